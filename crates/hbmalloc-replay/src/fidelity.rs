//! Fidelity: does policy `pytorch` make the recorded allocator's decisions?
//!
//! Replays a snapshot's requests with the snapshot's own configuration and
//! compares the sequence of segment events (kind and size, in order) with the
//! one PyTorch recorded.

use hbmalloc::{Action, PolicyConfig};
use hbmalloc_trace::{DeviceTrace, SegmentEventKind};
use serde::Serialize;

use crate::{Outcome, PreparedTrace, ReplayError, ReplayOptions};

/// Events shown before a divergence.
pub const CONTEXT_BEFORE: usize = 3;
/// Events shown after a divergence.
pub const CONTEXT_AFTER: usize = 4;

/// One segment event, recorded or replayed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SegmentEvent {
    /// `segment_alloc`, `segment_free`, `segment_map` or `segment_unmap`.
    pub action: &'static str,
    /// Bytes.
    pub size: u64,
    /// The index of the trace op it happened at.
    pub op_index: usize,
}

/// Where the two sequences first differ.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Divergence {
    /// Position in the sequences.
    pub index: usize,
    /// A few recorded events around it.
    pub recorded_context: Vec<SegmentEvent>,
    /// A few replayed events around it.
    pub replayed_context: Vec<SegmentEvent>,
}

/// The comparison for one device of one snapshot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FidelityReport {
    /// Device index.
    pub device: i64,
    /// The configuration replayed (the snapshot's own).
    pub config: String,
    /// Recorded segment events.
    pub recorded: usize,
    /// Replayed segment events.
    pub replayed: usize,
    /// Length of the common prefix (kind and size).
    pub matching_prefix: usize,
    /// `None` when the sequences are identical.
    pub first_divergence: Option<Divergence>,
    /// True when the source is a port of PyTorch's allocator (torch_npu):
    /// reported, not held to fidelity.
    pub foreign_allocator: bool,
    /// How the replay ended, when it did not complete.
    pub replay_note: Option<String>,
}

/// What a [`FidelityReport`] concludes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Every recorded segment event was reproduced, and nothing more.
    Exact,
    /// Neither the recorded allocator nor the replay made a segment event in
    /// the window: nothing was compared.
    NoEvents,
    /// The sequences differ from `matching_prefix` on.
    Diverges,
}

impl FidelityReport {
    /// True when every recorded event was reproduced and nothing more.
    pub fn exact(&self) -> bool {
        self.first_divergence.is_none()
    }

    /// Exact, diverging, or nothing to compare.
    pub fn verdict(&self) -> Verdict {
        match (&self.first_divergence, self.recorded) {
            (Some(_), _) => Verdict::Diverges,
            (None, 0) => Verdict::NoEvents,
            (None, _) => Verdict::Exact,
        }
    }
}

/// Why [`fidelity`] could not compare.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FidelityError {
    /// The trace records requests but not the allocator's segment events (a
    /// torch.profiler trace, an RMM log): there is nothing to compare with.
    NotASnapshot,
    /// The snapshot could not be replayed.
    Replay(ReplayError),
}

impl From<ReplayError> for FidelityError {
    fn from(e: ReplayError) -> Self {
        FidelityError::Replay(e)
    }
}

impl std::fmt::Display for FidelityError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FidelityError::NotASnapshot => f.write_str(
                "not a PyTorch memory snapshot: this trace records requests but not the \
                 allocator's segment events, so there is nothing to compare (fidelity reads \
                 the pickles torch.cuda.memory._dump_snapshot writes)",
            ),
            FidelityError::Replay(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for FidelityError {}

fn action_of(kind: SegmentEventKind) -> &'static str {
    kind.action()
}

fn replayed_action(action: Action) -> &'static str {
    action.name()
}

/// Replays `trace` under policy `pytorch` with its recorded configuration and
/// compares segment events. A trace that does not record the allocator's
/// segment events (a torch.profiler trace, an RMM log) is refused: there is
/// nothing to compare with.
pub fn fidelity(trace: &DeviceTrace) -> Result<FidelityReport, FidelityError> {
    if trace.recorded.is_none() {
        return Err(FidelityError::NotASnapshot);
    }
    let config = trace.recorded_config.clone().unwrap_or_default();
    let policy = PolicyConfig::parse("pytorch", &config).map_err(|e| ReplayError {
        op_index: None,
        message: format!("recorded configuration: {e}"),
    })?;
    let mut options = ReplayOptions::new(policy);
    options.emulate_recorded_ooms = true;
    options.record_history = true;
    options.use_recorded_addresses = true;
    let run = PreparedTrace::new(trace)?.run(&options)?;

    let recorded: Vec<SegmentEvent> = trace
        .recorded
        .iter()
        .flat_map(|r| r.segment_events.iter())
        .map(|e| SegmentEvent {
            action: action_of(e.kind),
            size: e.size,
            op_index: e.op_index,
        })
        .collect();
    let replayed: Vec<SegmentEvent> = run
        .segment_events
        .iter()
        .map(|(i, e)| SegmentEvent {
            action: replayed_action(e.action),
            size: e.size,
            op_index: *i,
        })
        .collect();
    let same = |a: &SegmentEvent, b: &SegmentEvent| a.action == b.action && a.size == b.size;
    let matching_prefix = recorded
        .iter()
        .zip(&replayed)
        .take_while(|(a, b)| same(a, b))
        .count();
    let first_divergence = if matching_prefix == recorded.len() && matching_prefix == replayed.len()
    {
        None
    } else {
        let window = |events: &[SegmentEvent]| {
            let start = matching_prefix.saturating_sub(CONTEXT_BEFORE);
            events
                .iter()
                .skip(start)
                .take(CONTEXT_BEFORE + CONTEXT_AFTER + 1)
                .cloned()
                .collect()
        };
        Some(Divergence {
            index: matching_prefix,
            recorded_context: window(&recorded),
            replayed_context: window(&replayed),
        })
    };
    let replay_note = match &run.outcome {
        Outcome::Completed if run.unreproduced_ooms > 0 => Some(format!(
            "{} recorded out-of-memory request(s) succeeded in replay",
            run.unreproduced_ooms
        )),
        Outcome::Completed => None,
        Outcome::OutOfMemory { op_index, .. } => {
            Some(format!("replay ran out of memory at op {op_index}"))
        }
    };
    Ok(FidelityReport {
        device: trace.device,
        config,
        recorded: recorded.len(),
        replayed: replayed.len(),
        matching_prefix,
        first_divergence,
        foreign_allocator: trace.foreign_allocator,
        replay_note,
    })
}

#[cfg(test)]
mod tests {
    use hbmalloc_trace::{DeviceTrace, Op, Recorded, RecordedSegmentEvent, SegmentEventKind};

    use super::*;

    #[test]
    fn a_trace_without_recorded_decisions_is_not_a_snapshot() {
        let trace = DeviceTrace::default();
        assert_eq!(fidelity(&trace), Err(FidelityError::NotASnapshot));
    }

    #[test]
    fn a_window_without_segment_events_compares_nothing() {
        let trace = DeviceTrace {
            recorded: Some(Recorded::default()),
            ..DeviceTrace::default()
        };
        let report = fidelity(&trace).unwrap();
        assert_eq!(report.verdict(), Verdict::NoEvents);
    }

    const MIB: u64 = 1 << 20;

    /// `requests` requests of 64 MiB, each a `cudaMalloc` of its own under
    /// `pytorch`, and a recorded out-of-memory error; the recorded allocator
    /// made the `recorded` segments (MiB) at ops 0, 1, ...
    fn snapshot_of(requests: u64, recorded: &[u64]) -> DeviceTrace {
        let alloc = |id| Op::Alloc {
            id,
            size: 64 * MIB,
            stream: 0,
        };
        let event = |(op_index, &mib): (usize, &u64)| RecordedSegmentEvent {
            kind: SegmentEventKind::Alloc,
            size: mib * MIB,
            stream: 0,
            address: 0,
            op_index,
        };
        DeviceTrace {
            ops: (1..=requests)
                .map(alloc)
                .chain([Op::Oom {
                    size: MIB,
                    stream: 0,
                    device_free: 0,
                }])
                .collect(),
            recorded: Some(Recorded {
                segment_events: recorded.iter().enumerate().map(event).collect(),
                ..Recorded::default()
            }),
            ..DeviceTrace::default()
        }
    }

    #[test]
    fn the_replay_is_compared_with_the_recorded_segments_in_order() {
        let same = fidelity(&snapshot_of(4, &[64, 64, 64, 64])).unwrap();
        assert!(same.exact());
        assert_eq!(same.verdict(), Verdict::Exact);
        assert_eq!(
            (same.recorded, same.replayed, same.matching_prefix),
            (4, 4, 4)
        );
        // The recorded out-of-memory error happened again (the device said
        // it had no memory free); where it said it had, the note says so.
        assert_eq!(same.replay_note, None);
        let mut roomy = snapshot_of(4, &[64, 64, 64, 64]);
        roomy.ops[4] = Op::Oom {
            size: MIB,
            stream: 0,
            device_free: 1 << 30,
        };
        assert_eq!(
            fidelity(&roomy).unwrap().replay_note.as_deref(),
            Some("1 recorded out-of-memory request(s) succeeded in replay")
        );
        // A third segment of another size: the sequences part there, shown
        // with what came before and after.
        let other = fidelity(&snapshot_of(4, &[64, 64, 66, 64])).unwrap();
        assert!(!other.exact());
        assert_eq!(other.verdict(), Verdict::Diverges);
        let divergence = other.first_divergence.unwrap();
        assert_eq!((other.matching_prefix, divergence.index), (2, 2));
        let sizes = |events: &[SegmentEvent]| -> Vec<(usize, u64)> {
            events.iter().map(|e| (e.op_index, e.size / MIB)).collect()
        };
        assert_eq!(
            sizes(&divergence.recorded_context),
            [(0, 64), (1, 64), (2, 66), (3, 64)]
        );
        assert_eq!(
            sizes(&divergence.replayed_context),
            [(0, 64), (1, 64), (2, 64), (3, 64)]
        );
        assert!(divergence
            .recorded_context
            .iter()
            .all(|e| e.action == "segment_alloc"));
        // A long record is shown around where it parts: 3 events before
        // it, that one and 4 after.
        let mut long = vec![64; 12];
        long[6] = 66;
        let divergence = fidelity(&snapshot_of(12, &long))
            .unwrap()
            .first_divergence
            .unwrap();
        let ops: Vec<usize> = divergence
            .recorded_context
            .iter()
            .map(|e| e.op_index)
            .collect();
        assert_eq!(ops, [3, 4, 5, 6, 7, 8, 9, 10]);
        assert_eq!(divergence.replayed_context.len(), 8);
        // Fewer recorded than replayed: they part where the record ends.
        let fewer = fidelity(&snapshot_of(4, &[64, 64, 64])).unwrap();
        assert_eq!(fewer.verdict(), Verdict::Diverges);
        assert_eq!(fewer.first_divergence.unwrap().index, 3);
    }
}

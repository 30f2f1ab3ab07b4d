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

impl FidelityReport {
    /// True when every recorded event was reproduced and nothing more.
    pub fn exact(&self) -> bool {
        self.first_divergence.is_none()
    }
}

fn action_of(kind: SegmentEventKind) -> &'static str {
    kind.action()
}

fn replayed_action(action: Action) -> &'static str {
    action.name()
}

/// Replays `trace` under policy `pytorch` with its recorded configuration and
/// compares segment events.
pub fn fidelity(trace: &DeviceTrace) -> Result<FidelityReport, ReplayError> {
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

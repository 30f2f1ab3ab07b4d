//! The metrics of DESIGN.md for one trace on one device under one policy.

use std::collections::BTreeMap;

use hbmalloc::{
    BlockState, CallCounts, CallKind, LatencyModel, PolicyConfig, SegmentSnapshot, SimConfig,
    Snapshot,
};
use hbmalloc_trace::{DeviceTrace, InitialBlockState, Op};
use serde::Serialize;

use crate::{
    drift_within_reach, growth_floor, steady_state_growth_floor, Outcome, PreparedTrace,
    ReplayError, ReplayOptions, UNBOUNDED_CAPACITY_BYTES,
};

/// Bisection resolution for `min_capacity_bytes`: one device granule.
pub const MIN_CAPACITY_RESOLUTION_BYTES: u64 = 2 << 20;

/// The granule of the simulated device every replay runs on: what memory
/// is held in, for the offline plan and the drift floor alike.
pub(crate) fn device_granule() -> u64 {
    SimConfig::default()
        .granularity
        .unwrap_or(MIN_CAPACITY_RESOLUTION_BYTES)
}

/// Simulated nanoseconds as seconds, as every `*_seconds` metric reports them.
fn seconds(ns: u64) -> f64 {
    ns as f64 / 1e9
}

/// What to measure.
#[derive(Clone, Debug)]
pub struct EvalOptions {
    /// The policy and its configuration.
    pub policy: PolicyConfig,
    /// Device capacity for the main run (`None`: unbounded).
    pub capacity_bytes: Option<u64>,
    /// Bisect for the smallest capacity on which the trace completes.
    pub find_min_capacity: bool,
    /// Reproduce the out-of-memory errors the trace recorded (the device
    /// reports the free memory it reported then) and report them.
    pub reproduce_recorded_ooms: bool,
    /// A what-if: the simulated driver maps part of a physical handle (see
    /// [`ReplayOptions::maps_handle_parts`]).
    pub maps_handle_parts: bool,
    /// What each driver call costs (default: measured on an H100).
    pub latency: LatencyModel,
    /// The simulated driver hands out the recorded allocator's segment
    /// addresses while the replay asks for the same sizes (see
    /// [`ReplayOptions::use_recorded_addresses`]): best-fit ties between
    /// equal blocks then break as they did for real.
    pub use_recorded_addresses: bool,
}

impl EvalOptions {
    /// Measure `policy` on an unbounded device that behaves like a real
    /// one: whole-handle maps, measured latencies, recorded addresses; no
    /// bisection for the smallest device.
    pub fn new(policy: PolicyConfig) -> Self {
        EvalOptions {
            policy,
            capacity_bytes: None,
            find_min_capacity: false,
            reproduce_recorded_ooms: false,
            maps_handle_parts: false,
            latency: LatencyModel::h100(),
            use_recorded_addresses: true,
        }
    }

    /// The options of the main replay: this policy and capacity, and the
    /// recorded out-of-memory errors reproduced if asked.
    fn replay_options(&self) -> ReplayOptions {
        let mut replay = ReplayOptions::new(self.policy.clone());
        replay.capacity_bytes = self.capacity_bytes.unwrap_or(UNBOUNDED_CAPACITY_BYTES);
        replay.emulate_recorded_ooms = self.reproduce_recorded_ooms;
        replay.maps_handle_parts = self.maps_handle_parts;
        replay.latency = self.latency.clone();
        replay.use_recorded_addresses = self.use_recorded_addresses;
        replay
    }
}

/// What the recorded allocator did, where the trace says.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct RecordedMetrics {
    /// Its peak reserved bytes during the window.
    pub peak_reserved_bytes: Option<u64>,
    /// Its segment events (alloc, free, map, unmap) in the window.
    pub segment_events: usize,
}

/// One row of results: a trace's device under a policy. Names as in DESIGN.md.
#[derive(Clone, Debug, Serialize)]
pub struct Metrics {
    /// The trace's source.
    pub trace: String,
    /// Device index in the trace.
    pub device: i64,
    /// Policy and configuration (`policy:pytorch,expandable_segments:True`).
    pub settings: String,
    /// Mallocs plus frees replayed.
    pub ops: u64,
    /// Steps the trace marks ([`DeviceTrace::step_starts`]; 0: unknown).
    pub steps: usize,
    /// Max over time of the sum of live requested sizes: the physical floor.
    pub peak_live_bytes: u64,
    /// Max over time of device memory held (segments plus physical memory).
    pub peak_reserved_bytes: u64,
    /// `peak_live_bytes / peak_reserved_bytes`; `None` (JSON `null`) when
    /// the replay ran out of memory: the peak live memory of the whole trace
    /// over the reserved memory of the part that ran means nothing.
    pub efficiency: Option<f64>,
    /// The same over the first half of the ops alone (peak live over peak
    /// reserved, both up to the middle op): `efficiency` well below it is
    /// drift, a cache that holds more the longer it runs. `None` when the
    /// replay stopped before the middle.
    pub efficiency_at_half: Option<f64>,
    /// Whether any allocator that holds memory in whole granules can meet
    /// the efficiency target with `efficiency` within
    /// [`DRIFT_TOLERANCE`](crate::DRIFT_TOLERANCE) of `efficiency_at_half`
    /// ([`drift_within_reach`]): false on a small heap whose live memory
    /// rises in the second half by a share no two granule counts match.
    /// The same for every policy.
    pub drift_within_reach: bool,
    /// `peak_reserved_bytes - peak_live_bytes`; `None` as for `efficiency`.
    pub waste_bytes: Option<u64>,
    /// Smallest capacity on which the whole trace runs without running out of memory.
    pub min_capacity_bytes: Option<u64>,
    /// Resolution of `min_capacity_bytes`.
    pub min_capacity_resolution_bytes: u64,
    /// Driver calls by kind (only kinds that were called).
    pub device_calls: BTreeMap<String, u64>,
    /// Calls that allocate, free, map or unmap memory.
    pub memory_device_calls: u64,
    /// Fraction of mallocs served without any driver call.
    pub cache_hit_rate: f64,
    /// Memory-moving driver calls in the second half of the trace; `None`
    /// (JSON `null`) when the replay ran out of memory before it.
    pub steady_state_device_calls: Option<u64>,
    /// Driver calls in the second half of the trace, by kind (only kinds that
    /// were called): what the steady-state calls are made of; `None` as for
    /// `steady_state_device_calls`.
    pub steady_state_calls_by_kind: Option<BTreeMap<String, u64>>,
    /// What the second half's driver calls cost under the latency model:
    /// the steady state's driver time, where calls of different kinds and
    /// sizes cost different amounts (a map a tenth of an access grant);
    /// `None` as for `steady_state_device_calls`.
    pub steady_state_driver_seconds: Option<f64>,
    /// The fewest times any allocator of whole granules (the device's) must
    /// get new memory in the second half of the trace if it meets the
    /// efficiency target wherever the trace might have ended
    /// ([`steady_state_growth_floor`]): each is one driver call at least
    /// (`cudaMalloc`), two through the virtual-memory API (create and map).
    /// The same for every policy.
    pub steady_state_growth_floor: u64,
    /// Driver time under the latency model.
    pub simulated_driver_seconds: f64,
    /// `simulated_driver_seconds` by kind of call (only kinds that were
    /// called): where the driver time goes.
    pub simulated_driver_seconds_by_kind: BTreeMap<String, f64>,
    /// The least driver time any allocator of whole granules that meets the
    /// efficiency target wherever the trace might have ended spends under the
    /// same latency model: [`growth_floor`] growths (a snapshot's restored
    /// state one of them) at the cheapest a growth can cost
    /// ([`LatencyModel::cheapest_growth_ns`]). The same for every policy.
    pub driver_time_floor_seconds: f64,
    /// Wall-clock time the recording spans ([`DeviceTrace::recorded_span_us`]),
    /// where the trace has timestamps.
    pub recorded_seconds: Option<f64>,
    /// `simulated_driver_seconds / recorded_seconds`: the share of the run
    /// the driver calls would take. `None` for memory recorded on a CPU
    /// (device -1), whose wall time says nothing of a GPU's.
    pub driver_time_fraction: Option<f64>,
    /// Allocator CPU time per malloc or free, measured in the replay loop.
    pub ns_per_op: f64,
    /// Ops in the trace (mallocs, frees and the rest): an out-of-memory
    /// replay stopped at op `out_of_memory_at_op` of these.
    pub trace_ops: usize,
    /// The index of the op that ran out of memory; `None` when the trace
    /// completed.
    pub out_of_memory_at_op: Option<usize>,
    /// `None` when the trace completed; otherwise the op that ran out of
    /// memory and the allocator's whole report (the numbers, the verdict,
    /// what would help). JSON: `"op N: "` and the report's first line.
    #[serde(serialize_with = "serialize_out_of_memory")]
    pub out_of_memory: Option<(usize, hbmalloc::OomReport)>,
    /// What the recorded allocator did, where the trace says.
    pub recorded: Option<RecordedMetrics>,
    /// The allocator's PyTorch-compatible statistics at the end of the main run.
    #[serde(skip)]
    pub final_stats: hbmalloc::DeviceStats,
    /// Recorded out-of-memory errors reproduced by the replay.
    #[serde(skip)]
    pub reproduced_ooms: Vec<ReproducedOom>,
}

/// A recorded out-of-memory error the replay reproduced.
#[derive(Clone, Debug)]
pub struct ReproducedOom {
    /// The op it was recorded at.
    pub op: usize,
    /// The allocator's report. Where the device's size is not known, its
    /// total is the least the device can have held: what the allocator
    /// reserved plus the free memory the trace recorded.
    pub report: hbmalloc::OomReport,
    /// Whether the device's size is known (a capacity was given): a trace
    /// records the free memory at an out-of-memory error, not the size.
    pub device_size_known: bool,
}

/// The max over time of the sum of live requested sizes, computed from the
/// trace alone (no allocator involved): the floor any policy is measured against.
pub fn peak_live_bytes(trace: &DeviceTrace) -> u64 {
    let mut peak = 0;
    walk_live_bytes(trace, |live| peak = peak.max(live));
    peak
}

/// The sum of live requested sizes after each op, from the trace alone:
/// `[i]` after `i` ops, `[0]` the window's initial state.
pub fn live_bytes_after_ops(trace: &DeviceTrace) -> Vec<u64> {
    let mut live = Vec::with_capacity(trace.ops.len() + 1);
    walk_live_bytes(trace, |bytes| live.push(bytes));
    live
}

/// Calls `visit` with the live requested bytes of the initial state, then
/// after each op.
fn walk_live_bytes(trace: &DeviceTrace, mut visit: impl FnMut(u64)) {
    let mut live = std::collections::HashMap::new();
    // Counted wide and reported saturated: a hostile trace's sizes may add
    // up past 2^64 (which no replay of it reaches).
    let mut current: u128 = 0;
    let saturated = |bytes: u128| u64::try_from(bytes).unwrap_or(u64::MAX);
    for seg in &trace.initial_segments {
        for b in &seg.blocks {
            if let InitialBlockState::Allocated(id) = b.state {
                live.insert(id, b.requested_size);
                current += u128::from(b.requested_size);
            }
        }
    }
    visit(saturated(current));
    for op in &trace.ops {
        match *op {
            Op::Alloc { id, size, .. } => {
                live.insert(id, size);
                current += u128::from(size);
            }
            Op::Free { id } => current -= u128::from(live.remove(&id).unwrap_or(0)),
            _ => {}
        }
        visit(saturated(current));
    }
}

/// Live and reserved memory after every op of one trace, for several
/// configurations side by side: where reserved memory parts from live
/// memory, and when (`hbmalloc compare --timeline`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Timeline {
    /// [`live_bytes_after_ops`]: the same for every configuration.
    pub live_bytes: Vec<u64>,
    /// Each configuration's settings and its reserved bytes after each op
    /// ([`RunResult::reserved_after_ops`](crate::RunResult::reserved_after_ops)):
    /// shorter than `live_bytes` when that replay ran out of memory.
    pub reserved_bytes: Vec<(String, Vec<u64>)>,
}

/// Replays `trace` once under each of `configurations` and keeps live and
/// reserved memory after every op. `find_min_capacity` is ignored.
pub fn timeline(
    trace: &DeviceTrace,
    configurations: &[EvalOptions],
) -> Result<Timeline, ReplayError> {
    let prepared = PreparedTrace::new(trace)?;
    let mut reserved_bytes = Vec::with_capacity(configurations.len());
    for options in configurations {
        let mut replay = options.replay_options();
        replay.latency = LatencyModel::zero();
        replay.record_reserved_after_ops = true;
        let run = prepared.run(&replay)?;
        reserved_bytes.push((options.policy.to_settings(), run.reserved_after_ops));
    }
    Ok(Timeline {
        live_bytes: live_bytes_after_ops(trace),
        reserved_bytes,
    })
}

/// What each op of one trace called the driver for, under one
/// configuration (`hbmalloc replay --calls-log`): which requests cost driver
/// time, and what they did with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallsLog {
    /// [`live_bytes_after_ops`].
    pub live_bytes: Vec<u64>,
    /// Reserved bytes after each op, `[i]` after `i` ops, up to the last op
    /// that ran ([`RunResult::reserved_after_ops`](crate::RunResult::reserved_after_ops)).
    pub reserved_bytes: Vec<u64>,
    /// Each op that called the driver: its index and the calls it made,
    /// with their simulated time under the configuration's latency model.
    pub ops: Vec<(usize, CallCounts)>,
}

/// Replays `trace` once under `options` and keeps what every op called.
/// `find_min_capacity` is ignored.
pub fn calls_log(trace: &DeviceTrace, options: &EvalOptions) -> Result<CallsLog, ReplayError> {
    let mut replay = options.replay_options();
    replay.record_reserved_after_ops = true;
    replay.record_calls_by_op = true;
    let run = PreparedTrace::new(trace)?.run(&replay)?;
    Ok(CallsLog {
        live_bytes: live_bytes_after_ops(trace),
        reserved_bytes: run.reserved_after_ops,
        ops: run.calls_by_op,
    })
}

/// `Metrics::out_of_memory` in JSON: `"op N: "` and the report's first
/// line (what was asked), or `null`.
fn serialize_out_of_memory<S: serde::Serializer>(
    out_of_memory: &Option<(usize, hbmalloc::OomReport)>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    match out_of_memory {
        None => serializer.serialize_none(),
        Some((op_index, report)) => serializer.collect_str(&format_args!(
            "op {op_index}: {}",
            report.render().lines().next().unwrap_or("")
        )),
    }
}

/// Replays `trace` under `options` and measures everything.
pub fn evaluate(
    source: &str,
    trace: &DeviceTrace,
    options: &EvalOptions,
) -> Result<Metrics, ReplayError> {
    let prepared = PreparedTrace::new(trace)?;
    let replay = options.replay_options();
    let run = prepared.run(&replay)?;

    let live = live_bytes_after_ops(trace);
    // The floors speak of allocators that hold the replay device's granules.
    let granule = device_granule();
    let peak_live = live.iter().copied().max().unwrap_or(0);
    // `live[i]` is after `i` ops: the first half is `live[..=half]`.
    let half = prepared.len() / 2;
    let peak_live_at_half = live[..=half].iter().copied().max().unwrap_or(0);
    let out_of_memory = match &run.outcome {
        Outcome::Completed => None,
        Outcome::OutOfMemory { op_index, report } => Some((*op_index, (**report).clone())),
    };
    let min_capacity = if options.find_min_capacity {
        min_capacity_bytes(&prepared, &replay, peak_live, run.peak_reserved_bytes)?
    } else {
        None
    };
    let ops = run.mallocs + run.frees;
    let recorded_seconds = trace.recorded_span_us.map(|us| us as f64 / 1e6);
    let completed = out_of_memory.is_none();
    // A figure per kind of call, for the kinds that were called.
    fn per_kind<T>(
        calls: &hbmalloc::CallCounts,
        figure: impl Fn(CallKind) -> T,
    ) -> BTreeMap<String, T> {
        CallKind::ALL
            .iter()
            .filter(|&&k| calls.get(k) > 0)
            .map(|&k| (k.name().to_string(), figure(k)))
            .collect()
    }
    let by_kind = |calls: &hbmalloc::CallCounts| per_kind(calls, |k| calls.get(k));
    Ok(Metrics {
        trace: source.to_string(),
        device: trace.device,
        settings: options.policy.to_settings(),
        ops,
        steps: trace.step_starts.len(),
        peak_live_bytes: peak_live,
        peak_reserved_bytes: run.peak_reserved_bytes,
        efficiency: completed.then(|| ratio(peak_live, run.peak_reserved_bytes)),
        efficiency_at_half: run
            .peak_reserved_at_half
            .map(|reserved| ratio(peak_live_at_half, reserved)),
        drift_within_reach: drift_within_reach(peak_live_at_half, peak_live, granule),
        waste_bytes: completed.then(|| run.peak_reserved_bytes.saturating_sub(peak_live)),
        min_capacity_bytes: min_capacity,
        min_capacity_resolution_bytes: MIN_CAPACITY_RESOLUTION_BYTES,
        device_calls: by_kind(&run.calls),
        memory_device_calls: run.calls.memory_calls(),
        cache_hit_rate: ratio(run.cache_hits, run.mallocs),
        steady_state_device_calls: run.steady_state_calls.as_ref().map(|c| c.memory_calls()),
        steady_state_calls_by_kind: run.steady_state_calls.as_ref().map(by_kind),
        steady_state_driver_seconds: run
            .steady_state_calls
            .as_ref()
            .map(|c| seconds(c.simulated_ns())),
        steady_state_growth_floor: steady_state_growth_floor(&live, granule),
        simulated_driver_seconds: seconds(run.calls.simulated_ns()),
        simulated_driver_seconds_by_kind: per_kind(&run.calls, |k| {
            seconds(run.calls.simulated_ns_by_kind[k as usize])
        }),
        driver_time_floor_seconds: seconds(
            growth_floor(&live, granule) * options.latency.cheapest_growth_ns(),
        ),
        recorded_seconds,
        driver_time_fraction: recorded_seconds
            .filter(|&s| s > 0.0 && trace.device >= 0)
            .map(|s| seconds(run.calls.simulated_ns()) / s),
        ns_per_op: if ops == 0 {
            0.0
        } else {
            run.loop_ns as f64 / ops as f64
        },
        trace_ops: trace.ops.len(),
        out_of_memory_at_op: out_of_memory.as_ref().map(|(op, _)| *op),
        out_of_memory,
        recorded: trace.recorded.as_ref().map(|r| RecordedMetrics {
            peak_reserved_bytes: r.peak_reserved_bytes,
            segment_events: r.segment_events.len(),
        }),
        final_stats: run.final_stats,
        reproduced_ooms: run
            .reproduced_ooms
            .into_iter()
            .map(|(op, mut report)| {
                let device_size_known = options.capacity_bytes.is_some();
                if !device_size_known {
                    // The simulated device's size stands in for one the trace
                    // does not record: no figure may be read from it.
                    report.device_total_bytes = report
                        .reserved_bytes
                        .saturating_add(report.device_free_bytes);
                }
                ReproducedOom {
                    op,
                    report,
                    device_size_known,
                }
            })
            .collect(),
    })
}

/// When [`snapshot`] takes the allocator's snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SnapshotMoment {
    /// When reserved memory first reached its peak: what pytorch.org/memory_viz
    /// shows to explain `waste_bytes`.
    Peak,
    /// After this many ops (0: the window's initial state), to see how the
    /// allocator got there (`hbmalloc compare --timeline` says when).
    AfterOps(usize),
}

/// The allocator at a [`SnapshotMoment`] (or at its out-of-memory error, if
/// that came first), with its free memory summed up.
#[derive(Clone, Debug)]
pub struct ReplaySnapshot {
    /// Ops replayed when the snapshot was taken (when the replay ran out of
    /// memory, those before the op that failed).
    pub ops_replayed: usize,
    /// The op that ran out of memory, if one did.
    pub out_of_memory_op: Option<usize>,
    /// Ops in the trace.
    pub ops: usize,
    /// The snapshot, with the engine's history up to that moment.
    pub snapshot: Snapshot,
    /// Bytes the snapshot's segments hold.
    pub reserved_bytes: u64,
    /// Its segments (for virtual memory, contiguous mapped ranges): each
    /// has two edges, where part of a granule may lie free.
    pub segments: usize,
    /// Bytes of its active blocks (allocated or waiting for other streams).
    pub active_bytes: u64,
    /// Its free blocks: what `reserved_bytes` holds beyond the active
    /// blocks, and how scattered it is (many small ones: fragmentation).
    pub free_blocks: usize,
    /// Bytes of its free blocks.
    pub free_bytes: u64,
    /// The largest free block: the largest request it can serve without
    /// more memory.
    pub largest_free_block_bytes: u64,
    /// Its free bytes by what keeps them from serving requests.
    pub free_breakdown: FreeBreakdown,
    /// The replay's `peak_reserved_bytes` up to the snapshot: at the peak,
    /// above `reserved_bytes` only when the peak lasted less than one op
    /// (memory taken and given back within one malloc, as an out-of-memory
    /// retry does).
    pub peak_reserved_bytes: u64,
}

/// A snapshot's free memory by what keeps it from serving requests: where
/// `waste_bytes` lies at the peak. The three parts add up to the free
/// blocks' bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FreeBreakdown {
    /// Memory no live block pins: the whole granules inside the free blocks
    /// of virtual-memory segments, and plain segments with no active block.
    /// A miss can stitch it anywhere, or `empty_cache` give it back.
    pub idle_bytes: u64,
    /// The rest of the free blocks at the start or the end of a segment
    /// (for virtual memory, a contiguous mapped range): the free part of a
    /// granule (or of a plain segment) whose other part holds the live block
    /// beside it. Only requests small enough for that part can use it.
    pub segment_edge_bytes: u64,
    /// The rest of the free blocks between two active blocks: holes.
    pub between_blocks_bytes: u64,
}

impl FreeBreakdown {
    /// Classifies the free blocks of `snapshot`; `granule` is the device's
    /// virtual-memory granularity (whole granules of a virtual-memory
    /// segment are idle).
    pub fn of(snapshot: &Snapshot, granule: Option<u64>) -> Self {
        snapshot
            .segments
            .iter()
            .map(|segment| Self::of_segment(segment, granule))
            .fold(Self::default(), Self::plus)
    }

    /// Classifies the free blocks of one segment.
    pub fn of_segment(segment: &SegmentSnapshot, granule: Option<u64>) -> Self {
        Self::of_blocks(segment, granule).fold(Self::default(), Self::plus)
    }

    /// Each block of `segment` in address order, classified on its own (an
    /// active block has no free bytes): where a memory map colours it.
    pub fn of_blocks(
        segment: &SegmentSnapshot,
        granule: Option<u64>,
    ) -> impl Iterator<Item = Self> + '_ {
        let active = segment
            .blocks
            .iter()
            .any(|b| b.state != BlockState::Inactive);
        let last = segment.blocks.len().saturating_sub(1);
        segment.blocks.iter().enumerate().map(move |(i, block)| {
            if block.state != BlockState::Inactive {
                return Self::default();
            }
            let idle = match granule {
                _ if !active => block.size,
                Some(g) if segment.expandable => {
                    let first = block.address.div_ceil(g);
                    let end = (block.address + block.size) / g;
                    end.saturating_sub(first) * g
                }
                _ => 0,
            };
            let rest = block.size - idle;
            let edge = i == 0 || i == last;
            FreeBreakdown {
                idle_bytes: idle,
                segment_edge_bytes: if edge { rest } else { 0 },
                between_blocks_bytes: if edge { 0 } else { rest },
            }
        })
    }

    fn plus(self, other: Self) -> Self {
        FreeBreakdown {
            idle_bytes: self.idle_bytes + other.idle_bytes,
            segment_edge_bytes: self.segment_edge_bytes + other.segment_edge_bytes,
            between_blocks_bytes: self.between_blocks_bytes + other.between_blocks_bytes,
        }
    }
}

/// Replays `trace` under `options` up to `moment` and returns the
/// allocator's snapshot there. For the peak it replays twice: once to find
/// the op after which reserved memory first reached its peak, then up to
/// that op (the engine is deterministic: the second replay makes the same
/// decisions as the first). A replay that runs out of memory first is
/// snapshotted where it failed. `find_min_capacity` is ignored.
pub fn snapshot(
    trace: &DeviceTrace,
    options: &EvalOptions,
    moment: SnapshotMoment,
) -> Result<ReplaySnapshot, ReplayError> {
    let prepared = PreparedTrace::new(trace)?;
    let mut replay = options.replay_options();
    let after_ops = match moment {
        SnapshotMoment::Peak => {
            let first = prepared.run(&replay)?;
            match first.outcome {
                Outcome::Completed => first.ops_at_peak_reserved,
                // Asked to stop past the failing op, the replay keeps the
                // snapshot of the moment it failed.
                Outcome::OutOfMemory { op_index, .. } => op_index + 1,
            }
        }
        SnapshotMoment::AfterOps(n) if n > prepared.len() => {
            return Err(ReplayError {
                op_index: Some(n),
                message: format!(
                    "past the trace's end: it has {} ops, and a snapshot is taken after \
                     op 0 (the initial state) to {}",
                    prepared.len(),
                    prepared.len()
                ),
            })
        }
        SnapshotMoment::AfterOps(n) => n,
    };
    replay.snapshot_after_ops = Some(after_ops);
    replay.record_history = true;
    let run = prepared.run(&replay)?;
    let (ops_replayed, out_of_memory_op) = match run.outcome {
        Outcome::OutOfMemory { op_index, .. } => (op_index, Some(op_index)),
        Outcome::Completed => (after_ops, None),
    };
    let snapshot = run
        .snapshot
        .expect("a replay asked for a snapshot keeps one");
    let blocks = || snapshot.segments.iter().flat_map(|s| &s.blocks);
    let free = || blocks().filter(|b| b.state == BlockState::Inactive);
    Ok(ReplaySnapshot {
        ops_replayed,
        out_of_memory_op,
        ops: prepared.len(),
        reserved_bytes: snapshot.segments.iter().map(|s| s.total_size).sum(),
        segments: snapshot.segments.len(),
        active_bytes: snapshot.segments.iter().map(|s| s.active_size()).sum(),
        free_blocks: free().count(),
        free_bytes: free().map(|b| b.size).sum(),
        largest_free_block_bytes: free().map(|b| b.size).max().unwrap_or(0),
        free_breakdown: FreeBreakdown::of(&snapshot, SimConfig::default().granularity),
        snapshot,
        peak_reserved_bytes: run.peak_reserved_bytes,
    })
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        if a == 0 {
            1.0
        } else {
            0.0
        }
    } else {
        a as f64 / b as f64
    }
}

/// Bisects for the smallest capacity on which the trace completes. Policies
/// are not guaranteed monotone in capacity, so this is the smallest capacity
/// bisection finds, at [`MIN_CAPACITY_RESOLUTION_BYTES`].
fn min_capacity_bytes(
    prepared: &PreparedTrace,
    replay: &ReplayOptions,
    peak_live: u64,
    unbounded_peak_reserved: u64,
) -> Result<Option<u64>, ReplayError> {
    let completes = |capacity: u64| -> Result<bool, ReplayError> {
        // The main run's options at another capacity; no recorded
        // out-of-memory error reproduced: those are the recorded device's,
        // not this capacity's.
        let mut options = replay.clone();
        options.emulate_recorded_ooms = false;
        options.capacity_bytes = capacity;
        options.latency = LatencyModel::zero();
        Ok(prepared.run(&options)?.outcome == Outcome::Completed)
    };
    smallest_completing(
        peak_live,
        unbounded_peak_reserved,
        MIN_CAPACITY_RESOLUTION_BYTES,
        completes,
    )
}

/// The smallest multiple of `res` at which `completes` holds, found by
/// bisection: from `start` rounded up (where an unbounded replay peaked, so
/// it should complete; doubled up to six times while it does not, else
/// `None`) down to `peak_live` rounded down, below which nothing can. Each
/// probe is a whole replay, hence few: about log2 of the range over `res`.
fn smallest_completing<E>(
    peak_live: u64,
    start: u64,
    res: u64,
    mut completes: impl FnMut(u64) -> Result<bool, E>,
) -> Result<Option<u64>, E> {
    let mut hi = start.div_ceil(res).max(1) * res;
    let mut doublings = 0;
    while !completes(hi)? {
        doublings += 1;
        if doublings > 6 || hi >= UNBOUNDED_CAPACITY_BYTES {
            return Ok(None);
        }
        hi *= 2;
    }
    let mut lo = (peak_live / res) * res;
    if lo >= hi {
        return Ok(Some(hi));
    }
    if lo > 0 && completes(lo)? {
        return Ok(Some(lo));
    }
    while hi - lo > res {
        let mid = lo + ((hi - lo) / 2 / res).max(1) * res;
        if completes(mid)? {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok(Some(hi))
}

#[cfg(test)]
mod tests {
    use hbmalloc::BlockState;

    use super::*;

    const MIB: u64 = 1 << 20;

    /// An RMM log of (action, pointer, MiB) rows, a tenth of a second apart.
    fn rmm_trace(rows: &[(&str, u64, f64)]) -> DeviceTrace {
        let mut csv = String::from("Thread,Time,Action,Pointer,Size,Stream\n");
        for (i, &(action, ptr, mib)) in rows.iter().enumerate() {
            let size = (mib * MIB as f64) as u64 / 512 * 512;
            let (seconds, tenths) = ((i + 1) / 10, (i + 1) % 10);
            csv += &format!("1,10:00:{seconds:02}.{tenths},{action},{ptr:#x},{size},0x0\n");
        }
        let trace = hbmalloc_trace::parse_bytes("rows.csv", csv.as_bytes()).unwrap();
        trace.devices.into_iter().next().unwrap()
    }

    /// Live bytes past 2^64 (two absurd allocations of a hostile trace)
    /// read as 2^64 - 1, not an overflow, and come back down when freed.
    #[test]
    fn live_bytes_past_2_64_saturate() {
        let alloc = |id| Op::Alloc {
            id,
            size: 1 << 63,
            stream: 0,
        };
        let trace = DeviceTrace {
            ops: vec![alloc(0), alloc(1), Op::Free { id: 1 }],
            ..DeviceTrace::default()
        };
        assert_eq!(
            live_bytes_after_ops(&trace),
            vec![0, 1 << 63, u64::MAX, 1 << 63]
        );
        assert_eq!(peak_live_bytes(&trace), u64::MAX);
    }

    /// 64 MiB and 32 MiB allocated, both freed, then 16 MiB that the cache
    /// serves: reserved memory peaks after the second op and stays there.
    const PEAK_IN_THE_MIDDLE: [(&str, u64, f64); 5] = [
        ("allocate", 0x1000, 64.0),
        ("allocate", 0x2000, 32.0),
        ("free", 0x1000, 64.0),
        ("free", 0x2000, 32.0),
        ("allocate", 0x3000, 16.0),
    ];

    fn peak_in_the_middle() -> DeviceTrace {
        rmm_trace(&PEAK_IN_THE_MIDDLE)
    }

    fn options(settings: &str, capacity_bytes: Option<u64>) -> EvalOptions {
        EvalOptions {
            capacity_bytes,
            ..EvalOptions::new(PolicyConfig::from_settings(settings).unwrap())
        }
    }

    /// A segment at `address` of the given (state, size) blocks, in order.
    fn segment(
        address: u64,
        expandable: bool,
        blocks: &[(BlockState, u64)],
    ) -> hbmalloc::SegmentSnapshot {
        let mut at = address;
        let blocks = blocks
            .iter()
            .map(|&(state, size)| {
                let block = hbmalloc::BlockSnapshot {
                    address: at,
                    size,
                    requested_size: if state == BlockState::Inactive {
                        0
                    } else {
                        size
                    },
                    state,
                };
                at += size;
                block
            })
            .collect();
        hbmalloc::SegmentSnapshot {
            address,
            total_size: at - address,
            stream: hbmalloc::StreamId(0),
            small_pool: false,
            expandable,
            blocks,
        }
    }

    #[test]
    fn free_memory_is_split_into_idle_granules_segment_edges_and_holes() {
        use BlockState::{ActiveAllocated as Live, ActivePendingFree as Pending, Inactive as Free};
        let g = 2 * MIB;
        let snapshot = Snapshot {
            segments: vec![
                // A mapped range of 5 granules: a free front part, a hole
                // holding one whole granule, a free end part.
                segment(
                    8 * g,
                    true,
                    &[
                        (Free, MIB),
                        (Live, MIB + MIB / 2),
                        (Free, 4 * MIB),
                        (Pending, 2 * MIB + MIB / 2),
                        (Free, MIB),
                    ],
                ),
                // A plain segment in use: its free end is an edge, and its
                // whole granules are not idle (a segment is freed whole).
                segment(64 * g, false, &[(Live, MIB), (Free, 5 * MIB)]),
                // A plain segment with nothing active: idle.
                segment(80 * g, false, &[(Free, 20 * MIB)]),
            ],
            history: Vec::new(),
            settings: String::new(),
        };
        let breakdown = FreeBreakdown::of(&snapshot, Some(g));
        assert_eq!(
            breakdown,
            FreeBreakdown {
                // The hole [2.5, 6.5) MiB into the first range holds the
                // granule [4, 6) MiB.
                idle_bytes: 2 * MIB + 20 * MIB,
                segment_edge_bytes: MIB + MIB + 5 * MIB,
                between_blocks_bytes: 2 * MIB,
            }
        );
        let free: u64 = snapshot
            .segments
            .iter()
            .flat_map(|s| &s.blocks)
            .filter(|b| b.state == Free)
            .map(|b| b.size)
            .sum();
        assert_eq!(
            breakdown.idle_bytes + breakdown.segment_edge_bytes + breakdown.between_blocks_bytes,
            free
        );
        // Without a granularity no part of a segment in use is idle.
        let plain = FreeBreakdown::of(&snapshot, None);
        assert_eq!(plain.idle_bytes, 20 * MIB);
        assert_eq!(plain.between_blocks_bytes, 4 * MIB);
    }

    #[test]
    fn only_mallocs_and_frees_that_allocate_nothing_are_timed_as_cache_hits() {
        // Two empty tensors made and dropped at the end: the allocator is
        // not called for them, so they are no hits.
        let empty = [
            ("allocate", 0x4000, 0.0),
            ("allocate", 0x5000, 0.0),
            ("free", 0x4000, 0.0),
            ("free", 0x5000, 0.0),
        ];
        let trace = rmm_trace(&[&PEAK_IN_THE_MIDDLE[..], &empty].concat());
        for settings in ["policy:pytorch", "policy:hbm"] {
            let mut replay = options(settings, None).replay_options();
            let untimed = PreparedTrace::new(&trace).unwrap().run(&replay).unwrap();
            assert_eq!((untimed.hit_ops, untimed.hit_ns), (0, 0), "{settings}");
            replay.time_cache_hits = true;
            let run = PreparedTrace::new(&trace).unwrap().run(&replay).unwrap();
            // The two first mallocs call the driver; both frees and the
            // 16 MiB malloc are served by the cache.
            assert_eq!((run.mallocs, run.frees), (3, 2), "{settings}");
            assert_eq!(run.hit_ops, 3, "{settings}");
            assert!(run.hit_ns > 0 && run.hit_ns <= run.loop_ns, "{settings}");
            // Which ops they were, for a later replay to time those alone.
            let hits = run.cache_hit_ops.iter().filter(|&&hit| hit).count();
            assert_eq!(hits, 3, "{settings}");
            replay.known_cache_hits = Some(run.cache_hit_ops.clone().into());
            let again = PreparedTrace::new(&trace).unwrap().run(&replay).unwrap();
            assert_eq!(again.hit_ops, 3, "{settings}");
            assert!(again.cache_hit_ops.is_empty(), "{settings}");
            // An op that calls the driver, named a hit: the replays differ.
            let first_miss = run.cache_hit_ops.iter().position(|&hit| !hit).unwrap();
            let mut wrong = run.cache_hit_ops.clone();
            wrong[first_miss] = true;
            replay.known_cache_hits = Some(wrong.into());
            let failed = PreparedTrace::new(&trace)
                .unwrap()
                .run(&replay)
                .unwrap_err();
            assert_eq!(failed.op_index, Some(first_miss), "{settings}");
        }
    }

    #[test]
    fn the_peak_snapshot_says_where_its_free_memory_lies() {
        let trace = peak_in_the_middle();
        for settings in ["policy:pytorch", "policy:hbm"] {
            let peak = snapshot(&trace, &options(settings, None), SnapshotMoment::Peak).unwrap();
            let free = peak.free_breakdown;
            assert_eq!(peak.segments, peak.snapshot.segments.len(), "{settings}");
            assert!(peak.segments >= 1, "{settings}");
            assert_eq!(
                free.idle_bytes + free.segment_edge_bytes + free.between_blocks_bytes,
                peak.free_bytes,
                "{settings}"
            );
        }
    }

    fn allocated(snapshot: &Snapshot) -> Vec<u64> {
        let mut sizes: Vec<u64> = snapshot
            .segments
            .iter()
            .flat_map(|s| &s.blocks)
            .filter(|b| b.state == BlockState::ActiveAllocated)
            .map(|b| b.size)
            .collect();
        sizes.sort_unstable();
        sizes
    }

    #[test]
    fn the_snapshot_is_taken_when_reserved_memory_first_peaks() {
        let trace = peak_in_the_middle();
        for settings in ["policy:pytorch", "policy:hbm"] {
            let peak = snapshot(&trace, &options(settings, None), SnapshotMoment::Peak).unwrap();
            assert_eq!(peak.ops, 5, "{settings}");
            assert_eq!(peak.ops_replayed, 2, "{settings}");
            assert_eq!(peak.out_of_memory_op, None, "{settings}");
            assert_eq!(peak.reserved_bytes, peak.peak_reserved_bytes, "{settings}");
            assert!(peak.reserved_bytes >= 96 * MIB, "{settings}");
            assert_eq!(
                allocated(&peak.snapshot),
                [32 * MIB, 64 * MIB],
                "{settings}"
            );
            assert_eq!(peak.active_bytes, 96 * MIB, "{settings}");
            assert_eq!(
                peak.active_bytes + peak.free_bytes,
                peak.reserved_bytes,
                "{settings}"
            );
            assert!(
                peak.largest_free_block_bytes <= peak.free_bytes,
                "{settings}"
            );
            // The history up to that moment, for memory_viz's timeline.
            assert!(
                peak.snapshot
                    .history
                    .iter()
                    .filter(|e| e.action == hbmalloc::Action::Alloc)
                    .count()
                    == 2,
                "{settings}: {:?}",
                peak.snapshot.history
            );
        }
    }

    #[test]
    fn a_snapshot_after_an_op_shows_the_allocator_then() {
        let trace = peak_in_the_middle();
        for settings in ["policy:pytorch", "policy:hbm"] {
            let options = options(settings, None);
            // After the first free: the 32 MiB block alone is live.
            let taken = snapshot(&trace, &options, SnapshotMoment::AfterOps(3)).unwrap();
            assert_eq!(taken.ops_replayed, 3, "{settings}");
            assert_eq!(taken.out_of_memory_op, None, "{settings}");
            assert_eq!(allocated(&taken.snapshot), [32 * MIB], "{settings}");
            // The initial state, and after the last op.
            let first = snapshot(&trace, &options, SnapshotMoment::AfterOps(0)).unwrap();
            assert!(allocated(&first.snapshot).is_empty(), "{settings}");
            let last = snapshot(&trace, &options, SnapshotMoment::AfterOps(5)).unwrap();
            assert_eq!(allocated(&last.snapshot), [16 * MIB], "{settings}");
            // Past the end: refused, naming the trace's length.
            let past = snapshot(&trace, &options, SnapshotMoment::AfterOps(6)).unwrap_err();
            assert_eq!(past.op_index, Some(6), "{settings}");
            assert!(past.message.contains("it has 5 ops"), "{past}");
            // Out of memory before the op asked for: snapshotted there.
            let small = self::options(settings, Some(80 * MIB));
            let failed = snapshot(&trace, &small, SnapshotMoment::AfterOps(4)).unwrap();
            assert_eq!(failed.out_of_memory_op, Some(1), "{settings}");
            assert_eq!(allocated(&failed.snapshot), [64 * MIB], "{settings}");
        }
    }

    #[test]
    fn the_timeline_follows_live_and_reserved_memory_op_by_op() {
        let trace = peak_in_the_middle();
        let live = live_bytes_after_ops(&trace);
        assert_eq!(live, [0, 64 * MIB, 96 * MIB, 32 * MIB, 0, 16 * MIB]);
        assert_eq!(live.iter().max(), Some(&peak_live_bytes(&trace)));
        let configurations = [
            options("policy:pytorch", None),
            options("policy:hbm", None),
            options("policy:hbm", Some(80 * MIB)),
        ];
        let timeline = timeline(&trace, &configurations).unwrap();
        assert_eq!(timeline.live_bytes, live);
        let names: Vec<&str> = timeline
            .reserved_bytes
            .iter()
            .map(|(s, _)| s.as_str())
            .collect();
        assert_eq!(names, ["policy:pytorch", "policy:hbm", "policy:hbm"]);
        for (options, (settings, reserved)) in configurations.iter().zip(&timeline.reserved_bytes) {
            if options.capacity_bytes.is_some() {
                continue;
            }
            assert_eq!(reserved.len(), live.len(), "{settings}");
            assert_eq!(reserved[0], 0, "{settings}");
            // Never below live memory; its peak is the replay's, at the
            // live peak.
            for (op, (r, l)) in reserved.iter().zip(&live).enumerate() {
                assert!(r >= l, "{settings} op {op}: {r} < {l}");
            }
            let peak = evaluate("peak.csv", &trace, options)
                .unwrap()
                .peak_reserved_bytes;
            assert_eq!(reserved.iter().max(), Some(&peak), "{settings}");
            assert_eq!(reserved[2], peak, "{settings}");
        }
        // On 80 MiB the second allocation fails: the column stops before it.
        assert_eq!(timeline.reserved_bytes[2].1.len(), 2);
    }

    #[test]
    fn a_replay_that_runs_out_of_memory_before_the_second_half_has_no_steady_state() {
        let trace = peak_in_the_middle();
        for settings in ["policy:pytorch", "policy:hbm"] {
            // Out of memory at op 1 of 5: the second half starts at op 2.
            let failed = evaluate("peak.csv", &trace, &options(settings, Some(80 * MIB))).unwrap();
            assert!(failed.out_of_memory.is_some(), "{settings}");
            assert_eq!(failed.steady_state_device_calls, None, "{settings}");
            assert_eq!(failed.steady_state_calls_by_kind, None, "{settings}");
            assert_eq!(failed.steady_state_driver_seconds, None, "{settings}");
            let completed = evaluate("peak.csv", &trace, &options(settings, None)).unwrap();
            assert!(completed.steady_state_device_calls.is_some(), "{settings}");
        }
    }

    #[test]
    fn the_steady_state_driver_time_is_what_the_second_half_calls_cost() {
        // Four 64 MiB tensors kept: `pytorch` makes one `cudaMalloc` each,
        // two of them in the second half (ops 2 and 3).
        let trace = growing_trace();
        let m = evaluate("growing.csv", &trace, &options("policy:pytorch", None)).unwrap();
        let by_kind = m.steady_state_calls_by_kind.clone().unwrap();
        assert_eq!(by_kind.get("segment_alloc"), Some(&2), "{by_kind:?}");
        let one = LatencyModel::h100().of(CallKind::SegmentAlloc, 64 * MIB) as f64 / 1e9;
        let seconds = m.steady_state_driver_seconds.unwrap();
        assert!(
            (seconds - 2.0 * one).abs() < 1e-12,
            "{seconds} against {one}"
        );
        assert!(m.simulated_driver_seconds >= 4.0 * one - 1e-12);
        // Where the run's driver time went: the four mallocs, and what else
        // was called, adding up to the whole.
        let by_kind = &m.simulated_driver_seconds_by_kind;
        assert!(
            (by_kind["segment_alloc"] - 4.0 * one).abs() < 1e-12,
            "{by_kind:?}"
        );
        let total: f64 = by_kind.values().sum();
        assert!((total - m.simulated_driver_seconds).abs() < 1e-12);
    }

    #[test]
    fn the_calls_log_keeps_each_op_that_called_the_driver_and_no_other() {
        // `pytorch`: a `cudaMalloc` for each of the first two requests; the
        // frees and the third request are served from its cache.
        let trace = peak_in_the_middle();
        let log = calls_log(&trace, &options("policy:pytorch", None)).unwrap();
        let one = |bytes| {
            let mut calls = CallCounts::default();
            calls.by_kind[CallKind::SegmentAlloc as usize] = 1;
            calls.simulated_ns_by_kind[CallKind::SegmentAlloc as usize] =
                LatencyModel::h100().of(CallKind::SegmentAlloc, bytes);
            calls
        };
        assert_eq!(log.ops, vec![(0, one(64 * MIB)), (1, one(32 * MIB))]);
        assert_eq!(log.live_bytes, live_bytes_after_ops(&trace));
        assert_eq!(
            log.reserved_bytes,
            vec![0, 64 * MIB, 96 * MIB, 96 * MIB, 96 * MIB, 96 * MIB]
        );
    }

    /// A block that lives across another's free leaves a hole too small for
    /// the next request, in the first half; the second half's live peak is
    /// higher. Nine ops, 0.8 s recorded.
    fn fragmenting_trace() -> DeviceTrace {
        rmm_trace(&[
            ("allocate", 0x1000, 4.0),
            ("allocate", 0x2000, 4.0),
            ("free", 0x1000, 4.0),
            ("allocate", 0x3000, 15.0),
            ("free", 0x2000, 4.0),
            ("allocate", 0x4000, 1.0),
            ("free", 0x3000, 15.0),
            ("allocate", 0x5000, 30.0),
            ("free", 0x5000, 30.0),
        ])
    }

    #[test]
    fn each_metric_is_what_its_definition_says() {
        let trace = fragmenting_trace();
        let live = live_bytes_after_ops(&trace);
        for settings in [
            "policy:pytorch",
            "policy:pytorch,expandable_segments:True",
            "policy:hbm",
        ] {
            let opts = options(settings, None);
            let m = evaluate("rows.csv", &trace, &opts).unwrap();
            let log = calls_log(&trace, &opts).unwrap();
            let reserved = &log.reserved_bytes;
            assert_eq!((m.ops, m.trace_ops, m.device), (9, 9, 0), "{settings}");
            assert_eq!(m.peak_live_bytes, 31 * MIB, "{settings}");
            assert_eq!(Some(&m.peak_reserved_bytes), reserved.iter().max());
            let eff = m.peak_live_bytes as f64 / m.peak_reserved_bytes as f64;
            assert_eq!(m.efficiency, Some(eff), "{settings}");
            assert!(eff < 1.0, "{settings}: {eff}");
            let waste = m.peak_reserved_bytes - m.peak_live_bytes;
            assert_eq!(m.waste_bytes, Some(waste), "{settings}");
            // The first half: ops 0-3, its live peak 19 MiB (the 15 MiB
            // block and one 4 MiB block), what was held by then.
            let half_live = *live[..=4].iter().max().unwrap();
            assert_eq!(half_live, 19 * MIB);
            let half_reserved = *reserved[..=4].iter().max().unwrap();
            let at_half = half_live as f64 / half_reserved as f64;
            assert_eq!(m.efficiency_at_half, Some(at_half), "{settings}");
            // Every driver call, and those of the second half's ops.
            let memory = |calls: &CallCounts| calls.memory_calls();
            let all: u64 = log.ops.iter().map(|(_, c)| memory(c)).sum();
            let second: u64 = log
                .ops
                .iter()
                .filter(|(op, _)| *op >= 4)
                .map(|(_, c)| memory(c))
                .sum();
            assert_eq!(m.memory_device_calls, all, "{settings}");
            assert_eq!(m.steady_state_device_calls, Some(second), "{settings}");
            assert!(
                m.device_calls.values().all(|&n| n > 0),
                "{settings}: {:?}",
                m.device_calls
            );
            // The ops' calls, and before them the allocator's start: one
            // query of the device's memory (1 µs on the H100).
            let ns: u64 = log.ops.iter().map(|(_, c)| c.simulated_ns()).sum();
            let start = LatencyModel::h100().of(CallKind::MemoryInfo, 0);
            assert_eq!(
                m.simulated_driver_seconds,
                seconds(ns + start),
                "{settings}"
            );
            let hits = log
                .ops
                .iter()
                .filter(|(op, _)| matches!(trace.ops[*op], Op::Alloc { .. }))
                .count();
            assert_eq!(m.cache_hit_rate, (5 - hits) as f64 / 5.0, "{settings}");
            // 0.1 s to 0.9 s.
            let recorded = m.recorded_seconds.unwrap();
            assert!((recorded - 0.8).abs() < 1e-9, "{settings}: {recorded}");
            assert_eq!(
                m.driver_time_fraction,
                Some(m.simulated_driver_seconds / recorded),
                "{settings}"
            );
            assert!(m.ns_per_op > 0.0, "{settings}");
            // By the half 19 MiB live may hold 20 MiB (0.95 allows 20.0):
            // 31 MiB in the second half passes it once.
            assert_eq!(m.steady_state_growth_floor, 1, "{settings}");
        }
    }

    #[test]
    fn the_smallest_device_is_one_that_completes_above_one_that_does_not() {
        let trace = fragmenting_trace();
        for settings in ["policy:pytorch", "policy:hbm"] {
            let mut opts = options(settings, None);
            opts.find_min_capacity = true;
            let m = evaluate("rows.csv", &trace, &opts).unwrap();
            let min = m.min_capacity_bytes.unwrap();
            let res = m.min_capacity_resolution_bytes;
            assert_eq!(res, 2 * MIB);
            assert!(
                min % res == 0 && min >= m.peak_live_bytes,
                "{settings}: {min}"
            );
            assert!(
                min <= m.peak_reserved_bytes.next_multiple_of(res),
                "{settings}"
            );
            let runs = |capacity| {
                let at = evaluate("rows.csv", &trace, &options(settings, Some(capacity))).unwrap();
                at.out_of_memory.is_none()
            };
            assert!(runs(min), "{settings}: {min}");
            assert!(!runs(min - res), "{settings}: {min}");
        }
        // Blocks that fill whole granules need no more than their live peak.
        for settings in ["policy:pytorch", "policy:hbm"] {
            let mut opts = options(settings, None);
            opts.find_min_capacity = true;
            let m = evaluate("peak.csv", &peak_in_the_middle(), &opts).unwrap();
            assert_eq!(m.min_capacity_bytes, Some(96 * MIB), "{settings}");
        }
        // pytorch holds a 20 MiB segment for the first 4 MiB blocks, and a
        // second one for the 15 MiB block that fits in none of its holes:
        // more than live memory, found by bisection.
        let mut opts = options("policy:pytorch", None);
        opts.find_min_capacity = true;
        let m = evaluate("rows.csv", &trace, &opts).unwrap();
        assert!(
            m.min_capacity_bytes.unwrap() > 32 * MIB,
            "{:?}",
            m.min_capacity_bytes
        );
    }

    #[test]
    fn a_free_driver_costs_no_time() {
        let trace = fragmenting_trace();
        let mut free = options("policy:hbm", None);
        free.latency = LatencyModel::zero();
        let m = evaluate("rows.csv", &trace, &free).unwrap();
        assert!(m.memory_device_calls > 0);
        assert_eq!(m.simulated_driver_seconds, 0.0);
    }

    #[test]
    fn a_trace_that_asks_for_nothing_wastes_nothing() {
        // PyTorch never calls its allocator for an empty tensor.
        let m = evaluate(
            "rows.csv",
            &rmm_trace(&[("allocate", 0x1000, 0.0)]),
            &options("policy:hbm", None),
        )
        .unwrap();
        assert_eq!((m.ops, m.peak_live_bytes, m.peak_reserved_bytes), (0, 0, 0));
        assert_eq!((m.efficiency, m.cache_hit_rate), (Some(1.0), 1.0));
        assert_eq!((m.waste_bytes, m.ns_per_op), (Some(0), 0.0));
    }

    #[test]
    fn live_memory_counts_the_blocks_a_window_starts_with() {
        // A snapshot's window: a 20 MiB segment holding 6 MiB asked for in
        // an 8 MiB block, then a 4 MiB request and the block's free.
        let mut trace = rmm_trace(&[("allocate", 0x1000, 4.0)]);
        trace.ops.push(Op::Free { id: 7 });
        trace.initial_segments.push(hbmalloc_trace::InitialSegment {
            address: 0,
            stream: 0,
            small_pool: false,
            expandable: false,
            blocks: vec![
                hbmalloc_trace::InitialBlock {
                    size: 8 * MIB,
                    requested_size: 6 * MIB,
                    state: InitialBlockState::Allocated(7),
                },
                hbmalloc_trace::InitialBlock {
                    size: 12 * MIB,
                    requested_size: 0,
                    state: InitialBlockState::Free,
                },
            ],
        });
        assert_eq!(live_bytes_after_ops(&trace), [6 * MIB, 10 * MIB, 4 * MIB]);
        assert_eq!(peak_live_bytes(&trace), 10 * MIB);
    }

    #[test]
    fn driver_time_is_a_share_of_a_gpu_recording_that_spans_time() {
        let two_rows = [("allocate", 0x1000, 4.0), ("free", 0x1000, 4.0)];
        let m = evaluate(
            "rows.csv",
            &rmm_trace(&two_rows),
            &options("policy:hbm", None),
        )
        .unwrap();
        assert!(m.driver_time_fraction.is_some_and(|f| f > 0.0));
        // A recording that spans no time has no share of it.
        let mut instant = rmm_trace(&two_rows);
        instant.recorded_span_us = Some(0);
        let m = evaluate("rows.csv", &instant, &options("policy:hbm", None)).unwrap();
        assert_eq!(
            (m.recorded_seconds, m.driver_time_fraction),
            (Some(0.0), None)
        );
        // Host memory (device -1) is not driven through a GPU's driver.
        let mut host = rmm_trace(&two_rows);
        host.device = -1;
        let m = evaluate("rows.csv", &host, &options("policy:hbm", None)).unwrap();
        assert!(m.recorded_seconds.is_some() && m.driver_time_fraction.is_none());
    }

    /// [`smallest_completing`] on a device that completes from `threshold`
    /// bytes on: its answer and how many capacities it tried.
    fn search(peak_live: u64, start: u64, threshold: u64) -> (Option<u64>, u32) {
        let mut probes = 0;
        let found = smallest_completing(peak_live, start, 2 * MIB, |capacity| {
            probes += 1;
            Ok::<_, ()>(capacity >= threshold)
        })
        .unwrap();
        (found, probes)
    }

    #[test]
    fn bisection_finds_the_smallest_capacity_in_few_replays() {
        let g = 2 * MIB;
        for live in (0..=40).map(|tenth_gib| tenth_gib * 100 * MIB + 3 * MIB / 2) {
            for extra in [0, MIB, 5 * MIB, 64 * MIB, 900 * MIB] {
                let start = live + extra;
                for threshold in [live, live + extra / 2, start] {
                    let (found, probes) = search(live, start, threshold);
                    let expected = threshold.next_multiple_of(g).max(g);
                    assert_eq!(found, Some(expected), "{live} {start} {threshold}");
                    // The range's granules halved each probe, after the
                    // start and the live peak rounded down are tried.
                    let granules = start.div_ceil(g) - live / g;
                    let most = 2 + u64::BITS - granules.leading_zeros();
                    assert!(
                        probes <= most,
                        "{live} {start} {threshold}: {probes} > {most}"
                    );
                }
            }
        }
    }

    #[test]
    fn bisection_doubles_past_a_start_that_does_not_complete() {
        let g = 2 * MIB;
        // Completes from 3x the start: two doublings, then bisection down.
        assert_eq!(search(100 * MIB, 200 * MIB, 600 * MIB).0, Some(600 * MIB));
        // 64x is the last try: seven probes, then none.
        assert_eq!(search(10 * MIB, 10 * MIB, 640 * MIB).0, Some(640 * MIB));
        assert_eq!(search(10 * MIB, 10 * MIB, 640 * MIB + g), (None, 7));
        // No search past the largest device replays use.
        let huge = UNBOUNDED_CAPACITY_BYTES;
        assert_eq!(search(huge, huge, huge + g), (None, 1));
        // A live peak at or above the start: the start is the answer.
        assert_eq!(search(300 * MIB, 200 * MIB, 0), (Some(200 * MIB), 1));
        // A live peak that fills whole granules and completes: two probes.
        assert_eq!(search(96 * MIB, 200 * MIB, 96 * MIB), (Some(96 * MIB), 2));
    }

    #[test]
    fn drift_is_judged_in_the_simulated_devices_granules() {
        // 107.9 MiB live by the half and 111 MiB in all: no two counts of 2
        // MiB granules give efficiencies within the tolerance (`floor.rs`).
        let trace = rmm_trace(&[
            ("allocate", 0x1000, 107.9),
            ("free", 0x1000, 107.9),
            ("allocate", 0x2000, 111.0),
            ("free", 0x2000, 111.0),
        ]);
        let m = evaluate("rows.csv", &trace, &options("policy:hbm", None)).unwrap();
        assert_eq!(device_granule(), 2 * MIB);
        assert!(!m.drift_within_reach);
    }

    /// Four 64 MiB tensors allocated and kept.
    fn growing_trace() -> DeviceTrace {
        rmm_trace(&[0x1000, 0x2000, 0x3000, 0x4000].map(|ptr| ("allocate", ptr, 64.0)))
    }

    #[test]
    fn every_policy_grows_at_least_as_often_as_the_floor_says() {
        // Four 64 MiB tensors kept: the second half (ops 3 and 4) takes live
        // memory past anything an efficient allocator could hold before.
        let trace = growing_trace();
        for (settings, calls_per_growth) in [("policy:pytorch", 1), ("policy:hbm", 2)] {
            let m = evaluate("growing.csv", &trace, &options(settings, None)).unwrap();
            assert_eq!(m.steady_state_growth_floor, 2, "{settings}");
            let calls = m.steady_state_device_calls.unwrap();
            assert!(calls >= calls_per_growth * 2, "{settings}: {calls}");
            // Over the whole run all four allocations grow, each at least a
            // create, a map and an access grant (52 µs on the H100).
            let floor = m.driver_time_floor_seconds;
            assert!((floor - 4.0 * 52e-6).abs() < 1e-12, "{settings}: {floor}");
            assert!(
                m.simulated_driver_seconds >= m.driver_time_floor_seconds,
                "{settings}"
            );
        }
    }

    #[test]
    fn a_replay_that_runs_out_of_memory_is_snapshotted_where_it_failed() {
        let trace = peak_in_the_middle();
        for settings in ["policy:pytorch", "policy:hbm"] {
            let peak = snapshot(
                &trace,
                &options(settings, Some(80 * MIB)),
                SnapshotMoment::Peak,
            )
            .unwrap();
            assert_eq!(peak.out_of_memory_op, Some(1), "{settings}");
            assert_eq!(peak.ops_replayed, 1, "{settings}");
            assert_eq!(allocated(&peak.snapshot), [64 * MIB], "{settings}");
            assert!(peak.reserved_bytes <= 80 * MIB, "{settings}");
        }
    }
}

//! Replay: run a recorded trace through the real engine on a simulated GPU.
//!
//! Every policy decision here is made by `hbmalloc`'s own engine code on a
//! [`SimDevice`]; this crate only drives it op by op and measures. It knows the
//! trace model, not file formats (that is `hbmalloc-trace`), and not blocks or
//! segments (that is the engine).

mod fidelity;
mod floor;
mod metrics;
mod plan;

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use hbmalloc::{
    AllocError, Allocator, AllocatorConfig, BlockImage, CallCounts, DevicePtr, DeviceStats,
    LatencyModel, OomReport, PolicyConfig, SegmentImage, SimConfig, SimDevice, Snapshot, StreamId,
    ThreadSafeAllocator, TraceEntry,
};
use hbmalloc_trace::{AllocId, DeviceTrace, InitialBlockState, Op, SegmentEventKind};

pub use fidelity::{
    fidelity, Divergence, FidelityError, FidelityReport, SegmentEvent, Verdict, CONTEXT_AFTER,
    CONTEXT_BEFORE,
};
pub use floor::{drift_within_reach, growth_floor, steady_state_growth_floor, DRIFT_TOLERANCE};
pub use metrics::{
    calls_log, evaluate, live_bytes_after_ops, peak_live_bytes, snapshot, timeline, CallsLog,
    EvalOptions, FreeBreakdown, Metrics, RecordedMetrics, ReplaySnapshot, ReproducedOom,
    SnapshotMoment, Timeline, MIN_CAPACITY_RESOLUTION_BYTES,
};
pub use plan::{plan_greedy_by_size, plan_last_step, Plan, StepPlan, PLAN_BLOCK_ROUND};

/// Device capacity used when none is given: large enough for any trace we know
/// (1 TiB), so only the policy decides how much is reserved.
pub const UNBOUNDED_CAPACITY_BYTES: u64 = 1 << 40;

/// The largest device capacity a replay is given (1 PiB): what the CLI and
/// the Python package accept.
pub const MAX_CAPACITY_BYTES: u64 = 1 << 50;

/// How to replay.
#[derive(Clone, Debug)]
pub struct ReplayOptions {
    /// The policy and its configuration.
    pub policy: PolicyConfig,
    /// Simulated device capacity.
    pub capacity_bytes: u64,
    /// Latency charged per driver call (simulated time, never slept).
    pub latency: LatencyModel,
    /// A what-if: the simulated driver maps part of a physical handle
    /// (`Device::maps_handle_parts`). False, the default, maps whole handles
    /// only, as real drivers do.
    pub maps_handle_parts: bool,
    /// Reproduce the recorded allocator's out-of-memory failures (`Op::Oom`)
    /// by making the simulated device report the same free memory at that
    /// moment. Off: those requests are skipped.
    pub emulate_recorded_ooms: bool,
    /// Record the engine's history (needed for fidelity; costs time).
    pub record_history: bool,
    /// Hand out the recorded allocator's segment addresses while the replay
    /// asks for the same sizes, so best-fit ties between equal blocks break
    /// as they did for real (needed for fidelity).
    pub use_recorded_addresses: bool,
    /// Check the engine's invariants (`Allocator::check_invariants`) after
    /// every this many operations and after the last (0: never), and stop
    /// with an error naming the operation after which one failed. Each check
    /// walks the whole state: for tests.
    pub check_invariants_every: usize,
    /// Stop once this many ops have run (0: right after the window's initial
    /// state) and keep the allocator's [`Snapshot`] in
    /// [`RunResult::snapshot`]. A replay that runs out of memory first keeps
    /// the snapshot of the moment it failed.
    pub snapshot_after_ops: Option<usize>,
    /// Keep the reserved bytes after every op in
    /// [`RunResult::reserved_after_ops`] (8 bytes an op).
    pub record_reserved_after_ops: bool,
    /// Keep what each op called in [`RunResult::calls_by_op`] (a read of
    /// the device's counters around every op).
    pub record_calls_by_op: bool,
    /// Time each malloc and free that makes no driver allocation or free (a
    /// cache hit; an event may be recorded or queried) and
    /// keep the sum in [`RunResult::hit_ns`]: two clock reads an op, so
    /// [`RunResult::loop_ns`] is not comparable with a run without it.
    /// Which ops were hits is kept in [`RunResult::cache_hit_ops`].
    pub time_cache_hits: bool,
    /// With [`ReplayOptions::time_cache_hits`]: the cache hits of an earlier
    /// replay of the same trace and policy ([`RunResult::cache_hit_ops`]),
    /// timed alone and each run through `PreparedTrace::hit_step`, which is
    /// not inlined, so that a profiler counts the hits apart
    /// (`scripts/bench-instructions --hits`). The engine is deterministic:
    /// an op that is no hit this time is an error.
    pub known_cache_hits: Option<Arc<[bool]>>,
}

impl ReplayOptions {
    /// Options for `policy` on an unbounded device with realistic latencies.
    pub fn new(policy: PolicyConfig) -> Self {
        ReplayOptions {
            policy,
            capacity_bytes: UNBOUNDED_CAPACITY_BYTES,
            latency: LatencyModel::h100(),
            maps_handle_parts: false,
            emulate_recorded_ooms: false,
            record_history: false,
            use_recorded_addresses: false,
            check_invariants_every: 0,
            snapshot_after_ops: None,
            record_reserved_after_ops: false,
            record_calls_by_op: false,
            time_cache_hits: false,
            known_cache_hits: None,
        }
    }
}

/// A trace that cannot be replayed as written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayError {
    /// Index of the op (or `None` for the initial state).
    pub op_index: Option<usize>,
    /// What went wrong.
    pub message: String,
}

impl fmt::Display for ReplayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.op_index {
            Some(i) => write!(f, "op {i}: {}", self.message),
            None => write!(f, "initial state: {}", self.message),
        }
    }
}

impl std::error::Error for ReplayError {}

/// How a replay ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every op ran.
    Completed,
    /// The allocator ran out of memory at `op_index`.
    OutOfMemory {
        /// The op that failed.
        op_index: usize,
        /// The allocator's explanation.
        report: Box<OomReport>,
    },
}

/// What one replay observed.
#[derive(Clone, Debug)]
pub struct RunResult {
    /// How it ended.
    pub outcome: Outcome,
    /// Max bytes the device had handed out (segments plus physical memory).
    pub peak_reserved_bytes: u64,
    /// Driver calls over the whole replay (including the initial state).
    pub calls: CallCounts,
    /// Driver calls made during the second half of the ops; `None` when the
    /// replay stopped before it (out of memory, or a snapshot taken).
    pub steady_state_calls: Option<CallCounts>,
    /// [`RunResult::peak_reserved_bytes`] over the first half of the ops
    /// alone; `None` when the replay stopped before the second half.
    pub peak_reserved_at_half: Option<u64>,
    /// `malloc` calls made.
    pub mallocs: u64,
    /// `free` calls made.
    pub frees: u64,
    /// Mallocs served without any driver allocation or free.
    pub cache_hits: u64,
    /// Wall-clock nanoseconds spent in the op loop.
    pub loop_ns: u64,
    /// Mallocs and frees that made no driver allocation or free (served
    /// from or returned to the cache); counted only with
    /// [`ReplayOptions::time_cache_hits`].
    pub hit_ops: u64,
    /// Wall-clock nanoseconds those ops took, each timed on its own.
    pub hit_ns: u64,
    /// With [`ReplayOptions::time_cache_hits`] and no known hits: per op,
    /// whether it was a cache hit, for [`ReplayOptions::known_cache_hits`].
    pub cache_hit_ops: Vec<bool>,
    /// Segment events of the engine's history with the index of the op that
    /// caused them (only with `record_history`).
    pub segment_events: Vec<(usize, TraceEntry)>,
    /// Recorded out-of-memory requests that the replay served instead of failing
    /// (only with `emulate_recorded_ooms`).
    pub unreproduced_ooms: u64,
    /// The allocator's statistics when the replay ended (peaks included).
    pub final_stats: DeviceStats,
    /// Recorded out-of-memory requests the replay reproduced, with the
    /// allocator's report (only with `emulate_recorded_ooms`).
    pub reproduced_ooms: Vec<(usize, OomReport)>,
    /// Ops replayed when the allocator's reserved memory, read between ops,
    /// first reached its highest value (0: the window's initial state). Run
    /// again with [`ReplayOptions::snapshot_after_ops`] set to it to see the
    /// allocator at its peak.
    pub ops_at_peak_reserved: usize,
    /// The allocator as [`ReplayOptions::snapshot_after_ops`] asked.
    pub snapshot: Option<Snapshot>,
    /// With [`ReplayOptions::record_reserved_after_ops`]: the reserved bytes
    /// read between ops from the engine's counters, `[i]` after `i` ops
    /// (`[0]`: the window's initial state), up to the last op that ran
    /// (not the op that ran out of memory).
    pub reserved_after_ops: Vec<u64>,
    /// With [`ReplayOptions::record_calls_by_op`]: each op that called the
    /// driver, as (op index, the calls it made and their simulated time),
    /// in order, the op that ran out of memory included.
    pub calls_by_op: Vec<(usize, CallCounts)>,
}

/// A trace's ops with allocation ids renumbered densely, ready to replay many
/// times (the bisection for minimum capacity replays a trace a dozen times).
#[derive(Clone, Debug)]
pub struct PreparedTrace {
    ops: Vec<DenseOp>,
    initial: Vec<(SegmentImage, Vec<Option<usize>>)>,
    slots: usize,
    /// (size, address) of every segment the recorded allocator allocated, in
    /// order: the initial ones, then those of the window.
    recorded_segment_addresses: Vec<(u64, DevicePtr)>,
}

#[derive(Copy, Clone, Debug)]
enum DenseOp {
    Alloc {
        slot: usize,
        size: u64,
        stream: u64,
    },
    Free {
        slot: usize,
    },
    RecordStream {
        slot: usize,
        stream: u64,
    },
    StreamComplete {
        stream: u64,
    },
    EmptyCache,
    Oom {
        size: u64,
        stream: u64,
        device_free: u64,
    },
}

impl PreparedTrace {
    /// Checks the trace and renumbers its allocations. Errors name the op.
    pub fn new(trace: &DeviceTrace) -> Result<Self, ReplayError> {
        let mut slot_of = std::collections::HashMap::<AllocId, usize>::new();
        let mut live = Vec::<bool>::new();
        let new_slot =
            |id: AllocId,
             live: &mut Vec<bool>,
             slot_of: &mut std::collections::HashMap<AllocId, usize>| {
                let slot = live.len();
                live.push(true);
                slot_of.insert(id, slot);
                slot
            };
        let mut initial = Vec::new();
        let mut recorded_segment_addresses = Vec::new();
        for seg in &trace.initial_segments {
            if !seg.expandable {
                recorded_segment_addresses.push((seg.total_size(), seg.address));
            }
            let mut blocks = Vec::new();
            let mut slots = Vec::new();
            for b in &seg.blocks {
                let (allocated, slot) = match b.state {
                    InitialBlockState::Allocated(id) => {
                        (true, Some(new_slot(id, &mut live, &mut slot_of)))
                    }
                    InitialBlockState::Free => (false, None),
                };
                blocks.push(BlockImage {
                    size: b.size,
                    requested_size: b.requested_size,
                    allocated,
                });
                slots.push(slot);
            }
            let image = SegmentImage {
                stream: StreamId(seg.stream),
                small_pool: seg.small_pool,
                expandable: seg.expandable,
                blocks,
            };
            initial.push((image, slots));
        }
        let mut ops = Vec::with_capacity(trace.ops.len());
        for (i, op) in trace.ops.iter().enumerate() {
            let err = |message: String| ReplayError {
                op_index: Some(i),
                message,
            };
            let live_slot =
                |id: AllocId,
                 live: &Vec<bool>,
                 slot_of: &std::collections::HashMap<AllocId, usize>| {
                    match slot_of.get(&id) {
                        Some(&s) if live[s] => Ok(s),
                        _ => Err(err(format!("allocation {id} is not live"))),
                    }
                };
            ops.push(match *op {
                Op::Alloc { id, size, stream } => {
                    if let Some(&s) = slot_of.get(&id) {
                        if live[s] {
                            return Err(err(format!("allocation {id} allocated twice")));
                        }
                    }
                    DenseOp::Alloc {
                        slot: new_slot(id, &mut live, &mut slot_of),
                        size,
                        stream,
                    }
                }
                Op::Free { id } => {
                    let slot = live_slot(id, &live, &slot_of)?;
                    live[slot] = false;
                    DenseOp::Free { slot }
                }
                Op::RecordStream { id, stream } => DenseOp::RecordStream {
                    slot: live_slot(id, &live, &slot_of)?,
                    stream,
                },
                Op::StreamComplete { stream } => DenseOp::StreamComplete { stream },
                Op::EmptyCache => DenseOp::EmptyCache,
                Op::Oom {
                    size,
                    stream,
                    device_free,
                } => DenseOp::Oom {
                    size,
                    stream,
                    device_free,
                },
            });
        }
        if let Some(recorded) = &trace.recorded {
            recorded_segment_addresses.extend(
                recorded
                    .segment_events
                    .iter()
                    .filter(|e| e.kind == SegmentEventKind::Alloc)
                    .map(|e| (e.size, e.address)),
            );
        }
        Ok(PreparedTrace {
            ops,
            initial,
            slots: live.len(),
            recorded_segment_addresses,
        })
    }

    /// Number of ops.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// True when there are no ops.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Replays the trace once.
    pub fn run(&self, options: &ReplayOptions) -> Result<RunResult, ReplayError> {
        let device = SimDevice::with_config(SimConfig {
            capacity_bytes: options.capacity_bytes,
            latency: options.latency.clone(),
            maps_handle_parts: options.maps_handle_parts,
            ..SimConfig::default()
        });
        let config = AllocatorConfig {
            policy: options.policy.clone(),
            history_entries: if options.record_history { 1 << 24 } else { 0 },
        };
        let at_start = |message: String| ReplayError {
            op_index: None,
            message,
        };
        if options.use_recorded_addresses {
            device.plan_segment_addresses(self.recorded_segment_addresses.iter().copied());
        }
        let mut allocator = Allocator::new(device, config).map_err(|e| at_start(e.to_string()))?;
        let mut ptrs: Vec<DevicePtr> = vec![0; self.slots];
        let mut result = RunResult {
            outcome: Outcome::Completed,
            peak_reserved_bytes: 0,
            calls: CallCounts::default(),
            steady_state_calls: None,
            peak_reserved_at_half: None,
            mallocs: 0,
            frees: 0,
            cache_hits: 0,
            loop_ns: 0,
            hit_ops: 0,
            hit_ns: 0,
            cache_hit_ops: Vec::new(),
            segment_events: Vec::new(),
            unreproduced_ooms: 0,
            final_stats: DeviceStats::default(),
            reproduced_ooms: Vec::new(),
            ops_at_peak_reserved: 0,
            snapshot: None,
            reserved_after_ops: Vec::new(),
            calls_by_op: Vec::new(),
        };

        for (image, slots) in &self.initial {
            match allocator.restore_segment(image) {
                Ok(block_ptrs) => {
                    for (ptr, slot) in block_ptrs.iter().zip(slots) {
                        if let Some(s) = slot {
                            ptrs[*s] = *ptr;
                        }
                    }
                }
                Err(AllocError::OutOfMemory(report)) => {
                    result.outcome = Outcome::OutOfMemory {
                        op_index: 0,
                        report,
                    };
                    return Ok(finish(result, &allocator, None, options));
                }
                Err(e) => return Err(at_start(e.to_string())),
            }
        }
        let history_base = allocator.history().recorded();
        let mut history_seen = history_base;
        let half = self.ops.len() / 2;
        // The calls made before the second half of the trace; `None` until
        // the replay gets there.
        let mut calls_at_half = (half == 0).then(|| allocator.device().call_counts());
        if half == 0 {
            result.peak_reserved_at_half = Some(allocator.device().peak_used_bytes());
        }
        let mut peak_reserved_between_ops = reserved_now(&allocator);
        if options.record_reserved_after_ops {
            result.reserved_after_ops.reserve(self.ops.len() + 1);
            result
                .reserved_after_ops
                .push(peak_reserved_between_ops as u64);
        }
        let known_hits = options
            .known_cache_hits
            .as_deref()
            .filter(|_| options.time_cache_hits);
        let started = Instant::now();
        for (i, op) in self.ops.iter().enumerate() {
            if options.snapshot_after_ops == Some(i) {
                result.snapshot = Some(allocator.snapshot());
                break;
            }
            if i == half {
                calls_at_half = Some(allocator.device().call_counts());
                result.peak_reserved_at_half = Some(allocator.device().peak_used_bytes());
            }
            let calls_before = options
                .record_calls_by_op
                .then(|| allocator.device().call_counts());
            // Timed: each known hit, or with none known, every malloc and free.
            let known_hit = known_hits.is_some_and(|hits| hits.get(i) == Some(&true));
            let timed = match known_hits {
                Some(_) => known_hit,
                None => options.time_cache_hits && calls_allocator(*op, &ptrs),
            };
            let hit_timer = timed.then(|| (driver_traffic(&allocator), Instant::now()));
            let step = if known_hit {
                self.hit_step(&mut allocator, &mut ptrs, (i, *op), options, &mut result)
            } else {
                self.step(&mut allocator, &mut ptrs, (i, *op), options, &mut result)
            };
            if let Some((traffic, started)) = hit_timer {
                let ns = started.elapsed().as_nanos() as u64;
                let hit = step.is_ok() && driver_traffic(&allocator) == traffic;
                if hit {
                    result.hit_ops += 1;
                    result.hit_ns += ns;
                } else if known_hit {
                    return Err(ReplayError {
                        op_index: Some(i),
                        message: "a cache hit of the earlier replay called the driver: \
                                  the replays differ"
                            .into(),
                    });
                }
                if known_hits.is_none() {
                    result.cache_hit_ops.resize(i, false);
                    result.cache_hit_ops.push(hit);
                }
            }
            if let Some(before) = calls_before {
                let made = allocator.device().call_counts().since(&before);
                if made.by_kind.iter().any(|&n| n > 0) {
                    result.calls_by_op.push((i, made));
                }
            }
            let reserved = reserved_now(&allocator);
            if options.record_reserved_after_ops && step.is_ok() {
                result.reserved_after_ops.push(reserved as u64);
            }
            if reserved > peak_reserved_between_ops {
                peak_reserved_between_ops = reserved;
                result.ops_at_peak_reserved = i + 1;
            }
            let every = options.check_invariants_every;
            if every > 0 && ((i + 1) % every == 0 || i + 1 == self.ops.len()) {
                if let Err(broken) = allocator.check_invariants() {
                    return Err(ReplayError {
                        op_index: Some(i),
                        message: format!("invariant broken: {broken}"),
                    });
                }
            }
            if let Err(e) = step {
                return match e {
                    AllocError::OutOfMemory(report) => {
                        result.loop_ns = started.elapsed().as_nanos() as u64;
                        result.outcome = Outcome::OutOfMemory {
                            op_index: i,
                            report,
                        };
                        Ok(finish(result, &allocator, calls_at_half.as_ref(), options))
                    }
                    other => Err(ReplayError {
                        op_index: Some(i),
                        message: other.to_string(),
                    }),
                };
            }
            if options.record_history {
                let recorded = allocator.history().recorded();
                if recorded > history_seen {
                    let new = (recorded - history_seen) as usize;
                    let mut fresh: Vec<TraceEntry> = allocator
                        .history()
                        .entries()
                        .rev()
                        .take(new)
                        .filter(|e| e.action.is_segment_event())
                        .copied()
                        .collect();
                    fresh.reverse();
                    result
                        .segment_events
                        .extend(fresh.into_iter().map(|e| (i, e)));
                    history_seen = recorded;
                }
            }
        }
        result.loop_ns = started.elapsed().as_nanos() as u64;
        Ok(finish(result, &allocator, calls_at_half.as_ref(), options))
    }

    /// Replays the mallocs, frees and `empty_cache` calls through a shared,
    /// thread-safe allocator, on streams shifted by `stream_offset` so that
    /// several threads can replay side by side. Cross-stream uses are left
    /// out (there is no simulated stream to complete them from here). Returns
    /// the number of mallocs and frees made.
    pub fn run_shared(
        &self,
        allocator: &dyn ThreadSafeAllocator,
        stream_offset: u64,
    ) -> Result<u64, ReplayError> {
        let mut ptrs: Vec<DevicePtr> = vec![0; self.slots];
        let mut ops = 0;
        for (i, op) in self.ops.iter().enumerate() {
            let failed = |e: AllocError| ReplayError {
                op_index: Some(i),
                message: e.to_string(),
            };
            match *op {
                DenseOp::Alloc { slot, size, stream } if size > 0 => {
                    ptrs[slot] = allocator
                        .malloc(size, StreamId(stream.wrapping_add(stream_offset)))
                        .map_err(failed)?;
                    ops += 1;
                }
                DenseOp::Free { slot } if ptrs[slot] != 0 => {
                    allocator.free(ptrs[slot]).map_err(failed)?;
                    ptrs[slot] = 0;
                    ops += 1;
                }
                DenseOp::EmptyCache => allocator.empty_cache().map_err(failed)?,
                _ => {}
            }
        }
        for ptr in ptrs.into_iter().filter(|&p| p != 0) {
            allocator.free(ptr).map_err(|e| ReplayError {
                op_index: None,
                message: e.to_string(),
            })?;
        }
        Ok(ops)
    }

    /// A cache hit found by an earlier replay
    /// ([`ReplayOptions::known_cache_hits`]): [`PreparedTrace::step`] under
    /// a name of its own, not inlined, so that a profiler counts the hits
    /// apart (`scripts/bench-instructions --hits`).
    #[inline(never)]
    fn hit_step(
        &self,
        allocator: &mut Allocator<SimDevice>,
        ptrs: &mut [DevicePtr],
        op: (usize, DenseOp),
        options: &ReplayOptions,
        result: &mut RunResult,
    ) -> Result<(), AllocError> {
        self.step(allocator, ptrs, op, options, result)
    }

    /// One operation of the timed loop. Not inlined, so that profilers (and
    /// `scripts/bench-instructions`) can count the replayed operations
    /// apart from setup, such as restoring a snapshot's initial segments.
    #[inline(never)]
    fn step(
        &self,
        allocator: &mut Allocator<SimDevice>,
        ptrs: &mut [DevicePtr],
        (index, op): (usize, DenseOp),
        options: &ReplayOptions,
        result: &mut RunResult,
    ) -> Result<(), AllocError> {
        match op {
            DenseOp::Alloc { slot, size, stream } => {
                if size == 0 {
                    // PyTorch never calls its allocator for empty tensors.
                    return Ok(());
                }
                let before = driver_traffic(allocator);
                ptrs[slot] = allocator.malloc(size, StreamId(stream))?;
                result.mallocs += 1;
                if driver_traffic(allocator) == before {
                    result.cache_hits += 1;
                }
            }
            DenseOp::Free { slot } => {
                if ptrs[slot] != 0 {
                    allocator.free(ptrs[slot])?;
                    ptrs[slot] = 0;
                    result.frees += 1;
                }
            }
            DenseOp::RecordStream { slot, stream } => {
                if ptrs[slot] != 0 {
                    allocator.record_stream(ptrs[slot], StreamId(stream))?;
                }
            }
            DenseOp::StreamComplete { stream } => {
                allocator.device().complete_stream(StreamId(stream));
            }
            DenseOp::EmptyCache => allocator.empty_cache()?,
            DenseOp::Oom {
                size,
                stream,
                device_free,
            } => {
                if options.emulate_recorded_ooms && size > 0 {
                    let device = allocator.device();
                    let others = options
                        .capacity_bytes
                        .saturating_sub(device.used_bytes())
                        .saturating_sub(device_free);
                    device.set_external_bytes(others);
                    let attempt = allocator.malloc(size, StreamId(stream));
                    allocator.device().set_external_bytes(0);
                    match attempt {
                        Ok(ptr) => {
                            result.unreproduced_ooms += 1;
                            allocator.free(ptr)?;
                        }
                        Err(AllocError::OutOfMemory(report)) => {
                            result.reproduced_ooms.push((index, *report));
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
        }
        Ok(())
    }
}

/// Whether `op` is a malloc or free the allocator is called for.
#[inline]
fn calls_allocator(op: DenseOp, ptrs: &[DevicePtr]) -> bool {
    match op {
        DenseOp::Alloc { size, .. } => size > 0,
        DenseOp::Free { slot } => ptrs[slot] != 0,
        _ => false,
    }
}

/// Driver allocations plus frees so far, from the engine's own counters
/// (cheap: no device lock).
#[inline]
fn driver_traffic(allocator: &Allocator<SimDevice>) -> i64 {
    let stats = allocator.stats();
    stats.num_device_alloc + stats.num_device_free
}

/// Reserved bytes now, from the engine's own counters (cheap: no device lock).
#[inline]
fn reserved_now(allocator: &Allocator<SimDevice>) -> i64 {
    allocator.stats().reserved_bytes[0].current
}

fn finish(
    mut result: RunResult,
    allocator: &Allocator<SimDevice>,
    at_half: Option<&CallCounts>,
    options: &ReplayOptions,
) -> RunResult {
    if options.snapshot_after_ops.is_some() && result.snapshot.is_none() {
        result.snapshot = Some(allocator.snapshot());
    }
    let device = allocator.device();
    result.peak_reserved_bytes = device.peak_used_bytes();
    result.calls = device.call_counts();
    result.steady_state_calls = at_half.map(|at_half| result.calls.since(at_half));
    result.final_stats = allocator.stats().clone();
    result
}

/// Replays `trace` once under `options`.
pub fn replay(trace: &DeviceTrace, options: &ReplayOptions) -> Result<RunResult, ReplayError> {
    PreparedTrace::new(trace)?.run(options)
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    const MIB: u64 = 1 << 20;

    /// A thread-safe allocator that notes each call it passes on.
    struct Noting {
        inner: Mutex<Allocator<SimDevice>>,
        calls: Mutex<Vec<String>>,
    }

    impl Noting {
        fn note(&self, call: String) {
            self.calls.lock().unwrap().push(call);
        }
    }

    impl ThreadSafeAllocator for Noting {
        fn malloc(&self, size: u64, stream: StreamId) -> Result<DevicePtr, AllocError> {
            self.note(format!("malloc {} {:#x}", size / MIB, stream.0));
            self.inner.malloc(size, stream)
        }
        fn free(&self, ptr: DevicePtr) -> Result<(), AllocError> {
            self.note("free".into());
            self.inner.free(ptr)
        }
        fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<(), AllocError> {
            self.inner.record_stream(ptr, stream)
        }
        fn empty_cache(&self) -> Result<(), AllocError> {
            self.note("empty_cache".into());
            self.inner.empty_cache()
        }
        fn stats(&self) -> DeviceStats {
            self.inner.stats()
        }
    }

    #[test]
    fn a_block_in_use_on_another_stream_waits_for_it_before_reuse() {
        let alloc = |id| Op::Alloc {
            id,
            size: 64 * MIB,
            stream: 0,
        };
        let trace = DeviceTrace {
            ops: vec![
                alloc(1),
                Op::RecordStream { id: 1, stream: 7 },
                Op::Free { id: 1 },
                alloc(2), // block 1 still in use on stream 7: a new segment
                Op::StreamComplete { stream: 7 },
                Op::Free { id: 2 },
                alloc(3), // either block, cached
            ],
            ..DeviceTrace::default()
        };
        let options = ReplayOptions::new(PolicyConfig::from_settings("policy:pytorch").unwrap());
        let run = replay(&trace, &options).unwrap();
        assert_eq!(run.calls.get(hbmalloc::CallKind::SegmentAlloc), 2);
        assert_eq!(run.peak_reserved_bytes, 128 * MIB);
        assert_eq!((run.mallocs, run.frees, run.cache_hits), (3, 2, 1));
    }

    #[test]
    fn recorded_out_of_memory_errors_are_replayed_only_when_asked() {
        let trace = DeviceTrace {
            ops: vec![Op::Oom {
                size: MIB,
                stream: 0,
                device_free: 0,
            }],
            ..DeviceTrace::default()
        };
        let mut options =
            ReplayOptions::new(PolicyConfig::from_settings("policy:pytorch").unwrap());
        assert!(replay(&trace, &options).unwrap().reproduced_ooms.is_empty());
        options.emulate_recorded_ooms = true;
        assert_eq!(replay(&trace, &options).unwrap().reproduced_ooms.len(), 1);
    }

    #[test]
    fn a_shared_replay_makes_the_traces_calls_on_its_own_streams() {
        let alloc = |id, mib| Op::Alloc {
            id,
            size: mib * MIB,
            stream: 1,
        };
        let trace = DeviceTrace {
            ops: vec![
                alloc(1, 4),
                alloc(2, 0),        // an empty tensor: PyTorch asks for nothing
                Op::Free { id: 2 }, // and gives nothing back
                Op::EmptyCache,
                alloc(3, 8),
                Op::Free { id: 1 },
            ],
            ..DeviceTrace::default()
        };
        let prepared = PreparedTrace::new(&trace).unwrap();
        let allocator = Noting {
            inner: Mutex::new(
                Allocator::new(SimDevice::default(), AllocatorConfig::default()).unwrap(),
            ),
            calls: Mutex::new(Vec::new()),
        };
        let ops = prepared.run_shared(&allocator, 0x100).unwrap();
        assert_eq!(ops, 3);
        // Block 3, still live at the end, is given back too.
        assert_eq!(
            *allocator.calls.lock().unwrap(),
            [
                "malloc 4 0x101",
                "empty_cache",
                "malloc 8 0x101",
                "free",
                "free"
            ]
        );
        assert_eq!(allocator.stats().allocated_bytes[0].current, 0);
    }
}

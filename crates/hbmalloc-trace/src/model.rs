//! The trace model: the allocator's view of a program, independent of any file format.
//!
//! A [`Trace`] holds one [`DeviceTrace`] per device. Each is an ordered list of
//! [`Op`]s (what the program asked of its allocator), the state the allocator was
//! in when the recorded window began (for windowed snapshots), and what the real
//! allocator did (`recorded`), where the source format says so.
//!
//! Allocations are named by [`AllocId`], not by address: addresses are the
//! recorded allocator's choices, and a replay under another policy hands out
//! other ones.

use std::collections::BTreeMap;

use serde::Serialize;

/// Names one allocation for its whole life, from `Alloc` to `Free`.
pub type AllocId = u64;

/// One request the program made of its allocator.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// `malloc(size, stream)`; `size` is the requested (unrounded) size in bytes.
    Alloc {
        /// The allocation's name.
        id: AllocId,
        /// Requested bytes.
        size: u64,
        /// The stream it was allocated on.
        stream: u64,
    },
    /// `free(ptr)` (PyTorch's `free_requested`).
    Free {
        /// The allocation freed.
        id: AllocId,
    },
    /// `record_stream(ptr, stream)`: the allocation is in use on another stream.
    RecordStream {
        /// The allocation.
        id: AllocId,
        /// The other stream.
        stream: u64,
    },
    /// The work queued on `stream` so far has completed on the device: events
    /// recorded on it before this point now report complete. Importers use
    /// this to reproduce when a deferred free completed.
    StreamComplete {
        /// The stream whose work completed.
        stream: u64,
    },
    /// `empty_cache()`.
    EmptyCache,
    /// A request the recorded allocator could not satisfy (PyTorch's `oom`
    /// entry). `device_free` is what the driver reported free at that moment.
    Oom {
        /// Requested bytes.
        size: u64,
        /// The stream it was requested on.
        stream: u64,
        /// Free device memory reported by the driver at the failure.
        device_free: u64,
    },
}

/// What a block held at the window start.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum InitialBlockState {
    /// Live: the program holds it and the trace may free it later under this id.
    Allocated(AllocId),
    /// Cached free memory.
    Free,
}

/// One block of a segment that existed at the window start.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct InitialBlock {
    /// Bytes (rounded, as the recorded allocator split them).
    pub size: u64,
    /// Bytes the program asked for (0 for free blocks).
    pub requested_size: u64,
    /// Live or free.
    pub state: InitialBlockState,
}

/// A segment that existed at the window start, with its blocks in address order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct InitialSegment {
    /// The address the recorded allocator had it at (for reports only).
    pub address: u64,
    /// The stream that owns it.
    pub stream: u64,
    /// True for a segment from the small pool.
    pub small_pool: bool,
    /// True for (a mapped range of) an expandable segment.
    pub expandable: bool,
    /// Blocks in address order; their sizes add up to the segment size.
    pub blocks: Vec<InitialBlock>,
}

impl InitialSegment {
    /// Total bytes of the segment.
    pub fn total_size(&self) -> u64 {
        self.blocks.iter().map(|b| b.size).sum()
    }
}

/// Kinds of segment event the recorded allocator logged.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SegmentEventKind {
    /// `cudaMalloc` of a new segment.
    Alloc,
    /// `cudaFree` of a segment.
    Free,
    /// Pages mapped into an expandable segment.
    Map,
    /// Pages unmapped from an expandable segment.
    Unmap,
}

impl SegmentEventKind {
    /// PyTorch's action name (`segment_alloc`, ...).
    pub fn action(self) -> &'static str {
        match self {
            SegmentEventKind::Alloc => "segment_alloc",
            SegmentEventKind::Free => "segment_free",
            SegmentEventKind::Map => "segment_map",
            SegmentEventKind::Unmap => "segment_unmap",
        }
    }

    /// The kind whose [`action`](SegmentEventKind::action) name is `name`.
    pub fn from_action(name: &str) -> Option<Self> {
        [Self::Alloc, Self::Free, Self::Map, Self::Unmap]
            .into_iter()
            .find(|kind| kind.action() == name)
    }
}

/// One segment event the recorded allocator logged.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RecordedSegmentEvent {
    /// What happened.
    pub kind: SegmentEventKind,
    /// Bytes.
    pub size: u64,
    /// Stream.
    pub stream: u64,
    /// The address the recorded allocator got (or mapped/freed).
    pub address: u64,
    /// The index of the op during which it happened: the allocation that
    /// needed it, or the `EmptyCache` that released it.
    pub op_index: usize,
}

/// What the recorded allocator did, where the source format says.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Recorded {
    /// Max bytes it held during the window (segments and mapped pages).
    pub peak_reserved_bytes: Option<u64>,
    /// Bytes it held at the window start.
    pub initial_reserved_bytes: u64,
    /// Its segment events, in order.
    pub segment_events: Vec<RecordedSegmentEvent>,
}

/// The allocator's view of one device.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DeviceTrace {
    /// Device index.
    pub device: i64,
    /// Segments at the window start (empty for a trace that starts at program start).
    pub initial_segments: Vec<InitialSegment>,
    /// The requests, in order.
    pub ops: Vec<Op>,
    /// The recorded allocator's configuration in `PYTORCH_CUDA_ALLOC_CONF`
    /// syntax, where the source records it.
    pub recorded_config: Option<String>,
    /// What the recorded allocator did, where known.
    pub recorded: Option<Recorded>,
    /// Wall-clock time the recording spans, first to last event of this
    /// device, in microseconds, where the source has timestamps (snapshots'
    /// `time_us`, profiler traces' `ts`, RMM logs' `Time`). What-ifs that
    /// lengthen a trace scale it by their ops.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recorded_span_us: Option<u64>,
    /// Where each step of the program began (a training iteration), as the
    /// index of its first op, ascending, where the source marks steps
    /// (torch.profiler's `ProfilerStep#N`). Empty when unknown.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub step_starts: Vec<usize>,
    /// True when the source is a port of PyTorch's allocator for another
    /// accelerator (torch_npu): reported, not held to fidelity.
    pub foreign_allocator: bool,
    /// Source entries the importer could not use and left out, counted by
    /// reason (e.g. `free of an unknown address`). Empty for a clean import;
    /// reported so that a lossy import is never silent.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub skipped: BTreeMap<String, u64>,
}

/// How an importer that appends a device's ops in time order turns the times
/// its steps began (sorted) into [`DeviceTrace::step_starts`]: a step begins
/// at the first op at or after its start time, and steps with no op in them
/// mark nothing.
pub(crate) struct StepMarks<'t, T> {
    times: &'t [T],
    /// Steps already begun.
    begun: usize,
}

impl<'t, T: PartialOrd + Copy> StepMarks<'t, T> {
    /// Steps of `times` that began before `since` (where given: the first
    /// event of a recording that starts mid-run) mark nothing.
    pub(crate) fn new(times: &'t [T], since: Option<T>) -> Self {
        let begun = since.map_or(0, |first| times.partition_point(|&t| t < first));
        StepMarks { times, begun }
    }

    /// An event at `now` is about to append op `next_op`.
    pub(crate) fn at(&mut self, now: T, next_op: usize, step_starts: &mut Vec<usize>) {
        let begun = self.times.partition_point(|&t| t <= now);
        if begun > self.begun {
            self.begun = begun;
            if step_starts.last() != Some(&next_op) {
                step_starts.push(next_op);
            }
        }
    }

    /// The recording ended after `ops` ops: a step marked at the op that
    /// never came is not in it.
    pub(crate) fn close(self, ops: usize, step_starts: &mut Vec<usize>) {
        if step_starts.last() == Some(&ops) {
            step_starts.pop();
        }
    }
}

/// A whole trace: one per source file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Trace {
    /// Where it came from (a file name).
    pub source: String,
    /// One per device that has any activity, ordered by device index.
    pub devices: Vec<DeviceTrace>,
    /// What the importer left out of `devices` and why, for the user to see
    /// (e.g. host memory in a profiler trace that also has GPU memory).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

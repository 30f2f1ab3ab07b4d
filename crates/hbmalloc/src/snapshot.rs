//! A plain-data picture of the allocator: its segments, their blocks, and the
//! history (out), and the segment images a replayed window starts from (in).
//! Writers for file formats (PyTorch's pickle, JSON) live outside the engine.

use crate::device::{DevicePtr, StreamId};
use crate::history::TraceEntry;

/// The state of one block, in PyTorch's words.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// Handed out to the program.
    ActiveAllocated,
    /// Freed by the program, waiting for other streams' events.
    ActivePendingFree,
    /// Cached free memory.
    Inactive,
}

impl BlockState {
    /// PyTorch's name (`active_allocated`, ...).
    pub fn name(self) -> &'static str {
        match self {
            BlockState::ActiveAllocated => "active_allocated",
            BlockState::ActivePendingFree => "active_pending_free",
            BlockState::Inactive => "inactive",
        }
    }
}

/// One block of a segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockSnapshot {
    /// Its address.
    pub address: DevicePtr,
    /// Its size in bytes.
    pub size: u64,
    /// Bytes the program asked for (0 when inactive).
    pub requested_size: u64,
    /// Its state.
    pub state: BlockState,
}

/// One segment (or one contiguous mapped range of a virtual-memory segment).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentSnapshot {
    /// Its address.
    pub address: DevicePtr,
    /// Its size in bytes.
    pub total_size: u64,
    /// The stream that owns it.
    pub stream: StreamId,
    /// True for the small pool.
    pub small_pool: bool,
    /// True for virtual-memory backed memory (expandable segments, `hbm` granules).
    pub expandable: bool,
    /// Its blocks, in address order.
    pub blocks: Vec<BlockSnapshot>,
}

impl SegmentSnapshot {
    fn sum(&self, keep: impl Fn(&BlockSnapshot) -> bool, f: impl Fn(&BlockSnapshot) -> u64) -> u64 {
        self.blocks.iter().filter(|b| keep(b)).map(f).sum()
    }

    /// Bytes of allocated blocks.
    pub fn allocated_size(&self) -> u64 {
        self.sum(|b| b.state == BlockState::ActiveAllocated, |b| b.size)
    }

    /// Bytes of active blocks (allocated or pending free).
    pub fn active_size(&self) -> u64 {
        self.sum(|b| b.state != BlockState::Inactive, |b| b.size)
    }

    /// Requested bytes of active blocks.
    pub fn requested_size(&self) -> u64 {
        self.sum(|b| b.state != BlockState::Inactive, |b| b.requested_size)
    }
}

/// The size of the largest inactive (cached, free) block among `segments`;
/// 0 when there is none.
pub fn largest_free_block(segments: &[SegmentSnapshot]) -> u64 {
    segments
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.state == BlockState::Inactive)
        .map(|b| b.size)
        .max()
        .unwrap_or(0)
}

/// The whole picture.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Segments in address order.
    pub segments: Vec<SegmentSnapshot>,
    /// The history ring buffer, oldest first (empty unless history is enabled).
    pub history: Vec<TraceEntry>,
    /// The policy and configuration, as a configuration string.
    pub settings: String,
}

/// A segment as it stood when a recorded trace window began.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentImage {
    /// The stream that owns it.
    pub stream: StreamId,
    /// True for the small pool.
    pub small_pool: bool,
    /// True for (a mapped range of) an expandable segment.
    pub expandable: bool,
    /// Its blocks in address order.
    pub blocks: Vec<BlockImage>,
}

/// One block of a [`SegmentImage`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockImage {
    /// Bytes (a multiple of 512).
    pub size: u64,
    /// Bytes the program asked for.
    pub requested_size: u64,
    /// True when the program holds it.
    pub allocated: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A segment's sums count the blocks of each state as PyTorch's
    /// snapshot does; the state names are its too (its memory visualizer
    /// reads them).
    #[test]
    fn a_segment_sums_its_blocks_by_state() {
        let block = |address, size, requested_size, state| BlockSnapshot {
            address,
            size,
            requested_size,
            state,
        };
        let segment = SegmentSnapshot {
            address: 0,
            total_size: 700,
            stream: StreamId(0),
            small_pool: false,
            expandable: false,
            blocks: vec![
                block(0, 100, 90, BlockState::ActiveAllocated),
                block(100, 200, 150, BlockState::ActivePendingFree),
                block(300, 400, 0, BlockState::Inactive),
            ],
        };
        assert_eq!(segment.allocated_size(), 100);
        assert_eq!(segment.active_size(), 300);
        assert_eq!(segment.requested_size(), 240);
        assert_eq!(largest_free_block(&[segment]), 400);
        let names = [
            BlockState::ActiveAllocated,
            BlockState::ActivePendingFree,
            BlockState::Inactive,
        ]
        .map(BlockState::name);
        assert_eq!(
            names,
            ["active_allocated", "active_pending_free", "inactive"]
        );
    }
}

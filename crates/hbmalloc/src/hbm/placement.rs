//! What placement remembers of the program: the allocation clock, how long
//! blocks of each small size lived, where blocks were freed lately, and the
//! peak of demand. Read by placement and the allowance; spans, memory and
//! alias groups are not seen here.

use std::hash::{BuildHasher, BuildHasherDefault};

use crate::device::{DevicePtr, StreamId};
use crate::fastmap::PointerHasher;

use super::MIN_BLOCK_SIZE;

/// A block freed within this many allocations of its own counts as
/// short-lived (a temporary).
const SHORT_LIVED_ALLOCATIONS: u64 = 8;
/// A request that best fit would place on unmapped memory first tries the
/// place where a block of its size and stream was freed within this many
/// allocations, if still free, mapped and not in use at another view: memory
/// just given back is reused before more is mapped elsewhere.
pub(super) const RECENT_FREE_ALLOCATIONS: u64 = 8;
/// Slots in the table of recent frees, direct-mapped by size and stream: a
/// collision only forgets a place, and the table never grows (48 KiB).
const RECENT_FREE_SLOTS: usize = 1024;
/// Near the peak (demand within this share of it), a block smaller than a
/// granule whose size has mostly been short-lived goes at the *end* of its
/// best-fit range when that is mapped, keeping the front of a hole whole for
/// longer-lived blocks; only near the peak do holes cost memory.
pub(super) const SHORT_LIVED_NEAR_PEAK_PERCENT: u64 = 90;

/// How long the blocks of one size lived: of the `frees` seen, `short`
/// were freed within [`SHORT_LIVED_ALLOCATIONS`] allocations of their own.
#[derive(Copy, Clone, Debug, Default)]
struct SizeLifetimes {
    frees: u64,
    short: u64,
}

impl SizeLifetimes {
    /// Most blocks of this size were temporaries (3 in 4, over 4 frees at least).
    fn mostly_short(self) -> bool {
        self.frees >= 4 && self.short * 4 >= self.frees * 3
    }
}

/// Where a block was freed, for a request of its size and stream soon after
/// (see [`RECENT_FREE_ALLOCATIONS`]). `span` is the free span the block
/// became part of; merges and splits may retire or move it since, so a use
/// checks that it is still free and still covers the place.
#[derive(Copy, Clone, Debug)]
struct RecentFree {
    stream: StreamId,
    size: u64,
    ptr: DevicePtr,
    span: u32,
    /// The allocation clock when it was freed.
    freed_at: u64,
}

/// The slot of the recent-free table for a size and stream.
#[inline]
fn recent_free_slot(stream: StreamId, size: u64) -> usize {
    let hash = BuildHasherDefault::<PointerHasher>::default().hash_one((stream, size));
    (hash % RECENT_FREE_SLOTS as u64) as usize
}

/// The program's history as placement reads it.
#[derive(Debug)]
pub(super) struct PlacementMemory {
    /// Allocations made so far: the clock block lifetimes are measured in.
    allocations: u64,
    /// How long blocks smaller than a granule lived, by size (indexed by
    /// size / `MIN_BLOCK_SIZE`: 4,096 entries for 2 MiB granules).
    lifetimes: Vec<SizeLifetimes>,
    /// Where blocks were freed lately ([`RECENT_FREE_SLOTS`] slots).
    recent_frees: Vec<Option<RecentFree>>,
    /// Highest live-plus-pending bytes seen, including requests being served.
    peak_demand_bytes: u64,
    /// The request being served takes demand to a new peak.
    growing: bool,
}

impl PlacementMemory {
    /// Nothing seen; lifetimes are kept for blocks below `small_bytes`.
    pub(super) fn new(small_bytes: u64) -> Self {
        PlacementMemory {
            allocations: 0,
            lifetimes: vec![SizeLifetimes::default(); (small_bytes / MIN_BLOCK_SIZE) as usize],
            recent_frees: vec![None; RECENT_FREE_SLOTS],
            peak_demand_bytes: 0,
            growing: false,
        }
    }

    /// A request takes live-plus-pending bytes to `demand`: whether that is
    /// a new peak is kept for the request; returns whether demand is near
    /// its peak ([`SHORT_LIVED_NEAR_PEAK_PERCENT`]).
    #[inline]
    pub(super) fn demand(&mut self, demand: u64) -> bool {
        self.growing = demand > self.peak_demand_bytes;
        self.peak_demand_bytes = self.peak_demand_bytes.max(demand);
        demand * 100 >= self.peak_demand_bytes * SHORT_LIVED_NEAR_PEAK_PERCENT
    }

    /// The request being served takes demand to a new peak.
    #[inline]
    pub(super) fn growing(&self) -> bool {
        self.growing
    }

    #[inline]
    pub(super) fn peak_demand_bytes(&self) -> u64 {
        self.peak_demand_bytes
    }

    /// A block was placed: returns its birth on the allocation clock.
    #[inline]
    pub(super) fn allocated(&mut self) -> u64 {
        let born = self.allocations;
        self.allocations += 1;
        born
    }

    /// A block of `size` bytes born at `born` was freed at `ptr`, now part
    /// of free span `span`.
    #[inline]
    pub(super) fn freed(
        &mut self,
        stream: StreamId,
        size: u64,
        ptr: DevicePtr,
        span: u32,
        born: u64,
    ) {
        if let Some(lifetimes) = self.lifetimes.get_mut((size / MIN_BLOCK_SIZE) as usize) {
            lifetimes.frees += 1;
            if self.allocations - born <= SHORT_LIVED_ALLOCATIONS {
                lifetimes.short += 1;
            }
        }
        self.recent_frees[recent_free_slot(stream, size)] = Some(RecentFree {
            stream,
            size,
            ptr,
            span,
            freed_at: self.allocations,
        });
    }

    /// Most blocks of `size` bytes were temporaries.
    #[inline]
    pub(super) fn mostly_short(&self, size: u64) -> bool {
        self.lifetimes
            .get((size / MIN_BLOCK_SIZE) as usize)
            .is_some_and(|l| l.mostly_short())
    }

    /// Where a block of `size` bytes of `stream` was freed within
    /// [`RECENT_FREE_ALLOCATIONS`] allocations, as (the free span it became
    /// part of then, address); the caller checks that it still holds it.
    #[inline]
    pub(super) fn recent_free(&self, stream: StreamId, size: u64) -> Option<(u32, DevicePtr)> {
        let recent = self.recent_frees[recent_free_slot(stream, size)]?;
        if recent.stream != stream
            || recent.size != size
            || self.allocations - recent.freed_at > RECENT_FREE_ALLOCATIONS
        {
            return None;
        }
        Some((recent.span, recent.ptr))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A free is offered to a request of its size and stream only, and only
    /// for `RECENT_FREE_ALLOCATIONS` allocations.
    #[test]
    fn recent_free_is_offered_to_its_size_and_stream_for_a_while() {
        let mut memory = PlacementMemory::new(2 << 20);
        let born = memory.allocated();
        memory.freed(StreamId(1), 4096, 0x1000, 7, born);
        assert_eq!(memory.recent_free(StreamId(1), 4096), Some((7, 0x1000)));
        assert_eq!(memory.recent_free(StreamId(2), 4096), None);
        assert_eq!(memory.recent_free(StreamId(1), 8192), None);
        for _ in 0..RECENT_FREE_ALLOCATIONS {
            memory.allocated();
        }
        assert_eq!(memory.recent_free(StreamId(1), 4096), Some((7, 0x1000)));
        memory.allocated();
        assert_eq!(memory.recent_free(StreamId(1), 4096), None);
    }

    /// A size is mostly short-lived once 3 in 4 of at least 4 frees came
    /// within `SHORT_LIVED_ALLOCATIONS` of their birth.
    #[test]
    fn sizes_freed_soon_after_birth_count_as_short_lived() {
        let mut memory = PlacementMemory::new(2 << 20);
        for i in 0..4u64 {
            let born = memory.allocated();
            if i == 0 {
                for _ in 0..=SHORT_LIVED_ALLOCATIONS {
                    memory.allocated();
                }
            }
            memory.freed(StreamId(0), 512, 0, 0, born);
            assert_eq!(memory.mostly_short(512), i == 3, "after {} frees", i + 1);
        }
        let born = memory.allocated();
        for _ in 0..=SHORT_LIVED_ALLOCATIONS {
            memory.allocated();
        }
        memory.freed(StreamId(0), 512, 0, 0, born);
        assert!(!memory.mostly_short(512), "3 short in 5");
        // Sizes of a granule or more are not tracked.
        assert!(!memory.mostly_short(2 << 20));
    }

    /// Demand near its peak is within `SHORT_LIVED_NEAR_PEAK_PERCENT`; only
    /// a new peak is growth.
    #[test]
    fn demand_tracks_its_peak() {
        let mut memory = PlacementMemory::new(2 << 20);
        assert!(memory.demand(1000));
        assert!(memory.growing());
        assert!(memory.demand(900));
        assert!(!memory.growing());
        assert!(!memory.demand(899));
        assert_eq!(memory.peak_demand_bytes(), 1000);
    }
}

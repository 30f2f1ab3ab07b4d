//! PyTorch-compatible statistics: the counters behind `memory_stats()`.
//!
//! The engine updates these at exactly the moments PyTorch's
//! `CUDACachingAllocator` does (see `../shared/reference/pytorch-allocator.md`):
//! `allocation`/`allocated_bytes` move when a free is *requested*, `active*`
//! when it *completes*, `segment` counts driver segments only, and so on.

/// One statistic: its current value, its peak, and the totals added and removed.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    /// Current value.
    pub current: i64,
    /// Highest `current` since the last peak reset.
    pub peak: i64,
    /// Sum of all increases.
    pub allocated: i64,
    /// Sum of all decreases.
    pub freed: i64,
}

impl Stat {
    /// Adds `amount` (PyTorch's `increase_stat`).
    pub fn increase(&mut self, amount: i64) {
        self.current += amount;
        self.peak = self.peak.max(self.current);
        self.allocated += amount;
    }

    /// Removes `amount` (PyTorch's `decrease_stat`).
    pub fn decrease(&mut self, amount: i64) {
        self.current -= amount;
        debug_assert!(self.current >= 0, "stat went negative: {self:?}");
        self.freed += amount;
    }

    /// `reset_peak_memory_stats()`: the peak becomes the current value.
    pub fn reset_peak(&mut self) {
        self.peak = self.current;
    }

    /// `reset_accumulated_memory_stats()`: the totals return to zero.
    pub fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.freed = 0;
    }
}

/// Which pool a statistic row describes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum StatType {
    /// Both pools.
    Aggregate = 0,
    /// Blocks of at most 1 MiB, in 2 MiB segments.
    SmallPool = 1,
    /// Everything else.
    LargePool = 2,
}

/// One statistic for the aggregate, small pool and large pool (indexed by [`StatType`]).
pub type StatArray = [Stat; 3];

/// All statistics of one device's allocator, as PyTorch's `DeviceStats`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Live allocations (moves at free request).
    pub allocation: StatArray,
    /// Driver segments (`cudaMalloc` calls live; expandable segments count once).
    pub segment: StatArray,
    /// Allocations not yet free-completed (includes pending frees).
    pub active: StatArray,
    /// Free blocks inside partly used segments ("non-releasable").
    pub inactive_split: StatArray,
    /// Bytes of live allocations (rounded sizes; moves at free request).
    pub allocated_bytes: StatArray,
    /// Bytes held from the driver (segments and mapped pages).
    pub reserved_bytes: StatArray,
    /// Bytes of active blocks.
    pub active_bytes: StatArray,
    /// Bytes of free blocks inside partly used segments.
    pub inactive_split_bytes: StatArray,
    /// Bytes the program asked for (unrounded) of live allocations.
    pub requested_bytes: StatArray,
    /// Allocations of at least `max_split_size`.
    pub oversize_allocations: Stat,
    /// Segments of at least `max_split_size`.
    pub oversize_segments: Stat,
    /// Times an allocation was retried after releasing cached memory.
    pub num_alloc_retries: i64,
    /// Out-of-memory errors raised.
    pub num_ooms: i64,
    /// Times every stream's pending events were synchronized.
    pub num_sync_all_streams: i64,
    /// Driver allocations (`cudaMalloc` or physical-memory creation).
    pub num_device_alloc: i64,
    /// Driver frees.
    pub num_device_free: i64,
    /// Requests refused by an out-of-memory observer without retrying.
    pub num_oom_rejections: i64,
    /// `max_split_size` in bytes, or -1 when unlimited.
    pub max_split_size: i64,
}

//! PyTorch-compatible statistics: the counters behind `memory_stats()`.
//!
//! The engine updates these at exactly the moments PyTorch's
//! `CUDACachingAllocator` does (see `../shared/reference/pytorch-allocator.md`):
//! `allocation`/`allocated_bytes` move when a free is *requested*, `active*`
//! when it *completes*, `segment` counts driver segments only, and so on.

use std::collections::BTreeMap;

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
    /// Adds `amount` (PyTorch's `increase_stat`). The totals saturate: they
    /// sum every allocation ever made, which a replay of huge requests can
    /// take past `i64::MAX`.
    pub fn increase(&mut self, amount: i64) {
        self.current += amount;
        self.peak = self.peak.max(self.current);
        self.allocated = self.allocated.saturating_add(amount);
    }

    /// Removes `amount` (PyTorch's `decrease_stat`).
    pub fn decrease(&mut self, amount: i64) {
        self.current -= amount;
        debug_assert!(self.current >= 0, "stat went negative: {self:?}");
        self.freed = self.freed.saturating_add(amount);
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

/// The rows of a [`StatArray`] that one block touches: the aggregate and
/// its pool (PyTorch's `get_stat_types_for_pool`).
pub(crate) fn pool_rows(small: bool) -> [usize; 2] {
    let pool = if small {
        StatType::SmallPool
    } else {
        StatType::LargePool
    };
    [StatType::Aggregate as usize, pool as usize]
}

/// Adds `amount` to the aggregate row and the block's pool row.
pub(crate) fn increase_pool(array: &mut StatArray, small: bool, amount: u64) {
    for row in pool_rows(small) {
        array[row].increase(amount as i64);
    }
}

/// Removes `amount` from the aggregate row and the block's pool row.
pub(crate) fn decrease_pool(array: &mut StatArray, small: bool, amount: u64) {
    for row in pool_rows(small) {
        array[row].decrease(amount as i64);
    }
}

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

impl StatType {
    /// Every pool, in PyTorch's `StatType` order.
    pub const ALL: [StatType; 3] = [
        StatType::Aggregate,
        StatType::SmallPool,
        StatType::LargePool,
    ];

    /// The name PyTorch gives this pool in `memory_stats()` keys.
    pub fn pytorch_name(self) -> &'static str {
        match self {
            StatType::Aggregate => "all",
            StatType::SmallPool => "small_pool",
            StatType::LargePool => "large_pool",
        }
    }
}

/// How many keys [`DeviceStats::to_pytorch_map`] produces: 9 per-pool statistics × 3 pools ×
/// 4 fields, 2 oversize statistics × 4 fields, and 7 scalar counters.
pub const PYTORCH_STAT_KEY_COUNT: usize = 9 * 3 * 4 + 2 * 4 + 7;

/// The four fields of a [`Stat`] with the names PyTorch uses for them.
fn stat_fields(stat: &Stat) -> [(&'static str, i64); 4] {
    [
        ("current", stat.current),
        ("peak", stat.peak),
        ("allocated", stat.allocated),
        ("freed", stat.freed),
    ]
}

impl DeviceStats {
    /// The per-pool statistics with the names PyTorch's `getDeviceStats` binding gives them.
    pub fn stat_arrays(&self) -> [(&'static str, &StatArray); 9] {
        [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ]
    }

    /// Adds `other` counter by counter. Peaks add too, so a sum over shards
    /// has peaks that are upper bounds of the true combined peak.
    pub(crate) fn accumulate(&mut self, other: &DeviceStats) {
        let theirs: Vec<Stat> = other.clone().all_stats_mut().map(|s| *s).collect();
        for (mine, theirs) in self.all_stats_mut().zip(theirs) {
            mine.current += theirs.current;
            mine.peak += theirs.peak;
            mine.allocated = mine.allocated.saturating_add(theirs.allocated);
            mine.freed = mine.freed.saturating_add(theirs.freed);
        }
        self.num_alloc_retries += other.num_alloc_retries;
        self.num_ooms += other.num_ooms;
        self.num_sync_all_streams += other.num_sync_all_streams;
        self.num_device_alloc += other.num_device_alloc;
        self.num_device_free += other.num_device_free;
        self.num_oom_rejections += other.num_oom_rejections;
    }

    /// Every [`Stat`] (per-pool and oversize), for the resets that apply to all of them.
    fn all_stats_mut(&mut self) -> impl Iterator<Item = &mut Stat> {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
        .into_iter()
        .flat_map(|array| array.iter_mut())
        .chain([&mut self.oversize_allocations, &mut self.oversize_segments])
    }

    /// The flat dictionary `torch.cuda.memory_stats()` returns, keyed exactly as PyTorch keys it
    /// (`allocation.all.current`, `requested_bytes.small_pool.peak`, `num_ooms`, ...).
    ///
    /// `memory_stats()` flattens the nested dictionary of the C++ binding (`_cuda_memoryStats`)
    /// by joining keys with `.` and sorts the result; a `BTreeMap` gives the same order.
    /// Recent PyTorch also nests `reserved_bytes_by_private_pools` there, one entry per
    /// private pool; it flattens to nothing when no private pool exists, which is the only
    /// case these statistics describe, so it is left out.
    pub fn to_pytorch_map(&self) -> BTreeMap<String, i64> {
        let mut map = BTreeMap::new();
        for (name, array) in self.stat_arrays() {
            for pool in StatType::ALL {
                for (field, value) in stat_fields(&array[pool as usize]) {
                    map.insert(format!("{name}.{}.{field}", pool.pytorch_name()), value);
                }
            }
        }
        for (name, stat) in self.oversize_stats() {
            for (field, value) in stat_fields(stat) {
                map.insert(format!("{name}.{field}"), value);
            }
        }
        for (name, value) in self.counters() {
            map.insert(name.to_owned(), value);
        }
        map
    }

    /// One value of [`DeviceStats::to_pytorch_map`] by its key, without building the map
    /// (that takes tens of microseconds, and a C++ allocator reads two keys on every
    /// allocation a profiler records); `None` for a key the map does not have.
    pub fn pytorch_value(&self, key: &str) -> Option<i64> {
        let field_of = |stat: &Stat, field: &str| {
            stat_fields(stat)
                .into_iter()
                .find_map(|(name, value)| (name == field).then_some(value))
        };
        match key.split('.').collect::<Vec<_>>()[..] {
            [name, pool, field] => {
                let (_, array) = self.stat_arrays().into_iter().find(|(n, _)| *n == name)?;
                let pool = StatType::ALL
                    .into_iter()
                    .find(|p| p.pytorch_name() == pool)?;
                field_of(&array[pool as usize], field)
            }
            [name, field] => {
                let (_, stat) = self
                    .oversize_stats()
                    .into_iter()
                    .find(|(n, _)| *n == name)?;
                field_of(stat, field)
            }
            [name] => self
                .counters()
                .into_iter()
                .find_map(|(n, value)| (n == name).then_some(value)),
            _ => None,
        }
    }

    /// The statistics without pools, named as in `memory_stats()`.
    fn oversize_stats(&self) -> [(&'static str, &Stat); 2] {
        [
            ("oversize_allocations", &self.oversize_allocations),
            ("oversize_segments", &self.oversize_segments),
        ]
    }

    /// The scalar counters, named as in `memory_stats()`.
    fn counters(&self) -> [(&'static str, i64); 7] {
        [
            ("num_alloc_retries", self.num_alloc_retries),
            ("num_ooms", self.num_ooms),
            ("num_sync_all_streams", self.num_sync_all_streams),
            ("num_device_alloc", self.num_device_alloc),
            ("num_device_free", self.num_device_free),
            ("num_oom_rejections", self.num_oom_rejections),
            ("max_split_size", self.max_split_size),
        ]
    }

    /// `reset_peak_memory_stats()` (PyTorch's `resetPeakStats`): every statistic's peak,
    /// per-pool and oversize alike, becomes its current value. Counters are untouched.
    pub fn reset_peak(&mut self) {
        self.all_stats_mut().for_each(Stat::reset_peak);
    }

    /// `reset_accumulated_memory_stats()` (PyTorch's `resetAccumulatedStats`): every
    /// statistic's `allocated` and `freed` totals return to zero, and so do the event
    /// counters `num_alloc_retries`, `num_ooms`, `num_sync_all_streams`, `num_device_alloc`
    /// and `num_device_free`. `max_split_size` is configuration, not a total, and stays.
    ///
    /// `num_oom_rejections` is reset too: it is an event counter like `num_ooms`. The
    /// PyTorch source available to us predates that counter, so this one is our choice.
    pub fn reset_accumulated(&mut self) {
        self.all_stats_mut().for_each(Stat::reset_accumulated);
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
        self.num_oom_rejections = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The running totals stop at i64::MAX rather than overflowing, alone
    /// and summed over shards; the current value and peak still move.
    #[test]
    fn totals_saturate() {
        let mut stat = Stat::default();
        for _ in 0..3 {
            stat.increase(i64::MAX / 2);
            stat.decrease(i64::MAX / 2);
        }
        assert_eq!((stat.allocated, stat.freed), (i64::MAX, i64::MAX));
        assert_eq!((stat.current, stat.peak), (0, i64::MAX / 2));
        let mut sum = DeviceStats::default();
        let mut one = DeviceStats::default();
        one.allocated_bytes[0] = stat;
        sum.accumulate(&one);
        sum.accumulate(&one);
        assert_eq!(sum.allocated_bytes[0].allocated, i64::MAX);
    }

    /// Stats where every field holds a distinct value, so a key mapped to the wrong field shows.
    fn numbered_stats() -> DeviceStats {
        let mut next = 0i64;
        let mut number = || {
            next += 1;
            next
        };
        let mut numbered_stat = || Stat {
            current: number(),
            peak: number() + 1000,
            allocated: number() + 2000,
            freed: number(),
        };
        let mut stats = DeviceStats::default();
        for array in [
            &mut stats.allocation,
            &mut stats.segment,
            &mut stats.active,
            &mut stats.inactive_split,
            &mut stats.allocated_bytes,
            &mut stats.reserved_bytes,
            &mut stats.active_bytes,
            &mut stats.inactive_split_bytes,
            &mut stats.requested_bytes,
        ] {
            for stat in array.iter_mut() {
                *stat = numbered_stat();
            }
        }
        stats.oversize_allocations = numbered_stat();
        stats.oversize_segments = numbered_stat();
        stats.num_alloc_retries = 7001;
        stats.num_ooms = 7002;
        stats.num_sync_all_streams = 7003;
        stats.num_device_alloc = 7004;
        stats.num_device_free = 7005;
        stats.num_oom_rejections = 7006;
        stats.max_split_size = -1;
        stats
    }

    #[test]
    fn pytorch_map_has_every_key_pytorch_emits() {
        let map = DeviceStats::default().to_pytorch_map();
        assert_eq!(map.len(), PYTORCH_STAT_KEY_COUNT);
        assert_eq!(map.len(), 123);
        // Names as torch/csrc/cuda/Module.cpp (`_cuda_memoryStats`) and memory.py emit them.
        for key in [
            "allocation.all.current",
            "allocation.small_pool.freed",
            "segment.large_pool.peak",
            "active.all.allocated",
            "inactive_split.small_pool.current",
            "allocated_bytes.small_pool.peak",
            "reserved_bytes.all.current",
            "active_bytes.large_pool.freed",
            "inactive_split_bytes.all.peak",
            "requested_bytes.large_pool.allocated",
            "requested_bytes.all.current",
            "oversize_allocations.current",
            "oversize_allocations.peak",
            "oversize_segments.allocated",
            "oversize_segments.freed",
            "num_alloc_retries",
            "num_ooms",
            "num_sync_all_streams",
            "num_device_alloc",
            "num_device_free",
            "num_oom_rejections",
            "max_split_size",
        ] {
            assert!(map.contains_key(key), "missing {key}");
        }
        // No invented names: every key is one of PyTorch's shapes.
        for key in map.keys() {
            let parts: Vec<&str> = key.split('.').collect();
            match parts.as_slice() {
                [_, pool, field] => {
                    assert!(["all", "small_pool", "large_pool"].contains(pool), "{key}");
                    assert!(
                        ["current", "peak", "allocated", "freed"].contains(field),
                        "{key}"
                    );
                }
                [name, field] => {
                    assert!(name.starts_with("oversize_"), "{key}");
                    assert!(
                        ["current", "peak", "allocated", "freed"].contains(field),
                        "{key}"
                    );
                }
                [_] => {}
                _ => panic!("unexpected key shape {key}"),
            }
        }
    }

    #[test]
    fn pytorch_map_reads_the_right_fields() {
        let stats = numbered_stats();
        let map = stats.to_pytorch_map();
        assert_eq!(map["allocation.all.current"], stats.allocation[0].current);
        assert_eq!(map["allocation.small_pool.peak"], stats.allocation[1].peak);
        assert_eq!(
            map["allocation.large_pool.allocated"],
            stats.allocation[2].allocated
        );
        assert_eq!(
            map["requested_bytes.large_pool.freed"],
            stats.requested_bytes[2].freed
        );
        assert_eq!(map["oversize_segments.peak"], stats.oversize_segments.peak);
        assert_eq!(map["num_oom_rejections"], 7006);
        assert_eq!(map["max_split_size"], -1);
        assert_eq!(map["num_device_free"], 7005);
    }

    #[test]
    fn one_value_by_key_is_the_maps_and_other_keys_are_none() {
        let stats = numbered_stats();
        for (key, value) in stats.to_pytorch_map() {
            assert_eq!(stats.pytorch_value(&key), Some(value), "{key}");
        }
        for key in [
            "",
            "allocation",
            "allocation.all",
            "allocation.all.current.x",
            "allocation.gpu.current",
            "allocation.all.maximum",
            "oversize_segments",
            "oversize_segments.all.current",
            "num_ooms.current",
            "num_frees",
        ] {
            assert_eq!(stats.pytorch_value(key), None, "{key:?}");
        }
    }

    #[test]
    fn reset_peak_touches_every_peak_and_nothing_else() {
        let mut stats = numbered_stats();
        let before = stats.clone();
        stats.reset_peak();
        assert_eq!(
            stats.reserved_bytes[2].peak,
            stats.reserved_bytes[2].current
        );
        assert_eq!(
            stats.requested_bytes[1].peak,
            stats.requested_bytes[1].current
        );
        assert_eq!(
            stats.oversize_allocations.peak,
            stats.oversize_allocations.current
        );
        assert_eq!(
            stats.oversize_segments.peak,
            stats.oversize_segments.current
        );
        assert_eq!(stats.num_ooms, before.num_ooms);
        for (key, value) in stats.to_pytorch_map() {
            if !key.ends_with(".peak") {
                assert_eq!(value, before.to_pytorch_map()[&key], "{key}");
            }
        }
    }

    #[test]
    fn reset_accumulated_zeroes_totals_and_event_counters() {
        let mut stats = numbered_stats();
        let before = stats.clone();
        stats.reset_accumulated();
        for (key, value) in stats.to_pytorch_map() {
            let is_total = key.ends_with(".allocated") || key.ends_with(".freed");
            let is_counter = key.starts_with("num_");
            if is_total || is_counter {
                assert_eq!(value, 0, "{key}");
            } else {
                assert_eq!(value, before.to_pytorch_map()[&key], "{key}");
            }
        }
        assert_eq!(stats.max_split_size, -1);
    }
}

//! The byte peaks a sharded allocator keeps exact across its shards.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};

use crate::stats::{DeviceStats, Stat};

/// The aggregate byte statistics whose peaks [`SharedAllocator`] keeps
/// exact across shards: what `max_memory_allocated()`,
/// `max_memory_reserved()` and the peaks of `memory_summary()`'s byte rows
/// read.
pub(super) const EXACT_PEAKS: usize = 4;

/// `value` of each [`EXACT_PEAKS`] statistic of `stats`.
pub(super) fn exact_values(stats: &DeviceStats, value: fn(&Stat) -> i64) -> [i64; EXACT_PEAKS] {
    [
        value(&stats.allocated_bytes[0]),
        value(&stats.reserved_bytes[0]),
        value(&stats.active_bytes[0]),
        value(&stats.requested_bytes[0]),
    ]
}

pub(super) fn exact_currents(stats: &DeviceStats) -> [i64; EXACT_PEAKS] {
    exact_values(stats, |s| s.current)
}

/// The [`EXACT_PEAKS`] currents summed over the shards' `stats`.
pub(super) fn summed_currents<'a>(
    stats: impl IntoIterator<Item = &'a DeviceStats>,
) -> [i64; EXACT_PEAKS] {
    let mut sum = [0; EXACT_PEAKS];
    for stats in stats {
        for (total, value) in sum.iter_mut().zip(exact_currents(stats)) {
            *total += value;
        }
    }
    sum
}

pub(super) fn exact_stats(stats: &mut DeviceStats) -> [&mut Stat; EXACT_PEAKS] {
    let DeviceStats {
        allocated_bytes,
        reserved_bytes,
        active_bytes,
        requested_bytes,
        ..
    } = stats;
    [
        &mut allocated_bytes[0],
        &mut reserved_bytes[0],
        &mut active_bytes[0],
        &mut requested_bytes[0],
    ]
}

/// The exact peaks of the [`EXACT_PEAKS`] statistics summed over shards.
///
/// The sum of each shard's peak overstates the device's peak whenever two
/// streams on different shards peak at different times. While one shard is
/// all that ever allocated, that sum is exact and costs nothing; once a
/// second shard allocates, every shard operation adds its change of the
/// statistics here, under its shard's lock, and the peak is the highest sum
/// seen. A few atomic adds per operation, paid only by programs that
/// allocate on several shards; only these four, because tracking every
/// statistic puts atomics on several cache lines that every shard writes on
/// every call (measurements: `docs/engine-notes.md`).
pub(super) struct CombinedPeaks {
    /// The first shard that allocated (`usize::MAX`: none yet).
    pub(super) first_shard: AtomicUsize,
    /// Set (under every shard's lock) once a second shard allocates.
    pub(super) tracking: AtomicBool,
    pub(super) current: [AtomicI64; EXACT_PEAKS],
    pub(super) peak: [AtomicI64; EXACT_PEAKS],
}

impl CombinedPeaks {
    pub(super) fn new() -> Self {
        CombinedPeaks {
            first_shard: AtomicUsize::new(usize::MAX),
            tracking: AtomicBool::new(false),
            current: Default::default(),
            peak: Default::default(),
        }
    }

    /// A shard's statistics went from `before` to `after`.
    pub(super) fn apply(&self, before: [i64; EXACT_PEAKS], after: [i64; EXACT_PEAKS]) {
        for k in 0..EXACT_PEAKS {
            let delta = after[k] - before[k];
            if delta != 0 {
                let now = self.current[k].fetch_add(delta, Ordering::Relaxed) + delta;
                // A read before the write: most changes set no new peak.
                if delta > 0 && now > self.peak[k].load(Ordering::Relaxed) {
                    self.peak[k].fetch_max(now, Ordering::Relaxed);
                }
            }
        }
    }
}

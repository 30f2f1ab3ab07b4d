//! Thread-safe allocators: many threads, many streams, no global lock on the hot path.
//!
//! [`SharedAllocator`] shards the engine by stream. Both policies already keep
//! memory owned by the stream that allocated it (reuse on another stream needs
//! synchronization), so giving each group of streams its own [`Allocator`]
//! changes no reuse decision: it only removes the lock that PyTorch takes for
//! every call on a device. A sharded pointer map routes each `free` to the
//! shard that owns the pointer. When a shard runs out of memory, the other
//! shards' caches are released and the request retried, so cached memory held
//! by one stream never causes another stream's out-of-memory error.
//!
//! What sharding does change: statistics are summed over shards, so most
//! `peak` values are upper bounds (the sum of each shard's peak; exact when
//! one stream does all the work, as in most training loops). The peaks that
//! `max_memory_allocated()` and `max_memory_reserved()` read are kept exact
//! (see `CombinedPeaks`). A memory fraction is
//! enforced on the memory of all shards together by [`LimitedDevice`], under
//! the shards, and each shard's policy also sees it (for PyTorch's garbage
//! collection threshold). With one shard the behaviour is exactly the
//! single-lock engine's.

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::allocator::{Allocator, AllocatorConfig};
use crate::device::{
    CallKind, Device, DeviceError, DeviceErrorKind, DevicePtr, DeviceResult, EventId, MemoryInfo,
    PhysicalHandle, StreamId,
};
use crate::error::AllocError;
use crate::snapshot::Snapshot;
use crate::stats::{DeviceStats, Stat};
use crate::{FastMap, PointerHasher};

/// The calls a thread-safe allocator offers. Implemented by
/// [`SharedAllocator`] and by `Mutex<Allocator<D>>` (the single-lock baseline
/// benchmarks compare against).
pub trait ThreadSafeAllocator: Send + Sync {
    /// Allocates `size` bytes for use on `stream`.
    fn malloc(&self, size: u64, stream: StreamId) -> Result<DevicePtr, AllocError>;
    /// Frees `ptr`.
    fn free(&self, ptr: DevicePtr) -> Result<(), AllocError>;
    /// Declares that `ptr` is used on `stream` too.
    fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<(), AllocError>;
    /// Returns every wholly free cached segment or page to the driver.
    fn empty_cache(&self) -> Result<(), AllocError>;
    /// PyTorch-compatible statistics.
    fn stats(&self) -> DeviceStats;
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic in another thread cannot leave an allocator half-updated in a
    // way later calls could not detect (`check_invariants` would say so), and
    // refusing every later call would lose track of live memory.
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl<D: Device> ThreadSafeAllocator for Mutex<Allocator<D>> {
    fn malloc(&self, size: u64, stream: StreamId) -> Result<DevicePtr, AllocError> {
        lock(self).malloc(size, stream)
    }
    fn free(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        lock(self).free(ptr)
    }
    fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<(), AllocError> {
        lock(self).record_stream(ptr, stream)
    }
    fn empty_cache(&self) -> Result<(), AllocError> {
        lock(self).empty_cache()
    }
    fn stats(&self) -> DeviceStats {
        lock(self).stats().clone()
    }
}

/// A device shared by several allocators, with a limit on the memory they
/// hold together (segments plus physical memory). Past the limit it answers
/// out-of-memory, so each allocator's usual retry path releases its cache.
pub struct LimitedDevice<D: Device> {
    inner: D,
    held_bytes: AtomicU64,
    limit_bytes: AtomicU64,
    /// Sizes of physical memory, which `physical_release` does not repeat.
    physical_sizes: Mutex<HashMap<PhysicalHandle, u64>>,
}

impl<D: Device> LimitedDevice<D> {
    /// `inner` with no limit.
    pub fn new(inner: D) -> Self {
        LimitedDevice {
            inner,
            held_bytes: AtomicU64::new(0),
            limit_bytes: AtomicU64::new(u64::MAX),
            physical_sizes: Mutex::new(HashMap::new()),
        }
    }

    /// The device underneath.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// Limits the memory held through this device to `bytes`.
    pub fn set_limit(&self, bytes: u64) {
        self.limit_bytes.store(bytes, Ordering::SeqCst);
    }

    /// Bytes held through this device now.
    pub fn held_bytes(&self) -> u64 {
        self.held_bytes.load(Ordering::SeqCst)
    }

    /// Reserves `size` bytes under the limit, or answers out-of-memory.
    fn charge(&self, call: CallKind, size: u64) -> DeviceResult<()> {
        let limit = self.limit_bytes.load(Ordering::SeqCst);
        let before = self.held_bytes.fetch_add(size, Ordering::SeqCst);
        if before.saturating_add(size) > limit {
            self.held_bytes.fetch_sub(size, Ordering::SeqCst);
            return Err(DeviceError::new(
                call,
                DeviceErrorKind::OutOfMemory,
                format!("the memory fraction allows {limit} bytes; {before} are held"),
            ));
        }
        Ok(())
    }

    fn refund(&self, size: u64) {
        self.held_bytes.fetch_sub(size, Ordering::SeqCst);
    }
}

impl<D: Device> Device for LimitedDevice<D> {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn memory_info(&self) -> DeviceResult<MemoryInfo> {
        self.inner.memory_info()
    }
    fn segment_alloc(&self, size: u64) -> DeviceResult<DevicePtr> {
        self.charge(CallKind::SegmentAlloc, size)?;
        self.inner
            .segment_alloc(size)
            .inspect_err(|_| self.refund(size))
    }
    fn segment_free(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        self.inner.segment_free(ptr, size)?;
        self.refund(size);
        Ok(())
    }
    fn granularity(&self) -> Option<u64> {
        self.inner.granularity()
    }
    fn address_reserve(&self, size: u64) -> DeviceResult<DevicePtr> {
        self.inner.address_reserve(size)
    }
    fn address_free(&self, base: DevicePtr, size: u64) -> DeviceResult<()> {
        self.inner.address_free(base, size)
    }
    fn physical_create(&self, size: u64) -> DeviceResult<PhysicalHandle> {
        self.charge(CallKind::PhysicalCreate, size)?;
        let handle = self
            .inner
            .physical_create(size)
            .inspect_err(|_| self.refund(size))?;
        lock(&self.physical_sizes).insert(handle, size);
        Ok(handle)
    }
    fn physical_release(&self, handle: PhysicalHandle) -> DeviceResult<()> {
        self.inner.physical_release(handle)?;
        if let Some(size) = lock(&self.physical_sizes).remove(&handle) {
            self.refund(size);
        }
        Ok(())
    }
    fn map(
        &self,
        va: DevicePtr,
        size: u64,
        handle: PhysicalHandle,
        offset: u64,
    ) -> DeviceResult<()> {
        self.inner.map(va, size, handle, offset)
    }
    fn maps_handle_parts(&self) -> bool {
        self.inner.maps_handle_parts()
    }
    fn set_access(&self, va: DevicePtr, size: u64) -> DeviceResult<()> {
        self.inner.set_access(va, size)
    }
    fn unmap(&self, va: DevicePtr, size: u64) -> DeviceResult<()> {
        self.inner.unmap(va, size)
    }
    fn record_event(&self, stream: StreamId) -> DeviceResult<EventId> {
        self.inner.record_event(stream)
    }
    fn query_event(&self, event: EventId) -> DeviceResult<bool> {
        self.inner.query_event(event)
    }
    fn synchronize_event(&self, event: EventId) -> DeviceResult<()> {
        self.inner.synchronize_event(event)
    }
    fn synchronize_device(&self) -> DeviceResult<()> {
        self.inner.synchronize_device()
    }
}

/// The aggregate byte statistics whose peaks [`SharedAllocator`] keeps
/// exact across shards: what `max_memory_allocated()`,
/// `max_memory_reserved()` and the peaks of `memory_summary()`'s byte rows
/// read.
const EXACT_PEAKS: usize = 4;

/// `value` of each [`EXACT_PEAKS`] statistic of `stats`.
fn exact_values(stats: &DeviceStats, value: fn(&Stat) -> i64) -> [i64; EXACT_PEAKS] {
    [
        value(&stats.allocated_bytes[0]),
        value(&stats.reserved_bytes[0]),
        value(&stats.active_bytes[0]),
        value(&stats.requested_bytes[0]),
    ]
}

fn exact_currents(stats: &DeviceStats) -> [i64; EXACT_PEAKS] {
    exact_values(stats, |s| s.current)
}

/// The [`EXACT_PEAKS`] currents summed over the shards' `stats`.
fn summed_currents<'a>(stats: impl IntoIterator<Item = &'a DeviceStats>) -> [i64; EXACT_PEAKS] {
    let mut sum = [0; EXACT_PEAKS];
    for stats in stats {
        for (total, value) in sum.iter_mut().zip(exact_currents(stats)) {
            *total += value;
        }
    }
    sum
}

fn exact_stats(stats: &mut DeviceStats) -> [&mut Stat; EXACT_PEAKS] {
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
/// allocate on several shards. Measured with `hbmalloc bench-threads`
/// (medians of 3 interleaved runs, the build of e08343f against this one, on a
/// 2-core machine), sharded, in millions of operations per second: traces
/// 7.60 / 7.49 / 9.00 -> 8.05 / 7.64 / 7.78 with 2 / 4 / 8 threads,
/// small-block churn 5.54 / 6.23 / 5.80 -> 6.25 / 5.78 / 5.26: noise at 2
/// and 4 threads, about 10% at 8, still above one lock per device (2.7 to
/// 5.7 in the same runs). Without the read before `fetch_max`, the 2-thread
/// figures halved; without the read before the first-shard
/// compare-exchange (a write on every malloc), churn lost 10-25%.
///
/// Why only these four: the same tracking for every statistic (the 29 with
/// a peak: counts, and each pool) or for the 9 aggregate ones made the
/// sharded allocator 3.5 and 2 times slower at 2 to 8 threads, below one
/// lock per device (`hbmalloc bench-threads`, stop 23: traces 6.4-7.5 ->
/// 1.7-1.9 and 2.8 Mops/s); their atomics span several cache lines that
/// every shard writes on every call. Those peaks stay sums of the shards'.
struct CombinedPeaks {
    /// The first shard that allocated (`usize::MAX`: none yet).
    first_shard: AtomicUsize,
    /// Set (under every shard's lock) once a second shard allocates.
    tracking: AtomicBool,
    current: [AtomicI64; EXACT_PEAKS],
    peak: [AtomicI64; EXACT_PEAKS],
}

impl CombinedPeaks {
    fn new() -> Self {
        CombinedPeaks {
            first_shard: AtomicUsize::new(usize::MAX),
            tracking: AtomicBool::new(false),
            current: Default::default(),
            peak: Default::default(),
        }
    }

    /// A shard's statistics went from `before` to `after`.
    fn apply(&self, before: [i64; EXACT_PEAKS], after: [i64; EXACT_PEAKS]) {
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

/// Shards of the pointer map: enough that threads rarely meet on one.
const OWNER_SHARDS: usize = 64;

/// One engine shard: an allocator over the shared, limited device.
type Shard<D> = Mutex<Allocator<Arc<LimitedDevice<D>>>>;

/// An allocator for one device, shared by many threads. See the module docs.
pub struct SharedAllocator<D: Device> {
    device: Arc<LimitedDevice<D>>,
    shards: Box<[Shard<D>]>,
    /// Which shard owns each live pointer, sharded by pointer.
    owners: Box<[Mutex<FastMap<DevicePtr, u32>>]>,
    peaks: CombinedPeaks,
}

impl<D: Device> SharedAllocator<D> {
    /// An allocator over `device` with `shards` independent engines (at least 1).
    pub fn new(device: D, config: AllocatorConfig, shards: usize) -> Result<Self, AllocError> {
        let device = Arc::new(LimitedDevice::new(device));
        let shards = (0..shards.max(1))
            .map(|_| Allocator::new(Arc::clone(&device), config.clone()).map(Mutex::new))
            .collect::<Result<Vec<_>, _>>()?
            .into_boxed_slice();
        let owners = (0..OWNER_SHARDS)
            .map(|_| Mutex::new(FastMap::default()))
            .collect();
        Ok(SharedAllocator {
            device,
            shards,
            owners,
            peaks: CombinedPeaks::new(),
        })
    }

    /// Runs `f` on shard `index` under its lock, keeping the combined peaks
    /// in step once they are tracked.
    fn on_shard<R>(
        &self,
        index: usize,
        f: impl FnOnce(&mut Allocator<Arc<LimitedDevice<D>>>) -> R,
    ) -> R {
        let mut shard = lock(&self.shards[index]);
        // Set only under every shard's lock, so this one orders it.
        if !self.peaks.tracking.load(Ordering::Relaxed) {
            return f(&mut shard);
        }
        let before = exact_currents(shard.stats());
        let result = f(&mut shard);
        self.peaks.apply(before, exact_currents(shard.stats()));
        result
    }

    /// Shard `home` has allocated: from the second shard that does, every
    /// shard operation keeps the combined peaks (see [`CombinedPeaks`]).
    fn note_allocating_shard(&self, home: usize) {
        if self.peaks.tracking.load(Ordering::Relaxed) {
            return;
        }
        // A read first: every malloc comes here until a second shard
        // allocates, and a compare-exchange is a write to a shared line.
        let mut first = self.peaks.first_shard.load(Ordering::Relaxed);
        if first == usize::MAX {
            first = match self.peaks.first_shard.compare_exchange(
                usize::MAX,
                home,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => home,
                Err(first) => first,
            };
        }
        if first == home {
            return;
        }
        let shards: Vec<_> = self.shards.iter().map(lock).collect();
        if self.peaks.tracking.load(Ordering::Relaxed) {
            return;
        }
        // Until now shards have allocated one after another: the device's
        // peak is the highest of each shard's own and of the sum now.
        for (k, current) in summed_currents(shards.iter().map(|s| s.stats()))
            .into_iter()
            .enumerate()
        {
            let own_peak = shards
                .iter()
                .map(|s| exact_values(s.stats(), |s| s.peak)[k])
                .max()
                .unwrap_or(0);
            self.peaks.current[k].store(current, Ordering::Relaxed);
            self.peaks.peak[k].store(own_peak.max(current), Ordering::Relaxed);
        }
        self.peaks.tracking.store(true, Ordering::Relaxed);
    }

    /// The device.
    pub fn device(&self) -> &D {
        self.device.inner()
    }

    /// The policy and configuration (`policy:hbm,...`).
    pub fn settings(&self) -> String {
        lock(&self.shards[0]).settings()
    }

    /// Number of engine shards.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    fn hash(value: u64) -> u64 {
        BuildHasherDefault::<PointerHasher>::default().hash_one(value)
    }

    fn shard_of_stream(&self, stream: StreamId) -> usize {
        (Self::hash(stream.0) % self.shards.len() as u64) as usize
    }

    fn owners_of(&self, ptr: DevicePtr) -> &Mutex<FastMap<DevicePtr, u32>> {
        &self.owners[(Self::hash(ptr) % OWNER_SHARDS as u64) as usize]
    }

    fn owner(&self, ptr: DevicePtr) -> Result<usize, AllocError> {
        lock(self.owners_of(ptr))
            .get(&ptr)
            .map(|&s| s as usize)
            .ok_or(AllocError::UnknownPointer { ptr })
    }

    /// The snapshot of every shard, segments in address order.
    pub fn snapshot(&self) -> Snapshot {
        let mut out = Snapshot::default();
        for shard in self.shards.iter() {
            let snap = lock(shard).snapshot();
            out.segments.extend(snap.segments);
            out.history.extend(snap.history);
            out.settings = snap.settings;
        }
        out.segments.sort_by_key(|s| s.address);
        out
    }

    /// Limits the memory of all shards together to `fraction` of the device.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<(), AllocError> {
        for shard in self.shards.iter() {
            lock(shard).set_memory_fraction(fraction)?;
        }
        let total = self.device.memory_info()?.total_bytes;
        self.device.set_limit((fraction * total as f64) as u64);
        Ok(())
    }

    /// `reset_peak_memory_stats()` on every shard: each peak becomes the
    /// current value.
    pub fn reset_peak_stats(&self) {
        let mut shards: Vec<_> = self.shards.iter().map(lock).collect();
        for shard in shards.iter_mut() {
            shard.reset_peak_stats();
        }
        for k in 0..EXACT_PEAKS {
            let current = self.peaks.current[k].load(Ordering::Relaxed);
            self.peaks.peak[k].store(current, Ordering::Relaxed);
        }
    }

    /// `reset_accumulated_memory_stats()` on every shard.
    pub fn reset_accumulated_stats(&self) {
        for shard in self.shards.iter() {
            lock(shard).reset_accumulated_stats();
        }
    }

    /// [`Allocator::set_history_entries`] on every shard.
    pub fn set_history_entries(&self, entries: usize, clear: bool) {
        for shard in self.shards.iter() {
            lock(shard).set_history_entries(entries, clear);
        }
    }

    /// The largest request this allocator could serve now without freeing
    /// anything (PyTorch's `cacheInfo`, which cuDNN's benchmark mode asks
    /// for to bound the workspaces it tries): the largest free block any
    /// shard caches ([`Allocator::largest_free_block_bytes`]), or the memory
    /// the driver could still hand out within the memory fraction, if that
    /// is more. Like PyTorch's answer, the second is an upper bound (free
    /// device memory need not come in one piece on a driver without virtual
    /// memory).
    pub fn largest_free_block_bytes(&self) -> Result<u64, AllocError> {
        let cached = self
            .shards
            .iter()
            .map(|shard| lock(shard).largest_free_block_bytes())
            .max()
            .unwrap_or(0);
        let device_free = self.device.memory_info()?.free_bytes;
        let within_limit = self
            .device
            .limit_bytes
            .load(Ordering::SeqCst)
            .saturating_sub(self.device.held_bytes());
        Ok(cached.max(device_free.min(within_limit)))
    }

    /// The share of the device's memory all shards together may hold.
    pub fn memory_fraction(&self) -> f64 {
        lock(&self.shards[0]).memory_fraction()
    }

    /// Checks every shard's invariants, and that the pointer map names
    /// exactly the live allocations.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut live = 0i64;
        let mut reserved = 0i64;
        for (i, shard) in self.shards.iter().enumerate() {
            let shard = lock(shard);
            shard
                .check_invariants()
                .map_err(|e| format!("shard {i}: {e}"))?;
            live += shard.stats().allocation[0].current;
            reserved += shard.stats().reserved_bytes[0].current;
        }
        if reserved as u64 != self.device.held_bytes() {
            return Err(format!(
                "shards reserve {reserved} bytes but hold {} from the device",
                self.device.held_bytes()
            ));
        }
        if self.peaks.tracking.load(Ordering::Relaxed) {
            let shards: Vec<_> = self.shards.iter().map(lock).collect();
            let sums = summed_currents(shards.iter().map(|s| s.stats()));
            for (k, &sum) in sums.iter().enumerate() {
                let (current, peak) = (
                    self.peaks.current[k].load(Ordering::Relaxed),
                    self.peaks.peak[k].load(Ordering::Relaxed),
                );
                if current != sum || peak < current {
                    return Err(format!(
                        "combined statistic {k}: current {current} and peak {peak}, but the shards hold {sum}"
                    ));
                }
            }
        }
        let mapped: usize = self.owners.iter().map(|o| lock(o).len()).sum();
        if mapped as i64 != live {
            return Err(format!(
                "pointer map holds {mapped} pointers but shards hold {live} allocations"
            ));
        }
        Ok(())
    }
}

impl<D: Device> ThreadSafeAllocator for SharedAllocator<D> {
    fn malloc(&self, size: u64, stream: StreamId) -> Result<DevicePtr, AllocError> {
        let home = self.shard_of_stream(stream);
        let first = self.on_shard(home, |a| a.malloc(size, stream));
        let ptr = match first {
            Ok(ptr) => ptr,
            Err(AllocError::OutOfMemory(_)) if self.shards.len() > 1 => {
                // Other shards may be caching what this one needs.
                for i in 0..self.shards.len() {
                    if i != home {
                        self.on_shard(i, |a| a.empty_cache())?;
                    }
                }
                self.on_shard(home, |a| a.malloc(size, stream))?
            }
            Err(e) => return Err(e),
        };
        lock(self.owners_of(ptr)).insert(ptr, home as u32);
        self.note_allocating_shard(home);
        Ok(ptr)
    }

    fn free(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        let shard = lock(self.owners_of(ptr))
            .remove(&ptr)
            .ok_or(AllocError::UnknownPointer { ptr })?;
        self.on_shard(shard as usize, |a| a.free(ptr))
    }

    fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<(), AllocError> {
        let shard = self.owner(ptr)?;
        self.on_shard(shard, |a| a.record_stream(ptr, stream))
    }

    fn empty_cache(&self) -> Result<(), AllocError> {
        for i in 0..self.shards.len() {
            self.on_shard(i, |a| a.empty_cache())?;
        }
        Ok(())
    }

    fn stats(&self) -> DeviceStats {
        let mut total = DeviceStats::default();
        for (i, shard) in self.shards.iter().enumerate() {
            let shard = lock(shard);
            let s = shard.stats();
            if i == 0 {
                total.max_split_size = s.max_split_size;
            }
            total.accumulate(s);
        }
        if self.peaks.tracking.load(Ordering::Relaxed) {
            for (stat, peak) in exact_stats(&mut total).into_iter().zip(&self.peaks.peak) {
                // Read after the shards: a peak reached since is at least as high.
                stat.peak = peak.load(Ordering::Relaxed).max(stat.current);
            }
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocator::PolicyConfig;
    use crate::sim::SimDevice;

    const MIB: u64 = 1 << 20;

    fn shared(settings: &str) -> SharedAllocator<SimDevice> {
        let config = AllocatorConfig {
            policy: PolicyConfig::from_settings(settings).unwrap(),
            history_entries: 0,
        };
        SharedAllocator::new(SimDevice::new(), config, 8).unwrap()
    }

    /// Two streams whose allocations go to different shards.
    fn streams_on_two_shards(alloc: &SharedAllocator<SimDevice>) -> (StreamId, StreamId) {
        let a = StreamId(1);
        let b = (2..)
            .map(StreamId)
            .find(|&s| alloc.shard_of_stream(s) != alloc.shard_of_stream(a))
            .unwrap();
        (a, b)
    }

    #[test]
    fn peaks_of_streams_on_two_shards_are_the_devices_not_their_sum() {
        for settings in ["policy:pytorch", "policy:hbm"] {
            let alloc = shared(settings);
            let (a, b) = streams_on_two_shards(&alloc);
            // One after the other: the device never holds both.
            let p = alloc.malloc(10 * MIB, a).unwrap();
            alloc.free(p).unwrap();
            let q = alloc.malloc(10 * MIB, b).unwrap();
            alloc.free(q).unwrap();
            let stats = alloc.stats();
            assert_eq!(stats.allocated_bytes[0].peak, 10 * MIB as i64, "{settings}");
            assert_eq!(stats.active_bytes[0].peak, 10 * MIB as i64, "{settings}");
            assert_eq!(stats.requested_bytes[0].peak, 10 * MIB as i64, "{settings}");
            // The per-pool peaks stay sums (upper bounds).
            assert_eq!(stats.allocated_bytes[2].peak, 20 * MIB as i64, "{settings}");
            // Together: both count.
            let p = alloc.malloc(10 * MIB, a).unwrap();
            let q = alloc.malloc(30 * MIB, b).unwrap();
            assert_eq!(alloc.stats().allocated_bytes[0].peak, 40 * MIB as i64);
            alloc.check_invariants().unwrap();
            alloc.free(p).unwrap();
            alloc.reset_peak_stats();
            assert_eq!(alloc.stats().allocated_bytes[0].peak, 30 * MIB as i64);
            alloc.free(q).unwrap();
            alloc.empty_cache().unwrap();
            let stats = alloc.stats();
            assert_eq!(stats.reserved_bytes[0].current, 0, "{settings}");
            assert!(
                stats.reserved_bytes[0].peak >= 40 * MIB as i64,
                "{settings}"
            );
            alloc.check_invariants().unwrap();
        }
    }

    #[test]
    fn one_shard_needs_no_tracking() {
        let alloc = shared("policy:hbm");
        let p = alloc.malloc(10 * MIB, StreamId(1)).unwrap();
        alloc.free(p).unwrap();
        let p = alloc.malloc(4 * MIB, StreamId(1)).unwrap();
        assert!(!alloc.peaks.tracking.load(Ordering::Relaxed));
        assert_eq!(alloc.stats().allocated_bytes[0].peak, 10 * MIB as i64);
        alloc.free(p).unwrap();
    }
}

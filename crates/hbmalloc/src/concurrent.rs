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
//!
//! Private memory pools (PyTorch's `MemPool`, and the pool a CUDA graph
//! capture allocates from) are engines of their own beside the shards, made
//! on request ([`SharedAllocator::create_or_incref_pool`]) and routed to by
//! the caller ([`SharedAllocator::malloc_in_pool`]; frees find them through
//! the pointer map). Like PyTorch's private pools they use policy `pytorch`
//! without expandable segments: a captured graph keeps using the addresses
//! of its pool's blocks, freed or not, at every replay, so a pool's memory
//! is never remapped, stitched elsewhere or given back while the pool is
//! held, and only memory of the same pool is reused for it. Once released
//! by every holder ([`SharedAllocator::release_pool`]) its cache is given
//! back, and the pool goes away with its last allocation.

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::allocator::{Allocator, AllocatorConfig, PolicyConfig};
use crate::config::PytorchConfig;
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

/// A private memory pool's id: PyTorch's `MempoolId_t`, a pair (a graph
/// capture's pool is `(capture id, 0)`, a `torch.cuda.MemPool`'s `(0, id)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolId(pub u64, pub u64);

/// A private memory pool: its engine and how many hold it.
struct PrivatePool<D: Device> {
    id: PoolId,
    shard: Arc<Shard<D>>,
    /// Graphs and `MemPool` objects holding the pool (PyTorch's `use_count`).
    use_count: u32,
}

/// The private pools of a device, in slots: a pointer's owner is
/// `shards.len() + slot`. A slot is emptied only when its pool holds no
/// allocation and no caller holds its engine (every handle to it is taken
/// under this lock), so no owner entry ever names an emptied slot.
struct PrivatePools<D: Device> {
    slots: Vec<Option<PrivatePool<D>>>,
    /// Settings a new pool starts with (history entries, as last set).
    config: AllocatorConfig,
    /// The statistics of the pools that went away (their counters and
    /// peaks; every current value was 0), so that no counter goes back.
    retired: DeviceStats,
}

/// An allocator for one device, shared by many threads. See the module docs.
pub struct SharedAllocator<D: Device> {
    device: Arc<LimitedDevice<D>>,
    shards: Box<[Shard<D>]>,
    /// Which shard owns each live pointer, sharded by pointer.
    owners: Box<[Mutex<FastMap<DevicePtr, u32>>]>,
    peaks: CombinedPeaks,
    /// Locked after `captures_underway` (when both are) and before any
    /// engine's lock, never after one.
    pools: Mutex<PrivatePools<D>>,
    /// Captures underway (see [`crate::capture`]): held while every engine
    /// is told that the count went from 0 to 1 or back.
    captures_underway: Mutex<u32>,
}

impl<D: Device> SharedAllocator<D> {
    /// An allocator over `device` with `shards` independent engines (at least 1).
    pub fn new(device: D, config: AllocatorConfig, shards: usize) -> Result<Self, AllocError> {
        let device = Arc::new(LimitedDevice::new(device));
        let pools = Mutex::new(PrivatePools {
            slots: Vec::new(),
            retired: DeviceStats::default(),
            config: AllocatorConfig {
                policy: PolicyConfig::Pytorch(private_pool_config(&config.policy)),
                history_entries: config.history_entries,
            },
        });
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
            pools,
            captures_underway: Mutex::new(0),
        })
    }

    /// Runs `f` on shard `index` under its lock, keeping the combined peaks
    /// in step once they are tracked.
    fn on_shard<R>(
        &self,
        index: usize,
        f: impl FnOnce(&mut Allocator<Arc<LimitedDevice<D>>>) -> R,
    ) -> R {
        self.on_engine(&self.shards[index], f)
    }

    /// [`SharedAllocator::on_shard`] for any engine of this device (a shard
    /// or a private pool).
    fn on_engine<R>(
        &self,
        engine: &Shard<D>,
        f: impl FnOnce(&mut Allocator<Arc<LimitedDevice<D>>>) -> R,
    ) -> R {
        let mut shard = lock(engine);
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
        self.start_tracking();
    }

    /// From now on every engine operation keeps the combined peaks (see
    /// [`CombinedPeaks`]).
    fn start_tracking(&self) {
        let pools = lock(&self.pools);
        let pool_shards: Vec<Arc<Shard<D>>> = pools
            .slots
            .iter()
            .flatten()
            .map(|p| Arc::clone(&p.shard))
            .collect();
        let shards: Vec<_> = self
            .shards
            .iter()
            .chain(pool_shards.iter().map(|s| &**s))
            .map(lock)
            .collect();
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

    /// The engines of the private pools now, with their owner indices.
    fn pool_engines(&self) -> Vec<(u32, Arc<Shard<D>>)> {
        self.pool_engines_where(|_| true)
    }

    /// The engines of the private pools that `keep` accepts, with their
    /// owner indices.
    fn pool_engines_where(
        &self,
        keep: impl Fn(&PrivatePool<D>) -> bool,
    ) -> Vec<(u32, Arc<Shard<D>>)> {
        let base = self.shards.len() as u32;
        lock(&self.pools)
            .slots
            .iter()
            .enumerate()
            .filter_map(|(slot, p)| {
                p.as_ref()
                    .filter(|p| keep(p))
                    .map(|p| (base + slot as u32, Arc::clone(&p.shard)))
            })
            .collect()
    }

    /// Every engine of this device: the shards, then the private pools.
    fn engines(&self) -> Vec<EngineRef<'_, D>> {
        self.shards
            .iter()
            .map(EngineRef::Shard)
            .chain(
                self.pool_engines()
                    .into_iter()
                    .map(|(_, e)| EngineRef::Pool(e)),
            )
            .collect()
    }

    /// The engine that owns pointers of owner index `owner`.
    fn engine_of(&self, owner: u32) -> Result<EngineRef<'_, D>, AllocError> {
        let owner = owner as usize;
        if let Some(shard) = self.shards.get(owner) {
            return Ok(EngineRef::Shard(shard));
        }
        lock(&self.pools)
            .slots
            .get(owner - self.shards.len())
            .and_then(|p| p.as_ref())
            .map(|p| EngineRef::Pool(Arc::clone(&p.shard)))
            .ok_or_else(|| {
                AllocError::Device(DeviceError::new(
                    CallKind::Setup,
                    DeviceErrorKind::Driver("hbmalloc internal error".into()),
                    format!("a pointer names engine {owner}, which does not exist"),
                ))
            })
    }

    /// `createOrIncrefPool`: makes the private pool `pool` (see the module
    /// docs), or counts one more holder of it.
    pub fn create_or_incref_pool(&self, pool: PoolId) -> Result<(), AllocError> {
        {
            // Lock order: the capture count, the pools, then any engine.
            let captures = lock(&self.captures_underway);
            let mut pools = lock(&self.pools);
            if let Some(existing) = pools.slots.iter_mut().flatten().find(|p| p.id == pool) {
                existing.use_count += 1;
                return Ok(());
            }
            let mut engine = Allocator::new(Arc::clone(&self.device), pools.config.clone())?;
            engine.set_memory_fraction(self.memory_fraction())?;
            if *captures > 0 {
                engine.set_capture_underway(true)?;
            }
            let entry = PrivatePool {
                id: pool,
                shard: Arc::new(Mutex::new(engine)),
                use_count: 1,
            };
            match pools.slots.iter().position(Option::is_none) {
                Some(slot) => pools.slots[slot] = Some(entry),
                None => pools.slots.push(Some(entry)),
            }
        }
        // Allocations of a pool and of the shards are summed exactly.
        self.start_tracking();
        Ok(())
    }

    /// How many hold `pool` (PyTorch's `getPoolUseCount`); 0 for none.
    pub fn pool_use_count(&self, pool: PoolId) -> u32 {
        lock(&self.pools)
            .slots
            .iter()
            .flatten()
            .find(|p| p.id == pool)
            .map_or(0, |p| p.use_count)
    }

    /// `releasePool`: one holder of `pool` fewer. When none is left, the
    /// pool's cached memory is given back (unless a capture is underway:
    /// then when the last one ends), and the pool goes away with its last
    /// allocation. Errors only for a pool that no one holds. Giving memory
    /// back is best effort here (PyTorch calls this from destructors):
    /// what the driver refuses waits for the next `empty_cache`.
    pub fn release_pool(&self, pool: PoolId) -> Result<(), AllocError> {
        {
            let mut pools = lock(&self.pools);
            let entry = pools
                .slots
                .iter_mut()
                .flatten()
                .find(|p| p.id == pool && p.use_count > 0)
                .ok_or(AllocError::UnknownPool { pool })?;
            entry.use_count -= 1;
            if entry.use_count > 0 {
                return Ok(());
            }
        }
        let captures = lock(&self.captures_underway);
        let _ = self.retire_released_pools(*captures);
        Ok(())
    }

    /// Unless a capture is underway (`captures`, read by the caller under
    /// the count's lock, which it holds so that none begins meanwhile):
    /// gives back the caches of the pools no one holds, and retires those
    /// left with no memory. A pool whose engine someone is using now (an
    /// allocation or a free in flight) stays until that caller comes here
    /// in turn. Every pool is tried; the first error is returned.
    fn retire_released_pools(&self, captures: u32) -> Result<(), AllocError> {
        if captures > 0 {
            return Ok(());
        }
        let mut first_error = Ok(());
        for (_, engine) in self.released_pool_engines() {
            let emptied = self.on_engine(&engine, |a| a.empty_cache());
            if first_error.is_ok() {
                first_error = emptied;
            }
        }
        let mut pools = lock(&self.pools);
        let PrivatePools { slots, retired, .. } = &mut *pools;
        for slot in slots.iter_mut() {
            let Some(pool) = slot.as_ref() else {
                continue;
            };
            // Every other handle to an engine is taken under this lock.
            if pool.use_count > 0 || Arc::strong_count(&pool.shard) > 1 {
                continue;
            }
            let engine = lock(&pool.shard);
            let stats = engine.stats();
            if stats.active[0].current == 0 && stats.reserved_bytes[0].current == 0 {
                retired.accumulate(stats);
                drop(engine);
                *slot = None;
            }
        }
        first_error
    }

    /// Allocates `size` bytes for use on `stream` from the private pool
    /// `pool` (made by [`SharedAllocator::create_or_incref_pool`]). When the
    /// pool's engine runs out of memory, the shards' caches (and those of
    /// released pools) are given back and the request retried.
    pub fn malloc_in_pool(
        &self,
        pool: PoolId,
        size: u64,
        stream: StreamId,
    ) -> Result<DevicePtr, AllocError> {
        let (owner, engine) = {
            let pools = lock(&self.pools);
            let base = self.shards.len() as u32;
            pools
                .slots
                .iter()
                .enumerate()
                .find_map(|(slot, p)| {
                    p.as_ref()
                        .filter(|p| p.id == pool && p.use_count > 0)
                        .map(|p| (base + slot as u32, Arc::clone(&p.shard)))
                })
                .ok_or(AllocError::UnknownPool { pool })?
        };
        let ptr = match self.on_engine(&engine, |a| a.malloc(size, stream)) {
            Err(AllocError::OutOfMemory(_)) if self.release_other_caches(owner)? => {
                self.on_engine(&engine, |a| a.malloc(size, stream))?
            }
            result => result?,
        };
        lock(self.owners_of(ptr)).insert(ptr, owner);
        Ok(ptr)
    }

    /// Gives back the cached memory of every engine but `except` that may
    /// give it back now: the shards and the pools no one holds, unless a
    /// capture is underway. True if any engine was asked.
    fn release_other_caches(&self, except: u32) -> Result<bool, AllocError> {
        // Held throughout: no capture begins while memory is given back.
        let captures = lock(&self.captures_underway);
        if *captures > 0 {
            return Ok(false);
        }
        let mut asked = false;
        for i in 0..self.shards.len() {
            if i as u32 != except {
                self.on_shard(i, |a| a.empty_cache())?;
                asked = true;
            }
        }
        if !self.released_pool_engines().is_empty() {
            self.retire_released_pools(*captures)?;
            asked = true;
        }
        Ok(asked)
    }

    /// The engines of the pools no one holds any more (waiting for their
    /// last allocations), with their owner indices.
    fn released_pool_engines(&self) -> Vec<(u32, Arc<Shard<D>>)> {
        self.pool_engines_where(|p| p.use_count == 0)
    }

    /// A CUDA graph capture begins on this device (PyTorch's
    /// `beginAllocateToPool`, which `torch.cuda.use_mem_pool` calls too):
    /// until the matching [`SharedAllocator::end_capture`], every engine
    /// keeps to [`crate::capture`]'s rules. Captures nest and overlap: the
    /// rules hold while any is underway.
    pub fn begin_capture(&self) -> Result<(), AllocError> {
        let mut count = lock(&self.captures_underway);
        *count += 1;
        if *count == 1 {
            self.tell_engines_capture(true)?;
        }
        Ok(())
    }

    /// A capture begun with [`SharedAllocator::begin_capture`] ended. When
    /// it was the last, the events of blocks freed meanwhile with uses on
    /// other streams are recorded, and the pools released meanwhile give
    /// their memory back (no capture can begin until they have). Errors if
    /// no capture was underway.
    pub fn end_capture(&self) -> Result<(), AllocError> {
        let mut count = lock(&self.captures_underway);
        if *count == 0 {
            return Err(AllocError::NoCaptureUnderway);
        }
        *count -= 1;
        if *count == 0 {
            self.tell_engines_capture(false)?;
            self.retire_released_pools(*count)?;
        }
        Ok(())
    }

    /// Whether a capture is underway on this device.
    pub fn capture_underway(&self) -> bool {
        *lock(&self.captures_underway) > 0
    }

    /// Every engine learns that captures began or ended. Called with the
    /// count's lock held, so no engine misses a change; each engine is told
    /// even if another reports an error (the first is returned).
    fn tell_engines_capture(&self, underway: bool) -> Result<(), AllocError> {
        let mut first_error = Ok(());
        for engine in self.engines() {
            let told = self.on_engine(engine.shard(), |a| a.set_capture_underway(underway));
            if first_error.is_ok() {
                first_error = told;
            }
        }
        first_error
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
        for engine in self.engines() {
            let snap = lock(engine.shard()).snapshot();
            out.segments.extend(snap.segments);
            out.history.extend(snap.history);
            out.settings = snap.settings;
        }
        out.segments.sort_by_key(|s| s.address);
        out
    }

    /// Limits the memory of all shards together to `fraction` of the device.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<(), AllocError> {
        for engine in self.engines() {
            lock(engine.shard()).set_memory_fraction(fraction)?;
        }
        let total = self.device.memory_info()?.total_bytes;
        self.device.set_limit((fraction * total as f64) as u64);
        Ok(())
    }

    /// `reset_peak_memory_stats()` on every shard: each peak becomes the
    /// current value.
    pub fn reset_peak_stats(&self) {
        lock(&self.pools).retired.reset_peak();
        let engines = self.engines();
        let mut shards: Vec<_> = engines.iter().map(|e| lock(e.shard())).collect();
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
        lock(&self.pools).retired.reset_accumulated();
        for engine in self.engines() {
            lock(engine.shard()).reset_accumulated_stats();
        }
    }

    /// [`Allocator::set_history_entries`] on every shard.
    pub fn set_history_entries(&self, entries: usize, clear: bool) {
        lock(&self.pools).config.history_entries = entries;
        for engine in self.engines() {
            lock(engine.shard()).set_history_entries(entries, clear);
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
        // A private pool's memory serves only that pool's requests.
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
        let engines = self.engines();
        for (i, engine) in engines.iter().enumerate() {
            let shard = lock(engine.shard());
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
            let shards: Vec<_> = engines.iter().map(|e| lock(e.shard())).collect();
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
            // Other engines may be caching what this one needs.
            Err(AllocError::OutOfMemory(_)) if self.release_other_caches(home as u32)? => {
                self.on_shard(home, |a| a.malloc(size, stream))?
            }
            Err(e) => return Err(e),
        };
        lock(self.owners_of(ptr)).insert(ptr, home as u32);
        self.note_allocating_shard(home);
        Ok(ptr)
    }

    fn free(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        let owner = lock(self.owners_of(ptr))
            .remove(&ptr)
            .ok_or(AllocError::UnknownPointer { ptr })?;
        let engine = self.engine_of(owner)?;
        let freed = self.on_engine(engine.shard(), |a| a.free(ptr));
        if let EngineRef::Pool(engine) = engine {
            // A released pool goes away with its last allocation.
            let released = lock(&self.pools)
                .slots
                .get(owner as usize - self.shards.len())
                .and_then(|p| p.as_ref())
                .is_some_and(|p| p.use_count == 0 && Arc::ptr_eq(&p.shard, &engine));
            drop(engine);
            if released {
                // The free is done; what is not given back now waits.
                let captures = lock(&self.captures_underway);
                let _ = self.retire_released_pools(*captures);
            }
        }
        freed
    }

    fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<(), AllocError> {
        let owner = self.owner(ptr)?;
        let engine = self.engine_of(owner as u32)?;
        self.on_engine(engine.shard(), |a| a.record_stream(ptr, stream))
    }

    /// Every shard's cache, and those of the pools no one holds; refused
    /// while a capture is underway.
    fn empty_cache(&self) -> Result<(), AllocError> {
        // Held throughout: no capture begins while memory is given back.
        let captures = lock(&self.captures_underway);
        if *captures > 0 {
            return Err(AllocError::CaptureUnderway {
                operation: "empty_cache",
            });
        }
        for i in 0..self.shards.len() {
            self.on_shard(i, |a| a.empty_cache())?;
        }
        self.retire_released_pools(*captures)
    }

    fn stats(&self) -> DeviceStats {
        let mut total = lock(&self.pools).retired.clone();
        for (i, engine) in self.engines().iter().enumerate() {
            let shard = lock(engine.shard());
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

/// A shard, or a private pool's engine (kept alive while used).
enum EngineRef<'a, D: Device> {
    Shard(&'a Shard<D>),
    Pool(Arc<Shard<D>>),
}

impl<D: Device> EngineRef<'_, D> {
    fn shard(&self) -> &Shard<D> {
        match self {
            EngineRef::Shard(shard) => shard,
            EngineRef::Pool(shard) => shard,
        }
    }
}

/// The policy of a private pool: `pytorch` without expandable segments, as
/// PyTorch's private pools (the user's `pytorch` settings otherwise).
fn private_pool_config(policy: &PolicyConfig) -> PytorchConfig {
    let mut config = match policy {
        PolicyConfig::Pytorch(config) => config.clone(),
        PolicyConfig::Hbm(_) => PytorchConfig::default(),
    };
    config.expandable_segments = false;
    config
}

// Read-only queries the C ABI answers PyTorch's pool checks with; kept
// apart from the allocator's own methods.
impl<D: Device> SharedAllocator<D> {
    /// The addresses of the live allocations (handed out, not yet freed) of
    /// the private pool `pool`, in address order; `None` when no such pool
    /// exists. PyTorch's `checkPoolLiveAllocations` compares them with the
    /// tensors a CUDA graph tree expects to be alive.
    pub fn pool_live_allocations(&self, pool: PoolId) -> Option<Vec<DevicePtr>> {
        let engine = lock(&self.pools)
            .slots
            .iter()
            .flatten()
            .find(|p| p.id == pool)
            .map(|p| Arc::clone(&p.shard))?;
        let snapshot = lock(&engine).snapshot();
        Some(
            snapshot
                .segments
                .iter()
                .flat_map(|s| &s.blocks)
                .filter(|b| b.state == crate::snapshot::BlockState::ActiveAllocated)
                .map(|b| b.address)
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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

    #[test]
    fn a_private_pool_reuses_only_its_own_memory_and_goes_with_its_last_holder() {
        for settings in ["policy:hbm", "policy:pytorch,expandable_segments:True"] {
            let alloc = shared(settings);
            let (pool, stream) = (PoolId(7, 0), StreamId(1));
            assert!(matches!(
                alloc.malloc_in_pool(pool, MIB, stream),
                Err(AllocError::UnknownPool { .. })
            ));
            alloc.create_or_incref_pool(pool).unwrap();
            alloc.create_or_incref_pool(pool).unwrap();
            assert_eq!(alloc.pool_use_count(pool), 2);
            let p = alloc.malloc_in_pool(pool, 9 * MIB, stream).unwrap();
            alloc.free(p).unwrap();
            // The pool's free memory is the graph's: not for the shards.
            let q = alloc.malloc(9 * MIB, stream).unwrap();
            assert_ne!(p, q, "{settings}");
            assert_eq!(alloc.malloc_in_pool(pool, 9 * MIB, stream).unwrap(), p);
            // A pool is PyTorch's plain segments (a 20 MiB one for requests
            // under 10 MiB), never expandable or stitched.
            let snapshot = alloc.snapshot();
            let segment = snapshot
                .segments
                .iter()
                .find(|s| s.address <= p && p < s.address + s.total_size)
                .unwrap();
            assert_eq!(segment.total_size, 20 * MIB, "{settings}");
            assert!(!segment.expandable, "{settings}");
            alloc.empty_cache().unwrap();
            let stats = alloc.stats();
            assert_eq!(stats.allocated_bytes[0].current, 18 * MIB as i64);
            alloc.check_invariants().unwrap();
            // Released by both holders with p still live: the pool stays
            // until p is freed, then gives its memory back.
            alloc.release_pool(pool).unwrap();
            alloc.release_pool(pool).unwrap();
            assert_eq!(alloc.pool_use_count(pool), 0);
            assert!(alloc.malloc_in_pool(pool, MIB, stream).is_err());
            alloc.check_invariants().unwrap();
            let reserved_with_pool = alloc.stats().reserved_bytes[0].current;
            alloc.free(p).unwrap();
            assert_eq!(
                alloc.stats().reserved_bytes[0].current,
                reserved_with_pool - 20 * MIB as i64,
                "{settings}"
            );
            assert!(alloc.pool_engines().is_empty(), "{settings}");
            assert!(matches!(
                alloc.release_pool(pool),
                Err(AllocError::UnknownPool { .. })
            ));
            alloc.free(q).unwrap();
            alloc.empty_cache().unwrap();
            let stats = alloc.stats();
            assert_eq!(stats.reserved_bytes[0].current, 0, "{settings}");
            assert_eq!(stats.allocated_bytes[0].peak, 18 * MIB as i64, "{settings}");
            alloc.check_invariants().unwrap();
        }
    }

    #[test]
    fn a_capture_covers_every_engine_and_a_pool_made_during_it() {
        let alloc = shared("policy:hbm");
        let (main, side) = (StreamId(1), StreamId(2));
        let p = alloc.malloc(4 * MIB, main).unwrap();
        alloc.record_stream(p, side).unwrap();
        alloc.begin_capture().unwrap();
        alloc.begin_capture().unwrap();
        let pool = PoolId(3, 0);
        alloc.create_or_incref_pool(pool).unwrap();
        let records = alloc.device().call_counts().get(CallKind::EventRecord);
        let g = alloc.malloc_in_pool(pool, MIB, main).unwrap();
        alloc.record_stream(g, side).unwrap();
        alloc.free(g).unwrap();
        alloc.free(p).unwrap();
        assert!(matches!(
            alloc.empty_cache(),
            Err(AllocError::CaptureUnderway { .. })
        ));
        alloc.end_capture().unwrap();
        assert!(alloc.capture_underway());
        assert_eq!(
            alloc.device().call_counts().get(CallKind::EventRecord),
            records
        );
        alloc.end_capture().unwrap();
        // Both deferred frees recorded their events at the end.
        assert_eq!(
            alloc.device().call_counts().get(CallKind::EventRecord),
            records + 2
        );
        assert!(alloc.end_capture().is_err());
        alloc.device().complete_all();
        alloc.release_pool(pool).unwrap();
        alloc.empty_cache().unwrap();
        assert_eq!(alloc.stats().reserved_bytes[0].current, 0);
        alloc.check_invariants().unwrap();
    }

    #[test]
    fn a_shard_out_of_memory_takes_back_a_released_pools_cache_but_not_a_held_one() {
        let config = AllocatorConfig {
            policy: PolicyConfig::from_settings("policy:pytorch").unwrap(),
            history_entries: 0,
        };
        let alloc = SharedAllocator::new(SimDevice::with_capacity(64 * MIB), config, 4).unwrap();
        let (held, released) = (PoolId(1, 0), PoolId(2, 0));
        alloc.create_or_incref_pool(held).unwrap();
        alloc.create_or_incref_pool(released).unwrap();
        let a = alloc.malloc_in_pool(held, 24 * MIB, StreamId(1)).unwrap();
        let b = alloc
            .malloc_in_pool(released, 24 * MIB, StreamId(1))
            .unwrap();
        alloc.free(a).unwrap();
        alloc.release_pool(released).unwrap();
        // b is live in the released pool: its segment stays until b goes.
        assert!(alloc.malloc(24 * MIB, StreamId(1)).is_err());
        alloc.free(b).unwrap();
        let c = alloc.malloc(24 * MIB, StreamId(1)).unwrap();
        // The held pool's cached segment was not taken.
        assert_eq!(
            alloc.malloc_in_pool(held, 24 * MIB, StreamId(1)).unwrap(),
            a
        );
        alloc.check_invariants().unwrap();
        for ptr in [a, c] {
            alloc.free(ptr).unwrap();
        }
    }

    #[test]
    fn counters_do_not_go_back_when_a_pool_goes_away_and_a_pool_is_released_once_per_holder() {
        let alloc = shared("policy:hbm");
        let pool = PoolId(0, 4);
        alloc.create_or_incref_pool(pool).unwrap();
        let p = alloc.malloc_in_pool(pool, 30 * MIB, StreamId(1)).unwrap();
        alloc.free(p).unwrap();
        let before = alloc.stats();
        assert_eq!(before.num_device_alloc, 1);
        alloc.release_pool(pool).unwrap();
        assert!(
            alloc.pool_engines().is_empty(),
            "released with nothing live: gone"
        );
        let after = alloc.stats();
        assert_eq!(after.reserved_bytes[0].current, 0);
        assert_eq!(after.num_device_alloc, 1);
        assert_eq!(after.num_device_free, 1);
        assert_eq!(
            after.allocation[0].allocated,
            before.allocation[0].allocated
        );
        assert_eq!(after.allocated_bytes[0].allocated, 30 * MIB as i64);
        assert_eq!(after.segment[0].peak, 1);
        // No holder left: a second release is an error, not a silent no-op.
        assert!(matches!(
            alloc.release_pool(pool),
            Err(AllocError::UnknownPool { .. })
        ));
        alloc.reset_accumulated_stats();
        assert_eq!(alloc.stats().num_device_alloc, 0);
        alloc.check_invariants().unwrap();
    }
}

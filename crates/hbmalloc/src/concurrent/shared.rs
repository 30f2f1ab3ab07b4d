//! [`SharedAllocator`]: engines sharded by stream, a sharded pointer map
//! routing each free to its engine, and statistics summed over them.

use std::hash::{BuildHasher, BuildHasherDefault};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::peaks::{
    exact_currents, exact_stats, exact_values, summed_currents, CombinedPeaks, EXACT_PEAKS,
};
use super::pools::{private_pool_config, PrivatePools};
use super::ThreadSafeAllocator;
use crate::adaptor::LimitedDevice;
use crate::allocator::{Allocator, AllocatorConfig, PolicyConfig};
use crate::device::{CallKind, Device, DeviceError, DeviceErrorKind, DevicePtr, StreamId};
use crate::error::AllocError;
use crate::fastmap::{FastMap, PointerHasher};
use crate::snapshot::Snapshot;
use crate::stats::DeviceStats;
use crate::sync::lock;

/// Shards of the pointer map: enough that threads rarely meet on one.
pub(super) const OWNER_SHARDS: usize = 64;

/// One engine shard: an allocator over the shared, limited device.
pub(super) type Shard<D> = Mutex<Allocator<Arc<LimitedDevice<D>>>>;

/// An allocator for one device, shared by many threads. See the module docs.
pub struct SharedAllocator<D: Device> {
    pub(super) device: Arc<LimitedDevice<D>>,
    pub(super) shards: Box<[Shard<D>]>,
    /// Which shard owns each live pointer, sharded by pointer.
    pub(super) owners: Box<[Mutex<FastMap<DevicePtr, u32>>]>,
    pub(super) peaks: CombinedPeaks,
    /// Locked after `captures_underway` (when both are) and before any
    /// engine's lock, never after one.
    pub(super) pools: Mutex<PrivatePools<D>>,
    /// Captures underway (see [`crate::capture`]): held while every engine
    /// is told that the count went from 0 to 1 or back.
    pub(super) captures_underway: Mutex<u32>,
    /// The history sequence every engine of this device numbers from, so
    /// a snapshot's history is one order.
    pub(super) history_clock: Arc<AtomicU64>,
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
        let history_clock = Arc::new(AtomicU64::new(0));
        let shards = (0..shards.max(1))
            .map(|_| {
                let mut engine = Allocator::new(Arc::clone(&device), config.clone())?;
                engine.share_history_clock(Arc::clone(&history_clock));
                Ok(Mutex::new(engine))
            })
            .collect::<Result<Vec<_>, AllocError>>()?
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
            history_clock,
        })
    }

    /// Runs `f` on shard `index` under its lock, keeping the combined peaks
    /// in step once they are tracked.
    pub(super) fn on_shard<R>(
        &self,
        index: usize,
        f: impl FnOnce(&mut Allocator<Arc<LimitedDevice<D>>>) -> R,
    ) -> R {
        self.on_engine(&self.shards[index], f)
    }

    /// [`SharedAllocator::on_shard`] for any engine of this device (a shard
    /// or a private pool).
    pub(super) fn on_engine<R>(
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
    pub(super) fn note_allocating_shard(&self, home: usize) {
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
    pub(super) fn start_tracking(&self) {
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

    /// Every engine of this device: the shards, then the private pools.
    pub(super) fn engines(&self) -> Vec<EngineRef<'_, D>> {
        self.shards
            .iter()
            .map(EngineRef::Shard)
            .chain(self.pool_engines().into_iter().map(EngineRef::Pool))
            .collect()
    }

    /// The engine that owns pointers of owner index `owner`.
    pub(super) fn engine_of(&self, owner: u32) -> Result<EngineRef<'_, D>, AllocError> {
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

    fn hash(value: u64) -> u64 {
        BuildHasherDefault::<PointerHasher>::default().hash_one(value)
    }

    pub(super) fn shard_of_stream(&self, stream: StreamId) -> usize {
        (Self::hash(stream.0) % self.shards.len() as u64) as usize
    }

    pub(super) fn owners_of(&self, ptr: DevicePtr) -> &Mutex<FastMap<DevicePtr, u32>> {
        &self.owners[(Self::hash(ptr) % OWNER_SHARDS as u64) as usize]
    }

    pub(super) fn owner(&self, ptr: DevicePtr) -> Result<usize, AllocError> {
        lock(self.owners_of(ptr))
            .get(&ptr)
            .map(|&s| s as usize)
            .ok_or(AllocError::UnknownPointer { ptr })
    }

    /// [`Allocator::allocation_size`] of `ptr`, in whichever engine served it.
    pub fn allocation_size(&self, ptr: DevicePtr) -> Result<u64, AllocError> {
        let owner = self.owner(ptr)?;
        let engine = self.engine_of(owner as u32)?;
        let size = lock(engine.shard()).allocation_size(ptr);
        size
    }

    /// The snapshot of every engine, segments in address order and history
    /// in the order it was recorded. Where an engine's ring dropped entries,
    /// the history begins where every engine's entries are complete, so the
    /// entries kept are one unbroken window of the run.
    pub fn snapshot(&self) -> Snapshot {
        let mut out = Snapshot::default();
        let mut window_start = 0;
        for engine in self.engines() {
            let engine = lock(engine.shard());
            window_start = window_start.max(engine.history().complete_from());
            let snap = engine.snapshot();
            out.segments.extend(snap.segments);
            out.history.extend(snap.history);
            out.settings = snap.settings;
        }
        out.segments.sort_by_key(|s| s.address);
        out.history.retain(|e| e.sequence >= window_start);
        out.history.sort_by_key(|e| e.sequence);
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
            .limit_bytes()
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
pub(super) enum EngineRef<'a, D: Device> {
    Shard(&'a Shard<D>),
    Pool(Arc<Shard<D>>),
}

impl<D: Device> EngineRef<'_, D> {
    pub(super) fn shard(&self) -> &Shard<D> {
        match self {
            EngineRef::Shard(shard) => shard,
            EngineRef::Pool(shard) => shard,
        }
    }
}

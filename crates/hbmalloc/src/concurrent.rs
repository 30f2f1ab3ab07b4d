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
//! What sharding does change: statistics are summed over shards, so `peak`
//! values are upper bounds (the sum of each shard's peak), and a memory
//! fraction applies to each shard. With one shard the behaviour is exactly
//! the single-lock engine's.

use std::hash::{BuildHasher, BuildHasherDefault};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::allocator::{Allocator, AllocatorConfig};
use crate::device::{Device, DevicePtr, StreamId};
use crate::error::AllocError;
use crate::snapshot::Snapshot;
use crate::stats::DeviceStats;
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

/// Shards of the pointer map: enough that threads rarely meet on one.
const OWNER_SHARDS: usize = 64;

/// An allocator for one device, shared by many threads. See the module docs.
pub struct SharedAllocator<D: Device> {
    device: Arc<D>,
    shards: Box<[Mutex<Allocator<Arc<D>>>]>,
    /// Which shard owns each live pointer, sharded by pointer.
    owners: Box<[Mutex<FastMap<DevicePtr, u32>>]>,
}

impl<D: Device> SharedAllocator<D> {
    /// An allocator over `device` with `shards` independent engines (at least 1).
    pub fn new(device: D, config: AllocatorConfig, shards: usize) -> Result<Self, AllocError> {
        let device = Arc::new(device);
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
        })
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.device
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

    /// Limits each shard to `fraction` of the device.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<(), AllocError> {
        for shard in self.shards.iter() {
            lock(shard).set_memory_fraction(fraction)?;
        }
        Ok(())
    }

    /// Checks every shard's invariants, and that the pointer map names
    /// exactly the live allocations.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut live = 0i64;
        for (i, shard) in self.shards.iter().enumerate() {
            let shard = lock(shard);
            shard
                .check_invariants()
                .map_err(|e| format!("shard {i}: {e}"))?;
            live += shard.stats().allocation[0].current;
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
        let first = lock(&self.shards[home]).malloc(size, stream);
        let ptr = match first {
            Ok(ptr) => ptr,
            Err(AllocError::OutOfMemory(_)) if self.shards.len() > 1 => {
                // Other shards may be caching what this one needs.
                for (i, other) in self.shards.iter().enumerate() {
                    if i != home {
                        lock(other).empty_cache()?;
                    }
                }
                lock(&self.shards[home]).malloc(size, stream)?
            }
            Err(e) => return Err(e),
        };
        lock(self.owners_of(ptr)).insert(ptr, home as u32);
        Ok(ptr)
    }

    fn free(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        let shard = lock(self.owners_of(ptr))
            .remove(&ptr)
            .ok_or(AllocError::UnknownPointer { ptr })?;
        lock(&self.shards[shard as usize]).free(ptr)
    }

    fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<(), AllocError> {
        let shard = self.owner(ptr)?;
        lock(&self.shards[shard]).record_stream(ptr, stream)
    }

    fn empty_cache(&self) -> Result<(), AllocError> {
        for shard in self.shards.iter() {
            lock(shard).empty_cache()?;
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
        total
    }
}

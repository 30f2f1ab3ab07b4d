//! Private memory pools (PyTorch's `MemPool` and a graph capture's pool)
//! and the capture count of a [`SharedAllocator`].

use std::sync::{Arc, Mutex};

use super::shared::{Shard, SharedAllocator};
use crate::allocator::{Allocator, AllocatorConfig, PolicyConfig};
use crate::config::PytorchConfig;
use crate::device::{Device, DevicePtr, PoolId, StreamId};
use crate::error::AllocError;
use crate::stats::DeviceStats;
use crate::sync::lock;

/// A private memory pool: its engine and how many hold it.
pub(super) struct PrivatePool<D: Device> {
    pub(super) id: PoolId,
    pub(super) shard: Arc<Shard<D>>,
    /// Graphs and `MemPool` objects holding the pool (PyTorch's `use_count`).
    pub(super) use_count: u64,
}

/// The private pools of a device, in slots: a pointer's owner is
/// `shards.len() + slot`. A slot is emptied only when its pool holds no
/// allocation and no caller holds its engine (every handle to it is taken
/// under this lock), so no owner entry ever names an emptied slot.
pub(super) struct PrivatePools<D: Device> {
    pub(super) slots: Vec<Option<PrivatePool<D>>>,
    /// Settings a new pool starts with (history entries, as last set).
    pub(super) config: AllocatorConfig,
    /// The statistics of the pools that went away (their counters and
    /// peaks; every current value was 0), so that no counter goes back.
    pub(super) retired: DeviceStats,
}

impl<D: Device> SharedAllocator<D> {
    /// The engines of the private pools now.
    pub(super) fn pool_engines(&self) -> Vec<Arc<Shard<D>>> {
        self.pool_engines_where(|_| true)
    }

    /// The engines of the private pools that `keep` accepts.
    pub(super) fn pool_engines_where(
        &self,
        keep: impl Fn(&PrivatePool<D>) -> bool,
    ) -> Vec<Arc<Shard<D>>> {
        lock(&self.pools)
            .slots
            .iter()
            .flatten()
            .filter(|p| keep(p))
            .map(|p| Arc::clone(&p.shard))
            .collect()
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
            engine.share_history_clock(Arc::clone(&self.history_clock));
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
    pub fn pool_use_count(&self, pool: PoolId) -> u64 {
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
    pub(super) fn retire_released_pools(&self, captures: u32) -> Result<(), AllocError> {
        if captures > 0 {
            return Ok(());
        }
        let mut first_error = Ok(());
        for engine in self.released_pool_engines() {
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
    pub(super) fn release_other_caches(&self, except: u32) -> Result<bool, AllocError> {
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
    /// last allocations).
    pub(super) fn released_pool_engines(&self) -> Vec<Arc<Shard<D>>> {
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
    pub(super) fn tell_engines_capture(&self, underway: bool) -> Result<(), AllocError> {
        let mut first_error = Ok(());
        for engine in self.engines() {
            let told = self.on_engine(engine.shard(), |a| a.set_capture_underway(underway));
            if first_error.is_ok() {
                first_error = told;
            }
        }
        first_error
    }
}

/// The policy of a private pool: `pytorch` without expandable segments, as
/// PyTorch's private pools (the user's `pytorch` settings otherwise).
pub(super) fn private_pool_config(policy: &PolicyConfig) -> PytorchConfig {
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

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
//! (see `peaks.rs`). A memory fraction is
//! enforced on the memory of all shards together by
//! [`crate::adaptor::LimitedDevice`], under
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

mod peaks;
mod pools;
mod shared;
#[cfg(test)]
mod tests;

use std::sync::Mutex;

use crate::allocator::Allocator;
use crate::device::{Device, DevicePtr, StreamId};
use crate::error::AllocError;
use crate::stats::DeviceStats;
use crate::sync::lock;

pub use shared::SharedAllocator;

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

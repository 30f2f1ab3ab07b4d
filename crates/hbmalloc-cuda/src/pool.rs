//! A device-memory pool for Rust programs: hbmalloc's engine over the CUDA
//! driver, handing out [`DeviceBuffer`]s that free themselves on drop.
//!
//! For frameworks on cudarc (candle, burn's CUDA backend, your own): pass the
//! raw stream handle (`stream.cu_stream()`) and use the buffer's
//! [`DeviceBuffer::device_ptr`] wherever a `CUdeviceptr` is expected. See
//! `examples/cudarc_pool.rs`.
//!
//! CUDA graphs: hold a [`CaptureGuard`] ([`CudaPool::capture`]) while a
//! stream captures, and take the graph's buffers from a [`GraphPool`]
//! ([`CudaPool::graph_pool`]), whose memory only that pool reuses, as long as
//! it lives (a replayed graph writes to its buffers, freed or not).

#![forbid(unsafe_code)]

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use hbmalloc::{
    AllocError, AllocatorConfig, DevicePtr, DeviceStats, PolicyConfig, PoolId, SharedAllocator,
    StreamId, ThreadSafeAllocator,
};

use crate::{CudaDevice, CudaDriver};

/// Engine shards of a pool: one per group of streams (see [`SharedAllocator`]).
const POOL_SHARDS: usize = 8;

/// A thread-safe pool of one GPU's memory.
pub struct CudaPool {
    pub(crate) allocator: SharedAllocator<CudaDevice>,
    /// The id of the last [`GraphPool`] made.
    last_graph_pool: AtomicU64,
}

impl fmt::Debug for CudaPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaPool")
            .field("device", &self.allocator.device().ordinal())
            .finish()
    }
}

impl CudaPool {
    /// A pool for GPU `ordinal`, configured by a settings string
    /// (`""` for the defaults, `policy:pytorch,expandable_segments:True`, ...).
    /// Loads the CUDA driver (see [`CudaDriver::load`]).
    pub fn new(ordinal: i32, settings: &str) -> Result<Arc<Self>, AllocError> {
        let policy = PolicyConfig::from_settings(settings)
            .map_err(|e| AllocError::InvalidConfig(e.to_string()))?;
        let driver = CudaDriver::load()?;
        let device = CudaDevice::new(driver, ordinal)?;
        Self::with_device(
            device,
            AllocatorConfig {
                policy,
                history_entries: 0,
            },
        )
    }

    /// A pool over an opened device.
    pub fn with_device(
        device: CudaDevice,
        config: AllocatorConfig,
    ) -> Result<Arc<Self>, AllocError> {
        Ok(Arc::new(CudaPool {
            allocator: SharedAllocator::new(device, config, POOL_SHARDS)?,
            last_graph_pool: AtomicU64::new(0),
        }))
    }

    /// Allocates `bytes` for use on `stream` (a raw `CUstream`, `0` for the
    /// legacy default stream). The memory is not initialised.
    pub fn alloc(
        self: &Arc<Self>,
        bytes: usize,
        stream: StreamId,
    ) -> Result<DeviceBuffer, AllocError> {
        let ptr = self.allocator.malloc(bytes as u64, stream)?;
        Ok(DeviceBuffer {
            pool: Arc::clone(self),
            ptr,
            len: bytes,
            stream,
        })
    }

    /// A CUDA graph capture is underway until the guard drops: meanwhile the
    /// pool waits for no event and gives no memory back, which the driver
    /// would refuse during a capture (see `hbmalloc::capture`). Begin it
    /// before the stream begins capturing; captures may overlap.
    pub fn capture(self: &Arc<Self>) -> Result<CaptureGuard, AllocError> {
        self.allocator.begin_capture()?;
        Ok(CaptureGuard {
            pool: Arc::clone(self),
        })
    }

    /// A private pool for a CUDA graph's buffers: their memory is reused
    /// only by this pool's allocations while it lives, and given back once
    /// it and all its buffers are gone.
    pub fn graph_pool(self: &Arc<Self>) -> Result<GraphPool, AllocError> {
        let id = PoolId(self.last_graph_pool.fetch_add(1, Ordering::Relaxed) + 1, 0);
        self.allocator.create_or_incref_pool(id)?;
        Ok(GraphPool {
            pool: Arc::clone(self),
            id,
        })
    }

    /// Returns cached memory to the driver (refused during a capture).
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        self.allocator.empty_cache()
    }

    /// PyTorch-compatible statistics of the pool.
    pub fn stats(&self) -> DeviceStats {
        self.allocator.stats()
    }

    /// PyTorch's `memory_summary()` table for the pool.
    pub fn summary(&self) -> String {
        hbmalloc::memory_summary(
            &self.stats(),
            i64::from(self.allocator.device().ordinal()),
            false,
        )
    }

    /// The device.
    pub fn device(&self) -> &CudaDevice {
        self.allocator.device()
    }
}

/// A CUDA graph capture underway on a [`CudaPool`]'s device
/// ([`CudaPool::capture`]); ends when dropped.
pub struct CaptureGuard {
    pool: Arc<CudaPool>,
}

impl fmt::Debug for CaptureGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CaptureGuard").finish_non_exhaustive()
    }
}

impl Drop for CaptureGuard {
    fn drop(&mut self) {
        // Fails only when recording the events of buffers dropped during the
        // capture fails (a driver error): those buffers' memory then waits
        // for the next synchronization. A destructor can only say so.
        if let Err(e) = self.pool.allocator.end_capture() {
            eprintln!("hbmalloc: ending a CUDA graph capture: {e}");
        }
    }
}

/// A private pool for a CUDA graph's memory ([`CudaPool::graph_pool`]).
pub struct GraphPool {
    pool: Arc<CudaPool>,
    id: PoolId,
}

impl fmt::Debug for GraphPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GraphPool").field("id", &self.id).finish()
    }
}

impl GraphPool {
    /// Allocates `bytes` for use on `stream` from this pool.
    pub fn alloc(&self, bytes: usize, stream: StreamId) -> Result<DeviceBuffer, AllocError> {
        let ptr = self
            .pool
            .allocator
            .malloc_in_pool(self.id, bytes as u64, stream)?;
        Ok(DeviceBuffer {
            pool: Arc::clone(&self.pool),
            ptr,
            len: bytes,
            stream,
        })
    }
}

impl Drop for GraphPool {
    fn drop(&mut self) {
        // This handle is the pool's only holder, so the release succeeds.
        let _ = self.pool.allocator.release_pool(self.id);
    }
}

/// Device memory from a [`CudaPool`]; returned to the pool when dropped.
/// Its memory is reused in stream order: work queued on its stream before
/// the drop finishes before the next user of the memory on that stream
/// starts; for other streams, call [`DeviceBuffer::record_stream`] first.
pub struct DeviceBuffer {
    pool: Arc<CudaPool>,
    ptr: DevicePtr,
    len: usize,
    stream: StreamId,
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("stream", &self.stream)
            .finish()
    }
}

impl DeviceBuffer {
    /// The device address (a `CUdeviceptr`).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes requested.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-byte buffer (never handed out: the pool refuses size 0).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The stream it was allocated on.
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    /// Declares that work on `stream` uses this buffer: after the drop, its
    /// memory is reused only once that work has completed.
    pub fn record_stream(&self, stream: StreamId) -> Result<(), AllocError> {
        self.pool.allocator.record_stream(self.ptr, stream)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // The pool knows this pointer (the buffer owns it), so a failure here
        // is a driver error while recording stream events; the pool keeps
        // the memory unusable until the next synchronization. Nothing better
        // can be done in a destructor than to say so.
        if let Err(e) = self.pool.allocator.free(self.ptr) {
            eprintln!("hbmalloc: freeing a device buffer: {e}");
        }
    }
}

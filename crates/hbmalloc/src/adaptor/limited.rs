//! [`LimitedDevice`]: a limit on the memory several allocators hold together.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::DeviceAdaptor;
use crate::device::{
    CallKind, Device, DeviceError, DeviceErrorKind, DevicePtr, DeviceResult, PhysicalHandle,
};
use crate::sync::lock;

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

    /// The limit now (`u64::MAX`: none).
    pub fn limit_bytes(&self) -> u64 {
        self.limit_bytes.load(Ordering::SeqCst)
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

impl<D: Device> DeviceAdaptor for LimitedDevice<D> {
    type Upstream = D;

    fn upstream(&self) -> &D {
        &self.inner
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
}

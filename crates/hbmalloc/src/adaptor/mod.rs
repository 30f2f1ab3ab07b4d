//! Device adaptors: a [`Device`] that wraps an upstream device and passes
//! every call through except the few it changes, one adaptor per file as RMM
//! keeps one resource adaptor per header.
//!
//! An adaptor implements [`DeviceAdaptor`], naming its upstream and
//! overriding only what it changes; the blanket `impl Device` forwards the
//! rest, so no adaptor restates the eighteen calls.

mod capture_safe;
mod limited;

use std::sync::Arc;

use crate::device::{
    Device, DevicePtr, DeviceResult, EventId, MemoryInfo, PhysicalHandle, StreamId,
};

pub use capture_safe::CaptureSafeDevice;
pub use limited::LimitedDevice;

/// A [`Device`] built on an upstream one: each call defaults to the
/// upstream's, and an adaptor overrides the calls it changes.
pub trait DeviceAdaptor: Send + Sync {
    /// The device calls pass to.
    type Upstream: Device + ?Sized;

    /// The upstream device.
    fn upstream(&self) -> &Self::Upstream;

    /// [`Device::name`]; the upstream's unless overridden.
    #[inline]
    fn name(&self) -> String {
        self.upstream().name()
    }

    /// [`Device::memory_info`]; the upstream's unless overridden.
    #[inline]
    fn memory_info(&self) -> DeviceResult<MemoryInfo> {
        self.upstream().memory_info()
    }

    /// [`Device::segment_alloc`]; the upstream's unless overridden.
    #[inline]
    fn segment_alloc(&self, size: u64) -> DeviceResult<DevicePtr> {
        self.upstream().segment_alloc(size)
    }

    /// [`Device::segment_free`]; the upstream's unless overridden.
    #[inline]
    fn segment_free(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        self.upstream().segment_free(ptr, size)
    }

    /// [`Device::granularity`]; the upstream's unless overridden.
    #[inline]
    fn granularity(&self) -> Option<u64> {
        self.upstream().granularity()
    }

    /// [`Device::address_reserve`]; the upstream's unless overridden.
    #[inline]
    fn address_reserve(&self, size: u64) -> DeviceResult<DevicePtr> {
        self.upstream().address_reserve(size)
    }

    /// [`Device::address_free`]; the upstream's unless overridden.
    #[inline]
    fn address_free(&self, base: DevicePtr, size: u64) -> DeviceResult<()> {
        self.upstream().address_free(base, size)
    }

    /// [`Device::physical_create`]; the upstream's unless overridden.
    #[inline]
    fn physical_create(&self, size: u64) -> DeviceResult<PhysicalHandle> {
        self.upstream().physical_create(size)
    }

    /// [`Device::physical_release`]; the upstream's unless overridden.
    #[inline]
    fn physical_release(&self, handle: PhysicalHandle) -> DeviceResult<()> {
        self.upstream().physical_release(handle)
    }

    /// [`Device::map`]; the upstream's unless overridden.
    #[inline]
    fn map(
        &self,
        va: DevicePtr,
        size: u64,
        handle: PhysicalHandle,
        offset: u64,
    ) -> DeviceResult<()> {
        self.upstream().map(va, size, handle, offset)
    }

    /// [`Device::maps_handle_parts`]; the upstream's unless overridden.
    #[inline]
    fn maps_handle_parts(&self) -> bool {
        self.upstream().maps_handle_parts()
    }

    /// [`Device::set_access`]; the upstream's unless overridden.
    #[inline]
    fn set_access(&self, va: DevicePtr, size: u64) -> DeviceResult<()> {
        self.upstream().set_access(va, size)
    }

    /// [`Device::unmap`]; the upstream's unless overridden.
    #[inline]
    fn unmap(&self, va: DevicePtr, size: u64) -> DeviceResult<()> {
        self.upstream().unmap(va, size)
    }

    /// [`Device::record_event`]; the upstream's unless overridden.
    #[inline]
    fn record_event(&self, stream: StreamId) -> DeviceResult<EventId> {
        self.upstream().record_event(stream)
    }

    /// [`Device::query_event`]; the upstream's unless overridden.
    #[inline]
    fn query_event(&self, event: EventId) -> DeviceResult<bool> {
        self.upstream().query_event(event)
    }

    /// [`Device::synchronize_event`]; the upstream's unless overridden.
    #[inline]
    fn synchronize_event(&self, event: EventId) -> DeviceResult<()> {
        self.upstream().synchronize_event(event)
    }

    /// [`Device::synchronize_device`]; the upstream's unless overridden.
    #[inline]
    fn synchronize_device(&self) -> DeviceResult<()> {
        self.upstream().synchronize_device()
    }
}

impl<A: DeviceAdaptor> Device for A {
    #[inline]
    fn name(&self) -> String {
        DeviceAdaptor::name(self)
    }
    #[inline]
    fn memory_info(&self) -> DeviceResult<MemoryInfo> {
        DeviceAdaptor::memory_info(self)
    }
    #[inline]
    fn segment_alloc(&self, size: u64) -> DeviceResult<DevicePtr> {
        DeviceAdaptor::segment_alloc(self, size)
    }
    #[inline]
    fn segment_free(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        DeviceAdaptor::segment_free(self, ptr, size)
    }
    #[inline]
    fn granularity(&self) -> Option<u64> {
        DeviceAdaptor::granularity(self)
    }
    #[inline]
    fn address_reserve(&self, size: u64) -> DeviceResult<DevicePtr> {
        DeviceAdaptor::address_reserve(self, size)
    }
    #[inline]
    fn address_free(&self, base: DevicePtr, size: u64) -> DeviceResult<()> {
        DeviceAdaptor::address_free(self, base, size)
    }
    #[inline]
    fn physical_create(&self, size: u64) -> DeviceResult<PhysicalHandle> {
        DeviceAdaptor::physical_create(self, size)
    }
    #[inline]
    fn physical_release(&self, handle: PhysicalHandle) -> DeviceResult<()> {
        DeviceAdaptor::physical_release(self, handle)
    }
    #[inline]
    fn map(
        &self,
        va: DevicePtr,
        size: u64,
        handle: PhysicalHandle,
        offset: u64,
    ) -> DeviceResult<()> {
        DeviceAdaptor::map(self, va, size, handle, offset)
    }
    #[inline]
    fn maps_handle_parts(&self) -> bool {
        DeviceAdaptor::maps_handle_parts(self)
    }
    #[inline]
    fn set_access(&self, va: DevicePtr, size: u64) -> DeviceResult<()> {
        DeviceAdaptor::set_access(self, va, size)
    }
    #[inline]
    fn unmap(&self, va: DevicePtr, size: u64) -> DeviceResult<()> {
        DeviceAdaptor::unmap(self, va, size)
    }
    #[inline]
    fn record_event(&self, stream: StreamId) -> DeviceResult<EventId> {
        DeviceAdaptor::record_event(self, stream)
    }
    #[inline]
    fn query_event(&self, event: EventId) -> DeviceResult<bool> {
        DeviceAdaptor::query_event(self, event)
    }
    #[inline]
    fn synchronize_event(&self, event: EventId) -> DeviceResult<()> {
        DeviceAdaptor::synchronize_event(self, event)
    }
    #[inline]
    fn synchronize_device(&self) -> DeviceResult<()> {
        DeviceAdaptor::synchronize_device(self)
    }
}

/// A shared device: several allocators (the shards of a
/// [`crate::SharedAllocator`]) use one driver.
impl<D: Device + ?Sized> DeviceAdaptor for Arc<D> {
    type Upstream = D;

    fn upstream(&self) -> &D {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{SimConfig, SimDevice};

    /// What a device is (its name, granularity, whether it maps parts of
    /// handles) passes through every adaptor unchanged: an allocator built
    /// over an adaptor must decide as over the device itself.
    #[test]
    fn adaptors_pass_what_a_device_is_through() {
        for maps_handle_parts in [false, true] {
            for granularity in [None, Some(2 << 20)] {
                let device = Arc::new(SimDevice::with_config(SimConfig {
                    maps_handle_parts,
                    granularity,
                    ..SimConfig::default()
                }));
                let shared: &dyn Device = &Arc::clone(&device);
                let limited = LimitedDevice::new(Arc::clone(&device));
                let capture = CaptureSafeDevice(device.as_ref());
                for adaptor in [shared, &limited as &dyn Device, &capture] {
                    assert_eq!(adaptor.name(), Device::name(device.as_ref()));
                    assert_eq!(adaptor.granularity(), granularity);
                    assert_eq!(adaptor.maps_handle_parts(), maps_handle_parts);
                }
            }
        }
    }
}

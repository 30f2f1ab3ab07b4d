//! [`CaptureSafeDevice`]: the driver as a CUDA graph capture allows it
//! (see [`crate::capture`]).

use super::DeviceAdaptor;
use crate::device::{
    CallKind, Device, DeviceError, DeviceErrorKind, DevicePtr, DeviceResult, EventId,
    PhysicalHandle, StreamId,
};

/// A device seen through an ongoing CUDA graph capture: calls that create or
/// map memory pass, calls that wait or give memory back are refused with
/// [`DeviceErrorKind::CaptureUnderway`].
pub struct CaptureSafeDevice<'a>(pub &'a dyn Device);

fn refused<T>(call: CallKind) -> DeviceResult<T> {
    Err(DeviceError::new(
        call,
        DeviceErrorKind::CaptureUnderway,
        "the driver would invalidate the capture; this happens after the capture ends".to_string(),
    ))
}

impl<'a> DeviceAdaptor for CaptureSafeDevice<'a> {
    type Upstream = dyn Device + 'a;

    fn upstream(&self) -> &(dyn Device + 'a) {
        self.0
    }

    fn segment_free(&self, _ptr: DevicePtr, _size: u64) -> DeviceResult<()> {
        refused(CallKind::SegmentFree)
    }

    fn address_free(&self, _base: DevicePtr, _size: u64) -> DeviceResult<()> {
        refused(CallKind::AddressFree)
    }

    fn physical_release(&self, _handle: PhysicalHandle) -> DeviceResult<()> {
        refused(CallKind::PhysicalRelease)
    }

    fn unmap(&self, _va: DevicePtr, _size: u64) -> DeviceResult<()> {
        refused(CallKind::Unmap)
    }

    fn record_event(&self, _stream: StreamId) -> DeviceResult<EventId> {
        refused(CallKind::EventRecord)
    }

    fn query_event(&self, _event: EventId) -> DeviceResult<bool> {
        refused(CallKind::EventQuery)
    }

    fn synchronize_event(&self, _event: EventId) -> DeviceResult<()> {
        refused(CallKind::EventSynchronize)
    }

    fn synchronize_device(&self) -> DeviceResult<()> {
        refused(CallKind::DeviceSynchronize)
    }
}

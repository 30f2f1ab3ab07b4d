//! `CudaDevice`: [`hbmalloc::Device`] over the CUDA driver API.
//!
//! No `unsafe` here: every driver call goes through `CudaDriver`'s wrappers.
//!
//! Safe during a CUDA graph capture (stream capture) in any thread, for the
//! calls that make memory: each runs with the calling thread switched to
//! relaxed capture mode (`RelaxedCapture`), as PyTorch's allocator does
//! around `cudaMalloc`. Frees, unmaps, releases and synchronizations are not
//! switched: they must not happen during a capture at all, nor must
//! `CudaDevice::new` (its map probe frees what it makes).
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use hbmalloc::{
    CallCounts, CallKind, Device, DeviceError, DeviceErrorKind, DevicePtr, DeviceResult, EventId,
    MemoryInfo, PhysicalHandle, StreamId,
};

use crate::driver::{CuContext, CuError, CuEvent, CudaDriver};
use crate::ffi::{
    CUdevice, CUdeviceptr, CUmemGenericAllocationHandle, CUstreamCaptureMode,
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_SUPPORTED, CU_STREAM_CAPTURE_MODE_RELAXED,
};
use crate::ipc::{HandleEntry, MapEntry, ShareTable};
use crate::SETUP_CALL_KIND;

/// Events handed out by `record_event` and the pool they return to.
#[derive(Debug, Default)]
struct EventTable {
    /// Completed events, ready to record again. Creating an event costs a
    /// driver call; the engine records one per cross-stream free.
    free: Vec<CuEvent>,
    /// Recorded and not yet retired.
    recorded: HashMap<u64, CuEvent>,
    next_id: u64,
}

/// Adds the time from its creation to its drop to one kind's total: dropped
/// on every return, so a failed call is timed too.
struct CallTimer<'a> {
    nanos: &'a AtomicU64,
    started: Instant,
}

impl Drop for CallTimer<'_> {
    fn drop(&mut self) {
        let elapsed = u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.nanos.fetch_add(elapsed, Ordering::Relaxed);
    }
}

/// One CUDA device, driven through its primary context (the context the
/// CUDA runtime and PyTorch use, so pointers are interchangeable with them).
///
/// Every call makes the primary context current on the calling thread first
/// (one `cuCtxGetCurrent`, plus a `cuCtxSetCurrent` only when another
/// context is current; that other context is restored afterwards).
///
/// The calls that make memory (`segment_alloc`, `address_reserve`,
/// `physical_create`, `map`, `set_access`) also switch the calling thread to
/// relaxed stream-capture mode around their driver call and restore its mode
/// afterwards (`cuThreadExchangeStreamCaptureMode`), so a CUDA graph capture
/// underway in this thread or another one neither refuses them nor is
/// invalidated by them.
///
/// Dropping it destroys its pooled events and releases the primary context.
#[derive(Debug)]
pub struct CudaDevice {
    driver: Arc<CudaDriver>,
    ordinal: i32,
    device: CUdevice,
    context: CuContext,
    name: String,
    total_bytes: u64,
    granularity: Option<u64>,
    /// This driver maps part of a handle (see [`CudaDevice::probe_handle_parts`]).
    handle_parts: bool,
    /// Ordinals granted access by `set_access`: this device, then every
    /// peer that can access its memory.
    access_ordinals: Vec<i32>,
    events: Mutex<EventTable>,
    /// `Device` calls made, by kind (indexed like `CallKind::ALL`).
    calls: [AtomicU64; CallKind::ALL.len()],
    /// Wall-clock nanoseconds spent in them, by kind.
    nanos: [AtomicU64; CallKind::ALL.len()],
    /// Segments, handles and mappings made, for sharing with other
    /// processes (`ipc.rs`).
    shared: Mutex<ShareTable>,
    /// Physical memory is created exportable (POSIX file descriptor) until
    /// the driver refuses that once.
    shareable: AtomicBool,
}

/// Makes a device's context current for one call; restores the thread's
/// previous context on drop if it was a different, non-null one.
pub(crate) struct ContextGuard<'a> {
    driver: &'a CudaDriver,
    restore: Option<CuContext>,
}

impl Drop for ContextGuard<'_> {
    fn drop(&mut self) {
        if let Some(previous) = self.restore {
            // Nothing to report to: the call itself already succeeded or
            // failed, and a stale current context is repaired by the next
            // guard on this thread.
            let _ = self.driver.ctx_set_current(previous);
        }
    }
}

/// Switches the calling thread to relaxed stream-capture mode for one driver
/// call that makes memory; restores the thread's previous mode on drop (no
/// call at all when it was relaxed already).
///
/// In the default global mode, while this thread captures a CUDA graph or
/// another thread runs a capture begun in global mode (PyTorch's default),
/// the driver refuses "potentially unsafe" calls such as `cuMemAlloc` with
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidates the capture.
/// Relaxed mode lets them run: memory made during a capture is fine as long
/// as it is not freed before the graph is replayed (PyTorch's allocator
/// wraps `cudaMalloc` the same way). Frees, unmaps, releases and
/// synchronizations take no guard: they must not happen during a capture.
struct RelaxedCapture<'a> {
    driver: &'a CudaDriver,
    restore: Option<CUstreamCaptureMode>,
}

impl Drop for RelaxedCapture<'_> {
    fn drop(&mut self) {
        if let Some(previous) = self.restore {
            // Nothing to report to: the call itself already succeeded or
            // failed. A failed restore leaves this thread relaxed, which
            // only stops the driver refusing its own unsafe calls during a
            // capture.
            let _ = self.driver.thread_exchange_stream_capture_mode(previous);
        }
    }
}

impl CudaDevice {
    /// Opens device `device_ordinal`: `cuInit(0)`, checks the ordinal against
    /// `cuDeviceGetCount`, retains the primary context, queries the name,
    /// memory, VMM granularity and peers.
    ///
    /// Errors carry [`SETUP_CALL_KIND`] and name the failing driver function
    /// in their detail.
    ///
    /// Not for use during a CUDA graph capture: the map probe
    /// (`probe_handle_parts`) makes and frees memory and copies it to the
    /// host. Open devices before capturing.
    pub fn new(driver: Arc<CudaDriver>, device_ordinal: i32) -> Result<Self, DeviceError> {
        let setup = |e: CuError, context: &str| {
            DeviceError::new(
                SETUP_CALL_KIND,
                driver.error_kind(e.code),
                driver.describe(e, context),
            )
        };
        driver.init().map_err(|e| setup(e, ""))?;
        let count = driver.get_device_count().map_err(|e| setup(e, ""))?;
        if !(0..count).contains(&device_ordinal) {
            return Err(DeviceError::new(
                SETUP_CALL_KIND,
                DeviceErrorKind::Driver("CUDA_ERROR_INVALID_DEVICE".into()),
                format!(
                    "CUDA device ordinal {device_ordinal} is out of range: the driver sees {count} device(s)"
                ),
            ));
        }
        let for_device = format!("device {device_ordinal}");
        let device = driver
            .device_get(device_ordinal)
            .map_err(|e| setup(e, &for_device))?;
        let name = driver
            .device_name(device)
            .map_err(|e| setup(e, &for_device))?;
        let total_bytes = driver
            .device_total_mem(device)
            .map_err(|e| setup(e, &for_device))?;
        let context = driver
            .primary_ctx_retain(device)
            .map_err(|e| setup(e, &for_device))?;
        // From here on `Drop` releases the context if a later step fails.
        let mut cuda = CudaDevice {
            driver: Arc::clone(&driver),
            ordinal: device_ordinal,
            device,
            context,
            name,
            total_bytes,
            granularity: None,
            handle_parts: false,
            access_ordinals: vec![device_ordinal],
            events: Mutex::new(EventTable::default()),
            calls: std::array::from_fn(|_| AtomicU64::new(0)),
            nanos: std::array::from_fn(|_| AtomicU64::new(0)),
            shared: Mutex::new(ShareTable::default()),
            shareable: AtomicBool::new(true),
        };
        let granularity = {
            let _current = cuda.make_current(SETUP_CALL_KIND)?;
            match driver.mem_get_allocation_granularity(device_ordinal) {
                Ok(g) if g > 0 => Some(g),
                // No virtual-memory API on this device or driver.
                Ok(_) => None,
                Err(e) if e.code == CUDA_ERROR_NOT_SUPPORTED => None,
                Err(e) => return Err(setup(e, &for_device)),
            }
        };
        cuda.granularity = granularity;
        if let Some(g) = granularity {
            let handle_parts = {
                let _current = cuda.make_current(SETUP_CALL_KIND)?;
                cuda.probe_handle_parts(g)
            };
            cuda.handle_parts = handle_parts;
        }
        for peer_ordinal in (0..count).filter(|&p| p != device_ordinal) {
            let for_peer = format!("peer {peer_ordinal} of device {device_ordinal}");
            let peer = driver
                .device_get(peer_ordinal)
                .map_err(|e| setup(e, &for_peer))?;
            if driver
                .can_access_peer(peer, device)
                .map_err(|e| setup(e, &for_peer))?
            {
                cuda.access_ordinals.push(peer_ordinal);
            }
        }
        Ok(cuda)
    }

    /// Whether this driver maps part of a handle (`cuMemMap` at an offset
    /// into it), as its data shows: what `Device::maps_handle_parts`
    /// answers. CUDA documents that offset as one that "currently must be
    /// zero". A driver that refuses it gets whole maps only (handles of
    /// `whole_handle_granules` from policy `hbm`). So does one that takes it
    /// and maps from the handle's start anyway, which only the bytes show:
    /// stitching there would hand two live blocks the same memory.
    ///
    /// The probe maps a two-granule handle whole and its second granule a
    /// second time on its own, writes through the second mapping and reads
    /// through the first (see [`CudaDevice::part_aliases`]). Any failure on
    /// the way (out of memory included) answers false, the safe side;
    /// everything made is released. The context must be current.
    fn probe_handle_parts(&self, granule: u64) -> bool {
        let (Ok(granule), Some(three)) = (
            usize::try_from(granule),
            granule.checked_mul(3).and_then(|b| usize::try_from(b).ok()),
        ) else {
            return false;
        };
        let driver = &self.driver;
        let Ok(va) = driver.mem_address_reserve(three) else {
            return false;
        };
        // Cleanup failures leave nothing this device tracks: the answer
        // stands either way.
        let answer = match driver.mem_create(2 * granule, self.ordinal, false) {
            Ok(handle) => {
                let answer = self.probe_maps(va, granule, handle);
                let _ = driver.mem_release(handle);
                answer
            }
            Err(_) => false,
        };
        let _ = driver.mem_address_free(va, three);
        answer
    }

    /// The probe's maps: `handle` (two granules) whole at `va`, its second
    /// granule at `va + 2 * granule`, access to both, the data check; then
    /// unmaps what it mapped.
    fn probe_maps(
        &self,
        va: CUdeviceptr,
        granule: usize,
        handle: CUmemGenericAllocationHandle,
    ) -> bool {
        let driver = &self.driver;
        if driver.mem_map(va, 2 * granule, handle, 0).is_err() {
            return false;
        }
        let part = va + 2 * granule as u64;
        let mut answer = false;
        if driver.mem_map(part, granule, handle, granule).is_ok() {
            answer = driver
                .mem_set_access(va, 3 * granule, &[self.ordinal])
                .is_ok()
                && self.part_aliases(va, part, granule);
            let _ = driver.mem_unmap(part, granule);
        }
        let _ = driver.mem_unmap(va, 2 * granule);
        answer
    }

    /// Zeroes the whole mapping at `whole` (two granules), marks the first
    /// bytes of the part mapping at `part`, and reads both granules back
    /// through `whole`: true when the mark is in the second granule and
    /// only there.
    fn part_aliases(&self, whole: CUdeviceptr, part: CUdeviceptr, granule: usize) -> bool {
        const PROBE_BYTES: usize = 4096;
        const MARK: u8 = 0xA5;
        let driver = &self.driver;
        let mut first = [MARK; PROBE_BYTES];
        let mut second = [0u8; PROBE_BYTES];
        driver.memset_d8(whole, 0, 2 * granule).is_ok()
            && driver.memset_d8(part, MARK, PROBE_BYTES).is_ok()
            && driver
                .memcpy_dtoh(&mut second, whole + granule as u64)
                .is_ok()
            && driver.memcpy_dtoh(&mut first, whole).is_ok()
            && second.iter().all(|&b| b == MARK)
            && first.iter().all(|&b| b == 0)
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Total device memory (`cuDeviceTotalMem`).
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// The devices that `set_access` grants access to: this one first, then
    /// every peer that `cuDeviceCanAccessPeer` says can access its memory.
    pub fn access_ordinals(&self) -> &[i32] {
        &self.access_ordinals
    }

    /// The driver this device uses.
    pub fn driver(&self) -> &Arc<CudaDriver> {
        &self.driver
    }

    /// Events in the pool, ready for reuse without a `cuEventCreate`.
    pub fn pooled_events(&self) -> usize {
        self.lock_events().free.len()
    }

    /// `Device` calls made so far, by kind, failed ones included (like
    /// `SimDevice::call_counts`; `simulated_ns_by_kind` stays 0: the time
    /// they took is [`CudaDevice::call_nanos`]).
    pub fn call_counts(&self) -> CallCounts {
        let mut counts = CallCounts::default();
        for (slot, count) in counts.by_kind.iter_mut().zip(&self.calls) {
            *slot = count.load(Ordering::Relaxed);
        }
        counts
    }

    /// Wall-clock nanoseconds spent in `Device` calls so far, by kind
    /// (indexed like `CallKind::ALL`), failed ones included: the driver call
    /// and what surrounds it (making the context current, relaxing a
    /// capture, the bookkeeping). What the simulator's latency model claims
    /// is checked against this on a real GPU.
    pub fn call_nanos(&self) -> [u64; CallKind::ALL.len()] {
        std::array::from_fn(|i| self.nanos[i].load(Ordering::Relaxed))
    }

    /// Counts `call` now and adds its duration when the guard drops.
    fn timed(&self, call: CallKind) -> CallTimer<'_> {
        self.calls[call as usize].fetch_add(1, Ordering::Relaxed);
        CallTimer {
            nanos: &self.nanos[call as usize],
            started: Instant::now(),
        }
    }

    fn lock_events(&self) -> MutexGuard<'_, EventTable> {
        // The table is updated in single steps that cannot panic halfway,
        // so a poisoned lock still guards a consistent table.
        self.events.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn lock_shared(&self) -> MutexGuard<'_, ShareTable> {
        // Updated in single steps that cannot panic halfway.
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn error(&self, call: CallKind, e: CuError, context: &str) -> DeviceError {
        DeviceError::new(
            call,
            self.driver.error_kind(e.code),
            self.driver.describe(e, context),
        )
    }

    pub(crate) fn make_current(&self, call: CallKind) -> DeviceResult<ContextGuard<'_>> {
        let previous = self
            .driver
            .ctx_get_current()
            .map_err(|e| self.error(call, e, ""))?;
        if previous == self.context {
            return Ok(ContextGuard {
                driver: &self.driver,
                restore: None,
            });
        }
        self.driver
            .ctx_set_current(self.context)
            .map_err(|e| self.error(call, e, ""))?;
        Ok(ContextGuard {
            driver: &self.driver,
            // A thread with no context keeps ours, as the CUDA runtime does:
            // the next call then needs no switch at all.
            restore: (!previous.is_null()).then_some(previous),
        })
    }

    /// Switches this thread to relaxed stream-capture mode until the guard
    /// drops (see [`RelaxedCapture`]). A failed switch is an error of `call`
    /// naming `cuThreadExchangeStreamCaptureMode`; the mode is unchanged.
    fn relax_capture(&self, call: CallKind) -> DeviceResult<RelaxedCapture<'_>> {
        let previous = self
            .driver
            .thread_exchange_stream_capture_mode(CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|e| {
                self.error(
                    call,
                    e,
                    "switching this thread to relaxed stream-capture mode",
                )
            })?;
        Ok(RelaxedCapture {
            driver: &self.driver,
            restore: (previous != CU_STREAM_CAPTURE_MODE_RELAXED).then_some(previous),
        })
    }

    fn require_vmm(&self, call: CallKind) -> DeviceResult<()> {
        match self.granularity {
            Some(_) => Ok(()),
            None => Err(DeviceError::new(
                call,
                DeviceErrorKind::Unsupported,
                format!("device {} has no virtual-memory API", self.ordinal),
            )),
        }
    }

    fn size_arg(call: CallKind, size: u64) -> DeviceResult<usize> {
        usize::try_from(size).map_err(|_| {
            DeviceError::new(
                call,
                DeviceErrorKind::Driver("CUDA_ERROR_INVALID_VALUE".into()),
                format!("size {size} does not fit in size_t"),
            )
        })
    }

    fn unknown_event(call: CallKind, event: EventId) -> DeviceError {
        DeviceError::new(
            call,
            DeviceErrorKind::Driver("CUDA_ERROR_INVALID_HANDLE".into()),
            format!("event {} was never recorded or is already retired", event.0),
        )
    }
}

impl Device for CudaDevice {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn memory_info(&self) -> DeviceResult<MemoryInfo> {
        let call = CallKind::MemoryInfo;
        let _timed = self.timed(call);
        let _current = self.make_current(call)?;
        let (free_bytes, total_bytes) = self
            .driver
            .mem_get_info()
            .map_err(|e| self.error(call, e, ""))?;
        Ok(MemoryInfo {
            free_bytes,
            total_bytes,
        })
    }

    fn segment_alloc(&self, size: u64) -> DeviceResult<DevicePtr> {
        let call = CallKind::SegmentAlloc;
        let _timed = self.timed(call);
        let bytes = CudaDevice::size_arg(call, size)?;
        let _current = self.make_current(call)?;
        let _relaxed = self.relax_capture(call)?;
        let ptr = self
            .driver
            .mem_alloc(bytes)
            .map_err(|e| self.error(call, e, &format!("size {size}")))?;
        self.lock_shared().segments.insert(ptr, size);
        Ok(ptr)
    }

    fn segment_free(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        let call = CallKind::SegmentFree;
        let _timed = self.timed(call);
        let _current = self.make_current(call)?;
        self.driver
            .mem_free(ptr)
            .map_err(|e| self.error(call, e, &format!("segment {ptr:#x} of {size} bytes")))?;
        self.lock_shared().segments.remove(&ptr);
        Ok(())
    }

    fn granularity(&self) -> Option<u64> {
        self.granularity
    }

    fn address_reserve(&self, size: u64) -> DeviceResult<DevicePtr> {
        let call = CallKind::AddressReserve;
        let _timed = self.timed(call);
        self.require_vmm(call)?;
        let bytes = CudaDevice::size_arg(call, size)?;
        let _current = self.make_current(call)?;
        let _relaxed = self.relax_capture(call)?;
        self.driver
            .mem_address_reserve(bytes)
            .map_err(|e| self.error(call, e, &format!("size {size}")))
    }

    fn address_free(&self, base: DevicePtr, size: u64) -> DeviceResult<()> {
        let call = CallKind::AddressFree;
        let _timed = self.timed(call);
        self.require_vmm(call)?;
        let bytes = CudaDevice::size_arg(call, size)?;
        let _current = self.make_current(call)?;
        self.driver
            .mem_address_free(base, bytes)
            .map_err(|e| self.error(call, e, &format!("range {base:#x}+{size}")))
    }

    fn physical_create(&self, size: u64) -> DeviceResult<PhysicalHandle> {
        let call = CallKind::PhysicalCreate;
        let _timed = self.timed(call);
        self.require_vmm(call)?;
        let bytes = CudaDevice::size_arg(call, size)?;
        let _current = self.make_current(call)?;
        let _relaxed = self.relax_capture(call)?;
        let mut shareable = self.shareable.load(Ordering::Relaxed);
        let created = match self.driver.mem_create(bytes, self.ordinal, shareable) {
            // A driver or device without exportable memory (it answers that
            // the handle type is not supported, or an invalid value): plain
            // memory from now on, which cannot be shared with other processes.
            Err(e)
                if shareable
                    && (e.code == CUDA_ERROR_NOT_SUPPORTED
                        || e.code == CUDA_ERROR_INVALID_VALUE) =>
            {
                self.shareable.store(false, Ordering::Relaxed);
                shareable = false;
                self.driver.mem_create(bytes, self.ordinal, false)
            }
            other => other,
        };
        let handle = created.map_err(|e| self.error(call, e, &format!("size {size}")))?;
        self.lock_shared().handles.insert(
            handle,
            HandleEntry {
                size,
                shareable,
                fd: None,
            },
        );
        Ok(PhysicalHandle(handle))
    }

    fn physical_release(&self, handle: PhysicalHandle) -> DeviceResult<()> {
        let call = CallKind::PhysicalRelease;
        let _timed = self.timed(call);
        self.require_vmm(call)?;
        let _current = self.make_current(call)?;
        self.driver
            .mem_release(handle.0)
            .map_err(|e| self.error(call, e, &format!("handle {:#x}", handle.0)))?;
        // Closes its export, if it was shared.
        self.lock_shared().handles.remove(&handle.0);
        Ok(())
    }

    fn map(
        &self,
        va: DevicePtr,
        size: u64,
        handle: PhysicalHandle,
        offset: u64,
    ) -> DeviceResult<()> {
        let call = CallKind::Map;
        let _timed = self.timed(call);
        self.require_vmm(call)?;
        let bytes = CudaDevice::size_arg(call, size)?;
        let offset_bytes = CudaDevice::size_arg(call, offset)?;
        let _current = self.make_current(call)?;
        let _relaxed = self.relax_capture(call)?;
        self.driver
            .mem_map(va, bytes, handle.0, offset_bytes)
            .map_err(|e| {
                self.error(
                    call,
                    e,
                    &format!("handle {:#x}+{offset} at {va:#x}+{size}", handle.0),
                )
            })?;
        self.lock_shared().mappings.insert(
            va,
            MapEntry {
                size,
                handle: handle.0,
                offset,
            },
        );
        Ok(())
    }

    /// What the driver answered when the device was opened
    /// (`CudaDevice::probe_handle_parts`). `cuMemMap`'s documentation says
    /// its offset "currently must be zero" (PyTorch's expandable segments
    /// and GMLake map each handle whole), so the answer is asked of the
    /// driver, not assumed: a map refused in the middle of a run would fail
    /// an allocation, and one that ignored its offset would hand two blocks
    /// the same memory.
    fn maps_handle_parts(&self) -> bool {
        self.handle_parts
    }

    fn set_access(&self, va: DevicePtr, size: u64) -> DeviceResult<()> {
        let call = CallKind::SetAccess;
        let _timed = self.timed(call);
        self.require_vmm(call)?;
        let bytes = CudaDevice::size_arg(call, size)?;
        let _current = self.make_current(call)?;
        let _relaxed = self.relax_capture(call)?;
        self.driver
            .mem_set_access(va, bytes, &self.access_ordinals)
            .map_err(|e| {
                self.error(
                    call,
                    e,
                    &format!("{va:#x}+{size} for devices {:?}", self.access_ordinals),
                )
            })
    }

    fn unmap(&self, va: DevicePtr, size: u64) -> DeviceResult<()> {
        let call = CallKind::Unmap;
        let _timed = self.timed(call);
        self.require_vmm(call)?;
        let bytes = CudaDevice::size_arg(call, size)?;
        let _current = self.make_current(call)?;
        self.driver
            .mem_unmap(va, bytes)
            .map_err(|e| self.error(call, e, &format!("{va:#x}+{size}")))?;
        self.lock_shared().unmapped(va, size);
        Ok(())
    }

    fn record_event(&self, stream: StreamId) -> DeviceResult<EventId> {
        let call = CallKind::EventRecord;
        let _timed = self.timed(call);
        let _current = self.make_current(call)?;
        let mut table = self.lock_events();
        let event = match table.free.pop() {
            Some(event) => event,
            None => self
                .driver
                .event_create()
                .map_err(|e| self.error(call, e, ""))?,
        };
        if let Err(e) = self.driver.event_record(event, stream.0) {
            table.free.push(event);
            return Err(self.error(call, e, &format!("stream {:#x}", stream.0)));
        }
        table.next_id += 1;
        let id = table.next_id;
        table.recorded.insert(id, event);
        Ok(EventId(id))
    }

    fn query_event(&self, event: EventId) -> DeviceResult<bool> {
        let call = CallKind::EventQuery;
        let _timed = self.timed(call);
        // Held across the query so two threads cannot retire one event twice;
        // cuEventQuery does not block.
        let mut table = self.lock_events();
        let Some(&cu_event) = table.recorded.get(&event.0) else {
            return Err(CudaDevice::unknown_event(call, event));
        };
        let done = self
            .driver
            .event_query(cu_event)
            .map_err(|e| self.error(call, e, &format!("event {}", event.0)))?;
        if done {
            table.recorded.remove(&event.0);
            table.free.push(cu_event);
        }
        Ok(done)
    }

    fn synchronize_event(&self, event: EventId) -> DeviceResult<()> {
        let call = CallKind::EventSynchronize;
        let _timed = self.timed(call);
        // Taken out of the table so the lock is not held while blocking.
        let Some(cu_event) = self.lock_events().recorded.remove(&event.0) else {
            return Err(CudaDevice::unknown_event(call, event));
        };
        match self.driver.event_synchronize(cu_event) {
            Ok(()) => {
                self.lock_events().free.push(cu_event);
                Ok(())
            }
            Err(e) => {
                // Not retired: the caller may query or wait again.
                self.lock_events().recorded.insert(event.0, cu_event);
                Err(self.error(call, e, &format!("event {}", event.0)))
            }
        }
    }

    fn synchronize_device(&self) -> DeviceResult<()> {
        let call = CallKind::DeviceSynchronize;
        let _timed = self.timed(call);
        let _current = self.make_current(call)?;
        self.driver
            .ctx_synchronize()
            .map_err(|e| self.error(call, e, ""))
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // Errors cannot be reported from drop; each step is independent, so
        // a failure in one still lets the others run.
        let table = std::mem::take(self.events.get_mut().unwrap_or_else(|e| e.into_inner()));
        let current = self.make_current(SETUP_CALL_KIND);
        for event in table.free.into_iter().chain(table.recorded.into_values()) {
            // A still-pending event may be destroyed: the driver frees it
            // once its work completes.
            let _ = self.driver.event_destroy(event);
        }
        drop(current);
        let _ = self.driver.primary_ctx_release(self.device);
        // Don't leave a released context current on this thread.
        if self.driver.ctx_get_current() == Ok(self.context) {
            let _ = self.driver.ctx_set_current(CuContext::NULL);
        }
    }
}

#[cfg(feature = "harness")]
/// Device memory through this device's driver (`cuMemsetD8_v2`,
/// `cuMemcpyDtoH_v2` on the legacy default stream, the context made current
/// for the call): what [`crate::byte_check::byte_program`] checks with.
impl crate::byte_check::DeviceBytes for CudaDevice {
    fn fill(&self, ptr: u64, value: u8, len: usize) -> Result<(), String> {
        let _current = self
            .make_current(SETUP_CALL_KIND)
            .map_err(|e| e.to_string())?;
        self.driver
            .memset_d8(ptr, value, len)
            .map_err(|e| self.driver.describe(e, &format!("{len} bytes at {ptr:#x}")))
    }

    fn read(&self, ptr: u64, len: usize) -> Result<Vec<u8>, String> {
        let _current = self
            .make_current(SETUP_CALL_KIND)
            .map_err(|e| e.to_string())?;
        let mut bytes = vec![0u8; len];
        self.driver
            .memcpy_dtoh(&mut bytes, ptr)
            .map_err(|e| self.driver.describe(e, &format!("{len} bytes at {ptr:#x}")))?;
        Ok(bytes)
    }
}

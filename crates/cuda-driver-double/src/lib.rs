//! A test double of the CUDA driver library (`libcuda`).
//!
//! Built as a `cdylib`, it exports the driver functions `hbmalloc-cuda` uses,
//! under the same C names and signatures, so `CudaDriver::load_from` can load
//! it in place of the real driver on a machine without a GPU. It is backed by
//! host memory:
//!
//! - `cuMemAlloc_v2` really allocates (zeroed, 256-byte aligned), so a test
//!   can write and read bytes through the returned pointer;
//! - the virtual-memory API is modelled: `cuMemAddressReserve` hands out
//!   fake address ranges (never dereference them), `cuMemCreate` holds a
//!   host buffer per handle, and map / unmap / set-access / release /
//!   address-free are validated like the real driver (mapping inside one
//!   reserved range, no overlap, unmap exactly one mapping, release only when
//!   unmapped, address free only when nothing is mapped in it); a map at an
//!   offset into a handle is refused when a test asks
//!   (`hbm_double_set_whole_handle_maps`), as `cuMemMap`'s documentation
//!   allows, or accepted and then mapped from the handle's start
//!   (`hbm_double_set_map_offset_ignored`), a driver that takes the
//!   parameter without honouring it;
//! - `cuMemsetD8_v2` and `cuMemcpyDtoH_v2` write and read device memory:
//!   a segment's bytes, or through mapped ranges (with access granted to the
//!   current device) the bytes of each mapping's handle, so a test can see
//!   which physical memory an address reaches;
//! - two devices, each able to access the other's memory, each with a
//!   configurable capacity (1 GiB by default) past which allocation fails
//!   with `CUDA_ERROR_OUT_OF_MEMORY`; 2 MiB granularity;
//! - events complete immediately by default, or only when the test says so;
//! - contexts are per thread as in the driver: calls that need one fail with
//!   `CUDA_ERROR_INVALID_CONTEXT` when the thread has no valid current context;
//! - so is the stream-capture mode (`cuThreadExchangeStreamCaptureMode`,
//!   global until changed): each driver call is counted as made in relaxed
//!   mode or not, so a test can see that the calls that make memory would be
//!   allowed during a CUDA graph capture (no capture is modelled).
//!
//! Tests steer it through the `hbm_double_*` functions (reset, capacity,
//! fault injection, event completion, call counts, calls made in relaxed
//! capture mode, the calling thread's capture mode, live bytes, and filling
//! and reading device memory as a device sees it, without a context). Setting
//! `HBM_DOUBLE_NO_DEVICE=1` makes `cuInit` fail with `CUDA_ERROR_NO_DEVICE`;
//! it is read on every `cuInit` call so one process can test both cases.
//!
//! State lives behind one global mutex. No function panics across the C
//! boundary: every body runs under `catch_unwind` and a panic becomes
//! `CUDA_ERROR_UNKNOWN`. Null output pointers give `CUDA_ERROR_INVALID_VALUE`.

// The exported names are the driver's own, which are not snake case.
#![allow(non_snake_case)]

use std::cell::Cell;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, MutexGuard};

pub use hbmalloc_cuda::ffi::*;

mod host;
use host::HostBytes;

/// Devices the double pretends to have.
pub const DEVICE_COUNT: usize = 2;
/// Virtual-memory granularity, minimum and recommended (as on current GPUs).
pub const GRANULARITY: u64 = 2 << 20;
/// Capacity of each device after `hbm_double_reset`.
pub const DEFAULT_CAPACITY: u64 = 1 << 30;
/// `cuMemAlloc` guarantees at least this alignment.
const SEGMENT_ALIGN: u64 = 256;
/// Fake context handles are `CONTEXT_BASE + ordinal * CONTEXT_STRIDE`: never
/// dereferenced, only compared.
const CONTEXT_BASE: usize = 0xC0DE_0000;
const CONTEXT_STRIDE: usize = 0x1000;
/// Fake event handles start here and step by 16.
const EVENT_BASE: u64 = 0xE7E0_0000;
/// Fake virtual addresses for reserved ranges start here.
const VA_BASE: u64 = 0x7e00_0000_0000;

const LOCATION_TYPE_DEVICE: c_uint = 1;
const ALLOCATION_TYPE_PINNED: c_uint = 1;

/// A segment from `cuMemAlloc_v2` (real host memory), or another process's
/// opened by `cuIpcOpenMemHandle_v2`.
struct Segment {
    /// Owns the bytes; the handed-out pointer lies inside, aligned.
    buffer: HostBytes,
    size: u64,
    device: usize,
    /// Opened from another process: closed with `cuIpcCloseMemHandle`, not
    /// freed, and not counted against this process's capacity.
    opened: bool,
}

/// Physical memory from `cuMemCreate`.
struct Physical {
    /// Backing store: what `cuMemsetD8_v2` and `cuMemcpyDtoH_v2` reach
    /// through a mapping (zeroed, so committed by the OS only when written).
    buffer: HostBytes,
    size: u64,
    device: usize,
    /// How many mappings use it.
    mappings: u64,
    /// Created with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` (or imported
    /// from such an export): `cuMemExportToShareableHandle` may export it.
    exportable: bool,
    /// Imported from another process's export: not counted against this
    /// process's capacity (the exporter's memory).
    imported: bool,
}

/// One `cuMemMap` of (part of) a handle.
struct Mapping {
    size: u64,
    handle: CUmemGenericAllocationHandle,
    /// Where in the handle the mapping starts (0 for a driver that ignores
    /// the offset it was given).
    offset: u64,
    /// Bit `d` set when device `d` may read and write the range.
    access_mask: u32,
}

/// A fault armed by `hbm_double_fail_nth`.
struct Fault {
    call: String,
    /// The value of the call's counter at which it fires.
    at_count: u64,
    code: CUresult,
}

/// Everything the double knows, behind [`STATE`].
struct State {
    initialized: bool,
    capacity: u64,
    used: [u64; DEVICE_COUNT],
    primary_retains: [u64; DEVICE_COUNT],
    segments: BTreeMap<CUdeviceptr, Segment>,
    reservations: BTreeMap<CUdeviceptr, u64>,
    next_va: u64,
    physical: BTreeMap<CUmemGenericAllocationHandle, Physical>,
    next_handle: u64,
    mappings: BTreeMap<CUdeviceptr, Mapping>,
    /// Live events: `true` while recorded work is pending.
    events: BTreeMap<u64, bool>,
    next_event: u64,
    events_complete: bool,
    /// `cuMemMap` refuses an offset other than 0, as its documentation allows.
    whole_handle_maps: bool,
    /// `cuMemMap` accepts any offset and maps from the handle's start.
    map_offset_ignored: bool,
    calls: BTreeMap<String, u64>,
    /// Of `calls`, those made while the calling thread's stream-capture
    /// mode was relaxed.
    relaxed_calls: BTreeMap<String, u64>,
    faults: Vec<Fault>,
}

impl State {
    const fn new() -> Self {
        State {
            initialized: false,
            capacity: DEFAULT_CAPACITY,
            used: [0; DEVICE_COUNT],
            primary_retains: [0; DEVICE_COUNT],
            segments: BTreeMap::new(),
            reservations: BTreeMap::new(),
            next_va: VA_BASE,
            physical: BTreeMap::new(),
            next_handle: 0x1000,
            mappings: BTreeMap::new(),
            events: BTreeMap::new(),
            next_event: EVENT_BASE,
            events_complete: true,
            whole_handle_maps: false,
            map_offset_ignored: false,
            calls: BTreeMap::new(),
            relaxed_calls: BTreeMap::new(),
            faults: Vec::new(),
        }
    }

    /// Counts a call of `name` (made in relaxed capture mode or not);
    /// returns the injected error if one fires now.
    fn enter(&mut self, name: &str, relaxed: bool) -> Result<(), CUresult> {
        if relaxed {
            *self.relaxed_calls.entry(name.to_string()).or_insert(0) += 1;
        }
        let count = self.calls.entry(name.to_string()).or_insert(0);
        *count += 1;
        let count = *count;
        if let Some(i) = self
            .faults
            .iter()
            .position(|f| f.call == name && f.at_count == count)
        {
            return Err(self.faults.remove(i).code);
        }
        Ok(())
    }

    fn require_init(&self) -> Result<(), CUresult> {
        if self.initialized {
            Ok(())
        } else {
            Err(CUDA_ERROR_NOT_INITIALIZED)
        }
    }

    fn device(&self, ordinal: CUdevice) -> Result<usize, CUresult> {
        self.require_init()?;
        device_index(ordinal).ok_or(CUDA_ERROR_INVALID_DEVICE)
    }

    /// The device of `context` if it is a retained primary context.
    fn context_device(&self, context: usize) -> Option<usize> {
        let offset = context.checked_sub(CONTEXT_BASE)?;
        let device = offset / CONTEXT_STRIDE;
        let valid = offset % CONTEXT_STRIDE == 0
            && device < DEVICE_COUNT
            && self.primary_retains[device] > 0;
        valid.then_some(device)
    }

    /// The device of the calling thread's current context.
    fn current_device(&self) -> Result<usize, CUresult> {
        self.require_init()?;
        self.context_device(CURRENT_CONTEXT.with(Cell::get))
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)
    }

    fn check_capacity(&self, device: usize, size: u64) -> Result<(), CUresult> {
        if size > self.capacity.saturating_sub(self.used[device]) {
            Err(CUDA_ERROR_OUT_OF_MEMORY)
        } else {
            Ok(())
        }
    }

    fn complete_all_events(&mut self) {
        for pending in self.events.values_mut() {
            *pending = false;
        }
    }

    fn validate_prop(&self, prop: &CUmemAllocationProp) -> Result<usize, CUresult> {
        if prop.allocation_type != ALLOCATION_TYPE_PINNED
            || prop.location.location_type != LOCATION_TYPE_DEVICE
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        self.device(prop.location.id)
    }

    /// The reserved range holding all of `[va, va + size)`, if any.
    fn reservation_of(&self, va: u64, size: u64) -> Option<(u64, u64)> {
        let (&base, &len) = self.reservations.range(..=va).next_back()?;
        (va.checked_add(size)? <= base + len).then_some((base, len))
    }

    fn overlaps_mapping(&self, va: u64, size: u64) -> bool {
        let before = self
            .mappings
            .range(..va)
            .next_back()
            .is_some_and(|(&start, m)| start + m.size > va);
        before || self.mappings.range(va..va + size).next().is_some()
    }

    fn live_bytes(&self) -> u64 {
        self.used.iter().sum()
    }

    /// Runs `visit` over the host bytes behind device range `[va, va + len)`
    /// in address order, for `device`: inside one segment, or across
    /// mappings that tile the range and grant `device` access, each
    /// reaching its handle's bytes from the mapping's offset. Nothing is
    /// visited unless the whole range is reachable.
    fn device_bytes(
        &mut self,
        va: u64,
        len: u64,
        device: usize,
        mut visit: impl FnMut(&mut [u8]),
    ) -> Result<(), CUresult> {
        let end = va.checked_add(len).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if len == 0 {
            return Ok(());
        }
        if let Some((&ptr, segment)) = self.segments.range_mut(..=va).next_back() {
            if end <= ptr + segment.size {
                let start = (ptr - segment.buffer.as_ptr() as u64) + (va - ptr);
                let (start, len) = (start as usize, len as usize);
                visit(&mut segment.buffer[start..start + len]);
                return Ok(());
            }
        }
        // Every piece first, so a range with a hole touches nothing.
        let mut pieces = Vec::new();
        let mut cursor = va;
        let first = self
            .mappings
            .range(..=va)
            .next_back()
            .map_or(va, |(&start, _)| start);
        for (&start, m) in self.mappings.range(first..end) {
            if start + m.size <= cursor {
                continue;
            }
            if start > cursor {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            if m.access_mask & (1 << device) == 0 {
                return Err(CUDA_ERROR_ILLEGAL_ADDRESS);
            }
            let stop = end.min(start + m.size);
            pieces.push((m.handle, m.offset + (cursor - start), stop - cursor));
            cursor = stop;
        }
        if cursor != end {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        for (handle, at, len) in pieces {
            let physical = self
                .physical
                .get_mut(&handle)
                .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            let (at, len) = (at as usize, len as usize);
            visit(&mut physical.buffer[at..at + len]);
        }
        Ok(())
    }

    /// Copies the `count` bytes behind device range `va` (as
    /// [`State::device_bytes`] reaches them for `device`) to host memory at
    /// `out`, piece by piece: nothing is allocated for the copy, and nothing
    /// is written unless the whole range is reachable.
    ///
    /// # Safety
    /// `out` must be non-null and valid for writing `count` bytes.
    unsafe fn copy_to_host(
        &mut self,
        out: *mut u8,
        va: u64,
        count: u64,
        device: usize,
    ) -> Result<(), CUresult> {
        let mut at = 0usize;
        self.device_bytes(va, count, device, |bytes| {
            // SAFETY: the caller promises `count` writable bytes at `out`,
            // and the pieces add up to `count`.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.add(at), bytes.len()) };
            at += bytes.len();
        })
    }
}

static STATE: Mutex<State> = Mutex::new(State::new());

thread_local! {
    /// The calling thread's current context, as in the real driver.
    static CURRENT_CONTEXT: Cell<usize> = const { Cell::new(0) };
    /// The calling thread's stream-capture mode, as in the real driver.
    static CAPTURE_MODE: Cell<CUstreamCaptureMode> =
        const { Cell::new(CU_STREAM_CAPTURE_MODE_GLOBAL) };
}

fn lock() -> MutexGuard<'static, State> {
    // Every mutation completes before anything that could panic, so a
    // poisoned lock still guards consistent state.
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs one driver call: counts it (and whether the calling thread's
/// capture mode is relaxed), fires an armed fault, then runs `body`.
/// A panic becomes `CUDA_ERROR_UNKNOWN` instead of unwinding into C.
fn driver_call<T>(
    name: &str,
    body: impl FnOnce(&mut State) -> Result<T, CUresult>,
) -> Result<T, CUresult> {
    catch_unwind(AssertUnwindSafe(|| {
        let relaxed = CAPTURE_MODE.with(Cell::get) == CU_STREAM_CAPTURE_MODE_RELAXED;
        let mut state = lock();
        state.enter(name, relaxed)?;
        body(&mut state)
    }))
    .unwrap_or(Err(CUDA_ERROR_UNKNOWN))
}

/// Runs a control function, turning a panic into `fallback`.
fn control<T>(fallback: T, body: impl FnOnce(&mut State) -> T) -> T {
    catch_unwind(AssertUnwindSafe(|| body(&mut lock()))).unwrap_or(fallback)
}

fn non_null<T>(ptr: *const T) -> Result<(), CUresult> {
    if ptr.is_null() {
        Err(CUDA_ERROR_INVALID_VALUE)
    } else {
        Ok(())
    }
}

fn status(result: Result<(), CUresult>) -> CUresult {
    result.err().unwrap_or(CUDA_SUCCESS)
}

/// Writes a successful result through `out`.
///
/// # Safety
/// When `result` is `Ok`, `out` must be non-null and valid for a write of `T`.
unsafe fn write_out<T>(out: *mut T, result: Result<T, CUresult>) -> CUresult {
    match result {
        Ok(value) => {
            // SAFETY: every caller checks `out` for null inside the call body
            // before producing `Ok`, and the C caller promises it points to
            // writable storage for a `T` (the driver API contract).
            unsafe { out.write_unaligned(value) };
            CUDA_SUCCESS
        }
        Err(code) => code,
    }
}

fn granular(value: u64) -> bool {
    value != 0 && value % GRANULARITY == 0
}

// ---------------------------------------------------------------------------
// Driver API
// ---------------------------------------------------------------------------

/// `cuInit`: fails with `CUDA_ERROR_NO_DEVICE` while `HBM_DOUBLE_NO_DEVICE=1`.
#[no_mangle]
pub extern "C" fn cuInit(flags: c_uint) -> CUresult {
    status(driver_call("cuInit", |s| {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // Read on every call, so one process can test both outcomes.
        if std::env::var("HBM_DOUBLE_NO_DEVICE").is_ok_and(|v| v == "1") {
            s.initialized = false;
            return Err(CUDA_ERROR_NO_DEVICE);
        }
        s.initialized = true;
        Ok(())
    }))
}

/// `cuDeviceGetCount`.
///
/// # Safety
/// `count` must be null or valid for writing an `int`.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    let result = driver_call("cuDeviceGetCount", |s| {
        non_null(count)?;
        s.require_init()?;
        Ok(DEVICE_COUNT as c_int)
    });
    // SAFETY: checked non-null above; the caller promises it is writable.
    unsafe { write_out(count, result) }
}

/// `cuDeviceGet`.
///
/// # Safety
/// `device` must be null or valid for writing a `CUdevice`.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    let result = driver_call("cuDeviceGet", |s| {
        non_null(device)?;
        s.device(ordinal).map(|_| ordinal)
    });
    // SAFETY: checked non-null above; the caller promises it is writable.
    unsafe { write_out(device, result) }
}

/// `cuDeviceGetName`: writes a nul-terminated name, truncated to `len` bytes.
///
/// # Safety
/// `name` must be null or valid for writing `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(
    name: *mut c_char,
    len: c_int,
    device: CUdevice,
) -> CUresult {
    let result = driver_call("cuDeviceGetName", |s| {
        non_null(name)?;
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l > 0)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let ordinal = s.device(device)?;
        let mut text = format!("hbmalloc CUDA driver double, device {ordinal}").into_bytes();
        text.truncate(len - 1);
        text.push(0);
        Ok(text)
    });
    match result {
        Ok(text) => {
            // SAFETY: `name` is non-null (checked above) and the caller
            // promises `len` writable bytes; `text` has at most `len` bytes.
            unsafe { std::ptr::copy_nonoverlapping(text.as_ptr(), name.cast::<u8>(), text.len()) };
            CUDA_SUCCESS
        }
        Err(code) => code,
    }
}

/// `cuDeviceTotalMem_v2`: the configured capacity.
///
/// # Safety
/// `bytes` must be null or valid for writing a `size_t`.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, device: CUdevice) -> CUresult {
    let result = driver_call("cuDeviceTotalMem_v2", |s| {
        non_null(bytes)?;
        s.device(device)?;
        Ok(s.capacity as usize)
    });
    // SAFETY: checked non-null above; the caller promises it is writable.
    unsafe { write_out(bytes, result) }
}

/// `cuDeviceCanAccessPeer`: every device can access every other one.
///
/// # Safety
/// `can_access` must be null or valid for writing an `int`.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(
    can_access: *mut c_int,
    device: CUdevice,
    peer: CUdevice,
) -> CUresult {
    let result = driver_call("cuDeviceCanAccessPeer", |s| {
        non_null(can_access)?;
        let (a, b) = (s.device(device)?, s.device(peer)?);
        Ok(c_int::from(a != b))
    });
    // SAFETY: checked non-null above; the caller promises it is writable.
    unsafe { write_out(can_access, result) }
}

/// `cuDevicePrimaryCtxRetain`.
///
/// # Safety
/// `context` must be null or valid for writing a `CUcontext`.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(
    context: *mut CUcontext,
    device: CUdevice,
) -> CUresult {
    let result = driver_call("cuDevicePrimaryCtxRetain", |s| {
        non_null(context)?;
        let d = s.device(device)?;
        s.primary_retains[d] += 1;
        Ok((CONTEXT_BASE + d * CONTEXT_STRIDE) as CUcontext)
    });
    // SAFETY: checked non-null above; the caller promises it is writable.
    unsafe { write_out(context, result) }
}

/// `cuDevicePrimaryCtxRelease_v2`.
#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(device: CUdevice) -> CUresult {
    status(driver_call("cuDevicePrimaryCtxRelease_v2", |s| {
        let d = s.device(device)?;
        if s.primary_retains[d] == 0 {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        s.primary_retains[d] -= 1;
        Ok(())
    }))
}

/// `cuCtxSetCurrent`: null, or a retained primary context.
#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(context: CUcontext) -> CUresult {
    status(driver_call("cuCtxSetCurrent", |s| {
        s.require_init()?;
        let value = context as usize;
        if value != 0 && s.context_device(value).is_none() {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        CURRENT_CONTEXT.with(|c| c.set(value));
        Ok(())
    }))
}

/// `cuCtxGetCurrent`.
///
/// # Safety
/// `context` must be null or valid for writing a `CUcontext`.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(context: *mut CUcontext) -> CUresult {
    let result = driver_call("cuCtxGetCurrent", |s| {
        non_null(context)?;
        s.require_init()?;
        Ok(CURRENT_CONTEXT.with(Cell::get) as CUcontext)
    });
    // SAFETY: checked non-null above; the caller promises it is writable.
    unsafe { write_out(context, result) }
}

/// `cuCtxSynchronize`: completes every event.
#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    status(driver_call("cuCtxSynchronize", |s| {
        s.current_device()?;
        s.complete_all_events();
        Ok(())
    }))
}

/// `cuMemGetInfo_v2`, for the current context's device.
///
/// # Safety
/// `free` and `total` must each be null or valid for writing a `size_t`.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let result = driver_call("cuMemGetInfo_v2", |s| {
        non_null(free)?;
        non_null(total)?;
        let d = s.current_device()?;
        Ok((s.capacity.saturating_sub(s.used[d]), s.capacity))
    });
    match result {
        Ok((free_bytes, total_bytes)) => {
            // SAFETY: both checked non-null above; the caller promises they
            // are writable.
            unsafe {
                free.write_unaligned(free_bytes as usize);
                total.write_unaligned(total_bytes as usize);
            }
            CUDA_SUCCESS
        }
        Err(code) => code,
    }
}

/// `cuMemAlloc_v2`: real, zeroed, 256-byte aligned host memory.
///
/// # Safety
/// `dptr` must be null or valid for writing a `CUdeviceptr`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    let result = driver_call("cuMemAlloc_v2", |s| {
        non_null(dptr)?;
        let d = s.current_device()?;
        let size = bytesize as u64;
        if size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        s.check_capacity(d, size)?;
        // Zeroed allocation is lazily committed by the OS, so a large
        // capacity costs nothing until written.
        let buffer = HostBytes::new(bytesize + SEGMENT_ALIGN as usize)?;
        let start = buffer.as_ptr() as u64;
        let ptr = start.next_multiple_of(SEGMENT_ALIGN);
        s.segments.insert(
            ptr,
            Segment {
                buffer,
                size,
                device: d,
                opened: false,
            },
        );
        s.used[d] += size;
        Ok(ptr)
    });
    // SAFETY: checked non-null above; the caller promises it is writable.
    unsafe { write_out(dptr, result) }
}

/// `cuMemFree_v2`: also completes every event, as `cudaFree` synchronizes.
#[no_mangle]
pub extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    status(driver_call("cuMemFree_v2", |s| {
        s.current_device()?;
        if s.segments.get(&dptr).is_none_or(|seg| seg.opened) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let segment = s.segments.remove(&dptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        s.used[segment.device] -= segment.size;
        s.complete_all_events();
        Ok(())
    }))
}

/// `cuMemGetAllocationGranularity`: 2 MiB, minimum and recommended.
///
/// # Safety
/// `granularity` must be null or valid for writing a `size_t`; `prop` null
/// or valid for reading a `CUmemAllocationProp`.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const CUmemAllocationProp,
    option: c_uint,
) -> CUresult {
    let result = driver_call("cuMemGetAllocationGranularity", |s| {
        non_null(granularity)?;
        non_null(prop)?;
        // SAFETY: checked non-null above; the caller promises it points to
        // a readable `CUmemAllocationProp`.
        let prop = unsafe { prop.read_unaligned() };
        s.validate_prop(&prop)?;
        if option > 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(GRANULARITY as usize)
    });
    // SAFETY: checked non-null above; the caller promises it is writable.
    unsafe { write_out(granularity, result) }
}

/// `cuMemAddressReserve`: a fake, never-dereferenceable address range.
///
/// # Safety
/// `ptr` must be null or valid for writing a `CUdeviceptr`.
#[no_mangle]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    alignment: usize,
    _addr: CUdeviceptr,
    flags: c_ulonglong,
) -> CUresult {
    let result = driver_call("cuMemAddressReserve", |s| {
        non_null(ptr)?;
        s.require_init()?;
        let size = size as u64;
        let alignment = alignment as u64;
        if !granular(size) || flags != 0 || (alignment != 0 && !alignment.is_power_of_two()) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let base = s.next_va.next_multiple_of(alignment.max(GRANULARITY));
        // A one-granule gap keeps adjacent ranges from looking like one.
        s.next_va = base + size + GRANULARITY;
        s.reservations.insert(base, size);
        Ok(base)
    });
    // SAFETY: checked non-null above; the caller promises it is writable.
    unsafe { write_out(ptr, result) }
}

/// `cuMemAddressFree`: the exact range, with nothing mapped in it.
#[no_mangle]
pub extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> CUresult {
    status(driver_call("cuMemAddressFree", |s| {
        s.require_init()?;
        let size = size as u64;
        if s.reservations.get(&ptr) != Some(&size) || s.overlaps_mapping(ptr, size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        s.reservations.remove(&ptr);
        Ok(())
    }))
}

/// `cuMemCreate`: physical memory backed by a host buffer.
///
/// # Safety
/// `handle` must be null or valid for writing a handle; `prop` null or valid
/// for reading a `CUmemAllocationProp`.
#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: c_ulonglong,
) -> CUresult {
    let result = driver_call("cuMemCreate", |s| {
        non_null(handle)?;
        non_null(prop)?;
        // SAFETY: checked non-null above; the caller promises it points to
        // a readable `CUmemAllocationProp`.
        let prop = unsafe { prop.read_unaligned() };
        let d = s.validate_prop(&prop)?;
        let size64 = size as u64;
        if !granular(size64) || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        s.check_capacity(d, size64)?;
        if prop.requested_handle_types & !CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR != 0 {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        let buffer = HostBytes::new(size)?;
        let value = s.next_handle;
        s.next_handle += 1;
        s.physical.insert(
            value,
            Physical {
                buffer,
                size: size64,
                device: d,
                mappings: 0,
                exportable: prop.requested_handle_types != 0,
                imported: false,
            },
        );
        s.used[d] += size64;
        Ok(value)
    });
    // SAFETY: checked non-null above; the caller promises it is writable.
    unsafe { write_out(handle, result) }
}

/// `cuMemRelease`: only once the handle is no longer mapped (the real driver
/// defers the release instead; the double is stricter to catch leaks).
#[no_mangle]
pub extern "C" fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult {
    status(driver_call("cuMemRelease", |s| {
        s.require_init()?;
        match s.physical.get(&handle) {
            None => return Err(CUDA_ERROR_INVALID_HANDLE),
            Some(p) if p.mappings > 0 => return Err(CUDA_ERROR_INVALID_VALUE),
            Some(_) => {}
        }
        if let Some(p) = s.physical.remove(&handle) {
            if !p.imported {
                s.used[p.device] -= p.size;
            }
        }
        Ok(())
    }))
}

/// `cuMemMap`: inside one reserved range, overlapping no other mapping.
#[no_mangle]
pub extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: c_ulonglong,
) -> CUresult {
    status(driver_call("cuMemMap", |s| {
        s.require_init()?;
        let (size, offset) = (size as u64, offset as u64);
        if flags != 0 || !granular(size) || ptr % GRANULARITY != 0 || offset % GRANULARITY != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if s.whole_handle_maps && offset != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let physical_size = s
            .physical
            .get(&handle)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?
            .size;
        if offset
            .checked_add(size)
            .is_none_or(|end| end > physical_size)
            || s.reservation_of(ptr, size).is_none()
            || s.overlaps_mapping(ptr, size)
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let offset = if s.map_offset_ignored { 0 } else { offset };
        s.mappings.insert(
            ptr,
            Mapping {
                size,
                handle,
                offset,
                access_mask: 0,
            },
        );
        if let Some(p) = s.physical.get_mut(&handle) {
            p.mappings += 1;
        }
        Ok(())
    }))
}

/// `cuMemUnmap`: exactly one earlier mapping.
#[no_mangle]
pub extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    status(driver_call("cuMemUnmap", |s| {
        s.require_init()?;
        if s.mappings.get(&ptr).map(|m| m.size) != Some(size as u64) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if let Some(m) = s.mappings.remove(&ptr) {
            if let Some(p) = s.physical.get_mut(&m.handle) {
                p.mappings -= 1;
            }
        }
        Ok(())
    }))
}

/// `cuMemSetAccess`: the range must be exactly covered by mappings.
///
/// # Safety
/// `desc` must be null or valid for reading `count` `CUmemAccessDesc`s.
#[no_mangle]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> CUresult {
    status(driver_call("cuMemSetAccess", |s| {
        s.require_init()?;
        non_null(desc)?;
        if count == 0 || size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: checked non-null above; the caller promises `count`
        // readable descriptors, which are plain integers.
        let descs = unsafe { std::slice::from_raw_parts(desc, count) }.to_vec();
        let mut grant = 0u32;
        let mut revoke = 0u32;
        for d in &descs {
            if d.location.location_type != LOCATION_TYPE_DEVICE {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            let bit = 1u32 << s.device(d.location.id)?;
            match d.flags {
                0 => revoke |= bit,
                1 | 3 => grant |= bit,
                _ => return Err(CUDA_ERROR_INVALID_VALUE),
            }
        }
        // The mappings must tile [ptr, ptr + size) with no hole.
        let end = ptr
            .checked_add(size as u64)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let mut cursor = ptr;
        for (&start, m) in s.mappings.range(ptr..end) {
            if start != cursor {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            cursor = start + m.size;
        }
        if cursor != end {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        for (_, m) in s.mappings.range_mut(ptr..end) {
            m.access_mask = (m.access_mask | grant) & !revoke;
        }
        Ok(())
    }))
}

/// `cuMemsetD8_v2`: sets `count` bytes from `dst` (a segment's, or mapped
/// with access for the current device) to `value`.
#[no_mangle]
pub extern "C" fn cuMemsetD8_v2(dst: CUdeviceptr, value: u8, count: usize) -> CUresult {
    status(driver_call("cuMemsetD8_v2", |s| {
        let d = s.current_device()?;
        s.device_bytes(dst, count as u64, d, |bytes| bytes.fill(value))
    }))
}

/// `cuMemcpyDtoH_v2`: copies `count` bytes from device address `src` (as
/// for `cuMemsetD8_v2`) to host memory at `dst`.
///
/// # Safety
/// `dst` must be null or valid for writing `count` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(
    dst: *mut c_void,
    src: CUdeviceptr,
    count: usize,
) -> CUresult {
    status(driver_call("cuMemcpyDtoH_v2", |s| {
        non_null(dst)?;
        let d = s.current_device()?;
        // SAFETY: checked non-null above; the caller promises `count`
        // writable bytes at `dst`.
        unsafe { s.copy_to_host(dst.cast(), src, count as u64, d) }
    }))
}

/// `cuEventCreate`.
///
/// # Safety
/// `event` must be null or valid for writing a `CUevent`.
#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(event: *mut CUevent, flags: c_uint) -> CUresult {
    let result = driver_call("cuEventCreate", |s| {
        non_null(event)?;
        s.current_device()?;
        if flags > 0xF {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let value = s.next_event;
        s.next_event += 16;
        s.events.insert(value, false);
        Ok(value as usize as CUevent)
    });
    // SAFETY: checked non-null above; the caller promises it is writable.
    unsafe { write_out(event, result) }
}

/// `cuEventRecord`: pending until completed, unless events complete at once.
#[no_mangle]
pub extern "C" fn cuEventRecord(event: CUevent, _stream: CUstream) -> CUresult {
    status(driver_call("cuEventRecord", |s| {
        s.current_device()?;
        let pending_after_record = !s.events_complete;
        let pending = s
            .events
            .get_mut(&(event as usize as u64))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        *pending = pending_after_record;
        Ok(())
    }))
}

/// `cuEventQuery`: `CUDA_ERROR_NOT_READY` while pending.
#[no_mangle]
pub extern "C" fn cuEventQuery(event: CUevent) -> CUresult {
    status(driver_call("cuEventQuery", |s| {
        s.require_init()?;
        match s.events.get(&(event as usize as u64)) {
            None => Err(CUDA_ERROR_INVALID_HANDLE),
            Some(true) => Err(CUDA_ERROR_NOT_READY),
            Some(false) => Ok(()),
        }
    }))
}

/// `cuEventSynchronize`: the wait is simulated; the event completes.
#[no_mangle]
pub extern "C" fn cuEventSynchronize(event: CUevent) -> CUresult {
    status(driver_call("cuEventSynchronize", |s| {
        s.require_init()?;
        let pending = s
            .events
            .get_mut(&(event as usize as u64))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        *pending = false;
        Ok(())
    }))
}

/// `cuEventDestroy_v2`.
#[no_mangle]
pub extern "C" fn cuEventDestroy_v2(event: CUevent) -> CUresult {
    status(driver_call("cuEventDestroy_v2", |s| {
        s.require_init()?;
        s.events
            .remove(&(event as usize as u64))
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }))
}

/// `cuGetErrorName`: the driver's name for a status code.
///
/// # Safety
/// `name` must be null or valid for writing a `const char*`.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, name: *mut *const c_char) -> CUresult {
    let result = driver_call("cuGetErrorName", |_| {
        non_null(name)?;
        KNOWN_ERROR_NAMES
            .iter()
            .find(|(code, _)| *code == error)
            .map(|(_, text)| text.as_ptr())
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    });
    // SAFETY: checked non-null above; the caller promises it is writable.
    // The strings are `'static`, so the pointer stays valid.
    unsafe { write_out(name, result) }
}

/// `cuThreadExchangeStreamCaptureMode`: sets the calling thread's mode to
/// `*mode` and writes the previous one back.
///
/// # Safety
/// `mode` must be null or valid for reading and writing a
/// `CUstreamCaptureMode`.
#[no_mangle]
pub unsafe extern "C" fn cuThreadExchangeStreamCaptureMode(
    mode: *mut CUstreamCaptureMode,
) -> CUresult {
    let result = driver_call("cuThreadExchangeStreamCaptureMode", |s| {
        non_null(mode)?;
        s.require_init()?;
        // SAFETY: checked non-null above; the caller promises it points to
        // a readable `CUstreamCaptureMode`.
        let wanted = unsafe { mode.read_unaligned() };
        if wanted > CU_STREAM_CAPTURE_MODE_RELAXED {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(CAPTURE_MODE.with(|m| m.replace(wanted)))
    });
    // SAFETY: checked non-null above; the caller promises it is writable.
    unsafe { write_out(mode, result) }
}

// ---------------------------------------------------------------------------
// Control functions for tests
// ---------------------------------------------------------------------------

/// Forgets everything: memory, ranges, events, contexts, counts, faults;
/// capacity back to 1 GiB, events complete at once, `cuInit` needed again,
/// the calling thread's capture mode global (other threads keep theirs).
#[no_mangle]
pub extern "C" fn hbm_double_reset() {
    control((), |s| {
        *s = State::new();
        CAPTURE_MODE.with(|m| m.set(CU_STREAM_CAPTURE_MODE_GLOBAL));
    });
}

/// Sets each device's capacity in bytes.
#[no_mangle]
pub extern "C" fn hbm_double_set_capacity(bytes: u64) {
    control((), |s| s.capacity = bytes);
}

/// Makes the `nth` call (1 = the next) of driver function `call_name` from
/// now fail with `error_code`. Returns `CUDA_SUCCESS`, or
/// `CUDA_ERROR_INVALID_VALUE` for a null or non-UTF-8 name or `nth == 0`.
///
/// # Safety
/// `call_name` must be null or a valid nul-terminated string.
#[no_mangle]
pub unsafe extern "C" fn hbm_double_fail_nth(
    call_name: *const c_char,
    nth: u64,
    error_code: CUresult,
) -> CUresult {
    if call_name.is_null() || nth == 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: checked non-null above; the caller promises a nul-terminated
    // string that outlives this call.
    let Ok(call) = unsafe { CStr::from_ptr(call_name) }.to_str() else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    control(CUDA_ERROR_UNKNOWN, |s| {
        let seen = s.calls.get(call).copied().unwrap_or(0);
        s.faults.push(Fault {
            call: call.to_string(),
            at_count: seen + nth,
            code: error_code,
        });
        CUDA_SUCCESS
    })
}

/// With `true` (the default), recorded events complete at once; with
/// `false`, they stay pending until completed or synchronized.
#[no_mangle]
pub extern "C" fn hbm_double_set_events_complete(complete: bool) {
    control((), |s| s.events_complete = complete);
}

/// With `true`, `cuMemMap` refuses any offset but 0 (its documentation
/// says the offset "currently must be zero"); with `false` (the default),
/// it maps any granule-aligned part of a handle.
#[no_mangle]
pub extern "C" fn hbm_double_set_whole_handle_maps(whole: bool) {
    control((), |s| s.whole_handle_maps = whole);
}

/// With `true`, `cuMemMap` accepts an offset into a handle but maps the
/// handle from its start, as a driver that takes the parameter (documented
/// as "currently must be zero") without honouring it might. Only the data
/// (`cuMemsetD8_v2`, `cuMemcpyDtoH_v2`) shows it; `false` is the default.
#[no_mangle]
pub extern "C" fn hbm_double_set_map_offset_ignored(ignored: bool) {
    control((), |s| s.map_offset_ignored = ignored);
}

/// `device` as an index, if the double has that device.
fn device_index(device: c_int) -> Option<usize> {
    usize::try_from(device).ok().filter(|&d| d < DEVICE_COUNT)
}

/// Sets `count` bytes from device address `va` to `value`, as device
/// `device` would reach them (`cuMemsetD8_v2` without a context, and not
/// counted as a driver call): how a test puts data into a buffer.
/// `CUDA_SUCCESS`, or the error `cuMemsetD8_v2` would return.
#[no_mangle]
pub extern "C" fn hbm_double_fill(va: u64, value: u8, count: u64, device: c_int) -> CUresult {
    control(CUDA_ERROR_UNKNOWN, |s| {
        let Some(d) = device_index(device) else {
            return CUDA_ERROR_INVALID_DEVICE;
        };
        status(s.device_bytes(va, count, d, |bytes| bytes.fill(value)))
    })
}

/// Copies `count` bytes from device address `va`, as device `device` would
/// reach them, to host memory at `out` (`cuMemcpyDtoH_v2` without a
/// context, not counted): how a test reads a buffer back.
///
/// # Safety
/// `out` must be null or valid for writing `count` bytes.
#[no_mangle]
pub unsafe extern "C" fn hbm_double_read(
    out: *mut u8,
    va: u64,
    count: u64,
    device: c_int,
) -> CUresult {
    if out.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    control(CUDA_ERROR_UNKNOWN, |s| {
        let Some(d) = device_index(device) else {
            return CUDA_ERROR_INVALID_DEVICE;
        };
        // SAFETY: checked non-null above; the caller promises `count`
        // writable bytes at `out`.
        status(unsafe { s.copy_to_host(out, va, count, d) })
    })
}

/// Completes every pending event.
#[no_mangle]
pub extern "C" fn hbm_double_complete_all_events() {
    control((), State::complete_all_events);
}

/// Calls of driver function `call_name` since the last reset (0 for null).
///
/// # Safety
/// `call_name` must be null or a valid nul-terminated string.
#[no_mangle]
pub unsafe extern "C" fn hbm_double_call_count(call_name: *const c_char) -> u64 {
    if call_name.is_null() {
        return 0;
    }
    // SAFETY: checked non-null above; the caller promises a nul-terminated
    // string that outlives this call.
    let name = unsafe { CStr::from_ptr(call_name) }.to_string_lossy();
    control(0, |s| s.calls.get(name.as_ref()).copied().unwrap_or(0))
}

/// Calls of driver function `call_name` since the last reset that were made
/// while the calling thread's stream-capture mode was relaxed (0 for null):
/// the calls a CUDA graph capture would have allowed.
///
/// # Safety
/// `call_name` must be null or a valid nul-terminated string.
#[no_mangle]
pub unsafe extern "C" fn hbm_double_relaxed_call_count(call_name: *const c_char) -> u64 {
    if call_name.is_null() {
        return 0;
    }
    // SAFETY: checked non-null above; the caller promises a nul-terminated
    // string that outlives this call.
    let name = unsafe { CStr::from_ptr(call_name) }.to_string_lossy();
    control(0, |s| {
        s.relaxed_calls.get(name.as_ref()).copied().unwrap_or(0)
    })
}

/// The calling thread's stream-capture mode (0 global, 1 thread-local,
/// 2 relaxed), read without a driver call.
#[no_mangle]
pub extern "C" fn hbm_double_capture_mode() -> CUstreamCaptureMode {
    control(CU_STREAM_CAPTURE_MODE_GLOBAL, |_| {
        CAPTURE_MODE.with(Cell::get)
    })
}

/// Sets the calling thread's stream-capture mode without a driver call (how
/// a test puts a thread in the mode a capture left it in). Returns
/// `CUDA_SUCCESS`, or `CUDA_ERROR_INVALID_VALUE` for an unknown mode.
#[no_mangle]
pub extern "C" fn hbm_double_set_capture_mode(mode: CUstreamCaptureMode) -> CUresult {
    if mode > CU_STREAM_CAPTURE_MODE_RELAXED {
        return CUDA_ERROR_INVALID_VALUE;
    }
    control(CUDA_ERROR_UNKNOWN, |_| {
        CAPTURE_MODE.with(|m| m.set(mode));
        CUDA_SUCCESS
    })
}

/// Bytes held by segments and physical memory on all devices.
#[no_mangle]
pub extern "C" fn hbm_double_live_bytes() -> u64 {
    control(0, |s| s.live_bytes())
}

/// Events created and not yet destroyed.
#[no_mangle]
pub extern "C" fn hbm_double_live_events() -> u64 {
    control(0, |s| s.events.len() as u64)
}

/// Outstanding `cuDevicePrimaryCtxRetain`s of `device` (0 for a bad ordinal).
#[no_mangle]
pub extern "C" fn hbm_double_primary_context_retains(device: c_int) -> u64 {
    control(0, |s| {
        usize::try_from(device)
            .ok()
            .and_then(|d| s.primary_retains.get(d).copied())
            .unwrap_or(0)
    })
}

/// Bit `d` set when device `d` may access the mapping starting at `va`
/// (0 when there is no mapping there).
#[no_mangle]
pub extern "C" fn hbm_double_access_mask(va: u64) -> u32 {
    control(0, |s| s.mappings.get(&va).map_or(0, |m| m.access_mask))
}

// ---------------------------------------------------------------------------
// Interprocess sharing
// ---------------------------------------------------------------------------

/// First bytes of the double's `CUipcMemHandle`s.
const IPC_MAGIC: &[u8; 8] = b"HBMDBLIP";

/// The double's `CUipcMemHandle`: the exporting process and its memory
/// file's descriptor (taken with `pidfd_getfd`), the file's length, and the
/// segment's offset and size in it.
fn ipc_handle_bytes(fd: i32, len: u64, offset: u64, size: u64) -> CUipcMemHandle {
    let mut reserved = [0u8; CU_IPC_HANDLE_SIZE];
    reserved[..8].copy_from_slice(IPC_MAGIC);
    reserved[8..12].copy_from_slice(&(std::process::id() as i32).to_le_bytes());
    reserved[12..16].copy_from_slice(&fd.to_le_bytes());
    reserved[16..24].copy_from_slice(&len.to_le_bytes());
    reserved[24..32].copy_from_slice(&offset.to_le_bytes());
    reserved[32..40].copy_from_slice(&size.to_le_bytes());
    CUipcMemHandle { reserved }
}

fn le_u64(bytes: &[u8]) -> u64 {
    u64::from_le_bytes(bytes.try_into().expect("8 bytes"))
}

fn le_i32(bytes: &[u8]) -> i32 {
    i32::from_le_bytes(bytes.try_into().expect("4 bytes"))
}

/// `cuIpcGetMemHandle`: the base of a live `cuMemAlloc` segment only.
///
/// # Safety
/// `handle` must be null or valid for writing a `CUipcMemHandle`.
#[no_mangle]
pub unsafe extern "C" fn cuIpcGetMemHandle(
    handle: *mut CUipcMemHandle,
    dptr: CUdeviceptr,
) -> CUresult {
    let result = driver_call("cuIpcGetMemHandle", |s| {
        non_null(handle)?;
        s.current_device()?;
        let segment = s
            .segments
            .get(&dptr)
            .filter(|seg| !seg.opened)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let start = segment.buffer.as_ptr() as u64;
        Ok(ipc_handle_bytes(
            segment.buffer.fd().as_raw_fd(),
            segment.buffer.len() as u64,
            dptr - start,
            segment.size,
        ))
    });
    // SAFETY: checked non-null above; the caller promises it is writable.
    unsafe { write_out(handle, result) }
}

/// `cuIpcOpenMemHandle_v2`: maps another process's segment (its memory file,
/// taken with `pidfd_getfd`) into this one. Bytes that are not a handle of
/// the double's give `CUDA_ERROR_INVALID_VALUE`; a handle of this process,
/// `CUDA_ERROR_INVALID_CONTEXT` (as the driver refuses); a process or
/// descriptor that is gone, `CUDA_ERROR_INVALID_HANDLE`.
///
/// # Safety
/// `dptr` must be null or valid for writing a `CUdeviceptr`.
#[no_mangle]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(
    dptr: *mut CUdeviceptr,
    handle: CUipcMemHandle,
    flags: c_uint,
) -> CUresult {
    let result = driver_call("cuIpcOpenMemHandle_v2", |s| {
        non_null(dptr)?;
        let d = s.current_device()?;
        let bytes = &handle.reserved;
        if &bytes[..8] != IPC_MAGIC || flags > CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (pid, fd) = (le_i32(&bytes[8..12]), le_i32(&bytes[12..16]));
        let (len, offset, size) = (
            le_u64(&bytes[16..24]),
            le_u64(&bytes[24..32]),
            le_u64(&bytes[32..40]),
        );
        if pid == std::process::id() as i32 {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        if offset.checked_add(size).is_none_or(|end| end > len) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let file =
            hbmalloc_cuda::fd_from_process(pid, fd).map_err(|_| CUDA_ERROR_INVALID_HANDLE)?;
        if HostBytes::file_len(std::os::fd::AsFd::as_fd(&file))? < len {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        let len = usize::try_from(len).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        let buffer = HostBytes::open(std::os::fd::AsFd::as_fd(&file), len)?;
        let ptr = buffer.as_ptr() as u64 + offset;
        s.segments.insert(
            ptr,
            Segment {
                buffer,
                size,
                device: d,
                opened: true,
            },
        );
        Ok(ptr)
    });
    // SAFETY: checked non-null above; the caller promises it is writable.
    unsafe { write_out(dptr, result) }
}

/// `cuIpcCloseMemHandle`: unmaps what `cuIpcOpenMemHandle_v2` mapped.
#[no_mangle]
pub extern "C" fn cuIpcCloseMemHandle(dptr: CUdeviceptr) -> CUresult {
    status(driver_call("cuIpcCloseMemHandle", |s| {
        s.current_device()?;
        if !s.segments.get(&dptr).is_some_and(|seg| seg.opened) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        s.segments.remove(&dptr);
        Ok(())
    }))
}

/// `cuMemExportToShareableHandle`: a new descriptor of the handle's memory
/// file, for handles created with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
///
/// # Safety
/// `shareable` must be null or valid for writing an `int`.
#[no_mangle]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    shareable: *mut c_void,
    handle: CUmemGenericAllocationHandle,
    handle_type: c_uint,
    flags: c_ulonglong,
) -> CUresult {
    let out = shareable.cast::<c_int>();
    let result = driver_call("cuMemExportToShareableHandle", |s| {
        non_null(out)?;
        s.require_init()?;
        if handle_type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let physical = s.physical.get(&handle).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if !physical.exportable {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let fd = physical
            .buffer
            .fd()
            .try_clone_to_owned()
            .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
        Ok(std::os::fd::IntoRawFd::into_raw_fd(fd))
    });
    // SAFETY: checked non-null above; the caller promises an int's room.
    unsafe { write_out(out, result) }
}

/// `cuMemImportFromShareableHandle`: a handle over the memory file behind
/// descriptor `os_handle` (an export, possibly another process's); the
/// descriptor stays the caller's. Not counted against this process's
/// capacity.
///
/// # Safety
/// `handle` must be null or valid for writing a handle.
#[no_mangle]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut CUmemGenericAllocationHandle,
    os_handle: *mut c_void,
    handle_type: c_uint,
) -> CUresult {
    let result = driver_call("cuMemImportFromShareableHandle", |s| {
        non_null(handle)?;
        let d = s.current_device()?;
        let raw = i32::try_from(os_handle as usize).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        if handle_type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || raw < 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: F_GETFD reads a descriptor's flags and fails on one that
        // is not open; no memory is passed.
        if unsafe { libc::fcntl(raw, libc::F_GETFD) } < 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: checked open just above, and the caller keeps it open for
        // the call.
        let fd = unsafe { BorrowedFd::borrow_raw(raw) };
        let len = HostBytes::file_len(fd)?;
        if !granular(len) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let buffer = HostBytes::open(
            fd,
            usize::try_from(len).map_err(|_| CUDA_ERROR_INVALID_VALUE)?,
        )?;
        let value = s.next_handle;
        s.next_handle += 1;
        s.physical.insert(
            value,
            Physical {
                buffer,
                size: len,
                device: d,
                mappings: 0,
                exportable: true,
                imported: true,
            },
        );
        Ok(value)
    });
    // SAFETY: checked non-null above; the caller promises it is writable.
    unsafe { write_out(handle, result) }
}

/// Physical handles alive (created or imported, not yet released).
#[no_mangle]
pub extern "C" fn hbm_double_live_handles() -> u64 {
    control(0, |s| s.physical.len() as u64)
}

/// Other processes' segments open (`cuIpcOpenMemHandle_v2`, not yet closed).
#[no_mangle]
pub extern "C" fn hbm_double_open_ipc_segments() -> u64 {
    control(0, |s| {
        s.segments.values().filter(|seg| seg.opened).count() as u64
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capture_mode_is_exchanged_per_thread_and_relaxed_calls_are_counted() {
        // The other unit tests do not touch the driver state, so one reset
        // here is enough.
        hbm_double_reset();
        assert_eq!(cuInit(0), CUDA_SUCCESS);
        assert_eq!(hbm_double_capture_mode(), CU_STREAM_CAPTURE_MODE_GLOBAL);
        let mut mode = CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is a valid in-out pointer for the call.
        let status = unsafe { cuThreadExchangeStreamCaptureMode(&mut mode) };
        assert_eq!(status, CUDA_SUCCESS);
        assert_eq!(mode, CU_STREAM_CAPTURE_MODE_GLOBAL, "the previous mode");
        assert_eq!(hbm_double_capture_mode(), CU_STREAM_CAPTURE_MODE_RELAXED);
        // Another thread has its own mode.
        let other = std::thread::spawn(|| hbm_double_capture_mode())
            .join()
            .unwrap();
        assert_eq!(other, CU_STREAM_CAPTURE_MODE_GLOBAL);
        // Made in relaxed mode: counted as such; the exchange that switched
        // to relaxed was made in global mode.
        assert_eq!(cuInit(0), CUDA_SUCCESS);
        let relaxed = |name: &CStr| {
            // SAFETY: a valid nul-terminated string.
            unsafe { hbm_double_relaxed_call_count(name.as_ptr()) }
        };
        assert_eq!(relaxed(c"cuInit"), 1);
        assert_eq!(relaxed(c"cuThreadExchangeStreamCaptureMode"), 0);

        let mut bad = 3;
        // SAFETY: as above.
        let status = unsafe { cuThreadExchangeStreamCaptureMode(&mut bad) };
        assert_eq!(status, CUDA_ERROR_INVALID_VALUE);
        assert_eq!(bad, 3, "unchanged on failure");
        assert_eq!(hbm_double_capture_mode(), CU_STREAM_CAPTURE_MODE_RELAXED);
        // SAFETY: null is allowed and refused.
        let status = unsafe { cuThreadExchangeStreamCaptureMode(std::ptr::null_mut()) };
        assert_eq!(status, CUDA_ERROR_INVALID_VALUE);
        assert_eq!(hbm_double_set_capture_mode(3), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(
            hbm_double_set_capture_mode(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            CUDA_SUCCESS
        );
        assert_eq!(
            hbm_double_capture_mode(),
            CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        );
        hbm_double_reset();
        assert_eq!(hbm_double_capture_mode(), CU_STREAM_CAPTURE_MODE_GLOBAL);
        assert_eq!(relaxed(c"cuInit"), 0);
    }
}

//! The `extern "C"` functions of `include/hbmalloc.h`.
//!
//! Every function runs its body under [`std::panic::catch_unwind`] (a panic
//! becomes [`Status::Internal`]), records its outcome as the calling thread's
//! last error (`Status::Ok` and an empty message on success), and never
//! unwinds into C. The one exception is by design: `hbmalloc_torch_alloc`
//! reports a failure to its C++ caller (PyTorch) as a C++ exception, thrown
//! by `cxx/throw.cc` after hbmalloc's own work is done. `unsafe` appears
//! only where C pointers are read or written, and at that throw.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

use hbmalloc::{PoolId, StreamId};

use crate::{ApiError, Status};

/// C's `ssize_t` (`isize` on every platform Rust and PyTorch support).
#[allow(non_camel_case_types)]
pub type ssize_t = isize;

/// `cudaStream_t`: an opaque stream handle, used as a number.
pub type CudaStream = *mut c_void;

thread_local! {
    static LAST_ERROR: RefCell<(Status, String)> = const { RefCell::new((Status::Ok, String::new())) };
}

fn set_last_error(status: Status, message: &str) {
    // `try_with` fails only while the thread is being torn down; the error
    // is then unobservable anyway.
    let _ = LAST_ERROR.try_with(|last| {
        let mut last = last.borrow_mut();
        last.0 = status;
        last.1.clear();
        last.1.push_str(message);
    });
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".to_string()
    }
}

/// Runs `body`, records its outcome as the last error, returns its value or
/// `on_error`.
fn guarded<T>(on_error: T, body: impl FnOnce() -> Result<T, ApiError>) -> T {
    let outcome = catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|payload| {
        Err(ApiError::new(
            Status::Internal,
            format!(
                "hbmalloc: internal error (panic): {}",
                panic_message(&*payload)
            ),
        ))
    });
    match outcome {
        Ok(value) => {
            set_last_error(Status::Ok, "");
            value
        }
        Err(e) => {
            set_last_error(e.status, &e.message);
            on_error
        }
    }
}

/// Runs `body`; returns the status it recorded.
fn status_of(body: impl FnOnce() -> Result<(), ApiError>) -> c_int {
    guarded((), body);
    last_error_status() as c_int
}

fn last_error_status() -> Status {
    LAST_ERROR
        .try_with(|last| last.borrow().0)
        .unwrap_or(Status::Internal)
}

fn stream_id(stream: CudaStream) -> StreamId {
    StreamId(stream as usize as u64)
}

/// Copies `text` into `buf` (at most `len - 1` bytes and a NUL), snprintf
/// style; returns the length of `text`.
///
/// # Safety
/// `buf` is null, or valid for writes of `len` bytes.
unsafe fn write_text(text: &str, buf: *mut c_char, len: usize) -> Result<ssize_t, ApiError> {
    if buf.is_null() && len > 0 {
        return Err(ApiError::new(
            Status::InvalidArgument,
            format!("hbmalloc: buffer is NULL but its length is {len}"),
        ));
    }
    if len > 0 {
        let n = text.len().min(len - 1);
        // SAFETY: the caller guarantees `buf` is valid for `len` bytes and
        // `n + 1 <= len`; `text` is a distinct Rust allocation.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
    }
    // A Rust string is at most isize::MAX bytes.
    Ok(text.len() as ssize_t)
}

/// Allocates `size` bytes on `device` for `stream` (PyTorch's pluggable
/// `alloc`). NULL on failure, with the reason as the last error; NULL without
/// error for `size == 0`.
#[no_mangle]
pub extern "C" fn hbmalloc_alloc(size: ssize_t, device: c_int, stream: CudaStream) -> *mut c_void {
    guarded(std::ptr::null_mut(), || {
        // `isize` always fits in `i64` on supported platforms.
        crate::alloc(size as i64, device, stream_id(stream)).map(|p| p as usize as *mut c_void)
    })
}

extern "C-unwind" {
    /// Throws `std::runtime_error(message)` (`cxx/throw.cc`); the message is
    /// copied before the throw.
    fn hbmalloc_capi_throw(message: *const c_char) -> !;
}

thread_local! {
    /// The message `hbmalloc_torch_alloc` throws, kept here so that no value
    /// with a destructor is alive in the frame the exception unwinds.
    static THROWN: RefCell<std::ffi::CString> = RefCell::new(std::ffi::CString::default());
}

/// [`hbmalloc_alloc`] for PyTorch's `CUDAPluggableAllocator` installed as
/// the process's allocator: a failure throws a C++ `std::runtime_error`
/// instead of returning NULL, which PyTorch would hand to a tensor
/// unchecked (the first kernel to touch it would fault at address 0). The
/// exception unwinds through PyTorch's C++ to its Python bindings, which
/// raise `RuntimeError` with the message: for lack of memory it begins
/// `CUDA out of memory.`, as PyTorch's own does, then hbmalloc's report.
/// `size == 0` returns NULL without throwing. Only C++ callers that catch
/// exceptions may use it; C callers use [`hbmalloc_alloc`], as does a
/// `torch.cuda.MemPool`, whose allocator turns NULL into PyTorch's own
/// out-of-memory handling.
#[no_mangle]
pub extern "C-unwind" fn hbmalloc_torch_alloc(
    size: ssize_t,
    device: c_int,
    stream: CudaStream,
) -> *mut c_void {
    throw_unless_allocated(hbmalloc_alloc(size, device, stream), size)
}

/// `ptr`, or the last error thrown as a C++ exception when the allocation
/// of `size` bytes failed (NULL for a non-zero size).
extern "C-unwind" fn throw_unless_allocated(ptr: *mut c_void, size: ssize_t) -> *mut c_void {
    if !ptr.is_null() || size == 0 {
        return ptr;
    }
    let message = thrown_message();
    // SAFETY: `message` is a NUL-terminated string owned by this thread's
    // `THROWN`, valid until its next write on this thread; the C++ side
    // copies it into the exception before it throws. The exception unwinds
    // this frame and the caller's ("C-unwind"), which hold nothing to drop.
    unsafe { hbmalloc_capi_throw(message) }
}

/// The last error as `hbmalloc_torch_alloc` throws it, in `THROWN`.
fn thrown_message() -> *const c_char {
    let text = catch_unwind(|| {
        let (status, message) = LAST_ERROR
            .try_with(|last| last.borrow().clone())
            .unwrap_or((Status::Internal, String::new()));
        let text = match status {
            Status::OutOfMemory => format!(
                "CUDA out of memory. hbmalloc: {}",
                message.strip_prefix("out of memory: ").unwrap_or(&message)
            ),
            _ if message.is_empty() => "hbmalloc: allocation failed".to_string(),
            _ => message,
        };
        // A message never holds a NUL; if one did, it would be cut there.
        let text = text.split('\0').next().unwrap_or_default().to_string();
        std::ffi::CString::new(text).unwrap_or_default()
    })
    .unwrap_or_default();
    THROWN
        .try_with(|slot| {
            *slot.borrow_mut() = text;
            slot.borrow().as_ptr()
        })
        .unwrap_or(c"hbmalloc: allocation failed".as_ptr())
}

/// [`hbmalloc_alloc`] from the private pool `(pool_first, pool_second)`
/// (PyTorch's `MempoolId_t`), made by [`hbmalloc_create_or_incref_pool`].
/// NULL on failure, with the reason as the last error; NULL without error
/// for `size == 0`.
#[no_mangle]
pub extern "C" fn hbmalloc_pool_alloc(
    size: ssize_t,
    device: c_int,
    stream: CudaStream,
    pool_first: u64,
    pool_second: u64,
) -> *mut c_void {
    guarded(std::ptr::null_mut(), || {
        let pool = PoolId(pool_first, pool_second);
        crate::pool_alloc(pool, size as i64, device, stream_id(stream))
            .map(|p| p as usize as *mut c_void)
    })
}

/// [`hbmalloc_pool_alloc`] that throws on failure, as
/// [`hbmalloc_torch_alloc`] does: for C++ callers only.
#[no_mangle]
pub extern "C-unwind" fn hbmalloc_torch_pool_alloc(
    size: ssize_t,
    device: c_int,
    stream: CudaStream,
    pool_first: u64,
    pool_second: u64,
) -> *mut c_void {
    let ptr = hbmalloc_pool_alloc(size, device, stream, pool_first, pool_second);
    throw_unless_allocated(ptr, size)
}

/// Makes the private pool `(pool_first, pool_second)` on `device`, or
/// counts one more holder of it (PyTorch's `createOrIncrefPool`).
#[no_mangle]
pub extern "C" fn hbmalloc_create_or_incref_pool(
    device: c_int,
    pool_first: u64,
    pool_second: u64,
) -> c_int {
    status_of(|| crate::create_or_incref_pool(device, PoolId(pool_first, pool_second)))
}

/// One holder of the pool fewer (PyTorch's `releasePool`): with none left,
/// its memory goes back to the driver as its allocations are freed.
#[no_mangle]
pub extern "C" fn hbmalloc_release_pool(device: c_int, pool_first: u64, pool_second: u64) -> c_int {
    status_of(|| crate::release_pool(device, PoolId(pool_first, pool_second)))
}

/// How many hold the pool, into `*count` (0: no such pool).
///
/// # Safety
/// `count` is null (an invalid argument) or valid for a write of an `int`.
#[no_mangle]
pub unsafe extern "C" fn hbmalloc_pool_use_count(
    device: c_int,
    pool_first: u64,
    pool_second: u64,
    count: *mut c_int,
) -> c_int {
    status_of(|| {
        let n = crate::pool_use_count(device, PoolId(pool_first, pool_second))?;
        // SAFETY: the caller guarantees `count` is null or valid for a write.
        unsafe { write_out(count, c_int::try_from(n).unwrap_or(c_int::MAX), "count") }
    })
}

/// The live allocations of the private pool `(pool_first, pool_second)` on
/// `device`: their number into `*count`, and the first `capacity` of their
/// addresses into `ptrs` (call again with room for `*count` when it is
/// larger). An unknown pool is an invalid argument.
///
/// # Safety
/// `count` is null (an invalid argument) or valid for a write of a
/// `size_t`; `ptrs` is valid for writes of `capacity` pointers (it may be
/// null when `capacity` is 0).
#[no_mangle]
pub unsafe extern "C" fn hbmalloc_pool_live_allocations(
    device: c_int,
    pool_first: u64,
    pool_second: u64,
    ptrs: *mut *mut c_void,
    capacity: usize,
    count: *mut usize,
) -> c_int {
    status_of(|| {
        let live = crate::pool_live_allocations(device, PoolId(pool_first, pool_second))?;
        if capacity > 0 && ptrs.is_null() {
            return Err(ApiError::new(
                Status::InvalidArgument,
                "hbmalloc: ptrs is NULL with a non-zero capacity",
            ));
        }
        for (i, &ptr) in live.iter().take(capacity).enumerate() {
            // SAFETY: `ptrs` is non-null here and valid for `capacity` writes
            // (the caller's guarantee); `i < capacity`.
            unsafe { ptrs.add(i).write(ptr as usize as *mut c_void) };
        }
        // SAFETY: the caller guarantees `count` is null or valid for a write.
        unsafe { write_out(count, live.len(), "count") }
    })
}

/// A CUDA graph capture (or `torch.cuda.use_mem_pool`) begins on `device`:
/// until the matching [`hbmalloc_end_capture`] the allocator waits for no
/// event and gives no memory back (`hbmalloc::capture`).
#[no_mangle]
pub extern "C" fn hbmalloc_begin_capture(device: c_int) -> c_int {
    status_of(|| crate::begin_capture(device))
}

/// The capture begun with [`hbmalloc_begin_capture`] ended.
#[no_mangle]
pub extern "C" fn hbmalloc_end_capture(device: c_int) -> c_int {
    status_of(|| crate::end_capture(device))
}

/// Frees `ptr` (PyTorch's pluggable `free`). NULL is a no-op; a pointer
/// hbmalloc does not hold on `device` sets `UNKNOWN_POINTER`.
#[no_mangle]
pub extern "C" fn hbmalloc_free(
    ptr: *mut c_void,
    size: ssize_t,
    device: c_int,
    stream: CudaStream,
) {
    let _ = (size, stream);
    guarded((), || crate::free(ptr as usize as u64, device));
}

/// Declares that `ptr` is used on `stream` too; its memory is reused only
/// after that stream's work issued before the free completes.
#[no_mangle]
pub extern "C" fn hbmalloc_record_stream(
    ptr: *mut c_void,
    device: c_int,
    stream: CudaStream,
) -> c_int {
    status_of(|| crate::record_stream(ptr as usize as u64, device, stream_id(stream)))
}

/// Returns `device`'s cached free memory to the driver.
#[no_mangle]
pub extern "C" fn hbmalloc_empty_cache(device: c_int) -> c_int {
    status_of(|| crate::empty_cache(device))
}

/// Limits `device`'s allocator to `fraction` (0..=1) of the device's memory.
#[no_mangle]
pub extern "C" fn hbmalloc_set_memory_fraction(fraction: f64, device: c_int) -> c_int {
    status_of(|| crate::set_memory_fraction(fraction, device))
}

/// `torch.cuda.reset_peak_memory_stats(device)`: every peak statistic of
/// `device` becomes its current value.
#[no_mangle]
pub extern "C" fn hbmalloc_reset_peak_stats(device: c_int) -> c_int {
    status_of(|| crate::reset_peak_stats(device))
}

/// `torch.cuda.reset_accumulated_memory_stats(device)`.
#[no_mangle]
pub extern "C" fn hbmalloc_reset_accumulated_stats(device: c_int) -> c_int {
    status_of(|| crate::reset_accumulated_stats(device))
}

/// Writes `value` through `out`, a caller's out-parameter named `name`.
///
/// # Safety
/// `out` is null (an invalid argument) or valid for a write of a `T`.
unsafe fn write_out<T>(out: *mut T, value: T, name: &str) -> Result<(), ApiError> {
    if out.is_null() {
        return Err(ApiError::new(
            Status::InvalidArgument,
            format!("hbmalloc: {name} is NULL"),
        ));
    }
    // SAFETY: non-null, and the caller guarantees it is valid for a write.
    unsafe { out.write(value) };
    Ok(())
}

/// The share of `device`'s memory its allocator may hold, into `*fraction`
/// (`torch.cuda.get_per_process_memory_fraction`).
///
/// # Safety
/// `fraction` is null or valid for a write of a `double`.
#[no_mangle]
pub unsafe extern "C" fn hbmalloc_memory_fraction(device: c_int, fraction: *mut f64) -> c_int {
    status_of(|| {
        let value = crate::memory_fraction(device)?;
        // SAFETY: forwarded from this function's contract.
        unsafe { write_out(fraction, value, "fraction") }
    })
}

/// PyTorch's `cacheInfo`: the largest request `device`'s allocator could
/// serve now without freeing anything, into `*largest_block`.
///
/// # Safety
/// `largest_block` is null or valid for a write of a `size_t`.
#[no_mangle]
pub unsafe extern "C" fn hbmalloc_cache_info(device: c_int, largest_block: *mut usize) -> c_int {
    status_of(|| {
        let bytes = crate::largest_free_block(device)?;
        let bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
        // SAFETY: forwarded from this function's contract.
        unsafe { write_out(largest_block, bytes, "largest_block") }
    })
}

/// The driver's free and total memory of `device` into `*free_bytes` and
/// `*total_bytes` (`cudaMemGetInfo`).
///
/// # Safety
/// Each pointer is null or valid for a write of a `size_t`.
#[no_mangle]
pub unsafe extern "C" fn hbmalloc_mem_get_info(
    device: c_int,
    free_bytes: *mut usize,
    total_bytes: *mut usize,
) -> c_int {
    status_of(|| {
        if free_bytes.is_null() || total_bytes.is_null() {
            return Err(ApiError::new(
                Status::InvalidArgument,
                "hbmalloc: free_bytes or total_bytes is NULL",
            ));
        }
        let (free, total) = crate::mem_get_info(device)?;
        let size = |bytes: u64| usize::try_from(bytes).unwrap_or(usize::MAX);
        // SAFETY: both non-null, and the caller guarantees them valid for writes.
        unsafe {
            write_out(free_bytes, size(free), "free_bytes")?;
            write_out(total_bytes, size(total), "total_bytes")
        }
    })
}

/// `values[i]` = `memory_stats()[keys[i]]` of `device` for each of `count`
/// keys; nothing is written unless every key is known.
///
/// # Safety
/// When `count > 0`, `keys` is valid for reads of `count` pointers, each
/// null or a NUL-terminated string, and `values` for writes of `count`
/// `int64_t`s.
#[no_mangle]
pub unsafe extern "C" fn hbmalloc_stats_values(
    device: c_int,
    keys: *const *const c_char,
    count: usize,
    values: *mut i64,
) -> c_int {
    status_of(|| {
        if count == 0 {
            return Ok(());
        }
        if keys.is_null() || values.is_null() || count > isize::MAX as usize / 8 {
            return Err(ApiError::new(
                Status::InvalidArgument,
                format!("hbmalloc: stats keys or values are NULL, or count {count} is absurd"),
            ));
        }
        // SAFETY: non-null, and the caller guarantees `count` readable
        // pointers; `count * 8` fits in isize (checked above).
        let keys = unsafe { std::slice::from_raw_parts(keys, count) };
        let mut names = Vec::with_capacity(count);
        for (i, &key) in keys.iter().enumerate() {
            let invalid = |what: &str| {
                ApiError::new(
                    Status::InvalidArgument,
                    format!("hbmalloc: stats key {i} is {what}"),
                )
            };
            if key.is_null() {
                return Err(invalid("NULL"));
            }
            // SAFETY: non-null, and the caller guarantees NUL termination.
            let key = unsafe { CStr::from_ptr(key) };
            names.push(key.to_str().map_err(|_| invalid("not UTF-8"))?);
        }
        let found = crate::stats_values(device, &names)?;
        // SAFETY: the caller guarantees `count` writable values; `found`
        // has one per key and is a distinct Rust allocation.
        unsafe { std::ptr::copy_nonoverlapping(found.as_ptr(), values, count) };
        Ok(())
    })
}

/// Every allocator (and those created later) keeps its last `entries`
/// history entries from now on (0 stops recording); a non-zero `clear`
/// drops those kept. `entries` below 0 is an invalid argument.
#[no_mangle]
pub extern "C" fn hbmalloc_set_history_entries(entries: ssize_t, clear: c_int) -> c_int {
    status_of(|| {
        let entries = usize::try_from(entries).map_err(|_| {
            ApiError::new(
                Status::InvalidArgument,
                format!("hbmalloc: invalid history entries {entries}: expected 0 or more"),
            )
        })?;
        crate::set_history_entries(entries, clear != 0)
    })
}

/// The history entries every allocator keeps now, into `*entries` (0:
/// history is off).
///
/// # Safety
/// `entries` is null (an invalid argument) or valid for a write of a `size_t`.
#[no_mangle]
pub unsafe extern "C" fn hbmalloc_history_entries(entries: *mut usize) -> c_int {
    status_of(|| {
        let n = crate::history_entries()?;
        // SAFETY: the caller guarantees `entries` is null or valid for a write.
        unsafe { write_out(entries, n, "entries") }
    })
}

/// Writes `memory_stats()` of `device` as JSON into `buf` (snprintf style);
/// returns the JSON's length, or -1 on error.
///
/// # Safety
/// `buf` is null (with `len == 0` to ask for the length), or valid for
/// writes of `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn hbmalloc_stats_json(
    device: c_int,
    buf: *mut c_char,
    len: usize,
) -> ssize_t {
    guarded(-1, || {
        let json = crate::stats_json(device)?;
        // SAFETY: forwarded from this function's contract.
        unsafe { write_text(&json, buf, len) }
    })
}

/// Writes `memory_summary()` of `device` into `buf` (snprintf style);
/// returns the text's length, or -1 on error.
///
/// # Safety
/// As [`hbmalloc_stats_json`].
#[no_mangle]
pub unsafe extern "C" fn hbmalloc_summary(
    device: c_int,
    abbreviated: c_int,
    buf: *mut c_char,
    len: usize,
) -> ssize_t {
    guarded(-1, || {
        let text = crate::summary(device, abbreviated != 0)?;
        // SAFETY: forwarded from this function's contract.
        unsafe { write_text(&text, buf, len) }
    })
}

/// Writes `device`'s snapshot to the file `path` as a PyTorch memory-snapshot
/// pickle.
///
/// # Safety
/// `path` is null or a valid NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn hbmalloc_snapshot(device: c_int, path: *const c_char) -> c_int {
    status_of(|| {
        if path.is_null() {
            return Err(ApiError::new(
                Status::InvalidArgument,
                "hbmalloc: snapshot path is NULL",
            ));
        }
        // SAFETY: non-null, and the caller guarantees NUL termination.
        let path = unsafe { CStr::from_ptr(path) };
        let path = path_from_c(path)?;
        crate::write_snapshot(device, &path)
    })
}

/// Writes the production log (`log:PATH` in `HBMALLOC_CONF`): each device
/// that has allocated, its snapshot with the history it kept, to `PATH`
/// (device 0) or `PATH.dev<N>`. `HBMALLOC_INVALID_STATE` when no log is
/// configured.
#[no_mangle]
pub extern "C" fn hbmalloc_write_log() -> c_int {
    status_of(|| crate::write_log().map(|_| ()))
}

#[cfg(unix)]
fn path_from_c(path: &CStr) -> Result<std::path::PathBuf, ApiError> {
    use std::os::unix::ffi::OsStrExt;
    Ok(std::ffi::OsStr::from_bytes(path.to_bytes()).into())
}

#[cfg(not(unix))]
fn path_from_c(path: &CStr) -> Result<std::path::PathBuf, ApiError> {
    path.to_str().map(Into::into).map_err(|_| {
        ApiError::new(
            Status::InvalidArgument,
            "hbmalloc: snapshot path is not valid UTF-8",
        )
    })
}

/// Copies the calling thread's last error message into `buf` (snprintf
/// style); returns its length (0 after a successful call).
///
/// # Safety
/// As [`hbmalloc_stats_json`].
#[no_mangle]
pub unsafe extern "C" fn hbmalloc_last_error(buf: *mut c_char, len: usize) -> ssize_t {
    let result = catch_unwind(AssertUnwindSafe(|| {
        let message = LAST_ERROR
            .try_with(|last| last.borrow().1.clone())
            .unwrap_or_default();
        // SAFETY: forwarded from this function's contract.
        unsafe { write_text(&message, buf, len) }.unwrap_or(-1)
    }));
    result.unwrap_or(-1)
}

/// The calling thread's last status code (`HBMALLOC_OK` after a successful call).
#[no_mangle]
pub extern "C" fn hbmalloc_last_error_code() -> c_int {
    catch_unwind(|| last_error_status() as c_int).unwrap_or(Status::Internal as c_int)
}

/// Loads the driver and configuration now rather than at the first
/// allocation. `device_count` is what PyTorch's init hook passes (the number
/// of devices it sees); it must not exceed the driver's count (negative:
/// not checked).
#[no_mangle]
pub extern "C" fn hbmalloc_init(device_count: c_int) -> c_int {
    status_of(|| {
        let seen = crate::init()?;
        if usize::try_from(device_count).is_ok_and(|n| n > seen) {
            return Err(ApiError::new(
                Status::DeviceOutOfRange,
                format!(
                    "hbmalloc: asked to serve {device_count} device(s) but the CUDA driver sees {seen}"
                ),
            ));
        }
        Ok(())
    })
}

/// Returns every device's cached free memory to the driver (PyTorch's
/// `reset` hook, which `torch.cuda.empty_cache()` calls).
#[no_mangle]
pub extern "C" fn hbmalloc_reset() -> c_int {
    status_of(crate::reset)
}

/// Shares allocation `ptr` with another process in PyTorch's CUDA IPC
/// format (`CUDAAllocator::shareIpcHandle`), or hbmalloc's own where physical
/// handles of several sizes lie under it (see `ipc.rs`): the handle's bytes
/// into `handle` (at most `capacity` of them), their number into `*length`
/// (call again with a larger buffer when it exceeds `capacity`), and where
/// `ptr` lies in the shared memory into `*offset`.
///
/// # Safety
/// `handle` is valid for writes of `capacity` bytes (it may be null when
/// `capacity` is 0); `length` and `offset` are null (an invalid argument)
/// or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn hbmalloc_ipc_share(
    ptr: *mut c_void,
    handle: *mut c_char,
    capacity: usize,
    length: *mut usize,
    offset: *mut u64,
) -> c_int {
    status_of(|| {
        if capacity > 0 && handle.is_null() {
            return Err(ApiError::new(
                Status::InvalidArgument,
                "hbmalloc: handle is NULL with a non-zero capacity",
            ));
        }
        let shared = crate::ipc::share(ptr as usize as u64)?;
        let n = shared.handle.len().min(capacity);
        // SAFETY: `handle` is non-null when `capacity > 0` (checked) and the
        // caller guarantees `capacity` writable bytes; `n <= capacity`.
        unsafe { std::ptr::copy_nonoverlapping(shared.handle.as_ptr(), handle.cast::<u8>(), n) };
        // SAFETY: forwarded from this function's contract.
        unsafe { write_out(length, shared.handle.len(), "length")? };
        // SAFETY: forwarded from this function's contract.
        unsafe { write_out(offset, shared.offset, "offset") }
    })
}

/// Maps on `device` the memory another process shared as the `length`
/// bytes at `handle` (PyTorch's `getIpcDevPtr`), into `*base`: where the
/// shared memory starts (add the sender's offset). The same bytes again give
/// the same base; each open needs one [`hbmalloc_ipc_close`].
///
/// # Safety
/// `handle` is valid for reads of `length` bytes (any bytes: they are
/// checked); `base` is null (an invalid argument) or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn hbmalloc_ipc_open(
    handle: *const c_char,
    length: usize,
    device: c_int,
    base: *mut *mut c_void,
) -> c_int {
    status_of(|| {
        if handle.is_null() {
            return Err(ApiError::new(
                Status::InvalidArgument,
                "hbmalloc: handle is NULL",
            ));
        }
        // No buffer is longer than isize::MAX bytes: such a length (a
        // negative one cast to size_t) is refused before a slice is made.
        if length > isize::MAX as usize {
            return Err(ApiError::new(
                Status::InvalidArgument,
                format!("hbmalloc: handle length {length} is absurd"),
            ));
        }
        // SAFETY: non-null, and the caller guarantees `length` readable
        // bytes; `length` fits in isize (checked above).
        let bytes = unsafe { std::slice::from_raw_parts(handle.cast::<u8>(), length) };
        let ptr = crate::ipc::open(bytes, device)?;
        // SAFETY: forwarded from this function's contract.
        unsafe { write_out(base, ptr as usize as *mut c_void, "base") }
    })
}

/// Releases one [`hbmalloc_ipc_open`] of the memory at `base`; the last one
/// unmaps it. Never throws or aborts (a destructor calls it).
#[no_mangle]
pub extern "C" fn hbmalloc_ipc_close(base: *mut c_void) -> c_int {
    status_of(|| crate::ipc::close(base as usize as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_internal_error() {
        let value = guarded(7, || -> Result<i32, ApiError> { panic!("boom") });
        assert_eq!(value, 7);
        assert_eq!(hbmalloc_last_error_code(), Status::Internal as c_int);
        let message = LAST_ERROR.with(|last| last.borrow().1.clone());
        assert!(
            message.contains("internal error (panic): boom"),
            "{message}"
        );
        assert_eq!(guarded(0, || Ok(1)), 1);
        assert_eq!(hbmalloc_last_error_code(), Status::Ok as c_int);
    }
}

//! `CudaDriver`: the CUDA driver library, loaded at run time, and safe
//! wrappers over the calls `CudaDevice` makes.
//!
//! This module and `ffi` are the crate's whole FFI layer: every `unsafe`
//! in the crate is here. The wrappers are `pub(crate)`: they take handles
//! (`CuContext`, `CuEvent`) that only this crate can make, from the driver.

use std::ffi::{c_char, c_int, c_uchar, c_uint, c_ulonglong, c_void, CStr, OsStr};
use std::fmt;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hbmalloc::{DeviceError, DeviceErrorKind};
use libloading::Library;

use crate::ffi::*;
use crate::SETUP_CALL_KIND;

/// Environment variable naming the driver library to load instead of the
/// system's (how tests point `CudaDriver::load` at the test double).
pub const DRIVER_PATH_ENV: &str = "HBMALLOC_CUDA_DRIVER";

/// Library names tried by [`CudaDriver::load`], in order.
#[cfg(windows)]
pub const DEFAULT_DRIVER_NAMES: &[&str] = &["nvcuda.dll"];
/// Library names tried by [`CudaDriver::load`], in order.
#[cfg(not(windows))]
pub const DEFAULT_DRIVER_NAMES: &[&str] = &["libcuda.so.1", "libcuda.so"];

/// Declares the driver's function table: one field per symbol, all resolved
/// when the library is loaded, and [`DRIVER_SYMBOLS`] listing their names.
macro_rules! driver_api {
    ($($field:ident = $symbol:literal fn($($arg:ty),*);)*) => {
        /// Every driver symbol `CudaDriver` resolves at load time.
        pub const DRIVER_SYMBOLS: &[&str] = &[$($symbol),*];

        /// The resolved driver functions. Valid while the `Library` they came
        /// from is loaded, which `CudaDriver` guarantees by owning both.
        struct DriverApi {
            $($field: unsafe extern "C" fn($($arg),*) -> CUresult,)*
        }

        impl DriverApi {
            fn resolve(library: &Library, path: &str) -> Result<DriverApi, DeviceError> {
                Ok(DriverApi {
                    $($field: {
                        let name = concat!($symbol, "\0").as_bytes();
                        // SAFETY: the type is the C prototype of this symbol
                        // in cuda.h (checked by hand; the `_v2` names are the
                        // ones whose prototypes match); the pointer is only
                        // used while `library` stays loaded (see DriverApi).
                        let symbol = unsafe {
                            library.get::<unsafe extern "C" fn($($arg),*) -> CUresult>(name)
                        }
                        .map_err(|e| no_driver(format!(
                            "CUDA driver library {path} lacks symbol {}: {e}",
                            $symbol
                        )))?;
                        *symbol
                    },)*
                })
            }
        }
    };
}

driver_api! {
    init = "cuInit" fn(c_uint);
    device_get_count = "cuDeviceGetCount" fn(*mut c_int);
    device_get = "cuDeviceGet" fn(*mut CUdevice, c_int);
    device_get_name = "cuDeviceGetName" fn(*mut c_char, c_int, CUdevice);
    device_total_mem = "cuDeviceTotalMem_v2" fn(*mut usize, CUdevice);
    device_can_access_peer = "cuDeviceCanAccessPeer" fn(*mut c_int, CUdevice, CUdevice);
    primary_ctx_retain = "cuDevicePrimaryCtxRetain" fn(*mut CUcontext, CUdevice);
    primary_ctx_release = "cuDevicePrimaryCtxRelease_v2" fn(CUdevice);
    ctx_set_current = "cuCtxSetCurrent" fn(CUcontext);
    ctx_get_current = "cuCtxGetCurrent" fn(*mut CUcontext);
    ctx_synchronize = "cuCtxSynchronize" fn();
    mem_get_info = "cuMemGetInfo_v2" fn(*mut usize, *mut usize);
    mem_alloc = "cuMemAlloc_v2" fn(*mut CUdeviceptr, usize);
    mem_free = "cuMemFree_v2" fn(CUdeviceptr);
    mem_get_allocation_granularity = "cuMemGetAllocationGranularity"
        fn(*mut usize, *const CUmemAllocationProp, c_uint);
    mem_address_reserve = "cuMemAddressReserve"
        fn(*mut CUdeviceptr, usize, usize, CUdeviceptr, c_ulonglong);
    mem_address_free = "cuMemAddressFree" fn(CUdeviceptr, usize);
    mem_create = "cuMemCreate"
        fn(*mut CUmemGenericAllocationHandle, usize, *const CUmemAllocationProp, c_ulonglong);
    mem_release = "cuMemRelease" fn(CUmemGenericAllocationHandle);
    mem_map = "cuMemMap"
        fn(CUdeviceptr, usize, usize, CUmemGenericAllocationHandle, c_ulonglong);
    mem_unmap = "cuMemUnmap" fn(CUdeviceptr, usize);
    mem_set_access = "cuMemSetAccess" fn(CUdeviceptr, usize, *const CUmemAccessDesc, usize);
    memset_d8 = "cuMemsetD8_v2" fn(CUdeviceptr, c_uchar, usize);
    memcpy_dtoh = "cuMemcpyDtoH_v2" fn(*mut c_void, CUdeviceptr, usize);
    event_create = "cuEventCreate" fn(*mut CUevent, c_uint);
    event_record = "cuEventRecord" fn(CUevent, CUstream);
    event_query = "cuEventQuery" fn(CUevent);
    event_synchronize = "cuEventSynchronize" fn(CUevent);
    event_destroy = "cuEventDestroy_v2" fn(CUevent);
    get_error_name = "cuGetErrorName" fn(CUresult, *mut *const c_char);
    thread_exchange_stream_capture_mode = "cuThreadExchangeStreamCaptureMode"
        fn(*mut CUstreamCaptureMode);
    ipc_get_mem_handle = "cuIpcGetMemHandle" fn(*mut CUipcMemHandle, CUdeviceptr);
    ipc_open_mem_handle = "cuIpcOpenMemHandle_v2" fn(*mut CUdeviceptr, CUipcMemHandle, c_uint);
    ipc_close_mem_handle = "cuIpcCloseMemHandle" fn(CUdeviceptr);
    mem_export_to_shareable_handle = "cuMemExportToShareableHandle"
        fn(*mut c_void, CUmemGenericAllocationHandle, c_uint, c_ulonglong);
    mem_import_from_shareable_handle = "cuMemImportFromShareableHandle"
        fn(*mut CUmemGenericAllocationHandle, *mut c_void, c_uint);
}

fn no_driver(detail: String) -> DeviceError {
    DeviceError::new(SETUP_CALL_KIND, DeviceErrorKind::NoDriver, detail)
}

/// A failed driver call: the C function and its status code.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct CuError {
    /// The driver function that failed (`cuMemAlloc_v2`).
    pub function: &'static str,
    /// What it returned.
    pub code: CUresult,
}

pub(crate) type CuResult<T> = Result<T, CuError>;

fn check(function: &'static str, code: CUresult) -> CuResult<()> {
    if code == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CuError { function, code })
    }
}

/// A `CUcontext` this crate got from the driver.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct CuContext(CUcontext);

impl CuContext {
    /// No context.
    pub(crate) const NULL: CuContext = CuContext(std::ptr::null_mut());

    pub(crate) fn is_null(self) -> bool {
        self.0.is_null()
    }
}

// SAFETY: a CUcontext is an opaque token the driver hands out; the driver API
// is thread-safe and accepts a context from any thread (cuCtxSetCurrent is
// made for exactly that). We never dereference it.
unsafe impl Send for CuContext {}
// SAFETY: as above; sharing the token between threads only copies it.
unsafe impl Sync for CuContext {}

/// A `CUevent` this crate created.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct CuEvent(CUevent);

// SAFETY: a CUevent is an opaque token; the driver allows recording, querying,
// synchronizing and destroying an event from any thread. We never
// dereference it, and `CudaDevice` serialises each event's lifecycle through
// its event table.
unsafe impl Send for CuEvent {}
// SAFETY: as above; sharing the token between threads only copies it.
unsafe impl Sync for CuEvent {}

/// The CUDA driver library, loaded at run time, with every symbol hbmalloc
/// needs resolved up front (see [`DRIVER_SYMBOLS`]).
///
/// Share it between devices with an `Arc`; it stays loaded until the last
/// `CudaDevice` using it is dropped.
pub struct CudaDriver {
    api: DriverApi,
    path: String,
    // Keeps the code behind `api` mapped. Never used after loading.
    _library: Library,
}

impl fmt::Debug for CudaDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDriver")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl CudaDriver {
    /// Loads the driver: the library named by `HBMALLOC_CUDA_DRIVER` when
    /// that is set, else the first of [`DEFAULT_DRIVER_NAMES`] that loads.
    ///
    /// Fails with [`DeviceErrorKind::NoDriver`] saying what was tried and
    /// why each failed (the loader's own message).
    pub fn load() -> Result<Arc<CudaDriver>, DeviceError> {
        if let Some(path) = std::env::var_os(DRIVER_PATH_ENV) {
            return CudaDriver::load_from(PathBuf::from(path));
        }
        let mut failures = Vec::new();
        for name in DEFAULT_DRIVER_NAMES {
            match CudaDriver::load_from(name) {
                Ok(driver) => return Ok(driver),
                Err(e) => failures.push(e.detail),
            }
        }
        Err(no_driver(format!(
            "no CUDA driver found: {}",
            failures.join("; ")
        )))
    }

    /// Loads the driver library at `path` (a file path, or a bare name for
    /// the system loader to search) and resolves every symbol.
    pub fn load_from(path: impl AsRef<Path>) -> Result<Arc<CudaDriver>, DeviceError> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        let file: &OsStr = path.as_os_str();
        // SAFETY: loading a library runs its initialisers. We only load the
        // CUDA driver (or a stand-in the user named on purpose), whose
        // initialisers are meant to run in any process that links it.
        let library = unsafe { Library::new(file) }
            .map_err(|e| no_driver(format!("cannot load CUDA driver library {shown}: {e}")))?;
        let api = DriverApi::resolve(&library, &shown)?;
        Ok(Arc::new(CudaDriver {
            api,
            path: shown,
            _library: library,
        }))
    }

    /// The path or name the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Initialises the driver (`cuInit(0)`) and returns how many devices it sees.
    pub fn device_count(&self) -> Result<i32, DeviceError> {
        let setup_error = |e: CuError| {
            DeviceError::new(
                SETUP_CALL_KIND,
                self.error_kind(e.code),
                self.describe(e, ""),
            )
        };
        self.init().map_err(setup_error)?;
        self.get_device_count().map_err(setup_error)
    }

    /// The driver's name for a status code (`CUDA_ERROR_INVALID_VALUE`),
    /// from `cuGetErrorName`, or from a built-in table if that fails.
    pub fn error_name(&self, code: i32) -> String {
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: `name` is a valid out-pointer for the call's duration.
        let status = unsafe { (self.api.get_error_name)(code, &mut name) };
        if status == CUDA_SUCCESS && !name.is_null() {
            // SAFETY: on success the driver stores a pointer to a static,
            // nul-terminated string.
            return unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned();
        }
        KNOWN_ERROR_NAMES
            .iter()
            .find(|(known, _)| *known == code)
            .map_or_else(
                || format!("CUDA_ERROR_{code}"),
                |(_, n)| n.to_string_lossy().into_owned(),
            )
    }

    /// `OutOfMemory` for `CUDA_ERROR_OUT_OF_MEMORY`, else the driver's name.
    pub(crate) fn error_kind(&self, code: CUresult) -> DeviceErrorKind {
        if code == CUDA_ERROR_OUT_OF_MEMORY {
            DeviceErrorKind::OutOfMemory
        } else {
            DeviceErrorKind::Driver(self.error_name(code))
        }
    }

    /// "cuMemAlloc_v2 returned CUDA_ERROR_OUT_OF_MEMORY (2); size 1048576".
    pub(crate) fn describe(&self, e: CuError, context: &str) -> String {
        let mut text = format!(
            "{} returned {} ({})",
            e.function,
            self.error_name(e.code),
            e.code
        );
        if !context.is_empty() {
            text.push_str("; ");
            text.push_str(context);
        }
        text
    }

    pub(crate) fn init(&self) -> CuResult<()> {
        // SAFETY: plain value argument.
        check("cuInit", unsafe { (self.api.init)(0) })
    }

    pub(crate) fn get_device_count(&self) -> CuResult<i32> {
        let mut count = 0;
        // SAFETY: `count` is a valid out-pointer for the call's duration.
        check("cuDeviceGetCount", unsafe {
            (self.api.device_get_count)(&mut count)
        })?;
        Ok(count)
    }

    pub(crate) fn device_get(&self, ordinal: i32) -> CuResult<CUdevice> {
        let mut device = 0;
        // SAFETY: `device` is a valid out-pointer for the call's duration.
        check("cuDeviceGet", unsafe {
            (self.api.device_get)(&mut device, ordinal)
        })?;
        Ok(device)
    }

    pub(crate) fn device_name(&self, device: CUdevice) -> CuResult<String> {
        let mut buffer = [0u8; 256];
        // SAFETY: the driver writes at most `len` bytes, nul included, into
        // `buffer`, which has exactly that many.
        check("cuDeviceGetName", unsafe {
            (self.api.device_get_name)(buffer.as_mut_ptr().cast(), buffer.len() as c_int, device)
        })?;
        let end = buffer.iter().position(|&b| b == 0).unwrap_or(buffer.len());
        Ok(String::from_utf8_lossy(&buffer[..end]).into_owned())
    }

    pub(crate) fn device_total_mem(&self, device: CUdevice) -> CuResult<u64> {
        let mut bytes = 0usize;
        // SAFETY: `bytes` is a valid out-pointer for the call's duration.
        check("cuDeviceTotalMem_v2", unsafe {
            (self.api.device_total_mem)(&mut bytes, device)
        })?;
        Ok(bytes as u64)
    }

    /// True when contexts on `device` can access memory of `peer`.
    pub(crate) fn can_access_peer(&self, device: CUdevice, peer: CUdevice) -> CuResult<bool> {
        let mut can = 0;
        // SAFETY: `can` is a valid out-pointer for the call's duration.
        check("cuDeviceCanAccessPeer", unsafe {
            (self.api.device_can_access_peer)(&mut can, device, peer)
        })?;
        Ok(can != 0)
    }

    pub(crate) fn primary_ctx_retain(&self, device: CUdevice) -> CuResult<CuContext> {
        let mut context = std::ptr::null_mut();
        // SAFETY: `context` is a valid out-pointer for the call's duration.
        check("cuDevicePrimaryCtxRetain", unsafe {
            (self.api.primary_ctx_retain)(&mut context, device)
        })?;
        Ok(CuContext(context))
    }

    pub(crate) fn primary_ctx_release(&self, device: CUdevice) -> CuResult<()> {
        // SAFETY: plain value argument.
        check("cuDevicePrimaryCtxRelease_v2", unsafe {
            (self.api.primary_ctx_release)(device)
        })
    }

    pub(crate) fn ctx_get_current(&self) -> CuResult<CuContext> {
        let mut context = std::ptr::null_mut();
        // SAFETY: `context` is a valid out-pointer for the call's duration.
        check("cuCtxGetCurrent", unsafe {
            (self.api.ctx_get_current)(&mut context)
        })?;
        Ok(CuContext(context))
    }

    pub(crate) fn ctx_set_current(&self, context: CuContext) -> CuResult<()> {
        // SAFETY: the context is null or one the driver gave us (CuContext
        // cannot be made outside this module); the driver validates it.
        check("cuCtxSetCurrent", unsafe {
            (self.api.ctx_set_current)(context.0)
        })
    }

    pub(crate) fn ctx_synchronize(&self) -> CuResult<()> {
        // SAFETY: no arguments.
        check("cuCtxSynchronize", unsafe { (self.api.ctx_synchronize)() })
    }

    /// (free, total) bytes of the current context's device.
    pub(crate) fn mem_get_info(&self) -> CuResult<(u64, u64)> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both are valid out-pointers for the call's duration.
        check("cuMemGetInfo_v2", unsafe {
            (self.api.mem_get_info)(&mut free, &mut total)
        })?;
        Ok((free as u64, total as u64))
    }

    pub(crate) fn mem_alloc(&self, size: usize) -> CuResult<CUdeviceptr> {
        let mut ptr = 0;
        // SAFETY: `ptr` is a valid out-pointer for the call's duration.
        check("cuMemAlloc_v2", unsafe {
            (self.api.mem_alloc)(&mut ptr, size)
        })?;
        Ok(ptr)
    }

    pub(crate) fn mem_free(&self, ptr: CUdeviceptr) -> CuResult<()> {
        // SAFETY: a device address is a plain integer to the host; the driver
        // validates it and never touches host memory through it.
        check("cuMemFree_v2", unsafe { (self.api.mem_free)(ptr) })
    }

    /// Properties of device memory on `ordinal`, exportable as a POSIX file
    /// descriptor when `shareable`.
    fn device_memory_prop(ordinal: i32, shareable: bool) -> CUmemAllocationProp {
        CUmemAllocationProp {
            allocation_type: CU_MEM_ALLOCATION_TYPE_PINNED,
            requested_handle_types: if shareable {
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            } else {
                CU_MEM_HANDLE_TYPE_NONE
            },
            location: CUmemLocation {
                location_type: CU_MEM_LOCATION_TYPE_DEVICE,
                id: ordinal,
            },
            win32_handle_meta_data: std::ptr::null_mut(),
            alloc_flags: CUmemAllocationPropFlags::default(),
        }
    }

    pub(crate) fn mem_get_allocation_granularity(&self, ordinal: i32) -> CuResult<u64> {
        let prop = CudaDriver::device_memory_prop(ordinal, false);
        let mut granularity = 0usize;
        // SAFETY: `granularity` is a valid out-pointer and `prop` a valid,
        // fully initialised CUmemAllocationProp for the call's duration.
        check("cuMemGetAllocationGranularity", unsafe {
            (self.api.mem_get_allocation_granularity)(
                &mut granularity,
                &prop,
                CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        })?;
        Ok(granularity as u64)
    }

    pub(crate) fn mem_address_reserve(&self, size: usize) -> CuResult<CUdeviceptr> {
        let mut ptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; alignment 0 asks for the
        // default, address 0 for no placement hint, flags must be 0.
        check("cuMemAddressReserve", unsafe {
            (self.api.mem_address_reserve)(&mut ptr, size, 0, 0, 0)
        })?;
        Ok(ptr)
    }

    pub(crate) fn mem_address_free(&self, ptr: CUdeviceptr, size: usize) -> CuResult<()> {
        // SAFETY: plain integer arguments; the driver validates the range.
        check("cuMemAddressFree", unsafe {
            (self.api.mem_address_free)(ptr, size)
        })
    }

    pub(crate) fn mem_create(
        &self,
        size: usize,
        ordinal: i32,
        shareable: bool,
    ) -> CuResult<CUmemGenericAllocationHandle> {
        let prop = CudaDriver::device_memory_prop(ordinal, shareable);
        let mut handle = 0;
        // SAFETY: `handle` is a valid out-pointer and `prop` a valid, fully
        // initialised CUmemAllocationProp for the call's duration; flags 0.
        check("cuMemCreate", unsafe {
            (self.api.mem_create)(&mut handle, size, &prop, 0)
        })?;
        Ok(handle)
    }

    /// A file descriptor for `handle`'s memory (made with `shareable`), owned
    /// by the caller: another process imports it.
    pub(crate) fn mem_export_fd(&self, handle: CUmemGenericAllocationHandle) -> CuResult<OwnedFd> {
        let mut fd: c_int = -1;
        // SAFETY: for CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR the driver
        // writes one int through the pointer, and `fd` is a valid int; the
        // handle is an integer the driver validates; flags must be 0.
        check("cuMemExportToShareableHandle", unsafe {
            (self.api.mem_export_to_shareable_handle)(
                (&mut fd as *mut c_int).cast(),
                handle,
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        if fd < 0 {
            return Err(CuError {
                function: "cuMemExportToShareableHandle",
                code: CUDA_ERROR_UNKNOWN,
            });
        }
        // SAFETY: the driver just made this descriptor for us; nothing else
        // owns it, so OwnedFd closing it once is right.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Imports the memory behind file descriptor `fd` (another process's
    /// export); `fd` stays the caller's to close.
    pub(crate) fn mem_import_fd(&self, fd: c_int) -> CuResult<CUmemGenericAllocationHandle> {
        let mut handle = 0;
        // SAFETY: for CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR the driver
        // takes the descriptor itself as the pointer-sized argument (cuda.h:
        // "(void*)(uintptr_t)fd"), never dereferenced; `handle` is a valid
        // out-pointer. An fd that is not an export is the driver's to refuse.
        check("cuMemImportFromShareableHandle", unsafe {
            (self.api.mem_import_from_shareable_handle)(
                &mut handle,
                fd as isize as *mut c_void,
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        Ok(handle)
    }

    /// The IPC handle of the `cuMemAlloc` allocation starting at `ptr`.
    pub(crate) fn ipc_get_mem_handle(&self, ptr: CUdeviceptr) -> CuResult<CUipcMemHandle> {
        let mut handle = CUipcMemHandle {
            reserved: [0; CU_IPC_HANDLE_SIZE],
        };
        // SAFETY: `handle` is a valid, writable CUipcMemHandle; the address
        // is an integer the driver validates.
        check("cuIpcGetMemHandle", unsafe {
            (self.api.ipc_get_mem_handle)(&mut handle, ptr)
        })?;
        Ok(handle)
    }

    /// Maps another process's allocation named by `handle` into this one.
    pub(crate) fn ipc_open_mem_handle(&self, handle: CUipcMemHandle) -> CuResult<CUdeviceptr> {
        let mut ptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the handle is passed by
        // value as cuda.h declares it, and its bytes (possibly from another
        // process, possibly garbage) are the driver's to validate.
        check("cuIpcOpenMemHandle_v2", unsafe {
            (self.api.ipc_open_mem_handle)(&mut ptr, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        })?;
        Ok(ptr)
    }

    /// Unmaps what `ipc_open_mem_handle` mapped at `ptr`.
    pub(crate) fn ipc_close_mem_handle(&self, ptr: CUdeviceptr) -> CuResult<()> {
        // SAFETY: a plain integer the driver validates.
        check("cuIpcCloseMemHandle", unsafe {
            (self.api.ipc_close_mem_handle)(ptr)
        })
    }

    pub(crate) fn mem_release(&self, handle: CUmemGenericAllocationHandle) -> CuResult<()> {
        // SAFETY: the handle is an integer the driver validates.
        check("cuMemRelease", unsafe { (self.api.mem_release)(handle) })
    }

    pub(crate) fn mem_map(
        &self,
        ptr: CUdeviceptr,
        size: usize,
        handle: CUmemGenericAllocationHandle,
        offset: usize,
    ) -> CuResult<()> {
        // SAFETY: plain integer arguments the driver validates; flags 0.
        check("cuMemMap", unsafe {
            (self.api.mem_map)(ptr, size, offset, handle, 0)
        })
    }

    pub(crate) fn mem_unmap(&self, ptr: CUdeviceptr, size: usize) -> CuResult<()> {
        // SAFETY: plain integer arguments the driver validates.
        check("cuMemUnmap", unsafe { (self.api.mem_unmap)(ptr, size) })
    }

    /// Grants read-write access to `[ptr, ptr + size)` to each device in
    /// `ordinals`, in one call.
    pub(crate) fn mem_set_access(
        &self,
        ptr: CUdeviceptr,
        size: usize,
        ordinals: &[i32],
    ) -> CuResult<()> {
        let descs: Vec<CUmemAccessDesc> = ordinals
            .iter()
            .map(|&id| CUmemAccessDesc {
                location: CUmemLocation {
                    location_type: CU_MEM_LOCATION_TYPE_DEVICE,
                    id,
                },
                flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            })
            .collect();
        // SAFETY: `descs` holds `descs.len()` initialised descriptors and
        // lives for the call's duration.
        check("cuMemSetAccess", unsafe {
            (self.api.mem_set_access)(ptr, size, descs.as_ptr(), descs.len())
        })
    }

    /// Sets `count` bytes of device memory from `ptr` to `value`, on the
    /// legacy default stream (ordered before a later `memcpy_dtoh`).
    pub(crate) fn memset_d8(&self, ptr: CUdeviceptr, value: u8, count: usize) -> CuResult<()> {
        // SAFETY: plain integer arguments; the driver validates the device
        // range and never touches host memory.
        check("cuMemsetD8_v2", unsafe {
            (self.api.memset_d8)(ptr, value, count)
        })
    }

    /// Copies `out.len()` bytes of device memory from `ptr` into `out`
    /// (synchronous: the bytes are there when it returns).
    pub(crate) fn memcpy_dtoh(&self, out: &mut [u8], ptr: CUdeviceptr) -> CuResult<()> {
        // SAFETY: `out` is valid for writing `out.len()` bytes for the
        // call's duration, and the copy completes before the call returns.
        check("cuMemcpyDtoH_v2", unsafe {
            (self.api.memcpy_dtoh)(out.as_mut_ptr().cast(), ptr, out.len())
        })
    }

    /// Sets the calling thread's stream-capture interaction mode to `mode`
    /// and returns the mode it had (`cuThreadExchangeStreamCaptureMode`,
    /// CUDA 10.1 and later). The mode is per thread: it says which capture
    /// sequences forbid this thread's "potentially unsafe" calls
    /// (`cuMemAlloc` among them).
    pub(crate) fn thread_exchange_stream_capture_mode(
        &self,
        mode: CUstreamCaptureMode,
    ) -> CuResult<CUstreamCaptureMode> {
        let mut exchanged = mode;
        // SAFETY: `exchanged` is a valid, initialised in-out pointer for the
        // call's duration; the driver reads the new mode from it and writes
        // the old one back.
        check("cuThreadExchangeStreamCaptureMode", unsafe {
            (self.api.thread_exchange_stream_capture_mode)(&mut exchanged)
        })?;
        Ok(exchanged)
    }

    pub(crate) fn event_create(&self) -> CuResult<CuEvent> {
        let mut event = std::ptr::null_mut();
        // SAFETY: `event` is a valid out-pointer for the call's duration.
        check("cuEventCreate", unsafe {
            (self.api.event_create)(&mut event, CU_EVENT_DISABLE_TIMING)
        })?;
        Ok(CuEvent(event))
    }

    /// Records `event` on the stream whose raw `CUstream` value is `stream`
    /// (0 = legacy default stream).
    pub(crate) fn event_record(&self, event: CuEvent, stream: u64) -> CuResult<()> {
        // SAFETY: `event` was created by this driver and is not destroyed
        // (CudaDevice owns it); `stream` is the caller's CUstream value,
        // which the driver validates (0 and the per-thread value 2 are
        // special handles, not pointers).
        check("cuEventRecord", unsafe {
            (self.api.event_record)(event.0, stream as usize as CUstream)
        })
    }

    /// `Ok(true)` when complete, `Ok(false)` on `CUDA_ERROR_NOT_READY`.
    pub(crate) fn event_query(&self, event: CuEvent) -> CuResult<bool> {
        // SAFETY: `event` was created by this driver and is not destroyed.
        let code = unsafe { (self.api.event_query)(event.0) };
        if code == CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check("cuEventQuery", code).map(|()| true)
    }

    pub(crate) fn event_synchronize(&self, event: CuEvent) -> CuResult<()> {
        // SAFETY: `event` was created by this driver and is not destroyed.
        check("cuEventSynchronize", unsafe {
            (self.api.event_synchronize)(event.0)
        })
    }

    pub(crate) fn event_destroy(&self, event: CuEvent) -> CuResult<()> {
        // SAFETY: `event` was created by this driver; CudaDevice destroys
        // each event once, when it drops.
        check("cuEventDestroy_v2", unsafe {
            (self.api.event_destroy)(event.0)
        })
    }
}

/// A duplicate, in this process, of descriptor `fd` of process `pid`
/// (`pidfd_open` + `pidfd_getfd`, Linux 5.6): how PyTorch's expandable
/// segments pass exported memory between processes. Needs the right to
/// ptrace `pid` (same user; under Yama's `ptrace_scope` 1, an ancestor).
pub fn fd_from_process(pid: i32, fd: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags (0) and returns a new
    // descriptor or -1; no memory is passed.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the descriptor was just returned to us and is owned by no one
    // else; OwnedFd closes it on every path below.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
    // SAFETY: pidfd_getfd takes a pidfd, a descriptor number in that
    // process and flags (0); it returns a new descriptor or -1.
    let mine = unsafe {
        libc::syscall(
            libc::SYS_pidfd_getfd,
            std::os::fd::AsRawFd::as_raw_fd(&pidfd),
            fd,
            0,
        )
    };
    if mine < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor of this process, owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(mine as i32) })
}

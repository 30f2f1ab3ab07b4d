//! C types and constants of the CUDA driver API, declared by hand: the one
//! declaration `CudaDevice` and `cuda-driver-double` both use.
//!
//! Only what they use. Layouts match `cuda.h` (CUDA 11.x to 12.x, 64-bit
//! platforms); the unit tests pin sizes and offsets against it, so a layout
//! mistake fails there rather than being shared unseen.

use std::ffi::{c_int, c_uint, c_ulonglong, c_void, CStr};

/// `CUresult`: a driver status code.
pub type CUresult = c_int;
/// `CUdevice`: a device handle (an ordinal on every driver so far).
pub type CUdevice = c_int;
/// `CUdeviceptr`: a device address (`unsigned long long` on 64-bit hosts).
pub type CUdeviceptr = c_ulonglong;
/// `CUmemGenericAllocationHandle`.
pub type CUmemGenericAllocationHandle = c_ulonglong;
/// `CUcontext`: an opaque pointer.
pub type CUcontext = *mut c_void;
/// `CUevent`: an opaque pointer.
pub type CUevent = *mut c_void;
/// `CUstream`: an opaque pointer.
pub type CUstream = *mut c_void;

/// `CUstreamCaptureMode`: how a thread's "potentially unsafe" driver calls
/// interact with stream captures (a C enum).
pub type CUstreamCaptureMode = c_uint;

/// `CUmemLocation`.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub struct CUmemLocation {
    /// `CUmemLocationType`.
    pub location_type: c_uint,
    /// The device ordinal when `location_type` is a device.
    pub id: c_int,
}

/// The anonymous `allocFlags` struct inside `CUmemAllocationProp`.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub struct CUmemAllocationPropFlags {
    /// `CUmemAllocationCompType`.
    pub compression_type: u8,
    /// Non-zero to ask for GPUDirect RDMA capable memory.
    pub gpu_direct_rdma_capable: u8,
    /// `CUmemCreateUsage` bits.
    pub usage: u16,
    /// Must be zero.
    pub reserved: [u8; 4],
}

/// `CUmemAllocationProp`.
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct CUmemAllocationProp {
    /// `CUmemAllocationType`.
    pub allocation_type: c_uint,
    /// `CUmemAllocationHandleType` bits (none: not shareable).
    pub requested_handle_types: c_uint,
    /// Where the memory lives.
    pub location: CUmemLocation,
    /// Windows IPC metadata; null.
    pub win32_handle_meta_data: *mut c_void,
    /// Compression, RDMA and usage flags.
    pub alloc_flags: CUmemAllocationPropFlags,
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub struct CUmemAccessDesc {
    /// Who gets access.
    pub location: CUmemLocation,
    /// `CUmemAccess_flags`.
    pub flags: c_uint,
}

/// `CU_IPC_HANDLE_SIZE`: bytes in a `CUipcMemHandle`.
pub const CU_IPC_HANDLE_SIZE: usize = 64;

/// `CUipcMemHandle`: an opaque handle another process opens with
/// `cuIpcOpenMemHandle` (the same bytes as the runtime's `cudaIpcMemHandle_t`).
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CUipcMemHandle {
    /// The driver's bytes.
    pub reserved: [u8; CU_IPC_HANDLE_SIZE],
}

/// `CUDA_SUCCESS`.
pub const CUDA_SUCCESS: CUresult = 0;
/// `CUDA_ERROR_INVALID_VALUE`.
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
/// `CUDA_ERROR_NOT_INITIALIZED`.
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
/// `CUDA_ERROR_NO_DEVICE`.
pub const CUDA_ERROR_NO_DEVICE: CUresult = 100;
/// `CUDA_ERROR_INVALID_DEVICE`.
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
/// `CUDA_ERROR_INVALID_CONTEXT`.
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
/// `CUDA_ERROR_INVALID_HANDLE`.
pub const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
/// `CUDA_ERROR_NOT_READY`: an event or stream query whose work is pending.
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
/// `CUDA_ERROR_ILLEGAL_ADDRESS`.
pub const CUDA_ERROR_ILLEGAL_ADDRESS: CUresult = 700;
/// `CUDA_ERROR_NOT_SUPPORTED`.
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
/// `CUDA_ERROR_UNKNOWN`.
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

/// `CU_MEM_ALLOCATION_TYPE_PINNED`.
pub const CU_MEM_ALLOCATION_TYPE_PINNED: c_uint = 0x1;
/// `CU_MEM_HANDLE_TYPE_NONE`.
pub const CU_MEM_HANDLE_TYPE_NONE: c_uint = 0x0;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: physical memory exportable as
/// a file descriptor (what PyTorch's expandable segments request and share).
pub const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_uint = 0x1;
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`: the flag PyTorch opens IPC handles with.
pub const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 0x1;
/// `CU_MEM_LOCATION_TYPE_DEVICE`.
pub const CU_MEM_LOCATION_TYPE_DEVICE: c_uint = 0x1;
/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
pub const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_uint = 0x3;
/// `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED` (what PyTorch's expandable
/// segments use).
pub const CU_MEM_ALLOC_GRANULARITY_RECOMMENDED: c_uint = 0x1;
/// `CU_EVENT_DISABLE_TIMING`: cheaper events, enough for ordering.
pub const CU_EVENT_DISABLE_TIMING: c_uint = 0x2;

/// `CU_STREAM_CAPTURE_MODE_GLOBAL`: every thread's mode until it changes it.
pub const CU_STREAM_CAPTURE_MODE_GLOBAL: CUstreamCaptureMode = 0;
/// `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`.
pub const CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: CUstreamCaptureMode = 1;
/// `CU_STREAM_CAPTURE_MODE_RELAXED`: the thread's potentially unsafe calls
/// are never refused for a capture (what PyTorch's allocator switches to
/// around `cudaMalloc`). The others are `CU_STREAM_CAPTURE_MODE_GLOBAL` (0,
/// every thread's default: refused while this thread runs a capture, or
/// another thread runs one begun in global mode) and
/// `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL` (1: refused only while this thread
/// runs one). Captures begun in relaxed mode refuse nothing.
pub const CU_STREAM_CAPTURE_MODE_RELAXED: CUstreamCaptureMode = 2;

/// Names of the status codes most likely to reach us: what the double's
/// `cuGetErrorName` answers, and what `CudaDevice` says when the driver's
/// `cuGetErrorName` itself fails.
pub const KNOWN_ERROR_NAMES: &[(CUresult, &CStr)] = &[
    (0, c"CUDA_SUCCESS"),
    (1, c"CUDA_ERROR_INVALID_VALUE"),
    (2, c"CUDA_ERROR_OUT_OF_MEMORY"),
    (3, c"CUDA_ERROR_NOT_INITIALIZED"),
    (4, c"CUDA_ERROR_DEINITIALIZED"),
    (34, c"CUDA_ERROR_STUB_LIBRARY"),
    (100, c"CUDA_ERROR_NO_DEVICE"),
    (101, c"CUDA_ERROR_INVALID_DEVICE"),
    (201, c"CUDA_ERROR_INVALID_CONTEXT"),
    (208, c"CUDA_ERROR_ALREADY_MAPPED"),
    (211, c"CUDA_ERROR_NOT_MAPPED"),
    (217, c"CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"),
    (400, c"CUDA_ERROR_INVALID_HANDLE"),
    (500, c"CUDA_ERROR_NOT_FOUND"),
    (600, c"CUDA_ERROR_NOT_READY"),
    (700, c"CUDA_ERROR_ILLEGAL_ADDRESS"),
    (801, c"CUDA_ERROR_NOT_SUPPORTED"),
    (900, c"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"),
    (901, c"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"),
    (999, c"CUDA_ERROR_UNKNOWN"),
];

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn layouts_match_cuda_h() {
        assert_eq!(size_of::<CUmemLocation>(), 8);
        assert_eq!(size_of::<CUmemAccessDesc>(), 12);
        assert_eq!(offset_of!(CUmemAccessDesc, flags), 8);
        assert_eq!(size_of::<CUmemAllocationPropFlags>(), 8);
        assert_eq!(size_of::<CUmemAllocationProp>(), 32);
        assert_eq!(offset_of!(CUmemAllocationProp, requested_handle_types), 4);
        assert_eq!(offset_of!(CUmemAllocationProp, location), 8);
        assert_eq!(offset_of!(CUmemAllocationProp, win32_handle_meta_data), 16);
        assert_eq!(offset_of!(CUmemAllocationProp, alloc_flags), 24);
        assert_eq!(size_of::<CUipcMemHandle>(), 64);
    }

    #[test]
    fn error_names_are_unique() {
        for (i, (code, _)) in KNOWN_ERROR_NAMES.iter().enumerate() {
            assert!(KNOWN_ERROR_NAMES[i + 1..].iter().all(|(c, _)| c != code));
        }
    }
}

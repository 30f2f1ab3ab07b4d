//! `hbmalloc-cuda`: the CUDA backend of hbmalloc.
//!
//! [`CudaDevice`] implements [`hbmalloc::Device`] over the CUDA driver API.
//! The driver library is loaded at run time by [`CudaDriver`], so building
//! and testing this crate never needs CUDA; on a machine without a driver,
//! loading fails with [`hbmalloc::DeviceErrorKind::NoDriver`] and a message
//! saying what was tried.
//!
//! ```no_run
//! use hbmalloc::Device;
//! use hbmalloc_cuda::{CudaDevice, CudaDriver};
//!
//! let driver = CudaDriver::load()?;
//! let device = CudaDevice::new(driver, 0)?;
//! let ptr = device.segment_alloc(1 << 20)?;
//! device.segment_free(ptr, 1 << 20)?;
//! # Ok::<(), hbmalloc::DeviceError>(())
//! ```
//!
//! A CUDA graph capture may be underway in any thread while a `CudaDevice`
//! allocates: the calls that make memory (`segment_alloc`,
//! `address_reserve`, `physical_create`, `map`, `set_access`) switch the
//! calling thread to relaxed stream-capture mode for their driver call
//! (`cuThreadExchangeStreamCaptureMode`, restored afterwards), so the driver
//! neither refuses them nor invalidates the capture. Frees, unmaps, releases,
//! synchronizations and opening a device must wait until no capture is
//! underway.
//!
//! Tests run against `cuda-driver-double`, a stand-in for `libcuda` built
//! from this workspace; `cargo run -p hbmalloc-cuda --example driver_check`
//! runs [`exercise::exercise_device`] and [`byte_check::byte_program`] on a
//! real GPU.

#[cfg(feature = "harness")]
pub mod byte_check;
mod device;
mod driver;
#[cfg(feature = "harness")]
pub mod exercise;
pub mod ffi;
mod ipc;
mod pool;

pub use device::CudaDevice;
pub use driver::{
    fd_from_process, CudaDriver, DEFAULT_DRIVER_NAMES, DRIVER_PATH_ENV, DRIVER_SYMBOLS,
};
pub use ipc::{ImportedRange, IpcExport};
pub use pool::{CaptureGuard, CudaPool, DeviceBuffer, GraphPool};

use hbmalloc::CallKind;

/// The [`CallKind`] carried by errors from loading the driver and opening a
/// device (`cuInit`, `cuDeviceGet`, `cuDevicePrimaryCtxRetain`, ...); the
/// error's `detail` names the actual driver function.
pub const SETUP_CALL_KIND: CallKind = CallKind::Setup;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_device_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<CudaDevice>();
        assert_send_sync::<CudaDriver>();
    }

    #[test]
    fn every_symbol_is_listed_once() {
        assert_eq!(DRIVER_SYMBOLS.len(), 36);
        for (i, name) in DRIVER_SYMBOLS.iter().enumerate() {
            assert!(!DRIVER_SYMBOLS[i + 1..].contains(name), "{name} twice");
        }
    }
}

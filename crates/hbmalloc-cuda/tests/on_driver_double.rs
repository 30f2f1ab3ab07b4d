//! `CudaDevice` against `cuda-driver-double`, the host-memory stand-in for
//! libcuda: every code path of the backend, with no GPU and no CUDA.

mod support;

use std::sync::Arc;

use hbmalloc::{
    CallKind, Device, DeviceErrorKind, DeviceResult, PhysicalHandle, SimConfig, SimDevice, StreamId,
};
use hbmalloc_cuda::exercise::exercise_device;
use hbmalloc_cuda::{CudaDevice, CudaDriver, DRIVER_PATH_ENV, SETUP_CALL_KIND};
use support::{double_path, exclusive};

const MIB: u64 = 1 << 20;
const GRANULE: u64 = 2 * MIB;
const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;
const CUDA_ERROR_NOT_SUPPORTED: i32 = 801;
/// Injected where a test needs an error no natural path produces.
const CUDA_ERROR_ILLEGAL_ADDRESS: i32 = 700;
/// `CUstreamCaptureMode` values.
const CAPTURE_MODE_GLOBAL: u32 = 0;
const CAPTURE_MODE_THREAD_LOCAL: u32 = 1;
const CAPTURE_MODE_RELAXED: u32 = 2;
const EXCHANGE_CAPTURE_MODE: &str = "cuThreadExchangeStreamCaptureMode";
/// The driver calls that make memory: `CudaDevice` runs each in relaxed
/// stream-capture mode, so a CUDA graph capture allows them.
const MEMORY_MAKING_SYMBOLS: [&str; 5] = [
    "cuMemAlloc_v2",
    "cuMemAddressReserve",
    "cuMemCreate",
    "cuMemMap",
    "cuMemSetAccess",
];
/// Calls that must not happen during a capture at all: never switched.
const OTHER_RUNTIME_SYMBOLS: [&str; 10] = [
    "cuMemFree_v2",
    "cuMemUnmap",
    "cuMemRelease",
    "cuMemAddressFree",
    "cuMemGetInfo_v2",
    "cuCtxSynchronize",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
];

fn driver() -> Arc<CudaDriver> {
    CudaDriver::load_from(double_path()).expect("the double loads as a driver")
}

fn open(ordinal: i32) -> CudaDevice {
    CudaDevice::new(driver(), ordinal).expect("the double has devices 0 and 1")
}

fn driver_error(name: &str) -> DeviceErrorKind {
    DeviceErrorKind::Driver(name.to_string())
}

#[test]
fn loading_a_nonexistent_path_is_no_driver_with_a_clear_message() {
    let _serial = exclusive();
    let err = CudaDriver::load_from("/nonexistent/libcuda.so.1").unwrap_err();
    assert_eq!(err.kind, DeviceErrorKind::NoDriver);
    assert!(
        err.detail.contains("/nonexistent/libcuda.so.1") && err.detail.contains("cannot load"),
        "{}",
        err.detail
    );
    assert!(err.to_string().contains("no driver present"), "{err}");
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn loading_a_library_without_the_driver_symbols_is_no_driver() {
    let _serial = exclusive();
    // The C library loads but is no CUDA driver.
    let err = CudaDriver::load_from("libc.so.6").unwrap_err();
    assert_eq!(err.kind, DeviceErrorKind::NoDriver);
    assert!(err.detail.contains("lacks symbol cuInit"), "{}", err.detail);
}

#[test]
fn load_follows_the_driver_path_env_var() {
    let _serial = exclusive();
    std::env::set_var(DRIVER_PATH_ENV, double_path());
    let driver = CudaDriver::load().expect("loads the double named by the env var");
    assert_eq!(driver.path(), double_path().display().to_string());
    assert_eq!(driver.device_count(), Ok(2));
    std::env::set_var(DRIVER_PATH_ENV, "/nonexistent/driver.so");
    let err = CudaDriver::load().unwrap_err();
    assert_eq!(err.kind, DeviceErrorKind::NoDriver);
    assert!(
        err.detail.contains("/nonexistent/driver.so"),
        "{}",
        err.detail
    );
    std::env::remove_var(DRIVER_PATH_ENV);
}

#[test]
fn segment_round_trip_through_real_bytes() {
    let (_serial, double) = exclusive();
    let dev = open(0);
    let size = 3 * MIB + 123;
    let ptr = dev.segment_alloc(size).unwrap();
    assert_ne!(ptr, 0);
    assert_eq!(ptr % 256, 0);
    assert_eq!(double.live_bytes(), size);
    let bytes = ptr as usize as *mut u8;
    for i in 0..size as usize {
        // SAFETY: the double backs segments with host memory of `size`
        // bytes at `ptr`, live until the segment_free below.
        unsafe { bytes.add(i).write((i % 251) as u8) };
    }
    for i in (0..size as usize).step_by(4099) {
        // SAFETY: as above.
        assert_eq!(unsafe { bytes.add(i).read() }, (i % 251) as u8);
    }
    dev.segment_free(ptr, size).unwrap();
    assert_eq!(double.live_bytes(), 0);
    let err = dev.segment_free(ptr, size).unwrap_err();
    assert_eq!(err.call, CallKind::SegmentFree);
    assert_eq!(err.kind, driver_error("CUDA_ERROR_INVALID_VALUE"));
    assert_eq!(double.call_count("cuMemAlloc_v2"), 1);
    assert_eq!(double.call_count("cuMemFree_v2"), 2);
}

#[test]
fn granularity_is_the_drivers_2_mib() {
    let (_serial, double) = exclusive();
    assert_eq!(open(0).granularity(), Some(GRANULE));
    assert_eq!(double.call_count("cuMemGetAllocationGranularity"), 1);
}

#[test]
fn vmm_reserve_create_map_set_access_unmap_release() {
    let (_serial, double) = exclusive();
    let dev = open(0);
    assert_eq!(dev.access_ordinals(), &[0, 1], "device 1 is a peer");
    let base = dev.address_reserve(8 * GRANULE).unwrap();
    assert_eq!(base % GRANULE, 0);
    let a = dev.physical_create(2 * GRANULE).unwrap();
    let b = dev.physical_create(GRANULE).unwrap();
    assert_eq!(double.live_bytes(), 3 * GRANULE);

    dev.map(base, 2 * GRANULE, a, 0).unwrap();
    dev.set_access(base, 2 * GRANULE).unwrap();
    assert_eq!(double.access_mask(base), 0b11, "itself and its peer");
    let invalid = driver_error("CUDA_ERROR_INVALID_VALUE");
    // Overlap, outside the reservation, partial unmap, busy release/free.
    assert_eq!(
        dev.map(base + GRANULE, GRANULE, b, 0).unwrap_err().kind,
        invalid
    );
    assert_eq!(
        dev.map(base + 8 * GRANULE, GRANULE, b, 0).unwrap_err().kind,
        invalid
    );
    assert_eq!(dev.set_access(base, 3 * GRANULE).unwrap_err().kind, invalid);
    dev.map(base + 2 * GRANULE, GRANULE, b, 0).unwrap();
    dev.set_access(base, 3 * GRANULE).unwrap();
    assert_eq!(dev.unmap(base, GRANULE).unwrap_err().kind, invalid);
    let busy = dev.physical_release(a).unwrap_err();
    assert_eq!(
        (busy.call, busy.kind),
        (CallKind::PhysicalRelease, invalid.clone())
    );
    let busy = dev.address_free(base, 8 * GRANULE).unwrap_err();
    assert_eq!(
        (busy.call, busy.kind),
        (CallKind::AddressFree, invalid.clone())
    );

    dev.unmap(base, 2 * GRANULE).unwrap();
    dev.unmap(base + 2 * GRANULE, GRANULE).unwrap();
    assert_eq!(double.access_mask(base), 0);
    dev.physical_release(a).unwrap();
    dev.physical_release(b).unwrap();
    dev.address_free(base, 8 * GRANULE).unwrap();
    assert_eq!(double.live_bytes(), 0);
    let gone = dev.physical_release(PhysicalHandle(a.0)).unwrap_err();
    assert_eq!(gone.kind, driver_error("CUDA_ERROR_INVALID_HANDLE"));
    // Three here, one by the probe when the device opened.
    assert_eq!(double.call_count("cuMemSetAccess"), 4);
}

/// The double's memory behaves as the driver's: a handle mapped at two
/// addresses (whole, and its second granule on its own) shows the same
/// bytes at both, and memory mapped without access is refused.
#[test]
fn mappings_of_one_handle_reach_the_same_bytes() {
    let (_serial, double) = exclusive();
    let dev = open(0);
    let base = dev.address_reserve(4 * GRANULE).unwrap();
    let handle = dev.physical_create(2 * GRANULE).unwrap();
    let part = base + 3 * GRANULE;
    dev.map(base, 2 * GRANULE, handle, 0).unwrap();
    dev.map(part, GRANULE, handle, GRANULE).unwrap();
    let illegal_address = 700;
    assert_eq!(double.fill(part, 1, 16), illegal_address, "no access yet");
    dev.set_access(base, 2 * GRANULE).unwrap();
    dev.set_access(part, GRANULE).unwrap();

    assert_eq!(double.fill(base, 0, 2 * GRANULE as usize), 0);
    assert_eq!(double.fill(part + 8, 0x5A, 8), 0);
    let second = double.read(base + GRANULE, 24).unwrap();
    assert_eq!(second, [[0; 8], [0x5A; 8], [0; 8]].concat());
    assert_eq!(double.read(base, 24).unwrap(), vec![0; 24]);
    // A range that runs past the mapping is refused whole.
    let invalid_value = 1;
    assert_eq!(double.read(part, GRANULE as usize + 1), Err(invalid_value));

    dev.unmap(part, GRANULE).unwrap();
    dev.unmap(base, 2 * GRANULE).unwrap();
    dev.physical_release(handle).unwrap();
    dev.address_free(base, 4 * GRANULE).unwrap();
    assert_eq!(double.live_bytes(), 0);
}

#[test]
fn events_are_not_ready_then_ready_and_pooled() {
    let (_serial, double) = exclusive();
    double.set_events_complete(false);
    let dev = open(0);
    let first = dev.record_event(StreamId(0)).unwrap();
    assert_eq!(dev.query_event(first), Ok(false));
    assert_eq!(dev.query_event(first), Ok(false));
    double.complete_all_events();
    assert_eq!(dev.query_event(first), Ok(true));
    let retired = dev.query_event(first).unwrap_err();
    assert_eq!(retired.call, CallKind::EventQuery);
    assert_eq!(dev.pooled_events(), 1);

    // The completed CUevent is reused: no second cuEventCreate.
    let second = dev.record_event(StreamId(0x7f00_1234)).unwrap();
    assert_ne!(second, first);
    assert_eq!(double.call_count("cuEventCreate"), 1);
    assert_eq!(dev.query_event(second), Ok(false));
    dev.synchronize_event(second).unwrap();
    assert_eq!(dev.pooled_events(), 1);
    assert_eq!(
        dev.synchronize_event(second).unwrap_err().call,
        CallKind::EventSynchronize
    );

    // Device synchronization completes pending events.
    let third = dev.record_event(StreamId(0)).unwrap();
    let fourth = dev.record_event(StreamId(0)).unwrap();
    assert_eq!(double.call_count("cuEventCreate"), 2);
    dev.synchronize_device().unwrap();
    assert_eq!(dev.query_event(third), Ok(true));
    assert_eq!(dev.query_event(fourth), Ok(true));
    assert_eq!(double.live_events(), 2);
    let _pending = dev.record_event(StreamId(0)).unwrap();
    drop(dev);
    assert_eq!(
        double.live_events(),
        0,
        "drop destroys pooled and pending events"
    );
    assert_eq!(
        double.primary_context_retains(0),
        0,
        "drop releases the context"
    );
}

#[test]
fn memory_info_follows_allocations_per_device() {
    let (_serial, double) = exclusive();
    double.set_capacity(256 * MIB);
    let zero = open(0);
    let one = open(1);
    assert_eq!(zero.total_bytes(), 256 * MIB);
    assert!(zero.name().contains("device 0"), "{}", zero.name());
    let ptr = zero.segment_alloc(64 * MIB).unwrap();
    let info = zero.memory_info().unwrap();
    assert_eq!((info.free_bytes, info.total_bytes), (192 * MIB, 256 * MIB));
    // Switching contexts: device 1's call runs in device 1's context.
    assert_eq!(one.memory_info().unwrap().free_bytes, 256 * MIB);
    assert_eq!(zero.memory_info().unwrap().free_bytes, 192 * MIB);
    zero.segment_free(ptr, 64 * MIB).unwrap();
    assert_eq!(zero.memory_info().unwrap().free_bytes, 256 * MIB);
}

#[test]
fn out_of_memory_maps_to_out_of_memory() {
    let (_serial, double) = exclusive();
    double.set_capacity(8 * MIB);
    let dev = open(0);
    let err = dev.segment_alloc(16 * MIB).unwrap_err();
    assert_eq!(err.call, CallKind::SegmentAlloc);
    assert!(err.is_out_of_memory(), "{err}");
    assert!(err.detail.contains("cuMemAlloc_v2"), "{}", err.detail);
    let err = dev.physical_create(5 * GRANULE).unwrap_err();
    assert_eq!(err.call, CallKind::PhysicalCreate);
    assert!(err.is_out_of_memory(), "{err}");
    // An injected CUDA_ERROR_OUT_OF_MEMORY is out-of-memory too.
    double.fail_nth("cuMemAddressReserve", 1, CUDA_ERROR_OUT_OF_MEMORY);
    assert!(dev.address_reserve(GRANULE).unwrap_err().is_out_of_memory());
}

/// One driver call the device makes while running, and how to reach it:
/// `run` does any setup, calls `arm` (which arms the fault), then the call.
struct RuntimeCase {
    symbol: &'static str,
    call: CallKind,
    run: fn(&CudaDevice, &dyn Fn()) -> DeviceResult<()>,
}

fn runtime_cases() -> Vec<RuntimeCase> {
    fn mapped(dev: &CudaDevice) -> u64 {
        let base = dev.address_reserve(GRANULE).unwrap();
        let handle = dev.physical_create(GRANULE).unwrap();
        dev.map(base, GRANULE, handle, 0).unwrap();
        base
    }
    vec![
        RuntimeCase {
            symbol: "cuMemAlloc_v2",
            call: CallKind::SegmentAlloc,
            run: |dev, arm| {
                arm();
                dev.segment_alloc(MIB).map(drop)
            },
        },
        RuntimeCase {
            symbol: EXCHANGE_CAPTURE_MODE,
            call: CallKind::SegmentAlloc,
            run: |dev, arm| {
                arm();
                dev.segment_alloc(MIB).map(drop)
            },
        },
        RuntimeCase {
            symbol: "cuMemFree_v2",
            call: CallKind::SegmentFree,
            run: |dev, arm| {
                let ptr = dev.segment_alloc(MIB)?;
                arm();
                dev.segment_free(ptr, MIB)
            },
        },
        RuntimeCase {
            symbol: "cuMemGetInfo_v2",
            call: CallKind::MemoryInfo,
            run: |dev, arm| {
                arm();
                dev.memory_info().map(drop)
            },
        },
        RuntimeCase {
            symbol: "cuCtxSynchronize",
            call: CallKind::DeviceSynchronize,
            run: |dev, arm| {
                arm();
                dev.synchronize_device()
            },
        },
        RuntimeCase {
            symbol: "cuCtxGetCurrent",
            call: CallKind::SegmentAlloc,
            run: |dev, arm| {
                arm();
                dev.segment_alloc(MIB).map(drop)
            },
        },
        RuntimeCase {
            symbol: "cuCtxSetCurrent",
            call: CallKind::MemoryInfo,
            run: |dev, arm| {
                arm();
                // A fresh thread has no current context, so the device
                // must set its own.
                std::thread::scope(|s| s.spawn(|| dev.memory_info().map(drop)).join())
                    .expect("no panic")
            },
        },
        RuntimeCase {
            symbol: "cuMemAddressReserve",
            call: CallKind::AddressReserve,
            run: |dev, arm| {
                arm();
                dev.address_reserve(GRANULE).map(drop)
            },
        },
        RuntimeCase {
            symbol: "cuMemAddressFree",
            call: CallKind::AddressFree,
            run: |dev, arm| {
                let base = dev.address_reserve(GRANULE)?;
                arm();
                dev.address_free(base, GRANULE)
            },
        },
        RuntimeCase {
            symbol: "cuMemCreate",
            call: CallKind::PhysicalCreate,
            run: |dev, arm| {
                arm();
                dev.physical_create(GRANULE).map(drop)
            },
        },
        RuntimeCase {
            symbol: "cuMemRelease",
            call: CallKind::PhysicalRelease,
            run: |dev, arm| {
                let handle = dev.physical_create(GRANULE)?;
                arm();
                dev.physical_release(handle)
            },
        },
        RuntimeCase {
            symbol: "cuMemMap",
            call: CallKind::Map,
            run: |dev, arm| {
                let base = dev.address_reserve(GRANULE)?;
                let handle = dev.physical_create(GRANULE)?;
                arm();
                dev.map(base, GRANULE, handle, 0)
            },
        },
        RuntimeCase {
            symbol: "cuMemSetAccess",
            call: CallKind::SetAccess,
            run: |dev, arm| {
                let base = mapped(dev);
                arm();
                dev.set_access(base, GRANULE)
            },
        },
        RuntimeCase {
            symbol: "cuMemUnmap",
            call: CallKind::Unmap,
            run: |dev, arm| {
                let base = mapped(dev);
                arm();
                dev.unmap(base, GRANULE)
            },
        },
        RuntimeCase {
            symbol: "cuEventCreate",
            call: CallKind::EventRecord,
            run: |dev, arm| {
                arm();
                dev.record_event(StreamId(0)).map(drop)
            },
        },
        RuntimeCase {
            symbol: "cuEventRecord",
            call: CallKind::EventRecord,
            run: |dev, arm| {
                arm();
                dev.record_event(StreamId(0)).map(drop)
            },
        },
        RuntimeCase {
            symbol: "cuEventQuery",
            call: CallKind::EventQuery,
            run: |dev, arm| {
                let event = dev.record_event(StreamId(0))?;
                arm();
                dev.query_event(event).map(drop)
            },
        },
        RuntimeCase {
            symbol: "cuEventSynchronize",
            call: CallKind::EventSynchronize,
            run: |dev, arm| {
                let event = dev.record_event(StreamId(0))?;
                arm();
                dev.synchronize_event(event)
            },
        },
    ]
}

#[test]
fn an_injected_failure_of_every_runtime_driver_call_is_a_typed_error() {
    for case in runtime_cases() {
        let (_serial, double) = exclusive();
        let dev = open(0);
        let arm = || double.fail_nth(case.symbol, 1, CUDA_ERROR_ILLEGAL_ADDRESS);
        let err = (case.run)(&dev, &arm).expect_err(&format!("{} was armed to fail", case.symbol));
        assert_eq!(err.call, case.call, "{}: {err}", case.symbol);
        assert_eq!(
            err.kind,
            driver_error("CUDA_ERROR_ILLEGAL_ADDRESS"),
            "{}",
            case.symbol
        );
        assert!(
            err.detail.contains(case.symbol) && err.detail.contains("(700)"),
            "{}: {}",
            case.symbol,
            err.detail
        );
        // The device still works after the failure.
        dev.memory_info().unwrap();
    }
}

#[test]
fn an_injected_failure_of_every_setup_driver_call_is_a_typed_error_and_leaks_nothing() {
    let setup_symbols = [
        "cuInit",
        "cuDeviceGetCount",
        "cuDeviceGet",
        "cuDeviceGetName",
        "cuDeviceTotalMem_v2",
        "cuDevicePrimaryCtxRetain",
        "cuCtxGetCurrent",
        "cuCtxSetCurrent",
        "cuMemGetAllocationGranularity",
        "cuDeviceCanAccessPeer",
    ];
    for symbol in setup_symbols {
        let (_serial, double) = exclusive();
        let driver = driver();
        double.fail_nth(symbol, 1, CUDA_ERROR_ILLEGAL_ADDRESS);
        let err = CudaDevice::new(driver, 0).expect_err(symbol);
        assert_eq!(err.call, SETUP_CALL_KIND, "{symbol}");
        assert_eq!(
            err.kind,
            driver_error("CUDA_ERROR_ILLEGAL_ADDRESS"),
            "{symbol}"
        );
        assert!(err.detail.contains(symbol), "{symbol}: {}", err.detail);
        assert_eq!(
            double.primary_context_retains(0),
            0,
            "{symbol} leaked the context"
        );
    }
}

#[test]
fn teardown_and_error_name_failures_are_survived() {
    let (_serial, double) = exclusive();
    let dev = open(0);
    let event = dev.record_event(StreamId(0)).unwrap();
    dev.synchronize_event(event).unwrap();
    double.fail_nth("cuEventDestroy_v2", 1, CUDA_ERROR_ILLEGAL_ADDRESS);
    double.fail_nth(
        "cuDevicePrimaryCtxRelease_v2",
        1,
        CUDA_ERROR_ILLEGAL_ADDRESS,
    );
    drop(dev);
    assert_eq!(double.call_count("cuEventDestroy_v2"), 1);
    assert_eq!(double.call_count("cuDevicePrimaryCtxRelease_v2"), 1);

    // When cuGetErrorName itself fails, the built-in table still names it.
    double.reset();
    let dev = open(0);
    double.fail_nth("cuGetErrorName", 1, CUDA_ERROR_ILLEGAL_ADDRESS);
    double.fail_nth("cuMemAlloc_v2", 1, CUDA_ERROR_ILLEGAL_ADDRESS);
    let err = dev.segment_alloc(MIB).unwrap_err();
    assert_eq!(err.kind, driver_error("CUDA_ERROR_ILLEGAL_ADDRESS"));
    assert!(double.call_count("cuGetErrorName") >= 1);
}

#[test]
fn a_device_without_vmm_reports_unsupported() {
    let (_serial, double) = exclusive();
    let driver = driver();
    double.fail_nth("cuMemGetAllocationGranularity", 1, CUDA_ERROR_NOT_SUPPORTED);
    let dev = CudaDevice::new(driver, 0).unwrap();
    assert_eq!(dev.granularity(), None);
    let err = dev.address_reserve(GRANULE).unwrap_err();
    assert_eq!(
        (err.call, err.kind),
        (CallKind::AddressReserve, DeviceErrorKind::Unsupported)
    );
    assert_eq!(double.call_count("cuMemAddressReserve"), 0);
    // Segments still work.
    let ptr = dev.segment_alloc(MIB).unwrap();
    dev.segment_free(ptr, MIB).unwrap();
}

#[test]
fn an_ordinal_out_of_range_is_a_clear_error() {
    let (_serial, double) = exclusive();
    for ordinal in [2, -1, 1000] {
        let err = CudaDevice::new(driver(), ordinal).unwrap_err();
        assert_eq!(err.kind, driver_error("CUDA_ERROR_INVALID_DEVICE"));
        assert!(
            err.detail
                .contains(&format!("ordinal {ordinal} is out of range"))
                && err.detail.contains("2 device(s)"),
            "{}",
            err.detail
        );
    }
    assert_eq!(double.call_count("cuDevicePrimaryCtxRetain"), 0);
}

#[test]
fn no_device_from_cu_init_is_a_clear_error() {
    let (_serial, _double) = exclusive();
    let driver = driver();
    std::env::set_var("HBM_DOUBLE_NO_DEVICE", "1");
    let err = CudaDevice::new(Arc::clone(&driver), 0).unwrap_err();
    std::env::remove_var("HBM_DOUBLE_NO_DEVICE");
    assert_eq!(err.kind, driver_error("CUDA_ERROR_NO_DEVICE"));
    assert!(err.detail.contains("cuInit"), "{}", err.detail);
    assert!(err.to_string().contains("CUDA_ERROR_NO_DEVICE"), "{err}");
    // The same loaded driver works once a device is there.
    CudaDevice::new(driver, 0).unwrap();
}

#[test]
fn threads_share_one_device() {
    let (_serial, double) = exclusive();
    let dev = open(1);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..50 {
                    let ptr = dev.segment_alloc(MIB).unwrap();
                    let event = dev.record_event(StreamId(0)).unwrap();
                    dev.synchronize_event(event).unwrap();
                    dev.segment_free(ptr, MIB).unwrap();
                }
            });
        }
    });
    assert_eq!(double.live_bytes(), 0);
    assert!(double.call_count("cuEventCreate") <= 4, "events are pooled");
}

#[test]
fn the_double_behaves_like_the_simulated_device() {
    let (_serial, _double) = exclusive();
    let cuda = open(0);
    // The double's default capacity; like the double by default, a driver
    // that maps part of a handle (the simulated one's what-if).
    let sim = SimDevice::with_config(SimConfig {
        capacity_bytes: 1 << 30,
        maps_handle_parts: true,
        ..SimConfig::default()
    });
    let on_cuda = exercise_device(&cuda).expect("exercise on the double");
    let on_sim = exercise_device(&sim).expect("exercise on SimDevice");
    assert_eq!(on_cuda, on_sim);
    assert_eq!(on_cuda.failures(), Vec::<&str>::new());
    assert_eq!(on_cuda.granularity, Some(GRANULE));
    // Both counted the same calls, failed ones included.
    assert_eq!(cuda.call_counts().by_kind, sim.call_counts().by_kind);
    // Two whole maps, one refused over a mapping, one of part of a handle.
    assert_eq!(cuda.call_counts().get(CallKind::Map), 4);
    // Every kind called was timed, and no other.
    let counts = cuda.call_counts().by_kind;
    for (kind, (calls, nanos)) in CallKind::ALL
        .iter()
        .zip(counts.iter().zip(cuda.call_nanos()))
    {
        assert_eq!(*calls > 0, nanos > 0, "{kind}: {calls} calls in {nanos} ns");
    }
}

/// Whether `cuMemMap` maps part of a handle is asked of the driver when the
/// device opens (its documentation says the offset "currently must be
/// zero"), and the probe leaves nothing behind.
#[test]
fn whether_the_driver_maps_handle_parts_is_asked_not_assumed() {
    let (_serial, double) = exclusive();
    assert!(
        open(0).maps_handle_parts(),
        "the double maps parts by default"
    );
    double.set_whole_handle_maps(true);
    let cuda = open(0);
    assert!(!cuda.maps_handle_parts());
    assert_eq!(double.live_bytes(), 0, "the probe released its memory");
    assert_eq!(
        cuda.call_counts().get(CallKind::Map),
        0,
        "the probe is no Device call"
    );
    let sim = SimDevice::with_config(SimConfig {
        capacity_bytes: 1 << 30,
        maps_handle_parts: false,
        ..SimConfig::default()
    });
    let on_cuda = exercise_device(&cuda).expect("exercise on the double");
    assert_eq!(
        on_cuda,
        exercise_device(&sim).expect("exercise on SimDevice")
    );
    assert_eq!(on_cuda.failures(), Vec::<&str>::new());
}

/// A driver could take `cuMemMap`'s offset and map from the handle's start
/// anyway: every call succeeds, and stitching there would give two live
/// blocks the same memory. The probe reads the bytes back, so such a driver
/// gets whole maps only; so does one whose data calls fail.
#[test]
fn a_driver_that_ignores_the_map_offset_is_caught_by_its_data() {
    let (_serial, double) = exclusive();
    let cuda = open(0);
    assert!(cuda.maps_handle_parts());
    // Zero both granules, mark the part, read both back.
    assert_eq!(double.call_count("cuMemsetD8_v2"), 2);
    assert_eq!(double.call_count("cuMemcpyDtoH_v2"), 2);

    double.set_map_offset_ignored(true);
    let cuda = open(0);
    assert!(!cuda.maps_handle_parts());
    assert_eq!(double.live_bytes(), 0, "the probe released its memory");
    double.set_map_offset_ignored(false);

    for symbol in ["cuMemsetD8_v2", "cuMemcpyDtoH_v2", "cuMemSetAccess"] {
        double.fail_nth(symbol, 1, 999);
        assert!(!open(0).maps_handle_parts(), "{symbol} failed");
        assert_eq!(double.live_bytes(), 0, "{symbol} failed");
    }
    assert!(open(0).maps_handle_parts());
}

/// (calls, calls made in relaxed capture mode) of each symbol so far.
fn call_counts(double: &support::Double, symbols: &[&str]) -> Vec<(u64, u64)> {
    symbols
        .iter()
        .map(|s| (double.call_count(s), double.relaxed_call_count(s)))
        .collect()
}

/// Every `Device` call that reaches the driver, once, checking after each
/// that the calling thread's capture mode is `mode` again.
fn every_device_call(dev: &CudaDevice, double: &support::Double, mode: u32) {
    let check = |what: &str| assert_eq!(double.capture_mode(), mode, "after {what}");
    let ptr = dev.segment_alloc(MIB).unwrap();
    check("segment_alloc");
    dev.segment_free(ptr, MIB).unwrap();
    check("segment_free");
    let base = dev.address_reserve(2 * GRANULE).unwrap();
    check("address_reserve");
    let handle = dev.physical_create(GRANULE).unwrap();
    check("physical_create");
    dev.map(base, GRANULE, handle, 0).unwrap();
    check("map");
    dev.set_access(base, GRANULE).unwrap();
    check("set_access");
    dev.unmap(base, GRANULE).unwrap();
    check("unmap");
    dev.physical_release(handle).unwrap();
    check("physical_release");
    dev.address_free(base, 2 * GRANULE).unwrap();
    check("address_free");
    let event = dev.record_event(StreamId(0)).unwrap();
    check("record_event");
    assert_eq!(dev.query_event(event), Ok(true));
    let event = dev.record_event(StreamId(0)).unwrap();
    dev.synchronize_event(event).unwrap();
    dev.synchronize_device().unwrap();
    dev.memory_info().unwrap();
    check("the event, synchronize and memory-info calls");
}

/// During a CUDA graph capture in global mode (PyTorch's default), the
/// driver refuses `cuMemAlloc` and its kind and invalidates the capture
/// unless the calling thread is in relaxed mode. `CudaDevice` switches to
/// relaxed for exactly the calls that make memory, and gives the thread its
/// own mode back, whatever it was.
#[test]
fn calls_that_make_memory_run_in_relaxed_capture_mode_and_restore_the_mode() {
    for mode in [
        CAPTURE_MODE_GLOBAL,
        CAPTURE_MODE_THREAD_LOCAL,
        CAPTURE_MODE_RELAXED,
    ] {
        let (_serial, double) = exclusive();
        let dev = open(0);
        double.set_capture_mode(mode);
        let making = call_counts(double, &MEMORY_MAKING_SYMBOLS);
        let other = call_counts(double, &OTHER_RUNTIME_SYMBOLS);
        let exchanges = double.call_count(EXCHANGE_CAPTURE_MODE);

        every_device_call(&dev, double, mode);

        for (symbol, (before, after)) in MEMORY_MAKING_SYMBOLS.iter().zip(
            making
                .iter()
                .zip(call_counts(double, &MEMORY_MAKING_SYMBOLS)),
        ) {
            let calls = after.0 - before.0;
            assert_eq!(calls, 1, "mode {mode}: {symbol} calls");
            assert_eq!(
                after.1 - before.1,
                calls,
                "mode {mode}: {symbol} ran in relaxed mode"
            );
        }
        for (symbol, (before, after)) in OTHER_RUNTIME_SYMBOLS.iter().zip(
            other
                .iter()
                .zip(call_counts(double, &OTHER_RUNTIME_SYMBOLS)),
        ) {
            assert!(after.0 > before.0, "mode {mode}: {symbol} was called");
            // Not switched: they run in the thread's own mode.
            let relaxed = if mode == CAPTURE_MODE_RELAXED {
                after.0 - before.0
            } else {
                0
            };
            assert_eq!(after.1 - before.1, relaxed, "mode {mode}: {symbol}");
        }
        // One exchange to relaxed per call that makes memory, and one back
        // unless the thread was relaxed already.
        let per_call = if mode == CAPTURE_MODE_RELAXED { 1 } else { 2 };
        assert_eq!(
            double.call_count(EXCHANGE_CAPTURE_MODE) - exchanges,
            per_call * MEMORY_MAKING_SYMBOLS.len() as u64,
            "mode {mode}"
        );
        assert_eq!(double.capture_mode(), mode);
    }
}

/// The capture mode is per thread, in the driver and here: threads sharing
/// one device, each in its own mode, each get theirs back.
#[test]
fn each_thread_gets_its_own_capture_mode_back() {
    let (_serial, double) = exclusive();
    let dev = open(0);
    // The probe when the device opened is no `Device` call: not switched.
    let before = call_counts(double, &MEMORY_MAKING_SYMBOLS);
    std::thread::scope(|s| {
        for mode in [
            CAPTURE_MODE_GLOBAL,
            CAPTURE_MODE_THREAD_LOCAL,
            CAPTURE_MODE_RELAXED,
            CAPTURE_MODE_THREAD_LOCAL,
        ] {
            let dev = &dev;
            s.spawn(move || {
                double.set_capture_mode(mode);
                for _ in 0..20 {
                    every_device_call(dev, double, mode);
                }
            });
        }
    });
    assert_eq!(double.capture_mode(), CAPTURE_MODE_GLOBAL);
    let after = call_counts(double, &MEMORY_MAKING_SYMBOLS);
    for (symbol, (before, after)) in MEMORY_MAKING_SYMBOLS.iter().zip(before.iter().zip(after)) {
        assert_eq!(after.0 - before.0, 80, "{symbol}: 4 threads, 20 rounds");
        assert_eq!(after.1 - before.1, 80, "{symbol} ran in relaxed mode");
    }
    assert_eq!(double.live_bytes(), 0);
}

/// When the switch to relaxed mode fails, the call fails with an error
/// naming `cuThreadExchangeStreamCaptureMode`, makes nothing, and leaves
/// the thread's mode alone; the device works on afterwards.
#[test]
fn a_failed_capture_mode_switch_is_a_clear_error_and_makes_nothing() {
    let cases = runtime_cases();
    for symbol in MEMORY_MAKING_SYMBOLS {
        let case = cases
            .iter()
            .find(|c| c.symbol == symbol)
            .expect("every call that makes memory has a runtime case");
        let (_serial, double) = exclusive();
        let dev = open(0);
        double.set_capture_mode(CAPTURE_MODE_THREAD_LOCAL);
        let made = double.call_count(symbol);
        let arm = || double.fail_nth(EXCHANGE_CAPTURE_MODE, 1, CUDA_ERROR_ILLEGAL_ADDRESS);
        let live = std::cell::Cell::new(0);
        let arm_and_note = || {
            live.set(double.live_bytes());
            arm();
        };
        let err = (case.run)(&dev, &arm_and_note).expect_err(symbol);
        assert_eq!(err.call, case.call, "{symbol}: {err}");
        assert_eq!(
            err.kind,
            driver_error("CUDA_ERROR_ILLEGAL_ADDRESS"),
            "{symbol}"
        );
        assert!(
            err.detail.contains(EXCHANGE_CAPTURE_MODE)
                && err.detail.contains("relaxed stream-capture mode"),
            "{symbol}: {}",
            err.detail
        );
        assert_eq!(double.call_count(symbol), made, "{symbol} was not called");
        assert_eq!(double.live_bytes(), live.get(), "{symbol} made nothing");
        assert_eq!(double.capture_mode(), CAPTURE_MODE_THREAD_LOCAL, "{symbol}");
        // The device still works, and still switches.
        dev.physical_create(GRANULE).unwrap();
        assert_eq!(double.capture_mode(), CAPTURE_MODE_THREAD_LOCAL, "{symbol}");
    }
}

/// A failed switch back cannot undo a call that succeeded: the memory is
/// the caller's, and the thread stays relaxed (the driver then refuses none
/// of its calls during a capture), as the next successful switch shows.
#[test]
fn a_failed_switch_back_keeps_the_memory_and_leaves_the_thread_relaxed() {
    let (_serial, double) = exclusive();
    let dev = open(0);
    double.fail_nth(EXCHANGE_CAPTURE_MODE, 2, CUDA_ERROR_ILLEGAL_ADDRESS);
    let ptr = dev.segment_alloc(MIB).unwrap();
    assert_eq!(double.live_bytes(), MIB);
    assert_eq!(double.capture_mode(), CAPTURE_MODE_RELAXED);
    dev.segment_free(ptr, MIB).unwrap();
    double.set_capture_mode(CAPTURE_MODE_GLOBAL);
    dev.segment_free(dev.segment_alloc(MIB).unwrap(), MIB)
        .unwrap();
    assert_eq!(double.capture_mode(), CAPTURE_MODE_GLOBAL);
}

/// What `ipc_export` answers for segments and whole handles, of one size or
/// several; an export imported again (here, in the same process) reaches the
/// same bytes; importing leaks nothing.
#[test]
fn ipc_export_describes_the_memory_and_an_import_reaches_its_bytes() {
    use hbmalloc_cuda::IpcExport;
    use std::os::fd::BorrowedFd;
    let (_serial, double) = exclusive();
    let dev = open(0);
    let seg = dev.segment_alloc(3 * MIB).unwrap();
    match dev.ipc_export(seg + 4096, 1000).unwrap() {
        IpcExport::Segment { offset, .. } => assert_eq!(offset, 4096),
        other => panic!("a segment, not {other:?}"),
    }
    // Two whole handles of one size, mapped one after the other.
    let va = dev.address_reserve(6 * GRANULE).unwrap();
    let (a, b) = (
        dev.physical_create(GRANULE).unwrap(),
        dev.physical_create(GRANULE).unwrap(),
    );
    let c = dev.physical_create(2 * GRANULE).unwrap();
    dev.map(va, GRANULE, a, 0).unwrap();
    dev.map(va + GRANULE, GRANULE, b, 0).unwrap();
    dev.map(va + 2 * GRANULE, 2 * GRANULE, c, 0).unwrap();
    dev.set_access(va, 4 * GRANULE).unwrap();
    assert_eq!(double.fill(va + 100, 0x5a, (GRANULE + 10) as usize), 0);
    let export = dev.ipc_export(va + 100, GRANULE + 10).unwrap();
    assert_eq!(export.common_handle_size(), Some(GRANULE));
    let IpcExport::Handles { sizes, fds, offset } = export else {
        panic!("handles")
    };
    assert_eq!((sizes.len(), fds.len(), offset), (2, 2, 100));
    // SAFETY: the descriptors are open while their handles live (below).
    let borrowed: Vec<_> = fds
        .iter()
        .map(|&fd| unsafe { BorrowedFd::borrow_raw(fd) })
        .collect();
    let imported = dev.ipc_import_handles(&borrowed, &sizes).unwrap();
    let seen = double
        .read(imported.base + 100, (GRANULE + 10) as usize)
        .unwrap();
    assert!(
        seen.iter().all(|&x| x == 0x5a),
        "the import reaches the same bytes"
    );
    // Over handles of two sizes: each mapped whole, one after the other.
    assert_eq!(double.fill(va + GRANULE, 0x3c, (2 * GRANULE) as usize), 0);
    let export = dev.ipc_export(va + GRANULE, 2 * GRANULE).unwrap();
    assert_eq!(export.common_handle_size(), None);
    let IpcExport::Handles { sizes, fds, offset } = export else {
        panic!("handles")
    };
    assert_eq!((sizes, offset), (vec![GRANULE, 2 * GRANULE], 0));
    // SAFETY: as above.
    let borrowed: Vec<_> = fds
        .iter()
        .map(|&fd| unsafe { BorrowedFd::borrow_raw(fd) })
        .collect();
    let mixed = dev
        .ipc_import_handles(&borrowed, &[GRANULE, 2 * GRANULE])
        .unwrap();
    let seen = double.read(mixed.base, (2 * GRANULE) as usize).unwrap();
    assert!(seen.iter().all(|&x| x == 0x3c), "both handles' bytes");
    dev.ipc_release_import(mixed).unwrap();
    // Addresses this device never mapped.
    let err = dev.ipc_export(va + 5 * GRANULE, 16).unwrap_err();
    assert!(
        err.detail.contains("not memory this device allocated"),
        "{}",
        err.detail
    );
    dev.ipc_release_import(imported).unwrap();
    for (at, size, handle) in [
        (0, GRANULE, a),
        (GRANULE, GRANULE, b),
        (2 * GRANULE, 2 * GRANULE, c),
    ] {
        dev.unmap(va + at, size).unwrap();
        dev.physical_release(handle).unwrap();
    }
    dev.address_free(va, 6 * GRANULE).unwrap();
    dev.segment_free(seg, 3 * MIB).unwrap();
    assert_eq!(double.live_bytes(), 0);
    // Garbage descriptors are the driver's to refuse, and leave nothing behind.
    // SAFETY: stdin is open for the test's duration (the import only reads it).
    let stdin = unsafe { BorrowedFd::borrow_raw(0) };
    assert!(dev.ipc_import_handles(&[stdin], &[GRANULE]).is_err());
    assert!(dev.ipc_import_handles(&[], &[]).is_err());
    assert!(dev.ipc_import_handles(&[stdin], &[GRANULE + 1]).is_err());
}

/// A driver that refuses exportable memory still serves plain memory, which
/// is then refused for sharing with a reason.
#[test]
fn memory_the_driver_would_not_make_exportable_is_served_but_not_shared() {
    let (_serial, double) = exclusive();
    let dev = open(0);
    double.fail_nth("cuMemCreate", 1, CUDA_ERROR_NOT_SUPPORTED);
    let va = dev.address_reserve(GRANULE).unwrap();
    let handle = dev.physical_create(GRANULE).unwrap();
    dev.map(va, GRANULE, handle, 0).unwrap();
    let err = dev.ipc_export(va, 64).unwrap_err();
    assert!(
        err.detail.contains("POSIX_FILE_DESCRIPTOR"),
        "{}",
        err.detail
    );
    dev.unmap(va, GRANULE).unwrap();
    dev.physical_release(handle).unwrap();
    dev.address_free(va, GRANULE).unwrap();
    assert!(
        dev.ipc_export(va, 64).is_err(),
        "nothing is mapped there any more"
    );
}

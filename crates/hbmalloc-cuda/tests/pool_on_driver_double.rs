//! `CudaPool` (the Rust API for frameworks) on the driver double: buffers
//! hold real (host-backed) memory, free themselves on drop, respect streams.

#[allow(dead_code)] // Each test binary uses part of the support module.
mod support;

use hbmalloc::{AllocError, StreamId};
use hbmalloc_cuda::byte_check::byte_program;
use hbmalloc_cuda::{CudaPool, DRIVER_PATH_ENV};

fn pool(settings: &str) -> std::sync::Arc<CudaPool> {
    std::env::set_var(DRIVER_PATH_ENV, support::double_path());
    CudaPool::new(0, settings).expect("pool on the double")
}

#[test]
fn buffers_hold_memory_and_return_it_on_drop() {
    let (_guard, double) = support::exclusive();
    let pool = pool("policy:pytorch");
    let stream = StreamId(0);
    {
        let buffer = pool.alloc(3 << 20, stream).unwrap();
        assert_eq!(buffer.len(), 3 << 20);
        // The double backs segments with host memory: write and read it back.
        let bytes = buffer.device_ptr() as *mut u8;
        // SAFETY: the double's segments are host allocations of at least
        // `len` bytes, live while `buffer` is.
        unsafe {
            std::ptr::write_bytes(bytes, 0xAB, buffer.len());
            assert_eq!(*bytes.add(buffer.len() - 1), 0xAB);
        }
        assert_eq!(pool.stats().allocation[0].current, 1);
    }
    assert_eq!(pool.stats().allocation[0].current, 0, "drop freed it");
    // Cached, then returned to the driver.
    assert!(double.live_bytes() > 0);
    pool.empty_cache().unwrap();
    assert_eq!(double.live_bytes(), 0);
    assert!(pool.summary().contains("memory summary, device ID 0"));
}

#[test]
fn a_buffer_used_on_another_stream_is_not_reused_before_that_stream_completes() {
    let (_guard, double) = support::exclusive();
    double.set_events_complete(false);
    let pool = pool("policy:pytorch");
    let (compute, copy) = (StreamId(0), StreamId(0x1000));
    let first = pool.alloc(1 << 20, compute).unwrap();
    let first_ptr = first.device_ptr();
    first.record_stream(copy).unwrap();
    drop(first);
    let second = pool.alloc(1 << 20, compute).unwrap();
    assert_ne!(
        second.device_ptr(),
        first_ptr,
        "still in use on the copy stream"
    );
    drop(second);
    double.complete_all_events();
    let third = pool.alloc(1 << 20, compute).unwrap();
    assert_eq!(
        third.device_ptr(),
        first_ptr,
        "reused once the copy stream completed"
    );
}

#[test]
fn out_of_memory_and_bad_settings_are_errors() {
    let (_guard, double) = support::exclusive();
    double.set_capacity(64 << 20);
    let pool = pool("policy:pytorch");
    match pool.alloc(1 << 30, StreamId(0)) {
        Err(AllocError::OutOfMemory(report)) => {
            assert_eq!(report.requested_bytes, 1 << 30);
            assert_eq!(report.device_total_bytes, 64 << 20);
        }
        other => panic!("expected out of memory, got {other:?}"),
    }
    std::env::set_var(DRIVER_PATH_ENV, support::double_path());
    assert!(matches!(
        CudaPool::new(0, "policy:pytorch,expandable_segments:true"),
        Err(AllocError::InvalidConfig(_))
    ));
    std::env::set_var(DRIVER_PATH_ENV, "/nonexistent/libcuda.so");
    let err = CudaPool::new(0, "").unwrap_err();
    assert!(err.to_string().contains("/nonexistent/libcuda.so"), "{err}");
}

/// Policy `hbm` on a driver whose `cuMemMap` refuses part of a handle:
/// memory freed in one place is stitched in at another (mapped a second
/// time), a granule-sized handle at a time, and every map is whole.
#[test]
fn hbm_stitches_whole_handles_on_a_driver_that_maps_no_parts() {
    let (_guard, double) = support::exclusive();
    double.set_whole_handle_maps(true);
    let pool = pool("policy:hbm,max_waste_percent:0,whole_handle_granules:1");
    // Opening the device asked the driver (one create, one refused map).
    let (creates, maps) = (
        double.call_count("cuMemCreate"),
        double.call_count("cuMemMap"),
    );
    let stream = StreamId(0);
    let first = pool.alloc(6 << 20, stream).unwrap();
    let second = pool.alloc(6 << 20, stream).unwrap();
    assert_eq!(
        double.call_count("cuMemCreate") - creates,
        6,
        "a handle per granule"
    );
    drop(first);
    // Needs 4 granules: the 3 idle ones first held, stitched in, and one new.
    let third = pool.alloc(8 << 20, stream).unwrap();
    assert_eq!(double.call_count("cuMemCreate") - creates, 7);
    assert_eq!(double.call_count("cuMemMap") - maps, 6 + 4);
    assert_eq!(pool.stats().reserved_bytes[0].current, 14 << 20);
    drop((second, third));
    pool.empty_cache().unwrap();
    assert_eq!(double.live_bytes(), 0);
}

/// End to end through the CUDA backend: policy `hbm` stitches, steals and
/// maps memory a second time while buffers live, and no live buffer ever
/// shares a byte with another ([`byte_program`], through the double's
/// `cuMemsetD8_v2` and `cuMemcpyDtoH_v2`, which reach each handle's bytes
/// through its mappings and refuse memory mapped without access). On a
/// driver that maps parts of handles and on one that maps whole handles
/// only, with handles of one granule, three, and the default (at least 16,
/// larger ones mapped on past a run, kept mappings reused on a miss); and
/// policy `pytorch`, which splits and merges blocks inside segments. Each
/// `hbm` run maps more often than it creates handles by at least the number
/// given: memory was stitched.
#[test]
fn buffers_keep_their_bytes_while_memory_moves_around_them() {
    for (whole_handles, settings, stitched) in [
        (false, "policy:hbm,max_waste_percent:0", 20),
        (
            true,
            "policy:hbm,max_waste_percent:0,whole_handle_granules:1",
            20,
        ),
        (
            true,
            "policy:hbm,max_waste_percent:0,whole_handle_granules:3",
            10,
        ),
        (true, "policy:hbm,max_waste_percent:0", 5),
        (false, "policy:pytorch", 0),
    ] {
        let (_guard, double) = support::exclusive();
        double.set_whole_handle_maps(whole_handles);
        let pool = pool(settings);
        let streams = [StreamId(0), StreamId(0x1000)];
        let report = byte_program(&*pool, pool.device(), 0, &streams, 1500).unwrap();
        assert_eq!(report.out_of_memory, 0, "{settings}");
        // The program moved memory: 12 to 165 maps more than handles made.
        assert!(
            settings.starts_with("policy:pytorch")
                || double.call_count("cuMemMap") > double.call_count("cuMemCreate") + stitched,
            "{settings}: {} maps of {} handles: nothing was stitched",
            double.call_count("cuMemMap"),
            double.call_count("cuMemCreate")
        );
        pool.empty_cache().unwrap();
        assert_eq!(double.live_bytes(), 0, "{settings}");
    }
}

/// The same with four threads sharing one pool (two of them one stream)
/// on a device too small for all of them: shards give memory back to each
/// other before an out-of-memory error, and still no live buffer shares a
/// byte with another.
#[test]
fn hbm_buffers_keep_their_bytes_with_threads_sharing_a_small_device() {
    let (_guard, double) = support::exclusive();
    double.set_capacity(160 << 20);
    let pool = pool("policy:hbm,max_waste_percent:0");
    let streams = [StreamId(0), StreamId(0), StreamId(0x1000), StreamId(0x2000)];
    let out_of_memory: u64 = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..4)
            .map(|thread| {
                let pool = &pool;
                let stream = [streams[thread]];
                scope.spawn(move || {
                    byte_program(&**pool, pool.device(), thread as u64 + 1, &stream, 800)
                        .unwrap()
                        .out_of_memory
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).sum()
    });
    // About 160 of 3,200 operations, in every run measured.
    assert!(out_of_memory > 0, "the device was never full");
    pool.empty_cache().unwrap();
    assert_eq!(double.live_bytes(), 0);
}

/// A CUDA graph's buffers from a `GraphPool` while a `CaptureGuard` lives:
/// memory is made in relaxed capture mode, nothing is waited for or freed
/// during the capture, the graph's freed buffers are reused only by the
/// graph pool, and everything returns to the driver once the pool and its
/// buffers are gone.
#[test]
fn a_graph_pool_keeps_its_memory_and_a_capture_waits_for_nothing() {
    let (_guard, double) = support::exclusive();
    double.set_events_complete(false);
    for settings in ["policy:hbm", "policy:pytorch"] {
        let pool = pool(settings);
        let (capturing, side) = (StreamId(0x10), StreamId(0x20));
        let graph = pool.graph_pool().unwrap();
        let forbidden = || {
            [
                "cuEventRecord",
                "cuEventQuery",
                "cuEventSynchronize",
                "cuCtxSynchronize",
                "cuMemFree_v2",
                "cuMemUnmap",
                "cuMemRelease",
            ]
            .iter()
            .map(|symbol| double.call_count(symbol))
            .sum::<u64>()
        };
        let capture = pool.capture().unwrap();
        let before = forbidden();
        let relaxed_before =
            double.relaxed_call_count("cuMemAlloc_v2") + double.relaxed_call_count("cuMemCreate");
        let kept = graph.alloc(3 << 20, capturing).unwrap();
        let temporary = graph.alloc(2 << 20, capturing).unwrap();
        temporary.record_stream(side).unwrap();
        let temporary_ptr = temporary.device_ptr();
        drop(temporary);
        // Not reusable by anyone: its use on `side` has no event yet.
        let other = pool.alloc(2 << 20, capturing).unwrap();
        assert_ne!(other.device_ptr(), temporary_ptr, "{settings}");
        assert!(matches!(
            pool.empty_cache(),
            Err(AllocError::CaptureUnderway { .. })
        ));
        assert_eq!(
            forbidden(),
            before,
            "{settings}: a forbidden call during the capture"
        );
        assert!(
            double.relaxed_call_count("cuMemAlloc_v2") + double.relaxed_call_count("cuMemCreate")
                > relaxed_before,
            "{settings}: memory made in relaxed capture mode"
        );
        drop(capture);
        double.complete_all_events();
        // After the capture the graph's freed memory is its pool's alone.
        let again = graph.alloc(2 << 20, capturing).unwrap();
        assert_eq!(again.device_ptr(), temporary_ptr, "{settings}");
        drop((kept, again, other));
        drop(graph);
        pool.empty_cache().unwrap();
        assert_eq!(double.live_bytes(), 0, "{settings}");
        assert_eq!(pool.stats().reserved_bytes[0].current, 0, "{settings}");
    }
}

//! The C ABI called directly, against the CUDA driver test double.
//!
//! Allocators are created once per process, so this binary's tests share
//! one configuration (`policy:pytorch`, history on) and run one at a time.
//! Cases that need another configuration (or no driver) re-run this binary
//! as a child process with their environment and a filter: see
//! [`child_case`].

mod support;

use std::ffi::{c_char, c_void, CString};
use std::process::Command;
use std::sync::{Mutex, MutexGuard, OnceLock};

use hbmalloc::simtest::{RandomSource, SplitMix64};
use hbmalloc::{StreamId, ThreadSafeAllocator};
use hbmalloc_capi::{
    check_invariants, driver_calls, hbmalloc_alloc, hbmalloc_begin_capture, hbmalloc_cache_info,
    hbmalloc_create_or_incref_pool, hbmalloc_empty_cache, hbmalloc_end_capture, hbmalloc_free,
    hbmalloc_history_entries, hbmalloc_init, hbmalloc_ipc_open, hbmalloc_last_error,
    hbmalloc_last_error_code, hbmalloc_mem_get_info, hbmalloc_memory_fraction, hbmalloc_pool_alloc,
    hbmalloc_pool_live_allocations, hbmalloc_pool_use_count, hbmalloc_record_stream,
    hbmalloc_release_pool, hbmalloc_reset, hbmalloc_set_history_entries,
    hbmalloc_set_memory_fraction, hbmalloc_snapshot, hbmalloc_stats_json, hbmalloc_stats_values,
    hbmalloc_summary, hbmalloc_write_log, settings, stats_map, Status,
};
use hbmalloc_cuda::byte_check::{byte_program, Buffers, DeviceBytes};

const MIB: isize = 1 << 20;
/// Set in a child process: the name of the case it runs.
const CHILD_ENV: &str = "HBMALLOC_CAPI_TEST_CHILD";
const NO_STREAM: *mut c_void = std::ptr::null_mut();

/// Points the ABI at the driver double with a fixed configuration (unless
/// this is a child process, whose parent chose its environment), and
/// serialises the tests.
fn setup() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    static ENV: OnceLock<()> = OnceLock::new();
    ENV.get_or_init(|| {
        if std::env::var_os(CHILD_ENV).is_none() {
            for var in support::CONFIG_VARS {
                std::env::remove_var(var);
            }
            std::env::set_var("HBMALLOC_CUDA_DRIVER", support::double_path());
            std::env::set_var("HBMALLOC_CONF", "policy:pytorch");
            std::env::set_var("HBMALLOC_HISTORY_ENTRIES", "100000");
        }
    });
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn last_error() -> String {
    // SAFETY: a null buffer with length 0 only asks for the length.
    let len = unsafe { hbmalloc_last_error(std::ptr::null_mut(), 0) };
    let mut buf = vec![0u8; len as usize + 1];
    // SAFETY: `buf` is valid for `buf.len()` bytes.
    let written = unsafe { hbmalloc_last_error(buf.as_mut_ptr().cast::<c_char>(), buf.len()) };
    assert_eq!(written, len);
    buf.truncate(len as usize);
    String::from_utf8(buf).unwrap()
}

fn last_status() -> i32 {
    hbmalloc_last_error_code()
}

fn assert_ok() {
    assert_eq!(last_status(), Status::Ok as i32, "{}", last_error());
    assert_eq!(last_error(), "");
}

fn assert_error(status: Status, needles: &[&str]) {
    let message = last_error();
    assert_eq!(last_status(), status as i32, "message: {message}");
    for needle in needles {
        assert!(
            message.contains(needle),
            "{needle:?} not in the message: {message}"
        );
    }
}

fn assert_consistent() {
    for device in 0..2 {
        check_invariants(device).unwrap();
    }
}

fn stat(device: i32, key: &str) -> i64 {
    stats_map(device).unwrap()[key]
}

fn alloc(size: isize, device: i32) -> *mut c_void {
    hbmalloc_alloc(size, device, NO_STREAM)
}

fn free(ptr: *mut c_void, device: i32) {
    hbmalloc_free(ptr, 0, device, NO_STREAM)
}

#[test]
fn alloc_free_round_trip_with_bytes_written_through_the_pointer() {
    let _serial = setup();
    let live_before = stat(0, "allocation.all.current");
    let small = alloc(1000, 0);
    assert_ok();
    let large = alloc(3 * MIB + 5, 0);
    assert_ok();
    assert!(!small.is_null() && !large.is_null());
    // The double aligns segments to 256 bytes, as cudaMalloc does.
    assert_eq!(small as usize % 256, 0);
    // The double backs segments with host memory: the pointers are usable.
    // SAFETY: both blocks are live allocations of at least these sizes.
    unsafe {
        std::ptr::write_bytes(small.cast::<u8>(), 0xab, 1000);
        std::ptr::write_bytes(large.cast::<u8>(), 0xcd, (3 * MIB + 5) as usize);
        assert_eq!(*small.cast::<u8>().add(999), 0xab);
        assert_eq!(*large.cast::<u8>().add(3 * MIB as usize), 0xcd);
    }
    assert_eq!(stat(0, "allocation.all.current"), live_before + 2);
    free(small, 0);
    assert_ok();
    free(large, 0);
    assert_ok();
    assert_eq!(stat(0, "allocation.all.current"), live_before);
    assert_consistent();
}

#[test]
fn second_device_has_its_own_allocator() {
    let _serial = setup();
    let p = alloc(4096, 1);
    assert_ok();
    // Freed on the wrong device: hbmalloc on device 0 never handed it out.
    free(p, 0);
    assert_error(Status::UnknownPointer, &[&format!("{:#x}", p as usize)]);
    free(p, 1);
    assert_ok();
    assert_consistent();
}

#[test]
fn driver_calls_count_and_time_each_kind_the_allocator_called() {
    let _serial = setup();
    let kinds: Vec<&str> = hbmalloc::CallKind::ALL.iter().map(|k| k.name()).collect();
    // The allocator exists (opening it asks the device's size).
    free(alloc(4096, 0), 0);
    assert_ok();
    let before = driver_calls(0).unwrap();
    assert_eq!(before.iter().map(|c| c.0).collect::<Vec<_>>(), kinds);
    // Larger than anything cached: policy pytorch makes a cudaMalloc of its own.
    let p = alloc(256 * MIB, 0);
    assert_ok();
    let after = driver_calls(0).unwrap();
    free(p, 0);
    assert_ok();
    for ((kind, calls, seconds), (_, calls_before, seconds_before)) in after.iter().zip(&before) {
        let made = calls - calls_before;
        assert_eq!(made, u64::from(*kind == "segment_alloc"), "{kind}");
        // A call takes some nanoseconds (seconds from ns: not a whole second).
        assert_eq!(made > 0, seconds > seconds_before, "{kind}");
        assert!(*seconds < 1.0, "{kind}: {seconds} s");
    }
}

#[test]
fn null_free_is_a_no_op() {
    let _serial = setup();
    let before = stats_map(0).unwrap();
    free(std::ptr::null_mut(), 0);
    assert_ok();
    assert_eq!(stats_map(0).unwrap(), before);
}

#[test]
fn unknown_and_interior_pointers_are_refused_and_change_nothing() {
    let _serial = setup();
    let p = alloc(8192, 0);
    assert_ok();
    let before = stats_map(0).unwrap();
    free(0xdead_0000 as *mut c_void, 0);
    assert_error(
        Status::UnknownPointer,
        &["0xdead0000", "not a live allocation"],
    );
    // SAFETY: only the address is computed; nothing is dereferenced.
    let interior = unsafe { p.cast::<u8>().add(512) }.cast::<c_void>();
    free(interior, 0);
    assert_error(Status::UnknownPointer, &[]);
    assert_eq!(stats_map(0).unwrap(), before);
    assert_consistent();
    free(p, 0);
    assert_ok();
}

#[test]
fn double_free_is_refused() {
    let _serial = setup();
    let p = alloc(512, 0);
    free(p, 0);
    assert_ok();
    let before = stats_map(0).unwrap();
    free(p, 0);
    assert_error(Status::UnknownPointer, &["double free"]);
    assert_eq!(stats_map(0).unwrap(), before);
    assert_consistent();
}

#[test]
fn sizes_zero_negative_and_absurd() {
    let _serial = setup();
    let before = stats_map(0).unwrap();
    assert!(alloc(0, 0).is_null());
    assert_ok();
    for size in [-1, -MIB, isize::MIN] {
        assert!(alloc(size, 0).is_null());
        assert_error(
            Status::InvalidArgument,
            &["invalid allocation size", "positive"],
        );
    }
    for size in [1 << 51, isize::MAX] {
        assert!(alloc(size, 0).is_null());
        assert_error(Status::InvalidArgument, &["invalid allocation size"]);
    }
    assert_eq!(stats_map(0).unwrap(), before);
    assert_consistent();
}

#[test]
fn device_out_of_range() {
    let _serial = setup();
    for device in [2, -1, i32::MAX] {
        assert!(alloc(512, device).is_null());
        assert_error(
            Status::DeviceOutOfRange,
            &[&format!("device {device} is out of range"), "2 device(s)"],
        );
        free(0x1000 as *mut c_void, device);
        assert_eq!(last_status(), Status::DeviceOutOfRange as i32);
        assert_eq!(
            hbmalloc_empty_cache(device),
            Status::DeviceOutOfRange as i32
        );
    }
    assert_eq!(hbmalloc_init(2), Status::Ok as i32);
    assert_eq!(hbmalloc_init(3), Status::DeviceOutOfRange as i32);
    assert_consistent();
}

#[test]
fn out_of_memory_returns_null_with_the_report() {
    let _serial = setup();
    // The double's devices hold 1 GiB each.
    assert!(alloc(4 << 30, 0).is_null());
    assert_error(
        Status::OutOfMemory,
        &["out of memory", "tried to allocate 4", "verdict"],
    );
    assert!(stat(0, "num_ooms") >= 1);
    assert_consistent();
    // Still serves requests afterwards.
    let p = alloc(MIB, 0);
    assert_ok();
    free(p, 0);
}

#[test]
fn record_stream_fraction_empty_cache_and_reset() {
    let _serial = setup();
    let p = alloc(2 * MIB, 0);
    assert_eq!(hbmalloc_record_stream(p, 0, 0x77 as *mut c_void), 0);
    assert_eq!(
        hbmalloc_record_stream(0x1234_5600 as *mut c_void, 0, NO_STREAM),
        Status::UnknownPointer as i32
    );
    free(p, 0);
    assert_ok();
    assert_eq!(
        hbmalloc_set_memory_fraction(1.5, 0),
        Status::InvalidArgument as i32
    );
    assert!(last_error().contains("1.5"), "{}", last_error());
    assert_eq!(hbmalloc_set_memory_fraction(1.0, 0), 0);
    assert_eq!(hbmalloc_empty_cache(0), 0);
    assert_eq!(hbmalloc_reset(), 0);
    assert_eq!(stat(0, "reserved_bytes.all.current"), 0);
    assert_eq!(stat(1, "reserved_bytes.all.current"), 0);
    assert_consistent();
}

#[test]
fn stats_json_and_summary_text() {
    let _serial = setup();
    let p = alloc(3 * MIB, 0);
    // SAFETY: a null buffer with length 0 only asks for the length.
    let len = unsafe { hbmalloc_stats_json(0, std::ptr::null_mut(), 0) };
    assert!(len > 100);
    let mut buf = vec![0u8; len as usize + 1];
    // SAFETY: `buf` is valid for `buf.len()` bytes.
    let written = unsafe { hbmalloc_stats_json(0, buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(written, len);
    assert_eq!(buf[len as usize], 0);
    let json: serde_json::Value = serde_json::from_slice(&buf[..len as usize]).unwrap();
    let object = json.as_object().unwrap();
    assert_eq!(object.len(), stats_map(0).unwrap().len());
    assert!(object["allocation.all.current"].as_i64().unwrap() >= 1);
    assert!(
        object["requested_bytes.large_pool.current"]
            .as_i64()
            .unwrap()
            >= 3 << 20
    );

    // Truncation: snprintf semantics, always NUL-terminated.
    let mut small = [0x55u8; 8];
    // SAFETY: `small` is valid for 8 bytes.
    let needed = unsafe { hbmalloc_summary(0, 0, small.as_mut_ptr().cast(), small.len()) };
    assert!(needed > 8);
    assert_eq!(small[7], 0);
    let mut text = vec![0u8; needed as usize + 1];
    // SAFETY: `text` is valid for `text.len()` bytes.
    unsafe { hbmalloc_summary(0, 0, text.as_mut_ptr().cast(), text.len()) };
    let text = String::from_utf8(text[..needed as usize].to_vec()).unwrap();
    assert!(
        text.contains("PyTorch CUDA memory summary, device ID 0"),
        "{text}"
    );
    assert!(text.contains("from large pool"));
    assert!(text.starts_with(std::str::from_utf8(&small[..7]).unwrap()));
    // SAFETY: a null buffer with length 0 only asks for the length.
    let abbreviated = unsafe { hbmalloc_summary(0, 1, std::ptr::null_mut(), 0) };
    assert!(abbreviated < needed);
    // A null buffer with a length is refused.
    // SAFETY: the function checks for null before writing.
    let refused = unsafe { hbmalloc_stats_json(0, std::ptr::null_mut(), 10) };
    assert_eq!(refused, -1);
    assert_error(Status::InvalidArgument, &["NULL"]);
    free(p, 0);
}

#[test]
fn stats_values_fill_in_the_order_asked_and_refuse_unknown_keys() {
    let _serial = setup();
    let p = alloc(3 * MIB, 0);
    let names = [
        "requested_bytes.all.current",
        "num_ooms",
        "allocation.all.current",
    ];
    let keys: Vec<CString> = names.iter().map(|k| CString::new(*k).unwrap()).collect();
    let pointers: Vec<*const c_char> = keys.iter().map(|k| k.as_ptr()).collect();
    let mut values = [-7i64; 3];
    // SAFETY: three key pointers, three values.
    let status = unsafe { hbmalloc_stats_values(0, pointers.as_ptr(), 3, values.as_mut_ptr()) };
    assert_eq!(status, 0, "{}", last_error());
    let expected: Vec<i64> = names.iter().map(|k| stat(0, k)).collect();
    assert_eq!(values.to_vec(), expected);
    assert_eq!(values[0], 3 * MIB as i64);

    // An unknown key writes nothing and is named.
    let unknown = CString::new("allocated_bytes.all.nonsense").unwrap();
    let with_unknown = [pointers[0], unknown.as_ptr()];
    let mut untouched = [-7i64; 2];
    // SAFETY: two key pointers, two values.
    let status =
        unsafe { hbmalloc_stats_values(0, with_unknown.as_ptr(), 2, untouched.as_mut_ptr()) };
    assert_eq!(status, Status::InvalidArgument as i32);
    assert_error(Status::InvalidArgument, &["allocated_bytes.all.nonsense"]);
    assert_eq!(untouched, [-7, -7]);
    // NULL keys, a NULL key, NULL values: refused, never read.
    let with_null = [pointers[0], std::ptr::null()];
    // SAFETY: the function checks for null before reading or writing.
    unsafe {
        assert_eq!(
            hbmalloc_stats_values(0, std::ptr::null(), 1, untouched.as_mut_ptr()),
            Status::InvalidArgument as i32
        );
        assert_eq!(
            hbmalloc_stats_values(0, with_null.as_ptr(), 2, untouched.as_mut_ptr()),
            Status::InvalidArgument as i32
        );
        assert_error(Status::InvalidArgument, &["key 1 is NULL"]);
        assert_eq!(
            hbmalloc_stats_values(0, pointers.as_ptr(), 1, std::ptr::null_mut()),
            Status::InvalidArgument as i32
        );
        assert_eq!(
            hbmalloc_stats_values(0, std::ptr::null(), 0, std::ptr::null_mut()),
            0
        );
    }
    assert_eq!(untouched, [-7, -7]);
    free(p, 0);
}

#[test]
fn cache_info_memory_fraction_and_mem_get_info_read_back() {
    let _serial = setup();
    assert_eq!(hbmalloc_empty_cache(0), 0);
    let mut fraction = -1.0f64;
    // SAFETY: `fraction` is a valid out-parameter.
    assert_eq!(unsafe { hbmalloc_memory_fraction(0, &mut fraction) }, 0);
    assert_eq!(fraction, 1.0);
    // The driver double's device: its free memory, nothing cached.
    let mut largest = 0usize;
    // SAFETY: `largest` is a valid out-parameter.
    assert_eq!(unsafe { hbmalloc_cache_info(0, &mut largest) }, 0);
    assert!(largest > 64 * MIB as usize, "{largest}");

    // A 40 MiB block cached, under a fraction the cache already exceeds, so
    // the device may add nothing: the cached block is the answer.
    let p = alloc(40 * MIB, 0);
    free(p, 0);
    assert_eq!(
        hbmalloc_set_memory_fraction(0.001, 0),
        0,
        "{}",
        last_error()
    );
    // SAFETY: valid out-parameters.
    unsafe {
        assert_eq!(hbmalloc_memory_fraction(0, &mut fraction), 0);
        assert_eq!(fraction, 0.001);
        assert_eq!(hbmalloc_cache_info(0, &mut largest), 0);
    }
    assert_eq!(largest, 40 * MIB as usize);
    // The driver's view: 40 MiB fewer free than in total, at least.
    let (mut free_bytes, mut total_bytes) = (0usize, 0usize);
    // SAFETY: valid out-parameters.
    let status = unsafe { hbmalloc_mem_get_info(0, &mut free_bytes, &mut total_bytes) };
    assert_eq!(status, 0);
    assert!(
        free_bytes + 40 * MIB as usize <= total_bytes,
        "{free_bytes} of {total_bytes}"
    );
    // NULL out-parameters are refused.
    // SAFETY: the functions check for null before writing.
    unsafe {
        assert_eq!(
            hbmalloc_mem_get_info(0, &mut free_bytes, std::ptr::null_mut()),
            Status::InvalidArgument as i32
        );
        assert_eq!(
            hbmalloc_cache_info(0, std::ptr::null_mut()),
            Status::InvalidArgument as i32
        );
        assert_error(Status::InvalidArgument, &["largest_block is NULL"]);
        assert_eq!(
            hbmalloc_memory_fraction(0, std::ptr::null_mut()),
            Status::InvalidArgument as i32
        );
    }
    assert_eq!(hbmalloc_set_memory_fraction(1.0, 0), 0);
    assert_eq!(hbmalloc_empty_cache(0), 0);
    assert_consistent();
}

#[test]
fn snapshot_file_loads_as_a_trace() {
    let _serial = setup();
    let keep = alloc(5 * MIB, 0);
    let gone = alloc(1000, 0);
    free(gone, 0);
    let path = std::env::temp_dir().join(format!("hbmalloc-capi-{}.pickle", std::process::id()));
    let c_path = CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: `c_path` is a valid NUL-terminated string.
    let status = unsafe { hbmalloc_snapshot(0, c_path.as_ptr()) };
    assert_eq!(status, 0, "{}", last_error());
    let trace = hbmalloc_trace::load(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let device = trace.devices.iter().find(|d| d.device == 0).unwrap();
    assert!(device.ops.len() >= 3, "history records the allocations");
    assert_eq!(device.recorded_config.as_deref(), Some(""));
    // SAFETY: null is checked before use.
    let status = unsafe { hbmalloc_snapshot(0, std::ptr::null()) };
    assert_eq!(status, Status::InvalidArgument as i32);
    let bad = CString::new("/nonexistent-dir/x.pickle").unwrap();
    // SAFETY: `bad` is a valid NUL-terminated string.
    let status = unsafe { hbmalloc_snapshot(0, bad.as_ptr()) };
    assert_eq!(status, Status::InvalidArgument as i32);
    assert!(last_error().contains("/nonexistent-dir/x.pickle"));
    assert_eq!(hbmalloc_write_log(), Status::InvalidState as i32);
    assert!(last_error().contains("log:PATH"));
    free(keep, 0);
    assert_consistent();
}

#[test]
fn pool_live_allocations_list_what_the_pool_handed_out_and_history_reads_back() {
    let _serial = setup();
    assert_eq!(hbmalloc_create_or_incref_pool(0, 7, 1), Status::Ok as i32);
    let a = hbmalloc_pool_alloc(MIB, 0, NO_STREAM, 7, 1);
    let b = hbmalloc_pool_alloc(2 * MIB, 0, NO_STREAM, 7, 1);
    let outside = alloc(MIB, 0);
    assert!(!a.is_null() && !b.is_null());
    let live = |capacity: usize| {
        let mut ptrs = vec![std::ptr::null_mut(); capacity];
        let mut count = 0usize;
        // SAFETY: `ptrs` has room for `capacity` pointers, `count` for one.
        let status = unsafe {
            hbmalloc_pool_live_allocations(0, 7, 1, ptrs.as_mut_ptr(), capacity, &mut count)
        };
        assert_eq!(status, Status::Ok as i32, "{}", last_error());
        ptrs.truncate(count.min(capacity));
        (count, ptrs)
    };
    let mut expected = vec![a, b];
    expected.sort();
    assert_eq!(live(4), (2, expected));
    assert_eq!(
        live(0).0,
        2,
        "the count comes without room for the addresses"
    );
    free(b, 0);
    assert_eq!(live(4), (1, vec![a]));
    free(a, 0);
    free(outside, 0);
    assert_eq!(hbmalloc_release_pool(0, 7, 1), Status::Ok as i32);
    let mut count = 0usize;
    // SAFETY: a null `ptrs` with capacity 0; `count` is valid.
    let status =
        unsafe { hbmalloc_pool_live_allocations(0, 7, 1, std::ptr::null_mut(), 0, &mut count) };
    assert_eq!(
        status,
        Status::InvalidArgument as i32,
        "a released, emptied pool is gone"
    );

    let history = || {
        let mut entries = 0usize;
        // SAFETY: `entries` is valid for a write.
        let status = unsafe { hbmalloc_history_entries(&mut entries) };
        assert_eq!(status, Status::Ok as i32);
        entries
    };
    assert_eq!(hbmalloc_set_history_entries(0, 0), Status::Ok as i32);
    assert_eq!(history(), 0);
    // Back to what `setup` configured.
    assert_eq!(hbmalloc_set_history_entries(100_000, 0), Status::Ok as i32);
    assert_eq!(history(), 100_000);
}

/// A handle length no buffer can have (a negative `ssize_t` passed as
/// `size_t`) is refused before any byte is read.
#[test]
fn ipc_open_refuses_an_absurd_length() {
    let _serial = setup();
    let handle = [0u8; 66];
    let mut base = std::ptr::null_mut();
    for length in [usize::MAX, isize::MAX as usize + 1] {
        // SAFETY: the length is refused before `handle` is read.
        let status = unsafe { hbmalloc_ipc_open(handle.as_ptr().cast(), length, 0, &mut base) };
        assert_eq!(status, Status::InvalidArgument as i32);
        assert_error(Status::InvalidArgument, &["handle length", "absurd"]);
        assert!(base.is_null());
    }
}

#[test]
fn errors_are_per_thread() {
    let _serial = setup();
    free(0xbad0_0000 as *mut c_void, 0);
    assert_eq!(last_status(), Status::UnknownPointer as i32);
    std::thread::spawn(|| assert_eq!(hbmalloc_last_error_code(), 0))
        .join()
        .unwrap();
    assert_eq!(last_status(), Status::UnknownPointer as i32);
}

/// Runs this binary again as a child with `env` (on a clean configuration
/// environment) running only [`child_entry`] with the case `name`.
fn child_case(name: &str, env: &[(&str, &str)]) {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"]);
    for var in support::CONFIG_VARS {
        command.env_remove(var);
    }
    command.env(CHILD_ENV, name);
    command.env("HBMALLOC_CUDA_DRIVER", support::double_path());
    command.envs(env.iter().copied());
    let output = command.output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains("1 passed"),
        "child case {name} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The body of every child case; does nothing in the parent.
#[test]
fn child_entry() {
    let Ok(case) = std::env::var(CHILD_ENV) else {
        return;
    };
    let _serial = setup();
    match case.as_str() {
        "bad_hbmalloc_conf" => {
            assert!(alloc(512, 0).is_null());
            assert_error(
                Status::ConfigError,
                &["HBMALLOC_CONF", "expandable_segments", "true"],
            );
            // Reported again at every use, not only the first.
            free(0x1000 as *mut c_void, 0);
            assert_eq!(last_status(), Status::ConfigError as i32);
            assert_eq!(hbmalloc_init(-1), Status::ConfigError as i32);
        }
        "bad_pytorch_conf" => {
            assert!(alloc(512, 0).is_null());
            assert_error(
                Status::ConfigError,
                &["PYTORCH_CUDA_ALLOC_CONF", "no_such_key"],
            );
        }
        "bad_history" => {
            assert!(alloc(512, 0).is_null());
            assert_error(Status::ConfigError, &["HBMALLOC_HISTORY_ENTRIES", "lots"]);
        }
        "first_use_during_a_capture" => {
            // Device 1 is opened for the first time while device 0 captures.
            assert_eq!(hbmalloc_begin_capture(0), 0);
            assert!(alloc(512, 1).is_null());
            assert_error(
                Status::InvalidState,
                &["device 1 is used for the first time while a CUDA graph capture"],
            );
            assert_eq!(hbmalloc_end_capture(0), 0);
            let p = alloc(512, 1);
            assert_ok();
            free(p, 1);
            assert_eq!(hbmalloc_end_capture(0), Status::InvalidState as i32);
        }
        "pytorch_conf" => {
            let p = alloc(512, 0);
            assert_ok();
            assert_eq!(
                settings(0).unwrap(),
                "policy:pytorch,expandable_segments:True"
            );
            free(p, 0);
        }
        "pytorch_alloc_conf" => {
            assert_eq!(settings(0).unwrap(), "policy:pytorch,max_split_size_mb:64");
        }
        "hbmalloc_conf_wins" => {
            assert_eq!(settings(0).unwrap(), "policy:pytorch,max_split_size_mb:64");
        }
        "default_conf" => {
            let expected = hbmalloc::AllocatorConfig::default().policy.to_settings();
            assert_eq!(settings(0).unwrap(), expected);
        }
        "no_driver" => {
            assert!(alloc(512, 0).is_null());
            assert_error(
                Status::NoDriver,
                &["/nonexistent", "cannot load CUDA driver"],
            );
            assert_eq!(hbmalloc_init(1), Status::NoDriver as i32);
            // SAFETY: a null buffer with length 0 only asks for the length.
            let length = unsafe { hbmalloc_stats_json(0, std::ptr::null_mut(), 0) };
            assert_eq!(length, -1);
            assert_eq!(last_status(), Status::NoDriver as i32);
        }
        "no_device" => {
            assert!(alloc(512, 0).is_null());
            assert_error(Status::NoDriver, &["CUDA_ERROR_NO_DEVICE"]);
        }
        "hbm_bytes" => hbm_keeps_every_buffer_its_own_bytes(),
        "hostile" => {
            for seed in 0..hostile_seeds() {
                hostile_program(seed, 400, true);
            }
        }
        "log" => a_logged_run_replays_to_the_peak_it_saw(),
        "bad_log_entries" => {
            assert!(alloc(512, 0).is_null());
            assert_error(Status::ConfigError, &["HBMALLOC_CONF", "log_entries", "0"]);
        }
        "log_entries_without_log" => {
            assert!(alloc(512, 0).is_null());
            assert_error(Status::ConfigError, &["log_entries", "without log:PATH"]);
        }
        "unused_device" => {
            // Reading device 1, which never allocated, creates no allocator
            // there (whose CUDA context would take memory on that GPU).
            let read = stats_map(1).unwrap();
            assert_eq!(read["max_split_size"], 64 << 20);
            assert!(read.iter().all(|(k, &v)| k == "max_split_size" || v == 0));
            assert!(hbmalloc_capi::summary(1, false)
                .unwrap()
                .contains("device ID 1"));
            hbmalloc_capi::reset_peak_stats(1).unwrap();
            hbmalloc_capi::reset_accumulated_stats(1).unwrap();
            assert_eq!(hbmalloc_capi::memory_fraction(1).unwrap(), 0.5);
            assert_eq!(
                settings(1).unwrap(),
                "policy:pytorch,max_split_size_mb:64,per_process_memory_fraction:0.5"
            );
            let pickle = hbmalloc_capi::snapshot_pickle(1).unwrap();
            assert!(pickle.len() > 10);
            let created = hbmalloc_capi::with_existing_allocator(1, |_| Ok(())).unwrap();
            assert!(created.is_none(), "reading created an allocator");
            // What was read is what a new allocator reports.
            let fresh = hbmalloc_capi::with_allocator(1, |a| Ok(a.stats().to_pytorch_map()));
            assert_eq!(fresh.unwrap(), read);
            assert_eq!(hbmalloc_capi::memory_fraction(1).unwrap(), 0.5);
        }
        other => panic!("unknown child case {other}"),
    }
}

/// A production run through the C ABI on three streams (several shards),
/// logged with a ring far smaller than the run: the log replays, and the
/// replay's peak live is the peak of requested bytes the run saw.
fn a_logged_run_replays_to_the_peak_it_saw() {
    let streams = [NO_STREAM, 0x100 as *mut c_void, 0x200 as *mut c_void];
    let mut rng = 1u64;
    let mut next = || {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (rng >> 33) as usize
    };
    let (mut live, mut live_bytes, mut peak) = (Vec::new(), 0isize, 0isize);
    let allocate = |size: isize, stream: *mut c_void, live: &mut Vec<_>, bytes: &mut isize| {
        let ptr = hbmalloc_alloc(size, 0, stream.cast());
        assert!(!ptr.is_null(), "{}", last_error());
        live.push((ptr, size));
        *bytes += size;
    };
    // Churn that overflows every shard's ring, then the run's peak, late
    // enough that the log's window holds it.
    let mut operations = 0;
    for _ in 0..600 {
        if live.len() < 20 || next() % 3 != 0 {
            let (size, stream) = (512 * (1 + next() % 2000) as isize, streams[next() % 3]);
            allocate(size, stream, &mut live, &mut live_bytes);
        } else {
            let (ptr, size) = live.swap_remove(next() % live.len());
            free(ptr, 0);
            live_bytes -= size;
        }
        peak = peak.max(live_bytes);
        operations += 1;
    }
    let peak_before = peak;
    for i in 0..8 {
        allocate(8 * MIB, streams[i % 3], &mut live, &mut live_bytes);
        peak = peak.max(live_bytes);
    }
    for _ in 0..4 {
        let (ptr, _) = live.pop().unwrap();
        free(ptr, 0);
    }
    assert!(
        peak > peak_before,
        "the run's peak is in its last operations"
    );
    assert_eq!(stat(0, "requested_bytes.all.peak"), peak as i64);

    assert_eq!(hbmalloc_write_log(), 0, "{}", last_error());
    let path = hbmalloc_capi::log_path().unwrap().unwrap();
    let trace = hbmalloc_trace::load(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let device = trace.devices.iter().find(|d| d.device == 0).unwrap();
    assert!(
        device.ops.len() < operations,
        "the log keeps a window, not the run: {} ops",
        device.ops.len()
    );
    let options = hbmalloc_replay::EvalOptions::new(
        hbmalloc::PolicyConfig::from_settings("policy:pytorch").unwrap(),
    );
    let metrics = hbmalloc_replay::evaluate("log", device, &options).unwrap();
    assert!(metrics.out_of_memory.is_none());
    assert_eq!(metrics.peak_live_bytes, peak as u64);
    for (ptr, _) in live {
        free(ptr, 0);
    }
}

/// The C ABI as [`byte_program`] allocates through it: what PyTorch calls,
/// on one device, on the legacy default stream.
struct CApi {
    device: i32,
}

impl Buffers for CApi {
    fn alloc(&self, size: usize, _stream: StreamId) -> Result<Option<u64>, String> {
        let ptr = hbmalloc_alloc(size as isize, self.device, NO_STREAM);
        match last_status() {
            0 => Ok(Some(ptr as u64)),
            status if status == Status::OutOfMemory as i32 => Ok(None),
            _ => Err(last_error()),
        }
    }

    fn free(&self, ptr: u64) -> Result<(), String> {
        hbmalloc_free(ptr as *mut c_void, 0, self.device, NO_STREAM);
        match last_status() {
            0 => Ok(()),
            _ => Err(last_error()),
        }
    }
}

/// Device memory through the double's own `hbm_double_fill` and
/// `hbm_double_read` (no context needed, no driver call counted).
struct DoubleBytes {
    fill: extern "C" fn(u64, u8, u64, i32) -> i32,
    read: unsafe extern "C" fn(*mut u8, u64, u64, i32) -> i32,
    device: i32,
}

impl DeviceBytes for DoubleBytes {
    fn fill(&self, ptr: u64, value: u8, len: usize) -> Result<(), String> {
        match (self.fill)(ptr, value, len as u64, self.device) {
            0 => Ok(()),
            code => Err(format!("filling {len} bytes at {ptr:#x}: {code}")),
        }
    }

    fn read(&self, ptr: u64, len: usize) -> Result<Vec<u8>, String> {
        let mut bytes = vec![0u8; len];
        // SAFETY: `bytes` has room for `len` bytes for the call's duration.
        match unsafe { (self.read)(bytes.as_mut_ptr(), ptr, len as u64, self.device) } {
            0 => Ok(bytes),
            code => Err(format!("reading {len} bytes at {ptr:#x}: {code}")),
        }
    }
}

/// PyTorch's path under policy `hbm`: [`byte_program`] through the C ABI,
/// one thread per device of the double at once. Every buffer keeps its own
/// bytes while memory is stitched, stolen and mapped a second time around
/// it, and everything goes back to the driver at the end.
fn hbm_keeps_every_buffer_its_own_bytes() {
    assert_eq!(settings(0).unwrap(), "policy:hbm,max_waste_percent:0");
    // SAFETY: the double is already loaded by the ABI (this returns the
    // same library); its initialisers are constant Rust statics.
    let double = unsafe { libloading::Library::new(support::double_path()) }.unwrap();
    // SAFETY: these are the signatures the double exports under these names.
    let (fill, read, calls) = unsafe {
        (
            *double
                .get::<extern "C" fn(u64, u8, u64, i32) -> i32>(b"hbm_double_fill\0")
                .unwrap(),
            *double
                .get::<unsafe extern "C" fn(*mut u8, u64, u64, i32) -> i32>(b"hbm_double_read\0")
                .unwrap(),
            *double
                .get::<unsafe extern "C" fn(*const c_char) -> u64>(b"hbm_double_call_count\0")
                .unwrap(),
        )
    };
    std::thread::scope(|scope| {
        for device in 0..2 {
            scope.spawn(move || {
                let bytes = DoubleBytes { fill, read, device };
                let report =
                    byte_program(&CApi { device }, &bytes, device as u64, &[StreamId(0)], 600)
                        .unwrap_or_else(|e| panic!("device {device}: {e}"));
                assert_eq!(report.out_of_memory, 0, "device {device}");
            });
        }
    });
    assert_consistent();
    let count = |name: &std::ffi::CStr| {
        // SAFETY: a nul-terminated name.
        unsafe { calls(name.as_ptr()) }
    };
    assert!(
        count(c"cuMemMap") > count(c"cuMemCreate") + 20,
        "{} maps of {} handles: nothing was stitched",
        count(c"cuMemMap"),
        count(c"cuMemCreate")
    );
    for device in 0..2 {
        assert_eq!(hbmalloc_empty_cache(device), Status::Ok as i32);
    }
    // SAFETY: the signature the double exports under this name.
    let live_bytes = unsafe {
        *double
            .get::<extern "C" fn() -> u64>(b"hbm_double_live_bytes\0")
            .unwrap()
    };
    assert_eq!(live_bytes(), 0, "everything went back to the driver");
}

#[test]
fn config_cases_in_child_processes() {
    let _serial = setup();
    child_case(
        "bad_hbmalloc_conf",
        &[("HBMALLOC_CONF", "policy:pytorch,expandable_segments:true")],
    );
    child_case(
        "bad_pytorch_conf",
        &[("PYTORCH_CUDA_ALLOC_CONF", "no_such_key:1")],
    );
    child_case("bad_history", &[("HBMALLOC_HISTORY_ENTRIES", "lots")]);
    child_case("first_use_during_a_capture", &[]);
    child_case(
        "pytorch_conf",
        &[("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")],
    );
    child_case(
        "pytorch_alloc_conf",
        &[("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")],
    );
    child_case(
        "hbmalloc_conf_wins",
        &[
            ("HBMALLOC_CONF", "policy:pytorch,max_split_size_mb:64"),
            ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
        ],
    );
    child_case("default_conf", &[]);
    child_case(
        "hbm_bytes",
        &[("HBMALLOC_CONF", "policy:hbm,max_waste_percent:0")],
    );
    child_case(
        "no_driver",
        &[("HBMALLOC_CUDA_DRIVER", "/nonexistent/libcuda.so")],
    );
    child_case("no_device", &[("HBM_DOUBLE_NO_DEVICE", "1")]);
    let log = std::env::temp_dir().join(format!("hbmalloc-capi-log-{}.pickle", std::process::id()));
    child_case(
        "log",
        &[(
            "HBMALLOC_CONF",
            &format!("policy:pytorch,log:{},log_entries:200", log.display()),
        )],
    );
    child_case(
        "bad_log_entries",
        &[("HBMALLOC_CONF", "log:/tmp/x.pickle,log_entries:0")],
    );
    child_case(
        "log_entries_without_log",
        &[("HBMALLOC_CONF", "policy:pytorch,log_entries:10")],
    );
    child_case(
        "unused_device",
        &[(
            "HBMALLOC_CONF",
            "policy:pytorch,max_split_size_mb:64,per_process_memory_fraction:0.5",
        )],
    );
}

/// Many threads on many streams through the C ABI, freeing each other's
/// pointers: nothing lost, invariants hold.
#[test]
fn threads_allocate_and_free_concurrently() {
    let _serial = setup();
    let before = stats_map(0).unwrap()["allocation.all.current"];
    let handles: Vec<_> = (0..4usize)
        .map(|t| {
            std::thread::spawn(move || {
                let stream = ((t + 1) * 0x100) as *mut c_void;
                let mut live: Vec<usize> = Vec::new();
                for i in 0..500usize {
                    let size = 512 * (1 + (i * 7 + t) % 64) as isize;
                    let ptr = hbmalloc_alloc(size, 0, stream.cast());
                    assert!(!ptr.is_null(), "{}", last_error());
                    live.push(ptr as usize);
                    if i % 3 == 2 {
                        let victim = live.swap_remove(i % live.len());
                        hbmalloc_free(victim as *mut c_void, 0, 0, stream.cast());
                        assert_eq!(last_status(), Status::Ok as i32, "{}", last_error());
                    }
                }
                live
            })
        })
        .collect();
    // Free every survivor from this thread: frees find their shard.
    for handle in handles {
        for ptr in handle.join().unwrap() {
            hbmalloc_free(ptr as *mut c_void, 0, 0, NO_STREAM.cast());
            assert_ok();
        }
    }
    assert_eq!(stats_map(0).unwrap()["allocation.all.current"], before);
    assert_consistent();
}

/// One seeded program of `ops` calls through the C ABI as a careless or
/// hostile caller makes them: valid and invalid sizes and devices, frees of
/// live, freed, interior, foreign and wrong-device pointers, streams used
/// and recorded, private pools made, held, released, listed and allocated
/// from after their release, memory fractions valid and not, empty_cache
/// and captures at any moment. Every call's status is the one the header promises, and
/// after every call each device's invariants hold, its count of live
/// allocations is the program's and its requested and allocated bytes at
/// least the program's. At the end everything is freed and the statistics
/// are back where they started; `fresh`: this process holds no other
/// allocation, so after `empty_cache` no device holds any memory.
fn hostile_program(seed: u64, ops: usize, fresh: bool) {
    let mut draw = SplitMix64::new(seed);
    // A foreign pointer, on devices that may have no allocator yet (the
    // first program in a process).
    for device in 0..2 {
        hbmalloc_free(0xdead_0000 as *mut c_void, 0, device, NO_STREAM.cast());
        assert_error(Status::UnknownPointer, &["0xdead0000"]);
    }
    let streams = [NO_STREAM, 0x100 as *mut c_void, 0x200 as *mut c_void];
    let before: Vec<(i64, i64, i64)> = (0..2)
        .map(|d| {
            (
                stat(d, "allocation.all.current"),
                stat(d, "requested_bytes.all.current"),
                stat(d, "allocated_bytes.all.current"),
            )
        })
        .collect();
    // Live allocations in the order made: (pointer, device, requested
    // bytes, private pool). Picks go by position, so a seed makes the same
    // calls whatever addresses the driver hands out.
    let mut live: Vec<(usize, i32, i64, Option<usize>)> = Vec::new();
    // Private pools (PyTorch's MempoolId_t pairs) and how many hold each, per
    // device.
    let pools: [(u64, u64); 3] = [(1, 0), (2, 0), (3, 7)];
    let mut holders = [[0u32; 3]; 2];
    let mut freed: Vec<(usize, i32)> = Vec::new();
    let mut capturing = false;
    let context = |op: usize, what: &str| format!("seed {seed} op {op}: {what}: {}", last_error());
    for op in 0..ops {
        let kind = draw.below(100);
        let stream = *draw.pick(&streams);
        match kind {
            0..=44 => {
                let device = *draw.pick(&[0, 0, 0, 1, -1, 2]);
                let size: isize = match draw.below(10) {
                    0 => *draw.pick(&[0, -1, isize::MIN, isize::MAX, 1 << 51]),
                    1..=2 => (1 + draw.below(64 * MIB as u64)) as isize,
                    _ => (1 + draw.below(256 * 1024)) as isize,
                };
                // A third into a private pool, held or not.
                let pool = (draw.below(3) == 0).then(|| draw.below(3) as usize);
                let ptr = match pool {
                    None => hbmalloc_alloc(size, device, stream.cast()),
                    Some(p) => {
                        hbmalloc_pool_alloc(size, device, stream.cast(), pools[p].0, pools[p].1)
                    }
                };
                let what = context(op, &format!("alloc {size} on device {device} in {pool:?}"));
                let held = match pool {
                    None => true,
                    Some(p) => (0..2).contains(&device) && holders[device as usize][p] > 0,
                };
                if size == 0 {
                    assert!(
                        ptr.is_null() && last_status() == Status::Ok as i32,
                        "{what}"
                    );
                } else if size < 0 || size as u64 > hbmalloc::MAX_REQUEST_BYTES {
                    assert!(ptr.is_null(), "{what}");
                    assert_eq!(last_status(), Status::InvalidArgument as i32, "{what}");
                } else if !(0..2).contains(&device) {
                    assert!(ptr.is_null(), "{what}");
                    assert_eq!(last_status(), Status::DeviceOutOfRange as i32, "{what}");
                } else if !held {
                    // An unknown or released pool takes no allocation.
                    assert!(ptr.is_null(), "{what}");
                    assert!(
                        [Status::InvalidArgument as i32, Status::InvalidState as i32]
                            .contains(&last_status()),
                        "{what}"
                    );
                } else if ptr.is_null() {
                    // A memory fraction below what is held, or the capture's
                    // first use of a device: refused, with its own status.
                    assert!(
                        [Status::OutOfMemory as i32, Status::InvalidState as i32]
                            .contains(&last_status()),
                        "{what}"
                    );
                } else {
                    assert_eq!(last_status(), Status::Ok as i32, "{what}");
                    assert!(
                        live.iter().all(|&(p, ..)| p != ptr as usize),
                        "{what}: handed out twice"
                    );
                    live.push((ptr as usize, device, size as i64, pool));
                    freed.retain(|&(p, _)| p != ptr as usize);
                }
            }
            45..=74 => {
                let (ptr, device, expect) = match draw.below(8) {
                    0..=3 if !live.is_empty() => {
                        let (ptr, device, ..) = *draw.pick(&live);
                        (ptr, device, Status::Ok)
                    }
                    4 if !freed.is_empty() => {
                        let (ptr, device) = *draw.pick(&freed);
                        (ptr, device, Status::UnknownPointer)
                    }
                    5 if !live.is_empty() => {
                        let (ptr, device, size, _) = live[0];
                        if size > 1 {
                            (
                                ptr + 1 + draw.below(size as u64 - 1) as usize,
                                device,
                                Status::UnknownPointer,
                            )
                        } else {
                            (ptr, 1 - device, Status::UnknownPointer)
                        }
                    }
                    6 if !live.is_empty() => {
                        let (ptr, device, ..) = live[live.len() - 1];
                        (ptr, 1 - device, Status::UnknownPointer)
                    }
                    7 => (0, 0, Status::Ok),
                    _ => {
                        // A foreign pointer, on a device that may have no
                        // allocator yet, or on none at all.
                        let device = *draw.pick(&[0, 1, 1, -1, 2]);
                        let expect = if (0..2).contains(&device) {
                            Status::UnknownPointer
                        } else {
                            Status::DeviceOutOfRange
                        };
                        (0xdead_0000 + 512 * draw.below(64) as usize, device, expect)
                    }
                };
                hbmalloc_free(ptr as *mut c_void, 0, device, stream.cast());
                let what = context(op, &format!("free {ptr:#x} on device {device}"));
                assert_eq!(last_status(), expect as i32, "{what}");
                if expect == Status::Ok && ptr != 0 {
                    live.retain(|&(p, ..)| p != ptr);
                    freed.push((ptr, device));
                    // At once again: the block may still wait for a stream
                    // it was recorded on, and is freed all the same.
                    if draw.below(4) == 0 {
                        hbmalloc_free(ptr as *mut c_void, 0, device, stream.cast());
                        let what = context(op, &format!("second free of {ptr:#x}"));
                        assert_eq!(last_status(), Status::UnknownPointer as i32, "{what}");
                    }
                }
            }
            75..=84 => {
                let target = if !live.is_empty() && draw.below(4) > 0 {
                    let (ptr, device, ..) = *draw.pick(&live);
                    Some((ptr, device, Status::Ok))
                } else {
                    freed.last().map(|&(p, d)| (p, d, Status::UnknownPointer))
                };
                if let Some((ptr, device, expect)) = target {
                    let code = hbmalloc_record_stream(ptr as *mut c_void, device, stream.cast());
                    let what = context(op, &format!("record_stream {ptr:#x}"));
                    assert_eq!(code, expect as i32, "{what}");
                }
            }
            85..=89 => {
                let device = *draw.pick(&[0, 1]);
                let code = hbmalloc_empty_cache(device);
                // Refused on the capturing device only: a capture is per device.
                let expect = if capturing && device == 0 {
                    Status::InvalidState
                } else {
                    Status::Ok
                };
                assert_eq!(code, expect as i32, "{}", context(op, "empty_cache"));
            }
            90..=94 => {
                let device = *draw.pick(&[0, 1]);
                let fraction = *draw.pick(&[0.05, 0.5, 1.0, f64::NAN, -0.5, 1.5]);
                let code = hbmalloc_set_memory_fraction(fraction, device);
                let expect = if (0.0..=1.0).contains(&fraction) {
                    Status::Ok
                } else {
                    Status::InvalidArgument
                };
                let what = context(op, &format!("set_memory_fraction {fraction}"));
                assert_eq!(code, expect as i32, "{what}");
            }
            95..=97 => {
                let device = *draw.pick(&[0, 1]);
                let p = draw.below(3) as usize;
                let (first, second) = pools[p];
                let held = &mut holders[device as usize][p];
                let what = context(op, &format!("pool {first},{second} on device {device}"));
                match draw.below(4) {
                    0 | 1 => {
                        assert_eq!(
                            hbmalloc_create_or_incref_pool(device, first, second),
                            Status::Ok as i32,
                            "{what}"
                        );
                        *held += 1;
                    }
                    2 => {
                        let code = hbmalloc_release_pool(device, first, second);
                        if *held > 0 {
                            assert_eq!(code, Status::Ok as i32, "{what}");
                            *held -= 1;
                        } else {
                            assert_eq!(code, Status::InvalidArgument as i32, "{what}");
                        }
                    }
                    _ => {
                        let mut count = -1;
                        // SAFETY: `count` is valid for a write.
                        let code =
                            unsafe { hbmalloc_pool_use_count(device, first, second, &mut count) };
                        assert_eq!((code, count), (Status::Ok as i32, *held as i32), "{what}");
                        let in_pool = live
                            .iter()
                            .filter(|&&(_, d, _, q)| d == device && q == Some(p))
                            .count();
                        let mut listed = 0usize;
                        // SAFETY: a null `ptrs` with capacity 0; `listed` is valid.
                        let code = unsafe {
                            hbmalloc_pool_live_allocations(
                                device,
                                first,
                                second,
                                std::ptr::null_mut(),
                                0,
                                &mut listed,
                            )
                        };
                        if code == Status::Ok as i32 {
                            assert_eq!(listed, in_pool, "{what}");
                        } else {
                            // Gone: released by every holder, its last allocation freed.
                            assert_eq!(code, Status::InvalidArgument as i32, "{what}");
                            assert_eq!((*held, in_pool), (0, 0), "{what}");
                        }
                    }
                }
            }
            _ => {
                let code = if capturing {
                    hbmalloc_end_capture(0)
                } else {
                    hbmalloc_begin_capture(0)
                };
                assert_eq!(code, Status::Ok as i32, "{}", context(op, "capture"));
                capturing = !capturing;
                // An end where none is underway (device 1 never captures).
                let code = hbmalloc_end_capture(if capturing { 1 } else { 0 });
                assert_ne!(
                    code,
                    Status::Ok as i32,
                    "{}",
                    context(op, "end of no capture")
                );
            }
        }
        for device in 0..2 {
            check_invariants(device).unwrap_or_else(|e| panic!("seed {seed} op {op}: {e:?}"));
            let (count, bytes) = live
                .iter()
                .filter(|&&(_, d, ..)| d == device)
                .fold((0, 0), |(c, b), &(_, _, size, _)| (c + 1, b + size));
            assert_eq!(
                stat(device, "allocation.all.current") - before[device as usize].0,
                count,
                "seed {seed} op {op}: live allocations on device {device}"
            );
            // As PyTorch's, requested bytes count a freed block until the
            // streams it was recorded on are done with it (then it is no
            // longer active); allocated bytes, rounded, drop at the free.
            let requested = stat(device, "requested_bytes.all.current") - before[device as usize].1;
            let allocated = stat(device, "allocated_bytes.all.current") - before[device as usize].2;
            assert!(
                requested >= bytes && allocated >= bytes && (count > 0 || allocated == 0),
                "seed {seed} op {op}: device {device}: {bytes} B live, {requested} B requested, \
                 {allocated} B allocated"
            );
        }
    }
    if capturing {
        assert_eq!(
            hbmalloc_end_capture(0),
            Status::Ok as i32,
            "{}",
            last_error()
        );
    }
    for (ptr, device, ..) in std::mem::take(&mut live) {
        hbmalloc_free(ptr as *mut c_void, 0, device, NO_STREAM.cast());
        assert_ok();
    }
    for (device, held) in holders.iter().enumerate() {
        for (p, &count) in held.iter().enumerate() {
            for _ in 0..count {
                let (first, second) = pools[p];
                assert_eq!(
                    hbmalloc_release_pool(device as i32, first, second),
                    Status::Ok as i32
                );
            }
        }
    }
    for device in 0..2 {
        assert_eq!(hbmalloc_set_memory_fraction(1.0, device), Status::Ok as i32);
        assert_eq!(
            hbmalloc_empty_cache(device),
            Status::Ok as i32,
            "{}",
            last_error()
        );
        check_invariants(device).unwrap();
        let (count, requested, allocated) = before[device as usize];
        assert_eq!(
            [
                stat(device, "allocation.all.current"),
                stat(device, "requested_bytes.all.current"),
                stat(device, "allocated_bytes.all.current"),
            ],
            [count, requested, allocated],
            "seed {seed}: device {device} after everything was freed"
        );
        if fresh {
            assert_eq!(
                stat(device, "reserved_bytes.all.current"),
                0,
                "seed {seed}: device {device} holds memory with nothing live"
            );
        }
    }
}

/// Seeds for the hostile programs: `HBMALLOC_CAPI_SEEDS` (default 8) of
/// 400 calls each.
fn hostile_seeds() -> u64 {
    std::env::var("HBMALLOC_CAPI_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8)
}

#[test]
fn hostile_call_sequences_break_no_rule() {
    let _serial = setup();
    for seed in 0..hostile_seeds() {
        hostile_program(seed, 400, false);
    }
    for conf in [
        "policy:hbm",
        "policy:hbm,whole_handle_granules:4",
        "policy:pytorch,expandable_segments:True",
    ] {
        child_case("hostile", &[("HBMALLOC_CONF", conf)]);
    }
}

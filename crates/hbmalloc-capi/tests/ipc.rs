//! CUDA IPC through the C ABI, between two real processes on the driver
//! double: an exporter shares allocations in PyTorch's format, an importer
//! maps them and sees their bytes, writes new ones the exporter then sees,
//! and each side gives its memory back, the exporter first (the importer's
//! mapping stays valid until it lets go too). Every descriptor opened on the
//! way is closed again.
//!
//! Each configuration runs in processes of its own (an allocator's
//! configuration is fixed per process): the test re-runs this binary as the
//! importer, which runs it again as the exporter, its child, so that taking
//! the exporter's descriptors (`pidfd_getfd`) is allowed even under Yama's
//! `ptrace_scope` 1. They talk over the exporter's stdin and stdout.

mod support;

use std::ffi::{c_char, c_void};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use hbmalloc_capi::{
    hbmalloc_alloc, hbmalloc_empty_cache, hbmalloc_free, hbmalloc_ipc_close, hbmalloc_ipc_open,
    hbmalloc_ipc_share, hbmalloc_last_error, hbmalloc_last_error_code, Status,
};

/// The role this process plays: "importer" or "exporter".
const ROLE_ENV: &str = "HBMALLOC_IPC_TEST_ROLE";
/// The exporter's `HBMALLOC_CONF`, passed through the importer.
const EXPORTER_CONF_ENV: &str = "HBMALLOC_IPC_TEST_EXPORTER_CONF";
/// Set to 1: the exporter's driver maps whole handles only, as the H100's
/// does (`hbm_double_set_whole_handle_maps`).
const WHOLE_MAPS_ENV: &str = "HBMALLOC_IPC_TEST_WHOLE_MAPS";
const MIB: usize = 1 << 20;
/// What the exporter allocates: a small block, a large one, one over 20 MiB.
const SIZES: [usize; 3] = [1000, 3 * MIB + 5, 25 * MIB];

fn last_error() -> String {
    let mut buf = vec![0u8; 4096];
    // SAFETY: `buf` is valid for `buf.len()` bytes.
    let len = unsafe { hbmalloc_last_error(buf.as_mut_ptr().cast::<c_char>(), buf.len()) };
    buf.truncate((len as usize).min(buf.len() - 1));
    String::from_utf8_lossy(&buf).into_owned()
}

fn assert_ok(what: &str) {
    assert_eq!(hbmalloc_last_error_code(), 0, "{what}: {}", last_error());
}

/// The driver double's own functions, reached in the library hbmalloc loaded.
struct Double {
    _library: libloading::Library,
    fill: extern "C" fn(u64, u8, u64, i32) -> i32,
    read: unsafe extern "C" fn(*mut u8, u64, u64, i32) -> i32,
    live_bytes: extern "C" fn() -> u64,
    live_handles: extern "C" fn() -> u64,
    open_segments: extern "C" fn() -> u64,
    whole_maps: extern "C" fn(bool),
}

impl Double {
    fn load() -> Double {
        // The roles run inside `cargo test`, which holds the build lock: they
        // take the library their parent built rather than build it again.
        let path = std::env::var_os("HBMALLOC_CUDA_DRIVER").expect("set by run_pair");
        // SAFETY: the double is a plain cdylib with no load-time side effects;
        // it is the same library (and state) hbmalloc loaded.
        let library = unsafe { libloading::Library::new(path) }.unwrap();
        // SAFETY: these are the signatures the double exports under these names.
        unsafe {
            Double {
                fill: *library.get(b"hbm_double_fill\0").unwrap(),
                read: *library.get(b"hbm_double_read\0").unwrap(),
                live_bytes: *library.get(b"hbm_double_live_bytes\0").unwrap(),
                live_handles: *library.get(b"hbm_double_live_handles\0").unwrap(),
                open_segments: *library.get(b"hbm_double_open_ipc_segments\0").unwrap(),
                whole_maps: *library.get(b"hbm_double_set_whole_handle_maps\0").unwrap(),
                _library: library,
            }
        }
    }

    fn fill(&self, ptr: u64, value: u8, len: usize) {
        assert_eq!((self.fill)(ptr, value, len as u64, 0), 0, "fill {ptr:#x}");
    }

    /// Whether every byte of `[ptr, ptr + len)` is `value`, as device 0 sees it.
    fn holds(&self, ptr: u64, value: u8, len: usize) -> bool {
        let mut bytes = vec![!value; len];
        // SAFETY: `bytes` is valid for `len` writes.
        let status = unsafe { (self.read)(bytes.as_mut_ptr(), ptr, len as u64, 0) };
        assert_eq!(status, 0, "read {ptr:#x}+{len}");
        bytes.iter().all(|&b| b == value)
    }
}

/// Descriptors open in this process.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

fn share(ptr: *mut c_void) -> (Vec<u8>, u64) {
    let mut handle = vec![0u8; 16];
    let (mut length, mut offset) = (0usize, 0u64);
    loop {
        // SAFETY: `handle` is valid for its length; the outputs are valid.
        unsafe {
            hbmalloc_ipc_share(
                ptr,
                handle.as_mut_ptr().cast(),
                handle.len(),
                &mut length,
                &mut offset,
            )
        };
        assert_ok("share");
        if length <= handle.len() {
            handle.truncate(length);
            return (handle, offset);
        }
        handle.resize(length, 0);
    }
}

fn open(handle: &[u8]) -> Result<u64, (i32, String)> {
    let mut base: *mut c_void = std::ptr::null_mut();
    // SAFETY: `handle` is valid for its length; `base` for a write.
    let status = unsafe { hbmalloc_ipc_open(handle.as_ptr().cast(), handle.len(), 0, &mut base) };
    if status == 0 {
        Ok(base as u64)
    } else {
        Err((status, last_error()))
    }
}

/// Runs the importer (and through it the exporter) for one configuration.
fn run_pair(exporter_conf: &str, importer_conf: &str, whole_maps: bool) {
    let mut command = Command::new(std::env::current_exe().unwrap());
    for var in support::CONFIG_VARS {
        command.env_remove(var);
    }
    let output = command
        .args(["--exact", "ipc_role", "--nocapture", "--test-threads=1"])
        .env("HBMALLOC_CUDA_DRIVER", support::double_path())
        .env("HBMALLOC_CONF", importer_conf)
        .env(EXPORTER_CONF_ENV, exporter_conf)
        .env(WHOLE_MAPS_ENV, if whole_maps { "1" } else { "0" })
        .env(ROLE_ENV, "importer")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains("1 passed"),
        "exporter {exporter_conf}, importer {importer_conf}:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn cuda_malloc_segments_are_shared_with_another_process() {
    run_pair("policy:pytorch", "policy:hbm", false);
}

#[test]
fn expandable_segments_are_shared_with_another_process() {
    run_pair(
        "policy:pytorch,expandable_segments:True",
        "policy:pytorch",
        false,
    );
}

/// On a driver that maps whole handles only (the H100's), policy `hbm`
/// backs blocks with whole handles, which PyTorch's format describes.
#[test]
fn hbm_memory_is_shared_with_another_process() {
    run_pair("policy:hbm", "policy:hbm", true);
}

/// The body of both roles; does nothing in the test process itself.
#[test]
fn ipc_role() {
    match std::env::var(ROLE_ENV).as_deref() {
        Ok("importer") => importer(),
        Ok("exporter") => exporter(),
        _ => {}
    }
}

/// Bad variants of an expandable-segment handle: each must be refused, and
/// leave no descriptor open (the test counts them at the end).
fn refuse_tampered(handle: &[u8]) {
    let count = u64::from_ne_bytes(handle[18..26].try_into().unwrap()) as usize;
    let last = handle.len() - 4;
    // The last descriptor is not the sender's: those before it were taken.
    let mut bogus_fd = handle.to_vec();
    bogus_fd[last..].copy_from_slice(&999_999i32.to_ne_bytes());
    // Handles that are not whole granules: every descriptor was taken.
    let mut bad_size = handle.to_vec();
    bad_size[10..18].copy_from_slice(&4096u64.to_ne_bytes());
    // A process that does not exist.
    let mut bad_pid = handle.to_vec();
    bad_pid[2..6].copy_from_slice(&i32::MAX.to_ne_bytes());
    for (bytes, needle) in [
        (bogus_fd, "cannot take descriptor 999999"),
        (bad_size, "not a whole number of"),
        (bad_pid, "cannot take descriptor"),
    ] {
        let (status, message) = open(&bytes).unwrap_err();
        assert_eq!(
            status,
            Status::DriverError as i32,
            "{count} handles: {message}"
        );
        assert!(message.contains(needle), "{message}");
    }
}

fn importer() {
    let double = Double::load();
    let fds_before = open_fds();
    // Garbage from another process is an error saying what, not a crash.
    assert_eq!(
        open(b"\x02x").unwrap_err().0,
        Status::InvalidArgument as i32
    );
    let (status, message) = open(&[2, b'c', 1, 2, 3]).unwrap_err();
    assert_eq!(status, Status::InvalidArgument as i32, "{message}");
    let (status, message) = open(&[[2, b'c'].as_slice(), &[0x5a; 64]].concat()).unwrap_err();
    assert_eq!(status, Status::DriverError as i32, "{message}");
    let mut exporter = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "ipc_role", "--nocapture", "--test-threads=1"])
        .env("HBMALLOC_CONF", std::env::var(EXPORTER_CONF_ENV).unwrap())
        .env(ROLE_ENV, "exporter")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut to_exporter = exporter.stdin.take().unwrap();
    let mut from_exporter = BufReader::new(exporter.stdout.take().unwrap());
    let mut expect = |word: &str| -> Vec<String> {
        loop {
            let mut line = String::new();
            assert!(
                from_exporter.read_line(&mut line).unwrap() > 0,
                "exporter quit"
            );
            // libtest's "test ipc_role ... " may lead the first line.
            let fields: Vec<String> = line.split_whitespace().map(String::from).collect();
            if let Some(at) = fields.iter().position(|f| f == word) {
                return fields[at..].to_vec();
            }
        }
    };
    let mut opened = Vec::new();
    for _ in SIZES {
        let fields = expect("SHARE");
        let handle = unhex(&fields[1]);
        let offset: u64 = fields[2].parse().unwrap();
        let size: usize = fields[3].parse().unwrap();
        let value: u8 = fields[4].parse().unwrap();
        if handle[1] == b'e' {
            refuse_tampered(&handle);
        }
        let base = open(&handle).unwrap_or_else(|(_, m)| panic!("open: {m}"));
        // The same string again maps nothing new.
        assert_eq!(open(&handle).unwrap(), base);
        assert_eq!(hbmalloc_ipc_close(base as *mut c_void), 0);
        let ptr = base + offset;
        assert!(double.holds(ptr, value, size), "the exporter's bytes");
        double.fill(ptr, value ^ 0xff, size);
        opened.push((base, ptr, size, value ^ 0xff));
    }
    writeln!(to_exporter, "WRITTEN").unwrap();
    expect("RELEASED");
    for &(base, ptr, size, value) in &opened {
        // The exporter let go; this mapping still holds the memory.
        assert!(
            double.holds(ptr, value, size),
            "bytes after the exporter let go"
        );
        assert_eq!(
            hbmalloc_ipc_close(base as *mut c_void),
            0,
            "{}",
            last_error()
        );
    }
    assert_eq!(
        hbmalloc_ipc_close(opened[0].0 as *mut c_void),
        Status::UnknownPointer as i32
    );
    assert_eq!((double.live_handles)(), 0, "imported handles released");
    assert_eq!((double.open_segments)(), 0, "opened segments closed");
    assert_eq!(hbmalloc_capi::ipc::open_count(), 0);
    writeln!(to_exporter, "BYE").unwrap();
    drop(to_exporter);
    // Read to the end, so the exporter's last lines find a reader.
    std::io::Read::read_to_end(&mut from_exporter, &mut Vec::new()).unwrap();
    drop(from_exporter);
    assert!(exporter.wait().unwrap().success(), "the exporter failed");
    assert_eq!(open_fds(), fds_before, "every descriptor taken was closed");
}

fn exporter() {
    let double = Double::load();
    if std::env::var(WHOLE_MAPS_ENV).as_deref() == Ok("1") {
        (double.whole_maps)(true);
    }
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let fds_before = open_fds();
    // A pointer hbmalloc did not hand out cannot be shared.
    let mut length = 0usize;
    let mut offset = 0u64;
    // SAFETY: capacity 0 with a null buffer; the outputs are valid.
    let status = unsafe {
        hbmalloc_ipc_share(
            0x1000 as *mut c_void,
            std::ptr::null_mut(),
            0,
            &mut length,
            &mut offset,
        )
    };
    assert_eq!(status, Status::UnknownPointer as i32);
    assert!(
        last_error().contains("not a live allocation"),
        "{}",
        last_error()
    );
    let mut blocks = Vec::new();
    for (i, size) in SIZES.into_iter().enumerate() {
        let ptr = hbmalloc_alloc(size as isize, 0, std::ptr::null_mut());
        assert_ok("alloc");
        let value = 0x10 + i as u8;
        double.fill(ptr as u64, value, size);
        let (handle, offset) = share(ptr);
        println!("SHARE {} {offset} {size} {value}", hex(&handle));
        blocks.push((ptr, size, value ^ 0xff));
    }
    assert_eq!(lines.next().unwrap().unwrap(), "WRITTEN");
    for &(ptr, size, value) in &blocks {
        assert!(
            double.holds(ptr as u64, value, size),
            "the importer's bytes"
        );
        hbmalloc_free(ptr, 0, 0, std::ptr::null_mut());
        assert_ok("free");
    }
    assert_eq!(hbmalloc_empty_cache(0), 0, "{}", last_error());
    assert_eq!(
        (double.live_bytes)(),
        0,
        "the exporter gave everything back"
    );
    assert_eq!(open_fds(), fds_before, "exports closed with their handles");
    println!("RELEASED");
    assert_eq!(lines.next().unwrap().unwrap(), "BYE");
}

//! Finds (building it if needed) and steers `cuda-driver-double`, the
//! stand-in for libcuda these tests load through `CudaDriver::load_from`.
//!
//! The double keeps its state in the loaded library, one copy per test
//! process, so every test takes [`exclusive`] first: it serialises the tests
//! of this binary and resets the double.

use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard, OnceLock};

use libloading::Library;

/// `target/<profile>/` of the running test binary (`target/<profile>/deps/test-...`).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary knows its path");
    let deps = exe
        .parent()
        .expect("the test binary lives in target/<profile>/deps");
    deps.parent()
        .expect("deps lives in target/<profile>")
        .to_path_buf()
}

fn library_file_name() -> String {
    format!(
        "{}cuda_driver_double{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    )
}

/// Builds the double with the running cargo, into the same target directory
/// and profile as this test. Cargo does nothing when it is already fresh,
/// so an edited double is never tested stale.
fn build_double(profile_dir: &Path) -> Result<(), String> {
    let target_dir = profile_dir.parent().ok_or("profile dir has no parent")?;
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev".to_string(),
        Some(other) => other.to_string(),
    };
    let output = Command::new(env!("CARGO"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["build", "-p", "cuda-driver-double", "--profile", &profile])
        .arg("--target-dir")
        .arg(target_dir)
        .output()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&output.stderr).into_owned())
    }
}

/// The double's library, built once per test process.
pub fn double_path() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = profile_dir();
        let path = dir.join(library_file_name());
        if let Err(why) = build_double(&dir) {
            // A library built earlier still serves; say why it may be stale.
            assert!(path.exists(), "cannot build cuda-driver-double: {why}");
            eprintln!(
                "warning: using existing {}: rebuild failed: {why}",
                path.display()
            );
        }
        path
    })
}

/// The double's control functions (`hbm_double_*`).
pub struct Double {
    reset: extern "C" fn(),
    set_capacity: extern "C" fn(u64),
    fail_nth: unsafe extern "C" fn(*const c_char, u64, i32) -> i32,
    set_events_complete: extern "C" fn(bool),
    set_whole_handle_maps: extern "C" fn(bool),
    set_map_offset_ignored: extern "C" fn(bool),
    fill: extern "C" fn(u64, u8, u64, i32) -> i32,
    read: unsafe extern "C" fn(*mut u8, u64, u64, i32) -> i32,
    complete_all_events: extern "C" fn(),
    call_count: unsafe extern "C" fn(*const c_char) -> u64,
    relaxed_call_count: unsafe extern "C" fn(*const c_char) -> u64,
    capture_mode: extern "C" fn() -> u32,
    set_capture_mode: extern "C" fn(u32) -> i32,
    live_bytes: extern "C" fn() -> u64,
    live_events: extern "C" fn() -> u64,
    primary_context_retains: extern "C" fn(i32) -> u64,
    access_mask: extern "C" fn(u64) -> u32,
    // Keeps the functions above loaded.
    _library: Library,
}

macro_rules! symbol {
    ($library:expr, $name:literal) => {
        // SAFETY: the type is the signature `cuda-driver-double` exports
        // under this name; the pointer is used only while `Double` holds
        // the library.
        *unsafe { $library.get(concat!($name, "\0").as_bytes()) }
            .expect(concat!("the double exports ", $name))
    };
}

impl Double {
    fn load() -> Double {
        // SAFETY: the double's initialisers are Rust statics with constant
        // initialisers; loading it has no other side effect.
        let library = unsafe { Library::new(double_path()) }.expect("the double loads");
        Double {
            reset: symbol!(library, "hbm_double_reset"),
            set_capacity: symbol!(library, "hbm_double_set_capacity"),
            fail_nth: symbol!(library, "hbm_double_fail_nth"),
            set_events_complete: symbol!(library, "hbm_double_set_events_complete"),
            set_whole_handle_maps: symbol!(library, "hbm_double_set_whole_handle_maps"),
            set_map_offset_ignored: symbol!(library, "hbm_double_set_map_offset_ignored"),
            fill: symbol!(library, "hbm_double_fill"),
            read: symbol!(library, "hbm_double_read"),
            complete_all_events: symbol!(library, "hbm_double_complete_all_events"),
            call_count: symbol!(library, "hbm_double_call_count"),
            relaxed_call_count: symbol!(library, "hbm_double_relaxed_call_count"),
            capture_mode: symbol!(library, "hbm_double_capture_mode"),
            set_capture_mode: symbol!(library, "hbm_double_set_capture_mode"),
            live_bytes: symbol!(library, "hbm_double_live_bytes"),
            live_events: symbol!(library, "hbm_double_live_events"),
            primary_context_retains: symbol!(library, "hbm_double_primary_context_retains"),
            access_mask: symbol!(library, "hbm_double_access_mask"),
            _library: library,
        }
    }

    /// Forgets everything (memory, faults, counts); capacity 1 GiB.
    pub fn reset(&self) {
        (self.reset)()
    }

    /// Each device's capacity in bytes.
    pub fn set_capacity(&self, bytes: u64) {
        (self.set_capacity)(bytes)
    }

    /// The `nth` call of `symbol` from now fails with `code`.
    pub fn fail_nth(&self, symbol: &str, nth: u64, code: i32) {
        let name = CString::new(symbol).expect("no nul in a symbol name");
        // SAFETY: `name` is a valid nul-terminated string for the call.
        let status = unsafe { (self.fail_nth)(name.as_ptr(), nth, code) };
        assert_eq!(status, 0, "arming a fault on {symbol}");
    }

    /// With `false`, recorded events stay pending until completed.
    pub fn set_events_complete(&self, complete: bool) {
        (self.set_events_complete)(complete)
    }

    /// With `true`, `cuMemMap` refuses any offset but 0.
    pub fn set_whole_handle_maps(&self, whole: bool) {
        (self.set_whole_handle_maps)(whole)
    }

    /// With `true`, `cuMemMap` takes an offset but maps from the handle's
    /// start (only the data shows it).
    pub fn set_map_offset_ignored(&self, ignored: bool) {
        (self.set_map_offset_ignored)(ignored)
    }

    /// Sets `len` bytes of device 0's memory from `va` to `value`, through
    /// the mappings as the device sees them; the double's status code.
    pub fn fill(&self, va: u64, value: u8, len: usize) -> i32 {
        (self.fill)(va, value, len as u64, 0)
    }

    /// `len` bytes of device 0's memory from `va`, or the double's status
    /// code when they are not all mapped with access.
    pub fn read(&self, va: u64, len: usize) -> Result<Vec<u8>, i32> {
        let mut bytes = vec![0u8; len];
        // SAFETY: `bytes` has room for `len` bytes for the call's duration.
        match unsafe { (self.read)(bytes.as_mut_ptr(), va, len as u64, 0) } {
            0 => Ok(bytes),
            code => Err(code),
        }
    }

    /// Completes every pending event.
    pub fn complete_all_events(&self) {
        (self.complete_all_events)()
    }

    /// Calls of `symbol` since the last reset.
    pub fn call_count(&self, symbol: &str) -> u64 {
        let name = CString::new(symbol).expect("no nul in a symbol name");
        // SAFETY: `name` is a valid nul-terminated string for the call.
        unsafe { (self.call_count)(name.as_ptr()) }
    }

    /// Calls of `symbol` since the last reset made while the calling
    /// thread's stream-capture mode was relaxed.
    pub fn relaxed_call_count(&self, symbol: &str) -> u64 {
        let name = CString::new(symbol).expect("no nul in a symbol name");
        // SAFETY: `name` is a valid nul-terminated string for the call.
        unsafe { (self.relaxed_call_count)(name.as_ptr()) }
    }

    /// The calling thread's stream-capture mode (0 global, 1 thread-local,
    /// 2 relaxed).
    pub fn capture_mode(&self) -> u32 {
        (self.capture_mode)()
    }

    /// Puts the calling thread in stream-capture mode `mode`.
    pub fn set_capture_mode(&self, mode: u32) {
        assert_eq!(
            (self.set_capture_mode)(mode),
            0,
            "setting capture mode {mode}"
        );
    }

    /// Bytes of segments and physical memory held on all devices.
    pub fn live_bytes(&self) -> u64 {
        (self.live_bytes)()
    }

    /// Events created and not destroyed.
    pub fn live_events(&self) -> u64 {
        (self.live_events)()
    }

    /// Outstanding primary-context retains of `device`.
    pub fn primary_context_retains(&self, device: i32) -> u64 {
        (self.primary_context_retains)(device)
    }

    /// Bit `d` set when device `d` may access the mapping at `va`.
    pub fn access_mask(&self, va: u64) -> u32 {
        (self.access_mask)(va)
    }
}

/// Serialises this binary's tests and resets the double for the caller.
pub fn exclusive() -> (MutexGuard<'static, ()>, &'static Double) {
    static SERIAL: Mutex<()> = Mutex::new(());
    static DOUBLE: OnceLock<Double> = OnceLock::new();
    // A failed test poisons the lock; the next one resets the double anyway.
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let double = DOUBLE.get_or_init(Double::load);
    double.reset();
    std::env::remove_var("HBM_DOUBLE_NO_DEVICE");
    std::env::remove_var(hbmalloc_cuda::DRIVER_PATH_ENV);
    (guard, double)
}

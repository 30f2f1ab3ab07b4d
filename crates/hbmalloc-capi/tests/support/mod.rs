//! Builds (with the running cargo) and locates the libraries these tests
//! load: `cuda-driver-double`, the stand-in for libcuda, and this crate's
//! own cdylib for the C test.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// `target/<profile>/` of the running test binary (`target/<profile>/deps/test-...`).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary knows its path");
    exe.parent()
        .and_then(Path::parent)
        .expect("the test binary lives in target/<profile>/deps")
        .to_path_buf()
}

/// The file name of the shared library `name` on this platform.
pub fn library_file_name(name: &str) -> String {
    format!(
        "{}{name}{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    )
}

/// Builds `package` into this test's target directory and profile (cargo
/// does nothing when it is fresh) and returns the path of its cdylib `lib`.
pub fn build_cdylib(package: &str, lib: &str) -> PathBuf {
    let dir = profile_dir();
    let target_dir = dir.parent().expect("profile dir has a parent");
    let profile = match dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev".to_string(),
        Some(other) => other.to_string(),
    };
    let output = Command::new(env!("CARGO"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["build", "-p", package, "--profile", &profile])
        .arg("--target-dir")
        .arg(target_dir)
        .output()
        .expect("cargo runs");
    let path = dir.join(library_file_name(lib));
    if !output.status.success() {
        // A library built earlier still serves; say why it may be stale.
        assert!(
            path.exists(),
            "cannot build {package}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        eprintln!("warning: using existing {}: rebuild failed", path.display());
    }
    path
}

/// The driver double's library, built once per test process.
pub fn double_path() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| build_cdylib("cuda-driver-double", "cuda_driver_double"))
}

/// Every environment variable the C ABI reads, so a child process can start clean.
pub const CONFIG_VARS: [&str; 5] = [
    "HBMALLOC_CONF",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "HBMALLOC_HISTORY_ENTRIES",
    "HBMALLOC_CUDA_DRIVER",
];

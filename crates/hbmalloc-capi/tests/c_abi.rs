//! Compiles `tests/c/abi_test.c` with the system C compiler, and
//! `tests/cxx/throw_test.cc` with the C++ one, against `include/hbmalloc.h`
//! and the built cdylib, and runs them on the driver double: the header and
//! the library agree, and `hbmalloc_torch_alloc`'s failures reach C++ as
//! exceptions.

mod support;

use std::path::Path;
use std::process::Command;

#[test]
fn c_program_compiles_against_the_header_and_runs() {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let library = support::build_cdylib("hbmalloc-capi", "hbmalloc_capi");
    let double = support::double_path();
    let lib_dir = library.parent().unwrap();
    let out_dir = lib_dir.join("hbmalloc-capi-c-test");
    std::fs::create_dir_all(&out_dir).unwrap();
    let exe = out_dir.join("abi_test");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let compile = Command::new(&cc)
        .args(["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic"])
        .arg("-I")
        .arg(manifest.join("include"))
        .arg(manifest.join("tests/c/abi_test.c"))
        .arg("-L")
        .arg(lib_dir)
        .arg("-lhbmalloc_capi")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C compiler {cc}: {e}"));
    assert!(
        compile.status.success(),
        "{cc} failed:\n{}",
        String::from_utf8_lossy(&compile.stderr)
    );
    let snapshot = out_dir.join("abi_test.pickle");
    let mut run = Command::new(&exe);
    for var in support::CONFIG_VARS {
        run.env_remove(var);
    }
    let output = run
        .arg(&snapshot)
        .env("HBMALLOC_CUDA_DRIVER", double)
        .env("HBMALLOC_CONF", "policy:pytorch")
        .env("HBMALLOC_HISTORY_ENTRIES", "1000")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains(", 0 failed"),
        "abi_test failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let trace = hbmalloc_trace::load(&snapshot).unwrap();
    assert!(trace.devices.iter().any(|d| !d.ops.is_empty()));
}

/// `hbmalloc_torch_alloc` (what `hbmalloc.torch.install()` gives PyTorch)
/// throws `std::runtime_error` where `hbmalloc_alloc` returns NULL: out of
/// memory (beginning "CUDA out of memory."), a bad size, a bad device.
#[test]
fn cxx_program_catches_hbmalloc_torch_alloc_failures() {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let library = support::build_cdylib("hbmalloc-capi", "hbmalloc_capi");
    let double = support::double_path();
    let lib_dir = library.parent().unwrap();
    let out_dir = lib_dir.join("hbmalloc-capi-c-test");
    std::fs::create_dir_all(&out_dir).unwrap();
    let exe = out_dir.join("throw_test");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let compile = Command::new(&cxx)
        .args(["-std=c++11", "-Wall", "-Wextra", "-Werror"])
        .arg("-I")
        .arg(manifest.join("include"))
        .arg(manifest.join("tests/cxx/throw_test.cc"))
        .arg("-L")
        .arg(lib_dir)
        .arg("-lhbmalloc_capi")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C++ compiler {cxx}: {e}"));
    assert!(
        compile.status.success(),
        "{cxx} failed:\n{}",
        String::from_utf8_lossy(&compile.stderr)
    );
    let mut run = Command::new(&exe);
    for var in support::CONFIG_VARS {
        run.env_remove(var);
    }
    let output = run.env("HBMALLOC_CUDA_DRIVER", double).output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains(", 0 failed"),
        "throw_test failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

//! Compiles `tests/c/abi_test.c` with the system C compiler, and
//! `tests/cxx/throw_test.cc` with the C++ one, against `include/hbmalloc.h`
//! and the built cdylib, and runs them on the driver double: the header and
//! the library agree, and `hbmalloc_torch_alloc`'s failures reach C++ as
//! exceptions.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Compiles `source` (relative to this crate) with `compiler` (from the
/// environment variable `compiler_var`, else `default`) and `flags` against
/// the header and the cdylib, runs it with `args` and `env` on the driver
/// double (no other configuration variable set) in the directory it was
/// built in, and checks that it reported `", 0 failed"`. Returns that
/// directory.
fn compile_and_run(
    (compiler_var, default): (&str, &str),
    flags: &[&str],
    source: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let library = support::build_cdylib("hbmalloc-capi", "hbmalloc_capi");
    let lib_dir = library.parent().unwrap();
    let out_dir = lib_dir.join("hbmalloc-capi-c-test");
    std::fs::create_dir_all(&out_dir).unwrap();
    let source = manifest.join(source);
    let exe = out_dir.join(source.file_stem().unwrap());
    let compiler = std::env::var(compiler_var).unwrap_or_else(|_| default.to_string());
    let compile = Command::new(&compiler)
        .args(flags)
        .arg("-I")
        .arg(manifest.join("include"))
        .arg(&source)
        .arg("-L")
        .arg(lib_dir)
        .arg("-lhbmalloc_capi")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the compiler {compiler}: {e}"));
    assert!(
        compile.status.success(),
        "{compiler} failed:\n{}",
        String::from_utf8_lossy(&compile.stderr)
    );
    let mut run = Command::new(&exe);
    for var in support::CONFIG_VARS {
        run.env_remove(var);
    }
    let output: Output = run
        .current_dir(&out_dir)
        .args(args)
        .env("HBMALLOC_CUDA_DRIVER", support::double_path())
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains(", 0 failed"),
        "{} failed:\n{stdout}\n{}",
        exe.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    out_dir
}

#[test]
fn c_program_compiles_against_the_header_and_runs() {
    let out_dir = compile_and_run(
        ("CC", "cc"),
        &["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic"],
        "tests/c/abi_test.c",
        &["abi_test.pickle"],
        &[
            ("HBMALLOC_CONF", "policy:pytorch"),
            ("HBMALLOC_HISTORY_ENTRIES", "1000"),
        ],
    );
    let trace = hbmalloc_trace::load(&out_dir.join("abi_test.pickle")).unwrap();
    assert!(trace.devices.iter().any(|d| !d.ops.is_empty()));
}

/// `hbmalloc_torch_alloc` (what `hbmalloc.torch.install()` gives PyTorch)
/// throws `std::runtime_error` where `hbmalloc_alloc` returns NULL: out of
/// memory (beginning "CUDA out of memory."), a bad size, a bad device.
#[test]
fn cxx_program_catches_hbmalloc_torch_alloc_failures() {
    compile_and_run(
        ("CXX", "c++"),
        &["-std=c++11", "-Wall", "-Wextra", "-Werror"],
        "tests/cxx/throw_test.cc",
        &[],
        &[],
    );
}

//! `summary`, `advise`, `report` and `plan` end to end: where memory went,
//! which setting to use, and what a model needs.

use std::path::PathBuf;
use std::process::{Command, Output};

fn hbmalloc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hbmalloc"))
        .args(args)
        .output()
        .expect("run hbmalloc")
}

fn succeed(args: &[&str]) -> String {
    let out = hbmalloc(args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn assert_clear_error(out: &Output, needle: &str) {
    assert!(!out.status.success(), "expected failure");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(needle), "{needle:?} not in:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// A file under `../shared/traces`, or `None` (a failure under `CI=true`).
fn shared(path: &str) -> Option<String> {
    let full = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/traces")
        .join(path);
    if full.exists() {
        return Some(full.to_string_lossy().into_owned());
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{} is missing under CI",
        full.display()
    );
    eprintln!("skipped: {} is missing", full.display());
    None
}

#[test]
fn summary_of_a_snapshot_replays_its_recorded_peak() {
    let Some(path) = shared("pytorch-snapshots/cs336_silmont2000__memory_forward_bf16_128.pickle")
    else {
        return;
    };
    let text = succeed(&["summary", &path]);
    assert!(
        text.contains("PyTorch CUDA memory summary, device ID 0"),
        "{text}"
    );
    assert!(
        text.contains("recorded peak reserved 822.00 MiB, replayed 822.00 MiB"),
        "{text}"
    );
    assert!(
        text.contains("| GPU reserved memory   |    822 MiB |"),
        "{text}"
    );
}

#[test]
fn summary_refuses_what_is_not_a_trace() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.pickle");
    std::fs::write(&path, b"not a pickle").unwrap();
    assert_clear_error(&hbmalloc(&["summary", path.to_str().unwrap()]), "x.pickle");
    assert_clear_error(&hbmalloc(&["summary"]), "required");
}

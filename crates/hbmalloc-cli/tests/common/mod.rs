//! What the CLI's end-to-end tests share: running the binary and checking
//! its success or its one-line error.

use std::process::{Command, Output};

/// Runs hbmalloc with `args`.
pub fn hbmalloc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hbmalloc"))
        .args(args)
        .output()
        .expect("run hbmalloc")
}

/// Runs hbmalloc, asserts it succeeded (showing its stderr if not), and
/// returns its stdout.
pub fn succeed(args: &[&str]) -> String {
    stdout_of_success(hbmalloc(args))
}

/// Asserts `out` is a success (showing its stderr if not) and returns its
/// stdout.
pub fn stdout_of_success(out: Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Asserts a failure whose message is one line that mentions `needle`.
pub fn assert_clear_error(output: &Output, needle: &str) {
    assert!(!output.status.success(), "expected failure, got success");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(needle),
        "stderr should mention {needle:?}:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    let first = stderr.lines().next().unwrap_or("");
    assert!(
        first.starts_with("hbmalloc: error:") || first.starts_with("error:"),
        "{stderr}"
    );
}

/// The lines after a replay's "smallest device on which ..." heading (its
/// report after an out-of-memory error), as (settings, what follows them).
pub fn smallest_devices(text: &str) -> Vec<(&str, &str)> {
    text.lines()
        .skip_while(|l| !l.contains("smallest device on which"))
        .skip(1)
        .take_while(|l| l.starts_with("    "))
        .map(|l| {
            let (settings, needed) = l.trim().split_once(' ').unwrap();
            (settings, needed.trim())
        })
        .collect()
}

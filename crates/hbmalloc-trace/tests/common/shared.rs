//! Finds `shared/traces` beside the repository for the tests that read it
//! (included by path from more than one crate's tests).

use std::path::{Path, PathBuf};

/// The first `shared/traces` directory above `manifest_dir`. Missing, it is
/// `None` on a developer's machine (the caller skips, saying so) and a panic
/// under `CI=true`, so that a CI without the traces fails instead of passing
/// vacuously.
pub fn shared_traces(manifest_dir: &str) -> Option<PathBuf> {
    let found = Path::new(manifest_dir)
        .ancestors()
        .map(|dir| dir.join("shared/traces"))
        .find(|dir| dir.is_dir());
    if found.is_none() {
        let ci = std::env::var("CI").unwrap_or_default();
        assert!(
            ci.is_empty() || ci == "false" || ci == "0",
            "CI={ci}: no shared/traces above {manifest_dir}; these tests need it"
        );
        eprintln!("note: no shared/traces found above {manifest_dir}; skipping");
    }
    found
}

//! Every committed seed of every fuzz target, run as an ordinary test: the
//! targets' code stays built and exercised by `scripts/test` without a
//! fuzzer, and an input a fuzzing run found (saved as a seed) stays fixed.

use std::path::Path;

#[test]
fn every_seed_of_every_target_runs_clean() {
    let seeds = Path::new(env!("CARGO_MANIFEST_DIR")).join("seeds");
    for (target, run) in hbmalloc_fuzz::TARGETS {
        let dir = seeds.join(target);
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|entry| entry.expect("a seed directory entry").path())
            .collect();
        files.sort();
        assert!(!files.is_empty(), "{}: no seeds", dir.display());
        for file in files {
            let data = std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            eprintln!("{target}: {}", file.display());
            run(&data);
        }
    }
}

//! Deterministic simulation tests: seeded GPU programs against every policy
//! configuration, with every check of `hbmalloc::simtest` after every step.
//!
//! - CI mode (default): a fixed number of seeds per configuration.
//! - `HBMALLOC_SIM_SEED=<n>`: replays exactly seed `n` (every configuration).
//! - `HBMALLOC_SIM_SEEDS=<n>`: runs `n` seeds per configuration (long mode);
//!   `HBMALLOC_SIM_FIRST=<n>` starts elsewhere than seed 0.
//! - `HBMALLOC_SIM_TRACE=1`: prints every operation (with `--nocapture`).

use hbmalloc::simtest::{run_seed, SeedReport, SimOptions};

/// The configurations every seed runs under. Add `policy:hbm` settings here
/// when that policy lands.
const SETTINGS: [&str; 3] = [
    "policy:pytorch",
    "policy:pytorch,expandable_segments:True",
    "policy:pytorch,max_split_size_mb:40,garbage_collection_threshold:0.6,per_process_memory_fraction:0.9",
];

/// Seeds per configuration in CI mode.
const CI_SEEDS: u64 = 150;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| {
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number"))
    })
}

fn run(settings: &str, seeds: std::ops::Range<u64>) -> SeedReport {
    let opts = SimOptions {
        trace: std::env::var_os("HBMALLOC_SIM_TRACE").is_some(),
        ..SimOptions::default()
    };
    let mut total = SeedReport::default();
    let count = seeds.end - seeds.start;
    for seed in seeds {
        match run_seed(settings, seed, &opts) {
            Ok(r) => total.add(&r),
            Err(failure) => panic!("{failure}"),
        }
    }
    println!(
        "{settings}: {count} seeds, {} operations checked ({} mallocs, {} OOMs, {} faults armed, {} injected errors, {} kernels)",
        total.ops, total.mallocs, total.ooms, total.faults_armed, total.device_errors, total.uses
    );
    total
}

fn seeds() -> std::ops::Range<u64> {
    if let Some(seed) = env_u64("HBMALLOC_SIM_SEED") {
        return seed..seed + 1;
    }
    let first = env_u64("HBMALLOC_SIM_FIRST").unwrap_or(0);
    first..first + env_u64("HBMALLOC_SIM_SEEDS").unwrap_or(CI_SEEDS)
}

#[test]
fn simulation_pytorch() {
    let total = run(SETTINGS[0], seeds());
    assert!(total.ops > 0);
}

#[test]
fn simulation_pytorch_expandable() {
    let total = run(SETTINGS[1], seeds());
    assert!(total.ops > 0);
}

#[test]
fn simulation_pytorch_gc_fraction() {
    let total = run(SETTINGS[2], seeds());
    assert!(total.ops > 0);
}

/// Seeds that found engine bugs in policy `pytorch` with expandable segments
/// (an unmap or release failing part-way left reserved_bytes disagreeing
/// with the device and pages unmapped behind the books; a failed event
/// synchronization leaked the event; a page a failed undo could not unmap
/// was later mapped over).
#[test]
fn regression_expandable_partial_unmap_seeds() {
    for seed in [0, 6, 29, 39, 516, 1001] {
        if let Err(failure) = run_seed(SETTINGS[1], seed, &SimOptions::default()) {
            panic!("{failure}");
        }
    }
}

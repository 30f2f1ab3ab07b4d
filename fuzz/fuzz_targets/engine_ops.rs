//! Bytes spell a GPU program (allocations, kernels on several streams,
//! record_stream, frees, event completions, empty_cache, memory fractions,
//! injected driver faults) run on a small SimDevice with every check of the
//! simulation harness after every operation.
#![no_main]

use libfuzzer_sys::fuzz_target;

/// The configurations `tests/simulation.rs` runs: both policies, `hbm` with
/// its defaults, with a wide allowance under a limit, with two views per
/// granule at most, and with handles of several granules (on the devices
/// that map whole handles only, which `run_bytes` picks half the time).
const SETTINGS: [&str; 7] = [
    "policy:pytorch",
    "policy:pytorch,expandable_segments:True",
    "policy:pytorch,max_split_size_mb:40,garbage_collection_threshold:0.6,per_process_memory_fraction:0.9",
    "policy:hbm",
    "policy:hbm,max_waste_percent:5,per_process_memory_fraction:0.8",
    "policy:hbm,max_views:2",
    "policy:hbm,whole_handle_granules:3",
];

fuzz_target!(|data: &[u8]| {
    if let Err(failure) = hbmalloc::simtest::run_bytes(&SETTINGS, data) {
        panic!("{failure}");
    }
});

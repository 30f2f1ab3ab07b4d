//! The fuzz targets' bodies, one function each, so that the committed seeds
//! run as ordinary tests (`tests/seeds.rs`) with no fuzzer installed, and
//! `cargo fuzz` explores from the same functions.

/// The configurations `tests/simulation.rs` runs: both policies, `hbm` with
/// its defaults, with a wide allowance under a limit, with two views per
/// granule at most, and with handles of several granules (on the devices
/// that map whole handles only, which `run_bytes` picks half the time).
const ENGINE_SETTINGS: [&str; 7] = [
    "policy:pytorch",
    "policy:pytorch,expandable_segments:True",
    "policy:pytorch,max_split_size_mb:40,garbage_collection_threshold:0.6,per_process_memory_fraction:0.9",
    "policy:hbm",
    "policy:hbm,max_waste_percent:5,per_process_memory_fraction:0.8",
    "policy:hbm,max_views:2",
    "policy:hbm,whole_handle_granules:3",
];

/// Any byte string given to the trace importers is a trace or an error,
/// never a panic; so is running an imported trace's last step again
/// (`--repeat-step`), and laying it out offline (`compare --planned`).
pub fn trace_import(data: &[u8]) {
    if let Ok(trace) = hbmalloc_trace::parse_bytes("fuzz", data) {
        for device in &trace.devices {
            let _ = hbmalloc_trace::repeat_last_step(device, 2);
            let _ = hbmalloc_replay::plan_greedy_by_size(device);
        }
    }
}

/// Any string is a configuration or an error; what parses round-trips.
pub fn config_parse(data: &[u8]) {
    use hbmalloc::{PolicyConfig, PytorchConfig};
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(config) = PytorchConfig::parse(text) {
        let again = PytorchConfig::parse(&config.to_conf_string())
            .unwrap_or_else(|e| panic!("{text:?}: to_conf_string does not parse back: {e}"));
        assert_eq!(config, again, "{text:?}");
        let _ = config.round_size(text.len() as u64 * 4099);
    }
    if let Ok(policy) = PolicyConfig::from_settings(text) {
        let again = PolicyConfig::from_settings(&policy.to_settings())
            .unwrap_or_else(|e| panic!("{text:?}: to_settings does not parse back: {e}"));
        assert_eq!(policy, again, "{text:?}");
    }
}

/// Bytes spell a GPU program (allocations, kernels on several streams,
/// record_stream, frees, event completions, empty_cache, memory fractions,
/// injected driver faults) run on a small SimDevice with every check of the
/// simulation harness after every operation.
pub fn engine_ops(data: &[u8]) {
    if let Err(failure) = hbmalloc::simtest::run_bytes(&ENGINE_SETTINGS, data) {
        panic!("{failure}");
    }
}

/// A fuzz target's body: it panics on a bug, and returns otherwise.
pub type Target = fn(&[u8]);

/// Every target by name, for the seed tests.
pub const TARGETS: [(&str, Target); 3] = [
    ("trace_import", trace_import),
    ("config_parse", config_parse),
    ("engine_ops", engine_ops),
];

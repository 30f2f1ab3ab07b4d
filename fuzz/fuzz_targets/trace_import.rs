//! Any byte string given to the trace importers is a trace or an error, never
//! a panic; so is running an imported trace's last step again
//! (`--repeat-step`), and laying it out offline (`compare --planned`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(trace) = hbmalloc_trace::parse_bytes("fuzz", data) {
        for device in &trace.devices {
            let _ = hbmalloc_trace::repeat_last_step(device, 2);
            let _ = hbmalloc_replay::plan_greedy_by_size(device);
        }
    }
});

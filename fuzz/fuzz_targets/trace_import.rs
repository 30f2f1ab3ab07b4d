//! Any byte string given to the trace importers is a trace or an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = hbmalloc_trace::parse_bytes("fuzz", data);
});

//! libFuzzer's entry point for `hbmalloc_fuzz::engine_ops`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| hbmalloc_fuzz::engine_ops(data));

//! libFuzzer's entry point for `hbmalloc_fuzz::trace_import`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| hbmalloc_fuzz::trace_import(data));

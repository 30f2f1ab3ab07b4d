//! libFuzzer's entry point for `hbmalloc_fuzz::config_parse`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| hbmalloc_fuzz::config_parse(data));

//! Any string is a configuration or an error; what parses round-trips.
#![no_main]

use hbmalloc::{PolicyConfig, PytorchConfig};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
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
});

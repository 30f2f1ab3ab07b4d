//! Temporary minimal configuration; replaced by the full parser on merge.
#![allow(missing_docs)]

const MIB: u64 = 1 << 20;

#[derive(Clone, Debug, PartialEq)]
pub struct PytorchConfig {
    pub max_split_size: u64,
    pub max_non_split_rounding: u64,
    pub large_segment_size: u64,
    pub roundup_power2_divisions: [u64; 16],
    pub garbage_collection_threshold: f64,
    pub expandable_segments: bool,
    pub per_process_memory_fraction: f64,
}

impl Default for PytorchConfig {
    fn default() -> Self {
        PytorchConfig {
            max_split_size: u64::MAX,
            max_non_split_rounding: 20 * MIB,
            large_segment_size: 20 * MIB,
            roundup_power2_divisions: [0; 16],
            garbage_collection_threshold: 0.0,
            expandable_segments: false,
            per_process_memory_fraction: 1.0,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl PytorchConfig {
    pub fn parse(conf: &str) -> Result<Self, ConfigError> {
        let mut c = PytorchConfig::default();
        for kv in conf.split(',').filter(|s| !s.trim().is_empty()) {
            let (k, v) = kv.split_once(':').ok_or_else(|| ConfigError(kv.into()))?;
            match (k.trim(), v.trim()) {
                ("expandable_segments", "True") => c.expandable_segments = true,
                ("expandable_segments", "False") => c.expandable_segments = false,
                ("max_split_size_mb", v) => {
                    c.max_split_size = v.parse::<u64>().map_err(|_| ConfigError(kv.into()))? * MIB
                }
                _ => return Err(ConfigError(format!("unknown {kv}"))),
            }
        }
        Ok(c)
    }

    pub fn round_size(&self, size: u64) -> u64 {
        if size < 512 {
            512
        } else {
            size.div_ceil(512) * 512
        }
    }
}

impl PytorchConfig {
    pub fn to_conf_string(&self) -> String {
        if self.expandable_segments { "expandable_segments:True".into() } else { String::new() }
    }
}

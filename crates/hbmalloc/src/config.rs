//! PyTorch's caching-allocator configuration: `PYTORCH_CUDA_ALLOC_CONF` (or
//! `PYTORCH_ALLOC_CONF`) parsed and validated as PyTorch does, and `round_size`.
//!
//! The rules follow the PyTorch sources (`c10/core/AllocatorConfig.{h,cpp}`,
//! `c10/cuda/CUDAAllocatorConfig.{h,cpp}`, `CUDACachingAllocator.cpp`); where they differ
//! from `shared/reference/pytorch-allocator.md` the source wins and a comment says so.
//!
//! Syntax: `key:value` pairs separated by `,`; list values in `[...]` with `a:b` items
//! separated by `,`. PyTorch's tokenizer drops every whitespace character (so `max_split
//! _size_mb : 20` is `max_split_size_mb:20`) and splits on `,` `:` `[` `]`.
//!
//! Deliberate strictness beyond PyTorch, because PyTorch's leniency there is accidental:
//! - PyTorch's `ConfigTokenizer::checkToken` returns a bool that the parsers ignore, so a
//!   wrong separator (`max_split_size_mb,40`, `a:True:b:False`) goes unnoticed there; here
//!   a missing `:` or `,` is an error.
//! - PyTorch reads integers with `std::stoull`, which ignores trailing garbage (`40abc` is
//!   40) and wraps negatives (`-1` is 2^64 - 1); here an integer is ASCII digits only.
//! - PyTorch reads reals with `std::stod` (trailing garbage ignored); here the whole token
//!   must be a number.

use std::fmt;
use std::str::FromStr;

/// One mebibyte; every `*_mb` key is in these units.
pub const MIB: u64 = 1 << 20;

/// Every request is rounded up to a multiple of this (`kMinBlockSize`).
pub const MIN_BLOCK_SIZE: u64 = 512;

/// Number of `roundup_power2_divisions` intervals: 1 MiB, 2 MiB, ..., 32 GiB and up.
pub const ROUNDUP_POWER2_INTERVALS: usize = 16;

/// log2 of the first `roundup_power2_divisions` interval (1 MiB).
const ROUNDUP_POWER2_FIRST_LOG2: u32 = 20;

/// Default `large_segment_size` and `max_non_split_rounding` (`kLargeBuffer`, 20 MiB).
pub const DEFAULT_LARGE_SEGMENT_SIZE: u64 = 20 * MIB;

/// `large_segment_size_mb` must exceed this (`kMinLargeAlloc / kMB`, 10).
const LARGE_SEGMENT_SIZE_MB_EXCLUSIVE_MIN: u64 = 10;

/// Upper bound of `pinned_num_register_threads` (`pinned_max_register_threads()`).
pub const MAX_PINNED_REGISTER_THREADS: u64 = 128;

/// The environment variable named in error messages.
const ENV_NAME: &str = "PYTORCH_CUDA_ALLOC_CONF";

/// How much virtual address space an expandable segment reserves
/// (`expandable_segments_reserve`), PyTorch's `ExpandableSegmentReserveSpec`.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum ReserveSpec {
    /// A fraction of the device's total memory (`0.5`); positive and finite.
    FractionOfDevice(f64),
    /// An absolute size in GiB (`40G` or `40g`); positive and finite.
    Gib(f64),
}

impl ReserveSpec {
    /// PyTorch's `parseReserveSpec`: `None` for a malformed or non-positive value, which
    /// PyTorch logs and ignores rather than rejecting the whole configuration.
    fn parse(token: &str) -> Option<ReserveSpec> {
        let (number, is_gib) = match token.strip_suffix(['G', 'g']) {
            Some(number) => (number, true),
            None => (token, false),
        };
        let value: f64 = number.parse().ok()?;
        if !value.is_finite() || value <= 0.0 {
            return None;
        }
        Some(if is_gib {
            ReserveSpec::Gib(value)
        } else {
            ReserveSpec::FractionOfDevice(value)
        })
    }

    /// The address space to reserve on a device of `device_total` bytes.
    pub fn bytes(self, device_total: u64) -> u64 {
        match self {
            ReserveSpec::FractionOfDevice(fraction) => (device_total as f64 * fraction) as u64,
            ReserveSpec::Gib(gib) => (gib * (1u64 << 30) as f64) as u64,
        }
    }

    /// The value as written in a configuration string; [`ReserveSpec::parse`] reads it back.
    fn to_conf_value(self) -> String {
        match self {
            ReserveSpec::FractionOfDevice(value) => conf_number(value),
            ReserveSpec::Gib(value) => format!("{}G", conf_number(value)),
        }
    }
}

/// A number as a configuration string writes it: the shorter of Rust's plain
/// and scientific notations, each the shortest that parses back to the same
/// value, so `1e-300` stays short.
pub(crate) fn conf_number(value: f64) -> String {
    let (plain, scientific) = (format!("{value}"), format!("{value:e}"));
    if scientific.len() < plain.len() {
        scientific
    } else {
        plain
    }
}

/// A configuration string PyTorch would reject (or, for separators and number syntax, one
/// this parser rejects more strictly; see the module documentation).
///
/// Displays as one line: `PYTORCH_CUDA_ALLOC_CONF: <key>: expected <rule>, got '<value>'`,
/// followed by a hint when there is one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The key whose value is wrong (or the unknown key itself).
    pub key: String,
    /// The offending token, as written (empty when it is missing).
    pub value: String,
    /// What would have been accepted.
    pub expected: String,
    /// A suggestion for a near miss, such as `use True` for `true`.
    pub hint: Option<String>,
    /// Where the string came from, named in the message
    /// (`PYTORCH_CUDA_ALLOC_CONF` unless set by [`ConfigError::in_source`]).
    pub source: &'static str,
}

impl ConfigError {
    /// An error for `key` whose `value` is not what was `expected`.
    pub fn new(key: &str, value: &str, expected: impl Into<String>) -> Self {
        ConfigError {
            key: key.to_owned(),
            value: value.to_owned(),
            expected: expected.into(),
            hint: None,
            source: ENV_NAME,
        }
    }

    /// Names where the configuration came from (`hbm configuration`, `HBMALLOC_CONF`).
    pub fn in_source(mut self, source: &'static str) -> Self {
        self.source = source;
        self
    }

    pub(crate) fn with_hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `escape_debug` keeps the message on one line whatever the input held.
        write!(
            f,
            "{}: {}: expected {}, got '{}'",
            self.source,
            self.key.escape_debug(),
            self.expected,
            self.value.escape_debug()
        )?;
        if let Some(hint) = &self.hint {
            write!(f, " ({hint})")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

/// PyTorch's allocator configuration: every key the CUDA build accepts, in three kinds.
///
/// - Device-allocator keys, which policy `pytorch` follows: `large_segment_size_mb`,
///   `max_split_size_mb`, `max_non_split_rounding_mb`, `roundup_power2_divisions`,
///   `garbage_collection_threshold`, `expandable_segments`, `expandable_segments_reserve`,
///   `per_process_memory_fraction`.
/// - Keys of the parts of PyTorch hbmalloc does not replace (the pinned host allocator,
///   the lock around `cudaMalloc`): validated, carried into settings and exported
///   snapshots, deciding nothing ([`PASSED_THROUGH_KEYS`]).
/// - Device-allocator features hbmalloc does not implement: accepted only at their
///   default, any other value refused naming the key ([`UNIMPLEMENTED_KEYS`]).
///
/// Byte sizes are stored in bytes even where the key is in MiB, as PyTorch stores them.
#[derive(Clone, Debug, PartialEq)]
pub struct PytorchConfig {
    /// `max_split_size_mb`: blocks at least this large are never split; `u64::MAX` when
    /// unlimited (the default).
    pub max_split_size: u64,
    /// `max_non_split_rounding_mb`: how much larger than an oversize request a cached block
    /// may be and still be used whole. Defaults to `large_segment_size`.
    pub max_non_split_rounding: u64,
    /// `large_segment_size_mb`: the segment a large request under 10 MiB gets, and the large
    /// expandable page. Default 20 MiB.
    pub large_segment_size: u64,
    /// `roundup_power2_divisions`, per interval: index `i` covers sizes in
    /// `[2^(20+i), 2^(21+i))` (index 0 also everything smaller, index 15 everything larger).
    /// 0 or 1 means plain 512-byte rounding.
    pub roundup_power2_divisions: [u64; ROUNDUP_POWER2_INTERVALS],
    /// `garbage_collection_threshold`; 0.0 (the default) disables garbage collection.
    pub garbage_collection_threshold: f64,
    /// `expandable_segments`.
    pub expandable_segments: bool,
    /// `per_process_memory_fraction`, in [0, 1]; default 1.0.
    pub per_process_memory_fraction: f64,
    /// `expandable_segments_reserve`: the address space each expandable segment
    /// reserves; `None` keeps PyTorch's default, 9/8 of device memory.
    pub expandable_segments_reserve: Option<ReserveSpec>,
    /// `release_lock_on_cudamalloc` (alias `release_lock_on_hipmalloc`). Inert: whether
    /// PyTorch holds its lock across `cudaMalloc` decides nothing here; kept so that
    /// recorded snapshots replay and exported ones carry it.
    pub release_lock_on_cudamalloc: bool,
    /// `pinned_use_cuda_host_register` (alias `pinned_use_hip_host_register`).
    pub pinned_use_cuda_host_register: bool,
    /// `pinned_num_register_threads`: a power of two, at most 128; default 1.
    pub pinned_num_register_threads: u64,
    /// `pinned_use_background_threads`.
    pub pinned_use_background_threads: bool,
    /// `pinned_reserve_segment_size_mb`, in MiB; 0 (the default) means not set, and an
    /// explicit value must be positive.
    pub pinned_reserve_segment_size_mb: u64,
    /// `pinned_max_round_threshold_mb`, in MiB; `None` when not set.
    pub pinned_max_round_threshold_mb: Option<u64>,
    /// `pinned_max_cached_size_mb`, in MiB; `None` when not set.
    pub pinned_max_cached_size_mb: Option<u64>,
    /// `pinned_free_catch_all`.
    pub pinned_free_catch_all: bool,
}

impl Default for PytorchConfig {
    fn default() -> Self {
        PytorchConfig {
            max_split_size: u64::MAX,
            max_non_split_rounding: DEFAULT_LARGE_SEGMENT_SIZE,
            large_segment_size: DEFAULT_LARGE_SEGMENT_SIZE,
            roundup_power2_divisions: [0; ROUNDUP_POWER2_INTERVALS],
            garbage_collection_threshold: 0.0,
            expandable_segments: false,
            per_process_memory_fraction: 1.0,
            expandable_segments_reserve: None,
            release_lock_on_cudamalloc: false,
            pinned_use_cuda_host_register: false,
            pinned_num_register_threads: 1,
            pinned_use_background_threads: false,
            pinned_reserve_segment_size_mb: 0,
            pinned_max_round_threshold_mb: None,
            pinned_max_cached_size_mb: None,
            pinned_free_catch_all: false,
        }
    }
}

/// A value after the `:`: one token, or a bracketed list of `a:b` items.
enum ConfValue {
    Token(String),
    List(Vec<(String, String)>),
}

/// One `key:value` entry of the configuration string.
struct ConfEntry {
    key: String,
    value: ConfValue,
}

impl ConfEntry {
    /// The single-token value, or an error naming what `key` expects instead of a list.
    fn token(&self, expected: &str) -> Result<&str, ConfigError> {
        match &self.value {
            ConfValue::Token(token) => Ok(token),
            ConfValue::List(_) => Err(ConfigError::new(&self.key, "[", expected)),
        }
    }

    /// The list value, or an error for a single token.
    fn list(&self, expected: &str) -> Result<&[(String, String)], ConfigError> {
        match &self.value {
            ConfValue::List(items) => Ok(items),
            ConfValue::Token(token) => Err(ConfigError::new(&self.key, token, expected)),
        }
    }
}

/// Whether `c` is whitespace to C's `isspace` in the "C" locale, which PyTorch's tokenizer
/// drops (`char::is_ascii_whitespace` leaves out the vertical tab).
fn is_c_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\x0b' | '\x0c' | '\r')
}

/// PyTorch's `ConfigTokenizer`: whitespace dropped, `,` `:` `[` `]` each their own token,
/// everything between them one token.
fn tokenize(conf: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    let mut buffer = String::new();
    for c in conf.chars() {
        if matches!(c, ',' | ':' | '[' | ']') {
            if !buffer.is_empty() {
                tokens.push(std::mem::take(&mut buffer));
            }
            tokens.push(c.to_string());
        } else if !is_c_space(c) {
            buffer.push(c);
        }
    }
    if !buffer.is_empty() {
        tokens.push(buffer);
    }
    tokens
}

fn is_separator(token: &str) -> bool {
    matches!(token, "," | ":" | "[" | "]")
}

/// Reads tokens in order, with errors that name the key being parsed.
struct TokenCursor {
    tokens: Vec<String>,
    position: usize,
}

impl TokenCursor {
    fn next(&mut self) -> Option<&str> {
        let token = self.tokens.get(self.position)?;
        self.position += 1;
        Some(token)
    }

    fn peek(&self) -> Option<&str> {
        self.tokens.get(self.position).map(String::as_str)
    }

    /// Consumes `separator` or fails with `expected` for `key`.
    fn expect(&mut self, key: &str, separator: &str, expected: &str) -> Result<(), ConfigError> {
        match self.next() {
            Some(token) if token == separator => Ok(()),
            found => Err(ConfigError::new(key, found.unwrap_or(""), expected)),
        }
    }

    /// A plain (non-separator) token, or an error for `key`.
    fn plain(&mut self, key: &str, expected: &str) -> Result<String, ConfigError> {
        match self.next() {
            Some(token) if !is_separator(token) => Ok(token.to_owned()),
            found => Err(ConfigError::new(key, found.unwrap_or(""), expected)),
        }
    }
}

/// Splits the string into entries: `key:value` or `key:[a:b,...]`, separated by `,`.
/// A trailing `,` is accepted, as PyTorch accepts it.
fn split_entries(conf: &str) -> Result<Vec<ConfEntry>, ConfigError> {
    let mut cursor = TokenCursor {
        tokens: tokenize(conf),
        position: 0,
    };
    let mut entries = Vec::new();
    while let Some(key) = cursor.peek() {
        let key = key.to_owned();
        if is_separator(&key) {
            return Err(ConfigError::new(
                "configuration",
                &key,
                "a key such as expandable_segments",
            ));
        }
        cursor.position += 1;
        cursor.expect(&key, ":", "':' and a value after the key")?;
        let value = if cursor.peek() == Some("[") {
            cursor.position += 1;
            let mut items = Vec::new();
            while cursor.peek() != Some("]") {
                let item_key = cursor.plain(&key, "a list item 'name:value' or ']'")?;
                cursor.expect(&key, ":", "':' inside a list item")?;
                let item_value = cursor.plain(&key, "a value inside a list item")?;
                items.push((item_key, item_value));
                match cursor.peek() {
                    Some(",") => cursor.position += 1,
                    Some("]") => {}
                    found => {
                        return Err(ConfigError::new(
                            &key,
                            found.unwrap_or(""),
                            "',' or ']' after a list item",
                        ))
                    }
                }
            }
            cursor.position += 1; // the closing ']'
            ConfValue::List(items)
        } else {
            ConfValue::Token(cursor.plain(&key, "a value after ':'")?)
        };
        entries.push(ConfEntry { key, value });
        if cursor.peek().is_some() {
            cursor.expect(&entries[entries.len() - 1].key, ",", "',' between entries")?;
        }
    }
    Ok(entries)
}

/// A non-negative decimal integer that fits in 64 bits.
fn parse_unsigned(key: &str, token: &str, what: &str) -> Result<u64, ConfigError> {
    if token.is_empty() || !token.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ConfigError::new(key, token, what));
    }
    token
        .parse()
        .map_err(|_| ConfigError::new(key, token, format!("{what} below 2^64")))
}

/// A real number (`std::stod`'s job in PyTorch); NaN is left to the range checks, which
/// it fails. `-0` is zero, so that it is written back as `0`.
pub(crate) fn parse_real(key: &str, token: &str, what: &str) -> Result<f64, ConfigError> {
    token
        .parse::<f64>()
        .map(|value| value + 0.0)
        .map_err(|_| ConfigError::new(key, token, what))
}

/// Exactly `True` or `False`, PyTorch's `ConfigTokenizer::toBool`.
fn parse_bool(key: &str, token: &str) -> Result<bool, ConfigError> {
    match token {
        "True" => Ok(true),
        "False" => Ok(false),
        _ => {
            let error = ConfigError::new(key, token, "True or False");
            Err(if token.eq_ignore_ascii_case("true") {
                error.with_hint("use True")
            } else if token.eq_ignore_ascii_case("false") {
                error.with_hint("use False")
            } else {
                error
            })
        }
    }
}

/// A size in MiB with an inclusive lower bound, stored in bytes as PyTorch stores it: the
/// MiB count is clamped to `u64::MAX / MiB` first, so the product cannot overflow (and
/// "unlimited" written as a huge number is `(2^44 - 1) MiB`, not `u64::MAX`).
fn parse_mib_at_least(key: &str, token: &str, minimum_mb: u64) -> Result<u64, ConfigError> {
    let expected = format!("an integer number of MiB >= {minimum_mb}");
    let megabytes = parse_unsigned(key, token, &expected)?;
    if megabytes < minimum_mb {
        return Err(ConfigError::new(key, token, expected));
    }
    Ok(megabytes.min(u64::MAX / MIB) * MIB)
}

fn parse_power_of_two_or_zero(key: &str, token: &str) -> Result<u64, ConfigError> {
    let expected = "a power of two, or 0 to disable rounding";
    let value = parse_unsigned(key, token, expected)?;
    if value != 0 && !value.is_power_of_two() {
        return Err(ConfigError::new(key, token, expected));
    }
    Ok(value)
}

/// Keys read by PyTorch's host allocator or its locking, which stay PyTorch's when
/// hbmalloc is the device allocator: accepted and carried along, deciding nothing here.
pub const PASSED_THROUGH_KEYS: &[&str] = &[
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
    "pinned_max_round_threshold_mb",
    "pinned_max_cached_size_mb",
    "pinned_free_catch_all",
];

/// Device-allocator keys hbmalloc does not implement, each with the only value it
/// accepts (PyTorch's default); any other value is refused with an error naming the key.
pub const UNIMPLEMENTED_KEYS: &[(&str, &str)] = &[
    ("backend", "native"),
    ("throw_on_cudamalloc_oom", "False"),
    ("graph_capture_record_stream_reuse", "False"),
    ("expandable_segments_reserve_by_class", "[]"),
];

/// The keys a CUDA build of PyTorch accepts: the common `AcceleratorAllocatorConfig` keys,
/// then `CUDAAllocatorConfig`'s, then the pinned-memory size keys.
pub const KNOWN_KEYS: &[&str] = &[
    "large_segment_size_mb",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "pinned_use_background_threads",
    "backend",
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse",
    "per_process_memory_fraction",
    "pinned_free_catch_all",
    "throw_on_cudamalloc_oom",
    "expandable_segments_reserve",
    "expandable_segments_reserve_by_class",
    // In the reference sheet; not in the PyTorch sources we could read (which predate
    // them), though PyTorch 2.13+ users set them. Accepted as plain MiB counts.
    "pinned_max_round_threshold_mb",
    "pinned_max_cached_size_mb",
];

impl PytorchConfig {
    /// The statistics of an allocator that has not allocated: zeros, and
    /// `max_split_size` as configured (-1: unlimited).
    pub fn initial_stats(&self) -> crate::stats::DeviceStats {
        crate::stats::DeviceStats {
            max_split_size: if self.max_split_size == u64::MAX {
                -1
            } else {
                self.max_split_size as i64
            },
            ..Default::default()
        }
    }

    /// Parses a `PYTORCH_CUDA_ALLOC_CONF` string. The empty string gives the defaults.
    ///
    /// Keys apply in order, so a repeated key keeps its last value, except that
    /// `large_segment_size_mb` is applied before everything else (as PyTorch does: the
    /// lower bounds of `max_split_size_mb` and `max_non_split_rounding_mb` are the large
    /// segment size) and that repeated `roundup_power2_divisions` lists update the same
    /// table rather than starting over.
    pub fn parse(conf: &str) -> Result<Self, ConfigError> {
        let entries = split_entries(conf)?;
        let mut config = PytorchConfig::default();
        for entry in entries
            .iter()
            .filter(|entry| entry.key == "large_segment_size_mb")
        {
            // The reference sheet's "> 10" matches the source (`kMinLargeAlloc / kMB`).
            let expected =
                format!("an integer number of MiB > {LARGE_SEGMENT_SIZE_MB_EXCLUSIVE_MIN}");
            let token = entry.token(&expected)?;
            let megabytes = parse_unsigned(&entry.key, token, &expected)?;
            if megabytes <= LARGE_SEGMENT_SIZE_MB_EXCLUSIVE_MIN {
                return Err(ConfigError::new(&entry.key, token, expected));
            }
            config.large_segment_size = megabytes.min(u64::MAX / MIB) * MIB;
        }
        config.max_non_split_rounding = config.large_segment_size;
        for entry in &entries {
            config.apply(entry)?;
        }
        Ok(config)
    }

    /// Applies one entry other than `large_segment_size_mb` (already applied).
    fn apply(&mut self, entry: &ConfEntry) -> Result<(), ConfigError> {
        let key = entry.key.as_str();
        let bool_value = || {
            entry
                .token("True or False")
                .and_then(|t| parse_bool(key, t))
        };
        match key {
            "large_segment_size_mb" => {}
            "max_split_size_mb" | "max_non_split_rounding_mb" => {
                // The reference sheet says "must be >= 20"; the source's bound is the large
                // segment size in MiB, which is 20 only by default.
                let minimum_mb = self.large_segment_size / MIB;
                let expected = format!("an integer number of MiB >= {minimum_mb}");
                let bytes = parse_mib_at_least(key, entry.token(&expected)?, minimum_mb)?;
                if key == "max_split_size_mb" {
                    self.max_split_size = bytes;
                } else {
                    self.max_non_split_rounding = bytes;
                }
            }
            "garbage_collection_threshold" => {
                let expected = "a number strictly between 0 and 1";
                let token = entry.token(expected)?;
                let value = parse_real(key, token, expected)?;
                if !(value > 0.0 && value < 1.0) {
                    return Err(ConfigError::new(key, token, expected));
                }
                self.garbage_collection_threshold = value;
            }
            "roundup_power2_divisions" => self.apply_roundup_power2_divisions(entry)?,
            "expandable_segments" => self.expandable_segments = bool_value()?,
            "pinned_use_background_threads" => self.pinned_use_background_threads = bool_value()?,
            "backend" => {
                // `hipMallocAsync` is accepted only by ROCm builds.
                let expected = "native or cudaMallocAsync";
                match entry.token(expected)? {
                    "native" => {}
                    "cudaMallocAsync" => return Err(unimplemented(key, "cudaMallocAsync")),
                    other => return Err(ConfigError::new(key, other, expected)),
                }
            }
            "release_lock_on_cudamalloc" | "release_lock_on_hipmalloc" => {
                self.release_lock_on_cudamalloc = bool_value()?;
            }
            "pinned_use_cuda_host_register" | "pinned_use_hip_host_register" => {
                self.pinned_use_cuda_host_register = bool_value()?;
            }
            "pinned_num_register_threads" => {
                let expected = format!("a power of two <= {MAX_PINNED_REGISTER_THREADS}");
                let token = entry.token(&expected)?;
                let threads = parse_unsigned(key, token, &expected)?;
                if !threads.is_power_of_two() || threads > MAX_PINNED_REGISTER_THREADS {
                    return Err(ConfigError::new(key, token, expected));
                }
                self.pinned_num_register_threads = threads;
            }
            "pinned_reserve_segment_size_mb" => {
                let expected = "a positive integer number of MiB";
                let token = entry.token(expected)?;
                let megabytes = parse_unsigned(key, token, expected)?;
                if megabytes == 0 {
                    return Err(ConfigError::new(key, token, expected));
                }
                self.pinned_reserve_segment_size_mb = megabytes;
            }
            "pinned_max_round_threshold_mb" | "pinned_max_cached_size_mb" => {
                let expected = "a non-negative integer number of MiB";
                let megabytes = parse_unsigned(key, entry.token(expected)?, expected)?;
                if key == "pinned_max_round_threshold_mb" {
                    self.pinned_max_round_threshold_mb = Some(megabytes);
                } else {
                    self.pinned_max_cached_size_mb = Some(megabytes);
                }
            }
            "graph_capture_record_stream_reuse" | "throw_on_cudamalloc_oom" => {
                if bool_value()? {
                    return Err(unimplemented(key, "True"));
                }
            }
            "per_process_memory_fraction" => {
                let expected = "a number between 0 and 1 inclusive";
                let token = entry.token(expected)?;
                let value = parse_real(key, token, expected)?;
                if !(0.0..=1.0).contains(&value) {
                    return Err(ConfigError::new(key, token, expected));
                }
                self.per_process_memory_fraction = value;
            }
            "pinned_free_catch_all" => self.pinned_free_catch_all = bool_value()?,
            "expandable_segments_reserve" => {
                // PyTorch logs a malformed reserve and keeps the previous value instead of
                // failing; so do we.
                let token = entry.token("a positive fraction like 0.5 or a size like 40G")?;
                if let Some(spec) = ReserveSpec::parse(token) {
                    self.expandable_segments_reserve = Some(spec);
                }
            }
            "expandable_segments_reserve_by_class" => {
                let items = entry.list("a list [name:value,...]")?;
                if let Some((name, value)) = items.first() {
                    return Err(unimplemented(key, &format!("[{name}:{value}...]")));
                }
            }
            unknown => {
                return Err(ConfigError::new(
                    unknown,
                    unknown,
                    format!("a known key (one of {})", KNOWN_KEYS.join(", ")),
                ));
            }
        }
        Ok(())
    }

    /// `roundup_power2_divisions:N` (all intervals; N a power of two, 0 rejected) or
    /// `roundup_power2_divisions:[MB:N,...,>:N]` (per interval; N a power of two or 0).
    fn apply_roundup_power2_divisions(&mut self, entry: &ConfEntry) -> Result<(), ConfigError> {
        let key = entry.key.as_str();
        let divisions = &mut self.roundup_power2_divisions;
        let items = match &entry.value {
            ConfValue::Token(token) => {
                // The single-value form rejects 0, unlike the list form (source:
                // "For roundups, the divisions has to be power of 2").
                let expected = "a power of two, or a list [MB:divisions,...,>:divisions]";
                let value = parse_unsigned(key, token, expected)?;
                if !value.is_power_of_two() {
                    return Err(ConfigError::new(key, token, expected));
                }
                *divisions = [value; ROUNDUP_POWER2_INTERVALS];
                return Ok(());
            }
            ConfValue::List(items) => items,
        };
        let mut first_boundary = true;
        let mut last_index = 0usize;
        for (boundary_token, value_token) in items {
            let value = parse_power_of_two_or_zero(key, value_token)?;
            if boundary_token == ">" {
                // Everything after the last boundary given. The source fills from
                // `last_index + 1`, so a leading `>:N` leaves the first interval alone.
                divisions[(last_index + 1).min(ROUNDUP_POWER2_INTERVALS)..].fill(value);
                continue;
            }
            let expected = "an interval boundary in MB that is a power of two, or '>'";
            let boundary = parse_unsigned(key, boundary_token, expected)?;
            if !boundary.is_power_of_two() {
                return Err(ConfigError::new(key, boundary_token, expected));
            }
            let index = (boundary.ilog2() as usize).min(ROUNDUP_POWER2_INTERVALS - 1);
            if first_boundary {
                // The first boundary also covers every interval below it.
                divisions[..index].fill(value);
                first_boundary = false;
            }
            divisions[index] = value;
            last_index = index;
        }
        Ok(())
    }

    /// The `roundup_power2_divisions` entry for `size` bytes: interval
    /// `floor(log2(size)) - 20`, clamped to the table.
    ///
    /// `size == 0` maps to the last interval, as in PyTorch (where `63 - clz(0)` wraps);
    /// `round_size` never asks for it.
    pub fn roundup_power2_divisions_for(&self, size: u64) -> u64 {
        let index = match size.checked_ilog2() {
            None => ROUNDUP_POWER2_INTERVALS - 1,
            Some(log2) => log2.saturating_sub(ROUNDUP_POWER2_FIRST_LOG2) as usize,
        };
        self.roundup_power2_divisions[index.min(ROUNDUP_POWER2_INTERVALS - 1)]
    }

    /// PyTorch's `round_size`: the block size a request of `size` bytes gets.
    ///
    /// At least 512 bytes; a multiple of 512; and when the size's interval has `d > 1`
    /// divisions and `size > 512 * d`, the next multiple of `floor_pow2(size) / d` (a power
    /// of two stays as it is). Sizes within 511 bytes of `u64::MAX`, which no device can
    /// hold, saturate to `u64::MAX` where PyTorch would wrap.
    pub fn round_size(&self, size: u64) -> u64 {
        if size < MIN_BLOCK_SIZE {
            return MIN_BLOCK_SIZE;
        }
        let divisions = self.roundup_power2_divisions_for(size);
        let above_division_floor = MIN_BLOCK_SIZE
            .checked_mul(divisions)
            .is_some_and(|floor| size > floor);
        if divisions > 1 && above_division_floor {
            roundup_power2_next_division(size, divisions)
        } else {
            size.div_ceil(MIN_BLOCK_SIZE).saturating_mul(MIN_BLOCK_SIZE)
        }
    }

    /// The configuration as a `PYTORCH_CUDA_ALLOC_CONF` string naming only the keys that
    /// differ from the defaults; [`PytorchConfig::parse`] reads it back to an equal value
    /// for every configuration `parse` can produce.
    pub fn to_conf_string(&self) -> String {
        let defaults = PytorchConfig::default();
        let mut parts: Vec<String> = Vec::new();
        if self.large_segment_size != defaults.large_segment_size {
            parts.push(format!(
                "large_segment_size_mb:{}",
                self.large_segment_size / MIB
            ));
        }
        if self.max_split_size != defaults.max_split_size {
            parts.push(format!("max_split_size_mb:{}", self.max_split_size / MIB));
        }
        // Its default follows the large segment size.
        if self.max_non_split_rounding != self.large_segment_size {
            parts.push(format!(
                "max_non_split_rounding_mb:{}",
                self.max_non_split_rounding / MIB
            ));
        }
        if self.roundup_power2_divisions != defaults.roundup_power2_divisions {
            parts.push(self.roundup_power2_divisions_conf());
        }
        if self.garbage_collection_threshold != defaults.garbage_collection_threshold {
            parts.push(format!(
                "garbage_collection_threshold:{}",
                conf_number(self.garbage_collection_threshold)
            ));
        }
        push_bool(
            &mut parts,
            "expandable_segments",
            self.expandable_segments,
            defaults.expandable_segments,
        );
        if self.per_process_memory_fraction != defaults.per_process_memory_fraction {
            parts.push(format!(
                "per_process_memory_fraction:{}",
                conf_number(self.per_process_memory_fraction)
            ));
        }
        push_bool(
            &mut parts,
            "release_lock_on_cudamalloc",
            self.release_lock_on_cudamalloc,
            defaults.release_lock_on_cudamalloc,
        );
        if let Some(spec) = self.expandable_segments_reserve {
            parts.push(format!(
                "expandable_segments_reserve:{}",
                spec.to_conf_value()
            ));
        }
        push_bool(
            &mut parts,
            "pinned_use_cuda_host_register",
            self.pinned_use_cuda_host_register,
            defaults.pinned_use_cuda_host_register,
        );
        if self.pinned_num_register_threads != defaults.pinned_num_register_threads {
            parts.push(format!(
                "pinned_num_register_threads:{}",
                self.pinned_num_register_threads
            ));
        }
        push_bool(
            &mut parts,
            "pinned_use_background_threads",
            self.pinned_use_background_threads,
            defaults.pinned_use_background_threads,
        );
        if self.pinned_reserve_segment_size_mb != defaults.pinned_reserve_segment_size_mb {
            parts.push(format!(
                "pinned_reserve_segment_size_mb:{}",
                self.pinned_reserve_segment_size_mb
            ));
        }
        if let Some(megabytes) = self.pinned_max_round_threshold_mb {
            parts.push(format!("pinned_max_round_threshold_mb:{megabytes}"));
        }
        if let Some(megabytes) = self.pinned_max_cached_size_mb {
            parts.push(format!("pinned_max_cached_size_mb:{megabytes}"));
        }
        push_bool(
            &mut parts,
            "pinned_free_catch_all",
            self.pinned_free_catch_all,
            defaults.pinned_free_catch_all,
        );
        parts.join(",")
    }

    /// `roundup_power2_divisions` in its shortest exact form: one number when every
    /// interval agrees (and it is not 0, which that form rejects), else every interval
    /// listed by its boundary in MB.
    fn roundup_power2_divisions_conf(&self) -> String {
        let divisions = &self.roundup_power2_divisions;
        if divisions[0] != 0 && divisions.iter().all(|&d| d == divisions[0]) {
            return format!("roundup_power2_divisions:{}", divisions[0]);
        }
        let items: Vec<String> = divisions
            .iter()
            .enumerate()
            .map(|(index, value)| format!("{}:{value}", 1u64 << index))
            .collect();
        format!("roundup_power2_divisions:[{}]", items.join(","))
    }
}

impl FromStr for PytorchConfig {
    type Err = ConfigError;

    fn from_str(conf: &str) -> Result<Self, Self::Err> {
        PytorchConfig::parse(conf)
    }
}

/// The error for a non-default `value` of one of [`UNIMPLEMENTED_KEYS`].
fn unimplemented(key: &str, value: &str) -> ConfigError {
    let default = UNIMPLEMENTED_KEYS
        .iter()
        .find(|(name, _)| *name == key)
        .map_or("its default", |(_, default)| default);
    ConfigError::new(
        key,
        value,
        format!("{default} (hbmalloc does not implement {key})"),
    )
}

/// Appends `key:True`/`key:False` when `value` is not the default.
fn push_bool(parts: &mut Vec<String>, key: &str, value: bool, default: bool) {
    if value != default {
        parts.push(format!("{key}:{}", if value { "True" } else { "False" }));
    }
}

/// PyTorch's `roundup_power2_next_division`: `size` rounded up to the next multiple of
/// `floor_pow2(size) / divisions`; powers of two are returned unchanged. The caller
/// guarantees `divisions >= 2`.
fn roundup_power2_next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let power2_floor = 1u64 << size.ilog2();
    let step = power2_floor >> divisions.ilog2();
    if step == 0 {
        return power2_floor.saturating_mul(2);
    }
    let rounded_down = size & !(step - 1);
    if rounded_down == size {
        size
    } else {
        rounded_down.saturating_add(step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(conf: &str) -> PytorchConfig {
        PytorchConfig::parse(conf).unwrap_or_else(|error| panic!("{conf:?}: {error}"))
    }

    fn error(conf: &str) -> ConfigError {
        match PytorchConfig::parse(conf) {
            Ok(config) => panic!("{conf:?} was accepted: {config:?}"),
            Err(error) => error,
        }
    }

    fn with_divisions(divisions: u64) -> PytorchConfig {
        PytorchConfig {
            roundup_power2_divisions: [divisions; ROUNDUP_POWER2_INTERVALS],
            ..PytorchConfig::default()
        }
    }

    #[test]
    fn empty_and_blank_strings_give_the_defaults() {
        assert_eq!(parse(""), PytorchConfig::default());
        assert_eq!(parse(" \t\n"), PytorchConfig::default());
        let defaults = PytorchConfig::default();
        assert_eq!(defaults.max_split_size, u64::MAX);
        assert_eq!(defaults.max_non_split_rounding, 20 * MIB);
        assert_eq!(defaults.large_segment_size, 20 * MIB);
        assert_eq!(defaults.per_process_memory_fraction, 1.0);
        assert_eq!(defaults.pinned_num_register_threads, 1);
        assert_eq!("".parse::<PytorchConfig>(), Ok(defaults));
    }

    #[test]
    fn every_implemented_and_passed_through_key_is_accepted() {
        let config = parse(
            "large_segment_size_mb:32,max_split_size_mb:64,\
             max_non_split_rounding_mb:40,roundup_power2_divisions:[256:1,512:2,>:8],\
             garbage_collection_threshold:0.6,expandable_segments:True,\
             pinned_use_background_threads:True,release_lock_on_cudamalloc:True,\
             pinned_use_cuda_host_register:True,pinned_num_register_threads:8,\
             pinned_reserve_segment_size_mb:64,\
             per_process_memory_fraction:0.5,pinned_free_catch_all:True,\
             expandable_segments_reserve:40G,\
             pinned_max_round_threshold_mb:128,pinned_max_cached_size_mb:0",
        );
        assert_eq!(config.large_segment_size, 32 * MIB);
        assert_eq!(config.max_split_size, 64 * MIB);
        assert_eq!(config.max_non_split_rounding, 40 * MIB);
        assert_eq!(config.garbage_collection_threshold, 0.6);
        assert!(config.expandable_segments);
        assert!(config.pinned_use_background_threads);
        assert!(config.release_lock_on_cudamalloc);
        assert!(config.pinned_use_cuda_host_register);
        assert_eq!(config.pinned_num_register_threads, 8);
        assert_eq!(config.pinned_reserve_segment_size_mb, 64);
        assert_eq!(config.per_process_memory_fraction, 0.5);
        assert!(config.pinned_free_catch_all);
        assert_eq!(
            config.expandable_segments_reserve,
            Some(ReserveSpec::Gib(40.0))
        );
        assert_eq!(config.pinned_max_round_threshold_mb, Some(128));
        assert_eq!(config.pinned_max_cached_size_mb, Some(0));
        // Every known key is implemented (above), passed through (above) or
        // unimplemented (below), so the lists and the parser agree.
        for key in KNOWN_KEYS {
            let aliased = key.contains("hip");
            let unimplemented = UNIMPLEMENTED_KEYS.iter().any(|(name, _)| name == key);
            assert!(
                aliased || unimplemented || config.to_conf_string().contains(key),
                "{key}"
            );
        }
        for key in PASSED_THROUGH_KEYS {
            assert!(KNOWN_KEYS.contains(key), "{key}");
        }
    }

    #[test]
    fn unimplemented_keys_take_only_their_default_and_name_the_key_otherwise() {
        for (key, default) in UNIMPLEMENTED_KEYS {
            assert!(KNOWN_KEYS.contains(key), "{key}");
            assert_eq!(parse(&format!("{key}:{default}")), PytorchConfig::default());
        }
        for (conf, key) in [
            ("backend:cudaMallocAsync", "backend"),
            ("throw_on_cudamalloc_oom:True", "throw_on_cudamalloc_oom"),
            (
                "graph_capture_record_stream_reuse:True",
                "graph_capture_record_stream_reuse",
            ),
            (
                "expandable_segments_reserve_by_class:[decode:0.25,prefill:8g]",
                "expandable_segments_reserve_by_class",
            ),
        ] {
            let refused = error(conf);
            assert_eq!(refused.key, key);
            assert!(
                refused
                    .to_string()
                    .contains(&format!("hbmalloc does not implement {key}")),
                "{refused}"
            );
        }
    }

    #[test]
    fn hip_spellings_are_aliases() {
        let config = parse("release_lock_on_hipmalloc:True,pinned_use_hip_host_register:True");
        assert!(config.release_lock_on_cudamalloc);
        assert!(config.pinned_use_cuda_host_register);
        assert_eq!(
            error("backend:hipMallocAsync").expected,
            "native or cudaMallocAsync"
        );
    }

    #[test]
    fn whitespace_is_dropped_everywhere_as_pytorch_drops_it() {
        let config = parse(
            " max_split_size_mb : 4 0 ,\texpandable_segments:\nTrue , roundup_power2_divisions : [ 256 : 2 , > : 4 ] ",
        );
        assert_eq!(config.max_split_size, 40 * MIB);
        assert!(config.expandable_segments);
        assert_eq!(config.roundup_power2_divisions[8], 2);
        assert_eq!(config.roundup_power2_divisions[9], 4);
        // A trailing comma is accepted; a leading or doubled one is not.
        assert!(parse("expandable_segments:True,").expandable_segments);
        error(",expandable_segments:True");
        error("expandable_segments:True,,backend:native");
    }

    #[test]
    fn booleans_are_exactly_true_or_false() {
        assert!(!parse("expandable_segments:False").expandable_segments);
        let lowercase = error("expandable_segments:true");
        assert_eq!(
            lowercase.to_string(),
            "PYTORCH_CUDA_ALLOC_CONF: expandable_segments: expected True or False, got 'true' (use True)"
        );
        assert_eq!(
            error("pinned_free_catch_all:FALSE").hint.as_deref(),
            Some("use False")
        );
        let numeric = error("throw_on_cudamalloc_oom:1");
        assert_eq!(numeric.hint, None);
        assert_eq!(
            numeric.to_string(),
            "PYTORCH_CUDA_ALLOC_CONF: throw_on_cudamalloc_oom: expected True or False, got '1'"
        );
        error("expandable_segments:[True]");
    }

    #[test]
    fn unknown_and_malformed_keys_are_errors() {
        let unknown = error("expandable_segment:True");
        assert_eq!(unknown.key, "expandable_segment");
        assert!(unknown.expected.contains("expandable_segments"));
        let missing_value = error("expandable_segments");
        assert_eq!(missing_value.value, "");
        error("expandable_segments:");
        error("max_split_size_mb,40");
        error("expandable_segments:True:False");
        error("expandable_segments:True backend:native"); // one token "Truebackend"
        error("roundup_power2_divisions:[256:1");
        error("roundup_power2_divisions:[256]");
        error("roundup_power2_divisions:[256:1,,512:2]");
        error("]");
        // A separator is never a value, even for a key that ignores bad ones.
        error("expandable_segments_reserve:,");
        // Integers are ASCII digits only: Rust's parser alone would take `+40`.
        error("max_split_size_mb:+40");
    }

    #[test]
    fn max_split_size_rules() {
        assert_eq!(parse("max_split_size_mb:20").max_split_size, 20 * MIB);
        let too_small = error("max_split_size_mb:19");
        assert_eq!(
            too_small.to_string(),
            "PYTORCH_CUDA_ALLOC_CONF: max_split_size_mb: expected an integer number of MiB >= 20, got '19'"
        );
        error("max_split_size_mb:-1");
        error("max_split_size_mb:20.5");
        error("max_split_size_mb:40abc");
        error("max_split_size_mb:");
        let overflow = error("max_split_size_mb:18446744073709551616");
        assert!(overflow.expected.contains("2^64"), "{overflow}");
        // Huge values are clamped so that the byte count fits, as in PyTorch.
        assert_eq!(
            parse("max_split_size_mb:18446744073709551615").max_split_size,
            (u64::MAX / MIB) * MIB
        );
        assert_eq!(
            parse("max_non_split_rounding_mb:100").max_non_split_rounding,
            100 * MIB
        );
        error("max_non_split_rounding_mb:10");
    }

    #[test]
    fn large_segment_size_is_read_first_and_bounds_the_split_sizes() {
        error("large_segment_size_mb:10");
        let config = parse("large_segment_size_mb:11");
        assert_eq!(config.large_segment_size, 11 * MIB);
        // max_non_split_rounding follows the large segment size unless set.
        assert_eq!(config.max_non_split_rounding, 11 * MIB);
        assert_eq!(
            parse("max_split_size_mb:11,large_segment_size_mb:11").max_split_size,
            11 * MIB
        );
        // Applied before max_split_size_mb even when written after it.
        let error = error("max_split_size_mb:30,large_segment_size_mb:40");
        assert_eq!(error.key, "max_split_size_mb");
        assert!(error.expected.contains(">= 40"));
        super::PytorchConfig::parse("max_non_split_rounding_mb:39,large_segment_size_mb:40")
            .unwrap_err();
    }

    #[test]
    fn repeated_keys_keep_the_last_value() {
        let config = parse("max_split_size_mb:40,max_split_size_mb:80,expandable_segments:True,expandable_segments:False");
        assert_eq!(config.max_split_size, 80 * MIB);
        assert!(!config.expandable_segments);
        // Lists update the same table.
        let config = parse("roundup_power2_divisions:[1:2],roundup_power2_divisions:[1024:4]");
        assert_eq!(config.roundup_power2_divisions[0], 4);
        assert_eq!(config.roundup_power2_divisions[10], 4);
        assert_eq!(config.roundup_power2_divisions[11], 0);
    }

    #[test]
    fn garbage_collection_threshold_is_strictly_between_0_and_1() {
        assert_eq!(
            parse("garbage_collection_threshold:0.8").garbage_collection_threshold,
            0.8
        );
        assert_eq!(
            parse("garbage_collection_threshold:1e-3").garbage_collection_threshold,
            0.001
        );
        for bad in [
            "0", "1", "1.0", "-0.5", "NaN", "nan", "inf", "0.5x", "", "[0.5]",
        ] {
            let conf = format!("garbage_collection_threshold:{bad}");
            assert!(PytorchConfig::parse(&conf).is_err(), "{conf}");
        }
    }

    #[test]
    fn per_process_memory_fraction_is_between_0_and_1_inclusive() {
        assert_eq!(
            parse("per_process_memory_fraction:0").per_process_memory_fraction,
            0.0
        );
        assert_eq!(
            parse("per_process_memory_fraction:1").per_process_memory_fraction,
            1.0
        );
        assert_eq!(
            parse("per_process_memory_fraction:0.25").per_process_memory_fraction,
            0.25
        );
        for bad in ["1.01", "-0.1", "NaN", "infinity", "half"] {
            let conf = format!("per_process_memory_fraction:{bad}");
            assert!(PytorchConfig::parse(&conf).is_err(), "{conf}");
        }
    }

    #[test]
    fn pinned_keys_rules() {
        for threads in [1, 2, 64, 128] {
            let conf = format!("pinned_num_register_threads:{threads}");
            assert_eq!(parse(&conf).pinned_num_register_threads, threads);
        }
        for bad in ["0", "3", "256", "-8", "8.0"] {
            let conf = format!("pinned_num_register_threads:{bad}");
            assert!(PytorchConfig::parse(&conf).is_err(), "{conf}");
        }
        error("pinned_reserve_segment_size_mb:0");
        assert_eq!(
            parse("pinned_reserve_segment_size_mb:1").pinned_reserve_segment_size_mb,
            1
        );
        error("pinned_max_round_threshold_mb:-1");
        error("pinned_max_cached_size_mb:big");
        assert!(parse("pinned_use_background_threads:True").pinned_use_background_threads);
    }

    #[test]
    fn a_reserve_is_a_share_of_the_device_or_whole_gib() {
        assert_eq!(ReserveSpec::FractionOfDevice(0.5).bytes(3 << 30), 3 << 29);
        assert_eq!(ReserveSpec::FractionOfDevice(1.125).bytes(8 << 30), 9 << 30);
        assert_eq!(ReserveSpec::Gib(2.0).bytes(1 << 30), 2 << 30);
        assert_eq!(ReserveSpec::Gib(0.25).bytes(1 << 40), 1 << 28);
    }

    #[test]
    fn backend_values() {
        assert_eq!(parse("backend:native"), PytorchConfig::default());
        assert_eq!(
            error("backend:cudamallocasync").to_string(),
            "PYTORCH_CUDA_ALLOC_CONF: backend: expected native or cudaMallocAsync, got 'cudamallocasync'"
        );
    }

    #[test]
    fn expandable_segments_reserve_ignores_malformed_values_like_pytorch() {
        assert_eq!(
            parse("expandable_segments_reserve:0.5").expandable_segments_reserve,
            Some(ReserveSpec::FractionOfDevice(0.5))
        );
        for ignored in ["0", "-1", "nan", "inf", "G", "abc", "1.5GiB"] {
            let conf =
                format!("expandable_segments_reserve:0.5,expandable_segments_reserve:{ignored}");
            assert_eq!(
                parse(&conf).expandable_segments_reserve,
                Some(ReserveSpec::FractionOfDevice(0.5)),
                "{conf}"
            );
        }
        error("expandable_segments_reserve_by_class:0.5");
    }

    #[test]
    fn roundup_power2_divisions_list_form() {
        let config = parse("roundup_power2_divisions:[256:1,512:2,>:8]");
        let mut expected = [1; ROUNDUP_POWER2_INTERVALS];
        expected[9] = 2; // 512 MB interval
        expected[10..].fill(8);
        assert_eq!(config.roundup_power2_divisions, expected);

        // 0 disables rounding for an interval; boundaries past 32 GB clamp to the last one.
        let config = parse("roundup_power2_divisions:[1:0,2:4,65536:16]");
        assert_eq!(config.roundup_power2_divisions[0], 0);
        assert_eq!(config.roundup_power2_divisions[1], 4);
        assert_eq!(config.roundup_power2_divisions[2..15], [0; 13]);
        assert_eq!(config.roundup_power2_divisions[15], 16);

        // A leading '>' starts after interval 0, as the source's `last_index + 1` does.
        let config = parse("roundup_power2_divisions:[>:4]");
        assert_eq!(config.roundup_power2_divisions[0], 0);
        assert_eq!(config.roundup_power2_divisions[1..], [4; 15]);

        error("roundup_power2_divisions:[3:2]"); // boundary not a power of two
        error("roundup_power2_divisions:[0:2]");
        error("roundup_power2_divisions:[256:3]"); // divisions not a power of two
        error("roundup_power2_divisions:[abc:2]");
        error("roundup_power2_divisions:[256:-2]");
    }

    #[test]
    fn roundup_power2_divisions_single_form() {
        assert_eq!(parse("roundup_power2_divisions:4"), with_divisions(4));
        assert_eq!(parse("roundup_power2_divisions:1"), with_divisions(1));
        // Unlike the list form, the single form rejects 0.
        error("roundup_power2_divisions:0");
        error("roundup_power2_divisions:6");
        error("roundup_power2_divisions:");
    }

    #[test]
    fn roundup_power2_divisions_intervals() {
        let mut config = PytorchConfig::default();
        for (index, divisions) in config.roundup_power2_divisions.iter_mut().enumerate() {
            *divisions = index as u64 + 100;
        }
        assert_eq!(config.roundup_power2_divisions_for(1), 100);
        assert_eq!(config.roundup_power2_divisions_for(MIB), 100);
        assert_eq!(config.roundup_power2_divisions_for(2 * MIB - 1), 100);
        assert_eq!(config.roundup_power2_divisions_for(2 * MIB), 101);
        assert_eq!(config.roundup_power2_divisions_for(1 << 35), 115);
        assert_eq!(config.roundup_power2_divisions_for(1 << 40), 115);
        assert_eq!(config.roundup_power2_divisions_for(u64::MAX), 115);
        assert_eq!(config.roundup_power2_divisions_for(0), 115);
    }

    #[test]
    fn round_size_without_divisions() {
        let config = PytorchConfig::default();
        assert_eq!(config.round_size(0), 512);
        assert_eq!(config.round_size(1), 512);
        assert_eq!(config.round_size(512), 512);
        assert_eq!(config.round_size(513), 1024);
        assert_eq!(config.round_size(MIB), MIB);
        assert_eq!(config.round_size(MIB + 1), 1_049_088);
        assert_eq!(config.round_size(11_000_000), 11_000_320);
        assert_eq!(config.round_size(12 * MIB), 12 * MIB);
        assert_eq!(config.round_size(u64::MAX), u64::MAX);
        assert_eq!(config.round_size(u64::MAX - 511), u64::MAX - 511);
    }

    #[test]
    fn round_size_with_divisions() {
        let four = with_divisions(4);
        // Sizes up to 512 × divisions only get 512-byte rounding: 1200 → 1536, not 1280.
        assert_eq!(four.round_size(1200), 1536);
        assert_eq!(four.round_size(2048), 2048);
        assert_eq!(four.round_size(2049), 2560);
        // Above it, the next quarter of the power-of-two interval.
        assert_eq!(four.round_size(5 * MIB + 1), 6 * MIB);
        assert_eq!(four.round_size(5 * MIB), 5 * MIB);
        assert_eq!(four.round_size((1 << 30) + 1), (1 << 30) + (1 << 28));
        assert_eq!(four.round_size(1_500_000_000), 1_610_612_736);
        // A power of two stays.
        assert_eq!(four.round_size(8 * MIB), 8 * MIB);
        assert_eq!(four.round_size(1 << 40), 1 << 40);
        // Eight divisions between 2 MiB and 4 MiB: steps of 256 KiB.
        assert_eq!(with_divisions(8).round_size(3_000_000), 3_145_728);
        // 1 division means off, like 0.
        assert_eq!(with_divisions(1).round_size(5 * MIB + 1), 5 * MIB + 512);
        // Huge division counts: sizes below 512 × d round to 512 only.
        assert_eq!(with_divisions(1024).round_size(500_000), 500_224);
        assert_eq!(
            with_divisions(1 << 62).round_size(5 * MIB + 1),
            5 * MIB + 512
        );
        // No overflow near the top of the range.
        assert_eq!(with_divisions(2).round_size(u64::MAX - 5), u64::MAX);
        // Per interval: the first boundary (1 GiB) also covers everything below it, and
        // the intervals above it stay off.
        let config = parse("roundup_power2_divisions:[1024:2]");
        assert_eq!(config.round_size(5 * MIB + 1), 6 * MIB);
        assert_eq!(config.round_size((1 << 30) + 1), 3 << 29);
        assert_eq!(config.round_size((1 << 31) + 1), (1 << 31) + 512);
    }

    #[test]
    fn to_conf_string_lists_only_non_default_keys_and_round_trips() {
        assert_eq!(PytorchConfig::default().to_conf_string(), "");
        assert_eq!(
            parse("per_process_memory_fraction:-0").to_conf_string(),
            "per_process_memory_fraction:0"
        );
        assert_eq!(
            parse("expandable_segments:True,max_split_size_mb:200").to_conf_string(),
            "max_split_size_mb:200,expandable_segments:True"
        );
        assert_eq!(
            parse("roundup_power2_divisions:4").to_conf_string(),
            "roundup_power2_divisions:4"
        );
        for reserve in ["0.5", "40G", "1e-300", "1e300G"] {
            let conf = format!("expandable_segments_reserve:{reserve}");
            assert_eq!(parse(&conf).to_conf_string(), conf);
        }
        for conf in [
            "backend:native",
            "large_segment_size_mb:64",
            "large_segment_size_mb:64,max_non_split_rounding_mb:64",
            "large_segment_size_mb:30,max_non_split_rounding_mb:31,max_split_size_mb:30",
            "max_split_size_mb:99999999999999999999",
            "roundup_power2_divisions:[256:1,512:2,>:8]",
            "roundup_power2_divisions:[>:4]",
            "roundup_power2_divisions:[1:0,2:4,65536:16]",
            "garbage_collection_threshold:0.1",
            "garbage_collection_threshold:0.30000000000000004",
            "garbage_collection_threshold:1e-300",
            "per_process_memory_fraction:0",
            "per_process_memory_fraction:-0",
            "per_process_memory_fraction:0.333333333333333314829616256247",
            "expandable_segments_reserve:1e-7,expandable_segments_reserve_by_class:[]",
            "pinned_num_register_threads:128,pinned_reserve_segment_size_mb:3",
            "pinned_max_round_threshold_mb:0,pinned_max_cached_size_mb:18446744073709551615",
            "release_lock_on_hipmalloc:True,pinned_use_hip_host_register:True",
            "throw_on_cudamalloc_oom:False,graph_capture_record_stream_reuse:False",
            "pinned_free_catch_all:True,pinned_use_background_threads:True,expandable_segments:True",
        ] {
            let config = match PytorchConfig::parse(conf) {
                Ok(config) => config,
                // The huge max_split_size overflows u64 and must be rejected, not wrapped.
                Err(_) if conf.contains("99999999999999999999") => continue,
                Err(error) => panic!("{conf}: {error}"),
            };
            let written = config.to_conf_string();
            assert_eq!(parse(&written), config, "{conf} -> {written}");
        }
    }

    /// A small deterministic generator (xorshift64*), so the fuzz loop needs no crate.
    struct XorShift(u64);

    impl XorShift {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        fn below(&mut self, bound: usize) -> usize {
            (self.next() % bound as u64) as usize
        }
    }

    /// Pieces a random configuration is made of: keys, separators, numbers at the edges of
    /// every rule, and garbage.
    const FUZZ_PIECES: &[&str] = &[
        ":",
        ",",
        "[",
        "]",
        ">",
        " ",
        "\t",
        "True",
        "False",
        "true",
        "0",
        "1",
        "2",
        "3",
        "4",
        "8",
        "10",
        "11",
        "19",
        "20",
        "64",
        "128",
        "256",
        "1024",
        "65536",
        "0.5",
        "1.0",
        "-1",
        "1e308",
        "1e-320",
        "NaN",
        "inf",
        "G",
        "g",
        "18446744073709551615",
        "18446744073709551616",
        "99999999999999999999999",
        "native",
        "cudaMallocAsync",
        "é",
        "\u{0}",
        "\u{7}",
        "+5",
        "0x10",
        "max_split_size_mb",
        "max_non_split_rounding_mb",
        "large_segment_size_mb",
        "roundup_power2_divisions",
        "garbage_collection_threshold",
        "expandable_segments",
        "per_process_memory_fraction",
        "backend",
        "pinned_num_register_threads",
        "pinned_reserve_segment_size_mb",
        "expandable_segments_reserve",
        "expandable_segments_reserve_by_class",
        "pinned_max_round_threshold_mb",
        "throw_on_cudamalloc_oom",
        "unknown_key",
    ];

    #[test]
    fn random_strings_never_panic_and_accepted_ones_round_trip() {
        let mut random = XorShift(0x9E37_79B9_7F4A_7C15);
        let mut accepted = 0;
        for _ in 0..20_000 {
            let mut conf = String::new();
            for _ in 0..random.below(12) {
                if random.below(8) == 0 {
                    // A raw character, to reach paths no piece spells.
                    conf.push(char::from_u32(random.below(0x250) as u32).unwrap_or('?'));
                } else {
                    conf.push_str(FUZZ_PIECES[random.below(FUZZ_PIECES.len())]);
                }
            }
            match PytorchConfig::parse(&conf) {
                Ok(config) => {
                    accepted += 1;
                    let written = config.to_conf_string();
                    assert_eq!(parse(&written), config, "{conf:?} -> {written:?}");
                    let _ = config.round_size(random.next());
                }
                Err(error) => {
                    let message = error.to_string();
                    assert!(!message.contains('\n'), "{message:?}");
                    assert!(message.starts_with("PYTORCH_CUDA_ALLOC_CONF: "));
                }
            }
        }
        // The generator must reach the accepting paths too, not only errors.
        assert!(accepted > 100, "only {accepted} accepted");
    }

    #[test]
    fn structured_random_configs_round_trip() {
        let mut random = XorShift(42);
        let keys = [
            "max_split_size_mb",
            "large_segment_size_mb",
            "max_non_split_rounding_mb",
            "roundup_power2_divisions",
            "garbage_collection_threshold",
            "per_process_memory_fraction",
            "pinned_num_register_threads",
        ];
        let mut accepted = 0;
        for _ in 0..5_000 {
            let mut parts = Vec::new();
            for _ in 0..random.below(5) {
                let key = keys[random.below(keys.len())];
                let value = match key {
                    "roundup_power2_divisions" if random.below(2) == 0 => {
                        let items: Vec<String> = (0..random.below(4))
                            .map(|_| {
                                let boundary = if random.below(4) == 0 {
                                    ">".to_owned()
                                } else {
                                    (1u64 << random.below(18)).to_string()
                                };
                                format!("{boundary}:{}", (1u64 << random.below(6)) >> 1)
                            })
                            .collect();
                        format!("[{}]", items.join(","))
                    }
                    "garbage_collection_threshold" | "per_process_memory_fraction" => {
                        format!("{}", random.next() as f64 / u64::MAX as f64)
                    }
                    _ => (random.next() % 200).to_string(),
                };
                parts.push(format!("{key}:{value}"));
            }
            let conf = parts.join(",");
            if let Ok(config) = PytorchConfig::parse(&conf) {
                accepted += 1;
                let written = config.to_conf_string();
                assert_eq!(parse(&written), config, "{conf:?} -> {written:?}");
            }
        }
        assert!(accepted > 500, "only {accepted} accepted");
    }
}

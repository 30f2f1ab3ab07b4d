//! Writers for hbmalloc's outputs in other programs' formats.
//!
//! - [`snapshot_to_pickle`]: the dictionary `torch.cuda.memory._snapshot()`
//!   returns, pickled as `torch.cuda.memory._dump_snapshot(path)` writes it, so
//!   pytorch.org/memory_viz and `python -m torch.cuda._memory_viz` read it.
//! - [`stats_to_json`]: `torch.cuda.memory_stats()` as one flat JSON object.
//!
//! The engine writes no file format itself; it hands out plain data
//! ([`Snapshot`], [`DeviceStats`]) and these functions render it.

pub mod pickle;

use hbmalloc::{Action, DeviceStats, PolicyConfig, SegmentSnapshot, Snapshot, TraceEntry};

pub use pickle::{to_pickle, PickleValue};

/// The largest device index a snapshot is written for: PyTorch numbers
/// devices with an `int8_t` (`c10::DeviceIndex`), and `device_traces` holds
/// a list for every index up to the snapshot's (2^31 of them for a hostile
/// trace's device 2^31 would exhaust memory).
pub const MAX_DEVICE_INDEX: i64 = i8::MAX as i64;

/// The snapshot as a PyTorch memory-snapshot pickle (`_dump_snapshot` format):
/// `{segments, device_traces, allocator_settings, external_annotations}`.
///
/// `device` is the device index the snapshot describes: every segment gets
/// it, and `device_traces` holds one list per device index `0..=device`, the
/// history in the last one (the others empty), as PyTorch lays it out. A
/// negative `device` is written as device 0; callers refuse one past
/// [`MAX_DEVICE_INDEX`].
///
/// Frames are empty lists (hbmalloc records no Python stacks) and `time_us`
/// is the entry's sequence number, which orders entries as time would.
pub fn snapshot_to_pickle(snapshot: &Snapshot, device: i64) -> Vec<u8> {
    to_pickle(&snapshot_value(snapshot, device))
}

/// The [`PickleValue`] that [`snapshot_to_pickle`] serialises.
pub fn snapshot_value(snapshot: &Snapshot, device: i64) -> PickleValue {
    let device = device.max(0);
    let segments = snapshot
        .segments
        .iter()
        .map(|s| segment_value(s, device))
        .collect();
    let history: Vec<PickleValue> = snapshot.history.iter().map(trace_entry_value).collect();
    let mut device_traces = vec![PickleValue::List(Vec::new()); device as usize];
    device_traces.push(PickleValue::List(history));
    PickleValue::dict([
        ("segments", PickleValue::List(segments)),
        ("device_traces", PickleValue::List(device_traces)),
        (
            "allocator_settings",
            allocator_settings_value(&snapshot.settings),
        ),
        ("external_annotations", PickleValue::List(Vec::new())),
    ])
}

fn segment_value(segment: &SegmentSnapshot, device: i64) -> PickleValue {
    let blocks = segment
        .blocks
        .iter()
        .map(|b| {
            PickleValue::dict([
                ("address", PickleValue::int(b.address)),
                ("size", PickleValue::int(b.size)),
                ("requested_size", PickleValue::int(b.requested_size)),
                ("state", PickleValue::str(b.state.name())),
                ("frames", PickleValue::List(Vec::new())),
            ])
        })
        .collect();
    let segment_type = if segment.small_pool { "small" } else { "large" };
    PickleValue::dict([
        ("device", PickleValue::int(device)),
        ("address", PickleValue::int(segment.address)),
        ("total_size", PickleValue::int(segment.total_size)),
        ("allocated_size", PickleValue::int(segment.allocated_size())),
        ("active_size", PickleValue::int(segment.active_size())),
        ("requested_size", PickleValue::int(segment.requested_size())),
        ("stream", PickleValue::int(segment.stream.0)),
        ("segment_type", PickleValue::str(segment_type)),
        (
            "segment_pool_id",
            PickleValue::Tuple(vec![PickleValue::int(0), PickleValue::int(0)]),
        ),
        ("is_expandable", PickleValue::Bool(segment.expandable)),
        ("frames", PickleValue::List(Vec::new())),
        ("blocks", PickleValue::List(blocks)),
    ])
}

fn trace_entry_value(entry: &TraceEntry) -> PickleValue {
    // PyTorch writes an OOM's free device memory under `device_free`, every
    // other action's address under `addr`.
    let addr_key = if entry.action == Action::Oom {
        "device_free"
    } else {
        "addr"
    };
    PickleValue::dict([
        ("action", PickleValue::str(entry.action.name())),
        (addr_key, PickleValue::int(entry.addr)),
        ("size", PickleValue::int(entry.size)),
        ("stream", PickleValue::int(entry.stream.0)),
        ("time_us", PickleValue::int(entry.sequence)),
        ("frames", PickleValue::List(Vec::new())),
    ])
}

/// PyTorch's `allocator_settings` keys where the policy is `pytorch`, plus
/// `hbmalloc_settings` (the whole settings string) for every policy.
fn allocator_settings_value(settings: &str) -> PickleValue {
    let mut pairs = vec![("hbmalloc_settings", PickleValue::str(settings))];
    if let Ok(PolicyConfig::Pytorch(config)) = PolicyConfig::from_settings(settings) {
        let max_split_size = if config.max_split_size == u64::MAX {
            -1
        } else {
            i128::from(config.max_split_size)
        };
        pairs.extend([
            (
                "PYTORCH_CUDA_ALLOC_CONF",
                PickleValue::str(config.to_conf_string()),
            ),
            ("max_split_size", PickleValue::Int(max_split_size)),
            (
                "garbage_collection_threshold",
                PickleValue::Float(config.garbage_collection_threshold),
            ),
            (
                "expandable_segments",
                PickleValue::Bool(config.expandable_segments),
            ),
            (
                "release_lock_on_cudamalloc",
                PickleValue::Bool(config.release_lock_on_cudamalloc),
            ),
            (
                "pinned_use_cuda_host_register",
                PickleValue::Bool(config.pinned_use_cuda_host_register),
            ),
            (
                "pinned_num_register_threads",
                PickleValue::int(config.pinned_num_register_threads),
            ),
        ]);
    }
    PickleValue::dict(pairs)
}

/// `torch.cuda.memory_stats()` as one flat JSON object, keys sorted as
/// PyTorch sorts them (`{"active.all.allocated": 0, ...}`).
pub fn stats_to_json(stats: &DeviceStats) -> String {
    let mut out = String::from("{");
    for (i, (key, value)) in stats.to_pytorch_map().iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        push_json_string(&mut out, key);
        out.push_str(": ");
        out.push_str(&value.to_string());
    }
    out.push('}');
    out
}

/// Appends `text` as a JSON string literal.
fn push_json_string(out: &mut String, text: &str) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `allocator_settings` dict's value under `key`.
    fn setting(settings: &str, key: &str) -> Option<PickleValue> {
        let PickleValue::Dict(pairs) = allocator_settings_value(settings) else {
            panic!("allocator_settings is a dict");
        };
        pairs
            .into_iter()
            .find(|(k, _)| *k == PickleValue::str(key))
            .map(|(_, v)| v)
    }

    #[test]
    fn allocator_settings_say_pytorch_s_keys_under_policy_pytorch_only() {
        assert_eq!(
            setting("policy:pytorch", "max_split_size"),
            Some(PickleValue::Int(-1))
        );
        assert_eq!(
            setting("policy:pytorch,max_split_size_mb:64", "max_split_size"),
            Some(PickleValue::int(64u64 << 20))
        );
        assert_eq!(
            setting(
                "policy:pytorch,expandable_segments:True",
                "expandable_segments"
            ),
            Some(PickleValue::Bool(true))
        );
        assert_eq!(
            setting("policy:hbm", "hbmalloc_settings"),
            Some(PickleValue::str("policy:hbm"))
        );
        assert_eq!(setting("policy:hbm", "max_split_size"), None);
    }

    #[test]
    fn json_strings_are_escaped() {
        let mut out = String::new();
        push_json_string(&mut out, "a\"b\\c\n \u{1f}");
        assert_eq!(out, r#""a\"b\\c\u000a \u001f""#);
    }
}

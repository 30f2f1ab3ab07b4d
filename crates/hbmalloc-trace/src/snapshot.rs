//! PyTorch memory snapshots (`torch.cuda.memory._dump_snapshot`) → [`Trace`].
//!
//! A snapshot holds the allocator's state at the dump (`segments`) and a ring
//! buffer of its recent history per device (`device_traces`). The history may
//! start long after the program did, so the state at the window start is
//! rebuilt by walking the history backwards from the dumped state, as
//! PyTorch's own viewer (`torch/cuda/_memory_viz.py`, `MemoryViz.js`) does.
//!
//! Accepted variants, from torch 2.0 on (and ROCm builds, which write the
//! same format): entries with or without `time_us`, `frames`,
//! `compile_context` or `user_metadata`; blocks without `address` (they tile
//! their segment) or without `requested_size` (taken from `history[0]`);
//! `snapshot`, `annotate` and `user_defined` entries (markers, skipped); and
//! `free`, MemoryViz.js's name for a free that completed at once. Where the
//! snapshot has `external_annotations` (the `record_function` ranges PyTorch
//! records beside the history), they mark where the program's steps began
//! ([`step_times`]). Keys this importer does not use (`segment_pool_id`,
//! `host_segments`, ...) are ignored.

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::error::{Location, TraceError};
use crate::model::{
    AllocId, DeviceTrace, InitialBlock, InitialBlockState, InitialSegment, Op, Recorded,
    RecordedSegmentEvent, SegmentEventKind, StepMarks, Trace,
};
use crate::pickle::{Document, Value, ValueId};

/// Bit pattern of the synthetic streams that stand for "whatever other stream
/// still used a block whose free was deferred"; the low bits are the AllocId.
pub const DEFERRED_FREE_STREAM_BASE: u64 = 0xFFFF_0000_0000_0000;

/// PyTorch's small-pool segment size (`kSmallBuffer`): the only segment size
/// the small pool uses, so it identifies small-pool segments we only know by size.
const SMALL_SEGMENT_SIZE: u64 = 2 << 20;

/// PyTorch's minimum block size and rounding (`kMinBlockSize`).
const MIN_BLOCK_SIZE: u64 = 512;

/// Converts a decoded snapshot pickle into a trace.
///
/// The root is the dict `torch.cuda.memory._snapshot()` returns or, as
/// `torch/cuda/_memory_viz.py` also accepts, the bare list of segments
/// `torch.cuda.memory_snapshot()` returns. A snapshot without allocation
/// history (no `device_traces`, or only empty ones: recorded without
/// `_record_memory_history`) is not refused: each device with segments gets
/// its dumped state as the window start and no ops, so a replay holds that
/// state and nothing more.
pub fn snapshot_to_trace(doc: &Document) -> Result<Trace, TraceError> {
    let reader = Reader {
        doc,
        budget: Cell::new(doc.len()),
    };
    let root = doc.root();
    let (segments, segments_path) = match doc.get(root) {
        Value::Dict(_) => match doc.dict_get(root, "segments") {
            Some(id) => (reader.list(id, "segments")?, "segments"),
            None => (Vec::new(), "segments"),
        },
        // `torch.cuda.memory_snapshot()`: segments only.
        Value::List(items) => (items.clone(), ""),
        _ => return Err(reader.wrong_type("snapshot", root, "a dict or a list of segments")),
    };
    let segments = segments
        .iter()
        .enumerate()
        .map(|(i, &id)| reader.segment(id, &format!("{segments_path}[{i}]")))
        .collect::<Result<Vec<_>, _>>()?;

    let mut traces: BTreeMap<i64, Vec<Entry>> = BTreeMap::new();
    if let Some(id) = doc.dict_get(root, "device_traces") {
        for (device, &trace_id) in reader.list(id, "device_traces")?.iter().enumerate() {
            let path = format!("device_traces[{device}]");
            let entries = reader
                .list(trace_id, &path)?
                .iter()
                .enumerate()
                .map(|(i, &entry)| reader.entry(entry, &format!("{path}[{i}]")))
                .collect::<Result<Vec<_>, _>>()?;
            if !entries.is_empty() {
                traces.insert(device as i64, entries);
            }
        }
    }

    let settings = doc.dict_get(root, "allocator_settings");
    let any_expandable = segments.iter().any(|s| s.expandable);
    let recorded_config = match settings {
        Some(id) => Some(reader.config(id)?),
        // Settings are absent in older files; expandable segments still say
        // what the config was.
        None if any_expandable => Some("expandable_segments:True".to_string()),
        None => None,
    };
    let foreign_allocator = is_torch_npu(doc, &segments, &traces);
    let steps = match doc.dict_get(root, "external_annotations") {
        Some(id) => step_times(&reader, id)?,
        None => Vec::new(),
    };

    let devices: BTreeSet<i64> = segments
        .iter()
        .map(|s| s.device)
        .chain(traces.keys().copied())
        .collect();
    let devices = devices
        .into_iter()
        .map(|device| {
            let device_segments: Vec<&Segment> =
                segments.iter().filter(|s| s.device == device).collect();
            let entries = traces.remove(&device).unwrap_or_default();
            let times: Vec<u64> = steps
                .iter()
                .filter(|&&(on, _)| on.is_none_or(|on| on == device))
                .map(|&(_, time)| time)
                .collect();
            let mut trace = rebuild_device(device, &device_segments, &entries, &times);
            trace.recorded_config = recorded_config.clone();
            trace.foreign_allocator = foreign_allocator;
            trace.recorded_span_us = time_span_us(&entries);
            trace
        })
        .collect();
    Ok(Trace {
        source: String::new(),
        devices,
        notes: Vec::new(),
    })
}

/// When the program's steps began, as (device, `time_us`), sorted by time,
/// from the snapshot's `external_annotations`: torch.profiler's
/// `ProfilerStep#N` ranges where the program has them, otherwise the
/// optimizer's steps (`Optimizer.step#AdamW.step`: one per training
/// iteration, so the first optimizer named stands for all where a program
/// has several). Annotations without a name, stage or time (or not dicts)
/// mark nothing: they are not the allocator's, and a replay needs none.
fn step_times(reader: &Reader, id: ValueId) -> Result<Vec<(Option<i64>, u64)>, TraceError> {
    let path = "external_annotations";
    let mut profiler = Vec::new();
    let mut optimizer = Vec::new();
    let mut optimizer_name: Option<&str> = None;
    for (i, &annotation) in reader.list(id, path)?.iter().enumerate() {
        let path = format!("{path}[{i}]");
        reader.spend(&path)?;
        let text = |key| match reader.field(annotation, key).map(|v| reader.doc.get(v)) {
            Some(Value::Str(s)) => Some(s.as_str()),
            _ => None,
        };
        let (Some(name), Some("START")) = (text("name"), text("stage")) else {
            continue;
        };
        let Ok(Some(time)) = reader.word_field(annotation, "time_us", &path) else {
            continue;
        };
        let device = match reader
            .field(annotation, "device")
            .map(|v| reader.int(v, &path))
        {
            Some(Ok(device)) => i64::try_from(device).ok(),
            _ => None,
        };
        if name.starts_with("ProfilerStep#") {
            profiler.push((device, time));
        } else if name.starts_with("Optimizer.step#") && *optimizer_name.get_or_insert(name) == name
        {
            optimizer.push((device, time));
        }
    }
    let mut times = if profiler.is_empty() {
        optimizer
    } else {
        profiler
    };
    times.sort_by_key(|&(_, time)| time);
    Ok(times)
}

/// Microseconds from the first to the last entry's `time_us`, where
/// entries have one.
fn time_span_us(entries: &[Entry]) -> Option<u64> {
    let mut stamps = entries.iter().filter_map(|e| e.time_us);
    let first = stamps.next()?;
    let (low, high) = stamps.fold((first, first), |(lo, hi), t| (lo.min(t), hi.max(t)));
    Some(high - low)
}

/// A segment of the dumped (end) state.
#[derive(Clone, Debug)]
struct Segment {
    device: i64,
    address: u64,
    total_size: u64,
    stream: u64,
    small_pool: bool,
    expandable: bool,
    blocks: Vec<Block>,
}

/// A block of the dumped (end) state.
#[derive(Clone, Debug)]
struct Block {
    address: u64,
    size: u64,
    requested_size: u64,
    /// `active_allocated` or `active_pending_free` (the program freed it but
    /// another stream's work on it had not finished).
    live: bool,
    pending_free: bool,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Action {
    Alloc,
    /// A free that completed at once: `free_requested` directly followed by
    /// its `free_completed`, as MemoryViz.js writes the pair.
    Free,
    FreeRequested,
    FreeCompleted,
    Segment(SegmentEventKind),
    Oom,
    /// `snapshot`, `annotate`, `user_defined`: markers with no allocator effect.
    Marker,
    Unknown,
}

/// One history entry.
#[derive(Clone, Debug)]
struct Entry {
    action: Action,
    /// The action name as written, for counting unknown ones.
    name: String,
    /// Address; for `oom`, the free device memory.
    addr: u64,
    size: u64,
    stream: u64,
    /// `time_us`, where the entry has it.
    time_us: Option<u64>,
}

/// Typed access to a decoded pickle, with errors that say where.
struct Reader<'d> {
    doc: &'d Document,
    /// Segments, blocks and entries left to read. A pickle can name one
    /// value many times through its memo (a million-entry list used as every
    /// device's trace); real snapshots never do, so reading more records than
    /// the document holds values is refused instead of taking quadratic time.
    budget: Cell<usize>,
}

impl Reader<'_> {
    fn spend(&self, path: &str) -> Result<(), TraceError> {
        let left = self.budget.get();
        if left == 0 {
            return Err(self.error(
                path,
                "more records than the document holds values (shared references)".to_string(),
            ));
        }
        self.budget.set(left - 1);
        Ok(())
    }

    fn error(&self, path: &str, message: String) -> TraceError {
        TraceError::new("snapshot", Location::Entry(path.to_string()), message)
    }

    fn wrong_type(&self, path: &str, id: ValueId, expected: &str) -> TraceError {
        let found = self.doc.get(id).type_name();
        self.error(path, format!("expected {expected}, found {found}"))
    }

    fn list(&self, id: ValueId, path: &str) -> Result<Vec<ValueId>, TraceError> {
        match self.doc.get(id) {
            Value::List(items) | Value::Tuple(items) => Ok(items.clone()),
            _ => Err(self.wrong_type(path, id, "a list")),
        }
    }

    fn dict(&self, id: ValueId, path: &str) -> Result<(), TraceError> {
        match self.doc.get(id) {
            Value::Dict(_) => Ok(()),
            _ => Err(self.wrong_type(path, id, "a dict")),
        }
    }

    fn int(&self, id: ValueId, path: &str) -> Result<i128, TraceError> {
        match self.doc.get(id) {
            Value::Int(n) => Ok(*n),
            Value::Bool(b) => Ok(i128::from(*b)),
            _ => Err(self.wrong_type(path, id, "an integer")),
        }
    }

    /// An address, size or stream: any integer that fits in 64 bits
    /// (negative ones, as a C pointer printed signed, wrap).
    fn word(&self, id: ValueId, path: &str) -> Result<u64, TraceError> {
        let n = self.int(id, path)?;
        if let Ok(n) = u64::try_from(n) {
            Ok(n)
        } else if let Ok(n) = i64::try_from(n) {
            Ok(n as u64)
        } else {
            Err(self.error(path, format!("integer {n} does not fit in 64 bits")))
        }
    }

    fn field(&self, dict: ValueId, key: &str) -> Option<ValueId> {
        self.doc.dict_get(dict, key)
    }

    fn word_field(&self, dict: ValueId, key: &str, path: &str) -> Result<Option<u64>, TraceError> {
        self.field(dict, key)
            .map(|id| self.word(id, &format!("{path}.{key}")))
            .transpose()
    }

    fn required_word(&self, dict: ValueId, key: &str, path: &str) -> Result<u64, TraceError> {
        self.word_field(dict, key, path)?
            .ok_or_else(|| self.error(path, format!("missing '{key}'")))
    }

    fn str_field(&self, dict: ValueId, key: &str, path: &str) -> Result<Option<&str>, TraceError> {
        match self.field(dict, key) {
            None => Ok(None),
            Some(id) => match self.doc.get(id) {
                Value::Str(s) => Ok(Some(s)),
                _ => Err(self.wrong_type(&format!("{path}.{key}"), id, "a string")),
            },
        }
    }

    fn bool_field(&self, dict: ValueId, key: &str, path: &str) -> Result<Option<bool>, TraceError> {
        self.field(dict, key)
            .map(|id| Ok(self.int(id, &format!("{path}.{key}"))? != 0))
            .transpose()
    }

    fn segment(&self, id: ValueId, path: &str) -> Result<Segment, TraceError> {
        self.dict(id, path)?;
        self.spend(path)?;
        let address = self.required_word(id, "address", path)?;
        let total_size = self.required_word(id, "total_size", path)?;
        let small_pool = match self.str_field(id, "segment_type", path)? {
            Some(kind) => kind == "small",
            None => total_size == SMALL_SEGMENT_SIZE,
        };
        let device = self
            .field(id, "device")
            .map(|d| self.int(d, &format!("{path}.device")));
        let device = match device.transpose()? {
            Some(d) => i64::try_from(d)
                .map_err(|_| self.error(path, format!("device {d} out of range")))?,
            None => 0,
        };
        let mut blocks = Vec::new();
        if let Some(list) = self.field(id, "blocks") {
            let mut next_address = address;
            for (i, &block) in self
                .list(list, &format!("{path}.blocks"))?
                .iter()
                .enumerate()
            {
                let block_path = format!("{path}.blocks[{i}]");
                self.dict(block, &block_path)?;
                self.spend(&block_path)?;
                let size = self.required_word(block, "size", &block_path)?;
                // Older files give no block addresses: blocks tile the segment.
                let block_address = self
                    .word_field(block, "address", &block_path)?
                    .unwrap_or(next_address);
                next_address = block_address.saturating_add(size);
                let state = self
                    .str_field(block, "state", &block_path)?
                    .ok_or_else(|| self.error(&block_path, "missing 'state'".to_string()))?;
                let (live, pending_free) = match state {
                    "active_allocated" => (true, false),
                    // `active_awaiting_free` is the name the `_snapshot()`
                    // docstring gives the state PyTorch writes as
                    // `active_pending_free`.
                    "active_pending_free" | "active_awaiting_free" => (true, true),
                    _ => (false, false),
                };
                let requested_size = match self.word_field(block, "requested_size", &block_path)? {
                    Some(requested) => requested,
                    None => self
                        .legacy_requested_size(block, &block_path)?
                        .unwrap_or(size),
                };
                blocks.push(Block {
                    address: block_address,
                    size,
                    requested_size,
                    live,
                    pending_free,
                });
            }
        }
        Ok(Segment {
            device,
            address,
            total_size,
            stream: self.word_field(id, "stream", path)?.unwrap_or(0),
            small_pool,
            expandable: self.bool_field(id, "is_expandable", path)?.unwrap_or(false),
            blocks,
        })
    }

    /// Older snapshots (torch 2.0) give a block no `requested_size`; its
    /// latest allocation's size is `history[0].real_size`, as PyTorch's
    /// viewers read it (`_block_extra_legacy` in `torch/cuda/_memory_viz.py`).
    fn legacy_requested_size(&self, block: ValueId, path: &str) -> Result<Option<u64>, TraceError> {
        let Some(history) = self.field(block, "history") else {
            return Ok(None);
        };
        let path = format!("{path}.history");
        // Only the first item is read, so the list is not copied: a history
        // shared by every block through the memo costs nothing extra.
        let latest = match self.doc.get(history) {
            Value::List(items) | Value::Tuple(items) => items.first().copied(),
            _ => return Err(self.wrong_type(&path, history, "a list")),
        };
        let Some(latest) = latest else {
            return Ok(None);
        };
        let path = format!("{path}[0]");
        self.dict(latest, &path)?;
        self.word_field(latest, "real_size", &path)
    }

    fn entry(&self, id: ValueId, path: &str) -> Result<Entry, TraceError> {
        self.dict(id, path)?;
        self.spend(path)?;
        let name = self
            .str_field(id, "action", path)?
            .ok_or_else(|| self.error(path, "missing 'action'".to_string()))?;
        let action = match name {
            "alloc" => Action::Alloc,
            // MemoryViz.js's name for a free_requested that completed at once.
            "free" => Action::Free,
            "free_requested" => Action::FreeRequested,
            "free_completed" => Action::FreeCompleted,
            "oom" => Action::Oom,
            "snapshot" | "annotate" | "user_defined" => Action::Marker,
            other => SegmentEventKind::from_action(other).map_or(Action::Unknown, Action::Segment),
        };
        let stream = self.word_field(id, "stream", path)?.unwrap_or(0);
        let (addr, size) = match action {
            Action::Marker | Action::Unknown => (0, 0),
            Action::Oom => {
                // PyTorch writes the free device memory as `device_free`
                // (`addr` in the C++ entry it comes from).
                let free = match self.word_field(id, "device_free", path)? {
                    Some(free) => free,
                    None => self.word_field(id, "addr", path)?.unwrap_or(0),
                };
                (free, self.required_word(id, "size", path)?)
            }
            _ => (
                self.required_word(id, "addr", path)?,
                self.required_word(id, "size", path)?,
            ),
        };
        Ok(Entry {
            action,
            name: name.to_string(),
            addr,
            size,
            stream,
            time_us: self.word_field(id, "time_us", path).ok().flatten(),
        })
    }

    /// Renders `allocator_settings` as `PYTORCH_CUDA_ALLOC_CONF` syntax,
    /// keeping only keys that differ from PyTorch's defaults.
    fn config(&self, id: ValueId) -> Result<String, TraceError> {
        let path = "allocator_settings";
        self.dict(id, path)?;
        let mut parts = Vec::new();
        if let Some(bytes) = self.field(id, "max_split_size") {
            let bytes = self.int(bytes, "allocator_settings.max_split_size")?;
            // -1 (SIZE_MAX) means "no limit", the default.
            if bytes >= 0 && bytes < i128::from(u64::MAX) {
                parts.push(format!("max_split_size_mb:{}", bytes >> 20));
            }
        }
        if let Some(threshold) = self.field(id, "garbage_collection_threshold") {
            let threshold = match self.doc.get(threshold) {
                Value::Float(x) => *x,
                _ => self.int(threshold, "allocator_settings.garbage_collection_threshold")? as f64,
            };
            if threshold != 0.0 {
                parts.push(format!("garbage_collection_threshold:{threshold}"));
            }
        }
        for (key, default) in [
            ("expandable_segments", false),
            ("release_lock_on_cudamalloc", false),
            ("pinned_use_cuda_host_register", false),
            ("graph_capture_record_stream_reuse", false),
        ] {
            if let Some(value) = self.bool_field(id, key, path)? {
                if value != default {
                    let rendered = if value { "True" } else { "False" };
                    parts.push(format!("{key}:{rendered}"));
                }
            }
        }
        if let Some(threads) = self.word_field(id, "pinned_num_register_threads", path)? {
            if threads != 1 {
                parts.push(format!("pinned_num_register_threads:{threads}"));
            }
        }
        if let Some(divisions) = self.field(id, "roundup_power2_divisions") {
            let rendered = self.divisions(divisions)?;
            if !rendered.is_empty() {
                parts.push(format!("roundup_power2_divisions:[{}]", rendered.join(",")));
            }
        }
        Ok(parts.join(","))
    }

    /// Non-zero `roundup_power2_divisions` entries as `size_mb:divisions`.
    fn divisions(&self, id: ValueId) -> Result<Vec<String>, TraceError> {
        let path = "allocator_settings.roundup_power2_divisions";
        let Value::Dict(pairs) = self.doc.get(id) else {
            // A single number is PyTorch's "same divisions for every size" form.
            let n = self.int(id, path)?;
            return Ok(if n == 0 {
                vec![]
            } else {
                vec![format!(">:{n}")]
            });
        };
        let mut rendered = Vec::new();
        for &(key, value) in pairs {
            let divisions = self.int(value, path)?;
            if divisions != 0 {
                let key = match self.doc.get(key) {
                    Value::Str(s) => s.clone(),
                    _ => self.int(key, path)?.to_string(),
                };
                rendered.push(format!("{key}:{divisions}"));
            }
        }
        Ok(rendered)
    }
}

/// torch_npu's port of the allocator writes the same format. It is told apart
/// by frames from torch_npu's Python package or, failing that, by its streams:
/// CUDA's default stream is 0, while every NPU stream is a non-null handle.
fn is_torch_npu(doc: &Document, segments: &[Segment], traces: &BTreeMap<i64, Vec<Entry>>) -> bool {
    let mentions_torch_npu = doc
        .values()
        .any(|value| matches!(value, Value::Str(s) if s.contains("/torch_npu/")));
    let streams: Vec<u64> = segments
        .iter()
        .map(|s| s.stream)
        .chain(traces.values().flatten().map(|e| e.stream))
        .collect();
    mentions_torch_npu || (!streams.is_empty() && streams.iter().all(|&s| s != 0))
}

/// What the rebuild knows about an allocation while walking backwards.
#[derive(Clone, Debug)]
struct LiveBlock {
    size: u64,
    requested_size: u64,
    /// Freed by the program (free_requested) but not yet completed.
    pending_free: bool,
}

/// A mapped address range while walking backwards.
#[derive(Clone, Debug)]
struct Range {
    end: u64,
    stream: u64,
    small_pool: bool,
    expandable: bool,
}

/// The block size PyTorch's allocator gives a request (`round_size` with the
/// default config); used for allocations the dump no longer shows.
fn rounded_block_size(requested: u64) -> u64 {
    requested
        .max(1)
        .div_ceil(MIN_BLOCK_SIZE)
        .saturating_mul(MIN_BLOCK_SIZE)
}

/// Removes `[start, end)` from `ranges`, trimming or splitting what overlaps.
fn remove_range(ranges: &mut BTreeMap<u64, Range>, start: u64, end: u64) {
    // Ranges do not overlap, so their ends increase with their starts.
    let overlapping: Vec<u64> = ranges
        .range(..end)
        .rev()
        .take_while(|(_, r)| r.end > start)
        .map(|(&s, _)| s)
        .collect();
    for range_start in overlapping {
        let range = ranges.remove(&range_start).expect("key just listed");
        if range_start < start {
            ranges.insert(
                range_start,
                Range {
                    end: start,
                    ..range.clone()
                },
            );
        }
        if range.end > end {
            ranges.insert(end, range);
        }
    }
}

/// Adds `[start, end)`; expandable ranges join touching expandable neighbours
/// of the same stream and pool, so each contiguous mapped range is one segment.
fn add_range(ranges: &mut BTreeMap<u64, Range>, mut start: u64, range: Range) {
    remove_range(ranges, start, range.end);
    let mut range = range;
    if range.expandable {
        let joins = |other: &Range| {
            other.expandable && other.stream == range.stream && other.small_pool == range.small_pool
        };
        if let Some((&left_start, left)) = ranges.range(..start).next_back() {
            if left.end == start && joins(left) {
                ranges.remove(&left_start);
                start = left_start;
            }
        }
        if let Some(right) = ranges.get(&range.end) {
            if joins(right) {
                let right_end = right.end;
                ranges.remove(&range.end);
                range.end = right_end;
            }
        }
    }
    ranges.insert(start, range);
}

/// Rebuilds the window-start state of one device and turns its history into
/// ops; `step_times` are when its steps began (`time_us`, sorted).
fn rebuild_device(
    device: i64,
    segments: &[&Segment],
    entries: &[Entry],
    step_times: &[u64],
) -> DeviceTrace {
    let (mut ranges, mut live) = dumped_state(segments);
    let mut rebuild = Rebuild::default();
    undo_history(entries, &mut ranges, &mut live, &mut rebuild.skipped);
    let initial_segments = rebuild.lay_out(&ranges, &live);
    // Saturating: blocks outside every segment (from absurd history entries)
    // may add up past 2^64 bytes.
    let initial_reserved_bytes = initial_segments
        .iter()
        .fold(0u64, |sum, s| sum.saturating_add(s.total_size()));
    let (segment_events, peak_reserved) =
        rebuild.replay(entries, initial_reserved_bytes, step_times);
    DeviceTrace {
        device,
        initial_segments,
        ops: rebuild.ops,
        recorded_config: None,
        recorded: Some(Recorded {
            peak_reserved_bytes: Some(peak_reserved),
            initial_reserved_bytes,
            segment_events,
        }),
        foreign_allocator: false,
        skipped: rebuild.skipped.0,
        recorded_span_us: None,
        step_starts: rebuild.step_starts,
    }
}

/// Entries the rebuild could not use, counted by reason.
#[derive(Default)]
struct Skipped(BTreeMap<String, u64>);

impl Skipped {
    fn skip(&mut self, reason: &str) {
        *self.0.entry(reason.to_string()).or_default() += 1;
    }
}

/// The dumped state: its address ranges (segments, adjacent ones joined)
/// and the blocks live in them.
fn dumped_state(segments: &[&Segment]) -> (BTreeMap<u64, Range>, BTreeMap<u64, LiveBlock>) {
    let mut ranges: BTreeMap<u64, Range> = BTreeMap::new();
    let mut live: BTreeMap<u64, LiveBlock> = BTreeMap::new();
    for segment in segments {
        add_range(
            &mut ranges,
            segment.address,
            Range {
                end: segment.address.saturating_add(segment.total_size),
                stream: segment.stream,
                small_pool: segment.small_pool,
                expandable: segment.expandable,
            },
        );
        for block in segment.blocks.iter().filter(|b| b.live) {
            live.insert(
                block.address,
                LiveBlock {
                    size: block.size,
                    requested_size: block.requested_size,
                    pending_free: block.pending_free,
                },
            );
        }
    }
    (ranges, live)
}

/// Walks the history backwards, undoing each entry, so that `ranges` and
/// `live` become the state when the window began.
fn undo_history(
    entries: &[Entry],
    ranges: &mut BTreeMap<u64, Range>,
    live: &mut BTreeMap<u64, LiveBlock>,
    skipped: &mut Skipped,
) {
    for entry in entries.iter().rev() {
        let end = entry.addr.saturating_add(entry.size);
        match entry.action {
            Action::Alloc => {
                if live.remove(&entry.addr).is_none() {
                    skipped.skip("alloc of a block the dump does not show");
                }
            }
            Action::Free | Action::FreeRequested => {
                live.entry(entry.addr)
                    .or_insert_with(|| LiveBlock {
                        size: rounded_block_size(entry.size),
                        requested_size: entry.size,
                        pending_free: false,
                    })
                    .pending_free = false;
            }
            Action::FreeCompleted => {
                live.entry(entry.addr).or_insert(LiveBlock {
                    size: rounded_block_size(entry.size),
                    requested_size: entry.size,
                    pending_free: true,
                });
            }
            Action::Segment(SegmentEventKind::Alloc | SegmentEventKind::Map) => {
                remove_range(ranges, entry.addr, end);
            }
            Action::Segment(kind) => {
                // A range reappears. Unmapped pages belong to the expandable
                // segment they touch; take its pool from there.
                let expandable = kind == SegmentEventKind::Unmap;
                let neighbour = ranges
                    .range(..entry.addr)
                    .next_back()
                    .filter(|(_, r)| r.end == entry.addr)
                    .map(|(_, r)| r)
                    .or_else(|| ranges.get(&end));
                let small_pool = match neighbour {
                    Some(r) if expandable => r.small_pool,
                    _ => entry.size == SMALL_SEGMENT_SIZE,
                };
                add_range(
                    ranges,
                    entry.addr,
                    Range {
                        end,
                        stream: entry.stream,
                        small_pool,
                        expandable,
                    },
                );
            }
            Action::Oom | Action::Marker | Action::Unknown => {}
        }
    }
}

/// The ops of a device being rebuilt, and the ids given out so far.
#[derive(Default)]
struct Rebuild {
    skipped: Skipped,
    next_id: AllocId,
    addr_to_id: HashMap<u64, AllocId>,
    pending_streams: HashMap<u64, u64>,
    ops: Vec<Op>,
    /// Where each step began, as in [`DeviceTrace::step_starts`].
    step_starts: Vec<usize>,
}

impl Rebuild {
    fn skip(&mut self, reason: &str) {
        self.skipped.skip(reason);
    }

    /// Records an allocation live at the window start under a new id and
    /// returns its block of `size` bytes. One whose free was already
    /// requested (pending at the window start) is freed at once behind a
    /// synthetic stream, which the later `free_completed` completes.
    fn register_initial(&mut self, addr: u64, block: &LiveBlock, size: u64) -> InitialBlock {
        let id = self.next_id;
        self.next_id += 1;
        if block.pending_free {
            let stream = DEFERRED_FREE_STREAM_BASE | id;
            self.ops.push(Op::RecordStream { id, stream });
            self.ops.push(Op::Free { id });
            self.pending_streams.insert(addr, stream);
        } else {
            self.addr_to_id.insert(addr, id);
        }
        InitialBlock {
            size,
            requested_size: block.requested_size,
            state: InitialBlockState::Allocated(id),
        }
    }

    /// Lays the allocations live at the window start out in the ranges
    /// then, as initial segments, each allocation registered under an id.
    fn lay_out(
        &mut self,
        ranges: &BTreeMap<u64, Range>,
        live: &BTreeMap<u64, LiveBlock>,
    ) -> Vec<InitialSegment> {
        let mut initial_segments = Vec::new();
        let mut placed: BTreeSet<u64> = BTreeSet::new();
        for (&start, range) in ranges {
            let mut blocks = Vec::new();
            let mut cursor = start;
            let inside: Vec<(u64, &LiveBlock)> =
                live.range(start..range.end).map(|(&a, b)| (a, b)).collect();
            for (i, &(addr, block)) in inside.iter().enumerate() {
                let limit = inside.get(i + 1).map_or(range.end, |&(next, _)| next);
                let size = block.size.min(limit - addr);
                if addr > cursor {
                    blocks.push(free_block(addr - cursor));
                }
                blocks.push(self.register_initial(addr, block, size));
                placed.insert(addr);
                cursor = addr + size;
            }
            if range.end > cursor {
                blocks.push(free_block(range.end - cursor));
            }
            if !blocks.is_empty() {
                initial_segments.push(InitialSegment {
                    address: start,
                    stream: range.stream,
                    small_pool: range.small_pool,
                    expandable: range.expandable,
                    blocks,
                });
            }
        }
        // Allocations outside every segment mean the history and the dump
        // disagree; keep them (in a segment of their own) so their frees resolve.
        for (&addr, block) in live.iter().filter(|(a, _)| !placed.contains(a)) {
            self.skip("live block outside every segment (given its own segment)");
            let blocks = vec![self.register_initial(addr, block, block.size)];
            initial_segments.push(InitialSegment {
                address: addr,
                stream: 0,
                small_pool: block.size <= SMALL_SEGMENT_SIZE,
                expandable: false,
                blocks,
            });
        }

        initial_segments
    }

    /// Turns the history into ops, forwards: returns the segment events it
    /// recorded (each at the op it belongs to) and the peak reserved bytes.
    /// A step begins at the first entry at or after its time in
    /// `step_times`; steps begun before the history starts mark nothing.
    fn replay(
        &mut self,
        entries: &[Entry],
        initial_reserved_bytes: u64,
        step_times: &[u64],
    ) -> (Vec<RecordedSegmentEvent>, u64) {
        let mut explained_by_oom = vec![false; entries.len()];
        let mut oom_ahead = false;
        for (i, entry) in entries.iter().enumerate().rev() {
            match entry.action {
                Action::Oom => oom_ahead = true,
                Action::Alloc => oom_ahead = false,
                _ => {}
            }
            explained_by_oom[i] = oom_ahead;
        }

        let mut reserved = initial_reserved_bytes;
        let mut peak_reserved = reserved;
        let mut segment_events = Vec::new();
        let mut in_empty_cache = false;
        let since = entries.iter().find_map(|e| e.time_us);
        let mut steps = StepMarks::new(step_times, since);
        let mut i = 0;
        while i < entries.len() {
            let entry = &entries[i];
            if let Some(now) = entry.time_us {
                steps.at(now, self.ops.len(), &mut self.step_starts);
            }
            match entry.action {
                Action::Alloc => {
                    in_empty_cache = false;
                    if self.addr_to_id.contains_key(&entry.addr) {
                        self.skip("alloc at a live address (old allocation dropped)");
                    }
                    let id = self.next_id;
                    self.next_id += 1;
                    self.addr_to_id.insert(entry.addr, id);
                    self.ops.push(Op::Alloc {
                        id,
                        size: entry.size,
                        stream: entry.stream,
                    });
                }
                Action::Free | Action::FreeRequested => match self.addr_to_id.remove(&entry.addr) {
                    Some(id) => {
                        // A `free_requested` whose `free_completed` follows at
                        // once is a `free` (taken together with it).
                        let completed_next = entry.action == Action::FreeRequested
                            && entries.get(i + 1).is_some_and(|next| {
                                next.action == Action::FreeCompleted && next.addr == entry.addr
                            });
                        if entry.action == Action::Free || completed_next {
                            self.ops.push(Op::Free { id });
                            i += usize::from(completed_next);
                        } else {
                            let stream = DEFERRED_FREE_STREAM_BASE | id;
                            self.ops.push(Op::RecordStream { id, stream });
                            self.ops.push(Op::Free { id });
                            self.pending_streams.insert(entry.addr, stream);
                        }
                    }
                    None => self.skip("free of an unknown address"),
                },
                Action::FreeCompleted => match self.pending_streams.remove(&entry.addr) {
                    Some(stream) => self.ops.push(Op::StreamComplete { stream }),
                    None => self.skip("free_completed without a pending free"),
                },
                Action::Segment(kind) => {
                    let grows = matches!(kind, SegmentEventKind::Alloc | SegmentEventKind::Map);
                    if grows {
                        reserved = reserved.saturating_add(entry.size);
                        peak_reserved = peak_reserved.max(reserved);
                    } else {
                        reserved = reserved.saturating_sub(entry.size);
                        // PyTorch returns segments only on empty_cache(), an OOM
                        // retry or GC; unexplained runs replay as empty_cache().
                        if !explained_by_oom[i] && !in_empty_cache {
                            self.ops.push(Op::EmptyCache);
                            in_empty_cache = true;
                        }
                    }
                    let op_index = if in_empty_cache && !grows {
                        self.ops.len() - 1
                    } else {
                        self.ops.len()
                    };
                    segment_events.push(RecordedSegmentEvent {
                        kind,
                        size: entry.size,
                        stream: entry.stream,
                        address: entry.addr,
                        op_index,
                    });
                }
                Action::Oom => self.ops.push(Op::Oom {
                    size: entry.size,
                    stream: entry.stream,
                    device_free: entry.addr,
                }),
                Action::Marker => {}
                Action::Unknown => self.skip(&format!("unknown action '{}'", entry.name)),
            }
            i += 1;
        }
        steps.close(self.ops.len(), &mut self.step_starts);

        (segment_events, peak_reserved)
    }
}

fn free_block(size: u64) -> InitialBlock {
    InitialBlock {
        size,
        requested_size: 0,
        state: InitialBlockState::Free,
    }
}

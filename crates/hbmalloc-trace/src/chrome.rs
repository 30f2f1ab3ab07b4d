//! torch.profiler chrome traces (`profile_memory=True`) → [`Trace`].
//!
//! The profiler logs one `[memory]` instant event per allocation and free:
//! `args.Addr`, `args.Bytes` (negative for a free), `args["Device Type"]`
//! (c10's `DeviceType`: 0 CPU, 1 CUDA, also on ROCm; CPU when missing) and
//! `args["Device Id"]` (required but for host memory), and one `[OutOfMemory]`
//! event (no `Addr`) per failed allocation, which becomes [`Op::Oom`].
//! Events are replayed in timestamp order; the trace knows nothing of
//! segments or streams, so every op is on stream 0.
//!
//! Devices: a GPU run logs host (CPU) and device memory in the same file.
//! Every device type but the CPU keeps its `Device Id` (a CUDA device 0 is
//! device 0); two device types sharing an id (rare) stay separate traces with
//! the same number. Host memory is no GPU's: where the file has device
//! memory, CPU events are left out with a note (`Trace::notes`). A file with
//! host memory only (a program profiled on a CPU, standing in for its GPU
//! run) keeps it as device `-1`.
//!
//! The document is `{"traceEvents": [...], ...}` with any other keys
//! (`deviceProperties`, `distributedInfo`, `baseTimeNanoseconds`, ...) or a
//! bare event array; `ts` is a number (a numeric string is also read). A
//! document with no `[memory]` event at all is refused: it was recorded
//! without `profile_memory=True` (or is another JSON file), and has nothing
//! to replay.

use std::cmp::Ordering;
use std::collections::{BTreeMap, HashMap};

use serde_json::Value as Json;

use crate::error::{Location, TraceError};
use crate::model::{AllocId, DeviceTrace, Op, StepMarks, Trace};

/// PyTorch's `DeviceType::CPU`.
const DEVICE_TYPE_CPU: i64 = 0;

/// Parses a chrome-trace JSON document (object with `traceEvents`, or a bare
/// event array).
pub fn parse_chrome_trace(bytes: &[u8]) -> Result<Trace, TraceError> {
    let root: Json = serde_json::from_slice(bytes).map_err(|e| {
        TraceError::new(
            "chrome-trace",
            Location::Line {
                line: e.line(),
                column: e.column(),
            },
            format!("invalid JSON: {e}"),
        )
    })?;
    let events = match &root {
        Json::Array(events) => events,
        Json::Object(map) => match map.get("traceEvents") {
            Some(Json::Array(events)) => events,
            Some(_) => return Err(entry_error("traceEvents", "expected an array")),
            None => return Err(entry_error("traceEvents", "missing")),
        },
        _ => return Err(entry_error("document", "expected an object or an array")),
    };

    let mut memory_events = Vec::new();
    let mut step_times = Vec::new();
    for (index, event) in events.iter().enumerate() {
        match event.get("name").and_then(Json::as_str) {
            Some("[memory]") => memory_events.push(MemoryEvent::parse(index, event, false)?),
            Some("[OutOfMemory]") => memory_events.push(MemoryEvent::parse(index, event, true)?),
            Some(name) if name.starts_with("ProfilerStep#") => {
                if let Some(ts) = event.get("ts").and_then(Json::as_f64) {
                    step_times.push(ts);
                }
            }
            _ => {}
        }
    }
    step_times.sort_by(f64::total_cmp);
    if memory_events.is_empty() {
        return Err(entry_error(
            "traceEvents",
            "no [memory] events (record with torch.profiler.profile(profile_memory=True))",
        ));
    }
    // Stable, so events with equal timestamps keep their file order.
    memory_events.sort_by(|a, b| a.ts.total_cmp(&b.ts));

    let mut devices: BTreeMap<(i64, i64), DeviceBuilder> = BTreeMap::new();
    for event in &memory_events {
        devices
            .entry((event.device, event.device_type))
            .or_insert_with(|| DeviceBuilder::new(event.device, &step_times))
            .apply(event);
    }
    let mut notes = Vec::new();
    let has_accelerator = devices.keys().any(|&(_, kind)| kind != DEVICE_TYPE_CPU);
    if has_accelerator {
        if let Some(host) = devices.remove(&(-1, DEVICE_TYPE_CPU)) {
            notes.push(format!(
                "host (CPU) memory left out: {} allocations, not on a GPU",
                host.next_id
            ));
        }
    }
    Ok(Trace {
        source: String::new(),
        devices: devices.into_values().map(DeviceBuilder::finish).collect(),
        notes,
    })
}

fn entry_error(path: &str, message: &str) -> TraceError {
    TraceError::new(
        "chrome-trace",
        Location::Entry(path.to_string()),
        message.to_string(),
    )
}

/// One `[memory]` or `[OutOfMemory]` event.
struct MemoryEvent {
    ts: f64,
    addr: u64,
    bytes: i64,
    device_type: i64,
    /// Its `Device Id`, or -1 for host memory.
    device: i64,
    /// `[OutOfMemory]`: `bytes` is the request that failed.
    out_of_memory: bool,
}

impl MemoryEvent {
    fn parse(index: usize, event: &Json, out_of_memory: bool) -> Result<Self, TraceError> {
        let path = format!("traceEvents[{index}]");
        let name = if out_of_memory {
            "[OutOfMemory]"
        } else {
            "[memory]"
        };
        let args = event
            .get("args")
            .filter(|a| a.is_object())
            .ok_or_else(|| entry_error(&path, &format!("{name} event without an 'args' object")))?;
        let int = |key: &str, default: Option<i64>| -> Result<i64, TraceError> {
            match args.get(key) {
                None => default.ok_or_else(|| entry_error(&path, &format!("missing args.{key}"))),
                Some(value) => value
                    .as_i64()
                    // Host addresses may exceed i64::MAX; a size or device
                    // that does would wrap negative (a byte count into a free).
                    .or_else(|| value.as_u64().filter(|_| key == "Addr").map(|n| n as i64))
                    .ok_or_else(|| {
                        entry_error(
                            &path,
                            &format!("args.{key} is not an integer of 64 bits: {value}"),
                        )
                    }),
            }
        };
        let ts = match event.get("ts") {
            None => Some(0.0),
            Some(Json::String(text)) => text.trim().parse::<f64>().ok(),
            Some(ts) => ts.as_f64(),
        };
        let ts = ts
            .filter(|ts| ts.is_finite())
            .ok_or_else(|| entry_error(&path, "ts is not a number"))?;
        let device_type = int("Device Type", Some(DEVICE_TYPE_CPU))?;
        // Host memory is one device whatever id the profiler gives it; a
        // GPU's event without its device cannot be placed.
        let device = if device_type == DEVICE_TYPE_CPU {
            -1
        } else {
            int("Device Id", None)?
        };
        Ok(MemoryEvent {
            ts,
            // An OOM names no address.
            addr: int("Addr", out_of_memory.then_some(0))? as u64,
            bytes: int("Bytes", None)?,
            device_type,
            device,
            out_of_memory,
        })
    }
}

/// Accumulates one device's ops.
struct DeviceBuilder<'t> {
    trace: DeviceTrace,
    live: HashMap<u64, AllocId>,
    next_id: AllocId,
    /// The first and last `ts` seen, in microseconds.
    span: Option<(f64, f64)>,
    /// The file's steps, marked at this device's ops.
    steps: StepMarks<'t, f64>,
}

impl<'t> DeviceBuilder<'t> {
    /// `step_times`: when the file's steps began, sorted.
    fn new(device: i64, step_times: &'t [f64]) -> Self {
        DeviceBuilder {
            trace: DeviceTrace {
                device,
                ..DeviceTrace::default()
            },
            live: HashMap::new(),
            next_id: 0,
            span: None,
            steps: StepMarks::new(step_times, None),
        }
    }

    fn finish(mut self) -> DeviceTrace {
        self.steps
            .close(self.trace.ops.len(), &mut self.trace.step_starts);
        self.trace.recorded_span_us = self
            .span
            .map(|(first, last)| (last - first).max(0.0).round() as u64);
        self.trace
    }

    fn skip(&mut self, reason: &str) {
        *self.trace.skipped.entry(reason.to_string()).or_default() += 1;
    }

    /// Applies `event`.
    fn apply(&mut self, event: &MemoryEvent) {
        self.steps
            .at(event.ts, self.trace.ops.len(), &mut self.trace.step_starts);
        let (first, _) = self.span.unwrap_or((event.ts, event.ts));
        // Events arrive sorted by `ts`.
        self.span = Some((first, event.ts));
        if event.out_of_memory {
            // The profiler logs no free device memory for an OOM.
            self.trace.ops.push(Op::Oom {
                size: event.bytes.unsigned_abs(),
                stream: 0,
                device_free: 0,
            });
            return;
        }
        match event.bytes.cmp(&0) {
            Ordering::Equal => self.skip("zero-byte event"),
            Ordering::Greater => {
                if let Some(old) = self.live.remove(&event.addr) {
                    // The profiler missed the free; the address cannot be
                    // handed out twice, so the old allocation is gone.
                    self.skip("alloc at a live address (old one freed first)");
                    self.trace.ops.push(Op::Free { id: old });
                }
                let id = self.next_id;
                self.next_id += 1;
                self.live.insert(event.addr, id);
                self.trace.ops.push(Op::Alloc {
                    id,
                    size: event.bytes.unsigned_abs(),
                    stream: 0,
                });
            }
            Ordering::Less => match self.live.remove(&event.addr) {
                Some(id) => self.trace.ops.push(Op::Free { id }),
                // Allocated before profiling started.
                None => self.skip("free of an unknown address"),
            },
        }
    }
}

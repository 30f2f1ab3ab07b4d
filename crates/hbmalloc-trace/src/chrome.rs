//! torch.profiler chrome traces (`profile_memory=True`) → [`Trace`].
//!
//! The profiler logs one `[memory]` instant event per allocation and free:
//! `args.Addr`, `args.Bytes` (negative for a free), `args["Device Type"]`
//! (0 CPU, 1 CUDA) and `args["Device Id"]`. Events are replayed in timestamp
//! order; it knows nothing of segments or streams, so every op is on stream 0.

use std::collections::{BTreeMap, HashMap};

use serde_json::Value as Json;

use crate::error::{Location, TraceError};
use crate::model::{AllocId, DeviceTrace, Op, Trace};

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
    for (index, event) in events.iter().enumerate() {
        if event.get("name").and_then(Json::as_str) == Some("[memory]") {
            memory_events.push(MemoryEvent::parse(index, event)?);
        }
    }
    // Stable, so events with equal timestamps keep their file order.
    memory_events.sort_by(|a, b| a.ts.total_cmp(&b.ts));

    let mut devices: BTreeMap<(i64, i64), DeviceBuilder> = BTreeMap::new();
    for event in &memory_events {
        let device = if event.device_type == DEVICE_TYPE_CPU {
            -1
        } else {
            event.device_id
        };
        devices
            .entry((device, event.device_type))
            .or_insert_with(|| DeviceBuilder::new(device))
            .apply(event);
    }
    Ok(Trace {
        source: String::new(),
        devices: devices.into_values().map(|d| d.trace).collect(),
    })
}

fn entry_error(path: &str, message: &str) -> TraceError {
    TraceError::new(
        "chrome-trace",
        Location::Entry(path.to_string()),
        message.to_string(),
    )
}

/// One `[memory]` event.
struct MemoryEvent {
    ts: f64,
    addr: u64,
    bytes: i64,
    device_type: i64,
    device_id: i64,
}

impl MemoryEvent {
    fn parse(index: usize, event: &Json) -> Result<Self, TraceError> {
        let path = format!("traceEvents[{index}]");
        let args = event
            .get("args")
            .filter(|a| a.is_object())
            .ok_or_else(|| entry_error(&path, "[memory] event without an 'args' object"))?;
        let int = |key: &str, default: Option<i64>| -> Result<i64, TraceError> {
            match args.get(key) {
                None => default.ok_or_else(|| entry_error(&path, &format!("missing args.{key}"))),
                Some(value) => value
                    .as_i64()
                    // Host addresses may exceed i64::MAX.
                    .or_else(|| value.as_u64().map(|n| n as i64))
                    .ok_or_else(|| {
                        entry_error(&path, &format!("args.{key} is not an integer: {value}"))
                    }),
            }
        };
        let ts = match event.get("ts") {
            None => 0.0,
            Some(ts) => ts
                .as_f64()
                .ok_or_else(|| entry_error(&path, &format!("ts is not a number: {ts}")))?,
        };
        Ok(MemoryEvent {
            ts,
            addr: int("Addr", None)? as u64,
            bytes: int("Bytes", None)?,
            device_type: int("Device Type", Some(DEVICE_TYPE_CPU))?,
            device_id: int("Device Id", Some(-1))?,
        })
    }
}

/// Accumulates one device's ops.
struct DeviceBuilder {
    trace: DeviceTrace,
    live: HashMap<u64, AllocId>,
    next_id: AllocId,
}

impl DeviceBuilder {
    fn new(device: i64) -> Self {
        DeviceBuilder {
            trace: DeviceTrace {
                device,
                ..DeviceTrace::default()
            },
            live: HashMap::new(),
            next_id: 0,
        }
    }

    fn skip(&mut self, reason: &str) {
        *self.trace.skipped.entry(reason.to_string()).or_default() += 1;
    }

    fn apply(&mut self, event: &MemoryEvent) {
        match event.bytes {
            0 => self.skip("zero-byte event"),
            bytes if bytes > 0 => {
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
                    size: bytes.unsigned_abs(),
                    stream: 0,
                });
            }
            _ => match self.live.remove(&event.addr) {
                Some(id) => self.trace.ops.push(Op::Free { id }),
                // Allocated before profiling started.
                None => self.skip("free of an unknown address"),
            },
        }
    }
}

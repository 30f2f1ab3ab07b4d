//! RMM logging-adaptor CSV (`rmm::mr::logging_resource_adaptor`) → [`Trace`].
//!
//! The header is `Thread,Time,Action,Pointer,Size,Stream` in every RMM
//! version; each line is `thread,HH:MM:SS.micros,action,pointer,size,stream`
//! with action `allocate`, `free` or `allocate failure`. Pointers and
//! streams are hex: `0x7f..` (fmt, spdlog-era RMM) or bare `7f..`
//! (`%llx`, rapids-logger-era RMM); a null one is `0x0` or `0`.
//!
//! One file is one device. `rmm.reinitialize(logging=True, devices=[...])`
//! writes one log per device and names it `<name>.dev<N><ext>`; that `N` is
//! the device, otherwise 0.

use std::collections::HashMap;

use crate::error::{Location, TraceError};
use crate::model::{AllocId, DeviceTrace, Op, Trace};

/// The header line RMM writes.
pub const RMM_HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

/// Parses an RMM log; `name` (the file name) may say the device.
pub fn parse_rmm_csv(name: &str, bytes: &[u8]) -> Result<Trace, TraceError> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        TraceError::new(
            "rmm-csv",
            Location::Byte(e.valid_up_to() as u64),
            "not valid UTF-8",
        )
    })?;
    let mut lines = text.lines().enumerate();
    match lines.next() {
        Some((_, header)) if header.trim_start_matches('\u{feff}').trim() == RMM_HEADER => {}
        _ => return Err(line_error(0, format!("expected the header '{RMM_HEADER}'"))),
    }

    let mut trace = DeviceTrace {
        device: device_from_file_name(name),
        ..DeviceTrace::default()
    };
    let mut live: HashMap<u64, AllocId> = HashMap::new();
    let mut next_id: AllocId = 0;
    let mut span = TimeSpan::default();
    for (index, line) in lines {
        if line.trim().is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        let [_thread, time, action, pointer, size, stream] = fields[..] else {
            return Err(line_error(
                index,
                format!("expected 6 fields, found {}", fields.len()),
            ));
        };
        span.add(time);
        let pointer = parse_hex(pointer)
            .ok_or_else(|| line_error(index, format!("bad pointer {pointer:?}")))?;
        let size: u64 = size
            .parse()
            .map_err(|_| line_error(index, format!("bad size {size:?}")))?;
        let stream =
            parse_hex(stream).ok_or_else(|| line_error(index, format!("bad stream {stream:?}")))?;
        match action {
            "allocate" => {
                if let Some(old) = live.remove(&pointer) {
                    *trace
                        .skipped
                        .entry("allocate at a live address (old one freed first)".into())
                        .or_default() += 1;
                    trace.ops.push(Op::Free { id: old });
                }
                let id = next_id;
                next_id += 1;
                live.insert(pointer, id);
                trace.ops.push(Op::Alloc { id, size, stream });
            }
            "free" => match live.remove(&pointer) {
                Some(id) => trace.ops.push(Op::Free { id }),
                None => {
                    *trace
                        .skipped
                        .entry("free of an unknown address".into())
                        .or_default() += 1
                }
            },
            "allocate failure" => trace.ops.push(Op::Oom {
                size,
                stream,
                device_free: 0,
            }),
            other => return Err(line_error(index, format!("unknown action {other:?}"))),
        }
    }
    trace.recorded_span_us = span.micros;
    // A log of nothing (a header, or frees of addresses it never saw) holds
    // no device's activity, as an empty snapshot holds none.
    let devices = if trace.ops.is_empty() {
        Vec::new()
    } else {
        vec![trace]
    };
    Ok(Trace {
        source: String::new(),
        devices,
        notes: Vec::new(),
    })
}

/// The time a log spans, from its `HH:MM:SS.micros` stamps (time of day: a
/// stamp earlier than the one before it is taken as the next day).
#[derive(Default)]
struct TimeSpan {
    last: Option<u64>,
    micros: Option<u64>,
}

impl TimeSpan {
    fn add(&mut self, stamp: &str) {
        const DAY_US: u64 = 86_400_000_000;
        let Some(now) = time_of_day_us(stamp) else {
            return;
        };
        if let Some(last) = self.last {
            let step = if now >= last {
                now - last
            } else {
                now + DAY_US - last
            };
            self.micros = Some(self.micros.unwrap_or(0) + step);
        }
        self.last = Some(now);
    }
}

/// `HH:MM:SS.micros` (RMM also writes `HH:MM:SS:micros`) in microseconds
/// since midnight; `None` for anything else.
fn time_of_day_us(stamp: &str) -> Option<u64> {
    let mut parts = stamp.splitn(4, [':', '.']);
    let mut field = |max: u64| -> Option<u64> {
        let value: u64 = parts.next()?.parse().ok()?;
        (value < max).then_some(value)
    };
    let (h, m, s) = (field(24)?, field(60)?, field(61)?);
    let fraction = parts.next().unwrap_or("0");
    let digits = fraction.len().min(6);
    let micros: u64 = fraction.get(..digits)?.parse().ok()?;
    let micros = micros * 10u64.pow(6 - digits as u32);
    Some(((h * 60 + m) * 60 + s) * 1_000_000 + micros)
}

/// `index` is 0-based; messages say the 1-based line.
fn line_error(index: usize, message: String) -> TraceError {
    TraceError::new(
        "rmm-csv",
        Location::Line {
            line: index + 1,
            column: 0,
        },
        message,
    )
}

/// A pointer or stream: hex with or without `0x` (RMM prints `0x7f..`; a
/// null stream may be `0`).
fn parse_hex(text: &str) -> Option<u64> {
    let digits = text
        .strip_prefix("0x")
        .or_else(|| text.strip_prefix("0X"))
        .unwrap_or(text);
    u64::from_str_radix(digits, 16).ok()
}

/// The `N` of a `.dev<N>` that RMM's Python package (`_append_id`) puts
/// before the extension of a per-device log name, e.g. `rmm_log.dev1.csv`
/// (the last such part wins; `.gz` and other suffixes may follow).
fn device_from_file_name(name: &str) -> i64 {
    name.split('.')
        .skip(1) // the stem: `dev1.csv` is not a `.dev1` suffix
        .filter_map(|part| part.strip_prefix("dev"))
        .filter(|digits| {
            (1..=9).contains(&digits.len()) && digits.bytes().all(|b| b.is_ascii_digit())
        })
        .filter_map(|digits| digits.parse().ok())
        .last()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_time_of_day_is_read_to_the_microsecond_and_nothing_else_is() {
        let us = |h: u64, m: u64, s: u64, micros: u64| {
            Some(((h * 60 + m) * 60 + s) * 1_000_000 + micros)
        };
        assert_eq!(time_of_day_us("10:00:00.000001"), us(10, 0, 0, 1));
        assert_eq!(time_of_day_us("23:59:59:750000"), us(23, 59, 59, 750_000));
        assert_eq!(time_of_day_us("01:02:03.25"), us(1, 2, 3, 250_000));
        assert_eq!(time_of_day_us("01:02:03"), us(1, 2, 3, 0));
        assert_eq!(time_of_day_us("00:00:00.1234567"), us(0, 0, 0, 123_456));
        // A leap second is a time of day; the 24th hour and the 60th minute
        // are not, nor is anything but numbers.
        assert_eq!(time_of_day_us("12:30:60.0"), us(12, 30, 60, 0));
        for stamp in [
            "24:00:00.0",
            "10:60:00.0",
            "10:00:61.0",
            "10:00",
            "10:0x:00",
            "",
        ] {
            assert_eq!(time_of_day_us(stamp), None, "{stamp}");
        }
    }

    #[test]
    fn a_time_span_adds_the_steps_between_stamps_past_midnight() {
        let mut span = TimeSpan::default();
        span.add("23:59:58.0");
        assert_eq!(span.micros, None, "one stamp spans no time");
        span.add("not a time");
        span.add("23:59:59.5");
        assert_eq!(span.micros, Some(1_500_000));
        span.add("23:59:59.5");
        span.add("00:00:00.25");
        assert_eq!(span.micros, Some(2_250_000));
    }
}

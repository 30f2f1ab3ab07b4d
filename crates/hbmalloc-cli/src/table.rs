//! Text output: the side-by-side comparison table, per-run reports and the
//! timeline's CSV.

use std::fmt::Write;

use hbmalloc_replay::{FidelityReport, Metrics, Plan, Timeline};

use crate::human;

/// A size in a narrow column: `2.53G`, `905M`, `12K`.
fn short(bytes: u64) -> String {
    const G: f64 = (1u64 << 30) as f64;
    const M: f64 = (1u64 << 20) as f64;
    let b = bytes as f64;
    if b >= 100.0 * G {
        format!("{:.1}G", b / G)
    } else if b >= G {
        format!("{:.2}G", b / G)
    } else if b >= M {
        format!("{:.0}M", b / M)
    } else {
        format!("{:.0}K", b / 1024.0)
    }
}

/// `policy:pytorch,expandable_segments:True` → `pytorch+expandable`.
pub fn label(settings: &str) -> String {
    settings
        .trim_start_matches("policy:")
        .replace(",expandable_segments:True", "+expandable")
        .replace(',', "+")
}

/// A trace's file name, shortened for a 35-column cell.
pub fn trace_name(source: &str) -> String {
    let name = source.trim_end_matches(".gz").trim_end_matches(".json");
    let name = name.trim_end_matches(".pickle").trim_end_matches(".pkl");
    // Keep both ends: file names often share a long prefix.
    let chars: Vec<char> = name.chars().collect();
    if chars.len() > 34 {
        let head: String = chars[..16].iter().collect();
        let tail: String = chars[chars.len() - 17..].iter().collect();
        format!("{head}…{tail}")
    } else {
        name.to_string()
    }
}

/// One row per trace and device; for each configuration its peak reserved,
/// waste, efficiency, minimum capacity and memory-moving driver calls; and,
/// where `plans` has one for the row, what the offline plan holds. The
/// footer says which driver the replays simulated (`driver`, one line).
pub fn compare_table(rows: &[Vec<Metrics>], plans: &[Option<Plan>], driver: &str) -> String {
    let mut out = String::new();
    let Some(first) = rows.first() else {
        return "no trace had any device activity\n".into();
    };
    let labels: Vec<String> = first.iter().map(|m| label(&m.settings)).collect();
    let planned = plans.iter().any(Option::is_some);
    let _ = write!(out, "{:<35} {:>4} {:>8} {:>8}", "", "", "", "recorded");
    if planned {
        let _ = write!(out, " | {:^22}", "planned (offline)");
    }
    for l in &labels {
        let _ = write!(out, " | {:^38}", l);
    }
    out.push('\n');
    let _ = write!(
        out,
        "{:<35} {:>4} {:>8} {:>8}",
        "trace", "dev", "live", "reserved"
    );
    if planned {
        let _ = write!(out, " | {:>8} {:>7} {:>5}", "reserved", "waste", "eff");
    }
    for _ in &labels {
        let _ = write!(
            out,
            " | {:>7} {:>7} {:>5} {:>8} {:>6}",
            "reserved", "waste", "eff", "min cap", "calls"
        );
    }
    out.push('\n');
    let width = out.lines().last().map_or(0, |l| l.chars().count());
    out += &"-".repeat(width);
    out.push('\n');
    let mut total_live = 0u64;
    // Per configuration: reserved, waste and calls, summed over the rows.
    let mut totals = vec![(0u64, 0u64, 0u64); labels.len()];
    let mut planned_totals = (0u64, 0u64);
    for (index, row) in rows.iter().enumerate() {
        let Some(m0) = row.first() else { continue };
        total_live += m0.peak_live_bytes;
        let recorded = m0
            .recorded
            .as_ref()
            .and_then(|r| r.peak_reserved_bytes)
            .map_or("-".to_string(), short);
        let _ = write!(
            out,
            "{:<35} {:>4} {:>8} {:>8}",
            trace_name(&m0.trace),
            m0.device,
            short(m0.peak_live_bytes),
            recorded
        );
        match plans.get(index).copied().flatten() {
            Some(plan) => {
                let reserved = plan.peak_mapped_bytes;
                let waste = reserved.saturating_sub(m0.peak_live_bytes);
                // As for the policies: nothing live and nothing held is 1.
                let efficiency = match reserved {
                    0 => 1.0,
                    _ => m0.peak_live_bytes as f64 / reserved as f64,
                };
                planned_totals.0 += reserved;
                planned_totals.1 += waste;
                let _ = write!(
                    out,
                    " | {:>8} {:>7} {:>5.3}",
                    short(reserved),
                    short(waste),
                    efficiency
                );
            }
            None if planned => {
                let _ = write!(out, " | {:>8} {:>7} {:>5}", "-", "-", "-");
            }
            None => {}
        }
        for (i, m) in row.iter().enumerate() {
            let total = &mut totals[i];
            total.0 += m.peak_reserved_bytes;
            total.1 += m.waste_bytes;
            total.2 += m.memory_device_calls;
            let min_cap = match (m.min_capacity_bytes, &m.out_of_memory) {
                (_, Some(_)) => "OOM".to_string(),
                (Some(c), None) => short(c),
                (None, None) => "-".to_string(),
            };
            let _ = write!(
                out,
                " | {:>8} {:>7} {:>5.3} {:>8} {:>6}",
                short(m.peak_reserved_bytes),
                short(m.waste_bytes),
                m.efficiency,
                min_cap,
                m.memory_device_calls
            );
        }
        out.push('\n');
    }
    out += &"-".repeat(width);
    out.push('\n');
    let _ = write!(
        out,
        "{:<35} {:>4} {:>8} {:>8}",
        "total (sums over the rows)",
        "",
        short(total_live),
        ""
    );
    if planned {
        let (reserved, waste) = planned_totals;
        let _ = write!(
            out,
            " | {:>8} {:>7} {:>5}",
            short(reserved),
            short(waste),
            ""
        );
    }
    for &(reserved, waste, calls) in &totals {
        let _ = write!(
            out,
            " | {:>8} {:>7} {:>5} {:>8} {:>6}",
            short(reserved),
            short(waste),
            "",
            "",
            calls
        );
    }
    out.push('\n');
    out += "\nlive: peak of live requested bytes; reserved: peak device memory held; waste = reserved - live;\n\
            eff = live / reserved; min cap: smallest device on which the trace completes (2 MiB resolution);\n\
            calls: driver calls that allocate, free, map or unmap memory. The total row sums each column.\n";
    if planned {
        out += "planned: each trace laid out offline, knowing all of it in advance (greedy by size), its\n\
                granules mapped only while a block lies on them (driver calls not counted): what\n\
                foresight alone would save.\n";
    }
    out += driver;
    out
}

/// A multi-line report of one run's metrics.
pub fn metrics_text(m: &Metrics) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{} device {} under {}", m.trace, m.device, m.settings);
    let _ = writeln!(out, "  ops                        {}", m.ops);
    let _ = writeln!(
        out,
        "  peak_live_bytes            {} ({})",
        m.peak_live_bytes,
        human(m.peak_live_bytes)
    );
    let _ = writeln!(
        out,
        "  peak_reserved_bytes        {} ({})",
        m.peak_reserved_bytes,
        human(m.peak_reserved_bytes)
    );
    let _ = writeln!(out, "  efficiency                 {:.4}", m.efficiency);
    if let Some(c) = m.min_capacity_bytes {
        let _ = writeln!(
            out,
            "  min_capacity_bytes         {} ({}, resolution {})",
            c,
            human(c),
            human(m.min_capacity_resolution_bytes)
        );
    }
    let calls: Vec<String> = m
        .device_calls
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let _ = writeln!(out, "  device_calls               {}", calls.join(" "));
    let _ = writeln!(out, "  cache_hit_rate             {:.4}", m.cache_hit_rate);
    let _ = match m.steady_state_device_calls {
        Some(calls) => writeln!(out, "  steady_state_device_calls  {calls}"),
        None => writeln!(
            out,
            "  steady_state_device_calls  none: out of memory before the second half of the trace"
        ),
    };
    let _ = writeln!(
        out,
        "  steady_state_growth_floor  {} (fewest growths there for any allocator that meets the efficiency target wherever the trace might end)",
        m.steady_state_growth_floor
    );
    let _ = writeln!(
        out,
        "  simulated_driver_seconds   {:.6}",
        m.simulated_driver_seconds
    );
    let _ = writeln!(out, "  ns_per_op                  {:.1}", m.ns_per_op);
    if let Some(r) = &m.recorded {
        if let Some(p) = r.peak_reserved_bytes {
            let _ = writeln!(out, "  recorded peak_reserved     {} ({})", p, human(p));
        }
    }
    if let Some((op, report)) = &m.out_of_memory {
        let _ = writeln!(out, "  out of memory at op {op}:");
        for line in report.render().lines() {
            let _ = writeln!(out, "    {line}");
        }
    }
    for (op, report) in &m.reproduced_ooms {
        let _ = writeln!(out, "  recorded out-of-memory error reproduced at op {op}:");
        for line in report.render().lines() {
            let _ = writeln!(out, "    {line}");
        }
        let _ = writeln!(
            out,
            "    PyTorch would say: {}",
            report.pytorch_message(m.device)
        );
    }
    out
}

/// One snapshot device's fidelity result.
pub fn fidelity_text(source: &str, r: &FidelityReport) -> String {
    let mut out = String::new();
    let status = if r.exact() {
        "EXACT".to_string()
    } else {
        format!("diverges at event {}", r.matching_prefix)
    };
    let foreign = if r.foreign_allocator {
        " (torch_npu: reported, not required)"
    } else {
        ""
    };
    let config = if r.config.is_empty() {
        "default config"
    } else {
        r.config.as_str()
    };
    let _ = writeln!(
        out,
        "{source} device {} [{config}]{foreign}: recorded {} replayed {} matching prefix {} — {status}",
        r.device, r.recorded, r.replayed, r.matching_prefix
    );
    if let Some(note) = &r.replay_note {
        let _ = writeln!(out, "  note: {note}");
    }
    if let Some(d) = &r.first_divergence {
        let start = d.index.saturating_sub(hbmalloc_replay::CONTEXT_BEFORE);
        let fmt = |events: &[hbmalloc_replay::SegmentEvent]| {
            events
                .iter()
                .enumerate()
                .map(|(i, e)| format!("#{} {} {} @op {}", start + i, e.action, e.size, e.op_index))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(out, "  recorded: {}", fmt(&d.recorded_context));
        let _ = writeln!(out, "  replayed: {}", fmt(&d.replayed_context));
    }
    out
}

/// Writes the timeline as CSV to `out`, a row at a time (a trace may have
/// millions of ops): `op` (ops replayed; 0 is the initial state),
/// `live_bytes`, then one column of reserved bytes per configuration, named
/// `reserved_bytes SETTINGS` (quoted: settings hold commas). A replay that ran
/// out of memory leaves its column empty from the op that failed.
pub fn write_timeline_csv(
    timeline: &Timeline,
    out: &mut impl std::io::Write,
) -> std::io::Result<()> {
    let quoted = |field: &str| format!("\"{}\"", field.replace('"', "\"\""));
    write!(out, "op,live_bytes")?;
    for (settings, _) in &timeline.reserved_bytes {
        write!(out, ",{}", quoted(&format!("reserved_bytes {settings}")))?;
    }
    writeln!(out)?;
    for (op, live) in timeline.live_bytes.iter().enumerate() {
        write!(out, "{op},{live}")?;
        for (_, reserved) in &timeline.reserved_bytes {
            match reserved.get(op) {
                Some(bytes) => write!(out, ",{bytes}")?,
                None => write!(out, ",")?,
            }
        }
        writeln!(out)?;
    }
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timeline_csv_has_a_quoted_column_per_configuration_and_blanks_after_an_error() {
        let timeline = Timeline {
            live_bytes: vec![0, 512, 1024],
            reserved_bytes: vec![
                (
                    "policy:pytorch,expandable_segments:True".into(),
                    vec![0, 2048, 2048],
                ),
                ("policy:hbm".into(), vec![0, 4096]),
            ],
        };
        let mut csv = Vec::new();
        write_timeline_csv(&timeline, &mut csv).unwrap();
        assert_eq!(
            String::from_utf8(csv).unwrap(),
            "op,live_bytes,\"reserved_bytes policy:pytorch,expandable_segments:True\",\
             \"reserved_bytes policy:hbm\"\n\
             0,0,0,0\n\
             1,512,2048,4096\n\
             2,1024,2048,\n"
        );
    }
}

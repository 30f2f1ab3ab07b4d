//! Text output: the side-by-side comparison table, per-run reports and the
//! timeline's CSV.

use std::fmt::Write;

use hbmalloc::CallKind;
use hbmalloc_replay::{
    CallsLog, FidelityReport, Metrics, Plan, Timeline, Verdict, DRIFT_TOLERANCE,
};
use hbmalloc_trace::{DeviceTrace, InitialBlockState, Op};

use crate::human;

/// Seconds as milliseconds below one, else seconds: `12.3ms`, `1.24s`.
fn seconds(s: f64) -> String {
    if s < 1.0 {
        format!("{:.1}ms", s * 1e3)
    } else {
        format!("{s:.2}s")
    }
}

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

/// A device index as the tables show it: torch.profiler files CPU memory
/// under device -1, shown as `cpu`.
pub fn device_label(device: i64) -> String {
    if device == -1 {
        "cpu".to_string()
    } else {
        device.to_string()
    }
}

/// `n` and `noun`, plural unless `n` is 1 (`1 segment`, `3 segments`).
pub fn count_of(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// `source device N` (`source device cpu` for host memory): how messages
/// name one device of a trace.
pub fn on_device(source: &str, device: i64) -> String {
    format!("{source} device {}", device_label(device))
}

/// How [`compare_table`] lays the comparison out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// One block per trace and device, a line per configuration, in at most
    /// this many columns (trace names and long settings are shortened).
    Blocks {
        /// Columns available.
        width: usize,
    },
    /// One line per trace and device, the configurations side by side
    /// (about 60 columns per configuration).
    Wide,
}

/// The per-configuration columns of the block layout: header and width.
/// A metric added here widens every block by its width, and nothing else.
const BLOCK_COLUMNS: [(&str, usize); 6] = [
    ("reserved", 8),
    ("waste", 8),
    ("eff", 7),
    ("min cap", 8),
    ("calls", 7),
    ("drv", 8),
];

/// The narrowest label column of the block layout.
const MIN_LABEL_WIDTH: usize = 12;

/// `text` in lines of at most `width` characters, broken between words.
pub fn wrap(text: &str, width: usize) -> String {
    let mut out = String::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.chars().count() + 1 + word.chars().count() > width {
            out += &line;
            out.push('\n');
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line += word;
    }
    if !line.is_empty() {
        out += &line;
        out.push('\n');
    }
    out
}

/// `text` cut to `width` characters, with `…` where it was cut.
pub fn fit(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        return text.to_string();
    }
    let mut cut: String = text.chars().take(width.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// One configuration's cells: reserved, waste, efficiency, minimum capacity
/// and driver calls; a replay that ran out of memory has no waste or
/// efficiency (its reserved memory is that of the part that ran).
fn cells(m: &Metrics) -> [String; 6] {
    let min_cap = match (m.min_capacity_bytes, m.out_of_memory_at_op) {
        (Some(c), _) => short(c),
        (None, Some(_)) => "OOM".to_string(),
        (None, None) => "-".to_string(),
    };
    [
        short(m.peak_reserved_bytes),
        m.waste_bytes.map_or("-".to_string(), short),
        m.efficiency.map_or("-".to_string(), |e| format!("{e:.3}")),
        min_cap,
        m.memory_device_calls.to_string(),
        seconds(m.simulated_driver_seconds),
    ]
}

/// Sums over the rows, per configuration: reserved, waste and calls, and
/// how many rows ran out of memory (their reserved and waste are not summed).
#[derive(Clone, Copy, Default)]
struct Totals {
    reserved: u64,
    waste: u64,
    calls: u64,
    driver_seconds: f64,
    out_of_memory: usize,
}

fn totals(rows: &[Vec<Metrics>], configurations: usize) -> (u64, Vec<Totals>) {
    let mut live = 0;
    let mut totals = vec![Totals::default(); configurations];
    for row in rows {
        live += row.first().map_or(0, |m| m.peak_live_bytes);
        for (total, m) in totals.iter_mut().zip(row) {
            total.calls += m.memory_device_calls;
            total.driver_seconds += m.simulated_driver_seconds;
            match m.waste_bytes {
                Some(waste) => {
                    total.reserved += m.peak_reserved_bytes;
                    total.waste += waste;
                }
                None => total.out_of_memory += 1,
            }
        }
    }
    (live, totals)
}

/// The offline plan's reserved, waste and efficiency for a row.
fn plan_cells(plan: Plan, live: u64) -> (u64, u64, f64) {
    let reserved = plan.peak_mapped_bytes;
    // As for the policies: nothing live and nothing held is 1.
    let efficiency = match reserved {
        0 => 1.0,
        _ => live as f64 / reserved as f64,
    };
    (reserved, reserved.saturating_sub(live), efficiency)
}

/// The comparison of `rows` (one per trace and device, a [`Metrics`] per
/// configuration), with the offline plan where `plans` has one, laid out as
/// `layout` says; a legend follows, and a footer on which driver the replays
/// simulated (`driver`, a sentence).
pub fn compare_table(
    rows: &[Vec<Metrics>],
    plans: &[Option<Plan>],
    driver: &str,
    layout: Layout,
) -> String {
    let Some(first) = rows.first() else {
        return "no trace had any device activity\n".into();
    };
    let labels: Vec<String> = first.iter().map(|m| label(&m.settings)).collect();
    let planned = plans.iter().any(Option::is_some);
    let mut out = match layout {
        Layout::Blocks { width } => blocks(rows, plans, &labels, width),
        Layout::Wide => wide(rows, plans, &labels, planned),
    };
    let mut legend = String::from(
        "live: peak of live requested bytes. reserved: peak device memory held. waste = \
         reserved - live. eff = live / reserved. min cap: the smallest device on which the \
         trace completes (2 MiB resolution). calls: driver calls that allocate, free, map or \
         unmap memory. drv: simulated time in driver calls. OOM: out of memory on the device given (--capacity): only part of the \
         trace ran, so no waste or eff. cpu: a torch.profiler trace's CPU memory. Sizes are \
         binary (1G = 2^30 bytes). --json has every metric.",
    );
    if planned {
        legend += " planned: each trace laid out offline, knowing all of it in advance (greedy \
                   by size), its granules mapped only while a block lies on them (driver calls \
                   not counted): what foresight alone would save.";
    }
    legend.push(' ');
    legend += driver;
    let legend_width = match layout {
        Layout::Blocks { width } => width.min(100),
        Layout::Wide => 100,
    };
    out.push('\n');
    out += &wrap(&legend, legend_width);
    out
}

/// The block layout: a header, then per trace and device a line naming it
/// and a line per configuration; then the totals, as a block.
fn blocks(
    rows: &[Vec<Metrics>],
    plans: &[Option<Plan>],
    labels: &[String],
    width: usize,
) -> String {
    let metrics_width: usize = BLOCK_COLUMNS.iter().map(|(_, w)| w).sum();
    let longest = labels
        .iter()
        .map(|l| l.chars().count())
        .chain(["planned (offline)".len(), "as recorded".len()])
        .max()
        .unwrap_or(0);
    let label_width = longest
        .min(width.saturating_sub(metrics_width + 2))
        .max(MIN_LABEL_WIDTH);
    let line = |label: &str, cells: &[String]| {
        let mut text = format!("  {:<label_width$}", fit(label, label_width));
        for ((_, w), cell) in BLOCK_COLUMNS.iter().zip(cells) {
            let _ = write!(text, "{cell:>w$}");
        }
        text.trim_end().to_string() + "\n"
    };
    let headers: Vec<String> = BLOCK_COLUMNS.iter().map(|(h, _)| h.to_string()).collect();
    let mut out = line("", &headers);
    let name_width = width.max(MIN_LABEL_WIDTH + 20);
    for (index, row) in rows.iter().enumerate() {
        let Some(m0) = row.first() else { continue };
        let device = match m0.device {
            -1 => "CPU memory".to_string(),
            d => format!("device {d}"),
        };
        let about = format!(", {device}, peak live {}", short(m0.peak_live_bytes));
        let name = fit(&m0.trace, name_width.saturating_sub(about.chars().count()));
        let _ = writeln!(out, "\n{name}{about}");
        if let Some(recorded) = m0.recorded.as_ref().and_then(|r| r.peak_reserved_bytes) {
            let waste = recorded.saturating_sub(m0.peak_live_bytes);
            out += &line("as recorded", &[short(recorded), short(waste)]);
        }
        if let Some(plan) = plans.get(index).copied().flatten() {
            let (reserved, waste, efficiency) = plan_cells(plan, m0.peak_live_bytes);
            out += &line(
                "planned (offline)",
                &[short(reserved), short(waste), format!("{efficiency:.3}")],
            );
        }
        for (m, label) in row.iter().zip(labels) {
            match m.out_of_memory_at_op {
                None => out += &line(label, &cells(m)),
                Some(op) => {
                    let min_cap = m
                        .min_capacity_bytes
                        .map_or(String::new(), |c| format!("; min cap {}", short(c)));
                    let stopped = format!(
                        "  {:<label_width$}   out of memory at op {op} of {} ({} reserved by \
                         then{min_cap})",
                        fit(label, label_width),
                        m.trace_ops,
                        short(m.peak_reserved_bytes)
                    );
                    out += &fit(&stopped, width.max(metrics_width + label_width + 2));
                    out.push('\n');
                }
            }
        }
    }
    if rows.len() < 2 {
        return out;
    }
    let (live, totals) = totals(rows, labels.len());
    let _ = writeln!(
        out,
        "\ntotal of the {} rows above, peak live {}",
        rows.len(),
        short(live)
    );
    for (total, label) in totals.iter().zip(labels) {
        let mut cells = vec![String::new(); BLOCK_COLUMNS.len()];
        if total.out_of_memory == 0 {
            cells[0] = short(total.reserved);
            cells[1] = short(total.waste);
        } else {
            cells[0] = "-".into();
            cells[1] = "-".into();
        }
        cells[4] = total.calls.to_string();
        cells[5] = seconds(total.driver_seconds);
        let mut text = line(label, &cells);
        if total.out_of_memory > 0 {
            text.pop();
            let _ = writeln!(text, "  ({} OOM)", total.out_of_memory);
        }
        out += &text;
    }
    out
}

/// The wide layout: a row per trace and device, the configurations side by
/// side, then a row of sums.
fn wide(rows: &[Vec<Metrics>], plans: &[Option<Plan>], labels: &[String], planned: bool) -> String {
    let mut out = String::new();
    let _ = write!(out, "{:<35} {:>4} {:>8} {:>8}", "", "", "", "recorded");
    if planned {
        let _ = write!(out, " | {:^22}", "planned (offline)");
    }
    for l in labels {
        let _ = write!(out, " | {:^47}", l);
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
    for _ in labels {
        let _ = write!(
            out,
            " | {:>8} {:>7} {:>5} {:>8} {:>6} {:>8}",
            "reserved", "waste", "eff", "min cap", "calls", "drv"
        );
    }
    out.push('\n');
    let width = out.lines().last().map_or(0, |l| l.chars().count());
    out += &"-".repeat(width);
    out.push('\n');
    let mut planned_totals = (0u64, 0u64);
    for (index, row) in rows.iter().enumerate() {
        let Some(m0) = row.first() else { continue };
        let recorded = m0
            .recorded
            .as_ref()
            .and_then(|r| r.peak_reserved_bytes)
            .map_or("-".to_string(), short);
        let _ = write!(
            out,
            "{:<35} {:>4} {:>8} {:>8}",
            trace_name(&m0.trace),
            device_label(m0.device),
            short(m0.peak_live_bytes),
            recorded
        );
        match plans.get(index).copied().flatten() {
            Some(plan) => {
                let (reserved, waste, efficiency) = plan_cells(plan, m0.peak_live_bytes);
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
        for m in row {
            let [reserved, waste, efficiency, min_cap, calls, drv] = cells(m);
            let _ = write!(
                out,
                " | {reserved:>8} {waste:>7} {efficiency:>5} {min_cap:>8} {calls:>6} {drv:>8}"
            );
        }
        out.push('\n');
    }
    out += &"-".repeat(width);
    out.push('\n');
    let (live, totals) = totals(rows, labels.len());
    let _ = write!(
        out,
        "{:<35} {:>4} {:>8} {:>8}",
        "total (sums over the rows)",
        "",
        short(live),
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
    for total in &totals {
        let (reserved, waste) = match total.out_of_memory {
            0 => (short(total.reserved), short(total.waste)),
            _ => ("-".to_string(), "-".to_string()),
        };
        let _ = write!(
            out,
            " | {reserved:>8} {waste:>7} {:>5} {:>8} {:>6} {:>8}",
            "",
            "",
            total.calls,
            seconds(total.driver_seconds)
        );
    }
    out.push('\n');
    out
}

/// A multi-line report of one run's metrics.
pub fn metrics_text(m: &Metrics) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} device {} under {}",
        m.trace,
        device_label(m.device),
        m.settings
    );
    if let Some(op) = m.out_of_memory_at_op {
        let _ = writeln!(
            out,
            "  stopped                    out of memory at op {op} of {}: the figures below cover \
             the ops before it",
            m.trace_ops
        );
    }
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
    let _ = match m.efficiency {
        Some(efficiency) => writeln!(out, "  efficiency                 {efficiency:.4}"),
        None => writeln!(
            out,
            "  efficiency                 none: the trace did not run to its end"
        ),
    };
    if let Some(half) = m.efficiency_at_half {
        let _ = writeln!(
            out,
            "  efficiency_at_half         {half:.4} (the first half of the ops alone)"
        );
    }
    if !m.drift_within_reach {
        let _ = writeln!(
            out,
            "  drift_within_reach         no (no allocator that holds whole granules meets the efficiency target with efficiency within {DRIFT_TOLERANCE} of efficiency_at_half)"
        );
    }
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
    let _ = match (m.steady_state_device_calls, m.steady_state_driver_seconds) {
        (Some(calls), Some(seconds)) => writeln!(
            out,
            "  steady_state_device_calls  {calls} ({seconds:.6} s of simulated driver time)"
        ),
        _ => writeln!(
            out,
            "  steady_state_device_calls  none: out of memory before the second half of the trace"
        ),
    };
    let _ = writeln!(
        out,
        "  steady_state_growth_floor  {} (fewest growths there for any allocator of whole granules that meets the efficiency target wherever the trace might end)",
        m.steady_state_growth_floor
    );
    let _ = writeln!(
        out,
        "  simulated_driver_seconds   {:.6}",
        m.simulated_driver_seconds
    );
    let _ = writeln!(
        out,
        "  driver_time_floor_seconds  {:.6} (least for any allocator of whole granules that meets the efficiency target wherever the trace might end)",
        m.driver_time_floor_seconds
    );
    if let Some(seconds) = m.recorded_seconds {
        let _ = writeln!(out, "  recorded_seconds           {seconds:.3}");
    }
    if let Some(fraction) = m.driver_time_fraction {
        let _ = writeln!(
            out,
            "  driver_time_fraction       {:.4}% of the recorded time",
            fraction * 100.0
        );
    }
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
    for oom in &m.reproduced_ooms {
        let (op, report) = (oom.op, &oom.report);
        let _ = writeln!(out, "  recorded out-of-memory error reproduced at op {op}:");
        for line in report.render().lines() {
            let _ = writeln!(out, "    {line}");
        }
        if !oom.device_size_known {
            let _ = writeln!(
                out,
                "    (the trace records free memory, not the device's size: the total is the \
                 least it can have been, reserved plus free; --capacity gives the size)"
            );
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
    let status = match r.verdict() {
        Verdict::Exact => "EXACT".to_string(),
        Verdict::NoEvents => "no segment events in this window: nothing to compare".to_string(),
        Verdict::Diverges => format!("diverges at event {}", r.matching_prefix),
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
        device_label(r.device),
        r.recorded, r.replayed, r.matching_prefix
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

/// The line after every fidelity result: how many devices of how many
/// snapshots were exact, diverged, or had nothing to compare.
pub fn fidelity_summary(snapshots: usize, reports: &[FidelityReport]) -> String {
    let count = |verdict: Verdict, foreign: bool| {
        reports
            .iter()
            .filter(|r| r.verdict() == verdict && r.foreign_allocator == foreign)
            .count()
    };
    let mut summary = format!(
        "fidelity: {} device(s) of {snapshots} snapshot(s): {} exact, {} diverge, {} with no \
         segment events",
        reports.len(),
        count(Verdict::Exact, false),
        count(Verdict::Diverges, false),
        count(Verdict::NoEvents, false),
    );
    let foreign = reports.iter().filter(|r| r.foreign_allocator).count();
    if foreign > 0 {
        let _ = write!(
            summary,
            "; and {foreign} from torch_npu, not held to fidelity ({} exact, {} diverge)",
            count(Verdict::Exact, true),
            count(Verdict::Diverges, true)
        );
    }
    summary
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

/// Writes `replay --calls-log`'s CSV: a row per op that called the driver
/// (op index, what the op was and its requested bytes, live and reserved
/// bytes after it, blank where it failed, simulated driver nanoseconds),
/// then a count per kind of call, for the kinds any row made.
pub fn write_calls_csv(
    trace: &DeviceTrace,
    log: &CallsLog,
    out: &mut impl std::io::Write,
) -> std::io::Result<()> {
    let kinds: Vec<CallKind> = CallKind::ALL
        .into_iter()
        .filter(|&kind| log.ops.iter().any(|(_, calls)| calls.get(kind) > 0))
        .collect();
    write!(
        out,
        "op,action,size_bytes,live_bytes,reserved_bytes,driver_ns"
    )?;
    for kind in &kinds {
        write!(out, ",{}", kind.name())?;
    }
    writeln!(out)?;
    // A free names its allocation: its size is that of the allocation
    // (or of the live block the window started with).
    let mut sizes: std::collections::HashMap<_, u64> = trace
        .initial_segments
        .iter()
        .flat_map(|segment| &segment.blocks)
        .filter_map(|block| match block.state {
            InitialBlockState::Allocated(id) => Some((id, block.requested_size)),
            InitialBlockState::Free => None,
        })
        .collect();
    let mut logged = log.ops.iter().peekable();
    for (op, traced) in trace.ops.iter().enumerate() {
        if let Op::Alloc { id, size, .. } = *traced {
            sizes.insert(id, size);
        }
        let Some((_, calls)) = logged.next_if(|(at, _)| *at == op) else {
            continue;
        };
        let (action, size) = match *traced {
            Op::Alloc { size, .. } => ("alloc", Some(size)),
            Op::Free { id } => ("free", sizes.get(&id).copied()),
            Op::RecordStream { .. } => ("record_stream", None),
            Op::StreamComplete { .. } => ("stream_complete", None),
            Op::EmptyCache => ("empty_cache", None),
            Op::Oom { size, .. } => ("recorded_oom", Some(size)),
        };
        let blank = |value: Option<u64>| value.map_or(String::new(), |v| v.to_string());
        let reserved = log.reserved_bytes.get(op + 1).copied();
        let live = reserved.and(log.live_bytes.get(op + 1).copied());
        write!(
            out,
            "{op},{action},{},{},{},{}",
            blank(size),
            blank(live),
            blank(reserved),
            calls.simulated_ns()
        )?;
        for &kind in &kinds {
            write!(out, ",{}", calls.get(kind))?;
        }
        writeln!(out)?;
    }
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reproduced out-of-memory error says its total is a least figure
    /// where the device's size is not known, and only there.
    #[test]
    fn a_reproduced_oom_on_a_device_of_no_given_size_says_its_total_is_the_least() {
        use hbmalloc_trace::{DeviceTrace, Op};
        let trace = DeviceTrace {
            ops: vec![
                Op::Alloc {
                    id: 1,
                    size: 4 << 20,
                    stream: 0,
                },
                Op::Oom {
                    size: 1 << 30,
                    stream: 0,
                    device_free: 2 << 20,
                },
            ],
            ..DeviceTrace::default()
        };
        let text = |capacity: Option<u64>| {
            let options = hbmalloc_replay::EvalOptions {
                reproduce_recorded_ooms: true,
                capacity_bytes: capacity,
                ..hbmalloc_replay::EvalOptions::new(
                    hbmalloc::PolicyConfig::from_settings("policy:pytorch").unwrap(),
                )
            };
            let m = hbmalloc_replay::evaluate("t", &trace, &options).unwrap();
            assert_eq!(m.reproduced_ooms.len(), 1);
            metrics_text(&m)
        };
        let note = "the total is the least it can have been";
        let unknown = text(None);
        assert!(unknown.contains(note), "{unknown}");
        assert!(!unknown.contains("outside this allocator"), "{unknown}");
        let known = text(Some(64 << 20));
        assert!(!known.contains(note), "{known}");
    }

    #[test]
    fn a_count_of_one_is_singular() {
        assert_eq!(count_of(1, "segment"), "1 segment");
        assert_eq!(count_of(0, "segment"), "0 segments");
        assert_eq!(count_of(300, "step"), "300 steps");
    }

    #[test]
    fn cells_say_seconds_in_ms_below_one_and_keep_both_ends_of_long_names() {
        assert_eq!(seconds(0.0123), "12.3ms");
        assert_eq!(seconds(1.244), "1.24s");
        assert_eq!(seconds(1.0), "1.00s");
        assert_eq!(short(50 << 30), "50.00G");
        assert_eq!(short(100 << 30), "100.0G");
        // A plan that holds nothing for nothing live is as efficient as can be.
        let empty = Plan {
            arena_bytes: 0,
            peak_live_rounded_bytes: 0,
            peak_mapped_bytes: 0,
            blocks: 0,
        };
        assert_eq!(plan_cells(empty, 0), (0, 0, 1.0));
        let long = "abcdefghijklmnopqrstuvwxyz0123456789.pickle";
        assert_eq!(trace_name(long), "abcdefghijklmnop…tuvwxyz0123456789");
        assert_eq!(trace_name(&long[2..]), "cdefghijklmnopqrstuvwxyz0123456789");
        // A word that fills the line exactly stays on it.
        assert_eq!(wrap("ab cd ef", 5), "ab cd\nef\n");
    }

    #[test]
    fn the_fidelity_summary_tells_torch_npu_apart() {
        let report = |foreign_allocator| FidelityReport {
            device: 0,
            config: String::new(),
            recorded: 2,
            replayed: 2,
            matching_prefix: 2,
            first_divergence: None,
            foreign_allocator,
            replay_note: None,
        };
        let ours = fidelity_summary(1, &[report(false)]);
        assert!(ours.starts_with("fidelity: 1 device(s) of 1 snapshot(s): 1 exact"));
        assert!(!ours.contains("torch_npu"), "{ours}");
        let both = fidelity_summary(2, &[report(false), report(true)]);
        assert!(
            both.contains(": 1 exact,")
                && both
                    .ends_with("; and 1 from torch_npu, not held to fidelity (1 exact, 0 diverge)"),
            "{both}"
        );
    }

    #[test]
    fn the_calls_log_names_each_op_and_the_size_a_free_gives_back() {
        use hbmalloc::CallCounts;
        use hbmalloc_trace::{InitialBlock, InitialSegment};
        // A block live when the window starts (id 7), one allocated in it
        // (id 1): freeing either gives back its requested size.
        let trace = DeviceTrace {
            initial_segments: vec![InitialSegment {
                address: 0,
                stream: 0,
                small_pool: false,
                expandable: false,
                blocks: vec![InitialBlock {
                    size: 4096,
                    requested_size: 4000,
                    state: InitialBlockState::Allocated(7),
                }],
            }],
            ops: vec![
                Op::Alloc {
                    id: 1,
                    size: 1000,
                    stream: 0,
                },
                Op::EmptyCache,
                Op::Free { id: 7 },
                Op::Free { id: 1 },
            ],
            ..DeviceTrace::default()
        };
        let calls = |kind: CallKind, ns| {
            let mut counts = CallCounts::default();
            counts.by_kind[kind as usize] = 1;
            counts.simulated_ns_by_kind[kind as usize] = ns;
            counts
        };
        let log = CallsLog {
            live_bytes: vec![4000, 5000, 5000, 1000, 0],
            reserved_bytes: vec![4096, 6144, 4096, 4096],
            ops: vec![
                (0, calls(CallKind::SegmentAlloc, 10)),
                (1, calls(CallKind::SegmentFree, 20)),
                (2, calls(CallKind::SegmentFree, 30)),
                (3, calls(CallKind::SegmentFree, 40)),
            ],
        };
        let mut csv = Vec::new();
        write_calls_csv(&trace, &log, &mut csv).unwrap();
        // The last free ran out of memory: no reserved bytes after it.
        assert_eq!(
            String::from_utf8(csv).unwrap(),
            "op,action,size_bytes,live_bytes,reserved_bytes,driver_ns,segment_alloc,segment_free\n\
             0,alloc,1000,5000,6144,10,1,0\n\
             1,empty_cache,,5000,4096,20,0,1\n\
             2,free,4000,1000,4096,30,0,1\n\
             3,free,1000,,,40,0,1\n"
        );
    }

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

//! `hbmalloc report`: one self-contained HTML page (inline SVG and CSS, no
//! script, nothing fetched) showing where a trace's memory went under each
//! configuration: memory over time, the memory map at the peak, the largest
//! live allocations with their stack frames, driver activity, the
//! out-of-memory point and the comparison table.
//!
//! Every plot is drawn from a bounded number of points (each series is cut
//! into buckets that keep their minimum and maximum), so the page stays
//! light however long the trace is.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use hbmalloc::{BlockState, PolicyConfig, SegmentSnapshot, SimConfig};
use hbmalloc_replay::{
    evaluate, live_bytes_after_ops, snapshot, EvalOptions, FreeBreakdown, Metrics, Outcome,
    PreparedTrace, ReplayOptions, ReplaySnapshot, SnapshotMoment,
};
use hbmalloc_trace::pickle::{self, Document, Value, ValueId};
use hbmalloc_trace::{DeviceTrace, InitialBlockState, Op};
use rayon::prelude::*;

use crate::{human, Capacity};

/// Arguments of `hbmalloc report`.
#[derive(Args)]
pub struct ReportArgs {
    /// Trace files; default: the bundled trace.
    traces: Vec<PathBuf>,
    /// Where to write the page.
    #[arg(short, long, value_name = "PATH")]
    output: PathBuf,
    /// A configuration to show; repeat for several. Default: pytorch,
    /// pytorch with expandable segments, and hbm.
    #[arg(long = "run", value_name = "SETTINGS")]
    runs: Vec<String>,
    /// Device capacity for the replays (80GiB, or 1.03x of peak live);
    /// default unbounded. Shows where each configuration runs out of memory.
    #[arg(long, value_parser = crate::parse_capacity)]
    capacity: Option<Capacity>,
    /// Buckets each plot's x axis is cut into (each keeps its minimum and
    /// maximum).
    #[arg(long, default_value_t = 1000, value_parser = crate::count(100_000))]
    buckets: usize,
    /// Skip the smallest-device bisection (about ten replays a
    /// configuration; the table shows "-").
    #[arg(long)]
    no_min_capacity: bool,
}

/// Largest live allocations listed.
const TOP_ALLOCATIONS: usize = 15;
/// Stack frames shown per allocation.
const FRAMES_SHOWN: usize = 6;
/// Rows of the memory map.
const MAP_ROWS: u64 = 40;
/// Rectangles one memory map draws before it stops: the segments after
/// the one that passes it are left out, and the page says so.
const MAP_RECTS: usize = 20_000;
/// Plot size in CSS pixels.
const PLOT_W: f64 = 960.0;
const PLOT_H: f64 = 260.0;
/// Colours of the configurations, live memory, and the memory map's classes.
const COLOURS: [&str; 6] = [
    "#d62728", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2",
];
const LIVE: &str = "#1f77b4";
const ALLOCATED: &str = "#4c72b0";
const IDLE: &str = "#8fd18a";
const EDGE: &str = "#f0a35e";
const BETWEEN: &str = "#d65f5f";

/// Writes the page and says what it took.
pub fn run(args: ReportArgs) -> Result<(), String> {
    let started = Instant::now();
    let runs = crate::parse_runs(&args.runs)?;
    let traces = crate::load_or_bundled(&args.traces)?;
    let mut body = String::new();
    for (i, trace) in traces.iter().enumerate() {
        let frames = match args.traces.get(i) {
            Some(path) => frames_of(path),
            None => Err("the bundled trace is a torch.profiler trace, which records none".into()),
        };
        for device in &trace.devices {
            let frames = frames
                .as_ref()
                .map_err(Clone::clone)
                .and_then(|f| frames_by_alloc(device, f));
            body += &device_section(&trace.source, device, &runs, &args, frames).map_err(|e| {
                format!(
                    "{}: {e}",
                    crate::table::on_device(&trace.source, device.device)
                )
            })?;
        }
    }
    let page = page(
        &traces.iter().map(|t| t.source.as_str()).collect::<Vec<_>>(),
        &body,
    );
    std::fs::write(&args.output, &page).map_err(|e| format!("{}: {e}", args.output.display()))?;
    eprintln!(
        "hbmalloc: wrote {} ({}) in {:.1} s",
        args.output.display(),
        human(page.len() as u64),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// What a PyTorch snapshot says of its allocations' stack frames.
#[derive(Debug, Default)]
struct SnapshotFrames {
    /// Each device's `alloc` entries in order: size and frames.
    allocs: HashMap<i64, Vec<(u64, Vec<String>)>>,
    /// Each device's blocks allocated at the dump, by address.
    at_dump: HashMap<i64, HashMap<u64, Vec<String>>>,
}

/// The frames of a PyTorch snapshot's `alloc` entries and dumped blocks;
/// an error says why there are none (not a snapshot, compressed).
fn frames_of(path: &Path) -> Result<SnapshotFrames, String> {
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    if !bytes.starts_with(&[0x80]) {
        return Err("the trace is not an uncompressed PyTorch snapshot".into());
    }
    let doc = pickle::parse(&bytes).map_err(|e| e.to_string())?;
    let list = |id: Option<ValueId>| match id.map(|id| doc.get(id)) {
        Some(Value::List(items) | Value::Tuple(items)) => items.clone(),
        _ => Vec::new(),
    };
    let int = |id: Option<ValueId>| match id.map(|id| doc.get(id)) {
        Some(Value::Int(n)) => u64::try_from(*n).ok(),
        _ => None,
    };
    // The program's own (Python) frames say where; C++ frames only when
    // there is nothing else.
    let frames = |of: ValueId| {
        let frames: Vec<(bool, String)> = list(doc.dict_get(of, "frames"))
            .into_iter()
            .filter_map(|frame| frame_text(&doc, frame))
            .collect();
        let python = frames.iter().any(|(py, _)| *py);
        frames
            .into_iter()
            .filter(|(py, _)| *py || !python)
            .map(|(_, text)| text)
            .collect::<Vec<_>>()
    };
    let mut found = SnapshotFrames::default();
    let traces = list(doc.dict_get(doc.root(), "device_traces"));
    for (device, entries) in traces.into_iter().enumerate() {
        let allocs = list(Some(entries))
            .into_iter()
            .filter(|&e| str_of(&doc, doc.dict_get(e, "action")) == Some("alloc"))
            .map(|e| (int(doc.dict_get(e, "size")).unwrap_or(0), frames(e)))
            .collect();
        found.allocs.insert(device as i64, allocs);
    }
    for segment in list(doc.dict_get(doc.root(), "segments")) {
        let device = int(doc.dict_get(segment, "device")).unwrap_or(0) as i64;
        let mut address = int(doc.dict_get(segment, "address")).unwrap_or(0);
        for block in list(doc.dict_get(segment, "blocks")) {
            // Blocks without an address tile their segment.
            let at = int(doc.dict_get(block, "address")).unwrap_or(address);
            // Saturating: a hostile snapshot's blocks may run past 2^64.
            address = at.saturating_add(int(doc.dict_get(block, "size")).unwrap_or(0));
            if str_of(&doc, doc.dict_get(block, "state")) == Some("active_allocated") {
                found
                    .at_dump
                    .entry(device)
                    .or_default()
                    .insert(at, frames(block));
            }
        }
    }
    if found.allocs.is_empty() && found.at_dump.is_empty() {
        return Err("the snapshot has no history".into());
    }
    Ok(found)
}

fn str_of(doc: &Document, id: Option<ValueId>) -> Option<&str> {
    match doc.get(id?) {
        Value::Str(s) => Some(s),
        _ => None,
    }
}

/// Whether a frame is Python's, and `name (file:line)`; frames with no
/// file (`??`: C++ unwinding) are left out.
fn frame_text(doc: &Document, frame: ValueId) -> Option<(bool, String)> {
    let file = str_of(doc, doc.dict_get(frame, "filename"))?;
    if file == "??" {
        return None;
    }
    let name = str_of(doc, doc.dict_get(frame, "name")).unwrap_or("?");
    let line = match doc.dict_get(frame, "line").map(|id| doc.get(id)) {
        Some(Value::Int(n)) => *n,
        _ => 0,
    };
    Some((file.ends_with(".py"), format!("{name} ({file}:{line})")))
}

/// Frames by the trace's allocation id. The importer turns the history's
/// `alloc` entries into `Alloc` ops one for one and in order, which the
/// sizes confirm (anything else: no frames rather than wrong ones). A block
/// live from the window start to the dump is the dumped block at its
/// address.
fn frames_by_alloc(
    device: &DeviceTrace,
    snapshot: &SnapshotFrames,
) -> Result<HashMap<u64, Vec<String>>, String> {
    let entries = snapshot
        .allocs
        .get(&device.device)
        .map_or(&[][..], Vec::as_slice);
    let allocs: Vec<(u64, u64)> = device
        .ops
        .iter()
        .filter_map(|op| match op {
            Op::Alloc { id, size, .. } => Some((*id, *size)),
            _ => None,
        })
        .collect();
    if allocs.len() != entries.len() || allocs.iter().zip(entries).any(|(a, e)| a.1 != e.0) {
        return Err(format!(
            "the history's {} allocations do not line up with the trace's {}",
            entries.len(),
            allocs.len()
        ));
    }
    let mut by_id: HashMap<u64, Vec<String>> = allocs
        .into_iter()
        .zip(entries)
        .map(|((id, _), (_, frames))| (id, frames.clone()))
        .collect();
    let freed: HashSet<u64> = device
        .ops
        .iter()
        .filter_map(|op| match op {
            Op::Free { id } => Some(*id),
            _ => None,
        })
        .collect();
    let at_dump = snapshot.at_dump.get(&device.device);
    for segment in &device.initial_segments {
        let mut address = segment.address;
        for block in &segment.blocks {
            if let InitialBlockState::Allocated(id) = block.state {
                if let Some(frames) = at_dump.and_then(|d| d.get(&address)) {
                    if !freed.contains(&id) {
                        by_id.insert(id, frames.clone());
                    }
                }
            }
            address = address.saturating_add(block.size);
        }
    }
    Ok(by_id)
}

/// What one configuration did on one device.
struct Replayed {
    metrics: Metrics,
    reserved: Vec<u64>,
    /// Op index of each segment event (alloc, free, map, unmap).
    segment_event_ops: Vec<usize>,
    peak: ReplaySnapshot,
}

fn replay_one(
    source: &str,
    device: &DeviceTrace,
    policy: &PolicyConfig,
    capacity: Option<u64>,
    find_min_capacity: bool,
) -> Result<Replayed, String> {
    let options = EvalOptions {
        capacity_bytes: capacity,
        find_min_capacity,
        ..EvalOptions::new(policy.clone())
    };
    let metrics = evaluate(source, device, &options).map_err(|e| e.to_string())?;
    let mut replay = ReplayOptions::new(policy.clone());
    replay.capacity_bytes = capacity.unwrap_or(hbmalloc_replay::UNBOUNDED_CAPACITY_BYTES);
    // The same simulated device as the metrics' replay.
    replay.maps_handle_parts = options.maps_handle_parts;
    replay.latency = options.latency.clone();
    replay.use_recorded_addresses = options.use_recorded_addresses;
    replay.record_reserved_after_ops = true;
    replay.record_history = true;
    let run = PreparedTrace::new(device)
        .and_then(|p| p.run(&replay))
        .map_err(|e| e.to_string())?;
    // This replay found the peak already: one more replay to it, not the
    // two of `SnapshotMoment::Peak` (where it ran out of memory, the
    // snapshot is taken at the failure, as there).
    let moment = match run.outcome {
        Outcome::Completed => run.ops_at_peak_reserved,
        Outcome::OutOfMemory { op_index, .. } => op_index + 1,
    };
    let peak =
        snapshot(device, &options, SnapshotMoment::AfterOps(moment)).map_err(|e| e.to_string())?;
    Ok(Replayed {
        metrics,
        reserved: run.reserved_after_ops,
        segment_event_ops: run.segment_events.iter().map(|(op, _)| *op).collect(),
        peak,
    })
}

fn device_section(
    source: &str,
    device: &DeviceTrace,
    runs: &[PolicyConfig],
    args: &ReportArgs,
    frames: Result<HashMap<u64, Vec<String>>, String>,
) -> Result<String, String> {
    let capacity = args.capacity.map(|c| c.bytes(device));
    let buckets = args.buckets;
    let replayed: Vec<Replayed> = runs
        .par_iter()
        .map(|policy| replay_one(source, device, policy, capacity, !args.no_min_capacity))
        .collect::<Result<_, _>>()?;
    let live = live_bytes_after_ops(device);
    let ops = live.len().saturating_sub(1).max(1);
    let mut s = String::new();
    let _ = write!(
        s,
        "<section><h2>{} — device {}</h2><p>{} operations; peak live {}{}.</p>",
        esc(source),
        crate::table::device_label(device.device),
        ops,
        human(live.iter().copied().max().unwrap_or(0)),
        capacity.map_or(String::new(), |c| format!("; device capacity {}", human(c))),
    );

    // One line per configuration, in its colour.
    let per_config = |name: &str, points: &dyn Fn(&Replayed) -> Vec<(f64, f64)>| {
        replayed
            .iter()
            .enumerate()
            .map(|(i, r)| Series {
                name: format!("{name}{}", r.metrics.settings),
                colour: COLOURS[i % COLOURS.len()],
                points: points(r),
            })
            .collect::<Vec<_>>()
    };

    // Memory over time.
    let mut series = vec![Series {
        name: "live".into(),
        colour: LIVE,
        points: min_max_points(&live, buckets),
    }];
    series.extend(per_config("reserved: ", &|r| {
        min_max_points(&r.reserved, buckets)
    }));
    let mut markers: Vec<(usize, String)> = replayed
        .iter()
        .filter_map(|r| {
            r.metrics
                .out_of_memory
                .as_ref()
                .map(|(op, _)| (*op, format!("OOM {}", r.metrics.settings)))
        })
        .collect();
    for (op_index, op) in device.ops.iter().enumerate() {
        if let Op::Oom { .. } = op {
            markers.push((op_index, "recorded OOM".into()));
        }
    }
    s += "<h3>Memory over time</h3>";
    s += &chart(&series, ops, &markers, "bytes");
    s += &legend(&series);

    // Waste and driver activity over time.
    let waste = per_config("", &|r| {
        let waste: Vec<u64> = r
            .reserved
            .iter()
            .zip(&live)
            .map(|(r, l)| r.saturating_sub(*l))
            .collect();
        min_max_points(&waste, buckets)
    });
    s += "<h3>Waste over time (reserved − live)</h3>";
    s += &chart(&waste, ops, &markers, "bytes");
    s += &legend(&waste);
    let calls = per_config("", &|r| {
        counts_per_bucket(&r.segment_event_ops, ops, buckets)
    });
    s += "<h3>Driver calls over time</h3><p class='note'>Segment events (allocate, free, map, \
          unmap) per bucket of operations.</p>";
    s += &chart(&calls, ops, &markers, "count");
    s += &legend(&calls);

    // The comparison table.
    s += "<h3>Comparison</h3><table><tr><th>settings</th><th>peak reserved</th>\
          <th>efficiency</th><th>waste</th><th>smallest device</th><th>driver calls</th>\
          <th>driver time</th><th>out of memory</th></tr>";
    for r in &replayed {
        let m = &r.metrics;
        let _ = write!(
            s,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{:.1} ms</td><td>{}</td></tr>",
            esc(&m.settings),
            human(m.peak_reserved_bytes),
            // A replay that ran out of memory has neither.
            m.efficiency.map_or("-".into(), |e| format!("{e:.3}")),
            m.waste_bytes.map_or("-".into(), human),
            m.min_capacity_bytes.map_or("-".into(), human),
            m.memory_device_calls,
            m.simulated_driver_seconds * 1e3,
            m.out_of_memory
                .as_ref()
                .map_or("no".into(), |(op, _)| format!("at op {op}")),
        );
    }
    s += "</table>";

    // Out-of-memory reports.
    for r in &replayed {
        if let Some((op, report)) = &r.metrics.out_of_memory {
            let _ = write!(
                s,
                "<h3>Out of memory under {} at op {op}</h3><pre>{}</pre>",
                esc(&r.metrics.settings),
                esc(&report.render())
            );
        }
    }

    // The memory map at each configuration's peak.
    s += "<h3>Memory at the peak</h3><p class='note'>Each configuration's segments (for \
          virtual memory, contiguous mapped ranges) laid end to end in address order, left to \
          right and top to bottom, at the moment its reserved memory first peaked (or where it \
          ran out of memory). Free memory is coloured by what keeps it from serving a request: \
          <span class='sw' style='background:#8fd18a'></span>idle (no live block pins it: \
          reusable anywhere, or given back by empty_cache), \
          <span class='sw' style='background:#f0a35e'></span>at a segment's edge (the free part \
          of a granule or segment a live block holds), \
          <span class='sw' style='background:#d65f5f'></span>between live blocks (holes); \
          <span class='sw' style='background:#4c72b0'></span>allocated. Hover a segment for its \
          numbers.</p>";
    for r in &replayed {
        s += &memory_map(&r.metrics.settings, &r.peak);
    }

    // The largest live allocations.
    s += &largest_live(device, &live, frames);
    s += "</section>";
    Ok(s)
}

/// One plotted line: points (op index, value).
struct Series {
    name: String,
    colour: &'static str,
    points: Vec<(f64, f64)>,
}

/// `values` cut into at most `buckets` buckets, each giving its minimum and
/// its maximum in the order they came: spikes and dips survive.
fn min_max_points(values: &[u64], buckets: usize) -> Vec<(f64, f64)> {
    let n = values.len();
    if n == 0 {
        return Vec::new();
    }
    let buckets = buckets.clamp(1, n);
    let mut points = Vec::with_capacity(2 * buckets);
    for b in 0..buckets {
        // Every bucket holds at least one value: buckets <= n.
        let (start, end) = (b * n / buckets, (b + 1) * n / buckets);
        let slice = &values[start..end];
        let (mut lo, mut hi) = (0, 0);
        for (i, v) in slice.iter().enumerate() {
            if *v < slice[lo] {
                lo = i;
            }
            if *v > slice[hi] {
                hi = i;
            }
        }
        let mut pair = [(start + lo, slice[lo]), (start + hi, slice[hi])];
        pair.sort_unstable();
        for (x, v) in pair {
            if points.last() != Some(&(x as f64, v as f64)) {
                points.push((x as f64, v as f64));
            }
        }
    }
    points
}

/// How many of `ops` (op indices) fall in each of `buckets` buckets of
/// `0..total`, as points at each bucket's start.
fn counts_per_bucket(ops: &[usize], total: usize, buckets: usize) -> Vec<(f64, f64)> {
    let buckets = buckets.clamp(1, total.max(1));
    let mut counts = vec![0u64; buckets];
    for &op in ops {
        // An event after the last op counts in the last bucket.
        counts[(op * buckets / total).min(buckets - 1)] += 1;
    }
    counts
        .iter()
        .enumerate()
        .map(|(b, c)| ((b * total / buckets) as f64, *c as f64))
        .collect()
}

/// An SVG line chart of `series` over `0..ops`, with vertical markers.
fn chart(series: &[Series], ops: usize, markers: &[(usize, String)], unit: &str) -> String {
    let (left, right, top, bottom) = (80.0, 10.0, 10.0, 30.0);
    let (w, h) = (PLOT_W - left - right, PLOT_H - top - bottom);
    let y_max = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0_f64, f64::max)
        .max(1.0);
    let x = |op: f64| left + w * op / ops as f64;
    let y = |v: f64| top + h - h * v / y_max;
    let mut svg = format!(
        "<svg class='plot' viewBox='0 0 {PLOT_W} {PLOT_H}' width='{PLOT_W}' height='{PLOT_H}' \
         role='img'><rect x='{left}' y='{top}' width='{w}' height='{h}' class='frame'/>"
    );
    for i in 0..=4 {
        let v = y_max * i as f64 / 4.0;
        let label = if unit == "bytes" {
            human(v as u64)
        } else {
            format!("{v:.0}")
        };
        let _ = write!(
            svg,
            "<line x1='{left}' x2='{}' y1='{yy:.1}' y2='{yy:.1}' class='grid'/>\
             <text x='{}' y='{:.1}' class='ylab'>{label}</text>",
            left + w,
            left - 4.0,
            y(v) + 4.0,
            yy = y(v),
        );
        let op = ops as f64 * i as f64 / 4.0;
        let anchor = ["start", "middle", "middle", "middle", "end"][i];
        let _ = write!(
            svg,
            "<text x='{:.1}' y='{}' class='xlab' text-anchor='{anchor}'>op {op:.0}</text>",
            x(op),
            PLOT_H - 8.0
        );
    }
    for (op, label) in markers {
        let _ = write!(
            svg,
            "<line x1='{xx:.1}' x2='{xx:.1}' y1='{top}' y2='{}' class='oom'><title>{}</title></line>",
            top + h,
            esc(label),
            xx = x(*op as f64),
        );
    }
    // The first series (live memory) is drawn last, on top.
    for s in series.iter().rev() {
        let mut d = String::with_capacity(s.points.len() * 14);
        for (px, py) in &s.points {
            let _ = write!(d, "{:.1},{:.1} ", x(*px), y(*py));
        }
        let _ = write!(
            svg,
            "<polyline points='{}' stroke='{}' class='line'><title>{}</title></polyline>",
            d.trim_end(),
            s.colour,
            esc(&s.name)
        );
    }
    svg += "</svg>";
    svg
}

fn legend(series: &[Series]) -> String {
    let mut s = String::from("<p class='legend'>");
    for series in series {
        let _ = write!(
            s,
            "<span><span class='sw' style='background:{}'></span>{}</span> ",
            series.colour,
            esc(&series.name)
        );
    }
    s + "</p>"
}

/// The memory map of one configuration at its peak.
fn memory_map(settings: &str, peak: &ReplaySnapshot) -> String {
    let granule = SimConfig::default().granularity;
    let total: u64 = peak.reserved_bytes.max(1);
    let per_row = total.div_ceil(MAP_ROWS).max(1);
    let row_h = 10.0;
    let height = MAP_ROWS as f64 * (row_h + 2.0);
    let px = |bytes: u64| PLOT_W * bytes as f64 / per_row as f64;
    let mut rects = 0usize;
    let mut body = String::new();
    let mut segments: Vec<&SegmentSnapshot> = peak.snapshot.segments.iter().collect();
    segments.sort_by_key(|s| s.address);
    let mut cursor = 0u64;
    let mut left_out = 0usize;
    // Draws bytes [start, start + len) of the laid-out map in `colour`,
    // split across rows, and says how many rectangles that took.
    let draw = |start: u64, len: u64, colour: &str, title: Option<&str>, out: &mut String| {
        let mut drawn = 0;
        let mut at = start;
        let end = start + len;
        while at < end {
            let row = at / per_row;
            let row_end = ((row + 1) * per_row).min(end);
            let _ = write!(
                out,
                "<rect x='{:.2}' y='{:.0}' width='{:.2}' height='{row_h}' fill='{colour}'>",
                px(at - row * per_row),
                row as f64 * (row_h + 2.0),
                px(row_end - at).max(0.3),
            );
            if let Some(title) = title {
                let _ = write!(out, "<title>{}</title>", esc(title));
            }
            out.push_str("</rect>");
            drawn += 1;
            at = row_end;
        }
        drawn
    };
    for segment in &segments {
        if rects > MAP_RECTS {
            left_out += 1;
            continue;
        }
        let breakdown = FreeBreakdown::of_segment(segment, granule);
        let title = format!(
            "segment at {:#x}: {} ({} blocks), {} allocated; free: {} idle, {} at the edges, \
             {} between live blocks",
            segment.address,
            human(segment.total_size),
            segment.blocks.len(),
            human(segment.allocated_size()),
            human(breakdown.idle_bytes),
            human(breakdown.segment_edge_bytes),
            human(breakdown.between_blocks_bytes),
        );
        rects += draw(
            cursor,
            segment.total_size,
            "#ffffff",
            Some(&title),
            &mut body,
        );
        // Runs of blocks of one colour become one rectangle.
        let mut run: Option<(u64, u64, &str)> = None;
        let mut offset = cursor;
        let classes = FreeBreakdown::of_blocks(segment, granule);
        for (block, b) in segment.blocks.iter().zip(classes) {
            let size = block.size;
            let colour = if block.state == BlockState::Inactive {
                if b.idle_bytes >= b.segment_edge_bytes.max(b.between_blocks_bytes) {
                    IDLE
                } else if b.segment_edge_bytes >= b.between_blocks_bytes {
                    EDGE
                } else {
                    BETWEEN
                }
            } else {
                ALLOCATED
            };
            run = match run {
                Some((start, len, c)) if c == colour => Some((start, len + size, c)),
                Some((start, len, c)) => {
                    rects += draw(start, len, c, None, &mut body);
                    Some((offset, size, colour))
                }
                None => Some((offset, size, colour)),
            };
            offset += size;
        }
        if let Some((start, len, c)) = run {
            rects += draw(start, len, c, None, &mut body);
        }
        cursor += segment.total_size;
    }
    let free = &peak.free_breakdown;
    let moment = match peak.out_of_memory_op {
        Some(op) => format!("where it ran out of memory (op {op})"),
        None => format!(
            "at its peak (after op {} of {})",
            peak.ops_replayed, peak.ops
        ),
    };
    let mut s = format!(
        "<h4>{}</h4><p>{moment}: {} reserved in {} segments, {} in use; {} free in {} blocks \
         (largest {}): {} idle, {} at segment edges, {} between live blocks. One row is {}.</p>",
        esc(settings),
        human(peak.reserved_bytes),
        peak.segments,
        human(peak.active_bytes),
        human(peak.free_bytes),
        peak.free_blocks,
        human(peak.largest_free_block_bytes),
        human(free.idle_bytes),
        human(free.segment_edge_bytes),
        human(free.between_blocks_bytes),
        human(per_row),
    );
    if left_out > 0 {
        let _ = write!(
            s,
            "<p class='note'>The last {left_out} segments are left out: the map stops at \
             {MAP_RECTS} rectangles.</p>"
        );
    }
    let _ = write!(
        s,
        "<svg class='map' viewBox='0 0 {PLOT_W} {height}' width='{PLOT_W}' height='{height}' \
         role='img'>{body}</svg>"
    );
    s
}

/// The largest allocations live when live memory first peaked, with their
/// stack frames where the trace has them.
fn largest_live(
    device: &DeviceTrace,
    live: &[u64],
    frames: Result<HashMap<u64, Vec<String>>, String>,
) -> String {
    let peak_op = live
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(&a.0)))
        .map_or(0, |(i, _)| i);
    // (id, size, op allocated at; None: live at the window start)
    let mut alive: HashMap<u64, (u64, Option<usize>)> = HashMap::new();
    for segment in &device.initial_segments {
        for block in &segment.blocks {
            if let InitialBlockState::Allocated(id) = block.state {
                alive.insert(id, (block.requested_size, None));
            }
        }
    }
    for (i, op) in device.ops.iter().take(peak_op).enumerate() {
        match op {
            Op::Alloc { id, size, .. } => {
                alive.insert(*id, (*size, Some(i + 1)));
            }
            Op::Free { id } => {
                alive.remove(id);
            }
            _ => {}
        }
    }
    let count = alive.len();
    let mut largest: Vec<(u64, u64, Option<usize>)> = alive
        .into_iter()
        .map(|(id, (size, at))| (id, size, at))
        .collect();
    largest.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut s = format!(
        "<h3>Largest live allocations at the peak</h3><p>Live memory first peaked after op \
         {peak_op}: {} in {count} allocations (requested sizes; the same for every \
         configuration).{}</p><table><tr><th>size</th><th>allocated at</th><th>stack \
         frames (innermost first; Python's where there are any)</th></tr>",
        human(live.get(peak_op).copied().unwrap_or(0)),
        match &frames {
            Ok(_) => String::new(),
            Err(why) => format!(" No stack frames: {}.", esc(why)),
        }
    );
    for (id, size, at) in largest.into_iter().take(TOP_ALLOCATIONS) {
        let shown = frames
            .as_ref()
            .ok()
            .and_then(|f| f.get(&id))
            .map(|f| {
                f.iter()
                    .take(FRAMES_SHOWN)
                    .map(|l| esc(l))
                    .collect::<Vec<_>>()
                    .join("<br>")
            })
            .unwrap_or_default();
        let _ = write!(
            s,
            "<tr><td>{}</td><td>{}</td><td class='frames'>{}</td></tr>",
            human(size),
            at.map_or("before the window".into(), |op| format!("op {op}")),
            if shown.is_empty() && frames.is_ok() && at.is_none() {
                "(live before the window: the snapshot has no frames for it)".to_string()
            } else {
                shown
            }
        );
    }
    s + "</table>"
}

/// The whole page.
fn page(sources: &[&str], body: &str) -> String {
    format!(
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>\
         <title>hbmalloc report: {}</title><style>{STYLE}</style></head><body>\
         <h1>Where the memory went</h1><p class='note'>Made by <code>hbmalloc report</code>: each \
         configuration replayed on a simulated GPU. Plots have the operation index on the x \
         axis and are drawn from at most two points per bucket (the bucket's minimum and \
         maximum, in the order they came), so peaks and dips stay visible however long the \
         trace; red vertical lines mark out-of-memory errors (hover for which).</p>{body}\
         </body></html>\n",
        esc(&sources.join(", ")),
    )
}

const STYLE: &str =
    "body{font:14px/1.4 system-ui,sans-serif;margin:20px;color:#222;max-width:1000px}\
h2{border-bottom:1px solid #ccc}.note{color:#555}.plot .frame{fill:none;stroke:#999}\
.plot .grid{stroke:#eee}.plot .line{fill:none;stroke-width:1.3;stroke-opacity:.85}.plot .oom{stroke:#d00;\
stroke-dasharray:4 3}.ylab{font-size:11px;text-anchor:end}.xlab{font-size:11px;\
}.sw{display:inline-block;width:12px;height:12px;margin:0 4px 0 8px;\
vertical-align:middle}.legend span{white-space:nowrap}table{border-collapse:collapse}\
td,th{border:1px solid #ddd;padding:3px 6px;text-align:right;vertical-align:top}\
td:first-child,th:first-child,.frames{text-align:left}.frames{font:11px monospace}\
.map{background:#f4f4f4}pre{background:#f6f6f6;padding:8px;overflow:auto}";

/// Escapes text for HTML.
fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '\'' => out.push_str("&#39;"),
            '"' => out.push_str("&quot;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use hbmalloc::{BlockSnapshot, BlockState, SegmentSnapshot, Snapshot, StreamId};
    use hbmalloc_export::{to_pickle, PickleValue};
    use hbmalloc_replay::{FreeBreakdown, ReplaySnapshot};
    use hbmalloc_trace::{DeviceTrace, InitialBlock, InitialBlockState, InitialSegment, Op};

    use super::{
        chart, counts_per_bucket, esc, frames_by_alloc, frames_of, largest_live, legend,
        memory_map, min_max_points, Series, SnapshotFrames, ALLOCATED, BETWEEN, EDGE, IDLE,
    };
    use crate::human;

    const MIB: u64 = 1 << 20;

    #[test]
    fn downsampling_keeps_each_buckets_extremes() {
        let mut values = vec![5u64; 10_000];
        values[1234] = 900;
        values[7777] = 1;
        let points = min_max_points(&values, 100);
        assert!(points.len() <= 200);
        assert!(points.contains(&(1234.0, 900.0)), "{points:?}");
        assert!(points.contains(&(7777.0, 1.0)));
        assert!(points.windows(2).all(|w| w[0].0 < w[1].0));
        // Short series are kept whole.
        assert_eq!(min_max_points(&[3, 1, 2], 100).len(), 3);
        assert!(min_max_points(&[], 10).is_empty());
    }

    #[test]
    fn counts_fall_in_their_buckets() {
        let points = counts_per_bucket(&[0, 1, 99, 99, 50], 100, 4);
        assert_eq!(points, [(0.0, 2.0), (25.0, 0.0), (50.0, 1.0), (75.0, 2.0)]);
    }

    #[test]
    fn text_is_escaped() {
        assert_eq!(esc("<a href='x'>&"), "&lt;a href=&#39;x&#39;&gt;&amp;");
    }

    #[test]
    fn a_flat_bucket_gives_one_point() {
        let points = min_max_points(&[5; 100], 10);
        let xs: Vec<f64> = points.iter().map(|p| p.0).collect();
        assert_eq!(xs, (0..10).map(|b| f64::from(b * 10)).collect::<Vec<_>>());
    }

    #[test]
    fn an_event_after_the_last_op_counts_in_the_last_bucket() {
        let points = counts_per_bucket(&[100, 250], 100, 4);
        assert_eq!(points[3], (75.0, 2.0));
    }

    /// The plot area is 870 x 220 pixels from (80, 10): op 0 and the value
    /// 0 at its bottom left, the last op and the largest value at its top
    /// right; five labels on each axis, markers as vertical lines.
    #[test]
    fn a_chart_maps_ops_and_values_onto_its_plot_area() {
        let series = [Series {
            name: "a & b".into(),
            colour: "#123456",
            points: vec![(0.0, 0.0), (50.0, 200.0), (100.0, 400.0)],
        }];
        let svg = chart(&series, 100, &[(50, "OOM <x>".into())], "count");
        for part in [
            "<rect x='80' y='10' width='870' height='220' class='frame'/>",
            "<polyline points='80.0,230.0 515.0,120.0 950.0,10.0' stroke='#123456' \
             class='line'><title>a &amp; b</title></polyline>",
            "<line x1='80' x2='950' y1='230.0' y2='230.0' class='grid'/>\
             <text x='76' y='234.0' class='ylab'>0</text>",
            "<line x1='80' x2='950' y1='65.0' y2='65.0' class='grid'/>\
             <text x='76' y='69.0' class='ylab'>300</text>",
            "<text x='80.0' y='252' class='xlab' text-anchor='start'>op 0</text>",
            "<text x='297.5' y='252' class='xlab' text-anchor='middle'>op 25</text>",
            "<text x='950.0' y='252' class='xlab' text-anchor='end'>op 100</text>",
            "<line x1='515.0' x2='515.0' y1='10' y2='230' class='oom'>\
             <title>OOM &lt;x&gt;</title></line>",
        ] {
            assert!(svg.contains(part), "{part}\nnot in\n{svg}");
        }
        // A byte axis labels its values as sizes.
        let svg = chart(&series, 100, &[], "bytes");
        assert!(svg.contains(&format!("class='ylab'>{}</text>", human(400))));
    }

    #[test]
    fn a_legend_names_each_series_in_its_colour() {
        let series = [Series {
            name: "a & b".into(),
            colour: "#123456",
            points: Vec::new(),
        }];
        assert_eq!(
            legend(&series),
            "<p class='legend'><span><span class='sw' style='background:#123456'></span>\
             a &amp; b</span> </p>"
        );
    }

    fn block(address: u64, size: u64, allocated: bool) -> BlockSnapshot {
        BlockSnapshot {
            address,
            size,
            requested_size: if allocated { size } else { 0 },
            state: if allocated {
                BlockState::ActiveAllocated
            } else {
                BlockState::Inactive
            },
        }
    }

    /// A virtual-memory segment of `(MiB, allocated)` blocks at `address`.
    fn segment(address: u64, blocks: &[(f64, bool)]) -> SegmentSnapshot {
        let mut at = address;
        let blocks: Vec<BlockSnapshot> = blocks
            .iter()
            .map(|&(mib, allocated)| {
                let size = (mib * MIB as f64) as u64;
                at += size;
                block(at - size, size, allocated)
            })
            .collect();
        SegmentSnapshot {
            address,
            total_size: at - address,
            stream: StreamId(0),
            small_pool: false,
            expandable: true,
            blocks,
        }
    }

    fn peak_of(segments: Vec<SegmentSnapshot>) -> ReplaySnapshot {
        let snapshot = Snapshot {
            segments,
            history: Vec::new(),
            settings: String::new(),
        };
        let free_breakdown = FreeBreakdown::of(&snapshot, Some(2 * MIB));
        let reserved_bytes = snapshot.segments.iter().map(|s| s.total_size).sum();
        ReplaySnapshot {
            ops_replayed: 10,
            out_of_memory_op: None,
            ops: 20,
            reserved_bytes,
            segments: snapshot.segments.len(),
            active_bytes: 0,
            free_blocks: 0,
            free_bytes: 0,
            largest_free_block_bytes: 0,
            free_breakdown,
            peak_reserved_bytes: reserved_bytes,
            snapshot,
        }
    }

    /// 40 MiB in 40 rows of 1 MiB (12 pixels apart): a free 2 MiB segment
    /// at the lower address first (idle), then a 38 MiB one whose free
    /// blocks are a hole between live blocks, two whole idle granules and a
    /// free end.
    #[test]
    fn the_memory_map_lays_segments_end_to_end_and_colours_free_memory_by_class() {
        let free = segment(0x2000_0000, &[(2.0, false)]);
        let used = segment(
            0x4000_0000,
            &[
                (1.5, true),
                (1.0, false),
                (3.5, true),
                (4.0, false),
                (13.5, true),
                (13.5, true),
                (1.0, false),
            ],
        );
        let html = memory_map("policy:hbm", &peak_of(vec![used, free]));
        let rect = |x: &str, row: u32, width: &str, fill: &str| {
            format!(
                "<rect x='{x}' y='{}' width='{width}' height='10' fill='{fill}'></rect>",
                row * 12
            )
        };
        for part in [
            rect("0.00", 0, "960.00", IDLE),
            rect("0.00", 1, "960.00", IDLE),
            rect("0.00", 2, "960.00", ALLOCATED),
            rect("0.00", 3, "480.00", ALLOCATED),
            rect("480.00", 3, "480.00", BETWEEN),
            rect("0.00", 4, "480.00", BETWEEN),
            rect("480.00", 4, "480.00", ALLOCATED),
            rect("0.00", 8, "960.00", IDLE),
            rect("0.00", 11, "960.00", IDLE),
            rect("0.00", 12, "960.00", ALLOCATED),
            rect("0.00", 39, "960.00", EDGE),
            format!(
                "<rect x='0.00' y='24' width='960.00' height='10' fill='#ffffff'><title>segment at \
                 0x40000000: {} (7 blocks), {} allocated; free: {} idle, {} at the edges, {} \
                 between live blocks</title></rect>",
                human(38 * MIB),
                human(32 * MIB),
                human(4 * MIB),
                human(MIB),
                human(MIB)
            ),
        ] {
            assert!(html.contains(&part), "{part}\nnot in\n{html}");
        }
        assert!(!html.contains(&rect("0.00", 12, "960.00", IDLE)));
        // A background per row a segment covers (40), and the runs: idle
        // (2 rows), allocated (2), the hole (2), allocated (4), idle (4),
        // allocated (27: two blocks, one run) and the free end (1).
        assert_eq!(
            html.matches("<rect").count(),
            40 + 2 + 2 + 2 + 4 + 4 + 27 + 1
        );
        assert!(html.contains(&format!(
            "at its peak (after op 10 of 20): {} reserved in 2 segments",
            human(40 * MIB)
        )));
        assert!(html.contains(&format!("One row is {}.", human(MIB))));
        assert!(html.contains("<svg class='map' viewBox='0 0 960 480' width='960' height='480'"));
        assert!(!html.contains("left out"));
    }

    /// 20,040 one-block segments of 512 bytes, 501 to a row: two
    /// rectangles each, so the map stops after the segment that passes
    /// 20,000 (the 10,001st) and says how many it left out.
    #[test]
    fn the_memory_map_stops_at_its_rectangle_bound() {
        let segments = (0..20_040u64)
            .map(|i| SegmentSnapshot {
                address: i * 512,
                total_size: 512,
                stream: StreamId(0),
                small_pool: false,
                expandable: false,
                blocks: vec![block(i * 512, 512, false)],
            })
            .collect();
        let html = memory_map("policy:pytorch", &peak_of(segments));
        assert!(
            html.contains(
                "The last 10039 segments are left out: the map stops at 20000 rectangles."
            ),
            "{}",
            &html[..html.find("<svg").unwrap()]
        );
        assert_eq!(html.matches("<rect").count(), 2 * 10_001);
    }

    /// The largest allocations live at live memory's first peak, when each
    /// was made (after which op), nothing freed before it.
    #[test]
    fn the_largest_live_allocations_are_those_of_the_peak() {
        let device = DeviceTrace {
            ops: vec![
                Op::Alloc {
                    id: 1,
                    size: 300,
                    stream: 0,
                },
                Op::Free { id: 1 },
                Op::Alloc {
                    id: 2,
                    size: 100,
                    stream: 0,
                },
                Op::Alloc {
                    id: 3,
                    size: 250,
                    stream: 0,
                },
                Op::Free { id: 2 },
                Op::Free { id: 3 },
            ],
            ..DeviceTrace::default()
        };
        let live = hbmalloc_replay::live_bytes_after_ops(&device);
        let html = largest_live(&device, &live, Err("none recorded".into()));
        assert!(html.contains(&format!(
            "Live memory first peaked after op 4: {} in 2 allocations",
            human(350)
        )));
        assert!(html.contains("No stack frames: none recorded."));
        assert!(html.contains(&format!(
            "<tr><td>{}</td><td>op 4</td><td class='frames'></td></tr>\
             <tr><td>{}</td><td>op 3</td><td class='frames'></td></tr></table>",
            human(250),
            human(100)
        )));
    }

    fn frame(file: &str, name: &str, line: i64) -> PickleValue {
        PickleValue::dict([
            ("filename", PickleValue::str(file)),
            ("name", PickleValue::str(name)),
            ("line", PickleValue::int(line)),
        ])
    }

    fn snapshot_file(snapshot: &PickleValue) -> tempfile::NamedTempFile {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), to_pickle(snapshot)).unwrap();
        file
    }

    /// A dumped block without an address lies where the one before it
    /// ends; Python's frames are kept where there are any, C++'s only
    /// where there are none, unwinder frames (`??`) never.
    #[test]
    fn a_snapshots_frames_are_read_by_allocation_and_by_dumped_block() {
        let python = PickleValue::List(vec![
            frame("??", "unwind", 0),
            frame("model.py", "forward", 42),
            frame("ops.cpp", "launch", 7),
        ]);
        let native = PickleValue::List(vec![
            frame("??", "unwind", 0),
            frame("ops.cpp", "launch", 7),
        ]);
        let dumped = |state: &str, size: i64, frames: PickleValue| {
            PickleValue::dict([
                ("size", PickleValue::int(size)),
                ("state", PickleValue::str(state)),
                ("frames", frames),
            ])
        };
        let segments = PickleValue::List(vec![PickleValue::dict([
            ("device", PickleValue::int(0)),
            ("address", PickleValue::int(0x1000)),
            (
                "blocks",
                PickleValue::List(vec![
                    dumped("inactive", 512, PickleValue::List(Vec::new())),
                    dumped("active_allocated", 1024, python),
                ]),
            ),
        ])]);
        let traces = PickleValue::List(vec![PickleValue::List(vec![
            PickleValue::dict([
                ("action", PickleValue::str("alloc")),
                ("size", PickleValue::int(1024)),
                ("frames", native),
            ]),
            PickleValue::dict([
                ("action", PickleValue::str("free_requested")),
                ("size", PickleValue::int(1024)),
            ]),
        ])]);
        let file = snapshot_file(&PickleValue::dict([
            ("segments", segments.clone()),
            ("device_traces", traces),
        ]));
        let found = frames_of(file.path()).unwrap();
        assert_eq!(
            found.at_dump[&0],
            HashMap::from([(0x1200, vec!["forward (model.py:42)".to_string()])])
        );
        assert_eq!(
            found.allocs[&0],
            [(1024, vec!["launch (ops.cpp:7)".to_string()])]
        );
        // Dumped blocks alone are frames enough; neither is none.
        let file = snapshot_file(&PickleValue::dict([("segments", segments)]));
        assert!(frames_of(file.path()).unwrap().allocs.is_empty());
        let file = snapshot_file(&PickleValue::dict([(
            "segments",
            PickleValue::List(Vec::new()),
        )]));
        assert!(frames_of(file.path()).unwrap_err().contains("no history"));
    }

    /// Blocks whose addresses and sizes run past 2^64 (a hostile snapshot's)
    /// are read, their addresses saturating, rather than overflowing.
    #[test]
    fn blocks_past_the_end_of_the_address_space_are_read() {
        let block = |state: &str, size: u64| {
            PickleValue::dict([
                ("size", PickleValue::int(size)),
                ("state", PickleValue::str(state)),
            ])
        };
        let segments = PickleValue::List(vec![PickleValue::dict([
            ("address", PickleValue::int(u64::MAX - 511)),
            (
                "blocks",
                PickleValue::List(vec![
                    block("inactive", 1024),
                    block("active_allocated", 1024),
                ]),
            ),
        ])]);
        let file = snapshot_file(&PickleValue::dict([("segments", segments)]));
        let found = frames_of(file.path()).unwrap();
        assert!(found.at_dump[&0].contains_key(&u64::MAX));

        let held = |id, size| InitialBlock {
            size,
            requested_size: size,
            state: InitialBlockState::Allocated(id),
        };
        let device = DeviceTrace {
            initial_segments: vec![InitialSegment {
                address: u64::MAX - 511,
                stream: 0,
                small_pool: false,
                expandable: false,
                blocks: vec![held(1, 1024), held(2, 1024)],
            }],
            ..DeviceTrace::default()
        };
        let by_id = frames_by_alloc(&device, &found).unwrap();
        assert_eq!(by_id, HashMap::from([(2, Vec::new())]));
    }

    /// Allocations take their history entry's frames in order; a block
    /// live since before the window takes the dumped block's at its
    /// address, unless the window frees it (the dumped block is another).
    #[test]
    fn frames_go_to_allocations_by_order_and_to_older_blocks_by_address() {
        let text = |t: &str| vec![t.to_string()];
        let snapshot = SnapshotFrames {
            allocs: HashMap::from([(0, vec![(1024, text("a")), (2048, text("b"))])]),
            at_dump: HashMap::from([(
                0,
                HashMap::from([(0x1000, text("later")), (0x1200, text("old"))]),
            )]),
        };
        let older = |id, size| InitialBlock {
            size,
            requested_size: size,
            state: InitialBlockState::Allocated(id),
        };
        let mut device = DeviceTrace {
            initial_segments: vec![InitialSegment {
                address: 0x1000,
                stream: 0,
                small_pool: false,
                expandable: false,
                blocks: vec![older(7, 512), older(8, 256)],
            }],
            ops: vec![
                Op::Alloc {
                    id: 1,
                    size: 1024,
                    stream: 0,
                },
                Op::Free { id: 7 },
                Op::Alloc {
                    id: 2,
                    size: 2048,
                    stream: 0,
                },
            ],
            ..DeviceTrace::default()
        };
        let by_id = frames_by_alloc(&device, &snapshot).unwrap();
        assert_eq!(
            by_id,
            HashMap::from([(1, text("a")), (2, text("b")), (8, text("old"))])
        );
        // The same number of allocations, one of another size: none.
        device.ops[2] = Op::Alloc {
            id: 2,
            size: 4096,
            stream: 0,
        };
        assert!(frames_by_alloc(&device, &snapshot)
            .unwrap_err()
            .contains("do not line up"));
    }
}

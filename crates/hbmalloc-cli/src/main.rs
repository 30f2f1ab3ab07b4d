//! The `hbmalloc` command: thin glue over `hbmalloc-trace` (reading traces),
//! `hbmalloc-replay` (running them) and `hbmalloc-export` (writing
//! snapshots). It knows neither blocks nor formats.

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::{self, ExitCode};

use clap::{Args, Parser, Subcommand};
use hbmalloc::format::format_bytes;
use hbmalloc::{LatencyModel, PolicyConfig};
use hbmalloc_replay::{
    calls_log, evaluate, fidelity, plan_greedy_by_size, plan_last_step, snapshot, timeline,
    EvalOptions, Metrics, SnapshotMoment, Verdict, MAX_CAPACITY_BYTES,
};
use hbmalloc_trace::Trace;

/// `print!` to standard output, ending the program quietly (status 0) when
/// the reader has gone (`hbmalloc compare --json | head -1`), as Unix tools
/// do, where `print!` panics on the closed pipe.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::write_stdout(format_args!($($arg)*))
    };
}

/// `println!` through [`out!`].
macro_rules! outln {
    () => {
        $crate::write_stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

mod advise;
mod bench;
mod budget;
mod report;
mod summary;
mod table;

/// Writes to standard output for [`out!`]: a closed pipe ends the program
/// with status 0 (the reader took what it wanted); any other failure to
/// write ends it with an error.
fn write_stdout(text: std::fmt::Arguments) {
    if let Err(e) = io::stdout().lock().write_fmt(text) {
        if e.kind() == io::ErrorKind::BrokenPipe {
            process::exit(0);
        }
        eprintln!("hbmalloc: error: writing to standard output: {e}");
        process::exit(1);
    }
}

/// The trace `hbmalloc compare` runs when given none: GPT-2 small training,
/// recorded by this team with torch.profiler (ours to ship).
const BUNDLED_TRACE_NAME: &str = "gpt2_train.json.gz (bundled)";
const BUNDLED_TRACE: &[u8] = include_bytes!("../../../traces/gpt2_train.json.gz");

/// The configurations `compare` and `bench` run by default.
const DEFAULT_RUNS: &[&str] = &[
    "policy:pytorch",
    "policy:pytorch,expandable_segments:True",
    "policy:hbm",
];

#[derive(Parser)]
#[command(
    name = "hbmalloc",
    version,
    about = "A caching allocator for GPU memory: replay real allocation traces with no GPU and compare policies."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// What-if options of `compare` and `replay`.
#[derive(Args)]
struct WhatIf {
    /// What if the program ran N more steps: find each trace's last
    /// repeating step (a stretch of operations, sizes and streams alike, that
    /// repeats the one before it: a training iteration) and run it N more
    /// times before the trace's tail. The steady state of a long run, from a
    /// trace of a few steps; a trace without one is refused.
    #[arg(long, value_name = "N")]
    repeat_step: Option<usize>,
    /// What if the program's tensors were slightly different sizes: scale
    /// each distinct request size by its own factor within 5%, drawn from
    /// SEED (the same factor for every request of that size), keeping the
    /// order, streams and lifetimes. A few seeds show how much a result owes
    /// to the exact sizes recorded.
    #[arg(long, value_name = "SEED")]
    jitter_sizes: Option<u64>,
    /// What if the driver mapped part of a physical handle: real drivers
    /// refuse a map at an offset into a handle (`cuMemMap`'s documentation
    /// says the offset "currently must be zero"), and so does the simulated
    /// one by default.
    #[arg(long)]
    part_handle_maps: bool,
    /// What if every driver call were free: by default each costs what it
    /// was measured to cost on an H100 (`docs/driver-latency.md`).
    #[arg(long)]
    zero_latency: bool,
    /// What if a variable-length run went on for N steps: keep each trace up
    /// to its first steady step, then draw N of its recorded steps at random
    /// (seed: --draw-seed), as a data loader draws batches of other lengths.
    /// Needs step marks: torch.profiler's ProfilerStep#N, or in a memory
    /// snapshot the optimizer's steps.
    #[arg(
        long,
        value_name = "N",
        conflicts_with = "repeat_step",
        value_parser = count(MAX_DRAWN_STEPS)
    )]
    draw_steps: Option<usize>,
    /// The seed of --draw-steps.
    #[arg(
        long,
        value_name = "SEED",
        default_value_t = 0,
        requires = "draw_steps"
    )]
    draw_seed: u64,
}

impl WhatIf {
    /// `traces` as the options change them: steps repeated or drawn, then
    /// sizes jittered.
    fn apply(&self, traces: Vec<Trace>) -> Result<Vec<Trace>, String> {
        let mut traces = repeat_steps(traces, self.repeat_step)?;
        if let Some(steps) = self.draw_steps {
            for trace in &mut traces {
                for device in &mut trace.devices {
                    let (drawn, from) = hbmalloc_trace::draw_steps(device, steps, self.draw_seed)
                        .map_err(|e| {
                        format!(
                            "{}: --draw-steps: {e}",
                            table::on_device(&trace.source, device.device)
                        )
                    })?;
                    eprintln!(
                        "hbmalloc: {}: {} drawn from {from} of its {} recorded steps",
                        table::on_device(&trace.source, device.device),
                        table::count_of(steps, "step"),
                        device.step_starts.len()
                    );
                    *device = drawn;
                }
                trace.source = format!(
                    "{} ~{} drawn (seed {})",
                    trace.source,
                    table::count_of(steps, "step"),
                    self.draw_seed
                );
            }
        }
        if let Some(seed) = self.jitter_sizes {
            for trace in &mut traces {
                for device in &mut trace.devices {
                    *device = hbmalloc_trace::jitter_sizes(device, seed);
                }
                trace.source = format!("{} ~sizes{seed}", trace.source);
            }
        }
        for (asked, label) in [
            (self.part_handle_maps, "part-handle-maps"),
            (self.zero_latency, "zero-latency"),
        ] {
            if asked {
                for trace in &mut traces {
                    trace.source = format!("{} ~{label}", trace.source);
                }
            }
        }
        Ok(traces)
    }

    /// One line saying which driver the replays simulated.
    fn driver_description(&self) -> String {
        let maps = if self.part_handle_maps {
            "also maps part of a physical handle (what-if: --part-handle-maps)"
        } else {
            "maps whole physical handles only, as real drivers do"
        };
        let latency = if self.zero_latency {
            "every call free (what-if: --zero-latency)"
        } else {
            "calls timed as measured on an H100"
        };
        format!("Replayed on a simulated GPU whose driver {maps}; {latency}.")
    }

    /// Evaluation options for `policy` on the simulated driver these
    /// what-ifs ask for.
    fn eval_options(&self, policy: PolicyConfig) -> EvalOptions {
        EvalOptions {
            maps_handle_parts: self.part_handle_maps,
            latency: if self.zero_latency {
                LatencyModel::zero()
            } else {
                LatencyModel::h100()
            },
            ..EvalOptions::new(policy)
        }
    }
}

/// The arguments of `compare`.
#[derive(Args)]
struct CompareArgs {
    /// Trace files: PyTorch snapshots (.pickle), torch.profiler traces (.json, .json.gz), RMM logs (.csv).
    traces: Vec<PathBuf>,
    /// A configuration to run, as a settings string (`policy:pytorch,expandable_segments:True`);
    /// repeat for several. Default: pytorch, pytorch with expandable segments, and hbm.
    #[arg(long = "run", value_name = "SETTINGS")]
    runs: Vec<String>,
    /// Device capacity for the replays: a size (80GiB) or a multiple of
    /// each trace's peak live memory (1.03x); default unbounded.
    #[arg(long, value_parser = parse_capacity)]
    capacity: Option<Capacity>,
    /// Skip the minimum-capacity bisection (faster).
    #[arg(long)]
    no_min_capacity: bool,
    /// Print one JSON object per line instead of the table.
    #[arg(long)]
    json: bool,
    /// One line per trace, the configurations side by side (about 60
    /// columns each), instead of a block per trace.
    #[arg(long)]
    wide: bool,
    /// Also write live memory and each configuration's reserved memory
    /// after every op to PATH, as CSV (`op,live_bytes`, then a column
    /// per configuration): where and when reserved memory parts from
    /// live memory. For a trace of several devices, `.devN` goes before
    /// the extension. One trace file only.
    #[arg(long, value_name = "PATH")]
    timeline: Option<PathBuf>,
    /// Also lay each trace out offline, knowing all of it in advance
    /// (greedy by size: largest block first, each in the smallest gap
    /// among the blocks alive with it), and show what that plan holds
    /// with granules mapped only under blocks: a reference for how much
    /// of a policy's waste came from not knowing the future. No online
    /// allocator can be sure to reach it. With --json, also an estimate
    /// for a training loop that plans each step from the one before
    /// (`planned_last_step`).
    #[arg(long)]
    planned: bool,
    #[command(flatten)]
    what_if: WhatIf,
}

/// The arguments of `replay`.
#[derive(Args)]
struct ReplayArgs {
    /// Trace files.
    #[arg(required = true)]
    traces: Vec<PathBuf>,
    /// The policy: hbm (hbmalloc's own) or pytorch (PyTorch's allocator, reproduced).
    #[arg(long, default_value = "hbm")]
    policy: String,
    /// The policy's configuration (`key:value,...`; PYTORCH_CUDA_ALLOC_CONF syntax for pytorch).
    #[arg(long, default_value = "")]
    config: String,
    /// Device capacity: a size (80GiB, 81920MiB, or bytes) or a multiple
    /// of the trace's peak live memory (1.03x); default unbounded.
    #[arg(long, value_parser = parse_capacity)]
    capacity: Option<Capacity>,
    /// Also bisect for the smallest capacity the trace fits.
    #[arg(long)]
    min_capacity: bool,
    /// Also print PyTorch's `memory_summary()` table of the allocator after the replay.
    #[arg(long)]
    summary: bool,
    /// Skip the out-of-memory errors the trace recorded instead of
    /// reproducing them (by making the simulated device report the free
    /// memory the real one reported at that moment), as `compare` does.
    /// Reproduced, a failing growth may create memory it gives back at the
    /// failure (expandable segments create page by page): the device held
    /// it, so peak_reserved_bytes counts it; PyTorch's reserved statistic,
    /// which `recorded peak_reserved` reads, does not.
    #[arg(long)]
    ignore_recorded_ooms: bool,
    /// Print one JSON object per trace and device.
    #[arg(long)]
    json: bool,
    /// Also write the allocator's snapshot at the moment its reserved
    /// memory first peaked (or at its out-of-memory error) to PATH, as a
    /// PyTorch memory snapshot that pytorch.org/memory_viz opens: where
    /// the waste is (a second line splits the free memory there into idle
    /// granules, edges of mapped ranges and holes between live blocks).
    /// For a trace of several devices, `.devN` goes before
    /// the extension. One trace file only.
    #[arg(long, value_name = "PATH", conflicts_with = "snapshot_at_op")]
    snapshot_at_peak: Option<PathBuf>,
    /// Also write the allocator's snapshot after op N (0: the initial
    /// state; or at an out-of-memory error before it) to PATH, as
    /// `--snapshot-at-peak` does: how the allocator got where it is
    /// (`compare --timeline` says when reserved memory grew).
    #[arg(long, num_args = 2, value_names = ["N", "PATH"])]
    snapshot_at_op: Option<Vec<String>>,
    /// Also write a row for every op that called the driver to PATH, as
    /// CSV (the op, what it asked for, live and reserved memory after it,
    /// the simulated driver time, then a count per kind of call): which
    /// requests cost driver time, and what for. For a trace of several
    /// devices, `.devN` goes before the extension. One trace file only.
    #[arg(long, value_name = "PATH")]
    calls_log: Option<PathBuf>,
    #[command(flatten)]
    what_if: WhatIf,
}

/// The arguments of `fidelity`.
#[derive(Args)]
struct FidelityArgs {
    /// PyTorch memory snapshot pickles.
    #[arg(required = true)]
    snapshots: Vec<PathBuf>,
    /// Print one JSON object per snapshot and device.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Replay traces under each configuration and print them side by side.
    /// With no trace, runs the bundled GPT-2 training trace. Out-of-memory
    /// errors the trace recorded are not reproduced (`replay` reproduces
    /// them): each configuration runs the whole trace on the device given.
    Compare(CompareArgs),
    /// Replay traces under one policy and print the metrics.
    Replay(ReplayArgs),
    /// Check that policy pytorch reproduces the segment decisions recorded in PyTorch snapshots.
    Fidelity(FidelityArgs),
    /// Measure allocator CPU time per operation (ns_per_op) with free driver calls.
    Bench {
        /// Trace files; default: the bundled trace.
        traces: Vec<PathBuf>,
        /// A configuration to run; repeat for several.
        #[arg(long = "run", value_name = "SETTINGS")]
        runs: Vec<String>,
        /// Replays per measurement (the median is reported).
        #[arg(long, default_value_t = 5, value_parser = count(1000))]
        repeat: usize,
        /// Print one JSON object per line.
        #[arg(long)]
        json: bool,
        /// Also time each malloc and free on its own and report those that
        /// allocate, map or free no device memory (cache hits) apart: `hit
        /// ns/op` in the table, `hit_ns_per_op`, `hit_share` and `hit_ops` in `--json`.
        #[arg(long)]
        hits: bool,
    },
    /// Measure operations per second for several threads: the sharded
    /// thread-safe allocator against one mutex around the same engine.
    BenchThreads {
        #[command(flatten)]
        engine: EngineBench,
        /// Thread counts to measure.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4,8", value_parser = count(256))]
        threads: Vec<usize>,
        /// Engine shards of the sharded allocator.
        #[arg(long, default_value_t = 16, value_parser = count(4096))]
        shards: usize,
        /// Runs per measurement (the median is reported).
        #[arg(long, default_value_t = 3, value_parser = count(1000))]
        repeat: usize,
    },
    /// Measure what the production log (`log:PATH`: history kept on every
    /// engine) costs per operation: the sharded allocator with and without
    /// it, side by side in one run.
    BenchLog {
        #[command(flatten)]
        engine: EngineBench,
        /// History entries each engine keeps (the log's `log_entries`).
        #[arg(long, default_value_t = 1_000_000, value_parser = count(1 << 30))]
        entries: usize,
        /// Runs per measurement (the median is reported).
        #[arg(long, default_value_t = 5, value_parser = count(1000))]
        repeat: usize,
    },
    /// Measure cost per operation and driver calls as the number of live
    /// blocks grows (10^2 to 10^6 by default), side by side.
    BenchScaling {
        /// A configuration to run; repeat for several. Default: pytorch, pytorch+expandable, hbm.
        #[arg(long = "run", value_name = "SETTINGS")]
        runs: Vec<String>,
        /// Live-block counts to measure.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "100,1000,10000,100000,1000000",
            value_parser = clap::value_parser!(u64).range(1..=10_000_000)
        )]
        live: Vec<u64>,
        /// Churn operations (free one, allocate one) per measurement.
        #[arg(
            long,
            default_value_t = 200_000,
            value_parser = clap::value_parser!(u64).range(1..=1_000_000_000)
        )]
        churn: u64,
    },
    /// Print PyTorch's memory_summary() table for a trace, from a replay
    /// under policy pytorch with the trace's recorded configuration.
    Summary(summary::SummaryArgs),
    /// Sweep policies and settings by replay and say which to use: the
    /// smallest device that fits (or, given --capacity, the most traces that
    /// fit it), then peak reserved, then driver time; driver calls a program
    /// would notice rank last.
    Advise(advise::AdviseArgs),
    /// Write one self-contained HTML page showing where memory went under
    /// each configuration: memory over time, the map at the peak, the
    /// largest live allocations, driver calls, OOMs and the comparison.
    Report(report::ReportArgs),
    /// The memory budget of transformer training or inference (weights,
    /// gradients, optimizer, activations, KV cache) from a model
    /// description or a Hugging Face config.json.
    Plan(budget::PlanArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("hbmalloc: error: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> Result<(), String> {
    match command {
        Command::Compare(args) => compare(args),
        Command::Replay(args) => replay(args),
        Command::Fidelity(args) => fidelity_check(args),
        Command::Bench {
            traces,
            runs,
            repeat,
            json,
            hits,
        } => {
            let runs = parse_runs(&runs)?;
            let traces = load_or_bundled(&traces)?;
            bench::run(&traces, &runs, repeat, json, hits)
        }
        Command::BenchScaling { runs, live, churn } => {
            let runs = parse_runs(&runs)?;
            bench::scaling(&runs, &live, churn)
        }
        Command::BenchThreads {
            engine,
            threads,
            shards,
            repeat,
        } => {
            let (traces, policy) = engine.load()?;
            bench::threads(&traces, &policy, &threads, shards, repeat)
        }
        Command::BenchLog {
            engine,
            entries,
            repeat,
        } => {
            let (traces, policy) = engine.load()?;
            bench::log(&traces, &policy, entries, repeat)
        }
        Command::Summary(args) => summary::run(args),
        Command::Advise(args) => advise::run(args),
        Command::Report(args) => report::run(args),
        Command::Plan(args) => budget::run(args),
    }
}

fn compare(args: CompareArgs) -> Result<(), String> {
    let CompareArgs {
        traces,
        runs,
        capacity,
        no_min_capacity,
        json,
        wide,
        timeline: timeline_path,
        planned,
        what_if,
    } = args;
    let runs = parse_runs(&runs)?;
    if timeline_path.is_some() && traces.len() > 1 {
        return Err(format!(
            "--timeline writes one trace's timeline, and {} traces were given",
            traces.len()
        ));
    }
    let traces = what_if.apply(load_or_bundled(&traces)?)?;
    let mut rows = Vec::new();
    let mut plans = Vec::new();
    for trace in &traces {
        for device in &trace.devices {
            let in_device =
                |e: String| format!("{}: {e}", table::on_device(&trace.source, device.device));
            // Each configuration's options on this device: the
            // metrics and the timeline replay the same ones.
            let configurations: Vec<EvalOptions> = runs
                .iter()
                .map(|policy| EvalOptions {
                    capacity_bytes: capacity.map(|c| c.bytes(device)),
                    find_min_capacity: !no_min_capacity,
                    ..what_if.eval_options(policy.clone())
                })
                .collect();
            let mut metrics = Vec::new();
            for options in &configurations {
                let m = evaluate(&trace.source, device, options)
                    .map_err(|e| in_device(e.to_string()))?;
                if json {
                    outln!("{}", to_json(&m));
                }
                metrics.push(m);
            }
            let plan = planned.then(|| plan_greedy_by_size(device));
            if let (Some(plan), true) = (&plan, json) {
                let mut value = serde_json::json!({
                    "trace": metrics.first().map_or(&trace.source, |m| &m.trace),
                    "device": device.device,
                });
                value["planned"] = serde_json::to_value(plan).map_err(|e| e.to_string())?;
                value["planned_last_step"] =
                    serde_json::to_value(plan_last_step(device)).map_err(|e| e.to_string())?;
                outln!("{value}");
            }
            rows.push(metrics);
            plans.push(plan);
            if let Some(path) = &timeline_path {
                let path = device_path(path, device.device, trace.devices.len());
                let written = write_timeline(device, &configurations, &path).map_err(in_device)?;
                eprintln!(
                    "hbmalloc: {}: {written}",
                    table::on_device(&trace.source, device.device)
                );
            }
        }
    }
    if !json {
        let layout = if wide {
            table::Layout::Wide
        } else {
            table::Layout::Blocks {
                width: output_width(),
            }
        };
        out!(
            "{}",
            table::compare_table(&rows, &plans, &what_if.driver_description(), layout)
        );
    }
    Ok(())
}

fn replay(args: ReplayArgs) -> Result<(), String> {
    let ReplayArgs {
        traces,
        policy,
        config,
        capacity,
        min_capacity,
        summary,
        ignore_recorded_ooms,
        json,
        snapshot_at_peak,
        snapshot_at_op,
        calls_log,
        what_if,
    } = args;
    let policy = PolicyConfig::parse(&policy, &config).map_err(|e| e.to_string())?;
    let snapshot_request = match (snapshot_at_peak, snapshot_at_op) {
        (Some(path), _) => Some((SnapshotMoment::Peak, path)),
        (None, Some(args)) => {
            let op = args[0].parse().map_err(|_| {
                format!(
                    "--snapshot-at-op N PATH: N must be a number of ops, not '{}'",
                    args[0]
                )
            })?;
            Some((SnapshotMoment::AfterOps(op), PathBuf::from(&args[1])))
        }
        (None, None) => None,
    };
    if (snapshot_request.is_some() || calls_log.is_some()) && traces.len() > 1 {
        return Err(format!(
            "a snapshot or calls log is written for one trace, and {} traces were given",
            traces.len()
        ));
    }
    for trace in what_if.apply(load_all(&traces)?)? {
        for device in &trace.devices {
            let options = EvalOptions {
                capacity_bytes: capacity.map(|c| c.bytes(device)),
                find_min_capacity: min_capacity,
                reproduce_recorded_ooms: !ignore_recorded_ooms,
                ..what_if.eval_options(policy.clone())
            };
            let m = evaluate(&trace.source, device, &options)
                .map_err(|e| format!("{}: {e}", table::on_device(&trace.source, device.device)))?;
            if json {
                outln!("{}", to_json(&m));
            } else {
                out!("{}", table::metrics_text(&m));
            }
            if !json && (m.out_of_memory.is_some() || !m.reproduced_ooms.is_empty()) {
                out!("{}", what_would_help(&trace.source, device, &options)?);
            }
            if summary {
                outln!(
                    "{}",
                    hbmalloc::memory_summary(&m.final_stats, device.device, false)
                );
            }
            // A file written beside the metrics: its path for this device,
            // and a line saying what it holds (on stderr beside JSON).
            let write_beside = |path: &Path, write: &dyn Fn(&Path) -> Result<String, String>| {
                let path = device_path(path, device.device, trace.devices.len());
                let written = write(&path).map_err(|e| {
                    format!("{}: {e}", table::on_device(&trace.source, device.device))
                })?;
                if json {
                    eprintln!("hbmalloc: {written}");
                } else {
                    outln!("  {written}");
                }
                Ok::<(), String>(())
            };
            if let Some(path) = &calls_log {
                write_beside(path, &|path| write_calls_log(device, &options, path))?;
            }
            if let Some((moment, path)) = &snapshot_request {
                write_beside(path, &|path| {
                    write_snapshot(device, &options, *moment, path)
                })?;
            }
        }
    }
    Ok(())
}

fn fidelity_check(args: FidelityArgs) -> Result<(), String> {
    let FidelityArgs { snapshots, json } = args;
    let mut reports = Vec::new();
    for trace in load_all(&snapshots)? {
        for device in &trace.devices {
            let report = fidelity(device).map_err(|e| {
                format!(
                    "{} device {}: {e}",
                    trace.source,
                    table::device_label(device.device)
                )
            })?;
            if json {
                let mut value = serde_json::to_value(&report).map_err(|e| e.to_string())?;
                value["trace"] = serde_json::Value::String(trace.source.clone());
                value["verdict"] =
                    serde_json::to_value(report.verdict()).map_err(|e| e.to_string())?;
                outln!("{value}");
            } else {
                out!("{}", table::fidelity_text(&trace.source, &report));
            }
            reports.push(report);
        }
    }
    let summary = table::fidelity_summary(snapshots.len(), &reports);
    if json {
        eprintln!("hbmalloc: {summary}");
    } else {
        outln!("{summary}");
    }
    let diverging = reports
        .iter()
        .filter(|r| !r.foreign_allocator && r.verdict() == Verdict::Diverges)
        .count();
    if diverging > 0 {
        return Err(format!(
            "policy pytorch diverges from the recorded allocator on {diverging} device(s) \
             of CUDA snapshots"
        ));
    }
    Ok(())
}

/// After an out-of-memory error: the smallest device on which the trace
/// completes under the configuration replayed and the alternatives, on the
/// same simulated driver, from replay.
fn what_would_help(
    source: &str,
    device: &hbmalloc_trace::DeviceTrace,
    replayed: &EvalOptions,
) -> Result<String, String> {
    let mut candidates = vec![replayed.policy.clone()];
    for settings in DEFAULT_RUNS {
        let policy = PolicyConfig::from_settings(settings).map_err(|e| e.to_string())?;
        if !candidates.contains(&policy) {
            candidates.push(policy);
        }
    }
    let mut out = String::from("  smallest device on which every request that succeeded in the trace succeeds (replayed):\n");
    for policy in candidates {
        let options = EvalOptions {
            policy: policy.clone(),
            capacity_bytes: None,
            find_min_capacity: true,
            reproduce_recorded_ooms: false,
            ..replayed.clone()
        };
        let m = evaluate(source, device, &options).map_err(|e| e.to_string())?;
        let needed = m.min_capacity_bytes.map_or("unknown".to_string(), human);
        out += &format!(
            "    {:<45} {} (peak live {})\n",
            policy.to_settings(),
            needed,
            human(m.peak_live_bytes)
        );
    }
    Ok(out)
}

/// `path` with `.devN` before its extension when a trace has several
/// devices (`devices` of them).
fn device_path(path: &Path, device: i64, devices: usize) -> PathBuf {
    if devices <= 1 {
        return path.to_path_buf();
    }
    let stem = path.file_stem().unwrap_or_default().to_string_lossy();
    let name = match path.extension() {
        Some(ext) => format!("{stem}.dev{device}.{}", ext.to_string_lossy()),
        None => format!("{stem}.dev{device}"),
    };
    path.with_file_name(name)
}

/// Creates `path` and writes it with `write`; an error names the path.
fn write_file(
    path: &Path,
    write: impl FnOnce(&mut io::BufWriter<std::fs::File>) -> io::Result<()>,
) -> Result<(), String> {
    let error = |e: io::Error| format!("{}: {e}", path.display());
    let mut file = std::fs::File::create(path)
        .map(io::BufWriter::new)
        .map_err(error)?;
    write(&mut file).map_err(error)
}

/// Writes the timeline of `configurations` on `device` (see `--timeline`)
/// and says what it holds.
fn write_timeline(
    device: &hbmalloc_trace::DeviceTrace,
    configurations: &[EvalOptions],
    path: &Path,
) -> Result<String, String> {
    let timeline = timeline(device, configurations).map_err(|e| e.to_string())?;
    write_file(path, |file| table::write_timeline_csv(&timeline, file))?;
    Ok(format!(
        "timeline of {} ops, {} configurations -> {}",
        timeline.live_bytes.len() - 1,
        timeline.reserved_bytes.len(),
        path.display()
    ))
}

/// Writes what every op of `device` called the driver for (see
/// `--calls-log`) and says what it holds.
fn write_calls_log(
    device: &hbmalloc_trace::DeviceTrace,
    options: &EvalOptions,
    path: &Path,
) -> Result<String, String> {
    let log = calls_log(device, options).map_err(|e| e.to_string())?;
    write_file(path, |file| table::write_calls_csv(device, &log, file))?;
    Ok(format!(
        "calls log                  {} of {} ops called the driver -> {}",
        log.ops.len(),
        device.ops.len(),
        path.display()
    ))
}

/// Writes the snapshot at `moment` (see `--snapshot-at-peak` and
/// `--snapshot-at-op`) and says what it shows.
fn write_snapshot(
    device: &hbmalloc_trace::DeviceTrace,
    options: &EvalOptions,
    moment: SnapshotMoment,
    path: &Path,
) -> Result<String, String> {
    if device.device > hbmalloc_export::MAX_DEVICE_INDEX {
        return Err(format!(
            "no PyTorch snapshot of this device: PyTorch numbers devices up to {}",
            hbmalloc_export::MAX_DEVICE_INDEX
        ));
    }
    let taken = snapshot(device, options, moment).map_err(|e| e.to_string())?;
    let pickle = hbmalloc_export::snapshot_to_pickle(&taken.snapshot, device.device);
    std::fs::write(path, pickle).map_err(|e| format!("{}: {e}", path.display()))?;
    let moment = match (taken.out_of_memory_op, moment) {
        (Some(op), _) => format!("at the out-of-memory error (op {op} of {})", taken.ops),
        (None, SnapshotMoment::Peak) => {
            format!("at peak, after op {} of {}", taken.ops_replayed, taken.ops)
        }
        (None, SnapshotMoment::AfterOps(_)) => {
            format!("after op {} of {}", taken.ops_replayed, taken.ops)
        }
    };
    let free = taken.free_breakdown;
    Ok(format!(
        "snapshot                   {moment}: {} reserved, {} in use, {} free in {} \
         (largest {}) -> {} (open it at pytorch.org/memory_viz)\n  \
         free there                 {} idle (whole granules or segments), {} at the edges of \
         the {} (in a granule or segment a live block pins), {} between live blocks",
        human(taken.reserved_bytes),
        human(taken.active_bytes),
        human(taken.free_bytes),
        table::count_of(taken.free_blocks, "block"),
        human(taken.largest_free_block_bytes),
        path.display(),
        human(free.idle_bytes),
        human(free.segment_edge_bytes),
        table::count_of(taken.segments, "segment"),
        human(free.between_blocks_bytes),
    ))
}

fn to_json(m: &Metrics) -> String {
    serde_json::to_string(m).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
}

fn parse_runs(runs: &[String]) -> Result<Vec<PolicyConfig>, String> {
    let settings: Vec<&str> = if runs.is_empty() {
        DEFAULT_RUNS.to_vec()
    } else {
        runs.iter().map(String::as_str).collect()
    };
    settings
        .iter()
        .map(|s| PolicyConfig::from_settings(s).map_err(|e| format!("--run '{s}': {e}")))
        .collect()
}

/// Loads every trace, saying on stderr what an importer left out; a trace
/// with no device activity is an error, so every command has a device to
/// work on.
fn load_all(paths: &[PathBuf]) -> Result<Vec<Trace>, String> {
    let traces: Vec<Trace> = paths
        .iter()
        .map(|p| hbmalloc_trace::load(p).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    for trace in &traces {
        for note in &trace.notes {
            eprintln!("hbmalloc: {}: {note}", trace.source);
        }
        if trace.devices.is_empty() {
            return Err(format!(
                "{}: no device allocated anything in this trace (an empty snapshot or log): \
                 nothing to replay",
                trace.source
            ));
        }
    }
    Ok(traces)
}

/// A count from 1 to `most`: anything else is refused with the range, not
/// clamped.
/// The traces and engine settings of `bench-threads` and `bench-log`.
#[derive(Args)]
struct EngineBench {
    /// Trace files (with several threads, one per thread in turn); default:
    /// the bundled trace.
    traces: Vec<PathBuf>,
    /// Settings of the engine.
    #[arg(
        long = "run",
        value_name = "SETTINGS",
        default_value = "policy:pytorch"
    )]
    settings: String,
}

impl EngineBench {
    fn load(&self) -> Result<(Vec<Trace>, PolicyConfig), String> {
        let policy = PolicyConfig::from_settings(&self.settings).map_err(|e| e.to_string())?;
        Ok((load_or_bundled(&self.traces)?, policy))
    }
}

/// The most steps `--draw-steps` takes: a step is at least one operation,
/// and a drawn run holds no more operations than this.
const MAX_DRAWN_STEPS: u64 = 50_000_000;

fn count(most: u64) -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::new().range(1..=most)
}

/// `traces` with each device's last step run `copies` more times
/// (`--repeat-step`); says on stderr which step each one repeats.
fn repeat_steps(traces: Vec<Trace>, copies: Option<usize>) -> Result<Vec<Trace>, String> {
    let Some(copies) = copies else {
        return Ok(traces);
    };
    traces
        .into_iter()
        .map(|mut trace| {
            for device in &mut trace.devices {
                let (repeated, step) = hbmalloc_trace::repeat_last_step(device, copies)
                    .map_err(|e| format!("{}: {}: {}", trace.source, e.location, e.message))?;
                eprintln!(
                    "hbmalloc: {}: the step of {} operations from operation {} runs {} \
                     more times ({} -> {} operations)",
                    table::on_device(&trace.source, device.device),
                    step.len,
                    step.start,
                    copies,
                    device.ops.len(),
                    repeated.ops.len()
                );
                *device = repeated;
            }
            trace.source = format!("{} +{copies} steps", trace.source);
            Ok(trace)
        })
        .collect()
}

fn load_or_bundled(paths: &[PathBuf]) -> Result<Vec<Trace>, String> {
    if paths.is_empty() {
        let trace = hbmalloc_trace::parse_bytes(BUNDLED_TRACE_NAME, BUNDLED_TRACE)
            .map_err(|e| e.to_string())?;
        Ok(vec![trace])
    } else {
        load_all(paths)
    }
}

/// A device capacity for replays.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Capacity {
    /// This many bytes.
    Bytes(u64),
    /// This multiple of each trace's peak live memory ("does it run with 3%
    /// headroom?"), so one setting fits traces of any size.
    TimesPeakLive(f64),
}

impl Capacity {
    /// The capacity in bytes for one device's trace.
    fn bytes(self, trace: &hbmalloc_trace::DeviceTrace) -> u64 {
        match self {
            Capacity::Bytes(bytes) => bytes,
            // Within the bounds of a capacity given in bytes, whatever the
            // peak (a hostile trace's may be past 2^64 bytes).
            Capacity::TimesPeakLive(factor) => ((hbmalloc_replay::peak_live_bytes(trace) as f64
                * factor) as u64)
                .clamp(1, MAX_CAPACITY_BYTES),
        }
    }
}

/// Parses `1.03x` (a multiple of peak live memory), or `80GiB`, `80G`,
/// `81920MiB`, `1.5TiB` or plain bytes. Units are binary whether written
/// `G`, `GB` or `GiB`: device memory is sold that way.
fn parse_capacity(text: &str) -> Result<Capacity, String> {
    let t = text.trim();
    if let Some(factor) = t.strip_suffix(['x', 'X']) {
        let factor: f64 = factor.trim().parse().map_err(|_| {
            format!("capacity '{text}': expected a multiple of peak live memory, e.g. 1.03x")
        })?;
        if !(0.01..=1000.0).contains(&factor) {
            return Err(format!(
                "capacity '{text}': the multiple of peak live memory must be between 0.01x and 1000x"
            ));
        }
        return Ok(Capacity::TimesPeakLive(factor));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number.parse().map_err(|_| {
        format!("capacity '{text}': expected a number with an optional unit, e.g. 80GiB")
    })?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        other => {
            return Err(format!(
                "capacity '{text}': unknown unit '{other}' (use B, KiB, MiB, GiB or TiB)"
            ))
        }
    };
    let bytes = value * (1u64 << shift) as f64;
    if shift == 0 && value.fract() != 0.0 {
        // A size in bytes is whole: a fraction is a multiple missing its x.
        return Err(format!(
            "capacity '{text}': a number of bytes is whole; for a multiple of peak live \
             memory write {number}x"
        ));
    }
    if !bytes.is_finite() || bytes < 1.0 || bytes > MAX_CAPACITY_BYTES as f64 {
        return Err(format!(
            "capacity '{text}' must be between 1 byte and 1 PiB"
        ));
    }
    Ok(Capacity::Bytes(bytes as u64))
}

/// The columns tables may fill: the terminal's width where standard output
/// is one, else `COLUMNS` where set, else 100.
fn output_width() -> usize {
    if let Some((terminal_size::Width(width), _)) = terminal_size::terminal_size_of(io::stdout()) {
        return usize::from(width);
    }
    std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.trim().parse().ok())
        .filter(|&c| c > 0)
        .unwrap_or(100)
}

/// Formats a byte count for tables.
fn human(bytes: u64) -> String {
    format_bytes(bytes)
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::{device_path, parse_capacity, Capacity, MAX_CAPACITY_BYTES};

    #[test]
    fn snapshot_paths_name_the_device_when_a_trace_has_several() {
        let path = Path::new("out/peak.pickle");
        assert_eq!(device_path(path, 1, 1), PathBuf::from("out/peak.pickle"));
        assert_eq!(
            device_path(path, 1, 2),
            PathBuf::from("out/peak.dev1.pickle")
        );
        assert_eq!(
            device_path(Path::new("peak"), 0, 3),
            PathBuf::from("peak.dev0")
        );
    }

    #[test]
    fn capacities() {
        assert_eq!(parse_capacity("80GiB"), Ok(Capacity::Bytes(80 << 30)));
        assert_eq!(parse_capacity("80G"), Ok(Capacity::Bytes(80 << 30)));
        assert_eq!(parse_capacity("512"), Ok(Capacity::Bytes(512)));
        assert_eq!(parse_capacity("1.5 MiB"), Ok(Capacity::Bytes(3 << 19)));
        assert_eq!(parse_capacity("1.03x"), Ok(Capacity::TimesPeakLive(1.03)));
        assert_eq!(parse_capacity(" 2X"), Ok(Capacity::TimesPeakLive(2.0)));
        assert!(parse_capacity("x").is_err());
        assert!(parse_capacity("0x").is_err());
        assert!(parse_capacity("nanx").is_err());
        assert!(parse_capacity("-1x").is_err());
        assert!(parse_capacity("-1").is_err());
        assert!(parse_capacity("12 parsecs").is_err());
        assert!(parse_capacity("0").is_err());
        assert!(parse_capacity("99999999TiB").is_err());
        // From 1 byte to 1 PiB, both ends included.
        assert_eq!(parse_capacity("1"), Ok(Capacity::Bytes(1)));
        assert_eq!(parse_capacity("1024TiB"), Ok(Capacity::Bytes(1 << 50)));
        assert!(parse_capacity("0.5").is_err());
        // A fraction of a byte is a multiple missing its x: said so.
        for fraction in ["1.03", "1.5B", "2.5 b"] {
            let error = parse_capacity(fraction).unwrap_err();
            assert!(error.contains("x"), "{error}");
            assert!(error.contains("bytes is whole"), "{error}");
        }
        assert_eq!(parse_capacity("2.0"), Ok(Capacity::Bytes(2)));
        assert!(parse_capacity("1025TiB").is_err());
    }

    /// A multiple of a peak past 1 PiB (a hostile trace's sizes add up to
    /// exabytes) is held to the bound a capacity in bytes has.
    #[test]
    fn a_multiple_of_an_absurd_peak_is_at_most_one_pib() {
        let alloc = |id| hbmalloc_trace::Op::Alloc {
            id,
            size: 1 << 50,
            stream: 0,
        };
        let trace = hbmalloc_trace::DeviceTrace {
            ops: (0..20_000).map(alloc).collect(),
            ..Default::default()
        };
        let capacity = Capacity::TimesPeakLive(1.03);
        assert_eq!(capacity.bytes(&trace), MAX_CAPACITY_BYTES);
        let small = hbmalloc_trace::DeviceTrace {
            ops: vec![alloc(0)],
            ..Default::default()
        };
        assert_eq!(
            Capacity::TimesPeakLive(0.5).bytes(&small),
            MAX_CAPACITY_BYTES / 2
        );
    }
}

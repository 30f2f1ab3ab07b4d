//! `hbmalloc advise`: replays traces under a sweep of policies and settings
//! on the simulated device and says which one to use, with the evidence.
//!
//! Rank: the smallest device the trace fits (or, given `--capacity`, how
//! many traces fit it, then for those that fit it all peak reserved memory
//! and for the rest the smallest device), then peak reserved memory, then
//! simulated driver time; memory within a tenth of a percent is a tie
//! ([`MEMORY_TIE_SHARE`]). A setting whose driver calls the program would
//! notice ranks after those whose calls it would not ([`DRIVER_TIME_FACTOR`],
//! [`DRIVER_TIME_SHARE`]).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;
use hbmalloc::PolicyConfig;
use hbmalloc_replay::{evaluate, EvalOptions, Metrics, MIN_CAPACITY_RESOLUTION_BYTES};
use hbmalloc_trace::DeviceTrace;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rayon::prelude::*;

use crate::{human, Capacity};

/// The settings swept: PyTorch's defaults first (the baseline every saving
/// is measured against), then each PyTorch knob on its own at values its
/// documentation suggests, then policy hbm, its allowance of waste, and the
/// size of its physical handles (memory against driver calls).
/// `garbage_collection_threshold` acts only under a memory fraction, so it
/// comes with one.
pub const SWEEP: &[&str] = &[
    "policy:pytorch",
    EXPANDABLE,
    "policy:pytorch,max_split_size_mb:128",
    "policy:pytorch,max_split_size_mb:512",
    "policy:pytorch,roundup_power2_divisions:4",
    "policy:pytorch,roundup_power2_divisions:8",
    "policy:pytorch,garbage_collection_threshold:0.8,per_process_memory_fraction:0.99",
    "policy:pytorch,expandable_segments:True,roundup_power2_divisions:4",
    "policy:hbm",
    "policy:hbm,max_waste_percent:0",
    "policy:hbm,max_waste_percent:5",
    "policy:hbm,max_views:4",
    "policy:hbm,whole_handle_granules:1",
    "policy:hbm,whole_handle_granules:4",
    "policy:hbm,whole_handle_granules:64",
];

/// PyTorch's expandable segments: the driver time every setting's is held
/// against, as policy `hbm`'s own target holds it.
const EXPANDABLE: &str = "policy:pytorch,expandable_segments:True";

/// A setting's driver calls are ones the program would notice where, on
/// some trace device, they take more than this many times expandable
/// segments' time there ...
pub const DRIVER_TIME_FACTOR: f64 = 2.0;

/// ... and, on a recording of a GPU, more than this share of the time it
/// spans (a CPU's recording says nothing of a GPU's time, so there the
/// factor alone decides).
pub const DRIVER_TIME_SHARE: f64 = 0.01;

/// The sweep shows a progress bar once it has run this long.
const PROGRESS_AFTER: Duration = Duration::from_secs(1);

/// Arguments of `hbmalloc advise`.
#[derive(Args)]
pub struct AdviseArgs {
    /// Trace files (several: runs of one program; the advice fits them all).
    /// Default: the bundled trace.
    traces: Vec<PathBuf>,
    /// The device to fit: a size (80GiB) or a multiple of each trace's peak
    /// live memory (1.03x). Without it, the settings are ranked by the
    /// smallest device each fits.
    #[arg(long, value_parser = crate::parse_capacity)]
    capacity: Option<Capacity>,
}

/// One configuration's results summed over every trace and device.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The settings string (`policy:...`).
    pub settings: String,
    /// Devices that completed (at `--capacity`, or unbounded).
    pub fits: usize,
    /// Sum of each device's smallest capacity; `None` when one has none.
    pub min_capacity_bytes: Option<u64>,
    /// Sum of peak reserved bytes.
    pub peak_reserved_bytes: u64,
    /// Sum of simulated driver seconds.
    pub driver_seconds: f64,
    /// Sum of memory-moving driver calls.
    pub calls: u64,
    /// Its driver calls take time the program would notice on some device
    /// ([`noticeable_driver_time`]).
    pub slow_driver: bool,
}

impl Row {
    /// `metrics` and `expandable`: each trace device's, in the same order.
    fn of(settings: &str, metrics: &[&Metrics], expandable: &[&Metrics]) -> Row {
        Row {
            settings: settings.to_string(),
            fits: metrics.iter().filter(|m| m.out_of_memory.is_none()).count(),
            min_capacity_bytes: metrics.iter().map(|m| m.min_capacity_bytes).sum(),
            peak_reserved_bytes: metrics.iter().map(|m| m.peak_reserved_bytes).sum(),
            driver_seconds: metrics.iter().map(|m| m.simulated_driver_seconds).sum(),
            calls: metrics.iter().map(|m| m.memory_device_calls).sum(),
            slow_driver: metrics.iter().zip(expandable).any(|(m, e)| {
                noticeable_driver_time(
                    m.simulated_driver_seconds,
                    e.simulated_driver_seconds,
                    m.driver_time_fraction,
                )
            }),
        }
    }
}

/// Whether a replay's simulated driver time (`seconds`) is one its program
/// would notice: over [`DRIVER_TIME_FACTOR`] times expandable segments' on
/// the same trace device (`expandable_seconds`) and, where the recording is
/// a GPU's (`share`: of the time it spans), over [`DRIVER_TIME_SHARE`].
pub fn noticeable_driver_time(seconds: f64, expandable_seconds: f64, share: Option<f64>) -> bool {
    seconds > DRIVER_TIME_FACTOR * expandable_seconds
        && share.is_none_or(|share| share > DRIVER_TIME_SHARE)
}

/// Memory figures this share apart or closer rank as equal, so that the
/// next key decides: a GPU's free memory varies by more than that between
/// runs (the CUDA context, library workspaces), and the smallest device is
/// found to one step of its search per device, which counts as a tie too.
pub const MEMORY_TIE_SHARE: f64 = 0.001;

/// Sorts `rows` best first: most of the `devices` fitting, then driver time
/// the program would not notice, then (without a capacity to fit, or for a
/// setting that runs out of memory in it on some device, whose peak reserved
/// is only that of the part it ran) the smallest device, then peak reserved,
/// then driver time; memory within [`MEMORY_TIE_SHARE`] is a tie, and ties
/// keep the sweep's order, so PyTorch's defaults win a tie.
pub fn rank(rows: &mut [Row], capacity_given: bool, devices: usize) {
    let step = MIN_CAPACITY_RESOLUTION_BYTES.saturating_mul(devices as u64);
    let min_device = tie_classes(
        rows.iter()
            .map(|r| r.min_capacity_bytes.unwrap_or(u64::MAX)),
        step,
    );
    let reserved = tie_classes(rows.iter().map(|r| r.peak_reserved_bytes), step);
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by(|&i, &j| {
        let (a, b) = (&rows[i], &rows[j]);
        b.fits
            .cmp(&a.fits)
            .then(a.slow_driver.cmp(&b.slow_driver))
            .then_with(|| {
                // Equal fits here: both rows fit every device, or both run
                // out of memory on some.
                if capacity_given && a.fits >= devices {
                    std::cmp::Ordering::Equal
                } else {
                    min_device[i].cmp(&min_device[j])
                }
            })
            .then(reserved[i].cmp(&reserved[j]))
            .then(a.driver_seconds.total_cmp(&b.driver_seconds))
    });
    let sorted: Vec<Row> = order.iter().map(|&i| rows[i].clone()).collect();
    rows.clone_from_slice(&sorted);
}

/// Each value's tie class, as the least value of its class: classes start
/// at the least value not yet in one and hold the values up to
/// [`MEMORY_TIE_SHARE`] (and at least `step`) over it. Anchored at their
/// least, so that a chain of close values does not merge into one class.
fn tie_classes(values: impl Iterator<Item = u64>, step: u64) -> Vec<u64> {
    let values: Vec<u64> = values.collect();
    let mut sorted = values.clone();
    sorted.sort_unstable();
    let mut anchors: Vec<u64> = Vec::new();
    for v in sorted {
        let within = |a: u64| {
            let tolerance = ((a as f64 * MEMORY_TIE_SHARE) as u64).max(step);
            v <= a.saturating_add(tolerance)
        };
        if !anchors.last().is_some_and(|&a| within(a)) {
            anchors.push(v);
        }
    }
    values
        .iter()
        .map(|&v| anchors[anchors.partition_point(|&a| a <= v) - 1])
        .collect()
}

/// The environment line that selects `settings`.
pub fn environment_line(settings: &str) -> String {
    match settings.strip_prefix("policy:pytorch") {
        Some(rest) => {
            let conf = rest.trim_start_matches(',');
            if conf.is_empty() {
                "PYTORCH_CUDA_ALLOC_CONF= (PyTorch's defaults: set nothing)".to_string()
            } else {
                format!("PYTORCH_CUDA_ALLOC_CONF={conf}")
            }
        }
        None => format!("HBMALLOC_CONF={settings}"),
    }
}

/// Runs the sweep and prints the advice.
pub fn run(args: AdviseArgs) -> Result<(), String> {
    let traces = crate::load_or_bundled(&args.traces)?;
    let devices: Vec<(&str, &DeviceTrace)> = traces
        .iter()
        .flat_map(|t| t.devices.iter().map(move |d| (t.source.as_str(), d)))
        .collect();
    let policies = SWEEP
        .iter()
        .map(|s| PolicyConfig::from_settings(s).map_err(|e| format!("{s}: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    let jobs: Vec<(usize, usize)> = (0..policies.len())
        .flat_map(|p| (0..devices.len()).map(move |d| (p, d)))
        .collect();

    let bar = ProgressBar::hidden();
    bar.set_length(jobs.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("advise {bar:40} {pos}/{len} replays, {elapsed} (eta {eta})")
            .map_err(|e| e.to_string())?,
    );
    let started = Instant::now();
    let show = std::io::stderr().is_terminal();
    let results: Vec<Metrics> = jobs
        .par_iter()
        .map(|&(p, d)| {
            let (source, device) = devices[d];
            let options = EvalOptions {
                capacity_bytes: args.capacity.map(|c| c.bytes(device)),
                find_min_capacity: true,
                ..EvalOptions::new(policies[p].clone())
            };
            let metrics = evaluate(source, device, &options)
                .map_err(|e| format!("{}: {e}", crate::table::on_device(source, device.device)));
            if show && bar.is_hidden() && started.elapsed() > PROGRESS_AFTER {
                bar.set_draw_target(ProgressDrawTarget::stderr());
            }
            bar.inc(1);
            metrics
        })
        .collect::<Result<_, _>>()?;
    bar.finish_and_clear();

    let of_policy = |p: usize| -> Vec<&Metrics> {
        jobs.iter()
            .zip(&results)
            .filter(|((q, _), _)| *q == p)
            .map(|(_, m)| m)
            .collect()
    };
    let expandable = of_policy(
        SWEEP
            .iter()
            .position(|&s| s == EXPANDABLE)
            .expect("expandable segments are swept"),
    );
    let mut rows: Vec<Row> = SWEEP
        .iter()
        .enumerate()
        .map(|(p, settings)| Row::of(settings, &of_policy(p), &expandable))
        .collect();
    let baseline = rows[0].clone();
    rank(&mut rows, args.capacity.is_some(), devices.len());
    out!(
        "{}",
        advice_text(&rows, &baseline, devices.len(), args.capacity.is_some())
    );
    outln!(
        "swept {} settings on {} trace device(s) in {:.1} s",
        SWEEP.len(),
        devices.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Width of the settings column; longer settings go on a line of their own.
const SETTINGS_WIDTH: usize = 44;

/// The recommendation, its saving against PyTorch's defaults, and the
/// table (at most 100 columns).
pub fn advice_text(rows: &[Row], baseline: &Row, devices: usize, capacity_given: bool) -> String {
    let best = &rows[0];
    let mut text = String::new();
    if best.fits < devices {
        text += &format!(
            "no setting swept fits every trace in the capacity given (the best fits {} of {})\n",
            best.fits, devices
        );
    } else {
        text += &format!("use: {}\n", environment_line(&best.settings));
        if best.slow_driver {
            // Only settings whose calls a program would notice fit this much.
            text += &format!(
                "its driver calls take {:.0} ms, over {DRIVER_TIME_FACTOR}x expandable \
                 segments': a program would notice them\n",
                best.driver_seconds * 1e3
            );
        }
        let saving = |new: Option<u64>, old: Option<u64>| match (new, old) {
            (Some(new), Some(old)) if old > 0 => format!(
                "{} ({:.1}%)",
                signed(old as i128 - new as i128),
                100.0 * (old as f64 - new as f64) / old as f64
            ),
            _ => "-".to_string(),
        };
        if baseline.fits < devices {
            // A replay that ran out of memory stopped early: its peak
            // reserved is no baseline.
            text += &format!(
                "PyTorch's defaults run out of memory on {} of the {devices} trace devices here; \
                 this fits them all,\nand needs {} less device (the smallest that fits)\n",
                devices - baseline.fits,
                saving(best.min_capacity_bytes, baseline.min_capacity_bytes),
            );
        } else {
            text += &format!(
                "against PyTorch's defaults it saves {} of device (the smallest that fits)\n\
                 and {} of peak reserved memory\n",
                saving(best.min_capacity_bytes, baseline.min_capacity_bytes),
                saving(
                    Some(best.peak_reserved_bytes),
                    Some(baseline.peak_reserved_bytes)
                ),
            );
        }
    }
    text += "\n";
    text += &format!(
        "{:>2} {:>5} {:>11} {:>11} {:>9}  {:>6}  {}\n",
        "#", "fits", "min device", "reserved", "driver", "calls", "settings"
    );
    for (i, row) in rows.iter().enumerate() {
        let settings = row
            .settings
            .strip_prefix("policy:")
            .unwrap_or(&row.settings);
        let numbers = format!(
            "{:>2} {:>5} {:>11} {:>11} {:>7.0}ms{} {:>6}  ",
            i + 1,
            format!("{}/{}", row.fits, devices),
            row.min_capacity_bytes.map_or("-".into(), human),
            human(row.peak_reserved_bytes),
            row.driver_seconds * 1e3,
            if row.slow_driver { "!" } else { " " },
            row.calls,
        );
        let indent = " ".repeat(numbers.len());
        text += &numbers;
        text += &wrap(settings, SETTINGS_WIDTH).join(&format!("\n{indent}"));
        text += "\n";
    }
    text += &format!(
        "\nfits: trace devices that completed {}; min device: the smallest device on which\n\
         each completes (2 MiB resolution; summed over devices, as are the other columns);\n\
         reserved: peak device memory held; driver: simulated driver time; calls: driver calls\n\
         that allocate, free, map or unmap memory; !: driver time a program would notice, over\n\
         {}x expandable segments' on some device (and over {}% of the run, on a GPU's\n\
         recording). Ranked by fits, then driver time not noticed, then {}",
        if capacity_given {
            "in --capacity"
        } else {
            "(unbounded device)"
        },
        DRIVER_TIME_FACTOR,
        DRIVER_TIME_SHARE * 100.0,
        if capacity_given {
            "min device where a\n\
             trace device ran out of memory, then peak reserved, then driver time; memory within\n\
             0.1% (or one 2 MiB step a device) is a tie; ties keep the sweep's order (PyTorch's\n\
             defaults first).\n"
        } else {
            "min device, then peak\n\
             reserved, then driver time; memory within 0.1% (or one 2 MiB step a device) is a\n\
             tie; ties keep the sweep's order (PyTorch's defaults first).\n"
        },
    );
    text
}

/// Splits settings at commas into lines of at most `width` characters
/// (a single key longer than that stays whole).
fn wrap(settings: &str, width: usize) -> Vec<String> {
    let mut lines = vec![String::new()];
    for part in settings.split(',') {
        let line = lines.last_mut().expect("never empty");
        if line.is_empty() {
            *line = part.to_string();
        } else if line.len() + 1 + part.len() <= width {
            *line += ",";
            *line += part;
        } else {
            *line += ",";
            lines.push(part.to_string());
        }
    }
    lines
}

/// A signed byte difference.
fn signed(bytes: i128) -> String {
    if bytes < 0 {
        format!("-{}", human(bytes.unsigned_abs() as u64))
    } else {
        human(bytes as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::{
        advice_text, environment_line, noticeable_driver_time, rank, tie_classes, wrap, Row, SWEEP,
    };
    use hbmalloc_replay::MIN_CAPACITY_RESOLUTION_BYTES;

    /// A row whose memory figures are `min` and `reserved` GiB.
    fn row(settings: &str, fits: usize, min: Option<u64>, reserved: u64, driver: f64) -> Row {
        Row {
            settings: settings.into(),
            fits,
            min_capacity_bytes: min.map(|gib| gib << 30),
            peak_reserved_bytes: reserved << 30,
            driver_seconds: driver,
            calls: 0,
            slow_driver: false,
        }
    }

    /// The rows' settings, in their order.
    fn order(rows: &[Row]) -> Vec<&str> {
        rows.iter().map(|r| r.settings.as_str()).collect()
    }

    #[test]
    fn ranking_puts_fitting_first_then_the_smallest_device_then_reserved_then_time() {
        let mut rows = vec![
            row("a", 1, Some(100), 100, 1.0),
            row("b", 2, Some(300), 300, 1.0),
            row("c", 2, Some(200), 250, 1.0),
            row("d", 2, Some(200), 240, 2.0),
            row("e", 2, Some(200), 240, 1.0),
            row("f", 2, None, 10, 0.0),
        ];
        rank(&mut rows, false, 2);
        assert_eq!(order(&rows), ["e", "d", "c", "b", "f", "a"]);
        // Given a capacity, the smallest device no longer matters where
        // every device fits it.
        rank(&mut rows, true, 2);
        assert_eq!(order(&rows), ["f", "e", "d", "c", "b", "a"]);
        // Where none fits it every device, a replay's peak reserved is the
        // part it ran before running out: the smallest device ranks.
        let mut rows = vec![
            row("stopped early", 0, Some(300), 100, 1.0),
            row("needs least", 0, Some(200), 150, 1.0),
            row("between", 0, Some(250), 120, 1.0),
        ];
        rank(&mut rows, true, 1);
        assert_eq!(order(&rows), ["needs least", "between", "stopped early"]);
    }

    /// Memory a tenth of a percent apart, or one step of the search per
    /// device, is a tie the driver time breaks; classes start at their
    /// least, so close values do not chain into one.
    #[test]
    fn memory_within_a_tenth_of_a_percent_is_a_tie() {
        let mut rows = vec![
            row("least memory, slow", 1, Some(100), 100, 3.0),
            row("a step more, fast", 1, Some(100), 100, 1.0),
            row("0.2% more, fastest", 1, Some(100), 100, 0.5),
        ];
        let step = MIN_CAPACITY_RESOLUTION_BYTES;
        rows[1].min_capacity_bytes = Some((100 << 30) + step);
        rows[1].peak_reserved_bytes += step;
        rows[2].min_capacity_bytes = Some((100 << 30) + (100 << 30) / 500);
        rank(&mut rows, false, 1);
        assert_eq!(
            order(&rows),
            [
                "a step more, fast",
                "least memory, slow",
                "0.2% more, fastest"
            ]
        );
        // On a small heap one step is more than 0.1%, and still a tie.
        let tie = tie_classes(
            [1 << 30, (1 << 30) + step, (1 << 30) + 2 * step].into_iter(),
            step,
        );
        assert_eq!(tie, [1 << 30, 1 << 30, (1 << 30) + 2 * step]);
        assert_eq!(tie_classes([u64::MAX, 5].into_iter(), step), [u64::MAX, 5]);
    }

    #[test]
    fn noticeable_driver_calls_rank_after_the_rest_that_fit_as_many() {
        let mut rows = vec![
            row("small but slow", 2, Some(100), 100, 9.0),
            row("large", 2, Some(300), 300, 1.0),
            row("fits fewer", 1, Some(50), 50, 1.0),
        ];
        rows[0].slow_driver = true;
        rank(&mut rows, false, 2);
        assert_eq!(order(&rows), ["large", "small but slow", "fits fewer"]);
    }

    #[test]
    fn driver_time_is_noticed_over_twice_expandables_and_one_percent_of_a_gpu_run() {
        // A CPU's recording: the factor alone decides.
        assert!(!noticeable_driver_time(2.0, 1.0, None));
        assert!(noticeable_driver_time(2.01, 1.0, None));
        // A GPU's: both must hold.
        assert!(!noticeable_driver_time(5.0, 1.0, Some(0.01)));
        assert!(noticeable_driver_time(5.0, 1.0, Some(0.0101)));
        assert!(!noticeable_driver_time(1.5, 1.0, Some(0.5)));
        // Expandable segments made no call: any driver time is over twice it.
        assert!(noticeable_driver_time(1e-6, 0.0, None));
    }

    #[test]
    fn the_line_to_use_names_the_right_variable() {
        assert_eq!(
            environment_line("policy:pytorch,expandable_segments:True"),
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
        );
        assert!(environment_line("policy:pytorch").contains("set nothing"));
        assert_eq!(
            environment_line("policy:hbm,max_waste_percent:5"),
            "HBMALLOC_CONF=policy:hbm,max_waste_percent:5"
        );
    }

    #[test]
    fn every_swept_setting_parses_and_reads_back_the_same() {
        for settings in SWEEP {
            let policy = hbmalloc::PolicyConfig::from_settings(settings).unwrap();
            let back = hbmalloc::PolicyConfig::from_settings(&policy.to_settings()).unwrap();
            assert_eq!(policy, back, "{settings}");
        }
    }

    #[test]
    fn the_saving_is_against_pytorch_s_defaults_and_none_against_nothing() {
        let best = row("policy:hbm", 1, Some(3), 3, 0.01);
        let baseline = row("policy:pytorch", 1, Some(4), 5, 0.01);
        let text = advice_text(&[best.clone(), baseline.clone()], &baseline, 1, false);
        assert!(
            text.contains("it saves 1.00 GiB (25.0%) of device")
                && text.contains("and 2.00 GiB (40.0%) of peak reserved"),
            "{text}"
        );
        // A setting that holds more, or as much: a negative saving, or none.
        let worse = row("policy:hbm", 1, Some(5), 5, 0.01);
        let text = advice_text(&[worse.clone(), baseline.clone()], &baseline, 1, false);
        assert!(
            text.contains("it saves -1.00 GiB (-25.0%) of device"),
            "{text}"
        );
        let text = advice_text(std::slice::from_ref(&baseline), &baseline, 1, false);
        assert!(text.contains("it saves 0 B (0.0%) of device"), "{text}");
        // A baseline that held nothing: no share of it to state.
        let empty = row("policy:pytorch", 1, Some(0), 0, 0.0);
        let text = advice_text(&[best, empty.clone()], &empty, 1, false);
        assert!(
            text.contains("it saves - of device") && text.contains("and - of peak reserved"),
            "{text}"
        );
    }

    #[test]
    fn long_settings_wrap_at_commas() {
        assert_eq!(wrap("a:1,b:2,c:3", 7), ["a:1,b:2,", "c:3"]);
        assert_eq!(wrap("a:1", 1), ["a:1"]);
        // The comma counts: two 3-character keys need 7.
        assert_eq!(wrap("a:1,b:2", 6), ["a:1,", "b:2"]);
    }
}

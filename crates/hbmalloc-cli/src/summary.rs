//! `hbmalloc summary`: PyTorch's `torch.cuda.memory_summary()` table for any
//! trace, from a replay under policy `pytorch` with the trace's recorded
//! configuration (and, for snapshots, its recorded segment addresses), so the
//! numbers are those PyTorch's allocator would have printed at the end of the
//! recorded window.

use std::path::PathBuf;

use clap::Args;
use hbmalloc::PolicyConfig;
use hbmalloc_replay::{Outcome, PreparedTrace, ReplayOptions};
use hbmalloc_trace::DeviceTrace;

/// Arguments of `hbmalloc summary`.
#[derive(Args)]
pub struct SummaryArgs {
    /// Trace files: PyTorch snapshots (.pickle), torch.profiler traces, RMM logs.
    #[arg(required = true)]
    traces: Vec<PathBuf>,
    /// Leave out the "from large pool" / "from small pool" rows, as
    /// `memory_summary(abbreviated=True)` does.
    #[arg(long)]
    abbreviated: bool,
}

/// Prints one summary per trace and device.
pub fn run(args: SummaryArgs) -> Result<(), String> {
    for trace in crate::load_all(&args.traces)? {
        for device in &trace.devices {
            let text = summary(device, args.abbreviated).map_err(|e| {
                format!(
                    "{}: {e}",
                    crate::table::on_device(&trace.source, device.device)
                )
            })?;
            outln!("{}:", crate::table::on_device(&trace.source, device.device));
            out!("{text}");
        }
    }
    Ok(())
}

/// The summary of one device: a line saying where the numbers come from,
/// then PyTorch's table.
pub fn summary(device: &DeviceTrace, abbreviated: bool) -> Result<String, String> {
    let config = device.recorded_config.clone().unwrap_or_default();
    let policy = PolicyConfig::parse("pytorch", &config)
        .map_err(|e| format!("recorded configuration '{config}': {e}"))?;
    let mut options = ReplayOptions::new(policy.clone());
    // Recorded OOMs and addresses make the replay take PyTorch's own
    // decisions (the same as `hbmalloc fidelity`), so the counters match.
    options.emulate_recorded_ooms = true;
    options.use_recorded_addresses = true;
    let run = PreparedTrace::new(device)
        .and_then(|p| p.run(&options))
        .map_err(|e| e.to_string())?;
    let ended = match &run.outcome {
        Outcome::Completed => format!("its end ({} ops)", device.ops.len()),
        Outcome::OutOfMemory { op_index, .. } => {
            format!("op {op_index}, where the replay ran out of memory")
        }
    };
    let recorded_peak = device
        .recorded
        .as_ref()
        .and_then(|r| r.peak_reserved_bytes)
        .map_or(String::new(), |peak| {
            format!(
                "; recorded peak reserved {}, replayed {}",
                crate::human(peak),
                crate::human(run.peak_reserved_bytes)
            )
        });
    let source = match device.recorded_config.as_deref() {
        Some("") => "the trace's recorded configuration: PyTorch's defaults",
        Some(_) => "the trace's recorded configuration",
        None => "PyTorch's defaults: the trace records no configuration",
    };
    Ok(format!(
        "replayed under {} ({source}) from the window start to {ended}; peaks and totals count \
         from the window start{recorded_peak}\n{}",
        policy.to_settings(),
        hbmalloc::memory_summary(&run.final_stats, device.device, abbreviated)
    ))
}

#[cfg(test)]
mod tests {
    use hbmalloc_trace::{DeviceTrace, Op};

    use super::summary;

    #[test]
    fn the_table_counts_what_the_trace_did() {
        let device = DeviceTrace {
            ops: vec![
                Op::Alloc {
                    id: 1,
                    size: 3 << 20,
                    stream: 0,
                },
                Op::Alloc {
                    id: 2,
                    size: 1000,
                    stream: 0,
                },
                Op::Free { id: 1 },
            ],
            ..DeviceTrace::default()
        };
        let text = summary(&device, false).unwrap();
        assert!(text.contains("PyTorch's defaults: the trace records no configuration"));
        assert!(text.contains("to its end (3 ops)"), "{text}");
        let row = |title: &str| {
            text.lines()
                .find(|l| l.starts_with(&format!("| {title}")))
                .unwrap_or_else(|| panic!("no row {title}:\n{text}"))
                .to_string()
        };
        // One allocation live at the end, two at the peak, two made, one freed.
        let allocations: Vec<String> = row("Allocations ")
            .split('|')
            .map(|c| c.trim().to_string())
            .collect();
        assert_eq!(allocations[2..6], ["1", "2", "2", "1"], "{text}");
        // A large block's segment (3 MiB rounded to 20 MiB) and a small one (2 MiB).
        assert!(row("GPU reserved memory").contains("22528 KiB"), "{text}");
    }
}

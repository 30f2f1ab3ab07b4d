//! `hbmalloc bench`: allocator CPU time per operation, side by side.
//!
//! Driver calls cost nothing here (zero latency model), so the figure is the
//! engine's own work per malloc or free in the replay loop. Each configuration
//! is replayed `repeat` times, interleaved, and the median is reported.

use hbmalloc::{LatencyModel, PolicyConfig};
use hbmalloc_replay::{PreparedTrace, ReplayOptions};
use hbmalloc_trace::Trace;

use crate::table::{label, trace_name};

pub fn run(
    traces: &[Trace],
    runs: &[PolicyConfig],
    repeat: usize,
    json: bool,
) -> Result<(), String> {
    if !json {
        print!("{:<35} {:>4}", "trace", "dev");
        for policy in runs {
            print!(" {:>24}", format!("{} ns/op", label(&policy.to_settings())));
        }
        if runs.len() > 1 {
            print!(" {:>12}", "ratio");
        }
        println!();
    }
    for trace in traces {
        for device in &trace.devices {
            let prepared = PreparedTrace::new(device)
                .map_err(|e| format!("{} device {}: {e}", trace.source, device.device))?;
            let mut samples: Vec<Vec<f64>> = vec![Vec::new(); runs.len()];
            for _ in 0..repeat {
                for (i, policy) in runs.iter().enumerate() {
                    let mut options = ReplayOptions::new(policy.clone());
                    options.latency = LatencyModel::zero();
                    let result = prepared
                        .run(&options)
                        .map_err(|e| format!("{} device {}: {e}", trace.source, device.device))?;
                    let ops = (result.mallocs + result.frees).max(1);
                    samples[i].push(result.loop_ns as f64 / ops as f64);
                }
            }
            let medians: Vec<f64> = samples.iter_mut().map(|s| median(s)).collect();
            if json {
                for (policy, ns) in runs.iter().zip(&medians) {
                    println!(
                        "{{\"trace\":{:?},\"device\":{},\"settings\":{:?},\"ns_per_op\":{:.1},\"repeat\":{}}}",
                        trace.source,
                        device.device,
                        policy.to_settings(),
                        ns,
                        repeat
                    );
                }
            } else {
                print!("{:<35} {:>4}", trace_name(&trace.source), device.device);
                for ns in &medians {
                    print!(" {:>24.1}", ns);
                }
                if medians.len() > 1 {
                    print!(" {:>12.2}", medians[medians.len() - 1] / medians[0]);
                }
                println!();
            }
        }
    }
    if !json && runs.len() > 1 {
        println!(
            "\nratio: last configuration's ns/op divided by the first's, measured in the same run."
        );
    }
    Ok(())
}

fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(|a, b| a.total_cmp(b));
    samples[samples.len() / 2]
}

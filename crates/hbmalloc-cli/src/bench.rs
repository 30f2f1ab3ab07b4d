//! `hbmalloc bench`: allocator CPU time per operation, side by side.
//!
//! Driver calls take no simulated time here (zero latency model), so the
//! figure is the engine's own work per malloc or free in the replay loop,
//! plus the simulated driver's bookkeeping of each call it makes: a policy
//! that makes more calls pays more of it. Each configuration is replayed
//! `repeat` times, interleaved, and the median is reported. `--hits` adds a
//! replay each time that times every malloc and free on its own and keeps
//! the cache hits apart: what a hit costs, whatever the misses cost. After
//! the first repeat only the hits it found are timed, through a function of
//! their own that `scripts/bench-instructions --hits` counts.

use std::sync::{Arc, Mutex};

use hbmalloc::simtest::SplitMix64;
use hbmalloc::{
    Allocator, AllocatorConfig, LatencyModel, PolicyConfig, SharedAllocator, SimConfig, SimDevice,
    StreamId, ThreadSafeAllocator,
};
use hbmalloc_replay::{PreparedTrace, ReplayOptions};
use hbmalloc_trace::Trace;

use crate::table::{device_label, fit, label, trace_name, wrap};

pub fn run(
    traces: &[Trace],
    runs: &[PolicyConfig],
    repeat: usize,
    json: bool,
    hits: bool,
) -> Result<(), String> {
    // Each configuration's column is as wide as its header.
    let unit = if hits { "hit ns/op" } else { "ns/op" };
    let headers: Vec<String> = runs
        .iter()
        .map(|p| format!("{} {unit}", label(&p.to_settings())))
        .collect();
    let widths: Vec<usize> = headers.iter().map(|h| h.chars().count().max(9)).collect();
    if !json {
        out!("{:<30} {:>4}", "trace", "dev");
        for (header, width) in headers.iter().zip(&widths) {
            out!(" {header:>width$}");
        }
        if runs.len() > 1 {
            out!(" {:>12}", "ratio");
        }
        outln!();
    }
    for trace in traces {
        for device in &trace.devices {
            let prepared = PreparedTrace::new(device).map_err(|e| {
                format!(
                    "{}: {e}",
                    crate::table::on_device(&trace.source, device.device)
                )
            })?;
            let mut samples: Vec<Samples> = vec![Samples::default(); runs.len()];
            for _ in 0..repeat {
                for (i, policy) in runs.iter().enumerate() {
                    let replay = |time_cache_hits: bool, known: &Option<Arc<[bool]>>| {
                        let mut options = ReplayOptions::new(policy.clone());
                        options.latency = LatencyModel::zero();
                        options.time_cache_hits = time_cache_hits;
                        options.known_cache_hits = known.clone();
                        prepared.run(&options).map_err(|e| {
                            format!(
                                "{}: {e}",
                                crate::table::on_device(&trace.source, device.device)
                            )
                        })
                    };
                    let result = replay(false, &None)?;
                    let ops = result.mallocs + result.frees;
                    samples[i].ns.push(per_op(result.loop_ns, ops));
                    // Timing each op slows the loop: a replay of its own.
                    if hits {
                        let timed = replay(true, &samples[i].known_hits)?;
                        samples[i].hit_ns.push(per_op(timed.hit_ns, timed.hit_ops));
                        samples[i].hit_ops = timed.hit_ops;
                        samples[i].ops = ops;
                        if samples[i].known_hits.is_none() {
                            samples[i].known_hits = Some(timed.cache_hit_ops.into());
                        }
                    }
                }
            }
            if json {
                for (policy, sample) in runs.iter().zip(&mut samples) {
                    let hit = if hits {
                        format!(
                            ",\"hit_ns_per_op\":{:.1},\"hit_share\":{:.4},\"hit_ops\":{}",
                            median(&mut sample.hit_ns),
                            per_op(sample.hit_ops, sample.ops),
                            sample.hit_ops
                        )
                    } else {
                        String::new()
                    };
                    outln!(
                        "{{\"trace\":{:?},\"device\":{},\"settings\":{:?},\"ns_per_op\":{:.1}{hit},\"repeat\":{}}}",
                        trace.source,
                        device.device,
                        policy.to_settings(),
                        median(&mut sample.ns),
                        repeat
                    );
                }
            } else {
                out!(
                    "{:<30} {:>4}",
                    fit(&trace_name(&trace.source), 30),
                    device_label(device.device)
                );
                let shown: Vec<f64> = samples
                    .iter_mut()
                    .map(|s| median(if hits { &mut s.hit_ns } else { &mut s.ns }))
                    .collect();
                for (ns, width) in shown.iter().zip(&widths) {
                    out!(" {ns:>width$.1}");
                }
                if shown.len() > 1 {
                    out!(" {:>12.2}", shown[shown.len() - 1] / shown[0]);
                }
                outln!();
            }
        }
    }
    if !json && runs.len() > 1 {
        let cpu = if traces
            .iter()
            .any(|t| t.devices.iter().any(|d| d.device == -1))
        {
            " cpu: a torch.profiler trace's CPU memory."
        } else {
            ""
        };
        let hit = if hits {
            " hit ns/op: the mallocs and frees that allocated, mapped or freed no device memory \
             (each policy's own), each timed on its own (two clock reads an op included)."
        } else {
            ""
        };
        out!(
            "\n{}",
            wrap(
                &format!(
                    "ratio: last configuration's figure divided by the first's, measured in the \
                     same run.{hit}{cpu}"
                ),
                100
            )
        );
    }
    Ok(())
}

/// One configuration's measurements over the repeats.
#[derive(Clone, Default)]
struct Samples {
    /// Nanoseconds per malloc or free, the whole loop timed.
    ns: Vec<f64>,
    /// Nanoseconds per cache hit, each timed on its own (with `--hits`).
    hit_ns: Vec<f64>,
    /// Mallocs and frees replayed, and how many were cache hits (the same
    /// in every repeat: the engine is deterministic).
    ops: u64,
    hit_ops: u64,
    /// Which ops they were, from the first repeat: the later ones time
    /// only these.
    known_hits: Option<Arc<[bool]>>,
}

/// `total` over `ops` (0 with no ops).
fn per_op(total: u64, ops: u64) -> f64 {
    total as f64 / ops.max(1) as f64
}

fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(|a, b| a.total_cmp(b));
    samples.get(samples.len() / 2).copied().unwrap_or(0.0)
}

/// One measured workload for the thread-scaling table.
enum Workload<'a> {
    /// Thread `t` replays trace `t % n` on its own streams.
    Traces(&'a [PreparedTrace]),
    /// Each thread allocates and frees small blocks, keeping a window live.
    SmallBlockChurn { ops_per_thread: u64 },
}

fn run_workload(
    workload: &Workload<'_>,
    allocator: &dyn ThreadSafeAllocator,
    threads: usize,
) -> Result<(u64, f64), String> {
    let started = std::time::Instant::now();
    let results: Vec<Result<u64, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                scope.spawn(move || -> Result<u64, String> {
                    let stream_offset = (t as u64 + 1) << 40;
                    match workload {
                        Workload::Traces(traces) => traces[t % traces.len()]
                            .run_shared(allocator, stream_offset)
                            .map_err(|e| e.to_string()),
                        Workload::SmallBlockChurn { ops_per_thread } => small_block_churn(
                            allocator,
                            StreamId(stream_offset),
                            *ops_per_thread,
                            t as u64,
                        ),
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("benchmark thread panicked".into()))
            })
            .collect()
    });
    let seconds = started.elapsed().as_secs_f64();
    let mut ops = 0;
    for r in results {
        ops += r?;
    }
    Ok((ops, seconds))
}

/// Mallocs and frees of 512 B to 64 KiB, keeping 512 blocks live: the
/// pattern of many small tensors (optimizer states, activations of small layers).
fn small_block_churn(
    allocator: &dyn ThreadSafeAllocator,
    stream: StreamId,
    ops: u64,
    seed: u64,
) -> Result<u64, String> {
    let mut rng = SplitMix64::new(seed);
    let mut live: Vec<u64> = Vec::with_capacity(512);
    let mut done = 0;
    while done < ops {
        let r = rng.next_u64();
        if live.len() < 512 {
            let size = 512 + (r >> 16) % (64 << 10);
            live.push(allocator.malloc(size, stream).map_err(|e| e.to_string())?);
        } else {
            let ptr = live.swap_remove((r % 512) as usize);
            allocator.free(ptr).map_err(|e| e.to_string())?;
        }
        done += 1;
    }
    for ptr in live {
        allocator.free(ptr).map_err(|e| e.to_string())?;
    }
    Ok(done)
}

/// Every device of `traces`, prepared for replay.
fn prepare_devices(traces: &[Trace]) -> Result<Vec<PreparedTrace>, String> {
    let mut prepared = Vec::new();
    for trace in traces {
        for device in &trace.devices {
            prepared.push(PreparedTrace::new(device).map_err(|e| {
                format!(
                    "{}: {e}",
                    crate::table::on_device(&trace.source, device.device)
                )
            })?);
        }
    }
    Ok(prepared)
}

fn zero_latency_device() -> SimDevice {
    SimDevice::with_config(SimConfig {
        capacity_bytes: 1 << 40,
        latency: LatencyModel::zero(),
        ..SimConfig::default()
    })
}

/// `hbmalloc bench-threads`: operations per second for 1..N threads, the
/// sharded allocator against a single mutex around the same engine.
pub fn threads(
    traces: &[Trace],
    policy: &PolicyConfig,
    thread_counts: &[usize],
    shards: usize,
    repeat: usize,
) -> Result<(), String> {
    let prepared = prepare_devices(traces)?;
    let config = AllocatorConfig {
        policy: policy.clone(),
        history_entries: 0,
    };
    let workloads = [
        ("traces", Workload::Traces(&prepared)),
        (
            "small-block churn",
            Workload::SmallBlockChurn {
                ops_per_thread: 200_000,
            },
        ),
    ];
    outln!(
        "{:<18} {:>7} {:>16} {:>16} {:>8}",
        "workload",
        "threads",
        "1 mutex Mops/s",
        "sharded Mops/s",
        "ratio"
    );
    for (name, workload) in &workloads {
        for &threads in thread_counts {
            let mut baseline = Vec::new();
            let mut sharded = Vec::new();
            for _ in 0..repeat {
                let single = Mutex::new(
                    Allocator::new(zero_latency_device(), config.clone())
                        .map_err(|e| e.to_string())?,
                );
                let (ops, secs) = run_workload(workload, &single, threads)?;
                baseline.push(ops as f64 / secs / 1e6);
                let shared = SharedAllocator::new(zero_latency_device(), config.clone(), shards)
                    .map_err(|e| e.to_string())?;
                let (ops, secs) = run_workload(workload, &shared, threads)?;
                sharded.push(ops as f64 / secs / 1e6);
            }
            let (b, s) = (median(&mut baseline), median(&mut sharded));
            outln!("{name:<18} {threads:>7} {b:>16.2} {s:>16.2} {:>8.2}", s / b);
        }
    }
    out!(
        "\n{}",
        wrap(
            &format!(
                "Mops/s: million mallocs+frees per second, all threads together (median of \
                 {repeat}); each thread uses its own streams. This machine has {} cores: beyond \
                 that, threads share cores.",
                std::thread::available_parallelism().map_or(1, |n| n.get())
            ),
            100
        )
    );
    Ok(())
}

/// `hbmalloc bench-log`: ns per malloc or free on the sharded allocator (the
/// C ABI's engine, its default shard count) with no history, and keeping
/// `entries` history entries per engine as `log:PATH` does; one thread,
/// runs interleaved, medians of `repeat`.
pub fn log(
    traces: &[Trace],
    policy: &PolicyConfig,
    entries: usize,
    repeat: usize,
) -> Result<(), String> {
    let prepared = prepare_devices(traces)?;
    let workloads = [
        ("traces", Workload::Traces(&prepared)),
        (
            "small-block churn",
            Workload::SmallBlockChurn {
                ops_per_thread: 1_000_000,
            },
        ),
    ];
    outln!(
        "{:<18} {:>12} {:>12} {:>8}",
        "workload",
        "off ns/op",
        "log ns/op",
        "ratio"
    );
    for (name, workload) in &workloads {
        let mut samples = [Vec::new(), Vec::new()];
        for r in 0..repeat {
            // Alternate which runs first, so neither always finds the caches cold.
            let mut order = [(0, 0), (1, entries)];
            if r % 2 == 1 {
                order.reverse();
            }
            for (i, history_entries) in order {
                let config = AllocatorConfig {
                    policy: policy.clone(),
                    history_entries,
                };
                let shared = SharedAllocator::new(zero_latency_device(), config, 8)
                    .map_err(|e| e.to_string())?;
                let (ops, secs) = run_workload(workload, &shared, 1)?;
                samples[i].push(secs * 1e9 / ops.max(1) as f64);
            }
        }
        let [off, on] = samples.map(|mut s| median(&mut s));
        outln!("{name:<18} {off:>12.1} {on:>12.1} {:>8.2}", on / off);
    }
    out!(
        "\n{}",
        wrap(
            &format!(
                "ns/op: wall time per malloc or free, one thread, the sharded allocator (8 \
                 shards) on a zero-latency simulated device, median of {repeat}, the two alternating \
                 which runs first; log: {entries} \
                 history entries kept per engine. ratio: log / off, measured in the same run."
            ),
            100
        )
    );
    Ok(())
}

/// `hbmalloc bench-scaling`: cost per operation as the number of live blocks
/// grows. For each count N, N blocks are allocated, then `churn` operations
/// free a random live block and allocate a new one, keeping N live; the
/// churn is timed and its driver calls counted.
pub fn scaling(runs: &[PolicyConfig], counts: &[u64], churn: u64) -> Result<(), String> {
    // Each configuration's column is as wide as its header.
    let headers: Vec<String> = runs
        .iter()
        .map(|p| format!("{} ns/op", label(&p.to_settings())))
        .collect();
    out!("{:>9}", "live");
    for header in &headers {
        out!(" {header:>9} {:>8}", "calls");
    }
    outln!();
    for &count in counts {
        out!("{count:>9}");
        for (policy, header) in runs.iter().zip(&headers) {
            let (ns, calls) = scaling_point(policy, count, churn)?;
            let width = header.chars().count().max(9);
            out!(" {ns:>width$.1} {calls:>8}");
        }
        outln!();
    }
    out!(
        "\n{}",
        wrap(
            &format!(
                "ns/op: mean time of a malloc or free during {churn} churn operations with N \
                 blocks live (sizes 512 B to 4 MiB, mostly small); calls: driver calls that \
                 allocate, free, map or unmap memory during the churn. Zero-latency simulated \
                 device."
            ),
            100
        )
    );
    Ok(())
}

fn scaling_point(policy: &PolicyConfig, count: u64, churn: u64) -> Result<(f64, u64), String> {
    let config = AllocatorConfig {
        policy: policy.clone(),
        history_entries: 0,
    };
    let mut allocator = Allocator::new(zero_latency_device(), config).map_err(|e| e.to_string())?;
    let mut rng = SplitMix64::new(count);
    // Mostly small tensors, some medium, a few large: a model's mix.
    let size = move |r: u64| match r % 100 {
        0 => (1 << 20) + (r >> 8) % (3 << 20),
        1..=9 => 65536 + (r >> 8) % (1 << 20),
        _ => 512 + (r >> 8) % 65536,
    };
    let stream = StreamId(0);
    let mut live = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let r = rng.next_u64();
        live.push(
            allocator
                .malloc(size(r), stream)
                .map_err(|e| e.to_string())?,
        );
    }
    let calls_before = allocator.device().call_counts();
    let started = std::time::Instant::now();
    for _ in 0..churn {
        let r = rng.next_u64();
        let victim = live.swap_remove((r % live.len() as u64) as usize);
        allocator.free(victim).map_err(|e| e.to_string())?;
        live.push(
            allocator
                .malloc(size(r >> 7), stream)
                .map_err(|e| e.to_string())?,
        );
    }
    let ns = started.elapsed().as_nanos() as f64 / (2 * churn) as f64;
    let calls = allocator
        .device()
        .call_counts()
        .since(&calls_before)
        .memory_calls();
    Ok((ns, calls))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_per_op_and_their_median() {
        assert_eq!(per_op(1_000, 4), 250.0);
        assert_eq!(per_op(1_000, 0), 1_000.0);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut []), 0.0);
    }
}

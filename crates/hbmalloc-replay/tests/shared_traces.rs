//! Replay of every real trace in `../shared/traces`: fidelity of policy
//! `pytorch` against what PyTorch recorded, and `peak_live_bytes` against an
//! independent computation.

use std::path::{Path, PathBuf};

use hbmalloc::{CallKind, PolicyConfig};
use hbmalloc_replay::{
    evaluate, fidelity, plan_greedy_by_size, plan_last_step, EvalOptions, Outcome, PreparedTrace,
    ReplayOptions,
};
use hbmalloc_trace::{DeviceTrace, InitialBlockState, Op, Trace};

#[path = "../../hbmalloc-trace/tests/common/shared.rs"]
mod common_shared;

/// `shared/traces` beside the repository (see `common/shared.rs`).
fn shared_traces() -> Option<PathBuf> {
    common_shared::shared_traces(env!("CARGO_MANIFEST_DIR"))
}

fn load_dir(dir: &Path) -> Vec<Trace> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    paths.sort();
    paths
        .iter()
        .map(|p| hbmalloc_trace::load(p).unwrap_or_else(|e| panic!("{e}")))
        .collect()
}

/// Every snapshot recorded by CUDA PyTorch replays to exactly the recorded
/// sequence of segment events.
#[test]
fn pytorch_policy_reproduces_every_cuda_snapshot_exactly() {
    let Some(shared) = shared_traces() else {
        return;
    };
    let mut checked = 0;
    for trace in load_dir(&shared.join("pytorch-snapshots")) {
        for device in &trace.devices {
            let report = fidelity(device).unwrap_or_else(|e| panic!("{}: {e}", trace.source));
            eprintln!(
                "{} dev {}: recorded {} replayed {} prefix {}{}",
                trace.source,
                device.device,
                report.recorded,
                report.replayed,
                report.matching_prefix,
                if report.foreign_allocator {
                    " (torch_npu)"
                } else {
                    ""
                }
            );
            if report.foreign_allocator {
                continue;
            }
            assert!(
                report.exact(),
                "{} device {}: diverges at event {}: {:?}",
                trace.source,
                device.device,
                report.matching_prefix,
                report.first_divergence
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 14,
        "expected at least 14 CUDA snapshot devices, checked {checked}"
    );
}

/// `compare`'s `pytorch` column is what PyTorch did: every CUDA snapshot
/// (the GPU run in `gpu-h100/` too), evaluated as `compare` does under
/// PyTorch's policy with the configuration it was recorded with, peaks at
/// exactly the reserved memory PyTorch recorded. The simulated driver hands
/// out the recorded addresses, so best-fit ties break as they did.
#[test]
fn pytorch_policy_peaks_at_the_recorded_reserved_memory() {
    let Some(shared) = shared_traces() else {
        return;
    };
    let mut checked = 0;
    for dir in ["pytorch-snapshots", "gpu-h100"] {
        for trace in load_dir(&shared.join(dir)) {
            for device in trace.devices.iter().filter(|d| !d.foreign_allocator) {
                let config = device.recorded_config.as_deref().unwrap_or("");
                let policy = PolicyConfig::parse("pytorch", config).unwrap();
                let m = evaluate(&trace.source, device, &EvalOptions::new(policy))
                    .unwrap_or_else(|e| panic!("{}: {e}", trace.source));
                let recorded = device.recorded.as_ref().and_then(|r| r.peak_reserved_bytes);
                assert_eq!(
                    Some(m.peak_reserved_bytes),
                    recorded,
                    "{} device {}",
                    trace.source,
                    device.device
                );
                checked += 1;
            }
        }
    }
    assert!(
        checked >= 15,
        "expected at least 15 CUDA snapshot devices, checked {checked}"
    );
}

/// Peak live bytes computed another way: sort all lifetime edges and sweep.
fn independent_peak_live(trace: &DeviceTrace) -> u64 {
    let mut edges: Vec<(usize, i128)> = Vec::new();
    let mut born = std::collections::HashMap::new();
    for seg in &trace.initial_segments {
        for b in &seg.blocks {
            if let InitialBlockState::Allocated(id) = b.state {
                born.insert(id, b.requested_size);
                edges.push((0, i128::from(b.requested_size)));
            }
        }
    }
    for (i, op) in trace.ops.iter().enumerate() {
        match *op {
            Op::Alloc { id, size, .. } => {
                born.insert(id, size);
                edges.push((i + 1, i128::from(size)));
            }
            Op::Free { id } => edges.push((i + 1, -i128::from(born[&id]))),
            _ => {}
        }
    }
    edges.sort_by_key(|&(t, delta)| (t, delta));
    let (mut live, mut peak) = (0i128, 0i128);
    let mut i = 0;
    while i < edges.len() {
        let t = edges[i].0;
        while i < edges.len() && edges[i].0 == t {
            live += edges[i].1;
            i += 1;
        }
        peak = peak.max(live);
    }
    peak as u64
}

/// `hbmalloc compare` over every shared trace runs to completion, and its
/// `peak_live_bytes` is the independently computed maximum.
#[test]
fn compare_runs_on_every_trace_and_peak_live_is_exact() {
    let Some(shared) = shared_traces() else {
        return;
    };
    let policies = [
        PolicyConfig::from_settings("policy:pytorch").unwrap(),
        PolicyConfig::from_settings("policy:pytorch,expandable_segments:True").unwrap(),
    ];
    let mut rows = 0;
    for sub in ["pytorch-snapshots", "profiler-cpu"] {
        for trace in load_dir(&shared.join(sub)) {
            for device in &trace.devices {
                let expected = independent_peak_live(device);
                for policy in &policies {
                    let options = EvalOptions::new(policy.clone());
                    let m = evaluate(&trace.source, device, &options)
                        .unwrap_or_else(|e| panic!("{}: {e}", trace.source));
                    assert_eq!(
                        m.peak_live_bytes, expected,
                        "{} device {}",
                        trace.source, device.device
                    );
                    assert!(
                        m.out_of_memory.is_none(),
                        "{}: {:?}",
                        trace.source,
                        m.out_of_memory
                    );
                    assert!(m.peak_reserved_bytes >= m.peak_live_bytes);
                    rows += 1;
                }
            }
        }
    }
    assert!(
        rows >= 2 * 21,
        "expected every trace and device, got {rows} rows"
    );
}

/// The offline plan of every shared trace places every block and holds no
/// less than the trace's live peak (the plan's own rounded peak, computed
/// apart from the independent one here), mapping no more than its arena;
/// so does the plan of its last repeating step.
#[test]
fn the_offline_plan_of_every_trace_holds_at_least_its_live_peak() {
    let Some(shared) = shared_traces() else {
        return;
    };
    let (mut rows, mut steps) = (0, 0);
    for sub in ["pytorch-snapshots", "profiler-cpu"] {
        for trace in load_dir(&shared.join(sub)) {
            for device in &trace.devices {
                let live = independent_peak_live(device);
                let plan = plan_greedy_by_size(device);
                let name = format!("{} device {}: {plan:?}", trace.source, device.device);
                assert!(plan.peak_live_rounded_bytes >= live, "{name}");
                assert!(
                    plan.peak_mapped_bytes >= plan.peak_live_rounded_bytes,
                    "{name}"
                );
                assert!(plan.arena_bytes >= plan.peak_live_rounded_bytes, "{name}");
                assert!(
                    plan.peak_mapped_bytes <= plan.arena_bytes.next_multiple_of(2 << 20),
                    "{name}"
                );
                // Live memory in a step is outer plus own blocks, each at
                // most its own peak: the step estimate holds no less.
                if let Some(step) = plan_last_step(device) {
                    assert!(
                        step.held_bytes() >= step.peak_live_bytes,
                        "{name}: {step:?}"
                    );
                    assert!(step.peak_live_bytes <= live, "{name}: {step:?}");
                    steps += 1;
                }
                rows += 1;
            }
        }
    }
    assert!(
        rows >= 21,
        "expected every trace and device, got {rows} rows"
    );
    // Every row but two repeats a step (silmont's full snapshot and
    // select_n ec5be11 do not).
    assert!(steps >= 19, "{steps} steps planned");
}

/// The bisection finds a capacity that works, and one resolution step below it fails.
#[test]
fn min_capacity_is_tight() {
    let Some(shared) = shared_traces() else {
        return;
    };
    let trace = hbmalloc_trace::load(&shared.join("profiler-cpu/resnet50_train.json.gz")).unwrap();
    let device = &trace.devices[0];
    let policy = PolicyConfig::from_settings("policy:pytorch").unwrap();
    let m = evaluate(
        &trace.source,
        device,
        &EvalOptions {
            find_min_capacity: true,
            ..EvalOptions::new(policy.clone())
        },
    )
    .unwrap();
    let min = m.min_capacity_bytes.expect("a capacity that fits");
    assert!(min >= m.peak_live_bytes && min <= m.peak_reserved_bytes.next_multiple_of(2 << 20));
    let run = |capacity| {
        evaluate(
            &trace.source,
            device,
            &EvalOptions {
                capacity_bytes: Some(capacity),
                ..EvalOptions::new(policy.clone())
            },
        )
        .unwrap()
        .out_of_memory
    };
    assert!(run(min).is_none(), "fits at its min capacity");
    assert!(
        run(min - m.min_capacity_resolution_bytes).is_some(),
        "one step below runs out"
    );
}

/// The snapshot whose device 1 ran out of memory: the replay reproduces the
/// failure and explains it (real demand: 78 GiB live plus a 5.3 GB tensor on a
/// device with 91 MiB free), naming the tensor's size, not a segment's.
#[test]
fn the_recorded_oom_is_reproduced_and_explained() {
    let Some(shared) = shared_traces() else {
        return;
    };
    let trace = hbmalloc_trace::load(
        &shared.join("pytorch-snapshots/Constructor-Sun__memory_snapshot.pickle"),
    )
    .unwrap();
    let device = trace.devices.iter().find(|d| d.device == 1).unwrap();
    let options = EvalOptions {
        reproduce_recorded_ooms: true,
        ..EvalOptions::new(
            PolicyConfig::from_settings("policy:pytorch,expandable_segments:True").unwrap(),
        )
    };
    let m = evaluate(&trace.source, device, &options).unwrap();
    assert_eq!(m.reproduced_ooms.len(), 1, "one recorded OOM, reproduced");
    let oom = &m.reproduced_ooms[0];
    let report = &oom.report;
    assert_eq!(report.verdict, hbmalloc::OomVerdict::RealDemand);
    // No capacity given: the device's size is not known, and no memory is
    // said to be held outside the allocator.
    assert!(!oom.device_size_known);
    assert_eq!(
        report.device_total_bytes,
        report.reserved_bytes + report.device_free_bytes
    );
    assert!(!report.render().contains("outside"), "{}", report.render());
    assert!(report.requested_bytes > 5_000_000_000 && report.requested_bytes < 5_400_000_000);
    assert!(report.device_free_bytes < 100 << 20);
    let text = report.render();
    assert!(text.contains("real demand"), "{text}");
    assert!(report
        .pytorch_message(1)
        .starts_with("CUDA out of memory. Tried to allocate"));
}

/// The streams a device's trace allocates on (window-start blocks included).
fn streams_used(device: &DeviceTrace) -> u64 {
    let mut streams: Vec<u64> = device.initial_segments.iter().map(|s| s.stream).collect();
    streams.extend(device.ops.iter().filter_map(|op| match op {
        Op::Alloc { stream, .. } => Some(*stream),
        _ => None,
    }));
    streams.sort_unstable();
    streams.dedup();
    streams.len() as u64
}

/// Policy `hbm` replays every shared trace (the 10-stream `select_n` snapshot
/// among them) to completion, with the engine's invariants checked along the
/// way: blocks tile their regions, no physical memory lies under two live
/// blocks' views, reserved memory is what is mapped, alias groups agree
/// with the bitmaps. About 100 checks per trace (each walks the whole state).
/// The snapshot at the peak adds up to the peak. And no stream holds more
/// than one region at the end.
#[test]
fn hbm_replays_every_trace_with_its_invariants_held() {
    let Some(shared) = shared_traces() else {
        return;
    };
    let policy = PolicyConfig::from_settings("policy:hbm").unwrap();
    let mut rows = 0;
    for sub in ["pytorch-snapshots", "profiler-cpu"] {
        for trace in load_dir(&shared.join(sub)) {
            for device in &trace.devices {
                let prepared =
                    PreparedTrace::new(device).unwrap_or_else(|e| panic!("{}: {e}", trace.source));
                let mut options = ReplayOptions::new(policy.clone());
                options.check_invariants_every = (prepared.len() / 100).max(1);
                let run = prepared
                    .run(&options)
                    .unwrap_or_else(|e| panic!("{} device {}: {e}", trace.source, device.device));
                assert!(
                    matches!(run.outcome, Outcome::Completed),
                    "{} device {}: out of memory on an unbounded device",
                    trace.source,
                    device.device
                );
                assert!(run.peak_reserved_bytes >= independent_peak_live(device));
                // Replayed again up to the op where reserved memory first
                // peaked, the snapshot shows all of it, each physical granule
                // once (an alias at one view): what memory_viz is given.
                let mut at_peak = ReplayOptions::new(policy.clone());
                at_peak.snapshot_after_ops = Some(run.ops_at_peak_reserved);
                let snapshot = prepared.run(&at_peak).unwrap().snapshot.unwrap();
                let shown: u64 = snapshot.segments.iter().map(|s| s.total_size).sum();
                assert_eq!(
                    shown, run.peak_reserved_bytes,
                    "{} device {}: snapshot after op {}",
                    trace.source, device.device, run.ops_at_peak_reserved
                );
                // One region per stream is room enough (each spans twice the
                // device): a stream whose best fits are all in use elsewhere
                // places past them, it does not open another region (where
                // every small block pinned a granule of its own).
                let regions_held =
                    run.calls.get(CallKind::AddressReserve) - run.calls.get(CallKind::AddressFree);
                let streams = streams_used(device);
                assert!(
                    regions_held <= streams,
                    "{} device {}: {regions_held} regions held for {streams} streams",
                    trace.source,
                    device.device
                );
                rows += 1;
            }
        }
    }
    assert!(
        rows >= 21,
        "expected every trace and device, got {rows} rows"
    );
}

/// A training loop run longer than it was recorded settles: with each
/// profiler trace's last step run six more times (`--repeat-step 6`), policy
/// `hbm` makes no driver call in the second half of the replay. The traces
/// as recorded end after three steps, before resnet's and vit's layouts have
/// settled (resnet maps idle memory at new places in its third and fourth
/// steps, then never again). t5 has no repeating training step (random
/// batch shapes) and is left out.
#[test]
fn hbm_makes_no_driver_calls_once_a_repeated_training_step_settles() {
    let Some(shared) = shared_traces() else {
        return;
    };
    let policy = PolicyConfig::from_settings("policy:hbm").unwrap();
    for (name, step_ops) in [
        ("gpt2_train.json.gz", 6332),
        ("resnet50_train.json.gz", 3362),
        ("vit_train.json.gz", 6090),
    ] {
        let trace = hbmalloc_trace::load(&shared.join("profiler-cpu").join(name)).unwrap();
        let device = &trace.devices[0];
        let (longer, step) =
            hbmalloc_trace::repeat_last_step(device, 6).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(step.len, step_ops, "{name}: the step found");
        assert_eq!(longer.ops.len(), device.ops.len() + 6 * step.len);
        let run = PreparedTrace::new(&longer)
            .unwrap()
            .run(&ReplayOptions::new(policy.clone()))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(matches!(run.outcome, Outcome::Completed), "{name}");
        assert_eq!(
            run.steady_state_calls.as_ref().map(|c| c.memory_calls()),
            Some(0),
            "{name}: driver calls in the second half of six more steps: {:?}",
            run.steady_state_calls
        );
    }
}

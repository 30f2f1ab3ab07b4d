//! Loads every real trace in `shared/traces` and checks it against MANIFEST.md.
//!
//! The traces are third-party files that must not be committed, so they are
//! looked for beside the repository; without them the test says so and passes
//! (and fails under `CI=true`).

use std::collections::HashSet;
use std::path::PathBuf;

use hbmalloc_trace::{load, DeviceTrace, InitialBlockState, Op};

#[path = "common/shared.rs"]
mod common_shared;

const MIB: f64 = (1u64 << 20) as f64;

/// MANIFEST.md figures for one snapshot device.
struct Expected {
    file: &'static str,
    device: i64,
    events: u64,
    peak_live_mib: f64,
    max_reserved_mib: f64,
    start_reserved_mib: f64,
}

const fn expected(
    file: &'static str,
    device: i64,
    events: u64,
    peak_live_mib: f64,
    max_reserved_mib: f64,
    start_reserved_mib: f64,
) -> Expected {
    Expected {
        file,
        device,
        events,
        peak_live_mib,
        max_reserved_mib,
        start_reserved_mib,
    }
}

/// The snapshot table of shared/traces/MANIFEST.md.
const SNAPSHOTS: &[Expected] = &[
    expected(
        "Constructor-Sun__memory_snapshot.pickle",
        0,
        4352,
        8065.,
        8146.,
        0.,
    ),
    expected(
        "Constructor-Sun__memory_snapshot.pickle",
        1,
        374,
        80169.,
        80302.,
        0.,
    ),
    expected(
        "Constructor-Sun__memory_snapshot.pickle",
        2,
        598,
        20566.,
        20870.,
        0.,
    ),
    expected("EoR_NN_snapshot.pickle", 0, 3892, 103., 128., 24.),
    expected(
        "MemSnapDump__test_test-data_snapshot_1768383987920985470.pkl",
        0,
        6432,
        450.,
        526.,
        0.,
    ),
    expected(
        "MemSnapDump__test_test-data_snapshot_expandable.pkl",
        0,
        5793,
        570.,
        614.,
        108.,
    ),
    expected(
        "MemSnapDump__test_test-data_snapshot_with_empty_cache.pkl",
        0,
        5793,
        570.,
        632.,
        108.,
    ),
    expected(
        "select_n__snapshot_ec5be11.pickle",
        0,
        6306,
        19839.,
        21476.,
        13386.,
    ),
    expected("select_n__snapshot.pickle", 0, 3386, 2297., 2648., 1290.),
    expected(
        "cranberrii__memory_snapshot.pickle",
        0,
        7452,
        5604.,
        6172.,
        1336.,
    ),
    expected(
        "cs336_Wedsonlin__results_medium_128_training_memory_snapshot.pickle",
        0,
        13495,
        6688.,
        6900.,
        6900.,
    ),
    expected(
        "cs336_Wedsonlin__results_medium_1024_inference_memory_snapshot.pickle",
        0,
        2783,
        2744.,
        3056.,
        3056.,
    ),
    expected(
        "cs336_kkaitlyn111__memory_ctx128_fullstep.pickle",
        0,
        12989,
        52264.,
        58280.,
        18756.,
    ),
    expected(
        "cs336_kkaitlyn111__memory_files_memory_ctx128_forward_mixed.pickle",
        0,
        4441,
        22767.,
        23122.,
        13126.,
    ),
    expected(
        "cs336_notHanmin__memory_snapshot.pickle",
        0,
        14289,
        21770.,
        22738.,
        22738.,
    ),
    expected(
        "cs336_silmont2000__mem_snapshot.pickle",
        0,
        62,
        3099.,
        3606.,
        0.,
    ),
    expected(
        "cs336_silmont2000__memory_forward_bf16_128.pickle",
        0,
        2011,
        744.,
        822.,
        822.,
    ),
];

/// The profiler table of shared/traces/MANIFEST.md: (file, events, peak live MiB).
const PROFILES: &[(&str, u64, f64)] = &[
    ("gpt2_train.json.gz", 20182, 2595.),
    ("resnet50_train.json.gz", 10404, 905.),
    ("vit_train.json.gz", 19912, 1918.),
    ("t5_varlen_train.json.gz", 47758, 2332.),
];

/// `shared/traces` above this crate (see `common/shared.rs`).
fn shared_traces() -> Option<PathBuf> {
    common_shared::shared_traces(env!("CARGO_MANIFEST_DIR"))
}

/// What the test measures on one device.
struct Figures {
    /// Alloc and Free ops plus allocations live at the window start.
    events: u64,
    /// Max over the ops of the sum of live requested bytes.
    peak_live_bytes: u64,
}

/// Checks that every Free names a live allocation, and measures the device.
fn measure(file: &str, device: &DeviceTrace) -> Figures {
    let mut live = std::collections::HashMap::new();
    let mut live_bytes = 0u64;
    let mut initial_live = 0u64;
    for segment in &device.initial_segments {
        for block in &segment.blocks {
            if let InitialBlockState::Allocated(id) = block.state {
                assert!(
                    live.insert(id, block.requested_size).is_none(),
                    "{file}: id {id} reused"
                );
                live_bytes += block.requested_size;
                initial_live += 1;
            }
        }
    }
    let mut peak = live_bytes;
    let mut seen = HashSet::new();
    let mut events = initial_live;
    for (index, op) in device.ops.iter().enumerate() {
        match *op {
            Op::Alloc { id, size, .. } => {
                assert!(seen.insert(id), "{file}: op {index} reuses id {id}");
                live.insert(id, size);
                live_bytes += size;
                peak = peak.max(live_bytes);
                events += 1;
            }
            Op::Free { id } => {
                let size = live
                    .remove(&id)
                    .unwrap_or_else(|| panic!("{file}: op {index} frees {id}, not live"));
                live_bytes -= size;
                events += 1;
            }
            _ => {}
        }
    }
    Figures {
        events,
        peak_live_bytes: peak,
    }
}

fn assert_close_mib(file: &str, what: &str, bytes: u64, expected_mib: f64) {
    let mib = bytes as f64 / MIB;
    assert!(
        (mib - expected_mib).abs() <= 1.0,
        "{file}: {what} is {mib:.1} MiB, MANIFEST says {expected_mib}"
    );
}

#[test]
fn snapshots_match_the_manifest() {
    let Some(root) = shared_traces() else {
        return;
    };
    for expected in SNAPSHOTS {
        let path = root.join("pytorch-snapshots").join(expected.file);
        let trace = load(&path).unwrap_or_else(|e| panic!("{e}"));
        let device = trace
            .devices
            .iter()
            .find(|d| d.device == expected.device)
            .unwrap_or_else(|| panic!("{}: no device {}", expected.file, expected.device));
        let figures = measure(expected.file, device);
        let recorded = device
            .recorded
            .as_ref()
            .expect("snapshots record reserved bytes");
        let peak_reserved = recorded.peak_reserved_bytes.expect("peak reserved");
        println!(
            "{} dev{}: events {} (manifest {}), peak live {:.1} MiB (manifest {}), \
             max reserved {:.1} MiB (manifest {}), reserved at start {:.1} MiB (manifest {}), \
             config {:?}, foreign {}, skipped {:?}",
            expected.file,
            expected.device,
            figures.events,
            expected.events,
            figures.peak_live_bytes as f64 / MIB,
            expected.peak_live_mib,
            peak_reserved as f64 / MIB,
            expected.max_reserved_mib,
            recorded.initial_reserved_bytes as f64 / MIB,
            expected.start_reserved_mib,
            device.recorded_config,
            device.foreign_allocator,
            device.skipped,
        );
        assert_close_mib(
            expected.file,
            "peak live",
            figures.peak_live_bytes,
            expected.peak_live_mib,
        );
        assert_close_mib(
            expected.file,
            "max reserved",
            peak_reserved,
            expected.max_reserved_mib,
        );
        assert_close_mib(
            expected.file,
            "reserved at window start",
            recorded.initial_reserved_bytes,
            expected.start_reserved_mib,
        );
        assert_eq!(figures.events, expected.events, "{}: events", expected.file);
        assert_eq!(
            device.foreign_allocator,
            expected.file.starts_with("MemSnapDump"),
            "{}: only the torch_npu files are foreign",
            expected.file
        );
    }

    let constructor = load(&root.join("pytorch-snapshots/Constructor-Sun__memory_snapshot.pickle"))
        .unwrap_or_else(|e| panic!("{e}"));
    for device in &constructor.devices {
        assert_eq!(
            device.recorded_config.as_deref(),
            Some("expandable_segments:True")
        );
        let ooms = device
            .ops
            .iter()
            .filter(|op| matches!(op, Op::Oom { .. }))
            .count();
        assert_eq!(
            ooms,
            usize::from(device.device == 1),
            "one OOM, on device 1"
        );
    }
    // select_n returns segments in bulk (runs of dozens of segment_free entries,
    // no OOM), which replays as empty_cache().
    let select_n = load(&root.join("pytorch-snapshots/select_n__snapshot_ec5be11.pickle"))
        .unwrap_or_else(|e| panic!("{e}"));
    let empty_caches = select_n.devices[0]
        .ops
        .iter()
        .filter(|op| matches!(op, Op::EmptyCache))
        .count();
    println!("select_n__snapshot_ec5be11.pickle: {empty_caches} inferred empty_cache calls");
    assert!(empty_caches > 0);
}

#[test]
fn profiler_traces_match_the_manifest() {
    let Some(root) = shared_traces() else {
        return;
    };
    for &(file, events, peak_live_mib) in PROFILES {
        let trace = load(&root.join("profiler-cpu").join(file)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(trace.devices.len(), 1, "{file}: one CPU device");
        let device = &trace.devices[0];
        assert_eq!(device.device, -1, "{file}: the CPU is device -1");
        let figures = measure(file, device);
        println!(
            "{file}: events {} (manifest {events}), peak live {:.1} MiB (manifest {peak_live_mib}), skipped {:?}",
            figures.events,
            figures.peak_live_bytes as f64 / MIB,
            device.skipped,
        );
        assert_close_mib(file, "peak live", figures.peak_live_bytes, peak_live_mib);
        assert_eq!(figures.events, events, "{file}: events");
    }
}

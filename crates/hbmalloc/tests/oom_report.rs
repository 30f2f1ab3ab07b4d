//! Out-of-memory reports under policy `pytorch`: the numbers they carry and
//! their verdicts, for a fragmentation case, a real-demand case, a
//! pending-streams case and a memory-fraction case; and the fragmentation
//! report printed next to the message PyTorch prints for the same numbers.
//! Under policy `hbm`: where the free memory lies (whole granules that may
//! move, or that their handles pin) and the advice that follows from it.

use hbmalloc::{
    AllocError, Allocator, AllocatorConfig, DevicePtr, FreeGranules, OomReport, OomVerdict,
    PolicyConfig, SimDevice, StreamId,
};

const MIB: u64 = 1 << 20;
const S: StreamId = StreamId(0);

fn allocator(capacity: u64, settings: &str) -> Allocator<SimDevice> {
    Allocator::new(
        SimDevice::with_capacity(capacity),
        AllocatorConfig {
            policy: PolicyConfig::from_settings(settings).unwrap(),
            history_entries: 0,
        },
    )
    .unwrap()
}

fn oom(result: Result<DevicePtr, AllocError>) -> OomReport {
    match result {
        Err(AllocError::OutOfMemory(report)) => *report,
        other => panic!("expected out of memory, got {other:?}"),
    }
}

/// A report built by hand: 30 MiB asked of a 100 MiB device, 40 MiB live,
/// 80 MiB reserved, 40 MiB of it waiting on another stream.
fn pending_report() -> OomReport {
    OomReport {
        requested_bytes: 30 * MIB,
        rounded_bytes: 30 * MIB,
        device_request_bytes: 30 * MIB,
        stream: S,
        device_total_bytes: 100 * MIB,
        device_free_bytes: 20 * MIB,
        allocated_bytes: 40 * MIB,
        reserved_bytes: 80 * MIB,
        cached_free_bytes: 40 * MIB,
        largest_free_block_bytes: 0,
        pending_free_bytes: 40 * MIB,
        limit_bytes: None,
        policy: "pytorch",
        free_granules: None,
        segment_reserve_bytes: None,
        verdict: OomVerdict::RealDemand,
    }
}

/// The numbers every report must get right, whatever the verdict.
fn check_numbers(alloc: &Allocator<SimDevice>, report: &OomReport, requested: u64) {
    let stats = alloc.stats();
    assert_eq!(report.requested_bytes, requested, "unrounded request");
    assert!(report.rounded_bytes >= requested);
    assert_eq!(report.device_total_bytes, alloc.device().capacity_bytes());
    assert_eq!(
        report.allocated_bytes,
        stats.allocated_bytes[0].current as u64
    );
    assert_eq!(
        report.reserved_bytes,
        stats.reserved_bytes[0].current as u64
    );
    assert_eq!(report.reserved_bytes, alloc.device().used_bytes());
    assert_eq!(
        report.cached_free_bytes,
        report.reserved_bytes - report.allocated_bytes
    );
    assert!(report.largest_free_block_bytes <= report.cached_free_bytes);
    assert_eq!(
        report.device_free_bytes,
        report.device_total_bytes - report.reserved_bytes
    );
    let text = report.render();
    assert!(text.contains("verdict: "), "{text}");
}

#[test]
fn fragmentation() {
    // 10 segments of 20 MiB, each cut into five 4 MiB blocks; every second
    // block freed: 80 MiB free in 4 MiB holes between live blocks.
    let mut alloc = allocator(200 * MIB, "policy:pytorch");
    let mut ptrs = Vec::new();
    for _ in 0..50 {
        ptrs.push(alloc.malloc(4 * MIB, S).unwrap());
    }
    assert_eq!(alloc.device().used_bytes(), 200 * MIB);
    ptrs.sort_unstable();
    for (i, &p) in ptrs.iter().enumerate() {
        if i % 5 == 1 || i % 5 == 3 {
            alloc.free(p).unwrap();
        }
    }
    let requested = 10_000_000;
    let report = oom(alloc.malloc(requested, S));
    check_numbers(&alloc, &report, requested);
    assert_eq!(
        report.verdict,
        OomVerdict::Fragmentation,
        "{}",
        report.render()
    );
    assert_eq!(report.allocated_bytes, 120 * MIB);
    assert_eq!(report.reserved_bytes, 200 * MIB);
    assert_eq!(report.cached_free_bytes, 80 * MIB);
    assert!(report.cached_free_bytes >= requested);
    assert_eq!(report.largest_free_block_bytes, 4 * MIB);
    assert_eq!(report.pending_free_bytes, 0);
    // Under 10 MiB a request asks the driver for a whole 20 MiB segment.
    assert_eq!(report.device_request_bytes, 20 * MIB);
    assert_eq!(report.limit_bytes, None);
    println!("hbmalloc:\n{}\n", report.render());
    let pytorch = report.pytorch_message(0);
    println!("PyTorch, same numbers:\n{pytorch}");
    // PyTorch names the 20 MiB segment it tried, not the 9.54 MiB tensor.
    assert!(
        pytorch.starts_with("CUDA out of memory. Tried to allocate 20.00 MiB."),
        "{pytorch}"
    );
    assert!(
        pytorch.contains("80.00 MiB is reserved by PyTorch but unallocated"),
        "{pytorch}"
    );
    alloc.check_invariants().unwrap();
}

#[test]
fn real_demand() {
    let mut alloc = allocator(100 * MIB, "policy:pytorch");
    for _ in 0..4 {
        alloc.malloc(20 * MIB, S).unwrap();
    }
    let requested = 30 * MIB + 123;
    let report = oom(alloc.malloc(requested, S));
    check_numbers(&alloc, &report, requested);
    assert_eq!(
        report.verdict,
        OomVerdict::RealDemand,
        "{}",
        report.render()
    );
    assert_eq!(report.allocated_bytes, 80 * MIB);
    assert_eq!(report.cached_free_bytes, 0);
}

#[test]
fn memory_fraction() {
    let mut alloc = allocator(100 * MIB, "policy:pytorch,per_process_memory_fraction:0.5");
    alloc.malloc(20 * MIB, S).unwrap();
    alloc.malloc(20 * MIB, S).unwrap();
    let requested = 20 * MIB;
    let report = oom(alloc.malloc(requested, S));
    check_numbers(&alloc, &report, requested);
    assert_eq!(report.limit_bytes, Some(50 * MIB));
    assert_eq!(
        report.verdict,
        OomVerdict::ConfiguredLimit,
        "{}",
        report.render()
    );
    assert!(report.render().contains("per_process_memory_fraction"));
    // The same through set_memory_fraction at run time.
    let mut alloc = allocator(100 * MIB, "policy:pytorch");
    alloc.malloc(40 * MIB, S).unwrap();
    alloc.set_memory_fraction(0.5).unwrap();
    let report = oom(alloc.malloc(20 * MIB, S));
    assert_eq!(
        report.verdict,
        OomVerdict::ConfiguredLimit,
        "{}",
        report.render()
    );
}

#[test]
fn pending_streams() {
    // Under policy pytorch an allocation that fails while frees wait on other
    // streams synchronizes them and retries, so it succeeds...
    let mut alloc = allocator(100 * MIB, "policy:pytorch");
    let other = StreamId(7);
    let a = alloc.malloc(20 * MIB, S).unwrap();
    let b = alloc.malloc(20 * MIB, S).unwrap();
    alloc.malloc(20 * MIB, S).unwrap();
    alloc.malloc(20 * MIB, S).unwrap();
    for p in [a, b] {
        alloc.record_stream(p, other).unwrap();
        alloc.free(p).unwrap();
    }
    let syncs = alloc.stats().num_sync_all_streams;
    alloc.malloc(30 * MIB, S).unwrap();
    assert_eq!(alloc.stats().num_sync_all_streams, syncs + 1);
    alloc.check_invariants().unwrap();

    // ...so the verdict is judged from the numbers: 40 MiB waits on another
    // stream, and the request fits once it is released.
    let mut report = pending_report();
    report.judge();
    assert_eq!(
        report.verdict,
        OomVerdict::PendingStreams,
        "{}",
        report.render()
    );
    // Pending frees that could not make room do not explain the failure:
    // 90 MiB live + 20 MiB asked exceeds 100 MiB whatever the streams do.
    report.allocated_bytes = 90 * MIB;
    report.reserved_bytes = 100 * MIB;
    report.cached_free_bytes = 10 * MIB;
    report.device_free_bytes = 0;
    report.rounded_bytes = 20 * MIB;
    report.pending_free_bytes = 10 * MIB;
    report.judge();
    assert_eq!(
        report.verdict,
        OomVerdict::RealDemand,
        "{}",
        report.render()
    );
    // Same under a limit: the limit, not the streams, refuses it (the
    // device still has 50 MiB free).
    report.limit_bytes = Some(50 * MIB);
    report.device_free_bytes = 50 * MIB;
    report.allocated_bytes = 40 * MIB;
    report.reserved_bytes = 50 * MIB;
    report.rounded_bytes = 15 * MIB;
    report.pending_free_bytes = 10 * MIB;
    report.judge();
    assert_eq!(
        report.verdict,
        OomVerdict::ConfiguredLimit,
        "{}",
        report.render()
    );
}

/// Policy `hbm` on a driver that maps whole handles only: two 16-granule
/// (32 MiB) handles fill the device, and a 2 MiB block kept at the front of
/// each leaves 60 MiB free in whole granules that move with their handle or
/// not at all. A 40 MiB request runs out: the report says where the free
/// memory lies and names smaller handles; with one-granule handles the same
/// program stitches the idle granules together and fits.
#[test]
fn hbm_says_when_free_granules_are_pinned_by_their_handles() {
    let program = |settings: &str| {
        let mut alloc = allocator(64 * MIB, settings);
        let handles = [
            alloc.malloc(32 * MIB, S).unwrap(),
            alloc.malloc(32 * MIB, S).unwrap(),
        ];
        assert_eq!(alloc.device().used_bytes(), 64 * MIB);
        for p in handles {
            alloc.free(p).unwrap();
        }
        let front = alloc.malloc(2 * MIB, S).unwrap();
        let rest = alloc.malloc(30 * MIB, S).unwrap();
        let second_front = alloc.malloc(2 * MIB, S).unwrap();
        alloc.free(rest).unwrap();
        assert_eq!(
            second_front - front,
            32 * MIB,
            "one block at each handle's front"
        );
        let result = alloc.malloc(40 * MIB, S);
        (alloc, result)
    };
    let (alloc, result) = program("policy:hbm,whole_handle_granules:16");
    let report = oom(result);
    check_numbers(&alloc, &report, 40 * MIB);
    let free = report
        .free_granules
        .expect("hbm reports where free memory lies");
    assert_eq!(free.movable_bytes, 0, "{}", report.render());
    assert_eq!(free.pinned_bytes, 60 * MIB, "{}", report.render());
    assert_eq!(report.cached_free_bytes, 60 * MIB);
    assert_eq!(report.verdict, OomVerdict::Fragmentation);
    let text = report.render();
    println!("{text}");
    assert!(
        text.contains("60.00 MiB in whole granules of handles live blocks lie on"),
        "{text}"
    );
    assert!(text.contains("whole_handle_granules:4 or 1"), "{text}");
    alloc.check_invariants().unwrap();
    let (alloc, result) = program("policy:hbm,whole_handle_granules:1");
    result.expect("one-granule handles move where the request is");
    alloc.check_invariants().unwrap();
}

/// During a CUDA graph capture the retry may not release idle handles, so an
/// out-of-memory report can find whole idle handles: counted as memory that
/// may move, apart from the granules live blocks pin in their handles. Three
/// 16-granule (32 MiB) handles fill the device; the middle one lies idle
/// between a 2 MiB block at the end of the first and one at the front of the
/// third, and a 70 MiB request finds room nowhere.
#[test]
fn hbm_counts_an_idle_handle_a_capture_keeps_as_movable() {
    let mut alloc = allocator(96 * MIB, "policy:hbm,whole_handle_granules:16");
    let handles = [(); 3].map(|()| alloc.malloc(32 * MIB, S).unwrap());
    for p in handles {
        alloc.free(p).unwrap();
    }
    let head = alloc.malloc(30 * MIB, S).unwrap();
    let first_end = alloc.malloc(2 * MIB, S).unwrap();
    let middle = alloc.malloc(32 * MIB, S).unwrap();
    let third_front = alloc.malloc(2 * MIB, S).unwrap();
    assert_eq!(
        [head, first_end, middle, third_front],
        [handles[0], handles[0] + 30 * MIB, handles[1], handles[2]]
    );
    alloc.free(head).unwrap();
    alloc.free(middle).unwrap();
    alloc.set_capture_underway(true).unwrap();
    let report = oom(alloc.malloc(70 * MIB, S));
    check_numbers(&alloc, &report, 70 * MIB);
    let free = report
        .free_granules
        .expect("hbm reports where free memory lies");
    assert_eq!(free.movable_bytes, 32 * MIB, "{}", report.render());
    assert_eq!(free.pinned_bytes, 60 * MIB, "{}", report.render());
    assert_eq!(report.largest_free_block_bytes, 32 * MIB);
    assert_eq!(report.verdict, OomVerdict::Fragmentation);
    let text = report.render();
    assert!(
        text.contains("32.00 MiB in whole granules that may move, 60.00 MiB in whole granules"),
        "{text}"
    );
    alloc.set_capture_underway(false).unwrap();
    alloc.check_invariants().unwrap();
}

/// What would help a fragmented `hbm` follows where most of its free memory
/// lies: whole granules its handles pin, granules live blocks share, or
/// idle granules the retry could not give back.
#[test]
fn hbm_fragmentation_advice_follows_where_the_free_memory_lies() {
    let report = |movable: u64, pinned: u64| {
        // The device full, 60 MiB live, no frees pending.
        let mut report = OomReport {
            device_free_bytes: 0,
            allocated_bytes: 60 * MIB,
            reserved_bytes: 100 * MIB,
            pending_free_bytes: 0,
            policy: "hbm",
            free_granules: Some(FreeGranules {
                movable_bytes: movable,
                pinned_bytes: pinned,
            }),
            ..pending_report()
        };
        report.judge();
        assert_eq!(report.verdict, OomVerdict::Fragmentation);
        report.render()
    };
    let pinned = report(0, 30 * MIB);
    assert!(pinned.contains("whole_handle_granules"), "{pinned}");
    assert!(
        pinned.contains("30.00 MiB in whole granules of handles"),
        "{pinned}"
    );
    assert!(
        pinned.contains("10.00 MiB in granules live blocks share"),
        "{pinned}"
    );
    let shared = report(0, 10 * MIB);
    assert!(shared.contains("no remapping frees"), "{shared}");
    let movable = report(30 * MIB, 0);
    assert!(movable.contains("empty_cache()"), "{movable}");
    // A tie with the granules live blocks share gets the advice that always
    // helps, a larger device, not a change of settings.
    for (movable, pinned) in [(0, 20 * MIB), (20 * MIB, 0)] {
        let tie = report(movable, pinned);
        assert!(tie.contains("no remapping frees"), "{tie}");
    }
}

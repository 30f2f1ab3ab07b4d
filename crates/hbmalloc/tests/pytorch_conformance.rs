//! Conformance tests for policy `pytorch`: one focused test per documented
//! behaviour of PyTorch's CUDA caching allocator (see
//! `shared/reference/pytorch-allocator.md` and `c10/cuda/CUDACachingAllocator.cpp`),
//! each asserting exact sizes, addresses, history entries and statistics.

use hbmalloc::{
    Action, AllocError, Allocator, AllocatorConfig, BlockImage, BlockSnapshot, BlockState,
    CallKind, DeviceErrorKind, DevicePtr, Fault, OomVerdict, PolicyConfig, SegmentImage, SimDevice,
    StreamId, TraceEntry,
};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);
const S2: StreamId = StreamId(2);

fn allocator(conf: &str, capacity: u64) -> Allocator<SimDevice> {
    let config = AllocatorConfig {
        policy: PolicyConfig::parse("pytorch", conf).expect("valid config"),
        history_entries: 100_000,
    };
    Allocator::new(SimDevice::with_capacity(capacity), config).expect("allocator")
}

fn default_allocator() -> Allocator<SimDevice> {
    allocator("", 80 * GIB)
}

/// Every history entry with the given action, as (addr, size, stream).
fn entries(a: &Allocator<SimDevice>, action: Action) -> Vec<(DevicePtr, u64, StreamId)> {
    a.history()
        .entries()
        .filter(|e| e.action == action)
        .map(|e| (e.addr, e.size, e.stream))
        .collect()
}

/// Sizes of the segment events of one kind, in order.
fn seg_sizes(a: &Allocator<SimDevice>, action: Action) -> Vec<u64> {
    entries(a, action).into_iter().map(|e| e.1).collect()
}

/// Segment-changing history entries as (action, size), in order.
fn segment_events(a: &Allocator<SimDevice>) -> Vec<(Action, u64)> {
    a.history()
        .entries()
        .filter(|e| e.action.is_segment_event())
        .map(|e| (e.action, e.size))
        .collect()
}

fn block(a: &Allocator<SimDevice>, ptr: DevicePtr) -> BlockSnapshot {
    a.snapshot()
        .segments
        .iter()
        .flat_map(|s| s.blocks.iter())
        .find(|b| b.address == ptr)
        .cloned()
        .unwrap_or_else(|| panic!("no block at {ptr:#x}"))
}

fn stat(a: &Allocator<SimDevice>, key: &str) -> i64 {
    *a.stats()
        .to_pytorch_map()
        .get(key)
        .unwrap_or_else(|| panic!("no stat {key}"))
}

fn calls(a: &Allocator<SimDevice>, kind: CallKind) -> u64 {
    a.device().call_counts().get(kind)
}

fn consistent(a: &Allocator<SimDevice>) {
    a.check_invariants().expect("allocator invariants");
    a.device().check_invariants().expect("device invariants");
    assert_eq!(
        a.stats().reserved_bytes[0].current as u64,
        a.device().used_bytes(),
        "reserved_bytes stat vs device memory"
    );
}

// ----- rounding and segment sizes -----

#[test]
fn one_byte_rounds_to_512_in_a_2mib_small_segment() {
    let mut a = default_allocator();
    let p = a.malloc(1, S0).unwrap();
    assert_eq!(block(&a, p).size, 512);
    assert_eq!(block(&a, p).requested_size, 1);
    assert_eq!(seg_sizes(&a, Action::SegmentAlloc), vec![2 * MIB]);
    assert_eq!(calls(&a, CallKind::SegmentAlloc), 1);
    assert_eq!(stat(&a, "allocated_bytes.small_pool.current"), 512);
    assert_eq!(stat(&a, "allocated_bytes.large_pool.current"), 0);
    assert_eq!(
        stat(&a, "reserved_bytes.small_pool.current"),
        2 * MIB as i64
    );
    assert_eq!(stat(&a, "requested_bytes.small_pool.current"), 1);
    // The small pool splits: the 2 MiB - 512 tail is an inactive split block.
    assert_eq!(stat(&a, "inactive_split.small_pool.current"), 1);
    assert_eq!(
        stat(&a, "inactive_split_bytes.small_pool.current"),
        (2 * MIB - 512) as i64
    );
    consistent(&a);
}

#[test]
fn one_mib_is_small_one_mib_plus_one_is_large() {
    let mut a = default_allocator();
    let p = a.malloc(MIB, S0).unwrap();
    assert_eq!(block(&a, p).size, MIB);
    assert_eq!(stat(&a, "allocation.small_pool.current"), 1);
    assert_eq!(stat(&a, "allocation.large_pool.current"), 0);
    assert_eq!(seg_sizes(&a, Action::SegmentAlloc), vec![2 * MIB]);

    let q = a.malloc(MIB + 1, S0).unwrap();
    assert_eq!(block(&a, q).size, 1_049_088);
    assert_eq!(stat(&a, "allocation.large_pool.current"), 1);
    assert_eq!(stat(&a, "allocated_bytes.large_pool.current"), 1_049_088);
    assert_eq!(seg_sizes(&a, Action::SegmentAlloc), vec![2 * MIB, 20 * MIB]);
    // Split: remainder 20 MiB - 1,049,088 > 1 MiB.
    assert_eq!(stat(&a, "inactive_split.large_pool.current"), 1);
    assert_eq!(
        stat(&a, "inactive_split_bytes.large_pool.current"),
        (20 * MIB - 1_049_088) as i64
    );
    consistent(&a);
}

#[test]
fn eleven_million_bytes_get_a_12mib_segment_and_split() {
    let mut a = default_allocator();
    let p = a.malloc(11_000_000, S0).unwrap();
    assert_eq!(block(&a, p).size, 11_000_320);
    assert_eq!(seg_sizes(&a, Action::SegmentAlloc), vec![12 * MIB]);
    assert_eq!(stat(&a, "inactive_split.large_pool.current"), 1);
    assert_eq!(
        stat(&a, "inactive_split_bytes.large_pool.current"),
        1_582_592
    );
    let seg = &a.snapshot().segments[0];
    assert_eq!(seg.total_size, 12 * MIB);
    assert_eq!(seg.blocks.len(), 2);
    assert_eq!(seg.blocks[1].size, 1_582_592);
    assert_eq!(seg.blocks[1].state, BlockState::Inactive);
    consistent(&a);
}

#[test]
fn twelve_mib_gets_an_exact_unsplit_segment() {
    let mut a = default_allocator();
    let p = a.malloc(12 * MIB, S0).unwrap();
    assert_eq!(block(&a, p).size, 12 * MIB);
    assert_eq!(seg_sizes(&a, Action::SegmentAlloc), vec![12 * MIB]);
    assert_eq!(a.snapshot().segments[0].blocks.len(), 1);
    assert_eq!(stat(&a, "inactive_split.all.current"), 0);
    // Under 10 MiB: one 20 MiB segment, split.
    let q = a.malloc(9 * MIB + MIB / 2, S0).unwrap();
    assert_eq!(block(&a, q).size, 9 * MIB + MIB / 2);
    assert_eq!(
        seg_sizes(&a, Action::SegmentAlloc),
        vec![12 * MIB, 20 * MIB]
    );
    assert_eq!(
        stat(&a, "inactive_split_bytes.large_pool.current"),
        (10 * MIB + MIB / 2) as i64
    );
    consistent(&a);
}

#[test]
fn roundup_power2_divisions_single_value() {
    let mut a = allocator("roundup_power2_divisions:4", 80 * GIB);
    // 1200 <= 512 * 4: plain 512 rounding.
    let p = a.malloc(1200, S0).unwrap();
    assert_eq!(block(&a, p).size, 1536);
    // 1 MiB + 1: the next quarter of 1 MiB.
    let q = a.malloc(MIB + 1, S0).unwrap();
    assert_eq!(block(&a, q).size, MIB + MIB / 4);
    // 5 MiB + 1: floor 4 MiB, step 1 MiB.
    let r = a.malloc(5 * MIB + 1, S0).unwrap();
    assert_eq!(block(&a, r).size, 6 * MIB);
    // A power of two stays.
    let s = a.malloc(16 * MIB, S0).unwrap();
    assert_eq!(block(&a, s).size, 16 * MIB);
    consistent(&a);
}

#[test]
fn roundup_power2_divisions_list_syntax() {
    let mut a = allocator("roundup_power2_divisions:[256:1,512:2,>:8]", 80 * GIB);
    // [256 MiB, 512 MiB): 1 division, plain rounding.
    let p = a.malloc(300 * MIB + 1, S0).unwrap();
    assert_eq!(block(&a, p).size, 300 * MIB + 512);
    // [512 MiB, 1 GiB): 2 divisions of 256 MiB.
    let q = a.malloc(600 * MIB + 1, S0).unwrap();
    assert_eq!(block(&a, q).size, 768 * MIB);
    // >= 1 GiB: 8 divisions of 128 MiB (for a 1 GiB floor).
    let r = a.malloc(1536 * MIB + 1, S0).unwrap();
    assert_eq!(block(&a, r).size, 1664 * MIB);
    // Below 256 MiB the first boundary's value applies: plain rounding.
    let s = a.malloc(5 * MIB + 1, S0).unwrap();
    assert_eq!(block(&a, s).size, 5 * MIB + 512);
    assert_eq!(
        seg_sizes(&a, Action::SegmentAlloc),
        vec![300 * MIB + 2 * MIB, 768 * MIB, 1664 * MIB, 20 * MIB]
    );
    consistent(&a);
}

// ----- pool choice and best fit -----

#[test]
fn best_fit_by_stream_size_then_address() {
    let mut a = default_allocator();
    let x = a.malloc(12 * MIB, S0).unwrap();
    let y = a.malloc(14 * MIB, S0).unwrap();
    let z = a.malloc(12 * MIB, S0).unwrap();
    assert!(x < z);
    for p in [x, y, z] {
        a.free(p).unwrap();
    }
    assert_eq!(calls(&a, CallKind::SegmentAlloc), 3);
    // Two 12 MiB blocks fit exactly: the lower address wins.
    assert_eq!(a.malloc(12 * MIB, S0).unwrap(), x);
    // 13 MiB: the 14 MiB block is the smallest that fits (12 MiB is left),
    // unsplit because the 1 MiB tail is not > 1 MiB.
    assert_eq!(a.malloc(13 * MIB, S0).unwrap(), y);
    assert_eq!(block(&a, y).size, 14 * MIB);
    // Another stream never takes the free 12 MiB block of stream 0.
    let w = a.malloc(12 * MIB, S1).unwrap();
    assert_ne!(w, z);
    assert_eq!(calls(&a, CallKind::SegmentAlloc), 4);
    // Stream 0 still gets it.
    assert_eq!(a.malloc(12 * MIB, S0).unwrap(), z);
    assert_eq!(calls(&a, CallKind::SegmentAlloc), 4);
    consistent(&a);
}

#[test]
fn freed_block_is_reused_by_the_same_stream_only() {
    let mut a = default_allocator();
    let p = a.malloc(4096, S0).unwrap();
    a.free(p).unwrap();
    // The whole 2 MiB segment is one free block of stream 0 again.
    let q = a.malloc(4096, S1).unwrap();
    assert_ne!(q, p);
    assert_eq!(seg_sizes(&a, Action::SegmentAlloc), vec![2 * MIB, 2 * MIB]);
    assert_eq!(a.malloc(4096, S0).unwrap(), p);
    assert_eq!(calls(&a, CallKind::SegmentAlloc), 2);
    consistent(&a);
}

// ----- split rules -----

#[test]
fn small_pool_splits_remainders_of_512_or_more() {
    let mut a = default_allocator();
    let p = a.malloc(MIB, S0).unwrap();
    let q = a.malloc(MIB - 512, S0).unwrap();
    assert_eq!(q, p + MIB);
    // Remainder exactly 512: split off and reused.
    assert_eq!(block(&a, q).size, MIB - 512);
    let r = a.malloc(1, S0).unwrap();
    assert_eq!(r, p + 2 * MIB - 512);
    assert_eq!(calls(&a, CallKind::SegmentAlloc), 1);
    assert_eq!(stat(&a, "inactive_split.small_pool.current"), 0);
    consistent(&a);
}

#[test]
fn large_pool_keeps_tails_of_one_mib_or_less_attached() {
    let mut a = default_allocator();
    // 19 MiB in a 20 MiB segment: the 1 MiB tail stays attached.
    let p = a.malloc(19 * MIB, S0).unwrap();
    assert_eq!(block(&a, p).size, 20 * MIB);
    assert_eq!(block(&a, p).requested_size, 19 * MIB);
    assert_eq!(
        stat(&a, "allocated_bytes.large_pool.current"),
        20 * MIB as i64
    );
    assert_eq!(
        stat(&a, "requested_bytes.large_pool.current"),
        19 * MIB as i64
    );
    assert_eq!(stat(&a, "inactive_split.all.current"), 0);
    // 18.5 MiB: the 1.5 MiB tail is split off.
    let q = a.malloc(18 * MIB + MIB / 2, S0).unwrap();
    assert_eq!(block(&a, q).size, 18 * MIB + MIB / 2);
    assert_eq!(
        stat(&a, "inactive_split_bytes.large_pool.current"),
        (MIB + MIB / 2) as i64
    );
    consistent(&a);
}

#[test]
fn large_pool_does_not_split_requests_at_or_above_max_split_size() {
    // Without max_split_size: 40 MiB + 512 in a 42 MiB segment splits.
    let mut a = default_allocator();
    let p = a.malloc(40 * MIB + 512, S0).unwrap();
    assert_eq!(block(&a, p).size, 40 * MIB + 512);
    assert_eq!(seg_sizes(&a, Action::SegmentAlloc), vec![42 * MIB]);
    // With max_split_size_mb:40 it does not.
    let mut b = allocator("max_split_size_mb:40", 80 * GIB);
    let p = b.malloc(40 * MIB + 512, S0).unwrap();
    assert_eq!(block(&b, p).size, 42 * MIB);
    assert_eq!(stat(&b, "inactive_split.all.current"), 0);
    assert_eq!(stat(&b, "max_split_size"), 40 * MIB as i64);
    assert_eq!(stat(&a, "max_split_size"), -1);
    consistent(&a);
    consistent(&b);
}

/// `large_segment_size_mb` is the segment a large request under 10 MiB gets.
#[test]
fn large_segment_size_sets_the_segment_of_a_mid_sized_request() {
    for (conf, segment) in [("", 20 * MIB), ("large_segment_size_mb:32", 32 * MIB)] {
        let mut a = allocator(conf, 80 * GIB);
        a.malloc(4 * MIB, S0).unwrap();
        assert_eq!(seg_sizes(&a, Action::SegmentAlloc), vec![segment], "{conf}");
        consistent(&a);
    }
}

// ----- oversize rules -----

#[test]
fn smaller_request_never_takes_an_oversize_block() {
    let mut a = allocator("max_split_size_mb:40", 80 * GIB);
    let p = a.malloc(50 * MIB, S0).unwrap();
    assert_eq!(stat(&a, "oversize_allocations.current"), 1);
    assert_eq!(stat(&a, "oversize_segments.current"), 1);
    a.free(p).unwrap();
    assert_eq!(stat(&a, "oversize_allocations.current"), 0);
    assert_eq!(stat(&a, "oversize_allocations.peak"), 1);
    assert_eq!(stat(&a, "oversize_segments.current"), 1);
    let q = a.malloc(30 * MIB, S0).unwrap();
    assert_ne!(q, p);
    assert_eq!(
        seg_sizes(&a, Action::SegmentAlloc),
        vec![50 * MIB, 30 * MIB]
    );
    assert_eq!(stat(&a, "oversize_segments.current"), 1);
    // A small request neither.
    let r = a.malloc(512, S0).unwrap();
    assert_ne!(r, p);
    assert_eq!(
        seg_sizes(&a, Action::SegmentAlloc),
        vec![50 * MIB, 30 * MIB, 2 * MIB]
    );
    consistent(&a);
}

#[test]
fn large_request_takes_an_oversize_block_only_within_max_non_split_rounding() {
    let mut a = allocator("max_split_size_mb:40", 80 * GIB);
    let p = a.malloc(50 * MIB, S0).unwrap();
    a.free(p).unwrap();
    // 50 < 45 + 20: taken whole.
    assert_eq!(a.malloc(45 * MIB, S0).unwrap(), p);
    assert_eq!(block(&a, p).size, 50 * MIB);
    assert_eq!(stat(&a, "allocated_bytes.all.current"), 50 * MIB as i64);
    assert_eq!(stat(&a, "oversize_allocations.current"), 1);
    a.free(p).unwrap();
    let big = a.malloc(62 * MIB, S0).unwrap();
    a.free(big).unwrap();
    // 40 MiB: the 50 MiB block (< 60) is the best fit; then the 62 MiB block
    // (>= 40 + 20) is refused and a new segment is made.
    assert_eq!(a.malloc(40 * MIB, S0).unwrap(), p);
    let q = a.malloc(40 * MIB, S0).unwrap();
    assert_ne!(q, big);
    assert_eq!(
        seg_sizes(&a, Action::SegmentAlloc),
        vec![50 * MIB, 62 * MIB, 40 * MIB]
    );
    assert_eq!(stat(&a, "oversize_segments.current"), 3);
    assert_eq!(stat(&a, "oversize_allocations.current"), 2);
    consistent(&a);
}

/// Each oversize rule at its exact boundary: a block of exactly
/// `max_split_size` is oversize, and a cached block of exactly
/// `size + max_non_split_rounding` is refused.
#[test]
fn oversize_rules_hold_at_their_exact_boundaries() {
    let mut a = allocator("max_split_size_mb:40", 80 * GIB);
    let p = a.malloc(40 * MIB, S0).unwrap();
    assert_eq!(block(&a, p).size, 40 * MIB);
    assert_eq!(stat(&a, "oversize_allocations.current"), 1);
    assert_eq!(stat(&a, "oversize_segments.current"), 1);
    a.free(p).unwrap();
    assert_eq!(stat(&a, "oversize_allocations.current"), 0);
    // A request below max_split_size never takes the 40 MiB block.
    let q = a.malloc(30 * MIB, S0).unwrap();
    assert_ne!(q, p);
    assert_eq!(stat(&a, "oversize_segments.current"), 1);
    a.free(q).unwrap();
    let big = a.malloc(60 * MIB, S0).unwrap();
    a.free(big).unwrap();
    // 40 MiB takes the 40 MiB block; the next one refuses the 60 MiB block
    // (60 >= 40 + 20) and makes a segment.
    assert_eq!(a.malloc(40 * MIB, S0).unwrap(), p);
    let r = a.malloc(40 * MIB, S0).unwrap();
    assert_ne!(r, big);
    assert_eq!(
        seg_sizes(&a, Action::SegmentAlloc),
        vec![40 * MIB, 30 * MIB, 60 * MIB, 40 * MIB]
    );
    assert_eq!(stat(&a, "oversize_segments.current"), 3);
    // 60 < 42 + 20: taken whole.
    assert_eq!(a.malloc(42 * MIB, S0).unwrap(), big);
    // A request of exactly max_split_size in a larger block is not split.
    let n = a.malloc(50 * MIB, S0).unwrap();
    a.free(n).unwrap();
    assert_eq!(a.malloc(40 * MIB, S0).unwrap(), n);
    assert_eq!(block(&a, n).size, 50 * MIB);
    for ptr in [p, r, big, n] {
        a.free(ptr).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(stat(&a, "oversize_segments.current"), 0);
    assert_eq!(stat(&a, "oversize_allocations.current"), 0);
    consistent(&a);
}

#[test]
fn max_non_split_rounding_is_configurable() {
    let mut a = allocator(
        "max_split_size_mb:40,max_non_split_rounding_mb:30",
        80 * GIB,
    );
    let big = a.malloc(62 * MIB, S0).unwrap();
    a.free(big).unwrap();
    // 62 < 40 + 30: taken.
    assert_eq!(a.malloc(40 * MIB, S0).unwrap(), big);
    assert_eq!(calls(&a, CallKind::SegmentAlloc), 1);
    consistent(&a);
}

// ----- coalescing -----

#[test]
fn free_coalesces_with_free_neighbours() {
    let mut a = default_allocator();
    let x = a.malloc(2 * MIB, S0).unwrap();
    let y = a.malloc(2 * MIB, S0).unwrap();
    let z = a.malloc(2 * MIB, S0).unwrap();
    assert_eq!((y, z), (x + 2 * MIB, x + 4 * MIB));
    assert_eq!(stat(&a, "inactive_split.large_pool.current"), 1);
    assert_eq!(
        stat(&a, "inactive_split_bytes.large_pool.current"),
        14 * MIB as i64
    );
    a.free(x).unwrap();
    a.free(z).unwrap();
    // x alone; z merged with the 14 MiB tail.
    assert_eq!(stat(&a, "inactive_split.large_pool.current"), 2);
    assert_eq!(
        stat(&a, "inactive_split_bytes.large_pool.current"),
        18 * MIB as i64
    );
    let seg = &a.snapshot().segments[0];
    let sizes: Vec<u64> = seg.blocks.iter().map(|b| b.size).collect();
    assert_eq!(sizes, vec![2 * MIB, 2 * MIB, 16 * MIB]);
    a.free(y).unwrap();
    // One free 20 MiB block: no longer split.
    assert_eq!(stat(&a, "inactive_split.large_pool.current"), 0);
    assert_eq!(stat(&a, "inactive_split_bytes.large_pool.current"), 0);
    let seg = &a.snapshot().segments[0];
    assert_eq!(seg.blocks.len(), 1);
    assert_eq!(seg.blocks[0].size, 20 * MIB);
    // The whole segment serves a 20 MiB request.
    assert_eq!(a.malloc(20 * MIB, S0).unwrap(), x);
    assert_eq!(calls(&a, CallKind::SegmentAlloc), 1);
    consistent(&a);
}

#[test]
fn coalescing_never_crosses_segments() {
    let mut a = default_allocator();
    let x = a.malloc(12 * MIB, S0).unwrap();
    let y = a.malloc(12 * MIB, S0).unwrap();
    a.free(x).unwrap();
    a.free(y).unwrap();
    let snap = a.snapshot();
    assert_eq!(snap.segments.len(), 2);
    assert!(snap.segments.iter().all(|s| s.blocks.len() == 1));
    let z = a.malloc(24 * MIB, S0).unwrap();
    assert_ne!(z, x);
    assert_eq!(
        seg_sizes(&a, Action::SegmentAlloc),
        vec![12 * MIB, 12 * MIB, 24 * MIB]
    );
    consistent(&a);
}

// ----- record_stream -----

#[test]
fn record_stream_delays_reuse_until_the_stream_completes() {
    let mut a = default_allocator();
    let p = a.malloc(512, S0).unwrap();
    let keep = a.malloc(512, S0).unwrap();
    a.record_stream(p, S1).unwrap();
    // Recording the allocation stream itself needs no event.
    a.record_stream(p, S0).unwrap();
    a.free(p).unwrap();
    assert_eq!(calls(&a, CallKind::EventRecord), 1);
    assert_eq!(a.device().pending_events(), 1);
    // Free requested: allocation/allocated_bytes drop now, active stays.
    assert_eq!(stat(&a, "allocation.all.current"), 1);
    assert_eq!(stat(&a, "allocated_bytes.all.current"), 512);
    assert_eq!(stat(&a, "active.all.current"), 2);
    assert_eq!(stat(&a, "active_bytes.all.current"), 1024);
    assert_eq!(stat(&a, "requested_bytes.all.current"), 1024);
    assert_eq!(block(&a, p).state, BlockState::ActivePendingFree);
    assert_eq!(entries(&a, Action::FreeRequested), vec![(p, 512, S0)]);
    assert!(entries(&a, Action::FreeCompleted).is_empty());

    // Not reused while stream 1 may still use it, nor after stream 0 completes.
    let q = a.malloc(512, S0).unwrap();
    assert_ne!(q, p);
    a.device().complete_stream(S0);
    let r = a.malloc(512, S0).unwrap();
    assert_ne!(r, p);
    assert_eq!(stat(&a, "active.all.current"), 4);

    // Stream 1 completes: still active until the next malloc looks.
    a.device().complete_stream(S1);
    assert_eq!(stat(&a, "active.all.current"), 4);
    let s = a.malloc(512, S0).unwrap();
    assert_eq!(s, p, "the freed 512-byte block is the best fit");
    assert_eq!(entries(&a, Action::FreeCompleted), vec![(p, 512, S0)]);
    assert_eq!(stat(&a, "active.all.current"), 4);
    assert_eq!(a.device().pending_events(), 0);
    for ptr in [keep, q, r, s] {
        a.free(ptr).unwrap();
    }
    assert_eq!(stat(&a, "active.all.current"), 0);
    consistent(&a);
}

#[test]
fn record_stream_events_per_stream_all_must_complete() {
    let mut a = default_allocator();
    let p = a.malloc(12 * MIB, S0).unwrap();
    a.record_stream(p, S1).unwrap();
    a.record_stream(p, S2).unwrap();
    a.record_stream(p, S1).unwrap();
    a.free(p).unwrap();
    assert_eq!(calls(&a, CallKind::EventRecord), 2);
    a.device().complete_stream(S1);
    let q = a.malloc(12 * MIB, S0).unwrap();
    assert_ne!(q, p);
    assert_eq!(stat(&a, "active.all.current"), 2);
    a.device().complete_stream(S2);
    a.free(q).unwrap();
    // The next malloc retires S2's event: p comes back (lowest address).
    assert_eq!(a.malloc(12 * MIB, S0).unwrap(), p);
    assert_eq!(stat(&a, "active.all.current"), 1);
    assert_eq!(calls(&a, CallKind::SegmentAlloc), 2);
    consistent(&a);
}

#[test]
fn record_stream_of_unknown_pointer_is_an_error() {
    let mut a = default_allocator();
    let p = a.malloc(512, S0).unwrap();
    assert_eq!(
        a.record_stream(p + 512, S1),
        Err(AllocError::UnknownPointer { ptr: p + 512 })
    );
    a.free(p).unwrap();
    assert_eq!(
        a.record_stream(p, S1),
        Err(AllocError::UnknownPointer { ptr: p })
    );
    consistent(&a);
}

// ----- empty_cache -----

#[test]
fn empty_cache_releases_wholly_free_segments_in_pool_order() {
    let mut a = default_allocator();
    let s_live = a.malloc(512, S1).unwrap();
    let s_free = a.malloc(512, S0).unwrap();
    let l12 = a.malloc(12 * MIB, S0).unwrap();
    let l20 = a.malloc(2 * MIB, S0).unwrap();
    let l_live = a.malloc(2 * MIB, S1).unwrap();
    let l14 = a.malloc(14 * MIB, S2).unwrap();
    let seg_s1_live = l_live;
    for p in [l14, l20, s_free, l12] {
        a.free(p).unwrap();
    }
    assert_eq!(stat(&a, "segment.all.current"), 6);
    a.empty_cache().unwrap();
    // Large pool first, in (stream, size, address) order, then the small pool.
    assert_eq!(
        entries(&a, Action::SegmentFree),
        vec![
            (l12, 12 * MIB, S0),
            (l20, 20 * MIB, S0),
            (l14, 14 * MIB, S2),
            (s_free, 2 * MIB, S0),
        ]
    );
    assert_eq!(stat(&a, "segment.all.current"), 2);
    assert_eq!(stat(&a, "segment.large_pool.current"), 1);
    assert_eq!(stat(&a, "segment.small_pool.current"), 1);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 22 * MIB as i64);
    assert_eq!(stat(&a, "num_device_free"), 4);
    assert_eq!(stat(&a, "num_sync_all_streams"), 1);
    assert_eq!(a.device().used_bytes(), 22 * MIB);
    // Partly used segments keep their free parts cached.
    assert_eq!(stat(&a, "inactive_split.all.current"), 2);
    a.free(s_live).unwrap();
    a.free(seg_s1_live).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.device().used_bytes(), 0);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 0);
    assert_eq!(stat(&a, "segment.all.current"), 0);
    consistent(&a);
}

#[test]
fn empty_cache_synchronizes_pending_frees_first() {
    let mut a = default_allocator();
    let p = a.malloc(12 * MIB, S0).unwrap();
    a.record_stream(p, S1).unwrap();
    a.free(p).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(entries(&a, Action::FreeCompleted).len(), 1);
    assert_eq!(seg_sizes(&a, Action::SegmentFree), vec![12 * MIB]);
    assert_eq!(a.device().pending_events(), 0);
    assert_eq!(a.device().used_bytes(), 0);
    assert_eq!(stat(&a, "active.all.current"), 0);
    consistent(&a);
}

// ----- memory fraction and garbage collection -----

#[test]
fn memory_fraction_fails_without_calling_the_driver() {
    let mut a = allocator("", 100 * MIB);
    a.set_memory_fraction(0.5).unwrap();
    let _p = a.malloc(40 * MIB, S0).unwrap();
    assert_eq!(calls(&a, CallKind::SegmentAlloc), 1);
    let err = a.malloc(12 * MIB, S0).unwrap_err();
    let AllocError::OutOfMemory(report) = err else {
        panic!("expected OOM, got {err:?}");
    };
    assert_eq!(report.rounded_bytes, 12 * MIB);
    assert_eq!(report.limit_bytes, Some(50 * MIB));
    assert_eq!(calls(&a, CallKind::SegmentAlloc), 1, "no driver call");
    assert_eq!(stat(&a, "num_alloc_retries"), 1);
    assert_eq!(stat(&a, "num_ooms"), 1);
    // 10 MiB fits under the limit.
    a.malloc(10 * MIB, S0).unwrap();
    assert_eq!(calls(&a, CallKind::SegmentAlloc), 2);
    consistent(&a);
}

#[test]
fn per_process_memory_fraction_config_limits_too() {
    let mut a = allocator("per_process_memory_fraction:0.25", 100 * MIB);
    assert!(matches!(
        a.malloc(26 * MIB, S0),
        Err(AllocError::OutOfMemory(_))
    ));
    assert_eq!(calls(&a, CallKind::SegmentAlloc), 0);
    a.malloc(24 * MIB, S0).unwrap();
    consistent(&a);
}

#[test]
fn garbage_collection_frees_aged_cached_large_blocks() {
    let run = |conf: &str| {
        let mut a = allocator(conf, 200 * MIB);
        let x = a.malloc(30 * MIB, S0).unwrap();
        let y = a.malloc(12 * MIB, S0).unwrap();
        a.free(x).unwrap();
        let z = a.malloc(36 * MIB, S1).unwrap();
        a.free(z).unwrap();
        a.free(y).unwrap();
        // Miss on stream 0: reserved 78 MiB > 0.5 * 100 MiB. Ages: x 2, y 1,
        // z 1; mean 4/3: x (30 MiB) goes, which covers the 28 MiB target.
        a.malloc(35 * MIB, S0).unwrap();
        consistent(&a);
        a
    };
    let a = run("garbage_collection_threshold:0.5,per_process_memory_fraction:0.5");
    assert_eq!(
        segment_events(&a),
        vec![
            (Action::SegmentAlloc, 30 * MIB),
            (Action::SegmentAlloc, 12 * MIB),
            (Action::SegmentAlloc, 36 * MIB),
            (Action::SegmentFree, 30 * MIB),
            (Action::SegmentAlloc, 36 * MIB),
        ]
    );
    assert_eq!(stat(&a, "num_sync_all_streams"), 0);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 84 * MIB as i64);
    // Without a fraction, the threshold alone does nothing.
    let b = run("garbage_collection_threshold:0.5");
    assert_eq!(seg_sizes(&b, Action::SegmentFree), Vec::<u64>::new());
    assert_eq!(stat(&b, "reserved_bytes.all.current"), 114 * MIB as i64);
    // Nor does a fraction alone: a cache miss under the limit frees nothing.
    let c = run("per_process_memory_fraction:0.9");
    assert_eq!(seg_sizes(&c, Action::SegmentFree), Vec::<u64>::new());
    assert_eq!(stat(&c, "reserved_bytes.all.current"), 114 * MIB as i64);
}

// ----- restoring a recorded segment -----

fn large_image(blocks: &[(u64, bool)]) -> SegmentImage {
    SegmentImage {
        stream: S0,
        small_pool: false,
        expandable: false,
        blocks: blocks
            .iter()
            .map(|&(size, allocated)| BlockImage {
                size,
                requested_size: size,
                allocated,
            })
            .collect(),
    }
}

#[test]
fn restore_segment_carves_every_recorded_block_and_caches_the_free_ones() {
    let mut a = default_allocator();
    let image = large_image(&[(2 * MIB, true), (4 * MIB, false), (6 * MIB, true)]);
    let ptrs = a.restore_segment(&image).unwrap();
    assert_eq!(ptrs.len(), 3);
    assert_eq!(seg_sizes(&a, Action::SegmentAlloc), vec![12 * MIB]);
    assert_eq!(ptrs[1], ptrs[0] + 2 * MIB);
    assert_eq!(ptrs[2], ptrs[1] + 4 * MIB);
    let states: Vec<_> = ptrs
        .iter()
        .map(|&p| (block(&a, p).size, block(&a, p).state))
        .collect();
    assert_eq!(
        states,
        vec![
            (2 * MIB, BlockState::ActiveAllocated),
            (4 * MIB, BlockState::Inactive),
            (6 * MIB, BlockState::ActiveAllocated),
        ]
    );
    // The free block is cached: a request that fits it takes it.
    assert_eq!(a.malloc(4 * MIB, S0).unwrap(), ptrs[1]);
    consistent(&a);
}

#[test]
fn restore_segment_refuses_an_empty_or_unaligned_block() {
    let mut a = default_allocator();
    for (blocks, bad, says) in [
        (vec![], 0, "must be between 1 and"),
        (
            vec![(2 * MIB, true), (0, false)],
            0,
            "must be between 1 and",
        ),
        (
            vec![(2 * MIB, true), (1000, true)],
            1000,
            "multiples of 512 bytes",
        ),
    ] {
        let err = a.restore_segment(&large_image(&blocks)).unwrap_err();
        assert_eq!(err, AllocError::InvalidSize { size: bad }, "{blocks:?}");
        // The message names what is wrong with the block, not the sum.
        assert!(err.to_string().contains(says), "{blocks:?}: {err}");
    }
    assert_eq!(calls(&a, CallKind::SegmentAlloc), 0);
    consistent(&a);
}

/// A recorded block that asks for more than it holds (a hostile snapshot's
/// requested size of 2^63) counts as requesting its whole size, as under
/// policy hbm, rather than overflowing the requested-bytes statistic.
#[test]
fn restore_segment_holds_a_requested_size_to_its_block() {
    let mut a = default_allocator();
    let mut image = large_image(&[(2 * MIB, true), (2 * MIB, true)]);
    for block in &mut image.blocks {
        block.requested_size = i64::MAX as u64;
    }
    a.restore_segment(&image).unwrap();
    assert_eq!(a.stats().requested_bytes[0].current, 4 * MIB as i64);
    consistent(&a);
}

// ----- OOM retry order -----

#[test]
fn driver_oom_frees_cached_segments_and_retries() {
    let mut a = allocator("", 64 * MIB);
    let x = a.malloc(30 * MIB, S0).unwrap();
    a.free(x).unwrap();
    let y = a.malloc(40 * MIB, S1).unwrap();
    assert_eq!(
        segment_events(&a),
        vec![
            (Action::SegmentAlloc, 30 * MIB),
            (Action::SegmentFree, 30 * MIB),
            (Action::SegmentAlloc, 40 * MIB),
        ]
    );
    assert_eq!(calls(&a, CallKind::SegmentAlloc), 3);
    assert_eq!(stat(&a, "num_alloc_retries"), 1);
    assert_eq!(stat(&a, "num_sync_all_streams"), 1);
    assert_eq!(stat(&a, "num_ooms"), 0);

    // Nothing cached to free: OOM.
    let err = a.malloc(30 * MIB, S1).unwrap_err();
    let AllocError::OutOfMemory(report) = err else {
        panic!("expected OOM, got {err:?}");
    };
    assert_eq!(report.requested_bytes, 30 * MIB);
    assert_eq!(report.device_request_bytes, 30 * MIB);
    assert_eq!(stat(&a, "num_alloc_retries"), 2);
    assert_eq!(stat(&a, "num_sync_all_streams"), 2);
    assert_eq!(stat(&a, "num_ooms"), 1);
    let ooms: Vec<TraceEntry> = a
        .history()
        .entries()
        .filter(|e| e.action == Action::Oom)
        .copied()
        .collect();
    assert_eq!(ooms.len(), 1);
    assert_eq!(
        (ooms[0].addr, ooms[0].size, ooms[0].stream),
        (24 * MIB, 30 * MIB, S1)
    );
    assert_eq!(calls(&a, CallKind::SegmentAlloc), 5);
    a.free(y).unwrap();
    consistent(&a);
}

#[test]
fn with_max_split_size_oversize_blocks_are_freed_before_a_full_flush() {
    let mut a = allocator("max_split_size_mb:40", 100 * MIB);
    let big = a.malloc(62 * MIB, S0).unwrap();
    let small = a.malloc(12 * MIB, S0).unwrap();
    a.free(big).unwrap();
    a.free(small).unwrap();
    // 62 >= 40 + 20: refused; the driver has 26 MiB: the oversize block goes.
    let p = a.malloc(40 * MIB, S0).unwrap();
    assert_ne!(p, big);
    assert_eq!(
        segment_events(&a),
        vec![
            (Action::SegmentAlloc, 62 * MIB),
            (Action::SegmentAlloc, 12 * MIB),
            (Action::SegmentFree, 62 * MIB),
            (Action::SegmentAlloc, 40 * MIB),
        ]
    );
    assert_eq!(stat(&a, "num_alloc_retries"), 0);
    assert_eq!(stat(&a, "num_sync_all_streams"), 0);
    assert_eq!(stat(&a, "oversize_segments.current"), 1);
    consistent(&a);
}

#[test]
fn oversize_blocks_are_freed_largest_first_until_enough() {
    let mut a = allocator("max_split_size_mb:40", 140 * MIB);
    let b1 = a.malloc(42 * MIB, S0).unwrap();
    let b2 = a.malloc(44 * MIB, S0).unwrap();
    let b3 = a.malloc(46 * MIB, S0).unwrap();
    for p in [b1, b2, b3] {
        a.free(p).unwrap();
    }
    // 100 MiB: no block fits; driver has 8 MiB; no single oversize block
    // >= 100 MiB, so free from the largest down until 100 MiB are released:
    // 46 + 44 = 90 < 100, + 42 = 132.
    a.malloc(100 * MIB, S0).unwrap();
    assert_eq!(
        entries(&a, Action::SegmentFree),
        vec![(b3, 46 * MIB, S0), (b2, 44 * MIB, S0), (b1, 42 * MIB, S0)]
    );
    assert_eq!(stat(&a, "num_alloc_retries"), 0);
    consistent(&a);
}

#[test]
fn blocks_freed_by_the_final_synchronization_are_found() {
    // PyTorch #189504: PyTorch raises OOM here; the engine searches the pool
    // again after the last retry.
    let mut a = allocator("", 30 * MIB);
    let x = a.malloc(8 * MIB, S0).unwrap();
    let y = a.malloc(12 * MIB, S0).unwrap();
    assert_eq!(y, x + 8 * MIB);
    a.record_stream(x, S1).unwrap();
    a.free(x).unwrap();
    let p = a.malloc(8 * MIB, S0).unwrap();
    assert_eq!(p, x);
    assert_eq!(stat(&a, "num_alloc_retries"), 1);
    assert_eq!(stat(&a, "num_sync_all_streams"), 1);
    assert_eq!(stat(&a, "num_ooms"), 0);
    assert_eq!(calls(&a, CallKind::SegmentAlloc), 3);
    assert!(entries(&a, Action::Oom).is_empty());
    consistent(&a);
}

// ----- expandable segments -----

#[test]
fn expandable_segments_map_pages_on_demand() {
    let mut a = allocator("expandable_segments:True", GIB);
    let p = a.malloc(MIB + 1, S0).unwrap();
    assert_eq!(calls(&a, CallKind::AddressReserve), 1);
    assert_eq!(calls(&a, CallKind::PhysicalCreate), 1);
    assert_eq!(calls(&a, CallKind::Map), 1);
    assert_eq!(calls(&a, CallKind::SegmentAlloc), 0);
    assert_eq!(entries(&a, Action::SegmentMap), vec![(p, 20 * MIB, S0)]);
    assert_eq!(block(&a, p).size, 1_049_088);
    assert_eq!(
        stat(&a, "reserved_bytes.large_pool.current"),
        20 * MIB as i64
    );
    assert_eq!(stat(&a, "segment.all.current"), 0);
    assert_eq!(stat(&a, "num_device_alloc"), 1);
    // Expandable blocks are left out of inactive_split.
    assert_eq!(stat(&a, "inactive_split.all.current"), 0);

    // 25 MiB: the free tail of page 0 plus one more page.
    let q = a.malloc(25 * MIB, S0).unwrap();
    assert_eq!(q, p + 1_049_088);
    assert_eq!(
        entries(&a, Action::SegmentMap),
        vec![(p, 20 * MIB, S0), (p + 20 * MIB, 20 * MIB, S0)]
    );
    assert_eq!(calls(&a, CallKind::PhysicalCreate), 2);
    assert_eq!(
        stat(&a, "reserved_bytes.large_pool.current"),
        40 * MIB as i64
    );
    assert_eq!(calls(&a, CallKind::AddressReserve), 1);

    // Small requests get their own segment with 2 MiB pages.
    let s = a.malloc(512, S0).unwrap();
    assert_eq!(calls(&a, CallKind::AddressReserve), 2);
    assert_eq!(entries(&a, Action::SegmentMap)[2], (s, 2 * MIB, S0));
    assert_eq!(
        stat(&a, "reserved_bytes.small_pool.current"),
        2 * MIB as i64
    );
    assert_eq!(stat(&a, "segment.all.current"), 0);
    assert_eq!(a.device().used_bytes(), 42 * MIB);
    consistent(&a);

    for ptr in [p, q, s] {
        a.free(ptr).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(
        entries(&a, Action::SegmentUnmap),
        vec![(p, 40 * MIB, S0), (s, 2 * MIB, S0)]
    );
    assert_eq!(calls(&a, CallKind::Unmap), 3);
    assert_eq!(calls(&a, CallKind::PhysicalRelease), 3);
    assert_eq!(calls(&a, CallKind::AddressFree), 2);
    assert_eq!(a.device().used_bytes(), 0);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 0);
    assert_eq!(stat(&a, "num_device_free"), 2);
    assert!(a.snapshot().segments.is_empty());
    consistent(&a);
}

#[test]
fn expandable_segment_is_per_stream_and_reserves_nine_eighths() {
    let mut a = allocator("expandable_segments:True", GIB);
    let p = a.malloc(2 * MIB, S0).unwrap();
    let q = a.malloc(2 * MIB, S1).unwrap();
    assert_eq!(calls(&a, CallKind::AddressReserve), 2);
    // 9/8 of 1 GiB = 1152 MiB, rounded up to 20 MiB pages: 58 pages.
    assert!(q >= p + 58 * 20 * MIB);
    let snap = a.snapshot();
    assert_eq!(snap.segments.len(), 2);
    assert!(snap.segments.iter().all(|s| s.expandable));
    assert_eq!(snap.segments[0].total_size, 20 * MIB);
    consistent(&a);
}

/// `expandable_segments_reserve` sets the address space each segment
/// reserves, as a fraction of the device or in GiB.
#[test]
fn expandable_segments_reserve_sets_each_segments_address_space() {
    for (conf, pages) in [
        ("expandable_segments:True", 58),
        (
            "expandable_segments:True,expandable_segments_reserve:0.5",
            26,
        ),
        (
            "expandable_segments:True,expandable_segments_reserve:0.75G",
            39,
        ),
    ] {
        let mut a = allocator(conf, GIB);
        let p = a.malloc(2 * MIB, S0).unwrap();
        let q = a.malloc(2 * MIB, S1).unwrap();
        // The simulator leaves a 2 MiB gap after each reservation.
        assert_eq!(q - p, pages * 20 * MIB + 2 * MIB, "{conf}");
        consistent(&a);
    }
}

/// However large the setting, a segment reserves at most the default 9/8 of
/// the device, as PyTorch clamps it.
#[test]
fn expandable_segments_reserve_is_clamped_to_nine_eighths_of_the_device() {
    for reserve in ["1.5", "1e30", "1e300G"] {
        let conf = format!("expandable_segments:True,expandable_segments_reserve:{reserve}");
        let mut a = allocator(&conf, GIB);
        let p = a.malloc(2 * MIB, S0).unwrap();
        let q = a.malloc(2 * MIB, S1).unwrap();
        assert_eq!(q - p, 58 * 20 * MIB + 2 * MIB, "{conf}");
        consistent(&a);
    }
}

/// One allocation cannot span expandable segments: a request larger than a
/// segment's reserve fails through the normal out-of-memory path, and the
/// report names the setting; a request larger than the device does not.
#[test]
fn a_request_larger_than_a_segments_reserve_fails_as_out_of_memory() {
    for (reserve, request) in [("1e-300", 30 * MIB), ("0.05", 200 * MIB)] {
        let conf = format!("expandable_segments:True,expandable_segments_reserve:{reserve}");
        let mut a = allocator(&conf, GIB);
        let err = a.malloc(request, S0).unwrap_err();
        let AllocError::OutOfMemory(report) = err else {
            panic!("{conf}: expected OOM, got {err:?}");
        };
        assert_eq!(report.verdict, OomVerdict::SegmentReserve, "{conf}");
        let text = report.render();
        assert!(text.contains("expandable-segment"), "{text}");
        assert!(text.contains("expandable_segments_reserve"), "{text}");
        assert_eq!(stat(&a, "num_ooms"), 1, "{conf}");
        assert_eq!(calls(&a, CallKind::PhysicalCreate), 0, "{conf}");
        // A request within the reserve is served.
        a.malloc(request / 10, S0).unwrap();
        consistent(&a);
    }
    // A request of exactly a segment's reserve fits in one.
    let mut a = allocator(
        "expandable_segments:True,expandable_segments_reserve:1e-300",
        GIB,
    );
    a.malloc(20 * MIB, S0).unwrap();
    consistent(&a);
    // One that fits a segment but not the device is real demand, and the
    // report leaves the reserve out.
    let mut a = allocator(
        "expandable_segments:True,expandable_segments_reserve:0.5",
        GIB,
    );
    let _live = [
        a.malloc(300 * MIB, S0).unwrap(),
        a.malloc(300 * MIB, S0).unwrap(),
    ];
    let err = a.malloc(520 * MIB, S0).unwrap_err();
    let AllocError::OutOfMemory(report) = err else {
        panic!("expected OOM, got {err:?}");
    };
    assert_eq!(report.verdict, OomVerdict::RealDemand);
    assert_eq!(report.segment_reserve_bytes, None);
    consistent(&a);
    let mut a = allocator("expandable_segments:True", GIB);
    let err = a.malloc(2 * GIB, S0).unwrap_err();
    let AllocError::OutOfMemory(report) = err else {
        panic!("expected OOM, got {err:?}");
    };
    assert_eq!(report.verdict, OomVerdict::RealDemand);
    assert!(!report.render().contains("expandable-segment"));
    assert!(!report.render().contains("expandable_segments_reserve"));
    consistent(&a);
}

#[test]
fn expandable_empty_cache_unmaps_free_pages_and_regrows_at_lowest_address() {
    let mut a = allocator("expandable_segments:True", GIB);
    let x = a.malloc(25 * MIB, S0).unwrap();
    let y = a.malloc(10 * MIB, S0).unwrap();
    assert_eq!(y, x + 25 * MIB);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 40 * MIB as i64);
    a.free(x).unwrap();
    a.empty_cache().unwrap();
    // Only page 0 is wholly free; [20, 25) MiB stays mapped.
    assert_eq!(entries(&a, Action::SegmentUnmap), vec![(x, 20 * MIB, S0)]);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 20 * MIB as i64);
    assert_eq!(a.device().used_bytes(), 20 * MIB);
    assert_eq!(calls(&a, CallKind::AddressFree), 0);
    consistent(&a);
    // A 20 MiB request maps page 0 again: the lowest address with room.
    let z = a.malloc(20 * MIB, S0).unwrap();
    assert_eq!(z, x);
    assert_eq!(
        entries(&a, Action::SegmentMap),
        vec![(x, 40 * MIB, S0), (x, 20 * MIB, S0)]
    );
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 40 * MIB as i64);
    consistent(&a);
    a.free(y).unwrap();
    a.free(z).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.device().used_bytes(), 0);
    assert_eq!(calls(&a, CallKind::AddressFree), 1);
    consistent(&a);
}

#[test]
fn expandable_best_fit_counts_unmapped_space_after_a_block() {
    let mut a = allocator("expandable_segments:True", GIB);
    // Page 0: [0, 8) live, [8, 20) free followed by unmapped space.
    let x = a.malloc(8 * MIB, S0).unwrap();
    // 12 MiB fits the free block exactly: no new page.
    let y = a.malloc(12 * MIB, S0).unwrap();
    assert_eq!(y, x + 8 * MIB);
    assert_eq!(calls(&a, CallKind::Map), 1);
    a.free(y).unwrap();
    // 16 MiB: the free 12 MiB block grows into the next page.
    let z = a.malloc(16 * MIB, S0).unwrap();
    assert_eq!(z, x + 8 * MIB);
    assert_eq!(calls(&a, CallKind::Map), 2);
    consistent(&a);
}

// ----- memory_stats() key families -----

#[test]
fn stat_families_change_at_the_documented_moments() {
    let mut a = default_allocator();
    assert_eq!(
        a.stats().to_pytorch_map().len(),
        hbmalloc::PYTORCH_STAT_KEY_COUNT
    );
    let p = a.malloc(3 * MIB, S0).unwrap();
    let m = a.stats().to_pytorch_map();
    let expect = [
        ("allocation.large_pool.current", 1),
        ("allocation.large_pool.allocated", 1),
        ("segment.large_pool.current", 1),
        ("active.large_pool.current", 1),
        ("inactive_split.large_pool.current", 1),
        ("allocated_bytes.large_pool.current", 3 * MIB as i64),
        ("reserved_bytes.large_pool.current", 20 * MIB as i64),
        ("active_bytes.large_pool.current", 3 * MIB as i64),
        ("inactive_split_bytes.large_pool.current", 17 * MIB as i64),
        ("requested_bytes.large_pool.current", 3 * MIB as i64),
        ("num_device_alloc", 1),
        ("num_device_free", 0),
        ("num_sync_all_streams", 0),
        ("allocation.small_pool.current", 0),
    ];
    for (k, v) in expect {
        assert_eq!(m[k], v, "{k} after malloc");
    }
    a.record_stream(p, S1).unwrap();
    a.free(p).unwrap();
    let m = a.stats().to_pytorch_map();
    let expect = [
        ("allocation.all.current", 0),
        ("allocation.all.freed", 1),
        ("allocated_bytes.all.current", 0),
        ("allocated_bytes.all.freed", 3 * MIB as i64),
        ("active.all.current", 1),
        ("active_bytes.all.current", 3 * MIB as i64),
        ("requested_bytes.all.current", 3 * MIB as i64),
        ("inactive_split.all.current", 1),
        ("inactive_split_bytes.all.current", 17 * MIB as i64),
    ];
    for (k, v) in expect {
        assert_eq!(m[k], v, "{k} after free requested");
    }
    a.device().complete_stream(S1);
    let q = a.malloc(512, S0).unwrap();
    let m = a.stats().to_pytorch_map();
    let expect = [
        ("active.large_pool.current", 0),
        ("active.large_pool.freed", 1),
        ("active_bytes.large_pool.current", 0),
        ("requested_bytes.large_pool.current", 0),
        ("requested_bytes.large_pool.freed", 3 * MIB as i64),
        ("inactive_split.large_pool.current", 0),
        ("inactive_split_bytes.large_pool.current", 0),
        ("inactive_split_bytes.large_pool.peak", 17 * MIB as i64),
        ("segment.large_pool.current", 1),
        ("reserved_bytes.all.current", 22 * MIB as i64),
        ("active.small_pool.current", 1),
        ("num_device_alloc", 2),
    ];
    for (k, v) in expect {
        assert_eq!(m[k], v, "{k} after free completed");
    }
    a.free(q).unwrap();
    a.empty_cache().unwrap();
    let m = a.stats().to_pytorch_map();
    let expect = [
        ("segment.all.current", 0),
        ("segment.all.peak", 2),
        ("segment.all.freed", 2),
        ("reserved_bytes.all.current", 0),
        ("reserved_bytes.all.peak", 22 * MIB as i64),
        ("reserved_bytes.all.freed", 22 * MIB as i64),
        ("num_device_free", 2),
        ("num_sync_all_streams", 1),
        ("allocation.all.allocated", 2),
        ("allocation.all.peak", 1),
        ("num_alloc_retries", 0),
        ("num_ooms", 0),
    ];
    for (k, v) in expect {
        assert_eq!(m[k], v, "{k} after empty_cache");
    }
    consistent(&a);
}

// ----- bad input -----

#[test]
fn bad_input_is_rejected_and_leaves_the_allocator_consistent() {
    let mut a = default_allocator();
    assert_eq!(a.malloc(0, S0), Err(AllocError::InvalidSize { size: 0 }));
    assert_eq!(
        a.malloc(1 << 60, S0),
        Err(AllocError::InvalidSize { size: 1 << 60 })
    );
    let p = a.malloc(4096, S0).unwrap();
    assert_eq!(
        a.free(0xdead_beef),
        Err(AllocError::UnknownPointer { ptr: 0xdead_beef })
    );
    assert_eq!(
        a.free(p + 512),
        Err(AllocError::UnknownPointer { ptr: p + 512 })
    );
    a.free(p).unwrap();
    assert_eq!(a.free(p), Err(AllocError::UnknownPointer { ptr: p }));
    assert!(a.set_memory_fraction(1.5).is_err());
    assert!(a.set_memory_fraction(-0.1).is_err());
    assert_eq!(stat(&a, "allocation.all.current"), 0);
    assert_eq!(stat(&a, "allocation.all.freed"), 1);
    assert_eq!(stat(&a, "num_ooms"), 0);
    consistent(&a);
    a.empty_cache().unwrap();
    assert_eq!(a.device().used_bytes(), 0);
}

#[test]
fn a_request_larger_than_the_device_is_an_oom() {
    let mut a = allocator("", GIB);
    assert!(matches!(
        a.malloc(2 * GIB, S0),
        Err(AllocError::OutOfMemory(_))
    ));
    assert_eq!(stat(&a, "num_ooms"), 1);
    consistent(&a);
}

// ----- fault injection -----

fn driver_error() -> DeviceErrorKind {
    DeviceErrorKind::Driver("CUDA_ERROR_UNKNOWN".into())
}

#[test]
fn non_oom_segment_alloc_failure_is_a_device_error_and_leaks_nothing() {
    let mut a = default_allocator();
    a.device().inject(Fault {
        call: CallKind::SegmentAlloc,
        nth: 1,
        error: driver_error(),
        sticky: false,
    });
    let err = a.malloc(12 * MIB, S0).unwrap_err();
    assert!(
        matches!(&err, AllocError::Device(e) if e.call == CallKind::SegmentAlloc),
        "{err:?}"
    );
    assert_eq!(a.device().used_bytes(), 0);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 0);
    assert_eq!(stat(&a, "num_ooms"), 0);
    assert_eq!(stat(&a, "num_alloc_retries"), 0);
    consistent(&a);
    let p = a.malloc(12 * MIB, S0).unwrap();
    a.free(p).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.device().used_bytes(), 0);
    consistent(&a);
}

#[test]
fn expandable_partial_physical_create_failure_leaves_nothing_behind() {
    let mut a = allocator("expandable_segments:True", GIB);
    a.device().inject(Fault {
        call: CallKind::PhysicalCreate,
        nth: 2,
        error: driver_error(),
        sticky: false,
    });
    let err = a.malloc(30 * MIB, S0).unwrap_err();
    assert!(matches!(&err, AllocError::Device(e) if e.call == CallKind::PhysicalCreate));
    assert_eq!(a.device().used_bytes(), 0);
    assert_eq!(calls(&a, CallKind::Map), 0);
    assert_eq!(calls(&a, CallKind::PhysicalRelease), 1);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 0);
    assert!(entries(&a, Action::SegmentMap).is_empty());
    consistent(&a);
    // It still works afterwards.
    let p = a.malloc(30 * MIB, S0).unwrap();
    assert_eq!(a.device().used_bytes(), 40 * MIB);
    a.free(p).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.device().used_bytes(), 0);
    consistent(&a);
}

#[test]
fn expandable_partial_map_failure_leaves_nothing_behind() {
    for (call, nth) in [(CallKind::Map, 2), (CallKind::SetAccess, 1)] {
        let mut a = allocator("expandable_segments:True", GIB);
        let keep = a.malloc(4 * MIB, S0).unwrap();
        let used = a.device().used_bytes();
        a.device().inject(Fault {
            call,
            nth,
            error: driver_error(),
            sticky: false,
        });
        let err = a.malloc(60 * MIB, S0).unwrap_err();
        assert!(
            matches!(&err, AllocError::Device(e) if e.call == call),
            "{err:?}"
        );
        assert_eq!(a.device().used_bytes(), used, "{call:?}");
        assert_eq!(stat(&a, "reserved_bytes.all.current"), 20 * MIB as i64);
        consistent(&a);
        let p = a.malloc(60 * MIB, S0).unwrap();
        assert_eq!(p, keep + 4 * MIB);
        a.free(p).unwrap();
        a.free(keep).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(a.device().used_bytes(), 0);
        consistent(&a);
    }
}

#[test]
fn oom_from_physical_create_goes_through_the_retry_path() {
    let mut a = allocator("expandable_segments:True", GIB);
    a.device().inject(Fault {
        call: CallKind::PhysicalCreate,
        nth: 2,
        error: DeviceErrorKind::OutOfMemory,
        sticky: false,
    });
    // First attempt fails part-way with OOM; the retry after the flush maps.
    let p = a.malloc(30 * MIB, S0).unwrap();
    assert_eq!(stat(&a, "num_alloc_retries"), 1);
    assert_eq!(stat(&a, "num_ooms"), 0);
    assert_eq!(entries(&a, Action::SegmentMap), vec![(p, 40 * MIB, S0)]);
    assert_eq!(a.device().used_bytes(), 40 * MIB);
    consistent(&a);
}

#[test]
fn expandable_reserves_total_plus_an_eighth_rounded_up_to_pages() {
    // PyTorch reserves numSegments(total + total / 8) pages. For a device of
    // 160 MiB + 7 bytes that is 180 MiB + 7 bytes -> 10 pages of 20 MiB (200 MiB),
    // where total / 8 * 9 would give exactly 180 MiB (9 pages).
    let mut a = allocator("expandable_segments:True", 160 * MIB + 7);
    let p = a.malloc(2 * MIB, S0).unwrap();
    let q = a.malloc(2 * MIB, S1).unwrap();
    // The simulated device leaves a 2 MiB gap after each reserved range.
    assert_eq!(q - p, 200 * MIB + 2 * MIB);
    consistent(&a);
}

#[test]
fn expandable_unmap_failure_during_empty_cache_stays_consistent() {
    for (call, nth) in [
        (CallKind::Unmap, 1),
        (CallKind::Unmap, 2),
        (CallKind::PhysicalRelease, 2),
    ] {
        let mut a = allocator("expandable_segments:True", GIB);
        let p = a.malloc(60 * MIB, S0).unwrap();
        a.free(p).unwrap();
        a.device().inject(Fault {
            call,
            nth,
            error: driver_error(),
            sticky: false,
        });
        let err = a.empty_cache().unwrap_err();
        assert!(
            matches!(&err, AllocError::Device(e) if e.call == call),
            "{err:?}"
        );
        consistent(&a);
        // The cache still works and releases everything once the driver does.
        let q = a.malloc(60 * MIB, S0).unwrap();
        assert_eq!(q, p);
        a.free(q).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(a.device().used_bytes(), 0, "{call:?} {nth}");
        assert_eq!(stat(&a, "reserved_bytes.all.current"), 0);
        consistent(&a);
    }
}

#[test]
fn segment_free_failure_during_empty_cache_stays_consistent() {
    let mut a = default_allocator();
    let p = a.malloc(12 * MIB, S0).unwrap();
    let q = a.malloc(14 * MIB, S0).unwrap();
    a.free(p).unwrap();
    a.free(q).unwrap();
    a.device().inject(Fault {
        call: CallKind::SegmentFree,
        nth: 2,
        error: driver_error(),
        sticky: false,
    });
    assert!(a.empty_cache().is_err());
    consistent(&a);
    assert_eq!(a.device().used_bytes(), 14 * MIB);
    a.empty_cache().unwrap();
    assert_eq!(a.device().used_bytes(), 0);
    consistent(&a);
}

#[test]
fn event_record_failure_on_free_keeps_the_block_unusable_until_a_sync() {
    let mut a = default_allocator();
    let p = a.malloc(12 * MIB, S0).unwrap();
    a.record_stream(p, S1).unwrap();
    a.device().inject(Fault {
        call: CallKind::EventRecord,
        nth: 1,
        error: driver_error(),
        sticky: false,
    });
    assert!(matches!(a.free(p), Err(AllocError::Device(_))));
    consistent(&a);
    // The free was requested: the pointer is gone, the block is not reusable.
    assert_eq!(a.free(p), Err(AllocError::UnknownPointer { ptr: p }));
    assert_eq!(stat(&a, "allocation.all.current"), 0);
    assert_eq!(stat(&a, "active.all.current"), 1);
    let q = a.malloc(12 * MIB, S0).unwrap();
    assert_ne!(q, p);
    a.free(q).unwrap();
    // empty_cache synchronizes the device and releases both segments.
    a.empty_cache().unwrap();
    assert_eq!(stat(&a, "active.all.current"), 0);
    assert_eq!(a.device().used_bytes(), 0);
    consistent(&a);
}

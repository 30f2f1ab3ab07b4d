//! Unit tests of the sharded allocator's peaks, pools and captures.

use std::sync::atomic::Ordering;

use super::*;
use crate::allocator::{AllocatorConfig, PolicyConfig};
use crate::device::{CallKind, PoolId};
use crate::sim::SimDevice;
use crate::stats::StatType;

const MIB: u64 = 1 << 20;

/// An engine's configuration from a settings string, without history.
fn config(settings: &str) -> AllocatorConfig {
    AllocatorConfig {
        policy: PolicyConfig::from_settings(settings).unwrap(),
        history_entries: 0,
    }
}

fn shared(settings: &str) -> SharedAllocator<SimDevice> {
    SharedAllocator::new(SimDevice::new(), config(settings), 8).unwrap()
}

/// Two streams whose allocations go to different shards.
fn streams_on_two_shards(alloc: &SharedAllocator<SimDevice>) -> (StreamId, StreamId) {
    let a = StreamId(1);
    let b = (2..)
        .map(StreamId)
        .find(|&s| alloc.shard_of_stream(s) != alloc.shard_of_stream(a))
        .unwrap();
    (a, b)
}

#[test]
fn peaks_of_streams_on_two_shards_are_the_devices_not_their_sum() {
    for settings in ["policy:pytorch", "policy:hbm"] {
        let alloc = shared(settings);
        let (a, b) = streams_on_two_shards(&alloc);
        // One after the other: the device never holds both.
        let p = alloc.malloc(10 * MIB, a).unwrap();
        alloc.free(p).unwrap();
        let q = alloc.malloc(10 * MIB, b).unwrap();
        alloc.free(q).unwrap();
        let stats = alloc.stats();
        assert_eq!(stats.allocated_bytes[0].peak, 10 * MIB as i64, "{settings}");
        assert_eq!(stats.active_bytes[0].peak, 10 * MIB as i64, "{settings}");
        assert_eq!(stats.requested_bytes[0].peak, 10 * MIB as i64, "{settings}");
        // The per-pool peaks stay sums (upper bounds).
        assert_eq!(stats.allocated_bytes[2].peak, 20 * MIB as i64, "{settings}");
        // Together: both count.
        let p = alloc.malloc(10 * MIB, a).unwrap();
        let q = alloc.malloc(30 * MIB, b).unwrap();
        assert_eq!(alloc.stats().allocated_bytes[0].peak, 40 * MIB as i64);
        alloc.check_invariants().unwrap();
        alloc.free(p).unwrap();
        alloc.reset_peak_stats();
        assert_eq!(alloc.stats().allocated_bytes[0].peak, 30 * MIB as i64);
        alloc.free(q).unwrap();
        alloc.empty_cache().unwrap();
        let stats = alloc.stats();
        assert_eq!(stats.reserved_bytes[0].current, 0, "{settings}");
        assert!(
            stats.reserved_bytes[0].peak >= 40 * MIB as i64,
            "{settings}"
        );
        alloc.check_invariants().unwrap();
    }
}

#[test]
fn one_shard_needs_no_tracking() {
    let alloc = shared("policy:hbm");
    let p = alloc.malloc(10 * MIB, StreamId(1)).unwrap();
    alloc.free(p).unwrap();
    let p = alloc.malloc(4 * MIB, StreamId(1)).unwrap();
    assert!(!alloc.peaks.tracking.load(Ordering::Relaxed));
    assert_eq!(alloc.stats().allocated_bytes[0].peak, 10 * MIB as i64);
    alloc.free(p).unwrap();
}

#[test]
fn a_private_pool_reuses_only_its_own_memory_and_goes_with_its_last_holder() {
    for settings in ["policy:hbm", "policy:pytorch,expandable_segments:True"] {
        let alloc = shared(settings);
        let (pool, stream) = (PoolId(7, 0), StreamId(1));
        assert!(matches!(
            alloc.malloc_in_pool(pool, MIB, stream),
            Err(AllocError::UnknownPool { .. })
        ));
        alloc.create_or_incref_pool(pool).unwrap();
        alloc.create_or_incref_pool(pool).unwrap();
        assert_eq!(alloc.pool_use_count(pool), 2);
        let p = alloc.malloc_in_pool(pool, 9 * MIB, stream).unwrap();
        alloc.free(p).unwrap();
        // The pool's free memory is the graph's: not for the shards.
        let q = alloc.malloc(9 * MIB, stream).unwrap();
        assert_ne!(p, q, "{settings}");
        assert_eq!(alloc.malloc_in_pool(pool, 9 * MIB, stream).unwrap(), p);
        // A pool is PyTorch's plain segments (a 20 MiB one for requests
        // under 10 MiB), never expandable or stitched.
        let snapshot = alloc.snapshot();
        let segment = snapshot
            .segments
            .iter()
            .find(|s| s.address <= p && p < s.address + s.total_size)
            .unwrap();
        assert_eq!(segment.total_size, 20 * MIB, "{settings}");
        assert!(!segment.expandable, "{settings}");
        alloc.empty_cache().unwrap();
        let stats = alloc.stats();
        assert_eq!(stats.allocated_bytes[0].current, 18 * MIB as i64);
        alloc.check_invariants().unwrap();
        // Released by both holders with p still live: the pool stays
        // until p is freed, then gives its memory back.
        alloc.release_pool(pool).unwrap();
        alloc.release_pool(pool).unwrap();
        assert_eq!(alloc.pool_use_count(pool), 0);
        assert!(alloc.malloc_in_pool(pool, MIB, stream).is_err());
        alloc.check_invariants().unwrap();
        let reserved_with_pool = alloc.stats().reserved_bytes[0].current;
        alloc.free(p).unwrap();
        assert_eq!(
            alloc.stats().reserved_bytes[0].current,
            reserved_with_pool - 20 * MIB as i64,
            "{settings}"
        );
        assert!(alloc.pool_engines().is_empty(), "{settings}");
        assert!(matches!(
            alloc.release_pool(pool),
            Err(AllocError::UnknownPool { .. })
        ));
        alloc.free(q).unwrap();
        alloc.empty_cache().unwrap();
        let stats = alloc.stats();
        assert_eq!(stats.reserved_bytes[0].current, 0, "{settings}");
        assert_eq!(stats.allocated_bytes[0].peak, 18 * MIB as i64, "{settings}");
        alloc.check_invariants().unwrap();
    }
}

#[test]
fn a_capture_covers_every_engine_and_a_pool_made_during_it() {
    let alloc = shared("policy:hbm");
    let (main, side) = (StreamId(1), StreamId(2));
    let p = alloc.malloc(4 * MIB, main).unwrap();
    alloc.record_stream(p, side).unwrap();
    alloc.begin_capture().unwrap();
    alloc.begin_capture().unwrap();
    let pool = PoolId(3, 0);
    alloc.create_or_incref_pool(pool).unwrap();
    let records = alloc.device().call_counts().get(CallKind::EventRecord);
    let g = alloc.malloc_in_pool(pool, MIB, main).unwrap();
    alloc.record_stream(g, side).unwrap();
    alloc.free(g).unwrap();
    alloc.free(p).unwrap();
    assert!(matches!(
        alloc.empty_cache(),
        Err(AllocError::CaptureUnderway { .. })
    ));
    alloc.end_capture().unwrap();
    assert!(alloc.capture_underway());
    assert_eq!(
        alloc.device().call_counts().get(CallKind::EventRecord),
        records
    );
    alloc.end_capture().unwrap();
    // Both deferred frees recorded their events at the end.
    assert_eq!(
        alloc.device().call_counts().get(CallKind::EventRecord),
        records + 2
    );
    assert!(alloc.end_capture().is_err());
    alloc.device().complete_all();
    alloc.release_pool(pool).unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().reserved_bytes[0].current, 0);
    alloc.check_invariants().unwrap();
}

#[test]
fn a_shard_out_of_memory_takes_back_a_released_pools_cache_but_not_a_held_one() {
    let alloc = SharedAllocator::new(
        SimDevice::with_capacity(64 * MIB),
        config("policy:pytorch"),
        4,
    )
    .unwrap();
    let (held, released) = (PoolId(1, 0), PoolId(2, 0));
    alloc.create_or_incref_pool(held).unwrap();
    alloc.create_or_incref_pool(released).unwrap();
    let a = alloc.malloc_in_pool(held, 24 * MIB, StreamId(1)).unwrap();
    let b = alloc
        .malloc_in_pool(released, 24 * MIB, StreamId(1))
        .unwrap();
    alloc.free(a).unwrap();
    alloc.release_pool(released).unwrap();
    // b is live in the released pool: its segment stays until b goes.
    assert!(alloc.malloc(24 * MIB, StreamId(1)).is_err());
    alloc.free(b).unwrap();
    let c = alloc.malloc(24 * MIB, StreamId(1)).unwrap();
    // The held pool's cached segment was not taken.
    assert_eq!(
        alloc.malloc_in_pool(held, 24 * MIB, StreamId(1)).unwrap(),
        a
    );
    alloc.check_invariants().unwrap();
    for ptr in [a, c] {
        alloc.free(ptr).unwrap();
    }
}

#[test]
fn counters_do_not_go_back_when_a_pool_goes_away_and_a_pool_is_released_once_per_holder() {
    let alloc = shared("policy:hbm");
    let pool = PoolId(0, 4);
    alloc.create_or_incref_pool(pool).unwrap();
    let p = alloc.malloc_in_pool(pool, 30 * MIB, StreamId(1)).unwrap();
    alloc.free(p).unwrap();
    let before = alloc.stats();
    assert_eq!(before.num_device_alloc, 1);
    alloc.release_pool(pool).unwrap();
    assert!(
        alloc.pool_engines().is_empty(),
        "released with nothing live: gone"
    );
    let after = alloc.stats();
    assert_eq!(after.reserved_bytes[0].current, 0);
    assert_eq!(after.num_device_alloc, 1);
    assert_eq!(after.num_device_free, 1);
    assert_eq!(
        after.allocation[0].allocated,
        before.allocation[0].allocated
    );
    assert_eq!(after.allocated_bytes[0].allocated, 30 * MIB as i64);
    assert_eq!(after.segment[0].peak, 1);
    // No holder left: a second release is an error, not a silent no-op.
    assert!(matches!(
        alloc.release_pool(pool),
        Err(AllocError::UnknownPool { .. })
    ));
    alloc.reset_accumulated_stats();
    assert_eq!(alloc.stats().num_device_alloc, 0);
    alloc.check_invariants().unwrap();
}

#[test]
fn history_of_several_shards_is_one_unbroken_window_in_recorded_order() {
    let config = AllocatorConfig {
        policy: PolicyConfig::from_settings("policy:pytorch").unwrap(),
        history_entries: 16,
    };
    let alloc = SharedAllocator::new(SimDevice::new(), config, 8).unwrap();
    let (a, b) = streams_on_two_shards(&alloc);
    // Stream `a` works three times as often, so its ring wraps first and
    // `b`'s older entries fall outside the window every engine still holds.
    for step in 0..40u64 {
        let stream = if step % 4 == 0 { b } else { a };
        let p = alloc.malloc(MIB * (1 + step % 3), stream).unwrap();
        alloc.free(p).unwrap();
    }
    let history = alloc.snapshot().history;
    assert!(!history.is_empty());
    let first = history[0].sequence;
    let sequences: Vec<u64> = history.iter().map(|e| e.sequence).collect();
    let unbroken: Vec<u64> = (first..first + history.len() as u64).collect();
    assert_eq!(sequences, unbroken, "sorted, with no entry missing");
    let last = history.last().unwrap().sequence;
    assert_eq!(last + 1, alloc.history_clock.load(Ordering::Relaxed));
    assert!(history.iter().any(|e| e.stream == b) && history.iter().any(|e| e.stream == a));

    alloc.set_history_entries(16, true);
    let p = alloc.malloc(MIB, b).unwrap();
    alloc.free(p).unwrap();
    let after_clear = alloc.snapshot().history;
    assert!(
        after_clear.len() >= 2 && after_clear.iter().all(|e| e.stream == b),
        "a clear starts the window again on every engine: {after_clear:?}"
    );
}

#[test]
fn the_single_lock_baseline_is_the_engine_behind_a_lock() {
    // The same program through `ThreadSafeAllocator` on a locked engine and
    // straight on an engine: the same pointers, statistics and driver calls.
    let pytorch = config("policy:pytorch");
    let locked = Mutex::new(Allocator::new(SimDevice::new(), pytorch.clone()).unwrap());
    let mut plain = Allocator::new(SimDevice::new(), pytorch).unwrap();
    let shared: &dyn ThreadSafeAllocator = &locked;
    let (main, side) = (StreamId(1), StreamId(2));
    let a = shared.malloc(3 * MIB, main).unwrap();
    assert_eq!(a, plain.malloc(3 * MIB, main).unwrap());
    shared.record_stream(a, side).unwrap();
    plain.record_stream(a, side).unwrap();
    let b = shared.malloc(MIB, main).unwrap();
    assert_eq!(b, plain.malloc(MIB, main).unwrap());
    shared.free(a).unwrap();
    plain.free(a).unwrap();
    shared.free(b).unwrap();
    plain.free(b).unwrap();
    shared.empty_cache().unwrap();
    plain.empty_cache().unwrap();
    let stats = shared.stats();
    assert_eq!(stats, *plain.stats());
    let all = StatType::Aggregate as usize;
    assert_eq!(stats.allocation[all].allocated, 2, "two mallocs counted");
    assert_eq!(
        stats.reserved_bytes[all].current, 0,
        "the cache was emptied"
    );
    let calls = lock(&locked).device().call_counts();
    assert_eq!(calls, plain.device().call_counts());
    assert!(
        calls.get(CallKind::EventRecord) > 0,
        "the side stream's use was recorded"
    );
}

#[test]
fn shards_are_as_many_as_asked_and_at_least_one() {
    assert_eq!(shared("policy:pytorch").shard_count(), 8);
    let one = SharedAllocator::new(SimDevice::new(), config("policy:pytorch"), 0).unwrap();
    assert_eq!(one.shard_count(), 1);
}

#[test]
fn a_pools_live_allocations_are_its_own_in_address_order() {
    let alloc = shared("policy:pytorch");
    let (pool, other) = (PoolId(1, 0), PoolId(2, 0));
    assert_eq!(alloc.pool_live_allocations(pool), None, "no such pool yet");
    alloc.create_or_incref_pool(pool).unwrap();
    alloc.create_or_incref_pool(other).unwrap();
    let kept: Vec<DevicePtr> = (0..3)
        .map(|_| alloc.malloc_in_pool(pool, 4 * MIB, StreamId(1)).unwrap())
        .collect();
    let elsewhere = alloc.malloc_in_pool(other, 4 * MIB, StreamId(1)).unwrap();
    let outside = alloc.malloc(4 * MIB, StreamId(1)).unwrap();
    alloc.free(kept[1]).unwrap();
    assert_eq!(alloc.allocation_size(kept[0]).unwrap(), 4 * MIB);
    assert_eq!(alloc.allocation_size(outside).unwrap(), 4 * MIB);
    assert!(alloc.allocation_size(kept[1]).is_err(), "freed");
    let mut expected = vec![kept[0], kept[2]];
    expected.sort_unstable();
    assert_eq!(alloc.pool_live_allocations(pool), Some(expected));
    assert_eq!(alloc.pool_live_allocations(other), Some(vec![elsewhere]));
    for ptr in [kept[0], kept[2], elsewhere, outside] {
        alloc.free(ptr).unwrap();
    }
}

#[test]
fn a_pool_out_of_memory_takes_back_the_shards_caches() {
    let alloc = SharedAllocator::new(
        SimDevice::with_capacity(64 * MIB),
        config("policy:pytorch"),
        4,
    )
    .unwrap();
    // A shard caches 40 MiB; the pool's 40 MiB fits only once it is given back.
    let cached = alloc.malloc(40 * MIB, StreamId(1)).unwrap();
    alloc.free(cached).unwrap();
    let pool = PoolId(1, 0);
    alloc.create_or_incref_pool(pool).unwrap();
    let ptr = alloc.malloc_in_pool(pool, 40 * MIB, StreamId(1)).unwrap();
    alloc.free(ptr).unwrap();
    alloc.check_invariants().unwrap();
}

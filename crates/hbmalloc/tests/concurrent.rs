//! `SharedAllocator` under many threads: invariants hold, nothing is lost,
//! frees from other threads find their shard, and one shard's cache never
//! causes another shard's out-of-memory error.

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::sync::Arc;

use hbmalloc::{
    AllocError, AllocatorConfig, PolicyConfig, SharedAllocator, SimConfig, SimDevice, StreamId,
    ThreadSafeAllocator,
};

const MIB: u64 = 1 << 20;

fn assert_send_sync<T: Send + Sync>() {}

#[test]
fn shared_allocator_is_send_and_sync() {
    assert_send_sync::<SharedAllocator<SimDevice>>();
    assert_send_sync::<std::sync::Mutex<hbmalloc::Allocator<SimDevice>>>();
}

fn config(settings: &str) -> AllocatorConfig {
    AllocatorConfig {
        policy: PolicyConfig::from_settings(settings).unwrap(),
        history_entries: 0,
    }
}

/// xorshift64*: deterministic per thread.
fn next(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

fn churn(settings: &str, shards: usize) {
    let device = SimDevice::with_config(SimConfig {
        capacity_bytes: 4 << 30,
        ..SimConfig::default()
    });
    let alloc = Arc::new(SharedAllocator::new(device, config(settings), shards).unwrap());
    let threads = 4;
    // Each thread hands some of its pointers to the next thread to free.
    let (senders, receivers): (Vec<_>, Vec<_>) =
        (0..threads).map(|_| mpsc::channel::<u64>()).unzip();
    let mut handles = Vec::new();
    for (t, receiver) in receivers.into_iter().enumerate() {
        let alloc = Arc::clone(&alloc);
        let to_next = senders[(t + 1) % threads].clone();
        handles.push(std::thread::spawn(move || {
            let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ (t as u64 + 1);
            let stream = StreamId(t as u64 + 1);
            let mut live = Vec::new();
            for step in 0..4000 {
                let r = next(&mut rng);
                if live.len() < 64 && r % 3 != 0 {
                    let size = match r % 10 {
                        0 => 8 * MIB + r % (8 * MIB),
                        1..=3 => MIB + r % MIB,
                        _ => 1 + r % 65536,
                    };
                    let ptr = alloc.malloc(size, stream).expect("capacity is ample");
                    if r % 7 == 0 {
                        alloc.record_stream(ptr, StreamId(99)).unwrap();
                    }
                    live.push(ptr);
                } else if !live.is_empty() {
                    let ptr = live.swap_remove((r as usize / 7) % live.len());
                    if r % 5 == 0 {
                        to_next.send(ptr).unwrap();
                    } else {
                        alloc.free(ptr).unwrap();
                    }
                }
                while let Ok(ptr) = receiver.try_recv() {
                    alloc.free(ptr).unwrap();
                }
                if step % 1000 == 999 {
                    alloc.empty_cache().unwrap();
                }
            }
            for ptr in live {
                alloc.free(ptr).unwrap();
            }
            drop(to_next);
            receiver
        }));
    }
    drop(senders);
    let receivers: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for receiver in receivers {
        while let Ok(ptr) = receiver.try_recv() {
            alloc.free(ptr).unwrap();
        }
    }
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.stats().allocation[0].current, 0);
    // A double free is caught, whichever thread tries it.
    let ptr = alloc.malloc(4096, StreamId(1)).unwrap();
    alloc.free(ptr).unwrap();
    assert!(matches!(
        alloc.free(ptr),
        Err(AllocError::UnknownPointer { .. })
    ));
    alloc.device().complete_all();
    alloc.empty_cache().unwrap();
    assert_eq!(
        alloc.device().used_bytes(),
        0,
        "everything returns to the device"
    );
    assert_eq!(alloc.stats().reserved_bytes[0].current, 0);
}

#[test]
fn four_threads_churn_pytorch_policy_sharded() {
    churn("policy:pytorch", 8);
}

#[test]
fn four_threads_churn_pytorch_policy_one_shard() {
    churn("policy:pytorch", 1);
}

#[test]
fn four_threads_churn_expandable_segments() {
    churn("policy:pytorch,expandable_segments:True", 8);
}

#[test]
fn a_shard_out_of_memory_releases_the_other_shards_caches() {
    let device = SimDevice::with_capacity(64 * MIB);
    let alloc = SharedAllocator::new(device, config("policy:pytorch"), 4).unwrap();
    // Find two streams that land on different shards.
    let a = StreamId(1);
    let b = (2..100)
        .map(StreamId)
        .find(|s| {
            let probe =
                SharedAllocator::new(SimDevice::new(), config("policy:pytorch"), 4).unwrap();
            let pa = probe.malloc(1, a).unwrap();
            let pb = probe.malloc(1, *s).unwrap();
            // Different shards allocate different small segments.
            pa >> 21 != pb >> 21
        })
        .unwrap();
    assert_eq!(alloc.settings(), "policy:pytorch");
    let big = alloc.malloc(48 * MIB, a).unwrap();
    alloc.free(big).unwrap();
    // Stream a's shard caches 48 MiB; stream b needs 40 MiB of a 64 MiB device.
    let other = alloc
        .malloc(40 * MIB, b)
        .expect("the cache of shard a is released");
    alloc.free(other).unwrap();
    alloc.check_invariants().unwrap();
}

#[test]
fn a_memory_fraction_limits_all_shards_together() {
    for settings in ["policy:pytorch", "policy:hbm"] {
        let device = SimDevice::with_capacity(1 << 30);
        let alloc = SharedAllocator::new(device, config(settings), 8).unwrap();
        assert_eq!(alloc.memory_fraction(), 1.0, "{settings}");
        alloc.set_memory_fraction(0.25).unwrap();
        assert_eq!(alloc.memory_fraction(), 0.25, "{settings}");
        // 256 MiB allowed: 100 MiB on each of several streams fits twice, not thrice.
        let mut held = Vec::new();
        let mut refused = 0;
        for s in 1..=3 {
            match alloc.malloc(100 * MIB, StreamId(s)) {
                Ok(ptr) => held.push(ptr),
                Err(AllocError::OutOfMemory(_)) => refused += 1,
                Err(e) => panic!("{settings}: {e}"),
            }
        }
        assert_eq!((held.len(), refused), (2, 1), "{settings}");
        assert!(alloc.device().used_bytes() <= 256 * MIB, "{settings}");
        alloc.check_invariants().unwrap();
        for ptr in held {
            alloc.free(ptr).unwrap();
        }
    }
}

#[test]
fn four_threads_churn_hbm_policy_sharded() {
    churn("policy:hbm", 8);
}

/// The call of [`run_program`] before which it resets the peaks.
const RESET_PEAKS_BEFORE_CALL: usize = 1_500;

/// A seeded program for [`SharedAllocator`]s: streams 1-6 (on several of 8
/// shards) allocating small and large blocks and freeing them in turn, a
/// `reset_peak_stats` before call [`RESET_PEAKS_BEFORE_CALL`], everything
/// freed and `empty_cache` at the end. `each_step` sees the allocator after
/// every call.
fn run_program(
    alloc: &SharedAllocator<SimDevice>,
    seed: u64,
    mut each_step: impl FnMut(&SharedAllocator<SimDevice>),
) {
    let mut state = seed;
    let mut live: Vec<u64> = Vec::new();
    for step in 0..2 * RESET_PEAKS_BEFORE_CALL {
        if step == RESET_PEAKS_BEFORE_CALL {
            alloc.reset_peak_stats();
        }
        if live.is_empty() || next(&mut state) % 5 < 3 {
            let stream = StreamId(1 + next(&mut state) % 6);
            let size = if next(&mut state) % 4 == 0 {
                MIB + next(&mut state) % (24 * MIB)
            } else {
                512 + next(&mut state) % (MIB / 2)
            };
            live.push(alloc.malloc(size, stream).unwrap());
        } else {
            alloc
                .free(live.swap_remove((next(&mut state) % live.len() as u64) as usize))
                .unwrap();
        }
        each_step(alloc);
    }
    for ptr in live.drain(..) {
        alloc.free(ptr).unwrap();
        each_step(alloc);
    }
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
}

/// A sharded allocator reports what one engine under one lock reports for
/// the same program, under PyTorch's policy, whose decisions sharding does
/// not change (memory never leaves its stream): every current value and
/// total, and the byte peaks it keeps exact (`CombinedPeaks`: allocated,
/// reserved, active, requested bytes). The other peaks are sums of the
/// shards' (upper bounds), and `num_sync_all_streams` counts each shard's
/// `empty_cache`.
#[test]
fn sharded_statistics_are_one_engines() {
    let exact_peaks = [
        "allocated_bytes.all.peak",
        "reserved_bytes.all.peak",
        "active_bytes.all.peak",
        "requested_bytes.all.peak",
    ];
    for settings in ["policy:pytorch", "policy:pytorch,expandable_segments:True"] {
        for seed in 1..=4u64 {
            let stats = |shards| {
                let alloc =
                    SharedAllocator::new(SimDevice::new(), config(settings), shards).unwrap();
                run_program(&alloc, seed, |_| {});
                let mut stats = alloc.stats().to_pytorch_map();
                stats.retain(|key, _| {
                    !key.ends_with(".peak") || exact_peaks.contains(&key.as_str())
                });
                stats.remove("num_sync_all_streams");
                stats
            };
            assert_eq!(stats(8), stats(1), "{settings}, seed {seed}");
        }
    }
}

/// Under policy hbm, which stitches idle memory across streams (so one
/// engine decides differently from eight), no peak of a sharded allocator
/// is below the highest total seen after any call. (That the byte peaks are
/// not the sums of the shards' either is `src/concurrent.rs`'s unit tests.)
#[test]
fn sharded_hbm_peaks_are_at_least_every_total_seen() {
    let field = |stats: &BTreeMap<String, i64>, suffix: &str| {
        stats
            .iter()
            .filter_map(|(k, v)| Some((k.strip_suffix(suffix)?.to_string(), *v)))
            .collect::<BTreeMap<_, _>>()
    };
    for seed in 1..=4u64 {
        let alloc = SharedAllocator::new(SimDevice::new(), config("policy:hbm"), 8).unwrap();
        let mut highest_seen = BTreeMap::<String, i64>::new();
        let mut calls = 0;
        run_program(&alloc, seed, |alloc| {
            calls += 1;
            if calls == RESET_PEAKS_BEFORE_CALL {
                // The last call before the reset: its totals are where the
                // reset peaks start.
                highest_seen.clear();
            }
            for (key, current) in field(&alloc.stats().to_pytorch_map(), ".current") {
                let seen = highest_seen.entry(key).or_insert(current);
                *seen = (*seen).max(current);
            }
        });
        for (key, peak) in field(&alloc.stats().to_pytorch_map(), ".peak") {
            let seen = highest_seen[&key];
            assert!(peak >= seen, "seed {seed}: {key} peak {peak} < {seen} seen");
        }
    }
}

/// The totals of a sharded allocator are the shards' summed, `freed` as
/// well as `allocated`: every `.freed` figure the C ABI and Python read
/// comes from this sum.
#[test]
fn sharded_totals_sum_what_every_shard_freed() {
    for settings in ["policy:pytorch", "policy:hbm"] {
        let alloc = SharedAllocator::new(SimDevice::new(), config(settings), 8).unwrap();
        // Streams 1 to 4 land on more than one shard.
        let ptrs: Vec<_> = (1..=4)
            .map(|s| alloc.malloc(10 * MIB, StreamId(s)).unwrap())
            .collect();
        for &ptr in &ptrs {
            alloc.free(ptr).unwrap();
        }
        let stats = alloc.stats();
        assert_eq!(stats.allocation[0].allocated, 4, "{settings}");
        assert_eq!(stats.allocation[0].freed, 4, "{settings}");
        assert_eq!(
            stats.allocated_bytes[0].freed,
            40 * MIB as i64,
            "{settings}"
        );
        assert_eq!(stats.allocation[0].current, 0, "{settings}");
        let map = stats.to_pytorch_map();
        assert_eq!(map["allocation.all.freed"], 4, "{settings}");
    }
}

/// The event counters are summed over shards too: out-of-memory errors,
/// retries and synchronizations of every shard.
#[test]
fn sharded_event_counters_sum_every_shards() {
    let device = SimDevice::with_capacity(64 * MIB);
    let alloc = SharedAllocator::new(device, config("policy:pytorch"), 8).unwrap();
    for s in 1..=4 {
        assert!(alloc.malloc(1 << 30, StreamId(s)).is_err());
    }
    alloc.empty_cache().unwrap();
    let stats = alloc.stats();
    // Each request fails on its shard after one retry, and again after the
    // other 7 shards emptied their caches: 8 failures and 8 retries. Every
    // retry, every emptied cache (7 per request) and the final empty_cache
    // of all 8 shards synchronize once: 8 + 28 + 8.
    assert_eq!(stats.num_ooms, 8);
    assert_eq!(stats.num_alloc_retries, 8);
    assert_eq!(stats.num_sync_all_streams, 44);
}

#[test]
fn resetting_statistics_reaches_every_shard() {
    for settings in ["policy:pytorch", "policy:hbm"] {
        let alloc = SharedAllocator::new(SimDevice::new(), config(settings), 8).unwrap();
        // Streams 1 to 4 land on more than one shard.
        let ptrs: Vec<_> = (1..=4)
            .map(|s| alloc.malloc(10 * MIB, StreamId(s)).unwrap())
            .collect();
        for &ptr in &ptrs[1..] {
            alloc.free(ptr).unwrap();
        }
        let before = alloc.stats();
        assert_eq!(
            before.allocated_bytes[0].peak,
            40 * MIB as i64,
            "{settings}"
        );
        assert_eq!(before.allocation[0].allocated, 4, "{settings}");
        alloc.reset_peak_stats();
        let after = alloc.stats();
        assert_eq!(after.allocated_bytes[0].peak, 10 * MIB as i64, "{settings}");
        assert_eq!(after.allocation[0].allocated, 4, "{settings}: totals stay");
        alloc.reset_accumulated_stats();
        let after = alloc.stats();
        assert_eq!(after.allocation[0].allocated, 0, "{settings}");
        assert_eq!(after.allocation[0].freed, 0, "{settings}");
        assert_eq!(after.allocation[0].current, 1, "{settings}: current stays");
        alloc.free(ptrs[0]).unwrap();
    }
}

#[test]
fn a_configured_memory_fraction_reads_back() {
    for settings in [
        "policy:pytorch,per_process_memory_fraction:0.8",
        "policy:hbm,per_process_memory_fraction:0.8",
    ] {
        let alloc = SharedAllocator::new(SimDevice::new(), config(settings), 2).unwrap();
        assert_eq!(alloc.memory_fraction(), 0.8, "{settings}");
    }
}

#[test]
fn the_largest_free_block_is_the_cache_or_the_device_within_the_fraction() {
    for settings in ["policy:pytorch", "policy:hbm"] {
        let device = SimDevice::with_capacity(1 << 30);
        let alloc = SharedAllocator::new(device, config(settings), 4).unwrap();
        // Nothing cached: what the device has free.
        assert_eq!(
            alloc.largest_free_block_bytes().unwrap(),
            1 << 30,
            "{settings}"
        );
        let big = alloc.malloc(600 * MIB, StreamId(1)).unwrap();
        let small = alloc.malloc(100 * MIB, StreamId(2)).unwrap();
        let device_free = (1 << 30) - alloc.device().used_bytes();
        assert!(device_free < 600 * MIB, "{settings}: {device_free}");
        alloc.free(big).unwrap();
        // The cached block is larger than what the device has left.
        let largest = alloc.largest_free_block_bytes().unwrap();
        assert!(
            (600 * MIB..700 * MIB).contains(&largest),
            "{settings}: {largest}"
        );
        // Over the fraction's limit: the cache still serves its block.
        alloc.set_memory_fraction(0.5).unwrap();
        assert_eq!(
            alloc.largest_free_block_bytes().unwrap(),
            largest,
            "{settings}"
        );
        // Cache emptied: the fraction bounds what the device could add.
        alloc.empty_cache().unwrap();
        let within_limit = 512 * MIB - alloc.device().used_bytes();
        assert_eq!(
            alloc.largest_free_block_bytes().unwrap(),
            within_limit,
            "{settings}"
        );
        alloc.free(small).unwrap();
        alloc.check_invariants().unwrap();
    }
}

/// Threads that each capture "graphs" into private pools of their own while
/// the others allocate, free each other's memory and empty the cache: the
/// pools' memory is never handed to anyone else, every engine keeps its
/// books, and everything returns to the device once the pools are released.
#[test]
fn four_threads_capture_into_private_pools_while_others_churn() {
    use hbmalloc::PoolId;
    for settings in ["policy:hbm", "policy:pytorch,expandable_segments:True"] {
        let device = SimDevice::with_config(SimConfig {
            // Pools released while another thread captures give their
            // memory back only when no capture is underway: room for all.
            capacity_bytes: 32 << 30,
            ..SimConfig::default()
        });
        let alloc = Arc::new(SharedAllocator::new(device, config(settings), 8).unwrap());
        let handles: Vec<_> = (0..4u64)
            .map(|t| {
                let alloc = Arc::clone(&alloc);
                std::thread::spawn(move || {
                    let mut rng = 0x2545_F491_4F6C_DD1Du64 ^ (t + 1);
                    let stream = StreamId(t + 1);
                    let mut outside = Vec::new();
                    for round in 0..12u64 {
                        let pool = PoolId(t * 1000 + round + 1, 0);
                        alloc.create_or_incref_pool(pool).unwrap();
                        alloc.begin_capture().unwrap();
                        let mut graph = Vec::new();
                        for _ in 0..16 {
                            let r = next(&mut rng);
                            let size = 1 + r % (4 * MIB);
                            let p = alloc.malloc_in_pool(pool, size, stream).unwrap();
                            if r % 3 == 0 {
                                // A temporary of the graph: freed in the capture.
                                alloc.free(p).unwrap();
                            } else {
                                graph.push((p, size));
                            }
                            // Another stream of this thread, outside the pool.
                            let q = alloc.malloc(1 + r % MIB, StreamId(t + 10)).unwrap();
                            outside.push(q);
                            if outside.len() > 8 {
                                alloc.free(outside.swap_remove(0)).unwrap();
                            }
                        }
                        // Memory of a live pool never serves anyone else.
                        for &q in &outside {
                            assert!(graph.iter().all(|&(p, size)| q < p || q >= p + size));
                        }
                        alloc.end_capture().unwrap();
                        if round % 4 == 3 {
                            // Captures that have ended allow empty_cache
                            // unless another thread's is underway.
                            match alloc.empty_cache() {
                                Ok(()) | Err(AllocError::CaptureUnderway { .. }) => {}
                                Err(e) => panic!("empty_cache: {e}"),
                            }
                        }
                        alloc.release_pool(pool).unwrap();
                        for (p, _) in graph {
                            alloc.free(p).unwrap();
                        }
                        assert_eq!(alloc.pool_use_count(pool), 0);
                    }
                    for q in outside {
                        alloc.free(q).unwrap();
                    }
                })
            })
            .collect();
        for handle in handles {
            handle.join().unwrap();
        }
        alloc.check_invariants().unwrap();
        assert!(!alloc.capture_underway());
        assert_eq!(alloc.stats().allocation[0].current, 0, "{settings}");
        alloc.device().complete_all();
        alloc.empty_cache().unwrap();
        assert_eq!(alloc.device().used_bytes(), 0, "{settings}");
        assert_eq!(alloc.stats().reserved_bytes[0].current, 0, "{settings}");
    }
}

/// Eight threads mixing every call that touches pools and captures (a
/// review's stress program): captures begun and ended, pools made, used,
/// released and freed into, `empty_cache`, statistics and their resets,
/// memory fractions, snapshots. No free may fail, nothing may deadlock, and
/// at the end every engine's books agree and everything goes back.
#[test]
fn eight_threads_mix_pools_captures_and_cache_calls() {
    use hbmalloc::PoolId;
    let device = SimDevice::with_config(SimConfig {
        capacity_bytes: 16 << 30,
        ..SimConfig::default()
    });
    let alloc = Arc::new(SharedAllocator::new(device, config("policy:hbm"), 4).unwrap());
    let handles: Vec<_> = (0..8u64)
        .map(|t| {
            let alloc = Arc::clone(&alloc);
            std::thread::spawn(move || {
                for i in 1..=20_000u64 {
                    let pool = PoolId(i % 3 + 1, 0);
                    match (t + i) % 9 {
                        0 => {
                            alloc.begin_capture().unwrap();
                            alloc.end_capture().unwrap();
                        }
                        1 => {
                            alloc.create_or_incref_pool(pool).unwrap();
                            let p = alloc.malloc_in_pool(pool, MIB * (1 + i % 5), StreamId(t));
                            alloc.release_pool(pool).unwrap();
                            if let Ok(p) = p {
                                alloc.record_stream(p, StreamId(t + 1)).unwrap();
                                alloc.free(p).unwrap();
                            }
                        }
                        2 => match alloc.empty_cache() {
                            Ok(()) | Err(AllocError::CaptureUnderway { .. }) => {}
                            Err(e) => panic!("empty_cache: {e}"),
                        },
                        3 => {
                            let _ = alloc.stats();
                            alloc.reset_peak_stats();
                        }
                        4 => alloc.set_memory_fraction(0.9).unwrap(),
                        5 => {
                            let _ = alloc.snapshot();
                            alloc.set_history_entries(0, false);
                        }
                        _ => {
                            let p = alloc.malloc(MIB * (1 + i % 7), StreamId(t)).unwrap();
                            alloc.record_stream(p, StreamId(t + 3)).unwrap();
                            alloc.free(p).unwrap();
                        }
                    }
                    if i % 500 == 0 {
                        alloc.device().complete_all();
                    }
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().unwrap();
    }
    assert!(!alloc.capture_underway());
    alloc.device().complete_all();
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.stats().reserved_bytes[0].current, 0);
    assert_eq!(alloc.device().used_bytes(), 0);
}

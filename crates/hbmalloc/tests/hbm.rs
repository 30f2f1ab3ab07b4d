//! Policy `hbm`: invariants under random multi-stream workloads, stream
//! safety, zero driver calls in a repeating step, reserved tracking live
//! memory, fault injection, and the no-virtual-memory fallback.

use std::collections::BTreeMap;

use hbmalloc::{
    AllocError, Allocator, AllocatorConfig, BlockImage, CallKind, DeviceErrorKind, DevicePtr,
    Fault, OomVerdict, PolicyConfig, SegmentImage, SimConfig, SimDevice, StreamId,
    MAX_REQUEST_BYTES,
};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// A deterministic xorshift generator: the tests never depend on a clock.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn allocator(device: SimDevice, policy: &str, conf: &str) -> Allocator<SimDevice> {
    let config = AllocatorConfig {
        policy: PolicyConfig::parse(policy, conf).expect("valid configuration"),
        history_entries: 0,
    };
    Allocator::new(device, config).expect("allocator")
}

/// `hbm` on the simulator's default device: a driver that maps whole
/// handles only, as the H100's does.
fn hbm(capacity: u64, conf: &str) -> Allocator<SimDevice> {
    allocator(SimDevice::with_capacity(capacity), "hbm", conf)
}

/// A device with no virtual-memory API: `hbm` falls back to segments.
fn without_virtual_memory(capacity: u64) -> SimDevice {
    SimDevice::with_config(SimConfig {
        capacity_bytes: capacity,
        granularity: None,
        ..SimConfig::default()
    })
}

/// A device whose driver also maps part of a physical handle: the what-if
/// on which `hbm` maps a growing heap in large chunks and stitches single
/// granules of them.
fn part_maps(capacity: u64) -> SimDevice {
    SimDevice::with_config(SimConfig {
        capacity_bytes: capacity,
        maps_handle_parts: true,
        ..SimConfig::default()
    })
}

fn check(a: &Allocator<SimDevice>) {
    a.check_invariants().expect("allocator invariants");
    a.device().check_invariants().expect("device invariants");
    assert_eq!(
        a.stats().reserved_bytes[0].current as u64,
        a.device().used_bytes(),
        "reserved must equal what the device handed out"
    );
}

/// No two live blocks share physical memory, even through different virtual
/// addresses: each physical granule under a live block backs one virtual
/// granule only.
fn check_physical(a: &Allocator<SimDevice>, live: &[(DevicePtr, u64, StreamId)]) {
    let granule = 2 * MIB;
    let mut backing: BTreeMap<(u64, u64), u64> = BTreeMap::new();
    for &(ptr, size, _) in live {
        let mut va = ptr / granule * granule;
        while va < ptr + size {
            let probe = va.max(ptr);
            let (handle, offset) = a
                .device()
                .physical_location(probe)
                .expect("a live block lies over mapped memory");
            let key = (handle.0, offset / granule);
            let previous = backing.insert(key, va / granule);
            assert!(
                previous.is_none_or(|v| v == va / granule),
                "physical granule {key:?} backs two live virtual granules"
            );
            va += granule;
        }
    }
}

/// A request size drawn from a training-like mix: many small tensors, some
/// medium, a few large.
fn mixed_size(random: &mut Random) -> u64 {
    match random.below(10) {
        0..=4 => 1 + random.below(256 * 1024),
        5..=7 => MIB + random.below(8 * MIB),
        _ => 8 * MIB + random.below(56 * MIB),
    }
}

/// Random multi-stream workload with `record_stream`; after every step the
/// invariants hold, and memory used on a stream is never handed to another
/// before that stream's work completed.
fn random_workload(seed: u64, conf: &str, steps: usize) {
    let mut a = hbm(4 * GIB, conf);
    let mut random = Random(seed);
    let streams = [StreamId(0), StreamId(7), StreamId(9)];
    let mut live: Vec<(DevicePtr, u64, StreamId)> = Vec::new();
    // Per stream: ranges it may still touch (freed blocks it used), cleared
    // when the test completes the stream's work.
    let mut dirty: BTreeMap<StreamId, Vec<(DevicePtr, u64)>> = BTreeMap::new();
    let mut uses: BTreeMap<DevicePtr, Vec<StreamId>> = BTreeMap::new();
    for _ in 0..steps {
        let syncs_before = {
            let c = a.device().call_counts();
            c.get(CallKind::EventSynchronize) + c.get(CallKind::DeviceSynchronize)
        };
        match random.below(20) {
            0..=8 => {
                let size = mixed_size(&mut random);
                let stream = streams[random.below(3) as usize];
                let result = a.malloc(size, stream);
                let c = a.device().call_counts();
                if c.get(CallKind::EventSynchronize) + c.get(CallKind::DeviceSynchronize)
                    > syncs_before
                {
                    // The allocator waited for streams: what it waited for is
                    // no longer in flight.
                    dirty.clear();
                }
                match result {
                    Ok(ptr) => {
                        for (other, ranges) in &dirty {
                            if *other == stream {
                                continue;
                            }
                            for &(p, s) in ranges {
                                assert!(
                                    ptr + size <= p || p + s <= ptr,
                                    "{ptr:#x}+{size} on {stream:?} reuses memory {other:?} may still touch"
                                );
                            }
                        }
                        live.push((ptr, size, stream));
                    }
                    Err(AllocError::OutOfMemory(_)) => {}
                    Err(e) => panic!("{e}"),
                }
            }
            9..=15 if !live.is_empty() => {
                let (ptr, size, stream) =
                    live.swap_remove(random.below(live.len() as u64) as usize);
                a.free(ptr).unwrap();
                dirty.entry(stream).or_default().push((ptr, size));
                for s in uses.remove(&ptr).unwrap_or_default() {
                    dirty.entry(s).or_default().push((ptr, size));
                }
            }
            16 if !live.is_empty() => {
                let (ptr, _, _) = live[random.below(live.len() as u64) as usize];
                let stream = streams[random.below(3) as usize];
                a.record_stream(ptr, stream).unwrap();
                uses.entry(ptr).or_default().push(stream);
            }
            17 => {
                let stream = streams[random.below(3) as usize];
                a.device().complete_stream(stream);
                dirty.remove(&stream);
            }
            18 => {
                a.empty_cache().unwrap();
                dirty.clear();
            }
            _ => {}
        }
        check(&a);
        check_physical(&a, &live);
    }
    for (ptr, _, _) in live.drain(..) {
        a.free(ptr).unwrap();
    }
    a.device().complete_all();
    a.empty_cache().unwrap();
    check(&a);
    assert_eq!(
        a.device().used_bytes(),
        0,
        "everything returns to the device"
    );
    assert_eq!(a.stats().allocated_bytes[0].current, 0);
    assert_eq!(a.stats().active_bytes[0].current, 0);
    assert_eq!(a.stats().reserved_bytes[0].current, 0);
}

#[test]
fn random_multi_stream_workloads_keep_invariants() {
    for seed in [1, 2, 3] {
        random_workload(0x9E37_79B9_7F4A_7C15 ^ seed, "", 1500);
    }
}

#[test]
fn random_workloads_under_pressure_keep_invariants() {
    // Tight allowance: stealing happens constantly.
    random_workload(42, "max_waste_percent:0", 1500);
    // Memory limit: out-of-memory retries happen too.
    random_workload(43, "per_process_memory_fraction:0.2", 1500);
}

/// One synthetic training step: parameters stay, activations pile up in the
/// forward pass and are freed in reverse in the backward pass, gradients and
/// temporaries of many sizes come and go.
fn training_step(a: &mut Allocator<SimDevice>, random: &mut Random) {
    let stream = StreamId(0);
    let mut activations = Vec::new();
    for layer in 0..24u64 {
        let tmp = a.malloc(3 * MIB + layer * 4096, stream).unwrap();
        activations.push(a.malloc(8 * MIB + (layer % 5) * 1_000_000, stream).unwrap());
        activations.push(a.malloc(1 + random.below(200_000), stream).unwrap());
        a.free(tmp).unwrap();
    }
    let mut grads = Vec::new();
    while let Some(act) = activations.pop() {
        let tmp = a.malloc(5 * MIB + 777, stream).unwrap();
        a.free(act).unwrap();
        grads.push(a.malloc(700 * 1024, stream).unwrap());
        a.free(tmp).unwrap();
    }
    for g in grads {
        a.free(g).unwrap();
    }
}

/// On a real driver (whole-handle maps) the second step still moves a few
/// handles into place; on one that maps parts of handles the first step
/// leaves everything where the next needs it.
#[test]
fn repeating_training_step_makes_no_driver_calls_once_warm() {
    for (device, warm_after) in [
        (SimDevice::with_capacity(16 * GIB), 2),
        (part_maps(16 * GIB), 1),
    ] {
        let mut a = allocator(device, "hbm", "");
        let params: Vec<DevicePtr> = (0..10)
            .map(|i| a.malloc(20 * MIB + i * 512, StreamId(0)).unwrap())
            .collect();
        let mut calls_per_step = Vec::new();
        for step in 0..6 {
            // The same step each time (same sizes): reseed.
            let mut random = Random(1234);
            let before = a.device().call_counts();
            training_step(&mut a, &mut random);
            let calls = a.device().call_counts().since(&before).memory_calls();
            calls_per_step.push(calls);
            check(&a);
            if step >= warm_after {
                assert_eq!(
                    calls, 0,
                    "step {step} made driver calls: {calls_per_step:?}"
                );
            }
        }
        assert!(calls_per_step[0] > 0);
        for p in params {
            a.free(p).unwrap();
        }
        a.empty_cache().unwrap();
        assert_eq!(a.device().used_bytes(), 0);
    }
}

/// A workload that alternates between phases of small and large tensors of
/// mixed sizes: PyTorch's caching keeps both pools' memory, `hbm` reuses the
/// same granules.
fn phased_workload(a: &mut Allocator<SimDevice>) -> u64 {
    let mut random = Random(77);
    let mut peak_live = 0u64;
    let mut live_bytes = 0u64;
    let mut held: Vec<(DevicePtr, u64)> = Vec::new();
    for phase in 0..6 {
        let (low, span) = match phase % 3 {
            0 => (4096, 900 * 1024),
            1 => (3 * MIB, 9 * MIB),
            _ => (12 * MIB, 50 * MIB),
        };
        let mut phase_blocks = Vec::new();
        while live_bytes < 1536 * MIB {
            let size = low + random.below(span);
            let ptr = a.malloc(size, StreamId(0)).unwrap();
            live_bytes += size;
            peak_live = peak_live.max(live_bytes);
            phase_blocks.push((ptr, size));
            // Some churn inside the phase.
            if random.below(4) == 0 {
                let (p, s) =
                    phase_blocks.swap_remove(random.below(phase_blocks.len() as u64) as usize);
                a.free(p).unwrap();
                live_bytes -= s;
            }
        }
        // Keep a few long-lived tensors from each phase.
        for _ in 0..3 {
            if let Some(b) = phase_blocks.pop() {
                held.push(b);
            }
        }
        for (p, s) in phase_blocks {
            a.free(p).unwrap();
            live_bytes -= s;
        }
    }
    for (p, _) in held {
        a.free(p).unwrap();
    }
    peak_live
}

/// With handles of one granule, as the phases move memory between sizes
/// granule by granule. The default handles of 16 granules move whole only,
/// and each tensor kept from a phase pins its handle: 0.949 here (printed),
/// the price of 16 times fewer creates and maps (`docs/hbm-design.md`).
#[test]
fn reserved_tracks_live_where_pytorch_wastes() {
    let mut default_handles = hbm(16 * GIB, "");
    let peak_live = phased_workload(&mut default_handles);
    check(&default_handles);
    let default_peak = default_handles.device().peak_used_bytes();
    println!(
        "phased workload, default handles: efficiency {:.4}",
        peak_live as f64 / default_peak as f64
    );
    assert!(default_peak as f64 <= peak_live as f64 * 1.06);
    let mut ours = hbm(16 * GIB, "whole_handle_granules:1");
    assert_eq!(phased_workload(&mut ours), peak_live);
    check(&ours);
    let mut theirs = allocator(SimDevice::with_capacity(16 * GIB), "pytorch", "");
    assert_eq!(phased_workload(&mut theirs), peak_live);
    let ours_peak = ours.device().peak_used_bytes();
    let theirs_peak = theirs.device().peak_used_bytes();
    let ours_efficiency = peak_live as f64 / ours_peak as f64;
    let theirs_efficiency = peak_live as f64 / theirs_peak as f64;
    // The brief's goal is 2%: stitching idle granules under the next phase's
    // tensors keeps it under 2% here (efficiency 0.982, printed below); the
    // bound leaves a little room.
    assert!(
        ours_peak as f64 <= peak_live as f64 * 1.03,
        "hbm peak {ours_peak} vs live {peak_live} ({ours_efficiency:.4})"
    );
    println!(
        "phased workload: hbm efficiency {ours_efficiency:.4}, pytorch {theirs_efficiency:.4}"
    );
    assert!(ours_peak < theirs_peak);
    assert!(
        theirs_efficiency < 0.9,
        "pytorch should waste much more here: {theirs_efficiency:.4}"
    );
}

/// A heap that keeps growing (a first step, a longer sequence) maps ahead in
/// chunks of up to 12 MiB (4% of demand while demand is small): 143 creates
/// here (printed), 456 with `GROWTH_CHUNK_BYTES` set to 0, when mapping
/// ahead stayed within the allowance. The overshoot at the peak stays within
/// one chunk of the 1% allowance. With `max_waste_percent:0` nothing is
/// mapped ahead.
#[test]
fn a_growing_heap_maps_in_large_chunks() {
    let grow = |conf: &str| {
        let mut a = allocator(part_maps(16 * GIB), "hbm", conf);
        let blocks: Vec<DevicePtr> = (0..1024)
            .map(|_| a.malloc(MIB, StreamId(0)).unwrap())
            .collect();
        check(&a);
        let creates = a.device().call_counts().get(CallKind::PhysicalCreate);
        let reserved = a.device().used_bytes();
        for p in blocks {
            a.free(p).unwrap();
        }
        a.empty_cache().unwrap();
        assert_eq!(a.device().used_bytes(), 0);
        (creates, reserved)
    };
    let live = 1024 * MIB;
    let (creates, reserved) = grow("");
    let (tight_creates, tight_reserved) = grow("max_waste_percent:0");
    println!("growing to 1 GiB: {creates} creates, {reserved} bytes held");
    println!("max_waste_percent:0: {tight_creates} creates, {tight_reserved} bytes held");
    assert_eq!(
        tight_reserved, live,
        "max_waste_percent:0 maps nothing ahead"
    );
    assert_eq!(tight_creates, live / (2 * MIB));
    assert!(
        creates * 3 <= tight_creates,
        "{creates} creates for 512 granules"
    );
    assert!(
        reserved <= live + live / 100 + 12 * MIB,
        "held {reserved} for {live} live"
    );
}

/// On a driver that maps whole handles only, a handle holds at least 16
/// granules (1/2048 of the most memory held once that is more), so a
/// large heap is not built a granule per create and map; a fixed
/// `whole_handle_granules:1` is. Memory then moves in those larger handles
/// (stitched into a request of another size under a limit) without two live
/// blocks sharing a byte, and all of it goes back.
#[test]
fn on_a_whole_handle_driver_handles_grow_with_the_heap() {
    let build = |conf: &str| {
        let device = SimDevice::with_config(SimConfig {
            capacity_bytes: 13 * GIB,
            maps_handle_parts: false,
            ..SimConfig::default()
        });
        let mut a = allocator(device, "hbm", conf);
        // Nothing mapped ahead: every run is one block's 32 granules.
        let blocks: Vec<DevicePtr> = (0..192)
            .map(|_| a.malloc(64 * MIB, StreamId(0)).unwrap())
            .collect();
        check(&a);
        let creates = a.device().call_counts().get(CallKind::PhysicalCreate);
        (a, blocks, creates)
    };
    let (_, _, granule_handles) = build("max_waste_percent:0,whole_handle_granules:1");
    assert_eq!(granule_handles, 12 * GIB / (2 * MIB));
    let (mut a, blocks, creates) = build("max_waste_percent:0");
    // Each block's 32 granules in two handles of 16 (12 GiB held is 6,144
    // granules: 1/2048 of it is 3, under the floor).
    println!(
        "12 GiB in 64 MiB blocks: {creates} creates ({granule_handles} with one granule each)"
    );
    assert_eq!(creates, 192 * 2);
    // Every other block freed, then requests of another size under a 12 GiB
    // limit: what they need comes from the freed handles, moved whole.
    let mut live = Vec::new();
    for (i, p) in blocks.into_iter().enumerate() {
        if i % 2 == 0 {
            a.free(p).unwrap();
        } else {
            live.push((p, 64 * MIB, StreamId(0)));
        }
    }
    a.set_memory_fraction(12.0 / 13.0).unwrap();
    while let Ok(p) = a.malloc(96 * MIB, StreamId(0)) {
        live.push((p, 96 * MIB, StreamId(0)));
        check(&a);
    }
    check_physical(&a, &live);
    assert!(
        live.len() > 96 + 32,
        "{} blocks live: the freed handles were not reused",
        live.len()
    );
    for (p, _, _) in live {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    check(&a);
    assert_eq!(a.device().used_bytes(), 0);
}

/// Under `auto`, a run shorter than two handles of the size takes one
/// handle of its own length (a create and a map), not a full handle and a
/// short one; a longer run is cut into handles of the size. A fixed
/// `whole_handle_granules` is the size of every handle but a run's last.
#[test]
fn a_run_shorter_than_two_handles_takes_one() {
    let calls = |conf: &str, size: u64| {
        let mut a = hbm(4 * GIB, conf);
        let p = a.malloc(size, StreamId(0)).unwrap();
        check(&a);
        let counts = a.device().call_counts();
        let calls = (
            counts.get(CallKind::PhysicalCreate),
            counts.get(CallKind::Map),
        );
        a.free(p).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(a.device().used_bytes(), 0);
        calls
    };
    // Nothing mapped ahead: each run is one block's granules, and a heap
    // this small takes handles of 16.
    let exact = "max_waste_percent:0";
    assert_eq!(calls(exact, 40 * MIB), (1, 1), "20 granules");
    assert_eq!(calls(exact, 62 * MIB), (1, 1), "31 granules");
    assert_eq!(calls(exact, 64 * MIB), (2, 2), "32 granules: 16 + 16");
    assert_eq!(calls(exact, 80 * MIB), (3, 3), "40 granules: 16 + 16 + 8");
    let fixed = "max_waste_percent:0,whole_handle_granules:16";
    assert_eq!(calls(fixed, 40 * MIB), (2, 2), "20 granules: 16 + 4");
}

/// Where handles map whole only, a freed block's granules cannot move while
/// another block of their handle lives. Below the peak of demand, a request
/// that finds no place is served by the idle tail of one such handle and the
/// idle head of another, both mapped again side by side, instead of new
/// memory; where the two are too short together, new memory is created.
#[test]
fn idle_memory_pinned_in_handles_serves_a_request() {
    let run = |request: u64| {
        let s = StreamId(0);
        // Handles of 4 granules (8 MiB), nothing mapped ahead.
        let mut a = hbm(4 * GIB, "max_waste_percent:0,whole_handle_granules:4");
        let handles: Vec<DevicePtr> = (0..3).map(|_| a.malloc(8 * MIB, s).unwrap()).collect();
        // The first and last handle each get two blocks of 4 MiB.
        a.free(handles[0]).unwrap();
        let (head1, tail1) = (a.malloc(4 * MIB, s).unwrap(), a.malloc(4 * MIB, s).unwrap());
        a.free(handles[2]).unwrap();
        let (head3, tail3) = (a.malloc(4 * MIB, s).unwrap(), a.malloc(4 * MIB, s).unwrap());
        assert_eq!((tail1 - head1, tail3 - head3), (4 * MIB, 4 * MIB));
        // Idle: the first handle's tail and the last one's head, apart.
        a.free(tail1).unwrap();
        a.free(head3).unwrap();
        check(&a);
        let held = a.device().used_bytes();
        assert_eq!(held, 24 * MIB);
        let counts = a.device().call_counts();
        let (creates, maps) = (
            counts.get(CallKind::PhysicalCreate),
            counts.get(CallKind::Map),
        );
        let r = a.malloc(request, s).unwrap();
        check(&a);
        let mut live = vec![
            (head1, 4 * MIB, s),
            (handles[1], 8 * MIB, s),
            (tail3, 4 * MIB, s),
        ];
        live.push((r, request, s));
        check_physical(&a, &live);
        let counts = a.device().call_counts();
        let calls = (
            counts.get(CallKind::PhysicalCreate) - creates,
            counts.get(CallKind::Map) - maps,
        );
        let grown = a.device().used_bytes() - held;
        for (ptr, _, _) in live {
            a.free(ptr).unwrap();
            check(&a);
        }
        a.empty_cache().unwrap();
        assert_eq!(a.device().used_bytes(), 0);
        (grown, calls)
    };
    // Two idle granules in each: 8 MiB fits across them, two maps, no create.
    assert_eq!(run(8 * MIB), (0, (0, 2)));
    // 10 MiB does not: 5 granules are created (handles of 4 and 1).
    assert_eq!(run(10 * MIB), (10 * MIB, (2, 2)));
}

/// Memory mapped ahead of a growing heap is worth a new handle only: when
/// the device cannot create one, the block's own granules are backed by
/// idle memory at once. (Before, idle memory was aliased for the granules
/// ahead too, the backing failed, and the request went through an
/// out-of-memory retry: 1 retry and 2 map calls here instead of 0 and 1.)
#[test]
fn mapping_ahead_never_takes_idle_memory() {
    let probe = |capacity: u64| {
        let mut a = allocator(part_maps(capacity), "hbm", "");
        let big = a.malloc(300 * MIB, StreamId(0)).unwrap();
        let y = a.malloc(12 * MIB, StreamId(0)).unwrap();
        let z = a.malloc(8 * MIB, StreamId(0)).unwrap();
        let w = a.malloc(2 * MIB, StreamId(0)).unwrap();
        a.free(z).unwrap();
        let held = a.device().used_bytes();
        (a, held, [big, y, w])
    };
    let (_, held, _) = probe(16 * GIB);
    // The device is full: the granules under `z` lie idle, mapped.
    let (mut a, _, live) = probe(held);
    let maps = a.device().call_counts().get(CallKind::Map);
    let r = a.malloc(10 * MIB, StreamId(0)).unwrap();
    check(&a);
    let new_maps = a.device().call_counts().get(CallKind::Map) - maps;
    let retries = a.stats().num_alloc_retries;
    println!("held {held}, retries {retries}, maps {new_maps}");
    assert_eq!(retries, 0);
    // One alias of the idle granules, for the block's own granules only.
    assert_eq!(new_maps, 1);
    for p in live.into_iter().chain([r]) {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(a.device().used_bytes(), 0);
}

/// Where handles map whole, a growing heap maps ahead one handle at most:
/// each handle costs its own create, map and access grant whenever it is
/// made, so mapping more ahead saves no call and holds memory. On a 20 GiB
/// heap the chunk (half a percent of peak demand, 102 MiB) would be four
/// 16-granule handles; it is one of at most 31 granules instead.
#[test]
fn growth_maps_ahead_one_handle_at_most() {
    let mut a = hbm(64 * GIB, "");
    let big = a.malloc(20 * GIB, StreamId(0)).unwrap();
    let (held, creates) = (
        a.device().used_bytes(),
        a.device().call_counts().get(CallKind::PhysicalCreate),
    );
    let small = a.malloc(4 * MIB, StreamId(0)).unwrap();
    check(&a);
    let grown = a.device().used_bytes() - held;
    let new_creates = a.device().call_counts().get(CallKind::PhysicalCreate) - creates;
    println!("grown {} MiB in {new_creates} handles", grown / MIB);
    assert_eq!(new_creates, 1);
    assert!(grown > 4 * MIB && grown <= 62 * MIB, "grown {grown}");
    for p in [big, small] {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(a.device().used_bytes(), 0);
}

#[test]
fn runs_at_a_capacity_just_above_peak_live() {
    let mut probe = hbm(16 * GIB, "");
    let peak_live = phased_workload(&mut probe);
    // The goal is 1.03 (met on the real traces, see `hbmalloc compare`);
    // chunks pinned by long-lived tensors need a little more on this
    // adversarial workload (hbm never unmaps memory under a live tensor):
    // 4% with handles of one granule, 6% with the default 16-granule
    // handles, which each kept tensor pins whole.
    for (conf, margin) in [("whole_handle_granules:1", 1.04), ("", 1.06)] {
        let capacity = (peak_live as f64 * margin) as u64;
        let mut tight = hbm(capacity, conf);
        assert_eq!(phased_workload(&mut tight), peak_live);
        check(&tight);
    }
}

#[test]
fn create_and_map_failing_part_way_leak_nothing() {
    for (call, nth, error) in [
        (
            CallKind::PhysicalCreate,
            3,
            DeviceErrorKind::Driver("CUDA_ERROR_UNKNOWN".into()),
        ),
        (CallKind::PhysicalCreate, 2, DeviceErrorKind::OutOfMemory),
        (
            CallKind::Map,
            4,
            DeviceErrorKind::Driver("CUDA_ERROR_INVALID_VALUE".into()),
        ),
        (
            CallKind::SetAccess,
            1,
            DeviceErrorKind::Driver("CUDA_ERROR_INVALID_VALUE".into()),
        ),
        (
            CallKind::Unmap,
            1,
            DeviceErrorKind::Driver("CUDA_ERROR_INVALID_VALUE".into()),
        ),
        (CallKind::AddressReserve, 1, DeviceErrorKind::OutOfMemory),
    ] {
        let mut a = hbm(GIB, "max_waste_percent:0");
        let keep = a.malloc(30 * MIB, StreamId(0)).unwrap();
        let gone = a.malloc(30 * MIB, StreamId(0)).unwrap();
        a.free(gone).unwrap();
        a.device().inject(Fault {
            call,
            nth,
            error: error.clone(),
            sticky: false,
        });
        // Needs new granules (40 MiB > what is free), or a new stream's region.
        let result = a.malloc(40 * MIB, StreamId(0));
        let other = a.malloc(5 * MIB, StreamId(3));
        check(&a);
        a.device().clear_faults();
        for ptr in [result.ok(), other.ok(), Some(keep)].into_iter().flatten() {
            a.free(ptr).unwrap();
        }
        // After a failure, the allocator still works.
        let again = a.malloc(50 * MIB, StreamId(0)).unwrap();
        a.free(again).unwrap();
        a.empty_cache().unwrap();
        check(&a);
        assert_eq!(a.device().used_bytes(), 0, "{call:?} fault leaked memory");
    }
}

#[test]
fn out_of_memory_is_reported_and_judged() {
    let mut a = hbm(256 * MIB, "");
    let first = a.malloc(200 * MIB, StreamId(0)).unwrap();
    let Err(AllocError::OutOfMemory(report)) = a.malloc(100 * MIB, StreamId(0)) else {
        panic!("expected out of memory");
    };
    assert_eq!(report.verdict, OomVerdict::RealDemand);
    assert_eq!(report.allocated_bytes, 200 * MIB);
    check(&a);
    a.free(first).unwrap();
    // The freed granules are remapped for a bigger request on another stream.
    let second = a.malloc(250 * MIB, StreamId(5)).unwrap();
    check(&a);
    a.free(second).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.device().used_bytes(), 0);
}

/// A failed request leaves the device as it found it: memory mapped while
/// trying stays with the program's other users (cuDNN's and NCCL's own
/// `cudaMalloc`s), as PyTorch's allocator frees its cache on an OOM.
#[test]
fn a_failed_request_gives_back_what_it_mapped() {
    for (capacity, request) in [(GIB, 2 * GIB), (GIB, 1000 * MIB), (GIB, 1100 * MIB)] {
        let mut a = hbm(capacity, "");
        let kept = a.malloc(64 * MIB, StreamId(0)).unwrap();
        let cached = a.malloc(32 * MIB, StreamId(0)).unwrap();
        a.free(cached).unwrap();
        let before = a.device().used_bytes();
        assert!(matches!(
            a.malloc(request, StreamId(0)),
            Err(AllocError::OutOfMemory(_))
        ));
        check(&a);
        assert!(
            a.device().used_bytes() <= before,
            "a failed {} MiB request on a {} MiB device left {} MiB held (was {})",
            request / MIB,
            capacity / MIB,
            a.device().used_bytes() / MIB,
            before / MIB
        );
        a.free(kept).unwrap();
        check(&a);
    }
}

/// A request no device could hold fails without leaving a trace in later
/// decisions: idle memory is still stitched rather than new memory made, as
/// the same program does without it.
#[test]
fn an_impossible_request_changes_no_later_decision() {
    let run = |impossible: bool| {
        let mut a = hbm(GIB, "");
        let blocks: Vec<_> = (0..16)
            .map(|_| a.malloc(16 * MIB, StreamId(0)).unwrap())
            .collect();
        for p in blocks.iter().step_by(2) {
            a.free(*p).unwrap();
        }
        if impossible {
            assert!(matches!(
                a.malloc(4 * GIB, StreamId(0)),
                Err(AllocError::OutOfMemory(_))
            ));
        }
        let big = a.malloc(64 * MIB, StreamId(0)).unwrap();
        check(&a);
        let stats = a.stats();
        let figures = (
            stats.reserved_bytes[0].peak,
            stats.num_device_alloc,
            a.device().used_bytes(),
        );
        a.free(big).unwrap();
        figures
    };
    assert_eq!(run(true), run(false));
}

/// The refusal of a request no device holds stops at the device's size: a
/// request of all of it is served.
#[test]
fn a_request_of_the_whole_device_is_served() {
    let mut a = hbm(GIB, "");
    let whole = a.malloc(GIB, StreamId(0)).unwrap();
    check(&a);
    a.free(whole).unwrap();
    assert!(matches!(
        a.malloc(GIB + 512, StreamId(0)),
        Err(AllocError::OutOfMemory(_))
    ));
    check(&a);
}

#[test]
fn memory_fraction_is_a_hard_limit() {
    let mut a = hbm(GIB, "per_process_memory_fraction:0.25");
    let p = a.malloc(200 * MIB, StreamId(0)).unwrap();
    let Err(AllocError::OutOfMemory(report)) = a.malloc(100 * MIB, StreamId(0)) else {
        panic!("expected out of memory");
    };
    assert_eq!(report.verdict, OomVerdict::ConfiguredLimit);
    a.free(p).unwrap();
    check(&a);
}

#[test]
fn pending_frees_wait_for_their_streams() {
    let mut a = hbm(GIB, "");
    let p = a.malloc(10 * MIB, StreamId(1)).unwrap();
    a.record_stream(p, StreamId(2)).unwrap();
    a.free(p).unwrap();
    // Same size on the same stream: the block is pending, so it is not reused.
    let q = a.malloc(10 * MIB, StreamId(1)).unwrap();
    assert_ne!(p, q);
    a.device().complete_stream(StreamId(2));
    let r = a.malloc(10 * MIB, StreamId(1)).unwrap();
    assert_eq!(r, p, "reused once stream 2 finished");
    for x in [q, r] {
        a.free(x).unwrap();
    }
    assert!(matches!(a.free(q), Err(AllocError::UnknownPointer { .. })));
    check(&a);
}

#[test]
fn snapshot_reports_mapped_ranges_as_expandable_segments() {
    let mut a = hbm(GIB, "");
    let p = a.malloc(3 * MIB, StreamId(0)).unwrap();
    let q = a.malloc(1000, StreamId(0)).unwrap();
    let snapshot = a.snapshot();
    assert_eq!(snapshot.segments.len(), 1);
    let segment = &snapshot.segments[0];
    assert!(segment.expandable);
    assert_eq!(segment.total_size, 4 * MIB);
    assert_eq!(segment.allocated_size(), 3 * MIB + 1024);
    assert_eq!(segment.blocks.iter().map(|b| b.size).sum::<u64>(), 4 * MIB);
    assert_eq!(snapshot.settings, "policy:hbm");
    a.free(p).unwrap();
    a.free(q).unwrap();
}

/// Without virtual memory the memory fraction is a limit on segments, and a
/// segment that takes the memory held exactly to it is allowed.
#[test]
fn without_virtual_memory_a_segment_may_reach_the_fraction_exactly() {
    let mut a = allocator(
        without_virtual_memory(GIB),
        "hbm",
        "per_process_memory_fraction:0.25",
    );
    let first = a.malloc(128 * MIB, StreamId(0)).unwrap();
    let second = a.malloc(128 * MIB, StreamId(0)).unwrap();
    assert_eq!(a.device().used_bytes(), 256 * MIB);
    assert!(matches!(
        a.malloc(2 * MIB, StreamId(0)),
        Err(AllocError::OutOfMemory(_))
    ));
    for p in [first, second] {
        a.free(p).unwrap();
    }
    check(&a);
}

#[test]
fn without_virtual_memory_falls_back_to_segments() {
    let mut a = allocator(without_virtual_memory(GIB), "hbm", "");
    let mut random = Random(5);
    let mut live = Vec::new();
    for _ in 0..2000 {
        if random.below(2) == 0 || live.is_empty() {
            if let Ok(p) = a.malloc(mixed_size(&mut random) / 4, StreamId(random.below(2))) {
                live.push(p);
            }
        } else {
            let p = live.swap_remove(random.below(live.len() as u64) as usize);
            a.free(p).unwrap();
        }
        check(&a);
    }
    for p in live {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    check(&a);
    assert_eq!(a.device().used_bytes(), 0);
    assert_eq!(a.device().call_counts().get(CallKind::Map), 0);
}

/// A recorded segment of `(size, allocated)` blocks on stream 0, each
/// allocated block requested at its size.
fn segment_image(blocks: &[(u64, bool)]) -> SegmentImage {
    SegmentImage {
        stream: StreamId(0),
        small_pool: false,
        expandable: false,
        blocks: blocks
            .iter()
            .map(|&(size, allocated)| BlockImage {
                size,
                requested_size: if allocated { size } else { 0 },
                allocated,
            })
            .collect(),
    }
}

/// A recorded segment is memory the program held before the recording:
/// restored as one run, a create and a map for its ten blocks (one segment
/// without a virtual-memory API), as PyTorch restores it with one call,
/// not a heap grown block by block. Its blocks lie in it in order, and its
/// free block stays there. An empty segment calls nothing.
#[test]
fn a_restored_segment_is_backed_as_one_run() {
    let mut blocks = vec![(2 * MIB, true); 9];
    blocks.insert(4, (2 * MIB, false));
    let image = segment_image(&blocks);
    let one_run = [CallKind::PhysicalCreate, CallKind::Map];
    for (device, calls) in [
        (SimDevice::with_capacity(GIB), &one_run[..]),
        (without_virtual_memory(GIB), &[CallKind::SegmentAlloc][..]),
    ] {
        let mut a = allocator(device, "hbm", "");
        assert_eq!(a.restore_segment(&segment_image(&[])).unwrap(), vec![]);
        assert_eq!(a.device().call_counts().get(CallKind::AddressReserve), 0);
        let ptrs = a.restore_segment(&image).unwrap();
        check(&a);
        let counts = a.device().call_counts();
        for &kind in calls {
            assert_eq!(counts.get(kind), 1, "{kind:?}");
        }
        assert!(ptrs.windows(2).all(|w| w[1] == w[0] + 2 * MIB));
        assert_eq!(a.stats().reserved_bytes[0].current as u64, 20 * MIB);
        for (i, p) in ptrs.into_iter().enumerate() {
            if i != 4 {
                a.free(p).unwrap();
            }
        }
        a.empty_cache().unwrap();
        check(&a);
        assert_eq!(a.device().used_bytes(), 0);
    }
}

/// A segment larger than any request may be (a hostile snapshot's block of
/// 2^63 bytes, or blocks adding up past 2^64) is an invalid size under
/// either policy, refused before it is counted or backed.
#[test]
fn an_absurd_restored_segment_is_an_invalid_size() {
    for blocks in [
        vec![(MAX_REQUEST_BYTES + 512, true)],
        vec![(1 << 63, true)],
        vec![(1 << 63, false), (1 << 63, true)],
        vec![(u64::MAX - 511, true), (1024, false)],
    ] {
        for policy in ["hbm", "pytorch"] {
            let mut a = allocator(SimDevice::with_capacity(GIB), policy, "");
            let err = a.restore_segment(&segment_image(&blocks)).unwrap_err();
            assert!(
                matches!(err, AllocError::InvalidSize { .. }),
                "{policy} {blocks:?}: {err:?}"
            );
            check(&a);
            assert_eq!(a.device().used_bytes(), 0);
        }
    }
    // The bound itself is a size like any other (policy pytorch backs it
    // with one segment; `hbm` would map it handle by handle).
    let mut a = allocator(SimDevice::with_capacity(MAX_REQUEST_BYTES), "pytorch", "");
    let image = segment_image(&[(MAX_REQUEST_BYTES, true)]);
    assert_eq!(a.restore_segment(&image).unwrap().len(), 1);
    assert_eq!(a.device().used_bytes(), MAX_REQUEST_BYTES);
}

/// A snapshot's live block is restored at the size the program asked for
/// (hbm's rounding), not at PyTorch's block size, which includes the
/// remainder PyTorch left unsplit; cached free blocks keep their sizes.
#[test]
fn restored_blocks_take_what_the_program_requested() {
    let image = SegmentImage {
        stream: StreamId(0),
        small_pool: false,
        expandable: false,
        blocks: vec![
            BlockImage {
                size: 3 * MIB,
                requested_size: 2 * MIB + 1000,
                allocated: true,
            },
            BlockImage {
                size: 4 * MIB,
                requested_size: 0,
                allocated: false,
            },
        ],
    };
    let mut a = hbm(GIB, "");
    let ptrs = a.restore_segment(&image).unwrap();
    check(&a);
    let stats = a.stats();
    assert_eq!(stats.allocated_bytes[0].current as u64, 2 * MIB + 1024);
    assert_eq!(stats.requested_bytes[0].current as u64, 2 * MIB + 1000);
    // The free block was restored (then freed): its memory stays cached.
    assert!(stats.reserved_bytes[0].current as u64 >= 2 * MIB + 1024 + 4 * MIB);
    a.free(ptrs[0]).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.device().used_bytes(), 0);

    // Policy pytorch reproduces PyTorch's state: the recorded block size.
    let mut p = allocator(SimDevice::with_capacity(GIB), "pytorch", "");
    p.restore_segment(&image).unwrap();
    assert_eq!(p.stats().allocated_bytes[0].current as u64, 3 * MIB);
}

#[test]
fn hbm_is_the_default_policy() {
    assert_eq!(AllocatorConfig::default().policy.policy_name(), "hbm");
    assert!(PolicyConfig::parse("hbm", "bogus:1").is_err());
    assert!(PolicyConfig::parse("nope", "").is_err());
}

/// A key policy hbm does not take is named as the culprit, not its value,
/// and a policy pytorch key says so.
#[test]
fn an_unknown_hbm_key_is_named_as_the_culprit() {
    let error = PolicyConfig::from_settings("policy:hbm,expandable_segments:True").unwrap_err();
    assert_eq!(error.key, "expandable_segments");
    assert_eq!(error.value, "expandable_segments");
    let message = error.to_string();
    assert!(
        message.starts_with("hbm configuration: expandable_segments: expected a policy hbm key"),
        "{message}"
    );
    assert!(
        message.contains("got 'expandable_segments' (a policy pytorch key"),
        "{message}"
    );
    assert!(!message.contains("'True'"), "{message}");
    let bogus = PolicyConfig::parse("hbm", "bogus:1").unwrap_err();
    assert_eq!((bogus.key.as_str(), bogus.hint.as_deref()), ("bogus", None));
}

/// Below the peak of demand, idle memory is stitched in before a new handle
/// would take the memory held past its peak, when at least twice what is
/// needed lies idle. Here 200 holes of 4 MiB lie idle between live 512 KiB
/// blocks and an 8 MiB request fits none of them; creating 8 MiB would
/// still be within the 5% allowance (the code before created it). Handles
/// of one granule: a hole's granules then make whole handles of their own
/// (in the default 16-granule handles they share handles with live blocks,
/// and only whole handles move).
#[test]
fn idle_memory_is_stitched_before_the_peak_is_raised() {
    let mut a = hbm(16 * GIB, "max_waste_percent:5,whole_handle_granules:1");
    let mut holes = Vec::new();
    let mut live = Vec::new();
    for _ in 0..200 {
        holes.push(a.malloc(4 * MIB, StreamId(0)).unwrap());
        live.push(a.malloc(MIB / 2, StreamId(0)).unwrap());
    }
    // Use up whatever was mapped ahead of the heap's top.
    let mut tail = Vec::new();
    while a.device().used_bytes() > a.stats().allocated_bytes[0].current as u64 + 4 * MIB {
        tail.push(a.malloc(MIB, StreamId(0)).unwrap());
    }
    for p in holes {
        a.free(p).unwrap();
    }
    let held = a.device().used_bytes();
    let creates = a.device().call_counts().get(CallKind::PhysicalCreate);
    let maps = a.device().call_counts().get(CallKind::Map);
    let request = a.malloc(8 * MIB, StreamId(0)).unwrap();
    check(&a);
    let new_creates = a.device().call_counts().get(CallKind::PhysicalCreate) - creates;
    let new_maps = a.device().call_counts().get(CallKind::Map) - maps;
    println!(
        "held {held} -> {}, creates {new_creates}, maps {new_maps}",
        a.device().used_bytes()
    );
    assert_eq!(new_creates, 0);
    assert_eq!(a.device().used_bytes(), held, "the peak was raised");
    assert!(new_maps > 0);
    for p in live.into_iter().chain(tail).chain([request]) {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(a.device().used_bytes(), 0);
}

/// At a new peak of demand, memory lying idle and mapped once is moved to
/// where the request needs it (unmapped there, mapped here), not mapped here
/// as well: an alias would keep blocks out of the range it came from for as
/// long as the peak's block lives. Here a freed 100 MiB block lies idle in
/// handles of one granule, and a 104 MiB request that fits no free range
/// takes demand past its peak with no allowance left.
#[test]
fn idle_memory_moves_to_a_new_peak() {
    let mut a = hbm(16 * GIB, "max_waste_percent:0.5,whole_handle_granules:1");
    let first = a.malloc(100 * MIB, StreamId(0)).unwrap();
    let pin = a.malloc(MIB / 2, StreamId(0)).unwrap();
    a.free(first).unwrap();
    let held = a.device().used_bytes();
    let unmaps = a.device().call_counts().get(CallKind::Unmap);
    let peak = a.malloc(104 * MIB, StreamId(0)).unwrap();
    check(&a);
    let moved = a.device().call_counts().get(CallKind::Unmap) - unmaps;
    let grown = a.device().used_bytes() - held;
    println!("held {held}, moved {moved} granules, grown {grown}");
    assert_eq!(moved, 50, "the idle granules were not moved");
    assert!(grown <= 6 * MIB, "idle memory was not used");
    for p in [pin, peak] {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(a.device().used_bytes(), 0);
}

/// A request that best fit would place on unmapped memory goes where a block
/// of its size was just freed, if that place is free and mapped: no driver
/// call. Once the free is more than a few allocations old, best fit decides
/// (with `mapped_fit:0`: otherwise any mapped place that fits comes first,
/// see the next test).
#[test]
fn a_miss_reuses_the_place_a_block_of_its_size_was_just_freed() {
    // Nothing mapped ahead: every granule below is mapped for a block.
    let mut a = hbm(16 * GIB, "max_waste_percent:0,mapped_fit:0");
    let s = StreamId(0);
    let anchor = a.malloc(MIB, StreamId(1)).unwrap();
    let first = a.malloc(6 * MIB, s).unwrap();
    let pin = a.malloc(2 * MIB, s).unwrap();
    let freed = a.malloc(4 * MIB, s).unwrap();
    let beside = a.malloc(4 * MIB, s).unwrap();
    let top = a.malloc(2 * MIB, s).unwrap();
    assert_eq!(freed, first + 8 * MIB, "blocks are laid out in order");
    // A 6 MiB hole with nothing mapped under it ...
    a.free(first).unwrap();
    a.empty_cache().unwrap();
    // ... and a mapped 8 MiB free range where a 4 MiB block was just freed.
    a.free(beside).unwrap();
    a.free(freed).unwrap();
    check(&a);
    let maps = a.device().call_counts().get(CallKind::Map);
    let creates = a.device().call_counts().get(CallKind::PhysicalCreate);
    let again = a.malloc(4 * MIB, s).unwrap();
    check(&a);
    assert_eq!(
        again, freed,
        "best fit would take the unmapped hole at {first:#x}"
    );
    assert_eq!(a.device().call_counts().get(CallKind::Map), maps);
    assert_eq!(
        a.device().call_counts().get(CallKind::PhysicalCreate),
        creates
    );

    // Freed longer ago than a few allocations: best fit, into the hole. The
    // allocations come from the granule `anchor` lies on, on another
    // stream, so that they touch neither this stream's ranges nor the
    // device.
    a.free(again).unwrap();
    for _ in 0..10 {
        let p = a.malloc(MIB / 2, StreamId(1)).unwrap();
        a.free(p).unwrap();
    }
    assert_eq!(
        a.device().call_counts().get(CallKind::Map),
        maps,
        "the allocations in between mapped nothing"
    );
    let later = a.malloc(4 * MIB, s).unwrap();
    check(&a);
    assert_eq!(later, first, "a free ten allocations old is not reused");
    for p in [pin, top, later, anchor] {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(a.device().used_bytes(), 0);
}

/// A miss takes a free place whose granules are all mapped, in a range best
/// fit passed over, before mapping memory at best fit: a stitched view kept
/// mapped after its block is freed serves a later, smaller request whole
/// (as GMLake hands out its stitched blocks).
#[test]
fn a_miss_takes_a_mapped_place_best_fit_passed_over() {
    let s = StreamId(0);
    let layout = |conf: &str| {
        let mut a = hbm(16 * GIB, &format!("max_waste_percent:0,{conf}"));
        let pins: Vec<DevicePtr> = [8, 2, 20, 2]
            .iter()
            .map(|&m| a.malloc(m * MIB, s).unwrap())
            .collect();
        // An unmapped 8 MiB hole (best fit for 6 MiB) and a mapped 20 MiB one.
        a.free(pins[0]).unwrap();
        a.empty_cache().unwrap();
        a.free(pins[2]).unwrap();
        check(&a);
        let before = a.device().call_counts();
        let p = a.malloc(6 * MIB, s).unwrap();
        check(&a);
        let calls = a.device().call_counts().since(&before).memory_calls();
        (p, pins, calls)
    };
    let (p, pins, calls) = layout("");
    assert_eq!(p, pins[2], "the mapped hole, at its front");
    assert_eq!(calls, 0);
    let (p, pins, calls) = layout("mapped_fit:0");
    assert_eq!(p, pins[0], "best fit alone takes the unmapped hole");
    assert!(calls > 0);
}

/// Steps of variable length (the sizes of each step's activations scale
/// with a sequence length drawn per step): once a step of the longest length
/// has run, shorter steps find every block a mapped place, and make no
/// driver call; best fit alone keeps mapping memory for them. Under a
/// memory limit, so that memory is stitched (mapped at several views), not
/// only created; no two live blocks share memory throughout.
#[test]
fn variable_length_steps_map_nothing_once_the_longest_has_run() {
    let run = |conf: &str| {
        let device = SimDevice::with_config(SimConfig {
            capacity_bytes: 2 * GIB,
            ..SimConfig::default()
        });
        let mut a = allocator(device, "hbm", conf);
        let s = StreamId(0);
        let weights = a.malloc(100 * MIB, s).unwrap();
        let mut random = Random(77);
        let mut calls_after_warm_up = 0;
        for step in 0..40 {
            let length = if step == 0 { 64 } else { 16 + random.below(49) };
            let before = a.device().call_counts();
            let mut live = vec![(weights, 100 * MIB, s)];
            let mut activations = Vec::new();
            for layer in 0..12u64 {
                let tmp = a.malloc(length * 96 * 1024 + layer * 512, s).unwrap();
                let act = a.malloc(length * 160 * 1024, s).unwrap();
                live.push((act, length * 160 * 1024, s));
                activations.push(act);
                a.free(tmp).unwrap();
            }
            let logits = a.malloc(length * 1536 * 1024, s).unwrap();
            live.push((logits, length * 1536 * 1024, s));
            check(&a);
            check_physical(&a, &live);
            a.free(logits).unwrap();
            while let Some(act) = activations.pop() {
                let grad = a.malloc(length * 160 * 1024, s).unwrap();
                a.free(act).unwrap();
                a.free(grad).unwrap();
            }
            check(&a);
            if step > 0 {
                calls_after_warm_up += a.device().call_counts().since(&before).memory_calls();
            }
        }
        a.free(weights).unwrap();
        a.empty_cache().unwrap();
        check(&a);
        assert_eq!(a.device().used_bytes(), 0);
        calls_after_warm_up
    };
    let kept = run("");
    let best_fit_alone = run("mapped_fit:0");
    println!("driver calls after the longest step: {kept} (best fit alone: {best_fit_alone})");
    assert_eq!(kept, 0);
    assert!(best_fit_alone > 0);
}

/// Near the peak, a block of a size that has mostly been a temporary goes at
/// the end of the small hole best fit picks, so the front of the hole, next
/// to the live block before it, stays whole for longer-lived blocks.
#[test]
fn likely_temporaries_go_at_the_end_of_holes_near_the_peak() {
    let mut a = hbm(16 * GIB, "");
    let temporary = 3 * MIB / 4;
    // Six blocks of this size, each freed at once: temporaries.
    for _ in 0..6 {
        let t = a.malloc(temporary, StreamId(0)).unwrap();
        a.free(t).unwrap();
    }
    let before = a.malloc(10 * MIB, StreamId(0)).unwrap();
    let hole = a.malloc(2 * MIB, StreamId(0)).unwrap();
    let after = a.malloc(10 * MIB, StreamId(0)).unwrap();
    a.free(hole).unwrap();
    // Demand is 20 of its peak 22 MiB: near the peak.
    let t = a.malloc(temporary, StreamId(0)).unwrap();
    check(&a);
    assert_eq!(
        t,
        hole + 2 * MIB - temporary,
        "placed at {t:#x}, hole at {hole:#x}"
    );
    // The front of the hole takes a longer-lived block whole.
    let long_lived = a.malloc(5 * MIB / 4, StreamId(0)).unwrap();
    assert_eq!(long_lived, hole);
    // A size never seen freed goes at the front, as best fit says.
    a.free(long_lived).unwrap();
    let unknown = a.malloc(MIB / 2, StreamId(0)).unwrap();
    assert_eq!(unknown, hole);
    check(&a);
    for p in [before, after, t, unknown] {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(a.device().used_bytes(), 0);
}

/// At the top of a heap large enough to map whole growth chunks ahead, a
/// likely temporary goes at the end of the memory mapped ahead, so that the
/// longer-lived block after it takes the front; on a smaller heap (less
/// mapped ahead) it stays at the front.
#[test]
fn likely_temporaries_go_at_the_end_of_the_memory_mapped_ahead() {
    let temporary = 3 * MIB / 4;
    for (heap, at_the_end) in [(400 * MIB, true), (100 * MIB, false)] {
        let mut a = hbm(16 * GIB, "");
        let big = a.malloc(heap, StreamId(0)).unwrap();
        // Six blocks of this size, each freed at once: temporaries.
        for _ in 0..6 {
            let t = a.malloc(temporary, StreamId(0)).unwrap();
            a.free(t).unwrap();
        }
        let top = big + heap;
        let mapped_end = big + a.stats().reserved_bytes[0].current as u64;
        assert!(mapped_end >= top + 4 * temporary, "{heap}: {mapped_end:#x}");
        let t = a.malloc(temporary, StreamId(0)).unwrap();
        check(&a);
        let long_lived = a.malloc(5 * MIB / 4, StreamId(0)).unwrap();
        check(&a);
        if at_the_end {
            assert_eq!(t, mapped_end - temporary, "{heap}: top at {top:#x}");
            assert_eq!(long_lived, top, "{heap}");
        } else {
            assert_eq!(t, top, "{heap}");
            assert_eq!(long_lived, top + temporary, "{heap}");
        }
        for p in [big, t, long_lived] {
            a.free(p).unwrap();
        }
        a.empty_cache().unwrap();
        assert_eq!(a.device().used_bytes(), 0);
    }
}

/// Restoring a segment counts its extent as demand once, as allocating it
/// would: the next segment's blocks fill the memory cached in the one
/// before and grow the heap by what is left, without mapping ahead past
/// what the two hold.
#[test]
fn restored_segments_count_as_demand_once() {
    let mut a = hbm(GIB, "");
    a.restore_segment(&segment_image(&[(2 * MIB, true), (6 * MIB, false)]))
        .unwrap();
    a.restore_segment(&segment_image(&[(8 * MIB, true)]))
        .unwrap();
    check(&a);
    assert_eq!(a.stats().reserved_bytes[0].current as u64, 10 * MIB);
    let counts = a.device().call_counts();
    assert_eq!(
        [CallKind::PhysicalCreate, CallKind::Map].map(|kind| counts.get(kind)),
        [2, 2]
    );
}

/// On a device too large for any address space, every policy answers with an
/// error or an allocation; none overflows its arithmetic.
#[test]
fn an_absurdly_large_device_gets_errors_not_overflows() {
    for (policy, conf) in [
        ("hbm", ""),
        ("pytorch", ""),
        ("pytorch", "expandable_segments:True"),
    ] {
        let config = AllocatorConfig {
            policy: PolicyConfig::parse(policy, conf).unwrap(),
            history_entries: 0,
        };
        let mut a = Allocator::new(SimDevice::with_capacity(u64::MAX), config).unwrap();
        for size in [MIB, 100 * MIB] {
            if let Ok(ptr) = a.malloc(size, StreamId(0)) {
                a.free(ptr).unwrap();
            }
        }
        a.check_invariants().unwrap();
    }
}

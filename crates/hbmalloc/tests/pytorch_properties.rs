//! Property tests for policy `pytorch`: random sequences of malloc, free,
//! record_stream, stream completion and empty_cache on a small simulated
//! device (so the OOM and retry paths run), under the default configuration,
//! `expandable_segments:True` and `max_split_size_mb:40`. After every step
//! the engine's invariants hold, live allocations never overlap each other or
//! memory still in use by another stream, and reserved memory equals what the
//! device handed out; at the end everything returns to the device.

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};

use hbmalloc::{
    AllocError, Allocator, AllocatorConfig, CallKind, DeviceErrorKind, DevicePtr, Fault,
    PolicyConfig, PytorchConfig, SimDevice, StreamId,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestRunner};

const MIB: u64 = 1 << 20;
const STREAMS: u64 = 3;
const CAPACITY: u64 = 128 * MIB;

#[derive(Clone, Debug)]
enum Op {
    Malloc {
        size: u64,
        stream: u64,
    },
    Free {
        index: usize,
    },
    RecordStream {
        index: usize,
        stream: u64,
    },
    CompleteStream {
        stream: u64,
    },
    EmptyCache,
    /// Arms a driver failure (not out-of-memory) on the `nth` next call of a kind.
    Fault {
        kind: usize,
        nth: u64,
    },
}

/// Calls a fault may hit.
const FAULT_KINDS: [CallKind; 11] = [
    CallKind::SegmentAlloc,
    CallKind::SegmentFree,
    CallKind::AddressReserve,
    CallKind::AddressFree,
    CallKind::PhysicalCreate,
    CallKind::PhysicalRelease,
    CallKind::Map,
    CallKind::SetAccess,
    CallKind::Unmap,
    CallKind::EventRecord,
    CallKind::EventSynchronize,
];

fn size_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![
        6 => 1u64..=4096,
        3 => 4097u64..=MIB,
        2 => (MIB + 1)..=(10 * MIB),
        1 => (10 * MIB + 1)..=(64 * MIB),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    base_op_strategy()
}

fn op_strategy_with_faults() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => base_op_strategy(),
        1 => (0..FAULT_KINDS.len(), 1u64..=3).prop_map(|(kind, nth)| Op::Fault { kind, nth }),
    ]
}

fn base_op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (size_strategy(), 0..STREAMS).prop_map(|(size, stream)| Op::Malloc { size, stream }),
        6 => any::<usize>().prop_map(|index| Op::Free { index }),
        3 => (any::<usize>(), 0..STREAMS)
            .prop_map(|(index, stream)| Op::RecordStream { index, stream }),
        3 => (0..STREAMS).prop_map(|stream| Op::CompleteStream { stream }),
        1 => Just(Op::EmptyCache),
    ]
}

struct Live {
    end: DevicePtr,
    stream: u64,
    uses: BTreeSet<u64>,
}

/// A freed range that other streams may still be using.
struct Pending {
    start: DevicePtr,
    end: DevicePtr,
    streams: BTreeSet<u64>,
}

struct Model {
    live: BTreeMap<DevicePtr, Live>,
    pending: Vec<Pending>,
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

fn check_step(a: &Allocator<SimDevice>, what: &str) -> Result<(), TestCaseError> {
    a.check_invariants()
        .map_err(|e| TestCaseError::fail(format!("after {what}: {e}")))?;
    a.device()
        .check_invariants()
        .map_err(|e| TestCaseError::fail(format!("after {what}: {e}")))?;
    prop_assert_eq!(
        a.stats().reserved_bytes[0].current as u64,
        a.device().used_bytes(),
        "reserved vs device after {}",
        what
    );
    Ok(())
}

/// Calls that make every stream's past work complete.
fn sync_marks(a: &Allocator<SimDevice>) -> (i64, u64, u64) {
    let calls = a.device().call_counts();
    (
        a.stats().num_sync_all_streams,
        calls.get(CallKind::SegmentFree),
        calls.get(CallKind::DeviceSynchronize),
    )
}

/// What a run exercised, summed over cases, so a test can show that the
/// interesting paths ran.
#[derive(Default, Clone, Copy, Debug)]
struct Coverage {
    ooms: i64,
    retries: i64,
    device_frees: i64,
    pending_frees: u64,
}

fn run_ops(conf: &str, ops: &[Op], cov: &Cell<Coverage>) -> Result<(), TestCaseError> {
    let faults = ops.iter().any(|op| matches!(op, Op::Fault { .. }));
    let pytorch = PytorchConfig::parse(conf).expect("config");
    let config = AllocatorConfig {
        policy: PolicyConfig::Pytorch(pytorch.clone()),
        history_entries: 0,
    };
    let mut a = Allocator::new(SimDevice::with_capacity(CAPACITY), config).expect("allocator");
    let mut m = Model {
        live: BTreeMap::new(),
        pending: Vec::new(),
    };
    for (step, op) in ops.iter().enumerate() {
        let what = format!("step {step} {op:?}");
        let before = sync_marks(&a);
        match *op {
            Op::Malloc { size, stream } => match a.malloc(size, StreamId(stream)) {
                Ok(ptr) => {
                    if sync_marks(&a) != before {
                        // The allocator synchronized the device (OOM retry,
                        // cudaFree): pending uses are over.
                        m.pending.clear();
                    }
                    let range = (ptr, ptr + pytorch.round_size(size));
                    prop_assert_eq!(ptr % 512, 0);
                    for (&start, l) in &m.live {
                        prop_assert!(
                            !overlaps(range, (start, l.end)),
                            "{}: {:#x?} overlaps live {:#x?}",
                            what,
                            range,
                            (start, l.end)
                        );
                    }
                    // With injected faults a failed synchronization can
                    // legitimately complete some uses the model cannot see.
                    for p in m.pending.iter().filter(|_| !faults) {
                        prop_assert!(
                            !overlaps(range, (p.start, p.end)),
                            "{}: {:#x?} reuses memory still used by streams {:?}",
                            what,
                            range,
                            p.streams
                        );
                    }
                    m.live.insert(
                        ptr,
                        Live {
                            end: range.1,
                            stream,
                            uses: BTreeSet::new(),
                        },
                    );
                }
                Err(AllocError::OutOfMemory(_)) => {
                    if sync_marks(&a) != before {
                        m.pending.clear();
                    }
                }
                Err(AllocError::Device(_)) if faults => {}
                Err(e) => return Err(TestCaseError::fail(format!("{what}: {e}"))),
            },
            Op::Free { index } => {
                if m.live.is_empty() {
                    continue;
                }
                let ptr = *m.live.keys().nth(index % m.live.len()).expect("live");
                let l = m.live.remove(&ptr).expect("live");
                match a.free(ptr) {
                    Ok(()) => {}
                    Err(AllocError::Device(_)) if faults => {}
                    Err(e) => return Err(TestCaseError::fail(format!("{what}: {e}"))),
                }
                if !l.uses.is_empty() {
                    m.pending.push(Pending {
                        start: ptr,
                        end: l.end,
                        streams: l.uses,
                    });
                }
            }
            Op::RecordStream { index, stream } => {
                if m.live.is_empty() {
                    continue;
                }
                let ptr = *m.live.keys().nth(index % m.live.len()).expect("live");
                a.record_stream(ptr, StreamId(stream))
                    .map_err(|e| TestCaseError::fail(format!("{what}: {e}")))?;
                let l = m.live.get_mut(&ptr).expect("live");
                if stream != l.stream {
                    l.uses.insert(stream);
                }
            }
            Op::CompleteStream { stream } => {
                a.device().complete_stream(StreamId(stream));
                for p in &mut m.pending {
                    p.streams.remove(&stream);
                }
                m.pending.retain(|p| !p.streams.is_empty());
            }
            Op::EmptyCache => match a.empty_cache() {
                Ok(()) => m.pending.clear(),
                Err(AllocError::Device(_)) if faults => {}
                Err(e) => return Err(TestCaseError::fail(format!("{what}: {e}"))),
            },
            Op::Fault { kind, nth } => {
                a.device().clear_faults();
                a.device().inject(Fault {
                    call: FAULT_KINDS[kind],
                    nth,
                    error: DeviceErrorKind::Driver("CUDA_ERROR_UNKNOWN".into()),
                    sticky: false,
                });
            }
        }
        check_step(&a, &what)?;
        prop_assert_eq!(
            a.stats().allocation[0].current as usize,
            m.live.len(),
            "allocation count after {}",
            what
        );
    }
    let mut c = cov.get();
    c.ooms += a.stats().num_ooms;
    c.retries += a.stats().num_alloc_retries;
    c.device_frees += a.stats().num_device_free;
    c.pending_frees += a.device().call_counts().get(CallKind::EventRecord);
    cov.set(c);
    // Tear down: everything goes back to the device.
    a.device().clear_faults();
    let ptrs: Vec<DevicePtr> = m.live.keys().copied().collect();
    for ptr in ptrs {
        a.free(ptr)
            .map_err(|e| TestCaseError::fail(format!("final free: {e}")))?;
    }
    a.device().complete_all();
    a.empty_cache()
        .map_err(|e| TestCaseError::fail(format!("final empty_cache: {e}")))?;
    check_step(&a, "final empty_cache")?;
    let s = a.stats();
    prop_assert_eq!(s.reserved_bytes[0].current, 0);
    prop_assert_eq!(s.segment[0].current, 0);
    prop_assert_eq!(a.device().used_bytes(), 0);
    // An event whose synchronization failed (an injected fault) is never
    // retired: the Device trait has no way to destroy it.
    if !faults {
        prop_assert_eq!(a.device().pending_events(), 0);
    }
    prop_assert_eq!(s.allocation[0].current, 0);
    prop_assert_eq!(s.active[0].current, 0);
    prop_assert_eq!(s.active_bytes[0].current, 0);
    prop_assert_eq!(s.allocated_bytes[0].current, 0);
    prop_assert_eq!(s.requested_bytes[0].current, 0);
    prop_assert_eq!(s.inactive_split[0].current, 0);
    prop_assert_eq!(s.inactive_split_bytes[0].current, 0);
    prop_assert_eq!(s.oversize_allocations.current, 0);
    prop_assert_eq!(s.oversize_segments.current, 0);
    prop_assert!(a.snapshot().segments.is_empty());
    Ok(())
}

fn check_config(conf: &str, seed: u64) {
    check_config_with(conf, seed, op_strategy());
}

fn check_config_with(conf: &str, seed: u64, ops: impl Strategy<Value = Op>) {
    let config = Config {
        cases: 64,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let cov = Cell::new(Coverage::default());
    let result = runner.run(&prop::collection::vec(ops, 1..160), |ops| {
        run_ops(conf, &ops, &cov)
    });
    if let Err(e) = result {
        panic!("config {conf:?}: {e}");
    }
    // The sequences must reach the OOM, retry, release and cross-stream paths.
    let c = cov.get();
    eprintln!("config {conf:?}: {c:?}");
    assert!(c.ooms > 0 && c.retries > 0, "{c:?}");
    assert!(c.device_frees > 0 && c.pending_frees > 0, "{c:?}");
}

#[test]
fn random_sequences_default_config() {
    check_config("", 0x5eed_0001);
}

#[test]
fn random_sequences_expandable_segments() {
    check_config("expandable_segments:True", 0x5eed_0002);
}

#[test]
fn random_sequences_max_split_size() {
    check_config("max_split_size_mb:40", 0x5eed_0003);
}

#[test]
fn random_sequences_gc_with_fraction() {
    check_config(
        "garbage_collection_threshold:0.6,per_process_memory_fraction:0.8,max_split_size_mb:20",
        0x5eed_0004,
    );
}

#[test]
fn random_sequences_roundup_power2_divisions() {
    check_config("roundup_power2_divisions:[1:2,8:4,>:8]", 0x5eed_0005);
}

#[test]
fn random_sequences_with_driver_faults() {
    check_config_with("", 0x5eed_0006, op_strategy_with_faults());
}

#[test]
fn random_sequences_expandable_with_driver_faults() {
    check_config_with(
        "expandable_segments:True",
        0x5eed_0007,
        op_strategy_with_faults(),
    );
}

#[test]
fn random_sequences_max_split_size_with_driver_faults() {
    check_config_with(
        "max_split_size_mb:40,garbage_collection_threshold:0.5,per_process_memory_fraction:0.9",
        0x5eed_0008,
        op_strategy_with_faults(),
    );
}

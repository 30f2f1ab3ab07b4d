//! The written pickle loads back through hbmalloc-trace's safe unpickler as
//! a trace with the same segments, blocks and history.

use hbmalloc::{
    Allocator, AllocatorConfig, BlockState, PolicyConfig, SimDevice, Snapshot, StreamId,
};
use hbmalloc_export::{snapshot_to_pickle, stats_to_json};
use hbmalloc_trace::{InitialBlockState, Op};

const MIB: u64 = 1 << 20;

/// An allocator with live, freed and cached blocks in small and large pools
/// on two streams.
fn busy_allocator(settings: &str, history_entries: usize) -> Allocator<SimDevice> {
    let config = AllocatorConfig {
        policy: PolicyConfig::from_settings(settings).unwrap(),
        history_entries,
    };
    let mut alloc = Allocator::new(SimDevice::new(), config).unwrap();
    let a = alloc.malloc(1000, StreamId(0)).unwrap();
    let _b = alloc.malloc(3000, StreamId(0)).unwrap();
    let c = alloc.malloc(5 * MIB + 7, StreamId(0)).unwrap();
    let _d = alloc.malloc(30 * MIB, StreamId(7)).unwrap();
    alloc.free(a).unwrap();
    alloc.free(c).unwrap();
    alloc.check_invariants().unwrap();
    alloc
}

#[test]
fn snapshot_pickle_loads_back_with_the_same_segments() {
    let alloc = busy_allocator("policy:pytorch", 0);
    let snapshot = alloc.snapshot();
    assert!(snapshot.segments.len() >= 2);
    let trace = hbmalloc_trace::parse_bytes("x.pickle", &snapshot_to_pickle(&snapshot, 0)).unwrap();
    assert_eq!(trace.devices.len(), 1);
    let device = &trace.devices[0];
    assert_eq!(device.device, 0);
    assert!(device.ops.is_empty());
    assert_eq!(device.initial_segments.len(), snapshot.segments.len());
    for (loaded, written) in device.initial_segments.iter().zip(&snapshot.segments) {
        assert_eq!(loaded.address, written.address);
        assert_eq!(loaded.stream, written.stream.0);
        assert_eq!(loaded.small_pool, written.small_pool);
        assert_eq!(loaded.expandable, written.expandable);
        assert_eq!(loaded.blocks.len(), written.blocks.len());
        for (lb, wb) in loaded.blocks.iter().zip(&written.blocks) {
            assert_eq!(lb.size, wb.size);
            let live = wb.state != BlockState::Inactive;
            assert_eq!(matches!(lb.state, InitialBlockState::Allocated(_)), live);
            if live {
                assert_eq!(lb.requested_size, wb.requested_size);
            }
        }
    }
}

#[test]
fn history_loads_back_as_the_same_operations() {
    let alloc = busy_allocator("policy:pytorch,expandable_segments:True", 1000);
    let snapshot = alloc.snapshot();
    assert!(snapshot.segments.iter().all(|s| s.expandable));
    // Device 2: two empty trace lists come first, as PyTorch writes them.
    let trace = hbmalloc_trace::parse_bytes("x.pickle", &snapshot_to_pickle(&snapshot, 2)).unwrap();
    assert_eq!(trace.devices.len(), 1);
    let device = &trace.devices[0];
    assert_eq!(device.device, 2);
    // The history covers everything, so the window started empty.
    assert!(device.initial_segments.is_empty());
    let allocs = device
        .ops
        .iter()
        .filter(|op| matches!(op, Op::Alloc { .. }))
        .count();
    let frees = device
        .ops
        .iter()
        .filter(|op| matches!(op, Op::Free { .. }))
        .count();
    assert_eq!((allocs, frees), (4, 2));
    assert_eq!(
        device.recorded_config.as_deref(),
        Some("expandable_segments:True")
    );
    let recorded = device.recorded.as_ref().unwrap();
    assert!(!recorded.segment_events.is_empty());
}

#[test]
fn an_empty_snapshot_is_a_valid_pickle() {
    let bytes = snapshot_to_pickle(&Snapshot::default(), 0);
    let trace = hbmalloc_trace::parse_bytes("empty.pickle", &bytes).unwrap();
    assert!(trace.devices.iter().all(|d| d.ops.is_empty()));
}

#[test]
fn stats_json_has_every_pytorch_key() {
    let alloc = busy_allocator("policy:pytorch", 0);
    let json: serde_json::Value = serde_json::from_str(&stats_to_json(alloc.stats())).unwrap();
    let object = json.as_object().unwrap();
    assert_eq!(object.len(), alloc.stats().to_pytorch_map().len());
    assert_eq!(object["allocation.all.current"], 2);
    assert_eq!(object["segment.all.current"].as_i64(), Some(3));
    assert_eq!(object["max_split_size"], -1);
    assert_eq!(
        object["allocated_bytes.all.current"].as_i64().unwrap(),
        alloc.stats().to_pytorch_map()["allocated_bytes.all.current"]
    );
}

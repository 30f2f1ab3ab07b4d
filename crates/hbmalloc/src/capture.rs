//! CUDA graph capture: what the engine must not do while one is underway.
//!
//! While a stream of the device captures a CUDA graph (`torch.cuda.graph`,
//! `torch.compile(mode="reduce-overhead")`), CUDA's default capture mode
//! (global) refuses calls that wait or give memory back (event queries and
//! synchronizations, `cudaFree`, unmaps, releases), from any thread, and
//! invalidates the capture. An event recorded on a capturing stream becomes
//! a node of the graph, not a marker the allocator could wait for. So, like
//! PyTorch's allocator while its `captures_underway` is not empty, both
//! policies, while a capture is underway:
//!
//! - do not look at pending events (a block freed with uses on other
//!   streams stays unavailable until the capture ends);
//! - do not record the events of blocks freed with uses on other streams:
//!   they are recorded when the last capture ends;
//! - give no memory back on the out-of-memory retry (it fails sooner), and
//!   refuse `empty_cache`;
//! - still create and map new memory (the CUDA backend makes those calls in
//!   relaxed capture mode, as PyTorch does for `cudaMalloc`).
//!
//! - policy `hbm` stitches in, and places blocks on, only memory last used
//!   on the request's own stream (another's would mean waiting for that
//!   stream), and steals nothing; a chunk whose `set_access` fails stays
//!   mapped (no unmap) and gets access again before the next request is
//!   served.
//!
//! [`crate::adaptor::CaptureSafeDevice`] makes the rule hold on every path: it answers those
//! calls with [`DeviceErrorKind::CaptureUnderway`] instead of passing them to
//! the driver, so a path missed here would be a clear error for one request,
//! never a broken capture. The simulation tests (`simtest.rs`) begin and end
//! captures at random, with driver faults injected, and fail on any such
//! refusal and on any such call reaching the device.

use crate::device::CallKind;
use crate::error::AllocError;

/// The calls a capture forbids: they wait, or give memory back.
pub const FORBIDDEN_DURING_CAPTURE: [CallKind; 8] = [
    CallKind::SegmentFree,
    CallKind::AddressFree,
    CallKind::PhysicalRelease,
    CallKind::Unmap,
    CallKind::EventRecord,
    CallKind::EventQuery,
    CallKind::EventSynchronize,
    CallKind::DeviceSynchronize,
];

/// Records the events deferred during a capture, once it has ended: `record`
/// for each item, every item tried even after a failure (the failed one keeps
/// its uses and waits for the next synchronization); the first error.
pub(crate) fn record_deferred<T>(
    items: Vec<T>,
    mut record: impl FnMut(T) -> Result<(), AllocError>,
) -> Result<(), AllocError> {
    let mut first_error = Ok(());
    for item in items {
        let recorded = record(item);
        if first_error.is_ok() {
            first_error = recorded;
        }
    }
    first_error
}

#[cfg(test)]
mod tests {
    use crate::allocator::{Allocator, AllocatorConfig, PolicyConfig};
    use crate::device::{CallKind, DeviceErrorKind, StreamId};
    use crate::error::AllocError;
    use crate::sim::SimDevice;

    const MIB: u64 = 1 << 20;
    const POLICIES: [&str; 3] = [
        "policy:hbm",
        "policy:pytorch",
        "policy:pytorch,expandable_segments:True",
    ];

    fn allocator(settings: &str, device: SimDevice) -> Allocator<SimDevice> {
        let config = AllocatorConfig {
            policy: PolicyConfig::from_settings(settings).unwrap(),
            history_entries: 0,
        };
        Allocator::new(device, config).unwrap()
    }

    fn forbidden_calls(device: &SimDevice) -> u64 {
        let counts = device.call_counts();
        super::FORBIDDEN_DURING_CAPTURE
            .iter()
            .map(|&kind| counts.get(kind))
            .sum()
    }

    #[test]
    fn a_block_freed_during_a_capture_waits_for_its_events_until_the_capture_ends() {
        let (main, side) = (StreamId(1), StreamId(2));
        for settings in POLICIES {
            let mut a = allocator(settings, SimDevice::new());
            let p = a.malloc(8 * MIB, main).unwrap();
            a.record_stream(p, side).unwrap();
            // Work pending on the other stream before the capture.
            let use_of_p = a.device().enqueue_use(side, p, 8 * MIB);
            a.set_capture_underway(true).unwrap();
            let before = forbidden_calls(a.device());
            a.free(p).unwrap();
            // Not reusable: its use on `side` is covered by no event yet.
            let q = a.malloc(8 * MIB, main).unwrap();
            assert_ne!(p, q, "{settings}");
            assert!(matches!(
                a.empty_cache(),
                Err(AllocError::CaptureUnderway {
                    operation: "empty_cache"
                })
            ));
            assert_eq!(forbidden_calls(a.device()), before, "{settings}");
            assert_eq!(a.stats().allocated_bytes[0].current, 8 * MIB as i64);
            assert_eq!(a.stats().active_bytes[0].current, 16 * MIB as i64);
            a.check_invariants().unwrap();
            // The end records the deferred event; once it completes, p's
            // memory is reused.
            let records = a.device().call_counts().get(CallKind::EventRecord);
            a.set_capture_underway(false).unwrap();
            assert_eq!(
                a.device().call_counts().get(CallKind::EventRecord),
                records + 1,
                "{settings}"
            );
            a.device().complete_use(use_of_p);
            a.device().complete_all();
            let r = a.malloc(8 * MIB, main).unwrap();
            assert_eq!(r, p, "{settings}");
            assert!(a.device().take_violations().is_empty());
            for ptr in [q, r] {
                a.free(ptr).unwrap();
            }
            a.empty_cache().unwrap();
            assert_eq!(a.stats().reserved_bytes[0].current, 0, "{settings}");
            a.check_invariants().unwrap();
        }
    }

    #[test]
    fn out_of_memory_during_a_capture_gives_nothing_back_and_waits_for_nothing() {
        for settings in POLICIES {
            let mut a = allocator(settings, SimDevice::with_capacity(64 * MIB));
            // Cached, wholly free memory that the usual retry would give back.
            let cached: Vec<_> = (0..3)
                .map(|_| a.malloc(12 * MIB, StreamId(1)).unwrap())
                .collect();
            for &p in &cached {
                a.free(p).unwrap();
            }
            a.set_capture_underway(true).unwrap();
            let before = forbidden_calls(a.device());
            let err = a.malloc(40 * MIB, StreamId(2)).unwrap_err();
            assert!(
                matches!(err, AllocError::OutOfMemory(_)),
                "{settings}: {err}"
            );
            assert_eq!(forbidden_calls(a.device()), before, "{settings}");
            a.check_invariants().unwrap();
            // After the capture the same request succeeds.
            a.set_capture_underway(false).unwrap();
            let p = a.malloc(40 * MIB, StreamId(2)).unwrap();
            a.free(p).unwrap();
            a.check_invariants().unwrap();
        }
    }

    #[test]
    fn the_capture_safe_device_refuses_what_would_break_a_capture() {
        use crate::device::Device;
        let device = SimDevice::new();
        let safe = crate::adaptor::CaptureSafeDevice(&device);
        let ptr = safe.segment_alloc(2 * MIB).unwrap();
        let err = safe.segment_free(ptr, 2 * MIB).unwrap_err();
        assert_eq!(err.kind, DeviceErrorKind::CaptureUnderway);
        assert_eq!(err.call, CallKind::SegmentFree);
        assert!(err.to_string().contains("CUDA graph capture"), "{err}");
        assert!(safe.record_event(StreamId(1)).is_err());
        assert!(safe.synchronize_device().is_err());
        assert_eq!(forbidden_calls(&device), 0);
        device.segment_free(ptr, 2 * MIB).unwrap();
    }
}

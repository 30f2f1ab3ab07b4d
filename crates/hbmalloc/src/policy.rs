//! What a policy must do, and the state every policy keeps the same way.
//!
//! A policy decides where each request goes and when memory is got from or
//! given back to the driver, through the `&dyn Device` it is handed. It
//! keeps PyTorch's statistics and the history as it goes, honours the memory
//! fraction and a capture underway (see [`crate::capture`]), answers an
//! out-of-memory with `AllocError::OutOfMemory` and a judged report, and
//! decides the same way for the same calls.

use crate::device::{Device, DevicePtr, StreamId};
use crate::error::AllocError;
use crate::history::History;
use crate::snapshot::{SegmentImage, SegmentSnapshot};
use crate::stats::DeviceStats;

/// The contract between [`crate::Allocator`] and a policy.
pub(crate) trait Policy {
    /// Serves `size` bytes (at most `MAX_REQUEST_BYTES`, not 0) for `stream`.
    fn malloc(
        &mut self,
        dev: &dyn Device,
        size: u64,
        stream: StreamId,
    ) -> Result<DevicePtr, AllocError>;

    /// Takes back `ptr`; its memory is reused once its other streams are done.
    fn free(&mut self, dev: &dyn Device, ptr: DevicePtr) -> Result<(), AllocError>;

    /// The bytes of live allocation `ptr` (its block, rounded as served),
    /// or `None` for an address that is not one.
    fn live_size(&self, ptr: DevicePtr) -> Option<u64>;

    /// Notes that `ptr` is used on `stream` too.
    fn record_stream(&mut self, ptr: DevicePtr, stream: StreamId) -> Result<(), AllocError>;

    /// Gives every wholly free piece of memory back to the driver.
    fn empty_cache(&mut self, dev: &dyn Device) -> Result<(), AllocError>;

    /// Keeps to [`crate::capture`]'s rules from now on (`true`), or until
    /// the next capture, recording the events deferred meanwhile (`false`).
    fn set_capture_underway(&mut self, dev: &dyn Device, underway: bool) -> Result<(), AllocError>;

    /// Segments and blocks as they stand.
    fn snapshot(&self) -> Vec<SegmentSnapshot>;

    /// Recreates a segment as a recorded window began with it.
    fn restore_segment(
        &mut self,
        dev: &dyn Device,
        image: &SegmentImage,
    ) -> Result<Vec<DevicePtr>, AllocError>;

    /// Checks every invariant of the policy's state; the error names the one broken.
    fn check_invariants(&self) -> Result<(), String>;

    /// The state every policy keeps the same way.
    fn state(&self) -> &PolicyState;

    /// The state every policy keeps the same way, to change.
    fn state_mut(&mut self) -> &mut PolicyState;
}

/// Implements [`Policy`] for a policy type by its inherent methods of the
/// same names and its `state` field: each policy lays its methods out in
/// its own order (`pytorch` in PyTorch's), and this says which serve the
/// contract.
macro_rules! policy_by_inherent_methods {
    ($policy:ident) => {
        impl $crate::policy::Policy for $policy {
            #[inline]
            fn malloc(
                &mut self,
                dev: &dyn $crate::device::Device,
                size: u64,
                stream: $crate::device::StreamId,
            ) -> Result<$crate::device::DevicePtr, $crate::error::AllocError> {
                $policy::malloc(self, dev, size, stream)
            }

            #[inline]
            fn free(
                &mut self,
                dev: &dyn $crate::device::Device,
                ptr: $crate::device::DevicePtr,
            ) -> Result<(), $crate::error::AllocError> {
                $policy::free(self, dev, ptr)
            }

            #[inline]
            fn live_size(&self, ptr: $crate::device::DevicePtr) -> Option<u64> {
                $policy::live_size(self, ptr)
            }

            #[inline]
            fn record_stream(
                &mut self,
                ptr: $crate::device::DevicePtr,
                stream: $crate::device::StreamId,
            ) -> Result<(), $crate::error::AllocError> {
                $policy::record_stream(self, ptr, stream)
            }

            #[inline]
            fn empty_cache(
                &mut self,
                dev: &dyn $crate::device::Device,
            ) -> Result<(), $crate::error::AllocError> {
                $policy::empty_cache(self, dev)
            }

            #[inline]
            fn set_capture_underway(
                &mut self,
                dev: &dyn $crate::device::Device,
                underway: bool,
            ) -> Result<(), $crate::error::AllocError> {
                $policy::set_capture_underway(self, dev, underway)
            }

            #[inline]
            fn snapshot(&self) -> Vec<$crate::snapshot::SegmentSnapshot> {
                $policy::snapshot(self)
            }

            #[inline]
            fn restore_segment(
                &mut self,
                dev: &dyn $crate::device::Device,
                image: &$crate::snapshot::SegmentImage,
            ) -> Result<Vec<$crate::device::DevicePtr>, $crate::error::AllocError> {
                $policy::restore_segment(self, dev, image)
            }

            #[inline]
            fn check_invariants(&self) -> Result<(), String> {
                $policy::check_invariants(self)
            }

            #[inline]
            fn state(&self) -> &$crate::policy::PolicyState {
                &self.state
            }

            #[inline]
            fn state_mut(&mut self) -> &mut $crate::policy::PolicyState {
                &mut self.state
            }
        }
    };
}
pub(crate) use policy_by_inherent_methods;

/// The state both policies keep the same way: statistics, history, the
/// device's size, the memory fraction and the limit it sets, and whether a
/// capture is underway. Each lives here only.
#[derive(Debug)]
pub(crate) struct PolicyState {
    /// PyTorch's statistics.
    pub(crate) stats: DeviceStats,
    /// The trace entries kept for snapshots.
    pub(crate) history: History,
    /// The device's memory in bytes.
    pub(crate) device_total: u64,
    /// The share of the device's memory this policy may hold.
    pub(crate) memory_fraction: f64,
    /// That share in bytes, once a fraction was set (PyTorch's
    /// `allowed_memory_maximum`).
    pub(crate) limit_bytes: Option<u64>,
    /// A CUDA graph capture is underway on the device.
    pub(crate) capture_underway: bool,
}

impl PolicyState {
    /// The state of a policy that has not allocated, limited to
    /// `memory_fraction` of `device_total` when that is below 1.
    pub(crate) fn new(
        stats: DeviceStats,
        history: History,
        device_total: u64,
        memory_fraction: f64,
    ) -> Self {
        let mut state = PolicyState {
            stats,
            history,
            device_total,
            memory_fraction: 1.0,
            limit_bytes: None,
            capture_underway: false,
        };
        if memory_fraction < 1.0 {
            state.set_memory_fraction(memory_fraction);
        }
        state
    }

    /// Limits the memory held to `fraction` of the device's.
    pub(crate) fn set_memory_fraction(&mut self, fraction: f64) {
        self.memory_fraction = fraction;
        self.limit_bytes = Some((fraction * self.device_total as f64) as u64);
    }
}

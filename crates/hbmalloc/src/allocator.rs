//! `Allocator<D>`: the public face of the engine. It owns a [`Device`] and one
//! policy's state, and forwards each call to the policy chosen at creation.

use crate::adaptor::CaptureSafeDevice;
use crate::config::{ConfigError, PytorchConfig, MIN_BLOCK_SIZE};
use crate::device::{Device, DevicePtr, StreamId};
use crate::error::{AllocError, MAX_REQUEST_BYTES};
use crate::hbm::{HbmConfig, HbmPolicy};
use crate::history::History;
use crate::policy::{Policy, PolicyState};
use crate::pytorch::PytorchPolicy;
use crate::snapshot::{SegmentImage, Snapshot};
use crate::stats::DeviceStats;

/// Which policy decides where requests go, and its configuration.
// Built once per allocator: the size difference does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum PolicyConfig {
    /// PyTorch's native caching allocator, reproduced decision for decision.
    Pytorch(PytorchConfig),
    /// hbmalloc's own policy: granule remapping, reserved memory tracking live memory.
    Hbm(HbmConfig),
}

impl PolicyConfig {
    /// The statistics of an allocator of this configuration that has not
    /// allocated (all zeros but `max_split_size`): what to report for a
    /// device without creating an allocator, and its CUDA context, there.
    pub fn initial_stats(&self) -> DeviceStats {
        match self {
            PolicyConfig::Pytorch(c) => c.initial_stats(),
            PolicyConfig::Hbm(c) => c.initial_stats(),
        }
    }

    /// The configured share of the device's memory an allocator may hold
    /// (`per_process_memory_fraction`, 1 unless set).
    pub fn memory_fraction(&self) -> f64 {
        match self {
            PolicyConfig::Pytorch(c) => c.per_process_memory_fraction,
            PolicyConfig::Hbm(c) => c.per_process_memory_fraction,
        }
    }

    /// Parses a policy name (`pytorch` or `hbm`) and its configuration string.
    pub fn parse(policy: &str, conf: &str) -> Result<Self, ConfigError> {
        match policy {
            "pytorch" => Ok(PolicyConfig::Pytorch(PytorchConfig::parse(conf)?)),
            "hbm" => Ok(PolicyConfig::Hbm(
                HbmConfig::parse(conf).map_err(|e| e.in_source("hbm configuration"))?,
            )),
            other => Err(ConfigError::new("policy", other, "hbm or pytorch").in_source("settings")),
        }
    }

    /// Parses a settings string: `policy:NAME` anywhere among the keys picks
    /// the policy (default `hbm`, hbmalloc's own), the other keys configure it. This is the
    /// syntax of `HBMALLOC_CONF` and of [`Allocator::settings`].
    pub fn from_settings(settings: &str) -> Result<Self, ConfigError> {
        let mut policy = None;
        let mut rest = Vec::new();
        for part in settings.split(',') {
            match part.trim().split_once(':') {
                Some((key, value)) if key.trim() == "policy" => {
                    policy = Some(value.trim().to_string())
                }
                _ => rest.push(part),
            }
        }
        Self::parse(policy.as_deref().unwrap_or("hbm"), &rest.join(","))
    }

    /// The settings string that [`PolicyConfig::from_settings`] reads back.
    pub fn to_settings(&self) -> String {
        let conf = match self {
            PolicyConfig::Pytorch(c) => c.to_conf_string(),
            PolicyConfig::Hbm(c) => c.to_conf_string(),
        };
        if conf.is_empty() {
            format!("policy:{}", self.policy_name())
        } else {
            format!("policy:{},{conf}", self.policy_name())
        }
    }

    /// The policy's name.
    pub fn policy_name(&self) -> &'static str {
        match self {
            PolicyConfig::Pytorch(_) => "pytorch",
            PolicyConfig::Hbm(_) => "hbm",
        }
    }
}

/// How to build an [`Allocator`].
#[derive(Clone, Debug, PartialEq)]
pub struct AllocatorConfig {
    /// The policy and its settings.
    pub policy: PolicyConfig,
    /// History entries to keep for snapshots (0 disables recording).
    pub history_entries: usize,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            // hbm is hbmalloc's default policy; `pytorch` is there on request.
            policy: PolicyConfig::Hbm(HbmConfig::default()),
            history_entries: 0,
        }
    }
}

// One per allocator, and every call dispatches through it: boxing the
// larger policy would add a pointer chase to the hot path for nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum Engine {
    Pytorch(PytorchPolicy),
    Hbm(HbmPolicy),
}

impl Engine {
    /// The chosen policy, through its contract.
    #[inline]
    fn policy(&self) -> &dyn Policy {
        match self {
            Engine::Pytorch(p) => p,
            Engine::Hbm(p) => p,
        }
    }

    /// The chosen policy, through its contract, to change.
    #[inline]
    fn policy_mut(&mut self) -> &mut dyn Policy {
        match self {
            Engine::Pytorch(p) => p,
            Engine::Hbm(p) => p,
        }
    }

    // The hot path (malloc, free, and the state they and every replayed
    // operation read) is matched to the concrete policy: through `&dyn
    // Policy` each is an indirect call LLVM does not remove.

    #[inline]
    fn malloc(
        &mut self,
        dev: &dyn Device,
        size: u64,
        stream: StreamId,
    ) -> Result<DevicePtr, AllocError> {
        match self {
            Engine::Pytorch(p) => Policy::malloc(p, dev, size, stream),
            Engine::Hbm(p) => Policy::malloc(p, dev, size, stream),
        }
    }

    #[inline]
    fn free(&mut self, dev: &dyn Device, ptr: DevicePtr) -> Result<(), AllocError> {
        match self {
            Engine::Pytorch(p) => Policy::free(p, dev, ptr),
            Engine::Hbm(p) => Policy::free(p, dev, ptr),
        }
    }

    #[inline]
    fn state(&self) -> &PolicyState {
        match self {
            Engine::Pytorch(p) => p.state(),
            Engine::Hbm(p) => p.state(),
        }
    }
}

/// A caching allocator for one device.
#[derive(Debug)]
pub struct Allocator<D: Device> {
    device: D,
    engine: Engine,
    settings: String,
}

impl<D: Device> Allocator<D> {
    /// An allocator over `device`.
    pub fn new(device: D, config: AllocatorConfig) -> Result<Self, AllocError> {
        let total = device.memory_info()?.total_bytes;
        let history = History::with_capacity(config.history_entries);
        let settings = config.policy.to_settings();
        let engine = match config.policy {
            PolicyConfig::Pytorch(c) => Engine::Pytorch(PytorchPolicy::new(c, total, history)),
            PolicyConfig::Hbm(c) => Engine::Hbm(HbmPolicy::new(
                c,
                total,
                device.granularity(),
                device.maps_handle_parts(),
                history,
            )),
        };
        Ok(Allocator {
            device,
            engine,
            settings,
        })
    }

    /// Tells the allocator that a CUDA graph capture began on the device
    /// (`true`) or that the last one ended (`false`); see [`crate::capture`]
    /// for what changes meanwhile. At the end, the events of blocks freed
    /// during the capture with uses on other streams are recorded; an error
    /// says one could not be (that block then waits for the next
    /// synchronization).
    pub fn set_capture_underway(&mut self, underway: bool) -> Result<(), AllocError> {
        let dev: &dyn Device = &self.device;
        self.engine.policy_mut().set_capture_underway(dev, underway)
    }

    /// Whether a CUDA graph capture is underway (as last set).
    #[inline]
    fn capture_underway(&self) -> bool {
        self.engine.state().capture_underway
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// Allocates `size` bytes for use on `stream`.
    #[inline]
    pub fn malloc(&mut self, size: u64, stream: StreamId) -> Result<DevicePtr, AllocError> {
        if size == 0 || size > MAX_REQUEST_BYTES {
            return Err(AllocError::InvalidSize { size });
        }
        if self.capture_underway() {
            return self.malloc_during_capture(size, stream);
        }
        let dev: &dyn Device = &self.device;
        self.engine.malloc(dev, size, stream)
    }

    #[cold]
    fn malloc_during_capture(
        &mut self,
        size: u64,
        stream: StreamId,
    ) -> Result<DevicePtr, AllocError> {
        let dev = CaptureSafeDevice(&self.device);
        self.engine.malloc(&dev, size, stream)
    }

    /// Frees `ptr`. Its memory is reused once every stream recorded with
    /// [`Allocator::record_stream`] has finished with it.
    #[inline]
    pub fn free(&mut self, ptr: DevicePtr) -> Result<(), AllocError> {
        if self.capture_underway() {
            return self.free_during_capture(ptr);
        }
        let dev: &dyn Device = &self.device;
        self.engine.free(dev, ptr)
    }

    #[cold]
    fn free_during_capture(&mut self, ptr: DevicePtr) -> Result<(), AllocError> {
        let dev = CaptureSafeDevice(&self.device);
        self.engine.free(&dev, ptr)
    }

    /// The bytes of live allocation `ptr` as served (its block, rounded);
    /// `UnknownPointer` for an address that is not a live allocation. What
    /// sharing an allocation with another process needs to know of it.
    pub fn allocation_size(&self, ptr: DevicePtr) -> Result<u64, AllocError> {
        self.engine
            .policy()
            .live_size(ptr)
            .ok_or(AllocError::UnknownPointer { ptr })
    }

    /// Declares that `ptr` is used on `stream` as well as its own.
    pub fn record_stream(&mut self, ptr: DevicePtr, stream: StreamId) -> Result<(), AllocError> {
        self.engine.policy_mut().record_stream(ptr, stream)
    }

    /// Returns every wholly free cached segment (or page) to the driver.
    /// Refused while a CUDA graph capture is underway.
    pub fn empty_cache(&mut self) -> Result<(), AllocError> {
        if self.capture_underway() {
            return Err(AllocError::CaptureUnderway {
                operation: "empty_cache",
            });
        }
        let dev: &dyn Device = &self.device;
        self.engine.policy_mut().empty_cache(dev)
    }

    /// Limits this allocator to `fraction` of the device's memory.
    pub fn set_memory_fraction(&mut self, fraction: f64) -> Result<(), AllocError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(AllocError::InvalidConfig(format!(
                "memory fraction {fraction} is not between 0 and 1"
            )));
        }
        self.engine
            .policy_mut()
            .state_mut()
            .set_memory_fraction(fraction);
        Ok(())
    }

    /// The share of the device's memory this allocator may hold (1 unless
    /// configured or set: `get_per_process_memory_fraction()`).
    pub fn memory_fraction(&self) -> f64 {
        self.engine.state().memory_fraction
    }

    /// PyTorch-compatible statistics.
    pub fn stats(&self) -> &DeviceStats {
        &self.engine.state().stats
    }

    /// `reset_peak_memory_stats()`: every peak becomes the current value.
    pub fn reset_peak_stats(&mut self) {
        self.engine.policy_mut().state_mut().stats.reset_peak()
    }

    /// `reset_accumulated_memory_stats()`.
    pub fn reset_accumulated_stats(&mut self) {
        self.engine
            .policy_mut()
            .state_mut()
            .stats
            .reset_accumulated()
    }

    /// The history ring buffer.
    pub fn history(&self) -> &History {
        &self.engine.state().history
    }

    /// Keeps the last `entries` history entries from now on (0 stops
    /// recording); `clear` drops those kept. See [`History::set_capacity`].
    pub fn set_history_entries(&mut self, entries: usize, clear: bool) {
        self.engine
            .policy_mut()
            .state_mut()
            .history
            .set_capacity(entries, clear)
    }

    /// Numbers history entries from `clock`, shared with other engines (see
    /// [`History::share_clock`]).
    pub fn share_history_clock(&mut self, clock: std::sync::Arc<std::sync::atomic::AtomicU64>) {
        self.engine
            .policy_mut()
            .state_mut()
            .history
            .share_clock(clock)
    }

    /// Segments, blocks, history and settings.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            segments: self.engine.policy().snapshot(),
            history: self.history().entries().copied().collect(),
            settings: self.settings(),
        }
    }

    /// The size of the largest free block in the cache: memory held, in one
    /// piece, that no allocation uses (PyTorch's `cacheInfo`). Policy `hbm`
    /// can serve a larger request without new memory, by stitching idle
    /// granules of several free blocks together.
    pub fn largest_free_block_bytes(&self) -> u64 {
        crate::snapshot::largest_free_block(&self.engine.policy().snapshot())
    }

    /// The policy and configuration as one string (`policy:pytorch,expandable_segments:True`).
    pub fn settings(&self) -> String {
        self.settings.clone()
    }

    /// Recreates a segment as it stood at a recorded window's start; returns
    /// the address of each of its blocks.
    pub fn restore_segment(&mut self, image: &SegmentImage) -> Result<Vec<DevicePtr>, AllocError> {
        // No segment is larger than a request may be: a bigger one (a hostile
        // snapshot's, its blocks maybe past 2^64) is refused before a policy
        // counts or backs it.
        let total = image
            .blocks
            .iter()
            .try_fold(0u64, |sum, b| sum.checked_add(b.size));
        if total.is_none_or(|total| total > MAX_REQUEST_BYTES) {
            return Err(AllocError::InvalidSize {
                size: total.unwrap_or(u64::MAX),
            });
        }
        // Both policies lay blocks out in multiples of PyTorch's block size.
        if let Some(bad) = image
            .blocks
            .iter()
            .find(|b| b.size == 0 || b.size % MIN_BLOCK_SIZE != 0)
        {
            return Err(AllocError::InvalidSize { size: bad.size });
        }
        let dev: &dyn Device = &self.device;
        self.engine.policy_mut().restore_segment(dev, image)
    }

    /// Checks the policy's invariants (`ARCHITECTURE.md`); the error says which one broke.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.engine.policy().check_invariants()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::SimDevice;

    fn allocator(settings: &str) -> Allocator<SimDevice> {
        let config = AllocatorConfig {
            policy: PolicyConfig::from_settings(settings).unwrap(),
            history_entries: 0,
        };
        Allocator::new(SimDevice::with_capacity(1 << 30), config).unwrap()
    }

    /// What the C ABI reports for a device it has built no allocator for
    /// yet is what an allocator of the same configuration reports at birth.
    #[test]
    fn a_configuration_reports_what_its_new_allocator_does() {
        for settings in [
            "policy:pytorch",
            "policy:pytorch,max_split_size_mb:64,per_process_memory_fraction:0.25",
            "policy:hbm",
            "policy:hbm,per_process_memory_fraction:0.5",
        ] {
            let policy = PolicyConfig::from_settings(settings).unwrap();
            let allocator = allocator(settings);
            assert_eq!(&policy.initial_stats(), allocator.stats(), "{settings}");
            assert_eq!(
                policy.memory_fraction(),
                allocator.memory_fraction(),
                "{settings}"
            );
        }
        let split = PolicyConfig::from_settings("policy:pytorch,max_split_size_mb:64").unwrap();
        assert_eq!(split.initial_stats().max_split_size, 64 << 20);
        let limited = PolicyConfig::from_settings("policy:hbm,per_process_memory_fraction:0.5");
        assert_eq!(limited.unwrap().memory_fraction(), 0.5);
    }

    /// The largest request is refused as out of memory on this device, one
    /// byte more as a size no program means.
    #[test]
    fn sizes_past_the_largest_request_are_invalid() {
        for settings in ["policy:pytorch", "policy:hbm"] {
            let mut a = allocator(settings);
            let s = StreamId(0);
            assert!(matches!(
                a.malloc(0, s),
                Err(AllocError::InvalidSize { .. })
            ));
            let too_large = a.malloc(MAX_REQUEST_BYTES + 1, s);
            assert!(matches!(too_large, Err(AllocError::InvalidSize { .. })));
            let largest = a.malloc(MAX_REQUEST_BYTES, s);
            assert!(
                matches!(largest, Err(AllocError::OutOfMemory(_))),
                "{settings}"
            );
        }
    }

    /// `reset_peak_memory_stats()` brings every peak down to the current value.
    #[test]
    fn resetting_peaks_brings_them_to_the_current_values() {
        for settings in ["policy:pytorch", "policy:hbm"] {
            let mut a = allocator(settings);
            let ptr = a.malloc(8 << 20, StreamId(0)).unwrap();
            a.free(ptr).unwrap();
            let active = a.stats().active_bytes[0];
            assert!(active.peak > active.current, "{settings}");
            a.reset_peak_stats();
            let active = a.stats().active_bytes[0];
            assert_eq!(active.peak, active.current, "{settings}");
        }
    }
}

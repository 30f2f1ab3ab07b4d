//! One fixed sequence of `Device` calls and what it observed, so that any two
//! devices can be compared: `SimDevice` against `CudaDevice` on the driver
//! test double in tests, and `CudaDevice` on a real GPU in the
//! `driver_check` example.
//!
//! The observations are the ones every faithful device must agree on; they
//! avoid exact addresses and exact free-memory numbers, which differ.
#![forbid(unsafe_code)]

use hbmalloc::{Device, DeviceResult, StreamId};

/// What [`exercise_device`] observed. Every `bool` is `true` on a device
/// that behaves as the `Device` trait documents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExerciseReport {
    /// What `Device::granularity` said.
    pub granularity: Option<u64>,
    /// `memory_info` reports `free <= total` and a non-zero total.
    pub memory_info_sane: bool,
    /// A segment is non-null and 256-byte aligned.
    pub segment_aligned: bool,
    /// Free memory dropped by at least the segment's size while it was held.
    pub segment_reduced_free: bool,
    /// Free memory came back after the segment was freed.
    pub segment_free_restored: bool,
    /// Asking for twice the device's total memory fails with out-of-memory.
    pub oversized_alloc_out_of_memory: bool,
    /// Freeing an address that is no segment fails.
    pub bogus_free_rejected: bool,
    /// A reserved range starts on a granule boundary (true without VMM).
    pub reserve_aligned: bool,
    /// Physical memory counts against free memory (true without VMM).
    pub physical_reduced_free: bool,
    /// Mapping over an existing mapping fails (true without VMM).
    pub overlapping_map_rejected: bool,
    /// Unmapping part of a mapping fails (true without VMM).
    pub partial_unmap_rejected: bool,
    /// What `Device::maps_handle_parts` said.
    pub maps_handle_parts: bool,
    /// Where the device says it maps part of a handle, the second granule
    /// of a two-granule handle maps on its own, beside the whole handle
    /// mapped elsewhere (true where it says it does not, or without VMM).
    pub handle_part_mapped: bool,
    /// Map, set access, unmap, release and address free all succeeded, and
    /// free memory came back (true without VMM).
    pub vmm_round_trip: bool,
    /// An event recorded then synchronized is done.
    pub event_synchronized: bool,
    /// After a device synchronization, a recorded event queries as done.
    pub event_done_after_device_sync: bool,
    /// Querying a retired event fails.
    pub retired_event_rejected: bool,
}

impl ExerciseReport {
    /// The names of the observations that did not hold (empty when all did).
    pub fn failures(&self) -> Vec<&'static str> {
        let checks = [
            ("memory_info_sane", self.memory_info_sane),
            ("segment_aligned", self.segment_aligned),
            ("segment_reduced_free", self.segment_reduced_free),
            ("segment_free_restored", self.segment_free_restored),
            (
                "oversized_alloc_out_of_memory",
                self.oversized_alloc_out_of_memory,
            ),
            ("bogus_free_rejected", self.bogus_free_rejected),
            ("reserve_aligned", self.reserve_aligned),
            ("physical_reduced_free", self.physical_reduced_free),
            ("overlapping_map_rejected", self.overlapping_map_rejected),
            ("partial_unmap_rejected", self.partial_unmap_rejected),
            ("handle_part_mapped", self.handle_part_mapped),
            ("vmm_round_trip", self.vmm_round_trip),
            ("event_synchronized", self.event_synchronized),
            (
                "event_done_after_device_sync",
                self.event_done_after_device_sync,
            ),
            ("retired_event_rejected", self.retired_event_rejected),
        ];
        checks
            .into_iter()
            .filter(|(_, ok)| !ok)
            .map(|(name, _)| name)
            .collect()
    }
}

/// Runs the fixed sequence on `device` and reports what it saw. An
/// unexpected driver error (one the sequence does not provoke on purpose)
/// stops it and is returned. Everything it allocates is freed again.
pub fn exercise_device(device: &dyn Device) -> DeviceResult<ExerciseReport> {
    const SEGMENT: u64 = 4 << 20;
    let before = device.memory_info()?;

    let segment = device.segment_alloc(SEGMENT)?;
    let holding = device.memory_info()?;
    device.segment_free(segment, SEGMENT)?;
    let after = device.memory_info()?;

    let oversized = device.segment_alloc(before.total_bytes.saturating_mul(2));
    let oversized_alloc_out_of_memory = match oversized {
        Err(e) => e.is_out_of_memory(),
        Ok(ptr) => {
            device.segment_free(ptr, before.total_bytes.saturating_mul(2))?;
            false
        }
    };
    // Far from any allocation on the simulated device, the double and real
    // GPUs' address spaces alike.
    let bogus_free_rejected = device.segment_free(0x10, 256).is_err();

    let mut report = ExerciseReport {
        granularity: device.granularity(),
        memory_info_sane: before.total_bytes > 0 && before.free_bytes <= before.total_bytes,
        segment_aligned: segment != 0 && segment % 256 == 0,
        segment_reduced_free: holding.free_bytes + SEGMENT <= before.free_bytes,
        segment_free_restored: after.free_bytes >= holding.free_bytes + SEGMENT,
        oversized_alloc_out_of_memory,
        bogus_free_rejected,
        reserve_aligned: true,
        physical_reduced_free: true,
        overlapping_map_rejected: true,
        partial_unmap_rejected: true,
        maps_handle_parts: device.maps_handle_parts(),
        handle_part_mapped: true,
        vmm_round_trip: true,
        event_synchronized: false,
        event_done_after_device_sync: false,
        retired_event_rejected: false,
    };

    if let Some(g) = device.granularity() {
        let start = device.memory_info()?;
        let base = device.address_reserve(4 * g)?;
        report.reserve_aligned = base % g == 0;
        let big = device.physical_create(2 * g)?;
        let small = device.physical_create(g)?;
        report.physical_reduced_free = device.memory_info()?.free_bytes + 3 * g <= start.free_bytes;
        device.map(base, 2 * g, big, 0)?;
        device.set_access(base, 2 * g)?;
        report.overlapping_map_rejected = device.map(base + g, g, small, 0).is_err();
        device.map(base + 2 * g, g, small, 0)?;
        device.set_access(base + 2 * g, g)?;
        report.partial_unmap_rejected = device.unmap(base, g).is_err();
        if report.maps_handle_parts {
            // Granule 3 of the range is free: the second half of `big`
            // again, as policy `hbm` stitches memory.
            report.handle_part_mapped = device.map(base + 3 * g, g, big, g).is_ok();
            if report.handle_part_mapped {
                device.unmap(base + 3 * g, g)?;
            }
        }
        device.unmap(base, 2 * g)?;
        device.unmap(base + 2 * g, g)?;
        device.physical_release(big)?;
        device.physical_release(small)?;
        device.address_free(base, 4 * g)?;
        report.vmm_round_trip = device.memory_info()?.free_bytes >= start.free_bytes;
    }

    let first = device.record_event(StreamId(0))?;
    device.synchronize_event(first)?;
    report.event_synchronized = true;
    let second = device.record_event(StreamId(0))?;
    device.synchronize_device()?;
    report.event_done_after_device_sync = device.query_event(second)?;
    report.retired_event_rejected = device.query_event(second).is_err();
    Ok(report)
}

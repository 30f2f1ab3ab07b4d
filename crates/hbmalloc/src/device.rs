//! The `Device` trait: the only door from the engine to a driver.
//!
//! Everything the allocator needs from a GPU driver is here and nothing more:
//! whole-segment allocation (`cudaMalloc`/`cudaFree`), the virtual-memory API
//! (reserve an address range, create physical memory, map, set access, unmap,
//! release), stream-ordered events, and memory information.
//!
//! Methods take `&self`: a real driver is thread-safe, and the simulated one
//! keeps its state behind a lock, so one device can serve several allocators
//! (one per pool or thread shard) without the engine knowing.

use std::fmt;

/// A device virtual address. `0` is never a valid allocation.
pub type DevicePtr = u64;

/// A stream handle as the caller passes it (a `cudaStream_t` value; `0` is the
/// legacy default stream).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StreamId(pub u64);

/// A private memory pool's id: PyTorch's `MempoolId_t`, a pair (a graph
/// capture's pool is `(capture id, 0)`, a `torch.cuda.MemPool`'s `(0, id)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolId(pub u64, pub u64);

/// An event recorded on a stream by [`Device::record_event`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventId(pub u64);

/// Physical memory created by [`Device::physical_create`] (a
/// `CUmemGenericAllocationHandle`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PhysicalHandle(pub u64);

/// Free and total device memory, as `cudaMemGetInfo` reports it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct MemoryInfo {
    /// Bytes the driver could still hand out.
    pub free_bytes: u64,
    /// Total device memory.
    pub total_bytes: u64,
}

/// Each kind of driver call, for counting, latency and fault injection.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CallKind {
    /// `cudaMalloc`: a whole segment.
    SegmentAlloc,
    /// `cudaFree` (synchronizes the device on real hardware).
    SegmentFree,
    /// `cuMemAddressReserve`.
    AddressReserve,
    /// `cuMemAddressFree`.
    AddressFree,
    /// `cuMemCreate`: physical memory.
    PhysicalCreate,
    /// `cuMemRelease`.
    PhysicalRelease,
    /// `cuMemMap`.
    Map,
    /// `cuMemSetAccess`.
    SetAccess,
    /// `cuMemUnmap`.
    Unmap,
    /// `cuEventRecord` (with an event from the pool).
    EventRecord,
    /// `cuEventQuery`.
    EventQuery,
    /// `cuEventSynchronize`.
    EventSynchronize,
    /// `cuCtxSynchronize`.
    DeviceSynchronize,
    /// `cuMemGetInfo`.
    MemoryInfo,
    /// Loading the driver and opening the device (`cuInit`, `cuDeviceGet`,
    /// retaining the primary context, ...).
    Setup,
}

impl CallKind {
    /// Every kind, in declaration order.
    pub const ALL: [CallKind; 15] = [
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
        CallKind::EventQuery,
        CallKind::EventSynchronize,
        CallKind::DeviceSynchronize,
        CallKind::MemoryInfo,
        CallKind::Setup,
    ];

    /// The metric name used in JSON and tables (`segment_alloc`, `map`, ...).
    pub fn name(self) -> &'static str {
        match self {
            CallKind::SegmentAlloc => "segment_alloc",
            CallKind::SegmentFree => "segment_free",
            CallKind::AddressReserve => "address_reserve",
            CallKind::AddressFree => "address_free",
            CallKind::PhysicalCreate => "physical_create",
            CallKind::PhysicalRelease => "physical_release",
            CallKind::Map => "map",
            CallKind::SetAccess => "set_access",
            CallKind::Unmap => "unmap",
            CallKind::EventRecord => "event_record",
            CallKind::EventQuery => "event_query",
            CallKind::EventSynchronize => "event_synchronize",
            CallKind::DeviceSynchronize => "device_synchronize",
            CallKind::MemoryInfo => "memory_info",
            CallKind::Setup => "setup",
        }
    }

    /// True for the calls that change what memory the device holds for us:
    /// the ones `device_calls` and `steady_state_device_calls` count.
    pub fn moves_memory(self) -> bool {
        matches!(
            self,
            CallKind::SegmentAlloc
                | CallKind::SegmentFree
                | CallKind::AddressReserve
                | CallKind::AddressFree
                | CallKind::PhysicalCreate
                | CallKind::PhysicalRelease
                | CallKind::Map
                | CallKind::Unmap
        )
    }
}

impl fmt::Display for CallKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a driver call failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceErrorKind {
    /// The device has no memory left for this request
    /// (`cudaErrorMemoryAllocation` / `CUDA_ERROR_OUT_OF_MEMORY`).
    OutOfMemory,
    /// Any other driver failure; the string is the driver's own name for it
    /// (e.g. `CUDA_ERROR_INVALID_VALUE`).
    Driver(String),
    /// The device does not support this call (e.g. no virtual-memory API).
    Unsupported,
    /// No driver is present on this machine.
    NoDriver,
    /// A call that waits or gives memory back, refused because a CUDA graph
    /// capture is underway on the device (see [`crate::capture`]).
    CaptureUnderway,
}

/// A failed driver call: which call, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceError {
    /// The call that failed.
    pub call: CallKind,
    /// Why it failed.
    pub kind: DeviceErrorKind,
    /// Extra detail (sizes, addresses, the injected fault).
    pub detail: String,
}

impl DeviceError {
    /// A new error for `call`.
    pub fn new(call: CallKind, kind: DeviceErrorKind, detail: impl Into<String>) -> Self {
        DeviceError {
            call,
            kind,
            detail: detail.into(),
        }
    }

    /// True when the driver said it is out of memory.
    pub fn is_out_of_memory(&self) -> bool {
        self.kind == DeviceErrorKind::OutOfMemory
    }
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let why = match &self.kind {
            DeviceErrorKind::OutOfMemory => "out of memory",
            DeviceErrorKind::Driver(name) => name.as_str(),
            DeviceErrorKind::Unsupported => "not supported by this device",
            DeviceErrorKind::NoDriver => "no driver present",
            DeviceErrorKind::CaptureUnderway => {
                "not allowed while a CUDA graph capture is underway on this device"
            }
        };
        write!(f, "{} failed: {}", self.call, why)?;
        if !self.detail.is_empty() {
            write!(f, " ({})", self.detail)?;
        }
        Ok(())
    }
}

impl std::error::Error for DeviceError {}

/// The result of a driver call.
pub type DeviceResult<T> = Result<T, DeviceError>;

/// Counts of driver calls by kind, and the simulated time they took (0 on a
/// real device).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CallCounts {
    /// Calls of each kind, indexed like [`CallKind::ALL`].
    pub by_kind: [u64; CallKind::ALL.len()],
    /// Simulated driver time of each kind, in nanoseconds, indexed likewise.
    pub simulated_ns_by_kind: [u64; CallKind::ALL.len()],
}

impl CallCounts {
    /// Calls of one kind.
    pub fn get(&self, kind: CallKind) -> u64 {
        self.by_kind[kind as usize]
    }

    /// Simulated driver time of every call, in nanoseconds.
    pub fn simulated_ns(&self) -> u64 {
        self.simulated_ns_by_kind.iter().sum()
    }

    /// Calls that change what memory the device holds (see [`CallKind::moves_memory`]).
    pub fn memory_calls(&self) -> u64 {
        CallKind::ALL
            .iter()
            .filter(|k| k.moves_memory())
            .map(|k| self.get(*k))
            .sum()
    }

    /// `self - earlier`, kind by kind.
    pub fn since(&self, earlier: &CallCounts) -> CallCounts {
        let mut out = CallCounts::default();
        for i in 0..self.by_kind.len() {
            out.by_kind[i] = self.by_kind[i] - earlier.by_kind[i];
            out.simulated_ns_by_kind[i] =
                self.simulated_ns_by_kind[i] - earlier.simulated_ns_by_kind[i];
        }
        out
    }
}

/// The only door from the engine to a driver.
///
/// Implementations: `SimDevice` (deterministic simulated GPU, feature `sim`),
/// `hbmalloc_cuda::CudaDevice` (the CUDA driver, loaded at run time).
pub trait Device: Send + Sync {
    /// A short human name ("simulated GPU, 80.0 GiB", "NVIDIA H100 80GB HBM3").
    fn name(&self) -> String;

    /// Free and total device memory.
    fn memory_info(&self) -> DeviceResult<MemoryInfo>;

    /// Allocates a whole segment of `size` bytes (`cudaMalloc`).
    fn segment_alloc(&self, size: u64) -> DeviceResult<DevicePtr>;

    /// Frees a segment returned by [`Device::segment_alloc`] (`cudaFree`).
    fn segment_free(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()>;

    /// The virtual-memory granularity in bytes (2 MiB on current GPUs), or
    /// `None` when the device has no virtual-memory API.
    fn granularity(&self) -> Option<u64>;

    /// Reserves `size` bytes of virtual address space (a multiple of the granularity).
    fn address_reserve(&self, size: u64) -> DeviceResult<DevicePtr>;

    /// Releases an address range returned by [`Device::address_reserve`];
    /// nothing may be mapped in it.
    fn address_free(&self, base: DevicePtr, size: u64) -> DeviceResult<()>;

    /// Creates `size` bytes of physical memory (a multiple of the granularity).
    fn physical_create(&self, size: u64) -> DeviceResult<PhysicalHandle>;

    /// Releases physical memory; it must no longer be mapped anywhere.
    fn physical_release(&self, handle: PhysicalHandle) -> DeviceResult<()>;

    /// Maps `size` bytes of `handle`, starting `offset` bytes into it, at
    /// `va` (inside a reserved range, currently unmapped). Sizes and offsets
    /// are multiples of the granularity. One handle may be mapped at several
    /// places at once (`cuMemMap` allows it), so physical memory can be
    /// stitched into new virtual ranges without being copied.
    fn map(
        &self,
        va: DevicePtr,
        size: u64,
        handle: PhysicalHandle,
        offset: u64,
    ) -> DeviceResult<()>;

    /// Whether [`Device::map`] may map part of a handle: an offset other
    /// than 0, or fewer bytes than the handle holds. CUDA documents
    /// `cuMemMap`'s offset as one that "currently must be zero", so a
    /// device that keeps to the documentation answers false, and policy
    /// `hbm` then creates handles of at most `whole_handle_granules`
    /// granules (by default 16, or 1/2048 of the most memory held on heaps
    /// past 64 GiB), each always mapped whole, instead of one per run.
    fn maps_handle_parts(&self) -> bool;

    /// Makes `[va, va + size)` readable and writable by this device (and its peers).
    fn set_access(&self, va: DevicePtr, size: u64) -> DeviceResult<()>;

    /// Unmaps `[va, va + size)`, which must be exactly one earlier mapping.
    fn unmap(&self, va: DevicePtr, size: u64) -> DeviceResult<()>;

    /// Records an event on `stream`; it completes when the work queued on the
    /// stream so far has run.
    fn record_event(&self, stream: StreamId) -> DeviceResult<EventId>;

    /// True when `event` has completed. A completed event is retired: it must
    /// not be queried again.
    fn query_event(&self, event: EventId) -> DeviceResult<bool>;

    /// Blocks until `event` completes, then retires it.
    fn synchronize_event(&self, event: EventId) -> DeviceResult<()>;

    /// Blocks until all work on the device has completed.
    fn synchronize_device(&self) -> DeviceResult<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_since_an_earlier_count_are_the_difference_kind_by_kind() {
        let at = |maps, map_ns, creates, create_ns| {
            let mut counts = CallCounts::default();
            counts.by_kind[CallKind::Map as usize] = maps;
            counts.simulated_ns_by_kind[CallKind::Map as usize] = map_ns;
            counts.by_kind[CallKind::PhysicalCreate as usize] = creates;
            counts.simulated_ns_by_kind[CallKind::PhysicalCreate as usize] = create_ns;
            counts
        };
        let earlier = at(2, 7_000, 1, 14_600);
        let later = at(5, 17_500, 1, 14_600);
        let made = later.since(&earlier);
        assert_eq!(made, at(3, 10_500, 0, 0));
        assert_eq!(made.simulated_ns(), 10_500);
        assert_eq!(made.memory_calls(), 3);
    }
}

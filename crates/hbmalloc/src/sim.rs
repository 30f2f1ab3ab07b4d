//! `SimDevice`: a deterministic simulated GPU.
//!
//! It models what the allocator can observe of a real device: a capacity,
//! an address space, physical memory in granules, asynchronous streams whose
//! events complete only when the *caller* says so, a latency for every call,
//! a counter for every call, and injected faults. By default it behaves as a
//! real driver does (whole-handle maps, measured latencies); kinder drivers
//! are what-ifs a caller asks for in `SimConfig`. It never touches real
//! memory, so a replay of an 80 GB training step runs on a laptop.
//!
//! Determinism: addresses come from a bump pointer, events from a counter,
//! and nothing depends on wall-clock time or hashing order.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use crate::device::{
    CallCounts, CallKind, Device, DeviceError, DeviceErrorKind, DevicePtr, DeviceResult, EventId,
    MemoryInfo, PhysicalHandle, StreamId,
};
use crate::fastmap::FastMap;
use crate::latency::LatencyModel;

const MIB: u64 = 1 << 20;

/// A fault to inject: the `nth` call of `call` from now on (1-based) fails.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The kind of call that fails.
    pub call: CallKind,
    /// Which call of that kind fails, counting from when the fault was armed (1 = the next).
    pub nth: u64,
    /// How it fails.
    pub error: DeviceErrorKind,
    /// When true, every call from the `nth` on fails, not just the `nth`.
    pub sticky: bool,
}

/// Configuration of a [`SimDevice`].
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Device memory in bytes.
    pub capacity_bytes: u64,
    /// Virtual-memory granularity; `None` simulates a device without the VMM API.
    pub granularity: Option<u64>,
    /// Latency charged for each call (default: measured on an H100).
    pub latency: LatencyModel,
    /// `map` accepts part of a handle (see [`Device::maps_handle_parts`]): a
    /// what-if. The default, false, refuses a map at an offset or of fewer
    /// bytes than the handle, as a real driver does.
    pub maps_handle_parts: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            capacity_bytes: 80 * 1024 * MIB,
            granularity: Some(2 * MIB),
            latency: LatencyModel::h100(),
            maps_handle_parts: false,
        }
    }
}

#[derive(Clone, Debug)]
struct PhysicalMemory {
    size: u64,
    /// Mappings of (parts of) this memory that exist now.
    mappings: u32,
}

#[derive(Clone, Debug)]
struct Mapping {
    size: u64,
    handle: PhysicalHandle,
    offset: u64,
    accessible: bool,
}

#[derive(Clone, Debug)]
struct PendingEvent {
    stream: StreamId,
    /// Position of the event in its stream's work queue.
    sequence: u64,
}

#[derive(Debug, Default)]
struct StreamState {
    /// Work items enqueued so far (one per recorded event).
    enqueued: u64,
    /// Work items known to have run.
    completed: u64,
}

#[derive(Debug)]
struct SimState {
    config: SimConfig,
    /// Bytes held by others (other processes, the CUDA context): not ours, not free.
    external_bytes: u64,
    next_address: DevicePtr,
    /// Addresses to hand out for upcoming segment allocations, as (size, address).
    address_plan: std::collections::VecDeque<(u64, DevicePtr)>,
    segments: BTreeMap<DevicePtr, u64>,
    reserved_ranges: BTreeMap<DevicePtr, u64>,
    physical: FastMap<u64, PhysicalMemory>,
    next_handle: u64,
    mappings: BTreeMap<DevicePtr, Mapping>,
    used_bytes: u64,
    peak_used_bytes: u64,
    streams: BTreeMap<StreamId, StreamState>,
    events: FastMap<u64, PendingEvent>,
    next_event: u64,
    calls: [u64; CallKind::ALL.len()],
    simulated_ns_by_kind: [u64; CallKind::ALL.len()],
    faults: Vec<(Fault, u64)>,
    /// Kernels the caller said are queued, by id: see [`SimDevice::enqueue_use`].
    uses: BTreeMap<u64, UseRecord>,
    next_use: u64,
    /// Frees and unmaps of memory that queued work still touched.
    violations: Vec<UseViolation>,
    /// Whether `segment_free` waits for all queued work first (`cudaFree` does).
    free_synchronizes: bool,
}

#[derive(Clone, Debug)]
struct UseRecord {
    stream: StreamId,
    ptr: DevicePtr,
    len: u64,
    /// Position of the use in its stream's work queue.
    sequence: u64,
    /// The physical memory behind `[ptr, ptr + len)` when it was queued,
    /// as (handle, first byte, end): the same memory may be mapped at
    /// other addresses too, and a kernel touches the memory, not the address.
    physical: Vec<(u64, u64, u64)>,
}

/// Work queued on a stream that reads or writes `[ptr, ptr + len)`: a kernel
/// launch, a copy, a collective. See [`SimDevice::enqueue_use`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingUse {
    /// The use, as [`SimDevice::enqueue_use`] returned it.
    pub id: UseId,
    /// The stream it is queued on.
    pub stream: StreamId,
    /// First byte it touches.
    pub ptr: DevicePtr,
    /// Bytes it touches.
    pub len: u64,
}

/// A use of memory queued on a stream (see [`SimDevice::enqueue_use`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct UseId(pub u64);

/// Memory given back to the driver while queued work still touched it: a
/// use-after-free on a real GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UseViolation {
    /// The call that gave the memory back (`segment_free`, `unmap`).
    pub call: CallKind,
    /// Start of the range given back.
    pub ptr: DevicePtr,
    /// Bytes given back.
    pub len: u64,
    /// The queued work that still touched it.
    pub uses: Vec<PendingUse>,
}

impl std::fmt::Display for UseViolation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} of [{:#x}, +{}) while queued work still touches it:",
            self.call, self.ptr, self.len
        )?;
        for u in &self.uses {
            write!(
                f,
                " use {} on stream {:#x} [{:#x}, +{})",
                u.id.0, u.stream.0, u.ptr, u.len
            )?;
        }
        Ok(())
    }
}

/// A deterministic simulated GPU. See the module docs.
#[derive(Debug)]
pub struct SimDevice {
    state: Mutex<SimState>,
}

impl SimDevice {
    /// A device with the default configuration (80 GiB, 2 MiB granules, an
    /// H100's driver: whole-handle maps, measured latencies).
    pub fn new() -> Self {
        SimDevice::with_config(SimConfig::default())
    }

    /// A device of `capacity_bytes` with otherwise default configuration.
    pub fn with_capacity(capacity_bytes: u64) -> Self {
        SimDevice::with_config(SimConfig {
            capacity_bytes,
            ..SimConfig::default()
        })
    }

    /// A device with the given configuration.
    pub fn with_config(config: SimConfig) -> Self {
        SimDevice {
            state: Mutex::new(SimState {
                config,
                external_bytes: 0,
                // Start above every address a real device hands out (below
                // 2^48), so planned addresses (recorded ones) never collide
                // with invented ones. Every range is 2 MiB aligned.
                next_address: 1 << 48,
                address_plan: std::collections::VecDeque::new(),
                segments: BTreeMap::new(),
                reserved_ranges: BTreeMap::new(),
                physical: FastMap::default(),
                next_handle: 1,
                mappings: BTreeMap::new(),
                used_bytes: 0,
                peak_used_bytes: 0,
                streams: BTreeMap::new(),
                events: FastMap::default(),
                next_event: 1,
                calls: [0; CallKind::ALL.len()],
                simulated_ns_by_kind: [0; CallKind::ALL.len()],
                faults: Vec::new(),
                uses: BTreeMap::new(),
                next_use: 1,
                violations: Vec::new(),
                free_synchronizes: true,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, SimState> {
        // A panic while holding the lock leaves consistent state (every
        // mutation is completed before any call that could panic), so a
        // poisoned lock is still safe to use.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Calls made so far, by kind, and the simulated time they took.
    pub fn call_counts(&self) -> CallCounts {
        let state = self.lock();
        CallCounts {
            by_kind: state.calls,
            simulated_ns_by_kind: state.simulated_ns_by_kind,
        }
    }

    /// Device memory in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.lock().config.capacity_bytes
    }

    /// Bytes this device has handed out (segments plus physical memory).
    pub fn used_bytes(&self) -> u64 {
        self.lock().used_bytes
    }

    /// The most bytes this device has handed out at once (segments plus
    /// physical memory): the policy-independent measure of reserved memory.
    pub fn peak_used_bytes(&self) -> u64 {
        self.lock().peak_used_bytes
    }

    /// Sets the bytes held by someone else (another process, the CUDA
    /// context). They count against capacity but are not ours.
    pub fn set_external_bytes(&self, bytes: u64) {
        self.lock().external_bytes = bytes;
    }

    /// Plans the addresses of upcoming segment allocations: while the next
    /// `segment_alloc` asks for the size at the head of `plan`, it gets that
    /// address (if free). Replays use it to hand out the addresses the recorded
    /// allocator got, so best-fit ties break the same way.
    pub fn plan_segment_addresses(&self, plan: impl IntoIterator<Item = (u64, DevicePtr)>) {
        self.lock().address_plan = plan.into_iter().collect();
    }

    /// Arms a fault. Several may be armed at once.
    pub fn inject(&self, fault: Fault) {
        let mut state = self.lock();
        let seen = state.calls[fault.call as usize];
        state.faults.push((fault, seen));
    }

    /// Disarms every fault.
    pub fn clear_faults(&self) {
        self.lock().faults.clear();
    }

    /// Runs all work enqueued on `stream` so far: its events complete.
    pub fn complete_stream(&self, stream: StreamId) {
        let mut state = self.lock();
        let s = state.streams.entry(stream).or_default();
        s.completed = s.enqueued;
    }

    /// Runs all work on every stream.
    pub fn complete_all(&self) {
        let mut state = self.lock();
        for s in state.streams.values_mut() {
            s.completed = s.enqueued;
        }
    }

    /// Completes one specific event (and everything queued before it on its stream).
    pub fn complete_event(&self, event: EventId) {
        let mut state = self.lock();
        if let Some(pending) = state.events.get(&event.0).cloned() {
            let s = state.streams.entry(pending.stream).or_default();
            s.completed = s.completed.max(pending.sequence);
        }
    }

    /// Events recorded and not yet retired.
    pub fn pending_events(&self) -> usize {
        self.lock().events.len()
    }

    /// The physical memory behind device address `va`: its handle and the
    /// byte offset into it, or `None` when `va` is not mapped. Tests use it to
    /// check that no two live allocations share physical memory, even through
    /// different virtual addresses.
    pub fn physical_location(&self, va: DevicePtr) -> Option<(PhysicalHandle, u64)> {
        let state = self.lock();
        let (&start, m) = state.mappings.range(..=va).next_back()?;
        (va < start + m.size).then(|| (m.handle, m.offset + (va - start)))
    }

    /// Whether no byte of `[ptr, ptr + len)` lies in a mapping that was
    /// never given access ([`Device::set_access`]): such memory faults when a
    /// kernel touches it. Segments and unmapped bytes count as accessible.
    pub fn accessible(&self, ptr: DevicePtr, len: u64) -> bool {
        let state = self.lock();
        let first = state
            .mappings
            .range(..=ptr)
            .next_back()
            .filter(|(&start, m)| ptr < start + m.size)
            .map_or(ptr, |(&start, _)| start);
        state
            .mappings
            .range(first..ptr.saturating_add(len))
            .all(|(_, m)| m.accessible)
    }

    /// The physical memory mapped under `[ptr, ptr + len)`: (handle, first
    /// byte, end byte) for each mapping the range crosses. Unmapped parts
    /// are left out.
    pub fn physical_ranges(&self, ptr: DevicePtr, len: u64) -> Vec<(PhysicalHandle, u64, u64)> {
        self.lock()
            .physical_ranges(ptr, len)
            .into_iter()
            .map(|(h, lo, hi)| (PhysicalHandle(h), lo, hi))
            .collect()
    }

    /// The events recorded and not yet retired, in the order they were
    /// recorded (so a caller can complete them in an order of its choosing
    /// with [`SimDevice::complete_event`]).
    pub fn pending_event_ids(&self) -> Vec<EventId> {
        let state = self.lock();
        let mut ids: Vec<u64> = state.events.keys().copied().collect();
        ids.sort_unstable();
        ids.into_iter().map(EventId).collect()
    }

    /// The streams this device has seen (events or uses), in order.
    pub fn streams(&self) -> Vec<StreamId> {
        self.lock().streams.keys().copied().collect()
    }

    /// Says that `stream` has work queued that touches `[ptr, ptr + len)` (a
    /// kernel launch). Like any work on a stream, it completes when the
    /// stream's work up to it completes: [`SimDevice::complete_stream`],
    /// [`SimDevice::complete_all`], [`SimDevice::complete_use`], or an event
    /// recorded after it on the same stream completing or being synchronized.
    ///
    /// While it is pending, giving its memory back to the driver (`unmap`, or
    /// `segment_free` when frees do not synchronize) is recorded as a
    /// [`UseViolation`]; a caller checks new allocations against
    /// [`SimDevice::pending_uses_overlapping`] itself.
    pub fn enqueue_use(&self, stream: StreamId, ptr: DevicePtr, len: u64) -> UseId {
        let mut state = self.lock();
        let s = state.streams.entry(stream).or_default();
        s.enqueued += 1;
        let sequence = s.enqueued;
        let id = state.next_use;
        state.next_use += 1;
        let physical = state.physical_ranges(ptr, len);
        state.uses.insert(
            id,
            UseRecord {
                stream,
                ptr,
                len,
                sequence,
                physical,
            },
        );
        UseId(id)
    }

    /// Completes `stream`'s work up to and including the use `id`.
    pub fn complete_use(&self, id: UseId) {
        let mut state = self.lock();
        if let Some(u) = state.uses.get(&id.0).cloned() {
            let s = state.streams.entry(u.stream).or_default();
            s.completed = s.completed.max(u.sequence);
        }
        state.prune_uses();
    }

    /// Every use still pending, oldest first.
    pub fn pending_uses(&self) -> Vec<PendingUse> {
        let mut state = self.lock();
        state.prune_uses();
        state.uses.iter().map(|(&id, u)| u.public(id)).collect()
    }

    /// The pending uses that touch any byte of `[ptr, ptr + len)`, or the
    /// physical memory mapped there through another address, oldest first.
    pub fn pending_uses_overlapping(&self, ptr: DevicePtr, len: u64) -> Vec<PendingUse> {
        let mut state = self.lock();
        state.prune_uses();
        state.overlapping_uses(ptr, len, true)
    }

    /// Use-after-free violations seen so far (frees and unmaps of memory that
    /// queued work still touched); clears the list.
    pub fn take_violations(&self) -> Vec<UseViolation> {
        std::mem::take(&mut self.lock().violations)
    }

    /// Whether `segment_free` first waits for all queued work, as `cudaFree`
    /// does (the default). With `false`, freeing a segment that pending work
    /// touches is a [`UseViolation`]: the stricter model of a driver whose
    /// free is stream-ordered.
    pub fn set_free_synchronizes(&self, synchronizes: bool) {
        self.lock().free_synchronizes = synchronizes;
    }

    /// Checks the device's own books: used bytes equal segments plus
    /// physical memory, every mapping lies inside a reserved range.
    pub fn check_invariants(&self) -> Result<(), String> {
        let state = self.lock();
        let segments: u64 = state.segments.values().sum();
        let physical: u64 = state.physical.values().map(|p| p.size).sum();
        if segments + physical != state.used_bytes {
            return Err(format!(
                "sim: used_bytes {} != segments {} + physical {}",
                state.used_bytes, segments, physical
            ));
        }
        for (&va, m) in &state.mappings {
            if !state.range_reserved(va, m.size) {
                return Err(format!(
                    "sim: mapping at {va:#x} outside any reserved range"
                ));
            }
        }
        Ok(())
    }
}

impl Default for SimDevice {
    fn default() -> Self {
        SimDevice::new()
    }
}

impl SimState {
    /// Counts the call, charges its latency for `bytes` and applies any
    /// armed fault.
    fn enter(&mut self, call: CallKind, bytes: u64) -> DeviceResult<()> {
        let ns = self.config.latency.of(call, bytes);
        self.enter_costing(call, ns)
    }

    /// [`enter`](Self::enter) for a call that costs `ns`.
    fn enter_costing(&mut self, call: CallKind, ns: u64) -> DeviceResult<()> {
        self.calls[call as usize] += 1;
        self.simulated_ns_by_kind[call as usize] += ns;
        let count = self.calls[call as usize];
        for (fault, armed_at) in &self.faults {
            if fault.call != call {
                continue;
            }
            let position = count - *armed_at;
            if position == fault.nth || (fault.sticky && position > fault.nth) {
                return Err(DeviceError::new(
                    call,
                    fault.error.clone(),
                    format!("injected fault on call {position} since armed"),
                ));
            }
        }
        Ok(())
    }

    /// Drops the uses whose stream has run past them.
    fn prune_uses(&mut self) {
        let streams = &self.streams;
        self.uses.retain(|_, u| {
            streams
                .get(&u.stream)
                .is_none_or(|s| s.completed < u.sequence)
        });
    }

    /// The physical memory mapped under `[ptr, ptr + len)`, as (handle,
    /// first byte, end) per mapping it crosses.
    fn physical_ranges(&self, ptr: DevicePtr, len: u64) -> Vec<(u64, u64, u64)> {
        let end = ptr.saturating_add(len);
        let first = self
            .mappings
            .range(..=ptr)
            .next_back()
            .map_or(ptr, |(&start, _)| start);
        self.mappings
            .range(first..end)
            .filter_map(|(&start, m)| {
                let lo = ptr.max(start);
                let hi = end.min(start + m.size);
                (lo < hi).then(|| (m.handle.0, m.offset + (lo - start), m.offset + (hi - start)))
            })
            .collect()
    }

    /// Pending uses of `[ptr, ptr + len)`; with `through_aliases`, also
    /// uses of the same physical memory at other addresses.
    fn overlapping_uses(&self, ptr: DevicePtr, len: u64, through_aliases: bool) -> Vec<PendingUse> {
        let end = ptr.saturating_add(len);
        let physical = if !through_aliases || self.mappings.is_empty() {
            Vec::new()
        } else {
            self.physical_ranges(ptr, len)
        };
        let shares_memory = |u: &UseRecord| {
            (u.ptr < end && ptr < u.ptr.saturating_add(u.len))
                || u.physical.iter().any(|&(h, lo, hi)| {
                    physical
                        .iter()
                        .any(|&(h2, lo2, hi2)| h == h2 && lo < hi2 && lo2 < hi)
                })
        };
        self.uses
            .iter()
            .filter(|(_, u)| {
                shares_memory(u)
                    && self
                        .streams
                        .get(&u.stream)
                        .is_none_or(|s| s.completed < u.sequence)
            })
            .map(|(&id, u)| u.public(id))
            .collect()
    }

    /// Records a violation when queued work still touches `[ptr, ptr + len)`.
    fn check_release(&mut self, call: CallKind, ptr: DevicePtr, len: u64) {
        if self.uses.is_empty() {
            return;
        }
        // Unmapping an address harms only work at that address.
        let uses = self.overlapping_uses(ptr, len, false);
        if !uses.is_empty() {
            self.violations.push(UseViolation {
                call,
                ptr,
                len,
                uses,
            });
        }
    }

    fn add_used(&mut self, bytes: u64) {
        self.used_bytes += bytes;
        self.peak_used_bytes = self.peak_used_bytes.max(self.used_bytes);
    }

    fn free_bytes(&self) -> u64 {
        self.config
            .capacity_bytes
            .saturating_sub(self.used_bytes + self.external_bytes)
    }

    /// The next unused address range of `size` bytes. Addresses are never
    /// reused; like a driver, it refuses a range past the end of the address
    /// space, which ends where no address plus size can overflow.
    fn take_address(&mut self, call: CallKind, size: u64) -> DeviceResult<DevicePtr> {
        const ALIGN: u64 = 2 * MIB;
        const ADDRESS_SPACE_END: u64 = 1 << 63;
        let base = self.next_address;
        // Leave a gap after each range so that adjacent ranges are never
        // mistaken for one.
        let next = size
            .div_ceil(ALIGN)
            .checked_mul(ALIGN)
            .and_then(|aligned| base.checked_add(aligned)?.checked_add(ALIGN))
            .filter(|&next| next <= ADDRESS_SPACE_END);
        let Some(next) = next else {
            return Err(DeviceError::new(
                call,
                DeviceErrorKind::OutOfMemory,
                format!("no {size}-byte range left in the address space"),
            ));
        };
        self.next_address = next;
        Ok(base)
    }

    fn segment_range_free(&self, addr: DevicePtr, size: u64) -> bool {
        let Some(end) = addr.checked_add(size) else {
            return false;
        };
        let before = self
            .segments
            .range(..=addr)
            .next_back()
            .is_some_and(|(&start, &len)| start + len > addr);
        let after = self.segments.range(addr..end).next().is_some();
        addr != 0 && !before && !after
    }

    fn range_reserved(&self, va: DevicePtr, size: u64) -> bool {
        match self.reserved_ranges.range(..=va).next_back() {
            Some((&base, &len)) => va >= base && va + size <= base + len,
            None => false,
        }
    }

    fn check_granular(&self, call: CallKind, value: u64, what: &str) -> DeviceResult<u64> {
        let Some(g) = self.config.granularity else {
            return Err(DeviceError::new(
                call,
                DeviceErrorKind::Unsupported,
                "no virtual-memory API",
            ));
        };
        if value == 0 || value % g != 0 {
            return Err(invalid(
                call,
                format!("{what} {value} is not a positive multiple of the granularity {g}"),
            ));
        }
        Ok(g)
    }
}

fn invalid(call: CallKind, detail: String) -> DeviceError {
    DeviceError::new(
        call,
        DeviceErrorKind::Driver("CUDA_ERROR_INVALID_VALUE".into()),
        detail,
    )
}

fn oom(call: CallKind, size: u64, free: u64) -> DeviceError {
    DeviceError::new(
        call,
        DeviceErrorKind::OutOfMemory,
        format!("asked for {size} bytes with {free} free"),
    )
}

impl UseRecord {
    fn public(&self, id: u64) -> PendingUse {
        PendingUse {
            id: UseId(id),
            stream: self.stream,
            ptr: self.ptr,
            len: self.len,
        }
    }
}

impl Device for SimDevice {
    fn name(&self) -> String {
        let state = self.lock();
        format!(
            "simulated GPU, {:.1} GiB",
            state.config.capacity_bytes as f64 / (1u64 << 30) as f64
        )
    }

    fn memory_info(&self) -> DeviceResult<MemoryInfo> {
        let mut state = self.lock();
        state.enter(CallKind::MemoryInfo, 0)?;
        Ok(MemoryInfo {
            free_bytes: state.free_bytes(),
            total_bytes: state.config.capacity_bytes,
        })
    }

    fn segment_alloc(&self, size: u64) -> DeviceResult<DevicePtr> {
        let mut state = self.lock();
        state.enter(CallKind::SegmentAlloc, size)?;
        if size == 0 {
            return Err(invalid(CallKind::SegmentAlloc, "size 0".into()));
        }
        let free = state.free_bytes();
        if size > free {
            return Err(oom(CallKind::SegmentAlloc, size, free));
        }
        let ptr = match state.address_plan.front() {
            Some(&(planned_size, addr))
                if planned_size == size && state.segment_range_free(addr, size) =>
            {
                state.address_plan.pop_front();
                addr
            }
            _ => {
                // The plan no longer matches what the allocator does: drop it.
                state.address_plan.clear();
                state.take_address(CallKind::SegmentAlloc, size)?
            }
        };
        state.segments.insert(ptr, size);
        state.add_used(size);
        Ok(ptr)
    }

    fn segment_free(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        let mut state = self.lock();
        state.enter(CallKind::SegmentFree, size)?;
        match state.segments.get(&ptr) {
            Some(&len) if len == size => {}
            Some(&len) => {
                return Err(invalid(
                    CallKind::SegmentFree,
                    format!("segment {ptr:#x} has {len} bytes, not {size}"),
                ))
            }
            None => {
                return Err(invalid(
                    CallKind::SegmentFree,
                    format!("{ptr:#x} is not a segment"),
                ))
            }
        }
        if state.free_synchronizes {
            // cudaFree synchronizes the device.
            for s in state.streams.values_mut() {
                s.completed = s.enqueued;
            }
        } else {
            state.check_release(CallKind::SegmentFree, ptr, size);
        }
        state.segments.remove(&ptr);
        state.used_bytes -= size;
        state.prune_uses();
        Ok(())
    }

    fn granularity(&self) -> Option<u64> {
        self.lock().config.granularity
    }

    fn maps_handle_parts(&self) -> bool {
        self.lock().config.maps_handle_parts
    }

    fn address_reserve(&self, size: u64) -> DeviceResult<DevicePtr> {
        let mut state = self.lock();
        state.enter(CallKind::AddressReserve, size)?;
        state.check_granular(CallKind::AddressReserve, size, "size")?;
        let base = state.take_address(CallKind::AddressReserve, size)?;
        state.reserved_ranges.insert(base, size);
        Ok(base)
    }

    fn address_free(&self, base: DevicePtr, size: u64) -> DeviceResult<()> {
        let mut state = self.lock();
        state.enter(CallKind::AddressFree, size)?;
        if state.reserved_ranges.get(&base) != Some(&size) {
            return Err(invalid(
                CallKind::AddressFree,
                format!("no reserved range of {size} bytes at {base:#x}"),
            ));
        }
        if state.mappings.range(base..base + size).next().is_some() {
            return Err(invalid(
                CallKind::AddressFree,
                format!("range at {base:#x} still has mappings"),
            ));
        }
        state.reserved_ranges.remove(&base);
        Ok(())
    }

    fn physical_create(&self, size: u64) -> DeviceResult<PhysicalHandle> {
        let mut state = self.lock();
        state.enter(CallKind::PhysicalCreate, size)?;
        state.check_granular(CallKind::PhysicalCreate, size, "size")?;
        let free = state.free_bytes();
        if size > free {
            return Err(oom(CallKind::PhysicalCreate, size, free));
        }
        let handle = state.next_handle;
        state.next_handle += 1;
        state
            .physical
            .insert(handle, PhysicalMemory { size, mappings: 0 });
        state.add_used(size);
        Ok(PhysicalHandle(handle))
    }

    fn physical_release(&self, handle: PhysicalHandle) -> DeviceResult<()> {
        let mut state = self.lock();
        let bytes = state.physical.get(&handle.0).map_or(0, |m| m.size);
        state.enter(CallKind::PhysicalRelease, bytes)?;
        let Some(mem) = state.physical.get(&handle.0) else {
            return Err(invalid(
                CallKind::PhysicalRelease,
                format!("unknown handle {}", handle.0),
            ));
        };
        if mem.mappings > 0 {
            return Err(invalid(
                CallKind::PhysicalRelease,
                format!(
                    "handle {} is still mapped {} time(s)",
                    handle.0, mem.mappings
                ),
            ));
        }
        let size = mem.size;
        state.physical.remove(&handle.0);
        state.used_bytes -= size;
        Ok(())
    }

    fn map(
        &self,
        va: DevicePtr,
        size: u64,
        handle: PhysicalHandle,
        offset: u64,
    ) -> DeviceResult<()> {
        let mut state = self.lock();
        state.enter(CallKind::Map, size)?;
        state.check_granular(CallKind::Map, size, "size")?;
        if offset > 0 {
            state.check_granular(CallKind::Map, offset, "offset")?;
        }
        match state.physical.get(&handle.0) {
            None => {
                return Err(invalid(
                    CallKind::Map,
                    format!("unknown handle {}", handle.0),
                ))
            }
            Some(mem) if !state.config.maps_handle_parts && (offset != 0 || size != mem.size) => {
                return Err(invalid(
                    CallKind::Map,
                    format!(
                        "{size} bytes at offset {offset} are part of handle {} of {} bytes: \
                         this device maps whole handles only",
                        handle.0, mem.size
                    ),
                ))
            }
            Some(mem) if offset.checked_add(size).is_none_or(|end| end > mem.size) => {
                return Err(invalid(
                    CallKind::Map,
                    format!(
                        "{size} bytes at offset {offset} do not fit handle {} of {} bytes",
                        handle.0, mem.size
                    ),
                ))
            }
            Some(_) => {}
        }
        if !state.range_reserved(va, size) {
            return Err(invalid(
                CallKind::Map,
                format!("{va:#x}+{size} is not inside a reserved range"),
            ));
        }
        // Mappings never overlap, so the last one starting before the new
        // range ends is the one that would reach into it.
        let overlaps = state
            .mappings
            .range(..va + size)
            .next_back()
            .is_some_and(|(&start, m)| start + m.size > va);
        if overlaps {
            return Err(invalid(
                CallKind::Map,
                format!("{va:#x}+{size} overlaps an existing mapping"),
            ));
        }
        state.mappings.insert(
            va,
            Mapping {
                size,
                handle,
                offset,
                accessible: false,
            },
        );
        if let Some(mem) = state.physical.get_mut(&handle.0) {
            mem.mappings += 1;
        }
        Ok(())
    }

    fn set_access(&self, va: DevicePtr, size: u64) -> DeviceResult<()> {
        let mut state = self.lock();
        // The driver grants access mapping by mapping: a range over k
        // handles costs k single grants, whatever their sizes.
        let end = va.saturating_add(size);
        let latency = &state.config.latency;
        let (covered, grants) =
            state
                .mappings
                .range(va..end)
                .fold((0, 0), |(covered, grants), (_, m)| {
                    (
                        covered + m.size,
                        grants + latency.of(CallKind::SetAccess, m.size),
                    )
                });
        // A range with nothing mapped is refused at one grant's cost.
        let ns = if grants > 0 {
            grants
        } else {
            latency.of(CallKind::SetAccess, size)
        };
        state.enter_costing(CallKind::SetAccess, ns)?;
        // Refused whole, as the driver refuses it: nothing is granted.
        if covered != size {
            return Err(invalid(
                CallKind::SetAccess,
                format!("{va:#x}+{size} is not fully mapped"),
            ));
        }
        for (_, m) in state.mappings.range_mut(va..end) {
            m.accessible = true;
        }
        Ok(())
    }

    fn unmap(&self, va: DevicePtr, size: u64) -> DeviceResult<()> {
        let mut state = self.lock();
        state.enter(CallKind::Unmap, size)?;
        match state.mappings.get(&va) {
            Some(m) if m.size == size => {}
            _ => {
                return Err(invalid(
                    CallKind::Unmap,
                    format!("no mapping of {size} bytes at {va:#x}"),
                ))
            }
        }
        state.check_release(CallKind::Unmap, va, size);
        if let Some(m) = state.mappings.remove(&va) {
            if let Some(mem) = state.physical.get_mut(&m.handle.0) {
                mem.mappings -= 1;
            }
        }
        Ok(())
    }

    fn record_event(&self, stream: StreamId) -> DeviceResult<EventId> {
        let mut state = self.lock();
        state.enter(CallKind::EventRecord, 0)?;
        let s = state.streams.entry(stream).or_default();
        s.enqueued += 1;
        let sequence = s.enqueued;
        let id = state.next_event;
        state.next_event += 1;
        state.events.insert(id, PendingEvent { stream, sequence });
        Ok(EventId(id))
    }

    fn query_event(&self, event: EventId) -> DeviceResult<bool> {
        let mut state = self.lock();
        state.enter(CallKind::EventQuery, 0)?;
        let Some(pending) = state.events.get(&event.0).cloned() else {
            return Err(invalid(
                CallKind::EventQuery,
                format!("unknown event {}", event.0),
            ));
        };
        let done = state
            .streams
            .get(&pending.stream)
            .is_some_and(|s| s.completed >= pending.sequence);
        if done {
            state.events.remove(&event.0);
        }
        Ok(done)
    }

    fn synchronize_event(&self, event: EventId) -> DeviceResult<()> {
        let mut state = self.lock();
        state.enter(CallKind::EventSynchronize, 0)?;
        let Some(pending) = state.events.remove(&event.0) else {
            return Err(invalid(
                CallKind::EventSynchronize,
                format!("unknown event {}", event.0),
            ));
        };
        let s = state.streams.entry(pending.stream).or_default();
        s.completed = s.completed.max(pending.sequence);
        Ok(())
    }

    fn synchronize_device(&self) -> DeviceResult<()> {
        let mut state = self.lock();
        state.enter(CallKind::DeviceSynchronize, 0)?;
        for s in state.streams.values_mut() {
            s.completed = s.enqueued;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_count_against_capacity() {
        let dev = SimDevice::with_capacity(10 * MIB);
        let a = dev.segment_alloc(6 * MIB).unwrap();
        let err = dev.segment_alloc(6 * MIB).unwrap_err();
        assert!(err.is_out_of_memory());
        dev.segment_free(a, 6 * MIB).unwrap();
        dev.segment_alloc(6 * MIB).unwrap();
        assert_eq!(dev.call_counts().get(CallKind::SegmentAlloc), 3);
        dev.check_invariants().unwrap();
    }

    #[test]
    fn events_complete_only_when_told() {
        let dev = SimDevice::new();
        let e = dev.record_event(StreamId(7)).unwrap();
        assert!(!dev.query_event(e).unwrap());
        dev.complete_stream(StreamId(7));
        assert!(dev.query_event(e).unwrap());
        // Retired: querying again is an error, as with a recycled CUDA event.
        assert!(dev.query_event(e).is_err());
    }

    #[test]
    fn vmm_map_and_release() {
        let dev = SimDevice::with_capacity(8 * MIB);
        let base = dev.address_reserve(8 * MIB).unwrap();
        let h = dev.physical_create(2 * MIB).unwrap();
        dev.map(base + 2 * MIB, 2 * MIB, h, 0).unwrap();
        dev.set_access(base + 2 * MIB, 2 * MIB).unwrap();
        assert!(dev.physical_release(h).is_err(), "still mapped");
        assert!(dev.address_free(base, 8 * MIB).is_err(), "still mapped");
        dev.unmap(base + 2 * MIB, 2 * MIB).unwrap();
        dev.physical_release(h).unwrap();
        dev.address_free(base, 8 * MIB).unwrap();
        assert_eq!(dev.used_bytes(), 0);
        dev.check_invariants().unwrap();
    }

    #[test]
    fn an_address_range_past_the_address_space_is_refused_not_wrapped() {
        let dev = SimDevice::with_capacity(8 * MIB);
        let huge = (u64::MAX / (2 * MIB)) * (2 * MIB);
        let err = dev.address_reserve(huge).unwrap_err();
        assert!(err.is_out_of_memory(), "{err}");
        let err = dev.address_reserve(1 << 63).unwrap_err();
        assert!(err.is_out_of_memory(), "{err}");
        // The refusals took nothing: a range still fits after them.
        let base = dev.address_reserve(8 * MIB).unwrap();
        dev.address_free(base, 8 * MIB).unwrap();
        dev.check_invariants().unwrap();
    }

    #[test]
    fn a_map_over_any_part_of_another_is_refused_and_neighbours_are_not() {
        // Parts of one handle, on a driver that maps them.
        let dev = SimDevice::with_config(SimConfig {
            capacity_bytes: 32 * MIB,
            maps_handle_parts: true,
            ..SimConfig::default()
        });
        let base = dev.address_reserve(32 * MIB).unwrap();
        let h = dev.physical_create(16 * MIB).unwrap();
        // [8, 12) MiB is taken.
        dev.map(base + 8 * MIB, 4 * MIB, h, 0).unwrap();
        for (start, size) in [(6, 4), (10, 4), (8, 4), (4, 16), (10, 2), (8, 2)] {
            let err = dev
                .map(base + start * MIB, size * MIB, h, 0)
                .expect_err(&format!("[{start}, {}) MiB overlaps", start + size));
            assert!(err.to_string().contains("overlaps"), "{err}");
        }
        // Ranges that end where it begins, or begin where it ends, fit.
        dev.map(base + 4 * MIB, 4 * MIB, h, 4 * MIB).unwrap();
        dev.map(base + 12 * MIB, 4 * MIB, h, 8 * MIB).unwrap();
        dev.check_invariants().unwrap();
    }

    #[test]
    fn injected_fault_fails_exactly_the_nth_call() {
        let dev = SimDevice::new();
        dev.inject(Fault {
            call: CallKind::SegmentAlloc,
            nth: 2,
            error: DeviceErrorKind::Driver("CUDA_ERROR_UNKNOWN".into()),
            sticky: false,
        });
        assert!(dev.segment_alloc(MIB).is_ok());
        assert!(dev.segment_alloc(MIB).is_err());
        assert!(dev.segment_alloc(MIB).is_ok());
    }

    #[test]
    fn uses_complete_with_their_stream_and_flag_early_unmaps() {
        let dev = SimDevice::with_capacity(8 * MIB);
        let base = dev.address_reserve(4 * MIB).unwrap();
        let h = dev.physical_create(2 * MIB).unwrap();
        dev.map(base, 2 * MIB, h, 0).unwrap();
        let a = StreamId(1);
        let b = StreamId(2);
        let u1 = dev.enqueue_use(a, base + 512, 1024);
        let u2 = dev.enqueue_use(b, base + 4096, 512);
        let e = dev.record_event(a).unwrap();
        let u3 = dev.enqueue_use(a, base, 512);
        assert_eq!(dev.pending_uses().len(), 3);
        assert_eq!(dev.pending_uses_overlapping(base, 1024).len(), 2);
        assert!(dev.pending_uses_overlapping(base + 2048, 1024).is_empty());
        // The event recorded after u1 completes u1, not u3.
        dev.complete_event(e);
        let left: Vec<UseId> = dev.pending_uses().iter().map(|u| u.id).collect();
        assert_eq!(left, vec![u2, u3]);
        assert_eq!(dev.pending_event_ids(), vec![e]);
        dev.complete_use(u3);
        assert!(dev.pending_uses_overlapping(base, 512).is_empty());
        // Unmapping while stream b still uses the page is a violation.
        dev.unmap(base, 2 * MIB).unwrap();
        let v = dev.take_violations();
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].call, CallKind::Unmap);
        assert_eq!(v[0].uses[0].id, u2);
        assert!(v[0].to_string().contains("stream 0x2"));
        let _ = u1;
        assert!(dev.take_violations().is_empty());
    }

    #[test]
    fn segment_free_synchronizes_unless_told_otherwise() {
        let dev = SimDevice::with_capacity(8 * MIB);
        let p = dev.segment_alloc(2 * MIB).unwrap();
        dev.enqueue_use(StreamId(3), p, 512);
        dev.segment_free(p, 2 * MIB).unwrap();
        assert!(dev.take_violations().is_empty());
        assert!(dev.pending_uses().is_empty());
        dev.set_free_synchronizes(false);
        let p = dev.segment_alloc(2 * MIB).unwrap();
        dev.enqueue_use(StreamId(3), p + 1024, 512);
        dev.segment_free(p, 2 * MIB).unwrap();
        let v = dev.take_violations();
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].call, CallKind::SegmentFree);
    }

    #[test]
    fn latency_is_charged_per_call() {
        let dev = SimDevice::new();
        dev.segment_alloc(2 * MIB).unwrap();
        assert_eq!(dev.call_counts().simulated_ns(), 52_700);
    }

    #[test]
    fn access_to_a_range_costs_one_grant_per_mapping_in_it() {
        let latency = LatencyModel::h100();
        let grant = |bytes| latency.of(CallKind::SetAccess, bytes);
        let dev = SimDevice::new();
        let base = dev.address_reserve(64 * MIB).unwrap();
        let sizes = [2 * MIB, 2 * MIB, 20 * MIB];
        let mut va = base;
        for size in sizes {
            let handle = dev.physical_create(size).unwrap();
            dev.map(va, size, handle, 0).unwrap();
            va += size;
        }
        let cost = |f: &dyn Fn()| {
            let before = dev.call_counts().simulated_ns();
            f();
            dev.call_counts().simulated_ns() - before
        };
        let all = cost(&|| dev.set_access(base, 24 * MIB).unwrap());
        assert_eq!(all, 2 * grant(2 * MIB) + grant(20 * MIB));
        assert!(
            all > grant(24 * MIB),
            "more than one grant of the range's size"
        );
        assert_eq!(
            cost(&|| dev.set_access(base, 2 * MIB).unwrap()),
            grant(2 * MIB)
        );
        // Nothing mapped: refused, at one grant's cost.
        let refused = cost(&|| assert!(dev.set_access(base + 40 * MIB, 2 * MIB).is_err()));
        assert_eq!(refused, grant(2 * MIB));
    }
}

//! Policy `pytorch`: PyTorch's native CUDA caching allocator, decision for decision.
//!
//! This follows `c10/cuda/CUDACachingAllocator.cpp` (`DeviceCachingAllocator`)
//! closely, function by function, so that a replay of a real snapshot makes the
//! same `segment_alloc`/`segment_free`/`segment_map`/`segment_unmap` decisions
//! in the same order. Function names match PyTorch's where they do the same
//! thing, so the two can be read side by side. Deliberate differences:
//!
//! - After every retry fails, the pool is searched once more before raising
//!   out-of-memory (PyTorch #189504: blocks freed by the event synchronization
//!   were never looked at). This only changes runs where PyTorch would have
//!   raised, so fidelity is unaffected.
//! - A virtual-memory map that fails part-way unmaps and releases what it
//!   mapped and reports an error (PyTorch #188008 crashed).
//! - Streams' pending events are processed in stream order (PyTorch iterates a
//!   hash map), so runs are deterministic.
//! - Unmapping that fails part-way keeps the books exact: the pages already
//!   unmapped become an unmapped block, the rest stays mapped, and physical
//!   memory the driver refused to release (or could not unmap while undoing
//!   a failed map) is kept as "stray" memory, counted as reserved, and
//!   released by the next `empty_cache` or out-of-memory retry. So is an
//!   event whose synchronization failed. (Found by the simulation harness,
//!   `tests/simulation.rs`.)

use std::collections::BTreeSet;

use crate::config::{PytorchConfig, MIN_BLOCK_SIZE};
use crate::device::{Device, DevicePtr, PhysicalHandle, StreamId};
use crate::error::{AllocError, OomReport, OomVerdict};
use crate::events::{PendingEvents, Poll};
use crate::fastmap::FastMap;
use crate::history::{Action, History};
use crate::policy::PolicyState;
use crate::snapshot::SegmentImage;
use crate::snapshot::{BlockSnapshot, BlockState, SegmentSnapshot};
use crate::stats::{decrease_pool, increase_pool, pool_rows, Stat};

/// Deliberately broken behaviour, for proving that the simulation harness
/// catches it (test builds only).
#[cfg(test)]
pub(crate) mod testing {
    use std::cell::Cell;

    thread_local! {
        /// When set, freed blocks are never merged with their free neighbours.
        pub(crate) static SKIP_COALESCING: Cell<bool> = const { Cell::new(false) };
    }
}

const MIB: u64 = 1 << 20;
/// Largest "small" request (`kSmallSize`).
const SMALL_SIZE: u64 = MIB;
/// Segment size for small requests, and the small expandable page (`kSmallBuffer`).
const SMALL_BUFFER: u64 = 2 * MIB;
/// Large requests under this get one `large_segment_size` segment (`kMinLargeAlloc`).
const MIN_LARGE_ALLOC: u64 = 10 * MIB;
/// Larger requests round their segment up to this (`kRoundLarge`).
const ROUND_LARGE: u64 = 2 * MIB;

type BlockId = u32;
const NO_BLOCK: BlockId = u32::MAX;

#[derive(Clone, Debug)]
struct Block {
    ptr: DevicePtr,
    size: u64,
    requested_size: u64,
    stream: StreamId,
    small: bool,
    prev: BlockId,
    next: BlockId,
    allocated: bool,
    mapped: bool,
    event_count: u32,
    stream_uses: Vec<StreamId>,
    /// Index into `expandable_segments` for virtual-memory backed blocks.
    expandable: Option<u32>,
    gc_count_base: u64,
}

impl Block {
    fn new(ptr: DevicePtr, size: u64, stream: StreamId, small: bool) -> Self {
        Block {
            ptr,
            size,
            requested_size: 0,
            stream,
            small,
            prev: NO_BLOCK,
            next: NO_BLOCK,
            allocated: false,
            mapped: true,
            event_count: 0,
            stream_uses: Vec::new(),
            expandable: None,
            gc_count_base: 0,
        }
    }

    fn is_split(&self) -> bool {
        self.prev != NO_BLOCK || self.next != NO_BLOCK
    }
}

/// Free blocks of one pool: `blocks` ordered like PyTorch's
/// `BlockComparatorSize` (stream, size, address), and the unmapped ranges of
/// expandable segments ordered by (stream, address).
#[derive(Debug, Default)]
struct BlockPool {
    blocks: BTreeSet<(StreamId, u64, DevicePtr, BlockId)>,
    unmapped: BTreeSet<(StreamId, DevicePtr, BlockId)>,
    get_free_blocks_call_count: u64,
}

/// A virtual range whose pages are mapped on demand (PyTorch's `ExpandableSegment`).
#[derive(Debug)]
struct ExpandableSegment {
    base: DevicePtr,
    reserved_size: u64,
    page_size: u64,
    stream: StreamId,
    handles: Vec<Option<PhysicalHandle>>,
}

/// Physical memory the policy still holds but no block describes: the driver
/// refused to release it (or to unmap it while undoing a failed map).
#[derive(Debug)]
struct StrayPage {
    handle: PhysicalHandle,
    /// Where it is still mapped, if unmapping it failed.
    mapped_at: Option<DevicePtr>,
    size: u64,
    small: bool,
}

/// The `pytorch` policy's state for one device.
#[derive(Debug)]
pub(crate) struct PytorchPolicy {
    config: PytorchConfig,
    blocks: Vec<Block>,
    free_block_ids: Vec<BlockId>,
    /// Index 0: large pool, 1: small pool.
    pools: [BlockPool; 2],
    allocated_blocks: FastMap<DevicePtr, BlockId>,
    expandable_segments: Vec<Option<ExpandableSegment>>,
    /// End-of-use events of freed blocks other streams used.
    events: PendingEvents<BlockId>,
    /// Bytes held from the driver (PyTorch's `total_allocated_memory`).
    total_allocated_memory: u64,
    /// Statistics, history, device size, memory fraction, capture flag.
    state: PolicyState,
    /// Pages to release at the next `release_cached_blocks` (counted as reserved).
    stray_pages: Vec<StrayPage>,
}

fn pool_index(small: bool) -> usize {
    usize::from(small)
}

impl PytorchPolicy {
    pub(crate) fn new(config: PytorchConfig, device_total: u64, history: History) -> Self {
        PytorchPolicy {
            blocks: Vec::new(),
            free_block_ids: Vec::new(),
            pools: [BlockPool::default(), BlockPool::default()],
            allocated_blocks: FastMap::default(),
            expandable_segments: Vec::new(),
            events: PendingEvents::default(),
            total_allocated_memory: 0,
            state: PolicyState::new(
                config.initial_stats(),
                history,
                device_total,
                config.per_process_memory_fraction,
            ),
            config,
            stray_pages: Vec::new(),
        }
    }

    // ----- block arena -----

    fn new_block(&mut self, block: Block) -> BlockId {
        if let Some(id) = self.free_block_ids.pop() {
            self.blocks[id as usize] = block;
            id
        } else {
            self.blocks.push(block);
            (self.blocks.len() - 1) as BlockId
        }
    }

    fn delete_block(&mut self, id: BlockId) {
        self.blocks[id as usize].size = 0;
        self.free_block_ids.push(id);
    }

    fn b(&self, id: BlockId) -> &Block {
        &self.blocks[id as usize]
    }

    fn bm(&mut self, id: BlockId) -> &mut Block {
        &mut self.blocks[id as usize]
    }

    fn pool_insert(&mut self, id: BlockId) {
        let b = &self.blocks[id as usize];
        let pool = &mut self.pools[pool_index(b.small)];
        let key = (b.stream, b.size, b.ptr, id);
        let inserted = pool.blocks.insert(key);
        debug_assert!(inserted, "block already in pool");
        let count = pool.get_free_blocks_call_count;
        self.blocks[id as usize].gc_count_base = count;
    }

    fn pool_erase(&mut self, id: BlockId) -> bool {
        let b = &self.blocks[id as usize];
        self.pools[pool_index(b.small)]
            .blocks
            .remove(&(b.stream, b.size, b.ptr, id))
    }

    fn unmapped_insert(&mut self, id: BlockId) {
        let b = &self.blocks[id as usize];
        self.pools[pool_index(b.small)]
            .unmapped
            .insert((b.stream, b.ptr, id));
    }

    fn unmapped_erase(&mut self, id: BlockId) -> bool {
        let b = &self.blocks[id as usize];
        self.pools[pool_index(b.small)]
            .unmapped
            .remove(&(b.stream, b.ptr, id))
    }

    // ----- sizes -----

    fn allocation_size(&self, size: u64) -> u64 {
        if size <= SMALL_SIZE {
            SMALL_BUFFER
        } else if size < MIN_LARGE_ALLOC {
            self.config.large_segment_size
        } else {
            size.div_ceil(ROUND_LARGE) * ROUND_LARGE
        }
    }

    fn should_split(&self, id: BlockId, size: u64) -> bool {
        let b = self.b(id);
        let remaining = b.size - size;
        if b.small || self.config.expandable_segments {
            remaining >= MIN_BLOCK_SIZE
        } else {
            size < self.config.max_split_size && remaining > SMALL_SIZE
        }
    }

    fn gc_enabled(&self) -> bool {
        self.state.limit_bytes.is_some() && self.config.garbage_collection_threshold > 0.0
    }

    // ----- malloc -----

    pub(crate) fn malloc(
        &mut self,
        dev: &dyn Device,
        orig_size: u64,
        stream: StreamId,
    ) -> Result<DevicePtr, AllocError> {
        self.process_events(dev)?;
        let size = self.config.round_size(orig_size);
        let small = size <= SMALL_SIZE;
        let alloc_size = self.allocation_size(size);

        let mut found = self.get_free_block(small, stream, size);
        // During a capture no memory is given back: only new memory.
        let may_release = !self.state.capture_underway;
        if found.is_none() {
            if self.gc_enabled() && may_release {
                self.garbage_collect_cached_blocks(dev)?;
            }
            found = self.alloc_block(dev, small, stream, size, alloc_size, false)?;
            if found.is_none()
                && may_release
                && self.release_available_cached_blocks(dev, small, stream, size)?
            {
                found = self.alloc_block(dev, small, stream, size, alloc_size, false)?;
            }
            if found.is_none() && may_release {
                self.release_cached_blocks(dev)?;
                found = self.alloc_block(dev, small, stream, size, alloc_size, true)?;
            }
            if found.is_none() {
                // Our fix for PyTorch #189504: the synchronization above may
                // have returned blocks to the pool that fit.
                found = self.get_free_block(small, stream, size);
            }
        }
        let Some(block) = found else {
            return Err(self.out_of_memory(dev, orig_size, size, alloc_size, stream));
        };
        let split = self.should_split(block, size);
        Ok(self.alloc_found_block(block, size, orig_size, split))
    }

    fn get_free_block(&mut self, small: bool, stream: StreamId, size: u64) -> Option<BlockId> {
        let gc = self.gc_enabled();
        let expandable_enabled = self.config.expandable_segments;
        let max_split = self.config.max_split_size;
        let max_non_split_rounding = self.config.max_non_split_rounding;
        let pool = &mut self.pools[pool_index(small)];
        if gc {
            pool.get_free_blocks_call_count += 1;
        }
        let mut range = pool.blocks.range((stream, size, 0, 0)..);
        let mut key = *range.next()?;
        if key.0 != stream {
            return None;
        }
        let blocks = &self.blocks;
        if blocks[key.3 as usize].expandable.is_some() {
            if expandable_enabled {
                // Best fit counts a free block followed by unmapped space as
                // the size it can grow to.
                let expandable_size = |id: BlockId| {
                    let b = &blocks[id as usize];
                    let next_unmapped = if b.next != NO_BLOCK && !blocks[b.next as usize].mapped {
                        blocks[b.next as usize].size
                    } else {
                        0
                    };
                    b.size + next_unmapped
                };
                for next in range {
                    if blocks[key.3 as usize].expandable.is_none()
                        || next.0 != stream
                        || expandable_size(next.3) >= expandable_size(key.3)
                    {
                        break;
                    }
                    key = *next;
                }
            } else {
                let mut candidate = None;
                for next in range {
                    if next.0 != stream {
                        return None;
                    }
                    if blocks[next.3 as usize].expandable.is_none() {
                        candidate = Some(*next);
                        break;
                    }
                }
                key = candidate?;
            }
        }
        let block_size = key.1;
        // Oversize rules: small requests never take an oversize block; large
        // requests only take one that wastes less than max_non_split_rounding.
        if size < max_split && block_size >= max_split {
            return None;
        }
        if size >= max_split && block_size >= size.saturating_add(max_non_split_rounding) {
            return None;
        }
        let pool = &mut self.pools[pool_index(small)];
        pool.blocks.remove(&key);
        let count = pool.get_free_blocks_call_count;
        if gc {
            self.blocks[key.3 as usize].gc_count_base = count;
        }
        Some(key.3)
    }

    /// Gets new memory from the driver. `Ok(None)` means the driver (or the
    /// memory fraction) said out of memory; any other driver error is returned.
    fn alloc_block(
        &mut self,
        dev: &dyn Device,
        small: bool,
        stream: StreamId,
        size: u64,
        alloc_size: u64,
        is_retry: bool,
    ) -> Result<Option<BlockId>, AllocError> {
        if is_retry {
            self.state.stats.num_alloc_retries += 1;
        }
        if let Some(max) = self.state.limit_bytes {
            if self.total_allocated_memory + alloc_size > max {
                return Ok(None);
            }
        }
        if self.config.expandable_segments {
            return self.try_allocate_expandable_block(dev, small, stream, size);
        }
        let ptr = match dev.segment_alloc(alloc_size) {
            Ok(ptr) => ptr,
            Err(e) if e.is_out_of_memory() => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        self.total_allocated_memory += alloc_size;
        let id = self.new_block(Block::new(ptr, alloc_size, stream, small));
        increase_pool(&mut self.state.stats.segment, small, 1);
        increase_pool(&mut self.state.stats.reserved_bytes, small, alloc_size);
        if alloc_size >= self.config.max_split_size {
            self.state.stats.oversize_segments.increase(1);
        }
        self.state.stats.num_device_alloc += 1;
        self.state
            .history
            .record(Action::SegmentAlloc, ptr, alloc_size, stream);
        Ok(Some(id))
    }

    fn alloc_found_block(
        &mut self,
        id: BlockId,
        size: u64,
        orig_size: u64,
        split: bool,
    ) -> DevicePtr {
        let small = self.b(id).small;
        let already_split = self.b(id).is_split();
        let expandable = self.b(id).expandable.is_some();
        let mut block = id;
        if split {
            let remaining = id;
            let (ptr, stream, prev) = {
                let r = self.b(remaining);
                (r.ptr, r.stream, r.prev)
            };
            let mut new = Block::new(ptr, size, stream, small);
            new.expandable = self.b(remaining).expandable;
            new.prev = prev;
            new.next = remaining;
            block = self.new_block(new);
            if prev != NO_BLOCK {
                self.bm(prev).next = block;
            }
            let r = self.bm(remaining);
            r.prev = block;
            r.ptr += size;
            r.size -= size;
            let remaining_size = r.size;
            self.pool_insert(remaining);
            if already_split && !expandable {
                // An already-split inactive block shrinks by `size` bytes.
                decrease_pool(&mut self.state.stats.inactive_split_bytes, small, size);
            } else if !expandable {
                // A new inactive split block is created from an unsplit one.
                increase_pool(
                    &mut self.state.stats.inactive_split_bytes,
                    small,
                    remaining_size,
                );
                increase_pool(&mut self.state.stats.inactive_split, small, 1);
            }
        } else if already_split && !expandable {
            let block_size = self.b(id).size;
            decrease_pool(
                &mut self.state.stats.inactive_split_bytes,
                small,
                block_size,
            );
            decrease_pool(&mut self.state.stats.inactive_split, small, 1);
        }
        let b = self.bm(block);
        b.allocated = true;
        b.requested_size = orig_size;
        let (ptr, block_size, stream) = (b.ptr, b.size, b.stream);
        self.state
            .history
            .record(Action::Alloc, ptr, orig_size, stream);
        self.allocated_blocks.insert(ptr, block);
        increase_pool(&mut self.state.stats.allocation, small, 1);
        increase_pool(&mut self.state.stats.allocated_bytes, small, block_size);
        increase_pool(&mut self.state.stats.active, small, 1);
        increase_pool(&mut self.state.stats.active_bytes, small, block_size);
        increase_pool(&mut self.state.stats.requested_bytes, small, orig_size);
        if block_size >= self.config.max_split_size {
            self.state.stats.oversize_allocations.increase(1);
        }
        ptr
    }

    // ----- free -----

    pub(crate) fn live_size(&self, ptr: DevicePtr) -> Option<u64> {
        self.allocated_blocks.get(&ptr).map(|&id| self.b(id).size)
    }

    pub(crate) fn free(&mut self, dev: &dyn Device, ptr: DevicePtr) -> Result<(), AllocError> {
        let Some(id) = self.allocated_blocks.remove(&ptr) else {
            return Err(AllocError::UnknownPointer { ptr });
        };
        let b = self.bm(id);
        b.allocated = false;
        let (small, size, requested, stream) = (b.small, b.size, b.requested_size, b.stream);
        decrease_pool(&mut self.state.stats.allocation, small, 1);
        decrease_pool(&mut self.state.stats.allocated_bytes, small, size);
        self.state
            .history
            .record(Action::FreeRequested, ptr, requested, stream);
        if size >= self.config.max_split_size {
            self.state.stats.oversize_allocations.decrease(1);
        }
        if self.b(id).stream_uses.is_empty() {
            self.free_block(id);
            Ok(())
        } else if self.state.capture_underway {
            self.events.defer(id);
            Ok(())
        } else {
            self.insert_events(dev, id)
        }
    }

    /// A capture began (`true`) or the last one ended: see [`crate::capture`].
    /// At the end, the events of the blocks freed during it are recorded.
    pub(crate) fn set_capture_underway(
        &mut self,
        dev: &dyn Device,
        underway: bool,
    ) -> Result<(), AllocError> {
        self.state.capture_underway = underway;
        if underway {
            return Ok(());
        }
        let deferred = self.events.take_deferred();
        crate::capture::record_deferred(deferred, |id| self.insert_events(dev, id))
    }

    pub(crate) fn record_stream(
        &mut self,
        ptr: DevicePtr,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        let Some(&id) = self.allocated_blocks.get(&ptr) else {
            return Err(AllocError::UnknownPointer { ptr });
        };
        let b = self.bm(id);
        // Uses on the allocation stream need no synchronization.
        if stream != b.stream && !b.stream_uses.contains(&stream) {
            b.stream_uses.push(stream);
        }
        Ok(())
    }

    fn insert_events(&mut self, dev: &dyn Device, id: BlockId) -> Result<(), AllocError> {
        let mut streams = std::mem::take(&mut self.bm(id).stream_uses);
        streams.sort();
        let (recorded, result) = self.events.record(dev, id, &streams);
        self.bm(id).event_count += recorded;
        // Uses no event covers stay, so the block is never reused while
        // those streams may touch it; a later empty_cache or OOM retry
        // synchronizes the device.
        result.map_err(|(uncovered, e)| {
            self.bm(id).stream_uses = uncovered;
            e.into()
        })
    }

    fn process_events(&mut self, dev: &dyn Device) -> Result<(), AllocError> {
        if self.events.is_empty() || self.state.capture_underway {
            return Ok(());
        }
        let mut poll = Poll::new();
        while let Some(id) = self.events.next_completed(dev, &mut poll)? {
            self.event_completed(id);
        }
        Ok(())
    }

    fn event_completed(&mut self, id: BlockId) {
        let b = self.bm(id);
        b.event_count -= 1;
        if b.event_count == 0 && b.stream_uses.is_empty() {
            self.free_block(id);
        }
    }

    fn synchronize_and_free_events(&mut self, dev: &dyn Device) -> Result<(), AllocError> {
        self.state.stats.num_sync_all_streams += 1;
        // Blocks whose event could not be recorded wait on a whole-device sync.
        let stranded: Vec<BlockId> = self.allocated_blocks_stranded().into_iter().collect();
        if !stranded.is_empty() {
            dev.synchronize_device()?;
        }
        for id in stranded {
            self.bm(id).stream_uses.clear();
            if self.b(id).event_count == 0 {
                self.free_block(id);
            }
        }
        while let Some(id) = self.events.wait_next(dev)? {
            self.event_completed(id);
        }
        Ok(())
    }

    /// Freed blocks still carrying stream uses because recording their event failed.
    fn allocated_blocks_stranded(&self) -> Vec<BlockId> {
        let mut ids: Vec<BlockId> = self
            .blocks
            .iter()
            .enumerate()
            .filter(|(_, b)| b.size > 0 && !b.allocated && !b.stream_uses.is_empty())
            .map(|(i, _)| i as BlockId)
            .collect();
        ids.sort_by_key(|&id| self.b(id).ptr);
        ids
    }

    fn try_merge_blocks(&mut self, dst: BlockId, src: BlockId) -> u64 {
        if src == NO_BLOCK {
            return 0;
        }
        #[cfg(test)]
        if testing::SKIP_COALESCING.with(|skip| skip.get()) {
            return 0;
        }
        {
            let s = self.b(src);
            if s.allocated
                || s.event_count > 0
                || !s.stream_uses.is_empty()
                || s.mapped != self.b(dst).mapped
            {
                return 0;
            }
        }
        let erased = if self.b(src).mapped {
            self.pool_erase(src)
        } else {
            self.unmapped_erase(src)
        };
        debug_assert!(erased, "mergeable block not in its pool");
        let (src_ptr, src_prev, src_next, src_size) = {
            let s = self.b(src);
            (s.ptr, s.prev, s.next, s.size)
        };
        if self.b(dst).prev == src {
            // [src dst]
            let d = self.bm(dst);
            d.ptr = src_ptr;
            d.prev = src_prev;
            if src_prev != NO_BLOCK {
                self.bm(src_prev).next = dst;
            }
        } else {
            // [dst src]
            self.bm(dst).next = src_next;
            if src_next != NO_BLOCK {
                self.bm(src_next).prev = dst;
            }
        }
        self.bm(dst).size += src_size;
        self.delete_block(src);
        src_size
    }

    fn free_block(&mut self, id: BlockId) {
        let (ptr, requested, stream, small, original_size, prev, next) = {
            let b = self.b(id);
            debug_assert!(!b.allocated && b.event_count == 0 && b.stream_uses.is_empty());
            (
                b.ptr,
                b.requested_size,
                b.stream,
                b.small,
                b.size,
                b.prev,
                b.next,
            )
        };
        self.state
            .history
            .record(Action::FreeCompleted, ptr, requested, stream);
        let mut net_blocks: i64 = 0;
        let mut net_bytes: i64 = 0;
        for candidate in [prev, next] {
            let subsumed = self.try_merge_blocks(id, candidate);
            if subsumed > 0 {
                net_blocks -= 1;
                net_bytes -= subsumed as i64;
            }
        }
        self.pool_insert(id);
        let b = self.b(id);
        if b.is_split() {
            net_blocks += 1;
            net_bytes += b.size as i64;
        }
        // Expandable segments are left out of inactive_split: their fully free
        // pages can always be released.
        if b.expandable.is_none() {
            for t in pool_rows(small) {
                apply_net(&mut self.state.stats.inactive_split[t], net_blocks);
                apply_net(&mut self.state.stats.inactive_split_bytes[t], net_bytes);
            }
        }
        decrease_pool(&mut self.state.stats.active, small, 1);
        decrease_pool(&mut self.state.stats.active_bytes, small, original_size);
        decrease_pool(&mut self.state.stats.requested_bytes, small, requested);
        self.bm(id).requested_size = 0;
    }

    // ----- releasing memory -----

    pub(crate) fn empty_cache(&mut self, dev: &dyn Device) -> Result<(), AllocError> {
        self.release_cached_blocks(dev)
    }

    fn release_cached_blocks(&mut self, dev: &dyn Device) -> Result<(), AllocError> {
        self.release_strays(dev)?;
        self.synchronize_and_free_events(dev)?;
        self.release_blocks(dev, false)?;
        self.release_blocks(dev, true)
    }

    fn release_blocks(&mut self, dev: &dyn Device, small: bool) -> Result<(), AllocError> {
        let keys: Vec<(StreamId, u64, DevicePtr, BlockId)> = self.pools[pool_index(small)]
            .blocks
            .iter()
            .copied()
            .collect();
        let mut to_unmap = Vec::new();
        for (_, _, _, id) in keys {
            let b = self.b(id);
            if b.expandable.is_some() {
                to_unmap.push(id);
            } else if !b.is_split() {
                self.release_block(dev, id)?;
            }
        }
        for id in to_unmap {
            let id = self.unmap_block(dev, id)?;
            if !self.b(id).is_split() {
                self.release_expandable_segment(dev, id)?;
            }
        }
        Ok(())
    }

    /// Retires events and releases pages left over by failed driver calls.
    fn release_strays(&mut self, dev: &dyn Device) -> Result<(), AllocError> {
        self.events.retire_strays(dev)?;
        while let Some(page) = self.stray_pages.last_mut() {
            if let Some(va) = page.mapped_at {
                dev.unmap(va, page.size)?;
                page.mapped_at = None;
            }
            dev.physical_release(page.handle)?;
            let (size, small) = (page.size, page.small);
            self.stray_pages.pop();
            self.total_allocated_memory -= size;
            decrease_pool(&mut self.state.stats.reserved_bytes, small, size);
            self.state.stats.num_device_free += 1;
        }
        Ok(())
    }

    fn release_block(&mut self, dev: &dyn Device, id: BlockId) -> Result<(), AllocError> {
        let (ptr, size, stream, small) = {
            let b = self.b(id);
            debug_assert!(b.expandable.is_none() && !b.is_split());
            (b.ptr, b.size, b.stream, b.small)
        };
        dev.segment_free(ptr, size)?;
        self.state.stats.num_device_free += 1;
        self.state
            .history
            .record(Action::SegmentFree, ptr, size, stream);
        self.total_allocated_memory -= size;
        decrease_pool(&mut self.state.stats.segment, small, 1);
        decrease_pool(&mut self.state.stats.reserved_bytes, small, size);
        if size >= self.config.max_split_size {
            self.state.stats.oversize_segments.decrease(1);
        }
        self.pool_erase(id);
        self.delete_block(id);
        Ok(())
    }

    /// With `max_split_size` set: frees one cached oversize block that covers
    /// the request, or oversize blocks from the largest down until enough.
    fn release_available_cached_blocks(
        &mut self,
        dev: &dyn Device,
        small: bool,
        stream: StreamId,
        size: u64,
    ) -> Result<bool, AllocError> {
        let max_split = self.config.max_split_size;
        if max_split == u64::MAX {
            return Ok(false);
        }
        let key_size = size.max(max_split);
        let pool = &self.pools[pool_index(small)];
        let at = pool
            .blocks
            .range((stream, key_size, 0, 0)..)
            .next()
            .copied();
        let single = at.filter(|k| k.0 == stream && self.b(k.3).expandable.is_none());
        if let Some(k) = single {
            if !self.b(k.3).is_split() {
                self.release_block(dev, k.3)?;
                return Ok(true);
            }
        }
        // No single block is large enough: free oversize blocks of this
        // stream from the largest down.
        let candidates: Vec<(StreamId, u64, DevicePtr, BlockId)> = pool
            .blocks
            .range(..(stream, key_size, 0, 0))
            .rev()
            .take_while(|k| k.0 == stream && k.1 >= max_split)
            .copied()
            .collect();
        let mut released = 0;
        for k in candidates {
            if released >= key_size {
                break;
            }
            let b = self.b(k.3);
            if b.expandable.is_none() && !b.is_split() {
                released += k.1;
                self.release_block(dev, k.3)?;
            }
        }
        Ok(released >= key_size)
    }

    fn garbage_collect_cached_blocks(&mut self, dev: &dyn Device) -> Result<(), AllocError> {
        let Some(max) = self.state.limit_bytes else {
            return Ok(());
        };
        let threshold = (self.config.garbage_collection_threshold * max as f64) as u64;
        if self.total_allocated_memory <= threshold {
            return Ok(());
        }
        let target = self.total_allocated_memory - threshold;
        let count = self.pools[0].get_free_blocks_call_count;
        let age = |b: &Block| count - b.gc_count_base;
        let mut total_age: u64 = 0;
        let mut freeable: u64 = 0;
        for &(_, _, _, id) in &self.pools[0].blocks {
            let b = self.b(id);
            if !b.is_split() {
                total_age += age(b);
                freeable += 1;
            }
        }
        let mut reclaimed = 0;
        let mut block_freed = true;
        while reclaimed < target && block_freed && freeable > 0 {
            let age_threshold = total_age as f64 / freeable as f64;
            block_freed = false;
            let keys: Vec<_> = self.pools[0].blocks.iter().copied().collect();
            for (_, size, _, id) in keys {
                let b = self.b(id);
                if !b.is_split() && b.expandable.is_none() && age(b) as f64 >= age_threshold {
                    block_freed = true;
                    reclaimed += size;
                    total_age -= age(b);
                    freeable -= 1;
                    self.release_block(dev, id)?;
                }
            }
        }
        Ok(())
    }

    // ----- expandable segments -----

    fn try_allocate_expandable_block(
        &mut self,
        dev: &dyn Device,
        small: bool,
        stream: StreamId,
        size: u64,
    ) -> Result<Option<BlockId>, AllocError> {
        // One allocation cannot span segments: a request larger than a
        // segment's address space fails as out of memory, however much is free.
        if size > self.expandable_reserve_bytes(small) {
            return Ok(None);
        }
        let mut candidate = self.find_expandable_block(dev, small, stream, size)?;
        if !self.b(candidate).mapped {
            let map_size = self.b(candidate).size.min(size);
            match self.map_block(dev, candidate, map_size)? {
                Some(id) => candidate = id,
                None => return Ok(None),
            }
        }
        while self.b(candidate).size < size {
            // Invariant: free -> unmapped -> ...; map part of the unmapped
            // block, which merges into the free one.
            let remaining = size - self.b(candidate).size;
            let next = self.b(candidate).next;
            let map_size = remaining.min(self.b(next).size);
            match self.map_block(dev, next, map_size)? {
                Some(id) => candidate = id,
                None => return Ok(None),
            }
        }
        self.pool_erase(candidate);
        Ok(Some(candidate))
    }

    fn expandable_page_size(&self, small: bool) -> u64 {
        if small {
            SMALL_BUFFER
        } else {
            self.config.large_segment_size
        }
    }

    /// The address space one expandable segment of the pool reserves: by
    /// default 9/8 of the device, so pages can be unmapped early and remapped
    /// at the end, and never more than that whatever the setting asks, as
    /// PyTorch clamps it. PyTorch computes `total + total / 8`; `total / 8 * 9`
    /// can come out a page short.
    fn expandable_reserve_bytes(&self, small: bool) -> u64 {
        let total = self.state.device_total;
        let full = total.saturating_add(total / 8);
        let wanted = self
            .config
            .expandable_segments_reserve
            .map_or(full, |spec| spec.bytes(total).min(full));
        let page_size = self.expandable_page_size(small);
        wanted.div_ceil(page_size).max(1).saturating_mul(page_size)
    }

    fn find_expandable_block(
        &mut self,
        dev: &dyn Device,
        small: bool,
        stream: StreamId,
        size: u64,
    ) -> Result<BlockId, AllocError> {
        let allocatable = |policy: &Self, id: BlockId| {
            id != NO_BLOCK && {
                let b = policy.b(id);
                !b.allocated && b.event_count == 0 && b.stream_uses.is_empty()
            }
        };
        let has_room = |policy: &Self, mut id: BlockId| {
            let mut bytes = 0;
            while bytes < size && allocatable(policy, id) {
                bytes += policy.b(id).size;
                id = policy.b(id).next;
            }
            bytes >= size
        };
        let unmapped: Vec<BlockId> = self.pools[pool_index(small)]
            .unmapped
            .range((stream, 0, 0)..)
            .take_while(|k| k.0 == stream)
            .map(|k| k.2)
            .collect();
        for mut c in unmapped {
            // There may be a free block right before the unmapped range.
            let prev = self.b(c).prev;
            if allocatable(self, prev) {
                c = prev;
            }
            if has_room(self, c) {
                return Ok(c);
            }
        }
        let page_size = self.expandable_page_size(small);
        let reserved_size = self.expandable_reserve_bytes(small);
        let base = dev.address_reserve(reserved_size)?;
        let index = self.expandable_segments.len() as u32;
        self.expandable_segments.push(Some(ExpandableSegment {
            base,
            reserved_size,
            page_size,
            stream,
            handles: Vec::new(),
        }));
        let mut block = Block::new(base, reserved_size, stream, small);
        block.mapped = false;
        block.expandable = Some(index);
        let id = self.new_block(block);
        self.unmapped_insert(id);
        Ok(id)
    }

    /// Maps the pages covering `[ptr, ptr + size)`; returns the mapped range,
    /// or `None` when the driver is out of memory (nothing stays mapped).
    fn segment_map(
        &mut self,
        dev: &dyn Device,
        index: u32,
        ptr: DevicePtr,
        size: u64,
        small: bool,
    ) -> Result<Option<(DevicePtr, u64)>, AllocError> {
        // A page a failed undo could not unmap still occupies its address.
        // During a capture it stays there (nothing may be unmapped): a range
        // over it cannot be mapped until the capture ends.
        if self.stray_pages.iter().any(|p| p.mapped_at.is_some()) {
            if !self.state.capture_underway {
                self.release_strays(dev)?;
            } else if self.stray_pages.iter().any(|p| {
                p.mapped_at
                    .is_some_and(|at| at < ptr + size && ptr < at + p.size)
            }) {
                return Ok(None);
            }
        }
        let seg = self.expandable_segments[index as usize]
            .as_mut()
            .expect("live expandable segment");
        let page = seg.page_size;
        let begin = (ptr - seg.base) / page;
        let end = (ptr + size - seg.base).div_ceil(page);
        debug_assert_eq!(seg.base + begin * page, ptr);
        if seg.handles.len() < end as usize {
            seg.handles.resize(end as usize, None);
        }
        let mut created = Vec::new();
        // Undoes a failed map; returns what the driver would not give back.
        let undo = |seg: &mut ExpandableSegment,
                    created: &[(u64, PhysicalHandle)],
                    mapped: usize|
         -> Vec<StrayPage> {
            let mut stray = Vec::new();
            for (i, &(page_index, handle)) in created.iter().enumerate() {
                let va = seg.base + page_index * seg.page_size;
                seg.handles[page_index as usize] = None;
                if i < mapped && dev.unmap(va, seg.page_size).is_err() {
                    stray.push((handle, Some(va)));
                } else if dev.physical_release(handle).is_err() {
                    stray.push((handle, None));
                }
            }
            stray
                .into_iter()
                .map(|(handle, mapped_at)| StrayPage {
                    handle,
                    mapped_at,
                    size: seg.page_size,
                    small: false,
                })
                .collect()
        };
        for i in begin..end {
            debug_assert!(seg.handles[i as usize].is_none());
            match dev.physical_create(page) {
                Ok(handle) => {
                    seg.handles[i as usize] = Some(handle);
                    created.push((i, handle));
                }
                Err(e) => {
                    let stray = undo(seg, &created, 0);
                    self.keep_stray(stray, small);
                    return if e.is_out_of_memory() {
                        Ok(None)
                    } else {
                        Err(e.into())
                    };
                }
            }
        }
        for (n, &(i, handle)) in created.iter().enumerate() {
            if let Err(e) = dev.map(seg.base + i * page, page, handle, 0) {
                let stray = undo(seg, &created, n);
                self.keep_stray(stray, small);
                return Err(e.into());
            }
        }
        if let Err(e) = dev.set_access(seg.base + begin * page, (end - begin) * page) {
            let mapped = created.len();
            let stray = undo(seg, &created, mapped);
            self.keep_stray(stray, small);
            return Err(e.into());
        }
        Ok(Some((seg.base + begin * page, (end - begin) * page)))
    }

    /// Keeps pages a failed map could not give back, counted as reserved.
    fn keep_stray(&mut self, pages: Vec<StrayPage>, small: bool) {
        for mut page in pages {
            page.small = small;
            self.total_allocated_memory += page.size;
            increase_pool(&mut self.state.stats.reserved_bytes, small, page.size);
            self.stray_pages.push(page);
        }
    }

    fn map_block(
        &mut self,
        dev: &dyn Device,
        id: BlockId,
        size: u64,
    ) -> Result<Option<BlockId>, AllocError> {
        let (ptr, index, small, stream, block_size, next) = {
            let b = self.b(id);
            debug_assert!(!b.mapped && size <= b.size);
            (
                b.ptr,
                b.expandable.expect("expandable"),
                b.small,
                b.stream,
                b.size,
                b.next,
            )
        };
        let Some((mapped_ptr, mapped_size)) = self.segment_map(dev, index, ptr, size, small)?
        else {
            return Ok(None);
        };
        debug_assert_eq!(mapped_ptr, ptr);
        self.unmapped_erase(id);
        self.bm(id).mapped = true;
        if mapped_size < block_size {
            let mut rest = Block::new(ptr + mapped_size, block_size - mapped_size, stream, small);
            rest.mapped = false;
            rest.expandable = Some(index);
            rest.prev = id;
            rest.next = next;
            let rest_id = self.new_block(rest);
            if next != NO_BLOCK {
                self.bm(next).prev = rest_id;
            }
            self.bm(id).next = rest_id;
            self.bm(id).size = mapped_size;
            self.unmapped_insert(rest_id);
        }
        let prev = self.b(id).prev;
        self.try_merge_blocks(id, prev);
        let next = self.b(id).next;
        self.try_merge_blocks(id, next);
        self.pool_insert(id);
        self.total_allocated_memory += mapped_size;
        increase_pool(&mut self.state.stats.reserved_bytes, small, mapped_size);
        self.state.stats.num_device_alloc += 1;
        self.state
            .history
            .record(Action::SegmentMap, mapped_ptr, mapped_size, stream);
        Ok(Some(id))
    }

    /// Unmaps the whole pages inside free block `id`; returns the block that
    /// now holds the unmapped range (or `id` when nothing was unmapped).
    fn unmap_block(&mut self, dev: &dyn Device, id: BlockId) -> Result<BlockId, AllocError> {
        let (ptr, size, index, small, stream) = {
            let b = self.b(id);
            (
                b.ptr,
                b.size,
                b.expandable.expect("expandable"),
                b.small,
                b.stream,
            )
        };
        let (base, page, seg_stream) = {
            let seg = self.expandable_segments[index as usize]
                .as_ref()
                .expect("live expandable segment");
            (seg.base, seg.page_size, seg.stream)
        };
        let begin = (ptr - base).div_ceil(page);
        let end = (ptr + size - base) / page;
        if begin >= end {
            return Ok(id);
        }
        // The stream may still be using the memory: wait for it first.
        self.events.wait_for_stream(dev, seg_stream)?;
        // Pages [begin, end) are unmapped one by one; a failure part-way
        // leaves [begin, i) unmapped (booked below) and the rest mapped.
        let mut failure = None;
        let mut unmapped_end = begin;
        let mut stray_bytes = 0;
        for i in begin..end {
            let handle = {
                let seg = self.expandable_segments[index as usize]
                    .as_mut()
                    .expect("live expandable segment");
                seg.handles[i as usize]
            };
            if let Some(handle) = handle {
                if let Err(e) = dev.unmap(base + i * page, page) {
                    failure = Some(e);
                    break;
                }
                if let Err(e) = dev.physical_release(handle) {
                    self.stray_pages.push(StrayPage {
                        handle,
                        mapped_at: None,
                        size: page,
                        small,
                    });
                    stray_bytes += page;
                    failure = Some(e);
                }
                if let Some(seg) = self.expandable_segments[index as usize].as_mut() {
                    seg.handles[i as usize] = None;
                }
            }
            unmapped_end = i + 1;
            if failure.is_some() {
                break;
            }
        }
        if unmapped_end == begin {
            if let Some(e) = failure {
                return Err(e.into());
            }
        }
        let end = unmapped_end;
        let unmapped_ptr = base + begin * page;
        let unmapped_size = (end - begin) * page;
        self.pool_erase(id);
        let before = unmapped_ptr - ptr;
        if before > 0 {
            let mut b = Block::new(ptr, before, stream, small);
            b.expandable = Some(index);
            let prev = self.b(id).prev;
            b.prev = prev;
            b.next = id;
            let new = self.new_block(b);
            if prev != NO_BLOCK {
                self.bm(prev).next = new;
            }
            self.bm(id).prev = new;
            self.pool_insert(new);
        }
        let after = size - before - unmapped_size;
        if after > 0 {
            let mut b = Block::new(unmapped_ptr + unmapped_size, after, stream, small);
            b.expandable = Some(index);
            let next = self.b(id).next;
            b.prev = id;
            b.next = next;
            let new = self.new_block(b);
            if next != NO_BLOCK {
                self.bm(next).prev = new;
            }
            self.bm(id).next = new;
            self.pool_insert(new);
        }
        {
            let b = self.bm(id);
            b.ptr = unmapped_ptr;
            b.size = unmapped_size;
            b.mapped = false;
        }
        let prev = self.b(id).prev;
        self.try_merge_blocks(id, prev);
        let next = self.b(id).next;
        self.try_merge_blocks(id, next);
        self.unmapped_insert(id);
        // Stray pages stay counted as reserved until they are released.
        self.total_allocated_memory -= unmapped_size - stray_bytes;
        decrease_pool(
            &mut self.state.stats.reserved_bytes,
            small,
            unmapped_size - stray_bytes,
        );
        self.state.stats.num_device_free += 1;
        self.state
            .history
            .record(Action::SegmentUnmap, unmapped_ptr, unmapped_size, stream);
        match failure {
            Some(e) => Err(e.into()),
            None => Ok(id),
        }
    }

    fn release_expandable_segment(
        &mut self,
        dev: &dyn Device,
        id: BlockId,
    ) -> Result<(), AllocError> {
        let index = self.b(id).expandable.expect("expandable");
        let seg = self.expandable_segments[index as usize]
            .take()
            .expect("live expandable segment");
        debug_assert_eq!(self.b(id).size, seg.reserved_size);
        self.unmapped_erase(id);
        self.delete_block(id);
        dev.address_free(seg.base, seg.reserved_size)?;
        Ok(())
    }

    // ----- out of memory -----

    fn out_of_memory(
        &mut self,
        dev: &dyn Device,
        requested: u64,
        rounded: u64,
        alloc_size: u64,
        stream: StreamId,
    ) -> AllocError {
        let device_free = dev.memory_info().map(|i| i.free_bytes).unwrap_or(0);
        self.state
            .history
            .record(Action::Oom, device_free, rounded, stream);
        self.state.stats.num_ooms += 1;
        let allocated = self.state.stats.allocated_bytes[0].current as u64;
        let largest_free = self
            .pools
            .iter()
            .flat_map(|p| p.blocks.iter())
            .map(|k| k.1)
            .max()
            .unwrap_or(0);
        let pending: u64 = self.events.iter().map(|&(_, id)| self.b(id).size).sum();
        let mut report = OomReport {
            requested_bytes: requested,
            rounded_bytes: rounded,
            device_request_bytes: alloc_size,
            stream,
            device_total_bytes: self.state.device_total,
            device_free_bytes: device_free,
            allocated_bytes: allocated,
            reserved_bytes: self.total_allocated_memory,
            cached_free_bytes: self.total_allocated_memory.saturating_sub(allocated),
            largest_free_block_bytes: largest_free,
            pending_free_bytes: pending,
            limit_bytes: self.state.limit_bytes,
            policy: "pytorch",
            free_granules: None,
            segment_reserve_bytes: self
                .config
                .expandable_segments
                .then(|| self.expandable_reserve_bytes(false))
                .filter(|&reserve| rounded > reserve),
            verdict: OomVerdict::RealDemand,
        };
        report.judge();
        AllocError::OutOfMemory(Box::new(report))
    }

    // ----- restoring a recorded state -----

    /// Recreates a segment as it was at a trace window's start: allocates it,
    /// carves its blocks, and leaves the free ones cached. Returns the address
    /// of each block.
    pub(crate) fn restore_segment(
        &mut self,
        dev: &dyn Device,
        image: &SegmentImage,
    ) -> Result<Vec<DevicePtr>, AllocError> {
        let total: u64 = image.blocks.iter().map(|b| b.size).sum();
        if total == 0 {
            return Err(AllocError::InvalidSize { size: total });
        }
        let stream = image.stream;
        let small = image.small_pool;
        let mut rest = if image.expandable && self.config.expandable_segments {
            self.try_allocate_expandable_block(dev, small, stream, total)?
        } else {
            self.alloc_block(dev, small, stream, total, total, false)?
        }
        .ok_or_else(|| self.out_of_memory(dev, total, total, total, stream))?;
        let mut ptrs = Vec::with_capacity(image.blocks.len());
        let mut to_free = Vec::new();
        for (i, block) in image.blocks.iter().enumerate() {
            let last = i + 1 == image.blocks.len();
            let split = self.b(rest).size > block.size;
            let next_rest = if split { rest } else { NO_BLOCK };
            // A block requests at most what it holds (a recorded size past
            // it is bad data), as under policy hbm.
            let requested = block.requested_size.clamp(1, block.size);
            let ptr = self.alloc_found_block(rest, block.size, requested, split);
            ptrs.push(ptr);
            if !block.allocated {
                to_free.push(ptr);
            }
            if !last {
                // The remainder went back to the pool: take it out again.
                rest = next_rest;
                if rest == NO_BLOCK {
                    break;
                }
                self.pool_erase(rest);
            }
        }
        for ptr in to_free {
            self.free(dev, ptr)?;
        }
        Ok(ptrs)
    }

    // ----- inspection -----

    pub(crate) fn snapshot(&self) -> Vec<SegmentSnapshot> {
        let pending: BTreeSet<BlockId> = self.events.iter().map(|&(_, id)| id).collect();
        let mut segments = Vec::new();
        for (i, head) in self.live_blocks() {
            let starts_range = head.mapped && (head.prev == NO_BLOCK || !self.b(head.prev).mapped);
            if !starts_range {
                continue;
            }
            let mut seg = SegmentSnapshot {
                address: head.ptr,
                total_size: 0,
                stream: head.stream,
                small_pool: head.small,
                expandable: head.expandable.is_some(),
                blocks: Vec::new(),
            };
            let mut id = i;
            while id != NO_BLOCK && self.b(id).mapped {
                let b = self.b(id);
                let state = if b.allocated {
                    BlockState::ActiveAllocated
                } else if pending.contains(&id) || !b.stream_uses.is_empty() {
                    BlockState::ActivePendingFree
                } else {
                    BlockState::Inactive
                };
                seg.blocks.push(BlockSnapshot {
                    address: b.ptr,
                    size: b.size,
                    requested_size: b.requested_size,
                    state,
                });
                seg.total_size += b.size;
                id = b.next;
            }
            segments.push(seg);
        }
        segments.sort_by_key(|s| s.address);
        segments
    }

    fn live_blocks(&self) -> impl Iterator<Item = (BlockId, &Block)> {
        self.blocks
            .iter()
            .enumerate()
            .filter(|(_, b)| b.size > 0)
            .map(|(i, b)| (i as BlockId, b))
    }

    /// Checks every invariant of its state that this policy can see.
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        let mut mapped_total = 0u64;
        let mut allocated_total = 0u64;
        let mut free_in_pools = 0usize;
        let mut unmapped_in_pools = 0usize;
        for (id, b) in self.live_blocks() {
            if b.prev != NO_BLOCK {
                let p = self.b(b.prev);
                if p.next != id || p.ptr + p.size != b.ptr {
                    return Err(format!("block {:#x}: broken link to previous block", b.ptr));
                }
            }
            if b.mapped {
                mapped_total += b.size;
            }
            if b.allocated {
                allocated_total += b.size;
                if self.allocated_blocks.get(&b.ptr) != Some(&id) {
                    return Err(format!(
                        "allocated block {:#x} missing from the pointer map",
                        b.ptr
                    ));
                }
            } else if b.event_count == 0 && b.stream_uses.is_empty() {
                let pool = &self.pools[pool_index(b.small)];
                let found = if b.mapped {
                    free_in_pools += 1;
                    pool.blocks.contains(&(b.stream, b.size, b.ptr, id))
                } else {
                    unmapped_in_pools += 1;
                    pool.unmapped.contains(&(b.stream, b.ptr, id))
                };
                if !found {
                    return Err(format!(
                        "free block {:#x} of {} bytes is not in its pool",
                        b.ptr, b.size
                    ));
                }
                for n in [b.prev, b.next] {
                    if n != NO_BLOCK {
                        let o = self.b(n);
                        if !o.allocated
                            && o.event_count == 0
                            && o.stream_uses.is_empty()
                            && o.mapped == b.mapped
                        {
                            return Err(format!(
                                "free blocks {:#x} and {:#x} were not coalesced",
                                b.ptr, o.ptr
                            ));
                        }
                    }
                }
            }
        }
        let pooled: usize = self.pools.iter().map(|p| p.blocks.len()).sum();
        let pooled_unmapped: usize = self.pools.iter().map(|p| p.unmapped.len()).sum();
        if pooled != free_in_pools || pooled_unmapped != unmapped_in_pools {
            return Err(format!(
                "pools hold {pooled}+{pooled_unmapped} blocks, but {free_in_pools}+{unmapped_in_pools} blocks are free"
            ));
        }
        // Pages the driver would not give back are still held.
        mapped_total += self.stray_pages.iter().map(|p| p.size).sum::<u64>();
        if mapped_total != self.total_allocated_memory {
            return Err(format!(
                "reserved {} != sum of segments and mapped pages {}",
                self.total_allocated_memory, mapped_total
            ));
        }
        if self.state.stats.reserved_bytes[0].current as u64 != mapped_total {
            return Err("reserved_bytes stat disagrees with the segments".into());
        }
        if self.state.stats.allocated_bytes[0].current as u64 != allocated_total {
            return Err(format!(
                "allocated_bytes stat {} != sum of live blocks {}",
                self.state.stats.allocated_bytes[0].current, allocated_total
            ));
        }
        if self.allocated_blocks.len() as i64 != self.state.stats.allocation[0].current {
            return Err("allocation stat disagrees with the pointer map".into());
        }
        Ok(())
    }
}

fn apply_net(stat: &mut Stat, net: i64) {
    if net > 0 {
        stat.increase(net);
    } else if net < 0 {
        stat.decrease(-net);
    }
}

// The contract, served by the inherent methods of the same names.
crate::policy::policy_by_inherent_methods!(PytorchPolicy);

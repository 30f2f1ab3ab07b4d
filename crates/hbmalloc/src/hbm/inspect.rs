//! Read-only walks of the whole state: the snapshot (segments and blocks as
//! tools expect them), where an out-of-memory report's free memory lies, and
//! the invariant checks the tests run. Each part
//! checks its own state (`Spans::check`, `Physical::check`,
//! `AliasGroups::check`, `AliasGroups::check_users`); the regions and the
//! totals that tie the parts together are checked here.

use std::collections::{BTreeMap, BTreeSet};

use crate::device::{DevicePtr, PhysicalHandle};
use crate::error::FreeGranules;
use crate::snapshot::{BlockSnapshot, BlockState, SegmentSnapshot};

use super::spans::RegionTiles;
use super::{granules_under, HbmPolicy, LiveBlock, PhysicalGranule, View};

impl HbmPolicy {
    /// Whole granules free under free ranges, each physical granule once (an
    /// idle alias group at the view that used it last; memory in use at
    /// another view is no free memory), by whether a live or pending-free
    /// block lies on their handle at any view: where the device maps whole
    /// handles only, such granules move only with the rest of their handle,
    /// and the others may be mapped where a request is (a handle cut into
    /// idle groups is mapped whole, each group gaining a view). Where an
    /// out-of-memory request's memory is.
    pub(super) fn free_granules_by_mobility(&self, granule: u64) -> FreeGranules {
        let pinned: BTreeSet<PhysicalHandle> = if self.physical.maps_handle_parts() {
            BTreeSet::new()
        } else {
            self.live
                .values()
                .flat_map(|block| {
                    let span = self.spans.get(block.span);
                    let region = self.region(span.region);
                    let (first, end) = granules_under(granule, region.base, span.start, span.size);
                    region.chunks_in(first, end).map(|(_, chunk)| chunk.handle)
                })
                .collect()
        };
        let mut free = FreeGranules {
            movable_bytes: 0,
            pinned_bytes: 0,
        };
        let mut count = |handle: PhysicalHandle, granules: u64| {
            let bytes = if pinned.contains(&handle) {
                &mut free.pinned_bytes
            } else {
                &mut free.movable_bytes
            };
            *bytes += granules * granule;
        };
        for (_, region_index, first, end) in self.free_granules(granule) {
            let region = self.region(region_index);
            for (start, chunk) in region.chunks_in(first, end) {
                let (lo, hi) = (first.max(start), end.min(start + chunk.count));
                let once = (lo..hi).filter(|&i| !region.aliased.get(i)).count() as u64;
                count(chunk.handle, once);
            }
            for (start, id) in self
                .groups
                .views_in(&self.regions, region_index, first, end)
            {
                let group = self.groups.get(id);
                if group.blocks == 0 && group.user == (region_index, start) {
                    count(
                        group.handle,
                        (start + group.count).min(end) - start.max(first),
                    );
                }
            }
        }
        free
    }

    /// Each contiguous mapped range (or fallback segment) as a segment.
    pub(crate) fn snapshot(&self) -> Vec<SegmentSnapshot> {
        let mut live: Vec<(DevicePtr, &LiveBlock)> =
            self.live.iter().map(|(&p, b)| (p, b)).collect();
        live.sort_unstable_by_key(|&(p, _)| p);
        let mut free: Vec<(DevicePtr, u64)> = self
            .spans
            .indexes()
            .iter()
            .flat_map(|index| index.ranges())
            .map(|(size, p, _)| (p, size))
            .collect();
        free.sort_unstable();
        let mut segments = Vec::new();
        for (region_index, region) in self.regions.iter().enumerate() {
            let Some(region) = region else { continue };
            let runs: Vec<(DevicePtr, u64)> = match self.granule {
                Some(g) if !region.segment => {
                    let mut runs: Vec<(DevicePtr, u64)> = Vec::new();
                    // Mapped granules, each physical granule once: of an
                    // alias group, only the view in use (or used last), so
                    // that segments add up to memory held, as tools expect.
                    let shown = |index: u64| {
                        region.is_mapped(index)
                            && (!region.aliased.get(index)
                                || region.group_at.get(index).is_some_and(|id| {
                                    let start =
                                        self.groups.view_start(id, region_index as u32, index);
                                    self.groups.get(id).user == (region_index as u32, start)
                                }))
                    };
                    let mut index = region.next_with(0, region.granules, true);
                    while index < region.granules {
                        if !shown(index) {
                            index = region.next_with(index + 1, region.granules, true);
                            continue;
                        }
                        let va = region.base + index * g;
                        match runs.last_mut() {
                            Some((start, len)) if *start + *len == va => *len += g,
                            _ => runs.push((va, g)),
                        }
                        index += 1;
                    }
                    runs
                }
                _ => vec![(region.base, region.size)],
            };
            for (start, len) in runs {
                let end = start + len;
                let mut blocks = Vec::new();
                let first_live = live.partition_point(|&(p, _)| p < start);
                for &(p, b) in live[first_live..].iter().take_while(|&&(p, _)| p < end) {
                    let state = if b.allocated {
                        BlockState::ActiveAllocated
                    } else {
                        BlockState::ActivePendingFree
                    };
                    blocks.push(BlockSnapshot {
                        address: p,
                        size: self.spans.get(b.span).size,
                        requested_size: b.requested,
                        state,
                    });
                }
                // Free ranges overlapping the run, clipped to it.
                let first_free = free.partition_point(|&(p, size)| p + size <= start);
                for &(p, free_size) in free[first_free..].iter().take_while(|&&(p, _)| p < end) {
                    let lo = p.max(start);
                    let hi = (p + free_size).min(end);
                    if lo < hi {
                        blocks.push(BlockSnapshot {
                            address: lo,
                            size: hi - lo,
                            requested_size: 0,
                            state: BlockState::Inactive,
                        });
                    }
                }
                blocks.sort_by_key(|b| b.address);
                segments.push(SegmentSnapshot {
                    address: start,
                    total_size: len,
                    stream: region.stream,
                    small_pool: false,
                    expandable: !region.segment,
                    blocks,
                });
            }
        }
        segments.sort_by_key(|s| s.address);
        segments
    }

    /// Checks every invariant of its state that this policy can see.
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        let granule = self.granule.unwrap_or(0);
        let by_region = self
            .spans
            .check(self.live.iter().map(|(&p, b)| (p, b.span)), |index| {
                let region = self.regions.get(index as usize)?.as_ref()?;
                Some((region.base, region.size, region.size_index))
            })?;
        let (views, segment_bytes) = self.check_regions(by_region)?;
        let (spare_granules, handle_bytes) = self.physical.check(&views, granule)?;
        self.groups
            .check(&views, granule, self.config.max_views, &self.regions)?;
        let live_blocks = self.live.iter().map(|(&ptr, block)| {
            let span = self.spans.get(block.span);
            (ptr, span.size, span.region)
        });
        self.groups
            .check_users(live_blocks, granule, &self.regions)?;
        let spare = spare_granules.len() as u64 * granule;
        if handle_bytes != (views.len() as u64) * granule + spare {
            return Err("handles held disagree with mapped and spare memory".into());
        }
        let held = handle_bytes + segment_bytes;
        if held != self.physical.held_bytes() {
            return Err(format!(
                "reserved {} != mapped granules + spare handles + segments {held}",
                self.physical.held_bytes()
            ));
        }
        if self.state.stats.reserved_bytes[0].current as u64 != held {
            return Err("reserved_bytes stat disagrees with the mapped memory".into());
        }
        let allocated: u64 = self
            .live
            .values()
            .filter(|b| b.allocated)
            .map(|b| self.spans.get(b.span).size)
            .sum();
        if self.state.stats.allocated_bytes[0].current as u64 != allocated {
            return Err(format!(
                "allocated_bytes stat {} != sum of live blocks {allocated}",
                self.state.stats.allocated_bytes[0].current
            ));
        }
        let active: u64 = self
            .live
            .values()
            .map(|b| self.spans.get(b.span).size)
            .sum();
        if self.state.stats.active_bytes[0].current as u64 != active {
            return Err("active_bytes stat disagrees with the live blocks".into());
        }
        // No check of `held` against the memory fraction: a fraction lowered
        // below what is held frees nothing by itself (as in PyTorch), it only
        // refuses new memory.
        Ok(())
    }

    /// Per region: live and free blocks tile it exactly (so nothing
    /// overlaps), free ranges are coalesced, live blocks are mapped, and the
    /// chunks agree with the bitmaps. Returns every view of every physical
    /// granule (from the chunks) and the bytes of plain segments.
    fn check_regions(
        &self,
        mut by_region: RegionTiles,
    ) -> Result<(BTreeMap<PhysicalGranule, Vec<View>>, u64), String> {
        let mut segment_bytes = 0u64;
        let granule_bytes = self.granule.unwrap_or(0);
        let mut views: BTreeMap<PhysicalGranule, Vec<View>> = BTreeMap::new();
        for (i, region) in self.regions.iter().enumerate() {
            let Some(region) = region else { continue };
            let mut blocks = by_region.remove(&(i as u32)).unwrap_or_default();
            blocks.sort_unstable();
            let mut cursor = region.base;
            let mut previous_free = false;
            for &(p, size, is_live) in &blocks {
                if p != cursor {
                    return Err(format!(
                        "region {:#x}: block at {p:#x}, expected {cursor:#x} (overlap or hole)",
                        region.base
                    ));
                }
                if !is_live && previous_free {
                    return Err(format!("free ranges at {p:#x} not coalesced"));
                }
                if is_live {
                    if let Some(g) = self.granule.filter(|_| !region.segment) {
                        let (first, end) = granules_under(g, region.base, p, size);
                        if !region.all_mapped(first, end) {
                            return Err(format!("live block {p:#x} lies over unmapped memory"));
                        }
                    }
                }
                previous_free = !is_live;
                cursor = p + size;
            }
            if cursor != region.base + region.size {
                return Err(format!("region {:#x} is not fully tiled", region.base));
            }
            if region.segment {
                segment_bytes += region.size;
            } else {
                let mut next_free_granule = 0;
                let mut counted = 0;
                for (&start, chunk) in &region.chunks {
                    let count = chunk.count;
                    for k in 0..count {
                        views
                            .entry((chunk.handle, chunk.offset + k * granule_bytes))
                            .or_default()
                            .push((i as u32, start + k));
                    }
                    if start < next_free_granule || start + count > region.granules {
                        return Err(format!("region {:#x}: chunks overlap", region.base));
                    }
                    if !region.all_mapped(start, start + count)
                        || !region.chunk_starts.get(start)
                        || region.chunk_starts.any(start + 1, start + count)
                    {
                        return Err(format!(
                            "region {:#x}: chunk not in the bitmaps",
                            region.base
                        ));
                    }
                    next_free_granule = start + count;
                    counted += count;
                }
                let bits = region.mapped.count_ones();
                if region.chunk_starts.count_ones() != region.chunks.len() as u64 {
                    return Err(format!(
                        "region {:#x}: chunk-start bitmap disagrees",
                        region.base
                    ));
                }
                if counted != bits {
                    return Err(format!(
                        "region {:#x}: mapped bitmap disagrees",
                        region.base
                    ));
                }
            }
        }
        if !by_region.is_empty() {
            return Err("blocks in regions that do not exist".into());
        }
        Ok((views, segment_bytes))
    }
}

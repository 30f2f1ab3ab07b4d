//! Read-only walks of the whole state: the snapshot (segments and blocks as
//! tools expect them) and the invariant checks the tests run.

use std::collections::{BTreeMap, BTreeSet};

use crate::device::DevicePtr;
use crate::snapshot::{BlockSnapshot, BlockState, SegmentSnapshot};

use super::{granules_under, HbmPolicy, LiveBlock, PhysicalGranule, Region, Span, View, NO_SPAN};

/// Each region's blocks and free ranges, as (address, size, live).
type RegionTiles = BTreeMap<u32, Vec<(DevicePtr, u64, bool)>>;

impl HbmPolicy {
    /// Each contiguous mapped range (or fallback segment) as a segment.
    pub(crate) fn snapshot(&self) -> Vec<SegmentSnapshot> {
        let mut live: Vec<(DevicePtr, &LiveBlock)> =
            self.live.iter().map(|(&p, b)| (p, b)).collect();
        live.sort_unstable_by_key(|&(p, _)| p);
        let mut free: Vec<(DevicePtr, u64)> = self
            .free_by_size
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
                                    let start = self.view_start(id, region_index as u32, index);
                                    self.group(id).user == (region_index as u32, start)
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
                        size: self.span(b.span).size,
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
        let by_region = self.check_spans()?;
        let (views, segment_bytes) = self.check_regions(by_region)?;
        let (spare_granules, handle_bytes) = self.check_handles(&views)?;
        self.check_alias_groups(&views)?;
        self.check_group_users()?;
        let granule = self.granule.unwrap_or(0);
        let spare = spare_granules.len() as u64 * granule;
        if handle_bytes != (views.len() as u64) * granule + spare {
            return Err("handles held disagree with mapped and spare memory".into());
        }
        let held = handle_bytes + segment_bytes;
        if held != self.held_bytes {
            return Err(format!(
                "reserved {} != mapped granules + spare handles + segments {held}",
                self.held_bytes
            ));
        }
        if self.state.stats.reserved_bytes[0].current as u64 != held {
            return Err("reserved_bytes stat disagrees with the mapped memory".into());
        }
        let allocated: u64 = self
            .live
            .values()
            .filter(|b| b.allocated)
            .map(|b| self.span(b.span).size)
            .sum();
        if self.state.stats.allocated_bytes[0].current as u64 != allocated {
            return Err(format!(
                "allocated_bytes stat {} != sum of live blocks {allocated}",
                self.state.stats.allocated_bytes[0].current
            ));
        }
        let active: u64 = self.live.values().map(|b| self.span(b.span).size).sum();
        if self.state.stats.active_bytes[0].current as u64 != active {
            return Err("active_bytes stat disagrees with the live blocks".into());
        }
        // No check of `held` against the memory fraction: a fraction lowered
        // below what is held frees nothing by itself (as in PyTorch), it only
        // refuses new memory.
        Ok(())
    }

    /// Spans: each live block's span is a block at its address; each free
    /// range in the size index is a free span of its stream, in the
    /// large-range index exactly when it is large; links are mutual and
    /// contiguous, and every span in use is a block or a free range. Returns
    /// each region's blocks and free ranges as (address, size, live).
    fn check_spans(&self) -> Result<RegionTiles, String> {
        // Per region: live and free blocks tile it exactly (so nothing
        // overlaps), free ranges are coalesced, live blocks are mapped.
        let mut by_region: BTreeMap<u32, Vec<(DevicePtr, u64, bool)>> = BTreeMap::new();
        let mut in_use = 0usize;
        for (&p, b) in &self.live {
            let span = self
                .spans
                .get(b.span as usize)
                .ok_or_else(|| format!("live block {p:#x}: no span {}", b.span))?;
            if span.free || span.start != p {
                return Err(format!("live block {p:#x}: its span disagrees: {span:?}"));
            }
            by_region
                .entry(span.region)
                .or_default()
                .push((p, span.size, true));
            in_use += 1;
        }
        let mut large = 0usize;
        for (slot, index) in self.free_by_size.iter().enumerate() {
            for (size, p, id) in index.ranges() {
                let span = self
                    .spans
                    .get(id as usize)
                    .ok_or_else(|| format!("free range {p:#x}: no span {id}"))?;
                if !span.free || span.start != p || span.size != size {
                    return Err(format!(
                        "free range {p:#x}+{size}: its span disagrees: {span:?}"
                    ));
                }
                let region = self
                    .regions
                    .get(span.region as usize)
                    .and_then(|r| r.as_ref())
                    .ok_or_else(|| format!("free range {p:#x} in a dead region"))?;
                if region.size_index != slot {
                    return Err(format!("free range {p:#x} in another stream's index"));
                }
                let is_large = size >= self.large_range_bytes();
                if is_large != (self.large_free.get(&(p + size)) == Some(&id)) {
                    return Err(format!("free range {p:#x}+{size} misfiled as large or not"));
                }
                large += usize::from(is_large);
                by_region
                    .entry(span.region)
                    .or_default()
                    .push((p, size, false));
                in_use += 1;
            }
        }
        if large != self.large_free.len() {
            return Err("the large-range index holds ranges that are not free".into());
        }
        if in_use + self.free_span_ids.len() != self.spans.len() {
            return Err(format!(
                "{} spans, {in_use} in use and {} retired",
                self.spans.len(),
                self.free_span_ids.len()
            ));
        }
        let retired: BTreeSet<u32> = self.free_span_ids.iter().copied().collect();
        for (id, span) in self.spans.iter().enumerate() {
            if retired.contains(&(id as u32)) {
                if span.free {
                    return Err(format!("retired span {id} is marked free"));
                }
                continue;
            }
            let region = self
                .regions
                .get(span.region as usize)
                .and_then(|r| r.as_ref())
                .ok_or_else(|| format!("span {id} in a dead region"))?;
            let linked = |other: u32, at: DevicePtr, back: bool| {
                let o = &self.spans[other as usize];
                let ok = !retired.contains(&other)
                    && o.region == span.region
                    && if back {
                        o.end() == at && o.next == id as u32
                    } else {
                        o.start == at && o.prev == id as u32
                    };
                ok && !(o.free && span.free)
            };
            let prev_ok = if span.prev == NO_SPAN {
                span.start == region.base
            } else {
                linked(span.prev, span.start, true)
            };
            let next_ok = if span.next == NO_SPAN {
                span.end() == region.base + region.size
            } else {
                linked(span.next, span.end(), false)
            };
            if !prev_ok || !next_ok {
                return Err(format!("span {id} is badly linked: {span:?}"));
            }
        }
        Ok(by_region)
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

    /// Each granule of each handle is mapped (at one or more views) or
    /// spare, never both. Returns the spare granules and the bytes of every
    /// handle.
    fn check_handles(
        &self,
        views: &BTreeMap<PhysicalGranule, Vec<View>>,
    ) -> Result<(BTreeSet<PhysicalGranule>, u64), String> {
        let granule = self.granule.unwrap_or(0);
        let mut spare_granules: BTreeSet<PhysicalGranule> = BTreeSet::new();
        for p in &self.spare {
            if p.bytes == 0 || p.bytes % granule.max(1) != 0 {
                return Err(format!(
                    "spare piece of handle {} is not whole granules",
                    p.handle.0
                ));
            }
            for k in 0..p.bytes / granule {
                if !spare_granules.insert((p.handle, p.offset + k * granule)) {
                    return Err(format!("spare pieces of handle {} overlap", p.handle.0));
                }
            }
        }
        let mut handle_bytes = 0u64;
        for (handle, info) in &self.handles {
            let mut mapped = 0;
            let mut offset = 0;
            while offset < info.bytes {
                let key = (*handle, offset);
                let seen = views.get(&key).map_or(0, |v| v.len() as u64);
                if (seen > 0) == spare_granules.contains(&key) {
                    return Err(format!(
                        "handle {}: granule at {offset} is {}",
                        handle.0,
                        if seen > 0 {
                            "both mapped and spare"
                        } else {
                            "neither mapped nor spare"
                        }
                    ));
                }
                mapped += seen * granule;
                offset += granule.max(1);
            }
            if mapped != info.mapped {
                return Err(format!("handle {}: mapped bytes disagree", handle.0));
            }
            handle_bytes += info.bytes;
        }
        if views
            .keys()
            .chain(&spare_granules)
            .any(|(h, _)| !self.handles.contains_key(h))
        {
            return Err("a mapping or spare piece of an unknown handle".into());
        }
        Ok((spare_granules, handle_bytes))
    }

    /// Groups: each physical granule mapped more than once lies in exactly
    /// one group, mapped at exactly its views, and the per-region bitmaps
    /// and view index say so and nothing more.
    fn check_alias_groups(
        &self,
        views: &BTreeMap<PhysicalGranule, Vec<View>>,
    ) -> Result<(), String> {
        let granule = self.granule.unwrap_or(0);
        let mut grouped: BTreeSet<PhysicalGranule> = BTreeSet::new();
        let mut aliased_bits = 0u64;
        for (id, group) in self.groups.iter().enumerate() {
            let Some(group) = group else { continue };
            if group.views.len() < 2 || group.views.len() > self.config.max_views {
                return Err(format!("alias group {id} has {} views", group.views.len()));
            }
            if !group.views.contains(&group.user) {
                return Err(format!(
                    "alias group {id}: its user is not one of its views"
                ));
            }
            for k in 0..group.count {
                let key = (group.handle, group.offset + k * granule);
                if !grouped.insert(key) {
                    return Err(format!("granule {key:?} lies in two alias groups"));
                }
                let mut expected: Vec<View> =
                    group.views.iter().map(|&(r, s)| (r, s + k)).collect();
                expected.sort_unstable();
                if views.get(&key) != Some(&expected) {
                    return Err(format!(
                        "alias group {id}: granule {key:?} is mapped at {:?}, not {expected:?}",
                        views.get(&key)
                    ));
                }
            }
            for &(r, s) in &group.views {
                let region = self.region(r);
                if (s..s + group.count).any(|k| region.group_at.get(k) != Some(id as u32))
                    || !region.aliased.all(s, s + group.count)
                {
                    return Err(format!(
                        "alias group {id}: view {s} of region {r} not indexed"
                    ));
                }
                aliased_bits += group.count;
            }
        }
        if let Some((key, at)) = views
            .iter()
            .find(|(k, at)| at.len() > 1 && !grouped.contains(k))
        {
            return Err(format!(
                "granule {key:?} is mapped at {at:?} outside any alias group"
            ));
        }
        let mut lent_bits = 0u64;
        for group in self.groups.iter().flatten() {
            for &(r, s) in &group.views {
                let lent = group.blocks > 0 && (r, s) != group.user;
                let bits = &self.region(r).lent;
                if (lent && !bits.all(s, s + group.count))
                    || (!lent && bits.any(s, s + group.count))
                {
                    return Err(format!("region {r}: lent bits of view {s} are wrong"));
                }
                if lent {
                    lent_bits += group.count;
                }
            }
        }
        let per_region =
            |count: fn(&Region) -> u64| -> u64 { self.regions.iter().flatten().map(count).sum() };
        if per_region(|r| r.lent.count_ones()) != lent_bits {
            return Err("lent bits outside busy alias groups".into());
        }
        // Every view's granules name its group (checked above), and no other
        // granule names any.
        if per_region(|r| r.aliased.count_ones()) != aliased_bits
            || per_region(|r| r.group_at.count_set()) != aliased_bits
        {
            return Err("aliased bits or view index disagree with the alias groups".into());
        }
        Ok(())
    }

    /// Each group counts the live blocks on its user view, no group is used
    /// through two views, and a group in use has no idle granules at either
    /// end. Blocks are matched to views granule by granule here, apart from
    /// the hot path's view index.
    fn check_group_users(&self) -> Result<(), String> {
        let granule = self.granule.unwrap_or(0);
        let mut users: BTreeMap<u32, (View, u32)> = BTreeMap::new();
        // The first and last granule of each group that a block touches.
        let mut touched: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
        let mut views_of_region: BTreeMap<u32, Vec<(u64, u32)>> = BTreeMap::new();
        for (id, group) in self.groups.iter().enumerate() {
            for &(r, s) in group.iter().flat_map(|g| &g.views) {
                views_of_region.entry(r).or_default().push((s, id as u32));
            }
        }
        for (&ptr, block) in &self.live {
            let Span {
                size,
                region: region_index,
                ..
            } = *self.span(block.span);
            let region = self.region(region_index);
            if region.segment {
                continue;
            }
            let (first, end) = granules_under(granule, region.base, ptr, size);
            let mut seen: BTreeSet<u32> = BTreeSet::new();
            for &(s, id) in views_of_region.get(&region_index).into_iter().flatten() {
                let count = self.group(id).count;
                if s < end && s + count > first && seen.insert(id) {
                    let entry = users.entry(id).or_insert(((region_index, s), 0));
                    if entry.0 != (region_index, s) {
                        return Err(format!("alias group {id} is used through two views"));
                    }
                    entry.1 += 1;
                    let (lo, hi) = (first.max(s), end.min(s + count) - 1);
                    let span = touched.entry(id).or_insert((lo, hi));
                    *span = (span.0.min(lo), span.1.max(hi));
                } else if s < end && s + count > first {
                    return Err(format!("block {ptr:#x} lies on two views of group {id}"));
                }
            }
        }
        for (id, group) in self.groups.iter().enumerate() {
            let Some(group) = group else { continue };
            let used = users.get(&(id as u32));
            let count = used.map_or(0, |u| u.1);
            if count != group.blocks || used.is_some_and(|u| u.0 != group.user) {
                return Err(format!(
                    "alias group {id}: counts {} blocks on its user, found {count}",
                    group.blocks
                ));
            }
            // A group in use has no idle granules at either end: those are
            // cut off when the block on them goes (`cut_unused`), so that they
            // are not lent elsewhere for nothing.
            let ends = (group.user.1, group.user.1 + group.count - 1);
            if group.blocks > 0 && touched.get(&(id as u32)) != Some(&ends) {
                return Err(format!(
                    "alias group {id} is in use but no block lies on granules {:?} of its ends {ends:?}",
                    touched.get(&(id as u32))
                ));
            }
        }
        Ok(())
    }
}

//! Alias groups ([`AliasGroup`]): idle memory mapped a second time where it
//! is needed. Placement checks (`blocked`, `busy_end`), blocks claiming and
//! releasing groups, groups cut and merged back, and finding idle memory to
//! donate.

use std::collections::BTreeSet;

use crate::device::{Device, DevicePtr, StreamId};
use crate::error::AllocError;

use super::{granules_under, AliasGroup, Donor, GranuleMap, GranuleSpan, HbmPolicy, View};

impl HbmPolicy {
    pub(super) fn group(&self, id: u32) -> &AliasGroup {
        self.groups[id as usize]
            .as_ref()
            .expect("a live alias group")
    }

    fn group_mut(&mut self, id: u32) -> &mut AliasGroup {
        self.groups[id as usize]
            .as_mut()
            .expect("a live alias group")
    }

    /// The granules `[first, end)` a block `[ptr, ptr + size)` of a region
    /// lies on, or `None` in a plain segment (no granules).
    #[inline]
    pub(super) fn granule_span(
        &self,
        region_index: u32,
        ptr: DevicePtr,
        size: u64,
    ) -> Option<(u64, u64)> {
        let granule = self.granule?;
        let region = self.region(region_index);
        if region.segment {
            return None;
        }
        Some(granules_under(granule, region.base, ptr, size))
    }

    /// [`HbmPolicy::granule_span`], or `None` when none of those granules is
    /// aliased (the hot path: one bitmap test).
    #[inline]
    pub(super) fn aliased_span(
        &self,
        region_index: u32,
        ptr: DevicePtr,
        size: u64,
    ) -> Option<(u64, u64)> {
        let (first, end) = self.granule_span(region_index, ptr, size)?;
        let aliased = &self.region(region_index).aliased;
        aliased.any(first, end).then_some((first, end))
    }

    /// The first granule of the view of group `id` in region
    /// `region_index` that covers `granule`.
    pub(super) fn view_start(&self, id: u32, region_index: u32, granule: u64) -> u64 {
        let group = self.group(id);
        group
            .views
            .iter()
            .find(|&&(r, s)| r == region_index && s <= granule && granule < s + group.count)
            .expect("an indexed granule lies in a view of its group")
            .1
    }

    /// The view covering aliased granule `granule` of region
    /// `region_index`, as (its first granule, group).
    pub(super) fn view_at(&self, region_index: u32, granule: u64) -> (u64, u32) {
        let id = self
            .region(region_index)
            .group_at
            .get(granule)
            .expect("an aliased granule lies in a group view");
        (self.view_start(id, region_index, granule), id)
    }

    /// The alias-group views of region `region_index` overlapping granules
    /// `[first, end)`, as (first granule of the view, group), lowest first:
    /// the aliased bitmap finds each view's first granule in the range, the
    /// granule map its group.
    pub(super) fn views_in(
        &self,
        region_index: u32,
        first: u64,
        end: u64,
    ) -> impl Iterator<Item = (u64, u32)> + '_ {
        let aliased = &self.region(region_index).aliased;
        let mut at = aliased.next_with(first, end, true);
        std::iter::from_fn(move || {
            if at >= end {
                return None;
            }
            let (start, id) = self.view_at(region_index, at);
            at = aliased.next_with(start + self.group(id).count, end, true);
            Some((start, id))
        })
    }

    /// Whether a block may not lie at `[ptr, ptr + size)` of region
    /// `region_index` (see [`HbmPolicy::busy_end`]); the lent bitmap answers
    /// most cases without a walk of the groups.
    #[inline]
    pub(super) fn blocked(&self, region_index: u32, ptr: DevicePtr, size: u64) -> bool {
        let Some((first, end)) = self.granule_span(region_index, ptr, size) else {
            return false;
        };
        let region = self.region(region_index);
        // Lent granules are aliased: the lent test comes first, as it
        // settles most blocked candidates alone.
        region.lent.any(first, end)
            || (region.aliased.any(first, end)
                && (self.twice_end(region_index, first, end).is_some()
                    || (self.state.capture_underway
                        && self.other_stream_end(region_index, first, end).is_some())))
    }

    /// `None` when a block at `[ptr, ptr + size)` of region `region_index`
    /// may lie there: no group under it is in use at another view, and no
    /// group is under it twice (an alias beside its donor). Otherwise the
    /// end of the last view in the way.
    #[inline]
    pub(super) fn busy_end(
        &self,
        region_index: u32,
        ptr: DevicePtr,
        size: u64,
    ) -> Option<DevicePtr> {
        let (first, end) = self.aliased_span(region_index, ptr, size)?;
        let granule = self.granule.unwrap_or(1);
        let region = self.region(region_index);
        let lent_end = region.lent.last_set(first, end).map(|index| index + 1);
        let other_stream_end = if self.state.capture_underway {
            self.other_stream_end(region_index, first, end)
        } else {
            None
        };
        lent_end
            .max(self.twice_end(region_index, first, end))
            .max(other_stream_end)
            .map(|index| region.base + index * granule)
    }

    /// During a CUDA graph capture, groups last used on another stream are
    /// in the way too: taking them would mean waiting for that stream
    /// ([`HbmPolicy::claim`]), which a capture forbids (see
    /// [`crate::capture`]). The end of the last such view under granules
    /// `[first, end)`, if any.
    #[cold]
    fn other_stream_end(&self, region_index: u32, first: u64, end: u64) -> Option<u64> {
        let stream = self.region(region_index).stream;
        self.views_in(region_index, first, end)
            .filter(|&(_, id)| self.region(self.group(id).user.0).stream != stream)
            .map(|(start, id)| start + self.group(id).count)
            .last()
    }

    /// The end (a granule index) of the last group view under granules
    /// `[first, end)` of region `region_index` whose group lies under them
    /// twice, if any.
    fn twice_end(&self, region_index: u32, first: u64, end: u64) -> Option<u64> {
        self.views_in(region_index, first, end)
            .filter(|&(start, id)| {
                let group = self.group(id);
                group.views.iter().any(|&(r, s)| {
                    r == region_index && s != start && s < end && s + group.count > first
                })
            })
            .map(|(start, id)| start + self.group(id).count)
            .last()
    }

    /// A block now lies on `[ptr, ptr + size)`: it takes over the groups
    /// under it, after waiting for the stream that used them last when that
    /// is another stream (as a steal does). True: it lies on aliased memory.
    pub(super) fn claim(
        &mut self,
        dev: &dyn Device,
        region_index: u32,
        ptr: DevicePtr,
        size: u64,
    ) -> Result<bool, AllocError> {
        let Some((first, end)) = self.aliased_span(region_index, ptr, size) else {
            return Ok(false);
        };
        let stream = self.region(region_index).stream;
        let mut views = std::mem::take(&mut self.scratch_views);
        views.clear();
        views.extend(self.views_in(region_index, first, end));
        let other_stream = |this: &Self, id: u32| {
            let user_stream = this.region(this.group(id).user.0).stream;
            (user_stream != stream).then_some(user_stream)
        };
        // Usually the memory was last used on this stream: nothing to wait for.
        if views
            .iter()
            .any(|&(_, id)| other_stream(self, id).is_some())
        {
            let waits: BTreeSet<StreamId> = views
                .iter()
                .filter_map(|&(_, id)| other_stream(self, id))
                .collect();
            #[cfg(test)]
            let waits = if super::testing::SKIP_ALIAS_WAIT.with(|skip| skip.get()) {
                BTreeSet::new()
            } else {
                waits
            };
            for other in waits {
                self.events.wait_for_stream(dev, other)?;
            }
        }
        for &(mut start, mut id) in &views {
            // An idle group is cut to the granules the block covers, so the
            // rest stays free to use at the other views.
            if self.group(id).blocks == 0 {
                if start < first {
                    id = self.split_group(id, first - start).1;
                    start = first;
                }
                if start + self.group(id).count > end {
                    id = self.split_group(id, end - start).0;
                }
            }
            let group = self.group_mut(id);
            debug_assert!(group.blocks == 0 || group.user == (region_index, start));
            group.user = (region_index, start);
            group.blocks += 1;
            if group.blocks == 1 {
                self.set_lent(id, true);
            }
        }
        self.scratch_views = views;
        Ok(true)
    }

    /// Marks (or clears) group `id` as lent at every view but its user's.
    fn set_lent(&mut self, id: u32, lent: bool) {
        // The group and the regions are disjoint fields: one lookup each.
        let group = self.groups[id as usize]
            .as_ref()
            .expect("a live alias group");
        for &(region, first) in &group.views {
            if (region, first) != group.user {
                self.regions[region as usize]
                    .as_mut()
                    .expect("a live region")
                    .lent
                    .set(first, group.count, lent);
            }
        }
    }

    /// Cuts idle group `id` after its first `at` granules; returns the
    /// groups of the two parts. The smaller part takes a new id, so the
    /// granule map is rewritten under it only: a small block cut from a
    /// large idle group costs its own granules, not the group's.
    fn split_group(&mut self, id: u32, at: u64) -> (u32, u32) {
        let granule = self.granule.unwrap_or(0);
        let group = self.group_mut(id);
        debug_assert!(group.blocks == 0 && at > 0 && at < group.count);
        let rest = AliasGroup {
            handle: group.handle,
            offset: group.offset + at * granule,
            count: group.count - at,
            views: group.views.iter().map(|&(r, s)| (r, s + at)).collect(),
            user: (group.user.0, group.user.1 + at),
            blocks: 0,
        };
        group.count = at;
        let head_moves = at < rest.count;
        let moving = if head_moves {
            std::mem::replace(group, rest)
        } else {
            rest
        };
        let (views, count) = (moving.views.clone(), moving.count);
        let new_id = self.new_group(moving);
        for (r, s) in views {
            self.region_mut(r).group_at.set(s, count, new_id);
        }
        if head_moves {
            (new_id, id)
        } else {
            (id, new_id)
        }
    }

    /// Merges idle group `id` with the idle groups just before and after it
    /// that continue it at every view (what [`HbmPolicy::split_group`] cut),
    /// so that groups do not stay small. Returns the group after it, if
    /// that one was merged in.
    fn merge_idle(&mut self, id: u32) -> Option<u32> {
        let (region, start, count) = {
            let group = self.group(id);
            (group.user.0, group.user.1, group.count)
        };
        // Neighbours continue a view only where they touch it.
        let group_at = &self.region(region).group_at;
        let next = group_at.get(start + count);
        let previous = start.checked_sub(1).and_then(|before| group_at.get(before));
        let mut id = id;
        if let Some(before) = previous.filter(|&before| self.continues(before, id)) {
            id = self.absorb(before, id);
        }
        let after = next.filter(|&after| self.continues(id, after))?;
        self.absorb(id, after);
        Some(after)
    }

    /// Whether idle group `after` continues idle group `first` at every view.
    fn continues(&self, first: u32, after: u32) -> bool {
        let granule = self.granule.unwrap_or(0);
        let (a, b) = (self.group(first), self.group(after));
        first != after
            && a.blocks == 0
            && b.blocks == 0
            && a.handle == b.handle
            && b.offset == a.offset + a.count * granule
            && a.views.len() == b.views.len()
            && b.user == (a.user.0, a.user.1 + a.count)
            && a.views.iter().all(|&(r, s)| {
                // A view lies inside one chunk: one unmap removes it whole.
                // Both views are mapped, so no chunk may start past `s`.
                let end = s + a.count + b.count;
                b.views.contains(&(r, s + a.count)) && !self.region(r).chunk_starts.any(s + 1, end)
            })
    }

    /// Joins idle group `after` to idle group `first` (see
    /// [`HbmPolicy::continues`]); returns the id of the joined group: the
    /// larger one's, so the granule map is rewritten under the smaller.
    fn absorb(&mut self, first: u32, after: u32) -> u32 {
        let (keep, gone) = if self.group(after).count > self.group(first).count {
            (after, first)
        } else {
            (first, after)
        };
        let gone_group = self.groups[gone as usize]
            .take()
            .expect("a live alias group");
        self.free_group_ids.push(gone);
        for &(r, s) in &gone_group.views {
            self.region_mut(r).group_at.set(s, gone_group.count, keep);
        }
        let group = self.group_mut(keep);
        if gone == first {
            // The joined group starts where `first` did.
            group.offset = gone_group.offset;
            group.views = gone_group.views;
            group.user = gone_group.user;
        }
        group.count += gone_group.count;
        keep
    }

    fn new_group(&mut self, group: AliasGroup) -> u32 {
        match self.free_group_ids.pop() {
            Some(id) => {
                self.groups[id as usize] = Some(group);
                id
            }
            None => {
                self.groups.push(Some(group));
                (self.groups.len() - 1) as u32
            }
        }
    }

    /// A block on `[ptr, ptr + size)` is gone, its range now part of free
    /// span `free`: the groups under it are idle unless other blocks lie on
    /// them, and those that stay in use shed what lies wholly under `free`
    /// ([`HbmPolicy::cut_unused`]).
    pub(super) fn unclaim(&mut self, region_index: u32, ptr: DevicePtr, size: u64, free: u32) {
        let Some((first, end)) = self.aliased_span(region_index, ptr, size) else {
            return;
        };
        let mut views = std::mem::take(&mut self.scratch_views);
        views.clear();
        views.extend(self.views_in(region_index, first, end));
        let mut idle = std::mem::take(&mut self.scratch_idle);
        idle.clear();
        for &(start, id) in &views {
            let group = self.group_mut(id);
            debug_assert!(group.user == (region_index, start) && group.blocks > 0);
            group.blocks -= 1;
            if group.blocks == 0 {
                idle.push(id);
            }
        }
        // `views` keeps the groups still in use: merging idle groups never
        // retires their ids.
        views.retain(|&(_, id)| self.group(id).blocks > 0);
        // Groups cut apart when blocks claimed them grow back together.
        for &id in &idle {
            self.set_lent(id, false);
        }
        // Lowest first; a group merged into the one before it is done.
        let mut merged: Option<u32> = None;
        for &id in &idle {
            if merged != Some(id) {
                merged = self.merge_idle(id);
            }
        }
        self.scratch_idle = idle;
        if !views.is_empty() {
            let granule = self.granule.expect("aliased memory has granules");
            let free_granules = self.whole_granules(granule, free);
            for &(_, id) in &views {
                self.cut_unused(id, free_granules);
            }
        }
        self.scratch_views = views;
    }

    /// Cuts from group `id`, still in use, its granules that lie wholly in a
    /// free range (whole granules `[first, end)`) at its front or its end,
    /// into an idle group. No block lies on them, and while they stayed in
    /// the busy group they were lent at every other view and could be
    /// neither used there nor stitched anywhere: idle memory held for
    /// nothing. (A group still used on both
    /// sides of the free range keeps its middle: which blocks lie on which
    /// side is not tracked.)
    fn cut_unused(&mut self, id: u32, (first, end): (u64, u64)) {
        let group = self.group(id);
        let (start, count, blocks) = (group.user.1, group.count, group.blocks);
        debug_assert!(blocks > 0);
        let (lo, hi) = (start.max(first), (start + count).min(end));
        let unused_front = lo == start && hi > lo && hi < start + count;
        let unused_end = hi == start + count && lo > start && lo < hi;
        if !unused_front && !unused_end {
            return;
        }
        // Cut as an idle group would be, then give the blocks back to the
        // part they lie on.
        self.group_mut(id).blocks = 0;
        let at = if unused_front { hi - start } else { lo - start };
        let (head, tail) = self.split_group(id, at);
        let (used, unused) = if unused_front {
            (tail, head)
        } else {
            (head, tail)
        };
        self.group_mut(used).blocks = blocks;
        self.set_lent(unused, false);
        self.merge_idle(unused);
    }

    /// Whether `group` is idle at every view and may be mapped into `span`
    /// as well (a range being backed: memory already stitched into it must
    /// not be mapped there twice), below the most views a group may have,
    /// and (on a device that maps whole handles only) a whole handle.
    fn group_idle(&self, group: &AliasGroup, span: GranuleSpan) -> bool {
        group.blocks == 0
            && group.views.len() < self.config.max_views
            && self.movable(group.handle, group.offset, group.count)
            && !group
                .views
                .iter()
                .any(|&(r, s)| r == span.0 && s < span.2 && s + group.count > span.1)
    }

    /// Memory lying idle under free ranges, highest address first, until it
    /// adds up to `bytes`: runs of unaliased granules (each inside one
    /// chunk, so physically contiguous) and whole idle groups. On a device
    /// that maps whole handles only, whole handles only: a run that is a
    /// whole chunk of a whole handle, a group that is a whole handle.
    fn idle_donors(&self, granule: u64, bytes: u64, span: GranuleSpan) -> Vec<Donor> {
        let mut donors = Vec::new();
        let mut found = 0u64;
        for (region_index, first, end) in self.free_granules(granule) {
            if found >= bytes {
                break;
            }
            let region = self.region(region_index);
            // Lent memory is in use elsewhere: skipped a word at a time.
            let mut i = region.next_unlent(first, end);
            while i < end && found < bytes {
                if region.aliased.get(i) {
                    let (start, id) = self.view_at(region_index, i);
                    let group = self.group(id);
                    if start >= first && start + group.count <= end && self.group_idle(group, span)
                    {
                        donors.push(Donor::Group(id));
                        found += group.count * granule;
                    }
                    i = region.next_unlent(start + group.count, end);
                    continue;
                }
                let (&start, chunk) = region
                    .chunks
                    .range(..=i)
                    .next_back()
                    .expect("a mapped granule lies in a chunk");
                let stop = region
                    .aliased
                    .next_with(i, end.min(start + chunk.count), true);
                // Only what is still wanted, where a handle may be cut.
                let count = if self.maps_handle_parts {
                    (stop - i).min((bytes - found).div_ceil(granule))
                } else {
                    stop - i
                };
                let offset = chunk.offset + (i - start) * granule;
                if self.movable(chunk.handle, offset, count) {
                    donors.push(Donor::Granules {
                        view: (region_index, i),
                        count,
                        handle: chunk.handle,
                        offset,
                    });
                    found += count * granule;
                }
                i = region.next_unlent(stop, end);
            }
        }
        donors
    }

    /// During a CUDA graph capture, only memory last used on the span's own
    /// stream may be stitched in: another stream's would mean waiting for it
    /// (see [`crate::capture`]).
    #[cold]
    fn keep_same_stream_donors(&self, donors: &mut Vec<Donor>, span: GranuleSpan) {
        let stream = self.region(span.0).stream;
        donors.retain(|donor| {
            let region = match *donor {
                Donor::Granules { view, .. } => view.0,
                Donor::Group(id) => self.group(id).user.0,
            };
            self.region(region).stream == stream
        });
    }

    /// Maps memory lying idle under free ranges elsewhere into
    /// `[cursor, end)` of the span's region as well (see [`AliasGroup`]);
    /// returns the first granule still unmapped (`end` or past it when
    /// done). Where handles map whole only, a whole handle larger than what
    /// is left may be mapped on past `end`, up to `room_end` (granules
    /// unmapped until then). With `plenty` above 1, maps nothing unless
    /// `plenty` times the granules needed lie idle.
    pub(super) fn alias_idle(
        &mut self,
        dev: &dyn Device,
        granule: u64,
        span: GranuleSpan,
        (mut cursor, end): (u64, u64),
        room_end: u64,
        plenty: u64,
    ) -> Result<u64, AllocError> {
        // A handle mapped whole past `end` must fit before `room_end`.
        let fits = |this: &Self, cursor: u64, handle, offset, count: u64| {
            this.movable(handle, offset, count.min(end - cursor))
                || (!this.maps_handle_parts
                    && cursor + count <= room_end
                    && this.movable(handle, offset, count))
        };
        let region_index = span.0;
        let wanted = (end - cursor) * plenty;
        let mut donors = self.idle_donors(granule, wanted * granule, span);
        if self.state.capture_underway {
            self.keep_same_stream_donors(&mut donors, span);
        }
        if plenty > 1 {
            let idle: u64 = donors
                .iter()
                .map(|donor| match *donor {
                    Donor::Granules { count, .. } => count,
                    Donor::Group(id) => self.group(id).count,
                })
                .sum();
            if idle < wanted {
                return Ok(cursor);
            }
        }
        for donor in donors {
            if cursor >= end {
                break;
            }
            let target = (region_index, cursor);
            match donor {
                Donor::Granules {
                    view,
                    count,
                    handle,
                    offset,
                } => {
                    // A whole handle that does not fit is not cut: it is
                    // mapped whole past `end`, or not at all.
                    if !fits(self, cursor, handle, offset, count) {
                        continue;
                    }
                    let take = if self.maps_handle_parts {
                        count.min(end - cursor)
                    } else {
                        count
                    };
                    self.map_chunk(
                        dev,
                        granule,
                        region_index,
                        cursor,
                        take,
                        handle,
                        offset,
                        true,
                    )?;
                    let group = AliasGroup {
                        handle,
                        offset,
                        count: take,
                        views: vec![view, target],
                        user: view,
                        blocks: 0,
                    };
                    let id = self.new_group(group);
                    self.add_view(id, view);
                    self.add_view(id, target);
                    cursor += take;
                }
                Donor::Group(id) => {
                    // A group is listed once per free view; the first use
                    // puts a view in the span and makes it ineligible.
                    let group = self.group(id);
                    if !self.group_idle(group, span) {
                        continue;
                    }
                    // A cut leaves the rest idle and ends the walk: the
                    // span is then backed to its end. A whole handle that
                    // does not fit is not cut (but may be mapped past `end`).
                    if !fits(self, cursor, group.handle, group.offset, group.count) {
                        continue;
                    }
                    let id = if group.count > end - cursor && self.maps_handle_parts {
                        self.split_group(id, end - cursor).0
                    } else {
                        id
                    };
                    let group = self.group(id);
                    let (handle, offset, count) = (group.handle, group.offset, group.count);
                    self.map_chunk(
                        dev,
                        granule,
                        region_index,
                        cursor,
                        count,
                        handle,
                        offset,
                        true,
                    )?;
                    self.group_mut(id).views.push(target);
                    self.add_view(id, target);
                    cursor += count;
                }
            }
        }
        Ok(cursor)
    }

    /// Records `view` of group `id` in its region.
    fn add_view(&mut self, id: u32, view: View) {
        let count = self.group(id).count;
        let region = self.region_mut(view.0);
        region.group_at.set(view.1, count, id);
        region.aliased.set(view.1, count, true);
    }

    /// Forgets `view` of group `id` (just unmapped there). A group left with
    /// one view is dissolved: that memory is plainly mapped again.
    pub(super) fn drop_view(&mut self, id: u32, view: View) {
        let count = self.group(id).count;
        let region = self.region_mut(view.0);
        region.group_at.set(view.1, count, GranuleMap::NONE);
        region.aliased.set(view.1, count, false);
        region.lent.set(view.1, count, false);
        let group = self.group_mut(id);
        group.views.retain(|&v| v != view);
        if group.user == view {
            debug_assert_eq!(group.blocks, 0, "an unmapped view was in use");
            group.user = group.views[0];
        }
        if group.views.len() == 1 {
            let last = group.views[0];
            let region = self.region_mut(last.0);
            region.group_at.set(last.1, count, GranuleMap::NONE);
            region.aliased.set(last.1, count, false);
            self.groups[id as usize] = None;
            self.free_group_ids.push(id);
        }
    }
}

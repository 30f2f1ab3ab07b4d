//! Alias groups at work: placement checks (`blocked`, `busy_end`), blocks
//! claiming and releasing groups, and finding idle memory to donate and
//! mapping it a second time. The groups themselves are kept by
//! [`AliasGroups`](super::groups::AliasGroups).

use std::collections::{BTreeMap, BTreeSet};

use crate::device::{Device, DevicePtr, PhysicalHandle, StreamId};
use crate::error::AllocError;

use super::groups::AliasGroup;
use super::{granules_under, GranuleSpan, HbmPolicy, Region, View};

/// Memory that may be mapped under a range as well (see [`AliasGroup`]).
enum Donor {
    /// Granules mapped only at `view`, idle there: `count` granules of
    /// `handle` from `offset`.
    Granules {
        view: View,
        count: u64,
        handle: PhysicalHandle,
        offset: u64,
    },
    /// A whole alias group, idle at every view.
    Group(u32),
    /// A whole handle, all of it in alias groups idle at every view
    /// (`groups`, by offset) that blocks cut apart and that have not merged
    /// back. Where handles map whole only, none of them may be mapped alone,
    /// but the handle may: each group gains a view.
    Handle {
        handle: PhysicalHandle,
        groups: Vec<u32>,
    },
}

/// Which idle memory [`HbmPolicy::alias_idle`] may map a second time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Donors {
    /// Runs of granules mapped once, and whole idle groups.
    Idle,
    /// Whole idle groups only: memory mapped at two places already.
    Aliased,
    /// Both, and after them handles that idle groups tile
    /// ([`Donor::Handle`]).
    WithCutHandles,
}

impl HbmPolicy {
    /// Region `region_index` with the granules `[first, end)` a block
    /// `[ptr, ptr + size)` lies on, or `None` in a plain segment (no
    /// granules): the hot path's tests take the region from here rather
    /// than look it up again.
    #[inline]
    pub(super) fn granules_in(
        &self,
        region_index: u32,
        ptr: DevicePtr,
        size: u64,
    ) -> Option<(&Region, u64, u64)> {
        let granule = self.granule?;
        let region = self.region(region_index);
        if region.segment {
            return None;
        }
        let (first, end) = granules_under(granule, region.base, ptr, size);
        Some((region, first, end))
    }

    /// The granules of [`HbmPolicy::granules_in`], or `None` when none is
    /// aliased (the hot path: one bitmap test).
    #[inline]
    pub(super) fn aliased_span(
        &self,
        region_index: u32,
        ptr: DevicePtr,
        size: u64,
    ) -> Option<(u64, u64)> {
        let (region, first, end) = self.granules_in(region_index, ptr, size)?;
        region.aliased.any(first, end).then_some((first, end))
    }

    /// Whether a block may not lie at `[ptr, ptr + size)` of region
    /// `region_index` (see [`HbmPolicy::busy_end`]); the lent bitmap answers
    /// most cases without a walk of the groups.
    #[inline]
    pub(super) fn blocked(&self, region_index: u32, ptr: DevicePtr, size: u64) -> bool {
        let Some((region, first, end)) = self.granules_in(region_index, ptr, size) else {
            return false;
        };
        // Lent granules are aliased: one test settles unaliased memory, the
        // usual case, and the lent test most blocked candidates.
        region.aliased.any(first, end)
            && (region.lent.any(first, end)
                || self
                    .groups
                    .twice_end(&self.regions, region_index, first, end)
                    .is_some()
                || (self.state.capture_underway
                    && self
                        .groups
                        .other_stream_end(&self.regions, region_index, first, end)
                        .is_some()))
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
        // During a CUDA graph capture, groups last used on another stream are
        // in the way too: taking them would mean waiting for that stream
        // ([`HbmPolicy::claim`]), which a capture forbids ([`crate::capture`]).
        let other_stream_end = if self.state.capture_underway {
            self.groups
                .other_stream_end(&self.regions, region_index, first, end)
        } else {
            None
        };
        lent_end
            .max(
                self.groups
                    .twice_end(&self.regions, region_index, first, end),
            )
            .max(other_stream_end)
            .map(|index| region.base + index * granule)
    }

    /// A block now lies on `[ptr, ptr + size)`: it takes over the groups
    /// under it ([`AliasGroups::claim`](super::groups::AliasGroups::claim)),
    /// after waiting for the stream that used them last when that is
    /// another stream (as a steal does). True: it lies on aliased memory.
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
        let views = self
            .groups
            .take_views(&self.regions, region_index, first, end);
        let other_stream = |this: &Self, id: u32| {
            let user_stream = this.groups.user_stream(&this.regions, id);
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
        let granule = self.granule.expect("aliased memory has granules");
        self.groups.claim(
            views,
            (region_index, first, end),
            granule,
            &mut self.regions,
        );
        Ok(true)
    }

    /// A block on `[ptr, ptr + size)` is gone, its range now part of free
    /// span `free`: see [`AliasGroups::unclaim`](super::groups::AliasGroups::unclaim).
    pub(super) fn unclaim(&mut self, region_index: u32, ptr: DevicePtr, size: u64, free: u32) {
        let Some((first, end)) = self.aliased_span(region_index, ptr, size) else {
            return;
        };
        let granule = self.granule.expect("aliased memory has granules");
        let free_granules = self.whole_granules(granule, free);
        self.groups.unclaim(
            (region_index, first, end),
            free_granules,
            granule,
            &mut self.regions,
        );
    }

    /// Whether `group` is idle at every view and may be mapped into `span`
    /// as well (a range being backed: memory already stitched into it must
    /// not be mapped there twice), below the most views a group may have,
    /// and (on a device that maps whole handles only) a whole handle.
    fn group_idle(&self, group: &AliasGroup, granule: u64, span: GranuleSpan) -> bool {
        self.group_idle_in_part(group, span)
            && self
                .physical
                .movable(group.handle, group.offset, group.count * granule)
    }

    /// [`HbmPolicy::group_idle`], but for whether the group may be mapped
    /// alone: it may be with the rest of its handle.
    fn group_idle_in_part(&self, group: &AliasGroup, span: GranuleSpan) -> bool {
        group.blocks == 0
            && group.views.len() < self.config.max_views
            && !group
                .views
                .iter()
                .any(|&(r, s)| r == span.0 && s < span.2 && s + group.count > span.1)
    }

    /// Memory lying idle under free ranges, highest address first, until it
    /// adds up to `bytes`: runs of unaliased granules (each inside one
    /// chunk, so physically contiguous; not with [`Donors::Aliased`]) and
    /// whole idle groups. On a device that maps whole handles only, whole
    /// handles only: a run that is a whole chunk of a whole handle, a group
    /// that is a whole handle, and with [`Donors::WithCutHandles`], after
    /// those, a handle its idle groups tile.
    fn idle_donors(
        &self,
        granule: u64,
        bytes: u64,
        span: GranuleSpan,
        kinds: Donors,
    ) -> Vec<Donor> {
        let mut donors = Vec::new();
        let mut found = 0u64;
        // Idle groups that are part of a handle, by handle and offset.
        let mut parts: BTreeMap<PhysicalHandle, BTreeSet<(u64, u32)>> = BTreeMap::new();
        for (_, region_index, first, end) in self.free_granules(granule) {
            if found >= bytes {
                break;
            }
            let region = self.region(region_index);
            // Lent memory is in use elsewhere: skipped a word at a time.
            let mut i = region.next_unlent(first, end);
            while i < end && found < bytes {
                if region.aliased.get(i) {
                    let (start, id) = self.groups.view_at(&self.regions, region_index, i);
                    let group = self.groups.get(id);
                    if start >= first && start + group.count <= end {
                        if self.group_idle(group, granule, span) {
                            donors.push(Donor::Group(id));
                            found += group.count * granule;
                        } else if kinds == Donors::WithCutHandles
                            && self.group_idle_in_part(group, span)
                        {
                            parts
                                .entry(group.handle)
                                .or_default()
                                .insert((group.offset, id));
                        }
                    }
                    i = region.next_unlent(start + group.count, end);
                    continue;
                }
                if kinds == Donors::Aliased {
                    // Memory mapped once may not serve: on to the next group.
                    i = region.next_unlent(region.aliased.next_with(i, end, true), end);
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
                let count = if self.physical.maps_handle_parts() {
                    (stop - i).min((bytes - found).div_ceil(granule))
                } else {
                    stop - i
                };
                let offset = chunk.offset + (i - start) * granule;
                if self.physical.movable(chunk.handle, offset, count * granule) {
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
        for (handle, groups) in parts {
            if found >= bytes {
                break;
            }
            // Tiled: each group begins where the one before it ends.
            let mut tiled = 0;
            for &(offset, id) in &groups {
                if offset != tiled {
                    break;
                }
                tiled += self.groups.get(id).count * granule;
            }
            if tiled == self.physical.handle_bytes(handle) {
                donors.push(Donor::Handle {
                    handle,
                    groups: groups.into_iter().map(|(_, id)| id).collect(),
                });
                found += tiled;
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
        let last_used_here = |id: u32| self.region(self.groups.get(id).user.0).stream == stream;
        donors.retain(|donor| match *donor {
            Donor::Granules { view, .. } => self.region(view.0).stream == stream,
            Donor::Group(id) => last_used_here(id),
            Donor::Handle { ref groups, .. } => groups.iter().all(|&id| last_used_here(id)),
        });
    }

    /// Maps memory lying idle under free ranges elsewhere into
    /// `[cursor, end)` of the span's region as well (see [`AliasGroup`]);
    /// returns the first granule still unmapped (`end` or past it when
    /// done). Where handles map whole only, a whole handle larger than what
    /// is left may be mapped on past `end`, up to `room_end` (granules
    /// unmapped until then). With `plenty` above 1, maps nothing unless
    /// `plenty` times the granules needed lie idle. `kinds`: which idle
    /// memory may serve ([`Donors`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn alias_idle(
        &mut self,
        dev: &dyn Device,
        granule: u64,
        span: GranuleSpan,
        (mut cursor, end): (u64, u64),
        room_end: u64,
        plenty: u64,
        kinds: Donors,
    ) -> Result<u64, AllocError> {
        // A handle mapped whole past `end` must fit before `room_end`.
        let fits = |this: &Self, cursor: u64, handle, offset, count: u64| {
            let physical = &this.physical;
            physical.movable(handle, offset, count.min(end - cursor) * granule)
                || (!physical.maps_handle_parts()
                    && cursor + count <= room_end
                    && physical.movable(handle, offset, count * granule))
        };
        let region_index = span.0;
        let wanted = (end - cursor) * plenty;
        let mut donors = self.idle_donors(granule, wanted * granule, span, kinds);
        if self.state.capture_underway {
            self.keep_same_stream_donors(&mut donors, span);
        }
        if plenty > 1 {
            let idle: u64 = donors
                .iter()
                .map(|donor| match *donor {
                    Donor::Granules { count, .. } => count,
                    Donor::Group(id) => self.groups.get(id).count,
                    Donor::Handle { handle, .. } => self.physical.handle_bytes(handle) / granule,
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
                    let take = if self.physical.maps_handle_parts() {
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
                    self.groups.create(group, &mut self.regions);
                    cursor += take;
                }
                Donor::Group(id) => {
                    // A group is listed once per free view; the first use
                    // puts a view in the span and makes it ineligible.
                    let group = self.groups.get(id);
                    if !self.group_idle(group, granule, span) {
                        continue;
                    }
                    // A cut leaves the rest idle and ends the walk: the
                    // span is then backed to its end. A whole handle that
                    // does not fit is not cut (but may be mapped past `end`).
                    if !fits(self, cursor, group.handle, group.offset, group.count) {
                        continue;
                    }
                    let id = if group.count > end - cursor && self.physical.maps_handle_parts() {
                        self.groups
                            .split(id, end - cursor, granule, &mut self.regions)
                            .0
                    } else {
                        id
                    };
                    let group = self.groups.get(id);
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
                    self.groups.add_view(id, target, &mut self.regions);
                    cursor += count;
                }
                Donor::Handle { handle, groups } => {
                    let count = self.physical.handle_bytes(handle) / granule;
                    let idle = |this: &Self, id| this.group_idle_in_part(this.groups.get(id), span);
                    if !groups.iter().all(|&id| idle(self, id))
                        || !fits(self, cursor, handle, 0, count)
                    {
                        continue;
                    }
                    self.map_chunk(dev, granule, region_index, cursor, count, handle, 0, true)?;
                    for id in groups {
                        let view = (region_index, cursor + self.groups.get(id).offset / granule);
                        self.groups.add_view(id, view, &mut self.regions);
                    }
                    cursor += count;
                }
            }
        }
        Ok(cursor)
    }
}

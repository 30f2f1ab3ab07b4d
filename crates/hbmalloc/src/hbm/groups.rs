//! The alias groups ([`AliasGroups`]) and their marks in the regions'
//! bitmaps (`aliased`, `group_at`, `lent`), kept in step: groups made, cut,
//! merged back, claimed and released by blocks, and views added and
//! dropped. The regions are handed in by the caller; devices, spans and
//! physical memory are not seen here (`alias.rs` coordinates them).

use std::collections::{BTreeMap, BTreeSet};

use crate::device::{DevicePtr, PhysicalHandle, StreamId};

use super::bitmap::GranuleMap;
use super::{granules_under, region_at, region_at_mut, PhysicalGranule, Region, View};

/// Physical memory mapped at several addresses (*stitched*, as in GMLake).
///
/// When a request needs memory and the allowance is spent, granules lying
/// idle under free ranges elsewhere are mapped under it a second time rather
/// than moved: the old mapping stays, so when the program later wants memory
/// at either address again it is still mapped there, and a repeating step
/// makes no driver call. A group is `count` granules of one handle and every
/// place (*view*) they are mapped whole; each view lies inside one chunk.
/// Only one view may be in use at a time, and the group says which. Groups
/// never overlap. An idle group is cut where a block or a donation needs
/// only part of it, and idle neighbours that continue each other at every
/// view are merged back. Bookkeeping is per group, not per granule, so a
/// block costs the same however large it is.
#[derive(Clone, Debug)]
pub(super) struct AliasGroup {
    pub(super) handle: PhysicalHandle,
    pub(super) offset: u64,
    pub(super) count: u64,
    /// Where it is mapped (region, first granule): two to
    /// [`HbmConfig::max_views`](super::HbmConfig::max_views).
    pub(super) views: Vec<View>,
    /// The view that uses it now (when `blocks > 0`) or used it last. A
    /// different stream taking it over first waits for this view's stream.
    pub(super) user: View,
    /// Live or pending-free blocks lying on it through `user`.
    pub(super) blocks: u32,
}

/// Every alias group, by id.
#[derive(Debug, Default)]
pub(super) struct AliasGroups {
    /// Memory mapped at more than one address, by group id (`None`: a
    /// retired id, reused from `free_ids`).
    groups: Vec<Option<AliasGroup>>,
    free_ids: Vec<u32>,
    /// Reused by `claim` and `unclaim` so that the hot path does not allocate.
    scratch_views: Vec<(u64, u32)>,
    /// Reused by `unclaim`, for the same reason.
    scratch_idle: Vec<u32>,
}

impl AliasGroups {
    #[inline]
    pub(super) fn get(&self, id: u32) -> &AliasGroup {
        self.groups[id as usize]
            .as_ref()
            .expect("a live alias group")
    }

    #[inline]
    fn get_mut(&mut self, id: u32) -> &mut AliasGroup {
        self.groups[id as usize]
            .as_mut()
            .expect("a live alias group")
    }

    fn insert(&mut self, group: AliasGroup) -> u32 {
        match self.free_ids.pop() {
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

    /// A new group of memory just mapped a second time: its views (the
    /// donor's and the new one) recorded in their regions.
    pub(super) fn create(&mut self, group: AliasGroup, regions: &mut [Option<Region>]) -> u32 {
        let id = self.insert(group);
        for &view in &self.get(id).views {
            self.record_view(id, view, regions);
        }
        id
    }

    /// Group `id` was just mapped at `view` as well.
    pub(super) fn add_view(&mut self, id: u32, view: View, regions: &mut [Option<Region>]) {
        self.get_mut(id).views.push(view);
        self.record_view(id, view, regions);
    }

    /// Records `view` of group `id` in its region.
    fn record_view(&self, id: u32, view: View, regions: &mut [Option<Region>]) {
        let count = self.get(id).count;
        let region = region_at_mut(regions, view.0);
        region.group_at.set(view.1, count, id);
        region.aliased.set(view.1, count, true);
    }

    /// Forgets `view` of group `id` (just unmapped there). A group left with
    /// one view is dissolved: that memory is plainly mapped again.
    pub(super) fn drop_view(&mut self, id: u32, view: View, regions: &mut [Option<Region>]) {
        let count = self.get(id).count;
        let region = region_at_mut(regions, view.0);
        region.group_at.set(view.1, count, GranuleMap::NONE);
        region.aliased.set(view.1, count, false);
        region.lent.set(view.1, count, false);
        let group = self.get_mut(id);
        group.views.retain(|&v| v != view);
        if group.user == view {
            debug_assert_eq!(group.blocks, 0, "an unmapped view was in use");
            group.user = group.views[0];
        }
        if group.views.len() == 1 {
            let last = group.views[0];
            let region = region_at_mut(regions, last.0);
            region.group_at.set(last.1, count, GranuleMap::NONE);
            region.aliased.set(last.1, count, false);
            self.groups[id as usize] = None;
            self.free_ids.push(id);
        }
    }

    /// The first granule of the view of group `id` in region
    /// `region_index` that covers `granule`.
    pub(super) fn view_start(&self, id: u32, region_index: u32, granule: u64) -> u64 {
        let group = self.get(id);
        group
            .views
            .iter()
            .find(|&&(r, s)| r == region_index && s <= granule && granule < s + group.count)
            .expect("an indexed granule lies in a view of its group")
            .1
    }

    /// The view covering aliased granule `granule` of region
    /// `region_index`, as (its first granule, group).
    pub(super) fn view_at(
        &self,
        regions: &[Option<Region>],
        region_index: u32,
        granule: u64,
    ) -> (u64, u32) {
        let id = region_at(regions, region_index)
            .group_at
            .get(granule)
            .expect("an aliased granule lies in a group view");
        (self.view_start(id, region_index, granule), id)
    }

    /// The alias-group views of region `region_index` overlapping granules
    /// `[first, end)`, as (first granule of the view, group), lowest first:
    /// the aliased bitmap finds each view's first granule in the range, the
    /// granule map its group.
    pub(super) fn views_in<'a>(
        &'a self,
        regions: &'a [Option<Region>],
        region_index: u32,
        first: u64,
        end: u64,
    ) -> impl Iterator<Item = (u64, u32)> + 'a {
        let aliased = &region_at(regions, region_index).aliased;
        let mut at = aliased.next_with(first, end, true);
        std::iter::from_fn(move || {
            if at >= end {
                return None;
            }
            let (start, id) = self.view_at(regions, region_index, at);
            at = aliased.next_with(start + self.get(id).count, end, true);
            Some((start, id))
        })
    }

    /// The stream whose region uses group `id` (or used it last).
    #[inline]
    pub(super) fn user_stream(&self, regions: &[Option<Region>], id: u32) -> StreamId {
        region_at(regions, self.get(id).user.0).stream
    }

    /// The end of the last view under granules `[first, end)` of region
    /// `region_index` whose group was last used on another stream, if any.
    #[cold]
    pub(super) fn other_stream_end(
        &self,
        regions: &[Option<Region>],
        region_index: u32,
        first: u64,
        end: u64,
    ) -> Option<u64> {
        let stream = region_at(regions, region_index).stream;
        self.views_in(regions, region_index, first, end)
            .filter(|&(_, id)| self.user_stream(regions, id) != stream)
            .map(|(start, id)| start + self.get(id).count)
            .last()
    }

    /// The end (a granule index) of the last group view under granules
    /// `[first, end)` of region `region_index` whose group lies under them
    /// twice, if any.
    pub(super) fn twice_end(
        &self,
        regions: &[Option<Region>],
        region_index: u32,
        first: u64,
        end: u64,
    ) -> Option<u64> {
        self.views_in(regions, region_index, first, end)
            .filter(|&(start, id)| {
                let group = self.get(id);
                group.views.iter().any(|&(r, s)| {
                    r == region_index && s != start && s < end && s + group.count > first
                })
            })
            .map(|(start, id)| start + self.get(id).count)
            .last()
    }

    /// The views under granules `[first, end)` of region `region_index`, in
    /// a vector lent from the scratch space: hand it back through
    /// [`AliasGroups::claim`] or drop it.
    pub(super) fn take_views(
        &mut self,
        regions: &[Option<Region>],
        region_index: u32,
        first: u64,
        end: u64,
    ) -> Vec<(u64, u32)> {
        let mut views = std::mem::take(&mut self.scratch_views);
        views.clear();
        views.extend(self.views_in(regions, region_index, first, end));
        views
    }

    /// A block now lies on granules `[first, end)` of region `region_index`,
    /// over `views` (from [`AliasGroups::take_views`]): it takes over the
    /// groups under it, idle ones cut to the granules it covers so the rest
    /// stays free to use at the other views.
    pub(super) fn claim(
        &mut self,
        views: Vec<(u64, u32)>,
        (region_index, first, end): (u32, u64, u64),
        granule: u64,
        regions: &mut [Option<Region>],
    ) {
        for &(mut start, mut id) in &views {
            if self.get(id).blocks == 0 {
                if start < first {
                    id = self.split(id, first - start, granule, regions).1;
                    start = first;
                }
                if start + self.get(id).count > end {
                    id = self.split(id, end - start, granule, regions).0;
                }
            }
            let group = self.get_mut(id);
            debug_assert!(group.blocks == 0 || group.user == (region_index, start));
            group.user = (region_index, start);
            group.blocks += 1;
            if group.blocks == 1 {
                self.set_lent(id, true, regions);
            }
        }
        self.scratch_views = views;
    }

    /// A block on granules `[first, end)` of region `region_index` is gone,
    /// its range now part of a free range whose whole granules are
    /// `free_granules`: the groups under it are idle unless other blocks lie
    /// on them, and those that stay in use shed what lies wholly under the
    /// free range ([`AliasGroups::cut_unused`]).
    pub(super) fn unclaim(
        &mut self,
        (region_index, first, end): (u32, u64, u64),
        free_granules: (u64, u64),
        granule: u64,
        regions: &mut [Option<Region>],
    ) {
        let mut views = self.take_views(regions, region_index, first, end);
        let mut idle = std::mem::take(&mut self.scratch_idle);
        idle.clear();
        for &(start, id) in &views {
            let group = self.get_mut(id);
            debug_assert!(group.user == (region_index, start) && group.blocks > 0);
            group.blocks -= 1;
            if group.blocks == 0 {
                idle.push(id);
            }
        }
        // `views` keeps the groups still in use: merging idle groups never
        // retires their ids.
        views.retain(|&(_, id)| self.get(id).blocks > 0);
        // Groups cut apart when blocks claimed them grow back together.
        for &id in &idle {
            self.set_lent(id, false, regions);
        }
        // Lowest first; a group merged into the one before it is done.
        let mut merged: Option<u32> = None;
        for &id in &idle {
            if merged != Some(id) {
                merged = self.merge_idle(id, granule, regions);
            }
        }
        self.scratch_idle = idle;
        for &(_, id) in &views {
            self.cut_unused(id, free_granules, granule, regions);
        }
        self.scratch_views = views;
    }

    /// Marks (or clears) group `id` as lent at every view but its user's.
    fn set_lent(&self, id: u32, lent: bool, regions: &mut [Option<Region>]) {
        let group = self.get(id);
        for &(region, first) in &group.views {
            if (region, first) != group.user {
                region_at_mut(regions, region)
                    .lent
                    .set(first, group.count, lent);
            }
        }
    }

    /// Cuts idle group `id` after its first `at` granules; returns the
    /// groups of the two parts. The smaller part takes a new id, so the
    /// granule map is rewritten under it only: a small block cut from a
    /// large idle group costs its own granules, not the group's.
    pub(super) fn split(
        &mut self,
        id: u32,
        at: u64,
        granule: u64,
        regions: &mut [Option<Region>],
    ) -> (u32, u32) {
        let group = self.get_mut(id);
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
        let new_id = self.insert(moving);
        for (r, s) in views {
            region_at_mut(regions, r).group_at.set(s, count, new_id);
        }
        if head_moves {
            (new_id, id)
        } else {
            (id, new_id)
        }
    }

    /// Merges idle group `id` with the idle groups just before and after it
    /// that continue it at every view (what [`AliasGroups::split`] cut),
    /// so that groups do not stay small. Returns the group after it, if
    /// that one was merged in.
    fn merge_idle(&mut self, id: u32, granule: u64, regions: &mut [Option<Region>]) -> Option<u32> {
        let (region, start, count) = {
            let group = self.get(id);
            (group.user.0, group.user.1, group.count)
        };
        // Neighbours continue a view only where they touch it.
        let group_at = &region_at(regions, region).group_at;
        let next = group_at.get(start + count);
        let previous = start.checked_sub(1).and_then(|before| group_at.get(before));
        let mut id = id;
        if let Some(before) =
            previous.filter(|&before| self.continues(before, id, granule, regions))
        {
            id = self.absorb(before, id, regions);
        }
        let after = next.filter(|&after| self.continues(id, after, granule, regions))?;
        self.absorb(id, after, regions);
        Some(after)
    }

    /// Whether idle group `after` continues idle group `first` at every view.
    fn continues(&self, first: u32, after: u32, granule: u64, regions: &[Option<Region>]) -> bool {
        let (a, b) = (self.get(first), self.get(after));
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
                b.views.contains(&(r, s + a.count))
                    && !region_at(regions, r).chunk_starts.any(s + 1, end)
            })
    }

    /// Joins idle group `after` to idle group `first` (see
    /// [`AliasGroups::continues`]); returns the id of the joined group: the
    /// larger one's, so the granule map is rewritten under the smaller.
    fn absorb(&mut self, first: u32, after: u32, regions: &mut [Option<Region>]) -> u32 {
        let (keep, gone) = if self.get(after).count > self.get(first).count {
            (after, first)
        } else {
            (first, after)
        };
        let gone_group = self.groups[gone as usize]
            .take()
            .expect("a live alias group");
        self.free_ids.push(gone);
        for &(r, s) in &gone_group.views {
            region_at_mut(regions, r)
                .group_at
                .set(s, gone_group.count, keep);
        }
        let group = self.get_mut(keep);
        if gone == first {
            // The joined group starts where `first` did.
            group.offset = gone_group.offset;
            group.views = gone_group.views;
            group.user = gone_group.user;
        }
        group.count += gone_group.count;
        keep
    }

    /// Cuts from group `id`, still in use, its granules that lie wholly in a
    /// free range (whole granules `[first, end)`) at its front or its end,
    /// into an idle group. No block lies on them, and while they stayed in
    /// the busy group they were lent at every other view and could be
    /// neither used there nor stitched anywhere: idle memory held for
    /// nothing. (A group still used on both sides of the free range keeps
    /// its middle: which blocks lie on which side is not tracked.)
    fn cut_unused(
        &mut self,
        id: u32,
        (first, end): (u64, u64),
        granule: u64,
        regions: &mut [Option<Region>],
    ) {
        let group = self.get(id);
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
        self.get_mut(id).blocks = 0;
        let at = if unused_front { hi - start } else { lo - start };
        let (head, tail) = self.split(id, at, granule, regions);
        let (used, unused) = if unused_front {
            (tail, head)
        } else {
            (head, tail)
        };
        self.get_mut(used).blocks = blocks;
        self.set_lent(unused, false, regions);
        self.merge_idle(unused, granule, regions);
    }

    /// Groups: each physical granule mapped more than once (`views`: every
    /// place each is mapped) lies in exactly one group, mapped at exactly
    /// its views, with two to `max_views` views, and the per-region bitmaps
    /// and view index say so and nothing more.
    pub(super) fn check(
        &self,
        views: &BTreeMap<PhysicalGranule, Vec<View>>,
        granule: u64,
        max_views: usize,
        regions: &[Option<Region>],
    ) -> Result<(), String> {
        let mut grouped: BTreeSet<PhysicalGranule> = BTreeSet::new();
        let mut aliased_bits = 0u64;
        for (id, group) in self.groups.iter().enumerate() {
            let Some(group) = group else { continue };
            if group.views.len() < 2 || group.views.len() > max_views {
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
                let region = region_at(regions, r);
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
                let bits = &region_at(regions, r).lent;
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
            |count: fn(&Region) -> u64| -> u64 { regions.iter().flatten().map(count).sum() };
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

    /// Each group counts the live blocks (`blocks`: address, size, region)
    /// on its user view, no group is used through two views, and a group in
    /// use has no idle granules at either end. Blocks are matched to views
    /// granule by granule here, apart from the hot path's view index.
    pub(super) fn check_users(
        &self,
        blocks: impl Iterator<Item = (DevicePtr, u64, u32)>,
        granule: u64,
        regions: &[Option<Region>],
    ) -> Result<(), String> {
        let mut users: BTreeMap<u32, (View, u32)> = BTreeMap::new();
        // The first and last granule of each group that a block touches.
        let mut touched: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
        let mut views_of_region: BTreeMap<u32, Vec<(u64, u32)>> = BTreeMap::new();
        for (id, group) in self.groups.iter().enumerate() {
            for &(r, s) in group.iter().flat_map(|g| &g.views) {
                views_of_region.entry(r).or_default().push((s, id as u32));
            }
        }
        for (ptr, size, region_index) in blocks {
            let region = region_at(regions, region_index);
            if region.segment {
                continue;
            }
            let (first, end) = granules_under(granule, region.base, ptr, size);
            let mut seen: BTreeSet<u32> = BTreeSet::new();
            for &(s, id) in views_of_region.get(&region_index).into_iter().flatten() {
                let count = self.get(id).count;
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

//! Idle memory that a live block pins, put back to use. Where the driver
//! maps whole handles only, a handle moves whole or not at all: once a
//! block in it is freed, its idle granules cannot be stitched elsewhere
//! while another block of the handle lives, and a request that finds no
//! place would create new memory beside them. Here two such handles are
//! mapped whole again, side by side at the top of the stream's region, so
//! that the idle tail of the one and the idle head of the other make the
//! request's place; what lives in them is lent at the new views.

use crate::device::{Device, DevicePtr, PhysicalHandle, StreamId};
use crate::error::AllocError;

use super::groups::AliasGroup;
use super::{HbmPolicy, View};

/// A run of whole granules lying idle under free span `free`, inside a
/// handle mapped once, whole, at `view`, with a live block beside the run.
#[derive(Clone, Copy, Debug)]
struct PinnedRun {
    free: u32,
    view: View,
    handle: PhysicalHandle,
    /// The handle's granules.
    count: u64,
    /// The run's first granule in the view's region, and its length.
    start: u64,
    len: u64,
}

impl PinnedRun {
    fn ends_the_handle(&self) -> bool {
        self.start + self.len == self.view.1 + self.count
    }

    fn starts_the_handle(&self) -> bool {
        self.start == self.view.1
    }
}

impl HbmPolicy {
    /// A place for `size` bytes of `stream` made of the idle ends of two
    /// handles that live blocks pin, mapped again (see the module's
    /// header), as (free span, address); `None` where there are none to
    /// pair, or it is not worth it. Only where a new handle would raise the
    /// most memory ever held while demand is below its peak: then the
    /// views' calls (a map and an access grant each) save memory a create
    /// would add; at a new peak of demand memory grows anyway.
    pub(super) fn pinned_place(
        &mut self,
        dev: &dyn Device,
        stream: StreamId,
        size: u64,
    ) -> Result<Option<(u32, DevicePtr)>, AllocError> {
        let Some(granule) = self.granule else {
            return Ok(None);
        };
        let granules = size.div_ceil(granule);
        if self.physical.maps_handle_parts()
            || self.state.capture_underway
            || self.placement.growing()
            || self.physical.held_bytes() + granules * granule <= self.physical.peak_held_bytes()
        {
            return Ok(None);
        }
        let Some((_, _, top_id)) = self.spans.index_of(stream).and_then(|i| i.largest()) else {
            return Ok(None);
        };
        let top = *self.spans.get(top_id);
        if self.region(top.region).segment {
            return Ok(None);
        }
        let Some((tail, head)) = self.pinned_pair(granule, top.region, granules) else {
            return Ok(None);
        };
        // The two views, side by side from the first granule of the top
        // free range, all unmapped; the block from the tail run's start.
        let region = self.region(top.region);
        let first = (top.start - region.base).div_ceil(granule);
        let end = first + tail.count + head.count;
        let ptr = region.base + (first + tail.count - tail.len) * granule;
        if end > region.granules
            || region.next_with(first, end, true) < end
            || ptr + size > top.end()
        {
            return Ok(None);
        }
        let mapped = self
            .map_pinned(dev, granule, tail, (top.region, first))
            .and_then(|()| self.map_pinned(dev, granule, head, (top.region, first + tail.count)));
        // What got mapped gets access even when the second map failed.
        self.grant_access(dev, granule, top.region, first, end)?;
        mapped?;
        Ok(Some((top_id, ptr)))
    }

    /// The tail run and the head run (of two handles) that add up to the
    /// fewest granules of at least `granules`, neither enough alone (one
    /// that is lies under a free range the request would have fitted).
    fn pinned_pair(
        &self,
        granule: u64,
        region_index: u32,
        granules: u64,
    ) -> Option<(PinnedRun, PinnedRun)> {
        let runs = self.pinned_runs(granule, region_index);
        let short = |r: &&PinnedRun| r.len < granules;
        let tails = runs.iter().filter(|r| r.ends_the_handle()).filter(short);
        let mut best: Option<(PinnedRun, PinnedRun)> = None;
        for tail in tails {
            for head in runs.iter().filter(|r| r.starts_the_handle()).filter(short) {
                let len = tail.len + head.len;
                if head.handle != tail.handle
                    && len >= granules
                    && best.is_none_or(|(t, h)| len < t.len + h.len)
                {
                    best = Some((*tail, *head));
                }
            }
        }
        best
    }

    /// Idle runs of whole granules in region `region_index` inside handles
    /// mapped once, whole, that a live block pins (a wholly idle handle is
    /// stitched elsewhere as it is).
    fn pinned_runs(&self, granule: u64, region_index: u32) -> Vec<PinnedRun> {
        let mut runs = Vec::new();
        let region = self.region(region_index);
        let free_ranges = self.free_granules(granule);
        for (free, _, first, end) in free_ranges.filter(|&(_, r, ..)| r == region_index) {
            for (start, chunk) in region.chunks_in(first, end) {
                let chunk_end = start + chunk.count;
                let (run_start, run_end) = (first.max(start), end.min(chunk_end));
                let whole = run_start == start && run_end == chunk_end;
                if whole
                    || chunk.offset != 0
                    || region.aliased.any(start, chunk_end)
                    || !self
                        .physical
                        .movable(chunk.handle, 0, chunk.count * granule)
                {
                    continue;
                }
                runs.push(PinnedRun {
                    free,
                    view: (region_index, start),
                    handle: chunk.handle,
                    count: chunk.count,
                    start: run_start,
                    len: run_end - run_start,
                });
            }
        }
        runs
    }

    /// Maps `run`'s whole handle again at `at`: one alias group of the
    /// handle at both views, which the live blocks at its first view claim
    /// (lent at the new one), leaving the rest idle at both.
    fn map_pinned(
        &mut self,
        dev: &dyn Device,
        granule: u64,
        run: PinnedRun,
        at: View,
    ) -> Result<(), AllocError> {
        let (handle, count) = (run.handle, run.count);
        self.map_chunk(dev, granule, at.0, at.1, count, handle, 0, true)?;
        let group = AliasGroup {
            handle,
            offset: 0,
            count,
            views: vec![run.view, at],
            user: run.view,
            blocks: 0,
        };
        self.groups.create(group, &mut self.regions);
        let region_index = run.view.0;
        let lo = self.region(region_index).base + run.view.1 * granule;
        for ptr in self
            .spans
            .live_overlapping(run.free, lo, lo + count * granule)
        {
            let size = self.spans.get(self.live[&ptr].span).size;
            let (first, end) = self
                .aliased_span(region_index, ptr, size)
                .expect("the handle is aliased now");
            let mut views = self
                .groups
                .take_views(&self.regions, region_index, first, end);
            // Groups of other handles under the block are its own already.
            views.retain(|&(_, id)| self.groups.get(id).handle == handle);
            self.groups.claim(
                views,
                (region_index, first, end),
                granule,
                &mut self.regions,
            );
            self.live.get_mut(&ptr).expect("a live block").on_aliased = true;
        }
        Ok(())
    }
}

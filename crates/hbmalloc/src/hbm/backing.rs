//! Physical memory under virtual ranges: the allowance, creating handles and
//! mapping them (with access granted once per stretch), mapping ahead at
//! the top of the heap, spare pieces, and stealing wholly free chunks. The
//! memory itself is kept by [`Physical`](super::physical::Physical). See the
//! policy's header for the order a miss takes memory in.

use std::collections::BTreeSet;

use crate::device::{Device, DevicePtr, PhysicalHandle, StreamId};
use crate::error::AllocError;
use crate::history::Action;

use super::alias::Donors;
use super::{
    granules_under, Backing, Chunk, GranuleSpan, HbmPolicy, GROWTH_CHUNK_BYTES,
    GROWTH_CHUNK_WASTE_FACTOR, MAX_HANDLES_PER_RUN, MAX_MAP_AHEAD_PERCENT,
    STITCH_BEFORE_PEAK_FACTOR, WHOLE_HANDLE_GRANULES_RANGE, WHOLE_HANDLE_SPLIT_FACTOR,
};

impl HbmPolicy {
    /// The memory this policy lets itself hold before it steals chunks
    /// rather than creating new ones.
    fn allowance_bytes(&self, granule: u64) -> u64 {
        let allowed = self.placement.peak_demand_bytes() as f64
            * (1.0 + self.config.max_waste_percent / 100.0);
        (allowed as u64).div_ceil(granule) * granule
    }

    /// Creates a handle of `bytes` unless that would hold more than `limit`
    /// or the device is out of memory.
    pub(super) fn create(
        &mut self,
        dev: &dyn Device,
        bytes: u64,
        limit: u64,
    ) -> Result<Option<PhysicalHandle>, AllocError> {
        if self.physical.held_bytes() + bytes > limit {
            return Ok(None);
        }
        match dev.physical_create(bytes) {
            Ok(handle) => {
                self.physical.add_handle(handle, bytes);
                self.count_reserved(bytes);
                self.state.stats.num_device_alloc += 1;
                Ok(Some(handle))
            }
            Err(e) if e.is_out_of_memory() => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Maps `count` granules of `handle`, from byte `offset` of it, at granule
    /// `first` of the region. Access is granted afterwards, once for a whole
    /// run ([`HbmPolicy::grant_access`]). On failure the piece is kept as a
    /// spare (an alias's memory stays mapped elsewhere), so nothing is ever
    /// lost track of.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn map_chunk(
        &mut self,
        dev: &dyn Device,
        granule: u64,
        region_index: u32,
        first: u64,
        count: u64,
        handle: PhysicalHandle,
        offset: u64,
        alias: bool,
    ) -> Result<(), AllocError> {
        let (va, stream) = {
            let r = self.region(region_index);
            (r.base + first * granule, r.stream)
        };
        let bytes = count * granule;
        // A failed alias loses nothing: the memory is still mapped elsewhere.
        if let Err(e) = dev.map(va, bytes, handle, offset) {
            if !alias {
                self.physical.add_spare(handle, offset, bytes);
            }
            return Err(e.into());
        }
        self.state.stats.num_device_alloc += 1;
        self.physical.count_mapped(handle, bytes, true);
        let region = self.region_mut(region_index);
        region.chunks.insert(
            first,
            Chunk {
                count,
                handle,
                offset,
            },
        );
        region.chunk_starts.set(first, 1, true);
        region.mapped.set(first, count, true);
        self.state
            .history
            .record(Action::SegmentMap, va, bytes, stream);
        Ok(())
    }

    /// Maps every unmapped granule under `[ptr, ptr + size)` of `region`.
    /// `pressed`: an out-of-memory retry, where stealing ignores the allowance.
    pub(super) fn back_range(
        &mut self,
        dev: &dyn Device,
        ptr: DevicePtr,
        size: u64,
        region_index: u32,
        pressed: bool,
    ) -> Result<Backing, AllocError> {
        let Some(granule) = self.granule else {
            return Ok(Backing::Done);
        };
        let region = self.region(region_index);
        let (first, end) = granules_under(granule, region.base, ptr, size);
        if region.all_mapped(first, end) {
            return Ok(Backing::Done);
        }
        // Maximal unmapped runs under the block, found a word at a time.
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut i = first;
        while i < end {
            let start = region.next_with(i, end, false);
            if start == end {
                break;
            }
            let stop = region.next_with(start, end, true);
            runs.push((start, stop - start));
            i = stop;
        }
        let hard_limit = self.state.limit_bytes.unwrap_or(u64::MAX);
        let soft_limit = if pressed {
            0
        } else {
            self.allowance_bytes(granule).min(hard_limit)
        };
        // Growth at the top of the heap: map ahead (half the allowance, at
        // most 1% of peak demand), so a growing heap maps in few large chunks
        // (each costs a create, a map and an access call). A request that
        // takes demand to a new peak maps at least `GROWTH_CHUNK_BYTES` ahead,
        // even past the allowance: growth (a first step, a longer sequence)
        // is where the calls are, and what the heap does not grow into is
        // one chunk at most (see `growing_limit` for a small heap). A chunk
        // is one handle at most: past that, each handle costs its own create,
        // map and access grant whether made now or when needed, and what is
        // mapped ahead is held.
        let needed: u64 = runs.iter().map(|r| r.1).sum::<u64>() * granule;
        let peak = self.placement.peak_demand_bytes() as f64;
        let ahead_percent = self.config.max_waste_percent.min(MAX_MAP_AHEAD_PERCENT) / 2.0;
        let growth_chunk = self.growth_chunk_bytes();
        let chunk_granules = (((peak * ahead_percent / 100.0) as u64).max(growth_chunk) / granule)
            .min(self.one_handle_granules(granule));
        let ahead_limit = if self.placement.growing() && !pressed {
            let waste = self.config.max_waste_percent;
            growing_limit(peak, waste, soft_limit, chunk_granules * granule, granule)
                .min(hard_limit)
        } else {
            soft_limit
        };
        let budget = ahead_limit.saturating_sub(self.physical.held_bytes() + needed) / granule;
        // Only the last run is extended, and only it may use the ahead limit.
        let mut last_extended = false;
        if let Some(last) = runs.last_mut() {
            let target = chunk_granules.min(last.1 + budget);
            if last.1 < target {
                // Extend up to the next mapped granule, within the target.
                let limit = (last.0 + target).min(region.granules);
                last.1 = region.next_with(last.0 + last.1, limit, true) - last.0;
                last_extended = true;
            }
        }
        let run_count = runs.len();
        // Where handles map whole only, the last run may take a whole handle
        // larger than it, mapped on past its end over unmapped (so free)
        // granules: idle memory or a spare in a large handle then serves a
        // small run instead of new memory being created beside it.
        let last_room = runs.last().map_or(end, |r| {
            let run_end = r.0 + r.1;
            if self.physical.maps_handle_parts() {
                run_end
            } else {
                let limit = region
                    .granules
                    .min(run_end + *WHOLE_HANDLE_GRANULES_RANGE.end());
                region.next_with(run_end, limit, true)
            }
        });
        // Memory already stitched under this range is not taken again.
        let span = (region_index, first, last_room.max(end));
        for (i, (start, count)) in runs.into_iter().enumerate() {
            let last = i + 1 == run_count;
            let limit = if last_extended && last {
                ahead_limit
            } else {
                soft_limit
            };
            let room = if last { last_room } else { start + count };
            let backed = self.back_run(
                dev,
                granule,
                span,
                (start, count, end),
                room,
                limit,
                hard_limit,
            );
            // Whatever got mapped, even on failure, gets access now (past
            // the run, only what this call mapped: it was unmapped before).
            self.grant_access(dev, granule, region_index, start, room)?;
            if !backed? {
                return Ok(Backing::OutOfMemory);
            }
        }
        Ok(Backing::Done)
    }

    /// What a request that takes demand to a new peak maps ahead at least:
    /// [`GROWTH_CHUNK_BYTES`], less on a heap whose share of waste that
    /// would exceed ([`GROWTH_CHUNK_WASTE_FACTOR`]).
    fn growth_chunk_bytes(&self) -> u64 {
        let peak = self.placement.peak_demand_bytes() as f64;
        GROWTH_CHUNK_BYTES
            .min((peak * self.config.max_waste_percent * GROWTH_CHUNK_WASTE_FACTOR / 100.0) as u64)
    }

    /// The heap is large enough to map whole [`GROWTH_CHUNK_BYTES`] ahead.
    pub(super) fn maps_whole_chunks_ahead(&self) -> bool {
        self.growth_chunk_bytes() >= GROWTH_CHUNK_BYTES
    }

    /// Grants access to the granules mapped in `[start, end)` of a run that
    /// was wholly unmapped before: one `set_access` per contiguous mapped
    /// stretch, however many chunks were stitched into it (as PyTorch's
    /// expandable segments do). If access fails the stretch's chunks are
    /// unmapped again: memory is never left mapped without access.
    pub(super) fn grant_access(
        &mut self,
        dev: &dyn Device,
        granule: u64,
        region_index: u32,
        start: u64,
        end: u64,
    ) -> Result<(), AllocError> {
        let mut from = self.region(region_index).next_with(start, end, true);
        while from < end {
            let region = self.region(region_index);
            let to = region.next_with(from, end, false);
            if let Err(e) = dev.set_access(region.base + from * granule, (to - from) * granule) {
                let victims: Vec<(u32, u64, u64, u64)> = region
                    .chunks
                    .range(from..to)
                    .map(|(&s, c)| (region_index, s, s, c.count))
                    .collect();
                // A capture forbids the unmap; a failed unmap leaves some
                // mapped. Either way, access is granted again before any
                // later request is served.
                let base = region.base;
                let undone = !self.state.capture_underway
                    && self.unmap_spans(dev, granule, &victims).is_ok();
                if !undone {
                    self.physical
                        .left_without_access((region_index, base, from, to));
                }
                return Err(e.into());
            }
            from = self.region(region_index).next_with(to, end, true);
        }
        Ok(())
    }

    /// Grants access to the stretches left mapped without it
    /// (`without_access`, see [`HbmPolicy::grant_access`]), or fails: no
    /// request is served while memory is mapped without access.
    #[cold]
    pub(super) fn grant_missing_access(&mut self, dev: &dyn Device) -> Result<(), AllocError> {
        let granule = self.granule.unwrap_or(1);
        while let Some((region_index, base, start, end)) = self.physical.next_without_access() {
            let region = self
                .regions
                .get(region_index as usize)
                .and_then(Option::as_ref);
            // A region given back since (its base differs) took its mappings with it.
            if let Some(region) = region.filter(|r| r.base == base) {
                let mut from = region.next_with(start, end, true);
                while from < end {
                    let to = region.next_with(from, end, false);
                    dev.set_access(base + from * granule, (to - from) * granule)?;
                    from = region.next_with(to, end, true);
                }
            }
            self.physical.access_granted();
        }
        Ok(())
    }

    /// Backs the unmapped granules `[start, start + count)`, where `run` is
    /// `(start, count, needed_end)`: spare pieces; one new handle within
    /// `soft_limit` (unless it would take the memory held past its peak
    /// while demand is below its own and idle memory is plentiful: then
    /// that idle memory first, see [`STITCH_BEFORE_PEAK_FACTOR`]); idle
    /// memory under free ranges, mapped here too
    /// ([`AliasGroup`](super::AliasGroup); at a new peak of demand, where
    /// handles map whole, only memory mapped twice already); wholly free
    /// chunks stolen (unmapped, stitched in here), then aliasing again,
    /// then handles cut into idle groups; one new handle within the hard
    /// limit. Granules from `needed_end` on are mapped ahead: worth spares
    /// or a new handle, never aliasing or stealing.
    /// Granules `[start + count, room)` are unmapped: a spare or idle whole
    /// handle larger than what is left of the run may be mapped on over
    /// them. False: out of memory.
    #[allow(clippy::too_many_arguments)]
    fn back_run(
        &mut self,
        dev: &dyn Device,
        granule: u64,
        span: GranuleSpan,
        run: (u64, u64, u64),
        room: u64,
        soft_limit: u64,
        hard_limit: u64,
    ) -> Result<bool, AllocError> {
        let (start, count, needed_end) = run;
        let region_index = span.0;
        let end = start + count;
        let mut cursor = self.stitch_spares(dev, granule, region_index, (start, end), room)?;
        if cursor >= end {
            return Ok(true);
        }
        // A new handle would raise the peak reserved memory while demand is
        // below its own peak: stitch plentiful idle memory in first.
        let needed_stop = end.min(needed_end);
        if !self.placement.growing()
            && cursor < needed_stop
            && self.physical.held_bytes() + (end - cursor) * granule
                > self.physical.peak_held_bytes()
        {
            let run = (cursor, needed_stop);
            cursor = self.alias_idle(
                dev,
                granule,
                span,
                run,
                room,
                STITCH_BEFORE_PEAK_FACTOR,
                Donors::Idle,
            )?;
            if cursor >= needed_stop {
                return Ok(true);
            }
        }
        cursor = self.map_new_handle(dev, granule, region_index, cursor, end, soft_limit)?;
        if cursor == end {
            return Ok(true);
        }
        let end = end.min(needed_end);
        if cursor >= end {
            return Ok(true);
        }
        // At a new peak of demand, where handles map whole, memory mapped
        // once is moved here (stolen, below) rather than mapped here as well:
        // a new alias group would lend its ranges for as long as the peak's
        // block lives, and a repeating step's later passes (no new peak)
        // still alias what they need. Idle groups still gain a view: moving
        // one unmaps a view and frees no memory (`docs/hbm-design.md`).
        let kinds = if self.placement.growing() && !self.physical.maps_handle_parts() {
            Donors::Aliased
        } else {
            Donors::Idle
        };
        cursor = self.alias_idle(dev, granule, span, (cursor, end), room, 1, kinds)?;
        if cursor >= end {
            return Ok(true);
        }
        // Stealing waits for the victims' streams: never during a capture.
        let victims = if self.state.capture_underway {
            Vec::new()
        } else {
            self.free_spans(granule, (end - cursor) * granule, true)
        };
        // With nothing stolen, the spares and idle memory are as the calls
        // above left them: used up.
        if !victims.is_empty() {
            self.unmap_spans(dev, granule, &victims)?;
            cursor = self.stitch_spares(dev, granule, region_index, (cursor, end), room)?;
            // Unmapping a view of a group frees a place for another view.
            if cursor < end {
                cursor =
                    self.alias_idle(dev, granule, span, (cursor, end), room, 1, Donors::Idle)?;
            }
            if cursor >= end {
                return Ok(true);
            }
        }
        // The last resort before memory past the allowance: idle handles
        // that blocks cut into groups, mapped whole. Not earlier: each such
        // map adds a view to every group of the handle, one more place it
        // may be lent from when a later step wants it back where it was.
        if !self.physical.maps_handle_parts() {
            cursor = self.alias_idle(
                dev,
                granule,
                span,
                (cursor, end),
                room,
                1,
                Donors::WithCutHandles,
            )?;
            if cursor >= end {
                return Ok(true);
            }
        }
        Ok(self.map_new_handle(dev, granule, region_index, cursor, end, hard_limit)? == end)
    }

    /// Creates one handle for granules `[cursor, end)` (unless that would
    /// hold more than `limit`) and maps it there; returns the first granule
    /// still unmapped (`end` when done, `cursor` when there was no memory).
    ///
    /// On a device that maps whole handles only
    /// ([`Device::maps_handle_parts`]), handles of at most
    /// [`HbmPolicy::whole_handle_granules`] granules instead (one for a
    /// run shorter than [`WHOLE_HANDLE_SPLIT_FACTOR`] of them): there a
    /// stitch, a steal or a spare moves whole handles only, and smaller
    /// handles fit where they are needed more often, for a create and a map
    /// each.
    fn map_new_handle(
        &mut self,
        dev: &dyn Device,
        granule: u64,
        region_index: u32,
        cursor: u64,
        end: u64,
        limit: u64,
    ) -> Result<u64, AllocError> {
        let count = end - cursor;
        // All or nothing against the limit, as one handle would be.
        if self.physical.held_bytes() + count * granule > limit {
            return Ok(cursor);
        }
        let per_handle = if count <= self.one_handle_granules(granule) {
            count
        } else {
            self.whole_handle_granules(granule)
                .max(count.div_ceil(MAX_HANDLES_PER_RUN))
        };
        let mut at = cursor;
        while at < end {
            let take = per_handle.min(end - at);
            let Some(handle) = self.create(dev, take * granule, limit)? else {
                // The device ran out part way: what is mapped stays mapped
                // (the caller grants it access).
                return Ok(at);
            };
            self.map_chunk(dev, granule, region_index, at, take, handle, 0, false)?;
            at += take;
        }
        Ok(end)
    }

    /// The most granules a new handle holds on a device that maps whole
    /// handles only: the configured number, or a share of the most memory
    /// held so far (`Physical::whole_handle_granules`).
    pub(super) fn whole_handle_granules(&self, granule: u64) -> u64 {
        self.physical
            .whole_handle_granules(self.config.whole_handle_granules, granule)
    }

    /// The longest run [`HbmPolicy::map_new_handle`] backs with one handle:
    /// any, where handles map in part; otherwise the handle size, or under
    /// `auto` a run shorter than [`WHOLE_HANDLE_SPLIT_FACTOR`] of them.
    fn one_handle_granules(&self, granule: u64) -> u64 {
        if self.physical.maps_handle_parts() {
            return u64::MAX;
        }
        let most = self.whole_handle_granules(granule);
        if self.config.whole_handle_granules.is_none() {
            WHOLE_HANDLE_SPLIT_FACTOR * most - 1
        } else {
            most
        }
    }

    /// Maps spare pieces into `[cursor, end)` (see `Physical::take_spare`),
    /// cutting the last one to fit where handles map in part, or mapping a
    /// whole one on past `end` (up to `room`, unmapped) where they map
    /// whole; returns the first granule still unmapped (`end` or past it
    /// when done).
    fn stitch_spares(
        &mut self,
        dev: &dyn Device,
        granule: u64,
        region_index: u32,
        (mut cursor, end): (u64, u64),
        room_end: u64,
    ) -> Result<u64, AllocError> {
        while cursor < end {
            let room = (end - cursor) * granule;
            let past = (room_end.max(end) - cursor) * granule;
            let Some(piece) = self.physical.take_spare(room, past) else {
                break;
            };
            let take = piece.bytes;
            self.map_chunk(
                dev,
                granule,
                region_index,
                cursor,
                take / granule,
                piece.handle,
                piece.offset,
                false,
            )?;
            cursor += take / granule;
        }
        Ok(cursor)
    }

    /// The granules `[first, end)` lying wholly inside each free range, as
    /// (its span, region, first, end), highest address first; ranges
    /// smaller than a granule (not in `large_free`) hold none.
    pub(super) fn free_granules(
        &self,
        granule: u64,
    ) -> impl Iterator<Item = (u32, u32, u64, u64)> + '_ {
        self.spans.large_free_by_end().filter_map(move |id| {
            let (first, end) = self.whole_granules(granule, id);
            (first < end).then_some((id, self.spans.get(id).region, first, end))
        })
    }

    /// Granules lying wholly inside free ranges, highest address first
    /// (placement favours low addresses, so the top is the least likely to be
    /// wanted again soon), until they add up to `bytes`: as (region, chunk
    /// start, first granule, granules). `giving_only`: only chunks whose
    /// unmapping gives something — unaliased granules (spare once unmapped)
    /// or an idle group's view (a place for another view); unmapping a view
    /// of memory in use elsewhere gives nothing.
    pub(super) fn free_spans(
        &self,
        granule: u64,
        bytes: u64,
        giving_only: bool,
    ) -> Vec<(u32, u64, u64, u64)> {
        let mut victims = Vec::new();
        let mut found = 0u64;
        for (_, region_index, first, end) in self.free_granules(granule) {
            if found >= bytes {
                break;
            }
            let region = self.region(region_index);
            for (start, chunk) in region.chunks_in(first, end) {
                let chunk_end = start + chunk.count;
                if found >= bytes {
                    break;
                }
                // Only chunks wholly inside the free range move: a chunk
                // partly under a live block stays mapped (see the header).
                if start < first || chunk_end > end {
                    continue;
                }
                // Wholly free here, so a group in use is in use elsewhere:
                // lent.
                if giving_only && region.lent.all(start, chunk_end) {
                    continue;
                }
                victims.push((region_index, start, start, chunk.count));
                found += chunk.count * granule;
            }
        }
        victims
    }

    /// Takes the given chunks (each wholly free) out of their regions: each
    /// is unmapped (one call) and its memory becomes a spare piece.
    pub(super) fn unmap_spans(
        &mut self,
        dev: &dyn Device,
        granule: u64,
        victims: &[(u32, u64, u64, u64)],
    ) -> Result<(), AllocError> {
        if victims.is_empty() {
            return Ok(());
        }
        // A page may still be touched by kernels queued on its stream before
        // the free: wait for each owning stream once.
        let streams: BTreeSet<StreamId> = victims
            .iter()
            .map(|&(r, ..)| self.region(r).stream)
            .collect();
        for stream in streams {
            self.events.wait_for_stream(dev, stream)?;
        }
        for &(region_index, start, _, _) in victims {
            // Taken out first (one search); put back if the unmap fails.
            let region = self.region_mut(region_index);
            let chunk = region.chunks.remove(&start).expect("a mapped chunk");
            let va = region.base + start * granule;
            let stream = region.stream;
            let bytes = chunk.count * granule;
            if let Err(e) = dev.unmap(va, bytes) {
                self.region_mut(region_index).chunks.insert(start, chunk);
                return Err(e.into());
            }
            self.state.stats.num_device_free += 1;
            self.state
                .history
                .record(Action::SegmentUnmap, va, bytes, stream);
            self.physical.count_mapped(chunk.handle, bytes, false);
            let region = self.region_mut(region_index);
            region.chunk_starts.set(start, 1, false);
            region.mapped.set(start, chunk.count, false);
            if !region.aliased.any(start, start + chunk.count) {
                self.physical.add_spare(chunk.handle, chunk.offset, bytes);
                continue;
            }
            // Views of alias groups stay held at their other views; the rest
            // of the chunk becomes spare pieces.
            let end = start + chunk.count;
            let views: Vec<(u64, u32)> = self
                .groups
                .views_in(&self.regions, region_index, start, end)
                .collect();
            let mut cursor = start;
            for (view_start, id) in views {
                if view_start > cursor {
                    self.physical.add_spare(
                        chunk.handle,
                        chunk.offset + (cursor - start) * granule,
                        (view_start - cursor) * granule,
                    );
                }
                cursor = view_start + self.groups.get(id).count;
                self.groups
                    .drop_view(id, (region_index, view_start), &mut self.regions);
            }
            if cursor < end {
                self.physical.add_spare(
                    chunk.handle,
                    chunk.offset + (cursor - start) * granule,
                    (end - cursor) * granule,
                );
            }
        }
        Ok(())
    }

    /// Releases every handle of which nothing is mapped.
    pub(super) fn release_spares(&mut self, dev: &dyn Device) -> Result<(), AllocError> {
        // In handle order, as the calls are recorded.
        for handle in self.physical.idle_handles() {
            dev.physical_release(handle)?;
            let bytes = self.physical.forget_handle(handle);
            self.count_unreserved(bytes);
            self.state.stats.num_device_free += 1;
        }
        Ok(())
    }
}

/// What a heap growing to a new peak of demand `peak` may hold: a `chunk`
/// past the allowance `soft_limit`, but in all no more than the chunk's and
/// the allowance's shares of peak demand (`1 + GROWTH_CHUNK_WASTE_FACTOR`
/// times `waste_percent`), rounded down to granules: the allowance is
/// rounded up, and on a heap of a few hundred MiB a granule of rounding is
/// a percent of efficiency.
fn growing_limit(peak: f64, waste_percent: f64, soft_limit: u64, chunk: u64, granule: u64) -> u64 {
    let share = 1.0 + waste_percent * (1.0 + GROWTH_CHUNK_WASTE_FACTOR) / 100.0;
    let cap = (peak * share) as u64 / granule * granule;
    (soft_limit + chunk).min(cap.max(soft_limit))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_small_heap_grows_within_its_share_of_peak_demand() {
        let g = 2 * MIB;
        let peak = 107.9 * MIB as f64;
        // Allowance 1% rounded up: 110 MiB; a 4 MiB chunk would make 114,
        // 5.7% over the peak; the share, 5%, rounds down to 112.
        assert_eq!(growing_limit(peak, 1.0, 110 * MIB, 4 * MIB, g), 112 * MIB);
        // A large heap's chunk is well within its share.
        let peak = 10_000.0 * MIB as f64;
        assert_eq!(
            growing_limit(peak, 1.0, 10_100 * MIB, 12 * MIB, g),
            10_112 * MIB
        );
        // Never below the allowance, nor past it with no waste allowed.
        assert_eq!(
            growing_limit(10.5 * MIB as f64, 1.0, 12 * MIB, 0, g),
            12 * MIB
        );
        assert_eq!(growing_limit(peak, 0.0, 10_000 * MIB, 0, g), 10_000 * MIB);
    }
}

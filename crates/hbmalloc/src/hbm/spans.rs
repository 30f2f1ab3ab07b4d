//! Blocks and free ranges as [`Span`]s linked to their neighbours, and the
//! free-range indexes kept in step with them: each stream's size index (best
//! fit) and `large_free` (ranges that can hold a whole granule). Splitting a
//! range and merging a freed block with its neighbours go through the links,
//! with no search. Regions are not seen here: a caller names a span's
//! size-index slot (its region's stream's).

use std::collections::{BTreeMap, BTreeSet};

use crate::device::{DevicePtr, StreamId};
use crate::fastmap::FastMap;

use super::size_index::SizeIndex;

/// No span: the end of a region's list.
pub(super) const NO_SPAN: u32 = u32::MAX;

/// A stretch of a region, a live block or a free range, linked to its
/// neighbours in address order (PyTorch's `Block` links, for the same
/// reason): freeing finds the ranges to merge with in O(1), with no search.
/// Free ranges are maximal: a free span's neighbours are live.
#[derive(Copy, Clone, Debug)]
pub(super) struct Span {
    pub(super) start: DevicePtr,
    pub(super) size: u64,
    pub(super) region: u32,
    pub(super) prev: u32,
    pub(super) next: u32,
    pub(super) free: bool,
}

impl Span {
    #[inline]
    pub(super) fn end(&self) -> DevicePtr {
        self.start + self.size
    }
}

/// Each region's blocks and free ranges, as (address, size, live).
pub(super) type RegionTiles = BTreeMap<u32, Vec<(DevicePtr, u64, bool)>>;

/// Every span, by id, and the indexes of the free ones.
#[derive(Debug)]
pub(super) struct Spans {
    /// Every region's live blocks and free ranges (`NO_SPAN`-terminated
    /// lists), by id.
    spans: Vec<Span>,
    /// Retired span ids, reused first.
    free_ids: Vec<u32>,
    /// Free spans of at least `large_bytes` (the only ones that can hold a
    /// whole granule) by end address, for the walks that look for idle
    /// memory and stealable chunks. A carve from the front or a merge with
    /// the next range keeps a range's end, so the hot path rarely touches
    /// it. A hash map, sorted by the walks (misses only): the hot path's
    /// inserts and removes cost a B-tree about 150 instructions each.
    large_free: FastMap<DevicePtr, u32>,
    /// Free ranges per stream by (size, address), one entry (slot) per
    /// stream that ever had a region (few: a linear search finds one).
    by_size: Vec<SizeIndex>,
    /// A granule (`u64::MAX` without one): free ranges this large are in
    /// `large_free`.
    large_bytes: u64,
}

impl Spans {
    /// No spans; free ranges of `large_bytes` or more go in `large_free`.
    pub(super) fn new(large_bytes: u64) -> Self {
        Spans {
            spans: Vec::new(),
            free_ids: Vec::new(),
            large_free: FastMap::default(),
            by_size: Vec::new(),
            large_bytes,
        }
    }

    #[inline]
    pub(super) fn get(&self, id: u32) -> &Span {
        &self.spans[id as usize]
    }

    #[inline]
    fn get_mut(&mut self, id: u32) -> &mut Span {
        &mut self.spans[id as usize]
    }

    /// The size index of `stream`, if it ever had a region.
    #[inline]
    pub(super) fn index_of(&self, stream: StreamId) -> Option<&SizeIndex> {
        self.by_size.iter().find(|index| index.stream == stream)
    }

    /// The size-index slot of `stream`, made if it has none.
    pub(super) fn slot_for(&mut self, stream: StreamId) -> usize {
        match self.by_size.iter().position(|s| s.stream == stream) {
            Some(slot) => slot,
            None => {
                self.by_size.push(SizeIndex::new(stream));
                self.by_size.len() - 1
            }
        }
    }

    /// Every stream's size index.
    pub(super) fn indexes(&self) -> &[SizeIndex] {
        &self.by_size
    }

    /// The free span that is exactly `[start, start + size)` in size-index
    /// `slot`, if there is one.
    pub(super) fn free_at(&self, slot: usize, size: u64, start: DevicePtr) -> Option<u32> {
        self.by_size[slot].get(size, start)
    }

    /// The live blocks (pending frees included) of span `id`'s region that
    /// overlap `[lo, hi)`, lowest first, found by walking from `id` (which
    /// must overlap it) to its neighbours.
    pub(super) fn live_overlapping(&self, id: u32, lo: DevicePtr, hi: DevicePtr) -> Vec<DevicePtr> {
        let walk = |blocks: &mut Vec<DevicePtr>, mut at: u32, step: fn(&Span) -> u32| {
            while at != NO_SPAN && self.get(at).start < hi && self.get(at).end() > lo {
                let span = self.get(at);
                if !span.free {
                    blocks.push(span.start);
                }
                at = step(span);
            }
        };
        let mut blocks = Vec::new();
        walk(&mut blocks, self.get(id).prev, |span| span.prev);
        blocks.reverse();
        walk(&mut blocks, self.get(id).next, |span| span.next);
        blocks
    }

    /// The free spans of at least a granule, highest end address first.
    pub(super) fn large_free_by_end(&self) -> impl Iterator<Item = u32> {
        let mut by_end: Vec<(DevicePtr, u32)> = self
            .large_free
            .iter()
            .map(|(&end, &id)| (end, id))
            .collect();
        by_end.sort_unstable_by_key(|&(end, _)| std::cmp::Reverse(end));
        by_end.into_iter().map(|(_, id)| id)
    }

    fn new_span(&mut self, span: Span) -> u32 {
        match self.free_ids.pop() {
            Some(id) => {
                self.spans[id as usize] = span;
                id
            }
            None => {
                self.spans.push(span);
                (self.spans.len() - 1) as u32
            }
        }
    }

    /// A new free span (a whole new region), filed in size-index `slot`.
    pub(super) fn add_free(&mut self, span: Span, slot: usize) -> u32 {
        let id = self.new_span(span);
        self.index_free(id, slot);
        id
    }

    /// Takes free span `id` (a whole region given back) out of the indexes
    /// and retires it.
    pub(super) fn remove_free(&mut self, id: u32, slot: usize) {
        self.unindex_free(id, slot);
        self.retire(id);
    }

    /// Makes `before` and `after` neighbours (either may be `NO_SPAN`).
    fn link(&mut self, before: u32, after: u32) {
        if before != NO_SPAN {
            self.get_mut(before).next = after;
        }
        if after != NO_SPAN {
            self.get_mut(after).prev = before;
        }
    }

    /// Unlinks span `id` (merged into a neighbour) and retires its id.
    fn drop_span(&mut self, id: u32) {
        let Span { prev, next, .. } = *self.get(id);
        self.link(prev, next);
        self.retire(id);
    }

    /// Retires span `id`, unlinked already, for reuse. A retired span is
    /// never free: a place remembered in a span (a recent free) may name it
    /// still, and is only used while its span is free.
    fn retire(&mut self, id: u32) {
        self.get_mut(id).free = false;
        self.free_ids.push(id);
    }

    /// Files free span `id` in size-index `slot` (and the large-range index).
    fn index_free(&mut self, id: u32, slot: usize) {
        let span = *self.get(id);
        self.by_size[slot].insert(span.size, span.start, id);
        if span.size >= self.large_bytes {
            self.large_free.insert(span.end(), id);
        }
    }

    /// Takes free span `id` out of the indexes.
    fn unindex_free(&mut self, id: u32, slot: usize) {
        let span = *self.get(id);
        self.by_size[slot].remove(span.size, span.start);
        if span.size >= self.large_bytes {
            self.large_free.remove(&span.end());
        }
    }

    /// Span `id` (a block just given back, its stream's size index `slot`)
    /// becomes free, merged with free neighbours: found through its links,
    /// no search. Merged into a free next span, it takes that span's id and
    /// end, so the large-range entry stays as it is. Returns the id of the
    /// free span it is now part of.
    #[inline]
    pub(super) fn release(&mut self, id: u32, slot: usize) -> u32 {
        let Span {
            start,
            size,
            prev,
            next,
            ..
        } = *self.get(id);
        let large = self.large_bytes;
        let mut keep = id;
        let mut indexed_large = false;
        if next != NO_SPAN && self.get(next).free {
            let old = *self.get(next);
            self.by_size[slot].remove(old.size, old.start);
            indexed_large = old.size >= large;
            let span = self.get_mut(next);
            span.start = start;
            span.size += size;
            self.drop_span(id);
            keep = next;
        }
        if prev != NO_SPAN && self.get(prev).free {
            self.unindex_free(prev, slot);
            let Span { start, size, .. } = *self.get(prev);
            let span = self.get_mut(keep);
            span.start = start;
            span.size += size;
            self.drop_span(prev);
        }
        let span = self.get_mut(keep);
        span.free = true;
        let (start, size, end) = (span.start, span.size, span.end());
        self.by_size[slot].insert(size, start, keep);
        if size >= large && !indexed_large {
            self.large_free.insert(end, keep);
        }
        keep
    }

    /// Cuts a live span of `size` bytes at `ptr` out of free span `id` (in
    /// size index `slot`); the parts before and after it stay free. Returns
    /// the new span.
    #[inline]
    pub(super) fn take(&mut self, id: u32, slot: usize, ptr: DevicePtr, size: u64) -> u32 {
        let range = *self.get(id);
        let large = self.large_bytes;
        let sizes = &mut self.by_size[slot];
        sizes.remove(range.size, range.start);
        let rest = range.end() - (ptr + size);
        if rest > 0 {
            // The range keeps what follows the block, hence its end (and its
            // large-range entry while it stays large).
            sizes.insert(rest, ptr + size, id);
            if range.size >= large && rest < large {
                self.large_free.remove(&range.end());
            }
        } else if range.size >= large {
            self.large_free.remove(&range.end());
        }
        let block = self.new_span(Span {
            start: ptr,
            size,
            region: range.region,
            prev: NO_SPAN,
            next: NO_SPAN,
            free: false,
        });
        // Slid past memory in use elsewhere: the front stays free.
        let before = if ptr > range.start {
            let front = self.new_span(Span {
                start: range.start,
                size: ptr - range.start,
                ..range
            });
            self.link(range.prev, front);
            self.index_free(front, slot);
            front
        } else {
            range.prev
        };
        self.link(before, block);
        if rest > 0 {
            let span = self.get_mut(id);
            span.start = ptr + size;
            span.size = rest;
            self.link(block, id);
        } else {
            self.link(block, range.next);
            self.retire(id);
        }
        block
    }

    /// Each live block's span (`live`: address, span id) is a block at its
    /// address; each free range in a size index is a free span of that
    /// index's stream (`region(i)`: base, size and size-index slot of live
    /// region `i`), in the large-range index exactly when it is large; links
    /// are mutual and contiguous, and every span in use is a block or a
    /// free range. Returns each region's blocks and free ranges.
    pub(super) fn check(
        &self,
        live: impl Iterator<Item = (DevicePtr, u32)>,
        region: impl Fn(u32) -> Option<(DevicePtr, u64, usize)>,
    ) -> Result<RegionTiles, String> {
        let mut by_region: RegionTiles = BTreeMap::new();
        let mut in_use = 0usize;
        for (p, id) in live {
            let span = self
                .spans
                .get(id as usize)
                .ok_or_else(|| format!("live block {p:#x}: no span {id}"))?;
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
        for (slot, index) in self.by_size.iter().enumerate() {
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
                let (_, _, region_slot) = region(span.region)
                    .ok_or_else(|| format!("free range {p:#x} in a dead region"))?;
                if region_slot != slot {
                    return Err(format!("free range {p:#x} in another stream's index"));
                }
                let is_large = size >= self.large_bytes;
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
        if in_use + self.free_ids.len() != self.spans.len() {
            return Err(format!(
                "{} spans, {in_use} in use and {} retired",
                self.spans.len(),
                self.free_ids.len()
            ));
        }
        let retired: BTreeSet<u32> = self.free_ids.iter().copied().collect();
        for (id, span) in self.spans.iter().enumerate() {
            if retired.contains(&(id as u32)) {
                if span.free {
                    return Err(format!("retired span {id} is marked free"));
                }
                continue;
            }
            let (base, size, _) =
                region(span.region).ok_or_else(|| format!("span {id} in a dead region"))?;
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
                span.start == base
            } else {
                linked(span.prev, span.start, true)
            };
            let next_ok = if span.next == NO_SPAN {
                span.end() == base + size
            } else {
                linked(span.next, span.end(), false)
            };
            if !prev_ok || !next_ok {
                return Err(format!("span {id} is badly linked: {span:?}"));
            }
        }
        Ok(by_region)
    }
}

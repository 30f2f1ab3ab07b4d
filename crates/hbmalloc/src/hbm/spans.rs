//! Blocks and free ranges as [`Span`]s linked to their neighbours, and the
//! free-range indexes kept in step with them: the stream's size index (best
//! fit) and `large_free` (ranges that can hold a whole granule). Splitting a
//! range and merging a freed block with its neighbours go through the links,
//! with no search.

use crate::device::DevicePtr;

use super::{HbmPolicy, Span, NO_SPAN};

impl HbmPolicy {
    /// Free ranges at least this large are in `large_free`: a granule
    /// (none, without one).
    pub(super) fn large_range_bytes(&self) -> u64 {
        self.granule.unwrap_or(u64::MAX)
    }

    pub(super) fn span(&self, id: u32) -> &Span {
        &self.spans[id as usize]
    }

    /// The granules `[first, end)` of its region lying wholly inside span
    /// `id` (none, `first >= end`, for a span smaller than a granule).
    pub(super) fn whole_granules(&self, granule: u64, id: u32) -> (u64, u64) {
        let span = self.span(id);
        let base = self.region(span.region).base;
        (
            (span.start - base).div_ceil(granule),
            (span.end() - base) / granule,
        )
    }

    fn span_mut(&mut self, id: u32) -> &mut Span {
        &mut self.spans[id as usize]
    }

    pub(super) fn new_span(&mut self, span: Span) -> u32 {
        match self.free_span_ids.pop() {
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

    /// Makes `before` and `after` neighbours (either may be `NO_SPAN`).
    fn link(&mut self, before: u32, after: u32) {
        if before != NO_SPAN {
            self.span_mut(before).next = after;
        }
        if after != NO_SPAN {
            self.span_mut(after).prev = before;
        }
    }

    /// Unlinks span `id` (merged into a neighbour) and retires its id.
    fn drop_span(&mut self, id: u32) {
        let Span { prev, next, .. } = *self.span(id);
        self.link(prev, next);
        self.retire_span(id);
    }

    /// Retires span `id`, unlinked already, for reuse. A retired span is
    /// never free: a place remembered in a span (`recent_frees`) may name it
    /// still, and is only used while its span is free.
    pub(super) fn retire_span(&mut self, id: u32) {
        self.span_mut(id).free = false;
        self.free_span_ids.push(id);
    }

    /// Files free span `id` in the size index (and the large-range index).
    pub(super) fn index_free(&mut self, id: u32) {
        let span = *self.span(id);
        let slot = self.region(span.region).size_index;
        self.free_by_size[slot].insert(span.size, span.start, id);
        if span.size >= self.large_range_bytes() {
            self.large_free.insert(span.end(), id);
        }
    }

    /// Takes free span `id` out of the indexes.
    pub(super) fn unindex_free(&mut self, id: u32) {
        let span = *self.span(id);
        let slot = self.region(span.region).size_index;
        self.free_by_size[slot].remove(span.size, span.start);
        if span.size >= self.large_range_bytes() {
            self.large_free.remove(&span.end());
        }
    }

    /// Span `id` (a block just given back) becomes free, merged with free
    /// neighbours: found through its links, no search. Merged into a free
    /// next span, it takes that span's id and end, so the large-range entry
    /// stays as it is. Returns the id of the free span it is now part of.
    pub(super) fn release_span(&mut self, id: u32) -> u32 {
        let Span {
            start,
            size,
            prev,
            next,
            region,
            ..
        } = *self.span(id);
        let slot = self.region(region).size_index;
        let large = self.large_range_bytes();
        let mut keep = id;
        let mut indexed_large = false;
        if next != NO_SPAN && self.span(next).free {
            let old = *self.span(next);
            self.free_by_size[slot].remove(old.size, old.start);
            indexed_large = old.size >= large;
            let span = self.span_mut(next);
            span.start = start;
            span.size += size;
            self.drop_span(id);
            keep = next;
        }
        if prev != NO_SPAN && self.span(prev).free {
            self.unindex_free(prev);
            let Span { start, size, .. } = *self.span(prev);
            let span = self.span_mut(keep);
            span.start = start;
            span.size += size;
            self.drop_span(prev);
        }
        let span = self.span_mut(keep);
        span.free = true;
        let (start, size, end) = (span.start, span.size, span.end());
        self.free_by_size[slot].insert(size, start, keep);
        if size >= large && !indexed_large {
            self.large_free.insert(end, keep);
        }
        keep
    }

    /// Cuts a live span of `size` bytes at `ptr` out of free span `id`; the
    /// parts before and after it stay free. Returns the new span.
    pub(super) fn take_span(&mut self, id: u32, ptr: DevicePtr, size: u64) -> u32 {
        let range = *self.span(id);
        let slot = self.region(range.region).size_index;
        let large = self.large_range_bytes();
        let sizes = &mut self.free_by_size[slot];
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
            self.index_free(front);
            front
        } else {
            range.prev
        };
        self.link(before, block);
        if rest > 0 {
            let span = self.span_mut(id);
            span.start = ptr + size;
            span.size = rest;
            self.link(block, id);
        } else {
            self.link(block, range.next);
            self.retire_span(id);
        }
        block
    }
}

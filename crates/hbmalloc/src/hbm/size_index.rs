//! One stream's free ranges in best-fit order: by size, then address.
//!
//! The ranges are split into size bins, each ordered by (size, address),
//! with a bitmap of the bins that hold any: one bin per 512-byte size up to
//! 1 MiB, then eight per doubling. Why bins: a free or a carve touches a bin
//! of a handful of ranges instead of one map of every range, several levels
//! deep, whose nodes shift on every insert. Bins partition the sizes in
//! order, so walking them in order gives exactly the order of a single map:
//! placements do not change.
//!
//! A bin is a sorted vector while it is small, which is almost always: a
//! binary search and a short shift, where a B-tree's remove costs about 180
//! instructions even in a one-node map (`docs/hbm-design.md`). A bin that grows past
//! [`BIN_VEC_MAX`] ranges (many free ranges of one size: the synthetic
//! scaling benchmark) becomes a B-tree for good, so no operation costs more
//! than a shift of that many entries.

use std::collections::{btree_map, BTreeMap};
use std::ops::ControlFlow;

use crate::device::{DevicePtr, StreamId};

/// Every range size is a multiple of this (`hbm` rounds every request to it).
const BIN_BYTES: u64 = 512;
/// Sizes up to `2^EXACT_LOG2` bytes (1 MiB) have a bin each.
const EXACT_LOG2: u32 = 20;
const EXACT_MAX: u64 = 1 << EXACT_LOG2;
const EXACT_BINS: usize = (EXACT_MAX / BIN_BYTES) as usize;
/// Above `EXACT_MAX`, each doubling of size is split into `2^this` bins.
const BINS_PER_DOUBLING_LOG2: u32 = 3;
const BINS: usize = EXACT_BINS + (((64 - EXACT_LOG2) as usize) << BINS_PER_DOUBLING_LOG2);
/// Most ranges a bin holds as a sorted vector before it becomes a B-tree.
const BIN_VEC_MAX: usize = 64;

/// One bin's ranges, keyed by size (high 64 bits) and address.
#[derive(Debug)]
enum Bin {
    /// Sorted by key; at most [`BIN_VEC_MAX`] entries.
    Sorted(Vec<(u128, u32)>),
    /// A bin that once outgrew the vector.
    Tree(BTreeMap<u128, u32>),
}

/// A bin's entries from some key on, in order.
enum BinIter<'a> {
    Sorted(std::slice::Iter<'a, (u128, u32)>),
    Tree(btree_map::Range<'a, u128, u32>),
}

impl Iterator for BinIter<'_> {
    type Item = (u128, u32);

    #[inline]
    fn next(&mut self) -> Option<(u128, u32)> {
        match self {
            BinIter::Sorted(entries) => entries.next().copied(),
            BinIter::Tree(range) => range.next().map(|(&key, &id)| (key, id)),
        }
    }
}

impl Bin {
    #[inline]
    fn insert(&mut self, key: u128, id: u32) {
        match self {
            Bin::Sorted(entries) => {
                let at = entries.partition_point(|&(k, _)| k < key);
                if entries.get(at).is_some_and(|&(k, _)| k == key) {
                    entries[at].1 = id;
                } else if entries.len() < BIN_VEC_MAX {
                    entries.insert(at, (key, id));
                } else {
                    let mut tree: BTreeMap<u128, u32> = entries.drain(..).collect();
                    tree.insert(key, id);
                    *self = Bin::Tree(tree);
                }
            }
            Bin::Tree(tree) => {
                tree.insert(key, id);
            }
        }
    }

    #[inline]
    fn remove(&mut self, key: u128) -> Option<u32> {
        match self {
            Bin::Sorted(entries) => {
                let at = entries.binary_search_by(|&(k, _)| k.cmp(&key)).ok()?;
                Some(entries.remove(at).1)
            }
            Bin::Tree(tree) => tree.remove(&key),
        }
    }

    fn get(&self, key: u128) -> Option<u32> {
        match self {
            Bin::Sorted(entries) => entries
                .binary_search_by(|&(k, _)| k.cmp(&key))
                .ok()
                .map(|at| entries[at].1),
            Bin::Tree(tree) => tree.get(&key).copied(),
        }
    }

    #[inline]
    fn is_empty(&self) -> bool {
        match self {
            Bin::Sorted(entries) => entries.is_empty(),
            Bin::Tree(tree) => tree.is_empty(),
        }
    }

    /// The entries with keys from `from` on.
    #[inline]
    fn range_from(&self, from: u128) -> BinIter<'_> {
        match self {
            Bin::Sorted(entries) => {
                let at = entries.partition_point(|&(k, _)| k < from);
                BinIter::Sorted(entries[at..].iter())
            }
            Bin::Tree(tree) => BinIter::Tree(tree.range(from..)),
        }
    }

    #[inline]
    fn first(&self) -> Option<(u128, u32)> {
        match self {
            Bin::Sorted(entries) => entries.first().copied(),
            Bin::Tree(tree) => tree.first_key_value().map(|(&key, &id)| (key, id)),
        }
    }

    fn last(&self) -> Option<(u128, u32)> {
        match self {
            Bin::Sorted(entries) => entries.last().copied(),
            Bin::Tree(tree) => tree.last_key_value().map(|(&key, &id)| (key, id)),
        }
    }
}

/// Free ranges of one stream; values are span ids. An empty index is its
/// bin table, about 75 KiB (2,400 empty bins), once per stream.
#[derive(Debug)]
pub(super) struct SizeIndex {
    /// The stream whose ranges these are.
    pub(super) stream: StreamId,
    /// Ranges by bin ([`bin`]), each keyed by size (high 64 bits) and address.
    bins: Vec<Bin>,
    /// Bit `b` set: bin `b` is not empty.
    occupied: [u64; BINS.div_ceil(64)],
}

#[inline]
fn key(size: u64, ptr: DevicePtr) -> u128 {
    (u128::from(size) << 64) | u128::from(ptr)
}

/// A bin entry as (size, address, span id).
#[inline]
fn entry((key, id): (u128, u32)) -> (u64, DevicePtr, u32) {
    ((key >> 64) as u64, key as u64, id)
}

/// Calls `visit` on bin entries until it breaks; what it broke with.
#[inline]
fn visit_entries<B>(
    entries: impl Iterator<Item = (u128, u32)>,
    visit: &mut impl FnMut(u64, DevicePtr, u32) -> ControlFlow<B>,
) -> Option<B> {
    for found in entries {
        let (size, ptr, id) = entry(found);
        if let ControlFlow::Break(value) = visit(size, ptr, id) {
            return Some(value);
        }
    }
    None
}

/// The bin of a range of `size` bytes; larger sizes never get a smaller bin.
#[inline]
fn bin(size: u64) -> usize {
    if size <= EXACT_MAX {
        return (size.div_ceil(BIN_BYTES) as usize).saturating_sub(1);
    }
    // The doubling (`EXACT_LOG2` or more), then the next bits below the top one.
    let log = 63 - size.leading_zeros();
    let sub =
        (size >> (log - BINS_PER_DOUBLING_LOG2)) as usize & ((1 << BINS_PER_DOUBLING_LOG2) - 1);
    EXACT_BINS + (((log - EXACT_LOG2) as usize) << BINS_PER_DOUBLING_LOG2) + sub
}

impl SizeIndex {
    /// An empty index for `stream`.
    pub(super) fn new(stream: StreamId) -> Self {
        SizeIndex {
            stream,
            bins: (0..BINS).map(|_| Bin::Sorted(Vec::new())).collect(),
            occupied: [0; BINS.div_ceil(64)],
        }
    }

    /// Adds range `[ptr, ptr + size)`, span `id`.
    #[inline]
    pub(super) fn insert(&mut self, size: u64, ptr: DevicePtr, id: u32) {
        debug_assert!(
            size >= BIN_BYTES && size % BIN_BYTES == 0,
            "range size {size}"
        );
        let b = bin(size);
        self.bins[b].insert(key(size, ptr), id);
        self.occupied[b / 64] |= 1 << (b % 64);
    }

    /// Removes range `[ptr, ptr + size)`; returns its span id.
    #[inline]
    pub(super) fn remove(&mut self, size: u64, ptr: DevicePtr) -> Option<u32> {
        let b = bin(size);
        let id = self.bins[b].remove(key(size, ptr));
        if self.bins[b].is_empty() {
            self.occupied[b / 64] &= !(1 << (b % 64));
        }
        id
    }

    /// The span id of range `[ptr, ptr + size)`, if it is here.
    pub(super) fn get(&self, size: u64, ptr: DevicePtr) -> Option<u32> {
        self.bins[bin(size)].get(key(size, ptr))
    }

    /// Calls `visit` with (size, address, span id) on the ranges of at
    /// least `size` bytes, smallest first and lowest address on ties (best
    /// fit), until it breaks; returns what it broke with. A loop over the
    /// bins, not an iterator chain: a `flat_map` over them cost about 60
    /// instructions per range.
    #[inline]
    pub(super) fn walk_best_fit<B>(
        &self,
        size: u64,
        mut visit: impl FnMut(u64, DevicePtr, u32) -> ControlFlow<B>,
    ) -> Option<B> {
        let first = bin(size);
        for b in self.occupied_from(first) {
            // Only the first bin may hold ranges smaller than `size`.
            let from = if b == first { key(size, 0) } else { 0 };
            // Each bin kind walked by its own loop: the enum iterator's match
            // per range cost 1-1.5% more instructions in all.
            let found = match &self.bins[b] {
                Bin::Sorted(entries) => {
                    let at = entries.partition_point(|&(k, _)| k < from);
                    visit_entries(entries[at..].iter().copied(), &mut visit)
                }
                Bin::Tree(tree) => {
                    visit_entries(tree.range(from..).map(|(&k, &id)| (k, id)), &mut visit)
                }
            };
            if found.is_some() {
                return found;
            }
        }
        None
    }

    /// The first range [`SizeIndex::walk_best_fit`] visits, without the
    /// walk: the hot path's usual answer. Later bins hold only larger ranges, and
    /// `size`'s own bin, if it is a bin of one size (up to 1 MiB), only
    /// ranges of `size`: the first entry of the first bin that has one is
    /// the answer, one descent of a small map. Only `size`'s own bin above
    /// 1 MiB is searched from `size`.
    #[inline]
    pub(super) fn first_fit(&self, size: u64) -> Option<(u64, DevicePtr, u32)> {
        let first = bin(size);
        let mut bins = self.occupied_from(first);
        let mut b = bins.next()?;
        if b == first && b >= EXACT_BINS {
            if let Some(found) = self.bins[b].range_from(key(size, 0)).next() {
                return Some(entry(found));
            }
            b = bins.next()?;
        }
        // An occupied bin is not empty.
        self.bins[b].first().map(entry)
    }

    /// Every range, in best-fit order (for snapshots and invariant checks).
    pub(super) fn ranges(&self) -> Vec<(u64, DevicePtr, u32)> {
        let mut ranges = Vec::new();
        self.walk_best_fit(0, |size, ptr, id| {
            ranges.push((size, ptr, id));
            ControlFlow::<()>::Continue(())
        });
        ranges
    }

    /// The last range in best-fit order: the largest, highest address on ties.
    pub(super) fn largest(&self) -> Option<(u64, DevicePtr, u32)> {
        let word = self.occupied.iter().rposition(|&w| w != 0)?;
        let b = word * 64 + 63 - self.occupied[word].leading_zeros() as usize;
        self.bins[b].last().map(entry)
    }

    /// The non-empty bins from `first` up, in order.
    #[inline]
    fn occupied_from(&self, first: usize) -> impl Iterator<Item = usize> + '_ {
        let mut word = first / 64;
        let mut bits = self
            .occupied
            .get(word)
            .map_or(0, |&w| w & (u64::MAX << (first % 64)));
        std::iter::from_fn(move || loop {
            if bits != 0 {
                let b = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                return Some(word * 64 + b);
            }
            word += 1;
            bits = *self.occupied.get(word)?;
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic xorshift generator.
    struct Random(u64);

    impl Random {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    type Reference = BTreeMap<(u64, u64), u32>;

    /// Removes range `(size, ptr)` from both, or adds it to both where the
    /// map lacks it, as span `step`.
    fn mirror(
        index: &mut SizeIndex,
        reference: &mut Reference,
        (size, ptr): (u64, u64),
        remove: bool,
        step: u32,
    ) {
        if remove {
            assert_eq!(index.remove(size, ptr), reference.remove(&(size, ptr)));
        } else if let std::collections::btree_map::Entry::Vacant(slot) =
            reference.entry((size, ptr))
        {
            slot.insert(step);
            index.insert(size, ptr, step);
        }
    }

    /// The first `limit` ranges of the index's best-fit walk for `query`
    /// are the map's from `(query, 0)` on, and `first_fit` is the first.
    fn assert_best_fit(index: &SizeIndex, reference: &Reference, query: u64, limit: usize) {
        let mut ours = Vec::new();
        index.walk_best_fit(query, |s, p, id| {
            ours.push((s, p, id));
            if ours.len() == limit {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        });
        let theirs: Vec<_> = reference
            .range((query, 0)..)
            .take(limit)
            .map(|(&(s, p), &id)| (s, p, id))
            .collect();
        assert_eq!(ours, theirs, "best fit for {query}");
        assert_eq!(index.first_fit(query), theirs.first().copied());
    }

    /// The bins give exactly the order of one map keyed by (size, address),
    /// under random inserts and removes of sizes from 512 bytes to 64 MiB;
    /// `first_fit` is the first of that order.
    #[test]
    fn order_matches_one_map_by_size_then_address() {
        let mut index = SizeIndex::new(StreamId(0));
        let mut reference = Reference::new();
        let mut random = Random(0x5eed);
        for step in 0..20_000u32 {
            // Sizes on both sides of the exact bins, up to 64 MiB.
            let magnitude = 1 << random.below(18);
            let size = BIN_BYTES * (1 + random.below(magnitude));
            let ptr = BIN_BYTES * random.below(512);
            let remove = random.below(3) == 0;
            mirror(&mut index, &mut reference, (size, ptr), remove, step);
            if step % 97 == 0 {
                let magnitude = 1 << random.below(18);
                assert_best_fit(&index, &reference, BIN_BYTES * random.below(magnitude), 40);
                assert_eq!(
                    index.largest(),
                    reference
                        .iter()
                        .next_back()
                        .map(|(&(s, p), &id)| (s, p, id))
                );
                assert_eq!(index.get(size, ptr), reference.get(&(size, ptr)).copied());
            }
        }
        assert_eq!(index.ranges().len(), reference.len());
    }

    /// Bins that outgrow their vector (hundreds of ranges of a few sizes)
    /// and shrink again keep the order of one map.
    #[test]
    fn crowded_bins_keep_the_order() {
        let mut index = SizeIndex::new(StreamId(0));
        let mut reference = Reference::new();
        let mut random = Random(0xb1b);
        let sizes = [512, 4096, 3 << 20, (3 << 20) + 512];
        for step in 0..20_000u32 {
            let size = sizes[random.below(4) as usize];
            let ptr = BIN_BYTES * random.below(4 * BIN_VEC_MAX as u64);
            // Mostly inserts at first, then mostly removes.
            let remove_one_in = if step < 10_000 { 4 } else { 2 };
            let remove = random.below(remove_one_in) == 0;
            mirror(&mut index, &mut reference, (size, ptr), remove, step);
            if step % 101 == 0 {
                assert_best_fit(&index, &reference, sizes[random.below(4) as usize], 300);
                assert_eq!(index.get(size, ptr), reference.get(&(size, ptr)).copied());
            }
        }
        assert!(
            index.bins.iter().any(|bin| matches!(bin, Bin::Tree(_))),
            "some bin outgrew its vector"
        );
        assert_eq!(index.ranges().len(), reference.len());
    }
}

//! One stream's free ranges in best-fit order: by size, then address.
//!
//! The ranges are split into size bins, each an ordered map keyed by (size,
//! address), with a bitmap of the bins that hold any: one bin per 512-byte
//! size up to 1 MiB, then eight per doubling. Why bins: a free or a carve
//! touches a map of a handful of ranges (one B-tree node) instead of one
//! map of every range, several levels deep, whose nodes shift on every
//! insert. Bins partition the sizes in order, so walking them in order
//! gives exactly the order of a single map: placements do not change.

use std::collections::BTreeMap;

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

/// Free ranges of one stream; values are span ids. An empty index is its
/// bin table, about 56 KiB (2,400 empty maps), once per stream.
#[derive(Debug)]
pub(super) struct SizeIndex {
    /// The stream whose ranges these are.
    pub(super) stream: StreamId,
    /// Ranges by bin ([`bin`]), each keyed by size (high 64 bits) and address.
    bins: Vec<BTreeMap<u128, u32>>,
    /// Bit `b` set: bin `b` is not empty.
    occupied: [u64; BINS.div_ceil(64)],
}

#[inline]
fn key(size: u64, ptr: DevicePtr) -> u128 {
    (u128::from(size) << 64) | u128::from(ptr)
}

/// A map entry as (size, address, span id).
#[inline]
fn entry((&key, &id): (&u128, &u32)) -> (u64, DevicePtr, u32) {
    ((key >> 64) as u64, key as u64, id)
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
            bins: (0..BINS).map(|_| BTreeMap::new()).collect(),
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
        let id = self.bins[b].remove(&key(size, ptr));
        if self.bins[b].is_empty() {
            self.occupied[b / 64] &= !(1 << (b % 64));
        }
        id
    }

    /// The span id of range `[ptr, ptr + size)`, if it is here.
    pub(super) fn get(&self, size: u64, ptr: DevicePtr) -> Option<u32> {
        self.bins[bin(size)].get(&key(size, ptr)).copied()
    }

    /// The ranges of at least `size` bytes, smallest first and lowest
    /// address on ties, as (size, address, span id).
    #[inline]
    pub(super) fn best_fit(&self, size: u64) -> impl Iterator<Item = (u64, DevicePtr, u32)> + '_ {
        let first = bin(size);
        self.occupied_from(first)
            .flat_map(move |b| {
                // Only the first bin may hold ranges smaller than `size`.
                let from = if b == first { key(size, 0) } else { 0 };
                self.bins[b].range(from..)
            })
            .map(entry)
    }

    /// The first of [`SizeIndex::best_fit`], without building the iterator:
    /// the hot path's usual answer. Later bins hold only larger ranges, and
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
            if let Some(found) = self.bins[b].range(key(size, 0)..).next() {
                return Some(entry(found));
            }
            b = bins.next()?;
        }
        // An occupied bin is not empty.
        self.bins[b].first_key_value().map(entry)
    }

    /// Every range, in best-fit order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u64, DevicePtr, u32)> + '_ {
        self.best_fit(0)
    }

    /// The last range in best-fit order: the largest, highest address on ties.
    pub(super) fn largest(&self) -> Option<(u64, DevicePtr, u32)> {
        let word = self.occupied.iter().rposition(|&w| w != 0)?;
        let b = word * 64 + 63 - self.occupied[word].leading_zeros() as usize;
        self.bins[b].last_key_value().map(entry)
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

    /// The bins give exactly the order of one map keyed by (size, address),
    /// under random inserts and removes of sizes from 512 bytes to 64 MiB;
    /// `first_fit` is the first of that order.
    #[test]
    fn order_matches_one_map_by_size_then_address() {
        let mut index = SizeIndex::new(StreamId(0));
        let mut reference: BTreeMap<(u64, u64), u32> = BTreeMap::new();
        let mut random = Random(0x5eed);
        for step in 0..20_000u32 {
            // Sizes on both sides of the exact bins, up to 64 MiB.
            let magnitude = 1 << random.below(18);
            let size = BIN_BYTES * (1 + random.below(magnitude));
            let ptr = BIN_BYTES * random.below(512);
            if random.below(3) == 0 {
                assert_eq!(index.remove(size, ptr), reference.remove(&(size, ptr)));
            } else if let std::collections::btree_map::Entry::Vacant(slot) =
                reference.entry((size, ptr))
            {
                slot.insert(step);
                index.insert(size, ptr, step);
            }
            if step % 97 == 0 {
                let magnitude = 1 << random.below(18);
                let query = BIN_BYTES * random.below(magnitude);
                let ours: Vec<_> = index.best_fit(query).take(40).collect();
                let theirs: Vec<_> = reference
                    .range((query, 0)..)
                    .take(40)
                    .map(|(&(s, p), &id)| (s, p, id))
                    .collect();
                assert_eq!(ours, theirs, "best fit for {query} at step {step}");
                assert_eq!(index.first_fit(query), theirs.first().copied());
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
        assert_eq!(index.iter().count(), reference.len());
    }
}

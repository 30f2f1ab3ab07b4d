//! One bit per granule: which granules of a region are mapped, aliased or
//! lent, answered a word at a time.

/// Bits `lo..hi` of a word (`lo < hi <= 64`), without a branch: the hot
/// path tests a block's granules with it.
#[inline]
fn bit_mask(lo: u64, hi: u64) -> u64 {
    (u64::MAX >> (64 - (hi - lo))) << lo
}

/// One bit per granule. It grows with the highest bit ever set (words past
/// its end read as zero): a region spans twice the device, and zeroing a
/// bitmap for all of it on every new region cost more than the rest of the
/// replay on traces with many streams.
#[derive(Debug, Default)]
pub(super) struct Bitmap(Vec<u64>);

impl Bitmap {
    #[inline]
    pub(super) fn word(&self, word: u64) -> u64 {
        self.0.get(word as usize).copied().unwrap_or(0)
    }

    #[inline]
    pub(super) fn get(&self, index: u64) -> bool {
        self.word(index / 64) & (1 << (index % 64)) != 0
    }

    /// Sets or clears bits `[first, first + count)`: the two edge words
    /// masked, whole words between filled (most calls touch one word).
    pub(super) fn set(&mut self, first: u64, count: u64, value: bool) {
        let mut end = first + count;
        if value {
            let words = end.div_ceil(64) as usize;
            if self.0.len() < words {
                self.0.resize(words, 0);
            }
        } else {
            // Clearing past the end: already zero there.
            end = end.min(self.0.len() as u64 * 64);
        }
        if first >= end {
            return;
        }
        let (first_word, last_word) = ((first / 64) as usize, ((end - 1) / 64) as usize);
        let head = u64::MAX << (first % 64);
        let tail = u64::MAX >> (63 - (end - 1) % 64);
        let apply = |word: &mut u64, mask: u64| {
            if value {
                *word |= mask;
            } else {
                *word &= !mask;
            }
        };
        if first_word == last_word {
            apply(&mut self.0[first_word], head & tail);
            return;
        }
        apply(&mut self.0[first_word], head);
        self.0[first_word + 1..last_word].fill(if value { u64::MAX } else { 0 });
        apply(&mut self.0[last_word], tail);
    }

    /// The first index in `[from, limit)` whose bit is `value`, or `limit`
    /// (`from` when `from >= limit`).
    pub(super) fn next_with(&self, from: u64, limit: u64, value: bool) -> u64 {
        if from >= limit {
            return from;
        }
        // Past the last word every bit is clear: no set bit to find there.
        let limit_set = if value {
            limit.min(self.0.len() as u64 * 64)
        } else {
            limit
        };
        let mut i = from;
        while i < limit_set {
            let lo = i % 64;
            let mut word = self.word(i / 64);
            if !value {
                word = !word;
            }
            word &= u64::MAX << lo;
            if word != 0 {
                return (i - lo + u64::from(word.trailing_zeros())).min(limit);
            }
            i = i - lo + 64;
        }
        limit
    }

    /// True when every bit in `[first, end)` is set.
    pub(super) fn all(&self, first: u64, end: u64) -> bool {
        let mut i = first;
        while i < end {
            let word = self.word(i / 64);
            let lo = i % 64;
            let hi = (end - (i - lo)).min(64);
            let mask = bit_mask(lo, hi);
            if word & mask != mask {
                return false;
            }
            i = i - lo + 64;
        }
        true
    }

    /// True when every bit in `[first, end)` is set here and none in `clear`.
    pub(super) fn all_and_none_in(&self, clear: &Bitmap, first: u64, end: u64) -> bool {
        let mut i = first;
        while i < end {
            let lo = i % 64;
            let mask = bit_mask(lo, (end - (i - lo)).min(64));
            let word = i / 64;
            if self.word(word) & mask != mask || clear.word(word) & mask != 0 {
                return false;
            }
            i = i - lo + 64;
        }
        true
    }

    /// The last set bit in `[first, end)`, if any.
    pub(super) fn last_set(&self, first: u64, end: u64) -> Option<u64> {
        let end = end.min(self.0.len() as u64 * 64);
        let mut i = end;
        while i > first {
            let word_start = (i - 1) / 64 * 64;
            let lo = first.max(word_start) - word_start;
            let word = self.word(word_start / 64) & bit_mask(lo, i - word_start);
            if word != 0 {
                return Some(word_start + 63 - u64::from(word.leading_zeros()));
            }
            i = word_start;
        }
        None
    }

    /// True when some bit in `[first, end)` is set.
    #[inline]
    pub(super) fn any(&self, first: u64, end: u64) -> bool {
        self.next_with(first, end, true) < end
    }

    pub(super) fn count_ones(&self) -> u64 {
        self.0.iter().map(|w| u64::from(w.count_ones())).sum()
    }
}

/// One group id per granule (`NONE` where no view lies), growing with the
/// highest granule ever written, like [`Bitmap`]: which alias group's view
/// covers a granule is one read, where a map of views by first granule took
/// a B-tree search on every block placed on, or freed from, aliased memory.
#[derive(Debug, Default)]
pub(super) struct GranuleMap(Vec<u32>);

impl GranuleMap {
    /// The value of a granule no view covers.
    pub(super) const NONE: u32 = u32::MAX;

    /// The group whose view covers `granule`, if any.
    #[inline]
    pub(super) fn get(&self, granule: u64) -> Option<u32> {
        self.0
            .get(granule as usize)
            .copied()
            .filter(|&id| id != Self::NONE)
    }

    /// Records group `id` (or [`GranuleMap::NONE`]) at granules
    /// `[first, first + count)`.
    pub(super) fn set(&mut self, first: u64, count: u64, id: u32) {
        let end = (first + count) as usize;
        if self.0.len() < end {
            if id == Self::NONE {
                // Clearing past the end: already clear there.
                let stop = end.min(self.0.len());
                if (first as usize) < stop {
                    self.0[first as usize..stop].fill(Self::NONE);
                }
                return;
            }
            self.0.resize(end, Self::NONE);
        }
        self.0[first as usize..end].fill(id);
    }

    /// Granules some view covers.
    pub(super) fn count_set(&self) -> u64 {
        self.0.iter().filter(|&&id| id != Self::NONE).count() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::{Bitmap, GranuleMap};

    #[test]
    fn granule_map_grows_and_clears() {
        let mut m = GranuleMap::default();
        assert_eq!(m.get(5), None);
        m.set(3, 4, 9);
        assert_eq!(
            (m.get(2), m.get(3), m.get(6), m.get(7)),
            (None, Some(9), Some(9), None)
        );
        m.set(5, 10, GranuleMap::NONE);
        assert_eq!((m.get(4), m.get(5)), (Some(9), None));
        assert_eq!(m.0.len(), 7, "clearing does not grow the map");
        assert_eq!(m.count_set(), 2);
    }

    #[test]
    fn bitmap_queries() {
        let mut r = Bitmap(vec![0; 4]);
        r.set(60, 80, true);
        assert!(r.all(60, 140));
        assert!(r.all(64, 128));
        assert!(!r.all(59, 140));
        assert!(!r.all(60, 141));
        assert!(r.all(70, 70));
        r.set(100, 1, false);
        assert!(!r.all(64, 128));
        assert!(r.get(99) && !r.get(100));
        assert!(r.any(100, 102) && !r.any(100, 101) && !r.any(0, 60));
        // The bitmap grows on demand; bits past its end are clear.
        r.0.clear();
        assert!(!r.get(150) && !r.all(150, 151) && r.all(150, 150));
        r.set(300, 5, false);
        assert!(r.0.is_empty());
        r.set(130, 5, true);
        assert_eq!(r.0.len(), 3);
        assert_eq!(r.count_ones(), 5);
        assert!(r.all(130, 135) && !r.all(129, 135) && !r.get(199));
        r.set(131, 3, false);
        assert!(r.get(130) && !r.get(131) && !r.get(133) && r.get(134));
        assert_eq!(r.next_with(0, 200, true), 130);
        assert_eq!(r.next_with(130, 200, false), 131);
        assert_eq!(r.next_with(131, 200, true), 134);
        assert_eq!(r.next_with(135, 200, true), 200);
        assert_eq!(r.next_with(0, 100, true), 100);
        assert_eq!(r.next_with(150, 140, false), 150);
        assert_eq!(r.next_with(0, 200, false), 0);
        assert_eq!(r.last_set(0, 200), Some(134));
        assert_eq!(r.last_set(0, 134), Some(130));
        assert_eq!(r.last_set(131, 134), None);
        assert_eq!(r.last_set(0, 130), None);
        assert_eq!(r.last_set(130, 131), Some(130));
        r.set(63, 2, true);
        assert_eq!(r.last_set(0, 64), Some(63));
        assert_eq!(r.last_set(64, 65), Some(64));
        assert_eq!(r.last_set(0, 1 << 20), Some(134));
        // Clearing across the end clears up to it and grows nothing.
        r.set(0, 192, true);
        r.set(150, 100, false);
        assert_eq!(r.0.len(), 3);
        assert!(r.all(0, 150) && !r.any(150, 192));
    }

    /// `all_and_none_in` (the cache hit's one test) agrees with a bit by bit
    /// reading of both bitmaps on every range up to 3 words long, across
    /// word edges and past the bitmaps' ends.
    #[test]
    fn all_and_none_in_matches_bit_by_bit() {
        let mut set = Bitmap::default();
        let mut clear = Bitmap::default();
        set.set(10, 150, true);
        set.set(70, 1, false);
        clear.set(100, 3, true);
        clear.set(190, 2, true);
        for first in 0..200 {
            for end in first..first.max(8) + 192 {
                let expected = (first..end).all(|i| set.get(i) && !clear.get(i));
                assert_eq!(
                    set.all_and_none_in(&clear, first, end),
                    expected,
                    "[{first}, {end})"
                );
            }
        }
    }
}

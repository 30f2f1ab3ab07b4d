//! The hash map the engine keys by device pointers, and its hasher.

/// A hash map keyed by device pointers. Pointers are 512-byte aligned, so
/// the hash mixes the high bits down (std's SipHash is needlessly slow here,
/// and keys come from the allocator, not from an attacker).
pub(crate) type FastMap<K, V> =
    std::collections::HashMap<K, V, std::hash::BuildHasherDefault<PointerHasher>>;

/// The hasher behind [`FastMap`].
#[derive(Default, Clone, Copy)]
pub(crate) struct PointerHasher(u64);

impl std::hash::Hasher for PointerHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n ^ (n >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 32)
    }
}

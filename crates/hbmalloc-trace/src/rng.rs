//! SplitMix64, the what-ifs' seeded randomness: the same seed gives the same
//! trace on every machine. (The engine's `simtest::SplitMix64` is the same
//! generator; this crate must not depend on the engine.)

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// A seeded stream of SplitMix64 outputs.
pub(crate) struct SplitMix(u64);

impl SplitMix {
    pub(crate) fn new(seed: u64) -> Self {
        SplitMix(seed)
    }

    pub(crate) fn next(&mut self) -> u64 {
        let out = hash(self.0);
        self.0 = self.0.wrapping_add(GAMMA);
        out
    }
}

/// SplitMix64's output for state `x`: a well-mixed 64-bit hash of it.
pub(crate) fn hash(x: u64) -> u64 {
    let mut z = x.wrapping_add(GAMMA);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::{hash, SplitMix};

    #[test]
    fn is_splitmix64() {
        // Reference values of SplitMix64 seeded with 0.
        let mut rng = SplitMix::new(0);
        assert_eq!(rng.next(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(rng.next(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(hash(0), 0xE220_A839_7B1D_CDAF);
    }
}

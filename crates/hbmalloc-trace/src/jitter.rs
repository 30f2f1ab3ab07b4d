//! What-if: the same program with slightly different tensor sizes.
//!
//! An allocator tuned on a handful of traces can look better on them than it
//! is: fragmentation depends on exact sizes, and a layout that happens to
//! tile on one trace may leave holes on a model one layer wider.
//! [`jitter_sizes`] keeps a trace's structure (the order of requests, which
//! block each free names, streams, lifetimes) and scales each distinct
//! request size by its own factor within [`JITTER_PERCENT`], the same factor
//! for every request of that size. Replaying a few seeds shows how much a
//! result owes to the exact sizes recorded.

use crate::model::{DeviceTrace, Op};
use crate::rng::hash;

/// Sizes are scaled by a factor in `[1 - p/100, 1 + p/100]`.
pub const JITTER_PERCENT: f64 = 5.0;

/// `device` with every requested size (allocations and recorded
/// out-of-memory requests) scaled by a factor drawn from `seed` and the size
/// itself: equal sizes stay equal, and the same seed gives the same trace.
/// The window-start state is kept as recorded; what the recorded allocator
/// did no longer applies and is dropped.
pub fn jitter_sizes(device: &DeviceTrace, seed: u64) -> DeviceTrace {
    let mut jittered = device.clone();
    for op in &mut jittered.ops {
        match op {
            Op::Alloc { size, .. } | Op::Oom { size, .. } => *size = jittered_size(*size, seed),
            Op::Free { .. }
            | Op::RecordStream { .. }
            | Op::StreamComplete { .. }
            | Op::EmptyCache => {}
        }
    }
    jittered.recorded = None;
    jittered
}

/// `size` scaled by its factor for `seed` (at least 1 byte; 0 stays 0, as
/// PyTorch never allocates for an empty tensor).
fn jittered_size(size: u64, seed: u64) -> u64 {
    if size == 0 {
        return 0;
    }
    // A uniform draw in [0, 1) from the top 53 bits of a mixed hash.
    let unit = (hash(seed ^ hash(size)) >> 11) as f64 / (1u64 << 53) as f64;
    let factor = 1.0 + JITTER_PERCENT / 100.0 * (2.0 * unit - 1.0);
    ((size as f64 * factor).round() as u64).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Recorded;

    fn trace() -> DeviceTrace {
        let alloc = |id, size| Op::Alloc {
            id,
            size,
            stream: 7,
        };
        DeviceTrace {
            ops: vec![
                alloc(0, 4 << 20),
                alloc(1, 512),
                alloc(2, 4 << 20),
                Op::RecordStream { id: 2, stream: 9 },
                Op::Free { id: 0 },
                alloc(3, 0),
                Op::Oom {
                    size: 4 << 20,
                    stream: 7,
                    device_free: 1 << 20,
                },
                Op::Free { id: 2 },
                Op::EmptyCache,
            ],
            recorded: Some(Recorded::default()),
            ..DeviceTrace::default()
        }
    }

    fn sizes(device: &DeviceTrace) -> Vec<u64> {
        device
            .ops
            .iter()
            .filter_map(|op| match op {
                Op::Alloc { size, .. } | Op::Oom { size, .. } => Some(*size),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn equal_sizes_stay_equal_within_the_bound_and_the_rest_is_kept() {
        let original = trace();
        let jittered = jitter_sizes(&original, 1);
        let (before, after) = (sizes(&original), sizes(&jittered));
        assert_eq!(after[0], after[2], "one factor per size");
        assert_eq!(after[0], after[4], "an OOM request is scaled like an alloc");
        assert_eq!(after[3], 0, "an empty tensor stays empty");
        for (b, a) in before.iter().zip(&after) {
            let bound = (*b as f64 * JITTER_PERCENT / 100.0).ceil() as u64;
            assert!(a.abs_diff(*b) <= bound, "{b} -> {a}");
        }
        assert_ne!(before, after, "sizes change");
        // Everything but the sizes is the trace as recorded.
        let shape = |d: &DeviceTrace| {
            d.ops
                .iter()
                .map(|op| match op.clone() {
                    Op::Alloc { id, stream, .. } => Op::Alloc {
                        id,
                        size: 0,
                        stream,
                    },
                    Op::Oom {
                        stream,
                        device_free,
                        ..
                    } => Op::Oom {
                        size: 0,
                        stream,
                        device_free,
                    },
                    other => other,
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(shape(&original), shape(&jittered));
        assert_eq!(
            jittered.recorded, None,
            "the recorded allocator's figures no longer apply"
        );
    }

    #[test]
    fn a_seed_gives_one_trace_and_seeds_differ() {
        let original = trace();
        assert_eq!(jitter_sizes(&original, 3), jitter_sizes(&original, 3));
        let seeds: Vec<Vec<u64>> = (0..8).map(|s| sizes(&jitter_sizes(&original, s))).collect();
        assert!(seeds.windows(2).any(|w| w[0] != w[1]));
    }

    /// For every seed, the extreme ones too: a seed mixed in badly would give
    /// every size of some seed one factor.
    #[test]
    fn factors_spread_over_the_whole_range() {
        for seed in [42, 0, u64::MAX] {
            let (mut low, mut high) = (f64::MAX, f64::MIN);
            for size in (1..2_000u64).map(|i| i * 4096) {
                let factor = jittered_size(size, seed) as f64 / size as f64;
                low = low.min(factor);
                high = high.max(factor);
            }
            assert!(
                (0.95 - 1e-9..0.96).contains(&low),
                "seed {seed}: lowest {low}"
            );
            assert!(
                high > 1.04 && high <= 1.05 + 1e-9,
                "seed {seed}: highest {high}"
            );
        }
        assert_eq!(jittered_size(1, 42), 1, "never below one byte");
    }
}

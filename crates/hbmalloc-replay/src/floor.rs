//! How few times any allocator can get new memory, in the second half of a
//! trace or over all of it, if it is never less efficient than the
//! `efficiency` target allows at any point where the program might have
//! stopped: lower bounds on `steady_state_device_calls` and on simulated
//! driver time that no policy can beat, from the live memory of the trace
//! alone.
//!
//! Why every point: an allocator that decides online behaves on a trace's
//! first `t` operations as on the whole trace, and a program that stopped
//! after them (a shorter run, a held-out trace) is as real as this one. So
//! for the efficiency target to hold on every trace, the memory held after
//! any op `s` may not exceed what the target allows on any prefix that
//! contains `s`: [`ceiling_bytes`] of each later prefix's peak live memory.
//! That bound rises with time, live memory must fit under what is held, and
//! each time live memory passes what is held the allocator must get memory
//! from the driver: at least one call (`cudaMalloc`), or two through the
//! virtual-memory API (`cuMemCreate` and `cuMemMap`; `cuMemSetAccess` is not
//! counted by `steady_state_device_calls`).
//!
//! The allocators bounded hold whole granules, as every allocator on a GPU
//! does (the driver creates and maps physical memory in 2 MiB granules, and
//! PyTorch's segments are multiples of them): what one may hold is the
//! target's ceiling rounded down to granules. A prefix whose live peak is a
//! few granules may have no granule count within the target (3 MiB live
//! needs 4 MiB, 0.75 of it); there the allocator is held to the best whole
//! granules can do, the peak rounded up. A bound that ignored granules would
//! bound allocators that hold 3.16 MiB for 3 MiB live, which no GPU has.
//!
//! The bound ignores everything that only raises the true figure: requests
//! rounded up, fragmentation, memory still pending on other streams, and
//! `empty_cache` (which gives memory back that later must be got again).
//!
//! A snapshot's window begins from a recorded state, and its first op is a
//! place the trace might end too. Policy `pytorch` restores the recorded
//! segments, free cache included, and so may hold from the start more than
//! the target allows (822 MiB held for 500 MiB live on one shared trace),
//! which is how it can make no call where the floor says an
//! allocator that keeps to the target must: the floor speaks of the latter.

/// Peak live memory from which the stricter efficiency floor applies.
const LARGE_HEAP_BYTES: u64 = 1 << 30;
/// The `efficiency` target where peak live memory is at least
/// [`LARGE_HEAP_BYTES`] (as `scripts/targets` checks it).
const LARGE_HEAP_EFFICIENCY: f64 = 0.98;
/// The `efficiency` target everywhere else (as `scripts/targets` checks it).
const SMALL_HEAP_EFFICIENCY: f64 = 0.95;

/// How far `efficiency` may move from `efficiency_at_half` on a long run
/// (as `scripts/targets` checks it).
pub const DRIFT_TOLERANCE: f64 = 0.005;

/// The most memory an allocator may hold on a trace whose live memory
/// peaks at `peak_live_bytes` and still meet the efficiency target there.
fn ceiling_bytes(peak_live_bytes: u64) -> u64 {
    let floor = if peak_live_bytes >= LARGE_HEAP_BYTES {
        LARGE_HEAP_EFFICIENCY
    } else {
        SMALL_HEAP_EFFICIENCY
    };
    (peak_live_bytes as f64 / floor) as u64
}

/// The fewest times an allocator that holds whole `granule`s and meets the
/// efficiency target on every prefix of the trace (where whole granules can)
/// must get new memory while it replays the second half (the ops from
/// `ops / 2` on, where `steady_state_device_calls` counts).
/// `live_after_ops[i]`: live bytes after `i` ops ([`crate::live_bytes_after_ops`]).
///
/// Greedy, and optimal: hold as much as allowed when the second half
/// begins, and each time live memory passes what is held, grow to as much
/// as allowed then. Any allowed schedule holds at most as much at every
/// moment, so it must grow between any two of these growths (and before the
/// first): it grows at least as often.
pub fn steady_state_growth_floor(live_after_ops: &[u64], granule: u64) -> u64 {
    growths_after(
        live_after_ops,
        granule,
        live_after_ops.len().saturating_sub(1) / 2,
    )
}

/// The fewest times an allocator that holds whole `granule`s and meets the
/// efficiency target on every prefix of the trace (where whole granules can)
/// must get new memory over the whole replay. A snapshot's restored state
/// (live memory before the first op) is one growth, holding as much as
/// allowed: a replay gets it from the driver under every policy. Each
/// growth is at least one `cudaMalloc`, or a create, a map and an access
/// grant: [`hbmalloc::LatencyModel::cheapest_growth_ns`] turns this into the
/// least driver time any such allocator spends.
pub fn growth_floor(live_after_ops: &[u64], granule: u64) -> u64 {
    let restored = live_after_ops.first().is_some_and(|&live| live > 0);
    u64::from(restored) + growths_after(live_after_ops, granule, 0)
}

/// Greedy growths after op `from`, holding all that is allowed there.
fn growths_after(live_after_ops: &[u64], granule: u64, from: usize) -> u64 {
    let Some(ops) = live_after_ops.len().checked_sub(1) else {
        return 0;
    };
    let allowed = allowed_after_ops(live_after_ops, granule);
    let mut held = allowed[from];
    let mut growths = 0;
    for t in from + 1..=ops {
        if live_after_ops[t] > held {
            held = allowed[t];
            growths += 1;
        }
    }
    growths
}

/// The most an allocator that holds whole `granule`s may hold after each op
/// and still meet the efficiency target on every prefix that contains the
/// op: the least of the ceilings of the prefixes that end there or later,
/// each rounded down to whole granules. A prefix's own ceiling can fall as
/// it gets longer (crossing [`LARGE_HEAP_BYTES`] tightens the target), which
/// is why later prefixes bound earlier ops. Where the rounded ceiling is
/// less than the prefix's peak live memory rounded up (a heap of a few
/// granules, where no whole-granule allocator meets the target), the bound
/// is that peak: the floor then speaks of allocators that come closest.
fn allowed_after_ops(live_after_ops: &[u64], granule: u64) -> Vec<u64> {
    let granule = granule.max(1);
    let mut peak = 0;
    let mut allowed: Vec<u64> = live_after_ops
        .iter()
        .map(|&live| {
            peak = peak.max(live);
            let ceiling = ceiling_bytes(peak) / granule * granule;
            ceiling.max(peak.div_ceil(granule).saturating_mul(granule))
        })
        .collect();
    for t in (0..allowed.len().saturating_sub(1)).rev() {
        allowed[t] = allowed[t].min(allowed[t + 1]);
    }
    allowed
}

/// Whether an allocator that holds memory in whole `granule`s can meet the
/// efficiency target on the whole trace and keep `efficiency` within
/// [`DRIFT_TOLERANCE`] of `efficiency_at_half`, on a trace whose live
/// memory peaks at `peak_live_at_half` by the middle op and at `peak_live`
/// overall. Both efficiencies are a peak live figure over a whole number of
/// granules, which lie so far apart on a small heap (a granule is 2% of
/// 100 MiB) that no pair may come within the tolerance: then no such
/// allocator meets both targets. The pairs tried: the whole run's peak
/// held `r2` from `peak_live` rounded up to granules to the most the target
/// allows, the first half's `r1` from `peak_live_at_half` rounded up to
/// granules to `r2` (a peak cannot fall). The first half is not held to
/// the efficiency target on its own, so "out of reach" holds even for an
/// allocator that wastes more there.
pub fn drift_within_reach(peak_live_at_half: u64, peak_live: u64, granule: u64) -> bool {
    if peak_live_at_half == 0 || granule == 0 {
        return true;
    }
    let (half, whole) = (peak_live_at_half as f64, peak_live as f64);
    let r1_least = peak_live_at_half.div_ceil(granule).saturating_mul(granule);
    // `r2` is `k` granules, `k` from `peak_live` rounded up to the ceiling.
    let last = ceiling_bytes(peak_live) / granule;
    let mut k = peak_live.div_ceil(granule);
    // Efficiency at half falls as `r1` grows: the `r1` within the tolerance
    // of an `r2`'s efficiency form one interval, up to `high`. (`r2` is
    // within the ceiling, so its efficiency is at least the target, far
    // above the tolerance.)
    let high = |k: u64| {
        let r2 = (k * granule) as f64;
        (half / (whole / r2 - DRIFT_TOLERANCE)).min(r2)
    };
    if k > last {
        return false;
    }
    loop {
        let r2 = (k * granule) as f64;
        let efficiency = whole / r2;
        let low = (half / (efficiency + DRIFT_TOLERANCE)).max(r1_least as f64);
        let r1 = (low / granule as f64).ceil() * granule as f64;
        if r1 <= high(k) {
            return true;
        }
        // `low` (so `r1`) and `high` only grow with `r2`: every `r2` whose
        // `high` is below this `r1` fails too. Skipped by bisection, as a
        // heap of petabytes has billions of granule counts to try.
        if r1 > high(last) {
            return false;
        }
        let (mut below, mut reaches) = (k, last);
        while reaches - below > 1 {
            let mid = below + (reaches - below) / 2;
            if r1 <= high(mid) {
                reaches = mid;
            } else {
                below = mid;
            }
        }
        k = reaches;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;
    /// The device's granule.
    const G: u64 = 2 * MIB;
    /// A byte granule: the ceiling unrounded, for arithmetic in round figures.
    const BYTE: u64 = 1;

    #[test]
    fn a_trace_that_holds_still_needs_no_growth() {
        assert_eq!(steady_state_growth_floor(&[], G), 0);
        assert_eq!(steady_state_growth_floor(&[0], G), 0);
        let flat = [0, 100 * MIB, 50 * MIB, 100 * MIB, 50 * MIB, 100 * MIB, 0];
        assert_eq!(steady_state_growth_floor(&flat, G), 0);
    }

    #[test]
    fn growth_within_what_the_first_half_may_hold_needs_none() {
        // 100 MiB live by the half: up to 105.26 MiB may be held, 104 MiB in
        // whole granules, and the second half peaks at 104 MiB.
        let live = [0, 100 * MIB, 100 * MIB, 104 * MIB, 104 * MIB];
        assert_eq!(steady_state_growth_floor(&live, G), 0);
        // 105 MiB fits under the ceiling but not under any granule count
        // within it.
        let live = [0, 100 * MIB, 100 * MIB, 105 * MIB, 105 * MIB];
        assert_eq!(steady_state_growth_floor(&live, BYTE), 0);
        assert_eq!(steady_state_growth_floor(&live, G), 1);
    }

    #[test]
    fn the_whole_run_counts_the_first_half_too() {
        // Doubling live memory: every op grows, in either half.
        let live = [0, MIB, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB, 32 * MIB];
        assert_eq!(growth_floor(&live, BYTE), 6);
        assert_eq!(steady_state_growth_floor(&live, BYTE), 3);
        // A restored state is one growth, and no more while live stays in it.
        assert_eq!(growth_floor(&[100 * MIB, 50 * MIB, 100 * MIB], G), 1);
        assert_eq!(
            steady_state_growth_floor(&[100 * MIB, 50 * MIB, 100 * MIB], G),
            0
        );
        assert_eq!(growth_floor(&[], G), 0);
    }

    #[test]
    fn a_heap_of_a_few_granules_is_held_to_what_granules_can_do() {
        // 3 MiB live allows 3.16 MiB: no granule count. The best whole
        // granules do is 4 MiB, which holds the next 4 MiB too; an allocator
        // that could hold 3.16 MiB would have to grow for it.
        let live = [0, 3 * MIB, 4 * MIB];
        assert_eq!(growth_floor(&live, G), 1);
        assert_eq!(growth_floor(&live, BYTE), 2);
    }

    #[test]
    fn each_step_past_the_ceiling_is_one_growth() {
        // Live memory doubles at each op of the second half: each rise
        // passes anything the ceiling allowed before it.
        let live = [
            0,
            MIB,
            2 * MIB,
            4 * MIB,
            8 * MIB,
            16 * MIB,
            32 * MIB,
            64 * MIB,
        ];
        // ops = 7, half = 3: ops 4..=7 each grow.
        assert_eq!(steady_state_growth_floor(&live, G), 4);
    }

    #[test]
    fn a_later_stricter_floor_bounds_earlier_ops() {
        // At the half live memory is 1000 MiB (ceiling 1052.6 MiB at 0.95),
        // but the trace then crosses 1 GiB, where 0.98 allows at most
        // 1,044.9 MiB for a peak of 1,024 MiB: holding 1,052 MiB at the half
        // would break that prefix's target, so 1,050 MiB live later needs a
        // growth (a ceiling taken from the half's prefix alone says none).
        let live = [0, 1000 * MIB, 1000 * MIB, 1024 * MIB, 1050 * MIB];
        assert_eq!(ceiling_bytes(1000 * MIB), 1_103_764_210);
        assert_eq!(steady_state_growth_floor(&live, G), 1);
    }

    #[test]
    fn drift_is_out_of_reach_where_no_two_granule_counts_come_close() {
        let g = 2 * MIB;
        // 107.9 MiB by the half, 111 MiB in all: the whole run may hold 112,
        // 114 or 116 MiB (0.95 allows 116.8), whose efficiencies 0.991,
        // 0.974 and 0.957 each need a first-half peak held between two
        // granule counts (108.3-109.4, 110.2-111.4, 112.2-113.3 MiB).
        let (half, whole) = (107.9 * MIB as f64, 111.0 * MIB as f64);
        assert!(!drift_within_reach(half as u64, whole as u64, g));
        // With a finer granule there is a pair, and so there is where live
        // memory does not rise (one count held throughout).
        assert!(drift_within_reach(half as u64, whole as u64, MIB / 4));
        assert!(drift_within_reach(whole as u64, whole as u64, g));
        // A large heap has granule counts close together.
        assert!(drift_within_reach(10_000 * MIB, 10_100 * MIB, g));
        assert!(drift_within_reach(0, MIB, g));
    }

    /// Heaps of petabytes to 2^64 bytes (a hostile trace's, which no device
    /// holds) are answered at once, without overflow: a first half of one
    /// byte cannot be held within the tolerance of any of the billions of
    /// granule counts such a whole run may hold.
    #[test]
    fn drift_on_absurd_heaps_is_answered_at_once() {
        assert!(!drift_within_reach(1, 1 << 60, G));
        assert!(!drift_within_reach(1, u64::MAX, G));
        assert!(drift_within_reach(1 << 62, 1 << 62, G));
        assert!(!drift_within_reach(u64::MAX, u64::MAX, G));
        assert!(drift_within_reach(u64::MAX, u64::MAX, BYTE));
        assert_eq!(steady_state_growth_floor(&[0, 1, u64::MAX], G), 1);
        assert_eq!(growth_floor(&[0, u64::MAX, u64::MAX], G), 1);
    }

    /// Whether some whole run's `r2` granules within the target and first
    /// half's `r1` granules (at least its peak, at most `r2`) give
    /// efficiencies within the tolerance: [`drift_within_reach`]'s question
    /// answered by trying every pair.
    fn some_pair_within_the_tolerance(half: u64, whole: u64, g: u64) -> bool {
        let mut r2 = whole.div_ceil(g) * g;
        while r2 <= ceiling_bytes(whole) {
            let mut r1 = half.div_ceil(g) * g;
            while r1 <= r2 {
                let drift = whole as f64 / r2 as f64 - half as f64 / r1 as f64;
                if drift.abs() <= DRIFT_TOLERANCE {
                    return true;
                }
                r1 += g;
            }
            r2 += g;
        }
        false
    }

    #[test]
    fn drift_reach_is_that_of_every_pair_on_small_heaps() {
        // Every first-half peak from 0.1 to 64 MiB and every rise up to
        // 24 MiB, in tenths of a MiB: heaps of a few granules, where the
        // first half's peak decides which counts it may hold. Off the round
        // figures by a few bytes, where two efficiencies can differ by the
        // tolerance exactly and rounding decides either way.
        for half in (1..=640).map(|tenths| tenths * MIB / 10 + 4_099) {
            for rise in (0..=240).map(|tenths| tenths * MIB / 10 + 1_031) {
                assert_eq!(
                    drift_within_reach(half, half + rise, G),
                    some_pair_within_the_tolerance(half, half + rise, G),
                    "half {half}, rise {rise}"
                );
            }
        }
    }

    /// Live curves: a few dozen ops, each freeing up to 64 MiB or
    /// allocating up to 128 MiB, so that live memory tends to grow, into
    /// new peaks in the second half and across 1 GiB.
    fn live_curves() -> impl Strategy<Value = Vec<u64>> {
        let restored = prop_oneof![Just(0i64), 1i64..256];
        (restored, prop::collection::vec(-64i64..128, 1..40)).prop_map(|(restored, deltas)| {
            let mut live = restored * MIB as i64;
            std::iter::once(live as u64)
                .chain(deltas.into_iter().map(|d| {
                    live = (live + d * MIB as i64).max(0);
                    live as u64
                }))
                .collect()
        })
    }

    proptest! {
        // Fixed seed: the same cases on every run.
        #![proptest_config(ProptestConfig {
            cases: 512,
            rng_seed: prop::test_runner::RngSeed::Fixed(27),
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// The answer is that of trying every pair of granule counts.
        #[test]
        fn drift_reach_is_that_of_every_pair(
            half in MIB..600 * MIB,
            rise in 0u64..60 * MIB,
        ) {
            prop_assert_eq!(
                drift_within_reach(half, half + rise, G),
                some_pair_within_the_tolerance(half, half + rise, G)
            );
        }

        /// No allowed schedule grows less often than the floors say, and one
        /// grows exactly that often. A schedule that holds whole granules, at
        /// least live memory, and never more than some prefix's target allows
        /// (or, where no granule count meets it, that prefix's peak rounded up
        /// to granules) is drawn at random: how much it holds where counting
        /// starts, and how much of the allowed room each growth takes. Its
        /// growths are counted from the half ([`steady_state_growth_floor`])
        /// and from the start ([`growth_floor`]).
        #[test]
        fn no_allowed_schedule_grows_less_often(
            live in live_curves(),
            shares in prop::collection::vec(0.0f64..=1.0, 41),
            whole_granules: bool,
        ) {
            let granule = if whole_granules { G } else { BYTE };
            let ops = live.len() - 1;
            // What a schedule may hold after op t, from the definition: the
            // least over the prefixes that contain t.
            let peaks: Vec<u64> = live.iter().scan(0, |p, &l| { *p = l.max(*p); Some(*p) }).collect();
            let bound = |t: usize| {
                peaks[t..].iter().map(|&peak| {
                    let within = ceiling_bytes(peak) / granule * granule;
                    within.max(peak.div_ceil(granule) * granule)
                }).min().unwrap()
            };
            let room = |t: usize, share: f64, held: u64| {
                let low = live[t].max(held).div_ceil(granule) * granule;
                let spare = (bound(t).saturating_sub(low)) / granule;
                low + (spare as f64 * share) as u64 * granule
            };
            // From the start, a restored state is got from the driver too.
            let growths = |from: usize, restores: bool, share: &dyn Fn(usize) -> f64| {
                let mut held = room(from, share(0), live[from]);
                let mut growths = u64::from(restores && live[from] > 0);
                for (t, &now) in live.iter().enumerate().skip(from + 1) {
                    if now > held {
                        held = room(t, share(t), held);
                        growths += 1;
                    }
                    assert!(held >= now && held <= bound(t) && held % granule == 0);
                }
                growths
            };
            for (from, restores, floor) in [
                (ops / 2, false, steady_state_growth_floor(&live, granule)),
                (0, true, growth_floor(&live, granule)),
            ] {
                prop_assert!(growths(from, restores, &|t| shares[t]) >= floor);
                // And the floor is reached: by the schedule that always
                // takes all the room there is.
                prop_assert_eq!(growths(from, restores, &|_| 1.0), floor);
            }
        }
    }
}

//! Offline planning: the memory a planner that saw the whole trace in advance
//! would hold, as a reference for the online policies.
//!
//! An allocator decides where a block goes when it is asked, knowing nothing
//! of what comes next. A planner that knows every block's size and lifetime
//! up front can lay them out in one arena (STAlloc; the memory planners of
//! TFLite and MLC). Laying them out optimally is NP-hard (dynamic storage
//! allocation), so this is the classic heuristic, *greedy by size*: largest
//! block first, each at the smallest gap that fits among the already placed
//! blocks whose lifetimes overlap its own (the lowest such gap on a tie, the
//! arena's end if none fits).
//!
//! Its arena is a reference, not a bound. A better planner may need less; no
//! online allocator can be sure of doing as well, since it would need to know
//! the future. Lifetimes are the trace's: a block is live from its `Alloc` to
//! its `Free`, as in [`peak_live_bytes`](crate::peak_live_bytes) (a block
//! used on another stream is not held until that stream's work completes),
//! and blocks live at the window start are live from its start. Sizes are
//! rounded up to [`PLAN_BLOCK_ROUND`] bytes, as both policies round requests.
//!
//! [`plan_last_step`] asks the same of a training step: a program repeats
//! its steps, so an allocator that has seen one step knows the next. It
//! plans the blocks a step allocates and frees itself, and leaves the rest
//! (live across the step's boundaries: weights, gradients, optimizer state)
//! to be placed online.

use std::collections::{HashMap, HashSet};

use hbmalloc_trace::{find_last_step, DeviceTrace, InitialBlockState, Op};
use serde::Serialize;

/// Every block is rounded up to a multiple of this, as the `pytorch` and
/// `hbm` policies round every request (PyTorch's `kMinBlockSize`).
pub const PLAN_BLOCK_ROUND: u64 = 512;

/// The outcome of [`plan_greedy_by_size`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// The arena the plan needs: the end of its highest block.
    pub arena_bytes: u64,
    /// The peak of live bytes, rounded as the plan rounds them: no plan
    /// needs less than this.
    pub peak_live_rounded_bytes: u64,
    /// The most granules of the arena that blocks lay on at one time,
    /// in bytes: what the plan holds if the arena's granules are mapped
    /// only while a block lies on them (with the virtual-memory API).
    pub peak_mapped_bytes: u64,
    /// How many blocks were placed.
    pub blocks: usize,
}

/// What an allocator that plans a repeating step from the one before could
/// hold in it ([`plan_last_step`]): the step's own blocks (allocated and
/// freed inside it) in one arena laid out greedy by size, beside the most
/// bytes of the other blocks live at once during the step. It counts those
/// as if they lay without a gap, and the arena as wholly mapped: an
/// estimate of what a step planner could reach, not something replayed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct StepPlan {
    /// Index of the step's first op: of the stretches as long as the last
    /// repeating step (`hbmalloc_trace::find_last_step`) that end in it, the
    /// one that begins where the least memory is live.
    pub first_op: usize,
    /// Ops in the step.
    pub ops: usize,
    /// The most requested bytes live at once during the step.
    pub peak_live_bytes: u64,
    /// The most requested bytes of blocks live across the step's
    /// boundaries that are live at once during it.
    pub outer_peak_bytes: u64,
    /// The arena the step's own blocks take, planned.
    pub arena_bytes: u64,
}

impl StepPlan {
    /// The estimate: `outer_peak_bytes + arena_bytes`.
    pub fn held_bytes(&self) -> u64 {
        self.outer_peak_bytes.saturating_add(self.arena_bytes)
    }
}

/// A block to place: its rounded size and its lifetime `[start, end)`, in
/// states of the trace (0: the window start; `i + 1`: after op `i`).
#[derive(Clone, Copy, Debug)]
struct Lifetime {
    size: u64,
    start: usize,
    end: usize,
}

#[cfg(test)]
impl Lifetime {
    /// Whether the two are alive at some same state (what [`ByLifetime`]
    /// answers for placement).
    fn overlaps(&self, other: &Lifetime) -> bool {
        self.start < other.end && other.start < self.end
    }
}

/// Each block of `trace` with its lifetime, in the order they began.
fn lifetimes(trace: &DeviceTrace) -> Vec<Lifetime> {
    let never_freed = trace.ops.len() + 1;
    let lifetime = |size: u64, start| Lifetime {
        // An absurd size saturates rather than wrapping around.
        size: size
            .max(1)
            .checked_next_multiple_of(PLAN_BLOCK_ROUND)
            .unwrap_or(u64::MAX),
        start,
        end: never_freed,
    };
    let mut blocks = Vec::new();
    // Each live block's index in `blocks`, by its id.
    let mut open = HashMap::new();
    for segment in &trace.initial_segments {
        for block in &segment.blocks {
            if let InitialBlockState::Allocated(id) = block.state {
                open.insert(id, blocks.len());
                blocks.push(lifetime(block.requested_size, 0));
            }
        }
    }
    for (index, op) in trace.ops.iter().enumerate() {
        match *op {
            Op::Alloc { id, size, .. } => {
                open.insert(id, blocks.len());
                blocks.push(lifetime(size, index + 1));
            }
            Op::Free { id } => {
                if let Some(block) = open.remove(&id) {
                    blocks[block].end = index + 1;
                }
            }
            _ => {}
        }
    }
    blocks
}

/// Lays out every block of `trace` greedy by size (see the module's header)
/// and returns the arena that takes, with granules of the simulated
/// device's size (the one every replay runs on).
pub fn plan_greedy_by_size(trace: &DeviceTrace) -> Plan {
    plan_with_granule(trace, crate::metrics::device_granule())
}

fn plan_with_granule(trace: &DeviceTrace, granule: u64) -> Plan {
    let blocks = lifetimes(trace);
    let offsets = place(&blocks);
    let (peak_live_rounded_bytes, peak_mapped_bytes) = peaks(&blocks, &offsets, granule);
    Plan {
        arena_bytes: arena_bytes(&blocks, &offsets),
        peak_live_rounded_bytes,
        peak_mapped_bytes,
        blocks: blocks.len(),
    }
}

/// The end of the highest block, each at its offset.
fn arena_bytes(blocks: &[Lifetime], offsets: &[u64]) -> u64 {
    blocks
        .iter()
        .zip(offsets)
        .map(|(block, offset)| offset.saturating_add(block.size))
        .max()
        .unwrap_or(0)
}

/// Plans the last repeating step of `trace` (see [`StepPlan`]); `None` when
/// no stretch of its ops repeats.
pub fn plan_last_step(trace: &DeviceTrace) -> Option<StepPlan> {
    let step = find_last_step(&trace.ops)?;
    let all_live = crate::live_bytes_after_ops(trace);
    // The step repeats the one before it, so any stretch of its length
    // ending in it is a step too: begin where least memory is live, where
    // an iteration begins (fewest blocks cross the boundary).
    let first_op = (step.start.saturating_sub(step.len - 1)..=step.start)
        .rev()
        .min_by_key(|&op| all_live[op])
        .unwrap_or(step.start);
    let ops = &trace.ops[first_op..first_op + step.len];
    // The step's own blocks: allocated and freed inside it.
    let mut allocated_inside = HashSet::new();
    let mut own = HashSet::new();
    for op in ops {
        match *op {
            Op::Alloc { id, .. } => {
                allocated_inside.insert(id);
            }
            Op::Free { id } if allocated_inside.contains(&id) => {
                own.insert(id);
            }
            _ => {}
        }
    }
    let is_own =
        |op: &Op| matches!(*op, Op::Alloc { id, .. } | Op::Free { id } if own.contains(&id));
    let own_trace = DeviceTrace {
        ops: ops.iter().filter(|op| is_own(op)).cloned().collect(),
        ..Default::default()
    };
    let own_live = crate::live_bytes_after_ops(&own_trace);
    let (mut own_ops, mut peak_live_bytes, mut outer_peak_bytes) = (0, 0, 0);
    for (index, op) in ops.iter().enumerate() {
        own_ops += usize::from(is_own(op));
        let live = all_live[first_op + index + 1];
        peak_live_bytes = peak_live_bytes.max(live);
        outer_peak_bytes = outer_peak_bytes.max(live.saturating_sub(own_live[own_ops]));
    }
    Some(StepPlan {
        first_op,
        ops: step.len,
        peak_live_bytes,
        outer_peak_bytes,
        arena_bytes: {
            let own_blocks = lifetimes(&own_trace);
            arena_bytes(&own_blocks, &place(&own_blocks))
        },
    })
}

/// Each block's offset in the arena, greedy by size.
fn place(blocks: &[Lifetime]) -> Vec<u64> {
    let mut order: Vec<usize> = (0..blocks.len()).collect();
    // Largest first; among equal sizes, the one that began first.
    order.sort_by_key(|&i| (std::cmp::Reverse(blocks[i].size), blocks[i].start));
    let mut offsets = vec![0; blocks.len()];
    let states = blocks.iter().map(|b| b.end).max().unwrap_or(0);
    let mut placed = ByLifetime::new(states);
    let mut alive: Vec<usize> = Vec::new();
    for &index in &order {
        let block = &blocks[index];
        // The placed blocks alive with this one, lowest first: one pass
        // over them finds the gaps.
        placed.alive_with(block, &mut alive);
        alive.sort_unstable_by_key(|&other| offsets[other]);
        let mut covered_to = 0u64;
        let mut best: Option<(u64, u64)> = None; // (gap, offset)
        for &other in &alive {
            let offset = offsets[other];
            if offset > covered_to {
                let gap = offset - covered_to;
                if gap >= block.size && best.is_none_or(|(best_gap, _)| gap < best_gap) {
                    best = Some((gap, covered_to));
                }
            }
            covered_to = covered_to.max(offset.saturating_add(blocks[other].size));
        }
        offsets[index] = best.map_or(covered_to, |(_, offset)| offset);
        placed.insert(index, block);
    }
    offsets
}

/// Placed blocks by lifetime, so that those alive with a new block are found
/// without a pass over every block placed (a quadratic plan takes seconds
/// on a long trace). A block alive with `[start, end)` either
/// is alive at `start` (a stabbing query of a segment tree over the states,
/// each block kept in the tree's nodes its lifetime covers) or begins after
/// `start` and before `end` (an ordered map by start).
struct ByLifetime {
    /// Leaves: a power of two at least the number of states.
    leaves: usize,
    /// The segment tree, node `n` with children `2n` and `2n + 1`.
    nodes: Vec<Vec<usize>>,
    by_start: std::collections::BTreeMap<usize, Vec<usize>>,
}

impl ByLifetime {
    fn new(states: usize) -> Self {
        let leaves = states.max(1).next_power_of_two();
        ByLifetime {
            leaves,
            nodes: vec![Vec::new(); 2 * leaves],
            by_start: Default::default(),
        }
    }

    fn insert(&mut self, index: usize, block: &Lifetime) {
        let (mut lo, mut hi) = (block.start + self.leaves, block.end + self.leaves);
        while lo < hi {
            if lo & 1 == 1 {
                self.nodes[lo].push(index);
                lo += 1;
            }
            if hi & 1 == 1 {
                hi -= 1;
                self.nodes[hi].push(index);
            }
            lo /= 2;
            hi /= 2;
        }
        self.by_start.entry(block.start).or_default().push(index);
    }

    /// Fills `out` with the blocks alive at some state of `block`'s lifetime.
    fn alive_with(&self, block: &Lifetime, out: &mut Vec<usize>) {
        out.clear();
        let mut node = block.start + self.leaves;
        while node >= 1 {
            out.extend_from_slice(&self.nodes[node]);
            node /= 2;
        }
        for started in self
            .by_start
            .range(block.start + 1..block.end)
            .map(|(_, b)| b)
        {
            out.extend_from_slice(started);
        }
    }
}

/// The most rounded bytes live at once, and the most granules (of
/// `granule` bytes) that blocks lie on at once, in bytes, with each block at
/// its offset: one sweep over the blocks' starts and ends. Blocks alive
/// together never overlap, so a granule a block covers whole is its own:
/// only the partly covered granules at a block's two ends are counted by who
/// uses them, and the work is a few steps a block however large it is.
fn peaks(blocks: &[Lifetime], offsets: &[u64], granule: u64) -> (u64, u64) {
    let mut changes: Vec<(usize, bool, usize)> = Vec::with_capacity(blocks.len() * 2);
    for (index, b) in blocks.iter().enumerate() {
        changes.push((b.start, true, index));
        changes.push((b.end, false, index));
    }
    // Frees before allocations at the same state: a block freed by op i is
    // gone in the state after it.
    changes.sort_unstable();
    let (mut live, mut peak_live) = (0u64, 0u64);
    let mut whole_granules: u64 = 0;
    // Blocks on each partly covered granule in use, by granule index.
    let mut edge_users: HashMap<u64, u32> = HashMap::new();
    let mut peak_granules = 0;
    for (_, begins, index) in changes {
        let size = blocks[index].size;
        let start = offsets[index];
        let end = start.saturating_add(size);
        let whole = (end / granule).saturating_sub(start.div_ceil(granule));
        // The granules it covers in part. One inside a single granule names
        // it twice and adds two users to it, as its free takes two away.
        let edges = [start, end].map(|at| (at % granule != 0).then_some(at / granule));
        if begins {
            live = live.saturating_add(size);
            whole_granules += whole;
            for g in edges.into_iter().flatten() {
                *edge_users.entry(g).or_default() += 1;
            }
        } else {
            live = live.saturating_sub(size);
            whole_granules -= whole;
            for g in edges.into_iter().flatten() {
                if let Some(count) = edge_users.get_mut(&g) {
                    *count -= 1;
                    if *count == 0 {
                        edge_users.remove(&g);
                    }
                }
            }
        }
        peak_live = peak_live.max(live);
        peak_granules = peak_granules.max(whole_granules.saturating_add(edge_users.len() as u64));
    }
    (peak_live, peak_granules.saturating_mul(granule))
}

#[cfg(test)]
mod tests {
    use super::*;
    use hbmalloc_trace::{InitialBlock, InitialSegment};

    const K: u64 = 1024;
    /// A small granule, so that tests of a few KiB see granules.
    const G: u64 = 4 * K;

    fn alloc(id: u64, size: u64) -> Op {
        Op::Alloc {
            id,
            size,
            stream: 0,
        }
    }

    fn free(id: u64) -> Op {
        Op::Free { id }
    }

    fn trace(ops: Vec<Op>) -> DeviceTrace {
        DeviceTrace {
            ops,
            ..Default::default()
        }
    }

    /// A deterministic pseudo-random program (xorshift, fixed seed): up to
    /// `blocks` allocations of 1 B to `max_size`, about half freed at random.
    fn random_program(seed: u64, blocks: u64, max_size: u64) -> DeviceTrace {
        let mut state = seed;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut ops = Vec::new();
        let mut live: Vec<u64> = Vec::new();
        for id in 0..blocks {
            if !live.is_empty() && next() % 2 == 0 {
                let victim = live.swap_remove((next() % live.len() as u64) as usize);
                ops.push(free(victim));
            }
            ops.push(alloc(id, 1 + next() % max_size));
            live.push(id);
        }
        trace(ops)
    }

    #[test]
    fn blocks_that_never_live_together_share_memory() {
        let plan = plan_with_granule(
            &trace(vec![alloc(1, 4 * K), free(1), alloc(2, 4 * K), free(2)]),
            G,
        );
        assert_eq!(plan.arena_bytes, 4 * K);
        assert_eq!(plan.peak_live_rounded_bytes, 4 * K);
        assert_eq!(plan.peak_mapped_bytes, G);
        assert_eq!(plan.blocks, 2);
    }

    #[test]
    fn knowing_the_future_avoids_the_hole_an_online_allocator_leaves() {
        // Online, X goes at 0 and Y above it; X's 1 KiB hole cannot take Z
        // (2 KiB), so Z goes on top: 5 KiB for 4 KiB live. The plan places
        // Y and Z (the larger blocks) first, side by side, and X above Y,
        // where Z never is while X lives: 4 KiB.
        let plan = plan_with_granule(
            &trace(vec![
                alloc(1, K),     // X
                alloc(2, 2 * K), // Y
                free(1),
                alloc(3, 2 * K), // Z: Y and Z live (4 KiB)
            ]),
            G,
        );
        assert_eq!(plan.peak_live_rounded_bytes, 4 * K);
        assert_eq!(plan.arena_bytes, 4 * K);
    }

    #[test]
    fn sizes_round_up_and_blocks_live_at_the_window_start_count_from_it() {
        let mut t = trace(vec![alloc(2, 100), free(7)]);
        t.initial_segments.push(InitialSegment {
            address: 0,
            stream: 0,
            small_pool: false,
            expandable: false,
            blocks: vec![
                InitialBlock {
                    size: 2 * K,
                    requested_size: 1000,
                    state: InitialBlockState::Allocated(7),
                },
                InitialBlock {
                    size: 2 * K,
                    requested_size: 0,
                    state: InitialBlockState::Free,
                },
            ],
        });
        let plan = plan_with_granule(&t, G);
        // 1000 -> 1024 and 100 -> 512, alive together after the first op.
        assert_eq!(plan.peak_live_rounded_bytes, K + 512);
        assert_eq!(plan.arena_bytes, K + 512);
        assert_eq!(plan.blocks, 2);
    }

    #[test]
    fn no_two_blocks_alive_together_overlap_in_the_arena() {
        for seed in [1, 2, 3] {
            let t = random_program(0x9e37_79b9_7f4a_7c15 ^ seed, 1_000, 64 * K);
            let blocks = lifetimes(&t);
            let offsets = place(&blocks);
            for (i, a) in blocks.iter().enumerate() {
                for (j, b) in blocks.iter().enumerate().skip(i + 1) {
                    let apart =
                        offsets[i] + a.size <= offsets[j] || offsets[j] + b.size <= offsets[i];
                    assert!(
                        !a.overlaps(b) || apart,
                        "seed {seed}: blocks {i} and {j} live together and overlap"
                    );
                }
            }
        }
    }

    /// [`place`]'s rule by its definition, in quadratic time: largest block
    /// first (earliest on ties), each in the smallest gap between the placed
    /// blocks it lives with that holds it (the lowest such gap on ties),
    /// else above them all.
    fn place_by_definition(blocks: &[Lifetime]) -> Vec<u64> {
        let mut order: Vec<usize> = (0..blocks.len()).collect();
        order.sort_by_key(|&i| (std::cmp::Reverse(blocks[i].size), blocks[i].start));
        let mut offsets: Vec<Option<u64>> = vec![None; blocks.len()];
        for &i in &order {
            let mut taken: Vec<(u64, u64)> = (0..blocks.len())
                .filter_map(|j| {
                    let offset = offsets[j]?;
                    blocks[i]
                        .overlaps(&blocks[j])
                        .then(|| (offset, offset + blocks[j].size))
                })
                .collect();
            taken.sort_unstable();
            let (mut top, mut best) = (0, None::<(u64, u64)>);
            for &(lo, hi) in &taken {
                let gap = lo.saturating_sub(top);
                if gap >= blocks[i].size && best.is_none_or(|(size, _)| gap < size) {
                    best = Some((gap, top));
                }
                top = top.max(hi);
            }
            offsets[i] = Some(best.map_or(top, |(_, at)| at));
        }
        offsets.into_iter().map(Option::unwrap).collect()
    }

    #[test]
    fn placement_is_greedy_by_size_into_the_smallest_gap() {
        for seed in [7, 8, 9] {
            // Up to 8 KiB, rounded: 16 sizes, so that ties in size and in
            // gap are common.
            let blocks = lifetimes(&random_program(0x9e37_79b9_7f4a_7c15 ^ seed, 600, 8 * K));
            let sizes: std::collections::BTreeSet<u64> = blocks.iter().map(|b| b.size).collect();
            assert!(sizes.len() > 8, "{sizes:?}");
            assert_eq!(place(&blocks), place_by_definition(&blocks), "seed {seed}");
        }
    }

    #[test]
    fn the_plan_holds_no_less_than_live_memory_and_maps_no_more_than_its_arena() {
        let plan = plan_with_granule(&random_program(0x9e37_79b9_7f4a_7c15, 2_000, 64 * K), G);
        assert!(plan.arena_bytes >= plan.peak_live_rounded_bytes, "{plan:?}");
        assert!(
            plan.peak_mapped_bytes >= plan.peak_live_rounded_bytes,
            "{plan:?}"
        );
        assert!(
            plan.peak_mapped_bytes <= plan.arena_bytes.div_ceil(G) * G,
            "{plan:?}"
        );
        // Greedy by size lands near the peak on such a program.
        assert!(
            (plan.arena_bytes as f64) < 1.25 * plan.peak_live_rounded_bytes as f64,
            "{plan:?}"
        );
    }

    #[test]
    fn peak_mapped_granules_match_a_count_granule_by_granule() {
        for seed in [4, 5, 6] {
            let t = random_program(0x2545_f491_4f6c_dd1d ^ seed, 600, 24 * K);
            let blocks = lifetimes(&t);
            let offsets = place(&blocks);
            // Every state, every granule: is some live block on it?
            let states = t.ops.len() + 2;
            let granules = blocks
                .iter()
                .zip(&offsets)
                .map(|(b, o)| (o + b.size).div_ceil(G))
                .max()
                .unwrap_or(0);
            let mut brute = 0;
            for state in 0..states {
                let mut used = vec![false; granules as usize];
                for (b, o) in blocks.iter().zip(&offsets) {
                    if b.start <= state && state < b.end {
                        for g in o / G..(o + b.size).div_ceil(G) {
                            used[g as usize] = true;
                        }
                    }
                }
                brute = brute.max(used.iter().filter(|&&u| u).count() as u64 * G);
            }
            assert_eq!(peaks(&blocks, &offsets, G).1, brute, "seed {seed}");
        }
    }

    #[test]
    fn a_block_maps_every_granule_it_touches_and_shares_its_edges() {
        // Each block as (offset, size, start, end): bytes, then states.
        let h = G / 2;
        let peak = |layout: &[(u64, u64, usize, usize)]| {
            let blocks: Vec<Lifetime> = layout
                .iter()
                .map(|&(_, size, start, end)| Lifetime { size, start, end })
                .collect();
            let offsets: Vec<u64> = layout.iter().map(|&(offset, ..)| offset).collect();
            peaks(&blocks, &offsets, G).1 / G
        };
        assert_eq!(peak(&[(0, G, 0, 1)]), 1, "one whole granule");
        assert_eq!(peak(&[(0, 3 * h, 0, 1)]), 2, "its end in the next granule");
        assert_eq!(peak(&[(h, h / 2, 0, 1)]), 1, "inside one granule");
        assert_eq!(peak(&[(h, 4 * h, 0, 1)]), 3, "both ends in part");
        // Two blocks on one granule count it once, and it stays mapped
        // while either lies on it.
        assert_eq!(peak(&[(0, 3 * h, 0, 2), (3 * h, 3 * h, 1, 3)]), 3);
        assert_eq!(peak(&[(0, 3 * h, 0, 1), (3 * h, 3 * h, 1, 2)]), 2);
    }

    #[test]
    fn an_absurd_size_saturates_instead_of_overflowing() {
        let plan = plan_with_granule(
            &trace(vec![
                alloc(1, u64::MAX),
                alloc(2, u64::MAX - 3),
                alloc(3, 0),
            ]),
            G,
        );
        assert_eq!(plan.arena_bytes, u64::MAX);
        assert_eq!(plan.blocks, 3);
    }

    #[test]
    fn a_step_plan_lays_out_the_blocks_the_step_frees_itself_beside_the_rest() {
        // W lives throughout. Each step: X (1 KiB), Y (2 KiB), X freed, Z (2
        // KiB), then G (4 KiB, kept to the next step, which frees it), Y
        // and Z freed. Own blocks X, Y, Z plan into 4 KiB (Y and Z side by
        // side, X above Y); W and G are outer, 16 + 4 KiB at most.
        let mut ops = vec![alloc(0, 16 * K)];
        let mut id = 1;
        let mut kept: Option<u64> = None;
        for _ in 0..4 {
            let (x, y, z, g) = (id, id + 1, id + 2, id + 3);
            id += 4;
            ops.extend([alloc(x, K), alloc(y, 2 * K), free(x), alloc(z, 2 * K)]);
            ops.push(alloc(g, 4 * K));
            if let Some(previous) = kept.replace(g) {
                ops.push(free(previous));
            }
            ops.extend([free(y), free(z)]);
            // Padding, so that a step is long enough to count as one.
            for _ in 0..5 {
                ops.extend([alloc(id, 512), free(id)]);
                id += 1;
            }
        }
        let plan = plan_last_step(&trace(ops)).expect("the steps repeat");
        assert_eq!(plan.ops, 18);
        assert_eq!(plan.arena_bytes, 4 * K);
        assert_eq!(plan.outer_peak_bytes, 16 * K + 4 * K + 4 * K);
        assert_eq!(plan.held_bytes(), 28 * K);
        // Live in the step: W, the previous G, Y and Z, then the new G.
        assert_eq!(plan.peak_live_bytes, 16 * K + 4 * K + 4 * K + 4 * K);
        assert_eq!(plan_last_step(&trace(vec![alloc(1, K), free(1)])), None);
    }

    #[test]
    fn a_step_plan_begins_where_least_is_live_and_pairs_each_state_with_its_op() {
        // W lives throughout. Each step: A (8 KiB, freed inside it), K (1
        // KiB, kept for good, so each step begins with 1 KiB more live), A
        // freed, then padding. The step before the last begins with less
        // live memory, but a stretch beginning there does not end in the
        // last step: the plan begins at the last step itself.
        let mut ops = vec![alloc(0, 16 * K)];
        let mut id = 1;
        for _ in 0..4 {
            ops.extend([alloc(id, 8 * K), alloc(id + 1, K), free(id)]);
            id += 2;
            for _ in 0..7 {
                ops.extend([alloc(id, 512), free(id)]);
                id += 1;
            }
        }
        let plan = plan_last_step(&trace(ops)).expect("the steps repeat");
        assert_eq!((plan.first_op, plan.ops), (1 + 3 * 17, 17));
        // After the last step's A and K: W, four K and A.
        assert_eq!(plan.peak_live_bytes, 16 * K + 4 * K + 8 * K);
        // Paired with the state after each op, A never counts as outer.
        assert_eq!(plan.outer_peak_bytes, 16 * K + 4 * K);
        assert_eq!(plan.arena_bytes, 8 * K);
    }
}

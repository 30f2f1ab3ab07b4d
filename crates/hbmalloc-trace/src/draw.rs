//! What-if: a long run built from a trace's own steps, drawn at random.
//!
//! A variable-length training run never repeats a step exactly, so a longer
//! run cannot be made by repeating one (`repeat.rs`). It can be made by
//! drawing the recorded steps again in a random order, as a data loader
//! would draw batches of other lengths: each step keeps its own ops, and the
//! blocks that live across steps are handed from one drawn step to the next:
//! weights and optimizer state by size, and what one step makes for the next
//! to free (a batch's inputs, kept until the next batch replaces them, whose
//! length varies) by age. That needs the trace's step marks
//! ([`DeviceTrace::step_starts`]) and steps that end with as many blocks
//! alive as they began with (a training loop past its first step).

use std::collections::{BTreeMap, HashMap};

use crate::model::{AllocId, DeviceTrace, InitialBlockState, Op};
use crate::repeat::{scale_by_ops, MAX_ADDED_OPS};
use crate::rng::SplitMix;

/// The trace's ops up to its first steady step, then `steps` steps drawn
/// uniformly (with replacement, from `seed`) from its steady steps: those
/// that begin and end with as many blocks alive as the first steady step
/// begins with. Each drawn step's ops are its recorded ones with fresh ids
/// for what it allocates; what it uses from before it is matched to what is
/// alive when it begins ([`hand_on`]). Returns the run and how many of the
/// recorded steps it drew from: a trace with one steady step repeats it.
pub fn draw_steps(
    trace: &DeviceTrace,
    steps: usize,
    seed: u64,
) -> Result<(DeviceTrace, usize), String> {
    let bounds = step_bounds(trace)?;
    let alive = alive_at(trace, &bounds);
    let steady: Vec<usize> = (0..bounds.len() - 1)
        .filter(|&i| alive[i].len() == alive[i + 1].len())
        .collect();
    let Some(&first) = steady.first() else {
        return Err(
            "no step ends with as many blocks alive as it began with (no steady step)".into(),
        );
    };
    let steady: Vec<usize> = steady
        .into_iter()
        .filter(|&i| alive[i].len() == alive[first].len())
        .collect();

    // Refused before drawing by the longest step, so that an absurd count is
    // an error rather than an allocation that fails.
    let longest = steady
        .iter()
        .map(|&i| bounds[i + 1] - bounds[i])
        .max()
        .unwrap_or(0);
    if longest
        .checked_mul(steps)
        .is_none_or(|ops| ops > MAX_ADDED_OPS)
    {
        return Err(format!(
            "{steps} steps of up to {longest} operations may be more than {MAX_ADDED_OPS} \
             operations"
        ));
    }
    let prefix_end = bounds[first];
    let mut out = Builder::new(trace, prefix_end, &alive[first]);
    let mut rng = SplitMix::new(seed);
    for _ in 0..steps {
        let i = steady[(rng.next() % steady.len() as u64) as usize];
        out.append_step(trace, &alive[i], bounds[i], bounds[i + 1])?;
    }
    let ops = out.ops;
    let recorded_span_us = trace
        .recorded_span_us
        .map(|us| scale_by_ops(us, trace.ops.len(), ops.len()));
    let drawn = DeviceTrace {
        ops,
        recorded: None,
        recorded_span_us,
        step_starts: out.step_starts,
        ..trace.clone()
    };
    Ok((drawn, steady.len()))
}

/// The ops where each step begins, and the end of the last one: the trace's
/// step marks, closed by the end of its ops.
fn step_bounds(trace: &DeviceTrace) -> Result<Vec<usize>, String> {
    if trace.step_starts.len() < 2 {
        return Err(format!(
            "the trace marks {} step(s); drawing steps needs at least 2 \
             (torch.profiler's ProfilerStep#N marks, or a memory snapshot's optimizer steps)",
            trace.step_starts.len()
        ));
    }
    let mut bounds = trace.step_starts.clone();
    if bounds.windows(2).any(|w| w[0] >= w[1]) || bounds.last() > Some(&trace.ops.len()) {
        return Err("the trace's step marks are not ascending op indices".into());
    }
    if bounds.last() != Some(&trace.ops.len()) {
        bounds.push(trace.ops.len());
    }
    Ok(bounds)
}

/// A block alive at some moment: (size, op index of its allocation, id).
/// Sorted, a moment's blocks read by size, then oldest first.
type Alive = (u64, usize, AllocId);

/// The blocks alive at each of `bounds`, sorted.
fn alive_at(trace: &DeviceTrace, bounds: &[usize]) -> Vec<Vec<Alive>> {
    let mut live: BTreeMap<AllocId, (u64, usize)> = initial_live(trace)
        .into_iter()
        .map(|(id, size)| (id, (size, 0)))
        .collect();
    let mut out = Vec::with_capacity(bounds.len());
    for (at, op) in trace.ops.iter().enumerate() {
        if bounds.get(out.len()) == Some(&at) {
            out.push(sorted(&live));
        }
        match *op {
            Op::Alloc { id, size, .. } => {
                live.insert(id, (size, at));
            }
            Op::Free { id } => {
                live.remove(&id);
            }
            _ => {}
        }
    }
    // The last bound is the end of the ops.
    out.resize_with(bounds.len(), || sorted(&live));
    out
}

fn sorted(live: &BTreeMap<AllocId, (u64, usize)>) -> Vec<Alive> {
    let mut blocks: Vec<Alive> = live
        .iter()
        .map(|(&id, &(size, at))| (size, at, id))
        .collect();
    blocks.sort_unstable();
    blocks
}

fn initial_live(trace: &DeviceTrace) -> BTreeMap<AllocId, u64> {
    let mut live = BTreeMap::new();
    for block in trace.initial_segments.iter().flat_map(|s| &s.blocks) {
        if let InitialBlockState::Allocated(id) = block.state {
            live.insert(id, block.requested_size);
        }
    }
    live
}

/// The ops of the run being built, and what is alive in it.
struct Builder {
    ops: Vec<Op>,
    step_starts: Vec<usize>,
    /// Alive now: id → (size, op index of its allocation; initial blocks
    /// count as allocated before op 0, in id order).
    live: BTreeMap<AllocId, (u64, usize)>,
    next_id: AllocId,
}

impl Builder {
    /// The run up to `prefix_end`, as recorded; `alive` is what is alive
    /// there ([`alive_at`]).
    fn new(trace: &DeviceTrace, prefix_end: usize, alive: &[Alive]) -> Self {
        let live = alive
            .iter()
            .map(|&(size, at, id)| (id, (size, at)))
            .collect();
        let ops = trace.ops[..prefix_end].to_vec();
        let initial_max = trace
            .initial_segments
            .iter()
            .flat_map(|s| &s.blocks)
            .filter_map(|b| match b.state {
                InitialBlockState::Allocated(id) => Some(id),
                InitialBlockState::Free => None,
            })
            .max();
        let ops_max = trace.ops.iter().filter_map(|op| match *op {
            Op::Alloc { id, .. } => Some(id),
            _ => None,
        });
        let next_id = ops_max.chain(initial_max).max().map_or(0, |id| id + 1);
        Builder {
            step_starts: trace
                .step_starts
                .iter()
                .copied()
                .filter(|&s| s < prefix_end)
                .collect(),
            ops,
            live,
            next_id,
        }
    }

    /// Appends the recorded step `[start, end)`, which found `theirs` alive,
    /// its blocks from before it matched to the blocks alive now.
    fn append_step(
        &mut self,
        trace: &DeviceTrace,
        theirs: &[Alive],
        start: usize,
        end: usize,
    ) -> Result<(), String> {
        let ours = sorted(&self.live);
        if theirs.len() != ours.len() {
            return Err(format!(
                "the step at op {start} begins with {} blocks alive, the run it joins with {}",
                theirs.len(),
                ours.len()
            ));
        }
        let mut rename = hand_on(theirs, &ours);
        self.step_starts.push(self.ops.len());
        for op in &trace.ops[start..end] {
            let renamed = |id: AllocId| -> Result<AllocId, String> {
                rename
                    .get(&id)
                    .copied()
                    .ok_or_else(|| format!("the step at op {start} uses block {id} it never made"))
            };
            let op = match *op {
                Op::Alloc { id, size, stream } => {
                    let fresh = self.next_id;
                    self.next_id += 1;
                    rename.insert(id, fresh);
                    self.live.insert(fresh, (size, self.ops.len()));
                    Op::Alloc {
                        id: fresh,
                        size,
                        stream,
                    }
                }
                Op::Free { id } => {
                    let id = renamed(id)?;
                    self.live.remove(&id);
                    Op::Free { id }
                }
                Op::RecordStream { id, stream } => Op::RecordStream {
                    id: renamed(id)?,
                    stream,
                },
                ref other => other.clone(),
            };
            self.ops.push(op);
        }
        Ok(())
    }
}

/// What a drawn step found alive when it was recorded (`theirs`), matched to
/// what is alive where it is drawn (`ours`, as many), as (their id, our id).
/// Blocks of the same size are matched first, oldest to oldest: the weights
/// and optimizer state every step finds. What is left on each side was made
/// by the step before for this one to free, and differs in size from step to
/// step (a batch's inputs): matched by age. Both sorted ([`sorted`]).
fn hand_on(theirs: &[Alive], ours: &[Alive]) -> HashMap<AllocId, AllocId> {
    let mut pairs = HashMap::with_capacity(theirs.len());
    let (mut their_rest, mut our_rest) = (Vec::new(), Vec::new());
    let (mut t, mut o) = (theirs.iter().peekable(), ours.iter().peekable());
    loop {
        match (t.peek(), o.peek()) {
            (Some(a), Some(b)) if a.0 == b.0 => {
                pairs.insert(a.2, b.2);
                t.next();
                o.next();
            }
            (Some(a), Some(b)) if a.0 < b.0 => their_rest.extend(t.next()),
            (Some(_), Some(_)) | (None, Some(_)) => our_rest.extend(o.next()),
            (Some(_), None) => their_rest.extend(t.next()),
            (None, None) => break,
        }
    }
    their_rest.sort_unstable_by_key(|&&(_, at, id)| (at, id));
    our_rest.sort_unstable_by_key(|&&(_, at, id)| (at, id));
    pairs.extend(their_rest.iter().zip(&our_rest).map(|(a, b)| (a.2, b.2)));
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A training loop: a weight alive throughout, then steps whose
    /// activations are `len` bytes each, with a gradient that replaces the
    /// last step's (allocated in the step, freed in the next).
    fn training(lens: &[u64]) -> DeviceTrace {
        let mut ops = vec![Op::Alloc {
            id: 0,
            size: 1000,
            stream: 0,
        }];
        let mut step_starts = Vec::new();
        let mut id = 1;
        let mut grad: Option<AllocId> = None;
        for &len in lens {
            step_starts.push(ops.len());
            let act = id;
            ops.push(Op::Alloc {
                id: act,
                size: len,
                stream: 0,
            });
            if let Some(g) = grad {
                ops.push(Op::Free { id: g });
            }
            ops.push(Op::Alloc {
                id: act + 1,
                size: 100,
                stream: 0,
            });
            ops.push(Op::Free { id: act });
            grad = Some(act + 1);
            id += 2;
        }
        DeviceTrace {
            ops,
            step_starts,
            recorded_span_us: Some(1_000),
            ..DeviceTrace::default()
        }
    }

    fn check_lifetimes(trace: &DeviceTrace) {
        let mut live = std::collections::BTreeSet::new();
        for op in &trace.ops {
            match *op {
                Op::Alloc { id, .. } => assert!(live.insert(id), "id {id} made twice"),
                Op::Free { id } => assert!(live.remove(&id), "id {id} freed while not alive"),
                _ => {}
            }
        }
    }

    #[test]
    fn a_long_run_draws_steady_steps_and_keeps_every_lifetime_whole() {
        // The first step allocates the gradient the others replace: not steady.
        let trace = training(&[10, 20, 30, 40]);
        let (long, from) = draw_steps(&trace, 1_000, 7).unwrap();
        assert_eq!(from, 3);
        check_lifetimes(&long);
        assert_eq!(
            long.step_starts.len(),
            1 + 1_000,
            "the prefix's step, then the drawn ones"
        );
        // Every drawn step is a recorded steady one (activation 20, 30 or 40).
        let mut seen = std::collections::BTreeSet::new();
        for op in &long.ops[long.step_starts[1]..] {
            if let Op::Alloc { size, .. } = *op {
                assert!([20, 30, 40, 100].contains(&size), "{size}");
                seen.insert(size);
            }
        }
        assert_eq!(seen.len(), 4, "all three steady steps were drawn");
        assert_eq!(
            long.recorded_span_us,
            Some(1_000 * long.ops.len() as u64 / trace.ops.len() as u64)
        );
        // Deterministic in the seed; another seed draws another order.
        assert_eq!(draw_steps(&trace, 1_000, 7).unwrap().0, long);
        assert_ne!(draw_steps(&trace, 1_000, 8).unwrap().0.ops, long.ops);
    }

    /// A step that hands the next one a block of another size each time (a
    /// batch's inputs, kept until the next batch replaces them) is steady:
    /// the drawn step frees whatever batch the step before it made.
    #[test]
    fn what_a_step_makes_for_the_next_is_handed_on_whatever_its_size() {
        let mut ops = vec![Op::Alloc {
            id: 0,
            size: 1000,
            stream: 0,
        }];
        let mut step_starts = Vec::new();
        for (step, batch) in [7u64, 11, 13, 17].into_iter().enumerate() {
            let id = 1 + 2 * step as AllocId;
            step_starts.push(ops.len());
            ops.push(Op::Alloc {
                id,
                size: batch,
                stream: 0,
            });
            if step > 0 {
                ops.push(Op::Free { id: id - 2 });
            }
            ops.push(Op::Alloc {
                id: id + 1,
                size: 10 * batch,
                stream: 0,
            });
            ops.push(Op::Free { id: id + 1 });
        }
        let trace = DeviceTrace {
            ops,
            step_starts,
            ..DeviceTrace::default()
        };
        let (long, from) = draw_steps(&trace, 500, 3).unwrap();
        assert_eq!(from, 3, "the batches of 11, 13 and 17");
        check_lifetimes(&long);
        // Each drawn step frees the batch the step before it made, and no
        // block that lives across the run (the weight, id 0) goes.
        let mut last_batch = None;
        for (k, window) in long.step_starts.windows(2).enumerate() {
            let step = &long.ops[window[0]..window[1]];
            let Op::Alloc { id: batch, .. } = step[0] else {
                panic!("step {k} begins with {:?}", step[0]);
            };
            let freed: Vec<AllocId> = step
                .iter()
                .filter_map(|op| match *op {
                    Op::Free { id } if id != batch + 1 => Some(id),
                    _ => None,
                })
                .collect();
            if let Some(last) = last_batch {
                assert_eq!(freed, vec![last], "step {k}");
            }
            last_batch = Some(batch);
        }
        let drawn_sizes: std::collections::BTreeSet<u64> = long.ops[long.step_starts[1]..]
            .iter()
            .filter_map(|op| match *op {
                Op::Alloc { size, .. } if size < 100 => Some(size),
                _ => None,
            })
            .collect();
        assert_eq!(
            drawn_sizes,
            [11, 13, 17].into(),
            "the steady steps, each drawn"
        );
    }

    /// The weights (sizes 1000 and 3000) and the batch each step hands the
    /// next (sizes below, between and above them) are told apart by size
    /// first: a drawn step frees the batch before it, never a weight, and
    /// what the recorded allocator did is dropped.
    #[test]
    fn weights_are_matched_by_size_and_batches_by_age_whatever_their_sizes() {
        let alloc = |id, size| Op::Alloc {
            id,
            size,
            stream: 0,
        };
        let mut ops = vec![alloc(0, 1000), alloc(1, 3000)];
        let mut step_starts = Vec::new();
        let batches = [500u64, 2000, 4000, 700, 2500];
        for (step, &batch) in batches.iter().enumerate() {
            let id = 2 + step as AllocId;
            step_starts.push(ops.len());
            ops.push(alloc(id, batch));
            if step > 0 {
                ops.push(Op::Free { id: id - 1 });
            }
        }
        let trace = DeviceTrace {
            ops,
            step_starts,
            recorded: Some(crate::model::Recorded::default()),
            ..DeviceTrace::default()
        };
        let (long, from) = draw_steps(&trace, 300, 11).unwrap();
        assert_eq!(from, 4);
        assert_eq!(
            long.recorded, None,
            "the recorded allocator's figures no longer apply"
        );
        check_lifetimes(&long);
        let mut last_batch = None;
        for op in &long.ops[long.step_starts[1]..] {
            match *op {
                Op::Alloc { id, .. } => last_batch = Some(id),
                Op::Free { id } => {
                    assert!(id > 1, "a drawn step freed weight {id}");
                    assert_ne!(Some(id), last_batch, "a step freed its own batch");
                }
                _ => {}
            }
        }
    }

    /// Two blocks each step makes for the next (sizes 100 and 200), made in
    /// one order in some steps and the other in the rest, beside a batch
    /// whose size varies around theirs: a drawn step frees the ones of the
    /// sizes it freed when recorded, which matching by age alone would
    /// swap.
    #[test]
    fn blocks_handed_on_are_matched_by_size_before_age() {
        let alloc = |id, size| Op::Alloc {
            id,
            size,
            stream: 0,
        };
        let mut ops = vec![alloc(0, 1000)];
        let mut step_starts = Vec::new();
        let mut handed: Option<[AllocId; 3]> = None;
        let mut id = 1;
        for (step, batch) in [50u64, 3000, 150, 2500, 70, 5000, 120]
            .into_iter()
            .enumerate()
        {
            step_starts.push(ops.len());
            if let Some([b, x, y]) = handed {
                ops.extend([b, x, y].map(|id| Op::Free { id }));
            }
            let order = if step % 2 == 0 {
                [100, 200]
            } else {
                [200, 100]
            };
            ops.push(alloc(id, batch));
            ops.push(alloc(id + 1, order[0]));
            ops.push(alloc(id + 2, order[1]));
            // Freed next step as (batch, 100, 200).
            handed = Some(if order[0] == 100 {
                [id, id + 1, id + 2]
            } else {
                [id, id + 2, id + 1]
            });
            id += 3;
        }
        let trace = DeviceTrace {
            ops,
            step_starts,
            ..DeviceTrace::default()
        };
        let (long, from) = draw_steps(&trace, 200, 9).unwrap();
        assert_eq!(from, 6);
        check_lifetimes(&long);
        let mut size = std::collections::HashMap::new();
        for (k, window) in long.step_starts.windows(2).enumerate() {
            let mut freed = Vec::new();
            for op in &long.ops[window[0]..window[1]] {
                match *op {
                    Op::Alloc {
                        id, size: bytes, ..
                    } => {
                        size.insert(id, bytes);
                    }
                    Op::Free { id } => freed.push(size[&id]),
                    _ => {}
                }
            }
            if k > 0 {
                assert!(
                    freed.len() == 3 && freed[1..] == [100, 200] && ![100, 200].contains(&freed[0]),
                    "step {k} freed {freed:?}"
                );
            }
        }
    }

    /// Blocks alive when the recording began count as alive: a first step
    /// that frees one and makes its replacement is steady, and is drawn.
    #[test]
    fn blocks_alive_at_the_window_start_are_handed_on() {
        use crate::model::{InitialBlock, InitialBlockState, InitialSegment};
        let block = |id| InitialBlock {
            size: 1024,
            requested_size: 1000,
            state: InitialBlockState::Allocated(id),
        };
        let mut ops = Vec::new();
        let mut step_starts = Vec::new();
        for step in 0..3u64 {
            step_starts.push(ops.len());
            ops.push(Op::Alloc {
                id: 2 + step,
                size: 10 + step,
                stream: 0,
            });
            // Frees the batch before it: the window's own at first.
            ops.push(Op::Free {
                id: if step == 0 { 1 } else { 1 + step },
            });
        }
        let trace = DeviceTrace {
            ops,
            step_starts,
            initial_segments: vec![InitialSegment {
                address: 0,
                stream: 0,
                small_pool: false,
                expandable: false,
                blocks: vec![block(0), block(1)],
            }],
            ..DeviceTrace::default()
        };
        let (long, from) = draw_steps(&trace, 50, 1).unwrap();
        assert_eq!(from, 3, "every recorded step, the first too");
        assert_eq!(long.step_starts[0], 0, "no prefix before the first step");
        assert_eq!(long.step_starts.len(), 50);
        // Each drawn step frees the batch the one before made (or the
        // window's), never weight 0, and ids stay fresh.
        let mut live: std::collections::BTreeSet<AllocId> = [0, 1].into();
        for op in &long.ops {
            match *op {
                Op::Alloc { id, .. } => assert!(id > 1 && live.insert(id)),
                Op::Free { id } => assert!(id != 0 && live.remove(&id), "freed {id}"),
                _ => {}
            }
        }
        assert_eq!(live.len(), 2);
    }

    #[test]
    fn step_marks_must_be_two_or_more_ascending_op_indices() {
        let trace = training(&[10, 20, 30]);
        let expected = draw_steps(&trace, 20, 4).unwrap();
        // A mark at the end of the ops marks no step.
        let mut at_end = trace.clone();
        at_end.step_starts.push(trace.ops.len());
        assert_eq!(draw_steps(&at_end, 20, 4).unwrap(), expected);
        let mut past_end = trace.clone();
        past_end.step_starts.push(trace.ops.len() + 1);
        let mut descending = trace.clone();
        descending.step_starts.swap(1, 2);
        let mut repeated = trace.clone();
        repeated.step_starts[1] = repeated.step_starts[0];
        for bad in [past_end, descending, repeated] {
            let error = draw_steps(&bad, 20, 4).unwrap_err();
            assert!(error.contains("not ascending op indices"), "{error}");
        }
        // Two marks are enough: the second step is the steady one.
        let two = training(&[10, 20]);
        assert_eq!(draw_steps(&two, 3, 0).unwrap().1, 1);
    }

    #[test]
    fn more_steps_than_a_replay_holds_are_refused_before_drawing() {
        let trace = training(&[10, 20, 30]);
        let steps = &trace.step_starts;
        let longest = (steps[1] - steps[0])
            .max(steps[2] - steps[1])
            .max(trace.ops.len() - steps[2]);
        for too_many in [super::MAX_ADDED_OPS / longest + 1, usize::MAX] {
            let error = draw_steps(&trace, too_many, 0).unwrap_err();
            assert!(
                error.contains(&format!("of up to {longest} operations may be more than")),
                "{error}"
            );
        }
    }

    #[test]
    fn a_trace_without_steady_steps_or_marks_is_refused() {
        let mut trace = training(&[10]);
        assert!(draw_steps(&trace, 5, 0).unwrap_err().contains("step"));
        trace.step_starts.clear();
        assert!(draw_steps(&trace, 5, 0)
            .unwrap_err()
            .contains("marks 0 step"));
    }
}

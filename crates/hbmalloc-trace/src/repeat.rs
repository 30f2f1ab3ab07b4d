//! What-if: a training trace run for more steps than were recorded.
//!
//! A profiler trace or snapshot usually holds a few iterations of a training
//! loop, and the second half of three steps is not the steady state of a run
//! of thousands: an allocator may still be settling in. [`repeat_last_step`]
//! finds the trace's last *step* (a stretch of operations that exactly
//! repeats the stretch before it, sizes and streams alike) and runs it again
//! `copies` more times before the trace's tail.
//!
//! Only the shape of the requests is copied: each copy allocates fresh ids,
//! and its frees name the blocks the copy before allocated in the same
//! places (the step frees, say, the gradients the step before made). The
//! result is checked like a real trace: a copy that would free a block that
//! is not live, or one allocated before the trace began, is an error naming
//! the operation, never a silently different program.

use std::collections::{HashMap, HashSet};

use crate::error::{Location, TraceError};
use crate::model::{AllocId, DeviceTrace, InitialBlockState, Op};

/// Fewest operations a step may have: shorter periods are loops inside a
/// step (the same small allocation made and freed), not a training step.
pub const MIN_STEP_OPS: usize = 16;

/// How many step lengths are checked in full, from the best by sampling.
const CANDIDATES: usize = 16;

/// Positions sampled to rank every step length before the full check.
const SAMPLES: usize = 64;

/// Most operations a what-if may add to a trace (repeated or drawn steps):
/// a replay holds every operation in memory.
pub(crate) const MAX_ADDED_OPS: usize = 50_000_000;

/// A repeating stretch of operations: `ops[start..start + len]` equals, in
/// shape, the `len` operations before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// Index of the step's first operation.
    pub start: usize,
    /// Operations in one step.
    pub len: usize,
}

/// An operation with its allocation names left out: what must repeat.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shape {
    Alloc { size: u64, stream: u64 },
    Free { size: u64 },
    RecordStream { stream: u64 },
    StreamComplete { stream: u64 },
    EmptyCache,
    Oom { size: u64, stream: u64 },
}

/// The shapes of `ops`; a free has the size of what it frees (0 when that
/// was made before the trace began).
fn shapes(ops: &[Op]) -> Vec<Shape> {
    let mut sizes: HashMap<AllocId, u64> = HashMap::new();
    ops.iter()
        .map(|op| match *op {
            Op::Alloc { id, size, stream } => {
                sizes.insert(id, size);
                Shape::Alloc { size, stream }
            }
            Op::Free { id } => Shape::Free {
                size: sizes.get(&id).copied().unwrap_or(0),
            },
            Op::RecordStream { stream, .. } => Shape::RecordStream { stream },
            Op::StreamComplete { stream } => Shape::StreamComplete { stream },
            Op::EmptyCache => Shape::EmptyCache,
            Op::Oom { size, stream, .. } => Shape::Oom { size, stream },
        })
        .collect()
}

/// The last step of `ops`: the step length from [`MIN_STEP_OPS`] to half
/// the trace whose repetitions cover the longest stretch of operations (the
/// shortest length on a tie: two steps repeat wherever one does), and the
/// last `len` operations of that stretch; `None` when nothing repeats.
pub fn find_last_step(ops: &[Op]) -> Option<Step> {
    let shapes = shapes(ops);
    let n = shapes.len();
    // Rank every length by how often it matches at a few positions in the
    // second half (a full check of every length is quadratic), then check
    // the best few in full.
    let stride = (n / 2 / SAMPLES).max(1);
    let positions: Vec<usize> = (n / 2..n).step_by(stride).collect();
    let mut ranked: Vec<(usize, usize)> = (MIN_STEP_OPS..=n / 2)
        .map(|len| {
            let hits = positions
                .iter()
                .filter(|&&i| i >= len && shapes[i] == shapes[i - len])
                .count();
            (hits, len)
        })
        .collect();
    // Most hits first, then the shorter length.
    ranked.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    ranked
        .iter()
        .take(CANDIDATES)
        .filter_map(|&(_, len)| {
            longest_repeat(&shapes, len).map(|(end, run)| (run + len, len, end))
        })
        // The longest stretch, then the shortest length.
        .max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)))
        .map(|(_, len, end)| Step {
            start: end - len,
            len,
        })
}

/// The longest run of operations equal to the one `len` before (the last
/// such run on a tie), as (end, length), when it is at least `len` long: a
/// whole step repeated.
fn longest_repeat(shapes: &[Shape], len: usize) -> Option<(usize, usize)> {
    let mut run = 0;
    let mut best = None;
    for i in len..shapes.len() {
        if shapes[i] == shapes[i - len] {
            run += 1;
            if run >= len && best.is_none_or(|(_, longest)| run >= longest) {
                best = Some((i + 1, run));
            }
        } else {
            run = 0;
        }
    }
    best
}

/// `trace` with its last step ([`find_last_step`]) run `copies` more times,
/// right after it, before the operations that followed it. The recorded
/// allocator's results (`recorded`) no longer describe the program and are
/// dropped. Returns the step found, as indices into the original operations.
pub fn repeat_last_step(
    trace: &DeviceTrace,
    copies: usize,
) -> Result<(DeviceTrace, Step), TraceError> {
    let error = |message: String| {
        TraceError::new(
            "repeat-step",
            Location::Entry(format!("device {}", trace.device)),
            message,
        )
    };
    let step = find_last_step(&trace.ops).ok_or_else(|| {
        error(format!(
            "no repeating step found in {} operations: no stretch of {} or more \
             repeats the one before it",
            trace.ops.len(),
            MIN_STEP_OPS
        ))
    })?;
    let end = step.start + step.len;
    let added = copies
        .checked_mul(step.len)
        .filter(|&added| added <= MAX_ADDED_OPS)
        .ok_or_else(|| {
            error(format!(
                "{copies} copies of a step of {} operations is more than {MAX_ADDED_OPS} \
                 operations",
                step.len
            ))
        })?;

    let initial_ids = || {
        trace
            .initial_segments
            .iter()
            .flat_map(|segment| &segment.blocks)
            .filter_map(|block| match block.state {
                InitialBlockState::Allocated(id) => Some(id),
                InitialBlockState::Free => None,
            })
    };
    let mut next_id = trace
        .ops
        .iter()
        .filter_map(|op| match op {
            Op::Alloc { id, .. } => Some(*id),
            _ => None,
        })
        .chain(initial_ids())
        .max()
        .map_or(Some(0), |id| id.checked_add(1))
        .filter(|next| next.checked_add(added as u64).is_some())
        .ok_or_else(|| error("allocation ids run out: the trace uses ids up to 2^64".into()))?;

    // The original up to the step's end, the copies, then the tail; with
    // where each allocation was made, by position in the new operations.
    let mut ops: Vec<Op> = Vec::with_capacity(trace.ops.len() + added);
    let mut made_at: HashMap<AllocId, usize> = HashMap::new();
    for op in &trace.ops[..end] {
        if let Op::Alloc { id, .. } = *op {
            made_at.insert(id, ops.len());
        }
        ops.push(op.clone());
    }
    for at in end..end + added {
        // Each copy's template is the step (or copy) just before it; a free
        // there names a block made in the step before, whose counterpart is
        // the block made one step later.
        let op = match ops[at - step.len].clone() {
            Op::Alloc { size, stream, .. } => {
                let id = next_id;
                next_id += 1;
                made_at.insert(id, at);
                Op::Alloc { id, size, stream }
            }
            Op::Free { id } => Op::Free {
                id: counterpart(&ops, &made_at, id, at, step.len, step).map_err(error)?,
            },
            Op::RecordStream { id, stream } => Op::RecordStream {
                id: counterpart(&ops, &made_at, id, at, step.len, step).map_err(error)?,
                stream,
            },
            other => other,
        };
        ops.push(op);
    }
    for op in &trace.ops[end..] {
        // A block the last step made and the tail frees is now the one the
        // last copy made.
        let at = ops.len();
        let inside = |id: AllocId| {
            made_at
                .get(&id)
                .is_some_and(|&made| made >= step.start && made < end)
        };
        let op = match *op {
            Op::Free { id } if inside(id) => Op::Free {
                id: counterpart(&ops, &made_at, id, at, added, step).map_err(error)?,
            },
            Op::RecordStream { id, stream } if inside(id) => Op::RecordStream {
                id: counterpart(&ops, &made_at, id, at, added, step).map_err(error)?,
                stream,
            },
            ref other => other.clone(),
        };
        if let Op::Alloc { id, .. } = op {
            made_at.insert(id, at);
        }
        ops.push(op);
    }
    check_lifetimes(initial_ids().collect(), &ops).map_err(error)?;
    // The copies take as long as the step they copy: scale by ops.
    let recorded_span_us = trace
        .recorded_span_us
        .map(|us| scale_by_ops(us, trace.ops.len(), ops.len()));
    let repeated = DeviceTrace {
        ops,
        recorded: None,
        recorded_span_us,
        // The copies' ops have moved: the recorded marks no longer apply.
        step_starts: Vec::new(),
        ..trace.clone()
    };
    Ok((repeated, step))
}

/// `span` of a trace of `old_ops` ops, stretched to `new_ops` at the same
/// time per op.
pub(crate) fn scale_by_ops(span: u64, old_ops: usize, new_ops: usize) -> u64 {
    if old_ops == 0 {
        return span;
    }
    (span as f64 * new_ops as f64 / old_ops as f64).round() as u64
}

/// The allocation made `shift` operations after allocation `id`, for the
/// operation at `at` (the next of `ops`). Only a block made in the step, or
/// in the step before it, has one: the copies repeat the step and nothing
/// earlier.
fn counterpart(
    ops: &[Op],
    made_at: &HashMap<AllocId, usize>,
    id: AllocId,
    at: usize,
    shift: usize,
    step: Step,
) -> Result<AllocId, String> {
    let Some(&made) = made_at.get(&id) else {
        return Err(format!(
            "operation {at} names allocation {id}, made before the trace began: the step \
             does not repeat its frees"
        ));
    };
    match ops.get(made + shift) {
        Some(Op::Alloc { id, .. }) if made + step.len >= step.start => Ok(*id),
        _ => Err(format!(
            "operation {at} frees or uses allocation {id}, made at operation {made}, before \
             the step it repeats: the step does not repeat its frees"
        )),
    }
}

/// Every free and record_stream names a live allocation, and no id is made
/// twice: the rule `hbmalloc-replay` applies when it prepares a trace,
/// checked here so that a copy that breaks it is refused where it is made,
/// with the step's operation named.
fn check_lifetimes(mut live: HashSet<AllocId>, ops: &[Op]) -> Result<(), String> {
    for (at, op) in ops.iter().enumerate() {
        match *op {
            Op::Alloc { id, .. } if !live.insert(id) => {
                return Err(format!("operation {at} allocates {id} twice"));
            }
            Op::Free { id } if !live.remove(&id) => {
                return Err(format!(
                    "operation {at} frees allocation {id}, which is not live: the step does \
                     not repeat its frees"
                ));
            }
            Op::RecordStream { id, .. } if !live.contains(&id) => {
                return Err(format!(
                    "operation {at} uses allocation {id}, which is not live"
                ));
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(id: AllocId, size: u64) -> Op {
        Op::Alloc {
            id,
            size,
            stream: 0,
        }
    }

    fn free(id: AllocId) -> Op {
        Op::Free { id }
    }

    /// A training loop in miniature: weights (id 1), then three steps that
    /// each make activations and gradients and free the step before's
    /// gradients, then a tail that frees what is left.
    fn training(steps: usize) -> DeviceTrace {
        let mut ops = vec![alloc(1, 4096)];
        let mut id = 10;
        let mut previous_grads: Vec<AllocId> = Vec::new();
        for _ in 0..steps {
            let activations: Vec<AllocId> = (0..8).map(|k| id + k).collect();
            for (k, &a) in activations.iter().enumerate() {
                ops.push(alloc(a, 1024 * (k as u64 + 1)));
            }
            id += 8;
            for &g in &previous_grads {
                ops.push(free(g));
            }
            let grads: Vec<AllocId> = (0..4).map(|k| id + k).collect();
            for &g in &grads {
                ops.push(alloc(g, 512));
            }
            id += 4;
            for &a in activations.iter().rev() {
                ops.push(free(a));
            }
            previous_grads = grads;
        }
        for &g in &previous_grads {
            ops.push(free(g));
        }
        ops.push(free(1));
        DeviceTrace {
            ops,
            ..DeviceTrace::default()
        }
    }

    #[test]
    fn finds_the_step_and_runs_it_again() {
        let trace = training(3);
        let step = find_last_step(&trace.ops).expect("a step");
        // The first step frees no gradients: steps 2 and 3 repeat, 24 ops each.
        assert_eq!(step.len, 24);
        assert_eq!(step.start + step.len, trace.ops.len() - 5);

        let (longer, found) = repeat_last_step(&trace, 5).expect("repeats");
        assert_eq!(found, step);
        // Five more steps: the same program as recording eight.
        let eight = training(8);
        assert_eq!(longer.ops.len(), eight.ops.len());
        let shapes = |t: &DeviceTrace| shapes(&t.ops);
        assert!(shapes(&longer) == shapes(&eight));
        check_lifetimes(HashSet::new(), &longer.ops).expect("every free names a live block");
        // And every allocation is freed by the end, as in the original.
        let (allocs, frees) = longer.ops.iter().fold((0, 0), |(a, f), op| match op {
            Op::Alloc { .. } => (a + 1, f),
            Op::Free { .. } => (a, f + 1),
            _ => (a, f),
        });
        assert_eq!(allocs, frees);
    }

    #[test]
    fn a_copy_that_would_free_a_freed_block_is_refused() {
        // Steps 2 and 3 have the same shape, but step 3 frees the block it
        // made itself where step 2 freed one made before: a copy of step 3
        // would free step 3's block, which step 3 already freed.
        let (s, t) = (4096, 512);
        let mut ops = vec![alloc(1, s)];
        let mut next = 100;
        for step in 1..=3u64 {
            let y = 10 + step;
            ops.push(alloc(y, s));
            for _ in 0..16 {
                ops.push(alloc(next, t));
                ops.push(free(next));
                next += 1;
            }
            match step {
                1 => {}
                2 => ops.extend([free(y - 1), free(1)]),
                _ => ops.extend([free(y - 1), free(y)]),
            }
        }
        let trace = DeviceTrace {
            ops,
            ..DeviceTrace::default()
        };
        assert_eq!(find_last_step(&trace.ops).map(|step| step.len), Some(35));
        let error = repeat_last_step(&trace, 1).expect_err("a double free");
        assert!(error.to_string().contains("which is not live"), "{error}");
    }

    /// The result is checked whole: a tail that uses a block after its free
    /// is named, though the copies are sound.
    #[test]
    fn a_use_of_a_freed_block_is_refused() {
        let mut trace = training(3);
        trace.ops.push(Op::RecordStream { id: 1, stream: 3 });
        let error = repeat_last_step(&trace, 2).expect_err("a use after free");
        assert!(
            error
                .to_string()
                .contains("uses allocation 1, which is not live"),
            "{error}"
        );
    }

    #[test]
    fn ids_that_would_overflow_are_refused() {
        let mut trace = training(3);
        trace.ops.insert(0, alloc(u64::MAX - 2, 512));
        trace.ops.insert(1, free(u64::MAX - 2));
        let error = repeat_last_step(&trace, 5).expect_err("ids run out");
        assert!(error.to_string().contains("ids run out"), "{error}");
        repeat_last_step(&training(3), 5).expect("small ids are fine");
    }

    /// A copy's `record_stream` names the block the copy made; the tail's
    /// names the last copy's block, or the block it named if that was made
    /// before the step. What was recorded of the allocator is dropped, the
    /// time span stretched with the ops, the step marks cleared.
    #[test]
    fn copies_and_the_tail_rename_what_they_record_and_drop_the_recording() {
        let mut trace = training(3);
        let tail_start = trace.ops.len() - 5;
        let mut ops = Vec::new();
        for (at, op) in trace.ops.iter().enumerate() {
            if at == tail_start {
                // The tail uses the weights and a gradient of the last step.
                ops.push(Op::RecordStream { id: 1, stream: 7 });
                ops.push(Op::RecordStream { id: 42, stream: 7 });
            }
            ops.push(op.clone());
            if let Op::Alloc { id, size: 512, .. } = *op {
                ops.push(Op::RecordStream { id, stream: 7 });
            }
        }
        trace.ops = ops;
        trace.recorded = Some(crate::model::Recorded::default());
        trace.recorded_span_us = Some(1_000);
        trace.step_starts = vec![1, 29];
        let (longer, step) = repeat_last_step(&trace, 5).expect("repeats");
        assert_eq!(step.len, 28);
        check_lifetimes(HashSet::new(), &longer.ops).expect("every op names a live block");
        let tail = &longer.ops[longer.ops.len() - 7..];
        let Op::RecordStream { id: gradient, .. } = tail[1] else {
            panic!("{tail:?}")
        };
        assert_eq!(tail[0], Op::RecordStream { id: 1, stream: 7 });
        assert!(
            gradient != 42 && tail.contains(&Op::Free { id: gradient }),
            "{tail:?}"
        );
        assert_eq!(longer.recorded, None);
        let stretched = scale_by_ops(1_000, trace.ops.len(), longer.ops.len());
        assert!(stretched > 1_000);
        assert_eq!(longer.recorded_span_us, Some(stretched));
        assert!(longer.step_starts.is_empty());
    }

    #[test]
    fn no_copies_is_the_same_trace() {
        let trace = training(3);
        let (same, _) = repeat_last_step(&trace, 0).expect("repeats");
        assert_eq!(same.ops, trace.ops);
    }

    /// Ops of two shapes in a fixed pseudo-random order: about half of all
    /// lengths match at any one place by chance, and only the step's own
    /// length (and its multiples) everywhere.
    /// Their ids count up from `first`.
    fn chance_matches(step_len: u64, steps: u64, first: u64) -> Vec<Op> {
        let mut rng = crate::rng::SplitMix::new(5);
        let step: Vec<u64> = (0..step_len).map(|_| 512 << (rng.next() % 2)).collect();
        (0..steps * step_len)
            .map(|i| alloc(first + i, step[(i % step_len) as usize]))
            .collect()
    }

    /// `count` ops of sizes no other test op has, ids from `first`.
    fn unrepeated(count: u64, first: u64) -> Vec<Op> {
        (0..count).map(|k| alloc(first + k, 100_000 + k)).collect()
    }

    #[test]
    fn the_step_is_found_among_lengths_that_match_by_chance() {
        let ops = chance_matches(97, 6, 0);
        assert_eq!(
            find_last_step(&ops),
            Some(Step {
                start: 5 * 97,
                len: 97
            })
        );
    }

    /// The length whose repeats cover the most ops wins, not the longest
    /// step: ten copies of a 16-op step, then three of a 40-op one.
    #[test]
    fn the_longest_repeated_stretch_decides_the_step() {
        let mut ops = chance_matches(16, 10, 0);
        for copy in 0..3 {
            ops.extend(unrepeated(40, 160 + 40 * copy));
        }
        assert_eq!(
            find_last_step(&ops),
            Some(Step {
                start: 144,
                len: 16
            })
        );
    }

    /// Of two repeated stretches of one step, the longer decides where the
    /// last step is, though a shorter one comes after it.
    #[test]
    fn a_shorter_repeat_later_does_not_move_the_step() {
        let mut ops = chance_matches(16, 5, 0);
        ops.extend(unrepeated(40, 80));
        ops.extend(chance_matches(16, 2, 120));
        assert_eq!(find_last_step(&ops), Some(Step { start: 64, len: 16 }));
    }

    #[test]
    fn a_trace_without_a_step_is_refused() {
        // Ten ops that repeat the ten 40 before them are no whole step.
        let mut sizes: Vec<u64> = (0..40).map(|i| 512 * (i + 1)).collect();
        sizes.extend_from_within(..10);
        sizes.extend((0..30).map(|i| 1_000_000 + i));
        let ops: Vec<Op> = (0..80).map(|i| alloc(i, sizes[i as usize])).collect();
        assert_eq!(find_last_step(&ops), None);
        // Nor are two copies of 15 ops: a step has `MIN_STEP_OPS` or more.
        assert_eq!(find_last_step(&chance_matches(15, 2, 0)), None);

        let ops: Vec<Op> = (0..100).map(|i| alloc(i, 512 * (i + 1))).collect();
        let trace = DeviceTrace {
            ops,
            ..DeviceTrace::default()
        };
        let error = repeat_last_step(&trace, 3).expect_err("no step");
        assert!(error.to_string().contains("no repeating step"), "{error}");
    }

    #[test]
    fn a_step_freeing_a_block_made_long_before_it_is_refused() {
        // Each step frees one of three like blocks made among 200 up front.
        // A copy of the last step, shifted by a step, would free another
        // block made up front, still live: a valid program, but not this one.
        let mut ops: Vec<Op> = (0..200)
            .map(|i| {
                alloc(
                    i,
                    if (10..13).contains(&i) {
                        512
                    } else {
                        4096 * (i + 1)
                    },
                )
            })
            .collect();
        let mut next = 1_000;
        for step in 0..3 {
            for _ in 0..16 {
                ops.push(alloc(next, 2048));
                ops.push(free(next));
                next += 1;
            }
            ops.push(free(10 + step));
        }
        let trace = DeviceTrace {
            ops,
            ..DeviceTrace::default()
        };
        assert_eq!(find_last_step(&trace.ops).map(|step| step.len), Some(33));
        let error = repeat_last_step(&trace, 1).expect_err("a free from before the step");
        assert!(
            error
                .to_string()
                .contains("made at operation 12, before the step it repeats"),
            "{error}"
        );
    }

    #[test]
    fn a_step_freeing_what_it_did_not_make_is_refused() {
        // Each "step" frees one of 40 blocks made up front: the shapes repeat,
        // but a copy would have to free a block made before the step that the
        // original step already freed.
        let mut ops: Vec<Op> = (0..40).map(|i| alloc(i, 512)).collect();
        for round in 0..3u64 {
            for k in 0..20u64 {
                ops.push(alloc(100 + round * 20 + k, 2048));
                ops.push(free(round * 10 + k % 10));
                ops.push(free(100 + round * 20 + k));
            }
        }
        let trace = DeviceTrace {
            ops,
            ..DeviceTrace::default()
        };
        let error = repeat_last_step(&trace, 2).expect_err("frees do not line up");
        assert!(
            error.to_string().contains("before the step it repeats"),
            "{error}"
        );
    }
}

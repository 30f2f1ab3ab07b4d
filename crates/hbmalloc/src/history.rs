//! The allocation history: a bounded ring buffer of what the allocator did,
//! in PyTorch's trace vocabulary, so snapshots and fidelity checks can read it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::device::{DevicePtr, StreamId};

/// What happened, named as PyTorch's `TraceEntry::Action`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// A block was handed out.
    Alloc,
    /// The program freed a block (it may still be in use on other streams).
    FreeRequested,
    /// The block went back to the cache.
    FreeCompleted,
    /// A whole segment was allocated from the driver.
    SegmentAlloc,
    /// A whole segment was returned to the driver.
    SegmentFree,
    /// Pages were mapped into a virtual range.
    SegmentMap,
    /// Pages were unmapped from a virtual range.
    SegmentUnmap,
    /// An allocation failed for lack of memory (`addr` holds the driver's free bytes).
    Oom,
}

impl Action {
    /// PyTorch's name for the action (`alloc`, `free_requested`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Oom => "oom",
        }
    }

    /// True for the actions that change reserved memory.
    pub fn is_segment_event(self) -> bool {
        matches!(
            self,
            Action::SegmentAlloc | Action::SegmentFree | Action::SegmentMap | Action::SegmentUnmap
        )
    }
}

/// One history entry.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TraceEntry {
    /// What happened.
    pub action: Action,
    /// The address (for `Oom`: the driver's free bytes, as PyTorch records it).
    pub addr: DevicePtr,
    /// Bytes: requested size for block actions, segment size for segment actions.
    pub size: u64,
    /// The stream.
    pub stream: StreamId,
    /// A counter that orders entries: the number of entries recorded before
    /// this one by this history, or by every history sharing its clock
    /// ([`History::share_clock`]).
    pub sequence: u64,
}

/// A bounded ring buffer of [`TraceEntry`]s. Disabled (capacity 0) by default:
/// recording costs time on the hot path, so it is opt-in, as in PyTorch.
#[derive(Clone, Debug, Default)]
pub struct History {
    entries: VecDeque<TraceEntry>,
    capacity: usize,
    recorded: u64,
    /// The sequence counter shared with other engines' histories, so their
    /// entries merge into one order.
    clock: Option<Arc<AtomicU64>>,
    complete_from: u64,
}

impl History {
    /// A history keeping the last `capacity` entries (0 disables recording).
    pub fn with_capacity(capacity: usize) -> Self {
        History {
            entries: VecDeque::new(),
            capacity,
            recorded: 0,
            clock: None,
            complete_from: 0,
        }
    }

    /// Numbers entries from `clock`, shared with other histories, from now
    /// on: the engines of one device then record in one order.
    pub fn share_clock(&mut self, clock: Arc<AtomicU64>) {
        self.clock = Some(clock);
    }

    /// Keeps the last `capacity` entries from now on, dropping the oldest
    /// past it; 0 stops recording and keeps what was recorded, so that it
    /// can still be read. `clear` drops every entry kept
    /// (`torch.cuda.memory._record_memory_history`).
    pub fn set_capacity(&mut self, capacity: usize, clear: bool) {
        if clear {
            self.entries.clear();
            self.complete_from = self.next_sequence();
        }
        if capacity > 0 {
            let excess = self.entries.len().saturating_sub(capacity);
            self.drop_oldest(excess);
        }
        self.capacity = capacity;
    }

    /// True when entries are being recorded.
    pub fn is_enabled(&self) -> bool {
        self.capacity > 0
    }

    /// Records an entry, dropping the oldest when full.
    #[inline]
    pub fn record(&mut self, action: Action, addr: DevicePtr, size: u64, stream: StreamId) {
        if self.capacity == 0 {
            return;
        }
        if self.entries.len() == self.capacity {
            self.drop_oldest(1);
        }
        let sequence = match &self.clock {
            // Relaxed: each engine records under its own lock; the order
            // across engines is the order the counter hands out.
            Some(clock) => clock.fetch_add(1, Ordering::Relaxed),
            None => self.recorded,
        };
        self.entries.push_back(TraceEntry {
            action,
            addr,
            size,
            stream,
            sequence,
        });
        self.recorded += 1;
    }

    /// The entries kept, oldest first.
    pub fn entries(&self) -> std::collections::vec_deque::Iter<'_, TraceEntry> {
        self.entries.iter()
    }

    /// Entries recorded since the history was created, including dropped ones.
    pub fn recorded(&self) -> u64 {
        self.recorded
    }

    /// The sequence from which this history holds every entry it recorded:
    /// 0 until the ring drops one (when full, shrunk or cleared).
    pub fn complete_from(&self) -> u64 {
        self.complete_from
    }

    fn next_sequence(&self) -> u64 {
        match &self.clock {
            Some(clock) => clock.load(Ordering::Relaxed),
            None => self.recorded,
        }
    }

    fn drop_oldest(&mut self, count: usize) {
        if let Some(last) = self.entries.drain(..count).next_back() {
            self.complete_from = last.sequence + 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Action, History};
    use crate::device::StreamId;

    fn sizes(history: &History) -> Vec<u64> {
        history.entries().map(|e| e.size).collect()
    }

    /// The names are PyTorch's `TraceEntry` actions, which its memory
    /// visualizer reads from a snapshot: a contract, not a choice.
    #[test]
    fn actions_carry_pytorchs_names() {
        let names = [
            (Action::Alloc, "alloc"),
            (Action::FreeRequested, "free_requested"),
            (Action::FreeCompleted, "free_completed"),
            (Action::SegmentAlloc, "segment_alloc"),
            (Action::SegmentFree, "segment_free"),
            (Action::SegmentMap, "segment_map"),
            (Action::SegmentUnmap, "segment_unmap"),
            (Action::Oom, "oom"),
        ];
        for (action, name) in names {
            assert_eq!(action.name(), name);
        }
    }

    /// `recorded` counts every entry, dropped ones too; a cleared history
    /// is complete from the next entry on.
    #[test]
    fn counts_survive_drops_and_clears() {
        let mut history = History::with_capacity(0);
        assert!(!history.is_enabled());
        history.set_capacity(2, false);
        assert!(history.is_enabled());
        for size in 1..=5 {
            history.record(Action::Alloc, 0, size, StreamId(0));
        }
        assert_eq!((history.recorded(), history.complete_from()), (5, 3));
        history.set_capacity(2, true);
        assert_eq!((history.recorded(), history.complete_from()), (5, 5));
        assert_eq!(history.entries().count(), 0);
    }

    #[test]
    fn the_capacity_can_change_while_recording() {
        let mut history = History::with_capacity(0);
        history.record(Action::Alloc, 0x100, 1, StreamId(0));
        assert!(sizes(&history).is_empty(), "off by default");
        history.set_capacity(3, false);
        for size in 1..=5 {
            history.record(Action::Alloc, 0x100, size, StreamId(0));
        }
        assert_eq!(sizes(&history), [3, 4, 5], "the last 3");
        history.set_capacity(2, false);
        assert_eq!(sizes(&history), [4, 5], "shrinking drops the oldest");
        history.set_capacity(0, false);
        history.record(Action::Alloc, 0x100, 6, StreamId(0));
        assert_eq!(sizes(&history), [4, 5], "stopped, entries kept");
        history.set_capacity(10, true);
        assert!(sizes(&history).is_empty(), "cleared");
        history.record(Action::Alloc, 0x100, 7, StreamId(0));
        assert_eq!(history.entries().next().map(|e| e.sequence), Some(5));
    }
}

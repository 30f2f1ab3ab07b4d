//! End-of-use events: how a policy knows that a freed block which other
//! streams used (`record_stream`) may be reused.
//!
//! On free, an event is recorded on each of the block's other streams; the
//! block is reused once all of them completed. Events of one stream complete
//! in the order they were recorded, so each stream keeps a queue and only its
//! front is ever asked. Both policies keep their events here, keyed by their
//! own block handle (`K`), and do the bookkeeping of their blocks themselves.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Bound;

use crate::device::{Device, DeviceError, EventId, StreamId};

/// Events not yet known to have completed, per stream, with the blocks
/// waiting on them.
#[derive(Debug)]
pub(crate) struct PendingEvents<K> {
    /// Per stream, in record order.
    queues: BTreeMap<StreamId, VecDeque<(EventId, K)>>,
    /// Blocks freed during a capture: their events are recorded when it ends
    /// (PyTorch's `needs_events_deferred_until_no_capture`).
    deferred: Vec<K>,
    /// Events whose synchronization failed, retired at the next full
    /// synchronization so that none is leaked.
    stray: Vec<EventId>,
}

impl<K> Default for PendingEvents<K> {
    fn default() -> Self {
        PendingEvents {
            queues: BTreeMap::new(),
            deferred: Vec::new(),
            stray: Vec::new(),
        }
    }
}

/// Where [`PendingEvents::next_completed`] goes on from: the streams still to
/// ask in one pass.
pub(crate) struct Poll(Bound<StreamId>);

impl Poll {
    /// A pass over every stream.
    pub(crate) fn new() -> Self {
        Poll(Bound::Unbounded)
    }
}

impl<K: Copy> PendingEvents<K> {
    /// Whether no event is pending.
    pub(crate) fn is_empty(&self) -> bool {
        self.queues.is_empty()
    }

    /// Every pending event with its block, stream by stream.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &(EventId, K)> {
        self.queues.values().flatten()
    }

    /// Records an event for `block` on each of `streams`, in that order.
    /// Returns how many were recorded and, if recording failed, the streams
    /// not covered (from the failing one on) with the error: the caller keeps
    /// those as uses, so the block waits for a whole-device synchronization.
    pub(crate) fn record(
        &mut self,
        dev: &dyn Device,
        block: K,
        streams: &[StreamId],
    ) -> (u32, Result<(), (Vec<StreamId>, DeviceError)>) {
        for (i, &stream) in streams.iter().enumerate() {
            match dev.record_event(stream) {
                Ok(event) => self
                    .queues
                    .entry(stream)
                    .or_default()
                    .push_back((event, block)),
                Err(e) => return (i as u32, Err((streams[i..].to_vec(), e))),
            }
        }
        (streams.len() as u32, Ok(()))
    }

    /// The block of the next completed event in this pass (`poll`), asking
    /// the driver without waiting; `None` once every stream's front event is
    /// still running. The caller handles each block before asking again.
    pub(crate) fn next_completed(
        &mut self,
        dev: &dyn Device,
        poll: &mut Poll,
    ) -> Result<Option<K>, DeviceError> {
        loop {
            let Some((&stream, queue)) = self.queues.range_mut((poll.0, Bound::Unbounded)).next()
            else {
                return Ok(None);
            };
            let &(event, block) = queue.front().expect("queues are never left empty");
            if !dev.query_event(event)? {
                poll.0 = Bound::Excluded(stream);
                continue;
            }
            queue.pop_front();
            if queue.is_empty() {
                self.queues.remove(&stream);
            }
            poll.0 = Bound::Included(stream);
            return Ok(Some(block));
        }
    }

    /// Waits for the oldest event of the first stream and returns its block;
    /// `None` when nothing is pending. The caller handles each block before
    /// asking again.
    pub(crate) fn wait_next(&mut self, dev: &dyn Device) -> Result<Option<K>, DeviceError> {
        let Some(mut entry) = self.queues.first_entry() else {
            return Ok(None);
        };
        let &(event, block) = entry.get().front().expect("queues are never left empty");
        dev.synchronize_event(event)?;
        entry.get_mut().pop_front();
        if entry.get().is_empty() {
            entry.remove();
        }
        Ok(Some(block))
    }

    /// Keeps `block` to record its events when the capture ends.
    pub(crate) fn defer(&mut self, block: K) {
        self.deferred.push(block);
    }

    /// The blocks freed during the capture that just ended.
    pub(crate) fn take_deferred(&mut self) -> Vec<K> {
        std::mem::take(&mut self.deferred)
    }

    /// Records an event that was waited for in vain, to retire later.
    pub(crate) fn stray(&mut self, event: EventId) {
        self.stray.push(event);
    }

    /// Waits for every event that [`stray`](Self::stray) kept.
    pub(crate) fn retire_strays(&mut self, dev: &dyn Device) -> Result<(), DeviceError> {
        while let Some(&event) = self.stray.last() {
            dev.synchronize_event(event)?;
            self.stray.pop();
        }
        Ok(())
    }

    /// Records an event on `stream` and waits for it: the stream's queued
    /// work is done. An event whose wait failed is kept to retire later.
    pub(crate) fn wait_for_stream(
        &mut self,
        dev: &dyn Device,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        let event = dev.record_event(stream)?;
        dev.synchronize_event(event)
            .inspect_err(|_| self.stray(event))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::SimDevice;

    fn drain(events: &mut PendingEvents<u32>, dev: &SimDevice) -> Vec<u32> {
        let mut poll = Poll::new();
        let mut done = Vec::new();
        while let Some(block) = events.next_completed(dev, &mut poll).unwrap() {
            done.push(block);
        }
        done
    }

    /// A pass hands out each stream's completed events in record order and
    /// stops at a stream's first running one; a later pass goes on from there.
    #[test]
    fn completed_events_come_stream_by_stream_in_record_order() {
        let dev = SimDevice::with_capacity(1 << 30);
        let mut events = PendingEvents::default();
        let (a, b) = (StreamId(1), StreamId(2));
        assert_eq!(events.record(&dev, 10, &[a, b]), (2, Ok(())));
        assert_eq!(events.record(&dev, 11, &[b]), (1, Ok(())));
        assert_eq!(events.record(&dev, 12, &[a]), (1, Ok(())));
        assert!(drain(&mut events, &dev).is_empty());
        dev.complete_stream(b);
        assert_eq!(drain(&mut events, &dev), vec![10, 11]);
        dev.complete_stream(a);
        assert_eq!(drain(&mut events, &dev), vec![10, 12]);
        assert!(events.is_empty());
    }

    /// Waiting goes stream by stream too, and empties every queue.
    #[test]
    fn waiting_hands_out_every_block_once() {
        let dev = SimDevice::with_capacity(1 << 30);
        let mut events = PendingEvents::default();
        assert_eq!(events.record(&dev, 1, &[StreamId(3), StreamId(1)]).0, 2);
        assert_eq!(events.record(&dev, 2, &[StreamId(1)]).0, 1);
        let mut done = Vec::new();
        while let Some(block) = events.wait_next(&dev).unwrap() {
            done.push(block);
        }
        assert_eq!(done, vec![1, 2, 1]);
        assert!(events.is_empty() && events.iter().next().is_none());
    }
}

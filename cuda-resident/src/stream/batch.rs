//! [`LaneBatch`]: exclusive use of a lane for a batch of submissions, and its side work.

use cuda_sys::CUstream;

use super::KeepAlive;
use super::lane::{Lane, SidePending};
use crate::error::Result;
use crate::raw::Raw;
use crate::sync::lock;

/// Exclusive use of a lane for a batch of submissions.
///
/// A batch reserves the sequence numbers of its submissions before the first is enqueued
/// ([`LaneBatch::reserve`]: buffers are marked as used up to the last one). If it stops
/// part-way (a driver call failed), dropping it makes the numbers it never submitted complete
/// with the work enqueued before them, so that nothing waits for them forever.
pub(crate) struct LaneBatch<'a> {
    lane: &'a Lane,
    reserved: std::cell::Cell<u64>,
    side: std::cell::Cell<SidePending>,
    /// The slots whose events this batch recorded (a bit each): the others hold only side
    /// work of earlier batches, which were joined.
    side_slots: std::cell::Cell<u8>,
    _exclusive: crate::sync::MutexGuard<'a, ()>,
}

impl Drop for LaneBatch<'_> {
    fn drop(&mut self) {
        // Side work left unjoined (a batch that stopped part-way) is joined first, so that
        // the numbers completed below cover it. There is no caller to report a failure to:
        // the join synchronizes the side stream when it cannot enqueue a wait, and fails only
        // when that fails too, a lost context, whose marker below cannot complete either
        // (its record fails and its stream cannot be synchronized: nothing retires).
        let _ = self.join_side();
        self.lane.skip_to(self.reserved.get());
    }
}

impl LaneBatch<'_> {
    /// Records that this batch's submissions will use sequence numbers up to `last`.
    pub(crate) fn reserve(&self, last: u64) {
        self.reserved.set(self.reserved.get().max(last));
    }

    /// The sequence number the next submission of this batch will get.
    pub(crate) fn next_seq(&self) -> u64 {
        lock(&self.lane.state).next_seq
    }

    /// Enqueues work on the stream, records the submission's event and returns its sequence
    /// number, which `enqueue` also receives (to mark the buffers it uses before any other
    /// thread can see the work). `keep` stays alive until the work completes. The lane's lock
    /// is held while `enqueue` runs, so stream order is sequence order.
    ///
    /// If `enqueue` fails after enqueuing part of its work, the event is recorded all the
    /// same (what was enqueued must finish before `keep` is released) and the error returned.
    pub(crate) fn submit(
        &self,
        keep: KeepAlive,
        enqueue: impl FnOnce(&Raw, CUstream, u64) -> Result<()>,
    ) -> Result<u64> {
        self.lane.submit_locked(keep, enqueue)
    }

    /// Enqueues `enqueue` on the lane's side stream, after the lane's last submission (work
    /// enqueued on the lane's stream since, outside a submission, is not waited for), and
    /// records its end in `slot`'s event. The side work gets no number and keeps nothing
    /// alive: what it uses must outlive the batch's later submissions, and the batch must
    /// [`wait_side`](Self::wait_side) before it reuses the work's inputs and
    /// [`join_side`](Self::join_side) before its last submission (a batch dropped with side
    /// work unjoined joins it).
    ///
    /// If `enqueue` fails after enqueuing part of its work, its end is recorded all the same
    /// and the error returned.
    pub(crate) fn submit_side(
        &self,
        slot: usize,
        enqueue: impl FnOnce(&Raw, CUstream) -> Result<()>,
    ) -> Result<()> {
        let raw = &self.lane.ctx.raw;
        let mut state = lock(&self.lane.state);
        let after = state.inflight.back().map(|f| f.event);
        let side = match &mut state.side {
            Some(side) => side,
            none => none.insert(self.lane.new_side()?),
        };
        // A submission no longer in flight is done, and so is everything before it.
        if let Some(event) = after {
            raw.stream_wait_event(side.stream, event)?;
        }
        let enqueued = enqueue(raw, side.stream);
        let pending = match raw.event_record(side.events[slot], side.stream) {
            Ok(()) => {
                self.side_slots.set(self.side_slots.get() | 1 << slot);
                SidePending::Recorded(slot)
            }
            Err(e) => {
                self.side.set(SidePending::Unrecorded);
                return Err(enqueued.err().unwrap_or(e));
            }
        };
        // Once one end could not be recorded, only a synchronize joins.
        if self.side.get() != SidePending::Unrecorded {
            self.side.set(pending);
        }
        enqueued
    }

    /// Makes the lane's stream wait for the side work last recorded in `slot` (and, the side
    /// stream being in order, for the side work before it).
    pub(crate) fn wait_side(&self, slot: usize) -> Result<()> {
        match self.side.get() {
            SidePending::None => Ok(()),
            SidePending::Recorded(_) if self.side_slots.get() & 1 << slot == 0 => Ok(()),
            SidePending::Recorded(last) if last == slot => self.join_side(),
            SidePending::Recorded(_) => {
                let state = lock(&self.lane.state);
                let side = state.side.as_ref().expect("side work was submitted");
                self.lane.ctx.raw.stream_wait_event(self.lane.stream, side.events[slot])
            }
            SidePending::Unrecorded => self.join_side(),
        }
    }

    /// Makes the lane's stream wait for all side work of this batch; the lane's next
    /// submission is then done only after it. Where no wait can be enqueued, blocks until
    /// the side stream is idle instead.
    pub(crate) fn join_side(&self) -> Result<()> {
        let pending = self.side.get();
        if pending == SidePending::None {
            return Ok(());
        }
        let raw = &self.lane.ctx.raw;
        let state = lock(&self.lane.state);
        let side = state.side.as_ref().expect("side work was submitted");
        let joined = match pending {
            SidePending::Recorded(slot) => raw
                .stream_wait_event(self.lane.stream, side.events[slot])
                .or_else(|_| raw.stream_synchronize(side.stream)),
            _ => raw.stream_synchronize(side.stream),
        };
        if joined.is_ok() {
            self.side.set(SidePending::None);
        }
        joined
    }
}

impl Lane {
    /// Starts a batch of submissions: until the returned guard drops, no other thread
    /// submits on this lane.
    pub(crate) fn batch(&self) -> LaneBatch<'_> {
        LaneBatch {
            lane: self,
            reserved: std::cell::Cell::new(0),
            side: std::cell::Cell::new(SidePending::None),
            side_slots: std::cell::Cell::new(0),
            _exclusive: lock(&self.submitting),
        }
    }
}

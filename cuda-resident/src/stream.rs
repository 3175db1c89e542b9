//! Lanes (one non-blocking stream per direction, each with a timeline of events) and fences.
//!
//! Every submission on a lane gets the next sequence number and an event recorded after its
//! work. The lane keeps the events of work in flight, in order, together with what that work
//! needs alive (pinned memory); polling pops the completed ones, recycles their events and
//! releases what they kept. "Is submission `s` done?" is then one atomic load in the common
//! case: `s <= completed`.
//!
//! Two lanes, host-to-device and device-to-host, so that the two directions overlap on the
//! GPU's separate copy engines. Neither is ever the null stream.
//!
//! A lane also has a side stream, made on first use, for kernels that should run while the
//! lane's stream moves the next bytes ([`LaneBatch::submit_side`]). Side work starts after the
//! lane's last submission and is joined back into the lane's stream before the batch's
//! dependent work and its last submission, so a sequence number still means "everything
//! before it is done", side work included.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use cuda_sys::{CUevent, CUstream};

use crate::context::Context;
use crate::error::Result;
use crate::host_pool::HostLease;
use crate::raw::{Raw, release_retrying};
use crate::sync::lock;
// The timeline's counter is model-checked with loom (the `loom` tests at the end).
use crate::sync::shim::atomic::AtomicU64;

/// The two directions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum LaneKind {
    /// Host to device.
    Upload = 0,
    /// Device to host.
    Readback = 1,
}

impl LaneKind {
    pub(crate) const ALL: [LaneKind; 2] = [LaneKind::Upload, LaneKind::Readback];

    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// The other direction.
    pub(crate) fn other(self) -> LaneKind {
        match self {
            LaneKind::Upload => LaneKind::Readback,
            LaneKind::Readback => LaneKind::Upload,
        }
    }
}

/// What a submission keeps alive until its work completes.
pub(crate) type KeepAlive = Vec<std::sync::Arc<HostLease>>;

struct InFlight {
    seq: u64,
    event: CUevent,
    keep: KeepAlive,
}

/// Side work slots of a lane: a batch alternates between two (two staging regions).
pub(crate) const SIDE_SLOTS: usize = 2;

/// A lane's side stream and the events recorded on it after side work, one per slot.
struct Side {
    stream: CUstream,
    events: [CUevent; SIDE_SLOTS],
}

/// Side work of a batch not yet joined into the lane's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SidePending {
    None,
    /// The last side work's end is recorded in this slot's event.
    Recorded(usize),
    /// Side work was enqueued but its end could not be recorded: joined by a synchronize.
    Unrecorded,
}

struct LaneState {
    next_seq: u64,
    inflight: VecDeque<InFlight>,
    spare_events: Vec<CUevent>,
    side: Option<Side>,
    /// What submissions kept alive when neither their event nor a stream synchronize could
    /// be had (a lost context): held until the lane goes away, never lent again meanwhile.
    stranded: Vec<KeepAlive>,
}

impl LaneState {
    /// The event after which submission `seq` is done: that of the first submission in
    /// flight at or after it; failing that (`seq` was reserved but never got an event of its
    /// own, after a failure), the newest in flight, which is never too early. `None` when
    /// nothing is in flight.
    fn event_for(&self, seq: u64) -> Option<(u64, CUevent)> {
        covering(&self.inflight, |f| f.seq, seq).map(|f| (f.seq, f.event))
    }
}

/// The submission of `inflight` (numbered by `seq_of`, in increasing order) after which
/// submission `seq` is done: the first at or after it, failing that the newest, which is
/// never too early. `None` when nothing is in flight.
fn covering<T>(inflight: &VecDeque<T>, seq_of: impl Fn(&T) -> u64, seq: u64) -> Option<&T> {
    inflight.iter().find(|f| seq_of(f) >= seq).or(inflight.back())
}

/// How many times [`settle_stream`] asks the driver before it gives up.
const SETTLE_TRIES: u32 = 8;

/// Synchronizes `stream` (of `kind`'s lane, in `ctx`), asking again while the driver
/// refuses: `Ok` once it confirms that everything enqueued on the stream is done, the error
/// of a context whose work will never run ([`crate::error::Error::work_never_runs`]: lost to a fault,
/// destroyed, or the driver shutting down). Returning otherwise would hand back memory that
/// queued work reads or writes; where the driver neither confirms the work done nor reports
/// it gone, nothing can keep that promise: the process aborts, after [`SETTLE_TRIES`] asks.
fn settle_stream(ctx: &Context, stream: CUstream, kind: LaneKind) -> Result<()> {
    let mut last = None;
    for attempt in 0..SETTLE_TRIES {
        match ctx.bind().and_then(|raw| raw.stream_synchronize(stream)) {
            Ok(()) => return Ok(()),
            Err(e) if e.work_never_runs() => return Err(e),
            Err(e) => last = Some(e),
        }
        std::thread::sleep(std::time::Duration::from_millis(1 << attempt));
    }
    eprintln!(
        "cuda-resident: copies on the {kind:?} lane could not be confirmed done or lost ({}); aborting rather than \
         handing back memory the GPU may still use",
        last.map_or_else(String::new, |e| e.to_string())
    );
    std::process::abort()
}

/// One stream and its timeline.
pub(crate) struct Lane {
    kind: LaneKind,
    stream: CUstream,
    ctx: Arc<Context>,
    state: crate::sync::Mutex<LaneState>,
    /// Held by a submitter for a whole batch, so that the sequence numbers of its
    /// submissions are known before the first one is enqueued.
    submitting: crate::sync::Mutex<()>,
    /// Every sequence number up to this one has completed.
    completed: Completed,
}

// SAFETY: the stream and event handles are driver handles usable from any thread; the
// mutable state is behind the mutex.
unsafe impl Send for Lane {}
// SAFETY: as above.
unsafe impl Sync for Lane {}

impl fmt::Debug for Lane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lane")
            .field("kind", &self.kind)
            .field("completed", &self.completed.get())
            .finish_non_exhaustive()
    }
}

impl Lane {
    /// A lane on a new non-blocking stream. The context must be current.
    pub(crate) fn new(kind: LaneKind, ctx: Arc<Context>) -> Result<Lane> {
        let stream = ctx.raw.stream_create_non_blocking()?;
        Ok(Lane {
            kind,
            stream,
            ctx,
            state: crate::sync::Mutex::new(LaneState {
                next_seq: 1,
                inflight: VecDeque::new(),
                spare_events: Vec::new(),
                side: None,
                stranded: Vec::new(),
            }),
            submitting: crate::sync::Mutex::new(()),
            completed: Completed::new(),
        })
    }

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

    /// The lane's stream.
    pub(crate) fn stream(&self) -> CUstream {
        self.stream
    }

    /// The sequence number of the last submission (0 when there was none).
    pub(crate) fn last_submitted(&self) -> u64 {
        lock(&self.state).next_seq - 1
    }

    /// The oldest submission still in flight, if any.
    pub(crate) fn oldest_in_flight(&self) -> Option<u64> {
        lock(&self.state).inflight.front().map(|f| f.seq)
    }

    /// Whether submission `seq` is known to have completed, without asking the driver.
    pub(crate) fn is_known_done(&self, seq: u64) -> bool {
        self.completed.covers(seq)
    }

    /// The submission up to which every one is known to have completed.
    pub(crate) fn known_done(&self) -> u64 {
        self.completed.get()
    }

    /// Whether submission `seq` has completed, asking the driver if need be.
    pub(crate) fn is_done(&self, seq: u64) -> Result<bool> {
        if self.is_known_done(seq) {
            return Ok(true);
        }
        self.poll()?;
        Ok(self.is_known_done(seq))
    }

    /// Retires every completed submission at the head of the timeline, releasing what it
    /// kept alive.
    pub(crate) fn poll(&self) -> Result<()> {
        self.retire_while(|front| self.ctx.raw.event_query(front.event))
    }

    /// Retires submissions from the head of the timeline while `done` says they have
    /// completed, releasing what they kept alive.
    fn retire_while(&self, done: impl FnMut(&InFlight) -> Result<bool>) -> Result<()> {
        let mut released: Vec<KeepAlive> = Vec::new();
        let result = {
            let mut state = lock(&self.state);
            let LaneState { inflight, spare_events, .. } = &mut *state;
            retire_front(
                inflight,
                |f| f.seq,
                &self.completed,
                done,
                |done| {
                    spare_events.push(done.event);
                    if !done.keep.is_empty() {
                        released.push(done.keep);
                    }
                },
            )
        };
        // Released staging goes back to its pool outside the lane's lock.
        drop(released);
        result
    }

    /// Blocks the calling thread until submission `seq` has completed. Returns whether it
    /// had to wait.
    pub(crate) fn wait(&self, seq: u64) -> Result<bool> {
        if self.is_known_done(seq) {
            return Ok(false);
        }
        let Some((through, event)) = lock(&self.state).event_for(seq) else {
            // Nothing in flight: retired between the check and the lock.
            return Ok(false);
        };
        // The event may be recycled for a later submission on this same stream while we
        // wait; then we wait for that later work too, which is later in stream order: longer,
        // never too short.
        self.ctx.bind()?.event_synchronize(event)?;
        // Everything up to the submission waited for is done, in stream order: retired
        // without asking the driver about each one (a query per submission cost the
        // latency path a driver call).
        self.retire_while(|front| Ok(front.seq <= through))?;
        Ok(true)
    }

    /// Waits for everything submitted so far.
    pub(crate) fn synchronize(&self) -> Result<bool> {
        self.wait(self.last_submitted())
    }

    /// Makes `stream` wait, on the device, for submission `seq` of this lane. Returns
    /// whether a wait was enqueued (none for work known to be done).
    pub(crate) fn make_stream_wait(&self, seq: u64, stream: CUstream) -> Result<bool> {
        if self.is_known_done(seq) {
            return Ok(false);
        }
        // The lock keeps the event from being recycled while the wait is enqueued.
        let state = lock(&self.state);
        match state.event_for(seq) {
            Some((_, event)) => self.ctx.raw.stream_wait_event(stream, event).map(|()| true),
            None => Ok(false),
        }
    }
}

impl Lane {
    /// Has the driver call `callback` with `data` once submission `seq` (and everything
    /// enqueued on the lane before the call) has completed, or failed. `Ok(false)`, with
    /// nothing enqueued, when `seq` is already known to be done.
    ///
    /// # Safety
    ///
    /// As [`Raw::stream_add_callback`]: `callback` may be called with `data` from another
    /// thread, once.
    pub(crate) unsafe fn call_after(
        &self,
        seq: u64,
        callback: cuda_sys::CUstreamCallback,
        data: *mut std::os::raw::c_void,
    ) -> Result<bool> {
        if self.is_known_done(seq) {
            return Ok(false);
        }
        // Under the lock, the callback lands after every submission recorded so far, in
        // stream order (submissions enqueue under this lock), so after `seq`'s work.
        let state = lock(&self.state);
        if state.inflight.is_empty() {
            return Ok(false);
        }
        // SAFETY: the lane's stream is live; the rest is the caller's promise.
        unsafe { self.ctx.raw.stream_add_callback(self.stream, callback, data) }?;
        drop(state);
        Ok(true)
    }

    /// Records `event` on the lane's stream after submission `seq`'s work (and whatever was
    /// submitted since). Records nothing when `seq` is known to be done: an event never
    /// recorded counts as complete for every wait and query.
    pub(crate) fn record_after(&self, seq: u64, event: CUevent) -> Result<()> {
        if self.is_known_done(seq) {
            return Ok(());
        }
        let state = lock(&self.state);
        if state.inflight.is_empty() {
            return Ok(());
        }
        self.ctx.raw.event_record(event, self.stream)?;
        drop(state);
        Ok(())
    }
}

/// How far a lane's timeline has completed: every submission numbered up to it is done.
/// Advanced by the thread that learned that submissions completed (a poll or a wait, which
/// asked the driver), read by any thread without a lock: one that sees a number covered
/// also sees what the advancing thread saw before (the bytes a download brought, say).
struct Completed(AtomicU64);

impl Completed {
    /// Nothing completed yet (numbers start at 1).
    fn new() -> Completed {
        Completed(AtomicU64::new(0))
    }

    /// Whether submission `seq` is known to have completed. Acquire: pairs with
    /// [`advance`](Completed::advance).
    fn covers(&self, seq: u64) -> bool {
        seq <= self.0.load(Ordering::Acquire)
    }

    /// Records that every submission up to `seq` has completed. Never goes back, whatever
    /// order concurrent retirements land in.
    fn advance(&self, seq: u64) {
        self.0.fetch_max(seq, Ordering::AcqRel);
    }

    /// The number. Acquire, as [`covers`](Completed::covers).
    fn get(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

/// Retires submissions from the head of `inflight` (numbered by `seq`, in increasing order)
/// while `done` says they have completed: pops each, advances `completed` to its number and
/// hands it to `retired`. Stops at the first not done, or at the first error of `done`,
/// which it returns. The caller holds the lock that guards `inflight`.
fn retire_front<T>(
    inflight: &mut VecDeque<T>,
    seq: impl Fn(&T) -> u64,
    completed: &Completed,
    mut done: impl FnMut(&T) -> Result<bool>,
    mut retired: impl FnMut(T),
) -> Result<()> {
    while let Some(front) = inflight.front() {
        if !done(front)? {
            break;
        }
        let front = inflight.pop_front().expect("front exists");
        completed.advance(seq(&front));
        retired(front);
    }
    Ok(())
}

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
    /// The side stream and its events. The context is bound here: nothing else on the
    /// submission path binds it.
    fn new_side(&self) -> Result<Side> {
        let raw = self.ctx.bind()?;
        let stream = raw.stream_create_non_blocking()?;
        let mut events = [std::ptr::null_mut(); SIDE_SLOTS];
        for i in 0..SIDE_SLOTS {
            match raw.event_create() {
                Ok(event) => events[i] = event,
                Err(e) => {
                    for &event in &events[..i] {
                        let _ = release_retrying(|| raw.event_destroy(event));
                    }
                    let _ = release_retrying(|| raw.stream_destroy(stream));
                    return Err(e);
                }
            }
        }
        Ok(Side { stream, events })
    }

    fn submit_locked(
        &self,
        keep: KeepAlive,
        enqueue: impl FnOnce(&Raw, CUstream, u64) -> Result<()>,
    ) -> Result<u64> {
        let mut state = lock(&self.state);
        let seq = state.next_seq;
        // The lane's context is made current first: a launch must go to a stream of the
        // current context, and the calling thread may have another device's current (or
        // none: a thread the caller spawned). Cheap when it already is.
        let bound = self.ctx.bind();
        let raw = &self.ctx.raw;
        // The event exists before any work is enqueued, so enqueued work always gets one.
        let event = bound.and_then(|raw| match state.spare_events.pop() {
            Some(event) => Ok(event),
            None => raw.event_create(),
        });
        let recorded = event.and_then(|event| {
            let enqueued = enqueue(raw, self.stream, seq);
            match raw.event_record(event, self.stream) {
                Ok(()) => Ok((event, enqueued)),
                Err(e) => {
                    state.spare_events.push(event);
                    Err(e)
                }
            }
        });
        state.next_seq = seq + 1;
        match recorded {
            Ok((event, enqueued)) => {
                state.inflight.push_back(InFlight { seq, event, keep });
                drop(state);
                enqueued.map(|()| seq)
            }
            Err(e) => {
                drop(state);
                self.retire_without_event(seq, keep);
                Err(e)
            }
        }
    }

    /// After submission `seq` got no event: waits for the stream instead ([`Lane::settle`]),
    /// after which everything up to `seq` is done and retires. If the context is lost, no
    /// work of it runs any more, but `keep` is never lent again all the same (held until the
    /// lane goes away).
    fn retire_without_event(&self, seq: u64, keep: KeepAlive) {
        if self.settle().is_err() {
            // Not coming back: transfers that find the pool full must not wait for it.
            keep.iter().for_each(|lease| lease.strand());
            lock(&self.state).stranded.push(keep);
            return;
        }
        let retired: Vec<InFlight> = {
            let mut state = lock(&self.state);
            let retired: Vec<InFlight> = state.inflight.drain(..).collect();
            state.spare_events.extend(retired.iter().map(|f| f.event));
            retired
        };
        self.completed.advance(seq);
        // Released staging goes back to its pool outside the lane's lock.
        drop((retired, keep));
    }

    /// Synchronizes the lane's stream, asking again while the driver refuses
    /// ([`settle_stream`]): for a path whose copy may still be queued after an error (its
    /// event or its wait failed), and for teardown.
    pub(crate) fn settle(&self) -> Result<()> {
        settle_stream(&self.ctx, self.stream, self.kind)
    }

    /// Makes every sequence number up to `last` that was reserved but never submitted complete
    /// once the work enqueued before it has: an empty submission numbered `last`.
    fn skip_to(&self, last: u64) {
        {
            let mut state = lock(&self.state);
            if state.next_seq > last {
                return;
            }
            state.next_seq = last;
        }
        // A failure is handled inside (the stream is waited for instead); there is no caller
        // to report it to.
        let _ = self.submit_locked(Vec::new(), |_, _, _| Ok(()));
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        // Destroying needs no current context; binding is for the synchronize.
        let _ = release_retrying(|| self.ctx.bind().map(drop));
        let raw = &self.ctx.raw;
        // Work in flight finishes before its staging is released and the stream destroyed
        // (or will never run: a lost context).
        let _ = self.settle();
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(side) = state.side.take() {
            let _ = settle_stream(&self.ctx, side.stream, self.kind);
            for event in side.events {
                let _ = release_retrying(|| raw.event_destroy(event));
            }
            let _ = release_retrying(|| raw.stream_destroy(side.stream));
        }
        let events = state.inflight.drain(..).map(|f| f.event).chain(state.spare_events.drain(..));
        for event in events {
            let _ = release_retrying(|| raw.event_destroy(event));
        }
        let _ = release_retrying(|| raw.stream_destroy(self.stream));
    }
}

/// A device's two lanes and the context they live in: what a [`Fence`] keeps alive.
///
/// The lanes drop (their streams and events destroyed, after the work in flight) before the
/// context is released: each lane holds the context too.
pub(crate) struct Lanes {
    lanes: [Lane; 2],
    ctx: Arc<Context>,
    /// Fences waited on by the host that were not already complete (shared with the
    /// device's telemetry).
    host_waits: Arc<std::sync::atomic::AtomicU64>,
}

impl fmt::Debug for Lanes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(&self.lanes).finish()
    }
}

impl Lanes {
    /// The upload and download lanes on new non-blocking streams of `ctx`, which must be
    /// current; host waits on their fences count in `host_waits`.
    pub(crate) fn new(ctx: Arc<Context>, host_waits: Arc<std::sync::atomic::AtomicU64>) -> Result<Lanes> {
        let lanes = [
            Lane::new(LaneKind::Upload, Arc::clone(&ctx))?,
            Lane::new(LaneKind::Readback, Arc::clone(&ctx))?,
        ];
        Ok(Lanes { lanes, ctx, host_waits })
    }

    /// The lane of direction `kind`.
    pub(crate) fn lane(&self, kind: LaneKind) -> &Lane {
        &self.lanes[kind.index()]
    }

    /// The context the lanes live in.
    pub(crate) fn ctx(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Both lanes, upload first.
    pub(crate) fn iter(&self) -> std::slice::Iter<'_, Lane> {
        self.lanes.iter()
    }
}

/// Completion of submitted work: an event on one lane, and the lanes and context that keep
/// it valid.
///
/// Wait for it on the host ([`wait`](Fence::wait)), await it (`fence.await`, under any
/// executor: [`FenceFuture`](crate::FenceFuture)), make a stream of yours wait for it on the
/// GPU ([`make_stream_wait`](Fence::make_stream_wait)), or hand it on as an event
/// ([`record_event`](Fence::record_event)); the [`interop`](crate::interop) chapter says more.
///
/// Dropping a fence does not cancel or wait for anything: the work completes on its own and
/// what it needs stays alive until then. A fence keeps its device's context and lanes alive,
/// not its buffers: those are freed when the last [`Device`](crate::Device) handle is
/// dropped (after the copies in flight complete), fence or no fence.
#[derive(Clone)]
#[must_use = "a fence is the only way to know that the submitted work has finished"]
pub struct Fence {
    lanes: Option<Arc<Lanes>>,
    lane: LaneKind,
    seq: u64,
}

impl fmt::Debug for Fence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fence").field("lane", &self.lane).field("seq", &self.seq).finish()
    }
}

impl Fence {
    pub(crate) fn new(lanes: Arc<Lanes>, lane: LaneKind, seq: u64) -> Fence {
        Fence { lanes: Some(lanes), lane, seq }
    }

    /// The lanes, lane and submission this fence waits for; `None` for a fence with
    /// nothing to wait for.
    pub(crate) fn target(&self) -> Option<(&Arc<Lanes>, LaneKind, u64)> {
        self.lanes.as_ref().map(|lanes| (lanes, self.lane, self.seq))
    }

    /// A fence with nothing to wait for (an empty batch).
    pub fn completed() -> Fence {
        Fence { lanes: None, lane: LaneKind::Upload, seq: 0 }
    }

    /// Blocks until the work has completed on the GPU. Fails if the GPU reported an error
    /// for that work (or earlier work on its stream).
    pub fn wait(&self) -> Result<()> {
        let Some(lanes) = &self.lanes else { return Ok(()) };
        if lanes.lane(self.lane).wait(self.seq)? {
            lanes.host_waits.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Whether the work has completed, without blocking.
    pub fn is_complete(&self) -> Result<bool> {
        match &self.lanes {
            None => Ok(true),
            Some(lanes) => lanes.lane(self.lane).is_done(self.seq),
        }
    }

    /// Makes one of the caller's streams wait, on the GPU, for this work: kernels the caller
    /// launches on `stream` afterwards see the uploaded bytes, with no host round trip.
    ///
    /// # Safety
    ///
    /// `stream` must be a live stream (or null, the legacy default stream) of this device's
    /// primary context.
    pub unsafe fn make_stream_wait(&self, stream: CUstream) -> Result<()> {
        match &self.lanes {
            None => Ok(()),
            Some(lanes) => {
                lanes.ctx.bind()?;
                lanes.lane(self.lane).make_stream_wait(self.seq, stream).map(drop)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use cuda_sys::{CUDA_ERROR_LAUNCH_FAILED, Driver, Fault};

    use super::*;
    use crate::host_pool::HostPool;
    use crate::testing::model::{self, complete_all, with};

    /// A lane on the model GPU, and its driver (for faults).
    fn lane() -> (Arc<Driver>, Lane) {
        let driver = model::driver();
        let lane = Lane::new(LaneKind::Upload, model::context(&driver)).unwrap();
        (driver, lane)
    }

    /// A batch that reserved three numbers and submitted one: as after a failure part-way.
    fn stop_after_one_of_three(lane: &Lane) {
        let batch = lane.batch();
        batch.reserve(3);
        assert_eq!(batch.submit(Vec::new(), |_, _, _| Ok(())).unwrap(), 1);
    }

    #[test]
    fn a_batch_that_stops_part_way_completes_its_numbers_with_the_work_before_them() {
        let (_driver, lane) = lane();
        stop_after_one_of_three(&lane);
        assert_eq!(lane.last_submitted(), 3, "2 and 3 are used up");
        assert!(!lane.is_done(3).unwrap(), "not done before the work before them");
        assert!(!lane.is_done(2).unwrap());
        complete_all();
        assert!(lane.is_done(2).unwrap() && lane.is_done(3).unwrap());
        assert_eq!(lane.batch().next_seq(), 4, "the next batch continues after them");
    }

    #[test]
    fn when_no_marker_can_be_recorded_the_stream_is_waited_for_and_everything_retires() {
        let (driver, lane) = lane();
        // The first record is the submission's, the second the marker's.
        driver.faults().inject(Fault::new("cuEventRecord", 2, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
        stop_after_one_of_three(&lane);
        assert_eq!(with(|g| g.stream_syncs), 1, "the stream was synchronized instead");
        assert!(lane.is_known_done(3), "and everything up to the reserved numbers retired");
        assert_eq!(lane.oldest_in_flight(), None);
    }

    #[test]
    fn a_wait_for_a_number_that_never_got_an_event_waits_for_the_newest_work() {
        let (driver, lane) = lane();
        // Neither the marker nor the stream synchronize: a context in trouble.
        driver.faults().inject(Fault::new("cuEventRecord", 2, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
        driver.faults().inject(Fault::new("cuStreamSynchronize", 1, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
        stop_after_one_of_three(&lane);
        let first = {
            let state = lock(&lane.state);
            assert_eq!(state.inflight.iter().map(|f| f.seq).collect::<Vec<_>>(), vec![1]);
            model::id(state.inflight[0].event)
        };
        assert!(!lane.is_known_done(3));
        // Number 3 has no event of its own: waiting for it waits for submission 1, the
        // newest work in flight, rather than returning at once.
        assert!(lane.wait(3).unwrap(), "it had to wait");
        assert_eq!(with(|g| g.event_waits.clone()), vec![first]);
        assert!(lane.is_done(1).unwrap());
    }

    #[test]
    fn staging_of_a_submission_whose_record_and_synchronize_fail_is_never_lent_again() {
        let (driver, lane) = lane();
        let pool = Arc::new(HostPool::new(model::context(&driver), 1 << 20, 0));
        let lease = Arc::new(pool.try_acquire(4096).unwrap().expect("room in the pool"));
        driver.faults().inject(Fault::new("cuEventRecord", 1, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
        driver.faults().inject(Fault::new("cuStreamSynchronize", 1, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
        let err = lane.batch().submit(vec![Arc::clone(&lease)], |_, _, _| Ok(())).unwrap_err();
        assert!(err.to_string().contains("cuEventRecord"), "{err}");
        drop(lease);
        assert!(pool.stats().lent_bytes > 0, "what the copy may still use is not back in the pool");
        drop(lane);
        assert_eq!(pool.stats().lent_bytes, 0, "returned once the lane is gone");
    }

    #[test]
    fn a_wait_retires_everything_up_to_its_submission_without_querying_each() {
        let (driver, lane) = lane();
        let pool = Arc::new(HostPool::new(model::context(&driver), 1 << 20, 0));
        let leases: Vec<_> = (0..3).map(|_| Arc::new(pool.try_acquire(4096).unwrap().unwrap())).collect();
        let seqs: Vec<u64> = leases
            .iter()
            .map(|l| lane.batch().submit(vec![Arc::clone(l)], |_, _, _| Ok(())).unwrap())
            .collect();
        let later = lane.batch().submit(Vec::new(), |_, _, _| Ok(())).unwrap();
        drop(leases);
        complete_all();
        driver.faults().record();
        assert!(lane.wait(seqs[2]).unwrap());
        let counts = driver.faults().counts();
        assert_eq!(counts.get("cuEventQuery").map_or(0, |c| c.calls), 0, "{counts:?}");
        assert!(lane.is_known_done(seqs[2]), "the three are retired");
        assert_eq!(pool.stats().lent_bytes, 0, "and their staging is back");
        assert!(!lane.is_known_done(later), "a later one is left for a poll");
        assert!(lane.is_done(later).unwrap());
    }

    /// Device memory of 4096 bytes, and pinned memory holding random bytes and poison.
    struct SideCopy {
        dev: u64,
        src: *mut u8,
        out: *mut u8,
    }

    impl SideCopy {
        fn new(lane: &Lane) -> SideCopy {
            let raw = &lane.ctx.raw;
            let (src, out) = (raw.mem_host_alloc(4096).unwrap(), raw.mem_host_alloc(4096).unwrap());
            let mut rng = fastrand::Rng::with_seed(7);
            // SAFETY: two fresh pinned allocations of 4096 bytes.
            unsafe {
                std::slice::from_raw_parts_mut(src, 4096).fill_with(|| rng.u8(..));
                std::slice::from_raw_parts_mut(out, 4096).fill(0xA5);
            }
            SideCopy { dev: raw.mem_alloc(4096).unwrap(), src, out }
        }

        /// The bytes up on the lane's stream (a submission); down on the side stream.
        fn enqueue(&self, batch: &LaneBatch<'_>) -> Result<()> {
            // SAFETY: live pinned and device allocations of 4096 bytes.
            batch.submit(Vec::new(), |raw, stream, _| unsafe {
                raw.memcpy_htod_async(self.dev, self.src, 4096, stream)
            })?;
            batch.submit_side(0, |raw, side| {
                // SAFETY: as above; `out` is not read before the copy is waited for.
                unsafe { raw.memcpy_dtoh_async(self.out, self.dev, 4096, side) }
            })
        }

        fn came_back(&self) -> bool {
            // SAFETY: live pinned allocations, no copy in flight (the model runs work when waited for).
            unsafe {
                std::slice::from_raw_parts(self.out, 4096) == std::slice::from_raw_parts(self.src, 4096)
            }
        }
    }

    #[test]
    fn side_work_starts_after_the_lanes_last_submission() {
        let (_driver, lane) = lane();
        let c = SideCopy::new(&lane);
        let batch = lane.batch();
        c.enqueue(&batch).unwrap();
        // Waiting for the side stream alone runs the upload first.
        let side = lock(&lane.state).side.as_ref().unwrap().stream;
        lane.ctx.raw.stream_synchronize(side).unwrap();
        assert!(c.came_back());
        batch.join_side().unwrap();
    }

    #[test]
    fn after_a_join_the_next_number_covers_the_side_work() {
        let (_driver, lane) = lane();
        let c = SideCopy::new(&lane);
        let batch = lane.batch();
        c.enqueue(&batch).unwrap();
        batch.join_side().unwrap();
        let seq = batch.submit(Vec::new(), |_, _, _| Ok(())).unwrap();
        drop(batch);
        assert!(!c.came_back(), "nothing ran yet");
        lane.wait(seq).unwrap();
        assert!(c.came_back(), "waiting for the number ran the side work");
    }

    #[test]
    fn a_batch_dropped_with_side_work_unjoined_completes_its_numbers_after_it() {
        let (_driver, lane) = lane();
        let c = SideCopy::new(&lane);
        let batch = lane.batch();
        batch.reserve(3);
        c.enqueue(&batch).unwrap();
        drop(batch);
        lane.wait(3).unwrap();
        assert!(c.came_back(), "the marker for 2 and 3 came after the side work");
    }

    #[test]
    fn a_join_that_cannot_enqueue_its_wait_synchronizes_the_side_stream() {
        let (driver, lane) = lane();
        let c = SideCopy::new(&lane);
        // The first wait is the side stream's for the lane, the second the join's.
        driver.faults().inject(Fault::new("cuStreamWaitEvent", 2, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
        let batch = lane.batch();
        c.enqueue(&batch).unwrap();
        batch.join_side().unwrap();
        assert_eq!(with(|g| g.stream_syncs), 1);
        assert!(c.came_back(), "done before the join returned");
    }

    #[test]
    fn side_work_whose_end_cannot_be_recorded_fails_and_is_joined_by_a_synchronize() {
        let (driver, lane) = lane();
        let c = SideCopy::new(&lane);
        // The first record is the upload's submission, the second the side work's end.
        driver.faults().inject(Fault::new("cuEventRecord", 2, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
        let batch = lane.batch();
        let err = c.enqueue(&batch).unwrap_err();
        assert!(err.to_string().contains("cuEventRecord"), "{err}");
        // A later side end recorded fine does not make the lost one joinable by a wait.
        batch.submit_side(1, |_, _| Ok(())).unwrap();
        batch.join_side().unwrap();
        assert_eq!(with(|g| g.stream_syncs), 1);
        assert!(c.came_back());
    }

    #[test]
    fn a_side_stream_that_cannot_be_made_fails_with_nothing_enqueued_and_the_next_try_makes_it() {
        let (driver, lane) = lane();
        driver.faults().inject(Fault::new("cuStreamCreate", 1, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
        let batch = lane.batch();
        let ran = std::cell::Cell::new(false);
        let side_work = || {
            batch.submit_side(0, |_, _| {
                ran.set(true);
                Ok(())
            })
        };
        let err = side_work().unwrap_err();
        assert!(err.to_string().contains("cuStreamCreate") && !ran.get(), "{err}");
        // A second event fails: the stream and the first event are released.
        driver.faults().inject(Fault::new("cuEventCreate", 2, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
        side_work().unwrap_err();
        assert!(!ran.get());
        side_work().unwrap();
        assert!(ran.get());
        drop(batch);
        drop(lane);
        // Counted from the first fault on: the lane's own stream was made before.
        let counts = driver.faults().counts();
        let made = |entry: &str| counts.get(entry).map_or(0, |c| c.succeeded);
        assert_eq!(made("cuStreamCreate"), 2, "{counts:?}");
        assert_eq!(made("cuStreamDestroy_v2"), 2 + 1, "{counts:?}");
        assert_eq!(made("cuEventCreate"), 3, "{counts:?}");
        assert_eq!(made("cuEventDestroy_v2"), 3, "{counts:?}");
    }

    #[test]
    fn a_fence_outlives_its_device_and_its_wait_counts_as_a_host_wait() {
        let d = crate::testing::device(crate::testing::small_chunks());
        let b = d.allocate(4096).unwrap();
        let fence = {
            let mut batch = d.uploads();
            batch.write(b, 0, &[7u8; 4096]).unwrap();
            batch.submit().unwrap()
        };
        let early = fence.clone();
        assert!(!fence.is_complete().unwrap(), "the model runs nothing until the host waits");
        early.wait().unwrap();
        assert_eq!(d.telemetry().host_waits, 1);
        let mut batch = d.uploads();
        batch.write(b, 0, &[8u8; 4096]).unwrap();
        let late = batch.submit().unwrap();
        drop(d);
        // The device went first; its lanes and context stay with the fences.
        assert!(late.is_complete().unwrap(), "dropping the device waited for its copies");
        late.wait().unwrap();
        // SAFETY: the null stream of a context that is still alive.
        unsafe { late.make_stream_wait(std::ptr::null_mut()) }.unwrap();
        assert!(fence.is_complete().unwrap());
    }

    #[test]
    fn a_failed_submission_with_a_working_stream_returns_its_staging_after_waiting() {
        let (driver, lane) = lane();
        let pool = Arc::new(HostPool::new(model::context(&driver), 1 << 20, 0));
        let lease = Arc::new(pool.try_acquire(4096).unwrap().expect("room in the pool"));
        driver.faults().inject(Fault::new("cuEventRecord", 1, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
        lane.batch().submit(vec![Arc::clone(&lease)], |_, _, _| Ok(())).unwrap_err();
        assert_eq!(with(|g| g.stream_syncs), 1);
        drop(lease);
        assert_eq!(pool.stats().lent_bytes, 0);
    }
}

/// Model checks of the timeline's protocol under every interleaving loom explores (run with
/// `RUSTFLAGS="--cfg loom"`, docs/reliability.md): the lane's own [`Completed`],
/// [`retire_front`] and [`covering`], with the driver replaced by a thread that plays the
/// device (it writes a submission's bytes, then sets its event).
#[cfg(all(test, loom))]
mod loom {
    use std::collections::VecDeque;

    use loom::cell::UnsafeCell;

    use super::{Completed, covering, retire_front};
    use crate::sync::shim::atomic::{AtomicBool, Ordering};
    use crate::sync::shim::{Arc, Mutex, lock, thread};

    /// A submission in flight: its number and its event.
    struct Work {
        seq: u64,
        event: usize,
    }

    /// What the lane's lock guards (the part the model needs).
    #[derive(Default)]
    struct State {
        inflight: VecDeque<Work>,
        retired: Vec<u64>,
    }

    /// A lane of two submissions and the device that runs them.
    struct Lane {
        state: Mutex<State>,
        completed: Completed,
        /// The events of submissions 1 and 2: set by the device once their work is done.
        events: [AtomicBool; 2],
        /// The bytes each submission brings (a download into pinned memory).
        bytes: [UnsafeCell<u8>; 2],
    }

    // SAFETY: `bytes[i]` is written by the device thread alone, before it sets `events[i]`,
    // and read only by threads that learned that submission `i + 1` completed; loom checks
    // that every such read happens after the write.
    unsafe impl Sync for Lane {}

    impl Lane {
        fn new() -> Lane {
            Lane {
                state: Mutex::new(State::default()),
                completed: Completed::new(),
                events: [AtomicBool::new(false), AtomicBool::new(false)],
                bytes: [UnsafeCell::new(0), UnsafeCell::new(0)],
            }
        }

        /// Records submission `seq` (`Lane::submit`: under the lock, in order).
        fn record(&self, seq: u64) {
            lock(&self.state).inflight.push_back(Work { seq, event: seq as usize - 1 });
        }

        /// The device runs submission `i + 1`: its bytes, then its event.
        fn complete(&self, i: usize) {
            // SAFETY: the device thread is the only writer (see `Sync` above).
            self.bytes[i].with_mut(|b| unsafe { *b = i as u8 + 1 });
            self.events[i].store(true, Ordering::Release);
        }

        /// Retires while `done` (`Lane::retire_while`).
        fn retire_while(&self, done: impl FnMut(&Work) -> crate::error::Result<bool>) {
            let mut state = lock(&self.state);
            let State { inflight, retired } = &mut *state;
            retire_front(inflight, |w| w.seq, &self.completed, done, |w| retired.push(w.seq)).unwrap();
        }

        /// `Lane::poll`: asks each event at the head.
        fn poll(&self) {
            self.retire_while(|w| Ok(self.events[w.event].load(Ordering::Acquire)));
        }

        /// `Lane::wait`: the fast path, else the covering event, waited for, then retires
        /// through it.
        fn wait(&self, seq: u64) {
            if self.completed.covers(seq) {
                return;
            }
            let Some((through, event)) =
                covering(&lock(&self.state).inflight, |w| w.seq, seq).map(|w| (w.seq, w.event))
            else {
                return;
            };
            // `cuEventSynchronize`.
            while !self.events[event].load(Ordering::Acquire) {
                thread::yield_now();
            }
            self.retire_while(|w| Ok(w.seq <= through));
        }

        /// The bytes of submission `i + 1`, which the caller knows completed.
        fn read(&self, i: usize) -> u8 {
            // SAFETY: read after the write, or loom reports the race (see `Sync` above).
            self.bytes[i].with(|b| unsafe { *b })
        }
    }

    /// While a poller races the submitter and a waiter: a waiter for submission 2 returns
    /// only once 2 is done, and sees its bytes and those of 1 (stream order); a thread that
    /// finds a number covered sees that submission's bytes; the completed number never goes
    /// back; each submission retires once, in order.
    #[test]
    fn loom_timeline_wait_poll_and_record() {
        loom::model(|| {
            let lane = Arc::new(Lane::new());
            lane.record(1);
            let poller = {
                let lane = Arc::clone(&lane);
                thread::spawn(move || {
                    lane.poll();
                    let seen = lane.completed.get();
                    if lane.completed.covers(1) {
                        assert_eq!(lane.read(0), 1, "covered, so its bytes are in");
                    }
                    lane.poll();
                    assert!(lane.completed.get() >= seen, "the completed number went back");
                })
            };
            lane.record(2);
            let device = {
                let lane = Arc::clone(&lane);
                thread::spawn(move || {
                    lane.complete(0);
                    lane.complete(1);
                })
            };
            lane.wait(2);
            assert!(lane.completed.covers(2), "a wait returned before its submission was done");
            assert_eq!((lane.read(0), lane.read(1)), (1, 2));
            poller.join().unwrap();
            device.join().unwrap();
            assert_eq!(lock(&lane.state).retired, vec![1, 2]);
            assert!(lock(&lane.state).inflight.is_empty());
        });
    }
}

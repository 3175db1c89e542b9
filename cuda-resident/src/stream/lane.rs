//! A lane: one stream, its timeline of events and what its work keeps alive; and [`Lanes`],
//! a device's two.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use cuda_sys::{CUevent, CUstream};

use super::{KeepAlive, LaneKind, SIDE_SLOTS};
use crate::context::Context;
use crate::error::Result;
use crate::raw::{Raw, release_retrying};
use crate::sync::lock;
// The timeline's counter is model-checked with loom (the `loom` tests, stream/loom.rs).
use crate::sync::shim::atomic::AtomicU64;

pub(super) struct InFlight {
    pub(super) seq: u64,
    pub(super) event: CUevent,
    pub(super) keep: KeepAlive,
}

/// A lane's side stream and the events recorded on it after side work, one per slot.
pub(super) struct Side {
    pub(super) stream: CUstream,
    pub(super) events: [CUevent; SIDE_SLOTS],
}

/// Side work of a batch not yet joined into the lane's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SidePending {
    None,
    /// The last side work's end is recorded in this slot's event.
    Recorded(usize),
    /// Side work was enqueued but its end could not be recorded: joined by a synchronize.
    Unrecorded,
}

pub(super) struct LaneState {
    pub(super) next_seq: u64,
    pub(super) inflight: VecDeque<InFlight>,
    pub(super) spare_events: Vec<CUevent>,
    pub(super) side: Option<Side>,
    /// What submissions kept alive when neither their event nor a stream synchronize could
    /// be had (a lost context): held until the lane goes away, never lent again meanwhile.
    pub(super) stranded: Vec<KeepAlive>,
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
pub(super) fn covering<T>(inflight: &VecDeque<T>, seq_of: impl Fn(&T) -> u64, seq: u64) -> Option<&T> {
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
    pub(super) kind: LaneKind,
    pub(super) stream: CUstream,
    pub(super) ctx: Arc<Context>,
    pub(super) state: crate::sync::Mutex<LaneState>,
    /// Held by a submitter for a whole batch, so that the sequence numbers of its
    /// submissions are known before the first one is enqueued.
    pub(super) submitting: crate::sync::Mutex<()>,
    /// Every sequence number up to this one has completed.
    pub(super) completed: Completed,
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
pub(super) struct Completed(AtomicU64);

impl Completed {
    /// Nothing completed yet (numbers start at 1).
    pub(super) fn new() -> Completed {
        Completed(AtomicU64::new(0))
    }

    /// Whether submission `seq` is known to have completed. Acquire: pairs with
    /// [`advance`](Completed::advance).
    pub(super) fn covers(&self, seq: u64) -> bool {
        seq <= self.0.load(Ordering::Acquire)
    }

    /// Records that every submission up to `seq` has completed. Never goes back, whatever
    /// order concurrent retirements land in.
    pub(super) fn advance(&self, seq: u64) {
        self.0.fetch_max(seq, Ordering::AcqRel);
    }

    /// The number. Acquire, as [`covers`](Completed::covers).
    pub(super) fn get(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

/// Retires submissions from the head of `inflight` (numbered by `seq`, in increasing order)
/// while `done` says they have completed: pops each, advances `completed` to its number and
/// hands it to `retired`. Stops at the first not done, or at the first error of `done`,
/// which it returns. The caller holds the lock that guards `inflight`.
pub(super) fn retire_front<T>(
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

impl Lane {
    /// The side stream and its events. The context is bound here: nothing else on the
    /// submission path binds it.
    pub(super) fn new_side(&self) -> Result<Side> {
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

    pub(super) fn submit_locked(
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
    pub(super) fn skip_to(&self, last: u64) {
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

/// A device's two lanes and the context they live in: what a [`Fence`](super::Fence) keeps alive.
///
/// The lanes drop (their streams and events destroyed, after the work in flight) before the
/// context is released: each lane holds the context too.
pub(crate) struct Lanes {
    pub(super) lanes: [Lane; 2],
    pub(super) ctx: Arc<Context>,
    /// Fences waited on by the host that were not already complete (shared with the
    /// device's telemetry).
    pub(crate) host_waits: Arc<std::sync::atomic::AtomicU64>,
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
            Lane::new(LaneKind::Download, Arc::clone(&ctx))?,
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

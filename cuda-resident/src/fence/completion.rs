//! A fence's completion handed to other code: awaited ([`FenceFuture`]) or as a recorded
//! `CUevent` ([`FenceEvent`]).
//!
//! Awaiting uses no thread of the crate's and no polling: the first poll of a fence that is
//! not complete enqueues a driver callback (`cuStreamAddCallback`) on the fence's lane, after
//! the fenced work. The driver calls it on its own thread once that work completes (or
//! fails); the callback only marks the future done and wakes its waker. The next poll then
//! asks the lane (one event query, no wait) and resolves to `Ok` or to the driver's error.

use std::fmt;
use std::future::{Future, IntoFuture};
use std::os::raw::c_void;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context as TaskContext, Poll, Waker};

use cuda_sys::{CUevent, CUresult, CUstream};

use super::Fence;
use crate::context::Context;
use crate::error::Result;
use crate::raw::release_retrying;

/// What the driver's callback and the future share.
#[derive(Default)]
struct Signal {
    state: Mutex<SignalState>,
}

#[derive(Default)]
struct SignalState {
    /// The callback ran: the fenced work has completed or failed.
    fired: bool,
    /// The waker of the latest poll.
    waker: Option<Waker>,
}

impl Signal {
    fn lock(&self) -> std::sync::MutexGuard<'_, SignalState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Called by the driver, on its own thread, after the fenced work: marks the signal and
/// wakes the task. Makes no driver call (the driver forbids it here).
unsafe extern "C" fn fired(_stream: CUstream, _status: CUresult, data: *mut c_void) {
    // SAFETY: `data` is the `Arc<Signal>` that `FenceFuture::poll` leaked for this one
    // call; taken back here, exactly once.
    let signal = unsafe { Arc::from_raw(data.cast_const().cast::<Signal>()) };
    let waker = {
        let mut state = signal.lock();
        state.fired = true;
        state.waker.take()
    };
    if let Some(waker) = waker {
        // A waker that panics must not unwind into the driver.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| waker.wake()));
    }
}

/// A [`Fence`] being awaited: resolves to `Ok(())` once the fenced work has completed on the
/// GPU, or to the driver's error if it failed. Made by `fence.await` (or
/// [`IntoFuture::into_future`]); works under any executor.
///
/// The first poll of a fence not yet complete enqueues a driver callback on the fence's lane
/// (`cuStreamAddCallback`) and returns `Pending`; the driver wakes the task from its own
/// thread when the work is done. No thread is started and nothing polls in a loop. A fence
/// already complete resolves at the first poll, with no callback. Dropping the future
/// cancels nothing and does not block: the callback, if enqueued, still runs and frees what
/// it shares with the future.
///
/// The waker is woken on the driver's callback thread, where no CUDA call may be made:
/// executors that only schedule the task on wake (all the common ones) are fine; a waker
/// that polls futures inline on that thread must not be used.
#[must_use = "futures do nothing unless polled"]
pub struct FenceFuture {
    fence: Fence,
    /// Set once the callback is enqueued.
    signal: Option<Arc<Signal>>,
}

impl fmt::Debug for FenceFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FenceFuture")
            .field("fence", &self.fence)
            .field("callback_enqueued", &self.signal.is_some())
            .finish()
    }
}

impl FenceFuture {
    /// The result once the work is known to have completed or failed: asks the lane, which
    /// retires the work (one event query, which reports a failure), and waits only if the
    /// query says otherwise (it should not: the callback ran after the work).
    fn finish(&self) -> Result<()> {
        if self.fence.is_complete()? { Ok(()) } else { self.fence.wait() }
    }
}

impl Future for FenceFuture {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<()>> {
        let this = self.get_mut();
        if let Some(signal) = &this.signal {
            {
                let mut state = signal.lock();
                if !state.fired {
                    if !state.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                        state.waker = Some(cx.waker().clone());
                    }
                    return Poll::Pending;
                }
            }
            return Poll::Ready(this.finish());
        }
        let Some((lanes, kind, seq)) = this.fence.target() else { return Poll::Ready(Ok(())) };
        match this.fence.is_complete() {
            Ok(true) => return Poll::Ready(Ok(())),
            Ok(false) => {}
            Err(e) => return Poll::Ready(Err(e)),
        }
        let signal = Arc::new(Signal::default());
        signal.lock().waker = Some(cx.waker().clone());
        let data = Arc::into_raw(Arc::clone(&signal)).cast_mut().cast::<c_void>();
        // SAFETY: `fired` takes back the `Arc` in `data` exactly once, and touches nothing
        // but it; the lane's stream lives as long as the lanes, which drop only after their
        // work (the callback included) completes.
        let enqueued =
            lanes.ctx().bind().and_then(|_| unsafe { lanes.lane(kind).call_after(seq, Some(fired), data) });
        match enqueued {
            Ok(true) => {
                this.signal = Some(signal);
                Poll::Pending
            }
            Ok(false) | Err(_) => {
                // SAFETY: not enqueued: the callback will never take it back.
                drop(unsafe { Arc::from_raw(data.cast_const().cast::<Signal>()) });
                Poll::Ready(enqueued.and_then(|_| this.finish()))
            }
        }
    }
}

impl IntoFuture for Fence {
    type Output = Result<()>;
    type IntoFuture = FenceFuture;

    fn into_future(self) -> FenceFuture {
        FenceFuture { fence: self, signal: None }
    }
}

impl IntoFuture for &Fence {
    type Output = Result<()>;
    type IntoFuture = FenceFuture;

    /// Awaits a clone of the fence (two reference counts, no driver call).
    fn into_future(self) -> FenceFuture {
        self.clone().into_future()
    }
}

/// A `CUevent` recorded after a fence's work, owned: made by [`Fence::record_event`],
/// destroyed when dropped. Hand [`as_raw`](FenceEvent::as_raw) to your own
/// `cuStreamWaitEvent`, `cuEventSynchronize` or `cuEventQuery` (or another library's event
/// wait) while the `FenceEvent` is alive; do not destroy or re-record it.
///
/// The event is recorded on the fence's lane after the fenced work and whatever that lane
/// had been given before the call, so it completes at the fence's completion or later, never
/// earlier. When the fence was already known to be complete the event is left unrecorded,
/// which every wait and query treats as complete. It keeps the device's primary context
/// alive (not its buffers).
pub struct FenceEvent {
    event: CUevent,
    ctx: Arc<Context>,
}

// SAFETY: a CUevent is a driver handle any thread may use; the struct only carries it (and
// the context, itself Send + Sync).
unsafe impl Send for FenceEvent {}
// SAFETY: as above; nothing is mutated through `&self`.
unsafe impl Sync for FenceEvent {}

impl fmt::Debug for FenceEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FenceEvent").field("event", &self.event).finish()
    }
}

impl FenceEvent {
    /// The event, for the caller's driver calls. Valid while `self` is alive; the caller must
    /// not destroy it.
    pub fn as_raw(&self) -> CUevent {
        self.event
    }
}

impl Drop for FenceEvent {
    fn drop(&mut self) {
        // Destroying an event that waits were enqueued on is allowed: they keep what they
        // wait for. Nothing can be reported from a drop.
        if let Ok(raw) = self.ctx.bind() {
            let _ = release_retrying(|| raw.event_destroy(self.event));
        }
    }
}

impl Fence {
    /// Records a new `CUevent` after this fence's work, for other code to wait on (on the GPU
    /// with `cuStreamWaitEvent`, or on the host). `Ok(None)` for a fence with nothing to wait
    /// for ([`Fence::completed`]), which belongs to no device.
    ///
    /// The returned [`FenceEvent`] owns the event and destroys it when dropped. One
    /// `cuEventCreate` (plus a `cuEventRecord` unless the work is known to be done): make it
    /// once per fence handed on, not per copy.
    pub fn record_event(&self) -> Result<Option<FenceEvent>> {
        let Some((lanes, kind, seq)) = self.target() else { return Ok(None) };
        let raw = lanes.ctx().bind()?;
        let event = raw.event_create()?;
        let owned = FenceEvent { event, ctx: Arc::clone(lanes.ctx()) };
        lanes.lane(kind).record_after(seq, event)?;
        Ok(Some(owned))
    }
}

#[cfg(test)]
mod tests {
    use std::future::IntoFuture;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Context as TaskContext, Poll, Wake, Waker};

    use cuda_sys::{CUDA_ERROR_LAUNCH_FAILED, Fault};

    use crate::Fence;
    use crate::testing::model::{self, complete_all, with};

    /// A device of the model and a fence of an upload of `fill` into a new buffer, not yet
    /// complete (the model runs nothing until the host waits).
    fn pending_upload(fill: u8) -> (crate::Device, crate::ResidentBuffer, Fence) {
        let d = crate::testing::device(crate::testing::small_chunks());
        let b = d.allocate(4096).unwrap();
        let data = [fill; 4096];
        let mut batch = d.uploads();
        batch.write(b, 0, &data).unwrap();
        let fence = batch.submit().unwrap();
        assert!(!fence.is_complete().unwrap());
        (d, b, fence)
    }

    fn calls(d: &crate::Device, entry: &str) -> u64 {
        d.driver().faults().counts().get(entry).map_or(0, |c| c.calls)
    }

    #[derive(Default)]
    struct CountingWaker(AtomicUsize);

    impl Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_fence_already_complete_resolves_at_once_with_no_callback() {
        pollster::block_on(Fence::completed()).unwrap();
        let (d, b, fence) = pending_upload(5);
        d.driver().faults().record();
        fence.wait().unwrap();
        pollster::block_on(&fence).unwrap();
        pollster::block_on(fence).unwrap();
        assert_eq!(calls(&d, "cuStreamAddCallback"), 0);
        assert_eq!(d.download(b).unwrap(), vec![5u8; 4096]);
    }

    #[test]
    fn an_awaited_fence_resolves_when_the_gpu_completes_its_work() {
        let (d, b, fence) = pending_upload(9);
        let mut future = fence.into_future();
        let mut kicked = false;
        // The executor parks after the first poll; the model GPU then runs the work and the
        // driver's callback wakes it.
        let result = pollster::block_on(std::future::poll_fn(|cx| {
            let poll = std::pin::Pin::new(&mut future).poll(cx);
            if poll.is_pending() && !kicked {
                kicked = true;
                complete_all();
            }
            poll
        }));
        result.unwrap();
        assert!(kicked, "the fence was pending at the first poll");
        assert_eq!(d.download(b).unwrap(), vec![9u8; 4096]);
    }

    #[test]
    fn the_callback_wakes_the_latest_waker_once_and_a_dropped_future_does_not_block() {
        let (_d, _b, fence) = pending_upload(1);
        let (first, second) = (Arc::new(CountingWaker::default()), Arc::new(CountingWaker::default()));
        let mut future = (&fence).into_future();
        let mut pin = std::pin::Pin::new(&mut future);
        let waker = Waker::from(Arc::clone(&first));
        assert!(pin.as_mut().poll(&mut TaskContext::from_waker(&waker)).is_pending());
        let waker = Waker::from(Arc::clone(&second));
        assert!(pin.as_mut().poll(&mut TaskContext::from_waker(&waker)).is_pending());
        assert_eq!(second.0.load(Ordering::SeqCst), 0);
        complete_all();
        assert_eq!((first.0.load(Ordering::SeqCst), second.0.load(Ordering::SeqCst)), (0, 1));
        assert!(matches!(pin.as_mut().poll(&mut TaskContext::from_waker(&waker)), Poll::Ready(Ok(()))));

        // Dropped while pending: the callback still runs later, with nothing to wake.
        let (_d, _b, fence) = pending_upload(2);
        let mut future = fence.clone().into_future();
        let noop = Waker::noop();
        assert!(std::pin::Pin::new(&mut future).poll(&mut TaskContext::from_waker(noop)).is_pending());
        drop(future);
        complete_all();
        assert!(fence.is_complete().unwrap());
    }

    #[test]
    fn a_failure_resolves_to_the_drivers_error() {
        let (d, _b, fence) = pending_upload(3);
        d.driver().faults().inject(Fault::new("cuStreamAddCallback", 1, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
        let err = pollster::block_on(&fence).unwrap_err();
        assert!(err.to_string().contains("cuStreamAddCallback"), "{err}");

        // The work fails after the callback is enqueued: the query after the wake reports it.
        d.driver().faults().clear();
        let mut future = fence.into_future();
        let noop = Waker::noop();
        assert!(std::pin::Pin::new(&mut future).poll(&mut TaskContext::from_waker(noop)).is_pending());
        d.driver().faults().inject(Fault::new("cuEventQuery", 1, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
        complete_all();
        let err = pollster::block_on(future).unwrap_err();
        assert!(err.to_string().contains("cuEventQuery"), "{err}");
    }

    #[test]
    fn a_recorded_event_completes_after_the_fenced_work_and_is_destroyed_on_drop() {
        assert!(Fence::completed().record_event().unwrap().is_none());
        let (d, b, fence) = pending_upload(4);
        let event = fence.record_event().unwrap().expect("a fence of a device");
        let id = model::id(event.as_raw());
        // A host wait on the caller's copy of the event runs the fenced work.
        // SAFETY: the event is alive.
        let code = unsafe { cuda_sys::call!(d.driver(), cuEventSynchronize(event.as_raw())) }.unwrap();
        assert_eq!(code, cuda_sys::CUDA_SUCCESS);
        assert!(fence.is_complete().unwrap());
        assert_eq!(d.download(b).unwrap(), vec![4u8; 4096]);
        drop(event);
        assert!(with(|g| g.event_waits.contains(&id)));
        // Destroyed: the model no longer knows it.
        // SAFETY: a query of a handle the model answers for, live or not.
        let code = unsafe { cuda_sys::call!(d.driver(), cuEventQuery(id as cuda_sys::CUevent)) }.unwrap();
        assert_eq!(code, cuda_sys::CUDA_ERROR_INVALID_HANDLE);
        // Already complete: an unrecorded event, complete for every query.
        let done = fence.record_event().unwrap().unwrap();
        // SAFETY: the event is alive.
        let code = unsafe { cuda_sys::call!(d.driver(), cuEventQuery(done.as_raw())) }.unwrap();
        assert_eq!(code, cuda_sys::CUDA_SUCCESS);
    }

    #[test]
    fn the_lanes_wait_on_the_gpu_for_a_callers_event() {
        let d = crate::testing::device(crate::testing::small_chunks());
        let b = d.allocate(4096).unwrap();
        let mut src = d.pinned(4096).unwrap();
        src.fill(6);
        let driver = d.driver();
        let mut stream: cuda_sys::CUstream = std::ptr::null_mut();
        let mut event: cuda_sys::CUevent = std::ptr::null_mut();
        // SAFETY: outputs written on success; the copy's ranges are live (pinned source,
        // device buffer of 4096 bytes) until the host waits below.
        unsafe {
            assert_eq!(cuda_sys::call!(driver, cuStreamCreate(&mut stream, 1)).unwrap(), 0);
            assert_eq!(cuda_sys::call!(driver, cuEventCreate(&mut event, 0)).unwrap(), 0);
            let dst = d.device_ptr(b).unwrap();
            let code = cuda_sys::call!(driver, cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), 4096, stream));
            assert_eq!(code.unwrap(), 0);
            assert_eq!(cuda_sys::call!(driver, cuEventRecord(event, stream)).unwrap(), 0);
            d.wait_for_event(event).unwrap();
            assert_eq!(cuda_sys::call!(driver, cuEventDestroy_v2(event)).unwrap(), 0);
        }
        // The model runs the caller's copy only if the download's lane was told to wait.
        assert_eq!(d.download(b).unwrap(), vec![6u8; 4096]);
        // A failed wait is reported with its entry point.
        driver.faults().inject(Fault::new("cuStreamWaitEvent", 1, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
        let mut other: cuda_sys::CUevent = std::ptr::null_mut();
        // SAFETY: writes one handle on success.
        unsafe { cuda_sys::call!(driver, cuEventCreate(&mut other, 0)) }.unwrap();
        // SAFETY: a live event, never recorded.
        let err = unsafe { d.wait_for_event(other) }.unwrap_err();
        assert!(err.to_string().contains("cuStreamWaitEvent"), "{err}");
    }
}

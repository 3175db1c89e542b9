//! [`Fence`]: completion of submitted work, in one place: what a fence is and the one way
//! to make one ([`Fence::new`]: every transfer's fence), waiting for it on the host or on a
//! stream of the caller's, and handing its completion to other code (`completion`: awaited
//! as a [`FenceFuture`], or as a recorded event, [`FenceEvent`]).

mod completion;

pub use completion::{FenceEvent, FenceFuture};

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use cuda_sys::CUstream;

use crate::error::Result;
use crate::stream::{LaneKind, Lanes};

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
    /// The fence of submission `seq` on the `lane` of `lanes`: every fence of a transfer is
    /// made here.
    pub(crate) fn new(lanes: &Arc<Lanes>, lane: LaneKind, seq: u64) -> Fence {
        Fence { lanes: Some(Arc::clone(lanes)), lane, seq }
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
                lanes.ctx().bind()?;
                lanes.lane(self.lane).make_stream_wait(self.seq, stream).map(drop)
            }
        }
    }
}

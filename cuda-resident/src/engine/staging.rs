//! What a lane's batches reuse under the lane's batch lock: planner, plans, descriptor and
//! piece lists, and the lane's device staging.

use crate::alloc::ResidentBuffer;
use crate::device::Core;
use crate::error::Result;
use crate::plan::route::Span;
use crate::stream::LaneKind;

use super::host::Piece;

/// What a lane's batches reuse, used only under the lane's batch lock: the planner and its
/// plans, descriptor and piece lists, and the device staging where packed bytes and
/// descriptors land before the scatter (uploads) or where the gather collects them
/// (downloads), grown on demand.
#[derive(Default)]
pub(crate) struct DeviceStaging {
    pub(crate) region: DeviceRegion,
    pub(crate) planner: crate::plan::Planner,
    pub(crate) upload_plan: crate::plan::UploadPlan,
    pub(crate) readback_plan: crate::plan::ReadbackPlan,
    pub(crate) descriptors: Vec<crate::kernels::CopyDescriptor>,
    pub(crate) pieces: Vec<Piece>,
    /// The chunks of a batch cut by [`cut_apart`](crate::plan::route::cut_apart).
    pub(crate) spans: Vec<Span>,
}

/// A lane's device staging buffer.
#[derive(Default)]
pub(crate) struct DeviceRegion {
    buffer: Option<(ResidentBuffer, u64, u64)>,
}

impl DeviceRegion {
    /// The address of at least `len` bytes of device staging for `lane`, growing it if need
    /// be. Must be called under the lane's batch lock; `last_seq` is the lane's last
    /// submission, which may still use the old staging.
    pub(crate) fn ensure(&mut self, core: &Core, lane: LaneKind, len: u64, last_seq: u64) -> Result<u64> {
        if let Some((_, ptr, have)) = self.buffer
            && have >= len
        {
            return Ok(ptr);
        }
        let want = len.max(1 << 20).next_power_of_two();
        let new = core.allocate_for_library(want)?;
        let (ptr, _) = core.alloc.resolve(new)?;
        let staging = &core.telemetry.staging_bytes;
        staging.fetch_add(want, std::sync::atomic::Ordering::Relaxed);
        if let Some((old, _, old_len)) = self.buffer.replace((new, ptr, want)) {
            staging.fetch_sub(old_len, std::sync::atomic::Ordering::Relaxed);
            // Work already enqueued may still use it: free after that work.
            core.alloc.mark_used(old, lane.index(), last_seq)?;
            // A refused driver free is not this batch's failure: the memory stays listed
            // and the next trim retries it.
            let _ = core.alloc.free(old, &|last| core.is_known_idle(last));
        }
        Ok(ptr)
    }
}

//! Copies between host and device: the unsafe single-copy path over caller-pinned memory.
//!
//! Every copy is ordered against copies in flight in the other direction that touch the same
//! buffer (on the device, with `cuStreamWaitEvent`), and marks the buffer as used by its
//! submission so that freeing it waits for the copy.

use crate::alloc::ResidentBuffer;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::stream::{Fence, LaneKind};
use crate::telemetry::Telemetry;

impl Device {
    /// Checks that `[offset, offset + len)` lies in `buffer`; returns the buffer's device
    /// address of `offset`.
    pub(crate) fn checked_range(&self, buffer: ResidentBuffer, offset: u64, len: u64) -> Result<u64> {
        let (ptr, buffer_len) = self.core().alloc.resolve(buffer)?;
        match offset.checked_add(len) {
            Some(end) if end <= buffer_len => Ok(ptr + offset),
            _ => Err(Error::OutOfRange { buffer, offset, len, buffer_len }),
        }
    }

    /// Makes `lane` wait, on the device, for copies in flight in the other direction that
    /// use `buffer`. Call with the lane's stream inside its submission.
    fn order_after_other_lane(&self, lane: LaneKind, buffer: ResidentBuffer, stream: cuda_sys::CUstream) -> Result<()> {
        let other = match lane {
            LaneKind::Upload => LaneKind::Readback,
            LaneKind::Readback => LaneKind::Upload,
        };
        let last = self.core().alloc.last_use(buffer)?[other.index()];
        self.core().lane(other).make_stream_wait(last, stream)
    }

    /// Starts copying `len` bytes from host memory at `src` into `buffer` at `offset`, on the
    /// upload lane, and returns at once. [`Device::synchronize_uploads`] or the returned
    /// fence tells when it is done.
    ///
    /// # Safety
    ///
    /// `[src, src + len)` must be readable host memory that stays valid and unchanged until
    /// the copy completes. It should be pinned ([`Device::pin_host`], or memory from
    /// [`Device::pinned`]); pageable memory works but the driver then copies synchronously
    /// and slowly.
    pub unsafe fn upload_async_at(
        &self,
        buffer: ResidentBuffer,
        offset: u64,
        src: *const u8,
        len: usize,
    ) -> Result<Fence> {
        let dst = self.checked_range(buffer, offset, len as u64)?;
        let core = self.core();
        let lane = core.lane(LaneKind::Upload);
        let seq = lane.submit(Vec::new(), |raw, stream, seq| {
            core.alloc.mark_used(buffer, LaneKind::Upload.index(), seq)?;
            self.order_after_other_lane(LaneKind::Upload, buffer, stream)?;
            // SAFETY: dst..dst+len lies in a live buffer (checked above, and the buffer
            // cannot be reused before this submission completes since it is marked);
            // the caller vouches for the source.
            unsafe { raw.memcpy_htod_async(dst, src, len, stream) }
        })?;
        Telemetry::add(&core.telemetry.upload_submissions, 1);
        Telemetry::add(&core.telemetry.bytes_requested, len as u64);
        Telemetry::add(&core.telemetry.bytes_moved, len as u64);
        Telemetry::add(&core.telemetry.dma_copies, 1);
        Ok(Fence::new(self.clone(), LaneKind::Upload, seq))
    }

    /// Starts copying `len` bytes of `buffer` at `offset` into host memory at `dst`, on the
    /// readback lane, and returns at once; the bytes are there once the fence completes.
    ///
    /// # Safety
    ///
    /// `[dst, dst + len)` must be writable host memory that stays valid, and that nothing
    /// reads or writes, until the copy completes. It should be pinned, as for
    /// [`Device::upload_async_at`].
    pub unsafe fn download_async_at(
        &self,
        buffer: ResidentBuffer,
        offset: u64,
        dst: *mut u8,
        len: usize,
    ) -> Result<Fence> {
        let src = self.checked_range(buffer, offset, len as u64)?;
        let core = self.core();
        let lane = core.lane(LaneKind::Readback);
        let seq = lane.submit(Vec::new(), |raw, stream, seq| {
            core.alloc.mark_used(buffer, LaneKind::Readback.index(), seq)?;
            self.order_after_other_lane(LaneKind::Readback, buffer, stream)?;
            // SAFETY: the source lies in a live, marked buffer; the caller vouches for dst.
            unsafe { raw.memcpy_dtoh_async(dst, src, len, stream) }
        })?;
        Telemetry::add(&core.telemetry.readback_submissions, 1);
        Telemetry::add(&core.telemetry.bytes_requested, len as u64);
        Telemetry::add(&core.telemetry.bytes_moved, len as u64);
        Telemetry::add(&core.telemetry.dma_copies, 1);
        Ok(Fence::new(self.clone(), LaneKind::Readback, seq))
    }

    /// Blocks until every upload submitted so far has completed.
    pub fn synchronize_uploads(&self) -> Result<()> {
        self.core().lane(LaneKind::Upload).synchronize().map(|_| ())
    }

    /// Page-locks `[ptr, ptr + len)` of host memory for fast, asynchronous copies
    /// (`cuMemHostRegister`, portable).
    ///
    /// # Safety
    ///
    /// The range must be mapped host memory that stays mapped until [`Device::unpin_host`].
    pub unsafe fn pin_host(&self, ptr: *mut u8, len: usize) -> Result<()> {
        let raw = self.core().ctx.bind()?;
        // SAFETY: as the caller promises.
        unsafe { raw.mem_host_register(ptr, len) }
    }

    /// Undoes [`Device::pin_host`].
    ///
    /// # Safety
    ///
    /// `ptr` must be the start of a range pinned with `pin_host`, and no copy in flight may
    /// use it.
    pub unsafe fn unpin_host(&self, ptr: *mut u8) -> Result<()> {
        let raw = self.core().ctx.bind()?;
        // SAFETY: as the caller promises.
        unsafe { raw.mem_host_unregister(ptr) }
    }
}

//! Single copies: one range between host and device. The asynchronous copies over memory
//! the caller pinned (one DMA each), pinning host memory, and large reads pipelined through
//! a ring of pinned chunks.
//!
//! Every copy is ordered against copies in flight in the other direction that touch the same
//! bytes (on the device, with `cuStreamWaitEvent`; `engine::order`), and marks the buffer as
//! used by its submission so that freeing it waits for the copy.

use std::sync::Arc;

use crate::alloc::ResidentBuffer;
use crate::engine::core::Core;
use crate::engine::{Enqueue, Exec};
use crate::error::{Error, Result};
use crate::fence::Fence;
use crate::stream::LaneKind;

/// The work of [`Device::upload_async_at`](crate::Device::upload_async_at).
///
/// # Safety
/// As for [`Device::upload_async_at`](crate::Device::upload_async_at).
pub(crate) unsafe fn upload_async_at(
    core: &Arc<Core>,
    buffer: ResidentBuffer,
    offset: u64,
    src: *const u8,
    len: usize,
) -> Result<Fence> {
    let host = ("Device::upload_async_at", src);
    single_copy(core, LaneKind::Upload, buffer, offset, len, host, |q, dst| {
        // SAFETY: dst..dst+len lies in a live buffer (checked, and marked so that it is
        // not reused before this copy completes); the caller vouches for the source.
        unsafe { q.htod(dst, src, len) }
    })
}

/// The largest blocking upload ([`Device::upload_at`](crate::Device::upload_at),
/// [`Device::upload`](crate::Device::upload)) handed to the driver as the caller gave it
/// ([`upload_now`]); larger ones are staged by the batch path, which pipelines them. On the
/// H200 the driver's own pageable path was as fast as the library's staging or faster up to
/// 16 KiB, and slower at 64 KiB (docs/runs/2026-12-02-h200-ab-d1303c8.md).
pub(crate) const DRIVER_STAGED_MOST: usize = 16 << 10;

/// A small blocking upload: `data` goes to the driver as it is, by one `cuMemcpyHtoDAsync`
/// on the upload lane (ordered and claimed as any copy), then waited for. From pageable
/// memory the driver copies the bytes into its own staging before the call returns (small
/// ones travel with the command), so no pinned lease or host copy of the library's is
/// needed. From pinned memory the DMA reads `data` after the call returns: `data` stays
/// borrowed until the wait returns, so it outlives the read (and where the lane cannot
/// record the copy's event, the submission waits for the stream before it returns). Where
/// the submission or the wait fails, the lane is settled before the error returns
/// ([`Lane::settle`](crate::stream::Lane::settle)), so no copy reads `data` afterwards.
pub(crate) fn upload_now(core: &Arc<Core>, buffer: ResidentBuffer, offset: u64, data: &[u8]) -> Result<()> {
    let len = data.len();
    let address = core.checked_range(buffer, offset, len as u64)?;
    if len == 0 {
        return Ok(());
    }
    let mut exec = Exec::begin(core, LaneKind::Upload);
    exec.claim_ranges(std::iter::once(buffer), 1, |r| r.push(address, len as u64))?;
    exec.requested(len as u64);
    let submitted = exec.submit(Vec::new(), |q| {
        // SAFETY: the destination lies in a live buffer (checked, and claimed so that it is
        // not reused before this copy completes); `data` is readable and stays borrowed
        // until the copy is known done, below.
        unsafe { q.htod(address, data.as_ptr(), len) }
    });
    let done = submitted.and_then(|_| exec.finish().wait());
    if done.is_err() {
        // The copy may still be queued (its event or its wait failed), and `data` is
        // borrowed only until this returns: the lane is settled first, so that no copy
        // reads the caller's memory (pinned memory is read by the DMA itself) afterwards.
        let _ = core.lane(LaneKind::Upload).settle();
    }
    done
}

/// The work of [`Device::download_async_at`](crate::Device::download_async_at).
///
/// # Safety
/// As for [`Device::download_async_at`](crate::Device::download_async_at).
pub(crate) unsafe fn download_async_at(
    core: &Arc<Core>,
    buffer: ResidentBuffer,
    offset: u64,
    dst: *mut u8,
    len: usize,
) -> Result<Fence> {
    let host = ("Device::download_async_at", dst.cast_const());
    single_copy(core, LaneKind::Download, buffer, offset, len, host, |q, src| {
        // SAFETY: the source lies in a live, marked buffer; the caller vouches for dst.
        unsafe { q.dtoh(dst, src, len) }
    })
}

/// The work of [`Device::download_to_slice`](crate::Device::download_to_slice).
pub(crate) fn download_to_slice(
    core: &Arc<Core>,
    buffer: ResidentBuffer,
    offset: u64,
    out: &mut [u8],
) -> Result<()> {
    let mut reads = [super::slices::SliceRead { buffer, offset, out }];
    super::slices::download_to_slices(core, &mut reads)
}

/// The work of [`Device::synchronize_uploads`](crate::Device::synchronize_uploads).
pub(crate) fn synchronize_uploads(core: &Arc<Core>) -> Result<()> {
    core.lane(LaneKind::Upload).synchronize().map(|_| ())
}

/// The work of [`Device::synchronize_downloads`](crate::Device::synchronize_downloads).
pub(crate) fn synchronize_downloads(core: &Arc<Core>) -> Result<()> {
    core.lane(LaneKind::Download).synchronize().map(|_| ())
}

/// The work of [`Device::pin_host`](crate::Device::pin_host).
///
/// # Safety
/// As for [`Device::pin_host`](crate::Device::pin_host).
pub(crate) unsafe fn pin_host(core: &Arc<Core>, ptr: *mut u8, len: usize) -> Result<()> {
    if len == 0 {
        return Err(Error::EmptyHostRange { operation: "Device::pin_host", address: ptr as usize });
    }
    let raw = core.ctx.bind()?;
    // SAFETY: as the caller promises.
    unsafe { raw.mem_host_register(ptr, len, 0) }
}

/// The work of [`Device::unpin_host`](crate::Device::unpin_host).
///
/// # Safety
/// As for [`Device::unpin_host`](crate::Device::unpin_host).
pub(crate) unsafe fn unpin_host(core: &Arc<Core>, ptr: *mut u8) -> Result<()> {
    let raw = core.ctx.bind()?;
    // SAFETY: as the caller promises.
    unsafe { raw.mem_host_unregister(ptr) }
}

/// Fails with [`Error::NotPinned`] unless all of `[ptr, ptr + len)` is pinned host
/// memory: walks the pinned allocations from the start (the one holding the first byte,
/// then the one holding the first byte past it, ...) until the end is covered, so that a
/// pageable hole between two pinned regions is found; the error names the first unpinned
/// byte. One lookup when the first byte's allocation covers the range.
fn check_pinned(core: &Core, operation: &'static str, ptr: *const u8, len: usize) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    let raw = core.ctx.bind()?;
    let not_pinned =
        |byte: u64| Error::NotPinned { operation, address: ptr as usize, len, unpinned: byte as usize };
    // A range that wraps the address space is not host memory anyone pinned.
    let end = (ptr as u64).checked_add(len as u64).ok_or_else(|| not_pinned(u64::MAX))?;
    let mut at = ptr as u64;
    while at < end {
        match raw.pinned_extent(at as usize as *const u8)? {
            Some((start, bytes)) if start <= at && start.saturating_add(bytes) > at => {
                at = start.saturating_add(bytes);
            }
            // Pinned, but the driver gave no extent that holds the byte: no walk is
            // possible from here; the last byte is checked, as the driver allows.
            Some(_) => {
                let last = end - 1;
                return match raw.pinned_extent(last as usize as *const u8)? {
                    Some(_) => Ok(()),
                    None => Err(not_pinned(last)),
                };
            }
            None => return Err(not_pinned(at)),
        }
    }
    Ok(())
}

/// One DMA between host memory at `host.1` (for `host.0`, an operation's name) and
/// `[offset, offset + len)` of `buffer` on `kind`'s lane: checks the range and that the
/// host memory is pinned, claims the buffer, lets `copy` enqueue the DMA given the
/// buffer's device address of `offset`, and counts it.
fn single_copy(
    core: &Arc<Core>,
    kind: LaneKind,
    buffer: ResidentBuffer,
    offset: u64,
    len: usize,
    host: (&'static str, *const u8),
    copy: impl FnOnce(&mut Enqueue<'_>, u64) -> Result<()>,
) -> Result<Fence> {
    let address = core.checked_range(buffer, offset, len as u64)?;
    if len == 0 {
        // Nothing to copy: no driver call, and a fence that is already complete.
        return Ok(Fence::completed());
    }
    // Pinned memory of this crate the caller can reach (a PinnedBuffer, a batch download's
    // views; of any device's pool) stays out of its pool until the copy
    // completes, even if the buffer is dropped first: held from before the check on.
    let keep = crate::host_pool::listed_leases_in(host.1 as usize, len);
    check_pinned(core, host.0, host.1, len)?;
    let mut exec = Exec::begin(core, kind);
    exec.claim_ranges(std::iter::once(buffer), 1, |r| r.push(address, len as u64))?;
    exec.requested(len as u64);
    exec.submit(keep, |q| copy(q, address))?;
    Ok(exec.finish())
}

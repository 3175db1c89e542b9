//! Copies between host and device: the unsafe single-copy path over caller-pinned memory.
//!
//! Every copy is ordered against copies in flight in the other direction that touch the same
//! buffer (on the device, with `cuStreamWaitEvent`), and marks the buffer as used by its
//! submission so that freeing it waits for the copy.

mod pipeline;
mod prepared;
mod readback;
mod upload;

pub use prepared::{PreparedReadbacks, PreparedUploads};
pub use readback::{PendingReadback, Readback, ReadbackBatch, Slot};
pub use upload::UploadBatch;
pub(crate) use upload::{RING, UploadParts};

use std::sync::Arc;

use crate::alloc::ResidentBuffer;
use crate::device::Core;
use crate::device::Device;
use crate::engine::{Enqueue, Exec};
use crate::error::{Error, Result};
use crate::plan::route::{Apart, PIPELINE_DEPTH, Route, Span, pipeline_chunk};
use crate::stream::{Fence, LaneKind};

impl Device {
    /// Checks that `[offset, offset + len)` lies in `buffer`; returns the buffer's device
    /// address of `offset`.
    pub(crate) fn checked_range(&self, buffer: ResidentBuffer, offset: u64, len: u64) -> Result<u64> {
        self.core().checked_range(buffer, offset, len)
    }

    /// Starts copying `len` bytes from host memory at `src` into `buffer` at `offset`, on the
    /// upload lane, and returns at once. [`Device::synchronize_uploads`] or the returned
    /// fence tells when it is done. A copy of 0 bytes (whose range is still checked) calls
    /// no driver entry point and returns a fence that is already complete.
    ///
    /// # Safety
    ///
    /// `[src, src + len)` must be readable host memory that stays valid and unchanged until
    /// the copy completes. (A [`PinnedBuffer`](crate::PinnedBuffer), or the
    /// [`Readback`](crate::Readback) of a batch whose view it is, may be dropped before
    /// then: the copy keeps that memory. Not so a prepared set's readback.)
    ///
    /// # Errors
    ///
    /// [`Error::NotPinned`] (nothing enqueued) when the range is not pinned: pin it with
    /// [`Device::pin_host`] or use memory from [`Device::pinned`]. Every byte is checked
    /// where the driver reports the extent of pinned regions, as it does for `cuMemHostAlloc`
    /// and `cuMemHostRegister` (a range over two pinned regions with a pageable gap between
    /// them is refused); where it does not, the first and last byte. Pinned memory of
    /// this crate (a [`PinnedBuffer`](crate::PinnedBuffer), a batch readback's views, of any
    /// device) is kept out of its pool until the copy completes, even if its holder is
    /// dropped first. Managed memory (`cuMemAllocManaged`) is not pinned
    /// host memory and is refused too.
    pub unsafe fn upload_async_at(
        &self,
        buffer: ResidentBuffer,
        offset: u64,
        src: *const u8,
        len: usize,
    ) -> Result<Fence> {
        let host = ("Device::upload_async_at", src);
        self.single_copy(LaneKind::Upload, buffer, offset, len, host, |q, dst| {
            // SAFETY: dst..dst+len lies in a live buffer (checked, and marked so that it is
            // not reused before this copy completes); the caller vouches for the source.
            unsafe { q.htod(dst, src, len) }
        })
    }

    /// Starts copying `len` bytes of `buffer` at `offset` into host memory at `dst`, on the
    /// readback lane, and returns at once; the bytes are there once the fence completes.
    /// A copy of 0 bytes (whose range is still checked) calls no driver entry point and
    /// returns a fence that is already complete.
    ///
    /// # Safety
    ///
    /// `[dst, dst + len)` must be writable host memory that stays valid, and that nothing
    /// reads or writes, until the copy completes. It must be pinned, as for
    /// [`Device::upload_async_at`] ([`Error::NotPinned`] otherwise).
    pub unsafe fn download_async_at(
        &self,
        buffer: ResidentBuffer,
        offset: u64,
        dst: *mut u8,
        len: usize,
    ) -> Result<Fence> {
        let host = ("Device::download_async_at", dst.cast_const());
        self.single_copy(LaneKind::Readback, buffer, offset, len, host, |q, src| {
            // SAFETY: the source lies in a live, marked buffer; the caller vouches for dst.
            unsafe { q.dtoh(dst, src, len) }
        })
    }

    /// Fails with [`Error::NotPinned`] unless all of `[ptr, ptr + len)` is pinned host
    /// memory: walks the pinned allocations from the start (the one holding the first byte,
    /// then the one holding the first byte past it, ...) until the end is covered, so that a
    /// pageable hole between two pinned regions is found; the error names the first unpinned
    /// byte. One lookup when the first byte's allocation covers the range.
    fn check_pinned(&self, operation: &'static str, ptr: *const u8, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let raw = self.core().ctx.bind()?;
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
        &self,
        kind: LaneKind,
        buffer: ResidentBuffer,
        offset: u64,
        len: usize,
        host: (&'static str, *const u8),
        copy: impl FnOnce(&mut Enqueue<'_>, u64) -> Result<()>,
    ) -> Result<Fence> {
        let address = self.checked_range(buffer, offset, len as u64)?;
        if len == 0 {
            // Nothing to copy: no driver call, and a fence that is already complete.
            return Ok(Fence::completed());
        }
        // Pinned memory of this crate the caller can reach (a PinnedBuffer, a batch readback's
        // views; of any device's pool) stays out of its pool until the copy
        // completes, even if the buffer is dropped first: held from before the check on.
        let keep = crate::host_pool::listed_leases_in(host.1 as usize, len);
        self.check_pinned(host.0, host.1, len)?;
        let mut exec = Exec::begin(self.core(), kind);
        exec.claim(std::iter::once(buffer), 1)?;
        exec.requested(len as u64);
        exec.submit(keep, |q| copy(q, address))?;
        Ok(exec.finish())
    }

    /// Uploads `data` as the whole contents of `buffer` and waits until it has landed.
    ///
    /// # Errors
    /// [`Error::UploadLength`] (nothing moved) unless `data` is exactly as long as the buffer:
    /// a shorter slice would leave the buffer's tail as it was, which is rarely what a caller
    /// of a whole-buffer upload means. Use [`Device::upload_at`] for a partial write.
    pub fn upload(&self, buffer: ResidentBuffer, data: &[u8]) -> Result<()> {
        self.upload_many(&[(buffer, data)])
    }

    /// Uploads `data` to `buffer` at `offset` and waits until it has landed.
    pub fn upload_at(&self, buffer: ResidentBuffer, offset: u64, data: &[u8]) -> Result<()> {
        let mut batch = self.uploads();
        batch.write(buffer, offset, data)?;
        batch.submit()?.wait()
    }

    /// Uploads each `(buffer, data)` as the whole contents of its buffer, as one batch, and
    /// waits.
    ///
    /// # Errors
    /// [`Error::UploadLength`] (nothing moved) unless every `data` is exactly as long as its
    /// buffer, as for [`Device::upload`]; [`Device::upload_at_many`] writes parts.
    pub fn upload_many(&self, writes: &[(ResidentBuffer, &[u8])]) -> Result<()> {
        for &(buffer, data) in writes {
            let buffer_len = self.buffer_len(buffer)?;
            if data.len() as u64 != buffer_len {
                return Err(Error::UploadLength { buffer, buffer_len, data_len: data.len() });
            }
        }
        let mut batch = self.uploads();
        for &(buffer, data) in writes {
            batch.write(buffer, 0, data)?;
        }
        batch.submit()?.wait()
    }

    /// Uploads each `(buffer, offset, data)`, as one batch (later writes win where they
    /// overlap), and waits.
    pub fn upload_at_many(&self, writes: &[(ResidentBuffer, u64, &[u8])]) -> Result<()> {
        let mut batch = self.uploads();
        for &(buffer, offset, data) in writes {
            batch.write(buffer, offset, data)?;
        }
        batch.submit()?.wait()
    }

    /// The whole buffer, read back.
    pub fn download(&self, buffer: ResidentBuffer) -> Result<Vec<u8>> {
        let len = self.buffer_len(buffer)?;
        self.download_range(buffer, 0, len)
    }

    /// `len` bytes of `buffer` at `offset`, read back.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] when the range does not lie in the buffer (`offset + len`
    /// overflowing included), checked before any host memory is reserved for the result.
    pub fn download_range(&self, buffer: ResidentBuffer, offset: u64, len: u64) -> Result<Vec<u8>> {
        // The range first: a length of `u64::MAX` is a bad range, not a host out of memory.
        self.checked_range(buffer, offset, len)?;
        if len <= self.config().chunk_bytes.saturating_mul(4) {
            return Ok(self.download_ranges(&[(buffer, offset, len)])?.pop().unwrap_or_default());
        }
        let mut out = zeroed_vec(len)?;
        self.read_into_slice(buffer, offset, &mut out)?;
        Ok(out)
    }

    /// Reads `out.len()` bytes of `buffer` at `offset` into `out`, pipelined through a ring
    /// of pinned chunks: chunk `k + 1` is on the wire while chunk `k` is unpacked by the
    /// packing threads. For large ranges; any size works.
    pub fn read_into_slice(&self, buffer: ResidentBuffer, offset: u64, out: &mut [u8]) -> Result<()> {
        let len = out.len() as u64;
        let src = self.checked_range(buffer, offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let core = self.core();
        let chunk = pipeline_chunk(self.config().chunk_bytes, len, PIPELINE_DEPTH);
        let chunks = len.div_ceil(chunk) as usize;
        let mut exec = Exec::begin(core, LaneKind::Readback);
        exec.claim(std::iter::once(buffer), chunks as u64)?;
        exec.requested(len);
        // The ring's leases are all taken before any copy of this read is in flight to wait
        // for: the first waits for room as any staging does, the others take only what is
        // free (the cap may hold as few as two chunks, and the caller may hold staging too).
        let most = chunks.min(upload::RING).min(core.pinned.leases_within_cap(chunk));
        let mut ring = vec![Arc::new(exec.lease(chunk as usize)?)];
        while ring.len() < most {
            match core.pinned.try_acquire(chunk as usize)? {
                Some(lease) => ring.push(Arc::new(lease)),
                None => break,
            }
        }
        let ring_len = ring.len();
        let mut seqs = Vec::with_capacity(chunks);
        let mut pieces = Vec::new();
        let mut unpack = |k: usize, seqs: &[u64], out: &mut [u8]| -> Result<()> {
            crate::engine::wait(core, LaneKind::Readback, seqs[k])?;
            let start = k as u64 * chunk;
            let n = (len - start).min(chunk) as usize;
            pieces.clear();
            let dst = out[start as usize..][..n].as_mut_ptr();
            Piece::push_split(&mut pieces, Piece { dst, src: ring[k % ring_len].as_ptr(), len: n });
            // SAFETY: the chunk's DMA completed (waited above); the ring lease and `out`
            // are disjoint and hold n bytes at these places.
            unsafe { Piece::copy_out_all(core, &pieces) };
            Ok(())
        };
        for k in 0..chunks {
            if k >= ring_len {
                unpack(k - ring_len, &seqs, out)?;
            }
            let lease = &ring[k % ring_len];
            let start = k as u64 * chunk;
            let n = (len - start).min(chunk) as usize;
            let dst = lease.as_ptr();
            seqs.push(exec.submit(vec![Arc::clone(lease)], |q| {
                // SAFETY: a range of a live, marked buffer into a pinned lease of >= n bytes
                // that this submission keeps alive.
                unsafe { q.dtoh(dst, src + start, n) }
            })?);
        }
        let ended = exec.end();
        for k in chunks.saturating_sub(ring_len)..chunks {
            unpack(k, &seqs, out)?;
        }
        ended.record();
        Ok(())
    }

    /// Each whole buffer, read back as one batch (of any size: a batch larger than the
    /// pinned pool streams through it, see [`ReadbackBatch`](crate::ReadbackBatch), each
    /// chunk copied into the result vectors as it lands).
    pub fn download_many(&self, buffers: &[ResidentBuffer]) -> Result<Vec<Vec<u8>>> {
        let mut out = vec![Vec::new(); buffers.len()];
        self.read_many_into(buffers, &mut out)?;
        Ok(out)
    }

    /// [`Device::download_many`] into `out` (one vector a buffer); the route the batch took.
    pub(crate) fn read_many_into(&self, buffers: &[ResidentBuffer], out: &mut [Vec<u8>]) -> Result<Route> {
        let mut batch = self.readbacks();
        batch.read_many(buffers)?;
        batch.submit_into_as(out, false)
    }

    /// Each `(buffer, offset, len)` range, read back as one batch (of any size, as
    /// [`Device::download_many`]).
    pub fn download_ranges(&self, ranges: &[(ResidentBuffer, u64, u64)]) -> Result<Vec<Vec<u8>>> {
        let mut out = vec![Vec::new(); ranges.len()];
        self.read_ranges_into(ranges, &mut out, false)?;
        Ok(out)
    }

    /// Reads each `(buffer, offset, len)` range into the caller's vector of the same index,
    /// replacing its contents and reusing its capacity; one batch (of any size, as
    /// [`Device::download_many`]), one wait.
    pub fn download_into(&self, ranges: &[(ResidentBuffer, u64, u64)], out: &mut [Vec<u8>]) -> Result<()> {
        if ranges.len() != out.len() {
            return Err(Error::LengthMismatch {
                what: "download_into ranges and output vectors",
                left: ranges.len(),
                right: out.len(),
            });
        }
        self.read_ranges_into(ranges, out, true).map(drop)
    }

    /// The ranges read into `out` as one batch ([`ReadbackBatch::submit_into`], `pipelined`
    /// or not); the route the batch took.
    pub(crate) fn read_ranges_into(
        &self,
        ranges: &[(ResidentBuffer, u64, u64)],
        out: &mut [Vec<u8>],
        pipelined: bool,
    ) -> Result<Route> {
        let mut batch = self.readbacks();
        for &(b, o, l) in ranges {
            batch.read(b, o, l)?;
        }
        batch.submit_into_as(out, pipelined)
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
    ///
    /// # Errors
    /// [`Error::EmptyHostRange`] for `len == 0` (the driver call is not made); the driver's
    /// error otherwise.
    pub unsafe fn pin_host(&self, ptr: *mut u8, len: usize) -> Result<()> {
        if len == 0 {
            return Err(Error::EmptyHostRange { operation: "Device::pin_host", address: ptr as usize });
        }
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

/// A vector of `len` zero bytes, or an error instead of an abort when the host cannot give
/// that much. Large zeroed allocations come from the OS already zero, so this costs no
/// memset (unlike `resize`): the pages are touched first by whatever fills the vector.
fn zeroed_vec(len: u64) -> Result<Vec<u8>> {
    let oom = || Error::HostOutOfMemory { bytes: len };
    let n = usize::try_from(len).map_err(|_| oom())?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(n).map_err(|_| oom())?;
    // SAFETY: the layout has a non-zero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(oom());
    }
    // SAFETY: ptr was allocated by the global allocator with exactly this layout (size n,
    // align 1), and all n bytes are initialised (zero).
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

/// The buffers a batch names, each resolved once: key (index) -> handle, address, length.
///
/// A table is reused by the device's next batches, and keeps what the last batch resolved:
/// the next batch takes a handle's address and length from there, without the allocator's
/// lock, as long as the allocator has freed nothing since ([`Allocator::validity`]). A
/// handle freed while a batch is built fails the batch at submit, where every buffer is
/// checked again (`Device::claim`).
///
/// [`Allocator::validity`]: crate::alloc::Allocator::validity
#[derive(Default)]
pub(crate) struct BufferTable {
    pub(crate) entries: Vec<Resolved>,
    /// Open addressing over `entries`: `index + 1`, 0 for empty. Length a power of two.
    slots: Vec<u32>,
    /// The allocator's validity when this batch resolved its first buffer.
    validity: Option<(u32, u64)>,
    /// The last batch's entries and slots, and the validity they were resolved under.
    kept: Vec<Resolved>,
    kept_slots: Vec<u32>,
    kept_validity: Option<(u32, u64)>,
    /// Whether the requests so far can skip the planner, and their layout if so.
    pub(crate) apart: Apart,
}

/// A buffer as the batch saw it when it was named.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Resolved {
    pub(crate) buffer: ResidentBuffer,
    pub(crate) ptr: u64,
    pub(crate) len: u64,
    /// The end plus one of the batch's last request to this buffer, 0 for none
    /// ([`Apart`]).
    next: u64,
}

impl crate::recycle::Reusable for BufferTable {
    fn clear(&mut self) {
        // A table grown by a batch of very many buffers is not kept for small ones: zeroing
        // it would cost each of them.
        if self.slots.len() > 1 << 16 {
            *self = BufferTable::default();
            return;
        }
        // This batch's buffers become the ones kept; the vectors kept before are emptied for
        // the next batch.
        std::mem::swap(&mut self.entries, &mut self.kept);
        std::mem::swap(&mut self.slots, &mut self.kept_slots);
        self.kept_validity = self.validity.take();
        self.entries.clear();
        self.slots.fill(0);
        self.apart.clear();
    }
}

#[cfg(test)]
thread_local! {
    /// Buffers this thread's batches took from what an earlier batch resolved.
    pub(crate) static KEPT_HITS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The key of `buffer` in a table's `entries` and `slots`, or the empty slot where it would
/// go. `slots` must have an empty slot.
#[inline]
fn probe_in(entries: &[Resolved], slots: &[u32], buffer: ResidentBuffer) -> std::result::Result<u32, usize> {
    let mask = slots.len() - 1;
    let mut at = (buffer.mix() >> 32) as usize & mask;
    loop {
        match slots[at] {
            0 => return Err(at),
            k if entries[k as usize - 1].buffer == buffer => return Ok(k - 1),
            _ => at = (at + 1) & mask,
        }
    }
}

impl BufferTable {
    /// The key of `buffer`, resolving it on first sight.
    pub(crate) fn key(&mut self, device: &Device, buffer: ResidentBuffer) -> Result<(u32, Resolved)> {
        if self.entries.len() * 2 >= self.slots.len() {
            self.grow();
        }
        let at = match self.probe(buffer) {
            Ok(key) => return Ok((key, self.entries[key as usize])),
            Err(empty) => empty,
        };
        let alloc = &device.core().alloc;
        let now = alloc.validity();
        // Read before anything this batch resolves: a free after it invalidates them all.
        self.validity.get_or_insert(now);
        // Frees only count up: unchanged since the last batch began, unchanged since this
        // one did.
        let kept = (self.kept_validity == Some(now) && !self.kept_slots.is_empty())
            .then(|| probe_in(&self.kept, &self.kept_slots, buffer).ok())
            .flatten();
        let resolved = match kept {
            Some(k) => {
                #[cfg(test)]
                KEPT_HITS.with(|n| n.set(n.get() + 1));
                Resolved { next: 0, ..self.kept[k as usize] }
            }
            None => {
                let (ptr, len) = alloc.resolve(buffer)?;
                Resolved { buffer, ptr, len, next: 0 }
            }
        };
        self.entries.push(resolved);
        self.slots[at] = self.entries.len() as u32;
        Ok((self.entries.len() as u32 - 1, resolved))
    }

    /// The key of `buffer` if the table has it, else the empty slot where it would go. The
    /// table must have a slot.
    #[inline]
    fn probe(&self, buffer: ResidentBuffer) -> std::result::Result<u32, usize> {
        probe_in(&self.entries, &self.slots, buffer)
    }

    /// The key of `buffer` if the table has it: the hot path of [`BufferTable::check`].
    #[inline]
    fn find(&self, buffer: ResidentBuffer) -> Option<u32> {
        if self.slots.is_empty() { None } else { self.probe(buffer).ok() }
    }

    /// The key and length of `buffer`, after checking that `[offset, offset + len)` lies in
    /// it. A failure is also kept in `first_error` (when it holds none yet): it fails the
    /// batch at submit.
    #[inline]
    pub(crate) fn check(
        &mut self,
        device: &Device,
        buffer: ResidentBuffer,
        offset: u64,
        len: u64,
        first_error: &mut Option<Error>,
    ) -> Result<(u32, u64)> {
        // A buffer seen before and a range inside it: no error value is built or moved.
        if let Some(key) = self.find(buffer) {
            let entry = &mut self.entries[key as usize];
            if offset.checked_add(len).is_some_and(|end| end <= entry.len) {
                self.apart.note(&mut entry.next, entry.ptr, offset, len);
                return Ok((key, entry.len));
            }
        }
        let (key, buffer_len) = self.check_slow(device, buffer, offset, len, first_error)?;
        let entry = &mut self.entries[key as usize];
        self.apart.note(&mut entry.next, entry.ptr, offset, len);
        Ok((key, buffer_len))
    }

    /// [`BufferTable::check`] for a buffer seen first or a bad range.
    #[cold]
    fn check_slow(
        &mut self,
        device: &Device,
        buffer: ResidentBuffer,
        offset: u64,
        len: u64,
        first_error: &mut Option<Error>,
    ) -> Result<(u32, u64)> {
        let checked = self.key(device, buffer).and_then(|(key, resolved)| match offset.checked_add(len) {
            Some(end) if end <= resolved.len => Ok((key, resolved.len)),
            _ => Err(Error::OutOfRange { buffer, offset, len, buffer_len: resolved.len }),
        });
        if let Err(e) = &checked
            && first_error.is_none()
        {
            *first_error = Some(e.clone());
        }
        checked
    }

    fn grow(&mut self) {
        let size = (self.slots.len() * 2).max(64);
        self.slots = vec![0; size];
        let mask = size - 1;
        for (i, e) in self.entries.iter().enumerate() {
            let mut at = (e.buffer.mix() >> 32) as usize & mask;
            while self.slots[at] != 0 {
                at = (at + 1) & mask;
            }
            self.slots[at] = i as u32 + 1;
        }
    }

    pub(crate) fn buffers(&self) -> impl Iterator<Item = ResidentBuffer> + '_ {
        self.entries.iter().map(|e| e.buffer)
    }
}

/// One host memcpy of packing or unpacking.
#[derive(Clone, Copy)]
pub(crate) struct Piece {
    pub(crate) dst: *mut u8,
    pub(crate) src: *const u8,
    pub(crate) len: usize,
}

// SAFETY: a piece is two addresses and a length; the code that builds pieces guarantees
// that the ranges are valid and that no two pieces' destinations overlap.
unsafe impl Send for Piece {}
// SAFETY: as above; pieces are only read.
unsafe impl Sync for Piece {}

/// Pieces larger than this are split for the packing threads.
const PIECE_SPLIT: usize = 256 << 10;
/// Below this many bytes in all, one thread copies (waking the pool costs more).
pub(crate) const PARALLEL_MIN: usize = 1 << 20;

impl Piece {
    /// Appends `piece`, split into parts of at most [`PIECE_SPLIT`] bytes.
    pub(crate) fn push_split(out: &mut Vec<Piece>, piece: Piece) {
        let mut done = 0;
        while done < piece.len {
            let len = (piece.len - done).min(PIECE_SPLIT);
            // SAFETY: offsets stay inside the piece's ranges.
            out.push(unsafe { Piece { dst: piece.dst.add(done), src: piece.src.add(done), len } });
            done += len;
        }
    }

    /// Performs every piece, in parallel on the device's packing threads when there is
    /// enough to do.
    ///
    /// # Safety
    /// Each piece's source must be readable and its destination writable for `len` bytes,
    /// and no destination may overlap another piece's source or destination.
    pub(crate) unsafe fn copy_all(core: &Core, pieces: &[Piece]) {
        // SAFETY: as the caller promises.
        unsafe { Piece::run_all(core, pieces, std::ptr::copy_nonoverlapping::<u8>) }
    }

    /// [`Piece::copy_all`] out of landed staging into the caller's memory
    /// ([`crate::hostcopy::copy_out`]: streaming stores for long pieces).
    ///
    /// # Safety
    /// As [`Piece::copy_all`].
    pub(crate) unsafe fn copy_out_all(core: &Core, pieces: &[Piece]) {
        // SAFETY: as the caller promises.
        unsafe { Piece::run_all(core, pieces, crate::hostcopy::copy_out) }
    }

    /// Performs every piece with `copy`, publishing each group's streaming stores.
    ///
    /// # Safety
    /// As [`Piece::copy_all`]; `copy(src, dst, len)` must copy `len` bytes from `src` to `dst`.
    unsafe fn run_all(core: &Core, pieces: &[Piece], copy: unsafe fn(*const u8, *mut u8, usize)) {
        let total: usize = pieces.iter().map(|p| p.len).sum();
        in_groups(
            core,
            pieces.len(),
            total,
            |i| pieces[i].len,
            |range| {
                for p in &pieces[range] {
                    // SAFETY: as the caller promises.
                    unsafe { copy(p.src, p.dst, p.len) }
                }
                crate::hostcopy::publish();
            },
        );
    }
}

/// Runs `work` over `0..count` split into contiguous ranges of about equal bytes (item `i`
/// has `bytes(i)`, `total` in all), a few per packing thread, in parallel when there is
/// enough to do: one task per range, not per item (thousands of tiny tasks cost more than
/// the copies). Returns when every range is done.
pub(crate) fn in_groups(
    core: &Core,
    count: usize,
    total: usize,
    bytes: impl Fn(usize) -> usize,
    work: impl Fn(std::ops::Range<usize>) + Sync + Send,
) {
    if total < PARALLEL_MIN || count < 2 {
        return work(0..count);
    }
    let pool = core.packers();
    let target = (total / (pool.current_num_threads() * 4)).max(64 << 10);
    let mut groups = Vec::new();
    pipeline::split_by_bytes(0..count, bytes, target, |group| groups.push(group));
    use rayon::prelude::*;
    let packing = pipeline::Packing::start(core);
    pool.install(|| groups.into_par_iter().for_each(work));
    drop(packing);
    pipeline::linger(core);
}

/// What a lane's batches reuse, used only under the lane's batch lock: the planner and its
/// plans, descriptor and piece lists, and the device staging where packed bytes and
/// descriptors land before the scatter (uploads) or where the gather collects them
/// (readbacks), grown on demand.
#[derive(Default)]
pub(crate) struct DeviceStaging {
    pub(crate) region: DeviceRegion,
    pub(crate) planner: crate::plan::Planner,
    pub(crate) upload_plan: crate::plan::UploadPlan,
    pub(crate) readback_plan: crate::plan::ReadbackPlan,
    pub(crate) descriptors: Vec<crate::kernels::CopyDescriptor>,
    pub(crate) pieces: Vec<Piece>,
    /// The chunks of a batch cut by [`cut_apart`].
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

#[cfg(test)]
mod callback_tests;
#[cfg(test)]
mod edge_tests;
#[cfg(test)]
pub(crate) mod model_tests;
#[cfg(test)]
mod readback_tests;

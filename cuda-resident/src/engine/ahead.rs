//! Staging ahead: the chunks of an upload batch of small writes in order and apart
//! (`plan::route::Route::InOrder`) packed into pinned memory and moved into device staging
//! of the batch's own while the caller is still adding writes
//! ([`Config::stage_ahead_bytes`](crate::Config::stage_ahead_bytes)), so that `submit` is
//! left with the scatter of each chunk and the writes added after the last one.
//!
//! Nothing staged ahead touches a destination: the DMAs write only the batch's own device
//! staging (allocated as the library's, one allocation a chunk), and the descriptors that
//! name the destinations are read only by the scatters that `submit` launches, after it has
//! claimed every buffer. A batch that is dropped, refused at submit, poisoned or that leaves
//! the in-order route (a write that overlaps, one made in place) moves nothing into any
//! buffer: its staging is freed once the DMAs that fill it are done.
//!
//! The DMAs go on the upload lane, each a submission of its own that claims no buffer (the
//! lane's batch lock is held only while one is enqueued), and keep their pinned lease until
//! they are done. The scatters that `submit` enqueues on the same lane come after them in
//! stream order.

use std::sync::Arc;

use super::Exec;
use super::core::Core;
use super::host::{Source, in_groups};
use crate::alloc::ResidentBuffer;
use crate::engine::table::BufferTable;
use crate::error::Result;
use crate::kernels::{CopyDescriptor, table_bytes};
use crate::plan::WriteRequest;
use crate::plan::route::{AHEAD_CHUNK, Span, cut_apart};
use crate::stream::LaneKind;

/// A chunk staged ahead: its descriptor table, then its packed bytes, in `buffer`.
pub(crate) struct Chunk {
    pub(crate) buffer: ResidentBuffer,
    /// The device address of the table.
    pub(crate) ptr: u64,
    /// Descriptors in the table (one a write).
    pub(crate) count: u64,
    /// Bytes of the buffer.
    len: u64,
}

/// What a batch staged ahead. Frees its device staging when dropped, after the upload
/// lane's last submission then (the DMAs that fill it, and the scatters of a submitted
/// batch, which are enqueued before the batch drops it).
pub(crate) struct Ahead {
    core: Arc<Core>,
    /// Writes `0..staged` of the batch are staged, in [`Ahead::chunks`].
    pub(crate) staged: usize,
    pub(crate) chunks: Vec<Chunk>,
    /// Payload bytes staged (the writes' lengths).
    pub(crate) requested: u64,
    /// Bytes of device staging held.
    held: u64,
    spans: Vec<Span>,
}

/// Where a batch's writes stand, for [`Ahead::stage`].
pub(crate) struct Pending<'b> {
    pub(crate) table: &'b BufferTable,
    pub(crate) writes: &'b [WriteRequest],
    /// Each write's bytes: slices only (a batch with writes made in place stages nothing
    /// ahead).
    pub(crate) sources: &'b [Source<'b>],
}

impl Ahead {
    pub(crate) fn new(core: &Arc<Core>) -> Ahead {
        Ahead {
            core: Arc::clone(core),
            staged: 0,
            chunks: Vec::new(),
            requested: 0,
            held: 0,
            spans: Vec::new(),
        }
    }

    /// Stages writes `self.staged..` of `pending` (in order and apart, laid out by
    /// `table.apart`), in chunks of at most [`AHEAD_CHUNK`], while the batch's staging stays
    /// within `most` bytes. Returns whether every pending write was staged: `false` when the
    /// cap, the pinned pool or the budget said no, and the rest moves at submit (the caller
    /// stops staging ahead). A driver error is returned as such; the chunks staged before
    /// it stay usable, and the one it hit is not listed.
    pub(crate) fn stage(&mut self, pending: &Pending<'_>, most: u64) -> Result<bool> {
        let offsets = &pending.table.apart.offsets[self.staged..pending.writes.len()];
        let from = self.staged;
        let mut spans = std::mem::take(&mut self.spans);
        cut_apart(offsets, |i| pending.writes[from + i].len, |_| AHEAD_CHUNK, &mut spans);
        let mut all = true;
        for span in &spans {
            if !self.stage_span(pending, span, from, most)? {
                all = false;
                break;
            }
        }
        self.spans = spans;
        Ok(all)
    }

    /// Stages one chunk (`span`, of the writes from `from`): `false` where it does not fit.
    fn stage_span(&mut self, pending: &Pending<'_>, span: &Span, from: usize, most: u64) -> Result<bool> {
        let core = &self.core;
        let count = span.requests.len() as u64;
        let area = table_bytes(count);
        let len = area + span.len;
        if self.held + len > most {
            return Ok(false);
        }
        let Some(lease) = core.pinned.try_acquire_for_transfer(len as usize)? else {
            return Ok(false);
        };
        let Ok(buffer) = core.allocate_for_library(len) else {
            return Ok(false);
        };
        let ptr = match core.alloc.resolve(buffer) {
            Ok((ptr, _)) => ptr,
            Err(e) => {
                let _ = core.alloc.free(buffer, &|last| core.is_known_idle(last));
                return Err(e);
            }
        };
        // Listed from here, so that a failure below frees it (after the lane's work), but
        // counted as staged only once its DMA is enqueued.
        self.chunks.push(Chunk { buffer, ptr, count: 0, len });
        self.held += len;
        crate::telemetry::Telemetry::add(&core.telemetry.staging_bytes, len);

        // The packing threads write each write's descriptor and copy its bytes, a group of
        // writes each.
        let base = lease.as_ptr();
        let (first, addr) = (from + span.requests.start, base as usize);
        let (writes, offsets) =
            (&pending.writes[first..from + span.requests.end], &pending.table.apart.offsets[first..]);
        let (entries, sources) = (&pending.table.entries[..], &pending.sources[first..]);
        in_groups(
            &core.packers,
            writes.len(),
            span.len as usize,
            |k| writes[k].len as usize,
            |group| {
                for k in group {
                    let (w, at) = (&writes[k], offsets[k] - span.start);
                    let Source::Slice(data) = sources[k] else {
                        unreachable!("a batch with writes made in place stages nothing ahead")
                    };
                    let d = CopyDescriptor {
                        src: ptr + area + at,
                        dst: entries[w.buffer as usize].ptr + w.offset,
                        len: w.len,
                    };
                    // SAFETY: the lease holds `area` bytes of table (a descriptor a write, 8-byte
                    // aligned at its page-aligned start) and the packed bytes after them; each
                    // write has a slot and a range of its own inside the chunk (`cut_apart`).
                    unsafe {
                        (addr as *mut CopyDescriptor).add(k).write(d);
                        std::ptr::copy_nonoverlapping(
                            data.as_ptr(),
                            (addr + (area + at) as usize) as *mut u8,
                            data.len(),
                        );
                    }
                }
            },
        );
        let requested: u64 = writes.iter().map(|w| w.len).sum();

        let mut exec = Exec::begin(core, LaneKind::Upload);
        // SAFETY: the lease holds `len` bytes, kept alive by the submission until the DMA
        // is done; the chunk's device staging holds `len` bytes and is freed only after it.
        exec.stage(vec![Arc::new(lease)], |q| unsafe { q.htod(ptr, base, len as usize) })?;
        exec.end().record();
        self.chunks.last_mut().expect("listed above").count = count;
        self.requested += requested;
        self.staged = from + span.requests.end;
        Ok(true)
    }
}

impl Drop for Ahead {
    fn drop(&mut self) {
        let core = &self.core;
        // Every submission that uses the staging is enqueued by now (a DMA that failed
        // part-way too: its submission is recorded all the same).
        let last = core.lane(LaneKind::Upload).last_submitted();
        for chunk in self.chunks.drain(..) {
            // A refused mark or free leaves the memory listed (a lost context); nothing is
            // left to report it to.
            if core.alloc.mark_used(chunk.buffer, LaneKind::Upload.index(), last).is_ok() {
                let _ = core.alloc.free(chunk.buffer, &|last| core.is_known_idle(last));
            }
            crate::counter::take_atomic(&core.telemetry.staging_bytes, chunk.len, "staging bytes");
        }
    }
}

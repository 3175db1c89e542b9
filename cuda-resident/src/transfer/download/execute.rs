//! Moving a batch: [`DownloadBatch::submit`] and [`DownloadBatch::submit_into`]; the routes
//! run in `engine::routes` (`download_planned`, `download_in_order`, `streamed`), reading the
//! batch through the `DownloadView` it lends them.

use super::results::PendingDownload;
use super::{DownloadBatch, Slot};
use crate::engine::routes::download_planned;
use crate::error::{Error, Result};
use crate::plan::route::Route;
use crate::transfer::scope::note;

impl DownloadBatch<'_> {
    /// Starts the reads and returns the [`PendingDownload`] that holds the batch's bytes:
    /// at once where the batch reads only into views. Reads into slices move first: an
    /// ordinary batch's are copied out before this returns; a scoped batch's into pinned
    /// memory land in place, the bytes there once the scope (or the returned download's
    /// fence) is done (a large batch moves in up to three parts, as
    /// [`UploadBatch::submit`](crate::UploadBatch::submit) says).
    ///
    /// # Errors
    /// The first bad read's error when any read was refused (the batch is poisoned), or
    /// [`Error::FreedBuffer`] for a buffer freed since its read was added; nothing is
    /// enqueued then, the good reads included. A batch too large for the pinned pool is not
    /// an error: it streams (see [`DownloadBatch`]), and this returns once it has landed;
    /// [`Error::PinnedExhausted`] only when the caller holds so much staging that not even
    /// one chunk of the ring is left. An error part way (from the driver, or a buffer
    /// another thread frees meanwhile) leaves the parts before it moved: a scoped batch's
    /// earlier parts, and the reads into slices, which move before the reads into views.
    pub fn submit(mut self) -> Result<PendingDownload> {
        let submitted = self.submit_inner();
        self.give_back();
        submitted
    }

    fn submit_inner(&mut self) -> Result<PendingDownload> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        let pending = match self.submit_slices()? {
            // Reads into slices only: a download of no views, done when they are.
            Some(fence) if self.reads.is_empty() => PendingDownload::empty(self.id, fence, Vec::new()),
            _ => execute(self, &mut None)?,
        };
        if let Some(seen) = self.scope {
            note(seen, pending.fence());
        }
        Ok(pending)
    }

    /// Submits, waits, and reads read `i` (in the order the reads into views were added)
    /// into `out[i]` for every read into a view, replacing each vector's contents and
    /// reusing its capacity: as [`DownloadBatch::submit`] then
    /// [`PendingDownload::wait_into`] with every slot, except that a batch too large for
    /// the pinned pool streams each chunk straight into the vectors as it lands (no host
    /// allocation of the whole batch, no second copy): the way to read batches of gigabytes
    /// into vectors. Reads into slices move as `submit` moves them.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] (nothing moved) unless `out` has one vector per read into
    /// a view; else as [`DownloadBatch::submit`].
    pub fn submit_into(self, out: &mut [Vec<u8>]) -> Result<()> {
        self.submit_into_as(out, true).map(drop)
    }

    /// [`DownloadBatch::submit_into`]; without `pipelined`, a wait and then a copy of each
    /// read (for batches whose vectors the caller does not keep). Returns the route the
    /// batch took.
    pub(crate) fn submit_into_as(mut self, out: &mut [Vec<u8>], pipelined: bool) -> Result<Route> {
        let submitted = self.submit_into_inner(out, pipelined);
        self.give_back();
        submitted
    }

    fn submit_into_inner(&mut self, out: &mut [Vec<u8>], pipelined: bool) -> Result<Route> {
        if out.len() != self.reads.len() {
            return Err(Error::LengthMismatch {
                what: "reads and output vectors",
                left: self.reads.len(),
                right: out.len(),
            });
        }
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        self.submit_slices()?;
        let mut sink = Some(&mut *out);
        let pending = execute(self, &mut sink)?;
        if let Some(seen) = self.scope {
            note(seen, pending.fence());
        }
        let route = pending.route;
        if sink.is_none() {
            // Streamed into the vectors.
            return Ok(route);
        }
        let slots = (0..out.len()).map(|i| Slot::nth(self.id, i));
        if pipelined {
            return pending.wait_into(&slots.collect::<Vec<_>>(), out).map(|_| route);
        }
        let done = pending.wait()?;
        for (slot, vec) in slots.zip(out.iter_mut()) {
            done.copy_into(slot, vec);
        }
        Ok(route)
    }
}

/// Moves the batch by its route ([`download_planned::execute`]) and makes its
/// [`PendingDownload`] of what landed.
fn execute(batch: &DownloadBatch<'_>, sink: &mut Option<&mut [Vec<u8>]>) -> Result<PendingDownload> {
    let landed = download_planned::execute(&batch.view(), sink)?;
    Ok(PendingDownload::landed(batch.core, batch.id, landed))
}

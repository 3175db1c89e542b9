//! A scope's batch of reads into the caller's memory.

use std::marker::PhantomData;
use std::sync::Arc;

use super::pinned::{move_pinned, ranges_of};
use super::places::{Lent, places};
use super::{Submitted, add_many, note};
use crate::alloc::ResidentBuffer;
use crate::engine::core::Core;
use crate::engine::host::Piece;
use crate::error::{Error, Result};
use crate::fence::Fence;
use crate::plan::runs::{Direct, Place, first_part, parts};
use crate::stream::LaneKind;
use crate::transfer::BufferTable;

/// A batch of reads into the caller's memory ([`Scope::downloads`](super::Scope::downloads)).
#[must_use = "a scoped download batch moves nothing until it is submitted"]
pub struct ScopedDownloads<'scope> {
    pub(super) core: &'scope Arc<Core>,
    pub(super) seen: &'scope Submitted,
    pub(super) table: BufferTable,
    pub(super) reads: Vec<(u32, u64, &'scope mut [u8])>,
    pub(super) error: Option<Error>,
    /// Invariant in 'scope, as [`ScopedUploads`](super::ScopedUploads).
    pub(super) scope: PhantomData<&'scope mut &'scope ()>,
}

impl std::fmt::Debug for ScopedDownloads<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScopedDownloads").field("reads", &self.reads.len()).finish_non_exhaustive()
    }
}

impl<'scope> ScopedDownloads<'scope> {
    /// Adds a read of `out.len()` bytes of `buffer` at `offset` into `out`, which stays
    /// borrowed until the scope ends: the bytes are in it once the scope returns. In pinned
    /// memory (this crate's, or runs of memory pinned by
    /// [`Device::pin_host`](crate::Device::pin_host)), the GPU writes it in place.
    ///
    /// # Errors
    /// A bad range (returned here and again by `submit`, which then moves nothing).
    pub fn read_into(
        &mut self,
        buffer: ResidentBuffer,
        offset: u64,
        out: &'scope mut [u8],
    ) -> Result<&mut Self> {
        let (key, _) =
            self.table.check(&self.core.alloc, buffer, offset, out.len() as u64, &mut self.error)?;
        self.reads.push((key, offset, out));
        Ok(self)
    }

    /// Adds a read for each `(buffer, offset, out)` item, in order, as that many
    /// [`read_into`](ScopedDownloads::read_into)s would, with less work per item: room
    /// reserved up front, no result per item.
    ///
    /// # Errors
    /// For the first bad item, [`Error::BadItem`] naming its index and holding the error
    /// `read_into` returns for it; the batch keeps the items before it and fails `submit`
    /// with that error (moving nothing), as after a bad `read_into`; the items after it are
    /// not added.
    ///
    /// # Panics
    /// Where the iterator panics, the panic goes on to the caller, and the batch keeps
    /// [`Error::ItemsPanicked`]: a caller that catches the panic finds `submit` failing with
    /// it, moving nothing.
    pub fn read_into_many<I>(&mut self, items: I) -> Result<&mut Self>
    where
        I: IntoIterator<Item = (ResidentBuffer, u64, &'scope mut [u8])>,
    {
        let call = "ScopedDownloads::read_into_many";
        add_many(self.core, (&mut self.table, &mut self.error), call, &mut self.reads, items, |o| o.len())?;
        Ok(self)
    }

    /// Number of reads.
    pub fn len(&self) -> usize {
        self.reads.len()
    }

    /// Whether the batch has no reads.
    pub fn is_empty(&self) -> bool {
        self.reads.is_empty()
    }

    /// Moves every read: into pinned memory of this crate straight from the device (this
    /// returns at once; the bytes are there when the scope ends; a large batch moves in up
    /// to three parts, as [`ScopedUploads::submit`](super::ScopedUploads::submit) says), into
    /// any other memory through staging (this returns once those bytes are copied in).
    ///
    /// # Errors
    /// The first bad read's error, or a staging or driver error; nothing moves if a read
    /// was bad or a buffer was freed before this was called. An error part way (from the
    /// driver, or a buffer another thread frees meanwhile) leaves the parts before it moved.
    pub fn submit(self) -> Result<()> {
        self.submit_fenced().map(drop)
    }

    /// [`ScopedDownloads::submit`], returning the fence of its last submission (a read into
    /// pinned memory: its bytes are there once the fence is).
    ///
    /// # Errors
    /// As [`ScopedDownloads::submit`].
    pub fn submit_fenced(mut self) -> Result<Fence> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        let core = self.core;
        // Nothing moves where a buffer was freed before this call: a buffer named only by
        // empty reads is claimed by no part, and a staged read claims only its own.
        core.alloc.check_live_many(self.table.buffers())?;
        let entries = &self.table.entries;
        // The first part moves before the rest is looked at (where the batch has one).
        let mut lent = Lent::default();
        let reads = &mut self.reads;
        let first = first_part(reads.len(), core.config.chunk_bytes, |i| {
            let (key, offset, ref mut out) = reads[i];
            lent.seen(out.as_mut_ptr() as usize, out.len(), entries[key as usize].ptr + offset)
        });
        let mut fence = Fence::completed();
        let move_part = |items: &[Direct]| {
            let ranges = ranges_of(core, LaneKind::Readback, items);
            let moved = move_pinned(core, LaneKind::Readback, self.table.buffers(), items, ranges, self.seen);
            let fence = self.seen.note(LaneKind::Readback, moved)?;
            note(self.seen, &fence);
            Ok::<_, Error>(fence)
        };
        let from = match first {
            Some((items, end)) => {
                fence = move_part(&items)?;
                end
            }
            None => 0,
        };
        let rest: Vec<_> = std::mem::take(reads).into_iter().skip(from).collect();
        let hosts: Vec<(usize, usize)> = rest.iter().map(|r| (r.2.as_ptr() as usize, r.2.len())).collect();
        let places = places(core, &hosts)?;
        let (mut direct, mut staged) = (Vec::with_capacity(rest.len()), Vec::new());
        for ((key, offset, out), place) in rest.into_iter().zip(places) {
            if out.is_empty() {
                continue;
            }
            let entry = entries[key as usize];
            match place {
                Place::Mapped(_) | Place::Pinned(_) => {
                    direct.push(Direct::new(out.as_mut_ptr() as usize, entry.ptr + offset, out.len(), place))
                }
                Place::Staged => staged.push((entry.buffer, offset, out)),
            }
        }
        // In parts (reads of distinct caller slices: their order does not matter).
        for part in parts(&direct, core.config.chunk_bytes, usize::from(from > 0)) {
            fence = move_part(&direct[part])?;
        }
        if !staged.is_empty() {
            let mut batch = crate::transfer::download::downloads(core);
            let slots = staged
                .iter()
                .map(|(buffer, offset, out)| batch.read(*buffer, *offset, out.len() as u64))
                .collect::<Result<Vec<_>>>()?;
            let pending = batch.submit()?;
            note(self.seen, pending.fence());
            let done = pending.wait()?;
            let mut pieces = Vec::with_capacity(staged.len());
            for ((_, _, out), slot) in staged.iter_mut().zip(slots) {
                let bytes = done.get(slot);
                Piece::push_split(
                    &mut pieces,
                    Piece { dst: out.as_mut_ptr(), src: bytes.as_ptr(), len: bytes.len() },
                );
            }
            // SAFETY: each piece copies a landed view into its own caller slice (distinct
            // `&mut` borrows, of the view's length).
            unsafe { Piece::copy_out_all(&core.packers, &pieces) };
            crate::hostcopy::publish();
        }
        Ok(fence)
    }
}

//! A scope's batch of writes from the caller's memory.

use std::marker::PhantomData;
use std::sync::Arc;

use super::pinned::{move_pinned, ranges_of};
use super::places::{Lent, places};
use super::{Submitted, add_many, note};
use crate::alloc::ResidentBuffer;
use crate::engine::core::Core;
use crate::error::{Error, Result};
use crate::fence::Fence;
use crate::plan::runs::{Direct, Place, first_part, parts};
use crate::stream::LaneKind;
use crate::transfer::BufferTable;

/// A batch of writes from the caller's memory ([`Scope::uploads`](super::Scope::uploads)).
/// Writes apply in order: where two overlap, the later one wins (such a batch takes the
/// staged path whole).
#[must_use = "a scoped upload batch moves nothing until it is submitted"]
pub struct ScopedUploads<'scope> {
    pub(super) core: &'scope Arc<Core>,
    pub(super) seen: &'scope Submitted,
    pub(super) table: BufferTable,
    pub(super) writes: Vec<(u32, u64, &'scope [u8])>,
    pub(super) error: Option<Error>,
    /// Invariant in 'scope: a batch must not shrink to a shorter borrow, or it would take
    /// memory that dies before the scope waits for it.
    pub(super) scope: PhantomData<&'scope mut &'scope ()>,
}

impl std::fmt::Debug for ScopedUploads<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScopedUploads").field("writes", &self.writes.len()).finish_non_exhaustive()
    }
}

impl<'scope> ScopedUploads<'scope> {
    /// Adds a write of `data` to `buffer` at `offset`. `data` stays borrowed until the scope
    /// ends; in pinned memory (this crate's, or runs of memory pinned by
    /// [`Device::pin_host`](crate::Device::pin_host)), the GPU reads it in place.
    ///
    /// # Errors
    /// A bad range (returned here and again by `submit`, which then moves nothing).
    pub fn write(&mut self, buffer: ResidentBuffer, offset: u64, data: &'scope [u8]) -> Result<&mut Self> {
        let (key, _) =
            self.table.check(&self.core.alloc, buffer, offset, data.len() as u64, &mut self.error)?;
        self.writes.push((key, offset, data));
        Ok(self)
    }

    /// Adds a write for each `(buffer, offset, data)` item, in order, as that many
    /// [`write`](ScopedUploads::write)s would, with less work per item: room reserved up
    /// front, no result per item.
    ///
    /// # Errors
    /// For the first bad item, [`Error::BadItem`] naming its index and holding the error
    /// `write` returns for it; the batch keeps the items before it and fails `submit` with
    /// that error (moving nothing), as after a bad `write`; the items after it are not added.
    ///
    /// # Panics
    /// Where the iterator panics, the panic goes on to the caller, and the batch keeps
    /// [`Error::ItemsPanicked`]: a caller that catches the panic finds `submit` failing with
    /// it, moving nothing.
    pub fn write_many<I>(&mut self, items: I) -> Result<&mut Self>
    where
        I: IntoIterator<Item = (ResidentBuffer, u64, &'scope [u8])>,
    {
        let call = "ScopedUploads::write_many";
        add_many(self.core, (&mut self.table, &mut self.error), call, &mut self.writes, items, |d| d.len())?;
        Ok(self)
    }

    /// Number of writes.
    pub fn len(&self) -> usize {
        self.writes.len()
    }

    /// Whether the batch has no writes.
    pub fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }

    /// Moves every write: those from pinned memory of this crate straight from it, the
    /// others through staging (copied before this returns). The scope waits for them. A
    /// batch of more than 1024 writes or a chunk of bytes moves in up to three parts, the
    /// first while the rest is looked at and laid out, where they come from pinned memory
    /// (the first part from this crate's: it moves before any later write is classified);
    /// the parts apply in order.
    ///
    /// # Errors
    /// The first bad write's error, or a staging or driver error; nothing moves if a write
    /// was bad or a buffer was freed before this was called. An error part way (from the
    /// driver, or a buffer another thread frees meanwhile) leaves the parts before it moved.
    pub fn submit(self) -> Result<()> {
        self.submit_fenced().map(drop)
    }

    /// [`ScopedUploads::submit`], returning the fence of its last submission: for a stream of
    /// your own that must wait for the writes inside the scope
    /// ([`Fence::make_stream_wait`]).
    ///
    /// # Errors
    /// As [`ScopedUploads::submit`].
    pub fn submit_fenced(mut self) -> Result<Fence> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        let core = self.core;
        // Nothing moves where a buffer was freed before this call: a part that goes through
        // staging claims only the buffers of its own writes, so every buffer is checked first.
        core.alloc.check_live_many(self.table.buffers())?;
        let ptr_of = |key: u32, offset: u64| self.table.entries[key as usize].ptr + offset;
        // The first part moves before the rest is looked at (where the batch has one).
        let mut lent = Lent::default();
        let first = first_part(self.writes.len(), core.config.chunk_bytes, |i| {
            let (key, offset, data) = self.writes[i];
            lent.seen(data.as_ptr() as usize, data.len(), ptr_of(key, offset))
        });
        let mut fence = Fence::completed();
        let from = match first {
            Some((items, end)) => {
                fence = self.move_part(&items, 0..end)?;
                end
            }
            None => 0,
        };
        let rest = &self.writes[from..];
        let hosts: Vec<(usize, usize)> = rest.iter().map(|w| (w.2.as_ptr() as usize, w.2.len())).collect();
        let places = places(core, &hosts)?;
        // One pass: the items that move in place (and the write each comes from), the others.
        let (mut direct, mut origin, mut staged) = (Vec::with_capacity(rest.len()), Vec::new(), Vec::new());
        for (i, (&(key, offset, data), place)) in (from..).zip(rest.iter().zip(places)) {
            if data.is_empty() {
                continue;
            }
            match place {
                Place::Mapped(_) | Place::Pinned(_) => {
                    direct.push(Direct::new(data.as_ptr() as usize, ptr_of(key, offset), data.len(), place));
                    origin.push(i);
                }
                Place::Staged => staged.push(i),
            }
        }
        if staged.is_empty() {
            // All in place: in parts, each checked for overlaps of its own (a part that has
            // some goes staged whole); the parts apply in order, one after the other on the
            // lane, so a later write wins over an earlier one in another part too.
            for part in parts(&direct, core.config.chunk_bytes, usize::from(from > 0)) {
                fence = self.move_part(&direct[part.clone()], origin[part].iter().copied())?;
            }
            return Ok(fence);
        }
        // Some staged: overlapping writes apply in order, so where any two writes overlap, the
        // staged path's planner takes them all (those of a first part moved already come
        // before them all on the lane).
        let mut ranges = core.ranges(LaneKind::Upload);
        for &(key, offset, data) in rest {
            ranges.push(ptr_of(key, offset), data.len() as u64);
        }
        if !direct.is_empty() && !ranges.disjoint_by_granules().unwrap_or_else(|| ranges.sort_disjoint()) {
            direct.clear();
            staged = (from..self.writes.len()).collect();
        }
        if !direct.is_empty() {
            // Noted in the scope, which waits for it; the staged batch comes after it on the
            // lane, so its fence is the one returned.
            drop(self.move_part(&direct, origin.into_iter())?);
        }
        fence = self.submit_staged(staged.into_iter())?;
        note(self.seen, &fence);
        Ok(fence)
    }

    /// Moves a part of the batch's writes made in place, `items`, coming from the writes at
    /// `origin`: in place where no two of them overlap (checked by granules, without a sort,
    /// which would cost ~0.7 ms for 16384 blocks of a pool on the development VM, before the
    /// first DMA), else those writes through staging, in order.
    fn move_part(&self, items: &[Direct], origin: impl Iterator<Item = usize>) -> Result<Fence> {
        let core = self.core;
        let mut ranges = ranges_of(core, LaneKind::Upload, items);
        let fence = if ranges.disjoint_by_granules().unwrap_or_else(|| ranges.sort_disjoint()) {
            let moved = move_pinned(core, LaneKind::Upload, self.table.buffers(), items, ranges, self.seen);
            self.seen.note(LaneKind::Upload, moved)?
        } else {
            self.submit_staged(origin)?
        };
        note(self.seen, &fence);
        Ok(fence)
    }

    /// The writes at `indices` (in order) as one ordinary batch, through staging.
    fn submit_staged(&self, indices: impl Iterator<Item = usize>) -> Result<Fence> {
        let mut batch = crate::transfer::upload::uploads(self.core);
        for i in indices {
            let (key, offset, data) = self.writes[i];
            if !data.is_empty() {
                batch.write(self.table.entries[key as usize].buffer, offset, data)?;
            }
        }
        batch.submit()
    }
}

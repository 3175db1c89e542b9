//! A batch's reads into the caller's slices ([`DownloadBatch::read_to_slice`]): added as
//! the views' reads are, moved at submit before them, in place by a scoped batch
//! (`crate::transfer::scope`), else through staging and copied out before submit returns.

use std::sync::Arc;

use super::DownloadBatch;
use crate::alloc::ResidentBuffer;
use crate::engine::core::Core;
use crate::engine::host::Piece;
use crate::error::{Error, Result};
use crate::fence::Fence;
use crate::transfer::scope::{Submitted, note, read_in_place};
use crate::transfer::upload::RESERVE_MOST;

impl<'a> DownloadBatch<'a> {
    /// Adds a read of `out.len()` bytes of `buffer` at `offset` into `out`, the caller's
    /// slice, which must be exactly as long as the read (as for
    /// [`Device::download_to_slice`](crate::Device::download_to_slice)). No slot: the bytes
    /// land in `out`. An ordinary batch copies them there before `submit` returns; a scoped
    /// one keeps `out` borrowed until the scope ends, and the bytes are in it once the scope
    /// has returned: in pinned memory (this crate's, or runs of memory pinned by
    /// [`Device::pin_host`](crate::Device::pin_host)), the GPU writes them in place.
    ///
    /// # Errors
    /// A bad range (returned here and again by `submit`, which then moves nothing).
    pub fn read_to_slice(
        &mut self,
        buffer: ResidentBuffer,
        offset: u64,
        out: &'a mut [u8],
    ) -> Result<&mut Self> {
        let table = &mut self.slices.table;
        let (key, _) = table.check(&self.core.alloc, buffer, offset, out.len() as u64, &mut self.error)?;
        self.slices.items.push((key, offset, out));
        Ok(self)
    }

    /// Adds a read for each `(buffer, offset, out)` item, in order, as that many
    /// [`read_to_slice`](DownloadBatch::read_to_slice)s would, with less work per item: room
    /// reserved up front, no result per item.
    ///
    /// # Errors
    /// For the first bad item, [`Error::BadItem`] naming its index and holding the error
    /// `read_to_slice` returns for it; the batch keeps the items before it and fails
    /// `submit` with that error (moving nothing), as after a bad `read_to_slice`; the items
    /// after it are not added.
    ///
    /// # Panics
    /// Where the iterator panics, the panic goes on to the caller, and the batch keeps
    /// [`Error::ItemsPanicked`]: a caller that catches the panic finds `submit` failing with
    /// it, moving nothing.
    pub fn read_to_slice_many<I>(&mut self, items: I) -> Result<&mut Self>
    where
        I: IntoIterator<Item = (ResidentBuffer, u64, &'a mut [u8])>,
    {
        let items = items.into_iter();
        // As `UploadBatch::write_many`: the iterator's hint is trusted only so far.
        self.slices.items.reserve(items.size_hint().0.min(RESERVE_MOST));
        Error::add_items(
            "DownloadBatch::read_to_slice_many",
            self,
            |batch| &mut batch.error,
            |batch, at| {
                let (core, slices) = (batch.core, &mut batch.slices);
                for (buffer, offset, out) in items {
                    let (key, _) =
                        slices.table.check(&core.alloc, buffer, offset, out.len() as u64, &mut None)?;
                    slices.items.push((key, offset, out));
                    *at += 1;
                }
                Ok(())
            },
        )?;
        Ok(self)
    }

    /// Moves the batch's reads into slices (the batch checked, not poisoned): in place where
    /// a scoped batch can, else through staging, copied out before this returns. Returns
    /// the fence of their last submission, `None` where the batch has none. Every buffer of
    /// the batch, those of its views' reads too, is checked first: nothing moves where one
    /// was freed.
    pub(super) fn submit_slices(&mut self) -> Result<Option<Fence>> {
        if self.slices.items.is_empty() {
            return Ok(None);
        }
        let core = self.core;
        core.alloc.check_live_many(self.slices.table.buffers().chain(self.table.buffers()))?;
        let items = std::mem::take(&mut self.slices.items);
        let table = &self.slices.table;
        match self.scope {
            Some(seen) => read_in_place(core, table, items, seen).map(Some),
            None => {
                let staged = items
                    .into_iter()
                    .map(|(key, offset, out)| (table.entries[key as usize].buffer, offset, out))
                    .collect();
                read_staged(core, staged, None)?;
                Ok(Some(Fence::completed()))
            }
        }
    }
}

/// Reads `out.len()` bytes of `buffer` at `offset` into `out` for each `(buffer, offset,
/// out)` of `staged`, as one ordinary batch (noted in `seen`, where a scope's): the bytes
/// land in staging and are copied out before this returns, on the packing threads.
pub(in crate::transfer) fn read_staged(
    core: &Arc<Core>,
    mut staged: Vec<(ResidentBuffer, u64, &mut [u8])>,
    seen: Option<&Submitted>,
) -> Result<()> {
    staged.retain(|(_, _, out)| !out.is_empty());
    if staged.is_empty() {
        return Ok(());
    }
    let mut batch = super::downloads(core);
    let slots =
        batch.read_many(staged.iter().map(|(buffer, offset, out)| (*buffer, *offset, out.len() as u64)))?;
    let pending = batch.submit()?;
    if let Some(seen) = seen {
        note(seen, pending.fence());
    }
    let done = pending.wait()?;
    let mut pieces = Vec::with_capacity(staged.len());
    for ((_, _, out), slot) in staged.iter_mut().zip(slots) {
        let bytes = done.get(slot);
        Piece::push_split(
            &mut pieces,
            Piece { dst: out.as_mut_ptr(), src: bytes.as_ptr(), len: bytes.len() },
        );
    }
    // SAFETY: each piece copies a landed view into its own caller slice (distinct `&mut`
    // borrows, of the view's length).
    unsafe { Piece::copy_out_all(&core.packers, &pieces) };
    crate::hostcopy::publish();
    Ok(())
}

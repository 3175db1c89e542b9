//! Downloads: a batch of reads, fused, gathered by the kernel (small ranges: into device
//! staging and moved by one DMA, or, many small reads in order, straight into pinned memory
//! over the bus) or copied directly (large ones), into one pinned region that the caller
//! reads as `&[u8]` views. A batch larger than the pinned pool can lend streams through a
//! ring of pinned chunks into one ordinary host allocation instead
//! (`engine::routes::streamed`).
//!
//! The batch, its `submit` and its results live here; the routes it takes run in
//! `engine::routes` (`download_planned`, `download_in_order`, `streamed`), reading the batch
//! through the `DownloadView` that `submit` lends them.

mod execute;
mod results;
mod to_slice;

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::Ordering;

pub use results::{Downloaded, PendingDownload};
pub(in crate::transfer) use to_slice::read_staged;

use super::BufferTable;
use super::scope::Submitted;
use crate::alloc::ResidentBuffer;
use crate::engine::core::Core;
use crate::engine::routes::view::DownloadView;
use crate::error::{Error, Result};
use crate::plan::ReadRequest;
#[cfg(test)]
use crate::plan::route::Route;

/// Names one read of a [`DownloadBatch`] (or one range of a
/// [`PreparedDownloads`](crate::PreparedDownloads)); redeem it with [`Downloaded::get`] or
/// the copying methods of the [`Downloaded`] that batch's submit produced.
///
/// A slot carries the identity of its batch next to the read's index, so that a slot of
/// another batch is caught (an error, or a panic where the method returns no `Result`)
/// instead of naming another read's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Slot {
    /// The batch (or prepared set) the slot came from ([`next_batch_id`]).
    pub(super) batch: u64,
    pub(super) index: u32,
}

/// The most reads a batch or prepared set holds: a slot's index is 32 bits, so that no index
/// wraps around to name another read.
pub(crate) const MAX_READS: usize = u32::MAX as usize;

impl Slot {
    /// The slot of the `index`th read of batch `batch` (`index < MAX_READS`: checked where
    /// reads are added).
    pub(crate) fn nth(batch: u64, index: usize) -> Slot {
        let index = u32::try_from(index).expect("reads are counted below MAX_READS where they are added");
        Slot { batch, index }
    }
}

/// A new batch identity, never handed out before in this process (a `u64` counter does not
/// wrap in practice): what ties a [`Slot`] to its batch.
pub(crate) fn next_batch_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A batch of device-to-host reads. Reads of one buffer that overlap or touch are fused
/// and move once. [`DownloadBatch::submit`] returns the [`PendingDownload`] that holds the
/// batch's bytes.
///
/// Two kinds of read:
/// - into pinned views that the batch's [`Downloaded`] lends, each named by a [`Slot`]:
///   [`read`](DownloadBatch::read), [`read_many`](DownloadBatch::read_many),
///   [`read_buffer`](DownloadBatch::read_buffer),
///   [`read_buffer_many`](DownloadBatch::read_buffer_many);
/// - into the caller's own slices, of exact length:
///   [`read_to_slice`](DownloadBatch::read_to_slice),
///   [`read_to_slice_many`](DownloadBatch::read_to_slice_many).
///
/// And two kinds of batch, with the same methods:
/// - from [`Device::downloads`](crate::Device::downloads), an **ordinary** batch: reads
///   into slices land in staging and are copied out before `submit` returns (so the
///   borrow of each slice ends there);
/// - from [`Scope::downloads`](crate::Scope::downloads), a **scoped** batch: its slices
///   stay borrowed until the scope ends, reads into pinned memory land there in place with
///   no staging copy, and the bytes are there once the scope has returned (the scope waits
///   for them); see [`Scope`](crate::Scope).
///
/// A batch that mixes the two kinds of read moves its reads into slices first, as a
/// submission of their own, then its slot reads: the [`PendingDownload`] holds the slot
/// reads' views, and its fence, the batch's last submission, completes after every read of
/// the batch (in a scoped batch, the reads into pinned slices too).
///
/// Every read is checked when it is added: a bad one (a freed or foreign handle, a range
/// out of its buffer) returns its error and poisons the batch: [`DownloadBatch::submit`]
/// fails with the first such error and nothing moves, the good reads included.
///
/// A batch of any size works, whatever [`Config::pinned_cap_bytes`](crate::Config::pinned_cap_bytes):
/// one whose staging the pool cannot lend at once (more than the cap, more than is free of
/// what callers hold, or more held staging than the pool's reserve for transfers leaves)
/// streams through a ring of pinned chunks into one ordinary host allocation owned by its
/// [`Downloaded`] (see there): same API and same bytes, one more host copy, and its `submit`
/// returns only once every byte has landed. [`DownloadBatch::submit_into`] streams such a
/// batch straight into the caller's vectors instead.
///
/// `DownloadBatch<'a>` is invariant in `'a`, as [`UploadBatch`](crate::UploadBatch) is
/// and for the same reason: a scoped batch cannot be coerced to a shorter lifetime to take
/// memory that dies before the scope waits for it.
///
/// ```compile_fail,E0597
/// # fn f(device: &cuda_resident::Device, pool: cuda_resident::ResidentBuffer) -> cuda_resident::Result<()> {
/// device.scope(|s| {
///     let mut local = vec![0u8; 4096];
///     // The scope's batch would have to shrink to `local`'s life, which ends before the
///     // scope waits: refused.
///     let mut reads: cuda_resident::DownloadBatch<'_> = s.downloads();
///     reads.read_to_slice(pool, 0, &mut local)?;
///     reads.submit().map(drop)
/// })
/// # }
/// ```
#[must_use = "a download batch moves nothing until it is submitted"]
pub struct DownloadBatch<'a> {
    pub(super) core: &'a Arc<Core>,
    pub(super) table: BufferTable,
    /// The reads redeemed by slots.
    pub(super) reads: Vec<ReadRequest>,
    /// The reads into the caller's slices, with a table of their own (whose layout
    /// bookkeeping must not mix with the slot reads').
    pub(super) slices: SliceReads<'a>,
    pub(super) error: Option<Error>,
    /// This batch's identity, carried by its slots and its download.
    pub(super) id: u64,
    /// The scope of a batch from [`Scope::downloads`](crate::Scope::downloads), which waits
    /// for its submissions; `None` for an ordinary batch.
    pub(super) scope: Option<&'a Submitted>,
    spare: Spare,
    /// Invariant in 'a, as [`UploadBatch`](crate::UploadBatch).
    invariant: PhantomData<&'a mut &'a ()>,
}

/// A batch's reads into the caller's slices: `(key in table, offset, out)` each.
#[derive(Default)]
pub(super) struct SliceReads<'a> {
    pub(super) table: BufferTable,
    pub(super) items: Vec<(u32, u64, &'a mut [u8])>,
}

/// Hands a submitted batch's vectors back to its device when the batch goes. A field of its
/// own, without the batch's lifetime: the batch itself has no `Drop`, so it may borrow
/// slices declared after it, as any struct of references.
struct Spare {
    core: Arc<Core>,
    parts: Option<(BufferTable, Vec<ReadRequest>)>,
}

impl Drop for Spare {
    fn drop(&mut self) {
        if let Some(parts) = self.parts.take() {
            self.core.spares.download.give(parts);
        }
    }
}

impl fmt::Debug for DownloadBatch<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DownloadBatch")
            .field("reads", &self.reads.len())
            .field("to_slices", &self.slices.items.len())
            .field("scoped", &self.scope.is_some())
            .finish_non_exhaustive()
    }
}

/// The work of [`Device::downloads`](crate::Device::downloads).
pub(crate) fn downloads(core: &Arc<Core>) -> DownloadBatch<'_> {
    downloads_as(core, next_batch_id())
}

/// A batch whose slots and download carry the identity `id` (a prepared set's, so that
/// the set's slots redeem the downloads it moves as batches).
pub(crate) fn downloads_as(core: &Arc<Core>, id: u64) -> DownloadBatch<'_> {
    batch(core, id, None)
}

/// The work of [`Scope::downloads`](crate::Scope::downloads): a batch whose submissions
/// `seen` records, for its scope to wait for.
pub(crate) fn scoped<'a>(core: &'a Arc<Core>, seen: &'a Submitted) -> DownloadBatch<'a> {
    batch(core, next_batch_id(), Some(seen))
}

fn batch<'a>(core: &'a Arc<Core>, id: u64, scope: Option<&'a Submitted>) -> DownloadBatch<'a> {
    let (table, reads) = core.spares.download.take();
    DownloadBatch {
        core,
        table,
        reads,
        slices: SliceReads::default(),
        error: None,
        id,
        scope,
        spare: Spare { core: Arc::clone(core), parts: None },
        invariant: PhantomData,
    }
}

impl DownloadBatch<'_> {
    /// Hands the batch's vectors to its spare, for the device's next batch once this one
    /// goes (emptied: no borrowed slice outlives the batch).
    pub(super) fn give_back(&mut self) {
        self.spare.parts = Some((std::mem::take(&mut self.table), std::mem::take(&mut self.reads)));
    }
}

impl DownloadBatch<'_> {
    /// The parts of the batch its route reads, borrowed ([`DownloadView`]).
    pub(super) fn view(&self) -> DownloadView<'_> {
        DownloadView { core: self.core, table: &self.table, reads: &self.reads }
    }

    /// The route the batch takes as its reads stand, when the pinned pool can lend it at
    /// submit ([`download_route`](crate::plan::route::download_route)); a batch it cannot lend streams instead
    /// ([`Route::Streamed`](crate::plan::route::Route::Streamed)).
    #[cfg(test)]
    pub(crate) fn route(&self) -> Route {
        let view = self.view();
        view.route_with(&view.sizing().1)
    }

    /// Adds a read of `len` bytes of `buffer` at `offset`.
    ///
    /// # Errors
    /// [`Error::FreedBuffer`], [`Error::ForeignBuffer`], or [`Error::OutOfRange`] (the range
    /// past the buffer's end, or `offset + len` overflowing); the batch is poisoned then:
    /// [`DownloadBatch::submit`] fails with the same error and moves nothing.
    #[inline]
    pub fn read(&mut self, buffer: ResidentBuffer, offset: u64, len: u64) -> Result<Slot> {
        // The hot path, inlined into the caller's loop: room for the read, a buffer the batch
        // named before, a range inside it. Everything else goes the cold way.
        let index = self.reads.len();
        if index < MAX_READS
            && let Some((key, buffer_len)) = self.table.hit(buffer, offset, len)
        {
            return Ok(self.push(index, ReadRequest { buffer: u64::from(key), buffer_len, offset, len }));
        }
        self.read_cold(buffer, offset, len)
    }

    /// [`DownloadBatch::read`] where [`BufferTable::hit`] found nothing.
    #[cold]
    #[inline(never)]
    fn read_cold(&mut self, buffer: ResidentBuffer, offset: u64, len: u64) -> Result<Slot> {
        let index = self.reads.len();
        if index < MAX_READS
            && let Some((key, buffer_len)) = self.table.hit_kept(&self.core.alloc, buffer, offset, len)
        {
            return Ok(self.push(index, ReadRequest { buffer: u64::from(key), buffer_len, offset, len }));
        }
        self.add(buffer, offset, len).inspect_err(|e| {
            self.error.get_or_insert_with(|| e.clone());
        })
    }

    /// Records checked read `read`, the batch's `index`th (below [`MAX_READS`]), and returns
    /// its slot.
    #[inline(always)]
    fn push(&mut self, index: usize, read: ReadRequest) -> Slot {
        self.reads.push(read);
        Slot::nth(self.id, index)
    }

    /// Checks a read and records it, without poisoning the batch on error (the caller
    /// does).
    #[inline(always)]
    fn add(&mut self, buffer: ResidentBuffer, offset: u64, len: u64) -> Result<Slot> {
        let index = self.reads.len();
        if index >= MAX_READS {
            return Err(Error::TooManyReads { most: MAX_READS });
        }
        // `check`, with only the cold path's result matched.
        let (key, buffer_len) = match self.table.hit(buffer, offset, len) {
            Some(found) => found,
            None => self.table.check_cold(&self.core.alloc, buffer, offset, len, &mut None)?,
        };
        Ok(self.push(index, ReadRequest { buffer: u64::from(key), buffer_len, offset, len }))
    }

    /// Adds a read of the whole buffer.
    ///
    /// # Errors
    /// As [`DownloadBatch::read`]: a freed or foreign handle poisons the batch.
    pub fn read_buffer(&mut self, buffer: ResidentBuffer) -> Result<Slot> {
        let len = match self.core.buffer_len(buffer) {
            Ok(len) => len,
            Err(e) => {
                self.error.get_or_insert_with(|| e.clone());
                return Err(e);
            }
        };
        self.read(buffer, 0, len)
    }

    /// Adds a read of each whole buffer, in order.
    ///
    /// # Errors
    /// For the first bad buffer, [`Error::BadItem`] naming its index and holding the error
    /// [`DownloadBatch::read_buffer`] returns for it; the reads before it stay added, but the
    /// batch is poisoned: `submit` fails with that error.
    pub fn read_buffer_many(&mut self, buffers: &[ResidentBuffer]) -> Result<Vec<Slot>> {
        let mut slots = Vec::with_capacity(buffers.len());
        self.reads.reserve(buffers.len());
        for (index, &buffer) in buffers.iter().enumerate() {
            let added = self.core.buffer_len(buffer).and_then(|len| self.add(buffer, 0, len));
            match added {
                Ok(slot) => slots.push(slot),
                Err(e) => {
                    return Err(Error::bad_item(
                        &mut self.error,
                        "DownloadBatch::read_buffer_many",
                        index,
                        e,
                    ));
                }
            }
        }
        Ok(slots)
    }

    /// Adds a read for each `(buffer, offset, len)` item, in order, as that many
    /// [`read`](DownloadBatch::read)s would, with less work per item: room reserved up
    /// front, no result per item. Returns the items' slots, in order (consecutive slots of
    /// this batch).
    ///
    /// # Errors
    /// For the first bad item, [`Error::BadItem`] naming its index and holding the error
    /// `read` returns for it; the reads before it stay added, but the batch is poisoned:
    /// `submit` fails with that error and moves nothing. The items after it are not added.
    ///
    /// # Panics
    /// Where the iterator panics, the panic goes on to the caller, and the batch keeps
    /// [`Error::ItemsPanicked`]: a caller that catches the panic finds `submit` failing with
    /// it, moving nothing.
    pub fn read_many<I>(&mut self, items: I) -> Result<Vec<Slot>>
    where
        I: IntoIterator<Item = (ResidentBuffer, u64, u64)>,
    {
        let items = items.into_iter();
        // As `UploadBatch::write_many`: the iterator's hint is trusted only so far.
        let lower = items.size_hint().0.min(super::upload::RESERVE_MOST);
        let mut slots = Vec::with_capacity(lower);
        self.reads.reserve(lower);
        Error::add_items(
            "DownloadBatch::read_many",
            self,
            |batch| &mut batch.error,
            |batch, at| {
                for (buffer, offset, len) in items {
                    slots.push(batch.add(buffer, offset, len)?);
                    *at += 1;
                }
                Ok(())
            },
        )?;
        Ok(slots)
    }

    /// Number of reads added, of both kinds (into views and into slices).
    pub fn len(&self) -> usize {
        self.reads.len() + self.slices.items.len()
    }

    /// Whether no read was added.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

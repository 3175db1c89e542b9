//! Uploads: a batch of writes, fused, staged once in pinned memory and moved by one DMA plus
//! one scatter per chunk (small writes; many small writes in order, by one launch that reads
//! the chunk over the bus) or one DMA each (large ones).
//!
//! The batch and its `submit` live here; the routes it takes run in `engine::routes`
//! (`in_place`, `upload_planned`, `upload_in_order`), reading the batch through the
//! `UploadView` that `submit` lends them.

mod submit;

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use super::BufferTable;
use super::scope::Submitted;
use crate::alloc::ResidentBuffer;
use crate::engine::core::Core;
use crate::engine::fills::{FILL_COST, ParFills};
use crate::engine::host::Source;
use crate::engine::pipeline::{self, PARALLEL_MIN};
use crate::engine::routes::in_place::CLOSED;
use crate::engine::spares::UploadParts;
use crate::error::{Error, Result};
use crate::host_pool::{HostLease, arena_floor};
use crate::kernels::{SEGMENT, table_bytes};
use crate::plan::WriteRequest;
use crate::plan::route::FIRST_CHUNK;

/// The most bytes an arena lease opened by [`UploadBatch::write_with_par`] holds where leases
/// with fills move over the bus (or `chunk_bytes`, if less; the first leases of a batch hold
/// less, [`par_lease`]): each lease moves once its fills are done, and costs one launch.
const PAR_LEASE: usize = 4 << 20;

/// The bytes for packed writes of arena lease `k` of a batch, opened for fills at submit
/// where leases with fills move over the bus: [`FIRST_CHUNK`], doubling with each lease, up
/// to [`PAR_LEASE`] (or `chunk_bytes`, if less). The first launch waits only for the first
/// lease's fills: the link starts soon after submit, and the later, larger leases cost
/// fewer launches.
fn par_lease(k: usize, chunk_bytes: usize) -> usize {
    let growing = (FIRST_CHUNK as usize).saturating_mul(1 << k.min(16));
    growing.min(PAR_LEASE).min(chunk_bytes)
}

/// A batch of host-to-device writes. Writes apply in order: where two overlap, the later one
/// wins. Nothing moves until [`UploadBatch::submit`], which returns the [`Fence`](crate::Fence) of the
/// batch's last submission.
///
/// Every write is checked when it is added; a bad one returns its error and also fails
/// `submit`, so a batch with a bad write never moves anything.
///
/// One type, two kinds of batch, with the same methods:
/// - from [`Device::uploads`](crate::Device::uploads), an **ordinary** batch: `submit`
///   copies every slice into pinned staging before it returns, so the caller's memory is
///   free again at once;
/// - from [`Scope::uploads`](crate::Scope::uploads), a **scoped** batch: its slices stay
///   borrowed until the scope ends, and `submit` moves those in pinned memory in place,
///   with no staging copy (the scope waits for them); see [`Scope`](crate::Scope). A scoped
///   batch that holds fills ([`write_with`](UploadBatch::write_with),
///   [`write_with_par`](UploadBatch::write_with_par)) moves whole as an ordinary one does:
///   its slices are copied through staging at `submit`.
///
/// `UploadBatch<'a>` is invariant in `'a`: a scoped batch borrows for the scope's whole
/// life, and could take memory that dies before the scope waits for it if it could be
/// coerced to a shorter lifetime. An ordinary batch loses nothing by it: `'a` is inferred
/// where the batch is made, as the borrows of its device and of its slices allow, and the
/// batch has no destructor of its own, so it may borrow data declared after it.
///
/// ```compile_fail,E0597
/// # fn f(device: &cuda_resident::Device, pool: cuda_resident::ResidentBuffer) -> cuda_resident::Result<()> {
/// device.scope(|s| {
///     let local = vec![1u8; 4096];
///     // The scope's batch would have to shrink to `local`'s life, which ends before the
///     // scope waits: refused.
///     let mut writes: cuda_resident::UploadBatch<'_> = s.uploads();
///     writes.write(pool, 0, &local)?;
///     writes.submit().map(drop)
/// })
/// # }
/// ```
#[must_use = "an upload batch moves nothing until it is submitted"]
pub struct UploadBatch<'a> {
    pub(in crate::transfer) core: &'a Arc<Core>,
    pub(in crate::transfer) table: BufferTable,
    pub(in crate::transfer) writes: Vec<WriteRequest>,
    pub(in crate::transfer) sources: Vec<Source<'a>>,
    pub(in crate::transfer) arena: Vec<HostLease>,
    /// Bytes used in each arena lease.
    arena_used: Vec<usize>,
    /// Descriptors of each arena lease's writes (0: nothing to move), counted as they are
    /// added, so that submit learns each lease's table size without a pass over the writes.
    arena_descriptors: Vec<u64>,
    /// Writes of a caller's slice (not made in place).
    slice_writes: usize,
    /// The fills of [`UploadBatch::write_with_par`], in the order of their writes, run at
    /// submit.
    par: ParFills,
    /// Their work so far ([`FILL_COST`] a fill and its bytes): once it passes
    /// [`PARALLEL_MIN`], the packing threads are woken for the submit to come.
    par_work: usize,
    error: Option<Error>,
    spare: Spare,
    /// The scope of a batch from [`Scope::uploads`](crate::Scope::uploads), which waits for
    /// its submissions; `None` for an ordinary batch.
    pub(in crate::transfer) scope: Option<&'a Submitted>,
    /// Invariant in 'a: a scoped batch must not shrink to a shorter borrow, or it would take
    /// memory that dies before the scope waits for it.
    invariant: PhantomData<&'a mut &'a ()>,
}

/// Hands a submitted batch's vectors back to its device when the batch goes. A field of its
/// own, without the batch's lifetime: the batch itself has no `Drop`, so it may borrow data
/// declared after it, as any struct of references.
struct Spare {
    core: Arc<Core>,
    parts: UploadParts,
}

impl Drop for Spare {
    fn drop(&mut self) {
        // A batch dropped unsubmitted has nothing to hand back (and must not push out a
        // spare that has capacity).
        if self.parts.writes.capacity() > 0 {
            self.core.spares.upload.give(std::mem::take(&mut self.parts));
        }
    }
}

impl fmt::Debug for UploadBatch<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UploadBatch").field("writes", &self.writes.len()).finish_non_exhaustive()
    }
}

/// The most items a bulk call reserves room for up front, whatever its iterator's size hint
/// says (more are added as they come).
pub(crate) const RESERVE_MOST: usize = 1 << 16;

/// The work of [`Device::uploads`](crate::Device::uploads).
pub(crate) fn uploads(core: &Arc<Core>) -> UploadBatch<'_> {
    batch(core, None)
}

/// The work of [`Scope::uploads`](crate::Scope::uploads): a batch whose submissions `seen`
/// records, for its scope to wait for.
pub(crate) fn scoped<'a>(core: &'a Arc<Core>, seen: &'a Submitted) -> UploadBatch<'a> {
    batch(core, Some(seen))
}

fn batch<'a>(core: &'a Arc<Core>, scope: Option<&'a Submitted>) -> UploadBatch<'a> {
    let parts = core.spares.upload.take();
    UploadBatch {
        core,
        table: parts.table,
        writes: parts.writes,
        sources: parts.sources,
        arena: Vec::new(),
        arena_used: parts.arena_used,
        arena_descriptors: parts.arena_descriptors,
        slice_writes: 0,
        par: parts.par,
        par_work: 0,
        error: None,
        spare: Spare { core: Arc::clone(core), parts: UploadParts::default() },
        scope,
        invariant: PhantomData,
    }
}

impl<'a> UploadBatch<'a> {
    /// Checks a write and records it; on error, poisons the batch. A batch poisoned by a
    /// write that failed part-way ([`Error::BatchPoisoned`]) takes no more writes.
    #[inline(always)]
    fn add(&mut self, buffer: ResidentBuffer, offset: u64, len: u64) -> Result<()> {
        if let Some(e @ Error::BatchPoisoned { .. }) = &self.error {
            return Err(e.clone());
        }
        let (key, buffer_len) = self.table.check(&self.core.alloc, buffer, offset, len, &mut self.error)?;
        self.push_write(key, buffer_len, offset, len);
        Ok(())
    }

    /// Records a checked write of `len` bytes at `offset` of the buffer with key `key`.
    #[inline(always)]
    fn push_write(&mut self, key: u32, buffer_len: u64, offset: u64, len: u64) {
        self.writes.push(WriteRequest { buffer: u64::from(key), buffer_len, offset, len });
    }

    /// Records the source of the write just recorded, a caller's slice.
    #[inline(always)]
    fn push_slice(&mut self, data: &'a [u8]) {
        self.sources.push(Source::Slice(data));
        self.slice_writes += 1;
    }

    /// Adds a write of `data` to `buffer` at `offset`. An ordinary batch reads the slice at
    /// submit time; a scoped one borrows it until the scope ends, and the GPU reads it in
    /// place where it lies in pinned memory (this crate's, or runs of memory pinned by
    /// [`Device::pin_host`](crate::Device::pin_host)).
    ///
    /// # Errors
    /// A bad range (returned here and again by `submit`); [`Error::BatchPoisoned`] once a
    /// [`write_with`](UploadBatch::write_with) of the batch failed part-way.
    #[inline]
    pub fn write(&mut self, buffer: ResidentBuffer, offset: u64, data: &'a [u8]) -> Result<&mut Self> {
        // The hot path, inlined into the caller's loop: a batch not poisoned, a buffer it
        // named before, a range inside it. Everything else goes the cold way.
        let len = data.len() as u64;
        if !matches!(self.error, Some(Error::BatchPoisoned { .. }))
            && let Some((key, buffer_len)) = self.table.hit(buffer, offset, len)
        {
            self.push_write(key, buffer_len, offset, len);
            self.push_slice(data);
            return Ok(self);
        }
        self.write_cold(buffer, offset, data)
    }

    /// [`UploadBatch::write`] where [`BufferTable::hit`] found nothing.
    #[cold]
    #[inline(never)]
    fn write_cold(&mut self, buffer: ResidentBuffer, offset: u64, data: &'a [u8]) -> Result<&mut Self> {
        let len = data.len() as u64;
        if !matches!(self.error, Some(Error::BatchPoisoned { .. }))
            && let Some((key, buffer_len)) = self.table.hit_kept(&self.core.alloc, buffer, offset, len)
        {
            self.push_write(key, buffer_len, offset, len);
            self.push_slice(data);
            return Ok(self);
        }
        self.add(buffer, offset, len)?;
        self.push_slice(data);
        Ok(self)
    }

    /// Adds a write for each `(buffer, offset, data)` item, in order, as that many
    /// [`write`](UploadBatch::write)s would (each slice read as `write` says), with less
    /// work per item: room reserved up front, no result per item.
    ///
    /// # Errors
    /// For the first bad item, [`Error::BadItem`] naming its index and holding the error
    /// `write` returns for it; the batch keeps the items before it and fails `submit` with
    /// that error, as after a bad `write`; the items after it are not added.
    /// [`Error::BatchPoisoned`] (adding nothing) once a
    /// [`write_with`](UploadBatch::write_with) of the batch failed part-way.
    ///
    /// # Panics
    /// Where the iterator panics, the panic goes on to the caller, and the batch keeps
    /// [`Error::ItemsPanicked`]: a caller that catches the panic finds `submit` failing with
    /// it, moving nothing.
    pub fn write_many<I>(&mut self, items: I) -> Result<&mut Self>
    where
        I: IntoIterator<Item = (ResidentBuffer, u64, &'a [u8])>,
    {
        if let Some(e @ Error::BatchPoisoned { .. }) = &self.error {
            return Err(e.clone());
        }
        let items = items.into_iter();
        // Room for the items the iterator promises, up to a bound: its hint is not trusted
        // with the process's memory.
        let lower = items.size_hint().0.min(RESERVE_MOST);
        self.writes.reserve(lower);
        self.sources.reserve(lower);
        Error::add_items(
            "UploadBatch::write_many",
            self,
            |batch| &mut batch.error,
            |batch, at| {
                for (buffer, offset, data) in items {
                    let len = data.len() as u64;
                    // `check`, with only the cold path's result matched.
                    let (key, buffer_len) = match batch.table.hit(buffer, offset, len) {
                        Some(found) => found,
                        None => batch.table.check_cold(&batch.core.alloc, buffer, offset, len, &mut None)?,
                    };
                    batch.push_write(key, buffer_len, offset, len);
                    *at += 1;
                    batch.push_slice(data);
                }
                Ok(())
            },
        )?;
        Ok(self)
    }

    /// Poisons the batch after write `index` (`len` bytes at `offset` of `buffer`) failed
    /// part-way for `cause`: drops the write, returns every pinned lease of the batch to the
    /// pool at once, and keeps the error that every later call and `submit` return.
    fn poison(&mut self, index: usize, (buffer, offset, len): (ResidentBuffer, u64, usize), cause: String) {
        // The error first: whatever follows, the batch refuses every later call.
        self.error = Some(Error::BatchPoisoned { write: index, buffer, offset, len: len as u64, cause });
        self.writes.truncate(index);
        self.sources.truncate(index);
        self.arena.clear();
        self.arena_used.clear();
        self.arena_descriptors.clear();
        self.par.clear();
        self.table.apart.broken = true;
    }

    /// Adds a write of `len` bytes to `buffer` at `offset` whose bytes `fill` produces in
    /// place, straight into pinned memory: no copy of the caller's own.
    ///
    /// # Errors
    /// A bad range fails this write and `submit`, as for [`UploadBatch::write`]. When the
    /// write cannot take pinned memory ([`Error::PinnedExhausted`], a driver error), that
    /// error is returned and the batch is poisoned: every later call and `submit` fail with
    /// [`Error::BatchPoisoned`] naming this write, and its staging goes back to the pool at
    /// once. A batch already poisoned returns that error without calling `fill`.
    ///
    /// # Panics
    /// If `fill` panics, the panic goes on to the caller, and the batch is poisoned as
    /// above: a caller that catches the panic can neither add to the batch nor move it.
    pub fn write_with(
        &mut self,
        buffer: ResidentBuffer,
        offset: u64,
        len: usize,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<&mut Self> {
        let (lease, at) = self.stage(buffer, offset, len, false)?;
        // SAFETY: the arena is this batch's own; no copy uses it before submit.
        let region = unsafe { self.arena[lease as usize].as_mut_slice() };
        let dst = &mut region[at..at + len];
        // A panic of `fill` must not leave the write recorded without its source: the batch
        // is poisoned (nothing of it moves) before the panic goes on.
        if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| fill(dst))) {
            let index = self.writes.len() - 1;
            self.poison(index, (buffer, offset, len), "panicked in its fill closure".to_owned());
            std::panic::resume_unwind(panic);
        }
        self.sources.push(Source::Arena { lease, offset: at });
        Ok(self)
    }

    /// Adds a write of `len` bytes to `buffer` at `offset` whose bytes `fill` produces in
    /// place, in pinned memory, as [`write_with`](UploadBatch::write_with) does, but later:
    /// at [`submit`](UploadBatch::submit), many fills at once, lease by lease of staging,
    /// each lease moving as soon as its fills are done while later leases are still being
    /// filled. Fills run in groups of about equal work (a fill's bytes and the cost of a
    /// call), a few per lease and thread, never a task per fill, on the packing threads
    /// and the calling thread; a batch of less than about a megabyte of work runs them on
    /// the calling thread alone, as `write_with` would. Adding one keeps the closure's bytes
    /// and a small record in vectors the device reuses: no allocation per call. Where the
    /// copy kernel may read them over the bus
    /// ([`Config::small_copies_over_bus`](crate::Config::small_copies_over_bus)), the leases
    /// this call opens hold 256 KiB, then twice as much each, up to 4 MiB (or `chunk_bytes`,
    /// if less), so that the link starts soon after submit, and the kernel reads them in
    /// place; else they hold `chunk_bytes` and move by a DMA each. (A batch whose writes
    /// overlap or touch, or that mixes in [`write`](UploadBatch::write)s, runs every fill
    /// first and then moves the batch as a whole.) For fills that cost as much as the move
    /// (a copy, a conversion, a generator).
    ///
    /// `fill` is `Send` (it runs on another thread) and `Copy` (it holds references and
    /// plain values, no destructor: the batch keeps it without owning anything of the
    /// caller's). It is called at most once: not at all if the batch is dropped or
    /// poisoned, or fails before its lease, or once an earlier fill of the batch has
    /// panicked (fills already running on other threads finish); `submit` returns only after
    /// every fill that started has returned.
    ///
    /// Fills run while the batch holds the device's upload lane: a fill must not move data
    /// of this device itself (that would wait for the lane for ever).
    ///
    /// ```no_run
    /// # fn demo(device: &cuda_resident::Device, rows: &[Vec<u8>], b: cuda_resident::ResidentBuffer) -> cuda_resident::Result<()> {
    /// let mut uploads = device.uploads();
    /// for (k, row) in rows.iter().enumerate() {
    ///     // Captures a reference: `Copy` and `Send`.
    ///     uploads.write_with_par(b, k as u64 * 4096, row.len(), move |dst| dst.copy_from_slice(row))?;
    /// }
    /// uploads.submit()?.wait()?;
    /// # Ok(()) }
    /// ```
    ///
    /// A closure that owns a value with a destructor is not `Copy`; capture a reference to it:
    ///
    /// ```compile_fail
    /// # fn demo(uploads: &mut cuda_resident::UploadBatch<'_>, b: cuda_resident::ResidentBuffer) {
    /// let v = vec![1u8; 4];
    /// uploads.write_with_par(b, 0, 4, move |dst| dst.copy_from_slice(&v)).unwrap();
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`write_with`](UploadBatch::write_with) (a bad range; refused pinned memory,
    /// which poisons the batch). A fill that panics makes `submit` fail with
    /// [`Error::FillPanicked`] naming its write; see there for what moved.
    pub fn write_with_par<F>(
        &mut self,
        buffer: ResidentBuffer,
        offset: u64,
        len: usize,
        fill: F,
    ) -> Result<&mut Self>
    where
        F: FnOnce(&mut [u8]) + Send + Copy + 'a,
    {
        let (lease, at) = self.stage(buffer, offset, len, true)?;
        self.par.push(self.writes.len() - 1, fill);
        self.sources.push(Source::Arena { lease, offset: at });
        let before = self.par_work;
        self.par_work = before.saturating_add(len + FILL_COST);
        if before < PARALLEL_MIN && self.par_work >= PARALLEL_MIN {
            // Enough fills to run them on the packing threads: they are woken now (and
            // linger), so that submit finds them awake, not asleep since the last batch.
            pipeline::linger(&self.core.packers);
        }
        Ok(self)
    }

    /// Checks a write of `len` bytes made in place and gives it room in the batch's arena:
    /// the lease and the offset in it. On a refusal of pinned memory, poisons the batch.
    /// Inlined into the caller's loop: [`UploadBatch::stage_hit`] serves most writes, the
    /// rest go to [`UploadBatch::stage_cold`].
    #[inline(always)]
    fn stage(&mut self, buffer: ResidentBuffer, offset: u64, len: usize, par: bool) -> Result<(u32, usize)> {
        match self.stage_hit(buffer, offset, len) {
            Some(room) => Ok(room),
            None => self.stage_cold(buffer, offset, len, par),
        }
    }

    /// [`UploadBatch::stage`]'s hot path: a batch not poisoned, a write that fits the open
    /// arena lease, to a buffer the batch named before, a range inside it. `None` (nothing
    /// noted) otherwise, for `stage_cold` to decide.
    #[inline(always)]
    fn stage_hit(&mut self, buffer: ResidentBuffer, offset: u64, len: usize) -> Option<(u32, usize)> {
        if matches!(self.error, Some(Error::BatchPoisoned { .. })) {
            return None;
        }
        // The room first: `hit` notes the write in the batch's layout.
        let (lease, at) = self.arena_room(offset, len)?;
        let (key, buffer_len) = self.table.hit(buffer, offset, len as u64)?;
        self.push_write(key, buffer_len, offset, len as u64);
        self.arena_take(lease, at, len);
        Some((lease as u32, at))
    }

    /// Where a write of `len` bytes at `offset` goes in the batch's open arena lease (the
    /// last one), if it fits there: the lease and the offset in it, nothing changed. `None`
    /// when it needs a lease: a write that will be its own DMA gets one of its own, so that
    /// arena leases hold only packed writes and move whole.
    #[inline(always)]
    fn arena_room(&self, offset: u64, len: usize) -> Option<(usize, usize)> {
        if len as u64 >= self.core.config.direct_threshold {
            return None;
        }
        let lease = self.arena.len().checked_sub(1)?;
        let used = self.arena_used[lease];
        if used == CLOSED {
            return None;
        }
        // Same address residue mod 16 as the destination (buffers are 256-aligned), so the
        // scatter can use 16-byte accesses.
        let at = used.next_multiple_of(16) + (offset % 16) as usize;
        // A lease holds its writes' bytes and, after them (from a multiple of 256), their
        // descriptor table: submit writes it there, so that moving the arena takes no more
        // pinned memory than adding to it did.
        let end = (at + len).next_multiple_of(256) as u64;
        let descriptors = self.arena_descriptors[lease] + (len as u64).div_ceil(SEGMENT);
        (end + table_bytes(descriptors) <= self.arena[lease].len() as u64).then_some((lease, at))
    }

    /// Counts a write of `len` bytes at `at` of arena lease `lease`.
    #[inline(always)]
    fn arena_take(&mut self, lease: usize, at: usize, len: usize) {
        if self.arena_used[lease] != CLOSED {
            self.arena_used[lease] = at + len;
        }
        self.arena_descriptors[lease] += (len as u64).div_ceil(SEGMENT);
    }

    /// [`UploadBatch::stage`] for every write its hot path does not serve: checks the write
    /// in full, and opens a lease where the open one has no room.
    #[cold]
    #[inline(never)]
    fn stage_cold(
        &mut self,
        buffer: ResidentBuffer,
        offset: u64,
        len: usize,
        par: bool,
    ) -> Result<(u32, usize)> {
        self.add(buffer, offset, len as u64)?;
        if let Some((lease, at)) = self.arena_room(offset, len) {
            self.arena_take(lease, at, len);
            return Ok((lease as u32, at));
        }
        let own = len as u64 >= self.core.config.direct_threshold;
        // A lease opened for fills at submit is smaller when it moves over the bus: the first
        // launch waits for its fills only. The first leases are smaller still, doubling from
        // `FIRST_CHUNK`, so that the link starts soon after submit.
        let chunk = self.core.config.chunk_bytes as usize;
        let packed = match par && self.core.moves_small_copies_over_bus() {
            true => par_lease(self.arena.len(), chunk),
            false => chunk,
        };
        // A sixteenth more for the table: room for the whole table of writes of 384 bytes or
        // more (24 bytes of descriptor each), so that they fill the lease's bytes as before
        // the table moved in (4096 writes of 4 KiB in a 16 MiB chunk); but never an arena
        // past half the cap, so that two leases fit the smallest pool (two chunks).
        let room = (packed + packed / 16).min(arena_floor(self.core.config.pinned_cap_bytes / 2) as usize);
        let size = if own {
            len + 16
        } else {
            room.max((len + 32).next_multiple_of(256) + table_bytes((len as u64).div_ceil(SEGMENT)) as usize)
        };
        match self.core.acquire_staging(size) {
            Ok(lease) => {
                self.arena.push(lease);
                // An own lease is closed to later writes.
                self.arena_used.push(if own { CLOSED } else { 0 });
                self.arena_descriptors.push(0);
            }
            Err(e) => {
                let index = self.writes.len() - 1;
                // What happened, without the refusal's own Fix (the caller had it with the
                // refusal; the poisoned batch's error ends with its own).
                let text = e.to_string();
                let what = text.split(" Fix: ").next().unwrap_or(&text).trim_end_matches('.');
                self.poison(index, (buffer, offset, len), format!("was refused pinned staging ({what})"));
                return Err(e);
            }
        }
        // A fresh lease: the write at the start, at its residue.
        let (lease, at) = (self.arena.len() - 1, (offset % 16) as usize);
        self.arena_take(lease, at, len);
        Ok((lease as u32, at))
    }

    /// Number of writes added.
    pub fn len(&self) -> usize {
        self.writes.len()
    }

    /// Whether no write was added.
    pub fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }
}

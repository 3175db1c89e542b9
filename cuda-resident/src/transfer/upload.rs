//! Uploads: a batch of writes, fused, staged once in pinned memory and moved by one DMA plus
//! one scatter per chunk (small writes; many small writes in order, by one launch that reads
//! the chunk over the bus) or one DMA each (large ones).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::BufferTable;
use crate::alloc::ResidentBuffer;
use crate::engine::Exec;
use crate::engine::core::Core;
use crate::engine::fills::{FILL_COST, Fills, ParFills};
use crate::engine::host::Piece;
use crate::engine::host::Source;
use crate::engine::order::Ranges;
use crate::engine::pipeline::{self, Groups, PARALLEL_MIN, Step};
use crate::engine::spares::UploadParts;
use crate::engine::staging::DeviceStaging;
use crate::error::{Error, Result};
use crate::host_pool::{HostLease, arena_floor};
use crate::kernels::{CopyDescriptor, SEGMENT, descriptor_area, push_descriptors, table_bytes};
use crate::plan::route::{
    self, FIRST_CHUNK, PIPELINE_DEPTH, RING, Route, Span, UploadShape, cut_apart, growing, in_order_chunk,
};
use crate::plan::{PlanConfig, WriteRequest};
use crate::stream::{Fence, LaneKind, SIDE_SLOTS};
use crate::sync::lock;

/// A chunk with at most this many packed copies moves them by one DMA each, without the
/// kernel: for a handful of copies, DMAs cost less than a launch.
const KERNEL_MIN_COPIES: usize = 3;

/// `arena_used` of a lease that holds one large write and takes no more.
const CLOSED: usize = usize::MAX;

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

/// A batch of host-to-device writes ([`Device::uploads`](crate::Device::uploads)). Writes apply in order: where
/// two overlap, the later one wins. Nothing moves until [`UploadBatch::submit`].
///
/// Every write is checked when it is added; a bad one returns its error and also fails
/// `submit`, so a batch with a bad write never moves anything.
#[must_use = "an upload batch moves nothing until it is submitted"]
pub struct UploadBatch<'a> {
    core: &'a Arc<Core>,
    table: BufferTable,
    writes: Vec<WriteRequest>,
    sources: Vec<Source<'a>>,
    arena: Vec<HostLease>,
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
    }
}

impl<'a> UploadBatch<'a> {
    /// The device ranges of the batch's writes, for `Exec::claim_ranges`.
    fn ranges(&self) -> impl FnOnce(&mut Ranges) + '_ {
        |ranges| self.table.push_ranges(ranges, self.writes.iter().map(|w| (w.buffer, w.offset, w.len)))
    }

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

    /// Adds a write of `data` to `buffer` at `offset`. The slice is read at submit time.
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
        self.add(buffer, offset, data.len() as u64)?;
        self.push_slice(data);
        Ok(self)
    }

    /// Adds a write for each `(buffer, offset, data)` item, in order, as that many
    /// [`write`](UploadBatch::write)s would (each slice is read at submit time), with less
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
    fn stage(&mut self, buffer: ResidentBuffer, offset: u64, len: usize, par: bool) -> Result<(u32, usize)> {
        self.add(buffer, offset, len as u64)?;
        // Same address residue mod 16 as the destination (buffers are 256-aligned), so the
        // scatter can use 16-byte accesses.
        let residue = (offset % 16) as usize;
        // A lease holds its writes' bytes and, after them (from a multiple of 256), their
        // descriptor table: submit writes it there, so that moving the arena takes no more
        // pinned memory than adding to it did.
        let descriptors = (len as u64).div_ceil(SEGMENT);
        let fits = |lease: &HostLease, used: usize, counted: u64| {
            let end = (used.next_multiple_of(16) + residue + len).next_multiple_of(256) as u64;
            end + table_bytes(counted + descriptors) <= lease.len() as u64
        };
        // A write that will be its own DMA gets a lease of its own, so that arena leases hold
        // only packed writes and move whole.
        let own = len as u64 >= self.core.config.direct_threshold;
        let last = self.arena.len().checked_sub(1);
        let open = |i: usize| {
            self.arena_used[i] != CLOSED
                && fits(&self.arena[i], self.arena_used[i], self.arena_descriptors[i])
        };
        let reuse = !own && last.is_some_and(open);
        if !reuse {
            // A lease opened for fills at submit is smaller when it moves over the bus: the
            // first launch waits for its fills only. The first leases are smaller still,
            // doubling from `FIRST_CHUNK`, so that the link starts soon after submit.
            let chunk = self.core.config.chunk_bytes as usize;
            let packed = match par && self.core.moves_small_copies_over_bus() {
                true => par_lease(self.arena.len(), chunk),
                false => chunk,
            };
            // A sixteenth more for the table: room for the whole table of writes of 384
            // bytes or more (24 bytes of descriptor each), so that they fill the lease's
            // bytes as before the table moved in (4096 writes of 4 KiB in a 16 MiB chunk);
            // but never an arena past half the cap, so that two leases fit the smallest
            // pool (two chunks).
            let room =
                (packed + packed / 16).min(arena_floor(self.core.config.pinned_cap_bytes / 2) as usize);
            let size = if own {
                len + 16
            } else {
                room.max((len + 32).next_multiple_of(256) + table_bytes(descriptors) as usize)
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
        }
        let lease_index = self.arena.len() - 1;
        let used = if own { 0 } else { self.arena_used[lease_index] };
        let at = used.next_multiple_of(16) + residue;
        if !own {
            self.arena_used[lease_index] = at + len;
        }
        self.arena_descriptors[lease_index] += descriptors;
        Ok((lease_index as u32, at))
    }

    /// Runs every fill of [`write_with_par`](UploadBatch::write_with_par), before a route
    /// that reads the arena as a whole: in groups as [`execute_in_place`] runs them, on the
    /// packing threads and the calling thread, or on the calling thread alone for a small
    /// batch.
    fn run_fills(&self) -> Result<()> {
        if self.par.is_empty() {
            return Ok(());
        }
        let bases: Vec<usize> = self.arena.iter().map(|l| l.as_ptr() as usize).collect();
        let fills = Fills::new(&self.par, &self.writes, &self.sources, &bases);
        let spans = self.par.spans(&self.sources, bases.len());
        let (groups, work) = fills.groups(&spans, self.core.packers().current_num_threads());
        let all = bases.len();
        pipeline::run(&self.core.packers, &groups, work, all, |_| Ok(true), |_, items| fills.run(items))?;
        match fills.panics.first(usize::MAX) {
            Some(error) => Err(self.fill_panicked(error)),
            None => Ok(()),
        }
    }

    /// The error of fill `i` (of `par`), which panicked with `cause`.
    fn fill_panicked(&self, (i, cause): (usize, String)) -> Error {
        let write = self.par.write_of(i);
        let w = &self.writes[write];
        let buffer = self.table.entries[w.buffer as usize].buffer;
        Error::FillPanicked { write, buffer, offset: w.offset, len: w.len, cause }
    }

    /// Number of writes added.
    pub fn len(&self) -> usize {
        self.writes.len()
    }

    /// Whether no write was added.
    pub fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }

    /// Moves the batch to the device and returns at once; the fence completes when every
    /// byte has landed. Fails (with nothing enqueued) if any write was bad, a buffer was
    /// freed since it was added, or the batch was poisoned by a `write_with` that failed
    /// part-way ([`Error::BatchPoisoned`]).
    pub fn submit(mut self) -> Result<Fence> {
        let submitted = self.submit_inner();
        // The vectors go back for the next batch (emptied: no borrowed slice outlives this).
        use std::mem::take;
        self.spare.parts = UploadParts {
            table: take(&mut self.table),
            writes: take(&mut self.writes),
            sources: crate::recycle::relabel(take(&mut self.sources)),
            arena_used: take(&mut self.arena_used),
            arena_descriptors: take(&mut self.arena_descriptors),
            par: take(&mut self.par),
        };
        submitted
    }

    /// The route the batch takes, as its writes stand ([`route::upload_route`]).
    pub(crate) fn route(&self) -> Route {
        let single_slice = match (&self.writes[..], &self.sources[..]) {
            ([write], [Source::Slice(_)]) => Some(write.len),
            _ => None,
        };
        route::upload_route(&UploadShape {
            writes: self.writes.len(),
            single_slice,
            in_place: !self.arena.is_empty(),
            slice_writes: self.slice_writes,
            apart: &self.table.apart,
            direct_threshold: self.core.config.direct_threshold,
        })
    }

    fn submit_inner(&mut self) -> Result<Fence> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        match self.route() {
            Route::One => {
                let ([write], [Source::Slice(data)]) = (&self.writes[..], &self.sources[..]) else {
                    unreachable!("the route of one write from a slice")
                };
                execute_one(self.core, &self.table, write, data)
            }
            // Writes that fuse go to the planner.
            Route::InPlace => match execute_in_place(self)? {
                Some(fence) => Ok(fence),
                None => {
                    self.run_fills()?;
                    execute(self, Route::Planned)
                }
            },
            route => {
                self.run_fills()?;
                execute(self, route)
            }
        }
    }
}

impl Source<'_> {
    /// The address of byte `offset` of the write's data.
    fn at(&self, arena: &[HostLease], offset: u64) -> *const u8 {
        match *self {
            Source::Slice(s) => s[offset as usize..].as_ptr(),
            // SAFETY: offset lies within the write, which lies within its lease.
            Source::Arena { lease, offset: at } => unsafe {
                arena[lease as usize].as_ptr().add(at + offset as usize)
            },
        }
    }
}

/// One small write (below the direct threshold), the latency path: staged by one memcpy on
/// this thread and moved by one DMA, no planning. Larger single writes take the general
/// path, which packs on the packing threads and pipelines chunks.
fn execute_one(core: &Arc<Core>, table: &BufferTable, write: &WriteRequest, data: &[u8]) -> Result<Fence> {
    let target = table.entries[write.buffer as usize];
    // The lane first, then the staging (as every transfer takes them): a transfer that
    // waits for staging holds its lane, and waits only for staging that comes back.
    let mut exec = Exec::begin(core, LaneKind::Upload);
    let mut lease = exec.lease(data.len())?;
    // SAFETY: the lease is fresh (no copy uses it) and holds data.len() bytes.
    unsafe { lease.as_mut_slice() }.copy_from_slice(data);
    let lease = Arc::new(lease);
    let src = lease.as_ptr();
    exec.claim_ranges(std::iter::once(target.buffer), 1, |r| r.push(target.ptr + write.offset, write.len))?;
    exec.requested(write.len);
    exec.submit(vec![lease], |q| {
        // SAFETY: pinned staging kept alive by this submission, into a live, marked buffer
        // range checked when the write was added.
        unsafe { q.htod(target.ptr + write.offset, src, data.len()) }
    })?;
    Ok(exec.finish())
}

/// The in-place fast path: every write was made with `write_with` or `write_with_par` and
/// no two fuse, so the arena already is the staging. Nothing is copied on the host.
///
/// A lease holding fills of `write_with_par`, where the device allows copies over the bus
/// ([`Core::moves_small_copies_over_bus`]), moves by one launch on the lane's stream that
/// reads the lease in place, its descriptor table in a pinned lease of its own: no DMA, no
/// device staging, no side stream. Every other packed lease moves whole by one DMA and is
/// spread by one launch: its DMA is enqueued first and its descriptor table built while it
/// is on the wire (the table follows the bytes in device staging), so the link starts at
/// once; with several such leases, they alternate between two regions of device staging and
/// each one's scatter runs on the lane's side stream while the next one's bytes are on the
/// wire; the last one's scatter runs on the lane's stream, after the side work. Writes with a
/// lease of their own move by one DMA each.
///
/// Returns `None` (changing nothing) when writes overlap or touch, for the general path
/// (which runs every fill first and packs the arena's bytes again).
fn execute_in_place(batch: &mut UploadBatch<'_>) -> Result<Option<Fence>> {
    let core = batch.core;
    let mut exec = Exec::begin(core, LaneKind::Upload);
    let mut scratch = lock(&core.staging[LaneKind::Upload.index()]);
    let scratch = &mut *scratch;
    let plan_config = PlanConfig {
        direct_threshold: core.config.direct_threshold,
        chunk_bytes: core.config.chunk_bytes,
        align: 16,
    };
    // Writes apart (as added) are all non-empty and in order.
    let apart = &batch.table.apart;
    let (non_empty, requested) = if apart.broken {
        (batch.writes.iter().filter(|w| w.len > 0).count(), batch.writes.iter().map(|w| w.len).sum())
    } else {
        (batch.writes.len(), apart.requested)
    };
    // Writes in order are disjoint: no planning needed to know that none fuse. Otherwise the
    // planner tells (writes out of order may still be disjoint).
    if apart.broken && !scratch.planner.is_in_order(&batch.writes) {
        scratch.planner.plan_upload_into(&batch.writes, &plan_config, &mut scratch.upload_plan)?;
        if scratch.upload_plan.intervals != non_empty {
            return Ok(None);
        }
    }
    if non_empty == 0 {
        drop(exec);
        batch.run_fills()?;
        return Ok(Some(Fence::completed()));
    }
    // Nothing before the first DMA passes over the writes: what it needs was counted per
    // lease as the writes were added.
    let leases: Vec<Arc<HostLease>> = batch.arena.drain(..).map(Arc::new).collect();
    let own = |i: usize| batch.arena_used[i] == CLOSED;
    let has_bytes = |i: usize| batch.arena_descriptors[i] > 0;
    let ptr_of = |w: usize| batch.table.entries[batch.writes[w].buffer as usize].ptr + batch.writes[w].offset;
    let offset_of = |w: usize| match batch.sources[w] {
        Source::Arena { offset, .. } => offset as u64,
        Source::Slice(_) => unreachable!("only arena writes take this path"),
    };
    // Leases are opened in the order of the writes, so each lease's writes are a run of
    // consecutive writes: found by binary search, from where the last lease's run ended.
    let lease_of = |source: &Source<'_>| match *source {
        Source::Arena { lease, .. } => lease as usize,
        Source::Slice(_) => unreachable!("only arena writes take this path"),
    };
    // Each lease's writes, and its fills of `write_with_par` (indices of `par`).
    let fill_spans = batch.par.spans(&batch.sources, leases.len());
    let mut runs = Vec::with_capacity(leases.len());
    let mut first = 0;
    for (i, fills) in fill_spans.iter().enumerate() {
        let end = first + batch.sources[first..].partition_point(|s| lease_of(s) <= i);
        runs.push((std::mem::replace(&mut first, end)..end, fills.clone()));
    }
    // Device staging for a packed lease: its bytes, then its table.
    let table_at = |i: usize| (batch.arena_used[i] as u64).next_multiple_of(256);
    let areas: Vec<u64> = batch.arena_descriptors.iter().map(|&n| table_bytes(n)).collect();
    // A lease with fills made at submit moves over the bus where the device allows: the
    // kernel reads it in place, from lines the fills just wrote, which it reads faster than a
    // DMA does (50 against 43 GB/s: docs/runs/2026-12-01-h200-ceilings-ed801f4.md). Others
    // move by a DMA into device staging and a scatter there.
    let over_bus = core.moves_small_copies_over_bus();
    let bus = |i: usize| over_bus && !own(i) && has_bytes(i) && !runs[i].1.is_empty();
    let packed: Vec<usize> = (0..leases.len()).filter(|&i| !own(i) && has_bytes(i) && !bus(i)).collect();
    let packed_need = packed.iter().map(|&i| table_at(i) + areas[i]).max().unwrap_or(0);
    // Two regions when a lease's scatter may overlap the next one's DMA.
    let regions = packed.len().min(SIDE_SLOTS) as u64;
    let region_stride = packed_need.next_multiple_of(256);
    // A DMA, then a table and a launch, for each packed lease; a launch for each lease over
    // the bus; a DMA for each own one.
    let singles = (0..leases.len()).filter(|&i| bus(i) || (own(i) && has_bytes(i))).count();
    let submissions = (2 * packed.len() + singles) as u64;
    exec.claim_ranges(batch.table.buffers(), submissions, batch.ranges())?;
    exec.requested(requested);
    let dev = if packed_need > 0 { exec.region(&mut scratch.region, regions * region_stride)? } else { 0 };
    let kernels = if packed_need > 0 || (0..leases.len()).any(bus) { Some(exec.kernels()?) } else { None };
    let bases: Vec<usize> = leases.iter().map(|l| l.as_ptr() as usize).collect();
    let fills = Fills::new(&batch.par, &batch.writes, &batch.sources, &bases);
    // Packed leases enqueued so far.
    let mut j = 0;
    // Moves lease `i` (its fills done).
    let mut move_lease = |i: usize| -> Result<()> {
        let run = runs[i].0.clone();
        let lease = &leases[i];
        if !has_bytes(i) {
            return Ok(());
        }
        let base = lease.as_ptr();
        if own(i) {
            let w = run.start;
            let len = batch.writes[w].len as usize;
            exec.submit(vec![Arc::clone(lease)], |q| {
                // SAFETY: the write's bytes in its own pinned lease, kept alive by this
                // submission, into a live, marked buffer.
                unsafe { q.htod(ptr_of(w), base.add(offset_of(w) as usize), len) }
            })?;
            return Ok(());
        }
        let kernels = kernels.expect("loaded when there are packed writes");
        if bus(i) {
            let copies = run.map(|w| (base as u64 + offset_of(w), ptr_of(w), batch.writes[w].len));
            let (table, count) = write_table(lease, table_at(i), areas[i], &mut scratch.descriptors, copies);
            let bytes = count * size_of::<CopyDescriptor>() as u64;
            let payload = runs[i].0.clone().map(|w| batch.writes[w].len).sum::<u64>();
            let at = table as u64;
            exec.submit(vec![Arc::clone(lease)], |q| {
                // SAFETY: the table and the writes' bytes are in the pinned lease, which this
                // submission keeps alive and the device reads (unified addressing);
                // destinations are disjoint ranges (no two writes fuse) of live, marked
                // buffers.
                unsafe { q.launch_over_bus(kernels, at, count, bytes + payload) }
            })?;
            return Ok(());
        }
        let used = batch.arena_used[i];
        let (slot, last) = (j % SIDE_SLOTS, j + 1 == packed.len());
        let region = dev + slot as u64 * region_stride;
        j += 1;
        // The region's previous lease is spread before its bytes are overwritten.
        exec.wait_side(slot)?;
        exec.submit(vec![Arc::clone(lease)], |q| {
            // SAFETY: the lease's used bytes, kept alive by this submission, into a region of
            // device staging, which holds packed_need >= used bytes; the launches that read
            // the region before come before on this stream or were waited for just above.
            unsafe { q.htod(region, base, used) }
        })?;
        // Built while the bytes are on the wire.
        let copies = run.map(|w| (region + offset_of(w), ptr_of(w), batch.writes[w].len));
        let (area, at) = (areas[i], region + table_at(i));
        let (table, count) = write_table(lease, table_at(i), area, &mut scratch.descriptors, copies);
        // The launches below: the table sits in the region after the lease's bytes
        // (packed_need), put there by DMAs before on the lane's stream (which the side stream
        // waits for); destinations are disjoint ranges of live, marked buffers (no two writes
        // fuse); the region is not written again before the side work is waited for (above,
        // or by the last lease's join: device staging's next user comes after this batch).
        if last {
            exec.join_side()?;
            exec.submit(vec![Arc::clone(lease)], |q| {
                // SAFETY: the table, in the lease after its bytes, is kept alive by this
                // submission; the launch as above.
                unsafe {
                    q.htod(at, table, area as usize)?;
                    q.launch(kernels, at, count, 0)
                }
            })?;
        } else {
            exec.submit(vec![Arc::clone(lease)], |q| {
                // SAFETY: the table, in the lease after its bytes, is kept alive by this
                // submission, into the region.
                unsafe { q.htod(at, table, area as usize) }
            })?;
            exec.submit_side(slot, |q| {
                // SAFETY: as above.
                unsafe { q.launch(kernels, at, count, 0) }
            })?;
        }
        Ok(())
    };
    // The fills of `write_with_par` run in groups, lease by lease, on the packing threads
    // and this one (on this one alone for a small batch); each lease moves once its fills
    // are done, while the next ones are filled. A lease with a fill that panicked, and every
    // later one, does not move.
    let (groups, work) = fills.groups(&fill_spans, core.packers().current_num_threads());
    pipeline::run(
        &core.packers,
        &groups,
        work,
        leases.len(),
        |step| match step {
            Step::Open(_) => Ok(true),
            Step::Done(i) => match fills.panics.first(runs[i].1.end) {
                Some(panicked) => Err(batch.fill_panicked(panicked)),
                None => move_lease(i).map(|()| true),
            },
        },
        |_, items| fills.run(items),
    )?;
    Ok(Some(exec.finish()))
}

/// Writes the descriptor table of an arena lease's `copies` (source, destination, length:
/// the source where the kernel reads the write's bytes) into the lease itself, at `at` (past
/// its writes' bytes, where [`UploadBatch::stage`] kept `area` bytes for it, the table's size
/// counted as the writes were added); returns where it is and its number of descriptors.
fn write_table(
    lease: &HostLease,
    at: u64,
    area: u64,
    descriptors: &mut Vec<CopyDescriptor>,
    copies: impl Iterator<Item = (u64, u64, u64)>,
) -> (*const u8, u64) {
    descriptors.clear();
    for (src, dst, len) in copies {
        push_descriptors(descriptors, src, dst, len);
    }
    let bytes = descriptors.len() * size_of::<CopyDescriptor>();
    assert!(bytes as u64 <= area, "descriptors counted as the writes were added match those built");
    assert!(at + area <= lease.len() as u64, "the lease kept room for its table");
    // SAFETY: the lease holds `at + area` bytes (checked), past its writes' bytes, which
    // nothing else writes: the fills write only their writes' bytes, and the device reads
    // this part only in submissions enqueued after this call.
    let table = unsafe { lease.as_ptr().add(at as usize) };
    // SAFETY: as above; descriptors are three u64s (`repr(C)`, no padding).
    unsafe { std::ptr::copy_nonoverlapping(descriptors.as_ptr().cast::<u8>(), table, bytes) };
    (table.cast_const(), descriptors.len() as u64)
}

/// The routes [`Route::InOrder`] and [`Route::Planned`].
fn execute(batch: &UploadBatch<'_>, route: Route) -> Result<Fence> {
    let core = batch.core;
    let config = &core.config;
    // Uploads keep the configured chunk: cutting mid-size batches finer (as readbacks do)
    // measured no better.
    let plan_config =
        PlanConfig { direct_threshold: config.direct_threshold, chunk_bytes: config.chunk_bytes, align: 16 };
    let mut exec = Exec::begin(core, LaneKind::Upload);
    let mut scratch = lock(&core.staging[LaneKind::Upload.index()]);
    let scratch = &mut *scratch;
    if route == Route::InOrder {
        return execute_in_order(batch, exec, scratch);
    }
    scratch.planner.plan_upload_into(&batch.writes, &plan_config, &mut scratch.upload_plan)?;
    let plan = &scratch.upload_plan;
    if plan.is_empty() {
        return Ok(Fence::completed());
    }
    // Every buffer is checked (and marked as used by this batch) before anything moves.
    exec.claim_ranges(batch.table.buffers(), plan.chunks.len() as u64, batch.ranges())?;
    exec.requested(plan.requested_bytes);

    let uses_kernel = |n: usize| n >= KERNEL_MIN_COPIES;
    let kernels =
        if plan.chunks.iter().any(|c| uses_kernel(c.packed.len())) { Some(exec.kernels()?) } else { None };
    // Each chunk's descriptor table (0 without a kernel), counted once.
    let areas: Vec<u64> = plan
        .chunks
        .iter()
        .map(
            |c| if uses_kernel(c.packed.len()) { descriptor_area(c.packed.iter().map(|p| p.len)) } else { 0 },
        )
        .collect();
    let device_need = plan
        .chunks
        .iter()
        .zip(&areas)
        .filter(|(c, _)| uses_kernel(c.packed.len()))
        .map(|(c, area)| area + c.packed_len)
        .max()
        .unwrap_or(0);
    let dev = if device_need > 0 { exec.region(&mut scratch.region, device_need)? } else { 0 };
    // The first chunk's lease is as large as the largest any chunk takes: where the pool
    // cannot lend that much (in-place writes of the batch hold the rest of it), the batch
    // fails here, before anything moves, rather than at a later chunk; each later lease
    // finds that room again once the chunks before it complete.
    let largest = plan.chunks.iter().zip(&areas).map(|(c, area)| area + c.staging_len).max().unwrap_or(0);

    let ptr_of = |key: u64| batch.table.entries[key as usize].ptr;
    let mut seqs = Vec::with_capacity(plan.chunks.len());
    for (k, chunk) in plan.chunks.iter().enumerate() {
        if k >= RING {
            exec.wait(seqs[k - RING])?;
        }
        let kernel = uses_kernel(chunk.packed.len());
        let area = areas[k];
        let len = if k == 0 { largest } else { area + chunk.staging_len };
        let lease = Arc::new(exec.lease(len as usize)?);
        let base = lease.as_ptr();
        // SAFETY: the lease holds area + staging_len bytes; offsets below stay inside.
        let staged = |flat: u64| unsafe { base.add((area + chunk.local_offset(flat)) as usize) };

        scratch.descriptors.clear();
        if kernel {
            for c in &chunk.packed {
                let src = dev + area + (c.stage_offset - chunk.packed_offset);
                push_descriptors(&mut scratch.descriptors, src, ptr_of(c.buffer) + c.buffer_offset, c.len);
            }
            let bytes = scratch.descriptors.len() * std::mem::size_of::<CopyDescriptor>();
            // SAFETY: the descriptor area holds at least `bytes` bytes; the lease is fresh.
            unsafe { std::ptr::copy_nonoverlapping(scratch.descriptors.as_ptr().cast::<u8>(), base, bytes) };
        }
        scratch.pieces.clear();
        for f in plan.fills_of(k as u32) {
            let src = batch.sources[f.write as usize].at(&batch.arena, f.src_offset);
            Piece::push_split(
                &mut scratch.pieces,
                Piece { dst: staged(f.stage_offset), src, len: f.len as usize },
            );
        }
        // SAFETY: fills cover disjoint staging ranges inside the lease, sources are live
        // slices or the batch's arena.
        unsafe { Piece::copy_all(&core.packers, &scratch.pieces) };

        let descriptor_count = scratch.descriptors.len() as u64;
        let seq = exec.submit(vec![lease], |q| {
            if kernel {
                // SAFETY: descriptors and packed bytes are contiguous at the lease's start,
                // and device staging holds device_need >= area + packed_len bytes.
                unsafe { q.htod(dev, base, (area + chunk.packed_len) as usize) }?;
                let kernels = kernels.expect("loaded when a chunk uses it");
                // SAFETY: the table is in device staging by stream order; destinations are
                // disjoint fused intervals of live, marked buffers.
                unsafe { q.launch(kernels, dev, descriptor_count, 0) }?;
            } else {
                for c in &chunk.packed {
                    let src = staged(c.stage_offset);
                    // SAFETY: staged bytes of a live, marked buffer's interval.
                    unsafe { q.htod(ptr_of(c.buffer) + c.buffer_offset, src, c.len as usize) }?;
                }
            }
            for c in &chunk.direct {
                let src = staged(c.stage_offset);
                // SAFETY: as above.
                unsafe { q.htod(ptr_of(c.buffer) + c.buffer_offset, src, c.len as usize) }?;
            }
            Ok(())
        })?;
        seqs.push(seq);
    }
    Ok(exec.finish())
}

/// [`Route::InOrder`]: writes in order and apart (each past the end of the earlier writes into its buffer, with
/// a gap: none overlap and none touch, so the planner would fuse none), all from slices and
/// none longer than a kernel segment: the common batch of many small writes, laid out
/// as the writes were added ([`Apart`](crate::plan::route::Apart): each at the residue of its destination modulo
/// 16, so the scatter uses 16-byte accesses), without the planner. The batch is cut into
/// chunks (each with its descriptor table and packed bytes within `chunk_bytes`, over the
/// bus growing to it from [`FIRST_CHUNK`]; found by binary search); then, per chunk, the packing threads write each write's
/// descriptor and copy its bytes straight into the pinned lease, and one launch moves it:
/// the kernel reads table and bytes in the lease, over the bus
/// ([`Config::small_copies_over_bus`](crate::Config::small_copies_over_bus)), or after one
/// DMA of the lease into device staging. (Touching writes go to the planner, which fuses
/// them: one descriptor and one padded slot each would take far more staging for tiny
/// writes.)
fn execute_in_order(
    batch: &UploadBatch<'_>,
    mut exec: Exec<'_>,
    scratch: &mut DeviceStaging,
) -> Result<Fence> {
    let core = batch.core;
    let ptr_of = |w: &WriteRequest| batch.table.entries[w.buffer as usize].ptr + w.offset;
    let DeviceStaging { spans, region, .. } = scratch;
    let (writes, apart) = (&batch.writes[..], &batch.table.apart);
    let (offsets, requested) = (&apart.offsets[..], apart.requested);
    debug_assert_eq!(offsets.len(), writes.len(), "one offset a write");
    let chunk_bytes = in_order_chunk(core.config.chunk_bytes, requested, PIPELINE_DEPTH);
    // Over the bus a chunk costs a launch: the first is small and leaves while the rest is
    // packed. Through device staging (a DMA and a launch a chunk) chunks stay equal.
    if core.moves_small_copies_over_bus() {
        cut_apart(offsets, |i| writes[i].len, growing(FIRST_CHUNK, chunk_bytes), spans);
    } else {
        cut_apart(offsets, |i| writes[i].len, |_| chunk_bytes, spans);
    }
    let area = |span: &Span| table_bytes(span.requests.len() as u64);
    let device_need = spans.iter().map(|span| area(span) + span.len).max().unwrap_or(0);
    exec.claim_ranges(batch.table.buffers(), spans.len() as u64, batch.ranges())?;
    exec.requested(requested);
    let kernels = exec.kernels()?;
    // Where the kernel finds the packed bytes: in the lease itself, or in device staging.
    let dev = if core.moves_small_copies_over_bus() { None } else { Some(exec.region(region, device_need)?) };
    let spans = &*spans;
    let threads = core.packers().current_num_threads();
    // Groups of about the same bytes, from the mean write (no pass over the writes): a
    // batch smaller than a chunk is spread over every thread too.
    let groups = Groups::by_mean(
        spans.len(),
        spans.iter().enumerate().map(|(k, span)| (k, span.requests.clone())),
        (writes.len(), requested as usize),
        chunk_bytes.min(requested),
        threads,
    );
    // Each chunk's lease (the caller's) and its address (the packing threads').
    let mut leases: Vec<Option<Arc<HostLease>>> = vec![None; spans.len()];
    let bases: Vec<AtomicUsize> = spans.iter().map(|_| AtomicUsize::new(0)).collect();
    let mut seqs = Vec::with_capacity(spans.len());
    pipeline::run(
        &core.packers,
        &groups,
        requested as usize,
        RING,
        |step| match step {
            Step::Open(k) => {
                if k >= RING {
                    exec.wait(seqs[k - RING])?;
                }
                // The lease holds the table, then the chunk's packed bytes. While earlier
                // chunks hold leases not yet moved, the pool cannot make room by waiting for
                // them: take only what is free, else open this chunk after the next move.
                let len = (area(&spans[k]) + spans[k].len) as usize;
                let lease = if k == seqs.len() {
                    exec.lease(len)?
                } else {
                    match exec.try_lease(len)? {
                        Some(lease) => lease,
                        None => return Ok(false),
                    }
                };
                bases[k].store(lease.as_ptr() as usize, Ordering::Relaxed);
                leases[k] = Some(Arc::new(lease));
                Ok(true)
            }
            Step::Done(k) => {
                let span = &spans[k];
                let lease = leases[k].take().expect("opened before it is done");
                let (base, bytes) = (lease.as_ptr(), area(span) + span.len);
                let count = span.requests.len() as u64;
                let seq = exec.submit(vec![lease], |q| {
                    let Some(dev) = dev else {
                        // Over the bus the kernel reads the descriptors and the payload (counted
                        // once for the batch below), not the padding between packed writes
                        // that a DMA moves.
                        let table = count * size_of::<CopyDescriptor>() as u64;
                        // SAFETY: the table and the packed bytes are in the pinned lease, which
                        // this submission keeps alive and the device reads (unified
                        // addressing); destinations are disjoint ranges (writes in order do
                        // not overlap) of live, marked buffers.
                        return unsafe { q.launch_over_bus(kernels, base as u64, count, table) };
                    };
                    // SAFETY: descriptors and packed bytes are contiguous at the lease's start,
                    // which this submission keeps alive, and device staging holds
                    // device_need >= area + packed bytes.
                    unsafe { q.htod(dev, base, bytes as usize) }?;
                    // SAFETY: the table is in device staging by stream order; destinations are
                    // as above.
                    unsafe { q.launch(kernels, dev, count, 0) }
                })?;
                seqs.push(seq);
                Ok(true)
            }
        },
        |k, items| {
            let span = &spans[k];
            let (base, area) = (bases[k].load(Ordering::Relaxed), area(span));
            for i in items {
                let (w, at) = (&batch.writes[i], offsets[i] - span.start);
                let Source::Slice(data) = batch.sources[i] else {
                    unreachable!("only slices take this path")
                };
                let from = dev.unwrap_or(base as u64);
                let d = CopyDescriptor { src: from + area + at, dst: ptr_of(w), len: w.len };
                // SAFETY: the chunk's lease (opened before its groups start, alive until its
                // submission) holds `area` bytes of descriptors (one per write, 8-byte aligned
                // at its page-aligned start) and the packed bytes after them; each write has a
                // slot and a range of its own inside the chunk (laid out above).
                unsafe {
                    (base as *mut CopyDescriptor).add(i - span.requests.start).write(d);
                    std::ptr::copy_nonoverlapping(
                        data.as_ptr(),
                        (base + (area + at) as usize) as *mut u8,
                        data.len(),
                    );
                }
            }
        },
    )?;
    if dev.is_none() {
        exec.moved(requested);
    }
    Ok(exec.finish())
}

//! Downloads: a batch of reads, fused, gathered by the kernel (small ranges: into device
//! staging and moved by one DMA, or, many small reads in order, straight into pinned memory
//! over the bus) or copied directly (large ones), into one pinned region that the caller
//! reads as `&[u8]` views. A batch larger than the pinned pool can lend streams through a
//! ring of pinned chunks into one ordinary host allocation instead ([`execute_streamed`]).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::BufferTable;
use crate::alloc::ResidentBuffer;
use crate::engine::core::Core;
use crate::engine::host::Piece;
use crate::engine::order::Ranges;
use crate::engine::pipeline::{self, Groups, Step};
use crate::engine::staging::DeviceStaging;
use crate::engine::{Enqueue, Exec};
use crate::error::{Error, Result};
use crate::host_pool::HostLease;
use crate::kernels::{CopyDescriptor, descriptor_area, push_descriptors, table_bytes};
use crate::plan::route::{
    self, PIPELINE_DEPTH, READ_DEPTH, Route, Span, cut_apart, in_order_chunk, pipeline_chunk,
};
use crate::plan::{PlanConfig, ReadRequest, ReadView};
use crate::stream::{Fence, LaneKind};
use crate::sync::lock;

/// A chunk with fewer packed ranges than this reads them by one DMA each.
const KERNEL_MIN_COPIES: usize = 3;

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
    batch: u64,
    index: u32,
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

/// A batch of device-to-host reads ([`Device::downloads`](crate::Device::downloads)). Reads of one buffer that overlap
/// or touch are fused and move once.
///
/// Every read is checked when it is added ([`DownloadBatch::read`], [`DownloadBatch::read_all`],
/// [`DownloadBatch::read_many`], [`DownloadBatch::read_ranges`]): a bad one (a freed or foreign handle, a range out of its
/// buffer) returns its error and poisons the batch: [`DownloadBatch::submit`] fails with the
/// first such error and nothing moves, the good reads included.
///
/// A batch of any size works, whatever [`Config::pinned_cap_bytes`](crate::Config::pinned_cap_bytes):
/// one whose staging the pool cannot lend at once (more than the cap, more than is free of
/// what callers hold, or more held staging than the pool's reserve for transfers leaves)
/// streams through a ring of pinned chunks into one ordinary host allocation owned by its
/// [`Downloaded`] (see there): same API and same bytes, one more host copy, and its `submit`
/// returns only once every byte has landed. [`DownloadBatch::submit_into`] streams such a
/// batch straight into the caller's vectors instead.
#[must_use = "a download batch moves nothing until it is submitted"]
pub struct DownloadBatch<'a> {
    core: &'a Arc<Core>,
    table: BufferTable,
    reads: Vec<ReadRequest>,
    error: Option<Error>,
    /// This batch's identity, carried by its slots and its download.
    id: u64,
}

impl fmt::Debug for DownloadBatch<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DownloadBatch").field("reads", &self.reads.len()).finish_non_exhaustive()
    }
}

/// A submitted download: the bytes are in flight.
#[derive(Debug)]
#[must_use = "the bytes are reachable only through its wait"]
pub struct PendingDownload {
    fence: Fence,
    readback: Downloaded,
    /// The sequence number of the first chunk's submission (chunk `k` is `first_seq + k`).
    first_seq: u64,
    /// The route the batch took.
    pub(crate) route: Route,
}

/// Completed reads: views into pinned memory, valid while this value lives. Dropping it
/// returns the staging to the pool.
///
/// A batch whose reads need more pinned memory than the pool can lend at once (more than
/// [`Config::pinned_cap_bytes`](crate::Config::pinned_cap_bytes), or more than is free of
/// what callers hold) is not refused: it streams through a ring of pinned chunks, each
/// copied out as it lands into one ordinary host allocation that this value owns, and the
/// views point there. The API is the same; such a batch costs one more host copy, holds no
/// pinned memory once submitted, and its `submit` returns once every byte has landed.
/// When it drops, the device keeps that host memory for the next such download (the larger
/// of two; fresh gigabytes cost their page faults on each one) until
/// [`Device::trim`](crate::Device::trim). ([`DownloadBatch::submit_into`],
/// [`Device::download_many`](crate::Device::download_many), [`Device::download_ranges`](crate::Device::download_ranges) and [`Device::download_into`](crate::Device::download_into)
/// skip the host allocation: each chunk goes straight into the result vectors.)
pub struct Downloaded {
    core: Option<Arc<Core>>,
    /// The identity of the batch (or prepared set) whose slots this download redeems.
    batch: u64,
    lease: Option<Arc<HostLease>>,
    /// A streamed batch's flat staging, in ordinary host memory ([`execute_streamed`]);
    /// empty otherwise.
    host: Vec<u8>,
    /// Where flat staging starts in the lease (after the descriptor tables of planned reads;
    /// 0 for reads in order, whose tables follow the packed bytes).
    base: usize,
    views: Views,
    /// Reads in order ([`execute_in_order`]): the first read of each chunk, then the number
    /// of reads; the reads of chunk `k` are `chunks[k]..chunks[k + 1]`. Empty for reads
    /// the planner laid out.
    chunks: Vec<usize>,
    /// Bytes of all reads in order (0 for reads the planner laid out).
    in_order_bytes: usize,
}

impl Drop for DownloadBatch<'_> {
    fn drop(&mut self) {
        use std::mem::take;
        self.core.spares.readback.give((take(&mut self.table), take(&mut self.reads)));
    }
}

/// A download's views: its own (handed back to the device's pool when it goes), or those
/// of a prepared set, shared by each of its downloads.
enum Views {
    Pooled(Vec<ReadView>),
    Shared(Arc<[ReadView]>),
}

impl std::ops::Deref for Views {
    type Target = [ReadView];
    fn deref(&self) -> &[ReadView] {
        match self {
            Views::Pooled(v) => v,
            Views::Shared(v) => v,
        }
    }
}

impl Drop for Downloaded {
    fn drop(&mut self) {
        if let (Some(core), Views::Pooled(views)) = (&self.core, &mut self.views) {
            core.spares.views.give(std::mem::take(views));
        }
        // A streamed readback's host memory goes to the next one, the larger of two kept.
        if let Some(core) = &self.core
            && !self.host.is_empty()
        {
            let mut spare = lock(&core.spares.streamed_host);
            if spare.len() < self.host.len() {
                *spare = std::mem::take(&mut self.host);
            }
        }
    }
}

impl Downloaded {
    /// Reads whose bytes land in `lease` (flat staging from `base` on), with views of their
    /// own, handed back to the device's pool when the download drops; `chunks` and
    /// `in_order_bytes` as the fields say (empty and 0 for reads the planner laid out).
    fn leased(
        core: &Arc<Core>,
        batch: u64,
        lease: Arc<HostLease>,
        base: usize,
        views: Vec<ReadView>,
        chunks: Vec<usize>,
        in_order_bytes: usize,
    ) -> Downloaded {
        Downloaded {
            core: Some(Arc::clone(core)),
            batch,
            lease: Some(lease),
            host: Vec::new(),
            base,
            views: Views::Pooled(views),
            chunks,
            in_order_bytes,
        }
    }
}

impl PendingDownload {
    /// A download of a prepared set's reads in order ([`super::prepared`]): its chunks are
    /// submissions `first_seq..=fence`'s, `chunks` their first reads then the number of reads,
    /// and the bytes land in `lease` at the views' offsets; `views` comes with the set's
    /// identity, which its slots carry.
    pub(super) fn prepared(
        core: Arc<Core>,
        fence: Fence,
        first_seq: u64,
        lease: Arc<HostLease>,
        (batch, views): (u64, Arc<[ReadView]>),
        chunks: Vec<usize>,
        bytes: usize,
    ) -> PendingDownload {
        PendingDownload {
            fence,
            readback: Downloaded {
                core: Some(core),
                batch,
                lease: Some(lease),
                host: Vec::new(),
                base: 0,
                views: Views::Shared(views),
                chunks,
                in_order_bytes: bytes,
            },
            first_seq,
            route: Route::InOrder,
        }
    }
}

impl fmt::Debug for Downloaded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Downloaded").field("reads", &self.views.len()).finish_non_exhaustive()
    }
}

/// The work of [`Device::downloads`](crate::Device::downloads).
pub(crate) fn downloads(core: &Arc<Core>) -> DownloadBatch<'_> {
    downloads_as(core, next_batch_id())
}

/// A batch whose slots and download carry the identity `id` (a prepared set's, so that
/// the set's slots redeem the downloads it moves as batches).
pub(crate) fn downloads_as(core: &Arc<Core>, id: u64) -> DownloadBatch<'_> {
    let (table, reads) = core.spares.readback.take();
    DownloadBatch { core, table, reads, error: None, id }
}

impl DownloadBatch<'_> {
    /// The device ranges of the batch's reads, for `Exec::claim_ranges`.
    fn ranges(&self) -> impl FnOnce(&mut Ranges) + '_ {
        |ranges| self.table.push_ranges(ranges, self.reads.iter().map(|r| (r.buffer, r.offset, r.len)))
    }

    /// The bytes the batch moves and the planner's settings for it: chunks sized to the
    /// batch ([`pipeline_chunk`]), the direct threshold at most a chunk.
    fn sizing(&self) -> (u64, PlanConfig) {
        let config = &self.core.config;
        let apart = &self.table.apart;
        let in_order = self.reads.len() >= route::IN_ORDER_MIN && !apart.broken;
        let total: u64 = if in_order { apart.requested } else { self.reads.iter().map(|r| r.len).sum() };
        let chunk_bytes = pipeline_chunk(config.chunk_bytes, total, PIPELINE_DEPTH);
        (
            total,
            PlanConfig { direct_threshold: config.direct_threshold.min(chunk_bytes), chunk_bytes, align: 16 },
        )
    }

    /// The route [`route::download_route`] gives the batch's reads under `plan_config`.
    fn route_with(&self, plan_config: &PlanConfig) -> Route {
        route::download_route(self.reads.len(), &self.table.apart, plan_config.direct_threshold)
    }

    /// The route the batch takes as its reads stand, when the pinned pool can lend it at
    /// submit ([`route::download_route`]); a batch it cannot lend streams instead
    /// ([`Route::Streamed`]).
    #[cfg(test)]
    pub(crate) fn route(&self) -> Route {
        self.route_with(&self.sizing().1)
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
    pub fn read_all(&mut self, buffer: ResidentBuffer) -> Result<Slot> {
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
    /// [`DownloadBatch::read_all`] returns for it; the reads before it stay added, but the
    /// batch is poisoned: `submit` fails with that error.
    pub fn read_many(&mut self, buffers: &[ResidentBuffer]) -> Result<Vec<Slot>> {
        let mut slots = Vec::with_capacity(buffers.len());
        self.reads.reserve(buffers.len());
        for (index, &buffer) in buffers.iter().enumerate() {
            let added = self.core.buffer_len(buffer).and_then(|len| self.add(buffer, 0, len));
            match added {
                Ok(slot) => slots.push(slot),
                Err(e) => return Err(Error::bad_item(&mut self.error, "DownloadBatch::read_many", index, e)),
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
    pub fn read_ranges<I>(&mut self, items: I) -> Result<Vec<Slot>>
    where
        I: IntoIterator<Item = (ResidentBuffer, u64, u64)>,
    {
        let items = items.into_iter();
        // As `UploadBatch::write_many`: the iterator's hint is trusted only so far.
        let lower = items.size_hint().0.min(super::upload::RESERVE_MOST);
        let mut slots = Vec::with_capacity(lower);
        self.reads.reserve(lower);
        Error::add_items(
            "DownloadBatch::read_ranges",
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

    /// Number of reads added.
    pub fn len(&self) -> usize {
        self.reads.len()
    }

    /// Whether no read was added.
    pub fn is_empty(&self) -> bool {
        self.reads.is_empty()
    }

    /// Starts the reads and returns at once.
    ///
    /// # Errors
    /// The first bad read's error when any read was refused (the batch is poisoned), or
    /// [`Error::FreedBuffer`] for a buffer freed since its read was added; nothing is
    /// enqueued then, the good reads included. A batch too large for the pinned pool is not
    /// an error: it streams (see [`DownloadBatch`]), and this returns once it has landed;
    /// [`Error::PinnedExhausted`] only when the caller holds so much staging that not even
    /// one chunk of the ring is left.
    pub fn submit(mut self) -> Result<PendingDownload> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        execute(&self, &mut None)
    }

    /// Submits, waits, and reads read `i` (in the order the reads were added) into `out[i]`
    /// for every read, replacing each vector's contents and reusing its capacity: as
    /// [`DownloadBatch::submit`] then [`PendingDownload::wait_into`] with every slot, except
    /// that a batch too large for the pinned pool streams each chunk straight into the
    /// vectors as it lands (no host allocation of the whole batch, no second copy): the way
    /// to read batches of gigabytes into vectors.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] (nothing moved) unless `out` has one vector per read; else
    /// as [`DownloadBatch::submit`].
    pub fn submit_into(self, out: &mut [Vec<u8>]) -> Result<()> {
        self.submit_into_as(out, true).map(drop)
    }

    /// [`DownloadBatch::submit_into`]; without `pipelined`, a wait and then a copy of each
    /// read (for batches whose vectors the caller does not keep). Returns the route the
    /// batch took.
    pub(crate) fn submit_into_as(mut self, out: &mut [Vec<u8>], pipelined: bool) -> Result<Route> {
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
        let mut sink = Some(&mut *out);
        let pending = execute(&self, &mut sink)?;
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

impl PendingDownload {
    /// Blocks until the bytes are in host memory.
    pub fn wait(self) -> Result<Downloaded> {
        self.fence.wait()?;
        Ok(self.readback)
    }

    /// Waits for the reads chunk by chunk and copies each read into the caller's vector of
    /// the same index as soon as its chunk has landed, while later chunks are still on the
    /// wire, on the packing threads; replaces each vector's contents (capacity is reused).
    /// Returns the download for views as well.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] unless there is one vector per slot; [`Error::ForeignSlot`]
    /// for a slot of another batch: both checked before any vector is touched, which are
    /// left as they were (the download is consumed: its staging goes back once its copies
    /// are done). A failed wait: the vectors are left empty.
    ///
    /// Slots are best passed in the order their reads were added: for a batch of small
    /// reads in order, a slot whose read lands in a later chunk than the one its position
    /// falls in is copied once everything has landed, on the calling thread.
    pub fn wait_into(self, slots: &[Slot], out: &mut [Vec<u8>]) -> Result<Downloaded> {
        if slots.len() != out.len() {
            return Err(Error::LengthMismatch {
                what: "slots and output vectors",
                left: slots.len(),
                right: out.len(),
            });
        }
        if let Err(e) = self.readback.check_slots(slots) {
            out.iter_mut().for_each(Vec::clear);
            return Err(e);
        }
        let Some(core) = self.readback.core.clone().filter(|_| self.readback.lease.is_some()) else {
            // Nothing moved, or a streamed batch: its bytes are in host memory already.
            if let Err(e) = self.fence.wait().and_then(|()| self.readback.copy_all_into(slots, out)) {
                out.iter_mut().for_each(Vec::clear);
                return Err(e);
            }
            return Ok(self.readback);
        };
        if !self.readback.chunks.is_empty() {
            return self.wait_into_in_order(&core, slots, out);
        }
        // Reads grouped by the chunk that completes them, split into pieces for the packing
        // threads, which copy a chunk's reads out as soon as it has landed.
        let views = &self.readback.views;
        let mut order: Vec<usize> = (0..slots.len()).collect();
        order.sort_unstable_by_key(|&i| views[slots[i].index as usize].last_chunk);
        let chunks = order.last().map_or(0, |&i| views[slots[i].index as usize].last_chunk as usize + 1);
        let mut pieces = Vec::with_capacity(order.len());
        let mut spans = Vec::new();
        let mut total = 0;
        for same in order.chunk_by(|&a, &b| {
            views[slots[a].index as usize].last_chunk == views[slots[b].index as usize].last_chunk
        }) {
            let first = pieces.len();
            for &i in same {
                total += self.readback.push_copy(slots[i], &mut out[i], &mut pieces);
            }
            spans.push((views[slots[same[0]].index as usize].last_chunk as usize, first..pieces.len()));
        }
        let threads = core.packers().current_num_threads();
        let chunk_bytes = (total / chunks.max(1)) as u64;
        let groups =
            Groups::new(chunks, spans.into_iter(), |p| pieces[p].len, Groups::target(chunk_bytes, threads));
        let lane = core.lane(LaneKind::Readback);
        let first_seq = self.first_seq;
        pipeline::run(
            &core.packers,
            &groups,
            total,
            chunks,
            |step| match step {
                Step::Open(k) => lane.wait(first_seq + k as u64).map(|_| true),
                Step::Done(_) => Ok(true),
            },
            |_, items| {
                for p in &pieces[items] {
                    // SAFETY: each destination is a distinct vector's spare capacity of at
                    // least its source's length (reserved above); the source is a view of a
                    // read whose chunk has landed (the chunk is opened after its wait).
                    unsafe { crate::hostcopy::copy_out(p.src, p.dst, p.len) }
                }
                crate::hostcopy::publish();
            },
        )?;
        // Everything has landed; this also reports any error of the last submissions (the
        // vectors stay empty then).
        self.fence.wait()?;
        // SAFETY: every chunk's copies ran (`run` returned Ok).
        unsafe { self.readback.set_lengths(slots, out) };
        Ok(self.readback)
    }

    /// [`PendingDownload::wait_into`] for reads in order, whose chunks hold runs of reads:
    /// the packing threads take each chunk's share of `slots` (those of the same positions,
    /// assuming slots are passed in the order the reads were added) as soon as it has landed,
    /// and prepare, fill and size each vector themselves; the calling thread only waits. A
    /// slot whose read lands in a later chunk than its position's (slots out of order) is
    /// skipped there and copied once everything has landed.
    fn wait_into_in_order(self, core: &Arc<Core>, slots: &[Slot], out: &mut [Vec<u8>]) -> Result<Downloaded> {
        let (readback, lane) = (&self.readback, core.lane(LaneKind::Readback));
        let (views, starts) = (&readback.views, &readback.chunks);
        let chunks = starts.len() - 1;
        let base = readback.lease.as_ref().map_or(0, |lease| lease.as_ptr() as usize + readback.base);
        // Positions past the reads (a slot named twice) go with the last chunk.
        let at = |k: usize| if k == chunks { slots.len() } else { starts[k].min(slots.len()) };
        let spans = (0..chunks).map(|k| (k, at(k)..at(k + 1)));
        let total = readback.in_order_bytes;
        let threads = core.packers().current_num_threads();
        let chunk_bytes = (total / chunks.max(1)) as u64;
        let groups = Groups::by_mean(chunks, spans, (views.len(), total), chunk_bytes, threads);
        let outs = SharedVecs(out.as_mut_ptr());
        let skipped = AtomicBool::new(false);
        let fill = |p: usize| {
            let view = views[slots[p].index as usize];
            // SAFETY: positions are distinct across groups and `out` is borrowed mutably for
            // this call: no one else touches this vector.
            let vec = unsafe { &mut *outs.at(p) };
            vec.clear();
            vec.reserve(view.len as usize);
            // SAFETY: the source is the read's place in the lease, which has landed; the
            // destination is the vector's capacity of at least the read's length.
            unsafe {
                crate::hostcopy::copy_out(
                    (base + view.stage_offset as usize) as *const u8,
                    vec.as_mut_ptr(),
                    view.len as usize,
                );
                vec.set_len(view.len as usize);
            }
        };
        let run = pipeline::run(
            &core.packers,
            &groups,
            total,
            chunks,
            |step| match step {
                Step::Open(k) => lane.wait(self.first_seq + k as u64).map(|_| true),
                Step::Done(_) => Ok(true),
            },
            |k, items| {
                for p in items {
                    if views[slots[p].index as usize].last_chunk as usize > k {
                        skipped.store(true, Ordering::Relaxed);
                    } else {
                        fill(p);
                    }
                }
                crate::hostcopy::publish();
            },
        );
        // Everything has landed; this also reports any error of the last submissions.
        if let Err(e) = run.and_then(|()| self.fence.wait()) {
            out.iter_mut().for_each(Vec::clear);
            return Err(e);
        }
        if skipped.load(Ordering::Relaxed) {
            let chunk_of = |p: usize| starts[1..].partition_point(|&s| s <= p).min(chunks - 1);
            for p in 0..slots.len() {
                if views[slots[p].index as usize].last_chunk as usize > chunk_of(p) {
                    fill(p);
                }
            }
            crate::hostcopy::publish();
        }
        Ok(self.readback)
    }

    /// The fence of the reads.
    pub fn fence(&self) -> &Fence {
        &self.fence
    }
}

impl Downloaded {
    /// The bytes of a read, viewed in pinned memory (no copy).
    ///
    /// # Panics
    /// If `slot` came from another batch (or another prepared set) than this download's:
    /// a slot is redeemed only by the download of its own batch, never for another read's
    /// bytes. [`Downloaded::copy_all_into`] reports the same as an error.
    pub fn get(&self, slot: Slot) -> &[u8] {
        let view = self.view(slot).unwrap_or_else(|e| panic!("Downloaded::get: {e}"));
        let (at, len) = (view.stage_offset as usize, view.len as usize);
        match &self.lease {
            // SAFETY: the reads completed (this value exists only after the fence), the
            // view lies inside the lease's flat staging, and the lease lives as long as self.
            Some(lease) => unsafe { &lease.as_slice()[self.base + at..][..len] },
            // A streamed batch (or one that moved nothing, whose views are empty).
            None => self.host.get(at..at + len).unwrap_or(&[]),
        }
    }

    /// Where a read's bytes will be in pinned memory, and their length; no reference is
    /// made, so this may be asked before they land.
    fn address_of(&self, slot: Slot) -> (*const u8, usize) {
        let view = self.views[slot.index as usize];
        debug_assert_eq!(slot.batch, self.batch, "slots are checked before their addresses are taken");
        match &self.lease {
            Some(lease) => {
                // SAFETY: the view lies inside the lease's flat staging.
                let at = unsafe { lease.as_ptr().add(self.base + view.stage_offset as usize) };
                (at, view.len as usize)
            }
            // A streamed batch: its views lie in `host` (an empty one: views of no bytes).
            None if view.len > 0 => (self.host[view.stage_offset as usize..].as_ptr(), view.len as usize),
            None => (std::ptr::null(), 0),
        }
    }

    /// Copies a read into a caller-owned vector, replacing its contents (its capacity is
    /// reused).
    ///
    /// # Panics
    /// As [`Downloaded::get`], if `slot` came from another batch; `out` is left as it was.
    pub fn copy_into(&self, slot: Slot, out: &mut Vec<u8>) {
        let bytes = self.get(slot);
        out.clear();
        out.extend_from_slice(bytes);
    }

    /// Copies each read into the caller's vector of the same index, replacing its contents
    /// (capacity is reused), on the device's packing threads when there is enough to copy.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] unless there is one vector per slot; [`Error::ForeignSlot`]
    /// for a slot of another batch. Either leaves every vector as it was.
    pub fn copy_all_into(&self, slots: &[Slot], out: &mut [Vec<u8>]) -> Result<()> {
        if slots.len() != out.len() {
            return Err(Error::LengthMismatch {
                what: "slots and output vectors",
                left: slots.len(),
                right: out.len(),
            });
        }
        self.check_slots(slots)?;
        let Some(core) = &self.core else {
            out.iter_mut().for_each(Vec::clear);
            return Ok(());
        };
        let mut pieces = Vec::with_capacity(slots.len());
        for (&slot, vec) in slots.iter().zip(out.iter_mut()) {
            self.push_copy(slot, vec, &mut pieces);
        }
        // SAFETY: each destination is a distinct vector's spare capacity of at least its
        // source's length; sources are views of landed reads.
        unsafe { Piece::copy_out_all(&core.packers, &pieces) };
        // SAFETY: the copies above ran.
        unsafe { self.set_lengths(slots, out) };
        Ok(())
    }

    /// Empties `vec` with room for the read in `slot`, and lists the copy of the read into
    /// it (split for the packing threads); returns its length. Takes addresses only, so the
    /// bytes need not have landed yet.
    fn push_copy(&self, slot: Slot, vec: &mut Vec<u8>, pieces: &mut Vec<Piece>) -> usize {
        let (src, len) = self.address_of(slot);
        vec.clear();
        vec.reserve(len);
        Piece::push_split(pieces, Piece { dst: vec.as_mut_ptr(), src, len });
        len
    }

    /// Gives each vector its read's length.
    ///
    /// # Safety
    /// The copies [`Downloaded::push_copy`] listed for these slots and vectors have all run.
    unsafe fn set_lengths(&self, slots: &[Slot], out: &mut [Vec<u8>]) {
        for (&slot, vec) in slots.iter().zip(out.iter_mut()) {
            // SAFETY: the copies initialised exactly this many bytes, as the caller promises.
            unsafe { vec.set_len(self.views[slot.index as usize].len as usize) };
        }
    }

    /// Number of reads.
    pub fn len(&self) -> usize {
        self.views.len()
    }

    /// The view of `slot`, or [`Error::ForeignSlot`] unless it is one of this download's.
    fn view(&self, slot: Slot) -> Result<ReadView> {
        match self.views.get(slot.index as usize) {
            Some(&view) if slot.batch == self.batch => Ok(view),
            _ => Err(Error::ForeignSlot { index: slot.index, slot_batch: slot.batch, batch: self.batch }),
        }
    }

    /// Fails with [`Error::ForeignSlot`] for the first slot that is not this download's.
    fn check_slots(&self, slots: &[Slot]) -> Result<()> {
        slots.iter().try_for_each(|&slot| self.view(slot).map(drop))
    }

    /// Whether there are no reads.
    pub fn is_empty(&self) -> bool {
        self.views.is_empty()
    }
}

/// Moves the batch. A batch that streams ([`execute_streamed`]) copies its reads into the
/// vectors of `sink` (read `i` into the `i`th) when there are some, and takes them then.
fn execute(batch: &DownloadBatch<'_>, sink: &mut Option<&mut [Vec<u8>]>) -> Result<PendingDownload> {
    let core = batch.core;
    let config = &core.config;
    let apart = &batch.table.apart;
    let (total, plan_config) = batch.sizing();
    let mut exec = Exec::begin(core, LaneKind::Readback);
    let mut scratch = lock(&core.staging[LaneKind::Readback.index()]);
    let scratch = &mut *scratch;
    if batch.route_with(&plan_config) == Route::InOrder {
        let chunk = in_order_chunk(
            config.chunk_bytes,
            total,
            if core.moves_small_copies_over_bus() { READ_DEPTH } else { PIPELINE_DEPTH },
        );
        // Held staging: the readback's views keep it after the copy. The lease holds the
        // flat packed bytes, then the chunks' tables: one descriptor a read.
        let len = apart.end.next_multiple_of(256) as usize + batch.reads.len() * size_of::<CopyDescriptor>();
        return match core.acquire_held_staging(len) {
            // Listed: the caller can reach its views.
            Ok(lease) => execute_in_order(batch, chunk, exec, scratch, lease.into_listed()),
            // Refused before anything was enqueued: the batch streams instead.
            Err(e) if e.is_staging_refusal() => execute_streamed(batch, exec, scratch, sink.take()),
            Err(e) => Err(e),
        };
    }
    scratch.planner.plan_readback_into(&batch.reads, &plan_config, &mut scratch.readback_plan)?;
    let plan = &scratch.readback_plan;
    if plan.is_empty() {
        let views = plan.views.clone();
        return Ok(PendingDownload {
            fence: Fence::completed(),
            readback: Downloaded {
                core: None,
                batch: batch.id,
                lease: None,
                host: Vec::new(),
                base: 0,
                views: Views::Pooled(views),
                chunks: Vec::new(),
                in_order_bytes: 0,
            },
            first_seq: 0,
            route: Route::Planned,
        });
    }
    let uses_kernel = |n: usize| n >= KERNEL_MIN_COPIES;
    let areas: Vec<u64> = plan
        .chunks
        .iter()
        .map(
            |c| if uses_kernel(c.packed.len()) { descriptor_area(c.packed.iter().map(|p| p.len)) } else { 0 },
        )
        .collect();
    let tables: u64 = areas.iter().sum();
    // Held staging: the readback's views keep it after the copy.
    let lease = match core.acquire_held_staging((tables + plan.total_staging) as usize) {
        // Listed: the caller can reach its views.
        Ok(lease) => lease.into_listed(),
        // Nothing enqueued yet: the batch streams instead.
        Err(e) if e.is_staging_refusal() => {
            return execute_streamed(batch, exec, scratch, sink.take());
        }
        Err(e) => return Err(e),
    };
    let base = lease.as_ptr();

    let final_seq = exec.claim_ranges(batch.table.buffers(), plan.chunks.len() as u64, batch.ranges())?;
    exec.requested(plan.requested_bytes);

    let kernels = if areas.iter().any(|&a| a > 0) { Some(exec.kernels()?) } else { None };
    let device_need =
        plan.chunks.iter().zip(&areas).filter(|(_, a)| **a > 0).map(|(c, a)| a + c.packed_len).max();
    let dev = match device_need {
        Some(need) => exec.region(&mut scratch.region, need)?,
        None => 0,
    };
    let ptr_of = |key: u64| batch.table.entries[key as usize].ptr;
    // SAFETY: flat offsets of the plan lie inside the lease's staging part.
    let staged = |flat: u64| unsafe { base.add((tables + flat) as usize) };

    let mut table_at = 0u64;
    for (chunk, &area) in plan.chunks.iter().zip(&areas) {
        let table = table_at;
        table_at += area;
        scratch.descriptors.clear();
        if area > 0 {
            for c in &chunk.packed {
                let dst = dev + area + (c.stage_offset - chunk.packed_offset);
                push_descriptors(&mut scratch.descriptors, ptr_of(c.buffer) + c.buffer_offset, dst, c.len);
            }
            let bytes = scratch.descriptors.len() * std::mem::size_of::<CopyDescriptor>();
            // SAFETY: the chunk's table area in the lease holds `bytes`; nothing reads it yet.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    scratch.descriptors.as_ptr().cast::<u8>(),
                    base.add(table as usize),
                    bytes,
                )
            };
        }
        let count = scratch.descriptors.len() as u64;
        let places = ChunkPlaces {
            table: base.wrapping_add(table as usize),
            area,
            count,
            dev,
            staged: &staged,
            mapped: core.info.unified_addressing,
        };
        exec.submit(vec![Arc::clone(&lease)], |q| {
            // SAFETY: the table and the chunk's staging lie in the lease, kept alive by this
            // submission; device staging holds area + packed_len bytes; sources are live,
            // marked buffers.
            unsafe { enqueue_planned(q, chunk, &places, kernels, &ptr_of) }
        })?;
    }
    let mut views = core.spares.views.take();
    views.extend_from_slice(&plan.views);
    Ok(PendingDownload {
        fence: exec.finish(),
        readback: Downloaded::leased(core, batch.id, lease, tables as usize, views, Vec::new(), 0),
        first_seq: final_seq + 1 - plan.chunks.len() as u64,
        route: Route::Planned,
    })
}

/// Where a planned download chunk's work reads and writes: its descriptor table (`area`
/// bytes of `count` descriptors) in pinned memory, device staging at `dev`, and `staged`,
/// the pinned address of a flat staging offset of the chunk; `mapped`: the GPU reaches
/// pinned memory (unified addressing).
struct ChunkPlaces<'a> {
    table: *const u8,
    area: u64,
    count: u64,
    dev: u64,
    staged: &'a dyn Fn(u64) -> *mut u8,
    mapped: bool,
}

/// Enqueues a planned download chunk on `stream`: with a table (`area > 0`), one gather
/// launch and one DMA of the packed bytes down; then one DMA for each packed range moved
/// without the kernel and each direct one. The gather reads its table in pinned memory over
/// the bus where the GPU reaches it: a copy of the table up into device staging would queue
/// on the copy engine behind uploads of the other lane, holding the download back until
/// they are done. Without unified addressing the table goes up first.
///
/// # Safety
/// The table and every staged address stay alive and untouched by the host until the work
/// completes; device staging at `dev` holds `area + packed_len` bytes; `ptr_of` gives live
/// buffers (marked for this work) whose ranges the chunk reads.
unsafe fn enqueue_planned(
    q: &mut Enqueue<'_>,
    chunk: &crate::plan::ReadbackChunk,
    at: &ChunkPlaces<'_>,
    kernels: Option<&crate::kernels::Kernels>,
    ptr_of: &dyn Fn(u64) -> u64,
) -> Result<()> {
    if at.area > 0 {
        let kernels = kernels.expect("loaded when a chunk uses it");
        let table_bytes = at.count * size_of::<CopyDescriptor>() as u64;
        if at.mapped {
            // SAFETY: the table is pinned, mapped for the device, and stays alive (the
            // caller's promise); sources are live, marked buffers; destinations are disjoint
            // ranges of device staging.
            unsafe { q.launch(kernels, at.table as u64, at.count, table_bytes) }?;
        } else {
            // SAFETY: the table is pinned and stays alive (the caller's promise); device
            // staging holds area + packed_len bytes.
            unsafe { q.htod(at.dev, at.table, at.area as usize) }?;
            // SAFETY: as above, the table in device staging by stream order.
            unsafe { q.launch(kernels, at.dev, at.count, 0) }?;
        }
        // SAFETY: the packed region of this chunk lies in its staging.
        unsafe { q.dtoh((at.staged)(chunk.packed_offset), at.dev + at.area, chunk.packed_len as usize) }?;
    }
    // Packed ranges without the kernel, and direct ones: one DMA each.
    let singles = if at.area > 0 { &chunk.packed[..0] } else { &chunk.packed[..] };
    for c in singles.iter().chain(&chunk.direct) {
        // SAFETY: a range of a live, marked buffer into the chunk's staging.
        unsafe { q.dtoh((at.staged)(c.stage_offset), ptr_of(c.buffer) + c.buffer_offset, c.len as usize) }?;
    }
    Ok(())
}

/// A batch whose staging the pool cannot lend at once: planned in chunks of half the
/// configured chunk (a chunk's lease, its bytes plus a descriptor table of up to 1.5 times
/// them for the smallest reads, then stays within the cap, which holds two configured
/// chunks), moved through a ring of such leases (up to [`crate::plan::route::RING`], as many as the pool
/// gives), each chunk copied into one ordinary host allocation as soon as it has landed,
/// its lease then reused by a later chunk. Returns once every chunk has landed and been
/// copied out; the download's views point into the host allocation.
///
/// With `out` (one vector a read, in read order), each chunk's share of every read goes
/// straight into the read's vector instead, and no host allocation is made: the download
/// returned then has no views (the bytes are in `out`; on error every vector is empty).
fn execute_streamed(
    batch: &DownloadBatch<'_>,
    mut exec: Exec<'_>,
    scratch: &mut DeviceStaging,
    mut out: Option<&mut [Vec<u8>]>,
) -> Result<PendingDownload> {
    let core = batch.core;
    let config = &core.config;
    let chunk_bytes = config.chunk_bytes / 2;
    let plan_config =
        PlanConfig { direct_threshold: config.direct_threshold.min(chunk_bytes), chunk_bytes, align: 16 };
    scratch.planner.plan_readback_into(&batch.reads, &plan_config, &mut scratch.readback_plan)?;
    let DeviceStaging { readback_plan: plan, region, descriptors, pieces, .. } = scratch;
    let uses_kernel = |n: usize| n >= KERNEL_MIN_COPIES;
    let area_of = |c: &crate::plan::ReadbackChunk| {
        if uses_kernel(c.packed.len()) { descriptor_area(c.packed.iter().map(|p| p.len)) } else { 0 }
    };
    // Each ring lease: the largest table (a multiple of 256 bytes), then a chunk's staging.
    let room = plan.chunks.iter().map(area_of).max().unwrap_or(0);
    let ring_bytes = usize::try_from(room + plan.chunk_capacity)
        .map_err(|_| Error::HostOutOfMemory { bytes: room + plan.chunk_capacity })?;
    let views = &plan.views[..];
    let chunks = plan.chunks.len();
    // The ring is taken before anything is enqueued, and the buffers claimed (a freed one
    // refused) before the caller's vectors or the kept host memory are touched.
    let ring = exec.ring(ring_bytes, chunks.min(crate::plan::route::RING))?;
    exec.claim_ranges(batch.table.buffers(), chunks as u64, batch.ranges())?;
    exec.requested(plan.requested_bytes);
    // Into the caller's vectors: each emptied with room for its read (and its address
    // kept, for the packing threads); reads with bytes by the chunk of their first byte.
    let mut dsts = Vec::new();
    let mut order = Vec::new();
    if let Some(out) = out.as_deref_mut() {
        for (vec, view) in out.iter_mut().zip(views) {
            vec.clear();
            // A batch that streams may be larger than host memory: an error, not an abort
            // (nothing is enqueued yet).
            if vec.try_reserve_exact(view.len as usize).is_err() {
                out.iter_mut().for_each(Vec::clear);
                return Err(Error::HostOutOfMemory { bytes: view.len });
            }
            dsts.push(vec.as_mut_ptr() as usize);
        }
        order.extend((0..views.len()).filter(|&i| views[i].len > 0));
        order.sort_unstable_by_key(|&i| views[i].chunk);
    }
    let mut host = if out.is_some() { Vec::new() } else { streamed_host(core, plan.total_staging)? };
    // Reads with bytes in the chunk being copied out, and the next read of `order`.
    let (mut active, mut next) = (Vec::new(), 0);
    let first_seq = exec.first_seq();
    let device_need = plan.chunks.iter().filter(|c| area_of(c) > 0).map(|c| area_of(c) + c.packed_len).max();
    let kernels = if device_need.is_some() { Some(exec.kernels()?) } else { None };
    let dev = match device_need {
        Some(need) => exec.region(region, need)?,
        None => 0,
    };
    let ptr_of = |key: u64| batch.table.entries[key as usize].ptr;
    // Waits for chunk `k` (submission `seqs[k]`) and copies its staging out of its lease
    // into the host allocation, on the packing threads.
    let mut unpack = |k: usize, seqs: &[u64], host: &mut [u8]| -> Result<()> {
        crate::engine::wait(core, LaneKind::Readback, seqs[k])?;
        let chunk = &plan.chunks[k];
        pieces.clear();
        // SAFETY: the lease holds `room + chunk_capacity >= room + staging_len` bytes.
        let src = unsafe { ring[k % ring.len()].as_ptr().add(room as usize) };
        if dsts.is_empty() {
            let dst = host[chunk.stage_start as usize..][..chunk.staging_len as usize].as_mut_ptr();
            Piece::push_split(pieces, Piece { dst, src, len: chunk.staging_len as usize });
        } else {
            // Every read with bytes in this chunk: those begun before and those that begin.
            active.retain(|&i: &usize| views[i].last_chunk as usize >= k);
            while next < order.len() && views[order[next]].chunk as usize <= k {
                active.push(order[next]);
                next += 1;
            }
            for &i in &active {
                let view = views[i];
                let from = view.stage_offset.max(chunk.stage_start);
                let to = view.stage_end().min(chunk.stage_end());
                if from < to {
                    // SAFETY: `from..to` lies in the chunk's staging (in the lease after the
                    // table room) and in the read (inside its vector's reserved capacity).
                    let (src, dst) = unsafe {
                        (
                            src.add((from - chunk.stage_start) as usize),
                            (dsts[i] as *mut u8).add((from - view.stage_offset) as usize),
                        )
                    };
                    Piece::push_split(pieces, Piece { dst, src, len: (to - from) as usize });
                }
            }
        }
        // SAFETY: the chunk's DMAs completed (waited above); the lease and the host
        // allocation (or the caller's vectors, each its own) are disjoint and hold these
        // bytes; no two destinations overlap.
        unsafe { Piece::copy_out_all(&core.packers, pieces) };
        Ok(())
    };
    let mut seqs = Vec::with_capacity(chunks);
    for (k, chunk) in plan.chunks.iter().enumerate() {
        if k >= ring.len() {
            // The lease this chunk takes is free once the chunk before it there is out.
            unpack(k - ring.len(), &seqs, &mut host)?;
        }
        let lease = &ring[k % ring.len()];
        let base = lease.as_ptr();
        let area = area_of(chunk);
        // SAFETY: flat offsets of this chunk lie in its staging, after the table room.
        let staged = |flat: u64| unsafe { base.add((room + chunk.local_offset(flat)) as usize) };
        descriptors.clear();
        if area > 0 {
            for c in &chunk.packed {
                let dst = dev + area + (c.stage_offset - chunk.packed_offset);
                push_descriptors(descriptors, ptr_of(c.buffer) + c.buffer_offset, dst, c.len);
            }
            let bytes = descriptors.len() * size_of::<CopyDescriptor>();
            // SAFETY: the table room holds `area >= bytes`; the chunk that used this lease
            // before was waited for and copied out.
            unsafe { std::ptr::copy_nonoverlapping(descriptors.as_ptr().cast::<u8>(), base, bytes) };
        }
        let count = descriptors.len() as u64;
        let places = ChunkPlaces {
            table: base,
            area,
            count,
            dev,
            staged: &staged,
            mapped: core.info.unified_addressing,
        };
        seqs.push(exec.submit(vec![Arc::clone(lease)], |q| {
            // SAFETY: the table and the chunk's staging lie in the lease, kept alive by this
            // submission (the chunk that used it before was waited for and copied out);
            // device staging holds area + packed_len bytes; sources are live, marked buffers.
            unsafe { enqueue_planned(q, chunk, &places, kernels, &ptr_of) }
        })?);
    }
    for k in chunks.saturating_sub(ring.len())..chunks {
        unpack(k, &seqs, &mut host)?;
    }
    if let Some(out) = out.as_deref_mut() {
        for (vec, view) in out.iter_mut().zip(views) {
            // SAFETY: every chunk was copied out: each read's bytes, all of them, are in
            // its vector (the chunks' staging covers every read).
            unsafe { vec.set_len(view.len as usize) };
        }
    }
    let mut views = core.spares.views.take();
    if out.is_none() {
        views.extend_from_slice(&plan.views);
    }
    Ok(PendingDownload {
        fence: exec.finish(),
        readback: Downloaded {
            core: Some(Arc::clone(core)),
            batch: batch.id,
            lease: None,
            host,
            base: 0,
            views: Views::Pooled(views),
            chunks: Vec::new(),
            in_order_bytes: 0,
        },
        first_seq,
        route: if out.is_some() { Route::StreamedInto } else { Route::Streamed },
    })
}

/// Host memory of `len` bytes for a streamed download's views: the last one's, kept by the
/// device, when it is large enough (its bytes are initialised: those of an earlier download,
/// all overwritten where a view reads), else fresh zeroed memory.
fn streamed_host(core: &Arc<Core>, len: u64) -> Result<Vec<u8>> {
    let spare = std::mem::take(&mut *lock(&core.spares.streamed_host));
    match usize::try_from(len) {
        Ok(n) if spare.len() >= n => Ok(spare),
        _ => {
            // Too small: freed before the new one is taken.
            drop(spare);
            crate::engine::host::zeroed_vec(len)
        }
    }
}

/// The caller's vectors, for the packing threads of [`PendingDownload::wait_into`]: each
/// touches only the vectors of its own positions.
struct SharedVecs(*mut Vec<u8>);

// SAFETY: see above: threads reach disjoint vectors, while the caller's `&mut` is held.
unsafe impl Sync for SharedVecs {}

impl SharedVecs {
    /// The vector at position `p` (in bounds: the caller's).
    fn at(&self, p: usize) -> *mut Vec<u8> {
        self.0.wrapping_add(p)
    }
}

/// [`Route::InOrder`]: reads in order and apart (each past the end of the earlier reads of its buffer, with a
/// gap: none overlap and none touch, so the planner would fuse none), none longer than a
/// kernel segment: the common batch of many small reads, laid out as they were added
/// ([`Apart`](crate::plan::route::Apart)), without the planner. The batch is cut into chunks (each with its
/// descriptor table and packed bytes within `chunk_bytes`); then one pass over the reads
/// writes each read's view and its descriptor, straight into the pinned lease, and each
/// chunk moves by one launch as soon as its descriptors are written: the kernel reads the
/// table and writes the bytes in the lease, over the bus
/// ([`Config::small_copies_over_bus`](crate::Config::small_copies_over_bus)), or one table
/// upload, one gather into device staging and one DMA.
fn execute_in_order(
    batch: &DownloadBatch<'_>,
    chunk_bytes: u64,
    mut exec: Exec<'_>,
    scratch: &mut DeviceStaging,
    lease: Arc<HostLease>,
) -> Result<PendingDownload> {
    let core = batch.core;
    let (reads, apart) = (&batch.reads[..], &batch.table.apart);
    let offsets = &apart.offsets[..];
    debug_assert_eq!(offsets.len(), reads.len(), "one offset a read");
    let DeviceStaging { spans, region, .. } = scratch;
    cut_apart(offsets, |i| reads[i].len, |_| chunk_bytes, spans);
    // The lease holds the flat packed bytes, then the chunks' tables: one descriptor a read,
    // in read order (chunk `k`'s table starts at its first read's).
    let tables = apart.end.next_multiple_of(256);
    let base = lease.as_ptr();
    let final_seq = exec.claim_ranges(batch.table.buffers(), spans.len() as u64, batch.ranges())?;
    exec.requested(apart.requested);
    let kernels = exec.kernels()?;
    // Where the kernel gathers to: the lease itself, or device staging (a chunk's packed
    // bytes, then its table).
    let table_in_staging = |span: &Span| span.len.next_multiple_of(256);
    let dev = if core.moves_small_copies_over_bus() {
        None
    } else {
        let need = spans
            .iter()
            .map(|span| table_in_staging(span) + table_bytes(span.requests.len() as u64))
            .max()
            .unwrap_or(0);
        Some(exec.region(region, need)?)
    };
    let ptr_of = |r: &ReadRequest| batch.table.entries[r.buffer as usize].ptr + r.offset;
    let descriptors = base.wrapping_add(tables as usize).cast::<CopyDescriptor>();
    let mut views = core.spares.views.take();
    views.reserve(reads.len());
    let mut chunks = Vec::with_capacity(spans.len() + 1);
    for (chunk, span) in (0u32..).zip(spans.iter()) {
        chunks.push(span.requests.start);
        for i in span.requests.clone() {
            let (r, at) = (&reads[i], offsets[i]);
            views.push(ReadView { chunk, last_chunk: chunk, stage_offset: at, len: r.len });
            let dst = match dev {
                Some(dev) => dev + (at - span.start),
                None => base as u64 + at,
            };
            // SAFETY: the lease has a descriptor slot per read after the packed bytes
            // (8-byte aligned: `tables` is a multiple of 256 from the page-aligned start);
            // nothing reads it before this chunk's launch.
            unsafe { descriptors.add(i).write(CopyDescriptor { src: ptr_of(r), dst, len: r.len }) };
        }
        let (table, count) = (descriptors.wrapping_add(span.requests.start), span.requests.len() as u64);
        let table_len = count as usize * size_of::<CopyDescriptor>();
        exec.submit(vec![Arc::clone(&lease)], |q| {
            let Some(dev) = dev else {
                // Over the bus the kernel reads the descriptors and writes the payload
                // (counted once for the batch below), not the padding between packed reads
                // that a DMA moves.
                // SAFETY: the table and the destinations (each read's place in flat staging)
                // are in the pinned lease, which this submission keeps alive and the device
                // reaches (unified addressing); sources are disjoint ranges of live, marked
                // buffers.
                return unsafe { q.launch_over_bus(kernels, table as u64, count, table_len as u64) };
            };
            let dev_table = dev + table_in_staging(span);
            // SAFETY: the table is pinned and stays alive (kept by this submission); device
            // staging holds the chunk's packed bytes and then its table.
            unsafe { q.htod(dev_table, table.cast(), table_len) }?;
            // SAFETY: sources are disjoint ranges of live, marked buffers; destinations are
            // disjoint ranges of device staging.
            unsafe { q.launch(kernels, dev_table, count, 0) }?;
            // SAFETY: the chunk's packed bytes lie inside the lease.
            unsafe { q.dtoh(base.add(span.start as usize), dev, span.len as usize) }
        })?;
    }
    chunks.push(reads.len());
    let n = spans.len() as u64;
    if dev.is_none() {
        exec.moved(apart.requested);
    }
    Ok(PendingDownload {
        fence: exec.finish(),
        readback: Downloaded::leased(core, batch.id, lease, 0, views, chunks, apart.requested as usize),
        first_seq: final_seq + 1 - n,
        route: Route::InOrder,
    })
}

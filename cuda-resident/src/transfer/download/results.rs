//! What a submitted download gives back: [`PendingDownload`], then [`Downloaded`], its views.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::Slot;
use crate::engine::core::Core;
use crate::engine::host::Piece;
use crate::engine::pipeline::{self, Groups, Step};
use crate::engine::routes::view::Landed;
use crate::error::{Error, Result};
use crate::fence::Fence;
use crate::host_pool::HostLease;
use crate::plan::ReadView;
use crate::plan::route::Route;
use crate::stream::LaneKind;
use crate::sync::lock;

/// A submitted download: the bytes are in flight.
#[derive(Debug)]
#[must_use = "the bytes are reachable only through its wait"]
pub struct PendingDownload {
    pub(super) fence: Fence,
    pub(super) download: Downloaded,
    /// The sequence number of the first chunk's submission (chunk `k` is `first_seq + k`).
    pub(super) first_seq: u64,
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
/// [`Device::trim`](crate::Device::trim). ([`DownloadBatch::submit_into`](super::DownloadBatch::submit_into),
/// [`Device::download_many`](crate::Device::download_many), [`Device::download_ranges`](crate::Device::download_ranges) and [`Device::download_into`](crate::Device::download_into)
/// skip the host allocation: each chunk goes straight into the result vectors.)
pub struct Downloaded {
    pub(super) core: Option<Arc<Core>>,
    /// The identity of the batch (or prepared set) whose slots this download redeems.
    pub(super) batch: u64,
    pub(super) lease: Option<Arc<HostLease>>,
    /// A streamed batch's flat staging, in ordinary host memory
    /// (`engine::routes::streamed`); empty otherwise.
    pub(super) host: Vec<u8>,
    /// Where flat staging starts in the lease (after the descriptor tables of planned reads;
    /// 0 for reads in order, whose tables follow the packed bytes).
    pub(super) base: usize,
    pub(super) views: Views,
    /// Reads in order (`engine::routes::download_in_order`): the first read
    /// of each chunk, then the number of reads; the reads of chunk `k` are
    /// `chunks[k]..chunks[k + 1]`. Empty for reads the planner laid out.
    pub(super) chunks: Vec<usize>,
    /// Bytes of all reads in order (0 for reads the planner laid out).
    pub(super) in_order_bytes: usize,
}

/// A download's views: its own (handed back to the device's pool when it goes), or those
/// of a prepared set, shared by each of its downloads.
pub(super) enum Views {
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
        // A streamed download's host memory goes to the next one, the larger of two kept.
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
    pub(super) fn leased(
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
    /// A download of a prepared set's reads in order ([`crate::transfer::prepared`]): its chunks are
    /// submissions `first_seq..=fence`'s, `chunks` their first reads then the number of reads,
    /// and the bytes land in `lease` at the views' offsets; `views` comes with the set's
    /// identity, which its slots carry.
    pub(crate) fn prepared(
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
            download: Downloaded {
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

impl PendingDownload {
    /// A download of batch `batch` that moved nothing into staging (its views, of empty
    /// reads, at `views`): done when `fence` is.
    pub(super) fn empty(batch: u64, fence: Fence, views: Vec<ReadView>) -> PendingDownload {
        PendingDownload {
            fence,
            download: Downloaded {
                core: None,
                batch,
                lease: None,
                host: Vec::new(),
                base: 0,
                views: Views::Pooled(views),
                chunks: Vec::new(),
                in_order_bytes: 0,
            },
            first_seq: 0,
            route: Route::Planned,
        }
    }
}

impl PendingDownload {
    /// The download of batch `batch` whose route moved it as `landed` says.
    pub(super) fn landed(core: &Arc<Core>, batch: u64, landed: Landed) -> PendingDownload {
        match landed {
            Landed::Empty { views } => PendingDownload::empty(batch, Fence::completed(), views),
            Landed::Leased { fence, lease, base, views, chunks, in_order_bytes, first_seq, route } => {
                PendingDownload {
                    fence,
                    download: Downloaded::leased(core, batch, lease, base, views, chunks, in_order_bytes),
                    first_seq,
                    route,
                }
            }
            Landed::Streamed { fence, host, views, first_seq, route } => PendingDownload {
                fence,
                download: Downloaded {
                    core: Some(Arc::clone(core)),
                    batch,
                    lease: None,
                    host,
                    base: 0,
                    views: Views::Pooled(views),
                    chunks: Vec::new(),
                    in_order_bytes: 0,
                },
                first_seq,
                route,
            },
        }
    }
}

impl fmt::Debug for Downloaded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Downloaded").field("reads", &self.views.len()).finish_non_exhaustive()
    }
}

impl PendingDownload {
    /// Blocks until the bytes are in host memory.
    pub fn wait(self) -> Result<Downloaded> {
        self.fence.wait()?;
        Ok(self.download)
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
        if let Err(e) = self.download.check_slots(slots) {
            out.iter_mut().for_each(Vec::clear);
            return Err(e);
        }
        let Some(core) = self.download.core.clone().filter(|_| self.download.lease.is_some()) else {
            // Nothing moved, or a streamed batch: its bytes are in host memory already.
            if let Err(e) = self.fence.wait().and_then(|()| self.download.copy_all_into(slots, out)) {
                out.iter_mut().for_each(Vec::clear);
                return Err(e);
            }
            return Ok(self.download);
        };
        if !self.download.chunks.is_empty() {
            return self.wait_into_in_order(&core, slots, out);
        }
        // Reads grouped by the chunk that completes them, split into pieces for the packing
        // threads, which copy a chunk's reads out as soon as it has landed.
        let views = &self.download.views;
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
                total += self.download.push_copy(slots[i], &mut out[i], &mut pieces);
            }
            spans.push((views[slots[same[0]].index as usize].last_chunk as usize, first..pieces.len()));
        }
        let threads = core.packers().current_num_threads();
        let chunk_bytes = (total / chunks.max(1)) as u64;
        let groups =
            Groups::new(chunks, spans.into_iter(), |p| pieces[p].len, Groups::target(chunk_bytes, threads));
        let lane = core.lane(LaneKind::Download);
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
        unsafe { self.download.set_lengths(slots, out) };
        Ok(self.download)
    }

    /// [`PendingDownload::wait_into`] for reads in order, whose chunks hold runs of reads:
    /// the packing threads take each chunk's share of `slots` (those of the same positions,
    /// assuming slots are passed in the order the reads were added) as soon as it has landed,
    /// and prepare, fill and size each vector themselves; the calling thread only waits. A
    /// slot whose read lands in a later chunk than its position's (slots out of order) is
    /// skipped there and copied once everything has landed.
    fn wait_into_in_order(self, core: &Arc<Core>, slots: &[Slot], out: &mut [Vec<u8>]) -> Result<Downloaded> {
        let (download, lane) = (&self.download, core.lane(LaneKind::Download));
        let (views, starts) = (&download.views, &download.chunks);
        let chunks = starts.len() - 1;
        let base = download.lease.as_ref().map_or(0, |lease| lease.as_ptr() as usize + download.base);
        // Positions past the reads (a slot named twice) go with the last chunk.
        let at = |k: usize| if k == chunks { slots.len() } else { starts[k].min(slots.len()) };
        let spans = (0..chunks).map(|k| (k, at(k)..at(k + 1)));
        let total = download.in_order_bytes;
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
        Ok(self.download)
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

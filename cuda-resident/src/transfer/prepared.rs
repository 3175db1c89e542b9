//! Prepared sets: ranges checked and laid out once, then moved again and again, with new
//! bytes each time (uploads) or reading the buffers' current bytes (downloads).
//!
//! A batch pays, for every request, a check, a layout entry, a descriptor and (downloads) a
//! view, on the calling thread; for thousands of small copies that costs as much as moving
//! them. A runtime that moves the same ranges every step (a layer's slices, a table's rows,
//! a simulator's cells) prepares them once: for ranges in order and apart
//! ([`Apart`](crate::plan::route::Apart)), the set takes a pinned region of its own for the bytes and writes
//! every descriptor once, into a device buffer of its own. An upload then only copies the
//! bytes in, on the packing threads, and launches one kernel a chunk, which reads them over
//! the bus; a download only launches, the kernel writing the bytes into the set's region,
//! where its views are fixed.
//!
//! Other sets (ranges out of order, overlapping, touching, large, fewer than a few dozen,
//! or a GPU without unified addressing) are checked once too, and move as a batch each time.

use std::sync::Arc;

use super::BufferTable;
use crate::alloc::ResidentBuffer;
use crate::engine::Exec;
use crate::engine::core::Core;
use crate::engine::order::Ranges;
use crate::engine::pipeline::{self, Groups, Step};
use crate::error::{Error, Result};
use crate::fence::Fence;
use crate::host_pool::HostLease;
use crate::kernels::CopyDescriptor;
use crate::plan::ReadView;
use crate::plan::route::{
    FIRST_CHUNK, IN_ORDER_MIN, PIPELINE_DEPTH, READ_DEPTH, Route, Span, cut_apart, growing, in_order_chunk,
};
use crate::stream::LaneKind;
use crate::transfer::{PendingDownload, Slot};

/// A set of upload ranges checked and laid out once ([`Device::prepare_uploads`](crate::Device::prepare_uploads)), uploaded
/// with new bytes by [`PreparedUploads::upload`].
pub struct PreparedUploads {
    core: Arc<Core>,
    ranges: Vec<(ResidentBuffer, u64, u64)>,
    /// The layout and the packing threads' groups, for the fast path.
    fast: Option<(Layout, Groups)>,
    /// The last submission that reads the set's pinned region.
    last_seq: Option<u64>,
    /// The slices of an upload's data, empty between uploads: kept for their capacity (a
    /// fresh vector of thousands of slices costs its page faults on every upload).
    slices: Vec<&'static [u8]>,
}

/// A set of download ranges checked and laid out once ([`Device::prepare_downloads`](crate::Device::prepare_downloads)), read
/// by [`PreparedDownloads::submit`] or [`PreparedDownloads::download_into`].
pub struct PreparedDownloads {
    core: Arc<Core>,
    ranges: Vec<(ResidentBuffer, u64, u64)>,
    /// The layout, the views of its downloads, and each chunk's first read then the count,
    /// for the fast path.
    fast: Option<(Layout, Arc<[ReadView]>, Vec<usize>)>,
    /// `Slot`s of every range, in order, tagged with the set's identity.
    slots: Vec<Slot>,
    /// The set's identity: its downloads redeem its slots (those that move as a batch too).
    id: u64,
}

/// Ranges in order and apart, laid out once: the packed bytes at their flat offsets in a
/// pinned region of the set's own, and one descriptor a range in a device buffer of the
/// set's own, written once (chunk `k`'s table is the run of its ranges' descriptors). With
/// the table in device memory the kernel fetches each descriptor without a trip over the
/// bus, which measured faster for small copies (BENCHMARKS.md).
struct Layout {
    /// The device, which frees the table when the layout goes.
    core: Arc<Core>,
    /// Each distinct buffer and the table, claimed by every move.
    buffers: Vec<ResidentBuffer>,
    /// The device range of each range, and the table's, sorted once: what a move uses.
    device_ranges: Arc<Ranges>,
    offsets: Vec<u64>,
    spans: Vec<Span>,
    lease: Arc<HostLease>,
    /// The descriptors, and their device address.
    table: ResidentBuffer,
    table_ptr: u64,
    requested: u64,
    /// The largest chunk.
    chunk_bytes: u64,
}

impl Drop for Layout {
    fn drop(&mut self) {
        // Freed once the moves that use it are done (they marked it used); a refused free
        // leaves the buffer listed, as any.
        let _ = self.core.free(self.table);
    }
}

impl std::fmt::Debug for PreparedUploads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedUploads")
            .field("ranges", &self.ranges.len())
            .field("laid_out", &self.fast.is_some())
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for PreparedDownloads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedDownloads")
            .field("ranges", &self.ranges.len())
            .field("laid_out", &self.fast.is_some())
            .finish_non_exhaustive()
    }
}

/// The work of [`Device::prepare_uploads`](crate::Device::prepare_uploads).
pub(crate) fn prepare_uploads(
    core: &Arc<Core>,
    ranges: &[(ResidentBuffer, u64, u64)],
) -> Result<PreparedUploads> {
    let fast = Layout::new(core, ranges, LaneKind::Upload)?.map(|layout| {
        let spans = layout.spans.iter().enumerate().map(|(k, span)| (k, span.requests.clone()));
        let groups = Groups::by_mean(
            layout.spans.len(),
            spans,
            (ranges.len(), layout.requested as usize),
            layout.chunk_bytes.min(layout.requested),
            core.packers().current_num_threads(),
        );
        (layout, groups)
    });
    Ok(PreparedUploads {
        core: Arc::clone(core),
        ranges: ranges.to_vec(),
        fast,
        last_seq: None,
        slices: Vec::new(),
    })
}

/// The work of [`Device::prepare_downloads`](crate::Device::prepare_downloads).
pub(crate) fn prepare_downloads(
    core: &Arc<Core>,
    ranges: &[(ResidentBuffer, u64, u64)],
) -> Result<PreparedDownloads> {
    if ranges.len() > super::download::MAX_READS {
        return Err(Error::TooManyReads { most: super::download::MAX_READS });
    }
    let fast = Layout::new(core, ranges, LaneKind::Download)?.map(|layout| {
        let (views, chunks) = layout.views(ranges);
        (layout, views, chunks)
    });
    let id = super::download::next_batch_id();
    let slots = (0..ranges.len()).map(|i| Slot::nth(id, i)).collect();
    Ok(PreparedDownloads { core: Arc::clone(core), ranges: ranges.to_vec(), fast, slots, id })
}

impl Layout {
    /// Checks every range; lays them out if they take the fast path (else `None`).
    fn new(
        core: &Arc<Core>,
        ranges: &[(ResidentBuffer, u64, u64)],
        kind: LaneKind,
    ) -> Result<Option<Layout>> {
        let mut table = BufferTable::default();
        let mut first_error = None;
        let mut keys = Vec::with_capacity(ranges.len());
        for &(buffer, offset, len) in ranges {
            keys.push(table.check(&core.alloc, buffer, offset, len, &mut first_error)?.0);
        }
        let apart = &table.apart;
        if ranges.len() < IN_ORDER_MIN
            || apart.broken
            || apart.longest >= core.config.direct_threshold
            || !core.moves_small_copies_over_bus()
        {
            return Ok(None);
        }
        let depth = if kind == LaneKind::Upload { PIPELINE_DEPTH } else { READ_DEPTH };
        let chunk_bytes = in_order_chunk(core.config.chunk_bytes, apart.requested, depth);
        let mut spans = Vec::new();
        if kind == LaneKind::Upload {
            cut_apart(&apart.offsets, |i| ranges[i].2, growing(FIRST_CHUNK, chunk_bytes), &mut spans);
        } else {
            cut_apart(&apart.offsets, |i| ranges[i].2, |_| chunk_bytes, &mut spans);
        }
        // Held staging: a set that finds no room for it (past the held limit, the pool's
        // reserve for transfers, or larger than the pool can lend) moves as batches do, which
        // stream through the pool.
        let lease = match core.acquire_held_staging(apart.end as usize) {
            Ok(lease) => lease,
            Err(e) if e.is_staging_refusal() => return Ok(None),
            Err(e) => return Err(e),
        };
        let base = lease.as_ptr() as u64;
        let descriptors: Vec<CopyDescriptor> = keys
            .iter()
            .zip(ranges)
            .zip(&apart.offsets)
            .map(|((&key, &(_, offset, len)), &at)| {
                let (host, dev) = (base + at, table.entries[key as usize].ptr + offset);
                let (src, dst) = if kind == LaneKind::Upload { (host, dev) } else { (dev, host) };
                CopyDescriptor { src, dst, len }
            })
            .collect();
        // SAFETY: a descriptor is three u64s (`repr(C)`, no padding): its bytes are initialised.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                descriptors.as_ptr().cast::<u8>(),
                descriptors.len() * size_of::<CopyDescriptor>(),
            )
        };
        let table_buffer = core.allocate_for_library(bytes.len() as u64)?;
        let table_ptr = match super::convenience::upload(core, table_buffer, bytes)
            .and_then(|()| core.device_ptr(table_buffer))
        {
            Ok(ptr) => ptr,
            Err(e) => {
                let _ = core.free(table_buffer);
                return Err(e);
            }
        };
        let mut buffers: Vec<ResidentBuffer> = table.buffers().collect();
        buffers.push(table_buffer);
        let mut device_ranges = Ranges::default();
        for d in &descriptors {
            let start = if kind == LaneKind::Upload { d.dst } else { d.src };
            device_ranges.push(start, d.len);
        }
        device_ranges.push(table_ptr, bytes.len() as u64);
        // Apart, so disjoint: sorted once here, no move sorts them again.
        device_ranges.sort_disjoint();
        Ok(Some(Layout {
            core: Arc::clone(core),
            buffers,
            device_ranges: Arc::new(device_ranges),
            offsets: std::mem::take(&mut table.apart.offsets),
            spans,
            // Not listed for the unsafe copies (`into_listed`): the set decides that the
            // region is its own again by `Arc::get_mut`, which a listing's `Weak` would fail.
            lease: Arc::new(lease),
            table: table_buffer,
            table_ptr,
            requested: table.apart.requested,
            chunk_bytes,
        }))
    }

    /// The views of every range and each chunk's first range (then the count).
    fn views(&self, ranges: &[(ResidentBuffer, u64, u64)]) -> (Arc<[ReadView]>, Vec<usize>) {
        let mut views = Vec::with_capacity(ranges.len());
        let mut chunks = Vec::with_capacity(self.spans.len() + 1);
        for (chunk, span) in (0u32..).zip(&self.spans) {
            chunks.push(span.requests.start);
            for i in span.requests.clone() {
                let (stage_offset, len) = (self.offsets[i], ranges[i].2);
                views.push(ReadView { chunk, last_chunk: chunk, stage_offset, len });
            }
        }
        chunks.push(ranges.len());
        (views.into(), chunks)
    }

    /// Claims the buffers for one submission a chunk: the last one's sequence. Counts what
    /// a move of the set costs beyond its launches: the payload over the bus.
    fn claim(&self, exec: &mut Exec<'_>) -> Result<u64> {
        let final_seq =
            exec.claim_shared(self.buffers.iter().copied(), self.spans.len() as u64, &self.device_ranges)?;
        exec.requested(self.requested);
        exec.moved(self.requested);
        Ok(final_seq)
    }

    /// Enqueues chunk `k`'s launch, which keeps the region alive until it completes.
    fn launch(&self, exec: &mut Exec<'_>, kernels: &crate::kernels::Kernels, k: usize) -> Result<u64> {
        let span = &self.spans[k];
        let table = self.table_ptr + (span.requests.start * size_of::<CopyDescriptor>()) as u64;
        let count = span.requests.len() as u64;
        exec.submit(vec![Arc::clone(&self.lease)], |q| {
            // SAFETY: the table is the set's device buffer (live and marked: claimed with the
            // ranges' buffers); the host side of every copy lies in the set's pinned region,
            // which this submission keeps alive and the device reaches (unified addressing);
            // the device side of each is a range of a live, marked buffer, and the ranges are
            // disjoint (in order and apart).
            unsafe { q.launch_over_bus(kernels, table, count, 0) }
        })
    }
}

impl PreparedUploads {
    /// Number of ranges.
    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    /// Whether the set has no range.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Whether the set was laid out once (the fast path) rather than moving as a batch.
    pub fn is_laid_out(&self) -> bool {
        self.fast.is_some()
    }

    /// Uploads `data[i]` into range `i`, for every range, and returns at once; the fence
    /// completes when every byte has landed. The bytes are copied before this returns, so
    /// `data` may change right after. An upload waits, on the host, for the set's previous
    /// upload to have left its pinned region.
    ///
    /// Each item's `as_ref` is called once, on the calling thread, before anything is locked
    /// or enqueued: it may use the device itself, and if it panics the panic reaches the
    /// caller with nothing moved and the set as usable as before.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] unless there is one item of data per range,
    /// [`Error::PreparedDataLength`] for an item whose length is not its range's, a buffer
    /// freed since the set was prepared: each with nothing enqueued.
    pub fn upload<S: AsRef<[u8]> + Sync>(&mut self, data: &[S]) -> Result<Fence> {
        if data.len() != self.ranges.len() {
            return Err(Error::LengthMismatch {
                what: "prepared ranges and their data",
                left: self.ranges.len(),
                right: data.len(),
            });
        }
        // Every `as_ref` runs here, once per item, on the calling thread, before any lock of
        // the library is taken or anything is claimed: an `as_ref` that panics unwinds with
        // nothing held and nothing enqueued, and one that uses the device itself (uploads,
        // downloads, allocates) does not wait for a lane this upload holds. The packing
        // threads then only copy these slices.
        let mut slices: Vec<&[u8]> = crate::recycle::relabel(std::mem::take(&mut self.slices));
        slices.extend(data.iter().map(AsRef::as_ref));
        let moved = self.upload_slices(&slices);
        self.slices = crate::recycle::relabel(slices);
        moved
    }

    /// [`PreparedUploads::upload`] of the data's slices, one per range.
    fn upload_slices(&mut self, slices: &[&[u8]]) -> Result<Fence> {
        let ranges = &self.ranges;
        if let Some(i) = ranges.iter().zip(slices).position(|(r, d)| d.len() as u64 != r.2) {
            return Err(Error::PreparedDataLength { index: i, expected: ranges[i].2, got: slices[i].len() });
        }
        let core = &self.core;
        let lane = core.lane(LaneKind::Upload);
        if let Some((layout, groups)) = self.fast.as_mut() {
            if let Some(seq) = self.last_seq
                && lane.wait(seq)?
            {
                crate::telemetry::Telemetry::add(&core.telemetry.host_waits, 1);
            }
            // Only a submission stranded by a lost context could still hold the region
            // (`get_mut` also orders this after the release of every other holder).
            if Arc::get_mut(&mut layout.lease).is_some() {
                let (layout, groups) = (&*layout, &*groups);
                let mut exec = Exec::begin(core, LaneKind::Upload);
                let kernels = exec.kernels()?;
                let base = layout.lease.as_ptr() as usize;
                let mut final_seq = None;
                let moved = pipeline::run(
                    &core.packers,
                    groups,
                    layout.requested as usize,
                    layout.spans.len(),
                    |step| match step {
                        // The buffers are claimed while the packing threads wake, before any
                        // byte is copied or anything enqueued.
                        Step::Open(0) => {
                            final_seq = Some(layout.claim(&mut exec)?);
                            Ok(true)
                        }
                        Step::Open(_) => Ok(true),
                        Step::Done(k) => layout.launch(&mut exec, kernels, k).map(|_| true),
                    },
                    |_, items| {
                        for i in items {
                            let bytes = slices[i];
                            // SAFETY: range i's place in the set's region holds its length,
                            // which is the slice's (checked above), no two places overlap,
                            // and no copy reads the region (the previous upload was waited
                            // for above).
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    bytes.as_ptr(),
                                    (base + layout.offsets[i] as usize) as *mut u8,
                                    bytes.len(),
                                )
                            };
                        }
                    },
                );
                if final_seq.is_some() {
                    self.last_seq = final_seq;
                }
                moved?;
                final_seq.expect("chunk 0 opened: the run succeeded");
                return Ok(exec.finish());
            }
        }
        let mut batch = super::upload::uploads(core);
        for (&(buffer, offset, _), &bytes) in self.ranges.iter().zip(slices) {
            batch.write(buffer, offset, bytes)?;
        }
        batch.submit()
    }
}

impl PreparedDownloads {
    /// Number of ranges.
    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    /// Whether the set has no range.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Whether the set was laid out once (the fast path) rather than moving as a batch.
    pub fn is_laid_out(&self) -> bool {
        self.fast.is_some()
    }

    /// The slot of range `index` in every download of this set (only this set's downloads
    /// redeem it: see [`Downloaded::get`](crate::Downloaded::get)).
    ///
    /// # Panics
    /// If `index` is not below [`PreparedDownloads::len`].
    pub fn slot(&self, index: usize) -> Slot {
        self.slots[index]
    }

    /// The slots of every range, in order (for [`PendingDownload::wait_into`]).
    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// Starts reading every range and returns at once.
    ///
    /// # Errors
    /// A buffer freed since the set was prepared, with nothing enqueued.
    pub fn submit(&mut self) -> Result<PendingDownload> {
        let core = &self.core;
        let lane = core.lane(LaneKind::Download);
        if let Some((layout, views, chunks)) = self.fast.as_mut() {
            // Retire what completed: a download that is done and dropped no longer holds
            // the region.
            if Arc::get_mut(&mut layout.lease).is_none() {
                lane.poll()?;
            }
            // No download of the set holds the region any more (`get_mut` also orders this
            // after the release of every other holder, which may have read its views).
            if Arc::get_mut(&mut layout.lease).is_some() {
                let layout = &*layout;
                let mut exec = Exec::begin(core, LaneKind::Download);
                layout.claim(&mut exec)?;
                let first_seq = exec.first_seq();
                let kernels = exec.kernels()?;
                for k in 0..layout.spans.len() {
                    layout.launch(&mut exec, kernels, k)?;
                }
                return Ok(PendingDownload::prepared(
                    Arc::clone(core),
                    exec.finish(),
                    first_seq,
                    Arc::clone(&layout.lease),
                    (self.id, Arc::clone(views)),
                    chunks.clone(),
                    layout.requested as usize,
                ));
            }
        }
        self.as_batch()?.submit()
    }

    /// The set's reads as a batch of its own (whose slots are the set's).
    fn as_batch(&self) -> Result<crate::DownloadBatch<'_>> {
        let mut batch = super::download::downloads_as(&self.core, self.id);
        for &(buffer, offset, len) in &self.ranges {
            batch.read(buffer, offset, len)?;
        }
        Ok(batch)
    }

    /// Reads every range into the caller's vector of the same index, replacing its contents
    /// (capacity is reused), and waits; each vector is filled on the packing threads as soon
    /// as its chunk has landed. A set that is not laid out and streams through the pinned
    /// pool (see [`DownloadBatch`](crate::DownloadBatch)) copies each chunk straight into the
    /// vectors.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] unless there is one vector per range (nothing enqueued);
    /// those of [`PreparedDownloads::submit`] and [`PendingDownload::wait_into`].
    pub fn download_into(&mut self, out: &mut [Vec<u8>]) -> Result<()> {
        self.read_into_as(out).map(drop)
    }

    /// [`PreparedDownloads::download_into`]; returns the route the reads took.
    pub(crate) fn read_into_as(&mut self, out: &mut [Vec<u8>]) -> Result<Route> {
        if out.len() != self.ranges.len() {
            return Err(Error::LengthMismatch {
                what: "prepared ranges and output vectors",
                left: self.ranges.len(),
                right: out.len(),
            });
        }
        if self.fast.is_none() {
            // A batch each time: one that streams through the pinned pool goes straight into
            // the vectors.
            return self.as_batch()?.submit_into_as(out, true);
        }
        let pending = self.submit()?;
        let route = pending.route;
        pending.wait_into(&self.slots, out).map(|_| route)
    }
}

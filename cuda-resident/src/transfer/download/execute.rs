//! Moving a batch: [`DownloadBatch::submit`], the planner's route and reads in order.

use std::sync::Arc;

use super::results::{Downloaded, PendingDownload};
use super::streamed::execute_streamed;
use super::{DownloadBatch, Slot};
use crate::engine::Exec;
use crate::engine::routes::download_chunk::{ChunkPlaces, KERNEL_MIN_COPIES, enqueue_planned};
use crate::engine::spares::Planning;
use crate::engine::staging::DeviceStaging;
use crate::error::{Error, Result};
use crate::fence::Fence;
use crate::host_pool::HostLease;
use crate::kernels::{CopyDescriptor, descriptor_area, push_descriptors, table_bytes};
use crate::plan::route::{PIPELINE_DEPTH, READ_DEPTH, Route, Span, cut_apart, in_order_chunk};
use crate::plan::{ReadRequest, ReadView};
use crate::stream::LaneKind;
use crate::sync::lock;
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

/// Moves the batch. A batch that streams ([`execute_streamed`]) copies its reads into the
/// vectors of `sink` (read `i` into the `i`th) when there are some, and takes them then.
fn execute(batch: &DownloadBatch<'_>, sink: &mut Option<&mut [Vec<u8>]>) -> Result<PendingDownload> {
    let core = batch.core;
    let config = &core.config;
    let apart = &batch.table.apart;
    let (total, plan_config) = batch.sizing();
    let in_order = batch.route_with(&plan_config) == Route::InOrder;
    // Planned before the lane is taken: other batches submit on the lane meanwhile.
    let mut planning = core.spares.planning.lend();
    if !in_order {
        let Planning { planner, download_plan, .. } = &mut *planning;
        planner.plan_download_into(&batch.reads, &plan_config, download_plan)?;
    }
    let mut exec = Exec::begin(core, LaneKind::Download);
    let mut scratch = lock(&core.staging[LaneKind::Download.index()]);
    let scratch = &mut *scratch;
    if in_order {
        let chunk = in_order_chunk(
            config.chunk_bytes,
            total,
            if core.moves_small_copies_over_bus() { READ_DEPTH } else { PIPELINE_DEPTH },
        );
        // Held staging: the download's views keep it after the copy. The lease holds the
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
    let plan = &planning.download_plan;
    if plan.is_empty() {
        return Ok(PendingDownload::empty(batch.id, Fence::completed(), plan.views.clone()));
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
    // Held staging: the download's views keep it after the copy.
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
        download: Downloaded::leased(core, batch.id, lease, tables as usize, views, Vec::new(), 0),
        first_seq: final_seq + 1 - plan.chunks.len() as u64,
        route: Route::Planned,
    })
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
pub(super) fn execute_in_order(
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
        download: Downloaded::leased(core, batch.id, lease, 0, views, chunks, apart.requested as usize),
        first_seq: final_seq + 1 - n,
        route: Route::InOrder,
    })
}

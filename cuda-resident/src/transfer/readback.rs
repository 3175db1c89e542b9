//! Readbacks: a batch of reads, fused, gathered by the kernel (small ranges: into device
//! staging and moved by one DMA, or, many small reads in order, straight into pinned staging
//! over the bus) or copied directly (large ones), into one pinned region that the caller
//! reads as `&[u8]` views.

use std::fmt;
use std::sync::Arc;

use super::pipeline::{self, Groups, Step};
use super::{BufferTable, DeviceStaging, Piece, Span, lay_out_apart};
use crate::alloc::ResidentBuffer;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::host_pool::HostLease;
use crate::kernels::{CopyDescriptor, SEGMENT, descriptor_area, push_descriptors, table_bytes};
use crate::plan::{PlanConfig, ReadRequest, ReadView};
use crate::stream::{Fence, LaneKind};
use crate::sync::lock;
use crate::telemetry::Moves;

/// A chunk with fewer packed ranges than this reads them by one DMA each.
const KERNEL_MIN_COPIES: usize = 3;

/// Batches of at least this many reads, all small and in order, skip planning
/// ([`execute_in_order`]).
const IN_ORDER_MIN: usize = 64;

/// Names one read of a [`ReadbackBatch`]; redeem it with [`Readback::get`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Slot(u32);

/// A batch of device-to-host reads ([`Device::readbacks`]). Reads of one buffer that overlap
/// or touch are fused and move once. Every read is checked when it is added; a bad one
/// returns its error and also fails `submit`.
pub struct ReadbackBatch<'a> {
    device: &'a Device,
    table: BufferTable,
    reads: Vec<ReadRequest>,
    error: Option<Error>,
}

impl fmt::Debug for ReadbackBatch<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadbackBatch").field("reads", &self.reads.len()).finish_non_exhaustive()
    }
}

/// A submitted readback: the bytes are in flight.
#[derive(Debug)]
pub struct PendingReadback {
    fence: Fence,
    readback: Readback,
    /// The sequence number of the first chunk's submission (chunk `k` is `first_seq + k`).
    first_seq: u64,
}

/// Completed reads: views into pinned staging, valid while this value lives. Dropping it
/// returns the staging to the pool.
pub struct Readback {
    device: Option<Device>,
    lease: Option<Arc<HostLease>>,
    /// Where flat staging starts in the lease (after the descriptor tables).
    base: usize,
    views: Vec<ReadView>,
}

impl Drop for ReadbackBatch<'_> {
    fn drop(&mut self) {
        use std::mem::take;
        self.device.core().readback_parts.give((take(&mut self.table), take(&mut self.reads)));
    }
}

impl Drop for Readback {
    fn drop(&mut self) {
        if let Some(device) = &self.device {
            device.core().readback_views.give(std::mem::take(&mut self.views));
        }
    }
}

impl fmt::Debug for Readback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Readback").field("reads", &self.views.len()).finish_non_exhaustive()
    }
}

impl Device {
    /// Starts a batch of readbacks.
    pub fn readbacks(&self) -> ReadbackBatch<'_> {
        let (table, reads) = self.core().readback_parts.take();
        ReadbackBatch { device: self, table, reads, error: None }
    }
}

impl ReadbackBatch<'_> {
    /// Adds a read of `len` bytes of `buffer` at `offset`.
    pub fn read(&mut self, buffer: ResidentBuffer, offset: u64, len: u64) -> Result<Slot> {
        let (key, buffer_len) = self.table.check(self.device, buffer, offset, len, &mut self.error)?;
        let slot = Slot(self.reads.len() as u32);
        self.reads.push(ReadRequest { buffer: u64::from(key), buffer_len, offset, len });
        Ok(slot)
    }

    /// Adds a read of the whole buffer.
    pub fn read_all(&mut self, buffer: ResidentBuffer) -> Result<Slot> {
        let len = self.device.buffer_len(buffer)?;
        self.read(buffer, 0, len)
    }

    /// Adds a read of each whole buffer, in order.
    pub fn read_many(&mut self, buffers: &[ResidentBuffer]) -> Result<Vec<Slot>> {
        buffers.iter().map(|&b| self.read_all(b)).collect()
    }

    /// Number of reads added.
    pub fn len(&self) -> usize {
        self.reads.len()
    }

    /// Whether no read was added.
    pub fn is_empty(&self) -> bool {
        self.reads.is_empty()
    }

    /// Starts the reads and returns at once. Fails (with nothing enqueued) if any read was
    /// bad, a buffer was freed since, or the reads need more pinned staging than the pool's
    /// cap.
    pub fn submit(mut self) -> Result<PendingReadback> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        execute(&self)
    }
}

impl PendingReadback {
    /// Blocks until the bytes are in host memory.
    pub fn wait(self) -> Result<Readback> {
        self.fence.wait()?;
        Ok(self.readback)
    }

    /// Waits for the reads chunk by chunk and copies each read into the caller's vector of
    /// the same index as soon as its chunk has landed, while later chunks are still on the
    /// wire, on the packing threads; replaces each vector's contents (capacity is reused).
    /// Returns the readback for views as well. On error the vectors are left empty.
    pub fn wait_into(self, slots: &[Slot], out: &mut [Vec<u8>]) -> Result<Readback> {
        if slots.len() != out.len() {
            return Err(Error::LengthMismatch {
                what: "slots and output vectors",
                left: slots.len(),
                right: out.len(),
            });
        }
        let Some(device) = self.readback.device.clone() else {
            self.readback.copy_all_into(slots, out)?;
            return Ok(self.readback);
        };
        // Reads grouped by the chunk that completes them, split into pieces for the packing
        // threads, which copy a chunk's reads out as soon as it has landed.
        let views = &self.readback.views;
        let mut order: Vec<usize> = (0..slots.len()).collect();
        order.sort_unstable_by_key(|&i| views[slots[i].0 as usize].last_chunk);
        let chunks = order.last().map_or(0, |&i| views[slots[i].0 as usize].last_chunk as usize + 1);
        let mut pieces = Vec::with_capacity(order.len());
        let mut spans = Vec::new();
        let mut total = 0;
        for same in order
            .chunk_by(|&a, &b| views[slots[a].0 as usize].last_chunk == views[slots[b].0 as usize].last_chunk)
        {
            let first = pieces.len();
            for &i in same {
                total += self.readback.push_copy(slots[i], &mut out[i], &mut pieces);
            }
            spans.push((views[slots[same[0]].0 as usize].last_chunk as usize, first..pieces.len()));
        }
        let threads = device.core().packers().current_num_threads();
        let chunk_bytes = (total / chunks.max(1)) as u64;
        let groups =
            Groups::new(chunks, spans.into_iter(), |p| pieces[p].len, Groups::target(chunk_bytes, threads));
        let lane = device.core().lane(LaneKind::Readback);
        let first_seq = self.first_seq;
        pipeline::run(
            &device,
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
        // SAFETY: every chunk's copies ran (`run` returned Ok).
        unsafe { self.readback.set_lengths(slots, out) };
        // Everything has landed; this also reports any error of the last submissions.
        self.fence.wait()?;
        Ok(self.readback)
    }

    /// The fence of the reads.
    pub fn fence(&self) -> &Fence {
        &self.fence
    }
}

impl Readback {
    /// The bytes of a read, viewed in pinned staging (no copy).
    ///
    /// # Panics
    /// If `slot` came from another batch with more reads than this one.
    pub fn get(&self, slot: Slot) -> &[u8] {
        let view = self.views[slot.0 as usize];
        match &self.lease {
            // SAFETY: the reads completed (this value exists only after the fence), the
            // view lies inside the lease's flat staging, and the lease lives as long as self.
            Some(lease) => unsafe {
                &lease.as_slice()[self.base + view.stage_offset as usize..][..view.len as usize]
            },
            None => &[],
        }
    }

    /// Where a read's bytes will be in pinned staging, and their length; no reference is
    /// made, so this may be asked before they land.
    fn address_of(&self, slot: Slot) -> (*const u8, usize) {
        let view = self.views[slot.0 as usize];
        match &self.lease {
            Some(lease) => {
                // SAFETY: the view lies inside the lease's flat staging.
                let at = unsafe { lease.as_ptr().add(self.base + view.stage_offset as usize) };
                (at, view.len as usize)
            }
            None => (std::ptr::null(), 0),
        }
    }

    /// Copies a read into a caller-owned vector, replacing its contents (its capacity is
    /// reused).
    pub fn copy_into(&self, slot: Slot, out: &mut Vec<u8>) {
        out.clear();
        out.extend_from_slice(self.get(slot));
    }

    /// Copies each read into the caller's vector of the same index, replacing its contents
    /// (capacity is reused), on the device's packing threads when there is enough to copy.
    pub fn copy_all_into(&self, slots: &[Slot], out: &mut [Vec<u8>]) -> Result<()> {
        if slots.len() != out.len() {
            return Err(Error::LengthMismatch {
                what: "slots and output vectors",
                left: slots.len(),
                right: out.len(),
            });
        }
        let Some(device) = &self.device else {
            out.iter_mut().for_each(Vec::clear);
            return Ok(());
        };
        let mut pieces = Vec::with_capacity(slots.len());
        for (&slot, vec) in slots.iter().zip(out.iter_mut()) {
            self.push_copy(slot, vec, &mut pieces);
        }
        // SAFETY: each destination is a distinct vector's spare capacity of at least its
        // source's length; sources are views of landed reads.
        unsafe { Piece::copy_out_all(device, &pieces) };
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
    /// The copies [`Readback::push_copy`] listed for these slots and vectors have all run.
    unsafe fn set_lengths(&self, slots: &[Slot], out: &mut [Vec<u8>]) {
        for (&slot, vec) in slots.iter().zip(out.iter_mut()) {
            // SAFETY: the copies initialised exactly this many bytes, as the caller promises.
            unsafe { vec.set_len(self.views[slot.0 as usize].len as usize) };
        }
    }

    /// Number of reads.
    pub fn len(&self) -> usize {
        self.views.len()
    }

    /// Whether there are no reads.
    pub fn is_empty(&self) -> bool {
        self.views.is_empty()
    }
}

fn execute(batch: &ReadbackBatch<'_>) -> Result<PendingReadback> {
    let device = batch.device;
    let core = device.core();
    let config = device.config();
    let total: u64 = batch.reads.iter().map(|r| r.len).sum();
    let chunk_bytes = super::pipeline_chunk(config.chunk_bytes, total, super::PIPELINE_DEPTH);
    let plan_config =
        PlanConfig { direct_threshold: config.direct_threshold.min(chunk_bytes), chunk_bytes, align: 16 };
    let lane = core.lane(LaneKind::Readback);
    let lane_batch = lane.batch();
    let mut scratch = lock(&core.staging[LaneKind::Readback.index()]);
    let scratch = &mut *scratch;
    if batch.reads.len() >= IN_ORDER_MIN
        && batch.reads.iter().all(|r| r.len > 0 && r.len <= SEGMENT && r.len < plan_config.direct_threshold)
        && scratch.planner.are_reads_apart(&batch.reads)
    {
        return execute_in_order(
            batch,
            super::in_order_chunk(
                config.chunk_bytes,
                total,
                if device.small_copies_over_bus() { super::READ_DEPTH } else { super::PIPELINE_DEPTH },
            ),
            &lane_batch,
            scratch,
        );
    }
    scratch.planner.plan_readback_into(&batch.reads, &plan_config, &mut scratch.readback_plan)?;
    let plan = &scratch.readback_plan;
    if plan.is_empty() {
        let views = plan.views.clone();
        return Ok(PendingReadback {
            fence: Fence::completed(),
            readback: Readback { device: None, lease: None, base: 0, views },
            first_seq: 0,
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
    let lease = Arc::new(device.acquire_staging((tables + plan.total_staging) as usize)?);
    let base = lease.as_ptr();

    let first_seq = lane_batch.next_seq();
    let final_seq =
        device.claim(&lane_batch, LaneKind::Readback, batch.table.buffers(), plan.chunks.len() as u64)?;

    let kernels = if areas.iter().any(|&a| a > 0) { Some(core.kernels()?) } else { None };
    let device_need =
        plan.chunks.iter().zip(&areas).filter(|(_, a)| **a > 0).map(|(c, a)| a + c.packed_len).max();
    let dev = match device_need {
        Some(need) => scratch.region.ensure(device, LaneKind::Readback, need, first_seq - 1)?,
        None => 0,
    };
    let ptr_of = |key: u64| batch.table.entries[key as usize].ptr;
    // SAFETY: flat offsets of the plan lie inside the lease's staging part.
    let staged = |flat: u64| unsafe { base.add((tables + flat) as usize) };

    let (mut table_at, mut dmas, mut launches, mut moved) = (0u64, 0u64, 0u64, 0u64);
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
        lane_batch.submit(vec![Arc::clone(&lease)], |raw, stream, _| {
            if area > 0 {
                // SAFETY: the table is pinned and stays alive (kept by this submission);
                // device staging holds area + packed_len bytes.
                unsafe { raw.memcpy_htod_async(dev, base.add(table as usize), area as usize, stream) }?;
                let kernels = kernels.expect("loaded when a chunk uses it");
                // SAFETY: sources are live, marked buffers; destinations are disjoint ranges
                // of device staging.
                unsafe { kernels.copy(raw, stream, dev, count) }?;
                // SAFETY: the packed region of this chunk lies inside the lease.
                unsafe {
                    raw.memcpy_dtoh_async(
                        staged(chunk.packed_offset),
                        dev + area,
                        chunk.packed_len as usize,
                        stream,
                    )
                }?;
            }
            // Packed ranges without the kernel, and direct ones: one DMA each.
            let singles = if area > 0 { &chunk.packed[..0] } else { &chunk.packed[..] };
            for c in singles.iter().chain(&chunk.direct) {
                // SAFETY: a range of a live, marked buffer into the lease.
                unsafe {
                    raw.memcpy_dtoh_async(
                        staged(c.stage_offset),
                        ptr_of(c.buffer) + c.buffer_offset,
                        c.len as usize,
                        stream,
                    )
                }?;
            }
            Ok(())
        })?;
        if area > 0 {
            dmas += 2 + chunk.direct.len() as u64;
            launches += 1;
            moved += area + chunk.packed_len;
        } else {
            dmas += (chunk.packed.len() + chunk.direct.len()) as u64;
            moved += chunk.packed.iter().map(|c| c.len).sum::<u64>();
        }
        moved += chunk.direct.iter().map(|c| c.len).sum::<u64>();
    }
    core.telemetry.record(
        LaneKind::Readback,
        Moves {
            submissions: plan.chunks.len() as u64,
            requested: plan.requested_bytes,
            moved,
            dmas,
            launches,
        },
    );
    let mut views = core.readback_views.take();
    views.extend_from_slice(&plan.views);
    drop(lane_batch);
    Ok(PendingReadback {
        fence: Fence::new(device.clone(), LaneKind::Readback, final_seq),
        readback: Readback { device: Some(device.clone()), lease: Some(lease), base: tables as usize, views },
        first_seq: final_seq + 1 - plan.chunks.len() as u64,
    })
}

#[cfg(test)]
thread_local! {
    /// Batches this thread moved by [`execute_in_order`].
    pub(crate) static IN_ORDER_BATCHES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Reads in order and apart (each past the end of the earlier reads of its buffer, with a
/// gap: none overlap and none touch, so the planner would fuse none), none longer than a
/// kernel segment: the common batch of many small reads, laid out without the planner. One
/// pass places each read in a chunk (its descriptor table and packed bytes within
/// `chunk_bytes`), at the residue of its source modulo 16, and notes its view; then, per
/// chunk, the descriptors are written straight into the chunk's table in the pinned lease,
/// and one launch moves it: the kernel reads the table and writes the bytes in the lease,
/// over the bus ([`Config::small_copies_over_bus`](crate::Config::small_copies_over_bus)),
/// or one table upload, one gather into device staging and one DMA.
fn execute_in_order(
    batch: &ReadbackBatch<'_>,
    chunk_bytes: u64,
    lane_batch: &crate::stream::LaneBatch<'_>,
    scratch: &mut DeviceStaging,
) -> Result<PendingReadback> {
    #[cfg(test)]
    IN_ORDER_BATCHES.with(|n| n.set(n.get() + 1));
    let device = batch.device;
    let core = device.core();
    let ptr_of = |r: &ReadRequest| batch.table.entries[r.buffer as usize].ptr + r.offset;
    let DeviceStaging { offsets, spans, region, .. } = scratch;
    lay_out_apart(batch.reads.iter().map(|r| (ptr_of(r), r.len)), chunk_bytes, offsets, spans);
    let mut views = core.readback_views.take();
    for (chunk, span) in (0u32..).zip(spans.iter()) {
        for i in span.requests.clone() {
            let len = batch.reads[i].len;
            views.push(ReadView { chunk, last_chunk: chunk, stage_offset: offsets[i], len });
        }
    }
    let area = |span: &Span| table_bytes(span.requests.len() as u64);
    let tables: u64 = spans.iter().map(area).sum();
    let staged = spans.last().map_or(0, |span| span.start + span.len);
    let lease = Arc::new(device.acquire_staging((tables + staged) as usize)?);
    let base = lease.as_ptr();
    let first_seq = lane_batch.next_seq();
    let final_seq =
        device.claim(lane_batch, LaneKind::Readback, batch.table.buffers(), spans.len() as u64)?;
    let kernels = core.kernels()?;
    let device_need = spans.iter().map(|span| area(span) + span.len).max().unwrap_or(0);
    // Where the kernel gathers to: device staging, or the lease itself.
    let dev = if device.small_copies_over_bus() {
        None
    } else {
        Some(region.ensure(device, LaneKind::Readback, device_need, first_seq - 1)?)
    };
    let (mut table_at, mut moved) = (0u64, 0u64);
    for span in spans.iter() {
        // The lease holds every chunk's table, then the flat packed bytes.
        let (table, area, packed, start, range) =
            (table_at, area(span), span.len, span.start, span.requests.clone());
        table_at += area;
        let descriptors = base.wrapping_add(table as usize).cast::<CopyDescriptor>();
        for (j, i) in range.clone().enumerate() {
            let r = &batch.reads[i];
            let dst = match dev {
                Some(dev) => dev + area + (offsets[i] - start),
                None => base as u64 + tables + offsets[i],
            };
            let d = CopyDescriptor { src: ptr_of(r), dst, len: r.len };
            // SAFETY: the chunk's table in the lease has a slot per read (8-byte aligned:
            // tables are multiples of 256 bytes from the page-aligned start); nothing
            // reads it yet.
            unsafe { descriptors.add(j).write(d) };
        }
        let count = range.len() as u64;
        lane_batch.submit(vec![Arc::clone(&lease)], |raw, stream, _| {
            let Some(dev) = dev else {
                // SAFETY: the table and the destinations (each read's place in flat staging)
                // are in the pinned lease, which this submission keeps alive and the device
                // reaches (unified addressing); sources are disjoint ranges of live, marked
                // buffers.
                return unsafe { kernels.copy_over_bus(raw, stream, descriptors as u64, count) };
            };
            // SAFETY: the table is pinned and stays alive (kept by this submission); device
            // staging holds area + packed bytes.
            unsafe { raw.memcpy_htod_async(dev, descriptors.cast(), area as usize, stream) }?;
            // SAFETY: sources are disjoint ranges of live, marked buffers; destinations are
            // disjoint ranges of device staging.
            unsafe { kernels.copy(raw, stream, dev, count) }?;
            // SAFETY: the chunk's packed bytes lie inside the lease, after the tables.
            unsafe {
                raw.memcpy_dtoh_async(
                    base.add((tables + start) as usize),
                    dev + area,
                    packed as usize,
                    stream,
                )
            }
        })?;
        // Over the bus the kernel reads the descriptors and writes the payload, not the
        // padding between packed reads that a DMA moves.
        moved += match dev {
            Some(_) => area + packed,
            None => {
                count * std::mem::size_of::<CopyDescriptor>() as u64
                    + range.map(|i| batch.reads[i].len).sum::<u64>()
            }
        };
    }
    let chunks = spans.len() as u64;
    let requested = batch.reads.iter().map(|r| r.len).sum();
    core.telemetry.record(
        LaneKind::Readback,
        Moves {
            submissions: chunks,
            requested,
            moved,
            dmas: if dev.is_some() { 2 * chunks } else { 0 },
            launches: chunks,
        },
    );
    Ok(PendingReadback {
        fence: Fence::new(device.clone(), LaneKind::Readback, final_seq),
        readback: Readback { device: Some(device.clone()), lease: Some(lease), base: tables as usize, views },
        first_seq: final_seq + 1 - chunks,
    })
}

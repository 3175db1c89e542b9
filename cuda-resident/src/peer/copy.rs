//! Peer copy batches: many device-to-device copies into one GPU, fused like uploads.
//!
//! Copies run on the destination device's upload lane. Small ones are moved by one launch
//! of the copy kernel on the destination GPU, which reads the source GPU's memory directly
//! (peer access over NVLink or PCIe); large ones by one `cuMemcpyPeerAsync` each. The
//! descriptor table goes up with one DMA from pinned staging. Without peer access the copies
//! are staged through host memory instead: a readback on the source, an upload on the
//! destination.
//!
//! Ordering on the devices, no host waits: the destination lane waits (`cuStreamWaitEvent`)
//! for the source device's uploads into the source buffers and for the destination
//! device's readbacks of the destination buffers. On the source device an empty submission
//! on its readback lane waits for the copy and marks the source buffers as read by it, so
//! that freeing them, or uploading into them, waits for the copy as for any readback.

use std::fmt;
use std::sync::Arc;

use crate::alloc::ResidentBuffer;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::kernels::{CopyDescriptor, push_descriptors};
use crate::plan::{PlanConfig, Planner, UploadPlan, WriteRequest};
use crate::stream::{Fence, LaneKind};
use crate::sync::lock;
use crate::telemetry::{Moves, Telemetry};
use crate::transfer::BufferTable;

/// A copy of at least this many bytes moves by its own `cuMemcpyPeerAsync`; smaller ones
/// share one kernel launch.
pub(crate) const PEER_DMA_MIN: u64 = 4 << 20;

/// One copy with overlaps resolved: device addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Move {
    pub(crate) src: u64,
    pub(crate) dst: u64,
    pub(crate) len: u64,
}

/// A batch of copies from buffers of one device (the source) into buffers of the device
/// that made it ([`Device::peer_copies`]). Copies apply in order: where two destinations
/// overlap, the later copy wins. Nothing moves until [`PeerBatch::submit`].
///
/// Every copy is checked when it is added; a bad one returns its error and also fails
/// `submit`, so a batch with a bad copy moves nothing.
///
/// A source range that overlaps a destination range of the same batch (possible only when
/// source and destination are the same device) reads unspecified bytes.
pub struct PeerBatch<'a> {
    dst: &'a Device,
    src: &'a Device,
    src_table: BufferTable,
    dst_table: BufferTable,
    /// The copies, as writes into the destination buffers (keys of `dst_table`).
    writes: Vec<WriteRequest>,
    /// Per copy: its source buffer's key in `src_table` and the offset there.
    sources: Vec<(u32, u64)>,
    error: Option<Error>,
}

impl fmt::Debug for PeerBatch<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerBatch")
            .field("src", &self.src.info().ordinal)
            .field("dst", &self.dst.info().ordinal)
            .field("copies", &self.writes.len())
            .finish_non_exhaustive()
    }
}

impl Device {
    /// Starts a batch of copies from buffers of `src` into buffers of this device. `src` may
    /// be this device itself (copies inside one GPU).
    ///
    /// The copies read `src`'s memory directly when this device may access it
    /// ([`Device::enable_peer`]); otherwise they are staged through host memory, which
    /// works between any two GPUs but blocks `submit` until the source bytes are on the
    /// host.
    pub fn peer_copies<'a>(&'a self, src: &'a Device) -> PeerBatch<'a> {
        PeerBatch {
            dst: self,
            src,
            src_table: BufferTable::default(),
            dst_table: BufferTable::default(),
            writes: Vec::new(),
            sources: Vec::new(),
            error: None,
        }
    }
}

impl PeerBatch<'_> {
    /// Adds a copy of `len` bytes from `src` (a buffer of the source device) at
    /// `src_offset` to `dst` (a buffer of this batch's device) at `dst_offset`.
    pub fn copy(
        &mut self,
        src: ResidentBuffer,
        src_offset: u64,
        dst: ResidentBuffer,
        dst_offset: u64,
        len: u64,
    ) -> Result<&mut Self> {
        let (src_key, _) = self.src_table.check(self.src, src, src_offset, len, &mut self.error)?;
        let (dst_key, dst_len) = self.dst_table.check(self.dst, dst, dst_offset, len, &mut self.error)?;
        self.writes.push(WriteRequest {
            buffer: u64::from(dst_key),
            buffer_len: dst_len,
            offset: dst_offset,
            len,
        });
        self.sources.push((src_key, src_offset));
        Ok(self)
    }

    /// Number of copies added.
    pub fn len(&self) -> usize {
        self.writes.len()
    }

    /// Whether no copy was added.
    pub fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }

    /// Starts the copies and returns at once (after the source bytes reached the host, on
    /// the staged path); the fence, on the destination device, completes when every byte
    /// has landed. Fails (with nothing enqueued) if any copy was bad or a buffer was freed
    /// since it was added.
    pub fn submit(self) -> Result<Fence> {
        if let Some(e) = self.error {
            return Err(e);
        }
        if self.writes.iter().all(|w| w.len == 0) {
            return Ok(Fence::completed());
        }
        if self.dst.can_read_directly(self.src) { self.submit_direct() } else { self.submit_staged() }
    }

    /// The copies with overlaps resolved (the later copy wins), as device addresses: the
    /// copies themselves when their destinations are in order, else from an upload plan
    /// of the destinations (every interval direct, one chunk), whose fills say which copy
    /// supplies each destination byte.
    fn moves(&self, planner: &mut Planner, plan: &mut UploadPlan, out: &mut Vec<Move>) -> Result<()> {
        let src_at = |copy: usize, offset: u64| {
            let (key, at) = self.sources[copy];
            self.src_table.entries[key as usize].ptr + at + offset
        };
        let dst_at = |key: u64, offset: u64| self.dst_table.entries[key as usize].ptr + offset;
        out.clear();
        if planner.is_in_order(&self.writes) {
            let copies = self.writes.iter().enumerate().filter(|(_, w)| w.len > 0);
            out.extend(copies.map(|(i, w)| Move {
                src: src_at(i, 0),
                dst: dst_at(w.buffer, w.offset),
                len: w.len,
            }));
            return Ok(());
        }
        let config = PlanConfig { direct_threshold: 0, chunk_bytes: 1 << 62, align: 1 };
        planner.plan_upload_into(&self.writes, &config, plan)?;
        let mut spans: Vec<(u64, u64)> = plan
            .chunks
            .iter()
            .flat_map(|c| c.direct.iter().chain(&c.packed))
            .map(|c| (c.stage_offset, dst_at(c.buffer, c.buffer_offset)))
            .collect();
        spans.sort_unstable_by_key(|s| s.0);
        out.extend(plan.fills.iter().map(|f| {
            let (stage, dst) = spans[spans.partition_point(|s| s.0 <= f.stage_offset) - 1];
            Move {
                src: src_at(f.write as usize, f.src_offset),
                dst: dst + (f.stage_offset - stage),
                len: f.len,
            }
        }));
        Ok(())
    }

    /// Peer access (or one device): one kernel for the small copies, a DMA per large one,
    /// on the destination's upload lane.
    fn submit_direct(self) -> Result<Fence> {
        let (src, dst) = (self.src, self.dst);
        let (src_core, dst_core) = (src.core(), dst.core());
        let same = std::ptr::eq(src_core, dst_core);
        // Lock order, as everywhere: a readback lane before an upload lane, a lane before
        // its staging.
        let proxy = (!same).then(|| src_core.lane(LaneKind::Readback).batch());
        let lane = dst_core.lane(LaneKind::Upload);
        let lane_batch = lane.batch();
        let mut scratch = lock(&dst_core.staging[LaneKind::Upload.index()]);
        let scratch = &mut *scratch;

        let mut moves = Vec::new();
        self.moves(&mut scratch.planner, &mut scratch.upload_plan, &mut moves)?;
        let requested: u64 = self.writes.iter().map(|w| w.len).sum();
        let first_seq = lane_batch.next_seq();
        let final_seq = match &proxy {
            None => dst.claim(
                &lane_batch,
                LaneKind::Upload,
                self.src_table.buffers().chain(self.dst_table.buffers()),
                1,
            )?,
            Some(proxy) => {
                // The source buffers are read by the proxy submission's number on the
                // source's readback lane; the copy waits for the source's uploads into them.
                let proxy_seq = proxy.next_seq();
                proxy.reserve(proxy_seq);
                let uploads = src_core.alloc.mark_used_many(
                    self.src_table.buffers(),
                    LaneKind::Readback.index(),
                    proxy_seq,
                )?;
                let seq = dst.claim(&lane_batch, LaneKind::Upload, self.dst_table.buffers(), 1)?;
                src_core.lane(LaneKind::Upload).make_stream_wait(uploads, lane.stream())?;
                seq
            }
        };

        scratch.descriptors.clear();
        let mut dmas = Vec::new();
        for m in &moves {
            if m.len >= PEER_DMA_MIN {
                dmas.push(*m);
            } else {
                push_descriptors(&mut scratch.descriptors, m.src, m.dst, m.len);
            }
        }
        let count = scratch.descriptors.len() as u64;
        let table_bytes = scratch.descriptors.len() * std::mem::size_of::<CopyDescriptor>();
        // Rounded as descriptor tables are everywhere.
        let area = (table_bytes as u64).next_multiple_of(256);
        let enqueued = (|| {
            let mut keep = Vec::new();
            let mut kernel = None;
            if count > 0 {
                let dev = scratch.region.ensure(dst, LaneKind::Upload, area, first_seq - 1)?;
                let table = Arc::new(dst.acquire_staging(table_bytes)?);
                // SAFETY: the lease holds table_bytes bytes and is this batch's own.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        scratch.descriptors.as_ptr().cast::<u8>(),
                        table.as_ptr(),
                        table_bytes,
                    )
                };
                kernel = Some((dst_core.kernels()?, dev, table.as_ptr()));
                keep.push(table);
            }
            let contexts = (dst_core.ctx.ctx, src_core.ctx.ctx);
            lane_batch.submit(keep, |raw, stream, _| {
                if let Some((kernels, dev, table)) = kernel {
                    // SAFETY: the pinned table is kept alive by this submission; device
                    // staging holds `area >= table_bytes` bytes.
                    unsafe { raw.memcpy_htod_async(dev, table, table_bytes, stream) }?;
                    // SAFETY: the table is in device staging by stream order; sources are
                    // live, marked buffers this device may read; destinations are disjoint
                    // ranges of live, marked buffers.
                    unsafe { kernels.copy(raw, stream, dev, count) }?;
                }
                for m in &dmas {
                    // SAFETY: as above, by one DMA.
                    unsafe {
                        raw.memcpy_peer_async(
                            (m.dst, contexts.0),
                            (m.src, contexts.1),
                            m.len as usize,
                            stream,
                        )
                    }?;
                }
                Ok(())
            })
        })();
        if let Some(proxy) = proxy {
            // The source's readback lane waits for the copy, on the device; if that cannot be
            // enqueued, the host waits for it instead.
            let ordered = src_core
                .ctx
                .bind()
                .and_then(|_| lane.make_stream_wait(final_seq, src_core.lane(LaneKind::Readback).stream()));
            if ordered.is_err() {
                let _ = lane.wait(final_seq);
            }
            proxy.submit(Vec::new(), |_, _, _| Ok(()))?;
            src_core.telemetry.record(LaneKind::Readback, Moves { submissions: 1, ..Moves::default() });
        }
        let seq = enqueued?;
        debug_assert_eq!(seq, final_seq);
        let copied: u64 = moves.iter().map(|m| m.len).sum();
        let table_moved = if count > 0 { table_bytes as u64 } else { 0 };
        dst_core.telemetry.record(
            LaneKind::Upload,
            Moves {
                submissions: 1,
                requested,
                moved: copied + table_moved,
                dmas: dmas.len() as u64 + u64::from(count > 0),
                launches: u64::from(count > 0),
            },
        );
        Telemetry::add(&dst_core.telemetry.peer_bytes, copied);
        drop(lane_batch);
        Ok(Fence::new(dst.clone(), LaneKind::Upload, final_seq))
    }

    /// No peer access: groups of copies read back from the source into pinned staging and
    /// uploaded from there, in order (so later copies still win). Every buffer is checked
    /// before anything moves.
    fn submit_staged(self) -> Result<Fence> {
        for entry in &self.src_table.entries {
            self.src.core().alloc.resolve(entry.buffer)?;
        }
        for entry in &self.dst_table.entries {
            self.dst.core().alloc.resolve(entry.buffer)?;
        }
        let group = self.dst.config().chunk_bytes.max(1 << 20) * crate::transfer::RING as u64;
        let mut fence = Fence::completed();
        let mut pieces: Vec<(ResidentBuffer, u64, ResidentBuffer, u64, u64)> = Vec::new();
        let mut bytes = 0;
        let flush = |pieces: &mut Vec<(ResidentBuffer, u64, ResidentBuffer, u64, u64)>| -> Result<Fence> {
            let mut reads = self.src.readbacks();
            let slots =
                pieces.iter().map(|&(b, o, _, _, len)| reads.read(b, o, len)).collect::<Result<Vec<_>>>()?;
            let done = reads.submit()?.wait()?;
            let mut uploads = self.dst.uploads();
            for (&(_, _, b, o, _), &slot) in pieces.iter().zip(&slots) {
                uploads.write(b, o, done.get(slot))?;
            }
            pieces.clear();
            uploads.submit()
        };
        for (w, &(src_key, src_offset)) in self.writes.iter().zip(&self.sources) {
            let src = self.src_table.entries[src_key as usize].buffer;
            let dst = self.dst_table.entries[w.buffer as usize].buffer;
            let mut done = 0;
            while done < w.len {
                let len = (w.len - done).min(group);
                if bytes + len > group && !pieces.is_empty() {
                    fence = flush(&mut pieces)?;
                    bytes = 0;
                }
                pieces.push((src, src_offset + done, dst, w.offset + done, len));
                bytes += len;
                done += len;
            }
        }
        if !pieces.is_empty() {
            fence = flush(&mut pieces)?;
        }
        Ok(fence)
    }
}

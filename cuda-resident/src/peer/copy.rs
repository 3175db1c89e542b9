//! Peer copy batches: many device-to-device copies into one GPU, fused like uploads.
//!
//! Copies run on the destination device's upload lane. Small ones are moved by one launch
//! of the copy kernel on the destination GPU, which reads the source GPU's memory directly
//! (peer access over NVLink or PCIe); large ones by one `cuMemcpyPeerAsync` each. The
//! kernel's descriptors are written straight into pinned memory as the copies are added,
//! and the kernel reads them there (one DMA takes them to the device where the GPU has no
//! unified addressing): no copy of the table on the host. Without peer access the copies
//! are staged through host memory instead: a download on the source, an upload on the
//! destination.
//!
//! Ordering on the devices, no host waits: the destination lane waits (`cuStreamWaitEvent`)
//! for the source device's uploads into the source buffers and for the destination
//! device's downloads of the destination buffers. On the source device an empty submission
//! on its download lane waits for the copy and marks the source buffers as read by it, so
//! that freeing them, or uploading into them, waits for the copy as for any download.

use std::fmt;
use std::sync::Arc;

use crate::alloc::ResidentBuffer;
use crate::engine::Exec;
use crate::engine::core::Core;
use crate::engine::host::{DESCRIPTOR, Table};
use crate::engine::spares::{PeerParts, Planning};
use crate::engine::table::BufferTable;
use crate::error::{Error, Result};
use crate::fence::Fence;
use crate::kernels::{self, CopyDescriptor, PEER_SEGMENT, SEGMENT};
use crate::plan::route::Route;
use crate::plan::{PlanConfig, Planner, UploadPlan, WriteRequest};
use crate::stream::LaneKind;
use crate::sync::lock;
use crate::telemetry::Telemetry;
use crate::transfer::single::DRIVER_STAGED_MOST;

/// A copy of at least this many bytes moves by its own `cuMemcpyPeerAsync`; smaller ones
/// share one kernel launch.
pub(crate) const PEER_DMA_MIN: u64 = 4 << 20;

/// A batch of copies from buffers of one device (the source) into buffers of the device
/// that made it ([`Device::peer_copies`](crate::Device::peer_copies)). Copies apply in order: where two destinations
/// overlap, the later copy wins. Nothing moves until [`PeerBatch::submit`].
///
/// Every copy is checked when it is added; a bad one returns its error and also fails
/// `submit`, so a batch with a bad copy moves nothing.
///
/// A source range that overlaps a destination range of the same batch (possible only when
/// source and destination are the same device) reads unspecified bytes.
#[must_use = "a peer batch moves nothing until it is submitted"]
pub struct PeerBatch<'a> {
    dst: &'a Arc<Core>,
    src: &'a Arc<Core>,
    parts: PeerParts,
    error: Option<Error>,
}

/// Descriptors of a peer copy of `len` bytes.
fn pieces(len: u64) -> usize {
    len.div_ceil(PEER_SEGMENT) as usize
}

impl PeerParts {
    /// Records a checked copy: `src_at` and `dst_at` are the device addresses of its first
    /// byte. Fails only when pinned memory for its descriptors cannot be had.
    #[allow(clippy::too_many_arguments)] // One call site per public method; all scalars.
    #[inline]
    fn add(
        &mut self,
        dst: &Core,
        src_key: u32,
        src_offset: u64,
        src_at: u64,
        dst_key: u32,
        dst_len: u64,
        dst_offset: u64,
        dst_at: u64,
        len: u64,
    ) -> Result<()> {
        if len > 0 && !self.out_of_order && len < PEER_DMA_MIN {
            self.descriptors.reserve(dst, pieces(len))?;
        }
        self.copies += 1;
        if len == 0 {
            return Ok(());
        }
        self.bytes = self.bytes.saturating_add(len);
        if !self.out_of_order {
            let key = dst_key as usize;
            if key >= self.ends.len() {
                self.ends.resize(key + 1, 0);
            }
            if dst_offset >= self.ends[key] {
                self.ends[key] = dst_offset + len;
                self.route(CopyDescriptor { src: src_at, dst: dst_at, len });
                return Ok(());
            }
            self.list_copies();
        }
        self.writes.push(WriteRequest {
            buffer: u64::from(dst_key),
            buffer_len: dst_len,
            offset: dst_offset,
            len,
        });
        self.sources.push((src_key, src_offset));
        Ok(())
    }

    /// Leaves the in-order path: the copies so far, listed from their descriptors and DMAs
    /// (a copy split into several descriptors becomes as many adjacent copies; in order,
    /// none overlap, so their order among themselves does not matter). Each address lies
    /// in exactly one buffer of its table.
    fn list_copies(&mut self) {
        if self.out_of_order {
            return;
        }
        self.out_of_order = true;
        let index = |table: &BufferTable| {
            let mut by_address: Vec<(u64, u32)> = table.named().map(|(k, e)| (e.ptr, k)).collect();
            by_address.sort_unstable();
            by_address
        };
        let (src_index, dst_index) = (index(&self.src_table), index(&self.dst_table));
        let find = |index: &[(u64, u32)], at: u64| index[index.partition_point(|&(ptr, _)| ptr <= at) - 1].1;
        for m in self.descriptors.as_slice().iter().chain(&self.dmas) {
            let (dk, sk) = (find(&dst_index, m.dst), find(&src_index, m.src));
            let (d, s) = (self.dst_table.entries[dk as usize], self.src_table.entries[sk as usize]);
            self.writes.push(WriteRequest {
                buffer: u64::from(dk),
                buffer_len: d.len,
                offset: m.dst - d.ptr,
                len: m.len,
            });
            self.sources.push((sk, m.src - s.ptr));
        }
        // Rebuilt at submit if the copies run by kernel; no pinned staging held meanwhile.
        self.descriptors.clear();
        self.dmas.clear();
    }

    /// The common case of a block table, in one tight pass and one `extend`: every range
    /// inside both buffers, non-empty and at most the kernel's segment, and in order after
    /// the copies into `dst_key` so far. Returns `false`, adding nothing, otherwise (the
    /// caller then adds range by range).
    fn extend_in_order(
        &mut self,
        dst: &Core,
        dst_key: u32,
        src_ptr: u64,
        dst_ptr: u64,
        (src_len, dst_len): (u64, u64),
        ranges: &[(u64, u64, u64)],
    ) -> Result<bool> {
        let key = dst_key as usize;
        if self.out_of_order {
            return Ok(false);
        }
        self.descriptors.reserve(dst, ranges.len())?;
        if key >= self.ends.len() {
            self.ends.resize(key + 1, 0);
        }
        // One pass: each range is checked and its descriptor written past the table's end;
        // they count only if every range passed.
        let out = self.descriptors.end();
        let (mut end, mut bytes, mut ok) = (self.ends[key], 0u64, true);
        for (i, &(src_offset, dst_offset, len)) in ranges.iter().enumerate() {
            // No overflow: each operand is below 2^63 once the comparisons pass.
            ok &= len > 0
                && len <= PEER_SEGMENT
                && src_offset <= src_len
                && dst_offset >= end
                && dst_offset <= dst_len
                && len <= src_len - src_offset
                && len <= dst_len - dst_offset;
            end = dst_offset.wrapping_add(len);
            bytes = bytes.wrapping_add(len);
            let d = CopyDescriptor {
                src: src_ptr.wrapping_add(src_offset),
                dst: dst_ptr.wrapping_add(dst_offset),
                len,
            };
            // SAFETY: room for ranges.len() descriptors past the end was reserved above.
            unsafe { out.add(i).write(d) };
        }
        if !ok {
            return Ok(false);
        }
        self.descriptors.commit(ranges.len());
        self.ends[key] = end;
        self.copies += ranges.len();
        self.bytes = self.bytes.saturating_add(bytes);
        Ok(true)
    }

    /// A copy of the final set goes to the kernel or to a DMA of its own.
    #[inline]
    fn route(&mut self, m: CopyDescriptor) {
        if m.len >= PEER_DMA_MIN {
            self.dmas.push(m);
        } else {
            self.descriptors.push_copy(m.src, m.dst, m.len);
        }
    }

    /// For copies out of order: the descriptors and DMAs with overlaps resolved (the later
    /// copy wins), from an upload plan of the destinations (every interval direct, one
    /// chunk), whose fills say which copy supplies each destination byte.
    fn resolve(&mut self, dst: &Core, planner: &mut Planner, plan: &mut UploadPlan) -> Result<()> {
        self.descriptors.clear();
        self.dmas.clear();
        let config = PlanConfig { direct_threshold: 0, chunk_bytes: 1 << 62, align: 1 };
        planner.plan_upload_into(&self.writes, &config, plan)?;
        let dst_at = |key: u64, offset: u64| self.dst_table.entries[key as usize].ptr + offset;
        let mut spans: Vec<(u64, u64)> = plan
            .chunks
            .iter()
            .flat_map(|c| c.direct.iter().chain(&c.packed))
            .map(|c| (c.stage_offset, dst_at(c.buffer, c.buffer_offset)))
            .collect();
        spans.sort_unstable_by_key(|s| s.0);
        let moves: Vec<CopyDescriptor> = plan
            .fills
            .iter()
            .map(|f| {
                let (stage, dst) = spans[spans.partition_point(|s| s.0 <= f.stage_offset) - 1];
                let (key, at) = self.sources[f.write as usize];
                let src = self.src_table.entries[key as usize].ptr + at + f.src_offset;
                CopyDescriptor { src, dst: dst + (f.stage_offset - stage), len: f.len }
            })
            .collect();
        let kernel_copies = moves.iter().filter(|m| m.len < PEER_DMA_MIN).map(|m| pieces(m.len)).sum();
        self.descriptors.reserve(dst, kernel_copies)?;
        for m in moves {
            self.route(m);
        }
        Ok(())
    }
}

impl Drop for PeerBatch<'_> {
    fn drop(&mut self) {
        self.dst.spares.peer.give(std::mem::take(&mut self.parts));
    }
}

impl fmt::Debug for PeerBatch<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerBatch")
            .field("src", &self.src.info.ordinal)
            .field("dst", &self.dst.info.ordinal)
            .field("copies", &self.parts.copies)
            .finish_non_exhaustive()
    }
}

/// The work of [`Device::peer_copies`](crate::Device::peer_copies).
pub(crate) fn peer_copies<'a>(core: &'a Arc<Core>, src: &'a Arc<Core>) -> PeerBatch<'a> {
    PeerBatch { dst: core, src, parts: core.spares.peer.take(), error: None }
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
        let parts = &mut self.parts;
        // Peer batches keep no in-order layout of their own (they track order in `ends`).
        (parts.src_table.apart.broken, parts.dst_table.apart.broken) = (true, true);
        let (src_key, _) = parts.src_table.check(&self.src.alloc, src, src_offset, len, &mut self.error)?;
        let (dst_key, dst_len) =
            parts.dst_table.check(&self.dst.alloc, dst, dst_offset, len, &mut self.error)?;
        let src_at = parts.src_table.entries[src_key as usize].ptr + src_offset;
        let dst_at = parts.dst_table.entries[dst_key as usize].ptr + dst_offset;
        let added =
            parts.add(self.dst, src_key, src_offset, src_at, dst_key, dst_len, dst_offset, dst_at, len);
        self.poison_on(added)?;
        Ok(self)
    }

    /// Adds many copies between one pair of buffers: `(src_offset, dst_offset, len)` each,
    /// from `src` (a buffer of the source device) into `dst` (a buffer of this batch's
    /// device), in order. The same as calling [`PeerBatch::copy`] for each, with the two
    /// buffers looked up once: for block tables (a paged cache moved block by block).
    pub fn copy_ranges(
        &mut self,
        src: ResidentBuffer,
        dst: ResidentBuffer,
        ranges: &[(u64, u64, u64)],
    ) -> Result<&mut Self> {
        let parts = &mut self.parts;
        let (src_key, _) = parts.src_table.check(&self.src.alloc, src, 0, 0, &mut self.error)?;
        let (dst_key, _) = parts.dst_table.check(&self.dst.alloc, dst, 0, 0, &mut self.error)?;
        let (s, d) = (parts.src_table.entries[src_key as usize], parts.dst_table.entries[dst_key as usize]);
        let fits = |offset: u64, len: u64, buffer_len: u64| {
            offset.checked_add(len).is_some_and(|end| end <= buffer_len)
        };
        let fast = parts.extend_in_order(self.dst, dst_key, s.ptr, d.ptr, (s.len, d.len), ranges);
        if self.poison_on(fast)? {
            return Ok(self);
        }
        for &(src_offset, dst_offset, len) in ranges {
            let bad = if !fits(src_offset, len, s.len) {
                Some(Error::OutOfRange { buffer: src, offset: src_offset, len, buffer_len: s.len })
            } else if !fits(dst_offset, len, d.len) {
                Some(Error::OutOfRange { buffer: dst, offset: dst_offset, len, buffer_len: d.len })
            } else {
                None
            };
            if let Some(e) = bad {
                self.error.get_or_insert_with(|| e.clone());
                return Err(e);
            }
            let added = self.parts.add(
                self.dst,
                src_key,
                src_offset,
                s.ptr + src_offset,
                dst_key,
                d.len,
                dst_offset,
                d.ptr + dst_offset,
                len,
            );
            self.poison_on(added)?;
        }
        Ok(self)
    }

    /// Passes `result` on; an error (no pinned memory for the descriptors) also fails the
    /// batch, which may hold some of the copies of the call that failed.
    fn poison_on<T>(&mut self, result: Result<T>) -> Result<T> {
        if let Err(e) = &result {
            self.error.get_or_insert_with(|| e.clone());
        }
        result
    }

    /// The route of the batch as its copies stand: [`Route::InOrder`] while every copy came
    /// in order (its descriptors built as added, nothing to resolve), else
    /// [`Route::Planned`] (the planner resolves overlaps at submit).
    pub(crate) fn route(&self) -> Route {
        if self.parts.out_of_order { Route::Planned } else { Route::InOrder }
    }

    /// Number of copies added.
    pub fn len(&self) -> usize {
        self.parts.copies
    }

    /// Whether no copy was added.
    pub fn is_empty(&self) -> bool {
        self.parts.copies == 0
    }

    /// Starts the copies and returns at once (after the source bytes reached the host, on
    /// the staged path); the fence, on the destination device, completes when every byte
    /// has landed. Fails (with nothing enqueued) if any copy was bad or a buffer was freed
    /// since it was added.
    pub fn submit(mut self) -> Result<Fence> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        if self.parts.bytes == 0 {
            // Nothing to move; a buffer freed since it was named still fails the batch.
            self.check_live()?;
            return Ok(Fence::completed());
        }
        if super::can_read_directly(self.dst, self.src) { self.submit_direct() } else { self.submit_staged() }
    }

    /// Fails if a buffer the batch names was freed since (for paths that claim none).
    fn check_live(&self) -> Result<()> {
        let live =
            |d: &Core, t: &BufferTable| t.named().try_for_each(|(_, e)| d.alloc.resolve(e.buffer).map(drop));
        live(self.src, &self.parts.src_table)?;
        live(self.dst, &self.parts.dst_table)
    }

    /// Peer access (or one device): one kernel for the small copies, a DMA per large one,
    /// on the destination's upload lane.
    fn submit_direct(&mut self) -> Result<Fence> {
        let (src, dst) = (self.src, self.dst);
        let (src_core, dst_core) = (src, dst);
        // Overlaps resolved before the lane is taken: other batches submit on it meanwhile.
        if self.route() == Route::Planned {
            let mut planning = dst_core.spares.planning.lend();
            let Planning { planner, upload_plan, .. } = &mut *planning;
            self.parts.resolve(self.dst, planner, upload_plan)?;
        }
        let mut exec = Exec::begin(dst_core, LaneKind::Upload);
        let mut scratch = lock(&dst_core.staging[LaneKind::Upload.index()]);
        let scratch = &mut *scratch;
        // What needs no sequence number first, so that the source device's lane (taken
        // below) is held only while the copy is numbered and enqueued.
        let count = self.parts.descriptors.len() as u64;
        let table_bytes = self.parts.descriptors.len() * DESCRIPTOR;
        // What lands, overlaps resolved (as many as the copies name when none overlap).
        let landed = if self.parts.out_of_order {
            let kernel: u64 = self.parts.descriptors.as_slice().iter().map(|d| d.len).sum();
            kernel + self.parts.dmas.iter().map(|m| m.len).sum::<u64>()
        } else {
            self.parts.bytes
        };
        // What the kernel moves: what lands less what the DMAs move.
        let by_kernel = landed - self.parts.dmas.iter().map(|m| m.len).sum::<u64>();
        let table = self.parts.descriptors.take().filter(|_| count > 0);
        let parts = &self.parts;
        let mut keep = Vec::new();
        let mut kernel = None;
        // A table left on the heap, uploaded from there (below): it lives until the
        // submission has returned, by when the driver has copied it out.
        let mut heap = None;
        if let Some(table) = table {
            // With unified addressing the kernel reads a pinned table where it is (mapped for
            // every device): no upload of the table first, whose DMA and wait cost more than
            // the warps' reads over the bus (8192 x 256 B peer copies: see BENCHMARKS.md).
            // Otherwise, and for a table on the heap, it is uploaded to device staging.
            let area = kernels::table_bytes(count);
            let (dev, at) = match table {
                Table::Pinned(lease) => {
                    let lease = Arc::new(lease);
                    let dev = if dst.info.unified_addressing {
                        None
                    } else {
                        Some(exec.region(&mut scratch.region, area)?)
                    };
                    let at = lease.as_ptr().cast_const();
                    keep.push(lease);
                    (dev, at)
                }
                Table::Heap(descriptors) => {
                    let dev = exec.region(&mut scratch.region, area)?;
                    let at = heap.insert(descriptors).as_ptr().cast::<u8>();
                    (Some(dev), at)
                }
            };
            kernel = Some((exec.kernels()?, dev, at));
        }

        // Lock order: an upload lane (and its staging) before a download lane. Nothing
        // takes them the other way round.
        let mut proxy =
            (!std::ptr::eq(&**src_core, &**dst_core)).then(|| Exec::begin(src_core, LaneKind::Download));
        let final_seq = match &mut proxy {
            None => exec.claim(parts.src_table.buffers().chain(parts.dst_table.buffers()), 1)?,
            Some(proxy) => {
                // The source buffers are read by the proxy submission's number on the
                // source's download lane; the copy waits for the source's uploads into them.
                let uploads = proxy.claim_for_other(parts.src_table.buffers())?;
                let seq = exec.claim(parts.dst_table.buffers(), 1)?;
                proxy.make_wait_other(uploads, exec.stream())?;
                seq
            }
        };
        exec.requested(parts.bytes);
        let contexts = (dst_core.ctx.ctx, src_core.ctx.ctx);
        let enqueued = exec.submit(keep, |q| {
            if let Some((kernels, dev, table)) = kernel {
                let at = match dev {
                    Some(dev) if heap.is_some() => {
                        // From the heap in pieces the driver stages at the call, as it takes
                        // pageable memory for small blocking uploads.
                        for from in (0..table_bytes).step_by(DRIVER_STAGED_MOST) {
                            let len = (table_bytes - from).min(DRIVER_STAGED_MOST);
                            // SAFETY: the heap table holds table_bytes bytes and outlives
                            // this call; device staging holds at least table_bytes bytes.
                            unsafe { q.htod(dev + from as u64, table.add(from), len) }?;
                        }
                        dev
                    }
                    Some(dev) => {
                        // SAFETY: the pinned table is kept alive by this submission; device
                        // staging holds at least table_bytes bytes.
                        unsafe { q.htod(dev, table, table_bytes) }?;
                        dev
                    }
                    None => table as u64,
                };
                // The table crosses the bus whether uploaded (counted above) or read in place.
                let read_in_place = if dev.is_none() { table_bytes as u64 } else { 0 };
                // SAFETY: the table is in device staging by stream order, or in pinned
                // memory that this submission keeps alive; sources are live,
                // marked buffers this device may read; destinations are disjoint ranges of
                // live, marked buffers (a destination overlapping a source of the same batch,
                // inside one device, reads unspecified bytes but stays in bounds).
                unsafe { q.launch(kernels, at, count, by_kernel + read_in_place) }?;
            }
            for m in &parts.dmas {
                // SAFETY: as above, by one DMA.
                unsafe { q.peer((m.dst, contexts.0), (m.src, contexts.1), m.len as usize) }?;
            }
            Ok(())
        });
        if let Some(mut proxy) = proxy {
            // The source's download lane waits for the copy, on the device; if that cannot be
            // enqueued, the host waits for it instead.
            let ordered = src_core
                .ctx
                .bind()
                .and_then(|_| exec.make_wait(final_seq, proxy.stream()))
                .or_else(|_| dst_core.lane(LaneKind::Upload).wait(final_seq).map(drop))
                .or_else(|_| dst_core.ctx.bind().and_then(|raw| raw.stream_synchronize(exec.stream())));
            if let Err(e) = ordered {
                // Nothing can order later uses of the sources after the copy, which may still
                // run: their memory is never reused (freeing them defers forever).
                let _ = src_core.alloc.mark_used_many(
                    parts.src_table.buffers(),
                    LaneKind::Download.index(),
                    u64::MAX,
                    |_, _| (),
                );
                return Err(e);
            }
            proxy.submit(Vec::new(), |_| Ok(()))?;
            proxy.end().record();
        }
        let seq = enqueued?;
        debug_assert_eq!(seq, final_seq);
        Telemetry::add(&dst_core.telemetry.peer_bytes, landed);
        Ok(exec.finish())
    }

    /// No peer access: groups of copies read back from the source into pinned memory and
    /// uploaded from there, in order (so later copies still win). Every buffer is checked
    /// before anything moves; a driver failure part-way leaves the groups before it applied.
    fn submit_staged(&mut self) -> Result<Fence> {
        self.parts.list_copies();
        self.check_live()?;
        let PeerParts { src_table, dst_table, writes, sources, .. } = &self.parts;
        // Each group is one download into the source's pinned pool, whole: at most half its
        // cap, counting what a read takes there (its bytes, rounded for the gather, and its
        // descriptors).
        let group = (self.dst.config.chunk_bytes.max(1 << 20) * crate::plan::route::RING as u64)
            .min(self.src.config.pinned_cap_bytes / 2)
            .max(1);
        let mut fence = Fence::completed();
        let mut pieces: Vec<(ResidentBuffer, u64, ResidentBuffer, u64, u64)> = Vec::new();
        let mut bytes = 0;
        let flush = |pieces: &mut Vec<(ResidentBuffer, u64, ResidentBuffer, u64, u64)>| -> Result<Fence> {
            let mut reads = crate::transfer::download::downloads(self.src);
            let slots =
                pieces.iter().map(|&(b, o, _, _, len)| reads.read(b, o, len)).collect::<Result<Vec<_>>>()?;
            let done = reads.submit()?.wait()?;
            let mut uploads = crate::transfer::upload::uploads(self.dst);
            for (&(_, _, b, o, _), &slot) in pieces.iter().zip(&slots) {
                uploads.write(b, o, done.get(slot))?;
            }
            pieces.clear();
            uploads.submit()
        };
        for (w, &(src_key, src_offset)) in writes.iter().zip(sources) {
            let src = src_table.entries[src_key as usize].buffer;
            let dst = dst_table.entries[w.buffer as usize].buffer;
            let mut done = 0;
            while done < w.len {
                // A piece's payload leaves room for its descriptors within the group.
                let len = (w.len - done).min(group / 2);
                let need = len.next_multiple_of(16) + 24 * len.div_ceil(SEGMENT);
                if bytes + need > group && !pieces.is_empty() {
                    fence = flush(&mut pieces)?;
                    bytes = 0;
                }
                pieces.push((src, src_offset + done, dst, w.offset + done, len));
                bytes += need;
                done += len;
            }
        }
        if !pieces.is_empty() {
            fence = flush(&mut pieces)?;
        }
        Ok(fence)
    }
}

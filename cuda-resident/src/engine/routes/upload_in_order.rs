//! The in-order upload route: [`execute_in_order`], many small writes apart, without the
//! planner.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::view::UploadView;
use crate::engine::Exec;
use crate::engine::host::Source;
use crate::engine::pipeline::{self, Groups, Step};
use crate::engine::staging::DeviceStaging;
use crate::error::Result;
use crate::fence::Fence;
use crate::host_pool::HostLease;
use crate::kernels::{CopyDescriptor, table_bytes};
use crate::plan::WriteRequest;
use crate::plan::route::{FIRST_CHUNK, PIPELINE_DEPTH, RING, Span, cut_apart, growing, in_order_chunk};

/// Cuts a batch of writes in order and apart into the chunks [`execute_in_order`] moves,
/// into `spans`: each chunk's descriptor table and packed bytes within the in-order chunk,
/// over the bus growing to it from [`FIRST_CHUNK`] (a chunk costs a launch there: the first
/// is small and leaves while the rest is packed); through device staging (a DMA and a
/// launch a chunk) equal.
pub(super) fn cut_in_order(batch: &UploadView<'_>, spans: &mut Vec<Span>) {
    let core = batch.core;
    let (writes, apart) = (batch.writes, &batch.table.apart);
    let offsets = &apart.offsets[..];
    debug_assert_eq!(offsets.len(), writes.len(), "one offset a write");
    let chunk_bytes = in_order_chunk(core.config.chunk_bytes, apart.requested, PIPELINE_DEPTH);
    if core.moves_small_copies_over_bus() {
        cut_apart(offsets, |i| writes[i].len, growing(FIRST_CHUNK, chunk_bytes), spans);
    } else {
        cut_apart(offsets, |i| writes[i].len, |_| chunk_bytes, spans);
    }
}

/// [`Route::InOrder`](crate::plan::route::Route::InOrder): writes in order and apart (each past the end of the earlier writes into its buffer, with
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
///
/// `spans` are the chunks [`cut_in_order`] cut, before the lane was taken.
pub(super) fn execute_in_order(
    batch: &UploadView<'_>,
    spans: &[Span],
    mut exec: Exec<'_>,
    scratch: &mut DeviceStaging,
) -> Result<Fence> {
    let core = batch.core;
    let ptr_of = |w: &WriteRequest| batch.table.entries[w.buffer as usize].ptr + w.offset;
    let region = &mut scratch.region;
    let (writes, apart) = (batch.writes, &batch.table.apart);
    let (offsets, requested) = (&apart.offsets[..], apart.requested);
    let chunk_bytes = in_order_chunk(core.config.chunk_bytes, requested, PIPELINE_DEPTH);
    let area = |span: &Span| table_bytes(span.requests.len() as u64);
    let device_need = spans.iter().map(|span| area(span) + span.len).max().unwrap_or(0);
    exec.claim_ranges(batch.table.buffers(), spans.len() as u64, batch.ranges())?;
    exec.requested(requested);
    let kernels = exec.kernels()?;
    // Where the kernel finds the packed bytes: in the lease itself, or in device staging.
    let dev = if core.moves_small_copies_over_bus() { None } else { Some(exec.region(region, device_need)?) };
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

//! The in-order download route: [`execute_in_order`], many small reads apart, without the
//! planner.

use std::sync::Arc;

use super::view::{DownloadView, Landed};
use crate::engine::Exec;
use crate::engine::staging::DeviceStaging;
use crate::error::Result;
use crate::host_pool::HostLease;
use crate::kernels::{CopyDescriptor, table_bytes};
use crate::plan::route::{Route, Span, cut_apart};
use crate::plan::{ReadRequest, ReadView};

/// Cuts a batch of reads in order and apart into the chunks [`execute_in_order`] moves,
/// into `spans`: each chunk's descriptor table and packed bytes within `chunk_bytes`.
pub(super) fn cut_in_order(batch: &DownloadView<'_>, chunk_bytes: u64, spans: &mut Vec<Span>) {
    let (reads, offsets) = (batch.reads, &batch.table.apart.offsets[..]);
    debug_assert_eq!(offsets.len(), reads.len(), "one offset a read");
    cut_apart(offsets, |i| reads[i].len, |_| chunk_bytes, spans);
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
///
/// `spans` are the chunks [`cut_in_order`] cut, before the lane was taken.
pub(super) fn execute_in_order(
    batch: &DownloadView<'_>,
    spans: &[Span],
    mut exec: Exec<'_>,
    scratch: &mut DeviceStaging,
    lease: Arc<HostLease>,
) -> Result<Landed> {
    let core = batch.core;
    let (reads, apart) = (batch.reads, &batch.table.apart);
    let offsets = &apart.offsets[..];
    let region = &mut scratch.region;
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
    Ok(Landed::Leased {
        fence: exec.finish(),
        lease,
        base: 0,
        views,
        chunks,
        in_order_bytes: apart.requested as usize,
        first_seq: final_seq + 1 - n,
        route: Route::InOrder,
    })
}

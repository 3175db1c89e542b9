//! The planner's download route: [`execute`], which hands reads in order on to
//! [`execute_in_order`] and a batch the pinned pool cannot lend on to [`execute_streamed`].

use std::sync::Arc;

use super::download_chunk::{ChunkPlaces, enqueue_planned};
use super::download_in_order::{cut_in_order, execute_in_order};
use super::streamed::execute_streamed;
use super::table_areas;
use super::view::{DownloadView, Landed};
use crate::engine::Exec;
use crate::engine::spares::Planning;
use crate::error::Result;
use crate::kernels::{CopyDescriptor, push_descriptors};
use crate::plan::route::{PIPELINE_DEPTH, READ_DEPTH, Route, in_order_chunk};
use crate::stream::LaneKind;
use crate::sync::lock;

/// Moves the batch. A batch that streams ([`execute_streamed`]) copies its reads into the
/// vectors of `sink` (read `i` into the `i`th) when there are some, and takes them then.
pub(crate) fn execute(batch: &DownloadView<'_>, sink: &mut Option<&mut [Vec<u8>]>) -> Result<Landed> {
    let core = batch.core;
    let config = &core.config;
    let apart = &batch.table.apart;
    let (total, plan_config) = batch.sizing();
    let in_order = batch.route_with(&plan_config) == Route::InOrder;
    // Planned before the lane is taken: other batches submit on the lane meanwhile.
    let mut planning = core.spares.planning.lend();
    let Planning { planner, download_plan, spans, .. } = &mut *planning;
    if in_order {
        let depth = if core.moves_small_copies_over_bus() { READ_DEPTH } else { PIPELINE_DEPTH };
        cut_in_order(batch, in_order_chunk(config.chunk_bytes, total, depth), spans);
    } else {
        planner.plan_download_into(batch.reads, &plan_config, download_plan)?;
    }
    let mut exec = Exec::begin(core, LaneKind::Download);
    let mut staging = lock(&core.staging[LaneKind::Download.index()]);
    let scratch = &mut *staging;
    if in_order {
        // Held staging: the download's views keep it after the copy. The lease holds the
        // flat packed bytes, then the chunks' tables: one descriptor a read.
        let len = apart.end.next_multiple_of(256) as usize + batch.reads.len() * size_of::<CopyDescriptor>();
        return match core.acquire_held_staging(len) {
            // Listed: the caller can reach its views.
            Ok(lease) => execute_in_order(batch, &planning.spans, exec, scratch, lease.into_listed()),
            // Refused before anything was enqueued: the batch streams instead, planned once
            // the lane is let go, with the planner (and its vectors) given back for it.
            Err(e) if e.is_staging_refusal() => {
                drop((staging, exec, planning));
                execute_streamed(batch, sink.take())
            }
            Err(e) => Err(e),
        };
    }
    let plan = &planning.download_plan;
    if plan.is_empty() {
        return Ok(Landed::Empty { views: plan.views.clone() });
    }
    let (areas, device_need) = table_areas(&plan.chunks);
    let tables: u64 = areas.iter().sum();
    // Held staging: the download's views keep it after the copy.
    let lease = match core.acquire_held_staging((tables + plan.total_staging) as usize) {
        // Listed: the caller can reach its views.
        Ok(lease) => lease.into_listed(),
        // Nothing enqueued yet: the batch streams instead, planned once the lane is let go,
        // with the planner (and its vectors, as large as the batch's) given back for it.
        Err(e) if e.is_staging_refusal() => {
            drop((staging, exec, planning));
            return execute_streamed(batch, sink.take());
        }
        Err(e) => return Err(e),
    };
    let base = lease.as_ptr();

    let final_seq = exec.claim_ranges(batch.table.buffers(), plan.chunks.len() as u64, batch.ranges())?;
    exec.requested(plan.requested_bytes);

    let kernels = if device_need.is_some() { Some(exec.kernels()?) } else { None };
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
    Ok(Landed::Leased {
        fence: exec.finish(),
        lease,
        base: tables as usize,
        views,
        chunks: Vec::new(),
        in_order_bytes: 0,
        first_seq: final_seq + 1 - plan.chunks.len() as u64,
        route: Route::Planned,
    })
}

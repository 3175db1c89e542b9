//! The general upload route: [`execute`] (the planner's route, and the in-order route handed
//! on to [`execute_in_order`]).

use std::sync::Arc;

use super::upload_in_order::{cut_in_order, execute_in_order};
use super::view::UploadView;
use super::{table_areas, uses_kernel};
use crate::engine::Exec;
use crate::engine::host::Piece;
use crate::engine::host::Source;
use crate::engine::spares::Planning;
use crate::error::Result;
use crate::fence::Fence;
use crate::host_pool::HostLease;
use crate::kernels::{CopyDescriptor, push_descriptors};
use crate::plan::PlanConfig;
use crate::plan::route::{RING, Route};
use crate::stream::LaneKind;
use crate::sync::lock;

impl Source<'_> {
    /// The address of byte `offset` of the write's data.
    fn at(&self, arena: &[HostLease], offset: u64) -> *const u8 {
        match *self {
            Source::Slice(s) => s[offset as usize..].as_ptr(),
            // SAFETY: offset lies within the write, which lies within its lease.
            Source::Arena { lease, offset: at } => unsafe {
                arena[lease as usize].as_ptr().add(at + offset as usize)
            },
        }
    }
}

/// The routes [`Route::InOrder`] and [`Route::Planned`].
pub(crate) fn execute(batch: &UploadView<'_>, route: Route) -> Result<Fence> {
    let core = batch.core;
    let config = &core.config;
    // Uploads keep the configured chunk: cutting mid-size batches finer (as downloads do)
    // measured no better.
    let plan_config =
        PlanConfig { direct_threshold: config.direct_threshold, chunk_bytes: config.chunk_bytes, align: 16 };
    // Planned before the lane is taken: other batches submit on the lane meanwhile.
    let mut planning = core.spares.planning.lend();
    let Planning { planner, upload_plan, spans, .. } = &mut *planning;
    if route == Route::InOrder {
        cut_in_order(batch, spans);
    } else {
        planner.plan_upload_into(batch.writes, &plan_config, upload_plan)?;
    }
    let mut exec = Exec::begin(core, LaneKind::Upload);
    let mut scratch = lock(&core.staging[LaneKind::Upload.index()]);
    let scratch = &mut *scratch;
    if route == Route::InOrder {
        return execute_in_order(batch, &planning.spans, exec, scratch);
    }
    let plan = &planning.upload_plan;
    if plan.is_empty() {
        return Ok(Fence::completed());
    }
    // Every buffer is checked (and marked as used by this batch) before anything moves.
    exec.claim_ranges(batch.table.buffers(), plan.chunks.len() as u64, batch.ranges())?;
    exec.requested(plan.requested_bytes);

    // Each chunk's descriptor table (0 without a kernel), counted once.
    let (areas, device_need) = table_areas(&plan.chunks);
    let kernels = if device_need.is_some() { Some(exec.kernels()?) } else { None };
    let dev = match device_need {
        Some(need) => exec.region(&mut scratch.region, need)?,
        None => 0,
    };
    // The first chunk's lease is as large as the largest any chunk takes: where the pool
    // cannot lend that much (in-place writes of the batch hold the rest of it), the batch
    // fails here, before anything moves, rather than at a later chunk; each later lease
    // finds that room again once the chunks before it complete.
    let largest = plan.chunks.iter().zip(&areas).map(|(c, area)| area + c.staging_len).max().unwrap_or(0);

    let ptr_of = |key: u64| batch.table.entries[key as usize].ptr;
    let mut seqs = Vec::with_capacity(plan.chunks.len());
    for (k, chunk) in plan.chunks.iter().enumerate() {
        if k >= RING {
            exec.wait(seqs[k - RING])?;
        }
        let kernel = uses_kernel(chunk);
        let area = areas[k];
        let len = if k == 0 { largest } else { area + chunk.staging_len };
        let lease = Arc::new(exec.lease(len as usize)?);
        let base = lease.as_ptr();
        // SAFETY: the lease holds area + staging_len bytes; offsets below stay inside.
        let staged = |flat: u64| unsafe { base.add((area + chunk.local_offset(flat)) as usize) };

        scratch.descriptors.clear();
        if kernel {
            for c in &chunk.packed {
                let src = dev + area + (c.stage_offset - chunk.packed_offset);
                push_descriptors(&mut scratch.descriptors, src, ptr_of(c.buffer) + c.buffer_offset, c.len);
            }
            let bytes = scratch.descriptors.len() * std::mem::size_of::<CopyDescriptor>();
            // SAFETY: the descriptor area holds at least `bytes` bytes; the lease is fresh.
            unsafe { std::ptr::copy_nonoverlapping(scratch.descriptors.as_ptr().cast::<u8>(), base, bytes) };
        }
        scratch.pieces.clear();
        for f in plan.fills_of(k as u32) {
            let src = batch.sources[f.write as usize].at(batch.arena, f.src_offset);
            Piece::push_split(
                &mut scratch.pieces,
                Piece { dst: staged(f.stage_offset), src, len: f.len as usize },
            );
        }
        // SAFETY: fills cover disjoint staging ranges inside the lease, sources are live
        // slices or the batch's arena.
        unsafe { Piece::copy_all(&core.packers, &scratch.pieces) };

        let descriptor_count = scratch.descriptors.len() as u64;
        let seq = exec.submit(vec![lease], |q| {
            if kernel {
                // SAFETY: descriptors and packed bytes are contiguous at the lease's start,
                // and device staging holds at least area + packed_len bytes (device_need).
                unsafe { q.htod(dev, base, (area + chunk.packed_len) as usize) }?;
                let kernels = kernels.expect("loaded when a chunk uses it");
                // SAFETY: the table is in device staging by stream order; destinations are
                // disjoint fused intervals of live, marked buffers.
                unsafe { q.launch(kernels, dev, descriptor_count, 0) }?;
            } else {
                for c in &chunk.packed {
                    let src = staged(c.stage_offset);
                    // SAFETY: staged bytes of a live, marked buffer's interval.
                    unsafe { q.htod(ptr_of(c.buffer) + c.buffer_offset, src, c.len as usize) }?;
                }
            }
            for c in &chunk.direct {
                let src = staged(c.stage_offset);
                // SAFETY: as above.
                unsafe { q.htod(ptr_of(c.buffer) + c.buffer_offset, src, c.len as usize) }?;
            }
            Ok(())
        })?;
        seqs.push(seq);
    }
    Ok(exec.finish())
}

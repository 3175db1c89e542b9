//! A batch the pinned pool cannot lend at once: [`execute_streamed`].

use std::sync::Arc;

use super::download_chunk::{ChunkPlaces, enqueue_planned};
use super::table_areas;
use super::view::{DownloadView, Landed};
use crate::engine::Exec;
use crate::engine::core::Core;
use crate::engine::host::Piece;
use crate::engine::spares::Planning;
use crate::engine::staging::DeviceStaging;
use crate::error::{Error, Result};
use crate::kernels::{CopyDescriptor, push_descriptors};
use crate::plan::PlanConfig;
use crate::plan::route::Route;
use crate::stream::LaneKind;
use crate::sync::lock;

/// A batch whose staging the pool cannot lend at once: planned in chunks of half the
/// configured chunk (a chunk's lease, its bytes plus a descriptor table of up to 1.5 times
/// them for the smallest reads, then stays within the cap, which holds two configured
/// chunks), moved through a ring of such leases (up to [`crate::plan::route::RING`], as many as the pool
/// gives), each chunk copied into one ordinary host allocation as soon as it has landed,
/// its lease then reused by a later chunk. Returns once every chunk has landed and been
/// copied out; the download's views point into the host allocation.
///
/// With `out` (one vector a read, in read order), each chunk's share of every read goes
/// straight into the read's vector instead, and no host allocation is made: the download
/// returned then has no views (the bytes are in `out`; on error every vector is empty).
///
/// Planned before the lane is taken (the caller has let it go after the refusal, with
/// nothing enqueued): other batches submit on the lane meanwhile.
pub(super) fn execute_streamed(batch: &DownloadView<'_>, mut out: Option<&mut [Vec<u8>]>) -> Result<Landed> {
    let core = batch.core;
    let config = &core.config;
    let chunk_bytes = config.chunk_bytes / 2;
    let plan_config =
        PlanConfig { direct_threshold: config.direct_threshold.min(chunk_bytes), chunk_bytes, align: 16 };
    let mut planning = core.spares.planning.lend();
    let Planning { planner, download_plan: plan, .. } = &mut *planning;
    planner.plan_download_into(batch.reads, &plan_config, plan)?;
    let plan = &*plan;
    let mut exec = Exec::begin(core, LaneKind::Download);
    let mut scratch = lock(&core.staging[LaneKind::Download.index()]);
    let DeviceStaging { region, descriptors, pieces, .. } = &mut *scratch;
    // Each ring lease: the largest table (a multiple of 256 bytes), then a chunk's staging.
    let (areas, device_need) = table_areas(&plan.chunks);
    let room = areas.iter().copied().max().unwrap_or(0);
    let ring_bytes = usize::try_from(room + plan.chunk_capacity)
        .map_err(|_| Error::HostOutOfMemory { bytes: room + plan.chunk_capacity })?;
    let views = &plan.views[..];
    let chunks = plan.chunks.len();
    // The ring is taken before anything is enqueued, and the buffers claimed (a freed one
    // refused) before the caller's vectors or the kept host memory are touched.
    let ring = exec.ring(ring_bytes, chunks.min(crate::plan::route::RING))?;
    exec.claim_ranges(batch.table.buffers(), chunks as u64, batch.ranges())?;
    exec.requested(plan.requested_bytes);
    // Into the caller's vectors: each emptied with room for its read (and its address
    // kept, for the packing threads); reads with bytes by the chunk of their first byte.
    let mut dsts = Vec::new();
    let mut order = Vec::new();
    if let Some(out) = out.as_deref_mut() {
        for (vec, view) in out.iter_mut().zip(views) {
            vec.clear();
            // A batch that streams may be larger than host memory: an error, not an abort
            // (nothing is enqueued yet).
            if vec.try_reserve_exact(view.len as usize).is_err() {
                out.iter_mut().for_each(Vec::clear);
                return Err(Error::HostOutOfMemory { bytes: view.len });
            }
            dsts.push(vec.as_mut_ptr() as usize);
        }
        order.extend((0..views.len()).filter(|&i| views[i].len > 0));
        order.sort_unstable_by_key(|&i| views[i].chunk);
    }
    let mut host = if out.is_some() { Vec::new() } else { streamed_host(core, plan.total_staging)? };
    // Reads with bytes in the chunk being copied out, and the next read of `order`.
    let (mut active, mut next) = (Vec::new(), 0);
    let first_seq = exec.first_seq();
    let kernels = if device_need.is_some() { Some(exec.kernels()?) } else { None };
    let dev = match device_need {
        Some(need) => exec.region(region, need)?,
        None => 0,
    };
    let ptr_of = |key: u64| batch.table.entries[key as usize].ptr;
    // Waits for chunk `k` (submission `seqs[k]`) and copies its staging out of its lease
    // into the host allocation, on the packing threads.
    let mut unpack = |k: usize, seqs: &[u64], host: &mut [u8]| -> Result<()> {
        crate::engine::wait(core, LaneKind::Download, seqs[k])?;
        let chunk = &plan.chunks[k];
        pieces.clear();
        // SAFETY: the lease holds `room + chunk_capacity >= room + staging_len` bytes.
        let src = unsafe { ring[k % ring.len()].as_ptr().add(room as usize) };
        if dsts.is_empty() {
            let dst = host[chunk.stage_start as usize..][..chunk.staging_len as usize].as_mut_ptr();
            Piece::push_split(pieces, Piece { dst, src, len: chunk.staging_len as usize });
        } else {
            // Every read with bytes in this chunk: those begun before and those that begin.
            active.retain(|&i: &usize| views[i].last_chunk as usize >= k);
            while next < order.len() && views[order[next]].chunk as usize <= k {
                active.push(order[next]);
                next += 1;
            }
            for &i in &active {
                let view = views[i];
                let from = view.stage_offset.max(chunk.stage_start);
                let to = view.stage_end().min(chunk.stage_end());
                if from < to {
                    // SAFETY: `from..to` lies in the chunk's staging (in the lease after the
                    // table room) and in the read (inside its vector's reserved capacity).
                    let (src, dst) = unsafe {
                        (
                            src.add((from - chunk.stage_start) as usize),
                            (dsts[i] as *mut u8).add((from - view.stage_offset) as usize),
                        )
                    };
                    Piece::push_split(pieces, Piece { dst, src, len: (to - from) as usize });
                }
            }
        }
        // SAFETY: the chunk's DMAs completed (waited above); the lease and the host
        // allocation (or the caller's vectors, each its own) are disjoint and hold these
        // bytes; no two destinations overlap.
        unsafe { Piece::copy_out_all(&core.packers, pieces) };
        Ok(())
    };
    let mut seqs = Vec::with_capacity(chunks);
    for (k, chunk) in plan.chunks.iter().enumerate() {
        if k >= ring.len() {
            // The lease this chunk takes is free once the chunk before it there is out.
            unpack(k - ring.len(), &seqs, &mut host)?;
        }
        let lease = &ring[k % ring.len()];
        let base = lease.as_ptr();
        let area = areas[k];
        // SAFETY: flat offsets of this chunk lie in its staging, after the table room.
        let staged = |flat: u64| unsafe { base.add((room + chunk.local_offset(flat)) as usize) };
        descriptors.clear();
        if area > 0 {
            for c in &chunk.packed {
                let dst = dev + area + (c.stage_offset - chunk.packed_offset);
                push_descriptors(descriptors, ptr_of(c.buffer) + c.buffer_offset, dst, c.len);
            }
            let bytes = descriptors.len() * size_of::<CopyDescriptor>();
            // SAFETY: the table room holds `area >= bytes`; the chunk that used this lease
            // before was waited for and copied out.
            unsafe { std::ptr::copy_nonoverlapping(descriptors.as_ptr().cast::<u8>(), base, bytes) };
        }
        let count = descriptors.len() as u64;
        let places = ChunkPlaces {
            table: base,
            area,
            count,
            dev,
            staged: &staged,
            mapped: core.info.unified_addressing,
        };
        seqs.push(exec.submit(vec![Arc::clone(lease)], |q| {
            // SAFETY: the table and the chunk's staging lie in the lease, kept alive by this
            // submission (the chunk that used it before was waited for and copied out);
            // device staging holds area + packed_len bytes; sources are live, marked buffers.
            unsafe { enqueue_planned(q, chunk, &places, kernels, &ptr_of) }
        })?);
    }
    for k in chunks.saturating_sub(ring.len())..chunks {
        unpack(k, &seqs, &mut host)?;
    }
    if let Some(out) = out.as_deref_mut() {
        for (vec, view) in out.iter_mut().zip(views) {
            // SAFETY: every chunk was copied out: each read's bytes, all of them, are in
            // its vector (the chunks' staging covers every read).
            unsafe { vec.set_len(view.len as usize) };
        }
    }
    let mut views = core.spares.views.take();
    if out.is_none() {
        views.extend_from_slice(&plan.views);
    }
    Ok(Landed::Streamed {
        fence: exec.finish(),
        host,
        views,
        first_seq,
        route: if out.is_some() { Route::StreamedInto } else { Route::Streamed },
    })
}

/// Host memory of `len` bytes for a streamed download's views: the last one's, kept by the
/// device, when it is large enough (its bytes are initialised: those of an earlier download,
/// all overwritten where a view reads), else fresh zeroed memory.
fn streamed_host(core: &Arc<Core>, len: u64) -> Result<Vec<u8>> {
    let spare = std::mem::take(&mut *lock(&core.spares.streamed_host));
    match usize::try_from(len) {
        Ok(n) if spare.len() >= n => Ok(spare),
        _ => {
            // Too small: freed before the new one is taken.
            drop(spare);
            crate::engine::host::zeroed_vec(len)
        }
    }
}

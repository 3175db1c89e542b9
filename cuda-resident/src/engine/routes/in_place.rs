//! The in-place route: [`execute_in_place`], moving arena leases as the writes left them.

use std::sync::Arc;

use super::view::UploadView;
use crate::engine::Exec;
use crate::engine::fills::Fills;
use crate::engine::host::Source;
use crate::engine::pipeline::{self, Step};
use crate::engine::spares::Planning;
use crate::error::Result;
use crate::fence::Fence;
use crate::host_pool::HostLease;
use crate::kernels::{CopyDescriptor, push_descriptors, table_bytes};
use crate::plan::PlanConfig;
use crate::stream::{LaneKind, SIDE_SLOTS};
use crate::sync::lock;

/// `arena_used` of a lease that holds one large write and takes no more.
pub(crate) const CLOSED: usize = usize::MAX;

/// The in-place fast path: every write was made with `write_with` or `write_with_par` and
/// no two fuse, so the arena already is the staging. Nothing is copied on the host.
///
/// A lease holding fills of `write_with_par`, where the device allows copies over the bus
/// ([`Core::moves_small_copies_over_bus`](crate::engine::core::Core::moves_small_copies_over_bus)), moves by one launch on the lane's stream that
/// reads the lease in place, its descriptor table in a pinned lease of its own: no DMA, no
/// device staging, no side stream. Every other packed lease moves whole by one DMA and is
/// spread by one launch: its DMA is enqueued first and its descriptor table built while it
/// is on the wire (the table follows the bytes in device staging), so the link starts at
/// once; with several such leases, they alternate between two regions of device staging and
/// each one's scatter runs on the lane's side stream while the next one's bytes are on the
/// wire; the last one's scatter runs on the lane's stream, after the side work. Writes with a
/// lease of their own move by one DMA each.
///
/// Returns `None` (changing nothing) when writes overlap or touch, for the general path
/// (which runs every fill first and packs the arena's bytes again).
pub(crate) fn execute_in_place(batch: &mut UploadView<'_>) -> Result<Option<Fence>> {
    let core = batch.core;
    let plan_config = PlanConfig {
        direct_threshold: core.config.direct_threshold,
        chunk_bytes: core.config.chunk_bytes,
        align: 16,
    };
    // Writes apart (as added) are all non-empty and in order.
    let apart = &batch.table.apart;
    let (non_empty, requested) = if apart.broken {
        (batch.writes.iter().filter(|w| w.len > 0).count(), batch.writes.iter().map(|w| w.len).sum())
    } else {
        (batch.writes.len(), apart.requested)
    };
    // Writes in order are disjoint: no planning needed to know that none fuse. Otherwise the
    // planner tells (writes out of order may still be disjoint), before the lane is taken.
    if apart.broken {
        let mut planning = core.spares.planning.lend();
        let Planning { planner, upload_plan, .. } = &mut *planning;
        if !planner.is_in_order(batch.writes) {
            planner.plan_upload_into(batch.writes, &plan_config, upload_plan)?;
            if upload_plan.intervals != non_empty {
                return Ok(None);
            }
        }
    }
    let mut exec = Exec::begin(core, LaneKind::Upload);
    let mut scratch = lock(&core.staging[LaneKind::Upload.index()]);
    let scratch = &mut *scratch;
    if non_empty == 0 {
        drop(exec);
        batch.run_fills()?;
        return Ok(Some(Fence::completed()));
    }
    // Nothing before the first DMA passes over the writes: what it needs was counted per
    // lease as the writes were added.
    let leases: Vec<Arc<HostLease>> = batch.arena.drain(..).map(Arc::new).collect();
    let own = |i: usize| batch.arena_used[i] == CLOSED;
    let has_bytes = |i: usize| batch.arena_descriptors[i] > 0;
    let ptr_of = |w: usize| batch.table.entries[batch.writes[w].buffer as usize].ptr + batch.writes[w].offset;
    let offset_of = |w: usize| match batch.sources[w] {
        Source::Arena { offset, .. } => offset as u64,
        Source::Slice(_) => unreachable!("only arena writes take this path"),
    };
    // Leases are opened in the order of the writes, so each lease's writes are a run of
    // consecutive writes: found by binary search, from where the last lease's run ended.
    let lease_of = |source: &Source<'_>| match *source {
        Source::Arena { lease, .. } => lease as usize,
        Source::Slice(_) => unreachable!("only arena writes take this path"),
    };
    // Each lease's writes, and its fills of `write_with_par` (indices of `par`).
    let fill_spans = batch.par.spans(batch.sources, leases.len());
    let mut runs = Vec::with_capacity(leases.len());
    let mut first = 0;
    for (i, fills) in fill_spans.iter().enumerate() {
        let end = first + batch.sources[first..].partition_point(|s| lease_of(s) <= i);
        runs.push((std::mem::replace(&mut first, end)..end, fills.clone()));
    }
    // Device staging for a packed lease: its bytes, then its table.
    let table_at = |i: usize| (batch.arena_used[i] as u64).next_multiple_of(256);
    let areas: Vec<u64> = batch.arena_descriptors.iter().map(|&n| table_bytes(n)).collect();
    // A lease with fills made at submit moves over the bus where the device allows: the
    // kernel reads it in place, from lines the fills just wrote, which it reads faster than a
    // DMA does (50 against 43 GB/s: docs/runs/2026-12-01-h200-ceilings-ed801f4.md). Others
    // move by a DMA into device staging and a scatter there.
    let over_bus = core.moves_small_copies_over_bus();
    let bus = |i: usize| over_bus && !own(i) && has_bytes(i) && !runs[i].1.is_empty();
    let packed: Vec<usize> = (0..leases.len()).filter(|&i| !own(i) && has_bytes(i) && !bus(i)).collect();
    let packed_need = packed.iter().map(|&i| table_at(i) + areas[i]).max().unwrap_or(0);
    // Two regions when a lease's scatter may overlap the next one's DMA.
    let regions = packed.len().min(SIDE_SLOTS) as u64;
    let region_stride = packed_need.next_multiple_of(256);
    // A DMA, then a table and a launch, for each packed lease; a launch for each lease over
    // the bus; a DMA for each own one.
    let singles = (0..leases.len()).filter(|&i| bus(i) || (own(i) && has_bytes(i))).count();
    let submissions = (2 * packed.len() + singles) as u64;
    exec.claim_ranges(batch.table.buffers(), submissions, batch.ranges())?;
    exec.requested(requested);
    let dev = if packed_need > 0 { exec.region(&mut scratch.region, regions * region_stride)? } else { 0 };
    let kernels = if packed_need > 0 || (0..leases.len()).any(bus) { Some(exec.kernels()?) } else { None };
    let bases: Vec<usize> = leases.iter().map(|l| l.as_ptr() as usize).collect();
    let fills = Fills::new(batch.par, batch.writes, batch.sources, &bases);
    // Packed leases enqueued so far.
    let mut j = 0;
    // Moves lease `i` (its fills done).
    let mut move_lease = |i: usize| -> Result<()> {
        let run = runs[i].0.clone();
        let lease = &leases[i];
        if !has_bytes(i) {
            return Ok(());
        }
        let base = lease.as_ptr();
        if own(i) {
            let w = run.start;
            let len = batch.writes[w].len as usize;
            exec.submit(vec![Arc::clone(lease)], |q| {
                // SAFETY: the write's bytes in its own pinned lease, kept alive by this
                // submission, into a live, marked buffer.
                unsafe { q.htod(ptr_of(w), base.add(offset_of(w) as usize), len) }
            })?;
            return Ok(());
        }
        let kernels = kernels.expect("loaded when there are packed writes");
        if bus(i) {
            let copies = run.map(|w| (base as u64 + offset_of(w), ptr_of(w), batch.writes[w].len));
            let (table, count) = write_table(lease, table_at(i), areas[i], &mut scratch.descriptors, copies);
            let bytes = count * size_of::<CopyDescriptor>() as u64;
            let payload = runs[i].0.clone().map(|w| batch.writes[w].len).sum::<u64>();
            let at = table as u64;
            exec.submit(vec![Arc::clone(lease)], |q| {
                // SAFETY: the table and the writes' bytes are in the pinned lease, which this
                // submission keeps alive and the device reads (unified addressing);
                // destinations are disjoint ranges (no two writes fuse) of live, marked
                // buffers.
                unsafe { q.launch_over_bus(kernels, at, count, bytes + payload) }
            })?;
            return Ok(());
        }
        let used = batch.arena_used[i];
        let (slot, last) = (j % SIDE_SLOTS, j + 1 == packed.len());
        let region = dev + slot as u64 * region_stride;
        j += 1;
        // The region's previous lease is spread before its bytes are overwritten.
        exec.wait_side(slot)?;
        exec.submit(vec![Arc::clone(lease)], |q| {
            // SAFETY: the lease's used bytes, kept alive by this submission, into a region of
            // device staging, which holds packed_need >= used bytes; the launches that read
            // the region before come before on this stream or were waited for just above.
            unsafe { q.htod(region, base, used) }
        })?;
        // Built while the bytes are on the wire.
        let copies = run.map(|w| (region + offset_of(w), ptr_of(w), batch.writes[w].len));
        let (area, at) = (areas[i], region + table_at(i));
        let (table, count) = write_table(lease, table_at(i), area, &mut scratch.descriptors, copies);
        // The launches below: the table sits in the region after the lease's bytes
        // (packed_need), put there by DMAs before on the lane's stream (which the side stream
        // waits for); destinations are disjoint ranges of live, marked buffers (no two writes
        // fuse); the region is not written again before the side work is waited for (above,
        // or by the last lease's join: device staging's next user comes after this batch).
        if last {
            exec.join_side()?;
            exec.submit(vec![Arc::clone(lease)], |q| {
                // SAFETY: the table, in the lease after its bytes, is kept alive by this
                // submission; the launch as above.
                unsafe {
                    q.htod(at, table, area as usize)?;
                    q.launch(kernels, at, count, 0)
                }
            })?;
        } else {
            exec.submit(vec![Arc::clone(lease)], |q| {
                // SAFETY: the table, in the lease after its bytes, is kept alive by this
                // submission, into the region.
                unsafe { q.htod(at, table, area as usize) }
            })?;
            exec.submit_side(slot, |q| {
                // SAFETY: as above.
                unsafe { q.launch(kernels, at, count, 0) }
            })?;
        }
        Ok(())
    };
    // The fills of `write_with_par` run in groups, lease by lease, on the packing threads
    // and this one (on this one alone for a small batch); each lease moves once its fills
    // are done, while the next ones are filled. A lease with a fill that panicked, and every
    // later one, does not move.
    let (groups, work) = fills.groups(&fill_spans, core.packers().current_num_threads());
    pipeline::run(
        &core.packers,
        &groups,
        work,
        leases.len(),
        |step| match step {
            Step::Open(_) => Ok(true),
            Step::Done(i) => match fills.panics.first(runs[i].1.end) {
                Some(panicked) => Err(batch.fill_panicked(panicked)),
                None => move_lease(i).map(|()| true),
            },
        },
        |_, items| fills.run(items),
    )?;
    Ok(Some(exec.finish()))
}

/// Writes the descriptor table of an arena lease's `copies` (source, destination, length:
/// the source where the kernel reads the write's bytes) into the lease itself, at `at` (past
/// its writes' bytes, where the batch's `stage` kept `area` bytes for it, the table's size
/// counted as the writes were added); returns where it is and its number of descriptors.
fn write_table(
    lease: &HostLease,
    at: u64,
    area: u64,
    descriptors: &mut Vec<CopyDescriptor>,
    copies: impl Iterator<Item = (u64, u64, u64)>,
) -> (*const u8, u64) {
    descriptors.clear();
    for (src, dst, len) in copies {
        push_descriptors(descriptors, src, dst, len);
    }
    let bytes = descriptors.len() * size_of::<CopyDescriptor>();
    assert!(bytes as u64 <= area, "descriptors counted as the writes were added match those built");
    assert!(at + area <= lease.len() as u64, "the lease kept room for its table");
    // SAFETY: the lease holds `at + area` bytes (checked), past its writes' bytes, which
    // nothing else writes: the fills write only their writes' bytes, and the device reads
    // this part only in submissions enqueued after this call.
    let table = unsafe { lease.as_ptr().add(at as usize) };
    // SAFETY: as above; descriptors are three u64s (`repr(C)`, no padding).
    unsafe { std::ptr::copy_nonoverlapping(descriptors.as_ptr().cast::<u8>(), table, bytes) };
    (table.cast_const(), descriptors.len() as u64)
}

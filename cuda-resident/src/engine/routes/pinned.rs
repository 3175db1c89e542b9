//! The route of a scoped batch's items in pinned memory, with no host staging: chunks of runs
//! through device staging, small items over the bus, the rest by one DMA each, as the
//! layout (`plan::runs::Layout`) says.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::alloc::ResidentBuffer;
use crate::engine::Exec;
use crate::engine::core::Core;
use crate::engine::order::Ranges;
use crate::error::Result;
use crate::fence::Fence;
use crate::host_pool::HostLease;
use crate::kernels::{CopyDescriptor, table_bytes};
use crate::plan::runs::{Direct, Layout, OWN_DMA_MIN};
use crate::stream::{LaneKind, SIDE_SLOTS};
use crate::sync::lock;

/// Moves `items` on `kind`'s lane with no host staging ([`Layout`]): runs contiguous in host
/// memory by one DMA a chunk into or out of device staging, with a scatter (uploads) or
/// gather (downloads) launch inside the device, the two overlapped on the lane's two streams;
/// scattered small items by one launch of the copy kernel over the bus; the rest by one DMA
/// each. `ranges` are the items' device ranges; `buffers` every buffer they lie in. The
/// batch's last submission is noted in `last` as soon as it is claimed, before anything is
/// enqueued: the scope waits for it whatever happens after (an error, a panic).
pub(crate) fn move_pinned(
    core: &Arc<Core>,
    kind: LaneKind,
    buffers: impl Iterator<Item = ResidentBuffer>,
    items: &[Direct],
    ranges: Ranges,
    last: &AtomicU64,
) -> Result<Fence> {
    let config = &core.config;
    let batched = core.dma_batches();
    let layout = Layout::new(
        items,
        config.chunk_bytes,
        config.direct_threshold,
        (core.info.unified_addressing, core.moves_small_copies_over_bus()),
        if batched.is_some() { OWN_DMA_MIN } else { u64::MAX },
    );
    let mut exec = Exec::begin(core, kind);
    let mut scratch = lock(&core.staging[kind.index()]);
    let final_seq = exec.claim_built(buffers, layout.submissions(), ranges)?;
    last.fetch_max(final_seq, Ordering::AcqRel);
    exec.requested(items.iter().map(|d| d.len).sum());
    // A slot of device staging per chunk in flight: its bytes, then (uploads) its table. A
    // download's gather reads its table in pinned memory over the bus instead: a copy of it
    // into the device would queue on the copy engine behind the other lane's uploads, and
    // hold each chunk of a download back until they are done.
    let slot_bytes = layout.chunks.iter().map(|c| c.len).max().unwrap_or(0).next_multiple_of(256);
    let table_area = match kind {
        LaneKind::Upload => {
            layout.chunks.iter().map(|c| table_bytes(c.descriptors.len() as u64)).max().unwrap_or(0)
        }
        LaneKind::Download => 0,
    };
    let stride = slot_bytes + table_area;
    let slots = layout.chunks.len().min(SIDE_SLOTS) as u64;
    let region = if slots > 0 { exec.region(&mut scratch.region, slots * stride)? } else { 0 };
    let slot_at = |k: usize| region + (k % SIDE_SLOTS) as u64 * stride;
    // A pinned table per launch, read over the bus (or copied into a slot), leased and
    // written just before the submission that uses it, so that the first chunk moves while
    // later ones are still being described. Each holds at most `layout.most` descriptors
    // (half a chunk): the pool keeps that much for transfers however small the items, and
    // a table taken while earlier ones are in flight waits for them as staging does.
    let table_of = |exec: &Exec, descriptors: &[CopyDescriptor]| -> Result<Arc<HostLease>> {
        let table = exec.lease(table_bytes(descriptors.len() as u64) as usize)?;
        // SAFETY: the lease holds `table_bytes(len)` bytes, room for the descriptors (three
        // u64s each, `repr(C)`, no padding); it is new, so no reference to its bytes exists,
        // and the device reads it only in submissions enqueued after this write.
        unsafe {
            std::ptr::copy_nonoverlapping(
                descriptors.as_ptr().cast::<u8>(),
                table.as_ptr(),
                std::mem::size_of_val(descriptors),
            );
        }
        Ok(Arc::new(table))
    };
    let mut part = Vec::new();
    let kernels = if layout.count > 0 { Some(exec.kernels()?) } else { None };
    for (k, chunk) in layout.chunks.iter().enumerate() {
        let (slot, at) = (k % SIDE_SLOTS, slot_at(k));
        let at_table = at + slot_bytes;
        layout.chunk_descriptors(items, k, kind, at, &mut part);
        let table = table_of(&exec, &part)?;
        let n = part.len() as u64;
        let kernels = kernels.expect("chunks have descriptors");
        let (table_ptr, table_len) = (table.as_ptr().cast_const(), std::mem::size_of_val(&part[..]));
        // The slot's last user (two chunks ago, on the side stream) is done first.
        exec.wait_side(slot)?;
        // SAFETY, for the DMAs and launches below: the chunk's pinned table is written and
        // kept alive by the lane's submission that copies it into the slot, behind the
        // slot's bytes (`table_area` holds it), or that reads it over the bus (mapped for
        // the device: chunks exist only with unified addressing); its descriptors name the
        // slot (a chunk is at most `slot_bytes`) and ranges of live, claimed buffers, no two
        // destinations overlapping; the host run lies in one pinned region (this crate's, or
        // registered: only DMAs touch it) that the scope borrows until the copies complete;
        // the side work comes after the lane's submission and is joined before the batch's
        // last one.
        match kind {
            LaneKind::Upload => {
                // SAFETY: as above.
                exec.submit(vec![Arc::clone(&table)], |q| unsafe {
                    q.htod(at, chunk.host as *const u8, chunk.len as usize)?;
                    q.htod(at_table, table_ptr, table_len)
                })?;
                // SAFETY: as above.
                exec.submit_side(slot, |q| unsafe { q.launch(kernels, at_table, n, 0) })?;
            }
            LaneKind::Download => {
                // SAFETY: as above.
                exec.submit(vec![Arc::clone(&table)], |q| unsafe {
                    q.launch(kernels, table_ptr as u64, n, table_len as u64)
                })?;
                // SAFETY: as above.
                exec.submit_side(slot, |q| unsafe { q.dtoh(chunk.host as *mut u8, at, chunk.len as usize) })?;
            }
        }
    }
    if !layout.chunks.is_empty() {
        exec.join_side()?;
        exec.submit(Vec::new(), |_| Ok(()))?;
    }
    for g in 0..layout.bus_groups.len() {
        let bytes = layout.bus_descriptors(g, kind, &mut part);
        let table = table_of(&exec, &part)?;
        let (at, n) = (table.as_ptr() as u64, part.len() as u64);
        let kernels = kernels.expect("loaded for descriptors");
        exec.submit(vec![table], |q| {
            // SAFETY: as above; the host side of each copy lies in pinned memory of this
            // crate, mapped for the device, borrowed by the scope.
            unsafe { q.launch_over_bus(kernels, at, n, bytes + n * 24) }
        })?;
    }
    if !layout.dmas.is_empty() {
        let to_device = kind == LaneKind::Upload;
        // SAFETY: as above, by one DMA each (in one driver call where batched: the items'
        // destinations are disjoint, device ranges checked so by the caller, host ones
        // borrowed mutably apart).
        exec.submit(Vec::new(), |q| unsafe { q.dmas(&layout.dmas, to_device, batched) })?;
    }
    Ok(exec.finish())
}

/// The device ranges of `items` (as they come: the ledger compares a pool's blocks on a
/// grid, without sorting them).
pub(crate) fn ranges_of(core: &Core, kind: LaneKind, items: &[Direct]) -> Ranges {
    let mut ranges = core.ranges(kind);
    for d in items {
        ranges.push(d.dev, d.len);
    }
    ranges
}

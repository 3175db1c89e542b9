//! The submit of a scope's upload batch ([`Scope::uploads`](super::Scope::uploads)): writes
//! from pinned memory in place, the others through staging.

use super::pinned::{move_pinned, ranges_of};
use super::places::{Lent, places};
use super::{Submitted, note};
use crate::engine::host::Source;
use crate::error::Result;
use crate::fence::Fence;
use crate::plan::runs::{Direct, Place, first_part, parts};
use crate::stream::LaneKind;
use crate::transfer::UploadBatch;

/// Write `i` of a scoped batch without fills: its buffer's key, its offset, its slice.
fn write_at<'a>(batch: &UploadBatch<'a>, i: usize) -> (u32, u64, &'a [u8]) {
    let w = &batch.writes[i];
    let Source::Slice(data) = batch.sources[i] else {
        unreachable!("a scoped batch moved in place holds no fills")
    };
    (w.buffer as u32, w.offset, data)
}

/// Moves every write of `batch` (a scoped batch without fills, checked and not poisoned),
/// recording its submissions in `seen`: those from pinned memory of this crate straight
/// from it, the others through staging (copied before this returns). A batch of more than
/// 1024 writes or a chunk of bytes moves in up to three parts, the first while the rest is
/// looked at and laid out, where they come from pinned memory (the first part from this
/// crate's: it moves before any later write is classified); the parts apply in order.
/// Returns the fence of the last submission.
pub(in crate::transfer) fn submit_in_place(batch: &UploadBatch<'_>, seen: &Submitted) -> Result<Fence> {
    let core = batch.core;
    // Nothing moves where a buffer was freed before this call: a part that goes through
    // staging claims only the buffers of its own writes, so every buffer is checked first.
    core.alloc.check_live_many(batch.table.buffers())?;
    let ptr_of = |key: u32, offset: u64| batch.table.entries[key as usize].ptr + offset;
    let count = batch.writes.len();
    // The first part moves before the rest is looked at (where the batch has one).
    let mut lent = Lent::default();
    let first = first_part(count, core.config.chunk_bytes, |i| {
        let (key, offset, data) = write_at(batch, i);
        lent.seen(data.as_ptr() as usize, data.len(), ptr_of(key, offset))
    });
    let mut fence = Fence::completed();
    let from = match first {
        Some((items, end)) => {
            fence = move_part(batch, seen, &items, 0..end)?;
            end
        }
        None => 0,
    };
    let hosts: Vec<(usize, usize)> = (from..count)
        .map(|i| {
            let (_, _, data) = write_at(batch, i);
            (data.as_ptr() as usize, data.len())
        })
        .collect();
    let places = places(core, &hosts)?;
    // One pass: the items that move in place (and the write each comes from), the others.
    let (mut direct, mut origin, mut staged) = (Vec::with_capacity(hosts.len()), Vec::new(), Vec::new());
    for (i, place) in (from..).zip(places) {
        let (key, offset, data) = write_at(batch, i);
        if data.is_empty() {
            continue;
        }
        match place {
            Place::Mapped(_) | Place::Pinned(_) => {
                direct.push(Direct::new(data.as_ptr() as usize, ptr_of(key, offset), data.len(), place));
                origin.push(i);
            }
            Place::Staged => staged.push(i),
        }
    }
    if staged.is_empty() {
        // All in place: in parts, each checked for overlaps of its own (a part that has
        // some goes staged whole); the parts apply in order, one after the other on the
        // lane, so a later write wins over an earlier one in another part too.
        for part in parts(&direct, core.config.chunk_bytes, usize::from(from > 0)) {
            fence = move_part(batch, seen, &direct[part.clone()], origin[part].iter().copied())?;
        }
        return Ok(fence);
    }
    // Some staged: overlapping writes apply in order, so where any two writes overlap, the
    // staged path's planner takes them all (those of a first part moved already come
    // before them all on the lane).
    let mut ranges = core.ranges(LaneKind::Upload);
    for i in from..count {
        let (key, offset, data) = write_at(batch, i);
        ranges.push(ptr_of(key, offset), data.len() as u64);
    }
    if !direct.is_empty() && !ranges.disjoint_by_granules().unwrap_or_else(|| ranges.sort_disjoint()) {
        direct.clear();
        staged = (from..count).collect();
    }
    if !direct.is_empty() {
        // Noted in the scope, which waits for it; the staged batch comes after it on the
        // lane, so its fence is the one returned.
        drop(move_part(batch, seen, &direct, origin.into_iter())?);
    }
    fence = submit_staged(batch, staged.into_iter())?;
    note(seen, &fence);
    Ok(fence)
}

/// Moves a part of the batch's writes made in place, `items`, coming from the writes at
/// `origin`: in place where no two of them overlap (checked by granules, without a sort,
/// which would cost ~0.7 ms for 16384 blocks of a pool on the development VM, before the
/// first DMA), else those writes through staging, in order.
fn move_part(
    batch: &UploadBatch<'_>,
    seen: &Submitted,
    items: &[Direct],
    origin: impl Iterator<Item = usize>,
) -> Result<Fence> {
    let core = batch.core;
    let mut ranges = ranges_of(core, LaneKind::Upload, items);
    let fence = if ranges.disjoint_by_granules().unwrap_or_else(|| ranges.sort_disjoint()) {
        let moved = move_pinned(core, LaneKind::Upload, batch.table.buffers(), items, ranges, seen);
        seen.note(LaneKind::Upload, moved)?
    } else {
        submit_staged(batch, origin)?
    };
    note(seen, &fence);
    Ok(fence)
}

/// The writes at `indices` (in order) as one ordinary batch, through staging.
fn submit_staged(batch: &UploadBatch<'_>, indices: impl Iterator<Item = usize>) -> Result<Fence> {
    let mut staged = crate::transfer::upload::uploads(batch.core);
    for i in indices {
        let (key, offset, data) = write_at(batch, i);
        if !data.is_empty() {
            staged.write(batch.table.entries[key as usize].buffer, offset, data)?;
        }
    }
    staged.submit()
}

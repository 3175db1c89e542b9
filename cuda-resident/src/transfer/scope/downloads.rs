//! The reads into caller slices of a scope's download batch
//! ([`Scope::downloads`](super::Scope::downloads)): into pinned memory in place, into any
//! other memory through staging.

use std::sync::Arc;

use super::pinned::{move_pinned, ranges_of};
use super::places::{Lent, places};
use super::{Submitted, note};
use crate::engine::core::Core;
use crate::error::{Error, Result};
use crate::fence::Fence;
use crate::plan::runs::{Direct, Place, first_part, parts};
use crate::stream::LaneKind;
use crate::transfer::BufferTable;
use crate::transfer::download::read_staged;

/// Moves `reads` (`(key in table, offset, out)` each, checked, their buffers live), recording
/// the submissions in `seen`: into pinned memory of this crate straight from the device
/// (this returns at once; the bytes are there when the scope ends; a large batch moves in up
/// to three parts, as an [`UploadBatch`](crate::UploadBatch) of a scope does), into any
/// other memory through staging (this returns once those bytes are copied in). Returns the
/// fence of the last submission.
pub(in crate::transfer) fn read_in_place(
    core: &Arc<Core>,
    table: &BufferTable,
    mut reads: Vec<(u32, u64, &mut [u8])>,
    seen: &Submitted,
) -> Result<Fence> {
    let entries = &table.entries;
    // The first part moves before the rest is looked at (where the batch has one).
    let mut lent = Lent::default();
    let first = first_part(reads.len(), core.config.chunk_bytes, |i| {
        let (key, offset, ref mut out) = reads[i];
        lent.seen(out.as_mut_ptr() as usize, out.len(), entries[key as usize].ptr + offset)
    });
    let mut fence = Fence::completed();
    let move_part = |items: &[Direct]| {
        let ranges = ranges_of(core, LaneKind::Download, items);
        let moved = move_pinned(core, LaneKind::Download, table.buffers(), items, ranges, seen);
        let fence = seen.note(LaneKind::Download, moved)?;
        note(seen, &fence);
        Ok::<_, Error>(fence)
    };
    let from = match first {
        Some((items, end)) => {
            fence = move_part(&items)?;
            end
        }
        None => 0,
    };
    let rest: Vec<_> = std::mem::take(&mut reads).into_iter().skip(from).collect();
    let hosts: Vec<(usize, usize)> = rest.iter().map(|r| (r.2.as_ptr() as usize, r.2.len())).collect();
    let places = places(core, &hosts)?;
    let (mut direct, mut staged) = (Vec::with_capacity(rest.len()), Vec::new());
    for ((key, offset, out), place) in rest.into_iter().zip(places) {
        if out.is_empty() {
            continue;
        }
        let entry = entries[key as usize];
        match place {
            Place::Mapped(_) | Place::Pinned(_) => {
                direct.push(Direct::new(out.as_mut_ptr() as usize, entry.ptr + offset, out.len(), place))
            }
            Place::Staged => staged.push((entry.buffer, offset, out)),
        }
    }
    // In parts (reads of distinct caller slices: their order does not matter).
    for part in parts(&direct, core.config.chunk_bytes, usize::from(from > 0)) {
        fence = move_part(&direct[part])?;
    }
    read_staged(core, staged, Some(seen))?;
    Ok(fence)
}

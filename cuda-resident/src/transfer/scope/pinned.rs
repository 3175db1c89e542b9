//! The scope's side of moving items in place (`engine::routes::pinned`): the lane's last
//! submission noted in the scope's record.

use std::sync::Arc;

use super::Submitted;
use crate::alloc::ResidentBuffer;
use crate::engine::core::Core;
use crate::engine::order::Ranges;
pub(super) use crate::engine::routes::pinned::ranges_of;
use crate::error::Result;
use crate::fence::Fence;
use crate::plan::runs::Direct;
use crate::stream::LaneKind;

/// Moves `items` in place on `kind`'s lane ([`move_pinned`](crate::engine::routes::pinned::move_pinned)),
/// noting its last submission in `seen` as soon as it is claimed.
pub(super) fn move_pinned(
    core: &Arc<Core>,
    kind: LaneKind,
    buffers: impl Iterator<Item = ResidentBuffer>,
    items: &[Direct],
    ranges: Ranges,
    seen: &Submitted,
) -> Result<Fence> {
    crate::engine::routes::pinned::move_pinned(core, kind, buffers, items, ranges, &seen.last[kind.index()])
}

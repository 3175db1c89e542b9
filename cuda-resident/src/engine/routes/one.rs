//! The route [`Route::One`](crate::plan::route::Route::One): one small write from a slice,
//! [`execute_one`].

use std::sync::Arc;

use crate::engine::Exec;
use crate::engine::core::Core;
use crate::engine::table::BufferTable;
use crate::error::Result;
use crate::fence::Fence;
use crate::plan::WriteRequest;
use crate::stream::LaneKind;

/// One small write (below the direct threshold), the latency path: staged by one memcpy on
/// this thread and moved by one DMA, no planning. Larger single writes take the general
/// path, which packs on the packing threads and pipelines chunks.
pub(crate) fn execute_one(
    core: &Arc<Core>,
    table: &BufferTable,
    write: &WriteRequest,
    data: &[u8],
) -> Result<Fence> {
    let target = table.entries[write.buffer as usize];
    // The lane first, then the staging (as every transfer takes them): a transfer that
    // waits for staging holds its lane, and waits only for staging that comes back.
    let mut exec = Exec::begin(core, LaneKind::Upload);
    let mut lease = exec.lease(data.len())?;
    // SAFETY: the lease is fresh (no copy uses it) and holds data.len() bytes.
    unsafe { lease.as_mut_slice() }.copy_from_slice(data);
    let lease = Arc::new(lease);
    let src = lease.as_ptr();
    exec.claim_ranges(std::iter::once(target.buffer), 1, |r| r.push(target.ptr + write.offset, write.len))?;
    exec.requested(write.len);
    exec.submit(vec![lease], |q| {
        // SAFETY: pinned staging kept alive by this submission, into a live, marked buffer
        // range checked when the write was added.
        unsafe { q.htod(target.ptr + write.offset, src, data.len()) }
    })?;
    Ok(exec.finish())
}

//! One planned download chunk's work on a lane ([`enqueue_planned`]), for the planned and
//! streamed download routes.

use crate::engine::Enqueue;
use crate::error::Result;
use crate::kernels::CopyDescriptor;

/// Where a planned download chunk's work reads and writes: its descriptor table (`area`
/// bytes of `count` descriptors) in pinned memory, device staging at `dev`, and `staged`,
/// the pinned address of a flat staging offset of the chunk; `mapped`: the GPU reaches
/// pinned memory (unified addressing).
pub(crate) struct ChunkPlaces<'a> {
    pub(crate) table: *const u8,
    pub(crate) area: u64,
    pub(crate) count: u64,
    pub(crate) dev: u64,
    pub(crate) staged: &'a dyn Fn(u64) -> *mut u8,
    pub(crate) mapped: bool,
}

/// Enqueues a planned download chunk on `stream`: with a table (`area > 0`), one gather
/// launch and one DMA of the packed bytes down; then one DMA for each packed range moved
/// without the kernel and each direct one. The gather reads its table in pinned memory over
/// the bus where the GPU reaches it: a copy of the table up into device staging would queue
/// on the copy engine behind uploads of the other lane, holding the download back until
/// they are done. Without unified addressing the table goes up first.
///
/// # Safety
/// The table and every staged address stay alive and untouched by the host until the work
/// completes; device staging at `dev` holds `area + packed_len` bytes; `ptr_of` gives live
/// buffers (marked for this work) whose ranges the chunk reads.
pub(crate) unsafe fn enqueue_planned(
    q: &mut Enqueue<'_>,
    chunk: &crate::plan::DownloadChunk,
    at: &ChunkPlaces<'_>,
    kernels: Option<&crate::kernels::Kernels>,
    ptr_of: &dyn Fn(u64) -> u64,
) -> Result<()> {
    if at.area > 0 {
        let kernels = kernels.expect("loaded when a chunk uses it");
        let table_bytes = at.count * size_of::<CopyDescriptor>() as u64;
        if at.mapped {
            // SAFETY: the table is pinned, mapped for the device, and stays alive (the
            // caller's promise); sources are live, marked buffers; destinations are disjoint
            // ranges of device staging.
            unsafe { q.launch(kernels, at.table as u64, at.count, table_bytes) }?;
        } else {
            // SAFETY: the table is pinned and stays alive (the caller's promise); device
            // staging holds area + packed_len bytes.
            unsafe { q.htod(at.dev, at.table, at.area as usize) }?;
            // SAFETY: as above, the table in device staging by stream order.
            unsafe { q.launch(kernels, at.dev, at.count, 0) }?;
        }
        // SAFETY: the packed region of this chunk lies in its staging.
        unsafe { q.dtoh((at.staged)(chunk.packed_offset), at.dev + at.area, chunk.packed_len as usize) }?;
    }
    // Packed ranges without the kernel, and direct ones: one DMA each.
    let singles = if at.area > 0 { &chunk.packed[..0] } else { &chunk.packed[..] };
    for c in singles.iter().chain(&chunk.direct) {
        // SAFETY: a range of a live, marked buffer into the chunk's staging.
        unsafe { q.dtoh((at.staged)(c.stage_offset), ptr_of(c.buffer) + c.buffer_offset, c.len as usize) }?;
    }
    Ok(())
}

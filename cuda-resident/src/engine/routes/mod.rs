//! The routes, one file each: how a batch that `plan::route` sent one way packs and runs an
//! [`Exec`](super::Exec). A batch made above the engine hands its route a view of its parts
//! ([`view::UploadView`], [`view::DownloadView`]: borrows, nothing copied), so that no route
//! reads the batch type itself; a download route hands back where the bytes land
//! ([`view::Landed`]), of which the batch makes its pending download. A planned download
//! chunk's work, streamed or not, is [`download_chunk`]'s.
pub(crate) mod download_chunk;
pub(crate) mod download_in_order;
pub(crate) mod download_planned;
pub(crate) mod in_place;
pub(crate) mod one;
pub(crate) mod pinned;
pub(crate) mod streamed;
pub(crate) mod upload_in_order;
pub(crate) mod upload_planned;
pub(crate) mod view;

use crate::kernels::descriptor_area;
use crate::plan::Chunk;

/// A planned chunk with fewer packed copies than this moves them by one DMA each, without
/// the kernel: for a handful of copies, DMAs cost less than a launch.
pub(crate) const KERNEL_MIN_COPIES: usize = 3;

/// Whether a planned chunk's packed copies move by the kernel (a scatter up, a gather down).
pub(crate) fn uses_kernel(chunk: &Chunk) -> bool {
    chunk.packed.len() >= KERNEL_MIN_COPIES
}

/// The bytes of a planned chunk's descriptor table: 0 when its copies move without the
/// kernel.
fn table_area(chunk: &Chunk) -> u64 {
    if uses_kernel(chunk) { descriptor_area(chunk.packed.iter().map(|p| p.len)) } else { 0 }
}

/// Each planned chunk's [`table_area`], counted once, and the device staging its kernel
/// chunks need at most (table and packed bytes; `None` when no chunk uses the kernel).
pub(crate) fn table_areas(chunks: &[Chunk]) -> (Vec<u64>, Option<u64>) {
    let areas: Vec<u64> = chunks.iter().map(table_area).collect();
    let device_need = chunks.iter().zip(&areas).filter(|&(_, &a)| a > 0).map(|(c, a)| a + c.packed_len).max();
    (areas, device_need)
}

//! The host side of a transfer: host memcpys of packing and unpacking ([`Piece`]), run on
//! the device's packing threads ([`in_groups`], and `super::pipeline` for chunks
//! overlapped with the wire), and host memory for results ([`zeroed_vec`]).

use crate::device::Core;
use crate::error::{Error, Result};

use super::pipeline;

/// A vector of `len` zero bytes, or an error instead of an abort when the host cannot give
/// that much. Large zeroed allocations come from the OS already zero, so this costs no
/// memset (unlike `resize`): the pages are touched first by whatever fills the vector.
pub(crate) fn zeroed_vec(len: u64) -> Result<Vec<u8>> {
    let oom = || Error::HostOutOfMemory { bytes: len };
    let n = usize::try_from(len).map_err(|_| oom())?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(n).map_err(|_| oom())?;
    // SAFETY: the layout has a non-zero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(oom());
    }
    // SAFETY: ptr was allocated by the global allocator with exactly this layout (size n,
    // align 1), and all n bytes are initialised (zero).
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

/// One host memcpy of packing or unpacking.
#[derive(Clone, Copy)]
pub(crate) struct Piece {
    pub(crate) dst: *mut u8,
    pub(crate) src: *const u8,
    pub(crate) len: usize,
}

// SAFETY: a piece is two addresses and a length; the code that builds pieces guarantees
// that the ranges are valid and that no two pieces' destinations overlap.
unsafe impl Send for Piece {}
// SAFETY: as above; pieces are only read.
unsafe impl Sync for Piece {}

/// Pieces larger than this are split for the packing threads.
const PIECE_SPLIT: usize = 256 << 10;
/// Below this many bytes in all, one thread copies (waking the pool costs more).
pub(crate) const PARALLEL_MIN: usize = 1 << 20;

impl Piece {
    /// Appends `piece`, split into parts of at most [`PIECE_SPLIT`] bytes.
    pub(crate) fn push_split(out: &mut Vec<Piece>, piece: Piece) {
        let mut done = 0;
        while done < piece.len {
            let len = (piece.len - done).min(PIECE_SPLIT);
            // SAFETY: offsets stay inside the piece's ranges.
            out.push(unsafe { Piece { dst: piece.dst.add(done), src: piece.src.add(done), len } });
            done += len;
        }
    }

    /// Performs every piece, in parallel on the device's packing threads when there is
    /// enough to do.
    ///
    /// # Safety
    /// Each piece's source must be readable and its destination writable for `len` bytes,
    /// and no destination may overlap another piece's source or destination.
    pub(crate) unsafe fn copy_all(core: &Core, pieces: &[Piece]) {
        // SAFETY: as the caller promises.
        unsafe { Piece::run_all(core, pieces, std::ptr::copy_nonoverlapping::<u8>) }
    }

    /// [`Piece::copy_all`] out of landed staging into the caller's memory
    /// ([`crate::hostcopy::copy_out`]: streaming stores for long pieces).
    ///
    /// # Safety
    /// As [`Piece::copy_all`].
    pub(crate) unsafe fn copy_out_all(core: &Core, pieces: &[Piece]) {
        // SAFETY: as the caller promises.
        unsafe { Piece::run_all(core, pieces, crate::hostcopy::copy_out) }
    }

    /// Performs every piece with `copy`, publishing each group's streaming stores.
    ///
    /// # Safety
    /// As [`Piece::copy_all`]; `copy(src, dst, len)` must copy `len` bytes from `src` to `dst`.
    unsafe fn run_all(core: &Core, pieces: &[Piece], copy: unsafe fn(*const u8, *mut u8, usize)) {
        let total: usize = pieces.iter().map(|p| p.len).sum();
        in_groups(
            core,
            pieces.len(),
            total,
            |i| pieces[i].len,
            |range| {
                for p in &pieces[range] {
                    // SAFETY: as the caller promises.
                    unsafe { copy(p.src, p.dst, p.len) }
                }
                crate::hostcopy::publish();
            },
        );
    }
}

/// Runs `work` over `0..count` split into contiguous ranges of about equal bytes (item `i`
/// has `bytes(i)`, `total` in all), a few per packing thread, in parallel when there is
/// enough to do: one task per range, not per item (thousands of tiny tasks cost more than
/// the copies). Returns when every range is done.
pub(crate) fn in_groups(
    core: &Core,
    count: usize,
    total: usize,
    bytes: impl Fn(usize) -> usize,
    work: impl Fn(std::ops::Range<usize>) + Sync + Send,
) {
    if total < PARALLEL_MIN || count < 2 {
        return work(0..count);
    }
    let pool = core.packers();
    let target = (total / (pool.current_num_threads() * 4)).max(64 << 10);
    let mut groups = Vec::new();
    pipeline::split_by_bytes(0..count, bytes, target, |group| groups.push(group));
    use rayon::prelude::*;
    let packing = pipeline::Packing::start(core);
    pool.install(|| groups.into_par_iter().for_each(work));
    drop(packing);
    pipeline::linger(core);
}

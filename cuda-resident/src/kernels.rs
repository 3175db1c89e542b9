//! The scatter/gather kernel: CUDA C in `kernels/copy.cu`, PTX committed beside it
//! (`kernels/build-ptx.sh` regenerates it), loaded with `cuModuleLoadData` on first use.

use std::ffi::CStr;

use cuda_sys::{CUfunction, CUmodule};

use crate::error::Result;
use crate::raw::Raw;

/// The PTX of `kernels/copy.cu`, NUL-terminated for the driver.
const COPY_PTX: &CStr = {
    const TEXT: &str = concat!(include_str!("../kernels/copy.ptx"), "\0");
    match CStr::from_bytes_with_nul(TEXT.as_bytes()) {
        Ok(ptx) => ptx,
        Err(_) => panic!("copy.ptx contains a NUL byte"),
    }
};

/// One copy for the kernel: absolute device addresses. Layout shared with `copy.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CopyDescriptor {
    pub(crate) src: u64,
    pub(crate) dst: u64,
    pub(crate) len: u64,
}

/// Descriptors longer than this are split, so that one launch has a warp per piece.
pub(crate) const SEGMENT: u64 = 16 << 10;

/// The same for copies between GPUs. A warp pulls 64 KiB over NVLink as fast as four warps
/// pull 16 KiB each, and a quarter of the descriptors costs less to build and to move
/// (docs/multi-gpu.md).
pub(crate) const PEER_SEGMENT: u64 = 64 << 10;

/// Threads per block of the copy kernel (its `__launch_bounds__`).
const BLOCK: u32 = 256;

/// The loaded module.
pub(crate) struct Kernels {
    module: CUmodule,
    copy: CUfunction,
    /// Blocks of a launch at most: 8 per multiprocessor.
    max_blocks: u32,
    /// Blocks of a launch over the bus ([`Kernels::copy_over_bus`]): 1 per multiprocessor.
    bus_blocks: u32,
}

// SAFETY: module and function handles are usable from any thread of the process.
unsafe impl Send for Kernels {}
// SAFETY: as above; nothing is mutated after loading.
unsafe impl Sync for Kernels {}

impl Kernels {
    /// Loads the module. The context must be current.
    pub(crate) fn load(raw: &Raw, multiprocessors: u32) -> Result<Kernels> {
        let module = raw.module_load_data(COPY_PTX)?;
        match raw.module_get_function(module, c"copy_descriptors") {
            Ok(copy) => Ok(Kernels {
                module,
                copy,
                max_blocks: multiprocessors.max(1) * 8,
                bus_blocks: multiprocessors.max(1),
            }),
            Err(e) => {
                let _ = crate::raw::release_retrying(|| raw.module_unload(module));
                Err(e)
            }
        }
    }

    /// Enqueues one launch that performs `count` descriptors stored at `descriptors` (device
    /// memory).
    ///
    /// # Safety
    /// `descriptors` must hold `count` descriptors by the time the stream reaches the launch,
    /// and each must name device memory valid for the copy, with no two destinations
    /// overlapping (and no destination overlapping a source).
    pub(crate) unsafe fn copy(
        &self,
        raw: &Raw,
        stream: cuda_sys::CUstream,
        descriptors: u64,
        count: u64,
    ) -> Result<()> {
        // SAFETY: as the caller promises.
        unsafe { self.launch_copy(raw, stream, descriptors, count, self.max_blocks) }
    }

    /// [`Kernels::copy`] for a table and copies whose host side lies in pinned memory, read
    /// (uploads) or written (downloads) by the kernel over the bus: one block per
    /// multiprocessor, which keeps the link busy (as many blocks as eight per multiprocessor
    /// measured no faster) while leaving most of every multiprocessor to the caller's
    /// kernels.
    ///
    /// # Safety
    /// As [`Kernels::copy`], with pinned host memory (mapped for the device: unified
    /// addressing) allowed for the table and either side of each copy.
    pub(crate) unsafe fn copy_over_bus(
        &self,
        raw: &Raw,
        stream: cuda_sys::CUstream,
        descriptors: u64,
        count: u64,
    ) -> Result<()> {
        // SAFETY: as the caller promises.
        unsafe { self.launch_copy(raw, stream, descriptors, count, self.bus_blocks) }
    }

    /// One launch of the copy kernel over `count` descriptors at `descriptors`, a warp per
    /// descriptor, in at most `most_blocks` blocks.
    ///
    /// # Safety
    /// As [`Kernels::copy`] or [`Kernels::copy_over_bus`].
    unsafe fn launch_copy(
        &self,
        raw: &Raw,
        stream: cuda_sys::CUstream,
        descriptors: u64,
        count: u64,
        most_blocks: u32,
    ) -> Result<()> {
        let warps_per_block = u64::from(BLOCK / 32);
        let blocks = count.div_ceil(warps_per_block).clamp(1, u64::from(most_blocks.max(1))) as u32;
        let (mut table, mut n) = (descriptors, count);
        let mut params = [(&mut table as *mut u64).cast(), (&mut n as *mut u64).cast()];
        // SAFETY: the parameters match `copy_descriptors(const CopyDescriptor*, u64)`; the
        // caller vouches for the table.
        unsafe { raw.launch(self.copy, blocks, BLOCK, stream, &mut params) }
    }

    pub(crate) fn unload(&self, raw: &Raw) -> Result<()> {
        raw.module_unload(self.module)
    }
}

/// The bytes of a descriptor table for copies of these lengths, rounded to 256 so that what
/// follows it in staging stays aligned.
pub(crate) fn descriptor_area(copies: impl Iterator<Item = u64>) -> u64 {
    table_bytes(copies.map(|len| len.div_ceil(SEGMENT)).sum())
}

/// The bytes of a table of `count` descriptors, rounded as [`descriptor_area`] rounds.
pub(crate) fn table_bytes(count: u64) -> u64 {
    (count * std::mem::size_of::<CopyDescriptor>() as u64).next_multiple_of(256)
}

/// Appends descriptors for one copy of `len` bytes, split into pieces of at most
/// [`SEGMENT`] bytes.
#[inline]
pub(crate) fn push_descriptors(out: &mut Vec<CopyDescriptor>, src: u64, dst: u64, len: u64) {
    out.extend(segments(src, dst, len, SEGMENT));
}

/// The descriptors of one copy of `len` bytes, in pieces of at most `segment` bytes.
#[inline]
pub(crate) fn segments(src: u64, dst: u64, len: u64, segment: u64) -> impl Iterator<Item = CopyDescriptor> {
    (0..len).step_by(segment as usize).map(move |done| CopyDescriptor {
        src: src + done,
        dst: dst + done,
        len: (len - done).min(segment),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ptx_is_embedded_and_names_the_kernel() {
        let text = COPY_PTX.to_str().unwrap();
        assert!(text.contains(".entry copy_descriptors("), "kernel entry missing");
        assert!(text.contains(".target sm_75"));
    }

    #[test]
    fn long_copies_are_split_into_segments() {
        let mut v = Vec::new();
        push_descriptors(&mut v, 1000, 5000, 2 * SEGMENT + 3);
        assert_eq!(v.len(), 3);
        assert_eq!(v[1], CopyDescriptor { src: 1000 + SEGMENT, dst: 5000 + SEGMENT, len: SEGMENT });
        assert_eq!(v[2].len, 3);
        v.clear();
        push_descriptors(&mut v, 0, 0, 0);
        assert!(v.is_empty());
        assert_eq!(std::mem::size_of::<CopyDescriptor>(), 24);
    }
}

//! The raw driver's side of every case: its streams, a checked driver call, one
//! `cuMemcpy*Async` per copy, and `cuMemcpyBatchAsync` over a list of copies.

use cuda_resident::Device;
use cuda_resident::cuda_sys::{self, CUDA_SUCCESS, CUresult, CUstream, MissingSymbol, call};

use crate::BenchResult;

/// A raw driver call's outcome as a result: the call's name and the `CUresult` on failure.
pub(crate) fn check(what: &str, code: Result<CUresult, MissingSymbol>) -> BenchResult<()> {
    match code {
        Ok(CUDA_SUCCESS) => Ok(()),
        Ok(code) => Err(format!("{what} failed with CUresult {code}")),
        Err(e) => Err(e.to_string()),
    }
}

/// The raw driver baseline: two streams of the device's context (a second one for the other
/// direction of the both-at-once cases) and whether the driver has `cuMemcpyBatchAsync`.
pub(crate) struct DriverBaseline<'d> {
    device: &'d Device,
    pub(crate) stream: CUstream,
    pub(crate) second: CUstream,
    pub(crate) batch: bool,
}

impl<'d> DriverBaseline<'d> {
    /// Creates the two streams on `device`'s context, which must be current on this thread.
    pub(crate) fn new(device: &'d Device) -> BenchResult<DriverBaseline<'d>> {
        let mut streams: [CUstream; 2] = [std::ptr::null_mut(); 2];
        for stream in &mut streams {
            // SAFETY: creates a stream on the device's context, current on this thread.
            check("cuStreamCreate", unsafe {
                call!(device.driver(), cuStreamCreate(stream, cuda_sys::CU_STREAM_NON_BLOCKING))
            })?;
        }
        let [stream, second] = streams;
        Ok(DriverBaseline { device, stream, second, batch: device.info().batch_memcpy })
    }

    /// One `cuMemcpyHtoDAsync` per copy, `size` bytes of each of `sources` to the device
    /// address beside it in `dsts`, on the first stream, then a synchronize.
    pub(crate) fn uploads(&self, sources: &[Vec<u8>], dsts: &[u64], size: usize) -> BenchResult<()> {
        each_h2d(self.device, self.stream, sources.iter().map(|src| &src[..size]), dsts)
    }

    /// One `cuMemcpyDtoHAsync` per copy, `size` bytes from each device address of `srcs`
    /// into the vector beside it in `outs`, on the first stream, then a synchronize.
    pub(crate) fn downloads(&self, outs: &mut [Vec<u8>], srcs: &[u64], size: usize) -> BenchResult<()> {
        each_d2h(self.device, self.stream, outs.iter_mut().map(|out| &mut out[..size]), srcs)
    }

    /// One `cuMemcpyBatchAsync` over all copies on the first stream, then a synchronize.
    pub(crate) fn memcpy_batch(
        &self,
        dsts: &mut [u64],
        srcs: &mut [u64],
        sizes: &mut [usize],
        host_to_device: bool,
    ) -> BenchResult<()> {
        memcpy_batch(self.device, self.stream, dsts, srcs, sizes, host_to_device)
    }
}

impl Drop for DriverBaseline<'_> {
    fn drop(&mut self) {
        for stream in [self.stream, self.second] {
            // SAFETY: every copy on the stream has been waited for; each stream is destroyed once.
            let _ = unsafe { call!(self.device.driver(), cuStreamDestroy_v2(stream)) };
        }
    }
}

/// One `cuMemcpyHtoDAsync` per copy on `stream` of `d`'s context, each of `sources` to the
/// device address beside it in `dsts` (a range of at least its length), then a synchronize.
pub(crate) fn each_h2d<'a>(
    d: &Device,
    stream: CUstream,
    sources: impl IntoIterator<Item = &'a [u8]>,
    dsts: &[u64],
) -> BenchResult<()> {
    for (src, &dst) in sources.into_iter().zip(dsts) {
        // SAFETY: a live host source of `src.len()` bytes (pinned or pageable), a device
        // range of as many; synchronized before the borrow ends.
        check("cuMemcpyHtoDAsync", unsafe {
            call!(d.driver(), cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), stream))
        })?;
    }
    sync(d, stream)
}

/// One `cuMemcpyDtoHAsync` per copy on `stream` of `d`'s context, from each device address
/// of `srcs` (a range of at least the destination's length) into the slice beside it in
/// `outs`, then a synchronize.
pub(crate) fn each_d2h<'a>(
    d: &Device,
    stream: CUstream,
    outs: impl IntoIterator<Item = &'a mut [u8]>,
    srcs: &[u64],
) -> BenchResult<()> {
    for (out, &src) in outs.into_iter().zip(srcs) {
        // SAFETY: a live host destination of `out.len()` bytes (pinned or pageable), a device
        // range of as many; synchronized before the borrow ends.
        check("cuMemcpyDtoHAsync", unsafe {
            call!(d.driver(), cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), src, out.len(), stream))
        })?;
    }
    sync(d, stream)
}

/// `cuStreamSynchronize` on `stream` of `d`'s context.
pub(crate) fn sync(d: &Device, stream: CUstream) -> BenchResult<()> {
    // SAFETY: the stream is live.
    check("cuStreamSynchronize", unsafe { call!(d.driver(), cuStreamSynchronize(stream)) })
}

/// One `cuMemcpyBatchAsync` over all copies on `stream`, host sources or destinations as
/// `host_to_device` says, then a synchronize.
pub(crate) fn memcpy_batch(
    d: &Device,
    stream: CUstream,
    dsts: &mut [u64],
    srcs: &mut [u64],
    sizes: &mut [usize],
    host_to_device: bool,
) -> BenchResult<()> {
    let host = cuda_sys::CUmemLocation { type_: cuda_sys::CU_MEM_LOCATION_TYPE_HOST, id: 0 };
    let dev =
        cuda_sys::CUmemLocation { type_: cuda_sys::CU_MEM_LOCATION_TYPE_DEVICE, id: d.info().ordinal as i32 };
    let (src_loc, dst_loc) = if host_to_device { (host, dev) } else { (dev, host) };
    let mut attrs = cuda_sys::CUmemcpyAttributes {
        srcAccessOrder: cuda_sys::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: src_loc,
        dstLocHint: dst_loc,
        flags: 0,
    };
    let mut idx = 0usize;
    // SAFETY: the arrays hold `count` entries naming valid host and device ranges that
    // outlive the synchronize below.
    check("cuMemcpyBatchAsync", unsafe {
        call!(
            d.driver(),
            cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                sizes.len(),
                &mut attrs,
                &mut idx,
                1,
                stream
            )
        )
    })?;
    sync(d, stream)
}

//! A caller's own stream on the device's context, for the GPU tests that order work against
//! one (`gpu_core.rs`, `gpu_interop.rs`, which include this file). GPU only: not part of
//! `common/mod.rs`, which the crate's tests on the model driver include too.

use cuda_resident::Device;
use cuda_resident::cuda_sys::{self, CUDA_SUCCESS, call};

/// A non-blocking stream of the device's context, as a caller's runtime would make (the
/// context is current afterwards).
pub fn caller_stream(device: &Device) -> cuda_sys::CUstream {
    device.make_current().unwrap();
    let mut stream: cuda_sys::CUstream = std::ptr::null_mut();
    // SAFETY: writes one handle; the device's context is current.
    let code =
        unsafe { call!(device.driver(), cuStreamCreate(&mut stream, cuda_sys::CU_STREAM_NON_BLOCKING)) };
    assert_eq!(code.unwrap(), CUDA_SUCCESS);
    stream
}

/// Waits for a stream from [`caller_stream`] and destroys it.
pub fn finish_stream(device: &Device, stream: cuda_sys::CUstream) {
    // SAFETY: a live stream of the device's context, destroyed once.
    unsafe {
        assert_eq!(call!(device.driver(), cuStreamSynchronize(stream)).unwrap(), CUDA_SUCCESS);
        assert_eq!(call!(device.driver(), cuStreamDestroy_v2(stream)).unwrap(), CUDA_SUCCESS);
    }
}

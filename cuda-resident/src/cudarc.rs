//! Working beside [cudarc](https://docs.rs/cudarc) (feature `cudarc`).
//!
//! # One context, two crates
//!
//! A [`Device`] retains the GPU's *primary* context, and so does cudarc's
//! [`CudaContext::new(ordinal)`](driver::CudaContext::new): both crates work in the same
//! context, so device pointers, streams and events of one are valid in the other. Both load
//! the driver library at run time (cudarc with its `dynamic-loading` or
//! `fallback-dynamic-loading` feature): the process has one driver, whichever crate loaded it
//! first (cudarc looks for it by its default names: `CUDA_SYS_LIBCUDA` does not steer it, so
//! point both at one driver). Open the [`Device`] first: it fails with an error when there is
//! no driver, where cudarc panics.
//!
//! # Choosing cudarc's CUDA version and linking
//!
//! This feature asks cudarc for its driver API alone (`driver`, `std`) and chooses neither a
//! CUDA version nor how cudarc finds the driver: your application's own cudarc dependency
//! does, and Cargo unifies the two. cudarc needs one CUDA version to build:
//!
//! ```toml
//! [dependencies]
//! cuda-resident = { version = "0.1", features = ["cudarc"] }
//! # One CUDA version (or `cuda-version-from-build-system`, or CUDARC_CUDA_VERSION=12080 in
//! # the build's environment), and NVRTC if you compile kernels at run time.
//! cudarc = { version = "0.19", default-features = false, features = ["std", "driver", "nvrtc", "cuda-12080"] }
//! ```
//!
//! Without a linking feature cudarc loads the driver at run time (its
//! `fallback-dynamic-loading`, which this feature asks for); an application that links
//! cudarc against `libcuda` adds `dynamic-linking` (or `static-linking`) to its own cudarc
//! dependency, and that choice wins. This crate's own driver calls are loaded at run time
//! whatever cudarc does.
//!
//! This module adds, with cudarc's own types and no casts at the call site:
//! - [`Fence::make_cudarc_stream_wait`]: a cudarc stream waits, on the GPU, for copies of
//!   this crate (a kernel reads what an upload brought);
//! - [`Device::wait_for_cudarc_stream`]: this device's copies wait, on the GPU, for the work
//!   enqueued so far on a cudarc stream (a download reads what a kernel wrote);
//! - [`ResidentView`] ([`Device::cudarc_view`]): a typed, non-owning view of a
//!   [`ResidentBuffer`] that cudarc's launch builder takes as a kernel argument
//!   ([`PushKernelArg`]) and its other APIs (NCCL's collectives among them) as device memory
//!   ([`DevicePtr`] / [`DevicePtrMut`]).
//!
//! Neither crate waits on the host for the other: the ordering is events on the GPU, both
//! ways. cudarc's own tracking of reads and writes (for its `CudaSlice`s) does not see this
//! crate's copies: order them with the two calls above.
//!
//! cudarc's driver API is re-exported here as [`driver`] (and `nccl` with the `nccl`
//! feature, which selects cudarc's NCCL 2.30 bindings), so that callers name the version this
//! crate is built against.
//!
//! `examples/with-cudarc.rs` uploads a batch, runs a cudarc kernel on it and downloads the
//! result, ordered on the GPU only.

use std::marker::PhantomData;
use std::sync::Arc;

use ::cudarc::driver::{
    CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, LaunchArgs, PushKernelArg, SyncOnDrop,
};

use crate::alloc::ResidentBuffer;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::fence::Fence;

/// cudarc's driver API (safe and raw), the version this crate is built against.
pub use ::cudarc::driver;
/// cudarc's NCCL binding (feature `nccl`; `libnccl` is loaded at run time). `docs/multi-gpu.md`
/// and `examples/nccl-allreduce.rs` hand resident buffers and fences to it.
#[cfg(feature = "nccl")]
#[cfg_attr(docsrs, doc(cfg(feature = "nccl")))]
pub use ::cudarc::nccl;

impl Fence {
    /// Makes a cudarc stream wait, on the GPU, for this work: kernels launched on `stream`
    /// afterwards see what the copies wrote, with no host wait. The safe form of
    /// [`Fence::make_stream_wait`].
    ///
    /// A `&CudaStream` is a live stream for as long as it is borrowed, and the wait is one
    /// `cuStreamWaitEvent`, which takes an event of any context or device: a stream of
    /// another GPU waits correctly too. Work enqueued on `stream` before this call is not
    /// affected.
    pub fn make_cudarc_stream_wait(&self, stream: &CudaStream) -> Result<()> {
        // SAFETY: the borrow keeps `stream` (and its context) alive through the call, and
        // cuStreamWaitEvent accepts a stream of any context for the fence's event.
        unsafe { self.make_stream_wait(stream.cu_stream().cast()) }
    }
}

impl Device {
    /// Makes this device's copies, submitted from now on, wait on the GPU for the work
    /// enqueued so far on a cudarc stream: a download after a kernel reads what the kernel
    /// wrote, with no host wait. The safe form of [`Device::wait_for_stream`]; what it does and
    /// does not cover is said there.
    ///
    /// Fails with [`Error::Interop`] when `stream` belongs to another context than this
    /// device's primary context (a stream of another GPU, or of a context that cudarc
    /// created rather than retained).
    pub fn wait_for_cudarc_stream(&self, stream: &CudaStream) -> Result<()> {
        self.check_cudarc_stream(stream)?;
        // SAFETY: `stream` is live while borrowed and, as just checked, of this device's
        // primary context.
        unsafe { self.wait_for_stream(stream.cu_stream().cast()) }
    }

    /// Makes this device's copies, submitted from now on, wait on the GPU for a cudarc event:
    /// for the work recorded before it. The safe form of [`Device::wait_for_event`]; an event
    /// of any context or device will do.
    pub fn wait_for_cudarc_event(&self, event: &CudaEvent) -> Result<()> {
        // SAFETY: `event` is live while borrowed (cudarc destroys it only when dropped), and
        // the lanes may wait on an event of any context.
        unsafe { self.wait_for_event(event.cu_event().cast()) }
    }

    /// A typed, non-owning view of `buffer` as `buffer_len / size_of::<T>()` elements of
    /// `T`, for cudarc kernel launches and APIs that take device memory. `stream` is the one
    /// cudarc's [`DeviceSlice::stream`] reports for it.
    ///
    /// Fails when `buffer` is not live on this device, when its length is not a whole number
    /// of `T`s (or `T` is zero-sized), or when `stream` is not of this device's primary
    /// context. Buffers are 256-byte aligned, so any `T` of alignment up to 256 is aligned.
    pub fn cudarc_view<'a, T>(
        &'a self,
        buffer: ResidentBuffer,
        stream: &'a Arc<CudaStream>,
    ) -> Result<ResidentView<'a, T>> {
        self.check_cudarc_stream(stream)?;
        let ptr = self.device_ptr(buffer)?;
        let bytes = self.buffer_len(buffer)?;
        let size = std::mem::size_of::<T>() as u64;
        if size == 0 || bytes % size != 0 || std::mem::align_of::<T>() > 256 {
            return Err(Error::Interop {
                what: format!(
                    "a buffer of {bytes} bytes is not a whole number of {} ({size} bytes, aligned to {})",
                    std::any::type_name::<T>(),
                    std::mem::align_of::<T>()
                ),
                fix: "view it as an element type whose size divides the buffer's length (u8 always does), \
                      or allocate a multiple of the element size; zero-sized types and alignments above 256 \
                      are not supported",
            });
        }
        let len = usize::try_from(bytes / size).map_err(|_| Error::Interop {
            what: format!("a buffer of {bytes} bytes has more elements than usize holds"),
            fix: "view it on a 64-bit host",
        })?;
        let guard = self.core().view_guard(buffer)?;
        Ok(ResidentView { ptr, len, stream, _guard: guard, _device: PhantomData, _elem: PhantomData })
    }

    /// Fails unless `stream` belongs to this device's primary context.
    fn check_cudarc_stream(&self, stream: &CudaStream) -> Result<()> {
        let theirs = stream.context().cu_ctx();
        let ours = self.cu_context();
        if theirs.cast::<()>() == ours.cast::<()>() {
            return Ok(());
        }
        Err(Error::Interop {
            what: format!(
                "the cudarc stream belongs to context {theirs:p} (device ordinal {}), not to device {}'s primary \
                 context {ours:p}",
                stream.context().ordinal(),
                self.info().ordinal
            ),
            fix: "make the stream from CudaContext::new(device.info().ordinal), which retains the same primary \
                  context",
        })
    }
}

/// A typed, non-owning view of a [`ResidentBuffer`] for cudarc: `len` elements of `T` at the
/// buffer's device address. Made by [`Device::cudarc_view`].
///
/// - As a kernel argument: `launch_builder(&f).arg(&view)` (or `&mut view` for a buffer the
///   kernel writes) passes the device pointer ([`PushKernelArg`]).
/// - As device memory for cudarc's APIs (copies, NCCL's collectives): [`DevicePtr`] and
///   [`DevicePtrMut`] give the address; nothing is recorded or waited on (cudarc does not
///   track this memory), so order the work with [`Fence::make_cudarc_stream_wait`] and
///   [`Device::wait_for_cudarc_stream`].
///
/// The view never frees anything: dropping it leaves the buffer's bytes as they are, and
/// only [`Device::free`] frees it, once. It borrows the [`Device`], so the device (and the
/// memory of its buffers) outlives it. While it lives, [`Device::free`] of its buffer fails
/// with [`Error::BufferViewed`]; its drop waits, on the host, until every stream of the
/// device's context and of its peers' is done (`cuCtxSynchronize`), so that no copy,
/// memset or collective enqueued through it (cudarc's are safe calls, on any stream) still
/// uses the memory once the buffer can be freed. Keep a view for as long as the work that
/// uses the buffer goes on, not one per call: its drop is a device-wide wait.
pub struct ResidentView<'a, T> {
    ptr: driver::sys::CUdeviceptr,
    len: usize,
    stream: &'a Arc<CudaStream>,
    _guard: crate::engine::core::ViewGuard,
    _device: PhantomData<&'a Device>,
    _elem: PhantomData<fn() -> T>,
}

impl<T> std::fmt::Debug for ResidentView<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResidentView").field("ptr", &self.ptr).field("len", &self.len).finish_non_exhaustive()
    }
}

impl<T> ResidentView<'_, T> {
    /// The device address of the first element.
    pub fn device_address(&self) -> u64 {
        self.ptr
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view has no elements (never, for a live buffer: buffers are at least one
    /// byte, and the element size divides the length).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<T> DeviceSlice<T> for ResidentView<'_, T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T> DevicePtr<T> for ResidentView<'_, T> {
    fn device_ptr<'b>(&'b self, _stream: &'b CudaStream) -> (driver::sys::CUdeviceptr, SyncOnDrop<'b>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for ResidentView<'_, T> {
    fn device_ptr_mut<'b>(
        &'b mut self,
        _stream: &'b CudaStream,
    ) -> (driver::sys::CUdeviceptr, SyncOnDrop<'b>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

// SAFETY: the argument pushed is a pointer to the view's `CUdeviceptr`, a `u64` that lives
// as long as the borrow `'b`, which outlives the builder (`'b: 'a`): the kernel parameter a
// `T*` expects.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b ResidentView<'_, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b ResidentView<'_, T>) -> &mut Self {
        self.arg(&arg.ptr)
    }
}

// SAFETY: as for `&ResidentView`.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut ResidentView<'_, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut ResidentView<'_, T>) -> &mut Self {
        self.arg(&arg.ptr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_view_is_an_address_a_length_and_borrows() {
        assert_eq!(std::mem::size_of::<driver::sys::CUdeviceptr>(), 8);
        fn send_sync<X: Send + Sync>() {}
        send_sync::<ResidentView<'_, f32>>();
    }

    #[test]
    fn the_interop_error_ends_with_its_fix() {
        let e = Error::Interop {
            what: "a buffer of 10 bytes is not a whole number of f32".into(),
            fix: "view it as u8",
        };
        let text = e.to_string();
        assert!(text.contains("10 bytes"), "{text}");
        assert!(text.ends_with("Fix: view it as u8."), "{text}");
    }
}

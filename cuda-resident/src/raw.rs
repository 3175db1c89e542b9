//! Each driver entry point this crate uses, wrapped once: a typed result, the entry point's
//! name in the error. Everything above this module is safe code over these calls.
//!
//! The wrappers do not make a context current: callers that need one call
//! [`Raw::set_current`] once per operation.

use std::ffi::CStr;
use std::os::raw::{c_char, c_int, c_void};
use std::sync::Arc;

use cuda_sys::*;

use crate::error::{Result, driver_error};

/// Calls `$entry` through the driver table and turns a non-success code into [`Error`].
macro_rules! cu {
    ($raw:expr, $entry:ident ( $($arg:expr),* $(,)? )) => {
        $raw.check(::core::stringify!($entry), cuda_sys::call!($raw.driver, $entry($($arg),*)))
    };
}

/// Runs a release step, and once more if it fails: for teardown, where no error can be
/// returned and one refused call must not leak what it was releasing.
///
/// The release calls retried this way (`cuMemFree`, `cuMemFreeHost`, `cuEventDestroy`,
/// `cuStreamDestroy`, `cuModuleUnload`, `cuDevicePrimaryCtxRelease`) are not idempotent, and
/// the driver documents that they may also return the error of an earlier asynchronous
/// launch. Such errors are sticky (the context is lost and every later call fails, the
/// retry included), so a retry does not release twice; a refusal that is not sticky (out of
/// resources, an injected fault) did not release, and the retry does.
pub(crate) fn release_retrying(mut step: impl FnMut() -> Result<()>) -> Result<()> {
    step().or_else(|_| step())
}

/// The driver, shared.
#[derive(Clone, Debug)]
pub(crate) struct Raw {
    pub(crate) driver: Arc<Driver>,
}

impl Raw {
    pub(crate) fn new(driver: Arc<Driver>) -> Raw {
        Raw { driver }
    }

    fn check(&self, entry: &'static str, result: Result<CUresult, MissingSymbol>) -> Result<()> {
        match result? {
            CUDA_SUCCESS => Ok(()),
            code => Err(driver_error(&self.driver, entry, code)),
        }
    }

    pub(crate) fn init(&self) -> Result<()> {
        // SAFETY: no pointer arguments.
        unsafe { cu!(self, cuInit(0)) }
    }

    pub(crate) fn device_count(&self) -> Result<usize> {
        let mut count: c_int = 0;
        // SAFETY: writes one int.
        unsafe { cu!(self, cuDeviceGetCount(&mut count)) }?;
        Ok(count.max(0) as usize)
    }

    pub(crate) fn device_get(&self, ordinal: c_int) -> Result<CUdevice> {
        let mut device: CUdevice = 0;
        // SAFETY: writes one handle.
        unsafe { cu!(self, cuDeviceGet(&mut device, ordinal)) }?;
        Ok(device)
    }

    pub(crate) fn device_name(&self, device: CUdevice) -> Result<String> {
        let mut name = [0 as c_char; 256];
        // SAFETY: the buffer holds the 256 bytes the call is told about.
        unsafe { cu!(self, cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, device)) }?;
        // SAFETY: the driver wrote a NUL-terminated string into the buffer.
        Ok(unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned())
    }

    pub(crate) fn device_pci_bus_id(&self, device: CUdevice) -> Result<String> {
        let mut id = [0 as c_char; 64];
        // SAFETY: the buffer holds the 64 bytes the call is told about.
        unsafe { cu!(self, cuDeviceGetPCIBusId(id.as_mut_ptr(), id.len() as c_int, device)) }?;
        // SAFETY: NUL-terminated, as above.
        Ok(unsafe { CStr::from_ptr(id.as_ptr()) }.to_string_lossy().into_owned())
    }

    pub(crate) fn device_total_mem(&self, device: CUdevice) -> Result<u64> {
        let mut bytes = 0usize;
        // SAFETY: writes one size.
        unsafe { cu!(self, cuDeviceTotalMem_v2(&mut bytes, device)) }?;
        Ok(bytes as u64)
    }

    pub(crate) fn device_attribute(&self, device: CUdevice, attribute: CUdevice_attribute) -> Result<i32> {
        let mut value: c_int = 0;
        // SAFETY: writes one int.
        unsafe { cu!(self, cuDeviceGetAttribute(&mut value, attribute, device)) }?;
        Ok(value)
    }

    pub(crate) fn primary_ctx_retain(&self, device: CUdevice) -> Result<CUcontext> {
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: writes one handle.
        unsafe { cu!(self, cuDevicePrimaryCtxRetain(&mut ctx, device)) }?;
        Ok(ctx)
    }

    pub(crate) fn primary_ctx_release(&self, device: CUdevice) -> Result<()> {
        // SAFETY: releases one reference taken by primary_ctx_retain.
        unsafe { cu!(self, cuDevicePrimaryCtxRelease_v2(device)) }
    }

    /// Makes `ctx` current on the calling thread. Cheap when it already is.
    pub(crate) fn set_current(&self, ctx: CUcontext) -> Result<()> {
        // SAFETY: ctx is a live context retained by the caller.
        unsafe { cu!(self, cuCtxSetCurrent(ctx)) }
    }

    /// Whether host address `ptr` lies in pinned memory (allocated by `cuMemHostAlloc` or
    /// registered), and if so the extent `(start, bytes)` of the allocation it lies in, as far
    /// as the driver tells (`bytes` is 0 when it does not). One call:
    /// `cuPointerGetAttributes` (unlike `cuPointerGetAttribute`) answers an address the
    /// driver has never seen with success and a memory type of 0, so the check makes no
    /// failing call (which tools such as compute-sanitizer would report).
    pub(crate) fn pinned_extent(&self, ptr: *const u8) -> Result<Option<(u64, u64)>> {
        let (mut kind, mut start, mut bytes): (std::os::raw::c_uint, CUdeviceptr, usize) = (0, 0, 0);
        let mut attributes = [
            CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        ];
        let mut data = [
            (&raw mut kind).cast::<c_void>(),
            (&raw mut start).cast::<c_void>(),
            (&raw mut bytes).cast::<c_void>(),
        ];
        // SAFETY: three attributes, each output of its attribute's type (CUmemorytype,
        // CUdeviceptr, size_t); the address is only looked up, never dereferenced.
        unsafe {
            cu!(
                self,
                cuPointerGetAttributes(
                    attributes.len() as std::os::raw::c_uint,
                    attributes.as_mut_ptr(),
                    data.as_mut_ptr(),
                    ptr as CUdeviceptr
                )
            )
        }?;
        Ok((kind == CU_MEMORYTYPE_HOST).then_some((start, bytes as u64)))
    }

    /// `(free, total)` bytes of device memory, as the driver sees them now.
    pub(crate) fn mem_get_info(&self) -> Result<(u64, u64)> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: writes two sizes; needs a current context.
        unsafe { cu!(self, cuMemGetInfo_v2(&mut free, &mut total)) }?;
        Ok((free as u64, total as u64))
    }

    pub(crate) fn mem_alloc(&self, bytes: u64) -> Result<CUdeviceptr> {
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: writes one device pointer; needs a current context.
        unsafe { cu!(self, cuMemAlloc_v2(&mut ptr, bytes as usize)) }?;
        Ok(ptr)
    }

    pub(crate) fn mem_free(&self, ptr: CUdeviceptr) -> Result<()> {
        // SAFETY: ptr came from mem_alloc and is freed once; callers ensure no copy uses it.
        unsafe { cu!(self, cuMemFree_v2(ptr)) }
    }

    /// Page-locked host memory, portable (usable by every context), not write-combined.
    pub(crate) fn mem_host_alloc(&self, bytes: u64) -> Result<*mut u8> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        unsafe { cu!(self, cuMemHostAlloc(&mut ptr, bytes as usize, CU_MEMHOSTALLOC_PORTABLE)) }?;
        Ok(ptr.cast())
    }

    /// # Safety
    /// `ptr` came from [`Raw::mem_host_alloc`], is freed once, and no copy uses it any more.
    pub(crate) unsafe fn mem_free_host(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: as the caller promises.
        unsafe { cu!(self, cuMemFreeHost(ptr.cast())) }
    }

    /// Registers `[ptr, ptr + len)`, portable, with `flags` besides
    /// (`CU_MEMHOSTREGISTER_DEVICEMAP`, say).
    ///
    /// # Safety
    /// `[ptr, ptr + len)` is host memory that stays mapped until unregistered.
    pub(crate) unsafe fn mem_host_register(&self, ptr: *mut u8, len: usize, flags: u32) -> Result<()> {
        let flags = CU_MEMHOSTREGISTER_PORTABLE | flags;
        // SAFETY: as the caller promises.
        unsafe { cu!(self, cuMemHostRegister_v2(ptr.cast(), len, flags)) }
    }

    /// # Safety
    /// `ptr` was registered by [`Raw::mem_host_register`] and no copy uses it any more.
    pub(crate) unsafe fn mem_host_unregister(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: as the caller promises.
        unsafe { cu!(self, cuMemHostUnregister(ptr.cast())) }
    }

    pub(crate) fn stream_create_non_blocking(&self) -> Result<CUstream> {
        let mut stream: CUstream = std::ptr::null_mut();
        // SAFETY: writes one handle; needs a current context.
        unsafe { cu!(self, cuStreamCreate(&mut stream, CU_STREAM_NON_BLOCKING)) }?;
        Ok(stream)
    }

    pub(crate) fn stream_destroy(&self, stream: CUstream) -> Result<()> {
        // SAFETY: stream is live and destroyed once.
        unsafe { cu!(self, cuStreamDestroy_v2(stream)) }
    }

    pub(crate) fn stream_synchronize(&self, stream: CUstream) -> Result<()> {
        // SAFETY: stream is live.
        unsafe { cu!(self, cuStreamSynchronize(stream)) }
    }

    pub(crate) fn stream_wait_event(&self, stream: CUstream, event: CUevent) -> Result<()> {
        // SAFETY: both handles are live (the caller's stream is the caller's promise).
        unsafe { cu!(self, cuStreamWaitEvent(stream, event, 0)) }
    }

    /// Enqueues `callback` on `stream`: the driver calls it on a thread of its own, with
    /// `data`, once the work enqueued before it has completed, or with the error code when
    /// that work failed (`cuStreamAddCallback`, which unlike `cuLaunchHostFunc` also calls
    /// back after an error). The callback must not call the driver.
    ///
    /// # Safety
    ///
    /// `stream` is live; `callback` may be called with `data` from another thread, once.
    pub(crate) unsafe fn stream_add_callback(
        &self,
        stream: CUstream,
        callback: CUstreamCallback,
        data: *mut c_void,
    ) -> Result<()> {
        // SAFETY: the caller's promises above.
        unsafe { cu!(self, cuStreamAddCallback(stream, callback, data, 0)) }
    }

    pub(crate) fn event_create(&self) -> Result<CUevent> {
        let mut event: CUevent = std::ptr::null_mut();
        // SAFETY: writes one handle; needs a current context.
        unsafe { cu!(self, cuEventCreate(&mut event, CU_EVENT_DISABLE_TIMING)) }?;
        Ok(event)
    }

    pub(crate) fn event_destroy(&self, event: CUevent) -> Result<()> {
        // SAFETY: event is live and destroyed once.
        unsafe { cu!(self, cuEventDestroy_v2(event)) }
    }

    pub(crate) fn event_record(&self, event: CUevent, stream: CUstream) -> Result<()> {
        // SAFETY: both handles are live.
        unsafe { cu!(self, cuEventRecord(event, stream)) }
    }

    /// `Ok(true)` when all work captured by the event has completed.
    pub(crate) fn event_query(&self, event: CUevent) -> Result<bool> {
        // SAFETY: event is live.
        match unsafe { cuda_sys::call!(self.driver, cuEventQuery(event)) }? {
            CUDA_SUCCESS => Ok(true),
            CUDA_ERROR_NOT_READY => Ok(false),
            code => Err(driver_error(&self.driver, "cuEventQuery", code)),
        }
    }

    pub(crate) fn event_synchronize(&self, event: CUevent) -> Result<()> {
        // SAFETY: event is live.
        unsafe { cu!(self, cuEventSynchronize(event)) }
    }

    /// # Safety
    /// `[src, src + len)` is readable host memory that stays valid (and, for the copy to be
    /// asynchronous, pinned) until the stream reaches this copy; `dst` is device memory of at
    /// least `len` bytes.
    pub(crate) unsafe fn memcpy_htod_async(
        &self,
        dst: CUdeviceptr,
        src: *const u8,
        len: usize,
        stream: CUstream,
    ) -> Result<()> {
        // SAFETY: as the caller promises.
        unsafe { cu!(self, cuMemcpyHtoDAsync_v2(dst, src.cast(), len, stream)) }
    }

    /// # Safety
    /// `[dst, dst + len)` is writable host memory that stays valid (and pinned) until the
    /// stream reaches this copy, and nothing reads it before then; `src` is device memory of
    /// at least `len` bytes.
    pub(crate) unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut u8,
        src: CUdeviceptr,
        len: usize,
        stream: CUstream,
    ) -> Result<()> {
        // SAFETY: as the caller promises.
        unsafe { cu!(self, cuMemcpyDtoHAsync_v2(dst.cast(), src, len, stream)) }
    }

    /// One `cuMemcpyBatchAsync`: `sizes[i]` bytes from `srcs[i]` to `dsts[i]` for every `i`,
    /// host to device memory of device `ordinal` (`to_device`) or back, each source read in
    /// stream order. The copies run in no set order among themselves.
    ///
    /// # Safety
    /// The three slices are as long; each copy is as [`Raw::memcpy_htod_async`] or
    /// [`Raw::memcpy_dtoh_async`] asks; no two destinations overlap.
    pub(crate) unsafe fn memcpy_batch_async(
        &self,
        (dsts, srcs, sizes): (&mut [u64], &mut [u64], &mut [usize]),
        to_device: bool,
        ordinal: i32,
        stream: CUstream,
    ) -> Result<()> {
        debug_assert!(dsts.len() == sizes.len() && srcs.len() == sizes.len());
        let host = CUmemLocation { type_: CU_MEM_LOCATION_TYPE_HOST, id: 0 };
        let device = CUmemLocation { type_: CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal };
        let (src_hint, dst_hint) = if to_device { (host, device) } else { (device, host) };
        let mut attrs = CUmemcpyAttributes {
            srcAccessOrder: CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: src_hint,
            dstLocHint: dst_hint,
            flags: 0,
        };
        let mut first = 0usize;
        // SAFETY: three arrays of `sizes.len()` entries naming copies as the caller promises;
        // one attribute for them all, from the first.
        unsafe {
            cu!(
                self,
                cuMemcpyBatchAsync_v2(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    sizes.len(),
                    &mut attrs,
                    &mut first,
                    1,
                    stream
                )
            )
        }
    }

    /// # Safety
    /// `src` (memory of `src_ctx`) and `dst` (memory of `dst_ctx`) hold at least `len` bytes
    /// each, valid until the stream reaches this copy.
    pub(crate) unsafe fn memcpy_peer_async(
        &self,
        dst: (CUdeviceptr, CUcontext),
        src: (CUdeviceptr, CUcontext),
        len: usize,
        stream: CUstream,
    ) -> Result<()> {
        // SAFETY: as the caller promises.
        unsafe { cu!(self, cuMemcpyPeerAsync(dst.0, dst.1, src.0, src.1, len, stream)) }
    }

    /// Whether kernels on `device` can access memory of `peer` once peer access is enabled.
    pub(crate) fn device_can_access_peer(&self, device: CUdevice, peer: CUdevice) -> Result<bool> {
        let mut can: c_int = 0;
        // SAFETY: writes one int.
        unsafe { cu!(self, cuDeviceCanAccessPeer(&mut can, device, peer)) }?;
        Ok(can != 0)
    }

    /// Lets the current context access memory of `peer`. Enabling twice is not an error.
    pub(crate) fn ctx_enable_peer_access(&self, peer: CUcontext) -> Result<()> {
        // SAFETY: peer is a live context; needs a current context.
        match unsafe { cuda_sys::call!(self.driver, cuCtxEnablePeerAccess(peer, 0)) }? {
            CUDA_SUCCESS | CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
            code => Err(driver_error(&self.driver, "cuCtxEnablePeerAccess", code)),
        }
    }

    /// Waits until every stream of the current context is done (`cuCtxSynchronize`).
    #[cfg(any(feature = "cudarc", test))]
    pub(crate) fn ctx_synchronize(&self) -> Result<()> {
        // SAFETY: no arguments; needs a current context.
        unsafe { cu!(self, cuCtxSynchronize()) }
    }

    /// Takes back the current context's access to memory of `peer`.
    pub(crate) fn ctx_disable_peer_access(&self, peer: CUcontext) -> Result<()> {
        // SAFETY: peer is a live context; needs a current context.
        unsafe { cu!(self, cuCtxDisablePeerAccess(peer)) }
    }

    /// Loads a module from NUL-terminated PTX (JIT-compiled by the driver for this GPU).
    pub(crate) fn module_load_data(&self, ptx: &CStr) -> Result<CUmodule> {
        let mut module: CUmodule = std::ptr::null_mut();
        // SAFETY: ptx is NUL-terminated and outlives the call; needs a current context.
        unsafe { cu!(self, cuModuleLoadData(&mut module, ptx.as_ptr().cast())) }?;
        Ok(module)
    }

    pub(crate) fn module_unload(&self, module: CUmodule) -> Result<()> {
        // SAFETY: module is live and unloaded once, after its kernels' last use.
        unsafe { cu!(self, cuModuleUnload(module)) }
    }

    pub(crate) fn module_get_function(&self, module: CUmodule, name: &CStr) -> Result<CUfunction> {
        let mut function: CUfunction = std::ptr::null_mut();
        // SAFETY: writes one handle; name is NUL-terminated.
        unsafe { cu!(self, cuModuleGetFunction(&mut function, module, name.as_ptr())) }?;
        Ok(function)
    }

    /// Launches `function` on a 1-D grid.
    ///
    /// # Safety
    /// `params` must point to the kernel's arguments, each of the type and size the kernel
    /// declares, and every pointer they hold must be valid for what the kernel does with it
    /// until the stream reaches the launch.
    pub(crate) unsafe fn launch(
        &self,
        function: CUfunction,
        grid: u32,
        block: u32,
        stream: CUstream,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: as the caller promises.
        unsafe {
            cu!(
                self,
                cuLaunchKernel(
                    function,
                    grid,
                    1,
                    1,
                    block,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut()
                )
            )
        }
    }
}

//! A driver for CPU tests: the entry points of contexts, streams, events and pinned memory,
//! written in Rust and installed into a real [`Driver`]'s table (loaded from libc, which
//! has none of them), over a model GPU whose work completes only when the test says so or
//! when the host waits for it.
//!
//! The model is per thread (each test runs the code under test on its own thread): one
//! counter of recorded work, one of completed work. Recording an event is a unit of work;
//! the event is complete once the completed count reaches it. `cuEventSynchronize` and
//! `cuStreamSynchronize` complete work up to the event, or all of it, as a host wait would.
//! Faults are injected through the driver's own [`Faults`](cuda_sys::Faults).

use std::cell::RefCell;
use std::collections::HashMap;
use std::os::raw::{c_uint, c_void};
use std::sync::Arc;

use cuda_sys::*;

use crate::context::Context;
use crate::raw::Raw;

/// The model GPU of the calling thread.
#[derive(Default)]
pub(crate) struct FakeGpu {
    next_handle: usize,
    recorded: u64,
    completed: u64,
    /// Per live event, the work position of its last record (`None`: never recorded).
    events: HashMap<usize, Option<u64>>,
    /// Pinned allocations: address -> length.
    pinned: HashMap<usize, usize>,
    /// Events the host waited on with `cuEventSynchronize`, in order.
    pub(crate) event_waits: Vec<usize>,
    /// `cuStreamSynchronize` calls that succeeded.
    pub(crate) stream_syncs: u64,
}

thread_local! {
    static GPU: RefCell<FakeGpu> = RefCell::default();
}

/// Runs `f` on this thread's model GPU.
pub(crate) fn with<R>(f: impl FnOnce(&mut FakeGpu) -> R) -> R {
    GPU.with(|gpu| f(&mut gpu.borrow_mut()))
}

/// Completes every piece of work recorded so far, as the GPU would in its own time.
pub(crate) fn complete_all() {
    with(|g| g.completed = g.recorded);
}

/// The handle a test sees for `event` (its address as a number).
pub(crate) fn id(event: CUevent) -> usize {
    event as usize
}

fn handle(g: &mut FakeGpu) -> usize {
    g.next_handle += 1;
    // Non-null and distinct from every pinned address.
    g.next_handle << 4
}

unsafe extern "C" fn ctx_set_current(_ctx: CUcontext) -> CUresult {
    CUDA_SUCCESS
}

unsafe extern "C" fn primary_ctx_retain(pctx: *mut CUcontext, _dev: CUdevice) -> CUresult {
    // SAFETY: the caller passes a valid pointer, as the driver requires.
    unsafe { *pctx = 0x1000 as CUcontext };
    CUDA_SUCCESS
}

unsafe extern "C" fn primary_ctx_release(_dev: CUdevice) -> CUresult {
    CUDA_SUCCESS
}

unsafe extern "C" fn stream_create(stream: *mut CUstream, _flags: c_uint) -> CUresult {
    let h = with(handle);
    // SAFETY: as above.
    unsafe { *stream = h as CUstream };
    CUDA_SUCCESS
}

unsafe extern "C" fn stream_destroy(_stream: CUstream) -> CUresult {
    CUDA_SUCCESS
}

unsafe extern "C" fn stream_synchronize(_stream: CUstream) -> CUresult {
    with(|g| {
        g.completed = g.recorded;
        g.stream_syncs += 1;
    });
    CUDA_SUCCESS
}

unsafe extern "C" fn stream_wait_event(_stream: CUstream, _event: CUevent, _flags: c_uint) -> CUresult {
    CUDA_SUCCESS
}

unsafe extern "C" fn event_create(event: *mut CUevent, _flags: c_uint) -> CUresult {
    let h = with(|g| {
        let h = handle(g);
        g.events.insert(h, None);
        h
    });
    // SAFETY: as above.
    unsafe { *event = h as CUevent };
    CUDA_SUCCESS
}

unsafe extern "C" fn event_record(event: CUevent, _stream: CUstream) -> CUresult {
    with(|g| match g.events.get_mut(&id(event)) {
        Some(at) => {
            g.recorded += 1;
            *at = Some(g.recorded);
            CUDA_SUCCESS
        }
        None => CUDA_ERROR_INVALID_HANDLE,
    })
}

unsafe extern "C" fn event_query(event: CUevent) -> CUresult {
    with(|g| match g.events.get(&id(event)) {
        Some(Some(at)) if *at > g.completed => CUDA_ERROR_NOT_READY,
        Some(_) => CUDA_SUCCESS,
        None => CUDA_ERROR_INVALID_HANDLE,
    })
}

unsafe extern "C" fn event_synchronize(event: CUevent) -> CUresult {
    with(|g| match g.events.get(&id(event)).copied() {
        Some(at) => {
            g.completed = g.completed.max(at.unwrap_or(0));
            g.event_waits.push(id(event));
            CUDA_SUCCESS
        }
        None => CUDA_ERROR_INVALID_HANDLE,
    })
}

unsafe extern "C" fn event_destroy(event: CUevent) -> CUresult {
    with(|g| if g.events.remove(&id(event)).is_some() { CUDA_SUCCESS } else { CUDA_ERROR_INVALID_HANDLE })
}

unsafe extern "C" fn mem_host_alloc(pp: *mut *mut c_void, bytes: usize, _flags: c_uint) -> CUresult {
    let region = Box::into_raw(vec![0u8; bytes.max(1)].into_boxed_slice());
    with(|g| g.pinned.insert(region.cast::<u8>() as usize, bytes.max(1)));
    // SAFETY: as above.
    unsafe { *pp = region.cast() };
    CUDA_SUCCESS
}

unsafe extern "C" fn mem_free_host(p: *mut c_void) -> CUresult {
    match with(|g| g.pinned.remove(&(p as usize))) {
        Some(len) => {
            // SAFETY: the region came from mem_host_alloc above with this length, and is
            // freed once (it was just removed from the table).
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p.cast::<u8>(), len)) });
            CUDA_SUCCESS
        }
        None => CUDA_ERROR_INVALID_VALUE,
    }
}

/// A driver whose context, stream, event and pinned-memory entry points are the model's.
pub(crate) fn driver() -> Arc<Driver> {
    let mut driver = Driver::load_from("libc.so.6").expect("libc loads");
    // SAFETY: each function has the signature of the entry point it replaces and honours
    // its contract (outputs written on success, handles valid until destroyed).
    let api = unsafe { driver.api_mut() };
    api.cuCtxSetCurrent = Ok(ctx_set_current);
    api.cuDevicePrimaryCtxRetain = Ok(primary_ctx_retain);
    api.cuDevicePrimaryCtxRelease_v2 = Ok(primary_ctx_release);
    api.cuStreamCreate = Ok(stream_create);
    api.cuStreamDestroy_v2 = Ok(stream_destroy);
    api.cuStreamSynchronize = Ok(stream_synchronize);
    api.cuStreamWaitEvent = Ok(stream_wait_event);
    api.cuEventCreate = Ok(event_create);
    api.cuEventRecord = Ok(event_record);
    api.cuEventQuery = Ok(event_query);
    api.cuEventSynchronize = Ok(event_synchronize);
    api.cuEventDestroy_v2 = Ok(event_destroy);
    api.cuMemHostAlloc = Ok(mem_host_alloc);
    api.cuMemFreeHost = Ok(mem_free_host);
    Arc::new(driver)
}

/// A retained (model) primary context on `driver`.
pub(crate) fn context(driver: &Arc<Driver>) -> Arc<Context> {
    Arc::new(Context::retain(Raw::new(Arc::clone(driver)), 0).expect("the model retains"))
}

//! The model's driver entry points: contexts, devices, streams, events, memory, modules,
//! launches and copies, each a Rust `extern "C"` function over this thread's [`FakeGpu`],
//! installed into a real [`Driver`]'s table by [`driver`].

use super::*;

/// The model's primary context of `device`, and back.
fn context_of(device: CUdevice) -> CUcontext {
    (0x1000 + 0x100 * device as usize) as CUcontext
}

fn device_of(ctx: CUcontext) -> usize {
    (ctx as usize - 0x1000) / 0x100
}

unsafe extern "C" fn ctx_set_current(ctx: CUcontext) -> CUresult {
    with(|g| g.current = device_of(ctx));
    CUDA_SUCCESS
}

unsafe extern "C" fn primary_ctx_retain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    // SAFETY: the caller passes a valid pointer, as the driver requires.
    unsafe { *pctx = context_of(dev) };
    CUDA_SUCCESS
}

unsafe extern "C" fn device_can_access_peer(can: *mut c_int, dev: CUdevice, peer: CUdevice) -> CUresult {
    let yes = with(|g| !g.no_peer_path) && dev != peer;
    // SAFETY: as above.
    unsafe { *can = c_int::from(yes) };
    CUDA_SUCCESS
}

unsafe extern "C" fn ctx_enable_peer_access(peer: CUcontext, _flags: c_uint) -> CUresult {
    with(|g| {
        let pair = (g.current, device_of(peer));
        if g.no_peer_path || pair.0 == pair.1 {
            CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
        } else if g.peer_access.insert(pair) {
            CUDA_SUCCESS
        } else {
            CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
        }
    })
}

unsafe extern "C" fn ctx_disable_peer_access(peer: CUcontext) -> CUresult {
    with(|g| {
        let pair = (g.current, device_of(peer));
        if g.peer_access.remove(&pair) { CUDA_SUCCESS } else { CUDA_ERROR_PEER_ACCESS_NOT_ENABLED }
    })
}

unsafe extern "C" fn memcpy_peer(
    dst: CUdeviceptr,
    _dst_ctx: CUcontext,
    src: CUdeviceptr,
    _src_ctx: CUcontext,
    bytes: usize,
    stream: CUstream,
) -> CUresult {
    let (dst, src) = (dst as usize, src as usize);
    with(|g| {
        let ok = g.is_device(dst, bytes) && g.is_device(src, bytes);
        g.enqueue_copy(stream, (dst, src, bytes), ok, "device to device memory")
    })
}

unsafe extern "C" fn primary_ctx_release(_dev: CUdevice) -> CUresult {
    CUDA_SUCCESS
}

unsafe extern "C" fn stream_create(stream: *mut CUstream, _flags: c_uint) -> CUresult {
    let h = with(|g| {
        let h = handle(g);
        g.stream_device.insert(h, g.current);
        h
    });
    // SAFETY: as above.
    unsafe { *stream = h as CUstream };
    CUDA_SUCCESS
}

unsafe extern "C" fn stream_destroy(_stream: CUstream) -> CUresult {
    CUDA_SUCCESS
}

unsafe extern "C" fn stream_synchronize(stream: CUstream) -> CUresult {
    with(|g| {
        g.complete_to(stream as usize, g.position);
        g.stream_syncs += 1;
        g.sticky().unwrap_or(CUDA_SUCCESS)
    })
}

unsafe extern "C" fn ctx_synchronize() -> CUresult {
    with(|g| {
        let mine: Vec<usize> =
            g.stream_device.iter().filter(|&(_, &d)| d == g.current).map(|(&s, _)| s).collect();
        g.complete_streams(|s| mine.contains(&s));
        g.ctx_syncs += 1;
        g.sticky().unwrap_or(CUDA_SUCCESS)
    })
}

unsafe extern "C" fn stream_wait_event(stream: CUstream, event: CUevent, _flags: c_uint) -> CUresult {
    with(|g| match g.events.get(&id(event)).copied() {
        Some(Some((other, at))) => {
            if other != stream as usize {
                g.enqueue(stream, Op::Wait { stream: other, at });
            }
            CUDA_SUCCESS
        }
        Some(None) => CUDA_SUCCESS,
        None => CUDA_ERROR_INVALID_HANDLE,
    })
}

unsafe extern "C" fn stream_add_callback(
    stream: CUstream,
    callback: CUstreamCallback,
    data: *mut c_void,
    _flags: c_uint,
) -> CUresult {
    with(|g| g.enqueue(stream, Op::Callback { callback, data: data as usize }));
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

unsafe extern "C" fn event_record(event: CUevent, stream: CUstream) -> CUresult {
    with(|g| {
        if !g.events.contains_key(&id(event)) {
            return CUDA_ERROR_INVALID_HANDLE;
        }
        let at = g.next_position();
        g.streams.entry(stream as usize).or_default();
        g.events.insert(id(event), Some((stream as usize, at)));
        CUDA_SUCCESS
    })
}

unsafe extern "C" fn event_query(event: CUevent) -> CUresult {
    with(|g| match g.events.get(&id(event)) {
        _ if g.sticky().is_some() => CUDA_ERROR_ILLEGAL_ADDRESS,
        Some(Some((stream, at))) if !g.is_done(*stream, *at) => CUDA_ERROR_NOT_READY,
        Some(_) => CUDA_SUCCESS,
        None => CUDA_ERROR_INVALID_HANDLE,
    })
}

unsafe extern "C" fn event_synchronize(event: CUevent) -> CUresult {
    with(|g| match g.events.get(&id(event)).copied() {
        Some(recorded) => {
            if let Some((stream, at)) = recorded {
                g.complete_to(stream, at);
            }
            g.event_waits.push(id(event));
            g.sticky().unwrap_or(CUDA_SUCCESS)
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

unsafe extern "C" fn init(_flags: c_uint) -> CUresult {
    CUDA_SUCCESS
}

unsafe extern "C" fn device_get_count(count: *mut c_int) -> CUresult {
    // SAFETY: as above.
    unsafe { *count = 2 };
    CUDA_SUCCESS
}

unsafe extern "C" fn device_get(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    if !(0..2).contains(&ordinal) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    // SAFETY: as above.
    unsafe { *device = ordinal };
    CUDA_SUCCESS
}

/// Writes `text` NUL-terminated into `out` of `len` bytes.
unsafe fn write_str(out: *mut c_char, len: c_int, text: &str) -> CUresult {
    let bytes = text.as_bytes();
    if bytes.len() + 1 > len as usize {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller's buffer holds `len` bytes, more than the text and its NUL.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), out, bytes.len());
        *out.add(bytes.len()) = 0;
    }
    CUDA_SUCCESS
}

unsafe extern "C" fn device_get_name(name: *mut c_char, len: c_int, _dev: CUdevice) -> CUresult {
    // SAFETY: as the driver requires of the caller.
    unsafe { write_str(name, len, "Model GPU") }
}

unsafe extern "C" fn device_get_pci_bus_id(id: *mut c_char, len: c_int, _dev: CUdevice) -> CUresult {
    // SAFETY: as above.
    unsafe { write_str(id, len, "0000:00:00.0") }
}

/// The model's device memory.
const TOTAL: usize = 4 << 30;

unsafe extern "C" fn device_total_mem(bytes: *mut usize, _dev: CUdevice) -> CUresult {
    // SAFETY: as above.
    unsafe { *bytes = TOTAL };
    CUDA_SUCCESS
}

unsafe extern "C" fn device_get_attribute(
    pi: *mut c_int,
    attribute: CUdevice_attribute,
    _dev: CUdevice,
) -> CUresult {
    let value = match attribute {
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR => 9,
        CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT => 4,
        CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT => 2,
        CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED => 1,
        CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING => i32::from(!with(|g| g.no_unified_addressing)),
        CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED
        | CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM => {
            i32::from(with(|g| g.registers_host_memory))
        }
        _ => 0,
    };
    // SAFETY: as above.
    unsafe { *pi = value };
    CUDA_SUCCESS
}

/// Alignment of the model's device allocations, as the driver's (at least 256).
const DEVICE_ALIGN: usize = 4096;

unsafe extern "C" fn mem_alloc(dptr: *mut CUdeviceptr, bytes: usize) -> CUresult {
    let used: usize = with(|g| g.device.values().sum());
    if bytes == 0 || used + bytes > TOTAL {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    let layout = std::alloc::Layout::from_size_align(bytes, DEVICE_ALIGN).expect("a valid layout");
    // SAFETY: the layout has a non-zero size.
    let at = unsafe { std::alloc::alloc_zeroed(layout) };
    if at.is_null() {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    with(|g| {
        g.device.insert(at as usize, bytes);
        g.owner.insert(at as usize, g.current);
    });
    // SAFETY: as above.
    unsafe { *dptr = at as CUdeviceptr };
    CUDA_SUCCESS
}

unsafe extern "C" fn mem_free(dptr: CUdeviceptr) -> CUresult {
    match with(|g| {
        g.owner.remove(&(dptr as usize));
        g.device.remove(&(dptr as usize))
    }) {
        Some(bytes) => {
            let layout = std::alloc::Layout::from_size_align(bytes, DEVICE_ALIGN).expect("a valid layout");
            // SAFETY: allocated above with this layout, freed once (removed from the table).
            unsafe { std::alloc::dealloc(dptr as *mut u8, layout) };
            CUDA_SUCCESS
        }
        None => CUDA_ERROR_INVALID_VALUE,
    }
}

unsafe extern "C" fn mem_get_info(free: *mut usize, total: *mut usize) -> CUresult {
    let used: usize = with(|g| g.device.values().sum());
    // SAFETY: as above.
    unsafe {
        *free = TOTAL - used;
        *total = TOTAL;
    }
    CUDA_SUCCESS
}

unsafe extern "C" fn module_load_data(module: *mut CUmodule, _image: *const c_void) -> CUresult {
    let h = with(handle);
    // SAFETY: as above.
    unsafe { *module = h as CUmodule };
    CUDA_SUCCESS
}

unsafe extern "C" fn module_get_function(
    f: *mut CUfunction,
    _module: CUmodule,
    _name: *const c_char,
) -> CUresult {
    let h = with(handle);
    // SAFETY: as above.
    unsafe { *f = h as CUfunction };
    CUDA_SUCCESS
}

unsafe extern "C" fn module_unload(_module: CUmodule) -> CUresult {
    CUDA_SUCCESS
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn launch_kernel(
    _f: CUfunction,
    _gx: c_uint,
    _gy: c_uint,
    _gz: c_uint,
    _bx: c_uint,
    _by: c_uint,
    _bz: c_uint,
    _shared: c_uint,
    stream: CUstream,
    params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    // SAFETY: the copy kernel's parameters: a pointer to the table address, one to the count.
    let (table, count) = unsafe { (*(*params).cast::<u64>(), *(*params.add(1)).cast::<u64>()) };
    with(|g| g.enqueue(stream, Op::Kernel { table: table as usize, count }));
    CUDA_SUCCESS
}

unsafe extern "C" fn memcpy_htod(
    dst: CUdeviceptr,
    src: *const c_void,
    bytes: usize,
    stream: CUstream,
) -> CUresult {
    let (dst, src) = (dst as usize, src as usize);
    with(|g| {
        // Pageable memory, as the driver takes it: copied into its staging at the call. The
        // library hands the driver pageable bytes only for small blocking uploads; a larger
        // pageable source is a staging path gone wrong, refused below as not pinned.
        let small = bytes <= crate::transfer::single::DRIVER_STAGED_MOST;
        if small && g.is_device(dst, bytes) && !g.is_pinned(src, bytes) && !g.is_device(src, bytes) {
            // SAFETY: the code under test passes readable host memory of `bytes` bytes.
            let staged = unsafe { std::slice::from_raw_parts(src as *const u8, bytes) }.to_vec();
            g.pageable_uploads += 1;
            g.enqueue(stream, Op::Staged { dst, bytes: staged });
            return CUDA_SUCCESS;
        }
        let ok = g.is_device(dst, bytes) && g.is_pinned(src, bytes);
        g.enqueue_copy(stream, (dst, src, bytes), ok, "pinned host to device memory")
    })
}

unsafe extern "C" fn memcpy_dtoh(
    dst: *mut c_void,
    src: CUdeviceptr,
    bytes: usize,
    stream: CUstream,
) -> CUresult {
    let (dst, src) = (dst as usize, src as usize);
    with(|g| {
        let ok = g.is_device(src, bytes) && g.is_pinned(dst, bytes);
        g.enqueue_copy(stream, (dst, src, bytes), ok, "device to pinned host memory")
    })
}

/// `cuMemcpyBatchAsync`: every copy checked as the one-copy entry points check theirs, with
/// one attribute reading sources in stream order; a batch with a bad copy enqueues none.
/// The copies run in no set order, so the model runs them last to first, and a batch
/// whose destinations overlap is an illegal access.
unsafe extern "C" fn memcpy_batch(
    dsts: *mut CUdeviceptr,
    srcs: *mut CUdeviceptr,
    sizes: *mut usize,
    count: usize,
    attrs: *mut CUmemcpyAttributes,
    attrs_idxs: *mut usize,
    num_attrs: usize,
    stream: CUstream,
) -> CUresult {
    if count == 0 || num_attrs != 1 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller passes arrays of `count` entries and one attribute, as the driver
    // requires.
    let (dsts, srcs, sizes, attr, first) = unsafe {
        (
            std::slice::from_raw_parts(dsts, count),
            std::slice::from_raw_parts(srcs, count),
            std::slice::from_raw_parts(sizes, count),
            &*attrs,
            *attrs_idxs,
        )
    };
    if first != 0 || attr.srcAccessOrder != CU_MEMCPY_SRC_ACCESS_ORDER_STREAM {
        return CUDA_ERROR_INVALID_VALUE;
    }
    with(|g| {
        // The call takes host and device addresses as one type: without a unified address
        // space it cannot tell them apart.
        if g.no_unified_addressing {
            g.illegal("cuMemcpyBatchAsync without a unified address space".to_string());
            return CUDA_ERROR_INVALID_VALUE;
        }
        let mut ends: Vec<(usize, usize)> = Vec::with_capacity(count);
        for i in 0..count {
            let (dst, src, len) = (dsts[i] as usize, srcs[i] as usize, sizes[i]);
            let up = g.is_device(dst, len) && g.is_pinned(src, len);
            let down = g.is_device(src, len) && g.is_pinned(dst, len);
            if !(up || down) {
                g.illegal(format!(
                    "batched copy {i}: {src:#x} -> {dst:#x} ({len} bytes) between pinned and device memory"
                ));
                return CUDA_ERROR_INVALID_VALUE;
            }
            ends.push((dst, dst + len));
        }
        ends.sort_unstable();
        if ends.windows(2).any(|w| w[1].0 < w[0].1) {
            g.illegal("a batch of copies whose destinations overlap (they run in no set order)".to_string());
            return CUDA_ERROR_INVALID_VALUE;
        }
        for i in (0..count).rev() {
            g.enqueue(stream, Op::Copy { dst: dsts[i] as usize, src: srcs[i] as usize, len: sizes[i] });
        }
        g.batched_copies += count;
        CUDA_SUCCESS
    })
}

unsafe extern "C" fn host_register(p: *mut c_void, bytes: usize, _flags: c_uint) -> CUresult {
    with(|g| g.registered.insert(p as usize, bytes));
    CUDA_SUCCESS
}

unsafe extern "C" fn host_unregister(p: *mut c_void) -> CUresult {
    match with(|g| g.registered.remove(&(p as usize))) {
        Some(_) => CUDA_SUCCESS,
        None => CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
    }
}

unsafe extern "C" fn pointer_get_attributes(
    n: c_uint,
    attributes: *mut CUpointer_attribute,
    data: *mut *mut c_void,
    ptr: CUdeviceptr,
) -> CUresult {
    let at = ptr as usize;
    let range = with(|g| g.pinned_range(at));
    for i in 0..n as usize {
        // SAFETY: `n` attributes and as many outputs, each of its attribute's type.
        unsafe {
            let out = *data.add(i);
            match *attributes.add(i) {
                CU_POINTER_ATTRIBUTE_MEMORY_TYPE => {
                    *out.cast::<c_uint>() = if range.is_some() { CU_MEMORYTYPE_HOST } else { 0 }
                }
                CU_POINTER_ATTRIBUTE_RANGE_START_ADDR => {
                    *out.cast::<CUdeviceptr>() = range.map_or(0, |r| r.0 as u64)
                }
                CU_POINTER_ATTRIBUTE_RANGE_SIZE => *out.cast::<usize>() = range.map_or(0, |r| r.1),
                _ => return CUDA_ERROR_INVALID_VALUE,
            }
        }
    }
    CUDA_SUCCESS
}

/// A driver whose context, stream, event and pinned-memory entry points are the model's.
pub(crate) fn driver() -> Arc<Driver> {
    // SAFETY: libc's initialisers are sound (it is already loaded) and it exports no
    // driver entry point.
    let mut driver = unsafe { Driver::load_from("libc.so.6") }.expect("libc loads");
    // SAFETY: each function has the signature of the entry point it replaces and honours
    // its contract (outputs written on success, handles valid until destroyed).
    let api = unsafe { driver.api_mut() };
    api.cuCtxSetCurrent = Ok(ctx_set_current);
    api.cuDevicePrimaryCtxRetain = Ok(primary_ctx_retain);
    api.cuDevicePrimaryCtxRelease_v2 = Ok(primary_ctx_release);
    api.cuStreamCreate = Ok(stream_create);
    api.cuStreamDestroy_v2 = Ok(stream_destroy);
    api.cuStreamSynchronize = Ok(stream_synchronize);
    api.cuCtxSynchronize = Ok(ctx_synchronize);
    api.cuStreamWaitEvent = Ok(stream_wait_event);
    api.cuStreamAddCallback = Ok(stream_add_callback);
    api.cuEventCreate = Ok(event_create);
    api.cuEventRecord = Ok(event_record);
    api.cuEventQuery = Ok(event_query);
    api.cuEventSynchronize = Ok(event_synchronize);
    api.cuEventDestroy_v2 = Ok(event_destroy);
    api.cuMemHostAlloc = Ok(mem_host_alloc);
    api.cuMemFreeHost = Ok(mem_free_host);
    api.cuInit = Ok(init);
    api.cuDeviceGetCount = Ok(device_get_count);
    api.cuDeviceGet = Ok(device_get);
    api.cuDeviceGetName = Ok(device_get_name);
    api.cuDeviceGetPCIBusId = Ok(device_get_pci_bus_id);
    api.cuDeviceTotalMem_v2 = Ok(device_total_mem);
    api.cuDeviceGetAttribute = Ok(device_get_attribute);
    api.cuMemAlloc_v2 = Ok(mem_alloc);
    api.cuMemFree_v2 = Ok(mem_free);
    api.cuMemGetInfo_v2 = Ok(mem_get_info);
    api.cuModuleLoadData = Ok(module_load_data);
    api.cuModuleGetFunction = Ok(module_get_function);
    api.cuModuleUnload = Ok(module_unload);
    api.cuLaunchKernel = Ok(launch_kernel);
    api.cuMemcpyHtoDAsync_v2 = Ok(memcpy_htod);
    api.cuMemcpyDtoHAsync_v2 = Ok(memcpy_dtoh);
    api.cuMemcpyBatchAsync_v2 = Ok(memcpy_batch);
    api.cuMemHostRegister_v2 = Ok(host_register);
    api.cuMemHostUnregister = Ok(host_unregister);
    api.cuPointerGetAttributes = Ok(pointer_get_attributes);
    api.cuDeviceCanAccessPeer = Ok(device_can_access_peer);
    api.cuCtxEnablePeerAccess = Ok(ctx_enable_peer_access);
    api.cuCtxDisablePeerAccess = Ok(ctx_disable_peer_access);
    api.cuMemcpyPeerAsync = Ok(memcpy_peer);
    Arc::new(driver)
}

/// A retained (model) primary context on `driver`.
pub(crate) fn context(driver: &Arc<Driver>) -> Arc<Context> {
    Arc::new(Context::retain(Raw::new(Arc::clone(driver)), 0).expect("the model retains"))
}

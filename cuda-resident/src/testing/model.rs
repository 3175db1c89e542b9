//! A driver for CPU tests: the entry points of contexts, streams, events and pinned memory,
//! written in Rust and installed into a real [`Driver`]'s table (loaded from libc, which
//! has none of them), over a model GPU whose work completes only when the test says so or
//! when the host waits for it.
//!
//! The model is per thread (each test runs the code under test on its own thread). Each
//! stream has a queue of work (copies, kernel launches, waits for another stream's event),
//! carried out as late as the host allows: only when the host waits for an event or a
//! stream (`cuEventSynchronize`, `cuStreamSynchronize`), and then only that stream's work up
//! to that point, plus, through its waits, the other streams' work it was told to wait for.
//! So a copy whose staging was reused too early, or a read on one stream that was not told
//! to wait for a write on another, shows up as wrong bytes. Device memory is host memory at the address the model hands out; every
//! device range a copy or the kernel touches must lie in one allocation, and the host side
//! of every copy must be pinned (allocated or registered). A copy that breaks either is
//! refused at enqueue (`CUDA_ERROR_INVALID_VALUE`) or, found when carried out, skipped and
//! remembered: from then on every wait and query answers `CUDA_ERROR_ILLEGAL_ADDRESS`, as a
//! GPU's sticky error would. Each such finding is printed, for the failing test's output.
//!
//! Faults are injected through the driver's own [`Faults`](cuda_sys::Faults).

use std::cell::RefCell;
use std::collections::HashMap;
use std::os::raw::{c_char, c_int, c_uint, c_void};
use std::sync::Arc;

use cuda_sys::*;

use crate::context::Context;
use crate::raw::Raw;

/// Queued work.
enum Op {
    /// Carry out stream `stream`'s work up to position `at` first (`cuStreamWaitEvent`).
    Wait { stream: usize, at: u64 },
    /// `len` bytes from `src` to `dst` (either may be device or host memory).
    Copy { dst: usize, src: usize, len: usize },
    /// Bytes of pageable host memory to device memory at `dst`: the driver copies them into
    /// its own staging before `cuMemcpyHtoDAsync` returns, so they are read at the call.
    Staged { dst: usize, bytes: Vec<u8> },
    /// The copy kernel: `count` descriptors (`src, dst, len` as `u64`s) at device `table`.
    Kernel { table: usize, count: u64 },
    /// A host callback (`cuStreamAddCallback`), called with the model's sticky error or
    /// success. It must not call the driver (the model is borrowed while it runs).
    Callback { callback: CUstreamCallback, data: usize },
}

/// The model GPU of the calling thread.
#[derive(Default)]
pub(crate) struct FakeGpu {
    next_handle: usize,
    /// The last position handed out (work and event records share one numbering).
    position: u64,
    /// Per stream: work not yet carried out, with its position, and how far it is done.
    streams: HashMap<usize, StreamModel>,
    /// Device allocations: address -> length.
    device: std::collections::BTreeMap<usize, usize>,
    /// Registered host ranges: address -> length.
    registered: std::collections::BTreeMap<usize, usize>,
    /// Per live event, the stream and position of its last record (`None`: never recorded).
    events: HashMap<usize, Option<(usize, u64)>>,
    /// Pinned allocations: address -> length.
    pinned: std::collections::BTreeMap<usize, usize>,
    /// Events the host waited on with `cuEventSynchronize`, in order.
    pub(crate) event_waits: Vec<usize>,
    /// `cuStreamSynchronize` calls that succeeded.
    pub(crate) stream_syncs: u64,
    /// `cuCtxSynchronize` calls.
    pub(crate) ctx_syncs: u64,
    /// `cuMemcpyHtoDAsync` calls from pageable host memory (staged by the driver).
    pub(crate) pageable_uploads: u64,
    /// What the model found wrong (illegal accesses), in order.
    pub(crate) errors: Vec<String>,
    /// The model has two GPUs in one address space (as with unified addressing): the
    /// device of the calling thread's current context, of each stream and of each device
    /// allocation (by base address).
    current: usize,
    stream_device: HashMap<usize, usize>,
    owner: HashMap<usize, usize>,
    /// Pairs (device, peer) where `device` was given access to `peer`'s memory.
    pub(crate) peer_access: std::collections::HashSet<(usize, usize)>,
    /// Whether the GPUs lack a peer path (`cuDeviceCanAccessPeer` answers 0).
    pub(crate) no_peer_path: bool,
    /// Whether the GPUs lack unified addressing: then kernels cannot read pinned host
    /// memory (a descriptor table there is an illegal access).
    pub(crate) no_unified_addressing: bool,
}

thread_local! {
    /// Each thread's model GPU: its own, or another thread's after [`join`] (a test whose
    /// threads share one device).
    static GPU: RefCell<Arc<std::sync::Mutex<FakeGpu>>> = RefCell::default();
}

/// Runs `f` on this thread's model GPU (one driver call at a time, whichever thread makes it).
pub(crate) fn with<R>(f: impl FnOnce(&mut FakeGpu) -> R) -> R {
    let gpu = GPU.with(|gpu| Arc::clone(&gpu.borrow()));
    let mut g = crate::sync::lock(&gpu);
    f(&mut g)
}

/// This thread's model GPU, to share with other threads ([`join`]).
pub(crate) fn shared() -> Arc<std::sync::Mutex<FakeGpu>> {
    GPU.with(|gpu| Arc::clone(&gpu.borrow()))
}

/// Makes this thread use `gpu` (another thread's model GPU, from [`shared`]).
pub(crate) fn join(gpu: Arc<std::sync::Mutex<FakeGpu>>) {
    GPU.with(|g| *g.borrow_mut() = gpu);
}

/// One stream of the model.
#[derive(Default)]
struct StreamModel {
    queue: std::collections::VecDeque<(u64, Op)>,
    /// Every position up to this one is done.
    done: u64,
}

/// Completes every piece of work enqueued so far, as the GPU would in its own time.
pub(crate) fn complete_all() {
    with(|g| g.complete_streams(|_| true));
}

/// The range of `ranges` (address -> length) that holds address `at`.
fn range_of(ranges: &std::collections::BTreeMap<usize, usize>, at: usize) -> Option<(usize, usize)> {
    ranges.range(..=at).next_back().filter(|(base, n)| at < *base + *n).map(|(&base, &n)| (base, n))
}

/// Whether `[at, at + len)` lies inside one range (address, length).
fn inside(range: Option<(usize, usize)>, at: usize, len: usize) -> bool {
    range.is_some_and(|(base, n)| at + len <= base + n)
}

impl FakeGpu {
    fn is_device(&self, at: usize, len: usize) -> bool {
        inside(range_of(&self.device, at), at, len)
    }

    /// The pinned range (allocated or registered) that holds `at`.
    fn pinned_range(&self, at: usize) -> Option<(usize, usize)> {
        range_of(&self.pinned, at).or_else(|| range_of(&self.registered, at))
    }

    fn is_pinned(&self, at: usize, len: usize) -> bool {
        inside(self.pinned_range(at), at, len)
    }

    fn next_position(&mut self) -> u64 {
        self.position += 1;
        self.position
    }

    /// Queues a copy `(dst, src, len)` whose ranges passed their checks (`ok`), or refuses it
    /// as not `what` (a copy between which kinds of memory).
    fn enqueue_copy(
        &mut self,
        stream: CUstream,
        (dst, src, len): (usize, usize, usize),
        ok: bool,
        what: &str,
    ) -> CUresult {
        if !ok {
            self.illegal(format!("copy {src:#x} -> {dst:#x} ({len} bytes): not {what}"));
            return CUDA_ERROR_INVALID_VALUE;
        }
        self.enqueue(stream, Op::Copy { dst, src, len });
        CUDA_SUCCESS
    }

    /// Completes every piece of work enqueued so far on the streams `which` picks.
    fn complete_streams(&mut self, which: impl Fn(usize) -> bool) {
        let streams: Vec<usize> = self.streams.keys().copied().filter(|&s| which(s)).collect();
        let upto = self.position;
        for stream in streams {
            self.complete_to(stream, upto);
        }
    }

    fn enqueue(&mut self, stream: CUstream, op: Op) {
        // A copy or a launch goes to a stream of the context current on the calling thread,
        // as the driver requires of a launch (waits and callbacks name their stream alone).
        let moves = matches!(op, Op::Copy { .. } | Op::Staged { .. } | Op::Kernel { .. });
        if let Some(&device) = self.stream_device.get(&(stream as usize))
            && moves
            && device != self.current
        {
            let current = self.current;
            self.errors.push(format!(
                "work enqueued on a stream of device {device} while device {current}'s context is current"
            ));
        }
        let at = self.next_position();
        self.streams.entry(stream as usize).or_default().queue.push_back((at, op));
    }

    /// Whether `stream` is done up to `at`.
    fn is_done(&self, stream: usize, at: u64) -> bool {
        self.streams.get(&stream).is_none_or(|s| s.done >= at)
    }

    /// Carries out `stream`'s work up to position `position`, in order, and the other
    /// streams' work its waits name, first.
    fn complete_to(&mut self, stream: usize, position: u64) {
        loop {
            let Some(s) = self.streams.get_mut(&stream) else { return };
            if s.queue.front().is_none_or(|(at, _)| *at > position) {
                s.done = s.done.max(position);
                return;
            }
            let (_, op) = s.queue.pop_front().expect("checked");
            match op {
                Op::Wait { stream: other, at } => self.complete_to(other, at),
                Op::Copy { dst, src, len } => self.copy(dst, src, len),
                Op::Staged { dst, bytes } => self.copy(dst, bytes.as_ptr() as usize, bytes.len()),
                Op::Callback { callback, data } => {
                    let status = self.sticky().unwrap_or(CUDA_SUCCESS);
                    if let Some(callback) = callback {
                        // SAFETY: the callback and its data as the code under test enqueued them.
                        unsafe { callback(stream as CUstream, status, data as *mut c_void) };
                    }
                }
                Op::Kernel { table, count } => {
                    // Pinned host memory is mapped for every device with unified addressing.
                    let bytes = count as usize * 24;
                    let mapped = !self.no_unified_addressing && self.is_pinned(table, bytes);
                    if !self.is_device(table, bytes) && !mapped {
                        self.illegal(format!(
                            "descriptor table {table:#x} x {count} outside device and pinned memory"
                        ));
                        continue;
                    }
                    // The kernel's warps run in any order: destinations must not overlap.
                    let mut spans: Vec<(u64, u64)> = (0..count as usize)
                        .map(|i| {
                            // SAFETY: inside the table, checked above.
                            let [_, dst, len] =
                                unsafe { std::ptr::read_unaligned((table as *const [u64; 3]).add(i)) };
                            (dst, dst + len)
                        })
                        .filter(|&(a, b)| b > a)
                        .collect();
                    spans.sort_unstable();
                    if let Some(w) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
                        self.illegal(format!("kernel destinations overlap: {:#x?} and {:#x?}", w[0], w[1]));
                        continue;
                    }
                    for i in 0..count as usize {
                        // SAFETY: the table lies in a live device or pinned allocation (checked above).
                        let [src, dst, len] =
                            unsafe { std::ptr::read_unaligned((table as *const [u64; 3]).add(i)) };
                        let (src, dst, len) = (src as usize, dst as usize, len as usize);
                        let device = self.stream_device.get(&stream).copied().unwrap_or(0);
                        if let Some(other) = [src, dst].into_iter().find(|&at| !self.may_access(device, at)) {
                            self.illegal(format!(
                                "descriptor {i}: device {device} reads or writes {other:#x} of another device \
                                 without peer access"
                            ));
                            break;
                        }
                        // Pinned host memory is mapped for every device with unified
                        // addressing: either side of a copy may lie there.
                        let reachable = |at: usize| {
                            self.is_device(at, len)
                                || (!self.no_unified_addressing && self.is_pinned(at, len))
                        };
                        if reachable(src) && reachable(dst) {
                            self.copy(dst, src, len);
                        } else {
                            self.illegal(format!(
                                "descriptor {i}: {src:#x} -> {dst:#x} ({len} bytes) outside device and pinned memory"
                            ));
                            break;
                        }
                    }
                }
            }
        }
    }

    /// Whether kernels of `device` may touch device address `at`: its own memory, or a
    /// peer's after `cuCtxEnablePeerAccess`. Addresses outside device memory answer `true`
    /// (the range checks report them).
    fn may_access(&self, device: usize, at: usize) -> bool {
        match range_of(&self.device, at).and_then(|(base, _)| self.owner.get(&base)) {
            Some(&owner) => owner == device || self.peer_access.contains(&(device, owner)),
            None => true,
        }
    }

    fn illegal(&mut self, what: String) {
        eprintln!("model GPU: {what}");
        self.errors.push(what);
    }

    /// What waits and queries answer once the model found an illegal access.
    fn sticky(&self) -> Option<CUresult> {
        (!self.errors.is_empty()).then_some(CUDA_ERROR_ILLEGAL_ADDRESS)
    }

    fn copy(&self, dst: usize, src: usize, len: usize) {
        // SAFETY: both ranges were checked to lie in live device or pinned allocations when
        // the copy was queued (device ones again for the kernel). A region the code under
        // test freed while a copy still used it would be a use after free here too: finding
        // that is what these tests are for, and the checks above catch the usual case (a
        // table or a range overwritten by a later batch) before any copy.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
    }
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

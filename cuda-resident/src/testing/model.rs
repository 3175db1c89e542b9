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

mod entries;

// Outside tests the benches use only the driver.
#[cfg_attr(not(test), allow(unused_imports))]
pub(crate) use entries::{context, driver};

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
    /// Copies enqueued by `cuMemcpyBatchAsync`, in all.
    pub(crate) batched_copies: usize,
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
    /// Whether the GPU registers host memory and reaches it at its host address
    /// (`CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED` and `..._CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`
    /// answer 1): then a device opened on the model may make its pinned arenas of huge
    /// pages. Off unless a test turns it on, so that arenas come from `cuMemHostAlloc`.
    pub(crate) registers_host_memory: bool,
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

//! Scoped transfers: batches whose other end is the caller's own memory, borrowed until every
//! transfer of the scope has completed ([`Device::scope`](crate::Device::scope)).
//!
//! A batch of a scope takes caller slices for 'scope (the scope's whole life), and the scope
//! waits for every submission made in it before it returns, even when its closure panics, as
//! `std::thread::scope` joins its threads. So the GPU may read and write the caller's memory
//! after `submit` returns, with no copy through staging, and no safe code can touch that
//! memory until the copies are done.
//!
//! Memory of this crate's pinned pool ([`Device::pinned`](crate::Device::pinned): a
//! [`PinnedBuffer`](crate::PinnedBuffer), a download's views) is mapped for the device: a
//! range in it moves by one DMA when it is at least `Config::direct_threshold` long, else by
//! the copy kernel reading or writing it over the bus, many ranges to a launch. Any other
//! memory (pageable, or pinned by `Device::pin_host`) takes the staged path of ordinary
//! batches: uploads are copied into staging at submit; downloads land in staging and are
//! copied out before `submit` returns.

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::BufferTable;
use crate::alloc::ResidentBuffer;
use crate::engine::core::Core;
use crate::engine::host::Piece;
use crate::engine::order::Ranges;
use crate::engine::{Exec, wait};
use crate::error::{Error, Result};
use crate::host_pool::lent_extent;
use crate::kernels::{CopyDescriptor, push_descriptors, table_bytes};
use crate::stream::{Fence, LaneKind};

/// A scope of transfers that may use the caller's memory ([`Device::scope`](crate::Device::scope)).
///
/// Its batches borrow the caller's slices until the scope ends, so the borrow rules keep
/// safe code away from memory the GPU may still read or write. Memory read into cannot be
/// looked at inside the scope:
///
/// ```compile_fail,E0502
/// # fn f(device: &cuda_resident::Device, pool: cuda_resident::ResidentBuffer) -> cuda_resident::Result<()> {
/// let mut cache = vec![0u8; 4096];
/// device.scope(|s| {
///     let mut reads = s.downloads();
///     reads.read_into(pool, 0, &mut cache)?;
///     reads.submit()?;
///     println!("{}", cache[0]); // `cache` is borrowed until the scope ends
///     Ok(())
/// })
/// # }
/// ```
///
/// memory written from cannot be changed inside the scope:
///
/// ```compile_fail,E0502
/// # fn f(device: &cuda_resident::Device, pool: cuda_resident::ResidentBuffer) -> cuda_resident::Result<()> {
/// let mut rows = vec![1u8; 4096];
/// device.scope(|s| {
///     let mut writes = s.uploads();
///     writes.write(pool, 0, &rows)?;
///     writes.submit()?;
///     rows[0] = 2; // the GPU may be reading `rows`
///     Ok(())
/// })
/// # }
/// ```
///
/// and memory that does not outlive the scope cannot be lent to it:
///
/// ```compile_fail,E0597
/// # fn f(device: &cuda_resident::Device, pool: cuda_resident::ResidentBuffer) -> cuda_resident::Result<()> {
/// device.scope(|s| {
///     let mut local = vec![0u8; 4096];
///     let mut reads = s.downloads();
///     reads.read_into(pool, 0, &mut local)?; // `local` dies inside the scope
///     reads.submit()
/// })
/// # }
/// ```
pub struct Scope<'scope, 'env: 'scope> {
    core: &'env Arc<Core>,
    /// The last submission made in the scope on each lane (0: none).
    last: [AtomicU64; 2],
    scope: PhantomData<&'scope mut &'scope ()>,
    env: PhantomData<&'env mut &'env ()>,
}

impl std::fmt::Debug for Scope<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scope").field("device", &self.core.info.ordinal).finish_non_exhaustive()
    }
}

/// The work of [`Device::scope`](crate::Device::scope).
pub(crate) fn scope<'env, R>(
    core: &'env Arc<Core>,
    f: impl for<'scope> FnOnce(&'scope Scope<'scope, 'env>) -> Result<R>,
) -> Result<R> {
    let scope = Scope { core, last: Default::default(), scope: PhantomData, env: PhantomData };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&scope)));
    // Whatever the closure did, nothing returns (or unwinds) past this point while a copy
    // of the scope may still use the memory it borrowed.
    let waited = scope.wait_all();
    match result {
        Err(panic) => std::panic::resume_unwind(panic),
        Ok(Err(e)) => Err(e),
        Ok(Ok(value)) => waited.map(|()| value),
    }
}

impl<'scope> Scope<'scope, '_> {
    /// A batch of writes from the caller's memory, borrowed for the scope.
    pub fn uploads(&'scope self) -> ScopedUploads<'scope> {
        ScopedUploads {
            core: self.core,
            last: &self.last,
            table: BufferTable::default(),
            writes: Vec::new(),
            error: None,
            scope: PhantomData,
        }
    }

    /// A batch of reads into the caller's memory, borrowed for the scope.
    pub fn downloads(&'scope self) -> ScopedDownloads<'scope> {
        ScopedDownloads {
            core: self.core,
            last: &self.last,
            table: BufferTable::default(),
            reads: Vec::new(),
            error: None,
            scope: PhantomData,
        }
    }

    /// Waits for every submission of the scope. A wait that fails falls back to
    /// synchronizing the lane's stream, so that no copy runs once this returns: if that
    /// fails too, the context has failed, and no copy of it runs any more.
    fn wait_all(&self) -> Result<()> {
        let mut first = Ok(());
        for kind in [LaneKind::Upload, LaneKind::Readback] {
            let seq = self.last[kind.index()].load(Ordering::Acquire);
            if seq == 0 {
                continue;
            }
            if let Err(e) = wait(self.core, kind, seq) {
                let stream = self.core.lane(kind).stream();
                let _ = self.core.ctx.bind().and_then(|raw| raw.stream_synchronize(stream));
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }
}

/// Records `fence`'s submission as the scope's latest on its lane.
fn note(last: &[AtomicU64; 2], fence: &Fence) {
    if let Some((_, kind, seq)) = fence.target() {
        last[kind.index()].fetch_max(seq, Ordering::AcqRel);
    }
}

/// Finds whether host ranges lie in pinned memory of this crate, remembering the last arena
/// found (a batch's ranges mostly lie in one host cache).
#[derive(Default)]
struct Lent(Option<(usize, usize)>);

impl Lent {
    fn holds(&mut self, ptr: usize, len: usize) -> bool {
        let inside =
            |(start, bytes): (usize, usize)| ptr >= start && ptr.saturating_add(len) <= start + bytes;
        if self.0.is_some_and(inside) {
            return true;
        }
        match lent_extent(ptr) {
            Some(arena) if inside(arena) => {
                self.0 = Some(arena);
                true
            }
            _ => false,
        }
    }
}

/// One copy between caller memory mapped for the device and a device range.
#[derive(Clone, Copy, Debug)]
struct Direct {
    host: usize,
    dev: u64,
    len: u64,
}

/// Moves `items` on `kind`'s lane with no staging: each one at least the direct threshold
/// long by one DMA, the others by one launch of the copy kernel over the bus, its
/// descriptor table in pinned memory (by DMAs too on a GPU without unified addressing).
/// `ranges` are the items' device ranges; `buffers` every buffer they lie in.
fn move_pinned(
    core: &Arc<Core>,
    kind: LaneKind,
    buffers: impl Iterator<Item = ResidentBuffer>,
    items: &[Direct],
    ranges: Ranges,
) -> Result<Fence> {
    let threshold = core.config.direct_threshold;
    let bus = core.moves_small_copies_over_bus();
    let by_kernel = |d: &Direct| bus && d.len < threshold;
    let mut descriptors = Vec::new();
    let mut kernel_bytes = 0;
    for d in items.iter().filter(|d| by_kernel(d)) {
        let (src, dst) =
            if kind == LaneKind::Upload { (d.host as u64, d.dev) } else { (d.dev, d.host as u64) };
        push_descriptors(&mut descriptors, src, dst, d.len);
        kernel_bytes += d.len;
    }
    let mut exec = Exec::begin(core, kind);
    let count = descriptors.len() as u64;
    // The table in pinned memory; a pool that cannot lend it moves every item by DMA.
    let table = if count > 0 {
        match exec.lease(table_bytes(count) as usize) {
            Ok(mut lease) => {
                // SAFETY: a descriptor is three u64s (`repr(C)`, no padding); the lease is
                // fresh and holds the whole table.
                unsafe {
                    let bytes = descriptors.len() * size_of::<CopyDescriptor>();
                    lease.as_mut_slice()[..bytes].copy_from_slice(std::slice::from_raw_parts(
                        descriptors.as_ptr().cast::<u8>(),
                        bytes,
                    ));
                }
                Some(Arc::new(lease))
            }
            Err(e) if e.is_staging_refusal() => None,
            Err(e) => return Err(e),
        }
    } else {
        None
    };
    exec.claim_built(buffers, 1, ranges)?;
    exec.requested(items.iter().map(|d| d.len).sum());
    let kernels = if table.is_some() { Some(exec.kernels()?) } else { None };
    let keep = table.iter().cloned().collect();
    exec.submit(keep, |q| {
        if let (Some(table), Some(kernels)) = (&table, kernels) {
            // SAFETY: the table lies in pinned memory this submission keeps alive, mapped for
            // the device (unified addressing); the host side of every copy lies in pinned
            // memory of this crate that the scope borrows until the copy completes; the
            // device side is a range of a live, claimed buffer; no two destinations overlap
            // (uploads: checked at submit; downloads: distinct `&mut` slices).
            unsafe { q.launch_over_bus(kernels, table.as_ptr() as u64, count, kernel_bytes + count * 24) }?;
        }
        for d in items.iter().filter(|d| table.is_none() || !by_kernel(d)) {
            // SAFETY: as above, by one DMA each, in submission order.
            unsafe {
                match kind {
                    LaneKind::Upload => q.htod(d.dev, d.host as *const u8, d.len as usize),
                    LaneKind::Readback => q.dtoh(d.host as *mut u8, d.dev, d.len as usize),
                }
            }?;
        }
        Ok(())
    })?;
    Ok(exec.finish())
}

/// A batch of writes from the caller's memory ([`Scope::uploads`]). Writes apply in order:
/// where two overlap, the later one wins (such a batch takes the staged path whole).
#[must_use = "a scoped upload batch moves nothing until it is submitted"]
pub struct ScopedUploads<'scope> {
    core: &'scope Arc<Core>,
    last: &'scope [AtomicU64; 2],
    table: BufferTable,
    writes: Vec<(u32, u64, &'scope [u8])>,
    error: Option<Error>,
    /// Invariant in 'scope: a batch must not shrink to a shorter borrow, or it would take
    /// memory that dies before the scope waits for it.
    scope: PhantomData<&'scope mut &'scope ()>,
}

impl std::fmt::Debug for ScopedUploads<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScopedUploads").field("writes", &self.writes.len()).finish_non_exhaustive()
    }
}

impl<'scope> ScopedUploads<'scope> {
    /// Adds a write of `data` to `buffer` at `offset`. `data` stays borrowed until the scope
    /// ends; in pinned memory of this crate, the GPU reads it in place.
    ///
    /// # Errors
    /// A bad range (returned here and again by `submit`, which then moves nothing).
    pub fn write(&mut self, buffer: ResidentBuffer, offset: u64, data: &'scope [u8]) -> Result<&mut Self> {
        let (key, _) =
            self.table.check(&self.core.alloc, buffer, offset, data.len() as u64, &mut self.error)?;
        self.writes.push((key, offset, data));
        Ok(self)
    }

    /// Number of writes.
    pub fn len(&self) -> usize {
        self.writes.len()
    }

    /// Whether the batch has no writes.
    pub fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }

    /// Moves every write: those from pinned memory of this crate straight from it, the
    /// others through staging (copied before this returns). The scope waits for them.
    ///
    /// # Errors
    /// The first bad write's error, or a staging or driver error; nothing moves if a write
    /// was bad or a buffer was freed.
    pub fn submit(self) -> Result<()> {
        self.submit_fenced().map(drop)
    }

    /// [`ScopedUploads::submit`], returning the fence of its last submission: for a stream of
    /// your own that must wait for the writes inside the scope
    /// ([`Fence::make_stream_wait`]).
    ///
    /// # Errors
    /// As [`ScopedUploads::submit`].
    pub fn submit_fenced(mut self) -> Result<Fence> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        let core = self.core;
        let ptr_of = |key: u32, offset: u64| self.table.entries[key as usize].ptr + offset;
        let mut ranges = core.ranges(LaneKind::Upload);
        for &(key, offset, data) in &self.writes {
            ranges.push(ptr_of(key, offset), data.len() as u64);
        }
        // Overlapping writes apply in order: the staged path's planner resolves them.
        let disjoint = ranges.sort_disjoint();
        let mut lent = Lent::default();
        let (mut direct, mut staged) = (Vec::new(), Vec::new());
        for &(key, offset, data) in &self.writes {
            if data.is_empty() {
                continue;
            }
            if disjoint && lent.holds(data.as_ptr() as usize, data.len()) {
                direct.push(Direct {
                    host: data.as_ptr() as usize,
                    dev: ptr_of(key, offset),
                    len: data.len() as u64,
                });
            } else {
                staged.push((self.table.entries[key as usize].buffer, offset, data));
            }
        }
        let mut fence = Fence::completed();
        if !direct.is_empty() {
            let ranges = if staged.is_empty() { ranges } else { ranges_of(core, LaneKind::Upload, &direct) };
            fence = move_pinned(core, LaneKind::Upload, self.table.buffers(), &direct, ranges)?;
            note(self.last, &fence);
        }
        if !staged.is_empty() {
            let mut batch = super::upload::uploads(core);
            for (buffer, offset, data) in staged {
                batch.write(buffer, offset, data)?;
            }
            fence = batch.submit()?;
            note(self.last, &fence);
        }
        Ok(fence)
    }
}

/// The device ranges of `items`.
fn ranges_of(core: &Core, kind: LaneKind, items: &[Direct]) -> Ranges {
    let mut ranges = core.ranges(kind);
    for d in items {
        ranges.push(d.dev, d.len);
    }
    ranges
}

/// A batch of reads into the caller's memory ([`Scope::downloads`]).
#[must_use = "a scoped download batch moves nothing until it is submitted"]
pub struct ScopedDownloads<'scope> {
    core: &'scope Arc<Core>,
    last: &'scope [AtomicU64; 2],
    table: BufferTable,
    reads: Vec<(u32, u64, &'scope mut [u8])>,
    error: Option<Error>,
    /// Invariant in 'scope, as [`ScopedUploads`].
    scope: PhantomData<&'scope mut &'scope ()>,
}

impl std::fmt::Debug for ScopedDownloads<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScopedDownloads").field("reads", &self.reads.len()).finish_non_exhaustive()
    }
}

impl<'scope> ScopedDownloads<'scope> {
    /// Adds a read of `out.len()` bytes of `buffer` at `offset` into `out`, which stays
    /// borrowed until the scope ends: the bytes are in it once the scope returns. In pinned
    /// memory of this crate, the GPU writes it in place.
    ///
    /// # Errors
    /// A bad range (returned here and again by `submit`, which then moves nothing).
    pub fn read_into(
        &mut self,
        buffer: ResidentBuffer,
        offset: u64,
        out: &'scope mut [u8],
    ) -> Result<&mut Self> {
        let (key, _) =
            self.table.check(&self.core.alloc, buffer, offset, out.len() as u64, &mut self.error)?;
        self.reads.push((key, offset, out));
        Ok(self)
    }

    /// Number of reads.
    pub fn len(&self) -> usize {
        self.reads.len()
    }

    /// Whether the batch has no reads.
    pub fn is_empty(&self) -> bool {
        self.reads.is_empty()
    }

    /// Moves every read: into pinned memory of this crate straight from the device (this
    /// returns at once; the bytes are there when the scope ends), into any other memory
    /// through staging (this returns once those bytes are copied in).
    ///
    /// # Errors
    /// The first bad read's error, or a staging or driver error; nothing moves if a read
    /// was bad or a buffer was freed.
    pub fn submit(self) -> Result<()> {
        self.submit_fenced().map(drop)
    }

    /// [`ScopedDownloads::submit`], returning the fence of its last submission (a read into
    /// pinned memory: its bytes are there once the fence is).
    ///
    /// # Errors
    /// As [`ScopedDownloads::submit`].
    pub fn submit_fenced(mut self) -> Result<Fence> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        let core = self.core;
        let mut lent = Lent::default();
        let (mut direct, mut staged) = (Vec::new(), Vec::new());
        for (key, offset, out) in std::mem::take(&mut self.reads) {
            if out.is_empty() {
                continue;
            }
            let entry = self.table.entries[key as usize];
            if lent.holds(out.as_ptr() as usize, out.len()) {
                direct.push(Direct {
                    host: out.as_mut_ptr() as usize,
                    dev: entry.ptr + offset,
                    len: out.len() as u64,
                });
            } else {
                staged.push((entry.buffer, offset, out));
            }
        }
        let mut fence = Fence::completed();
        if !direct.is_empty() {
            let ranges = ranges_of(core, LaneKind::Readback, &direct);
            fence = move_pinned(core, LaneKind::Readback, self.table.buffers(), &direct, ranges)?;
            note(self.last, &fence);
        }
        if !staged.is_empty() {
            let mut batch = super::download::downloads(core);
            let slots = staged
                .iter()
                .map(|(buffer, offset, out)| batch.read(*buffer, *offset, out.len() as u64))
                .collect::<Result<Vec<_>>>()?;
            let pending = batch.submit()?;
            note(self.last, pending.fence());
            let done = pending.wait()?;
            let mut pieces = Vec::with_capacity(staged.len());
            for ((_, _, out), slot) in staged.iter_mut().zip(slots) {
                let bytes = done.get(slot);
                Piece::push_split(
                    &mut pieces,
                    Piece { dst: out.as_mut_ptr(), src: bytes.as_ptr(), len: bytes.len() },
                );
            }
            // SAFETY: each piece copies a landed view into its own caller slice (distinct
            // `&mut` borrows, of the view's length).
            unsafe { Piece::copy_out_all(&core.packers, &pieces) };
            crate::hostcopy::publish();
        }
        Ok(fence)
    }
}

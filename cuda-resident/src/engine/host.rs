//! The host side of a transfer: host memcpys of packing and unpacking ([`Piece`]), run on
//! the device's packing threads ([`in_groups`], and `super::pipeline` for chunks
//! overlapped with the wire), where a write's bytes come from ([`Source`]), descriptor
//! tables built straight into pinned memory ([`PinnedDescriptors`]), and host memory for
//! results ([`zeroed_vec`]).

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::{Error, Result};
use crate::host_pool::HostLease;
use crate::kernels::{CopyDescriptor, PEER_SEGMENT, segments};

use super::pipeline::{self, PARALLEL_MIN, Packers};

/// A vector of `len` zero bytes, or an error instead of an abort when the host cannot give
/// that much. Large zeroed allocations come from the OS already zero, so this costs no
/// memset (unlike `resize`): the pages are touched first by whatever fills the vector.
pub(crate) fn zeroed_vec(len: u64) -> Result<Vec<u8>> {
    let oom = || Error::HostOutOfMemory { bytes: len };
    let n = usize::try_from(len).map_err(|_| oom())?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(n).map_err(|_| oom())?;
    // SAFETY: the layout has a non-zero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(oom());
    }
    // SAFETY: ptr was allocated by the global allocator with exactly this layout (size n,
    // align 1), and all n bytes are initialised (zero).
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

/// One host memcpy of packing or unpacking.
#[derive(Clone, Copy)]
pub(crate) struct Piece {
    pub(crate) dst: *mut u8,
    pub(crate) src: *const u8,
    pub(crate) len: usize,
}

// SAFETY: a piece is two addresses and a length; the code that builds pieces guarantees
// that the ranges are valid and that no two pieces' destinations overlap.
unsafe impl Send for Piece {}
// SAFETY: as above; pieces are only read.
unsafe impl Sync for Piece {}

/// Pieces larger than this are split for the packing threads.
const PIECE_SPLIT: usize = 256 << 10;

impl Piece {
    /// Appends `piece`, split into parts of at most [`PIECE_SPLIT`] bytes.
    pub(crate) fn push_split(out: &mut Vec<Piece>, piece: Piece) {
        let mut done = 0;
        while done < piece.len {
            let len = (piece.len - done).min(PIECE_SPLIT);
            // SAFETY: offsets stay inside the piece's ranges.
            out.push(unsafe { Piece { dst: piece.dst.add(done), src: piece.src.add(done), len } });
            done += len;
        }
    }

    /// Performs every piece, in parallel on the device's packing threads when there is
    /// enough to do.
    ///
    /// # Safety
    /// Each piece's source must be readable and its destination writable for `len` bytes,
    /// and no destination may overlap another piece's source or destination.
    pub(crate) unsafe fn copy_all(packers: &Packers, pieces: &[Piece]) {
        // SAFETY: as the caller promises.
        unsafe { Piece::run_all(packers, pieces, std::ptr::copy_nonoverlapping::<u8>) }
    }

    /// [`Piece::copy_all`] out of landed staging into the caller's memory
    /// ([`crate::hostcopy::copy_out`]: streaming stores for long pieces).
    ///
    /// # Safety
    /// As [`Piece::copy_all`].
    pub(crate) unsafe fn copy_out_all(packers: &Packers, pieces: &[Piece]) {
        // SAFETY: as the caller promises.
        unsafe { Piece::run_all(packers, pieces, crate::hostcopy::copy_out) }
    }

    /// Performs every piece with `copy`, publishing each group's streaming stores.
    ///
    /// # Safety
    /// As [`Piece::copy_all`]; `copy(src, dst, len)` must copy `len` bytes from `src` to `dst`.
    unsafe fn run_all(packers: &Packers, pieces: &[Piece], copy: unsafe fn(*const u8, *mut u8, usize)) {
        let total: usize = pieces.iter().map(|p| p.len).sum();
        in_groups(
            packers,
            pieces.len(),
            total,
            |i| pieces[i].len,
            |range| {
                for p in &pieces[range] {
                    // SAFETY: as the caller promises.
                    unsafe { copy(p.src, p.dst, p.len) }
                }
                crate::hostcopy::publish();
            },
        );
    }
}

/// Runs `work` over `0..count` split into contiguous ranges of about equal bytes (item `i`
/// has `bytes(i)`, `total` in all), a few per copying thread, in parallel when there is
/// enough to do: one task per range, not per item (thousands of tiny tasks cost more than
/// the copies). Returns when every range is done.
///
/// The calling thread copies too: it would otherwise only wait, and the packing threads
/// are one per core but one ([`Config::pack_threads`](crate::Config::pack_threads)), so a
/// bulk copy runs on every core. Every thread takes the next range from a shared counter
/// until none is left, so a thread that starts late (or is descheduled) takes fewer.
pub(crate) fn in_groups(
    packers: &Packers,
    count: usize,
    total: usize,
    bytes: impl Fn(usize) -> usize,
    work: impl Fn(std::ops::Range<usize>) + Sync + Send,
) {
    if total < PARALLEL_MIN || count < 2 {
        return work(0..count);
    }
    let pool = packers.pool();
    let helpers = pool.current_num_threads();
    let target = (total / ((helpers + 1) * 4)).max(64 << 10);
    let mut groups = Vec::new();
    pipeline::split_by_bytes(0..count, bytes, target, |group| groups.push(group));
    let next = AtomicUsize::new(0);
    let take = || {
        while let Some(group) = groups.get(next.fetch_add(1, Ordering::Relaxed)) {
            work(group.clone());
        }
    };
    let packing = pipeline::Packing::start(packers);
    // The scope returns once every spawned task has; a panic in any is resumed here after.
    pool.in_place_scope(|scope| {
        for _ in 0..helpers.min(groups.len() - 1) {
            scope.spawn(|_| take());
        }
        take();
    });
    drop(packing);
    pipeline::linger(packers);
}

/// Where pinned memory for a transfer comes from: the device's pinned pool, waiting for
/// copies in flight when it is full.
pub(crate) trait Staging {
    /// The most pinned memory the pool holds.
    fn pinned_cap(&self) -> u64;
    /// Pinned memory of `len` bytes for a transfer.
    fn acquire_staging(&self, len: usize) -> Result<HostLease>;
}

/// Where a write's bytes come from.
#[derive(Clone, Copy)]
pub(crate) enum Source<'a> {
    /// The caller's slice.
    Slice(&'a [u8]),
    /// Written in place by `write_with`, into the batch's own pinned arena.
    Arena { lease: u32, offset: usize },
}

/// Descriptors built straight into pinned memory, where the kernel reads them (or one DMA
/// takes them to the device): no copy of the table on the host. Grows by doubling; holds
/// no staging once cleared.
///
/// A table that would take more than an eighth of the pinned pool (or for which the pool has
/// no room) is built on the heap instead, and stays there for the submission to upload: in
/// the pool it would hold that much staging while the batch is built (growing it holds the
/// old lease and the new one at once), and at submit it could ask more than the pool keeps
/// for transfers.
#[derive(Default)]
pub(crate) struct PinnedDescriptors {
    lease: Option<HostLease>,
    /// The table when on the heap (then `heap.len() == len`).
    heap: Vec<CopyDescriptor>,
    on_heap: bool,
    len: usize,
    /// The most descriptors a batch needed so far: the next batch starts with room for
    /// them.
    high: usize,
}

pub(crate) const DESCRIPTOR: usize = std::mem::size_of::<CopyDescriptor>();

/// A finished descriptor table ([`PinnedDescriptors::take`]).
pub(crate) enum Table {
    /// In pinned memory of the device, where the kernel may read it.
    Pinned(HostLease),
    /// On the heap: to be uploaded to device staging before the launch.
    Heap(Vec<CopyDescriptor>),
}

impl PinnedDescriptors {
    fn capacity(&self) -> usize {
        if self.on_heap {
            self.heap.capacity()
        } else {
            self.lease.as_ref().map_or(0, |l| l.len() / DESCRIPTOR)
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn as_slice(&self) -> &[CopyDescriptor] {
        match &self.lease {
            _ if self.on_heap => &self.heap,
            // SAFETY: the lease is page-aligned pinned memory of this table's own, holding
            // `len` written descriptors.
            Some(lease) => unsafe { std::slice::from_raw_parts(lease.as_ptr().cast(), self.len) },
            None => &[],
        }
    }

    /// Makes room for `extra` more, from the device's pinned pool (or on the heap).
    pub(crate) fn reserve(&mut self, staging: &impl Staging, extra: usize) -> Result<()> {
        let need = self.len.saturating_add(extra);
        if need <= self.capacity() {
            return Ok(());
        }
        let room = need.max(2 * self.capacity()).max(self.high).max(1024);
        let oom = |n: usize| Error::HostOutOfMemory { bytes: (n as u64).saturating_mul(DESCRIPTOR as u64) };
        if !self.on_heap {
            let bytes = room.saturating_mul(DESCRIPTOR);
            if (bytes as u64) <= staging.pinned_cap() / 8
                && let Ok(lease) = staging.acquire_staging(bytes)
            {
                if let Some(old) = &self.lease {
                    // SAFETY: both are pinned regions of this table's own, the new one larger.
                    unsafe {
                        std::ptr::copy_nonoverlapping(old.as_ptr(), lease.as_ptr(), self.len * DESCRIPTOR)
                    };
                }
                self.lease = Some(lease);
                return Ok(());
            }
            let mut heap = std::mem::take(&mut self.heap);
            heap.clear();
            heap.try_reserve(room).map_err(|_| oom(room))?;
            heap.extend_from_slice(self.as_slice());
            (self.heap, self.lease, self.on_heap) = (heap, None, true);
        }
        self.heap.try_reserve(need - self.len).map_err(|_| oom(need))
    }

    /// Appends one; room must have been reserved.
    #[inline]
    pub(crate) fn push(&mut self, d: CopyDescriptor) {
        assert!(self.len < self.capacity(), "descriptor room reserved");
        // SAFETY: inside the room (checked above), aligned for descriptors.
        unsafe { self.end().write(d) };
        self.commit(1);
    }

    /// Where the next descriptor goes (room must have been reserved for what is written;
    /// [`PinnedDescriptors::commit`] counts it).
    pub(crate) fn end(&mut self) -> *mut CopyDescriptor {
        match &self.lease {
            // SAFETY: `len` is within the vector's capacity.
            _ if self.on_heap => unsafe { self.heap.as_mut_ptr().add(self.len) },
            // SAFETY: `len` is within the lease.
            Some(lease) => unsafe { lease.as_ptr().cast::<CopyDescriptor>().add(self.len) },
            None => std::ptr::NonNull::dangling().as_ptr(),
        }
    }

    /// Counts `n` descriptors written at [`PinnedDescriptors::end`].
    pub(crate) fn commit(&mut self, n: usize) {
        self.len += n;
        if self.on_heap {
            // SAFETY: the caller wrote these descriptors within the reserved capacity.
            unsafe { self.heap.set_len(self.len) };
        }
    }

    /// Appends `len` descriptors of a copy, in pieces of at most [`PEER_SEGMENT`] bytes;
    /// room must have been reserved (`len.div_ceil(PEER_SEGMENT)` of them).
    pub(crate) fn push_copy(&mut self, src: u64, dst: u64, len: u64) {
        for d in segments(src, dst, len, PEER_SEGMENT) {
            self.push(d);
        }
    }

    /// Hands the table over to the submission that runs the kernel; the next batch starts
    /// a new one. A table built on the heap stays there: copying it into one pinned lease
    /// could ask more of the pool than it keeps for transfers (those are the tables past an
    /// eighth of the cap, or built while the pool had no room); the caller uploads it to
    /// device staging instead.
    pub(crate) fn take(&mut self) -> Option<Table> {
        self.high = self.high.max(self.len);
        let table = match self.lease.take() {
            _ if self.on_heap && self.len > 0 => Some(Table::Heap(std::mem::take(&mut self.heap))),
            Some(lease) => Some(Table::Pinned(lease)),
            None => None,
        };
        self.len = 0;
        self.heap.clear();
        self.on_heap = false;
        table
    }

    pub(crate) fn clear(&mut self) {
        self.high = self.high.max(self.len);
        self.len = 0;
        self.lease = None;
        self.heap.clear();
        self.on_heap = false;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::thread::ThreadId;

    use super::*;

    /// Ranges `in_groups` ran, and on which threads.
    fn run(threads: usize, count: usize, each: usize) -> (Vec<std::ops::Range<usize>>, Vec<ThreadId>) {
        let packers = Packers::new(threads, 0);
        let seen = Mutex::new((Vec::new(), Vec::new()));
        in_groups(
            &packers,
            count,
            count * each,
            |_| each,
            |range| {
                // Long enough that every thread gets a range before the others run out.
                std::thread::sleep(std::time::Duration::from_millis(2));
                let mut seen = seen.lock().unwrap();
                seen.0.push(range);
                seen.1.push(std::thread::current().id());
            },
        );
        let (mut ranges, threads) = seen.into_inner().unwrap();
        ranges.sort_by_key(|r| r.start);
        (ranges, threads)
    }

    #[test]
    fn every_item_runs_once_and_the_calling_thread_copies_too() {
        for (threads, count) in [(1, 2), (3, 64), (4, 1000), (2, 17)] {
            let (ranges, ran_on) = run(threads, count, 256 << 10);
            let mut next = 0;
            for r in &ranges {
                assert_eq!(r.start, next, "{threads} threads, {count} items: ranges {ranges:?}");
                assert!(r.end > r.start);
                next = r.end;
            }
            assert_eq!(next, count, "{threads} threads, {count} items: every item");
            if ranges.len() > threads {
                assert!(
                    ran_on.contains(&std::thread::current().id()),
                    "{threads} threads, {count} items: the calling thread took no range"
                );
            }
        }
    }

    #[test]
    fn small_work_runs_on_the_calling_thread_alone() {
        let (ranges, ran_on) = run(4, 3, 1000);
        assert_eq!(ranges, vec![0..3]);
        assert_eq!(ran_on, vec![std::thread::current().id()]);
    }

    #[test]
    fn a_panicking_range_reaches_the_caller_after_the_others_are_done() {
        let packers = Packers::new(3, 0);
        let done = AtomicUsize::new(0);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            in_groups(
                &packers,
                64,
                64 << 20,
                |_| 1 << 20,
                |range| {
                    assert!(!range.contains(&40), "a range that panics");
                    done.fetch_add(range.len(), Ordering::Relaxed);
                },
            )
        }));
        assert!(r.is_err());
        // Every other range ran, and none runs after the call returned.
        let after = done.load(Ordering::Relaxed);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(done.load(Ordering::Relaxed), after);
        assert!(after < 64);
    }
}

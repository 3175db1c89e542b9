//! Pinned (page-locked) host staging: arenas of huge pages registered with the driver, or
//! from `cuMemHostAlloc` ([`arena`] says which and why), reused.
//!
//! Making an arena costs milliseconds (5.7 ms for 16 MiB by `cuMemHostAlloc` on the H200's
//! host), so staging is never allocated per copy. Arenas come in sixteen sizes per power of
//! two from 64 KiB up (so rounding wastes at most 6.25 % of an arena), are lent out whole as
//! a [`HostLease`] and come back when the lease drops. A lease used by a copy is kept alive
//! by the lane until the copy's event completes, so an arena is reused only after the GPU
//! is done with it. The pool never holds more than
//! `Config::pinned_cap_bytes`; when it is full, free arenas of other sizes are released
//! first, and a request that still does not fit waits for copies in flight (the caller's
//! job) or fails.
//!
//! Staging comes in two kinds. A transfer's staging is lent for as long as its copy is in
//! flight. **Held** staging stays with its holder for as long as the holder likes:
//! [`PinnedBuffer`]s, prepared sets' regions, the views of a [`Downloaded`](crate::Downloaded).
//! Held staging may fill the pool only up to `cap - reserve`: the reserve is kept for
//! transfers, which then still move (in fewer chunks at a time), never fail for want of
//! staging that others hold.
//!
//! Arenas are portable (`CU_MEMHOSTALLOC_PORTABLE`, `CU_MEMHOSTREGISTER_PORTABLE`): every
//! context may use them.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Weak};
use std::time::Duration;

use crate::context::Context;
use crate::counter::take;
use crate::error::{Error, Result};
use crate::sync::{Mutex, lock};

mod arena;
pub(crate) use arena::kernel_offers_huge_pages;
use arena::{Arena, HUGE_PAGE};

/// The smallest arena.
pub(crate) const MIN_ARENA: u64 = 64 << 10;
/// A host page: an arena made to measure is a whole number of them where it can be.
const PAGE: u64 = 4096;
/// Arena sizes per doubling of the request: a request of `len` bytes, `2^k <= len < 2^(k+1)`,
/// gets the next multiple of `2^(k - CLASS_BITS)`, so that rounding never wastes more than
/// `1 / 2^CLASS_BITS` (6.25 %) of an arena, while sizes stay few enough to be reused.
const CLASS_BITS: u32 = 4;

/// The arena size that serves `len` bytes under `cap`: at least [`MIN_ARENA`], else `len`
/// rounded up to one of sixteen sizes per power of two (a 1 MiB request and its 16 bytes of
/// alignment take 1 MiB + 64 KiB, not 2 MiB: waste under 6.25 %), never past the cap (a
/// request within the cap must be servable).
pub(crate) fn arena_bytes(len: u64, cap: u64) -> u64 {
    let len = len.max(MIN_ARENA);
    let step = 1u64 << (u64::BITS - 1 - len.leading_zeros()).saturating_sub(CLASS_BITS);
    len.checked_next_multiple_of(step).unwrap_or(len).min(cap).max(len)
}

/// The largest request whose arena is at most `limit` bytes (for `limit >= MIN_ARENA`):
/// `limit` rounded down to an arena size. Two requests of `arena_floor(cap / 2)` bytes fit
/// a pool of `cap` bytes together.
pub(crate) fn arena_floor(limit: u64) -> u64 {
    let limit = limit.max(MIN_ARENA);
    let step = 1u64 << (u64::BITS - 1 - limit.leading_zeros()).saturating_sub(CLASS_BITS);
    limit - limit % step
}

#[derive(Default)]
struct PoolState {
    /// Free arenas by size.
    free: BTreeMap<u64, Vec<Arena>>,
    /// Bytes allocated from the driver (free and lent), including allocations in progress.
    reserved: u64,
    /// Bytes lent out.
    lent: u64,
    /// Bytes lent out as held staging (part of `lent`).
    held: u64,
    /// Arenas whose `cuMemFreeHost` failed: still counted in `reserved`, retried by the next
    /// trim.
    unreleased: Vec<Arena>,
    /// Bytes lent to running transfers (part of `lent`): staging that comes back without
    /// the caller's doing, once those transfers' copies are done
    /// ([`HostPool::wait_for_transfers`]).
    transfer_bytes: u64,
    /// Threads waiting in [`HostPool::wait_for_transfers`].
    waiters: usize,
    /// Transfer leases given back so far.
    transfer_returns: u64,
}

impl PoolState {
    /// Counts `bytes` more as running transfers' staging, where `transfer`.
    fn lend_to_transfer(&mut self, transfer: bool, bytes: u64) {
        if transfer {
            self.transfer_bytes += bytes;
        }
    }

    /// Counts `bytes` of running transfers' staging as back, where `transfer`.
    fn return_from_transfer(&mut self, transfer: bool, bytes: u64) {
        if transfer {
            take(&mut self.transfer_bytes, bytes, "pinned transfer bytes");
            self.transfer_returns += 1;
        }
    }
}

/// Counters of the pool, for telemetry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PinnedStats {
    /// Pinned bytes held from the driver.
    pub reserved_bytes: u64,
    /// Pinned bytes lent out (in use by copies or by the caller).
    pub lent_bytes: u64,
    /// Of `lent_bytes`, those held outside transfers: pinned buffers, prepared sets' regions,
    /// download views.
    pub held_bytes: u64,
    /// The most that held staging may take (`cap_bytes` less the reserve kept for transfers).
    pub held_limit_bytes: u64,
    /// The cap (`Config::pinned_cap_bytes`).
    pub cap_bytes: u64,
    /// Requests served by a free arena.
    pub hits: u64,
    /// Requests that needed a new arena from the driver.
    pub misses: u64,
    /// Arenas returned to the driver to make room or on trim.
    pub released: u64,
}

/// The pool.
pub(crate) struct HostPool {
    ctx: Arc<Context>,
    cap: u64,
    /// Bytes held staging may not take: kept for transfers.
    reserve: u64,
    state: Mutex<PoolState>,
    /// Signalled when a transfer's staging comes back while a transfer waits for some.
    returned: Condvar,
    hits: AtomicU64,
    misses: AtomicU64,
    released: AtomicU64,
    /// Whether arenas of whole huge pages are made of them ([`arena::make_huge`]): until one
    /// cannot be.
    huge: AtomicBool,
}

/// The pinned memory lent out that the caller can reach ([`PinnedBuffer`]s, batch
/// downloads' views), of every pool of the process: arena start -> (arena
/// bytes, lease), so that an `unsafe` copy given that memory, on any device (arenas are
/// portable), keeps the lease alive until it completes ([`listed_leases_in`]).
static LENT_BUFFERS: Mutex<BTreeMap<usize, (usize, Weak<HostLease>)>> = Mutex::new(BTreeMap::new());

/// The listed arena that holds byte `ptr`, live: `Ok` with its start and length. Pinned
/// memory of this crate, allocated portable and so mapped for every device with unified
/// addressing at the same address: a kernel may read or write it over the bus. Else `Err`
/// with a span `[from, to)` around `ptr` that held no live arena when asked (from the end of
/// the arena before it, or the dead arena that holds it, to the start of the next), so that
/// a caller walking many pageable ranges asks once per gap.
pub(crate) fn lent_extent(ptr: usize) -> Result<(usize, usize), (usize, usize)> {
    let buffers = lock(&LENT_BUFFERS);
    let before = buffers.range(..=ptr).next_back();
    let from = match before {
        Some((&start, &(bytes, ref lease))) if ptr < start.saturating_add(bytes) => {
            if lease.strong_count() > 0 {
                return Ok((start, bytes));
            }
            start
        }
        Some((&start, &(bytes, _))) => start.saturating_add(bytes),
        None => 0,
    };
    let to = buffers.range(ptr.saturating_add(1)..).next().map_or(usize::MAX, |(&start, _)| start);
    Err((from, to))
}

/// The leases of the listed memory (by any device's pool: see [`LENT_BUFFERS`]) whose arenas overlap
/// `[ptr, ptr + len)`: a copy that uses that memory keeps them, so that a buffer dropped
/// before the copy completes is not lent again while the copy still reads or writes it.
pub(crate) fn listed_leases_in(ptr: usize, len: usize) -> Vec<Arc<HostLease>> {
    let end = ptr.saturating_add(len);
    let buffers = lock(&LENT_BUFFERS);
    // Arenas do not overlap: walk back from the last one starting before the end while
    // they reach past the start.
    buffers
        .range(..end)
        .rev()
        .take_while(|&(&start, &(bytes, _))| start.saturating_add(bytes) > ptr)
        .filter_map(|(_, (_, lease))| lease.upgrade())
        .collect()
}

impl fmt::Debug for HostPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostPool").field("stats", &self.stats()).finish()
    }
}

/// A pinned region lent by the pool; it goes back to the pool when dropped.
pub(crate) struct HostLease {
    pool: Arc<HostPool>,
    arena: Option<Arena>,
    len: usize,
    /// Counted as held staging.
    held: bool,
    /// Listed in [`LENT_BUFFERS`] (unlisted when it drops).
    listed: bool,
    /// Counted in [`PoolState::transfer_bytes`]: lent to a running transfer, and not
    /// stranded ([`HostLease::strand`]).
    transfer: AtomicBool,
}

// SAFETY: through `&HostLease` only the address and length are read; the bytes are reached
// by `unsafe` methods whose callers promise no conflicting access (or through `&mut`).
unsafe impl Sync for HostLease {}

impl fmt::Debug for HostLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostLease").field("len", &self.len).field("arena_bytes", &self.arena_bytes()).finish()
    }
}

impl HostPool {
    /// A pool of at most `cap` bytes, of which held staging may take `cap - reserve`,
    /// making arenas of whole huge pages of them where `huge` (see [`arena`]).
    pub(crate) fn new(ctx: Arc<Context>, cap: u64, reserve: u64, huge: bool) -> HostPool {
        HostPool {
            ctx,
            cap,
            reserve: reserve.min(cap),
            state: Mutex::new(PoolState::default()),
            returned: Condvar::new(),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            released: AtomicU64::new(0),
            huge: AtomicBool::new(huge),
        }
    }

    /// Whether the pool makes its arenas of huge pages (those of a whole number of them).
    pub(crate) fn makes_huge_pages(&self) -> bool {
        self.huge.load(Ordering::Relaxed)
    }

    /// A new arena of `bytes`: of huge pages where the pool makes them and the size is a
    /// whole number of them, else (and once such an arena could not be made) by
    /// `cuMemHostAlloc`.
    fn make_arena(&self, bytes: u64) -> Result<Arena> {
        let raw = self.ctx.bind()?;
        if bytes.is_multiple_of(HUGE_PAGE) && self.makes_huge_pages() {
            match arena::make_huge(raw, bytes) {
                Ok(Some(arena)) => return Ok(arena),
                // No mapping of huge pages, or no registration: the next would fare the same.
                Ok(None) | Err(_) => self.huge.store(false, Ordering::Relaxed),
            }
        }
        arena::make_host_alloc(raw, bytes)
    }

    /// How many leases of `len` bytes the cap holds at once (at least 1: a single lease
    /// within the cap is always servable).
    pub(crate) fn leases_within_cap(&self, len: u64) -> usize {
        (self.cap / arena_bytes(len, self.cap)).max(1) as usize
    }

    /// The most that held staging may take.
    fn held_limit(&self) -> u64 {
        self.cap - self.reserve
    }

    /// Lends a region of `len` bytes (at least 1) for a transfer, or `None` when the cap is
    /// reached by arenas in use. Fails when `len` alone is over the cap, or the driver fails.
    pub(crate) fn try_acquire(self: &Arc<Self>, len: usize) -> Result<Option<HostLease>> {
        self.try_acquire_as(len, false)
    }

    /// As [`HostPool::try_acquire`], for held staging (`held`): fails with
    /// [`Error::PinnedReserved`] when held staging would pass `cap - reserve`.
    pub(crate) fn try_acquire_as(self: &Arc<Self>, len: usize, held: bool) -> Result<Option<HostLease>> {
        self.try_acquire_with(len, held, false)
    }

    /// [`HostPool::try_acquire_as`], the lease counted as a running transfer's staging
    /// where `transfer`.
    fn try_acquire_with(
        self: &Arc<Self>,
        len: usize,
        held: bool,
        transfer: bool,
    ) -> Result<Option<HostLease>> {
        let len64 = len.max(1) as u64;
        if len64 > self.cap {
            return Err(Error::PinnedCapExceeded { requested: len64, cap: self.cap });
        }
        let mut bytes = arena_bytes(len64, self.cap);
        let mut evicted = Vec::new();
        {
            let mut state = lock(&self.state);
            if held {
                // A request within the held limit is not refused for its arena's rounding:
                // it takes an arena of its own pages instead.
                let room = self.held_limit().saturating_sub(state.held);
                if len64 <= room && bytes > room {
                    bytes = len64.checked_next_multiple_of(PAGE).unwrap_or(len64).min(room);
                }
                self.check_held(&state, bytes, len64)?;
                state.held += bytes;
            }
            if let Some(arena) = state.free.get_mut(&bytes).and_then(Vec::pop) {
                state.lent += bytes;
                state.lend_to_transfer(transfer, bytes);
                drop(state);
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(Some(self.lease(arena, len, held, transfer)));
            }
            // Make room: first retry arenas the driver refused to free before, then release
            // free arenas of other sizes, largest first.
            if state.reserved + bytes > self.cap && !state.unreleased.is_empty() {
                let retry = std::mem::take(&mut state.unreleased);
                take(
                    &mut state.reserved,
                    retry.iter().map(|a| a.bytes).sum::<u64>(),
                    "pinned reserved bytes",
                );
                evicted.extend(retry);
            }
            while state.reserved + bytes > self.cap {
                let Some(mut entry) = state.free.last_entry() else { break };
                match entry.get_mut().pop() {
                    Some(arena) => {
                        take(&mut state.reserved, arena.bytes, "pinned reserved bytes");
                        evicted.push(arena);
                    }
                    // Lists emptied by hits stay in the map (to keep their capacity) until
                    // eviction passes over them.
                    None => {
                        entry.remove();
                    }
                }
            }
            if state.reserved + bytes > self.cap {
                if held {
                    take(&mut state.held, bytes, "pinned held bytes");
                }
                drop(state);
                // A failed eviction is not this request's failure: the arena stays listed
                // for the next trim, which reports it.
                let _ = self.free_arenas(evicted);
                return Ok(None);
            }
            state.reserved += bytes;
            state.lent += bytes;
            state.lend_to_transfer(transfer, bytes);
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let _ = self.free_arenas(evicted);
        match self.make_arena(bytes) {
            Ok(arena) => Ok(Some(self.lease(arena, len, held, transfer))),
            Err(e) => {
                let mut state = lock(&self.state);
                take(&mut state.reserved, bytes, "pinned reserved bytes");
                take(&mut state.lent, bytes, "pinned lent bytes");
                if held {
                    take(&mut state.held, bytes, "pinned held bytes");
                }
                state.return_from_transfer(transfer, bytes);
                Err(e)
            }
        }
    }

    /// Fails unless `bytes` more of held staging (for a request of `requested`) stay within
    /// the held limit.
    fn check_held(&self, state: &PoolState, bytes: u64, requested: u64) -> Result<()> {
        if state.held + bytes > self.held_limit() {
            return Err(Error::PinnedReserved {
                requested,
                held: state.held,
                limit: self.held_limit(),
                cap: self.cap,
            });
        }
        Ok(())
    }

    fn lease(self: &Arc<Self>, arena: Arena, len: usize, held: bool, transfer: bool) -> HostLease {
        let transfer = AtomicBool::new(transfer);
        HostLease { pool: Arc::clone(self), arena: Some(arena), len, held, listed: false, transfer }
    }

    fn give_back(&self, arena: Arena, held: bool, transfer: bool) {
        let mut state = lock(&self.state);
        take(&mut state.lent, arena.bytes, "pinned lent bytes");
        if held {
            take(&mut state.held, arena.bytes, "pinned held bytes");
        }
        state.return_from_transfer(transfer, arena.bytes);
        if transfer && state.waiters > 0 {
            self.returned.notify_all();
        }
        state.free.entry(arena.bytes).or_default().push(arena);
    }

    /// [`HostPool::try_acquire`] for a running transfer: the lease counts as running
    /// transfers' staging until it comes back ([`HostPool::wait_for_transfers`]).
    pub(crate) fn try_acquire_for_transfer(self: &Arc<Self>, len: usize) -> Result<Option<HostLease>> {
        self.try_acquire_with(len, false, true)
    }

    /// For a transfer that found the pool full with no copy in flight to wait for: where
    /// running transfers hold staging, waits (up to `most`) for some to come back, and
    /// returns how many transfer leases have come back so far (a measure of progress);
    /// with none out, returns `None` at once.
    ///
    /// Transfer staging comes back without its holder waiting for anyone: as its copies
    /// complete (a thread that retired them may still be handing them back), or as a
    /// streaming download finishes copying its chunks out. A transfer asks for more only
    /// once every lease it took is submitted, so transfers never wait for each other in a
    /// circle; the caller still gives up where nothing moves for a while.
    pub(crate) fn wait_for_transfers(&self, most: Duration) -> Option<u64> {
        let mut state = lock(&self.state);
        if state.transfer_bytes == 0 {
            return None;
        }
        state.waiters += 1;
        let (mut state, _) = self.returned.wait_timeout(state, most).unwrap_or_else(|e| e.into_inner());
        state.waiters -= 1;
        Some(state.transfer_returns)
    }

    fn free_arenas(&self, arenas: Vec<Arena>) -> Result<()> {
        if arenas.is_empty() {
            return Ok(());
        }
        let raw = match self.ctx.bind() {
            Ok(raw) => raw,
            Err(e) => {
                self.keep_unreleased(arenas);
                return Err(e);
            }
        };
        let mut result = Ok(());
        let mut failed = Vec::new();
        for arena in arenas {
            // SAFETY: the arena is free (no lease, so no copy uses it) and is removed from
            // the pool, so it is freed once.
            match unsafe { arena::free(raw, &arena) } {
                Ok(()) => {
                    self.released.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    result = result.and(Err(e));
                    failed.push(arena);
                }
            }
        }
        self.keep_unreleased(failed);
        result
    }

    /// Takes back arenas the driver refused to free: still held, so counted, and retried by
    /// the next trim.
    fn keep_unreleased(&self, arenas: Vec<Arena>) {
        if arenas.is_empty() {
            return;
        }
        let mut state = lock(&self.state);
        state.reserved += arenas.iter().map(|a| a.bytes).sum::<u64>();
        state.unreleased.extend(arenas);
    }

    /// Allocates free arenas of `arena_len` bytes until `total` bytes are held (or the cap
    /// is reached), so that the first copies find staging ready.
    pub(crate) fn prewarm(self: &Arc<Self>, arena_len: usize, total: u64) -> Result<()> {
        let mut leases = Vec::new();
        while lock(&self.state).reserved < total {
            match self.try_acquire(arena_len)? {
                Some(lease) => leases.push(lease),
                None => break,
            }
        }
        Ok(())
    }

    /// Returns every free arena to the driver. Returns the bytes released.
    pub(crate) fn trim(&self) -> Result<u64> {
        let arenas: Vec<Arena> = {
            let mut state = lock(&self.state);
            let mut arenas: Vec<Arena> = std::mem::take(&mut state.free).into_values().flatten().collect();
            arenas.append(&mut state.unreleased);
            take(&mut state.reserved, arenas.iter().map(|a| a.bytes).sum::<u64>(), "pinned reserved bytes");
            arenas
        };
        let bytes = arenas.iter().map(|a| a.bytes).sum();
        self.free_arenas(arenas)?;
        Ok(bytes)
    }

    pub(crate) fn stats(&self) -> PinnedStats {
        let state = lock(&self.state);
        PinnedStats {
            reserved_bytes: state.reserved,
            lent_bytes: state.lent,
            held_bytes: state.held,
            held_limit_bytes: self.held_limit(),
            cap_bytes: self.cap,
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            released: self.released.load(Ordering::Relaxed),
        }
    }
}

impl Drop for HostPool {
    fn drop(&mut self) {
        // Every lease holds the pool, so none is out: all arenas are free. An arena the
        // driver refused is kept by the first trim and retried by the second.
        let _ = self.trim().or_else(|_| self.trim());
    }
}

impl HostLease {
    /// The usable length (what was asked for).
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn arena_bytes(&self) -> u64 {
        self.arena.as_ref().map_or(0, |a| a.bytes)
    }

    /// Shares the lease and lists it among the pinned memory the caller can reach (a
    /// [`PinnedBuffer`], a batch download's views), so that an `unsafe`
    /// asynchronous copy given that memory keeps the lease until it completes
    /// ([`listed_leases_in`]), even if its holder lets go first.
    pub(crate) fn into_listed(mut self) -> Arc<HostLease> {
        self.listed = true;
        let lease = Arc::new(self);
        let (start, bytes) = (lease.as_ptr() as usize, lease.arena_bytes() as usize);
        lock(&LENT_BUFFERS).insert(start, (bytes, Arc::downgrade(&lease)));
        lease
    }

    /// Stops counting the lease as a running transfer's staging: it will not come back soon
    /// (after a lost context a copy may still use it, so it is kept until the lane goes
    /// away), and transfers that find the pool full must not wait for it.
    pub(crate) fn strand(&self) {
        if self.transfer.swap(false, Ordering::Relaxed) {
            take(&mut lock(&self.pool.state).transfer_bytes, self.arena_bytes(), "pinned transfer bytes");
        }
    }

    /// The start of the region.
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.arena.as_ref().expect("present until drop").ptr.as_ptr()
    }

    /// The region as bytes.
    ///
    /// # Safety
    /// No copy that writes the region may be in flight.
    pub(crate) unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the arena holds at least `len` bytes, lives as long as the lease, and the
        // caller promises no device write is in flight.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len) }
    }

    /// The region as mutable bytes.
    ///
    /// # Safety
    /// No copy that reads or writes the region may be in flight.
    pub(crate) unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as for as_slice, and `&mut self` makes the access exclusive on the host.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len) }
    }
}

impl Drop for HostLease {
    fn drop(&mut self) {
        if self.listed {
            // Before the arena goes back: no copy can find it once it may be lent again.
            lock(&LENT_BUFFERS).remove(&(self.as_ptr() as usize));
        }
        if let Some(arena) = self.arena.take() {
            self.pool.give_back(arena, self.held, *self.transfer.get_mut());
        }
    }
}

/// Pinned host memory lent by a device's pinned pool: as fast to copy from or into as host
/// memory gets. It goes back to the pool (not to the driver) when dropped, so acquiring one
/// again is a matter of nanoseconds. Obtained from [`Device::pinned`](crate::Device::pinned).
///
/// A buffer given to [`Device::upload_async_at`](crate::Device::upload_async_at) or
/// [`Device::download_async_at`](crate::Device::download_async_at) may be dropped before the
/// copy completes: its memory then goes back to the pool only once the copy is done (the
/// copy keeps it), never to another user while the DMA still reads or writes it.
pub struct PinnedBuffer {
    /// Shared with the copies in flight that use the buffer's memory.
    lease: Arc<HostLease>,
}

impl fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer").field("len", &self.lease.len()).finish()
    }
}

impl PinnedBuffer {
    pub(crate) fn new(lease: HostLease) -> PinnedBuffer {
        PinnedBuffer { lease: lease.into_listed() }
    }
}

impl std::ops::Deref for PinnedBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the region holds `len` bytes and lives as long as the lease. This crate
        // hands a PinnedBuffer's memory to its own copies only through a scope's batches,
        // which borrow the slice until the copies are done; the caller's `unsafe` copies
        // promise that nothing touches it while they run.
        unsafe { std::slice::from_raw_parts(self.lease.as_ptr(), self.lease.len()) }
    }
}

impl std::ops::DerefMut for PinnedBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access exclusive on the host (the
        // other references to the lease, held by copies in flight, only keep it alive).
        unsafe { std::slice::from_raw_parts_mut(self.lease.as_ptr(), self.lease.len()) }
    }
}

#[cfg(test)]
mod tests;

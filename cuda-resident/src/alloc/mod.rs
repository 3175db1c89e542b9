//! The resident store: budgeted device memory, sub-allocated from slabs.
//!
//! - Buffers up to [`classes::MAX_CLASS_BYTES`] come from size classes. A freed block goes
//!   to a per-class cache, so the next allocation of that class is a vector pop under an
//!   uncontended lock: no driver call, no search.
//! - Larger buffers up to the slab size are carved best-fit from slabs ([`ranges`]).
//! - Buffers past the slab size get a dedicated `cuMemAlloc`. A freed dedicated block is
//!   kept (not given back to the driver) and serves the next allocation it fits with at
//!   most a quarter to spare: a checkpoint loaded again after its buffers were dropped gets
//!   the same memory back without a driver call. Memory the driver has just taken back is
//!   slow to write for a while (the first 16 MiB DMAs into memory freed and allocated again
//!   took 0.66-1.38 ms instead of 0.35 on an H100: docs/runs/2026-12-07-h100-load-start.md).
//!   Trim, and any refusal by the budget or the driver, gives kept blocks back.
//!
//! **Shards.** Handles and caches live in [`SHARDS`] shards, each behind its own lock; a
//! thread uses the shard it was assigned on first use, so threads allocating at once do not
//! contend. The shard is encoded in the handle, so a free from any thread finds it. Only
//! cache misses take the global lock (to carve from slabs or grow). A cache hit writes only
//! its shard's cache lines: every count the allocator keeps (bytes, the library's bytes,
//! frees) is kept per shard, and the lock-free views of them are sums over the shards, so
//! threads on different shards scale without sharing a written line.
//!
//! **Validity.** Each shard counts its frees ([`Allocator::frees_in`]). While a shard's count
//! is unchanged, no handle of that shard has been freed, so a batch may reuse a resolution
//! it kept from an earlier batch without asking again (`engine::table::BufferTable`); a free
//! in another shard leaves it valid.
//!
//! **Handles** carry the allocator's id, a slot index and a generation. A freed handle's
//! generation no longer matches its slot, a handle of another allocator has another id: both
//! are errors, never a dangling pointer.
//!
//! **Budget.** New device memory is taken only while the holdings stay under
//! [`budget::limit`](crate::budget::limit), with live free memory read at that moment. When
//! the budget or the driver says no, cached blocks and empty slabs are released (trim) and
//! the request retried once.
//!
//! **Deferred frees.** Each buffer records the last submission of each lane that used it. A
//! free while such work is in flight invalidates the handle at once but keeps the memory out
//! of circulation until the work completes.

pub mod classes;
mod driver;
pub mod ranges;
mod stats;

use std::cell::Cell;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

use classes::{CLASS_COUNT, class_bytes, class_of, round_to_granule};
use ranges::{Ranges, SlabId};

use crate::context::Context;
use crate::counter::take;
use crate::error::{Error, Result};
use crate::sync::{Mutex, lock};

pub use crate::handle::ResidentBuffer;
use crate::handle::{SHARD_BITS, SHARDS};
pub use stats::AllocatorStats;

/// For each lane, the sequence number of the last submission that used a buffer (0: none).
pub(crate) type LastUse = [u64; 2];

/// How many buffers on [`Allocator::mark_used_many`] fetches a buffer's slot ahead.
const AHEAD: usize = 64;

/// Asks the CPU to bring the cache line at `at` in, where it has a way to (x86-64); a hint,
/// never a read: `at` need not point at anything.
#[inline(always)]
fn prefetch<T>(at: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing and faults on no address.
    unsafe {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_T0>(at.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}

/// Where a block's memory came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    /// A size-class block carved from a slab; cached on free.
    Class(u8),
    /// A best-fit range of a slab; returned to the slab on free.
    Range,
    /// A dedicated driver allocation; kept for reuse on free, given back by trim.
    Dedicated,
}

#[derive(Clone, Copy, Debug)]
struct Block {
    ptr: u64,
    bytes: u64,
    slab: SlabId,
    origin: Origin,
}

/// A buffer's record. One cache line each (56 bytes of fields, aligned to 64): a batch's
/// submit checks and marks every buffer it names (`mark_used_many`), in the order the batch
/// named them, which for a buffer per copy in shuffled order is no order at all; unaligned,
/// seven slots in eight straddled two lines.
#[derive(Clone, Copy, Debug)]
#[repr(align(64))]
struct Slot {
    block: Block,
    len: u64,
    generation: u32,
    live: bool,
    /// The library's own (device staging, prepared sets' tables), not a caller's.
    library: bool,
    last_use: LastUse,
}

const _: () = assert!(std::mem::size_of::<Slot>() == 64, "a slot is one cache line");

struct Shard {
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    cache: [Vec<Block>; CLASS_COUNT],
    /// Bytes requested by callers' live buffers of this shard.
    allocated: u64,
    /// Bytes of the library's own live buffers of this shard.
    library: u64,
    /// Bytes of the blocks of live buffers.
    footprint: u64,
    /// Bytes in this shard's class caches.
    cached: u64,
    allocations: u64,
    frees: u64,
}

/// A shard and lock-free mirrors of its counts, on cache lines of their own (128 bytes:
/// some CPUs fetch 64-byte lines in pairs). The mirrors are written under the shard's lock,
/// with plain stores (one writer at a time), and read without it.
#[repr(align(128))]
struct ShardCell {
    state: Mutex<Shard>,
    /// [`Shard::allocated`].
    allocated: AtomicU64,
    /// [`Shard::library`].
    library: AtomicU64,
    /// [`Shard::frees`], stored with `Release` after the freed slot is marked dead:
    /// [`Allocator::frees_in`].
    frees: AtomicU64,
}

/// A value on cache lines of its own, so that writes to it slow no reader of its neighbours.
#[repr(align(128))]
struct Padded<T>(T);

struct Slab {
    ptr: u64,
    bytes: u64,
}

#[derive(Default)]
struct Global {
    slabs: Vec<Option<Slab>>,
    ranges: Ranges,
    /// Bytes held from the driver: slabs plus dedicated allocations.
    reserved: u64,
    peak_reserved: u64,
    dedicated: u64,
    /// Freed dedicated blocks kept for reuse (part of `dedicated` and `reserved`).
    kept: Vec<Block>,
    /// Freed while in use by a copy: memory waits for the copy.
    deferred: Vec<(Block, LastUse)>,
    /// Driver allocations whose `cuMemFree` failed, as `(pointer, bytes)`: still counted in
    /// `reserved`, retried by the next trim and when the device goes away.
    unreleased: Vec<Unreleased>,
    driver_allocations: u64,
    driver_frees: u64,
    trims: u64,
    budget_refusals: u64,
    deferred_frees: u64,
}

/// A driver allocation on its way back to the driver: a slab or a dedicated block.
#[derive(Clone, Copy, Debug)]
struct Unreleased {
    ptr: u64,
    bytes: u64,
    /// A dedicated block (counted in `Global::dedicated` until freed), not a slab.
    dedicated: bool,
}

/// What the allocator needs to know about the device.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AllocatorConfig {
    pub(crate) total_memory: u64,
    pub(crate) budget_fraction: f64,
    pub(crate) slab_bytes: u64,
}

static NEXT_ALLOCATOR_ID: AtomicU32 = AtomicU32::new(1);
static NEXT_THREAD_SHARD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's shard, [`SHARDS`] until its first allocation.
    static THREAD_SHARD: Cell<usize> = const { Cell::new(SHARDS) };
}

#[inline]
fn current_shard() -> usize {
    THREAD_SHARD.with(|s| match s.get() {
        SHARDS => {
            // Once per thread: the only write to a shared line on this path.
            let shard = NEXT_THREAD_SHARD.fetch_add(1, Ordering::Relaxed) % SHARDS;
            s.set(shard);
            shard
        }
        shard => shard,
    })
}

/// Makes this thread allocate in shard `shard` from now on, as a thread assigned it would.
#[cfg(test)]
pub(crate) fn use_shard(shard: usize) {
    assert!(shard < SHARDS);
    THREAD_SHARD.with(|s| s.set(shard));
}

/// The driver operations the allocator needs; the device's context in production, a model
/// in tests.
pub(crate) trait DeviceMemory: Send + Sync {
    /// `(free, total)` device memory now.
    fn mem_get_info(&self) -> Result<(u64, u64)>;
    /// A new allocation.
    fn mem_alloc(&self, bytes: u64) -> Result<u64>;
    /// Frees an allocation.
    fn mem_free(&self, ptr: u64) -> Result<()>;
}

impl DeviceMemory for Arc<Context> {
    fn mem_get_info(&self) -> Result<(u64, u64)> {
        self.bind()?.mem_get_info()
    }
    fn mem_alloc(&self, bytes: u64) -> Result<u64> {
        self.bind()?.mem_alloc(bytes)
    }
    fn mem_free(&self, ptr: u64) -> Result<()> {
        self.bind()?.mem_free(ptr)
    }
}

/// The resident store of one device.
///
/// Its own fields are read on every allocation and free and written never (the shards and
/// the global state live elsewhere or on lines of their own), and it sits on cache lines of
/// its own, so that nothing the device writes next to it (telemetry, lanes) slows them.
#[repr(align(128))]
pub(crate) struct Allocator<M: DeviceMemory> {
    id: u32,
    ordinal: usize,
    memory: M,
    config: AllocatorConfig,
    shards: Box<[ShardCell]>,
    global: Padded<Mutex<Global>>,
}

impl<M: DeviceMemory> fmt::Debug for Allocator<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Allocator").field("id", &self.id).field("stats", &self.stats()).finish()
    }
}

impl<M: DeviceMemory> Allocator<M> {
    pub(crate) fn new(memory: M, ordinal: usize, config: AllocatorConfig) -> Allocator<M> {
        let shards = (0..SHARDS)
            .map(|_| ShardCell {
                state: Mutex::new(Shard {
                    slots: Vec::new(),
                    free_slots: Vec::new(),
                    cache: std::array::from_fn(|_| Vec::new()),
                    allocated: 0,
                    library: 0,
                    footprint: 0,
                    cached: 0,
                    allocations: 0,
                    frees: 0,
                }),
                allocated: AtomicU64::new(0),
                library: AtomicU64::new(0),
                frees: AtomicU64::new(0),
            })
            .collect();
        Allocator {
            id: NEXT_ALLOCATOR_ID.fetch_add(1, Ordering::Relaxed),
            ordinal,
            memory,
            config,
            shards,
            global: Padded(Mutex::new(Global::default())),
        }
    }

    /// Allocates `len` bytes. `is_idle` tells whether a buffer's last use has completed (for
    /// reclaiming deferred frees on the slow path).
    pub(crate) fn allocate(&self, len: u64, is_idle: &dyn Fn(LastUse) -> bool) -> Result<ResidentBuffer> {
        self.allocate_as(len, false, is_idle)
    }

    /// As [`Allocator::allocate`]; `library`: the buffer is the library's own, counted apart
    /// from callers' bytes.
    pub(crate) fn allocate_as(
        &self,
        len: u64,
        library: bool,
        is_idle: &dyn Fn(LastUse) -> bool,
    ) -> Result<ResidentBuffer> {
        if len == 0 {
            return Err(Error::ZeroSizedAllocation);
        }
        let shard_index = current_shard();
        let class = class_of(len);
        if let Some(class) = class {
            let mut shard = lock(&self.shards[shard_index].state);
            if let Some(block) = shard.cache[class].pop() {
                take(&mut shard.cached, block.bytes, "cached bytes");
                return Ok(self.insert(shard_index, &mut shard, block, len, library));
            }
        }
        let block = match class {
            Some(class) => self.carve(len, class_bytes(class), Origin::Class(class as u8), is_idle)?,
            None => {
                // Past the device's memory no budget can serve it (and rounding could overflow).
                let bytes =
                    round_to_granule(len).filter(|&b| b <= self.config.total_memory).ok_or_else(|| {
                        let limit = (self.config.budget_fraction * self.config.total_memory as f64) as u64;
                        self.refused(len, len, limit, lock(&self.global.0).reserved, false)
                    })?;
                let origin = if bytes <= self.config.slab_bytes { Origin::Range } else { Origin::Dedicated };
                self.carve(len, bytes, origin, is_idle)?
            }
        };
        let mut shard = lock(&self.shards[shard_index].state);
        Ok(self.insert(shard_index, &mut shard, block, len, library))
    }

    fn insert(
        &self,
        shard_index: usize,
        shard: &mut Shard,
        block: Block,
        len: u64,
        library: bool,
    ) -> ResidentBuffer {
        let slot = Slot { block, len, generation: 0, live: true, library, last_use: [0; 2] };
        let slot_index = match shard.free_slots.pop() {
            Some(i) => {
                let s = &mut shard.slots[i as usize];
                *s = Slot { generation: s.generation, ..slot };
                i
            }
            None => {
                shard.slots.push(slot);
                (shard.slots.len() - 1) as u32
            }
        };
        let cell = &self.shards[shard_index];
        if library {
            shard.library += len;
            cell.library.store(shard.library, Ordering::Relaxed);
        } else {
            shard.allocated += len;
            cell.allocated.store(shard.allocated, Ordering::Relaxed);
        }
        shard.footprint += block.bytes;
        shard.allocations += 1;
        ResidentBuffer {
            owner: self.id,
            index: (slot_index << SHARD_BITS) | shard_index as u32,
            generation: shard.slots[slot_index as usize].generation,
        }
    }

    /// Checks a handle and runs `f` on its live slot under the shard's lock.
    fn with_slot<T>(&self, buffer: ResidentBuffer, f: impl FnOnce(&mut Slot) -> T) -> Result<T> {
        let (shard_index, slot_index) = self.locate(buffer)?;
        let mut shard = lock(&self.shards[shard_index].state);
        self.live_slot(&mut shard.slots, buffer, slot_index).map(f)
    }

    /// The slot of `buffer` (at `slot_index` of its shard's `slots`), if the handle is live.
    fn live_slot<'s>(
        &self,
        slots: &'s mut [Slot],
        buffer: ResidentBuffer,
        slot_index: usize,
    ) -> Result<&'s mut Slot> {
        match slots.get_mut(slot_index) {
            Some(slot) if slot.live && slot.generation == buffer.generation => Ok(slot),
            Some(_) => Err(Error::FreedBuffer { buffer }),
            None => Err(self.foreign(buffer)),
        }
    }

    fn locate(&self, buffer: ResidentBuffer) -> Result<(usize, usize)> {
        if buffer.owner != self.id {
            return Err(self.foreign(buffer));
        }
        Ok((buffer.shard(), buffer.slot()))
    }

    fn foreign(&self, buffer: ResidentBuffer) -> Error {
        Error::ForeignBuffer { buffer, device: self.ordinal }
    }

    /// This allocator's id: the `owner` of the handles it makes.
    #[inline]
    pub(crate) fn id(&self) -> u32 {
        self.id
    }

    /// How many buffers of shard `shard` (a handle's [`ResidentBuffer::shard`]) have been
    /// freed. While it is unchanged, every handle of that shard that resolved after it was
    /// read is still live and resolves to the same memory: a live slot's memory never
    /// changes, and a free marks its slot dead before it bumps the count, both under the
    /// shard's lock. So a resolution either saw the slot dead (and failed), or came before
    /// the free, whose bump then comes after this read: in this thread's view the count has
    /// changed once the free happened-before (Release here, Acquire there).
    #[inline]
    pub(crate) fn frees_in(&self, shard: usize) -> u64 {
        self.shards[shard].frees.load(Ordering::Acquire)
    }

    /// `(device pointer, length)` of a live buffer.
    pub(crate) fn resolve(&self, buffer: ResidentBuffer) -> Result<(u64, u64)> {
        self.with_slot(buffer, |slot| (slot.block.ptr, slot.len))
    }

    /// Records that submission `seq` of lane `lane` uses `buffer`.
    pub(crate) fn mark_used(&self, buffer: ResidentBuffer, lane: usize, seq: u64) -> Result<()> {
        self.with_slot(buffer, |slot| slot.last_use[lane] = slot.last_use[lane].max(seq))
    }

    /// Checks every buffer and records that submission `seq` of lane `lane` uses it, handing
    /// each one's address and length to `each`. Returns the latest submission of the other
    /// lane that used any of them, so that the caller can order after it. Fails on the first
    /// stale or foreign handle (a mark already made is harmless: it names a submission that
    /// comes later anyway).
    pub(crate) fn mark_used_many(
        &self,
        buffers: impl Iterator<Item = ResidentBuffer>,
        lane: usize,
        seq: u64,
        mut each: impl FnMut(u64, u64),
    ) -> Result<u64> {
        let other = 1 - lane;
        let mut latest_other = 0;
        // Buffers of one shard in a row (those one thread allocated) take its lock once; one
        // lock is held at a time.
        let mut held = None;
        // The slots of the buffers `AHEAD` places on are fetched into the cache while this
        // one is marked: a batch of buffers named in no order of theirs (each its own, say)
        // would otherwise wait on a cache miss a buffer.
        let mut buffers = buffers.fuse();
        let mut ahead = [None; AHEAD];
        ahead.iter_mut().for_each(|b| *b = buffers.next());
        let mut turn = 0;
        while let Some(buffer) = ahead[turn].take() {
            ahead[turn] = buffers.next();
            let (shard_index, slot_index) = self.locate(buffer)?;
            let shard = match &mut held {
                Some((index, shard)) if *index == shard_index => shard,
                _ => {
                    held = None;
                    &mut held.insert((shard_index, lock(&self.shards[shard_index].state))).1
                }
            };
            if let Some(later) = ahead[turn]
                && later.shard() == shard_index
            {
                prefetch(shard.slots.as_ptr().wrapping_add(later.slot()));
            }
            turn = (turn + 1) % AHEAD;
            let slot = self.live_slot(&mut shard.slots, buffer, slot_index)?;
            slot.last_use[lane] = slot.last_use[lane].max(seq);
            latest_other = latest_other.max(slot.last_use[other]);
            each(slot.block.ptr, slot.len);
        }
        Ok(latest_other)
    }

    /// Checks that every one of `buffers` is live, as [`Allocator::mark_used_many`] does
    /// (one lock per run of one shard's buffers), without marking any: submission 0 comes
    /// before every real one, so no mark moves. Fails on the first stale or foreign handle.
    pub(crate) fn check_live_many(&self, buffers: impl Iterator<Item = ResidentBuffer>) -> Result<()> {
        self.mark_used_many(buffers, 0, 0, |_, _| ()).map(drop)
    }

    /// Frees `buffer`. The handle is invalid at once; the memory is reused at once when no
    /// copy uses it (`is_idle`, asked under a shard lock: it must not lock a lane), else
    /// once the copies complete (reclaimed on the next slow-path allocation or trim).
    pub(crate) fn free(&self, buffer: ResidentBuffer, is_idle: &dyn Fn(LastUse) -> bool) -> Result<()> {
        let (shard_index, slot_index) = self.locate(buffer)?;
        let cell = &self.shards[shard_index];
        let mut shard = lock(&cell.state);
        let slot = match shard.slots.get_mut(slot_index) {
            Some(slot) if slot.live && slot.generation == buffer.generation => slot,
            Some(_) => return Err(Error::FreedBuffer { buffer }),
            None => return Err(self.foreign(buffer)),
        };
        slot.live = false;
        slot.generation = slot.generation.wrapping_add(1);
        let (block, len, last_use, retire, library) =
            (slot.block, slot.len, slot.last_use, slot.generation == u32::MAX, slot.library);
        if !retire {
            // A slot whose generation is exhausted is never reused, so no old handle can
            // ever match it again.
            shard.free_slots.push(slot_index as u32);
        }
        if library {
            take(&mut shard.library, len, "library bytes");
            cell.library.store(shard.library, Ordering::Relaxed);
        } else {
            take(&mut shard.allocated, len, "allocated bytes");
            cell.allocated.store(shard.allocated, Ordering::Relaxed);
        }
        take(&mut shard.footprint, block.bytes, "footprint bytes");
        shard.frees += 1;
        // Under the shard lock, after the slot is dead: see `frees_in`. This shard's own line,
        // a plain store: frees on other shards never touch it.
        cell.frees.store(shard.frees, Ordering::Release);
        // A buffer no copy ever used is idle without asking the lanes.
        if last_use != [0; 2] && !is_idle(last_use) {
            drop(shard);
            let mut global = lock(&self.global.0);
            global.deferred_frees += 1;
            global.deferred.push((block, last_use));
            return Ok(());
        }
        if let Origin::Class(class) = block.origin {
            shard.cached += block.bytes;
            shard.cache[class as usize].push(block);
            return Ok(());
        }
        drop(shard);
        let mut global = lock(&self.global.0);
        self.retire(&mut global, block)
    }

    /// Frees every driver allocation. Called when the device goes away, after all copies.
    pub(crate) fn release_all(&mut self) -> Result<()> {
        let mut ptrs: Vec<u64> = Vec::new();
        for cell in self.shards.iter_mut() {
            let shard = cell.state.get_mut().unwrap_or_else(|e| e.into_inner());
            let live_dedicated = shard.slots.iter().filter(|s| s.live && s.block.origin == Origin::Dedicated);
            ptrs.extend(live_dedicated.map(|s| s.block.ptr));
        }
        let global = self.global.0.get_mut().unwrap_or_else(|e| e.into_inner());
        ptrs.extend(
            global.deferred.drain(..).filter(|(b, _)| b.origin == Origin::Dedicated).map(|(b, _)| b.ptr),
        );
        ptrs.extend(global.kept.drain(..).map(|b| b.ptr));
        ptrs.extend(global.slabs.drain(..).flatten().map(|slab| slab.ptr));
        ptrs.extend(global.unreleased.drain(..).map(|memory| memory.ptr));
        global.reserved = 0;
        global.dedicated = 0;
        // Free everything even if one call fails (each failed free is tried once more);
        // report the first failure.
        let mut result = Ok(());
        for ptr in ptrs {
            result = result.and(crate::raw::release_retrying(|| self.memory.mem_free(ptr)));
        }
        result
    }
}

#[cfg(test)]
mod tests;

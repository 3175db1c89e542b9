//! Scoped transfers: batches whose other end is the caller's own memory, borrowed until every
//! transfer of the scope has completed ([`Device::scope`](crate::Device::scope)).
//!
//! A batch of a scope takes caller slices for 'scope (the scope's whole life), and the scope
//! waits for every submission made in it before it returns, even when its closure panics, as
//! `std::thread::scope` joins its threads. So the GPU may read and write the caller's memory
//! after `submit` returns, with no copy through staging, and no safe code can touch that
//! memory until the copies are done.
//!
//! Ranges that follow each other in pinned host memory (a host cache's slots), 1 MiB or more
//! in all, move as runs: one DMA a chunk into or out of device staging and one scatter or
//! gather launch inside the device. Other ranges in this crate's pinned pool
//! ([`Device::pinned`](crate::Device::pinned): a [`PinnedBuffer`](crate::PinnedBuffer), a
//! download's views), which is mapped for the device, move by one DMA each when at least
//! `Config::direct_threshold` long, else by the copy kernel reading or writing them over the
//! bus, many to a launch. Memory pinned by `Device::pin_host` moves in place in runs only
//! (by one DMA a range for the piece of a run, shorter than a run, that crosses into a
//! registration).
//! Everything else (pageable memory, short pieces of registered memory) takes the staged
//! path of ordinary batches: uploads are copied into staging at submit; downloads land in
//! staging and are copied out before `submit` returns.

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::BufferTable;
use super::upload::RESERVE_MOST;
use crate::alloc::ResidentBuffer;
use crate::engine::core::Core;
use crate::engine::host::Piece;
use crate::engine::order::Ranges;
use crate::engine::{Exec, wait};
use crate::error::{Error, Result};
use crate::host_pool::{HostLease, lent_extent};
use crate::kernels::{CopyDescriptor, SEGMENT, push_descriptors, table_bytes};
use crate::plan::chunk_descriptors_most;
use crate::stream::{Fence, LaneKind, SIDE_SLOTS};
use crate::sync::lock;

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
/// and memory that does not outlive the scope cannot be lent to it (nor memory that a helper
/// closure takes as an argument of any lifetime: capture it instead, or name the scope's
/// lifetime):
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
    seen: Submitted,
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
    let scope = Scope { core, seen: Submitted::default(), scope: PhantomData, env: PhantomData };
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
            seen: &self.seen,
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
            seen: &self.seen,
            table: BufferTable::default(),
            reads: Vec::new(),
            error: None,
            scope: PhantomData,
        }
    }

    /// Waits for every submission of the scope. A lane where a batch failed part-way, or
    /// whose wait fails, is synchronized whole instead (its stream, which a failed batch's
    /// side work was joined into: [`Lane::settle`](crate::stream::Lane::settle)), so that no
    /// copy of the scope runs once this returns.
    fn wait_all(&self) -> Result<()> {
        let mut first = Ok(());
        for kind in [LaneKind::Upload, LaneKind::Readback] {
            let settle = || self.core.lane(kind).settle();
            let seq = self.seen.last[kind.index()].load(Ordering::Acquire);
            let failed = self.seen.failed[kind.index()].load(Ordering::Acquire);
            let waited = match (failed, seq) {
                (true, _) => settle(),
                (false, 0) => Ok(()),
                (false, seq) => wait(self.core, kind, seq).inspect_err(|_| drop(settle())),
            };
            if let Err(e) = waited
                && first.is_ok()
            {
                first = Err(e);
            }
        }
        first
    }
}

/// What a scope's batches did on each lane: the last submission made (0: none), and
/// whether a batch failed after it may have enqueued work.
#[derive(Debug, Default)]
struct Submitted {
    last: [AtomicU64; 2],
    failed: [std::sync::atomic::AtomicBool; 2],
}

impl Submitted {
    /// Records what a submit on `kind`'s lane returned.
    fn note<T>(&self, kind: LaneKind, result: Result<T>) -> Result<T> {
        if result.is_err() {
            self.failed[kind.index()].store(true, Ordering::Release);
        }
        result
    }
}

/// Records `fence`'s submission as the scope's latest on its lane.
fn note(seen: &Submitted, fence: &Fence) {
    if let Some((_, kind, seq)) = fence.target() {
        seen.last[kind.index()].fetch_max(seq, Ordering::AcqRel);
    }
}

/// Where a scoped batch's item moves from or to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// In place, in pinned memory of this crate (mapped for the device): the arena's start.
    Mapped(usize),
    /// In place by DMAs, in other pinned memory (`Device::pin_host`): the registration's
    /// start. Only items of a run of at least [`RUN_MIN`] contiguous bytes, each whole inside
    /// one registration: those of a piece of the run that is [`RUN_MIN`] long inside it move
    /// by chunk DMAs, the others (where the run crosses the registration's border) by one
    /// DMA each. No kernel touches them.
    Pinned(usize),
    /// Through staging, as an ordinary batch.
    Staged,
}

/// The [`Place`] of each of `hosts` (address and length, in the batch's order; an empty one
/// is staged, which moves nothing). Pinned memory of this crate is found in the registry of
/// lent buffers; other memory is asked of the driver only for runs of contiguous items of at
/// least [`RUN_MIN`] bytes, once per pinned region met (so pageable items cost no driver
/// call each). No run crosses from one arena or registration into another.
fn places(core: &Core, hosts: &[(usize, usize)]) -> Result<Vec<Place>> {
    let mut lent = Lent::default();
    let mut places: Vec<Place> = hosts
        .iter()
        .map(|&(ptr, len)| match lent.arena(ptr, len) {
            Some(start) if len > 0 => Place::Mapped(start),
            _ => Place::Staged,
        })
        .collect();
    let mut i = 0;
    while i < hosts.len() {
        if places[i] != Place::Staged || hosts[i].1 == 0 {
            i += 1;
            continue;
        }
        let (start, mut end, mut j) = (hosts[i].0, hosts[i].0 + hosts[i].1, i + 1);
        while j < hosts.len() && places[j] == Place::Staged && hosts[j].1 > 0 && hosts[j].0 == end {
            end += hosts[j].1;
            j += 1;
        }
        if (end - start) as u64 >= RUN_MIN {
            registered(core, &hosts[i..j], &mut places[i..j])?;
        }
        i = j;
    }
    Ok(places)
}

/// Marks the items of a run that lie whole in one pinned region the driver reports (its
/// start and size) as [`Place::Pinned`]; the others stay staged. One driver call per region
/// met, plus one for a run that is not pinned at all.
fn registered(core: &Core, hosts: &[(usize, usize)], places: &mut [Place]) -> Result<()> {
    let raw = core.ctx.bind()?;
    let mut region: Option<(usize, usize)> = None;
    for (&(ptr, len), place) in hosts.iter().zip(places) {
        let inside = |(from, to): (usize, usize)| ptr >= from && ptr + len <= to;
        if !region.is_some_and(inside) {
            region = match raw.pinned_extent(ptr as *const u8)? {
                // An extent that holds the item's first byte; a driver that gives none
                // leaves the item staged.
                Some((from, bytes)) if from <= ptr as u64 && from.saturating_add(bytes) > ptr as u64 => {
                    Some((from as usize, from.saturating_add(bytes) as usize))
                }
                Some(_) => None,
                // Not pinned: neither is the rest of a run that starts pageable, as a rule.
                None if region.is_none() => return Ok(()),
                None => None,
            };
        }
        if let Some(extent) = region.filter(|&e| inside(e)) {
            *place = Place::Pinned(extent.0);
        }
    }
    Ok(())
}

/// Finds whether host ranges lie in pinned memory of this crate, remembering the last arena
/// found (a batch's ranges mostly lie in one host cache) and the last span found to hold
/// none (a pageable cache's ranges then cost one registry lookup, not one each). Memory lent
/// while a batch is classified may be taken for unlisted: it is staged, which moves any
/// memory.
#[derive(Default)]
struct Lent {
    arena: Option<(usize, usize)>,
    gap: Option<(usize, usize)>,
}

impl Lent {
    /// What [`first_part`] sees of an item of `len` bytes at host `host`, to or from device
    /// address `dev`.
    fn seen(&mut self, host: usize, len: usize, dev: u64) -> Seen {
        if len == 0 {
            return Seen::Empty;
        }
        match self.arena(host, len) {
            Some(start) => Seen::Mapped(Direct::new(host, dev, len, Place::Mapped(start))),
            None => Seen::Elsewhere,
        }
    }

    /// The start of the arena of this crate that holds all of `[ptr, ptr + len)`.
    fn arena(&mut self, ptr: usize, len: usize) -> Option<usize> {
        let end = ptr.saturating_add(len);
        let inside = |(start, bytes): (usize, usize)| ptr >= start && end <= start.saturating_add(bytes);
        if let Some(arena) = self.arena.filter(|&a| inside(a)) {
            return Some(arena.0);
        }
        if self.gap.is_some_and(|(from, to)| ptr >= from && ptr < to) {
            return None;
        }
        match lent_extent(ptr) {
            Ok(arena) => {
                self.arena = Some(arena);
                inside(arena).then_some(arena.0)
            }
            Err(gap) => {
                self.gap = Some(gap);
                None
            }
        }
    }
}

/// One copy between caller memory mapped for the device and a device range.
#[derive(Clone, Copy, Debug)]
struct Direct {
    host: usize,
    dev: u64,
    len: u64,
    /// Where the host side lies ([`Place::Mapped`] or [`Place::Pinned`], with its region's
    /// start): a run never crosses into another region (a DMA must stay inside one), and
    /// only mapped memory is read or written by a kernel.
    place: Place,
}

impl Direct {
    /// The item of `len` bytes between host `host` and device `dev`, placed at `place`.
    fn new(host: usize, dev: u64, len: usize, place: Place) -> Direct {
        debug_assert!(place != Place::Staged, "staged items do not move in place");
        Direct { host, dev, len: len as u64, place }
    }

    /// Whether `next` starts in host memory where this item ends, in the same region (a run
    /// never crosses into another: [`Layout::new`], [`parts`]).
    fn followed_by(&self, next: &Direct) -> bool {
        next.host == self.host + self.len as usize && next.place == self.place
    }

    /// Whether the host side is mapped for the device.
    fn mapped(&self) -> bool {
        matches!(self.place, Place::Mapped(_))
    }
}

/// Runs of items contiguous in host memory at least this long move through device staging
/// (one DMA a chunk plus a scatter or gather launch inside the device) rather than one DMA
/// or one over-the-bus copy an item.
const RUN_MIN: u64 = 1 << 20;

/// One chunk of a run: its host bytes, moved by one DMA into or out of a device staging
/// slot; the items it covers (from `first`, whose first `skip` bytes an earlier chunk
/// moves); and its descriptors, numbered in the batch's order (chunks first, then the
/// over-the-bus launches from `bus_from`).
#[derive(Clone, Debug)]
struct Chunk {
    host: usize,
    len: u64,
    first: usize,
    skip: u64,
    descriptors: std::ops::Range<usize>,
}

/// How a batch of [`Direct`] items moves: the chunks of host-contiguous runs, the items
/// moved by over-the-bus launches, and the items moved by a DMA each. Descriptors are
/// counted here and written launch by launch into a table of each launch's own as the
/// launches are enqueued ([`Layout::chunk_descriptors`], [`Layout::bus_descriptors`]), so
/// that the first chunk moves while later ones are still being described.
#[derive(Debug, Default)]
struct Layout {
    chunks: Vec<Chunk>,
    /// Descriptors in all.
    count: usize,
    bus_from: usize,
    bus: Vec<Direct>,
    /// The over-the-bus items in launches of at most [`Layout::most`] descriptors each: a
    /// range of `bus` a launch.
    bus_groups: Vec<std::ops::Range<usize>>,
    dmas: Vec<Direct>,
    /// The most descriptors of one launch (a chunk's or a group of bus items'), as the
    /// planner bounds a chunk's ([`chunk_descriptors_most`]): its table, leased from the
    /// pinned pool, stays within half a chunk, which the pool keeps for transfers
    /// (`Config::pinned_reserve`) however small the items.
    most: usize,
}

impl Layout {
    /// Lays `items` out for `kind`: runs (items each starting in host memory where the last
    /// ended) of at least [`RUN_MIN`] bytes cut into chunks of at most `chunk` bytes, where
    /// the GPU has unified addressing (`unified`: a download's gather reads its table in
    /// pinned memory); other items of at least `threshold` bytes by DMA, the rest over the
    /// bus where `bus` (the configuration lets small copies move over the bus:
    /// `Core::moves_small_copies_over_bus`), else by DMA too.
    fn new(items: &[Direct], chunk: u64, threshold: u64, unified: bool, bus: bool) -> Layout {
        let mut layout = Layout { most: chunk_descriptors_most(chunk) as usize, ..Layout::default() };
        let mut i = 0;
        while i < items.len() {
            let mut end = i + 1;
            let mut bytes = items[i].len;
            while end < items.len() && continues(items, end - 1) {
                bytes += items[end].len;
                end += 1;
            }
            let run = &items[i..end];
            // A run of one item (a large write) is one DMA, without device staging.
            if unified && bytes >= RUN_MIN && run.len() > 1 {
                layout.push_run(run, i, chunk);
            } else {
                for &d in run {
                    if bus && d.mapped() && d.len < threshold {
                        layout.bus.push(d);
                    } else {
                        layout.dmas.push(d);
                    }
                }
            }
            i = end;
        }
        layout.bus_from = layout.count;
        let (mut from, mut descriptors) = (0, 0);
        for (i, d) in layout.bus.iter().enumerate() {
            // A bus item is shorter than the threshold, at most a chunk: it fits in a launch.
            let n = d.len.div_ceil(SEGMENT) as usize;
            if descriptors + n > layout.most && i > from {
                layout.bus_groups.push(from..i);
                (from, descriptors) = (i, 0);
            }
            descriptors += n;
            layout.count += n;
        }
        if from < layout.bus.len() {
            layout.bus_groups.push(from..layout.bus.len());
        }
        layout
    }

    /// Cuts a host-contiguous run (items from `first`) into chunks of at most `chunk` bytes
    /// and [`Layout::most`] descriptors, an item split where a chunk ends, counting each
    /// chunk's descriptors.
    fn push_run(&mut self, run: &[Direct], first: usize, chunk: u64) {
        let mut open =
            Chunk { host: run[0].host, len: 0, first, skip: 0, descriptors: self.count..self.count };
        for (i, d) in run.iter().enumerate() {
            let mut done = 0;
            while done < d.len {
                if open.len == chunk || open.descriptors.len() == self.most {
                    let next = Chunk {
                        host: open.host + open.len as usize,
                        len: 0,
                        first: first + i,
                        skip: done,
                        descriptors: self.count..self.count,
                    };
                    self.chunks.push(std::mem::replace(&mut open, next));
                }
                let room = (self.most - open.descriptors.len()) as u64 * SEGMENT;
                let len = (d.len - done).min(chunk - open.len).min(room);
                self.count += len.div_ceil(SEGMENT) as usize;
                open.descriptors.end = self.count;
                open.len += len;
                done += len;
            }
        }
        self.chunks.push(open);
    }

    /// Chunk `k`'s descriptors into `out` (cleared first): between the staging slot at
    /// `slot` (plus each piece's offset in the chunk) and the items' device ranges.
    fn chunk_descriptors(
        &self,
        items: &[Direct],
        k: usize,
        kind: LaneKind,
        slot: u64,
        out: &mut Vec<CopyDescriptor>,
    ) {
        let c = &self.chunks[k];
        out.clear();
        let (mut at, mut skip, mut i) = (0, c.skip, c.first);
        while at < c.len {
            let d = &items[i];
            let len = (d.len - skip).min(c.len - at);
            let (staging, dev) = (slot + at, d.dev + skip);
            let (src, dst) = if kind == LaneKind::Upload { (staging, dev) } else { (dev, staging) };
            push_descriptors(out, src, dst, len);
            (at, skip, i) = (at + len, 0, i + 1);
        }
        // The launch covers the counted descriptors: a table part written short would leave
        // it stale ones.
        assert_eq!(out.len(), c.descriptors.len(), "a chunk's descriptors as counted");
    }

    /// Over-the-bus launch `g`'s descriptors into `out` (cleared first), and its bytes.
    fn bus_descriptors(&self, g: usize, kind: LaneKind, out: &mut Vec<CopyDescriptor>) -> u64 {
        out.clear();
        let mut bytes = 0;
        for d in &self.bus[self.bus_groups[g].clone()] {
            let (src, dst) =
                if kind == LaneKind::Upload { (d.host as u64, d.dev) } else { (d.dev, d.host as u64) };
            push_descriptors(out, src, dst, d.len);
            bytes += d.len;
        }
        assert!(out.len() <= self.most, "a bus launch within its table");
        bytes
    }

    /// Submissions on the lane: one a chunk and one to close the chunks (their side work
    /// joined), one per over-the-bus launch, one for the DMAs.
    fn submissions(&self) -> u64 {
        let chunks = if self.chunks.is_empty() { 0 } else { self.chunks.len() + 1 };
        (chunks + self.bus_groups.len() + usize::from(!self.dmas.is_empty())) as u64
    }
}

/// Moves `items` on `kind`'s lane with no host staging ([`Layout`]): runs contiguous in host
/// memory by one DMA a chunk into or out of device staging, with a scatter (uploads) or
/// gather (downloads) launch inside the device, the two overlapped on the lane's two streams;
/// scattered small items by one launch of the copy kernel over the bus; the rest by one DMA
/// each. `ranges` are the items' device ranges; `buffers` every buffer they lie in. The
/// batch's last submission is noted in `seen` as soon as it is claimed, before anything is
/// enqueued: the scope waits for it whatever happens after (an error, a panic).
fn move_pinned(
    core: &Arc<Core>,
    kind: LaneKind,
    buffers: impl Iterator<Item = ResidentBuffer>,
    items: &[Direct],
    ranges: Ranges,
    seen: &Submitted,
) -> Result<Fence> {
    let config = &core.config;
    let layout = Layout::new(
        items,
        config.chunk_bytes,
        config.direct_threshold,
        core.info.unified_addressing,
        core.moves_small_copies_over_bus(),
    );
    let mut exec = Exec::begin(core, kind);
    let mut scratch = lock(&core.staging[kind.index()]);
    let final_seq = exec.claim_built(buffers, layout.submissions(), ranges)?;
    seen.last[kind.index()].fetch_max(final_seq, Ordering::AcqRel);
    exec.requested(items.iter().map(|d| d.len).sum());
    // A slot of device staging per chunk in flight: its bytes, then (uploads) its table. A
    // download's gather reads its table in pinned memory over the bus instead: a copy of it
    // into the device would queue on the copy engine behind the other lane's uploads, and
    // hold each chunk of a download back until they are done.
    let slot_bytes = layout.chunks.iter().map(|c| c.len).max().unwrap_or(0).next_multiple_of(256);
    let table_area = match kind {
        LaneKind::Upload => {
            layout.chunks.iter().map(|c| table_bytes(c.descriptors.len() as u64)).max().unwrap_or(0)
        }
        LaneKind::Readback => 0,
    };
    let stride = slot_bytes + table_area;
    let slots = layout.chunks.len().min(SIDE_SLOTS) as u64;
    let region = if slots > 0 { exec.region(&mut scratch.region, slots * stride)? } else { 0 };
    let slot_at = |k: usize| region + (k % SIDE_SLOTS) as u64 * stride;
    // A pinned table per launch, read over the bus (or copied into a slot), leased and
    // written just before the submission that uses it, so that the first chunk moves while
    // later ones are still being described. Each holds at most `layout.most` descriptors
    // (half a chunk): the pool keeps that much for transfers however small the items, and
    // a table taken while earlier ones are in flight waits for them as staging does.
    let table_of = |exec: &Exec, descriptors: &[CopyDescriptor]| -> Result<Arc<HostLease>> {
        let table = exec.lease(table_bytes(descriptors.len() as u64) as usize)?;
        // SAFETY: the lease holds `table_bytes(len)` bytes, room for the descriptors (three
        // u64s each, `repr(C)`, no padding); it is new, so no reference to its bytes exists,
        // and the device reads it only in submissions enqueued after this write.
        unsafe {
            std::ptr::copy_nonoverlapping(
                descriptors.as_ptr().cast::<u8>(),
                table.as_ptr(),
                std::mem::size_of_val(descriptors),
            );
        }
        Ok(Arc::new(table))
    };
    let mut part = Vec::new();
    let kernels = if layout.count > 0 { Some(exec.kernels()?) } else { None };
    for (k, chunk) in layout.chunks.iter().enumerate() {
        let (slot, at) = (k % SIDE_SLOTS, slot_at(k));
        let at_table = at + slot_bytes;
        layout.chunk_descriptors(items, k, kind, at, &mut part);
        let table = table_of(&exec, &part)?;
        let n = part.len() as u64;
        let kernels = kernels.expect("chunks have descriptors");
        let (table_ptr, table_len) = (table.as_ptr().cast_const(), std::mem::size_of_val(&part[..]));
        // The slot's last user (two chunks ago, on the side stream) is done first.
        exec.wait_side(slot)?;
        // SAFETY, for the DMAs and launches below: the chunk's pinned table is written and
        // kept alive by the lane's submission that copies it into the slot, behind the
        // slot's bytes (`table_area` holds it), or that reads it over the bus (mapped for
        // the device: chunks exist only with unified addressing); its descriptors name the
        // slot (a chunk is at most `slot_bytes`) and ranges of live, claimed buffers, no two
        // destinations overlapping; the host run lies in one pinned region (this crate's, or
        // registered: only DMAs touch it) that the scope borrows until the copies complete;
        // the side work comes after the lane's submission and is joined before the batch's
        // last one.
        match kind {
            LaneKind::Upload => {
                // SAFETY: as above.
                exec.submit(vec![Arc::clone(&table)], |q| unsafe {
                    q.htod(at, chunk.host as *const u8, chunk.len as usize)?;
                    q.htod(at_table, table_ptr, table_len)
                })?;
                // SAFETY: as above.
                exec.submit_side(slot, |q| unsafe { q.launch(kernels, at_table, n, 0) })?;
            }
            LaneKind::Readback => {
                // SAFETY: as above.
                exec.submit(vec![Arc::clone(&table)], |q| unsafe {
                    q.launch(kernels, table_ptr as u64, n, table_len as u64)
                })?;
                // SAFETY: as above.
                exec.submit_side(slot, |q| unsafe { q.dtoh(chunk.host as *mut u8, at, chunk.len as usize) })?;
            }
        }
    }
    if !layout.chunks.is_empty() {
        exec.join_side()?;
        exec.submit(Vec::new(), |_| Ok(()))?;
    }
    for g in 0..layout.bus_groups.len() {
        let bytes = layout.bus_descriptors(g, kind, &mut part);
        let table = table_of(&exec, &part)?;
        let (at, n) = (table.as_ptr() as u64, part.len() as u64);
        let kernels = kernels.expect("loaded for descriptors");
        exec.submit(vec![table], |q| {
            // SAFETY: as above; the host side of each copy lies in pinned memory of this
            // crate, mapped for the device, borrowed by the scope.
            unsafe { q.launch_over_bus(kernels, at, n, bytes + n * 24) }
        })?;
    }
    if !layout.dmas.is_empty() {
        exec.submit(Vec::new(), |q| {
            for d in &layout.dmas {
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
    }
    Ok(exec.finish())
}

/// The work of the scoped bulk calls ([`ScopedUploads::write_many`],
/// [`ScopedDownloads::read_into_many`]): each `(buffer, offset, host)` item checked as the
/// single call checks its own (a run of items on one buffer looked up once) and pushed onto
/// `to` as `(key, offset, host)`; the first bad item is named by its index in `call` and kept
/// as the batch's error, and the items after it are not added. An iterator that panics
/// leaves [`Error::ItemsPanicked`] as the batch's error ([`Error::add_items`]).
fn add_many<T>(
    core: &Core,
    (table, error): (&mut BufferTable, &mut Option<Error>),
    call: &'static str,
    to: &mut Vec<(u32, u64, T)>,
    items: impl IntoIterator<Item = (ResidentBuffer, u64, T)>,
    len: impl Fn(&T) -> usize,
) -> Result<()> {
    let items = items.into_iter();
    // As `UploadBatch::write_many`: the iterator's hint is trusted only so far.
    to.reserve(items.size_hint().0.min(RESERVE_MOST));
    Error::add_items(
        call,
        error,
        |error| error,
        |_, at| {
            for (buffer, offset, host) in items {
                let (key, _) = table.check(&core.alloc, buffer, offset, len(&host) as u64, &mut None)?;
                to.push((key, offset, host));
                *at += 1;
            }
            Ok(())
        },
    )
}

/// A batch of writes from the caller's memory ([`Scope::uploads`]). Writes apply in order:
/// where two overlap, the later one wins (such a batch takes the staged path whole).
#[must_use = "a scoped upload batch moves nothing until it is submitted"]
pub struct ScopedUploads<'scope> {
    core: &'scope Arc<Core>,
    seen: &'scope Submitted,
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
    /// ends; in pinned memory (this crate's, or runs of memory pinned by
    /// [`Device::pin_host`](crate::Device::pin_host)), the GPU reads it in place.
    ///
    /// # Errors
    /// A bad range (returned here and again by `submit`, which then moves nothing).
    pub fn write(&mut self, buffer: ResidentBuffer, offset: u64, data: &'scope [u8]) -> Result<&mut Self> {
        let (key, _) =
            self.table.check(&self.core.alloc, buffer, offset, data.len() as u64, &mut self.error)?;
        self.writes.push((key, offset, data));
        Ok(self)
    }

    /// Adds a write for each `(buffer, offset, data)` item, in order, as that many
    /// [`write`](ScopedUploads::write)s would, with less work per item: room reserved up
    /// front, no result per item.
    ///
    /// # Errors
    /// For the first bad item, [`Error::BadItem`] naming its index and holding the error
    /// `write` returns for it; the batch keeps the items before it and fails `submit` with
    /// that error (moving nothing), as after a bad `write`; the items after it are not added.
    ///
    /// # Panics
    /// Where the iterator panics, the panic goes on to the caller, and the batch keeps
    /// [`Error::ItemsPanicked`]: a caller that catches the panic finds `submit` failing with
    /// it, moving nothing.
    pub fn write_many<I>(&mut self, items: I) -> Result<&mut Self>
    where
        I: IntoIterator<Item = (ResidentBuffer, u64, &'scope [u8])>,
    {
        let call = "ScopedUploads::write_many";
        add_many(self.core, (&mut self.table, &mut self.error), call, &mut self.writes, items, |d| d.len())?;
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
    /// others through staging (copied before this returns). The scope waits for them. A
    /// batch of more than 1024 writes or a chunk of bytes moves in up to three parts, the
    /// first while the rest is looked at and laid out, where they come from pinned memory
    /// (the first part from this crate's: it moves before any later write is classified);
    /// the parts apply in order.
    ///
    /// # Errors
    /// The first bad write's error, or a staging or driver error; nothing moves if a write
    /// was bad or a buffer was freed before this was called. An error part way (from the
    /// driver, or a buffer another thread frees meanwhile) leaves the parts before it moved.
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
        // Nothing moves where a buffer was freed before this call: a part that goes through
        // staging claims only the buffers of its own writes, so every buffer is checked first.
        core.alloc.check_live_many(self.table.buffers())?;
        let ptr_of = |key: u32, offset: u64| self.table.entries[key as usize].ptr + offset;
        // The first part moves before the rest is looked at (where the batch has one).
        let mut lent = Lent::default();
        let first = first_part(self.writes.len(), core.config.chunk_bytes, |i| {
            let (key, offset, data) = self.writes[i];
            lent.seen(data.as_ptr() as usize, data.len(), ptr_of(key, offset))
        });
        let mut fence = Fence::completed();
        let from = match first {
            Some((items, end)) => {
                fence = self.move_part(&items, 0..end)?;
                end
            }
            None => 0,
        };
        let rest = &self.writes[from..];
        let hosts: Vec<(usize, usize)> = rest.iter().map(|w| (w.2.as_ptr() as usize, w.2.len())).collect();
        let places = places(core, &hosts)?;
        // One pass: the items that move in place (and the write each comes from), the others.
        let (mut direct, mut origin, mut staged) = (Vec::with_capacity(rest.len()), Vec::new(), Vec::new());
        for (i, (&(key, offset, data), place)) in (from..).zip(rest.iter().zip(places)) {
            if data.is_empty() {
                continue;
            }
            match place {
                Place::Mapped(_) | Place::Pinned(_) => {
                    direct.push(Direct::new(data.as_ptr() as usize, ptr_of(key, offset), data.len(), place));
                    origin.push(i);
                }
                Place::Staged => staged.push(i),
            }
        }
        if staged.is_empty() {
            // All in place: in parts, each checked for overlaps of its own (a part that has
            // some goes staged whole); the parts apply in order, one after the other on the
            // lane, so a later write wins over an earlier one in another part too.
            for part in parts(&direct, core.config.chunk_bytes, usize::from(from > 0)) {
                fence = self.move_part(&direct[part.clone()], origin[part].iter().copied())?;
            }
            return Ok(fence);
        }
        // Some staged: overlapping writes apply in order, so where any two writes overlap, the
        // staged path's planner takes them all (those of a first part moved already come
        // before them all on the lane).
        let mut ranges = core.ranges(LaneKind::Upload);
        for &(key, offset, data) in rest {
            ranges.push(ptr_of(key, offset), data.len() as u64);
        }
        if !direct.is_empty() && !ranges.disjoint_by_granules().unwrap_or_else(|| ranges.sort_disjoint()) {
            direct.clear();
            staged = (from..self.writes.len()).collect();
        }
        if !direct.is_empty() {
            // Noted in the scope, which waits for it; the staged batch comes after it on the
            // lane, so its fence is the one returned.
            drop(self.move_part(&direct, origin.into_iter())?);
        }
        fence = self.submit_staged(staged.into_iter())?;
        note(self.seen, &fence);
        Ok(fence)
    }

    /// Moves a part of the batch's writes made in place, `items`, coming from the writes at
    /// `origin`: in place where no two of them overlap (checked by granules, without a sort,
    /// which would cost ~0.7 ms for 16384 blocks of a pool on the development VM, before the
    /// first DMA), else those writes through staging, in order.
    fn move_part(&self, items: &[Direct], origin: impl Iterator<Item = usize>) -> Result<Fence> {
        let core = self.core;
        let mut ranges = ranges_of(core, LaneKind::Upload, items);
        let fence = if ranges.disjoint_by_granules().unwrap_or_else(|| ranges.sort_disjoint()) {
            let moved = move_pinned(core, LaneKind::Upload, self.table.buffers(), items, ranges, self.seen);
            self.seen.note(LaneKind::Upload, moved)?
        } else {
            self.submit_staged(origin)?
        };
        note(self.seen, &fence);
        Ok(fence)
    }

    /// The writes at `indices` (in order) as one ordinary batch, through staging.
    fn submit_staged(&self, indices: impl Iterator<Item = usize>) -> Result<Fence> {
        let mut batch = super::upload::uploads(self.core);
        for i in indices {
            let (key, offset, data) = self.writes[i];
            if !data.is_empty() {
                batch.write(self.table.entries[key as usize].buffer, offset, data)?;
            }
        }
        batch.submit()
    }
}

/// Items of at most this many (and at most a chunk of bytes) make the first part of a
/// scoped batch; see [`parts`].
const PART_ITEMS: usize = 1024;

/// Whether item `i + 1` goes on item `i`'s run: it starts in host memory where `i` ends, in
/// the same region (a run never crosses into another: [`Layout::new`], [`parts`]).
fn continues(items: &[Direct], i: usize) -> bool {
    items[i].followed_by(&items[i + 1])
}

/// What [`first_part`] sees of an item of a scoped batch.
#[derive(Clone, Copy, Debug)]
enum Seen {
    /// Moves nothing (no bytes).
    Empty,
    /// In pinned memory of this crate.
    Mapped(Direct),
    /// Anywhere else: only the whole batch's classification ([`places`]) says how it moves.
    Elsewhere,
}

/// The first of a scoped batch's [`parts`], cut off its front before the rest of the batch is
/// looked at, so that it moves while the rest is classified and laid out (for 16384 blocks
/// of a pool, that work took 0.15 ms on the development VM before the first DMA, and about
/// twice that on the H200's host). `seen(i)` tells item `i` of `n`. The first part found is
/// the one [`parts`] would cut from the whole batch: its items (all in pinned memory of this
/// crate, empty ones left out) and the number of the batch's items it spans; `None` where
/// an item of it lies elsewhere, or where it would take the whole batch (or more than twice
/// [`PART_ITEMS`] items), which the caller then moves as before.
fn first_part(n: usize, chunk: u64, mut seen: impl FnMut(usize) -> Seen) -> Option<(Vec<Direct>, usize)> {
    // The first item after `i` that moves bytes: its index, and itself where it is mapped.
    let mut next = |mut i: usize| {
        while i < n {
            match seen(i) {
                Seen::Empty => i += 1,
                Seen::Mapped(d) => return Some((i, Some(d))),
                Seen::Elsewhere => return Some((i, None)),
            }
        }
        None
    };
    let mut items: Vec<Direct> = Vec::with_capacity(PART_ITEMS);
    let (mut bytes, mut run) = (0, 0);
    // Where the run being added ends, once a look ahead found its rest shorter than a run:
    // no cut inside it then (its rest only gets shorter).
    let mut short_until = 0;
    let (mut i, mut item) = next(0)?;
    loop {
        let d = item?;
        run = if items.last().is_some_and(|p| p.followed_by(&d)) { run + d.len } else { d.len };
        bytes += d.len;
        items.push(d);
        if items.len() > 2 * PART_ITEMS {
            return None;
        }
        let (after, following) = next(i + 1)?;
        let due = bytes >= chunk || items.len() >= PART_ITEMS;
        if due && !following.is_some_and(|f| d.followed_by(&f)) {
            return Some((items, i + 1));
        }
        if due && run >= RUN_MIN && after >= short_until {
            // The rest of the run from `after`: a cut here leaves it a run too.
            let (mut rest, mut last, mut at) = (0, d, Some((after, following)));
            while let Some((j, Some(f))) = at
                && last.followed_by(&f)
                && rest < RUN_MIN
            {
                (rest, last, at, short_until) = (rest + f.len, f, next(j + 1), j + 1);
            }
            if rest >= RUN_MIN {
                return Some((items, i + 1));
            }
        }
        (i, item) = (after, following);
    }
}

/// The parts a scoped batch's in-place `items` are submitted in, so that the first part
/// moves while the next ones are laid out: the first ends at the first item past `chunk`
/// bytes or [`PART_ITEMS`] items, the second past twice as many, the third takes the rest
/// (a batch smaller than that is one part; no items, no part). A part ends inside a
/// host-contiguous run only where the run's pieces on both sides are [`RUN_MIN`] long or
/// more, so that each still moves as a run (a shorter piece would move by one DMA an item).
/// Three parts at most: each is a batch of its own on the lane, entered in the ledger.
/// `moved` parts were cut off the batch's front before `items` ([`first_part`]): the parts
/// returned go on from there.
fn parts(items: &[Direct], chunk: u64, moved: usize) -> Vec<std::ops::Range<usize>> {
    let mut parts = Vec::with_capacity(3);
    if items.is_empty() {
        return parts;
    }
    // The bytes of each item's run from it to the run's end.
    let mut rest = vec![0; items.len()];
    for i in (0..items.len()).rev() {
        let after = if i + 1 < items.len() && continues(items, i) { rest[i + 1] } else { 0 };
        rest[i] = items[i].len + after;
    }
    // Bytes of the part so far, and of its last run so far.
    let (mut start, mut bytes, mut run) = (0, 0, 0);
    for (i, d) in items.iter().enumerate() {
        bytes += d.len;
        run = if i > start && continues(items, i - 1) { run + d.len } else { d.len };
        let shift = moved + parts.len();
        if shift >= 2 || i + 1 == items.len() {
            continue;
        }
        let due = bytes >= chunk << shift || i + 1 - start >= PART_ITEMS << shift;
        let whole = !continues(items, i) || (run >= RUN_MIN && rest[i + 1] >= RUN_MIN);
        if due && whole {
            parts.push(start..i + 1);
            (start, bytes) = (i + 1, 0);
        }
    }
    parts.push(start..items.len());
    parts
}

/// The device ranges of `items` (as they come: the ledger compares a pool's blocks on a
/// grid, without sorting them).
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
    seen: &'scope Submitted,
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
    /// memory (this crate's, or runs of memory pinned by
    /// [`Device::pin_host`](crate::Device::pin_host)), the GPU writes it in place.
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

    /// Adds a read for each `(buffer, offset, out)` item, in order, as that many
    /// [`read_into`](ScopedDownloads::read_into)s would, with less work per item: room
    /// reserved up front, no result per item.
    ///
    /// # Errors
    /// For the first bad item, [`Error::BadItem`] naming its index and holding the error
    /// `read_into` returns for it; the batch keeps the items before it and fails `submit`
    /// with that error (moving nothing), as after a bad `read_into`; the items after it are
    /// not added.
    ///
    /// # Panics
    /// Where the iterator panics, the panic goes on to the caller, and the batch keeps
    /// [`Error::ItemsPanicked`]: a caller that catches the panic finds `submit` failing with
    /// it, moving nothing.
    pub fn read_into_many<I>(&mut self, items: I) -> Result<&mut Self>
    where
        I: IntoIterator<Item = (ResidentBuffer, u64, &'scope mut [u8])>,
    {
        let call = "ScopedDownloads::read_into_many";
        add_many(self.core, (&mut self.table, &mut self.error), call, &mut self.reads, items, |o| o.len())?;
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
    /// returns at once; the bytes are there when the scope ends; a large batch moves in up
    /// to three parts, as [`ScopedUploads::submit`] says), into any other memory through
    /// staging (this returns once those bytes are copied in).
    ///
    /// # Errors
    /// The first bad read's error, or a staging or driver error; nothing moves if a read
    /// was bad or a buffer was freed before this was called. An error part way (from the
    /// driver, or a buffer another thread frees meanwhile) leaves the parts before it moved.
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
        // Nothing moves where a buffer was freed before this call: a buffer named only by
        // empty reads is claimed by no part, and a staged read claims only its own.
        core.alloc.check_live_many(self.table.buffers())?;
        let entries = &self.table.entries;
        // The first part moves before the rest is looked at (where the batch has one).
        let mut lent = Lent::default();
        let reads = &mut self.reads;
        let first = first_part(reads.len(), core.config.chunk_bytes, |i| {
            let (key, offset, ref mut out) = reads[i];
            lent.seen(out.as_mut_ptr() as usize, out.len(), entries[key as usize].ptr + offset)
        });
        let mut fence = Fence::completed();
        let move_part = |items: &[Direct]| {
            let ranges = ranges_of(core, LaneKind::Readback, items);
            let moved = move_pinned(core, LaneKind::Readback, self.table.buffers(), items, ranges, self.seen);
            let fence = self.seen.note(LaneKind::Readback, moved)?;
            note(self.seen, &fence);
            Ok::<_, Error>(fence)
        };
        let from = match first {
            Some((items, end)) => {
                fence = move_part(&items)?;
                end
            }
            None => 0,
        };
        let rest: Vec<_> = std::mem::take(reads).into_iter().skip(from).collect();
        let hosts: Vec<(usize, usize)> = rest.iter().map(|r| (r.2.as_ptr() as usize, r.2.len())).collect();
        let places = places(core, &hosts)?;
        let (mut direct, mut staged) = (Vec::with_capacity(rest.len()), Vec::new());
        for ((key, offset, out), place) in rest.into_iter().zip(places) {
            if out.is_empty() {
                continue;
            }
            let entry = entries[key as usize];
            match place {
                Place::Mapped(_) | Place::Pinned(_) => {
                    direct.push(Direct::new(out.as_mut_ptr() as usize, entry.ptr + offset, out.len(), place))
                }
                Place::Staged => staged.push((entry.buffer, offset, out)),
            }
        }
        // In parts (reads of distinct caller slices: their order does not matter).
        for part in parts(&direct, core.config.chunk_bytes, usize::from(from > 0)) {
            fence = move_part(&direct[part])?;
        }
        if !staged.is_empty() {
            let mut batch = super::download::downloads(core);
            let slots = staged
                .iter()
                .map(|(buffer, offset, out)| batch.read(*buffer, *offset, out.len() as u64))
                .collect::<Result<Vec<_>>>()?;
            let pending = batch.submit()?;
            note(self.seen, pending.fence());
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

#[cfg(test)]
mod layout_tests {
    use super::{Direct, Layout, Lent, PART_ITEMS, Place, RUN_MIN, Seen, first_part, parts};
    use crate::stream::LaneKind;
    use crate::testing::device;

    /// Ranges in a pinned buffer find its arena; pageable ones find a span without one,
    /// which answers the next pageable ranges in it without asking the registry (a second
    /// lookup there could not say otherwise); a range that starts in the arena and ends
    /// past it is not in it.
    #[test]
    fn lent_ranges_find_their_arena_and_pageable_ones_a_gap() {
        let d = device(crate::Config::default());
        let pinned = d.pinned(1 << 20).unwrap();
        let pageable = vec![7u8; 1 << 20];
        let (p, q) = (pinned.as_ptr() as usize, pageable.as_ptr() as usize);
        let mut lent = Lent::default();
        let arena = lent.arena(p, 4096).expect("in the pool's arena");
        assert!(arena <= p);
        assert_eq!(lent.arena(p + 8192, 100), Some(arena), "remembered");
        assert_eq!(lent.arena(q, 4096), None);
        let (from, to) = lent.gap.expect("a gap remembered");
        assert!(from <= q && q < to && !(from..to).contains(&p), "{from:#x}..{to:#x}");
        assert_eq!(lent.arena(q + 4096, 4096), None);
        let (start, bytes) = lent.arena.unwrap();
        assert_eq!(lent.arena(start + bytes - 10, 20), None, "past the arena's end");
        assert_eq!(lent.arena(p, 4096), Some(arena), "still found after a gap");
        drop(pinned);
    }

    /// A part ends inside a host-contiguous run only where both pieces are runs themselves
    /// (`RUN_MIN` or more), whatever the item count says: 5000 items of 512 B in one run of
    /// 2.5 MiB, and runs of other lengths around it.
    #[test]
    fn parts_do_not_cut_a_run_into_pieces_shorter_than_a_run() {
        let mut rng = fastrand::Rng::with_seed(8);
        for round in 0..200 {
            let mut items = Vec::new();
            let mut host = 1usize << 40;
            let n = if round == 0 { 5000 } else { rng.usize(1..6000) };
            for _ in 0..n {
                if round > 0 && rng.u16(..500) == 0 {
                    host += 4096;
                }
                let len = if round == 0 { 512 } else { rng.u64(64..4096) };
                items.push(Direct { host, dev: 0, len, place: Place::Pinned(0) });
                host += len as usize;
            }
            let chunk = [16u64 << 20, 1 << 20, 64 << 10][round % 3];
            let p = parts(&items, chunk, 0);
            assert_eq!(p.iter().map(|r| r.len()).sum::<usize>(), items.len());
            for w in p.windows(2) {
                let (part, cut) = (w[0].start, w[1].start);
                if !super::continues(&items, cut - 1) {
                    continue;
                }
                // The run's piece in the part before the cut, and the rest of the run.
                let mut before = 0;
                let mut j = cut;
                while j > part && (j == cut || super::continues(&items, j - 1)) {
                    j -= 1;
                    before += items[j].len;
                }
                let mut after = items[cut].len;
                let mut k = cut;
                while k + 1 < items.len() && super::continues(&items, k) {
                    k += 1;
                    after += items[k].len;
                }
                assert!(before >= super::RUN_MIN && after >= super::RUN_MIN, "round {round}: a cut at {cut}");
            }
        }
    }

    /// Parts cover every item once, in order; at most three; the first ends at the first
    /// item past a chunk of bytes or `PART_ITEMS` items, the second past twice that.
    #[test]
    fn parts_cover_the_items_in_order_the_first_small() {
        assert!(parts(&[], 1 << 20, 0).is_empty());
        let mut rng = fastrand::Rng::with_seed(5);
        for _ in 0..200 {
            let chunk = rng.u64(1..4 << 20);
            let items: Vec<Direct> = (0..rng.usize(1..6000))
                .map(|_| Direct { host: 0, dev: 0, len: rng.u64(1..64 << 10), place: Place::Mapped(0) })
                .collect();
            let p = parts(&items, chunk, 0);
            assert!((1..=3).contains(&p.len()));
            assert_eq!(p[0].start, 0);
            assert_eq!(p.last().unwrap().end, items.len());
            assert!(p.windows(2).all(|w| w[0].end == w[1].start && w[0].start < w[0].end));
            for (k, part) in p.iter().enumerate().take(p.len() - 1) {
                let (count, bytes) = (part.len(), items[part.clone()].iter().map(|d| d.len).sum::<u64>());
                let before = &items[part.start..part.end - 1];
                let under =
                    before.iter().map(|d| d.len).sum::<u64>() < chunk << k && before.len() < PART_ITEMS << k;
                assert!(under, "part {k} went past its first boundary");
                assert!(bytes >= chunk << k || count >= PART_ITEMS << k, "part {k} ended early");
            }
        }
    }

    /// The first part cut off a batch's front, seeing one item at a time, is the first part
    /// `parts` cuts from the whole batch (empty items skipped, gaps between runs, arenas that
    /// abut in host memory, items of exactly a run, chunks smaller than an item, counts at
    /// the edges of `PART_ITEMS`), and `parts` of the rest, told that one part moved, cuts it
    /// as it cut the whole; it looks at no item more than three times. An item of that first
    /// part outside this crate's pinned memory leaves the batch whole (or ends the first part
    /// before it); an item past it does not matter.
    #[test]
    fn the_first_part_cut_off_the_front_is_the_one_parts_cuts_from_the_whole() {
        let mut rng = fastrand::Rng::with_seed(12);
        let mut cut = 0;
        for round in 0..1200 {
            let mut all: Vec<Option<Direct>> = Vec::new();
            let (mut host, mut arena) = (1usize << 40, 0);
            let n = if round % 2 == 0 {
                rng.usize(1..5000)
            } else {
                [1023, 1024, 1025, 2047, 2048, 2049][round % 6]
            };
            for _ in 0..n {
                if rng.u16(..40) == 0 {
                    all.push(None);
                    continue;
                }
                match rng.u16(..[3000, 300, 30][round % 3]) {
                    0 => host += 4096,
                    1 => arena += 1,
                    _ => {}
                }
                let len = match round % 7 {
                    0 => rng.u64(1..=64),
                    1 => 1024,
                    2 => rng.u64(1..=4096),
                    3 => rng.u64(1..=64 << 10),
                    4 => [RUN_MIN / 2, RUN_MIN - 1, RUN_MIN, 1, 512][rng.usize(..5)],
                    _ => rng.u64(1..=1 << 20),
                };
                all.push(Some(Direct { host, dev: host as u64, len, place: Place::Mapped(arena) }));
                host += len as usize;
            }
            let direct: Vec<Direct> = all.iter().flatten().copied().collect();
            let chunk = [16u64 << 20, 1 << 20, 64 << 10, 7777, 1][round % 5];
            let whole = parts(&direct, chunk, 0);
            let seen = |i: usize| all[i].map_or(Seen::Empty, Seen::Mapped);
            let mut looks = 0;
            let counted = first_part(all.len(), chunk, |i| {
                looks += 1;
                seen(i)
            });
            assert!(looks <= 3 * all.len(), "round {round}: {looks} looks at {} items", all.len());
            match counted {
                Some((items, end)) => {
                    cut += 1;
                    assert!(whole.len() >= 2 && all[end - 1].is_some(), "round {round}");
                    let took = all[..end].iter().flatten().count();
                    assert_eq!(took, whole[0].end, "round {round}: the first part's items");
                    assert!(items.iter().zip(&direct).all(|(a, b)| (a.host, a.len) == (b.host, b.len)));
                    let rest: Vec<_> = parts(&direct[took..], chunk, 1)
                        .into_iter()
                        .map(|r| r.start + took..r.end + took)
                        .collect();
                    assert_eq!(rest, whole[1..], "round {round}: the rest's parts");
                    // Another item in the first part: the batch stays whole; past it: no change.
                    let at = rng.usize(..end);
                    let elsewhere = |i: usize| if i == at { Seen::Elsewhere } else { seen(i) };
                    let cut_before = first_part(all.len(), chunk, elsewhere).is_none_or(|f| f.1 <= at);
                    assert!(cut_before, "round {round}: a first part over an item elsewhere");
                    let later = |i: usize| if i == end { Seen::Elsewhere } else { seen(i) };
                    assert_eq!(first_part(all.len(), chunk, later).map(|f| f.1), Some(end), "round {round}");
                }
                None => assert!(
                    whole.len() < 2 || whole[0].len() > 2 * PART_ITEMS,
                    "round {round}: no first part, but parts cut {whole:?}"
                ),
            }
        }
        assert!(cut > 400, "{cut} batches of 1200 had a first part cut off");
    }

    /// A run already past `RUN_MIN` when the first part is due, whose rest is shorter than a
    /// run, is looked ahead once, not once an item: 2000 items of 1 KiB in one run, then
    /// others apart.
    #[test]
    fn a_short_rest_of_a_run_is_looked_ahead_once() {
        let item = |i: usize| {
            let host = (1usize << 40) + i * 1024 + if i >= 2000 { 4096 } else { 0 };
            Direct { host, dev: 0, len: 1024, place: Place::Mapped(0) }
        };
        assert!(PART_ITEMS as u64 * 1024 >= RUN_MIN && (2000 - PART_ITEMS as u64) * 1024 < RUN_MIN);
        let mut calls = 0;
        let (items, end) = first_part(3000, 16 << 20, |i| {
            calls += 1;
            Seen::Mapped(item(i))
        })
        .expect("a first part, cut where the run ends");
        assert_eq!((items.len(), end), (2000, 2000));
        assert!(calls <= 2 * 2001, "{calls} looks at 2001 items");
    }

    /// Every item's bytes are covered exactly once by chunk descriptors, bus descriptors or
    /// DMAs; chunk descriptors stay within their chunk; chunks are host-contiguous pieces.
    #[test]
    fn a_layout_moves_every_byte_once_inside_its_chunks_and_no_kernel_touches_registered_memory() {
        let mut rng = fastrand::Rng::with_seed(9);
        for round in 0..300 {
            let chunk = [64u64 << 10, 1 << 20, (3 << 20) | 17][round % 3];
            let threshold = [0u64, 4096, 256 << 10][round % 3];
            let n = rng.usize(1..200);
            let mut items = Vec::new();
            let mut host = 1usize << 40;
            let mut dev = 1u64 << 30;
            for _ in 0..n {
                let len = if rng.bool() { rng.u64(1..300_000) } else { rng.u64(1..40_000) };
                if rng.u8(..10) == 0 {
                    host += rng.usize(1..100);
                }
                dev += rng.u64(0..5000);
                let place = if rng.u8(..8) != 0 { Place::Mapped(1) } else { Place::Pinned(0) };
                items.push(Direct { host, dev, len, place });
                host += len as usize;
                dev += len;
            }
            for kind in [LaneKind::Upload, LaneKind::Readback] {
                let bus = rng.bool();
                let unified = bus || rng.bool();
                let layout = Layout::new(&items, chunk, threshold, unified, bus);
                // Device bytes -> host bytes, as moved.
                let mut moved: Vec<(u64, u64, u64)> = Vec::new(); // (dev, host, len)
                let (mut part, mut counted) = (Vec::new(), 0);
                for (k, c) in layout.chunks.iter().enumerate() {
                    assert!(c.len <= chunk && c.len > 0);
                    assert_eq!(c.descriptors.start, counted, "chunks' descriptors follow each other");
                    layout.chunk_descriptors(&items, k, kind, 0, &mut part);
                    assert_eq!(part.len(), c.descriptors.len(), "as counted");
                    counted = c.descriptors.end;
                    for d in &part {
                        let (slot, dev) =
                            if kind == LaneKind::Upload { (d.src, d.dst) } else { (d.dst, d.src) };
                        assert!(slot + d.len <= c.len, "descriptor past its chunk");
                        moved.push((dev, c.host as u64 + slot, d.len));
                    }
                }
                assert_eq!(layout.bus_from, counted);
                let (mut bus_part, mut group) = (Vec::new(), Vec::new());
                for g in 0..layout.bus_groups.len() {
                    layout.bus_descriptors(g, kind, &mut group);
                    bus_part.extend_from_slice(&group);
                }
                assert_eq!(layout.bus_from + bus_part.len(), layout.count, "as counted");
                for d in &bus_part {
                    let (host, dev) = if kind == LaneKind::Upload { (d.src, d.dst) } else { (d.dst, d.src) };
                    moved.push((dev, host, d.len));
                }
                for d in &layout.dmas {
                    moved.push((d.dev, d.host as u64, d.len));
                }
                // Every moved piece maps device to host as some item does, and every item's
                // bytes are moved exactly once.
                let total: u64 = items.iter().map(|d| d.len).sum();
                assert_eq!(moved.iter().map(|m| m.2).sum::<u64>(), total);
                for &(dev, hostp, len) in &moved {
                    let it = items
                        .iter()
                        .find(|d| dev >= d.dev && dev + len <= d.dev + d.len)
                        .expect("a piece inside one item");
                    assert_eq!(hostp - it.host as u64, dev - it.dev, "host/device offsets disagree");
                    if !it.mapped() && bus {
                        // registered memory: no kernel may touch it
                        assert!(bus_part.iter().all(|d| {
                            let h = if kind == LaneKind::Upload { d.src } else { d.dst };
                            !(h >= it.host as u64 && h < it.host as u64 + it.len)
                        }));
                    }
                }
                let _ = layout.submissions();
            }
        }
    }

    /// However small the items, no launch takes more than [`Layout::most`] descriptors (its
    /// pinned table stays within half a chunk): a run of 16-byte items is cut into chunks by
    /// descriptors before bytes, and scattered small items into several bus launches; every
    /// byte is still described once, in order.
    #[test]
    fn no_launch_of_tiny_items_takes_a_table_past_half_a_chunk() {
        let chunk = 64u64 << 10;
        let most = crate::plan::chunk_descriptors_most(chunk) as usize;
        assert_eq!(most, (32 << 10) / 24);
        // A run of 1.5 MiB in 16-byte items, then 5000 scattered 8-byte items.
        let mut items = Vec::new();
        let (mut host, mut dev) = (1usize << 40, 1u64 << 30);
        for _ in 0..(3 << 16) {
            items.push(Direct { host, dev, len: 16, place: Place::Mapped(1) });
            (host, dev) = (host + 16, dev + 32);
        }
        for _ in 0..5000 {
            host += 64;
            items.push(Direct { host, dev, len: 8, place: Place::Mapped(1) });
            (host, dev) = (host + 8, dev + 8);
        }
        for kind in [LaneKind::Upload, LaneKind::Readback] {
            let layout = Layout::new(&items, chunk, 4096, true, true);
            assert_eq!(layout.most, most);
            assert!(layout.chunks.len() >= (3 << 16) / most, "{} chunks", layout.chunks.len());
            let mut part = Vec::new();
            let mut next_dev = 1u64 << 30;
            for (k, c) in layout.chunks.iter().enumerate() {
                assert!(c.descriptors.len() <= most && c.len <= chunk);
                layout.chunk_descriptors(&items, k, kind, 0, &mut part);
                assert_eq!(part.len(), c.descriptors.len());
                for d in &part {
                    let dv = if kind == LaneKind::Upload { d.dst } else { d.src };
                    assert_eq!((dv, d.len), (next_dev, 16), "in order, each item once");
                    next_dev += 32;
                }
            }
            assert!(layout.bus_groups.len() > 5000 / most);
            let mut described = 0;
            for g in 0..layout.bus_groups.len() {
                let bytes = layout.bus_descriptors(g, kind, &mut part);
                assert!(!part.is_empty() && part.len() <= most);
                assert_eq!(bytes, 8 * part.len() as u64);
                described += part.len();
            }
            assert_eq!(described, 5000);
            let launches = layout.chunks.len() + 1 + layout.bus_groups.len();
            assert_eq!(layout.submissions(), launches as u64);
        }
    }
}

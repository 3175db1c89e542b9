//! The layout of a scoped batch's in-place items, pure: the items ([`Direct`], with their
//! [`Place`]), the chunks of host-contiguous runs and the over-the-bus launches
//! ([`Layout`]), and the parts a batch is submitted in ([`first_part`], [`parts`]).
//!
//! The planner, not the executor, decides how a batch moves: the executor
//! (`engine::routes::pinned`) carries a [`Layout`] out as it is. Property-tested against a
//! byte model (`check::execute_runs`, `check::check_parts`).

use super::chunk_descriptors_most;
use crate::kernels::{CopyDescriptor, SEGMENT, push_descriptors};
use crate::stream::LaneKind;

/// Where a scoped batch's item moves from or to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
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

/// One copy between caller memory mapped for the device and a device range.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Direct {
    pub(crate) host: usize,
    pub(crate) dev: u64,
    pub(crate) len: u64,
    /// Where the host side lies ([`Place::Mapped`] or [`Place::Pinned`], with its region's
    /// start): a run never crosses into another region (a DMA must stay inside one), and
    /// only mapped memory is read or written by a kernel.
    pub(crate) place: Place,
}

impl Direct {
    /// The item of `len` bytes between host `host` and device `dev`, placed at `place`.
    pub(crate) fn new(host: usize, dev: u64, len: usize, place: Place) -> Direct {
        debug_assert!(place != Place::Staged, "staged items do not move in place");
        Direct { host, dev, len: len as u64, place }
    }

    /// Whether `next` starts in host memory where this item ends, in the same region (a run
    /// never crosses into another: [`Layout::new`], [`parts`]).
    fn followed_by(&self, next: &Direct) -> bool {
        next.host == self.host + self.len as usize && next.place == self.place
    }

    /// Whether the host side is mapped for the device.
    pub(crate) fn mapped(&self) -> bool {
        matches!(self.place, Place::Mapped(_))
    }
}

/// Runs of items contiguous in host memory at least this long move through device staging
/// (one DMA a chunk plus a scatter or gather launch inside the device) rather than one DMA
/// or one over-the-bus copy an item.
pub(crate) const RUN_MIN: u64 = 1 << 20;

/// Items at least this long move by a DMA of their own, even inside a run, where a
/// submission's DMAs go to the driver in one `cuMemcpyBatchAsync` (`Config::dma_batches`):
/// each goes straight to its place, with no device staging and no scatter or gather launch.
/// Chosen from xfer-bench's paging suite on an H100: 2 MiB blocks moved at 54.3 / 54.7 GB/s
/// out / in (99.9 both ways at once) by `cuMemcpyBatchAsync` itself, one call a direction,
/// against 53.9 / 53.5 (96.7) by this crate through device staging; 256 KiB blocks moved
/// faster through staging (53.8 / 53.3 against 49.4 / 47.4).
pub(crate) const OWN_DMA_MIN: u64 = 2 << 20;

/// One chunk of a run: its host bytes, moved by one DMA into or out of a device staging
/// slot; the items it covers (from `first`, whose first `skip` bytes an earlier chunk
/// moves); and its descriptors, numbered in the batch's order (chunks first, then the
/// over-the-bus launches from `bus_from`).
#[derive(Clone, Debug)]
pub(crate) struct Chunk {
    pub(crate) host: usize,
    pub(crate) len: u64,
    first: usize,
    skip: u64,
    pub(crate) descriptors: std::ops::Range<usize>,
}

/// How a batch of [`Direct`] items moves: the chunks of host-contiguous runs, the items
/// moved by over-the-bus launches, and the items moved by a DMA each. Descriptors are
/// counted here and written launch by launch into a table of each launch's own as the
/// launches are enqueued ([`Layout::chunk_descriptors`], [`Layout::bus_descriptors`]), so
/// that the first chunk moves while later ones are still being described.
#[derive(Debug, Default)]
pub(crate) struct Layout {
    pub(crate) chunks: Vec<Chunk>,
    /// Descriptors in all.
    pub(crate) count: usize,
    pub(crate) bus_from: usize,
    bus: Vec<Direct>,
    /// The over-the-bus items in launches of at most [`Layout::most`] descriptors each: a
    /// range of `bus` a launch.
    pub(crate) bus_groups: Vec<std::ops::Range<usize>>,
    pub(crate) dmas: Vec<Direct>,
    /// The most descriptors of one launch (a chunk's or a group of bus items'), as the
    /// planner bounds a chunk's ([`chunk_descriptors_most`]): its table, leased from the
    /// pinned pool, stays within half a chunk, which the pool keeps for transfers
    /// (`Config::pinned_reserve`) however small the items.
    pub(crate) most: usize,
}

impl Layout {
    /// Lays `items` out for `kind`: runs (items each starting in host memory where the last
    /// ended) of at least [`RUN_MIN`] bytes cut into chunks of at most `chunk` bytes, where
    /// the GPU has unified addressing (`unified`: a download's gather reads its table in
    /// pinned memory); other items of at least `threshold` bytes by DMA, the rest over the
    /// bus where `bus` (the configuration lets small copies move over the bus:
    /// `Core::moves_small_copies_over_bus`), else by DMA too. An item of at least `own_dma`
    /// bytes moves by a DMA of its own even inside a run ([`OWN_DMA_MIN`] where a
    /// submission's DMAs go to the driver in one call, `u64::MAX` otherwise).
    pub(crate) fn new(
        items: &[Direct],
        chunk: u64,
        threshold: u64,
        (unified, bus): (bool, bool),
        own_dma: u64,
    ) -> Layout {
        let mut layout = Layout { most: chunk_descriptors_most(chunk) as usize, ..Layout::default() };
        let mut i = 0;
        while i < items.len() {
            if items[i].len >= own_dma {
                layout.dmas.push(items[i]);
                i += 1;
                continue;
            }
            let mut end = i + 1;
            let mut bytes = items[i].len;
            while end < items.len() && continues(items, end - 1) && items[end].len < own_dma {
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
    pub(crate) fn chunk_descriptors(
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
    pub(crate) fn bus_descriptors(&self, g: usize, kind: LaneKind, out: &mut Vec<CopyDescriptor>) -> u64 {
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
    pub(crate) fn submissions(&self) -> u64 {
        let chunks = if self.chunks.is_empty() { 0 } else { self.chunks.len() + 1 };
        (chunks + self.bus_groups.len() + usize::from(!self.dmas.is_empty())) as u64
    }
}

/// Items of at most this many (and at most a chunk of bytes) make the first part of a
/// scoped batch; see [`parts`].
pub(crate) const PART_ITEMS: usize = 1024;

/// Whether item `i + 1` goes on item `i`'s run: it starts in host memory where `i` ends, in
/// the same region (a run never crosses into another: [`Layout::new`], [`parts`]).
pub(crate) fn continues(items: &[Direct], i: usize) -> bool {
    items[i].followed_by(&items[i + 1])
}

/// What [`first_part`] sees of an item of a scoped batch.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Seen {
    /// Moves nothing (no bytes).
    Empty,
    /// In pinned memory of this crate.
    Mapped(Direct),
    /// Anywhere else: only the whole batch's classification
    /// (`transfer::scope::places`) says how it moves.
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
pub(crate) fn first_part(
    n: usize,
    chunk: u64,
    mut seen: impl FnMut(usize) -> Seen,
) -> Option<(Vec<Direct>, usize)> {
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
pub(crate) fn parts(items: &[Direct], chunk: u64, moved: usize) -> Vec<std::ops::Range<usize>> {
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

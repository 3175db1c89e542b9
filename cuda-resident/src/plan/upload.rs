//! Upload emission: the chunks' copies, and the fills that put each interval's final bytes
//! into staging exactly once.

use std::collections::BinaryHeap;

use super::fuse::Interval;
use super::layout::{Emit, Layout, lay_out};
use super::request::Entry;
use super::sort::Sorted;
use super::{Chunk, Fill, Geometry, PlanError};

/// A write that covers the sweep position; [`Heap`] orders them by index, so that its top
/// is the latest write, the one whose bytes win.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Active {
    index: u32,
    end: u64,
    start: u64,
}

impl Active {
    fn of(e: Entry) -> Self {
        Self { index: e.index, end: e.end, start: e.start }
    }
}

/// The writes covering the sweep position in an interval with overlaps: a max-heap of
/// `index << 32 | slot`, where `slot` names the write in `writes`. Plain `u64`s sift faster
/// than the writes themselves (8 bytes and one comparison each): the heap dominated
/// planning batches with many overlaps.
#[derive(Debug, Default)]
pub(super) struct Heap {
    keys: BinaryHeap<u64>,
    writes: Vec<Active>,
}

impl Heap {
    fn clear(&mut self) {
        self.keys.clear();
        self.writes.clear();
    }

    /// Adds a write. An interval has fewer writes than a batch has requests, which fit
    /// `u32`.
    #[inline]
    fn push(&mut self, write: Active) {
        self.keys.push(u64::from(write.index) << 32 | self.writes.len() as u64);
        self.writes.push(write);
    }

    /// The latest write in the heap.
    #[inline]
    fn peek(&self) -> Option<Active> {
        self.keys.peek().map(|&key| self.writes[(key & u64::from(u32::MAX)) as usize])
    }

    fn pop(&mut self) {
        self.keys.pop();
    }
}

/// Scratch memory of upload planning, kept by the planner.
#[derive(Debug, Default)]
pub(super) struct Scratch {
    /// Direct intervals, waiting for the packed ones to be placed.
    directs: Vec<Interval>,
    /// Writes covering the sweep position in an interval with overlaps.
    heap: Heap,
}

/// Fuses the sorted entries, lays the intervals out into `chunks` and fills `fills` with the staging fills, in
/// ascending flat staging order.
pub(super) fn emit<S: Sorted + ?Sized>(
    entries: &S,
    geo: &Geometry,
    scratch: &mut Scratch,
    chunks: &mut Vec<Chunk>,
    fills: &mut Vec<Fill>,
) -> Result<Layout, PlanError> {
    let Scratch { directs, heap } = scratch;
    fills.clear();
    // At least one fill per interval; usually about one per write.
    fills.reserve(entries.len());
    lay_out(entries, geo, chunks, directs, &mut Fills { entries, geo, heap, fills })
}

/// The upload half of the layout: each interval's fills.
struct Fills<'a, S: ?Sized> {
    entries: &'a S,
    geo: &'a Geometry,
    heap: &'a mut Heap,
    fills: &'a mut Vec<Fill>,
}

impl<S: Sorted + ?Sized> Emit for Fills<'_, S> {
    #[inline(always)]
    fn emit(&mut self, iv: &Interval) {
        if iv.last - iv.first == 1 && self.geo.is_packed(iv.len()) {
            // The common case, kept small so that it is inlined into the sweep: one write, in
            // one chunk, is one fill. (Built in place: assembling a `Fill` on the stack and
            // copying it stalled on store forwarding, and cost more than the rest of the loop.)
            let write = iv.index;
            let fill = Fill { chunk: iv.chunk, stage_offset: iv.stage, write, src_offset: 0, len: iv.len() };
            self.fills.push(fill);
        } else {
            fill_interval(self.entries, iv, self.geo, self.heap, self.fills);
        }
    }
}

/// The fills of an interval of several writes, or of a direct one (which may be split over
/// chunks).
#[inline(never)]
fn fill_interval<S: Sorted + ?Sized>(
    entries: &S,
    iv: &Interval,
    geo: &Geometry,
    heap: &mut Heap,
    fills: &mut Vec<Fill>,
) {
    let packed = geo.is_packed(iv.len());
    winners(entries, iv, heap, |w, start, end| {
        let fill = Fill {
            chunk: iv.chunk,
            stage_offset: iv.stage + (start - iv.start),
            write: w.index,
            src_offset: start - w.start,
            len: end - start,
        };
        if packed { push_fill(fills, fill) } else { push_direct_fill(fills, geo, fill) }
    });
}

/// Splits interval `iv` into runs, each taken from the last write covering it, and calls
/// `run(write, start, end)` for them in ascending order.
///
/// The interval's writes are sorted by start and cover it without gaps. A sweep keeps the
/// writes covering the current position in a max-heap by index, dropping ended ones lazily,
/// so the cost is `O(n log n)` however the writes overlap; a lone write needs no heap.
fn winners<S: Sorted + ?Sized>(
    entries: &S,
    iv: &Interval,
    heap: &mut Heap,
    mut run: impl FnMut(Active, u64, u64),
) {
    if iv.last - iv.first == 1 {
        let only = entries.get(iv.first as usize);
        run(Active::of(only), only.start, only.end);
        return;
    }
    overlapping(entries, iv, heap, run);
}

/// The heap sweep of [`winners`], for an interval of several writes.
fn overlapping<S: Sorted + ?Sized>(
    entries: &S,
    iv: &Interval,
    heap: &mut Heap,
    mut run: impl FnMut(Active, u64, u64),
) {
    heap.clear();
    let (mut pos, mut next) = (iv.start, iv.first);
    let next_entry = |next: u32| (next < iv.last).then(|| entries.get(next as usize));
    while pos < iv.end {
        while let Some(e) = next_entry(next).filter(|e| e.start <= pos) {
            heap.push(Active::of(e));
            next += 1;
        }
        while heap.peek().is_some_and(|top| top.end <= pos) {
            heap.pop();
        }
        // The writes cover the interval, so one of them covers `pos`.
        let Some(top) = heap.peek() else {
            debug_assert!(false, "interval has a gap at {pos}");
            return;
        };
        // The winner can change only where it ends or where another write starts; both are
        // past `pos`, so the sweep always advances.
        let stop = next_entry(next).map_or(top.end, |e| e.start.min(top.end));
        run(top, pos, stop);
        pos = stop;
    }
}

/// Appends a fill that lies inside one chunk, merged with the previous fill when it simply
/// continues it (a write that won two runs next to each other).
#[inline(always)]
fn push_fill(fills: &mut Vec<Fill>, fill: Fill) {
    match fills.last_mut() {
        Some(last)
            if last.write == fill.write
                && last.chunk == fill.chunk
                && last.stage_offset + last.len == fill.stage_offset
                && last.src_offset + last.len == fill.src_offset =>
        {
            last.len += fill.len;
        }
        _ => fills.push(fill),
    }
}

/// Appends a fill of a direct interval, cut at chunk boundaries so that a ring of chunk
/// buffers can take it. `fill.chunk` is the interval's first chunk, not necessarily the
/// fill's, so it is worked out here.
fn push_direct_fill(fills: &mut Vec<Fill>, geo: &Geometry, fill: Fill) {
    let Fill { mut stage_offset, write, mut src_offset, mut len, .. } = fill;
    while len > 0 {
        let n = len.min(geo.room_at(stage_offset));
        push_fill(fills, Fill { chunk: geo.chunk_of(stage_offset), stage_offset, write, src_offset, len: n });
        stage_offset += n;
        src_offset += n;
        len -= n;
    }
}

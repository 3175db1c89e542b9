//! Validation and fusion: the requests, checked, sorted by buffer and offset, and swept into
//! disjoint intervals.

use super::request::{Collected, Entry, Request};
use super::sort::{SortScratch, Sorted, position_bits};
use super::{BufferKey, PlanError};

/// A fused run `[start, end)` of one buffer, made of the sorted entries `first..last`,
/// placed at flat staging offset `stage`, in chunk `chunk`, by the layout.
#[derive(Clone, Copy, Debug)]
pub(super) struct Interval {
    pub(super) buffer: BufferKey,
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) stage: u64,
    pub(super) first: u32,
    pub(super) last: u32,
    pub(super) chunk: u32,
    /// The request index of entry `first`.
    pub(super) index: u32,
}

impl Interval {
    pub(super) fn len(&self) -> u64 {
        self.end - self.start
    }
}

/// Validates every request, in order, and leaves in `scratch` what the sort needs: every
/// request's length, and for each non-empty one its key as far as it is known (`start <<
/// position_bits | index`) and its buffer's first-seen rank. The first bad request fails
/// with its index.
pub(super) fn collect<R: Request>(requests: &[R], scratch: &mut SortScratch) -> Result<Collected, PlanError> {
    let Checked { collected, empties } = check(requests)?;
    let SortScratch { ranker, keys, ranks, lens, .. } = scratch;
    let position_bits = position_bits(requests.len());
    ranker.reset();
    lens.clear();
    lens.extend(requests.iter().map(|r| r.len() as u32));
    keys.clear();
    ranks.clear();
    // Bits shifted out of a key mean a key too wide, which the sort notices from `start_bits`.
    if empties == 0 {
        keys.extend((0u64..).zip(requests).map(|(index, r)| r.offset().wrapping_shl(position_bits) | index));
        ranks.extend(requests.iter().map(|r| ranker.rank(r.buffer())));
    } else {
        for (index, r) in (0u64..).zip(requests).filter(|(_, r)| r.len() > 0) {
            keys.push(r.offset().wrapping_shl(position_bits) | index);
            ranks.push(ranker.rank(r.buffer()));
        }
    }
    Ok(collected)
}

/// What [`check`] found.
pub(super) struct Checked {
    pub(super) collected: Collected,
    /// How many requests are empty.
    pub(super) empties: usize,
}

/// Checks every request (the first bad one fails with its index) and totals the batch.
pub(super) fn check<R: Request>(requests: &[R]) -> Result<Checked, PlanError> {
    if u32::try_from(requests.len()).is_err() {
        return Err(PlanError::TooManyRequests { count: requests.len() });
    }
    // First the checks and the batch's totals: one pass of reductions, no branch and no
    // store per request.
    let (mut bad, mut saturated, mut wide, mut empties) = (false, false, 0, 0usize);
    let (mut requested, mut starts) = (0u64, 0);
    for r in requests {
        let (offset, len) = (r.offset(), r.len());
        let (end, overflow) = offset.overflowing_add(len);
        bad |= overflow | (end > r.buffer_len());
        let (sum, overflow) = requested.overflowing_add(len);
        (requested, saturated) = (sum, saturated | overflow);
        wide |= len >> u32::BITS;
        empties += usize::from(len == 0);
        // Zero-length requests count too: that can only widen the key, which sorts the
        // same.
        starts |= offset;
    }
    if bad {
        return Err(first_out_of_range(requests));
    }
    let requested_bytes = if saturated { u64::MAX } else { requested };
    Ok(Checked { collected: Collected { requested_bytes, start_bits: starts, wide: wide != 0 }, empties })
}

/// The non-empty requests of a batch in order, taken as sorted: for a batch whose every
/// request starts at or after the end of the previous one of its buffer (so no two overlap,
/// and each buffer's requests come in ascending order), which makes the sweep's result the
/// same as after a sort, up to the order of the intervals of different buffers.
pub(super) struct InOrder<'a, R> {
    pub(super) requests: &'a [R],
    /// The non-empty requests' indices, when some are empty.
    pub(super) non_empty: Option<&'a [u32]>,
}

impl<R: Request> Sorted for InOrder<'_, R> {
    #[inline]
    fn len(&self) -> usize {
        self.non_empty.map_or(self.requests.len(), <[u32]>::len)
    }

    #[inline(always)]
    fn get(&self, i: usize) -> Entry {
        let index = self.non_empty.map_or(i as u32, |n| n[i]);
        let r = &self.requests[index as usize];
        // The end cannot overflow: `check` accepted the request.
        Entry { place: r.buffer(), start: r.offset(), end: r.offset() + r.len(), index }
    }

    #[inline]
    fn buffer_of(&self, place: u64) -> BufferKey {
        place
    }
}

/// The error for the first request that reaches past its buffer.
#[cold]
fn first_out_of_range<R: Request>(requests: &[R]) -> PlanError {
    let (index, r) =
        (0u32..).zip(requests).find(|(_, r)| checked_end(*r).is_none()).expect("a request out of range");
    out_of_range(index, r)
}

/// The error for request `index`, built only when it is needed.
#[cold]
fn out_of_range<R: Request>(index: u32, r: &R) -> PlanError {
    PlanError::OutOfRange {
        index: index as usize,
        buffer: r.buffer(),
        offset: r.offset(),
        len: r.len(),
        buffer_len: r.buffer_len(),
    }
}

/// `offset + len` when it neither overflows nor passes the buffer's end.
fn checked_end<R: Request>(r: &R) -> Option<u64> {
    r.offset().checked_add(r.len()).filter(|&end| end <= r.buffer_len())
}

/// Sweeps the sorted entries into intervals: entries of one buffer that overlap or touch
/// join one interval, handed to `close` as soon as it is complete (the next entry starts
/// past it). Returns the sum of the interval lengths, saturating: the layout checks the
/// offsets that contain them, so a plan that succeeds has the exact sum.
///
/// `close` has a single call site, so that it is inlined into the loop: this runs once per
/// request, and a call per interval with the interval spilled to the stack cost as much as
/// the rest of the sweep.
#[inline(always)]
pub(super) fn sweep<S: Sorted + ?Sized>(
    entries: &S,
    mut close: impl FnMut(Interval) -> Result<(), PlanError>,
) -> Result<u64, PlanError> {
    let n = entries.len();
    let (mut moved, mut i) = (0u64, 0);
    while i < n {
        let e = entries.get(i);
        let (place, start, mut end, first, index) = (e.place, e.start, e.end, i, e.index);
        i += 1;
        while i < n {
            let e = entries.get(i);
            if e.place != place || e.start > end {
                break;
            }
            end = end.max(e.end);
            i += 1;
        }
        moved = moved.saturating_add(end - start);
        let buffer = entries.buffer_of(place);
        // Positions fit `u32`: there are no more entries than requests.
        close(Interval {
            buffer,
            start,
            end,
            stage: 0,
            first: first as u32,
            last: i as u32,
            chunk: 0,
            index,
        })?;
    }
    Ok(moved)
}

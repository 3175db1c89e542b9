//! Validation and fusion: the requests, checked, sorted by buffer and offset, and swept into
//! disjoint intervals.

use super::sort::{Ranker, Sorted};
use super::{BufferKey, PlanError, ReadRequest, WriteRequest};

/// What validation and fusion need of a request; writes and reads have the same shape.
pub(super) trait Request {
    fn buffer(&self) -> BufferKey;
    fn buffer_len(&self) -> u64;
    fn offset(&self) -> u64;
    fn len(&self) -> u64;
}

macro_rules! impl_request {
    ($t:ty) => {
        impl Request for $t {
            fn buffer(&self) -> BufferKey {
                self.buffer
            }
            fn buffer_len(&self) -> u64 {
                self.buffer_len
            }
            fn offset(&self) -> u64 {
                self.offset
            }
            fn len(&self) -> u64 {
                self.len
            }
        }
    };
}

impl_request!(WriteRequest);
impl_request!(ReadRequest);

/// A validated, non-empty request: `[start, end)` of `buffer`, request number `index`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Entry {
    pub(super) buffer: BufferKey,
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) index: u32,
    /// The buffer's first-seen rank in the batch, for the bucketed sort.
    pub(super) rank: u32,
}

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
}

impl Interval {
    pub(super) fn len(&self) -> u64 {
        self.end - self.start
    }
}

/// What validation found, besides the entries.
pub(super) struct Collected {
    /// Sum of the requests' lengths (saturating: it is a statistic, and the layout checks
    /// the sums that become offsets).
    pub(super) requested_bytes: u64,
    /// The largest start of a non-empty request, which sizes the sort key.
    pub(super) max_start: u64,
    /// Whether the non-empty requests already come sorted by buffer and offset (a caller
    /// that writes buffers front to back), so that sorting can be skipped.
    pub(super) in_order: bool,
}

/// Validates every request, in order, and collects the non-empty ones into `entries`,
/// ranking their buffers on the way. The first bad request fails with its index.
pub(super) fn collect<R: Request>(
    requests: &[R],
    entries: &mut Vec<Entry>,
    ranker: &mut Ranker,
) -> Result<Collected, PlanError> {
    if u32::try_from(requests.len()).is_err() {
        return Err(PlanError::TooManyRequests { count: requests.len() });
    }
    entries.clear();
    entries.reserve(requests.len());
    ranker.reset();
    let mut found = Collected { requested_bytes: 0, max_start: 0, in_order: true };
    let mut previous = (0, 0);
    // The last buffer ranked and its rank: requests often come grouped by buffer.
    let mut last = None;
    for (index, r) in (0u32..).zip(requests) {
        let Some(end) = checked_end(r) else {
            return Err(out_of_range(index, r));
        };
        found.requested_bytes = found.requested_bytes.saturating_add(r.len());
        if r.len() > 0 {
            found.max_start = found.max_start.max(r.offset());
            // Bitwise, not short-circuit: with buffers in random order a branch here
            // mispredicts half the time.
            let (buffer, offset) = (r.buffer(), r.offset());
            found.in_order &= (previous.0 < buffer) | ((previous.0 == buffer) & (previous.1 <= offset));
            previous = (buffer, offset);
            let rank = match last {
                Some((key, rank)) if key == buffer => rank,
                _ => ranker.rank(buffer),
            };
            last = Some((buffer, rank));
            entries.push(Entry { buffer, start: offset, end, index, rank });
        }
    }
    Ok(found)
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
pub(super) fn sweep(
    entries: &Sorted<'_>,
    mut close: impl FnMut(Interval) -> Result<(), PlanError>,
) -> Result<u64, PlanError> {
    let n = entries.len();
    let (mut moved, mut i) = (0u64, 0);
    while i < n {
        let e = entries.get(i);
        let (buffer, start, mut end, first) = (e.buffer, e.start, e.end, i);
        i += 1;
        while i < n {
            let e = entries.get(i);
            if e.buffer != buffer || e.start > end {
                break;
            }
            end = end.max(e.end);
            i += 1;
        }
        moved = moved.saturating_add(end - start);
        // Positions fit `u32`: there are no more entries than requests.
        close(Interval { buffer, start, end, stage: 0, first: first as u32, last: i as u32, chunk: 0 })?;
    }
    Ok(moved)
}

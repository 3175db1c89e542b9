//! The route a batch takes and the layouts of the paths that skip the planner: which
//! executor path moves a batch ([`Route`], decided by [`upload_route`] and
//! [`download_route`]), how large its chunks are ([`pipeline_chunk`], [`in_order_chunk`],
//! [`growing`]), and, for requests in order and apart ([`Apart`], the one meaning of "in
//! order" of those paths), where each request's bytes go and where chunks are cut
//! ([`cut_apart`]). Pure functions, tested here and against the byte model
//! (`plan::proptests`, `plan::check::execute_in_order`).
//!
//! Two orders of requests matter, and only these two:
//!
//! - *in order and apart* ([`Apart`]): every request non-empty, at most a kernel segment,
//!   and past the previous request of its buffer with a gap. Such a batch needs no fusing
//!   and no planner: [`Route::InOrder`] lays it out as added.
//! - *in order* (the planner's `in_order`): every non-empty request starts at or after the
//!   end of the previous one of its buffer, touching allowed. Such a batch has no overlaps
//!   and needs no sort: the planner takes it as it comes, and writes made in place or peer
//!   copies that keep it need no planner to know that none overlap ([`Route::InPlace`],
//!   `PeerBatch::route`).
//!
//! Touching requests are in order but not apart: the planner fuses them into one interval
//! (one descriptor), where the in-order layout would give each its own slot and
//! descriptor.

use crate::kernels::{SEGMENT, table_bytes};

/// The path an executor follows for a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    /// One small write from a slice: one memcpy into pinned memory and one DMA.
    One,
    /// Every write made in place (`write_with`): the batch's arena is the staging. Writes
    /// that turn out to fuse go to the planner ([`Route::Planned`]) instead.
    InPlace,
    /// Many small requests in order and apart ([`Apart`]): laid out as added, cut by
    /// [`cut_apart`], one launch a chunk.
    InOrder,
    /// Fused and laid out by the planner.
    Planned,
    /// A download the pinned pool cannot lend at once: planned in half chunks and moved
    /// through a ring of pinned chunks into host memory of its own.
    Streamed,
    /// [`Route::Streamed`] straight into the caller's vectors.
    StreamedInto,
}

/// What [`upload_route`] looks at in an upload batch.
#[derive(Clone, Copy)]
pub(crate) struct UploadShape<'a> {
    /// Writes in the batch.
    pub(crate) writes: usize,
    /// The length of the batch's one write when it has exactly one, from a slice.
    pub(crate) single_slice: Option<u64>,
    /// Writes made in place (`write_with`) and writes of a caller's slice.
    pub(crate) in_place: bool,
    pub(crate) slice_writes: usize,
    /// The layout of the writes as added.
    pub(crate) apart: &'a Apart,
    /// [`Config::direct_threshold`](crate::Config::direct_threshold).
    pub(crate) direct_threshold: u64,
}

/// The route of an upload batch.
pub(crate) fn upload_route(batch: &UploadShape<'_>) -> Route {
    if batch.single_slice.is_some_and(|len| len > 0 && len < batch.direct_threshold) {
        return Route::One;
    }
    if batch.in_place && batch.slice_writes == 0 {
        return Route::InPlace;
    }
    let apart = batch.apart;
    if batch.writes >= IN_ORDER_MIN
        && !apart.broken
        && apart.longest < batch.direct_threshold
        && !batch.in_place
    {
        return Route::InOrder;
    }
    Route::Planned
}

/// The route of a download batch of `reads` reads laid out as `apart`, whose planned
/// chunks hold `chunk_bytes` and whose copies of at least `direct_threshold` bytes move by
/// their own DMA: [`Route::InOrder`] or [`Route::Planned`] ([`Route::Streamed`] is taken
/// when the pool cannot lend the batch's staging at once, which only the pool knows).
pub(crate) fn download_route(reads: usize, apart: &Apart, direct_threshold: u64) -> Route {
    if reads >= IN_ORDER_MIN && !apart.broken && apart.longest < direct_threshold {
        Route::InOrder
    } else {
        Route::Planned
    }
}

/// The staging chunk for a batch of `total` bytes: the configured chunk, but small enough
/// that the batch has at least `depth` chunks (down to [`MIN_PIPELINE_CHUNK`]), so that
/// packing or copying out one chunk overlaps the DMA of another even for mid-size batches
/// (a 16 MiB read into pageable memory measured half as fast again with depth
/// [`PIPELINE_DEPTH`]: BENCHMARKS.md).
pub(crate) fn pipeline_chunk(configured: u64, total: u64, depth: u64) -> u64 {
    let share = (total / depth.max(1)).next_multiple_of(crate::host_pool::MIN_ARENA);
    configured.min(share.max(MIN_PIPELINE_CHUNK))
}

/// The staging chunk for `total` bytes of small requests in order and apart (the paths that
/// skip the planner), cutting the batch into `depth` chunks where they stay large enough: as
/// [`pipeline_chunk`], but not below 4 MiB, so that a few thousand small reads (a megabyte
/// or two) stay one chunk and one launch. Uploads over the bus start smaller and grow to
/// this ([`FIRST_CHUNK`]).
pub(crate) fn in_order_chunk(configured: u64, total: u64, depth: u64) -> u64 {
    pipeline_chunk(configured, total, depth).max(configured.min(4 << 20))
}

/// Batches of at least this many requests, all small and in order and apart, skip planning
/// (`execute_in_order` of uploads and downloads, and prepared sets): fewer small copies
/// cost less as planned DMAs than as a launch.
pub(crate) const IN_ORDER_MIN: usize = 64;

/// Chunks a batch is cut into at least, when it is large enough. For 8192 reads or writes of
/// 4 KiB and 64 KiB, 8 and 16 chunks measured no better than 4 both ways, 32 worse, when each
/// chunk moved by a DMA and a kernel; small uploads in order, which move by one launch over
/// the bus, measured no better with 2 and 4 MiB chunks either.
pub(crate) const PIPELINE_DEPTH: u64 = 4;

/// [`PIPELINE_DEPTH`] for small reads in order over the bus, where a chunk costs one launch
/// (through device staging it costs two DMAs and a launch, and keeps [`PIPELINE_DEPTH`]):
/// the last chunk's copy-out into the caller's vectors is what the wire does not hide, so
/// more, smaller chunks pay.
pub(crate) const READ_DEPTH: u64 = 8;

/// Chunks of one batch in flight at once; packing chunk `k` waits for chunk `k - RING`.
pub(crate) const RING: usize = 4;

/// Chunks are never cut smaller than this for pipelining.
const MIN_PIPELINE_CHUNK: u64 = 1 << 20;

/// Kept as a batch's requests are added, for the paths that skip the planner: whether every
/// request so far is non-empty, at most a kernel segment long and past the previous one of
/// its buffer with a gap (so that none overlap and none touch: the planner would fuse none),
/// and, while that holds, each request's flat staging offset. Knowing this on submit saves
/// two passes over the requests (a check and a layout), which on a slow host cost as much as
/// moving a few thousand small copies.
#[derive(Default)]
pub(crate) struct Apart {
    /// Set by the first request that breaks the rule: the batch goes to the planner.
    pub(crate) broken: bool,
    /// Each request's flat offset: at the next 16-byte boundary after the previous request,
    /// plus its device address's residue modulo 16 (so the kernel can use 16-byte accesses).
    /// A chunk of the layout starts at the 16-byte boundary below its first offset, which
    /// leaves every offset as it is, however the batch is cut into chunks.
    pub(crate) offsets: Vec<u64>,
    /// The end of the last request's flat range.
    pub(crate) end: u64,
    /// The longest request and the sum of all.
    pub(crate) longest: u64,
    pub(crate) requested: u64,
}

impl Apart {
    /// Notes a request of `len` bytes at `offset` of a buffer whose device address is
    /// `ptr` and whose previous request in the batch ended at `next - 1` (0 for none).
    #[inline]
    pub(crate) fn note(&mut self, next: &mut u64, ptr: u64, offset: u64, len: u64) {
        if self.broken {
            return;
        }
        // The range was checked against the buffer's length: `offset + len` does not overflow.
        if len == 0 || len > SEGMENT || offset < *next {
            self.broken = true;
            return;
        }
        *next = offset + len + 1;
        let address = ptr + offset;
        let at = self.end.next_multiple_of(16) + address % 16;
        self.offsets.push(at);
        self.end = at + len;
        self.longest = self.longest.max(len);
        self.requested += len;
    }

    pub(crate) fn clear(&mut self) {
        self.broken = false;
        self.offsets.clear();
        (self.end, self.longest, self.requested) = (0, 0, 0);
    }
}

/// A chunk of [`cut_apart`]: its requests, and its packed bytes' flat start and length.
pub(crate) struct Span {
    pub(crate) requests: std::ops::Range<usize>,
    pub(crate) start: u64,
    pub(crate) len: u64,
}

/// Cuts a batch of requests in order and apart, laid out as they were added ([`Apart`]:
/// request `i` at flat offset `offsets[i]`, `len(i)` bytes, none longer than a kernel
/// segment), into chunks whose descriptor table (one descriptor a request) and packed bytes
/// fit `budget(k)` for chunk `k` (at least 64 KiB), each chunk the longest run of requests
/// that fits (at least one): found by binary search, as flat offsets grow with the index, so
/// the cost is per chunk, not per request. A chunk starts at the 16-byte boundary below its
/// first offset. Fills `spans`.
pub(crate) fn cut_apart(
    offsets: &[u64],
    len: impl Fn(usize) -> u64,
    budget: impl Fn(usize) -> u64,
    spans: &mut Vec<Span>,
) {
    spans.clear();
    let mut first = 0;
    while first < offsets.len() {
        let start = offsets[first] & !15;
        let chunk_bytes = budget(spans.len());
        let end = |i: usize| offsets[i] + len(i) - start;
        let fits = |i: usize| table_bytes((i + 1 - first) as u64) + end(i) <= chunk_bytes;
        // The first request past `first` that does not fit (one request alone always does:
        // it is at most a segment, a chunk at least 64 KiB).
        let (mut lo, mut hi) = (first + 1, offsets.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if fits(mid) { lo = mid + 1 } else { hi = mid }
        }
        spans.push(Span { requests: first..lo, start, len: end(lo - 1) });
        first = lo;
    }
}

/// The first chunk of small uploads in order (batches and prepared sets), which then grow
/// ([`growing`]) to the batch's chunk: chunks growing from 256 KiB measured faster than equal
/// ones for 8192 writes of 256 B and 4 KiB, batches and prepared sets alike (`xfer-bench
/// --suite grid`, BENCHMARKS.md); from 512 KiB no better than equal chunks.
pub(crate) const FIRST_CHUNK: u64 = 256 << 10;

/// The budget of chunk `k` of chunks that start at `first` bytes and double up to `most`:
/// the first chunk is packed and moving while the packing threads are still waking, and
/// each later one is packed while the one before it is on the wire.
pub(crate) fn growing(first: u64, most: u64) -> impl Fn(usize) -> u64 {
    move |k| first.saturating_mul(1 << k.min(62)).min(most)
}

#[cfg(test)]
mod tests {
    use super::{in_order_chunk, pipeline_chunk};

    const MIB: u64 = 1 << 20;

    #[test]
    fn batches_are_cut_into_several_chunks_when_large_enough() {
        assert_eq!(pipeline_chunk(16 * MIB, 100, 4), MIB, "small batches: the minimum");
        assert_eq!(pipeline_chunk(16 * MIB, 16 * MIB, 4), 4 * MIB);
        assert_eq!(pipeline_chunk(16 * MIB, 1 << 30, 4), 16 * MIB, "large batches: the configured chunk");
        assert_eq!(pipeline_chunk(16 * MIB, 6 * MIB + 1, 4) % (64 << 10), 0);
        assert_eq!(pipeline_chunk(512 << 10, 16 * MIB, 4), 512 << 10, "never above the configured chunk");
        assert_eq!(in_order_chunk(16 * MIB, 2 * MIB, 4), 4 * MIB, "a few thousand small requests: one chunk");
        assert_eq!(in_order_chunk(16 * MIB, 32 * MIB, 4), 8 * MIB);
        assert_eq!(in_order_chunk(16 * MIB, 32 * MIB, 8), 4 * MIB);
        assert_eq!(in_order_chunk(16 * MIB, 2 * MIB, 8), 4 * MIB, "not below 4 MiB");
        assert_eq!(in_order_chunk(64 << 10, 32 * MIB, 4), 64 << 10, "never above the configured chunk");
    }

    /// The layout of requests in order and apart, one request at a time, as it was done on
    /// submit before [`super::Apart`]: the reference for [`super::cut_apart`].
    /// A chunk as (requests, start, length).
    type Cut = (std::ops::Range<usize>, u64, u64);

    fn reference(requests: &[(u64, u64)], budget: impl Fn(usize) -> u64) -> (Vec<u64>, Vec<Cut>) {
        let (mut offsets, mut spans) = (Vec::new(), Vec::new());
        let (mut first, mut start, mut cursor) = (0, 0u64, 0u64);
        for (i, &(address, len)) in requests.iter().enumerate() {
            let mut at = cursor.next_multiple_of(16) + address % 16;
            if crate::kernels::table_bytes((i + 1 - first) as u64) + at + len - start > budget(spans.len())
                && i > first
            {
                spans.push((first..i, start, cursor - start));
                (first, start) = (i, cursor.next_multiple_of(16));
                at = start + address % 16;
            }
            offsets.push(at);
            cursor = at + len;
        }
        spans.push((first..offsets.len(), start, cursor - start));
        (offsets, spans)
    }

    #[test]
    fn requests_laid_out_as_added_and_cut_by_search_match_the_layout_made_one_by_one() {
        let mut rng = fastrand::Rng::with_seed(7);
        for round in 0..300 {
            let buffers = rng.u32(1..8);
            let mut apart = super::Apart::default();
            let (mut next, mut noted) = (vec![0u64; buffers as usize], vec![0u64; buffers as usize]);
            let mut requests = Vec::new();
            for _ in 0..rng.usize(1..3000) {
                let key = rng.u32(..buffers);
                let len = match rng.u8(..3) {
                    0 => rng.u64(1..32),
                    1 => rng.u64(1..=4096),
                    _ => rng.u64(1..=crate::kernels::SEGMENT),
                };
                let offset = next[key as usize] + rng.u64(1..50);
                next[key as usize] = offset + len;
                // Buffers at 256-byte boundaries, as the allocator places them.
                let ptr = u64::from(key) << 32;
                apart.note(&mut noted[key as usize], ptr, offset, len);
                requests.push((ptr + offset, len));
            }
            assert!(!apart.broken, "round {round}");
            let chunk_bytes = [64 << 10, 1 << 20, 4 << 20][round % 3];
            // Equal chunks, or chunks growing from 64 KiB.
            let budget = |k: usize| {
                if round % 2 == 0 { chunk_bytes } else { super::growing(64 << 10, chunk_bytes)(k) }
            };
            let (offsets, spans) = reference(&requests, budget);
            assert_eq!(apart.offsets, offsets, "round {round}: offsets");
            let mut cut = Vec::new();
            super::cut_apart(&apart.offsets, |i| requests[i].1, budget, &mut cut);
            let cut: Vec<_> = cut.iter().map(|s| (s.requests.clone(), s.start, s.len)).collect();
            assert_eq!(cut, spans, "round {round}: chunks");
            assert_eq!(apart.requested, requests.iter().map(|r| r.1).sum::<u64>());
            assert_eq!(apart.longest, requests.iter().map(|r| r.1).max().unwrap());
        }
    }

    #[test]
    fn growing_chunks_double_from_the_first_up_to_the_most() {
        let g = super::growing(256 << 10, 8 * MIB);
        let sizes: Vec<u64> = (0..8).map(&g).collect();
        assert_eq!(sizes, [256 << 10, 512 << 10, MIB, 2 * MIB, 4 * MIB, 8 * MIB, 8 * MIB, 8 * MIB]);
        assert_eq!(g(1000), 8 * MIB, "no overflow far out");
        assert_eq!(super::growing(256 << 10, 64 << 10)(0), 64 << 10, "never above the most");
    }

    #[test]
    fn a_request_that_overlaps_touches_goes_back_is_empty_or_too_long_breaks_the_in_order_layout() {
        const SEGMENT: u64 = crate::kernels::SEGMENT;
        // (buffer key, offset, length) each.
        type Requests = &'static [(u32, u64, u64)];
        let cases: [(&str, Requests); 6] = [
            ("overlap", &[(0, 0, 10), (0, 5, 10)]),
            ("touch", &[(0, 0, 10), (0, 10, 10)]),
            ("back", &[(0, 100, 10), (1, 0, 4), (0, 0, 10)]),
            ("empty", &[(0, 0, 10), (0, 20, 0)]),
            ("too long", &[(0, 0, SEGMENT + 1)]),
            ("same range twice", &[(1, 8, 8), (1, 8, 8)]),
        ];
        for (what, requests) in cases {
            let (mut apart, mut next) = (super::Apart::default(), [0u64; 2]);
            for &(key, offset, len) in requests {
                apart.note(&mut next[key as usize], 0, offset, len);
            }
            assert!(apart.broken, "{what}");
            apart.clear();
            let mut next = 0;
            apart.note(&mut next, 0, 0, SEGMENT);
            apart.note(&mut next, 0, SEGMENT + 1, 1);
            assert!(
                !apart.broken && apart.offsets == [0, SEGMENT.next_multiple_of(16) + 1],
                "{what}: cleared"
            );
        }
    }
}

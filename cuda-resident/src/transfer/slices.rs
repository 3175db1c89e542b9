//! Large reads into the caller's slices, pipelined as one stream: the ranges laid end to end
//! are cut into chunks of a ring of pinned leases; chunk `k + 1` is on the wire (one DMA per
//! range piece in it) while chunk `k` is copied out by the packing threads. One range is
//! [`Device::download_to_slice`](crate::Device::download_to_slice); many move with no gap
//! between them on the wire.

use std::collections::HashSet;
use std::sync::Arc;

use crate::alloc::ResidentBuffer;
use crate::engine::Exec;
use crate::engine::core::Core;
use crate::engine::host::Piece;
use crate::error::Result;
use crate::plan::route::{PIPELINE_DEPTH, pipeline_chunk};
use crate::stream::LaneKind;

/// One read: `out.len()` bytes of `buffer` at `offset`.
pub(crate) struct SliceRead<'o> {
    pub(crate) buffer: ResidentBuffer,
    pub(crate) offset: u64,
    pub(crate) out: &'o mut [u8],
}

/// A piece of a read that lies in one chunk: `len` bytes of read `read` from `at` (of the
/// read), at `in_chunk` of the chunk's lease.
struct Span {
    read: usize,
    at: u64,
    in_chunk: u64,
    len: u64,
}

/// The pieces of chunk `[start, end)` of the reads laid end to end (`starts`: where each read
/// begins in that stream; `lens`: their lengths), from read `*cursor` on, which this moves
/// to the read where the next chunk begins.
fn spans_of(starts: &[u64], lens: &[u64], (start, end): (u64, u64), cursor: &mut usize, out: &mut Vec<Span>) {
    out.clear();
    let mut i = *cursor;
    while i < lens.len() && starts[i] < end {
        let from = start.max(starts[i]);
        let to = end.min(starts[i] + lens[i]);
        if to > from {
            out.push(Span { read: i, at: from - starts[i], in_chunk: from - start, len: to - from });
        }
        if starts[i] + lens[i] > end {
            break;
        }
        i += 1;
    }
    *cursor = i;
}

/// Reads every `reads` item into its slice. Checks every range first (nothing moves on a
/// bad one). A driver error part way returns with the chunks before it copied out, the rest
/// of the slices as they were.
pub(crate) fn download_to_slices(core: &Arc<Core>, reads: &mut [SliceRead<'_>]) -> Result<()> {
    let srcs = reads
        .iter()
        .map(|r| core.checked_range(r.buffer, r.offset, r.out.len() as u64))
        .collect::<Result<Vec<u64>>>()?;
    let lens: Vec<u64> = reads.iter().map(|r| r.out.len() as u64).collect();
    let mut starts = Vec::with_capacity(lens.len());
    let mut total = 0u64;
    for &len in &lens {
        starts.push(total);
        total += len;
    }
    if total == 0 {
        return Ok(());
    }
    let chunk = pipeline_chunk(core.config.chunk_bytes, total, PIPELINE_DEPTH);
    let chunks = total.div_ceil(chunk) as usize;
    let buffers: HashSet<ResidentBuffer> = reads.iter().map(|r| r.buffer).collect();
    let mut exec = Exec::begin(core, LaneKind::Download);
    exec.claim_ranges(buffers.into_iter(), chunks as u64, |r| {
        for (&src, &len) in srcs.iter().zip(&lens) {
            if len > 0 {
                r.push(src, len);
            }
        }
    })?;
    exec.requested(total);
    let ring = exec.ring(chunk as usize, chunks.min(crate::plan::route::RING))?;
    let ring_len = ring.len();
    let outs: Vec<*mut u8> = reads.iter_mut().map(|r| r.out.as_mut_ptr()).collect();
    let bounds = |k: usize| (k as u64 * chunk, ((k as u64 + 1) * chunk).min(total));
    let mut seqs = Vec::with_capacity(chunks);
    let mut pieces = Vec::new();
    let (mut spans, mut unpack_spans) = (Vec::new(), Vec::new());
    let mut unpack_cursor = 0;
    let mut unpack = |k: usize, seqs: &[u64]| -> Result<()> {
        crate::engine::wait(core, LaneKind::Download, seqs[k])?;
        spans_of(&starts, &lens, bounds(k), &mut unpack_cursor, &mut unpack_spans);
        pieces.clear();
        let lease = ring[k % ring_len].as_ptr();
        for s in &unpack_spans {
            // SAFETY: `at + len` lies inside read `s.read`'s slice, `in_chunk + len` inside
            // the chunk's lease.
            let (dst, src) = unsafe { (outs[s.read].add(s.at as usize), lease.add(s.in_chunk as usize)) };
            Piece::push_split(&mut pieces, Piece { dst, src, len: s.len as usize });
        }
        // SAFETY: the chunk's DMAs completed (waited above); the lease and the caller's
        // slices are disjoint, each piece writes its own part of one slice.
        unsafe { Piece::copy_out_all(&core.packers, &pieces) };
        Ok(())
    };
    let mut cursor = 0;
    for k in 0..chunks {
        if k >= ring_len {
            unpack(k - ring_len, &seqs)?;
        }
        let lease = &ring[k % ring_len];
        let dst = lease.as_ptr();
        spans_of(&starts, &lens, bounds(k), &mut cursor, &mut spans);
        seqs.push(exec.submit(vec![Arc::clone(lease)], |q| {
            for s in &spans {
                // SAFETY: a range of a live, marked buffer into a pinned lease that holds the
                // chunk and that this submission keeps alive.
                unsafe { q.dtoh(dst.add(s.in_chunk as usize), srcs[s.read] + s.at, s.len as usize) }?;
            }
            Ok(())
        })?);
    }
    let ended = exec.end();
    for k in chunks.saturating_sub(ring_len)..chunks {
        unpack(k, &seqs)?;
    }
    ended.record();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every byte of the stream is in exactly one piece, in order, and no piece crosses its
    /// chunk or its read.
    #[test]
    fn chunks_cut_the_reads_laid_end_to_end() {
        let mut rng = fastrand::Rng::with_seed(36);
        for _ in 0..300 {
            let lens: Vec<u64> =
                (0..rng.usize(1..20)).map(|_| [0, 1, 7, 4096, 100_000][rng.usize(..5)]).collect();
            let mut starts = Vec::new();
            let mut total = 0;
            for &l in &lens {
                starts.push(total);
                total += l;
            }
            let chunk = rng.u64(1..50_000);
            let (mut cursor, mut spans, mut seen) = (0, Vec::new(), 0u64);
            for k in 0..total.div_ceil(chunk) {
                let (start, end) = (k * chunk, ((k + 1) * chunk).min(total));
                spans_of(&starts, &lens, (start, end), &mut cursor, &mut spans);
                let mut in_chunk = 0;
                for s in &spans {
                    assert_eq!(starts[s.read] + s.at, seen, "in order, no gap");
                    assert_eq!(s.in_chunk, in_chunk);
                    assert!(s.at + s.len <= lens[s.read] && s.len > 0);
                    seen += s.len;
                    in_chunk += s.len;
                }
                assert_eq!(in_chunk, end - start);
            }
            assert_eq!(seen, total);
        }
    }
}

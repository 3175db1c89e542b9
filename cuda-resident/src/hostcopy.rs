//! Host copies out of pinned memory into the caller's memory.
//!
//! An ordinary `memcpy` writes through the caches: every destination line is first read
//! from memory (a read for ownership), then written. Copying a download out of staging into
//! caller memory that is not in the cache (a large download never is) therefore moves each
//! byte over the memory bus three times. On x86-64, copies of [`STREAM_MIN`] bytes or more
//! write whole cache lines with streaming (non-temporal) stores instead, which skip the read
//! for ownership, which measured faster for large downloads into `Vec`s and pageable memory
//! (BENCHMARKS.md). Smaller copies stay ordinary: their destinations are likely still in the
//! cache when the caller reads them, and streaming measured no gain for 4 KiB reads.
//!
//! Uploads pack with ordinary stores on purpose: streaming stores into staging measured
//! slower: the copy engine reads freshly written lines faster from the cache than from
//! memory.
//!
//! Streaming stores are weakly ordered: a thread that made them calls [`publish`] before it
//! tells another thread that the bytes are there.

/// Copies shorter than this use an ordinary copy.
const STREAM_MIN: usize = 16 << 10;

/// Copies `len` bytes of landed staging at `src` into caller memory at `dst` (the argument
/// order of [`std::ptr::copy_nonoverlapping`]). The calling thread must call [`publish`]
/// before another thread reads the destination.
///
/// # Safety
///
/// `src` must be readable and `dst` writable for `len` bytes, and the ranges must not overlap.
#[inline]
pub(crate) unsafe fn copy_out(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len >= STREAM_MIN {
        // SAFETY: as the caller promises.
        unsafe { stream_x86_64(src, dst, len) };
        return;
    }
    // SAFETY: as the caller promises.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

/// Makes the calling thread's streaming stores visible to every later access (an `sfence`),
/// so that any thread that synchronizes with this one afterwards sees the bytes.
#[inline]
pub(crate) fn publish() {
    // SAFETY: `sfence` is SSE, which every x86-64 processor has (the target enables it).
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// [`copy_out`] for long copies on x86-64: the part up to the first cache-line boundary of
/// `dst` and the part after the last one by an ordinary copy, the whole lines between by
/// 16-byte streaming stores (SSE2, which every x86-64 processor has).
///
/// # Safety
///
/// As [`copy_out`].
#[cfg(target_arch = "x86_64")]
unsafe fn stream_x86_64(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    const LINE: usize = 64;
    let head = dst.align_offset(LINE).min(len);
    let lines = (len - head) / LINE;
    // SAFETY: every offset below stays inside the caller's ranges: head + lines * LINE <= len;
    // `d` is 64-byte aligned in the loop, as 16-byte streaming stores require 16.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let (mut s, mut d) = (src.add(head), dst.add(head));
        for _ in 0..lines {
            let a = _mm_loadu_si128(s.cast::<__m128i>());
            let b = _mm_loadu_si128(s.add(16).cast::<__m128i>());
            let c = _mm_loadu_si128(s.add(32).cast::<__m128i>());
            let e = _mm_loadu_si128(s.add(48).cast::<__m128i>());
            _mm_stream_si128(d.cast::<__m128i>(), a);
            _mm_stream_si128(d.add(16).cast::<__m128i>(), b);
            _mm_stream_si128(d.add(32).cast::<__m128i>(), c);
            _mm_stream_si128(d.add(48).cast::<__m128i>(), e);
            s = s.add(LINE);
            d = d.add(LINE);
        }
        std::ptr::copy_nonoverlapping(s, d, len - head - lines * LINE);
    }
}

#[cfg(test)]
mod tests {
    use super::{STREAM_MIN, copy_out, publish};

    #[test]
    fn every_length_and_alignment_copies_exactly_its_bytes() {
        let mut rng = fastrand::Rng::with_seed(7);
        let room = STREAM_MIN + 4096;
        let src: Vec<u8> = (0..room).map(|_| rng.u8(..)).collect();
        let lens =
            (0..200).chain([STREAM_MIN - 1, STREAM_MIN, STREAM_MIN + 1, STREAM_MIN + 63, STREAM_MIN + 4000]);
        for len in lens {
            for (s_off, d_off) in [(0, 0), (1, 0), (0, 1), (3, 17), (63, 64), (64, 1), (15, 49)] {
                let mut dst = vec![0xA5u8; room + 64];
                // SAFETY: both ranges lie inside their vectors, which are distinct.
                unsafe { copy_out(src.as_ptr().add(s_off), dst.as_mut_ptr().add(d_off), len) };
                publish();
                assert_eq!(
                    &dst[d_off..d_off + len],
                    &src[s_off..s_off + len],
                    "len {len} at {s_off}/{d_off}"
                );
                assert!(dst[..d_off].iter().all(|&b| b == 0xA5), "before, len {len}");
                assert!(dst[d_off + len..].iter().all(|&b| b == 0xA5), "after, len {len}");
            }
        }
    }
}

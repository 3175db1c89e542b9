//! Random bytes, fast: the data every benchmark moves.

/// Fills `bytes` with random bytes from `seed`, on up to 16 threads (one per core).
pub fn fill_random(seed: u64, bytes: &mut [u8]) {
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get()).min(16);
    fill_random_on(seed, bytes, threads);
}

/// [`fill_random`] on `threads` threads: each MiB has a generator of its own, seeded from
/// `seed` and the MiB's place, so that the bytes are the same whatever the number of threads.
fn fill_random_on(seed: u64, bytes: &mut [u8], threads: usize) {
    const PIECE: usize = 1 << 20;
    let pieces_per_thread = bytes.len().div_ceil(PIECE).div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        for (t, part) in bytes.chunks_mut(pieces_per_thread * PIECE).enumerate() {
            s.spawn(move || {
                for (k, piece) in part.chunks_mut(PIECE).enumerate() {
                    let place = (t * pieces_per_thread + k) as u64;
                    // Distinct seeds for distinct places (an odd multiplier is a bijection).
                    let piece_seed = seed ^ place.wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    fastrand::Rng::with_seed(piece_seed).fill(piece);
                }
            });
        }
    });
}

#[cfg(test)]
mod tests {
    use super::fill_random_on;

    #[test]
    fn random_fills_are_reproducible_whatever_the_threads() {
        let len = (5 << 20) + 123;
        let mut one = vec![0u8; len];
        fill_random_on(7, &mut one, 1);
        for threads in [2, 3, 16] {
            let mut many = vec![0u8; len];
            fill_random_on(7, &mut many, threads);
            assert!(many == one, "{threads} threads give the bytes one thread gives");
        }
        let zeros = one.iter().filter(|&&b| b == 0).count();
        assert!(zeros < len / 128, "random, not zeros: {zeros} of {len}");
        assert!(one[..1 << 20] != one[1 << 20..2 << 20], "each MiB has its own bytes");
        let mut other = vec![0u8; len];
        fill_random_on(8, &mut other, 2);
        assert!(other != one, "another seed, other bytes");
        fill_random_on(7, &mut [], 4);
    }
}

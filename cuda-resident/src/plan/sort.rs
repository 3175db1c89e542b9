//! Sorting requests by `(buffer, offset, index)`: the one `O(n log n)` step of planning.
//!
//! Sorting 32-byte entries by a three-part key costs several times as much as sorting plain
//! `u64`s, and it dominated planning. So the sort is done in steps:
//!
//! 0. Requests that already come in order (a caller writing buffers front to back) are not
//!    sorted at all; validation notices.
//! 1. While the requests are validated, each buffer gets a *rank* (the order in which the
//!    batch first names it) from a small hash table.
//! 2. The ranks are put in buffer-key order (a sort of the distinct buffers only), and each
//!    request gets one `u64` key: its buffer's place, its offset and its position (positions
//!    are in request order, so they break ties by index).
//! 3. The keys are sorted by a least-significant-digit radix sort: at most four passes of 11
//!    bits over the top of the place and offset bits, and the fewer than 11 low offset bits
//!    left over finished by an insertion sort, which then finds only a few neighbours out of
//!    order (it gives up for `sort_unstable` past one move per key, for batches whose keys
//!    mostly share their top bits). The position bits need no pass: the keys are built in
//!    position order, and every pass is stable. For 8192 requests over 64 buffers of 64 MiB
//!    that is two passes and the insertion sort, which measured 5-15% faster for a whole
//!    plan than the counting sort by buffer followed by a `sort_unstable` per bucket that it
//!    replaced (three full passes and no insertion sort: about 3-8% slower than two).
//!    Small batches, and keys that would need more passes, use `sort_unstable` on the same
//!    keys. Tried and not kept: gathering the entries into sorted order after the sort, and
//!    radix sorting `[key, end]` pairs whose key holds the request index (so that the sweep
//!    reads everything in sequence instead of one random entry per request); both measured
//!    slower, the pairs by about 10%: moving the bytes costs more than the misses they save.
//!
//! The key fits as long as offsets need at most `64 - log2(requests) - log2(buffers)` bits,
//! which every realistic batch does (8192 requests over 64 buffers leave 45 bits, 32 TiB);
//! any other batch falls back to sorting the entries by the tuple, with the same result.

use super::BufferKey;
use super::fuse::{Collected, Entry};

/// Gives each distinct buffer of a batch a dense rank.
#[derive(Debug, Default)]
pub(super) struct Ranker {
    /// The distinct buffers in first-seen order.
    buffers: Vec<BufferKey>,
    /// Open-addressing table of `(buffer, first-seen rank)`, rank `u32::MAX` for an empty
    /// slot; its length is a power of two, and it is kept at most a quarter full, so that a
    /// lookup rarely probes twice (a second probe is a mispredicted branch).
    table: Vec<(BufferKey, u32)>,
}

impl Ranker {
    /// Forgets the previous batch.
    pub(super) fn reset(&mut self) {
        self.buffers.clear();
        reset_table(&mut self.table, 64);
    }

    /// The first-seen rank of `buffer`, inserting it if new. Expected `O(1)`. It writes
    /// nothing for a buffer already seen (request counts are taken later, in a pass of
    /// their own), so that the caller's loop keeps its state in registers.
    #[inline]
    pub(super) fn rank(&mut self, buffer: BufferKey) -> u32 {
        let mask = self.table.len() - 1;
        let mut slot = hash(buffer, self.table.len());
        loop {
            match self.table[slot] {
                (key, rank) if rank != u32::MAX && key == buffer => return rank,
                (_, rank) if rank != u32::MAX => slot = (slot + 1) & mask,
                _ => return self.insert(buffer, slot),
            }
        }
    }

    /// Adds a new buffer at the empty `slot`, growing the table when it gets a quarter full.
    #[cold]
    fn insert(&mut self, buffer: BufferKey, slot: usize) -> u32 {
        // Fewer distinct buffers than requests, and those fit `u32`.
        let rank = self.buffers.len() as u32;
        self.buffers.push(buffer);
        self.table[slot] = (buffer, rank);
        if self.buffers.len() * 4 >= self.table.len() {
            self.grow();
        }
        rank
    }

    /// Doubles the table and re-inserts the buffers seen so far.
    fn grow(&mut self) {
        let len = self.table.len() * 2;
        reset_table(&mut self.table, len);
        let mask = len - 1;
        for (rank, &buffer) in (0u32..).zip(&self.buffers) {
            let mut slot = hash(buffer, len);
            while self.table[slot].1 != u32::MAX {
                slot = (slot + 1) & mask;
            }
            self.table[slot] = (buffer, rank);
        }
    }
}

/// Fibonacci hashing: the top bits of a multiplication spread any key pattern (handles,
/// small integers, pointers) over a power-of-two table.
fn hash(buffer: BufferKey, table_len: usize) -> usize {
    let bits = table_len.trailing_zeros();
    (buffer.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (u64::BITS - bits)) as usize
}

fn reset_table(table: &mut Vec<(BufferKey, u32)>, len: usize) {
    table.clear();
    table.resize(len, (0, u32::MAX));
}

/// Scratch memory for [`sort_entries`], kept by the planner between batches.
#[derive(Debug)]
pub(super) struct SortScratch {
    /// Ranks the buffers while the requests are collected.
    pub(super) ranker: Ranker,
    /// Sort keys; in the end the sorted order.
    keys: Vec<u64>,
    /// The other half of the radix sort's ping-pong.
    spare: Vec<u64>,
    /// `(buffer, first-seen rank)`, sorted by buffer.
    by_key: Vec<(BufferKey, u32)>,
    /// For each first-seen rank, the buffer's place in buffer-key order.
    key_rank: Vec<u64>,
    /// The radix sort's counters.
    counts: Box<Counts>,
}

impl Default for SortScratch {
    fn default() -> Self {
        Self {
            ranker: Ranker::default(),
            keys: Vec::new(),
            spare: Vec::new(),
            by_key: Vec::new(),
            key_rank: Vec::new(),
            counts: Box::new([0; 1 << MAX_DIGIT_BITS]),
        }
    }
}

/// The entries in sorted order, without moving them: entry `i` in order is
/// `entries[order[i] & mask]`. Moving 32-byte entries into order would cost a pass of its
/// own; the sweep that follows reads each entry once, in this order, anyway.
pub(super) struct Sorted<'a> {
    entries: &'a [Entry],
    /// `None` when the entries are in order as they are.
    order: Option<&'a [u64]>,
    mask: u64,
}

impl<'a> Sorted<'a> {
    /// How many entries there are.
    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Entry `i` in sorted order.
    #[inline]
    pub(super) fn get(&self, i: usize) -> &'a Entry {
        match self.order {
            Some(order) => &self.entries[(order[i] & self.mask) as usize],
            None => &self.entries[i],
        }
    }

    /// Entries `first..last` in sorted order.
    pub(super) fn range(&self, first: u32, last: u32) -> impl Iterator<Item = &'a Entry> + '_ {
        (first as usize..last as usize).map(|i| self.get(i))
    }
}

/// Widest radix digit: 2048 counters per pass stay in L1 next to the keys.
const MAX_DIGIT_BITS: u32 = 11;
/// Most radix passes worth making; wider keys are compared instead.
const MAX_PASSES: u32 = 4;
/// Below this many entries a comparison sort beats clearing the counting tables.
const MIN_RADIX: usize = 256;

/// Sorts `entries` (in request order, each with its buffer's rank from `scratch.ranker`) by
/// `(buffer, start, index)`, using what [`collect`](super::fuse::collect) found about them.
pub(super) fn sort_entries<'a>(
    entries: &'a mut [Entry],
    found: &Collected,
    scratch: &'a mut SortScratch,
) -> Sorted<'a> {
    if found.in_order {
        return Sorted { entries, order: None, mask: 0 };
    }
    let position_bits = bits((entries.len() as u64).saturating_sub(1));
    let SortScratch { ranker, keys, spare, by_key, key_rank, counts } = scratch;
    let buffer_bits = bits((ranker.buffers.len() as u64).saturating_sub(1));
    let offset_bits = bits(found.max_start);
    let sort_bits = buffer_bits + offset_bits;
    if sort_bits + position_bits > u64::BITS {
        return sort_by_tuple(entries);
    }
    // Each buffer's place in key order: the key's top bits.
    by_key.clear();
    by_key.extend((0u32..).zip(&ranker.buffers).map(|(rank, &buffer)| (buffer, rank)));
    by_key.sort_unstable();
    key_rank.clear();
    key_rank.resize(by_key.len(), 0);
    for (place, &(_, rank)) in (0u64..).zip(by_key.iter()) {
        // The shift is 64 only for a single buffer, whose place is 0.
        key_rank[rank as usize] = place.checked_shl(offset_bits + position_bits).unwrap_or(0);
    }
    // `(buffer place, start, position)`: unique, and in position order as built.
    keys.clear();
    keys.extend(
        (0u64..)
            .zip(entries.iter())
            .map(|(position, e)| key_rank[e.rank as usize] | e.start << position_bits | position),
    );
    // Full digits over the top bits; the low bits left over (fewer than a digit) are
    // finished by an insertion sort, which finds the keys all but sorted.
    let passes = (sort_bits / MAX_DIGIT_BITS).max(1);
    if entries.len() < MIN_RADIX || passes > MAX_PASSES {
        keys.sort_unstable();
    } else if sort_bits > 0 {
        let digit = sort_bits.min(MAX_DIGIT_BITS);
        let low = position_bits + sort_bits - digit * passes;
        radix_sort(keys, spare, counts, low, digit, passes);
        if low > position_bits {
            finish_sort(keys);
        }
    }
    Sorted { entries, order: Some(keys), mask: (1u64 << position_bits) - 1 }
}

/// Counters of one radix pass.
type Counts = [u32; 1 << MAX_DIGIT_BITS];

/// A least-significant-digit radix sort of `keys` on bits `low..low + digit * passes`. Every
/// pass is stable, and the keys come in position order (their low bits), so those bits need
/// no pass. Each pass counts the next pass's digits while it moves the keys.
fn radix_sort(
    keys: &mut Vec<u64>,
    spare: &mut Vec<u64>,
    counts: &mut Counts,
    low: u32,
    digit: u32,
    passes: u32,
) {
    let radix = 1usize << digit;
    let mask = radix as u64 - 1;
    let n = keys.len();
    spare.clear();
    spare.resize(n, 0);
    let counts = &mut counts[..radix];
    counts.fill(0);
    for &key in keys.iter() {
        counts[((key >> low) & mask) as usize] += 1;
    }
    let mut next = [0u32; 1 << MAX_DIGIT_BITS];
    let next = &mut next[..radix];
    let (mut src, mut dst) = (&mut keys[..], &mut spare[..n]);
    let mut in_spare = false;
    for p in 0..passes {
        let shift = low + digit * p;
        let next_shift = shift + digit;
        let last = p + 1 == passes;
        next.fill(0);
        // A digit every key shares moves nothing.
        if counts.contains(&(n as u32)) {
            if !last {
                for &key in src.iter() {
                    next[((key >> next_shift) & mask) as usize] += 1;
                }
            }
        } else {
            let mut sum = 0;
            for c in counts.iter_mut() {
                sum += std::mem::replace(c, sum);
            }
            if last {
                for &key in src.iter() {
                    let slot = &mut counts[((key >> shift) & mask) as usize];
                    dst[*slot as usize] = key;
                    *slot += 1;
                }
            } else {
                for &key in src.iter() {
                    let slot = &mut counts[((key >> shift) & mask) as usize];
                    dst[*slot as usize] = key;
                    *slot += 1;
                    next[((key >> next_shift) & mask) as usize] += 1;
                }
            }
            std::mem::swap(&mut src, &mut dst);
            in_spare = !in_spare;
        }
        counts.copy_from_slice(next);
    }
    if in_spare {
        std::mem::swap(keys, spare);
    }
}

/// Sorts keys that are sorted but for a few small groups of neighbours (sorted by their top
/// bits): an insertion sort, which moves nothing when the keys are in order. Keys that need
/// more moves than that (many sharing their top bits) are sorted by `sort_unstable` instead.
fn finish_sort(keys: &mut [u64]) {
    let mut budget = keys.len();
    for i in 1..keys.len() {
        let key = keys[i];
        let mut j = i;
        while j > 0 && keys[j - 1] > key {
            keys[j] = keys[j - 1];
            j -= 1;
        }
        keys[j] = key;
        budget = budget.saturating_sub(i - j);
        if budget == 0 {
            keys.sort_unstable();
            return;
        }
    }
}

/// The fallback for offsets too wide for the packed key: sort the entries themselves.
#[cold]
fn sort_by_tuple(entries: &mut [Entry]) -> Sorted<'_> {
    entries.sort_unstable_by_key(|e| (e.buffer, e.start, e.index));
    Sorted { entries, order: None, mask: 0 }
}

/// Bits needed to write `x`.
fn bits(x: u64) -> u32 {
    u64::BITS - x.leading_zeros()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::{SortScratch, sort_entries};
    use crate::plan::fuse::{Collected, Entry};

    /// Entries as `collect` makes them: in request order, ranked by the scratch's ranker.
    fn entries(raw: &[(u64, u64)], scratch: &mut SortScratch) -> (Vec<Entry>, Collected) {
        scratch.ranker.reset();
        let entries: Vec<_> = (0u32..)
            .zip(raw)
            .map(|(index, &(buffer, start))| {
                let rank = scratch.ranker.rank(buffer);
                Entry { buffer, start, end: start, index, rank }
            })
            .collect();
        let in_order = raw.is_sorted();
        (
            entries,
            Collected { requested_bytes: 0, max_start: raw.iter().map(|r| r.1).max().unwrap_or(0), in_order },
        )
    }

    fn order(entries: &[Entry]) -> Vec<(u64, u64, u32)> {
        entries.iter().map(|e| (e.buffer, e.start, e.index)).collect()
    }

    fn check(raw: &[(u64, u64)], scratch: &mut SortScratch) {
        let (mut actual, found) = entries(raw, scratch);
        let mut expected = actual.clone();
        expected.sort_unstable_by_key(|e| (e.buffer, e.start, e.index));
        let sorted = sort_entries(&mut actual, &found, scratch);
        let actual: Vec<Entry> = (0..sorted.len()).map(|i| *sorted.get(i)).collect();
        assert_eq!(order(&actual), order(&expected));
        assert_eq!(
            order(&sorted.range(0, actual.len() as u32).copied().collect::<Vec<_>>()),
            order(&expected)
        );
    }

    proptest! {
        /// The bucketed sort (and its fallback) orders like sorting by the tuple, for keys
        /// from a few small values (ties, one buffer) to any `u64` (many buffers, wide
        /// offsets, growing the hash table), with one scratch reused across batches.
        #[test]
        fn sorts_like_the_tuple_key(
            batches in prop::collection::vec(
                prop::collection::vec(
                    (prop_oneof![0u64..4, any::<u64>()], prop_oneof![0u64..64, any::<u64>()]),
                    0..300,
                ),
                1..4,
            ),
        ) {
            let mut scratch = SortScratch::default();
            for raw in batches {
                check(&raw, &mut scratch);
            }
        }
    }

    #[test]
    fn large_batches_take_the_radix_path() {
        // One buffer, offsets of 6 bits: one narrow pass.
        let raw: Vec<_> = (0..3000u64).map(|i| (7, (i * 7919) % 61)).collect();
        check(&raw, &mut SortScratch::default());
        // One buffer, offsets of 22 bits whose top 11 are all the same: that pass is skipped.
        let raw: Vec<_> = (0..3000u64).map(|i| (7, (1 << 21) + (i * 7919) % 2048)).collect();
        check(&raw, &mut SortScratch::default());
        // Keys of 44 bits: four full passes, ties included.
        let raw: Vec<_> = (0..3000u64)
            .map(|i| (i % 3, i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 22 & !0xF))
            .chain((0..500).map(|i| (1, i)))
            .collect();
        check(&raw, &mut SortScratch::default());
        // 32 bits: two passes, and the low 10 bits finished by insertion.
        let raw: Vec<_> =
            (0..8192u64).map(|i| (i * 13 % 64, i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 38)).collect();
        check(&raw, &mut SortScratch::default());
        // Most keys share their top bits: the insertion sort gives up for `sort_unstable`.
        let raw: Vec<_> =
            (0..3000u64).map(|i| (0, (i * 7919) % 1000)).chain([(0, 1 << 40), (0, 5), (0, 3)]).collect();
        check(&raw, &mut SortScratch::default());
        // Wider keys than four passes take `sort_unstable`.
        let raw: Vec<_> =
            (0..3000u64).map(|i| (i % 5, i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 14)).collect();
        check(&raw, &mut SortScratch::default());
    }

    #[test]
    fn many_buffers_and_small_offsets_take_the_radix_path() {
        let raw: Vec<_> =
            (0..5000u64).map(|i| (i.wrapping_mul(0x1234_5678_9ABC_DEF1) % 1000, (i * 7919) % 4096)).collect();
        check(&raw, &mut SortScratch::default());
    }

    #[test]
    fn entries_in_order_are_not_sorted_again() {
        check(&[(0, 5), (0, 5), (0, 9), (1, 0), (u64::MAX, 0)], &mut SortScratch::default());
        check(&[], &mut SortScratch::default());
        check(&[(3, 3)], &mut SortScratch::default());
    }

    #[test]
    fn offsets_too_wide_for_the_key_take_the_fallback() {
        check(&[(1, u64::MAX), (0, 5), (1, 3), (0, u64::MAX - 1), (1, 3)], &mut SortScratch::default());
        check(&[(5, (1 << 63) + 7), (5, 3)], &mut SortScratch::default());
        // Offsets that fill the key but for the position bits: no room for a place.
        check(&[(5, (1 << 62) + 7), (5, 3)], &mut SortScratch::default());
        let raw: Vec<_> = (0..300u64).map(|i| (5, (1 << 54) + i % 17)).chain([(5, 0)]).collect();
        check(&raw, &mut SortScratch::default());
    }
}

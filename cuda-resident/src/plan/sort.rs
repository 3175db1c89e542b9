//! Sorting requests by `(buffer, offset, index)`: the one `O(n log n)` step of planning.
//!
//! Sorting 32-byte entries by a three-part key costs several times as much as sorting plain
//! `u64`s, and it dominated planning. So the sort is done in steps:
//!
//! 0. Requests that already come in order (a caller writing buffers front to back) are not
//!    sorted at all; validation notices.
//! 1. While the requests are validated, each buffer gets a *rank* (the order in which the
//!    batch first names it) from a small hash table.
//! 2. A counting sort by buffer (ranks put in buffer-key order) writes one `u64` key per
//!    request into its buffer's bucket: the offset and the request's position (positions are
//!    in request order, so they break ties by index). Each bucket is then sorted on its own:
//!    many small sorts cost less than one large one (for 8192 requests over 64 buffers,
//!    about 70% of one `sort_unstable` of the same keys). A finer bucket sort (by the top
//!    bits of the offset too, finished by insertion sort) measured no faster: its extra
//!    passes over the entries cost what it saved.
//!
//! The key fits as long as offsets need at most `64 - log2(requests)` bits, which every
//! realistic batch does (8192 requests leave 51 bits, 2 PiB); any other batch falls back to
//! sorting the entries by the tuple, with the same result.

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
#[derive(Debug, Default)]
pub(super) struct SortScratch {
    /// Ranks the buffers while the requests are collected.
    pub(super) ranker: Ranker,
    /// Sort keys, bucketed; in the end the sorted order.
    keys: Vec<u64>,
    /// `(buffer, first-seen rank)`, sorted by buffer.
    by_key: Vec<(BufferKey, u32)>,
    /// For each first-seen rank, where its bucket's next key goes.
    next: Vec<u32>,
    /// Where each bucket starts, in buffer-key order, plus the end.
    bounds: Vec<u32>,
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
    if bits(found.max_start) + position_bits > u64::BITS {
        return sort_by_tuple(entries);
    }
    bucket_bounds(entries, scratch);
    let SortScratch { keys, next, bounds, .. } = scratch;
    keys.clear();
    keys.resize(entries.len(), 0);
    for (position, e) in entries.iter().enumerate() {
        let slot = &mut next[e.rank as usize];
        keys[*slot as usize] = e.start << position_bits | position as u64;
        *slot += 1;
    }
    for bucket in bounds.windows(2) {
        keys[bucket[0] as usize..bucket[1] as usize].sort_unstable();
    }
    Sorted { entries, order: Some(keys), mask: (1u64 << position_bits) - 1 }
}

/// The fallback for offsets too wide for the packed key: sort the entries themselves.
#[cold]
fn sort_by_tuple(entries: &mut [Entry]) -> Sorted<'_> {
    entries.sort_unstable_by_key(|e| (e.buffer, e.start, e.index));
    Sorted { entries, order: None, mask: 0 }
}

/// Lays the buckets out in buffer-key order: `bounds` gets each bucket's start (and the
/// end), `next` each first-seen rank's bucket start.
fn bucket_bounds(entries: &[Entry], scratch: &mut SortScratch) {
    let SortScratch { ranker, by_key, next, bounds, .. } = scratch;
    // Count the requests of each rank (in `next`, for now).
    next.clear();
    next.resize(ranker.buffers.len(), 0);
    for e in entries {
        next[e.rank as usize] += 1;
    }
    by_key.clear();
    by_key.extend((0u32..).zip(&ranker.buffers).map(|(rank, &buffer)| (buffer, rank)));
    by_key.sort_unstable();
    bounds.clear();
    let mut start = 0u32;
    for &(_, rank) in by_key.iter() {
        bounds.push(start);
        start += std::mem::replace(&mut next[rank as usize], start);
    }
    bounds.push(start);
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
    fn many_buffers_and_small_offsets_take_the_bucketed_path() {
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
    }
}

//! Sorting requests by `(buffer, offset, index)`: the one `O(n log n)` step of planning.
//!
//! Sorting 32-byte entries by a three-part key costs several times as much as sorting plain
//! `u64`s, and it dominated planning. So the sort is done in steps:
//!
//! 1. While the requests are validated, each buffer gets a *rank* (the order in which the
//!    batch first names it) from a small hash table, and each non-empty request gets the
//!    low part of its `u64` key: its offset and its request index (which breaks ties).
//!    Nothing else is kept per request but its length (`u32`, by index): no entry array.
//! 2. The ranks are put in buffer-key order (a sort of the distinct buffers only), and each
//!    key gets its buffer's place on top, in the radix sort's first pass over the keys
//!    (which also notices keys already in order, from a caller writing buffers front to
//!    back, and then sorts nothing).
//! 3. The keys are sorted by a least-significant-digit radix sort: at most four passes of 11
//!    bits over the top of the place and offset bits, and the fewer than 11 low offset bits
//!    left over finished by an insertion sort, which then finds only a few neighbours out of
//!    order (it gives up for `sort_unstable` past one move per key, for batches whose keys
//!    mostly share their top bits). The index bits need no pass: the keys are built in
//!    index order, and every pass is stable. For 8192 requests over 64 buffers of 64 MiB
//!    that is two passes and the insertion sort. (Digits of 8, 9, 10, 12 and 13 bits all
//!    measured slower.) Small batches, and keys that would need more passes, use
//!    `sort_unstable` on the same keys.
//! 4. The sweep reads the sorted keys in sequence and decodes each one ([`KeyOrder`]): the
//!    place bits tell buffers apart, the start and index are in the key, and only the
//!    length is read by index, from an array small enough to stay in cache. Tried and not
//!    kept: gathering the lengths into sorted order in a pass of their own (what it saved
//!    the sweep it cost the sort), and, before the keys held everything, radix sorting
//!    `[key, end]` pairs (about 10% slower).
//!
//! The key fits as long as offsets need at most `64 - log2(requests) - log2(buffers)` bits,
//! which every realistic batch does (8192 requests over 64 buffers leave 45 bits, 32 TiB);
//! any other batch (or one with a request of 4 GiB or more, whose length does not fit the
//! `u32` lengths) falls back to sorting entries by the tuple, with the same result.

use super::BufferKey;
use super::request::{Collected, Entry, Request};

/// Gives each distinct buffer of a batch a dense rank.
#[derive(Debug, Default)]
pub(super) struct Ranker {
    /// The distinct buffers in first-seen order.
    pub(super) buffers: Vec<BufferKey>,
    /// Open-addressing table of `(buffer, first-seen rank)`, rank `u32::MAX` for an empty
    /// slot; its length is a power of two, and it is kept at most a quarter full, so that a
    /// lookup rarely probes twice (a second probe is a mispredicted branch). An empty slot
    /// holds a key that hashes to the next slot (see [`marker`]), which no lookup can find
    /// there: so a key that matches at its home slot is a hit, whatever the rank says, and
    /// the common lookup is one comparison.
    table: Vec<(BufferKey, u32)>,
}

impl Ranker {
    /// Forgets the previous batch, keeping the table's size (up to a few KiB), which the
    /// next batch likely needs again.
    pub(super) fn reset(&mut self) {
        self.buffers.clear();
        let len = if self.table.len() <= 1024 { self.table.len().max(64) } else { 64 };
        reset_table(&mut self.table, len);
    }

    /// The first-seen rank of `buffer`, inserting it if new. Expected `O(1)`. It writes
    /// nothing for a buffer already seen (request counts are taken later, in a pass of
    /// their own), so that the caller's loop keeps its state in registers.
    #[inline]
    pub(super) fn rank(&mut self, buffer: BufferKey) -> u32 {
        match self.table[hash(buffer, self.table.len())] {
            (key, rank) if key == buffer => rank,
            _ => self.probe(buffer),
        }
    }

    /// A lookup past the home slot, or of a buffer not seen yet.
    #[cold]
    fn probe(&mut self, buffer: BufferKey) -> u32 {
        let mask = self.table.len() - 1;
        let mut slot = hash(buffer, self.table.len());
        loop {
            match self.table[slot] {
                (_, u32::MAX) => return self.insert(buffer, slot),
                (key, rank) if key == buffer => return rank,
                _ => slot = (slot + 1) & mask,
            }
        }
    }

    /// Adds a new buffer at the empty `slot`, growing the table when it gets a quarter full.
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

/// The multiplier of [`hash`].
const FIBONACCI: u64 = 0x9E37_79B9_7F4A_7C15;

/// The inverse of [`FIBONACCI`] modulo `2^64` (it is odd), by Newton's iteration: each step
/// doubles the bits that are right, and `x = m` is right in 3.
const FIBONACCI_INVERSE: u64 = {
    let mut x = FIBONACCI;
    let mut i = 0;
    while i < 5 {
        x = x.wrapping_mul(2u64.wrapping_sub(FIBONACCI.wrapping_mul(x)));
        i += 1;
    }
    x
};

/// Fibonacci hashing: the top bits of a multiplication spread any key pattern (handles,
/// small integers, pointers) over a power-of-two table.
fn hash(buffer: BufferKey, table_len: usize) -> usize {
    let bits = table_len.trailing_zeros();
    (buffer.wrapping_mul(FIBONACCI) >> (u64::BITS - bits)) as usize
}

/// The key an empty `slot` holds: one whose home is the next slot. A lookup of it starts
/// there and stops at the first empty slot (the table is never full), before it could
/// wrap around to `slot`; a lookup of any other key does not match it.
fn marker(slot: usize, table_len: usize) -> BufferKey {
    let bits = table_len.trailing_zeros();
    let next = ((slot + 1) & (table_len - 1)) as u64;
    (next << (u64::BITS - bits)).wrapping_mul(FIBONACCI_INVERSE)
}

fn reset_table(table: &mut Vec<(BufferKey, u32)>, len: usize) {
    table.clear();
    table.extend((0..len).map(|slot| (marker(slot, len), u32::MAX)));
}

/// Scratch memory for [`sort`], kept by the planner between batches.
///
/// Validation ([`collect`](super::fuse::collect)) fills `keys`, `ranks` and `lens`; the
/// sort completes the keys and orders them. Nothing per request is kept but these compact
/// arrays: the sweep reads each request's buffer, start and index out of its sorted key (in
/// sequence) and only its length from `lens` (4 bytes by index, an array that stays in
/// cache).
#[derive(Debug)]
pub(super) struct SortScratch {
    /// Ranks the buffers while the requests are collected.
    pub(super) ranker: Ranker,
    /// Sort keys, one per non-empty request. Validation writes `start << position_bits |
    /// index`; the sort adds the buffer's place on top and orders them.
    pub(super) keys: Vec<u64>,
    /// The first-seen rank of each key's buffer, in key order as built.
    pub(super) ranks: Vec<u32>,
    /// The length of every request, by request index, cut to 32 bits (a batch with a longer
    /// request takes the fallback): 4 bytes each keep the array in L1 for the sweep, which
    /// reads it in random order.
    pub(super) lens: Vec<u32>,
    /// The other half of the radix sort's ping-pong.
    spare: Vec<u64>,
    /// `(buffer, first-seen rank)`, sorted by buffer.
    by_key: Vec<(BufferKey, u32)>,
    /// For each first-seen rank, the buffer's place in buffer-key order, shifted into place.
    key_rank: Vec<u64>,
    /// For each place in buffer-key order, the buffer.
    places: Vec<BufferKey>,
    /// The fallback's entries, for offsets too wide for the packed key.
    tuples: Vec<Entry>,
    /// The radix sort's counters.
    counts: Box<Counts>,
}

impl Default for SortScratch {
    fn default() -> Self {
        Self {
            ranker: Ranker::default(),
            keys: Vec::new(),
            ranks: Vec::new(),
            lens: Vec::new(),
            spare: Vec::new(),
            by_key: Vec::new(),
            key_rank: Vec::new(),
            places: Vec::new(),
            tuples: Vec::new(),
            counts: Box::new([0; 1 << MAX_DIGIT_BITS]),
        }
    }
}

/// The non-empty requests in sorted order, as the sweep reads them.
pub(super) trait Sorted {
    /// How many entries there are.
    fn len(&self) -> usize;

    /// Entry `i` in sorted order.
    fn get(&self, i: usize) -> Entry;

    /// The buffer of an entry's `place`.
    fn buffer_of(&self, place: u64) -> BufferKey;

    /// Entries `first..last` in sorted order.
    #[inline]
    fn range(&self, first: u32, last: u32) -> impl Iterator<Item = Entry> + '_ {
        (first as usize..last as usize).map(|i| self.get(i))
    }
}

/// Sorted keys, decoded on the fly: a key is `place << (offset_bits + position_bits) | start
/// << position_bits | index`. An entry's `place` is the key's place bits left where they are
/// (above the start), so that telling buffers apart needs no shift and no look-up.
pub(super) struct KeyOrder<'a> {
    keys: &'a [u64],
    lens: &'a [u32],
    places: &'a [BufferKey],
    position_bits: u32,
    /// `64` for a single buffer (whose place is 0).
    offset_bits: u32,
    start_mask: u64,
}

impl Sorted for KeyOrder<'_> {
    #[inline]
    fn len(&self) -> usize {
        self.keys.len()
    }

    #[inline(always)]
    fn get(&self, i: usize) -> Entry {
        let key = self.keys[i];
        let index = (key & ((1u64 << self.position_bits) - 1)) as usize;
        let high = key >> self.position_bits;
        let start = high & self.start_mask;
        // Validation checked `start + len`.
        Entry {
            place: high & !self.start_mask,
            start,
            end: start + u64::from(self.lens[index]),
            index: index as u32,
        }
    }

    #[inline]
    fn buffer_of(&self, place: u64) -> BufferKey {
        self.places[place.checked_shr(self.offset_bits).unwrap_or(0) as usize]
    }
}

impl Sorted for [Entry] {
    #[inline]
    fn len(&self) -> usize {
        <[Entry]>::len(self)
    }

    #[inline(always)]
    fn get(&self, i: usize) -> Entry {
        self[i]
    }

    #[inline]
    fn buffer_of(&self, place: u64) -> BufferKey {
        place
    }
}

/// The sorted entries: packed keys, or for offsets too wide for them, the entries sorted as
/// tuples.
pub(super) enum Order<'a> {
    Keys(KeyOrder<'a>),
    Tuples(&'a [Entry]),
}

/// Widest radix digit: 2048 counters per pass stay in L1 next to the keys.
const MAX_DIGIT_BITS: u32 = 11;
/// Most radix passes worth making; wider keys are compared instead.
const MAX_PASSES: u32 = 4;
/// Below this many entries a comparison sort beats clearing the counting tables.
const MIN_RADIX: usize = 256;

/// Sorts the keys that [`collect`](super::fuse::collect) left in `scratch` (for `requests`)
/// by `(buffer, start, index)`, using what it found about them.
pub(super) fn sort<'a, R: Request>(
    requests: &[R],
    found: &Collected,
    scratch: &'a mut SortScratch,
) -> Order<'a> {
    let position_bits = position_bits(requests.len());
    let SortScratch { ranker, keys, ranks, lens, spare, by_key, key_rank, places, tuples, counts } = scratch;
    let buffer_bits = bits((ranker.buffers.len() as u64).saturating_sub(1));
    let offset_bits = bits(found.start_bits);
    let sort_bits = buffer_bits + offset_bits;
    if sort_bits + position_bits > u64::BITS || found.wide {
        return Order::Tuples(sort_by_tuple(requests, tuples));
    }
    let place_shift = offset_bits + position_bits;
    // Each buffer's place in key order: the key's top bits.
    by_key.clear();
    by_key.extend((0u32..).zip(&ranker.buffers).map(|(rank, &buffer)| (buffer, rank)));
    by_key.sort_unstable();
    places.clear();
    places.extend(by_key.iter().map(|&(buffer, _)| buffer));
    if buffer_bits > 0 {
        key_rank.clear();
        key_rank.resize(by_key.len(), 0);
        for (place, &(_, rank)) in (0u64..).zip(by_key.iter()) {
            key_rank[rank as usize] = place << place_shift;
        }
    }
    // The places still have to be added to the keys: by the radix sort's first pass over
    // them when there is one, else here.
    let places_to_add = (buffer_bits > 0).then_some(Places { ranks, key_rank });
    // `(buffer place, start, index)`: unique, and in index order as built. Requests that
    // came in order need no sort.
    let passes = (sort_bits / MAX_DIGIT_BITS).max(1);
    if keys.len() < MIN_RADIX || passes > MAX_PASSES || sort_bits == 0 {
        if let Some(places) = places_to_add {
            for (key, &rank) in keys.iter_mut().zip(places.ranks.iter()) {
                *key |= places.key_rank[rank as usize];
            }
        }
        if !keys.is_sorted() {
            keys.sort_unstable();
        }
    } else {
        // Full digits over the top bits; the low bits left over (fewer than a digit) are
        // finished by an insertion sort, which finds the keys all but sorted.
        let digit = sort_bits.min(MAX_DIGIT_BITS);
        let low = position_bits + sort_bits - digit * passes;
        if radix_sort(keys, places_to_add, spare, counts, low, digit, passes) && low > position_bits {
            finish_sort(keys);
        }
    }
    Order::Keys(KeyOrder {
        keys,
        lens,
        places,
        position_bits,
        offset_bits,
        start_mask: u64::MAX.checked_shr(u64::BITS - offset_bits).unwrap_or(0),
    })
}

/// Bits of the index part of a key for a batch of `requests`.
pub(super) fn position_bits(requests: usize) -> u32 {
    bits((requests as u64).saturating_sub(1))
}

/// What completes the keys: each key's buffer rank, and each rank's place bits.
struct Places<'a> {
    ranks: &'a [u32],
    key_rank: &'a [u64],
}

/// Counters of one radix pass.
type Counts = [u32; 1 << MAX_DIGIT_BITS];

/// A least-significant-digit radix sort of `keys` on bits `low..low + digit * passes`, which
/// first adds `places` to the keys if given (in the same pass that counts the first digit).
/// Returns `false`, having sorted nothing, for keys that were in order already. Every
/// pass is stable, and the keys come in position order (their low bits), so those bits need
/// no pass. Each pass counts the next pass's digits while it moves the keys.
fn radix_sort(
    keys: &mut Vec<u64>,
    places: Option<Places<'_>>,
    spare: &mut Vec<u64>,
    counts: &mut Counts,
    low: u32,
    digit: u32,
    passes: u32,
) -> bool {
    let radix = 1usize << digit;
    let mask = radix as u64 - 1;
    let n = keys.len();
    spare.clear();
    spare.resize(n, 0);
    let counts = &mut counts[..radix];
    counts.fill(0);
    // Whether the keys are in order already (requests that came sorted): then there is
    // nothing to do.
    let (mut previous, mut sorted) = (0, true);
    match places {
        Some(Places { ranks, key_rank }) => {
            for (key, &rank) in keys.iter_mut().zip(ranks.iter()) {
                *key |= key_rank[rank as usize];
                counts[((*key >> low) & mask) as usize] += 1;
                sorted &= previous <= *key;
                previous = *key;
            }
        }
        None => {
            for &key in keys.iter() {
                counts[((key >> low) & mask) as usize] += 1;
                sorted &= previous <= key;
                previous = key;
            }
        }
    }
    if sorted {
        return false;
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
    true
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
fn sort_by_tuple<'a, R: Request>(requests: &[R], tuples: &'a mut Vec<Entry>) -> &'a [Entry] {
    tuples.clear();
    tuples.extend((0u32..).zip(requests).filter(|(_, r)| r.len() > 0).map(|(index, r)| Entry {
        place: r.buffer(),
        start: r.offset(),
        end: r.offset() + r.len(),
        index,
    }));
    tuples.sort_unstable_by_key(|e| (e.place, e.start, e.index));
    tuples
}

/// Bits needed to write `x`.
fn bits(x: u64) -> u32 {
    u64::BITS - x.leading_zeros()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::{Order, SortScratch, Sorted, sort};
    use crate::plan::WriteRequest;
    use crate::plan::fuse::collect;
    use crate::plan::request::Entry;

    /// An entry with its buffer.
    type Buffered = (u64, Entry);

    fn order(entries: Vec<Buffered>) -> Vec<(u64, u64, u32)> {
        entries.into_iter().map(|(buffer, e)| (buffer, e.start, e.index)).collect()
    }

    /// Sorts `(buffer, start)` pairs, as one-byte writes (so starts up to `u64::MAX - 1`),
    /// and compares with sorting by the tuple.
    fn check(raw: &[(u64, u64)], scratch: &mut SortScratch) {
        let writes: Vec<_> = raw
            .iter()
            .map(|&(buffer, offset)| WriteRequest { buffer, buffer_len: u64::MAX, offset, len: 1 })
            .collect();
        let mut expected: Vec<_> =
            (0u32..).zip(raw).map(|(index, &(buffer, start))| (buffer, start, index)).collect();
        expected.sort_unstable();
        let found = collect(&writes, scratch).expect("valid");
        let (actual, ranged) = match sort(&writes, &found, scratch) {
            Order::Keys(keys) => sorted_entries(&keys),
            Order::Tuples(tuples) => sorted_entries(tuples),
        };
        assert_eq!(order(actual), expected);
        assert_eq!(order(ranged), expected);
        for (index, &(_, start)) in raw.iter().enumerate() {
            assert_eq!(scratch.lens[index], 1, "{start}");
        }
    }

    /// `(buffer, entry)` in sorted order, by `get` and by `range`.
    fn sorted_entries<S: Sorted + ?Sized>(sorted: &S) -> (Vec<Buffered>, Vec<Buffered>) {
        let all = (0..sorted.len()).map(|i| sorted.get(i)).map(|e| (sorted.buffer_of(e.place), e)).collect();
        for e in sorted.range(0, sorted.len() as u32) {
            assert_eq!(e.end, e.start + 1);
        }
        (all, sorted.range(0, sorted.len() as u32).map(|e| (sorted.buffer_of(e.place), e)).collect())
    }

    proptest! {
        /// The bucketed sort (and its fallback) orders like sorting by the tuple, for keys
        /// from a few small values (ties, one buffer) to any `u64` (many buffers, wide
        /// offsets, growing the hash table), with one scratch reused across batches.
        #[test]
        fn sorts_like_the_tuple_key(
            batches in prop::collection::vec(
                prop::collection::vec(
                    (prop_oneof![0u64..4, any::<u64>()], prop_oneof![0u64..64, 0..u64::MAX]),
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
    fn requests_longer_than_u32_take_the_fallback() {
        let mut scratch = SortScratch::default();
        let writes: Vec<_> = [(3, 10, 1), (1, 5, 1 << 33), (3, 2, 7), (1, 0, 0), (1, 1, 1)]
            .iter()
            .map(|&(buffer, offset, len)| WriteRequest { buffer, buffer_len: u64::MAX, offset, len })
            .collect();
        let found = collect(&writes, &mut scratch).expect("valid");
        let Order::Tuples(tuples) = sort(&writes, &found, &mut scratch) else {
            panic!("a request longer than u32::MAX must take the fallback");
        };
        let actual: Vec<_> = tuples.iter().map(|e| (e.place, e.start, e.end, e.index)).collect();
        assert_eq!(actual, [(1, 1, 2, 4), (1, 5, 5 + (1 << 33), 1), (3, 2, 9, 2), (3, 10, 11, 0)]);
    }

    #[test]
    fn empty_slots_hold_keys_that_hash_to_the_next_slot() {
        assert_eq!(super::FIBONACCI.wrapping_mul(super::FIBONACCI_INVERSE), 1);
        for len in [64, 128, 1 << 20] {
            for slot in [0, 1, 17, len - 2, len - 1] {
                assert_eq!(super::hash(super::marker(slot, len), len), (slot + 1) % len);
            }
        }
        // Buffers that are the markers of empty slots are ranked like any other.
        let mut scratch = SortScratch::default();
        scratch.ranker.reset();
        let mut markers: Vec<_> = [64, 128, 256]
            .iter()
            .flat_map(|&len| (0..len).map(move |slot| super::marker(slot, len)))
            .collect();
        let mut seen = std::collections::HashSet::new();
        markers.retain(|&b| seen.insert(b));
        let ranks: Vec<_> = markers.iter().map(|&b| scratch.ranker.rank(b)).collect();
        assert_eq!(ranks, (0..markers.len() as u32).collect::<Vec<_>>());
        let again: Vec<_> = markers.iter().map(|&b| scratch.ranker.rank(b)).collect();
        assert_eq!(again, ranks);
        let raw: Vec<_> = markers.iter().rev().map(|&b| (b, b % 97)).collect();
        check(&raw, &mut scratch);
    }

    #[test]
    fn entries_in_order_are_not_sorted_again() {
        check(&[(0, 5), (0, 5), (0, 9), (1, 0), (u64::MAX, 0)], &mut SortScratch::default());
        check(&[], &mut SortScratch::default());
        check(&[(3, 3)], &mut SortScratch::default());
    }

    #[test]
    fn offsets_too_wide_for_the_key_take_the_fallback() {
        check(&[(1, u64::MAX - 1), (0, 5), (1, 3), (0, u64::MAX - 2), (1, 3)], &mut SortScratch::default());
        check(&[(5, (1 << 63) + 7), (5, 3)], &mut SortScratch::default());
        // Offsets that fill the key but for the position bits: no room for a place.
        check(&[(5, (1 << 62) + 7), (5, 3)], &mut SortScratch::default());
        let raw: Vec<_> = (0..300u64).map(|i| (5, (1 << 54) + i % 17)).chain([(5, 0)]).collect();
        check(&raw, &mut SortScratch::default());
    }
}

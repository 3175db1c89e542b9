//! Ordering by byte range: which batches of the other lane, still in flight, a batch must
//! wait for on the device.
//!
//! Each lane is one stream, so a lane's batches run in the order they were submitted. The
//! two lanes run at once; a batch waits for the other lane only where the two touch the same
//! bytes. Every claimed batch enters the [`Ledger`] with the device ranges it uses
//! ([`Ranges`], absolute device addresses: ranges of live buffers never alias, and a
//! buffer's memory is not reused while a batch that uses it is in flight). It then waits for
//! the newest batch of the other lane, entered before it and not known to be done, whose
//! ranges overlap its own. Ranges that only touch (one ends where the other starts) do not
//! overlap. A path that does not name its ranges claims whole buffers; a batch of many small
//! requests in order and apart claims, per buffer, the span from its first request to the end
//! of its last (`engine::table::BufferTable::push_ranges`), which spares it a pass over them.
//!
//! A batch waits only for batches entered before it, so waits never form a circle. Two
//! threads' batches on overlapping bytes, submitted at once, are not ordered against each
//! other: one may wait for the other, or (when the other has claimed but not yet enqueued
//! its work) the two may interleave on the device, as with any unsynchronized access. The
//! lanes never wait on the device for work not yet enqueued: a batch may wait on the host
//! for room in the pinned pool while its own numbers are reserved.
//!
//! Cost: one lock and a push per batch; the ranges themselves are built as the batch's
//! requests are walked once (touching ranges in order merge as they come). Ranges are
//! compared only when a batch of the other lane is in flight: ranges that are whole granules
//! of a power of two over a short span (a pool's blocks) on one bitmap of granules
//! ([`Grid`]), others by their unions, each sorted once per batch, in one sweep (or a
//! binary search for a handful of ranges).

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};

use crate::sync::{Mutex, lock};

/// How many batches in flight a lane's log keeps by their ranges; older ones are folded into
/// a floor that a later batch of the other lane sharing a buffer waits for whole.
const LOG_MOST: usize = 64;

/// The device ranges one batch uses: `[start, end)` pairs, absolute device addresses.
#[derive(Debug, Default)]
pub(crate) struct Ranges {
    spans: Vec<(u64, u64)>,
    /// Whether `spans` may be out of order or overlap (sorted spans that only touch are in
    /// order: a query finds overlaps in them as in their union).
    unordered: bool,
    /// Whether a range pushed overlapped the one before it (they were merged).
    overlapped: bool,
}

impl Ranges {
    /// Adds `len` bytes at device address `start`. A range that starts inside or at the end
    /// of the last one merges into it.
    #[inline]
    pub(crate) fn push(&mut self, start: u64, len: u64) {
        if len == 0 {
            return;
        }
        let end = start.saturating_add(len);
        if let Some(last) = self.spans.last_mut() {
            if start >= last.0 && start <= last.1 {
                self.overlapped |= start < last.1;
                last.1 = last.1.max(end);
                return;
            }
            self.unordered |= start < last.1;
        }
        self.spans.push((start, end));
    }

    /// Whether no two ranges share a byte, answered without sorting where the ranges are
    /// whole granules of a power of two over a short span (a pool's blocks): each granule is
    /// marked in a bitmap, and a granule marked twice is an overlap. `None` where they are
    /// not (the caller sorts: [`Ranges::sort_disjoint`]). Leaves the ranges as they are.
    pub(crate) fn disjoint_by_granules(&self) -> Option<bool> {
        if self.overlapped {
            return Some(false);
        }
        if !self.unordered {
            return Some(true);
        }
        let mut grid = Grid::over(&[&self.spans])?;
        Some(!grid.mark(&self.spans))
    }

    /// Puts the ranges in order; returns whether no two share a byte (touching ones do
    /// not). Ranges that overlap are merged.
    pub(crate) fn sort_disjoint(&mut self) -> bool {
        if !self.unordered {
            return !self.overlapped;
        }
        self.spans.sort_unstable_by_key(|s| s.0);
        let disjoint = !self.overlapped && self.spans.windows(2).all(|w| w[0].1 <= w[1].0);
        if !disjoint {
            self.spans = self.union();
        }
        self.unordered = false;
        disjoint
    }

    fn clear(&mut self) {
        self.spans.clear();
        self.unordered = false;
        self.overlapped = false;
    }

    /// The union of the ranges, sorted, no two touching.
    fn union(&self) -> Vec<(u64, u64)> {
        let mut sorted = self.spans.clone();
        sorted.sort_unstable_by_key(|s| s.0);
        let mut union: Vec<(u64, u64)> = Vec::with_capacity(sorted.len());
        for (start, end) in sorted {
            match union.last_mut() {
                Some(last) if start <= last.1 => last.1 = last.1.max(end),
                _ => union.push((start, end)),
            }
        }
        union
    }
}

/// A batch's ranges as the ledger holds them: built for it, or shared by every move of a
/// set laid out once (sorted when made, so that no move sorts them again).
#[derive(Debug)]
pub(crate) enum Held {
    Own(Ranges),
    Shared(Arc<Ranges>),
}

impl std::ops::Deref for Held {
    type Target = Ranges;
    fn deref(&self) -> &Ranges {
        match self {
            Held::Own(ranges) => ranges,
            Held::Shared(ranges) => ranges,
        }
    }
}

/// A bitmap of granules, `1 << shift` bytes each from `base`, over the ranges of one or
/// more sets: the common grid of a pool's blocks, on which overlaps are found in one pass,
/// without sorting.
struct Grid {
    base: u64,
    shift: u32,
    map: Vec<u64>,
}

impl Grid {
    /// The grid of the largest power of two that divides every range's offset from the
    /// lowest start and every range's length; `None` where it would take more than 1 MiB of
    /// bitmap, or more marks than a sort's comparisons (small ranges over a wide span), or
    /// there are no ranges.
    fn over(sets: &[&[(u64, u64)]]) -> Option<Grid> {
        let all = || sets.iter().flat_map(|s| s.iter());
        let base = all().map(|s| s.0).min()?;
        let end = all().map(|s| s.1).max()?;
        let bits = all().fold(0u64, |acc, &(start, stop)| acc | (start - base) | (stop - start));
        let shift = bits.trailing_zeros().min(63);
        let granules = (end - base) >> shift;
        let marks: u64 = all().map(|&(start, stop)| (stop - start) >> shift).sum();
        let count: u64 = sets.iter().map(|s| s.len() as u64).sum();
        if granules > 1 << 23 || marks > 8 * count {
            return None;
        }
        Some(Grid { base, shift, map: vec![0; granules.div_ceil(64) as usize] })
    }

    /// The granules of a range, as bit positions.
    fn granules(&self, (start, stop): (u64, u64)) -> std::ops::Range<u64> {
        (start - self.base) >> self.shift..(stop - self.base) >> self.shift
    }

    /// Marks every granule of `spans`; returns whether one was marked already.
    fn mark(&mut self, spans: &[(u64, u64)]) -> bool {
        let mut again = false;
        for &span in spans {
            for granule in self.granules(span) {
                let (word, bit) = ((granule / 64) as usize, 1u64 << (granule % 64));
                again |= self.map[word] & bit != 0;
                self.map[word] |= bit;
            }
        }
        again
    }

    /// Whether any granule of `spans` is marked.
    fn any(&self, spans: &[(u64, u64)]) -> bool {
        spans
            .iter()
            .any(|&span| self.granules(span).any(|g| self.map[(g / 64) as usize] & 1 << (g % 64) != 0))
    }
}

/// Whether two batches' ranges share a byte: by one sweep where both are in order, by a
/// [`Grid`] where one fits, else by their unions (sorted once per entry).
fn entries_overlap(a: &Entry, b: &Entry) -> bool {
    if (a.ranges.unordered || b.ranges.unordered)
        && let Some(mut grid) = Grid::over(&[&a.ranges.spans, &b.ranges.spans])
    {
        grid.mark(&a.ranges.spans);
        return grid.any(&b.ranges.spans);
    }
    overlap(a.union(), b.union())
}

/// One batch in a lane's log: its last submission and its ranges.
#[derive(Debug)]
struct Entry {
    seq: u64,
    ranges: Held,
    /// The union, for ranges out of order, made by the first comparison that needs it.
    union: OnceLock<Vec<(u64, u64)>>,
}

impl Entry {
    fn union(&self) -> &[(u64, u64)] {
        if self.ranges.unordered {
            self.union.get_or_init(|| self.ranges.union())
        } else {
            &self.ranges.spans
        }
    }
}

/// Whether two sorted unions, neither with touching ranges, share a byte.
fn overlap(a: &[(u64, u64)], b: &[(u64, u64)]) -> bool {
    let (small, large) = if a.len() <= b.len() { (a, b) } else { (b, a) };
    // A handful against many: a binary search each.
    if small.len().saturating_mul(large.len().max(2).ilog2() as usize) < large.len() {
        return small.iter().any(|&(start, end)| {
            // The first range of `large` that ends after `start` is the only one that can
            // hold byte `start`, or the first one past it.
            let at = large.partition_point(|r| r.1 <= start);
            large.get(at).is_some_and(|r| r.0 < end)
        });
    }
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        if a[i].1 <= b[j].0 {
            i += 1;
        } else if b[j].1 <= a[i].0 {
            j += 1;
        } else {
            return true;
        }
    }
    false
}

/// One lane's batches in flight, oldest first.
#[derive(Debug, Default)]
struct Log {
    entries: VecDeque<Arc<Entry>>,
    /// The newest batch dropped from `entries` while maybe in flight.
    floor: u64,
    /// Emptied ranges of retired entries, for the next batches.
    spare: Vec<Ranges>,
}

impl Log {
    /// Drops the entries of batches up to `done`, keeping their vectors.
    fn retire(&mut self, done: u64) {
        while self.entries.front().is_some_and(|e| e.seq <= done) {
            let entry = self.entries.pop_front().expect("checked above");
            if let Ok(Entry { ranges: Held::Own(mut ranges), .. }) = Arc::try_unwrap(entry)
                && self.spare.len() < 4
            {
                ranges.clear();
                self.spare.push(ranges);
            }
        }
    }
}

/// Both lanes' batches in flight, by the ranges they use.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    logs: Mutex<[Log; 2]>,
}

/// What [`Ledger::enter`] knows of the lanes: how far each has completed, and the newest
/// submission of the other lane that uses a buffer of the batch (0 for none).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Seen {
    pub(crate) done: [u64; 2],
    pub(crate) last_other: u64,
}

impl Ledger {
    /// An empty [`Ranges`], with the capacity of a retired batch's when there is one.
    pub(crate) fn ranges(&self, lane: usize) -> Ranges {
        lock(&self.logs)[lane].spare.pop().unwrap_or_default()
    }

    /// Enters a batch of lane `lane` whose submissions end at `seq` and use `ranges`, and
    /// returns the submission of the other lane it must wait for (0: none).
    pub(crate) fn enter(&self, lane: usize, seq: u64, ranges: Held, seen: Seen) -> u64 {
        let other = 1 - lane;
        let own = Arc::new(Entry { seq, ranges, union: OnceLock::new() });
        let in_flight = seen.last_other > seen.done[other];
        // Snapshot under the lock, compared after it: the other lane's batches entered so far.
        let (snapshot, floor) = {
            let mut logs = lock(&self.logs);
            logs[0].retire(seen.done[0]);
            logs[1].retire(seen.done[1]);
            let mine = &mut logs[lane];
            if mine.entries.len() >= LOG_MOST {
                let dropped = mine.entries.pop_front().expect("the log is full");
                mine.floor = mine.floor.max(dropped.seq);
            }
            mine.entries.push_back(Arc::clone(&own));
            if !in_flight {
                return 0;
            }
            let theirs = &logs[other];
            (theirs.entries.iter().cloned().collect::<Vec<_>>(), theirs.floor)
        };
        // A batch folded into the floor is waited for whole, if it may share a buffer.
        let mut need = if floor > seen.done[other] { floor.min(seen.last_other) } else { 0 };
        for entry in snapshot.iter().rev() {
            if entry.seq <= need.max(seen.done[other]) {
                break;
            }
            if entries_overlap(&own, entry) {
                need = entry.seq;
                break;
            }
        }
        need
    }
}

#[cfg(test)]
mod tests {
    use std::sync::OnceLock;

    use super::{Entry, Held, Ledger, Ranges, Seen, entries_overlap, overlap};

    fn ranges(pairs: &[(u64, u64)]) -> Ranges {
        let mut r = Ranges::default();
        for &(start, len) in pairs {
            r.push(start, len);
        }
        r
    }

    /// Enters a batch, with the other lane's last use on its buffers at `last_other` and
    /// nothing known done.
    fn enter(ledger: &Ledger, lane: usize, seq: u64, pairs: &[(u64, u64)], last_other: u64) -> u64 {
        ledger.enter(lane, seq, Held::Own(ranges(pairs)), Seen { done: [0, 0], last_other })
    }

    #[test]
    fn touching_ranges_in_order_merge_and_stay_sorted() {
        let r = ranges(&[(0, 16), (16, 16), (40, 8), (44, 10), (100, 0)]);
        assert_eq!(r.spans, [(0, 32), (40, 54)]);
        assert!(!r.unordered);
        let r = ranges(&[(100, 8), (0, 8), (4, 8), (8, 92)]);
        assert!(r.unordered);
        assert_eq!(r.union(), [(0, 108)]);
    }

    #[test]
    fn sorting_finds_overlaps_and_keeps_touching_ranges_apart() {
        let mut r = ranges(&[(100, 10), (0, 10), (10, 5), (50, 50)]);
        assert!(r.sort_disjoint(), "touching only");
        assert_eq!(r.spans, [(0, 15), (50, 100), (100, 110)], "(10, 5) touched (0, 10) as pushed");
        assert!(!r.unordered);
        assert!(!ranges(&[(100, 10), (0, 10), (5, 1)]).sort_disjoint(), "merged as pushed, but overlapping");
        let mut r = ranges(&[(100, 10), (0, 10), (105, 20)]);
        assert!(!r.sort_disjoint());
        assert_eq!(r.spans, [(0, 10), (100, 125)], "merged into the union");
        assert!(ranges(&[(0, 8), (8, 8)]).sort_disjoint(), "in order, touching");
        assert!(!ranges(&[(0, 8), (7, 8)]).sort_disjoint(), "in order, overlapping");
    }

    #[test]
    fn overlap_is_shared_bytes_not_touching() {
        let a = [(0, 16), (32, 48)];
        assert!(!overlap(&a, &[(16, 32)]), "touching on both sides");
        assert!(!overlap(&a, &[(48, 64), (100, 200)]));
        assert!(overlap(&a, &[(15, 16)]));
        assert!(overlap(&a, &[(47, 49)]));
        assert!(overlap(&a, &[(0, 1000)]));
        // Many against many, by the sweep: every other block against every block between.
        let evens: Vec<_> = (0..1000u64).map(|i| (i * 32, i * 32 + 16)).collect();
        let odds: Vec<_> = (0..1000u64).map(|i| (i * 32 + 16, i * 32 + 32)).collect();
        assert!(!overlap(&evens, &odds));
        let mut one_more = odds.clone();
        one_more[500] = (500 * 32 + 15, 500 * 32 + 32);
        assert!(overlap(&evens, &one_more));
    }

    #[test]
    fn disjoint_batches_of_the_two_lanes_do_not_wait() {
        let ledger = Ledger::default();
        // Swap out even blocks, swap in odd ones, touching, of one buffer.
        let out: Vec<_> = (0..64u64).map(|i| (i * 2 * 4096, 4096)).collect();
        let into: Vec<_> = (0..64u64).rev().map(|i| ((i * 2 + 1) * 4096, 4096)).collect();
        assert_eq!(enter(&ledger, 1, 5, &out, 0), 0);
        assert_eq!(enter(&ledger, 0, 9, &into, 5), 0, "disjoint, touching: no wait");
        // A read of a block just written waits for the write.
        assert_eq!(enter(&ledger, 1, 6, &[(4096, 8)], 9), 9);
        // A write of block 0 waits for the batch that reads it, not for the newer one.
        assert_eq!(enter(&ledger, 0, 10, &[(0, 1)], 6), 5);
    }

    #[test]
    fn a_batch_waits_for_the_newest_overlapping_one_only() {
        let ledger = Ledger::default();
        assert_eq!(enter(&ledger, 0, 1, &[(0, 100)], 0), 0);
        assert_eq!(enter(&ledger, 0, 2, &[(200, 100)], 0), 0);
        assert_eq!(enter(&ledger, 0, 3, &[(400, 100)], 0), 0);
        assert_eq!(enter(&ledger, 1, 1, &[(250, 10), (1000, 10)], 3), 2);
        assert_eq!(enter(&ledger, 1, 2, &[(50, 10)], 3), 1);
        assert_eq!(enter(&ledger, 1, 3, &[(500, 10), (600, 1)], 3), 0, "touching the end of 3");
    }

    #[test]
    fn batches_known_done_are_not_waited_for() {
        let ledger = Ledger::default();
        enter(&ledger, 0, 4, &[(0, 100)], 0);
        let seen = Seen { done: [0, 4], last_other: 4 };
        assert_eq!(ledger.enter(1, 1, Held::Own(ranges(&[(0, 100)])), seen), 4);
        let seen = Seen { done: [4, 0], last_other: 4 };
        assert_eq!(ledger.enter(1, 2, Held::Own(ranges(&[(0, 100)])), seen), 0, "4 is done");
        assert!(lock_len(&ledger, 0) == 0, "the done batch left the log");
    }

    fn lock_len(ledger: &Ledger, lane: usize) -> usize {
        crate::sync::lock(&ledger.logs)[lane].entries.len()
    }

    #[test]
    fn a_full_log_folds_its_oldest_into_a_floor_waited_for_whole() {
        let ledger = Ledger::default();
        for seq in 1..=super::LOG_MOST as u64 + 1 {
            enter(&ledger, 0, seq, &[(seq * 1000, 10)], 0);
        }
        assert_eq!(lock_len(&ledger, 0), super::LOG_MOST);
        // Batch 1 no longer has its ranges in the log: a batch sharing a buffer with it waits
        // for it, even on ranges apart; one that shares no buffer (last use 0) does not.
        assert_eq!(enter(&ledger, 1, 1, &[(5, 1)], 1), 1);
        assert_eq!(enter(&ledger, 1, 2, &[(5, 1)], 0), 0);
        // A batch overlapping a newer one waits for that one.
        assert_eq!(enter(&ledger, 1, 3, &[(30_000, 1)], 30), 30);
    }

    #[test]
    fn retired_ranges_are_reused() {
        let ledger = Ledger::default();
        let mut r = ledger.ranges(0);
        for i in 0..1000 {
            r.push(i * 10, 5);
        }
        ledger.enter(0, 1, Held::Own(r), Seen { done: [0, 0], last_other: 0 });
        ledger.enter(0, 2, Held::Own(Ranges::default()), Seen { done: [1, 0], last_other: 0 });
        let reused = ledger.ranges(0);
        assert!(reused.spans.is_empty() && reused.spans.capacity() >= 1000);
    }

    fn brute(a: &[(u64, u64)], b: &[(u64, u64)]) -> bool {
        a.iter().any(|x| b.iter().any(|y| x.0 < y.1 && y.0 < x.1))
    }

    #[test]
    fn ranges_sorting_and_overlap_match_brute_force() {
        let mut rng = fastrand::Rng::with_seed(77);
        for _ in 0..20_000 {
            let make = |rng: &mut fastrand::Rng| {
                let n = rng.usize(0..12);
                let sorted = rng.bool();
                let mut at = 0u64;
                (0..n)
                    .map(|_| {
                        let start = if sorted { at + rng.u64(0..4) } else { rng.u64(0..80) };
                        let len = rng.u64(0..10);
                        at = start + len;
                        (start, len)
                    })
                    .collect::<Vec<_>>()
            };
            let (pa, pb) = (make(&mut rng), make(&mut rng));
            let mut ra = Ranges::default();
            pa.iter().for_each(|&(s, l)| ra.push(s, l));
            let mut rb = Ranges::default();
            pb.iter().for_each(|&(s, l)| rb.push(s, l));
            let raw_a: Vec<(u64, u64)> = pa.iter().filter(|p| p.1 > 0).map(|&(s, l)| (s, s + l)).collect();
            let raw_b: Vec<(u64, u64)> = pb.iter().filter(|p| p.1 > 0).map(|&(s, l)| (s, s + l)).collect();
            // sort_disjoint: whether no two of the pushed ranges share a byte.
            let mut sa = Ranges::default();
            pa.iter().for_each(|&(s, l)| sa.push(s, l));
            let by_granules = sa.disjoint_by_granules();
            let disjoint = sa.sort_disjoint();
            assert!(
                by_granules.is_none_or(|d| d == disjoint),
                "granules {by_granules:?}, sorted {disjoint}: {pa:?}"
            );
            let truly = !(0..raw_a.len()).any(|i| (0..i).any(|j| brute(&raw_a[i..=i], &raw_a[j..=j])));
            assert_eq!(disjoint, truly, "{pa:?}");
            // The ledger's comparison, through entries (unions made as the ledger makes them).
            let ea = Entry { seq: 1, ranges: Held::Own(ra), union: OnceLock::new() };
            let eb = Entry { seq: 2, ranges: Held::Own(rb), union: OnceLock::new() };
            assert_eq!(overlap(ea.union(), eb.union()), brute(&raw_a, &raw_b), "{pa:?} {pb:?}");
            assert_eq!(entries_overlap(&ea, &eb), brute(&raw_a, &raw_b), "entries {pa:?} {pb:?}");
            let es = Entry { seq: 3, ranges: Held::Own(sa), union: OnceLock::new() };
            assert_eq!(overlap(es.union(), eb.union()), brute(&raw_a, &raw_b), "sorted {pa:?} {pb:?}");
        }
        // Large lists through both branches.
        for _ in 0..500 {
            let n = rng.usize(1..300);
            let m = rng.usize(1..5);
            let mk = |rng: &mut fastrand::Rng, n: usize| {
                let mut r = Ranges::default();
                for _ in 0..n {
                    r.push(rng.u64(0..100_000), rng.u64(1..200));
                }
                r
            };
            let (ra, rb) = (mk(&mut rng, n), mk(&mut rng, m));
            let (ua, ub) = (ra.union(), rb.union());
            assert_eq!(overlap(&ua, &ub), brute(&ua, &ub));
            assert_eq!(overlap(&ub, &ua), brute(&ua, &ub));
        }
    }

    /// A batch of the simulation: its last submission and its `[start, end)` ranges.
    type Batch = (u64, Vec<(u64, u64)>);

    /// Random batches on two lanes over 8 buffers of 1000 bytes; each batch touches random
    /// ranges in 1..3 buffers. For every batch entered: it must wait at least for the newest
    /// batch of the other lane not known done whose ranges overlap its own, and never for a
    /// batch not entered yet.
    #[test]
    fn the_ledger_never_skips_an_overlap_nor_waits_for_a_batch_not_entered() {
        let mut rng = fastrand::Rng::with_seed(5);
        for round in 0..200 {
            let ledger = Ledger::default();
            let mut next = [1u64, 1u64];
            let mut done = [0u64, 0u64];
            let mut marks = [[0u64; 2]; 8];
            // Per lane, every batch entered: its last submission and its byte ranges.
            let mut all: [Vec<Batch>; 2] = [Vec::new(), Vec::new()];
            let steps = if round % 2 == 0 { 300 } else { 60 };
            for _ in 0..steps {
                let lane = rng.usize(0..2);
                let other = 1 - lane;
                let subs = rng.u64(1..4);
                let seq = next[lane] + subs - 1;
                next[lane] = seq + 1;
                let nbuf = rng.usize(1..3);
                let mut spans = Vec::new();
                let mut r = Ranges::default();
                let mut last_other = 0;
                for _ in 0..nbuf {
                    let b = rng.usize(0..8);
                    marks[b][lane] = marks[b][lane].max(seq);
                    last_other = last_other.max(marks[b][other]);
                    for _ in 0..rng.usize(1..4) {
                        let s = b as u64 * 1000 + rng.u64(0..990);
                        let l = rng.u64(1..10);
                        r.push(s, l);
                        spans.push((s, s + l));
                    }
                }
                // Sometimes lanes complete some work.
                for k in 0..2 {
                    if rng.u8(..4) == 0 && next[k] > 1 {
                        done[k] = done[k].max(rng.u64(done[k]..next[k]));
                    }
                }
                if rng.bool() {
                    r.sort_disjoint();
                }
                let need = ledger.enter(lane, seq, Held::Own(r), Seen { done, last_other });
                let must = all[other]
                    .iter()
                    .filter(|(s, _)| *s > done[other])
                    .filter(|(_, sp)| sp.iter().any(|x| spans.iter().any(|y| x.0 < y.1 && y.0 < x.1)))
                    .map(|(s, _)| *s)
                    .max()
                    .unwrap_or(0);
                assert!(need >= must, "round {round}: need {need} < {must}");
                assert!(need < next[other], "waits for a batch not entered");
                all[lane].push((seq, spans));
            }
        }
    }
}

#[cfg(test)]
mod granule_tests {
    use super::Ranges;

    fn ranges(pairs: &[(u64, u64)]) -> Ranges {
        let mut r = Ranges::default();
        for &(start, len) in pairs {
            r.push(start, len);
        }
        r
    }

    #[test]
    fn blocks_of_a_pool_are_checked_by_granules_and_agree_with_sorting() {
        let mut rng = fastrand::Rng::with_seed(3);
        for block in [4096u64, 16 << 10, 48 << 10, 256 << 10, 2 << 20] {
            let base = 0x7f00_0000_0000u64;
            let blocks = (1u64 << 30) / block;
            let mut order: Vec<u64> = (0..blocks).collect();
            rng.shuffle(&mut order);
            let pick = &order[..(blocks as usize / 4).max(2)];
            let mut r = ranges(&pick.iter().map(|&b| (base + b * block, block)).collect::<Vec<_>>());
            assert_eq!(r.disjoint_by_granules(), Some(true), "{block} B blocks");
            assert!(r.sort_disjoint());
            // The same with one block twice, and with one shifted by half a block.
            let mut twice: Vec<(u64, u64)> = pick.iter().map(|&b| (base + b * block, block)).collect();
            twice.push(twice[0]);
            twice.swap(1, pick.len());
            assert_eq!(ranges(&twice).disjoint_by_granules(), Some(false), "{block} B, twice");
            let mut shifted: Vec<(u64, u64)> = pick.iter().map(|&b| (base + b * block, block)).collect();
            shifted.push((base + pick[5] * block + block / 2, block));
            shifted.swap(2, pick.len());
            assert_eq!(ranges(&shifted).disjoint_by_granules(), Some(false), "{block} B, shifted");
        }
        // Small ranges spread over a wide span fall back to sorting.
        let wide: Vec<(u64, u64)> = (0..1000u64).rev().map(|i| (i * (1 << 30) + 7, 100)).collect();
        assert_eq!(ranges(&wide).disjoint_by_granules(), None);
    }

    #[test]
    fn blocks_of_two_batches_are_compared_on_a_grid_as_by_sorting() {
        use std::sync::{Arc, OnceLock};

        use super::{Entry, Held, entries_overlap, overlap};
        let mut rng = fastrand::Rng::with_seed(4);
        for block in [4096u64, 16 << 10, 48 << 10, 2 << 20] {
            let base = 0x7f00_0000_0000u64;
            let blocks = (1u64 << 30) / block;
            let mut order: Vec<u64> = (0..blocks).collect();
            rng.shuffle(&mut order);
            let half = (blocks as usize / 4).max(2);
            let entry = |picks: &[u64], seq| {
                let r = ranges(&picks.iter().map(|&b| (base + b * block, block)).collect::<Vec<_>>());
                Entry { seq, ranges: Held::Shared(Arc::new(r)), union: OnceLock::new() }
            };
            let (out, into) = (entry(&order[..half], 1), entry(&order[half..2 * half], 2));
            assert!(!entries_overlap(&out, &into), "{block} B: disjoint blocks");
            assert!(!overlap(out.union(), into.union()));
            let mut one_shared = order[half..2 * half].to_vec();
            one_shared[half / 2] = order[3];
            let clash = entry(&one_shared, 3);
            assert!(entries_overlap(&out, &clash), "{block} B: one block in both");
        }
    }
}

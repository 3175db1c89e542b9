//! The fills of [`UploadBatch::write_with_par`](crate::UploadBatch::write_with_par): each
//! closure kept in the batch as plain bytes ([`ParFills`]: a record and the closure's own
//! bytes, in two vectors that the device lends from batch to batch, so that adding one costs
//! no allocation), and run at submit ([`Fills`]) in groups of about equal work, lease by
//! lease of staging ([`Fills::groups`]): on the packing threads with the calling thread
//! taking part (`engine::pipeline::run`), or on the calling thread alone where the batch is
//! small.

use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::host::Source;
use super::pipeline::Groups;
use crate::plan::WriteRequest;
use crate::recycle::Reusable;
use crate::sync::lock;

/// What running a fill costs beyond its bytes, counted in bytes of copying: the call
/// through a pointer, the guard against unwinding, the look for an earlier panic (a few
/// nanoseconds, the time to copy about this much). Groups weigh each fill by its bytes plus
/// this, so that a group of tiny fills is not tens of thousands long, and a batch of many
/// tiny fills is spread over the threads when its calls, not its bytes, are the work.
pub(crate) const FILL_COST: usize = 64;

/// One fill: the write it fills and its closure, `size_of` the closure's type bytes at
/// `code` in [`ParFills::code`] (unaligned), called through `call`. Where it writes (its
/// lease and offset) and how much are the write's: not kept twice.
#[derive(Clone, Copy)]
struct ParFill {
    write: usize,
    code: usize,
    /// [`call_fill`] for the closure's type.
    call: unsafe fn(*const MaybeUninit<u8>, *mut u8, usize),
}

/// The fills of a batch, in the order of their writes.
#[derive(Default)]
pub(crate) struct ParFills {
    fills: Vec<ParFill>,
    /// The closures' bytes, one after another.
    code: Vec<MaybeUninit<u8>>,
}

impl Reusable for ParFills {
    fn clear(&mut self) {
        ParFills::clear(self);
    }
}

impl ParFills {
    /// Forgets every fill, keeping the room.
    pub(crate) fn clear(&mut self) {
        self.fills.clear();
        // No destructor to run: the closures are `Copy`.
        self.code.clear();
    }

    /// Keeps `fill`, the fill of write `write` (whose source is its place in the arena).
    #[inline]
    pub(crate) fn push<F: FnOnce(&mut [u8]) + Copy>(&mut self, write: usize, fill: F) {
        let code = self.code.len();
        let size = size_of::<F>();
        self.code.reserve(size);
        // SAFETY: `size` bytes past `code` were reserved just above; the write is unaligned,
        // as each read (in `call_fill`); the bytes are counted once written.
        unsafe {
            self.code.as_mut_ptr().add(code).cast::<F>().write_unaligned(fill);
            self.code.set_len(code + size);
        }
        self.fills.push(ParFill { write, code, call: call_fill::<F> });
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.fills.is_empty()
    }

    /// The write that fill `i` fills.
    pub(crate) fn write_of(&self, i: usize) -> usize {
        self.fills[i].write
    }

    /// The fills of each of the first `leases` arena leases (indices of the fills): as
    /// leases are opened in the order of the writes, each lease's fills are a run, found by
    /// binary search.
    pub(crate) fn spans(&self, sources: &[Source<'_>], leases: usize) -> Vec<Range<usize>> {
        let lease_of = |f: &ParFill| match sources[f.write] {
            Source::Arena { lease, .. } => lease as usize,
            Source::Slice(_) => unreachable!("a fill's source is its place in the arena"),
        };
        let mut first = 0;
        (0..leases)
            .map(|i| {
                let end = first + self.fills[first..].partition_point(|f| lease_of(f) <= i);
                std::mem::replace(&mut first, end)..end
            })
            .collect()
    }
}

/// Calls the closure of type `F` whose bytes are at `code` on the `len` bytes at `dst`.
///
/// # Safety
/// `code` holds an `F` written there (unaligned) by [`ParFills::push`], alive for the
/// closure's lifetime; `dst` is writable for `len` bytes, and no one else touches them.
/// `F: Copy`: reading it leaves nothing to drop.
unsafe fn call_fill<F: FnOnce(&mut [u8]) + Copy>(code: *const MaybeUninit<u8>, dst: *mut u8, len: usize) {
    // SAFETY: as the caller promises.
    let (fill, dst) =
        unsafe { (code.cast::<F>().read_unaligned(), std::slice::from_raw_parts_mut(dst, len)) };
    fill(dst);
}

/// The first fill (lowest index) that panicked, and its message.
pub(crate) struct Panics {
    /// The lowest index that panicked (`usize::MAX`: none): read before each fill and once a
    /// lease.
    lowest: AtomicUsize,
    /// That fill and its panic's message, written only when a fill panics.
    first: Mutex<Option<(usize, String)>>,
}

impl Default for Panics {
    fn default() -> Panics {
        Panics { lowest: AtomicUsize::new(usize::MAX), first: Mutex::new(None) }
    }
}

impl Panics {
    fn record(&self, i: usize, panic: &(dyn std::any::Any + Send)) {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_owned());
        let mut first = lock(&self.first);
        if first.as_ref().is_none_or(|&(j, _)| i < j) {
            *first = Some((i, message));
            self.lowest.store(i, Ordering::Release);
        }
    }

    /// The first fill below `end` that panicked, with its message.
    pub(crate) fn first(&self, end: usize) -> Option<(usize, String)> {
        if self.lowest.load(Ordering::Acquire) >= end {
            return None;
        }
        lock(&self.first).clone().filter(|&(i, _)| i < end)
    }
}

/// What the threads that run fills share: read only but for the staging each fill writes
/// (its own).
pub(crate) struct Fills<'f> {
    store: &'f ParFills,
    writes: &'f [WriteRequest],
    sources: &'f [Source<'f>],
    /// Each arena lease's address.
    bases: &'f [usize],
    pub(crate) panics: Panics,
}

impl<'f> Fills<'f> {
    /// The fills of `store`, for the batch's `writes` and `sources`, its arena leases at
    /// `bases`.
    pub(crate) fn new(
        store: &'f ParFills,
        writes: &'f [WriteRequest],
        sources: &'f [Source<'f>],
        bases: &'f [usize],
    ) -> Fills<'f> {
        Fills { store, writes, sources, bases, panics: Panics::default() }
    }

    /// Where fill `i` writes in its lease: the lease and the offset.
    #[inline]
    fn place(&self, i: usize) -> (usize, usize) {
        match self.sources[self.store.fills[i].write] {
            Source::Arena { lease, offset } => (lease as usize, offset),
            Source::Slice(_) => unreachable!("a fill's source is its place in the arena"),
        }
    }

    /// Runs the fills `items`, each under `catch_unwind`; none past one that panicked.
    pub(crate) fn run(&self, items: Range<usize>) {
        for i in items {
            // After a fill panicked, no later one runs: their leases never move.
            if self.panics.lowest.load(Ordering::Acquire) < i {
                return;
            }
            let f = self.store.fills[i];
            let (lease, at) = self.place(i);
            let dst = (self.bases[lease] + at) as *mut u8;
            let len = self.writes[f.write].len as usize;
            // SAFETY: the closure's bytes were written by `ParFills::push` and the batch (its
            // lifetime) is alive; each fill has its own staging range in its lease, which no
            // copy uses before the lease moves, after its fills (each run once).
            let call = || unsafe { (f.call)(self.store.code.as_ptr().add(f.code), dst, len) };
            if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)) {
                self.panics.record(i, &*panic);
            }
        }
    }

    /// The fills of each lease (`spans`, as [`ParFills::spans`]) cut into groups of about
    /// equal work for `threads` packing threads, and the work in all. A fill's work is its
    /// bytes plus [`FILL_COST`]; a lease's fills lie in it in order, so the cuts are found
    /// by binary search on their offsets, without a pass over the fills: a group spreads a
    /// lease over the threads ([`Groups::target`] of the lease's work), and no group holds
    /// fills of two leases, so that each lease moves as soon as its own groups are done.
    pub(crate) fn groups(&self, spans: &[Range<usize>], threads: usize) -> (Groups, usize) {
        let mut total = 0;
        // The work of a lease's fills from its `first` up to fill `f`.
        let work_before =
            |first: usize, f: usize| self.place(f).1 - self.place(first).1 + FILL_COST * (f - first);
        let spans = spans.iter().cloned().enumerate().filter(|(_, fills)| !fills.is_empty());
        let groups = Groups::cut(self.bases.len(), spans, |fills, push| {
            let (first, last) = (fills.start, fills.end - 1);
            let len = self.writes[self.store.fills[last].write].len as usize;
            let work = work_before(first, last) + len + FILL_COST;
            total += work;
            let parts = work.div_ceil(Groups::target(work as u64, threads));
            let mut start = first;
            for j in 1..parts {
                let goal = work / parts * j;
                let end = partition_point(start..fills.end, |f| work_before(first, f) < goal);
                if end > start {
                    push(start..end);
                    start = end;
                }
            }
            if start < fills.end {
                push(start..fills.end);
            }
        });
        (groups, total)
    }
}

/// The first index of `range` at which `below` turns false (it holds for a prefix of the
/// range, then no more).
fn partition_point(range: Range<usize>, below: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (range.start, range.end);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if below(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch whose lease `i` holds fills of `leases[i]` bytes each, laid end to end (at
    /// 16-byte boundaries) from the lease's start: its fills, writes and sources.
    fn batch(leases: &[&[usize]]) -> (ParFills, Vec<WriteRequest>, Vec<Source<'static>>) {
        let (mut store, mut writes, mut sources) = (ParFills::default(), Vec::new(), Vec::new());
        for (lease, lens) in leases.iter().enumerate() {
            let mut at = 0;
            for &len in lens.iter() {
                store.push(writes.len(), |dst: &mut [u8]| dst.fill(1));
                writes.push(WriteRequest { buffer: 0, buffer_len: u64::MAX, offset: 0, len: len as u64 });
                sources.push(Source::Arena { lease: lease as u32, offset: at });
                at = (at + len).next_multiple_of(16);
            }
        }
        (store, writes, sources)
    }

    #[test]
    fn groups_hold_about_equal_work_within_a_lease_and_cover_every_fill_once() {
        // Many tiny fills, a few large ones, a lease without fills, one huge fill.
        let (tiny, large, huge) = (vec![16; 1000], vec![100_000; 10], vec![5 << 20]);
        let leases: [&[usize]; 4] = [&tiny, &large, &[], &huge];
        let (store, writes, sources) = batch(&leases);
        let bases = vec![0; leases.len()];
        let fills = Fills::new(&store, &writes, &sources, &bases);
        let spans = store.spans(&sources, leases.len());
        assert_eq!(spans, vec![0..1000, 1000..1010, 1010..1010, 1010..1011]);
        let threads = 4;
        let (groups, total) = fills.groups(&spans, threads);
        // A fill's work: its bytes and the cost of a call (the tiny ones' padding counts).
        let works = [1000 * (16 + FILL_COST), 10 * (100_000 + FILL_COST), 0, (5 << 20) + FILL_COST];
        assert_eq!(total, works.iter().sum::<usize>());
        let mut next = 0;
        for (lease, span) in spans.iter().enumerate() {
            let mine: Vec<_> =
                groups.all().iter().filter(|(_, l)| *l == lease).map(|(r, _)| r.clone()).collect();
            let target = Groups::target(works[lease] as u64, threads);
            assert!(mine.len() <= works[lease].div_ceil(target), "lease {lease}: {mine:?}");
            for group in &mine {
                assert_eq!(group.start, next, "lease {lease}: groups in order, none empty: {mine:?}");
                assert!(group.end > group.start && span.contains(&group.start) && group.end <= span.end);
                let work: usize =
                    group.clone().map(|f| writes[store.write_of(f)].len as usize + FILL_COST).sum();
                // A group ends at the first fill that reaches its share: past it by one fill
                // at most.
                let most = leases[lease].iter().max().copied().unwrap_or(0) + FILL_COST;
                assert!(work <= target + most, "lease {lease}: a group of {work} bytes of work");
                next = group.end;
            }
        }
        assert_eq!(next, 1011, "every fill in a group");
        // The 1000 tiny fills: a few groups of about a third each, not a task per fill.
        let tiny_groups: Vec<_> =
            groups.all().iter().filter(|(_, l)| *l == 0).map(|(r, _)| r.len()).collect();
        assert_eq!(tiny_groups.len(), 3, "{tiny_groups:?}");
        assert!(tiny_groups.iter().all(|&n| (300..=400).contains(&n)), "{tiny_groups:?}");
    }

    #[test]
    fn fills_run_once_each_and_the_lowest_panic_is_kept_whichever_panicked_first() {
        let lens = [100usize; 20];
        let (_, writes, sources) = batch(&[&lens]);
        let mut store = ParFills::default();
        let mut staging = vec![0u8; 20 * 112];
        for (i, w) in writes.iter().enumerate() {
            store.push(i, move |dst: &mut [u8]| {
                assert!(i != 5 && i != 9, "fill {i} fails");
                assert_eq!(dst.len() as u64, w.len);
                dst.fill(i as u8 + 1);
            });
        }
        let bases = [staging.as_mut_ptr() as usize];
        let fills = Fills::new(&store, &writes, &sources, &bases);
        // The later range first: fill 9 panics before fill 5 does.
        fills.run(10..20);
        assert_eq!(fills.panics.first(usize::MAX).map(|(i, _)| i), None, "10 to 19 do not panic");
        fills.run(0..10);
        let (first, cause) = fills.panics.first(usize::MAX).expect("a fill panicked");
        assert_eq!(first, 5);
        assert!(cause.contains("fill 5 fails"), "{cause}");
        assert_eq!(fills.panics.first(5), None, "none below 5");
        for (i, &b) in staging.iter().enumerate().filter(|(i, _)| i % 112 < 100) {
            let fill = i / 112;
            // Fills 0 to 4 and 10 to 19 ran; 5 panicked first thing; 6 to 9 never ran.
            let want = if (5..10).contains(&fill) { 0 } else { fill as u8 + 1 };
            assert_eq!(b, want, "byte {i} of fill {fill}");
        }
    }
}

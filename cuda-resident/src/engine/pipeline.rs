//! Host work on the packing threads that overlaps the device's: uploads pack chunk `k + 1`
//! while chunk `k` is on the wire, downloads copy chunk `k` out while chunk `k + 1` lands.
//! One parallel region serves the whole batch, not one per chunk: waking the pool for a
//! chunk costs about as much as packing a megabyte.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::Result;
// The signalling below is model-checked with loom (the `loom` tests at the end).
use crate::sync::shim::atomic::{AtomicBool, AtomicUsize, Ordering, fence};
use crate::sync::shim::{Condvar, Mutex, hint, lock, thread};

/// Below this many bytes in all, one thread copies (waking the pool costs more).
pub(crate) const PARALLEL_MIN: usize = 1 << 20;

/// A device's packing threads, started on first use and kept for the device's life, and
/// what keeps them awake between batches.
pub(crate) struct Packers {
    pool: std::sync::OnceLock<rayon::ThreadPool>,
    threads: usize,
    /// How long the threads stay awake after packing ([`linger`]).
    linger: Duration,
    /// Packing runs under way: the packing threads lingering after the last one stop when
    /// another starts ([`linger`]).
    packing: Arc<AtomicUsize>,
}

impl Packers {
    /// `threads` packing threads that linger `linger_us` microseconds after packing; none
    /// started yet.
    pub(crate) fn new(threads: usize, linger_us: u64) -> Packers {
        Packers {
            pool: std::sync::OnceLock::new(),
            threads,
            linger: Duration::from_micros(linger_us),
            packing: Default::default(),
        }
    }

    /// The packing threads, started on first use.
    pub(crate) fn pool(&self) -> &rayon::ThreadPool {
        self.pool.get_or_init(|| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(self.threads)
                .thread_name(|i| format!("cuda-resident-pack-{i}"))
                .build()
                // Spawning threads fails only when the system is out of resources; a pool
                // of one thread (the caller) still packs correctly.
                .or_else(|_| rayon::ThreadPoolBuilder::new().num_threads(1).use_current_thread().build())
                .expect("a one-thread pool on the current thread cannot fail")
        })
    }
}

/// A batch's items cut into groups for the packing threads: contiguous ranges of items in
/// chunk order, none across two chunks.
#[derive(Debug)]
pub(crate) struct Groups {
    /// Each group's items and chunk.
    groups: Vec<(Range<usize>, usize)>,
    /// Groups per chunk.
    per_chunk: Vec<usize>,
}

impl Groups {
    /// Cuts the items of `chunks` chunks into groups of about `target` bytes (item `i` has
    /// `bytes(i)`). `spans` gives each chunk's items, as `(chunk, items)` in increasing chunk
    /// order; a chunk without a span has no items.
    pub(crate) fn new(
        chunks: usize,
        spans: impl Iterator<Item = (usize, Range<usize>)>,
        bytes: impl Fn(usize) -> usize,
        target: usize,
    ) -> Groups {
        Groups::cut(chunks, spans, |items, push| split_by_bytes(items, &bytes, target, push))
    }

    /// Cuts the items of `chunks` chunks into groups of `per_group` items (the last of a
    /// chunk may have fewer), for items of about the same size: no pass over the items.
    pub(crate) fn by_count(
        chunks: usize,
        spans: impl Iterator<Item = (usize, Range<usize>)>,
        per_group: usize,
    ) -> Groups {
        let per_group = per_group.max(1);
        Groups::cut(chunks, spans, |items, push| {
            for start in items.clone().step_by(per_group) {
                push(start..items.end.min(start + per_group));
            }
        })
    }

    /// [`Groups::by_count`] for `items` items of about the same size, `total_bytes` in all:
    /// groups of about the bytes that spread a chunk of `chunk_bytes` over `threads` packing
    /// threads ([`Groups::target`]), counted from the mean item (no pass over the items).
    pub(crate) fn by_mean(
        chunks: usize,
        spans: impl Iterator<Item = (usize, Range<usize>)>,
        (items, total_bytes): (usize, usize),
        chunk_bytes: u64,
        threads: usize,
    ) -> Groups {
        let per_item = (total_bytes / items.max(1)).max(1);
        Groups::by_count(chunks, spans, Groups::target(chunk_bytes, threads) / per_item)
    }

    /// Cuts each chunk's items into groups with `split(items, push)`, which passes each
    /// group of `items` to `push` in order (none empty).
    pub(crate) fn cut(
        chunks: usize,
        spans: impl Iterator<Item = (usize, Range<usize>)>,
        mut split: impl FnMut(Range<usize>, &mut dyn FnMut(Range<usize>)),
    ) -> Groups {
        let mut groups = Vec::new();
        let mut per_chunk = vec![0; chunks];
        for (chunk, items) in spans {
            let before = groups.len();
            split(items, &mut |group| groups.push((group, chunk)));
            per_chunk[chunk] = groups.len() - before;
        }
        Groups { groups, per_chunk }
    }

    /// Each group's items and chunk, in order.
    #[cfg(test)]
    pub(crate) fn all(&self) -> &[(Range<usize>, usize)] {
        &self.groups
    }

    /// The group size that spreads a chunk of `chunk_bytes` over `threads` packing threads:
    /// not below 32 KiB (smaller groups cost more to hand out than to copy), not above 256 KiB.
    pub(crate) fn target(chunk_bytes: u64, threads: usize) -> usize {
        (chunk_bytes as usize / threads.max(1)).clamp(32 << 10, 256 << 10)
    }
}

/// Cuts `items` (item `i` has `bytes(i)`) into contiguous groups of at least `target` bytes
/// each but the last, passing each to `push` in order.
pub(crate) fn split_by_bytes(
    items: Range<usize>,
    bytes: impl Fn(usize) -> usize,
    target: usize,
    mut push: impl FnMut(Range<usize>),
) {
    let (mut start, mut sum) = (items.start, 0);
    for i in items.clone() {
        sum += bytes(i);
        if sum >= target {
            push(start..i + 1);
            (start, sum) = (i + 1, 0);
        }
    }
    if start < items.end {
        push(start..items.end);
    }
}

/// What the calling thread does for a chunk during [`run`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Before any group of the chunk starts (acquire its staging; wait for it to land).
    /// Answers whether the chunk is open; `false` puts it off until after the next `Done`,
    /// and is allowed only while an earlier chunk has not had its `Done` (staging held by
    /// chunks not yet moved cannot be waited for).
    Open(usize),
    /// Once every group of the chunk is done (move it).
    Done(usize),
}

/// Runs `work(chunk, items)` over every group on the packing threads, while the calling
/// thread runs `step`: `Open(k)` before any group of chunk `k` starts, at most `ahead`
/// chunks past the last chunk whose `Done` has run, and `Done(k)` once chunk `k`'s groups
/// are all done, in chunk order. Small batches (`total_bytes` below a megabyte), and calls
/// from a packing thread itself, run on the calling thread alone, chunk by chunk: open,
/// work, done. The first error of `step` stops the work and is returned: no `step` runs
/// after it, and the packing threads start no group of a chunk not yet open (groups of
/// chunks already open may still run; they touch only this batch's staging).
pub(crate) fn run(
    packers: &Packers,
    groups: &Groups,
    total_bytes: usize,
    ahead: usize,
    mut step: impl FnMut(Step) -> Result<bool>,
    work: impl Fn(usize, Range<usize>) + Sync,
) -> Result<()> {
    let chunks = groups.per_chunk.len();
    let pool = packers.pool();
    // On a packing thread (a nested call), jobs spawned here would wait behind this very
    // thread; and the one-thread fallback pool lives on the thread that first used it, which
    // runs jobs only from inside the pool: with it, no other thread's jobs would ever run.
    if total_bytes < PARALLEL_MIN
        || groups.groups.len() < 2
        || pool.current_thread_index().is_some()
        || pool.current_num_threads() < 2
    {
        let mut next = 0;
        for k in 0..chunks {
            let opened = step(Step::Open(k))?;
            assert!(opened, "the next chunk to move cannot be put off");
            for (items, chunk) in &groups.groups[next..next + groups.per_chunk[k]] {
                work(*chunk, items.clone());
            }
            next += groups.per_chunk[k];
            step(Step::Done(k))?;
        }
        return Ok(());
    }
    #[cfg(test)]
    PARALLEL_RUNS.with(|n| n.set(n.get() + 1));
    let ahead = ahead.max(1);
    let opened = AtomicUsize::new(0);
    let finished: Vec<AtomicUsize> = (0..chunks).map(|_| AtomicUsize::new(0)).collect();
    let next = AtomicUsize::new(0);
    let signal = Signal::default();
    let worker = || {
        let _stop = StopOnPanic(&signal);
        // Groups are taken in order, so the earliest chunk finishes first.
        while let Some((items, chunk)) = groups.groups.get(next.fetch_add(1, Ordering::Relaxed)) {
            if !signal.wait_until(|| opened.load(Ordering::Acquire) > *chunk) {
                return;
            }
            work(*chunk, items.clone());
            finished[*chunk].fetch_add(1, Ordering::Release);
            signal.notify();
        }
    };
    let worker = &worker;
    let workers = pool.current_num_threads().min(groups.groups.len());
    let packing = Packing::start(packers);
    let result = pool.in_place_scope(|scope| {
        // One job from here, which spawns the others from inside the pool: each spawn from
        // outside wakes a thread first (16 of them kept this thread from its own share of the
        // work for tens of microseconds).
        scope.spawn(move |inner| {
            for _ in 1..workers {
                inner.spawn(move |_| worker());
            }
            worker();
        });
        // A panic of `step` must release the packing threads too, or the scope would wait
        // for them for ever.
        let _stop = StopOnPanic(&signal);
        let mut steps = || {
            let mut open = 0;
            for (k, (finished, &count)) in finished.iter().zip(&groups.per_chunk).enumerate() {
                while open < chunks && open < k + ahead {
                    if !step(Step::Open(open))? {
                        assert!(open > k, "the next chunk to move cannot be put off");
                        break;
                    }
                    open += 1;
                    opened.store(open, Ordering::Release);
                    signal.notify();
                }
                // The calling thread takes chunk k's groups too while it waits for them: it
                // starts at once, while the packing threads wake (tens of microseconds), and
                // the chunk is done no later than its last group.
                while let Some(i) = take_group_of(&next, groups, k) {
                    let (items, chunk) = &groups.groups[i];
                    work(*chunk, items.clone());
                    finished.fetch_add(1, Ordering::Release);
                }
                if !signal.wait_until(|| finished.load(Ordering::Acquire) == count) {
                    // Only a panicking worker sets `stop` here, and the scope rethrows its
                    // panic once every job has ended: this value is never seen.
                    return Ok(());
                }
                step(Step::Done(k))?;
            }
            Ok(())
        };
        let result = steps();
        if result.is_err() {
            signal.stop();
        }
        result
    });
    drop(packing);
    linger(packers);
    result
}

/// A packing run under way on the packing threads: while one is, none lingers ([`linger`]).
pub(crate) struct Packing<'a>(&'a AtomicUsize);

impl Packing<'_> {
    /// Starts one: lingering threads stop spinning and take its work.
    pub(crate) fn start(packers: &Packers) -> Packing<'_> {
        Packing::enter(&packers.packing)
    }

    /// Starts one counted in `active` (the device's count of packing runs under way).
    fn enter(active: &AtomicUsize) -> Packing<'_> {
        active.fetch_add(1, Ordering::AcqRel);
        Packing(active)
    }
}

impl Drop for Packing<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Keeps the packing threads awake for [`Config::pack_linger_us`](crate::Config) after
/// packing, spinning until then or until packing starts again ([`Packing`]): the next
/// batch's packing then starts without waking them (all but one: the one woken first by
/// the next run's spawn). One job is spawned from here (a spawn from outside the pool wakes
/// a thread), which spawns the others inside.
pub(crate) fn linger(packers: &Packers) {
    linger_for(packers.pool(), &packers.packing, packers.linger);
}

fn linger_for(pool: &rayon::ThreadPool, packing: &Arc<AtomicUsize>, linger: Duration) {
    let threads = pool.current_num_threads();
    if linger.is_zero() || threads < 2 || pool.current_thread_index().is_some() {
        return;
    }
    let until = Instant::now() + linger;
    let spin = move |active: &AtomicUsize| {
        linger_spin(active, || Instant::now() >= until);
    };
    let active = Arc::clone(packing);
    // One thread fewer than the pool's: one core is left to the caller's threads.
    pool.spawn(move || {
        for _ in 2..threads {
            let active = Arc::clone(&active);
            rayon::spawn(move || spin(&active));
        }
        spin(&active);
    });
}

/// One lingering thread's wait: spins until packing is under way (`active` above zero) or
/// `expired`, with a yield now and then, so that a thread of the caller's made runnable
/// meanwhile (the one waiting for the device, say) gets a core. Returns how many times it
/// spun (none when packing was already under way).
fn linger_spin(active: &AtomicUsize, mut expired: impl FnMut() -> bool) -> u32 {
    let mut spins = 0u32;
    while active.load(Ordering::Relaxed) == 0 && !expired() {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(64) {
            thread::yield_now();
        } else {
            hint::spin_loop();
        }
    }
    spins
}

/// Takes the next group for the calling thread if it belongs to chunk `k` (the packing
/// threads take groups with `fetch_add`; this never takes past them).
fn take_group_of(next: &AtomicUsize, groups: &Groups, k: usize) -> Option<usize> {
    let mut i = next.load(Ordering::Relaxed);
    while groups.groups.get(i).is_some_and(|&(_, chunk)| chunk == k) {
        match next.compare_exchange_weak(i, i + 1, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return Some(i),
            Err(now) => i = now,
        }
    }
    None
}

#[cfg(test)]
thread_local! {
    /// Runs this thread made on the packing threads.
    pub(crate) static PARALLEL_RUNS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// How the threads of one [`run`] wait for each other: a stop flag, and a condition variable
/// for waits that outlast a short spin (a packing thread waiting for a chunk to land may wait
/// for milliseconds, and should not hold a core meanwhile).
#[derive(Default)]
struct Signal {
    stop: AtomicBool,
    lock: Mutex<()>,
    changed: Condvar,
    /// Waiters asleep or about to sleep: a notification with none costs no system call.
    sleepers: AtomicUsize,
}

/// Waits that went to sleep, in every run of this process.
#[cfg(test)]
pub(crate) static SLEEPS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Waits shorter than this spin and yield; longer ones sleep until notified.
#[cfg_attr(loom, allow(dead_code))]
const SPIN: Duration = Duration::from_micros(50);

/// How a [`Signal`] waiter waits before it sleeps: it spins briefly, then yields the core
/// until [`SPIN`] has passed. Under loom, where time is not modelled, it spins once and
/// then sleeps: the model checks the sleeping, where a wake-up could be lost.
struct Backoff {
    spins: u32,
    #[cfg(not(loom))]
    start: Instant,
}

impl Backoff {
    /// Spins before yielding.
    const SPINS: u32 = if cfg!(loom) { 1 } else { 100 };

    fn new() -> Backoff {
        Backoff {
            spins: 0,
            #[cfg(not(loom))]
            start: Instant::now(),
        }
    }

    /// Waits a little; false once the waiter should sleep instead.
    fn snooze(&mut self) -> bool {
        if self.spins < Backoff::SPINS {
            hint::spin_loop();
            self.spins += 1;
            return true;
        }
        #[cfg(not(loom))]
        if self.start.elapsed() < SPIN {
            thread::yield_now();
            return true;
        }
        false
    }
}

impl Signal {
    /// Waits until `ready`: spinning briefly, then yielding the core, then (past [`SPIN`])
    /// sleeping until a [`notify`](Signal::notify); false if the run stops first.
    fn wait_until(&self, ready: impl Fn() -> bool) -> bool {
        let mut backoff = Backoff::new();
        while !ready() {
            if self.stop.load(Ordering::Relaxed) {
                return false;
            }
            if !backoff.snooze() {
                // Counted as a sleeper, then checked under the lock: a notifier that changed
                // the state after that check sees the count (the fences order the two) and
                // takes the lock, so no wake-up is lost. The timeout only bounds the cost of
                // a missed one (loom's never times out: there a lost one hangs the model).
                let guard = lock(&self.lock);
                self.sleepers.fetch_add(1, Ordering::Relaxed);
                fence(Ordering::SeqCst);
                if !ready() && !self.stop.load(Ordering::Relaxed) {
                    #[cfg(test)]
                    SLEEPS.fetch_add(1, Ordering::Relaxed);
                    drop(self.changed.wait_timeout(guard, Duration::from_millis(1)));
                }
                self.sleepers.fetch_sub(1, Ordering::Relaxed);
            }
        }
        true
    }

    /// Wakes the sleeping waiters after a change they may wait for.
    fn notify(&self) {
        fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::Relaxed) > 0 {
            drop(lock(&self.lock));
            self.changed.notify_all();
        }
    }

    /// Stops the run: waiters return false.
    fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        self.notify();
    }
}

/// Stops the run if its thread unwinds, so that no one waits for a group that will never
/// finish.
struct StopOnPanic<'a>(&'a Signal);

impl Drop for StopOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.stop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Groups;

    #[test]
    fn groups_stay_inside_their_chunk_and_cover_every_item_once() {
        // Chunk 0 holds items 0..10 (100 bytes each), chunk 1 none, chunk 2 items 10..13.
        let g = Groups::new(3, [(0, 0..10), (2, 10..13)].into_iter(), |_| 100, 250);
        assert_eq!(g.per_chunk, vec![4, 0, 1]);
        let items: Vec<_> = g.groups.iter().map(|(r, c)| (r.clone(), *c)).collect();
        assert_eq!(items, vec![(0..3, 0), (3..6, 0), (6..9, 0), (9..10, 0), (10..13, 2)]);
        // By count, the same cut without a look at the items.
        let g = Groups::by_count(3, [(0, 0..10), (2, 10..13)].into_iter(), 3);
        assert_eq!(g.per_chunk, vec![4, 0, 1]);
        let by_count: Vec<_> = g.groups.iter().map(|(r, c)| (r.clone(), *c)).collect();
        assert_eq!(by_count, items);
    }

    #[test]
    fn the_calling_thread_takes_only_untaken_groups_of_the_chunk_it_waits_for() {
        use crate::sync::shim::atomic::{AtomicUsize, Ordering};
        // Chunk 0: groups 0..2, chunk 1: groups 2..4.
        let g = Groups::by_count(2, [(0, 0..4), (1, 4..8)].into_iter(), 2);
        let next = AtomicUsize::new(0);
        assert_eq!(super::take_group_of(&next, &g, 1), None, "chunk 1's groups come after chunk 0's");
        assert_eq!(super::take_group_of(&next, &g, 0), Some(0));
        // A packing thread takes group 1.
        assert_eq!(next.fetch_add(1, Ordering::Relaxed), 1);
        assert_eq!(super::take_group_of(&next, &g, 0), None, "chunk 0 has no group left");
        assert_eq!(super::take_group_of(&next, &g, 1), Some(2));
        assert_eq!(super::take_group_of(&next, &g, 1), Some(3));
        assert_eq!(super::take_group_of(&next, &g, 1), None, "past the last group");
        assert_eq!(next.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn lingering_threads_stop_when_packing_starts() {
        use crate::sync::shim::atomic::{AtomicUsize, Ordering};
        use std::sync::{Arc, Barrier};
        use std::time::{Duration, Instant};
        let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
        let packing = Arc::new(AtomicUsize::new(0));
        // Lingering for a minute: were the spinners deaf to new packing, work that needs
        // every thread of the pool at once would wait for them.
        super::linger_for(&pool, &packing, Duration::from_secs(60));
        let start = Instant::now();
        packing.fetch_add(1, Ordering::AcqRel);
        let all = Barrier::new(4);
        pool.scope(|s| {
            for _ in 0..4 {
                s.spawn(|_| {
                    all.wait();
                });
            }
        });
        // Left raised: a spinner that starts only now returns at once instead of spinning
        // for the rest of the minute.
        assert!(start.elapsed() < Duration::from_secs(30), "the work waited for the lingering threads");
        // Nothing lingers on a one-thread pool, nor for zero time: no job is spawned.
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        super::linger_for(&one, &packing, Duration::from_secs(60));
        one.install(|| ());
        super::linger_for(&pool, &packing, Duration::ZERO);
    }

    #[test]
    fn group_target_spreads_a_chunk_over_the_threads_within_bounds() {
        assert_eq!(Groups::target(4 << 20, 16), 256 << 10);
        assert_eq!(Groups::target(1 << 20, 16), 64 << 10);
        assert_eq!(Groups::target(1 << 20, 64), 32 << 10, "never below 32 KiB");
        assert_eq!(Groups::target(1 << 30, 1), 256 << 10, "never above 256 KiB");
        assert_eq!(Groups::target(1 << 20, 0), 256 << 10, "no threads counts as one");
    }
}

/// Model checks of the signalling above under every interleaving loom explores (run with
/// `RUSTFLAGS="--cfg loom"`, docs/reliability.md). Loom's condition variable never times
/// out, so a lost wake-up hangs the model, which loom reports as a deadlock.
#[cfg(all(test, loom))]
mod loom {
    use super::{Packing, Signal, linger_spin};
    use crate::sync::shim::atomic::{AtomicBool, AtomicUsize, Ordering};
    use crate::sync::shim::{Arc, thread};

    /// A waiter always sees a change made before or while it waits: it sleeps only if the
    /// notifier will wake it.
    #[test]
    fn loom_signal_loses_no_wakeup() {
        loom::model(|| {
            let signal = Arc::new(Signal::default());
            let ready = Arc::new(AtomicBool::new(false));
            let notifier = {
                let (signal, ready) = (Arc::clone(&signal), Arc::clone(&ready));
                thread::spawn(move || {
                    ready.store(true, Ordering::Release);
                    signal.notify();
                })
            };
            assert!(signal.wait_until(|| ready.load(Ordering::Acquire)));
            notifier.join().unwrap();
        });
    }

    /// Two threads each finish a group and notify; the waiter for both (the calling thread
    /// waiting for a chunk) returns once both are done, never before.
    #[test]
    fn loom_signal_waiter_for_two_groups_wakes_after_both() {
        loom::model(|| {
            let signal = Arc::new(Signal::default());
            let finished = Arc::new(AtomicUsize::new(0));
            let workers: Vec<_> = (0..2)
                .map(|_| {
                    let (signal, finished) = (Arc::clone(&signal), Arc::clone(&finished));
                    thread::spawn(move || {
                        finished.fetch_add(1, Ordering::Release);
                        signal.notify();
                    })
                })
                .collect();
            assert!(signal.wait_until(|| finished.load(Ordering::Acquire) == 2));
            assert_eq!(finished.load(Ordering::Relaxed), 2);
            for worker in workers {
                worker.join().unwrap();
            }
        });
    }

    /// A stop releases a waiter whose condition will never hold (a failed `step` or a
    /// panicking worker), asleep or not.
    #[test]
    fn loom_signal_stop_releases_a_waiter() {
        loom::model(|| {
            let signal = Arc::new(Signal::default());
            let stopper = {
                let signal = Arc::clone(&signal);
                thread::spawn(move || signal.stop())
            };
            assert!(!signal.wait_until(|| false));
            stopper.join().unwrap();
        });
    }

    /// A lingering thread with no deadline (a linger longer than any run) stops spinning
    /// once packing starts, so a job that needs every thread of the pool (here: both)
    /// runs: were it deaf to packing, the model would spin for ever, which loom reports.
    #[test]
    fn loom_lingering_thread_stops_when_packing_starts() {
        loom::model(|| {
            let active = Arc::new(AtomicUsize::new(0));
            let arrived = Arc::new(AtomicUsize::new(0));
            let lingering = {
                let (active, arrived) = (Arc::clone(&active), Arc::clone(&arrived));
                thread::spawn(move || {
                    linger_spin(&active, || false);
                    // Now free: takes its part of the job that needs both threads.
                    arrived.fetch_add(1, Ordering::AcqRel);
                    while arrived.load(Ordering::Acquire) < 2 {
                        thread::yield_now();
                    }
                })
            };
            let packing = Packing::enter(&active);
            arrived.fetch_add(1, Ordering::AcqRel);
            while arrived.load(Ordering::Acquire) < 2 {
                thread::yield_now();
            }
            drop(packing);
            lingering.join().unwrap();
            assert_eq!(active.load(Ordering::Relaxed), 0, "the guard counted its run out");
        });
    }

    /// A thread that starts lingering after packing started returns without a spin, and one
    /// whose linger ends (two spins here) returns though nothing packs; while two runs
    /// overlap, the count stays raised until the last ends.
    #[test]
    fn loom_linger_returns_at_once_while_packing_and_at_its_deadline() {
        loom::model(|| {
            let active = Arc::new(AtomicUsize::new(0));
            let first = Packing::enter(&active);
            let late = {
                let active = Arc::clone(&active);
                thread::spawn(move || linger_spin(&active, || false))
            };
            let second = {
                let active = Arc::clone(&active);
                thread::spawn(move || drop(Packing::enter(&active)))
            };
            assert_eq!(late.join().unwrap(), 0, "packing was under way when it started");
            drop(first);
            second.join().unwrap();
            assert_eq!(active.load(Ordering::Relaxed), 0);
            let mut left = 2;
            let spins = linger_spin(&active, || {
                left -= 1;
                left < 0
            });
            assert_eq!(spins, 2, "spun until its deadline");
        });
    }
}

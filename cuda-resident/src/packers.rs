//! The packing threads: a pool that lives with the `Device` and copies staging in parallel.
//!
//! Threads of an idle pool sleep, and on the H200's hosts waking them cost about 100 µs per
//! parallel copy, more than the copy itself for a batch of a few MiB. So a batch that is
//! about to pack *warms* the pool first: every thread spins, for at most [`WARM_LIMIT`],
//! until the copy is handed out; the batch plans (or its DMA runs) meanwhile, and the copy
//! finds every thread awake. [`Config::warm_packers`](crate::Config::warm_packers) turns
//! this off.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The longest a warmed thread spins waiting for work before it goes back to sleep.
pub(crate) const WARM_LIMIT: Duration = Duration::from_micros(1500);

pub(crate) struct Packers {
    pool: rayon::ThreadPool,
    /// Odd while the threads are asked to spin: [`Packers::warm`] makes it odd, handing out
    /// work (or a spinner's time limit) makes it even again. A count, not a flag, so that a
    /// late spinner of one warm-up can never end the next.
    spinning: Arc<AtomicU64>,
    /// [`Config::warm_packers`](crate::Config::warm_packers).
    warm: bool,
}

impl Packers {
    /// A pool of `threads` threads; a pool of the calling thread alone if the system cannot
    /// start them (it still packs correctly).
    pub(crate) fn new(threads: usize, warm: bool) -> Packers {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("cuda-resident-pack-{i}"))
            .build()
            .or_else(|_| rayon::ThreadPoolBuilder::new().num_threads(1).use_current_thread().build())
            .expect("a one-thread pool on the current thread cannot fail");
        Packers { pool, spinning: Arc::new(AtomicU64::new(0)), warm }
    }

    pub(crate) fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Wakes every thread to spin until the next [`Packers::run`] (or [`WARM_LIMIT`]):
    /// call it a little before a parallel copy, with other work to do meanwhile. Cheap when
    /// the threads already spin.
    pub(crate) fn warm(&self) {
        if !self.warm || self.threads() < 2 {
            return;
        }
        let Ok(idle) = self
            .spinning
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| (s % 2 == 0).then_some(s + 1))
        else {
            return; // already spinning
        };
        let warm_up = idle + 1;
        let spinning = Arc::clone(&self.spinning);
        self.pool.spawn_broadcast(move |_| {
            let start = Instant::now();
            let mut spins = 0u32;
            while spinning.load(Ordering::Acquire) == warm_up {
                std::hint::spin_loop();
                spins = spins.wrapping_add(1);
                // Reading the clock costs more than a spin: look every 64.
                if spins.is_multiple_of(64) && start.elapsed() >= WARM_LIMIT {
                    // The first thread out ends this warm-up for all.
                    let _ =
                        spinning.compare_exchange(warm_up, warm_up + 1, Ordering::AcqRel, Ordering::Acquire);
                    break;
                }
            }
        });
    }

    /// Whether the threads are asked to spin.
    #[cfg(test)]
    fn is_spinning(&self) -> bool {
        self.spinning.load(Ordering::Acquire) % 2 == 1
    }

    /// Runs `f` on every item of `items`, spread over the threads; returns when all are done.
    pub(crate) fn run<T: Sync>(&self, items: &[T], f: impl Fn(&T) + Sync + Send) {
        // Spinning threads stop and take the work.
        let _ = self
            .spinning
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| (s % 2 == 1).then_some(s + 1));
        use rayon::prelude::*;
        self.pool.install(|| items.par_iter().for_each(f));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn warmed_pools_run_everything_and_stop_spinning() {
        let packers = Packers::new(3, true);
        let done = AtomicUsize::new(0);
        for round in 0..50 {
            if round % 2 == 0 {
                packers.warm();
                packers.warm();
            }
            let items: Vec<usize> = (0..round + 1).collect();
            packers.run(&items, |&i| {
                done.fetch_add(i, Ordering::Relaxed);
            });
        }
        assert_eq!(done.load(Ordering::Relaxed), (1..=50).map(|n| n * (n - 1) / 2).sum::<usize>());
        assert!(!packers.is_spinning());
    }

    #[test]
    fn a_warm_up_without_work_ends_by_itself() {
        let packers = Packers::new(2, true);
        packers.warm();
        let start = Instant::now();
        while packers.is_spinning() {
            assert!(start.elapsed() < Duration::from_secs(10), "the threads never stopped spinning");
            std::thread::sleep(Duration::from_millis(1));
        }
        // And it can warm again (a new warm-up, however soon it ends).
        let before = packers.spinning.load(Ordering::Acquire);
        packers.warm();
        assert!(packers.spinning.load(Ordering::Acquire) > before);
        packers.run(&[1], |_| {});
        assert!(!packers.is_spinning());
    }

    #[test]
    fn one_thread_pools_and_pools_told_not_to_never_spin() {
        let cold = Packers::new(2, false);
        cold.warm();
        assert!(!cold.is_spinning());
        let packers = Packers::new(1, true);
        packers.warm();
        assert!(!packers.is_spinning());
        let done = AtomicUsize::new(0);
        packers.run(&[1, 2, 3], |&i| {
            done.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(done.load(Ordering::Relaxed), 6);
    }
}

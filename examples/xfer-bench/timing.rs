//! The clocks: one warm-up, then medians over repetitions timed on the host, and the
//! phases of one batch (adding its copies, submit, wait).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use cuda_resident::UploadBatch;

use crate::cli::Args;
use crate::{BenchResult, error};

/// Past this many copies, the many-small baselines (about 7 µs a raw call) run the minimum
/// of 5 repetitions whatever `--reps` says; their rows note it.
const BASELINE_REPS_COUNT: usize = 8192;

/// Repetitions of the baselines of a many-small case of `count` copies: one raw call costs
/// about 7 µs, so past `BASELINE_REPS_COUNT` copies they run the minimum of 5 (the same as
/// `--reps` unless it asks for more).
pub(crate) fn baseline_reps(args: &Args, count: usize) -> usize {
    if count > BASELINE_REPS_COUNT { args.reps.min(5) } else { args.reps }
}

/// The fewest, median and most of the repetitions of one timing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Spread {
    pub(crate) min: f64,
    pub(crate) median: f64,
    pub(crate) max: f64,
}

/// How many of the latest spreads [`spread_of`] can find: more than the timings of any row.
const SPREADS_KEPT: usize = 64;

thread_local! {
    /// The spreads of this thread's latest timings, newest last.
    static SPREADS: RefCell<VecDeque<Spread>> = const { RefCell::new(VecDeque::new()) };
}

/// The spread of the latest timing on this thread whose median is `median`, the exact
/// value [`median_of`] returned: a row finds the spread of each of its medians this way,
/// without every timing's caller handing it on.
pub(crate) fn spread_of(median: f64) -> Option<Spread> {
    SPREADS.with(|s| s.borrow().iter().rev().find(|s| s.median.to_bits() == median.to_bits()).copied())
}

/// Median of `reps` values of `sample`, after one warm-up call whose value is dropped; the
/// spread of the values is kept for [`spread_of`].
pub(crate) fn median_of(reps: usize, mut sample: impl FnMut() -> BenchResult<f64>) -> BenchResult<f64> {
    sample()?;
    let mut values = (0..reps).map(|_| sample()).collect::<BenchResult<Vec<f64>>>()?;
    values.sort_by(f64::total_cmp);
    let spread = Spread { min: values[0], median: values[values.len() / 2], max: values[values.len() - 1] };
    SPREADS.with(|s| {
        let mut s = s.borrow_mut();
        if s.len() == SPREADS_KEPT {
            s.pop_front();
        }
        s.push_back(spread);
    });
    Ok(spread.median)
}

/// Median seconds of `reps` runs of `run`, after one warm-up run.
pub(crate) fn median_secs(reps: usize, mut run: impl FnMut() -> BenchResult<()>) -> BenchResult<f64> {
    median_of(reps, || {
        let t = Instant::now();
        run()?;
        Ok(t.elapsed().as_secs_f64())
    })
}

/// Median microseconds of each of three phases over `reps` runs of `run`, which returns the
/// instants that start the first phase, end each phase and start the next.
pub(crate) fn phase_medians(
    reps: usize,
    mut run: impl FnMut() -> BenchResult<[Instant; 4]>,
) -> BenchResult<[f64; 3]> {
    let mut phases = [Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..reps.max(1) {
        let t = run()?;
        for (i, p) in phases.iter_mut().enumerate() {
            p.push(t[i + 1] - t[i]);
        }
    }
    Ok(phases.map(|mut p| median_micros(&mut p)))
}

/// The median of `times`, in microseconds.
pub(crate) fn median_micros(times: &mut [Duration]) -> f64 {
    times.sort();
    times[times.len() / 2].as_secs_f64() * 1e6
}

/// Median seconds of `reps` timed runs of `timed` on what `prepare` made (untimed), after
/// one warm-up run.
pub(crate) fn median_secs_prepared<T>(
    reps: usize,
    mut prepare: impl FnMut() -> BenchResult<T>,
    mut timed: impl FnMut(T) -> BenchResult<()>,
) -> BenchResult<f64> {
    median_of(reps, || {
        let input = prepare()?;
        let t = Instant::now();
        timed(input)?;
        Ok(t.elapsed().as_secs_f64())
    })
}

/// Median microseconds of an upload batch's three phases over `reps` runs: adding its
/// writes (`build`), submit (planning, packing, enqueueing) and the wait.
pub(crate) fn batch_phases<'d>(
    reps: usize,
    mut build: impl FnMut() -> cuda_resident::Result<UploadBatch<'d>>,
) -> BenchResult<[f64; 3]> {
    phase_medians(reps, || {
        let t = Instant::now();
        let batch = build().map_err(error)?;
        let t1 = Instant::now();
        let fence = batch.submit().map_err(error)?;
        let t2 = Instant::now();
        fence.wait().map_err(error)?;
        Ok([t, t1, t2, Instant::now()])
    })
}

#[cfg(test)]
mod tests {
    use super::{Spread, median_of, spread_of};

    #[test]
    fn a_median_finds_its_spread() {
        let mut values = [3.0, 9.0, 1.0, 5.0, 7.0, 2.0].into_iter();
        let median = median_of(5, || Ok(values.next().unwrap())).unwrap();
        assert_eq!(median, 5.0, "the warm-up's 3.0 is dropped");
        assert_eq!(spread_of(median), Some(Spread { min: 1.0, median: 5.0, max: 9.0 }));
        assert_eq!(spread_of(4.0), None);
    }
}

//! The clocks: one warm-up, then the spread (fewest, median, most) of repetitions timed on
//! the host, and the phases of one batch (adding its copies, submit, wait).

use std::time::{Duration, Instant};

use cuda_resident::{Device, UploadBatch};

pub(crate) use cuda_resident_suite::Spread;

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

/// The spread of `reps` values of `sample` (at least one), after one warm-up call whose
/// value is dropped.
pub(crate) fn median_of(reps: usize, mut sample: impl FnMut() -> BenchResult<f64>) -> BenchResult<Spread> {
    sample()?;
    let mut values = (0..reps.max(1)).map(|_| sample()).collect::<BenchResult<Vec<f64>>>()?;
    Ok(Spread::of(&mut values).expect("at least one repetition"))
}

/// The spread of the seconds of `reps` runs of `run`, after one warm-up run.
pub(crate) fn median_secs(reps: usize, mut run: impl FnMut() -> BenchResult<()>) -> BenchResult<Spread> {
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

/// The spread of the seconds of `reps` timed runs of `timed` on what `prepare` made
/// (untimed), after one warm-up run.
pub(crate) fn median_secs_prepared<T>(
    reps: usize,
    mut prepare: impl FnMut() -> BenchResult<T>,
    mut timed: impl FnMut(T) -> BenchResult<()>,
) -> BenchResult<Spread> {
    median_of(reps, || {
        let input = prepare()?;
        let t = Instant::now();
        timed(input)?;
        Ok(t.elapsed().as_secs_f64())
    })
}

/// Seconds of `first` and `second` run at the same time, `first` on a thread of its own
/// (with `d`'s context current), both released together; the clock runs until the later
/// one is done.
pub(crate) fn secs_together(
    d: &Device,
    first: impl FnOnce() -> BenchResult<()> + Send,
    second: impl FnOnce() -> BenchResult<()>,
) -> BenchResult<f64> {
    let start = std::sync::Barrier::new(2);
    std::thread::scope(|s| {
        let other = s.spawn(|| -> BenchResult<Instant> {
            let current = d.make_current().map_err(error);
            start.wait();
            current?;
            first()?;
            Ok(Instant::now())
        });
        start.wait();
        let t = Instant::now();
        let mine = second().map(|()| Instant::now());
        let theirs = other.join().map_err(|_| "a copy thread panicked".to_string())?;
        Ok((mine?.max(theirs?) - t).as_secs_f64())
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
    use super::{Spread, median_of};

    /// `median_of` over `values`, the first of them the warm-up.
    fn spread(reps: usize, values: &[f64]) -> Spread {
        let mut values = values.iter().copied();
        let spread = median_of(reps, || Ok(values.next().expect("one value per call"))).unwrap();
        assert_eq!(values.next(), None, "one warm-up and {reps} repetitions");
        spread
    }

    #[test]
    fn the_warm_up_is_dropped_and_the_spread_returned() {
        // The warm-up's 100.0 would be the most, and its 0.5 the fewest, were they kept.
        assert_eq!(spread(5, &[100.0, 3.0, 9.0, 1.0, 5.0, 7.0]), Spread { min: 1.0, median: 5.0, max: 9.0 });
        assert_eq!(spread(5, &[0.5, 3.0, 9.0, 1.0, 5.0, 7.0]), Spread { min: 1.0, median: 5.0, max: 9.0 });
        // An even count: the upper of the two middle values, one that was measured.
        assert_eq!(
            spread(6, &[0.0, 6.0, 2.0, 4.0, 1.0, 5.0, 3.0]),
            Spread { min: 1.0, median: 4.0, max: 6.0 }
        );
        assert_eq!(spread(1, &[9.0, 2.0]), Spread::exact(2.0));
    }

    #[test]
    fn a_failed_sample_fails_the_timing() {
        let mut n = 0;
        let failed = median_of(5, || {
            n += 1;
            if n == 3 { Err("boom".to_string()) } else { Ok(1.0) }
        });
        assert_eq!(failed, Err("boom".to_string()));
    }
}

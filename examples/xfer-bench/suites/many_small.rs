//! Many small copies, the cases of the default and grid suites: `count` copies of `size`
//! bytes to and from scattered device places, as one batch each way (by `write`, by
//! `write_with`, as a prepared set; read into caller `Vec`s and as views), against one raw
//! call per copy and one `cuMemcpyBatchAsync`.

use std::time::Instant;

use cuda_resident::{Device, ResidentBuffer};

use crate::baselines::DriverBaseline;
use crate::cli::Args;
use crate::report::{Row, human};
use crate::timing::{
    Spread, baseline_reps, batch_phases, median_micros, median_secs, median_secs_prepared, phase_medians,
};
use crate::workload::{Scatter, random_vec, verify_scatter};
use crate::{BenchResult, error};

/// The ranges of a case, `(buffer, offset, len)`, as prepared sets take them.
type Ranges = Vec<(ResidentBuffer, u64, u64)>;

/// One many-small case: `count` copies of `size` bytes, each way, by each method.
pub(crate) fn run(
    d: &Device,
    baseline: &DriverBaseline,
    args: &Args,
    (count, size): (usize, usize),
    rows: &mut Vec<Row>,
) -> BenchResult<()> {
    let first = rows.len();
    let base_reps = baseline_reps(args, count);
    let mut rng = fastrand::Rng::with_seed((count * 31 + size) as u64);
    let sources: Vec<Vec<u8>> = (0..count).map(|_| random_vec(&mut rng, size)).collect();
    let s = Scatter::new(d, count, size)?;
    let case = Case { d, baseline, args, count, size, base_reps, sources: &sources, s: &s };
    let ranges = case.upload_rows(rows)?;
    case.download_rows(&ranges, rows)?;
    for r in &mut rows[first..] {
        (r.count, r.size) = (Some(count), Some(size));
        if base_reps < args.reps {
            r.note = Some(format!("raw and batch API: median of {base_reps} repetitions"));
        }
    }
    Ok(())
}

/// What one case moves and where, and how many repetitions each side runs.
struct Case<'a, 'd> {
    d: &'d Device,
    baseline: &'a DriverBaseline<'d>,
    args: &'a Args,
    count: usize,
    size: usize,
    /// Repetitions of the raw and batch API sides.
    base_reps: usize,
    /// Each copy's bytes.
    sources: &'a [Vec<u8>],
    s: &'a Scatter,
}

impl Case<'_, '_> {
    /// The case's name: `{dir} {count} x {size} {what}`.
    fn name(&self, dir: &str, what: &str) -> String {
        format!("{dir} {} x {} {what}", self.count, human(self.size))
    }

    /// Host to device: the rows of every way of uploading; returns the case's ranges for
    /// the prepared downloads.
    fn upload_rows(&self, rows: &mut Vec<Row>) -> BenchResult<Ranges> {
        let (d, s, sources, size, e) = (self.d, self.s, self.sources, self.size, error);
        let raw_h2d = median_secs(self.base_reps, || self.baseline.uploads(sources, &s.ptrs, size))?;
        let batch_h2d = if self.baseline.batch {
            let mut dsts = s.ptrs.clone();
            let mut srcs: Vec<u64> = sources.iter().map(|v| v.as_ptr() as u64).collect();
            let mut sizes = vec![size; self.count];
            Some(median_secs(self.base_reps, || {
                self.baseline.memcpy_batch(&mut dsts, &mut srcs, &mut sizes, true)
            })?)
        } else {
            None
        };
        let ours_h2d = median_secs(self.args.reps, || {
            s.copied_batch(d, sources).map_err(e)?.submit().map_err(e)?.wait().map_err(e)
        })?;
        verify_scatter(d, s, sources, size, "H2D")?;
        if self.args.breakdown {
            self.upload_breakdown()?;
        }
        let ours_in_place = self.write_with_times()?;
        let ranges: Ranges = s.places.iter().map(|&(b, o)| (s.buffers[b], o, size as u64)).collect();
        let ours_prepared = prepared_uploads(d, self.args, s, sources, &ranges)?;
        let row = |what: &str, ours| {
            Row::gbps(self.name("H2D", what), self.count * size, Some(raw_h2d), batch_h2d, ours)
        };
        rows.push(row("from pageable", ours_h2d));
        if let Some(t) = ours_prepared {
            rows.push(row("prepared, from pageable", t));
        }
        if let Some((fill_and_move, staged)) = ours_in_place {
            rows.push(row("write_with, fill+move", fill_and_move));
            rows.push(row("write_with, move only", staged));
        }
        if let Some(fill_and_move) = self.write_with_par_time()? {
            rows.push(row("write_with_par, fill+move", fill_and_move));
        }
        Ok(ranges)
    }

    /// Where the time of one batch goes, from the outside: adding writes, submit
    /// (planning, packing, enqueueing), waiting; and planning alone.
    fn upload_breakdown(&self) -> BenchResult<()> {
        let (d, s, size) = (self.d, self.s, self.size);
        let [write, submit, wait] = batch_phases(self.args.reps, || s.copied_batch(d, self.sources))?;
        let len = d.buffer_len(s.buffers[0]).map_err(error)?;
        let requests: Vec<_> = s
            .places
            .iter()
            .map(|&(b, o)| cuda_resident::internals::plan::WriteRequest {
                buffer: b as u64,
                buffer_len: len,
                offset: o,
                len: size as u64,
            })
            .collect();
        let config = cuda_resident::internals::plan::PlanConfig::default();
        let (mut planner, mut plan) = (
            cuda_resident::internals::plan::Planner::new(),
            cuda_resident::internals::plan::UploadPlan::default(),
        );
        let mut planning = Vec::new();
        for _ in 0..self.args.reps.max(20) {
            let t = Instant::now();
            planner.plan_upload_into(&requests, &config, &mut plan).map_err(|e| e.to_string())?;
            planning.push(t.elapsed());
        }
        eprintln!(
            "breakdown H2D {} x {}: write {:.0} µs, submit {:.0} µs (planning alone {:.0} µs), wait {:.0} µs",
            self.count,
            human(size),
            write,
            submit,
            median_micros(&mut planning),
            wait
        );
        Ok(())
    }

    /// The `write_with` batch: the seconds to fill and move, and to move bytes already staged
    /// (written in place before the clock starts: what the link and the scatter cost).
    /// `None` where the batch is refused: it stages every byte in pinned memory before it is
    /// submitted, so a case larger than the pool can lend is skipped (with a line on
    /// stderr), as prepared sets are.
    fn write_with_times(&self) -> BenchResult<Option<(Spread, Spread)>> {
        let (d, s, sources, size, reps, e) = (self.d, self.s, self.sources, self.size, self.args.reps, error);
        let fill_and_move = match median_secs(reps, || {
            s.in_place_batch(d, sources).map_err(e)?.submit().map_err(e)?.wait().map_err(e)
        }) {
            Ok(t) => t,
            Err(err) => {
                eprintln!("write_with rows of {} x {} skipped: {err}", self.count, human(size));
                return Ok(None);
            }
        };
        verify_scatter(d, s, sources, size, "H2D write_with")?;
        let staged = median_secs_prepared(
            reps,
            || s.in_place_batch(d, sources).map_err(e),
            |batch| batch.submit().map_err(e)?.wait().map_err(e),
        )?;
        verify_scatter(d, s, sources, size, "H2D write_with, staged")?;
        if self.args.breakdown {
            let [fill, submit, wait] = batch_phases(reps, || s.in_place_batch(d, sources))?;
            eprintln!(
                "breakdown H2D {} x {} write_with: fill {fill:.0} µs, submit {submit:.0} µs, wait {wait:.0} µs",
                self.count,
                human(size)
            );
        }
        Ok(Some((fill_and_move, staged)))
    }

    /// The `write_with_par` batch: the seconds to fill (the same bytes as the `write_with`
    /// rows, written by the closure, on the packing threads at submit) and move. `None`
    /// where the batch is refused, as for [`Case::write_with_times`].
    fn write_with_par_time(&self) -> BenchResult<Option<Spread>> {
        let (d, s, sources, size, reps, e) = (self.d, self.s, self.sources, self.size, self.args.reps, error);
        let fill_and_move = match median_secs(reps, || {
            s.in_place_par_batch(d, sources).map_err(e)?.submit().map_err(e)?.wait().map_err(e)
        }) {
            Ok(t) => t,
            Err(err) => {
                eprintln!("write_with_par rows of {} x {} skipped: {err}", self.count, human(size));
                return Ok(None);
            }
        };
        verify_scatter(d, s, sources, size, "H2D write_with_par")?;
        if self.args.breakdown {
            let [add, submit, wait] = batch_phases(reps, || s.in_place_par_batch(d, sources))?;
            eprintln!(
                "breakdown H2D {} x {} write_with_par: add {add:.0} µs, submit (fill) {submit:.0} µs, wait {wait:.0} µs",
                self.count,
                human(size)
            );
        }
        Ok(Some(fill_and_move))
    }

    /// Device to host (the scattered places hold the sources): the rows of every way of
    /// reading back.
    fn download_rows(&self, ranges: &Ranges, rows: &mut Vec<Row>) -> BenchResult<()> {
        let (d, s, sources, size, count, e) = (self.d, self.s, self.sources, self.size, self.count, error);
        let mut outs: Vec<Vec<u8>> = (0..count).map(|_| vec![0u8; size]).collect();
        let raw_d2h = median_secs(self.base_reps, || self.baseline.downloads(&mut outs, &s.ptrs, size))?;
        let batch_d2h = if self.baseline.batch {
            let mut dsts: Vec<u64> = outs.iter_mut().map(|v| v.as_mut_ptr() as u64).collect();
            let mut srcs = s.ptrs.clone();
            let mut sizes = vec![size; count];
            Some(median_secs(self.base_reps, || {
                self.baseline.memcpy_batch(&mut dsts, &mut srcs, &mut sizes, false)
            })?)
        } else {
            None
        };
        for o in &mut outs {
            o.fill(0xA5);
        }
        let ours_d2h = median_secs(self.args.reps, || {
            s.read_batch(d, size).map_err(e)?.submit_into(&mut outs).map_err(e)
        })?;
        if outs != sources {
            return Err(crate::mismatch(format!("D2H {count} x {size} into Vecs: bytes differ")));
        }
        if self.args.breakdown {
            self.download_breakdown(&mut outs)?;
        }
        let ours_views = self.views_time()?;
        let prepared = prepared_downloads(d, self.args, sources, ranges, &mut outs)?;
        let row = |what: &str, ours| {
            Row::gbps(self.name("D2H", what), count * size, Some(raw_d2h), batch_d2h, ours)
        };
        rows.push(row("into caller Vecs", ours_d2h));
        rows.push(row("read as views", ours_views));
        if let Some([into, views]) = prepared {
            rows.push(row("prepared, into caller Vecs", into));
            rows.push(row("prepared, read as views", views));
        }
        Ok(())
    }

    /// Where the time of one download into `outs` goes: adding reads, submit (laying out,
    /// enqueueing), waiting and copying out chunk by chunk.
    fn download_breakdown(&self, outs: &mut [Vec<u8>]) -> BenchResult<()> {
        let (d, s, size, e) = (self.d, self.s, self.size, error);
        let [read, submit, wait] = phase_medians(self.args.reps, || {
            let t = Instant::now();
            let (reads, slots) = s.reads(d, size).map_err(e)?;
            let t1 = Instant::now();
            let pending = reads.submit().map_err(e)?;
            let t2 = Instant::now();
            pending.wait_into(&slots, outs).map_err(e)?;
            Ok([t, t1, t2, Instant::now()])
        })?;
        eprintln!(
            "breakdown D2H {} x {} into Vecs: read {read:.0} µs, submit {submit:.0} µs, wait and copy out {wait:.0} µs",
            self.count,
            human(size)
        );
        Ok(())
    }

    /// The seconds to read every copy back as views (the first 64 checked each time, every one
    /// after the clock).
    fn views_time(&self) -> BenchResult<Spread> {
        let (d, s, sources, size, count, e) = (self.d, self.s, self.sources, self.size, self.count, error);
        let mut seen = 0usize;
        let ours_views = median_secs(self.args.reps, || {
            let (slots, done) = s.read_all(d, size).map_err(e)?;
            seen = slots.iter().filter(|&&slot| done.get(slot).len() == size).count();
            if slots.iter().zip(sources).take(64).any(|(&slot, src)| done.get(slot) != &src[..]) {
                return Err(crate::mismatch("D2H views: bytes differ".into()));
            }
            Ok(())
        })?;
        if seen != count {
            return Err(format!("D2H {count} x {size} views: {seen} of {count} views have {size} bytes"));
        }
        let (slots, done) = s.read_all(d, size).map_err(e)?;
        if slots.iter().zip(sources).any(|(&slot, src)| done.get(slot) != &src[..]) {
            return Err(crate::mismatch(format!("D2H {count} x {size} views: bytes differ")));
        }
        drop(done);
        Ok(ours_views)
    }
}

/// The ranges prepared once (outside the clock) and uploaded with the bytes each time: the
/// seconds' spread, or `None` (said on stderr) when the set cannot be prepared, e.g. its pinned
/// region would not fit the pool.
fn prepared_uploads(
    d: &Device,
    args: &Args,
    s: &Scatter,
    sources: &[Vec<u8>],
    ranges: &[(ResidentBuffer, u64, u64)],
) -> BenchResult<Option<Spread>> {
    let mut prepared = match d.prepare_uploads(ranges) {
        Ok(p) => p,
        Err(err) => {
            eprintln!("prepared uploads of {} ranges skipped: {err}", ranges.len());
            return Ok(None);
        }
    };
    let t = median_secs(args.reps, || prepared.upload(sources).map_err(error)?.wait().map_err(error))?;
    verify_scatter(d, s, sources, sources[0].len(), "H2D prepared")?;
    Ok(Some(t))
}

/// The ranges (which hold `sources`) prepared once and read each time, into `outs` and as
/// views: the seconds' spreads, or `None` as for [`prepared_uploads`].
fn prepared_downloads(
    d: &Device,
    args: &Args,
    sources: &[Vec<u8>],
    ranges: &[(ResidentBuffer, u64, u64)],
    outs: &mut [Vec<u8>],
) -> BenchResult<Option<[Spread; 2]>> {
    let e = error;
    let mut prepared = match d.prepare_downloads(ranges) {
        Ok(p) => p,
        Err(err) => {
            eprintln!("prepared downloads of {} ranges skipped: {err}", ranges.len());
            return Ok(None);
        }
    };
    let what = format!("D2H {} x {} prepared", ranges.len(), sources[0].len());
    for o in outs.iter_mut() {
        o.fill(0x5A);
    }
    let into = median_secs(args.reps, || prepared.download_into(outs).map_err(e))?;
    if outs != sources {
        return Err(crate::mismatch(format!("{what} into Vecs: bytes differ")));
    }
    let views = median_secs(args.reps, || {
        let done = prepared.submit().map_err(e)?.wait().map_err(e)?;
        if (0..ranges.len().min(64)).any(|k| done.get(prepared.slot(k)) != &sources[k][..]) {
            return Err(crate::mismatch(format!("{what} views: bytes differ")));
        }
        Ok(())
    })?;
    let done = prepared.submit().map_err(e)?.wait().map_err(e)?;
    if (0..ranges.len()).any(|k| done.get(prepared.slot(k)) != &sources[k][..]) {
        return Err(crate::mismatch(format!("{what} views: bytes differ")));
    }
    Ok(Some([into, views]))
}

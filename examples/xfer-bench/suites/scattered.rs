//! Scattered batches, in the default suite: the shape of a runtime that holds one allocation
//! per tensor or row. `count` copies, each to or from a buffer of its own, named in shuffled
//! order, as one batch each way: by `write` from `Vec`s, and by `read` into caller `Vec`s
//! (`DownloadBatch::submit_into`), against one raw call per copy and one
//! `cuMemcpyBatchAsync`. The sizes: each of the suite's sizes, and a mix from 64 B to 256 KiB.

use std::time::Instant;

use cuda_resident::{Device, OwnedBuffer, ResidentBuffer};

use crate::baselines::DriverBaseline;
use crate::cli::Args;
use crate::report::{Row, human};
use crate::single::ByMethod;
use crate::timing::{Spread, baseline_reps, batch_phases, median_secs, phase_medians};
use crate::workload::random_vec;
use crate::{BenchResult, error};

/// The smallest and largest copy of the mixed shape.
const MIXED: (usize, usize) = (64, 256 << 10);

/// The copies' sizes: all alike, or mixed (log-uniform from [`MIXED`]'s first to its last, so
/// that every scale is as common).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Sizes {
    Each(usize),
    Mixed,
}

impl Sizes {
    /// The label of a row: `256 B` or `64 B-256 KiB`.
    fn label(self) -> String {
        match self {
            Sizes::Each(size) => human(size),
            Sizes::Mixed => format!("{}-{}", human(MIXED.0), human(MIXED.1)),
        }
    }

    /// `count` sizes, from `rng`.
    fn sizes(self, rng: &mut fastrand::Rng, count: usize) -> Vec<usize> {
        match self {
            Sizes::Each(size) => vec![size; count],
            Sizes::Mixed => {
                let (lo, hi) = ((MIXED.0 as f64).ln(), (MIXED.1 as f64).ln());
                (0..count)
                    .map(|_| ((lo + rng.f64() * (hi - lo)).exp() as usize).clamp(MIXED.0, MIXED.1))
                    .collect()
            }
        }
    }

    /// Bytes of `count` copies, for the mixed shape as many as its mean size gives
    /// (`(last - first) / ln(last / first)`, about 31 KiB).
    pub(crate) fn planned_bytes(self, count: usize) -> Option<usize> {
        count.checked_mul(match self {
            Sizes::Each(size) => size,
            Sizes::Mixed => ((MIXED.1 - MIXED.0) as f64 / (MIXED.1 as f64 / MIXED.0 as f64).ln()) as usize,
        })
    }
}

/// One scattered case: `count` copies of `sizes`, each way, by each method.
pub(crate) fn run(
    d: &Device,
    baseline: &DriverBaseline,
    args: &Args,
    (count, sizes): (usize, Sizes),
    rows: &mut Vec<Row>,
) -> BenchResult<()> {
    let mut rng = fastrand::Rng::with_seed(count as u64 * 131 + sizes.planned_bytes(1).unwrap_or(0) as u64);
    let lens = sizes.sizes(&mut rng, count);
    let total: usize = lens.iter().sum();
    let sources: Vec<Vec<u8>> = lens.iter().map(|&len| random_vec(&mut rng, len)).collect();
    // Owned: those allocated before a refusal, or an error part way, are freed on the way out.
    let owned =
        lens.iter().map(|&len| d.allocate_owned(len as u64)).collect::<Result<Vec<_>, _>>().map_err(error)?;
    let buffers: Vec<ResidentBuffer> = owned.iter().map(OwnedBuffer::handle).collect();
    let [h2d, d2h] = measure(d, baseline, args, &buffers, &sources, &mut rng)?;
    drop(owned);
    let name =
        |dir: &str, what: &str| format!("{dir} {count} x {} a buffer each, shuffled, {what}", sizes.label());
    let base_reps = baseline_reps(args, count);
    for (case, t) in [(name("H2D", "from pageable"), h2d), (name("D2H", "into caller Vecs"), d2h)] {
        let mut row = Row::from_times(case, total, &t);
        row.count = Some(count);
        if let Sizes::Each(size) = sizes {
            row.size = Some(size);
        }
        if base_reps < args.reps {
            row.note = Some(format!("raw and batch API: median of {base_reps} repetitions"));
        }
        rows.push(row);
    }
    Ok(())
}

/// Times each method each way (uploads checked by reading every buffer back; downloads into
/// poisoned `Vec`s, checked against the sources): up, then down.
fn measure(
    d: &Device,
    baseline: &DriverBaseline,
    args: &Args,
    buffers: &[ResidentBuffer],
    sources: &[Vec<u8>],
    rng: &mut fastrand::Rng,
) -> BenchResult<[ByMethod<Spread>; 2]> {
    let (count, e) = (buffers.len(), error);
    let mut order: Vec<usize> = (0..count).collect();
    rng.shuffle(&mut order);
    let ptrs: Vec<u64> =
        order.iter().map(|&i| d.device_ptr(buffers[i])).collect::<Result<_, _>>().map_err(e)?;
    let srcs: Vec<&[u8]> = order.iter().map(|&i| &sources[i][..]).collect();
    let base_reps = baseline_reps(args, count);
    let raw_h2d = median_secs(base_reps, || {
        crate::baselines::each_h2d(d, baseline.stream, srcs.iter().copied(), &ptrs)
    })?;
    let mut sizes: Vec<usize> = srcs.iter().map(|s| s.len()).collect();
    let batch_h2d = if baseline.batch {
        let (mut dsts, mut hosts) =
            (ptrs.clone(), srcs.iter().map(|s| s.as_ptr() as u64).collect::<Vec<_>>());
        Some(median_secs(base_reps, || baseline.memcpy_batch(&mut dsts, &mut hosts, &mut sizes, true))?)
    } else {
        None
    };
    let ours_h2d = median_secs(args.reps, || {
        let mut batch = d.uploads();
        for &i in &order {
            batch.write(buffers[i], 0, &sources[i]).map_err(e)?;
        }
        batch.submit().map_err(e)?.wait().map_err(e)
    })?;
    if args.breakdown {
        breakdown(d, args.reps, buffers, sources, &order)?;
    }
    let back = d.download_many(buffers).map_err(e)?;
    if let Some(i) = (0..count).find(|&i| back[i] != sources[i]) {
        return Err(crate::mismatch(format!(
            "H2D {count} copies a buffer each: buffer {i} ({} B) differs from its source",
            sources[i].len()
        )));
    }
    let mut outs: Vec<Vec<u8>> = order.iter().map(|&i| vec![0u8; sources[i].len()]).collect();
    let raw_d2h = median_secs(base_reps, || {
        crate::baselines::each_d2h(d, baseline.stream, outs.iter_mut().map(|o| &mut o[..]), &ptrs)
    })?;
    let batch_d2h = if baseline.batch {
        let (mut dsts, mut devs) =
            (outs.iter_mut().map(|o| o.as_mut_ptr() as u64).collect::<Vec<_>>(), ptrs.clone());
        Some(median_secs(base_reps, || baseline.memcpy_batch(&mut dsts, &mut devs, &mut sizes, false))?)
    } else {
        None
    };
    for o in &mut outs {
        o.fill(0xA5);
    }
    let ours_d2h = median_secs(args.reps, || {
        let mut reads = d.downloads();
        for &i in &order {
            reads.read(buffers[i], 0, sources[i].len() as u64).map_err(e)?;
        }
        reads.submit_into(&mut outs).map_err(e)
    })?;
    if let Some(k) = (0..count).find(|&k| outs[k] != sources[order[k]]) {
        return Err(crate::mismatch(format!(
            "D2H {count} copies a buffer each into Vecs: buffer {} ({} B) differs",
            order[k],
            outs[k].len()
        )));
    }
    Ok([
        ByMethod { raw: raw_h2d, batch: batch_h2d, ours: ours_h2d },
        ByMethod { raw: raw_d2h, batch: batch_d2h, ours: ours_d2h },
    ])
}

/// Where the time of one scattered batch goes, each way (`--breakdown`), on stderr: adding
/// the requests (one buffer each, in `order`), `submit`, and waiting (downloads: and copying
/// out into `Vec`s).
fn breakdown(
    d: &Device,
    reps: usize,
    buffers: &[ResidentBuffer],
    sources: &[Vec<u8>],
    order: &[usize],
) -> BenchResult<()> {
    let count = buffers.len();
    let [write, submit, wait] = batch_phases(reps, || {
        let mut batch = d.uploads();
        for &i in order {
            batch.write(buffers[i], 0, &sources[i])?;
        }
        Ok(batch)
    })?;
    eprintln!(
        "breakdown H2D {count} copies a buffer each, shuffled: write {write:.0} µs, submit {submit:.0} µs, wait {wait:.0} µs"
    );
    let mut outs: Vec<Vec<u8>> = order.iter().map(|&i| vec![0u8; sources[i].len()]).collect();
    let [read, submit, wait] = phase_medians(reps, || {
        let t = Instant::now();
        let mut reads = d.downloads();
        let mut slots = Vec::with_capacity(order.len());
        for &i in order {
            slots.push(reads.read(buffers[i], 0, sources[i].len() as u64).map_err(error)?);
        }
        let t1 = Instant::now();
        let pending = reads.submit().map_err(error)?;
        let t2 = Instant::now();
        pending.wait_into(&slots, &mut outs).map_err(error)?;
        Ok([t, t1, t2, Instant::now()])
    })?;
    eprintln!(
        "breakdown D2H {count} copies a buffer each, shuffled, into Vecs: read {read:.0} µs, submit {submit:.0} µs, wait and copy out {wait:.0} µs"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{MIXED, Sizes};

    #[test]
    fn mixed_sizes_span_the_range_at_every_scale() {
        let mut rng = fastrand::Rng::with_seed(3);
        let sizes = Sizes::Mixed.sizes(&mut rng, 8192);
        assert!(sizes.iter().all(|&s| (MIXED.0..=MIXED.1).contains(&s)));
        let small = sizes.iter().filter(|&&s| s < 1024).count();
        let large = sizes.iter().filter(|&&s| s >= 64 << 10).count();
        assert!(
            small > 8192 / 6 && large > 8192 / 8,
            "log-uniform: {small} under 1 KiB, {large} from 64 KiB"
        );
        assert_eq!(Sizes::Each(256).sizes(&mut rng, 3), [256; 3]);
        assert_eq!(Sizes::Mixed.label(), "64 B-256 KiB");
        let mean = Sizes::Mixed.planned_bytes(1).unwrap();
        assert!((30 << 10..32 << 10).contains(&mean), "{mean}");
        let drawn = Sizes::Mixed.sizes(&mut rng, 100_000).iter().sum::<usize>() / 100_000;
        assert!(drawn.abs_diff(mean) < mean / 20, "the draws' mean {drawn} is about {mean}");
    }
}

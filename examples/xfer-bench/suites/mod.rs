//! The suites: what each runs, worked out from the flags ([`SuitePlan`]), and the run of
//! its cases in order, one file per kind of case. The default suite is many small copies,
//! scattered batches (a buffer per copy), `--large` single copies and one 4 KiB upload's
//! latency; grid is many small copies over
//! every count and size; sweep, latency, alloc, paging and peer run their own file's cases;
//! all runs every one.

mod alloc;
mod large;
mod latency;
mod many_small;
mod paging;
mod peer;
mod scattered;
mod sweep;
mod weights;
mod weights_shards;

use std::sync::Arc;

use cuda_resident::Device;
use cuda_resident::cuda_sys::Driver;
use indicatif::{ProgressBar, ProgressStyle};

use crate::baselines::DriverBaseline;
use crate::cli::{Args, Suite};
use crate::report::{self, Row, human};
use crate::{BenchResult, error, no_gpu};

/// Copy counts of the many-small grid when `--counts` is not given.
const GRID_COUNTS: [usize; 3] = [1024, 8192, 65536];
/// Copy count of the default suite's many-small cases when `--counts` is not given.
const DEFAULT_COUNT: usize = 8192;

/// What a suite runs, worked out from the flags before any device is touched.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct SuitePlan {
    /// Many-small cases, `(count, size)`.
    many_small: Vec<(usize, usize)>,
    /// Many-small cases over `--max-case`, said in the report.
    pub(crate) skipped: Vec<String>,
    /// Scattered cases (a buffer per copy, shuffled), `(count, sizes)`.
    scattered: Vec<(usize, scattered::Sizes)>,
    large: bool,
    /// Latency sizes, and whether only uploads from pageable memory are timed.
    latency: Option<(Vec<usize>, bool)>,
    sweep: bool,
    alloc: bool,
    /// Whether the paging suite's cases run.
    paging: bool,
    /// The peer suite's many-small cases, `(count, size)`, when it runs.
    peer: Option<Vec<(usize, usize)>>,
    /// Whether the weights suite's cases run.
    weights: bool,
}

impl SuitePlan {
    pub(crate) fn new(args: &Args) -> SuitePlan {
        use Suite::*;
        let s = args.suite;
        let counts = match (&args.counts, s) {
            (_, Sweep | Latency | Alloc | Paging | Weights) => Vec::new(),
            (Some(counts), _) => counts.clone(),
            (None, Default | Peer) => vec![DEFAULT_COUNT],
            (None, _) => GRID_COUNTS.to_vec(),
        };
        let limit = args.max_case_bytes();
        let (mut many_small, mut skipped) = (Vec::new(), Vec::new());
        for &count in &counts {
            for &size in &args.sizes {
                match count.checked_mul(size) {
                    Some(bytes) if bytes <= limit => many_small.push((count, size)),
                    bytes => skipped.push(format!(
                        "{count} x {} ({}): more than --max-case {}",
                        human(size),
                        bytes.map_or_else(|| "too large to count".to_owned(), human),
                        human(limit)
                    )),
                }
            }
        }
        let latency = match s {
            Default => Some((vec![4096], true)),
            Latency | All => Some((args.latency_sizes.clone(), false)),
            _ => None,
        };
        let peer = matches!(s, Peer | All).then(|| many_small.clone());
        let scattered = match s {
            Default | All => {
                let count = args.counts.as_ref().and_then(|c| c.first().copied()).unwrap_or(DEFAULT_COUNT);
                args.sizes
                    .iter()
                    .map(|&size| scattered::Sizes::Each(size))
                    .chain([scattered::Sizes::Mixed])
                    .filter(|sizes| sizes.planned_bytes(count).is_some_and(|b| b <= limit))
                    .map(|sizes| (count, sizes))
                    .collect()
            }
            _ => Vec::new(),
        };
        SuitePlan {
            many_small: if s == Peer { Vec::new() } else { many_small },
            skipped,
            scattered,
            large: matches!(s, Default | All),
            latency,
            sweep: matches!(s, Sweep | All),
            alloc: matches!(s, Alloc | All),
            paging: args.runs_paging(),
            peer,
            weights: s == Weights,
        }
    }

    /// Steps of the progress bar.
    fn steps(&self, args: &Args) -> u64 {
        let sweep = if self.sweep { 2 * sweep::sweep_sizes(args.large).len() } else { 0 };
        (self.many_small.len()
            + self.scattered.len()
            + usize::from(self.large)
            + self.latency.as_ref().map_or(0, |(sizes, _)| sizes.len())
            + sweep
            + usize::from(self.alloc)
            + if self.paging { paging::steps(args) } else { 0 }
            + self.peer.as_deref().map_or(0, peer::steps)
            + if self.weights { weights::STEPS } else { 0 }) as u64
    }
}

/// Opens the device, prints the header and runs every case of `plan`: the rows, and what
/// the report says about the device. A peer case on a host of one GPU is dropped from
/// `plan` (and listed as skipped) unless the peer suite itself was asked for.
pub(crate) fn run(
    args: &Args,
    plan: &mut SuitePlan,
    config: cuda_resident::Config,
) -> BenchResult<(Vec<Row>, serde_json::Value, serde_json::Value)> {
    let driver = Driver::load().map(Arc::new).map_err(|e| no_gpu(e.to_string()))?;
    let d = Device::open_on_driver(driver, args.device, config).map_err(|e| no_gpu(error(e)))?;
    d.make_current().map_err(|e| no_gpu(error(e)))?;
    let baseline = DriverBaseline::new(&d)?;
    let gpus = count_peers(args, plan)?;
    report::print_header(&d, plan);
    let mut rows = Vec::new();
    let progress = ProgressBar::new(plan.steps(args)).with_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {elapsed} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    run_cases(&d, &baseline, args, plan, gpus, &mut rows, &progress)?;
    progress.finish_and_clear();
    drop(baseline);
    Ok((rows, report::device_json(&d), report::config_json(&d)))
}

/// How many GPUs the driver sees where the peer suite runs (0 where it does not); with
/// fewer than two, the peer suite fails and `all` skips its peer cases.
fn count_peers(args: &Args, plan: &mut SuitePlan) -> BenchResult<usize> {
    // Counted only where the peer suite runs, which needs two.
    let gpus = if plan.peer.is_some() { Device::count().map_err(error)? } else { 0 };
    if plan.peer.is_some() && gpus < 2 {
        if args.suite == Suite::Peer {
            return Err(no_gpu(format!("{}. {}", peer::too_few(gpus), peer::FEW_FIX)));
        }
        plan.peer = None;
        plan.skipped.push(format!("peer: {}", peer::too_few(gpus)));
    }
    Ok(gpus)
}

/// Every case of `plan`, in order, a progress step each.
fn run_cases(
    d: &Device,
    baseline: &DriverBaseline,
    args: &Args,
    plan: &SuitePlan,
    gpus: usize,
    rows: &mut Vec<Row>,
    progress: &ProgressBar,
) -> BenchResult<()> {
    for &(count, size) in &plan.many_small {
        progress.set_message(format!("{count} x {}", human(size)));
        many_small::run(d, baseline, args, (count, size), rows)?;
        progress.inc(1);
    }
    for &(count, sizes) in &plan.scattered {
        progress.set_message(format!("{count} scattered"));
        scattered::run(d, baseline, args, (count, sizes), rows)?;
        progress.inc(1);
    }
    if plan.large {
        progress.set_message(format!("{} single copies", human(args.large)));
        large::run(d, baseline, args, rows)?;
        progress.inc(1);
    }
    if let Some((sizes, upload_only)) = &plan.latency {
        for &size in sizes {
            progress.set_message(format!("latency {}", human(size)));
            latency::run(d, baseline, args, &[size], *upload_only, rows)?;
            progress.inc(1);
        }
    }
    if plan.sweep {
        sweep::run(d, baseline, args, rows, progress)?;
    }
    if plan.alloc {
        progress.set_message("allocation");
        alloc::run(d, rows)?;
        progress.inc(1);
    }
    if plan.paging {
        paging::run(d, baseline, args, rows, progress)?;
    }
    if let Some(cases) = &plan.peer {
        peer::run(d, baseline, args, gpus, cases, rows, progress)?;
    }
    if plan.weights {
        weights::run(d, baseline, args, rows, progress)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::SuitePlan;
    use crate::cli::parse;

    #[test]
    fn suites_plan_their_cases() {
        let default = SuitePlan::new(&parse(&[]).unwrap());
        assert_eq!(default.many_small, [(8192, 256), (8192, 4096), (8192, 65536)]);
        assert!(default.large && !default.sweep && !default.alloc && default.skipped.is_empty());
        assert!(!default.paging, "not part of the default suite");
        assert_eq!(default.latency, Some((vec![4096], true)));
        use super::scattered::Sizes::{Each, Mixed};
        assert_eq!(
            default.scattered,
            [(8192, Each(256)), (8192, Each(4096)), (8192, Each(65536)), (8192, Mixed)]
        );

        let small = SuitePlan::new(&parse(&["--max-case", "200MiB"]).unwrap());
        assert_eq!(small.scattered, [(8192, Each(256)), (8192, Each(4096))], "by planned bytes");

        let grid = SuitePlan::new(&parse(&["--suite", "grid"]).unwrap());
        assert_eq!(grid.many_small.len(), 8, "65536 x 64 KiB is 4 GiB, over the 1 GiB limit");
        assert_eq!(grid.skipped, ["65536 x 64 KiB (4 GiB): more than --max-case 1 GiB"]);
        assert!(!grid.large && grid.latency.is_none() && !grid.sweep && grid.scattered.is_empty());

        let all = SuitePlan::new(&parse(&["--suite", "all", "--max-case", "4GiB"]).unwrap());
        assert_eq!(all.many_small.len(), 9);
        let old = SuitePlan::new(&parse(&["--suite", "all", "--max-case-mib", "4096"]).unwrap());
        assert_eq!(old, all, "the deprecated spelling plans the same");
        let small = SuitePlan::new(&parse(&["--suite", "grid", "--max-case", "6MiB"]).unwrap());
        assert_eq!(small.skipped[0], "1024 x 64 KiB (64 MiB): more than --max-case 6 MiB");
        assert!(all.large && all.sweep && all.alloc && all.paging);
        assert_eq!(all.latency, Some((vec![4, 256, 4096, 65536], false)));

        let counts = SuitePlan::new(&parse(&["--count", "100", "--sizes", "8"]).unwrap());
        assert_eq!(counts.many_small, [(100, 8)]);
        let latency = SuitePlan::new(&parse(&["--suite", "latency", "--counts", "5"]).unwrap());
        assert!(latency.many_small.is_empty() && latency.latency.is_some());

        let peer = SuitePlan::new(&parse(&["--suite", "peer"]).unwrap());
        assert_eq!(peer.peer.as_deref(), Some(&default.many_small[..]));
        assert!(peer.many_small.is_empty() && !peer.large && peer.latency.is_none() && !peer.alloc);
        assert_eq!(all.peer.as_ref().map(Vec::len), Some(9), "the grid's cases");
        assert!(default.peer.is_none() && grid.peer.is_none());

        let paging = SuitePlan::new(&parse(&["--suite", "paging"]).unwrap());
        assert!(paging.paging && paging.many_small.is_empty() && paging.skipped.is_empty());
        assert!(!paging.large && paging.latency.is_none() && !paging.sweep && !paging.alloc);
        assert!(paging.peer.is_none() && !grid.paging);

        let weights = SuitePlan::new(&parse(&["--suite", "weights"]).unwrap());
        assert!(weights.weights && weights.many_small.is_empty() && weights.latency.is_none());
        assert!(!weights.large && !weights.paging && !all.weights && !default.weights);
    }
}

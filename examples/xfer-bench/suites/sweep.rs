//! The sweep suite: single copies from 4 KiB to `--large`, pageable and pinned, one way
//! and both at once.

use cuda_resident::Device;
use indicatif::ProgressBar;

use crate::baselines::DriverBaseline;
use crate::cli::Args;
use crate::report::{Row, human};
use crate::single::{both_ways, up_down, with_pinned};
use crate::workload::host_pair;
use crate::{BenchResult, error};

/// The sweep's sizes: 4 KiB, x16 apart, up to `large`, and `large` itself.
pub(crate) fn sweep_sizes(large: usize) -> Vec<usize> {
    let mut sizes: Vec<usize> =
        (0..).map(|i| 4096usize << (4 * i)).take_while(|&size| size <= large).collect();
    if sizes.last() != Some(&large) {
        sizes.push(large);
    }
    sizes
}

/// Single copies of every sweep size, pageable and pinned: H2D, D2H and both directions at
/// once, against the raw driver (and the batch API with one copy, one way). Each sample
/// moves at least 16 MiB each way.
pub(crate) fn run(
    d: &Device,
    baseline: &DriverBaseline,
    args: &Args,
    rows: &mut Vec<Row>,
    progress: &ProgressBar,
) -> BenchResult<()> {
    let n = args.large;
    let (mut src, mut dst) = host_pair(11, n);
    // Owned: an error part way frees both on its way out.
    let b = d.allocate_owned(n as u64).map_err(error)?;
    let other = d.allocate_owned(n as u64).map_err(error)?;
    for pinned in [false, true] {
        let memory = if pinned { "pinned" } else { "pageable" };
        let mut run = |src: &mut [u8], dst: &mut [u8]| -> BenchResult<()> {
            for size in sweep_sizes(n) {
                progress.set_message(format!("sweep: {} {memory}", human(size)));
                let iters = (16usize << 20).div_ceil(size);
                let host = (&src[..size], &mut dst[..size]);
                let (up, down) =
                    up_down(d, baseline, (args.reps, args.single_order), *b, host, pinned, iters)?;
                let host = (&src[..size], &mut dst[..size]);
                let both = both_ways(d, baseline, args.reps, (*b, *other), host, pinned, iters)?;
                let bytes = size * iters;
                let case = |dir: &str| format!("sweep {dir} {memory} {}", human(size));
                rows.extend([
                    Row::from_times(case("H2D"), bytes, &up).sized(size),
                    Row::from_times(case("D2H"), bytes, &down).sized(size),
                    Row::from_times(case("both"), 2 * bytes, &both).sized(size),
                ]);
                progress.inc(1);
            }
            Ok(())
        };
        if pinned {
            with_pinned(d, &mut src, &mut dst, run)?;
        } else {
            run(&mut src, &mut dst)?;
        }
    }
    other.free().map_err(error)?;
    b.free().map_err(error)
}

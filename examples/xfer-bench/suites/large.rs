//! `--large` single copies, the default suite's: pageable and pinned, each way, and both
//! directions at once.

use cuda_resident::Device;

use crate::baselines::DriverBaseline;
use crate::cli::Args;
use crate::report::{Row, human};
use crate::single::{both_ways, up_down, with_pinned};
use crate::workload::host_pair;
use crate::{BenchResult, error};

/// `--large` single copies, pageable and pinned, each way; then both directions at once
/// (half up, half down) on the pinned memory.
pub(crate) fn run(
    d: &Device,
    baseline: &DriverBaseline,
    args: &Args,
    rows: &mut Vec<Row>,
) -> BenchResult<()> {
    let n = args.large;
    let (mut src, mut dst) = host_pair(77, n);
    // Owned: an error part way frees it on its way out.
    let b = d.allocate_owned(n as u64).map_err(error)?;
    let (up, down) = up_down(d, baseline, (args.reps, args.single_order), *b, (&src, &mut dst), false, 1)?;
    rows.push(Row::from_times(format!("H2D {} from pageable", human(n)), n, &up));
    rows.push(Row::from_times(format!("D2H {} into pageable", human(n)), n, &down));
    with_pinned(d, &mut src, &mut dst, |src, dst| {
        let (up, down) = up_down(d, baseline, (args.reps, args.single_order), *b, (src, dst), true, 1)?;
        rows.push(Row::from_times(format!("H2D {} pinned", human(n)), n, &up));
        rows.push(Row::from_times(format!("D2H {} pinned", human(n)), n, &down));
        let half = (n / 2).max(1);
        let other = d.allocate_owned(half as u64).map_err(error)?;
        let both =
            both_ways(d, baseline, args.reps, (*b, *other), (&src[..half], &mut dst[..half]), true, 1)?;
        other.free().map_err(error)?;
        rows.push(Row::from_times(format!("both directions, 2 x {} pinned", human(half)), 2 * half, &both));
        Ok(())
    })?;
    b.free().map_err(error)
}

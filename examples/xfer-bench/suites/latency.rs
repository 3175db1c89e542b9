//! The latency suite (and the default suite's 4 KiB upload): one copy, submit to done, by
//! each method in turn; the median and the 99th percentile.

use cuda_resident::Device;

use crate::baselines::DriverBaseline;
use crate::cli::Args;
use crate::report::{Row, human};
use crate::single::{Host, Single, with_pinned};
use crate::{BenchResult, error};

/// One copy, submit to done, of every size in `sizes`: H2D and D2H from pageable and pinned
/// memory, or (`upload_only`) H2D from pageable memory alone, the default suite's row.
/// Each gives two rows, the median and the 99th percentile per copy in µs, both with the
/// spread (fewest, median, most) of every copy timed.
pub(crate) fn run(
    d: &Device,
    baseline: &DriverBaseline,
    args: &Args,
    sizes: &[usize],
    upload_only: bool,
    rows: &mut Vec<Row>,
) -> BenchResult<()> {
    let memories: &[bool] = if upload_only { &[false] } else { &[false, true] };
    // Host memory in whole pages of its own (64 KiB, the largest common page), so that
    // registering it shares no page with other memory.
    const PAGE: usize = 1 << 16;
    let start = |v: &[u8]| v.as_ptr().align_offset(PAGE); // below PAGE for bytes
    for &size in sizes {
        let padded = size.next_multiple_of(PAGE);
        let (mut src_mem, mut dst_mem) = (vec![0u8; padded + PAGE], vec![0u8; padded + PAGE]);
        let (s, t) = (start(&src_mem), start(&dst_mem));
        let (src, dst) = (&mut src_mem[s..s + padded], &mut dst_mem[t..t + padded]);
        fastrand::Rng::with_seed(3).fill(&mut src[..size]);
        // Owned: an error part way frees it on its way out.
        let owned = d.allocate_owned(size as u64).map_err(error)?;
        let b = *owned;
        let mut measure = |src: &mut [u8], dst: &mut [u8], pinned: bool| -> BenchResult<()> {
            let mut found = vec![
                Single::new(d, baseline.stream, b, Host::Src(&*src), pinned, true)?.latencies(args.reps)?,
            ];
            if !upload_only {
                found.push(
                    Single::new(d, baseline.stream, b, Host::Dst(dst), pinned, true)?.latencies(args.reps)?,
                );
            }
            let memory = if pinned { "pinned" } else { "pageable" };
            for (dir, t) in ["H2D", "D2H"].into_iter().zip(found) {
                for (i, stat) in ["median", "p99"].into_iter().enumerate() {
                    rows.push(
                        Row::figures(
                            format!("latency {dir} {memory} {} {stat}", human(size)),
                            "µs",
                            Some(t.raw[i]),
                            t.batch.map(|b| b[i]),
                            t.ours[i],
                        )
                        .sized(size),
                    );
                }
            }
            Ok(())
        };
        memories.iter().try_for_each(|&pinned| {
            if pinned {
                with_pinned(d, src, dst, |src, dst| measure(&mut src[..size], &mut dst[..size], true))
            } else {
                measure(&mut src[..size], &mut dst[..size], false)
            }
        })?;
        owned.free().map_err(error)?;
    }
    Ok(())
}

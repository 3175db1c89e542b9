//! The alloc suite: allocating device memory and pinned memory against the raw driver
//! (the measurements are `cuda_resident_suite::alloc_bench`'s, shared with `alloc-bench`).

use cuda_resident::Device;
use cuda_resident_suite::alloc_bench::measure;

use crate::BenchResult;
use crate::report::Row;

/// Measures on up to 16 threads (one per core) and adds the rows, each with the spread of
/// its repetitions; prints the size classes' waste, which has no row.
pub(crate) fn run(d: &Device, rows: &mut Vec<Row>) -> BenchResult<()> {
    let threads = std::thread::available_parallelism().map_or(16, |n| n.get()).min(16);
    let r = measure(d, threads)?;
    let (s, ns) = (r.spreads, |case: String, raw, batch, ours| Row::new(case, "ns", raw, batch, ours));
    rows.push(ns(
        "allocate + free 1 MiB, 1 thread".into(),
        Some(s.raw_alloc),
        Some(s.raw_async),
        s.one_thread,
    ));
    rows.push(ns(format!("allocate + free 1 MiB, {threads} threads each"), None, None, s.many_threads));
    rows.push(ns("pinned staging 1 MiB acquire + return".into(), Some(s.raw_host), None, s.pinned));
    println!("size-class waste on 4000 buffers of uniform 1 B..4 MiB: {:.2} %", r.waste_percent);
    Ok(())
}

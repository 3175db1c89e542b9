//! The command line: the suites, the flags and what a bad flag prints, and cuda-resident's
//! `Config` as the flags set it.

use std::path::PathBuf;

use clap::Parser;

use crate::{BenchResult, error};

/// Which cases to run.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Suite {
    /// Many small copies (--counts, default 8192, x --sizes), `--large` single copies, both
    /// directions at once, one 4 KiB upload's latency (under a minute on an H200).
    Default,
    /// Many small copies over a grid: every --counts (default 1024,8192,65536) x every
    /// --sizes; a case of more than --max-case-mib is skipped, and the report says so (about
    /// 1 to 2 minutes on an H200, most of it the baselines' 65536-copy downloads).
    Grid,
    /// Single copies from 4 KiB to --large (x16 apart), pageable and pinned: H2D, D2H and
    /// both directions at once (well under a minute on an H200).
    Sweep,
    /// One copy, submit to done, of every --latency-sizes: H2D and D2H, pageable and pinned;
    /// median and 99th percentile in µs (about 10 seconds on an H200).
    Latency,
    /// Allocation: device memory and pinned memory against cuMemAlloc, cuMemAllocAsync (in
    /// the "batch API" column) and cuMemHostAlloc.
    Alloc,
    /// Copies between two GPUs, --device and the next ordinal: one `--large` copy, many small
    /// copies (--counts, default 8192, x --sizes; the 4 KiB ones also before peer access is
    /// enabled, staged through the host), both directions at once, and a `--large` fan-out
    /// from pageable memory to both GPUs by each path. Needs two GPUs.
    Peer,
    /// Everything: the grid, `--large` single copies, sweep, latency, allocation and, where
    /// there are two GPUs, peer (about 2 to 3 minutes on an H200, without peer).
    All,
}

/// Side-by-side transfer benchmarks: raw driver, cuMemcpyBatchAsync, cuda-resident.
#[derive(Parser, Debug)]
#[command(
    version,
    about = "Side-by-side transfer benchmarks: the raw CUDA driver, cuMemcpyBatchAsync and cuda-resident, in one run.",
    after_help = "Writes report.json (every row, the build's provenance, the device, skipped cases) and SVG plots into --out."
)]
pub(crate) struct Args {
    /// Which cases to run.
    #[arg(long, value_enum, default_value_t = Suite::Default)]
    pub(crate) suite: Suite,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    pub(crate) device: usize,
    /// Timed repetitions per case (median reported; at least 5).
    #[arg(long, default_value_t = 5)]
    pub(crate) reps: usize,
    /// Copies per many-small case, a comma list [default: 8192; 1024,8192,65536 for --suite
    /// grid and all].
    #[arg(long, alias = "count", value_delimiter = ',', value_parser = positive)]
    pub(crate) counts: Option<Vec<usize>>,
    /// Copy sizes of the many-small cases, in bytes.
    #[arg(long, value_delimiter = ',', value_parser = positive, default_value = "256,4096,65536")]
    pub(crate) sizes: Vec<usize>,
    /// Largest many-small case, count x size, in MiB; larger ones are skipped and listed.
    #[arg(long, value_parser = positive, default_value_t = 1024)]
    pub(crate) max_case_mib: usize,
    /// Copy sizes of the latency suite, in bytes (the default suite times 4 KiB uploads only).
    #[arg(long, value_delimiter = ',', value_parser = positive, default_value = "4,256,4096,65536")]
    pub(crate) latency_sizes: Vec<usize>,
    /// Bytes of the large single-copy cases, and the sweep's largest size.
    #[arg(long, value_parser = positive, default_value_t = 1 << 30)]
    pub(crate) large: usize,
    /// cuda-resident's staging chunk in KiB (Config::chunk_bytes; default: the library's).
    #[arg(long)]
    pub(crate) chunk_kib: Option<u64>,
    /// cuda-resident's direct-copy threshold in KiB (Config::direct_threshold).
    #[arg(long)]
    pub(crate) direct_kib: Option<u64>,
    /// cuda-resident's packing threads (Config::pack_threads; 0 = one per core, up to 16).
    #[arg(long)]
    pub(crate) pack_threads: Option<usize>,
    /// Microseconds cuda-resident's packing threads stay awake after packing
    /// (Config::pack_linger_us).
    #[arg(long)]
    pub(crate) pack_linger_us: Option<u64>,
    /// Move batches of small copies in order through device staging (a DMA and a scatter or
    /// gather) instead of by the kernel over the bus (Config::small_copies_over_bus = false).
    #[arg(long)]
    pub(crate) staged_small_copies: bool,
    /// Also print where the time of an upload batch goes (adding writes, submit, wait).
    #[arg(long)]
    pub(crate) breakdown: bool,
    /// Folder for the JSON report and the SVG plots.
    #[arg(long, default_value = "target/xfer-bench")]
    pub(crate) out: PathBuf,
}

/// A whole number of at least 1 (a count, a size in bytes, a limit).
fn positive(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("it must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err("expected a whole number, such as 4096".into()),
    }
}

/// A command-line error as one line that ends in a fix.
pub(crate) fn usage_line(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let parts: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .map(|l| l.strip_prefix("error: ").unwrap_or(l))
        .collect();
    format!(
        "{}. Fix: correct the flag; `xfer-bench --help` lists every flag and its values.",
        parts.join("; ")
    )
}

/// cuda-resident's configuration as the flags set it, checked before any device is opened.
pub(crate) fn config(args: &Args) -> BenchResult<cuda_resident::Config> {
    let mut config = cuda_resident::Config::default();
    if let Some(kib) = args.chunk_kib {
        config.chunk_bytes = kib << 10;
    }
    if let Some(kib) = args.direct_kib {
        config.direct_threshold = kib << 10;
    }
    if let Some(us) = args.pack_linger_us {
        config.pack_linger_us = us;
    }
    if let Some(threads) = args.pack_threads {
        config.pack_threads = threads;
    }
    config.small_copies_over_bus = !args.staged_small_copies;
    config.validate().map_err(error)?;
    Ok(config)
}

/// `flags` parsed as the command line of `xfer-bench`.
#[cfg(test)]
pub(crate) fn parse(flags: &[&str]) -> Result<Args, clap::Error> {
    Args::try_parse_from(std::iter::once("xfer-bench").chain(flags.iter().copied()))
}

#[cfg(test)]
mod tests {
    use super::{config, parse, usage_line};

    #[test]
    fn bad_flags_are_one_line_with_a_fix() {
        for flags in [
            &["--counts", "0"][..],
            &["--counts", "1024,0"],
            &["--sizes", "0"],
            &["--sizes", "4k"],
            &["--latency-sizes", ""],
            &["--suite", "fast"],
            &["--max-case-mib", "0"],
            &["--large", "-1"],
            &["--no-such-flag"],
        ] {
            let e = parse(flags).expect_err(&format!("{flags:?} should be refused"));
            let line = usage_line(&e);
            assert!(!line.contains('\n') && line.contains("Fix:"), "{flags:?}: {line}");
        }
        let e = parse(&["--suite", "fast"]).unwrap_err();
        assert!(usage_line(&e).contains("grid"), "names the suites");
    }

    #[test]
    fn config_flags_are_checked_before_any_device() {
        let args = parse(&["--chunk-kib", "0"]).unwrap();
        assert!(config(&args).is_err_and(|e| e.contains("Fix")));
        assert!(config(&parse(&[]).unwrap()).is_ok());
    }
}

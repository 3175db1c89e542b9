//! The command line: the suites, the flags and what a bad flag prints, and cuda-resident's
//! `Config` as the flags set it.

use std::path::PathBuf;

use clap::Parser;

use crate::{BenchResult, error, size};

/// How the single-copy cases (`--large`, `sweep`) order their timed repetitions.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SingleOrder {
    /// Each repetition runs every method in turn (the raw driver, the batch API,
    /// cuda-resident): the methods meet the same noise, and each starts after the others ran.
    Turns,
    /// All of one method's repetitions back to back, then the next method's: each run starts
    /// warm from the same method's run before it.
    Blocks,
}

/// Which cases to run.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Suite {
    /// Many small copies (--counts, default 8192, x --sizes), the same count scattered over a
    /// buffer each (each of --sizes, and mixed 64 B-256 KiB), `--large` single copies, both
    /// directions at once, one 4 KiB upload's latency (about a minute on an H200).
    Default,
    /// Many small copies over a grid: every --counts (default 1024,8192,65536) x every
    /// --sizes; a case of more than --max-case is skipped, and the report says so (about 1 to
    /// 2 minutes on an H200, most of it the baselines' 65536-copy downloads).
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
    /// An inference server's KV-cache swap: random blocks of each --paging-blocks size of a
    /// --paging-pool device buffer swapped out into a host cache, others swapped in from it,
    /// and both at once, --paging-bytes each way a step, with a pinned and with a pageable
    /// host cache. Needs --paging-pool of device memory and 2 x --paging-bytes each of
    /// pinned and of pageable host memory (8 GiB, 512 MiB and 512 MiB by default).
    Paging,
    /// Model weights: a synthetic safetensors checkpoint of --weights-size in Llama-3-8B's
    /// shapes (bf16, random bytes) loaded and saved: one cuMemcpyHtoD / cuMemcpyDtoH per
    /// tensor from / into the mapped file, cuMemcpyBatchAsync, and cuda-resident's
    /// load_safetensors / save_safetensors; from the page cache, and cold where the page
    /// cache can be dropped. Writes the file to --weights-file and leaves it there (for
    /// benches/weights_torch.py). Not part of `all`.
    Weights,
    /// Everything: the grid, `--large` single copies, sweep, latency, allocation, paging and,
    /// where there are two GPUs, peer (about 2 to 3 minutes on an H200 without paging and
    /// peer).
    All,
}

/// Side-by-side transfer benchmarks: raw driver, cuMemcpyBatchAsync, cuda-resident.
#[derive(Parser, Debug)]
#[command(
    version,
    about = "Side-by-side transfer benchmarks: the raw CUDA driver, cuMemcpyBatchAsync and cuda-resident, in one run.",
    after_help = "Sizes: bytes (4096) or a whole number of B, KiB, MiB or GiB (256B, 4KiB, 1MiB, 1GiB).\n\
Writes report.json (every row with each method's spread: the fewest, median and most of its \
repetitions, or of every copy timed in latency rows; the settings, the build's provenance, \
the host, the device, the start time, skipped cases) and SVG plots into --out.\n\n\
Exit status: 0 done; 1 a step failed (a CUDA call, writing the report); 2 a bad flag; \
3 no usable CUDA driver or GPU (or fewer GPUs than the suite needs); 4 a transfer's bytes \
did not verify."
)]
pub(crate) struct Args {
    /// Which cases to run.
    #[arg(long, value_enum, default_value_t = Suite::Default)]
    pub(crate) suite: Suite,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    pub(crate) device: usize,
    /// Timed repetitions per case (median reported; at least 5: fewer are refused).
    #[arg(long, default_value_t = MIN_REPS, value_parser = reps)]
    pub(crate) reps: usize,
    /// Copies per many-small case, a comma list [default: 8192; 1024,8192,65536 for --suite
    /// grid and all].
    #[arg(long, alias = "count", value_delimiter = ',', value_parser = positive)]
    pub(crate) counts: Option<Vec<usize>>,
    /// Copy sizes of the many-small cases, a comma list of sizes.
    #[arg(long, value_delimiter = ',', value_parser = size::positive, default_value = "256,4KiB,64KiB")]
    pub(crate) sizes: Vec<usize>,
    /// Largest many-small case, count x size, a size; larger ones are skipped and listed.
    #[arg(long, value_parser = size::positive, default_value = "1GiB", conflicts_with = "max_case_mib")]
    pub(crate) max_case: usize,
    /// The largest many-small case in MiB (deprecated: --max-case <N>MiB is the same).
    #[arg(long, hide = true, value_parser = positive)]
    pub(crate) max_case_mib: Option<usize>,
    /// Copy sizes of the latency suite, a comma list of sizes (the default suite times 4 KiB
    /// uploads only).
    #[arg(long, value_delimiter = ',', value_parser = size::positive, default_value = "4,256,4KiB,64KiB")]
    pub(crate) latency_sizes: Vec<usize>,
    /// Size of the large single-copy cases, and the sweep's largest size.
    #[arg(long, value_parser = size::positive, default_value = "1GiB")]
    pub(crate) large: usize,
    /// The paging suite's device pool, a size; where the device cannot hold it, as much as
    /// it can (the rows say so).
    #[arg(long, value_parser = size::positive, default_value = "8GiB")]
    pub(crate) paging_pool: usize,
    /// Bytes a paging step moves each way, a size; the host cache holds twice this (an out
    /// and an in region), once pinned and once pageable. Raises cuda-resident's pinned cap
    /// (Config::pinned_cap_bytes) where the cache and a swap-out's views need more.
    #[arg(long, value_parser = size::positive, default_value = "256MiB")]
    pub(crate) paging_bytes: usize,
    /// Block sizes of the paging suite, a comma list of sizes, each at most --paging-bytes.
    #[arg(long, value_delimiter = ',', value_parser = size::positive, default_value = "16KiB,256KiB,2MiB")]
    pub(crate) paging_blocks: Vec<usize>,
    /// Batches each direction of cuda-resident's paging swap is submitted in, one after the
    /// other in one scope (the blocks split evenly, in swap order): the first moves while the
    /// next is built.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub(crate) paging_batches: u32,
    /// Size of the weights suite's synthetic checkpoint, a size (whole layers of Llama-3-8B
    /// that fit it, at least one).
    #[arg(long, value_parser = size::positive, default_value = "4GiB")]
    pub(crate) weights_size: usize,
    /// Where the weights suite writes its checkpoint [default: weights.safetensors in --out].
    #[arg(long)]
    pub(crate) weights_file: Option<PathBuf>,
    /// Bytes of each batch of cuda-resident's weights loads and saves, a size
    /// (LoadOptions::batch_bytes; default: the library's).
    #[arg(long, value_parser = size::positive)]
    pub(crate) weights_batch: Option<usize>,
    /// The weights suite's loads from the page cache only (no arena, registered, cold or
    /// save rows; the file is not synced to disk).
    #[arg(long, conflicts_with = "weights_saves_only")]
    pub(crate) weights_loads_only: bool,
    /// The weights suite's sharded save (and the load of what it wrote) only: no one-file,
    /// arena, registered or cold rows; the file is not synced to disk.
    #[arg(long)]
    pub(crate) weights_saves_only: bool,
    /// Shards of the weights suite's sharded save and load (SaveOptions::shards): one
    /// thread and one file each.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub(crate) weights_shards: u32,
    /// cuda-resident's staging chunk, a size (Config::chunk_bytes; default: the library's).
    #[arg(long, value_parser = size::parse, conflicts_with = "chunk_kib")]
    pub(crate) chunk: Option<u64>,
    /// The staging chunk in KiB (the same as --chunk <N>KiB).
    #[arg(long, hide = true)]
    pub(crate) chunk_kib: Option<u64>,
    /// cuda-resident's direct-copy threshold, a size (Config::direct_threshold).
    #[arg(long, value_parser = size::parse, conflicts_with = "direct_kib")]
    pub(crate) direct: Option<u64>,
    /// The direct-copy threshold in KiB (the same as --direct <N>KiB).
    #[arg(long, hide = true)]
    pub(crate) direct_kib: Option<u64>,
    /// cuda-resident's packing threads (Config::pack_threads; 0 = one per core but one, up to 16).
    #[arg(long)]
    pub(crate) pack_threads: Option<usize>,
    /// Microseconds cuda-resident's packing threads stay awake after packing
    /// (Config::pack_linger_us).
    #[arg(long)]
    pub(crate) pack_linger_us: Option<u64>,
    /// How the single-copy cases order their timed repetitions.
    #[arg(long, value_enum, default_value_t = SingleOrder::Turns)]
    pub(crate) single_order: SingleOrder,
    /// Move batches of small copies in order through device staging (a DMA and a scatter or
    /// gather) instead of by the kernel over the bus (Config::small_copies_over_bus = false).
    #[arg(long)]
    pub(crate) staged_small_copies: bool,
    /// Make pinned staging by `cuMemHostAlloc` rather than of huge pages
    /// (Config::pinned_huge_pages = false).
    #[arg(long)]
    pub(crate) no_huge_pages: bool,
    /// Hand a scoped batch's DMAs to the driver one call each, and move ranges of 2 MiB and
    /// more through device staging where they follow each other, rather than in one
    /// `cuMemcpyBatchAsync` (Config::dma_batches = false).
    #[arg(long)]
    pub(crate) no_dma_batches: bool,
    /// Also print, on stderr, where the time of a batch goes (adding requests, submit,
    /// waiting), for the many-small and the scattered cases, each way, and for the paging
    /// suite's swaps (each direction's times from the start, for "both" too).
    #[arg(long)]
    pub(crate) breakdown: bool,
    /// How the table is printed: aligned text, or a Markdown table.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub(crate) format: Format,
    /// Folder for the JSON report and the SVG plots.
    #[arg(long, default_value = "target/xfer-bench")]
    pub(crate) out: PathBuf,
}

/// How the table is printed.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Format {
    /// Aligned columns.
    Text,
    /// A Markdown table (for a pull request or an issue).
    Markdown,
}

impl Args {
    /// The largest many-small case in bytes: `--max-case`, or the deprecated `--max-case-mib`.
    pub(crate) fn max_case_bytes(&self) -> usize {
        self.max_case_mib.map_or(self.max_case, |mib| mib.saturating_mul(1 << 20))
    }

    /// Whether the paging suite runs.
    pub(crate) fn runs_paging(&self) -> bool {
        matches!(self.suite, Suite::Paging | Suite::All)
    }

    /// A line for each deprecated flag given, naming what replaces it.
    pub(crate) fn deprecations(&self) -> Vec<String> {
        let mut lines = Vec::new();
        if let Some(mib) = self.max_case_mib {
            lines.push(format!(
                "--max-case-mib is deprecated; it still works for now: use --max-case {mib}MiB"
            ));
        }
        lines
    }
}

/// The fewest timed repetitions: a median of fewer is noise.
pub(crate) const MIN_REPS: usize = 5;

/// `--reps`: at least [`MIN_REPS`].
fn reps(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n >= MIN_REPS => Ok(n),
        Ok(_) => Err(format!("it must be at least {MIN_REPS}: the median of fewer repetitions is noise")),
        Err(_) => Err(format!("expected a whole number of at least {MIN_REPS}")),
    }
}

/// A whole number of at least 1 (a count, a limit).
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

/// The paging flags checked against each other: a step moves at least one block each way,
/// and the pool holds the blocks swapped out and those swapped in.
fn check_paging(args: &Args) -> BenchResult<()> {
    let bytes = args.paging_bytes;
    if let Some(&block) = args.paging_blocks.iter().find(|&&block| block > bytes) {
        return Err(format!(
            "--paging-blocks {} is larger than --paging-bytes {}: a step moves at least one block \
             each way. Fix: pass blocks of at most --paging-bytes, or raise it.",
            size::human(block),
            size::human(bytes)
        ));
    }
    if bytes.checked_mul(2).is_none_or(|both| both > args.paging_pool) {
        return Err(format!(
            "--paging-pool {} cannot hold the blocks swapped out and those swapped in, \
             2 x --paging-bytes {}. Fix: raise --paging-pool or lower --paging-bytes.",
            size::human(args.paging_pool),
            size::human(bytes)
        ));
    }
    Ok(())
}

/// The pinned cap the paging suite needs: its pinned host cache (2 x `--paging-bytes`) and
/// the views of a swap-out's download (`--paging-bytes`) held at once, a sixteenth more for
/// the pool's rounding of its arenas, and the reserve the pool keeps for transfers (at most
/// 8 chunks of `chunk_bytes`); in whole MiB.
pub(crate) fn paging_pinned_cap(args: &Args, chunk_bytes: u64) -> u64 {
    let held = (args.paging_bytes as u64).saturating_mul(3);
    let cap = held.saturating_add(held / 16).saturating_add(chunk_bytes.saturating_mul(8));
    cap.checked_next_multiple_of(1 << 20).unwrap_or(cap)
}

/// cuda-resident's configuration as the flags set it, checked before any device is opened.
pub(crate) fn config(args: &Args) -> BenchResult<cuda_resident::Config> {
    check_paging(args)?;
    let mut config = cuda_resident::Config::default();
    let kib = |flag: &str, kib: u64| {
        kib.checked_mul(1 << 10)
            .ok_or_else(|| format!("--{flag} {kib} is too large. Fix: pass a smaller size."))
    };
    if let Some(bytes) = args.chunk {
        config.chunk_bytes = bytes;
    } else if let Some(n) = args.chunk_kib {
        config.chunk_bytes = kib("chunk-kib", n)?;
    }
    if let Some(bytes) = args.direct {
        config.direct_threshold = bytes;
    } else if let Some(n) = args.direct_kib {
        config.direct_threshold = kib("direct-kib", n)?;
    }
    if let Some(us) = args.pack_linger_us {
        config.pack_linger_us = us;
    }
    if let Some(threads) = args.pack_threads {
        config.pack_threads = threads;
    }
    config.small_copies_over_bus = !args.staged_small_copies;
    config.pinned_huge_pages = !args.no_huge_pages;
    config.dma_batches = !args.no_dma_batches;
    if args.runs_paging() {
        let cap = paging_pinned_cap(args, config.chunk_bytes);
        if cap > config.pinned_cap_bytes {
            config = config.with_pinned_cap_bytes(cap);
        }
    }
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
            &["--max-case", "0"],
            &["--max-case", "4GB"],
            &["--max-case", "1GiB", "--max-case-mib", "1024"],
            &["--large", "-1"],
            &["--paging-blocks", "16KiB,0"],
            &["--paging-bytes", "1.5GiB"],
            &["--paging-pool", ""],
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

    #[test]
    fn sizes_take_units_and_a_bad_one_names_the_flag_and_the_forms() {
        let args =
            parse(&["--sizes", "256,4KiB,1MiB", "--large", "1GiB", "--latency-sizes", "4,4096"]).unwrap();
        assert_eq!(args.sizes, [256, 4096, 1 << 20]);
        assert_eq!((args.large, &args.latency_sizes[..]), (1 << 30, &[4, 4096][..]));
        assert_eq!(parse(&["--large", "1073741824"]).unwrap().large, 1 << 30);
        let line = usage_line(&parse(&["--large", "1GB"]).unwrap_err());
        assert!(line.contains("--large") && line.contains("KiB, MiB or GiB"), "{line}");
        let c = config(&parse(&["--chunk", "4MiB", "--direct", "128KiB"]).unwrap()).unwrap();
        assert_eq!((c.chunk_bytes, c.direct_threshold), (4 << 20, 128 << 10));
        let c = config(&parse(&["--chunk-kib", "4096", "--direct-kib", "128"]).unwrap()).unwrap();
        assert_eq!((c.chunk_bytes, c.direct_threshold), (4 << 20, 128 << 10), "the KiB spellings");
        assert!(parse(&["--chunk", "4MiB", "--chunk-kib", "4096"]).is_err(), "one or the other");
    }

    #[test]
    fn max_case_takes_a_size_and_the_mib_spelling_still_works() {
        let default = parse(&[]).unwrap();
        assert_eq!((default.max_case_bytes(), default.deprecations().len()), (1 << 30, 0));
        assert_eq!(parse(&["--max-case", "4GiB"]).unwrap().max_case_bytes(), 4 << 30);
        assert_eq!(parse(&["--max-case", "65536"]).unwrap().max_case_bytes(), 65536, "plain bytes");
        let old = parse(&["--max-case-mib", "4096"]).unwrap();
        assert_eq!(old.max_case_bytes(), 4 << 30);
        assert_eq!(
            old.deprecations(),
            ["--max-case-mib is deprecated; it still works for now: use --max-case 4096MiB"]
        );
        let line = usage_line(&parse(&["--max-case", "1GiB", "--max-case-mib", "1024"]).unwrap_err());
        assert!(line.contains("--max-case") && line.contains("Fix:"), "one or the other: {line}");
        let line = usage_line(&parse(&["--max-case", "4GB"]).unwrap_err());
        assert!(line.contains("--max-case") && line.contains("KiB, MiB or GiB"), "{line}");
    }

    #[test]
    fn paging_flags_take_sizes_and_are_checked_against_each_other() {
        let default = parse(&[]).unwrap();
        assert_eq!((default.paging_pool, default.paging_bytes), (8 << 30, 256 << 20));
        assert_eq!(default.paging_blocks, [16 << 10, 256 << 10, 2 << 20]);
        let args =
            parse(&["--paging-pool", "1GiB", "--paging-bytes", "64MiB", "--paging-blocks", "4KiB,1MiB"])
                .unwrap();
        assert_eq!(
            (args.paging_pool, args.paging_bytes, &args.paging_blocks[..]),
            (1 << 30, 64 << 20, &[4096, 1 << 20][..])
        );
        assert!(config(&args).is_ok());
        let refused = |flags: &[&str], says: &str| {
            let line = config(&parse(flags).unwrap()).expect_err(&format!("{flags:?}"));
            assert!(line.contains(says) && line.contains("Fix:") && !line.contains('\n'), "{line}");
        };
        refused(
            &["--paging-bytes", "1MiB", "--paging-blocks", "16KiB,2MiB"],
            "--paging-blocks 2 MiB is larger",
        );
        refused(&["--paging-pool", "1GiB", "--paging-bytes", "768MiB"], "--paging-pool 1 GiB cannot hold");
        assert!(config(&parse(&["--paging-pool", "512MiB", "--paging-bytes", "256MiB"]).unwrap()).is_ok());
    }

    #[test]
    fn the_paging_suite_raises_the_pinned_cap_only_where_it_needs_more() {
        let cap = |flags: &[&str]| config(&parse(flags).unwrap()).unwrap().pinned_cap_bytes;
        let default_cap = cuda_resident::Config::default().pinned_cap_bytes;
        // 3 x 256 MiB held, a sixteenth more, 8 x 16 MiB: 944 MiB, under the default 1 GiB.
        assert_eq!(cap(&["--suite", "paging"]), default_cap);
        assert_eq!(cap(&["--paging-bytes", "1GiB"]), default_cap, "only where the suite runs");
        let raised = (3u64 << 30) + (3 << 30) / 16 + (8 << 24);
        assert_eq!(cap(&["--suite", "paging", "--paging-bytes", "1GiB"]), raised);
        assert_eq!(cap(&["--suite", "all", "--paging-bytes", "1GiB"]), raised);
        let odd = cap(&["--suite", "paging", "--paging-bytes", "300MiB", "--paging-blocks", "4KiB"]);
        assert!(odd % (1 << 20) == 0 && odd >= 900 << 20, "whole MiB: {odd}");
    }

    #[test]
    fn too_few_reps_are_refused_not_raised() {
        let line = usage_line(&parse(&["--reps", "2"]).unwrap_err());
        assert!(line.contains("--reps") && line.contains("at least 5") && line.contains("Fix:"), "{line}");
        assert_eq!(parse(&["--reps", "5"]).unwrap().reps, 5);
        assert_eq!(parse(&[]).unwrap().reps, 5);
    }

    #[test]
    fn paging_batches_are_one_unless_asked_and_never_zero() {
        assert_eq!(parse(&[]).unwrap().paging_batches, 1);
        assert_eq!(parse(&["--paging-batches", "16"]).unwrap().paging_batches, 16);
        let line = usage_line(&parse(&["--paging-batches", "0"]).unwrap_err());
        assert!(line.contains("--paging-batches") && line.contains("Fix:"), "{line}");
    }
}

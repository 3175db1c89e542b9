//! xfer-bench: the transfer benchmark, the project's main job.
//!
//! Every case runs, in the same process, the raw driver with one call per copy,
//! `cuMemcpyBatchAsync` where the driver has it, and cuda-resident; rows give GB/s (or µs)
//! and cuda-resident's ratio to each. Timing: one warm-up, then `--reps` repetitions timed
//! on the host around work that ends in a synchronize, median reported. Data is random;
//! every cuda-resident transfer that is timed is verified byte for byte afterwards, and a
//! mismatch fails the run.
//!
//! A failure ends the run with one line that says what went wrong and how to fix it, and a
//! status that tells the kind: [`exit`].
//!
//! Where things live: the flags in [`cli`], the clocks in [`timing`], the raw driver's side
//! in [`baselines`], one copy by each method in [`single`], the data of many-small cases in
//! [`workload`], the cases of each suite under [`suites`], the table and the JSON report in
//! [`report`], the SVG charts in [`plot`], sizes with units in [`size`].

mod baselines;
mod cli;
mod plot;
mod report;
mod single;
mod size;
mod suites;
mod timing;
mod workload;

use std::process::ExitCode;
use std::sync::atomic::{AtomicU8, Ordering};

use clap::Parser;

use cli::Args;
use suites::SuitePlan;

/// What a failed step says, one line.
type BenchResult<T> = Result<T, String>;

/// The exit statuses, also listed by `--help`.
pub(crate) mod exit {
    /// A step failed: a CUDA call, writing the report.
    pub(crate) const FAILED: u8 = 1;
    /// A bad flag (clap's status for usage errors).
    pub(crate) const USAGE: u8 = 2;
    /// No usable CUDA driver or GPU, or fewer GPUs than the suite needs.
    pub(crate) const NO_GPU: u8 = 3;
    /// A transfer's bytes did not verify.
    pub(crate) const MISMATCH: u8 = 4;
}

/// The status of the failure the run ends with, where a step said which kind it is
/// ([`no_gpu`], [`mismatch`]); 0 where none did.
static FAILURE: AtomicU8 = AtomicU8::new(0);

/// `line`, marked as a missing driver or GPU: the run exits with [`exit::NO_GPU`].
pub(crate) fn no_gpu(line: String) -> String {
    FAILURE.store(exit::NO_GPU, Ordering::Relaxed);
    line
}

/// `line`, marked as bytes that did not verify: the run exits with [`exit::MISMATCH`].
pub(crate) fn mismatch(line: String) -> String {
    FAILURE.store(exit::MISMATCH, Ordering::Relaxed);
    line
}

/// Prints the line a failed run ends with and gives its status.
fn failed(line: &str) -> ExitCode {
    eprintln!("xfer-bench: {line}");
    match FAILURE.load(Ordering::Relaxed) {
        0 => ExitCode::from(exit::FAILED),
        code => ExitCode::from(code),
    }
}

/// A cuda-resident error as the line the run ends with.
fn error(e: cuda_resident::Error) -> String {
    e.to_string()
}

fn main() -> ExitCode {
    let started = std::time::SystemTime::now();
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) if !e.use_stderr() => e.exit(), // --help, --version
        Err(e) => {
            eprintln!("xfer-bench: {}", cli::usage_line(&e));
            return ExitCode::from(exit::USAGE);
        }
    };
    for line in args.deprecations() {
        eprintln!("xfer-bench: {line}");
    }
    let config = match cli::config(&args) {
        Ok(config) => config,
        Err(line) => {
            eprintln!("xfer-bench: {line}");
            return ExitCode::from(exit::USAGE);
        }
    };
    let mut plan = SuitePlan::new(&args);
    let (rows, device, resolved) = match suites::run(&args, &mut plan, config) {
        Ok(done) => done,
        Err(line) => return failed(&line),
    };
    report::print_table(&rows, args.format);
    let run = report::Run { args: &args, plan: &plan, started, config: &resolved };
    match report::write(&run, &rows, device) {
        Ok(()) => ExitCode::SUCCESS,
        Err(line) => failed(&line),
    }
}

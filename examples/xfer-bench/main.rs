//! xfer-bench: the transfer benchmark, the project's main job.
//!
//! Every case runs, in the same process, the raw driver with one call per copy,
//! `cuMemcpyBatchAsync` where the driver has it, and cuda-resident; rows give GB/s (or µs)
//! and cuda-resident's ratio to each. Timing: one warm-up, then `--reps` repetitions timed
//! on the host around work that ends in a synchronize, median reported. Data is random;
//! every cuda-resident transfer that is timed is verified byte for byte afterwards, and a
//! mismatch fails the run.
//!
//! Without a usable driver or GPU it exits with status 2 and one line that says what is
//! missing and how to fix it; so does a bad flag.
//!
//! Where things live: the flags in [`cli`], the clocks in [`timing`], the raw driver's side
//! in [`baselines`], one copy by each method in [`single`], the data of many-small cases in
//! [`workload`], the cases of each suite under [`suites`], the table and the JSON report in
//! [`report`], the SVG charts in [`plot`].

mod baselines;
mod cli;
mod plot;
mod report;
mod single;
mod suites;
mod timing;
mod workload;

use std::process::ExitCode;

use clap::Parser;

use cli::Args;
use suites::SuitePlan;

/// What a failed step says, one line.
type BenchResult<T> = Result<T, String>;

/// A cuda-resident error as the line the run ends with.
fn error(e: cuda_resident::Error) -> String {
    e.to_string()
}

fn main() -> ExitCode {
    let mut args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) if !e.use_stderr() => e.exit(), // --help, --version
        Err(e) => {
            eprintln!("xfer-bench: {}", cli::usage_line(&e));
            return ExitCode::from(2);
        }
    };
    args.reps = args.reps.max(5);
    let mut plan = SuitePlan::new(&args);
    let outcome = cli::config(&args).and_then(|config| suites::run(&args, &mut plan, config));
    let (rows, device) = match outcome {
        Ok(done) => done,
        Err(message) => {
            eprintln!("xfer-bench: {message}");
            return ExitCode::from(2);
        }
    };
    report::print_table(&rows);
    match report::write(&args, &plan, &rows, device) {
        Ok(()) => ExitCode::SUCCESS,
        Err(line) => {
            eprintln!("xfer-bench: {line}");
            ExitCode::from(2)
        }
    }
}

//! alloc-bench: what allocating device memory and pinned memory costs, against the raw
//! driver, in one run (see `cuda_resident_suite::alloc_bench` for what is measured).
//!
//! `cargo run --release --example alloc-bench [-- --threads N]`

use std::process::ExitCode;

use cuda_resident::Device;
use cuda_resident_suite::PROVENANCE;
use cuda_resident_suite::alloc_bench::measure;

fn main() -> ExitCode {
    let threads: usize =
        std::env::args().skip_while(|a| a != "--threads").nth(1).and_then(|v| v.parse().ok()).unwrap_or(16);
    let report = Device::open(0).map_err(|e| e.to_string()).and_then(|device| {
        println!("alloc-bench | {PROVENANCE}");
        println!("device: {} | driver CUDA {}", device.info().name, device.info().driver_version);
        measure(&device, threads)
    });
    let r = match report {
        Ok(r) => r,
        Err(message) => {
            eprintln!("alloc-bench: {message}");
            return ExitCode::from(2);
        }
    };
    let row = |what: &str, ns: f64| println!("{what:<52} {ns:>9.1} ns");
    println!("{:<52} {:>12}", "case (1 MiB unless said)", "median");
    row("cuda-resident allocate + free, 1 thread", r.one_thread_ns);
    row(&format!("cuda-resident allocate + free, {threads} threads at once"), r.many_threads_ns);
    row(&format!("  the slowest of the {threads} threads"), r.slowest_thread_ns);
    row("cuda-resident pinned staging acquire + return", r.pinned_ns);
    row("raw cuMemAlloc + cuMemFree", r.raw_alloc_ns);
    row("raw cuMemAllocAsync + cuMemFreeAsync", r.raw_async_ns);
    row("raw cuMemHostAlloc + cuMemFreeHost", r.raw_host_ns);
    println!("{:<52} {:>9.2} %", "size-class waste, 4000 x uniform 1 B..4 MiB", r.waste_percent);
    println!(
        "ratios: 1 thread {:.0}x faster than cuMemAlloc+cuMemFree, {:.1}x than cuMemAllocAsync; pinned {:.0}x faster than cuMemHostAlloc",
        r.raw_alloc_ns / r.one_thread_ns,
        r.raw_async_ns / r.one_thread_ns,
        r.raw_host_ns / r.pinned_ns
    );
    ExitCode::SUCCESS
}

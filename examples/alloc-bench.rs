//! alloc-bench: what allocating device memory and pinned staging costs, against the raw
//! driver, in one run.
//!
//! Measures, warm, medians of 7 repetitions:
//! - `Device::allocate` + `Device::free` of 1 MiB, one thread, and 16 threads at once (time
//!   per pair as each thread sees it);
//! - `Device::pinned` of 1 MiB (acquire + return to the pool);
//! - the raw driver: `cuMemAlloc` + `cuMemFree`, `cuMemAllocAsync` + `cuMemFreeAsync` (with a
//!   stream synchronize every 1000 pairs), `cuMemHostAlloc` + `cuMemFreeHost`;
//! - the size classes' internal waste on 4000 buffers of uniform random size, 1 B to 4 MiB.
//!
//! `cargo run --release --example alloc-bench [-- --threads N]`

use std::process::ExitCode;
use std::sync::{Arc, Barrier};
use std::time::Instant;

use cuda_resident::cuda_sys::{self, CUDA_SUCCESS, call};
use cuda_resident::{Device, MAX_CLASS_BYTES};
use cuda_resident_suite::PROVENANCE;

const MIB: u64 = 1 << 20;
const REPS: usize = 7;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median over repetitions of nanoseconds per iteration of `f` run `n` times.
fn time_ns(n: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..n.min(1000) {
        f();
    }
    median(
        (0..REPS)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..n {
                    f();
                }
                t.elapsed().as_nanos() as f64 / n as f64
            })
            .collect(),
    )
}

fn check(code: Result<cuda_sys::CUresult, cuda_sys::MissingSymbol>, what: &str) {
    match code {
        Ok(CUDA_SUCCESS) => {}
        other => panic!("{what} failed: {other:?}"),
    }
}

fn main() -> ExitCode {
    let threads: usize =
        std::env::args().skip_while(|a| a != "--threads").nth(1).and_then(|v| v.parse().ok()).unwrap_or(16);
    let device = match Device::open(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("alloc-bench: {e}");
            return ExitCode::from(2);
        }
    };
    println!("alloc-bench | {PROVENANCE}");
    println!("device: {} | driver CUDA {}", device.info().name, device.info().driver_version);
    println!("{:<52} {:>12}", "case (1 MiB unless said)", "median");

    // cuda-resident, one thread.
    let one = time_ns(200_000, || {
        let b = device.allocate(MIB).unwrap();
        device.free(b).unwrap();
    });
    println!("{:<52} {:>9.1} ns", "cuda-resident allocate + free, 1 thread", one);

    // cuda-resident, N threads at once: each thread's time per pair.
    let per_thread: Vec<f64> = (0..REPS)
        .map(|_| {
            let barrier = Arc::new(Barrier::new(threads));
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    let (d, barrier) = (device.clone(), Arc::clone(&barrier));
                    std::thread::spawn(move || {
                        for _ in 0..1000 {
                            d.free(d.allocate(MIB).unwrap()).unwrap();
                        }
                        barrier.wait();
                        const N: usize = 100_000;
                        let t = Instant::now();
                        for _ in 0..N {
                            let b = d.allocate(MIB).unwrap();
                            d.free(b).unwrap();
                        }
                        t.elapsed().as_nanos() as f64 / N as f64
                    })
                })
                .collect();
            let times: Vec<f64> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            median(times)
        })
        .collect();
    println!(
        "{:<52} {:>9.1} ns",
        format!("cuda-resident allocate + free, {threads} threads at once"),
        median(per_thread)
    );

    let pinned = time_ns(200_000, || drop(device.pinned(MIB as usize).unwrap()));
    println!("{:<52} {:>9.1} ns", "cuda-resident pinned staging acquire + return", pinned);

    // Raw driver baselines.
    let driver = Arc::clone(device.driver());
    device.make_current().unwrap();
    let raw_alloc = time_ns(2000, || {
        let mut p = 0;
        // SAFETY: allocates and frees 1 MiB on the current context.
        unsafe {
            check(call!(driver, cuMemAlloc_v2(&mut p, MIB as usize)), "cuMemAlloc");
            check(call!(driver, cuMemFree_v2(p)), "cuMemFree");
        }
    });
    println!("{:<52} {:>9.1} ns", "raw cuMemAlloc + cuMemFree", raw_alloc);

    let mut stream: cuda_sys::CUstream = std::ptr::null_mut();
    // SAFETY: creates a stream on the current context.
    check(
        unsafe { call!(driver, cuStreamCreate(&mut stream, cuda_sys::CU_STREAM_NON_BLOCKING)) },
        "cuStreamCreate",
    );
    let mut i = 0u64;
    let raw_async = time_ns(20_000, || {
        let mut p = 0;
        // SAFETY: stream-ordered allocate and free of 1 MiB on a live stream.
        unsafe {
            check(call!(driver, cuMemAllocAsync(&mut p, MIB as usize, stream)), "cuMemAllocAsync");
            check(call!(driver, cuMemFreeAsync(p, stream)), "cuMemFreeAsync");
            i += 1;
            if i.is_multiple_of(1000) {
                check(call!(driver, cuStreamSynchronize(stream)), "cuStreamSynchronize");
            }
        }
    });
    println!("{:<52} {:>9.1} ns", "raw cuMemAllocAsync + cuMemFreeAsync", raw_async);
    // SAFETY: the stream is idle after a synchronize and destroyed once.
    unsafe {
        check(call!(driver, cuStreamSynchronize(stream)), "cuStreamSynchronize");
        check(call!(driver, cuStreamDestroy_v2(stream)), "cuStreamDestroy");
    }

    let raw_host = time_ns(50, || {
        let mut p = std::ptr::null_mut();
        // SAFETY: allocates and frees 1 MiB of pinned host memory.
        unsafe {
            check(
                call!(driver, cuMemHostAlloc(&mut p, MIB as usize, cuda_sys::CU_MEMHOSTALLOC_PORTABLE)),
                "cuMemHostAlloc",
            );
            check(call!(driver, cuMemFreeHost(p)), "cuMemFreeHost");
        }
    });
    println!("{:<52} {:>9.1} ns", "raw cuMemHostAlloc + cuMemFreeHost", raw_host);

    // Internal waste of the size classes on a real device.
    let mut rng = fastrand::Rng::with_seed(42);
    let before = device.telemetry().memory;
    let buffers: Vec<_> = (0..4000).map(|_| device.allocate(rng.u64(1..=MAX_CLASS_BYTES)).unwrap()).collect();
    let during = device.telemetry().memory;
    let requested = during.allocated_bytes - before.allocated_bytes;
    let footprint = during.footprint_bytes - before.footprint_bytes;
    println!(
        "{:<52} {:>9.2} %",
        "size-class waste, 4000 x uniform 1 B..4 MiB",
        100.0 * (footprint - requested) as f64 / requested as f64
    );
    for b in buffers {
        device.free(b).unwrap();
    }
    println!(
        "ratios: 1 thread {:.0}x faster than cuMemAlloc+cuMemFree, {:.1}x than cuMemAllocAsync; pinned {:.0}x faster than cuMemHostAlloc",
        raw_alloc / one,
        raw_async / one,
        raw_host / pinned
    );
    ExitCode::SUCCESS
}

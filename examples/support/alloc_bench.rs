//! What allocating device memory and pinned memory costs, against the raw driver: the
//! measurements behind `alloc-bench` and `xfer-bench --suite alloc`.
//!
//! Warm, medians (and spreads) of 7 repetitions, 1 MiB unless said: `Device::allocate` +
//! `Device::free` on one thread and on N threads at once (time per pair as each thread sees it:
//! the median thread and the slowest; each thread allocates in a shard of its own, so a
//! shared cache line written on that path shows as the N-thread figure growing with N);
//! `Device::pinned` acquire + return; the raw driver's `cuMemAlloc` + `cuMemFree`,
//! `cuMemAllocAsync` + `cuMemFreeAsync` (a stream synchronize every 1000 pairs) and
//! `cuMemHostAlloc` + `cuMemFreeHost`; and the size classes' internal waste on 4000 buffers of
//! uniform random size, 1 B to 4 MiB.

use std::sync::{Arc, Barrier};
use std::time::Instant;

use cuda_resident::cuda_sys::{self, CUDA_SUCCESS, CUresult, MissingSymbol, call};
use cuda_resident::{Device, MAX_CLASS_BYTES};

use crate::Spread;

const MIB: u64 = 1 << 20;
const REPS: usize = 7;

/// The measurements, in nanoseconds per pair (waste in percent): the medians, and in
/// [`AllocReport::spreads`] the spread of the repetitions behind each.
#[derive(Clone, Copy, Debug)]
pub struct AllocReport {
    /// Threads of the concurrent case.
    pub threads: usize,
    /// `allocate` + `free`, one thread.
    pub one_thread_ns: f64,
    /// `allocate` + `free`, `threads` threads at once, per thread: the median thread.
    pub many_threads_ns: f64,
    /// The same, the slowest thread.
    pub slowest_thread_ns: f64,
    /// `pinned` acquire + return.
    pub pinned_ns: f64,
    /// `cuMemAlloc` + `cuMemFree`.
    pub raw_alloc_ns: f64,
    /// `cuMemAllocAsync` + `cuMemFreeAsync`.
    pub raw_async_ns: f64,
    /// `cuMemHostAlloc` + `cuMemFreeHost`.
    pub raw_host_ns: f64,
    /// Internal waste of the size classes, percent of the bytes requested.
    pub waste_percent: f64,
    /// The fewest, median and most nanoseconds per pair over the repetitions of each
    /// measurement above (the medians are the `*_ns` fields).
    pub spreads: AllocSpreads,
}

/// The spread of the repetitions of each timed measurement of an [`AllocReport`], in
/// nanoseconds per pair.
#[derive(Clone, Copy, Debug)]
pub struct AllocSpreads {
    /// `allocate` + `free`, one thread.
    pub one_thread: Spread,
    /// `allocate` + `free`, every thread at once: the median thread's time of each repetition.
    pub many_threads: Spread,
    /// The same, the slowest thread's time of each repetition.
    pub slowest_thread: Spread,
    /// `pinned` acquire + return.
    pub pinned: Spread,
    /// `cuMemAlloc` + `cuMemFree`.
    pub raw_alloc: Spread,
    /// `cuMemAllocAsync` + `cuMemFreeAsync`.
    pub raw_async: Spread,
    /// `cuMemHostAlloc` + `cuMemFreeHost`.
    pub raw_host: Spread,
}

/// The spread of `v`, which holds at least one value.
fn spread(mut v: Vec<f64>) -> Spread {
    Spread::of(&mut v).expect("at least one repetition")
}

fn check(what: &str, code: Result<CUresult, MissingSymbol>) -> Result<(), String> {
    match code {
        Ok(CUDA_SUCCESS) => Ok(()),
        Ok(code) => Err(format!("{what} failed with CUresult {code}")),
        Err(e) => Err(e.to_string()),
    }
}

/// Spread over repetitions of nanoseconds per run of `f`, `n` runs each, after a warm-up.
fn time_ns(n: usize, mut f: impl FnMut() -> Result<(), String>) -> Result<Spread, String> {
    for _ in 0..n.min(1000) {
        f()?;
    }
    let mut times = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        let t = Instant::now();
        for _ in 0..n {
            f()?;
        }
        times.push(t.elapsed().as_nanos() as f64 / n as f64);
    }
    Ok(spread(times))
}

/// Runs every measurement on `device`.
pub fn measure(device: &Device, threads: usize) -> Result<AllocReport, String> {
    let e = |e: cuda_resident::Error| e.to_string();
    let pair = |d: &Device| d.allocate(MIB).and_then(|b| d.free(b)).map_err(e);
    let one_thread = time_ns(200_000, || pair(device))?;
    let [many_threads, slowest_thread] = many_threads_ns(device, threads)?;
    let pinned = time_ns(200_000, || device.pinned(MIB as usize).map(drop).map_err(e))?;
    let [raw_alloc, raw_async, raw_host] = raw_driver_ns(device)?;
    Ok(AllocReport {
        threads,
        one_thread_ns: one_thread.median,
        many_threads_ns: many_threads.median,
        slowest_thread_ns: slowest_thread.median,
        pinned_ns: pinned.median,
        raw_alloc_ns: raw_alloc.median,
        raw_async_ns: raw_async.median,
        raw_host_ns: raw_host.median,
        waste_percent: waste_percent(device)?,
        spreads: AllocSpreads {
            one_thread,
            many_threads,
            slowest_thread,
            pinned,
            raw_alloc,
            raw_async,
            raw_host,
        },
    })
}

/// `allocate` + `free` on `threads` threads at once, released together: the spreads over
/// repetitions of the median thread's and of the slowest thread's time per pair.
fn many_threads_ns(device: &Device, threads: usize) -> Result<[Spread; 2], String> {
    let (mut per_thread, mut slowest) = (Vec::with_capacity(REPS), Vec::with_capacity(REPS));
    for _ in 0..REPS {
        let barrier = Arc::new(Barrier::new(threads));
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (d, barrier) = (device.clone(), Arc::clone(&barrier));
                std::thread::spawn(move || -> Result<f64, String> {
                    let pair =
                        |d: &Device| d.allocate(MIB).and_then(|b| d.free(b)).map_err(|e| e.to_string());
                    for _ in 0..1000 {
                        pair(&d)?;
                    }
                    barrier.wait();
                    const N: usize = 100_000;
                    let t = Instant::now();
                    for _ in 0..N {
                        pair(&d)?;
                    }
                    Ok(t.elapsed().as_nanos() as f64 / N as f64)
                })
            })
            .collect();
        let times = handles
            .into_iter()
            .map(|h| h.join().map_err(|_| "an allocating thread panicked".to_string())?)
            .collect::<Result<Vec<_>, _>>()?;
        let times = spread(times);
        per_thread.push(times.median);
        slowest.push(times.max);
    }
    Ok([spread(per_thread), spread(slowest)])
}

/// The raw driver's pairs: `cuMemAlloc` + `cuMemFree`, `cuMemAllocAsync` +
/// `cuMemFreeAsync` and `cuMemHostAlloc` + `cuMemFreeHost`, nanoseconds each.
fn raw_driver_ns(device: &Device) -> Result<[Spread; 3], String> {
    let driver = Arc::clone(device.driver());
    device.make_current().map_err(|e| e.to_string())?;
    let raw_alloc_ns = time_ns(2000, || {
        let mut p = 0;
        // SAFETY: allocates and frees 1 MiB on the current context.
        unsafe {
            check("cuMemAlloc", call!(driver, cuMemAlloc_v2(&mut p, MIB as usize)))?;
            check("cuMemFree", call!(driver, cuMemFree_v2(p)))
        }
    })?;
    let raw_async_ns = raw_async_ns(&driver)?;
    let raw_host_ns = time_ns(50, || {
        let mut p = std::ptr::null_mut();
        // SAFETY: allocates and frees 1 MiB of pinned host memory.
        unsafe {
            let flags = cuda_sys::CU_MEMHOSTALLOC_PORTABLE;
            check("cuMemHostAlloc", call!(driver, cuMemHostAlloc(&mut p, MIB as usize, flags)))?;
            check("cuMemFreeHost", call!(driver, cuMemFreeHost(p)))
        }
    })?;
    Ok([raw_alloc_ns, raw_async_ns, raw_host_ns])
}

/// `cuMemAllocAsync` + `cuMemFreeAsync` on a stream of its own, a synchronize every 1000
/// pairs, on the current context.
fn raw_async_ns(driver: &cuda_sys::Driver) -> Result<Spread, String> {
    let mut stream: cuda_sys::CUstream = std::ptr::null_mut();
    // SAFETY: creates a stream on the current context.
    check("cuStreamCreate", unsafe {
        call!(driver, cuStreamCreate(&mut stream, cuda_sys::CU_STREAM_NON_BLOCKING))
    })?;
    let mut i = 0u64;
    let raw_async_ns = time_ns(20_000, || {
        let mut p = 0;
        i += 1;
        // SAFETY: stream-ordered allocate and free of 1 MiB on a live stream.
        unsafe {
            check("cuMemAllocAsync", call!(driver, cuMemAllocAsync(&mut p, MIB as usize, stream)))?;
            check("cuMemFreeAsync", call!(driver, cuMemFreeAsync(p, stream)))?;
            if i.is_multiple_of(1000) {
                check("cuStreamSynchronize", call!(driver, cuStreamSynchronize(stream)))?;
            }
        }
        Ok(())
    })?;
    // SAFETY: the stream is idle after a synchronize and destroyed once.
    unsafe {
        check("cuStreamSynchronize", call!(driver, cuStreamSynchronize(stream)))?;
        check("cuStreamDestroy", call!(driver, cuStreamDestroy_v2(stream)))?;
    }
    Ok(raw_async_ns)
}

/// Internal waste of the size classes on 4000 buffers of uniform random size, 1 B to
/// 4 MiB: percent of the bytes requested.
fn waste_percent(device: &Device) -> Result<f64, String> {
    let e = |e: cuda_resident::Error| e.to_string();
    let mut rng = fastrand::Rng::with_seed(42);
    let before = device.telemetry().memory;
    // Owned: those allocated before a refusal are freed on the way out.
    let buffers = (0..4000)
        .map(|_| device.allocate_owned(rng.u64(1..=MAX_CLASS_BYTES)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(e)?;
    let during = device.telemetry().memory;
    let requested = during.allocated_bytes - before.allocated_bytes;
    let footprint = during.footprint_bytes - before.footprint_bytes;
    for b in buffers {
        b.free().map_err(e)?;
    }
    Ok(100.0 * (footprint - requested) as f64 / requested as f64)
}

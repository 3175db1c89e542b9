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

mod peer;
mod plot;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Barrier;
use std::time::Instant;

use clap::Parser;
use cuda_resident::cuda_sys::{self, CUDA_SUCCESS, CUdeviceptr, CUresult, CUstream, MissingSymbol, call};
use cuda_resident::{Device, Readback, ReadbackBatch, ResidentBuffer, Slot, UploadBatch};
use cuda_resident_suite::PROVENANCE;
use indicatif::{ProgressBar, ProgressStyle};

/// Which cases to run.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Suite {
    /// Many small copies (--counts, default 8192, x --sizes), `--large` single copies, both
    /// directions at once, one 4 KiB upload's latency (under a minute on an H200).
    Default,
    /// Many small copies over a grid: every --counts (default 1024,8192,65536) x every
    /// --sizes; a case of more than --max-case-mib is skipped, and the report says so (about
    /// 1 to 2 minutes on an H200, most of it the baselines' 65536-copy readbacks).
    Grid,
    /// Single copies from 4 KiB to --large (x16 apart), pageable and pinned: H2D, D2H and
    /// both directions at once (well under a minute on an H200).
    Sweep,
    /// One copy, submit to done, of every --latency-sizes: H2D and D2H, pageable and pinned;
    /// median and 99th percentile in µs (about 10 seconds on an H200).
    Latency,
    /// Allocation: device memory and pinned staging against cuMemAlloc, cuMemAllocAsync (in
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

/// Copy counts of the many-small grid when `--counts` is not given.
const GRID_COUNTS: [usize; 3] = [1024, 8192, 65536];
/// Copy count of the default suite's many-small cases when `--counts` is not given.
const DEFAULT_COUNT: usize = 8192;
/// Past this many copies, the many-small baselines (about 7 µs a raw call) run the minimum
/// of 5 repetitions whatever `--reps` says; their rows note it.
const BASELINE_REPS_COUNT: usize = 8192;
/// Copies a repetition of the latency cases times one by one.
const LATENCY_COPIES: usize = 2000;

/// Side-by-side transfer benchmarks: raw driver, cuMemcpyBatchAsync, cuda-resident.
#[derive(Parser, Debug)]
#[command(
    version,
    about = "Side-by-side transfer benchmarks: the raw CUDA driver, cuMemcpyBatchAsync and cuda-resident, in one run.",
    after_help = "Writes report.json (every row, the build's provenance, the device, skipped cases) and SVG plots into --out."
)]
struct Args {
    /// Which cases to run.
    #[arg(long, value_enum, default_value_t = Suite::Default)]
    suite: Suite,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Timed repetitions per case (median reported; at least 5).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Copies per many-small case, a comma list [default: 8192; 1024,8192,65536 for --suite
    /// grid and all].
    #[arg(long, alias = "count", value_delimiter = ',', value_parser = positive)]
    counts: Option<Vec<usize>>,
    /// Copy sizes of the many-small cases, in bytes.
    #[arg(long, value_delimiter = ',', value_parser = positive, default_value = "256,4096,65536")]
    sizes: Vec<usize>,
    /// Largest many-small case, count x size, in MiB; larger ones are skipped and listed.
    #[arg(long, value_parser = positive, default_value_t = 1024)]
    max_case_mib: usize,
    /// Copy sizes of the latency suite, in bytes (the default suite times 4 KiB uploads only).
    #[arg(long, value_delimiter = ',', value_parser = positive, default_value = "4,256,4096,65536")]
    latency_sizes: Vec<usize>,
    /// Bytes of the large single-copy cases, and the sweep's largest size.
    #[arg(long, value_parser = positive, default_value_t = 1 << 30)]
    large: usize,
    /// cuda-resident's staging chunk in KiB (Config::chunk_bytes; default: the library's).
    #[arg(long)]
    chunk_kib: Option<u64>,
    /// cuda-resident's direct-copy threshold in KiB (Config::direct_threshold).
    #[arg(long)]
    direct_kib: Option<u64>,
    /// cuda-resident's packing threads (Config::pack_threads; 0 = one per core, up to 16).
    #[arg(long)]
    pack_threads: Option<usize>,
    /// Microseconds cuda-resident's packing threads stay awake after packing
    /// (Config::pack_linger_us).
    #[arg(long)]
    pack_linger_us: Option<u64>,
    /// Move batches of small copies in order through device staging (a DMA and a scatter or
    /// gather) instead of by the kernel over the bus (Config::small_copies_over_bus = false).
    #[arg(long)]
    staged_small_copies: bool,
    /// Also print where the time of an upload batch goes (adding writes, submit, wait).
    #[arg(long)]
    breakdown: bool,
    /// Folder for the JSON report and the SVG plots.
    #[arg(long, default_value = "target/xfer-bench")]
    out: PathBuf,
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
fn usage_line(e: &clap::Error) -> String {
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

type BenchResult<T> = Result<T, String>;

fn check(what: &str, code: Result<CUresult, MissingSymbol>) -> BenchResult<()> {
    match code {
        Ok(CUDA_SUCCESS) => Ok(()),
        Ok(code) => Err(format!("{what} failed with CUresult {code}")),
        Err(e) => Err(e.to_string()),
    }
}

fn error(e: cuda_resident::Error) -> String {
    e.to_string()
}

/// Median of `reps` values of `sample`, after one warm-up call whose value is dropped.
fn median_of(reps: usize, mut sample: impl FnMut() -> BenchResult<f64>) -> BenchResult<f64> {
    sample()?;
    let mut values = (0..reps).map(|_| sample()).collect::<BenchResult<Vec<f64>>>()?;
    values.sort_by(f64::total_cmp);
    Ok(values[values.len() / 2])
}

/// Median seconds of `reps` runs of `run`, after one warm-up run.
fn median_secs(reps: usize, mut run: impl FnMut() -> BenchResult<()>) -> BenchResult<f64> {
    median_of(reps, || {
        let t = Instant::now();
        run()?;
        Ok(t.elapsed().as_secs_f64())
    })
}

/// Median microseconds of each of three phases over `reps` runs of `run`, which returns the
/// instants that start the first phase, end each phase and start the next.
fn phase_medians(reps: usize, mut run: impl FnMut() -> BenchResult<[Instant; 4]>) -> BenchResult<[f64; 3]> {
    let mut phases = [Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..reps.max(1) {
        let t = run()?;
        for (i, p) in phases.iter_mut().enumerate() {
            p.push(t[i + 1] - t[i]);
        }
    }
    Ok(phases.map(|mut p| median_micros(&mut p)))
}

/// The median of `times`, in microseconds.
fn median_micros(times: &mut [std::time::Duration]) -> f64 {
    times.sort();
    times[times.len() / 2].as_secs_f64() * 1e6
}

/// Median seconds of `reps` timed runs of `timed` on what `prepare` made (untimed), after
/// one warm-up run.
fn median_secs_prepared<T>(
    reps: usize,
    mut prepare: impl FnMut() -> BenchResult<T>,
    mut timed: impl FnMut(T) -> BenchResult<()>,
) -> BenchResult<f64> {
    median_of(reps, || {
        let input = prepare()?;
        let t = Instant::now();
        timed(input)?;
        Ok(t.elapsed().as_secs_f64())
    })
}

/// Median microseconds of an upload batch's three phases over `reps` runs: adding its
/// writes (`build`), submit (planning, packing, enqueueing) and the wait.
fn batch_phases<'d>(
    reps: usize,
    mut build: impl FnMut() -> cuda_resident::Result<UploadBatch<'d>>,
) -> BenchResult<[f64; 3]> {
    phase_medians(reps, || {
        let t = Instant::now();
        let batch = build().map_err(error)?;
        let t1 = Instant::now();
        let fence = batch.submit().map_err(error)?;
        let t2 = Instant::now();
        fence.wait().map_err(error)?;
        Ok([t, t1, t2, Instant::now()])
    })
}

/// One row of the report.
#[derive(Debug)]
struct Row {
    case: String,
    /// Copies per batch (many-small cases), for the plots and the report.
    count: Option<usize>,
    /// Bytes per copy, for the plots (cases that sweep a size).
    size: Option<usize>,
    unit: &'static str,
    raw: Option<f64>,
    batch: Option<f64>,
    ours: f64,
    /// Anything the reader of this row should know (fewer baseline repetitions).
    note: Option<String>,
}

impl Row {
    fn new(case: String, unit: &'static str, raw: Option<f64>, batch: Option<f64>, ours: f64) -> Row {
        Row { case, count: None, size: None, unit, raw, batch, ours, note: None }
    }

    fn gbps(case: String, bytes: usize, raw: Option<f64>, batch: Option<f64>, ours: f64) -> Row {
        let rate = |secs: f64| bytes as f64 / secs / 1e9;
        Row::new(case, "GB/s", raw.map(rate), batch.map(rate), rate(ours))
    }

    /// A bandwidth row from the times of each method.
    fn from_times(case: String, bytes: usize, t: &ByMethod<f64>) -> Row {
        Row::gbps(case, bytes, Some(t.raw), t.batch, t.ours)
    }

    fn sized(mut self, size: usize) -> Row {
        self.size = Some(size);
        self
    }

    /// cuda-resident's advantage over `base` (higher is better for both units).
    fn ratio(&self, base: Option<f64>) -> String {
        match base {
            Some(b) if self.unit == "GB/s" => format!("{:.1}x", self.ours / b),
            Some(b) => format!("{:.2}x", b / self.ours),
            None => "n/a".into(),
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "case": self.case, "count": self.count, "bytes_per_copy": self.size, "unit": self.unit,
            "raw": self.raw, "batch": self.batch, "cuda_resident": self.ours, "note": self.note,
        })
    }
}

/// The raw side: two streams of the device's context (a second one for the other direction
/// of the both-at-once cases) and whether the driver has `cuMemcpyBatchAsync`.
struct Raw<'d> {
    device: &'d Device,
    stream: CUstream,
    second: CUstream,
    batch: bool,
}

impl<'d> Raw<'d> {
    fn new(device: &'d Device) -> BenchResult<Raw<'d>> {
        let mut streams: [CUstream; 2] = [std::ptr::null_mut(); 2];
        for stream in &mut streams {
            // SAFETY: creates a stream on the device's context, current on this thread.
            check("cuStreamCreate", unsafe {
                call!(device.driver(), cuStreamCreate(stream, cuda_sys::CU_STREAM_NON_BLOCKING))
            })?;
        }
        let [stream, second] = streams;
        Ok(Raw { device, stream, second, batch: device.info().batch_memcpy })
    }

    fn sync(&self) -> BenchResult<()> {
        sync(self.device, self.stream)
    }

    /// One `cuMemcpyBatchAsync` over all copies on the first stream, then a synchronize.
    fn memcpy_batch(
        &self,
        dsts: &mut [u64],
        srcs: &mut [u64],
        sizes: &mut [usize],
        host_to_device: bool,
    ) -> BenchResult<()> {
        memcpy_batch(self.device, self.stream, dsts, srcs, sizes, host_to_device)
    }
}

impl Drop for Raw<'_> {
    fn drop(&mut self) {
        for stream in [self.stream, self.second] {
            // SAFETY: every copy on the stream has been waited for; each stream is destroyed once.
            let _ = unsafe { call!(self.device.driver(), cuStreamDestroy_v2(stream)) };
        }
    }
}

fn sync(d: &Device, stream: CUstream) -> BenchResult<()> {
    // SAFETY: the stream is live.
    check("cuStreamSynchronize", unsafe { call!(d.driver(), cuStreamSynchronize(stream)) })
}

/// One `cuMemcpyBatchAsync` over all copies on `stream`, host sources or destinations as
/// `host_to_device` says, then a synchronize.
fn memcpy_batch(
    d: &Device,
    stream: CUstream,
    dsts: &mut [u64],
    srcs: &mut [u64],
    sizes: &mut [usize],
    host_to_device: bool,
) -> BenchResult<()> {
    let host = cuda_sys::CUmemLocation { type_: cuda_sys::CU_MEM_LOCATION_TYPE_HOST, id: 0 };
    let dev =
        cuda_sys::CUmemLocation { type_: cuda_sys::CU_MEM_LOCATION_TYPE_DEVICE, id: d.info().ordinal as i32 };
    let (src_loc, dst_loc) = if host_to_device { (host, dev) } else { (dev, host) };
    let mut attrs = cuda_sys::CUmemcpyAttributes {
        srcAccessOrder: cuda_sys::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: src_loc,
        dstLocHint: dst_loc,
        flags: 0,
    };
    let mut idx = 0usize;
    // SAFETY: the arrays hold `count` entries naming valid host and device ranges that
    // outlive the synchronize below.
    check("cuMemcpyBatchAsync", unsafe {
        call!(
            d.driver(),
            cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                sizes.len(),
                &mut attrs,
                &mut idx,
                1,
                stream
            )
        )
    })?;
    sync(d, stream)
}

fn random_vec(rng: &mut fastrand::Rng, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rng.fill(&mut v);
    v
}

/// A value measured for each method: the raw driver, `cuMemcpyBatchAsync` (`None` where the
/// driver lacks it or the case has no batch form) and cuda-resident.
#[derive(Clone, Copy, Debug)]
struct ByMethod<T> {
    raw: T,
    batch: Option<T>,
    ours: T,
}

/// Who makes a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Method {
    /// The raw driver, one call per copy.
    Raw,
    /// `cuMemcpyBatchAsync` with one copy.
    Batch,
    /// cuda-resident.
    Ours,
}

/// The host side of a single copy: the source of an upload or the destination of a readback.
enum Host<'a> {
    Src(&'a [u8]),
    Dst(&'a mut [u8]),
}

/// One copy between host memory and the start of a device buffer, which every method can
/// make, waiting until it is done.
///
/// The raw driver uses `cuMemcpy*Async` on `stream` + synchronize for pinned memory, and
/// for pageable memory either the synchronous `cuMemcpyHtoD` / `cuMemcpyDtoH` (bandwidth
/// cases) or the same async call + synchronize (`raw_async`: latency and both-at-once
/// cases, where two synchronous calls would meet on the legacy stream). cuda-resident uses
/// `upload_at` / `read_into_slice` (pageable) or `upload_async_at` / `download_async_at` +
/// fence wait (pinned).
struct Single<'a> {
    d: &'a Device,
    stream: CUstream,
    buffer: ResidentBuffer,
    ptr: CUdeviceptr,
    host: Host<'a>,
    pinned: bool,
    raw_async: bool,
}

// SAFETY: the driver API may be called from any thread and a `CUstream` handle used from
// any of them; the other fields are `Send`. A `Single` is used by one thread at a time.
unsafe impl Send for Single<'_> {}

impl<'a> Single<'a> {
    fn new(
        d: &'a Device,
        stream: CUstream,
        buffer: ResidentBuffer,
        host: Host<'a>,
        pinned: bool,
        raw_async: bool,
    ) -> BenchResult<Single<'a>> {
        let ptr = d.device_ptr(buffer).map_err(error)?;
        Ok(Single { d, stream, buffer, ptr, host, pinned, raw_async })
    }

    fn len(&self) -> usize {
        match &self.host {
            Host::Src(src) => src.len(),
            Host::Dst(dst) => dst.len(),
        }
    }

    fn label(&self) -> String {
        let dir = if matches!(self.host, Host::Src(_)) { "H2D" } else { "D2H" };
        let memory = if self.pinned { "pinned" } else { "pageable" };
        format!("{dir} {memory} {}", human(self.len()))
    }

    /// One copy by `method`, waited for.
    fn once(&mut self, method: Method) -> BenchResult<()> {
        let (d, stream, buffer, ptr, len) = (self.d, self.stream, self.buffer, self.ptr, self.len());
        let (pinned, asynchronous) = (self.pinned, self.pinned || self.raw_async);
        let driver = d.driver();
        match (method, &mut self.host) {
            (Method::Raw, Host::Src(src)) if asynchronous => {
                // SAFETY: `len` bytes of live host memory into a buffer of at least `len`
                // bytes; synchronized before the borrow ends.
                check("cuMemcpyHtoDAsync", unsafe {
                    call!(driver, cuMemcpyHtoDAsync_v2(ptr, src.as_ptr().cast(), len, stream))
                })?;
                sync(d, stream)
            }
            (Method::Raw, Host::Src(src)) => {
                // SAFETY: as above, and the call returns when the copy is done.
                check("cuMemcpyHtoD", unsafe {
                    call!(driver, cuMemcpyHtoD_v2(ptr, src.as_ptr().cast(), len))
                })
            }
            (Method::Raw, Host::Dst(dst)) if asynchronous => {
                // SAFETY: `len` bytes of the buffer into live host memory of `len` bytes;
                // synchronized before the borrow ends.
                check("cuMemcpyDtoHAsync", unsafe {
                    call!(driver, cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), ptr, len, stream))
                })?;
                sync(d, stream)
            }
            (Method::Raw, Host::Dst(dst)) => {
                // SAFETY: as above, and the call returns when the copy is done.
                check("cuMemcpyDtoH", unsafe {
                    call!(driver, cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), ptr, len))
                })
            }
            (Method::Batch, Host::Src(src)) => {
                memcpy_batch(d, stream, &mut [ptr], &mut [src.as_ptr() as u64], &mut [len], true)
            }
            (Method::Batch, Host::Dst(dst)) => {
                memcpy_batch(d, stream, &mut [dst.as_mut_ptr() as u64], &mut [ptr], &mut [len], false)
            }
            (Method::Ours, Host::Src(src)) if pinned => {
                // SAFETY: pinned source of `len` bytes, alive until the fence is waited on.
                unsafe { d.upload_async_at(buffer, 0, src.as_ptr(), len) }
                    .and_then(|f| f.wait())
                    .map_err(error)
            }
            (Method::Ours, Host::Src(src)) => d.upload_at(buffer, 0, src).map_err(error),
            (Method::Ours, Host::Dst(dst)) if pinned => {
                // SAFETY: pinned destination of `len` bytes, untouched until the fence is waited on.
                unsafe { d.download_async_at(buffer, 0, dst.as_mut_ptr(), len) }
                    .and_then(|f| f.wait())
                    .map_err(error)
            }
            (Method::Ours, Host::Dst(dst)) => d.read_into_slice(buffer, 0, dst).map_err(error),
        }
    }

    /// Overwrites the copy's destination with 0xA5 (the device range through the raw
    /// driver), so that what cuda-resident moves next is what gets verified.
    fn scramble(&mut self) -> BenchResult<()> {
        match &mut self.host {
            Host::Src(_) => {
                // SAFETY: `len` bytes of a live buffer; synchronized below.
                check("cuMemsetD8Async", unsafe {
                    call!(self.d.driver(), cuMemsetD8Async(self.ptr, 0xA5, self.len(), self.stream))
                })?;
                sync(self.d, self.stream)
            }
            Host::Dst(dst) => {
                dst.fill(0xA5);
                Ok(())
            }
        }
    }

    /// Checks that the host memory and the device range hold the same bytes, reading the
    /// device through the raw driver.
    fn verify(&self) -> BenchResult<()> {
        let mut device = vec![0u8; self.len()];
        // SAFETY: `len` bytes of a live buffer into a vector of `len` bytes.
        check("cuMemcpyDtoH", unsafe {
            call!(self.d.driver(), cuMemcpyDtoH_v2(device.as_mut_ptr().cast(), self.ptr, self.len()))
        })?;
        let host: &[u8] = match &self.host {
            Host::Src(src) => src,
            Host::Dst(dst) => dst,
        };
        if host != &device[..] {
            return Err(format!("{}: bytes differ after cuda-resident's copy", self.label()));
        }
        Ok(())
    }

    /// `measure` by each method (the batch API where the driver has it), cuda-resident last:
    /// its destination is scrambled first and verified afterwards.
    fn each_method<T>(
        &mut self,
        mut measure: impl FnMut(&mut Self, Method) -> BenchResult<T>,
    ) -> BenchResult<ByMethod<T>> {
        let raw = measure(self, Method::Raw)?;
        let batch = if self.d.info().batch_memcpy { Some(measure(self, Method::Batch)?) } else { None };
        self.scramble()?;
        let ours = measure(self, Method::Ours)?;
        self.verify()?;
        Ok(ByMethod { raw, batch, ours })
    }

    /// Median seconds of `iters` back-to-back copies by each method.
    fn times(&mut self, reps: usize, iters: usize) -> BenchResult<ByMethod<f64>> {
        self.each_method(|copy, method| median_secs(reps, || (0..iters).try_for_each(|_| copy.once(method))))
    }

    /// Median and 99th percentile, in µs, of one copy by each method: `LATENCY_COPIES`
    /// warm-up copies each, then `reps` times as many timed one by one. The methods take
    /// turns copy by copy, so that a burst of host noise falls on all of them alike rather
    /// than on one method's block of copies. cuda-resident's destination is scrambled before
    /// its last copy and verified after it.
    fn latencies(&mut self, reps: usize) -> BenchResult<ByMethod<[f64; 2]>> {
        let batch = self.d.info().batch_memcpy;
        let methods: Vec<Method> =
            [Method::Raw].into_iter().chain(batch.then_some(Method::Batch)).chain([Method::Ours]).collect();
        for &method in &methods {
            (0..LATENCY_COPIES).try_for_each(|_| self.once(method))?;
        }
        let mut us = vec![Vec::with_capacity(reps * LATENCY_COPIES); methods.len()];
        for _ in 0..reps * LATENCY_COPIES {
            for (&method, us) in methods.iter().zip(&mut us) {
                let t = Instant::now();
                self.once(method)?;
                us.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        self.scramble()?;
        self.once(Method::Ours)?;
        self.verify()?;
        let mut stats = us.into_iter().map(|mut us| {
            us.sort_by(f64::total_cmp);
            [us[us.len() / 2], us[us.len() * 99 / 100]]
        });
        let raw = stats.next().expect("raw is measured");
        let batch = if batch { stats.next() } else { None };
        let ours = stats.next().expect("cuda-resident is measured");
        Ok(ByMethod { raw, batch, ours })
    }
}

/// Seconds of `iters` copies of `up` and `iters` of `down` at the same time, by `method`:
/// each direction on its own thread, both released together, the clock running until the
/// later one is done.
fn time_both(up: &mut Single, down: &mut Single, iters: usize, method: Method) -> BenchResult<f64> {
    let start = Barrier::new(2);
    std::thread::scope(|s| {
        let other = s.spawn(|| -> BenchResult<Instant> {
            let current = up.d.make_current().map_err(error);
            start.wait();
            current?;
            (0..iters).try_for_each(|_| up.once(method))?;
            Ok(Instant::now())
        });
        start.wait();
        let t = Instant::now();
        let mine = (0..iters).try_for_each(|_| down.once(method)).map(|()| Instant::now());
        let theirs = other.join().map_err(|_| "a copy thread panicked".to_string())?;
        Ok((mine?.max(theirs?) - t).as_secs_f64())
    })
}

/// Runs `f` with `src` and `dst` registered with the driver (pinned), and unregisters them
/// afterwards whatever `f` returned.
fn with_pinned<R>(
    d: &Device,
    src: &mut [u8],
    dst: &mut [u8],
    f: impl FnOnce(&mut [u8], &mut [u8]) -> BenchResult<R>,
) -> BenchResult<R> {
    // SAFETY: both slices are borrowed for this whole call, so they stay alive and unmoved
    // until unpinned below.
    unsafe { d.pin_host(src.as_mut_ptr(), src.len()) }.map_err(error)?;
    // SAFETY: as above.
    if let Err(e) = unsafe { d.pin_host(dst.as_mut_ptr(), dst.len()) } {
        // SAFETY: pinned just above; nothing uses it.
        let _ = unsafe { d.unpin_host(src.as_mut_ptr()) };
        return Err(error(e));
    }
    let result = f(src, dst);
    // SAFETY: every copy that `f` made has been waited for.
    let unpinned = unsafe { d.unpin_host(src.as_mut_ptr()).and(d.unpin_host(dst.as_mut_ptr())) };
    let value = result?;
    unpinned.map_err(error)?;
    Ok(value)
}

/// H2D (`src` into `b`), then D2H (`b` into `dst`), `iters` copies a sample, by each method;
/// cuda-resident's copies verified.
fn up_down(
    d: &Device,
    raw: &Raw,
    reps: usize,
    b: ResidentBuffer,
    (src, dst): (&[u8], &mut [u8]),
    pinned: bool,
    iters: usize,
) -> BenchResult<(ByMethod<f64>, ByMethod<f64>)> {
    let up = Single::new(d, raw.stream, b, Host::Src(src), pinned, false)?.times(reps, iters)?;
    let down = Single::new(d, raw.stream, b, Host::Dst(dst), pinned, false)?.times(reps, iters)?;
    Ok((up, down))
}

/// Both directions at once: `src` into `b` while `other` comes into `dst`, `iters` copies
/// each way a sample. Raw driver and cuda-resident seconds (no batch form); cuda-resident's
/// copies verified.
fn both_ways(
    d: &Device,
    raw: &Raw,
    reps: usize,
    (b, other): (ResidentBuffer, ResidentBuffer),
    (src, dst): (&[u8], &mut [u8]),
    pinned: bool,
    iters: usize,
) -> BenchResult<ByMethod<f64>> {
    // `other` gets known bytes first, so that what comes down can be checked.
    Single::new(d, raw.stream, other, Host::Src(src), pinned, true)?.once(Method::Raw)?;
    let mut up = Single::new(d, raw.stream, b, Host::Src(src), pinned, true)?;
    let mut down = Single::new(d, raw.second, other, Host::Dst(dst), pinned, true)?;
    // One warm-up each, then the two take turns rep by rep, so that a burst of noise on the
    // link or the host falls on both alike; medians. cuda-resident's destinations are
    // scrambled before its last run and verified after it.
    let methods = [Method::Raw, Method::Ours];
    let mut secs = [Vec::with_capacity(reps), Vec::with_capacity(reps)];
    for method in methods {
        time_both(&mut up, &mut down, iters, method)?;
    }
    for _ in 0..reps.max(1) {
        for (method, secs) in methods.into_iter().zip(&mut secs) {
            secs.push(time_both(&mut up, &mut down, iters, method)?);
        }
    }
    up.scramble()?;
    down.scramble()?;
    time_both(&mut up, &mut down, iters, Method::Ours)?;
    up.verify()?;
    down.verify()?;
    let [raw_secs, ours] = secs.map(|mut v| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    });
    Ok(ByMethod { raw: raw_secs, batch: None, ours })
}

/// Many small copies: `count` copies of `size` bytes spread over 64 buffers with gaps, so
/// that none fuse.
struct Scatter {
    buffers: Vec<ResidentBuffer>,
    places: Vec<(usize, u64)>,
    ptrs: Vec<u64>,
}

impl Scatter {
    fn new(d: &Device, count: usize, size: usize) -> BenchResult<Scatter> {
        let per = count.div_ceil(64);
        let stride = size as u64 + 64;
        let buffers = (0..64)
            .map(|_| d.allocate(per as u64 * stride))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        let places: Vec<(usize, u64)> = (0..count).map(|i| (i % 64, (i / 64) as u64 * stride)).collect();
        let ptrs = places
            .iter()
            .map(|&(b, o)| d.device_ptr(buffers[b]).map(|p| p + o))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        Ok(Scatter { buffers, places, ptrs })
    }

    /// An upload batch of every copy from `sources` (one per copy), by `write`.
    fn copied_batch<'d>(
        &self,
        d: &'d Device,
        sources: &'d [Vec<u8>],
    ) -> cuda_resident::Result<UploadBatch<'d>> {
        let mut batch = d.uploads();
        for (src, &(b, o)) in sources.iter().zip(&self.places) {
            batch.write(self.buffers[b], o, src)?;
        }
        Ok(batch)
    }

    /// The same by `write_with`: each copy filled in place from its source.
    fn in_place_batch<'d>(
        &self,
        d: &'d Device,
        sources: &[Vec<u8>],
    ) -> cuda_resident::Result<UploadBatch<'d>> {
        let mut batch = d.uploads();
        for (src, &(b, o)) in sources.iter().zip(&self.places) {
            batch.write_with(self.buffers[b], o, src.len(), |dst| dst.copy_from_slice(src))?;
        }
        Ok(batch)
    }

    /// A readback batch of every copy's range, not yet submitted, and its slots.
    fn reads<'d>(&self, d: &'d Device, size: usize) -> cuda_resident::Result<(ReadbackBatch<'d>, Vec<Slot>)> {
        let mut reads = d.readbacks();
        let slots = self
            .places
            .iter()
            .map(|&(b, o)| reads.read(self.buffers[b], o, size as u64))
            .collect::<Result<_, _>>()?;
        Ok((reads, slots))
    }

    /// Reads every copy's range back as one batch.
    fn read_all(&self, d: &Device, size: usize) -> cuda_resident::Result<(Vec<Slot>, Readback)> {
        let (reads, slots) = self.reads(d, size)?;
        Ok((slots, reads.submit()?.wait()?))
    }

    fn free(self, d: &Device) {
        for b in self.buffers {
            let _ = d.free(b);
        }
    }
}

/// Repetitions of the baselines of a many-small case of `count` copies: one raw call costs
/// about 7 µs, so past `BASELINE_REPS_COUNT` copies they run the minimum of 5 (the same as
/// `--reps` unless it asks for more).
fn baseline_reps(args: &Args, count: usize) -> usize {
    if count > BASELINE_REPS_COUNT { args.reps.min(5) } else { args.reps }
}

/// One many-small case: `count` copies of `size` bytes, each way, by each method.
fn many_small(
    d: &Device,
    raw: &Raw,
    args: &Args,
    (count, size): (usize, usize),
    rows: &mut Vec<Row>,
) -> BenchResult<()> {
    let first = rows.len();
    let base_reps = baseline_reps(args, count);
    many_small_rows(d, raw, args, (count, size), base_reps, rows)?;
    for r in &mut rows[first..] {
        (r.count, r.size) = (Some(count), Some(size));
        if base_reps < args.reps {
            r.note = Some(format!("raw and batch API: median of {base_reps} repetitions"));
        }
    }
    Ok(())
}

fn many_small_rows(
    d: &Device,
    raw: &Raw,
    args: &Args,
    (count, size): (usize, usize),
    base_reps: usize,
    rows: &mut Vec<Row>,
) -> BenchResult<()> {
    let bytes = count * size;
    let mut rng = fastrand::Rng::with_seed((count * 31 + size) as u64);
    let sources: Vec<Vec<u8>> = (0..count).map(|_| random_vec(&mut rng, size)).collect();
    let s = Scatter::new(d, count, size)?;
    let e = error;

    // Host to device.
    let raw_h2d = median_secs(base_reps, || {
        for (src, &dst) in sources.iter().zip(&s.ptrs) {
            // SAFETY: pageable source of `size` bytes, device range of `size` bytes.
            check("cuMemcpyHtoDAsync", unsafe {
                call!(d.driver(), cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), size, raw.stream))
            })?;
        }
        raw.sync()
    })?;
    let batch_h2d = if raw.batch {
        let mut dsts = s.ptrs.clone();
        let mut srcs: Vec<u64> = sources.iter().map(|v| v.as_ptr() as u64).collect();
        let mut sizes = vec![size; count];
        Some(median_secs(base_reps, || raw.memcpy_batch(&mut dsts, &mut srcs, &mut sizes, true))?)
    } else {
        None
    };
    let ours_h2d = median_secs(args.reps, || {
        s.copied_batch(d, &sources).map_err(e)?.submit().map_err(e)?.wait().map_err(e)
    })?;
    verify_scatter(d, &s, &sources, size, "H2D")?;
    if args.breakdown {
        // Where the time of one batch goes, from the outside: adding writes, submit
        // (planning, packing, enqueueing), waiting.
        let [write, submit, wait] = batch_phases(args.reps, || s.copied_batch(d, &sources))?;
        let len = d.buffer_len(s.buffers[0]).map_err(e)?;
        let requests: Vec<_> = s
            .places
            .iter()
            .map(|&(b, o)| cuda_resident::internals::plan::WriteRequest {
                buffer: b as u64,
                buffer_len: len,
                offset: o,
                len: size as u64,
            })
            .collect();
        let config = cuda_resident::internals::plan::PlanConfig::default();
        let (mut planner, mut plan) = (
            cuda_resident::internals::plan::Planner::new(),
            cuda_resident::internals::plan::UploadPlan::default(),
        );
        let mut planning = Vec::new();
        for _ in 0..args.reps.max(20) {
            let t = Instant::now();
            planner.plan_upload_into(&requests, &config, &mut plan).map_err(|e| e.to_string())?;
            planning.push(t.elapsed());
        }
        eprintln!(
            "breakdown H2D {count} x {}: write {:.0} µs, submit {:.0} µs (planning alone {:.0} µs), wait {:.0} µs",
            human(size),
            write,
            submit,
            median_micros(&mut planning),
            wait
        );
    }
    // A write_with batch stages every byte in pinned memory before it is submitted: a case
    // larger than the pool can lend is skipped (with a line on stderr), as prepared sets are.
    let in_place = match median_secs(args.reps, || {
        s.in_place_batch(d, &sources).map_err(e)?.submit().map_err(e)?.wait().map_err(e)
    }) {
        Ok(t) => Some(t),
        Err(err) => {
            eprintln!("write_with rows of {count} x {} skipped: {err}", human(size));
            None
        }
    };
    let mut ours_in_place = None;
    if let Some(fill_and_move) = in_place {
        verify_scatter(d, &s, &sources, size, "H2D write_with")?;
        // The bytes already in pinned staging (written in place before the clock starts):
        // what the link and the scatter cost.
        let staged = median_secs_prepared(
            args.reps,
            || s.in_place_batch(d, &sources).map_err(e),
            |batch| batch.submit().map_err(e)?.wait().map_err(e),
        )?;
        verify_scatter(d, &s, &sources, size, "H2D write_with, staged")?;
        ours_in_place = Some((fill_and_move, staged));
        if args.breakdown {
            let [fill, submit, wait] = batch_phases(args.reps, || s.in_place_batch(d, &sources))?;
            eprintln!(
                "breakdown H2D {count} x {} write_with: fill {fill:.0} µs, submit {submit:.0} µs, wait {wait:.0} µs",
                human(size)
            );
        }
    }
    let ranges: Vec<_> = s.places.iter().map(|&(b, o)| (s.buffers[b], o, size as u64)).collect();
    let ours_prepared = prepared_uploads(d, args, &s, &sources, &ranges)?;
    let name = |what: &str| format!("H2D {count} x {} {what}", human(size));
    rows.push(Row::gbps(name("from pageable"), bytes, Some(raw_h2d), batch_h2d, ours_h2d));
    if let Some(t) = ours_prepared {
        rows.push(Row::gbps(name("prepared, from pageable"), bytes, Some(raw_h2d), batch_h2d, t));
    }
    if let Some((fill_and_move, staged)) = ours_in_place {
        rows.push(Row::gbps(name("write_with, fill+move"), bytes, Some(raw_h2d), batch_h2d, fill_and_move));
        rows.push(Row::gbps(name("write_with, move only"), bytes, Some(raw_h2d), batch_h2d, staged));
    }

    // Device to host: the sources now hold `sources`.
    let mut outs: Vec<Vec<u8>> = (0..count).map(|_| vec![0u8; size]).collect();
    let raw_d2h = median_secs(base_reps, || {
        for (out, &src) in outs.iter_mut().zip(&s.ptrs) {
            // SAFETY: pageable destination of `size` bytes.
            check("cuMemcpyDtoHAsync", unsafe {
                call!(d.driver(), cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), src, size, raw.stream))
            })?;
        }
        raw.sync()
    })?;
    let batch_d2h = if raw.batch {
        let mut dsts: Vec<u64> = outs.iter_mut().map(|v| v.as_mut_ptr() as u64).collect();
        let mut srcs = s.ptrs.clone();
        let mut sizes = vec![size; count];
        Some(median_secs(base_reps, || raw.memcpy_batch(&mut dsts, &mut srcs, &mut sizes, false))?)
    } else {
        None
    };
    for o in &mut outs {
        o.fill(0xA5);
    }
    let ours_d2h = median_secs(args.reps, || {
        let (reads, _) = s.reads(d, size).map_err(e)?;
        reads.submit_into(&mut outs).map_err(e)
    })?;
    if outs != sources {
        return Err(format!("D2H {count} x {size} into Vecs: bytes differ"));
    }
    if args.breakdown {
        // Where the time of one readback into Vecs goes: adding reads, submit (laying out,
        // enqueueing), waiting and copying out chunk by chunk.
        let [read, submit, wait] = phase_medians(args.reps, || {
            let t = Instant::now();
            let (reads, slots) = s.reads(d, size).map_err(e)?;
            let t1 = Instant::now();
            let pending = reads.submit().map_err(e)?;
            let t2 = Instant::now();
            pending.wait_into(&slots, &mut outs).map_err(e)?;
            Ok([t, t1, t2, Instant::now()])
        })?;
        eprintln!(
            "breakdown D2H {count} x {} into Vecs: read {read:.0} µs, submit {submit:.0} µs, wait and copy out {wait:.0} µs",
            human(size)
        );
    }
    let mut seen = 0usize;
    let ours_views = median_secs(args.reps, || {
        let (slots, done) = s.read_all(d, size).map_err(e)?;
        seen = slots.iter().filter(|&&slot| done.get(slot).len() == size).count();
        if slots.iter().zip(&sources).take(64).any(|(&slot, src)| done.get(slot) != &src[..]) {
            return Err("D2H views: bytes differ".into());
        }
        Ok(())
    })?;
    if seen != count {
        return Err(format!("D2H {count} x {size} views: {seen} of {count} views have {size} bytes"));
    }
    let (slots, done) = s.read_all(d, size).map_err(e)?;
    if slots.iter().zip(&sources).any(|(&slot, src)| done.get(slot) != &src[..]) {
        return Err(format!("D2H {count} x {size} views: bytes differ"));
    }
    drop(done);
    let prepared = prepared_readbacks(d, args, &sources, &ranges, &mut outs)?;
    rows.push(Row::gbps(
        format!("D2H {count} x {} into caller Vecs", human(size)),
        bytes,
        Some(raw_d2h),
        batch_d2h,
        ours_d2h,
    ));
    rows.push(Row::gbps(
        format!("D2H {count} x {} read as views", human(size)),
        bytes,
        Some(raw_d2h),
        batch_d2h,
        ours_views,
    ));
    if let Some([into, views]) = prepared {
        let name = |what: &str| format!("D2H {count} x {} prepared, {what}", human(size));
        rows.push(Row::gbps(name("into caller Vecs"), bytes, Some(raw_d2h), batch_d2h, into));
        rows.push(Row::gbps(name("read as views"), bytes, Some(raw_d2h), batch_d2h, views));
    }
    s.free(d);
    Ok(())
}

/// The ranges prepared once (outside the clock) and uploaded with the bytes each time: the
/// median time, or `None` (said on stderr) when the set cannot be prepared, e.g. its pinned
/// region would not fit the pool.
fn prepared_uploads(
    d: &Device,
    args: &Args,
    s: &Scatter,
    sources: &[Vec<u8>],
    ranges: &[(ResidentBuffer, u64, u64)],
) -> BenchResult<Option<f64>> {
    let mut prepared = match d.prepare_uploads(ranges) {
        Ok(p) => p,
        Err(err) => {
            eprintln!("prepared uploads of {} ranges skipped: {err}", ranges.len());
            return Ok(None);
        }
    };
    let t = median_secs(args.reps, || prepared.upload(sources).map_err(error)?.wait().map_err(error))?;
    verify_scatter(d, s, sources, sources[0].len(), "H2D prepared")?;
    Ok(Some(t))
}

/// The ranges (which hold `sources`) prepared once and read each time, into `outs` and as
/// views: the median times, or `None` as for [`prepared_uploads`].
fn prepared_readbacks(
    d: &Device,
    args: &Args,
    sources: &[Vec<u8>],
    ranges: &[(ResidentBuffer, u64, u64)],
    outs: &mut [Vec<u8>],
) -> BenchResult<Option<[f64; 2]>> {
    let e = error;
    let mut prepared = match d.prepare_readbacks(ranges) {
        Ok(p) => p,
        Err(err) => {
            eprintln!("prepared readbacks of {} ranges skipped: {err}", ranges.len());
            return Ok(None);
        }
    };
    let what = format!("D2H {} x {} prepared", ranges.len(), sources[0].len());
    for o in outs.iter_mut() {
        o.fill(0x5A);
    }
    let into = median_secs(args.reps, || prepared.read_into(outs).map_err(e))?;
    if outs != sources {
        return Err(format!("{what} into Vecs: bytes differ"));
    }
    let views = median_secs(args.reps, || {
        let done = prepared.submit().map_err(e)?.wait().map_err(e)?;
        if (0..ranges.len().min(64)).any(|k| done.get(prepared.slot(k)) != &sources[k][..]) {
            return Err(format!("{what} views: bytes differ"));
        }
        Ok(())
    })?;
    let done = prepared.submit().map_err(e)?.wait().map_err(e)?;
    if (0..ranges.len()).any(|k| done.get(prepared.slot(k)) != &sources[k][..]) {
        return Err(format!("{what} views: bytes differ"));
    }
    Ok(Some([into, views]))
}

fn verify_scatter(d: &Device, s: &Scatter, sources: &[Vec<u8>], size: usize, what: &str) -> BenchResult<()> {
    let back = d.download_many(&s.buffers).map_err(|e| e.to_string())?;
    for (src, &(b, o)) in sources.iter().zip(&s.places) {
        if back[b][o as usize..][..size] != src[..] {
            return Err(format!("{what}: a copy of {size} bytes to buffer {b} at {o} differs"));
        }
    }
    Ok(())
}

/// Random source and zeroed destination of `n` bytes for the single-copy cases.
fn host_pair(seed: u64, n: usize) -> (Vec<u8>, Vec<u8>) {
    (random_vec(&mut fastrand::Rng::with_seed(seed), n), vec![0u8; n])
}

/// `--large` single copies, pageable and pinned, each way; then both directions at once
/// (half up, half down) on the pinned memory.
fn large(d: &Device, raw: &Raw, args: &Args, rows: &mut Vec<Row>) -> BenchResult<()> {
    let n = args.large;
    let (mut src, mut dst) = host_pair(77, n);
    let b = d.allocate(n as u64).map_err(error)?;
    let result = (|| {
        let (up, down) = up_down(d, raw, args.reps, b, (&src, &mut dst), false, 1)?;
        rows.push(Row::from_times(format!("H2D {} from pageable", human(n)), n, &up));
        rows.push(Row::from_times(format!("D2H {} into pageable", human(n)), n, &down));
        with_pinned(d, &mut src, &mut dst, |src, dst| {
            let (up, down) = up_down(d, raw, args.reps, b, (src, dst), true, 1)?;
            rows.push(Row::from_times(format!("H2D {} pinned", human(n)), n, &up));
            rows.push(Row::from_times(format!("D2H {} pinned", human(n)), n, &down));
            let half = (n / 2).max(1);
            let other = d.allocate(half as u64).map_err(error)?;
            let both = both_ways(d, raw, args.reps, (b, other), (&src[..half], &mut dst[..half]), true, 1);
            d.free(other).map_err(error)?;
            rows.push(Row::from_times(
                format!("both directions, 2 x {} pinned", human(half)),
                2 * half,
                &both?,
            ));
            Ok(())
        })
    })();
    d.free(b).map_err(error)?;
    result
}

/// One copy, submit to done, of every size in `sizes`: H2D and D2H from pageable and pinned
/// memory, or (`upload_only`) H2D from pageable memory alone, the default suite's row.
/// Each gives two rows, the median and the 99th percentile per copy in µs.
fn latency(
    d: &Device,
    raw: &Raw,
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
        let b = d.allocate(size as u64).map_err(error)?;
        let mut measure = |src: &mut [u8], dst: &mut [u8], pinned: bool| -> BenchResult<()> {
            let mut found =
                vec![Single::new(d, raw.stream, b, Host::Src(&*src), pinned, true)?.latencies(args.reps)?];
            if !upload_only {
                found
                    .push(Single::new(d, raw.stream, b, Host::Dst(dst), pinned, true)?.latencies(args.reps)?);
            }
            let memory = if pinned { "pinned" } else { "pageable" };
            for (dir, t) in ["H2D", "D2H"].into_iter().zip(found) {
                for (i, stat) in ["median", "p99"].into_iter().enumerate() {
                    rows.push(
                        Row::new(
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
        let result = memories.iter().try_for_each(|&pinned| {
            if pinned {
                with_pinned(d, src, dst, |src, dst| measure(&mut src[..size], &mut dst[..size], true))
            } else {
                measure(&mut src[..size], &mut dst[..size], false)
            }
        });
        d.free(b).map_err(error)?;
        result?;
    }
    Ok(())
}

/// The sweep's sizes: 4 KiB, x16 apart, up to `large`, and `large` itself.
fn sweep_sizes(large: usize) -> Vec<usize> {
    let mut sizes: Vec<usize> =
        (0..).map(|i| 4096usize << (4 * i)).take_while(|&size| size <= large).collect();
    if sizes.last() != Some(&large) {
        sizes.push(large);
    }
    sizes
}

/// Single copies of every sweep size, pageable and pinned: H2D, D2H and both directions at
/// once, against the raw driver (and the batch API with one copy, one way). Each sample
/// moves at least 16 MiB each way.
fn sweep(d: &Device, raw: &Raw, args: &Args, rows: &mut Vec<Row>, progress: &ProgressBar) -> BenchResult<()> {
    let n = args.large;
    let (mut src, mut dst) = host_pair(11, n);
    let b = d.allocate(n as u64).map_err(error)?;
    let other = match d.allocate(n as u64) {
        Ok(other) => other,
        Err(e) => {
            let _ = d.free(b);
            return Err(error(e));
        }
    };
    let result = (|| {
        for pinned in [false, true] {
            let memory = if pinned { "pinned" } else { "pageable" };
            let mut run = |src: &mut [u8], dst: &mut [u8]| -> BenchResult<()> {
                for size in sweep_sizes(n) {
                    progress.set_message(format!("sweep: {} {memory}", human(size)));
                    let iters = (16usize << 20).div_ceil(size);
                    let host = (&src[..size], &mut dst[..size]);
                    let (up, down) = up_down(d, raw, args.reps, b, host, pinned, iters)?;
                    let host = (&src[..size], &mut dst[..size]);
                    let both = both_ways(d, raw, args.reps, (b, other), host, pinned, iters)?;
                    let bytes = size * iters;
                    let case = |dir: &str| format!("sweep {dir} {memory} {}", human(size));
                    rows.extend([
                        Row::from_times(case("H2D"), bytes, &up).sized(size),
                        Row::from_times(case("D2H"), bytes, &down).sized(size),
                        Row::from_times(case("both"), 2 * bytes, &both).sized(size),
                    ]);
                    progress.inc(1);
                }
                Ok(())
            };
            if pinned {
                with_pinned(d, &mut src, &mut dst, run)?;
            } else {
                run(&mut src, &mut dst)?;
            }
        }
        Ok(())
    })();
    d.free(other).map_err(error)?;
    d.free(b).map_err(error)?;
    result
}

/// The SVG plots, bandwidth against bytes per copy: many small copies (a color per count)
/// and the size sweep (a color per direction), the line's style telling the method.
fn plots(rows: &[Row], out: &std::path::Path) -> BenchResult<Vec<PathBuf>> {
    use plot::{Series, Stroke};
    type Pick = fn(&Row) -> Option<f64>;
    let methods: [(&str, Pick, Stroke); 3] = [
        ("raw driver", |r| r.raw, Stroke::Dashed),
        ("cuMemcpyBatchAsync", |r| r.batch, Stroke::Dotted),
        ("cuda-resident", |r| Some(r.ours), Stroke::Solid),
    ];
    // One line per method over the rows that `matches`, in color `color`.
    let series = |matches: &dyn Fn(&Row) -> bool, label: &str, color: usize| -> Vec<Series> {
        let matching: Vec<&Row> = rows.iter().filter(|r| r.size.is_some() && matches(r)).collect();
        methods
            .iter()
            .map(|&(method, pick, stroke)| Series {
                name: format!("{method}, {label}"),
                points: matching.iter().filter_map(|r| Some((r.size? as f64, pick(r)?))).collect(),
                color,
                stroke,
            })
            .filter(|s| !s.points.is_empty())
            .collect()
    };
    let mut counts: Vec<usize> = rows.iter().filter_map(|r| r.count).collect();
    counts.sort_unstable();
    counts.dedup();
    let many_small = |starts: &str, ends: &str| -> Vec<Series> {
        counts
            .iter()
            .enumerate()
            .flat_map(|(color, &count)| {
                let matches =
                    |r: &Row| r.count == Some(count) && r.case.starts_with(starts) && r.case.ends_with(ends);
                series(&matches, &format!("{count} copies"), color)
            })
            .collect()
    };
    let sweep = |memory: &str| -> Vec<Series> {
        ["H2D", "D2H", "both"]
            .iter()
            .enumerate()
            .flat_map(|(color, dir)| {
                let prefix = format!("sweep {dir} {memory} ");
                series(&|r: &Row| r.case.starts_with(&prefix), dir, color)
            })
            .collect()
    };
    let charts = [
        (
            "many-small-h2d.svg",
            "many small copies, H2D from pageable: bandwidth by copy size",
            many_small("H2D", "from pageable"),
        ),
        (
            "many-small-d2h.svg",
            "many small copies, D2H into caller Vecs: bandwidth by copy size",
            many_small("D2H", "into caller Vecs"),
        ),
        ("sweep-pageable.svg", "single copies, pageable memory: bandwidth by size", sweep("pageable")),
        ("sweep-pinned.svg", "single copies, pinned memory: bandwidth by size", sweep("pinned")),
    ];
    let mut written = Vec::new();
    for (file, title, lines) in charts {
        if !lines.is_empty() {
            let path = out.join(file);
            plot::bandwidth_chart(&path, title, &lines)?;
            written.push(path);
        }
    }
    Ok(written)
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

/// The PCIe link of the device at `bus_id` (`0000:00:06.0`) as Linux reports it under
/// `root` (`/sys/bus/pci/devices`): `PCIe 32.0 GT/s x16 (max 32.0 GT/s x16)`, or `None`
/// where the files are not there (another system, a container without sysfs).
fn pci_link(root: &std::path::Path, bus_id: &str) -> Option<String> {
    let dir = root.join(bus_id.to_ascii_lowercase());
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok().map(|s| s.trim().to_owned());
    let speed = |s: String| s.trim_end_matches(" PCIe").to_owned();
    let (now_speed, now_width) = (speed(read("current_link_speed")?), read("current_link_width")?);
    // Virtual slots may say "Unknown" or a width of 0.
    if !now_speed.contains("GT/s") || now_width == "0" {
        return None;
    }
    let mut link = format!("PCIe {now_speed} x{now_width}");
    if let (Some(max_speed), Some(max_width)) = (read("max_link_speed"), read("max_link_width")) {
        link.push_str(&format!(" (max {} x{max_width})", speed(max_speed)));
    }
    Some(link)
}

/// The device's link, or "unknown".
fn link_of(d: &Device) -> String {
    pci_link(std::path::Path::new("/sys/bus/pci/devices"), &d.info().pci_bus_id)
        .unwrap_or_else(|| "link unknown".to_owned())
}

/// What the report says about the device.
fn device_json(d: &Device) -> serde_json::Value {
    let i = d.info();
    serde_json::json!({
        "name": i.name, "ordinal": i.ordinal, "pci_bus_id": i.pci_bus_id, "link": link_of(d),
        "total_memory": i.total_memory,
        "compute_capability": [i.compute_capability.0, i.compute_capability.1],
        "copy_engines": i.copy_engines, "driver_cuda_version": i.driver_version.to_string(),
        "cuMemcpyBatchAsync": i.batch_memcpy,
    })
}

/// What a suite runs, worked out from the flags before any device is touched.
#[derive(Debug, PartialEq, Eq)]
struct Plan {
    /// Many-small cases, `(count, size)`.
    many_small: Vec<(usize, usize)>,
    /// Many-small cases over `--max-case-mib`, said in the report.
    skipped: Vec<String>,
    large: bool,
    /// Latency sizes, and whether only uploads from pageable memory are timed.
    latency: Option<(Vec<usize>, bool)>,
    sweep: bool,
    alloc: bool,
    /// The peer suite's many-small cases, `(count, size)`, when it runs.
    peer: Option<Vec<(usize, usize)>>,
}

impl Plan {
    fn new(args: &Args) -> Plan {
        use Suite::*;
        let s = args.suite;
        let counts = match (&args.counts, s) {
            (_, Sweep | Latency | Alloc) => Vec::new(),
            (Some(counts), _) => counts.clone(),
            (None, Default | Peer) => vec![DEFAULT_COUNT],
            (None, _) => GRID_COUNTS.to_vec(),
        };
        let limit = args.max_case_mib.saturating_mul(1 << 20);
        let (mut many_small, mut skipped) = (Vec::new(), Vec::new());
        for &count in &counts {
            for &size in &args.sizes {
                match count.checked_mul(size) {
                    Some(bytes) if bytes <= limit => many_small.push((count, size)),
                    _ => skipped.push(format!(
                        "{count} x {}: more than --max-case-mib {} MiB",
                        human(size),
                        args.max_case_mib
                    )),
                }
            }
        }
        let latency = match s {
            Default => Some((vec![4096], true)),
            Latency | All => Some((args.latency_sizes.clone(), false)),
            _ => None,
        };
        let peer = matches!(s, Peer | All).then(|| many_small.clone());
        Plan {
            many_small: if s == Peer { Vec::new() } else { many_small },
            skipped,
            large: matches!(s, Default | All),
            latency,
            sweep: matches!(s, Sweep | All),
            alloc: matches!(s, Alloc | All),
            peer,
        }
    }

    /// Steps of the progress bar.
    fn steps(&self, args: &Args) -> u64 {
        let sweep = if self.sweep { 2 * sweep_sizes(args.large).len() } else { 0 };
        (self.many_small.len()
            + usize::from(self.large)
            + self.latency.as_ref().map_or(0, |(sizes, _)| sizes.len())
            + sweep
            + usize::from(self.alloc)
            + self.peer.as_deref().map_or(0, peer::steps)) as u64
    }
}

fn config(args: &Args) -> BenchResult<cuda_resident::Config> {
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

fn run(
    args: &Args,
    plan: &mut Plan,
    config: cuda_resident::Config,
) -> BenchResult<(Vec<Row>, serde_json::Value)> {
    let driver =
        cuda_resident::cuda_sys::Driver::load().map(std::sync::Arc::new).map_err(|e| e.to_string())?;
    let d = Device::open_with(driver, args.device, config).map_err(error)?;
    d.make_current().map_err(error)?;
    let raw = Raw::new(&d)?;
    // Counted only where the peer suite runs, which needs two.
    let gpus = if plan.peer.is_some() { Device::count().map_err(error)? } else { 0 };
    if plan.peer.is_some() && gpus < 2 {
        if args.suite == Suite::Peer {
            return Err(format!("{}. {}", peer::too_few(gpus), peer::FEW_FIX));
        }
        plan.peer = None;
        plan.skipped.push(format!("peer: {}", peer::too_few(gpus)));
    }
    println!("xfer-bench | {PROVENANCE}");
    let info = d.info();
    let c = d.config();
    println!(
        "cuda-resident config: chunk {} KiB, direct threshold {} KiB, {} packing threads (linger {} µs), small copies in order {}",
        c.chunk_bytes >> 10,
        c.direct_threshold >> 10,
        c.resolved_pack_threads(),
        c.pack_linger_us,
        if d.small_copies_over_bus() { "over the bus" } else { "through device staging" }
    );
    println!(
        "device {}: {} | {} | {} | driver CUDA {} | {} copy engines",
        info.ordinal,
        info.name,
        info.pci_bus_id,
        link_of(&d),
        info.driver_version,
        info.copy_engines
    );
    for skipped in &plan.skipped {
        println!("skipped: {skipped}");
    }
    let mut rows = Vec::new();
    let progress = ProgressBar::new(plan.steps(args)).with_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {elapsed} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    for &(count, size) in &plan.many_small {
        progress.set_message(format!("{count} x {}", human(size)));
        many_small(&d, &raw, args, (count, size), &mut rows)?;
        progress.inc(1);
    }
    if plan.large {
        progress.set_message(format!("{} single copies", human(args.large)));
        large(&d, &raw, args, &mut rows)?;
        progress.inc(1);
    }
    if let Some((sizes, upload_only)) = &plan.latency {
        for &size in sizes {
            progress.set_message(format!("latency {}", human(size)));
            latency(&d, &raw, args, &[size], *upload_only, &mut rows)?;
            progress.inc(1);
        }
    }
    if plan.sweep {
        sweep(&d, &raw, args, &mut rows, &progress)?;
    }
    if plan.alloc {
        progress.set_message("allocation");
        let threads = std::thread::available_parallelism().map_or(16, |n| n.get()).min(16);
        let r = cuda_resident_suite::alloc_bench::measure(&d, threads)?;
        let ns = |case: String, raw, batch, ours| Row::new(case, "ns", raw, batch, ours);
        rows.push(ns(
            "allocate + free 1 MiB, 1 thread".into(),
            Some(r.raw_alloc_ns),
            Some(r.raw_async_ns),
            r.one_thread_ns,
        ));
        rows.push(ns(
            format!("allocate + free 1 MiB, {threads} threads each"),
            None,
            None,
            r.many_threads_ns,
        ));
        rows.push(ns("pinned staging 1 MiB acquire + return".into(), Some(r.raw_host_ns), None, r.pinned_ns));
        println!("size-class waste on 4000 buffers of uniform 1 B..4 MiB: {:.2} %", r.waste_percent);
        progress.inc(1);
    }
    if let Some(cases) = &plan.peer {
        peer::run(&d, &raw, args, gpus, cases, &mut rows, &progress)?;
    }
    progress.finish_and_clear();
    drop(raw);
    Ok((rows, device_json(&d)))
}

fn main() -> ExitCode {
    let mut args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) if !e.use_stderr() => e.exit(), // --help, --version
        Err(e) => {
            eprintln!("xfer-bench: {}", usage_line(&e));
            return ExitCode::from(2);
        }
    };
    args.reps = args.reps.max(5);
    let mut plan = Plan::new(&args);
    let outcome = config(&args).and_then(|config| run(&args, &mut plan, config));
    let (rows, device) = match outcome {
        Ok(done) => done,
        Err(message) => {
            eprintln!("xfer-bench: {message}");
            return ExitCode::from(2);
        }
    };
    let fmt = |v: Option<f64>| v.map_or("n/a".to_string(), |v| format!("{v:.2}"));
    println!(
        "{:<40} {:>5} {:>10} {:>12} {:>14} {:>8} {:>9}",
        "case", "unit", "raw", "batch API", "cuda-resident", "vs raw", "vs batch"
    );
    for r in &rows {
        println!(
            "{:<40} {:>5} {:>10} {:>12} {:>14.2} {:>8} {:>9}",
            r.case,
            r.unit,
            fmt(r.raw),
            fmt(r.batch),
            r.ours,
            r.ratio(r.raw),
            r.ratio(r.batch)
        );
    }
    for r in rows.iter().filter(|r| r.note.is_some()) {
        println!("note: {}: {}", r.case, r.note.as_deref().unwrap_or_default());
    }
    let report = serde_json::json!({
        "provenance": { "git": PROVENANCE.git_revision, "rustc": PROVENANCE.rustc, "profile": PROVENANCE.profile, "target": PROVENANCE.target },
        "device": device,
        "suite": format!("{:?}", args.suite).to_lowercase(),
        "reps": args.reps,
        "skipped": plan.skipped,
        "rows": rows.iter().map(Row::json).collect::<Vec<_>>(),
    });
    if let Err(e) = std::fs::create_dir_all(&args.out).and_then(|()| {
        std::fs::write(
            args.out.join("report.json"),
            serde_json::to_string_pretty(&report).unwrap_or_default(),
        )
    }) {
        eprintln!(
            "xfer-bench: could not write the report to {}: {e}. Fix: pass --out with a writable folder.",
            args.out.display()
        );
        return ExitCode::from(2);
    }
    println!("report: {}", args.out.join("report.json").display());
    match plots(&rows, &args.out) {
        Ok(files) => files.iter().for_each(|f| println!("plot: {}", f.display())),
        Err(message) => {
            eprintln!("xfer-bench: {message}. Fix: pass --out with a writable folder.");
            return ExitCode::from(2);
        }
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod link_tests {
    use super::pci_link;

    #[test]
    fn the_link_is_read_from_sysfs_files_and_missing_files_give_none() {
        let root = std::env::temp_dir().join(format!("xfer-bench-sysfs-{}", std::process::id()));
        // The driver may spell the bus id in upper case; sysfs names are lower case.
        let dir = root.join("0000:1a:00.0");
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(pci_link(&root, "0000:1A:00.0"), None, "no files");
        std::fs::write(dir.join("current_link_speed"), "Unknown\n").unwrap();
        std::fs::write(dir.join("current_link_width"), "0\n").unwrap();
        assert_eq!(pci_link(&root, "0000:1A:00.0"), None, "a virtual slot");
        std::fs::write(dir.join("current_link_speed"), "32.0 GT/s PCIe\n").unwrap();
        std::fs::write(dir.join("current_link_width"), "16\n").unwrap();
        assert_eq!(pci_link(&root, "0000:1A:00.0").as_deref(), Some("PCIe 32.0 GT/s x16"));
        std::fs::write(dir.join("max_link_speed"), "32.0 GT/s PCIe\n").unwrap();
        std::fs::write(dir.join("max_link_width"), "16\n").unwrap();
        assert_eq!(
            pci_link(&root, "0000:1A:00.0").as_deref(),
            Some("PCIe 32.0 GT/s x16 (max 32.0 GT/s x16)")
        );
        std::fs::remove_dir_all(&root).unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(flags: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("xfer-bench").chain(flags.iter().copied()))
    }

    #[test]
    fn plots_are_written_for_measured_rows() {
        let mut rows = Vec::new();
        for (i, size) in [256usize, 4096, 65536].into_iter().enumerate() {
            for count in [1024, 8192] {
                for case in [
                    format!("H2D {count} x {} from pageable", human(size)),
                    format!("D2H {count} x {} into caller Vecs", human(size)),
                ] {
                    let mut r = Row::gbps(case, size * count, Some(0.1 * (i + 1) as f64), Some(0.2), 1.0);
                    (r.count, r.size) = (Some(count), Some(size));
                    rows.push(r);
                }
            }
            for dir in ["H2D", "D2H", "both"] {
                for memory in ["pinned", "pageable"] {
                    let case = format!("sweep {dir} {memory} {}", human(size));
                    rows.push(Row::gbps(case, size, Some(1.0), None, 2.0 + i as f64).sized(size));
                }
            }
        }
        let out = std::env::temp_dir().join(format!("xfer-bench-plot-test-{}", std::process::id()));
        std::fs::create_dir_all(&out).unwrap();
        let files = plots(&rows, &out).unwrap();
        let names: Vec<_> = files.iter().filter_map(|f| f.file_name()?.to_str()).collect();
        assert_eq!(
            names,
            ["many-small-h2d.svg", "many-small-d2h.svg", "sweep-pageable.svg", "sweep-pinned.svg"]
        );
        for f in &files {
            let svg = std::fs::read_to_string(f).unwrap();
            assert!(svg.starts_with("<svg") && svg.contains("cuda-resident"), "{}", f.display());
        }
        let h2d = std::fs::read_to_string(&files[0]).unwrap();
        assert!(h2d.contains("1024 copies") && h2d.contains("8192 copies"), "a series per count");
        std::fs::remove_dir_all(&out).unwrap();
    }

    #[test]
    fn suites_plan_their_cases() {
        let default = Plan::new(&parse(&[]).unwrap());
        assert_eq!(default.many_small, [(8192, 256), (8192, 4096), (8192, 65536)]);
        assert!(default.large && !default.sweep && !default.alloc && default.skipped.is_empty());
        assert_eq!(default.latency, Some((vec![4096], true)));

        let grid = Plan::new(&parse(&["--suite", "grid"]).unwrap());
        assert_eq!(grid.many_small.len(), 8, "65536 x 64 KiB is 4 GiB, over the 1 GiB limit");
        assert_eq!(grid.skipped, ["65536 x 64 KiB: more than --max-case-mib 1024 MiB"]);
        assert!(!grid.large && grid.latency.is_none() && !grid.sweep);

        let all = Plan::new(&parse(&["--suite", "all", "--max-case-mib", "4096"]).unwrap());
        assert_eq!(all.many_small.len(), 9);
        assert!(all.large && all.sweep && all.alloc);
        assert_eq!(all.latency, Some((vec![4, 256, 4096, 65536], false)));

        let counts = Plan::new(&parse(&["--count", "100", "--sizes", "8"]).unwrap());
        assert_eq!(counts.many_small, [(100, 8)]);
        let latency = Plan::new(&parse(&["--suite", "latency", "--counts", "5"]).unwrap());
        assert!(latency.many_small.is_empty() && latency.latency.is_some());

        let peer = Plan::new(&parse(&["--suite", "peer"]).unwrap());
        assert_eq!(peer.peer.as_deref(), Some(&default.many_small[..]));
        assert!(peer.many_small.is_empty() && !peer.large && peer.latency.is_none() && !peer.alloc);
        assert_eq!(all.peer.as_ref().map(Vec::len), Some(9), "the grid's cases");
        assert!(default.peer.is_none() && grid.peer.is_none());
    }

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

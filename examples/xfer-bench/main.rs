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
//! missing and how to fix it.

mod plot;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use cuda_resident::cuda_sys::{self, CUDA_SUCCESS, CUdeviceptr, CUresult, CUstream, MissingSymbol, call};
use cuda_resident::{Device, Readback, ResidentBuffer, Slot};
use cuda_resident_suite::PROVENANCE;
use indicatif::{ProgressBar, ProgressStyle};

/// Which cases to run.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Suite {
    /// Many small copies, 1 GiB single copies, both directions at once, latency (under a minute).
    Default,
    /// Single copies from 4 KiB to `--large`, pageable and pinned, both directions.
    Sweep,
    /// Allocation: device memory and pinned staging against cuMemAlloc, cuMemAllocAsync (in
    /// the "batch API" column) and cuMemHostAlloc.
    Alloc,
    /// Everything.
    All,
}

/// Side-by-side transfer benchmarks: raw driver, cuMemcpyBatchAsync, cuda-resident.
#[derive(Parser, Debug)]
#[command(
    version,
    about = "Side-by-side transfer benchmarks: the raw CUDA driver, cuMemcpyBatchAsync and cuda-resident, in one run."
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
    /// Copies per many-small case.
    #[arg(long, default_value_t = 8192)]
    count: usize,
    /// Copy sizes of the many-small cases, in bytes.
    #[arg(long, value_delimiter = ',', default_values_t = vec![256, 4096, 65536])]
    sizes: Vec<usize>,
    /// Bytes of the large single-copy cases.
    #[arg(long, default_value_t = 1 << 30)]
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
    /// Also print where the time of an upload batch goes (adding writes, submit, wait).
    #[arg(long)]
    breakdown: bool,
    /// Folder for the JSON report and the SVG plots.
    #[arg(long, default_value = "target/xfer-bench")]
    out: PathBuf,
}

type BenchResult<T> = Result<T, String>;

fn check(what: &str, code: Result<CUresult, MissingSymbol>) -> BenchResult<()> {
    match code {
        Ok(CUDA_SUCCESS) => Ok(()),
        Ok(code) => Err(format!("{what} failed with CUresult {code}")),
        Err(e) => Err(e.to_string()),
    }
}

/// Median seconds of `reps` runs of `run`, after one warm-up run.
fn median_secs(reps: usize, mut run: impl FnMut() -> BenchResult<()>) -> BenchResult<f64> {
    run()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        run()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Median seconds of `reps` timed runs of `timed` on what `prepare` made (untimed), after
/// one warm-up run.
fn median_secs_prepared<T>(
    reps: usize,
    mut prepare: impl FnMut() -> BenchResult<T>,
    mut timed: impl FnMut(T) -> BenchResult<()>,
) -> BenchResult<f64> {
    timed(prepare()?)?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let input = prepare()?;
        let t = Instant::now();
        timed(input)?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// One row of the report.
#[derive(Debug)]
struct Row {
    case: String,
    /// Bytes per copy, for the plots (cases that sweep a size).
    size: Option<usize>,
    unit: &'static str,
    raw: Option<f64>,
    batch: Option<f64>,
    ours: f64,
}

impl Row {
    fn gbps(case: String, bytes: usize, raw: Option<f64>, batch: Option<f64>, ours: f64) -> Row {
        let rate = |secs: f64| bytes as f64 / secs / 1e9;
        Row { case, size: None, unit: "GB/s", raw: raw.map(rate), batch: batch.map(rate), ours: rate(ours) }
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
            "case": self.case, "unit": self.unit, "raw": self.raw, "batch": self.batch,
            "cuda_resident": self.ours,
        })
    }
}

/// The raw side: a stream of the device's context and the driver table.
struct Raw<'d> {
    device: &'d Device,
    stream: CUstream,
    batch: bool,
}

impl Raw<'_> {
    fn sync(&self) -> BenchResult<()> {
        // SAFETY: the stream is live.
        check("cuStreamSynchronize", unsafe { call!(self.device.driver(), cuStreamSynchronize(self.stream)) })
    }

    /// One `cuMemcpyBatchAsync` over all copies, host sources or destinations as `host_to_device` says.
    fn memcpy_batch(
        &self,
        dsts: &mut [u64],
        srcs: &mut [u64],
        sizes: &mut [usize],
        host_to_device: bool,
    ) -> BenchResult<()> {
        let host = cuda_sys::CUmemLocation { type_: cuda_sys::CU_MEM_LOCATION_TYPE_HOST, id: 0 };
        let dev = cuda_sys::CUmemLocation {
            type_: cuda_sys::CU_MEM_LOCATION_TYPE_DEVICE,
            id: self.device.info().ordinal as i32,
        };
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
                self.device.driver(),
                cuMemcpyBatchAsync_v2(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    sizes.len(),
                    &mut attrs,
                    &mut idx,
                    1,
                    self.stream
                )
            )
        })?;
        self.sync()
    }
}

impl Raw<'_> {
    /// One copy through `cuMemcpyBatchAsync` (count 1), or `None` when the driver lacks it.
    fn batch_one(
        &self,
        reps: usize,
        dst: u64,
        src: u64,
        len: usize,
        host_to_device: bool,
    ) -> BenchResult<Option<f64>> {
        if !self.batch {
            return Ok(None);
        }
        let (mut d, mut s, mut n) = ([dst], [src], [len]);
        median_secs(reps, || self.memcpy_batch(&mut d, &mut s, &mut n, host_to_device)).map(Some)
    }
}

fn random_vec(rng: &mut fastrand::Rng, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rng.fill(&mut v);
    v
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

    /// Reads every copy's range back as one batch.
    fn read_all(&self, d: &Device, size: usize) -> cuda_resident::Result<(Vec<Slot>, Readback)> {
        let mut reads = d.readbacks();
        let slots = self
            .places
            .iter()
            .map(|&(b, o)| reads.read(self.buffers[b], o, size as u64))
            .collect::<Result<_, _>>()?;
        Ok((slots, reads.submit()?.wait()?))
    }

    fn free(self, d: &Device) {
        for b in self.buffers {
            let _ = d.free(b);
        }
    }
}

fn many_small(d: &Device, raw: &Raw, args: &Args, size: usize, rows: &mut Vec<Row>) -> BenchResult<()> {
    let first = rows.len();
    many_small_rows(d, raw, args, size, rows)?;
    for r in &mut rows[first..] {
        r.size = Some(size);
    }
    Ok(())
}

fn many_small_rows(d: &Device, raw: &Raw, args: &Args, size: usize, rows: &mut Vec<Row>) -> BenchResult<()> {
    let count = args.count;
    let bytes = count * size;
    let mut rng = fastrand::Rng::with_seed(size as u64);
    let sources: Vec<Vec<u8>> = (0..count).map(|_| random_vec(&mut rng, size)).collect();
    let s = Scatter::new(d, count, size)?;
    let e = |e: cuda_resident::Error| e.to_string();

    // Host to device.
    let raw_h2d = median_secs(args.reps, || {
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
        Some(median_secs(args.reps, || raw.memcpy_batch(&mut dsts, &mut srcs, &mut sizes, true))?)
    } else {
        None
    };
    let ours_h2d = median_secs(args.reps, || {
        let mut batch = d.uploads();
        for (src, &(b, o)) in sources.iter().zip(&s.places) {
            batch.write(s.buffers[b], o, src).map_err(e)?;
        }
        batch.submit().map_err(e)?.wait().map_err(e)
    })?;
    verify_scatter(d, &s, &sources, size, "H2D")?;
    if args.breakdown {
        // Where the time of one batch goes, from the outside: adding writes, submit
        // (planning, packing, enqueueing), waiting.
        let mut parts = [Vec::new(), Vec::new(), Vec::new()];
        for _ in 0..args.reps {
            let t = Instant::now();
            let mut batch = d.uploads();
            for (src, &(b, o)) in sources.iter().zip(&s.places) {
                batch.write(s.buffers[b], o, src).map_err(e)?;
            }
            let t1 = Instant::now();
            let fence = batch.submit().map_err(e)?;
            let t2 = Instant::now();
            fence.wait().map_err(e)?;
            let t3 = Instant::now();
            parts[0].push(t1 - t);
            parts[1].push(t2 - t1);
            parts[2].push(t3 - t2);
        }
        let med = |v: &mut Vec<std::time::Duration>| {
            v.sort();
            v[v.len() / 2].as_secs_f64() * 1e6
        };
        let len = d.buffer_len(s.buffers[0]).map_err(e)?;
        let requests: Vec<_> = s
            .places
            .iter()
            .map(|&(b, o)| cuda_resident::plan::WriteRequest {
                buffer: b as u64,
                buffer_len: len,
                offset: o,
                len: size as u64,
            })
            .collect();
        let config = cuda_resident::plan::PlanConfig::default();
        let (mut planner, mut plan) =
            (cuda_resident::plan::Planner::new(), cuda_resident::plan::UploadPlan::default());
        let mut planning = Vec::new();
        for _ in 0..args.reps.max(20) {
            let t = Instant::now();
            planner.plan_upload_into(&requests, &config, &mut plan).map_err(|e| e.to_string())?;
            planning.push(t.elapsed());
        }
        eprintln!(
            "breakdown H2D {count} x {}: write {:.0} µs, submit {:.0} µs (planning alone {:.0} µs), wait {:.0} µs",
            human(size),
            med(&mut parts[0]),
            med(&mut parts[1]),
            med(&mut planning),
            med(&mut parts[2])
        );
    }
    let ours_in_place = median_secs(args.reps, || {
        let mut batch = d.uploads();
        for (src, &(b, o)) in sources.iter().zip(&s.places) {
            batch.write_with(s.buffers[b], o, size, |dst| dst.copy_from_slice(src)).map_err(e)?;
        }
        batch.submit().map_err(e)?.wait().map_err(e)
    })?;
    verify_scatter(d, &s, &sources, size, "H2D write_with")?;
    // The bytes already in pinned staging (written in place before the clock starts): what
    // the link and the scatter cost.
    let ours_staged = median_secs_prepared(
        args.reps,
        || {
            let mut batch = d.uploads();
            for (src, &(b, o)) in sources.iter().zip(&s.places) {
                batch.write_with(s.buffers[b], o, size, |dst| dst.copy_from_slice(src)).map_err(e)?;
            }
            Ok(batch)
        },
        |batch| batch.submit().map_err(e)?.wait().map_err(e),
    )?;
    verify_scatter(d, &s, &sources, size, "H2D write_with, staged")?;
    let name = |what: &str| format!("H2D {count} x {} {what}", human(size));
    rows.push(Row::gbps(name("from pageable"), bytes, Some(raw_h2d), batch_h2d, ours_h2d));
    rows.push(Row::gbps(name("write_with, fill+move"), bytes, Some(raw_h2d), batch_h2d, ours_in_place));
    rows.push(Row::gbps(name("write_with, move only"), bytes, Some(raw_h2d), batch_h2d, ours_staged));

    // Device to host: the sources now hold `sources`.
    let mut outs: Vec<Vec<u8>> = (0..count).map(|_| vec![0u8; size]).collect();
    let raw_d2h = median_secs(args.reps, || {
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
        Some(median_secs(args.reps, || raw.memcpy_batch(&mut dsts, &mut srcs, &mut sizes, false))?)
    } else {
        None
    };
    for o in &mut outs {
        o.fill(0xA5);
    }
    let ours_d2h = median_secs(args.reps, || {
        let mut reads = d.readbacks();
        let slots = s
            .places
            .iter()
            .map(|&(b, o)| reads.read(s.buffers[b], o, size as u64))
            .collect::<Result<Vec<_>, _>>()
            .map_err(e)?;
        reads.submit().map_err(e)?.wait_into(&slots, &mut outs).map(drop).map_err(e)
    })?;
    if outs != sources {
        return Err(format!("D2H {count} x {size} into Vecs: bytes differ"));
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
    assert_eq!(seen, count);
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
    s.free(d);
    Ok(())
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

fn large(d: &Device, raw: &Raw, args: &Args, rows: &mut Vec<Row>) -> BenchResult<()> {
    let n = args.large;
    let e = |e: cuda_resident::Error| e.to_string();
    let mut rng = fastrand::Rng::with_seed(77);
    let src = random_vec(&mut rng, n);
    let mut dst = vec![0u8; n];
    let b = d.allocate(n as u64).map_err(e)?;
    let ptr = d.device_ptr(b).map_err(e)?;

    // Pageable.
    let raw_up = median_secs(args.reps, || {
        // SAFETY: n-byte pageable source, n-byte device buffer.
        check("cuMemcpyHtoD", unsafe { call!(d.driver(), cuMemcpyHtoD_v2(ptr, src.as_ptr().cast(), n)) })
    })?;
    let ours_up = median_secs(args.reps, || d.upload(b, &src).map_err(e))?;
    let batch_up = raw.batch_one(args.reps, ptr, src.as_ptr() as u64, n, true)?;
    let batch_down = raw.batch_one(args.reps, dst.as_mut_ptr() as u64, ptr, n, false)?;
    let raw_down = median_secs(args.reps, || {
        // SAFETY: n-byte pageable destination.
        check("cuMemcpyDtoH", unsafe { call!(d.driver(), cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), ptr, n)) })
    })?;
    dst.fill(0xA5);
    let ours_down = median_secs(args.reps, || d.read_into_slice(b, 0, &mut dst).map_err(e))?;
    if dst != src {
        return Err("large pageable round trip: bytes differ".into());
    }
    rows.push(Row::gbps(format!("H2D {} from pageable", human(n)), n, Some(raw_up), batch_up, ours_up));
    rows.push(Row::gbps(format!("D2H {} into pageable", human(n)), n, Some(raw_down), batch_down, ours_down));

    // Pinned: the same host memory, registered.
    let (mut hsrc, mut hdst) = (src, dst);
    // SAFETY: both vectors stay alive and unmoved until unpinned below.
    unsafe {
        d.pin_host(hsrc.as_mut_ptr(), n).map_err(e)?;
        d.pin_host(hdst.as_mut_ptr(), n).map_err(e)?;
    }
    let result = (|| -> BenchResult<()> {
        let raw_up = median_secs(args.reps, || {
            // SAFETY: pinned n-byte source.
            check("cuMemcpyHtoDAsync", unsafe {
                call!(d.driver(), cuMemcpyHtoDAsync_v2(ptr, hsrc.as_ptr().cast(), n, raw.stream))
            })?;
            raw.sync()
        })?;
        let ours_up = median_secs(args.reps, || {
            // SAFETY: pinned n-byte source, alive until the fence is waited on.
            unsafe { d.upload_async_at(b, 0, hsrc.as_ptr(), n) }.and_then(|f| f.wait()).map_err(e)
        })?;
        let raw_down = median_secs(args.reps, || {
            // SAFETY: pinned n-byte destination.
            check("cuMemcpyDtoHAsync", unsafe {
                call!(d.driver(), cuMemcpyDtoHAsync_v2(hdst.as_mut_ptr().cast(), ptr, n, raw.stream))
            })?;
            raw.sync()
        })?;
        hdst.fill(0);
        let ours_down = median_secs(args.reps, || {
            // SAFETY: pinned n-byte destination, untouched until the fence is waited on.
            unsafe { d.download_async_at(b, 0, hdst.as_mut_ptr(), n) }.and_then(|f| f.wait()).map_err(e)
        })?;
        if hdst != hsrc {
            return Err("large pinned round trip: bytes differ".into());
        }
        let batch_up = raw.batch_one(args.reps, ptr, hsrc.as_ptr() as u64, n, true)?;
        let batch_down = raw.batch_one(args.reps, hdst.as_mut_ptr() as u64, ptr, n, false)?;
        rows.push(Row::gbps(format!("H2D {} pinned", human(n)), n, Some(raw_up), batch_up, ours_up));
        rows.push(Row::gbps(format!("D2H {} pinned", human(n)), n, Some(raw_down), batch_down, ours_down));

        // Both directions at once: half up, half down, on different buffers.
        let half = n / 2;
        let other = d.allocate(half as u64).map_err(e)?;
        let optr = d.device_ptr(other).map_err(e)?;
        let mut s2: CUstream = std::ptr::null_mut();
        // SAFETY: creates a second raw stream on the current context.
        check("cuStreamCreate", unsafe {
            call!(d.driver(), cuStreamCreate(&mut s2, cuda_sys::CU_STREAM_NON_BLOCKING))
        })?;
        let raw_both = median_secs(args.reps, || {
            // SAFETY: pinned halves, device ranges of `half` bytes.
            unsafe {
                check(
                    "cuMemcpyHtoDAsync",
                    call!(d.driver(), cuMemcpyHtoDAsync_v2(ptr, hsrc.as_ptr().cast(), half, raw.stream)),
                )?;
                check(
                    "cuMemcpyDtoHAsync",
                    call!(d.driver(), cuMemcpyDtoHAsync_v2(hdst.as_mut_ptr().cast(), optr, half, s2)),
                )?;
                check("cuStreamSynchronize", call!(d.driver(), cuStreamSynchronize(s2)))?;
            }
            raw.sync()
        })?;
        let ours_both = median_secs(args.reps, || {
            // SAFETY: pinned halves, alive until both fences are waited on.
            let (up, down) = unsafe {
                (
                    d.upload_async_at(b, 0, hsrc.as_ptr(), half).map_err(e)?,
                    d.download_async_at(other, 0, hdst.as_mut_ptr(), half).map_err(e)?,
                )
            };
            up.wait().map_err(e)?;
            down.wait().map_err(e)
        })?;
        // SAFETY: the stream is idle and destroyed once.
        check("cuStreamDestroy", unsafe { call!(d.driver(), cuStreamDestroy_v2(s2)) })?;
        d.free(other).map_err(e)?;
        rows.push(Row::gbps(
            format!("both directions, 2 x {} pinned", human(half)),
            2 * half,
            Some(raw_both),
            None,
            ours_both,
        ));
        Ok(())
    })();
    // SAFETY: no copy uses the vectors any more (every case synchronized).
    unsafe {
        d.unpin_host(hsrc.as_mut_ptr()).map_err(e)?;
        d.unpin_host(hdst.as_mut_ptr()).map_err(e)?;
    }
    d.free(b).map_err(e)?;
    result
}

fn latency(d: &Device, raw: &Raw, args: &Args, rows: &mut Vec<Row>) -> BenchResult<()> {
    let e = |e: cuda_resident::Error| e.to_string();
    let mut rng = fastrand::Rng::with_seed(3);
    let data = random_vec(&mut rng, 4096);
    let b = d.allocate(4096).map_err(e)?;
    let ptr: CUdeviceptr = d.device_ptr(b).map_err(e)?;
    const N: usize = 2000;
    let per = |secs: f64| secs / N as f64 * 1e6;
    let raw_t = median_secs(args.reps, || {
        for _ in 0..N {
            // SAFETY: 4 KiB pageable source into a 4 KiB buffer.
            check("cuMemcpyHtoDAsync", unsafe {
                call!(d.driver(), cuMemcpyHtoDAsync_v2(ptr, data.as_ptr().cast(), 4096, raw.stream))
            })?;
            raw.sync()?;
        }
        Ok(())
    })?;
    let batch_t = if raw.batch {
        let (mut dst, mut src, mut len) = ([ptr], [data.as_ptr() as u64], [4096usize]);
        Some(median_secs(args.reps, || {
            for _ in 0..N {
                raw.memcpy_batch(&mut dst, &mut src, &mut len, true)?;
            }
            Ok(())
        })?)
    } else {
        None
    };
    let ours_t = median_secs(args.reps, || {
        for _ in 0..N {
            d.upload(b, &data).map_err(e)?;
        }
        Ok(())
    })?;
    if d.download(b).map_err(e)? != data {
        return Err("latency: bytes differ".into());
    }
    d.free(b).map_err(e)?;
    rows.push(Row {
        case: "one 4 KiB upload, submit to done".into(),
        size: None,
        unit: "µs",
        raw: Some(per(raw_t)),
        batch: batch_t.map(per),
        ours: per(ours_t),
    });
    Ok(())
}

/// Single copies of every size from 4 KiB up to `--large` (x16 apart), pageable and pinned,
/// each direction: the raw driver's synchronous (pageable) or async-then-synchronize (pinned)
/// copy against cuda-resident's `upload_at` / `read_into_slice` (pageable) and
/// `upload_async_at` / `download_async_at` (pinned). Each sample moves at least 16 MiB.
fn sweep(d: &Device, raw: &Raw, args: &Args, rows: &mut Vec<Row>, progress: &ProgressBar) -> BenchResult<()> {
    let e = |e: cuda_resident::Error| e.to_string();
    let n = args.large;
    let mut rng = fastrand::Rng::with_seed(11);
    let mut src = random_vec(&mut rng, n);
    let mut dst = vec![0u8; n];
    let b = d.allocate(n as u64).map_err(e)?;
    let ptr = d.device_ptr(b).map_err(e)?;
    let mut sizes: Vec<usize> = (0..).map(|i| 4096usize << (4 * i)).take_while(|&size| size <= n).collect();
    if sizes.last() != Some(&n) {
        sizes.push(n);
    }
    let driver = d.driver();
    for pinned in [false, true] {
        let memory = if pinned { "pinned" } else { "pageable" };
        if pinned {
            // SAFETY: both vectors stay alive and unmoved until unpinned below.
            unsafe {
                d.pin_host(src.as_mut_ptr(), n).map_err(e)?;
                d.pin_host(dst.as_mut_ptr(), n).map_err(e)?;
            }
        }
        for &size in &sizes {
            progress.set_message(format!("sweep: {} {memory}", human(size)));
            let iters = (16usize << 20).div_ceil(size);
            let (s_ptr, d_ptr) = (src.as_ptr(), dst.as_mut_ptr());
            let raw_up = median_secs(args.reps, || {
                for _ in 0..iters {
                    // SAFETY: `size` bytes of a live host vector into a buffer of `n >= size`.
                    unsafe {
                        if pinned {
                            check(
                                "cuMemcpyHtoDAsync",
                                call!(driver, cuMemcpyHtoDAsync_v2(ptr, s_ptr.cast(), size, raw.stream)),
                            )?;
                            raw.sync()?;
                        } else {
                            check("cuMemcpyHtoD", call!(driver, cuMemcpyHtoD_v2(ptr, s_ptr.cast(), size)))?;
                        }
                    }
                }
                Ok(())
            })?;
            let ours_up = median_secs(args.reps, || {
                for _ in 0..iters {
                    if pinned {
                        // SAFETY: pinned source of `size` bytes, alive until the fence is waited on.
                        unsafe { d.upload_async_at(b, 0, s_ptr, size) }.and_then(|f| f.wait()).map_err(e)?;
                    } else {
                        d.upload_at(b, 0, &src[..size]).map_err(e)?;
                    }
                }
                Ok(())
            })?;
            let raw_down = median_secs(args.reps, || {
                for _ in 0..iters {
                    // SAFETY: `size` bytes of the buffer into a live host vector of `n >= size`.
                    unsafe {
                        if pinned {
                            check(
                                "cuMemcpyDtoHAsync",
                                call!(driver, cuMemcpyDtoHAsync_v2(d_ptr.cast(), ptr, size, raw.stream)),
                            )?;
                            raw.sync()?;
                        } else {
                            check("cuMemcpyDtoH", call!(driver, cuMemcpyDtoH_v2(d_ptr.cast(), ptr, size)))?;
                        }
                    }
                }
                Ok(())
            })?;
            dst[..size].fill(0xA5);
            let ours_down = median_secs(args.reps, || {
                for _ in 0..iters {
                    if pinned {
                        // SAFETY: pinned destination of `size` bytes, untouched until the fence is waited on.
                        unsafe { d.download_async_at(b, 0, d_ptr, size) }
                            .and_then(|f| f.wait())
                            .map_err(e)?;
                    } else {
                        d.read_into_slice(b, 0, &mut dst[..size]).map_err(e)?;
                    }
                }
                Ok(())
            })?;
            if dst[..size] != src[..size] {
                return Err(format!("sweep {memory} {}: bytes differ", human(size)));
            }
            let bytes = size * iters;
            let mut up =
                Row::gbps(format!("sweep H2D {memory} {}", human(size)), bytes, Some(raw_up), None, ours_up);
            let mut down = Row::gbps(
                format!("sweep D2H {memory} {}", human(size)),
                bytes,
                Some(raw_down),
                None,
                ours_down,
            );
            (up.size, down.size) = (Some(size), Some(size));
            rows.extend([up, down]);
            progress.inc(1);
        }
        if pinned {
            // SAFETY: every copy above has completed.
            unsafe {
                d.unpin_host(src.as_mut_ptr()).map_err(e)?;
                d.unpin_host(dst.as_mut_ptr()).map_err(e)?;
            }
        }
    }
    d.free(b).map_err(e)
}

/// The SVG plots: many-small copies and the size sweep, bandwidth against bytes per copy.
fn plots(rows: &[Row], out: &std::path::Path) -> BenchResult<Vec<PathBuf>> {
    use plot::Series;
    type Pick = fn(&Row) -> Option<f64>;
    let methods: [(&str, Pick); 3] =
        [("raw driver", |r| r.raw), ("cuMemcpyBatchAsync", |r| r.batch), ("cuda-resident", |r| Some(r.ours))];
    let series = |starts: &str, ends: &str, label: &str| -> Vec<Series> {
        let matching: Vec<&Row> = rows
            .iter()
            .filter(|r| r.size.is_some() && r.case.starts_with(starts) && r.case.ends_with(ends))
            .collect();
        methods
            .iter()
            .map(|(method, pick)| Series {
                name: format!("{method}, {label}"),
                points: matching.iter().filter_map(|r| Some((r.size? as f64, pick(r)?))).collect(),
            })
            .filter(|s| !s.points.is_empty())
            .collect()
    };
    let charts = [
        (
            "many-small.svg",
            "8192 small copies: bandwidth by copy size",
            [
                series("H2D", "from pageable", "H2D from pageable"),
                series("D2H", "into caller Vecs", "D2H into Vecs"),
            ]
            .concat(),
        ),
        (
            "sweep.svg",
            "single copies: bandwidth by size",
            [
                series("sweep H2D pageable", "", "H2D pageable"),
                series("sweep D2H pageable", "", "D2H pageable"),
                series("sweep H2D pinned", "", "H2D pinned"),
                series("sweep D2H pinned", "", "D2H pinned"),
            ]
            .concat(),
        ),
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

/// What the report says about the device.
fn device_json(d: &Device) -> serde_json::Value {
    let i = d.info();
    serde_json::json!({
        "name": i.name, "ordinal": i.ordinal, "pci_bus_id": i.pci_bus_id, "total_memory": i.total_memory,
        "compute_capability": [i.compute_capability.0, i.compute_capability.1],
        "copy_engines": i.copy_engines, "driver_cuda_version": i.driver_version.to_string(),
        "cuMemcpyBatchAsync": i.batch_memcpy,
    })
}

fn run(args: &Args) -> BenchResult<(Vec<Row>, serde_json::Value)> {
    let mut config = cuda_resident::Config::default();
    if let Some(kib) = args.chunk_kib {
        config.chunk_bytes = kib << 10;
    }
    if let Some(kib) = args.direct_kib {
        config.direct_threshold = kib << 10;
    }
    if let Some(threads) = args.pack_threads {
        config.pack_threads = threads;
    }
    let driver =
        cuda_resident::cuda_sys::Driver::load().map(std::sync::Arc::new).map_err(|e| e.to_string())?;
    let d = Device::open_with(driver, args.device, config).map_err(|e| e.to_string())?;
    d.make_current().map_err(|e| e.to_string())?;
    let mut stream: CUstream = std::ptr::null_mut();
    // SAFETY: creates a stream on the device's context, current on this thread.
    check("cuStreamCreate", unsafe {
        call!(d.driver(), cuStreamCreate(&mut stream, cuda_sys::CU_STREAM_NON_BLOCKING))
    })?;
    let raw = Raw { device: &d, stream, batch: d.info().batch_memcpy };
    println!("xfer-bench | {PROVENANCE}");
    let info = d.info();
    let c = d.config();
    println!(
        "cuda-resident config: chunk {} KiB, direct threshold {} KiB, {} packing threads",
        c.chunk_bytes >> 10,
        c.direct_threshold >> 10,
        c.resolved_pack_threads()
    );
    println!(
        "device {}: {} | {} | driver CUDA {} | {} copy engines",
        info.ordinal, info.name, info.pci_bus_id, info.driver_version, info.copy_engines
    );
    let mut rows = Vec::new();
    let default = matches!(args.suite, Suite::Default | Suite::All);
    let sweep_steps = if matches!(args.suite, Suite::Sweep | Suite::All) {
        2 * (0..).map(|i| 4096usize << (4 * i)).take_while(|&size| size <= args.large).count() as u64 + 2
    } else {
        0
    };
    let steps = if default { args.sizes.len() as u64 + 2 } else { 0 }
        + sweep_steps
        + u64::from(args.suite == Suite::Alloc || args.suite == Suite::All);
    let progress = ProgressBar::new(steps).with_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {elapsed} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    if default {
        for &size in &args.sizes {
            progress.set_message(format!("{} x {}", args.count, human(size)));
            many_small(&d, &raw, args, size, &mut rows)?;
            progress.inc(1);
        }
        progress.set_message(format!("{} single copies", human(args.large)));
        large(&d, &raw, args, &mut rows)?;
        progress.inc(1);
        progress.set_message("latency");
        latency(&d, &raw, args, &mut rows)?;
        progress.inc(1);
    }
    if sweep_steps > 0 {
        sweep(&d, &raw, args, &mut rows, &progress)?;
    }
    if matches!(args.suite, Suite::Alloc | Suite::All) {
        progress.set_message("allocation");
        let threads = std::thread::available_parallelism().map_or(16, |n| n.get()).min(16);
        let r = cuda_resident_suite::alloc_bench::measure(&d, threads)?;
        let ns = |case: String, raw: Option<f64>, batch: Option<f64>, ours: f64| Row {
            case,
            size: None,
            unit: "ns",
            raw,
            batch,
            ours,
        };
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
    }
    progress.finish_and_clear();
    // SAFETY: the stream is idle and destroyed once.
    check("cuStreamDestroy", unsafe { call!(d.driver(), cuStreamDestroy_v2(stream)) })?;
    Ok((rows, device_json(&d)))
}

fn main() -> ExitCode {
    let mut args = Args::parse();
    args.reps = args.reps.max(5);
    let (rows, device) = match run(&args) {
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
    let report = serde_json::json!({
        "provenance": { "git": PROVENANCE.git_revision, "rustc": PROVENANCE.rustc, "profile": PROVENANCE.profile, "target": PROVENANCE.target },
        "device": device,
        "reps": args.reps,
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
mod tests {
    use super::*;

    #[test]
    fn plots_are_written_for_measured_rows() {
        let mut rows = Vec::new();
        for (i, size) in [256usize, 4096, 65536].into_iter().enumerate() {
            for case in [
                format!("H2D 8192 x {} from pageable", human(size)),
                format!("D2H 8192 x {} into caller Vecs", human(size)),
            ] {
                let mut r = Row::gbps(case, size * 8192, Some(0.1 * (i + 1) as f64), Some(0.2), 1.0);
                r.size = Some(size);
                rows.push(r);
            }
            let mut r =
                Row::gbps(format!("sweep H2D pinned {}", human(size)), size, Some(1.0), None, 2.0 + i as f64);
            r.size = Some(size);
            rows.push(r);
        }
        let out = std::env::temp_dir().join(format!("xfer-bench-plot-test-{}", std::process::id()));
        std::fs::create_dir_all(&out).unwrap();
        let files = plots(&rows, &out).unwrap();
        assert_eq!(files.len(), 2);
        for f in files {
            let svg = std::fs::read_to_string(&f).unwrap();
            assert!(svg.starts_with("<svg") && svg.contains("cuda-resident"), "{}", f.display());
        }
        std::fs::remove_dir_all(&out).unwrap();
    }
}

//! The weights suite: a synthetic safetensors checkpoint (`cuda_resident_suite::weights`:
//! Llama-3-8B's tensor list cut to `--weights-size`, bf16, random bytes) loaded and saved
//! by the raw driver (one synchronous `cuMemcpyHtoD` / `cuMemcpyDtoH` per tensor, from or
//! into the mapped file, into buffers allocated beforehand), `cuMemcpyBatchAsync` (all
//! tensors in one call) and cuda-resident (`load_safetensors`, which also maps, checks and
//! allocates; `save_safetensors`, which also writes the header and renames). Every timed
//! method maps the file itself. From the page cache (the file read once before), and cold
//! (the file dropped from the page cache before each repetition) where the kernel lets an
//! unprivileged process do that. Every load is checked byte for byte on the device against
//! the file, every saved file against the one written by the safetensors crate.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::Instant;

use cuda_resident::cuda_sys::call;
use cuda_resident::weights::{Checkpoint, Dtype, LoadOptions, SaveOptions, WriteMode};
use cuda_resident::{Device, OwnedBuffer, ResidentBuffer};
use cuda_resident_suite::weights::{compare, llama, map, tensor_ranges, warm, write};
use indicatif::ProgressBar;
use memmap2::MmapMut;

use crate::baselines::{DriverBaseline, check, memcpy_batch};
use crate::cli::Args;
use crate::report::{Row, human};
use crate::timing::{Spread, median_of};
use crate::{BenchResult, error, mismatch};

/// Progress steps: loads from the page cache, cold loads, saves.
pub(crate) const STEPS: usize = 3;
const SEED: u64 = 36;

/// A tensor in the file: name, start, length.
type Ranges = [(String, usize, usize)];

pub(crate) fn run(
    d: &Device,
    baseline: &DriverBaseline,
    args: &Args,
    rows: &mut Vec<Row>,
    progress: &ProgressBar,
) -> BenchResult<()> {
    let model = llama(args.weights_size as u64);
    let path = args.weights_file.clone().unwrap_or_else(|| args.out.join("weights.safetensors"));
    if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    }
    progress.set_message(format!("writing {}", path.display()));
    write(&model, &path, SEED)?;
    // On disk before a cold load can drop it from the page cache (dirty pages stay); loads
    // from the page cache alone need no sync, which for 16 GiB takes most of a minute.
    if !args.weights_loads_only && !args.weights_saves_only {
        File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(|e| format!("syncing {}: {e}", path.display()))?;
    }
    let ranges = tensor_ranges(&map(&path)?)?;
    let bytes = model.bytes() as usize;
    let what = format!("{} ({} tensors, {}, bf16)", model.family, ranges.len(), human(bytes));
    let threads = format!(
        "CPU: the calling thread + {} packing threads; raw and batch API into buffers allocated beforehand",
        d.config().resolved_pack_threads()
    );
    println!("weights: {what} at {}", path.display());
    let buffers = ranges
        .iter()
        .map(|r| d.allocate_owned(r.2.max(1) as u64))
        .collect::<cuda_resident::Result<Vec<OwnedBuffer>>>()
        .map_err(error)?;
    let ptrs = buffers
        .iter()
        .map(|b| d.device_ptr(**b))
        .collect::<cuda_resident::Result<Vec<u64>>>()
        .map_err(error)?;
    let batch_bytes = args.weights_batch.map_or(cuda_resident::weights::DEFAULT_BATCH_BYTES, |b| b as u64);
    let loads =
        Loads { d, baseline, path: &path, ranges: &ranges, buffers: &buffers, ptrs: &ptrs, batch_bytes };

    let _ = warm(&map(&path)?);
    if args.weights_saves_only {
        progress.inc(STEPS as u64 - 1);
        progress.set_message("weights: sharded save");
        let ckpt = d.load_safetensors(&path).map_err(error)?;
        // The baselines save from the suite's own buffers, which no load filled yet.
        loads.baseline_load(Method::Raw)?;
        save_rows(&loads, args, &save_list(&ckpt), &what, rows)?;
        progress.inc(1);
        return Ok(());
    }
    progress.set_message("weights: load, page cache");
    let (raw, batch, ours) = loads.time(args.reps, &|| Ok(()), false)?;
    rows.push(Row::gbps(format!("load {what}, page cache"), bytes, Some(raw), batch, ours).noted(&threads));
    if args.breakdown {
        breakdown(d, &ranges, args.reps)?;
        loads.timeline(args.reps)?;
    }
    if args.weights_loads_only {
        progress.inc(3);
        return Ok(());
    }
    let arena = loads.timed(args.reps, &|| Ok(()), Method::Ours, true)?;
    rows.push(Row::gbps(format!("load {what}, page cache, one arena"), bytes, None, None, arena));
    // Whether registering the mapping (read only) pays: registration and unregistration
    // timed with the copies, by the raw driver and by a scope of cuda-resident.
    match loads.timed_registered(args.reps) {
        Ok((raw, ours)) => rows.push(
            Row::gbps(
                format!("load {what}, page cache, mapping registered read only"),
                bytes,
                Some(raw),
                None,
                ours,
            )
            .noted(
                "cuMemHostRegister(READ_ONLY) of the mapping included; raw: one cuMemcpyHtoDAsync per tensor",
            ),
        ),
        Err(why) => println!("skipped: weights load from the registered mapping: {why}"),
    }
    progress.inc(1);

    progress.set_message("weights: load, cold");
    match evict(&path) {
        Ok(()) => {
            let evict = || evict(&path);
            let (raw, batch, ours) = loads.time(args.reps, &evict, false)?;
            rows.push(Row::gbps(format!("load {what}, cold"), bytes, Some(raw), batch, ours).noted(&threads));
        }
        Err(why) => println!("skipped: weights load, cold: {why}"),
    }
    progress.inc(1);

    progress.set_message("weights: save");
    let ckpt = d.load_safetensors(&path).map_err(error)?;
    save_rows(&loads, args, &save_list(&ckpt), &what, rows)?;
    progress.inc(1);
    println!("weights: the checkpoint stays at {} (benches/weights_torch.py reads it)", path.display());
    Ok(())
}

/// The save rows: one file by the raw driver, the batch API and cuda-resident (its file
/// mapped, the default, and written with `pwrite`, in turn), then the sharded save and its
/// load.
fn save_rows(
    loads: &Loads<'_>,
    args: &Args,
    tensors: &[(&str, Dtype, &[usize], ResidentBuffer)],
    what: &str,
    rows: &mut Vec<Row>,
) -> BenchResult<()> {
    let (d, path, bytes) = (loads.d, loads.path, loads.ranges.iter().map(|r| r.2).sum::<usize>());
    let out = path.with_extension("out.safetensors");
    let raw = loads.time_save(args.reps, &out, Method::Raw, &|| Ok(()))?;
    let batch = match loads.baseline.batch {
        true => Some(loads.time_save(args.reps, &out, Method::Batch, &|| Ok(()))?),
        false => None,
    };
    let threads =
        d.config().resolved_pack_threads().max(std::thread::available_parallelism().map_or(1, |n| n.get()));
    let modes = [
        (
            WriteMode::Mapped,
            "",
            format!(
                "file preallocated and mapped where the file system allows (ext4, XFS, tmpfs), else pwrite; up to {threads} threads"
            ),
        ),
        (WriteMode::Pwrite, ", pwrite", "one thread: pwrite from pinned views".to_owned()),
    ];
    for (mode, named, note) in modes {
        let ours = loads.time_save(args.reps, &out, Method::Ours, &|| {
            let options = SaveOptions::new().batch_bytes(loads.batch_bytes).write_mode(mode);
            d.save_safetensors_configured(&out, tensors, options).map_err(error)
        })?;
        let (raw, batch) = if mode == WriteMode::Mapped { (Some(raw), batch) } else { (None, None) };
        rows.push(
            Row::gbps(format!("save {what}, into the page cache{named}"), bytes, raw, batch, ours)
                .noted(&note),
        );
    }
    let _ = std::fs::remove_file(&out);
    let sharded = super::weights_shards::Sharded {
        d,
        path,
        ranges: loads.ranges,
        batch_bytes: loads.batch_bytes,
        threads,
    };
    sharded.run(args, tensors, what, rows)
}

/// What a save of `ckpt`'s tensors takes: name, dtype, shape and buffer of each.
fn save_list(ckpt: &Checkpoint) -> Vec<(&str, Dtype, &[usize], ResidentBuffer)> {
    ckpt.tensors().iter().map(|t| (t.name(), t.dtype(), t.shape(), t.buffer())).collect()
}

/// Where a load's time goes (`--breakdown`), on stderr: allocating one buffer per tensor
/// as a load does (medians of `reps`), the part of a load that moves no byte.
fn breakdown(d: &Device, ranges: &Ranges, reps: usize) -> BenchResult<()> {
    let mut times = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        let owned = ranges
            .iter()
            .map(|r| d.allocate_owned(r.2.max(1) as u64))
            .collect::<cuda_resident::Result<Vec<OwnedBuffer>>>()
            .map_err(error)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        drop(owned);
    }
    times.sort_by(f64::total_cmp);
    eprintln!(
        "breakdown weights: allocating {} buffers {:.2} ms (median of {reps})",
        ranges.len(),
        times[reps / 2]
    );
    Ok(())
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Method {
    Raw,
    Batch,
    Ours,
}

/// What every load and save of the suite works on.
struct Loads<'a> {
    d: &'a Device,
    baseline: &'a DriverBaseline<'a>,
    path: &'a Path,
    ranges: &'a Ranges,
    buffers: &'a [OwnedBuffer],
    ptrs: &'a [u64],
    /// cuda-resident's batch size (`LoadOptions::batch_bytes`).
    batch_bytes: u64,
}

impl Loads<'_> {
    /// When a load's batches were submitted (`--breakdown`), on stderr: the first submit
    /// after the call, the median gap between submits, and the return after the last one
    /// (its fences waited for), medians of `reps` loads. Shows whether batches follow each
    /// other at the link's pace or each pays a start of its own.
    fn timeline(&self, reps: usize) -> BenchResult<()> {
        let (mut first, mut gap, mut end, mut total) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let before = self.d.telemetry();
        for _ in 0..reps {
            let t = Instant::now();
            let mut at = Vec::new();
            let options = LoadOptions::new()
                .batch_bytes(self.batch_bytes)
                .progress(|_, _| at.push(t.elapsed().as_secs_f64() * 1e3));
            let ckpt = self.d.load_safetensors_configured(self.path, options).map_err(error)?;
            let secs = t.elapsed().as_secs_f64() * 1e3;
            drop(ckpt);
            // The last report is the load's end (every fence waited for).
            let Some((&last, submits)) = at.split_last() else { continue };
            first.push(submits.first().copied().unwrap_or(last));
            let mut gaps: Vec<f64> = submits.windows(2).map(|w| w[1] - w[0]).collect();
            gaps.sort_by(f64::total_cmp);
            gap.push(gaps.get(gaps.len() / 2).copied().unwrap_or(0.0));
            end.push(last - submits.last().copied().unwrap_or(0.0));
            total.push(secs);
        }
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
        };
        eprintln!(
            "breakdown weights: load in batches of {}: first submit {:.2} ms, then one every {:.2} ms, \
             last fence {:.2} ms after the last submit, {:.2} ms in all (medians of {reps})",
            human(self.batch_bytes as usize),
            median(first),
            median(gap),
            median(end),
            median(total)
        );
        let after = self.d.telemetry();
        eprintln!(
            "breakdown weights: those {reps} loads: {} submissions, {} DMAs, {} launches, {} host waits; \
             pinned staging {} hits, {} new arenas, {} released, {} held at the end",
            after.upload_submissions - before.upload_submissions,
            after.dma_copies - before.dma_copies,
            after.kernel_launches - before.kernel_launches,
            after.host_waits - before.host_waits,
            after.pinned.hits - before.pinned.hits,
            after.pinned.misses - before.pinned.misses,
            after.pinned.released - before.pinned.released,
            human(after.pinned.reserved_bytes as usize),
        );
        Ok(())
    }

    /// The seconds of loads by each method (`before` each repetition, untimed), every byte
    /// checked after each: the raw driver's and the batch API's (`None` without it), and
    /// cuda-resident's (into an arena where `arena`).
    fn time(
        &self,
        reps: usize,
        before: &dyn Fn() -> BenchResult<()>,
        arena: bool,
    ) -> BenchResult<(Spread, Option<Spread>, Spread)> {
        let raw = self.timed(reps, before, Method::Raw, arena)?;
        let batch = match self.baseline.batch {
            true => Some(self.timed(reps, before, Method::Batch, arena)?),
            false => None,
        };
        Ok((raw, batch, self.timed(reps, before, Method::Ours, arena)?))
    }

    fn timed(
        &self,
        reps: usize,
        before: &dyn Fn() -> BenchResult<()>,
        method: Method,
        arena: bool,
    ) -> BenchResult<Spread> {
        let d = self.d;
        median_of(reps, || {
            before()?;
            let t = Instant::now();
            let ckpt = match method {
                Method::Ours => Some(
                    d.load_safetensors_configured(
                        self.path,
                        LoadOptions::new().arena(arena).batch_bytes(self.batch_bytes),
                    )
                    .map_err(error)?,
                ),
                Method::Raw | Method::Batch => {
                    self.baseline_load(method)?;
                    None
                }
            };
            let secs = t.elapsed().as_secs_f64();
            let file = map(self.path)?;
            match &ckpt {
                Some(ckpt) => {
                    cuda_resident_suite::weights::verify_loaded(d, ckpt, &file).map_err(mismatch)?
                }
                None => self.verify_buffers(&file)?,
            }
            Ok(secs)
        })
    }

    /// One copy per tensor from the mapped file (synchronous `cuMemcpyHtoD`), or all of them
    /// by one `cuMemcpyBatchAsync`.
    fn baseline_load(&self, method: Method) -> BenchResult<()> {
        let file = map(self.path)?;
        let d = self.d;
        if method == Method::Batch {
            let mut dsts = self.ptrs.to_vec();
            let mut srcs: Vec<u64> = self.ranges.iter().map(|r| file[r.1..].as_ptr() as u64).collect();
            let mut sizes: Vec<usize> = self.ranges.iter().map(|r| r.2).collect();
            return memcpy_batch(d, self.baseline.stream, &mut dsts, &mut srcs, &mut sizes, true);
        }
        for (r, &dst) in self.ranges.iter().zip(self.ptrs) {
            let src = &file[r.1..r.1 + r.2];
            // SAFETY: a device range of the buffer allocated for the tensor, the mapped file's
            // bytes of it; synchronous.
            check("cuMemcpyHtoD", unsafe {
                call!(d.driver(), cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len()))
            })?;
        }
        Ok(())
    }

    /// The seconds of loads from the mapped file registered read only
    /// (`cuMemHostRegister`), registration and unregistration included: one
    /// `cuMemcpyHtoDAsync` per tensor, and a scope of cuda-resident (which moves registered
    /// memory in place). Each checked.
    fn timed_registered(&self, reps: usize) -> BenchResult<(Spread, Spread)> {
        let raw = median_of(reps, || self.registered(false))?;
        Ok((raw, median_of(reps, || self.registered(true))?))
    }

    fn registered(&self, ours: bool) -> BenchResult<f64> {
        let d = self.d;
        let t = Instant::now();
        let file = map(self.path)?;
        let ptr = file.as_ptr() as *mut std::ffi::c_void;
        let flags = cuda_resident::cuda_sys::CU_MEMHOSTREGISTER_READ_ONLY
            | cuda_resident::cuda_sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: the whole live mapping, unregistered below before it is unmapped.
        check("cuMemHostRegister", unsafe {
            call!(d.driver(), cuMemHostRegister_v2(ptr, file.len(), flags))
        })?;
        let moved = if ours {
            d.scope(|s| {
                let mut up = s.uploads();
                up.write_many(
                    self.ranges.iter().zip(self.buffers).map(|(r, b)| (**b, 0, &file[r.1..r.1 + r.2])),
                )?;
                up.submit().map(drop)
            })
            .map_err(error)
        } else {
            let sources = self.ranges.iter().map(|r| &file[r.1..r.1 + r.2]);
            crate::baselines::each_h2d(d, self.baseline.stream, sources, self.ptrs)
        };
        // A raw copy that failed part way may leave earlier ones in flight: done before the
        // mapping goes.
        let _ = crate::baselines::sync(d, self.baseline.stream);
        // SAFETY: registered above; every copy from it is done (waited for above).
        let unregistered =
            check("cuMemHostUnregister", unsafe { call!(d.driver(), cuMemHostUnregister(ptr)) });
        moved?;
        unregistered?;
        drop(file);
        let secs = t.elapsed().as_secs_f64();
        self.verify_buffers(&map(self.path)?)?;
        Ok(secs)
    }

    /// Checks the baselines' buffers against `file`.
    fn verify_buffers(&self, file: &[u8]) -> BenchResult<()> {
        let mut got = Vec::new();
        for (r, b) in self.ranges.iter().zip(self.buffers) {
            got.resize(r.2, 0);
            self.d.download_to_slice(**b, 0, &mut got).map_err(error)?;
            compare(&r.0, &got, &file[r.1..r.1 + r.2]).map_err(mismatch)?;
        }
        Ok(())
    }

    /// The seconds of saves into `out` by `method` (cuda-resident's is `ours`), each saved
    /// file checked against the one the safetensors crate wrote.
    fn time_save(
        &self,
        reps: usize,
        out: &Path,
        method: Method,
        ours: &dyn Fn() -> BenchResult<()>,
    ) -> BenchResult<Spread> {
        median_of(reps, || {
            let _ = std::fs::remove_file(out);
            let t = Instant::now();
            match method {
                Method::Ours => ours()?,
                Method::Raw | Method::Batch => self.baseline_save(out, method)?,
            }
            let secs = t.elapsed().as_secs_f64();
            let (want, got) = (map(self.path)?, map(out)?);
            compare("(the whole file)", &got, &want).map_err(mismatch)?;
            Ok(secs)
        })
    }

    /// The file sized and mapped, the header copied from the crate's file, then one copy per
    /// tensor into its pages (synchronous `cuMemcpyDtoH`) or all by one `cuMemcpyBatchAsync`.
    fn baseline_save(&self, out: &Path, method: Method) -> BenchResult<()> {
        let reference = map(self.path)?;
        let head = self.ranges.first().map_or(reference.len(), |r| r.1);
        let io = |e: std::io::Error| format!("writing {}: {e}", out.display());
        let file =
            OpenOptions::new().read(true).write(true).create(true).truncate(true).open(out).map_err(io)?;
        file.set_len(reference.len() as u64).map_err(io)?;
        // SAFETY: a file this process just created; nothing else maps it.
        let mut pages = unsafe { MmapMut::map_mut(&file) }.map_err(io)?;
        pages[..head].copy_from_slice(&reference[..head]);
        let d = self.d;
        if method == Method::Batch {
            let mut dsts: Vec<u64> = self.ranges.iter().map(|r| pages[r.1..].as_mut_ptr() as u64).collect();
            let mut srcs = self.ptrs.to_vec();
            let mut sizes: Vec<usize> = self.ranges.iter().map(|r| r.2).collect();
            return memcpy_batch(d, self.baseline.stream, &mut dsts, &mut srcs, &mut sizes, false);
        }
        for (r, &src) in self.ranges.iter().zip(self.ptrs) {
            let dst = &mut pages[r.1..r.1 + r.2];
            // SAFETY: the tensor's device buffer into its place in the mapped file; synchronous.
            check("cuMemcpyDtoH", unsafe {
                call!(d.driver(), cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len()))
            })?;
        }
        Ok(())
    }
}

/// Drops `path` from the page cache (`posix_fadvise(DONTNEED)`, which needs no privilege
/// for pages no process maps), and checks with `mincore` that it is gone.
fn evict(path: &Path) -> BenchResult<()> {
    let file = File::open(path).map_err(|e| format!("opening {}: {e}", path.display()))?;
    // SAFETY: a plain advice call on an open descriptor.
    let code = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if code != 0 {
        return Err(format!("posix_fadvise failed with {code}"));
    }
    let mapped = map(path)?;
    let pages = mapped.len().div_ceil(4096);
    let mut resident = vec![0u8; pages];
    // SAFETY: the range is one live mapping; `resident` holds a byte per page.
    let code =
        unsafe { libc::mincore(mapped.as_ptr() as *mut libc::c_void, mapped.len(), resident.as_mut_ptr()) };
    if code != 0 {
        return Err("mincore failed".into());
    }
    let share = resident.iter().filter(|&&b| b & 1 == 1).count() as f64 / pages.max(1) as f64;
    if share > 0.05 {
        return Err(format!(
            "{:.0} % of the file stayed in the page cache after posix_fadvise",
            share * 100.0
        ));
    }
    Ok(())
}

//! The `paging` suite: an inference server's KV-cache swap.
//!
//! One device buffer of `--paging-pool` bytes is the pool, seen as blocks of each
//! `--paging-blocks` size in turn; the host cache holds 2 x `--paging-bytes`, an out region
//! and an in region, once in pinned memory (a [`PinnedBuffer`](cuda_resident::PinnedBuffer)
//! from `Device::pinned`) and once in pageable memory (a `Vec<u8>`). Everything starts
//! random. Per block size, `N = --paging-bytes / block` distinct random blocks are swapped
//! out and `N` others (none of the first) swapped in, in a random order, the same every run.
//! A step is "out" (those blocks into the out region's slots, D2H), "in" (the in region's
//! slots into those blocks, H2D) or "both" at once.
//!
//! The methods move the same blocks in the same order: the raw driver, one `cuMemcpy*Async` per
//! block on a stream per direction (from and into pageable memory too, as a naive server does),
//! then a synchronize; `cuMemcpyBatchAsync`, one call per direction; cuda-resident, one scope
//! ([`Device::scope`]) with a batch per direction: one `write` per block from its slot (in),
//! one `read_to_slice` per block into its slot (out), in place for the pinned cache, staged for
//! the pageable one; with `--paging-batches N`, each direction's blocks are split evenly into N
//! such batches submitted one after the other (the first moving while the next is built). For
//! "both", the baselines run each direction on a thread and stream of its own, released
//! together; cuda-resident builds and submits each direction's batch on a thread of its own in
//! one scope, which waits for both. GB/s counts the bytes moved, both directions' for "both".
//!
//! With `--breakdown`, each cuda-resident swap is also run again with each direction
//! waited for right after its submit, and stderr gets the medians of when each direction
//! finished adding its blocks, returned from `submit` and completed, from the start, and
//! the page faults its thread took while adding and in `submit`.
//!
//! Every method's swap is verified once per case, outside the clock: its destination
//! poisoned, one swap, then every byte of every moved block compared with its source, the
//! device side read back block by block through the raw driver.

use cuda_resident::cuda_sys::{CUstream, call};
use cuda_resident::{Config, Device, OwnedBuffer, ResidentBuffer};
use indicatif::ProgressBar;

use crate::baselines::{DriverBaseline, check, each_d2h, each_h2d, memcpy_batch, sync};
use crate::cli::Args;
use crate::report::{Row, human};
use crate::timing::{Spread, median_of, secs_together};
use crate::workload::fill_random;
use crate::{BenchResult, error};

/// The seed of the suite's random bytes and of the blocks it picks.
const SEED: u64 = 0x9A61_6E67;

/// What a poisoned destination holds before a verifying swap.
const POISON: u8 = 0xA5;

/// Device memory left to cuda-resident's own device staging when the pool is clamped.
const HEADROOM: u64 = 1 << 30;

/// Progress steps of the suite: one per block size and host cache.
pub(super) fn steps(args: &Args) -> usize {
    2 * args.paging_blocks.len()
}

/// The host cache's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Pinned,
    Pageable,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Pinned => "pinned",
            Kind::Pageable => "pageable",
        }
    }
}

/// What a step swaps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dir {
    /// Device blocks into the cache's out region.
    Out,
    /// The cache's in region into device blocks.
    In,
    /// Both at once.
    Both,
}

impl Dir {
    fn name(self) -> &'static str {
        match self {
            Dir::Out => "out",
            Dir::In => "in",
            Dir::Both => "both",
        }
    }

    fn outward(self) -> bool {
        matches!(self, Dir::Out | Dir::Both)
    }

    fn inward(self) -> bool {
        matches!(self, Dir::In | Dir::Both)
    }
}

/// Who swaps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Method {
    /// The raw driver, one call per block.
    Raw,
    /// `cuMemcpyBatchAsync`, one call per direction.
    Batch,
    /// cuda-resident, one batch per direction.
    Ours,
}

impl Method {
    fn name(self) -> &'static str {
        match self {
            Method::Raw => "raw driver",
            Method::Batch => "cuMemcpyBatchAsync",
            Method::Ours => "cuda-resident",
        }
    }
}

/// `n` distinct blocks to swap out and `n` other distinct blocks to swap in, of blocks
/// `0..total`, each list in a random order drawn from `seed`: the same lists every run.
///
/// # Panics
/// If `2 * n > total`.
pub(crate) fn pick_blocks(seed: u64, total: usize, n: usize) -> (Vec<usize>, Vec<usize>) {
    let both = n.checked_mul(2).filter(|&both| both <= total);
    let both = both.unwrap_or_else(|| panic!("{n} blocks out and {n} in do not fit in {total}"));
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut picked = if n.saturating_mul(4) <= total {
        // Few of many: draw, and draw again for a block already picked (at most half are).
        let mut seen = std::collections::HashSet::with_capacity(both);
        let mut picked = Vec::with_capacity(both);
        while picked.len() < both {
            let block = rng.usize(..total);
            if seen.insert(block) {
                picked.push(block);
            }
        }
        picked
    } else {
        // Most of them: the first `both` of a partial shuffle.
        let mut all: Vec<usize> = (0..total).collect();
        for i in 0..both {
            all.swap(i, rng.usize(i..total));
        }
        all.truncate(both);
        all
    };
    let ins = picked.split_off(n);
    (picked, ins)
}

/// Runs every case: each block size, with the pinned then the pageable host cache, each
/// direction by each method.
pub(super) fn run(
    d: &Device,
    baseline: &DriverBaseline,
    args: &Args,
    rows: &mut Vec<Row>,
    progress: &ProgressBar,
) -> BenchResult<()> {
    progress.set_message("paging: filling the pool");
    let pool = Pool::allocate(d, args.paging_pool, 2 * args.paging_bytes)?;
    with_pool(d, baseline, args, &pool, rows, progress)?;
    pool.buffer.free().map_err(error)
}

/// The device pool.
struct Pool {
    /// Owned: an error part way frees it on its way out.
    buffer: OwnedBuffer,
    bytes: usize,
    /// Why it is smaller than `--paging-pool`, where it is.
    clamped: Option<String>,
}

impl Pool {
    /// `wanted` bytes on `d`, or, where the device cannot hold them, as much as it can
    /// (leaving [`HEADROOM`] of what the budget allows to cuda-resident's own staging) but
    /// at least `least`.
    fn allocate(d: &Device, wanted: usize, least: usize) -> BenchResult<Pool> {
        let refused = match d.allocate_owned(wanted as u64) {
            Ok(buffer) => return Ok(Pool { buffer, bytes: wanted, clamped: None }),
            Err(e) => e,
        };
        let free = d.driver_free_bytes().map_err(error)?;
        let allowed = (free as f64 * d.config().budget_fraction) as u64;
        let mib = |bytes: u64| bytes >> 20 << 20;
        let mut bytes = mib(allowed.saturating_sub(HEADROOM).min(wanted as u64));
        while bytes >= least as u64 {
            if let Ok(buffer) = d.allocate_owned(bytes) {
                let clamped = format!(
                    "device pool clamped from --paging-pool {} to {}: the device could not hold \
                     more ({} free, budget fraction {}, {} left to cuda-resident's staging)",
                    human(wanted),
                    human(bytes as usize),
                    human(mib(free) as usize),
                    d.config().budget_fraction,
                    human(HEADROOM as usize)
                );
                eprintln!("paging: {clamped}");
                return Ok(Pool { buffer, bytes: bytes as usize, clamped: Some(clamped) });
            }
            bytes = mib(bytes / 8 * 7);
        }
        Err(format!(
            "the paging suite's device pool needs at least {} (2 x --paging-bytes) and the device \
             cannot hold it ({} free; {refused}). Fix: pass a smaller --paging-bytes, or free \
             device memory.",
            human(least),
            human(mib(free) as usize)
        ))
    }

    /// Fills the pool with random bytes, through `scratch` a piece at a time.
    fn fill(&self, d: &Device, scratch: &mut [u8]) -> BenchResult<()> {
        let step = scratch.len().max(1);
        for (k, start) in (0..self.bytes).step_by(step).enumerate() {
            let piece = &mut scratch[..(self.bytes - start).min(step)];
            fill_random(SEED ^ ((k as u64 + 1) << 32), piece);
            d.upload_at(*self.buffer, start as u64, piece).map_err(error)?;
        }
        Ok(())
    }
}

/// The cases on `pool`: the host caches made, every block size's swaps.
fn with_pool(
    d: &Device,
    baseline: &DriverBaseline,
    args: &Args,
    pool: &Pool,
    rows: &mut Vec<Row>,
    progress: &ProgressBar,
) -> BenchResult<()> {
    let cache_bytes = 2 * args.paging_bytes;
    let mut pageable = vec![0u8; cache_bytes];
    pool.fill(d, &mut pageable)?;
    fill_random(SEED + 1, &mut pageable);
    let mut pinned = d.pinned(cache_bytes).map_err(error)?;
    fill_random(SEED + 2, &mut pinned);
    let mut notes: Vec<String> = pool.clamped.iter().cloned().collect();
    let cap = d.config().pinned_cap_bytes;
    if cap > Config::default().pinned_cap_bytes {
        notes.push(format!(
            "cuda-resident's pinned cap raised to {} (Config::pinned_cap_bytes) to hold the pinned \
             cache and a swap-out's views",
            human(cap as usize)
        ));
    }
    if args.paging_batches > 1 {
        notes.push(format!(
            "cuda-resident submits each direction as {} batches, one after the other (--paging-batches)",
            args.paging_batches
        ));
    }
    let pool_ptr = d.device_ptr(*pool.buffer).map_err(error)?;
    for &block in &args.paging_blocks {
        let n = args.paging_bytes / block;
        let (out, ins) = pick_blocks(SEED ^ block as u64, pool.bytes / block, n);
        for kind in [Kind::Pinned, Kind::Pageable] {
            progress.set_message(format!("paging {} {}", human(block), kind.name()));
            let cache: &mut [u8] = match kind {
                Kind::Pinned => &mut pinned,
                Kind::Pageable => &mut pageable,
            };
            let (out_region, in_region) = cache.split_at_mut(args.paging_bytes);
            let mut case = Case {
                d,
                pool: *pool.buffer,
                batches: args.paging_batches as usize,
                out: Lane::new(pool_ptr, block, &out, out_region, baseline.second, false),
                ins: Lane::new(pool_ptr, block, &ins, &*in_region, baseline.stream, true),
            };
            for dir in [Dir::Out, Dir::In, Dir::Both] {
                let name = format!("paging {} {} {}", human(block), dir.name(), kind.name());
                let mut row = case.row(&name, dir, args.reps, baseline.batch, args.breakdown)?;
                (row.count, row.size) = (Some(n), Some(block));
                row.note = (!notes.is_empty()).then(|| notes.join("; "));
                rows.push(row);
            }
            progress.inc(1);
        }
    }
    Ok(())
}

/// One direction of a swap: the blocks it moves (their offsets in the pool and device
/// addresses, in swap order), its region of the host cache (slot `i`, `block` bytes at
/// `i * block`, holds block `i`'s bytes), the raw driver's stream for it and the address
/// lists `cuMemcpyBatchAsync` takes.
struct Lane<H> {
    block: usize,
    offsets: Vec<u64>,
    ptrs: Vec<u64>,
    host: H,
    stream: CUstream,
    /// `cuMemcpyBatchAsync`'s destinations, sources and sizes.
    dsts: Vec<u64>,
    srcs: Vec<u64>,
    sizes: Vec<usize>,
}

// SAFETY: the driver API may be called from any thread and a `CUstream` handle used from
// any of them; the other fields are `Send` where `H` is. A lane is used by one thread at a
// time.
unsafe impl<H: Send> Send for Lane<H> {}

impl<H: AsRef<[u8]>> Lane<H> {
    /// The lane of `blocks` (indices of `block` bytes in the pool at `pool_ptr`) and `host`,
    /// which holds a slot for each; `inward`: host to device.
    fn new(
        pool_ptr: u64,
        block: usize,
        blocks: &[usize],
        host: H,
        stream: CUstream,
        inward: bool,
    ) -> Lane<H> {
        let offsets: Vec<u64> = blocks.iter().map(|&b| (b * block) as u64).collect();
        let ptrs: Vec<u64> = offsets.iter().map(|&o| pool_ptr + o).collect();
        let base = host.as_ref().as_ptr() as u64;
        let slots: Vec<u64> = (0..blocks.len()).map(|i| base + (i * block) as u64).collect();
        let (dsts, srcs) = if inward { (ptrs.clone(), slots) } else { (slots, ptrs.clone()) };
        Lane { block, offsets, ptrs, host, stream, dsts, srcs, sizes: vec![block; blocks.len()] }
    }

    /// The bytes of the cache's slots.
    fn slots_len(&self) -> usize {
        self.offsets.len() * self.block
    }

    /// Checks that every block of the lane holds the bytes of its slot, reading the device
    /// through the raw driver: the index of the first that does not.
    fn first_differing(&self, d: &Device) -> BenchResult<Option<usize>> {
        let mut device = vec![0u8; self.block];
        for (i, (&ptr, slot)) in self.ptrs.iter().zip(self.host.as_ref().chunks_exact(self.block)).enumerate()
        {
            // SAFETY: `block` bytes of the live pool into a vector of as many; the call
            // returns when the copy is done.
            check("cuMemcpyDtoH", unsafe {
                call!(d.driver(), cuMemcpyDtoH_v2(device.as_mut_ptr().cast(), ptr, self.block))
            })?;
            if device != slot {
                return Ok(Some(i));
            }
        }
        Ok(None)
    }
}

impl Lane<&[u8]> {
    /// One `cuMemcpyHtoDAsync` per block, then a synchronize.
    fn raw(&self, d: &Device) -> BenchResult<()> {
        let slots = self.host.chunks_exact(self.block);
        each_h2d(d, self.stream, slots, &self.ptrs)
    }

    /// One `cuMemcpyBatchAsync` of every block, then a synchronize.
    fn batch(&mut self, d: &Device) -> BenchResult<()> {
        memcpy_batch(d, self.stream, &mut self.dsts, &mut self.srcs, &mut self.sizes, true)
    }

    /// Overwrites the lane's blocks on the device, so that what a swap-in moves next is
    /// what gets verified.
    fn poison(&self, d: &Device) -> BenchResult<()> {
        for &ptr in &self.ptrs {
            // SAFETY: `block` bytes of the live pool, on a stream of its context;
            // synchronized below.
            check("cuMemsetD8Async", unsafe {
                call!(d.driver(), cuMemsetD8Async(ptr, POISON, self.block, self.stream))
            })?;
        }
        sync(d, self.stream)
    }
}

impl Lane<&mut [u8]> {
    /// One `cuMemcpyDtoHAsync` per block, then a synchronize.
    fn raw(&mut self, d: &Device) -> BenchResult<()> {
        let slots = self.host.chunks_exact_mut(self.block);
        each_d2h(d, self.stream, slots, &self.ptrs)
    }

    /// One `cuMemcpyBatchAsync` of every block, then a synchronize.
    fn batch(&mut self, d: &Device) -> BenchResult<()> {
        memcpy_batch(d, self.stream, &mut self.dsts, &mut self.srcs, &mut self.sizes, false)
    }

    /// Overwrites the lane's slots, so that what a swap-out moves next is what gets verified.
    fn poison(&mut self) {
        let len = self.slots_len();
        self.host[..len].fill(POISON);
    }
}

/// cuda-resident's swap, `out` and / or `in`, in one scope ([`Device::scope`]): one
/// `read_to_slice` per block into its slot, one `write` per block from its slot, in swap
/// order; its seconds, until the scope has waited for both. From and into the pinned cache
/// the blocks move in place; the pageable cache is staged. Both at once, each direction is
/// built and submitted on a thread of its own, as the baselines' directions run on a thread
/// each: the clock starts once both threads are ready (spawned, the device's context
/// current), released together, as `secs_together` times the baselines.
fn ours(
    d: &Device,
    (pool, batches): (ResidentBuffer, usize),
    out: Option<&mut Lane<&mut [u8]>>,
    ins: Option<&Lane<&[u8]>>,
) -> BenchResult<f64> {
    ours_marked(d, (pool, batches), out, ins, None)
}

/// When each direction of one swap finished adding its blocks, returned from `submit`
/// and completed, in µs from the start ([`ours_marked`]).
#[derive(Clone, Copy, Default)]
struct Marks {
    built: f64,
    submitted: f64,
    done: f64,
    /// Page faults the direction's thread took while it added its blocks, and then in
    /// `submit` ([`minor_faults`]; 0 where the system does not say).
    faults_built: u64,
    faults_submit: u64,
}

/// Minor page faults of the calling thread so far (Linux: `/proc/thread-self/stat`), or 0:
/// memory a batch maps fresh and touches costs one each, and two threads faulting at once
/// contend for the process's memory map.
fn minor_faults() -> u64 {
    let Ok(stat) = std::fs::read_to_string("/proc/thread-self/stat") else { return 0 };
    // The fields after the command name (which may hold spaces), from the state on:
    // `minflt` is the eighth.
    let after = stat.rfind(')').map_or("", |at| &stat[at + 1..]);
    after.split_whitespace().nth(7).and_then(|n| n.parse().ok()).unwrap_or(0)
}

/// [`ours`], and where `marks` is given, each direction's [`Marks`] (in, out), its
/// completion waited for right after its submit.
fn ours_marked(
    d: &Device,
    (pool, batches): (ResidentBuffer, usize),
    out: Option<&mut Lane<&mut [u8]>>,
    ins: Option<&Lane<&[u8]>>,
    marks: Option<&std::sync::Mutex<[Marks; 2]>>,
) -> BenchResult<f64> {
    use std::time::Instant;
    // The swap-in's slots and offsets, not its lane: the lane's raw stream is not `Sync`.
    let ins = ins.map(|ins| (ins.host, &ins.offsets[..], ins.block));
    let both = out.is_some() && ins.is_some();
    // When the clock starts: at once for one direction, once both threads are ready for both.
    let start = std::sync::OnceLock::new();
    if !both {
        start.get_or_init(Instant::now);
    }
    let start = &start;
    d.scope(|s| {
        let since = move || start.get().map_or(0.0, |t: &Instant| t.elapsed().as_secs_f64() * 1e6);
        // Submits a direction's batch; with `marks`, waits for it and marks its times.
        // `built` is when the direction finished adding its blocks and the faults its thread
        // had taken by then, from `faults_at` before it began.
        let submit = move |which: usize,
                           (built, faults_at, faults_built): (f64, u64, u64),
                           fenced: cuda_resident::Result<cuda_resident::Fence>| {
            let Some(marks) = marks else { return fenced.map(drop) };
            let submitted = since();
            let faults_submitted = minor_faults();
            fenced?.wait()?;
            marks.lock().expect("no thread panics holding the marks")[which] = Marks {
                built,
                submitted,
                done: since(),
                faults_built: faults_built.saturating_sub(faults_at),
                faults_submit: faults_submitted.saturating_sub(faults_built),
            };
            Ok(())
        };
        let mark = move || if marks.is_some() { (since(), minor_faults()) } else { (0.0, 0) };
        let faults = move || if marks.is_some() { minor_faults() } else { 0 };
        // Closures that capture the caller's memory, rather than take it as an argument:
        // a scope's batches borrow it for the whole scope.
        let swap_in = move || {
            let Some((host, offsets, block)) = ins else { return Ok(()) };
            let faults_at = faults();
            let per = offsets.len().div_ceil(batches).max(1);
            let mut slots = host.chunks_exact(block).zip(offsets).peekable();
            loop {
                let mut writes = s.uploads();
                for (slot, &offset) in slots.by_ref().take(per) {
                    writes.write(pool, offset, slot)?;
                }
                if slots.peek().is_none() {
                    let (built, faulted) = mark();
                    return submit(0, (built, faults_at, faulted), writes.submit());
                }
                let _ = writes.submit()?;
            }
        };
        let swap_out = move || {
            let Some(out) = out else { return Ok(()) };
            let faults_at = faults();
            let per = out.offsets.len().div_ceil(batches).max(1);
            let mut slots = out.host.chunks_exact_mut(out.block).zip(&out.offsets).peekable();
            loop {
                let mut reads = s.downloads();
                for (slot, &offset) in slots.by_ref().take(per) {
                    reads.read_to_slice(pool, offset, slot)?;
                }
                if slots.peek().is_none() {
                    let (built, faulted) = mark();
                    return submit(1, (built, faults_at, faulted), reads.submit().map(|p| p.fence().clone()));
                }
                let _ = reads.submit()?;
            }
        };
        if !both {
            swap_in()?;
            return swap_out();
        }
        let ready = std::sync::Barrier::new(2);
        std::thread::scope(|threads| {
            let up = threads.spawn(|| {
                let current = d.make_current();
                ready.wait();
                // Released together: the clock starts at the first of the two.
                start.get_or_init(Instant::now);
                current?;
                swap_in()
            });
            ready.wait();
            start.get_or_init(Instant::now);
            let out = swap_out();
            let up = up.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            out.and(up)
        })
    })
    .map_err(error)?;
    Ok(start.get().expect("set before the swap").elapsed().as_secs_f64())
}

/// One block size and host cache: both lanes.
struct Case<'a> {
    d: &'a Device,
    pool: ResidentBuffer,
    /// Batches a direction of cuda-resident's swap is submitted in (`--paging-batches`).
    batches: usize,
    out: Lane<&'a mut [u8]>,
    ins: Lane<&'a [u8]>,
}

impl Case<'_> {
    /// The row of `dir`: each method timed (`reps` repetitions after a warm-up), then
    /// verified; the batch API where the driver has it (`batch`).
    fn row(&mut self, name: &str, dir: Dir, reps: usize, batch: bool, breakdown: bool) -> BenchResult<Row> {
        let mut time = |method| -> BenchResult<Spread> {
            let secs = median_of(reps, || self.secs(method, dir))?;
            self.verify(method, dir, name)?;
            Ok(secs)
        };
        let raw = time(Method::Raw)?;
        let batch = if batch { Some(time(Method::Batch)?) } else { None };
        let ours = time(Method::Ours)?;
        if breakdown {
            self.breakdown(name, dir, reps)?;
        }
        let per_way = self.out.slots_len();
        let bytes = if dir == Dir::Both { 2 * per_way } else { per_way };
        Ok(Row::gbps(name.to_owned(), bytes, Some(raw), batch, ours))
    }

    /// Where the time of cuda-resident's swap in `dir` goes (`--breakdown`), on stderr: the
    /// medians over `reps` swaps of when each direction finished adding its blocks, returned
    /// from `submit` and completed (waited for right after its submit), from the start.
    fn breakdown(&mut self, name: &str, dir: Dir, reps: usize) -> BenchResult<()> {
        let (d, pool) = (self.d, self.pool);
        let mut all: Vec<[Marks; 2]> = Vec::with_capacity(reps);
        for _ in 0..reps {
            let marks = std::sync::Mutex::new([Marks::default(); 2]);
            let out = dir.outward().then_some(&mut self.out);
            let ins = dir.inward().then_some(&self.ins);
            ours_marked(d, (pool, self.batches), out, ins, Some(&marks))?;
            all.push(marks.into_inner().expect("no thread panicked holding the marks"));
        }
        let median = |pick: &dyn Fn(&[Marks; 2]) -> f64| {
            let mut xs: Vec<f64> = all.iter().map(pick).collect();
            xs.sort_by(f64::total_cmp);
            xs[xs.len() / 2]
        };
        let mut line = format!("breakdown {name}:");
        for (which, (way, on)) in [("in", dir.inward()), ("out", dir.outward())].into_iter().enumerate() {
            if on {
                let [built, submitted, done, faults_built, faults_submit] = [
                    median(&|m| m[which].built),
                    median(&|m| m[which].submitted),
                    median(&|m| m[which].done),
                    median(&|m| m[which].faults_built as f64),
                    median(&|m| m[which].faults_submit as f64),
                ];
                line += &format!(
                    " {way} built {built:.0} µs, submitted {submitted:.0} µs, done {done:.0} µs \
                     (page faults: {faults_built:.0} building, {faults_submit:.0} in submit);"
                );
            }
        }
        eprintln!("{}", line.trim_end_matches(';'));
        Ok(())
    }

    /// Seconds of one swap by `method` in `dir`, waited for.
    fn secs(&mut self, method: Method, dir: Dir) -> BenchResult<f64> {
        let (d, pool) = (self.d, self.pool);
        if dir == Dir::Both && method != Method::Ours {
            let (out, ins) = (&mut self.out, &mut self.ins);
            return match method {
                Method::Raw => secs_together(d, move || ins.raw(d), move || out.raw(d)),
                _ => secs_together(d, move || ins.batch(d), move || out.batch(d)),
            };
        }
        let t = std::time::Instant::now();
        match (method, dir) {
            (Method::Raw, Dir::Out) => self.out.raw(d)?,
            (Method::Raw, _) => self.ins.raw(d)?,
            (Method::Batch, Dir::Out) => self.out.batch(d)?,
            (Method::Batch, _) => self.ins.batch(d)?,
            (Method::Ours, Dir::Out) => return ours(d, (pool, self.batches), Some(&mut self.out), None),
            (Method::Ours, Dir::In) => return ours(d, (pool, self.batches), None, Some(&self.ins)),
            (Method::Ours, Dir::Both) => {
                return ours(d, (pool, self.batches), Some(&mut self.out), Some(&self.ins));
            }
        }
        Ok(t.elapsed().as_secs_f64())
    }

    /// Poisons the destinations of `dir`, swaps once by `method`, and checks every moved
    /// block against its source.
    fn verify(&mut self, method: Method, dir: Dir, name: &str) -> BenchResult<()> {
        if dir.outward() {
            self.out.poison();
        }
        if dir.inward() {
            self.ins.poison(self.d)?;
        }
        self.secs(method, dir)?;
        let differs = |lane_offsets: &[u64], i: usize, what: &str| {
            crate::mismatch(format!(
                "{name}, {}: the block at pool offset {} ({what} {} of {}) differs from its source \
                 after the swap",
                method.name(),
                lane_offsets[i],
                i + 1,
                lane_offsets.len()
            ))
        };
        if dir.outward()
            && let Some(i) = self.out.first_differing(self.d)?
        {
            return Err(differs(&self.out.offsets, i, "swapped out"));
        }
        if dir.inward()
            && let Some(i) = self.ins.first_differing(self.d)?
        {
            return Err(differs(&self.ins.offsets, i, "swapped in"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::pick_blocks;

    #[test]
    fn blocks_are_distinct_disjoint_in_range_and_reproducible() {
        // Few of many (drawn) and most of them (shuffled), and all of them.
        for (total, n) in [(524_288, 16_384), (1000, 100), (1000, 400), (10, 5), (2, 1)] {
            let (out, ins) = pick_blocks(7, total, n);
            assert_eq!((out.len(), ins.len()), (n, n));
            let mut all: Vec<usize> = out.iter().chain(&ins).copied().collect();
            assert!(all.iter().all(|&b| b < total), "in range");
            all.sort_unstable();
            all.dedup();
            assert_eq!(all.len(), 2 * n, "{total}, {n}: distinct, and none both out and in");
            assert_eq!(pick_blocks(7, total, n), (out.clone(), ins.clone()), "the same every run");
            if n > 1 {
                assert_ne!(pick_blocks(8, total, n).0, out, "another seed, other blocks");
                assert!(out.windows(2).any(|w| w[0] > w[1]), "in a random order, not sorted");
            }
        }
        assert_eq!(pick_blocks(1, 5, 0), (vec![], vec![]));
    }

    #[test]
    #[should_panic(expected = "do not fit")]
    fn more_blocks_than_the_pool_holds_is_a_bug() {
        let _ = pick_blocks(1, 9, 5);
    }
}

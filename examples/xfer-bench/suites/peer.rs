//! The `peer` suite: copies between two GPUs, `--device` (the source) and the next ordinal
//! (the destination), against the raw driver in the same run.
//!
//! The raw baseline is one `cuMemcpyPeerAsync` per copy on a stream of the destination's
//! context, then a synchronize; cuda-resident's is one [`PeerBatch`](cuda_resident::PeerBatch)
//! built, submitted and waited for, inside the clock. Cases: many small copies of 4 KiB
//! before peer access is enabled (both sides then stage through host memory; peer access is
//! process-wide, so this comes first), then one `--large` copy, many small copies between
//! scattered places, both directions at once, and a `--large` fan-out from a pageable `Vec`
//! to both GPUs by each [`FanOutPath`] (against `cuMemcpyHtoD` to each device in turn).
//! Every cuda-resident copy lands on poisoned memory and is verified byte for byte after.

use std::sync::Arc;
use std::time::Instant;

use cuda_resident::cuda_sys::{CUstream, call};
use cuda_resident::{Device, DeviceSet, FanOutPath, Fence, ResidentBuffer};
use indicatif::ProgressBar;

use crate::baselines::{DriverBaseline, check, sync};
use crate::cli::Args;
use crate::report::{Row, human};
use crate::timing::{Spread, baseline_reps, median_secs, phase_medians};
use crate::workload::{Scatter, random_vec, verify_scatter};
use crate::{BenchResult, error};

/// Bytes per copy of the many-small cases also measured before peer access is enabled.
const STAGED_SIZE: usize = 4096;

/// The fix for a host with fewer than two GPUs.
pub(super) const FEW_FIX: &str =
    "Fix: run on a host with two or more GPUs, all of them visible (check CUDA_VISIBLE_DEVICES)";

/// Why the suite cannot run on `found` GPUs.
pub(super) fn too_few(found: usize) -> String {
    format!("peer mode needs two GPUs and the driver sees {found}")
}

/// Progress steps of the suite over the many-small `cases`.
pub(super) fn steps(cases: &[(usize, usize)]) -> usize {
    cases.len() + cases.iter().filter(|c| c.1 == STAGED_SIZE).count() + 3
}

/// The two devices and a raw stream of each one's context.
struct Pair<'a> {
    src: &'a Device,
    dst: &'a Device,
    src_stream: CUstream,
    dst_stream: CUstream,
    /// `0->1`, for the rows.
    dir: String,
}

/// Runs the suite; `gpus` (at least 2) is how many the driver sees, and `d` with
/// `baseline` the source device and its raw streams.
pub(super) fn run(
    d: &Device,
    baseline: &DriverBaseline,
    args: &Args,
    gpus: usize,
    cases: &[(usize, usize)],
    rows: &mut Vec<Row>,
    progress: &ProgressBar,
) -> BenchResult<()> {
    let ordinal = (d.info().ordinal + 1) % gpus;
    let other = Device::open_on_driver(Arc::clone(d.driver()), ordinal, d.config().clone()).map_err(error)?;
    let set = DeviceSet::from_devices(vec![d.clone(), other]);
    let (src, dst) = (set.get(0).map_err(error)?, set.get(1).map_err(error)?);
    dst.make_current().map_err(error)?;
    let dst_baseline = DriverBaseline::new(dst)?;
    let p = Pair {
        src,
        dst,
        src_stream: baseline.stream,
        dst_stream: dst_baseline.stream,
        dir: format!("{}->{}", src.info().ordinal, dst.info().ordinal),
    };
    progress.println(describe(&p)?);
    for &case in cases.iter().filter(|c| c.1 == STAGED_SIZE) {
        progress.set_message(format!("peer {} x {}, before peer access", case.0, human(case.1)));
        many_small(&p, args, case, true, rows)?;
        progress.inc(1);
    }
    set.enable_all_peers().map_err(error)?;
    let first = rows.len();
    with_peer_access(&set, &p, args, cases, rows, progress)?;
    if !dst.is_peer_enabled(src) {
        for r in &mut rows[first..] {
            add_note(r, "no peer access between these GPUs: copies between them stage through the host");
        }
    }
    drop(dst_baseline);
    // The other suites' raw calls expect their device current.
    d.make_current().map_err(error)
}

/// The line that names the two devices and whether peer access is possible.
fn describe(p: &Pair) -> BenchResult<String> {
    let (si, di) = (p.src.info(), p.dst.info());
    let possible = p.src.can_access_peer(p.dst).map_err(error)?;
    Ok(format!(
        "peer: device {} ({}) -> device {} ({}) | {} | peer access {}",
        si.ordinal,
        si.pci_bus_id,
        di.ordinal,
        di.pci_bus_id,
        di.name,
        if possible { "possible" } else { "impossible: every case stages through the host" }
    ))
}

/// The cases after peer access is enabled, on a `--large` buffer of each device: one large
/// copy, the many-small `cases`, both directions at once and the fan-out.
fn with_peer_access(
    set: &DeviceSet,
    p: &Pair,
    args: &Args,
    cases: &[(usize, usize)],
    rows: &mut Vec<Row>,
    progress: &ProgressBar,
) -> BenchResult<()> {
    let (src, dst) = (p.src, p.dst);
    let n = args.large;
    let data = random_vec(&mut fastrand::Rng::with_seed(101), n);
    // Owned: an error part way frees both on its way out.
    let a = src.allocate_owned(n as u64).map_err(error)?;
    let b = dst.allocate_owned(n as u64).map_err(error)?;
    progress.set_message(format!("peer {}", human(n)));
    src.upload(*a, &data).map_err(error)?;
    large(p, args, (*a, *b), &data, rows)?;
    progress.inc(1);
    for &case in cases {
        progress.set_message(format!("peer {} x {}", case.0, human(case.1)));
        many_small(p, args, case, false, rows)?;
        progress.inc(1);
    }
    progress.set_message("peer both directions");
    both_ways(p, args, (*a, *b), &data, rows)?;
    progress.inc(1);
    progress.set_message("fan-out");
    fan_out(set, p, args, (*a, *b), &data, rows)?;
    progress.inc(1);
    a.free().and(b.free()).map_err(error)
}

fn add_note(row: &mut Row, note: &str) {
    row.note = Some(match row.note.take() {
        Some(before) => format!("{before}; {note}"),
        None => note.to_owned(),
    });
}

/// One `cuMemcpyPeerAsync` of `len` bytes at `src` on `from` to `dst` on `to`, on `stream`
/// of `to`'s context; the caller synchronizes.
fn raw_copy(to: &Device, dst: u64, from: &Device, src: u64, len: usize, stream: CUstream) -> BenchResult<()> {
    // SAFETY: both are ranges of `len` bytes of live device memory of the contexts named,
    // and `stream` is of `to`'s context; the caller synchronizes it before freeing either.
    check("cuMemcpyPeerAsync", unsafe {
        call!(to.driver(), cuMemcpyPeerAsync(dst, to.cu_context(), src, from.cu_context(), len, stream))
    })
}

/// cuda-resident's copies `(source buffer, offset, destination buffer, offset, len)` from
/// `from` into `to`, as one batch, submitted.
fn ours(
    to: &Device,
    from: &Device,
    copies: impl IntoIterator<Item = (ResidentBuffer, u64, ResidentBuffer, u64, u64)>,
) -> BenchResult<Fence> {
    let mut batch = to.peer_copies(from);
    for (src, src_offset, dst, dst_offset, len) in copies {
        batch.copy(src, src_offset, dst, dst_offset, len).map_err(error)?;
    }
    batch.submit().map_err(error)
}

/// Overwrites `len` bytes of `buffer` at `offset` with 0xA5 through the raw driver, so that
/// what cuda-resident moves next is what gets verified.
fn poison(d: &Device, stream: CUstream, buffer: ResidentBuffer, offset: u64, len: usize) -> BenchResult<()> {
    let ptr = d.device_ptr(buffer).map_err(error)? + offset;
    d.make_current().map_err(error)?;
    // SAFETY: `len` bytes of a live buffer, on a stream of its context; synchronized below.
    check("cuMemsetD8Async", unsafe { call!(d.driver(), cuMemsetD8Async(ptr, 0xA5, len, stream)) })?;
    sync(d, stream)
}

/// Checks that `buffer` holds `expected` at `offset`.
fn verify(d: &Device, buffer: ResidentBuffer, offset: u64, expected: &[u8], case: &str) -> BenchResult<()> {
    let back = d.download_range(buffer, offset, expected.len() as u64).map_err(error)?;
    if back != expected {
        return Err(crate::mismatch(format!("{case}: bytes differ after cuda-resident's copy")));
    }
    Ok(())
}

/// One copy of all of `a` (on the source, holding `data`) into `b` (on the destination).
fn large(
    p: &Pair,
    args: &Args,
    (a, b): (ResidentBuffer, ResidentBuffer),
    data: &[u8],
    rows: &mut Vec<Row>,
) -> BenchResult<()> {
    let (src, dst, n) = (p.src, p.dst, data.len());
    let (pa, pb) = (src.device_ptr(a).map_err(error)?, dst.device_ptr(b).map_err(error)?);
    dst.make_current().map_err(error)?;
    let raw = median_secs(args.reps, || {
        raw_copy(dst, pb, src, pa, n, p.dst_stream)?;
        sync(dst, p.dst_stream)
    })?;
    poison(dst, p.dst_stream, b, 0, n)?;
    let case = format!("peer {} {}", human(n), p.dir);
    let ours = median_secs(args.reps, || ours(dst, src, [(a, 0, b, 0, n as u64)])?.wait().map_err(error))?;
    verify(dst, b, 0, data, &case)?;
    rows.push(Row::gbps(case, n, Some(raw), None, ours));
    Ok(())
}

/// `count` copies of `size` bytes from scattered places on the source to the same places of
/// a scatter on the destination; `staged`: measured before peer access is enabled.
fn many_small(
    p: &Pair,
    args: &Args,
    (count, size): (usize, usize),
    staged: bool,
    rows: &mut Vec<Row>,
) -> BenchResult<()> {
    let (src, dst) = (p.src, p.dst);
    let mut rng = fastrand::Rng::with_seed((count * 37 + size) as u64);
    let sources: Vec<Vec<u8>> = (0..count).map(|_| random_vec(&mut rng, size)).collect();
    let from = Scatter::new(src, count, size)?;
    let to = Scatter::new(dst, count, size)?;
    many_small_rows(p, args, (&from, &to), &sources, staged, rows)
}

/// The rows of [`many_small`] between the scatters `from` and `to`, `sources` the copies'
/// bytes: one batch of copies, and (with peer access) the same as block tables.
fn many_small_rows(
    p: &Pair,
    args: &Args,
    (from, to): (&Scatter, &Scatter),
    sources: &[Vec<u8>],
    staged: bool,
    rows: &mut Vec<Row>,
) -> BenchResult<()> {
    let (src, dst, count, size) = (p.src, p.dst, sources.len(), sources[0].len());
    let mut up = src.uploads();
    for (data, &(b, o)) in sources.iter().zip(&from.places) {
        up.write(from.buffers[b], o, data).map_err(error)?;
    }
    up.submit().map_err(error)?.wait().map_err(error)?;
    let base_reps = baseline_reps(args, count);
    dst.make_current().map_err(error)?;
    let raw = median_secs(base_reps, || {
        for (&s, &t) in from.ptrs.iter().zip(&to.ptrs) {
            raw_copy(dst, t, src, s, size, p.dst_stream)?;
        }
        sync(dst, p.dst_stream)
    })?;
    let len = dst.buffer_len(to.buffers[0]).map_err(error)? as usize;
    for &b in &to.buffers {
        poison(dst, p.dst_stream, b, 0, len)?;
    }
    let ours = median_secs(args.reps, || {
        let copies = from
            .places
            .iter()
            .zip(&to.places)
            .map(|(&(b, o), &(c, q))| (from.buffers[b], o, to.buffers[c], q, size as u64));
        ours(dst, src, copies)?.wait().map_err(error)
    })?;
    let case = format!("peer {count} x {} {}{}", human(size), p.dir, if staged { ", staged" } else { "" });
    verify_scatter(dst, to, sources, size, &case)?;
    if !staged {
        let ranges = copy_ranges_secs(p, args, (from, to), sources, &case)?;
        let mut row = Row::gbps(format!("{case}, copy_ranges"), count * size, Some(raw), None, ranges);
        (row.count, row.size) = (Some(count), Some(size));
        rows.push(row);
    }
    let mut row = Row::gbps(case, count * size, Some(raw), None, ours);
    (row.count, row.size) = (Some(count), Some(size));
    if base_reps < args.reps {
        add_note(&mut row, &format!("raw: median of {base_reps} repetitions"));
    }
    if staged {
        add_note(
            &mut row,
            "before peer access was enabled: the driver and cuda-resident stage through the host",
        );
    }
    rows.push(row);
    Ok(())
}

/// The copies of [`many_small_rows`] as a block table per buffer pair (as a paged cache
/// keeps them), one `copy_ranges` call per pair: the seconds' spread, verified. The tables
/// are the caller's data, built before the clock starts.
fn copy_ranges_secs(
    p: &Pair,
    args: &Args,
    (from, to): (&Scatter, &Scatter),
    sources: &[Vec<u8>],
    case: &str,
) -> BenchResult<Spread> {
    let (src, dst, size) = (p.src, p.dst, sources[0].len());
    let mut tables: Vec<Vec<(u64, u64, u64)>> = vec![Vec::new(); from.buffers.len()];
    let mut pairs = vec![usize::MAX; from.buffers.len()];
    for (&(b, o), &(c, q)) in from.places.iter().zip(&to.places) {
        tables[b].push((o, q, size as u64));
        pairs[b] = c;
    }
    let len = dst.buffer_len(to.buffers[0]).map_err(error)? as usize;
    for &b in &to.buffers {
        poison(dst, p.dst_stream, b, 0, len)?;
    }
    let batch = || {
        let mut batch = dst.peer_copies(src);
        for (b, table) in tables.iter().enumerate().filter(|(_, t)| !t.is_empty()) {
            batch.copy_ranges(from.buffers[b], to.buffers[pairs[b]], table).map_err(error)?;
        }
        BenchResult::Ok(batch)
    };
    let ranges = median_secs(args.reps, || batch()?.submit().map_err(error)?.wait().map_err(error))?;
    let case = format!("{case}, copy_ranges");
    verify_scatter(dst, to, sources, size, &case)?;
    if args.breakdown {
        // Where one batch's time goes: adding the tables, submit, waiting.
        let [add, submit, wait] = phase_medians(args.reps, || {
            let t = Instant::now();
            let batch = batch()?;
            let t1 = Instant::now();
            let fence = batch.submit().map_err(error)?;
            let t2 = Instant::now();
            fence.wait().map_err(error)?;
            Ok([t, t1, t2, Instant::now()])
        })?;
        eprintln!("breakdown {case}: add {add:.0} µs, submit {submit:.0} µs, wait {wait:.0} µs");
    }
    Ok(ranges)
}

/// Both directions at once, `data.len() / 2` bytes each way: the first half of `a` into
/// `b`, and a buffer on the destination holding the second half into one on the source.
/// Each batch has buffers of its own, so that cuda-resident's ordering (by buffer) leaves
/// the two free to overlap, as the raw copies do.
fn both_ways(
    p: &Pair,
    args: &Args,
    (a, b): (ResidentBuffer, ResidentBuffer),
    data: &[u8],
    rows: &mut Vec<Row>,
) -> BenchResult<()> {
    let (src, dst, half) = (p.src, p.dst, data.len() / 2);
    if half == 0 {
        return Ok(());
    }
    let h = half as u64;
    // Owned: an error part way frees both on its way out.
    let back_from = dst.allocate_owned(h).map_err(error)?;
    let back_to = src.allocate_owned(h).map_err(error)?;
    dst.upload(*back_from, &data[half..2 * half]).map_err(error)?;
    let ptr = |d: &Device, buffer| d.device_ptr(buffer).map_err(error);
    let (pa, pb) = (ptr(src, a)?, ptr(dst, b)?);
    let (pf, pt) = (ptr(dst, *back_from)?, ptr(src, *back_to)?);
    let raw = median_secs(args.reps, || {
        raw_copy(dst, pb, src, pa, half, p.dst_stream)?;
        raw_copy(src, pt, dst, pf, half, p.src_stream)?;
        sync(dst, p.dst_stream)?;
        sync(src, p.src_stream)
    })?;
    poison(dst, p.dst_stream, b, 0, half)?;
    poison(src, p.src_stream, *back_to, 0, half)?;
    let ours = median_secs(args.reps, || {
        let there = ours(dst, src, [(a, 0, b, 0, h)])?;
        let back = ours(src, dst, [(*back_from, 0, *back_to, 0, h)])?;
        there.wait().and(back.wait()).map_err(error)
    })?;
    let case = format!("peer both ways, 2 x {}", human(half));
    verify(dst, b, 0, &data[..half], &case)?;
    verify(src, *back_to, 0, &data[half..2 * half], &case)?;
    rows.push(Row::gbps(case, 2 * half, Some(raw), None, ours));
    back_from.free().and(back_to.free()).map_err(error)
}

/// `data`, from pageable memory, to `a` and `b` on both devices (the set's 0 and 1) by each
/// [`FanOutPath`], against `cuMemcpyHtoD` to each in turn. GB/s counts the bytes delivered.
fn fan_out(
    set: &DeviceSet,
    p: &Pair,
    args: &Args,
    (a, b): (ResidentBuffer, ResidentBuffer),
    data: &[u8],
    rows: &mut Vec<Row>,
) -> BenchResult<()> {
    let n = data.len();
    let ends = [(p.src, p.src_stream, a), (p.dst, p.dst_stream, b)];
    let raw = median_secs(args.reps, || {
        for &(d, _, buffer) in &ends {
            let ptr = d.device_ptr(buffer).map_err(error)?;
            d.make_current().map_err(error)?;
            // SAFETY: `n` bytes of live host memory into a buffer of `n` bytes; the call
            // returns when the copy is done.
            check("cuMemcpyHtoD", unsafe {
                call!(d.driver(), cuMemcpyHtoD_v2(ptr, data.as_ptr().cast(), n))
            })?;
        }
        Ok(())
    })?;
    let targets = [(0, a), (1, b)];
    for path in [FanOutPath::EachLink, FanOutPath::FirstThenPeers] {
        for &(d, stream, buffer) in &ends {
            poison(d, stream, buffer, 0, n)?;
        }
        let ours = median_secs(args.reps, || {
            let fences = set.fan_out_via(path, data, &targets, 0).map_err(error)?;
            fences.iter().try_for_each(Fence::wait).map_err(error)
        })?;
        let case = format!("fan-out {}, 2 GPUs, {path:?}", human(n));
        for &(d, _, buffer) in &ends {
            verify(d, buffer, 0, data, &case)?;
        }
        let mut row = Row::gbps(case, 2 * n, Some(raw), None, ours);
        add_note(&mut row, "raw: cuMemcpyHtoD from pageable memory to each GPU in turn");
        rows.push(row);
    }
    Ok(())
}

//! The bytes of a save, written by up to one thread per core. Each thread downloads pieces
//! of up to a few tens of MiB through the engine (a download batch each: small tensors
//! gathered on the device, large ones by one DMA, into pinned memory) and writes the pinned
//! views at their file offsets, the next piece on the wire while this one is written.
//!
//! Who writes what ([`sink`](super::sink) says why): a mapped file's pieces go to any thread,
//! so that every thread copies into one file at once; a file written with `pwrite` is
//! written by one thread, piece after piece, as the kernel would serialize more writers.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;

use super::Pacing;
use super::load::MIN_BATCH;
use super::save::Item;
use super::sink::Target;
use crate::device::Device;
use crate::error::Result;
use crate::transfer::{PendingDownload, Slot};

/// The largest piece a thread downloads at once.
const MAX_PIECE: u64 = 32 << 20;
/// The smallest piece, whatever the pinned cap.
const MIN_PIECE: u64 = 256 << 10;
/// Views shorter than this are copied together and written by one `pwrite`.
const COALESCE: usize = 64 << 10;

/// One file to fill: its tensors' places (`(offset in the file, item)`, in file order).
pub(super) struct Job {
    pub(super) target: Target,
    pub(super) places: Vec<(u64, usize)>,
}

/// A stretch of one tensor: `len` bytes of item `item` from `at`, going to `file_at`.
#[derive(Clone, Copy)]
struct Seg {
    item: usize,
    at: u64,
    len: u64,
    file_at: u64,
}

/// A piece of one job's file: the job and its segments.
type Piece = (usize, Vec<Seg>);

/// Threads for `jobs`: up to the packing threads or the cores; no more than the files where
/// none is mapped (each file has one writer then).
fn threads_for(device: &Device, jobs: &[Job]) -> usize {
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    let most = device.config().resolved_pack_threads().max(cores);
    match jobs.iter().any(|j| j.target.mapped()) {
        true => most,
        false => jobs.len().min(most).max(1),
    }
}

/// Bytes of a piece for `threads` threads: each holds up to two pieces of pinned memory (one
/// on the wire, one being written), and all of them at most half the pinned cap.
fn piece_for(device: &Device, threads: usize, batch_bytes: u64) -> u64 {
    let cap = device.config().pinned_cap_bytes;
    (cap / 2 / (2 * threads as u64)).clamp(MIN_PIECE, MAX_PIECE).min(batch_bytes.max(MIN_BATCH))
}

/// The work of a save in units a thread takes whole, in the order they are taken: a file
/// written with `pwrite` is one unit of all its pieces (the largest such file first: the save
/// lasts at least as long as it takes one thread), a mapped file's pieces a unit each.
fn units(jobs: &[Job], lens: &[usize], piece: u64) -> Vec<Vec<Piece>> {
    let bytes = |j: usize| jobs[j].places.iter().map(|&(_, i)| lens[i] as u64).sum::<u64>();
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by_key(|&j| (jobs[j].target.mapped(), std::cmp::Reverse(bytes(j))));
    let mut out = Vec::new();
    for j in order {
        let pieces = pieces(&jobs[j].places, lens, piece).into_iter().map(|segs| (j, segs));
        match jobs[j].target.mapped() {
            true => out.extend(pieces.map(|p| vec![p])),
            false => out.push(pieces.collect()),
        }
    }
    out.retain(|u| !u.is_empty());
    out
}

/// Sets `failed` if the thread unwinds, so that the others stop.
struct StopOthers<'a>(&'a AtomicBool);

impl Drop for StopOthers<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Relaxed);
        }
    }
}

/// Writes every job's tensors into its file; reports progress (bytes written, of `total`)
/// on the calling thread. On an error in any thread the others stop at their next piece and
/// the first error is returned; a panic in one is resumed here once all have stopped.
pub(super) fn write_all(
    device: &Device,
    jobs: &[Job],
    (items, lens): (&[Item<'_>], &[usize]),
    pacing: &mut Pacing<'_>,
    total: u64,
) -> Result<()> {
    let most = threads_for(device, jobs);
    let piece = piece_for(device, most, pacing.batch_bytes);
    let units = units(jobs, lens, piece);
    let threads = most.min(units.len()).max(1);
    let (next, failed) = (AtomicUsize::new(0), AtomicBool::new(false));
    let units = &units;
    let outcomes = std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel::<u64>();
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (tx, next, failed) = (tx.clone(), &next, &failed);
                crate::sync::spawn_in(s, move || {
                    let _stop = StopOthers(failed);
                    let written = write_units(device, jobs, items, (units, next), failed, &tx);
                    if written.is_err() {
                        failed.store(true, Ordering::Relaxed);
                    }
                    written
                })
            })
            .collect();
        drop(tx);
        // A panicking progress callback stops the threads too.
        let _stop = StopOthers(&failed);
        let mut done = 0u64;
        for bytes in rx {
            done += bytes;
            pacing.report(done, total);
        }
        handles.into_iter().map(|h| h.join()).collect::<Vec<_>>()
    });
    let mut first = Ok(());
    for outcome in outcomes {
        match outcome {
            Err(panic) => std::panic::resume_unwind(panic),
            Ok(Err(e)) if first.is_ok() => first = Err(e),
            Ok(_) => {}
        }
    }
    // A save of no bytes reports its end once, as every other save's last piece does.
    if first.is_ok() && total == 0 {
        pacing.report(0, 0);
    }
    first
}

/// The segments of `places`, cut into pieces of up to `piece` bytes (a tensor may be split
/// between two); empty tensors have none.
fn pieces(places: &[(u64, usize)], lens: &[usize], piece: u64) -> Vec<Vec<Seg>> {
    let mut out = vec![Vec::new()];
    let mut room = piece;
    for &(file_at, item) in places {
        let len = lens[item] as u64;
        let mut at = 0;
        while at < len {
            if room == 0 {
                out.push(Vec::new());
                room = piece;
            }
            let n = (len - at).min(room);
            out.last_mut().expect("one at least").push(Seg { item, at, len: n, file_at: file_at + at });
            at += n;
            room -= n;
        }
    }
    out.retain(|p| !p.is_empty());
    out
}

/// A piece on its way: its download and slots, its job and segments.
type InFlight<'u> = (PendingDownload, Vec<Slot>, usize, &'u [Seg]);

/// Takes units until none is left (or another thread failed), downloading each piece and
/// writing it, the next piece on the wire while one is written.
fn write_units(
    device: &Device,
    jobs: &[Job],
    items: &[Item<'_>],
    (units, next): (&[Vec<Piece>], &AtomicUsize),
    failed: &AtomicBool,
    progress: &mpsc::Sender<u64>,
) -> Result<()> {
    let mut in_flight: Option<InFlight> = None;
    loop {
        let u = next.fetch_add(1, Ordering::Relaxed);
        if u >= units.len() || failed.load(Ordering::Relaxed) {
            break;
        }
        for (job, segs) in &units[u] {
            #[cfg(test)]
            tests_hook::maybe_fail(jobs[*job].target.path())?;
            if failed.load(Ordering::Relaxed) {
                return Ok(());
            }
            let mut batch = device.downloads();
            let mut slots = Vec::with_capacity(segs.len());
            for s in segs {
                slots.push(batch.read(items[s.item].buffer, items[s.item].offset + s.at, s.len)?);
            }
            let next = (batch.submit()?, slots, *job, segs.as_slice());
            if let Some(landing) = in_flight.replace(next) {
                write_piece(jobs, landing, progress)?;
            }
        }
    }
    match in_flight {
        Some(landing) if !failed.load(Ordering::Relaxed) => write_piece(jobs, landing, progress),
        _ => Ok(()),
    }
}

/// Waits for a piece and writes its views at their offsets: into a mapped file each view
/// straight from the pinned memory; with `pwrite`, large views so, runs of small ones copied
/// together first.
fn write_piece(
    jobs: &[Job],
    (pending, slots, job, segs): InFlight<'_>,
    progress: &mpsc::Sender<u64>,
) -> Result<()> {
    let landed = pending.wait()?;
    let job = &jobs[job];
    let write = |bytes: &[u8], at: u64| job.target.write(bytes, at);
    let coalesce = if job.target.mapped() { 0 } else { COALESCE };
    let (mut run, mut run_at) = (Vec::new(), 0u64);
    let mut bytes = 0u64;
    for (seg, slot) in segs.iter().zip(slots) {
        let view = landed.get(slot);
        bytes += seg.len;
        let joins = run_at + run.len() as u64 == seg.file_at;
        if !run.is_empty() && (view.len() >= coalesce || !joins) {
            write(&run, run_at)?;
            run.clear();
        }
        if view.len() >= coalesce {
            write(view, seg.file_at)?;
        } else {
            if run.is_empty() {
                run_at = seg.file_at;
            }
            run.extend_from_slice(view);
        }
    }
    if !run.is_empty() {
        write(&run, run_at)?;
    }
    // The receiver lives until every thread is done.
    let _ = progress.send(bytes);
    Ok(())
}

/// Tests: make the thread of a file whose name holds a marker fail or panic.
#[cfg(test)]
pub(super) mod tests_hook {
    use std::path::Path;

    use crate::weights::error::WeightsError;

    /// A second shard's file name holding this makes its thread return an error.
    pub(crate) const FAIL: &str = "fail-this-shard";
    /// A second shard's file name holding this makes its thread panic.
    pub(crate) const PANIC: &str = "panic-this-shard";

    pub(super) fn maybe_fail(path: &Path) -> Result<(), WeightsError> {
        let name = path.to_string_lossy();
        if !name.contains("-00002-of-") {
            return Ok(());
        }
        if name.contains(PANIC) {
            panic!("a shard's thread panicked (test)");
        }
        if name.contains(FAIL) {
            let cause = std::io::Error::other("injected by the test");
            return Err(WeightsError::io("writing", path, &cause));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_every_byte_once_in_order() {
        let lens = [10, 0, 25, 3, 7];
        let places = [(100, 0), (110, 1), (110, 2), (135, 3), (138, 4)];
        for piece in [1, 4, 10, 13, 100] {
            let ps = pieces(&places, &lens, piece);
            let segs: Vec<Seg> = ps.iter().flatten().copied().collect();
            assert!(ps.iter().all(|p| p.iter().map(|s| s.len).sum::<u64>() <= piece));
            let mut at = 100;
            for s in &segs {
                assert_eq!(s.file_at, at);
                assert_eq!(s.file_at, places.iter().find(|p| p.1 == s.item).unwrap().0 + s.at);
                at += s.len;
            }
            assert_eq!(at, 145, "piece {piece}");
        }
        assert!(pieces(&[(8, 0)], &[0], 4).is_empty());
    }
}

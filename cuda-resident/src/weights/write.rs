//! The bytes of a save: every file (one, or each shard) written by a thread of its own, up
//! to one per core, in parallel. Each thread downloads its file's tensors through the engine
//! in pieces of up to a few tens of MiB (a download batch each: small tensors gathered on
//! the device, large ones by one DMA, into pinned memory) and writes the pinned views at
//! their offsets with `pwrite`, the next piece on the wire while this one is written.
//!
//! Why files of their own: buffered writes into one file are bounded by the kernel (2.5-6
//! GB/s on the H200 machine, whatever the thread count), threads writing files of their own
//! are not (42 GB/s at 16 threads).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;

use super::Pacing;
use super::error::WeightsError;
use super::load::MIN_BATCH;
use super::save::Item;
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
pub(super) struct Job<'a> {
    pub(super) file: File,
    pub(super) path: &'a Path,
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

/// Threads for `jobs` files: one per file, up to the packing threads or the cores.
fn threads_for(device: &Device, jobs: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    jobs.min(device.config().resolved_pack_threads().max(cores)).max(1)
}

/// Bytes of a piece for `threads` threads: each holds up to two pieces of pinned memory (one
/// on the wire, one being written), and all of them at most half the pinned cap.
fn piece_for(device: &Device, threads: usize, batch_bytes: u64) -> u64 {
    let cap = device.config().pinned_cap_bytes;
    (cap / 2 / (2 * threads as u64)).clamp(MIN_PIECE, MAX_PIECE).min(batch_bytes.max(MIN_BATCH))
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
    jobs: &[Job<'_>],
    (items, lens): (&[Item<'_>], &[usize]),
    pacing: &mut Pacing<'_>,
    total: u64,
) -> Result<()> {
    let threads = threads_for(device, jobs.len());
    let piece = piece_for(device, threads, pacing.batch_bytes);
    let (next, failed) = (AtomicUsize::new(0), AtomicBool::new(false));
    // The largest files first: the save lasts at least as long as its largest file takes
    // one thread (writes into one file do not scale with threads), so it must not start last.
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by_key(|&j| std::cmp::Reverse(jobs[j].places.iter().map(|&(_, i)| lens[i]).sum::<usize>()));
    let order = &order;
    let outcomes = std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel::<u64>();
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (tx, next, failed) = (tx.clone(), &next, &failed);
                crate::sync::spawn_in(s, move || {
                    let _stop = StopOthers(failed);
                    loop {
                        let j = next.fetch_add(1, Ordering::Relaxed);
                        if j >= jobs.len() || failed.load(Ordering::Relaxed) {
                            return Ok(());
                        }
                        let written = write_job(device, &jobs[order[j]], (items, lens), piece, failed, &tx);
                        if written.is_err() {
                            failed.store(true, Ordering::Relaxed);
                            return written;
                        }
                    }
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

/// A piece on its way: its download and segments.
type InFlight = (PendingDownload, Vec<Slot>, Vec<Seg>);

/// Downloads and writes one job's pieces, the next on the wire while one is written.
fn write_job(
    device: &Device,
    job: &Job<'_>,
    (items, lens): (&[Item<'_>], &[usize]),
    piece: u64,
    failed: &AtomicBool,
    progress: &mpsc::Sender<u64>,
) -> Result<()> {
    #[cfg(test)]
    tests_hook::maybe_fail(job.path)?;
    let mut in_flight: Option<InFlight> = None;
    for segs in pieces(&job.places, lens, piece) {
        if failed.load(Ordering::Relaxed) {
            return Ok(());
        }
        let mut batch = device.downloads();
        let slots = segs
            .iter()
            .map(|s| batch.read(items[s.item].buffer, items[s.item].offset + s.at, s.len))
            .collect::<Result<Vec<Slot>>>()?;
        let next = (batch.submit()?, slots, segs);
        if let Some(landing) = in_flight.replace(next) {
            write_piece(job, landing, progress)?;
        }
    }
    if let Some(landing) = in_flight {
        write_piece(job, landing, progress)?;
    }
    Ok(())
}

/// Waits for a piece and writes its views at their offsets: large views straight from the
/// pinned memory, runs of small ones copied together first.
fn write_piece(job: &Job<'_>, (pending, slots, segs): InFlight, progress: &mpsc::Sender<u64>) -> Result<()> {
    let landed = pending.wait()?;
    let write = |bytes: &[u8], at: u64| {
        job.file.write_all_at(bytes, at).map_err(|e| WeightsError::io("writing", job.path, &e))
    };
    let (mut run, mut run_at) = (Vec::new(), 0u64);
    let mut bytes = 0u64;
    for (seg, slot) in segs.iter().zip(slots) {
        let view = landed.get(slot);
        bytes += seg.len;
        let joins = run_at + run.len() as u64 == seg.file_at;
        if !run.is_empty() && (view.len() >= COALESCE || !joins) {
            write(&run, run_at)?;
            run.clear();
        }
        if view.len() >= COALESCE {
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

    use super::WeightsError;

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

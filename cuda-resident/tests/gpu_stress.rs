//! Concurrency stress on a real GPU: 16 threads share one device and run random mixes of
//! allocate, write batches (copied and in place), read batches, whole downloads and frees
//! (some while their uploads are in flight) for a bounded time, each checking every byte it
//! reads against its own model of what it wrote. At the end: no corruption, no deadlock
//! (a watchdog fails the test if a thread is stuck), and exact accounting: with every buffer
//! freed, the store holds only the lanes' staging and no pinned memory is lent.
//!
//! Callbacks that panic are mixed in: some batches of in-place writes have a fill closure
//! that panics part-way (caught by the thread), and some prepared uploads an `AsRef` that
//! panics; such a batch is poisoned, moves nothing (the thread's model stays as it was and
//! later reads check it), and its staging goes back.
//!
//! Ignored where there is no GPU. `STRESS_SECONDS` sets the duration (default 30);
//! `STRESS_THREADS` the thread count (default 16).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cuda_resident::{Config, Device, Fence, ResidentBuffer};

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[derive(Default)]
struct Totals {
    ops: AtomicU64,
    panics_caught: AtomicU64,
    bytes_written: AtomicU64,
    bytes_checked: AtomicU64,
    frees_in_flight: AtomicU64,
}

struct Owned {
    buffer: ResidentBuffer,
    bytes: Vec<u8>,
}

/// The text of the panics this test makes on purpose (kept out of the output).
const DELIBERATE: &str = "deliberate panic in a callback";

/// Bytes whose `as_ref` panics: a caller's type that fails inside the library's call.
struct Explosive;

impl AsRef<[u8]> for Explosive {
    fn as_ref(&self) -> &[u8] {
        panic!("{DELIBERATE}")
    }
}

/// Data for a prepared upload: ordinary bytes, or the one that panics.
enum Item {
    Bytes(Vec<u8>),
    Explosive(Explosive),
}

impl AsRef<[u8]> for Item {
    fn as_ref(&self) -> &[u8] {
        match self {
            Item::Bytes(b) => b,
            Item::Explosive(e) => e.as_ref(),
        }
    }
}

fn first_difference(got: &[u8], want: &[u8]) -> Option<usize> {
    got.iter().zip(want).position(|(a, b)| a != b).or((got.len() != want.len()).then_some(0))
}

/// One thread's random mix until `deadline`. Panics on corruption or any error.
fn worker(d: &Device, seed: u64, deadline: Instant, totals: &Totals) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut owned: Vec<Owned> = Vec::new();
    let mut fences: Vec<Fence> = Vec::new();
    let context = |what: &str| format!("thread seed {seed:#x}: {what}");
    while Instant::now() < deadline {
        let op = rng.u8(0..100);
        match op {
            // Allocate, mostly small, sometimes past the slab (a dedicated allocation).
            0..=14 if owned.len() < 24 => {
                let len = match rng.u8(0..20) {
                    0 => rng.usize(64 << 20..70 << 20),
                    1..=4 => rng.usize(1 << 20..8 << 20),
                    _ => rng.usize(1..256 << 10),
                };
                let buffer = d.allocate(len as u64).unwrap_or_else(|e| panic!("{}", context(&e.to_string())));
                let mut bytes = vec![0u8; len];
                rng.fill(&mut bytes);
                d.upload(buffer, &bytes).unwrap();
                totals.bytes_written.fetch_add(len as u64, Ordering::Relaxed);
                owned.push(Owned { buffer, bytes });
            }
            // A poisoned batch: in-place writes, one of whose fills panics; the thread catches
            // the panic, adds more writes (refused) and submits (refused): nothing moves.
            15..=19 if !owned.is_empty() => {
                let junk = vec![0xEEu8; 4096];
                let mut batch = d.uploads();
                let n = rng.usize(1..200);
                let bad = rng.usize(0..n);
                for k in 0..n {
                    let i = rng.usize(0..owned.len());
                    let size = owned[i].bytes.len();
                    let len = rng.usize(1..=size.min(4096));
                    let offset = rng.usize(0..=size - len) as u64;
                    let buffer = owned[i].buffer;
                    if k < bad {
                        let fill = rng.u8(1..=255);
                        batch.write_with(buffer, offset, len, |dst| dst.fill(fill)).unwrap();
                    } else if k == bad {
                        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            let _ = batch.write_with(buffer, offset, len, |dst| {
                                dst[0] = 1;
                                panic!("{DELIBERATE}");
                            });
                        }));
                        assert!(caught.is_err(), "{}", context("the fill's panic reaches the caller"));
                        totals.panics_caught.fetch_add(1, Ordering::Relaxed);
                    } else {
                        let refused = batch.write(buffer, offset, &junk[..len]).map(|_| ()).unwrap_err();
                        assert!(refused.to_string().contains("Fix:"), "{}", context(&refused.to_string()));
                    }
                }
                let refused = batch.submit().map(|_| ()).unwrap_err();
                assert!(refused.to_string().contains("Fix:"), "{}", context(&refused.to_string()));
            }
            // A prepared upload whose data panics in `as_ref`: nothing moves.
            20..=22 if !owned.is_empty() => {
                let i = rng.usize(0..owned.len());
                let size = owned[i].bytes.len();
                let count = rng.usize(1..=size.min(128));
                let ranges: Vec<_> =
                    (0..count).map(|k| (owned[i].buffer, (k * (size / count)) as u64, 1)).collect();
                let mut set = d.prepare_uploads(&ranges).unwrap();
                let bad = rng.usize(0..count);
                let data: Vec<Item> = (0..count)
                    .map(|k| if k == bad { Item::Explosive(Explosive) } else { Item::Bytes(vec![0xEE]) })
                    .collect();
                let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let _ = set.upload(&data);
                }));
                assert!(caught.is_err(), "{}", context("the as_ref panic reaches the caller"));
                totals.panics_caught.fetch_add(1, Ordering::Relaxed);
            }
            // A batch of writes, copied or in place; its fence kept, waited on later or never.
            23..=49 if !owned.is_empty() => {
                let n = rng.usize(1..400);
                let in_place = rng.bool();
                let mut data: Vec<(usize, usize, Vec<u8>)> = Vec::with_capacity(n);
                for _ in 0..n {
                    let i = rng.usize(0..owned.len());
                    let size = owned[i].bytes.len();
                    let cap = if rng.u8(0..50) == 0 { 1 << 20 } else { 4096 };
                    let len = rng.usize(1..=size.min(cap));
                    let offset = rng.usize(0..=size - len);
                    let mut bytes = vec![0u8; len];
                    rng.fill(&mut bytes);
                    data.push((i, offset, bytes));
                }
                let mut batch = d.uploads();
                for (i, offset, bytes) in &data {
                    let buffer = owned[*i].buffer;
                    if in_place {
                        batch
                            .write_with(buffer, *offset as u64, bytes.len(), |dst| dst.copy_from_slice(bytes))
                    } else {
                        batch.write(buffer, *offset as u64, bytes)
                    }
                    .unwrap();
                }
                fences.push(batch.submit().unwrap());
                for (i, offset, bytes) in &data {
                    owned[*i].bytes[*offset..*offset + bytes.len()].copy_from_slice(bytes);
                    totals.bytes_written.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                }
                if fences.len() > 8 || rng.u8(0..4) == 0 {
                    for f in fences.drain(..) {
                        f.wait().unwrap();
                    }
                }
            }
            // A batch of reads, checked as views or copied into vectors.
            50..=79 if !owned.is_empty() => {
                let mut reads = d.downloads();
                let mut expected = Vec::new();
                for _ in 0..rng.usize(1..300) {
                    let i = rng.usize(0..owned.len());
                    let size = owned[i].bytes.len();
                    let len = rng.usize(1..=size.min(8192));
                    let offset = rng.usize(0..=size - len);
                    let slot = reads.read(owned[i].buffer, offset as u64, len as u64).unwrap();
                    expected.push((slot, owned[i].bytes[offset..offset + len].to_vec()));
                }
                let pending = reads.submit().unwrap();
                if rng.bool() {
                    let got = pending.wait().unwrap();
                    for (slot, want) in &expected {
                        if let Some(at) = first_difference(got.get(*slot), want) {
                            panic!("{}", context(&format!("read view differs at {at}")));
                        }
                    }
                } else {
                    let slots: Vec<_> = expected.iter().map(|(s, _)| *s).collect();
                    let mut out = vec![Vec::new(); slots.len()];
                    pending.wait_into(&slots, &mut out).unwrap();
                    for (got, (_, want)) in out.iter().zip(&expected) {
                        if let Some(at) = first_difference(got, want) {
                            panic!("{}", context(&format!("read copy differs at {at}")));
                        }
                    }
                }
                let checked: usize = expected.iter().map(|(_, w)| w.len()).sum();
                totals.bytes_checked.fetch_add(checked as u64, Ordering::Relaxed);
            }
            // A whole buffer back.
            80..=87 if !owned.is_empty() => {
                let i = rng.usize(0..owned.len());
                let got = d.download(owned[i].buffer).unwrap();
                if let Some(at) = first_difference(&got, &owned[i].bytes) {
                    panic!("{}", context(&format!("download of {} bytes differs at {at}", got.len())));
                }
                totals.bytes_checked.fetch_add(got.len() as u64, Ordering::Relaxed);
            }
            // Free, possibly with the buffer's uploads still in flight.
            88..=99 if !owned.is_empty() => {
                let gone = owned.swap_remove(rng.usize(0..owned.len()));
                if !fences.is_empty() {
                    totals.frees_in_flight.fetch_add(1, Ordering::Relaxed);
                }
                d.free(gone.buffer).unwrap();
            }
            _ => continue,
        }
        totals.ops.fetch_add(1, Ordering::Relaxed);
    }
    for f in fences {
        f.wait().unwrap();
    }
    // A last full check, then everything goes.
    for o in owned {
        let got = d.download(o.buffer).unwrap();
        assert!(first_difference(&got, &o.bytes).is_none(), "{}", context("final download differs"));
        totals.bytes_checked.fetch_add(got.len() as u64, Ordering::Relaxed);
        d.free(o.buffer).unwrap();
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn sixteen_threads_of_random_work_corrupt_nothing_and_account_exactly() {
    let seconds = env_or("STRESS_SECONDS", 30);
    let threads = env_or("STRESS_THREADS", 16);
    // Small chunks and a small pinned cap: batches split, staging is contended and reused.
    let config = Config::default()
        .with_chunk_bytes(2 << 20)
        .with_direct_threshold(128 << 10)
        .with_pinned_cap_bytes(256 << 20);
    let base = Device::open(0).unwrap_or_else(|e| panic!("{e}"));
    // The panics this test makes on purpose are caught and counted; others print as usual.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let text = info.payload().downcast_ref::<String>().map(String::as_str).unwrap_or("");
        if !text.contains(DELIBERATE) {
            default_hook(info);
        }
    }));
    let d = Device::open_on_driver(Arc::clone(base.driver()), 0, config).unwrap();
    let totals = Arc::new(Totals::default());
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let (done_tx, done_rx) = mpsc::channel();
    let started = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (d, totals, done) = (d.clone(), Arc::clone(&totals), done_tx.clone());
            std::thread::spawn(move || {
                let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    worker(&d, 0x57e55 + t * 7919, deadline, &totals)
                }));
                let _ = done.send(outcome.is_ok());
            })
        })
        .collect();
    drop(done_tx);
    // Watchdog: every thread reports within the duration plus a generous margin, or the
    // test fails as a deadlock instead of hanging.
    let margin = Duration::from_secs(120);
    let mut ok = 0;
    for _ in 0..threads {
        match done_rx.recv_timeout((deadline + margin).saturating_duration_since(Instant::now())) {
            Ok(true) => ok += 1,
            Ok(false) => {}
            Err(_) => panic!("a thread did not finish {margin:?} after the deadline: deadlock"),
        }
    }
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(ok, threads, "{} of {threads} threads failed (see their panics above)", threads - ok);

    d.synchronize().unwrap();
    d.trim().unwrap();
    let t = d.telemetry();
    let elapsed = started.elapsed().as_secs_f64();
    println!(
        "stress: {threads} threads, {elapsed:.1} s, {} operations, {} bytes written, {} bytes read and \
         checked, {} panics in callbacks caught, {} frees with uploads in flight, {} deferred frees, {} upload \
         / {} download submissions, {} host waits",
        totals.ops.load(Ordering::Relaxed),
        totals.bytes_written.load(Ordering::Relaxed),
        totals.bytes_checked.load(Ordering::Relaxed),
        totals.panics_caught.load(Ordering::Relaxed),
        totals.frees_in_flight.load(Ordering::Relaxed),
        t.memory.deferred_frees,
        t.upload_submissions,
        t.download_submissions,
        t.host_waits,
    );
    assert!(totals.ops.load(Ordering::Relaxed) > threads * 10, "too little work to mean anything");
    assert!(totals.panics_caught.load(Ordering::Relaxed) > 0, "no callback panicked");
    // Exact accounting: every caller buffer freed, so the caller's bytes are back to zero and
    // the store holds only the lanes' staging; nothing is deferred, nothing pinned is lent,
    // and the allocator's counts balance.
    assert_eq!((t.memory.allocated_bytes, t.memory.buffers), (0, 0), "{t:#?}");
    assert_eq!(t.memory.library_bytes, t.staging_bytes, "{t:#?}");
    assert!(t.memory.library_buffers <= 2, "only staging buffers remain: {t:#?}");
    assert_eq!(t.memory.deferred_bytes, 0, "{t:#?}");
    assert_eq!(t.memory.cached_bytes, 0, "{t:#?}");
    assert_eq!(t.memory.allocations - t.memory.frees, t.memory.library_buffers, "{t:#?}");
    assert_eq!(t.pinned.lent_bytes, 0, "{t:#?}");
    assert_eq!(t.pinned.reserved_bytes, 0, "trimmed: {t:#?}");
}

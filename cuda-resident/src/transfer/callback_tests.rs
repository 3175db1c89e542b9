//! Callbacks are hostile: a `write_with` closure or an `AsRef` of the caller's may panic, or
//! use the device itself. On the model driver: a batch whose callback panicked, or whose
//! in-place write was refused staging, is poisoned and moves nothing; a prepared upload
//! calls each `as_ref` once, before it locks anything.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use crate::testing::model;
use crate::testing::{Model, random_vec, small_chunks};
use crate::{Config, Device, Error, ResidentBuffer};

/// A device on a fresh model driver, and the driver (for faults and call counts).
fn device(config: Config) -> (Arc<cuda_sys::Driver>, Device) {
    let driver = model::driver();
    let d = Device::open_on_driver(Arc::clone(&driver), 0, config).expect("the model opens");
    (driver, d)
}

/// Copies and launches the driver was asked for since `record()`.
fn moves_asked(driver: &cuda_sys::Driver) -> u64 {
    let counts = driver.faults().counts();
    ["cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2", "cuLaunchKernel"]
        .iter()
        .map(|e| counts.get(e).map_or(0, |c| c.calls))
        .sum()
}

/// Two buffers of 4 KiB holding zeros.
fn zeroed_pair(d: &Device) -> (ResidentBuffer, ResidentBuffer) {
    let (a, b) = (d.allocate(4096).unwrap(), d.allocate(4096).unwrap());
    d.upload_many(&[(a, &[0u8; 4096][..]), (b, &[0u8; 4096][..])]).unwrap();
    (a, b)
}

fn assert_poisoned_by(e: &Error, write: usize, buffer: ResidentBuffer, offset: u64, len: u64, cause: &str) {
    match e {
        Error::BatchPoisoned { write: w, buffer: b, offset: o, len: l, cause: c } => {
            assert_eq!((*w, *b, *o, *l), (write, buffer, offset, len), "{e}");
            assert!(c.contains(cause), "{e}");
        }
        _ => panic!("not BatchPoisoned: {e}"),
    }
    let text = e.to_string();
    assert!(text.contains(&format!("{buffer:?}")) && text.contains(cause), "{text}");
    assert!(text.trim_end().ends_with('.') && text.contains("Fix:"), "{text}");
}

#[test]
fn a_panic_in_write_with_poisons_the_batch_returns_its_staging_and_moves_nothing() {
    let (driver, d) = device(Config::default());
    let (a, b) = zeroed_pair(&d);
    let before = d.telemetry();
    driver.faults().record();
    let ones = [1u8; 300];
    let mut batch = d.uploads();
    batch.write(a, 0, &ones).unwrap();
    batch.write_with(a, 1000, 50, |dst| dst.fill(7)).unwrap();
    assert!(d.telemetry().pinned.lent_bytes > 0, "the in-place write holds staging");
    let panicked = catch_unwind(AssertUnwindSafe(|| {
        let _ = batch.write_with(b, 64, 32, |_| panic!("the caller's fill fails"));
    }));
    assert!(panicked.is_err(), "the panic reaches the caller");
    assert_eq!(d.telemetry().pinned.lent_bytes, 0, "the batch's staging went back at once");
    // Every later call names the write that failed (the third, index 2).
    let e = batch.write(a, 2000, &ones).map(drop).unwrap_err();
    assert_poisoned_by(&e, 2, b, 64, 32, "panicked");
    let e = batch.submit().unwrap_err();
    assert_poisoned_by(&e, 2, b, 64, 32, "panicked");
    assert_eq!(moves_asked(&driver), 0, "nothing enqueued");
    assert_eq!(d.telemetry().upload_submissions, before.upload_submissions);
    assert!(d.download(a).unwrap().iter().all(|&x| x == 0), "nothing of the batch landed");
    assert_eq!(d.telemetry().pinned.lent_bytes, 0);
    // The device goes on.
    d.upload_at(a, 0, &ones).unwrap();
    assert_eq!(&d.download(a).unwrap()[..300], &ones[..]);
    assert!(model::with(|g| g.errors.is_empty()), "the model found illegal accesses");
}

#[test]
fn a_write_with_after_a_panicked_one_is_refused_and_never_lands_at_its_offset() {
    let (driver, d) = device(Config::default());
    let (a, b) = zeroed_pair(&d);
    driver.faults().record();
    let mut batch = d.uploads();
    let panicked = catch_unwind(AssertUnwindSafe(|| {
        let _ = batch.write_with(b, 64, 32, |_| panic!("the caller's fill fails"));
    }));
    assert!(panicked.is_err());
    let called = AtomicBool::new(false);
    let e = batch
        .write_with(a, 0, 32, |dst| {
            called.store(true, Ordering::Relaxed);
            dst.fill(0xEE);
        })
        .map(drop)
        .unwrap_err();
    assert_poisoned_by(&e, 0, b, 64, 32, "panicked");
    assert!(!called.load(Ordering::Relaxed), "a poisoned batch calls no fill");
    assert!(batch.submit().is_err());
    assert_eq!(moves_asked(&driver), 0, "nothing enqueued");
    assert!(d.download(b).unwrap().iter().all(|&x| x == 0), "nothing landed at the panicked write's offset");
    assert!(d.download(a).unwrap().iter().all(|&x| x == 0));
}

#[test]
fn a_write_with_refused_staging_poisons_the_batch_and_returns_its_staging_at_once() {
    let (driver, d) = device(small_chunks());
    let (a, b) = zeroed_pair(&d);
    let big = d.allocate(64 << 10).unwrap();
    let mut batch = d.uploads();
    batch.write(a, 0, &[1u8; 100]).unwrap();
    batch.write_with(a, 200, 100, |dst| dst.fill(2)).unwrap();
    let lent = d.telemetry().pinned.lent_bytes;
    assert!(lent > 0);
    // The next in-place write is large (a lease of its own), and its cuMemHostAlloc fails
    // (no free arena of the pool can serve it: they are released first).
    d.trim().unwrap();
    driver.faults().record();
    driver
        .faults()
        .inject(cuda_sys::Fault::new("cuMemHostAlloc", 1, cuda_sys::CUDA_ERROR_OUT_OF_MEMORY).times(u64::MAX))
        .unwrap();
    let refused = batch.write_with(big, 0, 16 << 10, |dst| dst.fill(3)).map(drop).unwrap_err();
    assert!(matches!(refused, Error::Driver { .. }), "the refusal itself: {refused}");
    driver.faults().remove_faults();
    assert_eq!(d.telemetry().pinned.lent_bytes, 0, "the batch's staging went back at once");
    let cause = "refused pinned staging";
    let e = batch.write(b, 0, &[4u8; 10]).map(drop).unwrap_err();
    assert_poisoned_by(&e, 2, big, 0, 16 << 10, cause);
    assert!(e.to_string().contains("cuMemHostAlloc"), "the refusal's text: {e}");
    assert_eq!(e.to_string().matches("Fix:").count(), 1, "one Fix, the poisoned batch's: {e}");
    let e = batch.write_with(b, 0, 10, |dst| dst.fill(5)).map(drop).unwrap_err();
    assert_poisoned_by(&e, 2, big, 0, 16 << 10, cause);
    let e = batch.submit().unwrap_err();
    assert_poisoned_by(&e, 2, big, 0, 16 << 10, cause);
    assert_eq!(moves_asked(&driver), 0, "nothing enqueued");
    assert!(d.download(a).unwrap().iter().all(|&x| x == 0), "nothing of the batch landed");
    assert!(d.download(b).unwrap().iter().all(|&x| x == 0));
}

/// At least 64 small ranges in order and apart over `m`'s buffers (a set laid out once).
fn laid_out_ranges(m: &Model, rng: &mut fastrand::Rng) -> Vec<(ResidentBuffer, u64, u64)> {
    loop {
        let ranges = m.in_order_ranges(rng, 600);
        if ranges.len() >= 64 {
            return ranges.iter().map(|&(i, at, len)| (m.buffers[i], at as u64, len as u64)).collect();
        }
    }
}

/// Runs `f` on a thread of its own (with its own model GPU) and fails if it does not end
/// within a minute: a deadlock fails the test instead of hanging it.
fn within_a_minute(f: impl FnOnce() + Send + 'static) {
    let (done, finished) = std::sync::mpsc::channel();
    let runner = std::thread::spawn(move || {
        f();
        let _ = done.send(());
    });
    match finished.recv_timeout(Duration::from_secs(60)) {
        Ok(()) => runner.join().unwrap(),
        // The runner panicked (its sender dropped): its panic is the failure.
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(panic) = runner.join() {
                std::panic::resume_unwind(panic);
            }
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("deadlocked: no end within a minute"),
    }
}

/// Data whose `as_ref` counts its calls and the threads they came from, panics on item
/// `panic_at`, and runs `reenter` on item 0.
struct Hostile<'a> {
    bytes: Vec<u8>,
    index: usize,
    calls: &'a AtomicUsize,
    off_thread: &'a AtomicUsize,
    caller: std::thread::ThreadId,
    panic_at: Option<usize>,
    reenter: Option<&'a (dyn Fn() + Sync)>,
}

impl AsRef<[u8]> for Hostile<'_> {
    fn as_ref(&self) -> &[u8] {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if std::thread::current().id() != self.caller {
            self.off_thread.fetch_add(1, Ordering::Relaxed);
        }
        if self.panic_at == Some(self.index) {
            panic!("the caller's as_ref fails on item {}", self.index);
        }
        if self.index == 0
            && let Some(reenter) = self.reenter
        {
            reenter();
        }
        &self.bytes
    }
}

#[test]
fn a_prepared_upload_calls_each_as_ref_once_on_the_calling_thread_and_survives_a_panic() {
    within_a_minute(|| {
        let (driver, d) = device(small_chunks());
        let mut rng = fastrand::Rng::with_seed(71);
        let mut m = Model::new(&d, &mut rng, &[300_000, 70_000, 1 << 20]);
        let ranges = laid_out_ranges(&m, &mut rng);
        let mut up = d.prepare_uploads(&ranges).unwrap();
        assert!(up.is_laid_out());
        let (calls, off_thread) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let caller = std::thread::current().id();
        let hostile = |panic_at, rng: &mut fastrand::Rng| -> Vec<Hostile<'_>> {
            (ranges.iter().enumerate())
                .map(|(index, r)| Hostile {
                    bytes: random_vec(rng, r.2 as usize),
                    index,
                    calls: &calls,
                    off_thread: &off_thread,
                    caller,
                    panic_at,
                    reenter: None,
                })
                .collect()
        };
        // A panic on an item in the middle: it reaches the caller, nothing moved.
        let lent = d.telemetry().pinned.lent_bytes;
        let before = d.telemetry();
        driver.faults().record();
        let data = hostile(Some(ranges.len() / 2), &mut rng);
        let panicked = catch_unwind(AssertUnwindSafe(|| up.upload(&data).map(drop)));
        assert!(panicked.is_err(), "the panic reaches the caller");
        assert_eq!(moves_asked(&driver), 0, "nothing enqueued");
        assert_eq!(d.telemetry().upload_submissions, before.upload_submissions);
        assert_eq!(d.telemetry().pinned.lent_bytes, lent, "no staging kept by the failed upload");
        m.check(&d, "after the panicked upload");
        // The lane is free: an ordinary upload on the same device completes.
        let other = d.allocate(4096).unwrap();
        d.upload(other, &[9u8; 4096]).unwrap();
        // The set stays usable, and each `as_ref` runs once, on the calling thread.
        calls.store(0, Ordering::Relaxed);
        let data = hostile(None, &mut rng);
        up.upload(&data).unwrap().wait().unwrap();
        assert_eq!(calls.load(Ordering::Relaxed), ranges.len(), "one as_ref call per item");
        assert_eq!(off_thread.load(Ordering::Relaxed), 0, "no as_ref on a packing thread");
        let bytes: Vec<Vec<u8>> = data.iter().map(|h| h.bytes.clone()).collect();
        m.expect_writes(&ranges, &bytes);
        m.check(&d, "the set after the panic");
    });
}

#[test]
fn a_prepared_upload_whose_as_ref_uses_the_device_completes_without_deadlock() {
    within_a_minute(|| {
        for laid_out in [true, false] {
            let (_driver, d) = device(Config { small_copies_over_bus: laid_out, ..small_chunks() });
            let mut rng = fastrand::Rng::with_seed(72);
            let mut m = Model::new(&d, &mut rng, &[300_000, 70_000, 1 << 20]);
            let ranges = laid_out_ranges(&m, &mut rng);
            let mut up = d.prepare_uploads(&ranges).unwrap();
            assert_eq!(up.is_laid_out(), laid_out);
            let side = d.allocate(4096).unwrap();
            // On its first call, item 0's `as_ref` allocates, uploads (alone and as a batch),
            // downloads and frees: every lane and lock of the device.
            let reenter = || {
                let scratch = d.allocate(1000).unwrap();
                d.upload(scratch, &[5u8; 1000]).unwrap();
                let mut batch = d.uploads();
                batch.write(side, 0, &[6u8; 4096]).unwrap();
                batch.submit().unwrap().wait().unwrap();
                assert_eq!(d.download(scratch).unwrap(), vec![5u8; 1000]);
                d.free(scratch).unwrap();
            };
            let (calls, off_thread) = (AtomicUsize::new(0), AtomicUsize::new(0));
            let caller = std::thread::current().id();
            let data: Vec<Hostile<'_>> = (ranges.iter().enumerate())
                .map(|(index, r)| Hostile {
                    bytes: random_vec(&mut rng, r.2 as usize),
                    index,
                    calls: &calls,
                    off_thread: &off_thread,
                    caller,
                    panic_at: None,
                    reenter: Some(&reenter),
                })
                .collect();
            up.upload(&data).unwrap().wait().unwrap();
            let bytes: Vec<Vec<u8>> = data.iter().map(|h| h.bytes.clone()).collect();
            m.expect_writes(&ranges, &bytes);
            m.check(&d, "after the re-entrant upload");
            assert_eq!(d.download(side).unwrap(), vec![6u8; 4096]);
        }
    });
}

/// Writes made in place that fill the pinned pool as they are added (most of the cap held by
/// a `PinnedBuffer`, or none held and the arena taking the whole cap): either every
/// `write_with` (or `write_with_par`) is taken and `submit` moves them all, taking no pinned
/// memory beyond the arena (its leases keep room for their descriptor tables), or one is
/// refused, poisoning the batch, and nothing moves. Never a `submit` that fails part way.
#[test]
fn writes_in_place_that_fill_the_pinned_pool_move_whole_or_not_at_all() {
    let config = Config {
        chunk_bytes: 64 << 10,
        direct_threshold: 8 << 10,
        pinned_cap_bytes: 8 << 20,
        ..Config::default()
    };
    let cases = [(false, true, true), (true, true, true), (false, false, true), (true, false, false)];
    for (par, hold, over_bus) in cases {
        for n in if hold { [4_000u64, 10_000, 28_000, 60_000] } else { [50_000, 150_000, 300_000, 600_000] } {
            let (_driver, d) = device(config.clone().with_small_copies_over_bus(over_bus));
            let held = hold.then(|| d.pinned((15 << 20) / 2).unwrap());
            let big = d.allocate(8 << 10).unwrap();
            let b = d.allocate(n * 32).unwrap();
            d.upload(big, &[0u8; 8 << 10]).unwrap();
            d.upload(b, &vec![0u8; (n * 32) as usize]).unwrap();
            let mut w = d.uploads();
            // A write of a lease of its own (a DMA of its own), then n one-byte writes.
            let first = if par {
                w.write_with_par(big, 0, 8 << 10, |dst| dst.fill(0xEE)).map(drop)
            } else {
                w.write_with(big, 0, 8 << 10, |dst| dst.fill(0xEE)).map(drop)
            };
            let mut refused = first.err();
            for i in 0..n {
                if refused.is_some() {
                    break;
                }
                let value = (i % 251) as u8 + 1;
                let added = if par {
                    w.write_with_par(b, i * 32, 1, move |dst| dst[0] = value).map(drop)
                } else {
                    w.write_with(b, i * 32, 1, |dst| dst[0] = value).map(drop)
                };
                refused = added.err();
            }
            let case = format!("par {par}, pool held {hold}, over the bus {over_bus}, {n} writes");
            let submitted = w.submit().and_then(|f| f.wait());
            drop(held);
            let (got, got_big) = (d.download(b).unwrap(), d.download(big).unwrap());
            match refused {
                None => {
                    submitted
                        .unwrap_or_else(|e| panic!("{case}: every write was taken, yet submit failed: {e}"));
                    for i in 0..n as usize {
                        assert_eq!(got[i * 32], (i % 251) as u8 + 1, "{case}: write {i}");
                    }
                    assert!(got_big.iter().all(|&v| v == 0xEE), "{case}: the large write");
                }
                Some(e) => {
                    assert!(
                        matches!(e, Error::PinnedExhausted { .. } | Error::PinnedCapExceeded { .. }),
                        "{case}: {e}"
                    );
                    assert!(submitted.is_err(), "{case}: a poisoned batch submitted");
                    assert!(
                        got.iter().chain(&got_big).all(|&v| v == 0),
                        "{case}: a refused batch moved bytes"
                    );
                }
            }
        }
    }
}

/// The smallest pool a config accepts (two chunks) lends two leases of in-place writes at
/// once, by `write_with` and `write_with_par`, over the bus or by DMA: two writes of 40 KiB
/// (a lease each, the direct threshold at the chunk), and a write of 40 KiB beside one of 8
/// KiB that takes a lease of its own (the threshold at 8 KiB).
#[test]
fn the_smallest_pinned_pool_lends_two_leases_of_writes_in_place() {
    let shapes: [(u64, [(usize, usize); 2]); 2] =
        [(64 << 10, [(0, 40 << 10), (50_000, 40 << 10)]), (8 << 10, [(0, 40 << 10), (128 << 10, 8 << 10)])];
    for (threshold, writes) in shapes {
        for (par, over_bus) in [(false, false), (false, true), (true, false), (true, true)] {
            let case = format!("threshold {threshold}, par {par}, over the bus {over_bus}");
            let config = Config {
                chunk_bytes: 64 << 10,
                direct_threshold: threshold,
                pinned_cap_bytes: 128 << 10,
                ..small_chunks()
            };
            let (_driver, d) = device(config.with_small_copies_over_bus(over_bus));
            let b = d.allocate(256 << 10).unwrap();
            d.upload(b, &vec![0u8; 256 << 10]).unwrap();
            let mut w = d.uploads();
            for (k, &(at, len)) in writes.iter().enumerate() {
                let value = k as u8 + 1;
                let added = match par {
                    true => w.write_with_par(b, at as u64, len, move |dst| dst.fill(value)).map(drop),
                    false => w.write_with(b, at as u64, len, |dst| dst.fill(value)).map(drop),
                };
                added.unwrap_or_else(|e| panic!("{case}: write {k} refused: {e}"));
            }
            w.submit().and_then(|f| f.wait()).unwrap_or_else(|e| panic!("{case}: {e}"));
            let got = d.download(b).unwrap();
            for (k, &(at, len)) in writes.iter().enumerate() {
                assert!(got[at..at + len].iter().all(|&v| v == k as u8 + 1), "{case}: write {k}");
            }
        }
    }
}

/// A batch of writes in place and writes from slices takes the planned route, which leases
/// staging at submit while the in-place writes hold theirs. Where the pool cannot lend its
/// largest chunk (a later one, with its descriptor table), submit fails before anything
/// moves, not after its first chunk has landed; with room for it, everything lands.
#[test]
fn a_mixed_batch_the_pool_cannot_stage_fails_at_submit_before_anything_moves() {
    for cap in [256u64 << 10, 320 << 10] {
        let config = Config {
            chunk_bytes: 64 << 10,
            direct_threshold: 8 << 10,
            pinned_cap_bytes: cap,
            ..small_chunks()
        }
        .with_small_copies_over_bus(false);
        let (_driver, d) = device(config);
        let (a, b) = (d.allocate(1 << 20).unwrap(), d.allocate(1 << 20).unwrap());
        d.upload(a, &vec![0u8; 1 << 20]).unwrap();
        d.upload(b, &vec![0u8; 1 << 20]).unwrap();
        let block = vec![0xBB_u8; 8191];
        let mut w = d.uploads();
        // Three writes of a lease of their own: 192 KiB of the pool.
        for k in 0..3u64 {
            w.write_with(a, k * 100_000, 60_000, |dst| dst.fill(0xAA)).unwrap();
        }
        // From slices: chunk 0 packs 7 x 8191 + 5000 bytes (a 64 KiB arena); chunk 1 packs 8 x
        // 8191 and its table, 65,791 bytes (a 68 KiB arena).
        for k in 0..16u64 {
            w.write(b, k * 10_000, if k == 7 { &block[..5000] } else { &block[..] }).unwrap();
        }
        let submitted = w.submit().and_then(|f| f.wait());
        let (got_a, got_b) = (d.download(a).unwrap(), d.download(b).unwrap());
        if cap == 256 << 10 {
            let e = submitted.expect_err("64 KiB free cannot stage a 68 KiB chunk");
            assert!(matches!(e, Error::PinnedExhausted { .. }), "{e}");
            assert!(got_a.iter().chain(&got_b).all(|&v| v == 0), "a failed batch moved bytes");
        } else {
            submitted.unwrap_or_else(|e| panic!("128 KiB free stages every chunk: {e}"));
            for k in 0..3 {
                assert!(got_a[k * 100_000..][..60_000].iter().all(|&v| v == 0xAA), "in-place write {k}");
            }
            for k in 0..16 {
                let len = if k == 7 { 5000 } else { 8191 };
                assert!(got_b[k * 10_000..][..len].iter().all(|&v| v == 0xBB), "write {k}");
            }
        }
        assert_eq!(d.telemetry().pinned.lent_bytes, 0, "cap {cap}: the staging went back");
    }
}

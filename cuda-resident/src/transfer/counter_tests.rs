//! The counters a caller reads come back to where they were: after every mix of work that a
//! client found to leave a counter off (bad input only; prepared sets; downloads streamed
//! past the pinned cap; scoped transfers, `write_many`, a panicking parallel fill; odd
//! configurations; several threads), `Device::allocated_bytes` and
//! `AllocatorStats::buffers` are back at their baseline exactly, the library's device memory
//! is exactly the lanes' staging (`TelemetrySnapshot::staging_bytes`) once no prepared set is
//! alive, the resident store's byte counts add up to what it holds from the driver, and the
//! pinned pool lends nothing. Then random operation sequences against a model of the
//! counters.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use crate::testing::{Model, device, model, random_vec, small_chunks};
use crate::{Config, Device, ResidentBuffer, TelemetrySnapshot};

/// What the caller owns, as the device counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Caller {
    bytes: u64,
    buffers: u64,
}

fn caller(d: &Device) -> Caller {
    let t = d.telemetry();
    assert_eq!(d.allocated_bytes(), t.memory.allocated_bytes, "the two views of the caller's bytes agree");
    Caller { bytes: t.memory.allocated_bytes, buffers: t.memory.buffers }
}

/// Every counter of a settled device against `want` and against each other.
fn settled(d: &Device, want: Caller, what: &str) -> TelemetrySnapshot {
    d.synchronize().unwrap();
    let t = d.telemetry();
    let m = t.memory;
    assert_eq!(caller(d), want, "{what}: the caller's bytes and buffers: {m:?}");
    assert_eq!(m.library_bytes, t.staging_bytes, "{what}: the library holds its lanes' staging alone: {t:?}");
    assert!(m.library_buffers <= 2, "{what}: one staging buffer a lane at most: {m:?}");
    assert_eq!(
        m.reserved_bytes,
        m.footprint_bytes + m.cached_bytes + m.kept_bytes + m.slab_free_bytes + m.deferred_bytes,
        "{what}: the store's bytes add up to what it holds: {m:?}"
    );
    assert!(m.footprint_bytes >= m.allocated_bytes + m.library_bytes, "{what}: {m:?}");
    assert!(
        m.kept_bytes <= m.dedicated_bytes
            && m.dedicated_bytes <= m.reserved_bytes
            && m.reserved_bytes <= m.peak_reserved_bytes,
        "{what}: {m:?}"
    );
    assert!(m.frees <= m.allocations && m.driver_frees <= m.driver_allocations, "{what}: {m:?}");
    assert!((0.0..=1.0).contains(&m.fragmentation), "{what}: {m:?}");
    let p = t.pinned;
    assert_eq!((p.lent_bytes, p.held_bytes), (0, 0), "{what}: pinned memory still lent: {p:?}");
    assert!(p.reserved_bytes <= p.cap_bytes && p.held_limit_bytes <= p.cap_bytes, "{what}: {p:?}");
    // A counter that went below zero and wrapped reads as more than any device holds.
    for (name, v) in [
        ("allocated", m.allocated_bytes),
        ("library", m.library_bytes),
        ("footprint", m.footprint_bytes),
        ("reserved", m.reserved_bytes),
        ("cached", m.cached_bytes),
        ("kept", m.kept_bytes),
        ("staging", t.staging_bytes),
        ("pinned reserved", p.reserved_bytes),
    ] {
        assert!(v <= d.info().total_memory.max(p.cap_bytes), "{what}: {name} is {v}: wrapped");
    }
    assert!(model::with(|g| g.errors.is_empty()), "{what}: the model found illegal accesses");
    t
}

/// Runs `mix` on a fresh device of `config` between two readings; the caller's own buffers
/// made inside it are freed by it.
fn returns_to_baseline(config: Config, what: &str, mix: impl FnOnce(&Device)) {
    let d = device(config);
    // A buffer of the caller's that lives through the mix: its bytes stay in the count.
    let keep = d.allocate(12_345).unwrap();
    let base = caller(&d);
    mix(&d);
    settled(&d, base, what);
    d.trim().unwrap();
    assert_eq!(d.telemetry().memory.kept_bytes, 0, "{what}: trim gives kept blocks back");
    settled(&d, base, &format!("{what}, trimmed"));
    d.free(keep).unwrap();
    settled(&d, Caller { bytes: base.bytes - 12_345, buffers: base.buffers - 1 }, &format!("{what}, freed"));
}

fn refused<T: std::fmt::Debug>(what: &str, r: crate::Result<T>) {
    let e = r.expect_err(what);
    assert!(e.to_string().contains("Fix:"), "{what}: no Fix in {e}");
}

#[test]
fn bad_input_alone_leaves_every_counter_at_its_baseline() {
    returns_to_baseline(Config::default(), "bad input", |d| {
        let b = d.allocate(1 << 20).unwrap();
        let n = 1u64 << 20;
        refused("upload past the end", d.upload_at(b, n - 1, &[1, 2]));
        refused("upload at u64::MAX", d.upload_at(b, u64::MAX, &[1]));
        refused("empty upload at u64::MAX", d.upload_at(b, u64::MAX, &[]));
        refused("download range overflowing", d.download_range(b, 1, u64::MAX));
        refused("download range at u64::MAX", d.download_range(b, u64::MAX, 1));
        refused("download range past the end", d.download_range(b, n, 1));
        refused("ranges past the end", d.download_ranges(&[(b, 0, 16), (b, n - 8, 16)]));
        refused("a slice past the end", d.download_to_slice(b, n - 1, &mut [0u8; 2]));
        refused("zero bytes", d.allocate(0));
        refused("u64::MAX bytes", d.allocate(u64::MAX));
        let mut up = d.uploads();
        up.write(b, 0, &[7; 64]).unwrap();
        refused("a batch's write at u64::MAX", up.write(b, u64::MAX, &[]).map(drop));
        refused("a batch's fill past the end", up.write_with(b, n, 1, |_| ()).map(drop));
        refused("a batch with a bad write", up.submit());
        let mut down = d.downloads();
        down.read(b, 0, 8).unwrap();
        refused("a read at u64::MAX", down.read(b, u64::MAX, 2));
        refused("a batch with a bad read", down.submit().map(drop));
        refused("a prepared upload past the end", d.prepare_uploads(&[(b, 0, 8), (b, n, 8)]));
        refused("a prepared download overflowing", d.prepare_downloads(&[(b, u64::MAX, 2)]));
        d.free(b).unwrap();
        refused("a freed buffer", d.upload(b, &[1]));
        refused("freed twice", d.free(b));
    });
}

#[test]
fn prepared_sets_leave_every_counter_at_its_baseline() {
    let mut rng = fastrand::Rng::with_seed(38);
    returns_to_baseline(small_chunks(), "prepared sets", |d| {
        let m = Model::new(d, &mut rng, &[300_000, 5_000]);
        let ranges: Vec<_> = (0..700u64).map(|i| (m.buffers[0], i * 400, 300)).collect();
        let rows: Vec<Vec<u8>> = (0..700).map(|_| random_vec(&mut rng, 300)).collect();
        let before = d.telemetry();
        let mut up = d.prepare_uploads(&ranges).unwrap();
        let mut down = d.prepare_downloads(&ranges).unwrap();
        let during = d.telemetry().memory;
        assert!(during.library_bytes > before.memory.library_bytes, "the sets' tables are the library's");
        assert_eq!(during.allocated_bytes, before.memory.allocated_bytes, "... not the caller's");
        up.upload(&rows).unwrap().wait().unwrap();
        let mut out = vec![Vec::new(); rows.len()];
        down.download_into(&mut out).unwrap();
        assert_eq!(out, rows);
        // Rows that answer fewer bytes the second time they are asked.
        let shrinking: Vec<Arc<[u8]>> = rows.iter().map(|r| Arc::from(&r[..])).collect();
        let liar: Vec<LiarRow> = shrinking.iter().map(|r| LiarRow::new(Arc::clone(r))).collect();
        refused_or_ok(up.upload(&liar).map(|f| f.wait()));
        // Short rows, and too few rows.
        refused("a row too short", up.upload(&vec![vec![1u8; 299]; 700]));
        refused("too few rows", up.upload(&rows[..699]));
        drop(up);
        // The sets dropped in the other order than they were made.
        drop(down);
        for b in m.buffers {
            d.free(b).unwrap();
        }
    });
}

/// A row whose length halves after its first `as_ref`, shareable across the packing threads.
struct LiarRow {
    bytes: Arc<[u8]>,
    asked: std::sync::atomic::AtomicU32,
}

impl LiarRow {
    fn new(bytes: Arc<[u8]>) -> LiarRow {
        LiarRow { bytes, asked: std::sync::atomic::AtomicU32::new(0) }
    }
}

impl AsRef<[u8]> for LiarRow {
    fn as_ref(&self) -> &[u8] {
        match self.asked.fetch_add(1, std::sync::atomic::Ordering::Relaxed) {
            0 => &self.bytes,
            _ => &self.bytes[..self.bytes.len() / 2],
        }
    }
}

/// A refusal must say how to fix it; success is fine too (what matters is the counters).
fn refused_or_ok<T>(r: crate::Result<crate::Result<T>>) {
    if let Err(e) | Ok(Err(e)) = r {
        assert!(e.to_string().contains("Fix:"), "no Fix in {e}");
    }
}

#[test]
fn downloads_streamed_past_the_pinned_cap_leave_every_counter_at_its_baseline() {
    let mut rng = fastrand::Rng::with_seed(39);
    let config = Config { pinned_cap_bytes: 4 << 20, chunk_bytes: 1 << 20, ..small_chunks() };
    returns_to_baseline(config, "streamed downloads", |d| {
        let m = Model::new(d, &mut rng, &[16 << 20, (8 << 20) + 3]);
        assert!(d.download(m.buffers[0]).unwrap() == m.expect[0]);
        assert!(d.download_range(m.buffers[1], 1, (8 << 20) + 2).unwrap() == m.expect[1][1..]);
        let mut out = vec![0u8; 16 << 20];
        d.download_to_slice(m.buffers[0], 0, &mut out).unwrap();
        assert!(out == m.expect[0]);
        assert!(d.download_many(&m.buffers).unwrap() == m.expect);
        for b in m.buffers {
            d.free(b).unwrap();
        }
    });
}

#[test]
fn scoped_transfers_and_a_panicking_parallel_fill_leave_every_counter_at_its_baseline() {
    let mut rng = fastrand::Rng::with_seed(40);
    for (name, config) in [
        ("default", Config::default()),
        ("small chunks", small_chunks()),
        ("odd", Config { chunk_bytes: 96 << 10, direct_threshold: 1, pack_threads: 3, ..small_chunks() }),
        ("no bus", Config { small_copies_over_bus: false, direct_threshold: 64 << 10, ..small_chunks() }),
    ] {
        returns_to_baseline(config, name, |d| {
            let mut m = Model::new(d, &mut rng, &[1 << 20, 70_001]);
            let mut pinned = d.pinned(200_000).unwrap();
            rng.fill(&mut pinned);
            let pageable = random_vec(&mut rng, 200_000);
            let mut back = vec![0u8; 50_000];
            let mut back_pinned = d.pinned(50_000).unwrap();
            d.scope(|s| {
                let mut up = s.uploads();
                up.write(m.buffers[0], 0, &pinned[..100_000])?;
                up.write(m.buffers[0], 100_000, &pageable[..64])?;
                up.write_many((0..64u64).map(|i| (m.buffers[1], i * 1000, &pageable[i as usize..][..500])))?;
                let _ = up.submit()?;
                let mut down = s.downloads();
                down.read_to_slice(m.buffers[0], 500_000, &mut back)?;
                down.read_to_slice(m.buffers[0], 600_000, &mut back_pinned[..])?;
                let _ = down.submit()?;
                Ok(())
            })
            .unwrap();
            m.expect[0][..100_000].copy_from_slice(&pinned[..100_000]);
            m.expect[0][100_000..100_064].copy_from_slice(&pageable[..64]);
            for i in 0..64usize {
                m.expect[1][i * 1000..][..500].copy_from_slice(&pageable[i..][..500]);
            }
            assert!(back == m.expect[0][500_000..550_000]);
            assert!(back_pinned[..] == m.expect[0][600_000..650_000]);
            // A batch whose parallel fill panics is poisoned and moves nothing.
            let mut batch = d.uploads();
            batch.write(m.buffers[1], 0, &[9; 100]).unwrap();
            for k in 0..40u64 {
                batch
                    .write_with_par(m.buffers[0], k * 4096, 4096, move |dst| {
                        assert!(k != 17, "a fill that panics");
                        dst.fill(k as u8);
                    })
                    .unwrap();
            }
            let r = catch_unwind(AssertUnwindSafe(|| batch.submit()));
            assert!(matches!(r, Err(_) | Ok(Err(_))), "a panicking fill fails its batch");
            drop(r);
            // A scope whose closure fails after submitting, and one that panics.
            let failed: crate::Result<()> = d.scope(|s| {
                let mut up = s.uploads();
                up.write(m.buffers[1], 5, &pageable[..7])?;
                let _ = up.submit()?;
                d.download_range(m.buffers[0], u64::MAX, 1).map(drop)
            });
            assert!(failed.is_err());
            m.expect[1][5..12].copy_from_slice(&pageable[..7]);
            let panicked = catch_unwind(AssertUnwindSafe(|| {
                d.scope(|s| -> crate::Result<()> {
                    let mut up = s.uploads();
                    up.write(m.buffers[1], 20, &pageable[..9])?;
                    let _ = up.submit()?;
                    panic!("a scope that panics")
                })
            }));
            assert!(panicked.is_err());
            m.expect[1][20..29].copy_from_slice(&pageable[..9]);
            m.check(d, name);
            drop((pinned, back_pinned));
            for b in m.buffers {
                d.free(b).unwrap();
            }
        });
    }
}

#[test]
fn eight_threads_leave_every_counter_at_its_baseline() {
    let config = Config { pinned_cap_bytes: 8 << 20, ..small_chunks() };
    returns_to_baseline(config, "8 threads", |d| {
        let gpu = model::shared();
        let handles: Vec<_> = (0..8u64)
            .map(|t| {
                let (d, gpu) = (d.clone(), Arc::clone(&gpu));
                std::thread::spawn(move || {
                    model::join(gpu);
                    let mut rng = fastrand::Rng::with_seed(100 + t);
                    for round in 0..12 {
                        let sizes = [rng.usize(1..200_000), rng.usize(1..5_000)];
                        let m = Model::new(&d, &mut rng, &sizes);
                        let mine = d.allocate(rng.u64(4096..3_000_000)).unwrap();
                        let ranges: Vec<(ResidentBuffer, u64, u64)> = (0..50)
                            .map(|_| m.range(&mut rng, 4096))
                            .map(|(i, o, l)| (m.buffers[i], o as u64, l as u64))
                            .collect();
                        let want: Vec<Vec<u8>> = ranges
                            .iter()
                            .map(|&(b, o, l)| {
                                m.expect[usize::from(b == m.buffers[1])][o as usize..][..l as usize].to_vec()
                            })
                            .collect();
                        match round % 3 {
                            0 => assert_eq!(d.download_ranges(&ranges).unwrap(), want),
                            1 => {
                                let mut p = d.prepare_downloads(&ranges).unwrap();
                                let mut out = vec![Vec::new(); ranges.len()];
                                p.download_into(&mut out).unwrap();
                                assert_eq!(out, want);
                            }
                            _ => {
                                let _ = d.download_range(mine, u64::MAX, 1);
                                let mut b = d.uploads();
                                b.write(mine, 0, &[1; 4096]).unwrap();
                                drop(b);
                            }
                        }
                        // Freed while a transfer may still use them: deferred.
                        d.upload(m.buffers[0], &m.expect[0]).unwrap();
                        for b in m.buffers {
                            d.free(b).unwrap();
                        }
                        d.free(mine).unwrap();
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    });
}

/// One step of the random sequences.
#[derive(Clone, Copy, Debug)]
enum Step {
    Allocate(u64),
    Free(usize),
    Upload(usize),
    Download(usize),
    Prepare(usize),
    DropPrepared,
    Bad(usize),
    Trim,
    Synchronize,
}

fn step(rng: &mut fastrand::Rng) -> Step {
    let pick = rng.usize(..64);
    match rng.u8(..16) {
        0..=3 => Step::Allocate(match rng.u8(..4) {
            0 => rng.u64(1..=256),
            1 => rng.u64(1..=64 << 10),
            2 => rng.u64(1..=3 << 20),
            _ => rng.u64(1..=40 << 20),
        }),
        4..=6 => Step::Free(pick),
        7 | 8 => Step::Upload(pick),
        9 | 10 => Step::Download(pick),
        11 => Step::Prepare(pick),
        12 => Step::DropPrepared,
        13 => Step::Bad(pick),
        14 => Step::Trim,
        _ => Step::Synchronize,
    }
}

#[test]
fn random_sequences_keep_every_counter_equal_to_a_model_of_it() {
    for seed in 0..24u64 {
        let mut rng = fastrand::Rng::with_seed(seed);
        let config = match seed % 3 {
            0 => Config::default(),
            1 => small_chunks(),
            _ => Config {
                slab_bytes: 4 << 20,
                pinned_cap_bytes: 2 << 20,
                chunk_bytes: 256 << 10,
                ..small_chunks()
            },
        };
        let d = device(config);
        let base = caller(&d);
        // The model: the caller's live buffers and their lengths.
        let mut live: Vec<(ResidentBuffer, u64)> = Vec::new();
        let mut prepared = Vec::new();
        let mut trace = Vec::new();
        for _ in 0..120 {
            let s = step(&mut rng);
            trace.push(s);
            let at = |k: usize| (!live.is_empty()).then(|| k % live.len());
            match s {
                Step::Allocate(n) => {
                    if let Ok(b) = d.allocate(n) {
                        live.push((b, n));
                    }
                }
                Step::Free(k) => {
                    if let Some(i) = at(k) {
                        d.free(live.swap_remove(i).0).unwrap();
                    }
                }
                Step::Upload(k) => {
                    if let Some(i) = at(k) {
                        let (b, n) = live[i];
                        let len = n.min(rng.u64(1..=300_000));
                        d.upload_at(b, n - len, &random_vec(&mut rng, len as usize)).unwrap();
                    }
                }
                Step::Download(k) => {
                    if let Some(i) = at(k) {
                        let (b, n) = live[i];
                        let len = n.min(rng.u64(1..=300_000));
                        assert_eq!(d.download_range(b, 0, len).unwrap().len() as u64, len);
                    }
                }
                Step::Prepare(k) => {
                    if let Some(i) = at(k) {
                        let (b, n) = live[i];
                        let ranges: Vec<_> = (0..n.min(64)).map(|o| (b, o, 1)).collect();
                        prepared.push(d.prepare_uploads(&ranges).unwrap());
                    }
                }
                Step::DropPrepared => drop(prepared.pop()),
                Step::Bad(k) => {
                    if let Some(i) = at(k) {
                        let (b, n) = live[i];
                        assert!(d.upload_at(b, n, &[1]).is_err());
                        assert!(d.download_range(b, n - 1, u64::MAX).is_err());
                    }
                }
                Step::Trim => drop(d.trim().unwrap()),
                Step::Synchronize => d.synchronize().unwrap(),
            }
            let want = Caller {
                bytes: base.bytes + live.iter().map(|&(_, n)| n).sum::<u64>(),
                buffers: live.len() as u64,
            };
            assert_eq!(caller(&d), want, "seed {seed}, after {trace:?}");
            let m = d.telemetry().memory;
            assert!(m.library_bytes >= d.telemetry().staging_bytes, "seed {seed}, after {trace:?}: {m:?}");
        }
        prepared.clear();
        for (b, _) in live.drain(..) {
            d.free(b).unwrap();
        }
        settled(&d, base, &format!("seed {seed}, at the end of {trace:?}"));
    }
}

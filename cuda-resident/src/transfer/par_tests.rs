//! `UploadBatch::write_with_par` on the model driver: fills run at submit in groups, lease
//! by lease, on the packing threads (on the calling thread alone for a small batch); every
//! byte lands, every fill runs once, and a fill that panics fails `submit` without moving
//! undefined bytes.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::testing::{Model, device, random_vec, small_chunks};
use crate::{Config, Device, Error};

/// Random disjoint ranges of `m`, in order and apart or shuffled, some large.
fn ranges(m: &Model, rng: &mut fastrand::Rng, large: bool) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    for (i, e) in m.expect.iter().enumerate() {
        let mut at = rng.usize(0..64);
        loop {
            let len = if large && rng.u8(..8) == 0 { rng.usize(1..=200_000) } else { rng.usize(1..=5000) };
            if at + len > e.len() {
                break;
            }
            out.push((i, at, len));
            at += len + rng.usize(1..100);
        }
    }
    if rng.bool() {
        rng.shuffle(&mut out);
    }
    out
}

#[test]
fn every_byte_lands_and_every_fill_runs_once() {
    // Leases with fills move over the bus by default, by a DMA and a scatter without it.
    let by_dma = Config::default().with_small_copies_over_bus(false);
    for config in [Config::default(), small_chunks(), by_dma] {
        let d = device(config);
        let mut rng = fastrand::Rng::with_seed(3001);
        let mut m = Model::new(&d, &mut rng, &[3 << 20, 1 << 20, 70_000, 4096]);
        for round in 0..12 {
            let ranges = ranges(&m, &mut rng, round % 2 == 1);
            let data: Vec<Vec<u8>> = ranges.iter().map(|&(_, _, len)| random_vec(&mut rng, len)).collect();
            let calls = AtomicUsize::new(0);
            let mut batch = d.uploads();
            for (k, (&(i, at, _), bytes)) in ranges.iter().zip(&data).enumerate() {
                let b = m.buffers[i];
                // Mostly parallel fills; some rounds mix in the other kinds of write.
                match (round % 3, k % 5) {
                    (1, 0) => batch.write_with(b, at as u64, bytes.len(), |dst| dst.copy_from_slice(bytes)),
                    (2, 0) => batch.write(b, at as u64, bytes),
                    _ => {
                        let calls = &calls;
                        batch.write_with_par(b, at as u64, bytes.len(), move |dst| {
                            calls.fetch_add(1, Ordering::Relaxed);
                            dst.copy_from_slice(bytes);
                        })
                    }
                }
                .unwrap();
                m.expect[i][at..at + bytes.len()].copy_from_slice(bytes);
            }
            let par = match round % 3 {
                0 => ranges.len(),
                _ => ranges.len() - ranges.len().div_ceil(5),
            };
            assert_eq!(calls.load(Ordering::Relaxed), 0, "round {round}: fills wait for submit");
            batch.submit().unwrap().wait().unwrap();
            assert_eq!(calls.load(Ordering::Relaxed), par, "round {round}: each fill once");
            m.check(&d, &format!("round {round}"));
        }
    }
}

#[test]
fn overlapping_and_zero_length_fills_land_in_order_and_a_dropped_batch_calls_none() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(3002);
    let mut m = Model::new(&d, &mut rng, &[300_000]);
    // Overlapping writes (the planner's route): the later one wins.
    let a = random_vec(&mut rng, 10_000);
    let b = random_vec(&mut rng, 10_000);
    let mut batch = d.uploads();
    batch.write_with_par(m.buffers[0], 1000, a.len(), |dst| dst.copy_from_slice(&a)).unwrap();
    batch.write_with_par(m.buffers[0], 6000, 0, |dst| assert!(dst.is_empty())).unwrap();
    batch.write_with_par(m.buffers[0], 5000, b.len(), |dst| dst.copy_from_slice(&b)).unwrap();
    batch.submit().unwrap().wait().unwrap();
    m.expect[0][1000..11_000].copy_from_slice(&a);
    m.expect[0][5000..15_000].copy_from_slice(&b);
    m.check(&d, "after overlapping fills");
    // Only zero-length fills: each still runs once.
    let calls = AtomicUsize::new(0);
    let mut batch = d.uploads();
    for k in 0..3 {
        let calls = &calls;
        batch
            .write_with_par(m.buffers[0], k, 0, move |_| {
                calls.fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
    }
    batch.submit().unwrap().wait().unwrap();
    assert_eq!(calls.load(Ordering::Relaxed), 3);
    // A batch dropped unsubmitted calls no fill and gives its staging back.
    let mut batch = d.uploads();
    for k in 0..100u64 {
        batch.write_with_par(m.buffers[0], k * 100, 50, |_| panic!("never called")).unwrap();
    }
    drop(batch);
    assert_eq!(d.telemetry().pinned.lent_bytes, 0);
    m.check(&d, "after the dropped batch");
}

#[test]
fn a_fill_larger_than_a_chunk_lands_whole() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(3003);
    let mut m = Model::new(&d, &mut rng, &[1 << 20, 4096]);
    let big = random_vec(&mut rng, 700_000);
    let small = random_vec(&mut rng, 100);
    let mut batch = d.uploads();
    batch.write_with_par(m.buffers[1], 16, small.len(), |dst| dst.copy_from_slice(&small)).unwrap();
    batch.write_with_par(m.buffers[0], 3, big.len(), |dst| dst.copy_from_slice(&big)).unwrap();
    batch.write_with_par(m.buffers[1], 1000, small.len(), |dst| dst.copy_from_slice(&small)).unwrap();
    batch.submit().unwrap().wait().unwrap();
    m.expect[0][3..700_003].copy_from_slice(&big);
    m.expect[1][16..116].copy_from_slice(&small);
    m.expect[1][1000..1100].copy_from_slice(&small);
    m.check(&d, "after the large fill");
}

/// A fill that panics: `submit` fails naming its write; each write's destination holds its
/// old bytes or its new ones, whole, and the panicking write's its old ones; the device
/// and the packing threads go on working.
#[test]
fn a_fill_that_panics_fails_submit_naming_it_and_moves_no_undefined_byte() {
    let by_dma = Config::default().with_small_copies_over_bus(false);
    let threads = Config::default().with_pack_threads(4);
    for (config, count) in [
        (Config::default(), 8192usize),
        (by_dma, 8192),
        (threads, 8192),
        (small_chunks(), 600),
        (small_chunks(), 5),
    ] {
        let over_bus = config.small_copies_over_bus;
        let d = device(config);
        let mut rng = fastrand::Rng::with_seed(3004);
        let mut m = Model::new(&d, &mut rng, &[9 << 20]);
        for bad in [0, count / 2, count - 1] {
            let size = 1000;
            let data: Vec<Vec<u8>> = (0..count).map(|_| random_vec(&mut rng, size)).collect();
            let before = m.expect[0].clone();
            let mut batch = d.uploads();
            for (k, bytes) in data.iter().enumerate() {
                let at = k * (size + 24);
                batch
                    .write_with_par(m.buffers[0], at as u64, size, move |dst| {
                        // Half written, then the panic: the staging holds bytes of no write.
                        dst[..size / 2].copy_from_slice(&bytes[..size / 2]);
                        assert!(k != bad, "fill {k} fails");
                        dst.copy_from_slice(bytes);
                    })
                    .unwrap();
            }
            let e = batch.submit().unwrap_err();
            let Error::FillPanicked { write, offset, len, cause, .. } = &e else { panic!("{e}") };
            assert_eq!((*write, *offset, *len), (bad, (bad * (size + 24)) as u64, size as u64), "{e}");
            assert!(cause.contains(&format!("fill {bad} fails")), "{e}");
            assert!(e.to_string().contains("Fix: "), "{e}");
            d.synchronize().unwrap();
            let got = d.download(m.buffers[0]).unwrap();
            let mut landed = 0;
            for (k, bytes) in data.iter().enumerate() {
                let at = k * (size + 24);
                let now = &got[at..at + size];
                if now == &bytes[..] {
                    landed += 1;
                    assert!(k < bad, "write {k}, after the panicking {bad}, did not move");
                } else {
                    assert_eq!(now, &before[at..at + size], "write {k}: old bytes or new, whole");
                }
            }
            assert!(landed <= bad);
            if count == 8192 && bad == count - 1 && over_bus {
                // Leases over the bus hold 256 KiB, then twice as much each, up to 4 MiB:
                // those before the last, over 7000 of these writes, move before the last
                // lease's panic is known.
                assert!(landed >= 4000, "the first lease moved: {landed} writes landed");
            }
            // Between the writes nothing changed.
            for k in 0..count {
                let gap = k * (size + 24) + size..(k + 1) * (size + 24);
                assert_eq!(got[gap.clone()], before[gap], "gap after write {k}");
            }
            the_device_goes_on(&d, &mut m, &mut rng, got);
        }
    }
}

/// After a batch whose fill panicked, buffer 0 of `m` holding `got`: the staging is back,
/// and the next batch lands.
fn the_device_goes_on(d: &Device, m: &mut Model, rng: &mut fastrand::Rng, got: Vec<u8>) {
    m.expect[0] = got;
    assert_eq!(d.telemetry().pinned.lent_bytes, 0, "staging back");
    let bytes = random_vec(rng, 5000);
    let mut batch = d.uploads();
    batch.write_with_par(m.buffers[0], 17, bytes.len(), |dst| dst.copy_from_slice(&bytes)).unwrap();
    batch.submit().unwrap().wait().unwrap();
    m.expect[0][17..5017].copy_from_slice(&bytes);
    m.check(d, "after a panicked fill");
}

/// Threads submitting parallel fills at once, each on a device of its own (the model
/// driver is one per thread; many threads on one device: the GPU test
/// `gpu_transfer::parallel_fills_from_many_threads_land_every_byte`), sharing the process's
/// pinned memory bookkeeping.
#[test]
fn many_threads_submit_parallel_fills_at_once() {
    std::thread::scope(|s| {
        for t in 0..6u64 {
            s.spawn(move || {
                let d = device(Config::default());
                let mut rng = fastrand::Rng::with_seed(3005 + t);
                let mut m = Model::new(&d, &mut rng, &[2 << 20]);
                for round in 0..4 {
                    let rows: Vec<Vec<u8>> = (0..512).map(|_| random_vec(&mut rng, 4000)).collect();
                    let mut batch = d.uploads();
                    for (k, row) in rows.iter().enumerate() {
                        let at = k * 4096 + round;
                        batch
                            .write_with_par(m.buffers[0], at as u64, row.len(), |dst| {
                                dst.copy_from_slice(row)
                            })
                            .unwrap();
                        m.expect[0][at..at + row.len()].copy_from_slice(row);
                    }
                    batch.submit().unwrap().wait().unwrap();
                }
                m.check(&d, &format!("thread {t}"));
            });
        }
    });
}

/// The parallel runs this thread made so far.
fn parallel_runs() -> usize {
    crate::engine::pipeline::PARALLEL_RUNS.with(|n| n.get())
}

/// Four packing threads, whatever the host (this one may have two cores: the default would
/// be one thread, and every fill would run on the calling thread).
fn four_threads() -> Config {
    Config::default().with_pack_threads(4)
}

#[test]
fn a_small_batch_fills_on_the_calling_thread_and_a_large_one_in_one_parallel_run() {
    for config in [four_threads(), four_threads().with_small_copies_over_bus(false)] {
        let d = device(config);
        let mut rng = fastrand::Rng::with_seed(3006);
        let mut m = Model::new(&d, &mut rng, &[4 << 20]);
        let me = std::thread::current().id();
        // 2000 fills of 16 bytes: far less work than waking the threads costs.
        let (elsewhere, calls) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let data = random_vec(&mut rng, 2000 * 16);
        let before = parallel_runs();
        let mut batch = d.uploads();
        for (k, bytes) in data.chunks(16).enumerate() {
            let (elsewhere, calls) = (&elsewhere, &calls);
            batch
                .write_with_par(m.buffers[0], k as u64 * 32, 16, move |dst| {
                    if std::thread::current().id() != me {
                        elsewhere.fetch_add(1, Ordering::Relaxed);
                    }
                    calls.fetch_add(1, Ordering::Relaxed);
                    dst.copy_from_slice(bytes);
                })
                .unwrap();
            m.expect[0][k * 32..k * 32 + 16].copy_from_slice(bytes);
        }
        batch.submit().unwrap().wait().unwrap();
        assert_eq!(parallel_runs(), before, "a small batch wakes no thread");
        assert_eq!((calls.load(Ordering::Relaxed), elsewhere.load(Ordering::Relaxed)), (2000, 0));
        m.check(&d, "after the small batch");
        // 60 000 fills of 8 bytes: little data but many calls, spread over several leases
        // (over the bus) and the threads, in one parallel run for the whole batch, not one
        // a lease or a fill.
        let data = random_vec(&mut rng, 60_000 * 8);
        calls.store(0, Ordering::Relaxed);
        let before = parallel_runs();
        let mut batch = d.uploads();
        for (k, bytes) in data.chunks(8).enumerate() {
            let calls = &calls;
            batch
                .write_with_par(m.buffers[0], k as u64 * 40 + 3, 8, move |dst| {
                    calls.fetch_add(1, Ordering::Relaxed);
                    dst.copy_from_slice(bytes);
                })
                .unwrap();
            m.expect[0][k * 40 + 3..k * 40 + 11].copy_from_slice(bytes);
        }
        batch.submit().unwrap().wait().unwrap();
        assert_eq!(parallel_runs(), before + 1, "one parallel run");
        assert_eq!(calls.load(Ordering::Relaxed), 60_000, "each fill once");
        m.check(&d, "after the batch of many tiny fills");
        assert_eq!(d.telemetry().pinned.lent_bytes, 0, "staging back");
    }
}

#[test]
fn fills_of_varied_sizes_land_byte_exact_on_the_packing_threads() {
    let small = Config { pinned_cap_bytes: 64 << 20, ..small_chunks() }.with_pack_threads(4);
    for config in [four_threads(), four_threads().with_small_copies_over_bus(false), small] {
        let d = device(config);
        let mut rng = fastrand::Rng::with_seed(3007);
        let mut m = Model::new(&d, &mut rng, &[9 << 20, 3 << 20, 100_000]);
        for round in 0..6 {
            // From one byte to hundreds of KiB (some past the direct threshold: a lease of
            // their own), in order or shuffled, all made at submit.
            let mut ranges = ranges(&m, &mut rng, round % 2 == 0);
            if round % 3 == 2 {
                rng.shuffle(&mut ranges);
            }
            let data: Vec<Vec<u8>> = ranges.iter().map(|&(_, _, len)| random_vec(&mut rng, len)).collect();
            let calls = AtomicUsize::new(0);
            let mut batch = d.uploads();
            for (&(i, at, _), bytes) in ranges.iter().zip(&data) {
                let calls = &calls;
                batch
                    .write_with_par(m.buffers[i], at as u64, bytes.len(), move |dst| {
                        calls.fetch_add(1, Ordering::Relaxed);
                        dst.copy_from_slice(bytes);
                    })
                    .unwrap();
                m.expect[i][at..at + bytes.len()].copy_from_slice(bytes);
            }
            batch.submit().unwrap().wait().unwrap();
            assert_eq!(calls.load(Ordering::Relaxed), ranges.len(), "round {round}: each fill once");
            m.check(&d, &format!("round {round}"));
        }
        assert_eq!(d.telemetry().pinned.lent_bytes, 0, "staging back");
    }
}

/// A panic in a group in the middle of a batch filled on the packing threads (a second one
/// later): `submit` names the first, nothing from its lease on moves, earlier leases land
/// whole or not at all, and the device goes on.
#[test]
fn a_panic_in_a_middle_group_fails_submit_and_moves_nothing_from_its_lease_on() {
    for config in [four_threads(), four_threads().with_small_copies_over_bus(false)] {
        let d = device(config);
        let mut rng = fastrand::Rng::with_seed(3008);
        let mut m = Model::new(&d, &mut rng, &[12 << 20]);
        let (count, size, stride) = (20_000, 300, 600);
        let (bad, later) = (count / 2 + 7, count - 100);
        let data: Vec<Vec<u8>> = (0..count).map(|_| random_vec(&mut rng, size)).collect();
        let before = m.expect[0].clone();
        let calls = AtomicUsize::new(0);
        let mut batch = d.uploads();
        for (k, bytes) in data.iter().enumerate() {
            let calls = &calls;
            batch
                .write_with_par(m.buffers[0], (k * stride) as u64, size, move |dst| {
                    calls.fetch_add(1, Ordering::Relaxed);
                    dst[..size / 2].copy_from_slice(&bytes[..size / 2]);
                    assert!(k != bad && k != later, "fill {k} fails");
                    dst.copy_from_slice(bytes);
                })
                .unwrap();
        }
        let runs = parallel_runs();
        let e = batch.submit().unwrap_err();
        assert_eq!(parallel_runs(), runs + 1, "filled on the packing threads");
        let Error::FillPanicked { write, offset, len, cause, .. } = &e else { panic!("{e}") };
        assert_eq!((*write, *offset, *len), (bad, (bad * stride) as u64, size as u64), "{e}");
        assert!(cause.contains(&format!("fill {bad} fails")), "{e}");
        assert!(calls.load(Ordering::Relaxed) <= count, "no fill twice");
        d.synchronize().unwrap();
        let got = d.download(m.buffers[0]).unwrap();
        for (k, bytes) in data.iter().enumerate() {
            let at = k * stride;
            let now = &got[at..at + size];
            if now == &bytes[..] {
                assert!(k < bad, "write {k}, after the panicking {bad}, did not move");
            } else {
                assert_eq!(now, &before[at..at + size], "write {k}: old bytes or new, whole");
            }
            let gap = at + size..at + stride;
            assert_eq!(got[gap.clone()], before[gap], "gap after write {k}");
        }
        the_device_goes_on(&d, &mut m, &mut rng, got);
    }
}

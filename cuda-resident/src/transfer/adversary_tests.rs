//! Adversarial tests of the readback side and of concurrency, on the model driver: every
//! readback API at the edges of sizes and pools, bad input, drops in every order, and
//! threads sharing one device (their model GPU shared: `model::shared`, `model::join`),
//! where a transfer that finds the pinned pool held by another thread's transfer waits for
//! it rather than failing.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use crate::testing::{Model, device, model, random_vec, small_chunks};
use crate::{Config, Device, Error, ResidentBuffer, Slot};

type R = (usize, u64, u64);

/// The error of `r`, which must carry a "Fix:".
fn fix<T: std::fmt::Debug>(what: &str, r: crate::Result<T>) -> Error {
    let e = r.expect_err(what);
    assert!(e.to_string().contains("Fix:"), "{what}: error without a Fix: {e}");
    e
}

fn lent_zero(d: &Device, what: &str) {
    d.synchronize().unwrap();
    let t = d.telemetry().pinned;
    assert_eq!((t.lent_bytes, t.held_bytes), (0, 0), "{what}: pinned still lent: {t:?}");
}

fn no_model_errors(what: &str) {
    let errors = model::with(|g| g.errors.clone());
    assert!(errors.is_empty(), "{what}: model found {errors:?}");
}

fn want(m: &Model, ranges: &[R]) -> Vec<Vec<u8>> {
    ranges.iter().map(|&(i, o, l)| m.expect[i][o as usize..][..l as usize].to_vec()).collect()
}

fn abs(m: &Model, ranges: &[R]) -> Vec<(ResidentBuffer, u64, u64)> {
    ranges.iter().map(|&(i, o, l)| (m.buffers[i], o, l)).collect()
}

/// Vectors with junk in them (and capacity), to see that results replace contents.
fn dirty(rng: &mut fastrand::Rng, n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|_| {
            let k = rng.usize(0..40);
            random_vec(rng, k)
        })
        .collect()
}

fn same(what: &str, got: &[u8], want: &[u8]) {
    assert!(
        got == want,
        "{what}: {} bytes, want {}, first difference at {:?}",
        got.len(),
        want.len(),
        got.iter().zip(want).position(|(a, b)| a != b)
    );
}

/// Reads `ranges` through every readback API and checks every byte.
fn every_api(d: &Device, m: &Model, ranges: &[R], rng: &mut fastrand::Rng, what: &str) {
    d.synchronize().unwrap();
    let base = d.telemetry().pinned;
    let want = want(m, ranges);
    let abs = abs(m, ranges);
    let n = ranges.len();
    // read + submit + wait + get (and copy_all_into).
    let mut b = d.downloads();
    let slots: Vec<Slot> = abs.iter().map(|&(x, o, l)| b.read(x, o, l).unwrap()).collect();
    let route = b.route();
    let pending = b.submit().unwrap();
    let done = pending.wait().unwrap();
    for (i, &s) in slots.iter().enumerate() {
        same(&format!("{what} ({route:?}): get {i}"), done.get(s), &want[i]);
    }
    let mut out = dirty(rng, n);
    done.copy_all_into(&slots, &mut out).unwrap();
    for i in 0..n {
        same(&format!("{what}: copy_all_into {i}"), &out[i], &want[i]);
    }
    drop(done);
    // submit_into.
    let mut b = d.downloads();
    for &(x, o, l) in &abs {
        b.read(x, o, l).unwrap();
    }
    let mut out = dirty(rng, n);
    b.submit_into(&mut out).unwrap();
    for i in 0..n {
        same(&format!("{what}: submit_into {i}"), &out[i], &want[i]);
    }
    // wait_into, slots shuffled, one twice, one left out.
    let mut b = d.downloads();
    let slots = b.read_many(abs.iter().copied()).unwrap();
    let mut perm: Vec<usize> = (0..n).collect();
    rng.shuffle(&mut perm);
    if n > 1 {
        perm.pop();
        perm.push(perm[0]);
    }
    let pslots: Vec<Slot> = perm.iter().map(|&i| slots[i]).collect();
    let mut out = dirty(rng, perm.len());
    let done = b.submit().unwrap().wait_into(&pslots, &mut out).unwrap();
    for (k, &i) in perm.iter().enumerate() {
        same(&format!("{what}: wait_into position {k} (read {i})"), &out[k], &want[i]);
    }
    for (i, &s) in slots.iter().enumerate() {
        same(&format!("{what}: get after wait_into {i}"), done.get(s), &want[i]);
    }
    drop(done);
    // wait_into, slots in order.
    let mut b = d.downloads();
    let slots = b.read_many(abs.iter().copied()).unwrap();
    let mut out = dirty(rng, n);
    drop(b.submit().unwrap().wait_into(&slots, &mut out).unwrap());
    for i in 0..n {
        same(&format!("{what}: wait_into in order {i}"), &out[i], &want[i]);
    }
    // Conveniences.
    let got = d.download_ranges(&abs).unwrap();
    for i in 0..n {
        same(&format!("{what}: download_ranges {i}"), &got[i], &want[i]);
    }
    let mut out = dirty(rng, n);
    d.download_into(&abs, &mut out).unwrap();
    for i in 0..n {
        same(&format!("{what}: download_into {i}"), &out[i], &want[i]);
    }
    for (i, &(x, o, l)) in abs.iter().enumerate().take(4) {
        same(&format!("{what}: download_range {i}"), &d.download_range(x, o, l).unwrap(), &want[i]);
    }
    // Prepared: two downloads alive at once, then download_into.
    let mut set = d.prepare_downloads(&abs).unwrap();
    let a = set.submit().unwrap().wait().unwrap();
    let b2 = set.submit().unwrap().wait().unwrap();
    for (i, want) in want.iter().enumerate() {
        same(&format!("{what}: prepared first {i}"), a.get(set.slot(i)), want);
        same(&format!("{what}: prepared second {i}"), b2.get(set.slot(i)), want);
    }
    drop(a);
    let mut out = dirty(rng, n);
    set.download_into(&mut out).unwrap();
    for i in 0..n {
        same(&format!("{what}: prepared download_into {i}"), &out[i], &want[i]);
    }
    drop(b2);
    drop(set);
    // Scoped reads into vectors.
    let mut out: Vec<Vec<u8>> = ranges.iter().map(|&(_, _, l)| vec![0xEEu8; l as usize]).collect();
    d.scope(|s| {
        let mut r = s.downloads();
        for (dst, &(x, o, _)) in out.iter_mut().zip(&abs) {
            r.read_to_slice(x, o, dst)?;
        }
        r.submit().map(drop)
    })
    .unwrap();
    for i in 0..n {
        same(&format!("{what}: scope read_to_slice {i}"), &out[i], &want[i]);
    }
    d.synchronize().unwrap();
    let after = d.telemetry().pinned;
    assert_eq!(
        (after.lent_bytes, after.held_bytes),
        (base.lent_bytes, base.held_bytes),
        "{what}: pinned still lent: {after:?}"
    );
    no_model_errors(what);
}

fn tiny() -> Config {
    Config {
        chunk_bytes: 64 << 10,
        direct_threshold: 4 << 10,
        pinned_cap_bytes: 512 << 10,
        pinned_prewarm_bytes: 0,
        pack_threads: 3,
        ..Config::default()
    }
}

/// The smallest pool: two chunks, and a held limit of nothing (every download streams).
fn minimal() -> Config {
    Config {
        chunk_bytes: 64 << 10,
        direct_threshold: 64 << 10,
        pinned_cap_bytes: 128 << 10,
        pinned_prewarm_bytes: 0,
        pack_threads: 2,
        ..Config::default()
    }
}

fn edge_lens(c: &Config) -> Vec<u64> {
    let mut v = vec![0u64, 1, 2, 15, 16, 17, 255, 256, 257];
    let held = c.pinned_cap_bytes - c.pinned_reserve();
    for x in
        [c.direct_threshold, c.chunk_bytes / 2, c.chunk_bytes, 2 * c.chunk_bytes, held, c.pinned_cap_bytes]
    {
        for dx in [-1i64, 0, 1] {
            v.push((x as i64 + dx).max(0) as u64);
        }
    }
    v.sort_unstable();
    v.dedup();
    v
}

#[test]
fn edge_sizes_every_api() {
    for (name, config) in [
        ("small", small_chunks()),
        ("tiny", tiny()),
        ("minimal", minimal()),
        ("tiny-dma", tiny().with_small_copies_over_bus(false)),
    ] {
        let d = device(config.clone());
        let mut rng = fastrand::Rng::with_seed(7);
        let big = (2 * config.pinned_cap_bytes + 4099) as usize;
        let m = Model::new(&d, &mut rng, &[big, 4096, 1]);
        for len in edge_lens(&config) {
            for off in [0u64, 1, 7, big as u64 - len] {
                if off + len > big as u64 {
                    continue;
                }
                let what = format!("{name}: len {len} at {off}");
                // One read, the same read twice, overlapping and touching reads, a zero-length read at the end.
                let h = len / 2;
                let ranges = vec![
                    (0, off, len),
                    (0, off, len),
                    (0, off + h, len - h),
                    (1, 4096, 0),
                    (2, 0, 1),
                    (0, off + len, 0),
                    (0, off, h),
                ];
                every_api(&d, &m, &ranges[..1], &mut rng, &format!("{what} alone"));
                every_api(&d, &m, &ranges, &mut rng, &what);
            }
        }
        m.check(&d, name);
    }
}

#[test]
fn random_overlapping_batches() {
    for (name, config) in [("small", small_chunks()), ("tiny", tiny()), ("minimal", minimal())] {
        let d = device(config);
        let mut rng = fastrand::Rng::with_seed(11);
        let m = Model::new(&d, &mut rng, &[600_000, 70_001, 4096, 17]);
        for round in 0..40 {
            let n = rng.usize(1..if round % 4 == 0 { 300 } else { 40 });
            let mut ranges: Vec<R> = Vec::new();
            for _ in 0..n {
                let (i, at, len) = m.range(&mut rng, 20_000);
                ranges.push((i, at as u64, len as u64));
                if rng.u8(..5) == 0 {
                    ranges.push(*ranges.last().unwrap());
                }
                if rng.u8(..7) == 0 {
                    ranges.push((i, at as u64, 0));
                }
            }
            every_api(&d, &m, &ranges, &mut rng, &format!("{name} round {round}"));
        }
    }
}

#[test]
fn in_order_batches_and_out_of_order_slots() {
    for (name, config) in [
        ("small", small_chunks()),
        ("tiny", tiny()),
        ("minimal", minimal()),
        ("default", Config::default()),
        ("tiny-dma", tiny().with_small_copies_over_bus(false)),
    ] {
        let d = device(config);
        let mut rng = fastrand::Rng::with_seed(12);
        let m = Model::new(&d, &mut rng, &[3 << 20, 1 << 20, 70_000]);
        for round in 0..10 {
            let ranges: Vec<R> = m
                .in_order_ranges(&mut rng, 3000)
                .into_iter()
                .map(|(i, o, l)| (i, o as u64, l as u64))
                .collect();
            let (b, _) =
                m.reads(&d, &ranges.iter().map(|&(i, o, l)| (i, o as usize, l as usize)).collect::<Vec<_>>());
            let route = b.route();
            drop(b);
            every_api(&d, &m, &ranges, &mut rng, &format!("{name} in order round {round} ({route:?})"));
            // wait_into with slots reversed and a subset.
            let mut b = d.downloads();
            let slots = b.read_many(abs(&m, &ranges)).unwrap();
            let w = want(&m, &ranges);
            let rev: Vec<Slot> = slots.iter().rev().copied().collect();
            let mut out = dirty(&mut rng, rev.len());
            drop(b.submit().unwrap().wait_into(&rev, &mut out).unwrap());
            for (k, o) in out.iter().enumerate() {
                same(&format!("{name}: reversed {k}"), o, &w[w.len() - 1 - k]);
            }
            let mut b = d.downloads();
            let slots = b.read_many(abs(&m, &ranges)).unwrap();
            let sub: Vec<Slot> = slots.iter().step_by(3).copied().collect();
            let mut out = dirty(&mut rng, sub.len());
            drop(b.submit().unwrap().wait_into(&sub, &mut out).unwrap());
            for (k, o) in out.iter().enumerate() {
                same(&format!("{name}: every third {k}"), o, &w[3 * k]);
            }
            // Many slots (more than reads): every slot 3 times.
            let mut b = d.downloads();
            let slots = b.read_many(abs(&m, &ranges)).unwrap();
            let many: Vec<Slot> = slots.iter().flat_map(|&s| [s, s, s]).collect();
            let mut out = dirty(&mut rng, many.len());
            drop(b.submit().unwrap().wait_into(&many, &mut out).unwrap());
            for (k, o) in out.iter().enumerate() {
                same(&format!("{name}: thrice {k}"), o, &w[k / 3]);
            }
            lent_zero(&d, name);
        }
    }
}

#[test]
fn wait_into_wrong_lengths_and_foreign_slots() {
    for config in [small_chunks(), minimal()] {
        let d = device(config);
        let mut rng = fastrand::Rng::with_seed(13);
        let m = Model::new(&d, &mut rng, &[300_000, 4096]);
        for (ns, no) in [(2usize, 3usize), (3, 2), (0, 1), (1, 0)] {
            let mut b = d.downloads();
            let s0 = b.read(m.buffers[0], 0, 100_000).unwrap();
            let s1 = b.read(m.buffers[1], 10, 100).unwrap();
            let slots: Vec<Slot> = [s0, s1, s0].into_iter().take(ns).collect();
            let mut out = dirty(&mut rng, no);
            let e = fix("wait_into wrong lengths", b.submit().unwrap().wait_into(&slots, &mut out));
            assert!(matches!(e, Error::LengthMismatch { .. }), "{e}");
            lent_zero(&d, "after a wait_into of wrong lengths");
        }
        // A slot of another batch.
        let mut other = d.downloads();
        let foreign = other.read(m.buffers[1], 0, 10).unwrap();
        drop(other);
        let mut b = d.downloads();
        let s0 = b.read(m.buffers[0], 0, 100_000).unwrap();
        let mut out = dirty(&mut rng, 2);
        let e = fix("foreign slot", b.submit().unwrap().wait_into(&[s0, foreign], &mut out));
        assert!(matches!(e, Error::ForeignSlot { .. }), "{e}");
        // submit_into of the wrong length.
        let mut b = d.downloads();
        b.read(m.buffers[0], 0, 10).unwrap();
        let mut out = dirty(&mut rng, 2);
        fix("submit_into wrong length", b.submit_into(&mut out));
        let mut out = dirty(&mut rng, 3);
        fix("download_into wrong length", d.download_into(&[(m.buffers[0], 0, 1)], &mut out));
        let mut set = d.prepare_downloads(&[(m.buffers[0], 0, 1)]).unwrap();
        fix("prepared download_into wrong length", set.download_into(&mut out));
        drop(set);
        lent_zero(&d, "after the refusals");
        m.check(&d, "after the refusals");
    }
}

#[test]
fn panicking_iterators() {
    for config in [small_chunks(), minimal()] {
        let d = device(config);
        let mut rng = fastrand::Rng::with_seed(14);
        let m = Model::new(&d, &mut rng, &[300_000, 4096]);
        let b0 = m.buffers[0];
        for at in [0usize, 1, 70] {
            let mut b = d.downloads();
            b.read(b0, 0, 10).unwrap();
            let r = catch_unwind(AssertUnwindSafe(|| {
                b.read_many((0..100u64).map(|k| {
                    if k as usize == at {
                        panic!("iterator panics at {at}");
                    }
                    (b0, k * 100, 50)
                }))
            }));
            assert!(r.is_err());
            let e = fix("submit after a panicking iterator", b.submit());
            assert!(matches!(e, Error::ItemsPanicked { .. }), "{e}");
            let mut b = d.downloads();
            let _ = catch_unwind(AssertUnwindSafe(|| {
                b.read_many((0..100u64).map(|k| {
                    if k as usize == at {
                        panic!("iterator panics at {at}");
                    }
                    (b0, k * 100, 50)
                }))
            }));
            let mut out = dirty(&mut rng, b.len());
            fix("submit_into after a panicking iterator", b.submit_into(&mut out));
            // Scoped.
            let mut dst = vec![0u8; 100 * 50];
            let r = catch_unwind(AssertUnwindSafe(|| {
                d.scope(|s| {
                    let mut r = s.downloads();
                    let items = dst.chunks_mut(50).enumerate().map(move |(k, c)| {
                        if k == at {
                            panic!("scoped iterator panics at {at}");
                        }
                        (b0, k as u64 * 100, c)
                    });
                    let rr = &mut r;
                    let _ = catch_unwind(AssertUnwindSafe(move || rr.read_to_slice_many(items).map(drop)));
                    r.submit()
                })
            }));
            match r {
                Ok(res) => {
                    fix("scoped submit after a panicking iterator", res);
                }
                Err(_) => panic!("scope re-raised a panic that was caught inside it"),
            }
            lent_zero(&d, "after panicking iterators");
        }
        m.check(&d, "after panicking iterators");
    }
}

/// Submits reads of `ranges`, then frees the model's buffers and allocates new ones of the
/// same sizes (perhaps at the same addresses), written with `junk`: the slots, the pending
/// download and the new buffers.
fn submit_then_free(
    d: &Device,
    m: &Model,
    ranges: &[R],
    junk: u8,
) -> (Vec<Slot>, crate::PendingDownload, Vec<ResidentBuffer>) {
    let mut b = d.downloads();
    let slots = b.read_many(abs(m, ranges)).unwrap();
    let pending = b.submit().unwrap();
    for &x in &m.buffers {
        d.free(x).unwrap();
    }
    let sizes: Vec<usize> = m.expect.iter().map(Vec::len).collect();
    let fresh: Vec<ResidentBuffer> = sizes.iter().map(|&n| d.allocate(n as u64).unwrap()).collect();
    for (&x, &n) in fresh.iter().zip(&sizes) {
        d.upload(x, &vec![junk; n]).unwrap();
    }
    (slots, pending, fresh)
}

#[test]
fn free_between_submit_and_wait() {
    for (name, config) in [("small", small_chunks()), ("minimal", minimal()), ("tiny", tiny())] {
        let d = device(config);
        let mut rng = fastrand::Rng::with_seed(15);
        for kind in 0..4 {
            let sizes = [300_000usize, 70_000, 4096];
            let m = Model::new(&d, &mut rng, &sizes);
            let ranges: Vec<R> = match kind {
                0 => vec![(0, 0, 300_000)],
                1 => (0..200).map(|k| (1, k * 300, 200)).collect(), // in order
                2 => vec![(0, 5, 1000), (1, 3, 60_000), (2, 0, 4096), (0, 5, 1000)],
                _ => vec![(2, 1, 1)],
            };
            let w = want(&m, &ranges);
            let (slots, pending, junk) = submit_then_free(&d, &m, &ranges, 0xA5);
            let done = pending.wait().unwrap();
            for (i, &s) in slots.iter().enumerate() {
                same(&format!("{name} kind {kind}: read {i} after free"), done.get(s), &w[i]);
            }
            drop(done);
            // Free between submit and wait_into.
            let m = Model::new(&d, &mut rng, &sizes);
            let w = want(&m, &ranges);
            let (slots, pending, junk2) = submit_then_free(&d, &m, &ranges, 0x5A);
            let mut out = dirty(&mut rng, slots.len());
            drop(pending.wait_into(&slots, &mut out).unwrap());
            for i in 0..slots.len() {
                same(&format!("{name} kind {kind}: wait_into {i} after free"), &out[i], &w[i]);
            }
            for x in junk.into_iter().chain(junk2) {
                d.free(x).unwrap();
            }
            lent_zero(&d, name);
            no_model_errors(name);
        }
        // Prepared set whose buffer is freed: an error with a Fix.
        let m = Model::new(&d, &mut rng, &[4096]);
        let ranges: Vec<_> = (0..64).map(|k| (m.buffers[0], k * 60, 10)).collect();
        let mut set = d.prepare_downloads(&ranges).unwrap();
        d.free(m.buffers[0]).unwrap();
        fix("prepared after free", set.submit().map(drop));
        let mut out = vec![Vec::new(); 64];
        fix("prepared into after free", set.download_into(&mut out));
        drop(set);
        lent_zero(&d, "prepared after free");
    }
}

#[test]
fn drop_orders_and_views_after_device_and_trim() {
    for (name, config) in [("small", small_chunks()), ("minimal", minimal())] {
        for order in 0..6 {
            let driver = model::driver();
            driver.faults().record();
            let d = Device::open_with(driver.clone(), 0, config.clone()).unwrap();
            let mut rng = fastrand::Rng::with_seed(16 + order);
            let m = Model::new(&d, &mut rng, &[300_000, 4096]);
            let ranges: Vec<R> =
                (0..100).map(|k| (0, k * 2000 + 1, 1000)).chain([(0, 0, 300_000), (1, 0, 4096)]).collect();
            let w = want(&m, &ranges);
            let mut b = d.downloads();
            let slots = b.read_many(abs(&m, &ranges)).unwrap();
            let mut b2 = d.downloads();
            let slots2 = b2.read_many(abs(&m, &ranges[..100])).unwrap();
            let p2 = b2.submit().unwrap();
            let mut set = d.prepare_downloads(&abs(&m, &ranges[..100])).unwrap();
            let pslots: Vec<Slot> = set.slots().to_vec();
            let p3 = set.submit().unwrap();
            let check = |done: &crate::Downloaded, slots: &[Slot], what: &str| {
                for (i, &s) in slots.iter().enumerate() {
                    same(&format!("{name} order {order}: {what} {i}"), done.get(s), &w[i]);
                }
            };
            match order {
                0 => {
                    let p = b.submit().unwrap();
                    drop(d);
                    let done = p.wait().unwrap();
                    check(&done, &slots, "view after the device dropped before wait");
                    drop(p2);
                    drop(set);
                    check(&p3.wait().unwrap(), &pslots, "prepared after device drop");
                }
                1 => {
                    let done = b.submit().unwrap().wait().unwrap();
                    d.trim().unwrap();
                    drop(d);
                    check(&done, &slots, "view after trim and device drop");
                    drop(done);
                    drop(p3);
                    check(&p2.wait().unwrap(), &slots2, "second after all");
                    drop(set);
                }
                2 => {
                    drop(b);
                    drop(p2);
                    drop(p3);
                    d.trim().unwrap();
                    drop(set);
                    drop(d);
                }
                3 => {
                    let p = b.submit().unwrap();
                    drop(set);
                    let done3 = p3.wait().unwrap();
                    drop(d);
                    drop(p);
                    for i in 0..100 {
                        same("prepared view after its set and device", done3.get(pslots[i]), &w[i]);
                    }
                    drop(p2);
                }
                4 => {
                    let mut out = dirty(&mut rng, slots.len());
                    let p = b.submit().unwrap();
                    d.trim().unwrap();
                    let done = p.wait_into(&slots, &mut out).unwrap();
                    drop(d);
                    drop(set);
                    check(&done, &slots, "wait_into after trim");
                    drop(p3);
                    drop(p2);
                    drop(done);
                }
                _ => {
                    let p = b.submit().unwrap();
                    let e = d.clone();
                    drop(d);
                    drop(p2);
                    e.trim().unwrap();
                    let done = p.wait().unwrap();
                    drop(e);
                    check(&done, &slots, "view after clone dropped");
                    drop(p3);
                    drop(set);
                }
            }
            // Everything dropped: all pinned memory freed.
            let counts = driver.faults().counts();
            let alloc = counts.get("cuMemHostAlloc").map_or(0, |c| c.succeeded);
            let free = counts.get("cuMemFreeHost").map_or(0, |c| c.succeeded);
            assert_eq!(alloc, free, "{name} order {order}: pinned arenas leaked");
            no_model_errors(name);
        }
    }
}

#[test]
fn streamed_with_pinned_buffer_holding_most_of_the_pool() {
    for (name, config) in [("small", small_chunks()), ("tiny", tiny())] {
        let d = device(config.clone());
        let mut rng = fastrand::Rng::with_seed(17);
        let m = Model::new(&d, &mut rng, &[3 << 20, 70_000, 4096]);
        let limit = d.telemetry().pinned.held_limit_bytes;
        for keep in [limit, limit - 1, limit - 4096, limit / 2, 1] {
            let held = d.pinned(keep as usize).unwrap();
            for round in 0..4 {
                let mut ranges: Vec<R> = Vec::new();
                for _ in 0..rng.usize(1..80) {
                    let (i, at, len) = m.range(&mut rng, 200_000);
                    ranges.push((i, at as u64, len as u64));
                }
                if round == 0 {
                    ranges.push((0, 0, 3 << 20));
                }
                every_api(&d, &m, &ranges, &mut rng, &format!("{name} keep {keep} round {round}"));
            }
            drop(held);
        }
        // A PinnedBuffer that takes the rest of the held limit while a view is alive.
        let mut b = d.downloads();
        let s = b.read(m.buffers[1], 0, 70_000).unwrap();
        let done = b.submit().unwrap().wait().unwrap();
        let t = d.telemetry().pinned;
        let rest = t.held_limit_bytes - t.held_bytes;
        if rest > 0 {
            let p = d.pinned(rest as usize);
            assert!(p.is_ok(), "{name}: a request within the held limit is refused: {:?} {t:?}", p.err());
            let ranges = vec![(0usize, 1u64, 200_000u64), (2, 0, 4096)];
            every_api(&d, &m, &ranges, &mut rng, &format!("{name} held full"));
        }
        same("view", done.get(s), &m.expect[1]);
        drop(done);
        lent_zero(&d, name);
    }
}

/// A model GPU shared by the threads of a test.
fn spawn_joined<T: Send + 'static>(
    gpu: &Arc<std::sync::Mutex<model::FakeGpu>>,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    let gpu = Arc::clone(gpu);
    std::thread::spawn(move || {
        model::join(gpu);
        f()
    })
}

fn stress(config: Config, threads: usize, rounds: usize, seed: u64) {
    let d = device(config);
    let gpu = model::shared();
    let shared_m = Arc::new(Model::new(&d, &mut fastrand::Rng::with_seed(seed), &[1 << 20, 70_000]));
    let d = d.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    let mut handles = Vec::new();
    for t in 0..threads {
        let d = d.clone();
        let sm = Arc::clone(&shared_m);
        let tx = tx.clone();
        handles.push(spawn_joined(&gpu, move || {
            let r = catch_unwind(AssertUnwindSafe(|| worker(&d, &sm, t, rounds, seed)));
            let _ = tx.send((t, r.is_ok()));
            if let Err(p) = r {
                std::panic::resume_unwind(p);
            }
        }));
    }
    drop(tx);
    let mut finished = 0;
    while finished < threads {
        match rx.recv_timeout(std::time::Duration::from_secs(180)) {
            Ok(_) => finished += 1,
            Err(_) => panic!("deadlock: {finished} of {threads} threads finished in 180 s"),
        }
    }
    let mut failed = Vec::new();
    for (t, h) in handles.into_iter().enumerate() {
        if let Err(p) = h.join() {
            let text = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            failed.push(format!("thread {t}: {text}"));
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
    eprintln!("stress: {} retries for PinnedExhausted", RETRIES.load(std::sync::atomic::Ordering::Relaxed));
    lent_zero(&d, "after the threads");
    shared_m.check(&d, "shared buffers after the threads");
}

static RETRIES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Runs `f` again while it fails for want of pinned staging, counting: on the smallest pools,
/// the in-place writes of other threads' batches (held until submitted) may take all of it.
/// Any other error fails the test.
fn retry<T>(what: &str, mut f: impl FnMut() -> crate::Result<T>) -> T {
    loop {
        match f() {
            Ok(v) => return v,
            Err(Error::PinnedExhausted { .. }) => {
                RETRIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                std::thread::yield_now();
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

fn worker(d: &Device, shared: &Model, t: usize, rounds: usize, seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed * 100 + t as u64);
    let sizes = [300_000usize, 70_000, 4096, 1 << 20];
    let buffers: Vec<ResidentBuffer> = sizes.iter().map(|&n| d.allocate(n as u64).unwrap()).collect();
    let expect: Vec<Vec<u8>> = sizes.iter().map(|&n| random_vec(&mut rng, n)).collect();
    let writes: Vec<_> = buffers.iter().zip(&expect).map(|(&b, v)| (b, v.as_slice())).collect();
    retry("upload_many", || d.upload_many(&writes));
    let mut m = Model { buffers, expect };
    for round in 0..rounds {
        let what = format!("thread {t} round {round}");
        match rng.u8(..9) {
            0 => {
                let writes: Vec<(usize, usize, Vec<u8>)> = (0..rng.usize(1..100))
                    .map(|_| {
                        let (i, at, len) = m.range(&mut rng, 50_000);
                        (i, at, random_vec(&mut rng, len))
                    })
                    .collect();
                retry(&what, || {
                    let mut b = d.uploads();
                    for (i, at, bytes) in &writes {
                        b.write(m.buffers[*i], *at as u64, bytes)?;
                    }
                    b.submit()?.wait()
                });
                for (i, at, bytes) in &writes {
                    m.expect[*i][*at..*at + bytes.len()].copy_from_slice(bytes);
                }
            }
            1 => {
                let ranges = m.in_order_ranges(&mut rng, 800);
                let data: Vec<Vec<u8>> = ranges.iter().map(|&(_, _, l)| random_vec(&mut rng, l)).collect();
                retry(&what, || {
                    let mut b = d.uploads();
                    for (&(i, at, _), bytes) in ranges.iter().zip(&data) {
                        b.write(m.buffers[i], at as u64, bytes)?;
                    }
                    b.submit()?.wait()
                });
                for (&(i, at, _), bytes) in ranges.iter().zip(&data) {
                    m.expect[i][at..at + bytes.len()].copy_from_slice(bytes);
                }
                let r: Vec<R> = ranges.iter().map(|&(i, o, l)| (i, o as u64, l as u64)).collect();
                let w = want(&m, &r);
                let mut out = dirty(&mut rng, r.len());
                retry(&what, || {
                    let mut b = d.downloads();
                    let slots = b.read_many(abs(&m, &r))?;
                    b.submit()?.wait_into(&slots, &mut out).map(drop)
                });
                for i in 0..r.len() {
                    same(&format!("{what}: in order wait_into {i}"), &out[i], &w[i]);
                }
            }
            2 => {
                let s = d.telemetry().pinned;
                let want_len = rng.u64(1..=s.held_limit_bytes.max(1));
                let held = d.pinned(want_len as usize);
                let r: Vec<R> = (0..rng.usize(1..30))
                    .map(|_| {
                        let (i, o, l) = m.range(&mut rng, 100_000);
                        (i, o as u64, l as u64)
                    })
                    .collect();
                let w = want(&m, &r);
                let got = retry(&what, || d.download_ranges(&abs(&m, &r)));
                for i in 0..r.len() {
                    same(&format!("{what}: ranges with pinned held"), &got[i], &w[i]);
                }
                if let Err(e) = held {
                    assert!(
                        matches!(e, Error::PinnedReserved { .. } | Error::PinnedExhausted { .. }),
                        "{what}: pinned: {e}"
                    );
                    assert!(e.to_string().contains("Fix:"));
                }
            }
            3 => {
                let r: Vec<R> = (0..rng.usize(1..60))
                    .map(|_| {
                        let (i, o, l) = shared.range(&mut rng, 300_000);
                        (i, o as u64, l as u64)
                    })
                    .collect();
                let w = want(shared, &r);
                let (first, slots) = retry(&what, || {
                    let mut b = d.downloads();
                    let slots = b.read_many(abs(shared, &r))?;
                    Ok((b.submit()?, slots))
                });
                let (second, slots2) = retry(&what, || {
                    let mut b = d.downloads();
                    let slots = b.read_many(abs(shared, &r))?;
                    Ok((b.submit()?.wait()?, slots))
                });
                let first = first.wait().unwrap();
                for i in 0..r.len() {
                    same(&format!("{what}: shared first {i}"), first.get(slots[i]), &w[i]);
                    same(&format!("{what}: shared second {i}"), second.get(slots2[i]), &w[i]);
                }
            }
            4 => {
                let got = retry(&what, || d.download_many(&m.buffers));
                for (i, g) in got.iter().enumerate() {
                    same(&format!("{what}: download_many {i}"), g, &m.expect[i]);
                }
            }
            5 => {
                let r: Vec<R> = (0..60).map(|k| (2, k as u64 * 64, 32)).collect();
                let mut set = d.prepare_downloads(&abs(&m, &r)).unwrap();
                let w = want(&m, &r);
                for _ in 0..3 {
                    let mut out = dirty(&mut rng, r.len());
                    retry(&what, || set.download_into(&mut out));
                    for i in 0..r.len() {
                        same(&format!("{what}: prepared {i}"), &out[i], &w[i]);
                    }
                }
                let ranges = m.in_order_ranges(&mut rng, 400);
                let r: Vec<R> = ranges.iter().map(|&(i, o, l)| (i, o as u64, l as u64)).collect();
                let mut set = retry(&what, || d.prepare_downloads(&abs(&m, &r)));
                let w = want(&m, &r);
                let a = retry(&what, || set.submit()?.wait());
                let mut out = dirty(&mut rng, r.len());
                retry(&what, || set.download_into(&mut out));
                for i in 0..r.len() {
                    same(&format!("{what}: prepared in order view {i}"), a.get(set.slot(i)), &w[i]);
                    same(&format!("{what}: prepared in order into {i}"), &out[i], &w[i]);
                }
            }
            6 => {
                let (i, at, len) = m.range(&mut rng, 200_000);
                let bytes = random_vec(&mut rng, len);
                let mut dst = vec![0u8; len];
                let (j, at2, len2) = m.range(&mut rng, 200_000);
                let mut dst2 = vec![0u8; len2];
                let old2 = m.expect[j][at2..at2 + len2].to_vec();
                let buf = (m.buffers[i], m.buffers[j]);
                retry(&what, || {
                    d.scope(|s| {
                        let mut r = s.downloads();
                        r.read_to_slice(buf.1, at2 as u64, &mut dst2)?;
                        let _ = r.submit()?;
                        let mut w = s.uploads();
                        w.write(buf.0, at as u64, &bytes)?;
                        let _ = w.submit()?;
                        let mut r = s.downloads();
                        r.read_to_slice(buf.0, at as u64, &mut dst)?;
                        r.submit().map(drop)
                    })
                });
                same(&format!("{what}: scoped read after write"), &dst, &bytes);
                if i != j || at2 + len2 <= at || at + len <= at2 {
                    same(&format!("{what}: scoped read"), &dst2, &old2);
                }
                m.expect[i][at..at + len].copy_from_slice(&bytes);
            }
            7 => {
                let r = vec![(3usize, 1u64, (1u64 << 20) - 1), (0, 0, 300_000)];
                let w = want(&m, &r);
                let mut out = dirty(&mut rng, 2);
                retry(&what, || d.download_into(&abs(&m, &r), &mut out));
                let (done, slots) = retry(&what, || {
                    let mut b = d.downloads();
                    let slots = b.read_many(abs(&m, &r))?;
                    Ok((b.submit()?.wait()?, slots))
                });
                for i in 0..2 {
                    same(&format!("{what}: streamed into {i}"), &out[i], &w[i]);
                    same(&format!("{what}: streamed view {i}"), done.get(slots[i]), &w[i]);
                }
                if t == 0 {
                    d.trim().unwrap();
                }
            }
            _ => {
                let (i, at, len) = m.range(&mut rng, 100_000);
                let bytes = random_vec(&mut rng, len);
                let fence = retry(&what, || {
                    let mut b = d.uploads();
                    b.write(m.buffers[i], at as u64, &bytes)?;
                    b.submit()
                });
                m.expect[i][at..at + len].copy_from_slice(&bytes);
                let (done, s) = retry(&what, || {
                    let mut r = d.downloads();
                    let s = r.read(m.buffers[i], at as u64, len as u64)?;
                    Ok((r.submit()?.wait()?, s))
                });
                same(&format!("{what}: read after pending write"), done.get(s), &bytes);
                fence.wait().unwrap();
            }
        }
    }
    let got = retry("final", || d.download_many(&m.buffers));
    for (i, g) in got.iter().enumerate() {
        same(&format!("thread {t}: final {i}"), g, &m.expect[i]);
    }
    for &x in &m.buffers {
        d.free(x).unwrap();
    }
}

#[test]
fn stress_8_threads_tiny() {
    stress(tiny(), 8, 400, 1);
}

#[test]
fn stress_8_threads_minimal() {
    stress(minimal(), 8, 300, 2);
}

#[test]
fn stress_8_threads_small() {
    stress(small_chunks().with_pinned_prewarm_bytes(0).with_pack_threads(3), 8, 400, 3);
}

#[test]
fn stress_8_threads_dma() {
    stress(tiny().with_small_copies_over_bus(false), 8, 400, 4);
}

#[test]
fn zero_and_end_reads() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(18);
    let m = Model::new(&d, &mut rng, &[4096]);
    let b = m.buffers[0];
    // Only zero-length reads.
    let mut r = d.downloads();
    let s = r.read(b, 4096, 0).unwrap();
    let s2 = r.read(b, 0, 0).unwrap();
    let done = r.submit().unwrap().wait().unwrap();
    assert!(done.get(s).is_empty() && done.get(s2).is_empty());
    let mut r = d.downloads();
    let s = r.read(b, 4096, 0).unwrap();
    let mut out = vec![vec![1u8; 3]];
    drop(r.submit().unwrap().wait_into(&[s], &mut out).unwrap());
    assert!(out[0].is_empty());
    assert!(d.download_range(b, 4096, 0).unwrap().is_empty());
    fix("read at u64::MAX, len 0", d.downloads().read(b, u64::MAX, 0));
    fix("read at 4097, len 0", d.downloads().read(b, 4097, 0));
    fix("download_ranges at u64::MAX, len 0", d.download_ranges(&[(b, u64::MAX, 0)]));
    fix("prepare at u64::MAX, len 0", d.prepare_downloads(&[(b, u64::MAX, 0)]));
    fix("download_range u64::MAX, 0", d.download_range(b, u64::MAX, 0));
    let mut one = [0u8; 1];
    fix(
        "scope read_to_slice at u64::MAX",
        d.scope(|s| {
            let mut r = s.downloads();
            r.read_to_slice(b, u64::MAX, &mut one)?;
            r.submit()
        }),
    );
    let mut none: [u8; 0] = [];
    d.scope(|s| {
        let mut r = s.downloads();
        r.read_to_slice(b, 4096, &mut none)?;
        r.submit().map(drop)
    })
    .unwrap();
    let mut r = d.downloads();
    fix("read_many with u64::MAX", r.read_many([(b, 0, 1), (b, u64::MAX - 1, 2)]));
    fix("submit of it", r.submit().map(drop));
    // 64+ reads in order with one zero-length in the middle.
    let mut ranges: Vec<R> = (0..100).map(|k| (0, k * 40, 20)).collect();
    ranges[50].2 = 0;
    every_api(&d, &m, &ranges, &mut rng, "in order with a zero-length read");
    // An empty batch.
    let done = d.downloads().submit().unwrap().wait().unwrap();
    assert!(done.is_empty());
    let mut out: Vec<Vec<u8>> = Vec::new();
    d.downloads().submit_into(&mut out).unwrap();
    assert!(d.download_ranges(&[]).unwrap().is_empty());
    assert!(d.download_many(&[]).unwrap().is_empty());
    let mut set = d.prepare_downloads(&[]).unwrap();
    drop(set.submit().unwrap().wait().unwrap());
    set.download_into(&mut []).unwrap();
    lent_zero(&d, "zero reads");
}

/// Runs `body` while another thread, on the same device and model GPU, reads `ranges` with
/// `Device::download_ranges` over and over (each read must succeed).
fn beside_a_reader<T>(d: &Device, ranges: Vec<(ResidentBuffer, u64, u64)>, body: impl FnOnce() -> T) -> T {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (d, stop) = (d.clone(), Arc::clone(&stop));
        spawn_joined(&model::shared(), move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                d.download_ranges(&ranges).unwrap();
            }
        })
    };
    let result = body();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    reader.join().unwrap();
    result
}

/// Uploads `data` into `dst` again and again for `secs` seconds: how many, and the errors.
fn uploads_for(d: &Device, dst: ResidentBuffer, data: &[u8], secs: u64) -> (usize, Vec<String>) {
    let (mut errors, mut runs) = (Vec::new(), 0);
    let start = std::time::Instant::now();
    while start.elapsed() < std::time::Duration::from_secs(secs) {
        runs += 1;
        if let Err(e) = d.upload(dst, data) {
            errors.push(e.to_string());
        }
    }
    (runs, errors)
}

/// Two threads on one device: one reads a buffer larger than the pinned pool (it streams
/// through a ring of pinned chunks), the other uploads. The streamed read holds the whole
/// pool for its ring while it copies chunks out, with nothing in flight to wait for: the
/// upload waits for the ring to come back, and never fails with PinnedExhausted.
#[test]
fn an_upload_waits_for_the_staging_of_a_download_streaming_on_another_thread() {
    let d = device(minimal());
    let big = d.allocate(1 << 20).unwrap();
    let small = d.allocate(1 << 20).unwrap();
    let data = vec![7u8; 1 << 20];
    let (runs, errors) = beside_a_reader(&d, vec![(big, 0, 1 << 20)], || uploads_for(&d, small, &data, 2));
    assert!(errors.is_empty(), "{} of {runs} uploads failed; first: {}", errors.len(), errors[0]);
    assert!(d.download(small).unwrap() == data);
}

/// As above, with batches of several chunks (many small writes in order, one large write),
/// each followed by a read of the whole buffer on the same thread: every batch lands whole.
#[test]
fn uploads_beside_a_streaming_download_land_whole() {
    for (name, in_order) in [("many small writes in order", true), ("one large write", false)] {
        let d = device(minimal());
        let big = d.allocate(1 << 20).unwrap();
        let target = d.allocate(1 << 20).unwrap();
        d.upload(target, &vec![0u8; 1 << 20]).unwrap();
        beside_a_reader(&d, vec![(big, 0, 1 << 20)], || {
            for round in 0..60u32 {
                let value = (round % 250) as u8 + 1;
                let data = vec![value; 1 << 20];
                let mut b = d.uploads();
                if in_order {
                    for k in 0..(1 << 20) / 1024 {
                        b.write(target, k * 1024, &data[k as usize * 1024..][..1000]).unwrap();
                    }
                } else {
                    b.write(target, 0, &data).unwrap();
                }
                b.submit().and_then(|f| f.wait()).unwrap_or_else(|e| panic!("{name}, round {round}: {e}"));
                let got = d.download_ranges(&[(target, 0, 1 << 20)]).unwrap().pop().unwrap();
                let landed =
                    got.iter().enumerate().all(|(i, &x)| x == value || (in_order && i % 1024 >= 1000));
                assert!(landed, "{name}, round {round}: the batch did not land whole");
            }
        });
    }
}

/// The other way round: downloads (any route) while another thread uploads never fail for
/// staging, as the caller holds none.
#[test]
fn downloads_beside_another_threads_uploads_never_fail_for_staging() {
    for (name, config) in [("minimal", minimal()), ("tiny", tiny())] {
        let d = device(config);
        let gpu = model::shared();
        let mut rng = fastrand::Rng::with_seed(5);
        let m = Model::new(&d, &mut rng, &[1 << 20]);
        let target = d.allocate(1 << 20).unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (d, stop) = (d.clone(), Arc::clone(&stop));
            spawn_joined(&gpu, move || {
                let data = vec![1u8; 1 << 20];
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = d.upload(target, &data);
                }
            })
        };
        let (mut errors, mut runs) = (Vec::new(), 0);
        let start = std::time::Instant::now();
        while start.elapsed() < std::time::Duration::from_secs(2) {
            runs += 1;
            let ranges: Vec<_> = (0..100).map(|k| (m.buffers[0], k * 5000, 3000)).collect();
            match d.download_ranges(&ranges) {
                Ok(got) => assert_eq!(got[7], m.expect[0][35_000..38_000]),
                Err(e) => errors.push(e.to_string()),
            }
            if let Err(e) = d.download_ranges(&[(m.buffers[0], 0, 1 << 20)]) {
                errors.push(e.to_string());
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        writer.join().unwrap();
        assert!(
            errors.is_empty(),
            "{name}: {} of {runs} downloads failed; first: {}",
            errors.len(),
            errors[0]
        );
    }
}

/// A download in flight, then an upload of the same bytes: the download sees the old bytes
/// (write after read), on every route; and a scope's reads and writes of the same bytes.
#[test]
fn write_after_read_in_flight() {
    for (name, config) in
        [("small", small_chunks()), ("tiny", tiny()), ("dma", tiny().with_small_copies_over_bus(false))]
    {
        let d = device(config);
        let mut rng = fastrand::Rng::with_seed(21);
        let mut m = Model::new(&d, &mut rng, &[1 << 20, 70_000]);
        let cases: Vec<Vec<R>> = vec![
            vec![(0, 5, 100)],
            vec![(0, 0, 300_000), (1, 3, 60_000)],
            (0..200).map(|k| (0, k * 4000 + 3, 1000)).collect(),
            (0..100).map(|k| (1, k * 500, 499)).collect(),
        ];
        for (c, ranges) in cases.iter().enumerate() {
            let what = format!("{name} case {c}");
            let old = want(&m, ranges);
            let mut b = d.downloads();
            let slots = b.read_many(abs(&m, ranges)).unwrap();
            let route = b.route();
            let pending = b.submit().unwrap();
            // Overwrite everything read, by a batch and by the in-place route.
            let news: Vec<Vec<u8>> =
                ranges.iter().map(|&(_, _, l)| random_vec(&mut rng, l as usize)).collect();
            let mut u = d.uploads();
            for (&(i, o, _), bytes) in ranges.iter().zip(&news) {
                u.write(m.buffers[i], o, bytes).unwrap();
            }
            let f = u.submit().unwrap();
            f.wait().unwrap();
            let done = pending.wait().unwrap();
            for (k, &s) in slots.iter().enumerate() {
                same(&format!("{what} ({route:?}): read {k} sees the later write"), done.get(s), &old[k]);
            }
            drop(done);
            for (&(i, o, l), bytes) in ranges.iter().zip(&news) {
                m.expect[i][o as usize..][..l as usize].copy_from_slice(bytes);
            }
            // Prepared set, then write_with.
            let old = want(&m, ranges);
            let mut set = d.prepare_downloads(&abs(&m, ranges)).unwrap();
            let pending = set.submit().unwrap();
            let mut u = d.uploads();
            let news: Vec<Vec<u8>> =
                ranges.iter().map(|&(_, _, l)| random_vec(&mut rng, l as usize)).collect();
            for (&(i, o, l), bytes) in ranges.iter().zip(&news) {
                u.write_with(m.buffers[i], o, l as usize, |dst| dst.copy_from_slice(bytes)).unwrap();
            }
            u.submit().unwrap().wait().unwrap();
            let done = pending.wait().unwrap();
            for (k, old) in old.iter().enumerate() {
                same(&format!("{what}: prepared read {k} sees the later write"), done.get(set.slot(k)), old);
            }
            drop((done, set));
            for (&(i, o, l), bytes) in ranges.iter().zip(&news) {
                m.expect[i][o as usize..][..l as usize].copy_from_slice(bytes);
            }
            // Scope: read into pinned memory, then write the same bytes from pinned memory.
            let old = want(&m, ranges);
            let total: usize = ranges.iter().map(|r| r.2 as usize).sum();
            if 2 * (total as u64 + (64 << 10)) > d.telemetry().pinned.held_limit_bytes {
                continue;
            }
            let mut into = d.pinned(total).unwrap();
            let mut from = d.pinned(total).unwrap();
            rng.fill(&mut from);
            let from_bytes = from.to_vec();
            d.scope(|s| {
                let mut r = s.downloads();
                let mut rest: &mut [u8] = &mut into;
                for &(i, o, l) in ranges {
                    let (head, tail) = rest.split_at_mut(l as usize);
                    r.read_to_slice(m.buffers[i], o, head)?;
                    rest = tail;
                }
                let _ = r.submit()?;
                let mut w = s.uploads();
                let mut rest: &[u8] = &from;
                for &(i, o, l) in ranges {
                    let (head, tail) = rest.split_at(l as usize);
                    w.write(m.buffers[i], o, head)?;
                    rest = tail;
                }
                w.submit().map(drop)
            })
            .unwrap();
            let mut at = 0;
            for (k, &(i, o, l)) in ranges.iter().enumerate() {
                same(
                    &format!("{what}: scoped read {k} sees the later write"),
                    &into[at..at + l as usize],
                    &old[k],
                );
                m.expect[i][o as usize..][..l as usize].copy_from_slice(&from_bytes[at..at + l as usize]);
                at += l as usize;
            }
            drop((into, from));
            m.check(&d, &what);
            lent_zero(&d, &what);
        }
    }
}

/// A scope whose closure panics after submitting reads into pinned memory waits for them
/// before the panic goes on; the pinned buffer then holds the bytes.
#[test]
fn scope_panic_after_submit() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(22);
    let m = Model::new(&d, &mut rng, &[1 << 20]);
    let mut into = d.pinned(1 << 20).unwrap();
    let mut small = vec![0u8; 1000];
    let r = catch_unwind(AssertUnwindSafe(|| {
        d.scope(|s| {
            let mut r = s.downloads();
            r.read_to_slice(m.buffers[0], 0, &mut into)?;
            r.read_to_slice(m.buffers[0], 5, &mut small)?;
            let _ = r.submit()?;
            panic!("after submit");
            #[allow(unreachable_code)]
            Ok(())
        })
    }));
    assert!(r.is_err());
    same("pinned after panic", &into, &m.expect[0]);
    same("vec after panic", &small, &m.expect[0][5..1005]);
    drop(into);
    lent_zero(&d, "scope panic");
    no_model_errors("scope panic");
}

/// Many tiny planned reads (descriptor tables larger than their bytes) on the smallest pool,
/// where every download streams: the ring's leases (table + chunk) must fit the cap.
#[test]
fn streamed_tiny_reads_tables_fit() {
    for (name, config) in [
        ("minimal", minimal()),
        ("minimal-dma", minimal().with_small_copies_over_bus(false)),
        ("tiny", tiny()),
    ] {
        let d = device(config);
        let mut rng = fastrand::Rng::with_seed(23);
        let m = Model::new(&d, &mut rng, &[1 << 20, 4096]);
        // Reversed (so planned), 1 byte apart by 2; random 1..3 byte reads, overlapping.
        let rev: Vec<R> = (0..20_000u64).rev().map(|k| (0, k * 2 + (k % 7), 1)).collect();
        every_api(&d, &m, &rev, &mut rng, &format!("{name}: 20000 reversed 1-byte reads"));
        let rnd: Vec<R> = (0..30_000).map(|_| (0, rng.u64(0..(1 << 20) - 3), rng.u64(1..4))).collect();
        every_api(&d, &m, &rnd, &mut rng, &format!("{name}: 30000 random tiny reads"));
        let one: Vec<R> = (0..5000).map(|k| (1, k % 4096, 1)).collect();
        every_api(&d, &m, &one, &mut rng, &format!("{name}: 5000 reads of the same few bytes"));
        fix("pinned(usize::MAX)", d.pinned(usize::MAX));
        fix("pinned(cap + 1)", d.pinned(d.telemetry().pinned.cap_bytes as usize + 1));
    }
}

/// With a PinnedBuffer holding the held limit (allowed), one thread reads many tiny ranges
/// (so it streams, through the reserve), another uploads: every upload is served, also where
/// the reader holds the reserve while it copies out, or the uploader's own leases are still
/// on their way back from the thread that retired them.
#[test]
fn uploads_beside_a_streaming_download_and_a_full_held_limit_never_fail_for_staging() {
    for config in [tiny(), small_chunks()] {
        upload_with_pinned_buffer_at_the_held_limit(config);
    }
}

fn upload_with_pinned_buffer_at_the_held_limit(config: Config) {
    let d = device(config.clone());
    let limit = d.telemetry().pinned.held_limit_bytes;
    let _held = d.pinned(limit as usize).unwrap();
    let src = d.allocate(1 << 20).unwrap();
    let dst = d.allocate(1 << 20).unwrap();
    let ranges: Vec<_> = (0..20_000u64).rev().map(|k| (src, k * 50, 1)).collect();
    let data = vec![7u8; 1 << 20];
    let (runs, errors) = beside_a_reader(&d, ranges, || uploads_for(&d, dst, &data, 2));
    assert!(errors.is_empty(), "{config:?}: {} of {runs} uploads failed; first: {}", errors.len(), errors[0]);
}

#[test]
fn download_many_duplicates_and_bad_items() {
    for config in [small_chunks(), minimal(), tiny()] {
        let d = device(config);
        let mut rng = fastrand::Rng::with_seed(24);
        let m = Model::new(&d, &mut rng, &[300_000, 1, 4096, 70_000]);
        let list = [
            m.buffers[0],
            m.buffers[1],
            m.buffers[0],
            m.buffers[3],
            m.buffers[1],
            m.buffers[2],
            m.buffers[0],
        ];
        let got = d.download_many(&list).unwrap();
        for (k, &b) in list.iter().enumerate() {
            let i = m.buffers.iter().position(|&x| x == b).unwrap();
            same(&format!("download_many duplicate {k}"), &got[k], &m.expect[i]);
        }
        let mut r = d.downloads();
        let slots = r.read_buffer_many(&list).unwrap();
        let done = r.submit().unwrap().wait().unwrap();
        for (k, &b) in list.iter().enumerate() {
            let i = m.buffers.iter().position(|&x| x == b).unwrap();
            same(&format!("read_many duplicate {k}"), done.get(slots[k]), &m.expect[i]);
        }
        drop(done);
        let freed = d.allocate(10).unwrap();
        d.free(freed).unwrap();
        fix("download_many with a freed buffer", d.download_many(&[m.buffers[0], freed]));
        let mut r = d.downloads();
        fix("read_buffer_many with a freed buffer", r.read_buffer_many(&[m.buffers[0], freed]));
        fix("submit after it", r.submit().map(drop));
        fix("read_buffer of a freed buffer", d.downloads().read_buffer(freed));
        lent_zero(&d, "download_many");
    }
}

/// After a lost context, staging a copy may still use is kept until the lane goes away; it
/// is not counted as staging a running transfer will give back, so later calls that find
/// the pool full fail at once instead of waiting for it.
#[test]
fn staging_stranded_by_a_lost_context_is_not_waited_for() {
    let driver = model::driver();
    let d = Device::open_with(Arc::clone(&driver), 0, tiny()).unwrap();
    let buf = d.allocate(1 << 20).unwrap();
    let lost = cuda_sys::CUDA_ERROR_LAUNCH_FAILED;
    for entry in ["cuEventRecord", "cuStreamSynchronize"] {
        driver.faults().inject(cuda_sys::Fault::new(entry, 1, lost).times(u64::MAX)).unwrap();
    }
    // Each call fails and strands its 64 KiB; from the ninth on, the pool is full of them.
    for call in 0..12 {
        let start = std::time::Instant::now();
        let result = d.upload_at(buf, 0, &vec![1u8; 60_000]);
        let took = start.elapsed();
        assert!(result.is_err(), "call {call} succeeded on a lost context");
        assert!(took < std::time::Duration::from_millis(500), "call {call} waited {took:?}: {result:?}");
    }
}

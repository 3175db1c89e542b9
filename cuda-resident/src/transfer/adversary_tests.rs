//! Adversarial tests of the download side, on the model driver: every download API at the
//! edges of sizes and pools, bad input, panicking iterators, streamed downloads beside pinned
//! buffers. The helpers here serve the tests of lifetimes in flight (`lifetime_tests`) and of
//! threads sharing a device (`threads_tests`) too.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use crate::testing::{Model, device, model, random_vec, small_chunks};
use crate::{Config, Device, Error, ResidentBuffer, Slot};

pub(super) type R = (usize, u64, u64);

/// The error of `r`, which must carry a "Fix:".
pub(super) fn fix<T: std::fmt::Debug>(what: &str, r: crate::Result<T>) -> Error {
    let e = r.expect_err(what);
    assert!(e.to_string().contains("Fix:"), "{what}: error without a Fix: {e}");
    e
}

pub(super) fn lent_zero(d: &Device, what: &str) {
    d.synchronize().unwrap();
    let t = d.telemetry().pinned;
    assert_eq!((t.lent_bytes, t.held_bytes), (0, 0), "{what}: pinned still lent: {t:?}");
}

pub(super) fn no_model_errors(what: &str) {
    let errors = model::with(|g| g.errors.clone());
    assert!(errors.is_empty(), "{what}: model found {errors:?}");
}

pub(super) fn want(m: &Model, ranges: &[R]) -> Vec<Vec<u8>> {
    ranges.iter().map(|&(i, o, l)| m.expect[i][o as usize..][..l as usize].to_vec()).collect()
}

pub(super) fn abs(m: &Model, ranges: &[R]) -> Vec<(ResidentBuffer, u64, u64)> {
    ranges.iter().map(|&(i, o, l)| (m.buffers[i], o, l)).collect()
}

/// Vectors with junk in them (and capacity), to see that results replace contents.
pub(super) fn dirty(rng: &mut fastrand::Rng, n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|_| {
            let k = rng.usize(0..40);
            random_vec(rng, k)
        })
        .collect()
}

pub(super) fn same(what: &str, got: &[u8], want: &[u8]) {
    assert!(
        got == want,
        "{what}: {} bytes, want {}, first difference at {:?}",
        got.len(),
        want.len(),
        got.iter().zip(want).position(|(a, b)| a != b)
    );
}

/// Reads `ranges` through every download API and checks every byte.
pub(super) fn every_api(d: &Device, m: &Model, ranges: &[R], rng: &mut fastrand::Rng, what: &str) {
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
        same(&format!("{what}: scope read_into {i}"), &out[i], &want[i]);
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

pub(super) fn tiny() -> Config {
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
pub(super) fn minimal() -> Config {
    Config {
        chunk_bytes: 64 << 10,
        direct_threshold: 64 << 10,
        pinned_cap_bytes: 128 << 10,
        pinned_prewarm_bytes: 0,
        pack_threads: 2,
        ..Config::default()
    }
}

pub(super) fn edge_lens(c: &Config) -> Vec<u64> {
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
        "scope read_into at u64::MAX",
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
        fix("read_many with a freed buffer", r.read_buffer_many(&[m.buffers[0], freed]));
        fix("submit after it", r.submit().map(drop));
        fix("read_all of a freed buffer", d.downloads().read_buffer(freed));
        lent_zero(&d, "download_many");
    }
}

/// After a lost context, staging a copy may still use is kept until the lane goes away; it
/// is not counted as staging a running transfer will give back, so later calls that find
/// the pool full fail at once instead of waiting for it.
#[test]
fn staging_stranded_by_a_lost_context_is_not_waited_for() {
    let driver = model::driver();
    let d = Device::open_on_driver(Arc::clone(&driver), 0, tiny()).unwrap();
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

//! Lifetimes of transfers in flight on the model driver: buffers freed between submit and
//! wait, drops in every order (views after the device, trims), writes after reads in flight,
//! and a scope whose closure panics after submitting.

use std::panic::{AssertUnwindSafe, catch_unwind};

use super::adversary_tests::{R, abs, dirty, fix, lent_zero, minimal, no_model_errors, same, tiny, want};
use crate::testing::{Model, device, model, random_vec, small_chunks};
use crate::{Device, ResidentBuffer, Slot};

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
            let d = Device::open_on_driver(driver.clone(), 0, config.clone()).unwrap();
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

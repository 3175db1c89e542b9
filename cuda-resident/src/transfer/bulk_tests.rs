//! The bulk calls on the model driver: `UploadBatch::write_many`, `DownloadBatch::read_many`
//! and `read_buffer_many`, each against what the same items added one by one do.

use crate::testing::{Model, device, model, random_vec, small_chunks};
use crate::{Config, Device, Error, ResidentBuffer};

/// Random ranges `(buffer, offset, len)` of `m` in one of the shapes a bulk call sees.
fn shaped_ranges(m: &Model, rng: &mut fastrand::Rng, shape: usize) -> Vec<(usize, usize, usize)> {
    match shape {
        // Many items on one buffer, in order and apart.
        0 => {
            let mut at = 0;
            let mut out = Vec::new();
            while out.len() < 2000 {
                let len = rng.usize(1..=300);
                if at + len > m.expect[0].len() {
                    break;
                }
                out.push((0, at, len));
                at += len + rng.usize(1..40);
            }
            out
        }
        // One item per buffer, in a shuffled order.
        1 => {
            let mut out: Vec<_> = (1..m.buffers.len())
                .map(|i| {
                    let n = m.expect[i].len();
                    let len = rng.usize(1..=n);
                    (i, rng.usize(0..=n - len), len)
                })
                .collect();
            rng.shuffle(&mut out);
            out
        }
        // Several buffers, in order and apart, interleaved.
        2 => m.in_order_ranges(rng, 3000),
        // Anything: overlapping, out of order, some large.
        _ => (0..rng.usize(1..400)).map(|_| m.range(rng, 20_000)).collect(),
    }
}

fn buffers(d: &Device, rng: &mut fastrand::Rng) -> Model {
    let mut sizes = vec![1 << 20];
    sizes.extend((0..300).map(|_| rng.usize(1..=9000)));
    Model::new(d, rng, &sizes)
}

#[test]
fn write_many_lands_every_byte_as_writes_one_by_one_would() {
    for config in [Config::default(), small_chunks()] {
        let d = device(config);
        let mut rng = fastrand::Rng::with_seed(2001);
        let mut m = buffers(&d, &mut rng);
        for round in 0..16 {
            let ranges = shaped_ranges(&m, &mut rng, round % 4);
            let data: Vec<Vec<u8>> = ranges.iter().map(|&(_, _, len)| random_vec(&mut rng, len)).collect();
            let mut batch = d.uploads();
            // Sometimes after a write or two of the batch's own.
            let (head, tail) = ranges.split_at(if round % 3 == 0 { ranges.len().min(2) } else { 0 });
            for (&(i, at, _), bytes) in head.iter().zip(&data) {
                batch.write(m.buffers[i], at as u64, bytes).unwrap();
            }
            let items = tail
                .iter()
                .zip(&data[head.len()..])
                .map(|(&(i, at, _), bytes)| (m.buffers[i], at as u64, bytes.as_slice()));
            batch.write_many(items).unwrap();
            assert_eq!(batch.len(), ranges.len());
            for (&(i, at, len), bytes) in ranges.iter().zip(&data) {
                m.expect[i][at..at + len].copy_from_slice(bytes);
            }
            batch.submit().unwrap().wait().unwrap();
            m.check(&d, &format!("round {round}"));
        }
    }
}

#[test]
fn read_many_and_read_buffer_many_read_every_byte() {
    for config in [Config::default(), small_chunks()] {
        let d = device(config);
        let mut rng = fastrand::Rng::with_seed(2002);
        let m = buffers(&d, &mut rng);
        for round in 0..16 {
            let ranges = shaped_ranges(&m, &mut rng, round % 4);
            let mut reads = d.downloads();
            let first = reads.read(m.buffers[1], 0, 1).unwrap();
            let slots = reads
                .read_many(ranges.iter().map(|&(i, at, len)| (m.buffers[i], at as u64, len as u64)))
                .unwrap();
            let whole = reads.read_buffer_many(&m.buffers[..3]).unwrap();
            assert_eq!(reads.len(), 1 + ranges.len() + 3);
            let got = reads.submit().unwrap().wait().unwrap();
            assert_eq!(got.get(first), &m.expect[1][..1]);
            for (&(i, at, len), &slot) in ranges.iter().zip(&slots) {
                assert_eq!(got.get(slot), &m.expect[i][at..at + len], "round {round}");
            }
            for (i, &slot) in whole.iter().enumerate() {
                assert_eq!(got.get(slot), &m.expect[i][..], "round {round}: read_buffer_many");
            }
        }
    }
}

#[test]
fn empty_lists_and_zero_length_items_add_what_they_name() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(2003);
    let mut m = Model::new(&d, &mut rng, &[70_000, 4096]);
    let mut batch = d.uploads();
    batch.write_many(std::iter::empty()).unwrap();
    assert!(batch.is_empty());
    batch.submit().unwrap().wait().unwrap();

    let mut reads = d.downloads();
    assert!(reads.read_many([]).unwrap().is_empty());
    assert!(reads.read_buffer_many(&[]).unwrap().is_empty());
    assert!(reads.is_empty());
    reads.submit().unwrap().wait().unwrap();

    // Zero-length items, at the end of a buffer too, among ones with bytes.
    let bytes = random_vec(&mut rng, 300);
    let items = (0..200u64).map(|k| {
        let at = k * 300;
        if k % 3 == 0 { (m.buffers[0], 70_000, &bytes[..0]) } else { (m.buffers[0], at, &bytes[..]) }
    });
    let mut batch = d.uploads();
    batch.write_many(items).unwrap();
    assert_eq!(batch.len(), 200);
    batch.submit().unwrap().wait().unwrap();
    for k in (0..200).filter(|k| k % 3 != 0) {
        m.expect[0][k * 300..k * 300 + 300].copy_from_slice(&bytes);
    }
    m.check(&d, "after zero-length writes");
    let mut reads = d.downloads();
    let slots =
        reads.read_many([(m.buffers[0], 70_000, 0), (m.buffers[1], 5, 0), (m.buffers[1], 0, 9)]).unwrap();
    let got = reads.submit().unwrap().wait().unwrap();
    assert!(got.get(slots[0]).is_empty() && got.get(slots[1]).is_empty());
    assert_eq!(got.get(slots[2]), &m.expect[1][..9]);
}

/// A bad item at index `k`, after `k` good ones: the call's error names the item and holds
/// what the single call returns; the batch keeps the good items and fails submit with the
/// same error, with no driver call; a new batch works.
#[test]
fn a_bad_item_is_named_by_index_keeps_the_items_before_it_and_fails_submit() {
    let driver = model::driver();
    let d = Device::open_on_driver(driver.clone(), 0, small_chunks()).expect("the model opens");
    let other = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(2004);
    let m = Model::new(&d, &mut rng, &[300_000, 4096]);
    let freed = d.allocate(1000).unwrap();
    d.free(freed).unwrap();
    let foreign = other.allocate(1000).unwrap();
    let good = m.buffers[0];
    let bytes = vec![7u8; 100];
    // (what, the bad item's buffer, offset, length)
    let cases: [(&str, ResidentBuffer, u64, u64); 5] = [
        ("a freed handle", freed, 0, 10),
        ("a foreign handle", foreign, 0, 10),
        ("a range past the end", good, 299_950, 100),
        ("a range at u64::MAX", good, u64::MAX, 1),
        ("past the end of a buffer just named", m.buffers[1], 4000, 100),
    ];
    for (what, bad, offset, len) in cases {
        for k in [0usize, 1, 100, 300] {
            let items = |n: usize| (0..n).map(|j| (good, j as u64 * 200, 100u64));
            // Uploads.
            let single = {
                let mut b = d.uploads();
                b.write(bad, offset, &bytes[..len as usize]).unwrap_err()
            };
            let mut batch = d.uploads();
            let list = items(k)
                .map(|(b, at, _)| (b, at, &bytes[..]))
                .chain([(bad, offset, &bytes[..len as usize])])
                .chain(items(3).map(|(b, at, _)| (b, at + 250_000, &bytes[..])));
            let e = batch.write_many(list).unwrap_err();
            let Error::BadItem { call, index, error } = &e else { panic!("{what}: {e}") };
            assert_eq!((*call, *index), ("UploadBatch::write_many", k), "{what}");
            assert_eq!(error.to_string(), single.to_string(), "{what}: the error write gives");
            assert!(e.to_string().starts_with(&format!("item {k} of UploadBatch::write_many: ")), "{e}");
            assert!(e.to_string().contains("Fix: "), "{e}");
            assert_eq!(batch.len(), k, "{what}: the items before it stay, none after");
            // The batch takes more items, but fails at submit with the item's error.
            batch.write(good, 299_000, &bytes).unwrap();
            driver.faults().record();
            let got = batch.submit().unwrap_err();
            let counts = driver.faults().counts();
            driver.faults().clear();
            assert_eq!(got.to_string(), e.to_string(), "{what}: submit fails with the item's error");
            assert!(counts.values().all(|c| c.calls == 0), "{what}, item {k}: driver calls {counts:?}");

            // Downloads, as ranges.
            let single = {
                let mut r = d.downloads();
                r.read(bad, offset, len).unwrap_err()
            };
            let mut reads = d.downloads();
            let list = items(k).chain([(bad, offset, len)]).chain(items(3));
            let e = reads.read_many(list).unwrap_err();
            let Error::BadItem { call, index, error } = &e else { panic!("{what}: {e}") };
            assert_eq!((*call, *index), ("DownloadBatch::read_many", k), "{what}");
            assert_eq!(error.to_string(), single.to_string(), "{what}: the error read gives");
            assert_eq!(reads.len(), k, "{what}: the items before it stay, none after");
            reads.read(good, 0, 10).unwrap();
            driver.faults().record();
            let got = reads.submit().map(drop).unwrap_err();
            let counts = driver.faults().counts();
            driver.faults().clear();
            assert_eq!(got.to_string(), e.to_string(), "{what}: submit fails with the item's error");
            assert!(counts.values().all(|c| c.calls == 0), "{what}, item {k}: driver calls {counts:?}");
        }
    }
    // Whole buffers: a freed or foreign handle at index k.
    for bad in [freed, foreign] {
        let single = d.downloads().read_buffer(bad).unwrap_err();
        let mut reads = d.downloads();
        let e = reads.read_buffer_many(&[good, m.buffers[1], bad, good]).unwrap_err();
        let Error::BadItem { call: "DownloadBatch::read_buffer_many", index: 2, error } = &e else {
            panic!("{e}")
        };
        assert_eq!(error.to_string(), single.to_string());
        assert_eq!(reads.len(), 2);
        assert_eq!(reads.submit().map(drop).unwrap_err().to_string(), e.to_string());
    }
    // A first error stays the batch's error.
    let mut batch = d.uploads();
    let first = batch.write(freed, 0, &bytes).unwrap_err();
    batch.write_many([(foreign, 0, &bytes[..])]).unwrap_err();
    assert_eq!(batch.submit().unwrap_err().to_string(), first.to_string());
    m.check(&d, "after the refused items");
    assert_eq!(d.telemetry().pinned.lent_bytes, 0);
}

#[test]
fn write_many_on_a_poisoned_batch_adds_nothing_and_returns_the_poison() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(2005);
    let m = Model::new(&d, &mut rng, &[70_000]);
    let mut batch = d.uploads();
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = batch.write_with(m.buffers[0], 0, 100, |_| panic!("a fill that fails"));
    }));
    assert!(caught.is_err());
    let e = batch.write_many([(m.buffers[0], 0, &[1u8; 10][..])]).unwrap_err();
    assert!(matches!(e, Error::BatchPoisoned { write: 0, .. }), "{e}");
    assert!(batch.is_empty());
    m.check(&d, "after the poisoned batch");
}

/// An iterator that promises far more items than it has: a bulk call reserves room for a
/// bounded number of them and adds what comes (a hint of `usize::MAX` must not overflow a
/// capacity or reserve the process's memory).
struct Boasting<I>(I);

impl<I: Iterator> Iterator for Boasting<I> {
    type Item = I::Item;
    fn next(&mut self) -> Option<I::Item> {
        self.0.next()
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        (usize::MAX, None)
    }
}

#[test]
fn a_size_hint_past_memory_reserves_a_bounded_room() {
    let d = device(Config::default());
    let b = d.allocate(4096).unwrap();
    let data = random_vec(&mut fastrand::Rng::with_seed(4), 4096);
    let mut uploads = d.uploads();
    uploads.write_many(Boasting((0..16).map(|i| (b, i * 256, &data[i as usize * 256..][..256])))).unwrap();
    uploads.submit().unwrap().wait().unwrap();
    let mut reads = d.downloads();
    let slots = reads.read_many(Boasting((0..16u64).map(|i| (b, i * 256, 256)))).unwrap();
    assert_eq!(slots.len(), 16);
    let done = reads.submit().unwrap().wait().unwrap();
    for (i, slot) in slots.into_iter().enumerate() {
        assert_eq!(done.get(slot), &data[i * 256..][..256]);
    }
    assert!(model::with(|g| g.errors.is_empty()));
}

/// Items `0..n` of `item`, but the iterator panics when asked for item `at`.
fn panicking<T>(n: u64, at: u64, mut item: impl FnMut(u64) -> T) -> impl Iterator<Item = T> {
    (0..n).map(move |i| {
        assert!(i != at, "the caller's iterator panics at item {i}");
        item(i)
    })
}

/// Whether `e` is the error of a bulk call whose iterator panicked at item `index`, with a fix.
fn items_panicked(e: &Error, call: &str, index: usize) -> bool {
    matches!(e, Error::ItemsPanicked { call: c, index: i } if *c == call && *i == index)
        && e.to_string().contains("Fix: ")
}

/// A bulk call whose iterator panics part way: the panic reaches the caller, and a caller
/// that catches it and submits gets `ItemsPanicked` and nothing of the batch moves, neither
/// the items the call took before the panic nor writes added before it (one of them made
/// in place, which takes a route of its own when the batch holds no slices).
#[test]
fn a_bulk_call_whose_iterator_panics_moves_nothing_of_its_batch() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(2006);
    let m = Model::new(&d, &mut rng, &[70_000, 5_000]);
    let data = random_vec(&mut rng, 4096);
    let b = m.buffers[0];
    for with_fill in [false, true] {
        let mut batch = d.uploads();
        if with_fill {
            batch.write_with(m.buffers[1], 100, 64, |dst| dst.fill(7)).unwrap();
        } else {
            batch.write(m.buffers[1], 100, &data[..64]).unwrap();
        }
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = batch.write_many(panicking(200, 150, |i| (b, i * 300, &data[..200])));
        }));
        assert!(caught.is_err(), "the iterator's panic reaches the caller");
        let e = batch.submit().unwrap_err();
        assert!(items_panicked(&e, "UploadBatch::write_many", 150), "{e}");
        m.check(&d, "after an upload batch whose write_many panicked");
    }
    let mut reads = d.downloads();
    reads.read(b, 0, 10).unwrap();
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = reads.read_many(panicking(50, 3, |i| (b, i * 100, 50)));
    }));
    assert!(caught.is_err());
    let e = reads.submit().map(drop).unwrap_err();
    assert!(items_panicked(&e, "DownloadBatch::read_many", 3), "{e}");
    // In a scope: the caller catches the panic inside and submits what it has.
    let mut into = vec![0xA5u8; 64 * 100];
    let e = d
        .scope(|s| {
            let mut writes = s.uploads();
            writes.write(m.buffers[1], 0, &data[..10])?;
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let _ = writes.write_many(panicking(100, 99, |i| (b, i * 64, &data[..64])));
            }));
            assert!(caught.is_err());
            let e = writes.submit().unwrap_err();
            assert!(items_panicked(&e, "UploadBatch::write_many", 99), "{e}");
            let mut reads = s.downloads();
            let mut slots = into.chunks_mut(64);
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let _ = reads.read_to_slice_many(panicking(100, 0, |i| (b, i * 64, slots.next().unwrap())));
            }));
            assert!(caught.is_err());
            reads.submit()
        })
        .unwrap_err();
    assert!(items_panicked(&e, "DownloadBatch::read_to_slice_many", 0), "{e}");
    assert!(into.iter().all(|&x| x == 0xA5), "no read of the panicked call landed");
    m.check(&d, "after scoped bulk calls that panicked");
    assert!(model::with(|g| g.errors.is_empty()));
}

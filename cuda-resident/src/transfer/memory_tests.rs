//! Memory around transfers on the model driver: how much pinned staging a batch wastes or
//! holds, the reserve left to transfers when pinned buffers and unreleased downloads hold
//! the rest, and batches among allocations and frees.

use super::prepared_tests::prepared_ranges;
use crate::testing::{Model, device, random_vec, small_chunks};
use crate::{Config, Error, ResidentBuffer};

/// Staging written in place (`write_with`) is not lost to rounding: for writes of 4 KiB to
/// 64 MiB, the pinned bytes a batch holds exceed the bytes it writes by at most 10 %
/// (a 1 MiB write once took a 2 MiB arena). Writes of their own DMA get an arena each;
/// smaller ones share chunk-sized leases, the last of which may be part-full: the batches
/// here are large enough (256 MiB, or one write) for that to stay inside the bound.
#[test]
fn in_place_staging_wastes_at_most_a_tenth() {
    const MIB: usize = 1 << 20;
    let d = device(Config::default());
    let buffer = d.allocate(256 << 20).unwrap();
    for size in
        [4 << 10, 16 << 10, 100 << 10, (256 << 10) - 1, 256 << 10, MIB, MIB + 1, 3 * MIB, 17 * MIB, 64 * MIB]
    {
        let count = ((256 * MIB) / size).max(1);
        let mut batch = d.uploads();
        for i in 0..count {
            batch.write_with(buffer, (i * size) as u64, size, |dst| dst[0] = 1).unwrap();
        }
        let (held, written) = (d.telemetry().pinned.lent_bytes, (count * size) as u64);
        assert!(
            held * 10 <= written * 11,
            "{count} writes of {size} B hold {held} pinned bytes for {written}"
        );
        drop(batch);
        assert_eq!(d.telemetry().pinned.lent_bytes, 0);
    }
}

/// A pinned buffer of exactly what held staging may still take is lent, though its arena
/// size would round past the limit (it takes pages to measure); one byte more, or any more
/// once the limit is held, is refused with a Fix. Its memory goes back whole.
#[test]
fn a_pinned_buffer_of_the_whole_held_limit_is_lent_and_one_byte_more_is_not() {
    // A held limit of no arena size: 2 MiB + 4000 bytes less the reserve of 512 KiB.
    let config = Config { pinned_cap_bytes: (2 << 20) + 4000, ..small_chunks() };
    let d = device(config);
    let limit = d.telemetry().pinned.held_limit_bytes;
    assert_eq!(limit, (2 << 20) + 4000 - (512 << 10));
    let over = d.pinned(limit as usize + 1).expect_err("past the limit");
    assert!(matches!(over, Error::PinnedReserved { .. }) && over.to_string().contains("Fix:"), "{over}");
    for _ in 0..2 {
        let mut whole = d.pinned(limit as usize).unwrap_or_else(|e| panic!("the whole limit: {e}"));
        assert_eq!(whole.len(), limit as usize);
        whole.fill(0x5A);
        assert_eq!(d.telemetry().pinned.held_bytes, limit);
        let more = d.pinned(1).expect_err("the limit is held");
        assert!(matches!(more, Error::PinnedReserved { .. }), "{more}");
        // Transfers still have the reserve.
        let b = d.allocate(300_000).unwrap();
        let data = random_vec(&mut fastrand::Rng::with_seed(5), 300_000);
        d.upload(b, &data).unwrap();
        assert!(d.download(b).unwrap() == data);
        drop(whole);
        assert_eq!(d.telemetry().pinned.held_bytes, 0);
    }
    // Half of it (an arena rounded up), then exactly what that leaves.
    let half = d.pinned(limit as usize / 2).unwrap();
    let left = limit - d.telemetry().pinned.held_bytes;
    assert!(left < limit / 2, "the first half's arena was rounded up");
    let rest = d.pinned(left as usize).unwrap_or_else(|e| panic!("what is left, {left} bytes: {e}"));
    assert_eq!(d.telemetry().pinned.held_bytes, limit);
    drop((half, rest));
    assert_eq!(d.telemetry().pinned.held_bytes, 0);
}

/// Staging held outside transfers (pinned buffers, prepared sets) cannot take the pool's
/// reserve: with the rest of the pool held, transfers of several times the reserve still
/// move every byte (in fewer chunks at a time), a prepared set that finds no room moves as
/// batches, and one more pinned buffer is refused with a Fix. (Before the reserve, pinned
/// buffers filled the pool and every transfer failed with `PinnedExhausted`.)
#[test]
fn held_staging_leaves_the_reserve_to_transfers() {
    let config = small_chunks();
    let reserve = config.pinned_reserve();
    assert_eq!(reserve, 512 << 10, "8 chunks of 64 KiB");
    let d = device(config);
    let mut rng = fastrand::Rng::with_seed(71);
    let mut m = Model::new(&d, &mut rng, &[200_000, 230_000, 70_000]);
    let large = d.allocate(3 << 20).unwrap();
    let mut held = Vec::new();
    let refusal = loop {
        match d.pinned(1 << 20) {
            Ok(mut buffer) => {
                buffer.fill(0xA5);
                held.push(buffer);
            }
            Err(e) => break e,
        }
    };
    let stats = d.telemetry().pinned;
    assert_eq!(held.len(), 7, "{stats:?}");
    assert_eq!((stats.held_bytes, stats.held_limit_bytes), (7 << 20, (8 << 20) - reserve));
    assert!(matches!(refusal, Error::PinnedReserved { .. }), "{refusal}");
    let text = refusal.to_string();
    assert!(text.contains("Fix:") && text.contains("7340032 bytes"), "{text}");
    // The rest of the limit, in the smallest arenas.
    while let Ok(buffer) = d.pinned(1) {
        held.push(buffer);
    }
    assert_eq!(d.telemetry().pinned.held_bytes, (8 << 20) - reserve);

    // A prepared set finds no room for its region: it moves as batches, correctly.
    let ranges = prepared_ranges(&m, &mut rng);
    let mut up = d.prepare_uploads(&ranges).unwrap();
    assert!(!up.is_laid_out(), "no held staging left: the set moves as batches");
    let data: Vec<Vec<u8>> = ranges.iter().map(|&(_, _, len)| random_vec(&mut rng, len as usize)).collect();
    up.upload(&data).unwrap().wait().unwrap();
    m.expect_writes(&ranges, &data);

    // Transfers of several times the reserve: a whole buffer, many small writes, reads.
    let whole = random_vec(&mut rng, 3 << 20);
    d.upload(large, &whole).unwrap();
    for (k, part) in whole.chunks(256 << 10).enumerate() {
        assert!(d.download_range(large, (k << 18) as u64, part.len() as u64).unwrap() == part, "part {k}");
    }
    let mut batch = d.uploads();
    let small: Vec<(u64, Vec<u8>)> = (0..160).map(|i| (i * 1400, random_vec(&mut rng, 1000))).collect();
    for (at, bytes) in &small {
        batch.write(m.buffers[1], *at, bytes).unwrap();
    }
    batch.submit().unwrap().wait().unwrap();
    for (at, bytes) in &small {
        m.expect[1][*at as usize..][..bytes.len()].copy_from_slice(bytes);
    }
    m.check(&d, "transfers beside held staging");
    // A download with views finds no held staging left: it streams into memory of its own,
    // with the same views.
    let mut reads = d.downloads();
    let slots: Vec<_> = (0..3).map(|i| reads.read_buffer(m.buffers[i]).unwrap()).collect();
    let done = reads.submit().unwrap().wait().unwrap();
    for (i, &slot) in slots.iter().enumerate() {
        assert!(done.get(slot) == &m.expect[i][..], "view {i}");
    }
    assert_eq!(d.telemetry().pinned.held_bytes, (8 << 20) - reserve, "the views hold no pinned staging");
    drop(done);
    assert!(held[..7].iter().all(|b| b.iter().all(|&x| x == 0xA5)), "held buffers untouched");
    drop(held);
    drop(up);
    assert_eq!(d.telemetry().pinned.held_bytes, 0);
}

/// Unreleased downloads hold their staging as held staging: many of them stop at the held
/// limit (later ones stream into memory of their own), and transfers still move.
#[test]
fn unreleased_downloads_leave_the_reserve_to_transfers() {
    let config = small_chunks();
    let limit = config.pinned_cap_bytes - config.pinned_reserve();
    let d = device(config);
    let mut rng = fastrand::Rng::with_seed(73);
    let m = Model::new(&d, &mut rng, &[60_000, 50_000]);
    let mut kept = Vec::new();
    for _ in 0..200 {
        let mut reads = d.downloads();
        let a = reads.read_buffer(m.buffers[0]).unwrap();
        let b = reads.read(m.buffers[1], 1000, 40_000).unwrap();
        let done = reads.submit().unwrap().wait().unwrap();
        assert!(done.get(a) == &m.expect[0][..] && done.get(b) == &m.expect[1][1000..41_000]);
        kept.push(done);
        assert!(d.telemetry().pinned.held_bytes <= limit);
    }
    assert!(d.telemetry().pinned.held_bytes * 10 >= limit * 9, "the downloads filled the held limit");
    m.check(&d, "transfers beside 200 unreleased downloads");
    drop(kept);
    assert_eq!(d.telemetry().pinned.held_bytes, 0);
}

/// Buffers allocated, freed (their memory handed out again) and named by batches in random
/// turns, with handles freed long ago mixed in: every batch's buffer table is reused from
/// the last, so an entry still taken for a freed buffer would write into or read from its
/// memory's new owner. Every byte is checked against a model of what each live buffer holds;
/// a batch that names a freed handle fails and moves nothing.
#[test]
fn batches_among_allocations_and_frees_touch_only_live_buffers() {
    use std::collections::HashMap;
    let d = device(Config::default());
    let mut rng = fastrand::Rng::with_seed(41);
    let mut live: HashMap<ResidentBuffer, Vec<u8>> = HashMap::new();
    let mut order: Vec<ResidentBuffer> = Vec::new();
    let mut dead: Vec<ResidentBuffer> = Vec::new();
    let allocate = |rng: &mut fastrand::Rng, live: &mut HashMap<_, _>, order: &mut Vec<_>| {
        let len = rng.usize(1..=20_000);
        let bytes = random_vec(rng, len);
        let b = d.allocate(bytes.len() as u64).unwrap();
        d.upload(b, &bytes).unwrap();
        live.insert(b, bytes);
        order.push(b);
    };
    for _ in 0..40 {
        allocate(&mut rng, &mut live, &mut order);
    }
    for round in 0..300 {
        match rng.u8(..10) {
            // Free one, allocate one or two (likely in the freed memory).
            0 | 1 => {
                let b = order.swap_remove(rng.usize(..order.len()));
                live.remove(&b);
                d.free(b).unwrap();
                dead.push(b);
                for _ in 0..rng.usize(1..=2) {
                    allocate(&mut rng, &mut live, &mut order);
                }
            }
            // Writes to a random subset, shuffled, sometimes with a freed handle among them.
            2..=5 => {
                let mut names: Vec<ResidentBuffer> =
                    (0..rng.usize(1..=order.len())).map(|_| order[rng.usize(..order.len())]).collect();
                rng.shuffle(&mut names);
                let stale = (!dead.is_empty() && rng.u8(..4) == 0).then(|| dead[rng.usize(..dead.len())]);
                let mut batch = d.uploads();
                let mut writes = Vec::new();
                for (k, &b) in names.iter().enumerate() {
                    if let Some(freed) = stale
                        && k == names.len() / 2
                    {
                        let err = batch.write(freed, 0, &[7; 8]).unwrap_err();
                        assert!(matches!(err, Error::FreedBuffer { .. }), "round {round}: {err}");
                    }
                    let n = live[&b].len();
                    let at = rng.usize(..n);
                    let len = rng.usize(1..=(n - at).min(3000));
                    let bytes = random_vec(&mut rng, len);
                    writes.push((b, at, bytes));
                }
                for (b, at, bytes) in &writes {
                    batch.write(*b, *at as u64, bytes).unwrap();
                }
                match (stale, rng.u8(..8)) {
                    (Some(_), _) => {
                        let err = batch.submit().unwrap_err();
                        assert!(matches!(err, Error::FreedBuffer { .. }), "round {round}: {err}");
                    }
                    // Dropped unsubmitted: nothing moves.
                    (None, 0) => drop(batch),
                    (None, _) => {
                        batch.submit().unwrap().wait().unwrap();
                        for (b, at, bytes) in &writes {
                            live.get_mut(b).unwrap()[*at..*at + bytes.len()].copy_from_slice(bytes);
                        }
                    }
                }
            }
            // Reads of a random subset, shuffled, against the model.
            _ => {
                let mut reads = d.downloads();
                let mut slots = Vec::new();
                for _ in 0..rng.usize(1..=order.len()) {
                    let b = order[rng.usize(..order.len())];
                    let n = live[&b].len();
                    let at = rng.usize(..n);
                    let len = rng.usize(1..=n - at);
                    slots.push((reads.read(b, at as u64, len as u64).unwrap(), b, at, len));
                }
                let done = reads.submit().unwrap().wait().unwrap();
                for (slot, b, at, len) in slots {
                    assert_eq!(done.get(slot), &live[&b][at..at + len], "round {round}: read of {b:?}");
                }
            }
        }
    }
    for (&b, bytes) in &live {
        assert_eq!(&d.download(b).unwrap(), bytes, "{b:?} at the end");
    }
}

/// A device whose GPU registers host memory makes its staging of huge pages where the
/// kernel offers them: uploads and downloads through chunks of 2 MiB arenas, and batches
/// of small copies read over the bus from them, land every byte; every registration is
/// undone when the device goes. Asked not to, it registers nothing.
#[test]
fn staging_of_huge_pages_carries_every_kind_of_transfer_and_is_given_back() {
    const MIB: usize = 1 << 20;
    for wished in [true, false] {
        let driver = crate::testing::model::driver();
        crate::testing::model::with(|g| g.registers_host_memory = true);
        driver.faults().record();
        let config = Config { chunk_bytes: 2 << 20, pinned_cap_bytes: 16 << 20, ..Config::default() }
            .with_pinned_huge_pages(wished);
        let d = crate::Device::open_on_driver(std::sync::Arc::clone(&driver), 0, config).unwrap();
        let huge = wished && crate::host_pool::kernel_offers_huge_pages();
        assert_eq!(d.pinned_in_huge_pages(), huge, "wished {wished}");
        let mut rng = fastrand::Rng::with_seed(11);
        let big = d.allocate(21 * MIB as u64 + 333).unwrap();
        let data = random_vec(&mut rng, 21 * MIB + 333);
        d.upload(big, &data).unwrap();
        assert!(d.download(big).unwrap() == data, "wished {wished}: 21 MiB through 2 MiB chunks");
        let mut m = Model::new(&d, &mut rng, &[1 << 16; 8]);
        let src = random_vec(&mut rng, 4000 * 90);
        let mut batch = d.uploads();
        for i in 0..4000 {
            let (b, at, len) = (i % 8, (i / 8) * 100, 1 + i % 90);
            let bytes = &src[i * 90..i * 90 + len];
            m.expect[b][at..at + len].copy_from_slice(bytes);
            batch.write(m.buffers[b], at as u64, bytes).unwrap();
        }
        batch.submit().unwrap().wait().unwrap();
        m.check(&d, "small copies from huge-page staging");
        let registered = driver.faults().counts().get("cuMemHostRegister_v2").map_or(0, |c| c.succeeded);
        assert_eq!(registered > 0, huge, "wished {wished}: {registered} registrations");
        drop(m);
        drop(d);
        let counts = driver.faults().counts();
        let unregistered = counts.get("cuMemHostUnregister").map_or(0, |c| c.succeeded);
        assert_eq!(registered, unregistered, "wished {wished}: every registration undone");
        crate::testing::model::with(|g| g.registers_host_memory = false);
    }
}

//! The whole transfer engine on the model driver (`testing::model`): a `Device` opened on it
//! plans, stages, packs, "DMAs" and "scatters" exactly as on a GPU, and the model carries
//! the copies and kernels out only when the host waits, stream by stream, following the
//! waits between streams: staging reused too early, or a read not ordered after the writes
//! of the other lane, shows as wrong bytes. No GPU needed: these run in CI.

use crate::plan::route::Route;
use crate::testing::{Model, device, model, random_vec, small_chunks};
use crate::{Config, Device, Error};

fn ragged_rounds(config: Config, seed: u64) {
    let d = device(config);
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut m = Model::new(&d, &mut rng, &[1, 100, 4096, 70_000, 300_000, 1 << 20]);
    m.check(&d, "initial");
    for round in 0..12 {
        // Writes, copied or in place, overlapping, in any order; later ones win.
        let mut batch = d.uploads();
        // In-place batches hold their pinned staging until submitted: keep them within the
        // small configuration's cap.
        let in_place = round % 3 == 1;
        let data: Vec<(usize, usize, Vec<u8>)> = (0..rng.usize(1..300))
            .map(|_| {
                let (i, offset, len) = m.range(&mut rng, 5000);
                let len = if in_place { len.min(5000) } else { len };
                (i, offset, random_vec(&mut rng, len))
            })
            .collect();
        for (i, offset, bytes) in &data {
            if in_place {
                batch
                    .write_with(m.buffers[*i], *offset as u64, bytes.len(), |dst| dst.copy_from_slice(bytes))
                    .unwrap();
            } else {
                batch.write(m.buffers[*i], *offset as u64, bytes).unwrap();
            }
            m.expect[*i][*offset..offset + bytes.len()].copy_from_slice(bytes);
        }
        let fence = batch.submit().unwrap();
        if round % 2 == 0 {
            fence.wait().unwrap();
        }
        // Reads of random ranges, on the other lane, without waiting for the writes on the
        // host: as views, and into vectors.
        let mut reads = d.downloads();
        let ranges: Vec<_> = (0..rng.usize(1..200)).map(|_| m.range(&mut rng, 5000)).collect();
        let slots: Vec<_> = ranges
            .iter()
            .map(|&(i, offset, len)| reads.read(m.buffers[i], offset as u64, len as u64).unwrap())
            .collect();
        let pending = reads.submit().unwrap();
        if round % 2 == 0 {
            let got = pending.wait().unwrap();
            for (&(i, offset, len), &slot) in ranges.iter().zip(&slots) {
                assert_eq!(got.get(slot), &m.expect[i][offset..offset + len], "round {round}: a view");
            }
        } else {
            let mut out = vec![Vec::new(); slots.len()];
            pending.wait_into(&slots, &mut out).unwrap();
            for (&(i, offset, len), got) in ranges.iter().zip(&out) {
                assert_eq!(got, &m.expect[i][offset..offset + len], "round {round}: a copy");
            }
        }
        // One range the slow way round.
        let (i, offset, len) = m.range(&mut rng, 5000);
        let mut slice = vec![0x5a; len];
        d.download_to_slice(m.buffers[i], offset as u64, &mut slice).unwrap();
        assert_eq!(slice, &m.expect[i][offset..offset + len]);
        assert_eq!(
            d.download_range(m.buffers[i], offset as u64, len as u64).unwrap(),
            &m.expect[i][offset..offset + len]
        );
    }
    m.check(&d, "after the rounds");
    for b in m.buffers.drain(..) {
        d.free(b).unwrap();
    }
    d.synchronize().unwrap();
    d.trim().unwrap();
    let t = d.telemetry();
    assert_eq!((t.memory.allocated_bytes, t.memory.library_bytes), (0, t.staging_bytes), "{t:#?}");
    assert_eq!(t.pinned.lent_bytes, 0, "{t:#?}");
}

#[test]
fn ragged_batches_on_the_model_match_the_byte_model() {
    ragged_rounds(Config::default(), 1);
}

#[test]
fn ragged_batches_in_small_chunks_on_the_model_match_the_byte_model() {
    ragged_rounds(small_chunks(), 2);
    ragged_rounds(small_chunks(), 3);
}

#[test]
fn batches_submitted_back_to_back_never_reuse_staging_too_early() {
    // A pinned cap of a few chunks, many batches in flight, nothing waited for until the end:
    // staging must come back only after the model has carried out the copies that use it.
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(4);
    let b = d.allocate(4 << 20).unwrap();
    let mut expect = vec![0u8; 4 << 20];
    d.upload(b, &expect).unwrap();
    let mut fences = Vec::new();
    for _ in 0..40 {
        let mut batch = d.uploads();
        let data: Vec<(usize, Vec<u8>)> = (0..50)
            .map(|_| {
                let len = rng.usize(1..20_000);
                (rng.usize(0..=expect.len() - len), random_vec(&mut rng, len))
            })
            .collect();
        for (offset, bytes) in &data {
            batch.write(b, *offset as u64, bytes).unwrap();
            expect[*offset..offset + bytes.len()].copy_from_slice(bytes);
        }
        fences.push(batch.submit().unwrap());
    }
    drop(fences);
    assert!(d.download(b).unwrap() == expect, "a later batch's staging overwrote an earlier one's");
    d.free(b).unwrap();
}

#[test]
fn the_asynchronous_path_takes_pinned_memory_only() {
    let d = device(Config::default());
    let b = d.allocate(4096).unwrap();
    let mut rng = fastrand::Rng::with_seed(5);
    let data = random_vec(&mut rng, 4096);
    // SAFETY: refused before anything is enqueued.
    let err = unsafe { d.upload_async_at(b, 0, data.as_ptr(), data.len()) }.unwrap_err();
    assert!(matches!(err, Error::NotPinned { .. }), "{err}");
    let mut pinned = d.pinned(4096).unwrap();
    pinned.copy_from_slice(&data);
    // SAFETY: pinned, 4096 bytes, alive until the fence is waited on.
    unsafe { d.upload_async_at(b, 0, pinned.as_ptr(), 4096) }.unwrap().wait().unwrap();
    let mut back = d.pinned(4096).unwrap();
    // SAFETY: as above, written by the copy only.
    unsafe { d.download_async_at(b, 0, back.as_mut_ptr(), 4096) }.unwrap().wait().unwrap();
    assert_eq!(&back[..], &data[..]);
    assert_eq!(d.telemetry().upload_submissions, 1, "the refused copy enqueued nothing");
}

#[test]
fn a_device_dropped_with_work_in_flight_carries_it_out_first() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(6);
    let b = d.allocate(1 << 20).unwrap();
    let data = random_vec(&mut rng, 1 << 20);
    let mut reads = {
        let mut batch = d.uploads();
        batch.write(b, 0, &data).unwrap();
        drop(batch.submit().unwrap());
        d.downloads()
    };
    let slot = reads.read_buffer(b).unwrap();
    let pending = reads.submit().unwrap();
    drop(d);
    let got = pending.wait().unwrap();
    assert!(got.get(slot) == &data[..]);
}

#[test]
fn in_order_batches_of_small_writes_skip_planning_and_match() {
    // Chunks of 64 KiB: a batch spans more chunks than the ring holds. The kernel reads the
    // bytes in pinned staging over the bus, or from device staging after a DMA.
    for over_bus in [true, false] {
        in_order_writes(Config { small_copies_over_bus: over_bus, ..small_chunks() });
    }
}

fn in_order_writes(config: Config) {
    let d = device(config);
    let mut rng = fastrand::Rng::with_seed(33);
    let mut m = Model::new(&d, &mut rng, &[300_000, 70_000, 1 << 20, 4099]);
    for round in 0..8 {
        let ranges = m.in_order_ranges(&mut rng, 600);
        if ranges.len() < 64 {
            continue;
        }
        let data: Vec<_> = ranges.iter().map(|&(i, at, len)| (i, at, random_vec(&mut rng, len))).collect();
        let mut batch = d.uploads();
        for (i, at, bytes) in &data {
            batch.write(m.buffers[*i], *at as u64, bytes).unwrap();
            m.expect[*i][*at..at + bytes.len()].copy_from_slice(bytes);
        }
        assert_eq!(batch.route(), Route::InOrder, "round {round}: the in-order path");
        let fence = batch.submit().unwrap();
        if round % 2 == 0 {
            fence.wait().unwrap();
        }
        m.check(&d, &format!("in-order round {round}"));
    }
    // One write out of order sends the batch to the planner, with the same result.
    let mut batch = d.uploads();
    let bytes: Vec<Vec<u8>> = (0..100).map(|_| random_vec(&mut rng, 100)).collect();
    for (k, b) in bytes.iter().enumerate() {
        let at = if k == 50 { 0 } else { 200 + k * 100 };
        batch.write(m.buffers[0], at as u64, b).unwrap();
        m.expect[0][at..at + 100].copy_from_slice(b);
    }
    assert_eq!(batch.route(), Route::Planned, "out of order: planned");
    batch.submit().unwrap().wait().unwrap();
    m.check(&d, "a batch out of order");
    d.synchronize().unwrap();
    assert_eq!(d.telemetry().pinned.lent_bytes, 0);
}

#[test]
fn in_place_batches_in_order_over_several_leases_move_each_lease_by_a_dma_and_one_launch() {
    // 64 KiB chunks: the arena takes several leases; writes of 8 KiB or more (the direct
    // threshold) get a lease of their own and move by their own DMA; empty writes move
    // nothing. Each packed lease: its bytes by one DMA, its table by another, one launch.
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(41);
    let mut m = Model::new(&d, &mut rng, &[1 << 20, 300_000, 4099]);
    let mut next = vec![0usize; m.buffers.len()];
    let mut batch = d.uploads();
    let (mut packed_bytes, mut own) = (0usize, 0u64);
    for k in 0..400 {
        let i = rng.usize(..m.buffers.len());
        let len = match k % 50 {
            7 => 0,
            13 => rng.usize(8 << 10..20 << 10),
            _ => rng.usize(1..3000),
        };
        let at = next[i] + rng.usize(1..40);
        if at + len > m.expect[i].len() {
            continue;
        }
        next[i] = at + len;
        let bytes = random_vec(&mut rng, len);
        batch.write_with(m.buffers[i], at as u64, len, |dst| dst.copy_from_slice(&bytes)).unwrap();
        m.expect[i][at..at + len].copy_from_slice(&bytes);
        if len >= 8 << 10 {
            own += 1;
        } else {
            packed_bytes += len;
        }
    }
    let before = d.telemetry();
    batch.submit().unwrap().wait().unwrap();
    let after = d.telemetry();
    m.check(&d, "in place, in order");
    let launches = after.kernel_launches - before.kernel_launches;
    // At least as many leases as 64 KiB chunks of packed bytes.
    assert!(launches as usize >= packed_bytes.div_ceil(64 << 10), "{launches} launches");
    assert_eq!(after.dma_copies - before.dma_copies, 2 * launches + own);
    assert_eq!(after.upload_submissions - before.upload_submissions, 2 * launches + own);
    d.synchronize().unwrap();
    assert_eq!(d.telemetry().pinned.lent_bytes, 0);
}

#[test]
fn in_order_batches_of_small_reads_skip_planning_and_match() {
    for over_bus in [true, false] {
        in_order_reads(Config { small_copies_over_bus: over_bus, ..small_chunks() });
    }
}

fn in_order_reads(config: Config) {
    let d = device(config);
    let mut rng = fastrand::Rng::with_seed(34);
    let m = Model::new(&d, &mut rng, &[300_000, 70_000, 1 << 20, 4099]);
    for round in 0..8 {
        let ranges = m.in_order_ranges(&mut rng, 800);
        if ranges.len() < 64 {
            continue;
        }
        let (reads, slots) = m.reads(&d, &ranges);
        let pending = reads.submit().unwrap();
        assert_eq!(pending.route, Route::InOrder, "round {round}: the in-order path");
        let got = if round % 2 == 0 {
            pending.wait().unwrap()
        } else {
            let mut out = vec![vec![0x5a; 3]; slots.len()];
            let got = pending.wait_into(&slots, &mut out).unwrap();
            for (&(i, at, len), v) in ranges.iter().zip(&out) {
                assert_eq!(v, &m.expect[i][at..at + len], "round {round}: a copy");
            }
            got
        };
        for (&(i, at, len), &slot) in ranges.iter().zip(&slots) {
            assert_eq!(got.get(slot), &m.expect[i][at..at + len], "round {round}: a view");
        }
    }
    assert!(model::with(|g| g.errors.is_empty()), "the model found illegal accesses");
    d.synchronize().unwrap();
}

#[test]
fn reads_in_order_copy_into_vectors_for_slots_in_any_order_a_subset_or_named_twice() {
    for over_bus in [true, false] {
        let d = device(Config { small_copies_over_bus: over_bus, ..small_chunks() });
        let mut rng = fastrand::Rng::with_seed(44);
        let m = Model::new(&d, &mut rng, &[4 << 20]);
        // Over a megabyte in 64 KiB chunks: many chunks, copied out on the packing threads.
        let ranges = pipelined_ranges(900);
        let mut orders: Vec<(&str, Vec<usize>)> = vec![
            ("in order", (0..ranges.len()).collect()),
            ("reversed", (0..ranges.len()).rev().collect()),
            ("a subset", (0..ranges.len()).step_by(3).collect()),
            ("named twice", (0..ranges.len()).chain(0..ranges.len()).collect()),
        ];
        let mut shuffled: Vec<usize> = (0..ranges.len()).collect();
        rng.shuffle(&mut shuffled);
        orders.push(("shuffled", shuffled));
        for (what, order) in orders {
            let (reads, slots) = m.reads(&d, &ranges);
            let pending = reads.submit().unwrap();
            assert_eq!(pending.route, Route::InOrder, "{what}: the in-order path");
            let asked: Vec<_> = order.iter().map(|&r| slots[r]).collect();
            let mut out = vec![vec![0x5a; 7]; asked.len()];
            let got = pending.wait_into(&asked, &mut out).unwrap();
            for (&r, v) in order.iter().zip(&out) {
                let (i, at, len) = ranges[r];
                assert!(v == &m.expect[i][at..at + len], "{what}, over the bus {over_bus}: read {r}");
                assert_eq!(got.get(slots[r]), &v[..], "{what}: its view");
            }
        }
        assert!(model::with(|g| g.errors.is_empty()), "the model found illegal accesses");
    }
}

#[test]
fn a_write_in_place_refused_for_want_of_staging_poisons_the_batch_and_a_new_one_takes_writes_in_order() {
    let driver = model::driver();
    let d = Device::open_on_driver(std::sync::Arc::clone(&driver), 0, Config::default())
        .expect("the model opens");
    let mut rng = fastrand::Rng::with_seed(45);
    let target = d.allocate(1 << 20).unwrap();
    let other = d.allocate(4096).unwrap();
    // No pinned memory yet: the in-place write's lease needs a cuMemHostAlloc, which fails.
    driver.faults().record();
    driver
        .faults()
        .inject(cuda_sys::Fault::new("cuMemHostAlloc", 1, cuda_sys::CUDA_ERROR_OUT_OF_MEMORY).times(u64::MAX))
        .unwrap();
    let mut batch = d.uploads();
    let refused = batch.write_with(other, 0, 100, |dst| dst.fill(1)).unwrap_err();
    assert!(refused.to_string().contains("Fix:"), "{refused}");
    driver.faults().remove_faults();
    // The batch is poisoned: it takes no more writes and moves nothing.
    let e = batch.write(target, 0, &[1u8; 10]).map(drop).unwrap_err();
    assert!(matches!(e, Error::BatchPoisoned { write: 0, .. }), "{e}");
    assert!(batch.submit().is_err());
    // The caller goes on, in a new batch, with 200 small writes in order and apart, all from
    // slices.
    let mut batch = d.uploads();
    let data: Vec<_> = (0..200).map(|_| random_vec(&mut rng, 300)).collect();
    for (k, bytes) in data.iter().enumerate() {
        batch.write(target, k as u64 * 400, bytes).unwrap();
    }
    assert_eq!(batch.len(), 200);
    batch.submit().unwrap().wait().unwrap();
    let back = d.download(target).unwrap();
    for (k, bytes) in data.iter().enumerate() {
        assert_eq!(&back[k * 400..k * 400 + 300], &bytes[..], "write {k}");
    }
    assert!(model::with(|g| g.errors.is_empty()), "the model found illegal accesses");
}

#[test]
fn later_batches_reuse_what_earlier_ones_resolved_until_a_buffer_is_freed() {
    let d = device(Config::default());
    let mut rng = fastrand::Rng::with_seed(35);
    let mut m = Model::new(&d, &mut rng, &[5000, 6000, 7000]);
    let hits = || crate::engine::table::KEPT_HITS.with(|n| n.get());
    let round = |m: &mut Model, rng: &mut fastrand::Rng, which: &[usize]| {
        let mut batch = d.uploads();
        let data: Vec<_> = which.iter().map(|&i| (i, random_vec(rng, 100))).collect();
        for (i, bytes) in &data {
            batch.write(m.buffers[*i], 10, bytes).unwrap();
            m.expect[*i][10..110].copy_from_slice(bytes);
        }
        batch.submit().unwrap().wait().unwrap();
    };
    round(&mut m, &mut rng, &[0, 1, 2]);
    let before = hits();
    round(&mut m, &mut rng, &[2, 0, 1]);
    assert_eq!(hits(), before + 3, "the second batch resolved nothing again");
    m.check(&d, "batches from kept resolutions");
    // A free in the buffers' shard (all of them, `extra` too, are this thread's) invalidates
    // what was kept: the next batch resolves afresh, and a freed handle fails where it is named.
    let extra = d.allocate(64).unwrap();
    round(&mut m, &mut rng, &[0, 1, 2]);
    d.free(extra).unwrap();
    let gone = m.buffers.remove(1);
    m.expect.remove(1);
    d.free(gone).unwrap();
    let before = hits();
    let mut batch = d.uploads();
    let err = batch.write(gone, 0, &[1, 2, 3]).unwrap_err();
    assert!(matches!(err, Error::FreedBuffer { .. }), "{err}");
    drop(batch);
    round(&mut m, &mut rng, &[0, 1]);
    assert_eq!(hits(), before, "nothing was taken from before the frees");
    m.check(&d, "after frees");
}

#[test]
fn tiny_touching_requests_in_order_are_fused_by_the_planner_within_a_small_pinned_pool() {
    // The smallest pool the configuration allows: two chunks.
    let d = device(Config {
        chunk_bytes: 64 << 10,
        direct_threshold: 8 << 10,
        pinned_cap_bytes: 128 << 10,
        ..Config::default()
    });
    let mut rng = fastrand::Rng::with_seed(36);
    let mut m = Model::new(&d, &mut rng, &[64 << 10]);
    // 16384 writes of 4 bytes, each touching the last: one descriptor and a padded slot
    // each would need far more staging than the pool holds; fused, they are 64 KiB.
    let data = random_vec(&mut rng, 64 << 10);
    let mut batch = d.uploads();
    for (k, word) in data.chunks(4).enumerate() {
        batch.write(m.buffers[0], k as u64 * 4, word).unwrap();
    }
    assert_eq!(batch.route(), Route::Planned, "the upload batch was planned");
    batch.submit().unwrap().wait().unwrap();
    m.expect[0].copy_from_slice(&data);
    let mut batch = d.downloads();
    let slots: Vec<_> = (0..16384u64).map(|k| batch.read(m.buffers[0], k * 4, 4).unwrap()).collect();
    assert_eq!(batch.route(), Route::Planned, "the download batch was planned");
    let pending = batch.submit().unwrap();
    // Planned, then (the plan larger than the small pool lends) streamed in half chunks:
    // never moved in order.
    assert_eq!(pending.route, Route::Streamed, "the planned download streamed through the small pool");
    let got = pending.wait().unwrap();
    for (k, &slot) in slots.iter().enumerate() {
        assert_eq!(got.get(slot), &data[k * 4..k * 4 + 4]);
    }
    drop(got);
    m.check(&d, "tiny touching requests");
}

/// 4 KiB writes in order with gaps into one 4 MiB buffer, `count` of them: more than a
/// megabyte, so they are packed and copied out on the packing threads.
fn pipelined_ranges(count: usize) -> Vec<(usize, usize, usize)> {
    (0..count).map(|k| (0, k * 4200 + 3 + k % 5, 4096 - k % 7)).collect()
}

#[test]
fn large_batches_in_order_pack_and_copy_out_while_chunks_move() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(36);
    let mut m = Model::new(&d, &mut rng, &[4 << 20]);
    let runs = || crate::engine::pipeline::PARALLEL_RUNS.with(|n| n.get());
    let ranges = pipelined_ranges(900);
    let data: Vec<_> = ranges.iter().map(|&(_, _, len)| random_vec(&mut rng, len)).collect();
    let before = runs();
    let mut batch = d.uploads();
    for (&(i, at, _), bytes) in ranges.iter().zip(&data) {
        batch.write(m.buffers[i], at as u64, bytes).unwrap();
        m.expect[i][at..at + bytes.len()].copy_from_slice(bytes);
    }
    batch.submit().unwrap().wait().unwrap();
    assert_eq!(runs(), before + 1, "the upload ran on the packing threads");
    m.check(&d, "a pipelined upload");
    let (reads, slots) = m.reads(&d, &ranges);
    let mut out = vec![vec![0x5a; 5]; slots.len()];
    let got = reads.submit().unwrap().wait_into(&slots, &mut out).unwrap();
    assert_eq!(runs(), before + 2, "the copy-out ran on the packing threads");
    for ((&(i, at, len), v), &slot) in ranges.iter().zip(&out).zip(&slots) {
        assert_eq!(v, &m.expect[i][at..at + len]);
        assert_eq!(got.get(slot), &m.expect[i][at..at + len]);
    }
    drop(got);
    d.synchronize().unwrap();
    assert_eq!(d.telemetry().pinned.lent_bytes, 0);
}

#[test]
fn a_fault_in_the_middle_of_a_pipelined_batch_fails_it_and_the_next_batch_works() {
    // Over the bus each chunk is one launch; through device staging, a DMA and a launch.
    pipelined_fault(true, "cuLaunchKernel");
    pipelined_fault(false, "cuMemcpyHtoDAsync_v2");
}

fn pipelined_fault(over_bus: bool, chunk_call: &'static str) {
    use cuda_sys::{CUDA_ERROR_LAUNCH_FAILED, Fault};
    let driver = model::driver();
    let config = Config { small_copies_over_bus: over_bus, ..small_chunks() };
    let d = Device::open_on_driver(driver.clone(), 0, config).expect("the model opens");
    let mut rng = fastrand::Rng::with_seed(37);
    let mut m = Model::new(&d, &mut rng, &[4 << 20]);
    let ranges = pipelined_ranges(900);
    let data: Vec<_> = ranges.iter().map(|&(_, _, len)| random_vec(&mut rng, len)).collect();
    let upload = |m: &mut Model| {
        let mut batch = d.uploads();
        for (&(i, at, _), bytes) in ranges.iter().zip(&data) {
            batch.write(m.buffers[i], at as u64, bytes).unwrap();
        }
        batch.submit().and_then(|f| f.wait())
    };
    let fail = |entry: &'static str, nth: u64| {
        let faults = driver.faults();
        faults.clear();
        faults.inject(Fault { entry, nth, code: CUDA_ERROR_LAUNCH_FAILED, times: 1 }).unwrap();
    };
    // The tenth chunk's move, while the packing threads are still at work.
    fail(chunk_call, 10);
    let e = upload(&mut m).unwrap_err().to_string();
    assert!(e.contains(chunk_call.trim_end_matches("_v2")), "{e}");
    driver.faults().clear();
    d.synchronize().unwrap();
    assert_eq!(d.telemetry().pinned.lent_bytes, 0, "the failed batch returned its staging");
    upload(&mut m).unwrap();
    for (&(i, at, _), bytes) in ranges.iter().zip(&data) {
        m.expect[i][at..at + bytes.len()].copy_from_slice(bytes);
    }
    m.check(&d, "after a failed pipelined upload");
    // A wait that fails in the middle of the copy-out.
    let (reads, slots) = m.reads(&d, &ranges);
    let pending = reads.submit().unwrap();
    fail("cuEventSynchronize", 3);
    let mut out = vec![Vec::new(); slots.len()];
    let e = pending.wait_into(&slots, &mut out).unwrap_err().to_string();
    assert!(e.contains("cuEventSynchronize"), "{e}");
    driver.faults().clear();
    d.synchronize().unwrap();
    assert_eq!(d.telemetry().pinned.lent_bytes, 0, "the failed download returned its staging");
    m.check(&d, "after a failed copy-out");
}

#[test]
fn a_few_thousand_small_writes_or_reads_in_order_cost_a_few_launches_and_no_dma_over_the_bus() {
    // With the default configuration, 4096 reads of 256 bytes (a megabyte and their table)
    // stay one chunk; the writes move in chunks growing from 256 KiB (256 KiB, 512 KiB, the
    // rest: the first launch leaves while the rest is packed). The kernel reads and writes
    // pinned staging itself.
    let d = device(Config::default());
    assert!(d.moves_small_copies_over_bus());
    // What crosses the bus each way: 4096 descriptors and the payload, no padding.
    let moved = 4096 * (24 + 256);
    assert_eq!(few_thousand_in_order(&d), [(0, 3, moved), (0, 1, moved)]);
}

#[test]
fn through_device_staging_a_few_thousand_small_copies_cost_one_launch_and_a_dma_or_two() {
    // Chunks stay equal there (each costs a DMA too): an upload moves its lease in one DMA
    // and scatters; a download moves its table up, gathers, and moves the bytes down.
    let d = device(Config { small_copies_over_bus: false, ..Config::default() });
    assert_eq!(few_thousand_in_order(&d).map(|(dmas, launches, _)| (dmas, launches)), [(1, 1), (2, 1)]);
}

#[test]
fn without_unified_addressing_small_copies_go_through_device_staging() {
    // The model refuses a kernel that touches pinned memory here: the default configuration
    // must fall back to DMAs.
    model::with(|g| g.no_unified_addressing = true);
    let d = device(Config::default());
    assert!(!d.info().unified_addressing && !d.moves_small_copies_over_bus());
    assert!(d.config().dma_batches && !d.moves_dmas_in_batches());
    let counts = few_thousand_in_order(&d);
    model::with(|g| g.no_unified_addressing = false);
    assert_eq!(counts.map(|(dmas, launches, _)| (dmas, launches)), [(1, 1), (2, 1)]);
}

/// 4096 writes of 256 bytes in order, at odd offsets with gaps, then reads of them, each
/// batch checked byte for byte; the DMAs, launches and bytes moved of each (writes, then
/// reads).
fn few_thousand_in_order(d: &Device) -> [(u64, u64, u64); 2] {
    let mut rng = fastrand::Rng::with_seed(38);
    let mut m = Model::new(d, &mut rng, &[4096 * 512]);
    let data: Vec<_> = (0..4096).map(|_| random_vec(&mut rng, 256)).collect();
    let counts = |before: &crate::TelemetrySnapshot, after: &crate::TelemetrySnapshot| {
        (
            after.dma_copies - before.dma_copies,
            after.kernel_launches - before.kernel_launches,
            after.bytes_moved - before.bytes_moved,
        )
    };
    let before = d.telemetry();
    let mut batch = d.uploads();
    for (k, bytes) in data.iter().enumerate() {
        batch.write(m.buffers[0], k as u64 * 512 + 3, bytes).unwrap();
        m.expect[0][k * 512 + 3..][..256].copy_from_slice(bytes);
    }
    batch.submit().unwrap().wait().unwrap();
    let writes = counts(&before, &d.telemetry());
    m.check(d, "4096 small writes");
    let mut reads = d.downloads();
    let slots: Vec<_> = (0..4096).map(|k| reads.read(m.buffers[0], k * 512 + 3, 256).unwrap()).collect();
    let before = d.telemetry();
    let got = reads.submit().unwrap().wait().unwrap();
    let reads = counts(&before, &d.telemetry());
    for (k, &slot) in slots.iter().enumerate() {
        assert_eq!(got.get(slot), &m.expect[0][k * 512 + 3..][..256]);
    }
    assert!(model::with(|g| g.errors.is_empty()), "the model found illegal accesses");
    [writes, reads]
}

#[test]
fn large_downloads_and_pipelined_uploads_fit_a_pinned_pool_of_two_chunks() {
    // Room for two chunks only: chunks opened ahead take what is free and wait their turn,
    // never failing for staging that the batch itself holds.
    let d = device(Config { chunk_bytes: 1 << 20, pinned_cap_bytes: 2 << 20, ..Config::default() });
    let mut rng = fastrand::Rng::with_seed(39);
    let mut m = Model::new(&d, &mut rng, &[6 << 20]);
    let mut batch = d.uploads();
    let data: Vec<_> = (0..1200).map(|_| random_vec(&mut rng, 4000)).collect();
    for (k, bytes) in data.iter().enumerate() {
        batch.write(m.buffers[0], k as u64 * 4100 + 1, bytes).unwrap();
        m.expect[0][k * 4100 + 1..][..4000].copy_from_slice(bytes);
    }
    batch.submit().unwrap().wait().unwrap();
    // A download past four chunks moves through the ring too (a download batch would need
    // the whole buffer in staging at once).
    assert!(
        d.download(m.buffers[0]).unwrap() == m.expect[0],
        "a pipelined upload through two chunks of staging"
    );
}

#[test]
fn a_large_download_takes_the_staging_left_when_the_caller_holds_some() {
    // Four chunks of room, one of them held by the caller's download: the download's ring
    // takes the three left instead of failing.
    let d = device(Config { chunk_bytes: 1 << 20, pinned_cap_bytes: 4 << 20, ..Config::default() });
    let mut rng = fastrand::Rng::with_seed(40);
    let m = Model::new(&d, &mut rng, &[8 << 20, 100]);
    let mut reads = d.downloads();
    let slot = reads.read_buffer(m.buffers[1]).unwrap();
    let held = reads.submit().unwrap().wait().unwrap();
    assert!(d.download(m.buffers[0]).unwrap() == m.expect[0], "the download's bytes");
    assert_eq!(held.get(slot), &m.expect[1][..]);
}

#[test]
fn a_download_copies_every_read_into_vectors_after_the_wait() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(41);
    let m = Model::new(&d, &mut rng, &[300_000, 70_000, 4099]);
    // Ragged reads, in order and not, some over a megabyte in all: one thread and several.
    for count in [5, 400] {
        let ranges: Vec<_> = (0..count).map(|_| m.range(&mut rng, 20_000)).collect();
        let (reads, slots) = m.reads(&d, &ranges);
        let done = reads.submit().unwrap().wait().unwrap();
        let mut out = vec![vec![0x5a; 9]; count];
        done.copy_all_into(&slots, &mut out).unwrap();
        for (&(i, at, len), v) in ranges.iter().zip(&out) {
            assert_eq!(v, &m.expect[i][at..at + len]);
        }
        let e = done.copy_all_into(&slots, &mut out[1..]).unwrap_err().to_string();
        assert!(e.contains("Fix:"), "{e}");
    }
}

//! Peer copies and fan-out on the two-GPU model driver (`testing::model`): the model carries
//! work out only when the host waits, stream by stream, following cross-stream waits, and a
//! kernel of one device touching another's memory without peer access is an illegal
//! access. So a missing wait between the devices shows as wrong bytes, and a direct path
//! taken without access as an error. No GPU needed: these run in CI.

use super::PeerBatch;
use crate::plan::route::Route;
use crate::testing::model::{self, with};
use crate::testing::{Model, random_vec};
use crate::{Config, Device, DeviceSet, Error, FanOutPath, ResidentBuffer};

fn config() -> Config {
    Config {
        chunk_bytes: 64 << 10,
        direct_threshold: 8 << 10,
        pinned_cap_bytes: 64 << 20,
        ..Config::default()
    }
}

/// Devices 0 and 1 of one model driver.
fn pair() -> (Device, Device) {
    let driver = model::driver();
    let d0 = Device::open_on_driver(std::sync::Arc::clone(&driver), 0, config()).unwrap();
    let d1 = Device::open_on_driver(driver, 1, config()).unwrap();
    (d0, d1)
}

/// Random batches of copies from `src` into `dst` (overlapping, touching, in any order, a
/// few large enough for their own DMA), checked against the byte model after each.
fn ragged(src: &Device, dst: &Device, from: &Model, to: &mut Model, rng: &mut fastrand::Rng, what: &str) {
    for round in 0..6 {
        let mut batch: PeerBatch<'_> = dst.peer_copies(src);
        for _ in 0..rng.usize(1..200) {
            let (si, so, len) = from.range(rng, 5000);
            let (di, doff, dlen) = to.range(rng, len);
            let len = len.min(dlen).min(to.expect[di].len() - doff);
            let (s, d) = (from.buffers[si], to.buffers[di]);
            if round % 3 == 1 {
                batch.copy_ranges(s, d, &[(so as u64, doff as u64, len as u64)]).unwrap();
            } else {
                batch.copy(s, so as u64, d, doff as u64, len as u64).unwrap();
            }
            let bytes = from.expect[si][so..so + len].to_vec();
            to.expect[di][doff..doff + len].copy_from_slice(&bytes);
        }
        if round % 2 == 0 {
            // Whole large buffers: one DMA each.
            let big = from.expect.iter().position(|v| v.len() >= super::copy::PEER_DMA_MIN as usize).unwrap();
            let dbig = to.expect.iter().position(|v| v.len() >= from.expect[big].len()).unwrap();
            let n = from.expect[big].len();
            batch.copy(from.buffers[big], 0, to.buffers[dbig], 0, n as u64).unwrap();
            let bytes = from.expect[big].clone();
            to.expect[dbig][..n].copy_from_slice(&bytes);
        }
        batch.submit().unwrap().wait().unwrap();
        to.check(dst, &format!("{what}, round {round}"));
    }
}

const SIZES: [usize; 5] = [1, 300, 4096, 70_000, 5 << 20];

#[test]
fn ragged_peer_batches_match_the_byte_model_with_peer_access() {
    let (d0, d1) = pair();
    d0.enable_peer(&d1).unwrap();
    assert!(d0.is_peer_enabled(&d1) && d1.is_peer_enabled(&d0));
    let mut rng = fastrand::Rng::with_seed(7);
    let mut a = Model::new(&d0, &mut rng, &SIZES);
    let mut b = Model::new(&d1, &mut rng, &SIZES);
    let before = d1.telemetry();
    ragged(&d0, &d1, &a, &mut b, &mut rng, "0 -> 1");
    let after = d1.telemetry();
    assert!(after.kernel_launches > before.kernel_launches, "small copies by the kernel");
    assert!(after.peer_bytes > before.peer_bytes);
    ragged(&d1, &d0, &b, &mut a, &mut rng, "1 -> 0");
    a.check(&d0, "device 0 at the end");
}

#[test]
fn without_unified_addressing_the_descriptor_table_is_uploaded_before_the_kernel() {
    let driver = model::driver();
    with(|g| g.no_unified_addressing = true);
    let d0 = Device::open_on_driver(std::sync::Arc::clone(&driver), 0, config()).unwrap();
    let d1 = Device::open_on_driver(driver, 1, config()).unwrap();
    assert!(!d1.info().unified_addressing);
    d0.enable_peer(&d1).unwrap();
    let mut rng = fastrand::Rng::with_seed(8);
    let a = Model::new(&d0, &mut rng, &SIZES);
    let mut b = Model::new(&d1, &mut rng, &SIZES);
    let before = d1.telemetry();
    // The model refuses a kernel reading its table in pinned memory here (`check` fails
    // on illegal accesses).
    ragged(&d0, &d1, &a, &mut b, &mut rng, "0 -> 1, no unified addressing");
    let after = d1.telemetry();
    assert!(after.kernel_launches > before.kernel_launches, "small copies by the kernel");
    with(|g| g.no_unified_addressing = false);
}

#[test]
fn copies_inside_one_device_match_the_byte_model() {
    let (d0, _d1) = pair();
    let mut rng = fastrand::Rng::with_seed(8);
    let a = Model::new(&d0, &mut rng, &SIZES);
    let mut b = Model::new(&d0, &mut rng, &SIZES);
    ragged(&d0, &d0, &a, &mut b, &mut rng, "inside device 0");
    a.check(&d0, "sources unchanged");
}

#[test]
fn without_peer_access_copies_stage_through_the_host_and_match() {
    let (d0, d1) = pair();
    assert!(!d1.is_peer_enabled(&d0));
    let mut rng = fastrand::Rng::with_seed(9);
    let a = Model::new(&d0, &mut rng, &SIZES);
    let mut b = Model::new(&d1, &mut rng, &SIZES);
    let downloads = d0.telemetry().download_submissions;
    ragged(&d0, &d1, &a, &mut b, &mut rng, "staged 0 -> 1");
    // The kernel never read device 0's memory (the model would have flagged it); the copies
    // went through downloads on device 0 and uploads on device 1.
    assert_eq!(d1.telemetry().peer_bytes, 0);
    assert!(d0.telemetry().download_submissions > downloads, "read back on the source");
}

#[test]
fn a_pair_without_a_peer_path_says_so_and_still_copies() {
    let (d0, d1) = pair();
    with(|g| g.no_peer_path = true);
    assert!(!d0.can_access_peer(&d1).unwrap());
    let err = d0.enable_peer(&d1).unwrap_err();
    assert!(matches!(err, Error::PeerUnsupported { device: 0, peer: 1 }), "{err}");
    assert!(err.to_string().contains("Fix: "));
    let set = DeviceSet::from_devices(vec![d0.clone(), d1.clone()]);
    assert_eq!(set.enable_all_peers().unwrap(), 0);
    let mut rng = fastrand::Rng::with_seed(10);
    let a = Model::new(&d0, &mut rng, &[4096]);
    let mut b = Model::new(&d1, &mut rng, &[4096]);
    let mut batch = d1.peer_copies(&d0);
    batch.copy(a.buffers[0], 10, b.buffers[0], 20, 1000).unwrap();
    batch.submit().unwrap().wait().unwrap();
    b.expect[0][20..1020].copy_from_slice(&a.expect[0][10..1010]);
    b.check(&d1, "staged");
}

#[test]
fn enabling_peer_access_twice_is_harmless_and_a_device_is_its_own_peer() {
    let (d0, d1) = pair();
    assert!(d0.can_access_peer(&d1).unwrap() && d0.can_access_peer(&d0).unwrap());
    d0.enable_peer(&d1).unwrap();
    d1.enable_peer(&d0).unwrap();
    d0.enable_peer(&d0).unwrap();
    assert!(d0.is_peer_enabled(&d0));
    let set = DeviceSet::from_devices(vec![d0, d1]);
    assert_eq!(set.enable_all_peers().unwrap(), 1);
}

#[test]
fn copies_order_after_uploads_into_the_source_and_before_later_ones_without_host_waits() {
    let (d0, d1) = pair();
    d0.enable_peer(&d1).unwrap();
    let mut rng = fastrand::Rng::with_seed(11);
    let src = d0.allocate(1 << 16).unwrap();
    let dst = d1.allocate(1 << 16).unwrap();
    let first = random_vec(&mut rng, 1 << 16);
    let second = random_vec(&mut rng, 1 << 16);
    // Upload (not waited for), copy, overwrite the source (not waited for): the copy sees
    // exactly the first upload.
    let mut up = d0.uploads();
    up.write(src, 0, &first).unwrap();
    let _pending = up.submit().unwrap();
    let mut batch = d1.peer_copies(&d0);
    for i in 0..64u64 {
        batch.copy(src, i * 1024, dst, (63 - i) * 1024, 1024).unwrap();
    }
    let copied = batch.submit().unwrap();
    let mut up = d0.uploads();
    up.write(src, 0, &second).unwrap();
    let overwritten = up.submit().unwrap();
    // Freeing the source right away is deferred until the copy has read it.
    d0.free(src).unwrap();
    // The host waits for the overwrite first: the model then carries out the device 0 work
    // it depends on, which must include the copy.
    overwritten.wait().unwrap();
    copied.wait().unwrap();
    let got = d1.download(dst).unwrap();
    for i in 0..64 {
        let want = &first[i * 1024..(i + 1) * 1024];
        assert!(&got[(63 - i) * 1024..(64 - i) * 1024] == want, "block {i}");
    }
    assert!(with(|g| g.errors.is_empty()));
}

#[test]
fn a_copy_into_a_buffer_waits_for_downloads_of_it_on_the_destination() {
    let (d0, d1) = pair();
    d0.enable_peer(&d1).unwrap();
    let mut rng = fastrand::Rng::with_seed(12);
    let (old, new) = (random_vec(&mut rng, 8192), random_vec(&mut rng, 8192));
    let src = d0.allocate(8192).unwrap();
    let dst = d1.allocate(8192).unwrap();
    d0.upload(src, &new).unwrap();
    d1.upload(dst, &old).unwrap();
    let mut reads = d1.downloads();
    let slot = reads.read(dst, 0, 8192).unwrap();
    let pending = reads.submit().unwrap();
    let mut batch = d1.peer_copies(&d0);
    batch.copy(src, 0, dst, 0, 8192).unwrap();
    let fence = batch.submit().unwrap();
    assert!(pending.wait().unwrap().get(slot) == &old[..], "the download saw the bytes before the copy");
    fence.wait().unwrap();
    assert!(d1.download(dst).unwrap() == new);
}

#[test]
fn bad_copies_fail_with_a_fix_and_move_nothing() {
    let (d0, d1) = pair();
    d0.enable_peer(&d1).unwrap();
    let mut rng = fastrand::Rng::with_seed(13);
    let a = Model::new(&d0, &mut rng, &[4096]);
    let b = Model::new(&d1, &mut rng, &[4096]);
    let freed = d0.allocate(4096).unwrap();
    d0.free(freed).unwrap();
    type Bad = fn(&mut PeerBatch<'_>, ResidentBuffer, ResidentBuffer, ResidentBuffer) -> crate::Result<()>;
    let cases: [(&str, Bad); 6] = [
        ("source of the destination device", |p, _, b, _| p.copy(b, 0, b, 0, 1).map(drop)),
        ("destination of the source device", |p, a, _, _| p.copy(a, 0, a, 0, 1).map(drop)),
        ("source out of range", |p, a, b, _| p.copy(a, 4000, b, 0, 100).map(drop)),
        ("destination out of range", |p, a, b, _| p.copy(a, 0, b, 4096, 1).map(drop)),
        ("overflowing offset", |p, a, b, _| p.copy(a, u64::MAX, b, 0, 2).map(drop)),
        ("freed source", |p, _, b, f| p.copy(f, 0, b, 0, 1).map(drop)),
    ];
    for (what, bad) in cases {
        let mut batch = d1.peer_copies(&d0);
        batch.copy(a.buffers[0], 0, b.buffers[0], 0, 4096).unwrap();
        let err = bad(&mut batch, a.buffers[0], b.buffers[0], freed).unwrap_err();
        assert!(err.to_string().contains("Fix: "), "{what}: {err}");
        let again = batch.submit().unwrap_err();
        assert_eq!(again.to_string(), err.to_string(), "{what}: submit fails with the first error");
        b.check(&d1, what);
    }
    // A buffer freed between adding and submitting: nothing moves.
    let gone = d0.allocate(4096).unwrap();
    let mut batch = d1.peer_copies(&d0);
    batch.copy(a.buffers[0], 0, b.buffers[0], 0, 4096).unwrap();
    batch.copy(gone, 0, b.buffers[0], 0, 10).unwrap();
    d0.free(gone).unwrap();
    assert!(matches!(batch.submit(), Err(Error::FreedBuffer { .. })));
    b.check(&d1, "freed before submit");
    assert!(d1.peer_copies(&d0).submit().unwrap().is_complete().unwrap(), "an empty batch");
}

#[test]
fn fan_out_writes_every_target_by_either_path() {
    let (d0, d1) = pair();
    d0.enable_peer(&d1).unwrap();
    let set = DeviceSet::from_devices(vec![d0.clone(), d1.clone()]);
    let mut rng = fastrand::Rng::with_seed(14);
    // Larger than a staging chunk (64 KiB here) times the ring: pipelined.
    for len in [1usize, 1000, 300_000, (1 << 20) + 3] {
        for path in [FanOutPath::EachLink, FanOutPath::FirstThenPeers] {
            let data = random_vec(&mut rng, len);
            let n = (len + 100) as u64;
            let targets =
                [(1, d1.allocate(n).unwrap()), (0, d0.allocate(n).unwrap()), (0, d0.allocate(n).unwrap())];
            for &(i, b) in &targets {
                set.get(i).unwrap().upload(b, &vec![0xA5; n as usize]).unwrap();
            }
            let fences = set.fan_out_via(path, &data, &targets, 7).unwrap();
            assert_eq!(fences.len(), 3);
            for f in &fences {
                f.wait().unwrap();
            }
            for &(i, b) in &targets {
                let got = set.get(i).unwrap().download(b).unwrap();
                assert!(got[7..7 + len] == data[..], "{path:?}, {len} bytes, device {i}");
                assert!(
                    got[..7].iter().chain(&got[7 + len..]).all(|&x| x == 0xA5),
                    "{path:?}: outside untouched"
                );
            }
        }
    }
    assert!(with(|g| g.errors.is_empty()));
}

#[test]
fn fan_out_first_then_peers_writes_a_target_named_again_through_another_handle_once() {
    let (d0, _d1) = pair();
    // Two handles of one device: the second target is the first one again.
    let set = DeviceSet::from_devices(vec![d0.clone(), d0.clone()]);
    let b = d0.allocate(4096).unwrap();
    let mut rng = fastrand::Rng::with_seed(15);
    let data = random_vec(&mut rng, 1000);
    let before = d0.telemetry();
    let fences = set.fan_out_via(FanOutPath::FirstThenPeers, &data, &[(0, b), (1, b)], 5).unwrap();
    assert_eq!(fences.len(), 2);
    for f in &fences {
        f.wait().unwrap();
    }
    let after = d0.telemetry();
    assert_eq!(after.upload_submissions - before.upload_submissions, 1, "one upload");
    assert_eq!(after.download_submissions, before.download_submissions, "no copy onto itself");
    assert_eq!(after.peer_bytes, before.peer_bytes, "no copy onto itself");
    assert_eq!(d0.download_range(b, 5, 1000).unwrap(), data);
    assert!(with(|g| g.errors.is_empty()));
}

#[test]
fn fan_out_checks_every_target_before_moving_anything() {
    let (d0, d1) = pair();
    let set = DeviceSet::from_devices(vec![d0.clone(), d1.clone()]);
    let b0 = d0.allocate(100).unwrap();
    let b1 = d1.allocate(100).unwrap();
    d0.upload(b0, &[1; 100]).unwrap();
    let data = [9u8; 50];
    let err = set.fan_out(&data, &[(0, b0), (2, b1)], 0).unwrap_err();
    assert!(matches!(err, Error::NotInSet { index: 2, len: 2 }), "{err}");
    let err = set.fan_out(&data, &[(0, b0), (1, b1)], 60).unwrap_err();
    assert!(matches!(err, Error::OutOfRange { .. }), "{err}");
    let err = set.fan_out(&data, &[(0, b0), (0, b1)], 0).unwrap_err();
    assert!(matches!(err, Error::ForeignBuffer { .. }), "{err}");
    assert_eq!(d0.download(b0).unwrap(), vec![1; 100], "nothing written");
    assert!(set.get(5).unwrap_err().to_string().contains("Fix: "));
    assert!(DeviceSet::from_devices(Vec::new()).is_empty());
}

#[test]
fn block_tables_in_order_take_the_fast_path_and_match() {
    let (d0, d1) = pair();
    d0.enable_peer(&d1).unwrap();
    let mut rng = fastrand::Rng::with_seed(15);
    let a = Model::new(&d0, &mut rng, &[1 << 20, 1 << 20]);
    let mut b = Model::new(&d1, &mut rng, &[1 << 20, 1 << 20]);
    // Blocks of 4 KiB in a shuffled source order into ascending destination slots, two
    // buffer pairs interleaved: in order per destination, so built as they are added.
    let mut batch = d1.peer_copies(&d0);
    for pair in 0..2 {
        let mut blocks: Vec<u64> = (0..256).collect();
        rng.shuffle(&mut blocks);
        let ranges: Vec<(u64, u64, u64)> =
            blocks.iter().enumerate().map(|(slot, &blk)| (blk * 4096, slot as u64 * 4096, 4096)).collect();
        batch.copy_ranges(a.buffers[pair], b.buffers[pair], &ranges).unwrap();
        for &(so, doff, len) in &ranges {
            let (so, doff, len) = (so as usize, doff as usize, len as usize);
            b.expect[pair][doff..doff + len].copy_from_slice(&a.expect[pair][so..so + len]);
        }
    }
    assert_eq!(batch.route(), Route::InOrder);
    assert_eq!(batch.len(), 512);
    batch.submit().unwrap().wait().unwrap();
    b.check(&d1, "block tables");
    // A bad range in a table fails it, and the batch.
    let mut batch = d1.peer_copies(&d0);
    // In order, so that only the bounds refuse it.
    let table = [(0, 0, 16), ((1 << 20) - 8, 32, 16)];
    let err = batch.copy_ranges(a.buffers[0], b.buffers[0], &table).unwrap_err();
    assert!(matches!(err, Error::OutOfRange { offset, .. } if offset == (1 << 20) - 8), "{err}");
    assert!(batch.submit().is_err());
    b.check(&d1, "after the bad table");
    let mut batch = d1.peer_copies(&d0);
    let table = [(0, 0, 16), (0, 16, 16), (100, (1 << 20) - 8, 16)];
    let err = batch.copy_ranges(a.buffers[0], b.buffers[0], &table).unwrap_err();
    assert!(matches!(err, Error::OutOfRange { offset, .. } if offset == (1 << 20) - 8), "{err}");
    let mut batch = d1.peer_copies(&d0);
    let table = [(0, 0, 16), (64, (1 << 20) - 8, 16)];
    let err = batch.copy_ranges(a.buffers[0], b.buffers[0], &table).unwrap_err();
    assert!(matches!(err, Error::OutOfRange { buffer, .. } if buffer == b.buffers[0]), "{err}");
    // Overlapping ranges inside one table: later ones win.
    let mut batch = d1.peer_copies(&d0);
    let table = [(0, 100, 50), (1000, 120, 50), (5000, 4000, 20000), (30_000, 4000, 10)];
    batch.copy_ranges(a.buffers[1], b.buffers[1], &table).unwrap();
    for (so, d, len) in table {
        let (so, d, len) = (so as usize, d as usize, len as usize);
        b.expect[1][d..d + len].copy_from_slice(&a.expect[1][so..so + len]);
    }
    batch.submit().unwrap().wait().unwrap();
    b.check(&d1, "overlapping ranges in one table");
}

#[test]
fn small_pinned_pools_still_serve_fan_out_and_staged_copies() {
    let driver = model::driver();
    // The smallest pool the config allows: two chunks.
    let small = Config { chunk_bytes: 64 << 10, pinned_cap_bytes: 128 << 10, ..config() };
    let d0 = Device::open_on_driver(std::sync::Arc::clone(&driver), 0, small).unwrap();
    let d1 = Device::open_on_driver(driver, 1, config()).unwrap();
    let set = DeviceSet::from_devices(vec![d0.clone(), d1.clone()]);
    let mut rng = fastrand::Rng::with_seed(16);
    let data = random_vec(&mut rng, 4 * (64 << 10) + 5);
    let targets = [(0, d0.allocate(1 << 20).unwrap()), (1, d1.allocate(1 << 20).unwrap())];
    for round in 0..3 {
        for f in set.fan_out(&data, &targets, 3).unwrap() {
            f.wait().unwrap();
        }
        for &(i, b) in &targets {
            // Read back in pieces that fit device 0's small pool.
            for (k, want) in data.chunks(32 << 10).enumerate() {
                let at = 3 + (k * (32 << 10)) as u64;
                let got = set.get(i).unwrap().download_range(b, at, want.len() as u64).unwrap();
                assert!(got == want, "round {round}, device {i}, piece {k}");
            }
        }
    }
    // Only the first fence waited for: the first target's pool has its staging back.
    let fences = set.fan_out(&data, &targets, 3).unwrap();
    fences[0].wait().unwrap();
    d0.upload_at(targets[0].1, 0, &data[..1000]).unwrap();
    drop(d0.core().acquire_staging(64 << 10).unwrap());
    fences[1].wait().unwrap();
    // Many tiny staged copies: their descriptors count against the small pool too.
    let src = d0.allocate(1 << 20).unwrap();
    let dst = d1.allocate(1 << 20).unwrap();
    let bytes = random_vec(&mut rng, 1 << 17);
    d0.upload_at(src, 0, &bytes).unwrap();
    let mut batch = d1.peer_copies(&d0);
    for i in 0..4000u64 {
        batch.copy(src, i * 32, dst, i * 32, 16).unwrap();
    }
    batch.submit().unwrap().wait().unwrap();
    let got = d1.download_range(dst, 0, 4000 * 32).unwrap();
    for i in 0..4000usize {
        assert!(got[i * 32..i * 32 + 16] == bytes[i * 32..i * 32 + 16], "tiny copy {i}");
    }
    // Staged copies out of the small pool (no peer access): groups fit in it.
    let src = d0.allocate(1 << 20).unwrap();
    let bytes = random_vec(&mut rng, 1 << 20);
    d0.upload(src, &bytes).unwrap();
    let dst = d1.allocate(1 << 20).unwrap();
    let mut batch = d1.peer_copies(&d0);
    batch.copy(src, 0, dst, 0, 1 << 20).unwrap();
    batch.submit().unwrap().wait().unwrap();
    assert!(d1.download(dst).unwrap() == bytes);
}

#[test]
fn a_batch_that_turns_out_of_order_keeps_the_copies_before_it() {
    // Large copies (by DMA) and small ones in order, then one overlapping them: the copies
    // built on the in-order path are listed again and resolved with the rest. With and
    // without peer access.
    for peer in [true, false] {
        let (d0, d1) = pair();
        if peer {
            d0.enable_peer(&d1).unwrap();
        }
        let mut rng = fastrand::Rng::with_seed(17);
        let a = Model::new(&d0, &mut rng, &[6 << 20, 4096]);
        let mut b = Model::new(&d1, &mut rng, &[6 << 20, 4096]);
        let mut batch = d1.peer_copies(&d0);
        let copy = |batch: &mut PeerBatch<'_>,
                    b: &mut Model,
                    (si, so): (usize, usize),
                    (di, doff): (usize, usize),
                    len| {
            batch.copy(a.buffers[si], so as u64, b.buffers[di], doff as u64, len as u64).unwrap();
            b.expect[di][doff..doff + len].copy_from_slice(&a.expect[si][so..so + len]);
        };
        copy(&mut batch, &mut b, (0, 1), (0, 0), 5 << 20); // one DMA
        copy(&mut batch, &mut b, (1, 0), (1, 0), 100); // small, other buffer
        copy(&mut batch, &mut b, (1, 7), (0, (5 << 20) + 10), 3000); // small, after the DMA's range
        assert_eq!(batch.route(), Route::InOrder);
        copy(&mut batch, &mut b, (1, 100), (0, 12345), 2000); // inside the DMA's range: later wins
        copy(&mut batch, &mut b, (0, 9), (1, 50), 60); // overlaps the second copy
        assert_eq!(batch.route(), Route::Planned);
        assert_eq!(batch.len(), 5);
        batch.submit().unwrap().wait().unwrap();
        b.check(&d1, if peer { "with peer access" } else { "staged" });
    }
}

#[test]
fn telemetry_counts_what_landed_and_empty_batches_still_check_their_buffers() {
    let (d0, d1) = pair();
    d0.enable_peer(&d1).unwrap();
    let src = d0.allocate(4096).unwrap();
    let dst = d1.allocate(4096).unwrap();
    let before = d1.telemetry();
    let mut batch = d1.peer_copies(&d0);
    for _ in 0..10 {
        batch.copy(src, 0, dst, 0, 1000).unwrap(); // the same range ten times: 1000 bytes land
    }
    batch.submit().unwrap().wait().unwrap();
    let after = d1.telemetry();
    assert_eq!(after.peer_bytes - before.peer_bytes, 1000);
    assert_eq!(after.bytes_requested - before.bytes_requested, 10_000);
    assert!(after.bytes_moved - before.bytes_moved < 1100, "landed bytes plus one descriptor");
    // A batch of zero-length copies moves nothing, but a buffer freed since fails it.
    let gone = d0.allocate(64).unwrap();
    let mut batch = d1.peer_copies(&d0);
    batch.copy(gone, 0, dst, 0, 0).unwrap();
    d0.free(gone).unwrap();
    assert!(matches!(batch.submit(), Err(Error::FreedBuffer { .. })));
    let mut batch = d1.peer_copies(&d0);
    batch.copy(src, 4096, dst, 4096, 0).unwrap().copy_ranges(src, dst, &[]).unwrap();
    assert!(batch.submit().unwrap().is_complete().unwrap());
}

#[test]
fn descriptor_tables_live_in_pinned_staging_or_on_the_heap_only_while_a_batch_needs_them() {
    let driver = model::driver();
    let small = Config { chunk_bytes: 64 << 10, pinned_cap_bytes: 1 << 20, ..config() };
    let d0 = Device::open_on_driver(std::sync::Arc::clone(&driver), 0, small.clone()).unwrap();
    let d1 = Device::open_on_driver(driver, 1, small).unwrap();
    d0.enable_peer(&d1).unwrap();
    let mut rng = fastrand::Rng::with_seed(21);
    let a = Model::new(&d0, &mut rng, &[1 << 20]);
    let mut b = Model::new(&d1, &mut rng, &[1 << 20]);
    let lent = |d: &Device| d.telemetry().pinned.lent_bytes;
    // Descriptors are written into the destination's pinned pool as copies are added, and
    // the table goes with the submission: nothing stays lent once the copies are done.
    let mut batch = d1.peer_copies(&d0);
    let ranges: Vec<(u64, u64, u64)> = (0..2000u64).map(|i| ((1999 - i) * 500, i * 500, 300)).collect();
    batch.copy_ranges(a.buffers[0], b.buffers[0], &ranges).unwrap();
    for i in 0..10u64 {
        batch.copy(a.buffers[0], i, b.buffers[0], (1 << 20) - 100 + i * 10, 10).unwrap();
    }
    assert!(lent(&d1) >= 2010 * 24, "the table is in pinned staging");
    for &(so, doff, len) in &ranges {
        let (so, doff, len) = (so as usize, doff as usize, len as usize);
        b.expect[0][doff..doff + len].copy_from_slice(&a.expect[0][so..so + len]);
    }
    for i in 0..10usize {
        let doff = (1 << 20) - 100 + i * 10;
        b.expect[0][doff..doff + 10].copy_from_slice(&a.expect[0][i..i + 10]);
    }
    batch.submit().unwrap().wait().unwrap();
    b.check(&d1, "a table built in pinned staging");
    d1.synchronize().unwrap();
    assert_eq!(lent(&d1), 0, "the table went back to the pool");
    // A batch dropped unsubmitted gives its table back too.
    let mut batch = d1.peer_copies(&d0);
    batch.copy_ranges(a.buffers[0], b.buffers[0], &ranges).unwrap();
    drop(batch);
    assert_eq!(lent(&d1), 0, "a dropped batch's table went back");
    // A table of more than an eighth of the pool is built on the heap, holding no pinned
    // staging meanwhile, and uploaded from there to device staging at submit.
    let mut batch = d1.peer_copies(&d0);
    let ranges: Vec<(u64, u64, u64)> = (0..20_000u64).map(|i| (i * 50, i * 50 + 7, 20)).collect();
    for chunk in ranges.chunks(5000) {
        batch.copy_ranges(a.buffers[0], b.buffers[0], chunk).unwrap();
    }
    for i in 0..3000u64 {
        batch.copy(a.buffers[0], i * 7, b.buffers[0], 1_000_100 + i * 9, 5).unwrap();
    }
    assert!(lent(&d1) < (1 << 20) / 8, "no large table in the pool while building");
    for &(so, doff, len) in &ranges {
        let (so, doff, len) = (so as usize, doff as usize, len as usize);
        b.expect[0][doff..doff + len].copy_from_slice(&a.expect[0][so..so + len]);
    }
    for i in 0..3000usize {
        let doff = 1_000_100 + i * 9;
        b.expect[0][doff..doff + 5].copy_from_slice(&a.expect[0][i * 7..i * 7 + 5]);
    }
    batch.submit().unwrap().wait().unwrap();
    b.check(&d1, "a table built on the heap");
    d1.synchronize().unwrap();
    assert_eq!(lent(&d1), 0);
    // A table larger than the pool's cap takes none of it either: every copy lands.
    let mut batch = d1.peer_copies(&d0);
    let many: Vec<(u64, u64, u64)> = (0..60_000u64).map(|i| (i * 16, i * 16, 8)).collect();
    batch.copy_ranges(a.buffers[0], b.buffers[0], &many).unwrap();
    for &(so, doff, len) in &many {
        let (so, doff, len) = (so as usize, doff as usize, len as usize);
        b.expect[0][doff..doff + len].copy_from_slice(&a.expect[0][so..so + len]);
    }
    batch.submit().unwrap().wait().unwrap();
    b.check(&d1, "a table over the cap, from the heap");
    d1.synchronize().unwrap();
    assert_eq!(lent(&d1), 0);
}

/// `enable_peer` whose second direction the driver refuses: the first is taken back, so the
/// two devices agree (neither way enabled) and copies take the staged path; a retry enables
/// both.
#[test]
fn a_peer_enable_refused_one_way_is_taken_back_the_other() {
    use cuda_sys::{CUDA_ERROR_INVALID_VALUE, Fault};
    let driver = model::driver();
    let d0 = Device::open_on_driver(std::sync::Arc::clone(&driver), 0, config()).unwrap();
    let d1 = Device::open_on_driver(std::sync::Arc::clone(&driver), 1, config()).unwrap();
    driver.faults().inject(Fault::new("cuCtxEnablePeerAccess", 2, CUDA_ERROR_INVALID_VALUE)).unwrap();
    let e = d0.enable_peer(&d1).unwrap_err();
    driver.faults().clear();
    assert!(e.to_string().contains("cuCtxEnablePeerAccess") && e.to_string().contains("Fix: "), "{e}");
    assert_eq!((d0.is_peer_enabled(&d1), d1.is_peer_enabled(&d0)), (false, false), "half enabled");
    assert!(with(|g| g.peer_access.is_empty()), "the driver's access taken back too");
    d0.enable_peer(&d1).unwrap();
    assert_eq!((d0.is_peer_enabled(&d1), d1.is_peer_enabled(&d0)), (true, true));
}

/// An each-link fan-out whose submission on the second device fails after one of its two
/// copies was enqueued: that copy still reads the chunk's pinned staging, so the staging
/// goes back to the pool only after it (the failed device's lane is settled). Another
/// upload that then takes pinned staging never lands its bytes in the fan-out's target.
#[test]
fn a_fan_out_failing_part_way_keeps_its_staging_until_its_queued_copies_ran() {
    use cuda_sys::{CUDA_ERROR_INVALID_VALUE, Fault};
    let driver = model::driver();
    let d0 = Device::open_on_driver(std::sync::Arc::clone(&driver), 0, config()).unwrap();
    let d1 = Device::open_on_driver(std::sync::Arc::clone(&driver), 1, config()).unwrap();
    let set = DeviceSet::from_devices(vec![d0.clone(), d1.clone()]);
    let n = 64 << 10; // one chunk
    let a = d0.allocate(n as u64).unwrap();
    let (b1, b2) = (d1.allocate(n as u64).unwrap(), d1.allocate(n as u64).unwrap());
    let other = d0.allocate(n as u64).unwrap();
    let data = vec![0x11u8; n];
    // Devices submit in the order of their cores' addresses: the call that is d1's second copy.
    let d0_first =
        (std::sync::Arc::as_ptr(d0.core()) as usize) < (std::sync::Arc::as_ptr(d1.core()) as usize);
    let nth = if d0_first { 3 } else { 2 };
    driver.faults().inject(Fault::new("cuMemcpyHtoDAsync_v2", nth, CUDA_ERROR_INVALID_VALUE)).unwrap();
    let e = set.fan_out_via(FanOutPath::EachLink, &data, &[(0, a), (1, b1), (1, b2)], 0).unwrap_err();
    driver.faults().clear();
    assert!(e.to_string().contains("cuMemcpyHtoDAsync") && e.to_string().contains("Fix: "), "{e}");
    d0.upload_at(other, 0, &vec![0xEEu8; n]).unwrap();
    d1.synchronize().unwrap();
    let foreign = d1.download(b1).unwrap().iter().filter(|&&x| x == 0xEE).count();
    assert_eq!(foreign, 0, "the fan-out's target got bytes of a later upload through reused staging");
    assert!(with(|g| g.errors.is_empty()));
}

/// A batch of many small copies whose descriptor table outgrows what the pinned pool can
/// lend it (most of the cap held by a `PinnedBuffer`, or more descriptors than an eighth of
/// the cap): the table, built on the heap, is uploaded to device staging from there rather
/// than copied into one pinned lease, and every copy lands. Between two devices and inside
/// one, with and without unified addressing.
#[test]
fn a_peer_table_too_large_for_the_pinned_pool_is_uploaded_from_the_heap() {
    for (between, unified, hold) in
        [(false, true, true), (true, true, true), (false, true, false), (true, false, true)]
    {
        let small = Config { pinned_cap_bytes: 8 << 20, ..config() };
        let driver = model::driver();
        with(|g| g.no_unified_addressing = !unified);
        let d0 = Device::open_on_driver(std::sync::Arc::clone(&driver), 0, small.clone()).unwrap();
        let d1 = Device::open_on_driver(driver, 1, small).unwrap();
        let src_dev = if between { &d1 } else { &d0 };
        if between {
            d0.enable_peer(src_dev).unwrap();
        }
        // 7.5 MiB of the 8 MiB cap held: 512 KiB left, under the 30,000 copies' 720 KB of
        // descriptors; without it, 400,000 copies take 9.6 MB, past the cap itself.
        let n: u64 = if hold { 30_000 } else { 400_000 };
        let _held = hold.then(|| d0.pinned((15 << 20) / 2).unwrap());
        let mut rng = fastrand::Rng::with_seed(n + u64::from(between));
        let bytes = random_vec(&mut rng, (n * 32) as usize);
        let src = src_dev.allocate(n * 32).unwrap();
        src_dev.upload(src, &bytes).unwrap();
        let dst = d0.allocate(n * 32).unwrap();
        d0.upload(dst, &vec![0xA5; (n * 32) as usize]).unwrap();
        let mut batch = d0.peer_copies(src_dev);
        for i in 0..n {
            batch.copy(src, i * 32, dst, i * 32, 1 + i % 16).unwrap();
        }
        let case = format!("between devices {between}, unified {unified}, {n} copies");
        batch.submit().and_then(|f| f.wait()).unwrap_or_else(|e| panic!("{case}: {e}"));
        let got = d0.download(dst).unwrap();
        for i in 0..n as usize {
            let len = 1 + i % 16;
            assert!(got[i * 32..i * 32 + len] == bytes[i * 32..i * 32 + len], "{case}: copy {i}");
            assert!(got[i * 32 + len..(i + 1) * 32].iter().all(|&b| b == 0xA5), "{case}: past copy {i}");
        }
        assert!(with(|g| g.errors.is_empty()), "{case}");
        with(|g| g.no_unified_addressing = false);
    }
}

//! Misuse of the single copies and batches, on the model driver: ranges at and past every
//! edge (`u64::MAX` included), the 16 KiB edge of the small upload path from pageable and
//! pinned memory, stale, foreign and twice-freed handles, buffers freed while a batch is
//! built, panicking fills, dropped batches, and driver faults in a small upload.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use cuda_sys::{CUDA_ERROR_LAUNCH_FAILED, Fault};

use crate::testing::model;
use crate::transfer::single::DRIVER_STAGED_MOST;
use crate::{Config, Device, Error};

fn device(config: Config) -> (Arc<cuda_sys::Driver>, Device) {
    let driver = model::driver();
    let d = Device::open_on_driver(Arc::clone(&driver), 0, config).expect("the model opens");
    (driver, d)
}

fn has_fix(e: &Error) -> bool {
    let t = e.to_string();
    t.contains("Fix:")
}

#[test]
fn edges_of_ranges_are_errors_with_a_fix_and_move_nothing() {
    let (_driver, d) = device(Config::default());
    let n = 4096u64;
    let b = d.allocate(n).unwrap();
    d.upload(b, &[5u8; 4096]).unwrap();
    let one = [9u8; 1];
    let two = [9u8; 2];
    // upload_at
    for (off, data) in
        [(n + 1, &[][..]), (n, &one[..]), (n - 1, &two[..]), (u64::MAX, &one[..]), (u64::MAX, &[][..])]
    {
        let e = d.upload_at(b, off, data).unwrap_err();
        assert!(matches!(e, Error::OutOfRange { .. }) && has_fix(&e), "upload_at {off} {}: {e}", data.len());
    }
    d.upload_at(b, n, &[]).unwrap();
    d.upload_at(b, n - 1, &one).unwrap();
    // 16 KiB + 1 past the end of a 16 KiB buffer, and u64::MAX.
    let big = d.allocate(DRIVER_STAGED_MOST as u64).unwrap();
    let e = d.upload_at(big, 1, &vec![1u8; DRIVER_STAGED_MOST]).unwrap_err();
    assert!(matches!(e, Error::OutOfRange { .. }) && has_fix(&e), "{e}");
    let e = d.upload_at(big, 0, &vec![1u8; DRIVER_STAGED_MOST + 1]).unwrap_err();
    assert!(matches!(e, Error::OutOfRange { .. }) && has_fix(&e), "{e}");
    let e = d.upload_at(big, u64::MAX - 10, &vec![1u8; DRIVER_STAGED_MOST + 1]).unwrap_err();
    assert!(matches!(e, Error::OutOfRange { .. }) && has_fix(&e), "{e}");
    // download_range / download_to_slice
    for (off, len) in [(n + 1, 0), (n, 1), (1, u64::MAX), (u64::MAX, 1), (u64::MAX, u64::MAX)] {
        let e = d.download_range(b, off, len).unwrap_err();
        assert!(matches!(e, Error::OutOfRange { .. }) && has_fix(&e), "download_range {off} {len}: {e}");
        let mut batch = d.downloads();
        let e = batch.read(b, off, len).unwrap_err();
        assert!(matches!(e, Error::OutOfRange { .. }) && has_fix(&e), "{e}");
        assert!(batch.submit().is_err());
    }
    let mut out = [0u8; 2];
    let e = d.download_to_slice(b, u64::MAX, &mut out).unwrap_err();
    assert!(matches!(e, Error::OutOfRange { .. }), "{e}");
    let e = d.download_to_slice(b, n - 1, &mut out).unwrap_err();
    assert!(matches!(e, Error::OutOfRange { .. }), "{e}");
    assert_eq!(d.download_range(b, n, 0).unwrap(), Vec::<u8>::new());
    // write / write_with / write_with_par / write_many: the bad item fails submit, nothing moves.
    let other = d.allocate(64).unwrap();
    let mut batch = d.uploads();
    batch.write(other, 0, &[3u8; 64]).unwrap();
    assert!(batch.write(b, u64::MAX, &one).is_err());
    assert!(batch.write_with(b, 1, usize::MAX, |_| panic!("not called")).is_err());
    assert!(batch.write_with_par(b, n, 1, |_: &mut [u8]| panic!("not called")).is_err());
    let e = batch.submit().unwrap_err();
    assert!(has_fix(&e), "{e}");
    let mut batch = d.uploads();
    let items = [(other, 0, &[4u8; 64][..]), (b, n - 1, &two[..])];
    let e = batch.write_many(items).unwrap_err();
    assert!(matches!(&e, Error::BadItem { index: 1, .. }) && has_fix(&e), "{e}");
    assert!(batch.submit().is_err());
    d.synchronize().unwrap();
    assert_eq!(d.download(other).unwrap(), vec![0u8; 64], "nothing of the bad batches moved");
    let mut expect = vec![5u8; 4096];
    expect[4095] = 9;
    assert_eq!(d.download(b).unwrap(), expect);
    // Prepared sets refuse the same ranges.
    for (off, len) in [(n + 1, 0), (n, 1), (u64::MAX, 2)] {
        assert!(d.prepare_uploads(&[(b, 0, 16), (b, off, len)]).is_err());
        assert!(d.prepare_downloads(&[(b, 0, 16), (b, off, len)]).is_err());
    }
    assert_eq!(d.telemetry().pinned.lent_bytes, 0);
}

#[test]
fn small_path_at_and_around_16_kib_from_pageable_and_pinned_memory() {
    let (_driver, d) = device(Config::default());
    let mut rng = fastrand::Rng::with_seed(2);
    for len in [1, DRIVER_STAGED_MOST - 1, DRIVER_STAGED_MOST, DRIVER_STAGED_MOST + 1, 3 * DRIVER_STAGED_MOST]
    {
        let b = d.allocate(len as u64 + 32).unwrap();
        let data = crate::testing::random_vec(&mut rng, len);
        d.upload_at(b, 17, &data).unwrap();
        assert_eq!(d.download_range(b, 17, len as u64).unwrap(), data, "pageable {len}");
        let mut pinned = d.pinned(len).unwrap();
        pinned.copy_from_slice(&crate::testing::random_vec(&mut rng, len));
        d.upload_at(b, 3, &pinned[..]).unwrap();
        let want = pinned.to_vec();
        pinned.fill(0);
        drop(pinned);
        d.synchronize().unwrap();
        assert_eq!(d.download_range(b, 3, len as u64).unwrap(), want, "pinned {len}");
        let mut out = vec![0u8; len];
        d.download_to_slice(b, 3, &mut out).unwrap();
        assert_eq!(out, want);
    }
    assert!(model::with(|g| g.errors.is_empty()));
    assert_eq!(d.telemetry().pinned.lent_bytes, 0);
}

#[test]
fn stale_foreign_and_double_freed_handles_are_refused() {
    let driver = model::driver();
    let d0 = Device::open_on_driver(Arc::clone(&driver), 0, Config::default()).unwrap();
    let d1 = Device::open_on_driver(driver, 1, Config::default()).unwrap();
    let a = d0.allocate(4096).unwrap();
    let foreign = d1.allocate(4096).unwrap();
    d0.free(a).unwrap();
    let e = d0.free(a).unwrap_err();
    assert!(matches!(e, Error::FreedBuffer { .. }) && has_fix(&e), "{e}");
    // Reallocation of the same slot: a new generation; the old handle stays dead.
    let a2 = d0.allocate(4096).unwrap();
    assert_ne!(a, a2);
    for r in [d0.upload_at(a, 0, &[1; 16]), d0.upload(a, &[1; 4096]), d0.download_range(a, 0, 1).map(drop)] {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::FreedBuffer { .. }) && has_fix(&e), "{e}");
    }
    for r in
        [d0.upload_at(foreign, 0, &[1; 16]), d0.download_range(foreign, 0, 1).map(drop), d0.free(foreign)]
    {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::ForeignBuffer { .. }) && has_fix(&e), "{e}");
    }
    let mut batch = d0.uploads();
    assert!(batch.write(foreign, 0, &[1; 16]).is_err());
    assert!(batch.submit().is_err());
    d0.upload_at(a2, 0, &[2; 16]).unwrap();
    assert_eq!(d0.download_range(a2, 0, 16).unwrap(), vec![2; 16]);
    assert_eq!(d1.download_range(foreign, 0, 16).unwrap(), vec![0; 16]);
}

#[test]
fn a_buffer_freed_while_its_batch_is_built_fails_submit_and_nothing_moves() {
    let (_driver, d) = device(Config::default());
    let bytes = vec![9u8; 4096];
    for case in 0..4 {
        let keep = d.allocate(4096).unwrap();
        let gone = d.allocate(4096).unwrap();
        let mut batch = d.uploads();
        match case {
            0 => {
                batch.write(keep, 0, &bytes).unwrap();
                batch.write(gone, 0, &bytes).unwrap();
            }
            1 => {
                batch.write_with(keep, 0, 4096, |x| x.fill(9)).unwrap();
                batch.write_with(gone, 0, 4096, |x| x.fill(9)).unwrap();
            }
            2 => {
                batch.write_with_par(keep, 0, 4096, |x: &mut [u8]| x.fill(9)).unwrap();
                batch.write_with_par(gone, 0, 4096, |x: &mut [u8]| x.fill(9)).unwrap();
            }
            _ => {
                for i in 0..100u64 {
                    batch.write(keep, i * 40, &bytes[..16]).unwrap();
                }
                batch.write(gone, 0, &bytes[..16]).unwrap();
            }
        }
        d.free(gone).unwrap();
        // Freed and handed out again: the memory may be the same.
        let reused = d.allocate(4096).unwrap();
        let e = batch.submit().unwrap_err();
        assert!(matches!(e, Error::FreedBuffer { .. }) && has_fix(&e), "case {case}: {e}");
        d.synchronize().unwrap();
        assert_eq!(d.download(keep).unwrap(), vec![0u8; 4096], "case {case}: nothing moved");
        assert_eq!(d.download(reused).unwrap(), vec![0u8; 4096], "case {case}: the reused memory untouched");
        // A second try at the same write fails the same way.
        let mut again = d.uploads();
        assert!(again.write(gone, 0, &bytes).is_err());
        drop(again);
    }
    assert_eq!(d.telemetry().pinned.lent_bytes, 0);
}

#[test]
fn fill_panics_and_dropped_batches_leave_no_lease_and_move_nothing_wrong() {
    let (_driver, d) = device(Config::default());
    let b = d.allocate(1 << 20).unwrap();
    // Dropped without submit.
    {
        let mut batch = d.uploads();
        batch.write_with(b, 0, 4096, |x| x.fill(1)).unwrap();
        batch.write_with_par(b, 8192, 4096, |x: &mut [u8]| x.fill(2)).unwrap();
        batch.write(b, 65536, &[3u8; 100]).unwrap();
    }
    assert_eq!(d.telemetry().pinned.lent_bytes, 0, "a dropped batch returned its staging");
    // write_with panics: poisoned, the panic goes on, submit fails, nothing moved.
    let mut batch = d.uploads();
    batch.write_with(b, 0, 16, |x| x.fill(4)).unwrap();
    let r = catch_unwind(AssertUnwindSafe(|| {
        let _ = batch.write_with(b, 64, 16, |_| panic!("boom"));
    }));
    assert!(r.is_err());
    assert!(batch.write(b, 128, &[1u8; 4]).is_err());
    let e = batch.submit().unwrap_err();
    assert!(matches!(e, Error::BatchPoisoned { .. }) && has_fix(&e), "{e}");
    // write_with_par: a fill of the only lease panics: nothing moves.
    let mut batch = d.uploads();
    for i in 0..8u64 {
        batch
            .write_with_par(b, i * 4096, 1000, move |x: &mut [u8]| {
                if i == 5 {
                    panic!("fill {i}");
                }
                x.fill(6)
            })
            .unwrap();
    }
    let e = batch.submit().unwrap_err();
    assert!(matches!(e, Error::FillPanicked { write: 5, .. }) && has_fix(&e), "{e}");
    d.synchronize().unwrap();
    assert_eq!(d.download_range(b, 0, 40000).unwrap(), vec![0u8; 40000], "nothing moved");
    assert_eq!(d.telemetry().pinned.lent_bytes, 0);
    assert!(model::with(|g| g.errors.is_empty()));
}

#[test]
fn after_a_fault_in_a_small_upload_the_next_copy_works_and_nothing_is_leaked() {
    let (driver, d) = device(Config::default());
    let b = d.allocate(4096).unwrap();
    for entry in ["cuMemcpyHtoDAsync_v2", "cuEventRecord", "cuEventSynchronize", "cuStreamWaitEvent"] {
        let faults = driver.faults();
        faults.clear();
        faults.inject(Fault::new(entry, 1, CUDA_ERROR_LAUNCH_FAILED)).unwrap();
        let r = d.upload_at(b, 0, &[7u8; 4096]);
        faults.clear();
        if let Err(e) = &r {
            assert!(e.to_string().contains(entry) && has_fix(e), "{entry}: {e}");
        }
        d.synchronize().unwrap();
        d.upload_at(b, 0, &[8u8; 4096]).unwrap();
        assert_eq!(d.download(b).unwrap(), vec![8u8; 4096], "{entry}");
        d.upload_at(b, 0, &[0u8; 4096]).unwrap();
    }
    assert_eq!(d.telemetry().pinned.lent_bytes, 0);
    assert!(model::with(|g| g.errors.is_empty()));
}

/// A device dropped while a prepared upload is queued, whose final wait fails once without
/// losing the context: the lane is settled before any device memory is freed, so the queued
/// launch never runs against freed memory (its descriptor table, its destination).
#[test]
fn a_device_whose_final_wait_fails_frees_nothing_a_queued_copy_still_uses() {
    use cuda_sys::CUDA_ERROR_OUT_OF_MEMORY;
    let (driver, d) = device(Config::default());
    let b = d.allocate(1 << 20).unwrap();
    let ranges: Vec<_> = (0..64u64).map(|i| (b, i * 1024, 100)).collect();
    let mut set = d.prepare_uploads(&ranges).unwrap();
    assert!(set.is_laid_out());
    let data = vec![[7u8; 100]; 64];
    drop(set.upload(&data).unwrap());
    drop(set);
    assert!(model::with(|g| g.errors.is_empty()));
    driver.faults().inject(Fault::new("cuEventSynchronize", 1, CUDA_ERROR_OUT_OF_MEMORY)).unwrap();
    drop(d);
    driver.faults().clear();
    let errors = model::with(|g| std::mem::take(&mut g.errors));
    assert!(errors.is_empty(), "the GPU touched memory after the device freed it: {errors:?}");
}

/// Caps and chunks past what any host holds are refused by `Config::validate` (and so by
/// `Device::open_on_driver`) with a fix, not by a panic in their arithmetic; the largest cap
/// allowed opens, and a request for `usize::MAX` bytes under it is an error.
#[test]
fn huge_caps_and_chunks_are_refused_with_a_fix_not_a_panic() {
    for config in [
        Config::default().with_chunk_bytes(u64::MAX),
        Config::default().with_chunk_bytes(1 << 62).with_pinned_cap_bytes(1 << 63),
        Config::default().with_pinned_cap_bytes(u64::MAX),
        Config { slab_bytes: !255, ..Config::default() },
        Config { pack_threads: usize::MAX, ..Config::default() },
    ] {
        let e = config.validate().unwrap_err();
        assert!(matches!(e, Error::InvalidConfig { .. }) && has_fix(&e), "{e}");
        let opened = Device::open_on_driver(model::driver(), 0, config);
        assert!(matches!(opened, Err(Error::InvalidConfig { .. })), "{:?}", opened.map(drop));
    }
    let (_driver, d) = device(Config::default().with_pinned_cap_bytes(1 << 48));
    let _held = d.pinned(1).unwrap();
    let e = d.pinned(usize::MAX).map(drop).unwrap_err();
    assert!(has_fix(&e), "{e}");
    let e = d.pinned((1 << 48) + 1).map(drop).unwrap_err();
    assert!(has_fix(&e), "{e}");
}

/// `Device::trim` whose device release the driver refuses: the error comes back, and the
/// pinned pool is trimmed all the same.
#[test]
fn a_trim_whose_device_release_fails_still_trims_the_pinned_pool() {
    use cuda_sys::CUDA_ERROR_OUT_OF_MEMORY;
    let (driver, d) = device(Config::default());
    let b = d.allocate(1 << 20).unwrap();
    d.free(b).unwrap();
    drop(d.pinned(1 << 20).unwrap());
    assert!(d.telemetry().pinned.reserved_bytes > 0, "a free arena is cached");
    driver.faults().inject(Fault::new("cuMemFree_v2", 1, CUDA_ERROR_OUT_OF_MEMORY).times(2)).unwrap();
    let e = d.trim().unwrap_err();
    driver.faults().clear();
    assert!(e.to_string().contains("cuMemFree") && has_fix(&e), "{e}");
    assert_eq!(d.telemetry().pinned.reserved_bytes, 0, "the pinned pool was trimmed too");
    d.trim().unwrap();
}

/// A download into the caller's vectors, one of whose buffers was freed before submit: the
/// batch is refused with `FreedBuffer` and the vectors are as they were, whether the batch
/// fits the pinned pool (planned) or streams through it (a pool of two chunks).
#[test]
fn a_refused_download_into_vectors_leaves_them_as_they_were_on_every_route() {
    let tiny = Config {
        chunk_bytes: 64 << 10,
        direct_threshold: 16 << 10,
        pinned_cap_bytes: 128 << 10,
        ..Config::default()
    };
    for (config, route) in [(Config::default(), "planned"), (tiny, "streamed")] {
        let (_driver, d) = device(config);
        let b = d.allocate(1 << 20).unwrap();
        let late = d.allocate(4096).unwrap();
        let mut reads = d.downloads();
        for k in 0..4u64 {
            reads.read(b, k * 200_000, 150_000).unwrap();
        }
        reads.read(late, 0, 100).unwrap();
        d.free(late).unwrap();
        let mut out = vec![vec![0xA5u8; 17]; 5];
        let e = reads.submit_into(&mut out).unwrap_err();
        assert!(matches!(e, Error::FreedBuffer { .. }) && has_fix(&e), "{route}: {e}");
        assert!(out.iter().all(|v| v == &[0xA5u8; 17]), "{route}: the caller's vectors changed");
        assert_eq!(d.telemetry().pinned.lent_bytes, 0, "{route}");
    }
}

/// What a cudarc view (feature `cudarc`) holds of its buffer, on the model: while any view
/// lives the buffer cannot be freed (`BufferViewed`, naming how many views); the last
/// view's drop waits for every stream of the device's context and of its peers' before the
/// buffer can be freed; a freed buffer cannot be viewed; other buffers free as ever.
#[test]
fn a_viewed_buffer_is_not_freed_until_its_views_dropped_and_their_work_was_waited_for() {
    let driver = model::driver();
    let d0 = Device::open_on_driver(Arc::clone(&driver), 0, Config::default()).unwrap();
    let d1 = Device::open_on_driver(Arc::clone(&driver), 1, Config::default()).unwrap();
    d0.enable_peer(&d1).unwrap();
    let b = d0.allocate(4096).unwrap();
    let other = d0.allocate(4096).unwrap();
    let first = d0.core().view_guard(b).unwrap();
    let second = d0.core().view_guard(b).unwrap();
    let e = d0.free(b).unwrap_err();
    assert!(matches!(e, Error::BufferViewed { views: 2, .. }) && has_fix(&e), "{e}");
    drop(first);
    let e = d0.free(b).unwrap_err();
    assert!(matches!(e, Error::BufferViewed { views: 1, .. }), "{e}");
    d0.free(other).unwrap();
    let e = d0.free(other).unwrap_err();
    assert!(matches!(e, Error::FreedBuffer { .. }), "a stale handle is refused as stale: {e}");
    assert!(matches!(d0.core().view_guard(other).map(drop), Err(Error::FreedBuffer { .. })));
    let syncs = model::with(|g| g.ctx_syncs);
    drop(second);
    assert_eq!(model::with(|g| g.ctx_syncs) - syncs, 2, "the device's context and its peer's, waited for");
    d0.free(b).unwrap();
    assert!(model::with(|g| g.errors.is_empty()));
}

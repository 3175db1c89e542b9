//! Edges of the single-copy and convenience paths, on the model driver: whole-buffer uploads
//! of another length, copies and pins of zero bytes, pinned memory given to the unsafe
//! asynchronous copies.

use std::sync::Arc;

use crate::testing::model;
use crate::{Config, Device, Error, Fence};

fn device(config: Config) -> (Arc<cuda_sys::Driver>, Device) {
    let driver = model::driver();
    let d = Device::open_on_driver(Arc::clone(&driver), 0, config).expect("the model opens");
    (driver, d)
}

/// Driver calls since `record()`, all entry points together.
fn driver_calls(driver: &cuda_sys::Driver) -> u64 {
    driver.faults().counts().values().map(|c| c.calls).sum()
}

#[test]
fn a_whole_buffer_upload_of_another_length_is_refused_with_a_fix() {
    let (_driver, d) = device(Config::default());
    let b = d.allocate(4096).unwrap();
    d.upload(b, &[1u8; 4096]).unwrap();
    let before = d.telemetry().upload_submissions;
    for len in [0, 1, 4095, 4097] {
        let e = d.upload(b, &vec![2u8; len]).unwrap_err();
        assert!(
            matches!(e, Error::UploadLength { buffer, buffer_len: 4096, data_len } if buffer == b && data_len == len),
            "{e}"
        );
        let text = e.to_string();
        assert!(text.contains("Fix:") && text.contains("upload_at"), "{text}");
    }
    // upload_many: whole buffers too, every length checked before anything moves.
    let c = d.allocate(100).unwrap();
    let e = d.upload_many(&[(c, &[9u8; 100][..]), (b, &[2u8; 4095][..])]).unwrap_err();
    assert!(matches!(e, Error::UploadLength { buffer_len: 4096, data_len: 4095, .. }), "{e}");
    assert_eq!(d.telemetry().upload_submissions, before, "nothing moved");
    assert_eq!(d.download(b).unwrap(), vec![1u8; 4096]);
    assert_eq!(d.download(c).unwrap(), vec![0u8; 100]);
    // A partial write goes through upload_at.
    d.upload_at(b, 0, &[3u8; 10]).unwrap();
    assert_eq!(d.download(b).unwrap()[..11], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 1]);
}

#[test]
fn asynchronous_copies_of_zero_bytes_call_no_driver_and_return_a_completed_fence() {
    let (driver, d) = device(Config::default());
    let b = d.allocate(4096).unwrap();
    let mut host = vec![0u8; 16];
    driver.faults().record();
    // SAFETY: zero bytes: nothing is read or written (not even pinned memory is needed).
    let up: Fence = unsafe { d.upload_async_at(b, 4096, host.as_ptr(), 0) }.unwrap();
    // SAFETY: as above.
    let down: Fence = unsafe { d.download_async_at(b, 0, host.as_mut_ptr(), 0) }.unwrap();
    assert!(up.is_complete().unwrap() && down.is_complete().unwrap());
    up.wait().unwrap();
    down.wait().unwrap();
    assert_eq!(driver_calls(&driver), 0, "no driver call: {:?}", driver.faults().counts());
    assert_eq!(d.telemetry().upload_submissions + d.telemetry().download_submissions, 0);
    // The range is still checked.
    // SAFETY: refused before anything is enqueued.
    let e = unsafe { d.upload_async_at(b, 4097, host.as_ptr(), 0) }.unwrap_err();
    assert!(matches!(e, Error::OutOfRange { offset: 4097, len: 0, .. }), "{e}");
    d.free(b).unwrap();
    // SAFETY: as above.
    let e = unsafe { d.download_async_at(b, 0, host.as_mut_ptr(), 0) }.unwrap_err();
    assert!(matches!(e, Error::FreedBuffer { .. }), "{e}");
}

#[test]
fn pinning_zero_bytes_is_an_error_with_a_fix_and_calls_no_driver() {
    let (driver, d) = device(Config::default());
    let mut host = vec![0u8; 4096];
    driver.faults().record();
    // SAFETY: refused before the driver is called.
    let e = unsafe { d.pin_host(host.as_mut_ptr(), 0) }.unwrap_err();
    assert!(matches!(e, Error::EmptyHostRange { operation: "Device::pin_host", .. }), "{e}");
    assert!(e.to_string().contains("Fix:"), "{e}");
    assert!(!driver.faults().counts().contains_key("cuMemHostRegister_v2"), "no registration");
}

#[test]
fn a_pinned_buffer_dropped_during_its_copy_is_not_lent_again_before_the_copy_completes() {
    let (_driver, d) = device(Config::default());
    let len = 1 << 20;
    let b = d.allocate(len as u64).unwrap();
    let mut rng = fastrand::Rng::with_seed(81);
    let data = crate::testing::random_vec(&mut rng, len);

    // Upload: the model carries the copy out only when the host waits, so a reuse of the
    // dropped buffer's memory before then would change what the copy reads.
    let mut src = d.pinned(len).unwrap();
    src.copy_from_slice(&data);
    let src_at = src.as_ptr();
    // SAFETY: pinned, `len` bytes, unchanged until the copy completes (the drop below hands
    // the memory to the copy, which keeps it).
    let fence = unsafe { d.upload_async_at(b, 0, src.as_ptr(), len) }.unwrap();
    drop(src);
    assert!(!fence.is_complete().unwrap(), "the model has not carried the copy out yet");
    assert_eq!(d.telemetry().pinned.lent_bytes, len as u64, "the copy still holds the memory");
    let mut other = d.pinned(len).unwrap();
    assert_ne!(other.as_ptr(), src_at, "the memory the copy reads was lent again");
    other.fill(0xEE);
    fence.wait().unwrap();
    assert!(d.download(b).unwrap() == data, "the upload read another user's bytes");
    drop(other);
    d.synchronize().unwrap();
    assert_eq!(d.telemetry().pinned.lent_bytes, 0, "back to the pool once the copy is done");

    // Download: a reuse before the copy completes would be written by the copy.
    let mut dst = d.pinned(len).unwrap();
    let dst_at = dst.as_mut_ptr();
    // SAFETY: pinned, `len` bytes, untouched until the copy completes (as above).
    let fence = unsafe { d.download_async_at(b, 0, dst.as_mut_ptr(), len) }.unwrap();
    drop(dst);
    let mut other = d.pinned(len).unwrap();
    assert_ne!(other.as_mut_ptr(), dst_at, "the memory the copy writes was lent again");
    other.fill(0x55);
    fence.wait().unwrap();
    assert!(other.iter().all(|&x| x == 0x55), "the download wrote into another user's buffer");
    assert!(model::with(|g| g.errors.is_empty()), "the model found illegal accesses");
}

#[test]
fn a_range_over_two_pinned_regions_with_a_pageable_gap_is_refused_naming_the_gap() {
    let (_driver, d) = device(Config::default());
    let b = d.allocate(3 * 4096).unwrap();
    let mut host = vec![7u8; 3 * 4096];
    let base = host.as_mut_ptr();
    // SAFETY: two pages of the vector, which outlives the registrations (undone below); the
    // page between them stays pageable.
    unsafe {
        d.pin_host(base, 4096).unwrap();
        d.pin_host(base.add(2 * 4096), 4096).unwrap();
    }
    for (at, len) in [(0, 3 * 4096), (4000, 5000), (0, 4097)] {
        // SAFETY: refused before anything is enqueued.
        let e = unsafe { d.upload_async_at(b, 0, base.add(at).cast_const(), len) }.unwrap_err();
        assert!(
            matches!(e, Error::NotPinned { unpinned, .. } if unpinned == base as usize + 4096),
            "[{at}, +{len}): {e}"
        );
        // SAFETY: as above.
        let e = unsafe { d.download_async_at(b, 0, base.add(at), len) }.unwrap_err();
        assert!(matches!(e, Error::NotPinned { unpinned, .. } if unpinned == base as usize + 4096), "{e}");
    }
    assert_eq!(d.telemetry().upload_submissions + d.telemetry().download_submissions, 0, "nothing enqueued");
    // Each region alone is fine.
    // SAFETY: pinned, alive and unchanged until the fence is waited on.
    unsafe { d.upload_async_at(b, 0, base.add(2 * 4096).cast_const(), 4096) }.unwrap().wait().unwrap();
    // SAFETY: the registrations made above; no copy is in flight.
    unsafe {
        d.unpin_host(base).unwrap();
        d.unpin_host(base.add(2 * 4096)).unwrap();
    }
    assert_eq!(d.download_range(b, 0, 4096).unwrap(), vec![7u8; 4096]);
}

/// A `PinnedBuffer` of one device given to another device's asynchronous copy (arenas are
/// portable) and dropped before the copy completes stays out of its pool too.
#[test]
fn a_pinned_buffer_of_another_device_dropped_during_its_copy_is_not_lent_again() {
    let driver = model::driver();
    let d0 = Device::open_on_driver(Arc::clone(&driver), 0, Config::default()).unwrap();
    let d1 = Device::open_on_driver(driver, 1, Config::default()).unwrap();
    let len = 1 << 20;
    let b = d1.allocate(len as u64).unwrap();
    let data = crate::testing::random_vec(&mut fastrand::Rng::with_seed(83), len);
    let mut src = d0.pinned(len).unwrap();
    src.copy_from_slice(&data);
    let src_at = src.as_ptr();
    // SAFETY: pinned, `len` bytes, unchanged until the copy completes (the drop hands the
    // memory to the copy, which keeps it).
    let fence = unsafe { d1.upload_async_at(b, 0, src.as_ptr(), len) }.unwrap();
    drop(src);
    assert_eq!(d0.telemetry().pinned.lent_bytes, len as u64, "d1's copy still holds d0's memory");
    let mut other = d0.pinned(len).unwrap();
    assert_ne!(other.as_ptr(), src_at, "the memory d1's copy reads was lent again");
    other.fill(0xEE);
    fence.wait().unwrap();
    assert!(d1.download(b).unwrap() == data, "the upload read another user's bytes");
    drop(other);
    d1.synchronize().unwrap();
    assert_eq!(d0.telemetry().pinned.lent_bytes, 0);
}

/// A download's view given to an asynchronous copy, the download dropped before the copy
/// completes: its staging is not lent again (to the next download) while the copy reads it.
#[test]
fn a_download_view_given_to_an_async_copy_and_dropped_is_not_lent_again_before_the_copy_completes() {
    let (_driver, d) = device(Config::default());
    let len = 64 << 10;
    let (a, b) = (d.allocate(len as u64).unwrap(), d.allocate(len as u64).unwrap());
    let mut rng = fastrand::Rng::with_seed(85);
    let data = crate::testing::random_vec(&mut rng, len);
    d.upload(a, &data).unwrap();
    let mut reads = d.downloads();
    let slot = reads.read_buffer(a).unwrap();
    let done = reads.submit().unwrap().wait().unwrap();
    let view = done.get(slot).as_ptr();
    // SAFETY: pinned memory of the download, unchanged until the copy completes: the drop
    // below hands it to the copy, which keeps it.
    let fence = unsafe { d.upload_async_at(b, 0, view, len) }.unwrap();
    drop(done);
    // The next download of the same size takes other staging (no wait on the upload lane
    // here: the model has not carried the copy out).
    assert!(!fence.is_complete().unwrap());
    let mut reads = d.downloads();
    let slot = reads.read_buffer(a).unwrap();
    let next = reads.submit().unwrap().wait().unwrap();
    assert_ne!(next.get(slot).as_ptr(), view, "the memory the copy reads was lent again");
    fence.wait().unwrap();
    assert!(d.download(b).unwrap() == data, "the upload read another download's bytes");
}

/// Blocking uploads of at most `DRIVER_STAGED_MOST` bytes go to the driver as given (the
/// model counts a copy from pageable memory, staged at the call); larger ones take the
/// staged batch path. Either way every byte lands where it was sent, from pageable and from
/// pinned memory, and nothing else changes.
#[test]
fn small_blocking_uploads_go_to_the_driver_as_given_and_land() {
    use crate::transfer::single::DRIVER_STAGED_MOST as MOST;
    let (_driver, d) = device(Config::default());
    let mut rng = fastrand::Rng::with_seed(41);
    let len = 3 * MOST;
    let b = d.allocate(len as u64).unwrap();
    let mut expected: Vec<u8> = std::iter::repeat_with(|| rng.u8(..)).take(len).collect();
    d.upload(b, &expected).unwrap();
    let pageable = || model::with(|g| g.pageable_uploads);
    for (offset, n) in [(0, 1), (3, 4096), (len - MOST, MOST), (17, MOST + 1), (0, len)] {
        let data: Vec<u8> = std::iter::repeat_with(|| rng.u8(..)).take(n).collect();
        let before = pageable();
        d.upload_at(b, offset as u64, &data).unwrap();
        assert_eq!(pageable() - before, u64::from(n <= MOST), "{n} bytes at {offset}: the path");
        expected[offset..offset + n].copy_from_slice(&data);
        assert!(d.download(b).unwrap() == expected, "{n} bytes at {offset}: the buffer");
    }
    // A whole small buffer, by `upload`.
    let small = d.allocate(MOST as u64).unwrap();
    let data: Vec<u8> = std::iter::repeat_with(|| rng.u8(..)).take(MOST).collect();
    let before = pageable();
    d.upload(small, &data).unwrap();
    assert_eq!(pageable(), before + 1);
    assert!(d.download(small).unwrap() == data);
    // From pinned memory the DMA reads the source after the call returns: the upload waits
    // for it, and the source is only reused after.
    let mut pinned = d.pinned(MOST).unwrap();
    rng.fill(&mut pinned[..]);
    let before = pageable();
    d.upload_at(b, 5, &pinned[..]).unwrap();
    assert_eq!(pageable(), before, "pinned memory is not staged");
    expected[5..5 + MOST].copy_from_slice(&pinned[..]);
    pinned.fill(0x5A);
    assert!(d.download(b).unwrap() == expected);
    assert!(model::with(|g| g.errors.is_empty()), "{:?}", model::with(|g| g.errors.clone()));
}

/// A small blocking upload with a bad range, or to a freed buffer, fails before anything is
/// enqueued, with the errors of the batch path.
#[test]
fn small_blocking_uploads_of_bad_ranges_fail_and_move_nothing() {
    let (driver, d) = device(Config::default());
    let b = d.allocate(4096).unwrap();
    let data = [7u8; 64];
    driver.faults().record();
    for offset in [4033, 4096, u64::MAX, u64::MAX - 10] {
        let e = d.upload_at(b, offset, &data).unwrap_err();
        assert!(
            matches!(e, Error::OutOfRange { buffer, offset: o, len: 64, buffer_len: 4096 } if buffer == b && o == offset),
            "{e}"
        );
        assert!(e.to_string().contains("Fix:"), "{e}");
    }
    // Empty: checked, then nothing to do.
    d.upload_at(b, 4096, &[]).unwrap();
    assert!(matches!(d.upload_at(b, 4097, &[]), Err(Error::OutOfRange { .. })));
    assert_eq!(driver_calls(&driver), 0, "no driver call");
    d.free(b).unwrap();
    let e = d.upload_at(b, 0, &data).unwrap_err();
    assert!(matches!(e, Error::FreedBuffer { buffer } if buffer == b), "{e}");
    assert_eq!(d.telemetry().upload_submissions, 0);
}

/// A small blocking upload from pinned memory (read by the DMA itself, not staged by the
/// driver at the call) whose wait fails without losing the context: the copy may still be
/// queued, so `upload_at` settles the lane before it returns the error. Bytes the caller
/// writes into the source afterwards never reach the device.
#[test]
fn a_small_upload_whose_wait_fails_has_landed_or_never_will_when_it_returns() {
    use cuda_sys::{CUDA_ERROR_OUT_OF_MEMORY, Fault};
    let (driver, d) = device(Config::default());
    let b = d.allocate(4096).unwrap();
    d.upload(b, &[0x11; 4096]).unwrap();
    for entry in ["cuEventSynchronize", "cuEventRecord"] {
        let mut src = d.pinned(4096).unwrap();
        src.fill(0xAA);
        let faults = driver.faults();
        faults.clear();
        faults.inject(Fault::new(entry, 1, CUDA_ERROR_OUT_OF_MEMORY)).unwrap();
        if entry == "cuEventRecord" {
            // And the stream's synchronize once too: the lane asks again.
            faults.inject(Fault::new("cuStreamSynchronize", 1, CUDA_ERROR_OUT_OF_MEMORY)).unwrap();
        }
        let e = d.upload_at(b, 0, &src[..]).unwrap_err();
        faults.clear();
        assert!(e.to_string().contains(entry) && e.to_string().contains("Fix: "), "{e}");
        // The call returned: the source is the caller's again.
        src.fill(0xEE);
        drop(src);
        d.synchronize().unwrap();
        let after = d.download(b).unwrap();
        model::complete_all();
        assert!(after == vec![0xAA; 4096], "{entry}: the copy had landed when upload_at returned");
        assert!(d.download(b).unwrap() == after, "{entry}: nothing landed after synchronize returned");
        d.upload(b, &[0x11; 4096]).unwrap();
    }
    assert!(model::with(|g| g.errors.is_empty()));
}

/// A batch whose event cannot be recorded, and whose stream the lane then fails to
/// synchronize once: the lane asks again rather than leave the copy queued with no record
/// of it, so `Device::synchronize` (and the drop of the device, which frees the memory the
/// copy writes) comes after it.
#[test]
fn a_submission_without_an_event_is_waited_for_before_synchronize_returns() {
    use cuda_sys::{CUDA_ERROR_OUT_OF_MEMORY, Fault};
    let (driver, d) = device(Config::default());
    let b = d.allocate(1 << 20).unwrap();
    d.upload(b, &vec![0x11; 1 << 20]).unwrap();
    let data = vec![0x22u8; 1 << 20];
    let faults = driver.faults();
    faults.clear();
    faults.inject(Fault::new("cuEventRecord", 1, CUDA_ERROR_OUT_OF_MEMORY)).unwrap();
    faults.inject(Fault::new("cuStreamSynchronize", 1, CUDA_ERROR_OUT_OF_MEMORY)).unwrap();
    let mut batch = d.uploads();
    batch.write(b, 0, &data).unwrap();
    let e = batch.submit().map(drop).unwrap_err();
    faults.clear();
    assert!(e.to_string().contains("cuEventRecord"), "{e}");
    d.synchronize().unwrap();
    let after = d.download(b).unwrap();
    model::complete_all();
    assert!(d.download(b).unwrap() == after, "a copy landed after synchronize returned");
    drop(d);
    model::complete_all();
    assert!(model::with(|g| g.errors.is_empty()), "no copy touched freed memory");
}

/// A planned upload (writes out of order) of tiny writes: each chunk's pinned lease, its
/// packed bytes and their descriptor table, fits in what the pool keeps for transfers, at
/// the smallest cap a config accepts (two chunks) and with most of a larger cap held by a
/// `PinnedBuffer`. Every byte lands.
#[test]
fn tiny_writes_out_of_order_fit_the_pinned_pool_at_its_smallest() {
    let small = Config { chunk_bytes: 64 << 10, direct_threshold: 8 << 10, ..Config::default() };
    for (cap, hold) in [(128u64 << 10, 0usize), (256 << 10, 128 << 10)] {
        let (_driver, d) = device(Config { pinned_cap_bytes: cap, ..small.clone() });
        let _held = (hold > 0).then(|| d.pinned(hold).unwrap());
        let big = d.allocate(128 << 10).unwrap();
        let b = d.allocate(20_000 * 16).unwrap();
        let mut expect_big = vec![0u8; 128 << 10];
        let mut expect = vec![0u8; 20_000 * 16];
        d.upload(big, &expect_big).unwrap();
        d.upload(b, &expect).unwrap();
        let block = vec![0xEE_u8; 4096];
        let tiny: Vec<[u8; 1]> = (0..20_000u32).map(|i| [(i % 251) as u8 + 1]).collect();
        let mut w = d.uploads();
        // Out of order and apart: the planned route. 4 KiB writes, then 1-byte writes.
        for i in (0..16u64).rev() {
            w.write(big, i * 8192, &block).unwrap();
            expect_big[(i * 8192) as usize..][..4096].fill(0xEE);
        }
        for i in (0..20_000usize).rev() {
            w.write(b, (i * 16) as u64, &tiny[i]).unwrap();
            expect[i * 16] = tiny[i][0];
        }
        w.submit().and_then(|f| f.wait()).unwrap_or_else(|e| panic!("cap {cap}, {hold} held: {e}"));
        assert!(d.download(big).unwrap() == expect_big, "cap {cap}");
        assert!(d.download(b).unwrap() == expect, "cap {cap}");
    }
}

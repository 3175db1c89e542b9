//! Drop safety on a real GPU: dropping a `Device`, a batch, a pending download, a download or
//! a fence at any point leaves no leak and no use after free. Work in flight is waited for or
//! kept alive by what still refers to it.
//!
//! Each test runs on a driver of its own whose calls are counted, and checks at the end (with
//! everything dropped) that every allocation, stream, event, module and context retain was
//! released, and that the device's free memory is what it was before. compute-sanitizer's
//! memcheck over these tests finds no access to freed memory (see docs/reliability.md).
//!
//! Ignored where there is no GPU.

mod common;

use std::sync::Arc;

use cuda_resident::cuda_sys::Driver;
use cuda_resident::{Config, Device};

fn random_vec(rng: &mut fastrand::Rng, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rng.fill(&mut v);
    v
}

/// Runs `body` with a device on a counting driver, then checks that nothing leaked once the
/// body has dropped everything.
fn leak_checked(body: impl FnOnce(Device)) {
    // The anchor keeps the primary context alive and warm: its first kernel launches make
    // the driver reserve the context's own memory, which then stays, whoever launches.
    let anchor = Device::open(0).unwrap_or_else(|e| panic!("{e}"));
    let warm = anchor.allocate(1 << 20).unwrap();
    let bytes = [7u8; 100];
    let writes: Vec<_> = (0..8u64).map(|i| (warm, i * 1000, &bytes[..])).collect();
    anchor.upload_at_many(&writes).unwrap();
    let ranges: Vec<_> = (0..8u64).map(|i| (warm, i * 1000, 100)).collect();
    anchor.download_ranges(&ranges).unwrap();
    anchor.free(warm).unwrap();
    anchor.synchronize().unwrap();
    let before = anchor.driver_free_bytes().unwrap();
    let driver = Arc::new(Driver::load().unwrap());
    driver.faults().record();
    let config = Config::default().with_chunk_bytes(1 << 20).with_direct_threshold(64 << 10);
    body(Device::open_on_driver(Arc::clone(&driver), 0, config).unwrap());
    common::balanced(&driver.faults().counts()).unwrap();
    common::free_memory_kept(before, anchor.driver_free_bytes().unwrap()).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn dropping_the_device_with_uploads_and_downloads_in_flight_waits_for_them() {
    leak_checked(|d| {
        let mut rng = fastrand::Rng::with_seed(1);
        let data = random_vec(&mut rng, 64 << 20);
        let buffers: Vec<_> = (0..8).map(|_| d.allocate(8 << 20).unwrap()).collect();
        let mut batch = d.uploads();
        for (i, &b) in buffers.iter().enumerate() {
            batch.write(b, 0, &data[i << 23..(i + 1) << 23]).unwrap();
        }
        let fence = batch.submit().unwrap();
        let mut reads = d.downloads();
        for &b in &buffers {
            reads.read_buffer(b).unwrap();
        }
        let pending = reads.submit().unwrap();
        // Everything dropped while the copies may still be on the wire: the last owner
        // (whichever it is) waits for them before memory goes.
        drop(fence);
        drop(pending);
        drop(d);
    });
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_pending_download_and_a_fence_outlive_their_device_and_stay_correct() {
    leak_checked(|d| {
        let mut rng = fastrand::Rng::with_seed(2);
        let data = random_vec(&mut rng, 3 << 20);
        let b = d.allocate(data.len() as u64).unwrap();
        let fence = {
            let mut batch = d.uploads();
            batch.write(b, 0, &data).unwrap();
            batch.submit().unwrap()
        };
        let mut reads = d.downloads();
        let whole = reads.read_buffer(b).unwrap();
        let part = reads.read(b, 12345, 100).unwrap();
        let pending = reads.submit().unwrap();
        // The buffer is freed and the device handle dropped before anyone waits.
        d.free(b).unwrap();
        drop(d);
        fence.wait().unwrap();
        let got = pending.wait().unwrap();
        assert!(got.get(whole) == &data[..], "the read after the device handle was dropped differs");
        assert_eq!(got.get(part), &data[12345..12445]);
        // The views outlive every other handle, then go.
        drop(fence);
        assert_eq!(got.get(part), &data[12345..12445]);
        drop(got);
    });
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn dropping_unsubmitted_batches_returns_their_staging() {
    leak_checked(|d| {
        let b = d.allocate(1 << 20).unwrap();
        let mut batch = d.uploads();
        for i in 0..100u64 {
            batch.write_with(b, i * 1000, 1000, |dst| dst.fill(i as u8)).unwrap();
        }
        batch.write_with(b, 0, 512 << 10, |dst| dst.fill(7)).unwrap();
        assert!(d.telemetry().pinned.lent_bytes > 0, "in-place writes hold staging");
        drop(batch);
        let mut reads = d.downloads();
        reads.read_buffer(b).unwrap();
        drop(reads);
        let t = d.telemetry();
        assert_eq!(t.pinned.lent_bytes, 0, "{t:#?}");
        assert_eq!((t.upload_submissions, t.download_submissions), (0, 0), "nothing moved");
        d.free(b).unwrap();
    });
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn freeing_buffers_with_copies_in_flight_defers_and_keeps_the_bytes() {
    leak_checked(|d| {
        let mut rng = fastrand::Rng::with_seed(3);
        let data = random_vec(&mut rng, 32 << 20);
        let b = d.allocate(data.len() as u64).unwrap();
        d.upload(b, &data).unwrap();
        let mut reads = d.downloads();
        let slot = reads.read_buffer(b).unwrap();
        let pending = reads.submit().unwrap();
        // Freed while the download may be copying out of it, then reused at once by another
        // allocation that is written: the download must still see the old bytes.
        d.free(b).unwrap();
        let other = d.allocate(data.len() as u64).unwrap();
        d.upload(other, &random_vec(&mut rng, data.len())).unwrap();
        let got = pending.wait().unwrap();
        assert!(got.get(slot) == &data[..], "a freed buffer's pending read was overwritten");
        drop(got);
        d.free(other).unwrap();
        // Pinned buffers lent to the caller go back on drop; the pool frees them on trim.
        let pinned = d.pinned(5 << 20).unwrap();
        drop(pinned);
        d.synchronize().unwrap();
        d.trim().unwrap();
        let t = d.telemetry();
        assert_eq!(
            (t.pinned.lent_bytes, t.pinned.reserved_bytes, t.memory.deferred_bytes),
            (0, 0, 0),
            "{t:#?}"
        );
    });
}

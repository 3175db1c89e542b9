//! Devices, the resident store, the pinned pool and the lanes on a real GPU. Ignored where
//! there is none: `cargo test -- --include-ignored` on a machine with an NVIDIA GPU.

use std::sync::Arc;

use cuda_resident::cuda_sys::{self, CUDA_SUCCESS, call};
use cuda_resident::{Config, Device, Error, ResidentBuffer};

#[path = "common/streams.rs"]
mod streams;
use streams::{caller_stream, finish_stream};

fn device() -> Device {
    Device::open(0).unwrap_or_else(|e| panic!("{e}"))
}

fn random_bytes(rng: &mut fastrand::Rng, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rng.fill(&mut v);
    v
}

/// Writes `data` to the buffer with a raw, synchronous driver copy.
fn raw_write(device: &Device, buffer: ResidentBuffer, data: &[u8]) {
    let ptr = device.device_ptr(buffer).unwrap();
    device.make_current().unwrap();
    // SAFETY: the buffer holds at least data.len() bytes (checked by the callers' sizes).
    let code = unsafe { call!(device.driver(), cuMemcpyHtoD_v2(ptr, data.as_ptr().cast(), data.len())) };
    assert_eq!(code.unwrap(), CUDA_SUCCESS);
}

/// Reads the buffer back with a raw, synchronous driver copy into poisoned memory.
fn raw_read(device: &Device, buffer: ResidentBuffer) -> Vec<u8> {
    let ptr = device.device_ptr(buffer).unwrap();
    let len = device.buffer_len(buffer).unwrap() as usize;
    let mut out = vec![0xA5u8; len];
    device.make_current().unwrap();
    // SAFETY: out holds len bytes; the buffer holds len bytes.
    let code = unsafe { call!(device.driver(), cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), ptr, len)) };
    assert_eq!(code.unwrap(), CUDA_SUCCESS);
    out
}

fn driver_free_memory(device: &Device) -> u64 {
    device.make_current().unwrap();
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: writes two sizes.
    let code = unsafe { call!(device.driver(), cuMemGetInfo_v2(&mut free, &mut total)) };
    assert_eq!(code.unwrap(), CUDA_SUCCESS);
    free as u64
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn info_describes_the_device() {
    let count = Device::count().unwrap();
    assert!(count >= 1);
    let d = device();
    let info = d.info();
    println!("{info:?}");
    assert!(!info.name.is_empty());
    assert!(info.total_memory >= 1 << 30);
    assert!(info.compute_capability.0 >= 5);
    assert!(info.copy_engines >= 1 && info.multiprocessors >= 1);
    assert!(info.driver_version.major() >= 12);
    assert!(info.pci_bus_id.contains(':'));
    assert!(
        matches!(Device::open(count), Err(Error::NoSuchDevice { ordinal, count: c }) if ordinal == count && c == count)
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn allocations_hold_their_bytes() {
    let d = device();
    let mut rng = fastrand::Rng::with_seed(0xA110C);
    let sizes = [1usize, 255, 256, 4097, (1 << 20) + 3, 5 << 20, 70 << 20];
    let buffers: Vec<_> = sizes.iter().map(|&len| d.allocate(len as u64).unwrap()).collect();
    let data: Vec<_> = sizes.iter().map(|&len| random_bytes(&mut rng, len)).collect();
    // Write everything first, then read everything: a neighbour's write must not clobber.
    for (b, bytes) in buffers.iter().zip(&data) {
        raw_write(&d, *b, bytes);
    }
    for (b, bytes) in buffers.iter().zip(&data) {
        assert!(raw_read(&d, *b) == *bytes, "buffer of {} bytes changed", bytes.len());
        assert_eq!(d.device_ptr(*b).unwrap() % 256, 0);
    }
    for b in buffers {
        d.free(b).unwrap();
    }
    assert_eq!(d.allocated_bytes(), 0);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn the_budget_is_enforced_with_a_small_fraction() {
    let config = Config::default().with_budget_fraction(0.01);
    let d = Device::open_configured(0, config.clone()).unwrap();
    assert_eq!(d.config().budget_fraction, config.budget_fraction, "opened with the config given");
    let total = d.info().total_memory;
    let mut held = Vec::new();
    let err = loop {
        match d.allocate(96 << 20) {
            Ok(b) => held.push(b),
            Err(e) => break e,
        }
        assert!(held.len() < 10_000, "the budget never refused");
    };
    let Error::OverBudget { requested, needed, held: held_bytes, in_use, library, limit, .. } = err else {
        panic!("{err}")
    };
    assert_eq!(requested, 96 << 20);
    assert!(held_bytes + needed > limit && held_bytes >= in_use + library, "{err}");
    assert!(d.allocated_bytes() as f64 <= 0.01 * total as f64, "{} held of {total}", d.allocated_bytes());
    assert!(d.telemetry().memory.reserved_bytes as f64 <= 0.01 * total as f64);
    for b in held {
        d.free(b).unwrap();
    }
    assert_eq!(d.allocated_bytes(), 0);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_free_during_an_upload_is_deferred_until_it_completes() {
    let d = device();
    const LEN: usize = 512 << 20; // about 10 ms on the wire
    let mut rng = fastrand::Rng::with_seed(0xDEF);
    let mut src = d.pinned(LEN).unwrap();
    rng.fill(&mut src);
    let a = d.allocate(LEN as u64).unwrap();
    let a_ptr = d.device_ptr(a).unwrap();
    // SAFETY: src is pinned, LEN bytes, and lives until the fence is waited on below.
    let fence = unsafe { d.upload_async_at(a, 0, src.as_ptr(), LEN) }.unwrap();
    d.free(a).unwrap();
    assert!(!fence.is_complete().unwrap(), "the copy should still be in flight");
    let stats = d.telemetry().memory;
    assert_eq!(stats.deferred_frees, 1);
    assert_eq!(stats.deferred_bytes, LEN as u64);
    // The memory is not handed out again while the copy writes it.
    let b = d.allocate(LEN as u64).unwrap();
    assert_ne!(d.device_ptr(b).unwrap(), a_ptr);
    fence.wait().unwrap();
    assert!(fence.is_complete().unwrap());
    d.free(b).unwrap();
    d.trim().unwrap();
    let stats = d.telemetry().memory;
    assert_eq!((stats.deferred_bytes, stats.allocated_bytes), (0, 0));
}

/// A buffer past the slab size, freed, is kept: the next allocation it fits gets the same
/// memory without a driver call, holds what is written to it, and trim gives it back.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_freed_large_buffer_is_kept_reused_and_trimmed() {
    let d = device();
    const LEN: usize = 200 << 20;
    let mut rng = fastrand::Rng::with_seed(0x4EE9);
    let a = d.allocate(LEN as u64).unwrap();
    let a_ptr = d.device_ptr(a).unwrap();
    d.free(a).unwrap();
    let held = driver_free_memory(&d);
    let before = d.telemetry().memory;
    assert_eq!(before.kept_bytes, LEN as u64);
    let b = d.allocate(LEN as u64 - 4096).unwrap();
    assert_eq!(d.device_ptr(b).unwrap(), a_ptr, "the kept block serves it");
    let after = d.telemetry().memory;
    assert_eq!((after.driver_allocations, after.kept_bytes), (before.driver_allocations, 0));
    assert_eq!(driver_free_memory(&d), held, "no memory taken from the driver");
    let data = random_bytes(&mut rng, LEN - 4096);
    raw_write(&d, b, &[0xA5; 16]);
    d.upload(b, &data).unwrap();
    assert!(d.download(b).unwrap() == data, "the reused memory holds what was written");
    d.free(b).unwrap();
    // The copies may have made the lanes' device staging, which trim keeps: compare from here.
    let before_trim = driver_free_memory(&d);
    assert!(d.trim().unwrap() >= LEN as u64);
    assert_eq!(d.telemetry().memory.kept_bytes, 0);
    assert!(driver_free_memory(&d) >= before_trim + LEN as u64, "trim gave it back to the driver");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn async_copies_round_trip_and_order_across_lanes() {
    let d = device();
    let mut rng = fastrand::Rng::with_seed(0x1a4e);
    const LEN: usize = 64 << 20;
    let mut src = d.pinned(LEN).unwrap();
    rng.fill(&mut src);
    let mut dst = d.pinned(LEN).unwrap();
    dst.fill(0x5A);
    let buffer = d.allocate(LEN as u64).unwrap();
    // SAFETY: both regions are pinned, LEN bytes, alive and untouched until the fences are
    // waited on.
    let (up, down) = unsafe {
        let up = d.upload_async_at(buffer, 0, src.as_ptr(), LEN).unwrap();
        // Submitted at once on the other lane: it must wait for the upload on the device.
        let down = d.download_async_at(buffer, 0, dst.as_mut_ptr(), LEN).unwrap();
        (up, down)
    };
    down.wait().unwrap();
    assert!(up.is_complete().unwrap(), "the download waited for the upload");
    assert!(dst[..] == src[..], "read-after-write across lanes returned other bytes");
    let t = d.telemetry();
    assert!(t.upload_submissions >= 1 && t.download_submissions >= 1);
    d.free(buffer).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn bad_handles_and_ranges_are_errors() {
    let d = device();
    let other = Device::open(0).unwrap(); // a second Device: its own allocator
    let b = d.allocate(4096).unwrap();
    let theirs = other.allocate(4096).unwrap();
    let data = [1u8; 16];
    assert!(matches!(d.free(theirs), Err(Error::ForeignBuffer { .. })));
    assert!(matches!(d.device_ptr(theirs), Err(Error::ForeignBuffer { .. })));
    // SAFETY: each call fails validation before anything is enqueued.
    unsafe {
        assert!(matches!(d.upload_async_at(b, 4090, data.as_ptr(), 16), Err(Error::OutOfRange { .. })));
        assert!(matches!(d.upload_async_at(b, u64::MAX, data.as_ptr(), 16), Err(Error::OutOfRange { .. })));
        assert!(matches!(d.upload_async_at(theirs, 0, data.as_ptr(), 16), Err(Error::ForeignBuffer { .. })));
        // Pageable memory on the asynchronous path.
        let err = d.upload_async_at(b, 0, data.as_ptr(), 16).unwrap_err();
        assert!(matches!(err, Error::NotPinned { .. }), "{err}");
        assert!(err.to_string().contains("Device::upload_async_at"), "{err}");
        let mut out = [0u8; 16];
        let err = d.download_async_at(b, 0, out.as_mut_ptr(), 16).unwrap_err();
        assert!(matches!(err, Error::NotPinned { .. }), "{err}");
    }
    assert_eq!(d.telemetry().upload_submissions + d.telemetry().download_submissions, 0);
    // Pinned memory passes; a range that runs past a pinned region does not.
    let mut host = vec![3u8; 8192];
    // SAFETY: the vector's memory stays mapped until unpinned below; nothing is in flight
    // when it is unpinned (every fence is waited on).
    unsafe {
        d.pin_host(host.as_mut_ptr(), 4096).unwrap();
        d.upload_async_at(b, 0, host.as_ptr(), 4096).unwrap().wait().unwrap();
        let err = d.upload_async_at(b, 0, host.as_ptr().add(100), 4096).unwrap_err();
        match err {
            // The first byte past the pinned region.
            Error::NotPinned { unpinned, .. } => assert_eq!(unpinned, host.as_ptr() as usize + 4096),
            other => panic!("expected NotPinned, got {other}"),
        }
        d.unpin_host(host.as_mut_ptr()).unwrap();
        assert!(matches!(d.upload_async_at(b, 0, host.as_ptr(), 16), Err(Error::NotPinned { .. })));
    }
    let mut pinned = d.pinned(4096).unwrap();
    fastrand::Rng::with_seed(0x9177).fill(&mut pinned);
    // SAFETY: pinned, 4096 bytes, alive until the fence is waited on.
    unsafe { d.upload_async_at(b, 0, pinned.as_ptr(), 4096) }.unwrap().wait().unwrap();
    assert_eq!(d.download(b).unwrap()[..4096], pinned[..]);
    assert!(matches!(d.allocate(0), Err(Error::ZeroSizedAllocation)));
    d.free(b).unwrap();
    assert!(matches!(d.free(b), Err(Error::FreedBuffer { .. })));
    assert!(matches!(d.device_ptr(b), Err(Error::FreedBuffer { .. })));
    other.free(theirs).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn many_threads_allocating_at_once_keep_the_accounting_exact() {
    let d = device();
    d.trim().unwrap();
    let baseline = driver_free_memory(&d);
    let threads: Vec<_> = (0..16)
        .map(|t| {
            let d = d.clone();
            std::thread::spawn(move || {
                let mut rng = fastrand::Rng::with_seed(t);
                let mut live: Vec<(ResidentBuffer, u64)> = Vec::new();
                for _ in 0..20_000 {
                    if live.len() < 64 && (rng.bool() || live.is_empty()) {
                        let len =
                            if rng.u8(..) == 0 { rng.u64(4 << 20..80 << 20) } else { rng.u64(1..=1 << 20) };
                        live.push((d.allocate(len).unwrap(), len));
                    } else {
                        let (b, len) = live.swap_remove(rng.usize(..live.len()));
                        assert_eq!(d.buffer_len(b).unwrap(), len);
                        d.free(b).unwrap();
                    }
                }
                for (b, _) in live {
                    d.free(b).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let stats = d.telemetry().memory;
    assert_eq!((stats.allocated_bytes, stats.footprint_bytes, stats.buffers), (0, 0, 0));
    assert_eq!(stats.allocations, stats.frees);
    assert_eq!(stats.reserved_bytes, stats.cached_bytes + stats.slab_free_bytes + stats.dedicated_bytes);
    d.trim().unwrap();
    assert_eq!(d.telemetry().memory.reserved_bytes, 0);
    // The driver agrees that everything went back.
    let after = driver_free_memory(&d);
    assert!(after + (4 << 20) >= baseline, "driver free memory {after} vs {baseline} before");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn pinned_staging_is_reused_and_capped() {
    let config = Config::default().with_pinned_cap_bytes(32 << 20).with_chunk_bytes(1 << 20);
    let d = Device::open_on_driver(Arc::clone(device().driver()), 0, config).unwrap();
    let first = d.pinned(1 << 20).unwrap();
    let ptr = first.as_ptr();
    drop(first);
    let again = d.pinned(1 << 20).unwrap();
    assert_eq!(again.as_ptr(), ptr, "the arena came back from the pool");
    let stats = d.telemetry().pinned;
    assert_eq!((stats.hits, stats.misses), (1, 1));
    assert!(matches!(d.pinned(64 << 20), Err(Error::PinnedCapExceeded { .. })));
    // Pinned buffers may hold the cap less the reserve kept for transfers (8 chunks here).
    drop(again);
    let hold: Vec<_> = (0..12).map(|_| d.pinned(2 << 20).unwrap()).collect();
    let err = d.pinned(2 << 20).unwrap_err();
    assert!(
        matches!(err, Error::PinnedReserved { held, limit, .. } if held == 24 << 20 && limit == 24 << 20),
        "{err}"
    );
    // The reserve is a transfer's: in-place writes (staging of their own) take it; one past
    // the cap, with no copy in flight to wait for, is refused and poisons its batch.
    let buffer = d.allocate(16 << 20).unwrap();
    let mut batch = d.uploads();
    batch.write_with(buffer, 0, 4 << 20, |dst| dst.fill(1)).unwrap();
    let err = batch.write_with(buffer, 4 << 20, 4 << 20, |dst| dst.fill(2)).map(|_| ()).unwrap_err();
    assert!(matches!(err, Error::PinnedExhausted { .. }), "{err}");
    drop(batch);
    d.free(buffer).unwrap();
    drop(hold);
    assert!(d.pinned(4 << 20).is_ok(), "free arenas of other sizes make room");
    let _ = cuda_sys::CUDA_SUCCESS;
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_fence_makes_a_callers_stream_wait() {
    let d = device();
    let mut rng = fastrand::Rng::with_seed(0xFE);
    const LEN: usize = 32 << 20;
    let mut src = d.pinned(LEN).unwrap();
    rng.fill(&mut src);
    let mut dst = d.pinned(LEN).unwrap();
    dst.fill(0);
    let buffer = d.allocate(LEN as u64).unwrap();
    let ptr = d.device_ptr(buffer).unwrap();
    let stream = caller_stream(&d);
    // SAFETY: the stream belongs to the device's context; the copies use pinned
    // regions of LEN bytes that outlive the synchronize below.
    unsafe {
        let fence = d.upload_async_at(buffer, 0, src.as_ptr(), LEN).unwrap();
        fence.make_stream_wait(stream).unwrap();
        let copy = call!(d.driver(), cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), ptr, LEN, stream));
        assert_eq!(copy.unwrap(), 0);
    }
    finish_stream(&d, stream);
    assert!(dst[..] == src[..], "the caller's stream did not wait for the upload");
    d.free(buffer).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn copies_wait_for_a_callers_stream() {
    // The caller's stream is held by a flag in pinned host memory (cuStreamWaitValue32; with
    // unified addressing the host address is the device address) and then writes the buffer:
    // a download submitted after wait_for_stream may only run once the host sets the flag,
    // and then sees the stream's bytes. The host sets it with a plain store, no driver call
    // (which a tool serializing streams could hold behind the blocked stream).
    let d = device();
    const LEN: usize = 1 << 20;
    let buffer = d.allocate(LEN as u64).unwrap();
    raw_write(&d, buffer, &vec![0x11; LEN]);
    let mut flag = d.pinned(4).unwrap();
    flag.fill(0);
    let flag_word = flag.as_mut_ptr().cast::<u32>();
    let ptr = d.device_ptr(buffer).unwrap();
    let stream = caller_stream(&d);
    // SAFETY: a stream of the device's context; the wait names pinned memory that outlives
    // the stream's work (synchronized below), the memset a live buffer.
    unsafe {
        let at = flag_word as cuda_sys::CUdeviceptr;
        let wait =
            call!(d.driver(), cuStreamWaitValue32_v2(stream, at, 1, cuda_sys::CU_STREAM_WAIT_VALUE_GEQ));
        assert_eq!(wait.unwrap(), 0);
        assert_eq!(call!(d.driver(), cuMemsetD8Async(ptr, 0x5A, LEN, stream)).unwrap(), 0);
        d.wait_for_stream(stream).unwrap();
    }
    // Another thread releases the stream after a while, so that nothing here can wait for it
    // forever (a tool that serializes work may block a submission behind the stream).
    let released = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let releaser = {
        let (released, word) = (std::sync::Arc::clone(&released), flag_word as usize);
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            released.store(true, std::sync::atomic::Ordering::SeqCst);
            // SAFETY: 4 aligned bytes of pinned memory that the test keeps alive until this
            // thread is joined; the GPU only reads them.
            unsafe { std::ptr::write_volatile(word as *mut u32, 1) };
        })
    };
    // An upload submitted now lands after the stream's memset (the upload lane waits too),
    // and the download sees it over the memset's bytes.
    let mut up = d.uploads();
    up.write(buffer, 0, &[0x77; 4096]).unwrap();
    let uploaded = up.submit().unwrap();
    let mut reads = d.downloads();
    let slot = reads.read(buffer, 0, LEN as u64).unwrap();
    let pending = reads.submit().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert!(!uploaded.is_complete().unwrap() || released.load(std::sync::atomic::Ordering::SeqCst));
    let complete = pending.fence().is_complete().unwrap();
    assert!(
        !complete || released.load(std::sync::atomic::Ordering::SeqCst),
        "the download ran before the caller's stream"
    );
    let done = pending.wait().unwrap();
    releaser.join().unwrap();
    let got = done.get(slot);
    assert!(got[..4096].iter().all(|&b| b == 0x77), "the upload landed before the stream's memset");
    assert!(got[4096..].iter().all(|&b| b == 0x5A), "the download did not see the stream's bytes");
    finish_stream(&d, stream);
    d.free(buffer).unwrap();
}

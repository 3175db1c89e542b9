//! `OwnedBuffer` on the model driver: every way its buffer can be freed (drop, `free`,
//! by hand through a copy of the handle, not at all with `into_raw`), frees the driver or a
//! view refuses, drops while copies are in flight, the device dropped first, and threads
//! allocating and dropping at once.

use std::sync::Arc;

use cuda_sys::{CUDA_ERROR_INVALID_CONTEXT, Fault};

use crate::testing::{device, model, random_vec, small_chunks};
use crate::{Config, Device, Error, OwnedBuffer};

/// The caller's bytes and buffers, and the frees counted.
fn held(d: &Device) -> (u64, u64, u64) {
    let t = d.telemetry().memory;
    (d.allocated_bytes(), t.buffers, t.frees)
}

fn no_model_errors(what: &str) {
    let errors = model::with(|g| g.errors.clone());
    assert!(errors.is_empty(), "{what}: model found {errors:?}");
}

#[test]
fn dropping_the_owner_frees_its_buffer() {
    let d = device(small_chunks());
    let (bytes, buffers, frees) = held(&d);
    // A class size, one past the slab size's classes, and a dedicated allocation.
    for len in [1u64, 4096, 300_000, 100 << 20] {
        let owned = d.allocate_owned(len).unwrap();
        assert_eq!((owned.len(), owned.is_empty()), (len, false));
        assert_eq!(d.buffer_len(*owned).unwrap(), len);
        assert_eq!(owned.handle(), *owned);
        assert_eq!(held(&d).0, bytes + len);
        let handle = *owned;
        drop(owned);
        assert!(matches!(d.buffer_len(handle), Err(Error::FreedBuffer { .. })), "{len}: the handle dies");
    }
    assert_eq!(held(&d), (bytes, buffers, frees + 4));
}

#[test]
fn the_handle_moves_bytes_as_any_handle_does() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(7001);
    let owned = d.allocate_owned(70_000).unwrap();
    let bytes = random_vec(&mut rng, 70_000);
    let mut up = d.uploads();
    up.write(*owned, 0, &bytes).unwrap();
    up.submit().unwrap().wait().unwrap();
    assert!(owned.device().download(*owned).unwrap() == bytes);
    let mut reads = d.downloads();
    let slot = reads.read(owned.handle(), 5, 100).unwrap();
    assert!(reads.submit().unwrap().wait().unwrap().get(slot) == &bytes[5..105]);
    no_model_errors("owned handle");
}

#[test]
fn a_drop_while_an_upload_is_in_flight_is_deferred_until_its_fence() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(7002);
    let (bytes, buffers, _) = held(&d);
    // Sizes of a class (cached for reuse) and of a range of a slab.
    for len in [4096usize, 300_000] {
        let owned = d.allocate_owned(len as u64).unwrap();
        let old = d.device_ptr(*owned).unwrap();
        let data = random_vec(&mut rng, len);
        let mut up = d.uploads();
        up.write(*owned, 0, &data).unwrap();
        let fence = up.submit().unwrap();
        assert!(!fence.is_complete().unwrap(), "the model runs nothing until a wait");
        let before = d.telemetry().memory;
        drop(owned);
        let after = d.telemetry().memory;
        assert_eq!(after.deferred_frees, before.deferred_frees + 1, "{len}: the free waits for the upload");
        assert!(after.deferred_bytes >= len as u64, "{len}: {after:?}");
        assert_eq!(
            (d.allocated_bytes(), after.buffers),
            (bytes, buffers),
            "{len}: the caller's bytes are free"
        );
        // While the upload is in flight its memory is not handed out again, to either kind
        // of allocation.
        let again = d.allocate_owned(len as u64).unwrap();
        let other = d.allocate(len as u64).unwrap();
        assert!(
            ![d.device_ptr(*again).unwrap(), d.device_ptr(other).unwrap()].contains(&old),
            "{len}: reused"
        );
        d.free(other).unwrap();
        drop(again);
        fence.wait().unwrap();
        // Once it completed, the next trim reclaims the memory.
        d.trim().unwrap();
        assert_eq!(d.telemetry().memory.deferred_bytes, 0, "{len}");
        no_model_errors("deferred drop");
    }
    assert_eq!((d.allocated_bytes(), d.telemetry().memory.buffers), (bytes, buffers));
}

#[test]
fn into_raw_gives_the_handle_up_without_freeing_it_and_adopt_takes_it_back() {
    let d = device(small_chunks());
    let (bytes, buffers, frees) = held(&d);
    let owned = d.allocate_owned(5000).unwrap();
    let raw = owned.into_raw();
    assert_eq!(d.buffer_len(raw).unwrap(), 5000, "still live");
    assert_eq!(held(&d), (bytes + 5000, buffers + 1, frees));
    d.upload(raw, &[9u8; 5000]).unwrap();
    // Back into an owner, with its length.
    let owned = d.adopt(raw).unwrap();
    assert_eq!((*owned, owned.len()), (raw, 5000));
    assert!(d.download(*owned).unwrap() == [9u8; 5000]);
    drop(owned);
    assert_eq!(held(&d), (bytes, buffers, frees + 1));
    // A freed handle and another device's are refused, with a fix; nothing is freed.
    let e = d.adopt(raw).unwrap_err();
    assert!(matches!(e, Error::FreedBuffer { .. }) && e.to_string().contains("Fix:"), "{e}");
    let other = device(small_chunks());
    let foreign = other.allocate(100).unwrap();
    let e = d.adopt(foreign).unwrap_err();
    assert!(matches!(e, Error::ForeignBuffer { .. }) && e.to_string().contains("Fix:"), "{e}");
    assert_eq!(other.buffer_len(foreign).unwrap(), 100);
    assert_eq!(held(&d), (bytes, buffers, frees + 1));
}

#[test]
fn an_explicit_free_reports_and_the_drop_does_not_free_again() {
    let d = device(small_chunks());
    let (bytes, buffers, frees) = held(&d);
    let owned = d.allocate_owned(4096).unwrap();
    let handle = *owned;
    owned.free().unwrap();
    assert!(matches!(d.buffer_len(handle), Err(Error::FreedBuffer { .. })));
    assert_eq!(held(&d), (bytes, buffers, frees + 1), "freed once");
    // A new buffer may take the slot and the memory: the spent owner must not touch it.
    let next = d.allocate_owned(4096).unwrap();
    assert_eq!(d.buffer_len(*next).unwrap(), 4096);
    drop(next);
    assert_eq!(held(&d), (bytes, buffers, frees + 2));
    // `free` of a handle freed by hand reports it.
    let owned = d.allocate_owned(4096).unwrap();
    d.free(*owned).unwrap();
    let e = owned.free().unwrap_err();
    assert!(matches!(e, Error::FreedBuffer { .. }) && e.to_string().contains("Fix:"), "{e}");
    assert_eq!(held(&d), (bytes, buffers, frees + 3));
}

#[test]
fn a_handle_freed_by_hand_makes_the_drop_a_no_op() {
    let d = device(small_chunks());
    let (bytes, buffers, frees) = held(&d);
    let owned = d.allocate_owned(300_000).unwrap();
    d.free(*owned).unwrap();
    // Its slot and memory taken by another buffer before the owner drops.
    let reused = d.allocate(300_000).unwrap();
    d.upload(reused, &vec![3u8; 300_000]).unwrap();
    drop(owned);
    assert_eq!(d.buffer_len(reused).unwrap(), 300_000, "the other buffer lives on");
    assert!(d.download(reused).unwrap().iter().all(|&b| b == 3));
    assert_eq!(held(&d), (bytes + 300_000, buffers + 1, frees + 1), "counted once");
    d.free(reused).unwrap();
    assert_eq!(held(&d), (bytes, buffers, frees + 2));
}

#[test]
fn a_driver_free_refused_by_trim_keeps_the_memory_counted_and_the_next_trim_retries_it() {
    let driver = model::driver();
    let d = Device::open_on_driver(Arc::clone(&driver), 0, small_chunks()).expect("the model opens");
    let big = 100u64 << 20; // past the slab size: a cuMemAlloc of its own, kept when freed
    let (bytes, buffers, _) = held(&d);
    // Dropped or freed, the block is kept for reuse: no driver call, nothing to refuse.
    driver.faults().record();
    let owned = d.allocate_owned(big).unwrap();
    let handle = *owned;
    drop(owned);
    assert!(matches!(d.buffer_len(handle), Err(Error::FreedBuffer { .. })));
    assert_eq!((d.allocated_bytes(), d.telemetry().memory.buffers), (bytes, buffers));
    assert_eq!(d.telemetry().memory.kept_bytes, big, "kept for reuse");
    d.allocate_owned(big).unwrap().free().unwrap();
    let frees = driver.faults().counts().get("cuMemFree_v2").map_or(0, |c| c.calls);
    assert_eq!(frees, 0, "a kept block is not freed");
    // The trim gives it back; a refusal there is reported, and the memory (still the
    // driver's) stays counted until the next trim frees it.
    let fault = Fault::new("cuMemFree_v2", 1, CUDA_ERROR_INVALID_CONTEXT).times(u64::MAX);
    driver.faults().inject(fault).unwrap();
    let e = d.trim().unwrap_err();
    assert!(e.to_string().contains("cuMemFree_v2") && e.to_string().contains("Fix:"), "{e}");
    assert!(driver.faults().injected() > 0, "the free reached the driver");
    assert_eq!(d.telemetry().memory.dedicated_bytes, big, "still held, so still counted");
    assert_eq!(d.telemetry().memory.kept_bytes, 0, "no longer offered for reuse");
    driver.faults().clear();
    d.trim().unwrap();
    assert_eq!(d.telemetry().memory.dedicated_bytes, 0, "the trim retried it");
}

/// A cudarc view (its guard, here) refuses the free: the owner's drop leaves the buffer
/// allocated, and a copy of the handle frees it once the view is gone.
#[test]
fn a_drop_refused_by_a_view_leaves_the_buffer_to_a_copy_of_its_handle() {
    let d = device(small_chunks());
    let (bytes, buffers, _) = held(&d);
    let owned = d.allocate_owned(4096).unwrap();
    let handle = *owned;
    let view = d.core().view_guard(handle).unwrap();
    drop(owned);
    assert_eq!(d.buffer_len(handle).unwrap(), 4096, "viewed, so not freed");
    let owned = d.adopt(handle).unwrap();
    assert!(matches!(owned.free(), Err(Error::BufferViewed { views: 1, .. })));
    drop(view);
    d.free(handle).unwrap();
    assert_eq!((d.allocated_bytes(), d.telemetry().memory.buffers), (bytes, buffers));
}

#[test]
fn the_owner_keeps_its_device_open_after_the_caller_drops_it() {
    let d = device(small_chunks());
    let owned = d.allocate_owned(70_000).unwrap();
    let pending = {
        let mut up = d.uploads();
        up.write(*owned, 0, &[5u8; 70_000]).unwrap();
        up.submit().unwrap()
    };
    drop(d);
    // The device lives on in the owner: it still moves bytes through it.
    let device = owned.device();
    pending.wait().unwrap();
    assert!(device.download(*owned).unwrap() == [5u8; 70_000]);
    assert_eq!(device.allocated_bytes(), 70_000);
    assert!(format!("{owned:?}").contains("OwnedBuffer"), "{owned:?}");
    // The last owner drops the device with it, with an upload in flight: no panic.
    let mut up = device.uploads();
    up.write(*owned, 100, &[6u8; 300]).unwrap();
    let fence = up.submit().unwrap();
    drop(owned);
    fence.wait().unwrap();
    no_model_errors("device dropped first");
}

#[test]
fn owners_of_two_devices_drop_in_any_order() {
    let (a, b) = (device(Config::default()), device(Config::default()));
    let owned: Vec<OwnedBuffer> =
        (0..8).map(|i| (if i % 2 == 0 { &a } else { &b }).allocate_owned(1 << 10).unwrap()).collect();
    drop((a, b));
    for (i, o) in owned.into_iter().enumerate().rev() {
        assert_eq!(o.device().allocated_bytes(), (i as u64 / 2 + 1) << 10);
        drop(o);
    }
}

#[test]
fn many_threads_allocate_and_drop_owned_buffers() {
    let d = device(small_chunks());
    let gpu = model::shared();
    let (bytes, buffers, frees) = held(&d);
    let threads = 8;
    let rounds = 200;
    std::thread::scope(|s| {
        for t in 0..threads {
            let (d, gpu) = (d.clone(), Arc::clone(&gpu));
            s.spawn(move || {
                model::join(gpu);
                let mut rng = fastrand::Rng::with_seed(7100 + t);
                let mut kept: Vec<OwnedBuffer> = Vec::new();
                for round in 0..rounds {
                    let len = match rng.u8(..4) {
                        0 => rng.u64(1..=256),
                        1 => rng.u64(1..=64 << 10),
                        2 => rng.u64(1..=1 << 20),
                        _ => rng.u64(4 << 20..=6 << 20),
                    };
                    let owned = d.allocate_owned(len).unwrap();
                    assert_eq!(owned.len(), len);
                    if round % 16 == 0 {
                        d.upload_at(*owned, 0, &[t as u8; 64][..len.min(64) as usize]).unwrap();
                    }
                    kept.push(owned);
                    // Drop one at random, sometimes several, some sent to another thread.
                    while kept.len() > rng.usize(0..6) {
                        let o = kept.swap_remove(rng.usize(..kept.len()));
                        if rng.bool() {
                            let gpu = model::shared();
                            std::thread::spawn(move || {
                                model::join(gpu);
                                drop(o)
                            })
                            .join()
                            .unwrap();
                        } else {
                            drop(o);
                        }
                    }
                }
            });
        }
    });
    let after = held(&d);
    assert_eq!((after.0, after.1), (bytes, buffers), "every buffer freed once");
    assert!(after.2 >= frees + threads * rounds as u64, "{after:?}");
    no_model_errors("threads");
}

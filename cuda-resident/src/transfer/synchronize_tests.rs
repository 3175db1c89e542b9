//! `Device::synchronize_uploads` and `Device::synchronize_downloads` on the model driver:
//! each waits for every copy of its own lane, from any thread, and leaves the other lane's
//! alone.

use std::sync::Arc;

use crate::testing::{device, model, random_vec};
use crate::{Config, Device, ResidentBuffer};

/// The bytes of `buffer` on the model GPU as they are now, whatever is queued for them.
fn device_bytes(d: &Device, buffer: ResidentBuffer, len: usize) -> Vec<u8> {
    let at = d.device_ptr(buffer).unwrap() as usize as *const u8;
    // SAFETY: on the model driver device memory is host memory at the address it hands out;
    // `buffer` is live and at least `len` long, and the model carries out queued copies
    // only inside driver calls, none of which runs while this reads.
    unsafe { std::slice::from_raw_parts(at, len) }.to_vec()
}

#[test]
fn synchronizing_one_lane_waits_for_its_copies_from_any_thread_and_only_those() {
    let d = device(Config::default());
    let mut rng = fastrand::Rng::with_seed(7);
    let (up, down) = (d.allocate(4096).unwrap(), d.allocate(4096).unwrap());
    let (data, held) = (random_vec(&mut rng, 4096), random_vec(&mut rng, 4096));
    d.upload(down, &held).unwrap();
    let before = device_bytes(&d, up, 4096);
    let mut src = d.pinned(4096).unwrap();
    src.copy_from_slice(&data);
    let mut back = d.pinned(4096).unwrap();
    let (src_at, back_at) = (src.as_ptr() as usize, back.as_mut_ptr() as usize);
    // Two other threads submit one copy each and drop its fence: nothing waits for them.
    let gpu = model::shared();
    std::thread::scope(|s| {
        let (d, up_gpu, down_gpu) = (&d, Arc::clone(&gpu), Arc::clone(&gpu));
        s.spawn(move || {
            model::join(up_gpu);
            // SAFETY: pinned, 4096 bytes, alive and unchanged until synchronized below.
            drop(unsafe { d.upload_async_at(up, 0, src_at as *const u8, 4096) }.unwrap());
        });
        s.spawn(move || {
            model::join(down_gpu);
            // SAFETY: pinned, 4096 bytes, alive and untouched until synchronized below.
            drop(unsafe { d.download_async_at(down, 0, back_at as *mut u8, 4096) }.unwrap());
        });
    });
    assert_ne!(&back[..], &held[..], "the model carries copies out only when the host waits");

    d.synchronize_downloads().unwrap();
    assert_eq!(&back[..], &held[..], "the other thread's download landed");
    assert_eq!(device_bytes(&d, up, 4096), before, "the upload lane was left alone");

    d.synchronize_uploads().unwrap();
    assert_eq!(device_bytes(&d, up, 4096), data, "the other thread's upload landed");
    let t = d.telemetry();
    assert_eq!((t.upload_submissions, t.download_submissions), (2, 1));
    // Nothing in flight: both return at once.
    d.synchronize_downloads().unwrap();
    d.synchronize_uploads().unwrap();
    drop((src, back));
    d.free(up).unwrap();
    d.free(down).unwrap();
}

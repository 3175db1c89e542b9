//! Edges of the single-copy and convenience paths, on the model driver: whole-buffer uploads
//! of another length, copies and pins of zero bytes, pinned memory given to the unsafe
//! asynchronous copies.

use std::sync::Arc;

use crate::fake_driver;
use crate::{Config, Device, Error, Fence};

fn device(config: Config) -> (Arc<cuda_sys::Driver>, Device) {
    let driver = fake_driver::driver();
    let d = Device::open_with(Arc::clone(&driver), 0, config).expect("the model opens");
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
    assert_eq!(d.telemetry().upload_submissions, before, "nothing moved");
    assert_eq!(d.download(b).unwrap(), vec![1u8; 4096]);
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
    assert_eq!(d.telemetry().upload_submissions + d.telemetry().readback_submissions, 0);
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

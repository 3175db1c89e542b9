//! cuda-resident beside cudarc on a real GPU (feature `cudarc`): an upload, a cudarc kernel
//! and a download ordered on the GPU only, and the view's checks.
#![cfg(feature = "cudarc")]

use cuda_resident::cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cuda_resident::{Device, Error};
use cudarc::nvrtc::Ptx;

/// `add_one(u8 *data, u32 n)`: `data[i] += 1` for every `i < n`.
const ADD_ONE_PTX: &str = include_str!("kernels/add_one.ptx");

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn an_upload_a_cudarc_kernel_and_a_download_are_ordered_on_the_gpu() {
    upload_kernel_download(false);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_download_ordered_after_a_cudarc_kernel_by_its_event_reads_what_it_wrote() {
    upload_kernel_download(true);
}

/// An upload, a cudarc kernel after its fence, and a download after the kernel: ordered
/// after the kernel's stream, or after an event recorded on it (`by_event`).
fn upload_kernel_download(by_event: bool) {
    let device = Device::open(0).unwrap();
    let ctx = CudaContext::new(device.info().ordinal).unwrap();
    assert_eq!(ctx.cu_ctx().cast::<()>(), device.cu_context().cast::<()>(), "one primary context");
    let stream = ctx.new_stream().unwrap();
    let kernel = ctx.load_module(Ptx::from_src(ADD_ONE_PTX)).unwrap().load_function("add_one").unwrap();

    const ROWS: u64 = 2048;
    const ROW: u64 = 300;
    let buffer = device.allocate(ROWS * ROW).unwrap();
    let rows: Vec<Vec<u8>> = (0..ROWS).map(|i| (0..ROW).map(|j| (i * 13 + j) as u8).collect()).collect();
    let host_waits = device.telemetry().host_waits;

    let mut uploads = device.uploads();
    for (i, r) in rows.iter().enumerate() {
        uploads.write(buffer, i as u64 * ROW, r).unwrap();
    }
    uploads.submit().unwrap().make_cudarc_stream_wait(&stream).unwrap();

    let mut view = device.cudarc_view::<u8>(buffer, &stream).unwrap();
    assert_eq!(view.len() as u64, ROWS * ROW);
    assert_eq!(view.device_address(), device.device_ptr(buffer).unwrap());
    let n = view.len() as u32;
    let mut launch = stream.launch_builder(&kernel);
    launch.arg(&mut view).arg(&n);
    // SAFETY: add_one takes a u8* and a u32, as pushed; the buffer outlives the download.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }.unwrap();

    if by_event {
        let event = stream.record_event(None).unwrap();
        device.wait_for_cudarc_event(&event).unwrap();
    } else {
        device.wait_for_cudarc_stream(&stream).unwrap();
    }
    let mut reads = device.downloads();
    let slots: Vec<_> = (0..ROWS).map(|i| reads.read(buffer, i * ROW, ROW).unwrap()).collect();
    let pending = reads.submit().unwrap();
    assert_eq!(device.telemetry().host_waits, host_waits, "no host wait before the download's own");
    let done = pending.wait().unwrap();
    for (i, (slot, sent)) in slots.iter().zip(&rows).enumerate() {
        let want: Vec<u8> = sent.iter().map(|b| b.wrapping_add(1)).collect();
        assert_eq!(done.get(*slot), &want[..], "row {i}");
    }
    drop(done);
    drop(view);
    device.free(buffer).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_view_refuses_a_length_that_is_not_whole_elements_and_a_freed_buffer() {
    let device = Device::open(0).unwrap();
    let stream = CudaContext::new(device.info().ordinal).unwrap().new_stream().unwrap();
    let odd = device.allocate(10).unwrap();
    let err = device.cudarc_view::<f32>(odd, &stream).unwrap_err();
    assert!(matches!(err, Error::Interop { .. }), "{err}");
    assert!(err.to_string().contains("Fix:"), "{err}");
    assert_eq!(device.cudarc_view::<u16>(odd, &stream).unwrap().len(), 5);
    device.free(odd).unwrap();
    let err = device.cudarc_view::<u8>(odd, &stream).unwrap_err();
    assert!(matches!(err, Error::FreedBuffer { .. }), "{err}");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn the_lanes_refuse_a_stream_of_another_context() {
    let device = Device::open(0).unwrap();
    let Ok(other) = Device::open(1) else { return }; // needs a second GPU
    let stream = CudaContext::new(other.info().ordinal).unwrap().new_stream().unwrap();
    let err = device.wait_for_cudarc_stream(&stream).unwrap_err();
    assert!(matches!(err, Error::Interop { .. }), "{err}");
}

/// A view holds its buffer: `Device::free` of it fails while the view lives; a memset
/// enqueued through the view (safe code) is waited for by the view's drop, so the buffer
/// freed right after and its memory lent to a new buffer keeps the new buffer's bytes.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_view_holds_its_buffer_until_its_work_is_done() {
    let device = Device::open(0).unwrap();
    let stream = CudaContext::new(device.info().ordinal).unwrap().new_stream().unwrap();
    let first = device.allocate(64 << 20).unwrap();
    let mut view = device.cudarc_view::<u8>(first, &stream).unwrap();
    let err = device.free(first).unwrap_err();
    assert!(matches!(err, Error::BufferViewed { views: 1, .. }), "{err}");
    assert!(err.to_string().contains("Fix:"), "{err}");
    // Long enough to be still running when the view drops, unless the drop waits for it.
    for _ in 0..64 {
        stream.memset_zeros(&mut view).unwrap();
    }
    drop(view);
    device.free(first).unwrap();
    let second = device.allocate(64 << 20).unwrap();
    device.upload(second, &vec![7u8; 64 << 20]).unwrap();
    stream.synchronize().unwrap();
    assert!(device.download(second).unwrap().iter().all(|&x| x == 7), "the memset reached the new buffer");
}

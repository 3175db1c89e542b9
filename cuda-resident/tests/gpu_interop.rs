//! Handing a fence's completion to other code on a real GPU: awaited under an executor, as a
//! recorded event a caller's stream waits on, and the lanes waiting on a caller's event.
//! Ignored where there is none: `cargo test -- --include-ignored` on a machine with an NVIDIA
//! GPU.

use cuda_resident::Device;
use cuda_resident::cuda_sys::{self, CUDA_SUCCESS, call};

#[path = "common/streams.rs"]
mod streams;
use streams::{caller_stream, finish_stream};

fn device() -> Device {
    Device::open(0).unwrap_or_else(|e| panic!("{e}"))
}

const LEN: usize = 32 << 20;

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn an_awaited_upload_fence_resolves_after_the_bytes_landed() {
    let d = device();
    let mut src = d.pinned(LEN).unwrap();
    fastrand::Rng::with_seed(0xA7).fill(&mut src);
    let buffer = d.allocate(LEN as u64).unwrap();
    // SAFETY: `src` is pinned, LEN bytes, and outlives the awaited fence.
    let fence = unsafe { d.upload_async_at(buffer, 0, src.as_ptr(), LEN) }.unwrap();
    pollster::block_on(&fence).unwrap();
    assert!(fence.is_complete().unwrap());
    // Awaiting a complete fence resolves at once.
    pollster::block_on(fence).unwrap();
    assert!(d.download(buffer).unwrap() == src[..], "the awaited upload's bytes differ");
    d.free(buffer).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_callers_stream_waits_on_a_fences_event() {
    let d = device();
    let mut src = d.pinned(LEN).unwrap();
    fastrand::Rng::with_seed(0xE7).fill(&mut src);
    let mut dst = d.pinned(LEN).unwrap();
    dst.fill(0);
    let buffer = d.allocate(LEN as u64).unwrap();
    let ptr = d.device_ptr(buffer).unwrap();
    let stream = caller_stream(&d);
    // SAFETY: the stream belongs to the device's context; the copies use pinned regions of
    // LEN bytes that outlive the synchronize below; the event lives until after the wait.
    unsafe {
        let fence = d.upload_async_at(buffer, 0, src.as_ptr(), LEN).unwrap();
        let event = fence.record_event().unwrap().expect("a fence of a device");
        assert_eq!(call!(d.driver(), cuStreamWaitEvent(stream, event.as_raw(), 0)).unwrap(), CUDA_SUCCESS);
        drop(event);
        let copy = call!(d.driver(), cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), ptr, LEN, stream));
        assert_eq!(copy.unwrap(), CUDA_SUCCESS);
    }
    finish_stream(&d, stream);
    assert!(dst[..] == src[..], "the caller's stream did not wait for the fence's event");
    d.free(buffer).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn the_lanes_wait_for_a_callers_event() {
    let d = device();
    const SIZE: usize = 1 << 20;
    let buffer = d.allocate(SIZE as u64).unwrap();
    d.upload(buffer, &vec![0x11; SIZE]).unwrap();
    let mut flag = d.pinned(4).unwrap();
    flag.fill(0);
    let flag_word = flag.as_mut_ptr().cast::<u32>();
    let ptr = d.device_ptr(buffer).unwrap();
    let stream = caller_stream(&d);
    let mut event: cuda_sys::CUevent = std::ptr::null_mut();
    // SAFETY: a stream of the device's context; the wait names pinned memory that outlives
    // the stream's work (synchronized below), the memset a live buffer; the event is made,
    // recorded, handed over and destroyed here.
    unsafe {
        assert_eq!(call!(d.driver(), cuEventCreate(&mut event, 0)).unwrap(), CUDA_SUCCESS);
        let at = flag_word as cuda_sys::CUdeviceptr;
        let wait =
            call!(d.driver(), cuStreamWaitValue32_v2(stream, at, 1, cuda_sys::CU_STREAM_WAIT_VALUE_GEQ));
        assert_eq!(wait.unwrap(), CUDA_SUCCESS);
        assert_eq!(call!(d.driver(), cuMemsetD8Async(ptr, 0x5A, SIZE, stream)).unwrap(), CUDA_SUCCESS);
        assert_eq!(call!(d.driver(), cuEventRecord(event, stream)).unwrap(), CUDA_SUCCESS);
        d.wait_for_event(event).unwrap();
        assert_eq!(call!(d.driver(), cuEventDestroy_v2(event)).unwrap(), CUDA_SUCCESS);
    }
    // Another thread releases the stream after a while, so that nothing here waits forever.
    let releaser = {
        let word = flag_word as usize;
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            // SAFETY: 4 aligned bytes of pinned memory that the test keeps alive until this
            // thread is joined; the GPU only reads them.
            unsafe { std::ptr::write_volatile(word as *mut u32, 1) };
        })
    };
    let back = d.download(buffer).unwrap();
    releaser.join().unwrap();
    assert!(back.iter().all(|&b| b == 0x5A), "the download did not wait for the caller's event");
    finish_stream(&d, stream);
    drop(flag);
    d.free(buffer).unwrap();
}

//! The raw driver against a real GPU. Ignored where there is none; run them with
//! `cargo test -- --ignored` on a machine with an NVIDIA GPU and driver.

use std::ffi::CStr;
use std::os::raw::c_char;

use cuda_sys::*;

fn check(driver: &Driver, what: &str, code: Result<CUresult, MissingSymbol>) {
    let code = code.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(code, CUDA_SUCCESS, "{what} failed: {:?}", driver.error_name(code));
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn load_init_query_and_round_trip_4_kib() {
    let driver = Driver::load().expect("the CUDA driver loads");
    let version = driver.version().expect("the driver reports its version");
    assert!(version.major() >= 12, "driver CUDA version {version}");
    assert_eq!(driver.error_name(CUDA_ERROR_OUT_OF_MEMORY), Some("CUDA_ERROR_OUT_OF_MEMORY"));
    assert!(driver.error_string(CUDA_ERROR_OUT_OF_MEMORY).is_some());

    // SAFETY: each call gets valid pointers to live locals or buffers of
    // the sizes the driver is told, on the current thread's context once one is set.
    unsafe {
        check(&driver, "cuInit", call!(driver, cuInit(0)));
        let mut count = 0;
        check(&driver, "cuDeviceGetCount", call!(driver, cuDeviceGetCount(&mut count)));
        assert!(count >= 1, "no devices");

        let mut device: CUdevice = 0;
        check(&driver, "cuDeviceGet", call!(driver, cuDeviceGet(&mut device, 0)));
        let mut name = [0 as c_char; 256];
        check(&driver, "cuDeviceGetName", call!(driver, cuDeviceGetName(name.as_mut_ptr(), 256, device)));
        let name = CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
        assert!(!name.is_empty());
        let mut total = 0usize;
        check(&driver, "cuDeviceTotalMem_v2", call!(driver, cuDeviceTotalMem_v2(&mut total, device)));
        assert!(total >= 1 << 30, "{name} reports {total} bytes");
        println!("device 0: {name}, {} MiB, driver CUDA {version}", total >> 20);

        let mut ctx: CUcontext = std::ptr::null_mut();
        check(&driver, "cuDevicePrimaryCtxRetain", call!(driver, cuDevicePrimaryCtxRetain(&mut ctx, device)));
        check(&driver, "cuCtxSetCurrent", call!(driver, cuCtxSetCurrent(ctx)));

        const LEN: usize = 4096;
        let mut rng = fastrand::Rng::with_seed(0x5eed_cafe);
        let sent: Vec<u8> = (0..LEN).map(|_| rng.u8(..)).collect();
        let mut back = vec![0xA5u8; LEN]; // poison
        let mut dptr: CUdeviceptr = 0;
        check(&driver, "cuMemAlloc_v2", call!(driver, cuMemAlloc_v2(&mut dptr, LEN)));
        check(&driver, "cuMemsetD8_v2", call!(driver, cuMemsetD8_v2(dptr, 0x5A, LEN)));
        check(&driver, "cuMemcpyHtoD_v2", call!(driver, cuMemcpyHtoD_v2(dptr, sent.as_ptr().cast(), LEN)));
        check(
            &driver,
            "cuMemcpyDtoH_v2",
            call!(driver, cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), dptr, LEN)),
        );
        check(&driver, "cuMemFree_v2", call!(driver, cuMemFree_v2(dptr)));
        check(&driver, "cuDevicePrimaryCtxRelease_v2", call!(driver, cuDevicePrimaryCtxRelease_v2(device)));
        assert!(sent == back, "round trip changed the bytes");
    }
}

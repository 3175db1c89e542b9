//! `Driver::load` honours `CUDA_SYS_LIBCUDA`. This file holds a single test so that it owns
//! its process and may set the environment safely.

use cuda_sys::{Driver, ENV_VAR};

#[test]
fn load_uses_the_library_named_by_the_environment() {
    // SAFETY: this test binary runs exactly one test, so no other thread reads the
    // environment while it is changed.
    unsafe { std::env::set_var(ENV_VAR, "libc.so.6") };
    let driver = Driver::load().expect("the override names a library that exists");
    assert_eq!(driver.path(), std::path::Path::new("libc.so.6"));
    // SAFETY: cuInit is missing from libc, so nothing is called.
    let err = unsafe { cuda_sys::call!(driver, cuInit(0)) }.unwrap_err();
    assert_eq!(err.entry(), "cuInit");

    // SAFETY: as above.
    unsafe { std::env::set_var(ENV_VAR, "/nonexistent/libcuda.so.1") };
    let err = Driver::load().unwrap_err();
    assert_eq!(err.attempts().len(), 1);
    assert!(err.to_string().contains("/nonexistent/libcuda.so.1 (CUDA_SYS_LIBCUDA: "), "{err}");
}

//! xfer-bench: the transfer benchmark, the project's main job.
//!
//! Today it loads the CUDA driver, initialises it and reports the devices it sees; the
//! side-by-side transfer suites build on this. Without a usable driver or GPU it exits with
//! status 2 and one line that says what is missing and how to fix it.

use std::ffi::CStr;
use std::os::raw::c_char;
use std::process::ExitCode;

use cuda_resident_suite::PROVENANCE;
use cuda_sys::{CUDA_SUCCESS, CUresult, Driver, call};

fn fail(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("xfer-bench: {message}");
    ExitCode::from(2)
}

fn driver_error(driver: &Driver, entry: &str, code: CUresult) -> String {
    let name = driver.error_name(code).unwrap_or("an unknown CUresult");
    let fix = if code == cuda_sys::CUDA_ERROR_NO_DEVICE {
        "run on a machine with an NVIDIA GPU, and check that CUDA_VISIBLE_DEVICES does not hide it"
    } else {
        "check that the NVIDIA driver is installed and working (nvidia-smi)"
    };
    format!("{entry} failed with {name} ({code}). Fix: {fix}.")
}

fn main() -> ExitCode {
    let driver = match Driver::load() {
        Ok(driver) => driver,
        Err(e) => return fail(e),
    };
    // SAFETY: cuInit takes a flags word only.
    match unsafe { call!(driver, cuInit(0)) } {
        Ok(CUDA_SUCCESS) => {}
        Ok(code) => return fail(driver_error(&driver, "cuInit", code)),
        Err(e) => return fail(e),
    }
    let mut count = 0;
    // SAFETY: writes one int through a valid pointer.
    match unsafe { call!(driver, cuDeviceGetCount(&mut count)) } {
        Ok(CUDA_SUCCESS) => {}
        Ok(code) => return fail(driver_error(&driver, "cuDeviceGetCount", code)),
        Err(e) => return fail(e),
    }
    let version = driver.version().map_or("unknown".into(), |v| v.to_string());
    println!("xfer-bench | {PROVENANCE}");
    println!("driver {} (CUDA {version}), {count} device(s)", driver.path().display());
    for ordinal in 0..count {
        let mut name = [0 as c_char; 256];
        // SAFETY: the buffer holds 256 bytes, as the call is told; the ordinal is in range.
        let code = unsafe {
            let mut device = 0;
            match call!(driver, cuDeviceGet(&mut device, ordinal)) {
                Ok(CUDA_SUCCESS) => call!(driver, cuDeviceGetName(name.as_mut_ptr(), 256, device)),
                other => other,
            }
        };
        match code {
            Ok(CUDA_SUCCESS) => {
                // SAFETY: the driver wrote a NUL-terminated name into the buffer.
                let name = unsafe { CStr::from_ptr(name.as_ptr()) };
                println!("  {ordinal}: {}", name.to_string_lossy());
            }
            Ok(code) => return fail(driver_error(&driver, "cuDeviceGetName", code)),
            Err(e) => return fail(e),
        }
    }
    ExitCode::SUCCESS
}

//! Helpers shared by the tests that count driver calls: the GPU tests here, and the crate's
//! own tests on the model driver (`src/testing/faults.rs` includes this file).

use std::collections::BTreeMap;

use cuda_sys::CallCount;

/// Acquire / release pairs whose successful calls must balance once every `Device`, fence,
/// download and pinned buffer is gone.
pub const PAIRS: [(&str, &str); 7] = [
    ("cuMemAlloc_v2", "cuMemFree_v2"),
    ("cuMemHostAlloc", "cuMemFreeHost"),
    ("cuMemHostRegister_v2", "cuMemHostUnregister"),
    ("cuStreamCreate", "cuStreamDestroy_v2"),
    ("cuEventCreate", "cuEventDestroy_v2"),
    ("cuModuleLoadData", "cuModuleUnload"),
    ("cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease_v2"),
];

/// Checks that every acquisition counted in `counts` was released; the error names the pair.
pub fn balanced(counts: &BTreeMap<&str, CallCount>) -> Result<(), String> {
    let succeeded = |e: &str| counts.get(e).map_or(0, |c| c.succeeded);
    for (acquire, release) in PAIRS {
        if succeeded(acquire) != succeeded(release) {
            return Err(format!(
                "{acquire} succeeded {} times, {release} {} times: a leak",
                succeeded(acquire),
                succeeded(release)
            ));
        }
    }
    Ok(())
}

/// Compares the device's free memory after a test with before. Under compute-sanitizer
/// (`tests/sanitize.sh` sets `CUDA_RESIDENT_SANITIZER`) the tool's own device allocations
/// move the figure (2 MiB per test seen on the H200 machines), so there the difference is
/// only reported: the sanitizer's `--leak-check full` and the balanced call counts check
/// for leaks instead.
#[allow(dead_code)] // Not every includer compares free memory.
pub fn free_memory_kept(before: u64, after: u64) -> Result<(), String> {
    if before == after {
        return Ok(());
    }
    let text = format!("the driver reports {after} bytes free, {before} before");
    if std::env::var_os("CUDA_RESIDENT_SANITIZER").is_some() {
        eprintln!("{text} (under the sanitizer, reported only)");
        return Ok(());
    }
    Err(format!("{text}: a leak"))
}

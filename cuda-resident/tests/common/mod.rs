//! Helpers shared by the tests that count driver calls: the GPU tests here, and the crate's
//! own tests on the model driver (`src/model_faults.rs` includes this file).

use std::collections::BTreeMap;

use cuda_sys::CallCount;

/// Acquire / release pairs whose successful calls must balance once every `Device`, fence,
/// readback and pinned buffer is gone.
pub const PAIRS: [(&str, &str); 6] = [
    ("cuMemAlloc_v2", "cuMemFree_v2"),
    ("cuMemHostAlloc", "cuMemFreeHost"),
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

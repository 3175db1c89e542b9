//! Locking without poisoning: no code of this crate panics while holding a lock, and a
//! panic in a caller's closure must not turn every later call into a panic too.
//!
//! [`shim`] holds the primitives of the crate's hand-made signalling, which `loom` model-checks
//! (docs/reliability.md).

pub(crate) use std::sync::{Mutex, MutexGuard};

/// Locks `mutex`, ignoring poisoning.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// The primitives that the packing threads' signalling and the lanes' timelines are built
/// from: std's, re-exported as they are, in every ordinary build; `loom`'s when built with
/// `RUSTFLAGS="--cfg loom"`, so that the model checks (the `loom` tests next to that code)
/// run the code that ships under every interleaving of its threads (crossbeam's and tokio's
/// pattern). Code checked that way takes these from here, not from std.
pub(crate) mod shim {
    // Arc and MutexGuard are for the model checks and for `lock` under loom.
    #[cfg(not(loom))]
    #[allow(unused_imports)]
    pub(crate) use std::{
        hint,
        sync::{Arc, Condvar, Mutex, MutexGuard, atomic},
        thread,
    };

    #[cfg(loom)]
    #[allow(unused_imports)]
    pub(crate) use loom::{
        hint,
        sync::{Arc, Condvar, Mutex, MutexGuard, atomic},
        thread,
    };

    /// Locks `mutex`, ignoring poisoning (std's: the same function as [`super::lock`]).
    #[cfg(not(loom))]
    pub(crate) use super::lock;

    /// Locks `mutex`, ignoring poisoning.
    #[cfg(loom)]
    pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
        mutex.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Spawns `f` on a thread of `scope`. In the crate's tests the thread works on the spawning
/// thread's model GPU (the model is per thread), so that its driver calls reach the same
/// device.
#[cfg(feature = "safetensors")]
pub(crate) fn spawn_in<'s, T: Send + 's>(
    scope: &'s std::thread::Scope<'s, '_>,
    f: impl FnOnce() -> T + Send + 's,
) -> std::thread::ScopedJoinHandle<'s, T> {
    #[cfg(test)]
    let gpu = crate::testing::model::shared();
    scope.spawn(move || {
        #[cfg(test)]
        crate::testing::model::join(gpu);
        f()
    })
}

//! Locking without poisoning: no code of this crate panics while holding a lock, and a
//! panic in a caller's closure must not turn every later call into a panic too.

pub(crate) use std::sync::{Mutex, MutexGuard};

/// Locks `mutex`, ignoring poisoning.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

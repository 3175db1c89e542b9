//! Counts of bytes that never go below zero: every subtraction from a count a caller can
//! read ([`AllocatorStats`](crate::AllocatorStats), [`PinnedStats`](crate::PinnedStats),
//! [`TelemetrySnapshot`](crate::TelemetrySnapshot)) goes through here, so that a byte
//! taken off a count it was never added to stops a debug build at the place it happens,
//! naming the count, instead of surfacing later as a figure near 2^64.

use std::sync::atomic::{AtomicU64, Ordering};

/// `*count -= n`; in debug builds, a count that would go below zero panics naming `what`.
#[inline]
#[track_caller]
pub(crate) fn take(count: &mut u64, n: u64, what: &str) {
    debug_assert!(n <= *count, "{what} would go below zero: {count} - {n}");
    *count = count.wrapping_sub(n);
}

/// [`take`] for a count kept in an atomic.
#[inline]
#[track_caller]
pub(crate) fn take_atomic(count: &AtomicU64, n: u64, what: &str) {
    let was = count.fetch_sub(n, Ordering::Relaxed);
    debug_assert!(n <= was, "{what} would go below zero: {was} - {n}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_goes_down_to_zero() {
        let mut c = 5;
        take(&mut c, 5, "c");
        assert_eq!(c, 0);
        let a = AtomicU64::new(7);
        take_atomic(&a, 7, "a");
        assert_eq!(a.load(Ordering::Relaxed), 0);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "library bytes would go below zero: 1 - 2")]
    fn a_count_below_zero_names_itself() {
        let mut c = 1;
        take(&mut c, 2, "library bytes");
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "staging bytes would go below zero: 0 - 1")]
    fn an_atomic_count_below_zero_names_itself() {
        take_atomic(&AtomicU64::new(0), 1, "staging bytes");
    }
}

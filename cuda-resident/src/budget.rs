//! The budget rule: how much device memory this crate may hold.
//!
//! `limit = resident + min(f * total - resident, f * live_free)`
//!
//! `resident` is what the allocator already holds from the driver, `total` the device's
//! memory, `live_free` what the driver reports free right now and `f` the configured fraction
//! (0.9 by default). The first term caps this process at `f` of the device; the second leaves
//! `1 - f` of whatever is free to everyone else (other processes, the caller's own
//! `cuMemAlloc`s, the driver's own needs). Live free memory is read only when the allocator
//! needs a new slab, never on the fast path.

/// The most bytes the allocator may hold, by the rule above. Never below `resident`.
pub fn limit(resident: u64, total: u64, live_free: u64, fraction: f64) -> u64 {
    let scaled = |bytes: u64| (fraction * bytes as f64) as u64;
    let room_in_share = scaled(total).saturating_sub(resident);
    let room_in_free = scaled(live_free);
    resident.saturating_add(room_in_share.min(room_in_free))
}

#[cfg(test)]
mod tests {
    use super::limit;

    const GIB: u64 = 1 << 30;

    #[test]
    fn an_idle_device_gives_the_fraction_of_free_memory() {
        // Nothing held, 100 GiB total, 95 GiB free: 0.9 * 95 < 0.9 * 100.
        assert_eq!(limit(0, 100 * GIB, 95 * GIB, 0.9), (0.9 * (95 * GIB) as f64) as u64);
    }

    #[test]
    fn the_share_of_total_caps_a_process_that_already_holds_memory() {
        // Holding 80 GiB with 20 GiB free: the share leaves 10 GiB, free would allow 18.
        assert_eq!(limit(80 * GIB, 100 * GIB, 20 * GIB, 0.9), 90 * GIB);
    }

    #[test]
    fn other_users_of_the_device_shrink_the_limit() {
        // Holding 10 GiB, but others took most of the rest: 5 GiB free.
        assert_eq!(limit(10 * GIB, 100 * GIB, 5 * GIB, 0.9), 10 * GIB + (0.9 * (5 * GIB) as f64) as u64);
    }

    #[test]
    fn never_below_what_is_held() {
        assert_eq!(limit(95 * GIB, 100 * GIB, 0, 0.9), 95 * GIB);
        assert_eq!(limit(u64::MAX, u64::MAX, u64::MAX, 1.0), u64::MAX);
    }

    #[test]
    fn fraction_one_allows_everything_free() {
        assert_eq!(limit(GIB, 10 * GIB, 9 * GIB, 1.0), 10 * GIB);
    }
}

use super::*;

const MIB: u64 = 1 << 20;

#[test]
fn arena_sizes() {
    assert_eq!(arena_bytes(1, 1 << 30), MIN_ARENA);
    assert_eq!(arena_bytes(MIB, 1 << 30), MIB);
    assert_eq!(arena_bytes(MIB + 16, 1 << 30), MIB + (64 << 10), "not the next power of two");
    assert_eq!(arena_bytes(32 * MIB + 1, 1 << 30), 34 * MIB);
    assert_eq!(arena_bytes(64 * MIB + 16, 1 << 30), 68 * MIB);
    assert_eq!(arena_bytes(512 * MIB + 300_000, 1 << 30), 544 * MIB);
    // Never past the cap, never below the request.
    assert_eq!(arena_bytes(17 * MIB + 1, 18 * MIB), 18 * MIB);
    assert_eq!(arena_bytes(1000 * MIB + 1, 1001 * MIB), 1001 * MIB);
    assert_eq!(arena_bytes(5 * MIB, 5 * MIB), 5 * MIB);
    assert_eq!(arena_bytes(u64::MAX, u64::MAX), u64::MAX, "no overflow");
}

#[test]
fn a_request_of_the_arena_floor_takes_an_arena_within_the_limit_and_one_byte_more_does_not() {
    let cap = u64::MAX;
    let mut rng = fastrand::Rng::with_seed(3);
    let edges = [MIN_ARENA, MIN_ARENA + 1, 128 << 10, (128 << 10) + 5000, 17 * MIB, 1 << 39, u64::MAX / 4];
    for limit in edges.into_iter().chain((0..2000).map(|_| rng.u64(MIN_ARENA..1 << 36))) {
        let floor = arena_floor(limit);
        assert!(floor <= limit && arena_bytes(floor, cap) <= limit, "limit {limit}: floor {floor}");
        assert!(arena_bytes(floor + 1, cap) > limit, "limit {limit}: floor {floor} is the largest");
    }
}

#[test]
fn rounding_wastes_at_most_a_sixteenth_of_an_arena() {
    let mut len = MIN_ARENA;
    while len <= 4 << 30 {
        for l in [len - 1, len, len + 1, len + 16, len + len / 3] {
            let bytes = arena_bytes(l, u64::MAX);
            assert!(bytes >= l && (bytes - l) * 16 <= bytes, "{l} -> {bytes}");
        }
        len *= 2;
    }
}

use cuda_sys::{CUDA_ERROR_INVALID_CONTEXT, Fault};

use crate::testing::model;

/// A pool of `cap` bytes on the model driver, and the driver (for faults).
fn pool(cap: u64) -> (Arc<cuda_sys::Driver>, Arc<HostPool>) {
    let driver = model::driver();
    let pool = Arc::new(HostPool::new(model::context(&driver), cap, 0, false));
    driver.faults().record();
    (driver, pool)
}

/// The pool's first `cuMemFreeHost` is refused (none happened before in these tests).
fn free_host_fails_once(driver: &cuda_sys::Driver) {
    assert!(!driver.faults().counts().contains_key("cuMemFreeHost"));
    driver.faults().inject(Fault::new("cuMemFreeHost", 1, CUDA_ERROR_INVALID_CONTEXT)).unwrap();
}

#[test]
fn leases_within_the_cap_count_whole_arenas() {
    let (_driver, pool) = pool(3 * MIB);
    assert_eq!(pool.leases_within_cap(MIB), 3);
    assert_eq!(pool.leases_within_cap(MIB + 1), 2, "arenas of 1 MiB + 64 KiB: two fit");
    assert_eq!(pool.leases_within_cap(2 * MIB), 1);
    assert_eq!(pool.leases_within_cap(3 * MIB), 1);
    assert_eq!(pool.leases_within_cap(64 << 10), 48);
}

#[test]
fn a_refused_host_free_keeps_the_arena_counted_and_the_next_trim_retries_it() {
    let (driver, pool) = pool(8 * MIB);
    drop(pool.try_acquire(1000).unwrap().unwrap());
    assert_eq!(pool.stats().reserved_bytes, MIN_ARENA);
    free_host_fails_once(&driver);
    let err = pool.trim().unwrap_err();
    assert!(err.to_string().contains("cuMemFreeHost"), "{err}");
    assert_eq!(pool.stats().reserved_bytes, MIN_ARENA, "still held, still counted");
    assert_eq!(pool.trim().unwrap(), MIN_ARENA, "the next trim frees it");
    let stats = pool.stats();
    assert_eq!((stats.reserved_bytes, stats.lent_bytes), (0, 0));
    let counts = driver.faults().counts();
    assert_eq!(counts["cuMemFreeHost"].succeeded, 1, "freed exactly once");
}

#[test]
fn an_arena_refused_during_eviction_is_retried_when_room_is_needed_again() {
    // Room for one 4 MiB arena at a time: each new size evicts the free one.
    let (driver, pool) = pool(4 * MIB);
    drop(pool.try_acquire(4 * MIB as usize).unwrap().unwrap());
    free_host_fails_once(&driver);
    // Evicting the 4 MiB arena fails: the request still gets its arena (the refusal is
    // not its failure), and the refused one stays listed and counted.
    let lease = pool.try_acquire(MIB as usize).unwrap().expect("served");
    assert_eq!(pool.stats().reserved_bytes, 5 * MIB, "over the cap while the driver refuses");
    drop(lease);
    // The next request that needs room retries the refused arena first.
    let lease = pool.try_acquire(2 * MIB as usize).unwrap().expect("served");
    assert!(pool.stats().reserved_bytes <= 4 * MIB, "{:?}", pool.stats());
    drop(lease);
    pool.trim().unwrap();
    assert_eq!(pool.stats().reserved_bytes, 0);
    let counts = driver.faults().counts();
    assert_eq!(counts["cuMemHostAlloc"].succeeded, counts["cuMemFreeHost"].succeeded, "nothing leaked");
}

/// A pool of `cap` bytes on the model driver that makes arenas of huge pages.
fn huge_pool(cap: u64) -> (Arc<cuda_sys::Driver>, Arc<HostPool>) {
    let driver = model::driver();
    let pool = Arc::new(HostPool::new(model::context(&driver), cap, 0, true));
    driver.faults().record();
    (driver, pool)
}

/// The kernel's flags of the mapping that holds address `at` (`VmFlags` in
/// `/proc/self/smaps`: `hg` advised huge pages, `dc` not copied on fork).
fn vm_flags(at: u64) -> Vec<String> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("Linux");
    let mut inside = false;
    for line in smaps.lines() {
        let range = line.split(' ').next().and_then(|r| r.split_once('-'));
        if let Some((lo, hi)) = range
            .and_then(|(lo, hi)| Some((u64::from_str_radix(lo, 16).ok()?, u64::from_str_radix(hi, 16).ok()?)))
        {
            inside = lo <= at && at < hi;
        } else if inside && let Some(flags) = line.strip_prefix("VmFlags:") {
            return flags.split_whitespace().map(str::to_string).collect();
        }
    }
    panic!("no mapping holds {at:#x}")
}

fn succeeded(driver: &cuda_sys::Driver, entry: &str) -> u64 {
    driver.faults().counts().get(entry).map_or(0, |c| c.succeeded)
}

#[test]
fn arenas_of_whole_huge_pages_are_registered_aligned_usable_and_given_back() {
    let (driver, pool) = huge_pool(64 * MIB);
    let mut rng = fastrand::Rng::with_seed(7);
    for len in [16 * MIB, 2 * MIB, 4 * MIB - 5] {
        let lease = pool.try_acquire(len as usize).unwrap().expect("within the cap");
        let at = lease.as_ptr() as u64;
        assert_eq!(at % HUGE_PAGE, 0, "{len}: an arena starts on a huge page");
        let flags = vm_flags(at);
        assert!(flags.contains(&"hg".to_string()), "{len}: advised huge pages: {flags:?}");
        assert!(flags.contains(&"dc".to_string()), "{len}: not copied on fork: {flags:?}");
        // Every byte is writable and reads back.
        let bytes: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
        // SAFETY: the lease is ours, `len` bytes long, and no copy uses it.
        let slice = unsafe { std::slice::from_raw_parts_mut(lease.as_ptr(), len as usize) };
        slice.copy_from_slice(&bytes);
        assert!(slice == &bytes[..], "{len}: the arena keeps what was written");
        drop(lease);
    }
    assert!(pool.makes_huge_pages());
    assert_eq!(succeeded(&driver, "cuMemHostRegister_v2"), 3, "three sizes, three arenas");
    assert_eq!(succeeded(&driver, "cuMemHostAlloc"), 0);
    assert_eq!(pool.trim().unwrap(), 22 * MIB);
    assert_eq!(succeeded(&driver, "cuMemHostUnregister"), 3, "every registration undone");
    assert_eq!(pool.stats().reserved_bytes, 0);
}

#[test]
fn arenas_of_part_of_a_huge_page_come_from_host_alloc() {
    let (driver, pool) = huge_pool(64 * MIB);
    // 1 MiB, 3 MiB + 192 KiB, 64 KiB: no whole number of 2 MiB pages.
    let leases: Vec<_> =
        [MIB, 3 * MIB + 1, 1].map(|len| pool.try_acquire(len as usize).unwrap().expect("fits")).into();
    assert_eq!(succeeded(&driver, "cuMemHostAlloc"), 3);
    assert_eq!(succeeded(&driver, "cuMemHostRegister_v2"), 0);
    drop(leases);
    pool.trim().unwrap();
    assert_eq!(succeeded(&driver, "cuMemFreeHost"), 3);
}

#[test]
fn a_refused_registration_serves_the_request_from_host_alloc_and_turns_huge_pages_off() {
    let (driver, pool) = huge_pool(64 * MIB);
    driver
        .faults()
        .inject(Fault::new("cuMemHostRegister_v2", 1, cuda_sys::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED))
        .unwrap();
    let first = pool.try_acquire(16 * MIB as usize).unwrap().expect("served all the same");
    assert!(!pool.makes_huge_pages(), "off after a refusal");
    let second = pool.try_acquire(16 * MIB as usize).unwrap().expect("served");
    assert_eq!(succeeded(&driver, "cuMemHostAlloc"), 2, "both arenas from host alloc");
    assert_eq!(driver.faults().counts()["cuMemHostRegister_v2"].calls, 1, "tried once, never again");
    assert_eq!(pool.stats().reserved_bytes, 32 * MIB, "the refused arena is not counted");
    drop((first, second));
    pool.trim().unwrap();
    assert_eq!(succeeded(&driver, "cuMemFreeHost"), 2);
}

#[test]
fn a_refused_unregistration_keeps_the_arena_counted_and_the_next_trim_retries_it() {
    let (driver, pool) = huge_pool(64 * MIB);
    drop(pool.try_acquire(4 * MIB as usize).unwrap().unwrap());
    driver.faults().inject(Fault::new("cuMemHostUnregister", 1, CUDA_ERROR_INVALID_CONTEXT)).unwrap();
    let err = pool.trim().unwrap_err();
    assert!(err.to_string().contains("cuMemHostUnregister"), "{err}");
    assert_eq!(pool.stats().reserved_bytes, 4 * MIB, "still registered, still counted");
    assert_eq!(pool.trim().unwrap(), 4 * MIB);
    assert_eq!(succeeded(&driver, "cuMemHostUnregister"), 1, "undone exactly once");
}

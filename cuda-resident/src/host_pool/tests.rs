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
    let pool = Arc::new(HostPool::new(model::context(&driver), cap, 0));
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

#[test]
fn warming_makes_free_arenas_up_to_the_total_counting_what_is_held() {
    let (driver, pool) = pool(64 * MIB);
    // 10 MiB of 4 MiB arenas: three (the last passes the total, as a prewarm's last did).
    assert_eq!(pool.warm(4 * MIB as usize, 10 * MIB).unwrap(), 12 * MIB);
    let stats = pool.stats();
    assert_eq!((stats.reserved_bytes, stats.lent_bytes, stats.misses), (12 * MIB, 0, 0));
    // Held already: nothing more; asked for more: only what is missing.
    assert_eq!(pool.warm(4 * MIB as usize, 12 * MIB).unwrap(), 0);
    assert_eq!(pool.warm(4 * MIB as usize, 16 * MIB).unwrap(), 4 * MIB);
    // What the copies then take is served by those arenas.
    let leases: Vec<_> = (0..4).map(|_| pool.try_acquire(4 * MIB as usize).unwrap().unwrap()).collect();
    assert_eq!((pool.stats().hits, pool.stats().misses), (4, 0));
    drop(leases);
    assert_eq!(driver.faults().counts()["cuMemHostAlloc"].succeeded, 4);
    pool.trim().unwrap();
    assert_eq!(driver.faults().counts()["cuMemFreeHost"].succeeded, 4, "every arena freed once");
}

#[test]
fn warming_stops_at_the_cap_and_at_zero() {
    let (_driver, pool) = pool(10 * MIB);
    assert_eq!(pool.warm(4 * MIB as usize, u64::MAX).unwrap(), 8 * MIB, "a third would pass the cap");
    assert_eq!(pool.stats().reserved_bytes, 8 * MIB);
    let (_driver, fresh) = super::tests::pool(10 * MIB);
    let pool = fresh;
    assert_eq!(pool.warm(4 * MIB as usize, 0).unwrap(), 0);
    assert_eq!(pool.warm(0, MIB).unwrap(), MIN_ARENA.max(MIB), "a zero length takes the smallest arena");
    assert_eq!(pool.warm(usize::MAX, u64::MAX).unwrap(), 0, "an arena past the cap is never made");
}

#[test]
fn a_refused_arena_fails_the_warming_and_keeps_the_count_true() {
    let (driver, pool) = pool(64 * MIB);
    driver.faults().inject(Fault::new("cuMemHostAlloc", 3, CUDA_ERROR_INVALID_CONTEXT)).unwrap();
    let err = pool.warm(MIB as usize, 8 * MIB).unwrap_err();
    assert!(err.to_string().contains("cuMemHostAlloc"), "{err}");
    // The arenas made before (or alongside) the refusal stay, counted; nothing else is.
    let made = driver.faults().counts()["cuMemHostAlloc"].succeeded;
    let stats = pool.stats();
    assert_eq!((stats.reserved_bytes, stats.lent_bytes), (made * MIB, 0));
    assert_eq!(pool.trim().unwrap(), made * MIB);
    assert_eq!(driver.faults().counts()["cuMemFreeHost"].succeeded, made);
}

#[test]
fn warming_from_many_threads_at_once_never_passes_the_total() {
    let (driver, pool) = pool(256 * MIB);
    let gpu = model::shared();
    let added: u64 = std::thread::scope(|s| {
        let warms: Vec<_> = (0..8)
            .map(|_| {
                let (pool, gpu) = (&pool, gpu.clone());
                s.spawn(move || {
                    model::join(gpu);
                    pool.warm(MIB as usize, 40 * MIB).unwrap()
                })
            })
            .collect();
        warms.into_iter().map(|w| w.join().unwrap()).sum()
    });
    assert_eq!(added, 40 * MIB, "each arena counted by the warming that made it");
    assert_eq!(pool.stats().reserved_bytes, 40 * MIB);
    assert_eq!(driver.faults().counts()["cuMemHostAlloc"].succeeded, 40);
}

#[test]
fn a_transfer_that_finds_the_pool_full_of_arenas_being_made_waits_for_them() {
    let (driver, pool) = pool(4 * MIB);
    // Warming has counted the whole cap and not made any arena yet.
    for _ in 0..4 {
        assert!(pool.begin_arena(MIB, 4 * MIB));
    }
    assert!(!pool.begin_arena(MIB, 8 * MIB), "the cap is counted");
    assert_eq!(pool.try_acquire_for_transfer(MIB as usize).unwrap().map(|l| l.len()), None, "full");
    let gpu = model::shared();
    let made = std::thread::scope(|s| {
        let maker = s.spawn(|| {
            model::join(gpu);
            // Once the transfer waits.
            while lock(&pool.state).waiters == 0 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            let raw = pool.ctx.bind().unwrap();
            let ptr = NonNull::new(raw.mem_host_alloc(MIB).unwrap()).unwrap();
            pool.end_arena(MIB, Some(Arena { ptr, bytes: MIB }));
            // The others are given up on (as after a refusal): no longer counted.
            for _ in 0..3 {
                pool.end_arena(MIB, None);
            }
        });
        // Not `None` (which would make the transfer give up): arenas are on their way.
        let progress = pool.wait_for_transfers(std::time::Duration::from_secs(10));
        maker.join().unwrap();
        progress
    });
    assert!(made.is_some());
    let lease = pool.try_acquire_for_transfer(MIB as usize).unwrap().expect("the arena made");
    assert_eq!(pool.stats().hits, 1);
    drop(lease);
    assert_eq!(pool.wait_for_transfers(std::time::Duration::from_secs(10)), None, "nothing out any more");
    assert_eq!(pool.stats().reserved_bytes, MIB);
    pool.trim().unwrap();
    let counts = driver.faults().counts();
    assert_eq!(counts["cuMemHostAlloc"].succeeded, counts["cuMemFreeHost"].succeeded);
}

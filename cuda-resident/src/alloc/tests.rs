//! The allocator against a model of device memory: every rule that needs no GPU.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::*;
use crate::error::Error;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Device memory as the driver would account it: a total, allocations at fake addresses,
/// and an optional refusal of every allocation (out of memory).
#[derive(Default)]
struct Model {
    total: u64,
    state: Mutex<ModelState>,
}

#[derive(Default)]
struct ModelState {
    next: u64,
    live: BTreeMap<u64, u64>,
    /// Bytes taken by someone else (another process).
    others: u64,
    refuse: bool,
    /// Frees to refuse (the memory stays allocated), as a failing `cuMemFree` does.
    failing_frees: u32,
}

impl Model {
    fn new(total: u64) -> Arc<Model> {
        Arc::new(Model { total, state: Mutex::new(ModelState { next: 1 << 40, ..Default::default() }) })
    }
    fn live_bytes(&self) -> u64 {
        lock(&self.state).live.values().sum()
    }
}

impl DeviceMemory for Arc<Model> {
    fn mem_get_info(&self) -> Result<(u64, u64)> {
        let s = lock(&self.state);
        Ok((self.total - s.live.values().sum::<u64>() - s.others, self.total))
    }
    fn mem_alloc(&self, bytes: u64) -> Result<u64> {
        let mut s = lock(&self.state);
        let used: u64 = s.live.values().sum::<u64>() + s.others;
        if s.refuse || used + bytes > self.total {
            return Err(Error::Driver {
                entry: "cuMemAlloc_v2",
                code: cuda_sys::CUDA_ERROR_OUT_OF_MEMORY,
                name: "CUDA_ERROR_OUT_OF_MEMORY".into(),
                text: "out of memory".into(),
            });
        }
        let ptr = s.next;
        s.next += bytes.next_multiple_of(2 * MIB) + 2 * MIB; // gaps, as a real driver leaves
        s.live.insert(ptr, bytes);
        Ok(ptr)
    }
    fn mem_free(&self, ptr: u64) -> Result<()> {
        let mut s = lock(&self.state);
        if s.failing_frees > 0 {
            s.failing_frees -= 1;
            return Err(Error::Driver {
                entry: "cuMemFree_v2",
                code: cuda_sys::CUDA_ERROR_INVALID_CONTEXT,
                name: "CUDA_ERROR_INVALID_CONTEXT".into(),
                text: "invalid device context".into(),
            });
        }
        let removed = s.live.remove(&ptr);
        assert!(removed.is_some(), "freed {ptr:#x}, which is not allocated");
        Ok(())
    }
}

fn allocator(total: u64, fraction: f64) -> (Arc<Model>, Allocator<Arc<Model>>) {
    let model = Model::new(total);
    let config = AllocatorConfig { total_memory: total, budget_fraction: fraction, slab_bytes: 64 * MIB };
    (Arc::clone(&model), Allocator::new(model, 0, config))
}

const IDLE: &dyn Fn(LastUse) -> bool = &|_| true;
const BUSY: &dyn Fn(LastUse) -> bool = &|_| false;

#[test]
fn zero_bytes_is_an_error_and_changes_nothing() {
    let (model, a) = allocator(GIB, 0.9);
    assert!(matches!(a.allocate(0, IDLE), Err(Error::ZeroSizedAllocation)));
    assert_eq!(a.stats().driver_allocations, 0);
    assert_eq!(model.live_bytes(), 0);
}

#[test]
fn buffers_are_aligned_sized_and_disjoint() {
    let (_, a) = allocator(GIB, 0.9);
    let mut spans = Vec::new();
    for len in [1, 255, 256, 257, 1000, 4096, 100_000, MIB, 3 * MIB, 5 * MIB, 70 * MIB] {
        let b = a.allocate(len, IDLE).unwrap();
        let (ptr, got) = a.resolve(b).unwrap();
        assert_eq!(got, len);
        assert_eq!(ptr % GRANULE_FOR_TESTS, 0, "{len} bytes at {ptr:#x}");
        spans.push((ptr, ptr + len));
    }
    spans.sort();
    for w in spans.windows(2) {
        assert!(w[0].1 <= w[1].0, "overlap: {w:?}");
    }
    assert_eq!(
        a.allocated_bytes(),
        [1, 255, 256, 257, 1000, 4096, 100_000, MIB, 3 * MIB, 5 * MIB, 70 * MIB].iter().sum::<u64>()
    );
}

const GRANULE_FOR_TESTS: u64 = classes::GRANULE;

#[test]
fn a_freed_handle_a_double_free_and_a_foreign_handle_are_errors() {
    let (_, a) = allocator(GIB, 0.9);
    let (_, other) = allocator(GIB, 0.9);
    let b = a.allocate(4096, IDLE).unwrap();
    let theirs = other.allocate(4096, IDLE).unwrap();

    assert!(matches!(a.free(theirs, IDLE), Err(Error::ForeignBuffer { .. })));
    assert!(matches!(a.resolve(theirs), Err(Error::ForeignBuffer { .. })));
    a.free(b, IDLE).unwrap();
    assert!(matches!(a.free(b, IDLE), Err(Error::FreedBuffer { .. })), "double free");
    assert!(matches!(a.resolve(b), Err(Error::FreedBuffer { .. })), "use after free");
    assert!(matches!(a.mark_used(b, 0, 1), Err(Error::FreedBuffer { .. })));

    // The slot is reused with a new generation: the old handle stays dead.
    let again = a.allocate(4096, IDLE).unwrap();
    assert_ne!(again, b);
    assert!(matches!(a.resolve(b), Err(Error::FreedBuffer { .. })));
    assert!(a.resolve(again).is_ok());

    // A forged handle past the slots of its shard.
    let forged = ResidentBuffer { owner: again.owner, index: 1_000_000 << SHARD_BITS, generation: 0 };
    assert!(matches!(a.resolve(forged), Err(Error::ForeignBuffer { .. })));
    assert_eq!(a.allocated_bytes(), 4096, "failed calls changed nothing");
}

#[test]
fn a_freed_block_is_reused_without_the_driver() {
    let (_, a) = allocator(GIB, 0.9);
    let b = a.allocate(MIB, IDLE).unwrap();
    let ptr = a.resolve(b).unwrap().0;
    let calls = a.stats().driver_allocations;
    for _ in 0..100 {
        a.free(a.allocate(MIB, IDLE).unwrap(), IDLE).unwrap();
    }
    a.free(b, IDLE).unwrap();
    let c = a.allocate(MIB - 100, IDLE).unwrap();
    assert_eq!(a.resolve(c).unwrap().0, ptr, "same class, same block");
    assert_eq!(a.stats().driver_allocations, calls);
}

#[test]
fn the_budget_refuses_with_the_numbers_and_changes_nothing() {
    // 1 GiB device, fraction 0.5: the limit is 512 MiB.
    let (model, a) = allocator(GIB, 0.5);
    let first = a.allocate(300 * MIB, IDLE).unwrap();
    let before = a.stats();
    let err = a.allocate(300 * MIB, IDLE).unwrap_err();
    match &err {
        Error::OverBudget {
            requested,
            needed,
            held,
            in_use,
            library,
            limit,
            total,
            driver_out_of_memory,
            ..
        } => {
            assert_eq!(*requested, 300 * MIB);
            assert_eq!(*in_use, 300 * MIB);
            // 300 MiB held + min(0.5 * 1 GiB - 300 MiB, 0.5 * 724 MiB free) = 512 MiB.
            assert_eq!(*limit, 512 * MIB);
            assert_eq!(*total, GIB);
            assert!(!driver_out_of_memory);
            // The numbers add up, on one basis: what is held plus what was needed passes
            // the limit, and what is held covers the buffers in it.
            assert_eq!((*held, *needed, *library), (300 * MIB, 300 * MIB, 0));
            assert!(held + needed > *limit && *held >= in_use + library, "{err}");
        }
        other => panic!("{other}"),
    }
    let after = a.stats();
    assert_eq!(after.allocated_bytes, before.allocated_bytes);
    assert_eq!(after.reserved_bytes, before.reserved_bytes);
    assert_eq!(after.budget_refusals, 1);
    assert_eq!(model.live_bytes(), 300 * MIB);
    // Smaller requests still fit, in a slab shrunk to the room that is left.
    let small = a.allocate(100 * MIB, IDLE).unwrap();
    a.free(small, IDLE).unwrap();
    a.free(first, IDLE).unwrap();
    assert!(a.allocate(GIB, IDLE).is_err(), "more than the device");
    assert!(matches!(a.allocate(u64::MAX, IDLE), Err(Error::OverBudget { .. })), "no overflow");
}

#[test]
fn other_users_of_the_device_shrink_the_budget() {
    let (model, a) = allocator(GIB, 0.9);
    lock(&model.state).others = 900 * MIB;
    // Free is 124 MiB: the limit is 0.9 of that.
    assert!(a.allocate(100 * MIB, IDLE).is_ok());
    assert!(matches!(a.allocate(100 * MIB, IDLE), Err(Error::OverBudget { .. })));
}

#[test]
fn cached_memory_is_trimmed_and_the_request_retried_when_the_budget_is_tight() {
    // 256 MiB device, fraction 1: four 64 MiB slabs at most.
    let (model, a) = allocator(256 * MIB, 1.0);
    // Fill every slab with 4 MiB class blocks, then free them all into the caches.
    let blocks: Vec<_> = (0..64).map(|_| a.allocate(4 * MIB, IDLE).unwrap()).collect();
    for b in blocks {
        a.free(b, IDLE).unwrap();
    }
    assert_eq!(a.stats().cached_bytes, 256 * MIB);
    // A 100 MiB buffer needs a dedicated allocation: only possible once caches are released.
    let big = a.allocate(100 * MIB, IDLE).unwrap();
    let stats = a.stats();
    assert!(stats.trims >= 1);
    assert_eq!(stats.allocated_bytes, 100 * MIB);
    assert_eq!(model.live_bytes(), stats.reserved_bytes);
    a.free(big, IDLE).unwrap();
}

#[test]
fn driver_out_of_memory_trims_retries_once_then_reports() {
    let (model, a) = allocator(GIB, 0.9);
    let b = a.allocate(MIB, IDLE).unwrap();
    a.free(b, IDLE).unwrap();
    lock(&model.state).refuse = true;
    // Past the slab size: needs the driver.
    let err = a.allocate(100 * MIB, IDLE).unwrap_err();
    assert!(matches!(err, Error::OverBudget { driver_out_of_memory: true, .. }), "{err}");
    assert!(err.to_string().contains("cuMemAlloc_v2 reported out of memory"), "{err}");
    // The retry trimmed the cache and the empty slab.
    assert_eq!(model.live_bytes(), 0);
    assert_eq!(a.stats().reserved_bytes, 0);
    lock(&model.state).refuse = false;
    assert!(a.allocate(100 * MIB, IDLE).is_ok(), "the next call succeeds");
}

#[test]
fn a_free_while_a_copy_is_in_flight_is_deferred() {
    let (_, a) = allocator(GIB, 0.9);
    let b = a.allocate(MIB, IDLE).unwrap();
    let ptr = a.resolve(b).unwrap().0;
    a.mark_used(b, 0, 7).unwrap();
    a.free(b, BUSY).unwrap();
    assert!(matches!(a.resolve(b), Err(Error::FreedBuffer { .. })), "the handle dies at once");
    let stats = a.stats();
    assert_eq!((stats.deferred_frees, stats.deferred_bytes, stats.allocated_bytes), (1, MIB, 0));
    // While the copy is in flight, the memory is not handed out again.
    let c = a.allocate(MIB, BUSY).unwrap();
    assert_ne!(a.resolve(c).unwrap().0, ptr);
    // Once it completes, the next slow path reclaims it.
    a.trim(IDLE).unwrap();
    assert_eq!(a.stats().deferred_bytes, 0);
    a.free(c, IDLE).unwrap();
}

#[test]
fn trim_returns_everything_once_all_is_freed() {
    let (model, a) = allocator(GIB, 0.9);
    let mut rng = fastrand::Rng::with_seed(3);
    let bufs: Vec<_> = (0..100).map(|_| a.allocate(rng.u64(1..=80 * MIB / 10), IDLE).unwrap()).collect();
    let huge = a.allocate(100 * MIB, IDLE).unwrap();
    assert!(a.stats().peak_reserved_bytes >= 100 * MIB);
    for b in bufs {
        a.free(b, IDLE).unwrap();
    }
    a.free(huge, IDLE).unwrap();
    assert_eq!(a.stats().kept_bytes, 100 * MIB, "a freed dedicated block is kept for reuse");
    a.trim(IDLE).unwrap();
    let stats = a.stats();
    assert_eq!((stats.reserved_bytes, stats.slabs, stats.cached_bytes, stats.kept_bytes), (0, 0, 0, 0));
    assert_eq!(stats.dedicated_bytes, 0);
    assert_eq!(model.live_bytes(), 0);
    assert_eq!(stats.allocations, stats.frees);
}

#[test]
fn release_all_frees_every_driver_allocation() {
    let (model, mut a) = allocator(GIB, 0.9);
    let _live = a.allocate(MIB, IDLE).unwrap();
    let _dedicated = a.allocate(100 * MIB, IDLE).unwrap();
    let deferred = a.allocate(80 * MIB, IDLE).unwrap();
    a.free(deferred, BUSY).unwrap();
    a.release_all().unwrap();
    assert_eq!(model.live_bytes(), 0);
}

#[test]
fn many_threads_keep_the_accounting_exact() {
    let (model, a) = allocator(4 * GIB, 0.9);
    let a = Arc::new(a);
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let a = Arc::clone(&a);
            std::thread::spawn(move || {
                let mut rng = fastrand::Rng::with_seed(t);
                let mut live: Vec<(ResidentBuffer, u64)> = Vec::new();
                for _ in 0..3000 {
                    if live.len() < 40 && (rng.bool() || live.is_empty()) {
                        let len = match rng.u8(0..10) {
                            0 => rng.u64(4 * MIB..20 * MIB),
                            _ => rng.u64(1..=256 * 1024),
                        };
                        let b = a.allocate(len, IDLE).unwrap();
                        live.push((b, len));
                    } else {
                        let (b, len) = live.swap_remove(rng.usize(..live.len()));
                        assert_eq!(a.resolve(b).unwrap().1, len);
                        a.free(b, IDLE).unwrap();
                    }
                }
                let held: u64 = live.iter().map(|l| l.1).sum();
                (live, held)
            })
        })
        .collect();
    let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let held: u64 = results.iter().map(|r| r.1).sum();
    assert_eq!(a.allocated_bytes(), held);
    let mut spans: Vec<(u64, u64)> = results
        .iter()
        .flat_map(|r| r.0.iter().map(|&(b, len)| (a.resolve(b).unwrap().0, len)))
        .map(|(p, len)| (p, p + len))
        .collect();
    spans.sort();
    assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "live buffers overlap");
    for (live, _) in results {
        for (b, _) in live {
            a.free(b, IDLE).unwrap();
        }
    }
    let stats = a.stats();
    assert_eq!((stats.allocated_bytes, stats.footprint_bytes, stats.buffers), (0, 0, 0));
    assert_eq!(stats.allocations, stats.frees);
    assert_eq!(stats.reserved_bytes, stats.cached_bytes + stats.slab_free_bytes + stats.dedicated_bytes);
    a.trim(IDLE).unwrap();
    assert_eq!(model.live_bytes(), 0);
}

#[test]
fn a_failed_driver_free_keeps_the_memory_counted_and_the_next_trim_retries_it() {
    let (model, a) = allocator(GIB, 0.9);
    let big = a.allocate(100 * MIB, IDLE).unwrap();
    let small = a.allocate(MIB, IDLE).unwrap();
    let held = a.stats().reserved_bytes;
    assert_eq!(model.live_bytes(), held);
    a.free(big, IDLE).unwrap();
    a.free(small, IDLE).unwrap();

    // A trim whose first cuMemFree fails (the kept dedicated block's) frees what it can,
    // reports the failure, and keeps counting what the driver still holds.
    lock(&model.state).failing_frees = 1;
    let err = a.trim(IDLE).unwrap_err();
    assert!(err.to_string().contains("cuMemFree_v2"), "{err}");
    assert_eq!(a.stats().reserved_bytes, model.live_bytes(), "accounting matches the driver");
    assert_eq!(a.stats().dedicated_bytes, 100 * MIB, "still held, so still counted");
    assert_eq!(a.stats().kept_bytes, 0, "no longer offered for reuse");
    assert!(model.live_bytes() > 0);

    // The next trim retries and everything returns to the driver.
    assert!(a.trim(IDLE).unwrap() > 0);
    assert_eq!((a.stats().reserved_bytes, a.stats().dedicated_bytes, model.live_bytes()), (0, 0, 0));
    let stats = a.stats();
    assert_eq!(stats.driver_allocations, stats.driver_frees);
    // And the allocator works as before.
    let again = a.allocate(100 * MIB, IDLE).unwrap();
    a.free(again, IDLE).unwrap();
}

#[test]
fn a_failed_free_at_teardown_is_retried_there() {
    let (model, mut a) = allocator(GIB, 0.9);
    let big = a.allocate(100 * MIB, IDLE).unwrap();
    a.free(big, IDLE).unwrap();
    lock(&model.state).failing_frees = 1;
    assert!(a.trim(IDLE).is_err());
    a.release_all().unwrap();
    assert_eq!(model.live_bytes(), 0);
}

#[test]
fn a_freed_dedicated_block_serves_the_next_allocation_it_fits() {
    let (model, a) = allocator(4 * GIB, 0.9);
    let big = a.allocate(100 * MIB, IDLE).unwrap();
    let ptr = a.resolve(big).unwrap().0;
    a.free(big, IDLE).unwrap();
    let calls = a.stats().driver_allocations;
    // The same size again, and one a fifth smaller: the kept block, no driver call, its
    // length the new request's.
    let again = a.allocate(100 * MIB, IDLE).unwrap();
    assert_eq!(a.resolve(again).unwrap(), (ptr, 100 * MIB));
    a.free(again, IDLE).unwrap();
    let smaller = a.allocate(80 * MIB + 1, IDLE).unwrap();
    assert_eq!(a.resolve(smaller).unwrap(), (ptr, 80 * MIB + 1));
    let stats = a.stats();
    assert_eq!((stats.driver_allocations, stats.kept_bytes), (calls, 0));
    assert_eq!((stats.allocated_bytes, stats.footprint_bytes), (80 * MIB + 1, 100 * MIB));
    a.free(smaller, IDLE).unwrap();
    // Larger, or more than a quarter smaller: memory of its own; the kept block stays kept.
    let larger = a.allocate(100 * MIB + 1, IDLE).unwrap();
    let much_smaller = a.allocate(80 * MIB - 256, IDLE).unwrap();
    assert_ne!(a.resolve(larger).unwrap().0, ptr);
    assert_ne!(a.resolve(much_smaller).unwrap().0, ptr);
    assert_eq!(a.stats().kept_bytes, 100 * MIB);
    assert_eq!(a.stats().driver_allocations, calls + 2);
    // Of several kept blocks, the smallest that fits.
    a.free(larger, IDLE).unwrap();
    a.free(much_smaller, IDLE).unwrap();
    let fit = a.allocate(79 * MIB, IDLE).unwrap();
    assert_eq!(a.stats().footprint_bytes, 80 * MIB - 256);
    a.free(fit, IDLE).unwrap();
    assert_eq!(a.stats().reserved_bytes, model.live_bytes());
    a.trim(IDLE).unwrap();
    assert_eq!(model.live_bytes(), 0);
}

#[test]
fn kept_blocks_give_way_when_memory_is_short() {
    // 1 GiB, fraction 1: a kept 700 MiB block (too large by more than a quarter to serve
    // 500 MiB) and a live 300 MiB one leave no room for 500 MiB: the refusal gives the kept
    // block back and the retry succeeds.
    let (model, a) = allocator(GIB, 1.0);
    let big = a.allocate(700 * MIB, IDLE).unwrap();
    a.free(big, IDLE).unwrap();
    let other = a.allocate(300 * MIB, IDLE).unwrap();
    let wanted = a.allocate(500 * MIB, IDLE).unwrap();
    let stats = a.stats();
    assert_eq!((stats.kept_bytes, stats.dedicated_bytes, stats.trims), (0, 800 * MIB, 1));
    assert_eq!(model.live_bytes(), stats.reserved_bytes);
    // Another process takes memory while blocks are kept: a request they cannot serve
    // gives them back rather than fail.
    a.free(wanted, IDLE).unwrap();
    a.free(other, IDLE).unwrap();
    lock(&model.state).others = 200 * MIB;
    let again = a.allocate(700 * MIB, IDLE).unwrap();
    assert_eq!((a.stats().kept_bytes, a.stats().dedicated_bytes), (0, 700 * MIB));
    a.free(again, IDLE).unwrap();
    a.trim(IDLE).unwrap();
    assert_eq!(model.live_bytes(), 0);
}

#[test]
fn a_deferred_dedicated_free_is_kept_once_its_copy_completes() {
    let (model, a) = allocator(GIB, 0.9);
    let big = a.allocate(100 * MIB, IDLE).unwrap();
    let ptr = a.resolve(big).unwrap().0;
    a.mark_used(big, 0, 3).unwrap();
    a.free(big, BUSY).unwrap();
    assert_eq!((a.stats().deferred_bytes, a.stats().kept_bytes), (100 * MIB, 0));
    // Still in flight: not reused.
    let meanwhile = a.allocate(100 * MIB, BUSY).unwrap();
    assert_ne!(a.resolve(meanwhile).unwrap().0, ptr);
    // Completed: reclaimed into the kept blocks by the next slow path, and reused.
    let after = a.allocate(100 * MIB, IDLE).unwrap();
    assert_eq!(a.resolve(after).unwrap().0, ptr);
    a.free(meanwhile, IDLE).unwrap();
    a.free(after, IDLE).unwrap();
    a.trim(IDLE).unwrap();
    assert_eq!(model.live_bytes(), 0);
}

#[test]
fn marking_many_buffers_across_shards_checks_and_marks_each() {
    let a = Arc::new(allocator(GIB, 0.9).1);
    // Buffers of two threads land in two shards; interleave them.
    let mine: Vec<_> = (0..4).map(|_| a.allocate(4096, IDLE).unwrap()).collect();
    let theirs: Vec<_> = {
        let a = Arc::clone(&a);
        std::thread::spawn(move || (0..4).map(|_| a.allocate(4096, IDLE).unwrap()).collect()).join().unwrap()
    };
    let all: Vec<_> = mine.iter().zip(&theirs).flat_map(|(&m, &t)| [m, t]).collect();
    // Download lane (1) used one of them at 7: an upload (lane 0) marking all learns it.
    a.mark_used(theirs[2], 1, 7).unwrap();
    assert_eq!(a.mark_used_many(all.iter().copied(), 0, 5, |_, _| ()).unwrap(), 7);
    // Checking them all marks none: the upload lane's marks stay at 5.
    a.check_live_many(all.iter().copied()).unwrap();
    assert_eq!(a.mark_used_many(all.iter().copied(), 1, 1, |_, _| ()).unwrap(), 5);
    // Every one is marked: the other lane now learns 5 from any of them.
    for &b in &all {
        assert_eq!(a.mark_used_many(std::iter::once(b), 1, 1, |_, _| ()).unwrap(), 5);
    }
    // A freed or foreign handle anywhere in the list fails the call.
    a.free(mine[3], &|_| true).unwrap();
    assert!(matches!(a.mark_used_many(all.iter().copied(), 0, 9, |_, _| ()), Err(Error::FreedBuffer { .. })));
    assert!(matches!(a.check_live_many(all.iter().copied()), Err(Error::FreedBuffer { .. })));
    let (_, other) = allocator(GIB, 0.9);
    let foreign = other.allocate(4096, IDLE).unwrap();
    let err = a.mark_used_many([theirs[0], foreign].into_iter(), 0, 9, |_, _| ()).unwrap_err();
    assert!(matches!(err, Error::ForeignBuffer { .. }), "{err}");
}

#[test]
fn marking_more_buffers_than_are_fetched_ahead_visits_each_once_in_order() {
    let a = Arc::new(allocator(GIB, 0.9).1);
    assert_eq!(a.mark_used_many(std::iter::empty(), 0, 3, |_, _| panic!("no buffer")).unwrap(), 0);
    // Five times the lookahead, of two shards, in a shuffled order, some named twice.
    let mine: Vec<_> = (0..2 * AHEAD + 7).map(|i| a.allocate(4096 + i as u64, IDLE).unwrap()).collect();
    let theirs: Vec<_> = {
        let a = Arc::clone(&a);
        std::thread::spawn(move || (0..2 * AHEAD + 3).map(|_| a.allocate(512, IDLE).unwrap()).collect())
            .join()
            .unwrap()
    };
    let mut all: Vec<_> = mine.iter().chain(&theirs).chain(&mine[..AHEAD / 2]).copied().collect();
    fastrand::Rng::with_seed(11).shuffle(&mut all);
    assert!(all.len() > 4 * AHEAD);
    let late = all[all.len() - 3];
    a.mark_used(late, 1, 8).unwrap();
    let mut seen = Vec::new();
    assert_eq!(a.mark_used_many(all.iter().copied(), 0, 6, |ptr, len| seen.push((ptr, len))).unwrap(), 8);
    let expected: Vec<_> = all.iter().map(|&b| a.resolve(b).unwrap()).collect();
    assert_eq!(seen, expected, "each buffer once, in the list's order");
    for &b in &all {
        assert_eq!(a.mark_used_many(std::iter::once(b), 1, 1, |_, _| ()).unwrap(), 6, "{b:?} marked");
    }
    // A handle freed far past the first window fails the call, naming it.
    let freed = all[3 * AHEAD + 1];
    a.free(freed, &|_| true).unwrap();
    match a.mark_used_many(all.iter().copied(), 0, 9, |_, _| ()) {
        Err(Error::FreedBuffer { buffer }) => assert_eq!(buffer, freed),
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_librarys_own_buffers_are_counted_apart_from_the_callers() {
    let (_model, a) = allocator(GIB, 0.5);
    let mine = a.allocate(3 * MIB, IDLE).unwrap();
    let staging = a.allocate_as(16 * MIB, true, IDLE).unwrap();
    let stats = a.stats();
    assert_eq!((a.allocated_bytes(), stats.allocated_bytes, stats.buffers), (3 * MIB, 3 * MIB, 1));
    assert_eq!((stats.library_bytes, stats.library_buffers), (16 * MIB, 1));
    // A refusal names both, and they fit inside what is held.
    let err = a.allocate(600 * MIB, IDLE).unwrap_err();
    match &err {
        Error::OverBudget { held, needed, in_use, library, limit, .. } => {
            assert_eq!((*in_use, *library), (3 * MIB, 16 * MIB));
            assert!(held + needed > *limit && *held >= in_use + library, "{err}");
        }
        other => panic!("{other}"),
    }
    a.free(mine, IDLE).unwrap();
    assert_eq!(a.allocated_bytes(), 0, "the caller's bytes back to zero, the library's staging kept");
    assert_eq!(a.stats().library_bytes, 16 * MIB);
    a.free(staging, IDLE).unwrap();
    let stats = a.stats();
    assert_eq!((stats.library_bytes, stats.library_buffers, stats.buffers), (0, 0, 0));
}

#[test]
fn each_shard_counts_its_own_frees() {
    let (_, a) = allocator(GIB, 0.9);
    use_shard(3);
    let x = a.allocate(MIB, IDLE).unwrap();
    let library = a.allocate_as(4096, true, IDLE).unwrap();
    use_shard(5);
    let y = a.allocate(MIB, IDLE).unwrap();
    assert_eq!((x.shard(), y.shard()), (3, 5));
    let counts = |a: &Allocator<Arc<Model>>| (a.frees_in(3), a.frees_in(5));
    assert_eq!(counts(&a), (0, 0));

    // A free counts in its buffer's shard only, whichever thread's shard frees it.
    a.free(y, IDLE).unwrap();
    assert_eq!(counts(&a), (0, 1));
    // A refused free counts nowhere.
    assert!(a.free(y, IDLE).is_err());
    assert_eq!(counts(&a), (0, 1));
    a.free(x, IDLE).unwrap();
    assert_eq!(counts(&a), (1, 1));
    // Deferred frees and the library's buffers count as well.
    let z = a.allocate(MIB, IDLE).unwrap();
    a.mark_used(z, 1, 9).unwrap();
    a.free(z, BUSY).unwrap();
    assert_eq!(counts(&a), (1, 2));
    let stats = a.stats();
    assert_eq!((stats.library_bytes, stats.library_buffers), (4096, 1));
    a.free(library, IDLE).unwrap();
    assert_eq!(counts(&a), (2, 2));
    assert_eq!(a.stats().frees, 4);
    assert_eq!(a.stats().library_bytes, 0);
    for shard in (0..SHARDS).filter(|s| ![3, 5].contains(s)) {
        assert_eq!(a.frees_in(shard), 0, "shard {shard}");
    }
}

#[test]
fn a_slot_whose_generations_run_out_is_retired() {
    let (_, a) = allocator(GIB, 0.9);
    use_shard(7);
    let first = a.allocate(4096, IDLE).unwrap();
    a.free(first, IDLE).unwrap();
    // The slot's next handle is its last but one generation.
    let slot = (first.index >> SHARD_BITS) as usize;
    lock(&a.shards[7].state).slots[slot].generation = u32::MAX - 1;
    let last = a.allocate(4096, IDLE).unwrap();
    assert_eq!((last.index, last.generation), (first.index, u32::MAX - 1));
    a.free(last, IDLE).unwrap();
    // Its generation is now exhausted: the slot is never handed out again, so no handle of
    // it can ever match it.
    let next = a.allocate(4096, IDLE).unwrap();
    assert_ne!(next.index, last.index);
    for generation in [0, 1, u32::MAX - 1, u32::MAX] {
        let old = ResidentBuffer { generation, ..last };
        assert!(matches!(a.resolve(old), Err(Error::FreedBuffer { .. })), "generation {generation}");
        assert!(matches!(a.free(old, IDLE), Err(Error::FreedBuffer { .. })));
    }
    assert!(a.resolve(next).is_ok());
}

#[test]
fn many_threads_reusing_kept_blocks_never_share_one() {
    // Sizes past the 64 MiB slab: every free keeps its block, every allocation may take one.
    let (model, a) = allocator(64 * GIB, 0.9);
    let a = Arc::new(a);
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let a = Arc::clone(&a);
            std::thread::spawn(move || {
                let mut rng = fastrand::Rng::with_seed(100 + t);
                let mut live: Vec<(ResidentBuffer, u64)> = Vec::new();
                for _ in 0..400 {
                    if live.len() < 6 && (rng.bool() || live.is_empty()) {
                        let len = rng.u64(65 * MIB..=130 * MIB);
                        live.push((a.allocate(len, IDLE).unwrap(), len));
                    } else {
                        let (b, len) = live.swap_remove(rng.usize(..live.len()));
                        assert_eq!(a.resolve(b).unwrap().1, len);
                        a.free(b, IDLE).unwrap();
                    }
                }
                live
            })
        })
        .collect();
    let live: Vec<(ResidentBuffer, u64)> = threads.into_iter().flat_map(|t| t.join().unwrap()).collect();
    let mut spans: Vec<(u64, u64)> = live
        .iter()
        .map(|&(b, len)| {
            let ptr = a.resolve(b).unwrap().0;
            (ptr, ptr + len)
        })
        .collect();
    spans.sort();
    assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "live buffers overlap");
    let stats = a.stats();
    assert_eq!(stats.allocated_bytes, live.iter().map(|l| l.1).sum::<u64>());
    assert_eq!(stats.reserved_bytes, stats.footprint_bytes + stats.kept_bytes);
    assert!(stats.driver_allocations < stats.allocations, "kept blocks were reused: {stats:?}");
    for (b, _) in live {
        a.free(b, IDLE).unwrap();
    }
    assert_eq!(a.stats().kept_bytes, a.stats().reserved_bytes);
    a.trim(IDLE).unwrap();
    assert_eq!((model.live_bytes(), a.stats().reserved_bytes), (0, 0));
}

//! The packing threads under a transfer, on the model driver: panics while a chunk opens,
//! calls from a packing thread, chunks put off, long waits, one thread alone.

use crate::Config;
use crate::testing::device;

/// Groups over `chunks` chunks of 64 items of 32 KiB each (2 MiB a chunk: the parallel path).
fn big_groups(chunks: usize) -> crate::engine::pipeline::Groups {
    crate::engine::pipeline::Groups::new(
        chunks,
        (0..chunks).map(|k| (k, k * 64..(k + 1) * 64)),
        |_| 32 << 10,
        64 << 10,
    )
}

#[test]
fn a_panic_while_opening_a_chunk_reaches_the_caller_without_hanging() {
    use crate::engine::pipeline::{Step, run};
    let d = device(Config { pack_threads: 4, ..Config::default() });
    let groups = big_groups(4);
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run(
            &d.core().packers,
            &groups,
            8 << 20,
            2,
            |step| {
                assert!(step != Step::Open(1), "refused");
                Ok(true)
            },
            |_, _| {},
        )
    }));
    assert!(caught.is_err(), "the panic came back");
    // The packing threads are free again.
    let done = std::sync::atomic::AtomicUsize::new(0);
    run(
        &d.core().packers,
        &groups,
        8 << 20,
        2,
        |_| Ok(true),
        |_, items| {
            done.fetch_add(items.len(), std::sync::atomic::Ordering::Relaxed);
        },
    )
    .unwrap();
    assert_eq!(done.into_inner(), 4 * 64);
}

#[test]
fn a_call_from_a_packing_thread_runs_on_it_alone_in_chunk_order() {
    use crate::engine::pipeline::{Step, run};
    let d = device(Config { pack_threads: 1, ..Config::default() });
    let groups = big_groups(3);
    let log = std::sync::Mutex::new(Vec::new());
    let steps = std::sync::Mutex::new(Vec::new());
    d.core()
        .packers()
        .install(|| {
            run(
                &d.core().packers,
                &groups,
                6 << 20,
                3,
                |step| {
                    steps.lock().unwrap().push(step);
                    Ok(true)
                },
                |k, items| log.lock().unwrap().push((k, items)),
            )
        })
        .unwrap();
    let order: Vec<usize> = log.into_inner().unwrap().into_iter().map(|(k, _)| k).collect();
    assert!(order.is_sorted() && order.len() == 3 * 32, "{order:?}");
    use Step::{Done, Open};
    assert_eq!(steps.into_inner().unwrap(), vec![Open(0), Done(0), Open(1), Done(1), Open(2), Done(2)]);
}

#[test]
fn chunks_put_off_open_after_the_next_move_and_everything_runs_once() {
    use crate::engine::pipeline::{Step, run};
    let d = device(Config { pack_threads: 4, ..Config::default() });
    let groups = big_groups(6);
    let done = std::sync::atomic::AtomicUsize::new(0);
    // Each step with its answer.
    let mut steps = Vec::new();
    let mut moved = 0;
    run(
        &d.core().packers,
        &groups,
        12 << 20,
        4,
        |step| {
            let answer = match step {
                // Only one chunk past the last moved may open, as with a full pool.
                Step::Open(k) => k <= moved + 1,
                Step::Done(k) => {
                    moved = k + 1;
                    true
                }
            };
            steps.push((step, answer));
            Ok(answer)
        },
        |_, items| {
            done.fetch_add(items.len(), std::sync::atomic::Ordering::Relaxed);
        },
    )
    .unwrap();
    assert_eq!(done.into_inner(), 6 * 64, "every item once");
    let at = |s: Step| steps.iter().position(|&x| x == (s, true));
    for k in 0..6 {
        let opened = steps.iter().filter(|&&x| x == (Step::Open(k), true)).count();
        assert_eq!(opened, 1, "chunk {k} opened once: {steps:?}");
        assert!(at(Step::Open(k)) < at(Step::Done(k)), "chunk {k} opened before it moved");
        if k > 0 {
            assert!(at(Step::Done(k - 1)) < at(Step::Done(k)), "moves in chunk order");
        }
    }
    assert!(steps.iter().any(|x| !x.1), "some opens were put off");
}

#[test]
fn packing_threads_sleep_through_a_long_wait_for_a_chunk_and_wake_to_finish() {
    use crate::engine::pipeline::{SLEEPS, Step, run};
    use std::sync::atomic::{AtomicUsize, Ordering};
    let d = device(Config { pack_threads: 4, ..Config::default() });
    let groups = big_groups(3);
    let before = SLEEPS.load(Ordering::Relaxed);
    let done = AtomicUsize::new(0);
    run(
        &d.core().packers,
        &groups,
        6 << 20,
        3,
        |step| {
            // A chunk that takes long to land, as a download's DMA can.
            if step == Step::Open(1) {
                std::thread::sleep(std::time::Duration::from_millis(30));
            }
            Ok(true)
        },
        |_, items| {
            done.fetch_add(items.len(), Ordering::Relaxed);
        },
    )
    .unwrap();
    assert_eq!(done.into_inner(), 3 * 64, "every item once");
    assert!(SLEEPS.load(Ordering::Relaxed) > before, "the packing threads slept instead of spinning");
}

#[test]
fn one_packing_thread_packs_on_the_calling_thread() {
    // A pool of one thread runs nothing in parallel (and the fallback pool of one, on the
    // thread that built it, would never run another thread's jobs): the serial path.
    let d = device(Config { pack_threads: 1, ..Config::default() });
    let runs = || crate::engine::pipeline::PARALLEL_RUNS.with(|n| n.get());
    let groups = big_groups(2);
    let before = runs();
    let done = std::sync::atomic::AtomicUsize::new(0);
    crate::engine::pipeline::run(
        &d.core().packers,
        &groups,
        4 << 20,
        2,
        |_| Ok(true),
        |_, items| {
            done.fetch_add(items.len(), std::sync::atomic::Ordering::Relaxed);
        },
    )
    .unwrap();
    assert_eq!((done.into_inner(), runs()), (2 * 64, before));
}

//! Threads sharing one device on the model driver (their model GPU shared: `model::shared`,
//! `model::join`): stress rounds of every API, and uploads and downloads beside each other,
//! where a transfer that finds the pinned pool held by another thread's transfer waits for
//! it rather than failing.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use super::adversary_tests::{R, abs, dirty, lent_zero, minimal, same, tiny, want};
use crate::testing::{Model, device, model, random_vec, small_chunks};
use crate::{Config, Device, Error, ResidentBuffer};

/// A model GPU shared by the threads of a test.
fn spawn_joined<T: Send + 'static>(
    gpu: &Arc<std::sync::Mutex<model::FakeGpu>>,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    let gpu = Arc::clone(gpu);
    std::thread::spawn(move || {
        model::join(gpu);
        f()
    })
}

fn stress(config: Config, threads: usize, rounds: usize, seed: u64) {
    let d = device(config);
    let gpu = model::shared();
    let shared_m = Arc::new(Model::new(&d, &mut fastrand::Rng::with_seed(seed), &[1 << 20, 70_000]));
    let d = d.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    let mut handles = Vec::new();
    for t in 0..threads {
        let d = d.clone();
        let sm = Arc::clone(&shared_m);
        let tx = tx.clone();
        handles.push(spawn_joined(&gpu, move || {
            let r = catch_unwind(AssertUnwindSafe(|| worker(&d, &sm, t, rounds, seed)));
            let _ = tx.send((t, r.is_ok()));
            if let Err(p) = r {
                std::panic::resume_unwind(p);
            }
        }));
    }
    drop(tx);
    let mut finished = 0;
    while finished < threads {
        match rx.recv_timeout(std::time::Duration::from_secs(180)) {
            Ok(_) => finished += 1,
            Err(_) => panic!("deadlock: {finished} of {threads} threads finished in 180 s"),
        }
    }
    let mut failed = Vec::new();
    for (t, h) in handles.into_iter().enumerate() {
        if let Err(p) = h.join() {
            let text = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            failed.push(format!("thread {t}: {text}"));
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
    eprintln!("stress: {} retries for PinnedExhausted", RETRIES.load(std::sync::atomic::Ordering::Relaxed));
    lent_zero(&d, "after the threads");
    shared_m.check(&d, "shared buffers after the threads");
}

static RETRIES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Runs `f` again while it fails for want of pinned staging, counting: on the smallest pools,
/// the in-place writes of other threads' batches (held until submitted) may take all of it.
/// Any other error fails the test.
fn retry<T>(what: &str, mut f: impl FnMut() -> crate::Result<T>) -> T {
    loop {
        match f() {
            Ok(v) => return v,
            Err(Error::PinnedExhausted { .. }) => {
                RETRIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                std::thread::yield_now();
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

fn worker(d: &Device, shared: &Model, t: usize, rounds: usize, seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed * 100 + t as u64);
    let sizes = [300_000usize, 70_000, 4096, 1 << 20];
    let buffers: Vec<ResidentBuffer> = sizes.iter().map(|&n| d.allocate(n as u64).unwrap()).collect();
    let expect: Vec<Vec<u8>> = sizes.iter().map(|&n| random_vec(&mut rng, n)).collect();
    let writes: Vec<_> = buffers.iter().zip(&expect).map(|(&b, v)| (b, v.as_slice())).collect();
    retry("upload_many", || d.upload_many(&writes));
    let mut m = Model { buffers, expect };
    for round in 0..rounds {
        let what = format!("thread {t} round {round}");
        match rng.u8(..9) {
            0 => {
                let writes: Vec<(usize, usize, Vec<u8>)> = (0..rng.usize(1..100))
                    .map(|_| {
                        let (i, at, len) = m.range(&mut rng, 50_000);
                        (i, at, random_vec(&mut rng, len))
                    })
                    .collect();
                retry(&what, || {
                    let mut b = d.uploads();
                    for (i, at, bytes) in &writes {
                        b.write(m.buffers[*i], *at as u64, bytes)?;
                    }
                    b.submit()?.wait()
                });
                for (i, at, bytes) in &writes {
                    m.expect[*i][*at..*at + bytes.len()].copy_from_slice(bytes);
                }
            }
            1 => {
                let ranges = m.in_order_ranges(&mut rng, 800);
                let data: Vec<Vec<u8>> = ranges.iter().map(|&(_, _, l)| random_vec(&mut rng, l)).collect();
                retry(&what, || {
                    let mut b = d.uploads();
                    for (&(i, at, _), bytes) in ranges.iter().zip(&data) {
                        b.write(m.buffers[i], at as u64, bytes)?;
                    }
                    b.submit()?.wait()
                });
                for (&(i, at, _), bytes) in ranges.iter().zip(&data) {
                    m.expect[i][at..at + bytes.len()].copy_from_slice(bytes);
                }
                let r: Vec<R> = ranges.iter().map(|&(i, o, l)| (i, o as u64, l as u64)).collect();
                let w = want(&m, &r);
                let mut out = dirty(&mut rng, r.len());
                retry(&what, || {
                    let mut b = d.downloads();
                    let slots = b.read_many(abs(&m, &r))?;
                    b.submit()?.wait_into(&slots, &mut out).map(drop)
                });
                for i in 0..r.len() {
                    same(&format!("{what}: in order wait_into {i}"), &out[i], &w[i]);
                }
            }
            2 => {
                let s = d.telemetry().pinned;
                let want_len = rng.u64(1..=s.held_limit_bytes.max(1));
                let held = d.pinned(want_len as usize);
                let r: Vec<R> = (0..rng.usize(1..30))
                    .map(|_| {
                        let (i, o, l) = m.range(&mut rng, 100_000);
                        (i, o as u64, l as u64)
                    })
                    .collect();
                let w = want(&m, &r);
                let got = retry(&what, || d.download_ranges(&abs(&m, &r)));
                for i in 0..r.len() {
                    same(&format!("{what}: ranges with pinned held"), &got[i], &w[i]);
                }
                if let Err(e) = held {
                    assert!(
                        matches!(e, Error::PinnedReserved { .. } | Error::PinnedExhausted { .. }),
                        "{what}: pinned: {e}"
                    );
                    assert!(e.to_string().contains("Fix:"));
                }
            }
            3 => {
                let r: Vec<R> = (0..rng.usize(1..60))
                    .map(|_| {
                        let (i, o, l) = shared.range(&mut rng, 300_000);
                        (i, o as u64, l as u64)
                    })
                    .collect();
                let w = want(shared, &r);
                let (first, slots) = retry(&what, || {
                    let mut b = d.downloads();
                    let slots = b.read_many(abs(shared, &r))?;
                    Ok((b.submit()?, slots))
                });
                let (second, slots2) = retry(&what, || {
                    let mut b = d.downloads();
                    let slots = b.read_many(abs(shared, &r))?;
                    Ok((b.submit()?.wait()?, slots))
                });
                let first = first.wait().unwrap();
                for i in 0..r.len() {
                    same(&format!("{what}: shared first {i}"), first.get(slots[i]), &w[i]);
                    same(&format!("{what}: shared second {i}"), second.get(slots2[i]), &w[i]);
                }
            }
            4 => {
                let got = retry(&what, || d.download_many(&m.buffers));
                for (i, g) in got.iter().enumerate() {
                    same(&format!("{what}: download_many {i}"), g, &m.expect[i]);
                }
            }
            5 => {
                let r: Vec<R> = (0..60).map(|k| (2, k as u64 * 64, 32)).collect();
                let mut set = d.prepare_downloads(&abs(&m, &r)).unwrap();
                let w = want(&m, &r);
                for _ in 0..3 {
                    let mut out = dirty(&mut rng, r.len());
                    retry(&what, || set.download_into(&mut out));
                    for i in 0..r.len() {
                        same(&format!("{what}: prepared {i}"), &out[i], &w[i]);
                    }
                }
                let ranges = m.in_order_ranges(&mut rng, 400);
                let r: Vec<R> = ranges.iter().map(|&(i, o, l)| (i, o as u64, l as u64)).collect();
                let mut set = retry(&what, || d.prepare_downloads(&abs(&m, &r)));
                let w = want(&m, &r);
                let a = retry(&what, || set.submit()?.wait());
                let mut out = dirty(&mut rng, r.len());
                retry(&what, || set.download_into(&mut out));
                for i in 0..r.len() {
                    same(&format!("{what}: prepared in order view {i}"), a.get(set.slot(i)), &w[i]);
                    same(&format!("{what}: prepared in order into {i}"), &out[i], &w[i]);
                }
            }
            6 => {
                let (i, at, len) = m.range(&mut rng, 200_000);
                let bytes = random_vec(&mut rng, len);
                let mut dst = vec![0u8; len];
                let (j, at2, len2) = m.range(&mut rng, 200_000);
                let mut dst2 = vec![0u8; len2];
                let old2 = m.expect[j][at2..at2 + len2].to_vec();
                let buf = (m.buffers[i], m.buffers[j]);
                retry(&what, || {
                    d.scope(|s| {
                        let mut r = s.downloads();
                        r.read_to_slice(buf.1, at2 as u64, &mut dst2)?;
                        let _ = r.submit()?;
                        let mut w = s.uploads();
                        w.write(buf.0, at as u64, &bytes)?;
                        let _ = w.submit()?;
                        let mut r = s.downloads();
                        r.read_to_slice(buf.0, at as u64, &mut dst)?;
                        r.submit().map(drop)
                    })
                });
                same(&format!("{what}: scoped read after write"), &dst, &bytes);
                if i != j || at2 + len2 <= at || at + len <= at2 {
                    same(&format!("{what}: scoped read"), &dst2, &old2);
                }
                m.expect[i][at..at + len].copy_from_slice(&bytes);
            }
            7 => {
                let r = vec![(3usize, 1u64, (1u64 << 20) - 1), (0, 0, 300_000)];
                let w = want(&m, &r);
                let mut out = dirty(&mut rng, 2);
                retry(&what, || d.download_into(&abs(&m, &r), &mut out));
                let (done, slots) = retry(&what, || {
                    let mut b = d.downloads();
                    let slots = b.read_many(abs(&m, &r))?;
                    Ok((b.submit()?.wait()?, slots))
                });
                for i in 0..2 {
                    same(&format!("{what}: streamed into {i}"), &out[i], &w[i]);
                    same(&format!("{what}: streamed view {i}"), done.get(slots[i]), &w[i]);
                }
                if t == 0 {
                    d.trim().unwrap();
                }
            }
            _ => {
                let (i, at, len) = m.range(&mut rng, 100_000);
                let bytes = random_vec(&mut rng, len);
                let fence = retry(&what, || {
                    let mut b = d.uploads();
                    b.write(m.buffers[i], at as u64, &bytes)?;
                    b.submit()
                });
                m.expect[i][at..at + len].copy_from_slice(&bytes);
                let (done, s) = retry(&what, || {
                    let mut r = d.downloads();
                    let s = r.read(m.buffers[i], at as u64, len as u64)?;
                    Ok((r.submit()?.wait()?, s))
                });
                same(&format!("{what}: read after pending write"), done.get(s), &bytes);
                fence.wait().unwrap();
            }
        }
    }
    let got = retry("final", || d.download_many(&m.buffers));
    for (i, g) in got.iter().enumerate() {
        same(&format!("thread {t}: final {i}"), g, &m.expect[i]);
    }
    for &x in &m.buffers {
        d.free(x).unwrap();
    }
}

#[test]
fn stress_8_threads_tiny() {
    stress(tiny(), 8, 400, 1);
}

#[test]
fn stress_8_threads_minimal() {
    stress(minimal(), 8, 300, 2);
}

#[test]
fn stress_8_threads_small() {
    stress(small_chunks().with_pinned_prewarm_bytes(0).with_pack_threads(3), 8, 400, 3);
}

#[test]
fn stress_8_threads_dma() {
    stress(tiny().with_small_copies_over_bus(false), 8, 400, 4);
}

/// Runs `body` while another thread, on the same device and model GPU, reads `ranges` with
/// `Device::download_ranges` over and over (each read must succeed).
fn beside_a_reader<T>(d: &Device, ranges: Vec<(ResidentBuffer, u64, u64)>, body: impl FnOnce() -> T) -> T {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (d, stop) = (d.clone(), Arc::clone(&stop));
        spawn_joined(&model::shared(), move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                d.download_ranges(&ranges).unwrap();
            }
        })
    };
    let result = body();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    reader.join().unwrap();
    result
}

/// Uploads `data` into `dst` again and again for `secs` seconds: how many, and the errors.
fn uploads_for(d: &Device, dst: ResidentBuffer, data: &[u8], secs: u64) -> (usize, Vec<String>) {
    let (mut errors, mut runs) = (Vec::new(), 0);
    let start = std::time::Instant::now();
    while start.elapsed() < std::time::Duration::from_secs(secs) {
        runs += 1;
        if let Err(e) = d.upload(dst, data) {
            errors.push(e.to_string());
        }
    }
    (runs, errors)
}

/// Two threads on one device: one reads a buffer larger than the pinned pool (it streams
/// through a ring of pinned chunks), the other uploads. The streamed read holds the whole
/// pool for its ring while it copies chunks out, with nothing in flight to wait for: the
/// upload waits for the ring to come back, and never fails with PinnedExhausted.
#[test]
fn an_upload_waits_for_the_staging_of_a_download_streaming_on_another_thread() {
    let d = device(minimal());
    let big = d.allocate(1 << 20).unwrap();
    let small = d.allocate(1 << 20).unwrap();
    let data = vec![7u8; 1 << 20];
    let (runs, errors) = beside_a_reader(&d, vec![(big, 0, 1 << 20)], || uploads_for(&d, small, &data, 2));
    assert!(errors.is_empty(), "{} of {runs} uploads failed; first: {}", errors.len(), errors[0]);
    assert!(d.download(small).unwrap() == data);
}

/// As above, with batches of several chunks (many small writes in order, one large write),
/// each followed by a read of the whole buffer on the same thread: every batch lands whole.
#[test]
fn uploads_beside_a_streaming_download_land_whole() {
    for (name, in_order) in [("many small writes in order", true), ("one large write", false)] {
        let d = device(minimal());
        let big = d.allocate(1 << 20).unwrap();
        let target = d.allocate(1 << 20).unwrap();
        d.upload(target, &vec![0u8; 1 << 20]).unwrap();
        beside_a_reader(&d, vec![(big, 0, 1 << 20)], || {
            for round in 0..60u32 {
                let value = (round % 250) as u8 + 1;
                let data = vec![value; 1 << 20];
                let mut b = d.uploads();
                if in_order {
                    for k in 0..(1 << 20) / 1024 {
                        b.write(target, k * 1024, &data[k as usize * 1024..][..1000]).unwrap();
                    }
                } else {
                    b.write(target, 0, &data).unwrap();
                }
                b.submit().and_then(|f| f.wait()).unwrap_or_else(|e| panic!("{name}, round {round}: {e}"));
                let got = d.download_ranges(&[(target, 0, 1 << 20)]).unwrap().pop().unwrap();
                let landed =
                    got.iter().enumerate().all(|(i, &x)| x == value || (in_order && i % 1024 >= 1000));
                assert!(landed, "{name}, round {round}: the batch did not land whole");
            }
        });
    }
}

/// The other way round: downloads (any route) while another thread uploads never fail for
/// staging, as the caller holds none.
#[test]
fn downloads_beside_another_threads_uploads_never_fail_for_staging() {
    for (name, config) in [("minimal", minimal()), ("tiny", tiny())] {
        let d = device(config);
        let gpu = model::shared();
        let mut rng = fastrand::Rng::with_seed(5);
        let m = Model::new(&d, &mut rng, &[1 << 20]);
        let target = d.allocate(1 << 20).unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (d, stop) = (d.clone(), Arc::clone(&stop));
            spawn_joined(&gpu, move || {
                let data = vec![1u8; 1 << 20];
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = d.upload(target, &data);
                }
            })
        };
        let (mut errors, mut runs) = (Vec::new(), 0);
        let start = std::time::Instant::now();
        while start.elapsed() < std::time::Duration::from_secs(2) {
            runs += 1;
            let ranges: Vec<_> = (0..100).map(|k| (m.buffers[0], k * 5000, 3000)).collect();
            match d.download_ranges(&ranges) {
                Ok(got) => assert_eq!(got[7], m.expect[0][35_000..38_000]),
                Err(e) => errors.push(e.to_string()),
            }
            if let Err(e) = d.download_ranges(&[(m.buffers[0], 0, 1 << 20)]) {
                errors.push(e.to_string());
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        writer.join().unwrap();
        assert!(
            errors.is_empty(),
            "{name}: {} of {runs} downloads failed; first: {}",
            errors.len(),
            errors[0]
        );
    }
}

/// With a PinnedBuffer holding the held limit (allowed), one thread reads many tiny ranges
/// (so it streams, through the reserve), another uploads: every upload is served, also where
/// the reader holds the reserve while it copies out, or the uploader's own leases are still
/// on their way back from the thread that retired them.
#[test]
fn uploads_beside_a_streaming_download_and_a_full_held_limit_never_fail_for_staging() {
    for config in [tiny(), small_chunks()] {
        upload_with_pinned_buffer_at_the_held_limit(config);
    }
}

fn upload_with_pinned_buffer_at_the_held_limit(config: Config) {
    let d = device(config.clone());
    let limit = d.telemetry().pinned.held_limit_bytes;
    let _held = d.pinned(limit as usize).unwrap();
    let src = d.allocate(1 << 20).unwrap();
    let dst = d.allocate(1 << 20).unwrap();
    let ranges: Vec<_> = (0..20_000u64).rev().map(|k| (src, k * 50, 1)).collect();
    let data = vec![7u8; 1 << 20];
    let (runs, errors) = beside_a_reader(&d, ranges, || uploads_for(&d, dst, &data, 2));
    assert!(errors.is_empty(), "{config:?}: {} of {runs} uploads failed; first: {}", errors.len(), errors[0]);
}

/// Batches plan before they take their lane, so two threads' batches may plan at once: their
/// bytes still land in the order the lane took them. Round after round, two threads submit
/// a batch that plans (as `build` makes it, taking `route`) to the same bytes of one buffer at
/// the same moment; the buffer's bytes that the batches write (`written`) then hold the
/// bytes of the upload whose submission the lane numbered last.
fn two_threads_apply_in_lane_order(
    route: crate::plan::route::Route,
    build: for<'a> fn(&'a Device, ResidentBuffer, &'a [u8]) -> crate::UploadBatch<'a>,
    written: fn(usize) -> bool,
) {
    const LEN: usize = 64 << 10;
    let d = device(small_chunks());
    let gpu = model::shared();
    let buffer = d.allocate(LEN as u64).unwrap();
    for round in 0..24u8 {
        let barrier = Arc::new(std::sync::Barrier::new(2));
        let threads: Vec<_> = (0..2u8)
            .map(|t| {
                let (d, barrier) = (d.clone(), Arc::clone(&barrier));
                spawn_joined(&gpu, move || {
                    let fill = round.wrapping_mul(2).wrapping_add(t + 1);
                    let bytes = vec![fill; LEN];
                    let writes = build(&d, buffer, &bytes);
                    assert_eq!(writes.route(), route);
                    barrier.wait();
                    let fence = writes.submit().unwrap();
                    let seq = fence.target().expect("a fence of the lane").2;
                    fence.wait().unwrap();
                    (seq, fill)
                })
            })
            .collect();
        let mut done: Vec<(u64, u8)> = threads.into_iter().map(|h| h.join().unwrap()).collect();
        done.sort();
        assert!(done[0].0 < done[1].0, "round {round}: two submissions of the lane");
        let last = done[1].1;
        let got = d.download(buffer).unwrap();
        assert!(
            got.iter().enumerate().all(|(i, &b)| !written(i) || b == last),
            "round {round}: the lane's last upload"
        );
    }
}

/// Planned uploads: overlapping writes, which the planner fuses.
#[test]
fn planned_batches_from_two_threads_apply_in_lane_order() {
    two_threads_apply_in_lane_order(
        crate::plan::route::Route::Planned,
        |d, buffer, bytes| {
            let mut writes = d.uploads();
            writes.write(buffer, 0, &bytes[..40 << 10]).unwrap();
            writes.write(buffer, 16 << 10, &bytes[16 << 10..]).unwrap();
            writes
        },
        |_| true,
    );
}

/// In-place uploads out of order and apart: the planner checks, before the lane is taken,
/// that no two writes fuse, and the batch moves in place.
#[test]
fn in_place_batches_out_of_order_from_two_threads_apply_in_lane_order() {
    // Writes made in place, in reverse order, 96 bytes apart (touching ones would fuse and
    // hand the batch on to the planned route).
    fn apart<'a>(d: &'a Device, buffer: ResidentBuffer, bytes: &'a [u8]) -> crate::UploadBatch<'a> {
        let fill = bytes[0];
        let mut writes = d.uploads();
        for k in (0..bytes.len() as u64 / 4096).rev() {
            writes.write_with(buffer, k * 4096, 4000, |dst| dst.fill(fill)).unwrap();
        }
        writes
    }
    // The shape moves in place to the end, not handed on.
    let d = device(small_chunks());
    let buffer = d.allocate(64 << 10).unwrap();
    let bytes = vec![9u8; 64 << 10];
    let mut batch = apart(&d, buffer, &bytes);
    let fence = crate::engine::routes::in_place::execute_in_place(&mut batch.view()).unwrap();
    fence.expect("moved in place").wait().unwrap();
    let got = d.download(buffer).unwrap();
    assert!(got.iter().enumerate().all(|(i, &b)| (i % 4096 < 4000) == (b == 9)));
    two_threads_apply_in_lane_order(crate::plan::route::Route::InPlace, apart, |i| i % 4096 < 4000);
}

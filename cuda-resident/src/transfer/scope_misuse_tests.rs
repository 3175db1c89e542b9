//! Scoped transfers against misuse, on the model driver: ranges at and past the edges,
//! buffers and pinned memory of another device, a buffer freed inside the scope, reads and
//! writes of the same bytes, panicking iterators, driver faults (no copy may touch the
//! caller's memory once the scope has returned), and random batches over pinned, registered
//! and pageable memory against a byte model.

use std::sync::Arc;

use cuda_sys::{CUDA_ERROR_OUT_OF_MEMORY, Fault};

use crate::testing::{model, random_vec};
use crate::{Config, Device, Error, ResidentBuffer};

fn device(config: Config) -> (Arc<cuda_sys::Driver>, Device) {
    let driver = model::driver();
    let d = Device::open_on_driver(Arc::clone(&driver), 0, config).expect("the model opens");
    (driver, d)
}

fn pool(d: &Device, rng: &mut fastrand::Rng, len: usize) -> (ResidentBuffer, Vec<u8>) {
    let buffer = d.allocate(len as u64).unwrap();
    let bytes = random_vec(rng, len);
    d.upload(buffer, &bytes).unwrap();
    (buffer, bytes)
}

/// Small chunks and pool; DMAs in one driver call (`Config::dma_batches`), so that the
/// fault matrix fails that call too.
fn small() -> Config {
    Config {
        dma_batches: true,
        chunk_bytes: 64 << 10,
        direct_threshold: 8 << 10,
        pinned_cap_bytes: 64 << 20,
        ..Config::default()
    }
}

/// Range edges: every bad range is refused with a Fix, for every entry point, and nothing moves.
#[test]
fn bad_ranges_are_refused_with_a_fix_and_move_nothing() {
    let (_drv, d) = device(Config::default());
    let mut rng = fastrand::Rng::with_seed(1);
    let (b, expect) = pool(&d, &mut rng, 4096);
    let src = d.pinned(8192).unwrap();
    let moved = d.telemetry().bytes_requested;
    let bad: &[(u64, usize)] =
        &[(4097, 0), (u64::MAX, 0), (u64::MAX, 1), (u64::MAX - 1, 4), (4096, 1), (4095, 2), (0, 4097)];
    for &(off, len) in bad {
        let r = d.scope(|s| {
            let mut w = s.uploads();
            let e = w.write(b, off, &src[..len]).unwrap_err();
            assert!(matches!(e, Error::OutOfRange { .. }), "{e}");
            assert!(e.to_string().contains("Fix:"), "{e}");
            let e = w.write_many([(b, 0, &src[..1]), (b, off, &src[..len])]).unwrap_err();
            assert!(matches!(e, Error::BadItem { index: 1, .. }), "{e}");
            assert!(e.to_string().contains("Fix:"), "{e}");
            w.submit()
        });
        assert!(matches!(r, Err(Error::OutOfRange { .. })), "{off} {len}: {r:?}");
        let mut out = vec![0u8; len];
        let r = d.scope(|s| {
            let mut rd = s.downloads();
            let e = rd.read_to_slice(b, off, &mut out).unwrap_err();
            assert!(matches!(e, Error::OutOfRange { .. }), "{e}");
            rd.submit()
        });
        assert!(matches!(r, Err(Error::OutOfRange { .. })), "{off} {len}: {r:?}");
    }
    // Good edges.
    d.scope(|s| {
        let mut w = s.uploads();
        w.write(b, 4096, &src[..0])?;
        w.write(b, 4095, &src[..1])?;
        w.write_many(std::iter::empty())?;
        w.submit().map(drop)
    })
    .unwrap();
    assert_eq!(d.telemetry().bytes_requested - moved, 1);
    let mut e2 = expect.clone();
    e2[4095] = src[0];
    assert!(d.download(b).unwrap() == e2);
}

/// A buffer of another device, and pinned memory of another device.
#[test]
fn another_devices_buffer_is_refused_and_its_pinned_memory_moves_in_place() {
    let driver = model::driver();
    let d0 = Device::open_on_driver(Arc::clone(&driver), 0, Config::default()).unwrap();
    let d1 = Device::open_on_driver(driver, 1, Config::default()).unwrap();
    let mut rng = fastrand::Rng::with_seed(2);
    let (b0, e0) = pool(&d0, &mut rng, 4 << 20);
    let b1 = d1.allocate(4096).unwrap();
    let src = random_vec(&mut rng, 4096);
    let r = d0.scope(|s| {
        let mut w = s.uploads();
        let e = w.write(b1, 0, &src).unwrap_err();
        assert!(matches!(e, Error::ForeignBuffer { .. }), "{e}");
        assert!(e.to_string().contains("Fix:"));
        w.submit()
    });
    assert!(matches!(r, Err(Error::ForeignBuffer { .. })), "{r:?}");
    // Pinned memory of device 1 in a scope of device 0, in place, every path.
    let mut cache = d1.pinned(4 << 20).unwrap();
    cache.fill(0);
    let (head, tail) = cache.split_at_mut(2 << 20);
    d0.scope(|s| {
        let mut rd = s.downloads();
        for (i, c) in head.chunks_mut(4096).enumerate() {
            rd.read_to_slice(b0, (i * 4096) as u64, c)?;
        }
        let (t0, t1) = tail.split_at_mut(4096);
        rd.read_to_slice(b0, 100, &mut t0[..1000])?;
        rd.read_to_slice(b0, 1 << 20, &mut t1[..1 << 20])?;
        rd.submit().map(drop)
    })
    .unwrap();
    assert!(cache[..2 << 20] == e0[..2 << 20]);
    assert!(cache[(2 << 20)..(2 << 20) + 1000] == e0[100..1100]);
    assert!(model::with(|g| g.errors.is_empty()), "{:?}", model::with(|g| g.errors.clone()));
}

/// A buffer freed inside the scope after an in-place read of it was submitted: the read
/// still lands the old bytes, and a new buffer made in its place is not touched.
#[test]
fn a_buffer_freed_after_its_read_was_submitted_still_reads_its_own_bytes() {
    let (_drv, d) = device(Config::default());
    let mut rng = fastrand::Rng::with_seed(3);
    let (b, expect) = pool(&d, &mut rng, 2 << 20);
    let mut cache = d.pinned(2 << 20).unwrap();
    cache.fill(0);
    let mut newer = None;
    d.scope(|s| {
        let mut rd = s.downloads();
        for (i, c) in cache.chunks_mut(4096).enumerate() {
            rd.read_to_slice(b, (i * 4096) as u64, c)?;
        }
        let _ = rd.submit()?;
        d.free(b)?;
        let n = d.allocate(2 << 20)?;
        d.upload(n, &vec![0xEE; 2 << 20])?;
        newer = Some(n);
        Ok(())
    })
    .unwrap();
    assert!(cache[..] == expect[..], "the read landed the freed buffer's bytes");
    assert!(d.download(newer.unwrap()).unwrap().iter().all(|&x| x == 0xEE));
    assert!(model::with(|g| g.errors.is_empty()));
}

/// A read and a write on the same device bytes in one scope: submit order decides.
#[test]
fn a_read_and_a_write_of_the_same_bytes_apply_in_submit_order() {
    for (pinned_host, block) in [(true, 4096usize), (true, 256 << 10), (false, 4096), (true, 64)] {
        let (_drv, d) = device(Config::default());
        let mut rng = fastrand::Rng::with_seed(4);
        let (b, expect) = pool(&d, &mut rng, 64 * block);
        let mut pc = if pinned_host { Some(d.pinned(32 * block).unwrap()) } else { None };
        let mut vc = vec![0u8; 32 * block];
        let cache: &mut [u8] = match &mut pc {
            Some(p) => &mut p[..],
            None => &mut vc,
        };
        rng.fill(cache);
        let (out, inn) = cache.split_at_mut(16 * block);
        let incoming = inn.to_vec();
        // read blocks 0..16 then write blocks 0..16 (new bytes); read must see old bytes.
        d.scope(|s| {
            let mut rd = s.downloads();
            for (i, c) in out.chunks_mut(block).enumerate() {
                rd.read_to_slice(b, (i * block) as u64, c)?;
            }
            let mut w = s.uploads();
            for (i, c) in inn.chunks(block).enumerate() {
                w.write(b, (i * block) as u64, c)?;
            }
            let _ = rd.submit()?;
            w.submit().map(drop)
        })
        .unwrap();
        assert!(
            cache[..16 * block] == expect[..16 * block],
            "read before write sees old ({pinned_host}, {block})"
        );
        let got = d.download(b).unwrap();
        assert!(got[..16 * block] == incoming[..], "write landed ({pinned_host}, {block})");
        // write then read: read sees new.
        let mut e2 = got.clone();
        let newer = random_vec(&mut rng, 16 * block);
        let cache: &mut [u8] = match &mut pc {
            Some(p) => &mut p[..],
            None => &mut vc,
        };
        let (out, inn) = cache.split_at_mut(16 * block);
        inn.copy_from_slice(&newer);
        d.scope(|s| {
            let mut w = s.uploads();
            for (i, c) in inn.chunks(block).enumerate() {
                w.write(b, ((16 + i) * block) as u64, c)?;
            }
            let _ = w.submit()?;
            let mut rd = s.downloads();
            for (i, c) in out.chunks_mut(block).enumerate() {
                rd.read_to_slice(b, ((16 + i) * block) as u64, c)?;
            }
            rd.submit().map(drop)
        })
        .unwrap();
        e2[16 * block..32 * block].copy_from_slice(&newer);
        assert!(
            cache[..16 * block] == newer[..],
            "write before read: read sees new ({pinned_host}, {block})"
        );
        assert!(d.download(b).unwrap() == e2);
        assert!(model::with(|g| g.errors.is_empty()));
    }
}

/// An iterator that panics part way: the panic goes on, nothing moves.
#[test]
fn a_panicking_iterator_in_a_scope_moves_nothing() {
    let (_drv, d) = device(Config::default());
    let mut rng = fastrand::Rng::with_seed(5);
    let (b, expect) = pool(&d, &mut rng, 1 << 20);
    let cache = d.pinned(1 << 20).unwrap();
    let moved = d.telemetry().bytes_moved;
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        d.scope(|s| {
            let mut w = s.uploads();
            w.write_many((0..100).map(|i| {
                assert!(i < 50, "iterator panics");
                (b, (i * 4096) as u64, &cache[i * 4096..(i + 1) * 4096])
            }))?;
            w.submit()
        })
    }));
    assert!(caught.is_err());
    assert_eq!(d.telemetry().bytes_moved, moved);
    assert!(d.download(b).unwrap() == expect);
}

/// One scope of every in-place shape on `d`: a run of 2 MiB (chunks), scattered small
/// items (bus), a large item (DMA), each way, into and out of `cache` (pinned).
fn every_shape(d: &Device, b: ResidentBuffer, cache: &mut [u8]) -> crate::Result<()> {
    let (down, up) = cache.split_at_mut(4 << 20);
    let (run, rest) = down.split_at_mut(2 << 20);
    let (small, large) = rest.split_at_mut(1 << 20);
    d.scope(|s| {
        let mut rd = s.downloads();
        for (i, c) in run.chunks_mut(4096).enumerate() {
            rd.read_to_slice(b, ((511 - i) * 4096) as u64, c)?;
        }
        for (i, c) in small.chunks_mut(8192).enumerate() {
            rd.read_to_slice(b, (i * 5000) as u64, &mut c[..1000])?;
        }
        // Two large reads apart (no run): one DMA each, together one batched driver call.
        let (first, second) = large.split_at_mut(512 << 10);
        rd.read_to_slice(b, 3 << 20, &mut first[..256 << 10])?;
        rd.read_to_slice(b, (3 << 20) + (512 << 10), &mut second[..256 << 10])?;
        let mut w = s.uploads();
        let (wrun, wrest) = up.split_at(2 << 20);
        for (i, c) in wrun.chunks(4096).enumerate() {
            w.write(b, ((4 << 20) + (511 - i) * 4096) as u64, c)?;
        }
        for (i, c) in wrest[..1 << 20].chunks(8192).enumerate() {
            w.write(b, ((6 << 20) + i * 5000) as u64, &c[..1000])?;
        }
        let large = &wrest[1 << 20..];
        w.write(b, 7 << 20, &large[..256 << 10])?;
        w.write(b, (7 << 20) + (512 << 10), &large[512 << 10..768 << 10])?;
        let _ = rd.submit()?;
        w.submit().map(drop)
    })
}

/// Every driver call a scope makes fails in turn: once the scope has returned, no queued
/// work may still write the caller's memory (checked for codes that leave the context
/// alive; for the others, only no panic and a Fix).
fn fault_matrix(config: Config, registered: bool, code: cuda_sys::CUresult, times: u64) -> Vec<String> {
    let (driver, d) = device(config);
    let mut rng = fastrand::Rng::with_seed(6);
    let (b, _) = pool(&d, &mut rng, 8 << 20);
    let mut pinned = if registered { None } else { Some(d.pinned(8 << 20).unwrap()) };
    let mut vec = vec![0u8; 8 << 20];
    if registered {
        // SAFETY: the vector stays mapped and unmoved until unpinned below.
        unsafe { d.pin_host(vec.as_mut_ptr(), vec.len()) }.unwrap();
    }
    let cache: &mut [u8] = match &mut pinned {
        Some(p) => &mut p[..],
        None => &mut vec,
    };
    rng.fill(&mut cache[..]);
    let faults = driver.faults();
    faults.record();
    every_shape(&d, b, cache).unwrap();
    let recorded = faults.counts();
    faults.clear();
    // In this crate's pinned memory, the large items' DMAs go in one driver call a way, where
    // host addresses are device addresses; without a unified address space, never.
    let batched = recorded.contains_key("cuMemcpyBatchAsync_v2");
    let unified = d.info().unified_addressing;
    assert!(registered || batched == unified, "unified addressing {unified}: {recorded:?}");
    let lost = code != CUDA_ERROR_OUT_OF_MEMORY;
    let mut failures = Vec::new();
    for (&entry, count) in &recorded {
        for k in 1..=count.calls {
            faults.record();
            faults.inject(Fault::new(entry, k, code).times(times)).unwrap();
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| every_shape(&d, b, cache)));
            faults.clear();
            match r {
                Err(_) => {
                    failures.push(format!("{entry} #{k}: panicked"));
                    continue;
                }
                Ok(Err(ref e)) if !e.to_string().contains("Fix:") => {
                    failures.push(format!("{entry} #{k}: no fix: {e}"))
                }
                _ => {}
            }
            if lost {
                model::complete_all();
                model::with(|g| g.errors.clear());
                continue;
            }
            // The borrow has ended: poison the caller's memory, let the GPU run whatever is
            // still queued, and check nothing wrote it.
            cache.fill(0xC3);
            model::complete_all();
            if let Some(at) = cache.iter().position(|&x| x != 0xC3) {
                failures.push(format!(
                    "{entry} #{k}: byte {at} of the caller's memory written after the scope returned ({r:?})"
                ));
            }
            if !model::with(|g| g.errors.is_empty()) {
                failures.push(format!(
                    "{entry} #{k}: model errors {:?}",
                    model::with(|g| std::mem::take(&mut g.errors))
                ));
            }
            if let Err(e) = every_shape(&d, b, cache) {
                failures.push(format!("{entry} #{k}: the run after failed: {e}"));
            }
        }
    }
    if registered {
        // SAFETY: pinned above; every scope waited for its copies.
        unsafe { d.unpin_host(vec.as_mut_ptr()) }.unwrap();
    }
    failures
}

/// [`fault_matrix`] of one shape of failure: none may leave work on the caller's memory.
fn no_fault_leaves_work(registered: bool, code: cuda_sys::CUresult, times: u64) {
    let failures = fault_matrix(small(), registered, code, times);
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn faults_in_a_scope_never_leave_work_on_the_callers_memory() {
    no_fault_leaves_work(false, CUDA_ERROR_OUT_OF_MEMORY, 1);
}

#[test]
fn faults_in_a_scope_over_registered_memory_never_leave_work_on_it() {
    no_fault_leaves_work(true, CUDA_ERROR_OUT_OF_MEMORY, 1);
}

/// Three failures in a row: a failed event's lane synchronizes the stream, asking again.
#[test]
fn repeated_faults_in_a_scope_never_leave_work_on_the_callers_memory() {
    no_fault_leaves_work(false, CUDA_ERROR_OUT_OF_MEMORY, 3);
}

#[test]
fn faults_that_lose_the_context_in_a_scope_neither_panic_nor_lack_a_fix() {
    no_fault_leaves_work(false, cuda_sys::CUDA_ERROR_LAUNCH_FAILED, 1);
}

#[test]
fn faults_in_a_scope_without_unified_addressing_never_leave_work_on_the_callers_memory() {
    model::with(|g| g.no_unified_addressing = true);
    let failures = fault_matrix(small(), false, CUDA_ERROR_OUT_OF_MEMORY, 1);
    model::with(|g| g.no_unified_addressing = false);
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// Random scoped batches: writes from a host area that is part PinnedBuffer, part pin_host
/// registered, part pageable (runs over their borders, overlapping writes, empty ones), then
/// reads back into each kind; compared with a byte model.
#[test]
fn random_scoped_batches_match_a_byte_model() {
    for (round, config) in [
        Config::default(),
        small(),
        Config { chunk_bytes: 1 << 20, direct_threshold: 1, ..Config::default() },
        Config::default().with_small_copies_over_bus(false),
    ]
    .into_iter()
    .enumerate()
    {
        let (_drv, d) = device(config);
        let mut rng = fastrand::Rng::with_seed(100 + round as u64);
        let len = 6 << 20;
        let (b, mut expect) = pool(&d, &mut rng, len);
        let mut pinned = d.pinned(3 << 20).unwrap();
        let mut reg = vec![0u8; 4 << 20];
        // Registered: the middle 2 MiB only, so that runs cross its borders.
        // SAFETY: the vector stays mapped and unmoved until unpinned below.
        unsafe { d.pin_host(reg.as_mut_ptr().add(1 << 20), 2 << 20) }.unwrap();
        let mut page = vec![0u8; 3 << 20];
        for iter in 0..6 {
            rng.fill(&mut pinned[..]);
            rng.fill(&mut reg[..]);
            rng.fill(&mut page[..]);
            // Writes: (area, host offset, device offset, len).
            let mut writes = Vec::new();
            for _ in 0..rng.usize(1..3000) {
                let area = rng.usize(0..3);
                let alen = [pinned.len(), reg.len(), page.len()][area];
                let l = match rng.u8(..10) {
                    0 => 0,
                    1 => rng.usize(100_000..600_000),
                    _ => rng.usize(1..9000),
                };
                let l = l.min(alen);
                let h = rng.usize(0..=alen - l);
                let o = rng.usize(0..=len - l);
                writes.push((area, h, o, l));
            }
            // Sometimes contiguous host runs: rewrite host offsets to follow each other.
            if iter % 2 == 0 {
                let mut at = [0usize; 3];
                for w in writes.iter_mut() {
                    let alen = [pinned.len(), reg.len(), page.len()][w.0];
                    if at[w.0] + w.3 > alen {
                        at[w.0] = 0;
                    }
                    w.1 = at[w.0];
                    at[w.0] += w.3;
                }
            }
            let areas: [&[u8]; 3] = [&pinned[..], &reg[..], &page[..]];
            d.scope(|s| {
                let mut batch = s.uploads();
                if iter % 3 == 0 {
                    batch
                        .write_many(writes.iter().map(|&(a, h, o, l)| (b, o as u64, &areas[a][h..h + l])))?;
                } else {
                    for &(a, h, o, l) in &writes {
                        batch.write(b, o as u64, &areas[a][h..h + l])?;
                    }
                }
                batch.submit().map(drop)
            })
            .unwrap();
            for &(a, h, o, l) in &writes {
                expect[o..o + l].copy_from_slice(&areas[a][h..h + l]);
            }
            let got = d.download(b).unwrap();
            assert!(
                got == expect,
                "round {round} iter {iter}: writes differ at {:?}",
                got.iter().zip(&expect).position(|(x, y)| x != y)
            );
            assert!(model::with(|g| g.errors.is_empty()), "{:?}", model::with(|g| g.errors.clone()));
            // Reads: disjoint host pieces of each area, in order (runs) or shuffled.
            pinned.fill(0xA5);
            reg.fill(0xA5);
            page.fill(0xA5);
            let mut reads: Vec<(usize, usize, usize, usize)> = Vec::new();
            for a in 0..3 {
                let alen = [pinned.len(), reg.len(), page.len()][a];
                let mut h = 0;
                loop {
                    let l = match rng.u8(..10) {
                        0 => 0,
                        1 => rng.usize(100_000..400_000),
                        _ => rng.usize(1..9000),
                    };
                    if h + l > alen {
                        break;
                    }
                    reads.push((a, h, rng.usize(0..=len - l), l));
                    h += l + if rng.bool() { 0 } else { rng.usize(1..100) };
                }
            }
            if iter % 2 == 1 {
                rng.shuffle(&mut reads);
            }
            {
                // Split each area into the disjoint &mut pieces the reads name.
                let mut pieces: Vec<(usize, usize, &mut [u8])> = Vec::new();
                let mut order: Vec<usize> = (0..reads.len()).collect();
                order.sort_by_key(|&i| (reads[i].0, reads[i].1, reads[i].3));
                let mut rests: [&mut [u8]; 3] = [&mut pinned[..], &mut reg[..], &mut page[..]];
                let mut taken = [0usize; 3];
                let mut by_index: Vec<Option<(usize, &mut [u8])>> = (0..reads.len()).map(|_| None).collect();
                for i in order {
                    let (a, h, o, l) = reads[i];
                    let rest = std::mem::take(&mut rests[a]);
                    let (_, rest) = rest.split_at_mut(h - taken[a]);
                    let (piece, rest) = rest.split_at_mut(l);
                    rests[a] = rest;
                    taken[a] = h + l;
                    by_index[i] = Some((o, piece));
                }
                for (i, p) in by_index.into_iter().enumerate() {
                    let (o, piece) = p.unwrap();
                    pieces.push((i, o, piece));
                }
                d.scope(|s| {
                    let mut batch = s.downloads();
                    if iter % 3 == 1 {
                        batch.read_to_slice_many(
                            pieces.iter_mut().map(|(_, o, p)| (b, *o as u64, &mut **p)),
                        )?;
                    } else {
                        for (_, o, p) in pieces.iter_mut() {
                            batch.read_to_slice(b, *o as u64, p)?;
                        }
                    }
                    batch.submit().map(drop)
                })
                .unwrap();
            }
            let areas: [&[u8]; 3] = [&pinned[..], &reg[..], &page[..]];
            for &(a, h, o, l) in &reads {
                assert!(
                    areas[a][h..h + l] == expect[o..o + l],
                    "round {round} iter {iter}: read {a} {h} {o} {l}"
                );
            }
            assert!(model::with(|g| g.errors.is_empty()), "{:?}", model::with(|g| g.errors.clone()));
        }
        // SAFETY: pinned above; every scope waited.
        unsafe { d.unpin_host(reg.as_mut_ptr().add(1 << 20)) }.unwrap();
    }
}

/// A buffer freed before `submit` fails the batch with nothing moved, whatever route its
/// first part takes: 1024 writes of 1 KiB from pinned memory (a first part), two of them
/// overlapping (that part then goes through staging, which claims only its own buffers) or
/// none, then a write to a second buffer, from pageable or from pinned memory, and that
/// buffer freed before `submit`.
#[test]
fn a_buffer_freed_before_submit_fails_the_batch_whatever_route_its_first_part_takes() {
    for (overlap, last_pinned) in [(true, false), (true, true), (false, false), (false, true)] {
        let (_driver, d) = device(Config::default());
        let mut rng = fastrand::Rng::with_seed(3);
        let (b1, before) = pool(&d, &mut rng, 8 << 20);
        let b2 = d.allocate(4096).unwrap();
        let mut cache = d.pinned(1025 * 2048).unwrap();
        rng.fill(&mut cache[..]);
        let page = random_vec(&mut rng, 1024);
        let r = d.scope(|s| {
            let mut w = s.uploads();
            // 1 KiB items 2 KiB apart in host memory (no runs): the first part ends at 1024.
            for i in 0..1024 {
                let at = if overlap && i == 1 { 0 } else { i * 4096 };
                w.write(b1, at as u64, &cache[i * 2048..i * 2048 + 1024])?;
            }
            w.write(b2, 0, if last_pinned { &cache[1024 * 2048..1024 * 2048 + 1024] } else { &page })?;
            d.free(b2)?;
            w.submit()
        });
        let case = format!("overlap {overlap}, last write pinned {last_pinned}");
        assert!(matches!(r, Err(Error::FreedBuffer { buffer }) if buffer == b2), "{case}: {r:?}");
        assert!(d.download(b1).unwrap() == before, "{case}: the batch failed, yet moved bytes");
        assert!(model::with(|g| g.errors.is_empty()));
    }
}

/// The same for reads: a buffer freed before `submit` fails the batch and lands nothing in
/// the caller's memory, whether the batch has an in-place first part or none, and whether
/// the freed buffer is named by a read of bytes or only by an empty one (which moves
/// nothing, and so is never claimed).
#[test]
fn a_buffer_freed_before_submit_fails_a_read_batch_even_where_only_an_empty_read_names_it() {
    for (pinned_front, empty) in [(false, true), (true, true), (false, false), (true, false)] {
        let (_driver, d) = device(Config::default());
        let mut rng = fastrand::Rng::with_seed(5);
        let (b1, _) = pool(&d, &mut rng, 8 << 20);
        let b2 = d.allocate(4096).unwrap();
        let mut cache = d.pinned(1025 * 2048).unwrap();
        cache.fill(0xA5);
        let mut page = vec![0x5A_u8; 4096];
        let mut last = vec![0x3C_u8; 1024];
        let r = d.scope(|s| {
            let mut reads = s.downloads();
            if pinned_front {
                // 1 KiB reads 2 KiB apart in a pinned cache: a first part of 1024 items.
                for (i, slot) in cache.chunks_mut(2048).take(1024).enumerate() {
                    reads.read_to_slice(b1, (i * 4096) as u64, &mut slot[..1024])?;
                }
            }
            reads.read_to_slice(b1, 0, &mut page)?;
            reads.read_to_slice(b2, 0, if empty { &mut [] } else { &mut last[..] })?;
            d.free(b2)?;
            reads.submit()
        });
        let case = format!("pinned first part {pinned_front}, empty read of the freed buffer {empty}");
        assert!(matches!(r, Err(Error::FreedBuffer { buffer }) if buffer == b2), "{case}: {r:?}");
        assert!(cache.iter().all(|&b| b == 0xA5), "{case}: the batch failed, yet landed bytes");
        assert!(page.iter().all(|&b| b == 0x5A) && last.iter().all(|&b| b == 0x3C), "{case}");
        assert!(model::with(|g| g.errors.is_empty()));
    }
}

/// Many small items in a pinned cache that holds nearly all of the pinned cap: the pool
/// keeps only what transfers need (`Config::pinned_reserve`), and the descriptor tables of
/// the launches must fit in it. Each launch's table stays within half a chunk, so 100,000
/// writes and reads of 64 bytes in a row (runs: 2.4 MB of descriptors) and 50,000 with gaps
/// between them (over the bus: 1.2 MB) move whole, both ways, byte for byte.
#[test]
fn many_small_items_move_in_place_with_the_pinned_pool_almost_all_held() {
    let config =
        Config { chunk_bytes: 64 << 10, direct_threshold: 8 << 10, pinned_cap_bytes: 8 << 20, ..small() };
    let block = 64;
    for (n, stride) in [(100_000, 1), (50_000, 2)] {
        let (_driver, d) = device(config.clone());
        let mut rng = fastrand::Rng::with_seed(4);
        let (b, mut expect) = pool(&d, &mut rng, 16 << 20);
        let mut cache = d.pinned(7 << 20).unwrap();
        // Out: every other 64-byte slot of the pool into the cache's slots, in order.
        cache.fill(0xA5);
        d.scope(|s| {
            let mut reads = s.downloads();
            for (i, slot) in cache.chunks_mut(stride * block).take(n).enumerate() {
                reads.read_to_slice(b, (2 * i * block) as u64, &mut slot[..block])?;
            }
            reads.submit().map(drop)
        })
        .unwrap_or_else(|e| panic!("host stride {stride}: every read lands: {e}"));
        for i in 0..n {
            let at = i * stride * block;
            assert!(cache[at..at + block] == expect[2 * i * block..][..block], "stride {stride}: read {i}");
        }
        // In: new bytes from the cache into the same slots.
        rng.fill(&mut cache[..]);
        d.scope(|s| {
            let mut writes = s.uploads();
            for (i, slot) in cache.chunks(stride * block).take(n).enumerate() {
                writes.write(b, (2 * i * block) as u64, &slot[..block])?;
            }
            writes.submit().map(drop)
        })
        .unwrap_or_else(|e| panic!("host stride {stride}: every write moves: {e}"));
        for i in 0..n {
            let at = i * stride * block;
            expect[2 * i * block..][..block].copy_from_slice(&cache[at..at + block]);
        }
        assert!(d.download(b).unwrap() == expect, "host stride {stride}");
        assert!(model::with(|g| g.errors.is_empty()));
    }
}

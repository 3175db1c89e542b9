//! Downloads at the edges, on the model driver: bad ranges refused before host memory is
//! reserved, bad reads poisoning their batch, and slots redeemed only by their own batch's
//! download.

use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::plan::route::Route;

use crate::testing::model;
use crate::testing::{Model, device, small_chunks};
use crate::{Config, Device, Error};

fn out_of_range<T: std::fmt::Debug>(what: &str, result: crate::Result<T>) {
    match result {
        Err(e @ Error::OutOfRange { .. }) => assert!(e.to_string().contains("Fix:"), "{what}: {e}"),
        other => panic!("{what}: expected OutOfRange, got {other:?}"),
    }
}

#[test]
fn a_download_range_past_the_buffer_is_out_of_range_before_any_host_memory_is_reserved() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(61);
    let m = Model::new(&d, &mut rng, &[4096]);
    let b = m.buffers[0];
    let max = u64::MAX;
    for (offset, len) in [(0, max), (1, max), (max, 1), (max, max), (4096, 1), (0, 4097), (4000, max - 3000)]
    {
        let what = format!("offset {offset}, len {len}");
        out_of_range(&format!("download_range {what}"), d.download_range(b, offset, len));
        out_of_range(&format!("download_ranges {what}"), d.download_ranges(&[(b, 0, 8), (b, offset, len)]));
        let mut out = vec![Vec::new(); 2];
        out_of_range(
            &format!("download_into {what}"),
            d.download_into(&[(b, 0, 8), (b, offset, len)], &mut out),
        );
        out_of_range(&format!("read {what}"), d.downloads().read(b, offset, len));
        out_of_range(&format!("prepare_downloads {what}"), d.prepare_downloads(&[(b, offset, len)]));
        if len <= 4097 {
            let mut slice = vec![0u8; len as usize];
            out_of_range(&format!("download_to_slice {what}"), d.download_to_slice(b, offset, &mut slice));
        }
    }
    let mut one = [0u8; 1];
    out_of_range("download_to_slice at u64::MAX", d.download_to_slice(b, max, &mut one));
    // SAFETY: the range is refused before anything is enqueued (checked first).
    let fence = unsafe { d.download_async_at(b, max, one.as_mut_ptr(), 1) };
    out_of_range("download_async_at at u64::MAX", fence);
    assert_eq!(d.telemetry().pinned.lent_bytes, 0);
    m.check(&d, "after the refused downloads");
}

#[test]
fn a_bad_read_poisons_the_batch_and_submit_fails_with_it_enqueueing_nothing() {
    let driver = model::driver();
    let d = Device::open_on_driver(driver.clone(), 0, small_chunks()).expect("the model opens");
    let other = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(62);
    let m = Model::new(&d, &mut rng, &[300_000, 4096]);
    let freed = d.allocate(1000).unwrap();
    d.free(freed).unwrap();
    let foreign = other.allocate(1000).unwrap();
    type Bad = fn(&mut crate::DownloadBatch<'_>, [crate::ResidentBuffer; 3]) -> crate::Result<()>;
    let cases: [(&str, Bad); 7] = [
        ("read_buffer of a freed handle", |r, [freed, _, _]| r.read_buffer(freed).map(drop)),
        ("read of a freed handle", |r, [freed, _, _]| r.read(freed, 0, 10).map(drop)),
        ("read_buffer_many with a freed handle", |r, [freed, _, _]| r.read_buffer_many(&[freed]).map(drop)),
        ("read_buffer of a foreign handle", |r, [_, foreign, _]| r.read_buffer(foreign).map(drop)),
        ("read of a foreign handle", |r, [_, foreign, _]| r.read(foreign, 0, 10).map(drop)),
        ("a read past the end", |r, [_, _, good]| r.read(good, 4000, 200).map(drop)),
        ("a read at u64::MAX", |r, [_, _, good]| r.read(good, u64::MAX, 1).map(drop)),
    ];
    for (what, bad) in cases {
        // Many small reads in order (the path that skips the planner) and a few ragged ones
        // (the planner's): good reads before and after the bad one.
        for count in [3usize, 200] {
            let mut reads = d.downloads();
            for k in 0..count {
                reads.read(m.buffers[0], k as u64 * 1000, 100).unwrap();
            }
            let e = bad(&mut reads, [freed, foreign, m.buffers[1]]).unwrap_err();
            assert!(e.to_string().contains("Fix:"), "{what}: {e}");
            for k in 0..count {
                reads.read(m.buffers[0], 250_000 + k as u64 * 200, 50).unwrap();
            }
            driver.faults().record();
            let before = d.telemetry();
            let got = reads.submit().map(drop).unwrap_err();
            let counts = driver.faults().counts();
            driver.faults().clear();
            assert_eq!(got.to_string(), e.to_string(), "{what}: submit fails with the read's error");
            assert!(counts.values().all(|c| c.calls == 0), "{what}, {count} reads: driver calls {counts:?}");
            let after = d.telemetry();
            assert_eq!(after.download_submissions, before.download_submissions, "{what}: nothing submitted");
            assert_eq!(after.pinned.lent_bytes, 0, "{what}: no staging held");
        }
    }
    // A buffer freed between read and submit fails submit too, the good reads with it.
    let late = d.allocate(1000).unwrap();
    let mut reads = d.downloads();
    reads.read_buffer(m.buffers[1]).unwrap();
    reads.read_buffer(late).unwrap();
    d.free(late).unwrap();
    driver.faults().record();
    assert!(matches!(reads.submit().map(drop), Err(Error::FreedBuffer { .. })));
    let counts = driver.faults().counts();
    driver.faults().clear();
    for entry in ["cuMemcpyDtoHAsync_v2", "cuLaunchKernel", "cuMemcpyHtoDAsync_v2"] {
        assert!(counts.get(entry).is_none_or(|c| c.calls == 0), "{entry}: {counts:?}");
    }
    m.check(&d, "after the poisoned batches");
}

/// Whether `f` panics with a message naming the slot's batch and a fix.
fn panics_naming_the_batch(what: &str, f: impl FnOnce()) {
    let panic = catch_unwind(AssertUnwindSafe(f)).expect_err(what);
    let text = panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(text.contains("another batch") && text.contains("Fix:"), "{what}: {text}");
}

#[test]
fn a_slot_of_another_batch_is_refused_never_redeemed_for_another_reads_bytes() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(63);
    let m = Model::new(&d, &mut rng, &[300_000, 70_000]);
    // A large batch and a smaller one: slot 0 and slot 2 of the large one exist in the
    // small one's numbering too (slot 2 does not).
    let mut big = d.downloads();
    let big_slots: Vec<_> = (0..3).map(|k| big.read(m.buffers[0], k * 5000, 1000).unwrap()).collect();
    let mut small = d.downloads();
    let small_slots = [small.read(m.buffers[1], 7, 33).unwrap(), small.read(m.buffers[1], 100, 10).unwrap()];
    let big_done = big.submit().unwrap().wait().unwrap();
    let small_done = small.submit().unwrap().wait().unwrap();
    assert_eq!(small_done.get(small_slots[0]), &m.expect[1][7..40]);
    assert_eq!(big_done.get(big_slots[2]), &m.expect[0][10_000..11_000]);
    for &slot in &big_slots {
        panics_naming_the_batch("get", || {
            let _ = small_done.get(slot);
        });
        let mut v = vec![1, 2, 3];
        panics_naming_the_batch("copy_into", || small_done.copy_into(slot, &mut v));
        assert_eq!(v, [1, 2, 3], "copy_into left the vector as it was");
        let mut out = vec![vec![9u8; 4], vec![9u8; 4]];
        let e = small_done.copy_all_into(&[small_slots[0], slot], &mut out).unwrap_err();
        assert!(matches!(e, Error::ForeignSlot { .. }) && e.to_string().contains("Fix:"), "{e}");
        assert_eq!(out, [vec![9u8; 4], vec![9u8; 4]], "copy_all_into wrote nothing");
    }
    // wait_into: on a batch laid out by the planner and on one of small reads in order.
    for count in [2u64, 100] {
        let mut reads = d.downloads();
        let slots: Vec<_> = (0..count).map(|k| reads.read(m.buffers[0], k * 2000, 500).unwrap()).collect();
        let mut out = vec![Vec::new(); 2];
        let e = reads.submit().unwrap().wait_into(&[slots[0], big_slots[1]], &mut out).unwrap_err();
        assert!(matches!(e, Error::ForeignSlot { .. }), "{count} reads: {e}");
    }
    // Prepared sets: their slots redeem their own downloads only (the fast path and the
    // batches they move as while a download is held), and a batch's slot not theirs.
    let ranges: Vec<_> = (0..100).map(|k| (m.buffers[0], k * 2000, 300)).collect();
    let mut set = d.prepare_downloads(&ranges).unwrap();
    let mut other = d.prepare_downloads(&ranges).unwrap();
    let held = set.submit().unwrap().wait().unwrap();
    let second = set.submit().unwrap().wait().unwrap();
    for download in [&held, &second] {
        assert_eq!(download.get(set.slot(5)), &m.expect[0][10_000..10_300]);
        panics_naming_the_batch("a batch's slot on a prepared download", || {
            let _ = download.get(big_slots[0]);
        });
        panics_naming_the_batch("another set's slot", || {
            let _ = download.get(other.slot(5));
        });
    }
    panics_naming_the_batch("a set's slot on a batch's download", || {
        let _ = big_done.get(set.slot(0));
    });
    let mut out = vec![Vec::new(); ranges.len()];
    let e = other.submit().unwrap().wait_into(set.slots(), &mut out).unwrap_err();
    assert!(matches!(e, Error::ForeignSlot { .. }), "{e}");
    other.download_into(&mut out).unwrap();
    assert_eq!(out[5], &m.expect[0][10_000..10_300]);
}

/// A pinned pool of two 64 KiB chunks: every batch below is many times larger.
fn tiny_pool() -> Config {
    Config {
        chunk_bytes: 64 << 10,
        direct_threshold: 16 << 10,
        pinned_cap_bytes: 128 << 10,
        ..Config::default()
    }
}

/// Reads `ranges` of `m` every way a batch offers (views, `wait_into`, `copy_all_into`,
/// `copy_into`, the `download_*` helpers, a prepared set), outputs poisoned with garbage
/// first, and compares every byte; checks that pinned memory is back to `lent` after.
fn read_every_way(d: &Device, m: &Model, ranges: &[(usize, usize, usize)], what: &str) {
    let lent = d.telemetry().pinned.lent_bytes;
    let want: Vec<&[u8]> = ranges.iter().map(|&(i, at, len)| &m.expect[i][at..at + len]).collect();
    let poisoned = || vec![vec![0xA5u8; 17]; ranges.len()];
    let same = |got: &[Vec<u8>], how: &str| {
        assert_eq!(got.len(), want.len(), "{what}: {how}");
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g == w,
                "{what}: {how}: read {k} differs at {:?}",
                g.iter().zip(*w).position(|(a, b)| a != b)
            );
        }
    };
    // Views.
    let (reads, slots) = m.reads(d, ranges);
    let pending = reads.submit().unwrap();
    assert_eq!(pending.route, Route::Streamed, "{what}: the batch streamed");
    let done = pending.wait().unwrap();
    for (k, (&slot, w)) in slots.iter().zip(&want).enumerate() {
        assert!(done.get(slot) == *w, "{what}: view {k}");
    }
    let mut out = poisoned();
    done.copy_all_into(&slots, &mut out).unwrap();
    same(&out, "copy_all_into");
    let mut one = vec![1u8; 3];
    done.copy_into(slots[ranges.len() / 2], &mut one);
    assert!(one == want[ranges.len() / 2], "{what}: copy_into");
    let first_place = done.get(slots[0]).as_ptr();
    drop(done);
    // The next streamed download with views reuses the last one's host memory (no fresh
    // gigabytes to fault in), with the right bytes.
    let (reads, slots) = m.reads(d, ranges);
    let again = reads.submit().unwrap().wait().unwrap();
    assert_eq!(again.get(slots[0]).as_ptr(), first_place, "{what}: host memory reused");
    for (k, (&slot, w)) in slots.iter().zip(&want).enumerate() {
        assert!(again.get(slot) == *w, "{what}: view {k} in reused memory");
    }
    drop(again);
    // Into vectors.
    let (reads, slots) = m.reads(d, ranges);
    let mut out = poisoned();
    reads.submit().unwrap().wait_into(&slots, &mut out).unwrap();
    same(&out, "wait_into");
    let bufs: Vec<_> = ranges.iter().map(|&(i, at, len)| (m.buffers[i], at as u64, len as u64)).collect();
    same(&d.download_ranges(&bufs).unwrap(), "download_ranges");
    let mut out = poisoned();
    d.download_into(&bufs, &mut out).unwrap();
    same(&out, "download_into");
    // The helpers' batch, as download_ranges (a copy of each read) and download_into
    // (pipelined) move it. The public methods above are one-line wrappers of these
    // (`convenience.rs`, `DownloadBatch::submit_into`, `PreparedDownloads::download_into`),
    // which return the route they took.
    for pipelined in [false, true] {
        let mut out = poisoned();
        let route = super::convenience::download_ranges_into(d.core(), &bufs, &mut out, pipelined).unwrap();
        assert_eq!(route, Route::StreamedInto, "{what}: the helpers streamed straight into the vectors");
        same(&out, "the helpers' batch");
    }
    let (reads, _) = m.reads(d, ranges);
    let mut out = poisoned();
    let route = reads.submit_into_as(&mut out, true).unwrap();
    same(&out, "submit_into");
    assert_eq!(route, Route::StreamedInto, "{what}: submit_into streamed straight into the vectors");
    let mut set = d.prepare_downloads(&bufs).unwrap();
    let mut out = poisoned();
    let route = set.read_into_as(&mut out).unwrap();
    same(&out, "a prepared set");
    assert_eq!(route, Route::StreamedInto, "{what}: the prepared set streamed straight into the vectors");
    let got = set.submit().unwrap().wait().unwrap();
    for (k, w) in want.iter().enumerate() {
        assert!(got.get(set.slot(k)) == *w, "{what}: prepared view {k}");
    }
    drop((got, set));
    d.synchronize().unwrap();
    assert_eq!(d.telemetry().pinned.lent_bytes, lent, "{what}: pinned staging back after the downloads");
    d.trim().unwrap();
    assert!(model::with(|g| g.errors.is_empty()), "{what}: the model found illegal accesses");
    let (reads, slots) = m.reads(d, ranges);
    let fresh = reads.submit().unwrap().wait().unwrap();
    assert!(fresh.get(slots[0]) == want[0], "{what}: after trim released the host memory");
    drop(fresh);
    assert!(model::with(|g| g.errors.is_empty()), "{what}: the model found illegal accesses");
}

#[test]
fn download_batches_many_times_the_pinned_cap_stream_through_it_with_every_byte_right() {
    let d = device(tiny_pool());
    let mut rng = fastrand::Rng::with_seed(64);
    let m = Model::new(&d, &mut rng, &[3 << 20, 700_000, 4099]);
    // 2000 small reads in order and apart (the path that skips the planner), about 2 MiB.
    let mut in_order = Vec::new();
    let mut next = [0usize; 3];
    while in_order.len() < 2000 {
        let i = rng.usize(..2);
        let len = rng.usize(1..=2048);
        let at = next[i] + rng.usize(1..40);
        if at + len > m.expect[i].len() {
            break;
        }
        next[i] = at + len;
        in_order.push((i, at, len));
    }
    read_every_way(&d, &m, &in_order, "small reads in order");
    // Reads of 1 MiB and 100 KiB, each larger than a chunk (direct DMAs across chunks).
    let large: Vec<_> =
        (0..3).map(|k| (0, k << 20, 1 << 20)).chain((0..6).map(|k| (1, k * 100_000 + 7, 100_000))).collect();
    read_every_way(&d, &m, &large, "large reads");
    // Ragged reads in any order, overlapping (the planner fuses them), 16 bytes to 20 KiB.
    let ragged: Vec<_> = (0..600).map(|_| m.range(&mut rng, 20_000)).collect();
    read_every_way(&d, &m, &ragged, "ragged reads");
    // Whole buffers, several times the cap.
    let all = d.download_many(&m.buffers).unwrap();
    assert!(all == m.expect, "download_many");
    let mut all = vec![Vec::new(); m.buffers.len()];
    let route = super::convenience::download_many_into(d.core(), &m.buffers, &mut all).unwrap();
    assert!(matches!(route, Route::Streamed | Route::StreamedInto), "download_many streamed");
    assert!(all == m.expect, "download_many's batch");
    d.synchronize().unwrap();
    assert_eq!(d.telemetry().pinned.lent_bytes, 0);
}

#[test]
fn a_download_the_pool_cannot_lend_while_the_caller_holds_staging_streams_instead_of_failing() {
    // A batch within the cap (about 1.4 MiB of a 2 MiB pool), but half of the pool is held
    // by the caller: the batch's staging is refused (PinnedExhausted) and it streams
    // through what is left.
    let d = device(Config { pinned_cap_bytes: 2 << 20, ..tiny_pool() });
    let mut rng = fastrand::Rng::with_seed(65);
    let m = Model::new(&d, &mut rng, &[2 << 20]);
    let held = d.pinned(1 << 20).unwrap();
    let ranges: Vec<_> = (0..600).map(|k| (0, k * 2300 + 5, 2250)).collect();
    read_every_way(&d, &m, &ranges, "with most of the pool held");
    drop(held);
}

#[test]
fn a_fault_in_the_middle_of_a_streamed_download_fails_it_and_the_next_one_works() {
    use cuda_sys::{CUDA_ERROR_LAUNCH_FAILED, Fault};
    let driver = model::driver();
    let d = Device::open_on_driver(driver.clone(), 0, tiny_pool()).expect("the model opens");
    let mut rng = fastrand::Rng::with_seed(66);
    let m = Model::new(&d, &mut rng, &[2 << 20]);
    let ranges: Vec<_> = (0..3000).map(|k| (0, k * 600 + 3, 500)).collect();
    let bufs: Vec<_> = ranges.iter().map(|&(i, at, len)| (m.buffers[i], at as u64, len as u64)).collect();
    // A launch, a copy and a wait of the tenth chunk or so, as views and into vectors.
    for (entry, nth) in [("cuLaunchKernel", 10), ("cuMemcpyDtoHAsync_v2", 10), ("cuEventSynchronize", 5)] {
        for into_vectors in [false, true] {
            driver.faults().clear();
            let fault = Fault { entry, nth, code: CUDA_ERROR_LAUNCH_FAILED, times: 1 };
            driver.faults().inject(fault).unwrap();
            let mut out = vec![vec![7u8; 5]; ranges.len()];
            let e = if into_vectors {
                d.download_into(&bufs, &mut out).unwrap_err()
            } else {
                let (reads, _) = m.reads(&d, &ranges);
                reads.submit().map(drop).unwrap_err()
            };
            assert!(e.to_string().contains(entry.trim_end_matches("_v2")), "{entry}: {e}");
            if into_vectors {
                assert!(out.iter().all(Vec::is_empty), "{entry}: the vectors are left empty");
            }
            driver.faults().clear();
            d.synchronize().unwrap();
            assert_eq!(d.telemetry().pinned.lent_bytes, 0, "{entry}: the ring went back");
            d.download_into(&bufs, &mut out).unwrap();
            for (k, (&(_, at, len), got)) in ranges.iter().zip(&out).enumerate() {
                assert!(got[..] == m.expect[0][at..at + len], "{entry}: read {k} after the fault");
            }
        }
    }
}

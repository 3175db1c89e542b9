//! The two kinds of batch of each direction, on the model driver: an ordinary batch
//! ([`Device::uploads`], [`Device::downloads`]) and a scope's
//! ([`Scope::uploads`](crate::Scope::uploads), [`Scope::downloads`](crate::Scope::downloads))
//! are one type with the same methods; what differs is what `submit` does with the caller's
//! memory. Also the two kinds of read of a download batch in one batch.

use super::scope_tests::pool;
use crate::testing::{device, model};
use crate::{Config, Device, Error, ResidentBuffer, TelemetrySnapshot, UploadBatch};

/// What a batch enqueued, between two snapshots: DMAs, launches, bytes over the bus.
fn moves(before: &TelemetrySnapshot, after: &TelemetrySnapshot) -> (u64, u64, u64) {
    (
        after.dma_copies - before.dma_copies,
        after.kernel_launches - before.kernel_launches,
        after.bytes_moved - before.bytes_moved,
    )
}

/// Sixteen small writes from `src` (pinned, in the test), apart; with `fills`, also a
/// `write_with` and a `write_with_par` after them, the second over the first write.
fn writes<'a>(batch: &mut UploadBatch<'a>, buffer: ResidentBuffer, src: &'a [u8], fills: bool) {
    for i in 0..16 {
        batch.write(buffer, i * 8192, &src[i as usize * 4096..][..4096]).unwrap();
    }
    if fills {
        batch.write_with(buffer, 500_000, 100, |dst| dst.fill(7)).unwrap();
        batch.write_with_par(buffer, 1000, 200, |dst| dst.fill(9)).unwrap();
    }
}

/// The bytes [`writes`] leaves in a buffer that held `expect`.
fn written(expect: &mut [u8], src: &[u8], fills: bool) {
    for i in 0..16 {
        expect[i * 8192..i * 8192 + 4096].copy_from_slice(&src[i * 4096..][..4096]);
    }
    if fills {
        expect[500_000..500_100].fill(7);
        expect[1000..1200].fill(9);
    }
}

#[test]
fn a_scoped_upload_batch_with_fills_moves_whole_as_an_ordinary_one() {
    let d = device(Config::default());
    let mut rng = fastrand::Rng::with_seed(1);
    let (buffer, mut expect) = pool(&d, &mut rng, 1 << 20);
    let mut pinned = d.pinned(64 << 10).unwrap();
    rng.fill(&mut pinned);
    // The same writes as an ordinary batch: what the staged path enqueues.
    let before = d.telemetry();
    let mut batch = d.uploads();
    writes(&mut batch, buffer, &pinned, true);
    batch.submit().unwrap().wait().unwrap();
    let ordinary = moves(&before, &d.telemetry());
    written(&mut expect, &pinned, true);
    assert!(d.download(buffer).unwrap() == expect);
    for fills in [false, true] {
        rng.fill(&mut pinned);
        let before = d.telemetry();
        d.scope(|s| {
            let mut batch = s.uploads();
            writes(&mut batch, buffer, &pinned, fills);
            assert_eq!(batch.len(), if fills { 18 } else { 16 });
            let fence = batch.submit()?;
            // The scope's fence is a lane's, not one made complete: a stream could wait on it.
            assert!(fence.target().is_some());
            Ok(())
        })
        .unwrap();
        let scoped = moves(&before, &d.telemetry());
        if fills {
            // Staged whole: the very copies of the ordinary batch.
            assert_eq!(scoped, ordinary);
        } else {
            // In place: one launch reads the pinned slices over the bus, no DMA of staging.
            assert_eq!((scoped.0, scoped.1), (0, 1));
            assert_ne!(scoped, ordinary);
        }
        written(&mut expect, &pinned, fills);
        assert!(d.download(buffer).unwrap() == expect, "fills {fills}");
    }
    assert!(model::with(|g| g.errors.is_empty()));
}

#[test]
fn a_scoped_batch_with_a_fill_that_fails_moves_nothing_and_the_scope_returns() {
    let d = device(Config::default());
    let mut rng = fastrand::Rng::with_seed(2);
    let (buffer, expect) = pool(&d, &mut rng, 1 << 16);
    let src = vec![1u8; 4096];
    let result = d.scope(|s| {
        let mut batch = s.uploads();
        batch.write(buffer, 0, &src)?;
        batch.write_with_par(buffer, 8192, 64, |_| panic!("a fill that fails"))?;
        batch.submit().map(drop)
    });
    assert!(matches!(result, Err(Error::FillPanicked { write: 1, .. })), "{result:?}");
    assert!(result.unwrap_err().to_string().contains("Fix:"));
    assert!(d.download(buffer).unwrap()[8192..8192 + 64] == expect[8192..8192 + 64]);
}

#[test]
fn an_ordinary_download_batch_copies_reads_into_slices_before_submit_returns() {
    let d = device(Config::default());
    let mut rng = fastrand::Rng::with_seed(3);
    let (buffer, expect) = pool(&d, &mut rng, 1 << 20);
    let mut pinned = d.pinned(64 << 10).unwrap();
    let mut vec = vec![0u8; 70_000];
    let mut batch = d.downloads();
    let (v0, v1) = vec.split_at_mut(50_000);
    batch.read_to_slice(buffer, 10, v0).unwrap();
    batch.read_to_slice_many([(buffer, 300_000, &mut pinned[..1000]), (buffer, 5, &mut v1[..0])]).unwrap();
    let slot = batch.read(buffer, 900_000, 777).unwrap();
    assert_eq!(batch.len(), 4);
    let pending = batch.submit().unwrap();
    // The borrows of the slices ended with submit: their bytes are there before any wait.
    assert!(vec[..50_000] == expect[10..50_010]);
    assert!(vec[50_000..].iter().all(|&b| b == 0), "nothing past the reads");
    assert!(pinned[..1000] == expect[300_000..301_000]);
    // The slot read is the download's, and only it.
    let done = pending.wait().unwrap();
    assert_eq!(done.len(), 1);
    assert!(done.get(slot) == &expect[900_000..900_777]);
    drop(done);
    // A batch of reads into slices only gives a download with no views, done.
    let mut out = [0u8; 64];
    let mut batch = d.downloads();
    batch.read_to_slice(buffer, 64, &mut out).unwrap();
    let pending = batch.submit().unwrap();
    assert!(pending.fence().is_complete().unwrap());
    assert!(pending.wait().unwrap().is_empty());
    assert!(out[..] == expect[64..128]);
    assert!(model::with(|g| g.errors.is_empty()));
}

#[test]
fn a_scoped_download_batch_mixing_slots_and_slices_lands_both() {
    let d = device(Config::default());
    let mut rng = fastrand::Rng::with_seed(4);
    let (buffer, expect) = pool(&d, &mut rng, 1 << 20);
    let mut pinned = d.pinned(256 << 10).unwrap();
    let mut vec = vec![0u8; 3000];
    let got = d
        .scope(|s| {
            let mut batch = s.downloads();
            // Into pinned memory (in place), into pageable memory (staged), into views.
            for (i, dst) in pinned.chunks_mut(4096).take(32).enumerate() {
                batch.read_to_slice(buffer, (i * 8192) as u64, dst)?;
            }
            batch.read_to_slice(buffer, 600_000, &mut vec)?;
            let slots = batch.read_many([(buffer, 700_000, 100), (buffer, 700_050, 100)])?;
            let whole = batch.read_buffer(buffer)?;
            let done = batch.submit()?.wait()?;
            assert_eq!(done.len(), 3);
            let views: Vec<Vec<u8>> = slots.iter().map(|&s| done.get(s).to_vec()).collect();
            Ok((views, done.get(whole) == &expect[..]))
        })
        .unwrap();
    assert!(got.0[0] == expect[700_000..700_100] && got.0[1] == expect[700_050..700_150]);
    assert!(got.1, "the whole buffer");
    for i in 0..32 {
        assert!(pinned[i * 4096..(i + 1) * 4096] == expect[i * 8192..i * 8192 + 4096], "block {i}");
    }
    assert!(vec[..] == expect[600_000..603_000]);
    assert!(model::with(|g| g.errors.is_empty()));
}

#[test]
fn submit_into_fills_the_vectors_of_slot_reads_and_the_slices_too() {
    let d = device(Config::default());
    let mut rng = fastrand::Rng::with_seed(5);
    let (buffer, expect) = pool(&d, &mut rng, 1 << 16);
    let mut slice = [0u8; 500];
    let mut batch = d.downloads();
    batch.read(buffer, 0, 10).unwrap();
    batch.read_to_slice(buffer, 1000, &mut slice).unwrap();
    batch.read(buffer, 20_000, 30).unwrap();
    // One vector a slot read: the reads into slices have none.
    let mut out = vec![Vec::new(); 2];
    batch.submit_into(&mut out).unwrap();
    assert!(out[0] == expect[..10] && out[1] == expect[20_000..20_030]);
    assert!(slice[..] == expect[1000..1500]);
    let mut batch = d.downloads();
    batch.read_to_slice(buffer, 0, &mut slice).unwrap();
    let e = batch.submit_into(&mut [Vec::new()]).unwrap_err();
    assert!(matches!(e, Error::LengthMismatch { left: 0, right: 1, .. }), "{e}");
}

#[test]
fn a_bad_read_into_a_slice_fails_the_batch_and_nothing_moves() {
    let d = device(Config::default());
    let mut rng = fastrand::Rng::with_seed(6);
    let (buffer, _) = pool(&d, &mut rng, 4096);
    let freed = d.allocate(4096).unwrap();
    d.free(freed).unwrap();
    let (mut a, mut b, mut c) = ([0u8; 8], [0u8; 8], [0u8; 8]);
    for kind in ["single", "many", "freed before submit"] {
        let before = d.telemetry();
        let mut batch = d.downloads();
        batch.read(buffer, 0, 8).unwrap();
        let e = match kind {
            "single" => batch.read_to_slice(buffer, 4090, &mut a).map(drop).unwrap_err(),
            "many" => batch
                .read_to_slice_many([
                    (buffer, 0, &mut a[..]),
                    (freed, 0, &mut b[..]),
                    (buffer, 8, &mut c[..]),
                ])
                .map(drop)
                .unwrap_err(),
            _ => {
                let doomed = d.allocate(4096).unwrap();
                batch.read_to_slice(doomed, 0, &mut a).unwrap();
                d.free(doomed).unwrap();
                Error::FreedBuffer { buffer: doomed }
            }
        };
        if kind == "many" {
            assert!(
                matches!(&e, Error::BadItem { call: "DownloadBatch::read_to_slice_many", index: 1, .. }),
                "{e}"
            );
            assert_eq!(batch.len(), 2, "the item before the bad one is kept");
        }
        assert!(e.to_string().contains("Fix:"), "{e}");
        let submitted = batch.submit().map(drop).unwrap_err();
        assert_eq!(std::mem::discriminant(&submitted), std::mem::discriminant(&e), "{kind}: {submitted}");
        let after = d.telemetry();
        assert_eq!(moves(&before, &after), (0, 0, 0), "{kind}: nothing moved");
    }
    assert_eq!((a, b, c), ([0; 8], [0; 8], [0; 8]));
}

/// Ordinary uses that the batches' invariance must leave compiling: data declared after the
/// batch, borrowed by it, with an early return (`?`) while the batch is alive (the batches
/// have no destructor of their own that could use a borrow: dropped there, they only hand
/// their vectors back).
fn declared_after(d: &Device, buffer: ResidentBuffer, fail: bool) -> crate::Result<Vec<u8>> {
    let mut writes = d.uploads();
    let mut reads = d.downloads();
    let data = vec![3u8; 64];
    let mut out = vec![0u8; 64];
    writes.write(buffer, 0, &data)?;
    reads.read_to_slice(buffer, 0, &mut out)?;
    if fail {
        writes.write(buffer, u64::MAX, &data)?;
    }
    writes.submit()?.wait()?;
    reads.submit()?.wait()?;
    Ok(out)
}

/// A helper that takes a batch of any lifetime and data of that lifetime.
fn helper<'a>(batch: &mut UploadBatch<'a>, buffer: ResidentBuffer, data: &'a [u8]) -> crate::Result<()> {
    batch.write(buffer, 64, data).map(drop)
}

#[test]
fn invariant_batches_still_borrow_data_declared_after_them() {
    let d = device(Config::default());
    let buffer = d.allocate(4096).unwrap();
    assert!(matches!(declared_after(&d, buffer, true), Err(Error::OutOfRange { .. })));
    // The reads wait for the writes on the device: they see the new bytes.
    assert_eq!(declared_after(&d, buffer, false).unwrap(), vec![3u8; 64]);
    let mut batch = d.uploads();
    {
        let local = vec![4u8; 8];
        helper(&mut batch, buffer, &local).unwrap();
        batch.submit().unwrap().wait().unwrap();
    }
    assert_eq!(d.download_range(buffer, 64, 8).unwrap(), vec![4u8; 8]);
}

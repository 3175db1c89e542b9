//! Prepared sets on the model driver: laid out once, moved by launches alone, shared between
//! threads, refused bad input; out of order or small, moved as batches with the same bytes.

use crate::testing::{Model, device, random_vec, small_chunks};
use crate::{Config, Error, ResidentBuffer};

/// At least 64 ranges in order and apart over `m`'s buffers, as `(buffer, offset, len)`.
pub(super) fn prepared_ranges(m: &Model, rng: &mut fastrand::Rng) -> Vec<(ResidentBuffer, u64, u64)> {
    loop {
        let ranges = m.in_order_ranges(rng, 600);
        if ranges.len() >= 64 {
            return ranges.iter().map(|&(i, at, len)| (m.buffers[i], at as u64, len as u64)).collect();
        }
    }
}

impl Model {
    /// Records `data[k]` as written into `ranges[k]`, in order.
    pub(crate) fn expect_writes(&mut self, ranges: &[(ResidentBuffer, u64, u64)], data: &[Vec<u8>]) {
        for (&(buffer, at, _), bytes) in ranges.iter().zip(data) {
            let i = self.buffers.iter().position(|&b| b == buffer).unwrap();
            self.expect[i][at as usize..][..bytes.len()].copy_from_slice(bytes);
        }
    }

    /// What `ranges` hold now.
    fn expected(&self, ranges: &[(ResidentBuffer, u64, u64)]) -> Vec<Vec<u8>> {
        let index = |buffer| self.buffers.iter().position(|&b| b == buffer).unwrap();
        ranges
            .iter()
            .map(|&(b, at, len)| self.expect[index(b)][at as usize..][..len as usize].to_vec())
            .collect()
    }
}

#[test]
fn prepared_sets_in_order_are_laid_out_once_and_move_by_launches_alone_every_time() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(51);
    let mut m = Model::new(&d, &mut rng, &[300_000, 70_000, 1 << 20, 4099]);
    let ranges = prepared_ranges(&m, &mut rng);
    let random_data = |rng: &mut fastrand::Rng| -> Vec<Vec<u8>> {
        ranges.iter().map(|&(_, _, len)| random_vec(rng, len as usize)).collect()
    };
    let mut up = d.prepare_uploads(&ranges).unwrap();
    assert!(up.is_laid_out() && up.len() == ranges.len());
    for round in 0..4 {
        let data = random_data(&mut rng);
        let before = d.telemetry();
        let fence = up.upload(&data).unwrap();
        let after = d.telemetry();
        // 64 KiB chunks: a few hundred ranges of up to 8 KiB take several launches, no DMA.
        assert!(after.kernel_launches - before.kernel_launches >= 2, "round {round}");
        assert_eq!(after.dma_copies, before.dma_copies, "round {round}");
        if round % 2 == 0 {
            fence.wait().unwrap();
        }
        m.expect_writes(&ranges, &data);
        m.check(&d, &format!("prepared upload {round}"));
    }
    // Back to back without waiting: the second upload waits for the first to leave the
    // region before it copies in; the second's bytes win.
    let (first, second) = (random_data(&mut rng), random_data(&mut rng));
    let _ = up.upload(&first).unwrap();
    let waits = d.telemetry().host_waits;
    up.upload(&second).unwrap().wait().unwrap();
    assert!(d.telemetry().host_waits >= waits + 2, "the second upload waited for the first");
    m.expect_writes(&ranges, &second);
    m.check(&d, "prepared uploads back to back");

    let mut reads = d.prepare_downloads(&ranges).unwrap();
    assert!(reads.is_laid_out());
    let before = d.telemetry();
    let held = reads.submit().unwrap().wait().unwrap();
    let first_place = held.get(reads.slot(0)).as_ptr();
    let after = d.telemetry();
    assert_eq!(after.dma_copies, before.dma_copies, "a prepared download: launches only");
    let old = m.expected(&ranges);
    for (k, want) in old.iter().enumerate() {
        assert_eq!(held.get(reads.slot(k)), &want[..], "view {k}");
    }
    // New bytes, read while the first download still holds its views: the next download
    // moves as a batch of its own and the held views do not change.
    let data = random_data(&mut rng);
    up.upload(&data).unwrap().wait().unwrap();
    m.expect_writes(&ranges, &data);
    let new = m.expected(&ranges);
    let second = reads.submit().unwrap().wait().unwrap();
    let slot0 = reads.slot(0);
    let place = |r: &crate::Downloaded| r.get(slot0).as_ptr();
    assert_ne!(place(&second), place(&held), "moved as a batch, into staging of its own");
    for k in 0..ranges.len() {
        assert_eq!(second.get(reads.slot(k)), &new[k][..], "second view {k}");
        assert_eq!(held.get(reads.slot(k)), &old[k][..], "held view {k}");
    }
    drop((held, second));
    // Dropped: the fast path again, into the set's region.
    let mut out = vec![vec![0xA5u8; 3]; ranges.len()];
    reads.download_into(&mut out).unwrap();
    assert!(out == new, "read into vectors");
    let again = reads.submit().unwrap().wait().unwrap();
    assert_eq!(place(&again), first_place, "the set's region again");
    drop((again, up, reads));
    d.synchronize().unwrap();
    assert_eq!(d.telemetry().pinned.lent_bytes, 0, "a dropped set gives its region back");
}

#[test]
fn prepared_sets_can_move_to_and_be_shared_between_threads() {
    fn shareable<T: Send + Sync>() {}
    shareable::<crate::PreparedUploads>();
    shareable::<crate::PreparedDownloads>();
}

#[test]
fn prepared_sets_out_of_order_or_small_move_as_batches_with_the_same_result() {
    for over_bus in [true, false] {
        let d = device(Config { small_copies_over_bus: over_bus, ..small_chunks() });
        let mut rng = fastrand::Rng::with_seed(52);
        let mut m = Model::new(&d, &mut rng, &[300_000, 70_000, 4099]);
        let in_order = prepared_ranges(&m, &mut rng);
        let b = m.buffers[0];
        // Overlapping (later wins), a handful, and in order through device staging.
        let overlapping: Vec<_> = (0..100).map(|k| (b, (k * 37 % 1000) as u64, 50 + k as u64)).collect();
        let few = in_order[..10].to_vec();
        for (what, ranges) in [("overlapping", &overlapping), ("few", &few), ("in order", &in_order)] {
            let mut up = d.prepare_uploads(ranges).unwrap();
            assert_eq!(up.is_laid_out(), over_bus && what == "in order", "{what}");
            let data: Vec<Vec<u8>> =
                ranges.iter().map(|&(_, _, len)| random_vec(&mut rng, len as usize)).collect();
            up.upload(&data).unwrap().wait().unwrap();
            m.expect_writes(ranges, &data);
            m.check(&d, what);
            let mut reads = d.prepare_downloads(ranges).unwrap();
            let got = reads.submit().unwrap().wait().unwrap();
            let want = m.expected(ranges);
            for (k, w) in want.iter().enumerate() {
                assert_eq!(got.get(reads.slot(k)), &w[..], "{what}: view {k}");
            }
            let mut out = vec![Vec::new(); ranges.len()];
            reads.download_into(&mut out).unwrap();
            assert!(out == want, "{what}: into vectors");
        }
    }
}

#[test]
fn prepared_sets_refuse_bad_input_with_a_fix_and_move_nothing() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(53);
    let mut m = Model::new(&d, &mut rng, &[300_000, 70_000]);
    let ranges = prepared_ranges(&m, &mut rng);
    let mut bad = ranges.clone();
    bad[10].1 = 1 << 40;
    let e = d.prepare_uploads(&bad).unwrap_err();
    assert!(matches!(e, Error::OutOfRange { .. }) && e.to_string().contains("Fix:"), "{e}");
    assert!(matches!(d.prepare_downloads(&bad).unwrap_err(), Error::OutOfRange { .. }));

    let mut up = d.prepare_uploads(&ranges).unwrap();
    let mut data: Vec<Vec<u8>> =
        ranges.iter().map(|&(_, _, len)| random_vec(&mut rng, len as usize)).collect();
    let before = d.telemetry();
    let e = up.upload(&data[1..]).unwrap_err();
    assert!(matches!(e, Error::LengthMismatch { .. }), "{e}");
    data[40].push(1);
    let e = up.upload(&data).unwrap_err();
    assert!(
        matches!(e, Error::PreparedDataLength { index: 40, .. }) && e.to_string().contains("Fix:"),
        "{e}"
    );
    // The last range, in the last chunk: still refused before the first chunk moves.
    data[40].pop();
    let last = data.len() - 1;
    data[last].pop();
    let e = up.upload(&data).unwrap_err();
    assert!(matches!(e, Error::PreparedDataLength { index, .. } if index == last), "{e}");
    data[last].push(7);
    data[40].push(1);
    assert_eq!(d.telemetry().upload_submissions, before.upload_submissions, "nothing enqueued");
    m.check(&d, "after refused uploads");

    let mut reads = d.prepare_downloads(&ranges).unwrap();
    let e = reads.download_into(&mut vec![Vec::new(); 3]).unwrap_err();
    assert!(matches!(e, Error::LengthMismatch { .. }), "{e}");

    // A buffer freed after the sets were prepared fails them, with nothing enqueued.
    data[40].pop();
    d.free(m.buffers[1]).unwrap();
    let before = d.telemetry();
    assert!(matches!(up.upload(&data).unwrap_err(), Error::FreedBuffer { .. }));
    assert!(matches!(reads.submit().unwrap_err(), Error::FreedBuffer { .. }));
    let after = d.telemetry();
    assert_eq!(
        (after.upload_submissions, after.download_submissions),
        (before.upload_submissions, before.download_submissions)
    );
    m.buffers.truncate(1);
    m.expect.truncate(1);
    m.check(&d, "the live buffer after refused moves");
}

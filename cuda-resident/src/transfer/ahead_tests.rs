//! Upload batches that stage ahead while they are built (`engine::ahead`), on the model
//! driver: every byte lands at submit; nothing lands before it, nor ever for a batch that is
//! dropped, refused or poisoned after chunks were staged; a batch that leaves the in-order
//! route after staging (an overlap, a write made in place) moves as before; caps, a small
//! pinned pool, a small budget, driver faults and several threads.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use crate::testing::{Model, device, model, random_vec};
use crate::{Config, Device, Error, UploadBatch};

/// Writes in order and apart, round-robin over the model's buffers, 1 byte to 8 KiB each,
/// with gaps of 1 to 99 bytes, until they hold about `bytes`: `(buffer, offset, data)`.
fn writes(m: &Model, rng: &mut fastrand::Rng, bytes: usize) -> Vec<(usize, usize, Vec<u8>)> {
    let mut next = vec![0usize; m.buffers.len()];
    let (mut out, mut total) = (Vec::new(), 0);
    while total < bytes {
        let i = out.len() % m.buffers.len();
        let len = if rng.u8(..8) == 0 { rng.usize(1..64) } else { rng.usize(1..=8 << 10) };
        let at = next[i] + rng.usize(1..100);
        assert!(at + len <= m.expect[i].len(), "the test's buffers hold its writes");
        next[i] = at + len;
        out.push((i, at, random_vec(rng, len)));
        total += len;
    }
    out
}

/// A model of `buffers` buffers of 4 MiB each.
fn model_of(d: &Device, rng: &mut fastrand::Rng, buffers: usize) -> Model {
    Model::new(d, rng, &vec![4 << 20; buffers])
}

/// The batch of `writes` added one `write` at a time.
fn batch<'d>(d: &'d Device, m: &Model, writes: &'d [(usize, usize, Vec<u8>)]) -> UploadBatch<'d> {
    let mut batch = d.uploads();
    for (i, at, data) in writes {
        batch.write(m.buffers[*i], *at as u64, data).unwrap();
    }
    batch
}

/// What the model expects once `writes` landed.
fn apply(m: &mut Model, writes: &[(usize, usize, Vec<u8>)]) {
    for (i, at, data) in writes {
        m.expect[*i][*at..at + data.len()].copy_from_slice(data);
    }
}

/// DMAs enqueued so far.
fn dmas(d: &Device) -> u64 {
    d.telemetry().dma_copies
}

#[test]
fn a_batch_staged_ahead_lands_every_byte_at_submit_and_none_before() {
    let mut rng = fastrand::Rng::with_seed(11);
    let d = device(Config::default());
    let mut m = model_of(&d, &mut rng, 8);
    let w = writes(&m, &mut rng, 10 << 20);
    let before = dmas(&d);
    let b = batch(&d, &m, &w);
    let staged = dmas(&d) - before;
    assert!(staged >= 2, "10 MiB of writes staged at least two chunks ahead: {staged} DMAs");
    // The staged chunks are on the device; no destination changed.
    d.synchronize().unwrap();
    m.check(&d, "staged, not submitted");
    b.submit().unwrap().wait().unwrap();
    apply(&mut m, &w);
    m.check(&d, "submitted");
    let t = d.telemetry();
    assert_eq!(t.pinned.lent_bytes, 0, "every lease is back: {:?}", t.pinned);
}

#[test]
fn without_staging_ahead_nothing_moves_before_submit() {
    let mut rng = fastrand::Rng::with_seed(12);
    let d = device(Config::default().with_stage_ahead_bytes(0));
    let mut m = model_of(&d, &mut rng, 8);
    let w = writes(&m, &mut rng, 10 << 20);
    let before = d.telemetry();
    let b = batch(&d, &m, &w);
    let built = d.telemetry();
    assert_eq!((built.dma_copies, built.kernel_launches), (before.dma_copies, before.kernel_launches));
    b.submit().unwrap().wait().unwrap();
    apply(&mut m, &w);
    m.check(&d, "submitted at once");
}

#[test]
fn a_batch_dropped_after_staging_moves_nothing_and_gives_everything_back() {
    let mut rng = fastrand::Rng::with_seed(13);
    let d = device(Config::default());
    let m = model_of(&d, &mut rng, 8);
    let base = d.telemetry();
    let w = writes(&m, &mut rng, 10 << 20);
    for drain in [false, true] {
        let b = batch(&d, &m, &w);
        assert!(d.telemetry().staging_bytes > base.staging_bytes, "chunks were staged");
        if drain {
            // Dropped with its DMAs done, and also with them still queued (the first turn).
            d.synchronize().unwrap();
        }
        drop(b);
        d.synchronize().unwrap();
        m.check(&d, "dropped after staging");
        let t = d.telemetry();
        assert_eq!(t.staging_bytes, base.staging_bytes, "the staging is no longer counted");
        assert_eq!(t.pinned.lent_bytes, 0, "the leases are back");
    }
    d.trim().unwrap();
    let t = d.telemetry();
    assert_eq!(t.memory.library_bytes, t.staging_bytes, "the staged chunks' memory was freed: {t:?}");
    assert_eq!(t.memory.allocated_bytes, base.memory.allocated_bytes);
    assert!(model::with(|g| g.errors.is_empty()), "the model found illegal accesses");
}

#[test]
fn a_bad_write_after_staging_fails_submit_and_moves_nothing() {
    let mut rng = fastrand::Rng::with_seed(14);
    let d = device(Config::default());
    let m = model_of(&d, &mut rng, 8);
    let w = writes(&m, &mut rng, 10 << 20);
    let mut b = batch(&d, &m, &w);
    let bad = b.write(m.buffers[0], (4 << 20) - 10, &[7; 11]).map(drop).unwrap_err();
    assert!(matches!(bad, Error::OutOfRange { .. }), "{bad}");
    // Writes after the bad one are taken and refused with the batch.
    b.write(m.buffers[1], 0, &[1; 1]).unwrap();
    assert!(matches!(b.submit().unwrap_err(), Error::OutOfRange { .. }));
    d.synchronize().unwrap();
    m.check(&d, "refused after staging");
}

#[test]
fn a_buffer_freed_after_staging_fails_submit_and_moves_nothing() {
    let mut rng = fastrand::Rng::with_seed(15);
    let d = device(Config::default());
    let mut m = model_of(&d, &mut rng, 8);
    let w = writes(&m, &mut rng, 10 << 20);
    let b = batch(&d, &m, &w);
    // Buffer 0 holds writes of the first chunk staged.
    d.free(m.buffers.remove(0)).unwrap();
    m.expect.remove(0);
    assert!(matches!(b.submit().unwrap_err(), Error::FreedBuffer { .. }));
    d.synchronize().unwrap();
    m.check(&d, "refused for a freed buffer");
}

#[test]
fn a_batch_that_leaves_the_in_order_route_after_staging_moves_as_before() {
    for turn in 0..3 {
        let mut rng = fastrand::Rng::with_seed(16 + turn);
        let d = device(Config::default());
        let mut m = model_of(&d, &mut rng, 8);
        let w = writes(&m, &mut rng, 10 << 20);
        // Over the first write (staged in the first chunk): the later one wins. Or a write
        // of the direct size, apart from the others.
        let extra = match turn {
            0 | 1 => (w[0].0, w[0].1, random_vec(&mut rng, 100)),
            _ => (3, (4 << 20) - (300 << 10), random_vec(&mut rng, 300 << 10)),
        };
        let mut b = batch(&d, &m, &w);
        let (buffer, at) = (m.buffers[extra.0], extra.1 as u64);
        match turn {
            1 => b.write_with(buffer, at, extra.2.len(), |dst| dst.copy_from_slice(&extra.2)).map(drop),
            _ => b.write(buffer, at, &extra.2).map(drop),
        }
        .unwrap();
        b.submit().unwrap().wait().unwrap();
        apply(&mut m, &w);
        apply(&mut m, std::slice::from_ref(&extra));
        m.check(&d, &format!("turn {turn}"));
    }
}

#[test]
fn a_poisoned_batch_after_staging_moves_nothing() {
    let mut rng = fastrand::Rng::with_seed(19);
    let d = device(Config::default());
    let m = model_of(&d, &mut rng, 8);
    let w = writes(&m, &mut rng, 10 << 20);
    let mut b = batch(&d, &m, &w);
    let panicked = catch_unwind(AssertUnwindSafe(|| {
        let _ = b.write_with(m.buffers[2], 0, 16, |_| panic!("a fill that panics"));
    }));
    assert!(panicked.is_err());
    assert!(matches!(b.submit().unwrap_err(), Error::BatchPoisoned { .. }));
    d.synchronize().unwrap();
    m.check(&d, "poisoned after staging");
}

#[test]
fn caps_a_small_pool_and_a_small_budget_bound_staging_ahead() {
    let configs = [
        Config::default().with_stage_ahead_bytes(5 << 20),
        Config::default().with_stage_ahead_bytes(1),
        Config { pinned_cap_bytes: 8 << 20, chunk_bytes: 1 << 20, ..Config::default() },
        Config { pinned_cap_bytes: 2 << 20, chunk_bytes: 1 << 20, ..Config::default() },
    ];
    for (k, config) in configs.into_iter().enumerate() {
        let mut rng = fastrand::Rng::with_seed(20 + k as u64);
        let d = device(config.clone());
        let mut m = model_of(&d, &mut rng, 8);
        let w = writes(&m, &mut rng, 12 << 20);
        let base = d.telemetry().staging_bytes;
        let b = batch(&d, &m, &w);
        let held = d.telemetry().staging_bytes - base;
        assert!(held <= config.stage_ahead_bytes, "config {k}: {held} bytes staged ahead");
        b.submit().unwrap().wait().unwrap();
        apply(&mut m, &w);
        m.check(&d, &format!("config {k}"));
    }
    // A budget the staging does not fit past a few chunks (about 54 MiB of the model's
    // 4 GiB; the caller's buffers take 32): the rest moves at submit.
    let mut rng = fastrand::Rng::with_seed(25);
    let d = device(Config { budget_fraction: 0.0125, slab_bytes: 8 << 20, ..Config::default() });
    let mut m = model_of(&d, &mut rng, 8);
    let w = writes(&m, &mut rng, 14 << 20);
    let b = batch(&d, &m, &w);
    let t = d.telemetry();
    assert!(
        t.memory.budget_refusals > 0 || t.staging_bytes < 14 << 20,
        "the budget bounded the staging: {t:?}"
    );
    b.submit().unwrap().wait().unwrap();
    apply(&mut m, &w);
    m.check(&d, "small budget");
}

#[test]
fn write_many_stages_ahead_too() {
    let mut rng = fastrand::Rng::with_seed(26);
    let d = device(Config::default());
    let mut m = model_of(&d, &mut rng, 8);
    let w = writes(&m, &mut rng, 10 << 20);
    let before = dmas(&d);
    let mut b = d.uploads();
    b.write_many(w.iter().map(|(i, at, data)| (m.buffers[*i], *at as u64, &data[..]))).unwrap();
    assert!(dmas(&d) - before >= 2, "write_many staged ahead");
    b.submit().unwrap().wait().unwrap();
    apply(&mut m, &w);
    m.check(&d, "write_many");
}

#[test]
fn a_driver_fault_while_staging_ahead_leaves_the_batch_whole() {
    let mut rng = fastrand::Rng::with_seed(27);
    let driver = model::driver();
    let d = Device::open_with(Arc::clone(&driver), 0, Config::default()).unwrap();
    let mut m = model_of(&d, &mut rng, 8);
    let w = writes(&m, &mut rng, 10 << 20);
    // The second chunk's DMA fails once.
    let fault = cuda_sys::Fault::new("cuMemcpyHtoDAsync_v2", 2, cuda_sys::CUDA_ERROR_INVALID_VALUE);
    driver.faults().inject(fault).unwrap();
    let b = batch(&d, &m, &w);
    assert_eq!(driver.faults().injected(), 1, "the fault hit a chunk staged ahead");
    b.submit().unwrap().wait().unwrap();
    apply(&mut m, &w);
    m.check(&d, "after a staging fault");
}

#[test]
fn threads_stage_ahead_at_once() {
    let d = device(Config::default());
    let gpu = model::shared();
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (d, gpu) = (&d, Arc::clone(&gpu));
            s.spawn(move || {
                model::join(gpu);
                let mut rng = fastrand::Rng::with_seed(30 + t);
                let mut m = model_of(d, &mut rng, 4);
                for _ in 0..2 {
                    let w = writes(&m, &mut rng, 8 << 20);
                    batch(d, &m, &w).submit().unwrap().wait().unwrap();
                    apply(&mut m, &w);
                }
                m.check(d, &format!("thread {t}"));
            });
        }
    });
}

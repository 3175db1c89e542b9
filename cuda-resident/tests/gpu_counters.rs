//! The counters a caller reads come back to their baseline on a real GPU: after bad input,
//! prepared sets, downloads streamed past the pinned cap, scoped transfers, a panicking
//! parallel fill, a caller's stream ordered after a fence, and eight threads at once,
//! `Device::allocated_bytes` and `AllocatorStats::buffers` are where they started, the
//! library's device memory is its lanes' staging alone, and the pinned pool lends nothing.
//! Ignored where there is no GPU: `cargo test -- --include-ignored` on a machine with one.

use std::panic::{AssertUnwindSafe, catch_unwind};

use cuda_resident::{Config, Device, ResidentBuffer};

#[path = "common/streams.rs"]
mod streams;
use streams::{caller_stream, finish_stream};

fn random_bytes(rng: &mut fastrand::Rng, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rng.fill(&mut v);
    v
}

/// `(allocated_bytes, buffers)`.
fn caller(d: &Device) -> (u64, u64) {
    let m = d.telemetry().memory;
    assert_eq!(d.allocated_bytes(), m.allocated_bytes);
    (m.allocated_bytes, m.buffers)
}

fn settled(d: &Device, want: (u64, u64), what: &str) {
    d.synchronize().unwrap();
    let t = d.telemetry();
    let m = t.memory;
    assert_eq!(caller(d), want, "{what}: {m:?}");
    assert_eq!(m.library_bytes, t.staging_bytes, "{what}: the library holds its lanes' staging alone: {t:?}");
    assert_eq!(
        m.reserved_bytes,
        m.footprint_bytes + m.cached_bytes + m.kept_bytes + m.slab_free_bytes + m.deferred_bytes,
        "{what}: {m:?}"
    );
    assert_eq!((t.pinned.lent_bytes, t.pinned.held_bytes), (0, 0), "{what}: {:?}", t.pinned);
}

fn mixes(d: &Device, rng: &mut fastrand::Rng) {
    let n = 4u64 << 20;
    let b = d.allocate(n).unwrap();
    let data = random_bytes(rng, n as usize);
    d.upload(b, &data).unwrap();
    // Bad input only.
    assert!(d.upload_at(b, n - 1, &[1, 2]).is_err());
    assert!(d.upload_at(b, u64::MAX, &[]).is_err());
    assert!(d.download_range(b, 1, u64::MAX).is_err());
    assert!(d.download_range(b, u64::MAX, 1).is_err());
    let mut up = d.uploads();
    up.write(b, 0, &[1; 64]).unwrap();
    assert!(up.write(b, u64::MAX, &[]).is_err());
    assert!(up.submit().is_err());
    // Prepared sets, made and dropped in both orders.
    let ranges: Vec<_> = (0..2000u64).map(|i| (b, i * 2048, 1000)).collect();
    let rows: Vec<Vec<u8>> = (0..2000).map(|_| random_bytes(rng, 1000)).collect();
    let mut pu = d.prepare_uploads(&ranges).unwrap();
    let mut pd = d.prepare_downloads(&ranges).unwrap();
    pu.upload(&rows).unwrap().wait().unwrap();
    let mut out = vec![Vec::new(); rows.len()];
    pd.download_into(&mut out).unwrap();
    assert!(out == rows);
    drop(pu);
    drop(pd);
    let mut expect = data;
    for (i, r) in rows.iter().enumerate() {
        expect[i * 2048..][..1000].copy_from_slice(r);
    }
    // A download streamed past the pinned cap (the configs below keep it small).
    assert!(d.download(b).unwrap() == expect);
    // Scoped transfers and a panicking parallel fill.
    let mut back = vec![0u8; 100_000];
    d.scope(|s| {
        let mut down = s.downloads();
        down.read_to_slice(b, 7, &mut back)?;
        let _ = down.submit()?;
        Ok(())
    })
    .unwrap();
    assert!(back == expect[7..100_007]);
    let mut batch = d.uploads();
    for k in 0..64u64 {
        batch
            .write_with_par(b, k * 4096, 4096, move |dst| {
                assert!(k != 33, "a fill that panics");
                dst.fill(k as u8);
            })
            .unwrap();
    }
    let r = catch_unwind(AssertUnwindSafe(|| batch.submit()));
    assert!(matches!(r, Err(_) | Ok(Err(_))));
    // A caller's stream ordered after an upload's fence.
    let stream = caller_stream(d);
    let fence = {
        let mut up = d.uploads();
        up.write(b, 100, &[5; 300]).unwrap();
        up.submit().unwrap()
    };
    // SAFETY: the stream is live, of this device's context.
    unsafe { fence.make_stream_wait(stream).unwrap() };
    finish_stream(d, stream);
    expect[100..400].fill(5);
    assert!(d.download(b).unwrap() == expect);
    d.free(b).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn adversarial_mixes_leave_every_counter_at_its_baseline() {
    // A pool of four chunks streams the 4 MiB downloads; threads run on the default pool
    // only: eight threads' in-place fills may hold a four-chunk pool whole, and then a fill
    // is refused (PinnedExhausted, by design) rather than waited for.
    let small = Config::default().with_pinned_cap_bytes(4 << 20).with_chunk_bytes(1 << 20);
    for (config, threads) in [(Config::default(), 8u64), (small, 0)] {
        let d = Device::open_configured(0, config).unwrap_or_else(|e| panic!("{e}"));
        let keep = d.allocate(12_345).unwrap();
        let base = caller(&d);
        mixes(&d, &mut fastrand::Rng::with_seed(38));
        settled(&d, base, "one thread");
        let threads: Vec<_> = (0..threads)
            .map(|t| {
                let d = d.clone();
                std::thread::spawn(move || {
                    let mut rng = fastrand::Rng::with_seed(t);
                    for _ in 0..3 {
                        let mine: Vec<ResidentBuffer> =
                            (0..16).map(|_| d.allocate(rng.u64(1..300_000)).unwrap()).collect();
                        mixes(&d, &mut rng);
                        for b in mine {
                            d.free(b).unwrap();
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        settled(&d, base, "eight threads");
        d.trim().unwrap();
        settled(&d, base, "trimmed");
        d.free(keep).unwrap();
        settled(&d, (base.0 - 12_345, base.1 - 1), "freed");
    }
}

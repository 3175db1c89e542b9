//! The transfer engine on a real GPU, checked byte for byte against a host model. Ignored
//! where there is no GPU: `cargo test -- --include-ignored` on a machine with one.

use std::sync::Arc;

use cuda_resident::{Config, Device, Error, ResidentBuffer};

fn device() -> Device {
    Device::open(0).unwrap_or_else(|e| panic!("{e}"))
}

/// A device with small chunks and a low direct threshold, so that batches split into many
/// chunks and mix packed and direct copies.
fn small_chunk_device() -> Device {
    let config = Config::default().with_chunk_bytes(1 << 20).with_direct_threshold(64 << 10);
    Device::open_on_driver(Arc::clone(device().driver()), 0, config).unwrap()
}

fn random_vec(rng: &mut fastrand::Rng, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rng.fill(&mut v);
    v
}

/// Buffers on the device and their expected contents on the host.
struct Model {
    buffers: Vec<ResidentBuffer>,
    expect: Vec<Vec<u8>>,
}

impl Model {
    fn new(d: &Device, rng: &mut fastrand::Rng, sizes: &[usize]) -> Model {
        let buffers: Vec<_> = sizes.iter().map(|&n| d.allocate(n as u64).unwrap()).collect();
        let expect: Vec<_> = sizes.iter().map(|&n| random_vec(rng, n)).collect();
        let writes: Vec<_> = buffers.iter().zip(&expect).map(|(&b, v)| (b, v.as_slice())).collect();
        d.upload_many(&writes).unwrap();
        Model { buffers, expect }
    }

    fn check(&self, d: &Device, what: &str) {
        let got = d.download_many(&self.buffers).unwrap();
        for (i, (g, e)) in got.iter().zip(&self.expect).enumerate() {
            if g != e {
                let at = g.iter().zip(e).position(|(a, b)| a != b);
                panic!("{what}: buffer {i} ({} bytes) differs first at {at:?}", e.len());
            }
        }
    }

    /// A random range of a random buffer: lengths from 1 byte to all of it, biased small.
    fn range(&self, rng: &mut fastrand::Rng) -> (usize, u64, u64) {
        let i = rng.usize(..self.buffers.len());
        let n = self.expect[i].len() as u64;
        let len = match rng.u8(0..10) {
            0 => rng.u64(1..=n),
            1..=3 => rng.u64(1..=n.min(64)),
            _ => rng.u64(1..=n.min(8192)),
        };
        (i, rng.u64(0..=n - len), len)
    }

    fn free(self, d: &Device) {
        for b in self.buffers {
            d.free(b).unwrap();
        }
    }
}

fn ragged_uploads_and_downloads(d: &Device, seed: u64, rounds: usize) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let sizes: Vec<usize> = (0..24)
        .map(|i| if i % 8 == 0 { rng.usize(1 << 20..6 << 20) } else { rng.usize(1..200_000) })
        .collect();
    let mut model = Model::new(d, &mut rng, &sizes);
    model.check(d, "initial upload");
    for round in 0..rounds {
        // A batch of writes, some in place, with overlaps, touching ranges and duplicates.
        let mut datas: Vec<(usize, u64, Vec<u8>, bool)> = Vec::new();
        for _ in 0..rng.usize(1..600) {
            let (i, offset, len) = model.range(&mut rng);
            datas.push((i, offset, random_vec(&mut rng, len as usize), rng.u8(0..4) == 0));
            if rng.u8(0..8) == 0 {
                // Touching the previous write, or a duplicate of it.
                let (i, offset, len) = (i, offset, len);
                let end = offset + len;
                let n = model.expect[i].len() as u64;
                if end < n {
                    let l = rng.u64(1..=(n - end).min(4096));
                    datas.push((i, end, random_vec(&mut rng, l as usize), false));
                }
                datas.push((i, offset, random_vec(&mut rng, len as usize), false));
            }
        }
        let mut batch = d.uploads();
        for (i, offset, data, in_place) in &datas {
            if *in_place {
                batch
                    .write_with(model.buffers[*i], *offset, data.len(), |dst| dst.copy_from_slice(data))
                    .unwrap();
            } else {
                batch.write(model.buffers[*i], *offset, data).unwrap();
            }
        }
        let fence = batch.submit().unwrap();
        for (i, offset, data, _) in &datas {
            model.expect[*i][*offset as usize..][..data.len()].copy_from_slice(data);
        }
        // Reads submitted at once, on the other lane: they must see the writes.
        let mut reads = d.downloads();
        let ranges: Vec<_> = (0..rng.usize(1..500)).map(|_| model.range(&mut rng)).collect();
        let slots: Vec<_> =
            ranges.iter().map(|&(i, o, l)| reads.read(model.buffers[i], o, l).unwrap()).collect();
        let mut outs: Vec<Vec<u8>> = vec![Vec::new(); slots.len()];
        let done = if round % 2 == 0 {
            reads.submit().unwrap().wait().unwrap()
        } else {
            // Chunk by chunk into caller vectors.
            reads.submit().unwrap().wait_into(&slots, &mut outs).unwrap()
        };
        assert!(fence.is_complete().unwrap(), "reads completed before the writes they follow");
        for (k, (&(i, o, l), &slot)) in ranges.iter().zip(&slots).enumerate() {
            let expect = &model.expect[i][o as usize..][..l as usize];
            assert!(done.get(slot) == expect, "round {round}: read of buffer {i} at {o}+{l} differs");
            if round % 2 == 1 {
                assert!(outs[k] == expect, "round {round}: wait_into of buffer {i} at {o}+{l} differs");
            }
        }
    }
    model.check(d, "after all rounds");
    model.free(d);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn random_ragged_batches_match_the_model() {
    ragged_uploads_and_downloads(&device(), 1, 12);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn random_ragged_batches_match_the_model_with_small_chunks() {
    ragged_uploads_and_downloads(&small_chunk_device(), 2, 12);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn eight_threads_submit_batches_at_once() {
    let d = device();
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let d = d.clone();
            std::thread::spawn(move || ragged_uploads_and_downloads(&d, 100 + t, 6))
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_large_pageable_round_trip() {
    let d = device();
    let mut rng = fastrand::Rng::with_seed(9);
    let len = (1usize << 30) + 12345;
    let data = random_vec(&mut rng, len);
    let b = d.allocate(len as u64).unwrap();
    d.upload(b, &data).unwrap();
    let back = d.download(b).unwrap();
    assert!(back == data, "1 GiB round trip differs");
    let t = d.telemetry();
    assert!(t.bytes_moved >= 2 * len as u64);
    d.free(b).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn thousands_of_small_copies_cost_a_few_launches_over_the_bus_or_through_device_staging() {
    // Over the bus (the default) the kernel reads and writes pinned staging itself: no DMA.
    // The writes move in three chunks growing from 256 KiB, the reads in one. Through device
    // staging (equal chunks: one here) an upload is one DMA and a scatter, a download a table
    // upload, a gather and one DMA.
    let over_bus = device();
    assert!(
        over_bus.moves_small_copies_over_bus(),
        "the default, with unified addressing (every 64-bit GPU)"
    );
    assert_eq!(thousands_in_order(&over_bus, 4), [(0, 3), (0, 1)]);
    let config = Config::default().with_small_copies_over_bus(false);
    let staged = Device::open_on_driver(Arc::clone(over_bus.driver()), 0, config).unwrap();
    assert!(!staged.moves_small_copies_over_bus());
    assert_eq!(thousands_in_order(&staged, 5), [(1, 1), (2, 1)]);
}

/// 4096 random writes of 256 bytes at odd offsets with gaps between them, then reads of
/// the same ranges, every byte checked (destinations poisoned first); the DMAs and launches
/// of the writes and of the reads.
fn thousands_in_order(d: &Device, seed: u64) -> [(u64, u64); 2] {
    let mut rng = fastrand::Rng::with_seed(seed);
    let b = d.allocate(8192 * 512).unwrap();
    d.upload(b, &vec![0xA5; 8192 * 512]).unwrap();
    let data: Vec<Vec<u8>> = (0..4096).map(|_| random_vec(&mut rng, 256)).collect();
    let counts = |before: &cuda_resident::TelemetrySnapshot, after: &cuda_resident::TelemetrySnapshot| {
        (after.dma_copies - before.dma_copies, after.kernel_launches - before.kernel_launches)
    };
    let before = d.telemetry();
    let mut batch = d.uploads();
    for (i, v) in data.iter().enumerate() {
        batch.write(b, i as u64 * 512 + 3, v).unwrap();
    }
    batch.submit().unwrap().wait().unwrap();
    let after = d.telemetry();
    let writes = counts(&before, &after);
    assert_eq!(after.bytes_requested - before.bytes_requested, 4096 * 256);
    let back = d.download(b).unwrap();
    for (i, v) in data.iter().enumerate() {
        assert!(back[i * 512 + 3..][..256] == v[..], "write {i}");
        assert!(back[i * 512..][..3].iter().all(|&x| x == 0xA5), "before write {i}");
        assert!(back[i * 512 + 259..][..253].iter().all(|&x| x == 0xA5), "after write {i}");
    }
    let mut reads = d.downloads();
    let slots: Vec<_> = (0..4096).map(|i| reads.read(b, i * 512 + 3, 256).unwrap()).collect();
    let mut out = vec![vec![0x5Au8; 256]; 4096];
    let before = d.telemetry();
    let got = reads.submit().unwrap().wait_into(&slots, &mut out).unwrap();
    let reads = counts(&before, &d.telemetry());
    for (i, v) in data.iter().enumerate() {
        assert!(out[i] == *v, "read {i} into a vector");
        assert!(got.get(slots[i]) == &v[..], "read {i} as a view");
    }
    drop(got);
    d.free(b).unwrap();
    [writes, reads]
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn the_seed_operations_each_work() {
    let d = device();
    let mut rng = fastrand::Rng::with_seed(5);
    let a = d.allocate(10_000).unwrap();
    let b = d.allocate(300_000).unwrap();
    let va = random_vec(&mut rng, 10_000);
    let vb = random_vec(&mut rng, 300_000);
    d.upload(a, &va).unwrap();
    assert_eq!(d.download(a).unwrap(), va);
    let e = d.upload_many(&[(b, &vb), (a, &va[..5000])]).unwrap_err();
    assert!(matches!(e, Error::UploadLength { data_len: 5000, .. }), "whole buffers only: {e}");
    d.upload_many(&[(a, &va), (b, &vb)]).unwrap();
    assert_eq!(d.download_many(&[a, b]).unwrap(), vec![va.clone(), vb.clone()]);
    let patch = random_vec(&mut rng, 100);
    d.upload_at(b, 777, &patch).unwrap();
    let mut vb2 = vb.clone();
    vb2[777..877].copy_from_slice(&patch);
    assert_eq!(d.download_range(b, 700, 300).unwrap(), vb2[700..1000]);
    d.upload_at_many(&[(a, 1, &patch[..10]), (a, 5, &patch[50..60])]).unwrap();
    let mut va2 = va.clone();
    va2[1..11].copy_from_slice(&patch[..10]);
    va2[5..15].copy_from_slice(&patch[50..60]); // the later write wins
    let ranges = [(a, 0, 20), (b, 0, 300_000), (a, 9990, 10)];
    let got = d.download_ranges(&ranges).unwrap();
    assert_eq!(got[0], va2[..20]);
    assert_eq!(got[1], vb2);
    assert_eq!(got[2], va2[9990..]);
    let mut slots: Vec<Vec<u8>> = (0..3).map(|_| Vec::with_capacity(64)).collect();
    d.download_into(&ranges, &mut slots).unwrap();
    assert_eq!(slots, got);
    let mut reads = d.downloads();
    let s = reads.read_buffer_many(&[a, b]).unwrap();
    let done = reads.submit().unwrap().wait().unwrap();
    assert_eq!((done.get(s[0]), done.get(s[1])), (&va2[..], &vb2[..]));

    // Caller-pinned memory and the unsafe async path.
    let mut host = random_vec(&mut rng, 300_000);
    // SAFETY: host stays alive, unmoved and unread-by-us until unpinned after the copies.
    unsafe {
        d.pin_host(host.as_mut_ptr(), host.len()).unwrap();
        let _fence = d.upload_async_at(b, 0, host.as_ptr(), host.len()).unwrap();
        d.synchronize_uploads().unwrap();
        d.unpin_host(host.as_mut_ptr()).unwrap();
    }
    assert_eq!(d.download(b).unwrap(), host);
    d.free(a).unwrap();
    d.free(b).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn bad_input_fails_the_batch_and_enqueues_nothing() {
    let d = device();
    let b = d.allocate(1000).unwrap();
    let freed = d.allocate(1000).unwrap();
    d.free(freed).unwrap();
    let data = [7u8; 100];
    let before = d.telemetry();

    let mut batch = d.uploads();
    batch.write(b, 0, &data).unwrap();
    assert!(matches!(batch.write(b, 901, &data), Err(Error::OutOfRange { .. })));
    assert!(matches!(batch.write(b, u64::MAX - 10, &data), Err(Error::OutOfRange { .. })), "overflow");
    assert!(matches!(batch.write(freed, 0, &data), Err(Error::FreedBuffer { .. })));
    assert!(matches!(batch.submit(), Err(Error::OutOfRange { .. })), "the first error fails the batch");

    let mut reads = d.downloads();
    assert!(matches!(reads.read(b, 999, 2), Err(Error::OutOfRange { .. })));
    assert!(reads.submit().is_err());
    let mut out = vec![Vec::new(); 1];
    assert!(matches!(d.download_into(&[(b, 0, 1), (b, 1, 1)], &mut out), Err(Error::LengthMismatch { .. })));
    assert!(matches!(d.download(freed), Err(Error::FreedBuffer { .. })));

    // A buffer freed between write and submit.
    let gone = d.allocate(1000).unwrap();
    let mut batch = d.uploads();
    batch.write(gone, 0, &data).unwrap();
    d.free(gone).unwrap();
    assert!(matches!(batch.submit(), Err(Error::FreedBuffer { .. })));

    let after = d.telemetry();
    assert_eq!(after.upload_submissions, before.upload_submissions, "nothing was enqueued");
    assert_eq!(after.download_submissions, before.download_submissions);
    d.free(b).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn in_place_writes_move_without_a_host_copy_and_fall_back_when_they_overlap() {
    let d = small_chunk_device();
    let mut rng = fastrand::Rng::with_seed(6);
    let b = d.allocate(8 << 20).unwrap();
    d.upload(b, &random_vec(&mut rng, 8 << 20)).unwrap();
    let mut expect = d.download(b).unwrap();
    // Disjoint in-place writes, small and large (own lease, direct), odd offsets.
    let writes: Vec<(u64, Vec<u8>)> = (0..3000u64)
        .map(|i| {
            (
                i * 2048 + i % 7,
                random_vec(&mut rng, if i % 500 == 0 { 100_000 } else { 1 + (i as usize * 37) % 1500 }),
            )
        })
        .filter(|(o, v)| o + v.len() as u64 <= 8 << 20)
        .collect();
    let mut disjoint = Vec::new();
    let mut end = 0;
    for (o, v) in writes {
        if o >= end {
            end = o + v.len() as u64 + 1; // a gap: no two touch
            disjoint.push((o, v));
        }
    }
    let before = d.telemetry();
    let mut batch = d.uploads();
    for (o, v) in &disjoint {
        batch.write_with(b, *o, v.len(), |dst| dst.copy_from_slice(v)).unwrap();
        expect[*o as usize..][..v.len()].copy_from_slice(v);
    }
    batch.submit().unwrap().wait().unwrap();
    assert!(d.download(b).unwrap() == expect, "in-place writes");
    let launched = d.telemetry().kernel_launches - before.kernel_launches;
    assert!(launched >= 1, "packed in-place writes use the kernel");

    // Touching writes in order (in place, no planning) and disjoint writes in reverse order
    // (the planner decides), each checked.
    for reverse in [false, true] {
        let mut pieces: Vec<(u64, Vec<u8>)> = Vec::new();
        let mut at = 1u64 << 20;
        for i in 0..800u64 {
            let v = random_vec(&mut rng, 1 + (i as usize * 53) % 900);
            let gap = if reverse { 5 } else { 0 };
            pieces.push((at, v));
            at += pieces.last().unwrap().1.len() as u64 + gap;
        }
        if reverse {
            pieces.reverse();
        }
        let mut batch = d.uploads();
        for (o, v) in &pieces {
            batch.write_with(b, *o, v.len(), |dst| dst.copy_from_slice(v)).unwrap();
            expect[*o as usize..][..v.len()].copy_from_slice(v);
        }
        batch.submit().unwrap().wait().unwrap();
        assert!(d.download(b).unwrap() == expect, "in-place writes, reverse order: {reverse}");
    }

    // Overlapping in-place writes: the general path, later wins.
    let mut batch = d.uploads();
    for i in 0..500u64 {
        let v = random_vec(&mut rng, 700);
        let o = i * 300;
        batch.write_with(b, o, v.len(), |dst| dst.copy_from_slice(&v)).unwrap();
        expect[o as usize..][..700].copy_from_slice(&v);
    }
    batch.submit().unwrap().wait().unwrap();
    assert!(d.download(b).unwrap() == expect, "overlapping in-place writes");
    d.free(b).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_thread_that_never_bound_the_context_submits_batches_back_to_back() {
    // Staging, device staging and the kernel are all made on this thread, so a new thread's
    // batches reach the driver only through copies, launches and events; back-to-back
    // batches need new events, which need the context current on that thread.
    let base = device();
    // Prewarmed arenas of the chunk's size serve every batch below without a new pinned
    // allocation (which would make the context current as a side effect).
    let config = Config::default()
        .with_chunk_bytes(64 << 10)
        .with_direct_threshold(16 << 10)
        .with_pinned_prewarm_bytes(2 << 20);
    let d = Device::open_on_driver(Arc::clone(base.driver()), 0, config).unwrap();
    let mut rng = fastrand::Rng::with_seed(0xc0de);
    let b = d.allocate(1 << 20).unwrap();
    let warm: Vec<Vec<u8>> = (0..8).map(|_| random_vec(&mut rng, 100)).collect();
    let writes: Vec<_> = warm.iter().enumerate().map(|(i, v)| (b, i as u64 * 1000, v.as_slice())).collect();
    d.upload_at_many(&writes).unwrap();
    let expect = {
        let mut e = d.download(b).unwrap();
        let batches: Vec<Vec<(u64, Vec<u8>)>> = (0..6)
            .map(|_| (0..50).map(|_| (rng.u64(0..(1 << 20) - 300), random_vec(&mut rng, 300))).collect())
            .collect();
        for batch in &batches {
            for (offset, bytes) in batch {
                e[*offset as usize..*offset as usize + bytes.len()].copy_from_slice(bytes);
            }
        }
        let d2 = d.clone();
        std::thread::spawn(move || {
            let fences: Vec<_> = batches
                .iter()
                .map(|batch| {
                    let mut up = d2.uploads();
                    for (offset, bytes) in batch {
                        up.write(b, *offset, bytes).unwrap();
                    }
                    up.submit().unwrap()
                })
                .collect();
            for f in fences {
                f.wait().unwrap();
            }
        })
        .join()
        .unwrap();
        e
    };
    assert!(d.download(b).unwrap() == expect, "the batches from the other thread did not land");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn prepared_sets_move_new_bytes_every_round_and_read_them_back() {
    // 8192 ranges of 1 byte to 16 KiB at odd offsets in order over 64 buffers (which the
    // model fills with random bytes first), uploaded with new random bytes each round, read
    // back as views and into poisoned vectors; also on a device with small chunks (many
    // launches a move) and one through device staging (moving as batches).
    let over_staging = Config::default().with_small_copies_over_bus(false);
    let base = device();
    let devices = [
        base.clone(),
        small_chunk_device(),
        Device::open_on_driver(Arc::clone(base.driver()), 0, over_staging).unwrap(),
    ];
    for (n, d) in devices.iter().enumerate() {
        let mut rng = fastrand::Rng::with_seed(90 + n as u64);
        let mut m = Model::new(d, &mut rng, &[1 << 22; 64]);
        let mut next = [0u64; 64];
        let mut ranges = Vec::new();
        for k in 0..8192 {
            let i = k % 64;
            let len = if rng.u8(..8) == 0 { rng.u64(1..=16 << 10) } else { rng.u64(1..=4096) };
            let at = next[i] + rng.u64(1..40);
            next[i] = at + len;
            ranges.push((m.buffers[i], at, len));
        }
        let mut up = d.prepare_uploads(&ranges).unwrap();
        let mut reads = d.prepare_downloads(&ranges).unwrap();
        assert_eq!((up.is_laid_out(), reads.is_laid_out()), (n < 2, n < 2), "device {n}");
        for round in 0..3 {
            let data: Vec<Vec<u8>> =
                ranges.iter().map(|&(_, _, len)| random_vec(&mut rng, len as usize)).collect();
            up.upload(&data).unwrap().wait().unwrap();
            for (&(b, at, len), bytes) in ranges.iter().zip(&data) {
                let i = m.buffers.iter().position(|&x| x == b).unwrap();
                m.expect[i][at as usize..][..len as usize].copy_from_slice(bytes);
            }
            m.check(d, &format!("device {n}, round {round}: prepared upload"));
            let views = reads.submit().unwrap().wait().unwrap();
            for (k, want) in data.iter().enumerate() {
                assert!(views.get(reads.slot(k)) == &want[..], "device {n}, round {round}: view {k}");
            }
            drop(views);
            let mut out: Vec<Vec<u8>> = ranges.iter().map(|&(_, _, len)| vec![0xA5; len as usize]).collect();
            reads.download_into(&mut out).unwrap();
            assert!(out == data, "device {n}, round {round}: into vectors");
        }
        for b in m.buffers {
            d.free(b).unwrap();
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn download_batches_four_times_the_pinned_cap_stream_through_it_with_every_byte_right() {
    // A pool of 64 MiB (four 16 MiB chunks) and batches of 256 MiB: 1 MiB reads, 16 KiB
    // reads in order and apart (the path that skips the planner), and 16 KiB reads that
    // touch (fused by the planner into one interval); views, vectors, the download helpers
    // and a prepared set, outputs pre-filled with garbage; every byte compared.
    let config = Config::default().with_chunk_bytes(16 << 20).with_pinned_cap_bytes(64 << 20);
    let d = Device::open_on_driver(Arc::clone(device().driver()), 0, config).unwrap();
    let mut rng = fastrand::Rng::with_seed(91);
    let m = Model::new(&d, &mut rng, &[300 << 20]);
    let b = m.buffers[0];
    const SMALL: u64 = 16 << 10;
    let cases: [(&str, Vec<(u64, u64)>); 3] = [
        ("1 MiB reads", (0..256).map(|k| (k << 20, 1 << 20)).collect()),
        ("16 KiB reads apart", (0..16384).map(|k| (k * (SMALL + 64) + 16, SMALL)).collect()),
        ("16 KiB reads touching", (0..16384).map(|k| (k * SMALL, SMALL)).collect()),
    ];
    for (what, ranges) in &cases {
        let lent = d.telemetry().pinned.lent_bytes;
        let want: Vec<&[u8]> =
            ranges.iter().map(|&(at, len)| &m.expect[0][at as usize..][..len as usize]).collect();
        let same = |got: &[Vec<u8>], how: &str| {
            for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g == w,
                    "{what}: {how}: read {k} differs at {:?}",
                    g.iter().zip(*w).position(|(a, b)| a != b)
                );
            }
        };
        let poisoned = || vec![vec![0x5Au8; 100]; ranges.len()];
        // Views.
        let mut reads = d.downloads();
        let slots: Vec<_> = ranges.iter().map(|&(at, len)| reads.read(b, at, len).unwrap()).collect();
        let done = reads.submit().unwrap().wait().unwrap();
        for (k, (&slot, w)) in slots.iter().zip(&want).enumerate() {
            assert!(done.get(slot) == *w, "{what}: view {k}");
        }
        let mut out = poisoned();
        done.copy_all_into(&slots, &mut out).unwrap();
        same(&out, "copy_all_into");
        drop(done);
        // Into vectors.
        let mut reads = d.downloads();
        let slots: Vec<_> = ranges.iter().map(|&(at, len)| reads.read(b, at, len).unwrap()).collect();
        let mut out = poisoned();
        reads.submit().unwrap().wait_into(&slots, &mut out).unwrap();
        same(&out, "wait_into");
        let triples: Vec<_> = ranges.iter().map(|&(at, len)| (b, at, len)).collect();
        let mut out = poisoned();
        d.download_into(&triples, &mut out).unwrap();
        same(&out, "download_into");
        same(&d.download_ranges(&triples).unwrap(), "download_ranges");
        let mut set = d.prepare_downloads(&triples).unwrap();
        let mut out = poisoned();
        set.download_into(&mut out).unwrap();
        same(&out, "a prepared set");
        drop(set);
        d.synchronize().unwrap();
        assert_eq!(d.telemetry().pinned.lent_bytes, lent, "{what}: pinned staging back after the downloads");
    }
    d.free(b).unwrap();
}

/// One paging step on a GPU: random blocks of one pool buffer read while other blocks,
/// touching them, are written, both batches in flight at once. Disjoint ranges: neither
/// lane waits for the other on the device (`lane_waits` unchanged), and every byte read and
/// written is right. A later read of blocks just written waits for the write.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_paging_step_on_disjoint_blocks_moves_both_ways_without_waits_between_lanes() {
    let d = device();
    let mut rng = fastrand::Rng::with_seed(33);
    for block in [16 << 10, 256 << 10, 2 << 20] {
        let blocks = (256 << 20) / block;
        let pool = d.allocate((block * blocks) as u64).unwrap();
        let mut expect = random_vec(&mut rng, block * blocks);
        d.upload(pool, &expect).unwrap();
        let mut out: Vec<usize> = (0..blocks).step_by(2).collect();
        let mut into: Vec<usize> = (1..blocks).step_by(2).collect();
        rng.shuffle(&mut out);
        rng.shuffle(&mut into);
        let (out, into) = (&out[..blocks / 8], &into[..blocks / 8]);
        let data: Vec<Vec<u8>> = into.iter().map(|_| random_vec(&mut rng, block)).collect();
        let waits = d.telemetry().lane_waits;

        let mut reads = d.downloads();
        let slots: Vec<_> =
            out.iter().map(|&b| reads.read(pool, (b * block) as u64, block as u64).unwrap()).collect();
        let pending = reads.submit().unwrap();
        let mut writes = d.uploads();
        for (&b, bytes) in into.iter().zip(&data) {
            writes.write(pool, (b * block) as u64, bytes).unwrap();
        }
        let fence = writes.submit().unwrap();
        assert_eq!(d.telemetry().lane_waits, waits, "{block} B blocks: the lanes waited for each other");
        let got = pending.wait().unwrap();
        fence.wait().unwrap();
        for (&b, &slot) in out.iter().zip(&slots) {
            assert!(got.get(slot) == &expect[b * block..(b + 1) * block], "{block} B: block {b} read wrong");
        }
        for (&b, bytes) in into.iter().zip(&data) {
            expect[b * block..(b + 1) * block].copy_from_slice(bytes);
        }
        // Reading back what was just written, before its fence is waited for: one wait.
        let mut writes = d.uploads();
        let again = random_vec(&mut rng, block);
        writes.write(pool, (into[0] * block) as u64, &again).unwrap();
        let fence = writes.submit().unwrap();
        expect[into[0] * block..(into[0] + 1) * block].copy_from_slice(&again);
        let waits = d.telemetry().lane_waits;
        let back = d.download_range(pool, (into[0] * block) as u64, block as u64).unwrap();
        assert!(d.telemetry().lane_waits <= waits + 1);
        assert!(back == again, "{block} B: a read of bytes being written saw old bytes");
        fence.wait().unwrap();
        assert!(d.download(pool).unwrap() == expect, "{block} B: the pool differs");
        d.free(pool).unwrap();
    }
}

/// Tiny items in place in a pinned cache that holds nearly all of the pinned cap, both
/// directions at once: runs of 16-byte items (many chunks, each cut by its descriptor
/// table's bound before its bytes) and scattered 8-byte items (many over-the-bus launches),
/// each launch with a pinned table of its own within half a chunk. Every byte is checked.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tiny_items_move_in_place_in_launches_whose_tables_fit_what_the_pool_keeps() {
    let config = Config::default()
        .with_chunk_bytes(256 << 10)
        .with_direct_threshold(16 << 10)
        .with_pinned_cap_bytes(24 << 20);
    let d = Device::open_on_driver(Arc::clone(device().driver()), 0, config).unwrap();
    let mut rng = fastrand::Rng::with_seed(41);
    let pool = d.allocate(16 << 20).unwrap();
    let mut expect = random_vec(&mut rng, 16 << 20);
    d.upload(pool, &expect).unwrap();
    // 21.5 MiB held of a 24 MiB cap, which keeps 2 MiB for transfers: 2.5 MiB are free for
    // the tables (the reads' 160,000 descriptors alone take 3.7 MB).
    let mut cache = d.pinned((43 << 20) / 2).unwrap();
    // Out: 160,000 runs of 16 bytes (2.5 MiB) from every other 16 bytes of the pool's first
    // 5 MiB; in: 60,000 items of 8 bytes, 64 bytes apart in the cache, into the pool's last
    // MiB (every 16 bytes).
    let (runs, scattered) = (160_000usize, 60_000usize);
    let (out_half, in_half) = cache.split_at_mut(8 << 20);
    out_half.fill(0xA5);
    rng.fill(in_half);
    let incoming = in_half.to_vec();
    let at_in = (15 << 20) as u64;
    d.scope(|s| {
        let mut reads = s.downloads();
        for (i, dst) in out_half.chunks_mut(16).take(runs).enumerate() {
            reads.read_to_slice(pool, (32 * i) as u64, dst)?;
        }
        let mut writes = s.uploads();
        for (i, src) in in_half.chunks(64).take(scattered).enumerate() {
            writes.write(pool, at_in + (16 * i) as u64, &src[..8])?;
        }
        let _ = writes.submit()?;
        reads.submit().map(drop)
    })
    .unwrap();
    for i in 0..runs {
        assert!(cache[16 * i..16 * (i + 1)] == expect[32 * i..32 * i + 16], "run item {i}");
    }
    assert!(cache[16 * runs..8 << 20].iter().all(|&b| b == 0xA5), "past the reads");
    for i in 0..scattered {
        let at = at_in as usize + 16 * i;
        expect[at..at + 8].copy_from_slice(&incoming[64 * i..64 * i + 8]);
    }
    assert!(d.download(pool).unwrap() == expect, "the pool after the writes");
}

/// A paging step through a scope on a GPU: blocks of one pool buffer swapped out into a
/// pinned host cache and others swapped in from it, in place (no staging), both directions
/// at once; then the same with a cache pinned by `pin_host` (in place, by chunk DMAs) and a
/// pageable one (staged). Every byte is checked; the cache's out half is poisoned first.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_scoped_paging_step_moves_blocks_in_place_between_the_pool_and_a_pinned_cache() {
    let d = Device::open_configured(0, Config::default().with_pinned_cap_bytes(2 << 30)).unwrap();
    let mut rng = fastrand::Rng::with_seed(34);
    for block in [4 << 10, 16 << 10, 256 << 10, 2 << 20] {
        let blocks = (512 << 20) / block;
        let n = blocks / 8;
        let pool = d.allocate((block * blocks) as u64).unwrap();
        let mut expect = random_vec(&mut rng, block * blocks);
        d.upload(pool, &expect).unwrap();
        for (pinned, registered) in [(true, false), (false, true), (false, false)] {
            let mut order: Vec<usize> = (0..blocks).collect();
            rng.shuffle(&mut order);
            let (out, into) = (&order[..n], &order[n..2 * n]);
            let mut pinned_cache;
            let mut pageable_cache;
            let cache: &mut [u8] = if pinned {
                pinned_cache = d.pinned(2 * n * block).unwrap();
                &mut pinned_cache
            } else {
                pageable_cache = vec![0u8; 2 * n * block];
                if registered {
                    // SAFETY: the vector stays mapped, unmoved, until unpinned below.
                    unsafe { d.pin_host(pageable_cache.as_mut_ptr(), pageable_cache.len()) }.unwrap();
                }
                &mut pageable_cache
            };
            cache[..n * block].fill(0xA5);
            rng.fill(&mut cache[n * block..]);
            let incoming = cache[n * block..].to_vec();
            let (out_half, in_half) = cache.split_at_mut(n * block);
            let moves = d.telemetry();
            d.scope(|s| {
                let mut reads = s.downloads();
                for (&b, dst) in out.iter().zip(out_half.chunks_mut(block)) {
                    reads.read_to_slice(pool, (b * block) as u64, dst)?;
                }
                let mut writes = s.uploads();
                for (&b, src) in into.iter().zip(in_half.chunks(block)) {
                    writes.write(pool, (b * block) as u64, src)?;
                }
                let _ = writes.submit()?;
                reads.submit().map(drop)
            })
            .unwrap();
            assert_eq!(d.telemetry().lane_waits, moves.lane_waits, "{block} B: the directions waited");
            for (i, &b) in out.iter().enumerate() {
                let got = &cache[i * block..(i + 1) * block];
                assert!(
                    got == &expect[b * block..(b + 1) * block],
                    "{block} B, pinned {pinned}: block {b} out"
                );
            }
            for (i, &b) in into.iter().enumerate() {
                expect[b * block..(b + 1) * block].copy_from_slice(&incoming[i * block..(i + 1) * block]);
            }
            assert!(d.download(pool).unwrap() == expect, "{block} B, pinned {pinned}: the pool differs");
            if registered {
                // SAFETY: pinned above; the scope waited for every copy that used it.
                unsafe { d.unpin_host(cache.as_mut_ptr()) }.unwrap();
            }
        }
        d.free(pool).unwrap();
    }
}

/// With `Config::dma_batches`, a scoped paging step of 2 MiB blocks (slots side by side, a
/// run) and of 256 KiB blocks (every other slot) moves each block by a DMA of its own, a
/// direction's in one `cuMemcpyBatchAsync`, where the driver has it and the address space is
/// unified (elsewhere the run of 2 MiB blocks moves through staging, as without the setting);
/// every byte checked, the out slots poisoned first.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_scoped_paging_step_with_dma_batches_moves_every_block_by_its_own_dma() {
    let d = Device::open_configured(0, Config::default().with_dma_batches(true)).unwrap();
    let mut rng = fastrand::Rng::with_seed(35);
    for (block, stride) in [(2usize << 20, 1usize), (256 << 10, 2)] {
        let blocks = 64;
        let pool = d.allocate((block * blocks) as u64).unwrap();
        let mut expect = random_vec(&mut rng, block * blocks);
        d.upload(pool, &expect).unwrap();
        let mut order: Vec<usize> = (0..blocks).collect();
        rng.shuffle(&mut order);
        let (out, into) = (&order[..16], &order[16..32]);
        let mut cache = d.pinned(32 * stride * block).unwrap();
        rng.fill(&mut cache);
        let (out_area, in_area) = cache.split_at_mut(16 * stride * block);
        out_area.fill(0xA5);
        let incoming: Vec<Vec<u8>> = in_area.chunks(stride * block).map(|c| c[..block].to_vec()).collect();
        let before = d.telemetry();
        d.scope(|s| {
            let mut reads = s.downloads();
            for (&b, slot) in out.iter().zip(out_area.chunks_mut(stride * block)) {
                reads.read_to_slice(pool, (b * block) as u64, &mut slot[..block])?;
            }
            let mut writes = s.uploads();
            for (&b, slot) in into.iter().zip(in_area.chunks(stride * block)) {
                writes.write(pool, (b * block) as u64, &slot[..block])?;
            }
            let _ = writes.submit()?;
            reads.submit().map(drop)
        })
        .unwrap();
        let after = d.telemetry();
        if d.moves_dmas_in_batches() {
            assert_eq!(after.dma_copies - before.dma_copies, 32, "{block} B: one DMA a block");
            assert_eq!(after.kernel_launches, before.kernel_launches, "{block} B: no launch");
        }
        for (i, &b) in out.iter().enumerate() {
            let slot = &cache[i * stride * block..][..block];
            assert!(slot == &expect[b * block..(b + 1) * block], "{block} B: block {b} out");
        }
        for (i, &b) in into.iter().enumerate() {
            expect[b * block..(b + 1) * block].copy_from_slice(&incoming[i]);
        }
        assert!(d.download(pool).unwrap() == expect, "{block} B: the pool differs");
        d.free(pool).unwrap();
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_scope_is_shared_by_threads_each_building_a_direction() {
    // Both directions built and submitted at once on two threads of one scope, as a server
    // with a thread per direction would; the scope waits for both. (The model driver is
    // per thread: this runs on a GPU only.)
    let d = device();
    let mut rng = fastrand::Rng::with_seed(25);
    let block = 64 << 10;
    let buffer = d.allocate((64 * block) as u64).unwrap();
    let mut expect = random_vec(&mut rng, 64 * block);
    d.upload(buffer, &expect).unwrap();
    let mut cache = d.pinned(32 * block).unwrap();
    rng.fill(&mut cache);
    let incoming = cache[16 * block..].to_vec();
    let (out_half, in_half) = cache.split_at_mut(16 * block);
    d.scope(|s| {
        std::thread::scope(|threads| {
            let up = threads.spawn(|| {
                let mut writes = s.uploads();
                for (i, src) in in_half.chunks(block).enumerate() {
                    writes.write(buffer, ((32 + i) * block) as u64, src)?;
                }
                writes.submit().map(drop)
            });
            let down = threads.spawn(|| {
                let mut reads = s.downloads();
                for (i, dst) in out_half.chunks_mut(block).enumerate() {
                    reads.read_to_slice(buffer, (i * block) as u64, dst)?;
                }
                reads.submit().map(drop)
            });
            up.join().expect("no panic")?;
            down.join().expect("no panic")
        })
    })
    .unwrap();
    assert!(cache[..16 * block] == expect[..16 * block], "swapped out");
    expect[32 * block..48 * block].copy_from_slice(&incoming);
    assert!(d.download(buffer).unwrap() == expect, "swapped in");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn parallel_fills_from_many_threads_land_every_byte() {
    // Threads each submitting batches of `write_with_par` on one device (the model driver
    // is per thread: this runs on a GPU only), small and large writes, some larger than a
    // chunk, then bulk reads of every range; then a fill that panics.
    let d = small_chunk_device();
    let threads = 6;
    let size = 4 << 20;
    let mut rng = fastrand::Rng::with_seed(61);
    let mut m = Model::new(&d, &mut rng, &vec![size; threads]);
    let mut plans = Vec::new();
    for t in 0..threads {
        let mut writes = Vec::new();
        let mut at = rng.usize(0..32);
        loop {
            let len = if rng.u8(..16) == 0 { rng.usize(1..=3 << 20) } else { rng.usize(1..=8192) };
            if at + len > size {
                break;
            }
            writes.push((at, random_vec(&mut rng, len)));
            at += len + rng.usize(1..64);
        }
        for (at, bytes) in &writes {
            m.expect[t][*at..at + bytes.len()].copy_from_slice(bytes);
        }
        plans.push(writes);
    }
    std::thread::scope(|s| {
        for (t, writes) in plans.iter().enumerate() {
            let (d, b) = (&d, m.buffers[t]);
            s.spawn(move || {
                for _ in 0..3 {
                    let mut batch = d.uploads();
                    for (at, bytes) in writes {
                        batch
                            .write_with_par(b, *at as u64, bytes.len(), |dst| dst.copy_from_slice(bytes))
                            .unwrap();
                    }
                    batch.submit().unwrap().wait().unwrap();
                    let mut reads = d.downloads();
                    let slots = reads
                        .read_many(writes.iter().map(|(at, v)| (b, *at as u64, v.len() as u64)))
                        .unwrap();
                    let got = reads.submit().unwrap().wait().unwrap();
                    for ((at, bytes), slot) in writes.iter().zip(slots) {
                        assert!(got.get(slot) == &bytes[..], "thread {t}: the write at {at}");
                    }
                }
            });
        }
    });
    m.check(&d, "after parallel fills");
    // A fill that panics: submit fails naming it, and no write holds bytes of no fill.
    let rows: Vec<Vec<u8>> = (0..4096).map(|_| random_vec(&mut rng, 4096)).collect();
    let mut batch = d.uploads();
    for (k, row) in rows.iter().enumerate() {
        batch
            .write_with_par(m.buffers[0], k as u64 * 4096 / 4, 1024, move |dst| {
                assert!(k != 3000, "fill {k} fails");
                dst.copy_from_slice(&row[..1024]);
            })
            .unwrap();
    }
    let e = batch.submit().unwrap_err();
    assert!(matches!(e, Error::FillPanicked { write: 3000, .. }), "{e}");
    d.synchronize().unwrap();
    let got = d.download(m.buffers[0]).unwrap();
    for (k, row) in rows.iter().enumerate() {
        let now = &got[k * 1024..(k + 1) * 1024];
        assert!(
            now == &row[..1024] && k < 3000 || now == &m.expect[0][k * 1024..(k + 1) * 1024],
            "write {k}: old bytes or new, whole"
        );
    }
}

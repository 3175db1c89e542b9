//! Scoped transfers on the model driver: caller memory as the other end of a batch, pinned
//! (moved in place: DMAs and launches over the bus, no staging) or not (staged), checked byte
//! for byte. The model carries work out only when the host waits, so a scope that returned
//! without waiting would leave the caller's memory without its bytes.

use crate::testing::{device, model, random_vec};
use crate::{Config, Device, Error, ResidentBuffer};

pub(super) fn pool(d: &Device, rng: &mut fastrand::Rng, len: usize) -> (ResidentBuffer, Vec<u8>) {
    let buffer = d.allocate(len as u64).unwrap();
    let bytes = random_vec(rng, len);
    d.upload(buffer, &bytes).unwrap();
    (buffer, bytes)
}

/// Blocks `out` swapped out of `pool` into `cache`'s first half (block `i` of the list to
/// slot `i`), and blocks `into` swapped in from its second half, in one scope, both
/// directions submitted before either is waited for.
fn swap(d: &Device, pool: ResidentBuffer, cache: &mut [u8], block: usize, out: &[usize], into: &[usize]) {
    let (out_half, in_half) = cache.split_at_mut(out.len() * block);
    d.scope(|s| {
        let mut reads = s.downloads();
        for (&b, dst) in out.iter().zip(out_half.chunks_mut(block)) {
            reads.read_to_slice(pool, (b * block) as u64, dst)?;
        }
        let mut writes = s.uploads();
        for (&b, src) in into.iter().zip(in_half.chunks(block)) {
            writes.write(pool, (b * block) as u64, src)?;
        }
        let _ = reads.submit()?;
        let _ = writes.submit()?;
        Ok(())
    })
    .unwrap();
}

/// One paging step into and out of `cache`, checked: the blocks swapped out are in the
/// cache, those swapped in are in the pool, nothing else changed.
fn paging_step(d: &Device, cache: &mut [u8], block: usize, seed: u64) -> (u64, u64, u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let blocks = 64;
    let (buffer, mut expect) = pool(d, &mut rng, block * blocks);
    let mut order: Vec<usize> = (0..blocks).collect();
    rng.shuffle(&mut order);
    let (out, into) = (&order[..16], &order[16..32]);
    rng.fill(cache);
    let incoming = cache[16 * block..32 * block].to_vec();
    let before = d.telemetry();
    swap(d, buffer, cache, block, out, into);
    let after = d.telemetry();
    assert_eq!(after.lane_waits, before.lane_waits, "disjoint blocks waited");
    assert_eq!(
        after.bytes_requested - before.bytes_requested,
        32 * block as u64,
        "{block} B blocks: bytes asked"
    );
    for (i, &b) in out.iter().enumerate() {
        assert!(cache[i * block..(i + 1) * block] == expect[b * block..(b + 1) * block], "block {b} out");
    }
    for (i, &b) in into.iter().enumerate() {
        expect[b * block..(b + 1) * block].copy_from_slice(&incoming[i * block..(i + 1) * block]);
    }
    assert!(d.download(buffer).unwrap() == expect, "{block} B blocks: the pool differs");
    assert!(model::with(|g| g.errors.is_empty()));
    d.free(buffer).unwrap();
    let extra = (after.bytes_moved - before.bytes_moved) - (after.bytes_requested - before.bytes_requested);
    (after.kernel_launches - before.kernel_launches, after.dma_copies - before.dma_copies, extra)
}

#[test]
fn a_paging_step_with_a_pinned_cache_moves_in_place_without_staging() {
    // Past the bytes asked for, only the descriptor tables cross the bus (24 bytes a block
    // segment of 16 KiB): no staging copy on the host and no second trip. Runs of 1 MiB and
    // more (16 blocks of 256 KiB a way) move by one DMA a chunk and a launch inside the
    // device; shorter ones by one launch over the bus a way.
    for (block, moves) in
        [(4096, (2, 0, 32 * 24)), (16 << 10, (2, 0, 32 * 24)), (256 << 10, (2, 3, 2 * 256 * 24))]
    {
        let d = device(Config::default());
        let mut cache = d.pinned(32 * block).unwrap();
        assert_eq!(
            paging_step(&d, &mut cache, block, block as u64),
            moves,
            "{block} B blocks: launches, DMAs, extra"
        );
    }
}

#[test]
fn a_paging_step_with_a_pageable_cache_is_staged_with_the_same_bytes() {
    for block in [4096, 16 << 10, 256 << 10] {
        let d = device(Config::default());
        let mut cache = vec![0u8; 32 * block];
        paging_step(&d, &mut cache, block, block as u64 + 1);
    }
}

#[test]
fn without_unified_addressing_pinned_ranges_move_by_dmas() {
    model::with(|g| g.no_unified_addressing = true);
    let d = device(Config::default());
    let mut cache = d.pinned(32 * 4096).unwrap();
    let moves = paging_step(&d, &mut cache, 4096, 5);
    model::with(|g| g.no_unified_addressing = false);
    assert_eq!(moves, (0, 32, 0), "one DMA a block");
}

/// Large blocks in a pinned cache move by one DMA each, all of a submission in one
/// `cuMemcpyBatchAsync` where the driver has it (the model runs a batch's copies last to
/// first), or one call each with `Config::dma_batches` off; the same bytes either way, both
/// directions at once. Blocks of 256 KiB apart (every fourth slot: no run); blocks of 2 MiB
/// side by side, a run that moves through device staging (a launch a chunk) unless the DMAs
/// go in one call ([`OWN_DMA_MIN`](crate::plan::runs::OWN_DMA_MIN)).
#[test]
fn large_blocks_move_by_one_batched_driver_call_a_way() {
    for (block, stride) in [(256 << 10, 4), (2 << 20, 1)] {
        for batched in [true, false] {
            let d = device(Config::default().with_dma_batches(batched));
            let mut rng = fastrand::Rng::with_seed(0xBA7C);
            let (buffer, mut expect) = pool(&d, &mut rng, 16 * block);
            let mut cache = d.pinned(16 * stride * block).unwrap();
            rng.fill(&mut cache);
            let (out_area, in_area) = cache.split_at_mut(8 * stride * block);
            let incoming: Vec<Vec<u8>> =
                in_area.chunks(stride * block).map(|c| c[..block].to_vec()).collect();
            let (before, copies) = (d.telemetry(), model::with(|g| g.batched_copies));
            d.scope(|s| {
                let mut reads = s.downloads();
                let mut writes = s.uploads();
                // Pool blocks 0..8 out into the first half's slots, 8..16 in from the second's.
                for (i, out) in out_area.chunks_mut(stride * block).enumerate() {
                    reads.read_to_slice(buffer, (i * block) as u64, &mut out[..block])?;
                }
                for (i, src) in in_area.chunks(stride * block).enumerate() {
                    writes.write(buffer, ((8 + i) * block) as u64, &src[..block])?;
                }
                let _ = reads.submit()?;
                let _ = writes.submit()?;
                Ok(())
            })
            .unwrap();
            let after = d.telemetry();
            let batched_now = model::with(|g| g.batched_copies) - copies;
            let what = format!("{block} B blocks, batched {batched}");
            if batched || stride > 1 {
                assert_eq!(after.dma_copies - before.dma_copies, 16, "{what}: one DMA a block");
                assert_eq!(after.kernel_launches, before.kernel_launches, "{what}: no launch");
            } else {
                assert!(after.kernel_launches > before.kernel_launches, "{what}: through device staging");
            }
            assert_eq!(batched_now, if batched { 16 } else { 0 }, "{what}");
            for i in 0..8 {
                let slot = i * stride * block;
                assert!(
                    cache[slot..slot + block] == expect[i * block..(i + 1) * block],
                    "{what}: block {i} out"
                );
                expect[(8 + i) * block..(9 + i) * block].copy_from_slice(&incoming[i]);
            }
            assert!(d.download(buffer).unwrap() == expect, "{what}: the pool differs");
            assert!(model::with(|g| g.errors.is_empty()));
        }
    }
}

/// Memory the caller registered (`pin_host`) goes through the batched call as the pool's
/// does: 2 MiB blocks side by side, out of and into one registered vector, one
/// `cuMemcpyBatchAsync` a way with `dma_batches`, a run through device staging without;
/// every byte of the vector and of the device buffer checked.
#[test]
fn registered_blocks_move_by_one_batched_driver_call_a_way() {
    let block = 2 << 20;
    for batched in [true, false] {
        let d = device(Config::default().with_dma_batches(batched));
        assert_eq!(d.moves_dmas_in_batches(), batched);
        let mut rng = fastrand::Rng::with_seed(0xBA7D);
        let (buffer, mut expect) = pool(&d, &mut rng, 16 * block);
        let mut cache = random_vec(&mut rng, 16 * block);
        // SAFETY: the vector stays mapped and unmoved until unpinned below.
        unsafe { d.pin_host(cache.as_mut_ptr(), cache.len()) }.unwrap();
        let mut want = cache.clone();
        let (before, copies) = (d.telemetry(), model::with(|g| g.batched_copies));
        let (out_area, in_area) = cache.split_at_mut(8 * block);
        d.scope(|s| {
            let mut reads = s.downloads();
            let mut writes = s.uploads();
            // Pool blocks 0..8 out into the first half, 8..16 in from the second.
            reads.read_to_slice_many(
                out_area.chunks_mut(block).enumerate().map(|(i, out)| (buffer, (i * block) as u64, out)),
            )?;
            for (i, src) in in_area.chunks(block).enumerate() {
                writes.write(buffer, ((8 + i) * block) as u64, src)?;
            }
            let _ = reads.submit()?;
            let _ = writes.submit()?;
            Ok(())
        })
        .unwrap();
        let what = format!("batched {batched}");
        assert_eq!(model::with(|g| g.batched_copies) - copies, if batched { 16 } else { 0 }, "{what}");
        let launched = d.telemetry().kernel_launches > before.kernel_launches;
        assert_eq!(launched, !batched, "{what}: through device staging only without the setting");
        want[..8 * block].copy_from_slice(&expect[..8 * block]);
        expect[8 * block..].copy_from_slice(&want[8 * block..]);
        assert!(cache == want, "{what}: the host vector differs");
        assert!(d.download(buffer).unwrap() == expect, "{what}: the pool differs");
        // SAFETY: registered above; nothing of it is in flight.
        unsafe { d.unpin_host(cache.as_mut_ptr()) }.unwrap();
        assert!(model::with(|g| g.errors.is_empty()), "{what}");
    }
}

#[test]
fn pinned_and_pageable_ranges_mix_in_one_batch_and_overlapping_writes_apply_in_order() {
    let d = device(Config::default().with_direct_threshold(8 << 10));
    let mut rng = fastrand::Rng::with_seed(11);
    let (buffer, mut expect) = pool(&d, &mut rng, 1 << 20);
    let mut pinned = d.pinned(256 << 10).unwrap();
    rng.fill(&mut pinned);
    let pageable = random_vec(&mut rng, 256 << 10);
    // Writes from both kinds, small and large, apart; then a batch whose writes overlap.
    let apart = [
        (0usize, true, 0usize, 100usize),
        (1000, false, 0, 5000),
        (10_000, true, 1000, 20_000),
        (50_000, false, 7, 3),
    ];
    let overlapping = [
        (200_000usize, true, 0usize, 10_000usize),
        (205_000, false, 100, 10_000),
        (200_100, true, 50_000, 50),
    ];
    for writes in [&apart[..], &overlapping[..]] {
        d.scope(|s| {
            let mut batch = s.uploads();
            for &(at, is_pinned, from, len) in writes {
                let src = if is_pinned { &pinned[from..from + len] } else { &pageable[from..from + len] };
                batch.write(buffer, at as u64, src)?;
            }
            batch.submit().map(drop)
        })
        .unwrap();
        for &(at, is_pinned, from, len) in writes {
            let src = if is_pinned { &pinned[from..from + len] } else { &pageable[from..from + len] };
            expect[at..at + len].copy_from_slice(src);
        }
        assert!(d.download(buffer).unwrap() == expect, "writes {writes:?}");
    }
    // Reads into both kinds, in one batch.
    let mut out_pinned = d.pinned(64 << 10).unwrap();
    out_pinned.fill(0xA5);
    let mut out_vec = vec![0x5Au8; 64 << 10];
    // Distinct `&mut` slices of one buffer: split, as the borrow rules ask.
    let (p0, rest) = out_pinned.split_at_mut(100);
    let p1 = &mut rest[900..40_900];
    let (v0, rest) = out_vec.split_at_mut(30_000);
    let (v1, v2) = rest[10_000..].split_at_mut(1);
    d.scope(|s| {
        let mut batch = s.downloads();
        batch.read_to_slice(buffer, 3, p0)?;
        batch.read_to_slice(buffer, 70_000, v0)?;
        batch.read_to_slice(buffer, 100_000, p1)?;
        batch.read_to_slice(buffer, 9, v1)?;
        batch.read_to_slice(buffer, 9, &mut v2[..0])?;
        batch.submit().map(drop)
    })
    .unwrap();
    assert_eq!(out_pinned[..100], expect[3..103]);
    assert_eq!(out_pinned[100..1000], [0xA5; 900], "no byte outside the reads");
    assert!(out_pinned[1000..41_000] == expect[100_000..140_000]);
    assert!(out_vec[..30_000] == expect[70_000..100_000]);
    assert_eq!(out_vec[40_000], expect[9]);
    assert_eq!(out_vec[40_001], 0x5A);
    assert!(model::with(|g| g.errors.is_empty()));
}

#[test]
fn a_scope_waits_for_its_transfers_when_its_closure_fails_or_panics() {
    let d = device(Config::default());
    let mut rng = fastrand::Rng::with_seed(12);
    let (buffer, expect) = pool(&d, &mut rng, 64 << 10);
    let mut cache = d.pinned(64 << 10).unwrap();
    cache.fill(0);
    // An error after a submit: the scope returns it, once the read has landed.
    let err = d
        .scope(|s| -> crate::Result<()> {
            let mut reads = s.downloads();
            reads.read_to_slice(buffer, 0, &mut cache[..4096])?;
            let _ = reads.submit()?;
            let mut bad = s.downloads();
            bad.read_to_slice(buffer, 64 << 10, &mut [0u8; 0][..])?;
            Err(Error::LengthMismatch { what: "test", left: 1, right: 2 })
        })
        .unwrap_err();
    assert!(matches!(err, Error::LengthMismatch { .. }), "{err}");
    assert_eq!(cache[..4096], expect[..4096], "the read landed before the scope returned");
    // A panic after a submit: the same, and the panic goes on.
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = d.scope(|s| -> crate::Result<()> {
            let mut reads = s.downloads();
            reads.read_to_slice(buffer, 4096, &mut cache[4096..8192])?;
            let _ = reads.submit()?;
            panic!("the caller's closure panics");
        });
    }));
    assert!(caught.is_err(), "the panic went on");
    assert_eq!(cache[4096..8192], expect[4096..8192], "the read landed before the panic went on");
    assert!(model::with(|g| g.errors.is_empty()));
}

#[test]
fn bad_ranges_fail_the_batch_and_move_nothing() {
    let d = device(Config::default());
    let mut rng = fastrand::Rng::with_seed(13);
    let (buffer, expect) = pool(&d, &mut rng, 4096);
    let cache = d.pinned(8192).unwrap();
    let before = d.telemetry();
    let result = d.scope(|s| {
        let mut batch = s.uploads();
        batch.write(buffer, 0, &cache[..100])?;
        let err = batch.write(buffer, 4000, &cache[..100]).unwrap_err();
        assert!(matches!(err, Error::OutOfRange { .. }), "{err}");
        assert!(batch.write(buffer, u64::MAX, &cache[..1]).is_err(), "an offset past every length");
        batch.submit()
    });
    assert!(matches!(result, Err(Error::OutOfRange { .. })), "{result:?}");
    let freed = d.allocate(4096).unwrap();
    d.free(freed).unwrap();
    let mut out = vec![0u8; 16];
    let result = d.scope(|s| {
        let mut batch = s.downloads();
        batch.read_to_slice(freed, 0, &mut out)?;
        batch.submit()
    });
    assert!(matches!(result, Err(Error::FreedBuffer { .. })), "{result:?}");
    let after = d.telemetry();
    assert_eq!((after.dma_copies, after.kernel_launches), (before.dma_copies, before.kernel_launches));
    assert!(d.download(buffer).unwrap() == expect);
    // Empty batches and empty slices move nothing and succeed.
    d.scope(|s| {
        let _ = s.uploads().submit()?;
        let mut batch = s.uploads();
        batch.write(buffer, 4096, &[])?;
        let _ = batch.submit()?;
        s.downloads().submit().map(drop)
    })
    .unwrap();
}

#[test]
fn runs_longer_than_a_chunk_move_chunk_by_chunk_with_blocks_split_across_chunks() {
    // 200 KiB blocks (below the direct threshold), 1 MiB chunks: blocks straddle chunk ends;
    // 4 chunks a way, more than the two staging slots, so slots are reused once their chunk
    // has moved on.
    let block = 200 << 10;
    let d = device(Config::default().with_chunk_bytes(1 << 20));
    let mut cache = d.pinned(32 * block).unwrap();
    let (launches, dmas, _) = paging_step(&d, &mut cache, block, 21);
    let chunks = (16 * block as u64).div_ceil(1 << 20);
    // Up: the chunk's bytes and its table by DMA, a scatter; down: a gather (its table read
    // over the bus), the chunk's bytes by DMA.
    assert_eq!((launches, dmas), (2 * chunks, 3 * chunks), "a launch a chunk, three DMAs a pair");
}

#[test]
fn runs_scattered_items_and_large_ones_mix_in_one_batch() {
    // One batch: a 2 MiB host run of small writes, scattered small writes, and large
    // writes apart from each other; all into one pool, checked byte for byte, both ways.
    let d = device(Config::default().with_chunk_bytes(1 << 20).with_direct_threshold(64 << 10));
    let mut rng = fastrand::Rng::with_seed(22);
    let (buffer, mut expect) = pool(&d, &mut rng, 16 << 20);
    let mut cache = d.pinned(8 << 20).unwrap();
    rng.fill(&mut cache);
    // (cache offset, pool offset, len): the run is 512 writes of 4 KiB, contiguous in the
    // cache, to every other 4 KiB of the pool's first 4 MiB.
    let mut writes: Vec<(usize, usize, usize)> = (0..512).map(|i| (i * 4096, i * 8192, 4096)).collect();
    writes.extend((0..20).map(|i| ((4 << 20) + i * 20_000, (5 << 20) + i * 30_000, 1000 + i)));
    writes.extend((0..4).map(|i| ((6 << 20) + i * (256 << 10), (8 << 20) + i * (1 << 20), 200 << 10)));
    rng.shuffle(&mut writes[512..]);
    let waits = d.telemetry().lane_waits;
    d.scope(|s| {
        let mut batch = s.uploads();
        for &(from, at, len) in &writes {
            batch.write(buffer, at as u64, &cache[from..from + len])?;
        }
        batch.submit().map(drop)
    })
    .unwrap();
    for &(from, at, len) in &writes {
        expect[at..at + len].copy_from_slice(&cache[from..from + len]);
    }
    assert!(d.download(buffer).unwrap() == expect, "uploads");
    // The same shapes read back into a poisoned cache.
    cache.fill(0xA5);
    let (run, rest) = cache.split_at_mut(2 << 20);
    let mut rest_at = 2 << 20;
    let mut outs: Vec<(&mut [u8], usize)> =
        run.chunks_mut(4096).zip(writes.iter()).map(|(c, w)| (c, w.1)).collect();
    let mut rest = &mut rest[..];
    for &(_, at, len) in &writes[512..] {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(len + 100);
        outs.push((&mut head[..len], at));
        rest = tail;
        rest_at += len + 100;
    }
    assert!(rest_at < 8 << 20);
    let expected: Vec<Vec<u8>> = outs.iter().map(|(o, at)| expect[*at..at + o.len()].to_vec()).collect();
    d.scope(|s| {
        let mut batch = s.downloads();
        for (out, at) in outs.iter_mut() {
            batch.read_to_slice(buffer, *at as u64, out)?;
        }
        batch.submit().map(drop)
    })
    .unwrap();
    for ((out, at), want) in outs.iter().zip(&expected) {
        assert!(out[..] == want[..], "the read at pool offset {at}");
    }
    assert_eq!(d.telemetry().lane_waits, waits, "the scope of the writes waited for them on the host");
    assert!(model::with(|g| g.errors.is_empty()));
}

#[test]
fn among_many_shuffled_blocks_an_overlap_is_found_and_applied_in_order() {
    // 8192 blocks of 64 B, shuffled, from a pinned cache; then the same with one block
    // written twice (the later write wins).
    let d = device(Config::default());
    let mut rng = fastrand::Rng::with_seed(23);
    let block = 64;
    let (buffer, mut expect) = pool(&d, &mut rng, 16384 * block);
    let mut cache = d.pinned(8192 * block).unwrap();
    for twice in [false, true] {
        rng.fill(&mut cache);
        let mut order: Vec<usize> = (0..16384).collect();
        rng.shuffle(&mut order);
        let mut targets = order[..8192].to_vec();
        if twice {
            targets[8000] = targets[17];
        }
        d.scope(|s| {
            let mut batch = s.uploads();
            for (slot, &b) in cache.chunks(block).zip(&targets) {
                batch.write(buffer, (b * block) as u64, slot)?;
            }
            batch.submit().map(drop)
        })
        .unwrap();
        for (slot, &b) in cache.chunks(block).zip(&targets) {
            expect[b * block..(b + 1) * block].copy_from_slice(slot);
        }
        assert!(d.download(buffer).unwrap() == expect, "written twice: {twice}");
        let mut back = d.pinned(8192 * block).unwrap();
        back.fill(0xA5);
        d.scope(|s| {
            let mut batch = s.downloads();
            for (slot, &b) in back.chunks_mut(block).zip(&order[8192..]) {
                batch.read_to_slice(buffer, (b * block) as u64, slot)?;
            }
            batch.submit().map(drop)
        })
        .unwrap();
        for (slot, &b) in back.chunks(block).zip(&order[8192..]) {
            assert!(slot == &expect[b * block..(b + 1) * block], "block {b} read back");
        }
    }
    assert!(model::with(|g| g.errors.is_empty()));
}

#[test]
fn memory_pinned_by_pin_host_moves_in_place_in_runs_and_is_staged_in_pieces() {
    let d = device(Config::default());
    let block = 256 << 10;
    let mut cache = vec![0u8; 32 * block];
    // SAFETY: the vector's memory stays mapped (and is not reallocated) until unpinned below.
    unsafe { d.pin_host(cache.as_mut_ptr(), cache.len()) }.unwrap();
    // A run of 16 blocks each way: one chunk DMA a way (a table DMA beside the upload's),
    // two launches inside the device.
    let moves = paging_step(&d, &mut cache, block, 31);
    assert_eq!(moves, (2, 3, 2 * 256 * 24), "registered runs move in place");
    // Scattered small pieces of registered memory are staged, with the same bytes.
    let mut rng = fastrand::Rng::with_seed(32);
    let (buffer, mut expect) = pool(&d, &mut rng, 1 << 20);
    rng.fill(&mut cache[..]);
    let pieces: Vec<(usize, usize)> = (0..50).map(|i| (i * 100_000, i * 20_000)).collect();
    let before = d.telemetry();
    d.scope(|s| {
        let mut batch = s.uploads();
        for &(from, at) in &pieces {
            batch.write(buffer, at as u64, &cache[from..from + 1000])?;
        }
        batch.submit().map(drop)
    })
    .unwrap();
    assert!(
        d.telemetry().pinned.hits + d.telemetry().pinned.misses > before.pinned.hits + before.pinned.misses,
        "staged"
    );
    for &(from, at) in &pieces {
        expect[at..at + 1000].copy_from_slice(&cache[from..from + 1000]);
    }
    assert!(d.download(buffer).unwrap() == expect);
    // SAFETY: pinned above; the scopes waited for every copy that used it.
    unsafe { d.unpin_host(cache.as_mut_ptr()) }.unwrap();
    assert!(model::with(|g| g.errors.is_empty()));
}

#[test]
fn a_run_over_two_registrations_or_a_pageable_hole_never_moves_by_one_dma() {
    // 3 MiB of host memory: pinned 0..1 MiB and 2..3 MiB with a pageable hole between; then
    // pinned as two adjacent registrations. One write and one read of all of it each way,
    // and 48 writes of 64 KiB across it: every byte right, and no DMA crosses a boundary
    // (the model refuses a copy whose host side is not all pinned).
    for hole in [true, false] {
        let d = device(Config::default());
        let mut rng = fastrand::Rng::with_seed(24);
        let (buffer, mut expect) = pool(&d, &mut rng, 3 << 20);
        let mut host = random_vec(&mut rng, 3 << 20);
        let p = host.as_mut_ptr();
        let regions: &[(usize, usize)] =
            if hole { &[(0, 1 << 20), (2 << 20, 1 << 20)] } else { &[(0, 1 << 20), (1 << 20, 2 << 20)] };
        for &(at, len) in regions {
            // SAFETY: inside the vector, which stays mapped and unmoved until unpinned below.
            unsafe { d.pin_host(p.add(at), len) }.unwrap();
        }
        d.scope(|s| {
            let mut batch = s.uploads();
            batch.write(buffer, 0, &host)?;
            batch.submit().map(drop)
        })
        .unwrap();
        expect.copy_from_slice(&host);
        assert!(d.download(buffer).unwrap() == expect, "hole {hole}: one write");
        rng.fill(&mut host[..]);
        d.scope(|s| {
            let mut batch = s.uploads();
            for (i, piece) in host.chunks(64 << 10).enumerate() {
                batch.write(buffer, ((47 - i) * (64 << 10)) as u64, piece)?;
            }
            batch.submit().map(drop)
        })
        .unwrap();
        for (i, piece) in host.chunks(64 << 10).enumerate() {
            expect[(47 - i) * (64 << 10)..][..64 << 10].copy_from_slice(piece);
        }
        assert!(d.download(buffer).unwrap() == expect, "hole {hole}: 48 writes");
        host.fill(0xA5);
        d.scope(|s| {
            let mut batch = s.downloads();
            batch.read_to_slice(buffer, 0, &mut host)?;
            batch.submit().map(drop)
        })
        .unwrap();
        assert!(host == expect, "hole {hole}: one read");
        for &(at, _) in regions {
            // SAFETY: pinned above; every scope waited for its copies.
            unsafe { d.unpin_host(p.add(at)) }.unwrap();
        }
        assert!(model::with(|g| g.errors.is_empty()), "hole {hole}");
    }
}

#[test]
fn runs_move_through_device_staging_even_with_small_copies_kept_off_the_bus() {
    // The configuration keeps small copies off the bus: scattered small items go by DMA, but
    // a run still moves by chunk DMAs (its kernels touch only device memory and the table).
    let d = device(Config::default().with_small_copies_over_bus(false));
    let block = 256 << 10;
    let mut cache = d.pinned(32 * block).unwrap();
    assert_eq!(paging_step(&d, &mut cache, block, 41), (2, 3, 2 * 256 * 24));
    let mut small = d.pinned(32 * 4096).unwrap();
    assert_eq!(paging_step(&d, &mut small, 4096, 42), (0, 32, 0), "short runs: a DMA a block");
}

/// Random scoped batches against a byte model: up to 3000 writes, a random number of them
/// first from consecutive slots of a pinned cache (a run that a first part can be cut
/// from), the rest from random places of that cache, of a second pinned buffer and of a
/// vector, of 0 B to 8 KiB, onto ranges of one buffer: random and often overlapping (the
/// later write wins) in even rounds, in distinct 8 KiB blocks in odd ones. Then as many
/// reads of random ranges into the same kinds of memory, each landing what the model holds.
#[test]
fn random_scoped_batches_of_mixed_memory_apply_in_order() {
    let d = device(Config::default());
    let mut rng = fastrand::Rng::with_seed(97);
    let len = 32 << 20;
    let (buffer, mut expect) = pool(&d, &mut rng, len);
    let mut cache = d.pinned(8 << 20).unwrap();
    let mut other = d.pinned(1 << 20).unwrap();
    let mut pageable = vec![0u8; 1 << 20];
    for round in 0..24 {
        rng.fill(&mut cache);
        rng.fill(&mut other);
        rng.fill(&mut pageable);
        let n = rng.usize(1..3000);
        let slot = [64, 1024, 4096][round % 3];
        let front = rng.usize(..=n).min(cache.len() / slot);
        // (source: 0 cache, 1 other, 2 pageable; host offset; device offset; length)
        let mut blocks: Vec<usize> = (0..len / 8192).collect();
        rng.shuffle(&mut blocks);
        let mut items = Vec::with_capacity(n);
        // The front run's next slot; now and then an empty write, in the run or after it.
        let mut cursor = 0;
        for (i, &block) in blocks.iter().enumerate().take(n) {
            let (source, mut size) =
                if i < front { (0, slot) } else { (rng.usize(..3), rng.usize(1..=8192)) };
            if rng.u8(..64) == 0 {
                size = 0;
            }
            let host = if i < front {
                cursor += size;
                cursor - size
            } else {
                rng.usize(..=[cache.len(), 1 << 20, 1 << 20][source] - size)
            };
            let dev = match round % 2 {
                1 => block * 8192,
                _ if rng.u8(..8) == 0 => 0,
                _ => rng.usize(..=len - size),
            };
            items.push((source, host, dev, size));
        }
        let (cache_ref, other_ref, pageable_ref) = (&cache[..], &other[..], &pageable[..]);
        let bytes = |(source, host, _, size): (usize, usize, usize, usize)| {
            &[cache_ref, other_ref, pageable_ref][source][host..host + size]
        };
        d.scope(|s| {
            let mut writes = s.uploads();
            for &item in &items {
                writes.write(buffer, item.2 as u64, bytes(item))?;
            }
            writes.submit().map(drop)
        })
        .unwrap();
        for &item in &items {
            expect[item.2..item.2 + item.3].copy_from_slice(bytes(item));
        }
        assert!(d.download(buffer).unwrap() == expect, "round {round}: {n} writes, {front} in front");
        // Reads: the same shapes, into distinct places of each memory.
        cache.fill(0x5A);
        other.fill(0x5A);
        pageable.fill(0x5A);
        let mut reads = Vec::new();
        let mut rest: [&mut [u8]; 3] = [&mut cache[..], &mut other[..], &mut pageable[..]];
        for i in 0..n {
            let (source, size) = if i < front { (0, slot) } else { (rng.usize(..3), rng.usize(1..=8192)) };
            if rest[source].len() < size {
                break;
            }
            let (dst, after) = std::mem::take(&mut rest[source]).split_at_mut(size);
            rest[source] = after;
            reads.push((rng.usize(..=len - size), dst));
        }
        d.scope(|s| {
            let mut batch = s.downloads();
            for (dev, dst) in reads.iter_mut() {
                batch.read_to_slice(buffer, *dev as u64, dst)?;
            }
            batch.submit().map(drop)
        })
        .unwrap();
        for (dev, dst) in &reads {
            assert!(**dst == expect[*dev..*dev + dst.len()], "round {round}: a read at {dev}");
        }
    }
    assert!(model::with(|g| g.errors.is_empty()));
}

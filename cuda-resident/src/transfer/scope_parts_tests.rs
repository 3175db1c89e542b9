//! Scoped batches on the model driver, moved in parts (the first moved early, registered
//! runs kept whole), and the scoped bulk calls, checked against the single calls.

use super::scope_tests::pool;
use crate::testing::{device, model, random_vec};
use crate::{Config, Device, Error, ResidentBuffer};

/// Writes block `i` of `src` to block `targets[i]` of `buffer` in one scoped upload, and the
/// same into `expect` (the later of two writes to one block wins).
fn write_blocks(
    d: &Device,
    buffer: ResidentBuffer,
    block: usize,
    targets: &[usize],
    src: &[u8],
    expect: &mut [u8],
) {
    d.scope(|s| {
        let mut writes = s.uploads();
        for (&t, bytes) in targets.iter().zip(src.chunks(block)) {
            writes.write(buffer, (t * block) as u64, bytes)?;
        }
        writes.submit().map(drop)
    })
    .unwrap();
    for (&t, bytes) in targets.iter().zip(src.chunks(block)) {
        expect[t * block..(t + 1) * block].copy_from_slice(bytes);
    }
}

/// A scoped batch of thousands of items from pinned memory moves in parts (the first moving
/// while the rest are laid out). Writes apply in order across parts and within one: the first
/// part's blocks are distinct, the second's repeat blocks of their own and of the first part
/// (that part goes staged whole), the third's are distinct but land on blocks the earlier
/// parts wrote. Reads in parts land every byte.
#[test]
fn a_large_scoped_batch_moves_in_parts_and_later_writes_win() {
    let d = device(Config::default());
    let mut rng = fastrand::Rng::with_seed(21);
    let (block, blocks, n) = (512, 4096, 5000);
    let (buffer, mut expect) = pool(&d, &mut rng, block * blocks);
    let mut order: Vec<usize> = (0..blocks).collect();
    rng.shuffle(&mut order);
    let mut targets: Vec<usize> = order[..1024].to_vec();
    targets
        .extend((0..2048).map(|i| if i % 3 == 0 { order[rng.usize(..1024)] } else { rng.usize(..blocks) }));
    rng.shuffle(&mut order);
    targets.extend(order[..n - 3072].iter().copied());
    let mut cache = d.pinned(n * block).unwrap();
    rng.fill(&mut cache);
    write_blocks(&d, buffer, block, &targets, &cache, &mut expect);
    assert!(d.download(buffer).unwrap() == expect, "the pool after writes in parts");
    let mut out = d.pinned(n * block).unwrap();
    out.fill(0xA5);
    d.scope(|s| {
        let mut reads = s.downloads();
        for (&t, dst) in targets.iter().zip(out.chunks_mut(block)) {
            reads.read_to_slice(buffer, (t * block) as u64, dst)?;
        }
        reads.submit().map(drop)
    })
    .unwrap();
    for (&t, got) in targets.iter().zip(out.chunks(block)) {
        assert!(got == &expect[t * block..(t + 1) * block], "block {t} read in parts");
    }
    assert!(model::with(|g| g.errors.is_empty()));
}

/// A batch whose first part lies in pinned memory of this crate moves that part before it
/// looks at the rest: 1500 distinct blocks from a pinned cache (the first 1024 a part), then
/// 300 writes from pageable memory onto distinct blocks of that first part, staged. The later writes
/// still win, and the first part moved in place whole (no byte of it fused away by the
/// planner, as it is where the whole batch goes staged). Reads into a pinned cache followed
/// by reads into a vector land every byte.
#[test]
fn a_first_part_moved_early_stays_before_the_staged_writes_after_it() {
    let d = device(Config::default());
    let mut rng = fastrand::Rng::with_seed(77);
    let (block, blocks) = (4096, 4096);
    let (buffer, mut expect) = pool(&d, &mut rng, block * blocks);
    let mut order: Vec<usize> = (0..blocks).collect();
    rng.shuffle(&mut order);
    let mut cache = d.pinned(1500 * block).unwrap();
    rng.fill(&mut cache);
    let mut later = order[..1024].to_vec();
    rng.shuffle(&mut later);
    later.truncate(300);
    let pageable = crate::testing::random_vec(&mut rng, 300 * block);
    let before = d.telemetry();
    d.scope(|s| {
        let mut writes = s.uploads();
        for (&t, bytes) in order[..1500].iter().zip(cache.chunks(block)) {
            writes.write(buffer, (t * block) as u64, bytes)?;
        }
        for (&t, bytes) in later.iter().zip(pageable.chunks(block)) {
            writes.write(buffer, (t * block) as u64, bytes)?;
        }
        writes.submit().map(drop)
    })
    .unwrap();
    let after = d.telemetry();
    for (&t, bytes) in
        order[..1500].iter().zip(cache.chunks(block)).chain(later.iter().zip(pageable.chunks(block)))
    {
        expect[t * block..(t + 1) * block].copy_from_slice(bytes);
    }
    assert!(d.download(buffer).unwrap() == expect, "the later, staged writes win");
    let (asked, moved) =
        (after.bytes_requested - before.bytes_requested, after.bytes_moved - before.bytes_moved);
    assert_eq!(asked, 1800 * block as u64);
    assert!(moved >= asked, "{moved} bytes moved of {asked}: the first part went staged");
    let mut out = d.pinned(1500 * block).unwrap();
    out.fill(0x5A);
    let mut tail = vec![0xA5u8; 300 * block];
    d.scope(|s| {
        let mut reads = s.downloads();
        for (&t, dst) in order[..1500].iter().zip(out.chunks_mut(block)) {
            reads.read_to_slice(buffer, (t * block) as u64, dst)?;
        }
        for (&t, dst) in order[1500..1800].iter().zip(tail.chunks_mut(block)) {
            reads.read_to_slice(buffer, (t * block) as u64, dst)?;
        }
        reads.submit().map(drop)
    })
    .unwrap();
    for (&t, got) in order[..1800].iter().zip(out.chunks(block).chain(tail.chunks(block))) {
        assert!(got == &expect[t * block..(t + 1) * block], "block {t} read");
    }
    assert!(model::with(|g| g.errors.is_empty()));
}

/// 5000 blocks of 512 B, one run of 2.5 MiB in memory pinned by `pin_host`, to shuffled
/// places: the batch moves in parts, but no part cuts the run into pieces too short to move
/// as runs (which would take one DMA a block): a few chunk DMAs, and every byte lands.
#[test]
fn parts_keep_a_registered_run_of_small_blocks_whole_enough_to_move_as_runs() {
    let d = device(Config::default());
    let mut rng = fastrand::Rng::with_seed(41);
    let (block, blocks, n) = (512, 8192, 5000);
    let (buffer, mut expect) = pool(&d, &mut rng, block * blocks);
    let mut cache = vec![0u8; n * block];
    rng.fill(&mut cache[..]);
    // SAFETY: the vector's memory stays mapped (and is not reallocated) until unpinned below.
    unsafe { d.pin_host(cache.as_mut_ptr(), cache.len()) }.unwrap();
    let mut order: Vec<usize> = (0..blocks).collect();
    rng.shuffle(&mut order);
    let before = d.telemetry();
    write_blocks(&d, buffer, block, &order[..n], &cache, &mut expect);
    let dmas = d.telemetry().dma_copies - before.dma_copies;
    assert!(dmas <= 8, "{dmas} DMAs for one run of 2.5 MiB");
    assert!(d.download(buffer).unwrap() == expect);
    // SAFETY: pinned above; the scope waited for every copy that used it.
    unsafe { d.unpin_host(cache.as_mut_ptr()) }.unwrap();
    assert!(model::with(|g| g.errors.is_empty()));
}

/// `write_many` and `read_into_many` move what as many `write`s and `read_into`s would, from
/// and into pinned and pageable memory, with runs on one pool and items that alternate
/// between two.
#[test]
fn scoped_bulk_calls_move_what_single_calls_move() {
    for pinned in [true, false] {
        let d = device(Config::default());
        let mut rng = fastrand::Rng::with_seed(u64::from(pinned) + 11);
        let block = 4096;
        let (a, mut expect_a) = pool(&d, &mut rng, 64 * block);
        let (b, mut expect_b) = pool(&d, &mut rng, 64 * block);
        let mut order: Vec<usize> = (0..64).collect();
        rng.shuffle(&mut order);
        // Out: blocks 0..16 of the order from `a`, then 16..24 alternating between the pools.
        // In: blocks 24..40 into `a`, then 40..48 alternating.
        let outs: Vec<(ResidentBuffer, usize)> = order[..16]
            .iter()
            .map(|&k| (a, k))
            .chain(order[16..24].iter().enumerate().map(|(i, &k)| (if i % 2 == 0 { b } else { a }, k)))
            .collect();
        let ins: Vec<(ResidentBuffer, usize)> = order[24..40]
            .iter()
            .map(|&k| (a, k))
            .chain(order[40..48].iter().enumerate().map(|(i, &k)| (if i % 2 == 0 { b } else { a }, k)))
            .collect();
        let mut pinned_cache = if pinned { Some(d.pinned(48 * block).unwrap()) } else { None };
        let mut pageable_cache = vec![0u8; 48 * block];
        let cache: &mut [u8] = match &mut pinned_cache {
            Some(p) => &mut p[..],
            None => &mut pageable_cache,
        };
        rng.fill(cache);
        let incoming = cache[24 * block..].to_vec();
        let (out_half, in_half) = cache.split_at_mut(24 * block);
        d.scope(|s| {
            let mut reads = s.downloads();
            let items = outs
                .iter()
                .zip(out_half.chunks_mut(block))
                .map(|(&(p, k), dst)| (p, (k * block) as u64, dst));
            reads.read_to_slice_many(items)?;
            assert_eq!(reads.len(), 24);
            let mut writes = s.uploads();
            let items =
                ins.iter().zip(in_half.chunks(block)).map(|(&(p, k), src)| (p, (k * block) as u64, src));
            writes.write_many(items)?;
            assert_eq!(writes.len(), 24);
            let _ = reads.submit()?;
            writes.submit().map(drop)
        })
        .unwrap();
        for (i, &(p, k)) in outs.iter().enumerate() {
            let expect = if p == a { &expect_a } else { &expect_b };
            assert!(
                cache[i * block..(i + 1) * block] == expect[k * block..(k + 1) * block],
                "out {i} (pinned: {pinned})"
            );
        }
        for (i, &(p, k)) in ins.iter().enumerate() {
            let expect = if p == a { &mut expect_a } else { &mut expect_b };
            expect[k * block..(k + 1) * block].copy_from_slice(&incoming[i * block..(i + 1) * block]);
        }
        assert!(d.download(a).unwrap() == expect_a && d.download(b).unwrap() == expect_b, "pinned: {pinned}");
        assert!(model::with(|g| g.errors.is_empty()));
    }
}

/// The first bad item of a scoped bulk call is named by its index; the batch keeps the items
/// before it, and its `submit` fails with that error and moves nothing.
#[test]
fn a_bad_item_of_a_scoped_bulk_call_is_named_and_nothing_moves() {
    let d = device(Config::default());
    let mut rng = fastrand::Rng::with_seed(5);
    let block = 256;
    let (p, before) = pool(&d, &mut rng, 16 * block);
    let freed = d.allocate(64).unwrap();
    d.free(freed).unwrap();
    let src = random_vec(&mut rng, 16 * block);
    let mut out = vec![0x5Au8; 16 * block];
    let moved = d.telemetry().bytes_moved;
    d.scope(|s| {
        let mut writes = s.uploads();
        // Item 5 runs one byte past the pool; its run-mates before it share the pool's lookup.
        let items = (0..8).map(|i| {
            let offset = if i == 5 { (15 * block + 1) as u64 } else { (i * block) as u64 };
            (p, offset, &src[i * block..(i + 1) * block])
        });
        let e = writes.write_many(items).unwrap_err();
        let Error::BadItem { call: "UploadBatch::write_many", index: 5, error } = &e else { panic!("{e}") };
        assert!(matches!(**error, Error::OutOfRange { offset, len: 256, .. } if offset == (15 * block + 1) as u64), "{e}");
        assert!(e.to_string().contains("Fix:"), "{e}");
        assert_eq!(writes.len(), 5, "the items before the bad one are kept");
        assert!(matches!(writes.submit(), Err(Error::BadItem { index: 5, .. })));
        let mut reads = s.downloads();
        let items = out.chunks_mut(block).enumerate().map(|(i, dst)| (if i == 3 { freed } else { p }, (i * block) as u64, dst));
        let e = reads.read_to_slice_many(items).unwrap_err();
        let Error::BadItem { call: "DownloadBatch::read_to_slice_many", index: 3, error } = &e else { panic!("{e}") };
        assert!(matches!(**error, Error::FreedBuffer { buffer } if buffer == freed), "{e}");
        assert_eq!(reads.len(), 3);
        assert!(matches!(reads.submit(), Err(Error::BadItem { index: 3, .. })));
        Ok(())
    })
    .unwrap();
    assert_eq!(d.telemetry().bytes_moved, moved, "nothing moved");
    assert!(out.iter().all(|&x| x == 0x5A), "no read landed");
    assert!(d.download(p).unwrap() == before, "no write landed");
}

//! Ordering by byte range on the model driver (`engine::order`): uploads and downloads of
//! disjoint ranges of one buffer do not wait for each other on the device; overlapping ones
//! do, and the bytes show it (the model carries each lane's work out only when the host
//! waits for it, so a missing wait reads the wrong bytes).

use crate::testing::{device, model, random_vec, small_chunks};
use crate::{Config, Device, ResidentBuffer};

/// A buffer of `len` random bytes, uploaded and waited for, and the bytes.
fn pool(d: &Device, rng: &mut fastrand::Rng, len: usize) -> (ResidentBuffer, Vec<u8>) {
    let buffer = d.allocate(len as u64).unwrap();
    let bytes = random_vec(rng, len);
    d.upload(buffer, &bytes).unwrap();
    (buffer, bytes)
}

fn lane_waits(d: &Device) -> u64 {
    d.telemetry().lane_waits
}

/// One paging step: blocks `out` of `pool` read while blocks `into` are written with new
/// bytes, the download submitted first; the host waits for the upload first (the model then
/// runs the upload lane alone, unless told to wait for the download). Returns the blocks
/// read, and updates `bytes` with the writes.
fn step(
    d: &Device,
    rng: &mut fastrand::Rng,
    (buffer, bytes): (ResidentBuffer, &mut [u8]),
    block: usize,
    out: &[usize],
    into: &[usize],
) -> Vec<Vec<u8>> {
    let mut reads = d.downloads();
    let slots: Vec<_> =
        out.iter().map(|&b| reads.read(buffer, (b * block) as u64, block as u64).unwrap()).collect();
    let pending = reads.submit().unwrap();
    let data: Vec<Vec<u8>> = into.iter().map(|_| random_vec(rng, block)).collect();
    let mut writes = d.uploads();
    for (&b, bytes) in into.iter().zip(&data) {
        writes.write(buffer, (b * block) as u64, bytes).unwrap();
    }
    writes.submit().unwrap().wait().unwrap();
    let got = pending.wait().unwrap();
    let read = slots.iter().map(|&s| got.get(s).to_vec()).collect();
    for (&b, new) in into.iter().zip(&data) {
        bytes[b * block..(b + 1) * block].copy_from_slice(new);
    }
    read
}

fn shuffled(rng: &mut fastrand::Rng, mut v: Vec<usize>) -> Vec<usize> {
    rng.shuffle(&mut v);
    v
}

#[test]
fn a_paging_step_on_disjoint_blocks_does_not_wait_between_lanes() {
    for (config, block, blocks) in [
        (Config::default(), 4096, 256),
        (small_chunks(), 16 << 10, 64),
        // Blocks past the direct threshold: one DMA each.
        (small_chunks(), 64 << 10, 32),
    ] {
        let d = device(config);
        let mut rng = fastrand::Rng::with_seed(block as u64);
        let (buffer, mut bytes) = pool(&d, &mut rng, block * blocks);
        // Even blocks out, odd blocks in: every block swapped in touches one swapped out.
        let out = shuffled(&mut rng, (0..blocks).step_by(2).collect());
        let into = shuffled(&mut rng, (1..blocks).step_by(2).collect());
        let before = bytes.clone();
        let waits = lane_waits(&d);
        let read = step(&d, &mut rng, (buffer, &mut bytes), block, &out, &into);
        assert_eq!(lane_waits(&d), waits, "{block} B blocks: disjoint ranges waited");
        for (&b, got) in out.iter().zip(&read) {
            assert!(got[..] == before[b * block..(b + 1) * block], "{block} B: block {b} read wrong");
        }
        assert!(d.download(buffer).unwrap() == bytes, "{block} B: the writes did not land");
        assert!(model::with(|g| g.errors.is_empty()));
    }
}

#[test]
fn an_overlapping_write_waits_for_the_read_on_the_device() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(7);
    let block = 4096;
    let (buffer, mut bytes) = pool(&d, &mut rng, block * 64);
    let before = bytes.clone();
    // The read takes blocks 0..32; the write, 1 byte of block 31 (the host waits for it
    // first: without a wait on the device the read would see the new byte).
    let mut reads = d.downloads();
    let slot = reads.read(buffer, 0, 32 * block as u64).unwrap();
    let pending = reads.submit().unwrap();
    let waits = lane_waits(&d);
    d.upload_at(buffer, (32 * block - 1) as u64, &[!before[32 * block - 1]]).unwrap();
    assert_eq!(lane_waits(&d), waits + 1, "one wait for the overlapping read");
    bytes[32 * block - 1] = !before[32 * block - 1];
    let got = pending.wait().unwrap();
    assert!(got.get(slot) == &before[..32 * block], "the read saw the later write");
    // A write that touches the read's end, and one past it, wait for nothing.
    let mut reads = d.downloads();
    let slot = reads.read(buffer, 0, 32 * block as u64).unwrap();
    let pending = reads.submit().unwrap();
    let waits = lane_waits(&d);
    d.upload_at(buffer, (32 * block) as u64, &[1, 2, 3]).unwrap();
    d.upload_at(buffer, (40 * block) as u64, &[4]).unwrap();
    assert_eq!(lane_waits(&d), waits, "touching and apart: no wait");
    assert!(pending.wait().unwrap().get(slot) == &bytes[..32 * block]);
}

#[test]
fn a_read_of_bytes_being_written_waits_for_the_write() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(8);
    let (buffer, mut bytes) = pool(&d, &mut rng, 1 << 20);
    let new = random_vec(&mut rng, 100_000);
    let fence = {
        let mut writes = d.uploads();
        writes.write(buffer, 500_000, &new).unwrap();
        writes.submit().unwrap()
    };
    bytes[500_000..600_000].copy_from_slice(&new);
    let waits = lane_waits(&d);
    // Reads across the write's first and last byte, and one of bytes before it.
    let got = d.download_ranges(&[(buffer, 499_990, 20), (buffer, 599_999, 1), (buffer, 0, 10)]).unwrap();
    assert_eq!(lane_waits(&d), waits + 1);
    assert_eq!(got[0], bytes[499_990..500_010]);
    assert_eq!(got[1], bytes[599_999..600_000]);
    assert_eq!(got[2], bytes[..10]);
    fence.wait().unwrap();
}

/// Whether any range of `a` shares a byte with any of `b` (`(offset, len)` pairs).
fn any_overlap(a: &[(usize, usize)], b: &[(usize, usize)]) -> bool {
    a.iter().any(|&(x, n)| b.iter().any(|&(y, m)| x < y + m && y < x + n))
}

#[test]
fn random_ranges_wait_exactly_when_they_overlap() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(9);
    let len = 512 << 10;
    let (buffer, mut bytes) = pool(&d, &mut rng, len);
    let (mut waited, mut apart) = (0, 0);
    for round in 0..60 {
        // A few reads and writes of 1 B to 40 KiB (some past the direct threshold), in any
        // order; writes within one batch may overlap each other (the later one wins).
        let ranges = |rng: &mut fastrand::Rng, most: usize| -> Vec<(usize, usize)> {
            (0..rng.usize(1..most))
                .map(|_| {
                    let n = if rng.bool() { rng.usize(1..64) } else { rng.usize(1..40 << 10) };
                    (rng.usize(0..len - n), n)
                })
                .collect()
        };
        let reads_at = ranges(&mut rng, 8);
        let writes_at = ranges(&mut rng, 4);
        let mut reads = d.downloads();
        let slots: Vec<_> =
            reads_at.iter().map(|&(at, n)| reads.read(buffer, at as u64, n as u64).unwrap()).collect();
        let pending = reads.submit().unwrap();
        let before = bytes.clone();
        let waits = lane_waits(&d);
        let mut writes = d.uploads();
        let data: Vec<_> = writes_at.iter().map(|&(_, n)| random_vec(&mut rng, n)).collect();
        for (&(at, _), new) in writes_at.iter().zip(&data) {
            writes.write(buffer, at as u64, new).unwrap();
            bytes[at..at + new.len()].copy_from_slice(new);
        }
        let fence = writes.submit().unwrap();
        let overlap = any_overlap(&reads_at, &writes_at);
        assert_eq!(lane_waits(&d) - waits, u64::from(overlap), "round {round}: {reads_at:?} / {writes_at:?}");
        if overlap {
            waited += 1
        } else {
            apart += 1
        }
        fence.wait().unwrap();
        let got = pending.wait().unwrap();
        for (&(at, n), &s) in reads_at.iter().zip(&slots) {
            assert!(got.get(s) == &before[at..at + n], "round {round}: a read saw a later write");
        }
    }
    assert!(waited > 5 && apart > 5, "both cases ran: {waited} overlapping, {apart} apart");
    assert!(d.download(buffer).unwrap() == bytes);
    assert!(model::with(|g| g.errors.is_empty()));
}

#[test]
fn many_reads_in_order_claim_their_span_per_buffer() {
    // 512 reads of 64 B in order with 64 B gaps claim [first, last end) of the buffer: a write
    // into a gap waits for them, a write past the span does not; the bytes are right.
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(10);
    let (buffer, mut bytes) = pool(&d, &mut rng, 1 << 20);
    let mut reads = d.downloads();
    let slots: Vec<_> = (0..512u64).map(|i| reads.read(buffer, 4096 + i * 128, 64).unwrap()).collect();
    let pending = reads.submit().unwrap();
    let before = bytes.clone();
    let waits = lane_waits(&d);
    d.upload_at(buffer, 4096 + 64, &[1; 64]).unwrap();
    assert_eq!(lane_waits(&d), waits + 1, "a gap inside the span waits");
    d.upload_at(buffer, 4096 + 512 * 128, &[2; 64]).unwrap();
    assert_eq!(lane_waits(&d), waits + 1, "past the span: no wait");
    bytes[4096 + 64..4096 + 128].fill(1);
    bytes[4096 + 512 * 128..4096 + 512 * 128 + 64].fill(2);
    let got = pending.wait().unwrap();
    for (i, &slot) in slots.iter().enumerate() {
        let at = 4096 + i * 128;
        assert!(got.get(slot) == &before[at..at + 64], "read {i}");
    }
    assert!(d.download(buffer).unwrap() == bytes);
}

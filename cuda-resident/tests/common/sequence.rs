//! The realistic sequence the fault matrices run, on a real GPU (`tests/gpu_faults.rs`) and
//! on the model driver (`src/testing/faults.rs`), which both include this file. Each names
//! `Device`, `Error` and `ResidentBuffer` at its own root (the crate's or the library's).
//!
//! The sequence: three buffers (a size class, a slab range, past the slab); initial bytes by
//! `upload_many` and `upload_at_many`; a ragged batch of small overlapping writes with a
//! few direct ones, across chunks, and one direct write of the third buffer's head; an
//! in-place batch; over a megabyte of small writes in order and reads of them into vectors
//! (so on the packing threads' pipeline); a single small write; downloads as views (whole
//! buffers, a head, many small ranges), ranged, and into slices; pinned memory; frees.

use super::{Device, Error, ResidentBuffer};

/// The sizes a fault matrix runs the sequence at.
pub struct Shape {
    /// The three buffers: from a size class, from a slab range, past the slab size.
    pub sizes: [usize; 3],
    /// The head of the third buffer that the sequence writes and reads back.
    pub head: usize,
    /// Small writes of the ragged batch; every twentieth is `direct` bytes long.
    pub writes: usize,
    /// A length at or above the direct threshold, below the second buffer's size.
    pub direct: usize,
    /// Small ranges read back in the last batch.
    pub ranges: usize,
    /// Bytes of pinned memory lent at the end.
    pub pinned: usize,
}

/// What went wrong in a run of the sequence.
#[derive(Debug)]
pub enum Failure {
    /// An operation returned an error (expected when a fault was injected).
    Error(Error),
    /// An operation succeeded but the bytes are wrong: never acceptable.
    Corrupt(String),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        Failure::Error(e)
    }
}

/// `len` random bytes.
pub fn random_vec(rng: &mut fastrand::Rng, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rng.fill(&mut v);
    v
}

fn same(what: &str, got: &[u8], want: &[u8]) -> Result<(), Failure> {
    if got == want {
        return Ok(());
    }
    let at = got.iter().zip(want).position(|(a, b)| a != b);
    Err(Failure::Corrupt(format!(
        "{what}: {} vs {} bytes, first difference at {at:?}",
        got.len(),
        want.len()
    )))
}

/// Runs the sequence. Buffers are freed whatever happens, as an owner's cleanup would.
/// Returns the number of operations run and bytes verified.
pub fn sequence(d: &Device, seed: u64, shape: &Shape) -> Result<(u64, u64), Failure> {
    let mut held: Vec<ResidentBuffer> = Vec::new();
    let result = sequence_body(d, seed, shape, &mut held);
    let mut freed = Ok(());
    for b in held {
        if let Err(e) = d.free(b) {
            freed = freed.and(Err(Failure::Error(e)));
        }
    }
    let counts = result?;
    freed.map(|()| counts)
}

fn sequence_body(
    d: &Device,
    seed: u64,
    shape: &Shape,
    held: &mut Vec<ResidentBuffer>,
) -> Result<(u64, u64), Failure> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let (mut ops, mut checked) = (0u64, 0u64);
    let sizes = shape.sizes;
    for &n in &sizes {
        held.push(d.allocate(n as u64)?);
        ops += 1;
    }
    let [small, mid, big] = [held[0], held[1], held[2]];
    // The bytes each buffer should hold (for `big`, its head). Fresh buffers hold whatever
    // their memory held before: each gets known bytes first.
    let mut model =
        [random_vec(&mut rng, sizes[0]), random_vec(&mut rng, sizes[1]), random_vec(&mut rng, shape.head)];
    d.upload_many(&[(small, &model[0][..])])?;
    d.upload_at_many(&[(mid, 0, &model[1][..]), (big, 0, &model[2][..])])?;
    ops += 2;

    // A ragged batch: many small overlapping writes (packed, scattered by the kernel), every
    // twentieth long enough for a DMA of its own, across several chunks, then the head of
    // `big` (direct).
    let lens = [sizes[0], sizes[1], shape.head];
    let data: Vec<(usize, u64, Vec<u8>)> = (0..shape.writes)
        .map(|w| {
            let i = rng.usize(0..3);
            let len = if w % 20 == 0 { shape.direct.min(lens[i]) } else { rng.usize(1..=3000).min(lens[i]) };
            let offset = rng.usize(0..=lens[i] - len);
            (i, offset as u64, random_vec(&mut rng, len))
        })
        .collect();
    let whole = random_vec(&mut rng, shape.head);
    let mut batch = d.uploads();
    for (i, offset, bytes) in &data {
        batch.write(held[*i], *offset, bytes)?;
    }
    batch.write(big, 0, &whole)?;
    batch.submit()?.wait()?;
    ops += 1;
    for (i, offset, bytes) in &data {
        model[*i][*offset as usize..*offset as usize + bytes.len()].copy_from_slice(bytes);
    }
    model[2].copy_from_slice(&whole);

    // In place: disjoint writes filled straight into pinned staging.
    let mut batch = d.uploads();
    let fills: Vec<(u64, Vec<u8>)> = (0..50).map(|j| (j * 4096 + 7, random_vec(&mut rng, 1000))).collect();
    for (offset, bytes) in &fills {
        batch.write_with(mid, *offset, bytes.len(), |dst| dst.copy_from_slice(bytes))?;
    }
    batch.submit()?.wait()?;
    ops += 1;
    for (offset, bytes) in &fills {
        model[1][*offset as usize..*offset as usize + bytes.len()].copy_from_slice(bytes);
    }

    // Many small writes in order with gaps, then reads of the same ranges into vectors: both
    // laid out without the planner, over several chunks and over a megabyte, so that the
    // packing threads pack and copy out while chunks move.
    let mut order = Vec::new();
    let (mut at, mut total) = (0u64, 0usize);
    while total < (1 << 20) + (64 << 10) {
        let len = rng.usize(1..=4000);
        order.push((at, random_vec(&mut rng, len)));
        at += len as u64 + rng.u64(1..64);
        total += len;
    }
    let mut batch = d.uploads();
    for (offset, bytes) in &order {
        batch.write(mid, *offset, bytes)?;
    }
    batch.submit()?.wait()?;
    ops += 1;
    for (offset, bytes) in &order {
        model[1][*offset as usize..*offset as usize + bytes.len()].copy_from_slice(bytes);
    }
    let mut reads = d.downloads();
    let slots = order
        .iter()
        .map(|(offset, bytes)| reads.read(mid, *offset, bytes.len() as u64))
        .collect::<Result<Vec<_>, _>>()?;
    let mut outs = vec![vec![0x5a_u8; 3]; slots.len()];
    let got = reads.submit()?.wait_into(&slots, &mut outs)?;
    ops += 1;
    for (((offset, bytes), &slot), out) in order.iter().zip(&slots).zip(&outs) {
        let expected = &model[1][*offset as usize..*offset as usize + bytes.len()];
        same("in-order range", got.get(slot), expected)?;
        same("in-order range copied out", out, expected)?;
        checked += 2 * bytes.len() as u64;
    }
    drop(got);

    // One small write: the latency path.
    let one = random_vec(&mut rng, 100);
    d.upload_at(small, 999, &one)?;
    model[0][999..1099].copy_from_slice(&one);
    ops += 1;

    // Downloads: whole buffers, a direct range, many small ranges; views and copies.
    let mut reads = d.downloads();
    let all_small = reads.read_buffer(small)?;
    let all_mid = reads.read_buffer(mid)?;
    let head = reads.read(big, 0, shape.head as u64)?;
    let ranges: Vec<(usize, u64, u64)> = (0..shape.ranges)
        .map(|_| {
            let i = rng.usize(0..2);
            let len = rng.usize(1..=2000);
            (i, rng.usize(0..=sizes[i] - len) as u64, len as u64)
        })
        .collect();
    let mut slots = Vec::new();
    for &(i, offset, len) in &ranges {
        slots.push(reads.read([small, mid][i], offset, len)?);
    }
    let got = reads.submit()?.wait()?;
    ops += 1;
    same("small", got.get(all_small), &model[0])?;
    same("mid", got.get(all_mid), &model[1])?;
    same("big head", got.get(head), &model[2])?;
    checked += (model[0].len() + model[1].len() + model[2].len()) as u64;
    for (&(i, offset, len), &slot) in ranges.iter().zip(&slots) {
        let want = &model[i][offset as usize..(offset + len) as usize];
        same("range", got.get(slot), want)?;
        checked += len;
    }
    drop(got);

    let range = d.download_range(mid, 12345, 777)?;
    same("download_range", &range, &model[1][12345..12345 + 777])?;
    let mut out = vec![0x5au8; shape.head];
    d.download_to_slice(big, 0, &mut out)?;
    same("download_to_slice", &out, &model[2])?;
    let mut slice = vec![0x5au8; 10_000];
    d.download_to_slice(mid, 1234, &mut slice)?;
    same("download_to_slice at an offset", &slice, &model[1][1234..11_234])?;
    checked += 777 + out.len() as u64 + slice.len() as u64;
    ops += 3;

    let mut pinned = d.pinned(shape.pinned)?;
    pinned.fill(0xa5);
    drop(pinned);
    ops += 1;
    Ok((ops, checked))
}

/// The state of the accounting after a sequence, a synchronize and a trim: buffers,
/// allocated bytes, reserved bytes, pinned bytes reserved and lent.
pub fn settled(d: &Device) -> Result<[u64; 5], Error> {
    d.synchronize()?;
    d.trim()?;
    let t = d.telemetry();
    Ok([
        t.memory.buffers,
        t.memory.allocated_bytes,
        t.memory.reserved_bytes,
        t.pinned.reserved_bytes,
        t.pinned.lent_bytes,
    ])
}

/// The call numbers tried for an entry point called `calls` times: all of them, or `limit`
/// spread evenly from the first to the last.
pub fn call_numbers(calls: u64, limit: u64) -> Vec<u64> {
    if calls <= limit {
        return (1..=calls).collect();
    }
    let mut ks: Vec<u64> = (0..limit).map(|i| 1 + i * (calls - 1) / (limit - 1)).collect();
    ks.dedup();
    ks
}

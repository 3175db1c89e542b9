//! Fuzzes the copy planner (`cuda_resident::internals::plan`) against the byte model its
//! tests use (`plan::check`, public through the `fuzzing` feature).
//!
//! An input decodes into a config (mostly small chunks and thresholds, so that chunking and
//! the direct/packed split are hit; sometimes any numbers), a few buffers, and a batch of
//! writes and a batch of reads. Requests may overlap, touch, repeat, be empty, reach past
//! their buffer or overflow `u64`, and may claim a longer buffer than another request of the
//! same buffer does. An optional bulk part adds hundreds of requests, so that the radix sort
//! (and its shortcut for requests that come in order) runs, not only the comparison sort, or
//! replaces a direction's requests with hundreds in order (each at or after the end of the
//! previous one of its buffer), which the planner takes without sorting.
//!
//! For each batch:
//!
//! - a bad batch (bad config, or a request out of range) fails with exactly the error the
//!   docs promise (config errors first, then the first bad request), leaves the reused plan
//!   empty, and never panics;
//! - a good upload plan, carried out on the model, leaves every buffer as writing the
//!   requests in order does (later writes win), and keeps every structural promise of the
//!   plan (`check::execute_upload`);
//! - a good download plan, carried out on the model after the writes, shows each read
//!   exactly its bytes (`check::execute_download`);
//! - where the writes are in order and apart, the layout of the paths that skip the planner
//!   (`check::execute_in_order`) keeps its promises and gives the same bytes;
//! - the same batch moved to other buffer offsets (up to `u64::MAX`, which takes the
//!   planner's wide-key and tuple paths) plans the same, shifted, with the planner and the
//!   plan reused; and the one-shot functions agree with a reused `Planner`.
//!
//! An optional runs part is a scoped batch's items in pinned host memory (runs of items
//! that follow each other, gaps, regions mapped or only registered): its layout into chunks,
//! over-the-bus launches and DMAs, carried out on the model, moves every byte of every item
//! exactly once (`check::execute_runs`), and its parts cut where their rule says
//! (`check::check_parts`).

#![no_main]

use std::collections::HashMap;

use arbitrary::Arbitrary;
use cuda_resident::internals::plan::check::{
    Buffers, RunItem, apply_in_order, check_parts, execute_download, execute_in_order, execute_runs,
    execute_upload, initial_buffers,
};
use cuda_resident::internals::plan::{
    self, BufferKey, Chunk, DownloadPlan, PlanConfig, PlanError, Planner, ReadRequest, UploadPlan,
    WriteRequest,
};
use libfuzzer_sys::fuzz_target;

/// Most buffers one input names.
const MAX_BUFFERS: usize = 8;
/// Longest model buffer; requests may claim up to twice that.
const MAX_BUFFER_LEN: u64 = 4096;
/// Largest flat staging the model carries out (it allocates that much); bigger plans, from
/// configs with huge alignments, get every check but the byte model.
const MODEL_STAGING: u64 = 1 << 24;

#[derive(Arbitrary, Debug)]
struct Input {
    config: Config,
    buffers: Vec<Buffer>,
    writes: Vec<Request>,
    reads: Vec<Request>,
    bulk: Option<Bulk>,
    runs: Option<Runs>,
}

/// A scoped batch's items in pinned memory, and how they are laid out.
#[derive(Arbitrary, Debug)]
struct Runs {
    items: Vec<Run>,
    /// Multiplies every item's length, so that runs reach the 1 MiB they need.
    scale: u8,
    chunk: u32,
    threshold: u32,
    /// Items at least this many KiB long move by a DMA of their own (0: none does).
    own_dma_kib: u16,
    unified: bool,
    bus: bool,
    upload: bool,
    moved: u8,
}

/// One item: its length, the host gap before it, whether it opens a region, and whether that
/// region is mapped for the device.
#[derive(Arbitrary, Debug)]
struct Run {
    len: u16,
    gap: u8,
    new_region: bool,
    mapped: bool,
}

/// Most items of a runs part, and most model bytes (its items' lengths) it carries out.
const MAX_RUN_ITEMS: usize = 4096;
const MAX_RUN_BYTES: u64 = 32 << 20;

impl Runs {
    fn check(&self) {
        let scale = u64::from(self.scale % 64) + 1;
        let items: Vec<RunItem> = self
            .items
            .iter()
            .take(MAX_RUN_ITEMS)
            .map(|r| RunItem {
                len: u64::from(r.len) * scale,
                gap: u64::from(r.gap) * 64,
                new_region: r.new_region,
                mapped: r.mapped,
            })
            .collect();
        let chunk = u64::from(self.chunk % (8 << 20)) + 1;
        check_parts(&items, chunk, usize::from(self.moved % 3));
        if items.iter().map(|r| r.len + r.gap).sum::<u64>() <= MAX_RUN_BYTES {
            let threshold = u64::from(self.threshold % (2 << 20));
            let own_dma = if self.own_dma_kib == 0 { u64::MAX } else { u64::from(self.own_dma_kib) << 10 };
            execute_runs(&items, (chunk, threshold, own_dma), self.unified, self.bus, self.upload);
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Config {
    /// Alignment up to 64, chunks under 1 KiB (0 and less than `align` included, which are
    /// errors), thresholds on both sides of the chunk capacity.
    Small { align_log2: u8, chunk_bytes: u16, direct_threshold: u16 },
    /// Any numbers.
    Raw { direct_threshold: u64, chunk_bytes: u64, align: u64 },
}

impl Config {
    fn to_plan_config(&self) -> PlanConfig {
        match *self {
            Config::Small { align_log2, chunk_bytes, direct_threshold } => PlanConfig {
                direct_threshold: u64::from(direct_threshold % 1200),
                chunk_bytes: u64::from(chunk_bytes % 1024),
                align: 1 << (align_log2 % 7),
            },
            Config::Raw { direct_threshold, chunk_bytes, align } => {
                PlanConfig { direct_threshold, chunk_bytes, align }
            }
        }
    }
}

#[derive(Arbitrary, Debug)]
struct Buffer {
    key: Key,
    len: u16,
    /// Where this buffer's requests move to in the shifted batch.
    shift: u64,
}

#[derive(Arbitrary, Debug)]
enum Key {
    /// One of a few small keys, so that two buffers of an input may name the same one.
    Small(u8),
    /// The ends of `u64`.
    Extreme(bool),
    /// Any key.
    Any(u64),
}

impl Key {
    fn key(&self) -> BufferKey {
        match *self {
            Key::Small(k) => u64::from(k % 8),
            Key::Extreme(max) => {
                if max {
                    u64::MAX
                } else {
                    0
                }
            }
            Key::Any(k) => k,
        }
    }
}

/// One request; `buffer` picks one of the input's buffers (modulo their count).
#[derive(Arbitrary, Debug)]
enum Request {
    /// Fitted inside the buffer; `grid` snaps offset and length to 32 bytes, which makes
    /// duplicates and touching requests common.
    Fit { buffer: u8, offset: u16, len: u16, grid: bool },
    /// Offset and length relative to the buffer's end, wrapping: the boundary cases (a
    /// zero-length request at the end, one byte past it, offsets near `u64::MAX`).
    Near { buffer: u8, offset: i16, len: i16 },
    /// Any offset and length: mostly out of range, sometimes overflowing.
    Raw { buffer: u8, offset: u64, len: u64 },
    /// Fitted inside a longer buffer length than the buffer's own, which the request claims.
    Claimed { buffer: u8, extra: u16, offset: u16, len: u16, grid: bool },
}

/// Many small fitted requests from a seed.
#[derive(Arbitrary, Debug)]
struct Bulk {
    count: u16,
    seed: u64,
    max_len: u16,
    /// How the requests are placed and ordered.
    placement: Placement,
    /// 0: writes, 1: reads, else both.
    to: u8,
}

/// The bulk requests' placement.
#[derive(Arbitrary, Debug, Clone, Copy, PartialEq, Eq)]
enum Placement {
    /// Random offsets, in random order.
    Random,
    /// Random offsets, sorted by buffer key and offset, as a caller writing front to back
    /// would (overlaps stay).
    Sorted,
    /// In order: each request of a buffer starts at or after the end of the previous one
    /// (touching or with a gap), buffers interleaved, as the planner's sort-free path takes
    /// them (with small keys); they replace the input's own requests of that direction.
    InOrder,
}

/// A request as the planner sees it, before it becomes a write or a read.
#[derive(Clone, Copy, Debug)]
struct Req {
    buffer: BufferKey,
    buffer_len: u64,
    offset: u64,
    len: u64,
}

impl Req {
    fn write(self) -> WriteRequest {
        WriteRequest { buffer: self.buffer, buffer_len: self.buffer_len, offset: self.offset, len: self.len }
    }

    fn read(self) -> ReadRequest {
        ReadRequest { buffer: self.buffer, buffer_len: self.buffer_len, offset: self.offset, len: self.len }
    }

    fn is_in_range(&self) -> bool {
        self.offset.checked_add(self.len).is_some_and(|end| end <= self.buffer_len)
    }
}

/// A buffer of the model: its key, length and shift.
#[derive(Clone, Copy, Debug)]
struct Modelled {
    key: BufferKey,
    len: u64,
    shift: u64,
}

/// `offset` and `len` fitted inside `buffer_len`, as the property tests do.
fn fit(buffer_len: u64, offset: u16, len: u16, grid: bool) -> (u64, u64) {
    let mut offset = u64::from(offset) % (buffer_len + 1);
    let mut len = u64::from(len) % (buffer_len - offset + 1);
    if grid {
        offset -= offset % 32;
        len -= len % 32;
    }
    (offset, len)
}

impl Request {
    fn to_req(&self, buffers: &[Modelled]) -> Req {
        let pick = |b: u8| buffers[usize::from(b) % buffers.len()];
        match *self {
            Request::Fit { buffer, offset, len, grid } => {
                let b = pick(buffer);
                let (offset, len) = fit(b.len, offset, len, grid);
                Req { buffer: b.key, buffer_len: b.len, offset, len }
            }
            Request::Near { buffer, offset, len } => {
                let b = pick(buffer);
                let offset = b.len.wrapping_add_signed(i64::from(offset));
                Req { buffer: b.key, buffer_len: b.len, offset, len: i64::from(len) as u64 }
            }
            Request::Raw { buffer, offset, len } => {
                let b = pick(buffer);
                Req { buffer: b.key, buffer_len: b.len, offset, len }
            }
            Request::Claimed { buffer, extra, offset, len, grid } => {
                let b = pick(buffer);
                let claimed = b.len + u64::from(extra) % (MAX_BUFFER_LEN + 1);
                let (offset, len) = fit(claimed, offset, len, grid);
                Req { buffer: b.key, buffer_len: claimed, offset, len }
            }
        }
    }
}

/// splitmix64, for the bulk requests.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut x = *state;
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl Bulk {
    /// 256 to 2048 fitted requests (the radix sort starts at 256 keys).
    fn requests(&self, buffers: &[Modelled]) -> Vec<Req> {
        let mut state = self.seed;
        let max_len = u64::from(self.max_len % 1024);
        let count = 256 + usize::from(self.count) % 1793;
        if self.placement == Placement::InOrder {
            let mut cursors: HashMap<BufferKey, u64> = HashMap::new();
            return (0..count)
                .map(|_| {
                    let b = buffers[next(&mut state) as usize % buffers.len()];
                    let cursor = cursors.entry(b.key).or_insert(0);
                    let gap = if next(&mut state).is_multiple_of(3) { 0 } else { next(&mut state) % 64 };
                    let len = next(&mut state) % (max_len.min(b.len) + 1);
                    let offset = *cursor + gap;
                    if offset + len > b.len {
                        // The buffer is full: an empty request, which the order ignores.
                        return Req { buffer: b.key, buffer_len: b.len, offset: b.len, len: 0 };
                    }
                    if len > 0 {
                        *cursor = offset + len;
                    }
                    Req { buffer: b.key, buffer_len: b.len, offset, len }
                })
                .collect();
        }
        let mut reqs: Vec<Req> = (0..count)
            .map(|_| {
                let b = buffers[next(&mut state) as usize % buffers.len()];
                let len = next(&mut state) % (max_len.min(b.len) + 1);
                let offset = next(&mut state) % (b.len - len + 1);
                Req { buffer: b.key, buffer_len: b.len, offset, len }
            })
            .collect();
        if self.placement == Placement::Sorted {
            reqs.sort_by_key(|r| (r.buffer, r.offset));
        }
        reqs
    }
}

/// The error planning must give, if any: config errors first, then the first request out
/// of range. `Ok` means the batch must plan.
fn expected_error(cfg: &PlanConfig, reqs: &[Req]) -> Result<(), PlanError> {
    if !cfg.align.is_power_of_two() {
        return Err(PlanError::InvalidAlign { align: cfg.align });
    }
    if cfg.chunk_bytes & !(cfg.align - 1) == 0 {
        return Err(PlanError::ChunkTooSmall { chunk_bytes: cfg.chunk_bytes, align: cfg.align });
    }
    match reqs.iter().position(|r| !r.is_in_range()) {
        Some(index) => {
            let r = reqs[index];
            Err(PlanError::OutOfRange {
                index,
                buffer: r.buffer,
                offset: r.offset,
                len: r.len,
                buffer_len: r.buffer_len,
            })
        }
        None => Ok(()),
    }
}

/// Whether a good batch may still be refused as too large: only when its staging could pass
/// `u64::MAX`. Each request needs at most its length, an alignment's padding and (a packed
/// one that does not fit what is left of a chunk) one chunk's capacity.
fn may_be_too_large(cfg: &PlanConfig, reqs: &[Req]) -> bool {
    let cap = u128::from(cfg.chunk_bytes & !(cfg.align - 1));
    let per_request = cap + u128::from(cfg.align);
    let bound: u128 = reqs.iter().map(|r| u128::from(r.len) + per_request).sum();
    bound > u128::from(u64::MAX)
}

/// Adds each buffer's shift to the buffer offsets of a plan's copies.
fn shift_chunks(chunks: &mut [Chunk], shifts: &HashMap<BufferKey, u64>) {
    for c in chunks {
        for copy in c.packed.iter_mut().chain(c.direct.iter_mut()) {
            copy.buffer_offset += shifts[&copy.buffer];
        }
    }
}

fn shifted(reqs: &[Req], shifts: &HashMap<BufferKey, u64>) -> Vec<Req> {
    reqs.iter()
        .map(|r| {
            let s = shifts[&r.buffer];
            Req { buffer_len: r.buffer_len + s, offset: r.offset + s, ..*r }
        })
        .collect()
}

/// Plans the writes and checks the result; returns the model buffers after the writes when
/// the batch is good.
fn check_upload(
    planner: &mut Planner,
    cfg: &PlanConfig,
    reqs: &[Req],
    lens: &[(BufferKey, u64)],
    shifts: &HashMap<BufferKey, u64>,
) -> Option<Buffers> {
    let writes: Vec<WriteRequest> = reqs.iter().map(|r| r.write()).collect();
    // A plan left over from another batch, so that reuse is checked too.
    let mut plan = UploadPlan { chunks: vec![Chunk::default(); 3], ..UploadPlan::default() };
    let result = planner.plan_upload_into(&writes, cfg, &mut plan);
    assert_eq!(plan::plan_upload(&writes, cfg), result.clone().map(|()| plan.clone()), "one-shot vs reused");
    match (expected_error(cfg, reqs), result) {
        (Err(want), got) => {
            assert_eq!(got, Err(want));
            assert_eq!(plan, UploadPlan::default(), "a failed plan is left empty");
            None
        }
        (Ok(()), Err(PlanError::TooLarge { .. })) if may_be_too_large(cfg, reqs) => None,
        (Ok(()), Err(e)) => panic!("a good batch failed: {e}"),
        (Ok(()), Ok(())) => {
            let mut expected = initial_buffers(lens);
            let owners = apply_in_order(&mut expected, &writes);
            if plan.total_staging <= MODEL_STAGING {
                let mut actual = initial_buffers(lens);
                execute_upload(&plan, &writes, cfg, &mut actual, &owners);
                assert_eq!(actual, expected, "the plan's result differs from writing in order");
            }
            // The layout of the paths that skip the planner, where it applies (writes in order
            // and apart), gives the same bytes in chunks of either shape.
            for grow in [false, true] {
                if let Some(actual) = execute_in_order(&writes, &initial_buffers(lens), cfg.chunk_bytes, grow)
                {
                    assert_eq!(
                        actual, expected,
                        "the in-order layout's result differs from writing in order"
                    );
                }
            }
            let moved: Vec<WriteRequest> = shifted(reqs, shifts).iter().map(|r| r.write()).collect();
            let mut want = plan.clone();
            shift_chunks(&mut want.chunks, shifts);
            planner.plan_upload_into(&moved, cfg, &mut plan).expect("the shifted batch plans");
            assert_eq!(plan, want, "the shifted batch plans differently");
            Some(expected)
        }
    }
}

/// Plans the reads and checks the result against `buffers`.
fn check_download(
    planner: &mut Planner,
    cfg: &PlanConfig,
    reqs: &[Req],
    buffers: &Buffers,
    shifts: &HashMap<BufferKey, u64>,
) {
    let reads: Vec<ReadRequest> = reqs.iter().map(|r| r.read()).collect();
    let mut plan = DownloadPlan { chunks: vec![Chunk::default(); 2], ..DownloadPlan::default() };
    let result = planner.plan_download_into(&reads, cfg, &mut plan);
    assert_eq!(plan::plan_download(&reads, cfg), result.clone().map(|()| plan.clone()), "one-shot vs reused");
    match (expected_error(cfg, reqs), result) {
        (Err(want), got) => {
            assert_eq!(got, Err(want));
            assert_eq!(plan, DownloadPlan::default(), "a failed plan is left empty");
        }
        (Ok(()), Err(PlanError::TooLarge { .. })) if may_be_too_large(cfg, reqs) => {}
        (Ok(()), Err(e)) => panic!("a good batch failed: {e}"),
        (Ok(()), Ok(())) => {
            if plan.total_staging <= MODEL_STAGING {
                execute_download(&plan, &reads, cfg, buffers);
            }
            for (r, v) in reads.iter().zip(&plan.views) {
                assert!(r.len > 0 || (v.len == 0 && v.stage_offset == 0), "empty read {r:?}: {v:?}");
            }
            let moved: Vec<ReadRequest> = shifted(reqs, shifts).iter().map(|r| r.read()).collect();
            let mut want = plan.clone();
            shift_chunks(&mut want.chunks, shifts);
            planner.plan_download_into(&moved, cfg, &mut plan).expect("the shifted batch plans");
            assert_eq!(plan, want, "the shifted batch plans differently");
        }
    }
}

fuzz_target!(|input: Input| {
    let cfg = input.config.to_plan_config();
    // The buffers, one per key (the first one wins).
    let mut buffers: Vec<Modelled> = Vec::new();
    for b in &input.buffers {
        let key = b.key.key();
        if buffers.len() < MAX_BUFFERS && buffers.iter().all(|m| m.key != key) {
            let len = u64::from(b.len) % (MAX_BUFFER_LEN + 1);
            // Room for the longest claimed length above the shift.
            let shift = b.shift.min(u64::MAX - 2 * MAX_BUFFER_LEN);
            buffers.push(Modelled { key, len, shift });
        }
    }
    if buffers.is_empty() {
        buffers.push(Modelled { key: 1, len: 64, shift: 0 });
    }
    let mut writes: Vec<Req> = input.writes.iter().map(|r| r.to_req(&buffers)).collect();
    let mut reads: Vec<Req> = input.reads.iter().map(|r| r.to_req(&buffers)).collect();
    if let Some(bulk) = &input.bulk {
        let more = bulk.requests(&buffers);
        for (to, reqs) in [(bulk.to != 1, &mut writes), (bulk.to != 0, &mut reads)] {
            if to && bulk.placement == Placement::InOrder {
                *reqs = more.clone();
            } else if to {
                reqs.extend_from_slice(&more);
            }
        }
    }
    // The model's buffers are as long as the longest length any good request claims.
    let mut lens: Vec<(BufferKey, u64)> = buffers.iter().map(|b| (b.key, b.len)).collect();
    for r in writes.iter().chain(&reads).filter(|r| r.is_in_range()) {
        let len = &mut lens.iter_mut().find(|(k, _)| *k == r.buffer).expect("a modelled buffer").1;
        *len = (*len).max(r.buffer_len);
    }
    let shifts: HashMap<BufferKey, u64> = buffers.iter().map(|b| (b.key, b.shift)).collect();

    let mut planner = Planner::new();
    let after = check_upload(&mut planner, &cfg, &writes, &lens, &shifts);
    let source = after.unwrap_or_else(|| initial_buffers(&lens));
    check_download(&mut planner, &cfg, &reads, &source, &shifts);
    if let Some(runs) = &input.runs {
        runs.check();
    }
});

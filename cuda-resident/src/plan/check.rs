//! Test support: a byte model of the buffers, CPU executors for plans, and checks of every
//! structural promise a plan makes. Shared by the unit and property tests, and by the fuzz
//! target in `fuzz/` through the `fuzzing` feature (which is how it is public, and why it is
//! hidden from the docs: it is not part of the crate's API).
//!
//! The checks panic on the first broken promise.

use std::collections::HashMap;

mod runs;

pub use runs::{RunItem, check_parts, execute_runs};

use super::{BufferKey, Chunk, DownloadPlan, PlanConfig, ReadRequest, UploadPlan, WriteRequest};

/// A stand-in for device memory: each buffer's bytes, from offset 0.
pub type Buffers = HashMap<BufferKey, Vec<u8>>;

/// A well-mixed 64-bit hash (splitmix64's finaliser).
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Byte `pos` of write `write`'s data.
pub fn data_byte(write: usize, pos: u64) -> u8 {
    mix((write as u64) << 40 ^ pos) as u8
}

/// Byte `pos` of buffer `buffer` before any write.
pub fn initial_byte(buffer: BufferKey, pos: u64) -> u8 {
    mix(buffer.rotate_left(17) ^ pos ^ 0x5555) as u8
}

/// Buffers with their initial contents.
pub fn initial_buffers(lens: &[(BufferKey, u64)]) -> Buffers {
    lens.iter().map(|&(key, len)| (key, (0..len).map(|p| initial_byte(key, p)).collect())).collect()
}

/// The reference: applies the writes in order, and records which write owns each byte
/// (`None` for a byte no write touches). Every write must lie inside a modelled buffer.
pub fn apply_in_order(
    buffers: &mut Buffers,
    writes: &[WriteRequest],
) -> HashMap<BufferKey, Vec<Option<u32>>> {
    let mut owners: HashMap<BufferKey, Vec<Option<u32>>> =
        buffers.iter().map(|(&k, v)| (k, vec![None; v.len()])).collect();
    for (i, w) in writes.iter().enumerate() {
        let bytes = buffers.get_mut(&w.buffer).expect("write to a modelled buffer");
        let owner = owners.get_mut(&w.buffer).expect("write to a modelled buffer");
        for k in 0..w.len {
            bytes[(w.offset + k) as usize] = data_byte(i, k);
            owner[(w.offset + k) as usize] = Some(i as u32);
        }
    }
    owners
}

/// The set of buffer bytes some non-empty request covers, as sorted maximal runs
/// `(buffer, start, end)`: exactly the intervals a plan must produce.
fn covered_runs(requests: impl Iterator<Item = (BufferKey, u64, u64)>) -> Vec<(BufferKey, u64, u64)> {
    let mut spans: Vec<_> = requests.filter(|r| r.2 > 0).map(|(b, o, l)| (b, o, o + l)).collect();
    spans.sort_unstable();
    let mut runs: Vec<(BufferKey, u64, u64)> = Vec::new();
    for (b, s, e) in spans {
        match runs.last_mut() {
            Some(last) if last.0 == b && s <= last.2 => last.2 = last.2.max(e),
            _ => runs.push((b, s, e)),
        }
    }
    runs
}

/// How far a plan fused its requests: the planner takes batches in order (see
/// `Planner::plan_upload_into`) without sorting, and then joins only consecutive requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fused {
    /// Every overlapping or touching pair of requests of a buffer joined one interval (the
    /// general planner).
    All,
    /// Requests joined only when consecutive in request order (the in-order planner, for
    /// batches without overlaps): copies may touch without being joined.
    Consecutive,
}

impl Fused {
    /// How the planner fuses `requests`: by the same rule it uses to choose its path.
    fn of<R: super::request::Request>(requests: &[R]) -> Fused {
        if super::planner::in_order(requests, &mut Vec::new()) { Fused::Consecutive } else { Fused::All }
    }
}

/// The checks both directions share: the chunks, and the totals the plan stores against
/// those of its copies. Returns the bytes moved.
fn check_plan<R: super::request::Request>(
    (chunks, chunk_capacity, stored, requested): (&[Chunk], u64, super::layout::Layout, u64),
    requests: &[R],
    cfg: &PlanConfig,
) -> u64 {
    let fused = Fused::of(requests);
    let spans: Vec<_> = requests.iter().map(|r| (r.buffer(), r.offset(), r.len())).collect();
    let (moved, intervals, packed_bytes, packed_intervals) =
        check_chunks(chunks, cfg, chunk_capacity, stored.total_staging, &spans, fused);
    assert_eq!(stored.moved_bytes, moved);
    if fused == Fused::All {
        assert_eq!(stored.intervals, intervals);
    }
    assert_eq!(stored.packed_bytes, packed_bytes);
    assert_eq!(stored.packed_intervals, packed_intervals);
    assert_eq!(requested, spans.iter().map(|s| s.2).sum::<u64>());
    moved
}

/// Everything a plan promises about its chunks and copies, whatever the direction.
/// `requests` are `(buffer, offset, len)`.
fn check_chunks(
    chunks: &[Chunk],
    cfg: &PlanConfig,
    chunk_capacity: u64,
    total_staging: u64,
    requests: &[(BufferKey, u64, u64)],
    fused: Fused,
) -> (u64, usize, u64, usize) {
    let cap = cfg.chunk_capacity().expect("valid config");
    assert_eq!(chunk_capacity, cap);
    assert!(cap <= cfg.chunk_bytes && cap.is_multiple_of(cfg.align) && cap > 0);
    let threshold = cfg.direct_threshold.min(cap);
    let mut in_buffer = Vec::new();
    for (i, c) in chunks.iter().enumerate() {
        assert_eq!(c.stage_start, i as u64 * cap, "chunk {i} start");
        assert!(
            c.staging_len > 0 && c.staging_len <= cap && c.staging_len <= cfg.chunk_bytes,
            "chunk {i}: {c:?}"
        );
        assert_eq!(c.packed_offset, c.stage_start);
        assert!(c.packed_len <= c.staging_len);
        assert_eq!(c.packed.is_empty(), c.packed_len == 0);
        // Packed copies: aligned, inside the packed region, ascending, disjoint, small.
        let mut at = c.packed_offset;
        for p in &c.packed {
            assert!(p.len > 0 && p.len < threshold, "packed copy {p:?} vs threshold {threshold}");
            assert_eq!(p.stage_offset % cfg.align, 0, "packed copy {p:?} not aligned");
            assert!(p.stage_offset >= at, "packed copies overlap or are out of order: {c:?}");
            at = p.stage_offset + p.len;
            in_buffer.push((p.buffer, p.buffer_offset, p.len, true));
        }
        assert_eq!(at, c.packed_offset + c.packed_len, "packed region ends at the last packed copy");
        // Their descriptor table stays within half a chunk, however small the copies.
        let descriptors: u64 = c.packed.iter().map(|p| p.len.div_ceil(crate::kernels::SEGMENT)).sum();
        assert!(descriptors <= super::chunk_descriptors_most(cap), "chunk {i}: {descriptors} descriptors");
        for (pc, p) in c.packed_copies().zip(&c.packed) {
            assert_eq!(pc.region_offset, p.stage_offset - c.packed_offset);
            assert_eq!(pc.region_offset % cfg.align, 0);
        }
        // Direct pieces: after the packed region, aligned, ascending, disjoint.
        for d in &c.direct {
            assert!(d.len > 0);
            assert_eq!(d.stage_offset % cfg.align, 0, "direct copy {d:?} not aligned");
            assert!(d.stage_offset >= at, "direct copies overlap or precede the packed region: {c:?}");
            at = d.stage_offset + d.len;
            in_buffer.push((d.buffer, d.buffer_offset, d.len, false));
        }
        assert_eq!(at, c.stage_end(), "chunk {i} ends at its last copy");
    }
    assert_eq!(total_staging, chunks.last().map_or(0, Chunk::stage_end));
    // In buffer space, the copies are exactly the fused intervals: merging touching copies
    // gives the covered runs, and a run is packed exactly when it is below the threshold.
    in_buffer.sort_unstable();
    let runs = covered_runs(requests.iter().copied());
    if fused == Fused::Consecutive {
        // Copies are disjoint and cover exactly the requested bytes; the counts are the
        // plan's own (what is joined depends on the request order).
        let mut merged: Vec<(BufferKey, u64, u64)> = Vec::new();
        for &(b, o, l, _) in &in_buffer {
            match merged.last_mut() {
                Some(last) if last.0 == b && o <= last.2 => {
                    assert_eq!(o, last.2, "copies overlap in buffer {b}");
                    last.2 = o + l;
                }
                _ => merged.push((b, o, o + l)),
            }
        }
        assert_eq!(merged, runs, "copies vs covered runs");
        let moved = runs.iter().map(|r| r.2 - r.1).sum();
        let packed: Vec<_> = in_buffer.iter().filter(|c| c.3).collect();
        return (moved, usize::MAX, packed.iter().map(|c| c.2).sum(), packed.len());
    }
    let mut merged: Vec<(BufferKey, u64, u64, bool)> = Vec::new();
    for (b, o, l, packed) in in_buffer {
        match merged.last_mut() {
            Some(last) if last.0 == b && o <= last.2 => {
                assert_eq!(o, last.2, "copies overlap in buffer {b}");
                assert!(!packed && !last.3, "a packed interval touches another copy");
                last.2 = o + l;
            }
            _ => merged.push((b, o, o + l, packed)),
        }
    }
    assert_eq!(merged.len(), runs.len(), "intervals vs covered runs");
    for (m, r) in merged.iter().zip(&runs) {
        assert_eq!((m.0, m.1, m.2), *r);
        assert_eq!(m.3, r.2 - r.1 < threshold, "packed/direct split of {r:?}");
    }
    let moved: u64 = runs.iter().map(|r| r.2 - r.1).sum();
    let packed_runs: Vec<_> = merged.iter().filter(|m| m.3).collect();
    let packed_bytes = packed_runs.iter().map(|m| m.2 - m.1).sum();
    (moved, runs.len(), packed_bytes, packed_runs.len())
}

/// Checks an upload plan and carries it out on the model through a ring of staging buffers,
/// each as long as its chunk's `staging_len` (the executor with the least slack): fills into
/// the ring, the packed region through "device staging" and the scatter, direct pieces
/// straight to the buffers. Checks that every staged byte is filled exactly once, from the
/// write that owns it. `owners` is what [`apply_in_order`] returned for the same writes.
pub fn execute_upload(
    plan: &UploadPlan,
    writes: &[WriteRequest],
    cfg: &PlanConfig,
    buffers: &mut Buffers,
    owners: &HashMap<BufferKey, Vec<Option<u32>>>,
) {
    let moved = check_plan(plan.totals(), writes, cfg);
    assert_eq!(plan.is_empty(), moved == 0);

    // Fill: each staged byte remembers (write, source offset) and how often it was filled.
    // Each ring buffer holds just the chunk's `staging_len` bytes (at most the capacity), so
    // that a byte placed past it fails, and a config with huge chunks needs no huge buffers.
    let sized = |c: &Chunk| c.staging_len as usize;
    let mut ring: Vec<Vec<u8>> = plan.chunks.iter().map(|c| vec![0xA5; sized(c)]).collect();
    let mut source: Vec<Vec<Option<(u32, u64)>>> = plan.chunks.iter().map(|c| vec![None; sized(c)]).collect();
    let mut filled: Vec<Vec<u8>> = plan.chunks.iter().map(|c| vec![0; sized(c)]).collect();
    let mut previous_end = 0;
    for f in &plan.fills {
        let c = &plan.chunks[f.chunk as usize];
        assert!(f.len > 0);
        assert!(f.stage_offset >= previous_end, "fills out of order or overlapping");
        previous_end = f.stage_offset + f.len;
        assert!(f.stage_offset >= c.stage_start && previous_end <= c.stage_end(), "fill {f:?} outside chunk");
        let w = &writes[f.write as usize];
        assert!(f.src_offset + f.len <= w.len, "fill {f:?} reads past write {w:?}");
        let local = c.local_offset(f.stage_offset) as usize;
        for k in 0..f.len as usize {
            ring[f.chunk as usize][local + k] = data_byte(f.write as usize, f.src_offset + k as u64);
            source[f.chunk as usize][local + k] = Some((f.write, f.src_offset + k as u64));
            filled[f.chunk as usize][local + k] += 1;
        }
    }
    assert_eq!(plan.fills.iter().map(|f| f.len).sum::<u64>(), moved, "fills cover the intervals once");
    for i in 0..plan.chunks.len() {
        assert_eq!(
            plan.fills_of(i as u32).iter().map(|f| f.len).sum::<u64>(),
            plan.chunks[i].packed.iter().chain(&plan.chunks[i].direct).map(|c| c.len).sum::<u64>(),
        );
    }

    // Move: every byte a copy reads was filled exactly once, by its owning write.
    for (i, c) in plan.chunks.iter().enumerate() {
        let device_staging = &ring[i][..c.packed_len as usize];
        let region_start = c.local_offset(c.packed_offset) as usize;
        let direct = c
            .direct
            .iter()
            .map(|d| (c.local_offset(d.stage_offset) as usize, d.buffer, d.buffer_offset, d.len));
        let packed = c
            .packed_copies()
            .map(|p| (region_start + p.region_offset as usize, p.buffer, p.buffer_offset, p.len));
        for (local, buffer, buffer_offset, len) in packed.chain(direct) {
            let owner = &owners[&buffer];
            for k in 0..len as usize {
                assert_eq!(filled[i][local + k], 1, "staging byte filled {} times", filled[i][local + k]);
                let pos = buffer_offset + k as u64;
                let want = owner[pos as usize].expect("a copied byte is written by some write");
                let src = pos - writes[want as usize].offset;
                assert_eq!(source[i][local + k], Some((want, src)), "byte {pos} of buffer {buffer}");
            }
        }
        for p in c.packed_copies() {
            let bytes = &device_staging[p.region_offset as usize..][..p.len as usize];
            buffers.get_mut(&p.buffer).unwrap()[p.buffer_offset as usize..][..p.len as usize]
                .copy_from_slice(bytes);
        }
        for d in &c.direct {
            let bytes = &ring[i][c.local_offset(d.stage_offset) as usize..][..d.len as usize];
            buffers.get_mut(&d.buffer).unwrap()[d.buffer_offset as usize..][..d.len as usize]
                .copy_from_slice(bytes);
        }
    }
}

/// Checks a download plan and carries it out on the model into one flat staging region:
/// gather into "device staging" and one DMA of the packed region, direct pieces straight
/// from the buffers. Then every view must show exactly its read's bytes.
pub fn execute_download(plan: &DownloadPlan, reads: &[ReadRequest], cfg: &PlanConfig, buffers: &Buffers) {
    check_plan(plan.totals(), reads, cfg);
    assert_eq!(plan.views.len(), reads.len());

    let mut staging = vec![0x5Au8; plan.total_staging as usize];
    let mut written = vec![false; plan.total_staging as usize];
    for c in &plan.chunks {
        let mut device_staging = vec![0u8; c.packed_len as usize];
        for p in c.packed_copies() {
            let src = &buffers[&p.buffer][p.buffer_offset as usize..][..p.len as usize];
            device_staging[p.region_offset as usize..][..p.len as usize].copy_from_slice(src);
            written[(c.packed_offset + p.region_offset) as usize..][..p.len as usize].fill(true);
        }
        staging[c.packed_offset as usize..][..c.packed_len as usize].copy_from_slice(&device_staging);
        for d in &c.direct {
            let src = &buffers[&d.buffer][d.buffer_offset as usize..][..d.len as usize];
            staging[d.stage_offset as usize..][..d.len as usize].copy_from_slice(src);
            written[d.stage_offset as usize..][..d.len as usize].fill(true);
        }
    }
    for (r, v) in reads.iter().zip(&plan.views) {
        assert_eq!(v.len, r.len);
        if r.len == 0 {
            continue;
        }
        assert_eq!(v.chunk as u64, v.stage_offset / plan.chunk_capacity);
        assert_eq!(v.last_chunk as u64, (v.stage_end() - 1) / plan.chunk_capacity);
        assert!(v.stage_end() <= plan.chunks[v.last_chunk as usize].stage_end());
        let range = v.stage_offset as usize..v.stage_end() as usize;
        assert!(written[range.clone()].iter().all(|&w| w), "view {v:?} shows bytes no copy wrote");
        assert_eq!(&staging[range], &buffers[&r.buffer][r.offset as usize..][..r.len as usize], "read {r:?}");
    }
}

/// Lays `writes` out as the paths that skip the planner do (`plan::route::Apart`, each write's
/// destination taken at a 256-byte-aligned buffer address, as the allocator places them), cuts
/// the layout into chunks of at most `chunk_bytes` (at least 64 KiB; `grow`: growing from
/// 64 KiB, as small uploads over the bus do) and carries it out on the model: every write's
/// bytes into its chunk's staging, then scattered. Returns `None` when the layout is broken
/// (the batch goes to the planner), which must be exactly when a write is empty, longer than a
/// kernel segment or not past the previous write into its buffer with a gap; otherwise checks
/// that the chunks cover the writes in order within their budgets, that each write keeps its
/// destination's residue modulo 16 and no two share staging (so a gather into the same layout
/// gives each read its own bytes), and returns the buffers after the scatter. Every write
/// must lie inside a modelled buffer.
pub fn execute_in_order(
    writes: &[WriteRequest],
    buffers: &Buffers,
    chunk_bytes: u64,
    grow: bool,
) -> Option<Buffers> {
    use super::route::{Apart, cut_apart, growing};
    const SEGMENT: u64 = crate::kernels::SEGMENT;
    let mut apart = Apart::default();
    let mut next: HashMap<BufferKey, u64> = HashMap::new();
    let mut ends: HashMap<BufferKey, u64> = HashMap::new();
    let mut rule_holds = true;
    for w in writes {
        let end = ends.get(&w.buffer).copied();
        rule_holds &= w.len > 0 && w.len <= SEGMENT && end.is_none_or(|end| w.offset > end);
        ends.insert(w.buffer, w.offset + w.len);
        apart.note(next.entry(w.buffer).or_insert(0), 0, w.offset, w.len);
    }
    assert_eq!(apart.broken, !rule_holds, "the layout is broken exactly when the rule fails");
    if apart.broken {
        return None;
    }
    assert_eq!(apart.offsets.len(), writes.len());
    assert_eq!(apart.requested, writes.iter().map(|w| w.len).sum::<u64>());
    assert_eq!(apart.longest, writes.iter().map(|w| w.len).max().unwrap_or(0));
    let most = chunk_bytes.max(64 << 10);
    let budget = |k: usize| if grow { growing(64 << 10, most)(k) } else { most };
    let mut spans = Vec::new();
    cut_apart(&apart.offsets, |i| writes[i].len, budget, &mut spans);
    let mut out = buffers.clone();
    let mut covered = 0;
    for (k, span) in spans.iter().enumerate() {
        assert_eq!(span.requests.start, covered, "chunks cover the writes in order");
        assert!(!span.requests.is_empty());
        covered = span.requests.end;
        assert_eq!(span.start % 16, 0);
        let area = crate::kernels::table_bytes(span.requests.len() as u64);
        assert!(area + span.len <= budget(k), "chunk {k} fits its budget");
        let mut staging = vec![None::<u8>; span.len as usize];
        for i in span.requests.clone() {
            let (w, at) = (&writes[i], apart.offsets[i]);
            assert!(at >= span.start && at + w.len - span.start <= span.len, "write {i} inside its chunk");
            assert_eq!(at % 16, w.offset % 16, "write {i} keeps its destination's residue");
            for p in 0..w.len {
                let slot = &mut staging[(at - span.start + p) as usize];
                assert!(slot.is_none(), "write {i} shares staging with another");
                *slot = Some(data_byte(i, p));
            }
        }
        for i in span.requests.clone() {
            let (w, at) = (&writes[i], (apart.offsets[i] - span.start) as usize);
            let bytes = out.get_mut(&w.buffer).expect("write to a modelled buffer");
            for p in 0..w.len as usize {
                bytes[w.offset as usize + p] = staging[at + p].expect("staged");
            }
        }
    }
    assert_eq!(covered, writes.len(), "every write in a chunk");
    Some(out)
}

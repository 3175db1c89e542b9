//! Property tests: random batches (overlaps, touching ranges, duplicates, zero lengths,
//! several buffers, small chunks so that direct intervals split) planned and executed on the
//! byte model of `check`, which must match applying the requests directly.

use proptest::prelude::*;

use super::check::{
    RunItem, apply_in_order, check_parts, execute_download, execute_in_order, execute_runs, execute_upload,
    initial_buffers,
};
use super::*;

/// Buffer keys spread over `u64`, so that ordering by key is exercised at the extremes.
const KEYS: [BufferKey; 6] = [7, u64::MAX, 0, 3, 1 << 40, 5];

/// A request before it is fitted to its buffer: which buffer, two raw numbers for offset and
/// length, and whether to snap both to a grid of 32 bytes (which makes exact duplicates and
/// touching ranges common).
type RawRequest = (usize, u64, u64, bool);

/// A small config: chunks of at most a few hundred bytes, so that requests of up to a few
/// chunks split, thresholds on both sides of the chunk capacity, every alignment up to 32.
fn config() -> impl Strategy<Value = PlanConfig> {
    (0u32..6, 1u64..=256, 0u64..=320).prop_map(|(shift, chunk, threshold)| {
        let align = 1 << shift;
        PlanConfig { direct_threshold: threshold, chunk_bytes: chunk.max(align), align }
    })
}

fn batch() -> impl Strategy<Value = (PlanConfig, Vec<u64>, Vec<RawRequest>)> {
    let lens = prop::collection::vec(0u64..=700, 1..=KEYS.len());
    let requests =
        prop::collection::vec((0usize..KEYS.len(), any::<u64>(), any::<u64>(), any::<bool>()), 0..=48);
    (config(), lens, requests)
}

/// Fits raw requests to the buffers: every request valid, lengths up to the whole buffer.
fn fit(lens: &[u64], raw: &[RawRequest]) -> Vec<(BufferKey, u64, u64, u64)> {
    raw.iter()
        .map(|&(b, x, y, grid)| {
            let b = b % lens.len();
            let len = lens[b];
            let mut offset = x % (len + 1);
            let mut n = y % (len - offset + 1);
            if grid {
                offset -= offset % 32;
                n -= n % 32;
            }
            (KEYS[b], len, offset, n)
        })
        .collect()
}

fn buffer_lens(lens: &[u64]) -> Vec<(BufferKey, u64)> {
    KEYS.iter().copied().zip(lens.iter().copied()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Executing an upload plan gives the same buffers as applying the writes in order, and
    /// every structural promise of the plan holds (see `check::execute_upload`).
    #[test]
    fn upload_plans_match_writing_in_order((cfg, lens, raw) in batch()) {
        let writes: Vec<_> = fit(&lens, &raw)
            .into_iter()
            .map(|(buffer, buffer_len, offset, len)| WriteRequest { buffer, buffer_len, offset, len })
            .collect();
        let plan = plan_upload(&writes, &cfg).expect("valid batch");
        let mut expected = initial_buffers(&buffer_lens(&lens));
        let owners = apply_in_order(&mut expected, &writes);
        let mut actual = initial_buffers(&buffer_lens(&lens));
        execute_upload(&plan, &writes, &cfg, &mut actual, &owners);
        prop_assert_eq!(actual, expected);
    }

    /// Every read's view shows exactly its bytes after the download plan is executed.
    #[test]
    fn download_views_show_the_requested_bytes((cfg, lens, raw) in batch()) {
        let reads: Vec<_> = fit(&lens, &raw)
            .into_iter()
            .map(|(buffer, buffer_len, offset, len)| ReadRequest { buffer, buffer_len, offset, len })
            .collect();
        let plan = plan_download(&reads, &cfg).expect("valid batch");
        execute_download(&plan, &reads, &cfg, &initial_buffers(&buffer_lens(&lens)));
    }

    /// A batch with bad requests fails with the index of the first one, whatever follows it,
    /// and one without succeeds. Offsets and lengths here are arbitrary `u64`s, so sums
    /// overflow too.
    #[test]
    fn the_first_bad_request_fails_the_batch(
        requests in prop::collection::vec((0u64..4, any::<u64>(), any::<u64>(), 0u8..4), 0..=24),
    ) {
        let writes: Vec<_> = requests
            .iter()
            .map(|&(buffer, a, b, kind)| {
                // Mostly small in-range requests; sometimes arbitrary numbers.
                let (buffer_len, offset, len) = match kind {
                    0 => (a, b, a ^ b),
                    _ => (1000, a % 1100, b % 100),
                };
                WriteRequest { buffer, buffer_len, offset, len }
            })
            .collect();
        let first_bad = writes
            .iter()
            .position(|w| w.offset.checked_add(w.len).is_none_or(|end| end > w.buffer_len));
        let cfg = PlanConfig { chunk_bytes: 1 << 62, ..PlanConfig::default() };
        match (plan_upload(&writes, &cfg), first_bad) {
            (Err(PlanError::OutOfRange { index, .. }), Some(bad)) => prop_assert_eq!(index, bad),
            (Ok(_), None) | (Err(PlanError::TooLarge { .. }), None) => {}
            (other, bad) => prop_assert!(false, "{:?} for first bad {:?}", other.map(|p| p.moved_bytes), bad),
        }
        let reads: Vec<_> =
            writes.iter().map(|w| ReadRequest { buffer: w.buffer, buffer_len: w.buffer_len, offset: w.offset, len: w.len }).collect();
        match (plan_download(&reads, &cfg), first_bad) {
            (Err(PlanError::OutOfRange { index, .. }), Some(bad)) => prop_assert_eq!(index, bad),
            (Ok(_), None) | (Err(PlanError::TooLarge { .. }), None) => {}
            (other, bad) => prop_assert!(false, "{:?} for first bad {:?}", other.map(|p| p.moved_bytes), bad),
        }
    }

    /// Batches in order (each request at or after the end of the previous one of its buffer,
    /// buffers interleaved, empty requests anywhere) planned without the sort: the plans
    /// execute to the same bytes, and a bad request fails the same way.
    #[test]
    fn in_order_batches_plan_without_sorting((cfg, lens, raw) in batch(), bad in any::<Option<u8>>()) {
        // Buffer keys 0..6 (dense, as the transfer layer's are): the in-order path applies.
        let small_lens: Vec<(BufferKey, u64)> = (0u64..).zip(lens.iter().copied()).collect();
        let mut ends = std::collections::HashMap::new();
        let mut fitted: Vec<_> = fit(&lens, &raw)
            .into_iter()
            .map(|(key, len, offset, n)| (KEYS.iter().position(|&k| k == key).unwrap() as u64, len, offset, n))
            .filter(|&(buffer, _, offset, len)| {
                let end = ends.entry(buffer).or_insert(0u64);
                let keep = len == 0 || offset >= *end;
                if keep && len > 0 {
                    *end = offset + len;
                }
                keep
            })
            .collect();
        let mut planner = Planner::new();
        if let Some(at) = bad.filter(|_| !fitted.is_empty()) {
            let at = at as usize % fitted.len();
            fitted[at].3 = fitted[at].1 + 1; // one byte past the end
            let writes: Vec<_> = fitted.iter().map(|&(buffer, buffer_len, offset, len)| WriteRequest { buffer, buffer_len, offset, len }).collect();
            let mut plan = UploadPlan::default();
            let err = planner.plan_upload_into(&writes, &cfg, &mut plan).unwrap_err();
            let first_bad = writes.iter().position(|w| w.offset + w.len > w.buffer_len).unwrap();
            prop_assert!(matches!(err, PlanError::OutOfRange { index, .. } if index == first_bad), "{err}");
            prop_assert!(plan.is_empty());
            return Ok(());
        }
        let writes: Vec<_> = fitted.iter().map(|&(buffer, buffer_len, offset, len)| WriteRequest { buffer, buffer_len, offset, len }).collect();
        let mut plan = UploadPlan::default();
        planner.plan_upload_into(&writes, &cfg, &mut plan).expect("valid batch");
        prop_assert_eq!(plan.moved_bytes, plan.requested_bytes, "no overlaps: each byte moves once");
        let mut expected = initial_buffers(&small_lens);
        let owners = apply_in_order(&mut expected, &writes);
        let mut actual = initial_buffers(&small_lens);
        execute_upload(&plan, &writes, &cfg, &mut actual, &owners);
        prop_assert_eq!(actual, expected);

        let reads: Vec<_> = fitted.iter().map(|&(buffer, buffer_len, offset, len)| ReadRequest { buffer, buffer_len, offset, len }).collect();
        let mut plan = DownloadPlan::default();
        planner.plan_download_into(&reads, &cfg, &mut plan).expect("valid batch");
        execute_download(&plan, &reads, &cfg, &initial_buffers(&small_lens));
    }

    /// Any config either plans or is rejected with a config error; never a panic.
    #[test]
    fn any_config_plans_or_is_rejected(threshold in any::<u64>(), chunk in any::<u64>(), align in any::<u64>()) {
        let cfg = PlanConfig { direct_threshold: threshold, chunk_bytes: chunk, align };
        let writes = [WriteRequest { buffer: 1, buffer_len: 4096, offset: 100, len: 3000 }];
        match plan_upload(&writes, &cfg) {
            Ok(plan) => prop_assert_eq!(plan.moved_bytes, 3000),
            Err(PlanError::InvalidAlign { .. } | PlanError::ChunkTooSmall { .. } | PlanError::TooLarge { .. }) => {}
            Err(e) => prop_assert!(false, "unexpected {e}"),
        }
    }
}

/// A request of the in-order fast path: buffer (0..4), the gap before it in its buffer, its
/// length class and raw length.
type InOrderRaw = (u64, u64, u8, u64);

fn in_order_batch() -> impl Strategy<Value = (Vec<InOrderRaw>, u64, bool)> {
    let request = (0u64..4, 0u64..40, 0u8..40, any::<u64>());
    (prop::collection::vec(request, 0..=64), 0u64..3, any::<bool>())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    /// The layout of the paths that skip the planner ([`route::Apart`], cut by
    /// [`route::cut_apart`]) against the byte model (`check::execute_in_order`): broken
    /// exactly when the rule fails, else every promise of the layout holds and scattering it
    /// gives the buffers that writing in order gives.
    #[test]
    fn in_order_layouts_move_the_bytes_of_writing_in_order((raw, chunk_class, grow) in in_order_batch()) {
        const SEGMENT: u64 = crate::kernels::SEGMENT;
        let mut ends = [0u64; 4];
        let mut writes = Vec::new();
        for &(buffer, gap, class, x) in &raw {
            let len = match class {
                0 => 0,
                1 => SEGMENT + 1 + x % 100,
                2..=9 => 1 + x % SEGMENT,
                _ => 1 + x % 64,
            };
            let offset = ends[buffer as usize] + gap;
            ends[buffer as usize] = offset + len;
            writes.push(WriteRequest { buffer, buffer_len: 0, offset, len });
        }
        let lens: Vec<(BufferKey, u64)> = (0u64..4).map(|b| (b, ends[b as usize] + 64)).collect();
        for w in &mut writes {
            w.buffer_len = lens[w.buffer as usize].1;
        }
        let most = [64u64 << 10, 1 << 20, 4 << 20][chunk_class as usize];
        let before = initial_buffers(&lens);
        if let Some(actual) = execute_in_order(&writes, &before, most, grow) {
            let mut expected = before;
            apply_in_order(&mut expected, &writes);
            prop_assert_eq!(actual, expected);
        }
    }

    /// The route of a batch follows its shape: one small write from a slice moves alone,
    /// writes made in place move in place, many small writes in order and apart take the
    /// in-order path, everything else the planner; downloads alike.
    #[test]
    fn routes_follow_the_shape_of_the_batch(
        writes in 0usize..200,
        single in prop::option::of(0u64..1000),
        in_place in any::<bool>(),
        slice_writes in 0usize..3,
        broken in any::<bool>(),
        longest in 0u64..1000,
        threshold in 1u64..1000,
    ) {
        use route::{Apart, Route, UploadShape, download_route, upload_route};
        let apart = Apart { broken, longest, ..Apart::default() };
        let shape = UploadShape { writes, single_slice: single, in_place, slice_writes, apart: &apart, direct_threshold: threshold };
        let expected = if single.is_some_and(|len| len > 0 && len < threshold) {
            Route::One
        } else if in_place && slice_writes == 0 {
            Route::InPlace
        } else if !in_place && writes >= route::IN_ORDER_MIN && !broken && longest < threshold {
            Route::InOrder
        } else {
            Route::Planned
        };
        prop_assert_eq!(upload_route(&shape), expected);
        let read = if writes >= route::IN_ORDER_MIN && !broken && longest < threshold { Route::InOrder } else { Route::Planned };
        prop_assert_eq!(download_route(writes, &apart, threshold), read);
    }
}

/// Items of a scoped batch in pinned memory: a length class and raw length, whether a gap
/// of host memory comes before the item, whether it opens a new region and whether that is
/// mapped for the device.
type RunRaw = (u8, u64, bool, bool, bool);

fn run_items(raw: &[RunRaw], scale: u8) -> Vec<RunItem> {
    raw.iter()
        .map(|&(class, x, gap, new_region, mapped)| {
            let len = match (class, scale) {
                (0, _) => 0,
                (1..=3, _) => 1 + x % 64,
                (_, 0) => 1 + x % 4096,
                (_, 1) => 1 + x % (64 << 10),
                _ => {
                    [runs::RUN_MIN / 2, runs::RUN_MIN - 1, runs::RUN_MIN, 1 + x % (300 << 10)][x as usize % 4]
                }
            };
            RunItem { len, gap: if gap { 1 + x % 4096 } else { 0 }, new_region, mapped }
        })
        .collect()
}

/// A run item: mostly no gap and no new region, so that runs form.
fn run_raw() -> impl Strategy<Value = RunRaw> {
    (0u8..10, any::<u64>(), prop::bool::weighted(0.1), prop::bool::weighted(0.05), prop::bool::weighted(0.8))
}

const RUN_CHUNKS: [u64; 6] = [64 << 10, 1 << 20, 7777, 300 << 10, 4 << 20, 1];

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// The runs layout of scoped batches (`runs::Layout`) carried out on the byte model
    /// (`check::execute_runs`): every byte of every item moved exactly once to its place,
    /// nothing else written, chunks and launches within their limits, whatever the items,
    /// chunk size, threshold and GPU.
    #[test]
    fn runs_layouts_move_every_byte_of_every_item_once(
        raw in prop::collection::vec(run_raw(), 0..=32),
        scale in 0u8..3,
        chunk in 0usize..RUN_CHUNKS.len(),
        threshold in prop_oneof![1u64..1024, 1u64..(2 << 20)],
        own_dma in prop_oneof![Just(u64::MAX), 1u64..(4 << 20)],
        unified in prop::bool::weighted(0.8),
        bus in any::<bool>(),
        upload in any::<bool>(),
    ) {
        let sizes = (RUN_CHUNKS[chunk], threshold, own_dma);
        execute_runs(&run_items(&raw, scale), sizes, unified, bus, upload);
    }

    /// The parts of a scoped batch (`runs::parts`, `runs::first_part`) against their rule
    /// (`check::check_parts`): in order, covering every item, each cut the first its rule
    /// allows and never leaving a piece of a run shorter than a run.
    #[test]
    fn parts_cover_the_items_in_order_and_cut_where_the_rule_allows(
        raw in prop::collection::vec(run_raw(), 0..=3000),
        scale in 0u8..3,
        chunk in 0usize..RUN_CHUNKS.len(),
        moved in 0usize..3,
    ) {
        check_parts(&run_items(&raw, scale), RUN_CHUNKS[chunk], moved);
    }
}

//! Edge cases of the planner, each checked in full by the model executors of `check`.

use super::check::{apply_in_order, execute_download, execute_upload, initial_buffers};
use super::*;

fn w(buffer: BufferKey, buffer_len: u64, offset: u64, len: u64) -> WriteRequest {
    WriteRequest { buffer, buffer_len, offset, len }
}

fn r(buffer: BufferKey, buffer_len: u64, offset: u64, len: u64) -> ReadRequest {
    ReadRequest { buffer, buffer_len, offset, len }
}

fn cfg(direct_threshold: u64, chunk_bytes: u64, align: u64) -> PlanConfig {
    PlanConfig { direct_threshold, chunk_bytes, align }
}

/// Plans the writes, executes the plan on a model and compares it with writing in order.
fn upload_checked(writes: &[WriteRequest], cfg: &PlanConfig) -> UploadPlan {
    let plan = plan_upload(writes, cfg).expect("plan");
    let mut lens: Vec<(BufferKey, u64)> = writes.iter().map(|w| (w.buffer, w.buffer_len)).collect();
    lens.dedup();
    let mut expected = initial_buffers(&lens);
    let owners = apply_in_order(&mut expected, writes);
    let mut actual = initial_buffers(&lens);
    execute_upload(&plan, writes, cfg, &mut actual, &owners);
    assert_eq!(actual, expected);
    plan
}

/// Plans the reads and checks every view against a model.
fn download_checked(reads: &[ReadRequest], cfg: &PlanConfig) -> DownloadPlan {
    let plan = plan_download(reads, cfg).expect("plan");
    let lens: Vec<(BufferKey, u64)> = reads.iter().map(|r| (r.buffer, r.buffer_len)).collect();
    execute_download(&plan, reads, cfg, &initial_buffers(&lens));
    plan
}

fn fills(plan: &UploadPlan) -> Vec<(u64, u32, u64, u64)> {
    plan.fills.iter().map(|f| (f.stage_offset, f.write, f.src_offset, f.len)).collect()
}

#[test]
fn default_config_matches_the_design() {
    let c = PlanConfig::default();
    assert_eq!((c.direct_threshold, c.chunk_bytes, c.align), (256 << 10, 8 << 20, 16));
    assert_eq!(c.chunk_capacity(), Ok(8 << 20));
}

#[test]
fn empty_batch_plans_nothing() {
    let up = plan_upload(&[], &PlanConfig::default()).unwrap();
    assert!(up.is_empty() && up.fills.is_empty() && up.total_staging == 0 && up.intervals == 0);
    assert_eq!(up.chunk_capacity, 8 << 20);
    let down = plan_download(&[], &PlanConfig::default()).unwrap();
    assert!(down.is_empty() && down.views.is_empty() && down.total_staging == 0);
}

#[test]
fn zero_length_requests_are_valid_and_move_nothing() {
    let writes = [w(1, 100, 0, 0), w(1, 100, 100, 0), w(2, 0, 0, 0)];
    let plan = upload_checked(&writes, &PlanConfig::default());
    assert!(plan.is_empty() && plan.fills.is_empty());
    assert_eq!((plan.requested_bytes, plan.moved_bytes), (0, 0));
    let reads = [r(1, 100, 100, 0), r(1, 100, 5, 10)];
    let plan = download_checked(&reads, &PlanConfig::default());
    assert_eq!(plan.views[0], ReadView::default());
    assert_eq!(plan.views[1].len, 10);
}

#[test]
fn zero_length_request_past_the_end_is_out_of_range() {
    let err = plan_upload(&[w(1, 100, 101, 0)], &PlanConfig::default()).unwrap_err();
    assert_eq!(err, PlanError::OutOfRange { index: 0, buffer: 1, offset: 101, len: 0, buffer_len: 100 });
}

#[test]
fn touching_writes_fuse_into_one_interval() {
    let plan = upload_checked(&[w(1, 100, 10, 10), w(1, 100, 0, 10), w(1, 100, 20, 5)], &cfg(64, 256, 16));
    assert_eq!(plan.intervals, 1);
    assert_eq!(plan.chunks.len(), 1);
    let c = &plan.chunks[0];
    assert_eq!(c.packed, vec![Copy { stage_offset: 0, buffer: 1, buffer_offset: 0, len: 25 }]);
    assert_eq!(fills(&plan), vec![(0, 1, 0, 10), (10, 0, 0, 10), (20, 2, 0, 5)]);
}

#[test]
fn a_gap_of_one_byte_keeps_intervals_apart() {
    let plan = upload_checked(&[w(1, 100, 0, 10), w(1, 100, 11, 10)], &cfg(64, 256, 16));
    assert_eq!(plan.intervals, 2);
    let offsets: Vec<_> = plan.chunks[0].packed.iter().map(|c| (c.stage_offset, c.buffer_offset)).collect();
    assert_eq!(offsets, vec![(0, 0), (16, 11)]);
}

#[test]
fn same_range_of_different_buffers_does_not_fuse() {
    // Out of order (buffer 2's second write comes first): sorted, fused, laid out by buffer.
    let plan = upload_checked(&[w(2, 100, 10, 10), w(1, 100, 0, 10), w(2, 100, 0, 10)], &cfg(64, 256, 16));
    assert_eq!(plan.intervals, 2);
    let order: Vec<_> = plan.chunks[0].packed.iter().map(|c| (c.buffer, c.len)).collect();
    assert_eq!(order, vec![(1, 10), (2, 20)], "intervals are laid out by buffer, then offset");
}

#[test]
fn a_batch_in_order_is_laid_out_in_request_order_without_a_sort() {
    // Each write at or after the end of the previous one of its buffer: no sort, and only
    // consecutive writes of one buffer join (here none are consecutive).
    let plan = upload_checked(&[w(2, 100, 0, 10), w(1, 100, 0, 10), w(2, 100, 10, 10)], &cfg(64, 256, 16));
    assert_eq!(plan.intervals, 3);
    let order: Vec<_> = plan.chunks[0].packed.iter().map(|c| (c.buffer, c.buffer_offset, c.len)).collect();
    assert_eq!(order, vec![(2, 0, 10), (1, 0, 10), (2, 10, 10)], "request order");
    // Consecutive touching writes of one buffer do join.
    let plan = upload_checked(&[w(2, 100, 0, 10), w(2, 100, 10, 10), w(1, 100, 0, 10)], &cfg(64, 256, 16));
    assert_eq!(plan.intervals, 2);
    // Keys far from dense (past the batch's length + 64) take the sorted path.
    let plan =
        upload_checked(&[w(900, 100, 0, 10), w(1, 100, 0, 10), w(900, 100, 10, 10)], &cfg(64, 256, 16));
    assert_eq!(plan.intervals, 2);
}

#[test]
fn duplicate_writes_take_the_last_one() {
    let plan = upload_checked(&[w(1, 64, 8, 16), w(1, 64, 8, 16), w(1, 64, 8, 16)], &cfg(64, 256, 16));
    assert_eq!(fills(&plan), vec![(0, 2, 0, 16)]);
    assert_eq!((plan.requested_bytes, plan.moved_bytes), (48, 16));
}

#[test]
fn a_later_write_inside_an_earlier_one_wins_its_bytes() {
    let plan = upload_checked(&[w(1, 100, 0, 50), w(1, 100, 10, 5)], &cfg(64, 256, 16));
    assert_eq!(fills(&plan), vec![(0, 0, 0, 10), (10, 1, 0, 5), (15, 0, 15, 35)]);
}

#[test]
fn an_earlier_write_inside_a_later_one_is_not_staged() {
    let plan = upload_checked(&[w(1, 100, 10, 5), w(1, 100, 0, 50)], &cfg(64, 256, 16));
    assert_eq!(fills(&plan), vec![(0, 1, 0, 50)]);
}

#[test]
fn layered_overlaps_resolve_by_write_order() {
    // Staircase: each write starts later and is later, plus an early long one underneath.
    let writes =
        [w(1, 200, 0, 100), w(1, 200, 20, 30), w(1, 200, 40, 30), w(1, 200, 60, 30), w(1, 200, 150, 10)];
    let plan = upload_checked(&writes, &cfg(1000, 4096, 8));
    assert_eq!(plan.intervals, 2);
    assert_eq!(
        fills(&plan),
        vec![(0, 0, 0, 20), (20, 1, 0, 20), (40, 2, 0, 20), (60, 3, 0, 30), (90, 0, 90, 10), (104, 4, 0, 10)]
    );
}

#[test]
fn writes_at_the_very_end_of_a_buffer() {
    let max = u64::MAX;
    let writes = [w(1, 100, 95, 5), w(7, max, max - 3, 3)];
    let plan = plan_upload(&writes, &cfg(64, 256, 16)).unwrap();
    assert_eq!(plan.intervals, 2);
    let packed: Vec<_> = plan.chunks[0].packed.iter().map(|c| (c.buffer, c.buffer_offset, c.len)).collect();
    assert_eq!(packed, vec![(1, 95, 5), (7, max - 3, 3)]);
    let reads = [r(7, max, max - 3, 3), r(7, max, max - 1, 1)];
    let plan = plan_download(&reads, &cfg(64, 256, 16)).unwrap();
    assert_eq!(plan.views[1].stage_offset, 2);
}

#[test]
fn offset_plus_len_overflow_is_out_of_range() {
    let err = plan_upload(&[w(1, u64::MAX, u64::MAX, 1)], &PlanConfig::default()).unwrap_err();
    assert!(matches!(err, PlanError::OutOfRange { index: 0, offset: u64::MAX, len: 1, .. }));
    let err = plan_download(&[r(1, u64::MAX, 2, u64::MAX - 1)], &PlanConfig::default()).unwrap_err();
    assert!(matches!(err, PlanError::OutOfRange { index: 0, .. }));
}

#[test]
fn the_first_bad_request_is_reported() {
    let writes = [w(1, 100, 0, 10), w(2, 50, 40, 10), w(2, 50, 41, 10), w(3, 10, 20, 0)];
    let err = plan_upload(&writes, &PlanConfig::default()).unwrap_err();
    assert_eq!(err, PlanError::OutOfRange { index: 2, buffer: 2, offset: 41, len: 10, buffer_len: 50 });
    let reads = [r(1, 100, 0, 10), r(3, 10, 20, 0), r(2, 50, 41, 10)];
    let err = plan_download(&reads, &PlanConfig::default()).unwrap_err();
    assert!(matches!(err, PlanError::OutOfRange { index: 1, buffer: 3, .. }));
}

#[test]
fn an_interval_at_the_threshold_is_direct_and_one_below_is_packed() {
    let c = cfg(100, 1024, 16);
    let plan = upload_checked(&[w(1, 1000, 0, 100), w(2, 1000, 0, 99)], &c);
    assert_eq!(plan.chunks.len(), 1);
    let chunk = &plan.chunks[0];
    assert_eq!(chunk.packed, vec![Copy { stage_offset: 0, buffer: 2, buffer_offset: 0, len: 99 }]);
    assert_eq!(chunk.direct, vec![Copy { stage_offset: 112, buffer: 1, buffer_offset: 0, len: 100 }]);
    assert_eq!((chunk.packed_len, chunk.staging_len), (99, 212));
    assert_eq!((plan.packed_intervals, plan.packed_bytes), (1, 99));
    // Two packed writes that touch make an interval at the threshold: direct.
    let plan = upload_checked(&[w(1, 1000, 0, 60), w(1, 1000, 60, 40)], &c);
    assert!(plan.chunks[0].packed.is_empty());
    assert_eq!(plan.chunks[0].direct.len(), 1);
}

#[test]
fn a_direct_interval_larger_than_several_chunks_is_split_contiguously() {
    let c = cfg(16, 64, 16);
    let writes = [w(9, 1000, 3, 200), w(9, 1000, 500, 10)];
    let plan = upload_checked(&writes, &c);
    let pieces: Vec<_> = plan
        .chunks
        .iter()
        .flat_map(|c| c.direct.iter().map(|d| (d.stage_offset, d.buffer_offset, d.len)))
        .collect();
    // The packed 10-byte interval takes [0, 10); the direct one starts at 16 and runs on.
    assert_eq!(plan.chunks[0].packed.len(), 1);
    assert_eq!(pieces, vec![(16, 3, 48), (64, 51, 64), (128, 115, 64), (192, 179, 24)]);
    assert_eq!(plan.chunks.iter().map(|c| c.staging_len).collect::<Vec<_>>(), vec![64, 64, 64, 24]);
    assert_eq!(plan.total_staging, 216);
    // Fills are cut at chunk boundaries so that a ring of chunk buffers works.
    assert!(plan.fills.iter().all(|f| f.stage_offset / 64 == (f.stage_offset + f.len - 1) / 64));
    assert_eq!(plan.fills_of(1), &[Fill { chunk: 1, stage_offset: 64, write: 0, src_offset: 48, len: 64 }]);
    assert!(plan.fills_of(7).is_empty());

    let reads = [r(9, 1000, 3, 200), r(9, 1000, 60, 10), r(9, 1000, 500, 10)];
    let plan = download_checked(&reads, &c);
    assert_eq!(plan.views[0], ReadView { chunk: 0, last_chunk: 3, stage_offset: 16, len: 200 });
    assert_eq!(plan.views[1], ReadView { chunk: 1, last_chunk: 1, stage_offset: 73, len: 10 });
    assert_eq!(plan.views[2], ReadView { chunk: 0, last_chunk: 0, stage_offset: 0, len: 10 });
}

#[test]
fn packed_intervals_are_aligned_with_padding_counted() {
    let writes: Vec<_> = (0..5).map(|i| w(1, 1000, i * 100, 5)).collect();
    let plan = upload_checked(&writes, &cfg(64, 256, 16));
    let c = &plan.chunks[0];
    assert_eq!(c.packed.iter().map(|p| p.stage_offset).collect::<Vec<_>>(), vec![0, 16, 32, 48, 64]);
    assert_eq!((c.packed_len, c.staging_len), (69, 69));
    let rel: Vec<_> = c.packed_copies().map(|p| p.region_offset).collect();
    assert_eq!(rel, vec![0, 16, 32, 48, 64]);
}

#[test]
fn a_packed_interval_that_does_not_fit_starts_the_next_chunk() {
    // Capacity 64: 40 bytes fit, the next 40 would not, so they open chunk 1; the direct
    // interval then follows the packed one in chunk 1 and spills into chunk 2.
    let writes = [w(1, 1000, 0, 40), w(1, 1000, 100, 40), w(2, 1000, 0, 70)];
    let plan = upload_checked(&writes, &cfg(50, 64, 8));
    assert_eq!(plan.chunks.len(), 3);
    assert_eq!(plan.chunks[0].staging_len, 40);
    assert_eq!(plan.chunks[1].packed[0].stage_offset, 64);
    assert_eq!(plan.chunks[1].direct[0], Copy { stage_offset: 104, buffer: 2, buffer_offset: 0, len: 24 });
    assert_eq!(plan.chunks[2].direct[0], Copy { stage_offset: 128, buffer: 2, buffer_offset: 24, len: 46 });
    assert!(plan.chunks[2].packed.is_empty() && plan.chunks[2].packed_len == 0);
}

#[test]
fn packed_intervals_that_fill_a_chunk_exactly_stay_in_it() {
    let writes = [w(1, 1000, 0, 32), w(1, 1000, 100, 32), w(1, 1000, 200, 32)];
    let plan = upload_checked(&writes, &cfg(40, 64, 16));
    assert_eq!(plan.chunks.iter().map(|c| c.packed.len()).collect::<Vec<_>>(), vec![2, 1]);
    assert_eq!((plan.chunks[0].staging_len, plan.chunks[1].stage_start), (64, 64));
}

#[test]
fn requests_already_in_order_plan_like_shuffled_ones() {
    let c = cfg(100, 256, 16);
    let sorted: Vec<_> = (0..30).map(|i| w(i / 10, 1000, (i % 10) * 90, 40 + i)).collect();
    let mut shuffled = sorted.clone();
    shuffled.reverse();
    let (a, b) = (upload_checked(&sorted, &c), upload_checked(&shuffled, &c));
    assert_eq!(a.chunks, b.chunks);
    assert_eq!(
        a.fills.iter().map(|f| f.stage_offset).collect::<Vec<_>>(),
        b.fills.iter().map(|f| f.stage_offset).collect::<Vec<_>>()
    );
}

#[test]
fn chunk_bytes_smaller_than_align_is_an_error() {
    let err = plan_upload(&[w(1, 10, 0, 1)], &cfg(4, 8, 16)).unwrap_err();
    assert_eq!(err, PlanError::ChunkTooSmall { chunk_bytes: 8, align: 16 });
    assert_eq!(
        plan_download(&[], &cfg(0, 0, 1)).unwrap_err(),
        PlanError::ChunkTooSmall { chunk_bytes: 0, align: 1 }
    );
}

#[test]
fn chunk_bytes_is_rounded_down_to_the_alignment() {
    let c = cfg(1 << 20, 100, 16);
    assert_eq!(c.chunk_capacity(), Ok(96));
    let plan = upload_checked(&[w(1, 1000, 0, 500)], &c);
    assert_eq!(plan.chunk_capacity, 96);
    // The threshold is clamped to the capacity, so 500 bytes go direct over 6 chunks.
    assert_eq!(plan.chunks.len(), 6);
    assert!(plan.chunks.iter().all(|c| c.staging_len <= 96 && c.packed.is_empty()));
}

#[test]
fn align_must_be_a_power_of_two() {
    for align in [0, 3, 24] {
        let err = plan_upload(&[], &cfg(0, 1024, align)).unwrap_err();
        assert_eq!(err, PlanError::InvalidAlign { align });
    }
}

#[test]
fn align_one_packs_without_padding() {
    let writes = [w(1, 100, 0, 3), w(1, 100, 10, 3), w(2, 100, 0, 5)];
    let plan = upload_checked(&writes, &cfg(8, 8, 1));
    assert_eq!(plan.chunks[0].packed.iter().map(|p| p.stage_offset).collect::<Vec<_>>(), vec![0, 3]);
    assert_eq!(plan.chunks[1].packed[0].stage_offset, 8, "5 bytes do not fit in the 2 left");
}

#[test]
fn threshold_zero_sends_everything_direct() {
    let plan = upload_checked(&[w(1, 100, 0, 1), w(2, 100, 0, 2)], &cfg(0, 64, 16));
    assert_eq!(plan.packed_intervals, 0);
    assert_eq!(plan.chunks[0].direct.len(), 2);
    assert_eq!(plan.chunks[0].packed_len, 0);
}

#[test]
fn many_tiny_chunks() {
    // Capacity of one byte: every byte is its own chunk.
    let plan = upload_checked(&[w(1, 10, 2, 5), w(1, 10, 4, 5)], &cfg(1, 1, 1));
    assert_eq!(plan.chunks.len(), 7);
    assert_eq!(plan.fills.len(), 7);
    let plan = download_checked(&[r(1, 10, 2, 5), r(1, 10, 4, 5)], &cfg(1, 1, 1));
    assert_eq!(plan.views[1], ReadView { chunk: 2, last_chunk: 6, stage_offset: 2, len: 5 });
}

#[test]
fn too_many_chunks_is_an_error_not_an_allocation() {
    let err = plan_upload(&[w(1, u64::MAX, 0, 1 << 40)], &cfg(1, 16, 16)).unwrap_err();
    assert_eq!(err, PlanError::TooLarge { chunk_capacity: 16 });
    // Two buffers whose intervals together exceed u64.
    let huge = [r(1, u64::MAX, 0, u64::MAX), r(2, u64::MAX, 0, u64::MAX)];
    assert!(matches!(plan_download(&huge, &PlanConfig::default()), Err(PlanError::TooLarge { .. })));
}

#[test]
fn overlapping_reads_share_staging() {
    let reads = [r(1, 100, 0, 50), r(1, 100, 25, 50), r(1, 100, 25, 50), r(1, 100, 75, 1)];
    let plan = download_checked(&reads, &cfg(1000, 4096, 16));
    assert_eq!((plan.intervals, plan.moved_bytes, plan.requested_bytes), (1, 76, 151));
    let offsets: Vec<_> = plan.views.iter().map(|v| v.stage_offset).collect();
    assert_eq!(offsets, vec![0, 25, 25, 75]);
}

#[test]
fn a_planner_reuses_its_memory_and_gives_the_same_plans() {
    let c = cfg(64, 256, 16);
    let big: Vec<_> = (0..40).map(|i| w(i % 3, 4096, (i * 97) % 4000, 1 + (i * 31) % 90)).collect();
    let small = [w(1, 100, 0, 10)];
    let mut planner = Planner::new();
    let mut plan = UploadPlan::default();
    for batch in [&big[..], &small[..], &big[..], &[][..]] {
        planner.plan_upload_into(batch, &c, &mut plan).unwrap();
        assert_eq!(plan, plan_upload(batch, &c).unwrap());
    }
    let reads: Vec<_> = big.iter().map(|w| r(w.buffer, w.buffer_len, w.offset, w.len)).collect();
    let mut plan = DownloadPlan::default();
    for batch in [&reads[..], &reads[..3], &reads[..]] {
        planner.plan_download_into(batch, &c, &mut plan).unwrap();
        assert_eq!(plan, plan_download(batch, &c).unwrap());
    }
}

#[test]
fn a_failed_plan_into_leaves_an_empty_plan() {
    let c = cfg(64, 256, 16);
    let mut planner = Planner::new();
    let mut plan = planner.plan_upload(&[w(1, 100, 0, 10)], &c).unwrap();
    assert!(planner.plan_upload_into(&[w(1, 100, 95, 10)], &c, &mut plan).is_err());
    assert_eq!(plan, UploadPlan::default());
    let mut plan = planner.plan_download(&[r(1, 100, 0, 10)], &c).unwrap();
    assert!(planner.plan_download_into(&[r(1, 100, 0, 10)], &cfg(0, 0, 16), &mut plan).is_err());
    assert_eq!(plan, DownloadPlan::default());
}

#[test]
fn every_error_message_ends_with_a_fix() {
    let errors = [
        PlanError::OutOfRange { index: 3, buffer: 1, offset: 10, len: 5, buffer_len: 12 },
        PlanError::InvalidAlign { align: 3 },
        PlanError::ChunkTooSmall { chunk_bytes: 8, align: 16 },
        PlanError::TooManyRequests { count: 1 << 33 },
        PlanError::TooLarge { chunk_capacity: 16 },
        PlanError::OutOfMemory { chunks: 1 << 31 },
    ];
    for e in errors {
        let text = e.to_string();
        let (what, fix) = text.split_once(" Fix: ").unwrap_or_else(|| panic!("no fix in {text:?}"));
        assert!(!what.is_empty() && !fix.is_empty(), "{text}");
        assert!(!fix.contains("Fix:"), "{text}");
    }
    let text = PlanError::OutOfRange { index: 3, buffer: 1, offset: 10, len: 5, buffer_len: 12 }.to_string();
    assert!(text.contains("request 3") && text.contains("12 bytes"), "{text}");
}

#[test]
fn tiny_packed_intervals_end_a_chunk_at_half_a_chunk_of_descriptors() {
    // 64 KiB chunks hold 4096 one-byte intervals at 16-byte slots by bytes, but their table
    // (24 bytes each) may take only half the chunk: 1365 descriptors a chunk.
    let most = super::chunk_descriptors_most(64 << 10);
    assert_eq!(most, 1365);
    let writes: Vec<_> = (0..10_000).map(|i| w(1, 1 << 20, i * 32, 1)).collect();
    let plan = upload_checked(&writes, &cfg(8 << 10, 64 << 10, 16));
    let counts: Vec<usize> = plan.chunks.iter().map(|c| c.packed.len()).collect();
    assert!(counts[..counts.len() - 1].iter().all(|&n| n == most as usize), "{counts:?}");
    assert_eq!(counts.iter().sum::<usize>(), 10_000);
    // Intervals of a whole segment each: bytes fill the chunk before the table's bound.
    let writes: Vec<_> = (0..40).map(|i| w(1, 1 << 20, i * 20_000, 16 << 10)).collect();
    let plan = upload_checked(&writes, &cfg(32 << 10, 64 << 10, 16));
    assert!(plan.chunks.iter().all(|c| c.packed.len() == 4), "{:?}", plan.chunks.len());
}

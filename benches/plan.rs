//! CPU cost of planning a batch with `cuda_resident::internals::plan`: no GPU, no copies, just the plan.
//!
//! Each case is 8192 requests spread over 64 buffers at random offsets (seeded, so every run
//! plans the same batches), with the default `PlanConfig` (256 KiB direct threshold, 8 MiB
//! chunks, 16-byte alignment):
//!
//! - `256`, `4096`, `65536`: every request that many bytes, into buffers of 64 MiB: the sizes
//!   of the design's transfer anchors (8192 x 256 B, 4 KiB and 64 KiB), with few overlaps;
//! - `mixed`: sizes uniform in 256 B..=64 KiB, buffers of 64 MiB, so some requests overlap or
//!   touch and fuse (the planner's budget: 100 µs per batch on a modern core);
//! - `overlapping`: the same sizes into buffers of 4 MiB, so that most requests overlap
//!   (about 3000 intervals): the worst case for upload fills.
//!
//! Groups: `plan_upload` and `plan_download` call the free functions, which allocate fresh
//! scratch and a fresh plan each time; `planner_upload_into` and `planner_download_into`
//! reuse one `Planner` and one plan, as an executor that plans every batch does. One
//! iteration plans one whole batch, so the time shown is the cost of a batch.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use cuda_resident::internals::plan::{
    DownloadPlan, PlanConfig, Planner, ReadRequest, UploadPlan, WriteRequest, plan_download, plan_upload,
};

const REQUESTS: usize = 8192;
const BUFFERS: u64 = 64;

/// The batches, as `(name, writes)`; reads use the same ranges.
fn batches() -> Vec<(&'static str, Vec<WriteRequest>)> {
    let fixed = |size: u64| batch(64 << 20, |_| size);
    let mixed = |rng: &mut fastrand::Rng| rng.u64(256..=65536);
    vec![
        ("256", fixed(256)),
        ("4096", fixed(4096)),
        ("65536", fixed(65536)),
        ("mixed", batch(64 << 20, mixed)),
        ("overlapping", batch(4 << 20, mixed)),
        ("4096 in order", in_order(4096)),
    ]
}

/// 8192 writes of `size` bytes in order, round robin over `BUFFERS` buffers at increasing
/// offsets with gaps (as xfer-bench's many-small cases write): planned without a sort.
fn in_order(size: u64) -> Vec<WriteRequest> {
    let stride = size + 64;
    let buffer_len = (REQUESTS as u64).div_ceil(BUFFERS) * stride;
    (0..REQUESTS as u64)
        .map(|i| WriteRequest { buffer: i % BUFFERS, buffer_len, offset: (i / BUFFERS) * stride, len: size })
        .collect()
}

/// 8192 writes over `BUFFERS` buffers of `buffer_len` bytes, sizes from `size`, random
/// offsets; the seed is fixed so that every run measures the same batch.
fn batch(buffer_len: u64, mut size: impl FnMut(&mut fastrand::Rng) -> u64) -> Vec<WriteRequest> {
    let mut rng = fastrand::Rng::with_seed(0x5EED_F00D);
    (0..REQUESTS)
        .map(|_| {
            let len = size(&mut rng);
            let buffer = rng.u64(0..BUFFERS);
            WriteRequest { buffer, buffer_len, offset: rng.u64(0..=buffer_len - len), len }
        })
        .collect()
}

fn reads_of(writes: &[WriteRequest]) -> Vec<ReadRequest> {
    writes
        .iter()
        .map(|w| ReadRequest { buffer: w.buffer, buffer_len: w.buffer_len, offset: w.offset, len: w.len })
        .collect()
}

fn bench_plans(c: &mut Criterion) {
    let cfg = PlanConfig::default();
    let batches = batches();

    let mut group = c.benchmark_group("plan_upload");
    for (name, writes) in &batches {
        group.bench_with_input(BenchmarkId::from_parameter(name), writes, |b, writes| {
            b.iter(|| plan_upload(black_box(writes), &cfg).expect("valid batch"));
        });
    }
    group.finish();

    let mut group = c.benchmark_group("planner_upload_into");
    for (name, writes) in &batches {
        let (mut planner, mut plan) = (Planner::new(), UploadPlan::default());
        group.bench_with_input(BenchmarkId::from_parameter(name), writes, |b, writes| {
            b.iter(|| planner.plan_upload_into(black_box(writes), &cfg, &mut plan).expect("valid batch"));
        });
    }
    group.finish();

    let mut group = c.benchmark_group("plan_download");
    for (name, writes) in &batches {
        group.bench_with_input(BenchmarkId::from_parameter(name), &reads_of(writes), |b, reads| {
            b.iter(|| plan_download(black_box(reads), &cfg).expect("valid batch"));
        });
    }
    group.finish();

    let mut group = c.benchmark_group("planner_download_into");
    for (name, writes) in &batches {
        let (mut planner, mut plan) = (Planner::new(), DownloadPlan::default());
        group.bench_with_input(BenchmarkId::from_parameter(name), &reads_of(writes), |b, reads| {
            b.iter(|| planner.plan_download_into(black_box(reads), &cfg, &mut plan).expect("valid batch"));
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    // 20 cases on a shared 2-core machine: short runs, and fewer samples than the default
    // 100, which planning's steady cost does not need.
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(50);
    targets = bench_plans
}
criterion_main!(benches);

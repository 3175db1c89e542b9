//! CPU cost of planning a batch with `cuda_resident::plan`: no GPU, no copies, just the plan.
//!
//! Each case is 8192 requests spread over 64 buffers of 64 MiB, at random offsets (seeded,
//! so every run plans the same batches), with the default `PlanConfig` (256 KiB direct
//! threshold, 8 MiB chunks, 16-byte alignment):
//!
//! - `256`, `4096`, `65536`: every request that many bytes, the sizes of the design's
//!   transfer anchors (8192 x 256 B, 4 KiB and 64 KiB);
//! - `mixed`: sizes uniform in 256 B..=64 KiB over buffers of 4 MiB, so that some requests
//!   overlap and fuse (the planner's budget: at most 100 µs per batch).
//!
//! Groups: `plan_upload` and `plan_readback` are the free functions (fresh scratch and a
//! fresh plan each time); `planner_upload_into` and `planner_readback_into` reuse one
//! `Planner` and one plan, the way an executor that plans every batch would. One iteration
//! plans one whole batch, so the time shown is the cost per batch.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use cuda_resident::plan::{
    PlanConfig, Planner, ReadRequest, ReadbackPlan, UploadPlan, WriteRequest, plan_readback, plan_upload,
};

const REQUESTS: usize = 8192;
const BUFFERS: u64 = 64;

/// The batches, as `(name, writes)`; reads use the same ranges.
fn batches() -> Vec<(&'static str, Vec<WriteRequest>)> {
    let fixed = |size: u64| batch(64 << 20, |_| size);
    vec![
        ("256", fixed(256)),
        ("4096", fixed(4096)),
        ("65536", fixed(65536)),
        ("mixed", batch(4 << 20, |rng| rng.u64(256..=65536))),
    ]
}

/// 8192 writes over `BUFFERS` buffers of `buffer_len` bytes, sizes from `size`, random
/// offsets; the seed is fixed so that every run measures the same batch.
fn batch(buffer_len: u64, mut size: impl FnMut(&mut fastrand::Rng) -> u64) -> Vec<WriteRequest> {
    let mut rng = fastrand::Rng::with_seed(0x05EE_D0FB_47C4);
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

    let mut group = c.benchmark_group("plan_readback");
    for (name, writes) in &batches {
        group.bench_with_input(BenchmarkId::from_parameter(name), &reads_of(writes), |b, reads| {
            b.iter(|| plan_readback(black_box(reads), &cfg).expect("valid batch"));
        });
    }
    group.finish();

    let mut group = c.benchmark_group("planner_readback_into");
    for (name, writes) in &batches {
        let (mut planner, mut plan) = (Planner::new(), ReadbackPlan::default());
        group.bench_with_input(BenchmarkId::from_parameter(name), &reads_of(writes), |b, reads| {
            b.iter(|| planner.plan_readback_into(black_box(reads), &cfg, &mut plan).expect("valid batch"));
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    // Short runs: 16 cases on a shared 2-core machine; planning is steady, so 2 s suffice.
    config = Criterion::default().warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_secs(2));
    targets = bench_plans
}
criterion_main!(benches);

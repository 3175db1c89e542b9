//! Criterion benchmarks of cuda-resident's transfers on a GPU: an upload batch and a download
//! batch of 8192 x 4 KiB spread over 64 buffers, submit to fence, and the same ranges as
//! prepared sets. Without a GPU (or driver)
//! they print why they are skipped and measure nothing. `xfer-bench` is the side-by-side
//! comparison with the raw driver; these track cuda-resident's own speed over time.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use cuda_resident::Device;

const COUNT: usize = 8192;
const SIZE: usize = 4096;

fn transfers(c: &mut Criterion) {
    let device = match Device::open(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("transfer benches skipped: {e}");
            return;
        }
    };
    let mut rng = fastrand::Rng::with_seed(1);
    let buffers: Vec<_> =
        (0..64).map(|_| device.allocate((COUNT / 64 * (SIZE + 64)) as u64).unwrap()).collect();
    let places: Vec<_> = (0..COUNT).map(|i| (buffers[i % 64], (i / 64 * (SIZE + 64)) as u64)).collect();
    let data: Vec<Vec<u8>> = (0..COUNT)
        .map(|_| {
            let mut v = vec![0u8; SIZE];
            rng.fill(&mut v);
            v
        })
        .collect();
    let mut group = c.benchmark_group("transfer");
    group.throughput(Throughput::Bytes((COUNT * SIZE) as u64));
    group.bench_function("upload 8192 x 4 KiB", |b| {
        b.iter(|| {
            let mut batch = device.uploads();
            for (v, &(buf, off)) in data.iter().zip(&places) {
                batch.write(buf, off, v).unwrap();
            }
            batch.submit().unwrap().wait().unwrap();
        })
    });
    group.bench_function("download 8192 x 4 KiB as views", |b| {
        b.iter(|| {
            let mut reads = device.downloads();
            for &(buf, off) in &places {
                reads.read(buf, off, SIZE as u64).unwrap();
            }
            reads.submit().unwrap().wait().unwrap()
        })
    });
    // The same ranges prepared once, outside the measurement.
    let ranges: Vec<_> = places.iter().map(|&(buf, off)| (buf, off, SIZE as u64)).collect();
    let mut prepared = device.prepare_uploads(&ranges).unwrap();
    group.bench_function("prepared upload 8192 x 4 KiB", |b| {
        b.iter(|| prepared.upload(&data).unwrap().wait().unwrap())
    });
    drop(prepared);
    let mut prepared = device.prepare_downloads(&ranges).unwrap();
    group.bench_function("prepared download 8192 x 4 KiB as views", |b| {
        b.iter(|| prepared.submit().unwrap().wait().unwrap())
    });
    drop(prepared);
    group.finish();
    for b in buffers {
        device.free(b).unwrap();
    }
}

criterion_group!(benches, transfers);
criterion_main!(benches);

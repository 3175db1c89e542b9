//! CPU cost of a request: what `UploadBatch::write`, `UploadBatch::write_many`,
//! `UploadBatch::write_with` (its fill copying the bytes), `UploadBatch::write_with_par` (its
//! fill run at submit, untimed) and `DownloadBatch::read` cost per call, beyond the bytes a
//! submit later moves. No GPU: the
//! device is opened on the tests' model driver (`cuda_resident::internals::model_device`),
//! and only building a batch is timed (taking it from the device, then the calls: checking
//! the handle and the range, recording the request and its layout), not its submit.
//!
//! `read, slots collected` keeps the slots in a `Vec` by `collect::<Result<Vec<_>, _>>`,
//! which cannot tell the count, so the vector grows as it fills; `read, slots in a vector
//! with room` pushes them into one made with room for all (128 KiB for 8192 slots, made and
//! freed each batch): the differences from `read` are the caller's own cost (on the H100
//! machine's host, 8192 reads took 226 µs collected, 102 µs with no slot kept).
//!
//! Each case is the `xfer-bench` shape: 8192 requests of 256 B over 64 buffers, request `i`
//! to buffer `i % 64` at offset `(i / 64) * (256 + 64)` (in order and apart). One iteration
//! builds one whole batch, then (untimed) submits it and waits for it, so that the next batch
//! reuses its vectors as in a steady stream of batches. Criterion reports the time per batch
//! and requests per second: the cost per request is the time divided by 8192.
//!
//! The scattered shape follows: 8192 buffers of 256 B, one request each, named in a shuffled
//! order; for it, the `submit` of such a batch is timed too (its build and wait untimed):
//! checking and marking each of the 8192 buffers, laying out and packing the requests.
//!
//! Run with `cargo bench -p cuda-resident-benches --bench calls -- --warm-up-time 1
//! --measurement-time 2`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use cuda_resident::internals::model_device;
use cuda_resident::{Config, Device, DownloadBatch, ResidentBuffer, UploadBatch};

const COUNT: usize = 8192;
const SIZE: usize = 256;
const BUFFERS: usize = 64;

/// Builds `iters` upload batches with `build`, each submitted and waited for untimed (a
/// batch dropped unsubmitted does not hand its vectors back to the device, so the next would
/// build fresh ones, as no steady stream of batches does), and returns the time spent
/// building.
fn upload<'a>(device: &'a Device, iters: u64, build: impl Fn(&mut UploadBatch<'a>)) -> Duration {
    let mut spent = Duration::ZERO;
    for _ in 0..iters {
        let start = Instant::now();
        let mut batch = device.uploads();
        build(&mut batch);
        spent += start.elapsed();
        batch.submit().unwrap().wait().unwrap();
    }
    spent
}

/// As [`upload`], for download batches built by `build`: a batch hands its vectors back
/// once submitted (untimed, as uploads).
fn download(device: &Device, iters: u64, build: impl Fn(&mut DownloadBatch<'_>)) -> Duration {
    let mut spent = Duration::ZERO;
    for _ in 0..iters {
        let start = Instant::now();
        let mut batch = device.downloads();
        build(&mut batch);
        spent += start.elapsed();
        drop(batch.submit().unwrap().wait().unwrap());
    }
    spent
}

fn calls(c: &mut Criterion) {
    let device = model_device(Config::default());
    let per_buffer = COUNT.div_ceil(BUFFERS) * (SIZE + 64);
    let buffers: Vec<ResidentBuffer> =
        (0..BUFFERS).map(|_| device.allocate(per_buffer as u64).unwrap()).collect();
    let places: Vec<(ResidentBuffer, u64)> =
        (0..COUNT).map(|i| (buffers[i % BUFFERS], (i / BUFFERS * (SIZE + 64)) as u64)).collect();
    let bytes: Vec<u8> = (0..COUNT * SIZE).map(|i| i as u8).collect();
    let data: Vec<&[u8]> = bytes.chunks_exact(SIZE).collect();

    let mut group = c.benchmark_group("calls 8192 x 256 B");
    group.throughput(Throughput::Elements(COUNT as u64));
    group.bench_function("write", |b| {
        b.iter_custom(|iters| {
            upload(&device, iters, |batch| {
                for (&(buffer, offset), &d) in places.iter().zip(&data) {
                    batch.write(black_box(buffer), black_box(offset), d).unwrap();
                }
            })
        })
    });
    group.bench_function("write_many", |b| {
        b.iter_custom(|iters| {
            upload(&device, iters, |batch| {
                let items = places.iter().zip(&data).map(|(&(buffer, offset), &d)| (buffer, offset, d));
                batch.write_many(black_box(items)).unwrap();
            })
        })
    });
    // The bytes written in place: the fill copies the 256 bytes, as xfer-bench's fill+move.
    group.bench_function("write_with", |b| {
        b.iter_custom(|iters| {
            upload(&device, iters, |batch| {
                for (&(buffer, offset), &d) in places.iter().zip(&data) {
                    batch
                        .write_with(black_box(buffer), black_box(offset), SIZE, |dst| dst.copy_from_slice(d))
                        .unwrap();
                }
            })
        })
    });
    // Adding a fill that runs at submit (untimed here): the call alone.
    group.bench_function("write_with_par", |b| {
        b.iter_custom(|iters| {
            upload(&device, iters, |batch| {
                for (&(buffer, offset), &d) in places.iter().zip(&data) {
                    batch
                        .write_with_par(black_box(buffer), black_box(offset), SIZE, move |dst| {
                            dst.copy_from_slice(d)
                        })
                        .unwrap();
                }
            })
        })
    });
    group.bench_function("read", |b| {
        b.iter_custom(|iters| {
            download(&device, iters, |batch| {
                for &(buffer, offset) in &places {
                    black_box(batch.read(black_box(buffer), black_box(offset), SIZE as u64).unwrap());
                }
            })
        })
    });
    // The slots collected into a `Vec` whose length the iterator does not tell
    // (`collect::<Result<Vec<_>, _>>`).
    group.bench_function("read, slots collected", |b| {
        b.iter_custom(|iters| {
            download(&device, iters, |batch| {
                let slots: Result<Vec<_>, _> =
                    places.iter().map(|&(buffer, offset)| batch.read(buffer, offset, SIZE as u64)).collect();
                black_box(slots.unwrap());
            })
        })
    });
    group.bench_function("read, slots in a vector with room", |b| {
        b.iter_custom(|iters| {
            download(&device, iters, |batch| {
                let mut slots = Vec::with_capacity(places.len());
                for &(buffer, offset) in &places {
                    slots.push(batch.read(buffer, offset, SIZE as u64).unwrap());
                }
                black_box(slots);
            })
        })
    });
    group.finish();
    for b in buffers {
        device.free(b).unwrap();
    }
    scattered(c, &device, &data);
}

/// The scattered shape of `xfer-bench`: 8192 buffers of 256 B, one request each, named in a
/// shuffled order (the same every run), written by one batch and read by one.
fn scattered(c: &mut Criterion, device: &Device, data: &[&[u8]]) {
    let buffers: Vec<ResidentBuffer> = (0..COUNT).map(|_| device.allocate(SIZE as u64).unwrap()).collect();
    let mut order: Vec<usize> = (0..COUNT).collect();
    fastrand::Rng::with_seed(7).shuffle(&mut order);
    let shuffled: Vec<ResidentBuffer> = order.iter().map(|&i| buffers[i]).collect();

    let mut group = c.benchmark_group("calls 8192 x 256 B, a buffer each, shuffled");
    group.throughput(Throughput::Elements(COUNT as u64));
    group.bench_function("write", |b| {
        b.iter_custom(|iters| {
            upload(device, iters, |batch| {
                for (&buffer, &d) in shuffled.iter().zip(data) {
                    batch.write(black_box(buffer), 0, d).unwrap();
                }
            })
        })
    });
    group.bench_function("read", |b| {
        b.iter_custom(|iters| {
            download(device, iters, |batch| {
                for &buffer in &shuffled {
                    black_box(batch.read(black_box(buffer), 0, SIZE as u64).unwrap());
                }
            })
        })
    });
    // Submitting the batch, its build untimed: checking and marking each buffer, laying out
    // and packing the requests (the wait, the model's copies, untimed).
    group.bench_function("write, submit", |b| {
        b.iter_custom(|iters| {
            submits(iters, || {
                let mut batch = device.uploads();
                for (&buffer, &d) in shuffled.iter().zip(data) {
                    batch.write(buffer, 0, d).unwrap();
                }
                let start = Instant::now();
                let fence = batch.submit().unwrap();
                let spent = start.elapsed();
                fence.wait().unwrap();
                spent
            })
        })
    });
    group.bench_function("read, submit", |b| {
        b.iter_custom(|iters| {
            submits(iters, || {
                let mut batch = device.downloads();
                for &buffer in &shuffled {
                    black_box(batch.read(buffer, 0, SIZE as u64).unwrap());
                }
                let start = Instant::now();
                let pending = batch.submit().unwrap();
                let spent = start.elapsed();
                drop(pending.wait().unwrap());
                spent
            })
        })
    });
    group.finish();
    for b in buffers {
        device.free(b).unwrap();
    }
}

/// The sum of `iters` runs of `one`, each returning the time it timed.
fn submits(iters: u64, mut one: impl FnMut() -> Duration) -> Duration {
    (0..iters).map(|_| one()).sum()
}

criterion_group!(benches, calls);
criterion_main!(benches);

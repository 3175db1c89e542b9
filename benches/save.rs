//! The host's side of a checkpoint save: `Device::save_safetensors_configured` of 64 tensors
//! of 4 MiB (256 MiB, bf16) into one file, with each [`WriteMode`] in turn. No GPU: the device
//! is opened on the tests' model driver (`cuda_resident::internals::model_device`), whose
//! downloads are host copies, so what is timed is the save's threads, their downloads into
//! pinned memory and the writes into the file: preallocated and mapped, copied into by every
//! thread (`mapped`), or `pwrite` by one thread (`pwrite`). The file goes into the
//! temporary folder (`TMPDIR`, else `/tmp`; its file system decides much), and is removed
//! after each save, untimed.
//!
//! Run with `cargo bench -p cuda-resident-benches --bench save -- --warm-up-time 1
//! --measurement-time 5`.

use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use cuda_resident::internals::model_device;
use cuda_resident::weights::{Dtype, SaveOptions, WriteMode};
use cuda_resident::{Config, ResidentBuffer};

const TENSORS: usize = 64;
const TENSOR_BYTES: usize = 4 << 20;

fn save(c: &mut Criterion) {
    let device = model_device(Config::default());
    let names: Vec<String> = (0..TENSORS).map(|i| format!("layers.{i}.weight")).collect();
    let shape = [TENSOR_BYTES / 2 / 1024, 1024];
    let mut rng = fastrand::Rng::with_seed(7);
    let buffers: Vec<ResidentBuffer> = (0..TENSORS)
        .map(|_| {
            let b = device.allocate(TENSOR_BYTES as u64).unwrap();
            let bytes: Vec<u8> = (0..TENSOR_BYTES).map(|_| rng.u8(..)).collect();
            device.upload(b, &bytes).unwrap();
            b
        })
        .collect();
    let tensors: Vec<(&str, Dtype, &[usize], ResidentBuffer)> =
        names.iter().zip(&buffers).map(|(n, &b)| (n.as_str(), Dtype::BF16, &shape[..], b)).collect();
    let path =
        std::env::temp_dir().join(format!("cuda-resident-save-bench-{}.safetensors", std::process::id()));

    let mut group = c.benchmark_group("save 64 x 4 MiB, one file");
    group.throughput(Throughput::Bytes((TENSORS * TENSOR_BYTES) as u64));
    group.sample_size(10);
    for (name, mode) in [("mapped", WriteMode::Mapped), ("pwrite", WriteMode::Pwrite)] {
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    let start = Instant::now();
                    let options = SaveOptions::new().write_mode(mode);
                    device.save_safetensors_configured(&path, &tensors, options).unwrap();
                    spent += start.elapsed();
                    std::fs::remove_file(&path).unwrap();
                }
                spent
            })
        });
    }
    group.finish();
    for b in buffers {
        device.free(b).unwrap();
    }
}

criterion_group!(benches, save);
criterion_main!(benches);

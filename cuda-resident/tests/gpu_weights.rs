//! Safetensors checkpoints (feature `safetensors`) loaded into and saved from a real GPU,
//! every byte checked. Ignored where there is no GPU:
//! `cargo test -p cuda-resident --features safetensors --test gpu_weights -- --include-ignored`.

#![cfg(feature = "safetensors")]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cuda_resident::weights::{Dtype, LoadOptions, SaveOptions, WeightsError, WriteMode};
use cuda_resident::{Config, Device, Error};
use safetensors::tensor::TensorView;

fn device_with(config: Config) -> Device {
    let d = Device::open(0).unwrap_or_else(|e| panic!("{e}"));
    Device::open_on_driver(Arc::clone(d.driver()), 0, config).unwrap()
}

/// A file in the temporary folder, removed when dropped.
struct Temp(PathBuf);

impl Temp {
    fn new(name: &str) -> Temp {
        Temp(std::env::temp_dir().join(format!("cuda-resident-gpu-weights-{}-{name}", std::process::id())))
    }
}

impl Drop for Temp {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Writes tensors of `shapes` (`dtype`, random bytes) with the safetensors crate; their bytes.
fn write(path: &Path, shapes: &[(String, Dtype, Vec<usize>)], seed: u64) -> HashMap<String, Vec<u8>> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let data: HashMap<String, Vec<u8>> = shapes
        .iter()
        .map(|(name, dtype, shape)| {
            let bits = shape.iter().product::<usize>() * dtype.bitsize();
            let mut v = vec![0u8; bits / 8];
            rng.fill(&mut v);
            (name.clone(), v)
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = shapes
        .iter()
        .map(|(name, dtype, shape)| {
            (name.clone(), TensorView::new(*dtype, shape.clone(), &data[name]).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
    data
}

/// A decoder's tensors in Llama's shapes, at `hidden` (bf16).
fn decoder(layers: usize, hidden: usize) -> Vec<(String, Dtype, Vec<usize>)> {
    let mut t = vec![("model.embed_tokens.weight".to_owned(), Dtype::BF16, vec![32_000, hidden])];
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        for (name, shape) in [
            ("self_attn.q_proj.weight", vec![hidden, hidden]),
            ("self_attn.k_proj.weight", vec![hidden / 4, hidden]),
            ("self_attn.v_proj.weight", vec![hidden / 4, hidden]),
            ("self_attn.o_proj.weight", vec![hidden, hidden]),
            ("mlp.gate_proj.weight", vec![hidden * 7 / 2, hidden]),
            ("mlp.up_proj.weight", vec![hidden * 7 / 2, hidden]),
            ("mlp.down_proj.weight", vec![hidden, hidden * 7 / 2]),
            ("input_layernorm.weight", vec![hidden]),
            ("post_attention_layernorm.weight", vec![hidden]),
        ] {
            t.push((format!("{p}.{name}"), Dtype::BF16, shape));
        }
    }
    t.push(("model.norm.weight".to_owned(), Dtype::BF16, vec![hidden]));
    t
}

/// Checks every tensor of `ckpt` on the device against `data`.
fn check(d: &Device, ckpt: &cuda_resident::weights::Checkpoint, data: &HashMap<String, Vec<u8>>) {
    assert_eq!(ckpt.len(), data.len());
    let mut got = Vec::new();
    for t in ckpt.tensors() {
        got.resize(t.len() as usize, 0);
        d.download_to_slice(t.buffer(), t.offset(), &mut got).unwrap();
        assert!(got == data[t.name()], "tensor {} differs", t.name());
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_decoder_checkpoint_loads_and_saves_every_byte_in_either_layout() {
    let d = device_with(Config::default());
    let file = Temp::new("decoder.safetensors");
    let data = write(&file.0, &decoder(4, 2048), 1);
    for arena in [false, true] {
        let mut last = (0, 0);
        let options = LoadOptions::new().arena(arena).progress(|done, total| last = (done, total));
        let ckpt = d.load_safetensors_configured(&file.0, options).unwrap();
        assert_eq!(last.0, last.1);
        assert_eq!(last.1, ckpt.total_bytes());
        check(&d, &ckpt, &data);
        let out = Temp::new(&format!("decoder-out-{arena}.safetensors"));
        ckpt.save(&d, &out.0).unwrap();
        assert!(std::fs::read(&out.0).unwrap() == std::fs::read(&file.0).unwrap(), "the saved file differs");
        drop(ckpt);
        assert_eq!(d.allocated_bytes(), 0);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn thousands_of_small_tensors_round_trip() {
    let d = device_with(Config::default());
    let mut rng = fastrand::Rng::with_seed(2);
    let mut shapes: Vec<_> =
        (0..5000).map(|i| (format!("bias.{i}"), Dtype::F32, vec![rng.usize(1..1024)])).collect();
    shapes.extend((0..8).map(|i| (format!("w.{i}"), Dtype::BF16, vec![1024, rng.usize(512..4096)])));
    let file = Temp::new("small.safetensors");
    let data = write(&file.0, &shapes, 3);
    let ckpt = d.load_safetensors(&file.0).unwrap();
    check(&d, &ckpt, &data);
    let out = Temp::new("small-out.safetensors");
    let tensors: Vec<_> =
        ckpt.tensors().iter().map(|t| (t.name(), t.dtype(), t.shape(), t.buffer())).collect();
    for mode in [WriteMode::Mapped, WriteMode::Pwrite] {
        d.save_safetensors_configured(&out.0, &tensors, SaveOptions::new().write_mode(mode)).unwrap();
        assert!(
            std::fs::read(&out.0).unwrap() == std::fs::read(&file.0).unwrap(),
            "{mode:?}: the saved file differs"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_checkpoint_eight_times_the_pinned_pool_loads_and_saves_within_it() {
    let cap = 64 << 20;
    let d = device_with(Config::default().with_pinned_cap_bytes(cap));
    let file = Temp::new("large.safetensors");
    let shapes: Vec<_> = (0..8).map(|i| (format!("t{i}"), Dtype::BF16, vec![8192, 4096 + i])).collect();
    let data = write(&file.0, &shapes, 4);
    let ckpt = d.load_safetensors(&file.0).unwrap();
    assert!(ckpt.total_bytes() >= 8 * cap);
    check(&d, &ckpt, &data);
    let out = Temp::new("large-out.safetensors");
    for mode in [WriteMode::Mapped, WriteMode::Pwrite] {
        ckpt.save_configured(&d, &out.0, SaveOptions::new().write_mode(mode)).unwrap();
        assert!(d.telemetry().pinned.reserved_bytes <= cap, "{mode:?}");
        assert!(
            std::fs::read(&out.0).unwrap() == std::fs::read(&file.0).unwrap(),
            "{mode:?}: the saved file differs"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_sharded_save_loads_back_every_byte_within_the_pinned_pool() {
    let cap = 256 << 20;
    let d = device_with(Config::default().with_pinned_cap_bytes(cap));
    let file = Temp::new("sharded-source.safetensors");
    let data = write(&file.0, &decoder(4, 2048), 5);
    let ckpt = d.load_safetensors(&file.0).unwrap();
    let dir = std::env::temp_dir().join(format!("cuda-resident-gpu-shards-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let options = SaveOptions::new().shard_bytes(64 << 20);
    ckpt.save_configured(&d, dir.join("model.safetensors"), options).unwrap();
    assert!(d.telemetry().pinned.reserved_bytes <= cap);
    let index = dir.join("model.safetensors.index.json");
    for arena in [false, true] {
        let back = d.load_safetensors_configured(&index, LoadOptions::new().arena(arena)).unwrap();
        check(&d, &back, &data);
    }
    let files = std::fs::read_dir(&dir).unwrap().count();
    assert!(files > 4, "{files} files");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn bad_checkpoints_fail_with_a_fix_and_leave_nothing_allocated() {
    let d = device_with(Config::default());
    let file = Temp::new("good.safetensors");
    write(&file.0, &decoder(1, 1024), 5);
    let bytes = std::fs::read(&file.0).unwrap();
    let cut = Temp::new("cut.safetensors");
    std::fs::write(&cut.0, &bytes[..bytes.len() - 4096]).unwrap();
    let e = d.load_safetensors(&cut.0).unwrap_err();
    assert!(matches!(e, Error::Weights(WeightsError::Truncated { .. })), "{e}");
    // A budget of a thousandth of the GPU (141 MB on an H200) refuses a 256 MiB checkpoint
    // before anything is allocated or read.
    let small = device_with(Config::default().with_budget_fraction(0.001));
    let huge = Temp::new("huge.safetensors");
    write(&huge.0, &[("w".to_owned(), Dtype::BF16, vec![1 << 15, 1 << 12])], 6);
    let e = small.load_safetensors(&huge.0).unwrap_err();
    assert!(matches!(e, Error::Weights(WeightsError::OverBudget { .. })), "{e}");
    assert!(e.to_string().contains("Fix: "));
    assert_eq!(d.allocated_bytes(), 0);
    assert_eq!(small.allocated_bytes(), 0);
}

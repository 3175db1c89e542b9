//! The synthetic checkpoint of `xfer-bench --suite weights` and `examples/load-weights.rs`:
//! the tensor list of Llama-3-8B (bf16; vocabulary 128256, hidden 4096, MLP 14336, 8 KV
//! heads of 128), its first layers, as many as fit a size, random bytes, written by the
//! safetensors crate itself; and the checks of what a load or a save produced against it.

use std::path::Path;

use cuda_resident::Device;
use cuda_resident::weights::{Checkpoint, Dtype};
use memmap2::Mmap;
use safetensors::tensor::TensorView;

use crate::random::fill_random;

/// Llama-3-8B's dimensions: vocabulary, hidden, MLP, key/value width, layers.
const LLAMA3_8B: (usize, usize, usize, usize, usize) = (128_256, 4096, 14_336, 1024, 32);

/// The synthetic model: its description and its tensors (name, shape; all bf16).
pub struct Model {
    /// What it is, for reports: "Llama-3-8B, 7 of 32 layers" (dimensions halved where the
    /// size cannot hold a layer).
    pub family: String,
    /// The tensors, in Llama's order.
    pub tensors: Vec<(String, Vec<usize>)>,
}

impl Model {
    /// Bytes of data.
    pub fn bytes(&self) -> u64 {
        self.tensors.iter().map(|(_, s)| 2 * s.iter().product::<usize>() as u64).sum()
    }
}

/// The tensor list of Llama-3-8B cut to about `target` bytes: the embedding, the final norm
/// and as many whole layers as fit (at least one); with every layer in, the output head too.
/// Where not even one layer fits, every dimension is halved until one does.
pub fn llama(target: u64) -> Model {
    let (mut vocab, mut hidden, mut mlp, mut kv, layers_most) = LLAMA3_8B;
    let layer = |h: usize, m: usize, k: usize| 2 * (2 * h * h + 2 * k * h + 3 * m * h + 2 * h) as u64;
    let mut halved = 0;
    while hidden > 64 && (2 * (vocab * hidden + hidden)) as u64 + layer(hidden, mlp, kv) > target {
        (vocab, hidden, mlp, kv) = (vocab / 2, hidden / 2, mlp / 2, kv / 2);
        halved += 1;
    }
    let base = (2 * (vocab * hidden + hidden)) as u64;
    let layers = (target.saturating_sub(base) / layer(hidden, mlp, kv)).clamp(1, layers_most as u64) as usize;
    let mut t = vec![("model.embed_tokens.weight".to_owned(), vec![vocab, hidden])];
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        t.push((format!("{p}.input_layernorm.weight"), vec![hidden]));
        t.push((format!("{p}.mlp.down_proj.weight"), vec![hidden, mlp]));
        t.push((format!("{p}.mlp.gate_proj.weight"), vec![mlp, hidden]));
        t.push((format!("{p}.mlp.up_proj.weight"), vec![mlp, hidden]));
        t.push((format!("{p}.post_attention_layernorm.weight"), vec![hidden]));
        t.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, hidden]));
        t.push((format!("{p}.self_attn.o_proj.weight"), vec![hidden, hidden]));
        t.push((format!("{p}.self_attn.q_proj.weight"), vec![hidden, hidden]));
        t.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, hidden]));
    }
    t.push(("model.norm.weight".to_owned(), vec![hidden]));
    if layers == layers_most && base + layers as u64 * layer(hidden, mlp, kv) + base <= target {
        t.push(("lm_head.weight".to_owned(), vec![vocab, hidden]));
    }
    let scale = if halved == 0 { String::new() } else { format!(", every dimension / {}", 1 << halved) };
    Model { family: format!("Llama-3-8B, {layers} of {layers_most} layers{scale}"), tensors: t }
}

/// Writes `model` with random bytes (from `seed`) to `path`, with the safetensors crate.
pub fn write(model: &Model, path: &Path, seed: u64) -> Result<(), String> {
    let mut data = vec![0u8; model.bytes() as usize];
    fill_random(seed, &mut data);
    let mut views = Vec::with_capacity(model.tensors.len());
    let mut rest = &data[..];
    for (name, shape) in &model.tensors {
        let (bytes, tail) = rest.split_at(2 * shape.iter().product::<usize>());
        rest = tail;
        views.push((
            name.as_str(),
            TensorView::new(Dtype::BF16, shape.clone(), bytes).map_err(|e| e.to_string())?,
        ));
    }
    safetensors::serialize_to_file(views, None, path).map_err(|e| format!("writing {}: {e}", path.display()))
}

/// `path` mapped, read only.
pub fn map(path: &Path) -> Result<Mmap, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("opening {}: {e}", path.display()))?;
    // SAFETY: a file this process wrote and nothing else changes while it is mapped.
    unsafe { Mmap::map(&file) }.map_err(|e| format!("mapping {}: {e}", path.display()))
}

/// Reads every page of `file` (so that it is in the page cache); returns a byte that
/// depends on all of them, so that the reads are not optimised away.
pub fn warm(file: &[u8]) -> u8 {
    file.iter().step_by(4096).fold(0, |a, &b| a ^ b)
}

/// Each tensor of the checkpoint `file` holds: name, start in the file, length.
pub fn tensor_ranges(file: &[u8]) -> Result<Vec<(String, usize, usize)>, String> {
    let st = safetensors::SafeTensors::deserialize(file).map_err(|e| e.to_string())?;
    let mut out: Vec<_> = st
        .iter()
        .map(|(name, view)| {
            (name.to_owned(), view.data().as_ptr() as usize - file.as_ptr() as usize, view.data().len())
        })
        .collect();
    out.sort_by_key(|r| r.1);
    Ok(out)
}

/// Checks that every tensor of `ckpt` holds on the device the bytes `file` holds for it.
pub fn verify_loaded(d: &Device, ckpt: &Checkpoint, file: &[u8]) -> Result<(), String> {
    let ranges = tensor_ranges(file)?;
    if ranges.len() != ckpt.len() {
        return Err(format!("{} tensors loaded, the file has {}", ckpt.len(), ranges.len()));
    }
    let mut got = Vec::new();
    for (name, start, len) in ranges {
        let t = ckpt.get(&name).ok_or_else(|| format!("tensor {name} was not loaded"))?;
        got.resize(len, 0);
        d.download_to_slice(t.buffer(), t.offset(), &mut got).map_err(|e| e.to_string())?;
        compare(&name, &got, &file[start..start + len])?;
    }
    Ok(())
}

/// Fails, naming the tensor and the first byte that differs, unless `got` is `want`.
pub fn compare(name: &str, got: &[u8], want: &[u8]) -> Result<(), String> {
    if got == want {
        return Ok(());
    }
    let at = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(got.len().min(want.len()));
    Err(format!("tensor {name} differs from the file at byte {at} of {}", want.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_fills_its_size_with_whole_layers() {
        let four = llama(4 << 30);
        assert_eq!(four.family, "Llama-3-8B, 7 of 32 layers");
        assert_eq!(four.tensors.len(), 2 + 7 * 9);
        assert!(four.bytes() <= 4 << 30 && four.bytes() > 3 << 30, "{}", four.bytes());
        let full = llama(20 << 30);
        assert_eq!(full.tensors.len(), 3 + 32 * 9, "with the output head");
        assert!(full.bytes() > 16_000_000_000);
        let tiny = llama(8 << 20);
        assert!(tiny.family.contains("every dimension /"), "{}", tiny.family);
        assert!(tiny.bytes() <= 8 << 20 && (tiny.tensors.len() - 2).is_multiple_of(9), "{}", tiny.bytes());
    }

    #[test]
    fn the_written_file_reads_back_with_its_ranges() {
        let path =
            std::env::temp_dir().join(format!("cuda-resident-suite-{}.safetensors", std::process::id()));
        let model = llama(2 << 20);
        write(&model, &path, 1).unwrap();
        let file = map(&path).unwrap();
        let ranges = tensor_ranges(&file).unwrap();
        assert_eq!(ranges.len(), model.tensors.len());
        assert_eq!(ranges.iter().map(|r| r.2 as u64).sum::<u64>(), model.bytes());
        assert!(compare("x", &[1, 2], &[1, 3]).unwrap_err().contains("byte 1"));
        let _ = warm(&file);
        std::fs::remove_file(&path).unwrap();
    }
}

//! Loads and saves on the model driver: every byte, both layouts, batches past the pinned
//! cap, and every bad input refused with nothing left allocated.

use std::collections::HashMap;
use std::path::PathBuf;

use safetensors::tensor::TensorView;

use super::{Dtype, LoadOptions, SaveOptions, WeightsError, WriteMode};
use crate::testing::{device, random_vec, small_chunks};
use crate::{Config, Device, Error, ResidentBuffer};

/// Tensors as `save_safetensors` takes them.
type Named<'a> = &'a [(&'a str, Dtype, &'a [usize], ResidentBuffer)];
/// A bad file, and whether the error is the one it should give.
type BadCase = (Vec<u8>, fn(&WeightsError) -> bool);

/// A path in the temporary folder, unique to the test, removed when dropped.
struct TempPath(PathBuf);

impl TempPath {
    fn new(name: &str) -> TempPath {
        let dir = std::env::temp_dir().join(format!("cuda-resident-weights-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempPath(dir.join(name))
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A checkpoint of `shapes` (bf16, random bytes) written by the safetensors crate itself;
/// the tensors' bytes by name.
fn write_with_crate(
    path: &std::path::Path,
    shapes: &[(String, Vec<usize>)],
    seed: u64,
) -> HashMap<String, Vec<u8>> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let data: HashMap<String, Vec<u8>> = shapes
        .iter()
        .map(|(name, shape)| (name.clone(), random_vec(&mut rng, shape.iter().product::<usize>() * 2)))
        .collect();
    let views: Vec<(String, TensorView<'_>)> = shapes
        .iter()
        .map(|(name, shape)| {
            (name.clone(), TensorView::new(Dtype::BF16, shape.clone(), &data[name]).unwrap())
        })
        .collect();
    let mut meta = HashMap::new();
    meta.insert("format".to_owned(), "pt".to_owned());
    std::fs::write(path, safetensors::serialize(views, Some(meta)).unwrap()).unwrap();
    data
}

/// A small decoder's tensor list: embeddings, per layer four projections and two norms.
fn decoder(layers: usize, hidden: usize) -> Vec<(String, Vec<usize>)> {
    let mut t = vec![("model.embed_tokens.weight".to_owned(), vec![1000, hidden])];
    for l in 0..layers {
        for p in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            t.push((format!("model.layers.{l}.self_attn.{p}.weight"), vec![hidden, hidden]));
        }
        t.push((format!("model.layers.{l}.input_layernorm.weight"), vec![hidden]));
        t.push((format!("model.layers.{l}.post_attention_layernorm.weight"), vec![hidden]));
    }
    t.push(("model.norm.weight".to_owned(), vec![hidden]));
    t.push(("empty".to_owned(), vec![0, hidden]));
    t
}

fn check_loaded(d: &Device, ckpt: &super::Checkpoint, data: &HashMap<String, Vec<u8>>) {
    assert_eq!(ckpt.len(), data.len());
    for t in ckpt.tensors() {
        let want = &data[t.name()];
        assert_eq!(t.len(), want.len() as u64, "{}", t.name());
        assert_eq!(t.dtype(), Dtype::BF16);
        if !t.is_empty() {
            assert_eq!(&d.download_range(t.buffer(), t.offset(), t.len()).unwrap(), want, "{}", t.name());
        }
    }
}

#[test]
fn a_checkpoint_loads_every_byte_in_either_layout_and_saves_back() {
    for (config, arena) in [(Config::default(), false), (small_chunks(), false), (small_chunks(), true)] {
        let d = device(config);
        let file = TempPath::new(&format!("load-{arena}.safetensors"));
        let data = write_with_crate(&file.0, &decoder(3, 512), 1);
        let mut seen = Vec::new();
        let options =
            LoadOptions::new().arena(arena).batch_bytes(1).progress(|done, total| seen.push((done, total)));
        let ckpt = d.load_safetensors_configured(&file.0, options).unwrap();
        check_loaded(&d, &ckpt, &data);
        assert_eq!(ckpt.arena().is_some(), arena);
        assert_eq!(ckpt.metadata().unwrap()["format"], "pt");
        assert_eq!(ckpt.get("model.norm.weight").unwrap().shape(), &[512]);
        assert!(ckpt.tensors().iter().all(|t| t.offset() % 256 == 0));
        let total = ckpt.total_bytes();
        assert!(seen.len() > 2 && seen.windows(2).all(|w| w[0].0 <= w[1].0), "{seen:?}");
        assert_eq!(seen.last(), Some(&(total, total)));

        // Saved back (the checkpoint's own save, arena or not), the crate reads the same.
        let out = TempPath::new(&format!("save-{arena}.safetensors"));
        ckpt.save(&d, &out.0).unwrap();
        let bytes = std::fs::read(&out.0).unwrap();
        let back = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(back.len(), data.len());
        for (name, view) in back.tensors() {
            assert_eq!(view.data(), &data[&name][..], "{name}");
        }
        drop(ckpt);
        assert_eq!(d.allocated_bytes(), 0, "the checkpoint's buffers are freed with it");
    }
}

#[test]
fn save_writes_what_the_buffers_hold_and_load_reads_it_back() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(2);
    // Thousands of KiB-sized tensors (norms, biases), a few large ones, several dtypes.
    let mut specs: Vec<(String, Dtype, Vec<usize>)> =
        (0..3000).map(|i| (format!("bias.{i}"), Dtype::F32, vec![rng.usize(1..600)])).collect();
    specs.extend((0..4).map(|i| (format!("w.{i}"), Dtype::BF16, vec![256, rng.usize(100..600)])));
    specs.push(("scale".into(), Dtype::F64, vec![]));
    specs.push(("mask".into(), Dtype::BOOL, vec![3, 5]));
    let mut want = HashMap::new();
    let mut tensors = Vec::new();
    for (name, dtype, shape) in &specs {
        let len = super::header::byte_len(shape, *dtype).unwrap() as usize;
        let bytes = random_vec(&mut rng, len);
        // Buffers longer than the tensor: the first bytes are saved.
        let b = d.allocate(len as u64 + rng.u64(0..100)).unwrap();
        d.upload_at(b, 0, &bytes).unwrap();
        want.insert(name.clone(), bytes);
        tensors.push((name.as_str(), *dtype, shape.as_slice(), b));
    }
    let file = TempPath::new("many.safetensors");
    let mut saved = Vec::new();
    for mode in [WriteMode::Pwrite, WriteMode::Mapped] {
        let mut last = (0, 1);
        let meta = HashMap::from([("source".to_owned(), "test".to_owned())]);
        let options = SaveOptions::new()
            .metadata(meta)
            .batch_bytes(1 << 20)
            .write_mode(mode)
            .progress(|done, total| last = (done, total));
        let mapped_before = super::sink::MAPPED.with(|n| n.get());
        d.save_safetensors_configured(&file.0, &tensors, options).unwrap();
        // The file is mapped where the mode asks for it and its file system preallocates.
        let mapped = super::sink::MAPPED.with(|n| n.get()) - mapped_before;
        let preallocates = super::sink::tests::temp_dir_preallocates();
        assert_eq!(mapped, usize::from(mode == WriteMode::Mapped && preallocates), "{mode:?}");
        assert_eq!(last.0, last.1, "{mode:?}");
        let bytes = std::fs::read(&file.0).unwrap();
        let back = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(back.len(), specs.len());
        for (name, view) in back.tensors() {
            assert_eq!(view.data(), &want[&name][..], "{mode:?} {name}");
        }
        saved.push(bytes);
    }
    assert!(saved[0] == saved[1], "both modes write the same file");
    let ckpt = d.load_safetensors(&file.0).unwrap();
    assert_eq!(ckpt.len(), specs.len());
    assert_eq!(ckpt.metadata().unwrap()["source"], "test");
    for t in ckpt.tensors() {
        assert_eq!(d.download_range(t.buffer(), 0, t.len()).unwrap(), want[t.name()], "{}", t.name());
    }
    let (parts, arena) = ckpt.into_parts();
    assert!(arena.is_none());
    let owned: Vec<_> = parts.into_iter().map(|t| t.into_owned().unwrap()).collect();
    assert_eq!(owned.len(), specs.len());
}

/// A checkpoint many times the pinned cap moves whole, its pinned memory within the cap.
#[test]
fn a_checkpoint_larger_than_the_pinned_pool_loads_within_it() {
    let config = Config { pinned_cap_bytes: 2 << 20, chunk_bytes: 256 << 10, ..small_chunks() };
    let d = device(config.clone());
    let file = TempPath::new("large.safetensors");
    let shapes: Vec<(String, Vec<usize>)> =
        (0..12).map(|i| (format!("t{i}"), vec![1024, 1024 + i])).collect();
    let data = write_with_crate(&file.0, &shapes, 3);
    let ckpt = d.load_safetensors(&file.0).unwrap();
    assert!(ckpt.total_bytes() > 10 * config.pinned_cap_bytes);
    check_loaded(&d, &ckpt, &data);
    assert!(d.telemetry().pinned.reserved_bytes <= config.pinned_cap_bytes);
    let out = TempPath::new("large-out.safetensors");
    ckpt.save(&d, &out.0).unwrap();
    assert!(d.telemetry().pinned.reserved_bytes <= config.pinned_cap_bytes);
    assert_eq!(
        std::fs::read(&out.0).unwrap(),
        std::fs::read(&file.0).unwrap(),
        "the same order, the same bytes"
    );
}

fn weights_error(e: Error) -> WeightsError {
    match e {
        Error::Weights(w) => w,
        other => panic!("not a weights error: {other}"),
    }
}

#[test]
fn bad_files_are_refused_with_nothing_allocated() {
    let d = device(Config::default());
    let good = TempPath::new("good.safetensors");
    write_with_crate(&good.0, &decoder(1, 64), 4);
    let bytes = std::fs::read(&good.0).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + header_len]).unwrap().to_owned();

    let bad = TempPath::new("bad.safetensors");
    let mut cases: Vec<BadCase> = vec![
        (bytes[..bytes.len() - 1].to_vec(), |e| matches!(e, WeightsError::Truncated { .. })),
        (bytes[..header_len / 2].to_vec(), |e| matches!(e, WeightsError::Truncated { .. })),
        (Vec::new(), |e| matches!(e, WeightsError::Truncated { .. })),
        (bytes[8..].to_vec(), |e| {
            matches!(e, WeightsError::Truncated { .. } | WeightsError::BadHeader { .. })
        }),
    ];
    // The same header with a dtype it does not know, or offsets that lie (same length, so
    // that only the lie differs).
    let swap = |from: &str, to: &str| {
        let h = header.replacen(from, to, 1);
        assert_eq!(h.len(), header.len(), "{from} -> {to}");
        let mut f = bytes.clone();
        f[8..8 + header_len].copy_from_slice(h.as_bytes());
        f
    };
    cases.push((swap("BF16", "Q4_K"), |e| matches!(e, WeightsError::UnknownDtype { .. })));
    let first_offsets = header.find("\"data_offsets\":[0,").unwrap();
    let lie = header[first_offsets..].find(']').unwrap() + first_offsets;
    let span = &header[first_offsets..lie];
    let lied = span.replacen("[0,", "[1,", 1);
    cases.push((swap(span, &lied), |e| matches!(e, WeightsError::BadHeader { .. })));
    for (i, (content, expected)) in cases.into_iter().enumerate() {
        std::fs::write(&bad.0, content).unwrap();
        let e = weights_error(d.load_safetensors(&bad.0).unwrap_err());
        assert!(expected(&e), "case {i}: {e}");
        assert!(e.to_string().contains("Fix: "), "{e}");
        assert_eq!(d.allocated_bytes(), 0, "case {i}");
    }
    let missing = weights_error(d.load_safetensors("/no/such/model.safetensors").unwrap_err());
    assert!(matches!(&missing, WeightsError::Io { operation: "opening", .. }), "{missing}");
    assert!(missing.to_string().contains("/no/such/model.safetensors"));
}

#[test]
fn checkpoints_past_the_budget_are_refused_with_nothing_allocated() {
    // The model GPU has 4 GiB: 1/4096 of it is 1 MiB.
    let d = device(Config::default().with_budget_fraction(1.0 / 4096.0));
    let one = TempPath::new("one-large.safetensors");
    write_with_crate(&one.0, &[("huge".into(), vec![1024, 1024])], 5);
    let e = weights_error(d.load_safetensors(&one.0).unwrap_err());
    assert!(matches!(&e, WeightsError::OverBudget { what, .. } if what.contains("huge")), "{e}");
    let many = TempPath::new("many-small.safetensors");
    let shapes: Vec<_> = (0..5).map(|i| (format!("t{i}"), vec![128, 1024])).collect();
    write_with_crate(&many.0, &shapes, 6);
    for arena in [false, true] {
        let e = weights_error(
            d.load_safetensors_configured(&many.0, LoadOptions::new().arena(arena)).unwrap_err(),
        );
        assert!(matches!(&e, WeightsError::OverBudget { what, .. } if what == "the checkpoint"), "{e}");
    }
    // Within the ceiling, but not with what the device holds already: refused part way,
    // and what the load allocated is freed again.
    let held = d.allocate(800 << 10).unwrap();
    let two = TempPath::new("two.safetensors");
    write_with_crate(&two.0, &[("a".into(), vec![64, 1024]), ("b".into(), vec![128, 1024])], 7);
    let e = weights_error(d.load_safetensors(&two.0).unwrap_err());
    assert!(matches!(&e, WeightsError::Allocation { tensor, .. } if tensor.contains('b')), "{e}");
    assert!(e.to_string().contains("Fix: "), "{e}");
    assert_eq!(d.allocated_bytes(), 800 << 10);
    d.free(held).unwrap();
    assert_eq!(d.load_safetensors(&two.0).unwrap().len(), 2);
}

#[test]
fn bad_tensors_to_save_leave_no_file_behind() {
    let d = device(Config::default());
    let b = d.allocate(64).unwrap();
    let path = TempPath::new("refused.safetensors");
    std::fs::write(&path.0, b"before").unwrap();
    let cases: [Named<'_>; 3] = [
        &[("a", Dtype::F32, &[17], b)],
        &[("a", Dtype::F32, &[2], b), ("a", Dtype::F32, &[2], b)],
        &[("a", Dtype::F4, &[3], b)],
    ];
    for tensors in cases {
        let e = weights_error(d.save_safetensors(&path.0, tensors).unwrap_err());
        assert!(matches!(e, WeightsError::BadTensor { .. }), "{e}");
    }
    d.free(b).unwrap();
    let freed: Named<'_> = &[("a", Dtype::U8, &[4], b)];
    assert!(matches!(d.save_safetensors(&path.0, freed), Err(Error::FreedBuffer { .. })));
    assert_eq!(std::fs::read(&path.0).unwrap(), b"before", "left as it was");
    let dir = path.0.parent().unwrap();
    let partials = std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| {
            e.as_ref().unwrap().file_name().to_string_lossy().contains(".refused.safetensors.partial-")
        })
        .count();
    assert_eq!(partials, 0);
    let missing_dir =
        weights_error(d.save_safetensors("/no/such/dir/x.safetensors", &[] as Named<'_>).unwrap_err());
    assert!(matches!(missing_dir, WeightsError::Io { operation: "creating", .. }), "{missing_dir}");
}

#[cfg(target_os = "linux")]
#[test]
fn a_load_unmaps_its_file_once_it_returns() {
    let d = device(Config::default());
    let file = TempPath::new("unmapped.safetensors");
    let data = write_with_crate(&file.0, &decoder(2, 256), 3);
    let mapped = || std::fs::read_to_string("/proc/self/maps").unwrap().contains(file.0.to_str().unwrap());
    let ckpt = d.load_safetensors(&file.0).unwrap();
    // Unmapped on a thread of its own: soon, not necessarily before the load returns.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while mapped() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(!mapped(), "the checkpoint's file is still mapped 10 s after the load returned");
    // The bytes were all moved before the mapping went.
    check_loaded(&d, &ckpt, &data);
}

/// Two threads saving different bytes to one path at once, in each mode: each save writes a
/// partial file of its own (never one the other maps or truncates), so the file left is one
/// save's whole, and no partial file stays.
#[test]
fn two_saves_to_one_path_at_once_leave_one_whole_file() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(12);
    let shapes: Vec<(String, Vec<usize>)> =
        (0..40).map(|i| (format!("t.{i}"), vec![rng.usize(1..40_000)])).collect();
    // Each save's bytes by tensor name, and its buffers.
    type Set = (HashMap<String, Vec<u8>>, Vec<ResidentBuffer>);
    let sets: Vec<Set> = (0..2)
        .map(|_| {
            let mut want = HashMap::new();
            let mut buffers = Vec::new();
            for (name, shape) in &shapes {
                let bytes = random_vec(&mut rng, shape[0]);
                let b = d.allocate(bytes.len() as u64).unwrap();
                d.upload(b, &bytes).unwrap();
                want.insert(name.clone(), bytes);
                buffers.push(b);
            }
            (want, buffers)
        })
        .collect();
    let path = TempPath::new("raced.safetensors");
    let gpu = crate::testing::model::shared();
    for mode in [WriteMode::Mapped, WriteMode::Pwrite] {
        for round in 0..5 {
            std::thread::scope(|s| {
                for (_, buffers) in &sets {
                    let (gpu, d, path, shapes) = (gpu.clone(), &d, &path, &shapes);
                    s.spawn(move || {
                        crate::testing::model::join(gpu);
                        let tensors: Vec<_> = shapes
                            .iter()
                            .zip(buffers)
                            .map(|((name, shape), &b)| (name.as_str(), Dtype::U8, shape.as_slice(), b))
                            .collect();
                        let options = SaveOptions::new().write_mode(mode);
                        d.save_safetensors_configured(&path.0, &tensors, options).unwrap();
                    });
                }
            });
            let bytes = std::fs::read(&path.0).unwrap();
            let back = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let first = back.tensor("t.0").unwrap().data().to_vec();
            let which = sets.iter().position(|(want, _)| want["t.0"] == first).expect("one save's bytes");
            for (name, view) in back.tensors() {
                assert_eq!(view.data(), &sets[which].0[&name][..], "{mode:?}, round {round}: {name}");
            }
            let partials = std::fs::read_dir(path.0.parent().unwrap())
                .unwrap()
                .filter(|e| {
                    e.as_ref().unwrap().file_name().to_string_lossy().contains(".raced.safetensors.partial-")
                })
                .count();
            assert_eq!(partials, 0, "{mode:?}, round {round}");
        }
    }
}

/// A save of empty tensors only (and of none) writes a whole file and reports its end once.
#[test]
fn a_save_of_no_bytes_reports_its_end_once() {
    let d = device(Config::default());
    let b = d.allocate(16).unwrap();
    let file = TempPath::new("empty.safetensors");
    let empties: Named<'_> = &[("a", Dtype::F32, &[0], b), ("b", Dtype::BF16, &[3, 0], b)];
    for (tensors, mode) in
        [(empties, WriteMode::Mapped), (empties, WriteMode::Pwrite), (&[][..], WriteMode::Mapped)]
    {
        let mut calls = Vec::new();
        let options = SaveOptions::new().write_mode(mode).progress(|done, total| calls.push((done, total)));
        d.save_safetensors_configured(&file.0, tensors, options).unwrap();
        assert_eq!(calls, [(0, 0)], "{mode:?}, {} tensors", tensors.len());
        let bytes = std::fs::read(&file.0).unwrap();
        assert_eq!(safetensors::SafeTensors::deserialize(&bytes).unwrap().len(), tensors.len());
    }
}

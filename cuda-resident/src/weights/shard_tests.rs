//! Sharded saves and loads on the model driver: every byte back, shard boundaries, the index
//! Hugging Face writes, and every failure leaving no file and nothing allocated.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::write::tests_hook;
use super::{Dtype, LoadOptions, SaveOptions, WeightsError, WriteMode};
use crate::testing::{device, random_vec, small_chunks};
use crate::{Config, Device, Error, ResidentBuffer};

/// A folder of its own in the temporary folder, removed with what is in it when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("cuda-resident-shards-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    /// The names of the files in it, sorted.
    fn files(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Tensors on the device (random bytes, `lens` bytes each, U8), and their bytes by name.
struct OnDevice {
    tensors: Vec<(String, Dtype, Vec<usize>, ResidentBuffer)>,
    want: HashMap<String, Vec<u8>>,
}

impl OnDevice {
    fn new(d: &Device, lens: &[usize], seed: u64) -> OnDevice {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut tensors = Vec::new();
        let mut want = HashMap::new();
        for (i, &len) in lens.iter().enumerate() {
            let name = format!("t.{i:04}");
            let bytes = random_vec(&mut rng, len);
            let b = d.allocate(len.max(1) as u64).unwrap();
            if len > 0 {
                d.upload(b, &bytes).unwrap();
            }
            tensors.push((name.clone(), Dtype::U8, vec![len], b));
            want.insert(name, bytes);
        }
        OnDevice { tensors, want }
    }

    fn save(&self, d: &Device, path: &Path, options: SaveOptions<'_>) -> crate::Result<()> {
        d.save_safetensors_configured(path, &self.tensors, options)
    }

    /// Loads `index` and compares every byte with what was saved.
    fn check_load(&self, d: &Device, index: &Path, arena: bool) {
        let ckpt = d.load_safetensors_configured(index, LoadOptions::new().arena(arena)).unwrap();
        assert_eq!(ckpt.len(), self.want.len());
        assert_eq!(ckpt.total_bytes(), self.want.values().map(|v| v.len() as u64).sum::<u64>());
        for t in ckpt.tensors() {
            let want = &self.want[t.name()];
            assert_eq!(t.len(), want.len() as u64, "{}", t.name());
            if !t.is_empty() {
                assert_eq!(&d.download_range(t.buffer(), t.offset(), t.len()).unwrap(), want, "{}", t.name());
            }
        }
    }
}

fn weights_error(e: Error) -> WeightsError {
    match e {
        Error::Weights(w) => w,
        other => panic!("not a weights error: {other}"),
    }
}

/// The index's weight map, and the shard files it names.
fn read_index(path: &Path) -> (serde_json::Value, Vec<String>) {
    let index: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let mut files: Vec<String> =
        index["weight_map"].as_object().unwrap().values().map(|v| v.as_str().unwrap().to_owned()).collect();
    files.sort();
    files.dedup();
    (index, files)
}

#[test]
fn a_sharded_save_loads_back_every_byte_at_every_boundary() {
    let k = 64 << 10;
    // (tensor lengths, shard bytes, shards expected)
    let cases: Vec<(Vec<usize>, u64, usize)> = vec![
        (vec![k, k, k], k as u64, 3),                       // each exactly n
        (vec![10, 3 * k, 10], k as u64, 3),                 // one larger than n, alone
        (vec![0, 0, 100, 0, 50, 0], 100, 2),                // empty tensors ride along
        (vec![5 * k], 1, 1),                                // one tensor
        (vec![300; 1000], 30_000, 10),                      // 1000 small tensors
        (vec![k / 2, k / 2, k / 2, k / 2, 1], k as u64, 3), // two to a shard
    ];
    let runs = [
        (small_chunks(), false, WriteMode::Mapped),
        (small_chunks(), false, WriteMode::Pwrite),
        (Config::default(), true, WriteMode::Mapped),
    ];
    for (config, arena, mode) in runs {
        let cap = config.pinned_cap_bytes;
        let d = device(config);
        for (c, (lens, bytes, expected)) in cases.iter().enumerate() {
            let dir = TempDir::new(&format!("bounds-{c}-{arena}-{mode:?}"));
            let on = OnDevice::new(&d, lens, c as u64);
            let path = dir.0.join("model.safetensors");
            let mut last = (0, 1);
            let options = SaveOptions::new()
                .shard_bytes(*bytes)
                .write_mode(mode)
                .progress(|done, total| last = (done, total));
            on.save(&d, &path, options).unwrap();
            assert_eq!(last.0, last.1, "case {c}");
            assert!(d.telemetry().pinned.reserved_bytes <= cap, "case {c}: pinned memory within the cap");
            let index = dir.0.join("model.safetensors.index.json");
            let (json, files) = read_index(&index);
            assert_eq!(files.len(), *expected, "case {c}: {files:?}");
            let mut all = files.clone();
            all.push("model.safetensors.index.json".into());
            all.sort();
            assert_eq!(dir.files(), all, "case {c}: the shards and the index, nothing else");
            assert_eq!(files[0], format!("model-00001-of-{expected:05}.safetensors"));
            let total: usize = lens.iter().sum();
            assert_eq!(json["metadata"]["total_size"], total as u64);
            // Each shard is a checkpoint of its own, as the safetensors crate reads it.
            for f in &files {
                let bytes = std::fs::read(dir.0.join(f)).unwrap();
                let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
                for (name, view) in st.tensors() {
                    assert_eq!(json["weight_map"][&name], f.as_str());
                    assert_eq!(view.data(), &on.want[&name][..], "{name}");
                }
            }
            on.check_load(&d, &index, arena);
            for (.., b) in on.tensors {
                d.free(b).unwrap();
            }
            assert_eq!(d.allocated_bytes(), 0);
        }
    }
}

#[test]
fn shards_by_count_and_a_single_file_share_one_writer() {
    let d = device(small_chunks());
    let mut rng = fastrand::Rng::with_seed(9);
    let lens: Vec<usize> =
        (0..200).map(|i| if i % 50 == 0 { 300 << 10 } else { rng.usize(0..5000) }).collect();
    let on = OnDevice::new(&d, &lens, 10);
    let dir = TempDir::new("count");
    let path = dir.0.join("w");
    on.save(&d, &path, SaveOptions::new().shards(16)).unwrap();
    let (_, files) = read_index(&dir.0.join("w.safetensors.index.json"));
    assert!(files.len() > 4 && files.len() <= 16, "{files:?}");
    assert!(files.iter().all(|f| f.starts_with("w-000") && f.contains(&format!("-of-{:05}", files.len()))));
    on.check_load(&d, &dir.0.join("w.safetensors.index.json"), false);
    // One file, no index: the same bytes.
    let one = dir.0.join("one.safetensors");
    on.save(&d, &one, SaveOptions::new()).unwrap();
    on.check_load(&d, &one, false);
    assert!(!dir.files().iter().any(|f| f.starts_with("one") && f.ends_with(".json")));
}

#[test]
fn a_failing_or_panicking_shard_leaves_no_file() {
    let d = device(small_chunks());
    let lens = vec![200 << 10; 8];
    let on = OnDevice::new(&d, &lens, 11);
    let runs = [tests_hook::FAIL, tests_hook::PANIC]
        .into_iter()
        .flat_map(|m| [(m, WriteMode::Mapped), (m, WriteMode::Pwrite)]);
    for (marker, mode) in runs {
        let dir = TempDir::new(&format!("{marker}-{mode:?}"));
        let path = dir.0.join(format!("{marker}.safetensors"));
        let saved = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            on.save(&d, &path, SaveOptions::new().shard_bytes(200 << 10).write_mode(mode))
        }));
        match (marker, saved) {
            (tests_hook::FAIL, Ok(Err(e))) => {
                assert!(matches!(weights_error(e), WeightsError::Io { operation: "writing", .. }))
            }
            (tests_hook::PANIC, Err(_)) => {}
            (m, other) => panic!("{m}: {:?}", other.map(|r| r.map_err(|e| e.to_string()))),
        }
        assert_eq!(dir.files(), Vec::<String>::new(), "{marker}");
    }
    // A freed buffer among the tensors: refused before any file is made.
    let dir = TempDir::new("freed");
    let mut tensors = on.tensors.clone();
    d.free(tensors[5].3).unwrap();
    let e =
        d.save_safetensors_configured(dir.0.join("m.safetensors"), &tensors, SaveOptions::new().shards(4));
    assert!(matches!(e, Err(Error::FreedBuffer { .. })), "{e:?}");
    tensors[5].3 = d.allocate(1).unwrap();
    tensors[5].2 = vec![2];
    let e =
        d.save_safetensors_configured(dir.0.join("m.safetensors"), &tensors, SaveOptions::new().shards(4));
    assert!(matches!(e.map_err(weights_error), Err(WeightsError::BadTensor { .. })));
    assert_eq!(dir.files(), Vec::<String>::new());
}

#[test]
fn bad_indexes_and_shards_are_refused_with_a_fix_and_nothing_allocated() {
    let d = device(Config::default());
    let on = OnDevice::new(&d, &[1000, 2000, 3000, 4000], 12);
    let dir = TempDir::new("bad");
    let path = dir.0.join("m.safetensors");
    on.save(&d, &path, SaveOptions::new().shard_bytes(3000)).unwrap();
    let index = dir.0.join("m.safetensors.index.json");
    let good = std::fs::read_to_string(&index).unwrap();
    let held = d.allocated_bytes();
    let shard = |i: usize| format!("m-{i:05}-of-00003.safetensors");
    let bad = dir.0.join("bad.index.json");
    let cases: Vec<(String, &str)> = vec![
        ("{\"weight_map\": ".into(), "not JSON"),
        (good.replace(&shard(3), "m-00009-of-00003.safetensors"), "cannot be read"),
        (
            good.replacen(
                &format!("\"t.0003\": \"{}\"", shard(3)),
                &format!("\"t.0003\": \"{}\"", shard(2)),
                1,
            ),
            "does not hold",
        ),
        (good.replacen("\"t.0000\"", "\"t.0009\"", 1), "does not name"),
        (
            good.replacen(
                "\"weight_map\": {",
                "\"weight_map\": {\n    \"ghost\": \"m-00001-of-00003.safetensors\",",
                1,
            ),
            "does not hold",
        ),
    ];
    for (text, says) in cases {
        assert_ne!(text, good);
        std::fs::write(&bad, &text).unwrap();
        let e = weights_error(d.load_safetensors(&bad).unwrap_err());
        assert!(matches!(e, WeightsError::BadIndex { .. }), "{e}");
        let message = e.to_string();
        assert!(message.contains(says) && message.contains("Fix: "), "{says}: {message}");
        assert_eq!(d.allocated_bytes(), held);
    }
    // A tensor in two shards (written by the safetensors crate), the index naming one.
    let view = safetensors::tensor::TensorView::new(Dtype::U8, vec![2], &[1, 2]).unwrap();
    for f in ["a.safetensors", "b.safetensors"] {
        std::fs::write(dir.0.join(f), safetensors::serialize([("x", view.clone())], None).unwrap()).unwrap();
    }
    let two =
        r#"{"metadata": {"total_size": 2}, "weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}"#;
    std::fs::write(&bad, two).unwrap();
    let e = weights_error(d.load_safetensors(&bad).unwrap_err()).to_string();
    assert!(e.contains("\"x\" is in shard") && e.contains("two shards") && e.contains("Fix: "), "{e}");
    assert_eq!(d.allocated_bytes(), held);
    let missing = weights_error(d.load_safetensors(dir.0.join("none.index.json")).unwrap_err());
    assert!(matches!(missing, WeightsError::Io { operation: "opening", .. }), "{missing}");
    // A shard cut short: refused as a single file is.
    let first = dir.0.join(shard(1));
    let bytes = std::fs::read(&first).unwrap();
    std::fs::write(&first, &bytes[..bytes.len() - 1]).unwrap();
    let e = weights_error(d.load_safetensors(&index).unwrap_err());
    assert!(matches!(e, WeightsError::Truncated { .. }), "{e}");
    assert_eq!(d.allocated_bytes(), held);
}

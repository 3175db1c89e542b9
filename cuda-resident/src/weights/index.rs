//! A sharded checkpoint's index, Hugging Face's `model.safetensors.index.json`:
//! `{"metadata": {"total_size": N}, "weight_map": {"tensor.name": "model-00001-of-00004.safetensors", ...}}`.
//! Written after the shards of a sharded save; read, and checked against every shard's
//! header, by a load given its path.

use std::collections::{BTreeMap, HashMap};
use std::path::{Component, Path, PathBuf};

use serde_json::{Map, Value, json};

use super::error::WeightsError;
use super::header::Entry;

/// The index's text: `total_size` (bytes of tensor data of every shard) and the shard of
/// each tensor (sorted by name, as Hugging Face's writers sort it), two-space indented.
pub(super) fn to_json<'a>(total_size: u64, map: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let weight_map: Map<String, Value> =
        map.into_iter().map(|(name, file)| (name.to_owned(), Value::String(file.to_owned()))).collect();
    let index = json!({ "metadata": { "total_size": total_size }, "weight_map": weight_map });
    let mut text = serde_json::to_string_pretty(&index).expect("a map of strings serializes");
    text.push('\n');
    text
}

/// The shards an index names, each (its path, beside the index) with the tensors the index
/// assigns to it, ordered by file name.
pub(super) type Shards = Vec<(PathBuf, Vec<String>)>;

fn bad(path: &Path, detail: String, fix: &'static str) -> WeightsError {
    WeightsError::BadIndex { path: path.to_owned(), detail, fix }
}

const FIX_JSON: &str = "write the index again (Device::save_safetensors_configured with SaveOptions::shard_bytes, \
                        or Hugging Face's save_pretrained), or pass the path of a single .safetensors file";

/// Reads the index at `path` and the shards it names.
pub(super) fn read(path: &Path) -> Result<Shards, WeightsError> {
    let text = std::fs::read(path).map_err(|e| WeightsError::io("opening", path, &e))?;
    parse(path, &text)
}

/// The shards of index text `text` (`path` names it in errors and is where shards are looked
/// for).
pub(super) fn parse(path: &Path, text: &[u8]) -> Result<Shards, WeightsError> {
    let value: Value =
        serde_json::from_slice(text).map_err(|e| bad(path, format!("it is not JSON ({e})"), FIX_JSON))?;
    let map = value
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad(path, "it has no \"weight_map\" object".into(), FIX_JSON))?;
    let dir = path.parent().unwrap_or(Path::new(""));
    let mut shards: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| {
            bad(path, format!("tensor {name:?} maps to {file}, not to a file name"), FIX_JSON)
        })?;
        let plain = Path::new(file).components().collect::<Vec<_>>();
        if !matches!(plain[..], [Component::Normal(_)]) {
            return Err(bad(
                path,
                format!("tensor {name:?} maps to {file:?}, which is not a file name beside the index"),
                "keep every shard in the index's folder and name it by its file name alone",
            ));
        }
        shards.entry(file).or_default().push(name.clone());
    }
    Ok(shards.into_iter().map(|(file, names)| (dir.join(file), names)).collect())
}

/// The error of a shard the index names that cannot be opened or mapped.
pub(super) fn missing(index: &Path, shard: &Path, cause: &WeightsError) -> WeightsError {
    bad(
        index,
        format!("the shard {} it names cannot be read: {cause}", shard.display()),
        "copy every shard the index names into the index's folder, whole",
    )
}

/// Checks that the header of `shard` holds exactly the tensors the index assigns to it
/// (`named`); `owner` gives the shard the index assigns each tensor to.
pub(super) fn check_shard(
    index: &Path,
    shard: &Path,
    entries: &[Entry],
    named: &[String],
    owner: &HashMap<&str, &Path>,
) -> Result<(), WeightsError> {
    let fix = "write the index again from the shards, or copy the shards the index was written with";
    for e in entries {
        match owner.get(e.name.as_str()) {
            Some(&at) if at == shard => {}
            Some(at) => {
                return Err(bad(
                    index,
                    format!(
                        "tensor {:?} is in shard {}, but the index puts it in {} (a tensor in two shards, or \
                         the index out of date)",
                        e.name,
                        shard.display(),
                        at.display()
                    ),
                    fix,
                ));
            }
            None => {
                return Err(bad(
                    index,
                    format!(
                        "shard {} holds tensor {:?}, which the index does not name",
                        shard.display(),
                        e.name
                    ),
                    fix,
                ));
            }
        }
    }
    if entries.len() != named.len() {
        let held: std::collections::HashSet<&str> = entries.iter().map(|e| e.name.as_str()).collect();
        let lost = named.iter().find(|n| !held.contains(n.as_str())).map_or("", |n| n.as_str());
        return Err(bad(
            index,
            format!("the index names tensor {lost:?} in shard {}, which does not hold it", shard.display()),
            fix,
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An index as Hugging Face's `save_pretrained` writes it, by hand.
    const HF: &str = r#"{
  "metadata": {
    "total_size": 16060522496
  },
  "weight_map": {
    "lm_head.weight": "model-00004-of-00004.safetensors",
    "model.embed_tokens.weight": "model-00001-of-00004.safetensors",
    "model.layers.0.input_layernorm.weight": "model-00001-of-00004.safetensors",
    "model.norm.weight": "model-00004-of-00004.safetensors"
  }
}
"#;

    #[test]
    fn a_hugging_face_index_parses_and_ours_reads_the_same() {
        let path = Path::new("/ckpt/model.safetensors.index.json");
        let shards = parse(path, HF.as_bytes()).unwrap();
        assert_eq!(shards.len(), 2);
        assert_eq!(shards[0].0, Path::new("/ckpt/model-00001-of-00004.safetensors"));
        assert_eq!(shards[0].1, ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"]);
        assert_eq!(shards[1].1, ["lm_head.weight", "model.norm.weight"]);
        let ours = to_json(
            16060522496,
            [
                ("model.norm.weight", "model-00004-of-00004.safetensors"),
                ("model.embed_tokens.weight", "model-00001-of-00004.safetensors"),
                ("lm_head.weight", "model-00004-of-00004.safetensors"),
                ("model.layers.0.input_layernorm.weight", "model-00001-of-00004.safetensors"),
            ],
        );
        assert_eq!(ours, HF, "the same text, keys sorted");
    }

    #[test]
    fn bad_indexes_are_refused_with_a_fix() {
        let path = Path::new("i.index.json");
        for text in [
            "{",
            "[]",
            r#"{"metadata": {}}"#,
            r#"{"weight_map": {"a": 3}}"#,
            r#"{"weight_map": {"a": "../x.safetensors"}}"#,
            r#"{"weight_map": {"a": "/abs.safetensors"}}"#,
        ] {
            let e = parse(path, text.as_bytes()).unwrap_err();
            assert!(matches!(e, WeightsError::BadIndex { .. }), "{text}: {e}");
            assert!(e.to_string().contains("Fix: "), "{e}");
        }
    }
}

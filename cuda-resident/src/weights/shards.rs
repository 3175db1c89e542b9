//! Sharded checkpoints as Hugging Face writes them: which tensors go into which shard, and
//! the files' names. Pure: no device, no file system.
//!
//! A save to `dir/model.safetensors` with sharding writes `dir/model-00001-of-00004.safetensors`
//! ... `dir/model-00004-of-00004.safetensors` and `dir/model.safetensors.index.json`.

use std::path::{Path, PathBuf};

/// How a save splits its tensors between files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Sharding {
    /// Tensors in the given order packed into shards of at most this many bytes of data
    /// each; a tensor larger alone in its shard.
    Bytes(u64),
    /// Tensors in the given order cut into this many shards of about equal bytes (fewer
    /// where there are fewer tensors than shards, or a tensor spans several shares).
    Count(usize),
}

/// The shard of each tensor (`lens`: their bytes, in the given order), numbered from 0 with
/// no shard left empty, and the number of shards (at least 1).
pub(super) fn assign(lens: &[u64], sharding: Sharding) -> (Vec<usize>, usize) {
    let mut of = Vec::with_capacity(lens.len());
    match sharding {
        Sharding::Bytes(most) => {
            let (mut shard, mut held, mut any) = (0usize, 0u64, false);
            for &len in lens {
                if any && held.checked_add(len).is_none_or(|h| h > most) {
                    shard += 1;
                    held = 0;
                }
                held = held.saturating_add(len);
                any = true;
                of.push(shard);
            }
        }
        Sharding::Count(count) => {
            // Each tensor goes to the share its first byte falls in; numbered densely after.
            let total: u64 = lens.iter().sum();
            let count = count.max(1) as u128;
            let mut at = 0u64;
            for &len in lens {
                let share =
                    if total == 0 { 0 } else { (u128::from(at) * count / u128::from(total)) as usize };
                of.push(share);
                at += len;
            }
            let mut last = None;
            let mut dense = 0usize;
            for s in &mut of {
                if last.is_some_and(|l| l != *s) {
                    dense += 1;
                }
                last = Some(*s);
                *s = dense;
            }
        }
    }
    let shards = of.last().map_or(1, |&s| s + 1);
    (of, shards)
}

/// The stem of a save to `path`: its file name less a trailing `.safetensors`.
fn stem(path: &Path) -> String {
    let name = path.file_name().map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
    name.strip_suffix(".safetensors").unwrap_or(&name).to_owned()
}

/// The file name of shard `i` (from 0) of `count`: `<stem>-0000i-of-0000k.safetensors`,
/// numbered from 1 as Hugging Face numbers them.
pub(super) fn shard_name(path: &Path, i: usize, count: usize) -> String {
    format!("{}-{:05}-of-{:05}.safetensors", stem(path), i + 1, count)
}

/// The index beside the shards of a save to `path`: `<stem>.safetensors.index.json`.
pub(super) fn index_path(path: &Path) -> PathBuf {
    path.with_file_name(format!("{}.safetensors.index.json", stem(path)))
}

/// Whether `path` names an index (`*.index.json`) rather than a checkpoint file.
pub(super) fn is_index(path: &Path) -> bool {
    path.file_name().is_some_and(|n| n.to_string_lossy().ends_with(".index.json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_by_bytes_keep_the_order_and_put_a_large_tensor_alone() {
        let (of, n) = assign(&[4, 4, 8, 9, 0, 0, 3, 5], Sharding::Bytes(8));
        assert_eq!(of, [0, 0, 1, 2, 3, 3, 3, 3]);
        assert_eq!(n, 4);
        assert_eq!(assign(&[], Sharding::Bytes(8)), (vec![], 1));
        assert_eq!(assign(&[0, 0], Sharding::Bytes(0)), (vec![0, 0], 1));
        assert_eq!(assign(&[1, 1], Sharding::Bytes(0)).1, 2);
        assert_eq!(assign(&[u64::MAX, 1], Sharding::Bytes(u64::MAX)).1, 2);
    }

    #[test]
    fn shards_by_count_are_about_equal_and_never_empty() {
        let (of, n) = assign(&[10; 16], Sharding::Count(4));
        assert_eq!(n, 4);
        assert_eq!(of.iter().filter(|&&s| s == 3).count(), 4);
        // A tensor spanning three shares leaves them out: 2 shards, numbered densely.
        let (of, n) = assign(&[1, 100, 1], Sharding::Count(4));
        assert_eq!((of, n), (vec![0, 0, 1], 2));
        assert_eq!(assign(&[5], Sharding::Count(16)), (vec![0], 1));
        assert_eq!(assign(&[0, 0, 0], Sharding::Count(3)), (vec![0, 0, 0], 1));
    }

    #[test]
    fn names_follow_hugging_face() {
        let p = Path::new("/ckpt/model.safetensors");
        assert_eq!(shard_name(p, 0, 4), "model-00001-of-00004.safetensors");
        assert_eq!(index_path(p), Path::new("/ckpt/model.safetensors.index.json"));
        assert_eq!(shard_name(Path::new("w"), 9, 10), "w-00010-of-00010.safetensors");
        assert!(is_index(&index_path(p)) && !is_index(p));
    }
}

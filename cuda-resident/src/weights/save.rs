//! [`Device::save_safetensors`]: the tensors checked, split between shards where asked, each
//! file's header from the safetensors crate; every file written under a partial name
//! (`write.rs`) and renamed into place once all are whole, a sharded save's index last. On
//! any error, or a panic, every file of the save is removed.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use safetensors::{Dtype, View};

use super::error::WeightsError;
use super::header::byte_len;
use super::sink::Target;
use super::write::{self, Job};
use super::{SaveOptions, index, shards};
use crate::alloc::ResidentBuffer;
use crate::device::Device;
use crate::error::Result;

/// One tensor to save: `shape x dtype` bytes of `buffer` at `offset`.
pub(super) struct Item<'a> {
    pub(super) name: &'a str,
    pub(super) dtype: Dtype,
    pub(super) shape: &'a [usize],
    pub(super) buffer: ResidentBuffer,
    pub(super) offset: u64,
}

/// A tensor as the safetensors crate's serializer sees it for the header: dtype, shape and
/// length, and no bytes, so that `safetensors::serialize` gives the header alone (it
/// places tensors by `data_len` and appends each one's `data`, empty here).
struct HeaderOnly<'a> {
    dtype: Dtype,
    shape: &'a [usize],
    len: usize,
}

impl View for HeaderOnly<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&[])
    }
    fn data_len(&self) -> usize {
        self.len
    }
}

/// The files of a save being written: removed on the way out (the finished ones renamed
/// into place too) unless the save completes.
#[derive(Default)]
struct Partials {
    paths: Vec<PathBuf>,
    kept: bool,
}

impl Drop for Partials {
    fn drop(&mut self) {
        if !self.kept {
            for path in &self.paths {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

/// Where each tensor of a file goes: `(offset in the file, item)`, in file order.
type Places = Vec<(u64, usize)>;

/// The header of the tensors `members` (of `items`, `lens` bytes each) as the safetensors
/// crate writes it, and each member's place in the file: `(offset, item)` in file order.
fn header_of(
    items: &[Item<'_>],
    lens: &[usize],
    members: &[usize],
    metadata: Option<HashMap<String, String>>,
) -> Result<(Vec<u8>, Places)> {
    let views = members.iter().map(|&i| {
        let t = &items[i];
        (t.name, HeaderOnly { dtype: t.dtype, shape: t.shape, len: lens[i] })
    });
    let refused = |detail: String| WeightsError::BadTensor {
        tensor: "(the header)".into(),
        detail,
        fix: "pass tensors the safetensors format can hold",
    };
    let head = safetensors::serialize(views, metadata).map_err(|e| refused(e.to_string()))?;
    // Where the crate placed each tensor, from the header it wrote.
    let json: serde_json::Value = serde_json::from_slice(&head[8..]).map_err(|e| refused(e.to_string()))?;
    let mut places = members
        .iter()
        .map(|&i| {
            let offsets = json.get(items[i].name).and_then(|t| t.get("data_offsets")).and_then(|o| o.get(0));
            let start = offsets.and_then(serde_json::Value::as_u64).ok_or_else(|| {
                refused(format!("the safetensors crate wrote no offsets for tensor {:?}", items[i].name))
            })?;
            Ok((head.len() as u64 + start, i))
        })
        .collect::<Result<Vec<_>>>()?;
    places.sort_unstable();
    // The copies into a mapped file rely on this: each tensor's bytes apart from every
    // other's, and inside the file (`sink::Target::write` checks the end again).
    let mut end = head.len() as u64;
    for &(at, i) in &places {
        if at < end {
            let detail = format!("the safetensors crate placed tensor {:?} over another", items[i].name);
            return Err(refused(detail).into());
        }
        end = at + lens[i] as u64;
    }
    Ok((head, places))
}

/// The work of [`Device::save_safetensors_configured`]: one file, or shards and their index.
pub(super) fn save(
    device: &Device,
    path: &Path,
    items: &[Item<'_>],
    mut options: SaveOptions<'_>,
) -> Result<()> {
    let lens = check(device, items)?;
    let lens64: Vec<u64> = lens.iter().map(|&l| l as u64).collect();
    let (of, count) = match options.sharding {
        Some(sharding) => shards::assign(&lens64, sharding),
        None => (vec![0; items.len()], 1),
    };
    let mut members = vec![Vec::new(); count];
    for (i, &s) in of.iter().enumerate() {
        members[s].push(i);
    }
    let finals: Vec<PathBuf> = match options.sharding {
        Some(_) => (0..count).map(|s| path.with_file_name(shards::shard_name(path, s, count))).collect(),
        None => vec![path.to_owned()],
    };
    let metadata = options.metadata.take();
    let mut partials = Partials::default();
    let mut jobs = Vec::with_capacity(count);
    for (members, final_path) in members.iter().zip(&finals) {
        let (head, places) = header_of(items, &lens, members, metadata.clone())?;
        let data: u64 = members.iter().map(|&i| lens64[i]).sum();
        let partial = partial_path(final_path);
        // Removed on the way out only once this save made it (a name of its own, never an
        // existing file's).
        let target = Target::create(&partial, head.len() as u64 + data, options.write_mode)?;
        partials.paths.push(partial);
        target.write(&head, 0)?;
        jobs.push(Job { target, places });
    }
    let total: u64 = lens64.iter().sum();
    write::write_all(device, &jobs, (items, &lens), &mut options.pacing, total)?;
    drop(jobs);
    // Every file is whole: into place, the index last.
    for (i, final_path) in finals.iter().enumerate() {
        std::fs::rename(&partials.paths[i], final_path)
            .map_err(|e| WeightsError::io("renaming the finished file onto", final_path, &e))?;
        partials.paths[i] = final_path.clone();
    }
    if options.sharding.is_some() {
        let names: Vec<String> =
            finals.iter().map(|p| p.file_name().expect("named").to_string_lossy().into_owned()).collect();
        let text = index::to_json(total, items.iter().zip(&of).map(|(t, &s)| (t.name, names[s].as_str())));
        let index_path = shards::index_path(path);
        let partial = partial_path(&index_path);
        // A new file, as the tensors' are: never one that was there.
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&partial)
            .map_err(|e| WeightsError::io("creating", &partial, &e))?;
        partials.paths.push(partial.clone());
        file.write_all(text.as_bytes()).map_err(|e| WeightsError::io("writing", &partial, &e))?;
        std::fs::rename(&partial, &index_path)
            .map_err(|e| WeightsError::io("renaming the finished file onto", &index_path, &e))?;
    }
    partials.kept = true;
    Ok(())
}

/// Each tensor's bytes, after checking that it fits its buffer, that its bytes are whole,
/// and that its name is its own.
fn check(device: &Device, items: &[Item<'_>]) -> Result<Vec<usize>> {
    let mut names = HashSet::with_capacity(items.len());
    let bad = |t: &Item<'_>, detail: String, fix: &'static str| WeightsError::BadTensor {
        tensor: t.name.to_owned(),
        detail,
        fix,
    };
    items
        .iter()
        .map(|t| {
            if !names.insert(t.name) {
                return Err(bad(t, "two tensors have this name".into(), "give each tensor a name of its own").into());
            }
            let len = byte_len(t.shape, t.dtype).and_then(|l| usize::try_from(l).ok()).ok_or_else(|| {
                bad(t, format!("its shape {:?} of {} overflows or is no whole number of bytes", t.shape, t.dtype), "check the shape and the dtype")
            })?;
            let buffer_len = device.buffer_len(t.buffer)?;
            if t.offset.checked_add(len as u64).is_none_or(|end| end > buffer_len) {
                return Err(bad(
                    t,
                    format!("its shape {:?} of {} is {len} bytes, but its buffer holds {buffer_len} from offset {}", t.shape, t.dtype, t.offset),
                    "pass the shape and dtype the buffer holds, or a buffer large enough",
                )
                .into());
            }
            Ok(len)
        })
        .collect()
}

/// A name beside `path` for the file being written, of this save alone: the process's id
/// and a number no other save of the process takes, so that two saves to one path at once
/// (two threads) never write, or map, one partial file.
fn partial_path(path: &Path) -> PathBuf {
    static SAVES: AtomicU64 = AtomicU64::new(0);
    let n = SAVES.fetch_add(1, Ordering::Relaxed);
    let name = path.file_name().map_or_else(|| "checkpoint".into(), |n| n.to_string_lossy().into_owned());
    path.with_file_name(format!(".{name}.partial-{}-{n}", std::process::id()))
}

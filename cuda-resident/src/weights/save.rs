//! [`Device::save_safetensors`]: the header from the safetensors crate, the file sized and
//! mapped, every tensor downloaded straight into its pages, then renamed into place.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};

use memmap2::MmapMut;
use safetensors::{Dtype, View};

use super::SaveOptions;
use super::error::WeightsError;
use super::header::{self, byte_len};
use super::load::MIN_BATCH;
use crate::alloc::ResidentBuffer;
use crate::device::Device;
use crate::error::Result;
use crate::transfer::slices::{SliceRead, download_to_slices};

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

/// Removes the temporary file on the way out, unless it was renamed into place.
struct Partial {
    path: PathBuf,
    kept: bool,
}

impl Drop for Partial {
    fn drop(&mut self) {
        if !self.kept {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The work of [`Device::save_safetensors_configured`].
pub(super) fn save(
    device: &Device,
    path: &Path,
    items: &[Item<'_>],
    mut options: SaveOptions<'_>,
) -> Result<()> {
    let lens = check(device, items)?;
    let views =
        items.iter().zip(&lens).map(|(t, &len)| (t.name, HeaderOnly { dtype: t.dtype, shape: t.shape, len }));
    let head =
        safetensors::serialize(views, options.metadata.take()).map_err(|e| WeightsError::BadTensor {
            tensor: "(the header)".into(),
            detail: e.to_string(),
            fix: "pass tensors the safetensors format can hold",
        })?;
    let total: u64 = lens.iter().map(|&l| l as u64).sum();
    let file_len = head.len() as u64 + total;

    let partial = Partial { path: partial_path(path), kept: false };
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&partial.path)
        .map_err(|e| WeightsError::io("creating", &partial.path, &e))?;
    file.set_len(file_len).map_err(|e| WeightsError::io("sizing", &partial.path, &e))?;
    // SAFETY: the file was just created under a name of its own; this process is its only
    // writer until it is renamed, after the map is gone.
    let mut map =
        unsafe { MmapMut::map_mut(&file) }.map_err(|e| WeightsError::io("mapping", &partial.path, &e))?;
    map[..head.len()].copy_from_slice(&head);
    // Where the crate placed each tensor: the header read back, and checked, as any.
    let placed = header::parse(&partial.path, &map)?;
    let starts: HashMap<&str, (u64, u64)> =
        placed.entries.iter().map(|e| (e.name.as_str(), (e.start, e.len))).collect();
    let mut order: Vec<(u64, usize)> = items.iter().enumerate().map(|(i, t)| (starts[t.name].0, i)).collect();
    order.sort_unstable();
    download(device, &mut map, items, (&order, &lens), &mut options, total)?;
    drop(map);
    std::fs::rename(&partial.path, path)
        .map_err(|e| WeightsError::io("renaming the finished file onto", path, &e))?;
    let mut partial = partial;
    partial.kept = true;
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

/// A name beside `path` for the file being written.
fn partial_path(path: &Path) -> PathBuf {
    let name = path.file_name().map_or_else(|| "checkpoint".into(), |n| n.to_string_lossy().into_owned());
    path.with_file_name(format!(".{name}.partial-{}", std::process::id()))
}

/// Downloads each tensor (in file order, `order`: `(file offset, item)`) into its place in
/// `map`, in batches of about `batch_bytes`: small tensors gathered on the device by one
/// download batch and copied from its views, large ones pipelined straight into the pages.
fn download(
    device: &Device,
    map: &mut [u8],
    items: &[Item<'_>],
    (order, lens): (&[(u64, usize)], &[usize]),
    options: &mut SaveOptions<'_>,
    total: u64,
) -> Result<()> {
    let step = options.pacing.batch_bytes.max(MIN_BATCH);
    let small = device.config().direct_threshold;
    let mut rest = map;
    let mut consumed = 0u64;
    let mut done = 0u64;
    let mut group = order;
    while !group.is_empty() {
        // The next batch: tensors up to `step` bytes (at least one).
        let mut n = 0;
        let mut bytes = 0u64;
        while n < group.len() && (n == 0 || bytes + lens[group[n].1] as u64 <= step) {
            bytes += lens[group[n].1] as u64;
            n += 1;
        }
        let (this, next) = group.split_at(n);
        group = next;
        let (mut large, mut reads, mut smalls) = (Vec::new(), device.downloads(), Vec::new());
        for &(start, i) in this {
            let (t, len) = (&items[i], lens[i]);
            // The tensors come in file order, apart: split the rest of the map at each.
            let (_, tail) = std::mem::take(&mut rest).split_at_mut((start - consumed) as usize);
            let (out, tail) = tail.split_at_mut(len);
            rest = tail;
            consumed = start + len as u64;
            if len == 0 {
                continue;
            }
            if (len as u64) < small {
                smalls.push((reads.read(t.buffer, t.offset, len as u64)?, out));
            } else {
                large.push(SliceRead { buffer: t.buffer, offset: t.offset, out });
            }
        }
        let pending = if smalls.is_empty() { None } else { Some(reads.submit()?) };
        download_to_slices(device.core(), &mut large)?;
        if let Some(pending) = pending {
            let landed = pending.wait()?;
            for (slot, out) in smalls {
                out.copy_from_slice(landed.get(slot));
            }
        }
        done += bytes;
        options.pacing.report(done, total);
    }
    Ok(())
}

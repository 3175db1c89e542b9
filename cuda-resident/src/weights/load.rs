//! [`Device::load_safetensors`]: map, check, allocate (all or nothing) and upload the
//! checkpoint (one file, or every shard an index names) as a few large batches, each the engine pipelines through the pinned pool. A
//! buffer per tensor is allocated on a thread of its own, in the order the upload takes
//! them, so that allocating (a driver allocation for each tensor past the allocator's slab)
//! overlaps moving the tensors before it.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use memmap2::{Advice, Mmap};

use super::error::WeightsError;
use super::header::{self, Entry, Header};
use super::{Checkpoint, LoadOptions, Tensor, index, shards};
use crate::alloc::ResidentBuffer;
use crate::device::Device;
use crate::error::Result;
use crate::fence::Fence;
use crate::owned::OwnedBuffer;

/// Alignment of tensors in an arena: a buffer's own.
const ARENA_ALIGN: u64 = 256;
/// The smallest batch a load or save is cut into.
pub(super) const MIN_BATCH: u64 = 1 << 20;

/// A read-only map of the whole file at `path`.
pub(super) fn map(path: &Path) -> Result<Mmap, WeightsError> {
    let file = File::open(path).map_err(|e| WeightsError::io("opening", path, &e))?;
    // SAFETY: the map is read only, and only for the call that made it. Another process
    // that truncates or rewrites the file meanwhile could change or remove its pages under
    // the map, as with every reader of a mapped checkpoint (safetensors' own included): the
    // bytes moved would be wrong (or the process killed by SIGBUS), no memory of ours is
    // written through it.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| WeightsError::io("mapping", path, &e))?;
    // The engine reads the file front to back (several threads, each a stretch of a chunk).
    let _ = map.advise(Advice::Sequential);
    Ok(map)
}

/// The checkpoint's files, mapped, with their checked headers: the file at `path`, or
/// every shard its index names (each checked against the index).
fn open(path: &Path) -> Result<Vec<(Mmap, Header)>> {
    if !shards::is_index(path) {
        let file = map(path)?;
        let header = header::parse(path, &file)?;
        return Ok(vec![(file, header)]);
    }
    let named = index::read(path)?;
    let owner: HashMap<&str, &Path> =
        named.iter().flat_map(|(p, names)| names.iter().map(move |n| (n.as_str(), p.as_path()))).collect();
    named
        .iter()
        .map(|(shard, names)| {
            let file = map(shard).map_err(|e| index::missing(path, shard, &e))?;
            let header = header::parse(shard, &file)?;
            index::check_shard(path, shard, &header.entries, names, &owner)?;
            Ok((file, header))
        })
        .collect()
}

/// The work of [`Device::load_safetensors_configured`]: one file, or the shards of an index,
/// through one upload.
pub(super) fn load(device: &Device, path: &Path, mut options: LoadOptions<'_>) -> Result<Checkpoint> {
    let opened = open(path)?;
    let files: Vec<&[u8]> = opened.iter().map(|(map, _)| &map[..]).collect();
    let file_of: Vec<usize> =
        opened.iter().enumerate().flat_map(|(f, (_, h))| std::iter::repeat_n(f, h.entries.len())).collect();
    let total = opened.iter().map(|(_, h)| h.data_bytes).sum();
    let mut metadata = None;
    let mut all = Vec::with_capacity(file_of.len());
    for (_, header) in opened.iter() {
        metadata = metadata.or_else(|| header.metadata.clone());
        all.extend(header.entries.iter().cloned());
    }
    let header = Header { entries: all, metadata, data_bytes: total };
    let places = places(&header.entries, options.arena);
    check_budget(device, path, &header.entries, options.arena.then(|| arena_len(&places, &header.entries)))?;
    let entries = &header.entries;
    let source = (&files[..], &file_of[..]);
    let (owners, arena) = if options.arena {
        let arena = allocate_arena(device, path, entries, &places)?;
        upload(device, source, entries, &places, |_| Ok(*arena), &mut options)?;
        (Vec::new(), Some(arena))
    } else {
        let mut owners = Vec::with_capacity(entries.len());
        std::thread::scope(|s| {
            let (tx, rx) = std::sync::mpsc::channel();
            crate::sync::spawn_in(s, move || {
                allocate_each(device, path, entries, |owner| tx.send(owner).is_ok())
            });
            let uploaded = upload(
                device,
                source,
                entries,
                &places,
                |_| {
                    let owner = rx.recv().expect("the allocating thread sends a buffer or its error")?;
                    let buffer = *owner;
                    owners.push(owner);
                    Ok(buffer)
                },
                &mut options,
            );
            // The allocating thread stops at its next buffer (freed unsent) once nothing
            // takes them.
            drop(rx);
            uploaded
        })?;
        (owners, None)
    };
    let buffers: Vec<ResidentBuffer> = match &arena {
        Some(arena) => vec![**arena; entries.len()],
        None => owners.iter().map(|o| **o).collect(),
    };
    let mut index = HashMap::with_capacity(header.entries.len());
    let mut owners = owners.into_iter();
    let tensors = header
        .entries
        .into_iter()
        .zip(buffers.iter().zip(&places))
        .enumerate()
        .map(|(i, (e, (&buffer, &offset)))| {
            index.insert(e.name.clone(), i);
            let owned = if arena.is_some() { None } else { owners.next() };
            Tensor { name: e.name, dtype: e.dtype, shape: e.shape, buffer, offset, len: e.len, owned }
        })
        .collect();
    unmap_later(opened);
    Ok(Checkpoint { tensors, index, arena, metadata: header.metadata, bytes: total })
}

/// Unmaps the checkpoint's files on a thread of its own, once every byte has landed (no
/// copy reads them any more): tearing down a mapping the load faulted in whole took about
/// 2 ms per 4 GiB on the H200's host (2.5 % of the load), which the caller need not wait
/// for. Where no thread can be started, unmaps here.
fn unmap_later(opened: Vec<(Mmap, Header)>) {
    let maps: Vec<Mmap> = opened.into_iter().map(|(map, _)| map).collect();
    // A refused spawn drops the closure, and with it the maps, here.
    let _ = std::thread::Builder::new().name("cuda-resident-unmap".to_owned()).spawn(move || drop(maps));
}

/// Where each tensor goes in its buffer: 0 each, or its place in the arena.
fn places(entries: &[Entry], arena: bool) -> Vec<u64> {
    let mut at = 0u64;
    entries
        .iter()
        .map(|e| match arena {
            false => 0,
            true => {
                let here = at;
                // Cannot overflow: each len is at most the file's length, and the file's
                // length plus 256 per tensor is far from u64::MAX.
                at = (at + e.len).next_multiple_of(ARENA_ALIGN);
                here
            }
        })
        .collect()
}

/// The arena's length for tensors at `places` (at least 1 byte).
fn arena_len(places: &[u64], entries: &[Entry]) -> u64 {
    places.last().zip(entries.last()).map_or(0, |(p, e)| p + e.len).max(1)
}

/// Fails, before anything is allocated, when a tensor or the whole checkpoint (or its arena)
/// needs more than the budget could ever give: `budget_fraction` of the device's memory.
fn check_budget(device: &Device, path: &Path, entries: &[Entry], arena: Option<u64>) -> Result<()> {
    let total = device.info().total_memory;
    let fraction = device.config().budget_fraction;
    let limit = (total as f64 * fraction) as u64;
    let over = |what: String, bytes: u64| WeightsError::OverBudget {
        path: path.to_owned(),
        what,
        bytes,
        limit,
        fraction,
        total,
    };
    if let Some(e) = entries.iter().find(|e| e.len > limit) {
        return Err(over(format!("tensor {:?}", e.name), e.len).into());
    }
    let need = arena.unwrap_or_else(|| entries.iter().map(|e| e.len.max(1)).sum());
    if need > limit {
        return Err(over("the checkpoint".to_owned(), need).into());
    }
    Ok(())
}

/// The error of a refused allocation for `tensor` (`bytes`, `done` bytes of the checkpoint's
/// `total` allocated before it).
fn refused(
    path: &Path,
    (tensor, bytes): (String, u64),
    (done, total): (u64, u64),
    cause: crate::Error,
) -> WeightsError {
    WeightsError::Allocation { path: path.to_owned(), tensor, bytes, done, total, cause: Box::new(cause) }
}

/// The arena of every tensor.
fn allocate_arena(device: &Device, path: &Path, entries: &[Entry], places: &[u64]) -> Result<OwnedBuffer> {
    let (len, total) = (arena_len(places, entries), entries.iter().map(|e| e.len).sum());
    Ok(device
        .allocate_owned(len)
        .map_err(|e| refused(path, ("(the arena)".to_owned(), len), (0, total), e))?)
}

/// A buffer per tensor, in order, each handed to `send` (which says whether it was taken:
/// one not taken is freed, and no more are made), then a refusal's error if one came: the
/// buffers sent before it are the caller's to free.
fn allocate_each(
    device: &Device,
    path: &Path,
    entries: &[Entry],
    mut send: impl FnMut(Result<OwnedBuffer>) -> bool,
) {
    let total = entries.iter().map(|e| e.len).sum();
    let mut done = 0;
    for e in entries {
        // An empty tensor gets a buffer of a byte: buffers are never empty.
        let owner = device
            .allocate_owned(e.len.max(1))
            .map_err(|err| refused(path, (format!("{:?}", e.name), e.len), (done, total), err).into());
        let failed = owner.is_err();
        if !send(owner) || failed {
            return;
        }
        done += e.len;
    }
}

/// Uploads every tensor's bytes from its file (`files[file_of[i]]`) to its buffer (`buffer_of`, asked once a tensor,
/// in order) at its place (`places`), in batches of about
/// `batch_bytes` (a tensor may be split between two), reporting progress after each
/// submit; returns once every batch has landed.
fn upload(
    device: &Device,
    (files, file_of): (&[&[u8]], &[usize]),
    entries: &[Entry],
    places: &[u64],
    mut buffer_of: impl FnMut(usize) -> Result<ResidentBuffer>,
    options: &mut LoadOptions<'_>,
) -> Result<()> {
    let total: u64 = entries.iter().map(|e| e.len).sum();
    let step = options.pacing.batch_bytes.max(MIN_BATCH);
    let mut fences: Vec<Fence> = Vec::new();
    let mut done = 0u64;
    let mut batch = device.uploads();
    let mut in_batch = 0u64;
    for (i, (e, &place)) in entries.iter().zip(places).enumerate() {
        let buffer = buffer_of(i)?;
        let file = files[file_of[i]];
        let mut at = 0u64;
        while at < e.len {
            let n = (e.len - at).min(step - in_batch);
            // In the file: checked by `header::spans` against its length.
            let from = (e.start + at) as usize;
            batch.write(buffer, place + at, &file[from..from + n as usize])?;
            at += n;
            in_batch += n;
            if in_batch == step {
                fences.push(std::mem::replace(&mut batch, device.uploads()).submit()?);
                done += in_batch;
                in_batch = 0;
                options.pacing.report(done, total);
            }
        }
    }
    if !batch.is_empty() {
        fences.push(batch.submit()?);
    } else {
        drop(batch);
    }
    for fence in fences {
        fence.wait()?;
    }
    options.pacing.report(total, total);
    Ok(())
}

//! Model weights at the link: safetensors checkpoints loaded into resident buffers and saved
//! from them, through the engine (feature `safetensors`).
//!
//! [`Device::load_safetensors`] maps the file (no read into a buffer of its own), checks its
//! header (the [`safetensors`](https://docs.rs/safetensors) crate parses it; every offset is
//! then checked again against the file's length, with checked arithmetic, before anything
//! is allocated), allocates one buffer per tensor (or one arena, [`LoadOptions::arena`]) and
//! uploads every tensor through the engine's batches: large tensors are staged through the
//! pinned pool in chunks by the packing threads, pipelined with the wire, small ones (norms,
//! biases) are packed together and spread by one kernel launch per chunk. Pinned memory
//! stays within [`Config::pinned_cap_bytes`](crate::Config::pinned_cap_bytes) whatever the
//! checkpoint's size.
//!
//! [`Device::save_safetensors`] is the other way: the header is written by the safetensors
//! crate, and the tensors are downloaded through the engine in pieces into pinned memory
//! (small ones gathered on the device) and written at their offsets, then the file is
//! renamed into place. The file is preallocated (`fallocate`) and mapped, and every saving
//! thread copies its pieces into the mapping at once: buffered `pwrite`s into one file are
//! serialized by the kernel (3 to 6 GB/s on a 16-core host whatever the thread count), copies
//! into a mapping scale with threads (mapped on ext4, XFS and tmpfs only: see
//! [`WriteMode::Mapped`]). Where the file system cannot preallocate or map the file, or
//! [`SaveOptions::write_mode`] asks for [`WriteMode::Pwrite`], the file is written with
//! `pwrite` by one thread.
//!
//! # Sharded checkpoints
//!
//! [`SaveOptions::shard_bytes`] (or [`SaveOptions::shards`]) saves in Hugging Face's
//! layout: a save to `dir/model.safetensors` writes `dir/model-00001-of-0000k.safetensors`
//! ... and `dir/model.safetensors.index.json`, the shards in parallel. Given the index's
//! path, [`Device::load_safetensors`] loads every shard it names into one [`Checkpoint`],
//! each shard checked against the index.
//!
//! ```no_run
//! use cuda_resident::Device;
//! use cuda_resident::weights::{Dtype, LoadOptions};
//!
//! let device = Device::open(0)?;
//! let ckpt = device.load_safetensors_configured(
//!     "model.safetensors",
//!     LoadOptions::new().progress(|done, total| eprintln!("{done}/{total} bytes")),
//! )?;
//! let embed = ckpt.get("model.embed_tokens.weight").expect("in the checkpoint");
//! assert_eq!(embed.dtype(), Dtype::BF16);
//! let ptr = device.device_ptr(embed.buffer())? + embed.offset(); // for your kernels
//! # let _ = ptr;
//! // And back: any resident buffers, named, typed and shaped.
//! let tensors: Vec<_> = ckpt.tensors().iter().map(|t| (t.name(), t.dtype(), t.shape(), t.buffer())).collect();
//! device.save_safetensors("copy.safetensors", &tensors)?;
//! # Ok::<(), cuda_resident::Error>(())
//! ```
//!
//! # Getting at the buffers from a runtime
//!
//! Each [`Tensor`] is a [`ResidentBuffer`] (a `Copy` handle) plus an offset, which is 0
//! unless the checkpoint was loaded into one arena. A runtime of its own kernels takes the
//! address ([`Device::device_ptr`] plus [`Tensor::offset`]); with the `cudarc` feature,
//! `Device::cudarc_view::<T>(tensor.buffer(), &stream)` gives a typed view that cudarc's
//! launch builder takes as a kernel argument (a candle- or cudarc-style runtime's
//! `CudaSlice`-like handle), for the one-buffer-per-tensor layout (a view covers a whole
//! buffer). The [`Checkpoint`] owns the buffers and frees them when dropped;
//! [`Checkpoint::into_parts`] hands them over ([`OwnedBuffer`]s) to a runtime that keeps
//! them its own way.
//!
//! # Threads
//!
//! A load runs on the calling thread and the device's packing threads
//! ([`Config::pack_threads`](crate::Config::pack_threads): one per core but one, up to 16,
//! by default), which copy between the file's pages and pinned staging. A save starts up to
//! one thread per core (or packing thread, where there are more), which download pieces and
//! write them, no more than one a file for files written with `pwrite`; the calling thread
//! reports progress.

mod error;
// The header's checks are public (hidden) with `internals`, for the fuzz target.
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod header;
#[cfg(not(feature = "internals"))]
pub(crate) mod header;
mod index;
mod load;
mod save;
#[cfg(test)]
mod shard_tests;
mod shards;
mod sink;
#[cfg(test)]
mod tests;
mod write;

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

pub use error::WeightsError;
/// The element types of safetensors, as the `safetensors` crate names them.
pub use safetensors::Dtype;
pub use sink::WriteMode;

use crate::alloc::ResidentBuffer;
use crate::device::Device;
use crate::error::Result;
use crate::owned::OwnedBuffer;

/// A checkpoint loaded into device memory ([`Device::load_safetensors`]): its tensors in
/// the file's order, each in a resident buffer. Dropping it frees them.
pub struct Checkpoint {
    tensors: Vec<Tensor>,
    index: HashMap<String, usize>,
    arena: Option<OwnedBuffer>,
    metadata: Option<HashMap<String, String>>,
    bytes: u64,
}

impl fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Checkpoint")
            .field("tensors", &self.tensors.len())
            .field("bytes", &self.bytes)
            .field("arena", &self.arena.as_deref())
            .finish()
    }
}

impl Checkpoint {
    /// The tensors, in the order of their bytes in the file.
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    /// The tensor called `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the checkpoint has no tensor.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Bytes of tensor data (the file less its header).
    pub fn total_bytes(&self) -> u64 {
        self.bytes
    }

    /// The header's free-form `__metadata__` (string to string), where it has one.
    pub fn metadata(&self) -> Option<&HashMap<String, String>> {
        self.metadata.as_ref()
    }

    /// The one buffer that holds every tensor, where the checkpoint was loaded with
    /// [`LoadOptions::arena`].
    pub fn arena(&self) -> Option<ResidentBuffer> {
        self.arena.as_deref().copied()
    }

    /// Gives the buffers up to the caller: the tensors (each owning its buffer, unless the
    /// checkpoint was loaded into an arena) and the arena (which holds every tensor then).
    pub fn into_parts(self) -> (Vec<Tensor>, Option<OwnedBuffer>) {
        (self.tensors, self.arena)
    }
}

/// One tensor of a [`Checkpoint`]: its name, dtype, shape and where its bytes are on the
/// device (`len` bytes at `offset` of `buffer`).
pub struct Tensor {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    buffer: ResidentBuffer,
    offset: u64,
    len: u64,
    /// The buffer, where the tensor has one of its own.
    owned: Option<OwnedBuffer>,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("name", &self.name)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("buffer", &self.buffer)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl Tensor {
    /// Its name in the checkpoint.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its element type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Its shape (row-major, as safetensors stores it).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The buffer that holds it: its own (one byte long for an empty tensor), or the arena.
    pub fn buffer(&self) -> ResidentBuffer {
        self.buffer
    }

    /// Where its bytes start in [`buffer`](Self::buffer): 0 unless loaded into an arena
    /// (then a multiple of 256).
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Its bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it has no bytes (a dimension of 0).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Gives up its buffer: the owner, unless the tensor lives in an arena (`None`; the
    /// arena is [`Checkpoint::into_parts`]'s).
    pub fn into_owned(self) -> Option<OwnedBuffer> {
        self.owned
    }
}

/// A progress callback: bytes done, bytes in all.
type Progress<'p> = Box<dyn FnMut(u64, u64) + 'p>;

/// Bytes an upload or download batch of a load or save moves by default: progress is
/// reported after each, and batches follow each other on the lane with no gap.
pub const DEFAULT_BATCH_BYTES: u64 = 256 << 20;

/// What loads and saves share: the size of their batches and the progress callback.
struct Pacing<'p> {
    progress: Option<Progress<'p>>,
    batch_bytes: u64,
}

impl Default for Pacing<'_> {
    fn default() -> Self {
        Pacing { progress: None, batch_bytes: DEFAULT_BATCH_BYTES }
    }
}

impl fmt::Debug for Pacing<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pacing")
            .field("progress", &self.progress.is_some())
            .field("batch_bytes", &self.batch_bytes)
            .finish()
    }
}

impl Pacing<'_> {
    /// Calls the progress callback, where there is one.
    fn report(&mut self, done: u64, total: u64) {
        if let Some(progress) = self.progress.as_mut() {
            progress(done, total);
        }
    }
}

/// How [`Device::load_safetensors_configured`] loads.
#[must_use]
#[derive(Debug, Default)]
pub struct LoadOptions<'p> {
    arena: bool,
    pacing: Pacing<'p>,
}

impl<'p> LoadOptions<'p> {
    /// One buffer per tensor, no progress callback, batches of [`DEFAULT_BATCH_BYTES`].
    pub fn new() -> Self {
        LoadOptions::default()
    }

    /// Every tensor in one buffer, each at an offset that is a multiple of 256, instead of a
    /// buffer each: one allocation (which must fit whole), one handle to hand over.
    pub fn arena(mut self, arena: bool) -> Self {
        self.arena = arena;
        self
    }

    /// Calls `f(done, total)` as bytes are handed to the device (after each batch) and
    /// once more, with `done == total`, when every byte has landed.
    pub fn progress(mut self, f: impl FnMut(u64, u64) + 'p) -> Self {
        self.pacing.progress = Some(Box::new(f));
        self
    }

    /// Bytes per batch (at least 1 MiB is used): how often progress is reported.
    pub fn batch_bytes(mut self, bytes: u64) -> Self {
        self.pacing.batch_bytes = bytes;
        self
    }
}

/// How [`Device::save_safetensors_configured`] saves.
#[must_use]
#[derive(Debug, Default)]
pub struct SaveOptions<'p> {
    metadata: Option<HashMap<String, String>>,
    sharding: Option<shards::Sharding>,
    pacing: Pacing<'p>,
    write_mode: WriteMode,
}

impl<'p> SaveOptions<'p> {
    /// No `__metadata__`, no progress callback, batches of [`DEFAULT_BATCH_BYTES`].
    pub fn new() -> Self {
        SaveOptions::default()
    }

    /// The header's free-form `__metadata__` (`{"format": "pt"}`, say).
    pub fn metadata(mut self, metadata: HashMap<String, String>) -> Self {
        self.metadata = Some(metadata);
        self
    }

    /// Calls `f(done, total)` as bytes land in the file (after each batch; the last call
    /// has `done == total`). A save of no bytes (empty tensors, or none) calls it once,
    /// with `(0, 0)`.
    pub fn progress(mut self, f: impl FnMut(u64, u64) + 'p) -> Self {
        self.pacing.progress = Some(Box::new(f));
        self
    }

    /// Saves as shards of at most `bytes` bytes of tensor data each, Hugging Face's way:
    /// the tensors, in the order given, packed into shards (a tensor larger than `bytes`
    /// alone in its own), written in parallel ([`write_mode`](Self::write_mode)). A save to
    /// `dir/model.safetensors` writes `dir/model-00001-of-0000k.safetensors` ...
    /// `dir/model-0000k-of-0000k.safetensors` and `dir/model.safetensors.index.json`
    /// (`{"metadata": {"total_size": N}, "weight_map": {name: shard}}`), which
    /// [`Device::load_safetensors`] takes; no file `dir/model.safetensors`. Always an index,
    /// even for one shard. Each shard's header has the `__metadata__`. Replaces
    /// [`shards`](Self::shards).
    ///
    /// One file is written by every saving thread at once where it is mapped (the
    /// default, [`WriteMode::Mapped`]); with [`WriteMode::Pwrite`], shards are what lets
    /// threads write in parallel (one writer a file).
    pub fn shard_bytes(mut self, bytes: u64) -> Self {
        self.sharding = Some(shards::Sharding::Bytes(bytes));
        self
    }

    /// Saves as `count` shards of about equal bytes (fewer where a tensor spans several
    /// shares or there are fewer tensors), named as [`shard_bytes`](Self::shard_bytes)
    /// says. Replaces [`shard_bytes`](Self::shard_bytes).
    pub fn shards(mut self, count: usize) -> Self {
        self.sharding = Some(shards::Sharding::Count(count));
        self
    }

    /// Bytes per batch (at least 1 MiB is used): how often progress is reported.
    pub fn batch_bytes(mut self, bytes: u64) -> Self {
        self.pacing.batch_bytes = bytes;
        self
    }

    /// How the files are written: preallocated and mapped, every saving thread copying into
    /// them at once ([`WriteMode::Mapped`], the default), or with `pwrite`, one thread a file
    /// ([`WriteMode::Pwrite`]: for a file system whose mappings you would rather not write
    /// through). A file on a file system other than ext4, XFS or tmpfs, or one that cannot
    /// be preallocated or mapped, is written with `pwrite` whatever the mode. A mapped file is this save's own, under a temporary name; another
    /// process that truncates it while the save runs makes the save's copies fault
    /// (`SIGBUS`), as with any mapping.
    pub fn write_mode(mut self, mode: WriteMode) -> Self {
        self.write_mode = mode;
        self
    }
}

impl Device {
    /// Loads the safetensors checkpoint at `path` into device memory: one buffer per tensor,
    /// every byte moved through the engine ([`crate::weights`] says how). Returns once every
    /// byte has landed. A path ending in `.index.json` is a sharded checkpoint's index
    /// (Hugging Face's): every shard it names, beside it, is loaded into the one checkpoint.
    ///
    /// # Errors
    /// [`Error::Weights`](crate::Error::Weights) for a file that cannot be opened or mapped,
    /// an index that is no JSON index, names a missing shard or disagrees with a shard's
    /// header ([`WeightsError::BadIndex`]), a file that is truncated, has a bad header (offsets that overlap or reach past the end, shapes
    /// that disagree with them) or an unknown dtype, or needs more device memory than the
    /// budget allows (checked before anything is allocated) or than it has left; a driver
    /// error while moving. Whatever the error, nothing allocated for the checkpoint stays
    /// allocated.
    pub fn load_safetensors(&self, path: impl AsRef<Path>) -> Result<Checkpoint> {
        self.load_safetensors_configured(path, LoadOptions::new())
    }

    /// [`Device::load_safetensors`] with options: an arena, a progress callback.
    ///
    /// # Errors
    /// As [`Device::load_safetensors`].
    pub fn load_safetensors_configured(
        &self,
        path: impl AsRef<Path>,
        options: LoadOptions<'_>,
    ) -> Result<Checkpoint> {
        load::load(self, path.as_ref(), options)
    }

    /// Saves `tensors` (`(name, dtype, shape, buffer)` each; the tensor's bytes are the
    /// first `shape x dtype` bytes of `buffer`) as a safetensors checkpoint at `path`: the
    /// header written by the safetensors crate (tensors ordered by dtype, then name, as it
    /// orders them), the bytes downloaded through the engine into pinned memory and copied
    /// into the file, preallocated and mapped, by up to a thread per core (or written with
    /// `pwrite`: [`SaveOptions::write_mode`]). Sharded with [`SaveOptions::shard_bytes`]. The file is written beside `path` under a temporary name and renamed into
    /// place once every byte is in it, so an existing file at `path` (a checkpoint mapped by
    /// another reader, say) is never seen half written.
    ///
    /// # Errors
    /// [`Error::Weights`](crate::Error::Weights) for a tensor longer than its buffer, a
    /// shape of no whole number of bytes, two tensors of one name, a file that cannot be
    /// created, sized, written or renamed; a stale buffer or a driver error. On any
    /// error the temporary file is removed and `path` is left as it was.
    pub fn save_safetensors<N, S>(
        &self,
        path: impl AsRef<Path>,
        tensors: &[(N, Dtype, S, ResidentBuffer)],
    ) -> Result<()>
    where
        N: AsRef<str>,
        S: AsRef<[usize]>,
    {
        self.save_safetensors_configured(path, tensors, SaveOptions::new())
    }

    /// [`Device::save_safetensors`] with options: `__metadata__`, a progress callback.
    ///
    /// # Errors
    /// As [`Device::save_safetensors`].
    pub fn save_safetensors_configured<N, S>(
        &self,
        path: impl AsRef<Path>,
        tensors: &[(N, Dtype, S, ResidentBuffer)],
        options: SaveOptions<'_>,
    ) -> Result<()>
    where
        N: AsRef<str>,
        S: AsRef<[usize]>,
    {
        let items: Vec<save::Item<'_>> = tensors
            .iter()
            .map(|(name, dtype, shape, buffer)| save::Item {
                name: name.as_ref(),
                dtype: *dtype,
                shape: shape.as_ref(),
                buffer: *buffer,
                offset: 0,
            })
            .collect();
        save::save(self, path.as_ref(), &items, options)
    }
}

impl Checkpoint {
    /// Saves this checkpoint's tensors (as they are on the device now) to `path`, as
    /// [`Device::save_safetensors`] does, `__metadata__` included; works for an arena too.
    ///
    /// # Errors
    /// As [`Device::save_safetensors`].
    pub fn save(&self, device: &Device, path: impl AsRef<Path>) -> Result<()> {
        self.save_configured(device, path, SaveOptions::new())
    }

    /// [`Checkpoint::save`] with options: shards ([`SaveOptions::shard_bytes`]), a progress
    /// callback; the checkpoint's `__metadata__` unless the options give one.
    ///
    /// # Errors
    /// As [`Device::save_safetensors`].
    pub fn save_configured(
        &self,
        device: &Device,
        path: impl AsRef<Path>,
        mut options: SaveOptions<'_>,
    ) -> Result<()> {
        let items: Vec<save::Item<'_>> = self
            .tensors
            .iter()
            .map(|t| save::Item {
                name: &t.name,
                dtype: t.dtype,
                shape: &t.shape,
                buffer: t.buffer,
                offset: t.offset,
            })
            .collect();
        if options.metadata.is_none() {
            options.metadata = self.metadata.clone();
        }
        save::save(device, path.as_ref(), &items, options)
    }
}

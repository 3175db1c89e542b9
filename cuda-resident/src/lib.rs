//! Move bytes between host and an NVIDIA GPU as fast as the link allows.
//!
//! A [`Device`] owns one GPU's primary context and:
//! - a budgeted **resident store** of device memory ([`Device::allocate`] /
//!   [`Device::free`]): buffers are small `Copy` handles ([`ResidentBuffer`]) sub-allocated
//!   from slabs, so allocating and freeing cost nanoseconds, not a driver call; a stale or
//!   foreign handle is an error, never a dangling pointer. [`Device::allocate_owned`] gives
//!   an [`OwnedBuffer`], which frees its buffer when dropped (`*owned` is the handle);
//! - a **pinned pool** ([`Device::pinned`]): page-locked host memory, reused;
//! - two **lanes**, one non-blocking stream per direction, so that uploads and downloads
//!   overlap (uploads written in place also scatter on a second stream while the next
//!   bytes are on the wire); they wait for each other on the device only where they touch
//!   the same bytes; submitted work completes into a [`Fence`];
//! - **fused copies**: an [`UploadBatch`] or [`DownloadBatch`] of thousands of small copies
//!   costs one kernel launch per staging chunk, which reads or writes the pinned memory
//!   over the bus when the copies come in order ([`Config::small_copies_over_bus`]), or a
//!   DMA and one scatter or gather launch; large copies from ordinary memory are pipelined
//!   through pinned memory by several threads;
//! - **scoped transfers** ([`Device::scope`]): the same [`UploadBatch`] and [`DownloadBatch`]
//!   with the caller's own memory as the other end, borrowed until the scope has waited for
//!   them, so that pinned memory (a host cache of KV blocks, say) moves in place, with no
//!   staging copy, both directions at once;
//! - **prepared sets** ([`Device::prepare_uploads`], [`Device::prepare_downloads`]): the same
//!   ranges moved every step are checked and laid out once, with their descriptors resident
//!   on the device; each move then costs a parallel copy of the bytes (uploads) and a launch
//!   per chunk;
//! - **several GPUs** ([`DeviceSet`]): peer access, [`PeerBatch`]es of device-to-device copies
//!   fused into one kernel launch on the destination, and fan-out of one host buffer to
//!   every GPU.
//!
//! Every error says what happened and ends with `Fix: …`. New here? The table
//! [below](#which-api-for-which-job) says which API fits which job.
//!
//! Beside your own kernels, streams, cudarc or PyTorch: [`interop`], "Using cuda-resident
//! from your own runtime" (the shared context, threads, ordering both ways, awaiting a
//! [`Fence`], and every `unsafe` entry point).
//!
//! ```no_run
//! use cuda_resident::Device;
//!
//! let device = Device::open(0)?;
//! let a = device.allocate(1 << 20)?; // budgeted, sub-allocated: no driver call
//! let b = device.allocate_owned(4096)?; // freed when dropped; `*b` is the handle
//!
//! // Small writes are fused, packed into pinned memory and moved by one DMA plus one
//! // scatter launch.
//! let (x, y) = (vec![1u8; 300], vec![2u8; 64]);
//! let mut uploads = device.uploads();
//! uploads.write(a, 0, &x)?.write(*b, 128, &y)?;
//! uploads.write_with(a, 4096, 1000, |dst| dst.fill(3))?; // fill pinned memory in place
//! let fence = uploads.submit()?; // returns at once
//!
//! // Reads on the other lane wait for the writes on the device, not on the host.
//! let mut reads = device.downloads();
//! let slot = reads.read(a, 0, 300)?;
//! let done = reads.submit()?.wait()?;
//! assert_eq!(done.get(slot), &x[..]); // a view into pinned memory, no copy
//! assert!(fence.is_complete()?);
//! drop(done);
//!
//! // The same 1024 ranges every step: checked and laid out once.
//! let ranges: Vec<_> = (0..1024).map(|i| (a, i * 512, 256)).collect();
//! let mut prepared = device.prepare_uploads(&ranges)?;
//! let rows: Vec<Vec<u8>> = (0..1024).map(|i| vec![i as u8; 256]).collect();
//! prepared.upload(&rows)?.wait()?;
//! let mut back = device.prepare_downloads(&ranges)?;
//! let mut out = vec![Vec::new(); ranges.len()];
//! back.download_into(&mut out)?;
//! assert_eq!(out, rows);
//! drop((prepared, back));
//! device.free(a)?;
//! # Ok::<(), cuda_resident::Error>(())
//! ```
//!
//! # Which API for which job
//!
//! | job | use | when your memory may be reused or read | what `submit` returns |
//! |---|---|---|---|
//! | a one-off copy | [`Device::upload_at`], [`Device::download_range`], [`Device::download_to_slice`] | free to reuse, or holding the bytes, once the call returns | no submit: each call waits until its bytes have landed |
//! | many small copies | [`UploadBatch`] ([`Device::uploads`]), [`DownloadBatch`] ([`Device::downloads`]) | uploads: copied into pinned staging by `submit`, free to reuse once it returns; downloads: views into pinned memory while the [`Downloaded`] lives, or copied into your `Vec`s | a [`Fence`]; a [`PendingDownload`], whose `wait` gives the [`Downloaded`] |
//! | the same ranges every step | [`PreparedUploads`], [`PreparedDownloads`] ([`Device::prepare_uploads`], [`Device::prepare_downloads`]): checked and laid out once | as for batches: rows are copied in before [`PreparedUploads::upload`] returns; downloads as views, or into your `Vec`s ([`PreparedDownloads::download_into`]) | `upload`: a [`Fence`]; `submit`: a [`PendingDownload`] |
//! | your own pinned memory, moved with no copy | [`Device::scope`]: the [`Scope`]'s batches take your slices | borrowed until `scope` returns: the GPU reads and writes it in place after `submit`; read or reuse it once `scope` returns | nothing you must wait on: `scope` waits for every transfer before it returns |
//! | paging a KV cache | [`Device::scope`] over a host cache from [`Device::pinned`]: blocks out by a download batch, in by an upload batch, both directions at once | as for a scope: the cache's slots once `scope` returns | as for a scope |
//! | model weights (feature `safetensors`) | [`Device::load_safetensors`][load], [`Device::save_safetensors`][save] | the file is mapped during the call; nothing of yours is borrowed after it | no submit: each call returns once every byte has moved |
//!
#![cfg_attr(feature = "safetensors", doc = "[load]: Device::load_safetensors")]
#![cfg_attr(feature = "safetensors", doc = "[save]: Device::save_safetensors")]
#![cfg_attr(
    not(feature = "safetensors"),
    doc = "[load]: https://docs.rs/cuda-resident/latest/cuda_resident/struct.Device.html#method.load_safetensors"
)]
#![cfg_attr(
    not(feature = "safetensors"),
    doc = "[save]: https://docs.rs/cuda-resident/latest/cuda_resident/struct.Device.html#method.save_safetensors"
)]
//!
//! # Features
//!
//! - `cudarc`: the module `cuda_resident::cudarc`, working beside
//!   [cudarc](https://docs.rs/cudarc) (fences and lanes ordered against cudarc streams,
//!   resident buffers as cudarc kernel arguments). Your own cudarc dependency chooses its CUDA
//!   version and linking: see the module's docs.
//! - `nccl`: `cudarc`, and cudarc's NCCL binding as `cuda_resident::cudarc::nccl`.
//! - `safetensors`: the module `cuda_resident::weights`: safetensors checkpoints loaded
//!   into resident buffers and saved from them through the engine
//!   (`Device::load_safetensors`, `Device::save_safetensors`).
//! - `internals` and `fuzzing`: for this repository's benches and fuzz target only.
//!   `internals` exposes the copy planner, the budget rule and devices on a model driver
//!   (no GPU); `fuzzing` also exposes the planner's test byte model. Both are unstable,
//!   hidden from these docs, not part of the API and exempt from semver: do not enable them.

// docs.rs (`--cfg docsrs`, nightly) marks each feature-gated item with its feature.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod alloc;
// The planner and the budget rule are internals: private, except with the `internals`
// feature, which `internals` below reaches them through for the benches and the fuzz target.
// Without it, the planner's parts that only those use are unused here.
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod budget;
#[cfg(not(feature = "internals"))]
mod budget;
mod config;
mod context;
mod counter;
#[cfg(feature = "cudarc")]
#[cfg_attr(docsrs, doc(cfg(feature = "cudarc")))]
pub mod cudarc;
mod device;
mod engine;
mod error;
mod fence;
mod handle;
mod host_pool;
mod hostcopy;
pub mod interop;
mod kernels;
mod owned;
#[cfg(test)]
mod owned_tests;
mod peer;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod plan;
#[cfg(not(feature = "internals"))]
#[allow(dead_code)]
mod plan;
mod raw;
mod recycle;
mod stream;
mod sync;
mod telemetry;
#[cfg(any(test, feature = "internals"))]
mod testing;
mod transfer;
#[cfg(feature = "safetensors")]
#[cfg_attr(docsrs, doc(cfg(feature = "safetensors")))]
pub mod weights;

pub use alloc::classes::{GRANULE, MAX_CLASS_BYTES};
pub use alloc::{AllocatorStats, ResidentBuffer};
pub use config::{Config, DeviceInfo};
pub use device::{Device, DeviceSet};
pub use error::{Error, PlanError, Result};
pub use fence::{Fence, FenceEvent, FenceFuture};
pub use host_pool::{PinnedBuffer, PinnedStats};
pub use owned::OwnedBuffer;
pub use peer::{FanOutPath, PeerBatch};
pub use telemetry::TelemetrySnapshot;
pub use transfer::{
    DownloadBatch, Downloaded, PendingDownload, PreparedDownloads, PreparedUploads, Scope, Slot, UploadBatch,
};

/// The raw driver crate, re-exported for callers that make their own driver calls.
pub use cuda_sys;

// The README's code blocks, compiled and checked as doc tests (`cargo test --doc`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme_doctests {}

/// The copy planner and the budget rule, for the benches (`benches/plan.rs`) and the fuzz
/// target (`fuzz/`), behind the `internals` feature (and the planner's test byte model,
/// `plan::check`, behind `fuzzing`), and devices on the tests' model driver, for the benches
/// of the calls' own cost (`benches/calls.rs`). Not part of the API: unstable, exempt from
/// semver, hidden from the docs.
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod internals {
    /// A checkpoint header's checks (with the `safetensors` feature), for the fuzz target.
    #[cfg(feature = "safetensors")]
    pub use crate::weights::header as weights_header;
    pub use crate::{budget, plan};

    /// A device opened with `config` on a fresh model driver (the tests' driver, written in
    /// Rust, over host memory: no GPU): for measuring what the calls cost on the CPU.
    /// The model's state is per thread: use the device from the thread that opened it.
    /// Unstable, for this repository's benches only.
    pub fn model_device(config: crate::Config) -> crate::Device {
        crate::Device::open_on_driver(crate::testing::model::driver(), 0, config)
            .expect("the model driver opens")
    }
}

//! Move bytes between host and an NVIDIA GPU as fast as the link allows.
//!
//! A [`Device`] owns one GPU's primary context and:
//! - a budgeted **resident store** of device memory ([`Device::allocate`] /
//!   [`Device::free`]): buffers are small `Copy` handles ([`ResidentBuffer`]) sub-allocated
//!   from slabs, so allocating and freeing cost nanoseconds, not a driver call; a stale or
//!   foreign handle is an error, never a dangling pointer;
//! - a **pinned staging pool** ([`Device::pinned`]): page-locked host memory, reused;
//! - two **lanes**, one non-blocking stream per direction, so that uploads and readbacks
//!   overlap; submitted work completes into a [`Fence`].
//!
//! Every error says what happened and ends with `Fix: …`.
//!
//! ```no_run
//! use cuda_resident::Device;
//! let device = Device::open(0)?;
//! println!("{} with {} GiB", device.info().name, device.info().total_memory >> 30);
//! let buffer = device.allocate(1 << 20)?;
//! let ptr = device.device_ptr(buffer)?; // for your own kernels
//! # let _ = ptr;
//! device.free(buffer)?;
//! # Ok::<(), cuda_resident::Error>(())
//! ```

mod alloc;
pub mod budget;
mod context;
mod device;
mod error;
mod host_pool;
mod kernels;
pub mod plan;
mod raw;
mod stream;
mod sync;
mod telemetry;
mod transfer;

pub use alloc::classes::{GRANULE, MAX_CLASS_BYTES};
pub use alloc::{AllocatorStats, ResidentBuffer};
pub use device::{Config, Device, DeviceInfo};
pub use error::{Error, Result};
pub use host_pool::{PinnedBuffer, PinnedStats};
pub use stream::Fence;
pub use telemetry::TelemetrySnapshot;
pub use transfer::{PendingReadback, Readback, ReadbackBatch, Slot, UploadBatch};

/// The raw driver crate, re-exported for callers that make their own driver calls.
pub use cuda_sys;

//! # Using cuda-resident from your own runtime
//!
//! cuda-resident moves bytes; your runtime (a kernel launcher, cudarc, PyTorch, an NCCL
//! communicator) computes on them. This chapter says how the two share a GPU. It holds no
//! items of its own.
//!
//! ## One context: the device's primary context
//!
//! [`Device::open`] retains the GPU's *primary* context ([`Device::cu_context`]), the one the
//! CUDA runtime API, cudarc (`CudaContext::new`) and PyTorch use too. So device pointers
//! ([`Device::device_ptr`]), streams and events move freely between them with no
//! conversion: a [`ResidentBuffer`]'s pointer can be a kernel argument of yours, your stream
//! can be handed to [`Device::wait_for_stream`]. Before raw driver calls of your own on a
//! thread, make the context current ([`Device::make_current`]; cudarc and the runtime API do
//! this themselves). [`Device::driver`] is the loaded driver, for those calls through
//! [`cuda_sys`] (with the crate's fault injection and error naming).
//!
//! The device's copies run on two non-blocking streams of its own (one per direction), never
//! the legacy null stream: your null-stream work does not serialize with them, and nothing
//! orders them with your streams unless you ask (below).
//!
//! ## Threads
//!
//! [`Device`] is `Send + Sync` and cheap to clone (an `Arc`): share it between threads
//! rather than opening the GPU twice. Batches ([`UploadBatch`], [`DownloadBatch`]) are built
//! on one thread; a [`Fence`] is `Send + Sync` and can be cloned, waited on or awaited
//! anywhere. [`FenceEvent`] is `Send + Sync`.
//!
//! Which calls block the calling thread:
//! - [`Fence::wait`], [`PendingDownload::wait`], [`Device::synchronize`],
//!   [`Device::synchronize_uploads`] and [`Device::synchronize_downloads`]: until the GPU
//!   has done the work.
//! - The conveniences ([`Device::upload`], [`Device::download`] and their `_many`, `_at`,
//!   `_range`, `_into` and `_to_slice` forms, [`PreparedDownloads::download_into`]): each
//!   submits one batch and waits for it.
//! - `submit` of a batch returns once its copies are enqueued, without waiting for the GPU,
//!   except when pinned staging is short: it then waits for copies in flight to give theirs
//!   back, and large copies from ordinary memory are packed into staging by several threads
//!   before it returns. A peer batch between GPUs without a peer path waits until the source
//!   bytes are on the host.
//! - [`Device::wait_for_stream`] and [`Device::wait_for_event`] wait for a batch being
//!   submitted by another thread to finish enqueuing (not for the GPU).
//! - Dropping the last [`Device`] handle waits for its copies in flight.
//! - `fence.await` never blocks: see below.
//!
//! On an async executor, keep the blocking calls off its worker threads
//! (`spawn_blocking` or a thread of your own) or await the fence instead.
//!
//! ## Ordering, both ways, on the GPU
//!
//! Your work after cuda-resident's copies:
//! - [`Fence::make_stream_wait`] makes your stream wait for a fence's work, with no host round
//!   trip: kernels you launch on it afterwards see the uploaded bytes.
//! - [`Fence::record_event`] records a new `CUevent` after the fence's work and hands it to you
//!   as a [`FenceEvent`], which owns it (destroyed on drop). Pass
//!   [`FenceEvent::as_raw`] to `cuStreamWaitEvent`, `cuEventSynchronize`, or any library that
//!   takes an event, while the `FenceEvent` lives; do not destroy or re-record it.
//! - `fence.await` (a [`Fence`] and `&Fence` are [`IntoFuture`],
//!   giving a [`FenceFuture`]) resolves once the work has completed, or to the driver's error.
//!   It needs no particular executor and uses no thread or polling loop of the crate's: the
//!   first poll of an incomplete fence enqueues a driver callback (`cuStreamAddCallback`) on
//!   the fence's lane, and the driver wakes the task from its callback thread. Wakers must
//!   therefore not run CUDA work inline when woken (the common executors only schedule the
//!   task). Dropping the future cancels nothing and does not block.
//!
//! cuda-resident's copies after your work:
//! - [`Device::wait_for_stream`]: copies submitted from now on wait for the work enqueued so
//!   far on your stream.
//! - [`Device::wait_for_event`]: the same for an event of yours, as last recorded.
//!
//! Either way only copies submitted afterwards wait; copies already submitted are not
//! affected. A peer batch runs on its destination device: order it there. Freeing a buffer
//! does not know about your work: wait for your work (on the host) before freeing a buffer
//! it uses.
//!
//! ```no_run
//! use cuda_resident::Device;
//! # fn launch_my_kernel(_: u64, _: cuda_resident::cuda_sys::CUstream) {}
//!
//! # async fn example(stream: cuda_resident::cuda_sys::CUstream) -> cuda_resident::Result<()> {
//! let device = Device::open(0)?;
//! let buffer = device.allocate(1 << 20)?;
//! let mut uploads = device.uploads();
//! uploads.write(buffer, 0, &[7u8; 4096])?;
//! let fence = uploads.submit()?;
//!
//! // Your kernel runs after the upload, ordered on the GPU.
//! // SAFETY: `stream` is a live stream of the device's primary context.
//! unsafe { fence.make_stream_wait(stream)? };
//! launch_my_kernel(device.device_ptr(buffer)?, stream);
//!
//! // The download that follows waits for your kernel, again on the GPU.
//! // SAFETY: as above.
//! unsafe { device.wait_for_stream(stream)? };
//! let pending = device.downloads().submit()?;
//!
//! // Or hand the completion on: an event, or await it.
//! let event = fence.record_event()?; // Some(FenceEvent) for a fence of a device
//! fence.await?;
//! drop((event, pending));
//! # Ok(())
//! # }
//! ```
//!
//! ## Every `unsafe` entry point, and why
//!
//! The crate's safe API cannot reach freed memory or a foreign handle: buffers are checked
//! handles, and pinned memory lent by the crate is kept alive by the copies that use it. The
//! entry points below take raw handles or raw pointers the crate cannot check, so the caller
//! promises what the compiler cannot see:
//!
//! | Entry point | The caller promises | Because |
//! |---|---|---|
//! | [`Fence::make_stream_wait`] | `stream` is live and of this device's primary context (or null) | a destroyed or foreign stream is undefined behaviour in the driver |
//! | [`Device::wait_for_stream`] | as above | as above |
//! | [`Device::wait_for_event`] | `event` is live (created, not destroyed) | a destroyed event is undefined behaviour in the driver |
//! | [`Device::upload_async_at`] | `[src, src + len)` is readable and stays valid and unchanged until the fence completes | the GPU reads it after the call returns, and the borrow checker cannot see that |
//! | [`Device::download_async_at`] | `[dst, dst + len)` is writable, pinned, and untouched until the fence completes | the GPU writes it after the call returns |
//! | [`Device::pin_host`] | the range is mapped host memory that stays mapped until [`Device::unpin_host`] | the driver page-locks it and the GPU may read and write it directly |
//! | [`Device::unpin_host`] | `ptr` starts a range pinned by `pin_host`, and no copy in flight uses it | a copy in flight would read or write memory no longer pinned |
//!
//! The raw driver itself ([`cuda_sys`]) is unsafe throughout, as every FFI
//! call is.
//!
//! [`Device`]: crate::Device
//! [`Device::open`]: crate::Device::open
//! [`Device::cu_context`]: crate::Device::cu_context
//! [`Device::device_ptr`]: crate::Device::device_ptr
//! [`Device::make_current`]: crate::Device::make_current
//! [`Device::driver`]: crate::Device::driver
//! [`Device::wait_for_stream`]: crate::Device::wait_for_stream
//! [`Device::wait_for_event`]: crate::Device::wait_for_event
//! [`Device::synchronize`]: crate::Device::synchronize
//! [`Device::synchronize_uploads`]: crate::Device::synchronize_uploads
//! [`Device::synchronize_downloads`]: crate::Device::synchronize_downloads
//! [`Device::upload`]: crate::Device::upload
//! [`Device::download`]: crate::Device::download
//! [`Device::upload_async_at`]: crate::Device::upload_async_at
//! [`Device::download_async_at`]: crate::Device::download_async_at
//! [`Device::pin_host`]: crate::Device::pin_host
//! [`Device::unpin_host`]: crate::Device::unpin_host
//! [`ResidentBuffer`]: crate::ResidentBuffer
//! [`UploadBatch`]: crate::UploadBatch
//! [`DownloadBatch`]: crate::DownloadBatch
//! [`PendingDownload::wait`]: crate::PendingDownload::wait
//! [`PreparedDownloads::download_into`]: crate::PreparedDownloads::download_into
//! [`Fence`]: crate::Fence
//! [`Fence::wait`]: crate::Fence::wait
//! [`Fence::make_stream_wait`]: crate::Fence::make_stream_wait
//! [`Fence::record_event`]: crate::Fence::record_event
//! [`FenceEvent`]: crate::FenceEvent
//! [`FenceEvent::as_raw`]: crate::FenceEvent::as_raw
//! [`FenceFuture`]: crate::FenceFuture

//! `Device`: one GPU's primary context, its lanes, its resident store and its pinned pool.

mod peer;
mod set;

pub use set::DeviceSet;

use std::fmt;
use std::sync::Arc;

use cuda_sys::{CUcontext, Driver};

use crate::alloc::ResidentBuffer;
use crate::config::{Config, DeviceInfo};
use crate::engine::core::{Core, shared_driver};
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::fence::Fence;
use crate::host_pool::PinnedBuffer;
use crate::owned::OwnedBuffer;
use crate::raw::{Raw, release_retrying};
use crate::sync::lock;
use crate::telemetry::TelemetrySnapshot;
use crate::transfer::{DownloadBatch, PreparedDownloads, PreparedUploads, Scope, UploadBatch};

/// One GPU: its primary context, two copy lanes, a budgeted resident store and a pinned
/// pool.
///
/// The two lanes (one stream for uploads, one for downloads) run at once. Work on one lane
/// runs in the order it was submitted; a batch waits, on the device, for work of the other
/// lane still in flight only where the two use the same bytes: a download of some blocks of a
/// buffer and an upload of other blocks of it (touching ones included) overlap, while a
/// download of bytes an upload is writing waits for the upload. [`TelemetrySnapshot::lane_waits`](crate::TelemetrySnapshot::lane_waits)
/// counts those waits.
///
/// `Device` is `Send + Sync` and cheap to clone (an `Arc` inside); clones share everything.
/// Dropping the last clone (and the last prepared set and [`Downloaded`](crate::Downloaded)
/// made from it, which hold the device's state too) waits for every copy in flight, then
/// frees the device's buffers; the context is released once the fences and lent pinned
/// memory that keep it are gone too. A [`Fence`](crate::Fence) keeps the context and the
/// lanes only: it can still be waited on after the device is dropped, but the buffers are
/// freed by then, so work of your own that uses a buffer (after
/// [`Fence::make_stream_wait`](crate::Fence::make_stream_wait)) must finish before the last
/// `Device` goes.
///
/// Its blocking conveniences ([`upload`](Device::upload), [`upload_at`](Device::upload_at),
/// [`upload_many`](Device::upload_many), [`upload_at_many`](Device::upload_at_many),
/// [`download`](Device::download), [`download_range`](Device::download_range),
/// [`download_to_slice`](Device::download_to_slice), [`download_many`](Device::download_many),
/// [`download_ranges`](Device::download_ranges), [`download_into`](Device::download_into))
/// each do what one batch does, submitted and waited for; the batches
/// ([`uploads`](Device::uploads), [`downloads`](Device::downloads)) are the non-blocking form.
#[derive(Clone)]
pub struct Device {
    core: Arc<Core>,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.core.info.ordinal)
            .field("name", &self.core.info.name)
            .finish()
    }
}

impl Device {
    /// How many CUDA devices the driver sees. Fails when no driver can be loaded.
    pub fn count() -> Result<usize> {
        let raw = Raw::new(shared_driver()?);
        raw.init()?;
        raw.device_count()
    }

    /// Opens device `ordinal` with the default [`Config`], loading the driver on first use.
    pub fn open(ordinal: usize) -> Result<Device> {
        Device::open_configured(ordinal, Config::default())
    }

    /// Opens device `ordinal` with `config`, loading the driver on first use: a larger
    /// pinned cap for a host cache, a smaller device budget, another chunk size.
    ///
    /// ```no_run
    /// use cuda_resident::{Config, Device};
    ///
    /// let device = Device::open_configured(0, Config::default().with_pinned_cap_bytes(4 << 30))?;
    /// # Ok::<(), cuda_resident::Error>(())
    /// ```
    pub fn open_configured(ordinal: usize, config: Config) -> Result<Device> {
        Device::open_on_driver(shared_driver()?, ordinal, config)
    }

    /// Opens device `ordinal` through `driver` (for a driver loaded from a particular path,
    /// or one whose table was altered for testing) with `config`.
    pub fn open_on_driver(driver: Arc<Driver>, ordinal: usize, config: Config) -> Result<Device> {
        Core::open(driver, ordinal, config).map(|core| Device { core: Arc::new(core) })
    }

    #[cfg(any(test, feature = "cudarc"))]
    pub(crate) fn core(&self) -> &Arc<Core> {
        &self.core
    }

    /// What the device is and can do.
    pub fn info(&self) -> &DeviceInfo {
        &self.core.info
    }

    /// The configuration it was opened with.
    pub fn config(&self) -> &Config {
        &self.core.config
    }

    /// Whether batches of small copies in order move over the bus on this device: the
    /// configuration asks for it ([`Config::small_copies_over_bus`]) and the GPU has unified
    /// addressing, without which its kernels cannot reach pinned host memory.
    pub fn moves_small_copies_over_bus(&self) -> bool {
        self.core.moves_small_copies_over_bus()
    }

    /// Whether a scoped submission's DMAs go to the driver in one `cuMemcpyBatchAsync` on
    /// this device: the configuration asks for it ([`Config::dma_batches`]), the driver has
    /// the call ([`DeviceInfo::batch_memcpy`]) and the GPU
    /// has unified addressing, without which the call cannot tell host addresses from device
    /// ones.
    pub fn moves_dmas_in_batches(&self) -> bool {
        self.core.dma_batches().is_some()
    }

    /// Whether this device's pinned pool makes its arenas of transparent huge pages (those
    /// of a whole number of 2 MiB pages): the configuration asks for it
    /// ([`Config::pinned_huge_pages`]), the kernel offers them, the GPU reaches registered
    /// memory at its host address, and no arena has failed to be made so yet.
    pub fn pinned_in_huge_pages(&self) -> bool {
        self.core.pinned.makes_huge_pages()
    }

    /// The loaded driver, for raw calls of the caller's own.
    pub fn driver(&self) -> &Arc<Driver> {
        &self.core.ctx.raw.driver
    }

    /// The device's primary context (retained for as long as the device lives), for the
    /// caller's own kernels and streams.
    pub fn cu_context(&self) -> CUcontext {
        self.core.ctx.ctx
    }

    /// Makes the device's context current on the calling thread, for raw driver calls.
    pub fn make_current(&self) -> Result<()> {
        self.core.ctx.bind().map(|_| ())
    }

    /// Makes the copies this device runs, submitted from now on, wait on the GPU for the
    /// work enqueued so far on `stream`, one of the caller's (a compute or NCCL stream):
    /// uploads into the device, downloads from it and peer batches into it start after that
    /// work, with no host wait. The other direction is [`Fence::make_stream_wait`].
    ///
    /// Copies already submitted are not affected, nor are peer batches *out of* this device
    /// (they run on their destination): call it on the destination, with a stream of its
    /// own, or wait on the host. Deferred frees do not know about the caller's work either:
    /// wait on the host before freeing a buffer the stream uses.
    ///
    /// # Safety
    ///
    /// `stream` must be a live stream of this device's primary context (or null, the legacy
    /// default stream).
    ///
    /// [`Fence::make_stream_wait`]: crate::Fence::make_stream_wait
    pub unsafe fn wait_for_stream(&self, stream: cuda_sys::CUstream) -> Result<()> {
        let raw = self.core.ctx.bind()?;
        let event = raw.event_create()?;
        // SAFETY: the event was just made in this context and lives until after the waits.
        let waited = raw.event_record(event, stream).and_then(|()| unsafe { self.wait_for_event(event) });
        // A wait already enqueued keeps what it waits for: the event can go at once.
        let _ = release_retrying(|| raw.event_destroy(event));
        waited
    }

    /// Makes the copies this device runs, submitted from now on, wait on the GPU for
    /// `event`, one of the caller's, as last recorded before this call (an event never
    /// recorded is complete: nothing waits). As [`wait_for_stream`](Self::wait_for_stream),
    /// which records an event on the stream and calls this, with the same limits. The other
    /// direction is [`Fence::record_event`].
    ///
    /// Blocks while another thread is submitting a batch on this device (the waits go
    /// between batches, not inside one). The event may be destroyed or recorded again as
    /// soon as this returns: the waits keep what they wait for.
    ///
    /// # Safety
    ///
    /// `event` must be a live event (created and not destroyed), of any context.
    ///
    /// [`Fence::record_event`]: crate::Fence::record_event
    pub unsafe fn wait_for_event(&self, event: cuda_sys::CUevent) -> Result<()> {
        let raw = self.core.ctx.bind()?;
        self.core.lanes.iter().try_for_each(|lane| {
            // Between batches, not inside one.
            let _batch = lane.batch();
            raw.stream_wait_event(lane.stream(), event)
        })
    }

    /// Allocates `bytes` of device memory under the budget. Buffers are 256-byte aligned.
    ///
    /// Fails for zero bytes, and when the budget (or the driver, after cached memory was
    /// released) refuses; the error gives the request, the bytes in use and the limit.
    ///
    /// The handle is freed by hand ([`Device::free`]); [`Device::allocate_owned`] gives one
    /// that is freed on drop.
    pub fn allocate(&self, bytes: u64) -> Result<ResidentBuffer> {
        self.core.alloc.allocate(bytes, &|last| self.core.is_idle(last))
    }

    /// Allocates `bytes` as [`Device::allocate`] does, owned by an [`OwnedBuffer`] that frees
    /// it when dropped (deferred while copies use it, as [`Device::free`] is): no early
    /// return or `?` can leak it. `*owned` is the handle for batches.
    ///
    /// ```no_run
    /// use cuda_resident::Device;
    ///
    /// let device = Device::open(0)?;
    /// let staging = device.allocate_owned(64 << 20)?;
    /// device.upload_at(*staging, 0, &[1u8; 4096])?; // on error, `staging` is freed
    /// # Ok::<(), cuda_resident::Error>(())
    /// ```
    pub fn allocate_owned(&self, bytes: u64) -> Result<OwnedBuffer> {
        self.allocate(bytes).map(|buffer| OwnedBuffer::new(self.clone(), buffer, bytes))
    }

    /// Takes ownership of `buffer`, a live handle of this device (from
    /// [`Device::allocate`] or [`OwnedBuffer::into_raw`]): the [`OwnedBuffer`] frees it
    /// when dropped. Adopt a handle once; free it no other way afterwards (a copy freed by
    /// hand makes the owner's free a no-op, never a double free).
    ///
    /// # Errors
    /// [`Error::FreedBuffer`] for a handle already freed, [`Error::ForeignBuffer`] for one
    /// of another device; nothing is owned then.
    pub fn adopt(&self, buffer: ResidentBuffer) -> Result<OwnedBuffer> {
        let len = self.buffer_len(buffer)?;
        Ok(OwnedBuffer::new(self.clone(), buffer, len))
    }

    /// Frees a buffer. The handle is invalid at once; if a copy still uses the buffer, its
    /// memory is reused only after the copy completes.
    ///
    /// No driver call: the memory goes back to the device's store. A buffer past the slab
    /// size keeps its driver allocation, which the next allocation it fits (at most a
    /// quarter smaller) takes without a driver call: a checkpoint loaded again gets its
    /// memory back at once, and memory the driver has just taken back is slow to write for
    /// a while. [`Device::trim`] gives kept memory back, as does any allocation the budget
    /// or the driver would refuse otherwise; `telemetry().memory.kept_bytes` counts it.
    pub fn free(&self, buffer: ResidentBuffer) -> Result<()> {
        self.core.free(buffer)
    }

    /// The buffer's device address, for the caller's kernels. Valid until the buffer is freed.
    pub fn device_ptr(&self, buffer: ResidentBuffer) -> Result<u64> {
        self.core.device_ptr(buffer)
    }

    /// The buffer's length in bytes, as allocated.
    pub fn buffer_len(&self, buffer: ResidentBuffer) -> Result<u64> {
        self.core.buffer_len(buffer)
    }

    /// Bytes held by the caller's live buffers, as requested. The library's own device
    /// memory (device staging of the two lanes, prepared sets' tables) is not in it: it is
    /// [`AllocatorStats::library_bytes`](crate::AllocatorStats::library_bytes) in
    /// [`Device::telemetry`], so this returns to its baseline once the caller has freed
    /// every buffer.
    pub fn allocated_bytes(&self) -> u64 {
        self.core.alloc.allocated_bytes()
    }

    /// Device memory free right now, as the driver reports it (`cuMemGetInfo`): what every
    /// process on the GPU leaves, not this device's budget.
    pub fn driver_free_bytes(&self) -> Result<u64> {
        Ok(self.core.ctx.bind()?.mem_get_info()?.0)
    }

    /// Releases cached device memory (size-class caches, kept allocations past the slab
    /// size, empty slabs) and free pinned memory back to the driver, and the
    /// host memory kept from the last download that streamed into memory of its own (see
    /// [`Downloaded`](crate::Downloaded)). Returns the bytes of device memory released.
    ///
    /// # Errors
    /// The first release the driver refused; the other caches are trimmed all the same.
    pub fn trim(&self) -> Result<u64> {
        let released = self.core.alloc.trim(&|last| self.core.is_idle(last));
        drop(std::mem::take(&mut *lock(&self.core.spares.streamed_host)));
        let pinned = self.core.pinned.trim();
        let released = released?;
        pinned?;
        Ok(released)
    }

    /// Lends `len` bytes of pinned host memory from the pinned pool (at least 1 byte is
    /// lent for 0). It returns to the pool when dropped. When the pool is at its cap, waits
    /// for copies in flight to release their staging.
    ///
    /// Pinned buffers, prepared sets and download views are held staging: together they may
    /// take the pool's cap less a reserve kept for transfers ([`Config::pinned_cap_bytes`]);
    /// past that, [`Error::PinnedReserved`]. Each takes an arena of one of the pool's sizes
    /// (rounded up by at most 6.25 %, so that it is reused), or, where that rounding would
    /// pass the limit, exactly its own pages: a request of no more than what is left of the
    /// limit ([`PinnedStats::held_limit_bytes`](crate::PinnedStats::held_limit_bytes) less `held_bytes`) is
    /// lent.
    pub fn pinned(&self, len: usize) -> Result<PinnedBuffer> {
        self.core.acquire_held_staging(len).map(PinnedBuffer::new)
    }

    /// Blocks until every copy submitted so far, in both directions, has completed.
    pub fn synchronize(&self) -> Result<()> {
        for lane in self.core.lanes.iter() {
            lane.synchronize()?;
        }
        Ok(())
    }

    /// A snapshot of the device's counters and memory statistics.
    pub fn telemetry(&self) -> TelemetrySnapshot {
        TelemetrySnapshot::gather(&self.core.telemetry, self.core.alloc.stats(), self.core.pinned.stats())
    }

    /// Uploads `data` as the whole contents of `buffer` and waits until it has landed.
    ///
    /// # Errors
    /// [`Error::UploadLength`] (nothing moved) unless `data` is exactly as long as the buffer:
    /// a shorter slice would leave the buffer's tail as it was, which is rarely what a caller
    /// of a whole-buffer upload means. Use [`Device::upload_at`] for a partial write.
    pub fn upload(&self, buffer: ResidentBuffer, data: &[u8]) -> Result<()> {
        crate::transfer::convenience::upload(&self.core, buffer, data)
    }

    /// Uploads `data` to `buffer` at `offset` and waits until it has landed.
    ///
    /// Up to 16 KiB, `data` goes to the driver as it is (one `cuMemcpyHtoDAsync` on the upload
    /// lane, ordered against other copies of the same bytes as any batch): from pageable
    /// memory the driver stages the bytes itself. Larger uploads are staged in pinned memory
    /// and pipelined, as a batch's are. The same holds for [`Device::upload`].
    ///
    /// # Errors
    /// A bad range (nothing moved), a stale buffer, or a driver error. Where the driver
    /// fails after the copy was enqueued (its event or its wait), the call first waits for
    /// the upload lane's stream, so that no copy reads `data` once it returns; a driver that
    /// can confirm neither that nor a lost context, asked a few times, aborts the process, as
    /// [`Device::scope`] does.
    pub fn upload_at(&self, buffer: ResidentBuffer, offset: u64, data: &[u8]) -> Result<()> {
        crate::transfer::convenience::upload_at(&self.core, buffer, offset, data)
    }

    /// Uploads each `(buffer, data)` as the whole contents of its buffer, as one batch, and
    /// waits.
    ///
    /// # Errors
    /// [`Error::UploadLength`] (nothing moved) unless every `data` is exactly as long as its
    /// buffer, as for [`Device::upload`]; [`Device::upload_at_many`] writes parts.
    pub fn upload_many(&self, writes: &[(ResidentBuffer, &[u8])]) -> Result<()> {
        crate::transfer::convenience::upload_many(&self.core, writes)
    }

    /// Uploads each `(buffer, offset, data)`, as one batch (later writes win where they
    /// overlap), and waits.
    pub fn upload_at_many(&self, writes: &[(ResidentBuffer, u64, &[u8])]) -> Result<()> {
        crate::transfer::convenience::upload_at_many(&self.core, writes)
    }

    /// The whole buffer, read back.
    pub fn download(&self, buffer: ResidentBuffer) -> Result<Vec<u8>> {
        crate::transfer::convenience::download(&self.core, buffer)
    }

    /// `len` bytes of `buffer` at `offset`, read back.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] when the range does not lie in the buffer (`offset + len`
    /// overflowing included), checked before any host memory is reserved for the result.
    pub fn download_range(&self, buffer: ResidentBuffer, offset: u64, len: u64) -> Result<Vec<u8>> {
        crate::transfer::convenience::download_range(&self.core, buffer, offset, len)
    }

    /// Each whole buffer, read back as one batch (of any size: a batch larger than the
    /// pinned pool streams through it, see [`DownloadBatch`], each
    /// chunk copied into the result vectors as it lands).
    pub fn download_many(&self, buffers: &[ResidentBuffer]) -> Result<Vec<Vec<u8>>> {
        crate::transfer::convenience::download_many(&self.core, buffers)
    }

    /// Each `(buffer, offset, len)` range, read back as one batch (of any size, as
    /// [`Device::download_many`]).
    pub fn download_ranges(&self, ranges: &[(ResidentBuffer, u64, u64)]) -> Result<Vec<Vec<u8>>> {
        crate::transfer::convenience::download_ranges(&self.core, ranges)
    }

    /// Reads each `(buffer, offset, len)` range into the caller's vector of the same index,
    /// replacing its contents and reusing its capacity; one batch (of any size, as
    /// [`Device::download_many`]), one wait.
    pub fn download_into(&self, ranges: &[(ResidentBuffer, u64, u64)], out: &mut [Vec<u8>]) -> Result<()> {
        crate::transfer::convenience::download_into(&self.core, ranges, out)
    }

    /// Starts copying `len` bytes from host memory at `src` into `buffer` at `offset`, on the
    /// upload lane, and returns at once. [`Device::synchronize_uploads`] or the returned
    /// fence tells when it is done. A copy of 0 bytes (whose range is still checked) calls
    /// no driver entry point and returns a fence that is already complete.
    ///
    /// # Safety
    ///
    /// `[src, src + len)` must be readable host memory that stays valid and unchanged until
    /// the copy completes. (A [`PinnedBuffer`], or the
    /// [`Downloaded`](crate::Downloaded) of a batch whose view it is, may be dropped before
    /// then: the copy keeps that memory. Not so a prepared set's download.)
    ///
    /// # Errors
    ///
    /// [`Error::NotPinned`] (nothing enqueued) when the range is not pinned: pin it with
    /// [`Device::pin_host`] or use memory from [`Device::pinned`]. Every byte is checked
    /// where the driver reports the extent of pinned regions, as it does for `cuMemHostAlloc`
    /// and `cuMemHostRegister` (a range over two pinned regions with a pageable gap between
    /// them is refused); where it does not, the first and last byte. Pinned memory of
    /// this crate (a [`PinnedBuffer`], a batch download's views, of any
    /// device) is kept out of its pool until the copy completes, even if its holder is
    /// dropped first. Managed memory (`cuMemAllocManaged`) is not pinned
    /// host memory and is refused too.
    pub unsafe fn upload_async_at(
        &self,
        buffer: ResidentBuffer,
        offset: u64,
        src: *const u8,
        len: usize,
    ) -> Result<Fence> {
        // SAFETY: as the caller promises.
        unsafe { crate::transfer::single::upload_async_at(&self.core, buffer, offset, src, len) }
    }

    /// Starts copying `len` bytes of `buffer` at `offset` into host memory at `dst`, on the
    /// download lane, and returns at once; the bytes are there once the fence completes (or
    /// [`Device::synchronize_downloads`] returns).
    /// A copy of 0 bytes (whose range is still checked) calls no driver entry point and
    /// returns a fence that is already complete.
    ///
    /// # Safety
    ///
    /// `[dst, dst + len)` must be writable host memory that stays valid, and that nothing
    /// reads or writes, until the copy completes. It must be pinned, as for
    /// [`Device::upload_async_at`] ([`Error::NotPinned`] otherwise).
    pub unsafe fn download_async_at(
        &self,
        buffer: ResidentBuffer,
        offset: u64,
        dst: *mut u8,
        len: usize,
    ) -> Result<Fence> {
        // SAFETY: as the caller promises.
        unsafe { crate::transfer::single::download_async_at(&self.core, buffer, offset, dst, len) }
    }

    /// Reads `out.len()` bytes of `buffer` at `offset` into `out`, pipelined through a ring
    /// of pinned chunks: chunk `k + 1` is on the wire while chunk `k` is unpacked by the
    /// packing threads. For large ranges; any size works.
    ///
    /// # Errors
    /// A bad range or a stale buffer (nothing read into `out`). A driver error part way (a
    /// failed wait for a chunk) returns with the chunks unpacked before it already in
    /// `out`, the rest of `out` as it was: read into a scratch slice where a failed read
    /// must leave no trace.
    pub fn download_to_slice(&self, buffer: ResidentBuffer, offset: u64, out: &mut [u8]) -> Result<()> {
        crate::transfer::single::download_to_slice(&self.core, buffer, offset, out)
    }

    /// Blocks until every upload submitted so far on this device, from any thread, has
    /// completed: batches, prepared sets, a scope's uploads, [`Device::upload_async_at`] and
    /// peer copies into this device (they run on its upload lane). Downloads are not waited
    /// for ([`Device::synchronize_downloads`]; both: [`Device::synchronize`]).
    pub fn synchronize_uploads(&self) -> Result<()> {
        crate::transfer::single::synchronize_uploads(&self.core)
    }

    /// Blocks until every download submitted so far on this device, from any thread, has
    /// completed: batches, prepared sets, a scope's downloads and
    /// [`Device::download_async_at`] (whose bytes are then in the caller's memory). Uploads
    /// are not waited for ([`Device::synchronize_uploads`]; both: [`Device::synchronize`]).
    ///
    /// A batch's bytes still come through its [`PendingDownload`](crate::PendingDownload),
    /// whose wait then finds the device's part done.
    pub fn synchronize_downloads(&self) -> Result<()> {
        crate::transfer::single::synchronize_downloads(&self.core)
    }

    /// Page-locks `[ptr, ptr + len)` of host memory for fast, asynchronous copies
    /// (`cuMemHostRegister`, portable).
    ///
    /// # Safety
    ///
    /// The range must be mapped host memory that stays mapped until [`Device::unpin_host`].
    ///
    /// # Errors
    /// [`Error::EmptyHostRange`] for `len == 0` (the driver call is not made); the driver's
    /// error otherwise.
    pub unsafe fn pin_host(&self, ptr: *mut u8, len: usize) -> Result<()> {
        // SAFETY: as the caller promises.
        unsafe { crate::transfer::single::pin_host(&self.core, ptr, len) }
    }

    /// Undoes [`Device::pin_host`].
    ///
    /// # Safety
    ///
    /// `ptr` must be the start of a range pinned with `pin_host`, and no copy in flight may
    /// use it.
    pub unsafe fn unpin_host(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: as the caller promises.
        unsafe { crate::transfer::single::unpin_host(&self.core, ptr) }
    }

    /// Starts a batch of uploads: an ordinary [`UploadBatch`], which copies the caller's
    /// slices into pinned staging at `submit` (a [`Scope`]'s batch of the same type moves
    /// pinned memory in place instead: [`Device::scope`]).
    pub fn uploads(&self) -> UploadBatch<'_> {
        crate::transfer::upload::uploads(&self.core)
    }

    /// Runs `f` with a [`Scope`], whose batches move bytes straight between the device and
    /// the caller's own memory, then waits for every transfer submitted in it, and returns
    /// what `f` returned.
    ///
    /// The batches ([`Scope::uploads`], [`Scope::downloads`]) borrow the caller's slices for
    /// the whole scope, so nothing can touch them while the GPU may; the scope waits even if
    /// `f` returns an error or panics (the panic then goes on). Pinned memory moves with no
    /// staging copy on the host: ranges that follow each other in it (a host cache's slots,
    /// 1 MiB or more in all) by one DMA a chunk into or out of device staging and a scatter
    /// or gather launch inside the device; other ranges of this crate's pinned pool
    /// ([`Device::pinned`]) by one DMA each when large, by the copy kernel over the bus when
    /// small. Memory pinned by [`Device::pin_host`] moves in place in such runs (where a run
    /// crosses the border of a registration, the piece inside it, if shorter than a run, by
    /// one DMA a range); everything else takes the staged path of ordinary batches. This is
    /// the shape of a paging step: swap blocks out to a pinned host cache and others in, both
    /// directions at once. A batch moves nothing until its `submit`: a swap of thousands of
    /// small blocks between pinned memory and the device starts moving sooner as a few
    /// batches submitted one after the other, the first moving while the next is built
    /// (BENCHMARKS.md, "Paging", measures where that pays).
    ///
    /// ```no_run
    /// use cuda_resident::{Config, Device};
    ///
    /// let device = Device::open_configured(0, Config::default().with_pinned_cap_bytes(1 << 30))?;
    /// let pool = device.allocate(64 << 20)?;
    /// let mut cache = device.pinned(8 << 20)?; // the host cache, pinned
    /// let block = 256 << 10;
    /// let (out_half, in_half) = cache.split_at_mut(4 << 20);
    /// device.scope(|s| {
    ///     // Swap blocks 0..16 out into the first half, and the second half in as blocks 16..32.
    ///     let mut out = s.downloads();
    ///     for (i, dst) in out_half.chunks_mut(block).enumerate() {
    ///         out.read_to_slice(pool, (i * block) as u64, dst)?;
    ///     }
    ///     let mut into = s.uploads();
    ///     for (i, src) in in_half.chunks(block).enumerate() {
    ///         into.write(pool, ((16 + i) * block) as u64, src)?;
    ///     }
    ///     out.submit()?;
    ///     into.submit()?;
    ///     Ok(())
    /// })?; // both directions done, the cache's bytes are in place
    /// # Ok::<(), cuda_resident::Error>(())
    /// ```
    ///
    /// # Errors
    /// What `f` returned, else a failed wait for the scope's transfers. A lane whose wait
    /// fails is synchronized whole before the scope returns; a driver that, asked a few
    /// times, confirms neither that its copies are done nor that the context is lost (which
    /// runs no copy any more) aborts the process: returning would hand back memory the GPU
    /// may still read or write.
    pub fn scope<'env, R>(
        &'env self,
        f: impl for<'scope> FnOnce(&'scope Scope<'scope, 'env>) -> Result<R>,
    ) -> Result<R> {
        crate::transfer::scope::scope(&self.core, f)
    }

    /// Starts a batch of downloads: an ordinary [`DownloadBatch`], whose reads into the
    /// caller's slices land there before `submit` returns (a [`Scope`]'s batch of the same
    /// type lands them in pinned memory in place: [`Device::scope`]).
    pub fn downloads(&self) -> DownloadBatch<'_> {
        crate::transfer::download::downloads(&self.core)
    }

    /// Checks `ranges` (`(buffer, offset, len)` each) once, for uploading them again and
    /// again with new bytes ([`PreparedUploads::upload`]): the fast way to move the same
    /// thousands of small ranges every step.
    ///
    /// Ranges in order and apart (each past the end of the previous range of its buffer,
    /// with a gap), none longer than 16 KiB and at least 64 of them, are laid out once: the
    /// set keeps a pinned region for their bytes (from the pinned pool, packed as the ranges
    /// lie, until the set is dropped) and a device buffer of 24 bytes a range (the library's
    /// own memory, counted in
    /// [`AllocatorStats::library_bytes`](crate::AllocatorStats::library_bytes), not in
    /// [`Device::allocated_bytes`]) with every descriptor written there once: an upload then
    /// costs one parallel copy of the bytes and one launch per chunk. Other sets move
    /// as an [`UploadBatch`] each time (writes in order; later ones win): ranges that touch
    /// (a cache's adjacent blocks), that overlap or go back, any range longer than 16 KiB,
    /// fewer than 64 ranges, a GPU without unified addressing or a configuration without
    /// [`Config::small_copies_over_bus`](crate::Config::small_copies_over_bus).
    /// [`PreparedUploads::is_laid_out`] says which path a set takes, from the moment it is
    /// made. Blocks of any size whose bytes sit in pinned memory move fastest in place,
    /// through [`Device::scope`].
    ///
    /// # Errors
    /// The first bad range ([`Error::OutOfRange`], a freed buffer); nothing is kept.
    /// [`Error::PinnedExhausted`] or [`Error::PinnedCapExceeded`] when the pool cannot hold
    /// the region; the allocator's errors for the table.
    pub fn prepare_uploads(&self, ranges: &[(ResidentBuffer, u64, u64)]) -> Result<PreparedUploads> {
        crate::transfer::prepared::prepare_uploads(&self.core, ranges)
    }

    /// Checks `ranges` (`(buffer, offset, len)` each) once, for reading them again and again
    /// ([`PreparedDownloads::submit`], [`PreparedDownloads::download_into`]).
    ///
    /// Ranges in order and apart, as for [`Device::prepare_uploads`] (the same rule decides,
    /// and [`PreparedDownloads::is_laid_out`] tells), are laid out once in a
    /// pinned region that the set keeps, with every descriptor and view made once: a
    /// download then costs one launch per chunk, and its [`Downloaded`](crate::Downloaded)'s views
    /// point into that region. While one download of the set is alive (or in flight), the
    /// next moves as a [`DownloadBatch`] of its own, so views never
    /// change under a caller: drop a download before the next submit to stay on the fast
    /// path. Other sets move as a batch each time, and so does a set whose region the
    /// pinned pool cannot lend (larger than
    /// [`Config::pinned_cap_bytes`](crate::Config::pinned_cap_bytes), or more than is free):
    /// such a batch streams through the pool (see [`DownloadBatch`]).
    ///
    /// # Errors
    /// The first bad range ([`Error::OutOfRange`], a freed buffer); nothing is kept. The
    /// allocator's errors for the table.
    pub fn prepare_downloads(&self, ranges: &[(ResidentBuffer, u64, u64)]) -> Result<PreparedDownloads> {
        crate::transfer::prepared::prepare_downloads(&self.core, ranges)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    #[test]
    fn device_is_send_sync_and_cheap_to_clone() {
        fn check<T: Send + Sync + Clone>() {}
        check::<Device>();
        check::<crate::Fence>();
        fn send_sync<T: Send + Sync>() {}
        send_sync::<crate::Downloaded>();
        send_sync::<crate::PendingDownload>();
        send_sync::<crate::PinnedBuffer>();
        assert!(std::mem::size_of::<Device>() == std::mem::size_of::<usize>());
        assert!(std::mem::size_of::<ResidentBuffer>() <= 16);
    }

    #[test]
    fn open_with_a_library_that_is_not_cuda_fails_with_the_entry_point_named() {
        // SAFETY: libc's initialisers are sound (it is already loaded) and it exports no
        // driver entry point.
        let driver = Arc::new(unsafe { Driver::load_from("libc.so.6") }.unwrap());
        let err = Device::open_on_driver(driver, 0, Config::default()).unwrap_err();
        assert!(matches!(&err, Error::MissingSymbol(m) if m.entry() == "cuInit"), "{err}");
    }

    #[test]
    fn a_bad_config_is_reported_before_the_driver_is_touched() {
        // SAFETY: libc's initialisers are sound (it is already loaded) and it exports no
        // driver entry point.
        let driver = Arc::new(unsafe { Driver::load_from("libc.so.6") }.unwrap());
        let config = Config { budget_fraction: 2.0, ..Config::default() };
        let err = Device::open_on_driver(driver, 0, config).unwrap_err();
        assert!(matches!(err, Error::InvalidConfig { field: "budget_fraction", .. }), "{err}");
    }
}

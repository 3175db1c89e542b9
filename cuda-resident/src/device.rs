//! `Device`: one GPU's primary context, its lanes, its resident store and its pinned pool.

use std::fmt;
use std::sync::{Arc, OnceLock};

use cuda_sys::{CUcontext, Driver, DriverVersion};

use crate::alloc::{Allocator, AllocatorConfig, LastUse, ResidentBuffer};
use crate::context::Context;
use crate::engine::staging::DeviceStaging;
use crate::error::{Error, Result};
use crate::host_pool::{HostPool, PinnedBuffer};
use crate::kernels::Kernels;
use crate::raw::{Raw, release_retrying};
use crate::stream::{Lane, LaneKind, Lanes};
use crate::sync::{Mutex, lock};
use crate::telemetry::{Telemetry, TelemetrySnapshot};

/// Settings of a [`Device`]. The defaults need no tuning; each field says when to change it.
///
/// Start from the defaults and set what you need, with the `with_*` setters or by assigning
/// the public fields (new fields may be added, so `Config` cannot be built as a literal):
///
/// ```
/// use cuda_resident::Config;
///
/// let config = Config::default().with_chunk_bytes(8 << 20).with_pack_threads(4);
/// let mut same = Config::default();
/// same.chunk_bytes = 8 << 20;
/// same.pack_threads = 4;
/// assert_eq!(config, same);
/// config.validate()?;
/// # Ok::<(), cuda_resident::Error>(())
/// ```
///
/// ```compile_fail,E0639
/// // Not as a literal, even with the rest from the defaults:
/// let config = cuda_resident::Config { chunk_bytes: 8 << 20, ..Default::default() };
/// ```
///
/// The measurements behind the defaults are in
/// [BENCHMARKS.md](https://github.com/cuda-resident/cuda-resident/blob/main/BENCHMARKS.md).
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Config {
    /// The share of device memory this device's allocator may hold: at most this fraction of
    /// the total, and of what is free when it grows: the allocator may hold
    /// `resident + min(f * total - resident, f * free)`, where `resident` is what it already
    /// holds and `free` what the driver reports free when it needs a new slab.
    /// In `(0, 1]`; default 0.9. Lower it when other processes share the GPU.
    pub budget_fraction: f64,
    /// Bytes of each slab the allocator takes from the driver; buffers past it get their own
    /// allocation. At least 4 MiB, a multiple of 256; default 64 MiB.
    pub slab_bytes: u64,
    /// The most pinned host memory the pinned pool holds. At least `2 * chunk_bytes`;
    /// default 1 GiB. Batches larger than this still move: uploads pipeline through it in
    /// chunks, and a download the pool cannot hold at once streams through a ring of chunks
    /// (see [`DownloadBatch`](crate::DownloadBatch)). Of the cap,
    /// `min(8 * chunk_bytes, pinned_cap_bytes / 2)`, but at least two chunks (128 MiB by
    /// default), is kept for transfers: pinned buffers ([`Device::pinned`]), prepared sets'
    /// regions and unreleased download views may hold the rest, so that transfers always find
    /// pinned memory (a prepared set that finds no room moves as batches do, a download
    /// streams). At a cap of two chunks that is the whole pool: [`Device::pinned`] then fails
    /// with [`Error::PinnedReserved`].
    pub pinned_cap_bytes: u64,
    /// Pinned memory allocated when the device opens, so that the first copies do not pay
    /// for `cuMemHostAlloc` (about 0.5 ms per MiB). Default 0.
    pub pinned_prewarm_bytes: u64,
    /// Staging chunk: large copies are pipelined through pinned memory in chunks of this
    /// size. At least 64 KiB; default 16 MiB (smaller chunks move large copies from pageable
    /// memory markedly slower).
    pub chunk_bytes: u64,
    /// Copies of at least this many bytes get their own DMA; smaller ones are packed and
    /// scattered by a kernel. At most `chunk_bytes`; default 256 KiB.
    pub direct_threshold: u64,
    /// Threads that pack pinned memory for large batches; 0 picks one per core, up to 16.
    pub pack_threads: usize,
    /// Microseconds the packing threads stay awake (spinning, yielding now and then; all
    /// but one of them) after a batch's packing, so that the next batch's packing starts at
    /// once instead of after the threads wake (which takes tens of microseconds, as long as
    /// moving a batch of thousands of small copies). They stop as soon as new packing starts.
    /// 0 lets them sleep at once, for processes that need those cores between batches or run
    /// under a CPU quota (spinning threads use it up). At most 10 000; default 300, which
    /// speeds up prepared uploads of small rows; downloads gain nothing.
    pub pack_linger_us: u64,
    /// Batches of many small copies in order (the paths that skip the planner): whether the
    /// copy kernel may read the packed bytes of an upload, and write those of a download,
    /// straight in pinned memory, over the bus, instead of one DMA through device staging
    /// plus a scatter (or a gather plus a DMA). Default `true`; a wish, granted only where
    /// the GPU has unified addressing ([`Device::moves_small_copies_over_bus`] says whether it
    /// was). The kernel then runs for as long as the bytes are on the wire (one block of 256
    /// threads per multiprocessor), where a scatter runs for microseconds: set `false` when
    /// your own kernels keep every multiprocessor busy, or on a platform whose kernels may
    /// not touch host memory even with unified addressing. Over the bus, small uploads from
    /// pageable memory move faster than through device staging.
    pub small_copies_over_bus: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            budget_fraction: 0.9,
            slab_bytes: 64 << 20,
            pinned_cap_bytes: 1 << 30,
            pinned_prewarm_bytes: 0,
            chunk_bytes: 16 << 20,
            direct_threshold: 256 << 10,
            pack_threads: 0,
            pack_linger_us: 300,
            small_copies_over_bus: true,
        }
    }
}

impl Config {
    /// Checks every field; the error names the field and what to set.
    pub fn validate(&self) -> Result<()> {
        let invalid =
            |field, value: String, reason, fix| Err(Error::InvalidConfig { field, value, reason, fix });
        if !(self.budget_fraction > 0.0 && self.budget_fraction <= 1.0) {
            return invalid(
                "budget_fraction",
                self.budget_fraction.to_string(),
                "it must be a fraction in (0, 1]",
                "use a value such as 0.9 (the default)",
            );
        }
        let min_slab = crate::alloc::classes::MAX_CLASS_BYTES;
        if self.slab_bytes < min_slab || !self.slab_bytes.is_multiple_of(crate::alloc::classes::GRANULE) {
            return invalid(
                "slab_bytes",
                self.slab_bytes.to_string(),
                "it must be at least 4 MiB and a multiple of 256",
                "use 64 MiB (the default) or another multiple of 2 MiB",
            );
        }
        if self.chunk_bytes < crate::host_pool::MIN_ARENA {
            return invalid(
                "chunk_bytes",
                self.chunk_bytes.to_string(),
                "it must be at least 64 KiB",
                "use 16 MiB (the default)",
            );
        }
        if self.pinned_cap_bytes < 2 * self.chunk_bytes {
            return invalid(
                "pinned_cap_bytes",
                self.pinned_cap_bytes.to_string(),
                "it must hold at least two staging chunks (2 * chunk_bytes)",
                "raise it (default 1 GiB) or lower chunk_bytes",
            );
        }
        if self.pinned_prewarm_bytes > self.pinned_cap_bytes {
            return invalid(
                "pinned_prewarm_bytes",
                self.pinned_prewarm_bytes.to_string(),
                "it exceeds pinned_cap_bytes",
                "prewarm at most pinned_cap_bytes",
            );
        }
        if self.pack_linger_us > MAX_LINGER_US {
            return invalid(
                "pack_linger_us",
                self.pack_linger_us.to_string(),
                "it must be at most 10000 (10 ms)",
                "use a few hundred microseconds, or 0 to let the threads sleep at once",
            );
        }
        if self.direct_threshold == 0 || self.direct_threshold > self.chunk_bytes {
            return invalid(
                "direct_threshold",
                self.direct_threshold.to_string(),
                "it must be between 1 and chunk_bytes",
                "use 256 KiB (the default)",
            );
        }
        Ok(())
    }

    /// The pinned bytes kept for transfers: held staging may take the rest of the cap.
    /// At least two chunks (the largest lease a transfer takes is a chunk and its descriptor
    /// table, under 1.5 chunks), or the whole cap where it is smaller.
    pub(crate) fn pinned_reserve(&self) -> u64 {
        (8 * self.chunk_bytes)
            .min(self.pinned_cap_bytes / 2)
            .max((2 * self.chunk_bytes).min(self.pinned_cap_bytes))
    }

    /// The packing threads this config asks for, with 0 resolved.
    pub fn resolved_pack_threads(&self) -> usize {
        match self.pack_threads {
            0 => std::thread::available_parallelism().map_or(4, |n| n.get()).min(16),
            n => n,
        }
    }
}

/// Builder-style setters, one per field: `Config::default().with_chunk_bytes(8 << 20)`.
/// They only set the field; [`Config::validate`] (or opening the device) checks it.
impl Config {
    /// Sets [`Config::budget_fraction`].
    #[must_use]
    pub fn with_budget_fraction(mut self, budget_fraction: f64) -> Config {
        self.budget_fraction = budget_fraction;
        self
    }

    /// Sets [`Config::slab_bytes`].
    #[must_use]
    pub fn with_slab_bytes(mut self, slab_bytes: u64) -> Config {
        self.slab_bytes = slab_bytes;
        self
    }

    /// Sets [`Config::pinned_cap_bytes`].
    #[must_use]
    pub fn with_pinned_cap_bytes(mut self, pinned_cap_bytes: u64) -> Config {
        self.pinned_cap_bytes = pinned_cap_bytes;
        self
    }

    /// Sets [`Config::pinned_prewarm_bytes`].
    #[must_use]
    pub fn with_pinned_prewarm_bytes(mut self, pinned_prewarm_bytes: u64) -> Config {
        self.pinned_prewarm_bytes = pinned_prewarm_bytes;
        self
    }

    /// Sets [`Config::chunk_bytes`].
    #[must_use]
    pub fn with_chunk_bytes(mut self, chunk_bytes: u64) -> Config {
        self.chunk_bytes = chunk_bytes;
        self
    }

    /// Sets [`Config::direct_threshold`].
    #[must_use]
    pub fn with_direct_threshold(mut self, direct_threshold: u64) -> Config {
        self.direct_threshold = direct_threshold;
        self
    }

    /// Sets [`Config::pack_threads`].
    #[must_use]
    pub fn with_pack_threads(mut self, pack_threads: usize) -> Config {
        self.pack_threads = pack_threads;
        self
    }

    /// Sets [`Config::pack_linger_us`].
    #[must_use]
    pub fn with_pack_linger_us(mut self, pack_linger_us: u64) -> Config {
        self.pack_linger_us = pack_linger_us;
        self
    }

    /// Sets [`Config::small_copies_over_bus`].
    #[must_use]
    pub fn with_small_copies_over_bus(mut self, small_copies_over_bus: bool) -> Config {
        self.small_copies_over_bus = small_copies_over_bus;
        self
    }
}

/// The longest [`Config::pack_linger_us`].
const MAX_LINGER_US: u64 = 10_000;

/// What a device is and can do, read once when it opens.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceInfo {
    /// The ordinal it was opened with.
    pub ordinal: usize,
    /// The product name (`"NVIDIA H200"`).
    pub name: String,
    /// The PCI bus id (`"0000:41:00.0"`).
    pub pci_bus_id: String,
    /// Device memory in bytes.
    pub total_memory: u64,
    /// Compute capability, `(major, minor)`.
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Copy engines (`CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT`): 2 or more lets uploads and
    /// downloads run at the same time.
    pub copy_engines: u32,
    /// Whether stream-ordered memory pools (`cuMemAllocAsync`) are supported.
    pub memory_pools: bool,
    /// Whether the driver has `cuMemcpyBatchAsync` (CUDA 12.8 and newer).
    pub batch_memcpy: bool,
    /// Whether the device shares a unified address space with the host.
    pub unified_addressing: bool,
    /// The CUDA version the driver supports.
    pub driver_version: DriverVersion,
}

/// The shared state of a device. Fences hold its lanes and lent staging its context, so
/// that nothing they refer to goes away early; dropping it waits for the copies in flight
/// before their memory is freed.
pub(crate) struct Core {
    pub(crate) ctx: Arc<Context>,
    pub(crate) info: DeviceInfo,
    pub(crate) config: Config,
    pub(crate) alloc: Allocator<Arc<Context>>,
    pub(crate) pinned: Arc<HostPool>,
    pub(crate) lanes: Arc<Lanes>,
    pub(crate) telemetry: Telemetry,
    /// Device staging per lane, used under that lane's batch lock.
    pub(crate) staging: [Mutex<DeviceStaging>; 2],
    kernels: OnceLock<Kernels>,
    packers: OnceLock<rayon::ThreadPool>,
    /// Packing runs under way: the packing threads lingering after the last one stop when
    /// another starts ([`crate::engine::pipeline::linger`]).
    pub(crate) packing: Arc<crate::sync::shim::atomic::AtomicUsize>,
    /// The contexts of the devices whose memory this context was given access to
    /// (`cuCtxEnablePeerAccess`), kept alive: access ends when either context is destroyed.
    pub(crate) peers: Mutex<Vec<Arc<Context>>>,
    /// What finished batches leave for the next ones.
    pub(crate) spares: crate::engine::spares::Spares,
}

impl Core {
    pub(crate) fn lane(&self, kind: LaneKind) -> &Lane {
        self.lanes.lane(kind)
    }

    /// The scatter/gather kernel, loaded on first use.
    pub(crate) fn kernels(&self) -> Result<&Kernels> {
        if let Some(k) = self.kernels.get() {
            return Ok(k);
        }
        let loaded = Kernels::load(self.ctx.bind()?, self.info.multiprocessors)?;
        if let Err(lost) = self.kernels.set(loaded) {
            // Another thread loaded it first.
            let _ = lost.unload(&self.ctx.raw);
        }
        Ok(self.kernels.get().expect("set above"))
    }

    /// The packing threads, started on first use and kept for the device's life.
    pub(crate) fn packers(&self) -> &rayon::ThreadPool {
        self.packers.get_or_init(|| {
            let threads = self.config.resolved_pack_threads();
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("cuda-resident-pack-{i}"))
                .build()
                // Spawning threads fails only when the system is out of resources; a pool
                // of one thread (the caller) still packs correctly.
                .or_else(|_| rayon::ThreadPoolBuilder::new().num_threads(1).use_current_thread().build())
                .expect("a one-thread pool on the current thread cannot fail")
        })
    }

    /// Whether no copy in flight uses a buffer whose last uses were `last`, asking the
    /// driver when the timelines do not already say so.
    pub(crate) fn is_idle(&self, last: LastUse) -> bool {
        LaneKind::ALL.iter().all(|&k| self.lane(k).is_done(last[k.index()]).unwrap_or(false))
    }

    /// The same from the timelines alone: atomic loads, no lock, no driver call (safe to ask
    /// under the allocator's shard locks). `false` may mean "not known yet".
    pub(crate) fn is_known_idle(&self, last: LastUse) -> bool {
        LaneKind::ALL.iter().all(|&k| self.lane(k).is_known_done(last[k.index()]))
    }

    /// Pinned memory of `len` bytes for a transfer, waiting for copies in flight when the
    /// pool is full.
    pub(crate) fn acquire_staging(&self, len: usize) -> Result<crate::host_pool::HostLease> {
        self.acquire_staging_as(len, false)
    }

    /// Pinned memory of `len` bytes, held past any transfer (`held`: see
    /// [`Device::pinned`]) or for one, waiting for copies in flight when the pool is full.
    pub(crate) fn acquire_staging_as(&self, len: usize, held: bool) -> Result<crate::host_pool::HostLease> {
        let mut retried = false;
        loop {
            if let Some(lease) = self.pinned.try_acquire_as(len, held)? {
                return Ok(lease);
            }
            // Full: retire completed copies, and wait for the oldest one on each lane, which
            // releases its staging. Once nothing is in flight, one more try, then give up.
            let mut waited = false;
            for &kind in &LaneKind::ALL {
                let lane = self.lane(kind);
                lane.poll()?;
                if let Some(seq) = lane.oldest_in_flight() {
                    waited |= lane.wait(seq)?;
                }
            }
            if !waited {
                if retried {
                    let stats = self.pinned.stats();
                    return Err(Error::PinnedExhausted {
                        requested: len as u64,
                        cap: stats.cap_bytes,
                        lent: stats.lent_bytes,
                    });
                }
                retried = true;
            }
        }
    }

    /// Allocates a buffer of the library's own (device staging, prepared sets' tables):
    /// under the same budget, counted apart from the caller's bytes.
    pub(crate) fn allocate_for_library(&self, bytes: u64) -> Result<ResidentBuffer> {
        self.alloc.allocate_as(bytes, true, &|last| self.is_idle(last))
    }

    /// Checks that `[offset, offset + len)` lies in `buffer`; returns the buffer's device
    /// address of `offset`.
    pub(crate) fn checked_range(&self, buffer: ResidentBuffer, offset: u64, len: u64) -> Result<u64> {
        let (ptr, buffer_len) = self.alloc.resolve(buffer)?;
        match offset.checked_add(len) {
            Some(end) if end <= buffer_len => Ok(ptr + offset),
            _ => Err(Error::OutOfRange { buffer, offset, len, buffer_len }),
        }
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        // Copies in flight finish before the memory they use is freed.
        for lane in self.lanes.iter() {
            let _ = lane.synchronize();
        }
        let _ = release_retrying(|| self.ctx.bind().map(drop));
        if let Some(kernels) = self.kernels.get() {
            let _ = release_retrying(|| kernels.unload(&self.ctx.raw));
        }
        let _ = self.alloc.release_all();
    }
}

/// One GPU: its primary context, two copy lanes, a budgeted resident store and a pinned
/// pool.
///
/// `Device` is `Send + Sync` and cheap to clone (an `Arc` inside); clones share everything.
/// The context and all memory are released when the last clone, fence and lent staging
/// region are gone.
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

/// The process-wide driver, loaded on first use.
pub(crate) fn shared_driver() -> Result<Arc<Driver>> {
    static DRIVER: OnceLock<Result<Arc<Driver>, cuda_sys::LoadError>> = OnceLock::new();
    DRIVER.get_or_init(|| Driver::load().map(Arc::new)).clone().map_err(Error::from)
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
        Device::open_with(shared_driver()?, ordinal, Config::default())
    }

    /// Opens device `ordinal` through `driver` (for a driver loaded from a particular path,
    /// or one whose table was altered for testing) with `config`.
    pub fn open_with(driver: Arc<Driver>, ordinal: usize, config: Config) -> Result<Device> {
        config.validate()?;
        let raw = Raw::new(driver);
        raw.init()?;
        let count = raw.device_count()?;
        let cu_ordinal = i32::try_from(ordinal).ok().filter(|_| ordinal < count);
        let Some(cu_ordinal) = cu_ordinal else {
            return Err(Error::NoSuchDevice { ordinal, count });
        };
        let cu_device = raw.device_get(cu_ordinal)?;
        let ctx = Arc::new(Context::retain(raw, cu_device)?);
        let raw = ctx.bind()?;
        let info = query_info(raw, cu_device, ordinal)?;
        let telemetry = Telemetry::default();
        let lanes = Arc::new(Lanes::new(Arc::clone(&ctx), Arc::clone(&telemetry.host_waits))?);
        let pinned =
            Arc::new(HostPool::new(Arc::clone(&ctx), config.pinned_cap_bytes, config.pinned_reserve()));
        pinned.prewarm(config.chunk_bytes as usize, config.pinned_prewarm_bytes)?;
        let alloc = Allocator::new(
            Arc::clone(&ctx),
            ordinal,
            AllocatorConfig {
                total_memory: info.total_memory,
                budget_fraction: config.budget_fraction,
                slab_bytes: config.slab_bytes,
            },
        );
        let core = Core {
            ctx,
            info,
            config,
            alloc,
            pinned,
            lanes,
            telemetry,
            staging: Default::default(),
            kernels: OnceLock::new(),
            packers: OnceLock::new(),
            packing: Default::default(),
            peers: Mutex::new(Vec::new()),
            spares: Default::default(),
        };
        Ok(Device { core: Arc::new(core) })
    }

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
        self.core.config.small_copies_over_bus && self.info().unified_addressing
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
        let waited = raw.event_record(event, stream).and_then(|()| {
            self.core.lanes.iter().try_for_each(|lane| {
                // Between batches, not inside one.
                let _batch = lane.batch();
                raw.stream_wait_event(lane.stream(), event)
            })
        });
        // A wait already enqueued keeps what it waits for: the event can go at once.
        let _ = release_retrying(|| raw.event_destroy(event));
        waited
    }

    /// Allocates `bytes` of device memory under the budget. Buffers are 256-byte aligned.
    ///
    /// Fails for zero bytes, and when the budget (or the driver, after cached memory was
    /// released) refuses; the error gives the request, the bytes in use and the limit.
    pub fn allocate(&self, bytes: u64) -> Result<ResidentBuffer> {
        self.core.alloc.allocate(bytes, &|last| self.core.is_idle(last))
    }

    /// Allocates a buffer of the library's own (device staging, prepared sets' tables):
    /// under the same budget, counted apart from the caller's bytes.
    pub(crate) fn allocate_for_library(&self, bytes: u64) -> Result<ResidentBuffer> {
        self.core.allocate_for_library(bytes)
    }

    /// Frees a buffer. The handle is invalid at once; if a copy still uses the buffer, its
    /// memory is reused only after the copy completes.
    ///
    /// An error from the driver's own free (`cuMemFree`, for a buffer past the slab size)
    /// is returned, but the handle is freed all the same: the memory stays counted as held
    /// and the next [`Device::trim`] tries again.
    pub fn free(&self, buffer: ResidentBuffer) -> Result<()> {
        self.core.alloc.free(buffer, &|last| self.core.is_known_idle(last))
    }

    /// The buffer's device address, for the caller's kernels. Valid until the buffer is freed.
    pub fn device_ptr(&self, buffer: ResidentBuffer) -> Result<u64> {
        self.core.alloc.resolve(buffer).map(|(ptr, _)| ptr)
    }

    /// The buffer's length in bytes, as allocated.
    pub fn buffer_len(&self, buffer: ResidentBuffer) -> Result<u64> {
        self.core.alloc.resolve(buffer).map(|(_, len)| len)
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

    /// Releases cached device memory and free pinned memory back to the driver, and the
    /// host memory kept from the last download that streamed into memory of its own (see
    /// [`Downloaded`](crate::Downloaded)). Returns the bytes of device memory released.
    pub fn trim(&self) -> Result<u64> {
        let released = self.core.alloc.trim(&|last| self.core.is_idle(last))?;
        drop(std::mem::take(&mut *lock(&self.core.spares.streamed_host)));
        self.core.pinned.trim()?;
        Ok(released)
    }

    /// Lends `len` bytes of pinned host memory from the pinned pool (at least 1 byte is
    /// lent for 0). It returns to the pool when dropped. When the pool is at its cap, waits
    /// for copies in flight to release their staging.
    ///
    /// Pinned buffers, prepared sets and download views are held staging: together they may
    /// take the pool's cap less a reserve kept for transfers ([`Config::pinned_cap_bytes`]);
    /// past that, [`Error::PinnedReserved`].
    pub fn pinned(&self, len: usize) -> Result<PinnedBuffer> {
        self.acquire_held_staging(len).map(PinnedBuffer::new)
    }

    /// Pinned memory of `len` bytes for a transfer, waiting for copies in flight when the
    /// pool is full.
    pub(crate) fn acquire_staging(&self, len: usize) -> Result<crate::host_pool::HostLease> {
        self.core.acquire_staging(len)
    }

    /// Held pinned memory of `len` bytes (kept past any transfer: see
    /// [`Device::pinned`]), waiting for copies in flight when the pool is full.
    pub(crate) fn acquire_held_staging(&self, len: usize) -> Result<crate::host_pool::HostLease> {
        self.core.acquire_staging_as(len, true)
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
}

fn query_info(raw: &Raw, device: cuda_sys::CUdevice, ordinal: usize) -> Result<DeviceInfo> {
    use cuda_sys::*;
    let attr = |a| raw.device_attribute(device, a);
    Ok(DeviceInfo {
        ordinal,
        name: raw.device_name(device)?,
        pci_bus_id: raw.device_pci_bus_id(device)?,
        total_memory: raw.device_total_mem(device)?,
        compute_capability: (
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        multiprocessors: attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
        copy_engines: attr(CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT)? as u32,
        memory_pools: attr(CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? != 0,
        batch_memcpy: raw.driver.api().cuMemcpyBatchAsync_v2.is_ok(),
        unified_addressing: attr(CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)? != 0,
        driver_version: raw.driver.version().unwrap_or(DriverVersion(0)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_is_valid() {
        Config::default().validate().unwrap();
        assert!(Config::default().resolved_pack_threads() >= 1);
    }

    #[test]
    fn invalid_configs_name_the_field_and_the_fix() {
        let cases: Vec<(Config, &str)> = vec![
            (Config { budget_fraction: 0.0, ..Config::default() }, "budget_fraction"),
            (Config { budget_fraction: 1.5, ..Config::default() }, "budget_fraction"),
            (Config { budget_fraction: f64::NAN, ..Config::default() }, "budget_fraction"),
            (Config { slab_bytes: 1 << 20, ..Config::default() }, "slab_bytes"),
            (Config { slab_bytes: (64 << 20) + 1, ..Config::default() }, "slab_bytes"),
            (Config { chunk_bytes: 1024, ..Config::default() }, "chunk_bytes"),
            (Config { pack_linger_us: 10_001, ..Config::default() }, "pack_linger_us"),
            (Config { pinned_cap_bytes: 16 << 20, ..Config::default() }, "pinned_cap_bytes"),
            (Config { pinned_prewarm_bytes: 2 << 30, ..Config::default() }, "pinned_prewarm_bytes"),
            (Config { direct_threshold: 0, ..Config::default() }, "direct_threshold"),
            (Config { direct_threshold: 32 << 20, ..Config::default() }, "direct_threshold"),
        ];
        for (config, field) in cases {
            let err = config.validate().unwrap_err();
            let text = err.to_string();
            assert!(text.starts_with(&format!("Config::{field} = ")), "{text}");
            assert!(text.contains("Fix: "), "{text}");
        }
    }

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
        let driver = Arc::new(Driver::load_from("libc.so.6").unwrap());
        let err = Device::open_with(driver, 0, Config::default()).unwrap_err();
        assert!(matches!(&err, Error::MissingSymbol(m) if m.entry() == "cuInit"), "{err}");
    }

    #[test]
    fn a_bad_config_is_reported_before_the_driver_is_touched() {
        let driver = Arc::new(Driver::load_from("libc.so.6").unwrap());
        let config = Config { budget_fraction: 2.0, ..Config::default() };
        let err = Device::open_with(driver, 0, config).unwrap_err();
        assert!(matches!(err, Error::InvalidConfig { field: "budget_fraction", .. }), "{err}");
    }
}

//! `Core`: the shared state of one device, which the engine and every batch work on, and
//! its opening.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use cuda_sys::Driver;

use crate::alloc::{Allocator, AllocatorConfig, LastUse, ResidentBuffer};
use crate::config::{Config, DeviceInfo};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::host_pool::HostPool;
use crate::kernels::Kernels;
use crate::raw::{Raw, release_retrying};
use crate::stream::{Lane, LaneKind, Lanes};
use crate::sync::Mutex;
use crate::telemetry::Telemetry;

use super::host::Staging;
use super::order::Ledger;
use super::pipeline::Packers;
use super::spares::Spares;
use super::staging::{DeviceRegion, DeviceStaging};

/// How long a transfer that found the pinned pool full waits for other transfers' staging
/// before it looks again at the copies in flight.
const TRANSFER_WAIT: Duration = Duration::from_millis(10);
/// How long it goes on waiting with no staging coming back and no work completing, before
/// it fails with [`Error::PinnedExhausted`].
const TRANSFER_STALL: Duration = Duration::from_secs(2);

/// The process-wide driver, loaded on first use.
pub(crate) fn shared_driver() -> Result<Arc<Driver>> {
    static DRIVER: OnceLock<Result<Arc<Driver>, cuda_sys::LoadError>> = OnceLock::new();
    DRIVER.get_or_init(|| Driver::load().map(Arc::new)).clone().map_err(Error::from)
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
    /// The packing threads.
    pub(crate) packers: Packers,
    /// The contexts of the devices whose memory this context was given access to
    /// (`cuCtxEnablePeerAccess`), kept alive: access ends when either context is destroyed.
    pub(crate) peers: Mutex<Vec<Arc<Context>>>,
    /// Buffers shown by cudarc views, and how many views of each ([`Core::view_guard`]);
    /// the count of all, so that a free looks at the map only while there are some.
    #[cfg(any(feature = "cudarc", test))]
    pub(crate) viewed:
        (std::sync::atomic::AtomicUsize, Mutex<std::collections::HashMap<ResidentBuffer, usize>>),
    /// What finished batches leave for the next ones.
    pub(crate) spares: Spares,
    /// The device ranges each lane's batches in flight use.
    pub(crate) order: Ledger,
}

impl Core {
    /// Opens device `ordinal` through `driver` with `config`: retains its primary context
    /// and sets up its lanes, pinned pool and allocator.
    pub(crate) fn open(driver: Arc<Driver>, ordinal: usize, config: Config) -> Result<Core> {
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
        let huge = config.pinned_huge_pages && huge_pages_usable(raw, cu_device)?;
        let pinned =
            Arc::new(HostPool::new(Arc::clone(&ctx), config.pinned_cap_bytes, config.pinned_reserve(), huge));
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
        let packers = Packers::new(config.resolved_pack_threads(), config.pack_linger_us);
        Ok(Core {
            ctx,
            info,
            config,
            alloc,
            pinned,
            lanes,
            telemetry,
            staging: Default::default(),
            kernels: OnceLock::new(),
            packers,
            peers: Mutex::new(Vec::new()),
            #[cfg(any(feature = "cudarc", test))]
            viewed: Default::default(),
            spares: Default::default(),
            order: Ledger::default(),
        })
    }

    #[inline]
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
        self.packers.pool()
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
    /// `Device::pinned`) or for one, waiting for copies in flight when the pool is full.
    pub(crate) fn acquire_staging_as(&self, len: usize, held: bool) -> Result<crate::host_pool::HostLease> {
        self.acquire_staging_with(len, held, false)
    }

    /// Pinned memory of `len` bytes for the transfer this thread is running (an
    /// [`Exec`](super::Exec)'s), which gives it back before the transfer returns: counted so
    /// that a transfer of another thread that finds the pool full waits for it.
    pub(crate) fn acquire_transfer_staging(&self, len: usize) -> Result<crate::host_pool::HostLease> {
        self.acquire_staging_with(len, false, true)
    }

    fn acquire_staging_with(
        &self,
        len: usize,
        held: bool,
        transfer: bool,
    ) -> Result<crate::host_pool::HostLease> {
        let mut retried = false;
        // The last sign of progress while waiting for other transfers, and when it came.
        let mut progress = ((0, 0, 0), Instant::now());
        loop {
            let lease = match transfer {
                true => self.pinned.try_acquire_for_transfer(len)?,
                false => self.pinned.try_acquire_as(len, held)?,
            };
            if let Some(lease) = lease {
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
            // Nothing in flight: running transfers (of other threads, or this one's being
            // handed back by a thread that retired them) may hold staging they give back
            // without waiting for anyone. Wait for it while something moves: staging comes
            // back, or a lane completes work.
            if !waited && let Some(returns) = self.pinned.wait_for_transfers(TRANSFER_WAIT) {
                let mark = (
                    returns,
                    self.lane(LaneKind::Upload).known_done(),
                    self.lane(LaneKind::Download).known_done(),
                );
                if mark != progress.0 {
                    progress = (mark, Instant::now());
                }
                if progress.1.elapsed() < TRANSFER_STALL {
                    retried = false;
                    continue;
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

    /// The address of at least `len` bytes of `region`, `lane`'s device staging, growing it
    /// if need be. Must be called under the lane's batch lock; `last_seq` is the lane's last
    /// submission, which may still use the old staging.
    pub(crate) fn ensure_region(
        &self,
        region: &mut DeviceRegion,
        lane: LaneKind,
        len: u64,
        last_seq: u64,
    ) -> Result<u64> {
        if let Some(ptr) = region.holding(len) {
            return Ok(ptr);
        }
        let want = len.max(1 << 20).next_power_of_two();
        let new = self.allocate_for_library(want)?;
        let (ptr, _) = self.alloc.resolve(new)?;
        let staging = &self.telemetry.staging_bytes;
        staging.fetch_add(want, std::sync::atomic::Ordering::Relaxed);
        if let Some((old, old_len)) = region.replace(new, ptr, want) {
            crate::counter::take_atomic(staging, old_len, "staging bytes");
            // Work already enqueued may still use it: free after that work.
            self.alloc.mark_used(old, lane.index(), last_seq)?;
            // A refused driver free is not this batch's failure: the memory stays listed
            // and the next trim retries it.
            let _ = self.alloc.free(old, &|last| self.is_known_idle(last));
        }
        Ok(ptr)
    }

    /// Frees `buffer` (see `Device::free`).
    #[inline]
    pub(crate) fn free(&self, buffer: ResidentBuffer) -> Result<()> {
        #[cfg(any(feature = "cudarc", test))]
        if self.viewed.0.load(std::sync::atomic::Ordering::Acquire) > 0
            && let Some(&views) = crate::sync::lock(&self.viewed.1).get(&buffer)
        {
            // A stale handle is refused as such by the allocator; a live one stays viewed.
            self.alloc.resolve(buffer)?;
            return Err(crate::error::Error::BufferViewed { buffer, views });
        }
        self.alloc.free(buffer, &|last| self.is_known_idle(last))
    }

    /// Marks `buffer` as shown by a view of foreign work (a cudarc view) until the guard
    /// drops: [`Core::free`] refuses it meanwhile, and the guard's drop waits, on the host,
    /// for every stream of this device's context and of its peers' (the streams that may run
    /// work enqueued through the view), so that the memory is free of it once freed.
    #[cfg(any(feature = "cudarc", test))]
    pub(crate) fn view_guard(self: &Arc<Core>, buffer: ResidentBuffer) -> Result<ViewGuard> {
        self.alloc.resolve(buffer)?;
        *crate::sync::lock(&self.viewed.1).entry(buffer).or_insert(0) += 1;
        self.viewed.0.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Ok(ViewGuard { core: Arc::clone(self), buffer })
    }

    /// The buffer's device address.
    #[inline]
    pub(crate) fn device_ptr(&self, buffer: ResidentBuffer) -> Result<u64> {
        self.alloc.resolve(buffer).map(|(ptr, _)| ptr)
    }

    /// The buffer's length in bytes, as allocated.
    #[inline]
    pub(crate) fn buffer_len(&self, buffer: ResidentBuffer) -> Result<u64> {
        self.alloc.resolve(buffer).map(|(_, len)| len)
    }

    /// Held pinned memory of `len` bytes (kept past any transfer: see `Device::pinned`),
    /// waiting for copies in flight when the pool is full.
    pub(crate) fn acquire_held_staging(&self, len: usize) -> Result<crate::host_pool::HostLease> {
        self.acquire_staging_as(len, true)
    }

    /// Whether batches of small copies in order move over the bus: the configuration asks
    /// for it and the GPU has unified addressing.
    /// An empty set of device ranges for a batch on `kind`'s lane (`engine::Exec::claim_built`).
    pub(crate) fn ranges(&self, kind: LaneKind) -> super::order::Ranges {
        self.order.ranges(kind.index())
    }

    pub(crate) fn moves_small_copies_over_bus(&self) -> bool {
        self.config.small_copies_over_bus && self.info.unified_addressing
    }

    /// The device's ordinal where a submission's DMAs go to the driver as one
    /// `cuMemcpyBatchAsync` ([`Config::dma_batches`](crate::Config::dma_batches), the driver
    /// has it, and host addresses are device addresses: the call takes both kinds as one
    /// type, and tells them apart only in a unified address space); `None` for one call each.
    pub(crate) fn dma_batches(&self) -> Option<i32> {
        (self.config.dma_batches && self.info.batch_memcpy && self.info.unified_addressing)
            .then_some(self.info.ordinal as i32)
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

impl Staging for Core {
    fn pinned_cap(&self) -> u64 {
        self.config.pinned_cap_bytes
    }

    fn acquire_staging(&self, len: usize) -> Result<crate::host_pool::HostLease> {
        Core::acquire_staging(self, len)
    }
}

/// A buffer shown by a cudarc view ([`Core::view_guard`]).
#[cfg(any(feature = "cudarc", test))]
pub(crate) struct ViewGuard {
    core: Arc<Core>,
    buffer: ResidentBuffer,
}

#[cfg(any(feature = "cudarc", test))]
impl Drop for ViewGuard {
    fn drop(&mut self) {
        // Work enqueued through the view runs on a stream of this device's context or, by
        // peer access, of a peer's: every one of them is waited for. Where a wait fails the
        // buffer stays viewed (it can never be freed, which is safe), unless the context is
        // lost (its work never runs).
        let contexts: Vec<Arc<crate::context::Context>> = std::iter::once(Arc::clone(&self.core.ctx))
            .chain(crate::sync::lock(&self.core.peers).iter().cloned())
            .collect();
        let done = contexts.iter().all(|ctx| match ctx.bind().and_then(|raw| raw.ctx_synchronize()) {
            Ok(()) => true,
            Err(e) => e.work_never_runs(),
        });
        if !done {
            return;
        }
        let mut viewed = crate::sync::lock(&self.core.viewed.1);
        if let Some(views) = viewed.get_mut(&self.buffer) {
            *views -= 1;
            if *views == 0 {
                viewed.remove(&self.buffer);
            }
        }
        self.core.viewed.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        // Copies in flight finish before the memory they use is freed: a lane whose wait
        // fails is settled (its stream synchronized, asking again), or the process aborts
        // rather than free memory the GPU may still use.
        for lane in self.lanes.iter() {
            if lane.synchronize().is_err() {
                let _ = lane.settle();
            }
        }
        let _ = release_retrying(|| self.ctx.bind().map(drop));
        if let Some(kernels) = self.kernels.get() {
            let _ = release_retrying(|| kernels.unload(&self.ctx.raw));
        }
        let _ = self.alloc.release_all();
    }
}

/// Whether pinned arenas may be made of huge pages registered with the driver for
/// `device`: the kernel offers transparent huge pages and the GPU can register host memory
/// and reach it at its host address (the copy kernels read and write staging there).
fn huge_pages_usable(raw: &Raw, device: cuda_sys::CUdevice) -> Result<bool> {
    use cuda_sys::*;
    Ok(crate::host_pool::kernel_offers_huge_pages()
        && raw.device_attribute(device, CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED)? != 0
        && raw.device_attribute(device, CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM)? != 0)
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

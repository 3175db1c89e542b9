//! `Config`, a device's settings, and `DeviceInfo`, what it is and can do.

use cuda_sys::DriverVersion;

use crate::error::{Error, Result};

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
///
/// [`Device`]: crate::Device
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
    /// allocation. At least 4 MiB and at most 1 TiB, a multiple of 256; default 64 MiB.
    pub slab_bytes: u64,
    /// The most pinned host memory the pinned pool holds. At least `2 * chunk_bytes`, at most
    /// 256 TiB; default 1 GiB. Batches larger than this still move: uploads pipeline through
    /// it in chunks, and a download the pool cannot hold at once streams through a ring of chunks
    /// (see [`DownloadBatch`](crate::DownloadBatch)). Of the cap,
    /// `min(8 * chunk_bytes, pinned_cap_bytes / 2)`, but at least two chunks (128 MiB by
    /// default), is kept for transfers: pinned buffers ([`Device::pinned`]), prepared sets'
    /// regions and unreleased download views may hold the rest, so that transfers always find
    /// pinned memory (a prepared set that finds no room moves as batches do, a download
    /// streams). At a cap of two chunks that is the whole pool: [`Device::pinned`] then fails
    /// with [`Error::PinnedReserved`].
    ///
    /// [`Device::pinned`]: crate::Device::pinned
    pub pinned_cap_bytes: u64,
    /// Pinned memory allocated when the device opens, so that the first copies do not pay
    /// for making it (a 16 MiB arena took 5.7 ms by `cuMemHostAlloc` on the H200's host,
    /// 2.8 ms in huge pages on the H100's, see [`Config::pinned_huge_pages`]; a large
    /// transfer keeps about 12 in turn). Default 0. A runtime that loads a checkpoint right
    /// after opening the device wants about 256 MiB: a first 4 GiB load on the H200 ran at
    /// 47 GB/s with 192 MiB prewarmed (docs/weights.md).
    pub pinned_prewarm_bytes: u64,
    /// Whether pinned arenas whose size is a whole number of 2 MiB pages (the staging
    /// chunks, by default) are made of transparent huge pages registered with the driver,
    /// rather than by `cuMemHostAlloc`: on the H100's host a 16 MiB arena took 2.8 ms to make
    /// that way against 6.3, and 0.35 ms to give back against 1.7, with the same speed over
    /// the link, and a process's first 4 GiB load ran at 34.6 GB/s against 28.6 (33.1 against
    /// 20.3 in a later call; docs/weights.md). A wish, granted where the kernel offers
    /// transparent huge pages (`always` or `madvise` in
    /// `/sys/kernel/mm/transparent_hugepage/enabled`) and the GPU can use registered memory
    /// at its host address ([`Device::pinned_in_huge_pages`] says whether it was; an arena
    /// that cannot be made so turns it off). Default `true`.
    ///
    /// [`Device::pinned_in_huge_pages`]: crate::Device::pinned_in_huge_pages
    pub pinned_huge_pages: bool,
    /// Staging chunk: large copies are pipelined through pinned memory in chunks of this
    /// size. At least 64 KiB; default 16 MiB (smaller chunks move large copies from pageable
    /// memory markedly slower).
    pub chunk_bytes: u64,
    /// Copies of at least this many bytes get their own DMA; smaller ones are packed and
    /// scattered by a kernel. At most `chunk_bytes`; default 256 KiB.
    pub direct_threshold: u64,
    /// Threads that pack pinned memory for large batches, at most 1024; 0 picks one per core
    /// but one, up to 16 (with two cores or fewer, one per core). The calling thread packs beside them
    /// and runs the device's steps (leases, copies, launches) in between: a packing thread
    /// on every core would compete with it for one, and hold up those steps (most of all
    /// those of [`UploadBatch::write_with_par`](crate::UploadBatch::write_with_par)'s fills).
    pub pack_threads: usize,
    /// Microseconds the packing threads stay awake (spinning, yielding now and then; all
    /// but one of them) after a batch's packing, so that the next batch's packing starts at
    /// once instead of after the threads wake (which takes tens of microseconds, as long as
    /// moving a batch of thousands of small copies); and from when an upload batch holds
    /// about a megabyte of [`UploadBatch::write_with_par`](crate::UploadBatch::write_with_par)
    /// fills, which its submit will run on them. They stop as soon as new packing starts.
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
    /// pageable memory move faster than through device staging. It also decides how the
    /// staging that [`UploadBatch::write_with_par`](crate::UploadBatch::write_with_par) fills
    /// at submit moves: over the bus, each lease holding such fills by one launch that reads
    /// it in place (the kernel reads lines the fills just wrote faster than a DMA does), the
    /// leases that call opens holding 256 KiB, then twice as much each, up to 4 MiB (or
    /// `chunk_bytes`, if less); else by a DMA and a scatter each, in leases of `chunk_bytes`.
    ///
    /// [`Device::moves_small_copies_over_bus`]: crate::Device::moves_small_copies_over_bus
    pub small_copies_over_bus: bool,
    /// Items of a [`Scope`](crate::Scope) batch that move by one DMA each (those of at least
    /// `direct_threshold` bytes in pinned memory, such as a paged KV cache's large blocks):
    /// whether a submission hands them to the driver as one `cuMemcpyBatchAsync` instead of
    /// one `cuMemcpy*Async` call each, and ranges of 2 MiB and more move by a DMA of their
    /// own even where they follow each other in host memory, rather than through device
    /// staging and a scatter or gather launch. Default `true`: on an H100 (xfer-bench's
    /// paging suite, three runs each way, taking turns), 2 MiB blocks moved at or above
    /// `cuMemcpyBatchAsync` itself in each run that has its figures (out 54.3 / 55.1 GB/s
    /// against 53.3 / 54.5, in 43.6 / 44.2 against 42.1 / 43.2, both ways at once 71.7 /
    /// 74.3 against 71.5 / 72.2), and without it below in five of nine
    /// (docs/runs/2026-12-07-h100-dma-batches.md); `xfer-bench --no-dma-batches` turns it
    /// off. A wish, granted only where the driver has the call (CUDA 13.0 drivers and newer,
    /// [`DeviceInfo::batch_memcpy`]) and the device shares a unified address space with the
    /// host. Each submission's items have no two destinations in common (the driver runs a
    /// batch's copies in no set order), as a scope's in-place route already requires.
    pub dma_batches: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            budget_fraction: 0.9,
            slab_bytes: 64 << 20,
            pinned_cap_bytes: 1 << 30,
            pinned_prewarm_bytes: 0,
            pinned_huge_pages: true,
            chunk_bytes: 16 << 20,
            direct_threshold: 256 << 10,
            pack_threads: 0,
            pack_linger_us: 300,
            small_copies_over_bus: true,
            dma_batches: true,
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
        if self.slab_bytes > MAX_SLAB {
            return invalid(
                "slab_bytes",
                self.slab_bytes.to_string(),
                "it must be at most 1 TiB",
                "use 64 MiB (the default) or another multiple of 2 MiB",
            );
        }
        if self.pack_threads > MAX_PACK_THREADS {
            return invalid(
                "pack_threads",
                self.pack_threads.to_string(),
                "it must be at most 1024 (each is an OS thread that copies; more than the cores only wait)",
                "use 0 (one per core but one, up to 16) or the cores you give to copying",
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
        if self.pinned_cap_bytes > MAX_PINNED_CAP {
            return invalid(
                "pinned_cap_bytes",
                self.pinned_cap_bytes.to_string(),
                "it must be at most 256 TiB (no host pins more; larger caps overflow the pool's arithmetic)",
                "set the pinned memory the process may really use, such as 1 GiB (the default)",
            );
        }
        if self.chunk_bytes > self.pinned_cap_bytes / 2 {
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
        (self.chunk_bytes.saturating_mul(8))
            .min(self.pinned_cap_bytes / 2)
            .max(self.chunk_bytes.saturating_mul(2).min(self.pinned_cap_bytes))
    }

    /// The packing threads this config asks for, with 0 resolved.
    pub fn resolved_pack_threads(&self) -> usize {
        match self.pack_threads {
            0 => default_pack_threads(std::thread::available_parallelism().map_or(4, |n| n.get())),
            n => n,
        }
    }
}

/// The packing threads `pack_threads: 0` picks on a host of `cores` cores: one per core but
/// one (for the calling thread), up to 16; with two cores or fewer, one per core (fewer would
/// leave the calling thread to pack alone).
fn default_pack_threads(cores: usize) -> usize {
    match cores {
        ..=2 => cores.max(1),
        _ => (cores - 1).min(16),
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

    /// Sets [`Config::pinned_huge_pages`].
    #[must_use]
    pub fn with_pinned_huge_pages(mut self, pinned_huge_pages: bool) -> Config {
        self.pinned_huge_pages = pinned_huge_pages;
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

    /// Sets [`Config::dma_batches`].
    #[must_use]
    pub fn with_dma_batches(mut self, dma_batches: bool) -> Config {
        self.dma_batches = dma_batches;
        self
    }
}

/// The longest [`Config::pack_linger_us`].
const MAX_LINGER_US: u64 = 10_000;

/// The largest [`Config::slab_bytes`]: 1 TiB, past any GPU's memory.
const MAX_SLAB: u64 = 1 << 40;

/// The most packing threads [`Config::pack_threads`] may ask for.
const MAX_PACK_THREADS: usize = 1024;

/// The largest [`Config::pinned_cap_bytes`]: 256 TiB, past any host's memory, and small
/// enough that the pinned pool's sums of arena sizes cannot overflow.
const MAX_PINNED_CAP: u64 = 1 << 48;

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
    /// Whether the driver has `cuMemcpyBatchAsync` as CUDA 13.0 declares it (the
    /// `cuMemcpyBatchAsync_v2` entry point, drivers R580 and newer; a 12.8 or 12.9 driver's
    /// call, which also takes a failure index, is not used).
    pub batch_memcpy: bool,
    /// Whether the device shares a unified address space with the host.
    pub unified_addressing: bool,
    /// The CUDA version the driver supports.
    pub driver_version: DriverVersion,
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
    fn packing_threads_leave_a_core_to_the_calling_thread_from_three_cores() {
        let picked: Vec<usize> = [0, 1, 2, 3, 4, 16, 17, 18, 128].map(default_pack_threads).into();
        assert_eq!(picked, [1, 1, 2, 2, 3, 15, 16, 16, 16]);
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
}

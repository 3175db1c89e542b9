//! Counters of what a device did, and a snapshot of them.
//!
//! Counters are relaxed atomics bumped on paths that already cost a driver call or a batch;
//! the allocator's hot-path counts live in its shards. A snapshot gathers both.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::alloc::AllocatorStats;
use crate::host_pool::PinnedStats;
use crate::stream::LaneKind;

/// The device's own counters.
#[derive(Debug, Default)]
pub(crate) struct Telemetry {
    /// Fences waited on by the host that were not already complete (shared with the lanes,
    /// whose fences count their waits).
    pub(crate) host_waits: Arc<AtomicU64>,
    /// Submissions on the upload lane.
    pub(crate) upload_submissions: AtomicU64,
    /// Submissions on the download lane.
    pub(crate) download_submissions: AtomicU64,
    /// Bytes callers asked to move.
    pub(crate) bytes_requested: AtomicU64,
    /// Bytes that crossed the bus.
    pub(crate) bytes_moved: AtomicU64,
    /// DMA copies enqueued.
    pub(crate) dma_copies: AtomicU64,
    /// Kernel launches enqueued.
    pub(crate) kernel_launches: AtomicU64,
    /// Bytes of device memory the lanes hold as staging (descriptor tables, packed bytes).
    pub(crate) staging_bytes: AtomicU64,
    /// Bytes copied into this device from device memory (peer copies, copies inside it).
    pub(crate) peer_bytes: AtomicU64,
    /// Waits of one lane for the other enqueued on the device (overlapping bytes).
    pub(crate) lane_waits: AtomicU64,
}

impl Telemetry {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts a batch: its submissions on `lane`, the bytes asked for and moved, the DMAs
    /// and kernel launches it enqueued.
    pub(crate) fn record(&self, lane: LaneKind, moves: Moves) {
        let submissions = match lane {
            LaneKind::Upload => &self.upload_submissions,
            LaneKind::Download => &self.download_submissions,
        };
        Self::add(submissions, moves.submissions);
        Self::add(&self.bytes_requested, moves.requested);
        Self::add(&self.bytes_moved, moves.moved);
        Self::add(&self.dma_copies, moves.dmas);
        Self::add(&self.kernel_launches, moves.launches);
    }
}

/// What one batch enqueued, for [`Telemetry::record`].
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Moves {
    pub(crate) submissions: u64,
    pub(crate) requested: u64,
    pub(crate) moved: u64,
    pub(crate) dmas: u64,
    pub(crate) launches: u64,
}

/// A snapshot of a device's counters ([`Device::telemetry`](crate::Device::telemetry)).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct TelemetrySnapshot {
    /// The resident store.
    pub memory: AllocatorStats,
    /// The pinned pool.
    pub pinned: PinnedStats,
    /// Fences the host had to block on.
    pub host_waits: u64,
    /// Submissions on the upload lane.
    pub upload_submissions: u64,
    /// Submissions on the download lane.
    pub download_submissions: u64,
    /// Bytes callers asked to move.
    pub bytes_requested: u64,
    /// Bytes that crossed the bus (after fusing overlaps, plus descriptors).
    pub bytes_moved: u64,
    /// DMA copies enqueued.
    pub dma_copies: u64,
    /// Kernel launches enqueued.
    pub kernel_launches: u64,
    /// Bytes of device memory held as staging by the copy lanes: buffers of the resident
    /// store that no caller owns. They are the library's, counted in
    /// [`AllocatorStats::library_bytes`] (with prepared sets' descriptor tables), never in
    /// `memory.allocated_bytes` (the caller's buffers alone). So `memory.library_bytes >=
    /// staging_bytes` always, with equality while no prepared set is alive; subtracting
    /// this from `memory.allocated_bytes` is meaningless (and wraps below zero).
    pub staging_bytes: u64,
    /// Bytes copied into this device from device memory by peer batches on the peer path
    /// ([`Device::peer_copies`](crate::Device::peer_copies): from other GPUs, and inside this
    /// one), overlaps resolved: what landed. Batches staged through host memory count as
    /// downloads and uploads instead. Peer-path batches also count in `bytes_requested` (what
    /// they named) and `bytes_moved` (what landed, plus their descriptor tables).
    pub peer_bytes: u64,
    /// Times a batch was made to wait, on the device, for a batch of the other direction
    /// still in flight that uses some of the same bytes. Batches on disjoint byte ranges of
    /// one buffer (ranges that touch included) do not wait for each other.
    pub lane_waits: u64,
}

impl TelemetrySnapshot {
    pub(crate) fn gather(t: &Telemetry, memory: AllocatorStats, pinned: PinnedStats) -> TelemetrySnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        TelemetrySnapshot {
            memory,
            pinned,
            host_waits: get(&t.host_waits),
            upload_submissions: get(&t.upload_submissions),
            download_submissions: get(&t.download_submissions),
            bytes_requested: get(&t.bytes_requested),
            bytes_moved: get(&t.bytes_moved),
            dma_copies: get(&t.dma_copies),
            kernel_launches: get(&t.kernel_launches),
            staging_bytes: get(&t.staging_bytes),
            peer_bytes: get(&t.peer_bytes),
            lane_waits: get(&t.lane_waits),
        }
    }
}

//! The vectors that batches reuse instead of allocating anew, kept per device: each batch
//! kind's parts, emptied, and the host memory of the last streamed download.

use crate::kernels::CopyDescriptor;
use crate::plan::route::Span;
use crate::plan::{DownloadPlan, Planner, ReadRequest, ReadView, UploadPlan, WriteRequest};
use crate::recycle::{Recycler, Reusable};
use crate::sync::Mutex;

use super::fills::ParFills;
use super::host::{PinnedDescriptors, Source};
use super::table::BufferTable;

/// What a device keeps of its finished batches for the next ones.
#[derive(Default)]
pub(crate) struct Spares {
    /// Upload batches' vectors.
    pub(crate) upload: Recycler<UploadParts>,
    /// Download batches' vectors, and the views of downloads dropped.
    pub(crate) download: Recycler<(BufferTable, Vec<ReadRequest>)>,
    pub(crate) views: Recycler<Vec<ReadView>>,
    /// Peer batches' vectors.
    pub(crate) peer: Recycler<PeerParts>,
    /// Planners and their plans, lent to batches that plan before they take their lane.
    pub(crate) planning: Recycler<Planning>,
    /// The host memory of the last streamed download with views that was dropped (its
    /// length is its size; its bytes are initialised), for the next one: fresh memory of
    /// gigabytes costs its page faults on every download. Released by `Device::trim`.
    pub(crate) streamed_host: Mutex<Vec<u8>>,
}

/// An upload batch's vectors, reused by the device's next batches.
#[derive(Default)]
pub(crate) struct UploadParts {
    pub(crate) table: BufferTable,
    pub(crate) writes: Vec<WriteRequest>,
    pub(crate) sources: Vec<Source<'static>>,
    pub(crate) arena_used: Vec<usize>,
    pub(crate) arena_descriptors: Vec<u64>,
    pub(crate) par: ParFills,
}

impl Reusable for UploadParts {
    fn clear(&mut self) {
        self.table.clear();
        self.writes.clear();
        self.sources.clear();
        self.arena_used.clear();
        self.arena_descriptors.clear();
        self.par.clear();
    }
}

/// A planner, the plans it fills and the chunks of batches in order, reused by the next
/// batches that plan. A batch plans
/// with one of these before it takes its lane's batch lock, so that a batch being planned
/// does not hold up the lane's other submitters.
#[derive(Default)]
pub(crate) struct Planning {
    pub(crate) planner: Planner,
    pub(crate) upload_plan: UploadPlan,
    pub(crate) download_plan: DownloadPlan,
    /// The chunks of a batch in order and apart ([`cut_apart`](crate::plan::route::cut_apart)).
    pub(crate) spans: Vec<Span>,
}

impl Reusable for Planning {
    /// Nothing to empty: planning into a plan, or cutting into `spans`, replaces what it
    /// held, keeping its vectors.
    fn clear(&mut self) {}
}

/// A peer batch's vectors, reused by the destination device's next batches.
///
/// While the copies come in order (each starts at or after the end of the previous copy
/// into the same buffer, so none overlap), only their descriptors and DMAs are built, as
/// they are added: the least work per copy. The first copy out of order turns those back
/// into a list of copies, and overlaps are resolved at submit.
#[derive(Default)]
pub(crate) struct PeerParts {
    pub(crate) src_table: BufferTable,
    pub(crate) dst_table: BufferTable,
    /// Copies added, zero-length ones included.
    pub(crate) copies: usize,
    /// Once out of order: the non-empty copies, as writes into the destination buffers
    /// (keys of `dst_table`), and per copy its source buffer's key in `src_table` and the
    /// offset there.
    pub(crate) writes: Vec<WriteRequest>,
    pub(crate) sources: Vec<(u32, u64)>,
    /// Per destination key: the end of its last copy so far.
    pub(crate) ends: Vec<u64>,
    pub(crate) out_of_order: bool,
    /// The kernel's descriptors, in pinned memory of the destination device, and the
    /// copies moved by DMA.
    pub(crate) descriptors: PinnedDescriptors,
    pub(crate) dmas: Vec<CopyDescriptor>,
    /// Bytes the copies name (zero-length ones aside).
    pub(crate) bytes: u64,
}

impl Reusable for PeerParts {
    fn clear(&mut self) {
        self.src_table.clear();
        self.dst_table.clear();
        self.copies = 0;
        self.writes.clear();
        self.sources.clear();
        self.ends.clear();
        self.out_of_order = false;
        self.descriptors.clear();
        self.dmas.clear();
        self.bytes = 0;
    }
}

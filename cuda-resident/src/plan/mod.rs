//! The copy planner: turns a batch of uploads or downloads into fused, chunked copies.
//!
//! Pure CPU work: no driver types, no `unsafe`, no device. The executor (`transfer`) carries a
//! plan out with pinned memory, DMA copies and one scatter or gather kernel per chunk. Keeping
//! the offset arithmetic here, away from the driver, lets it be property-tested against a byte
//! model of the buffers (see the tests of this module).
//!
//! # What a plan says
//!
//! 1. **Validation.** Every request is checked first (`offset + len <= buffer_len`, without
//!    overflow). The first bad one fails the whole batch with its index; nothing else is
//!    returned. Zero-length requests are valid and move nothing.
//! 2. **Fusion.** Requests to one buffer that overlap or touch become one *interval*. For
//!    uploads, later writes win where they overlap: [`Fill`]s say which write each staged byte
//!    comes from, and every interval byte is filled exactly once.
//! 3. **Split.** An interval of at least `direct_threshold` bytes is *direct*: one DMA between
//!    staging and the buffer. Smaller ones are *packed*: laid end to end in the chunk's packed
//!    region, moved by one DMA between host and device staging, and spread (uploads) or
//!    collected (downloads) by one scatter or gather kernel per chunk.
//! 4. **Chunks.** Staging is processed in chunks of at most `chunk_bytes`, so the executor can
//!    pack chunk `k + 1` while chunk `k` is on the wire.
//!
//! # Staging offsets are flat
//!
//! Every staging offset in a plan ([`Copy::stage_offset`], [`Fill::stage_offset`],
//! [`ReadView::stage_offset`], [`Chunk::stage_start`], [`Chunk::packed_offset`]) is an offset
//! into **one flat staging space** of `total_staging` bytes. Chunk `i` starts at
//! `i * chunk_capacity` and uses `[stage_start, stage_start + staging_len)`, with
//! `staging_len <= chunk_capacity <= chunk_bytes`. The executor may back that space with:
//!
//! - **one pinned region** of `total_staging` bytes, using flat offsets as they are. Downloads
//!   that hand out `&[u8]` views need this: a view into a direct interval that was split over
//!   chunks spans consecutive chunks ([`ReadView::chunk`]`..=`[`ReadView::last_chunk`]), and
//!   the planner keeps such an interval's bytes contiguous in flat space; or
//! - **a ring of pinned buffers** of `chunk_capacity` bytes each, one per chunk in flight. An
//!   offset's place in its chunk's buffer is `flat - stage_start` ([`Chunk::local_offset`]).
//!   Every [`Fill`] and [`Copy`](struct@Copy) lies inside one chunk, so this works for every upload.
//!
//! `chunk_capacity` is `chunk_bytes` rounded down to a multiple of `align`, so an offset that
//! is aligned in flat space is aligned inside its chunk too, and either backing keeps the
//! packed copies aligned (pinned allocations are page aligned).
//!
//! # Layout of a chunk
//!
//! ```text
//! stage_start                                              stage_start + staging_len
//! | packed region: packed intervals, each start aligned | pad | direct pieces, each aligned |
//! ^ packed_offset (= stage_start)                      ^ packed_offset + packed_len
//! ```
//!
//! Packed intervals are laid out first, over as many chunks as they need (in order of buffer
//! and offset, a new chunk when the next one does not fit), then the direct intervals follow
//! from where the packed ones ended. So at most one chunk holds both, and the packed region is
//! always at the start of its chunk. A direct interval that does not fit in what is left of a
//! chunk is split at the chunk boundary and continues at the start of the next chunk, so
//! direct bytes leave no chunk partly empty (only a packed interval that does not fit leaves
//! room behind, less than one threshold), and a split interval stays contiguous in flat
//! space. A packed interval is never split: the effective direct threshold is clamped to
//! `chunk_capacity`, so a packed interval always fits in an empty chunk.
//!
//! # Cost
//!
//! Planning validates the requests in one pass, builds one packed `u64` key per non-empty
//! request (`(buffer, offset, index)`), radix sorts the keys (sorting nothing when they
//! already come in order), and then one sweep over the sorted keys fuses, places and emits.
//! A batch in order (every non-empty request starts at or after the end of the previous one
//! of its buffer, with buffer keys below the request count + 64, as the transfer layer's
//! dense keys are) is found in one pass and needs no keys and no sort: the sweep takes the
//! requests as they come, and joins only consecutive ones (touching requests of a buffer
//! that are not consecutive stay separate copies; no byte moves twice either way).
//! Overlapping uploads are resolved with a small heap keyed by write index, used only by
//! intervals of several writes. Nothing is allocated per request: a [`Planner`] keeps its
//! scratch vectors, and its `*_into` methods reuse the plan's vectors too, which matters as
//! much as the algorithm (fresh vectors of a few hundred KiB cost their page faults on every
//! batch). `benches/plan.rs` measures it.

mod download;
mod fuse;
mod layout;
mod planner;
mod request;
pub(crate) mod route;
pub(crate) mod runs;
mod sort;
mod upload;

// The byte model the tests check plans against. The `fuzzing` feature makes it public for the
// fuzz target in `fuzz/`; it is hidden from the docs and is not part of the crate's API.
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod check;
#[cfg(test)]
mod proptests;
#[cfg(test)]
mod runs_tests;
#[cfg(test)]
mod tests;

/// Identifies a buffer to the planner; the executor maps it to a device pointer.
pub type BufferKey = u64;

/// How a batch is split into direct and packed copies and into chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanConfig {
    /// An interval of at least this many bytes is copied by its own DMA; smaller ones are
    /// packed. Clamped to the chunk capacity, so that a packed interval always fits in one
    /// chunk. `0` makes every interval direct. Default 256 KiB, where one DMA's fixed cost
    /// (a few µs) stops mattering next to its transfer time.
    pub direct_threshold: u64,
    /// Staging is processed in chunks of at most this many bytes (default 8 MiB). Must be at
    /// least `align`; the usable part is rounded down to a multiple of `align`. A plan holds
    /// one [`Chunk`] per chunk, so tiny chunks for a huge batch cost memory (and more than
    /// `u32::MAX` chunks are refused).
    pub chunk_bytes: u64,
    /// Every packed interval and every direct piece starts at a staging offset that is a
    /// multiple of this (default 16, what the scatter and gather kernels load at once).
    /// Must be a power of two.
    pub align: u64,
}

impl Default for PlanConfig {
    fn default() -> Self {
        Self { direct_threshold: 256 << 10, chunk_bytes: 8 << 20, align: 16 }
    }
}

impl PlanConfig {
    /// The usable bytes of one chunk (`chunk_bytes` rounded down to a multiple of `align`),
    /// which is also the distance between chunk starts in flat staging: the size of one
    /// buffer of a staging ring. Fails like planning does for an invalid config.
    pub fn chunk_capacity(&self) -> Result<u64, PlanError> {
        Geometry::new(self).map(|geo| geo.cap)
    }
}

/// One host-to-device write: `len` bytes of the caller's data to `buffer` at `offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteRequest {
    /// The destination buffer.
    pub buffer: BufferKey,
    /// The destination buffer's length in bytes; the write must lie inside it.
    pub buffer_len: u64,
    /// Where in the buffer the write starts.
    pub offset: u64,
    /// How many bytes the write carries (its data is `len` bytes long).
    pub len: u64,
}

/// One device-to-host read: `len` bytes of `buffer` at `offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadRequest {
    /// The source buffer.
    pub buffer: BufferKey,
    /// The source buffer's length in bytes; the read must lie inside it.
    pub buffer_len: u64,
    /// Where in the buffer the read starts.
    pub offset: u64,
    /// How many bytes to read.
    pub len: u64,
}

pub use crate::error::PlanError;
// The one-shot functions are for the benches, tests and fuzz target (`internals`).
#[cfg_attr(not(feature = "internals"), allow(unused_imports))]
pub use planner::{Planner, plan_download, plan_upload};

/// One contiguous copy between staging and a buffer.
///
/// For an upload it moves `len` bytes from staging to the buffer; for a download the other
/// way. `stage_offset` is flat (see the [module docs](self)); a copy never crosses a chunk.
///
/// Import it by path (`plan::Copy`), not with a glob import, which would shadow the
/// prelude's `Copy` trait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Copy {
    /// Flat staging offset of the first byte.
    pub stage_offset: u64,
    /// The buffer on the device side.
    pub buffer: BufferKey,
    /// Offset of the first byte in that buffer.
    pub buffer_offset: u64,
    /// Bytes copied.
    pub len: u64,
}

/// A packed copy as the scatter or gather kernel sees it: its bytes sit at `region_offset`
/// from the start of the chunk's packed region, which is all that device staging receives
/// (uploads) or produces (downloads). The executor turns it into a `{src, dst, len}`
/// descriptor once the device pointers are known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedCopy {
    /// Offset from the start of the packed region (and of device staging); a multiple of
    /// `align`.
    pub region_offset: u64,
    /// The buffer on the device side.
    pub buffer: BufferKey,
    /// Offset of the first byte in that buffer.
    pub buffer_offset: u64,
    /// Bytes copied.
    pub len: u64,
}

/// One chunk of staging and the copies that use it.
///
/// Its staging is `[stage_start, stage_start + staging_len)` in flat offsets; the packed
/// region `[packed_offset, packed_offset + packed_len)` comes first, the direct pieces after
/// it. Both lists are in ascending `stage_offset` order, and no two copies overlap.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Chunk {
    /// Flat offset where this chunk starts: `index * chunk_capacity`.
    pub stage_start: u64,
    /// Staging bytes this chunk uses, alignment padding included; at most `chunk_capacity`.
    pub staging_len: u64,
    /// Flat offset of the packed region; always `stage_start`.
    pub packed_offset: u64,
    /// Length of the packed region, from the start of the first packed copy to the end of
    /// the last (padding between them included); `0` when the chunk has none.
    pub packed_len: u64,
    /// Small intervals, moved as one DMA of the packed region plus one scatter (uploads) or
    /// gather (downloads) kernel.
    pub packed: Vec<Copy>,
    /// Large intervals or pieces of them, each its own DMA between staging and the buffer.
    pub direct: Vec<Copy>,
}

/// A chunk of an upload plan: fill it, DMA the packed region to device staging, scatter, and
/// DMA each direct piece to its buffer.
pub type UploadChunk = Chunk;

/// A chunk of a download plan: gather the packed copies into device staging, DMA that to the
/// packed region, and DMA each direct piece from its buffer into staging.
pub type DownloadChunk = Chunk;

impl Chunk {
    /// The flat offset one past this chunk's last staging byte.
    pub fn stage_end(&self) -> u64 {
        self.stage_start + self.staging_len
    }

    /// Where a flat offset of this chunk lies in a chunk-sized ring buffer: `flat -
    /// stage_start` (saturating at zero for an offset before the chunk).
    pub fn local_offset(&self, flat: u64) -> u64 {
        flat.saturating_sub(self.stage_start)
    }

    /// The packed copies with their offsets relative to the packed region, in ascending
    /// order: the rows of this chunk's scatter or gather descriptor table.
    pub fn packed_copies(&self) -> impl ExactSizeIterator<Item = PackedCopy> + '_ {
        self.packed.iter().map(|c| PackedCopy {
            region_offset: c.stage_offset - self.packed_offset,
            buffer: c.buffer,
            buffer_offset: c.buffer_offset,
            len: c.len,
        })
    }

    /// Empties the chunk for reuse at `stage_start`, keeping its vectors' memory.
    fn reset(&mut self, stage_start: u64) {
        self.stage_start = stage_start;
        self.staging_len = 0;
        self.packed_offset = stage_start;
        self.packed_len = 0;
        self.packed.clear();
        self.direct.clear();
    }
}

/// Which write supplies a run of staging bytes.
///
/// The packer copies `write`'s data `[src_offset, src_offset + len)` to flat staging
/// `[stage_offset, stage_offset + len)`, which lies inside chunk `chunk`. Together the fills
/// of a plan cover every interval byte exactly once, each from the last write that covers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fill {
    /// The chunk the bytes belong to.
    pub chunk: u32,
    /// Flat staging offset of the first byte.
    pub stage_offset: u64,
    /// Index of the write (in the planned batch) whose data supplies the bytes.
    pub write: u32,
    /// Offset of the first byte within that write's data.
    pub src_offset: u64,
    /// Bytes filled.
    pub len: u64,
}

/// The plan for a batch of writes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UploadPlan {
    /// The chunks, in the order they should be filled and sent.
    pub chunks: Vec<UploadChunk>,
    /// What to copy into staging, sorted by `stage_offset` (so grouped by chunk, in chunk
    /// order). [`UploadPlan::fills_of`] gives one chunk's share.
    pub fills: Vec<Fill>,
    /// Distance between chunk starts in flat staging, and the size of a ring buffer.
    pub chunk_capacity: u64,
    /// Size of the flat staging space (`0` for a batch that moves nothing).
    pub total_staging: u64,
    /// Sum of the writes' lengths (saturating).
    pub requested_bytes: u64,
    /// Sum of the fused intervals' lengths: the bytes that cross the bus.
    pub moved_bytes: u64,
    /// Bytes moved through the packed path.
    pub packed_bytes: u64,
    /// How many fused intervals the writes made.
    pub intervals: usize,
    /// How many of those are packed (the rest are direct).
    pub packed_intervals: usize,
}

impl UploadPlan {
    /// The fills of chunk `chunk`, in ascending staging order (empty for an unknown chunk).
    pub fn fills_of(&self, chunk: u32) -> &[Fill] {
        let start = self.fills.partition_point(|f| f.chunk < chunk);
        let end = self.fills.partition_point(|f| f.chunk <= chunk);
        &self.fills[start..end]
    }

    /// True when the plan moves nothing (an empty batch, or only zero-length writes).
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Resets to the empty plan, keeping the vectors' memory.
    fn clear(&mut self) {
        let (mut chunks, mut fills) = (std::mem::take(&mut self.chunks), std::mem::take(&mut self.fills));
        chunks.clear();
        fills.clear();
        *self = Self { chunks, fills, ..Self::default() };
    }
}

/// Where one read's bytes are in staging once its chunks have arrived.
///
/// The bytes are contiguous: flat `[stage_offset, stage_offset + len)`. They lie in chunks
/// `chunk..=last_chunk`, which differ only when the read is inside a direct interval that was
/// split over chunks; then the view can only be handed out of a single flat staging region.
/// A zero-length read has an empty view at offset 0 whose chunk fields mean nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadView {
    /// The chunk holding the first byte.
    pub chunk: u32,
    /// The chunk holding the last byte.
    pub last_chunk: u32,
    /// Flat staging offset of the first byte.
    pub stage_offset: u64,
    /// The read's length.
    pub len: u64,
}

impl ReadView {
    /// The flat offset one past the last byte.
    pub fn stage_end(&self) -> u64 {
        self.stage_offset + self.len
    }
}

/// The plan for a batch of reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DownloadPlan {
    /// The chunks, in the order they should be gathered and sent.
    pub chunks: Vec<DownloadChunk>,
    /// One view per read, in the order of the reads.
    pub views: Vec<ReadView>,
    /// Distance between chunk starts in flat staging, and the size of a ring buffer.
    pub chunk_capacity: u64,
    /// Size of the flat staging space (`0` for a batch that moves nothing).
    pub total_staging: u64,
    /// Sum of the reads' lengths (saturating).
    pub requested_bytes: u64,
    /// Sum of the fused intervals' lengths: the bytes that cross the bus.
    pub moved_bytes: u64,
    /// Bytes moved through the packed (gather) path.
    pub packed_bytes: u64,
    /// How many fused intervals the reads made.
    pub intervals: usize,
    /// How many of those are packed (the rest are direct).
    pub packed_intervals: usize,
}

impl DownloadPlan {
    /// True when the plan moves nothing (an empty batch, or only zero-length reads).
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Resets to the empty plan, keeping the vectors' memory.
    fn clear(&mut self) {
        let (mut chunks, mut views) = (std::mem::take(&mut self.chunks), std::mem::take(&mut self.views));
        chunks.clear();
        views.clear();
        *self = Self { chunks, views, ..Self::default() };
    }
}

/// A validated config, reduced to the numbers the layout uses.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    /// Usable bytes per chunk and distance between chunk starts; a multiple of `align`.
    cap: u64,
    /// Effective direct threshold, `<= cap`.
    threshold: u64,
    /// Power of two.
    align: u64,
    /// The most kernel descriptors of one chunk's packed copies ([`chunk_descriptors_most`]).
    most: u64,
}

/// The most kernel descriptors (each of at most [`SEGMENT`](crate::kernels::SEGMENT) bytes)
/// the packed copies of a chunk of `cap` bytes may take: a table of half a chunk. Tiny
/// copies would otherwise take a table of up to 1.5 times the chunk (24 bytes a descriptor
/// for each 16-byte slot), and the pinned lease of a chunk and its table has to fit in what
/// the pool keeps for transfers, two chunks at least. Never fewer than 1024: the smallest
/// chunk a `Config` accepts (64 KiB) allows 1365, and geometries of a few bytes (the
/// planner's own tests) stay bound by bytes alone.
pub(crate) fn chunk_descriptors_most(cap: u64) -> u64 {
    (cap / 2 / std::mem::size_of::<crate::kernels::CopyDescriptor>() as u64).max(1024)
}

impl Geometry {
    fn new(cfg: &PlanConfig) -> Result<Self, PlanError> {
        if !cfg.align.is_power_of_two() {
            return Err(PlanError::InvalidAlign { align: cfg.align });
        }
        let cap = cfg.chunk_bytes & !(cfg.align - 1);
        if cap == 0 {
            return Err(PlanError::ChunkTooSmall { chunk_bytes: cfg.chunk_bytes, align: cfg.align });
        }
        Ok(Self {
            cap,
            threshold: cfg.direct_threshold.min(cap),
            align: cfg.align,
            most: chunk_descriptors_most(cap),
        })
    }

    /// Whether an interval of `len` bytes goes through the packed path.
    fn is_packed(&self, len: u64) -> bool {
        len < self.threshold
    }

    /// `offset` rounded up to `align`; `None` on overflow.
    fn align_up(&self, offset: u64) -> Option<u64> {
        offset.checked_add(self.align - 1).map(|o| o & !(self.align - 1))
    }

    /// The chunk that holds flat offset `flat`. Callers pass offsets inside the laid-out
    /// staging, whose chunk count is checked to fit `u32`.
    fn chunk_of(&self, flat: u64) -> u32 {
        (flat / self.cap) as u32
    }

    /// Bytes from `flat` to the end of its chunk's capacity.
    fn room_at(&self, flat: u64) -> u64 {
        self.cap - flat % self.cap
    }
}

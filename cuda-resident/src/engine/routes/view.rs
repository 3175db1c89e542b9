//! What a batch hands its route, and what a download route hands back: borrows of the parts of the batch the route reads, so that
//! the routes live in the engine without knowing the batch types made above it. Built by
//! the batch's `submit`; references only, nothing is copied or allocated to build one.

use std::sync::Arc;

use crate::engine::core::Core;
use crate::engine::fills::{Fills, ParFills};
use crate::engine::host::Source;
use crate::engine::order::Ranges;
use crate::engine::pipeline;
use crate::engine::table::BufferTable;
use crate::error::{Error, Result};
use crate::fence::Fence;
use crate::host_pool::HostLease;
use crate::plan::route::{self, PIPELINE_DEPTH, Route, pipeline_chunk};
use crate::plan::{PlanConfig, ReadRequest, ReadView, WriteRequest};

/// An upload batch as its route sees it: the writes, where their bytes are, the buffers they
/// name and the batch's pinned arena.
pub(crate) struct UploadView<'b> {
    pub(crate) core: &'b Arc<Core>,
    /// The buffers the writes name; `apart` is the layout of the writes as added.
    pub(crate) table: &'b BufferTable,
    pub(crate) writes: &'b [WriteRequest],
    /// Where each write's bytes are: a caller's slice or a place in `arena`.
    pub(crate) sources: &'b [Source<'b>],
    /// The batch's own pinned leases, written in place by `write_with` and
    /// `write_with_par` (the in-place route takes them).
    pub(crate) arena: &'b mut Vec<HostLease>,
    /// Bytes used in each arena lease ([`CLOSED`](super::in_place::CLOSED): one large write).
    pub(crate) arena_used: &'b [usize],
    /// Descriptors of each arena lease's writes (0: nothing to move).
    pub(crate) arena_descriptors: &'b [u64],
    /// The fills of `write_with_par`, in the order of their writes, run at submit.
    pub(crate) par: &'b ParFills,
}

impl UploadView<'_> {
    /// The device ranges of the batch's writes, for `Exec::claim_ranges`.
    pub(crate) fn ranges(&self) -> impl FnOnce(&mut Ranges) + '_ {
        |ranges| self.table.push_ranges(ranges, self.writes.iter().map(|w| (w.buffer, w.offset, w.len)))
    }

    /// Runs every fill of `write_with_par`, before a route that reads the arena as a whole:
    /// in groups as [`execute_in_place`](super::in_place::execute_in_place) runs them, on the
    /// packing threads and the calling thread, or on the calling thread alone for a small
    /// batch.
    pub(crate) fn run_fills(&self) -> Result<()> {
        if self.par.is_empty() {
            return Ok(());
        }
        let bases: Vec<usize> = self.arena.iter().map(|l| l.as_ptr() as usize).collect();
        let fills = Fills::new(self.par, self.writes, self.sources, &bases);
        let spans = self.par.spans(self.sources, bases.len());
        let (groups, work) = fills.groups(&spans, self.core.packers().current_num_threads());
        let all = bases.len();
        pipeline::run(&self.core.packers, &groups, work, all, |_| Ok(true), |_, items| fills.run(items))?;
        match fills.panics.first(usize::MAX) {
            Some(error) => Err(self.fill_panicked(error)),
            None => Ok(()),
        }
    }

    /// The error of fill `i` (of `par`), which panicked with `cause`.
    pub(crate) fn fill_panicked(&self, (i, cause): (usize, String)) -> Error {
        let write = self.par.write_of(i);
        let w = &self.writes[write];
        let buffer = self.table.entries[w.buffer as usize].buffer;
        Error::FillPanicked { write, buffer, offset: w.offset, len: w.len, cause }
    }
}

/// A download batch as its route sees it: the reads into views and the buffers they name.
pub(crate) struct DownloadView<'b> {
    pub(crate) core: &'b Arc<Core>,
    /// The buffers the reads name; `apart` is the layout of the reads as added.
    pub(crate) table: &'b BufferTable,
    pub(crate) reads: &'b [ReadRequest],
}

impl DownloadView<'_> {
    /// The device ranges of the batch's reads, for `Exec::claim_ranges`.
    pub(crate) fn ranges(&self) -> impl FnOnce(&mut Ranges) + '_ {
        |ranges| self.table.push_ranges(ranges, self.reads.iter().map(|r| (r.buffer, r.offset, r.len)))
    }

    /// The bytes the batch moves and the planner's settings for it: chunks sized to the
    /// batch ([`pipeline_chunk`]), the direct threshold at most a chunk.
    pub(crate) fn sizing(&self) -> (u64, PlanConfig) {
        let config = &self.core.config;
        let apart = &self.table.apart;
        let in_order = self.reads.len() >= route::IN_ORDER_MIN && !apart.broken;
        let total: u64 = if in_order { apart.requested } else { self.reads.iter().map(|r| r.len).sum() };
        let chunk_bytes = pipeline_chunk(config.chunk_bytes, total, PIPELINE_DEPTH);
        (
            total,
            PlanConfig { direct_threshold: config.direct_threshold.min(chunk_bytes), chunk_bytes, align: 16 },
        )
    }

    /// The route [`route::download_route`] gives the batch's reads under `plan_config`.
    pub(crate) fn route_with(&self, plan_config: &PlanConfig) -> Route {
        route::download_route(self.reads.len(), &self.table.apart, plan_config.direct_threshold)
    }
}

/// What a download route hands back: where the batch's bytes land and how to wait for them.
/// The batch makes its pending download of it (with its identity, which its slots carry).
pub(crate) enum Landed {
    /// Nothing moved into staging (the plan was empty): the views of empty reads, done at
    /// once.
    Empty { views: Vec<ReadView> },
    /// The bytes land in `lease` (flat staging from `base` on); `chunks` and
    /// `in_order_bytes` for reads in order (the first read of each chunk, then the number of
    /// reads; their bytes), empty and 0 for reads the planner laid out.
    Leased {
        fence: Fence,
        lease: Arc<HostLease>,
        base: usize,
        views: Vec<ReadView>,
        chunks: Vec<usize>,
        in_order_bytes: usize,
        first_seq: u64,
        route: Route,
    },
    /// Streamed through a ring of pinned chunks into `host` (or straight into the caller's
    /// vectors: no views then), landed when the route returned.
    Streamed { fence: Fence, host: Vec<u8>, views: Vec<ReadView>, first_seq: u64, route: Route },
}

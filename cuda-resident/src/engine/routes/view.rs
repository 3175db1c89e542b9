//! What a batch hands its route: borrows of the parts of the batch the route reads, so that
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
use crate::host_pool::HostLease;
use crate::plan::WriteRequest;

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

//! Moving a batch: [`UploadBatch::submit`] and the route it takes.

use super::UploadBatch;
use super::in_place::execute_in_place;
use super::planned::execute;
use crate::engine::host::Source;
use crate::engine::routes::one::execute_one;
use crate::engine::spares::UploadParts;
use crate::error::Result;
use crate::fence::Fence;
use crate::plan::route::{self, Route, UploadShape};

impl UploadBatch<'_> {
    /// Moves the batch to the device and returns at once; the fence completes when every
    /// byte has landed. Fails (with nothing enqueued) if any write was bad, a buffer was
    /// freed since it was added, or the batch was poisoned by a `write_with` that failed
    /// part-way ([`Error::BatchPoisoned`](crate::Error::BatchPoisoned)).
    pub fn submit(mut self) -> Result<Fence> {
        let submitted = self.submit_inner();
        // The vectors go back for the next batch (emptied: no borrowed slice outlives this).
        use std::mem::take;
        self.spare.parts = UploadParts {
            table: take(&mut self.table),
            writes: take(&mut self.writes),
            sources: crate::recycle::relabel(take(&mut self.sources)),
            arena_used: take(&mut self.arena_used),
            arena_descriptors: take(&mut self.arena_descriptors),
            par: take(&mut self.par),
        };
        submitted
    }

    /// The route the batch takes, as its writes stand ([`route::upload_route`]).
    pub(crate) fn route(&self) -> Route {
        let single_slice = match (&self.writes[..], &self.sources[..]) {
            ([write], [Source::Slice(_)]) => Some(write.len),
            _ => None,
        };
        route::upload_route(&UploadShape {
            writes: self.writes.len(),
            single_slice,
            in_place: !self.arena.is_empty(),
            slice_writes: self.slice_writes,
            apart: &self.table.apart,
            direct_threshold: self.core.config.direct_threshold,
        })
    }

    fn submit_inner(&mut self) -> Result<Fence> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        match self.route() {
            Route::One => {
                let ([write], [Source::Slice(data)]) = (&self.writes[..], &self.sources[..]) else {
                    unreachable!("the route of one write from a slice")
                };
                execute_one(self.core, &self.table, write, data)
            }
            // Writes that fuse go to the planner.
            Route::InPlace => match execute_in_place(self)? {
                Some(fence) => Ok(fence),
                None => {
                    self.run_fills()?;
                    execute(self, Route::Planned)
                }
            },
            route => {
                self.run_fills()?;
                execute(self, route)
            }
        }
    }
}

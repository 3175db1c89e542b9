//! Moving a batch: [`UploadBatch::submit`] and the route it takes.

use super::UploadBatch;
use crate::engine::host::Source;
use crate::engine::routes::in_place::execute_in_place;
use crate::engine::routes::one::execute_one;
use crate::engine::routes::upload_planned::execute;
use crate::engine::routes::view::UploadView;
use crate::engine::spares::UploadParts;
use crate::error::Result;
use crate::fence::Fence;
use crate::plan::route::{self, Route, UploadShape};
use crate::transfer::scope::{note, submit_in_place};

impl UploadBatch<'_> {
    /// Moves the batch to the device and returns at once with the fence of its last
    /// submission, which completes when every byte has landed.
    ///
    /// An ordinary batch ([`Device::uploads`](crate::Device::uploads)) has copied every
    /// slice into pinned staging when this returns. A scoped batch
    /// ([`Scope::uploads`](crate::Scope::uploads)) moves its writes from pinned memory of
    /// this crate straight from it, the others through staging (copied before this
    /// returns), and its scope waits for them; a batch of more than 1024 writes or a chunk
    /// of bytes moves in up to three parts, the first while the rest is looked at and laid
    /// out, where they come from pinned memory (the first part from this crate's: it moves
    /// before any later write is classified); the parts apply in order. A scoped batch that
    /// holds fills ([`write_with`](UploadBatch::write_with),
    /// [`write_with_par`](UploadBatch::write_with_par)) moves whole as an ordinary one.
    /// The fence is for a stream of your own that must wait for the writes
    /// ([`Fence::make_stream_wait`]), inside a scope too.
    ///
    /// # Errors
    /// Fails (with nothing enqueued) if any write was bad, a buffer was freed since it was
    /// added, or the batch was poisoned by a `write_with` that failed part-way
    /// ([`Error::BatchPoisoned`](crate::Error::BatchPoisoned)); else a staging or driver
    /// error. In a scoped batch, an error part way (from the driver, or a buffer another
    /// thread frees meanwhile) leaves the parts before it moved.
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

    /// The parts of the batch its route reads, borrowed ([`UploadView`]).
    pub(in crate::transfer) fn view(&mut self) -> UploadView<'_> {
        UploadView {
            core: self.core,
            table: &self.table,
            writes: &self.writes,
            sources: &self.sources,
            arena: &mut self.arena,
            arena_used: &self.arena_used,
            arena_descriptors: &self.arena_descriptors,
            par: &self.par,
        }
    }

    fn submit_inner(&mut self) -> Result<Fence> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        match self.scope {
            None => self.submit_staged(),
            // In place where it can: a batch of slices only.
            Some(seen) if self.arena.is_empty() => submit_in_place(self, seen),
            // Fills live in the batch's own staging: the batch moves whole as an ordinary
            // one, its slices copied at submit; the scope waits for it all the same.
            Some(seen) => {
                let fence = self.submit_staged()?;
                note(seen, &fence);
                Ok(fence)
            }
        }
    }

    /// Moves the batch as an ordinary batch, through its planner's route.
    fn submit_staged(&mut self) -> Result<Fence> {
        match self.route() {
            Route::One => {
                let ([write], [Source::Slice(data)]) = (&self.writes[..], &self.sources[..]) else {
                    unreachable!("the route of one write from a slice")
                };
                execute_one(self.core, &self.table, write, data)
            }
            // Writes that fuse go to the planner.
            Route::InPlace => {
                let mut view = self.view();
                match execute_in_place(&mut view)? {
                    Some(fence) => Ok(fence),
                    None => {
                        view.run_fills()?;
                        execute(&view, Route::Planned)
                    }
                }
            }
            route => {
                let view = self.view();
                view.run_fills()?;
                execute(&view, route)
            }
        }
    }
}

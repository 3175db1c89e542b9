//! Scoped transfers: batches whose other end is the caller's own memory, borrowed until every
//! transfer of the scope has completed ([`Device::scope`](crate::Device::scope)).
//!
//! A batch of a scope takes caller slices for 'scope (the scope's whole life), and the scope
//! waits for every submission made in it before it returns, even when its closure panics, as
//! `std::thread::scope` joins its threads. So the GPU may read and write the caller's memory
//! after `submit` returns, with no copy through staging, and no safe code can touch that
//! memory until the copies are done.
//!
//! Ranges that follow each other in pinned host memory (a host cache's slots), 1 MiB or more
//! in all, move as runs: one DMA a chunk into or out of device staging and one scatter or
//! gather launch inside the device. Other ranges in this crate's pinned pool
//! ([`Device::pinned`](crate::Device::pinned): a [`PinnedBuffer`](crate::PinnedBuffer), a
//! download's views), which is mapped for the device, move by one DMA each when at least
//! `Config::direct_threshold` long, else by the copy kernel reading or writing them over the
//! bus, many to a launch. Where the driver has `cuMemcpyBatchAsync`, the address space is
//! unified and the configuration asks for it (as by default), a submission's DMAs go to it
//! in one call, and ranges of 2 MiB and more move by a DMA of their own even inside a run
//! ([`Config::dma_batches`](crate::Config::dma_batches),
//! [`Device::moves_dmas_in_batches`](crate::Device::moves_dmas_in_batches)). Memory pinned by
//! `Device::pin_host` moves in place in runs only (by one DMA a range for the piece of a
//! run, shorter than a run, that crosses into a registration).
//! Everything else (pageable memory, short pieces of registered memory) takes the staged
//! path of ordinary batches: uploads are copied into staging at submit; downloads land in
//! staging and are copied out before `submit` returns.
//!
//! The scope and its waiting live here, with the checks the scoped bulk calls share; the
//! rest by concern: where host memory lies (`places`), how in-place items are laid out
//! (`plan::runs`, pure), how they move (`pinned`), and what the two batches' submits do when
//! the batch is a scope's (`uploads`: [`UploadBatch::submit`]; `downloads`: the reads
//! into slices of [`DownloadBatch::submit`]).

mod downloads;
mod pinned;
mod places;
mod uploads;

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub(in crate::transfer) use downloads::read_in_place;
pub(in crate::transfer) use uploads::submit_in_place;

use super::{DownloadBatch, UploadBatch};
use crate::engine::core::Core;
use crate::engine::wait;
use crate::error::Result;
use crate::fence::Fence;
use crate::stream::LaneKind;

/// A scope of transfers that may use the caller's memory ([`Device::scope`](crate::Device::scope)).
///
/// Its batches borrow the caller's slices until the scope ends, so the borrow rules keep
/// safe code away from memory the GPU may still read or write. Memory read into cannot be
/// looked at inside the scope:
///
/// ```compile_fail,E0502
/// # fn f(device: &cuda_resident::Device, pool: cuda_resident::ResidentBuffer) -> cuda_resident::Result<()> {
/// let mut cache = vec![0u8; 4096];
/// device.scope(|s| {
///     let mut reads = s.downloads();
///     reads.read_to_slice(pool, 0, &mut cache)?;
///     reads.submit()?;
///     println!("{}", cache[0]); // `cache` is borrowed until the scope ends
///     Ok(())
/// })
/// # }
/// ```
///
/// memory written from cannot be changed inside the scope:
///
/// ```compile_fail,E0502
/// # fn f(device: &cuda_resident::Device, pool: cuda_resident::ResidentBuffer) -> cuda_resident::Result<()> {
/// let mut rows = vec![1u8; 4096];
/// device.scope(|s| {
///     let mut writes = s.uploads();
///     writes.write(pool, 0, &rows)?;
///     writes.submit()?;
///     rows[0] = 2; // the GPU may be reading `rows`
///     Ok(())
/// })
/// # }
/// ```
///
/// and memory that does not outlive the scope cannot be lent to it (nor memory that a helper
/// closure takes as an argument of any lifetime: capture it instead, or name the scope's
/// lifetime):
///
/// ```compile_fail,E0597
/// # fn f(device: &cuda_resident::Device, pool: cuda_resident::ResidentBuffer) -> cuda_resident::Result<()> {
/// device.scope(|s| {
///     let mut local = vec![0u8; 4096];
///     let mut reads = s.downloads();
///     reads.read_to_slice(pool, 0, &mut local)?; // `local` dies inside the scope
///     reads.submit().map(drop)
/// })
/// # }
/// ```
pub struct Scope<'scope, 'env: 'scope> {
    core: &'env Arc<Core>,
    seen: Submitted,
    scope: PhantomData<&'scope mut &'scope ()>,
    env: PhantomData<&'env mut &'env ()>,
}

impl std::fmt::Debug for Scope<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scope").field("device", &self.core.info.ordinal).finish_non_exhaustive()
    }
}

/// The work of [`Device::scope`](crate::Device::scope).
pub(crate) fn scope<'env, R>(
    core: &'env Arc<Core>,
    f: impl for<'scope> FnOnce(&'scope Scope<'scope, 'env>) -> Result<R>,
) -> Result<R> {
    let scope = Scope { core, seen: Submitted::default(), scope: PhantomData, env: PhantomData };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&scope)));
    // Whatever the closure did, nothing returns (or unwinds) past this point while a copy
    // of the scope may still use the memory it borrowed.
    let waited = scope.wait_all();
    match result {
        Err(panic) => std::panic::resume_unwind(panic),
        Ok(Err(e)) => Err(e),
        Ok(Ok(value)) => waited.map(|()| value),
    }
}

impl<'scope> Scope<'scope, '_> {
    /// A batch of writes from the caller's memory, borrowed for the scope: an
    /// [`UploadBatch`] whose `submit` moves slices in pinned memory in place (see there).
    pub fn uploads(&'scope self) -> UploadBatch<'scope> {
        crate::transfer::upload::scoped(self.core, &self.seen)
    }

    /// A batch of reads, into the caller's memory borrowed for the scope
    /// ([`DownloadBatch::read_to_slice`]) or into pinned views: a [`DownloadBatch`] whose
    /// reads into slices land in pinned memory in place (see there).
    pub fn downloads(&'scope self) -> DownloadBatch<'scope> {
        crate::transfer::download::scoped(self.core, &self.seen)
    }

    /// Waits for every submission of the scope. A lane where a batch failed part-way, or
    /// whose wait fails, is synchronized whole instead (its stream, which a failed batch's
    /// side work was joined into: [`Lane::settle`](crate::stream::Lane::settle)), so that no
    /// copy of the scope runs once this returns.
    fn wait_all(&self) -> Result<()> {
        let mut first = Ok(());
        for kind in [LaneKind::Upload, LaneKind::Download] {
            let settle = || self.core.lane(kind).settle();
            let seq = self.seen.last[kind.index()].load(Ordering::Acquire);
            let failed = self.seen.failed[kind.index()].load(Ordering::Acquire);
            let waited = match (failed, seq) {
                (true, _) => settle(),
                (false, 0) => Ok(()),
                (false, seq) => wait(self.core, kind, seq).inspect_err(|_| drop(settle())),
            };
            if let Err(e) = waited
                && first.is_ok()
            {
                first = Err(e);
            }
        }
        first
    }
}

/// What a scope's batches did on each lane: the last submission made (0: none), and
/// whether a batch failed after it may have enqueued work.
#[derive(Debug, Default)]
pub(crate) struct Submitted {
    pub(super) last: [AtomicU64; 2],
    failed: [std::sync::atomic::AtomicBool; 2],
}

impl Submitted {
    /// Records what a submit on `kind`'s lane returned.
    pub(super) fn note<T>(&self, kind: LaneKind, result: Result<T>) -> Result<T> {
        if result.is_err() {
            self.failed[kind.index()].store(true, Ordering::Release);
        }
        result
    }
}

/// Records `fence`'s submission as the scope's latest on its lane.
pub(in crate::transfer) fn note(seen: &Submitted, fence: &Fence) {
    if let Some((_, kind, seq)) = fence.target() {
        seen.last[kind.index()].fetch_max(seq, Ordering::AcqRel);
    }
}

//! The planner: [`Planner`] and its one-shot conveniences, from a batch of requests to a plan
//! (validate, sort, fuse, lay out, emit; the steps live in the sibling modules), and the
//! totals a plan stores.

use super::{
    DownloadPlan, Geometry, PlanConfig, PlanError, ReadRequest, UploadPlan, WriteRequest, download, fuse,
    layout, request, sort, upload,
};

/// Plans a batch of writes. A convenience over [`Planner::plan_upload`] that allocates fresh
/// scratch; callers that plan often keep a [`Planner`].
pub fn plan_upload(writes: &[WriteRequest], cfg: &PlanConfig) -> Result<UploadPlan, PlanError> {
    Planner::new().plan_upload(writes, cfg)
}

/// Plans a batch of reads. A convenience over [`Planner::plan_download`] that allocates fresh
/// scratch; callers that plan often keep a [`Planner`].
pub fn plan_download(reads: &[ReadRequest], cfg: &PlanConfig) -> Result<DownloadPlan, PlanError> {
    Planner::new().plan_download(reads, cfg)
}

/// Plans batches while keeping its scratch memory between calls.
///
/// Planning needs a sorted copy of the requests, the fused intervals and, for overlapping
/// uploads, a heap; a planner keeps those vectors, so repeated planning allocates only the
/// plan itself, and nothing at all with the `*_into` methods once the plan's vectors have
/// grown.
#[derive(Debug, Default)]
pub struct Planner {
    sort: sort::SortScratch,
    upload: upload::Scratch,
    directs: Vec<fuse::Interval>,
    /// The non-empty requests of an in-order batch that has empty ones.
    non_empty: Vec<u32>,
    /// Per buffer key, the end of its last request so far: finding in-order batches.
    ends: Vec<u64>,
}

/// Whether a batch is in order: every non-empty request starts at or after the end of the
/// previous non-empty request of its buffer (so none overlap). Answered only for buffer keys
/// below `requests.len() + 64` (dense keys, such as a table's indices), with one pass over
/// `ends`; other keys, and requests that overflow, answer `false` (the general path then
/// plans or reports them).
pub(super) fn in_order<R: request::Request>(requests: &[R], ends: &mut Vec<u64>) -> bool {
    let bound = requests.len() as u64 + 64;
    ends.clear();
    for r in requests {
        if r.len() == 0 {
            continue;
        }
        let key = r.buffer();
        if key >= bound {
            return false;
        }
        let key = key as usize;
        if key >= ends.len() {
            ends.resize(key + 1, 0);
        }
        match r.offset().checked_add(r.len()) {
            Some(next) if r.offset() >= ends[key] => ends[key] = next,
            _ => return false,
        }
    }
    true
}

impl Planner {
    /// A planner with empty scratch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Plans a batch of writes; see the [module docs](self) for what the plan says.
    pub fn plan_upload(
        &mut self,
        writes: &[WriteRequest],
        cfg: &PlanConfig,
    ) -> Result<UploadPlan, PlanError> {
        let mut plan = UploadPlan::default();
        self.plan_upload_into(writes, cfg, &mut plan)?;
        Ok(plan)
    }

    /// Plans a batch of writes into `plan`, reusing its vectors. On error `plan` is left
    /// empty, as if for an empty batch.
    pub fn plan_upload_into(
        &mut self,
        writes: &[WriteRequest],
        cfg: &PlanConfig,
        plan: &mut UploadPlan,
    ) -> Result<(), PlanError> {
        // The chunk list is reset in place (keeping each chunk's vectors), the rest is
        // overwritten; only a failed run needs an explicit clear.
        let result = self.try_plan_upload(writes, cfg, plan);
        if result.is_err() {
            plan.clear();
        }
        result
    }

    /// Plans a batch of reads; see the [module docs](self) for what the plan says.
    pub fn plan_download(
        &mut self,
        reads: &[ReadRequest],
        cfg: &PlanConfig,
    ) -> Result<DownloadPlan, PlanError> {
        let mut plan = DownloadPlan::default();
        self.plan_download_into(reads, cfg, &mut plan)?;
        Ok(plan)
    }

    /// Plans a batch of reads into `plan`, reusing its vectors. On error `plan` is left
    /// empty, as if for an empty batch.
    pub fn plan_download_into(
        &mut self,
        reads: &[ReadRequest],
        cfg: &PlanConfig,
        plan: &mut DownloadPlan,
    ) -> Result<(), PlanError> {
        // The chunk list is reset in place (keeping each chunk's vectors), the rest is
        // overwritten; only a failed run needs an explicit clear.
        let result = self.try_plan_download(reads, cfg, plan);
        if result.is_err() {
            plan.clear();
        }
        result
    }

    /// Whether `writes` are in order (see [`in_order`]): then none of them overlap.
    pub(crate) fn is_in_order(&mut self, writes: &[WriteRequest]) -> bool {
        in_order(writes, &mut self.ends)
    }

    /// Checks an in-order batch and lists its non-empty requests when some are empty.
    fn in_order<'a, R: request::Request>(
        requests: &'a [R],
        non_empty: &'a mut Vec<u32>,
    ) -> Result<(u64, fuse::InOrder<'a, R>), PlanError> {
        let checked = fuse::check(requests)?;
        let non_empty = (checked.empties > 0).then(|| {
            non_empty.clear();
            non_empty.extend((0u32..).zip(requests).filter(|(_, r)| r.len() > 0).map(|(i, _)| i));
            &non_empty[..]
        });
        Ok((checked.collected.requested_bytes, fuse::InOrder { requests, non_empty }))
    }

    fn try_plan_upload_in_order(
        &mut self,
        writes: &[WriteRequest],
        cfg: &PlanConfig,
        plan: &mut UploadPlan,
    ) -> Result<(), PlanError> {
        let geo = Geometry::new(cfg)?;
        let (requested_bytes, entries) = Self::in_order(writes, &mut self.non_empty)?;
        let layout = upload::emit(&entries, &geo, &mut self.upload, &mut plan.chunks, &mut plan.fills)?;
        plan.store(&geo, &layout, requested_bytes);
        Ok(())
    }

    fn try_plan_download_in_order(
        &mut self,
        reads: &[ReadRequest],
        cfg: &PlanConfig,
        plan: &mut DownloadPlan,
    ) -> Result<(), PlanError> {
        let geo = Geometry::new(cfg)?;
        let (requested_bytes, entries) = Self::in_order(reads, &mut self.non_empty)?;
        let layout = download::emit(
            &entries,
            &mut self.directs,
            &geo,
            &mut plan.chunks,
            reads.len(),
            &mut plan.views,
        )?;
        plan.store(&geo, &layout, requested_bytes);
        Ok(())
    }

    fn try_plan_upload(
        &mut self,
        writes: &[WriteRequest],
        cfg: &PlanConfig,
        plan: &mut UploadPlan,
    ) -> Result<(), PlanError> {
        if in_order(writes, &mut self.ends) {
            return self.try_plan_upload_in_order(writes, cfg, plan);
        }
        let geo = Geometry::new(cfg)?;
        let (requested_bytes, sorted) = prepare(writes, &mut self.sort)?;
        let layout = match sorted {
            sort::Order::Keys(keys) => {
                upload::emit(&keys, &geo, &mut self.upload, &mut plan.chunks, &mut plan.fills)
            }
            sort::Order::Tuples(tuples) => {
                upload::emit(tuples, &geo, &mut self.upload, &mut plan.chunks, &mut plan.fills)
            }
        }?;
        plan.store(&geo, &layout, requested_bytes);
        Ok(())
    }

    fn try_plan_download(
        &mut self,
        reads: &[ReadRequest],
        cfg: &PlanConfig,
        plan: &mut DownloadPlan,
    ) -> Result<(), PlanError> {
        if in_order(reads, &mut self.ends) {
            return self.try_plan_download_in_order(reads, cfg, plan);
        }
        let geo = Geometry::new(cfg)?;
        let (requested_bytes, sorted) = prepare(reads, &mut self.sort)?;
        let (directs, chunks, views) = (&mut self.directs, &mut plan.chunks, &mut plan.views);
        let layout = match sorted {
            sort::Order::Keys(keys) => download::emit(&keys, directs, &geo, chunks, reads.len(), views),
            sort::Order::Tuples(tuples) => download::emit(tuples, directs, &geo, chunks, reads.len(), views),
        }?;
        plan.store(&geo, &layout, requested_bytes);
        Ok(())
    }
}

/// The totals of a layout, stored into a plan of either direction.
macro_rules! impl_store {
    ($plan:ty) => {
        impl $plan {
            fn store(&mut self, geo: &Geometry, layout: &layout::Layout, requested_bytes: u64) {
                self.chunk_capacity = geo.cap;
                self.total_staging = layout.total_staging;
                self.requested_bytes = requested_bytes;
                self.moved_bytes = layout.moved_bytes;
                self.packed_bytes = layout.packed_bytes;
                self.intervals = layout.intervals;
                self.packed_intervals = layout.packed_intervals;
            }

            /// The chunks, the chunk capacity, the stored layout totals and the requested
            /// bytes: what the byte model checks in either direction.
            #[cfg(any(test, feature = "fuzzing"))]
            pub(super) fn totals(&self) -> (&[super::Chunk], u64, layout::Layout, u64) {
                let layout = layout::Layout {
                    total_staging: self.total_staging,
                    moved_bytes: self.moved_bytes,
                    packed_bytes: self.packed_bytes,
                    intervals: self.intervals,
                    packed_intervals: self.packed_intervals,
                };
                (&self.chunks, self.chunk_capacity, layout, self.requested_bytes)
            }
        }
    };
}
impl_store!(UploadPlan);
impl_store!(DownloadPlan);

/// The direction-independent start: validate, and sort the non-empty requests. Returns the
/// sum of the requests' lengths and the sorted requests.
fn prepare<'a, R: request::Request>(
    requests: &[R],
    scratch: &'a mut sort::SortScratch,
) -> Result<(u64, sort::Order<'a>), PlanError> {
    let found = fuse::collect(requests, scratch)?;
    Ok((found.requested_bytes, sort::sort(requests, &found, scratch)))
}

//! The executor every transfer path runs through: claim -> stage -> move -> fence.
//!
//! [`Exec::begin`] takes a lane for a batch; [`Exec::claim`] checks the batch's buffers, marks
//! them as used by its last submission (so that freeing one waits for the copy) and makes the
//! lane wait, on the device, for work of the other lane that uses them; [`Exec::region`]
//! and [`Exec::lease`] give device and pinned memory; [`Exec::submit`] enqueues one
//! submission through an [`Enqueue`], which counts the DMAs, launches and bytes it enqueues;
//! [`Exec::finish`] records what the batch moved (one telemetry record) and returns its
//! [`Fence`] (made by `Fence::new`, in `crate::fence`, the one place a fence is made). A path differs
//! from another only in its plan (`crate::plan`, which also decides the route a batch takes,
//! `plan::route::Route`) and in how it packs; the executor decides nothing.
//!
//! One upload batch, followed through: `Device::uploads` hands the device's [`core::Core`]
//! to `transfer::upload::uploads`, which makes the batch; the batch checks each write as it
//! is added (`transfer::upload`, against the batch's [`table::BufferTable`]);
//! `submit` asks `plan::route::upload_route` for its route, and lends the route's function
//! in [`routes`] a view of its parts ([`routes::view`]); the function gets its layout from
//! the planner or `plan::route::cut_apart` (with a planner lent by [`spares`], before it
//! takes the lane), then runs an [`Exec`]: claim, staging ([`staging`], [`host`],
//! [`pipeline`]), one submission a chunk, fence. The engine's own scratch (lane staging, the parts batches reuse:
//! [`spares`]) lives here, owned by the device's [`core::Core`], the shared state every batch
//! works on.
//!
//! Inside the engine, each module uses only those listed before it: [`pipeline`] (the
//! packing threads), [`host`], [`fills`] (the fills of `UploadBatch::write_with_par`, kept
//! and run), [`order`] (ordering by byte range), [`table`], [`staging`]
//! and [`spares`], then [`core`], then the executor here, then [`routes`] (one file a
//! route, each running an [`Exec`]). The leaves take the parts of the core they need (the
//! packing threads, the allocator, a source of pinned staging), not the core.

pub(crate) mod core;
pub(crate) mod fills;
pub(crate) mod host;
pub(crate) mod order;
pub(crate) mod pipeline;
pub(crate) mod routes;
pub(crate) mod spares;
pub(crate) mod staging;
pub(crate) mod table;

use std::sync::Arc;

use cuda_sys::{CUcontext, CUstream};

use self::core::Core;
use self::order::{Held, Ranges, Seen};
use crate::alloc::ResidentBuffer;
use crate::error::Result;
use crate::fence::Fence;
use crate::host_pool::HostLease;
use crate::kernels::Kernels;
use crate::plan::runs::Direct;
use crate::raw::Raw;
use crate::stream::{KeepAlive, LaneBatch, LaneKind};
use crate::telemetry::{Moves, Telemetry};

/// Waits on the host for submission `seq` of `kind`'s lane, counting a wait that blocked.
pub(crate) fn wait(core: &Core, kind: LaneKind, seq: u64) -> Result<()> {
    if core.lane(kind).wait(seq)? {
        Telemetry::add(&core.telemetry.host_waits, 1);
    }
    Ok(())
}

/// One batch on one lane, from claim to fence. Holds the lane (its batch lock) until
/// [`Exec::end`] or [`Exec::finish`].
pub(crate) struct Exec<'a> {
    core: &'a Arc<Core>,
    kind: LaneKind,
    batch: LaneBatch<'a>,
    /// The sequence number of the batch's first submission, known once claimed.
    first_seq: u64,
    /// The sequence number of the batch's last submission, known once claimed.
    final_seq: u64,
    claimed: bool,
    moves: Moves,
}

impl<'a> Exec<'a> {
    /// Takes `kind`'s lane of `core` for one batch.
    pub(crate) fn begin(core: &'a Arc<Core>, kind: LaneKind) -> Exec<'a> {
        Exec {
            core,
            kind,
            batch: core.lane(kind).batch(),
            first_seq: 0,
            final_seq: 0,
            claimed: false,
            moves: Moves::default(),
        }
    }

    /// Claims `buffers`, whole, for `submissions` submissions (at least one): checks that
    /// every buffer is live and marks it as used by the last one (so that freeing it waits),
    /// and makes the lane wait, on the device, for work of the other lane still in flight
    /// that uses them ([`order`]). Nothing is enqueued if a buffer is stale. Returns the last
    /// submission's number.
    pub(crate) fn claim(
        &mut self,
        buffers: impl Iterator<Item = ResidentBuffer>,
        submissions: u64,
    ) -> Result<u64> {
        self.claim_with(buffers, submissions, None)
    }

    /// [`Exec::claim`] of the byte ranges `fill` names (absolute device addresses inside
    /// `buffers`), not of whole buffers: the lane waits only for work of the other lane on
    /// overlapping bytes.
    pub(crate) fn claim_ranges(
        &mut self,
        buffers: impl Iterator<Item = ResidentBuffer>,
        submissions: u64,
        fill: impl FnOnce(&mut Ranges),
    ) -> Result<u64> {
        let mut ranges = self.core.order.ranges(self.kind.index());
        fill(&mut ranges);
        self.claim_with(buffers, submissions, Some(Held::Own(ranges)))
    }

    /// [`Exec::claim_ranges`] of ranges already built (from [`core::Core::ranges`]).
    pub(crate) fn claim_built(
        &mut self,
        buffers: impl Iterator<Item = ResidentBuffer>,
        submissions: u64,
        ranges: Ranges,
    ) -> Result<u64> {
        self.claim_with(buffers, submissions, Some(Held::Own(ranges)))
    }

    /// [`Exec::claim_ranges`] of ranges built once for every move of a prepared set (sorted:
    /// [`Ranges::sort_disjoint`]), shared without a copy.
    pub(crate) fn claim_shared(
        &mut self,
        buffers: impl Iterator<Item = ResidentBuffer>,
        submissions: u64,
        ranges: &Arc<Ranges>,
    ) -> Result<u64> {
        self.claim_with(buffers, submissions, Some(Held::Shared(Arc::clone(ranges))))
    }

    fn claim_with(
        &mut self,
        buffers: impl Iterator<Item = ResidentBuffer>,
        submissions: u64,
        ranges: Option<Held>,
    ) -> Result<u64> {
        let core = self.core;
        self.first_seq = self.batch.next_seq();
        let final_seq = self.first_seq + submissions.max(1) - 1;
        self.batch.reserve(final_seq);
        let need = self.enter(buffers, final_seq, ranges)?;
        if need > 0 && core.lane(self.kind.other()).make_stream_wait(need, core.lane(self.kind).stream())? {
            Telemetry::add(&core.telemetry.lane_waits, 1);
        }
        (self.final_seq, self.claimed) = (final_seq, true);
        Ok(final_seq)
    }

    /// Marks `buffers` as used by submission `seq` of this lane and enters the batch's ranges
    /// (whole buffers when `ranges` is `None`) in the ledger. Returns the submission of the
    /// other lane the batch must wait for (0: none).
    fn enter(
        &self,
        buffers: impl Iterator<Item = ResidentBuffer>,
        seq: u64,
        ranges: Option<Held>,
    ) -> Result<u64> {
        let (core, lane) = (self.core, self.kind.index());
        let (ranges, last_other) = match ranges {
            Some(ranges) => (ranges, core.alloc.mark_used_many(buffers, lane, seq, |_, _| ())?),
            None => {
                let mut whole = core.order.ranges(lane);
                let last_other =
                    core.alloc.mark_used_many(buffers, lane, seq, |ptr, len| whole.push(ptr, len))?;
                (Held::Own(whole), last_other)
            }
        };
        let mut done = [0; 2];
        for kind in [LaneKind::Upload, LaneKind::Download] {
            done[kind.index()] = core.lane(kind).known_done();
        }
        Ok(core.order.enter(lane, seq, ranges, Seen { done, last_other }))
    }

    /// The sequence number of the batch's first submission (after [`Exec::claim`]).
    pub(crate) fn first_seq(&self) -> u64 {
        self.first_seq
    }

    /// The address of at least `len` bytes of the lane's device staging `region` (staging
    /// the lane's earlier work may still use is freed after it).
    pub(crate) fn region(&self, region: &mut staging::DeviceRegion, len: u64) -> Result<u64> {
        // Before the claim, the batch's first number is the lane's next one.
        let first_seq = if self.claimed { self.first_seq } else { self.batch.next_seq() };
        self.core.ensure_region(region, self.kind, len, first_seq - 1)
    }

    /// Claims `buffers` for one submission of this lane that stands for work another lane
    /// (of another device) does with them: marks them as used by it and returns the
    /// submission of this device's other lane that work must wait for
    /// ([`Exec::make_wait_other`]).
    pub(crate) fn claim_for_other(&mut self, buffers: impl Iterator<Item = ResidentBuffer>) -> Result<u64> {
        let seq = self.batch.next_seq();
        self.batch.reserve(seq);
        (self.first_seq, self.final_seq, self.claimed) = (seq, seq, true);
        self.enter(buffers, seq, None)
    }

    /// Makes `stream` wait, on the device, for this device's other lane up to its
    /// submission `seq`.
    pub(crate) fn make_wait_other(&self, seq: u64, stream: CUstream) -> Result<()> {
        self.core.lane(self.kind.other()).make_stream_wait(seq, stream).map(drop)
    }

    /// Makes `stream` wait, on the device, for this lane up to its submission `seq`.
    pub(crate) fn make_wait(&self, seq: u64, stream: CUstream) -> Result<()> {
        self.core.lane(self.kind).make_stream_wait(seq, stream).map(drop)
    }

    /// The lane's stream.
    pub(crate) fn stream(&self) -> CUstream {
        self.core.lane(self.kind).stream()
    }

    /// Pinned memory of `len` bytes, waiting for copies in flight when the pool is full, and
    /// for the staging other threads' transfers give back ([`Core::acquire_transfer_staging`]).
    /// Asked for only once every lease the batch took before is submitted.
    pub(crate) fn lease(&self, len: usize) -> Result<HostLease> {
        self.core.acquire_transfer_staging(len)
    }

    /// Pinned memory of `len` bytes if the pool has it free now, without waiting (for a
    /// chunk opened while earlier chunks of the batch hold leases not yet moved).
    pub(crate) fn try_lease(&self, len: usize) -> Result<Option<HostLease>> {
        self.core.pinned.try_acquire_for_transfer(len)
    }

    /// How many leases of `len` bytes the pinned pool's cap holds at once.
    pub(crate) fn room(&self, len: u64) -> usize {
        self.core.pinned.leases_within_cap(len)
    }

    /// A ring of up to `most` pinned leases of `len` bytes (at least one) for chunks moved
    /// in turn, taken before any copy of the batch is in flight to wait for: the first waits
    /// for room as any staging does, the others take only what is free (the cap may hold as
    /// few as two chunks, and the caller may hold staging too).
    pub(crate) fn ring(&self, len: usize, most: usize) -> Result<Vec<Arc<HostLease>>> {
        let most = most.min(self.room(len as u64));
        let mut ring = vec![Arc::new(self.lease(len)?)];
        while ring.len() < most {
            match self.try_lease(len)? {
                Some(lease) => ring.push(Arc::new(lease)),
                None => break,
            }
        }
        Ok(ring)
    }

    /// The scatter/gather kernel, loaded on first use.
    pub(crate) fn kernels(&self) -> Result<&'a Kernels> {
        self.core.kernels()
    }

    /// Waits on the host for this lane's submission `seq` (a chunk whose staging is reused).
    pub(crate) fn wait(&self, seq: u64) -> Result<()> {
        wait(self.core, self.kind, seq)
    }

    /// Enqueues one submission: `enqueue` puts its work on the lane's stream through an
    /// [`Enqueue`], which counts it; `keep` stays alive until the work completes. Returns
    /// the submission's number.
    #[inline]
    pub(crate) fn submit(
        &mut self,
        keep: KeepAlive,
        enqueue: impl FnOnce(&mut Enqueue<'_>) -> Result<()>,
    ) -> Result<u64> {
        let moves = &mut self.moves;
        let seq = self.batch.submit(keep, |raw, stream, _| enqueue(&mut Enqueue { raw, stream, moves }))?;
        self.moves.submissions += 1;
        Ok(seq)
    }

    /// A submission that enqueues nothing and only keeps `keep` until the work before it on
    /// the lane completes; not counted as a move.
    pub(crate) fn hold(&self, keep: KeepAlive) -> Result<u64> {
        self.batch.submit(keep, |_, _, _| Ok(()))
    }

    /// Enqueues work on the lane's side stream, recorded in `slot` (see
    /// [`LaneBatch::submit_side`]); counted as the batch's, not as a submission.
    pub(crate) fn submit_side(
        &mut self,
        slot: usize,
        enqueue: impl FnOnce(&mut Enqueue<'_>) -> Result<()>,
    ) -> Result<()> {
        let moves = &mut self.moves;
        self.batch.submit_side(slot, |raw, stream| enqueue(&mut Enqueue { raw, stream, moves }))
    }

    /// Makes the lane wait for the side work last recorded in `slot`.
    pub(crate) fn wait_side(&self, slot: usize) -> Result<()> {
        self.batch.wait_side(slot)
    }

    /// Makes the lane wait for all side work of this batch.
    pub(crate) fn join_side(&self) -> Result<()> {
        self.batch.join_side()
    }

    /// Counts `bytes` the caller asked to move.
    pub(crate) fn requested(&mut self, bytes: u64) {
        self.moves.requested += bytes;
    }

    /// Counts `bytes` that crossed the bus outside any one enqueue (the payload of launches
    /// over the bus, counted once for the batch).
    pub(crate) fn moved(&mut self, bytes: u64) {
        self.moves.moved += bytes;
    }

    /// Records what was counted so far and starts counting afresh (a batch that counts
    /// each chunk as it is enqueued).
    pub(crate) fn flush(&mut self) {
        self.core.telemetry.record(self.kind, std::mem::take(&mut self.moves));
    }

    /// Gives the lane back; what was counted is recorded by the [`Ended`].
    pub(crate) fn end(self) -> Ended<'a> {
        debug_assert!(
            self.moves.submissions == 0 || self.core.lane(self.kind).last_submitted() == self.final_seq,
            "a batch submits exactly what it claimed: its buffers are marked with its last submission"
        );
        Ended { core: self.core, kind: self.kind, final_seq: self.final_seq, moves: self.moves }
    }

    /// Gives the lane back, records what the batch moved and returns its fence.
    pub(crate) fn finish(self) -> Fence {
        self.end().fence()
    }
}

/// A batch whose lane was given back: what it counted, not recorded yet.
pub(crate) struct Ended<'a> {
    core: &'a Arc<Core>,
    kind: LaneKind,
    final_seq: u64,
    moves: Moves,
}

impl Ended<'_> {
    /// Records what the batch moved.
    pub(crate) fn record(self) {
        self.core.telemetry.record(self.kind, self.moves);
    }

    /// Records what the batch moved and returns the fence of its last submission.
    pub(crate) fn fence(self) -> Fence {
        let (core, kind, seq) = (self.core, self.kind, self.final_seq);
        self.record();
        Fence::new(&core.lanes, kind, seq)
    }
}

/// A [`Kernels`] method that enqueues one launch of the copy kernel: [`Kernels::copy`] or
/// [`Kernels::copy_over_bus`].
type KernelCopy = unsafe fn(&Kernels, &Raw, CUstream, u64, u64) -> Result<()>;

/// The work of one submission, enqueued on a stream and counted as it goes.
pub(crate) struct Enqueue<'q> {
    raw: &'q Raw,
    stream: CUstream,
    moves: &'q mut Moves,
}

impl Enqueue<'_> {
    /// One DMA of `len` bytes from host memory at `src` to device memory at `dst`.
    ///
    /// # Safety
    /// As [`Raw::memcpy_htod_async`].
    #[inline]
    pub(crate) unsafe fn htod(&mut self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        // SAFETY: as the caller promises.
        unsafe { self.raw.memcpy_htod_async(dst, src, len, self.stream) }?;
        self.count_dma(len);
        Ok(())
    }

    /// One DMA of `len` bytes from device memory at `src` to host memory at `dst`.
    ///
    /// # Safety
    /// As [`Raw::memcpy_dtoh_async`].
    #[inline]
    pub(crate) unsafe fn dtoh(&mut self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        // SAFETY: as the caller promises.
        unsafe { self.raw.memcpy_dtoh_async(dst, src, len, self.stream) }?;
        self.count_dma(len);
        Ok(())
    }

    /// One DMA per item, host to device (`to_device`) or back, in one
    /// `cuMemcpyBatchAsync` where `batched` names the device (`Core::dma_batches`), else by
    /// [`Enqueue::htod`] or [`Enqueue::dtoh`] each, in order.
    ///
    /// # Safety
    /// As [`Enqueue::htod`] or [`Enqueue::dtoh`] for each item; no two items' destinations
    /// overlap (a batch's copies run in no set order).
    pub(crate) unsafe fn dmas(
        &mut self,
        items: &[Direct],
        to_device: bool,
        batched: Option<i32>,
    ) -> Result<()> {
        match batched {
            Some(ordinal) if items.len() > 1 => {
                let n = items.len();
                let (mut dsts, mut srcs, mut sizes) =
                    (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
                for d in items {
                    let (dst, src) = if to_device { (d.dev, d.host as u64) } else { (d.host as u64, d.dev) };
                    dsts.push(dst);
                    srcs.push(src);
                    sizes.push(d.len as usize);
                }
                // SAFETY: as the caller promises.
                unsafe {
                    self.raw.memcpy_batch_async(
                        (&mut dsts, &mut srcs, &mut sizes),
                        to_device,
                        ordinal,
                        self.stream,
                    )
                }?;
                items.iter().for_each(|d| self.count_dma(d.len as usize));
                Ok(())
            }
            _ => items.iter().try_for_each(|d| {
                // SAFETY: as the caller promises.
                unsafe {
                    if to_device {
                        self.htod(d.dev, d.host as *const u8, d.len as usize)
                    } else {
                        self.dtoh(d.host as *mut u8, d.dev, d.len as usize)
                    }
                }
            }),
        }
    }

    /// One DMA of `len` bytes between two devices' memory, each given with its context.
    ///
    /// # Safety
    /// As [`Raw::memcpy_peer_async`].
    #[inline]
    pub(crate) unsafe fn peer(
        &mut self,
        dst: (u64, CUcontext),
        src: (u64, CUcontext),
        len: usize,
    ) -> Result<()> {
        // SAFETY: as the caller promises.
        unsafe { self.raw.memcpy_peer_async(dst, src, len, self.stream) }?;
        self.count_dma(len);
        Ok(())
    }

    /// One launch of the copy kernel over `count` descriptors at `table` (in device memory),
    /// which moves `bytes` over the bus (0 when it copies inside the device).
    ///
    /// # Safety
    /// As [`Kernels::copy`].
    #[inline]
    pub(crate) unsafe fn launch(
        &mut self,
        kernels: &Kernels,
        table: u64,
        count: u64,
        bytes: u64,
    ) -> Result<()> {
        // SAFETY: as the caller promises.
        unsafe { self.launch_by(Kernels::copy, kernels, table, count, bytes) }
    }

    /// [`Enqueue::launch`] for a table and copies whose host side lies in pinned memory,
    /// read or written by the kernel over the bus.
    ///
    /// # Safety
    /// As [`Kernels::copy_over_bus`].
    #[inline]
    pub(crate) unsafe fn launch_over_bus(
        &mut self,
        kernels: &Kernels,
        table: u64,
        count: u64,
        bytes: u64,
    ) -> Result<()> {
        // SAFETY: as the caller promises.
        unsafe { self.launch_by(Kernels::copy_over_bus, kernels, table, count, bytes) }
    }

    /// One launch of the copy kernel by `copy`, counted: the work of [`Enqueue::launch`] and
    /// [`Enqueue::launch_over_bus`], which differ only in the [`Kernels`] method they use.
    ///
    /// # Safety
    /// As `copy` ([`Kernels::copy`] or [`Kernels::copy_over_bus`]).
    #[inline]
    unsafe fn launch_by(
        &mut self,
        copy: KernelCopy,
        kernels: &Kernels,
        table: u64,
        count: u64,
        bytes: u64,
    ) -> Result<()> {
        // SAFETY: as the caller promises.
        unsafe { copy(kernels, self.raw, self.stream, table, count) }?;
        self.count_launch(bytes);
        Ok(())
    }

    #[inline]
    fn count_dma(&mut self, len: usize) {
        self.moves.dmas += 1;
        self.moves.moved += len as u64;
    }

    #[inline]
    fn count_launch(&mut self, bytes: u64) {
        self.moves.launches += 1;
        self.moves.moved += bytes;
    }
}

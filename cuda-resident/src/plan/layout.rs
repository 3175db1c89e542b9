//! Placement: where each fused interval goes in flat staging, and the chunks that result.
//!
//! Packed intervals come first, each at the next aligned offset, or at the start of a new
//! chunk when it does not fit in what is left of the current one. Direct intervals follow
//! from where the packed ones ended, each at the next aligned offset, and run over chunk
//! boundaries freely: they are cut into one piece per chunk. Chunk `i` starts at `i * cap`.
//!
//! Chunks are opened as the cursor reaches them, reusing the chunks (and their copy vectors)
//! of the plan being overwritten, and the current chunk is tracked rather than divided out:
//! a batch can hold thousands of small intervals.

use super::fuse::{Interval, sweep};
use super::sort::Sorted;
use super::{Chunk, Copy, Geometry, PlanError};

/// What a direction makes of each placed interval (fills, views).
///
/// A trait rather than a closure so that its `#[inline(always)]` method is inlined into the
/// sweep, which runs once per request, at both of its call sites.
pub(super) trait Emit {
    /// Records what `iv`, just placed, needs besides its copies.
    fn emit(&mut self, iv: &Interval);
}

/// Totals of a layout.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Layout {
    /// One past the last staging byte used.
    pub(super) total_staging: u64,
    /// Sum of the interval lengths.
    pub(super) moved_bytes: u64,
    /// Bytes of the packed intervals.
    pub(super) packed_bytes: u64,
    /// How many intervals there are.
    pub(super) intervals: usize,
    /// How many of them are packed.
    pub(super) packed_intervals: usize,
}

/// Fuses the sorted `entries` into intervals, places each one (setting its `stage` and
/// `chunk`), records its copies in `chunks`, and hands it to `emit` once it is placed.
///
/// Packed intervals are placed as the sweep closes them, since they are laid out in sweep
/// order anyway; direct ones wait in `directs` (scratch) until the packed ones are done.
/// So `emit` sees the intervals in ascending flat staging order, and whatever it appends
/// is sorted too. All offset arithmetic is checked; a chunk count past `u32::MAX` is
/// [`PlanError::TooLarge`].
pub(super) fn lay_out<S: Sorted + ?Sized>(
    entries: &S,
    geo: &Geometry,
    chunks: &mut Vec<Chunk>,
    directs: &mut Vec<Interval>,
    emit: &mut impl Emit,
) -> Result<Layout, PlanError> {
    let mut placer = Placer { geo, chunks, open: 0, end: 0, cursor: 0, descriptors: 0 };
    directs.clear();
    // The counts are taken afterwards rather than per interval, which keeps the loop's
    // state in registers.
    let moved_bytes = sweep(entries, |mut iv| {
        if !geo.is_packed(iv.len()) {
            directs.push(iv);
            return Ok(());
        }
        placer.packed(&mut iv)?;
        emit.emit(&iv);
        Ok(())
    })?;
    placer.close_packed();
    let mut direct_bytes = 0u64;
    for iv in directs.iter_mut() {
        placer.direct(iv)?;
        emit.emit(iv);
        // Cannot overflow: the placement checked the cursor past all of them.
        direct_bytes += iv.len();
    }
    placer.chunks.truncate(placer.open);
    let packed_intervals = placer.chunks.iter().map(|c| c.packed.len()).sum::<usize>();
    Ok(Layout {
        total_staging: placer.cursor,
        moved_bytes,
        // The sum of the lengths is exact for a layout that succeeds: the cursor is past it.
        packed_bytes: moved_bytes - direct_bytes,
        intervals: packed_intervals + directs.len(),
        packed_intervals,
    })
}

/// The moving state of a layout.
struct Placer<'a> {
    geo: &'a Geometry,
    chunks: &'a mut Vec<Chunk>,
    /// Chunks opened so far; any after them are left over from an earlier plan.
    open: usize,
    /// Flat end of the open chunks' capacity: `open * cap`, a multiple of `align`.
    end: u64,
    /// One past the last byte placed.
    cursor: u64,
    /// Kernel descriptors of the current chunk's packed copies so far.
    descriptors: u64,
}

impl Placer<'_> {
    fn too_large(&self) -> PlanError {
        PlanError::TooLarge { chunk_capacity: self.geo.cap }
    }

    /// Opens the next chunk at `end`, reusing a left-over chunk when there is one.
    #[cold]
    fn open_chunk(&mut self) -> Result<(), PlanError> {
        if self.open >= u32::MAX as usize {
            return Err(self.too_large());
        }
        let start = self.end;
        self.end = start.checked_add(self.geo.cap).ok_or_else(|| self.too_large())?;
        if let Some(chunk) = self.chunks.get_mut(self.open) {
            chunk.reset(start);
        } else {
            let chunks = self.open as u64 + 1;
            self.chunks.try_reserve(1).map_err(|_| PlanError::OutOfMemory { chunks })?;
            let mut chunk = Chunk::default();
            chunk.reset(start);
            self.chunks.push(chunk);
        }
        self.open += 1;
        self.descriptors = 0;
        Ok(())
    }

    /// The current chunk, the last one opened.
    #[inline(always)]
    fn current(&mut self) -> &mut Chunk {
        &mut self.chunks[self.open - 1]
    }

    /// A packed interval goes at the next aligned offset if it fits in the current chunk,
    /// bytes and descriptors ([`Geometry::most`]), else at the start of a new one. It is
    /// shorter than `cap`, so it always fits there, and is one copy at the end of its chunk's
    /// packed region.
    #[inline(always)]
    fn packed(&mut self, iv: &mut Interval) -> Result<(), PlanError> {
        let len = iv.len();
        let descriptors = len.div_ceil(crate::kernels::SEGMENT);
        // `cursor <= end`, and `end` is a multiple of `align` that fits `u64`: no overflow.
        let mut start = (self.cursor + self.geo.align - 1) & !(self.geo.align - 1);
        if len > self.end - start || self.descriptors + descriptors > self.geo.most {
            self.close_packed();
            start = self.end;
            self.open_chunk()?;
        }
        self.descriptors += descriptors;
        iv.stage = start;
        iv.chunk = (self.open - 1) as u32;
        self.cursor = start + len;
        let chunk = self.current();
        chunk.packed.push(Copy { stage_offset: start, buffer: iv.buffer, buffer_offset: iv.start, len });
        Ok(())
    }

    /// Sets the current chunk's packed region, which ends at `cursor` while packed intervals
    /// are placed. Done once per chunk rather than per interval.
    #[cold]
    fn close_packed(&mut self) {
        let cursor = self.cursor;
        if let Some(chunk) = self.chunks[..self.open].last_mut()
            && !chunk.packed.is_empty()
        {
            chunk.packed_len = cursor - chunk.stage_start;
            chunk.staging_len = chunk.packed_len;
        }
    }

    /// A direct interval goes at the next aligned offset and is cut at each chunk boundary;
    /// its pieces are contiguous in flat staging.
    fn direct(&mut self, iv: &mut Interval) -> Result<(), PlanError> {
        let start = self.geo.align_up(self.cursor).ok_or_else(|| self.too_large())?;
        let end = start.checked_add(iv.len()).ok_or_else(|| self.too_large())?;
        self.reserve_through(end)?;
        iv.stage = start;
        // `start <= self.end`; at `self.end` the interval starts the chunk about to be opened.
        iv.chunk = if start == self.end { self.open } else { self.open - 1 } as u32;
        let (mut flat, mut buffer_offset) = (start, iv.start);
        while flat < end {
            if flat == self.end {
                self.open_chunk()?;
            }
            let len = (end - flat).min(self.end - flat);
            let chunk = self.current();
            chunk.direct.push(Copy { stage_offset: flat, buffer: iv.buffer, buffer_offset, len });
            chunk.staging_len = flat + len - chunk.stage_start;
            flat += len;
            buffer_offset += len;
        }
        self.cursor = end;
        Ok(())
    }

    /// Fails before anything is allocated when staging up to `end` needs too many chunks,
    /// and reserves the chunk list for them at once, so that a huge interval fails fast.
    fn reserve_through(&mut self, end: u64) -> Result<(), PlanError> {
        let needed = end.div_ceil(self.geo.cap);
        if needed > u64::from(u32::MAX) {
            return Err(self.too_large());
        }
        let missing = (needed as usize).saturating_sub(self.chunks.len());
        self.chunks.try_reserve_exact(missing).map_err(|_| PlanError::OutOfMemory { chunks: needed })
    }
}

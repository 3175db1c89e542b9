//! Download emission: the chunks' copies, and for every read the place of its bytes.

use super::fuse::Interval;
use super::layout::{Emit, Layout, lay_out};
use super::request::Entry;
use super::sort::Sorted;
use super::{Chunk, Geometry, PlanError, ReadView};

/// Fuses the sorted entries, lays the intervals out into `chunks` and fills `views` with one view per read (`reads`
/// of them; zero-length reads keep the empty default view).
pub(super) fn emit<S: Sorted + ?Sized>(
    entries: &S,
    directs: &mut Vec<Interval>,
    geo: &Geometry,
    chunks: &mut Vec<Chunk>,
    reads: usize,
    views: &mut Vec<ReadView>,
) -> Result<Layout, PlanError> {
    views.clear();
    views.resize(reads, ReadView::default());
    lay_out(entries, geo, chunks, directs, &mut Views { entries, geo, views })
}

/// The download half of the layout: each read's view.
struct Views<'a, S: ?Sized> {
    entries: &'a S,
    geo: &'a Geometry,
    views: &'a mut [ReadView],
}

impl<S: Sorted + ?Sized> Emit for Views<'_, S> {
    #[inline(always)]
    fn emit(&mut self, iv: &Interval) {
        if iv.last - iv.first == 1 {
            // A lone read is the interval: no need to read its entry again.
            let e = Entry { place: 0, start: iv.start, end: iv.end, index: iv.index };
            self.views[e.index as usize] = view_of(iv, &e, self.geo);
            return;
        }
        for e in self.entries.range(iv.first, iv.last) {
            self.views[e.index as usize] = view_of(iv, &e, self.geo);
        }
    }
}

/// A read lies inside its interval, whose staging is contiguous (packed intervals are never
/// split, direct ones continue at the next chunk's start), so its bytes are too.
fn view_of(iv: &Interval, e: &Entry, geo: &Geometry) -> ReadView {
    let stage_offset = iv.stage + (e.start - iv.start);
    let len = e.end - e.start;
    if geo.is_packed(iv.len()) {
        // Never split: no division needed for the common small read.
        return ReadView { chunk: iv.chunk, last_chunk: iv.chunk, stage_offset, len };
    }
    ReadView {
        chunk: geo.chunk_of(stage_offset),
        last_chunk: geo.chunk_of(stage_offset + len - 1),
        stage_offset,
        len,
    }
}

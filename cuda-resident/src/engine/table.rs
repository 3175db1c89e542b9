//! The buffers a batch names, each resolved once, and the layout of its requests as added.

use std::sync::Arc;

use crate::alloc::{Allocator, ResidentBuffer};
use crate::context::Context;
use crate::engine::order::Ranges;
use crate::error::{Error, Result};
use crate::handle::SHARDS;
use crate::plan::route::Apart;

/// The buffers a batch names, each resolved once: key (index) -> handle, address, length.
///
/// A table is reused by the device's next batches, and keeps what the last batch resolved:
/// the next batch takes a handle's address and length from there, without the allocator's
/// lock, as long as the allocator has freed nothing in that handle's shard since
/// ([`Allocator::frees_in`], compared through [`Stamps`]). A handle freed while a batch is
/// built fails the batch at submit, where every buffer is checked again
/// (`engine::Exec::claim`).
///
/// [`Allocator::frees_in`]: crate::alloc::Allocator::frees_in
#[derive(Default)]
pub(crate) struct BufferTable {
    pub(crate) entries: Vec<Resolved>,
    /// Open addressing over `entries`: `index + 1`, 0 for empty. Length a power of two, at
    /// most a quarter full, so that a lookup almost always finds its buffer in the first
    /// slot it probes: whether it does varies from buffer to buffer, a branch no predictor
    /// follows, taken wrongly on most writes of a batch when the table is half full.
    slots: Vec<u32>,
    /// What this batch's entries were resolved under: made at the table's first resolution
    /// and kept with it. Boxed, as `kept_stamps`: a table moves with its batch (taken from
    /// the device's spares and given back, an empty one left in its place), and inline the
    /// two would make each move copy and each empty table fill half a kilobyte.
    stamps: Option<Box<Stamps>>,
    /// The last batch's entries and slots, and what they were resolved under.
    kept: Vec<Resolved>,
    kept_slots: Vec<u32>,
    kept_stamps: Option<Box<Stamps>>,
    /// Whether the requests so far can skip the planner, and their layout if so.
    pub(crate) apart: Apart,
}

/// From this many requests in order and apart, a batch claims one span per buffer
/// ([`BufferTable::push_ranges`]).
pub(crate) const SPAN_MIN: usize = 256;

/// What a batch's resolutions are valid under: the allocator (`owner`), and per shard the
/// allocator's count of frees in it, read before the batch resolved its first buffer of
/// that shard ([`UNREAD`](Stamps::UNREAD) until then). Each entry of the shard was live, at
/// its address, at some moment after that read; so while the count still reads the same, no
/// free has come since and the entry is still true (`Allocator::frees_in`). A batch reads
/// each shard's count at most once, and a free in one shard leaves the others' kept
/// resolutions valid.
#[derive(Clone, Copy)]
struct Stamps {
    /// The allocator's id; [`Stamps::NONE`] before the batch's first resolution,
    /// [`Stamps::MIXED`] once it named buffers of two allocators (then nothing is reused).
    owner: u32,
    frees: [u64; SHARDS],
}

impl Stamps {
    const UNREAD: u64 = u64::MAX;
    /// Allocator ids start at 1.
    const NONE: u32 = 0;
    const MIXED: u32 = u32::MAX;
}

impl Stamps {
    /// As made: no allocator, no count read.
    fn reset(&mut self) {
        self.owner = Stamps::NONE;
        self.frees.fill(Stamps::UNREAD);
    }
}

impl Default for Stamps {
    fn default() -> Stamps {
        Stamps { owner: Stamps::NONE, frees: [Stamps::UNREAD; SHARDS] }
    }
}

/// A buffer as the batch saw it when it was named.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Resolved {
    pub(crate) buffer: ResidentBuffer,
    pub(crate) ptr: u64,
    pub(crate) len: u64,
    /// The end plus one of the batch's last request to this buffer, 0 for none
    /// ([`Apart`]).
    next: u64,
    /// The lowest offset the batch's requests to this buffer start at (`u64::MAX`: none).
    first: u64,
}

impl crate::recycle::Reusable for BufferTable {
    fn clear(&mut self) {
        // A table grown by a batch of very many buffers is not kept for small ones: zeroing
        // it would cost each of them.
        if self.slots.len() > 1 << 16 {
            *self = BufferTable::default();
            return;
        }
        // This batch's buffers become the ones kept; the vectors kept before are emptied for
        // the next batch.
        std::mem::swap(&mut self.entries, &mut self.kept);
        std::mem::swap(&mut self.slots, &mut self.kept_slots);
        std::mem::swap(&mut self.kept_stamps, &mut self.stamps);
        if let Some(stamps) = &mut self.stamps {
            stamps.reset();
        }
        self.entries.clear();
        self.slots.fill(0);
        self.apart.clear();
    }
}

#[cfg(test)]
thread_local! {
    /// Buffers this thread's batches took from what an earlier batch resolved.
    pub(crate) static KEPT_HITS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The key of `buffer` in a table's `entries` and `slots`, or the empty slot where it would
/// go. `slots` must have an empty slot.
#[inline]
fn probe_in(entries: &[Resolved], slots: &[u32], buffer: ResidentBuffer) -> std::result::Result<u32, usize> {
    let mask = slots.len() - 1;
    let mut at = (buffer.mix() >> 32) as usize & mask;
    loop {
        match slots[at] {
            0 => return Err(at),
            k if entries[k as usize - 1].buffer == buffer => return Ok(k - 1),
            _ => at = (at + 1) & mask,
        }
    }
}

/// Whether `[offset, offset + len)` lies in a buffer of `buffer_len` bytes (a range whose
/// end overflows does not).
#[inline]
fn in_range(offset: u64, len: u64, buffer_len: u64) -> bool {
    offset.checked_add(len).is_some_and(|end| end <= buffer_len)
}

impl BufferTable {
    /// The key of `buffer`, resolving it on first sight.
    pub(crate) fn key(
        &mut self,
        alloc: &Allocator<Arc<Context>>,
        buffer: ResidentBuffer,
    ) -> Result<(u32, Resolved)> {
        if self.entries.len() * 4 >= self.slots.len() {
            self.grow();
        }
        let at = match self.probe(buffer) {
            Ok(key) => return Ok((key, self.entries[key as usize])),
            Err(empty) => empty,
        };
        let owner = alloc.id();
        let stamps = self.stamps.get_or_insert_with(Box::default);
        if stamps.owner != owner {
            // The batch's first resolution; or a second allocator, which no batch names (the
            // table then keeps nothing that could pass for the first one's).
            let first = stamps.owner == Stamps::NONE;
            stamps.reset();
            stamps.owner = if first { owner } else { Stamps::MIXED };
        }
        let shard = buffer.shard();
        // Read before anything this batch resolves in the shard: a free there after it
        // invalidates them all. A handle of another allocator is never taken from `kept`.
        let now = match stamps.frees[shard] {
            Stamps::UNREAD if stamps.owner == owner => {
                let now = alloc.frees_in(shard);
                stamps.frees[shard] = now;
                now
            }
            now => now,
        };
        // Frees only count up: unchanged since the last batch read it, unchanged since this
        // one did.
        let reuse = now != Stamps::UNREAD
            && buffer.owner == owner
            && self.kept_stamps.as_ref().is_some_and(|kept| kept.owner == owner && kept.frees[shard] == now)
            && !self.kept_slots.is_empty();
        let kept = reuse.then(|| probe_in(&self.kept, &self.kept_slots, buffer).ok()).flatten();
        let resolved = match kept {
            Some(k) => {
                #[cfg(test)]
                KEPT_HITS.with(|n| n.set(n.get() + 1));
                Resolved { next: 0, first: u64::MAX, ..self.kept[k as usize] }
            }
            None => {
                let (ptr, len) = alloc.resolve(buffer)?;
                Resolved { buffer, ptr, len, next: 0, first: u64::MAX }
            }
        };
        self.entries.push(resolved);
        self.slots[at] = self.entries.len() as u32;
        Ok((self.entries.len() as u32 - 1, resolved))
    }

    /// The key of `buffer` if the table has it, else the empty slot where it would go. The
    /// table must have a slot.
    #[inline]
    fn probe(&self, buffer: ResidentBuffer) -> std::result::Result<u32, usize> {
        probe_in(&self.entries, &self.slots, buffer)
    }

    /// The key of `buffer` if the table has it: the hot path of [`BufferTable::check`].
    #[inline]
    fn find(&self, buffer: ResidentBuffer) -> Option<u32> {
        if self.slots.is_empty() { None } else { self.probe(buffer).ok() }
    }

    /// The key and length of `buffer`, after checking that `[offset, offset + len)` lies in
    /// it. A failure is also kept in `first_error` (when it holds none yet): it fails the
    /// batch at submit.
    #[inline]
    pub(crate) fn check(
        &mut self,
        alloc: &Allocator<Arc<Context>>,
        buffer: ResidentBuffer,
        offset: u64,
        len: u64,
        first_error: &mut Option<Error>,
    ) -> Result<(u32, u64)> {
        // A buffer seen before and a range inside it: no error value is built or moved.
        if let Some(key) = self.find(buffer) {
            let entry = &mut self.entries[key as usize];
            if in_range(offset, len, entry.len) {
                self.apart.note(&mut entry.next, entry.ptr, offset, len);
                entry.first = entry.first.min(offset);
                return Ok((key, entry.len));
            }
        }
        let (key, buffer_len) = self.check_slow(alloc, buffer, offset, len, first_error)?;
        let entry = &mut self.entries[key as usize];
        self.apart.note(&mut entry.next, entry.ptr, offset, len);
        entry.first = entry.first.min(offset);
        Ok((key, buffer_len))
    }

    /// [`BufferTable::check`] of a range of the buffer with key `key` (one the table has),
    /// without looking the buffer up: its length, or `None` (nothing noted) when the range
    /// does not lie in it. For bulk calls, whose items come in runs on one buffer.
    #[inline]
    pub(crate) fn check_key(&mut self, key: u32, offset: u64, len: u64) -> Option<u64> {
        let entry = &mut self.entries[key as usize];
        if !in_range(offset, len, entry.len) {
            return None;
        }
        self.apart.note(&mut entry.next, entry.ptr, offset, len);
        entry.first = entry.first.min(offset);
        Some(entry.len)
    }

    /// [`BufferTable::check`] for a buffer seen first or a bad range.
    #[cold]
    fn check_slow(
        &mut self,
        alloc: &Allocator<Arc<Context>>,
        buffer: ResidentBuffer,
        offset: u64,
        len: u64,
        first_error: &mut Option<Error>,
    ) -> Result<(u32, u64)> {
        let checked = self.key(alloc, buffer).and_then(|(key, resolved)| {
            if in_range(offset, len, resolved.len) {
                Ok((key, resolved.len))
            } else {
                Err(Error::OutOfRange { buffer, offset, len, buffer_len: resolved.len })
            }
        });
        if let Err(e) = &checked
            && first_error.is_none()
        {
            *first_error = Some(e.clone());
        }
        checked
    }

    fn grow(&mut self) {
        let size = (self.slots.len() * 2).max(64);
        self.slots = vec![0; size];
        let mask = size - 1;
        for (i, e) in self.entries.iter().enumerate() {
            let mut at = (e.buffer.mix() >> 32) as usize & mask;
            while self.slots[at] != 0 {
                at = (at + 1) & mask;
            }
            self.slots[at] = i as u32 + 1;
        }
    }

    pub(crate) fn buffers(&self) -> impl Iterator<Item = ResidentBuffer> + '_ {
        self.entries.iter().map(|e| e.buffer)
    }

    /// Adds the device range of each of `requests` (key, offset in its buffer, length) to
    /// `ranges`, for `engine::Exec::claim_ranges`. A batch of at least [`SPAN_MIN`] requests
    /// in order and apart ([`Apart`]) claims instead, per buffer, the span from its first
    /// request to the end of its last, gaps included: a conservative claim, with no pass over
    /// the requests (8192 ranges cost a download's submit about 35 µs on the H200 host).
    pub(crate) fn push_ranges(&self, ranges: &mut Ranges, requests: impl Iterator<Item = (u64, u64, u64)>) {
        if !self.apart.broken && self.apart.offsets.len() >= SPAN_MIN {
            for e in self.entries.iter().filter(|e| e.next > 0) {
                ranges.push(e.ptr + e.first, e.next - 1 - e.first);
            }
            return;
        }
        for (key, offset, len) in requests {
            ranges.push(self.entries[key as usize].ptr + offset, len);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::{BufferTable, KEPT_HITS};
    use crate::alloc::use_shard;
    use crate::recycle::Reusable;
    use crate::testing::{device, model};
    use crate::{Config, Device, Error, ResidentBuffer};

    fn hits() -> usize {
        KEPT_HITS.with(|n| n.get())
    }

    /// One upload batch writing to each of `buffers`; the buffers taken from the last
    /// batch's resolutions.
    fn round(d: &Device, buffers: &[ResidentBuffer]) -> usize {
        let data: Vec<[u8; 16]> = (0..buffers.len()).map(|k| [k as u8; 16]).collect();
        let before = hits();
        let mut batch = d.uploads();
        for (&b, bytes) in buffers.iter().zip(&data) {
            batch.write(b, 0, bytes).unwrap();
        }
        batch.submit().unwrap().wait().unwrap();
        hits() - before
    }

    #[test]
    fn a_free_invalidates_kept_resolutions_of_its_own_shard_only() {
        let d = device(Config::default());
        use_shard(4);
        let (x, y, spare) = (d.allocate(4096).unwrap(), d.allocate(8192).unwrap(), d.allocate(64).unwrap());
        use_shard(9);
        let (z, other) = (d.allocate(4096).unwrap(), d.allocate(64).unwrap());
        assert_eq!([x, y, spare, z, other].map(ResidentBuffer::shard), [4, 4, 4, 9, 9]);

        round(&d, &[x, y, z]);
        assert_eq!(round(&d, &[y, z, x]), 3, "nothing freed: all three kept");
        // A free in shard 9 leaves shard 4's resolutions valid.
        d.free(other).unwrap();
        assert_eq!(round(&d, &[x, y, z]), 2, "x and y kept, z resolved again");
        assert_eq!(round(&d, &[x, y, z]), 3);
        // A free in shard 4 invalidates shard 4's only.
        d.free(spare).unwrap();
        assert_eq!(round(&d, &[x, y, z]), 1, "z kept, x and y resolved again");
        // A freed handle that was kept is refused where it is named; the others of its
        // batch are still taken from what was kept.
        d.free(z).unwrap();
        let mut batch = d.uploads();
        let before = hits();
        batch.write(x, 0, &[1; 16]).unwrap();
        let err = batch.write(z, 0, &[1; 16]).unwrap_err();
        assert!(matches!(err, Error::FreedBuffer { .. }), "{err}");
        assert_eq!(hits() - before, 1, "x kept");
        drop(batch);
        // Its memory, handed out again in its shard, is never reached through it.
        use_shard(9);
        let reused = d.allocate(4096).unwrap();
        let mut batch = d.uploads();
        assert!(matches!(batch.write(z, 0, &[1; 16]), Err(Error::FreedBuffer { .. })));
        drop(batch);
        round(&d, &[reused, x]);
        assert_eq!(d.download(x).unwrap()[..16], [1; 16]);
        assert_eq!(d.download(reused).unwrap()[..16], [0; 16]);
    }

    #[test]
    fn a_table_takes_nothing_kept_under_another_allocator() {
        let driver = model::driver();
        let d0 = Device::open_with(Arc::clone(&driver), 0, Config::default()).unwrap();
        let d1 = Device::open_with(driver, 1, Config::default()).unwrap();
        let (a, b) = (d0.allocate(4096).unwrap(), d1.allocate(4096).unwrap());
        let (alloc0, alloc1) = (&d0.core().alloc, &d1.core().alloc);
        let mut table = BufferTable::default();
        table.key(alloc0, a).unwrap();
        table.clear();
        let before = hits();
        table.key(alloc0, a).unwrap();
        assert_eq!(hits(), before + 1, "kept under the same allocator");
        table.clear();
        // Kept, but named to another allocator: refused there, as if never kept.
        let err = table.key(alloc1, a).unwrap_err();
        assert!(matches!(err, Error::ForeignBuffer { .. }), "{err}");
        table.clear();
        // A batch that names buffers of two allocators keeps nothing for the next.
        table.key(alloc0, a).unwrap();
        table.key(alloc1, b).unwrap();
        table.clear();
        let before = hits();
        table.key(alloc0, a).unwrap();
        table.key(alloc1, b).unwrap();
        assert_eq!(hits(), before);
    }
}

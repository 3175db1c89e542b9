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
/// A handle is found by its shard and slot (dense numbers, [`ResidentBuffer::slot`]) in
/// [`BufferTable::index`], with no hash: a request to a buffer this batch named before costs
/// two loads from the index, a comparison of the handle (generation and allocator included)
/// with its entry's, and no cache line of the allocator's.
///
/// A table is reused by the device's next batches and keeps its entries: the next batch
/// takes a handle's address and length from its entry, without the allocator's lock, as
/// long as the allocator has freed nothing in that handle's shard since the entry was
/// resolved ([`Allocator::frees_in`], read once a batch per shard and compared with the
/// entry's [`Resolved::frees`]). So a buffer named in an earlier batch costs a new batch one
/// lookup, as one named before in the same batch does. A handle freed while a batch is built
/// fails the batch at submit, where every buffer is checked again (`engine::Exec::claim`).
///
/// [`Allocator::frees_in`]: crate::alloc::Allocator::frees_in
#[derive(Default)]
pub(crate) struct BufferTable {
    /// Every buffer the table has resolved, this batch or an earlier one; this batch's have
    /// `batch` equal to the table's.
    pub(crate) entries: Vec<Resolved>,
    /// Per shard, per slot: `key + 1` of the entry made last for a handle of that shard and
    /// slot, 0 for none; the entries made before it for the same shard and slot (an earlier
    /// generation's handle, another allocator's) follow from it through [`Resolved::same`].
    /// Empty until the first entry, then [`SHARDS`] vectors, each as long as the highest slot
    /// of an entry made in its shard: an entry is made only for a handle its allocator
    /// resolved, so the index grows with the allocator's slots, never with a made-up handle.
    index: Vec<Vec<u32>>,
    /// This batch's keys, in the order first named.
    used: Vec<u32>,
    /// This batch's number among the table's batches (never wraps).
    batch: u64,
    /// The allocator's free counts as this batch read them. Boxed: a table moves with its
    /// batch (taken from the device's spares and given back, an empty one left in its
    /// place), and inline the counts would make each move copy a quarter of a kilobyte.
    frees: Option<Box<Frees>>,
    /// Whether the requests so far can skip the planner, and their layout if so.
    pub(crate) apart: Apart,
}

/// From this many requests in order and apart, a batch claims one span per buffer
/// ([`BufferTable::push_ranges`]).
pub(crate) const SPAN_MIN: usize = 256;

/// A table starts afresh at the end of a batch when it holds more than this many entries
/// and more than four times the batch's: entries of buffers no longer named (freed, or
/// only used long ago) would otherwise pile up.
const KEEP_MOST: usize = 1 << 12;

/// Per shard, the count of frees of the allocator `owner` as this batch read it
/// ([`UNREAD`](Frees::UNREAD) until the batch needs it). An entry resolved after the count
/// read `frees` is still true while the count reads `frees`: each read says no free has come
/// in the shard since ([`Allocator::frees_in`](crate::alloc::Allocator::frees_in)). Reading
/// the count again later in a batch reads the same or more; either is a count the entries
/// it validates can be checked against.
struct Frees {
    owner: u32,
    counts: [u64; SHARDS],
}

impl Frees {
    const UNREAD: u64 = u64::MAX;

    /// As made: no allocator, no count read.
    fn reset(&mut self) {
        self.owner = 0;
        self.counts.fill(Frees::UNREAD);
    }
}

impl Default for Frees {
    fn default() -> Frees {
        Frees { owner: 0, counts: [Frees::UNREAD; SHARDS] }
    }
}

/// A buffer as the table resolved it.
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
    /// The last batch that named the buffer.
    batch: u64,
    /// The count of frees in the buffer's shard read before it was resolved ([`Frees`]).
    frees: u64,
    /// `key + 1` of the entry made before this one for a handle of the same shard and slot,
    /// 0 for none ([`BufferTable::index`]).
    same: u32,
}

impl crate::recycle::Reusable for BufferTable {
    fn clear(&mut self) {
        if self.entries.len() > KEEP_MOST.max(4 * self.used.len()) {
            // A table grown by a batch of very many buffers is not kept for small ones.
            if self.index.iter().map(Vec::len).sum::<usize>() > 1 << 16 {
                *self = BufferTable::default();
                return;
            }
            self.entries.clear();
            self.index.iter_mut().for_each(|slots| slots.fill(0));
        }
        self.batch += 1;
        self.used.clear();
        if let Some(frees) = &mut self.frees {
            frees.reset();
        }
        self.apart.clear();
    }
}

#[cfg(test)]
thread_local! {
    /// Buffers this thread's batches took from what an earlier batch resolved.
    pub(crate) static KEPT_HITS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Whether `[offset, offset + len)` lies in a buffer of `buffer_len` bytes (a range whose
/// end overflows does not).
#[inline]
fn in_range(offset: u64, len: u64, buffer_len: u64) -> bool {
    offset.checked_add(len).is_some_and(|end| end <= buffer_len)
}

/// Notes a request of `len` bytes at `offset` of `entry`'s buffer, a range that lies in it,
/// in the batch's layout (`apart`) and in the entry's span.
#[inline(always)]
fn note(apart: &mut Apart, entry: &mut Resolved, offset: u64, len: u64) {
    apart.note(&mut entry.next, entry.ptr, offset, len);
    entry.first = entry.first.min(offset);
}

impl BufferTable {
    /// The key of `buffer`, resolving it on first sight in this batch.
    pub(crate) fn key(
        &mut self,
        alloc: &Allocator<Arc<Context>>,
        buffer: ResidentBuffer,
    ) -> Result<(u32, Resolved)> {
        let found = self.find(buffer);
        if let Some(key) = found
            && (self.entries[key as usize].batch == self.batch || self.revive(alloc, key))
        {
            return Ok((key, self.entries[key as usize]));
        }
        // New to the table, or changed since: resolved by the allocator, after the count of
        // frees is read. A handle of another allocator is refused there.
        let now =
            if buffer.owner == alloc.id() { self.frees_now(alloc, buffer.shard()) } else { Frees::UNREAD };
        let (ptr, len) = alloc.resolve(buffer)?;
        let resolved =
            Resolved { buffer, ptr, len, next: 0, first: u64::MAX, batch: self.batch, frees: now, same: 0 };
        let key = match found {
            Some(key) => {
                let entry = &mut self.entries[key as usize];
                *entry = Resolved { same: entry.same, ..resolved };
                key
            }
            None => self.insert(resolved),
        };
        self.used.push(key);
        Ok((key, self.entries[key as usize]))
    }

    /// Makes entry `key`, resolved by an earlier batch, this batch's if it is still true: its
    /// buffer is `alloc`'s and no free came in its shard since it was resolved. Returns
    /// whether it did. Kept out of line, so that the hot path of [`BufferTable::check`] (a
    /// buffer this batch named before) stays as short as when tables kept nothing (callgrind,
    /// 20 batches of 8192 writes in order on 64 buffers: 276.0M instructions against 276.2M).
    #[inline(never)]
    fn revive(&mut self, alloc: &Allocator<Arc<Context>>, key: u32) -> bool {
        let entry = &self.entries[key as usize];
        let (buffer, frees) = (entry.buffer, entry.frees);
        if buffer.owner != alloc.id() || self.frees_now(alloc, buffer.shard()) != frees {
            return false;
        }
        #[cfg(test)]
        KEPT_HITS.with(|n| n.set(n.get() + 1));
        let batch = self.batch;
        self.entries[key as usize] =
            Resolved { next: 0, first: u64::MAX, batch, ..self.entries[key as usize] };
        self.used.push(key);
        true
    }

    /// The count of frees in shard `shard` of `alloc`, read once a batch (and again when
    /// the batch names buffers of another allocator in between, which only tests do).
    fn frees_now(&mut self, alloc: &Allocator<Arc<Context>>, shard: usize) -> u64 {
        let frees = self.frees.get_or_insert_with(Box::default);
        if frees.owner != alloc.id() {
            frees.reset();
            frees.owner = alloc.id();
        }
        let count = &mut frees.counts[shard];
        if *count == Frees::UNREAD {
            *count = alloc.frees_in(shard);
        }
        *count
    }

    /// `key + 1` of the entry made last for `buffer`'s shard and slot, 0 for none.
    #[inline(always)]
    fn head(&self, buffer: ResidentBuffer) -> u32 {
        self.index.get(buffer.shard()).and_then(|slots| slots.get(buffer.slot())).copied().unwrap_or(0)
    }

    /// The key of `buffer` if the table has it.
    fn find(&self, buffer: ResidentBuffer) -> Option<u32> {
        let mut next = self.head(buffer);
        // `next - 1` wraps for 0 (none) to a key past every entry.
        while let Some(entry) = self.entries.get(next.wrapping_sub(1) as usize) {
            if entry.buffer == buffer {
                return Some(next - 1);
            }
            next = entry.same;
        }
        None
    }

    /// Adds `resolved`, an entry for a handle the table has none for, and returns its key.
    fn insert(&mut self, mut resolved: Resolved) -> u32 {
        let key = self.entries.len() as u32;
        if self.index.is_empty() {
            self.index.resize_with(SHARDS, Vec::new);
        }
        let (slots, slot) = (&mut self.index[resolved.buffer.shard()], resolved.buffer.slot());
        if slots.len() <= slot {
            slots.resize(slot + 1, 0);
        }
        resolved.same = slots[slot];
        slots[slot] = key + 1;
        self.entries.push(resolved);
        key
    }

    /// The key and length of `buffer`, after checking that `[offset, offset + len)` lies in
    /// it. A failure is also kept in `first_error` (when it holds none yet): it fails the
    /// batch at submit.
    #[inline(always)]
    pub(crate) fn check(
        &mut self,
        alloc: &Allocator<Arc<Context>>,
        buffer: ResidentBuffer,
        offset: u64,
        len: u64,
        first_error: &mut Option<Error>,
    ) -> Result<(u32, u64)> {
        match self.hit(buffer, offset, len) {
            Some(found) => Ok(found),
            None => self.check_cold(alloc, buffer, offset, len, first_error),
        }
    }

    /// The hot path of [`BufferTable::check`]: the key and length of `buffer` when this batch
    /// named it before and it is the last handle of its shard and slot that the table
    /// resolved, and `[offset, offset + len)` lies in it; `None` (nothing noted) otherwise,
    /// for `check`'s cold path to decide. No error value is built or moved.
    #[inline(always)]
    pub(crate) fn hit(&mut self, buffer: ResidentBuffer, offset: u64, len: u64) -> Option<(u32, u64)> {
        // `head - 1` wraps for 0 (none) to a key past every entry.
        let key = self.head(buffer).wrapping_sub(1);
        let entry = self.entries.get_mut(key as usize)?;
        if entry.buffer == buffer && entry.batch == self.batch && in_range(offset, len, entry.len) {
            note(&mut self.apart, entry, offset, len);
            return Some((key, entry.len));
        }
        None
    }

    /// [`BufferTable::hit`] for a handle an earlier batch resolved, whose entry still holds
    /// (no free in its shard since, [`BufferTable::revive`]): the key and length, the entry
    /// taken into this batch and the request noted. `None` (nothing changed) for anything
    /// else, for [`BufferTable::check_cold`] to decide. The way of a batch whose every
    /// request names a buffer of its own, in the buffers of the batch before: one lookup, no
    /// error value.
    #[inline(never)]
    pub(crate) fn hit_kept(
        &mut self,
        alloc: &Allocator<Arc<Context>>,
        buffer: ResidentBuffer,
        offset: u64,
        len: u64,
    ) -> Option<(u32, u64)> {
        let key = self.head(buffer).wrapping_sub(1);
        let entry = self.entries.get(key as usize)?;
        if entry.buffer != buffer || entry.batch == self.batch || !in_range(offset, len, entry.len) {
            return None;
        }
        if !self.revive(alloc, key) {
            return None;
        }
        let entry = &mut self.entries[key as usize];
        note(&mut self.apart, entry, offset, len);
        Some((key, entry.len))
    }

    /// [`BufferTable::check`] where [`BufferTable::hit`] found nothing: a buffer first named
    /// in this batch (or named after another handle of its shard and slot), or a bad range.
    #[cold]
    #[inline(never)]
    pub(crate) fn check_cold(
        &mut self,
        alloc: &Allocator<Arc<Context>>,
        buffer: ResidentBuffer,
        offset: u64,
        len: u64,
        first_error: &mut Option<Error>,
    ) -> Result<(u32, u64)> {
        // Resolved by an earlier batch and still true, or by this one: no error value.
        if let Some(key) = self.find(buffer)
            && (self.entries[key as usize].batch == self.batch || self.revive(alloc, key))
        {
            let entry = &mut self.entries[key as usize];
            if in_range(offset, len, entry.len) {
                note(&mut self.apart, entry, offset, len);
                return Ok((key, entry.len));
            }
        }
        let (key, buffer_len) = self.check_slow(alloc, buffer, offset, len, first_error)?;
        note(&mut self.apart, &mut self.entries[key as usize], offset, len);
        Ok((key, buffer_len))
    }

    /// [`BufferTable::check`] for a buffer new to the batch or a bad range.
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

    /// The buffers this batch names, in the order first named.
    pub(crate) fn buffers(&self) -> impl Iterator<Item = ResidentBuffer> + '_ {
        self.named().map(|(_, e)| e.buffer)
    }

    /// This batch's entries and their keys, in the order first named.
    pub(crate) fn named(&self) -> impl Iterator<Item = (u32, &Resolved)> + '_ {
        self.used.iter().map(|&k| (k, &self.entries[k as usize]))
    }

    /// Adds the device range of each of `requests` (key, offset in its buffer, length) to
    /// `ranges`, for `engine::Exec::claim_ranges`. A batch of at least [`SPAN_MIN`] requests
    /// in order and apart ([`Apart`]) claims instead, per buffer, the span from its first
    /// request to the end of its last, gaps included: a conservative claim, with no pass over
    /// the requests (8192 ranges cost a download's submit about 35 µs on the H200 host).
    pub(crate) fn push_ranges(&self, ranges: &mut Ranges, requests: impl Iterator<Item = (u64, u64, u64)>) {
        if !self.apart.broken && self.apart.offsets.len() >= SPAN_MIN {
            for (_, e) in self.named().filter(|(_, e)| e.next > 0) {
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

    /// A kept buffer, named first in a new batch with a range past its end, is refused
    /// there (its kept entry serves in-range requests only) by reads and writes alike; the
    /// batch's other requests still land, and the failed one fails its submit.
    #[test]
    fn a_kept_buffer_named_out_of_range_is_refused_by_writes_and_reads() {
        let d = device(Config::default());
        use_shard(6);
        let (x, y) = (d.allocate(4096).unwrap(), d.allocate(4096).unwrap());
        round(&d, &[x, y]);
        for (offset, len) in [(4096, 1), (0, 4097), (u64::MAX, 1)] {
            let mut writes = d.uploads();
            let data = vec![7u8; len as usize];
            let err = writes.write(x, offset, &data).unwrap_err();
            assert!(matches!(err, Error::OutOfRange { .. }), "write at {offset}+{len}: {err}");
            writes.write(y, 0, &[9; 16]).unwrap();
            assert!(matches!(writes.submit(), Err(Error::OutOfRange { .. })));
        }
        for (offset, len) in [(4096, 1), (0, 4097), (u64::MAX, 1), (1, u64::MAX)] {
            let mut reads = d.downloads();
            let err = reads.read(x, offset, len).unwrap_err();
            assert!(matches!(err, Error::OutOfRange { .. }), "read at {offset}+{len}: {err}");
            reads.read(y, 0, 16).unwrap();
            assert!(matches!(reads.submit(), Err(Error::OutOfRange { .. })));
        }
        assert_eq!(d.download(y).unwrap()[..16], [1; 16], "no refused batch moved anything");
        assert_eq!(round(&d, &[y, x]), 2, "both still kept");
        let mut reads = d.downloads();
        let slot = reads.read(x, 0, 16).unwrap();
        assert_eq!(reads.submit().unwrap().wait().unwrap().get(slot), &[1; 16][..]);
    }

    #[test]
    fn handles_of_one_slot_each_keep_their_own_entry() {
        let d = device(Config::default());
        use_shard(5);
        let old = d.allocate(4096).unwrap();
        let mut batch = d.uploads();
        batch.write(old, 0, &[1; 16]).unwrap();
        d.free(old).unwrap();
        let new = d.allocate(4096).unwrap();
        assert_eq!((new.shard(), new.slot()), (old.shard(), old.slot()), "the slot is handed out again");
        assert_ne!(new, old);
        batch.write(new, 0, &[2; 16]).unwrap();
        // The freed handle, named before its free, is still found (behind the new handle of
        // its slot): taken here, refused at submit, where every buffer is checked again.
        batch.write(old, 16, &[3; 16]).unwrap();
        let err = batch.submit().unwrap_err();
        assert!(matches!(err, Error::FreedBuffer { buffer } if buffer == old), "{err}");
        // The next batch reaches the new handle's buffer through it.
        let mut batch = d.uploads();
        batch.write(new, 0, &[9; 16]).unwrap();
        batch.submit().unwrap().wait().unwrap();
        assert_eq!(d.download(new).unwrap()[..16], [9; 16]);
    }

    #[test]
    fn entries_are_checked_against_their_own_allocator() {
        let driver = model::driver();
        let d0 = Device::open_on_driver(Arc::clone(&driver), 0, Config::default()).unwrap();
        let d1 = Device::open_on_driver(driver, 1, Config::default()).unwrap();
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
        // A batch that names buffers of two allocators: each entry is checked against its
        // own allocator's frees, and a free in one leaves the other's entries valid.
        table.key(alloc0, a).unwrap();
        table.key(alloc1, b).unwrap();
        table.clear();
        let before = hits();
        table.key(alloc0, a).unwrap();
        table.key(alloc1, b).unwrap();
        assert_eq!(hits(), before + 2);
        table.clear();
        use_shard(b.shard());
        let other = d1.allocate(64).unwrap();
        d1.free(other).unwrap();
        let before = hits();
        assert_eq!(table.key(alloc1, b).unwrap().1.ptr, d1.device_ptr(b).unwrap());
        assert_eq!(table.key(alloc0, a).unwrap().1.ptr, d0.device_ptr(a).unwrap());
        assert_eq!(hits(), before + 1, "a kept (another allocator freed), b resolved again");
        table.clear();
        let err = table.key(alloc1, a).unwrap_err();
        assert!(matches!(err, Error::ForeignBuffer { .. }), "{err}");
    }

    #[test]
    fn a_buffer_named_batches_ago_is_kept_and_only_this_batchs_buffers_are_claimed() {
        let d = device(Config::default());
        let (x, y, z) = (d.allocate(4096).unwrap(), d.allocate(4096).unwrap(), d.allocate(4096).unwrap());
        round(&d, &[x, y]);
        round(&d, &[z]);
        assert_eq!(round(&d, &[y, x]), 2, "named two batches ago, nothing freed since: kept");
        // y, named before and freed now, is in the table but not in this batch: the batch
        // neither claims it (which would fail on the freed handle) nor reaches its memory,
        // which a new buffer may hold.
        d.free(y).unwrap();
        let w = d.allocate(4096).unwrap();
        assert_eq!(round(&d, &[x, w]), 0, "a free in the shard: both resolved again");
        let mut batch = d.uploads();
        batch.write(x, 0, &[7; 16]).unwrap();
        batch.submit().unwrap().wait().unwrap();
        assert_eq!(d.download(x).unwrap()[..16], [7; 16]);
        assert_eq!(d.download(w).unwrap()[..16], [1; 16], "w holds what its own batch wrote");
    }

    #[test]
    fn a_table_of_many_buffers_no_longer_named_starts_afresh() {
        let d = device(Config::default());
        let alloc = &d.core().alloc;
        let mut table = BufferTable::default();
        let mut most = 0;
        for _ in 0..3 * super::KEEP_MOST {
            let b = d.allocate(64).unwrap();
            table.key(alloc, b).unwrap();
            table.clear();
            most = most.max(table.entries.len());
            d.free(b).unwrap();
        }
        assert!(most <= super::KEEP_MOST, "entries kept: {most}");
        // A batch of many buffers keeps them all for the next.
        let many: Vec<_> = (0..2 * super::KEEP_MOST).map(|_| d.allocate(64).unwrap()).collect();
        let (mut table, before) = (BufferTable::default(), hits());
        for &b in &many {
            table.key(alloc, b).unwrap();
        }
        table.clear();
        for &b in &many {
            table.key(alloc, b).unwrap();
        }
        assert_eq!(hits() - before, many.len());
    }
}

//! The byte model of the runs layout (`plan::runs`): a batch of items in pinned host memory,
//! laid out into chunks of host-contiguous runs, over-the-bus launches and DMAs, and cut into
//! parts, carried out on one flat model memory (host, device and a staging slot side by side).

use crate::kernels::CopyDescriptor;
use crate::plan::runs::{Direct, Layout, PART_ITEMS, Place, RUN_MIN, Seen, continues, first_part, parts};
use crate::stream::LaneKind;

/// One item of a modelled batch, as the model places it: `gap` host bytes after the previous
/// item (0: it continues the previous one's run, if in the same region), in a new pinned
/// region where `new_region` (the first item opens one), which is mapped for the device (this
/// crate's pinned pool) or only registered (`pin_host`) as the item that opens it says.
#[derive(Clone, Copy, Debug, Default)]
pub struct RunItem {
    /// Bytes of the item.
    pub len: u64,
    /// Host bytes between the previous item's end and this item's start.
    pub gap: u64,
    /// Whether the item starts a new pinned region.
    pub new_region: bool,
    /// Whether a region this item opens is mapped for the device.
    pub mapped: bool,
}

/// Where the model puts `items`: their [`Direct`]s (host from address 0, device ranges apart
/// after the host side, in reverse order) and the end of the device side.
fn place(items: &[RunItem]) -> (Vec<Direct>, u64) {
    let host_end: u64 = items.iter().map(|r| r.gap + r.len).sum();
    let mut dev = host_end + 64;
    let mut devs = vec![0; items.len()];
    for (i, r) in items.iter().enumerate().rev() {
        devs[i] = dev;
        dev += r.len + 16;
    }
    let (mut host, mut region, mut mapped) = (0u64, 0usize, true);
    let mut out = Vec::with_capacity(items.len());
    for (i, r) in items.iter().enumerate() {
        host += r.gap;
        if i == 0 || r.new_region {
            (region, mapped) = (host as usize, r.mapped);
        }
        let place = if mapped { Place::Mapped(region) } else { Place::Pinned(region) };
        out.push(Direct::new(host as usize, devs[i], r.len as usize, place));
        host += r.len;
    }
    (out, dev)
}

/// A byte of the model memory before anything moves.
fn initial(at: usize) -> u8 {
    ((at as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8
}

/// The model memory and how often each byte has been written.
struct Memory {
    bytes: Vec<u8>,
    writes: Vec<u32>,
}

impl Memory {
    fn copy(&mut self, src: u64, dst: u64, len: u64) {
        let (src, dst, len) = (src as usize, dst as usize, len as usize);
        assert!(src + len <= self.bytes.len() && dst + len <= self.bytes.len(), "a copy inside the model");
        self.bytes.copy_within(src..src + len, dst);
        self.writes[dst..dst + len].iter_mut().for_each(|w| *w += 1);
    }

    fn apply(&mut self, descriptors: &[CopyDescriptor]) {
        for d in descriptors {
            assert!(d.len > 0 && d.len <= crate::kernels::SEGMENT, "a descriptor within a segment");
            self.copy(d.src, d.dst, d.len);
        }
    }
}

/// Lays `items` out ([`Layout::new`]) with chunks of `chunk` bytes (at least 1), DMAs from
/// `threshold` (and of their own, even in a run, from `own_dma`), on a GPU with unified
/// addressing where `unified`, small copies over the bus where `bus`, and carries the
/// layout out on the model as the executor does, uploading (`upload`) or downloading: each
/// chunk's host bytes by one DMA into (out of) a staging slot and its descriptors, each bus
/// launch, each DMA. Checks that every byte of every item is
/// moved exactly once and lands where it belongs, that nothing else is written, that every
/// chunk stays within `chunk` bytes, its run and its table, that descriptors are numbered
/// chunks first and then the bus launches, and that the layout counts its submissions.
pub fn execute_runs(
    items: &[RunItem],
    (chunk, threshold, own_dma): (u64, u64, u64),
    unified: bool,
    bus: bool,
    upload: bool,
) {
    let chunk = chunk.max(1);
    let (mut direct, dev_end) = place(items);
    direct.retain(|d| d.len > 0);
    let layout = Layout::new(&direct, chunk, threshold, (unified, bus), own_dma);
    let long = |d: &&Direct| d.len >= own_dma;
    let own = layout.dmas.iter().filter(long).count();
    assert_eq!(own, direct.iter().filter(long).count(), "every item from own_dma by a DMA of its own");
    for c in &layout.chunks {
        let inside = |d: &&Direct| d.host < c.host + c.len as usize && c.host < d.host + d.len as usize;
        assert!(direct.iter().filter(inside).all(|d| d.len < own_dma), "an item of its own DMA in a chunk");
    }
    let staging = dev_end.next_multiple_of(256);
    let size = (staging + chunk) as usize;
    let mut memory = Memory { bytes: (0..size).map(initial).collect(), writes: vec![0; size] };
    let kind = if upload { LaneKind::Upload } else { LaneKind::Download };

    // Descriptors are numbered chunks first, each chunk's within the most of one launch.
    let mut numbered = 0;
    let mut part = Vec::new();
    for (k, c) in layout.chunks.iter().enumerate() {
        assert!(unified, "runs move through staging only with unified addressing");
        assert!(c.len > 0 && c.len <= chunk, "chunk {k} within a chunk of bytes");
        assert_eq!(c.descriptors.start, numbered, "chunk {k} numbered after the one before");
        assert!(c.descriptors.len() <= layout.most, "chunk {k} within its table");
        numbered = c.descriptors.end;
        let run = direct.iter().filter(|d| d.host <= c.host && c.host < d.host + d.len as usize);
        assert!(run.count() == 1, "chunk {k} starts inside an item");
        layout.chunk_descriptors(&direct, k, kind, staging, &mut part);
        assert!(part.iter().map(|d| d.len).sum::<u64>() == c.len, "chunk {k}'s descriptors cover it");
        if upload {
            memory.copy(c.host as u64, staging, c.len);
            memory.apply(&part);
        } else {
            let slot = staging as usize..(staging + c.len) as usize;
            memory.writes[slot.clone()].iter_mut().for_each(|w| *w = 0);
            memory.apply(&part);
            assert!(memory.writes[slot].iter().all(|&w| w == 1), "chunk {k}'s slot filled once");
            memory.copy(staging, c.host as u64, c.len);
        }
    }
    assert_eq!(layout.bus_from, numbered, "bus launches numbered after the chunks");
    assert!(bus || layout.bus_groups.is_empty(), "no bus launch unless allowed");
    let mut from = 0;
    for (g, group) in layout.bus_groups.iter().enumerate() {
        assert!(group.start == from && !group.is_empty(), "bus launch {g} follows the one before");
        from = group.end;
        let bytes = layout.bus_descriptors(g, kind, &mut part);
        assert_eq!(bytes, part.iter().map(|d| d.len).sum::<u64>());
        numbered += part.len();
        for d in &part {
            let host = if upload { d.src } else { d.dst } as usize;
            let item = direct.iter().find(|i| i.host <= host && host < i.host + i.len as usize);
            let item = item.expect("a bus copy inside an item");
            assert!(item.mapped() && item.len < threshold, "only small mapped items over the bus");
        }
        memory.apply(&part);
    }
    assert_eq!(layout.count, numbered, "descriptors counted");
    for d in &layout.dmas {
        let (src, dst) = if upload { (d.host as u64, d.dev) } else { (d.dev, d.host as u64) };
        memory.copy(src, dst, d.len);
    }
    let chunks = if layout.chunks.is_empty() { 0 } else { layout.chunks.len() + 1 };
    let expected = chunks + layout.bus_groups.len() + usize::from(!layout.dmas.is_empty());
    assert_eq!(layout.submissions(), expected as u64, "submissions counted");

    // Every byte of every item moved exactly once, to its place; nothing else written.
    let mut owned = vec![false; staging as usize];
    for (i, d) in direct.iter().enumerate() {
        let (host, dev, len) = (d.host, d.dev as usize, d.len as usize);
        let (src, dst) = if upload { (host, dev) } else { (dev, host) };
        assert!(memory.writes[dst..dst + len].iter().all(|&w| w == 1), "item {i} moved exactly once");
        let expected: Vec<u8> = (src..src + len).map(initial).collect();
        assert!(memory.bytes[dst..dst + len] == expected[..], "item {i}'s bytes");
        owned[dst..dst + len].iter_mut().for_each(|o| *o = true);
    }
    let stray = memory.writes[..staging as usize].iter().zip(&owned).position(|(&w, &o)| w > 0 && !o);
    assert_eq!(stray, None, "a byte outside every item written");
}

/// Cuts `items` (placed as [`execute_runs`] places them) into [`parts`] for chunks of `chunk`
/// bytes, `moved` parts having moved before, and checks the cuts against their rule: the
/// parts cover the items in order, at most three in all; each part but the last ends at the
/// first item where it is due (past `chunk << k` bytes or `PART_ITEMS << k` items, `k` the
/// parts before it) and a cut leaves the run it falls in as pieces of at least `RUN_MIN`
/// bytes on both sides; the last part is one where no such item comes. Then that
/// [`first_part`], looking at one item at a time (empty items included), finds the first
/// part exactly where it is at most twice `PART_ITEMS` items and not the whole batch, and
/// that the parts of the rest are the whole batch's.
pub fn check_parts(items: &[RunItem], chunk: u64, moved: usize) {
    let chunk = chunk.clamp(1, 1 << 40);
    let (all, _) = place(items);
    let direct: Vec<Direct> = all.iter().filter(|d| d.len > 0).copied().collect();
    let got = parts(&direct, chunk, moved);
    let n = direct.len();
    if n == 0 {
        assert!(got.is_empty(), "no items, no part");
        return;
    }
    // The bytes of each item's run from it to the run's end.
    let mut rest = vec![0; n + 1];
    for i in (0..n).rev() {
        rest[i] = direct[i].len + if i + 1 < n && continues(&direct, i) { rest[i + 1] } else { 0 };
    }
    let mut start = 0;
    for (k, p) in got.iter().enumerate() {
        assert!(p.start == start && p.end > p.start, "part {k} follows the one before");
        let shift = moved + k;
        let (mut bytes, mut run) = (0, 0);
        let mut cut = None;
        for i in p.start..n {
            bytes += direct[i].len;
            run = if i > p.start && continues(&direct, i - 1) { run + direct[i].len } else { direct[i].len };
            if shift >= 2 || i + 1 == n {
                continue;
            }
            let due = bytes >= chunk << shift || i + 1 - p.start >= PART_ITEMS << shift;
            let whole = !continues(&direct, i) || (run >= RUN_MIN && rest[i + 1] >= RUN_MIN);
            if due && whole {
                cut = Some(i + 1);
                break;
            }
        }
        assert_eq!(p.end, cut.unwrap_or(n), "part {k} ends at the first cut its rule allows");
        start = p.end;
    }
    assert_eq!(start, n, "the parts cover every item");
    assert!(got.len() <= 3, "three parts at most");

    if moved > 0 {
        return;
    }
    let seen = |i: usize| if all[i].len == 0 { Seen::Empty } else { Seen::Mapped(all[i]) };
    let first = first_part(all.len(), chunk, seen);
    let expect = got.len() >= 2 && got[0].len() <= 2 * PART_ITEMS;
    assert_eq!(first.is_some(), expect, "a first part exactly where parts cuts a short one");
    if let Some((part, end)) = first {
        let took = all[..end].iter().filter(|d| d.len > 0).count();
        assert_eq!(took, got[0].end, "the first part's items");
        assert!(part.iter().zip(&direct).all(|(a, b)| (a.host, a.len) == (b.host, b.len)));
        let later: Vec<_> =
            parts(&direct[took..], chunk, 1).into_iter().map(|r| r.start + took..r.end + took).collect();
        assert_eq!(later, got[1..], "the rest cut as the whole was");
    }
}

//! The layout of scoped batches ([`super::runs`]): parts, chunks, launches.

use super::runs::{Direct, Layout, PART_ITEMS, Place, RUN_MIN, Seen, first_part, parts};
use crate::stream::LaneKind;

/// A part ends inside a host-contiguous run only where both pieces are runs themselves
/// (`RUN_MIN` or more), whatever the item count says: 5000 items of 512 B in one run of
/// 2.5 MiB, and runs of other lengths around it.
#[test]
fn parts_do_not_cut_a_run_into_pieces_shorter_than_a_run() {
    let mut rng = fastrand::Rng::with_seed(8);
    for round in 0..200 {
        let mut items = Vec::new();
        let mut host = 1usize << 40;
        let n = if round == 0 { 5000 } else { rng.usize(1..6000) };
        for _ in 0..n {
            if round > 0 && rng.u16(..500) == 0 {
                host += 4096;
            }
            let len = if round == 0 { 512 } else { rng.u64(64..4096) };
            items.push(Direct { host, dev: 0, len, place: Place::Pinned(0) });
            host += len as usize;
        }
        let chunk = [16u64 << 20, 1 << 20, 64 << 10][round % 3];
        let p = parts(&items, chunk, 0);
        assert_eq!(p.iter().map(|r| r.len()).sum::<usize>(), items.len());
        for w in p.windows(2) {
            let (part, cut) = (w[0].start, w[1].start);
            if !super::runs::continues(&items, cut - 1) {
                continue;
            }
            // The run's piece in the part before the cut, and the rest of the run.
            let mut before = 0;
            let mut j = cut;
            while j > part && (j == cut || super::runs::continues(&items, j - 1)) {
                j -= 1;
                before += items[j].len;
            }
            let mut after = items[cut].len;
            let mut k = cut;
            while k + 1 < items.len() && super::runs::continues(&items, k) {
                k += 1;
                after += items[k].len;
            }
            assert!(before >= RUN_MIN && after >= RUN_MIN, "round {round}: a cut at {cut}");
        }
    }
}

/// Parts cover every item once, in order; at most three; the first ends at the first
/// item past a chunk of bytes or `PART_ITEMS` items, the second past twice that.
#[test]
fn parts_cover_the_items_in_order_the_first_small() {
    assert!(parts(&[], 1 << 20, 0).is_empty());
    let mut rng = fastrand::Rng::with_seed(5);
    for _ in 0..200 {
        let chunk = rng.u64(1..4 << 20);
        let items: Vec<Direct> = (0..rng.usize(1..6000))
            .map(|_| Direct { host: 0, dev: 0, len: rng.u64(1..64 << 10), place: Place::Mapped(0) })
            .collect();
        let p = parts(&items, chunk, 0);
        assert!((1..=3).contains(&p.len()));
        assert_eq!(p[0].start, 0);
        assert_eq!(p.last().unwrap().end, items.len());
        assert!(p.windows(2).all(|w| w[0].end == w[1].start && w[0].start < w[0].end));
        for (k, part) in p.iter().enumerate().take(p.len() - 1) {
            let (count, bytes) = (part.len(), items[part.clone()].iter().map(|d| d.len).sum::<u64>());
            let before = &items[part.start..part.end - 1];
            let under =
                before.iter().map(|d| d.len).sum::<u64>() < chunk << k && before.len() < PART_ITEMS << k;
            assert!(under, "part {k} went past its first boundary");
            assert!(bytes >= chunk << k || count >= PART_ITEMS << k, "part {k} ended early");
        }
    }
}

/// The first part cut off a batch's front, seeing one item at a time, is the first part
/// `parts` cuts from the whole batch (empty items skipped, gaps between runs, arenas that
/// abut in host memory, items of exactly a run, chunks smaller than an item, counts at
/// the edges of `PART_ITEMS`), and `parts` of the rest, told that one part moved, cuts it
/// as it cut the whole; it looks at no item more than three times. An item of that first
/// part outside this crate's pinned memory leaves the batch whole (or ends the first part
/// before it); an item past it does not matter.
#[test]
fn the_first_part_cut_off_the_front_is_the_one_parts_cuts_from_the_whole() {
    let mut rng = fastrand::Rng::with_seed(12);
    let mut cut = 0;
    for round in 0..1200 {
        let mut all: Vec<Option<Direct>> = Vec::new();
        let (mut host, mut arena) = (1usize << 40, 0);
        let n =
            if round % 2 == 0 { rng.usize(1..5000) } else { [1023, 1024, 1025, 2047, 2048, 2049][round % 6] };
        for _ in 0..n {
            if rng.u16(..40) == 0 {
                all.push(None);
                continue;
            }
            match rng.u16(..[3000, 300, 30][round % 3]) {
                0 => host += 4096,
                1 => arena += 1,
                _ => {}
            }
            let len = match round % 7 {
                0 => rng.u64(1..=64),
                1 => 1024,
                2 => rng.u64(1..=4096),
                3 => rng.u64(1..=64 << 10),
                4 => [RUN_MIN / 2, RUN_MIN - 1, RUN_MIN, 1, 512][rng.usize(..5)],
                _ => rng.u64(1..=1 << 20),
            };
            all.push(Some(Direct { host, dev: host as u64, len, place: Place::Mapped(arena) }));
            host += len as usize;
        }
        let direct: Vec<Direct> = all.iter().flatten().copied().collect();
        let chunk = [16u64 << 20, 1 << 20, 64 << 10, 7777, 1][round % 5];
        let whole = parts(&direct, chunk, 0);
        let seen = |i: usize| all[i].map_or(Seen::Empty, Seen::Mapped);
        let mut looks = 0;
        let counted = first_part(all.len(), chunk, |i| {
            looks += 1;
            seen(i)
        });
        assert!(looks <= 3 * all.len(), "round {round}: {looks} looks at {} items", all.len());
        match counted {
            Some((items, end)) => {
                cut += 1;
                assert!(whole.len() >= 2 && all[end - 1].is_some(), "round {round}");
                let took = all[..end].iter().flatten().count();
                assert_eq!(took, whole[0].end, "round {round}: the first part's items");
                assert!(items.iter().zip(&direct).all(|(a, b)| (a.host, a.len) == (b.host, b.len)));
                let rest: Vec<_> = parts(&direct[took..], chunk, 1)
                    .into_iter()
                    .map(|r| r.start + took..r.end + took)
                    .collect();
                assert_eq!(rest, whole[1..], "round {round}: the rest's parts");
                // Another item in the first part: the batch stays whole; past it: no change.
                let at = rng.usize(..end);
                let elsewhere = |i: usize| if i == at { Seen::Elsewhere } else { seen(i) };
                let cut_before = first_part(all.len(), chunk, elsewhere).is_none_or(|f| f.1 <= at);
                assert!(cut_before, "round {round}: a first part over an item elsewhere");
                let later = |i: usize| if i == end { Seen::Elsewhere } else { seen(i) };
                assert_eq!(first_part(all.len(), chunk, later).map(|f| f.1), Some(end), "round {round}");
            }
            None => assert!(
                whole.len() < 2 || whole[0].len() > 2 * PART_ITEMS,
                "round {round}: no first part, but parts cut {whole:?}"
            ),
        }
    }
    assert!(cut > 400, "{cut} batches of 1200 had a first part cut off");
}

/// A run already past `RUN_MIN` when the first part is due, whose rest is shorter than a
/// run, is looked ahead once, not once an item: 2000 items of 1 KiB in one run, then
/// others apart.
#[test]
fn a_short_rest_of_a_run_is_looked_ahead_once() {
    let item = |i: usize| {
        let host = (1usize << 40) + i * 1024 + if i >= 2000 { 4096 } else { 0 };
        Direct { host, dev: 0, len: 1024, place: Place::Mapped(0) }
    };
    assert!(PART_ITEMS as u64 * 1024 >= RUN_MIN && (2000 - PART_ITEMS as u64) * 1024 < RUN_MIN);
    let mut calls = 0;
    let (items, end) = first_part(3000, 16 << 20, |i| {
        calls += 1;
        Seen::Mapped(item(i))
    })
    .expect("a first part, cut where the run ends");
    assert_eq!((items.len(), end), (2000, 2000));
    assert!(calls <= 2 * 2001, "{calls} looks at 2001 items");
}

/// Every item's bytes are covered exactly once by chunk descriptors, bus descriptors or
/// DMAs; chunk descriptors stay within their chunk; chunks are host-contiguous pieces.
#[test]
fn a_layout_moves_every_byte_once_inside_its_chunks_and_no_kernel_touches_registered_memory() {
    let mut rng = fastrand::Rng::with_seed(9);
    for round in 0..300 {
        let chunk = [64u64 << 10, 1 << 20, (3 << 20) | 17][round % 3];
        let threshold = [0u64, 4096, 256 << 10][round % 3];
        let n = rng.usize(1..200);
        let mut items = Vec::new();
        let mut host = 1usize << 40;
        let mut dev = 1u64 << 30;
        for _ in 0..n {
            let len = if rng.bool() { rng.u64(1..300_000) } else { rng.u64(1..40_000) };
            if rng.u8(..10) == 0 {
                host += rng.usize(1..100);
            }
            dev += rng.u64(0..5000);
            let place = if rng.u8(..8) != 0 { Place::Mapped(1) } else { Place::Pinned(0) };
            items.push(Direct { host, dev, len, place });
            host += len as usize;
            dev += len;
        }
        for kind in [LaneKind::Upload, LaneKind::Download] {
            let bus = rng.bool();
            let unified = bus || rng.bool();
            let layout = Layout::new(&items, chunk, threshold, (unified, bus), u64::MAX);
            // Device bytes -> host bytes, as moved.
            let mut moved: Vec<(u64, u64, u64)> = Vec::new(); // (dev, host, len)
            let (mut part, mut counted) = (Vec::new(), 0);
            for (k, c) in layout.chunks.iter().enumerate() {
                assert!(c.len <= chunk && c.len > 0);
                assert_eq!(c.descriptors.start, counted, "chunks' descriptors follow each other");
                layout.chunk_descriptors(&items, k, kind, 0, &mut part);
                assert_eq!(part.len(), c.descriptors.len(), "as counted");
                counted = c.descriptors.end;
                for d in &part {
                    let (slot, dev) = if kind == LaneKind::Upload { (d.src, d.dst) } else { (d.dst, d.src) };
                    assert!(slot + d.len <= c.len, "descriptor past its chunk");
                    moved.push((dev, c.host as u64 + slot, d.len));
                }
            }
            assert_eq!(layout.bus_from, counted);
            let (mut bus_part, mut group) = (Vec::new(), Vec::new());
            for g in 0..layout.bus_groups.len() {
                layout.bus_descriptors(g, kind, &mut group);
                bus_part.extend_from_slice(&group);
            }
            assert_eq!(layout.bus_from + bus_part.len(), layout.count, "as counted");
            for d in &bus_part {
                let (host, dev) = if kind == LaneKind::Upload { (d.src, d.dst) } else { (d.dst, d.src) };
                moved.push((dev, host, d.len));
            }
            for d in &layout.dmas {
                moved.push((d.dev, d.host as u64, d.len));
            }
            // Every moved piece maps device to host as some item does, and every item's
            // bytes are moved exactly once.
            let total: u64 = items.iter().map(|d| d.len).sum();
            assert_eq!(moved.iter().map(|m| m.2).sum::<u64>(), total);
            for &(dev, hostp, len) in &moved {
                let it = items
                    .iter()
                    .find(|d| dev >= d.dev && dev + len <= d.dev + d.len)
                    .expect("a piece inside one item");
                assert_eq!(hostp - it.host as u64, dev - it.dev, "host/device offsets disagree");
                if !it.mapped() && bus {
                    // registered memory: no kernel may touch it
                    assert!(bus_part.iter().all(|d| {
                        let h = if kind == LaneKind::Upload { d.src } else { d.dst };
                        !(h >= it.host as u64 && h < it.host as u64 + it.len)
                    }));
                }
            }
            let _ = layout.submissions();
        }
    }
}

/// However small the items, no launch takes more than [`Layout::most`] descriptors (its
/// pinned table stays within half a chunk): a run of 16-byte items is cut into chunks by
/// descriptors before bytes, and scattered small items into several bus launches; every
/// byte is still described once, in order.
#[test]
fn no_launch_of_tiny_items_takes_a_table_past_half_a_chunk() {
    let chunk = 64u64 << 10;
    let most = crate::plan::chunk_descriptors_most(chunk) as usize;
    assert_eq!(most, (32 << 10) / 24);
    // A run of 1.5 MiB in 16-byte items, then 5000 scattered 8-byte items.
    let mut items = Vec::new();
    let (mut host, mut dev) = (1usize << 40, 1u64 << 30);
    for _ in 0..(3 << 16) {
        items.push(Direct { host, dev, len: 16, place: Place::Mapped(1) });
        (host, dev) = (host + 16, dev + 32);
    }
    for _ in 0..5000 {
        host += 64;
        items.push(Direct { host, dev, len: 8, place: Place::Mapped(1) });
        (host, dev) = (host + 8, dev + 8);
    }
    for kind in [LaneKind::Upload, LaneKind::Download] {
        let layout = Layout::new(&items, chunk, 4096, (true, true), u64::MAX);
        assert_eq!(layout.most, most);
        assert!(layout.chunks.len() >= (3 << 16) / most, "{} chunks", layout.chunks.len());
        let mut part = Vec::new();
        let mut next_dev = 1u64 << 30;
        for (k, c) in layout.chunks.iter().enumerate() {
            assert!(c.descriptors.len() <= most && c.len <= chunk);
            layout.chunk_descriptors(&items, k, kind, 0, &mut part);
            assert_eq!(part.len(), c.descriptors.len());
            for d in &part {
                let dv = if kind == LaneKind::Upload { d.dst } else { d.src };
                assert_eq!((dv, d.len), (next_dev, 16), "in order, each item once");
                next_dev += 32;
            }
        }
        assert!(layout.bus_groups.len() > 5000 / most);
        let mut described = 0;
        for g in 0..layout.bus_groups.len() {
            let bytes = layout.bus_descriptors(g, kind, &mut part);
            assert!(!part.is_empty() && part.len() <= most);
            assert_eq!(bytes, 8 * part.len() as u64);
            described += part.len();
        }
        assert_eq!(described, 5000);
        let launches = layout.chunks.len() + 1 + layout.bus_groups.len();
        assert_eq!(layout.submissions(), launches as u64);
    }
}

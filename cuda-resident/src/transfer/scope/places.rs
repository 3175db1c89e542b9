//! Where a scoped batch's host memory lies: in pinned memory of this crate (found in the
//! registry of lent buffers), in memory pinned by `Device::pin_host` (asked of the driver,
//! for runs only), or elsewhere (staged).

use crate::engine::core::Core;
use crate::error::Result;
use crate::host_pool::lent_extent;
use crate::plan::runs::{Direct, Place, RUN_MIN, Seen};

/// The [`Place`] of each of `hosts` (address and length, in the batch's order; an empty one
/// is staged, which moves nothing). Pinned memory of this crate is found in the registry of
/// lent buffers; other memory is asked of the driver only for runs of contiguous items of at
/// least [`RUN_MIN`] bytes, once per pinned region met (so pageable items cost no driver
/// call each). No run crosses from one arena or registration into another.
pub(super) fn places(core: &Core, hosts: &[(usize, usize)]) -> Result<Vec<Place>> {
    let mut lent = Lent::default();
    let mut places: Vec<Place> = hosts
        .iter()
        .map(|&(ptr, len)| match lent.arena(ptr, len) {
            Some(start) if len > 0 => Place::Mapped(start),
            _ => Place::Staged,
        })
        .collect();
    let mut i = 0;
    while i < hosts.len() {
        if places[i] != Place::Staged || hosts[i].1 == 0 {
            i += 1;
            continue;
        }
        let (start, mut end, mut j) = (hosts[i].0, hosts[i].0 + hosts[i].1, i + 1);
        while j < hosts.len() && places[j] == Place::Staged && hosts[j].1 > 0 && hosts[j].0 == end {
            end += hosts[j].1;
            j += 1;
        }
        if (end - start) as u64 >= RUN_MIN {
            registered(core, &hosts[i..j], &mut places[i..j])?;
        }
        i = j;
    }
    Ok(places)
}

/// Marks the items of a run that lie whole in one pinned region the driver reports (its
/// start and size) as [`Place::Pinned`]; the others stay staged. One driver call per region
/// met, plus one for a run that is not pinned at all.
fn registered(core: &Core, hosts: &[(usize, usize)], places: &mut [Place]) -> Result<()> {
    let raw = core.ctx.bind()?;
    let mut region: Option<(usize, usize)> = None;
    for (&(ptr, len), place) in hosts.iter().zip(places) {
        let inside = |(from, to): (usize, usize)| ptr >= from && ptr + len <= to;
        if !region.is_some_and(inside) {
            region = match raw.pinned_extent(ptr as *const u8)? {
                // An extent that holds the item's first byte; a driver that gives none
                // leaves the item staged.
                Some((from, bytes)) if from <= ptr as u64 && from.saturating_add(bytes) > ptr as u64 => {
                    Some((from as usize, from.saturating_add(bytes) as usize))
                }
                Some(_) => None,
                // Not pinned: neither is the rest of a run that starts pageable, as a rule.
                None if region.is_none() => return Ok(()),
                None => None,
            };
        }
        if let Some(extent) = region.filter(|&e| inside(e)) {
            *place = Place::Pinned(extent.0);
        }
    }
    Ok(())
}

/// Finds whether host ranges lie in pinned memory of this crate, remembering the last arena
/// found (a batch's ranges mostly lie in one host cache) and the last span found to hold
/// none (a pageable cache's ranges then cost one registry lookup, not one each). Memory lent
/// while a batch is classified may be taken for unlisted: it is staged, which moves any
/// memory.
#[derive(Default)]
pub(super) struct Lent {
    arena: Option<(usize, usize)>,
    gap: Option<(usize, usize)>,
}

impl Lent {
    /// What [`first_part`](crate::plan::runs::first_part) sees of an item of `len` bytes at host
    /// `host`, to or from device address `dev`.
    pub(super) fn seen(&mut self, host: usize, len: usize, dev: u64) -> Seen {
        if len == 0 {
            return Seen::Empty;
        }
        match self.arena(host, len) {
            Some(start) => Seen::Mapped(Direct::new(host, dev, len, Place::Mapped(start))),
            None => Seen::Elsewhere,
        }
    }

    /// The start of the arena of this crate that holds all of `[ptr, ptr + len)`.
    fn arena(&mut self, ptr: usize, len: usize) -> Option<usize> {
        let end = ptr.saturating_add(len);
        let inside = |(start, bytes): (usize, usize)| ptr >= start && end <= start.saturating_add(bytes);
        if let Some(arena) = self.arena.filter(|&a| inside(a)) {
            return Some(arena.0);
        }
        if self.gap.is_some_and(|(from, to)| ptr >= from && ptr < to) {
            return None;
        }
        match lent_extent(ptr) {
            Ok(arena) => {
                self.arena = Some(arena);
                inside(arena).then_some(arena.0)
            }
            Err(gap) => {
                self.gap = Some(gap);
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Lent;
    use crate::testing::device;

    /// Ranges in a pinned buffer find its arena; pageable ones find a span without one,
    /// which answers the next pageable ranges in it without asking the registry (a second
    /// lookup there could not say otherwise); a range that starts in the arena and ends
    /// past it is not in it.
    #[test]
    fn lent_ranges_find_their_arena_and_pageable_ones_a_gap() {
        let d = device(crate::Config::default());
        let pinned = d.pinned(1 << 20).unwrap();
        let pageable = vec![7u8; 1 << 20];
        let (p, q) = (pinned.as_ptr() as usize, pageable.as_ptr() as usize);
        let mut lent = Lent::default();
        let arena = lent.arena(p, 4096).expect("in the pool's arena");
        assert!(arena <= p);
        assert_eq!(lent.arena(p + 8192, 100), Some(arena), "remembered");
        assert_eq!(lent.arena(q, 4096), None);
        let (from, to) = lent.gap.expect("a gap remembered");
        assert!(from <= q && q < to && !(from..to).contains(&p), "{from:#x}..{to:#x}");
        assert_eq!(lent.arena(q + 4096, 4096), None);
        let (start, bytes) = lent.arena.unwrap();
        assert_eq!(lent.arena(start + bytes - 10, 20), None, "past the arena's end");
        assert_eq!(lent.arena(p, 4096), Some(arena), "still found after a gap");
        drop(pinned);
    }
}

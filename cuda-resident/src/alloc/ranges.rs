//! Best-fit allocation of byte ranges inside slabs, with coalescing.
//!
//! Pure bookkeeping over offsets: it never touches memory. Free ranges are indexed twice, by
//! position (to merge a freed range with its neighbours) and by size (to find the smallest
//! range that fits). Ranges never merge across slabs, even when two slabs happen to be
//! adjacent in the address space, so that an empty slab can be handed back whole.

use std::collections::{BTreeMap, BTreeSet};

/// A slab's index in the allocator's slab table.
pub type SlabId = u32;

/// Free ranges over any number of slabs.
#[derive(Debug, Default)]
pub struct Ranges {
    /// `(slab, offset) -> len`
    by_position: BTreeMap<(SlabId, u64), u64>,
    /// `(len, slab, offset)`
    by_size: BTreeSet<(u64, SlabId, u64)>,
    free_bytes: u64,
}

impl Ranges {
    /// Adds a new, entirely free slab of `len` bytes.
    pub fn add_slab(&mut self, slab: SlabId, len: u64) {
        self.insert(slab, 0, len);
    }

    /// Removes a slab that is entirely free. Returns false (and changes nothing) otherwise.
    pub fn remove_slab_if_free(&mut self, slab: SlabId, len: u64) -> bool {
        if self.by_position.get(&(slab, 0)) != Some(&len) {
            return false;
        }
        self.remove(slab, 0, len);
        true
    }

    /// Takes the smallest free range of at least `len` bytes and returns `(slab, offset)` of
    /// its first `len` bytes; the rest stays free.
    pub fn allocate(&mut self, len: u64) -> Option<(SlabId, u64)> {
        let &(found, slab, offset) = self.by_size.range((len, 0, 0)..).next()?;
        self.remove(slab, offset, found);
        if found > len {
            self.insert(slab, offset + len, found - len);
        }
        Some((slab, offset))
    }

    /// Returns `[offset, offset + len)` of `slab`, merging it with free neighbours.
    pub fn free(&mut self, slab: SlabId, mut offset: u64, mut len: u64) {
        if let Some((&(s, prev_offset), &prev_len)) = self.by_position.range(..(slab, offset)).next_back()
            && s == slab
            && prev_offset + prev_len == offset
        {
            self.remove(slab, prev_offset, prev_len);
            offset = prev_offset;
            len += prev_len;
        }
        if let Some(&next_len) = self.by_position.get(&(slab, offset + len)) {
            self.remove(slab, offset + len, next_len);
            len += next_len;
        }
        self.insert(slab, offset, len);
    }

    /// Free bytes across all slabs.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// The largest free range.
    pub fn largest(&self) -> u64 {
        self.by_size.last().map_or(0, |&(len, _, _)| len)
    }

    fn insert(&mut self, slab: SlabId, offset: u64, len: u64) {
        debug_assert!(len > 0);
        self.by_position.insert((slab, offset), len);
        self.by_size.insert((len, slab, offset));
        self.free_bytes += len;
    }

    fn remove(&mut self, slab: SlabId, offset: u64, len: u64) {
        self.by_position.remove(&(slab, offset));
        self.by_size.remove(&(len, slab, offset));
        self.free_bytes -= len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_picks_the_smallest_range_that_fits() {
        let mut r = Ranges::default();
        r.add_slab(0, 1000);
        r.add_slab(1, 300);
        assert_eq!(r.allocate(200), Some((1, 0)));
        assert_eq!(r.allocate(200), Some((0, 0)));
        assert_eq!(r.allocate(100), Some((1, 200)));
        assert_eq!(r.allocate(900), None);
        assert_eq!(r.free_bytes(), 800);
        assert_eq!(r.largest(), 800);
    }

    #[test]
    fn freeing_coalesces_with_both_neighbours_and_a_free_slab_can_be_removed() {
        let mut r = Ranges::default();
        r.add_slab(7, 300);
        let a = r.allocate(100).unwrap();
        let b = r.allocate(100).unwrap();
        let c = r.allocate(100).unwrap();
        assert!(!r.remove_slab_if_free(7, 300));
        r.free(a.0, a.1, 100);
        r.free(c.0, c.1, 100);
        r.free(b.0, b.1, 100);
        assert_eq!(r.largest(), 300);
        assert!(r.remove_slab_if_free(7, 300));
        assert_eq!(r.free_bytes(), 0);
    }

    #[test]
    fn ranges_never_merge_across_slabs() {
        let mut r = Ranges::default();
        r.add_slab(0, 100);
        r.add_slab(1, 100);
        assert_eq!(r.largest(), 100);
        assert_eq!(r.allocate(150), None);
    }

    /// Random allocate/free sequences against a byte-ownership model: no range is handed out
    /// twice, and freeing everything restores whole slabs.
    #[test]
    fn random_sequences_keep_ranges_disjoint() {
        let mut rng = fastrand::Rng::with_seed(11);
        for _ in 0..50 {
            let mut r = Ranges::default();
            let slabs = [(0u32, 4096u64), (1, 1024), (2, 8192)];
            for (id, len) in slabs {
                r.add_slab(id, len);
            }
            let mut owned = vec![vec![false; 8192]; 3];
            let mut live: Vec<(SlabId, u64, u64)> = Vec::new();
            for _ in 0..400 {
                if rng.bool() || live.is_empty() {
                    let len = rng.u64(1..600);
                    if let Some((slab, offset)) = r.allocate(len) {
                        for b in &mut owned[slab as usize][offset as usize..(offset + len) as usize] {
                            assert!(!*b, "byte handed out twice");
                            *b = true;
                        }
                        live.push((slab, offset, len));
                    }
                } else {
                    let (slab, offset, len) = live.swap_remove(rng.usize(..live.len()));
                    owned[slab as usize][offset as usize..(offset + len) as usize].fill(false);
                    r.free(slab, offset, len);
                }
                let used: u64 = live.iter().map(|l| l.2).sum();
                assert_eq!(r.free_bytes() + used, 4096 + 1024 + 8192);
            }
            for (slab, offset, len) in live.drain(..) {
                r.free(slab, offset, len);
            }
            for (id, len) in slabs {
                assert!(r.remove_slab_if_free(id, len));
            }
        }
    }
}

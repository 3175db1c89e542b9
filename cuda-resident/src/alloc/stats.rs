//! The resident store's statistics: [`AllocatorStats`] and the sums that fill it.

use std::sync::atomic::Ordering;

use super::{Allocator, DeviceMemory};
use crate::sync::lock;

/// Statistics of the resident store.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct AllocatorStats {
    /// Callers' live buffers.
    pub buffers: u64,
    /// Bytes callers asked for, over their live buffers ([`Device::allocated_bytes`](crate::Device::allocated_bytes)).
    pub allocated_bytes: u64,
    /// Bytes of the library's own live buffers: device staging of the two lanes, prepared
    /// sets' descriptor tables. Not in `allocated_bytes`; held under the same budget.
    pub library_bytes: u64,
    /// The library's own live buffers.
    pub library_buffers: u64,
    /// Bytes the live buffers occupy (size classes round up).
    pub footprint_bytes: u64,
    /// Bytes held from the driver (slabs and dedicated allocations).
    pub reserved_bytes: u64,
    /// The most bytes ever held from the driver at once.
    pub peak_reserved_bytes: u64,
    /// Number of slabs held.
    pub slabs: u64,
    /// Bytes in dedicated allocations, kept ones included.
    pub dedicated_bytes: u64,
    /// Bytes of freed dedicated allocations kept for reuse (part of `dedicated_bytes`):
    /// the next allocation of a size they fit takes one without a driver call; trim gives
    /// them back.
    pub kept_bytes: u64,
    /// Bytes in free size-class caches (kept dedicated blocks are `kept_bytes`).
    pub cached_bytes: u64,
    /// Free bytes inside slabs.
    pub slab_free_bytes: u64,
    /// The largest free range inside a slab.
    pub largest_free_range: u64,
    /// Bytes freed by the caller but still in use by copies in flight.
    pub deferred_bytes: u64,
    /// The share of reserved memory that holds no requested byte:
    /// `1 - (allocated + library) / reserved` (0 when nothing is reserved).
    pub fragmentation: f64,
    /// Allocations served (all paths).
    pub allocations: u64,
    /// Frees.
    pub frees: u64,
    /// Frees deferred because a copy still used the buffer.
    pub deferred_frees: u64,
    /// `cuMemAlloc` calls (slabs and dedicated).
    pub driver_allocations: u64,
    /// `cuMemFree` calls.
    pub driver_frees: u64,
    /// Times cached memory was released (on pressure or by `Device::trim`).
    pub trims: u64,
    /// Allocations refused by the budget.
    pub budget_refusals: u64,
}

impl<M: DeviceMemory> Allocator<M> {
    /// Bytes requested by live buffers. Lock-free.
    pub(crate) fn allocated_bytes(&self) -> u64 {
        self.shards.iter().map(|c| c.allocated.load(Ordering::Relaxed)).sum()
    }

    pub(crate) fn stats(&self) -> AllocatorStats {
        let mut stats = AllocatorStats::default();
        for cell in self.shards.iter() {
            let shard = lock(&cell.state);
            stats.buffers += shard.slots.iter().filter(|s| s.live && !s.library).count() as u64;
            stats.library_buffers += shard.slots.iter().filter(|s| s.live && s.library).count() as u64;
            stats.allocated_bytes += shard.allocated;
            stats.library_bytes += shard.library;
            stats.footprint_bytes += shard.footprint;
            stats.cached_bytes += shard.cached;
            stats.allocations += shard.allocations;
            stats.frees += shard.frees;
        }
        let global = lock(&self.global.0);
        stats.reserved_bytes = global.reserved;
        stats.peak_reserved_bytes = global.peak_reserved;
        stats.slabs = global.slabs.iter().flatten().count() as u64;
        stats.dedicated_bytes = global.dedicated;
        stats.kept_bytes = global.kept.iter().map(|b| b.bytes).sum();
        stats.slab_free_bytes = global.ranges.free_bytes();
        stats.largest_free_range = global.ranges.largest();
        stats.deferred_bytes = global.deferred.iter().map(|(b, _)| b.bytes).sum();
        stats.deferred_frees = global.deferred_frees;
        stats.driver_allocations = global.driver_allocations;
        stats.driver_frees = global.driver_frees;
        stats.trims = global.trims;
        stats.budget_refusals = global.budget_refusals;
        stats.fragmentation = if global.reserved == 0 {
            0.0
        } else {
            1.0 - (stats.allocated_bytes + stats.library_bytes) as f64 / global.reserved as f64
        };
        stats
    }
}

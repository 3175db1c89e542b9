//! Memory taken from and given back to the driver: carving from slabs, growing within the
//! budget, releasing blocks, deferred frees and trim.

use std::sync::atomic::Ordering;

use super::classes;
use super::ranges::SlabId;
use super::{Allocator, Block, DeviceMemory, Global, LastUse, Origin, Slab, Unreleased};
use crate::budget;
use crate::counter::take;
use crate::error::{Error, Result};
use crate::sync::lock;

impl<M: DeviceMemory> Allocator<M> {
    /// Returns a block that no buffer uses to the slabs or the driver. Class blocks go to
    /// the slabs too: this is used by trim and deferred frees.
    pub(super) fn release(&self, global: &mut Global, block: Block) -> Result<()> {
        match block.origin {
            Origin::Class(_) | Origin::Range => {
                let slab = global.slabs[block.slab as usize].as_ref().expect("a block's slab is live");
                global.ranges.free(block.slab, block.ptr - slab.ptr, block.bytes);
                Ok(())
            }
            Origin::Dedicated => {
                self.driver_free(global, Unreleased { ptr: block.ptr, bytes: block.bytes, dedicated: true })
            }
        }
    }

    /// Takes back a block no buffer uses any more: a dedicated one is kept for reuse, any
    /// other returns to its slab.
    pub(super) fn retire(&self, global: &mut Global, block: Block) -> Result<()> {
        if block.origin == Origin::Dedicated {
            global.kept.push(block);
            return Ok(());
        }
        self.release(global, block)
    }

    /// The kept dedicated block that serves `bytes` best: the smallest that holds them with
    /// at most a quarter to spare (as size classes waste at most), taken out of the kept.
    fn reuse_kept(global: &mut Global, bytes: u64) -> Option<Block> {
        let spare = bytes / 4;
        let best = (global.kept.iter().enumerate())
            .filter(|(_, b)| b.bytes >= bytes && b.bytes - bytes <= spare)
            .min_by_key(|(_, b)| b.bytes)?
            .0;
        Some(global.kept.swap_remove(best))
    }

    /// Returns one driver allocation. On failure the memory is still held: it stays counted
    /// in `reserved` and is retried by the next trim (a driver that refused once may not
    /// refuse again; one whose context is lost refuses everything, and then nothing leaks
    /// twice).
    fn driver_free(&self, global: &mut Global, memory: Unreleased) -> Result<()> {
        match self.memory.mem_free(memory.ptr) {
            Ok(()) => {
                take(&mut global.reserved, memory.bytes, "reserved bytes");
                if memory.dedicated {
                    take(&mut global.dedicated, memory.bytes, "dedicated bytes");
                }
                global.driver_frees += 1;
                Ok(())
            }
            Err(e) => {
                global.unreleased.push(memory);
                Err(e)
            }
        }
    }

    /// Retries the driver frees that failed before.
    fn retry_unreleased(&self, global: &mut Global) -> Result<()> {
        let mut result = Ok(());
        for memory in std::mem::take(&mut global.unreleased) {
            result = result.and(self.driver_free(global, memory));
        }
        result
    }

    /// Moves deferred frees whose copies have completed back into circulation.
    fn reclaim_deferred(&self, global: &mut Global, is_idle: &dyn Fn(LastUse) -> bool) -> Result<()> {
        let mut result = Ok(());
        let mut i = 0;
        while i < global.deferred.len() {
            if is_idle(global.deferred[i].1) {
                let (block, _) = global.deferred.swap_remove(i);
                result = result.and(self.retire(global, block));
            } else {
                i += 1;
            }
        }
        result
    }

    /// Finds `bytes` of memory for a buffer of `len` requested bytes: from the slabs, or by
    /// growing within the budget, trimming and retrying once when refused.
    pub(super) fn carve(
        &self,
        len: u64,
        bytes: u64,
        origin: Origin,
        is_idle: &dyn Fn(LastUse) -> bool,
    ) -> Result<Block> {
        let mut global = lock(&self.global.0);
        // A failed driver free here is not this allocation's failure: the memory stays
        // listed for the next trim, which reports it.
        let _ = self.reclaim_deferred(&mut global, is_idle);
        if origin == Origin::Dedicated
            && let Some(block) = Self::reuse_kept(&mut global, bytes)
        {
            return Ok(block);
        }
        let mut trimmed = false;
        loop {
            let attempt = if origin == Origin::Dedicated {
                self.grow_dedicated(&mut global, len, bytes)
            } else {
                self.carve_from_slabs(&mut global, len, bytes, origin)
            };
            match attempt {
                Err(refusal) if !trimmed && is_refusal(&refusal) => {
                    // As above: what the trim fails to free is retried later.
                    let _ = self.trim_locked(&mut global);
                    trimmed = true;
                }
                Err(refusal) if is_refusal(&refusal) => {
                    global.budget_refusals += 1;
                    return Err(refusal);
                }
                other => return other,
            }
        }
    }

    fn carve_from_slabs(&self, global: &mut Global, len: u64, bytes: u64, origin: Origin) -> Result<Block> {
        if global.ranges.largest() < bytes {
            self.grow_slab(global, len, bytes)?;
        }
        let (slab, offset) = global.ranges.allocate(bytes).expect("a range that fits exists");
        let base = global.slabs[slab as usize].as_ref().expect("ranges name live slabs").ptr;
        Ok(Block { ptr: base + offset, bytes, slab, origin })
    }

    /// Room under the budget for `bytes` more, reading live free memory now.
    fn headroom(&self, global: &Global) -> Result<u64> {
        let (live_free, _) = self.memory.mem_get_info()?;
        let limit =
            budget::limit(global.reserved, self.config.total_memory, live_free, self.config.budget_fraction);
        Ok(limit - global.reserved)
    }

    fn grow_slab(&self, global: &mut Global, len: u64, bytes: u64) -> Result<()> {
        let headroom = self.headroom(global)?;
        // A full slab when the budget allows it, else a smaller one that still serves.
        let room = headroom / classes::GRANULE * classes::GRANULE;
        let slab_bytes = self.config.slab_bytes.min(room).max(bytes);
        if slab_bytes > headroom {
            return Err(self.over_budget(global, len, bytes, headroom, false));
        }
        let ptr = self.driver_alloc(global, len, slab_bytes, headroom)?;
        let id = match global.slabs.iter().position(Option::is_none) {
            Some(free) => free,
            None => {
                global.slabs.push(None);
                global.slabs.len() - 1
            }
        };
        global.slabs[id] = Some(Slab { ptr, bytes: slab_bytes });
        global.ranges.add_slab(id as SlabId, slab_bytes);
        Ok(())
    }

    fn grow_dedicated(&self, global: &mut Global, len: u64, bytes: u64) -> Result<Block> {
        let headroom = self.headroom(global)?;
        if bytes > headroom {
            return Err(self.over_budget(global, len, bytes, headroom, false));
        }
        let ptr = self.driver_alloc(global, len, bytes, headroom)?;
        global.dedicated += bytes;
        Ok(Block { ptr, bytes, slab: SlabId::MAX, origin: Origin::Dedicated })
    }

    fn driver_alloc(&self, global: &mut Global, len: u64, bytes: u64, headroom: u64) -> Result<u64> {
        match self.memory.mem_alloc(bytes) {
            Ok(ptr) => {
                global.driver_allocations += 1;
                global.reserved += bytes;
                global.peak_reserved = global.peak_reserved.max(global.reserved);
                Ok(ptr)
            }
            Err(e) if e.cuda_code() == Some(cuda_sys::CUDA_ERROR_OUT_OF_MEMORY) => {
                Err(self.over_budget(global, len, bytes, headroom, true))
            }
            Err(e) => Err(e),
        }
    }

    /// A refusal of `len` bytes that needed `needed` more from the driver, with `headroom`
    /// left under the budget.
    fn over_budget(
        &self,
        global: &Global,
        len: u64,
        needed: u64,
        headroom: u64,
        driver_out_of_memory: bool,
    ) -> Error {
        self.refused(len, needed, global.reserved + headroom, global.reserved, driver_out_of_memory)
    }

    pub(super) fn refused(
        &self,
        len: u64,
        needed: u64,
        limit: u64,
        held: u64,
        driver_out_of_memory: bool,
    ) -> Error {
        let library = self.shards.iter().map(|c| c.library.load(Ordering::Relaxed)).sum();
        Error::OverBudget {
            requested: len,
            needed,
            held,
            in_use: self.allocated_bytes(),
            library,
            limit,
            total: self.config.total_memory,
            fraction: self.config.budget_fraction,
            driver_out_of_memory,
        }
    }

    /// Releases cached blocks, kept dedicated blocks and empty slabs to the driver. Returns
    /// the bytes released.
    pub(crate) fn trim(&self, is_idle: &dyn Fn(LastUse) -> bool) -> Result<u64> {
        let mut global = lock(&self.global.0);
        let reclaimed = self.reclaim_deferred(&mut global, is_idle);
        let trimmed = self.trim_locked(&mut global);
        reclaimed.and(trimmed)
    }

    /// Every step runs even when a driver free fails (the first failure is returned), so a
    /// failing free never strands the rest of the cache.
    fn trim_locked(&self, global: &mut Global) -> Result<u64> {
        global.trims += 1;
        let before = global.reserved;
        let mut result = self.retry_unreleased(global);
        for block in std::mem::take(&mut global.kept) {
            result = result.and(self.release(global, block));
        }
        for cell in self.shards.iter() {
            let blocks: Vec<Block> = {
                let mut shard = lock(&cell.state);
                shard.cached = 0;
                shard.cache.iter_mut().flat_map(std::mem::take).collect()
            };
            for block in blocks {
                result = result.and(self.release(global, block));
            }
        }
        for id in 0..global.slabs.len() {
            let Some(slab) = &global.slabs[id] else { continue };
            let (ptr, bytes) = (slab.ptr, slab.bytes);
            if global.ranges.remove_slab_if_free(id as SlabId, bytes) {
                global.slabs[id] = None;
                result = result.and(self.driver_free(global, Unreleased { ptr, bytes, dedicated: false }));
            }
        }
        result.map(|()| before - global.reserved)
    }
}

fn is_refusal(e: &Error) -> bool {
    matches!(e, Error::OverBudget { .. })
}

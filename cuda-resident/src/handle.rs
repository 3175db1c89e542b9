//! The handle of a buffer of device memory: what callers hold, and what errors name.
//!
//! The allocator ([`crate::alloc`]) makes and checks handles; this module only defines
//! them, so that anything may name a handle without depending on the allocator.

use std::fmt;

/// Number of the allocator's shards (a power of two): a handle names its shard.
pub(crate) const SHARDS: usize = 32;
pub(crate) const SHARD_BITS: u32 = SHARDS.trailing_zeros();

/// A buffer of device memory owned by a [`Device`](crate::Device): a small `Copy` handle.
///
/// Pass it by value to the device's methods. It stays valid until
/// [`Device::free`](crate::Device::free); using it afterwards, or with another device, is an
/// error.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ResidentBuffer {
    /// The id of the allocator that made it.
    pub(crate) owner: u32,
    /// `slot << SHARD_BITS | shard`: the handle's slot, and the shard that holds it.
    pub(crate) index: u32,
    /// The slot's generation when the handle was made.
    pub(crate) generation: u32,
}

impl fmt::Debug for ResidentBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ResidentBuffer(allocator {}, shard {}, slot {}, generation {})",
            self.owner,
            self.shard(),
            self.slot(),
            self.generation
        )
    }
}

impl ResidentBuffer {
    /// The allocator's shard that holds the handle's slot (below [`SHARDS`]).
    #[inline]
    pub(crate) fn shard(self) -> usize {
        self.index as usize % SHARDS
    }

    /// The handle's slot in its shard: slots of a shard are numbered densely from 0, so
    /// per-batch tables index by shard and slot.
    #[inline]
    pub(crate) fn slot(self) -> usize {
        (self.index >> SHARD_BITS) as usize
    }

    #[cfg(test)]
    pub(crate) fn test_handle(owner: u32, index: u32, generation: u32) -> ResidentBuffer {
        ResidentBuffer { owner, index, generation }
    }
}

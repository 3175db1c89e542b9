//! What a lane's batches reuse under the lane's batch lock: descriptor and piece lists and
//! the lane's device staging. (Planners are not here: a batch plans before it takes its
//! lane, with one lent by [`Spares::planning`](super::spares::Spares).)

use crate::alloc::ResidentBuffer;

use super::host::Piece;

/// What a lane's batches reuse, used only under the lane's batch lock: descriptor and piece
/// lists, and the device staging where packed bytes and descriptors land before the scatter
/// (uploads) or where the gather collects them (downloads), grown on demand.
#[derive(Default)]
pub(crate) struct DeviceStaging {
    pub(crate) region: DeviceRegion,
    pub(crate) descriptors: Vec<crate::kernels::CopyDescriptor>,
    pub(crate) pieces: Vec<Piece>,
}

/// A lane's device staging buffer.
#[derive(Default)]
pub(crate) struct DeviceRegion {
    buffer: Option<(ResidentBuffer, u64, u64)>,
}

impl DeviceRegion {
    /// The address of the region if it holds at least `len` bytes.
    pub(crate) fn holding(&self, len: u64) -> Option<u64> {
        self.buffer.filter(|&(_, _, have)| have >= len).map(|(_, ptr, _)| ptr)
    }

    /// Makes `buffer`, `len` bytes at `ptr`, the region; returns the one it replaces, with
    /// its length.
    pub(crate) fn replace(
        &mut self,
        buffer: ResidentBuffer,
        ptr: u64,
        len: u64,
    ) -> Option<(ResidentBuffer, u64)> {
        self.buffer.replace((buffer, ptr, len)).map(|(old, _, old_len)| (old, old_len))
    }
}

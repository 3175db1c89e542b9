//! What validation, sorting and fusion share: the shape of a request, a validated request,
//! and the totals validation finds.

use super::{BufferKey, ReadRequest, WriteRequest};

/// What validation and fusion need of a request; writes and reads have the same shape.
pub(super) trait Request {
    fn buffer(&self) -> BufferKey;
    fn buffer_len(&self) -> u64;
    fn offset(&self) -> u64;
    fn len(&self) -> u64;
}

macro_rules! impl_request {
    ($t:ty) => {
        impl Request for $t {
            fn buffer(&self) -> BufferKey {
                self.buffer
            }
            fn buffer_len(&self) -> u64 {
                self.buffer_len
            }
            fn offset(&self) -> u64 {
                self.offset
            }
            fn len(&self) -> u64 {
                self.len
            }
        }
    };
}

impl_request!(WriteRequest);
impl_request!(ReadRequest);

/// A validated, non-empty request: `[start, end)` of the buffer that `place` names (see
/// [`Sorted::buffer_of`](super::sort::Sorted::buffer_of)), request number `index`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Entry {
    /// Equal for entries of one buffer, different for different buffers.
    pub(super) place: u64,
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) index: u32,
}

/// What validation found, besides what it left in the sort scratch.
pub(super) struct Collected {
    /// Sum of the requests' lengths (saturating: it is a statistic, and the layout checks
    /// the sums that become offsets).
    pub(super) requested_bytes: u64,
    /// The bitwise or of the requests' offsets: its bit count (that of the largest offset)
    /// sizes the sort key.
    pub(super) start_bits: u64,
    /// Whether a request is longer than `u32::MAX` bytes, too long for the sort's `lens`.
    pub(super) wide: bool,
}

//! Lanes (one non-blocking stream per direction, each with a timeline of events); the
//! fences of their submissions are `crate::fence`.
//!
//! Every submission on a lane gets the next sequence number and an event recorded after its
//! work. The lane keeps the events of work in flight, in order, together with what that work
//! needs alive (pinned memory); polling pops the completed ones, recycles their events and
//! releases what they kept. "Is submission `s` done?" is then one atomic load in the common
//! case: `s <= completed`.
//!
//! Two lanes, host-to-device and device-to-host, so that the two directions overlap on the
//! GPU's separate copy engines. Neither is ever the null stream.
//!
//! A lane also has a side stream, made on first use, for kernels that should run while the
//! lane's stream moves the next bytes ([`LaneBatch::submit_side`]). Side work starts after the
//! lane's last submission and is joined back into the lane's stream before the batch's
//! dependent work and its last submission, so a sequence number still means "everything
//! before it is done", side work included.

mod batch;
mod lane;
#[cfg(all(test, loom))]
mod loom;
#[cfg(test)]
mod tests;

pub(crate) use batch::LaneBatch;
pub(crate) use lane::{Lane, Lanes};

use crate::host_pool::HostLease;

/// The two directions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum LaneKind {
    /// Host to device.
    Upload = 0,
    /// Device to host.
    Download = 1,
}

impl LaneKind {
    pub(crate) const ALL: [LaneKind; 2] = [LaneKind::Upload, LaneKind::Download];

    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// The other direction.
    pub(crate) fn other(self) -> LaneKind {
        match self {
            LaneKind::Upload => LaneKind::Download,
            LaneKind::Download => LaneKind::Upload,
        }
    }
}

/// What a submission keeps alive until its work completes.
pub(crate) type KeepAlive = Vec<std::sync::Arc<HostLease>>;

/// Side work slots of a lane: a batch alternates between two (two staging regions).
pub(crate) const SIDE_SLOTS: usize = 2;

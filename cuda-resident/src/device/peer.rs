//! A device's peer calls: access to another GPU's memory and copies between GPUs.

use crate::error::Result;
use crate::peer::PeerBatch;

#[cfg(doc)]
use crate::error::Error;

use super::Device;

impl Device {
    /// Whether this device can be given access to `peer`'s memory (and the other way
    /// round): both directions must have a peer path. A device can always access its own.
    pub fn can_access_peer(&self, peer: &Device) -> Result<bool> {
        crate::peer::can_access_peer(&self.core, &peer.core)
    }

    /// Lets this device and `peer` access each other's memory (`cuCtxEnablePeerAccess` in
    /// both directions), so that [`Device::peer_copies`] between them move over the peer
    /// link. Calling it again is harmless. Fails with [`Error::PeerUnsupported`] where the
    /// pair has no peer path; copies between them still work, staged through host memory.
    ///
    /// Access lasts while both devices are open: each keeps the other's context alive. The
    /// calling thread's current context changes.
    pub fn enable_peer(&self, peer: &Device) -> Result<()> {
        crate::peer::enable_peer(&self.core, &peer.core)
    }

    /// Whether this device may access `peer`'s memory: the same GPU, or peer access enabled
    /// through this device or `peer` ([`Device::enable_peer`]).
    pub fn is_peer_enabled(&self, peer: &Device) -> bool {
        crate::peer::is_peer_enabled(&self.core, &peer.core)
    }

    /// Starts a batch of copies from buffers of `src` into buffers of this device. `src` may
    /// be this device itself (copies inside one GPU).
    ///
    /// The copies read `src`'s memory directly when this device may access it
    /// ([`Device::enable_peer`]); otherwise they are staged through host memory, which
    /// works between any two GPUs but blocks `submit` until the source bytes are on the
    /// host.
    pub fn peer_copies<'a>(&'a self, src: &'a Device) -> PeerBatch<'a> {
        crate::peer::copy::peer_copies(&self.core, &src.core)
    }
}

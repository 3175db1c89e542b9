//! `DeviceSet`: the GPUs of one host, each a [`Device`].

use std::sync::Arc;

use crate::alloc::ResidentBuffer;
use crate::config::Config;
use crate::engine::core::shared_driver;
use crate::error::{Error, Result};
use crate::fence::Fence;
use crate::peer::FanOutPath;

use super::Device;

/// The GPUs of one host (all of them, or those chosen), each a [`Device`] with its own
/// budget, resident store, staging and lanes.
#[derive(Clone, Debug)]
pub struct DeviceSet {
    devices: Vec<Device>,
}

impl DeviceSet {
    /// Opens every device the driver sees, each with the default [`Config`].
    pub fn open_all() -> Result<DeviceSet> {
        DeviceSet::open_all_configured(Config::default())
    }

    /// Opens every device the driver sees, each with `config` (each gets its own budget:
    /// `budget_fraction` applies per device).
    pub fn open_all_configured(config: Config) -> Result<DeviceSet> {
        let count = Device::count()?;
        let driver = shared_driver()?;
        let devices = (0..count).map(|i| Device::open_on_driver(Arc::clone(&driver), i, config.clone()));
        Ok(DeviceSet { devices: devices.collect::<Result<_>>()? })
    }

    /// A set of devices opened by the caller (with configs of their own), in that order.
    pub fn from_devices(devices: Vec<Device>) -> DeviceSet {
        DeviceSet { devices }
    }

    /// Number of devices.
    pub fn len(&self) -> usize {
        self.devices.len()
    }

    /// Whether the set holds no device.
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    /// Device `index` of the set.
    pub fn get(&self, index: usize) -> Result<&Device> {
        self.devices.get(index).ok_or(Error::NotInSet { index, len: self.devices.len() })
    }

    /// The devices, in set order.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// Enables peer access between every pair of devices that can have it
    /// ([`Device::enable_peer`]); pairs without a peer path are left as they are (their
    /// copies stage through host memory). Returns the number of pairs with access.
    pub fn enable_all_peers(&self) -> Result<usize> {
        let mut enabled = 0;
        for (i, a) in self.devices.iter().enumerate() {
            for b in &self.devices[i + 1..] {
                match a.enable_peer(b) {
                    Ok(()) => enabled += 1,
                    Err(Error::PeerUnsupported { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(enabled)
    }

    /// Writes `data` at `offset` into every target (a device index of this set and a buffer
    /// of that device), by [`FanOutPath::EachLink`], the faster path where measured
    /// (docs/multi-gpu.md; [`DeviceSet::fan_out_via`] picks the other).
    /// Returns one fence per target, in target order.
    pub fn fan_out(
        &self,
        data: &[u8],
        targets: &[(usize, ResidentBuffer)],
        offset: u64,
    ) -> Result<Vec<Fence>> {
        self.fan_out_via(FanOutPath::EachLink, data, targets, offset)
    }

    /// [`DeviceSet::fan_out`] by the path given.
    ///
    /// # Errors
    /// A bad target (an index not in the set, a buffer of another device or freed, a range
    /// past its end): every target is checked before anything moves. A failure part way,
    /// of resources or of the driver (device staging past a device's budget for
    /// [`FanOutPath::FirstThenPeers`]' peer copies, pinned staging, a driver error), can
    /// leave the targets copied before it written: the chunks already moved to them stay.
    pub fn fan_out_via(
        &self,
        path: FanOutPath,
        data: &[u8],
        targets: &[(usize, ResidentBuffer)],
        offset: u64,
    ) -> Result<Vec<Fence>> {
        let len = data.len() as u64;
        let mut places = Vec::with_capacity(targets.len());
        for &(index, buffer) in targets {
            let device = self.get(index)?;
            places.push((&device.core, buffer, device.core.checked_range(buffer, offset, len)?));
        }
        crate::peer::fan_out(path, data, &places, offset)
    }
}

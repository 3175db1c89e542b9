//! What the crate's tests share: the model driver ([`model`]), the fault matrix on it
//! ([`faults`]), and the helpers of the tests that run the engine on the model.
//!
//! Only the model driver is also built outside tests, with the `internals` feature: the
//! benches open devices on it (`internals::model_device`). The rest is the tests' own.

#[cfg(test)]
mod faults;
// Outside tests the benches use only the device it opens.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) mod model;

#[cfg(test)]
use crate::{Config, Device, DownloadBatch, ResidentBuffer, Slot};

/// A device opened on a fresh model driver.
#[cfg(test)]
pub(crate) fn device(config: Config) -> Device {
    Device::open_on_driver(model::driver(), 0, config).expect("the model opens")
}

/// Small chunks and a low threshold: batches split into chunks and mix packed and direct.
#[cfg(test)]
pub(crate) fn small_chunks() -> Config {
    Config {
        chunk_bytes: 64 << 10,
        direct_threshold: 8 << 10,
        pinned_cap_bytes: 8 << 20,
        ..Config::default()
    }
}

#[cfg(test)]
pub(crate) fn random_vec(rng: &mut fastrand::Rng, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rng.fill(&mut v);
    v
}

/// Buffers of one device and what they must hold (also for the peer tests).
#[cfg(test)]
pub(crate) struct Model {
    pub(crate) buffers: Vec<ResidentBuffer>,
    pub(crate) expect: Vec<Vec<u8>>,
}

#[cfg(test)]
impl Model {
    pub(crate) fn new(d: &Device, rng: &mut fastrand::Rng, sizes: &[usize]) -> Model {
        let buffers: Vec<_> = sizes.iter().map(|&n| d.allocate(n as u64).unwrap()).collect();
        let expect: Vec<_> = sizes.iter().map(|&n| random_vec(rng, n)).collect();
        let writes: Vec<_> = buffers.iter().zip(&expect).map(|(&b, v)| (b, v.as_slice())).collect();
        d.upload_many(&writes).unwrap();
        Model { buffers, expect }
    }

    pub(crate) fn check(&self, d: &Device, what: &str) {
        assert!(model::with(|g| g.errors.is_empty()), "{what}: the model found illegal accesses");
        for (i, got) in d.download_many(&self.buffers).unwrap().iter().enumerate() {
            assert!(
                got == &self.expect[i],
                "{what}: buffer {i} differs at {:?}",
                got.iter().zip(&self.expect[i]).position(|(a, b)| a != b)
            );
        }
    }

    /// Up to `most` random ranges `(buffer, offset, len)` of 1 byte to 8 KiB, at rising
    /// offsets per buffer with gaps of 1 to 99 bytes (odd ones too), interleaved across
    /// buffers: in order and apart.
    pub(crate) fn in_order_ranges(&self, rng: &mut fastrand::Rng, most: usize) -> Vec<(usize, usize, usize)> {
        let mut next = vec![0usize; self.buffers.len()];
        let mut ranges = Vec::new();
        for _ in 0..rng.usize(64..most) {
            let i = rng.usize(..self.buffers.len());
            let len = match rng.u8(..4) {
                0 => rng.usize(1..16),
                1 => rng.usize(1..=4096),
                _ => rng.usize(1..=(8 << 10) - 1),
            };
            let at = next[i] + rng.usize(1..100);
            if at + len <= self.expect[i].len() {
                next[i] = at + len;
                ranges.push((i, at, len));
            }
        }
        ranges
    }

    /// A download batch of `ranges` `(buffer, offset, len)`, not yet submitted, and its slots.
    pub(crate) fn reads<'d>(
        &self,
        d: &'d Device,
        ranges: &[(usize, usize, usize)],
    ) -> (DownloadBatch<'d>, Vec<Slot>) {
        let mut reads = d.downloads();
        let slots = ranges
            .iter()
            .map(|&(i, at, len)| reads.read(self.buffers[i], at as u64, len as u64).unwrap())
            .collect();
        (reads, slots)
    }

    /// A random range: 1 byte to the whole buffer, mostly small (at most `max` bytes).
    pub(crate) fn range(&self, rng: &mut fastrand::Rng, max: usize) -> (usize, usize, usize) {
        let i = rng.usize(..self.buffers.len());
        let n = self.expect[i].len();
        let len = match rng.u8(0..10) {
            0 => rng.usize(1..=n),
            1..=4 => rng.usize(1..=n.min(64)),
            _ => rng.usize(1..=n.min(max)),
        };
        (i, rng.usize(0..=n - len), len)
    }
}

//! `OwnedBuffer`: a buffer of device memory freed when its owner is dropped.
//!
//! A [`ResidentBuffer`] is a `Copy` handle, freed by hand with [`Device::free`]: right for a
//! runtime's own tables of thousands of handles, easy to leak on an early return. The guard
//! here owns one handle and frees it on drop, deferred while copies use it exactly as
//! [`Device::free`] is, and hands out the handle (`*owned`) for batches.

use std::fmt;
use std::ops::Deref;

use crate::alloc::ResidentBuffer;
use crate::device::Device;
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;

/// A buffer of device memory that is freed when dropped: [`Device::allocate_owned`] makes
/// one, [`Device::adopt`] takes over a handle made by [`Device::allocate`].
///
/// It dereferences to its [`ResidentBuffer`], so `*owned` (or [`handle`](Self::handle)) is
/// the `Copy` handle that batches and the device's methods take:
///
/// ```no_run
/// use cuda_resident::Device;
///
/// let device = Device::open(0)?;
/// let a = device.allocate_owned(1 << 20)?;
/// device.upload_at(*a, 0, &[7u8; 300])?; // an error here frees `a` on the way out
/// let mut reads = device.downloads();
/// let slot = reads.read(*a, 0, 300)?;
/// assert_eq!(reads.submit()?.wait()?.get(slot), &[7u8; 300][..]);
/// # Ok::<(), cuda_resident::Error>(())
/// ```
///
/// Dropping it frees the buffer as [`Device::free`] does: the handle is invalid at once,
/// and if a copy submitted earlier still uses the buffer, its memory is reused only after
/// that copy completes, with no wait on the host. [`free`](Self::free) does the same and
/// returns its error; [`into_raw`](Self::into_raw) gives the handle up without
/// freeing it.
///
/// It keeps a clone of its [`Device`]: the device's context and memory stay alive while an
/// `OwnedBuffer` does, even after every other clone of the device is dropped. A `Copy` of
/// its handle is only a handle: using it after the owner is dropped is an error
/// ([`Error::FreedBuffer`]), never a dangling pointer.
///
/// # Errors on drop
///
/// A drop has nowhere to return an error, so it ignores the one [`Device::free`] gives (a
/// free makes no driver call: its memory goes back to the device's store):
/// - the handle freed already, through a copy of it passed to [`Device::free`]: nothing is
///   freed twice or counted twice;
/// - (feature `cudarc`) a `ResidentView` of the buffer still alive: the free is refused and
///   the buffer stays allocated, until a copy of the handle is freed once the view is gone,
///   or the device is dropped. A view made through [`device`](Self::device) borrows the
///   owner, so the compiler keeps the owner from being dropped first.
///
/// Call [`free`](Self::free) where the error matters.
pub struct OwnedBuffer {
    device: Device,
    buffer: ResidentBuffer,
    /// The length as allocated (what [`Device::buffer_len`] answers while the handle lives).
    len: u64,
    /// Whether the drop frees the handle: cleared by `into_raw` and `free`, which consume
    /// the owner and so must keep its drop from freeing a second time.
    owns: bool,
}

// The guard moves between threads and is shared as a `Device` and a handle are.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<OwnedBuffer>();
};

impl OwnedBuffer {
    /// The owner of `buffer`, a live handle of `device` of `len` bytes.
    pub(crate) fn new(device: Device, buffer: ResidentBuffer, len: u64) -> OwnedBuffer {
        OwnedBuffer { device, buffer, len, owns: true }
    }

    /// The `Copy` handle, for batches and the device's methods (also `*owned`). It stays
    /// valid until this owner is dropped or freed.
    pub fn handle(&self) -> ResidentBuffer {
        self.buffer
    }

    /// The buffer's length in bytes, as allocated.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the buffer has no bytes: never (an allocation is at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device the buffer belongs to.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Gives up ownership and returns the handle, which stays live: for runtimes that keep
    /// handles in tables of their own and free them with [`Device::free`].
    /// [`Device::adopt`] makes an owner of it again.
    pub fn into_raw(mut self) -> ResidentBuffer {
        self.owns = false;
        self.buffer
    }

    /// Frees the buffer now, as dropping it would, and returns what [`Device::free`]
    /// returns: [`Error::FreedBuffer`] when a copy of the handle was freed already,
    /// (feature `cudarc`) [`Error::BufferViewed`] while a view of the buffer lives (it then
    /// stays allocated, as for a drop).
    pub fn free(mut self) -> Result<()> {
        self.owns = false;
        self.device.free(self.buffer)
    }
}

impl Deref for OwnedBuffer {
    type Target = ResidentBuffer;

    fn deref(&self) -> &ResidentBuffer {
        &self.buffer
    }
}

impl Drop for OwnedBuffer {
    fn drop(&mut self) {
        if self.owns {
            // Nowhere to return it: see "Errors on drop" above.
            let _ = self.device.free(self.buffer);
        }
    }
}

impl fmt::Debug for OwnedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedBuffer")
            .field("buffer", &self.buffer)
            .field("len", &self.len)
            .field("device", &self.device.info().ordinal)
            .finish()
    }
}

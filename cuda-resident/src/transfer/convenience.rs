//! The blocking conveniences of [`Device`]: each builds one batch, submits it and waits.

use crate::alloc::ResidentBuffer;
use crate::device::Device;
use crate::engine::host::zeroed_vec;
use crate::error::{Error, Result};
use crate::plan::route::Route;

impl Device {
    /// Uploads `data` as the whole contents of `buffer` and waits until it has landed.
    ///
    /// # Errors
    /// [`Error::UploadLength`] (nothing moved) unless `data` is exactly as long as the buffer:
    /// a shorter slice would leave the buffer's tail as it was, which is rarely what a caller
    /// of a whole-buffer upload means. Use [`Device::upload_at`] for a partial write.
    pub fn upload(&self, buffer: ResidentBuffer, data: &[u8]) -> Result<()> {
        self.upload_many(&[(buffer, data)])
    }

    /// Uploads `data` to `buffer` at `offset` and waits until it has landed.
    pub fn upload_at(&self, buffer: ResidentBuffer, offset: u64, data: &[u8]) -> Result<()> {
        let mut batch = self.uploads();
        batch.write(buffer, offset, data)?;
        batch.submit()?.wait()
    }

    /// Uploads each `(buffer, data)` as the whole contents of its buffer, as one batch, and
    /// waits.
    ///
    /// # Errors
    /// [`Error::UploadLength`] (nothing moved) unless every `data` is exactly as long as its
    /// buffer, as for [`Device::upload`]; [`Device::upload_at_many`] writes parts.
    pub fn upload_many(&self, writes: &[(ResidentBuffer, &[u8])]) -> Result<()> {
        for &(buffer, data) in writes {
            let buffer_len = self.buffer_len(buffer)?;
            if data.len() as u64 != buffer_len {
                return Err(Error::UploadLength { buffer, buffer_len, data_len: data.len() });
            }
        }
        let mut batch = self.uploads();
        for &(buffer, data) in writes {
            batch.write(buffer, 0, data)?;
        }
        batch.submit()?.wait()
    }

    /// Uploads each `(buffer, offset, data)`, as one batch (later writes win where they
    /// overlap), and waits.
    pub fn upload_at_many(&self, writes: &[(ResidentBuffer, u64, &[u8])]) -> Result<()> {
        let mut batch = self.uploads();
        for &(buffer, offset, data) in writes {
            batch.write(buffer, offset, data)?;
        }
        batch.submit()?.wait()
    }

    /// The whole buffer, read back.
    pub fn download(&self, buffer: ResidentBuffer) -> Result<Vec<u8>> {
        let len = self.buffer_len(buffer)?;
        self.download_range(buffer, 0, len)
    }

    /// `len` bytes of `buffer` at `offset`, read back.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] when the range does not lie in the buffer (`offset + len`
    /// overflowing included), checked before any host memory is reserved for the result.
    pub fn download_range(&self, buffer: ResidentBuffer, offset: u64, len: u64) -> Result<Vec<u8>> {
        // The range first: a length of `u64::MAX` is a bad range, not a host out of memory.
        self.checked_range(buffer, offset, len)?;
        if len <= self.config().chunk_bytes.saturating_mul(4) {
            return Ok(self.download_ranges(&[(buffer, offset, len)])?.pop().unwrap_or_default());
        }
        let mut out = zeroed_vec(len)?;
        self.download_to_slice(buffer, offset, &mut out)?;
        Ok(out)
    }

    /// Each whole buffer, read back as one batch (of any size: a batch larger than the
    /// pinned pool streams through it, see [`DownloadBatch`](crate::DownloadBatch), each
    /// chunk copied into the result vectors as it lands).
    pub fn download_many(&self, buffers: &[ResidentBuffer]) -> Result<Vec<Vec<u8>>> {
        let mut out = vec![Vec::new(); buffers.len()];
        self.read_many_into(buffers, &mut out)?;
        Ok(out)
    }

    /// [`Device::download_many`] into `out` (one vector a buffer); the route the batch took.
    pub(crate) fn read_many_into(&self, buffers: &[ResidentBuffer], out: &mut [Vec<u8>]) -> Result<Route> {
        let mut batch = self.downloads();
        batch.read_many(buffers)?;
        batch.submit_into_as(out, false)
    }

    /// Each `(buffer, offset, len)` range, read back as one batch (of any size, as
    /// [`Device::download_many`]).
    pub fn download_ranges(&self, ranges: &[(ResidentBuffer, u64, u64)]) -> Result<Vec<Vec<u8>>> {
        let mut out = vec![Vec::new(); ranges.len()];
        self.read_ranges_into(ranges, &mut out, false)?;
        Ok(out)
    }

    /// Reads each `(buffer, offset, len)` range into the caller's vector of the same index,
    /// replacing its contents and reusing its capacity; one batch (of any size, as
    /// [`Device::download_many`]), one wait.
    pub fn download_into(&self, ranges: &[(ResidentBuffer, u64, u64)], out: &mut [Vec<u8>]) -> Result<()> {
        if ranges.len() != out.len() {
            return Err(Error::LengthMismatch {
                what: "download_into ranges and output vectors",
                left: ranges.len(),
                right: out.len(),
            });
        }
        self.read_ranges_into(ranges, out, true).map(drop)
    }

    /// The ranges read into `out` as one batch ([`DownloadBatch::submit_into`](crate::DownloadBatch::submit_into), `pipelined`
    /// or not); the route the batch took.
    pub(crate) fn read_ranges_into(
        &self,
        ranges: &[(ResidentBuffer, u64, u64)],
        out: &mut [Vec<u8>],
        pipelined: bool,
    ) -> Result<Route> {
        let mut batch = self.downloads();
        for &(b, o, l) in ranges {
            batch.read(b, o, l)?;
        }
        batch.submit_into_as(out, pipelined)
    }
}

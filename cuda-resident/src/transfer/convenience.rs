//! The blocking conveniences of [`Device`](crate::Device): each builds one batch, submits it and waits.

use std::sync::Arc;

use crate::alloc::ResidentBuffer;
use crate::engine::core::Core;
use crate::engine::host::zeroed_vec;
use crate::error::{Error, Result};
use crate::plan::route::Route;
use crate::transfer::single::{DRIVER_STAGED_MOST, upload_now};

/// The work of [`Device::upload`](crate::Device::upload).
pub(crate) fn upload(core: &Arc<Core>, buffer: ResidentBuffer, data: &[u8]) -> Result<()> {
    let buffer_len = core.buffer_len(buffer)?;
    if data.len() as u64 != buffer_len {
        return Err(Error::UploadLength { buffer, buffer_len, data_len: data.len() });
    }
    upload_at(core, buffer, 0, data)
}

/// The work of [`Device::upload_at`](crate::Device::upload_at).
pub(crate) fn upload_at(core: &Arc<Core>, buffer: ResidentBuffer, offset: u64, data: &[u8]) -> Result<()> {
    if data.len() <= DRIVER_STAGED_MOST {
        return upload_now(core, buffer, offset, data);
    }
    let mut batch = super::upload::uploads(core);
    batch.write(buffer, offset, data)?;
    batch.submit()?.wait()
}

/// The work of [`Device::upload_many`](crate::Device::upload_many).
pub(crate) fn upload_many(core: &Arc<Core>, writes: &[(ResidentBuffer, &[u8])]) -> Result<()> {
    for &(buffer, data) in writes {
        let buffer_len = core.buffer_len(buffer)?;
        if data.len() as u64 != buffer_len {
            return Err(Error::UploadLength { buffer, buffer_len, data_len: data.len() });
        }
    }
    let mut batch = super::upload::uploads(core);
    for &(buffer, data) in writes {
        batch.write(buffer, 0, data)?;
    }
    batch.submit()?.wait()
}

/// The work of [`Device::upload_at_many`](crate::Device::upload_at_many).
pub(crate) fn upload_at_many(core: &Arc<Core>, writes: &[(ResidentBuffer, u64, &[u8])]) -> Result<()> {
    let mut batch = super::upload::uploads(core);
    for &(buffer, offset, data) in writes {
        batch.write(buffer, offset, data)?;
    }
    batch.submit()?.wait()
}

/// The work of [`Device::download`](crate::Device::download).
pub(crate) fn download(core: &Arc<Core>, buffer: ResidentBuffer) -> Result<Vec<u8>> {
    let len = core.buffer_len(buffer)?;
    download_range(core, buffer, 0, len)
}

/// The work of [`Device::download_range`](crate::Device::download_range).
pub(crate) fn download_range(
    core: &Arc<Core>,
    buffer: ResidentBuffer,
    offset: u64,
    len: u64,
) -> Result<Vec<u8>> {
    // The range first: a length of `u64::MAX` is a bad range, not a host out of memory.
    core.checked_range(buffer, offset, len)?;
    if len <= core.config.chunk_bytes.saturating_mul(4) {
        return Ok(download_ranges(core, &[(buffer, offset, len)])?.pop().unwrap_or_default());
    }
    let mut out = zeroed_vec(len)?;
    super::single::download_to_slice(core, buffer, offset, &mut out)?;
    Ok(out)
}

/// The work of [`Device::download_many`](crate::Device::download_many).
pub(crate) fn download_many(core: &Arc<Core>, buffers: &[ResidentBuffer]) -> Result<Vec<Vec<u8>>> {
    let mut out = vec![Vec::new(); buffers.len()];
    download_many_into(core, buffers, &mut out)?;
    Ok(out)
}

/// `Device::download_many` into `out` (one vector a buffer); the route the batch took.
pub(crate) fn download_many_into(
    core: &Arc<Core>,
    buffers: &[ResidentBuffer],
    out: &mut [Vec<u8>],
) -> Result<Route> {
    let mut batch = super::download::downloads(core);
    batch.read_buffer_many(buffers)?;
    batch.submit_into_as(out, false)
}

/// The work of [`Device::download_ranges`](crate::Device::download_ranges).
pub(crate) fn download_ranges(
    core: &Arc<Core>,
    ranges: &[(ResidentBuffer, u64, u64)],
) -> Result<Vec<Vec<u8>>> {
    let mut out = vec![Vec::new(); ranges.len()];
    download_ranges_into(core, ranges, &mut out, false)?;
    Ok(out)
}

/// The work of [`Device::download_into`](crate::Device::download_into).
pub(crate) fn download_into(
    core: &Arc<Core>,
    ranges: &[(ResidentBuffer, u64, u64)],
    out: &mut [Vec<u8>],
) -> Result<()> {
    if ranges.len() != out.len() {
        return Err(Error::LengthMismatch {
            what: "download_into ranges and output vectors",
            left: ranges.len(),
            right: out.len(),
        });
    }
    download_ranges_into(core, ranges, out, true).map(drop)
}

/// The ranges read into `out` as one batch ([`DownloadBatch::submit_into`](crate::DownloadBatch::submit_into), `pipelined`
/// or not); the route the batch took.
pub(crate) fn download_ranges_into(
    core: &Arc<Core>,
    ranges: &[(ResidentBuffer, u64, u64)],
    out: &mut [Vec<u8>],
    pipelined: bool,
) -> Result<Route> {
    let mut batch = super::download::downloads(core);
    for &(b, o, l) in ranges {
        batch.read(b, o, l)?;
    }
    batch.submit_into_as(out, pipelined)
}

//! Several GPUs in one host: a set of devices, peer access, fused peer copies and fan-out.
//!
//! Each [`Device`] of a [`DeviceSet`] keeps its own budget, allocator, staging and lanes;
//! pinned memory is allocated portable, so any device can copy from any pool's memory.
//!
//! Calls that involve two devices (peer batches, fan-out, [`Device::enable_peer`]) make
//! each device's context current on the calling thread as they need it and leave the last
//! one current: a caller that mixes in driver calls of its own makes its context current
//! again first ([`Device::make_current`]).
//!
//! [`Device`]: crate::Device
//! [`DeviceSet`]: crate::DeviceSet
//! [`Device::enable_peer`]: crate::Device::enable_peer
//! [`Device::make_current`]: crate::Device::make_current

pub(crate) mod copy;

pub use copy::PeerBatch;

use std::sync::Arc;

use crate::alloc::ResidentBuffer;
use crate::engine::Exec;
use crate::engine::core::Core;
use crate::engine::host::Piece;
use crate::error::{Error, Result};
use crate::fence::Fence;
use crate::plan::route::RING;
use crate::stream::LaneKind;
use crate::sync::lock;

/// How [`DeviceSet::fan_out_via`](crate::DeviceSet::fan_out_via) reaches its devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FanOutPath {
    /// Pack the bytes once into portable pinned memory, chunk by chunk, and copy each
    /// chunk to every device over that GPU's own link, all devices at once.
    EachLink,
    /// Upload to the first target, then copy from it to the others over the peer links
    /// ([`Device::peer_copies`](crate::Device::peer_copies)).
    FirstThenPeers,
}

/// The work of [`DeviceSet::fan_out_via`](crate::DeviceSet::fan_out_via), once every
/// target was checked: `places` holds each target's device, buffer and address at `offset`.
pub(crate) fn fan_out(
    path: FanOutPath,
    data: &[u8],
    places: &[(&Arc<Core>, ResidentBuffer, u64)],
    offset: u64,
) -> Result<Vec<Fence>> {
    let len = data.len() as u64;
    if data.is_empty() || places.is_empty() {
        return Ok(vec![Fence::completed(); places.len()]);
    }
    match path {
        FanOutPath::EachLink => fan_out_each_link(data, places),
        FanOutPath::FirstThenPeers => {
            let (first, first_buffer, _) = places[0];
            let mut uploads = crate::transfer::upload::uploads(first);
            uploads.write(first_buffer, offset, data)?;
            let first_fence = uploads.submit()?;
            let mut fences = vec![first_fence.clone()];
            for &(device, buffer, _) in &places[1..] {
                if buffer == first_buffer && Arc::ptr_eq(device, first) {
                    // The first target named again: already written.
                    fences.push(first_fence.clone());
                    continue;
                }
                let mut copies = copy::peer_copies(device, first);
                copies.copy(first_buffer, offset, buffer, offset, len)?;
                fences.push(copies.submit()?);
            }
            Ok(fences)
        }
    }
}

/// The fan-out over every GPU's own link: chunk `k` is packed (by the first target's
/// packing threads) into pinned memory while the devices copy chunk `k - 1`; each device's
/// upload lane moves every chunk to each of its targets. At most [`RING`] chunks are in
/// flight, fewer when the first target's pinned pool holds fewer.
///
/// Only the first target's lane keeps a chunk's staging: after the other devices' copies of
/// it, that lane gets a submission that waits for them on the GPU and holds the chunk, so
/// the staging returns to its pool through the lanes that pool's own waits poll.
fn fan_out_each_link(data: &[u8], places: &[(&Arc<Core>, ResidentBuffer, u64)]) -> Result<Vec<Fence>> {
    let stager = places[0].0;
    // One lane batch per distinct device, taken in one global order (by core address) so
    // that concurrent fan-outs cannot deadlock.
    let mut devices: Vec<&Arc<Core>> = places.iter().map(|p| p.0).collect();
    devices.sort_by_key(|d| Arc::as_ptr(d) as usize);
    devices.dedup_by_key(|d| Arc::as_ptr(d) as usize);
    let same = |a: &Arc<Core>, b: &Arc<Core>| Arc::ptr_eq(a, b);
    let home = devices.iter().position(|d| same(d, stager)).expect("a target");
    let others = devices.len() > 1;
    let mut execs: Vec<Exec<'_>> = devices.iter().map(|d| Exec::begin(d, LaneKind::Upload)).collect();
    let chunk = stager.config.chunk_bytes as usize;
    let ring = execs[home].room(chunk as u64).min(RING);
    let chunks = data.len().div_ceil(chunk) as u64;
    let mut finals = Vec::with_capacity(devices.len());
    for (i, (device, exec)) in devices.iter().zip(&mut execs).enumerate() {
        let mine = places.iter().filter(|p| same(p.0, device)).map(|p| p.1);
        // The first target's lane has a holding submission per chunk when others copy too.
        let submissions = if i == home && others { 2 * chunks } else { chunks };
        finals.push(exec.claim(mine, submissions)?);
    }
    let home_stream = execs[home].stream();
    // Per device, its targets' addresses (at the start of the data).
    let dsts: Vec<Vec<u64>> =
        devices.iter().map(|d| places.iter().filter(|p| same(p.0, d)).map(|p| p.2).collect()).collect();
    // Per chunk, per device: the submission (for the first target, its holding one).
    let mut seqs: Vec<Vec<u64>> = Vec::with_capacity(chunks as usize);
    let mut pieces = Vec::new();
    for (k, part) in data.chunks(chunk).enumerate() {
        if k >= ring {
            for (exec, &seq) in execs.iter().zip(&seqs[k - ring]) {
                exec.wait(seq)?;
            }
        }
        let lease = Arc::new(execs[home].lease(part.len())?);
        let base = lease.as_ptr();
        pieces.clear();
        Piece::push_split(&mut pieces, Piece { dst: base, src: part.as_ptr(), len: part.len() });
        // SAFETY: the pieces cover the fresh lease's first part.len() bytes from the live slice.
        unsafe { Piece::copy_all(&stager.packers, &pieces) };
        let at = (k * chunk) as u64;
        let mut row = Vec::with_capacity(devices.len());
        for (i, exec) in execs.iter_mut().enumerate() {
            let mine = &dsts[i];
            let keep = if i == home && !others { vec![Arc::clone(&lease)] } else { Vec::new() };
            let bytes = part.len() as u64 * mine.len() as u64;
            let submitted = exec.submit(keep, |q| {
                for &dst in mine {
                    // SAFETY: the portable pinned chunk is kept alive until this copy is done
                    // (by this submission, or by the first target's holding one, which waits
                    // for it); the destination range was checked and its buffer is marked.
                    unsafe { q.htod(dst + at, base, part.len()) }?;
                }
                Ok(())
            });
            match submitted {
                Ok(seq) => row.push(seq),
                Err(e) => {
                    // This device's submission may have enqueued some of its copies before
                    // it failed: its lane is settled too.
                    hold_until_done(&lease, &row, &devices, Some(i));
                    return Err(e);
                }
            }
            // Each chunk is counted as it is enqueued.
            exec.requested(bytes);
            exec.flush();
        }
        if others {
            // The first target's lane waits for every device's copy of this chunk, on the
            // GPU, then holds the chunk until then.
            let ordered = stager.ctx.bind().and_then(|_| {
                execs.iter().zip(&row).try_for_each(|(exec, &seq)| exec.make_wait(seq, home_stream))
            });
            if let Err(e) = ordered {
                hold_until_done(&lease, &row, &devices, None);
                return Err(e);
            }
            row[home] = execs[home].hold(vec![Arc::clone(&lease)])?;
        }
        seqs.push(row);
    }
    drop(execs);
    Ok(places
        .iter()
        .map(|p| {
            let i = devices.iter().position(|d| same(d, p.0)).expect("listed above");
            Fence::new(&p.0.lanes, LaneKind::Upload, finals[i])
        })
        .collect())
}

/// After a failure part-way through a fan-out chunk: the copies already submitted (`row`,
/// in device order) may still read the chunk's staging, which no submission keeps, and so
/// may the copies a failed submission of device `failed` enqueued before it failed. Waits
/// for the first and settles that device's lane ([`crate::stream::Lane::settle`]); if that
/// fails too, the staging is never lent again (the context is lost).
fn hold_until_done(
    lease: &Arc<crate::host_pool::HostLease>,
    row: &[u64],
    devices: &[&Arc<Core>],
    failed: Option<usize>,
) {
    let waited = devices.iter().zip(row).all(|(d, &seq)| d.lane(LaneKind::Upload).wait(seq).is_ok());
    let settled = failed.is_none_or(|i| devices[i].lane(LaneKind::Upload).settle().is_ok());
    if !(waited && settled) {
        lease.strand();
        std::mem::forget(Arc::clone(lease));
    }
}

/// The work of [`Device::can_access_peer`](crate::Device::can_access_peer).
pub(crate) fn can_access_peer(core: &Arc<Core>, peer: &Arc<Core>) -> Result<bool> {
    let (a, b) = (core.ctx.device, peer.ctx.device);
    if a == b {
        return Ok(true);
    }
    let raw = &core.ctx.raw;
    Ok(raw.device_can_access_peer(a, b)? && raw.device_can_access_peer(b, a)?)
}

/// The work of [`Device::enable_peer`](crate::Device::enable_peer).
pub(crate) fn enable_peer(core: &Arc<Core>, peer: &Arc<Core>) -> Result<()> {
    let (a, b) = (core, peer);
    if a.ctx.device == b.ctx.device {
        return Ok(());
    }
    let ordinal = |d: &Core| d.info.ordinal;
    let raw = &a.ctx.raw;
    if !raw.device_can_access_peer(a.ctx.device, b.ctx.device)? {
        return Err(Error::PeerUnsupported { device: core.info.ordinal, peer: ordinal(peer) });
    }
    if !raw.device_can_access_peer(b.ctx.device, a.ctx.device)? {
        return Err(Error::PeerUnsupported { device: ordinal(peer), peer: core.info.ordinal });
    }
    // Both ways or neither: where the second fails, the first (if this call enabled it) is
    // taken back, so that no copy takes the direct path one way only.
    let mut enabled: Option<(&Arc<Core>, &Arc<Core>)> = None;
    for (from, to) in [(a, b), (b, a)] {
        let mut peers = lock(&from.peers);
        if peers.iter().any(|c| c.device == to.ctx.device) {
            continue;
        }
        if let Err(e) = from.ctx.bind().and_then(|raw| raw.ctx_enable_peer_access(to.ctx.ctx)) {
            drop(peers);
            if let Some((first, other)) = enabled {
                let mut peers = lock(&first.peers);
                peers.retain(|c| c.device != other.ctx.device);
                // A refusal to take it back leaves the access unused: no copy takes it.
                let _ = first.ctx.bind().and_then(|raw| raw.ctx_disable_peer_access(other.ctx.ctx));
            }
            return Err(e);
        }
        peers.push(Arc::clone(&to.ctx));
        enabled = Some((from, to));
    }
    Ok(())
}

/// The work of [`Device::is_peer_enabled`](crate::Device::is_peer_enabled).
pub(crate) fn is_peer_enabled(core: &Arc<Core>, peer: &Arc<Core>) -> bool {
    can_read_directly(core, peer)
}

/// Whether kernels of this device may read `src`'s memory.
pub(crate) fn can_read_directly(core: &Arc<Core>, src: &Arc<Core>) -> bool {
    let (a, b) = (core, src);
    a.ctx.device == b.ctx.device || lock(&a.peers).iter().any(|c| c.device == b.ctx.device)
}

#[cfg(test)]
mod model_tests;

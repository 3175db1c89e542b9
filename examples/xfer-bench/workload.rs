//! The data the cases move: random host bytes, and the scattered device places of the
//! many-small cases with their check.

use cuda_resident::{Device, DownloadBatch, Downloaded, OwnedBuffer, ResidentBuffer, Slot, UploadBatch};

use crate::BenchResult;

/// `len` random bytes.
pub(crate) fn random_vec(rng: &mut fastrand::Rng, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rng.fill(&mut v);
    v
}

pub(crate) use cuda_resident_suite::random::fill_random;

/// Random source and zeroed destination of `n` bytes for the single-copy cases.
pub(crate) fn host_pair(seed: u64, n: usize) -> (Vec<u8>, Vec<u8>) {
    (random_vec(&mut fastrand::Rng::with_seed(seed), n), vec![0u8; n])
}

/// Many small copies: `count` copies of `size` bytes spread over 64 buffers with gaps, so
/// that none fuse. The buffers are freed when it is dropped.
pub(crate) struct Scatter {
    /// The buffers' owners.
    _owned: Vec<OwnedBuffer>,
    /// Their handles, as the batches and `download_many` take them.
    pub(crate) buffers: Vec<ResidentBuffer>,
    /// Each copy's `(buffer index, offset)`.
    pub(crate) places: Vec<(usize, u64)>,
    /// Each copy's device address.
    pub(crate) ptrs: Vec<u64>,
}

impl Scatter {
    /// Allocates the 64 buffers on `d` and lays out `count` places of `size` bytes.
    pub(crate) fn new(d: &Device, count: usize, size: usize) -> BenchResult<Scatter> {
        let per = count.div_ceil(64);
        let stride = size as u64 + 64;
        // Owned: those allocated before a refusal are freed on the way out.
        let owned = (0..64)
            .map(|_| d.allocate_owned(per as u64 * stride))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        let buffers: Vec<ResidentBuffer> = owned.iter().map(OwnedBuffer::handle).collect();
        let places: Vec<(usize, u64)> = (0..count).map(|i| (i % 64, (i / 64) as u64 * stride)).collect();
        let ptrs = places
            .iter()
            .map(|&(b, o)| d.device_ptr(buffers[b]).map(|p| p + o))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        Ok(Scatter { _owned: owned, buffers, places, ptrs })
    }

    /// An upload batch of every copy from `sources` (one per copy), by `write`.
    pub(crate) fn copied_batch<'d>(
        &self,
        d: &'d Device,
        sources: &'d [Vec<u8>],
    ) -> cuda_resident::Result<UploadBatch<'d>> {
        let mut batch = d.uploads();
        for (src, &(b, o)) in sources.iter().zip(&self.places) {
            batch.write(self.buffers[b], o, src)?;
        }
        Ok(batch)
    }

    /// The same by `write_with`: each copy filled in place from its source.
    pub(crate) fn in_place_batch<'d>(
        &self,
        d: &'d Device,
        sources: &[Vec<u8>],
    ) -> cuda_resident::Result<UploadBatch<'d>> {
        let mut batch = d.uploads();
        for (src, &(b, o)) in sources.iter().zip(&self.places) {
            batch.write_with(self.buffers[b], o, src.len(), |dst| dst.copy_from_slice(src))?;
        }
        Ok(batch)
    }

    /// The same by `write_with_par`: each copy filled in place from its source at submit,
    /// on the packing threads.
    pub(crate) fn in_place_par_batch<'d>(
        &self,
        d: &'d Device,
        sources: &'d [Vec<u8>],
    ) -> cuda_resident::Result<UploadBatch<'d>> {
        let mut batch = d.uploads();
        for (src, &(b, o)) in sources.iter().zip(&self.places) {
            batch.write_with_par(self.buffers[b], o, src.len(), move |dst| dst.copy_from_slice(src))?;
        }
        Ok(batch)
    }

    /// A download batch of every copy's range, not yet submitted, its slots dropped: what
    /// `DownloadBatch::submit_into` takes, which lands the reads in order.
    pub(crate) fn read_batch<'d>(
        &self,
        d: &'d Device,
        size: usize,
    ) -> cuda_resident::Result<DownloadBatch<'d>> {
        let mut reads = d.downloads();
        for &(b, o) in &self.places {
            reads.read(self.buffers[b], o, size as u64)?;
        }
        Ok(reads)
    }

    /// A download batch of every copy's range, not yet submitted, and its slots, kept as a
    /// caller who knows the count keeps them: in a vector made with room for all. (Collected
    /// by `collect::<Result<Vec<_>, _>>`, which cannot tell the count, the vector grows as it
    /// fills, and on the H100 machine's host that took longer than the reads themselves:
    /// `benches/calls.rs`.)
    pub(crate) fn reads<'d>(
        &self,
        d: &'d Device,
        size: usize,
    ) -> cuda_resident::Result<(DownloadBatch<'d>, Vec<Slot>)> {
        let mut reads = d.downloads();
        let mut slots = Vec::with_capacity(self.places.len());
        for &(b, o) in &self.places {
            slots.push(reads.read(self.buffers[b], o, size as u64)?);
        }
        Ok((reads, slots))
    }

    /// Reads every copy's range back as one batch.
    pub(crate) fn read_all(&self, d: &Device, size: usize) -> cuda_resident::Result<(Vec<Slot>, Downloaded)> {
        let (reads, slots) = self.reads(d, size)?;
        Ok((slots, reads.submit()?.wait()?))
    }
}

/// Checks that every copy of `s` holds its source, reading all of `s`'s buffers back.
pub(crate) fn verify_scatter(
    d: &Device,
    s: &Scatter,
    sources: &[Vec<u8>],
    size: usize,
    what: &str,
) -> BenchResult<()> {
    let back = d.download_many(&s.buffers).map_err(|e| e.to_string())?;
    for (src, &(b, o)) in sources.iter().zip(&s.places) {
        if back[b][o as usize..][..size] != src[..] {
            return Err(crate::mismatch(format!(
                "{what}: a copy of {size} bytes to buffer {b} at {o} differs"
            )));
        }
    }
    Ok(())
}

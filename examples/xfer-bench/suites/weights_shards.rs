//! The weights suite's sharded rows: the checkpoint saved as `--weights-shards` shards in
//! Hugging Face's layout (`SaveOptions::shards`, written in parallel), timed as the one-file
//! save is, then loaded back from the index. Every shard is checked against the reference file,
//! every loaded tensor on the device against it.

use std::path::{Path, PathBuf};
use std::time::Instant;

use cuda_resident::weights::{Dtype, SaveOptions};
use cuda_resident::{Device, ResidentBuffer};
use cuda_resident_suite::weights::{compare, map};

use crate::cli::Args;
use crate::report::Row;
use crate::timing::median_of;
use crate::{BenchResult, error, mismatch};

/// The checkpoint the sharded rows work on.
pub(crate) struct Sharded<'a> {
    pub(crate) d: &'a Device,
    /// The reference file, written by the safetensors crate.
    pub(crate) path: &'a Path,
    /// Its tensors: name, start, length.
    pub(crate) ranges: &'a [(String, usize, usize)],
    pub(crate) batch_bytes: u64,
    /// The threads a save writes with, at most.
    pub(crate) threads: usize,
}

impl Sharded<'_> {
    /// Times the sharded save of `tensors` and the load of what it wrote; two rows.
    pub(crate) fn run(
        &self,
        args: &Args,
        tensors: &[(&str, Dtype, &[usize], ResidentBuffer)],
        what: &str,
        rows: &mut Vec<Row>,
    ) -> BenchResult<()> {
        let shards = args.weights_shards as usize;
        let dir = self.path.with_extension("shards");
        let stem = dir.join("weights.safetensors");
        let index = dir.join("weights.safetensors.index.json");
        let bytes: usize = self.ranges.iter().map(|r| r.2).sum();
        let note = format!(
            "shards preallocated and mapped where the file system allows (ext4, XFS, tmpfs), else pwrite; up to {} threads",
            self.threads
        );
        let save = median_of(args.reps, || {
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
            let t = Instant::now();
            let options = SaveOptions::new().shards(shards).batch_bytes(self.batch_bytes);
            self.d.save_safetensors_configured(&stem, tensors, options).map_err(error)?;
            let secs = t.elapsed().as_secs_f64();
            self.check_shards(&dir)?;
            Ok(secs)
        })?;
        let written = self.check_shards(&dir)?;
        rows.push(
            Row::gbps(format!("save {what}, {written} shards, into the page cache"), bytes, None, None, save)
                .noted(&note),
        );
        let load = median_of(args.reps, || {
            let t = Instant::now();
            let ckpt = self.d.load_safetensors(&index).map_err(error)?;
            Ok(t.elapsed().as_secs_f64()).inspect(|_| drop(ckpt))
        })?;
        let ckpt = self.d.load_safetensors(&index).map_err(error)?;
        let file = map(self.path)?;
        for r in self.ranges {
            let t = ckpt.get(&r.0).ok_or_else(|| format!("{} is missing from the sharded load", r.0))?;
            let got = self.d.download_range(t.buffer(), t.offset(), t.len()).map_err(error)?;
            compare(&r.0, &got, &file[r.1..r.1 + r.2]).map_err(mismatch)?;
        }
        drop(ckpt);
        rows.push(Row::gbps(format!("load {what}, {written} shards, page cache"), bytes, None, None, load));
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    /// Checks every shard in `dir` against the reference file, tensor by tensor, and that
    /// every tensor is in one; the number of shards.
    fn check_shards(&self, dir: &Path) -> BenchResult<usize> {
        let file = map(self.path)?;
        let mut shards: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| format!("listing {}: {e}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        shards.sort();
        let mut seen = 0;
        for shard in &shards {
            let bytes = map(shard)?;
            let st = safetensors::SafeTensors::deserialize(&bytes)
                .map_err(|e| format!("{}: {e}", shard.display()))?;
            for (name, view) in st.tensors() {
                let r = self
                    .ranges
                    .iter()
                    .find(|r| r.0 == name)
                    .ok_or_else(|| format!("{name} is not in the reference"))?;
                compare(&name, view.data(), &file[r.1..r.1 + r.2]).map_err(mismatch)?;
                seen += 1;
            }
        }
        if seen != self.ranges.len() {
            return Err(format!("the shards hold {seen} tensors, the checkpoint {}", self.ranges.len()));
        }
        Ok(shards.len())
    }
}

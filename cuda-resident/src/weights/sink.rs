//! The file a save writes into: either mapped (preallocated with `fallocate`, then written
//! by memory copies from any number of threads at once) or written with `pwrite`.
//!
//! Why both: buffered `pwrite`s into one file are serialized by the kernel (one writer at a
//! time per file: 3-6 GB/s on the H200 machine, whatever the thread count), while copies into
//! a shared mapping of a preallocated file scaled with threads (tmpfs: 13.4 GB/s at 16). The
//! mapping is used only on ext4, XFS and tmpfs, where `fallocate` made the space first: a
//! write fault that needs space on a full file system would kill the process with `SIGBUS`,
//! where `pwrite` returns `ENOSPC` ([`maps_safely`] says which file systems and why).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use memmap2::{MmapOptions, MmapRaw};

use super::error::WeightsError;
use crate::error::Result;

/// How a save writes its files ([`SaveOptions::write_mode`](super::SaveOptions::write_mode)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum WriteMode {
    /// Each file preallocated (`fallocate`) and mapped, its pieces copied in by every
    /// saving thread at once, on ext4, XFS and tmpfs (file systems where the preallocated
    /// space takes write faults with no allocation, so that a full disk cannot make a copy
    /// fault); files elsewhere, or that cannot be preallocated or mapped, are written as
    /// [`WriteMode::Pwrite`] says. The default.
    #[default]
    Mapped,
    /// `pwrite` into each file, by one thread a file (up to one per core): a file takes its
    /// bytes one writer at a time, as the kernel serializes buffered writes into a file.
    Pwrite,
}

#[cfg(test)]
thread_local! {
    /// Files this thread's saves mapped.
    pub(super) static MAPPED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// One file being written: its handle and path (which errors name), and, where it is
/// mapped, the mapping.
pub(super) struct Target {
    file: File,
    path: PathBuf,
    map: Option<MmapRaw>,
    len: u64,
}

impl Target {
    /// Creates the file at `path` (none may be there), `len` bytes long, preallocated and
    /// mapped where `mode` asks for it and the filesystem allows (else written with `pwrite`).
    pub(super) fn create(path: &Path, len: u64, mode: WriteMode) -> Result<Target> {
        // Readable too: a shared mapping for writing needs a descriptor open both ways. A new
        // file only: no other handle of this process has it open, let alone truncates it.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| WeightsError::io("creating", path, &e))?;
        let map = match Target::prepare(&file, path, len, mode) {
            Ok(map) => map,
            Err(e) => {
                // The file is this call's own, made above: gone again before the error returns.
                drop(file);
                let _ = std::fs::remove_file(path);
                return Err(e);
            }
        };
        #[cfg(test)]
        MAPPED.with(|n| n.set(n.get() + usize::from(map.is_some())));
        Ok(Target { file, path: path.to_owned(), map, len })
    }

    /// Sizes the new `file` and, where `mode` asks for it and its file system is one whose
    /// preallocated space takes write faults without allocating ([`maps_safely`]),
    /// preallocates and maps it.
    fn prepare(file: &File, path: &Path, len: u64, mode: WriteMode) -> Result<Option<MmapRaw>> {
        file.set_len(len).map_err(|e| WeightsError::io("sizing", path, &e))?;
        if mode != WriteMode::Mapped || !maps_safely(file) || !preallocate(file, path, len)? {
            return Ok(None);
        }
        // A file system that preallocates but maps no file for writing gets `pwrite`.
        Ok(MmapOptions::new().len(len as usize).map_raw(file).ok())
    }

    /// The file's path.
    #[cfg(test)]
    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    /// Whether copies into the file go through the mapping.
    pub(super) fn mapped(&self) -> bool {
        self.map.is_some()
    }

    /// Writes `bytes` at `at` of the file.
    pub(super) fn write(&self, bytes: &[u8], at: u64) -> Result<()> {
        let path = &self.path;
        let end = at.checked_add(bytes.len() as u64).filter(|&end| end <= self.len);
        let Some(_) = end else {
            // The save places every tensor inside the file it sized; reaching past it is a bug.
            let cause = std::io::Error::other(format!(
                "{} bytes at {at} reach past its {} bytes",
                bytes.len(),
                self.len
            ));
            return Err(WeightsError::io("writing", path, &cause).into());
        };
        match &self.map {
            // SAFETY: `at..end` lies inside the mapping (checked above), and the file is at
            // least as long: it is this save's own, created under a temporary name and sized
            // before it was mapped, and nothing of this process shrinks it (another process
            // that truncates it makes the copy fault, as `SaveOptions::write_mode` says). The
            // save hands each range of a file to one thread, so no two copies overlap, and
            // nothing reads the mapping while they run.
            Some(map) => unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), map.as_mut_ptr().add(at as usize), bytes.len());
            },
            None => self.file.write_all_at(bytes, at).map_err(|e| WeightsError::io("writing", path, &e))?,
        }
        Ok(())
    }
}

/// Whether `file` lies on a file system where the space `fallocate` made is written through
/// a mapping with no allocation at fault time: ext4, XFS, tmpfs. Not ZFS (whose `fallocate`
/// returns success and reserves nothing) nor btrfs (whose faults still reserve metadata, or
/// copy on write), where a full file system would make a copy fault (`SIGBUS`): others get
/// `pwrite`.
#[cfg(target_os = "linux")]
fn maps_safely(file: &File) -> bool {
    use std::os::fd::AsRawFd;
    const EXT4: i64 = 0xEF53;
    const XFS: i64 = 0x5846_5342;
    const TMPFS: i64 = 0x0102_1994;
    let mut fs = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: a plain system call on an open descriptor, into a struct it fills.
    if unsafe { libc::fstatfs(file.as_raw_fd(), fs.as_mut_ptr()) } != 0 {
        return false;
    }
    // SAFETY: filled by the call that succeeded.
    #[allow(clippy::unnecessary_cast, reason = "f_type's type differs between targets")]
    let kind = unsafe { fs.assume_init() }.f_type as i64;
    matches!(kind, EXT4 | XFS | TMPFS)
}

/// Elsewhere than Linux no file is mapped.
#[cfg(not(target_os = "linux"))]
fn maps_safely(_: &File) -> bool {
    false
}

/// Reserves every block of the `len` bytes of `file` (`fallocate`); `Ok(false)` where the
/// filesystem cannot (then nothing is reserved and the file is written with `pwrite`).
#[cfg(target_os = "linux")]
fn preallocate(file: &File, path: &Path, len: u64) -> Result<bool> {
    use std::os::fd::AsRawFd;
    let Ok(len) = libc::off_t::try_from(len) else { return Ok(false) };
    // SAFETY: a plain system call on an open descriptor this function borrows.
    if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) } == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG) => {
            Err(WeightsError::io("reserving room for", path, &e).into())
        }
        _ => Ok(false),
    }
}

/// Elsewhere than Linux nothing is preallocated: files are written with `pwrite`.
#[cfg(not(target_os = "linux"))]
fn preallocate(_: &File, _: &Path, _: u64) -> Result<bool> {
    Ok(false)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        std::env::temp_dir().join(format!("cuda-resident-sink-{name}-{}-{n}", std::process::id()))
    }

    #[test]
    fn both_modes_write_the_same_bytes_and_refuse_past_the_end() {
        for mode in [WriteMode::Mapped, WriteMode::Pwrite] {
            let path = scratch(&format!("{mode:?}"));
            let target = Target::create(&path, 10_000, mode).unwrap();
            assert!(mode == WriteMode::Mapped || !target.mapped());
            let bytes: Vec<u8> = (0..4000u32).map(|i| (i * 7 + 3) as u8).collect();
            target.write(&bytes, 6000).unwrap();
            target.write(&bytes[..10], 0).unwrap();
            for (at, len) in [(6001, 4000), (10_000, 1), (u64::MAX, 1), (u64::MAX - 1, 4000)] {
                let err = target.write(&bytes[..len], at).unwrap_err().to_string();
                assert!(err.contains("reach past its 10000 bytes"), "{err}");
            }
            target.write(&[], 10_000).unwrap();
            drop(target);
            let back = std::fs::read(&path).unwrap();
            std::fs::remove_file(&path).unwrap();
            assert_eq!(back.len(), 10_000);
            assert_eq!(&back[..10], &bytes[..10]);
            assert!(back[10..6000].iter().all(|&b| b == 0));
            assert_eq!(&back[6000..], &bytes[..]);
        }
    }

    /// Whether a file in the temporary directory can be mapped for a save: its file system
    /// is one of those and preallocates, asked directly.
    pub(in crate::weights) fn temp_dir_preallocates() -> bool {
        let path = scratch("probe");
        let file = OpenOptions::new().write(true).create(true).truncate(true).open(&path).unwrap();
        let preallocates = maps_safely(&file) && preallocate(&file, &path, 1 << 20).unwrap();
        std::fs::remove_file(&path).unwrap();
        preallocates
    }

    #[test]
    fn a_file_is_mapped_exactly_where_its_filesystem_preallocates() {
        let path = scratch("prealloc");
        let target = Target::create(&path, 1 << 20, WriteMode::Mapped).unwrap();
        let mapped = target.mapped();
        drop(target);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(mapped, temp_dir_preallocates());
        let target = Target::create(&path, 1 << 20, WriteMode::Pwrite).unwrap();
        assert!(!target.mapped());
        // A file already there is not opened again: another save's, or anyone's.
        let err = Target::create(&path, 1 << 20, WriteMode::Mapped).err().unwrap().to_string();
        assert!(err.contains("creating") && err.contains("Fix: "), "{err}");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_file_that_cannot_be_sized_is_removed_again() {
        // Past the largest file size of any file system: `set_len` fails after the file
        // was made.
        let path = scratch("too-large");
        let err = Target::create(&path, u64::MAX / 2, WriteMode::Mapped).err().unwrap().to_string();
        assert!(err.contains("sizing") && err.contains("Fix: "), "{err}");
        assert!(!path.exists(), "the file was removed again");
    }

    #[test]
    fn a_file_that_cannot_be_created_says_so_with_a_fix() {
        let path = Path::new("/no/such/dir/x.safetensors");
        let err = Target::create(path, 10, WriteMode::Mapped).err().unwrap().to_string();
        assert!(err.contains("creating /no/such/dir/x.safetensors") && err.contains("Fix: "), "{err}");
    }
}

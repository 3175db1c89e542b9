//! What can go wrong with a checkpoint: [`WeightsError`], held by
//! [`Error::Weights`](crate::Error::Weights). Every message says what happened, names the
//! file (and the tensor, where one is at fault) and ends with `Fix: …`.

use std::path::{Path, PathBuf};

/// Why a checkpoint could not be loaded or saved. Nothing of it stays allocated.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WeightsError {
    /// The file could not be opened, created, mapped, sized, written or renamed.
    #[error("{operation} {path} failed: {cause}. Fix: {fix}.", path = .path.display())]
    Io {
        /// What was done ("opening", "mapping", "creating", ...).
        operation: &'static str,
        /// The file.
        path: PathBuf,
        /// The operating system's error, as text.
        cause: String,
        /// What to do about it.
        fix: &'static str,
    },

    /// The file is shorter than its header says: cut short by a copy or a download.
    #[error(
        "{path} is truncated: {detail} (the file has {file_len} bytes). Fix: copy or download the \
         checkpoint again, whole, and compare its size with the source's.",
        path = .path.display()
    )]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Its length.
        file_len: u64,
        /// What is missing.
        detail: String,
    },

    /// The header is not a safetensors header, or it contradicts itself: offsets that
    /// overlap, leave holes, go backwards or past the end of the file, shapes whose bytes
    /// do not match their offsets.
    #[error(
        "{path} has a bad safetensors header: {detail}. Fix: the file is damaged or not a safetensors \
         checkpoint; write it again with a safetensors library (safetensors.torch.save_file, \
         Device::save_safetensors).",
        path = .path.display()
    )]
    BadHeader {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the tensor at fault where one is.
        detail: String,
    },

    /// A tensor's dtype is not one the safetensors crate this library is built with knows.
    #[error(
        "{path} has a tensor of a dtype this build does not know: {detail}. Fix: convert the tensor to a \
         known dtype (BF16, F16, F32, F8_E4M3, ...), or upgrade cuda-resident for a newer safetensors.",
        path = .path.display()
    )]
    UnknownDtype {
        /// The file.
        path: PathBuf,
        /// The parser's words, with the dtype.
        detail: String,
    },

    /// The checkpoint (or one of its tensors) needs more device memory than the device's
    /// budget allows at all, whatever else is freed.
    #[error(
        "{path}: {what} needs {bytes} bytes of device memory, but this device's budget is at most {limit} \
         bytes ({fraction} of {total}); nothing was allocated. Fix: load it on a GPU with more memory, shard \
         it across GPUs, or raise Config::budget_fraction.",
        path = .path.display()
    )]
    OverBudget {
        /// The file.
        path: PathBuf,
        /// "the checkpoint" or "tensor NAME".
        what: String,
        /// Bytes it needs.
        bytes: u64,
        /// The budget's ceiling: `budget_fraction` of the device's memory.
        limit: u64,
        /// `Config::budget_fraction`.
        fraction: f64,
        /// The device's memory.
        total: u64,
    },

    /// A tensor could not be allocated: the budget (with what else the device holds) or
    /// the driver refused. Everything allocated for the checkpoint before it was freed.
    #[error(
        "{path}: allocating tensor {tensor} ({bytes} bytes, {done} of the checkpoint's {total} bytes allocated \
         before it) failed, and what was allocated for the checkpoint was freed again: {cause}",
        path = .path.display()
    )]
    Allocation {
        /// The file.
        path: PathBuf,
        /// The tensor, or "the arena".
        tensor: String,
        /// Its bytes.
        bytes: u64,
        /// Bytes allocated for the checkpoint before it.
        done: u64,
        /// The checkpoint's bytes.
        total: u64,
        /// The allocator's error, which ends with its fix.
        cause: Box<crate::Error>,
    },

    /// A sharded checkpoint's index (`*.index.json`) is not Hugging Face's JSON, names a
    /// shard that is missing, or disagrees with its shards: a tensor it names that no shard
    /// holds, a tensor in a shard other than the one it names (or in two).
    #[error("{path} is not a usable checkpoint index: {detail}. Fix: {fix}.", path = .path.display())]
    BadIndex {
        /// The index file.
        path: PathBuf,
        /// What is wrong, naming the shard or tensor at fault.
        detail: String,
        /// What to do about it.
        fix: &'static str,
    },

    /// A tensor given to save does not fit its buffer, or its shape and dtype give no whole
    /// number of bytes, or two tensors have one name.
    #[error("tensor {tensor} cannot be saved: {detail}. Fix: {fix}.")]
    BadTensor {
        /// The tensor's name.
        tensor: String,
        /// What is wrong.
        detail: String,
        /// What to pass instead.
        fix: &'static str,
    },
}

impl WeightsError {
    /// An I/O failure of `operation` on `path`.
    pub(crate) fn io(operation: &'static str, path: &Path, cause: &std::io::Error) -> WeightsError {
        let fix = match cause.kind() {
            std::io::ErrorKind::NotFound => "check the path (it is taken relative to the working directory)",
            std::io::ErrorKind::PermissionDenied => "check the file's and its folder's permissions",
            _ if is_full(cause) => {
                "free room on the file system (or raise the quota), or save somewhere with room"
            }
            _ => "check that the path names a regular file on a healthy file system with room to spare",
        };
        WeightsError::Io { operation, path: path.to_owned(), cause: cause.to_string(), fix }
    }
}

/// Whether `cause` says the file system (or a quota, or a file size limit) is full.
fn is_full(cause: &std::io::Error) -> bool {
    #[cfg(target_os = "linux")]
    return matches!(cause.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG));
    #[cfg(not(target_os = "linux"))]
    return false;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_names_the_file_and_ends_with_a_fix() {
        let path = PathBuf::from("/m/model.safetensors");
        let cause = std::io::Error::from(std::io::ErrorKind::NotFound);
        let errors = [
            WeightsError::io("opening", &path, &cause),
            WeightsError::Truncated { path: path.clone(), file_len: 10, detail: "x".into() },
            WeightsError::BadHeader { path: path.clone(), detail: "tensor a overlaps b".into() },
            WeightsError::UnknownDtype { path: path.clone(), detail: "unknown variant `Q4`".into() },
            WeightsError::OverBudget {
                path: path.clone(),
                what: "the checkpoint".into(),
                bytes: 10,
                limit: 5,
                fraction: 0.9,
                total: 6,
            },
            WeightsError::Allocation {
                path: path.clone(),
                tensor: "a".into(),
                bytes: 1,
                done: 2,
                total: 3,
                cause: Box::new(crate::Error::ZeroSizedAllocation),
            },
            WeightsError::BadIndex { path: path.clone(), detail: "d".into(), fix: "f" },
        ];
        for e in errors {
            let text = crate::Error::from(e).to_string();
            assert!(text.contains("/m/model.safetensors"), "{text}");
            assert!(text.contains("Fix: ") && text.ends_with('.'), "{text}");
        }
        #[cfg(target_os = "linux")]
        for errno in [libc::ENOSPC, libc::EDQUOT, libc::EFBIG] {
            let full =
                WeightsError::io("reserving room for", &path, &std::io::Error::from_raw_os_error(errno));
            assert!(full.to_string().contains("Fix: free room on the file system"), "{full}");
        }
        let e = WeightsError::BadTensor { tensor: "a".into(), detail: "d".into(), fix: "f" };
        assert!(e.to_string().ends_with("Fix: f."));
    }
}

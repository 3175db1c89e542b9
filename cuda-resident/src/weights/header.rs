//! A checkpoint's header, read by the safetensors crate, then checked again here: every
//! tensor's byte range is worked out with checked arithmetic against the file's length
//! before anything is allocated, so that no offset of the file reaches the engine unchecked
//! (the crate checks too; this does not rely on it). Pure: no device, no file system.

use std::collections::HashMap;
use std::path::Path;

use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, SafeTensorError, TensorInfo};

use super::error::WeightsError;

/// One tensor of a checkpoint, where its bytes lie in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) name: String,
    pub(crate) dtype: Dtype,
    pub(crate) shape: Vec<usize>,
    /// The first byte of its data, from the start of the file.
    pub(crate) start: u64,
    /// Bytes of data.
    pub(crate) len: u64,
}

/// A checked header: the tensors in file order, and the free-form `__metadata__`.
#[derive(Clone, Debug)]
pub(crate) struct Header {
    pub(crate) entries: Vec<Entry>,
    pub(crate) metadata: Option<HashMap<String, String>>,
    /// Bytes of tensor data (the file less its header).
    pub(crate) data_bytes: u64,
}

/// The 8-byte length that starts every safetensors file.
const LEN_BYTES: u64 = 8;

/// Reads and checks the header of `file`, the whole checkpoint's bytes (`path` names it in
/// errors).
pub(crate) fn parse(path: &Path, file: &[u8]) -> Result<Header, WeightsError> {
    let file_len = file.len() as u64;
    let (header_len, metadata) = SafeTensors::read_metadata(file).map_err(|e| refusal(path, file, e))?;
    let data_start =
        LEN_BYTES.checked_add(header_len as u64).filter(|&s| s <= file_len).ok_or_else(|| {
            bad(path, format!("the header's length {header_len} reaches past the end of the file"))
        })?;
    let infos = metadata.offset_keys().into_iter().filter_map(|name| {
        let info = metadata.info(&name)?.clone();
        Some((name, info))
    });
    let entries = spans(data_start, file_len, infos).map_err(|detail| bad(path, detail))?;
    Ok(Header { entries, metadata: metadata.metadata().clone(), data_bytes: file_len - data_start })
}

/// The entries of `infos` (in the order of their data), their data starting at
/// `data_start` of a file of `file_len` bytes: each range inside the file, none
/// overlapping an earlier one or going backwards, each as long as its shape and dtype say.
/// Checked arithmetic throughout: an error, never an overflow, whatever the numbers.
pub(crate) fn spans(
    data_start: u64,
    file_len: u64,
    infos: impl IntoIterator<Item = (String, TensorInfo)>,
) -> Result<Vec<Entry>, String> {
    let mut entries: Vec<Entry> = Vec::new();
    let mut end_of_last = 0u64;
    for (name, info) in infos {
        let (s, e) = (info.data_offsets.0 as u64, info.data_offsets.1 as u64);
        if e < s {
            return Err(format!("tensor {name:?} ends (data_offsets {s}..{e}) before it starts"));
        }
        if s < end_of_last {
            let last = entries.last().map_or("", |l| l.name.as_str());
            return Err(format!(
                "tensor {name:?} (data_offsets {s}..{e}) overlaps tensor {last:?}, which ends at {end_of_last}, \
                 or comes before it"
            ));
        }
        let end = data_start.checked_add(e).filter(|&end| end <= file_len).ok_or_else(|| {
            format!(
                "tensor {name:?} (data_offsets {s}..{e}) reaches past the end of the file ({} bytes of data)",
                file_len.saturating_sub(data_start)
            )
        })?;
        let bytes = byte_len(&info.shape, info.dtype).ok_or_else(|| {
            format!(
                "tensor {name:?}'s shape {:?} of {} overflows or is no whole number of bytes",
                info.shape, info.dtype
            )
        })?;
        if bytes != e - s {
            return Err(format!(
                "tensor {name:?} is {:?} of {} ({bytes} bytes) but its data_offsets {s}..{e} hold {} bytes",
                info.shape,
                info.dtype,
                e - s
            ));
        }
        end_of_last = e;
        entries.push(Entry { name, dtype: info.dtype, shape: info.shape, start: end - (e - s), len: e - s });
    }
    Ok(entries)
}

/// Bytes of a tensor of `shape` and `dtype`: `None` on overflow, or where the bits are no
/// whole number of bytes.
pub(crate) fn byte_len(shape: &[usize], dtype: Dtype) -> Option<u64> {
    let elements = shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d as u64))?;
    let bits = elements.checked_mul(dtype.bitsize() as u64)?;
    (bits % 8 == 0).then_some(bits / 8)
}

/// For the fuzz target (`internals`): `parse` of `file`, as `(start, len)` of each tensor,
/// after checking what every success promises (each range inside the file, after the
/// header, in order and apart, as long as its shape says); a broken promise panics.
#[cfg(feature = "internals")]
pub fn check_parse(file: &[u8]) -> Result<Vec<(u64, u64)>, String> {
    let header = parse(Path::new("fuzz"), file).map_err(|e| e.to_string())?;
    let mut end = file.len() as u64 - header.data_bytes;
    for e in &header.entries {
        assert!(
            e.start >= end && e.start + e.len <= file.len() as u64,
            "{e:?} outside the file or overlapping"
        );
        assert_eq!(byte_len(&e.shape, e.dtype), Some(e.len));
        end = e.start + e.len;
    }
    Ok(header.entries.iter().map(|e| (e.start, e.len)).collect())
}

/// For the fuzz target (`internals`): `spans` of any numbers, `(begin, end)` offsets and
/// a shape of bf16 each; on success, the promises of [`check_parse`] are checked.
#[cfg(feature = "internals")]
pub fn check_spans(
    data_start: u64,
    file_len: u64,
    tensors: &[((u64, u64), Vec<usize>)],
) -> Result<(), String> {
    let infos = tensors.iter().enumerate().map(|(i, ((s, e), shape))| {
        let info =
            TensorInfo { dtype: Dtype::BF16, shape: shape.clone(), data_offsets: (*s as usize, *e as usize) };
        (format!("t{i}"), info)
    });
    let entries = spans(data_start, file_len, infos)?;
    let mut end = data_start;
    for e in &entries {
        assert!(e.start >= end && e.start.checked_add(e.len).is_some_and(|x| x <= file_len), "{e:?}");
        end = e.start + e.len;
    }
    Ok(())
}

fn bad(path: &Path, detail: String) -> WeightsError {
    WeightsError::BadHeader { path: path.to_owned(), detail }
}

/// The safetensors crate's refusal of `file`, as an error that says what is wrong with it.
fn refusal(path: &Path, file: &[u8], e: SafeTensorError) -> WeightsError {
    let file_len = file.len() as u64;
    let truncated = |detail: String| WeightsError::Truncated { path: path.to_owned(), file_len, detail };
    // The header's length as the file states it, for the messages only.
    let stated = file.get(..8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
    match e {
        SafeTensorError::HeaderTooSmall => {
            truncated("it ends before the 8 bytes that give the header's length".to_owned())
        }
        SafeTensorError::InvalidHeaderLength => truncated(format!(
            "its first 8 bytes give a header of {} bytes, which does not fit in the file",
            stated.unwrap_or(0)
        )),
        SafeTensorError::MetadataIncompleteBuffer => truncated(format!(
            "its tensors' data does not end where the file does (after a header of {} bytes): bytes are \
             missing at the end, or were added",
            stated.unwrap_or(0)
        )),
        SafeTensorError::InvalidHeaderDeserialization(e) if e.to_string().contains("unknown variant") => {
            WeightsError::UnknownDtype { path: path.to_owned(), detail: e.to_string() }
        }
        SafeTensorError::InvalidOffset(name) => bad(
            path,
            format!(
                "tensor {name:?}'s data_offsets overlap another tensor's, leave a hole before it, or go backwards"
            ),
        ),
        SafeTensorError::TensorInvalidInfo => {
            bad(path, "a tensor's shape and dtype give another byte count than its data_offsets".to_owned())
        }
        other => bad(path, other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(dtype: Dtype, shape: &[usize], s: usize, e: usize) -> TensorInfo {
        TensorInfo { dtype, shape: shape.to_vec(), data_offsets: (s, e) }
    }

    fn named(v: Vec<TensorInfo>) -> Vec<(String, TensorInfo)> {
        v.into_iter().enumerate().map(|(i, t)| (format!("t{i}"), t)).collect()
    }

    #[test]
    fn spans_place_each_tensor_after_the_header() {
        let e = spans(
            100,
            100 + 24,
            named(vec![info(Dtype::BF16, &[2, 4], 0, 16), info(Dtype::F32, &[2], 16, 24)]),
        )
        .unwrap();
        assert_eq!((e[0].start, e[0].len, e[1].start, e[1].len), (100, 16, 116, 8));
        assert!(spans(0, 0, Vec::new()).unwrap().is_empty());
        let empty = spans(8, 8, named(vec![info(Dtype::F32, &[0, 7], 0, 0)])).unwrap();
        assert_eq!(empty[0].len, 0);
    }

    /// What the crate refuses too, refused here on its own: this code does not trust it.
    #[test]
    fn lying_offsets_are_refused_by_the_checked_arithmetic() {
        let cases = [
            (named(vec![info(Dtype::U8, &[8], 0, 8), info(Dtype::U8, &[8], 4, 12)]), "overlaps"),
            (named(vec![info(Dtype::U8, &[8], 8, 16), info(Dtype::U8, &[8], 0, 8)]), "overlaps"),
            (named(vec![info(Dtype::U8, &[8], 8, 0)]), "before it starts"),
            (named(vec![info(Dtype::U8, &[64], 0, 64)]), "past the end"),
            (named(vec![info(Dtype::U8, &[1], usize::MAX - 1, usize::MAX)]), "past the end"),
            (named(vec![info(Dtype::BF16, &[8], 0, 8)]), "16 bytes"),
            (named(vec![info(Dtype::F64, &[usize::MAX, 3], 0, 8)]), "overflows"),
            (named(vec![info(Dtype::F4, &[3], 0, 2)]), "whole number"),
        ];
        for (infos, says) in cases {
            let err = spans(u64::MAX - 40, u64::MAX - 8, infos.clone()).unwrap_err();
            let err2 = spans(16, 48, infos).unwrap_err();
            assert!(err2.contains(says), "{err2} (wanted {says})");
            assert!(!err.is_empty());
        }
    }

    #[test]
    fn byte_len_counts_bits() {
        assert_eq!(byte_len(&[4096, 4096], Dtype::BF16), Some(32 << 20));
        assert_eq!(byte_len(&[], Dtype::F32), Some(4), "a scalar");
        assert_eq!(byte_len(&[3], Dtype::F4), None);
        assert_eq!(byte_len(&[4], Dtype::F4), Some(2));
        assert_eq!(byte_len(&[usize::MAX, usize::MAX], Dtype::U8), None);
    }

    fn file(header: &str, data: usize) -> Vec<u8> {
        let mut f = (header.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(header.as_bytes());
        f.resize(f.len() + data, 7);
        f
    }

    #[test]
    fn refusals_say_what_is_wrong() {
        let p = Path::new("m.safetensors");
        let good = r#"{"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}}"#;
        let h = parse(p, &file(good, 8)).unwrap();
        assert_eq!(h.entries.len(), 1);
        assert_eq!(h.entries[0].start, 8 + good.len() as u64);
        let cases: [(Vec<u8>, &str); 7] = [
            (file(good, 5), "truncated"),
            (file(good, 9), "truncated"),
            (vec![1, 2, 3], "before the 8 bytes"),
            (
                {
                    let mut f = file(good, 8);
                    f[..8].copy_from_slice(&1000u64.to_le_bytes());
                    f
                },
                "does not fit",
            ),
            (
                file(r#"{"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,1]}}"#, 1),
                "dtype this build does not know",
            ),
            (
                file(
                    r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#,
                    6,
                ),
                "bad safetensors header",
            ),
            (file("not json", 0), "bad safetensors header"),
        ];
        for (bytes, says) in cases {
            let text = crate::Error::from(parse(p, &bytes).unwrap_err()).to_string();
            assert!(text.contains(says) && text.contains("Fix: "), "{text} (wanted {says})");
        }
    }
}

//! Fuzzes the checkpoint header path of `cuda_resident::weights`: any bytes as a whole
//! safetensors file (the safetensors crate parses the header; the library then checks every
//! offset again with checked arithmetic), and any numbers as a header's offsets and shapes
//! given straight to the library's own checks, which must not trust them.
//!
//! Neither may panic or overflow; on success, every tensor lies inside the file, after the
//! header, in order and apart, as long as its shape and dtype say
//! (`internals::weights_header::{check_parse, check_spans}` assert it).

#![no_main]

use arbitrary::Arbitrary;
use cuda_resident::internals::weights_header::{check_parse, check_spans};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Input {
    /// A file: its bytes as given.
    File(Vec<u8>),
    /// A file made of a JSON header of the fuzzer's text and some data bytes, so that
    /// well-formed headers (and near misses) are common.
    Header { json: String, data: u16 },
    /// Offsets and shapes as any numbers.
    Spans { data_start: u64, file_len: u64, tensors: Vec<((u64, u64), Vec<usize>)> },
}

fuzz_target!(|input: Input| {
    match input {
        Input::File(bytes) => drop(check_parse(&bytes)),
        Input::Header { json, data } => {
            let mut file = (json.len() as u64).to_le_bytes().to_vec();
            file.extend_from_slice(json.as_bytes());
            file.resize(file.len() + usize::from(data), 0);
            drop(check_parse(&file));
        }
        Input::Spans { data_start, file_len, tensors } => drop(check_spans(data_start, file_len, &tensors)),
    }
});

//! The routes, one file each: how a batch that `plan::route` sent one way packs and runs an
//! [`Exec`](super::Exec). The routes whose batches are made above the engine (uploads in
//! order, in place and planned, planned and streamed downloads) run from `transfer/`, on
//! the pieces here: a planned download chunk's work ([`download_chunk`]).

pub(crate) mod download_chunk;
pub(crate) mod one;
pub(crate) mod pinned;

//! The routes, one file each: how a batch that `plan::route` sent one way packs and runs an
//! [`Exec`](super::Exec). A batch made above the engine hands its route a view of its parts
//! ([`view::UploadView`]: borrows, nothing copied), so that no route reads the batch type
//! itself. The download routes whose batches are read whole (planned and streamed
//! downloads) still run from `transfer/`, on the pieces here: a planned download chunk's
//! work ([`download_chunk`]).
pub(crate) mod download_chunk;
pub(crate) mod in_place;
pub(crate) mod one;
pub(crate) mod pinned;
pub(crate) mod upload_in_order;
pub(crate) mod upload_planned;
pub(crate) mod view;

//! The routes, one file each: how a batch that `plan::route` sent one way packs and runs an
//! [`Exec`](super::Exec). A batch made above the engine hands its route a view of its parts
//! ([`view::UploadView`], [`view::DownloadView`]: borrows, nothing copied), so that no route
//! reads the batch type itself; a download route hands back where the bytes land
//! ([`view::Landed`]), of which the batch makes its pending download. A planned download
//! chunk's work, streamed or not, is [`download_chunk`]'s.
pub(crate) mod download_chunk;
pub(crate) mod download_in_order;
pub(crate) mod download_planned;
pub(crate) mod in_place;
pub(crate) mod one;
pub(crate) mod pinned;
pub(crate) mod streamed;
pub(crate) mod upload_in_order;
pub(crate) mod upload_planned;
pub(crate) mod view;

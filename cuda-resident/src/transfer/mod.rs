//! Batches between host and device, and the blocking conveniences over them.
//!
//! A batch collects and checks its requests ([`UploadBatch`], [`DownloadBatch`], against
//! the [`BufferTable`] of the buffers it names), asks `crate::plan` for
//! its route and layout, and moves through the executor (`crate::engine`): its `submit`
//! lends the route (in `crate::engine::routes`) a view of its parts, borrowed. Prepared sets
//! lay out a fixed set of ranges once; single copies move one range.

pub(crate) mod convenience;
pub(crate) mod download;
pub(crate) mod prepared;
pub(crate) mod scope;
pub(crate) mod single;
pub(crate) mod slices;
pub(crate) mod upload;

pub(crate) use crate::engine::table::BufferTable;
pub use download::{DownloadBatch, Downloaded, PendingDownload, Slot};
pub use prepared::{PreparedDownloads, PreparedUploads};
pub use scope::Scope;
pub use upload::UploadBatch;

#[cfg(test)]
mod adversary_tests;
#[cfg(test)]
mod batch_kind_tests;
#[cfg(test)]
mod bulk_tests;
#[cfg(test)]
mod callback_tests;
#[cfg(test)]
mod counter_tests;
#[cfg(test)]
mod download_tests;
#[cfg(test)]
mod edge_tests;
#[cfg(test)]
mod lifetime_tests;
#[cfg(test)]
mod memory_tests;
#[cfg(test)]
mod misuse_tests;
#[cfg(test)]
pub(crate) mod model_tests;
#[cfg(test)]
mod order_tests;
#[cfg(test)]
mod par_tests;
#[cfg(test)]
mod pipeline_tests;
#[cfg(test)]
mod prepared_tests;
#[cfg(test)]
mod scope_misuse_tests;
#[cfg(test)]
mod scope_parts_tests;
#[cfg(test)]
mod scope_tests;
#[cfg(test)]
mod synchronize_tests;
#[cfg(test)]
mod threads_tests;

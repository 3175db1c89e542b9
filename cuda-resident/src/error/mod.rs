//! The one error type of the crate. Every message says what happened and ends with `Fix: …`.

use cuda_sys::CUresult;

use crate::handle::ResidentBuffer;

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong. Each variant's message says what happened and how to fix it.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No CUDA driver library could be loaded.
    #[error(transparent)]
    Load(#[from] cuda_sys::LoadError),

    /// The loaded driver lacks an entry point this operation needs.
    #[error(transparent)]
    MissingSymbol(#[from] cuda_sys::MissingSymbol),

    /// A driver call returned an error.
    #[error("{entry} failed with {name} ({code}): {text}. Fix: {fix}.", fix = driver_fix(*.code))]
    Driver {
        /// The entry point, as exported (`cuMemAlloc_v2`).
        entry: &'static str,
        /// The raw `CUresult`.
        code: CUresult,
        /// Its name (`CUDA_ERROR_OUT_OF_MEMORY`), or `unknown CUresult` for codes the driver
        /// does not name.
        name: String,
        /// The driver's description.
        text: String,
    },

    /// The ordinal passed to [`Device::open`](crate::Device::open) names no device.
    #[error(
        "device ordinal {ordinal} does not exist: the driver sees {count} CUDA device(s). \
         Fix: pass an ordinal below {count} (Device::count() tells), and check CUDA_VISIBLE_DEVICES."
    )]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices the driver sees.
        count: usize,
    },

    /// A [`Config`](crate::Config) field is out of its range.
    #[error("Config::{field} = {value} is invalid: {reason}. Fix: {fix}.")]
    InvalidConfig {
        /// The field.
        field: &'static str,
        /// Its value, as text.
        value: String,
        /// Why it is invalid.
        reason: &'static str,
        /// What to set instead.
        fix: &'static str,
    },

    /// An allocation of zero bytes.
    #[error("cannot allocate a buffer of 0 bytes. Fix: ask for at least 1 byte.")]
    ZeroSizedAllocation,

    /// The allocation would take device memory past the budget.
    #[error(
        "allocating {requested} bytes needs {needed} more bytes from the driver, but this device holds {held} \
         bytes already and its budget allows {limit} ({fraction} of {total} total){driver_oom}. Of the {held} \
         bytes held, {in_use} are in your buffers, {library} in the library's own (device staging, prepared \
         sets' tables), and the rest free in slabs and caches or freed but still used by copies in flight. \
         Fix: free buffers you no longer need, or raise Config::budget_fraction."
    , driver_oom = if *.driver_out_of_memory { ", and cuMemAlloc_v2 reported out of memory" } else { "" })]
    OverBudget {
        /// Bytes asked for.
        requested: u64,
        /// Bytes the allocation needed from the driver (a block, a slab, a dedicated
        /// allocation): past the budget, `held + needed > limit`.
        needed: u64,
        /// Bytes of device memory this device held from the driver when the request came.
        held: u64,
        /// Of `held`, bytes in callers' live buffers ([`Device::allocated_bytes`](crate::Device::allocated_bytes)).
        in_use: u64,
        /// Of `held`, bytes in the library's own buffers.
        library: u64,
        /// The budget's limit on held bytes at that time.
        limit: u64,
        /// The device's total memory.
        total: u64,
        /// The configured budget fraction.
        fraction: f64,
        /// Whether the driver itself ran out of memory (after trimming caches and retrying).
        driver_out_of_memory: bool,
    },

    /// A buffer handle that was freed (and perhaps its slot reused).
    #[error(
        "{buffer:?} was already freed. \
         Fix: do not use a buffer after Device::free (or after its OwnedBuffer is dropped); allocate a new one."
    )]
    FreedBuffer {
        /// The stale handle.
        buffer: ResidentBuffer,
    },

    /// A buffer handle made by another [`Device`](crate::Device) (or never made at all).
    #[error(
        "{buffer:?} does not belong to this device (device {device}). \
         Fix: pass each buffer to the Device that allocated it."
    )]
    ForeignBuffer {
        /// The handle.
        buffer: ResidentBuffer,
        /// The ordinal of the device it was passed to.
        device: usize,
    },

    /// [`Device::free`](crate::Device::free) of a buffer that a cudarc view
    /// (`Device::cudarc_view`, feature `cudarc`) still shows: work enqueued through the view
    /// may still use the memory.
    #[error(
        "{buffer:?} cannot be freed: {views} cudarc view(s) of it are alive, and work enqueued through them may \
         still use its memory. Fix: drop the ResidentView first (its drop waits for the work enqueued through \
         it), then free the buffer."
    )]
    BufferViewed {
        /// The handle.
        buffer: ResidentBuffer,
        /// The views of it alive.
        views: usize,
    },

    /// Two GPUs that cannot access each other's memory (no NVLink or PCIe peer path).
    #[error(
        "device {device} cannot access the memory of device {peer}: the driver reports no peer path between them. \
         Fix: copies between them still work without it (Device::peer_copies stages them through host memory, \
         slower); `nvidia-smi topo -m` shows how the GPUs are linked."
    )]
    PeerUnsupported {
        /// The ordinal of the device that would read or write.
        device: usize,
        /// The ordinal of the device whose memory it would access.
        peer: usize,
    },

    /// A device index past the end of a [`DeviceSet`](crate::DeviceSet).
    #[error(
        "device index {index} is not in this set of {len} device(s). Fix: pass an index below {len} \
         (DeviceSet::len tells)."
    )]
    NotInSet {
        /// The index asked for.
        index: usize,
        /// Devices in the set.
        len: usize,
    },

    /// A batch could not be planned (too large, or a request out of range).
    #[error(transparent)]
    Plan(#[from] PlanError),

    /// A byte range that does not lie inside its buffer.
    #[error(
        "the range of {len} bytes at offset {offset} does not fit in {buffer:?}, which holds {buffer_len} bytes. \
         Fix: keep offset + len within the buffer (Device::buffer_len tells its size)."
    )]
    OutOfRange {
        /// The buffer.
        buffer: ResidentBuffer,
        /// The range's offset.
        offset: u64,
        /// The range's length.
        len: u64,
        /// The buffer's length.
        buffer_len: u64,
    },

    /// A download slot redeemed by the download of another batch than the one that gave it.
    #[error(
        "slot {index} of download batch {slot_batch} was given to the download of batch {batch}: it names a read of \
         another batch, whose bytes are not here. Fix: redeem each Slot with the Downloaded (or PendingDownload) of \
         the batch that returned it; for a prepared set, use its own slots (PreparedDownloads::slot) with its downloads."
    )]
    ForeignSlot {
        /// The slot's index in its batch.
        index: u32,
        /// The identity of the slot's batch.
        slot_batch: u64,
        /// The identity of the download's batch.
        batch: u64,
    },

    /// Host memory for a result could not be reserved.
    #[error(
        "could not reserve {bytes} bytes of host memory for the result. Fix: read in smaller ranges, or into a slice you own (Device::download_to_slice)."
    )]
    HostOutOfMemory {
        /// Bytes asked for.
        bytes: u64,
    },

    /// Two lists that must have the same length do not.
    #[error("{what} have different lengths: {left} and {right}. Fix: pass one entry of each per item.")]
    LengthMismatch {
        /// What the two lists are.
        what: &'static str,
        /// The first list's length.
        left: usize,
        /// The second list's length.
        right: usize,
    },

    /// A value handed over from another crate (the `cudarc` feature) does not fit the call:
    /// a stream of another context, a buffer that is not a whole number of elements.
    #[error("{what}. Fix: {fix}.")]
    Interop {
        /// What does not fit, with the values.
        what: String,
        /// What to pass instead.
        fix: &'static str,
    },

    /// An item of data for a prepared upload does not have its range's length.
    #[error(
        "prepared upload range {index} is {expected} bytes long but its data has {got} bytes; nothing was uploaded. \
         Fix: pass, for each range in the order it was prepared, data of exactly its length (or prepare the ranges again)."
    )]
    PreparedDataLength {
        /// The range's index in the prepared set.
        index: usize,
        /// The range's length.
        expected: u64,
        /// The data's length.
        got: usize,
    },

    /// An upload batch whose write failed part-way: its `write_with` closure panicked, or the
    /// write was refused pinned memory. The batch takes no more writes and moves nothing.
    #[error(
        "write {write} of this upload batch ({len} bytes at offset {offset} of {buffer:?}) {cause}; \
         the batch is poisoned: it takes no more writes and nothing of it was or will be moved. \
         Fix: drop this batch and build the writes again in a new one (Device::uploads), after \
         fixing what made the write fail."
    )]
    BatchPoisoned {
        /// The failed write's index in the batch (writes counted in the order added).
        write: usize,
        /// Its buffer.
        buffer: ResidentBuffer,
        /// Its offset.
        offset: u64,
        /// Its length.
        len: u64,
        /// What happened: "panicked in its fill closure", or the refusal and its error's text.
        cause: String,
    },

    /// An item of a list call (`<single>_many`:
    /// [`UploadBatch::write_many`](crate::UploadBatch::write_many),
    /// [`DownloadBatch::read_many`](crate::DownloadBatch::read_many),
    /// [`DownloadBatch::read_buffer_many`](crate::DownloadBatch::read_buffer_many),
    /// [`DownloadBatch::read_to_slice_many`](crate::DownloadBatch::read_to_slice_many)) was
    /// refused: `error` is what the single call (`write`, `read`, `read_buffer`,
    /// `read_to_slice`) would have returned for it.
    #[error("item {index} of {call}: {error}")]
    BadItem {
        /// The call.
        call: &'static str,
        /// The item's index in the call's list (0 for the first).
        index: usize,
        /// The item's own error, which ends with its fix.
        error: Box<Error>,
    },

    /// The iterator given to a bulk call (those of [`Error::BadItem`]) panicked while
    /// producing item `index`. The panic went on to the caller; a caller that catches it
    /// finds the batch keeping this error: `submit` returns it and moves nothing, neither the
    /// items the call added before the panic nor any other.
    #[error(
        "the iterator given to {call} panicked while producing item {index}, so this batch holds only part of \
         that call's items and moves none of its writes or reads. Fix: make the iterator not panic, then build \
         the batch again in a new one."
    )]
    ItemsPanicked {
        /// The call.
        call: &'static str,
        /// The index of the item the iterator was producing (the items before it were added).
        index: usize,
    },

    /// A fill closure of [`UploadBatch::write_with_par`](crate::UploadBatch::write_with_par)
    /// panicked during `submit`. Staging moves lease by lease, each once all its fills are
    /// done: no byte of the lease that holds this write, or of any later lease, was moved; the
    /// writes of earlier leases may have landed, each whole. No write's destination holds
    /// bytes that no fill produced.
    #[error(
        "the fill closure of write {write} of this upload batch ({len} bytes at offset {offset} of {buffer:?}) \
         panicked during submit ({cause}); that write and the writes staged after it were not moved (writes \
         staged before it may have landed, each whole). Fix: make the fill closure not panic (or fill with \
         write_with, whose panics reach the caller), then write the batch again in a new one (Device::uploads)."
    )]
    FillPanicked {
        /// The write's index in the batch (writes counted in the order added).
        write: usize,
        /// Its buffer.
        buffer: ResidentBuffer,
        /// Its offset.
        offset: u64,
        /// Its length.
        len: u64,
        /// The panic's message.
        cause: String,
    },

    /// [`Device::upload`](crate::Device::upload) was given data of another length than the
    /// buffer's.
    #[error(
        "Device::upload writes whole buffers, but {buffer:?} holds {buffer_len} bytes and the data has \
         {data_len}; nothing was uploaded. Fix: pass exactly {buffer_len} bytes, or use upload_at for a \
         partial write."
    )]
    UploadLength {
        /// The buffer.
        buffer: ResidentBuffer,
        /// Its length.
        buffer_len: u64,
        /// The data's length.
        data_len: usize,
    },

    /// An empty host range where one of at least a byte is needed.
    #[error(
        "{operation} was given 0 bytes of host memory at {address:#x}: an empty range cannot be \
         pinned. Fix: pass the length of the range to pin, at least 1 byte."
    )]
    EmptyHostRange {
        /// The operation.
        operation: &'static str,
        /// The start of the range.
        address: usize,
    },

    /// A pinned memory request larger than the pool's cap.
    #[error(
        "pinned staging of {requested} bytes was requested but the pool is capped at {cap} bytes. \
         Fix: raise Config::pinned_cap_bytes, or split the work into smaller batches."
    )]
    PinnedCapExceeded {
        /// Bytes asked for.
        requested: u64,
        /// `Config::pinned_cap_bytes`.
        cap: u64,
    },

    /// The pinned pool is full of regions the caller still holds.
    #[error(
        "pinned staging of {requested} bytes is not available: {lent} of the pool's {cap} bytes are lent out (to \
         PinnedBuffers, prepared sets or Downloads still alive, or to the in-place writes of batches not yet \
         submitted), and neither copies in flight nor other threads' transfers gave any back. Fix: drop \
         PinnedBuffers and Downloads you are done with, split a batch of in-place writes (write_with, \
         write_with_par) into smaller ones, or raise Config::pinned_cap_bytes."
    )]
    PinnedExhausted {
        /// Bytes asked for.
        requested: u64,
        /// `Config::pinned_cap_bytes`.
        cap: u64,
        /// Bytes lent out.
        lent: u64,
    },

    /// A download batch or prepared set given more reads than a slot can number.
    #[error(
        "a download batch holds at most {most} reads (a Slot numbers them in 32 bits), and this one \
         would hold more; nothing was added. Fix: split the reads into several batches."
    )]
    TooManyReads {
        /// The most reads a batch holds.
        most: usize,
    },

    /// Held pinned memory (pinned buffers, prepared sets' regions, download views) would take
    /// the part of the pool kept for transfers.
    #[error(
        "{requested} bytes of pinned memory to keep were requested, but {held} bytes of the pool are already \
         held by PinnedBuffers, prepared sets and Downloads, and they may hold at most {limit} of its {cap} \
         bytes: the rest is kept for transfers, so that they never fail for want of staging. \
         Fix: drop PinnedBuffers, prepared sets and Downloads you are done with, or raise \
         Config::pinned_cap_bytes."
    )]
    PinnedReserved {
        /// Bytes asked for.
        requested: u64,
        /// Bytes already held.
        held: u64,
        /// The most held staging may take (the cap less the reserve for transfers).
        limit: u64,
        /// `Config::pinned_cap_bytes`.
        cap: u64,
    },

    /// Host memory given to an asynchronous copy is not pinned (page-locked).
    #[error(
        "{operation} was given {len} bytes of host memory at {address:#x} whose byte at {unpinned:#x} \
         is not pinned (page-locked): the driver would copy it synchronously, and the copy would not \
         overlap anything. Nothing was enqueued. Fix: pin the range with Device::pin_host, copy from \
         or into memory from Device::pinned, or use the safe upload_at / download_to_slice, which \
         stage pageable memory themselves."
    )]
    NotPinned {
        /// The operation.
        operation: &'static str,
        /// The start of the range.
        address: usize,
        /// Its length.
        len: usize,
        /// A byte of it that is not pinned.
        unpinned: usize,
    },

    /// A safetensors checkpoint could not be loaded or saved (feature `safetensors`).
    #[cfg(feature = "safetensors")]
    #[cfg_attr(docsrs, doc(cfg(feature = "safetensors")))]
    #[error(transparent)]
    Weights(#[from] crate::weights::WeightsError),
}

/// Why a batch could not be planned. Nothing of the batch was planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// A request reaches past the end of its buffer (or `offset + len` overflows `u64`).
    #[error(
        "request {index} (buffer {buffer}, offset {offset}, len {len}) reaches past the end of its \
         buffer of {buffer_len} bytes; the whole batch was rejected. Fix: keep offset + len within \
         the buffer's length"
    )]
    OutOfRange {
        /// The request's position in the batch.
        index: usize,
        /// The buffer it names, by its number in the batch.
        buffer: u64,
        /// Its offset.
        offset: u64,
        /// Its length.
        len: u64,
        /// The buffer's length.
        buffer_len: u64,
    },
    /// The planner's alignment is not a power of two.
    #[error(
        "the plan config's align is {align}, which is not a power of two. Fix: use a power of two \
         such as 16 (the default)"
    )]
    InvalidAlign {
        /// The rejected alignment.
        align: u64,
    },
    /// The planner's chunk is smaller than its alignment, so a chunk could hold nothing.
    #[error(
        "the plan config's chunk_bytes ({chunk_bytes}) is smaller than its align ({align}), so a \
         chunk could hold nothing. Fix: make chunk_bytes at least align (the default is 8 MiB)"
    )]
    ChunkTooSmall {
        /// The rejected chunk size.
        chunk_bytes: u64,
        /// The alignment it must hold.
        align: u64,
    },
    /// The batch has more requests than a `u32` index can name.
    #[error(
        "the batch has {count} requests, more than the {} the planner can index. Fix: split the batch",
        u32::MAX
    )]
    TooManyRequests {
        /// How many requests the batch has.
        count: usize,
    },
    /// The batch needs more than `u32::MAX` chunks, or more than `u64::MAX` bytes of staging.
    #[error(
        "the batch needs more than {} chunks of {chunk_capacity} bytes of staging. Fix: split the \
         batch, or raise chunk_bytes",
        u32::MAX
    )]
    TooLarge {
        /// The chunk capacity the batch was planned with.
        chunk_capacity: u64,
    },
    /// Memory for the plan's chunk list could not be reserved.
    #[error(
        "could not reserve memory for a plan of {chunks} chunks. Fix: split the batch, or raise \
         chunk_bytes so that it needs fewer chunks"
    )]
    OutOfMemory {
        /// How many chunks the plan needed.
        chunks: u64,
    },
}

impl Error {
    /// Item `index` of the bulk call `call` refused for `error`, kept in `batch_error` (the
    /// error a batch's `submit` returns) unless that holds one already.
    pub(crate) fn bad_item(
        batch_error: &mut Option<Error>,
        call: &'static str,
        index: usize,
        error: Error,
    ) -> Error {
        let e = Error::BadItem { call, index, error: Box::new(error) };
        batch_error.get_or_insert_with(|| e.clone());
        e
    }

    /// Runs `body` on `batch`: a bulk call's loop over the caller's items, which counts in
    /// `at` the items it added and returns the error of the first bad one. That error is
    /// returned as [`Error::BadItem`] (of `call`, item `at`) and kept as the batch's
    /// (`error_of(batch)`, the error its `submit` returns) unless it holds one already. If
    /// `body` panics (the caller's iterator did), the batch keeps [`Error::ItemsPanicked`]
    /// instead and the panic goes on: a caller that catches it cannot move half the call.
    pub(crate) fn add_items<B: ?Sized>(
        call: &'static str,
        batch: &mut B,
        error_of: fn(&mut B) -> &mut Option<Error>,
        body: impl FnOnce(&mut B, &mut usize) -> Result<()>,
    ) -> Result<()> {
        let mut at = 0;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(batch, &mut at))) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => Err(Error::bad_item(error_of(batch), call, at, error)),
            Err(panic) => {
                error_of(batch).get_or_insert(Error::ItemsPanicked { call, index: at });
                std::panic::resume_unwind(panic)
            }
        }
    }

    /// Whether this is the pinned pool refusing staging: more than the cap, more than is free
    /// of what callers hold, or more held staging than the reserve for transfers leaves. A
    /// download so refused streams through the pool; a prepared set moves as batches.
    pub(crate) fn is_staging_refusal(&self) -> bool {
        matches!(
            self,
            Error::PinnedCapExceeded { .. } | Error::PinnedExhausted { .. } | Error::PinnedReserved { .. }
        )
    }

    /// Whether this is a driver error that loses the context (a fault on the GPU): every
    /// later call fails the same way and no work of the context runs any more.
    pub(crate) fn context_is_lost(&self) -> bool {
        use cuda_sys::{
            CUDA_ERROR_ECC_UNCORRECTABLE, CUDA_ERROR_HARDWARE_STACK_ERROR, CUDA_ERROR_ILLEGAL_ADDRESS,
            CUDA_ERROR_ILLEGAL_INSTRUCTION, CUDA_ERROR_INVALID_PC, CUDA_ERROR_LAUNCH_FAILED,
            CUDA_ERROR_MISALIGNED_ADDRESS,
        };
        const LOST: [cuda_sys::CUresult; 7] = [
            CUDA_ERROR_ILLEGAL_ADDRESS,
            CUDA_ERROR_LAUNCH_FAILED,
            CUDA_ERROR_HARDWARE_STACK_ERROR,
            CUDA_ERROR_ILLEGAL_INSTRUCTION,
            CUDA_ERROR_MISALIGNED_ADDRESS,
            CUDA_ERROR_INVALID_PC,
            CUDA_ERROR_ECC_UNCORRECTABLE,
        ];
        self.cuda_code().is_some_and(|code| LOST.contains(&code))
    }

    /// Whether the work queued in the context will never run: the context is lost to a
    /// fault ([`Error::context_is_lost`]), destroyed, or the driver is shutting down.
    pub(crate) fn work_never_runs(&self) -> bool {
        use cuda_sys::{CUDA_ERROR_CONTEXT_IS_DESTROYED, CUDA_ERROR_DEINITIALIZED};
        self.context_is_lost()
            || self
                .cuda_code()
                .is_some_and(|c| c == CUDA_ERROR_DEINITIALIZED || c == CUDA_ERROR_CONTEXT_IS_DESTROYED)
    }

    /// The `CUresult` of a driver error, if this is one.
    pub fn cuda_code(&self) -> Option<CUresult> {
        match self {
            Error::Driver { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// The advice for a failing driver call, by code.
fn driver_fix(code: CUresult) -> &'static str {
    use cuda_sys::*;
    match code {
        CUDA_ERROR_OUT_OF_MEMORY => {
            "free device or pinned memory (Device::trim releases cached memory), or lower Config::budget_fraction \
             so that other users of the GPU keep room"
        }
        CUDA_ERROR_NO_DEVICE | CUDA_ERROR_INVALID_DEVICE => {
            "run on a machine with an NVIDIA GPU, and check that CUDA_VISIBLE_DEVICES does not hide it"
        }
        CUDA_ERROR_NOT_INITIALIZED | CUDA_ERROR_DEINITIALIZED => {
            "the driver was not initialised or is shutting down; open the Device again and keep it alive while \
             it is used"
        }
        CUDA_ERROR_SYSTEM_DRIVER_MISMATCH
        | CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER
        | CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE => {
            "install an NVIDIA driver that supports CUDA 13.0 or newer (R580+)"
        }
        CUDA_ERROR_ILLEGAL_ADDRESS
        | CUDA_ERROR_LAUNCH_FAILED
        | CUDA_ERROR_HARDWARE_STACK_ERROR
        | CUDA_ERROR_ILLEGAL_INSTRUCTION
        | CUDA_ERROR_MISALIGNED_ADDRESS
        | CUDA_ERROR_INVALID_PC
        | CUDA_ERROR_ECC_UNCORRECTABLE => {
            "the GPU context is no longer usable after this fault; restart the process (run compute-sanitizer to \
             find the kernel at fault)"
        }
        CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => "unpin the range first, or do not pin it twice",
        CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED => "pin the range with Device::pin_host before this call",
        _ => "check the driver's health (nvidia-smi); if it is healthy, report this with the message above",
    }
}

/// A `Fix:`-terminated error from a driver result, for the one place each entry point is
/// wrapped ([`crate::raw`]).
pub(crate) fn driver_error(driver: &cuda_sys::Driver, entry: &'static str, code: CUresult) -> Error {
    Error::Driver {
        entry,
        code,
        name: driver.error_name(code).unwrap_or("unknown CUresult").to_owned(),
        text: driver.error_string(code).unwrap_or("no description").to_owned(),
    }
}

#[cfg(test)]
mod tests;

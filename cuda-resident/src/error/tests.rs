//! Every error's text: what happened, then a `Fix:`.

use super::*;

#[test]
fn every_message_ends_with_a_fix() {
    let buffer = ResidentBuffer::test_handle(1, 2, 3);
    let errors = [
        Error::Driver {
            entry: "cuMemAlloc_v2",
            code: cuda_sys::CUDA_ERROR_OUT_OF_MEMORY,
            name: "CUDA_ERROR_OUT_OF_MEMORY".into(),
            text: "out of memory".into(),
        },
        Error::NoSuchDevice { ordinal: 3, count: 1 },
        Error::InvalidConfig {
            field: "budget_fraction",
            value: "1.5".into(),
            reason: "it must be in (0, 1]",
            fix: "use a fraction such as 0.9",
        },
        Error::ZeroSizedAllocation,
        Error::OverBudget {
            requested: 10,
            needed: 10,
            held: 24,
            library: 1,
            in_use: 20,
            limit: 25,
            total: 100,
            fraction: 0.25,
            driver_out_of_memory: true,
        },
        Error::FreedBuffer { buffer },
        Error::ForeignBuffer { buffer, device: 0 },
        Error::BufferViewed { buffer, views: 1 },
        Error::PeerUnsupported { device: 0, peer: 1 },
        Error::NotInSet { index: 2, len: 2 },
        Error::OutOfRange { buffer, offset: u64::MAX, len: 2, buffer_len: 10 },
        Error::PinnedCapExceeded { requested: 2, cap: 1 },
        Error::PinnedExhausted { requested: 2, cap: 4, lent: 3 },
        Error::PinnedReserved { requested: 2, held: 3, limit: 4, cap: 5 },
        Error::TooManyReads { most: 7 },
        Error::LengthMismatch { what: "a and b", left: 1, right: 2 },
        Error::Interop { what: "a stream of another context".into(), fix: "pass one of this device" },
        Error::PreparedDataLength { index: 3, expected: 256, got: 255 },
        Error::FillPanicked { write: 3, buffer, offset: 16, len: 4096, cause: "boom".into() },
        Error::BadItem {
            call: "UploadBatch::write_many",
            index: 4,
            error: Box::new(Error::OutOfRange { buffer, offset: 8, len: 2, buffer_len: 9 }),
        },
        Error::HostOutOfMemory { bytes: 1 },
        Error::ForeignSlot { index: 3, slot_batch: 7, batch: 9 },
        Error::NotPinned { operation: "Device::upload_async_at", address: 4096, len: 10, unpinned: 4105 },
        Error::BatchPoisoned {
            write: 2,
            buffer,
            offset: 64,
            len: 32,
            cause: "panicked in its fill closure".into(),
        },
        Error::ItemsPanicked { call: "UploadBatch::write_many", index: 3 },
        Error::UploadLength { buffer, buffer_len: 4096, data_len: 100 },
        Error::EmptyHostRange { operation: "Device::pin_host", address: 4096 },
    ];
    for e in errors {
        let text = e.to_string();
        let fix = text.find("Fix: ").unwrap_or_else(|| panic!("no Fix in: {text}"));
        assert!(text.ends_with('.'), "{text}");
        assert!(fix > 20, "the message says what happened before the fix: {text}");
    }
}

#[test]
fn driver_errors_name_the_entry_point_and_code() {
    let e = Error::Driver {
        entry: "cuMemAlloc_v2",
        code: cuda_sys::CUDA_ERROR_OUT_OF_MEMORY,
        name: "CUDA_ERROR_OUT_OF_MEMORY".into(),
        text: "out of memory".into(),
    };
    assert_eq!(e.cuda_code(), Some(2));
    let text = e.to_string();
    assert!(
        text.starts_with("cuMemAlloc_v2 failed with CUDA_ERROR_OUT_OF_MEMORY (2): out of memory."),
        "{text}"
    );
    assert!(text.contains("Device::trim"), "{text}");
}

#[test]
fn over_budget_gives_the_numbers() {
    let e = Error::OverBudget {
        requested: 4096,
        needed: 8192,
        held: 1500,
        in_use: 1000,
        library: 256,
        limit: 2000,
        total: 10_000,
        fraction: 0.2,
        driver_out_of_memory: false,
    };
    assert_eq!(
        e.to_string(),
        "allocating 4096 bytes needs 8192 more bytes from the driver, but this device holds 1500 bytes \
         already and its budget allows 2000 (0.2 of 10000 total). Of the 1500 bytes held, 1000 are in your \
         buffers, 256 in the library's own (device staging, prepared sets' tables), and the rest free in \
         slabs and caches or freed but still used by copies in flight. Fix: free buffers you no \
         longer need, or raise Config::budget_fraction."
    );
}

#[test]
fn error_is_send_sync_static() {
    fn check<T: std::error::Error + Send + Sync + 'static>() {}
    check::<Error>();
}

//! The public API, named item by item: a renamed, removed or re-typed item fails to compile
//! here, and a public item this file does not name fails `this_file_names_every_public_item`.
//! No GPU: nothing is called, the items are only named (and a few pure ones run).

// The fn types spelled out are the point here.
#![allow(clippy::type_complexity)]

use std::collections::BTreeSet;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cuda_resident::{
    AllocatorStats, Config, Device, DeviceInfo, DeviceSet, DownloadBatch, Downloaded, Error, FanOutPath,
    Fence, FenceEvent, FenceFuture, GRANULE, MAX_CLASS_BYTES, OwnedBuffer, PeerBatch, PendingDownload,
    PinnedBuffer, PinnedStats, PlanError, PreparedDownloads, PreparedUploads, ResidentBuffer, Result, Scope,
    Slot, TelemetrySnapshot, UploadBatch, cuda_sys,
};

type Ranges<'r> = &'r [(ResidentBuffer, u64, u64)];

#[test]
fn every_public_item_is_named() {
    // Opening and identity.
    let _: fn() -> Result<usize> = Device::count;
    let _: fn(usize) -> Result<Device> = Device::open;
    let _: fn(Arc<cuda_sys::Driver>, usize, Config) -> Result<Device> = Device::open_on_driver;
    let _: fn(usize, Config) -> Result<Device> = Device::open_configured;
    let _: fn(&Device) -> &DeviceInfo = Device::info;
    let _: fn(&Device) -> &Config = Device::config;
    let _: fn(&Device) -> bool = Device::moves_small_copies_over_bus;
    let _: fn(&Device) -> bool = Device::moves_dmas_in_batches;
    let _: fn(&Device) -> bool = Device::pinned_in_huge_pages;
    let _: fn(&Device) -> &Arc<cuda_sys::Driver> = Device::driver;
    let _: fn(&Device) -> cuda_sys::CUcontext = Device::cu_context;
    let _: fn(&Device) -> Result<()> = Device::make_current;
    let _: unsafe fn(&Device, cuda_sys::CUstream) -> Result<()> = Device::wait_for_stream;

    // The resident store and the pinned pool.
    let _: fn(&Device, u64) -> Result<ResidentBuffer> = Device::allocate;
    let _: fn(&Device, ResidentBuffer) -> Result<()> = Device::free;
    let _: fn(&Device, u64) -> Result<OwnedBuffer> = Device::allocate_owned;
    let _: fn(&Device, ResidentBuffer) -> Result<OwnedBuffer> = Device::adopt;
    let _: fn(&OwnedBuffer) -> ResidentBuffer = OwnedBuffer::handle;
    let _: fn(&OwnedBuffer) -> u64 = OwnedBuffer::len;
    let _: fn(&OwnedBuffer) -> bool = OwnedBuffer::is_empty;
    let _: fn(&OwnedBuffer) -> &Device = OwnedBuffer::device;
    let _: fn(OwnedBuffer) -> ResidentBuffer = OwnedBuffer::into_raw;
    let _: fn(OwnedBuffer) -> Result<()> = OwnedBuffer::free;
    fn owns<T: std::ops::Deref<Target = ResidentBuffer> + Send + Sync + std::fmt::Debug>() {}
    owns::<OwnedBuffer>();
    let _: fn(&Device, ResidentBuffer) -> Result<u64> = Device::device_ptr;
    let _: fn(&Device, ResidentBuffer) -> Result<u64> = Device::buffer_len;
    let _: fn(&Device) -> u64 = Device::allocated_bytes;
    let _: fn(&Device) -> Result<u64> = Device::driver_free_bytes;
    let _: fn(&Device) -> Result<u64> = Device::trim;
    let _: fn(&Device, usize) -> Result<PinnedBuffer> = Device::pinned;
    let _: unsafe fn(&Device, *mut u8, usize) -> Result<()> = Device::pin_host;
    let _: unsafe fn(&Device, *mut u8) -> Result<()> = Device::unpin_host;
    let _: fn(&Device) -> Result<()> = Device::synchronize;
    let _: fn(&Device) -> Result<()> = Device::synchronize_uploads;
    let _: fn(&Device) -> Result<()> = Device::synchronize_downloads;
    let _: unsafe fn(&Device, ResidentBuffer, u64, *const u8, usize) -> Result<Fence> =
        Device::upload_async_at;
    let _: unsafe fn(&Device, ResidentBuffer, u64, *mut u8, usize) -> Result<Fence> =
        Device::download_async_at;
    let _: fn(&Device) -> TelemetrySnapshot = Device::telemetry;

    // Blocking conveniences: one batch each, submitted and waited for.
    let _: fn(&Device, ResidentBuffer, &[u8]) -> Result<()> = Device::upload;
    let _: fn(&Device, ResidentBuffer, u64, &[u8]) -> Result<()> = Device::upload_at;
    let _: fn(&Device, &[(ResidentBuffer, &[u8])]) -> Result<()> = Device::upload_many;
    let _: fn(&Device, &[(ResidentBuffer, u64, &[u8])]) -> Result<()> = Device::upload_at_many;
    let _: fn(&Device, ResidentBuffer) -> Result<Vec<u8>> = Device::download;
    let _: fn(&Device, ResidentBuffer, u64, u64) -> Result<Vec<u8>> = Device::download_range;
    let _: fn(&Device, ResidentBuffer, u64, &mut [u8]) -> Result<()> = Device::download_to_slice;
    let _: fn(&Device, &[ResidentBuffer]) -> Result<Vec<Vec<u8>>> = Device::download_many;
    let _: fn(&Device, Ranges<'_>) -> Result<Vec<Vec<u8>>> = Device::download_ranges;
    let _: fn(&Device, Ranges<'_>, &mut [Vec<u8>]) -> Result<()> = Device::download_into;

    // Batches, pending and finished downloads.
    let _: for<'a> fn(&'a Device) -> UploadBatch<'a> = Device::uploads;
    let _: for<'a> fn(&'a Device) -> DownloadBatch<'a> = Device::downloads;
    let _: fn(PendingDownload) -> Result<Downloaded> = PendingDownload::wait;
    let _: fn(PendingDownload, &[Slot], &mut [Vec<u8>]) -> Result<Downloaded> = PendingDownload::wait_into;
    let _: fn(&PendingDownload) -> &Fence = PendingDownload::fence;
    let _: fn(&Downloaded, Slot) -> &[u8] = Downloaded::get;
    let _: fn(&Downloaded, Slot, &mut Vec<u8>) = Downloaded::copy_into;
    let _: fn(&Downloaded, &[Slot], &mut [Vec<u8>]) -> Result<()> = Downloaded::copy_all_into;
    let _: fn(&Downloaded) -> usize = Downloaded::len;
    let _: fn(&Downloaded) -> bool = Downloaded::is_empty;
    let _: fn() -> Fence = Fence::completed;
    let _: fn(&Fence) -> Result<()> = Fence::wait;
    let _: fn(&Fence) -> Result<bool> = Fence::is_complete;
    let _: unsafe fn(&Fence, cuda_sys::CUstream) -> Result<()> = Fence::make_stream_wait;
    let _: fn(&Fence) -> Result<Option<FenceEvent>> = Fence::record_event;
    let _: fn(&FenceEvent) -> cuda_sys::CUevent = FenceEvent::as_raw;
    let _: unsafe fn(&Device, cuda_sys::CUevent) -> Result<()> = Device::wait_for_event;
    fn awaits<F: std::future::IntoFuture<Output = Result<()>, IntoFuture = FenceFuture>>() {}
    awaits::<Fence>();
    awaits::<&Fence>();
    fn send_sync<T: Send + Sync>() {}
    send_sync::<FenceEvent>();
    send_sync::<Scope<'static, 'static>>();
    fn send<T: Send>() {}
    send::<UploadBatch<'static>>();
    send::<DownloadBatch<'static>>();
    send_sync::<FenceFuture>();

    // Scoped transfers: the caller's memory as the other end.
    let _ = |d: &Device| Device::scope(d, |s: &Scope<'_, '_>| -> Result<u8> { Ok(scoped_items(s)) });

    // Prepared sets.
    let _: fn(&Device, Ranges<'_>) -> Result<PreparedUploads> = Device::prepare_uploads;
    let _: fn(&Device, Ranges<'_>) -> Result<PreparedDownloads> = Device::prepare_downloads;
    let _: fn(&mut PreparedUploads, &[Vec<u8>]) -> Result<Fence> = PreparedUploads::upload::<Vec<u8>>;
    let _: fn(&PreparedUploads) -> usize = PreparedUploads::len;
    let _: fn(&PreparedUploads) -> bool = PreparedUploads::is_empty;
    let _: fn(&PreparedUploads) -> bool = PreparedUploads::is_laid_out;
    let _: fn(&mut PreparedDownloads) -> Result<PendingDownload> = PreparedDownloads::submit;
    let _: fn(&mut PreparedDownloads, &mut [Vec<u8>]) -> Result<()> = PreparedDownloads::download_into;
    let _: fn(&PreparedDownloads, usize) -> Slot = PreparedDownloads::slot;
    let _: fn(&PreparedDownloads) -> &[Slot] = PreparedDownloads::slots;
    let _: fn(&PreparedDownloads) -> usize = PreparedDownloads::len;
    let _: fn(&PreparedDownloads) -> bool = PreparedDownloads::is_empty;
    let _: fn(&PreparedDownloads) -> bool = PreparedDownloads::is_laid_out;

    // Several GPUs.
    let _: fn() -> Result<DeviceSet> = DeviceSet::open_all;
    let _: fn(Config) -> Result<DeviceSet> = DeviceSet::open_all_configured;
    let _: fn(Vec<Device>) -> DeviceSet = DeviceSet::from_devices;
    let _: fn(&DeviceSet) -> usize = DeviceSet::len;
    let _: fn(&DeviceSet) -> bool = DeviceSet::is_empty;
    let _: fn(&DeviceSet, usize) -> Result<&Device> = DeviceSet::get;
    let _: fn(&DeviceSet) -> &[Device] = DeviceSet::devices;
    let _: fn(&DeviceSet) -> Result<usize> = DeviceSet::enable_all_peers;
    let _: fn(&DeviceSet, &[u8], &[(usize, ResidentBuffer)], u64) -> Result<Vec<Fence>> = DeviceSet::fan_out;
    let _: fn(&DeviceSet, FanOutPath, &[u8], &[(usize, ResidentBuffer)], u64) -> Result<Vec<Fence>> =
        DeviceSet::fan_out_via;
    let _ = [FanOutPath::EachLink, FanOutPath::FirstThenPeers];
    let _: fn(&Device, &Device) -> Result<bool> = Device::can_access_peer;
    let _: fn(&Device, &Device) -> Result<()> = Device::enable_peer;
    let _: fn(&Device, &Device) -> bool = Device::is_peer_enabled;
    let _: for<'a> fn(&'a Device, &'a Device) -> PeerBatch<'a> = Device::peer_copies;

    // Errors, stats and constants.
    batch_items(PhantomData);
    let _: fn(&Error) -> Option<cuda_sys::CUresult> = Error::cuda_code;
    let planned = Error::from(PlanError::TooManyRequests { count: 1 << 33 });
    assert!(matches!(&planned, Error::Plan(PlanError::TooManyRequests { .. })), "{planned}");
    assert!(planned.to_string().contains("Fix: "), "{planned}");
    let _ = (AllocatorStats::default(), PinnedStats::default(), TelemetrySnapshot::default());
    let _: fn(&TelemetrySnapshot) -> u64 = |t| t.upload_submissions + t.download_submissions;
    assert_eq!((GRANULE, MAX_CLASS_BYTES), (256, 4 << 20));
}

/// The methods of the batches, for one lifetime of the device they borrow.
fn batch_items<'a>(_device: PhantomData<&'a Device>) {
    let _: for<'b> fn(
        &'b mut UploadBatch<'a>,
        ResidentBuffer,
        u64,
        &'a [u8],
    ) -> Result<&'b mut UploadBatch<'a>> = UploadBatch::write;
    let _: for<'b> fn(
        &'b mut UploadBatch<'a>,
        ResidentBuffer,
        u64,
        usize,
        fn(&mut [u8]),
    ) -> Result<&'b mut UploadBatch<'a>> = UploadBatch::write_with;
    let _: for<'b> fn(
        &'b mut UploadBatch<'a>,
        ResidentBuffer,
        u64,
        usize,
        fn(&mut [u8]),
    ) -> Result<&'b mut UploadBatch<'a>> = UploadBatch::write_with_par;
    let _: for<'b> fn(
        &'b mut PeerBatch<'a>,
        ResidentBuffer,
        u64,
        ResidentBuffer,
        u64,
        u64,
    ) -> Result<&'b mut PeerBatch<'a>> = PeerBatch::copy;
    let _: for<'b> fn(
        &'b mut PeerBatch<'a>,
        ResidentBuffer,
        ResidentBuffer,
        &[(u64, u64, u64)],
    ) -> Result<&'b mut PeerBatch<'a>> = PeerBatch::copy_ranges;
    let _: fn(UploadBatch<'a>) -> Result<Fence> = UploadBatch::submit;
    let _: fn(&UploadBatch<'a>) -> usize = UploadBatch::len;
    let _: fn(&UploadBatch<'a>) -> bool = UploadBatch::is_empty;
    let _: fn(&mut DownloadBatch<'a>, ResidentBuffer, u64, u64) -> Result<Slot> = DownloadBatch::read;
    let _: fn(&mut DownloadBatch<'a>, ResidentBuffer) -> Result<Slot> = DownloadBatch::read_buffer;
    let _: fn(&mut DownloadBatch<'a>, &[ResidentBuffer]) -> Result<Vec<Slot>> =
        DownloadBatch::read_buffer_many;
    let _: fn(&mut DownloadBatch<'a>, Vec<(ResidentBuffer, u64, u64)>) -> Result<Vec<Slot>> =
        DownloadBatch::read_many;
    let _: for<'b> fn(
        &'b mut UploadBatch<'a>,
        Vec<(ResidentBuffer, u64, &'a [u8])>,
    ) -> Result<&'b mut UploadBatch<'a>> = UploadBatch::write_many;
    let _: for<'b> fn(
        &'b mut DownloadBatch<'a>,
        ResidentBuffer,
        u64,
        &'a mut [u8],
    ) -> Result<&'b mut DownloadBatch<'a>> = DownloadBatch::read_to_slice;
    let _: for<'b> fn(
        &'b mut DownloadBatch<'a>,
        Vec<(ResidentBuffer, u64, &'a mut [u8])>,
    ) -> Result<&'b mut DownloadBatch<'a>> = DownloadBatch::read_to_slice_many;
    let _: fn(&DownloadBatch<'a>) -> usize = DownloadBatch::len;
    let _: fn(&DownloadBatch<'a>) -> bool = DownloadBatch::is_empty;
    let _: fn(DownloadBatch<'a>) -> Result<PendingDownload> = DownloadBatch::submit;
    let _: fn(DownloadBatch<'a>, &mut [Vec<u8>]) -> Result<()> = DownloadBatch::submit_into;
    let _: fn(PeerBatch<'a>) -> Result<Fence> = PeerBatch::submit;
    let _: fn(&PeerBatch<'a>) -> usize = PeerBatch::len;
    let _: fn(&PeerBatch<'a>) -> bool = PeerBatch::is_empty;
}

#[test]
fn config_is_built_from_its_defaults_with_setters() {
    let _: fn(Config, f64) -> Config = Config::with_budget_fraction;
    let _: fn(Config, u64) -> Config = Config::with_slab_bytes;
    let _: fn(Config, u64) -> Config = Config::with_pinned_cap_bytes;
    let _: fn(Config, u64) -> Config = Config::with_pinned_prewarm_bytes;
    let _: fn(Config, u64) -> Config = Config::with_chunk_bytes;
    let _: fn(Config, u64) -> Config = Config::with_direct_threshold;
    let _: fn(Config, usize) -> Config = Config::with_pack_threads;
    let _: fn(Config, u64) -> Config = Config::with_pack_linger_us;
    let _: fn(Config, bool) -> Config = Config::with_small_copies_over_bus;
    let _: fn(Config, bool) -> Config = Config::with_pinned_huge_pages;
    let _: fn(Config, bool) -> Config = Config::with_dma_batches;
    let _: fn(&Config) -> Result<()> = Config::validate;
    let _: fn(&Config) -> usize = Config::resolved_pack_threads;
    let config = Config::default()
        .with_budget_fraction(0.5)
        .with_slab_bytes(32 << 20)
        .with_pinned_cap_bytes(256 << 20)
        .with_pinned_prewarm_bytes(1 << 20)
        .with_chunk_bytes(4 << 20)
        .with_direct_threshold(64 << 10)
        .with_pack_threads(2)
        .with_pack_linger_us(0)
        .with_small_copies_over_bus(false)
        .with_pinned_huge_pages(false)
        .with_dma_batches(false);
    let mut same = Config::default();
    same.budget_fraction = 0.5;
    same.slab_bytes = 32 << 20;
    same.pinned_cap_bytes = 256 << 20;
    same.pinned_prewarm_bytes = 1 << 20;
    same.chunk_bytes = 4 << 20;
    same.direct_threshold = 64 << 10;
    same.pack_threads = 2;
    same.pack_linger_us = 0;
    same.small_copies_over_bus = false;
    same.pinned_huge_pages = false;
    same.dma_batches = false;
    assert_eq!(config, same);
    config.validate().unwrap();
    assert_eq!(config.resolved_pack_threads(), 2);
    let bad = Config::default().with_budget_fraction(1.5).validate().unwrap_err();
    assert!(bad.to_string().contains("Fix:"), "{bad}");
}

/// The items of a scope's batches, named with the scope's lifetime.
fn scoped_items<'scope>(s: &'scope Scope<'scope, '_>) -> u8 {
    let _: UploadBatch<'scope> = Scope::uploads(s);
    let _: DownloadBatch<'scope> = Scope::downloads(s);
    let _: for<'b> fn(
        &'b mut UploadBatch<'scope>,
        ResidentBuffer,
        u64,
        &'scope [u8],
    ) -> Result<&'b mut UploadBatch<'scope>> = UploadBatch::write;
    let _: for<'b> fn(
        &'b mut DownloadBatch<'scope>,
        ResidentBuffer,
        u64,
        &'scope mut [u8],
    ) -> Result<&'b mut DownloadBatch<'scope>> = DownloadBatch::read_to_slice;
    let _: for<'b> fn(
        &'b mut UploadBatch<'scope>,
        Vec<(ResidentBuffer, u64, &'scope [u8])>,
    ) -> Result<&'b mut UploadBatch<'scope>> = UploadBatch::write_many;
    let _: for<'b> fn(
        &'b mut DownloadBatch<'scope>,
        Vec<(ResidentBuffer, u64, &'scope mut [u8])>,
    ) -> Result<&'b mut DownloadBatch<'scope>> = DownloadBatch::read_to_slice_many;
    // The same types as ordinary batches, with the same submits.
    let _: fn(UploadBatch<'scope>) -> Result<Fence> = UploadBatch::submit;
    let _: fn(DownloadBatch<'scope>) -> Result<PendingDownload> = DownloadBatch::submit;
    let _: fn(&mut DownloadBatch<'scope>, ResidentBuffer, u64, u64) -> Result<Slot> = DownloadBatch::read;
    let _: fn(&UploadBatch<'scope>) -> usize = UploadBatch::len;
    let _: fn(&UploadBatch<'scope>) -> bool = UploadBatch::is_empty;
    let _: fn(&DownloadBatch<'scope>) -> usize = DownloadBatch::len;
    let _: fn(&DownloadBatch<'scope>) -> bool = DownloadBatch::is_empty;
    0
}

/// Fails when the crate has a public item that this file does not name. The rule, applied to
/// the crate's source with a line scan (the code is rustfmt-formatted; an `impl` header it
/// cannot read fails the test rather than being skipped):
///
/// - Public items are the names `src/lib.rs` re-exports at the crate root (`pub use`), and the
///   `pub fn` and `pub const` items at the first level of a top-level inherent `impl` block
///   (`impl Type {`, `impl<'a> Type<'a> {`; not `impl Trait for Type`) of one of those types,
///   in any file under `src/`.
/// - Left out: files of modules that `lib.rs` compiles only under `cfg(test)` or with a
///   feature (`cudarc`, `internals`: this test builds without features), test files
///   (`tests.rs`, `*_tests.rs`, `proptests.rs`), items marked `#[cfg(test)]`,
///   `#[cfg(feature = ...)]` or `#[doc(hidden)]`, and `pub(crate)` and narrower items.
///   Struct fields, enum variants and trait impls are not counted: the tests that use them
///   name them.
/// - A root name counts as named when it appears as a word in this file's code, a method when
///   `Type::method` does (comments are not code). Name a method by its path, as a typed fn
///   pointer above or a call in `Type::method(receiver, ...)` form.
#[test]
fn this_file_names_every_public_item() {
    // The crate's directory where the test runs (cargo and nextest set it, remapped for a
    // test archive run on another machine), else where it was built.
    let root = std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).to_owned(), std::path::PathBuf::from);
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let lib = read(&root.join("src/lib.rs"));
    let exported = root_exports(&lib);
    let gated = gated_modules(&lib);
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    let mut public: BTreeSet<String> = exported.iter().cloned().collect();
    for file in &files {
        let rel = file.strip_prefix(root.join("src")).unwrap();
        let top = rel.iter().next().unwrap().to_str().unwrap().trim_end_matches(".rs");
        let stem = file.file_stem().unwrap().to_str().unwrap();
        if gated.contains(top) || stem == "tests" || stem == "proptests" || stem.ends_with("_tests") {
            continue;
        }
        public.extend(impl_items(&read(file), &exported, rel));
    }
    let this = read(&root.join("tests/api_surface.rs"));
    let code: String =
        this.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n");
    let missing: Vec<_> = public.iter().filter(|item| !names(&code, item)).collect();
    assert!(
        public.len() > 100,
        "the scan found only {} public items: is the rule still right?",
        public.len()
    );
    assert!(missing.is_empty(), "public items not named in tests/api_surface.rs: {missing:?}");
}

/// The names re-exported at the crate root: `pub use path::{A, B};` or `pub use path::A;`.
fn root_exports(lib: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = lib;
    while let Some(at) = rest.find("\npub use ") {
        let body = &rest[at + "\npub use ".len()..];
        let end = body.find(';').expect("a pub use ends with ;");
        let list = &body[..end];
        let list = match (list.find('{'), list.rfind('}')) {
            (Some(open), Some(close)) => &list[open + 1..close],
            _ => list.rsplit("::").next().unwrap(),
        };
        names.extend(list.split(',').map(str::trim).filter(|n| !n.is_empty()).map(String::from));
        rest = &body[end..];
    }
    names
}

/// Modules that `lib.rs` declares only under `cfg(test)` or with a feature on.
fn gated_modules(lib: &str) -> BTreeSet<String> {
    let (mut gated, mut always) = (BTreeSet::new(), BTreeSet::new());
    let mut cfg: Option<&str> = None;
    for line in lib.lines().map(str::trim) {
        if line.starts_with("#[cfg(") {
            cfg = Some(line);
            continue;
        }
        if line.starts_with("#[") || line.starts_with("//") {
            continue;
        }
        let decl = line.strip_prefix("pub ").unwrap_or(line).strip_prefix("mod ");
        if let Some(name) = decl.map(|d| d.trim_end_matches(';').trim_end_matches(" {").trim()) {
            match cfg {
                Some(c) if c.contains("test") || (c.contains("feature") && !c.contains("not(")) => {
                    gated.insert(name.to_string())
                }
                _ => always.insert(name.to_string()),
            };
        }
        cfg = None;
    }
    gated.difference(&always).cloned().collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `Type::item` for each `pub fn` / `pub const` at the first level of a top-level inherent
/// impl of an exported type.
fn impl_items(text: &str, exported: &BTreeSet<String>, file: &Path) -> Vec<String> {
    let mut items = Vec::new();
    let (mut ty, mut hidden) = (None::<String>, false);
    for line in text.lines() {
        if line.starts_with("impl ") || line.starts_with("impl<") {
            ty = Some(
                inherent_impl_type(line)
                    .unwrap_or_else(|| panic!("{}: cannot read `{line}`", file.display())),
            );
            hidden = false;
            continue;
        }
        if line == "}" {
            ty = None;
        }
        let Some(t) = ty.as_ref().filter(|t| exported.contains(*t)) else { continue };
        if let Some(attr) = line.strip_prefix("    #[") {
            hidden |= ["cfg(test", "cfg(feature", "doc(hidden"].iter().any(|a| attr.starts_with(a));
            continue;
        }
        if line.starts_with("    ///") || line.trim().is_empty() {
            continue;
        }
        if let Some(name) = pub_item(line).filter(|_| !hidden) {
            items.push(format!("{t}::{name}"));
        }
        if !line.starts_with("        ") {
            hidden = false;
        }
    }
    items
}

/// The self type of `impl<..> Type<..> {`; `Some("")` for a trait impl (counted as no type).
fn inherent_impl_type(line: &str) -> Option<String> {
    let header = line.strip_prefix("impl")?.strip_suffix(" {")?;
    if header.contains(" for ") {
        return Some(String::new());
    }
    let mut rest = header;
    if rest.starts_with('<') {
        let mut depth = 0;
        let close = rest.char_indices().find(|&(_, c)| {
            depth += match c {
                '<' => 1,
                '>' => -1,
                _ => 0,
            };
            depth == 0
        })?;
        rest = &rest[close.0 + 1..];
    }
    let name: String = rest.trim_start().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
    (!name.is_empty()).then_some(name)
}

/// The name of `    pub [const|async|unsafe] fn name` or `    pub const NAME:`.
fn pub_item(line: &str) -> Option<String> {
    let mut rest = line.strip_prefix("    pub ")?;
    let is_const = rest.starts_with("const ") && !rest.starts_with("const fn ");
    while let Some(r) = ["const ", "async ", "unsafe "].iter().find_map(|q| rest.strip_prefix(q)) {
        rest = r;
    }
    let rest = if is_const { rest } else { rest.strip_prefix("fn ")? };
    let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
    (!name.is_empty()).then_some(name)
}

/// Whether `code` holds `item` as a whole path or word (not as part of a longer name).
fn names(code: &str, item: &str) -> bool {
    let word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
    code.match_indices(item)
        .any(|(at, _)| !word(code[..at].chars().next_back()) && !word(code[at + item.len()..].chars().next()))
}

/// The `safetensors` feature's items: `cuda_resident::weights`.
#[cfg(feature = "safetensors")]
#[test]
fn the_weights_items_are_named() {
    use std::collections::HashMap;
    use std::path::Path;

    use cuda_resident::weights::{
        Checkpoint, DEFAULT_BATCH_BYTES, Dtype, LoadOptions, SaveOptions, Tensor, WeightsError, WriteMode,
    };

    type Named<'a> = &'a [(&'a str, Dtype, &'a [usize], ResidentBuffer)];
    // `impl AsRef<Path>` arguments take no turbofish: named through closures of the types.
    let _: fn(&Device, &Path) -> Result<Checkpoint> = |d, p| d.load_safetensors(p);
    let _: fn(&Device, &Path, LoadOptions<'_>) -> Result<Checkpoint> =
        |d, p, o| d.load_safetensors_configured(p, o);
    let _: fn(&Device, &Path, Named<'_>) -> Result<()> = |d, p, t| d.save_safetensors(p, t);
    let _: fn(&Device, &Path, Named<'_>, SaveOptions<'_>) -> Result<()> =
        |d, p, t, o| d.save_safetensors_configured(p, t, o);
    let _: fn(&Checkpoint) -> &[Tensor] = Checkpoint::tensors;
    let _: for<'c> fn(&'c Checkpoint, &str) -> Option<&'c Tensor> = Checkpoint::get;
    let _: fn(&Checkpoint) -> usize = Checkpoint::len;
    let _: fn(&Checkpoint) -> bool = Checkpoint::is_empty;
    let _: fn(&Checkpoint) -> u64 = Checkpoint::total_bytes;
    let _: fn(&Checkpoint) -> Option<&HashMap<String, String>> = Checkpoint::metadata;
    let _: fn(&Checkpoint) -> Option<ResidentBuffer> = Checkpoint::arena;
    let _: fn(Checkpoint) -> (Vec<Tensor>, Option<OwnedBuffer>) = Checkpoint::into_parts;
    let _: fn(&Checkpoint, &Device, &Path) -> Result<()> = |c, d, p| c.save(d, p);
    let _: fn(&Tensor) -> &str = Tensor::name;
    let _: fn(&Tensor) -> Dtype = Tensor::dtype;
    let _: fn(&Tensor) -> &[usize] = Tensor::shape;
    let _: fn(&Tensor) -> ResidentBuffer = Tensor::buffer;
    let _: fn(&Tensor) -> u64 = Tensor::offset;
    let _: fn(&Tensor) -> u64 = Tensor::len;
    let _: fn(&Tensor) -> bool = Tensor::is_empty;
    let _: fn(Tensor) -> Option<OwnedBuffer> = Tensor::into_owned;
    let options = LoadOptions::new().arena(true).batch_bytes(DEFAULT_BATCH_BYTES).progress(|_, _| ());
    let _ = (options, LoadOptions::default());
    let save = SaveOptions::new().metadata(HashMap::new()).batch_bytes(1).progress(|_, _| ());
    let _ = (save, SaveOptions::default());
    let _ = SaveOptions::new().write_mode(WriteMode::Pwrite).write_mode(WriteMode::Mapped);
    assert_eq!(WriteMode::default(), WriteMode::Mapped);
    fn mode<T: Copy + Send + Sync + Eq + std::fmt::Debug>() {}
    mode::<WriteMode>();
    fn error<T: std::error::Error + Send + Sync + Clone + 'static>() {}
    error::<WeightsError>();
    let e = Error::from(WeightsError::BadTensor { tensor: "a".into(), detail: "d".into(), fix: "f" });
    assert!(matches!(e, Error::Weights(_)));
    fn owned<T: Send + Sync + std::fmt::Debug>() {}
    owned::<Checkpoint>();
    owned::<Tensor>();
}

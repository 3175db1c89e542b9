//! Finding and opening `libcuda`, and the errors of doing so.
//!
//! Written by hand; the symbol table it fills ([`DriverApi`]) is generated.

use std::ffi::{CStr, OsStr, OsString};
use std::fmt;
use std::os::raw::{c_char, c_int};
use std::path::{Path, PathBuf};

#[cfg(feature = "faults")]
use crate::faults::Faults;
use crate::{CUDA_SUCCESS, CUresult, DriverApi};

/// The environment variable that names the driver library to load instead of the defaults.
pub const ENV_VAR: &str = "CUDA_SYS_LIBCUDA";

/// The names tried, in order, when neither an explicit path nor [`ENV_VAR`] is given.
/// `libcuda.so.1` is what the NVIDIA driver installs; `libcuda.so` is the development
/// symlink (and the toolkit's stub, which loads but whose calls all fail).
pub const DEFAULT_LIBRARY_NAMES: &[&str] = &["libcuda.so.1", "libcuda.so"];

/// The CUDA version of the header the bindings were generated from, as `cuDriverGetVersion`
/// encodes it (13000 for 13.0).
const HEADER_VERSION: c_int = crate::CUDA_VERSION as c_int;

/// A loaded CUDA driver library and its table of entry points.
///
/// Loading resolves every entry point of the header once. An entry point the library lacks
/// does not fail the load: it is recorded as missing, and calling it through [`call!`]
/// returns a [`MissingSymbol`] error that names it. This is what lets a driver older than the
/// header load and serve every call it does have.
///
/// `Driver` is `Send + Sync`; share it with `Arc`.
///
/// [`call!`]: crate::call
pub struct Driver {
    api: DriverApi,
    path: PathBuf,
    version: Option<DriverVersion>,
    /// Only with the `faults` feature: a default build's `Driver` is its table, path and
    /// version, nothing more (`fault_state_only_with_the_feature` checks it).
    #[cfg(feature = "faults")]
    faults: Faults,
}

impl Driver {
    /// Loads the driver from the standard places: the path in [`ENV_VAR`] if it is set
    /// (and only that path: a wrong override is reported, not silently skipped), otherwise
    /// each of [`DEFAULT_LIBRARY_NAMES`] in turn through the system's library search path.
    ///
    /// The error lists every place tried, with the system's reason for each, and a fix.
    ///
    /// Loading a library runs its initialisers, which is why [`Driver::load_from`] is
    /// `unsafe`. This function is safe because the caller picks no library: it opens the
    /// NVIDIA driver by the names its installer gives it, through the system's library search
    /// path, which is the trust any program linked against `libcuda` places in the system.
    /// [`ENV_VAR`] can name another file, but the process environment is already trusted
    /// with that power: `LD_PRELOAD` and `LD_LIBRARY_PATH` let whoever sets it load any
    /// library into the process before `main` runs.
    pub fn load() -> Result<Driver, LoadError> {
        Self::search(std::env::var_os(ENV_VAR), DEFAULT_LIBRARY_NAMES)
    }

    /// Loads the driver from exactly `path` (a file path, or a bare name resolved through
    /// the system's library search path).
    ///
    /// # Safety
    ///
    /// Loading a shared library runs its initialisers (constructors, `.init_array`), which
    /// may do anything, and the calls made through the returned driver trust the library to
    /// honour the CUDA driver API's signatures and contracts for every entry point it exports
    /// under a driver's name. `path` must name a library for which both hold: the NVIDIA
    /// driver's `libcuda`, or a library whose initialisers are sound and whose exports of
    /// driver entry-point names (if any) behave as the driver's. A library that exports none
    /// of them (as in the tests, which load `libc`) loads and reports every call as missing.
    pub unsafe fn load_from(path: impl AsRef<Path>) -> Result<Driver, LoadError> {
        let path = path.as_ref();
        Self::open(path.as_os_str(), Origin::Explicit)
            .map_err(|attempt| LoadError { attempts: vec![attempt] })
    }

    /// The search behind [`Driver::load`], with the environment value and the default names
    /// passed in so that it can be tested without touching the process environment.
    fn search(env: Option<OsString>, defaults: &[&str]) -> Result<Driver, LoadError> {
        let mut attempts = Vec::new();
        if let Some(value) = env.filter(|v| !v.is_empty()) {
            return Self::open(&value, Origin::Env).map_err(|attempt| LoadError { attempts: vec![attempt] });
        }
        for name in defaults {
            match Self::open(OsStr::new(name), Origin::Default) {
                Ok(driver) => return Ok(driver),
                Err(attempt) => attempts.push(attempt),
            }
        }
        Err(LoadError { attempts })
    }

    fn open(name: &OsStr, origin: Origin) -> Result<Driver, Attempt> {
        // SAFETY: loading a shared library runs its initialisers. We only open a path the
        // caller of the `unsafe` `load_from` vouched for, or the driver's well-known names and
        // the environment's override (trusted as `Driver::load` explains). `from_library` only
        // looks symbols up and stores them.
        let api = unsafe { DriverApi::new(name) }.map_err(|e| Attempt {
            name: name.to_owned(),
            origin,
            reason: error_chain(&e),
        })?;
        let mut driver = Driver {
            api,
            path: PathBuf::from(name),
            version: None,
            #[cfg(feature = "faults")]
            faults: Faults::default(),
        };
        driver.version = driver.query_version();
        Ok(driver)
    }

    fn query_version(&self) -> Option<DriverVersion> {
        let mut version: c_int = 0;
        // SAFETY: cuDriverGetVersion writes one int through a valid pointer; it needs no
        // cuInit and no context.
        let code = unsafe { crate::call!(self, cuDriverGetVersion(&mut version)) }.ok()?;
        (code == CUDA_SUCCESS).then_some(DriverVersion(version))
    }

    /// The symbol table: one `Result` field per entry point of the header, `Err` where the
    /// library lacks it (`driver.api().cuMemcpyBatchAsync_v2.is_ok()` asks whether it has it).
    ///
    /// Call entry points through [`call!`](crate::call), which turns a missing one into a
    /// [`MissingSymbol`] error; the table has no public methods:
    ///
    /// ```compile_fail
    /// # let driver = cuda_sys::Driver::load().unwrap();
    /// // The generated method would panic on a missing entry point: it is not public.
    /// unsafe { driver.api().cuInit(0) };
    /// ```
    pub fn api(&self) -> &DriverApi {
        &self.api
    }

    /// Mutable access to the symbol table, to replace entry points (fault injection in
    /// tests, tracing wrappers).
    ///
    /// # Safety
    ///
    /// Every function stored must have the signature and the contract of the entry point it
    /// replaces: code that calls through this table trusts what the driver documents (for
    /// example that `cuMemAlloc_v2` returning `CUDA_SUCCESS` wrote a valid pointer).
    pub unsafe fn api_mut(&mut self) -> &mut DriverApi {
        &mut self.api
    }

    /// The fault plan and call counts of this driver: see [`Faults`]. Unarmed (every call
    /// goes to the driver, uncounted) until a test arms it.
    ///
    /// Only with the `faults` feature, which is test machinery: unstable, not part of the
    /// API and exempt from semver.
    #[cfg(feature = "faults")]
    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// The path or name this driver was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The CUDA version the driver supports (`cuDriverGetVersion`), or `None` when the
    /// library does not answer it (it is then almost surely not the CUDA driver).
    pub fn version(&self) -> Option<DriverVersion> {
        self.version
    }

    /// The error for a call of `entry`, which this library does not export. Used by
    /// [`call!`](crate::call); public so that safe layers can build the same error.
    pub fn missing(&self, entry: &'static str) -> MissingSymbol {
        MissingSymbol { entry, library: self.path.clone(), version: self.version }
    }

    /// The name of a `CUresult` (`"CUDA_ERROR_OUT_OF_MEMORY"`), as the driver reports it,
    /// or `None` when the driver does not know the value (or lacks `cuGetErrorName`).
    pub fn error_name(&self, code: CUresult) -> Option<&str> {
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorName writes a pointer to a static, NUL-terminated string owned
        // by the library, or returns an error for unknown values.
        let result = unsafe { crate::call!(self, cuGetErrorName(code, &mut text)) }.ok()?;
        self.static_text(result, text)
    }

    /// The driver's description of a `CUresult` ("out of memory"), or `None` when the driver
    /// does not know the value (or lacks `cuGetErrorString`).
    pub fn error_string(&self, code: CUresult) -> Option<&str> {
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: as for cuGetErrorName.
        let result = unsafe { crate::call!(self, cuGetErrorString(code, &mut text)) }.ok()?;
        self.static_text(result, text)
    }

    /// A string the library returned, borrowed for as long as the library stays loaded.
    fn static_text(&self, result: CUresult, text: *const c_char) -> Option<&str> {
        if result != CUDA_SUCCESS || text.is_null() {
            return None;
        }
        // SAFETY: the driver returned success and a non-null pointer to a NUL-terminated
        // string in its own static data, which lives as long as the library, which lives
        // as long as `self`.
        unsafe { CStr::from_ptr(text) }.to_str().ok()
    }
}

impl fmt::Debug for Driver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Driver")
            .field("path", &self.path)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

/// An error and its sources, joined: libloading puts the system's reason ("cannot open
/// shared object file") in the source, not in the message.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(inner) = source {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        source = inner.source();
    }
    text
}

/// A CUDA version as `cuDriverGetVersion` encodes it: `1000 * major + 10 * minor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DriverVersion(pub i32);

impl DriverVersion {
    /// The major version (13 for 13.0).
    pub fn major(self) -> i32 {
        self.0 / 1000
    }

    /// The minor version (0 for 13.0).
    pub fn minor(self) -> i32 {
        (self.0 % 1000) / 10
    }

    /// The version of the header these bindings were generated from.
    pub fn header() -> DriverVersion {
        DriverVersion(HEADER_VERSION)
    }
}

impl fmt::Display for DriverVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major(), self.minor())
    }
}

/// Where a library name came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    Explicit,
    Env,
    Default,
}

/// One place [`Driver::load`] tried, and why it failed.
#[derive(Clone, Debug)]
pub struct Attempt {
    name: OsString,
    origin: Origin,
    reason: String,
}

impl Attempt {
    /// The path or name passed to the system loader.
    pub fn name(&self) -> &OsStr {
        &self.name
    }

    /// The system loader's reason.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for Attempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let from = match self.origin {
            Origin::Explicit => "explicit path",
            Origin::Env => ENV_VAR,
            Origin::Default => "default name",
        };
        write!(f, "{} ({from}: {})", self.name.to_string_lossy(), self.reason)
    }
}

/// No CUDA driver library could be opened. Lists every place tried.
#[derive(Clone, Debug, thiserror::Error)]
pub struct LoadError {
    attempts: Vec<Attempt>,
}

impl LoadError {
    /// Every place tried, in order.
    pub fn attempts(&self) -> &[Attempt] {
        &self.attempts
    }
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("no CUDA driver library could be loaded; tried ")?;
        for (i, attempt) in self.attempts.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{attempt}")?;
        }
        let fix = match self.attempts.first().map(|a| a.origin) {
            Some(Origin::Explicit) => "pass the full path of the NVIDIA driver's libcuda.so.1",
            Some(Origin::Env) => {
                "set CUDA_SYS_LIBCUDA to the full path of the NVIDIA driver's libcuda.so.1, or unset it to search the default names"
            }
            _ => {
                "install the NVIDIA driver (it provides libcuda.so.1), or set CUDA_SYS_LIBCUDA to the full path of libcuda.so.1"
            }
        };
        write!(f, ". Fix: {fix}.")
    }
}

/// A call of an entry point that the loaded library does not export.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct MissingSymbol {
    entry: &'static str,
    library: PathBuf,
    version: Option<DriverVersion>,
}

impl MissingSymbol {
    /// The entry point that was called (`"cuMemcpyBatchAsync_v2"`).
    pub fn entry(&self) -> &'static str {
        self.entry
    }

    /// The library that lacks it.
    pub fn library(&self) -> &Path {
        &self.library
    }

    /// The CUDA version the library reports, if it answers `cuDriverGetVersion` at all.
    pub fn driver_version(&self) -> Option<DriverVersion> {
        self.version
    }
}

impl fmt::Display for MissingSymbol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let library = self.library.display();
        let header = DriverVersion::header();
        match self.version {
            Some(version) => write!(
                f,
                "the CUDA driver {library} (CUDA {version}) has no entry point {entry}, which the CUDA {header} API declares. \
                 Fix: install an NVIDIA driver that supports CUDA {header} or newer (R580+), or avoid this call on this driver.",
                entry = self.entry,
            ),
            None => write!(
                f,
                "{library} has no entry point {entry} and does not answer cuDriverGetVersion: it is not the CUDA driver. \
                 Fix: load the NVIDIA driver's libcuda.so.1 (set CUDA_SYS_LIBCUDA to its full path, or unset it).",
                entry = self.entry,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A library that every glibc system has and that is certainly not the CUDA driver.
    const NOT_CUDA: &str = "libc.so.6";

    #[test]
    fn not_found_lists_every_place_tried_and_a_fix() {
        let err = Driver::search(None, &["libcuda-absent-1.so", "libcuda-absent-2.so"]).unwrap_err();
        assert_eq!(err.attempts().len(), 2);
        let text = err.to_string();
        assert!(text.contains("libcuda-absent-1.so (default name: "), "{text}");
        assert!(text.contains("libcuda-absent-2.so (default name: "), "{text}");
        assert!(text.contains("Fix: install the NVIDIA driver"), "{text}");
        assert!(!text.contains('\n'), "one line: {text}");
        // The system's own reason is carried, not replaced.
        assert!(!err.attempts()[0].reason().is_empty());
    }

    #[test]
    fn env_value_is_the_only_place_tried_when_set() {
        let err = Driver::search(Some("/nonexistent/libcuda.so.1".into()), &[NOT_CUDA]).unwrap_err();
        assert_eq!(err.attempts().len(), 1, "the defaults must not be tried: {err}");
        let text = err.to_string();
        assert!(text.contains("/nonexistent/libcuda.so.1 (CUDA_SYS_LIBCUDA: "), "{text}");
        assert!(text.contains("Fix: set CUDA_SYS_LIBCUDA"), "{text}");
    }

    #[test]
    fn env_value_is_used_when_it_loads() {
        let driver = Driver::search(Some(NOT_CUDA.into()), &["libcuda-absent.so"]).unwrap();
        assert_eq!(driver.path(), Path::new(NOT_CUDA));
    }

    #[test]
    fn empty_env_value_means_unset() {
        let err = Driver::search(Some("".into()), &["libcuda-absent.so"]).unwrap_err();
        assert_eq!(err.attempts()[0].name(), "libcuda-absent.so");
    }

    #[test]
    fn explicit_path_failure_names_the_path() {
        // SAFETY: the path does not exist, so nothing is loaded.
        let err = unsafe { Driver::load_from("/nonexistent/dir/libcuda.so.1") }.unwrap_err();
        let text = err.to_string();
        assert!(text.contains("/nonexistent/dir/libcuda.so.1 (explicit path: "), "{text}");
        assert!(text.contains("Fix: pass the full path"), "{text}");
    }

    #[test]
    fn a_library_that_is_not_cuda_loads_but_its_calls_fail_with_the_entry_point_named() {
        // SAFETY: libc's initialisers are sound (it is already loaded) and it exports no
        // driver entry point.
        let driver = unsafe { Driver::load_from(NOT_CUDA) }.expect("libc loads");
        assert_eq!(driver.version(), None);
        // SAFETY: the entry point is missing, so nothing is called.
        let err = unsafe { crate::call!(driver, cuInit(0)) }.unwrap_err();
        assert_eq!(err.entry(), "cuInit");
        assert_eq!(err.library(), Path::new(NOT_CUDA));
        let text = err.to_string();
        assert!(text.contains("has no entry point cuInit"), "{text}");
        assert!(text.contains("not the CUDA driver"), "{text}");
        assert!(text.contains("Fix: load the NVIDIA driver's libcuda.so.1"), "{text}");
        // The name helpers degrade to None instead of failing.
        assert_eq!(driver.error_name(crate::CUDA_ERROR_OUT_OF_MEMORY), None);
        assert_eq!(driver.error_string(crate::CUDA_ERROR_OUT_OF_MEMORY), None);
    }

    #[cfg(feature = "faults")]
    #[test]
    fn call_goes_through_the_fault_plan_and_an_injected_fault_never_reaches_the_driver() {
        use crate::{CUDA_ERROR_NOT_INITIALIZED, Fault};
        use std::sync::atomic::{AtomicU32, Ordering};
        static REAL_CALLS: AtomicU32 = AtomicU32::new(0);
        unsafe extern "C" fn fake_init(_flags: std::os::raw::c_uint) -> CUresult {
            REAL_CALLS.fetch_add(1, Ordering::SeqCst);
            CUDA_SUCCESS
        }
        // SAFETY: libc's initialisers are sound (it is already loaded) and it exports no
        // driver entry point.
        let mut driver = unsafe { Driver::load_from(NOT_CUDA) }.expect("libc loads");
        // SAFETY: fake_init has cuInit's signature and honours its contract (no outputs).
        unsafe { driver.api_mut() }.cuInit = Ok(fake_init);
        let init = |driver: &Driver| {
            // SAFETY: the fake entry point takes a flags word and nothing else.
            unsafe { crate::call!(driver, cuInit(0)) }.expect("installed")
        };
        assert_eq!(init(&driver), CUDA_SUCCESS);
        assert!(driver.faults().counts().is_empty(), "not counted while unarmed");
        driver.faults().inject(Fault::new("cuInit", 2, CUDA_ERROR_NOT_INITIALIZED)).unwrap();
        let codes: Vec<CUresult> = (0..3).map(|_| init(&driver)).collect();
        assert_eq!(codes, [CUDA_SUCCESS, CUDA_ERROR_NOT_INITIALIZED, CUDA_SUCCESS]);
        assert_eq!(REAL_CALLS.load(Ordering::SeqCst), 3, "1 unarmed + 2 passed through");
        let count = driver.faults().counts()["cuInit"];
        assert_eq!((count.calls, count.succeeded, count.injected), (3, 2, 1));
        // A missing entry point is still reported as missing, armed or not.
        // SAFETY: missing, so nothing is called.
        let missing = unsafe { crate::call!(driver, cuMemAlloc_v2(std::ptr::null_mut(), 1)) };
        assert_eq!(missing.unwrap_err().entry(), "cuMemAlloc_v2");
    }

    #[test]
    fn fault_state_only_with_the_feature() {
        // A default build's driver is its table, its path and its version: no fault state, not
        // even an "armed" flag, so `call!` has nothing to consult. The fields need no padding
        // (the table and the path are whole words, the version two `i32`s), so any other field
        // shows in the size.
        let fields = size_of::<DriverApi>() + size_of::<PathBuf>() + size_of::<Option<DriverVersion>>();
        #[cfg(feature = "faults")]
        let fields = fields + size_of::<Faults>();
        assert_eq!(size_of::<Driver>(), fields);
    }

    #[test]
    fn missing_symbol_on_an_old_driver_names_the_versions() {
        let err = MissingSymbol {
            entry: "cuMemcpyBatchAsync_v2",
            library: PathBuf::from("libcuda.so.1"),
            version: Some(DriverVersion(12040)),
        };
        assert_eq!(
            err.to_string(),
            "the CUDA driver libcuda.so.1 (CUDA 12.4) has no entry point cuMemcpyBatchAsync_v2, which the CUDA 13.0 API \
             declares. Fix: install an NVIDIA driver that supports CUDA 13.0 or newer (R580+), or avoid this call on this driver."
        );
    }

    #[test]
    fn version_arithmetic() {
        let v = DriverVersion(12080);
        assert_eq!((v.major(), v.minor()), (12, 8));
        assert_eq!(v.to_string(), "12.8");
        assert_eq!(DriverVersion::header().to_string(), "13.0");
        assert!(DriverVersion(12080) < DriverVersion::header());
    }

    #[test]
    fn driver_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Driver>();
        check::<LoadError>();
        check::<MissingSymbol>();
    }

    #[test]
    fn result_codes_are_plain_integers() {
        // A code no header knows must be representable without undefined behaviour.
        let unknown: CUresult = 0xdead;
        assert_ne!(unknown, CUDA_SUCCESS);
        assert_eq!(crate::CUDA_ERROR_OUT_OF_MEMORY, 2);
    }
}

//! Fault injection and call counting at the driver's dispatch: the tool for testing what a
//! failing driver does to the code above it.
//!
//! Every call made through [`call!`](crate::call) passes through its [`Driver`]'s
//! [`Faults`]. While nothing is armed that costs one relaxed atomic load. Once armed (by
//! [`Faults::record`] or [`Faults::inject`]) the driver counts every call per entry point,
//! and a [`Fault`] makes the `nth` call of its entry point (counted from the last
//! [`Faults::reset`]) return the fault's code **without calling the driver**: no memory is
//! allocated by a failed `cuMemAlloc_v2`, no copy is enqueued by a failed
//! `cuMemcpyHtoDAsync_v2`, exactly as when the real driver refuses. The call's arguments are
//! not evaluated either.
//!
//! ```no_run
//! use cuda_sys::{Driver, Fault, CUDA_ERROR_OUT_OF_MEMORY};
//! let driver = Driver::load()?;
//! driver.faults().inject(Fault::new("cuMemAlloc_v2", 2, CUDA_ERROR_OUT_OF_MEMORY))?;
//! // ... the second cuMemAlloc_v2 through this driver now fails ...
//! let counts = driver.faults().counts();
//! println!("{:?}", counts.get("cuMemAlloc_v2"));
//! driver.faults().clear();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Faults are per [`Driver`] value: two `Driver`s loaded from the same library count and
//! fail independently.
//!
//! This module exists only with the crate's `faults` feature (off by default). It is test
//! machinery: unstable, not part of the API and exempt from semver. Enable it for tests, from
//! `[dev-dependencies]`:
//!
//! ```toml
//! [dev-dependencies]
//! cuda-sys = { package = "cuda-resident-sys", version = "0.1", features = ["faults"] }
//! ```
//!
//! Without the feature, `Driver` has no fault state and [`call!`](crate::call) calls the
//! driver directly: a default build pays nothing for this module.
//!
//! [`Driver`]: crate::Driver

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::{CUDA_SUCCESS, CUresult};

/// One fault: the `nth` call (1-based) of `entry` returns `code`, and so do the next
/// `times - 1` calls of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The entry point, as the library exports it (`"cuMemAlloc_v2"`).
    pub entry: &'static str,
    /// Which call fails, counted from 1 since the last [`Faults::reset`].
    pub nth: u64,
    /// The code returned instead of calling the driver. Never `CUDA_SUCCESS`.
    pub code: CUresult,
    /// How many calls in a row fail, from the `nth` on (`u64::MAX`: every call from then on,
    /// a driver that stays broken).
    pub times: u64,
}

impl Fault {
    /// The `nth` call of `entry` returns `code`; the calls after it go to the driver.
    pub fn new(entry: &'static str, nth: u64, code: CUresult) -> Fault {
        Fault { entry, nth, code, times: 1 }
    }

    /// Makes `times` calls in a row fail, from the `nth` on.
    pub fn times(mut self, times: u64) -> Fault {
        self.times = times;
        self
    }

    fn covers(&self, entry: &str, call: u64) -> bool {
        self.entry == entry && call >= self.nth && call - self.nth < self.times
    }
}

/// A [`Fault`] that cannot be armed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("cannot inject {fault:?}: {reason}. Fix: {fix}")]
pub struct InvalidFault {
    /// The fault refused.
    pub fault: Fault,
    /// Why.
    pub reason: &'static str,
    /// What to change.
    pub fix: &'static str,
}

/// How one entry point was called since the last [`Faults::reset`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallCount {
    /// Calls made (injected ones included).
    pub calls: u64,
    /// Calls that reached the driver and returned `CUDA_SUCCESS`.
    pub succeeded: u64,
    /// Calls answered by an injected fault.
    pub injected: u64,
}

#[derive(Default)]
struct State {
    faults: Vec<Fault>,
    counts: BTreeMap<&'static str, CallCount>,
}

/// The fault plan and call counts of one [`Driver`](crate::Driver). Obtained from
/// [`Driver::faults`](crate::Driver::faults).
#[derive(Default)]
pub struct Faults {
    armed: AtomicBool,
    state: Mutex<State>,
}

impl fmt::Debug for Faults {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.lock();
        f.debug_struct("Faults")
            .field("armed", &self.armed.load(Ordering::Relaxed))
            .field("faults", &state.faults)
            .finish_non_exhaustive()
    }
}

impl Faults {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state stays consistent even if a holder panicked: every update is one step.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts counting calls (with no fault) from zero.
    pub fn record(&self) {
        self.lock().counts.clear();
        self.armed.store(true, Ordering::SeqCst);
    }

    /// Arms `fault` (besides any already armed) and counts calls. Counts are not reset: the
    /// `nth` call is counted from the last [`reset`](Faults::reset) or [`record`](Faults::record).
    pub fn inject(&self, fault: Fault) -> Result<(), InvalidFault> {
        let invalid = |reason, fix| Err(InvalidFault { fault: fault.clone(), reason, fix });
        if fault.code == CUDA_SUCCESS {
            return invalid(
                "a call answered CUDA_SUCCESS without reaching the driver would leave its outputs unwritten",
                "inject an error code such as CUDA_ERROR_OUT_OF_MEMORY",
            );
        }
        if fault.nth == 0 || fault.times == 0 {
            return invalid(
                "calls are counted from 1 and at least one must fail",
                "use nth >= 1 and times >= 1",
            );
        }
        self.lock().faults.push(fault);
        self.armed.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Zeroes the call counts, keeping the faults armed.
    pub fn reset(&self) {
        self.lock().counts.clear();
    }

    /// Disarms every fault but keeps counting: what follows runs against the real driver,
    /// and its calls still count (to check that what was acquired is released).
    pub fn remove_faults(&self) {
        self.lock().faults.clear();
    }

    /// Disarms every fault and stops counting; calls go straight to the driver again.
    pub fn clear(&self) {
        let mut state = self.lock();
        state.faults.clear();
        state.counts.clear();
        self.armed.store(false, Ordering::SeqCst);
    }

    /// The calls counted per entry point since the last reset.
    pub fn counts(&self) -> BTreeMap<&'static str, CallCount> {
        self.lock().counts.clone()
    }

    /// Calls answered by injected faults since the last reset, over all entry points.
    pub fn injected(&self) -> u64 {
        self.lock().counts.values().map(|c| c.injected).sum()
    }

    /// Called by [`call!`](crate::call) before an entry point: the code to return instead of
    /// calling it, when a fault covers this call.
    #[doc(hidden)]
    #[inline]
    pub fn before(&self, entry: &'static str) -> Option<CUresult> {
        if !self.armed.load(Ordering::Relaxed) {
            return None;
        }
        self.before_slow(entry)
    }

    #[cold]
    fn before_slow(&self, entry: &'static str) -> Option<CUresult> {
        let mut state = self.lock();
        let count = state.counts.entry(entry).or_default();
        count.calls += 1;
        let call = count.calls;
        let code = state.faults.iter().find(|f| f.covers(entry, call)).map(|f| f.code);
        if code.is_some() {
            state.counts.get_mut(entry).expect("inserted above").injected += 1;
        }
        code
    }

    /// Called by [`call!`](crate::call) after an entry point returned `code`.
    #[doc(hidden)]
    #[inline]
    pub fn after(&self, entry: &'static str, code: CUresult) {
        if code == CUDA_SUCCESS
            && self.armed.load(Ordering::Relaxed)
            && let Some(count) = self.lock().counts.get_mut(entry)
        {
            count.succeeded += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CUDA_ERROR_LAUNCH_FAILED, CUDA_ERROR_OUT_OF_MEMORY};

    /// A call as `call!` makes it, with `real` standing in for the driver.
    fn dispatch(faults: &Faults, entry: &'static str, real: &mut u32) -> CUresult {
        match faults.before(entry) {
            Some(code) => code,
            None => {
                *real += 1;
                faults.after(entry, CUDA_SUCCESS);
                CUDA_SUCCESS
            }
        }
    }

    #[test]
    fn unarmed_calls_pass_through_uncounted() {
        let faults = Faults::default();
        let mut real = 0;
        assert_eq!(dispatch(&faults, "cuMemAlloc_v2", &mut real), CUDA_SUCCESS);
        assert_eq!(real, 1);
        assert!(faults.counts().is_empty());
    }

    #[test]
    fn the_nth_call_fails_without_reaching_the_driver_and_the_rest_pass() {
        let faults = Faults::default();
        faults.inject(Fault::new("cuMemAlloc_v2", 3, CUDA_ERROR_OUT_OF_MEMORY)).unwrap();
        let mut real = 0;
        let codes: Vec<CUresult> = (0..5).map(|_| dispatch(&faults, "cuMemAlloc_v2", &mut real)).collect();
        assert_eq!(codes, [0, 0, CUDA_ERROR_OUT_OF_MEMORY, 0, 0]);
        assert_eq!(real, 4, "the failed call never reached the driver");
        // Another entry point is not affected.
        assert_eq!(dispatch(&faults, "cuMemFree_v2", &mut real), CUDA_SUCCESS);
        let counts = faults.counts();
        assert_eq!(counts["cuMemAlloc_v2"], CallCount { calls: 5, succeeded: 4, injected: 1 });
        assert_eq!(counts["cuMemFree_v2"], CallCount { calls: 1, succeeded: 1, injected: 0 });
        assert_eq!(faults.injected(), 1);
    }

    #[test]
    fn repeated_faults_reset_and_clear() {
        let faults = Faults::default();
        faults.inject(Fault::new("cuLaunchKernel", 2, CUDA_ERROR_LAUNCH_FAILED).times(u64::MAX)).unwrap();
        let mut real = 0;
        let codes: Vec<CUresult> = (0..4).map(|_| dispatch(&faults, "cuLaunchKernel", &mut real)).collect();
        assert_eq!(codes, [0, CUDA_ERROR_LAUNCH_FAILED, CUDA_ERROR_LAUNCH_FAILED, CUDA_ERROR_LAUNCH_FAILED]);
        faults.reset();
        assert_eq!(dispatch(&faults, "cuLaunchKernel", &mut real), CUDA_SUCCESS, "counted from 1 again");
        assert_eq!(dispatch(&faults, "cuLaunchKernel", &mut real), CUDA_ERROR_LAUNCH_FAILED);
        faults.remove_faults();
        assert_eq!(dispatch(&faults, "cuLaunchKernel", &mut real), CUDA_SUCCESS);
        assert_eq!(faults.counts()["cuLaunchKernel"].calls, 3, "still counting");
        faults.clear();
        for _ in 0..3 {
            assert_eq!(dispatch(&faults, "cuLaunchKernel", &mut real), CUDA_SUCCESS);
        }
        assert!(faults.counts().is_empty());
    }

    #[test]
    fn faults_that_cannot_work_are_refused_with_a_fix() {
        let faults = Faults::default();
        let e = faults.inject(Fault::new("cuInit", 1, CUDA_SUCCESS)).unwrap_err();
        assert!(e.to_string().contains("Fix: inject an error code"), "{e}");
        let e = faults.inject(Fault::new("cuInit", 0, CUDA_ERROR_OUT_OF_MEMORY)).unwrap_err();
        assert!(e.to_string().contains("Fix: use nth >= 1"), "{e}");
        assert!(faults.counts().is_empty());
        let mut real = 0;
        assert_eq!(dispatch(&faults, "cuInit", &mut real), CUDA_SUCCESS, "nothing was armed");
    }
}

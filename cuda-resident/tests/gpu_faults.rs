//! Fault injection at every driver call the engine makes, on a real GPU.
//!
//! A recording run of a realistic sequence (open a device; allocate from a size class, a slab
//! range and a dedicated allocation; packed, direct, in-place and single uploads; downloads
//! as views, into slices and ranged; pinned memory; frees; trim) counts the calls of every
//! entry point. Then, for every entry point and a spread of call numbers `k` along the
//! sequence, a fresh run makes the `k`-th call of that entry point fail with one of four codes
//! (out of memory, launch failure, illegal address, not initialized) without reaching the
//! driver, and checks that
//! - the sequence either absorbs the fault (a retried allocation) and verifies every byte,
//!   or fails with an error that names the entry point; nothing panics;
//! - the same device then runs the whole sequence again, every byte verified;
//! - after a trim, the allocator and the pinned pool hold exactly what a run without faults
//!   holds;
//! - once the device is dropped, every successful allocation, stream, event, module and
//!   context retain has its matching release (driver call counts), and the free device
//!   memory the driver reports (`cuMemGetInfo`) is what it was before.
//!
//! Ignored where there is no GPU: `cargo test -- --include-ignored` on a machine with one.
//! `FAULT_CALLS_PER_ENTRY` (default 24) bounds how many call numbers are tried per entry point.

mod common;
#[path = "common/sequence.rs"]
mod sequence;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use cuda_resident::cuda_sys::{self, CUresult, Driver, Fault};
use cuda_resident::{Config, Device, Error, ResidentBuffer};
use sequence::{Failure, Shape, call_numbers, settled};

const CODES: [CUresult; 4] = [
    cuda_sys::CUDA_ERROR_OUT_OF_MEMORY,
    cuda_sys::CUDA_ERROR_LAUNCH_FAILED,
    cuda_sys::CUDA_ERROR_ILLEGAL_ADDRESS,
    cuda_sys::CUDA_ERROR_NOT_INITIALIZED,
];

/// Small chunks and a low direct threshold: the sequence crosses chunk boundaries and mixes
/// packed and direct copies; a small pinned cap makes the pool evict.
fn config() -> Config {
    Config::default()
        .with_chunk_bytes(1 << 20)
        .with_direct_threshold(64 << 10)
        .with_pinned_cap_bytes(8 << 20)
        .with_pack_threads(2)
}

fn load_driver() -> Arc<Driver> {
    Arc::new(Driver::load().unwrap_or_else(|e| panic!("{e}")))
}

/// The shared sequence at sizes of a real run: a 64 KiB buffer from a size class, 3 MiB
/// from a slab range, 65 MiB past the 64 MiB slab, a 2 MiB head.
const SHAPE: Shape = Shape {
    sizes: [64 << 10, 3 << 20, 65 << 20],
    head: 2 << 20,
    writes: 300,
    direct: 100_000,
    ranges: 200,
    pinned: 1 << 20,
};

fn run_sequence(d: &Device, seed: u64) -> Result<(u64, u64), Failure> {
    sequence::sequence(d, seed, &SHAPE)
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn every_driver_call_can_fail_without_panics_leaks_or_corruption() {
    let limit: u64 = std::env::var("FAULT_CALLS_PER_ENTRY").ok().and_then(|v| v.parse().ok()).unwrap_or(24);
    // Keeps the primary context alive between runs (each run's device retains and releases
    // it), and reads the driver's free memory.
    let anchor = Device::open(0).unwrap_or_else(|e| panic!("{e}"));
    let seed = 0x5eed_f00d;

    // The recording run: which entry points the sequence calls, how often, and the
    // accounting a run without faults leaves.
    let driver = load_driver();
    driver.faults().record();
    let (reference, recorded, teardown) = {
        let d = Device::open_on_driver(Arc::clone(&driver), 0, config()).unwrap();
        run_sequence(&d, seed).unwrap_or_else(|f| panic!("the sequence fails without faults: {f:?}"));
        let reference = settled(&d).unwrap();
        let recorded = driver.faults().counts();
        driver.faults().reset();
        drop(d);
        (reference, recorded, driver.faults().counts())
    };
    driver.faults().clear();
    let base = Baseline { seed, reference, anchor: &anchor, free: anchor.driver_free_bytes().unwrap() };
    for (phase, counts) in [("sequence", &recorded), ("teardown", &teardown)] {
        println!("recorded {phase}: {} entry points", counts.len());
        for (entry, count) in counts {
            println!("  {entry}: {} calls", count.calls);
        }
    }

    let mut failures: Vec<String> = Vec::new();
    let mut unfired: Vec<String> = Vec::new();
    let (mut cases, mut fired, mut absorbed, mut ops_total, mut bytes_total) = (0u64, 0u64, 0u64, 0u64, 0u64);
    let phases =
        recorded.iter().map(|e| (Phase::Sequence, e)).chain(teardown.iter().map(|e| (Phase::Teardown, e)));
    for (index, (phase, (&entry, count))) in phases.enumerate() {
        for k in call_numbers(count.calls, limit) {
            let codes: Vec<CUresult> = if count.calls < 4 {
                CODES.to_vec()
            } else {
                vec![CODES[(k as usize + index) % CODES.len()]]
            };
            for code in codes {
                cases += 1;
                let case = format!("{phase:?}: {entry} call {k} -> {code}");
                let fault = Fault::new(entry, k, code);
                let outcome = catch_unwind(AssertUnwindSafe(|| match phase {
                    Phase::Sequence => run_case(&driver, fault, &base),
                    Phase::Teardown => teardown_case(&driver, fault, &base),
                }));
                match outcome {
                    Ok(Ok(report)) => {
                        if !report.fired {
                            // Calls whose count varies with timing (event polling) may not
                            // reach k in this run.
                            unfired.push(case);
                        }
                        fired += u64::from(report.fired);
                        absorbed += u64::from(report.fired && report.absorbed);
                        ops_total += report.ops;
                        bytes_total += report.bytes;
                    }
                    Ok(Err(why)) => failures.push(format!("{case}: {why}")),
                    Err(panic) => {
                        let text = panic
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_default();
                        failures.push(format!("{case}: PANIC {text}"));
                    }
                }
                driver.faults().clear();
            }
        }
    }
    println!(
        "fault matrix: {cases} cases over {} entry points ({} in the sequence, {} in teardown), {fired} \
         faults fired ({absorbed} absorbed by a retry), {ops_total} operations, {bytes_total} bytes verified, \
         {} failures",
        recorded.keys().chain(teardown.keys()).collect::<std::collections::BTreeSet<_>>().len(),
        recorded.len(),
        teardown.len(),
        failures.len()
    );
    if !unfired.is_empty() {
        println!("not reached in their run: {}", unfired.join("; "));
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
    assert!(fired > 0, "no fault fired: the matrix tested nothing");
}

/// Where the fault is injected.
#[derive(Clone, Copy, Debug)]
enum Phase {
    /// While the device opens and runs the sequence.
    Sequence,
    /// While the device is dropped (every release retries once; nothing may leak).
    Teardown,
}

/// What every case compares against: the sequence's seed, the accounting a run without
/// faults leaves, and the device's free memory with no case running (read through `anchor`,
/// which keeps the primary context alive).
struct Baseline<'a> {
    seed: u64,
    reference: [u64; 5],
    anchor: &'a Device,
    free: u64,
}

impl Baseline<'_> {
    /// Fails when the driver reports less free device memory than before the case.
    fn no_leak(&self) -> Result<(), String> {
        common::free_memory_kept(self.free, self.anchor.driver_free_bytes().map_err(|e| e.to_string())?)
    }
}

/// A fault while a device that ran the whole sequence is dropped.
fn teardown_case(driver: &Arc<Driver>, fault: Fault, base: &Baseline) -> Result<CaseReport, String> {
    let (seed, reference) = (base.seed, base.reference);
    let faults = driver.faults();
    faults.record();
    let d = Device::open_on_driver(Arc::clone(driver), 0, config()).map_err(|e| e.to_string())?;
    let (ops, bytes) = run_sequence(&d, seed).map_err(|f| format!("the sequence failed: {f:?}"))?;
    let state = settled(&d).map_err(|e| e.to_string())?;
    if state != reference {
        return Err(format!("accounting {state:?}, expected {reference:?}"));
    }
    let mut counts = faults.counts();
    faults.reset();
    faults.inject(fault).map_err(|e| e.to_string())?;
    drop(d);
    faults.remove_faults();
    let fired = faults.injected() > 0;
    for (name, c) in faults.counts() {
        let total = counts.entry(name).or_default();
        total.calls += c.calls;
        total.succeeded += c.succeeded;
        total.injected += c.injected;
    }
    common::balanced(&counts)?;
    base.no_leak()?;
    Ok(CaseReport { fired, absorbed: fired, ops, bytes })
}

struct CaseReport {
    fired: bool,
    absorbed: bool,
    ops: u64,
    bytes: u64,
}

/// A fault while a device opens and runs the sequence; then the same device runs it again.
fn run_case(driver: &Arc<Driver>, fault: Fault, base: &Baseline) -> Result<CaseReport, String> {
    let (seed, reference, entry, k) = (base.seed, base.reference, fault.entry, fault.nth);
    let faults = driver.faults();
    faults.record();
    faults.inject(fault).map_err(|e| e.to_string())?;
    let (mut ops, mut bytes) = (0, 0);

    // The faulty run: opening the device may be what fails.
    let first = Device::open_on_driver(Arc::clone(driver), 0, config());
    let (device, first_result) = match first {
        Ok(d) => {
            let r = run_sequence(&d, seed);
            (Some(d), r.map_err(Some))
        }
        Err(e) => (None, Err(Some(Failure::Error(e)))),
    };
    let fired = faults.injected() > 0;
    faults.remove_faults();
    let absorbed = match first_result {
        Ok((o, b)) => {
            ops += o;
            bytes += b;
            true
        }
        Err(Some(Failure::Corrupt(why))) => return Err(format!("corrupt data after success: {why}")),
        Err(Some(Failure::Error(e))) => {
            if !fired {
                return Err(format!("an error without a fault: {e}"));
            }
            let text = e.to_string();
            if !text.contains(entry) {
                return Err(format!("the error does not name {entry}: {text}"));
            }
            if !text.contains("Fix:") {
                return Err(format!("the error has no Fix: {text}"));
            }
            false
        }
        Err(None) => unreachable!(),
    };

    // The same device (or a new one, if opening failed) runs everything again.
    let device = match device {
        Some(d) => d,
        None => {
            Device::open_on_driver(Arc::clone(driver), 0, config()).map_err(|e| format!("reopen: {e}"))?
        }
    };
    let (o, b) =
        run_sequence(&device, seed ^ k).map_err(|f| format!("the run after the fault failed: {f:?}"))?;
    ops += o;
    bytes += b;
    let state = settled(&device).map_err(|e| format!("settling after the fault: {e}"))?;
    if state != reference {
        return Err(format!(
            "accounting [buffers, allocated, reserved, pinned reserved, pinned lent] is {state:?}, \
             a run without faults leaves {reference:?}"
        ));
    }
    drop(device);

    common::balanced(&faults.counts())?;
    base.no_leak()?;
    Ok(CaseReport { fired, absorbed: fired && absorbed, ops, bytes })
}

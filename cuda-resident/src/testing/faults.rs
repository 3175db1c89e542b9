//! The fault matrix on the model driver, in CI: every driver call of a realistic sequence
//! fails in turn (without reaching the model), and the sequence must report it naming the
//! entry point, or absorb it; the same device must then run the sequence again with every
//! byte right; after a trim the accounting must be what a run without faults leaves; and once
//! the device is gone every acquisition must have its release. `tests/gpu_faults.rs` runs
//! the same checks, with more, on a real GPU.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use cuda_sys::{
    CUDA_ERROR_ILLEGAL_ADDRESS, CUDA_ERROR_LAUNCH_FAILED, CUDA_ERROR_OUT_OF_MEMORY, CUresult, Driver, Fault,
};

use crate::testing::model;

#[path = "../../tests/common/mod.rs"]
mod common;
#[path = "../../tests/common/sequence.rs"]
mod sequence;
use sequence::{Failure, Shape, call_numbers, settled};

use crate::{Config, Device, Error, ResidentBuffer};

const CODES: [CUresult; 3] = [CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_LAUNCH_FAILED, CUDA_ERROR_ILLEGAL_ADDRESS];

/// Slabs of 8 MiB, so that a buffer past the slab (a dedicated allocation) stays small.
fn config() -> Config {
    Config {
        chunk_bytes: 64 << 10,
        direct_threshold: 8 << 10,
        pinned_cap_bytes: 16 << 20,
        slab_bytes: 8 << 20,
        ..Config::default()
    }
}

/// The shared sequence at sizes that keep the model quick: 4 KiB, 6 MiB and 9 MiB buffers
/// (past the 8 MiB slab), a 256 KiB head.
const SHAPE: Shape = Shape {
    sizes: [4096, 6 << 20, 9 << 20],
    head: 256 << 10,
    writes: 60,
    direct: 40_000,
    ranges: 200,
    pinned: 100_000,
};

/// The shared sequence at [`SHAPE`]; a wrong byte after success panics.
fn run(d: &Device, seed: u64) -> Result<(), Error> {
    match sequence::sequence(d, seed, &SHAPE) {
        Ok(_) => Ok(()),
        Err(Failure::Error(e)) => Err(e),
        Err(Failure::Corrupt(why)) => panic!("corrupt data after success: {why}"),
    }
}

/// One case: the fault during open and the sequence, then the sequence again without it.
fn case(driver: &Arc<Driver>, fault: Fault, reference: [u64; 5]) -> Result<bool, String> {
    let faults = driver.faults();
    faults.record();
    let entry = fault.entry;
    faults.inject(fault).map_err(|e| e.to_string())?;
    let (device, first) = match Device::open_on_driver(Arc::clone(driver), 0, config()) {
        Ok(d) => {
            let r = run(&d, 7);
            (Some(d), r)
        }
        Err(e) => (None, Err(e)),
    };
    let fired = faults.injected() > 0;
    faults.remove_faults();
    if let Err(e) = &first {
        let text = e.to_string();
        if !fired || !text.contains(entry) || !text.contains("Fix:") {
            return Err(format!("fired: {fired}; the error does not name {entry} with a fix: {text}"));
        }
    }
    let device = match device {
        Some(d) => d,
        None => {
            Device::open_on_driver(Arc::clone(driver), 0, config()).map_err(|e| format!("reopen: {e}"))?
        }
    };
    run(&device, 8).map_err(|e| format!("the run after the fault: {e}"))?;
    let state = settled(&device).map_err(|e| format!("settling: {e}"))?;
    if state != reference {
        return Err(format!("accounting {state:?}, a run without faults leaves {reference:?}"));
    }
    drop(device);
    common::balanced(&faults.counts())?;
    Ok(fired)
}

#[test]
fn every_call_of_the_sequence_can_fail_on_the_model_without_panics_leaks_or_corruption() {
    let driver = model::driver();
    driver.faults().record();
    let (reference, recorded) = {
        let d = Device::open_on_driver(Arc::clone(&driver), 0, config()).unwrap();
        run(&d, 7).unwrap();
        // The calls a case's faulty run makes: opening and one sequence.
        let recorded = driver.faults().counts();
        run(&d, 8).unwrap();
        (settled(&d).unwrap(), recorded)
    };
    driver.faults().clear();
    let (mut cases, mut fired, mut failures) = (0, 0, Vec::new());
    for (index, (&entry, count)) in recorded.iter().enumerate() {
        // Every call number when there are few; else 16 spread from the first to the last.
        for k in call_numbers(count.calls, 16) {
            let code = CODES[(index + k as usize) % CODES.len()];
            cases += 1;
            let outcome =
                catch_unwind(AssertUnwindSafe(|| case(&driver, Fault::new(entry, k, code), reference)));
            driver.faults().clear();
            match outcome {
                Ok(Ok(f)) => fired += u64::from(f),
                Ok(Err(why)) => failures.push(format!("{entry} call {k} -> {code}: {why}")),
                Err(_) => failures.push(format!("{entry} call {k} -> {code}: panicked")),
            }
        }
    }
    println!("model fault matrix: {cases} cases over {} entry points, {fired} faults fired", recorded.len());
    assert!(failures.is_empty(), "{} of {cases} cases failed:\n{}", failures.len(), failures.join("\n"));
    assert!(cases > 100 && fired > 100, "{cases} cases, {fired} fired: the matrix tested too little");
}

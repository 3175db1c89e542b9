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

/// The sequence: three buffers (size class, slab range, past the slab), a ragged batch across
/// chunks, an in-place batch, small writes and reads in order, a single small write, readbacks as views and into a slice,
/// pinned staging, frees. Buffers are freed whatever happens. Any wrong byte panics.
fn sequence(d: &Device, seed: u64) -> Result<(), Error> {
    let mut held: Vec<ResidentBuffer> = Vec::new();
    let result = sequence_body(d, seed, &mut held);
    let mut freed = Ok(());
    for b in held {
        freed = freed.and(d.free(b));
    }
    result.and(freed)
}

fn sequence_body(d: &Device, seed: u64, held: &mut Vec<ResidentBuffer>) -> Result<(), Error> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let sizes = [4096usize, 6 << 20, 9 << 20];
    for &n in &sizes {
        held.push(d.allocate(n as u64)?);
    }
    // Fresh buffers hold whatever their memory held before: give them known bytes first.
    let mut model: Vec<Vec<u8>> = [sizes[0], sizes[1], 256 << 10]
        .iter()
        .map(|&n| {
            let mut v = vec![0u8; n];
            rng.fill(&mut v);
            v
        })
        .collect();
    let initial: Vec<_> = held.iter().zip(&model).map(|(&b, v)| (b, 0, v.as_slice())).collect();
    d.upload_at_many(&initial)?;
    let mut batch = d.uploads();
    let writes: Vec<(usize, usize, Vec<u8>)> = (0..60)
        .map(|i| {
            let b = i % 3;
            let len = if i % 20 == 0 { 40_000.min(model[b].len()) } else { rng.usize(1..2000) };
            let offset = rng.usize(0..=model[b].len() - len);
            let mut bytes = vec![0u8; len];
            rng.fill(&mut bytes);
            (b, offset, bytes)
        })
        .collect();
    for (b, offset, bytes) in &writes {
        batch.write(held[*b], *offset as u64, bytes)?;
        model[*b][*offset..offset + bytes.len()].copy_from_slice(bytes);
    }
    batch.submit()?.wait()?;
    let mut batch = d.uploads();
    for k in 0..20u64 {
        let value = rng.u8(..);
        batch.write_with(held[1], k * 4000 + 7, 1000, |dst| dst.fill(value))?;
        model[1][(k * 4000 + 7) as usize..][..1000].fill(value);
    }
    batch.submit()?.wait()?;
    // Many small writes in order with gaps, then reads of them into vectors: both laid out
    // without the planner, over more chunks than the ring holds, and over a megabyte, so
    // that the packing threads pack and copy out while chunks move.
    let mut order = Vec::new();
    let (mut at, mut total) = (0usize, 0usize);
    while total < (1 << 20) + (64 << 10) {
        let len = rng.usize(1..3000);
        let mut bytes = vec![0u8; len];
        rng.fill(&mut bytes);
        order.push((at, bytes));
        at += len + rng.usize(1..64);
        total += len;
    }
    let mut batch = d.uploads();
    for (at, bytes) in &order {
        batch.write(held[1], *at as u64, bytes)?;
        model[1][*at..at + bytes.len()].copy_from_slice(bytes);
    }
    batch.submit()?.wait()?;
    let mut reads = d.readbacks();
    let slots = order
        .iter()
        .map(|(at, bytes)| reads.read(held[1], *at as u64, bytes.len() as u64))
        .collect::<Result<Vec<_>, _>>()?;
    let mut outs = vec![vec![0x5a_u8; 7]; slots.len()];
    let got = reads.submit()?.wait_into(&slots, &mut outs)?;
    for (((at, bytes), &slot), out) in order.iter().zip(&slots).zip(&outs) {
        let expected = &model[1][*at..at + bytes.len()];
        assert!(got.get(slot) == expected, "an in-order read differs after success");
        assert!(out[..] == *expected, "an in-order read copied out differs after success");
    }
    drop(got);
    let one: Vec<u8> = (0..100).map(|_| rng.u8(..)).collect();
    d.upload_at(held[0], 50, &one)?;
    model[0][50..150].copy_from_slice(&one);

    let mut reads = d.readbacks();
    let slots = [reads.read_all(held[0])?, reads.read_all(held[1])?, reads.read(held[2], 0, 256 << 10)?];
    let got = reads.submit()?.wait()?;
    for (i, slot) in slots.iter().enumerate() {
        let at = got.get(*slot).iter().zip(&model[i]).position(|(a, b)| a != b);
        assert!(at.is_none(), "buffer {i} differs at {at:?} after a run that reported success");
    }
    drop(got);
    let mut slice = vec![0u8; 10_000];
    d.read_into_slice(held[1], 1234, &mut slice)?;
    assert!(slice == model[1][1234..11_234], "read_into_slice differs after success");
    drop(d.pinned(100_000)?);
    Ok(())
}

fn settled(d: &Device) -> Result<[u64; 5], Error> {
    d.synchronize()?;
    d.trim()?;
    let t = d.telemetry();
    Ok([
        t.memory.buffers,
        t.memory.allocated_bytes,
        t.memory.reserved_bytes,
        t.pinned.reserved_bytes,
        t.pinned.lent_bytes,
    ])
}

/// One case: the fault during open and the sequence, then the sequence again without it.
fn case(driver: &Arc<Driver>, fault: Fault, reference: [u64; 5]) -> Result<bool, String> {
    let faults = driver.faults();
    faults.record();
    let entry = fault.entry;
    faults.inject(fault).map_err(|e| e.to_string())?;
    let (device, first) = match Device::open_with(Arc::clone(driver), 0, config()) {
        Ok(d) => {
            let r = sequence(&d, 7);
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
        None => Device::open_with(Arc::clone(driver), 0, config()).map_err(|e| format!("reopen: {e}"))?,
    };
    sequence(&device, 8).map_err(|e| format!("the run after the fault: {e}"))?;
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
        let d = Device::open_with(Arc::clone(&driver), 0, config()).unwrap();
        sequence(&d, 7).unwrap();
        // The calls a case's faulty run makes: opening and one sequence.
        let recorded = driver.faults().counts();
        sequence(&d, 8).unwrap();
        (settled(&d).unwrap(), recorded)
    };
    driver.faults().clear();
    let (mut cases, mut fired, mut failures) = (0, 0, Vec::new());
    for (index, (&entry, count)) in recorded.iter().enumerate() {
        // Every call number when there are few; else 16 spread from the first to the last.
        let ks: Vec<u64> = if count.calls <= 16 {
            (1..=count.calls).collect()
        } else {
            (0..16).map(|i| 1 + i * (count.calls - 1) / 15).collect()
        };
        for k in ks {
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

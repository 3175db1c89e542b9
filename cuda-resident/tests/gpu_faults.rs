//! Fault injection at every driver call the engine makes, on a real GPU.
//!
//! A recording run of a realistic sequence (open a device; allocate from a size class, a slab
//! range and a dedicated allocation; packed, direct, in-place and single uploads; readbacks
//! as views, into slices and ranged; pinned staging; frees; trim) counts the calls of every
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

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use cuda_resident::cuda_sys::{self, CUresult, Driver, Fault};
use cuda_resident::{Config, Device, Error, ResidentBuffer};

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

/// What went wrong in a run of the sequence.
#[derive(Debug)]
enum Failure {
    /// An operation returned an error (expected when a fault was injected).
    Error(Error),
    /// An operation succeeded but the bytes are wrong: never acceptable.
    Corrupt(String),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        Failure::Error(e)
    }
}

fn random_vec(rng: &mut fastrand::Rng, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rng.fill(&mut v);
    v
}

fn same(what: &str, got: &[u8], want: &[u8]) -> Result<(), Failure> {
    if got == want {
        return Ok(());
    }
    let at = got.iter().zip(want).position(|(a, b)| a != b);
    Err(Failure::Corrupt(format!(
        "{what}: {} vs {} bytes, first difference at {at:?}",
        got.len(),
        want.len()
    )))
}

/// The realistic sequence. Buffers are freed whatever happens, as an owner's cleanup would.
/// Returns the number of operations run and bytes verified.
fn sequence(d: &Device, seed: u64) -> Result<(u64, u64), Failure> {
    let mut held: Vec<ResidentBuffer> = Vec::new();
    let result = sequence_body(d, seed, &mut held);
    let mut freed = Ok(());
    for b in held {
        if let Err(e) = d.free(b) {
            freed = freed.and(Err(Failure::Error(e)));
        }
    }
    let counts = result?;
    freed.map(|()| counts)
}

fn sequence_body(d: &Device, seed: u64, held: &mut Vec<ResidentBuffer>) -> Result<(u64, u64), Failure> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let (mut ops, mut checked) = (0u64, 0u64);
    let sizes = [64usize << 10, 3 << 20, 65 << 20];
    for &n in &sizes {
        held.push(d.allocate(n as u64)?);
        ops += 1;
    }
    let [small, mid, big] = [held[0], held[1], held[2]];
    // The bytes each buffer should hold (for `big`, its first 2 MiB).
    let mut model = [random_vec(&mut rng, sizes[0]), random_vec(&mut rng, sizes[1]), vec![0u8; 2 << 20]];
    d.upload_many(&[(small, &model[0][..]), (mid, &model[1][..])])?;
    ops += 1;

    // A ragged batch: many small overlapping writes (packed, scattered by the kernel) and one
    // 2 MiB write (direct), across several 1 MiB chunks.
    let data: Vec<(usize, u64, Vec<u8>)> = (0..300)
        .map(|_| {
            let i = rng.usize(0..2);
            let len = rng.usize(1..=3000);
            let offset = rng.usize(0..=sizes[i] - len);
            (i, offset as u64, random_vec(&mut rng, len))
        })
        .collect();
    let whole = random_vec(&mut rng, 2 << 20);
    let mut batch = d.uploads();
    for (i, offset, bytes) in &data {
        batch.write([small, mid][*i], *offset, bytes)?;
    }
    batch.write(big, 0, &whole)?;
    batch.submit()?.wait()?;
    ops += 1;
    for (i, offset, bytes) in &data {
        model[*i][*offset as usize..*offset as usize + bytes.len()].copy_from_slice(bytes);
    }
    model[2].copy_from_slice(&whole);

    // In place: disjoint writes filled straight into pinned staging.
    let mut batch = d.uploads();
    let fills: Vec<(u64, Vec<u8>)> = (0..50).map(|j| (j * 4096 + 7, random_vec(&mut rng, 1000))).collect();
    for (offset, bytes) in &fills {
        batch.write_with(mid, *offset, bytes.len(), |dst| dst.copy_from_slice(bytes))?;
    }
    batch.submit()?.wait()?;
    ops += 1;
    for (offset, bytes) in &fills {
        model[1][*offset as usize..*offset as usize + bytes.len()].copy_from_slice(bytes);
    }

    // Many small writes in order with gaps, then reads of the same ranges into vectors: both
    // laid out without the planner, over several chunks and over a megabyte, so that the
    // packing threads pack and copy out while chunks move.
    let mut order = Vec::new();
    let (mut at, mut total) = (0u64, 0usize);
    while total < (1 << 20) + (64 << 10) {
        let len = rng.usize(1..=4000);
        order.push((at, random_vec(&mut rng, len)));
        at += len as u64 + rng.u64(1..64);
        total += len;
    }
    let mut batch = d.uploads();
    for (offset, bytes) in &order {
        batch.write(mid, *offset, bytes)?;
    }
    batch.submit()?.wait()?;
    ops += 1;
    for (offset, bytes) in &order {
        model[1][*offset as usize..*offset as usize + bytes.len()].copy_from_slice(bytes);
    }
    let mut reads = d.readbacks();
    let slots = order
        .iter()
        .map(|(offset, bytes)| reads.read(mid, *offset, bytes.len() as u64))
        .collect::<Result<Vec<_>, _>>()?;
    let mut outs = vec![vec![0x5a_u8; 3]; slots.len()];
    let got = reads.submit()?.wait_into(&slots, &mut outs)?;
    ops += 1;
    for (((offset, bytes), &slot), out) in order.iter().zip(&slots).zip(&outs) {
        let expected = &model[1][*offset as usize..*offset as usize + bytes.len()];
        same("in-order range", got.get(slot), expected)?;
        same("in-order range copied out", out, expected)?;
        checked += 2 * bytes.len() as u64;
    }
    drop(got);

    // One small write: the latency path.
    let one = random_vec(&mut rng, 100);
    d.upload_at(small, 999, &one)?;
    model[0][999..1099].copy_from_slice(&one);
    ops += 1;

    // Readbacks: whole buffers, a direct range, many small ranges; views and copies.
    let mut reads = d.readbacks();
    let all_small = reads.read_all(small)?;
    let all_mid = reads.read_all(mid)?;
    let head = reads.read(big, 0, 2 << 20)?;
    let ranges: Vec<(usize, u64, u64)> = (0..200)
        .map(|_| {
            let i = rng.usize(0..2);
            let len = rng.usize(1..=2000);
            (i, rng.usize(0..=sizes[i] - len) as u64, len as u64)
        })
        .collect();
    let mut slots = Vec::new();
    for &(i, offset, len) in &ranges {
        slots.push(reads.read([small, mid][i], offset, len)?);
    }
    let got = reads.submit()?.wait()?;
    ops += 1;
    same("small", got.get(all_small), &model[0])?;
    same("mid", got.get(all_mid), &model[1])?;
    same("big head", got.get(head), &model[2])?;
    checked += (model[0].len() + model[1].len() + model[2].len()) as u64;
    for (&(i, offset, len), &slot) in ranges.iter().zip(&slots) {
        let want = &model[i][offset as usize..(offset + len) as usize];
        same("range", got.get(slot), want)?;
        checked += len;
    }
    drop(got);

    let range = d.download_range(mid, 12345, 777)?;
    same("download_range", &range, &model[1][12345..12345 + 777])?;
    let mut out = vec![0x5au8; 2 << 20];
    d.read_into_slice(big, 0, &mut out)?;
    same("read_into_slice", &out, &model[2])?;
    checked += 777 + out.len() as u64;
    ops += 2;

    let mut pinned = d.pinned(1 << 20)?;
    pinned.fill(0xa5);
    drop(pinned);
    ops += 1;
    Ok((ops, checked))
}

/// The state of the accounting after a sequence, a synchronize and a trim.
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

/// The call numbers tried for an entry point called `calls` times: all of them, or `limit`
/// spread evenly from the first to the last.
fn call_numbers(calls: u64, limit: u64) -> Vec<u64> {
    if calls <= limit {
        return (1..=calls).collect();
    }
    let mut ks: Vec<u64> = (0..limit).map(|i| 1 + i * (calls - 1) / (limit - 1)).collect();
    ks.dedup();
    ks
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
        let d = Device::open_with(Arc::clone(&driver), 0, config()).unwrap();
        sequence(&d, seed).unwrap_or_else(|f| panic!("the sequence fails without faults: {f:?}"));
        let reference = settled(&d).unwrap();
        let recorded = driver.faults().counts();
        driver.faults().reset();
        drop(d);
        (reference, recorded, driver.faults().counts())
    };
    driver.faults().clear();
    let base = Baseline { seed, reference, anchor: &anchor, free: anchor.free_memory().unwrap() };
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
        common::free_memory_kept(self.free, self.anchor.free_memory().map_err(|e| e.to_string())?)
    }
}

/// A fault while a device that ran the whole sequence is dropped.
fn teardown_case(driver: &Arc<Driver>, fault: Fault, base: &Baseline) -> Result<CaseReport, String> {
    let (seed, reference) = (base.seed, base.reference);
    let faults = driver.faults();
    faults.record();
    let d = Device::open_with(Arc::clone(driver), 0, config()).map_err(|e| e.to_string())?;
    let (ops, bytes) = sequence(&d, seed).map_err(|f| format!("the sequence failed: {f:?}"))?;
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
    let first = Device::open_with(Arc::clone(driver), 0, config());
    let (device, first_result) = match first {
        Ok(d) => {
            let r = sequence(&d, seed);
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
        None => Device::open_with(Arc::clone(driver), 0, config()).map_err(|e| format!("reopen: {e}"))?,
    };
    let (o, b) = sequence(&device, seed ^ k).map_err(|f| format!("the run after the fault failed: {f:?}"))?;
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

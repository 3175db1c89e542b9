//! cuda-resident and cudarc on one GPU, ordered on the GPU only.
//!
//! Uploads a batch of small rows with cuda-resident, adds one to every byte with a cudarc
//! kernel (hand-written PTX, loaded by the driver: no CUDA toolkit is needed to build or
//! run), downloads the rows with a download batch, and checks every byte. The kernel waits
//! for the upload's fence and the download for the kernel's stream on the GPU; the one host
//! wait is for the download's bytes.
//!
//! ```text
//! cargo run --release --example with-cudarc --features cudarc
//! ```

use std::process::ExitCode;

use cuda_resident::Device;
use cuda_resident::cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

/// `add_one(u8 *data, u32 n)`: `data[i] += 1` for every `i < n`, one thread per byte.
/// The text is shared with cuda-resident's GPU test and lies in that package, the published one.
const ADD_ONE_PTX: &str = include_str!("../cuda-resident/tests/kernels/add_one.ptx");

const ROWS: u64 = 4096;
const ROW_BYTES: u64 = 256;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("with-cudarc: {e}");
            ExitCode::FAILURE
        }
    }
}

fn row(i: u64) -> Vec<u8> {
    (0..ROW_BYTES).map(|j| (i * 31 + j * 7) as u8).collect()
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    // The Device first: without a driver it fails with an error (cudarc would panic).
    let device = Device::open(0)?;
    let ordinal = device.info().ordinal;
    // Retains the same primary context as `device`.
    let ctx = CudaContext::new(ordinal)?;
    let stream = ctx.new_stream()?;
    let kernel = ctx.load_module(Ptx::from_src(ADD_ONE_PTX))?.load_function("add_one")?;
    println!("device {ordinal}: {}; cudarc stream on the same primary context", device.info().name);

    let bytes = ROWS * ROW_BYTES;
    // Owned: an error on the way frees it (after the view below, which drops first).
    let buffer = device.allocate_owned(bytes)?;
    let rows: Vec<Vec<u8>> = (0..ROWS).map(row).collect();
    let host_waits_before = device.telemetry().host_waits;

    // 1. Upload: ROWS small writes, fused into one batch.
    let mut uploads = device.uploads();
    for (i, r) in rows.iter().enumerate() {
        uploads.write(*buffer, i as u64 * ROW_BYTES, r)?;
    }
    let uploaded = uploads.submit()?;

    // 2. The kernel, on cudarc's stream, after the upload (a wait on the GPU).
    uploaded.make_cudarc_stream_wait(&stream)?;
    let mut view = device.cudarc_view::<u8>(*buffer, &stream)?;
    let n = u32::try_from(view.len())?;
    let mut launch = stream.launch_builder(&kernel);
    launch.arg(&mut view).arg(&n);
    // SAFETY: `add_one` takes a `u8*` and a `u32`, as pushed; it touches the `n` bytes of
    // `buffer`, which stays allocated until the kernel is done: on every path the view drops
    // before the buffer, and its drop waits for the device's streams.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }?;

    // 3. The download, after the kernel (a wait on the GPU).
    device.wait_for_cudarc_stream(&stream)?;
    let mut reads = device.downloads();
    let slots =
        (0..ROWS).map(|i| reads.read(*buffer, i * ROW_BYTES, ROW_BYTES)).collect::<Result<Vec<_>, _>>()?;
    let pending = reads.submit()?;
    let submitted_waits = device.telemetry().host_waits - host_waits_before;
    let done = pending.wait()?; // the only host wait

    let mut checked = 0u64;
    for (i, (slot, sent)) in slots.iter().zip(&rows).enumerate() {
        let got = done.get(*slot);
        for (j, (&g, &s)) in got.iter().zip(sent).enumerate() {
            if g != s.wrapping_add(1) {
                return Err(format!(
                    "row {i} byte {j}: got {g}, expected {} (sent {s} + 1)",
                    s.wrapping_add(1)
                )
                .into());
            }
            checked += 1;
        }
    }
    drop(done);
    // The view holds the buffer until it drops (its drop waits for the device's streams).
    drop(view);
    buffer.free()?;
    println!(
        "uploaded {ROWS} rows of {ROW_BYTES} B in one batch, ran add_one over {bytes} B on cudarc's stream, \
         downloaded {ROWS} rows in one batch"
    );
    println!(
        "host waits before the download's own: {submitted_waits}; checked {checked} bytes: all sent + 1"
    );
    if submitted_waits != 0 {
        return Err("the host waited before the download was submitted".into());
    }
    Ok(())
}

//! An all-reduce across every GPU of the host, on resident buffers, ordered by fences.
//!
//! Each GPU uploads its part (rank `r` holds `COUNT` floats of value `r + 1`) into a
//! [`ResidentBuffer`](cuda_resident::ResidentBuffer) with an upload batch; NCCL's stream
//! waits for that upload's fence on the GPU; `ncclAllReduce` sums the buffers in place; the
//! download waits for NCCL's stream on the GPU and reads the sums back. The host waits once,
//! for the downloads. docs/multi-gpu.md explains each step.
//!
//! Needs 2 or more GPUs and NCCL's library (`libnccl.so.2`, loaded at run time):
//!
//! ```text
//! cargo run --release --example nccl-allreduce --features nccl
//! ```

use std::process::ExitCode;

use cuda_resident::cudarc::driver::CudaContext;
use cuda_resident::cudarc::nccl::safe::{Comm, ReduceOp, group_end, group_start};
use cuda_resident::{DeviceSet, OwnedBuffer};

/// Floats per GPU.
const COUNT: usize = 1 << 20;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nccl-allreduce: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let gpus = DeviceSet::open_all()?;
    let n = gpus.len();
    if n < 2 {
        return Err(format!(
            "an all-reduce needs 2 or more GPUs and the driver sees {n}. Fix: run on a machine with several \
             GPUs (and check CUDA_VISIBLE_DEVICES)"
        )
        .into());
    }

    // One cudarc stream per GPU, on the primary context its `Device` uses; NCCL runs on them.
    let mut streams = Vec::with_capacity(n);
    for d in gpus.devices() {
        streams.push(CudaContext::new(d.info().ordinal)?.new_stream()?);
    }
    let comms = Comm::from_devices(streams.clone()).map_err(|e| format!("ncclCommInitAll failed: {e:?}"))?;

    // 1. Each GPU's part, uploaded; NCCL's stream waits for it on the GPU. Owned buffers: an
    // error on the way frees them (after the views below, which drop first).
    let mut buffers: Vec<OwnedBuffer> = Vec::with_capacity(n);
    for (rank, (d, stream)) in gpus.devices().iter().zip(&streams).enumerate() {
        let buffer = d.allocate_owned((COUNT * size_of::<f32>()) as u64)?;
        let part: Vec<u8> = std::iter::repeat_n((rank as f32 + 1.0).to_ne_bytes(), COUNT).flatten().collect();
        let mut uploads = d.uploads();
        uploads.write(*buffer, 0, &part)?;
        uploads.submit()?.make_cudarc_stream_wait(stream)?;
        buffers.push(buffer);
    }

    // 2. The all-reduce, in place: one call per GPU, grouped (one thread drives every GPU).
    let mut views = Vec::with_capacity(n);
    for ((d, stream), buffer) in gpus.devices().iter().zip(&streams).zip(&buffers) {
        views.push(d.cudarc_view::<f32>(buffer.handle(), stream)?);
    }
    group_start().map_err(|e| format!("ncclGroupStart failed: {e:?}"))?;
    for (comm, view) in comms.iter().zip(&mut views) {
        comm.all_reduce_in_place(view, &ReduceOp::Sum).map_err(|e| format!("ncclAllReduce failed: {e:?}"))?;
    }
    group_end().map_err(|e| format!("ncclGroupEnd failed: {e:?}"))?;

    // 3. The sums, downloaded after NCCL's work (a wait on the GPU), then checked.
    let expected = (n * (n + 1) / 2) as f32;
    let mut pending = Vec::with_capacity(n);
    for ((d, stream), buffer) in gpus.devices().iter().zip(&streams).zip(&buffers) {
        d.wait_for_cudarc_stream(stream)?;
        let mut reads = d.downloads();
        let slot = reads.read(buffer.handle(), 0, (COUNT * size_of::<f32>()) as u64)?;
        pending.push((reads.submit()?, slot));
    }
    for (rank, (p, slot)) in pending.into_iter().enumerate() {
        let done = p.wait()?;
        let bad = done
            .get(slot)
            .chunks_exact(4)
            .position(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]) != expected);
        if let Some(i) = bad {
            return Err(format!("GPU {rank}: float {i} is not the sum {expected}").into());
        }
    }
    // The views hold their buffers until they drop (each drop waits for its device's
    // streams: done by now).
    drop(views);
    for buffer in buffers {
        buffer.free()?;
    }
    println!("all-reduce (sum) of {COUNT} floats over {n} GPUs: every GPU holds {expected} everywhere");
    Ok(())
}

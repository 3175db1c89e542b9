//! Loads a safetensors checkpoint into GPU memory with a progress bar, checks every byte,
//! and saves it back.
//!
//! ```sh
//! cargo run --release --example load-weights -- model.safetensors
//! cargo run --release --example load-weights -- --weights-size 4GiB   # a synthetic one
//! ```
//!
//! Without a path (or with one that does not exist yet), it first writes a synthetic
//! checkpoint: Llama-3-8B's tensor list, as many layers as fit `--weights-size` (default
//! 4 GiB), bf16, random bytes (`cuda_resident_suite::weights`). The load and the save each
//! print GB/s; the saved copy goes beside the input as `*.out.safetensors` and is removed
//! after its check, unless `--keep`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use cuda_resident::weights::{LoadOptions, SaveOptions};
use cuda_resident::{Config, Device};
use cuda_resident_suite::weights::{compare, llama, map, verify_loaded, warm, write};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Parser)]
#[command(
    about = "Load a safetensors checkpoint into GPU memory through cuda-resident, check it, save it back."
)]
struct Args {
    /// The checkpoint; written first (synthetic) when it does not exist.
    path: Option<PathBuf>,
    /// Size of the synthetic checkpoint, in bytes or with a unit (4GiB).
    #[arg(long, default_value = "4GiB", value_parser = size)]
    weights_size: u64,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Load every tensor into one buffer instead of one each.
    #[arg(long)]
    arena: bool,
    /// Keep the saved copy.
    #[arg(long)]
    keep: bool,
    /// Load it this many times, each checked and dropped before the next (GB/s of each):
    /// the first load of a process pays for its pinned staging, later ones reuse it.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    loads: u32,
    /// Pinned memory to allocate as the device opens (`Config::pinned_prewarm_bytes`), in
    /// bytes or with a unit (0: none): the staging a first load otherwise makes as it goes
    /// (on an H100 it then ran at 30 GB/s instead of 46).
    #[arg(long, default_value = "256MiB", value_parser = size_or_zero)]
    pinned_prewarm: u64,
    /// Make pinned staging by `cuMemHostAlloc` rather than of huge pages
    /// (`Config::pinned_huge_pages = false`).
    #[arg(long)]
    no_huge_pages: bool,
}

/// `4096`, `256MiB`, `4GiB`: a size of at least one byte.
fn size(s: &str) -> Result<u64, String> {
    match size_or_zero(s)? {
        0 => Err(not_a_size(s)),
        n => Ok(n),
    }
}

/// As [`size`], 0 (with or without a unit) allowed.
fn size_or_zero(s: &str) -> Result<u64, String> {
    let units = [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1)];
    let (digits, unit) = units.iter().find_map(|&(u, n)| s.strip_suffix(u).map(|d| (d, n))).unwrap_or((s, 1));
    digits.trim().parse::<u64>().ok().and_then(|n| n.checked_mul(unit)).ok_or_else(|| not_a_size(s))
}

fn not_a_size(s: &str) -> String {
    format!("{s:?} is not a size such as 4096, 256MiB or 4GiB")
}

fn bar(total: u64, what: &str) -> ProgressBar {
    let style =
        ProgressStyle::with_template("{msg:6} {bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar());
    ProgressBar::new(total).with_style(style).with_message(what.to_owned())
}

fn run(args: &Args) -> Result<(), String> {
    let path = args.path.clone().unwrap_or_else(|| PathBuf::from("target/load-weights/weights.safetensors"));
    if !path.exists() {
        let model = llama(args.weights_size);
        println!("writing {} ({}, {} tensors, bf16)", path.display(), model.family, model.tensors.len());
        if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        }
        write(&model, &path, 36)?;
    }
    let config = Config::default()
        .with_pinned_prewarm_bytes(args.pinned_prewarm)
        .with_pinned_huge_pages(!args.no_huge_pages);
    let opening = Instant::now();
    let device = Device::open_configured(args.device, config).map_err(|e| e.to_string())?;
    println!(
        "{}: opened in {:.1} ms; loading with the calling thread and {} packing threads, pinned memory capped at {} MiB, {} MiB allocated at open, {}",
        device.info().name,
        opening.elapsed().as_secs_f64() * 1e3,
        device.config().resolved_pack_threads(),
        device.config().pinned_cap_bytes >> 20,
        device.config().pinned_prewarm_bytes >> 20,
        if device.pinned_in_huge_pages() { "in huge pages" } else { "by cuMemHostAlloc" },
    );
    // From the page cache, as a runtime that restarts finds it.
    let _ = warm(&map(&path)?);

    let total = std::fs::metadata(&path).map_err(|e| e.to_string())?.len();
    let mut ckpt = None;
    for load in 1..=args.loads {
        drop(ckpt.take());
        let progress = bar(total, "load");
        let started = Instant::now();
        let options = LoadOptions::new().arena(args.arena).progress(|done, total| {
            progress.set_length(total);
            progress.set_position(done);
        });
        let loaded = device.load_safetensors_configured(&path, options).map_err(|e| e.to_string())?;
        let secs = started.elapsed().as_secs_f64();
        progress.finish();
        let pinned = device.telemetry().pinned;
        println!(
            "load {load}: {} tensors, {:.2} GB in {:.3} s: {:.1} GB/s ({} MiB of pinned staging held)",
            loaded.len(),
            loaded.total_bytes() as f64 / 1e9,
            secs,
            loaded.total_bytes() as f64 / 1e9 / secs,
            pinned.reserved_bytes >> 20,
        );
        verify_loaded(&device, &loaded, &map(&path)?)?;
        ckpt = Some(loaded);
    }
    let ckpt = ckpt.expect("at least one load");
    println!("every byte checked against the file");

    let out = path.with_extension("out.safetensors");
    let progress = bar(ckpt.total_bytes(), "save");
    let started = Instant::now();
    let tensors: Vec<_> =
        ckpt.tensors().iter().map(|t| (t.name(), t.dtype(), t.shape(), t.buffer())).collect();
    let options = SaveOptions::new().progress(|done, _| progress.set_position(done));
    device.save_safetensors_configured(&out, &tensors, options).map_err(|e| e.to_string())?;
    let secs = started.elapsed().as_secs_f64();
    progress.finish();
    println!("saved {} in {:.3} s: {:.1} GB/s", out.display(), secs, ckpt.total_bytes() as f64 / 1e9 / secs);
    // The same tensors, bytes and order: the file differs from the input at most in its
    // header (a checkpoint written by another tool orders or pads it otherwise).
    let (a, b) = (map(&path)?, map(&out)?);
    let (ra, rb) =
        (cuda_resident_suite::weights::tensor_ranges(&a)?, cuda_resident_suite::weights::tensor_ranges(&b)?);
    for (name, start, len) in &ra {
        let there = rb.iter().find(|r| &r.0 == name).ok_or_else(|| format!("tensor {name} was not saved"))?;
        compare(name, &b[there.1..there.1 + there.2], &a[*start..start + len])?;
    }
    println!("every byte of the saved file checked");
    if !args.keep {
        std::fs::remove_file(&out).map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(line) => {
            eprintln!("load-weights: {line}");
            ExitCode::FAILURE
        }
    }
}

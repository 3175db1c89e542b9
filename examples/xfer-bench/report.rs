//! What a run says: its rows, the header (provenance, configuration, device), the text
//! table, and the JSON report with its plots.

use cuda_resident::Device;
use cuda_resident_suite::PROVENANCE;

use crate::cli::Args;
use crate::single::ByMethod;
use crate::suites::SuitePlan;

/// One row of the report.
#[derive(Debug)]
pub(crate) struct Row {
    pub(crate) case: String,
    /// Copies per batch (many-small cases), for the plots and the report.
    pub(crate) count: Option<usize>,
    /// Bytes per copy, for the plots (cases that sweep a size).
    pub(crate) size: Option<usize>,
    pub(crate) unit: &'static str,
    pub(crate) raw: Option<f64>,
    pub(crate) batch: Option<f64>,
    pub(crate) ours: f64,
    /// Anything the reader of this row should know (fewer baseline repetitions).
    pub(crate) note: Option<String>,
}

impl Row {
    pub(crate) fn new(
        case: String,
        unit: &'static str,
        raw: Option<f64>,
        batch: Option<f64>,
        ours: f64,
    ) -> Row {
        Row { case, count: None, size: None, unit, raw, batch, ours, note: None }
    }

    pub(crate) fn gbps(case: String, bytes: usize, raw: Option<f64>, batch: Option<f64>, ours: f64) -> Row {
        let rate = |secs: f64| bytes as f64 / secs / 1e9;
        Row::new(case, "GB/s", raw.map(rate), batch.map(rate), rate(ours))
    }

    /// A bandwidth row from the times of each method.
    pub(crate) fn from_times(case: String, bytes: usize, t: &ByMethod<f64>) -> Row {
        Row::gbps(case, bytes, Some(t.raw), t.batch, t.ours)
    }

    pub(crate) fn sized(mut self, size: usize) -> Row {
        self.size = Some(size);
        self
    }

    /// cuda-resident's advantage over `base` (higher is better for both units).
    fn ratio(&self, base: Option<f64>) -> String {
        match base {
            Some(b) if self.unit == "GB/s" => format!("{:.1}x", self.ours / b),
            Some(b) => format!("{:.2}x", b / self.ours),
            None => "n/a".into(),
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "case": self.case, "count": self.count, "bytes_per_copy": self.size, "unit": self.unit,
            "raw": self.raw, "batch": self.batch, "cuda_resident": self.ours, "note": self.note,
        })
    }
}

/// `bytes` as people write it: `4 KiB`, `1 GiB`, `100 B`.
pub(crate) fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

/// The PCIe link of the device at `bus_id` (`0000:00:06.0`) as Linux reports it under
/// `root` (`/sys/bus/pci/devices`): `PCIe 32.0 GT/s x16 (max 32.0 GT/s x16)`, or `None`
/// where the files are not there (another system, a container without sysfs).
fn pci_link(root: &std::path::Path, bus_id: &str) -> Option<String> {
    let dir = root.join(bus_id.to_ascii_lowercase());
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok().map(|s| s.trim().to_owned());
    let speed = |s: String| s.trim_end_matches(" PCIe").to_owned();
    let (now_speed, now_width) = (speed(read("current_link_speed")?), read("current_link_width")?);
    // Virtual slots may say "Unknown" or a width of 0.
    if !now_speed.contains("GT/s") || now_width == "0" {
        return None;
    }
    let mut link = format!("PCIe {now_speed} x{now_width}");
    if let (Some(max_speed), Some(max_width)) = (read("max_link_speed"), read("max_link_width")) {
        link.push_str(&format!(" (max {} x{max_width})", speed(max_speed)));
    }
    Some(link)
}

/// The device's link, or "unknown".
fn link_of(d: &Device) -> String {
    pci_link(std::path::Path::new("/sys/bus/pci/devices"), &d.info().pci_bus_id)
        .unwrap_or_else(|| "link unknown".to_owned())
}

/// What the report says about the device.
pub(crate) fn device_json(d: &Device) -> serde_json::Value {
    let i = d.info();
    serde_json::json!({
        "name": i.name, "ordinal": i.ordinal, "pci_bus_id": i.pci_bus_id, "link": link_of(d),
        "total_memory": i.total_memory,
        "compute_capability": [i.compute_capability.0, i.compute_capability.1],
        "copy_engines": i.copy_engines, "driver_cuda_version": i.driver_version.to_string(),
        "cuMemcpyBatchAsync": i.batch_memcpy,
    })
}

/// The lines before the table: the build's provenance, cuda-resident's configuration, the
/// device and the cases skipped.
pub(crate) fn print_header(d: &Device, plan: &SuitePlan) {
    println!("xfer-bench | {PROVENANCE}");
    let info = d.info();
    let c = d.config();
    println!(
        "cuda-resident config: chunk {} KiB, direct threshold {} KiB, {} packing threads (linger {} µs), small copies in order {}",
        c.chunk_bytes >> 10,
        c.direct_threshold >> 10,
        c.resolved_pack_threads(),
        c.pack_linger_us,
        if d.moves_small_copies_over_bus() { "over the bus" } else { "through device staging" }
    );
    println!(
        "device {}: {} | {} | {} | driver CUDA {} | {} copy engines",
        info.ordinal,
        info.name,
        info.pci_bus_id,
        link_of(d),
        info.driver_version,
        info.copy_engines
    );
    for skipped in &plan.skipped {
        println!("skipped: {skipped}");
    }
}

/// The table of every row, then the rows' notes.
pub(crate) fn print_table(rows: &[Row]) {
    let fmt = |v: Option<f64>| v.map_or("n/a".to_string(), |v| format!("{v:.2}"));
    println!(
        "{:<40} {:>5} {:>10} {:>12} {:>14} {:>8} {:>9}",
        "case", "unit", "raw", "batch API", "cuda-resident", "vs raw", "vs batch"
    );
    for r in rows {
        println!(
            "{:<40} {:>5} {:>10} {:>12} {:>14.2} {:>8} {:>9}",
            r.case,
            r.unit,
            fmt(r.raw),
            fmt(r.batch),
            r.ours,
            r.ratio(r.raw),
            r.ratio(r.batch)
        );
    }
    for r in rows.iter().filter(|r| r.note.is_some()) {
        println!("note: {}: {}", r.case, r.note.as_deref().unwrap_or_default());
    }
}

/// Writes `report.json` and the plots into `--out` and names each file written; the error
/// is the line to print, with its fix.
pub(crate) fn write(
    args: &Args,
    plan: &SuitePlan,
    rows: &[Row],
    device: serde_json::Value,
) -> Result<(), String> {
    let report = serde_json::json!({
        "provenance": { "git": PROVENANCE.git_revision, "rustc": PROVENANCE.rustc, "profile": PROVENANCE.profile, "target": PROVENANCE.target },
        "device": device,
        "suite": format!("{:?}", args.suite).to_lowercase(),
        "reps": args.reps,
        "skipped": plan.skipped,
        "rows": rows.iter().map(Row::json).collect::<Vec<_>>(),
    });
    std::fs::create_dir_all(&args.out)
        .and_then(|()| {
            std::fs::write(
                args.out.join("report.json"),
                serde_json::to_string_pretty(&report).unwrap_or_default(),
            )
        })
        .map_err(|e| {
            format!(
                "could not write the report to {}: {e}. Fix: pass --out with a writable folder.",
                args.out.display()
            )
        })?;
    println!("report: {}", args.out.join("report.json").display());
    let files = crate::plot::plots(rows, &args.out)
        .map_err(|message| format!("{message}. Fix: pass --out with a writable folder."))?;
    files.iter().for_each(|f| println!("plot: {}", f.display()));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::pci_link;

    #[test]
    fn the_link_is_read_from_sysfs_files_and_missing_files_give_none() {
        let root = std::env::temp_dir().join(format!("xfer-bench-sysfs-{}", std::process::id()));
        // The driver may spell the bus id in upper case; sysfs names are lower case.
        let dir = root.join("0000:1a:00.0");
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(pci_link(&root, "0000:1A:00.0"), None, "no files");
        std::fs::write(dir.join("current_link_speed"), "Unknown\n").unwrap();
        std::fs::write(dir.join("current_link_width"), "0\n").unwrap();
        assert_eq!(pci_link(&root, "0000:1A:00.0"), None, "a virtual slot");
        std::fs::write(dir.join("current_link_speed"), "32.0 GT/s PCIe\n").unwrap();
        std::fs::write(dir.join("current_link_width"), "16\n").unwrap();
        assert_eq!(pci_link(&root, "0000:1A:00.0").as_deref(), Some("PCIe 32.0 GT/s x16"));
        std::fs::write(dir.join("max_link_speed"), "32.0 GT/s PCIe\n").unwrap();
        std::fs::write(dir.join("max_link_width"), "16\n").unwrap();
        assert_eq!(
            pci_link(&root, "0000:1A:00.0").as_deref(),
            Some("PCIe 32.0 GT/s x16 (max 32.0 GT/s x16)")
        );
        std::fs::remove_dir_all(&root).unwrap();
    }
}

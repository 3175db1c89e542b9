//! What a run says: its rows, the header (provenance, configuration, device), the text
//! table, and the JSON report with its plots.

use cuda_resident::Device;
use cuda_resident_suite::PROVENANCE;

pub(crate) use crate::size::human;

use std::time::SystemTime;

use crate::cli::{Args, Format};
use crate::single::ByMethod;
use crate::suites::SuitePlan;
use crate::timing::Spread;

/// One method's figure in a row, and the spread of the samples it comes from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Figure {
    /// What the table prints: the median, or (a latency row's p99) another statistic of the
    /// samples.
    pub(crate) value: f64,
    /// The fewest, median and most of the samples: the repetitions, or every copy timed
    /// (latency rows).
    pub(crate) spread: Spread,
}

impl Figure {
    /// The median of `spread`, with it.
    pub(crate) fn median(spread: Spread) -> Figure {
        Figure { value: spread.median, spread }
    }
}

/// One row of the report.
#[derive(Debug)]
pub(crate) struct Row {
    pub(crate) case: String,
    /// Copies per batch (many-small cases), for the plots and the report.
    pub(crate) count: Option<usize>,
    /// Bytes per copy, for the plots (cases that sweep a size).
    pub(crate) size: Option<usize>,
    pub(crate) unit: &'static str,
    /// The raw driver's figure.
    pub(crate) raw: Option<Figure>,
    /// `cuMemcpyBatchAsync`'s figure (or the case's stand-in: `cuMemAllocAsync` in the
    /// allocation rows).
    pub(crate) batch: Option<Figure>,
    /// cuda-resident's figure.
    pub(crate) ours: Figure,
    /// Anything the reader of this row should know (fewer baseline repetitions).
    pub(crate) note: Option<String>,
}

impl Row {
    /// A row of each method's figure.
    pub(crate) fn figures(
        case: String,
        unit: &'static str,
        raw: Option<Figure>,
        batch: Option<Figure>,
        ours: Figure,
    ) -> Row {
        Row { case, count: None, size: None, unit, raw, batch, ours, note: None }
    }

    /// A row of the median of each method's spread, in `unit`.
    pub(crate) fn new(
        case: String,
        unit: &'static str,
        raw: Option<Spread>,
        batch: Option<Spread>,
        ours: Spread,
    ) -> Row {
        Row::figures(case, unit, raw.map(Figure::median), batch.map(Figure::median), Figure::median(ours))
    }

    /// A bandwidth row, `bytes` moved in the seconds each method's spread gives.
    pub(crate) fn gbps(
        case: String,
        bytes: usize,
        raw: Option<Spread>,
        batch: Option<Spread>,
        ours: Spread,
    ) -> Row {
        let rate = |secs: Spread| secs.per_second(bytes as f64 / 1e9);
        Row::new(case, "GB/s", raw.map(rate), batch.map(rate), rate(ours))
    }

    /// A bandwidth row from the seconds of each method.
    pub(crate) fn from_times(case: String, bytes: usize, t: &ByMethod<Spread>) -> Row {
        Row::gbps(case, bytes, Some(t.raw), t.batch, t.ours)
    }

    /// The row with `note`.
    pub(crate) fn noted(mut self, note: &str) -> Row {
        self.note = Some(note.to_owned());
        self
    }

    pub(crate) fn sized(mut self, size: usize) -> Row {
        self.size = Some(size);
        self
    }

    /// cuda-resident's advantage over `base` (higher is better for both units).
    fn ratio(&self, base: Option<Figure>) -> String {
        match base {
            Some(b) if self.unit == "GB/s" => format!("{:.1}x", self.ours.value / b.value),
            Some(b) => format!("{:.2}x", b.value / self.ours.value),
            None => "n/a".into(),
        }
    }

    fn json(&self) -> serde_json::Value {
        let value = |f: Option<Figure>| f.map(|f| f.value);
        let spread = |f: Option<Figure>| {
            f.map(|Figure { spread: s, .. }| serde_json::json!({ "min": s.min, "median": s.median, "max": s.max }))
        };
        serde_json::json!({
            "case": self.case, "count": self.count, "bytes_per_copy": self.size, "unit": self.unit,
            "raw": value(self.raw), "batch": value(self.batch), "cuda_resident": self.ours.value,
            "note": self.note,
            "spread": {
                "raw": spread(self.raw), "batch": spread(self.batch),
                "cuda_resident": spread(Some(self.ours)),
            },
        })
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

/// cuda-resident's configuration as the device resolved it.
pub(crate) fn config_json(d: &Device) -> serde_json::Value {
    let c = d.config();
    serde_json::json!({
        "budget_fraction": c.budget_fraction, "slab_bytes": c.slab_bytes,
        "pinned_cap_bytes": c.pinned_cap_bytes, "pinned_prewarm_bytes": c.pinned_prewarm_bytes,
        "chunk_bytes": c.chunk_bytes, "direct_threshold": c.direct_threshold,
        "pack_threads": c.pack_threads, "resolved_pack_threads": c.resolved_pack_threads(),
        "pack_linger_us": c.pack_linger_us, "small_copies_over_bus": c.small_copies_over_bus,
        "moves_small_copies_over_bus": d.moves_small_copies_over_bus(),
        "pinned_huge_pages": c.pinned_huge_pages, "pinned_in_huge_pages": d.pinned_in_huge_pages(),
        "dma_batches": c.dma_batches, "dmas_in_batches": d.moves_dmas_in_batches(),
    })
}

/// Every flag's value, as the run used it.
fn settings_json(a: &Args) -> serde_json::Value {
    let lower = |v: &dyn std::fmt::Debug| format!("{v:?}").to_lowercase();
    serde_json::json!({
        "suite": lower(&a.suite), "device": a.device, "reps": a.reps, "counts": a.counts,
        "sizes": a.sizes, "max_case": human(a.max_case_bytes()), "max_case_mib": a.max_case_mib,
        "latency_sizes": a.latency_sizes,
        "large": a.large, "paging_pool": human(a.paging_pool), "paging_bytes": human(a.paging_bytes),
        "paging_blocks": a.paging_blocks.iter().map(|&b| human(b)).collect::<Vec<_>>(),
        "paging_batches": a.paging_batches, "chunk": a.chunk, "chunk_kib": a.chunk_kib, "direct": a.direct,
        "direct_kib": a.direct_kib, "pack_threads": a.pack_threads,
        "pack_linger_us": a.pack_linger_us, "single_order": lower(&a.single_order), "staged_small_copies": a.staged_small_copies,
        "no_huge_pages": a.no_huge_pages, "no_dma_batches": a.no_dma_batches,
        "breakdown": a.breakdown, "format": lower(&a.format), "out": a.out.display().to_string(),
    })
}

/// The host as Linux describes it under `proc` (`/proc`) and in `os_release`
/// (`/etc/os-release`): its name, CPU model and logical cores, and the OS; `null` for what
/// is not there.
fn host_json(proc: &std::path::Path, os_release: &std::path::Path) -> serde_json::Value {
    let read = |p: &std::path::Path| std::fs::read_to_string(p).ok();
    let cpuinfo = read(&proc.join("cpuinfo")).unwrap_or_default();
    let field = |line: &str, key: &str| {
        let (k, v) = line.split_once(':')?;
        (k.trim() == key).then(|| v.trim().to_owned())
    };
    let cpu = cpuinfo.lines().find_map(|l| field(l, "model name"));
    let cores = cpuinfo.lines().filter(|l| field(l, "processor").is_some()).count();
    let os = read(os_release).and_then(|text| {
        text.lines().find_map(|l| l.strip_prefix("PRETTY_NAME=").map(|v| v.trim_matches('"').to_owned()))
    });
    let trimmed = |p: &std::path::Path| read(p).map(|s| s.trim().to_owned());
    serde_json::json!({
        "hostname": trimmed(&proc.join("sys/kernel/hostname")), "cpu": cpu,
        "cores": if cores > 0 { Some(cores) } else { std::thread::available_parallelism().ok().map(|n| n.get()) },
        "os": os, "kernel": trimmed(&proc.join("sys/kernel/osrelease")),
    })
}

/// `t` as UTC in ISO 8601, to the second: `2026-12-01T18:06:00Z`.
pub(crate) fn utc_iso8601(t: SystemTime) -> String {
    let secs = t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rest) = ((secs / 86_400) as i64, secs % 86_400);
    // Days since 1970-01-01 to a civil date (Howard Hinnant's days_from_civil, inverted).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s) = (rest / 3600, rest % 3600 / 60, rest % 60);
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}Z")
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
pub(crate) fn print_table(rows: &[Row], format: Format) {
    if format == Format::Markdown {
        return print!("{}", markdown(rows));
    }
    let fmt = |v: Option<Figure>| v.map_or("n/a".to_string(), |v| format!("{:.2}", v.value));
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
            r.ours.value,
            r.ratio(r.raw),
            r.ratio(r.batch)
        );
    }
    for r in rows.iter().filter(|r| r.note.is_some()) {
        println!("note: {}: {}", r.case, r.note.as_deref().unwrap_or_default());
    }
}

/// The table of every row as Markdown, then the rows' notes as a list.
fn markdown(rows: &[Row]) -> String {
    let fmt = |v: Option<Figure>| v.map_or("n/a".to_string(), |v| format!("{:.2}", v.value));
    let mut out = String::from(
        "| case | unit | raw | batch API | cuda-resident | vs raw | vs batch |\n|---|---|--:|--:|--:|--:|--:|\n",
    );
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {:.2} | {} | {} |\n",
            r.case.replace('|', "\\|"),
            r.unit,
            fmt(r.raw),
            fmt(r.batch),
            r.ours.value,
            r.ratio(r.raw),
            r.ratio(r.batch)
        ));
    }
    let mut notes = rows.iter().filter_map(|r| Some((&r.case, r.note.as_deref()?))).peekable();
    if notes.peek().is_some() {
        out.push('\n');
    }
    for (case, note) in notes {
        out.push_str(&format!("- {case}: {note}\n"));
    }
    out
}

/// What a run was, besides its rows: the flags, the plan, when it started and the
/// configuration the device resolved.
pub(crate) struct Run<'a> {
    pub(crate) args: &'a Args,
    pub(crate) plan: &'a SuitePlan,
    pub(crate) started: SystemTime,
    pub(crate) config: &'a serde_json::Value,
}

/// Writes `report.json` and the plots into `--out` and names each file written; the error
/// is the line to print, with its fix.
pub(crate) fn write(run: &Run<'_>, rows: &[Row], device: serde_json::Value) -> Result<(), String> {
    let (args, plan) = (run.args, run.plan);
    let report = serde_json::json!({
        "provenance": { "git": PROVENANCE.git_revision, "rustc": PROVENANCE.rustc, "profile": PROVENANCE.profile, "target": PROVENANCE.target },
        "device": device,
        "suite": format!("{:?}", args.suite).to_lowercase(),
        "reps": args.reps,
        "skipped": plan.skipped,
        "rows": rows.iter().map(Row::json).collect::<Vec<_>>(),
        "started": utc_iso8601(run.started),
        "settings": { "flags": settings_json(args), "config": run.config },
        "host": host_json(std::path::Path::new("/proc"), std::path::Path::new("/etc/os-release")),
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
    use super::{Figure, Row, host_json, markdown, pci_link, settings_json, utc_iso8601};
    use crate::timing::Spread;
    use std::time::{Duration, SystemTime};

    #[test]
    fn times_are_utc_iso8601() {
        let at = |secs: u64| utc_iso8601(SystemTime::UNIX_EPOCH + Duration::from_secs(secs));
        assert_eq!(at(0), "1970-01-01T00:00:00Z");
        assert_eq!(at(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(at(1_796_142_360), "2026-12-01T16:26:00Z");
    }

    #[test]
    fn the_host_is_read_from_proc_and_os_release() {
        let root = std::env::temp_dir().join(format!("xfer-bench-host-{}", std::process::id()));
        std::fs::create_dir_all(root.join("sys/kernel")).unwrap();
        let cpu = "processor\t: 0\nmodel name\t: Example CPU @ 2.0GHz\n\nprocessor\t: 1\nmodel name\t: Example CPU @ 2.0GHz\n";
        std::fs::write(root.join("cpuinfo"), cpu).unwrap();
        std::fs::write(root.join("sys/kernel/hostname"), "box\n").unwrap();
        std::fs::write(root.join("os-release"), "NAME=X\nPRETTY_NAME=\"X Linux 1\"\n").unwrap();
        let host = host_json(&root, &root.join("os-release"));
        assert_eq!(host["cpu"], "Example CPU @ 2.0GHz");
        assert_eq!((host["cores"].as_u64(), host["hostname"].as_str()), (Some(2), Some("box")));
        assert_eq!(host["os"], "X Linux 1");
        assert!(host["kernel"].is_null(), "a missing file is null");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn the_markdown_table_has_a_row_per_case_and_the_notes() {
        let (raw, ours) = (Spread::exact(1.0), Spread::exact(4.0));
        let mut row = Row::new("D2H 8192 x 4 KiB into caller Vecs".into(), "GB/s", Some(raw), None, ours);
        row.note = Some("raw: median of 5 repetitions".into());
        let table = markdown(&[row]);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].starts_with("| case |") && lines[1].starts_with("|---|"), "{table}");
        assert_eq!(lines[2], "| D2H 8192 x 4 KiB into caller Vecs | GB/s | 1.00 | n/a | 4.00 | 4.0x | n/a |");
        assert_eq!(lines[4], "- D2H 8192 x 4 KiB into caller Vecs: raw: median of 5 repetitions");
    }

    #[test]
    fn the_settings_give_sizes_with_units() {
        let flags = settings_json(&crate::cli::parse(&["--max-case", "4GiB"]).unwrap());
        assert_eq!((flags["max_case"].as_str(), flags["max_case_mib"].is_null()), (Some("4 GiB"), true));
        assert_eq!(
            (flags["paging_pool"].as_str(), flags["paging_bytes"].as_str()),
            (Some("8 GiB"), Some("256 MiB"))
        );
        assert_eq!(flags["paging_blocks"], serde_json::json!(["16 KiB", "256 KiB", "2 MiB"]));
        let flags = settings_json(&crate::cli::parse(&["--max-case-mib", "1536"]).unwrap());
        assert_eq!(
            (flags["max_case"].as_str(), flags["max_case_mib"].as_u64()),
            (Some("1536 MiB"), Some(1536))
        );
    }

    #[test]
    fn every_row_carries_the_spread_of_each_method() {
        let secs = |min, median, max| Spread { min, median, max };
        let row = Row::gbps(
            "H2D 1 GiB pinned".into(),
            2_000_000_000,
            Some(secs(1.0, 2.0, 4.0)),
            None,
            secs(0.5, 1.0, 2.0),
        );
        let json = row.json();
        assert_eq!((json["raw"].as_f64(), json["cuda_resident"].as_f64()), (Some(1.0), Some(2.0)), "GB/s");
        assert_eq!(json["spread"]["raw"], serde_json::json!({ "min": 0.5, "median": 1.0, "max": 2.0 }));
        assert_eq!(
            json["spread"]["cuda_resident"],
            serde_json::json!({ "min": 1.0, "median": 2.0, "max": 4.0 })
        );
        assert!(json["batch"].is_null() && json["spread"]["batch"].is_null(), "no batch form");
        // A figure other than the median (a latency row's p99) keeps its samples' spread.
        let us = secs(5.0, 6.0, 90.0);
        let p99 = Figure { value: 12.0, spread: us };
        let json = Row::figures("latency H2D pageable 4 KiB p99".into(), "µs", Some(p99), None, p99).json();
        assert_eq!(json["raw"].as_f64(), Some(12.0));
        assert_eq!(json["spread"]["cuda_resident"]["max"].as_f64(), Some(90.0));
    }

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

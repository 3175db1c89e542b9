//! SVG line charts of the results: bandwidth against size, a color per group of cases
//! (a copy count, a direction) and a line style per method; [`plots`] picks the charts from
//! the rows of a run. The x axis has a tick at each measured size, in binary units.

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::BenchResult;
use crate::report::Row;

/// How a line is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stroke {
    Solid,
    /// Long dashes.
    Dashed,
    /// Short dashes.
    Dotted,
}

impl Stroke {
    /// Dash and gap lengths in pixels (`None`: a solid line).
    fn dashes(self) -> Option<(i32, i32)> {
        match self {
            Stroke::Solid => None,
            Stroke::Dashed => Some((10, 6)),
            Stroke::Dotted => Some((3, 4)),
        }
    }
}

/// One line of a chart: its name, `(bytes, GB/s)` points, color index and style.
#[derive(Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    pub color: usize,
    pub stroke: Stroke,
}

/// The lines' colors: dark enough to read on white, none of them yellow.
const COLORS: [RGBColor; 6] = [
    RGBColor(0x1f, 0x5f, 0xb4), // blue
    RGBColor(0xc8, 0x28, 0x28), // red
    RGBColor(0x2a, 0x8a, 0x2a), // green
    RGBColor(0x7b, 0x3f, 0xb0), // purple
    RGBColor(0x8c, 0x50, 0x20), // brown
    RGBColor(0x20, 0x20, 0x20), // near black
];

/// The color of index `i`.
fn color(i: usize) -> RGBColor {
    COLORS[i % COLORS.len()]
}

/// The most x-axis ticks a chart gets; with more measured sizes, every other one (or every
/// third...) is labelled.
const MAX_TICKS: usize = 12;

/// The x-axis ticks: each measured size of `series`, ascending, thinned to [`MAX_TICKS`].
fn ticks(series: &[Series]) -> Vec<f64> {
    let mut xs: Vec<f64> = series.iter().flat_map(|s| s.points.iter().map(|&(x, _)| x)).collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    let step = xs.len().div_ceil(MAX_TICKS).max(1);
    xs.into_iter().step_by(step).collect()
}

/// Draws `series` on a log-log chart (bytes on x, GB/s on y) into an SVG file.
pub fn bandwidth_chart(path: &Path, title: &str, series: &[Series]) -> Result<(), String> {
    let all = series.iter().flat_map(|s| s.points.iter());
    let (mut x_lo, mut x_hi, mut y_lo, mut y_hi) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in all {
        (x_lo, x_hi, y_lo, y_hi) = (x_lo.min(x), x_hi.max(x), y_lo.min(y), y_hi.max(y));
    }
    if x_lo > x_hi {
        return Ok(()); // nothing measured
    }
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(64)
            .build_cartesian_2d(
                (x_lo * 0.8..x_hi * 1.25).log_scale().with_key_points(ticks(series)),
                (y_lo * 0.5..y_hi * 2.0).log_scale(),
            )?;
        chart
            .configure_mesh()
            .x_desc("bytes per copy")
            .y_desc("GB/s")
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 16))
            .x_label_formatter(&|x| crate::size::human(x.round() as usize))
            .draw()?;
        for s in series {
            let color = color(s.color);
            let style = color.stroke_width(2);
            let points = s.points.iter().copied();
            let drawn = match s.stroke.dashes() {
                None => chart.draw_series(LineSeries::new(points, style))?,
                Some((dash, gap)) => chart.draw_series(DashedLineSeries::new(points, dash, gap, style))?,
            };
            // The legend's sample: two strokes, touching for a solid line.
            let (dash, gap) = s.stroke.dashes().map_or((10, 0), |(dash, gap)| (dash.min(8), gap.max(4)));
            drawn.label(s.name.clone()).legend(move |(x, y)| {
                EmptyElement::at((x, y))
                    + PathElement::new(vec![(0, 0), (dash, 0)], style)
                    + PathElement::new(vec![(dash + gap, 0), (2 * dash + gap, 0)], style)
            });
            chart.draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font(("sans-serif", 15))
            .legend_area_size(40)
            .background_style(WHITE)
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| format!("could not draw {}: {e}", path.display()))
}

/// The SVG plots, bandwidth against bytes per copy: many small copies (a color per count)
/// and the size sweep (a color per direction), the line's style telling the method.
pub(crate) fn plots(rows: &[Row], out: &Path) -> BenchResult<Vec<PathBuf>> {
    type Pick = fn(&Row) -> Option<f64>;
    let methods: [(&str, Pick, Stroke); 3] = [
        ("raw driver", |r| r.raw.map(|f| f.value), Stroke::Dashed),
        ("cuMemcpyBatchAsync", |r| r.batch.map(|f| f.value), Stroke::Dotted),
        ("cuda-resident", |r| Some(r.ours.value), Stroke::Solid),
    ];
    // One line per method over the rows that `matches`, in color `color`.
    let series = |matches: &dyn Fn(&Row) -> bool, label: &str, color: usize| -> Vec<Series> {
        let matching: Vec<&Row> = rows.iter().filter(|r| r.size.is_some() && matches(r)).collect();
        methods
            .iter()
            .map(|&(method, pick, stroke)| Series {
                name: format!("{method}, {label}"),
                points: matching.iter().filter_map(|r| Some((r.size? as f64, pick(r)?))).collect(),
                color,
                stroke,
            })
            .filter(|s| !s.points.is_empty())
            .collect()
    };
    // The counts of the many-small rows (other rows with a count, such as paging's, have
    // charts of their own or none, and must not shift these colors).
    let many_small_row = |r: &&Row| r.case.starts_with("H2D ") || r.case.starts_with("D2H ");
    let mut counts: Vec<usize> = rows.iter().filter(many_small_row).filter_map(|r| r.count).collect();
    counts.sort_unstable();
    counts.dedup();
    let many_small = |starts: &str, ends: &str| -> Vec<Series> {
        counts
            .iter()
            .enumerate()
            .flat_map(|(color, &count)| {
                let matches =
                    |r: &Row| r.count == Some(count) && r.case.starts_with(starts) && r.case.ends_with(ends);
                series(&matches, &format!("{count} copies"), color)
            })
            .collect()
    };
    let sweep = |memory: &str| -> Vec<Series> {
        ["H2D", "D2H", "both"]
            .iter()
            .enumerate()
            .flat_map(|(color, dir)| {
                let prefix = format!("sweep {dir} {memory} ");
                series(&|r: &Row| r.case.starts_with(&prefix), dir, color)
            })
            .collect()
    };
    let charts = [
        (
            "many-small-h2d.svg",
            "many small copies, H2D from pageable: bandwidth by copy size",
            many_small("H2D", "from pageable"),
        ),
        (
            "many-small-d2h.svg",
            "many small copies, D2H into caller Vecs: bandwidth by copy size",
            many_small("D2H", "into caller Vecs"),
        ),
        ("sweep-pageable.svg", "single copies, pageable memory: bandwidth by size", sweep("pageable")),
        ("sweep-pinned.svg", "single copies, pinned memory: bandwidth by size", sweep("pinned")),
    ];
    let mut written = Vec::new();
    for (file, title, lines) in charts {
        if !lines.is_empty() {
            let path = out.join(file);
            bandwidth_chart(&path, title, &lines)?;
            written.push(path);
        }
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::{COLORS, Series, Stroke, plots, ticks};
    use crate::report::{Row, human};
    use crate::timing::Spread;

    #[test]
    fn plots_are_written_for_measured_rows() {
        let mut rows = Vec::new();
        for (i, size) in [256usize, 4096, 65536].into_iter().enumerate() {
            for count in [1024, 8192] {
                for case in [
                    format!("H2D {count} x {} from pageable", human(size)),
                    format!("D2H {count} x {} into caller Vecs", human(size)),
                ] {
                    let secs = |s: f64| Spread::exact(s);
                    let raw = Some(secs(0.1 * (i + 1) as f64));
                    let mut r = Row::gbps(case, size * count, raw, Some(secs(0.2)), secs(1.0));
                    (r.count, r.size) = (Some(count), Some(size));
                    rows.push(r);
                }
            }
            for dir in ["H2D", "D2H", "both"] {
                for memory in ["pinned", "pageable"] {
                    let case = format!("sweep {dir} {memory} {}", human(size));
                    let (raw, ours) = (Spread::exact(1.0), Spread::exact(2.0 + i as f64));
                    rows.push(Row::gbps(case, size, Some(raw), None, ours).sized(size));
                }
            }
        }
        // A paging row has a count too; the many-small charts' colors do not move for it.
        let mut paging =
            Row::gbps("paging 16 KiB out pinned".into(), 1 << 20, None, None, Spread::exact(1.0))
                .sized(16384);
        paging.count = Some(64);
        rows.push(paging);
        let out = std::env::temp_dir().join(format!("xfer-bench-plot-test-{}", std::process::id()));
        std::fs::create_dir_all(&out).unwrap();
        let files = plots(&rows, &out).unwrap();
        let names: Vec<_> = files.iter().filter_map(|f| f.file_name()?.to_str()).collect();
        assert_eq!(
            names,
            ["many-small-h2d.svg", "many-small-d2h.svg", "sweep-pageable.svg", "sweep-pinned.svg"]
        );
        for f in &files {
            let svg = std::fs::read_to_string(f).unwrap();
            assert!(svg.starts_with("<svg") && svg.contains("cuda-resident"), "{}", f.display());
        }
        let h2d = std::fs::read_to_string(&files[0]).unwrap();
        assert!(h2d.contains("1024 copies") && h2d.contains("8192 copies"), "a series per count");
        assert!(!h2d.contains("64 copies"), "no series for the paging row");
        let (first, second) = (COLORS[0], COLORS[1]);
        let hex = |c: plotters::style::RGBColor| format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2);
        assert!(h2d.contains(&hex(first)) && h2d.contains(&hex(second)), "the first two colors");
        assert!(!h2d.contains(&hex(COLORS[2])), "two counts, two colors: {}", hex(COLORS[2]));
        for tick in ["256 B", "4 KiB", "64 KiB"] {
            assert!(h2d.lines().any(|l| l.trim() == tick), "a tick at each measured size: {tick}");
        }
        std::fs::remove_dir_all(&out).unwrap();
    }

    #[test]
    fn ticks_are_the_measured_sizes_and_colors_read_on_white() {
        let line = |xs: &[f64]| Series {
            name: String::new(),
            points: xs.iter().map(|&x| (x, 1.0)).collect(),
            color: 0,
            stroke: Stroke::Solid,
        };
        let sizes = [4096.0, 256.0, 65536.0];
        assert_eq!(ticks(&[line(&sizes), line(&[256.0])]), [256.0, 4096.0, 65536.0]);
        let many: Vec<f64> = (0..30).map(|i| f64::from(1 << i)).collect();
        let thinned = ticks(&[line(&many)]);
        assert!(thinned.len() <= super::MAX_TICKS && thinned[0] == 1.0, "{thinned:?}");
        for c in COLORS {
            // Relative luminance well below white's, and not yellow (red and green high, blue low).
            let luminance = 0.2126 * f64::from(c.0) + 0.7152 * f64::from(c.1) + 0.0722 * f64::from(c.2);
            assert!(luminance < 140.0, "{c:?} is too light on white");
            assert!(!(c.0 > 150 && c.1 > 150 && c.2 < 100), "{c:?} is yellow");
        }
    }
}

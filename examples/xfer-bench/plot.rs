//! SVG line charts of the results: bandwidth against size, a color per group of cases
//! (a copy count, a direction) and a line style per method.

use std::path::Path;

use plotters::prelude::*;

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
                (x_lo * 0.8..x_hi * 1.25).log_scale(),
                (y_lo * 0.5..y_hi * 2.0).log_scale(),
            )?;
        chart
            .configure_mesh()
            .x_desc("bytes per copy")
            .y_desc("GB/s")
            .x_label_formatter(&|x| super::human(*x as usize))
            .draw()?;
        for s in series {
            let color = Palette99::pick(s.color).to_rgba();
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
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| format!("could not draw {}: {e}", path.display()))
}

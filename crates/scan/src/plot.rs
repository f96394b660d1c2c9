//! The report's figure, drawn with plotters as SVG and PNG: our points as lines, a paper's
//! published points as markers beside them.

use anyhow::{anyhow, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;

/// A font inside the binary: a report looks the same on every host, and none needs fonts
/// installed. DejaVu Sans (Bitstream Vera licence, `assets/DejaVuSans.LICENSE`).
static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // The bytes are the font shipped above: it parses.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
}

/// One line (or set of markers) on the figure.
#[derive(Clone, Debug)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    /// Published points: markers, no line.
    pub paper: bool,
    /// A model's prediction: a dashed line.
    pub model: bool,
}

#[derive(Clone, Debug)]
pub struct Figure {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    /// The x axis in decades (fragment sizes over several of them).
    pub log_x: bool,
    /// Labels of a non-numeric x axis: point i is at x = i.
    pub x_categories: Option<Vec<String>>,
    pub series: Vec<Series>,
}

impl Figure {
    /// Writes `NAME.svg` and `NAME.png` into `dir`.
    pub fn write(&self, dir: &Path, name: &str) -> Result<()> {
        register_font();
        let svg = dir.join(format!("{name}.svg"));
        draw(SVGBackend::new(&svg, (960, 600)).into_drawing_area(), self)
            .map_err(|e| anyhow!("drawing {}: {e}", svg.display()))?;
        let png = dir.join(format!("{name}.png"));
        draw(
            BitMapBackend::new(&png, (960, 600)).into_drawing_area(),
            self,
        )
        .map_err(|e| anyhow!("drawing {}: {e}", png.display()))?;
        Ok(())
    }

    fn x(&self, v: f64) -> f64 {
        if self.log_x {
            v.max(f64::MIN_POSITIVE).log10()
        } else {
            v
        }
    }
}

/// A number as a reader wants it on an axis: 1500 is 1.5k, 2e6 is 2M.
pub fn short(v: f64) -> String {
    let a = v.abs();
    let (x, unit) = if a >= 1e9 {
        (v / 1e9, "G")
    } else if a >= 1e6 {
        (v / 1e6, "M")
    } else if a >= 1e3 {
        (v / 1e3, "k")
    } else {
        (v, "")
    };
    let s = format!("{x:.2}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    format!("{s}{unit}")
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, fig: &Figure) -> Result<(), String> {
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| format!("{e:?}");
    root.fill(&WHITE).map_err(e)?;
    let xs: Vec<f64> = fig
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| fig.x(p.0)))
        .collect();
    let ys: Vec<f64> = fig
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .collect();
    let (mut x0, mut x1) = xs
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| {
            (a.min(x), b.max(x))
        });
    if !x0.is_finite() {
        (x0, x1) = (0.0, 1.0);
    }
    let span = x1 - x0;
    let pad = if span > 0.0 {
        span * 0.06
    } else if fig.log_x {
        0.1
    } else {
        (x0.abs() * 0.1).max(0.5)
    };
    let (x0, x1) = (x0 - pad, x1 + pad);
    let y1 = ys.iter().copied().fold(0.0f64, f64::max);
    // Room above the highest point for the legend.
    let y1 = if y1 > 0.0 { y1 * 1.25 } else { 1.0 };
    // The legend goes in the corner with the fewest points under it.
    let corner = {
        let (mx, my) = ((x0 + x1) / 2.0, y1 / 2.0);
        let count = |left: bool, up: bool| {
            fig.series
                .iter()
                .flat_map(|s| s.points.iter())
                .filter(|p| ((fig.x(p.0) < mx) == left) && ((p.1 > my) == up))
                .count()
        };
        [
            (SeriesLabelPosition::UpperLeft, count(true, true)),
            (SeriesLabelPosition::UpperRight, count(false, true)),
            (SeriesLabelPosition::LowerRight, count(false, false)),
            (SeriesLabelPosition::LowerLeft, count(true, false)),
        ]
        .into_iter()
        .min_by_key(|c| c.1)
        .map(|c| c.0)
        .unwrap_or(SeriesLabelPosition::UpperLeft)
    };
    // A long title is set smaller rather than cut at the edges (a character of the font is
    // about half its size wide).
    let width = root.dim_in_pixel().0 as f64;
    let title_size = (width * 1.9 / fig.title.chars().count().max(1) as f64).clamp(11.0, 22.0);
    let mut chart = ChartBuilder::on(&root)
        .caption(&fig.title, ("sans-serif", title_size))
        .margin(18)
        .x_label_area_size(50)
        .y_label_area_size(72)
        .build_cartesian_2d(x0..x1, 0.0..y1)
        .map_err(e)?;
    let log = fig.log_x;
    let cats = fig.x_categories.clone();
    let x_fmt = move |v: &f64| match &cats {
        Some(c) => {
            let i = v.round();
            if (v - i).abs() < 0.05 && i >= 0.0 && (i as usize) < c.len() {
                c[i as usize].clone()
            } else {
                String::new()
            }
        }
        // Decades and their 2 and 5 only: 316 and 3.16k say nothing to a reader.
        None if log => {
            let frac = v - v.floor();
            [1.0f64, 2.0, 5.0, 10.0]
                .iter()
                .find(|m| (frac - m.log10()).abs() < 0.012)
                .map(|m| short(m * 10f64.powf(v.floor())))
                .unwrap_or_default()
        }
        None => short(*v),
    };
    // On a log axis, ticks every tenth of a decade, so that 2 and 5 of each decade have one.
    let x_ticks = if log && fig.x_categories.is_none() {
        ((x1 - x0) * 10.0).ceil() as usize + 1
    } else {
        10
    };
    chart
        .configure_mesh()
        .x_labels(x_ticks)
        .x_desc(fig.x_label.as_str())
        .y_desc(fig.y_label.as_str())
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&|v| short(*v))
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .draw()
        .map_err(e)?;
    for (i, s) in fig.series.iter().enumerate() {
        // A model's line takes the colour of the line it predicts.
        let same = s
            .name
            .strip_prefix("capacity model: ")
            .filter(|_| s.model)
            .and_then(|n| fig.series.iter().position(|o| o.name == n));
        let color = Palette99::pick(same.unwrap_or(i)).to_rgba();
        let pts: Vec<(f64, f64)> = s.points.iter().map(|&(x, y)| (fig.x(x), y)).collect();
        if s.model {
            chart
                .draw_series(DashedLineSeries::new(
                    pts.clone(),
                    8,
                    5,
                    color.stroke_width(2),
                ))
                .map_err(e)?
                .label(s.name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(1))
                });
        } else if s.paper {
            chart
                .draw_series(
                    pts.iter()
                        .map(|&p| TriangleMarker::new(p, 7, color.filled())),
                )
                .map_err(e)?
                .label(s.name.as_str())
                .legend(move |(x, y)| TriangleMarker::new((x + 10, y), 6, color.filled()));
        } else {
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                .map_err(e)?
                .label(s.name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
            chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))
                .map_err(e)?;
        }
    }
    if !fig.series.is_empty() {
        chart
            .configure_series_labels()
            .label_font(("sans-serif", 15))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(corner)
            .draw()
            .map_err(e)?;
    }
    root.present().map_err(e)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_numbers_are_short() {
        assert_eq!(short(1500.0), "1.5k");
        assert_eq!(short(2e6), "2M");
        assert_eq!(short(12.5), "12.5");
        assert_eq!(short(0.25), "0.25");
        assert_eq!(short(0.0), "0");
    }

    #[test]
    fn a_figure_is_written_as_svg_and_png() {
        let d = tempfile::tempdir().unwrap();
        let f = Figure {
            title: "accepted against offered".into(),
            x_label: "offered (Hz)".into(),
            y_label: "accepted (Hz)".into(),
            log_x: true,
            x_categories: None,
            series: vec![
                Series {
                    name: "Tessera".into(),
                    points: vec![(100.0, 100.0), (1000.0, 990.0), (10000.0, 4000.0)],
                    paper: false,
                    model: false,
                },
                Series {
                    name: "paper, Fig. 6".into(),
                    points: vec![(100.0, 100.0), (10000.0, 5000.0)],
                    paper: true,
                    model: false,
                },
            ],
        };
        f.write(d.path(), "plot").unwrap();
        let png = std::fs::read(d.path().join("plot.png")).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        let svg = std::fs::read_to_string(d.path().join("plot.svg")).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains("paper, Fig. 6"),
            "{svg:.200}"
        );
    }
}

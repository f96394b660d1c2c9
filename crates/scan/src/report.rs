//! The files of a scan's report: `points.csv`, `points.json`, `plot.svg`, `plot.png` and
//! `index.html`, which ties them together with the table.

use anyhow::{Context, Result};
use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;

use crate::plot::{Figure, Series};
use crate::{describe, numeric, Point};

/// What a plot shows on its y axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    EventsPerS,
    AcceptedHz,
    BuiltMbPerS,
    /// Built data per readout unit: the CMS paper's "throughput per node".
    BuiltMbPerSPerReadoutUnit,
    DeadTime,
}

impl Metric {
    pub fn parse(s: &str) -> Result<Metric, String> {
        Ok(match s {
            "events_per_s" => Metric::EventsPerS,
            "accepted_hz" => Metric::AcceptedHz,
            "built_mb_per_s" => Metric::BuiltMbPerS,
            "built_mb_per_s_per_ru" => Metric::BuiltMbPerSPerReadoutUnit,
            "dead_time" => Metric::DeadTime,
            _ => {
                return Err(format!(
                    "{s:?}: expected events_per_s, accepted_hz, built_mb_per_s, built_mb_per_s_per_ru or dead_time"
                ))
            }
        })
    }

    pub fn label(self) -> &'static str {
        match self {
            Metric::EventsPerS => "events built per second",
            Metric::AcceptedHz => "accepted trigger rate (Hz)",
            Metric::BuiltMbPerS => "built data (MB/s)",
            Metric::BuiltMbPerSPerReadoutUnit => "built data per readout unit (MB/s)",
            Metric::DeadTime => "dead-time fraction",
        }
    }

    pub fn of(self, p: &Point) -> Option<f64> {
        match self {
            Metric::EventsPerS => Some(p.events_per_s),
            Metric::AcceptedHz => p.accepted_hz,
            Metric::BuiltMbPerS => Some(p.built_mb_per_s),
            Metric::BuiltMbPerSPerReadoutUnit => {
                (p.readout_units > 0).then(|| p.built_mb_per_s / p.readout_units as f64)
            }
            Metric::DeadTime => p.dead_time_fraction,
        }
    }
}

/// Published points to draw beside ours, with where they come from.
#[derive(Clone, Debug, Serialize)]
pub struct PaperSeries {
    pub name: String,
    /// The figure or table they are read from, e.g. "COMET paper, Fig. 6".
    pub source: String,
    pub points: Vec<(f64, f64)>,
}

/// A report's words and figure settings.
pub struct Layout {
    pub title: String,
    /// The command that made it, shown on the page.
    pub command: String,
    /// What the figure plots: x is the first varied key (or `x_key`), one line per value of
    /// the second.
    pub x_key: Option<String>,
    pub x_label: Option<String>,
    /// The x values are scaled by this before plotting (e.g. bytes to KiB).
    pub x_scale: f64,
    pub metric: Metric,
    pub log_x: bool,
    pub paper: Vec<PaperSeries>,
    /// Paragraphs shown above the figure (how ours differs from the paper, and why).
    pub notes: Vec<String>,
    /// The points carry the capacity model's prediction (`Point::predicted`): drawn as
    /// dashed lines and tabled beside the measurement.
    pub predicted: bool,
}

#[derive(Serialize)]
struct Json<'a> {
    title: &'a str,
    command: &'a str,
    machine: Machine,
    metric: Metric,
    points: &'a [Point],
    paper: &'a [PaperSeries],
    notes: &'a [String],
}

#[derive(Serialize)]
struct Machine {
    cpus: usize,
    cpu_model: String,
}

fn machine() -> Machine {
    let cpu_model = tessera_config::capacity::cpu_model();
    Machine {
        cpus: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        cpu_model,
    }
}

/// Writes every file of the report into `dir`.
pub fn write(dir: &Path, layout: &Layout, points: &[Point]) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(dir.join("points.csv"), csv(points))?;
    let json = Json {
        title: &layout.title,
        command: &layout.command,
        machine: machine(),
        metric: layout.metric,
        points,
        paper: &layout.paper,
        notes: &layout.notes,
    };
    std::fs::write(dir.join("points.json"), serde_json::to_vec_pretty(&json)?)?;
    figure(layout, points).write(dir, "plot")?;
    std::fs::write(dir.join("index.html"), html(layout, points))?;
    Ok(())
}

/// The raw points, one row each, every varied key a column.
pub fn csv(points: &[Point]) -> String {
    let keys: Vec<&str> = points
        .first()
        .map(|p| p.values.iter().map(|v| v.0.as_str()).collect())
        .unwrap_or_default();
    let mut s = String::from("point");
    for k in &keys {
        s += &format!(",{k}");
    }
    s += ",ok,duration_s,events_per_s,built_mb_per_s,offered_hz,accepted_hz,dead_time_fraction,events_complete,events_incomplete,bottleneck,bottleneck_share,balance_holds,error\n";
    let opt = |v: Option<f64>| v.map(|x| format!("{x}")).unwrap_or_default();
    for p in points {
        s += &p.index.to_string();
        for (_, v) in &p.values {
            s += &format!(",{}", field(v));
        }
        let _ = writeln!(
            s,
            ",{},{},{},{},{},{},{},{},{},{},{},{},{}",
            p.ok,
            p.duration_s,
            p.events_per_s,
            p.built_mb_per_s,
            opt(p.offered_hz),
            opt(p.accepted_hz),
            opt(p.dead_time_fraction),
            p.events_complete,
            p.events_incomplete,
            field(p.bottleneck.as_deref().unwrap_or("")),
            opt(p.bottleneck_share),
            p.balance_holds,
            field(p.error.as_deref().unwrap_or("")),
        );
    }
    s
}

/// A CSV field, quoted where it needs to be.
fn field(v: &str) -> String {
    if v.contains([',', '"', '\n']) {
        format!("\"{}\"", v.replace('"', "\"\""))
    } else {
        v.to_string()
    }
}

/// Our points as one line per value of the second varied key, the paper's as markers.
pub fn figure(layout: &Layout, points: &[Point]) -> Figure {
    let keys: Vec<String> = points
        .first()
        .map(|p| p.values.iter().map(|v| v.0.clone()).collect())
        .unwrap_or_default();
    let x_key = layout
        .x_key
        .clone()
        .or_else(|| keys.first().cloned())
        .unwrap_or_default();
    let others: Vec<&String> = keys.iter().filter(|k| **k != x_key).collect();
    let value = |p: &Point, k: &str| {
        p.values
            .iter()
            .find(|v| v.0 == k)
            .map(|v| v.1.clone())
            .unwrap_or_default()
    };
    let all_numeric = points.iter().all(|p| numeric(&value(p, &x_key)).is_some());
    let mut categories: Vec<String> = Vec::new();
    let mut x_of = |p: &Point| -> f64 {
        let v = value(p, &x_key);
        if all_numeric {
            numeric(&v).unwrap_or(0.0) * layout.x_scale
        } else {
            match categories.iter().position(|c| *c == v) {
                Some(i) => i as f64,
                None => {
                    categories.push(v);
                    (categories.len() - 1) as f64
                }
            }
        }
    };
    let mut series: Vec<Series> = Vec::new();
    let mut model: Vec<Series> = Vec::new();
    for p in points {
        let x = x_of(p);
        let name = if others.is_empty() {
            "Tessera, this machine".to_string()
        } else {
            others
                .iter()
                .map(|k| format!("{k}={}", value(p, k)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let add = |to: &mut Vec<Series>, name: String, y: f64, is_model: bool| match to
            .iter_mut()
            .find(|s| s.name == name)
        {
            Some(s) => s.points.push((x, y)),
            None => to.push(Series {
                name,
                points: vec![(x, y)],
                paper: false,
                model: is_model,
            }),
        };
        if let Some(y) = p.predicted.filter(|_| layout.predicted) {
            add(&mut model, format!("capacity model: {name}"), y, true);
        }
        if let Some(y) = layout.metric.of(p).filter(|_| p.ok) {
            add(&mut series, name, y, false);
        }
    }
    series.extend(model);
    for s in &layout.paper {
        series.push(Series {
            // The source is on the page, under the table: the legend stays short.
            name: format!("{} (paper)", s.name),
            points: s.points.clone(),
            paper: true,
            model: false,
        });
    }
    Figure {
        title: layout.title.clone(),
        x_label: layout.x_label.clone().unwrap_or(x_key),
        y_label: layout.metric.label().into(),
        log_x: layout.log_x && all_numeric,
        x_categories: (!all_numeric).then_some(categories),
        series,
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The page: title, notes, figure, table, links to the raw points.
pub fn html(layout: &Layout, points: &[Point]) -> String {
    let m = machine();
    let mut s = String::new();
    let _ = write!(
        s,
        "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{t}</title>\n\
         <style>body{{font-family:sans-serif;max-width:70em;margin:2em auto;padding:0 1em}}\
         table{{border-collapse:collapse}}td,th{{border:1px solid #bbb;padding:2px 8px;text-align:right}}\
         td.l,th.l{{text-align:left}}.bad{{color:#b00}}</style></head><body>\n\
         <h1>{t}</h1>\n<p><code>{c}</code><br>on {cpus} CPUs ({model})</p>\n",
        t = esc(&layout.title),
        c = esc(&layout.command),
        cpus = m.cpus,
        model = esc(&m.cpu_model),
    );
    for n in &layout.notes {
        let _ = writeln!(s, "<p>{}</p>", esc(n));
    }
    s += "<p><img src=\"plot.svg\" alt=\"the figure\" width=\"960\"></p>\n";
    s += "<p>Raw points: <a href=\"points.csv\">points.csv</a>, <a href=\"points.json\">points.json</a>; \
          each point's run report under <code>points/</code>. Figure: <a href=\"plot.svg\">SVG</a>, \
          <a href=\"plot.png\">PNG</a>.</p>\n";
    s += "<table><tr><th>#</th><th class=\"l\">point</th><th>events/s</th><th>MB/s</th>\
          <th>offered Hz</th><th>accepted Hz</th><th>dead time</th>";
    if layout.predicted {
        let _ = write!(s, "<th>model: {}</th>", esc(layout.metric.label()));
    }
    s += "<th class=\"l\">bottleneck</th><th class=\"l\">result</th></tr>\n";
    let opt = |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map(f).unwrap_or_else(|| "-".into());
    for p in points {
        let _ = write!(
            s,
            "<tr><td>{}</td><td class=\"l\">{}</td><td>{:.0}</td><td>{:.1}</td><td>{}</td><td>{}</td><td>{}</td>",
            p.index,
            esc(&describe(&p.values)),
            p.events_per_s,
            p.built_mb_per_s,
            opt(p.offered_hz, &|x| format!("{x:.0}")),
            opt(p.accepted_hz, &|x| format!("{x:.0}")),
            opt(p.dead_time_fraction, &|x| format!("{:.1} %", x * 100.0)),
        );
        if layout.predicted {
            let _ = write!(s, "<td>{}</td>", opt(p.predicted, &|x| format!("{x:.0}")));
        }
        let _ = writeln!(
            s,
            "<td class=\"l\">{}</td><td class=\"l{}\">{}</td></tr>",
            esc(&p
                .bottleneck
                .as_ref()
                .map(|b| format!("{b} ({:.0} %)", p.bottleneck_share.unwrap_or(0.0) * 100.0))
                .unwrap_or_else(|| "-".into())),
            if p.ok { "" } else { " bad" },
            if p.ok {
                "ok".to_string()
            } else {
                esc(p.error.as_deref().unwrap_or("failed"))
            },
        );
    }
    s += "</table>\n";
    for ps in &layout.paper {
        let _ = writeln!(
            s,
            "<p>Published points, {}: {}</p>",
            esc(&ps.source),
            esc(&ps
                .points
                .iter()
                .map(|(x, y)| format!("({x}, {y})"))
                .collect::<Vec<_>>()
                .join(", "))
        );
    }
    s += "</body></html>\n";
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(i: usize, rate: &str, busy: &str, acc: f64) -> Point {
        Point {
            index: i,
            values: vec![
                ("sources.rate_hz".into(), rate.into()),
                ("sources.busy".into(), busy.into()),
            ],
            ok: true,
            accepted_hz: Some(acc),
            events_per_s: acc,
            ..Default::default()
        }
    }

    #[test]
    fn the_figure_has_a_line_per_value_of_the_second_key_and_the_paper_beside() {
        let pts = vec![
            point(1, "1000", "veto", 1000.0),
            point(2, "1000", "queue", 1000.0),
            point(3, "8000", "veto", 5000.0),
            point(4, "8000", "queue", 5100.0),
        ];
        let layout = Layout {
            title: "t".into(),
            command: "tessera scan".into(),
            x_key: None,
            x_label: None,
            x_scale: 1.0,
            metric: Metric::AcceptedHz,
            log_x: false,
            paper: vec![PaperSeries {
                name: "COMET".into(),
                source: "Fig. 6".into(),
                points: vec![(1000.0, 1000.0)],
            }],
            notes: vec!["why <ours> differs".into()],
            predicted: false,
        };
        let f = figure(&layout, &pts);
        assert_eq!(f.series.len(), 3);
        assert_eq!(f.series[0].name, "sources.busy=veto");
        assert_eq!(f.series[0].points, vec![(1000.0, 1000.0), (8000.0, 5000.0)]);
        assert!(f.series[2].paper);
        let c = csv(&pts);
        assert!(
            c.starts_with("point,sources.rate_hz,sources.busy,ok,"),
            "{c}"
        );
        assert_eq!(c.lines().count(), 5);
        let h = html(&layout, &pts);
        assert!(h.contains("why &lt;ours&gt; differs"), "{h}");
    }
}

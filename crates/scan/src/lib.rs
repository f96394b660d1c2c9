//! Design evaluation as a command (issue 15): a topology run over a grid of configuration
//! values (`tessera scan`), or a seed experiment's own sweep (`tessera scenario`), each point a
//! real run of the `tessera` binary whose JSON report gives the point's figures and the
//! bottleneck the run control named. The report is a table, CSV and JSON of the raw points, a
//! plot (SVG and PNG) and an HTML page tying them together.
//!
//! Each point runs as its own process: a point that fails (a bad value, a run in error) is
//! reported as failed and the sweep goes on, and no point inherits another's memory or threads.

pub mod network;
pub mod plot;
pub mod report;
pub mod scenario;

use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Instant;

/// Values one key may take in a scan.
pub const MAX_VALUES: usize = 256;
/// Points one scan may run (the product of the value counts).
pub const MAX_POINTS: usize = 4096;

/// A point's (key, value) pairs, in the order of the scan's keys.
pub type Values = Vec<(String, String)>;

/// One `--vary KEY=V1,V2,...`: a configuration key and the values it takes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Vary {
    pub key: String,
    pub values: Vec<String>,
}

impl FromStr for Vary {
    type Err = String;
    fn from_str(s: &str) -> Result<Vary, String> {
        let (key, values) = s
            .split_once('=')
            .ok_or_else(|| format!("{s:?}: expected KEY=V1,V2,..."))?;
        let key = key.trim();
        if key.is_empty() {
            return Err(format!("{s:?}: the key is empty"));
        }
        let values: Vec<String> = values.split(',').map(|v| v.trim().to_string()).collect();
        if values.iter().any(|v| v.is_empty()) {
            return Err(format!("{s:?}: an empty value"));
        }
        if values.len() > MAX_VALUES {
            return Err(format!(
                "{key}: {} values, at most {MAX_VALUES}",
                values.len()
            ));
        }
        Ok(Vary {
            key: key.to_string(),
            values,
        })
    }
}

/// Every combination of the values, the first key varying slowest.
pub fn grid(varies: &[Vary]) -> Result<Vec<Values>> {
    let mut n = 1usize;
    for v in varies {
        n = n.saturating_mul(v.values.len());
    }
    if n > MAX_POINTS {
        bail!("{n} points: at most {MAX_POINTS} (fewer values, or several scans)");
    }
    let mut out = vec![Vec::new()];
    for v in varies {
        let mut next = Vec::with_capacity(out.len() * v.values.len());
        for p in &out {
            for val in &v.values {
                let mut q: Vec<(String, String)> = p.clone();
                q.push((v.key.clone(), val.clone()));
                next.push(q);
            }
        }
        out = next;
    }
    Ok(out)
}

/// Sets `key` to `value` in a topology document (`tessera_config::set`).
pub fn set_key(doc: &mut toml_edit::DocumentMut, key: &str, value: &str) -> Result<()> {
    tessera_config::set::set_key(doc, key, value).map_err(|e| anyhow::anyhow!(e))
}

/// A point's value as a number for a plot axis: a plain number, or a size with its unit
/// (`16KiB` is 16384).
pub fn numeric(value: &str) -> Option<f64> {
    let v = value.trim().trim_matches('"');
    if let Ok(x) = v.parse::<f64>() {
        return x.is_finite().then_some(x);
    }
    tessera_config::ByteSize::parse(v).ok().map(|b| b.0 as f64)
}

/// What one point measured, from its run report.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct Point {
    pub index: usize,
    /// (key, value) of each varied key, in the order of the scan.
    pub values: Vec<(String, String)>,
    /// The run ended well (exit 0: drained, balanced, no error).
    pub ok: bool,
    /// Why not, when not.
    pub error: Option<String>,
    pub duration_s: f64,
    pub events_per_s: f64,
    pub built_mb_per_s: f64,
    /// Triggers offered and accepted per second, and the dead-time fraction (trigger model).
    pub offered_hz: Option<f64>,
    pub accepted_hz: Option<f64>,
    pub dead_time_fraction: Option<f64>,
    pub events_complete: u64,
    pub events_incomplete: u64,
    /// The stage the run control named the bottleneck for most of the data-taking time.
    pub bottleneck: Option<String>,
    pub bottleneck_share: Option<f64>,
    pub readout_units: usize,
    /// Every fragment sent is accounted for.
    pub balance_holds: bool,
    /// The point's run report, relative to the scan's output directory.
    pub report: String,
    /// Wall-clock seconds the point took, start to report.
    pub wall_s: f64,
    /// What the capacity model predicted for the report's metric (with a calibration).
    pub predicted: Option<f64>,
}

impl Point {
    /// Fills the figures from a `tessera run --json` report.
    pub fn read_report(&mut self, r: &serde_json::Value) {
        let f = |v: &serde_json::Value| v.as_f64().unwrap_or(0.0);
        self.duration_s = f(&r["duration_s"]);
        self.events_per_s = f(&r["events_per_s"]);
        self.built_mb_per_s = f(&r["built_bytes_per_s"]) / 1e6;
        self.events_complete = r["events_complete"].as_u64().unwrap_or(0);
        self.events_incomplete = r["events_incomplete"].as_u64().unwrap_or(0);
        self.balance_holds = r["balance"]["holds"].as_bool().unwrap_or(false);
        self.readout_units = r["readout_units"].as_array().map_or(0, |a| a.len());
        let t = &r["trigger"];
        // Over the time triggers came where the report knows it (a veto), else over the run.
        let span = match f(&t["offered_s"]) {
            s if s > 0.0 => s,
            _ => self.duration_s,
        };
        if t.is_object() && span > 0.0 {
            self.offered_hz = Some(f(&t["offered"]) / span);
            self.accepted_hz = Some(f(&t["accepted"]) / span);
            self.dead_time_fraction = Some(f(&t["dead_time_fraction"]));
        }
        if let Some(b) = r["bottlenecks"].as_array() {
            let top = b
                .iter()
                .filter_map(|x| Some((x["name"].as_str()?, x["share"].as_f64()?)))
                .max_by(|a, b| a.1.total_cmp(&b.1));
            if let Some((name, share)) = top {
                self.bottleneck = Some(name.to_string());
                self.bottleneck_share = Some(share);
            }
        }
    }
}

/// The points of a report written before (`points.json` in `dir`), to draw it again, and the
/// command that measured them.
pub fn read_points(dir: &Path) -> Result<(Vec<Point>, String)> {
    let path = dir.join("points.json");
    let v: serde_json::Value = serde_json::from_slice(
        &std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?,
    )
    .with_context(|| format!("{}: not JSON", path.display()))?;
    let points = serde_json::from_value(v["points"].clone())
        .with_context(|| format!("{}: no points in it", path.display()))?;
    Ok((
        points,
        v["command"].as_str().unwrap_or_default().to_string(),
    ))
}

/// Set (by the command's Ctrl-C handler) to end a scan after the point that is running: the
/// report then holds the points that ran, and emulated hosts are taken down.
pub static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// What a scan runs and where it writes.
pub struct Scan {
    /// The topology's text, and the file it came from (relative paths in it are resolved
    /// against that file's directory).
    pub base: String,
    pub origin: PathBuf,
    /// Set in every point before the varied keys (`--set KEY=VALUE`), not shown as columns.
    pub fixed: Vec<(String, String)>,
    pub varies: Vec<Vary>,
    pub output: PathBuf,
    /// Overrides of each point's length (`run.duration_s`, `run.events`).
    pub duration_s: Option<f64>,
    pub events: Option<u64>,
    /// Keep each point's recorded files (else only its report is kept).
    pub keep_data: bool,
    /// The `tessera` binary that runs the points.
    pub binary: PathBuf,
    /// The capacity model's calibration, and the metric it predicts for each point.
    pub model: Option<(tessera_config::capacity::Calibration, report::Metric)>,
    /// Run every point over emulated hosts (network namespaces with shaped links), each role
    /// where the network places it; `None`: in one process.
    pub network: Option<network::Network>,
}

impl Scan {
    /// Every point's configuration, checked before anything runs: a bad value is refused with
    /// its point and key, not found an hour into the sweep.
    pub fn configurations(&self) -> Result<Vec<(Values, String)>> {
        let dir = self
            .origin
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        let mut out = Vec::new();
        for values in grid(&self.varies)? {
            let mut doc: toml_edit::DocumentMut = self
                .base
                .parse()
                .with_context(|| format!("{}: not TOML", self.origin.display()))?;
            for (k, v) in self.fixed.iter().chain(&values) {
                set_key(&mut doc, k, v)?;
            }
            absolute_scenario(&mut doc, &dir);
            if let Some(n) = &self.network {
                let hosts = network::plan(&n.hosts(&doc))?;
                n.place(&mut doc, &hosts)?;
            }
            let text = doc.to_string();
            let label = describe(&values);
            tessera_config::Topology::parse(&text, &label)
                .map_err(|e| anyhow::anyhow!("point {label}: {e}"))?;
            out.push((values, text));
        }
        Ok(out)
    }

    /// Runs every point in turn, printing a line per point on stderr.
    pub fn run(&self) -> Result<Vec<Point>> {
        let configs = self.configurations()?;
        let predicted = match &self.model {
            Some((c, metric)) => predictions(&configs, *metric, c, self.network.as_ref()),
            None => vec![None; configs.len()],
        };
        let points_dir = self.output.join("points");
        std::fs::create_dir_all(&points_dir)
            .with_context(|| format!("creating {}", points_dir.display()))?;
        let n = configs.len();
        // The hosts are those of the first point; a point that needs others is refused before
        // anything runs.
        let running = match &self.network {
            None => None,
            Some(net) => {
                let hosts_of = |text: &str| -> Result<Vec<(String, network::Link)>> {
                    Ok(net.hosts(&text.parse::<toml_edit::DocumentMut>()?))
                };
                let first = hosts_of(&configs[0].1)?;
                for (values, text) in &configs {
                    if hosts_of(text)? != first {
                        bail!(
                            "point {}: needs other hosts than the first point (the emulated hosts are made once per scan)",
                            describe(values)
                        );
                    }
                }
                eprintln!(
                    "emulated hosts: {}",
                    first
                        .iter()
                        .map(|(h, l)| format!("{h}{}", network::describe_link(l)))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                Some(network::Running::start(
                    network::plan(&first)?,
                    &self.binary,
                    &self.output.join("hosts"),
                    "a scan over emulated hosts",
                )?)
            }
        };
        let control_ns = match (&running, &self.network) {
            (Some(r), Some(n)) => r.ns(&n.control_host()).map(str::to_string),
            _ => None,
        };
        let mut points = Vec::with_capacity(n);
        for (i, (values, text)) in configs.into_iter().enumerate() {
            if INTERRUPTED.load(std::sync::atomic::Ordering::Relaxed) {
                eprintln!(
                    "interrupted: {} of {n} points ran; the report holds them",
                    points.len()
                );
                break;
            }
            let name = format!("{:04}", i + 1);
            let cfg = points_dir.join(format!("{name}.toml"));
            std::fs::write(&cfg, &text).with_context(|| format!("writing {}", cfg.display()))?;
            let data = self.output.join("runs").join(&name);
            eprintln!("point {}/{n}: {} ...", i + 1, describe(&values));
            let started = Instant::now();
            let mut cmd = network::command_on(control_ns.as_deref(), &self.binary);
            if control_ns.is_some() {
                cmd.env("TESSERA_TOKEN", network::TOKEN);
            }
            cmd.arg("run")
                .arg(&cfg)
                .args(["--json", "--quiet", "--http", "off", "--output"])
                .arg(&data);
            if let Some(d) = self.duration_s {
                cmd.args(["--duration", &d.to_string()]);
            }
            if let Some(e) = self.events {
                cmd.args(["--events", &e.to_string()]);
            }
            let out = cmd
                .output()
                .with_context(|| format!("starting {}", self.binary.display()))?;
            let mut p = Point {
                index: i + 1,
                predicted: predicted[i],
                values,
                ok: out.status.success(),
                report: format!("points/{name}.json"),
                wall_s: started.elapsed().as_secs_f64(),
                ..Default::default()
            };
            match serde_json::from_slice::<serde_json::Value>(&out.stdout) {
                Ok(r) => {
                    p.read_report(&r);
                    std::fs::write(
                        points_dir.join(format!("{name}.json")),
                        serde_json::to_vec_pretty(&r)?,
                    )?;
                    if !p.ok {
                        p.error = Some(last_line(&out.stderr).unwrap_or("the run failed".into()));
                    }
                }
                Err(_) => {
                    p.ok = false;
                    p.report.clear();
                    p.error = Some(
                        last_line(&out.stderr).unwrap_or_else(|| "no report from the run".into()),
                    );
                }
            }
            // What the run said on its way, kept for the point that needs explaining.
            if !out.stderr.is_empty() {
                std::fs::write(points_dir.join(format!("{name}.log")), &out.stderr)?;
            }
            eprintln!("point {}/{n}: {}", i + 1, summary(&p));
            if !self.keep_data {
                let _ = std::fs::remove_dir_all(&data);
            }
            points.push(p);
        }
        drop(running);
        if !self.keep_data {
            let _ = std::fs::remove_dir(self.output.join("runs"));
            let _ = std::fs::remove_dir_all(self.output.join("hosts"));
        }
        Ok(points)
    }
}

/// What the capacity model (`tessera_config::capacity`, from this host's calibration) predicts
/// for each point's `metric`; `None` for every point without a calibration.
pub fn predictions(
    configs: &[(Values, String)],
    metric: report::Metric,
    calibration: &tessera_config::capacity::Calibration,
    network: Option<&network::Network>,
) -> Vec<Option<f64>> {
    use tessera_config::capacity;
    configs
        .iter()
        .map(|(values, text)| {
            let r = tessera_config::Topology::parse(text, &describe(values)).ok()?;
            let s = &r.topology.sources;
            let mut p = capacity::predict(
                &r,
                calibration,
                capacity::mean_fragment(s),
                capacity::offered_rate(s),
            );
            // Over emulated hosts, a shaped link may fill before the cores do.
            if let Some(n) = network {
                let doc = text.parse::<toml_edit::DocumentMut>().ok()?;
                if let Some(l) = n.limit_hz(&doc, p.event_bytes) {
                    p.expected_hz = p.expected_hz.min(l);
                }
            }
            let rus = r.topology.readout_units.len().max(1) as f64;
            Some(match metric {
                report::Metric::EventsPerS | report::Metric::AcceptedHz => p.expected_hz,
                report::Metric::BuiltMbPerS => p.expected_hz * p.event_bytes / 1e6,
                report::Metric::BuiltMbPerSPerReadoutUnit => {
                    p.expected_hz * p.event_bytes / 1e6 / rus
                }
                report::Metric::DeadTime => {
                    let o = p.offered_hz?;
                    (1.0 - p.expected_hz / o).max(0.0)
                }
            })
        })
        .collect()
}

/// A scenario file named relative to the topology file stays found from the point's copy.
fn absolute_scenario(doc: &mut toml_edit::DocumentMut, dir: &Path) {
    let Some(sources) = doc.get_mut("sources").and_then(|s| s.as_table_like_mut()) else {
        return;
    };
    let Some(path) = sources
        .get("scenario")
        .and_then(|v| v.as_str())
        .map(PathBuf::from)
    else {
        return;
    };
    if path.is_relative() {
        let abs = dir.join(path);
        sources.insert(
            "scenario",
            toml_edit::value(abs.to_string_lossy().into_owned()),
        );
    }
}

fn last_line(stderr: &[u8]) -> Option<String> {
    String::from_utf8_lossy(stderr)
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .map(|l| l.trim().to_string())
}

/// `key=value, key=value`.
pub fn describe(values: &[(String, String)]) -> String {
    values
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The one-line result of a point.
pub fn summary(p: &Point) -> String {
    let mut s = format!(
        "{:.0} events/s, {:.1} MB/s",
        p.events_per_s, p.built_mb_per_s
    );
    if let (Some(o), Some(a), Some(d)) = (p.offered_hz, p.accepted_hz, p.dead_time_fraction) {
        s += &format!(
            ", triggers {o:.0}/s offered {a:.0}/s accepted, dead time {:.1} %",
            d * 100.0
        );
    }
    if let Some(b) = &p.bottleneck {
        s += &format!(
            ", bottleneck: {b} ({:.0} %)",
            p.bottleneck_share.unwrap_or(0.0) * 100.0
        );
    }
    if !p.ok {
        s += &format!(
            ", FAILED: {}",
            p.error.as_deref().unwrap_or("the run failed")
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vary_reads_its_key_and_values_and_refuses_what_is_not_one() {
        let v: Vary = "sources.rate_hz=1000, 2000,4000".parse().unwrap();
        assert_eq!(v.key, "sources.rate_hz");
        assert_eq!(v.values, ["1000", "2000", "4000"]);
        for bad in ["rate", "=1,2", "a=1,,2", "a="] {
            assert!(bad.parse::<Vary>().is_err(), "{bad}");
        }
    }

    #[test]
    fn the_grid_is_every_combination_first_key_slowest() {
        let g = grid(&["a=1,2".parse().unwrap(), "b=x,y,z".parse().unwrap()]).unwrap();
        assert_eq!(g.len(), 6);
        assert_eq!(g[0], [("a".into(), "1".into()), ("b".into(), "x".into())]);
        assert_eq!(g[5], [("a".into(), "2".into()), ("b".into(), "z".into())]);
        let big: Vary = format!("c={}", vec!["1"; 100].join(",")).parse().unwrap();
        assert!(grid(&[big.clone(), big]).is_err());
    }

    #[test]
    fn keys_are_set_in_tables_arrays_of_tables_and_new_tables() {
        let mut doc: toml_edit::DocumentMut =
            "# kept\n[sources]\ncount = 8 # eight\n[[readout]]\nid = 0\n[[readout]]\nid = 1\n"
                .parse()
                .unwrap();
        set_key(&mut doc, "sources.rate_hz", "4000").unwrap();
        set_key(&mut doc, "sources.busy", "veto").unwrap();
        set_key(&mut doc, "sources.fragment_size", "16KiB").unwrap();
        set_key(&mut doc, "readout[1].host", "\"fe2\"").unwrap();
        set_key(&mut doc, "recorder.enabled", "false").unwrap();
        let t = doc.to_string();
        assert!(t.contains("# kept") && t.contains("# eight"), "{t}");
        let v: toml::Value = toml::from_str(&t).unwrap();
        assert_eq!(v["sources"]["rate_hz"].as_integer(), Some(4000));
        assert_eq!(v["sources"]["busy"].as_str(), Some("veto"));
        assert_eq!(v["sources"]["fragment_size"].as_str(), Some("16KiB"));
        assert_eq!(v["readout"][1]["host"].as_str(), Some("fe2"));
        assert_eq!(v["recorder"]["enabled"].as_bool(), Some(false));
        assert!(set_key(&mut doc, "readout[2].host", "x").is_err());
        assert!(set_key(&mut doc, "sources.count.x", "1").is_err());
        assert!(set_key(&mut doc, "sources..x", "1").is_err());
    }

    #[test]
    fn numbers_and_sizes_are_numeric() {
        assert_eq!(numeric("4000"), Some(4000.0));
        assert_eq!(numeric("0.5"), Some(0.5));
        assert_eq!(numeric("16KiB"), Some(16384.0));
        assert_eq!(numeric("veto"), None);
    }

    #[test]
    fn a_report_gives_the_points_figures_and_its_main_bottleneck() {
        let r = serde_json::json!({
            "duration_s": 2.0, "events_per_s": 500.0, "built_bytes_per_s": 3.0e6,
            "events_complete": 1000, "events_incomplete": 0,
            "balance": {"holds": true},
            "trigger": {"offered": 2000, "accepted": 1000, "dead_time_fraction": 0.5},
            "bottlenecks": [{"name": "builders", "share": 0.2}, {"name": "recorder (disk)", "share": 0.7}]
        });
        let mut p = Point::default();
        p.read_report(&r);
        assert_eq!(p.offered_hz, Some(1000.0));
        assert_eq!(p.accepted_hz, Some(500.0));
        assert_eq!(p.bottleneck.as_deref(), Some("recorder (disk)"));
        assert!(p.balance_holds);
        assert_eq!(p.built_mb_per_s, 3.0);
    }
}

//! The seeds' experiments as ready sweeps (`tessera scenario comet|cms|nectarcam|atlas`): each
//! is a topology from `examples/`, the keys the paper varied, the figure it drew, and the
//! points its text publishes, drawn beside ours with the figure they come from.
//!
//! Only the numbers a paper's text states are used as its points: the figures themselves are
//! not in the seeds as data, and a point read off a picture by eye would be a guess.

use crate::network::{Group, Link, Network};
use crate::report::{Layout, Metric, PaperSeries};
use crate::{Point, Vary};

pub const NAMES: [&str; 4] = ["comet", "cms", "nectarcam", "atlas"];

pub struct Scenario {
    pub name: &'static str,
    pub title: &'static str,
    /// The topology every point starts from, and the file it is (shown in the report).
    pub base: &'static str,
    pub base_name: &'static str,
    /// Set in every point.
    pub fixed: Vec<(String, String)>,
    pub varies: Vec<Vary>,
    /// Length of each point.
    pub duration_s: f64,
    pub metric: Metric,
    pub log_x: bool,
    pub x_label: &'static str,
    pub paper: Vec<PaperSeries>,
    /// What the paper measured and what runs here instead.
    pub setup: &'static str,
    /// Why this machine's curve differs from the paper's, as far as the setup explains it.
    pub why: &'static str,
    /// The paper's network, for `--network`: its hosts as network namespaces, its links'
    /// rates shaped.
    pub network: Network,
    /// What running over that network changes, as measured on this machine.
    pub network_why: &'static str,
}

const GBIT: f64 = 1e9;

fn vary(key: &str, values: &[&str]) -> Vary {
    Vary {
        key: key.into(),
        values: values.iter().map(|v| v.to_string()).collect(),
    }
}

fn set(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The scenario by name; `quick`: fewer and shorter points (minutes, not tens of minutes).
pub fn get(name: &str, quick: bool) -> Option<Scenario> {
    let pick = |q: &[&'static str], full: &[&'static str]| -> Vec<&'static str> {
        if quick {
            q.to_vec()
        } else {
            full.to_vec()
        }
    };
    Some(match name {
        "comet" => Scenario {
            name: "comet",
            title: "COMET Phase-I: accepted trigger rate against input trigger rate, 105 sources (Figs. 6 and 7)",
            base: include_str!("../../../examples/comet.toml"),
            base_name: "examples/comet.toml",
            fixed: set(&[
                ("sources.busy", "veto"),
                // A front-end's buffer of a few events, not the 1024 of the default: a deep
                // derandomizer accepts a short run's triggers faster than they are built.
                ("sources.derandomizer", "16"),
                ("recorder.enabled", "false"),
                ("run.events", "0"),
            ]),
            varies: vec![
                vary(
                    "sources.rate_hz",
                    &pick(
                        &["200", "800", "2000", "8000"],
                        &["100", "200", "400", "800", "1200", "1600", "2000", "3000", "4000", "6000", "8000", "12000", "16000"],
                    ),
                ),
                // RAW mode (6144 B) and SUPPRESS mode (~380 B).
                vary("sources.fragment_size", &["6144", "380"]),
            ],
            duration_s: if quick { 2.0 } else { 5.0 },
            metric: Metric::AcceptedHz,
            log_x: false,
            x_label: "input trigger rate (Hz)",
            paper: vec![
                PaperSeries {
                    name: "COMET RAW, saturation".into(),
                    source: "COMET paper, Fig. 6 and its text: 800 Hz accepted, 337 MiB/s".into(),
                    points: vec![(800.0, 800.0)],
                },
                PaperSeries {
                    name: "COMET SUPPRESS, saturation".into(),
                    source: "COMET paper, Fig. 7 and its text: 1800 Hz accepted, 24.4 MiB/s".into(),
                    points: vec![(1800.0, 1800.0)],
                },
            ],
            setup: "The paper reads 105 RECBE boards (104 on the chamber, one for the trigger counters) through five switches into one PC (Xeon E5-1650v2) and raises the input trigger rate from a function generator; BUSY was not handled, so past saturation building failed. Here, examples/comet.toml: 105 emulated sources in 5 readout units of 21 (one per front-end PC) and one builder, all in one process on this machine's cores, with BUSY vetoing triggers (sources.busy = veto) so that past saturation the accepted rate flattens instead of building failing, and the recorder off (the figures measure building).",
            why: "Ours runs the 105 emulated front-ends, the readout units and the builder on the same two cores, over loopback instead of 1 GbE links through switches: the sources' own CPU is taken from the building, and no link limits a source to 125 MB/s. The paper's curve ends where its PC could no longer build (800 Hz RAW, 1800 Hz SUPPRESS); ours flattens where the stage named as the bottleneck saturates, and the dead time then rises instead of the building failing. With SUPPRESS-size fragments our accepted rate still creeps up past the knee: at higher input rates the trigger hands each emulated front-end several triggers per tick and it writes them in one call, so the cost per fragment falls (batching that front-end hardware has no need of). The capacity model, calibrated with 8 connections, overestimates these 105: the cost per connection grows with their number (issue 14's finding).",
            network_why: "The link into the building PC is never full (RAW at its highest is 0.8 GB/s of its 1.25 GB/s) and the bottleneck named is the same as in one process, the emulated front-ends' CPU: RAW flattens at 0.87-1.24 kHz and SUPPRESS reaches 6.1 kHz, within this machine's spread of the runs in one process. The capacity model, which overestimates the CPU side at 105 connections, puts RAW's ceiling at the link (1.9 kHz) instead.",
            network: Network {
                about: "the paper's front-end network: the 105 boards on one host (the switches' side), their data into the building PC over at most 10 Gb/s (the switches' 10 Gb/s uplinks); the PC runs the 5 readout units, the builder and the run control. Each board's own 1 Gb/s port is not shaped (one link carries all 105), and at 6144 B and a few kHz a board sends far below it",
                sources: Some(Group::one("boards", Link::default())),
                readout: Group::one("pc", Link::down(10.0 * GBIT)),
                builder: Group::one("pc", Link::default()),
                control: Group::one("pc", Link::default()),
            },
        },
        "cms" => Scenario {
            name: "cms",
            title: "CMS readout builder: throughput per readout unit against fragment size, trapezoidal (Fig. 4)",
            base: include_str!("../../../examples/cms-trapezoid.toml"),
            base_name: "examples/cms-trapezoid.toml",
            fixed: set(&[
                ("sources.trigger", "\"unlimited\""),
                ("sources.size_spread", "0"),
                ("recorder.enabled", "false"),
                ("run.events", "0"),
                ("run.max_fragment_size", "\"64 KiB\""),
            ]),
            varies: vec![vary(
                "sources.fragment_size",
                &pick(
                    &["1KiB", "4KiB", "16KiB"],
                    &["256", "1KiB", "2KiB", "4KiB", "8KiB", "16KiB", "32KiB"],
                ),
            )],
            duration_s: if quick { 2.0 } else { 4.0 },
            metric: Metric::BuiltMbPerSPerReadoutUnit,
            log_x: true,
            x_label: "fragment size (bytes)",
            paper: vec![PaperSeries {
                name: "CMS 16 RU x 60 BU-FU, two GbE rails".into(),
                source: "CMS paper, Fig. 4 and its text: network utilisation almost 100 % from 8 KB; 240 MB/s per node".into(),
                points: vec![(8192.0, 240.0), (16384.0, 240.0)],
            }],
            setup: "The paper's prototype is 16 readout units and 60 builder/filter units (a quarter of one readout builder), PCs with two Gigabit Ethernet rails each, measured as throughput per node against the fragment size. Here, examples/cms-trapezoid.toml: 16 emulated sources into 2 readout units and 6 builders (the trapezoid: more builders than readout units), sources as fast as allowed (trigger unlimited), fixed fragment sizes, recorder off, all in one process.",
            why: "The paper's nodes were limited by their two 1 GbE rails (about 240 MB/s per node), so its curve rises with the fragment size until the links are full at 8 KB and stays flat. Ours has no link limit (loopback) and shares two cores between sources, readout units and builders: the per-unit throughput is set by CPU per fragment at small sizes and by memory copies at large ones, so it is higher than the paper's at large fragments and its shape (rising with size, then flattening) comes from CPU, not from the network.",
            network_why: "Here the paper's shape and level come back: at 256 B the CPU limits (157 MB/s per unit, the builders' CPU named), and from 1 KiB on each unit sends 231-236 MB/s, 0.94 of the two rails' 250 MB/s and 0.96-0.98 of the paper's 240 MB/s, while the run control names the network from the readout units to the builders (their send queues full, the builders' receive queues empty). The capacity model, given the links, predicts the 250 MB/s ceiling.",
            network: Network {
                about: "the paper's two-rail Gigabit Ethernet: each readout unit on a host of its own (its sources beside it) sending at most 2 Gb/s, each builder on a host of its own receiving at most 2 Gb/s, the run control on a host of its own. The two rails are one link of their summed rate here",
                sources: None,
                readout: Group::each("ru", Link::up(2.0 * GBIT)),
                builder: Group::each("bu", Link::down(2.0 * GBIT)),
                control: Group::one("evm", Link::default()),
            },
        },
        "nectarcam" => Scenario {
            name: "nectarcam",
            title: "NectarCAM camera event builder: built throughput against packet size, 288 boards",
            base: include_str!("../../../examples/nectarcam.toml"),
            base_name: "examples/nectarcam.toml",
            fixed: set(&[
                ("sources.trigger", "\"unlimited\""),
                ("run.duration_s", "0"),
                ("run.max_fragment_size", "\"16 KiB\""),
            ]),
            varies: vec![vary(
                "sources.fragment_size",
                &pick(&["1024", "8192"], &["1024", "2048", "4096", "8192"]),
            )],
            duration_s: if quick { 2.0 } else { 5.0 },
            metric: Metric::BuiltMbPerS,
            log_x: false,
            x_label: "fragment (packet) size (bytes)",
            paper: vec![PaperSeries {
                name: "NectarCAM event builder, no loss".into(),
                source: "NectarCAM slides, event-builder results: 1 GB/s with 1024-byte frames (1.7 cores), 2.4 GB/s with 8192-byte jumbo frames (1.6 cores)".into(),
                points: vec![(1024.0, 1000.0), (8192.0, 2400.0)],
            }],
            setup: "The slides' event builder receives 288 front-end boards (2016 photomultipliers) through two 10 Gb/s uplinks on a 12-core PC, fed by a 300-node stimulator, and reaches 2.4 GB/s with 8192-byte jumbo frames and 1 GB/s with 1024-byte frames, without loss. Here, examples/nectarcam.toml: 288 emulated boards (4 sender threads) into 4 readout units and 2 builders, as fast as allowed, recorder off, all on this machine's two cores.",
            why: "The paper's receiver had 12 cores (1.6-1.7 of them in use) and a separate 300-node stimulator; here the 288 emulated boards share this machine's two cores with the readout units and the builders. Both curves rise with the packet size, the cost of each fragment spread over more bytes; how far ours stays below the paper's at each size is in the ratios above, and the stage named is where the shared cores ran out.",
            network_why: "The camera server's two 10 Gb/s uplinks are never full (0.63 GB/s at 1024 B to 1.05 GB/s at 8192 B, of their 2.5 GB/s) and the builders' CPU is named at every point, as in one process: on this machine the shared cores run out long before the slides' network does.",
            network: Network {
                about: "the slides' camera network: the 288 boards on one host (the camera's switches), their data into the camera server over at most 20 Gb/s (its two 10 Gb/s uplinks); the server runs the 4 readout units, the 2 builders and the run control. Each board's own 1 Gb/s port is not shaped (one link carries all 288)",
                sources: Some(Group::one("boards", Link::default())),
                readout: Group::one("server", Link::down(20.0 * GBIT)),
                builder: Group::one("server", Link::default()),
                control: Group::one("server", Link::default()),
            },
        },
        "atlas" => Scenario {
            name: "atlas",
            title: "ATLAS ROS: event rate (deletes) against the fraction of events fully built, RoI of 4 links (Fig. 9)",
            base: include_str!("../../../examples/atlas-ros.toml"),
            base_name: "examples/atlas-ros.toml",
            fixed: set(&[
                ("recorder.enabled", "false"),
                ("run.events", "0"),
            ]),
            varies: vec![
                vary(
                    "filter.fraction",
                    &pick(&["0.2", "0.5"], &["0.2", "0.3", "0.4", "0.5"]),
                ),
                // 300 and 400 words of 4 bytes.
                vary("sources.fragment_size", &pick(&["1600"], &["1200", "1600"])),
            ],
            duration_s: if quick { 2.0 } else { 5.0 },
            metric: Metric::AcceptedHz,
            log_x: false,
            x_label: "fraction of events fully built after the RoI step",
            paper: vec![
                PaperSeries {
                    name: "ROS, 400-word fragments, generator limit".into(),
                    source: "ATLAS ROS paper, Sect. 7.1 on Fig. 9: the 250 MB/s on-board generator caps deletes at 161 kHz".into(),
                    points: vec![(0.2, 161_000.0), (0.5, 161_000.0)],
                },
                PaperSeries {
                    name: "ROS model, 400 words, EB 20 %, L2 70 %, RoI 4".into(),
                    source: "ATLAS ROS paper, Sect. 7.1: eq. 7.2 predicts 108 kHz".into(),
                    points: vec![(0.2, 108_000.0)],
                },
            ],
            setup: "The paper drives one ROS PC with its RobinNP cards' on-board data generator (no input network) and the ROSTester's requests: RoI requests for 4 links, full event-building requests for a fraction of events, deletes in groups of 100, and plots the inverse delete rate against the readout fraction (Fig. 9). Here, examples/atlas-ros.toml: one request-mode readout unit with 24 links of 400 words (1600 bytes) fed over TCP by emulated sources as fast as allowed, four builders that fetch a 4-link RoI first and the rest of the event for the fraction the filter accepts, clears in groups of 100; the y axis is the event rate, which is the delete rate.",
            why: "The paper's input came from an FPGA generator on the card at no CPU cost to the server, whose 12+ cores served the requests; here the 24 links are fed over loopback TCP by emulated sources on the same two cores, and the builders run beside the readout unit, so every event costs the input TCP, the requests and the answers on the same CPU. Ours changes little with the built fraction, where the paper's delete rate falls with it: every fragment arrives over loopback TCP from the emulated sources whatever fraction is then built, and that input, not the requests, takes most of the CPU, so the rate stays far below 100 kHz and the request mix moves it less than this machine's noise (tessera bench request measures the readout unit with an in-process generator, as the paper did). The capacity model knows no filter and counts every byte as built, so it overestimates the rate.",
            network_why: "The ROS's 40 Gb/s are far from full (at most 0.32 GB/s): the readout unit's CPU is named, as in one process, and the rates are lower than in one process (15-20 kHz against 21-27 kHz), since the requests and answers now cross hosts (veth links, an agent per host) on the same two cores.",
            network: Network {
                about: "the paper's test stand: the ROS on a host of its own (its 24 links emulated beside it, as the RobinNP's generator sits in the server) serving over at most 40 Gb/s (four 10 GbE links), the four builders (the ROSTester instances) on two hosts each receiving at most 20 Gb/s (two point-to-point 10 GbE links), the event manager (the HLT supervisor) and the run control on a host of their own",
                sources: None,
                readout: Group::one("ros", Link::up(40.0 * GBIT)),
                builder: Group {
                    host: "tester",
                    spread: 2,
                    link: Link::down(20.0 * GBIT),
                },
                control: Group::one("hltsv", Link::default()),
            },
        },
        _ => return None,
    })
}

impl Scenario {
    /// The report's layout, with a paragraph on what this run found.
    /// `network`: the points ran over the paper's network (`--network`).
    pub fn layout(&self, command: String, points: &[Point], network: bool) -> Layout {
        let mut notes = vec![format!("Setup. {}", self.setup)];
        if network {
            notes.push(format!(
                "Network. Every point ran over emulated hosts, network namespaces on this machine with shaped links: {}. The hosts share this machine's two cores; only the links are the paper's.",
                self.network.about
            ));
        }
        notes.push(format!("Found here: {}", self.found(points)));
        notes.push(if network {
            format!("Where and why ours differs, in one process. {}", self.why)
        } else {
            format!("Where and why ours differs. {}", self.why)
        });
        if network {
            notes.push(format!("Over the paper's network. {}", self.network_why));
        }
        Layout {
            title: if network {
                format!("{}, over the paper's network", self.title)
            } else {
                self.title.into()
            },
            command,
            x_key: Some(self.varies[0].key.clone()),
            x_label: Some(self.x_label.into()),
            x_scale: 1.0,
            metric: self.metric,
            log_x: self.log_x,
            paper: self.paper.clone(),
            notes,
            predicted: points.iter().any(|p| p.predicted.is_some()),
        }
    }

    /// Per line of the figure: the highest value, where, and what the run control named the
    /// bottleneck at the largest point of the line.
    pub fn found(&self, points: &[Point]) -> String {
        let x_key = &self.varies[0].key;
        let mut lines: Vec<(String, Vec<&Point>)> = Vec::new();
        for p in points {
            let name = line_of(p, x_key);
            match lines.iter_mut().find(|l| l.0 == name) {
                Some(l) => l.1.push(p),
                None => lines.push((name, vec![p])),
            }
        }
        let mut out = Vec::new();
        for (name, pts) in lines {
            let x = |p: &Point| {
                p.values
                    .iter()
                    .find(|v| &v.0 == x_key)
                    .map(|v| v.1.clone())
                    .unwrap_or_default()
            };
            let best = pts
                .iter()
                .filter(|p| p.ok)
                .filter_map(|p| self.metric.of(p).map(|y| (*p, y)))
                .max_by(|a, b| a.1.total_cmp(&b.1));
            let failed = pts.iter().filter(|p| !p.ok).count();
            let last = pts.last();
            let mut s = if name.is_empty() {
                String::new()
            } else {
                format!("{name}: ")
            };
            match best {
                Some((p, y)) => {
                    s += &format!(
                        "the highest {} was {} at {x_key}={}",
                        self.metric.label(),
                        crate::plot::short(y),
                        x(p)
                    );
                }
                None => s += "no point ended well",
            }
            if let Some(l) = last {
                s += &format!(
                    "; at {x_key}={} the bottleneck named for most of the run was {}",
                    x(l),
                    l.bottleneck
                        .as_deref()
                        .unwrap_or("not sampled (a short run)")
                );
                if let Some(d) = l.dead_time_fraction {
                    s += &format!(", dead time {:.0} %", d * 100.0);
                }
            }
            if failed > 0 {
                s += &format!("; {failed} point(s) failed (see the table)");
            }
            out.push(s);
        }
        // The capacity model against the measurement, where it predicted.
        let judged: Vec<f64> = points
            .iter()
            .filter(|p| p.ok)
            .filter_map(|p| Some(self.metric.of(p)? / p.predicted.filter(|m| *m > 0.0)?))
            .collect();
        if !judged.is_empty() {
            let lo = judged.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = judged.iter().copied().fold(0.0, f64::max);
            out.push(format!(
                "The capacity model (tessera check, from this host's calibration) against the measurement: measured over predicted from {lo:.2} to {hi:.2} over the points"
            ));
        }
        // Ours against the paper's at the same x, where a line has a point there.
        for ps in &self.paper {
            for &(px, py) in &ps.points {
                let ours: Vec<String> = points
                    .iter()
                    .filter(|p| p.ok)
                    .filter(|p| {
                        p.values
                            .iter()
                            .find(|v| &v.0 == x_key)
                            .and_then(|v| crate::numeric(&v.1))
                            .is_some_and(|x| (x - px).abs() <= 1e-9 * px.abs().max(1.0))
                    })
                    .filter_map(|p| {
                        let y = self.metric.of(p)?;
                        let line = line_of(p, x_key);
                        let at = if line.is_empty() {
                            String::new()
                        } else {
                            format!(" ({line})")
                        };
                        Some(format!(
                            "{}{at}, {:.2} of it",
                            crate::plot::short(y),
                            y / py
                        ))
                    })
                    .collect();
                if !ours.is_empty() && py > 0.0 {
                    out.push(format!(
                        "Against {} at {x_key}={}: the paper {}, ours {}",
                        ps.name,
                        crate::plot::short(px),
                        crate::plot::short(py),
                        ours.join("; ")
                    ));
                }
            }
        }
        out.join(". ") + "."
    }
}

/// The line of the figure a point is on: its values but the x axis's.
fn line_of(p: &Point, x_key: &str) -> String {
    p.values
        .iter()
        .filter(|v| v.0 != x_key)
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scenario_is_a_valid_topology_at_every_point() {
        for name in NAMES {
            for (quick, network) in [(true, false), (false, false), (true, true)] {
                let s = get(name, quick).unwrap();
                let scan = crate::Scan {
                    base: s.base.into(),
                    origin: s.base_name.into(),
                    fixed: s.fixed.clone(),
                    varies: s.varies.clone(),
                    output: "unused".into(),
                    duration_s: Some(s.duration_s),
                    events: None,
                    keep_data: false,
                    binary: "unused".into(),
                    model: None,
                    network: network.then(|| s.network.clone()),
                };
                let c = scan
                    .configurations()
                    .unwrap_or_else(|e| panic!("{name}: {e:#}"));
                assert!(!c.is_empty());
            }
        }
        assert!(get("lhcb", false).is_none());
    }
}

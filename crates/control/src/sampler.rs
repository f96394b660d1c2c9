//! Rates from successive snapshots, a bounded history of them for the dashboard's plots, and
//! each stage's condition (starved, busy, blocked) with the bottleneck named.
//!
//! The rule for the bottleneck is back-pressure's: a stage that is blocked waits on the stage
//! after it. Walking from the sources towards the recorder, the first stage that is not blocked
//! after one that is, is the one that sets the pace. With no stage blocked the sources' trigger
//! rate sets it.

use serde::Serialize;
use std::collections::VecDeque;
use std::time::Instant;

use tessera_run::live::Live;

/// Points kept: at the default 0.5 s interval, five minutes.
pub const HISTORY: usize = 600;

/// A stage counts as blocked when its buffers are fuller than this, or it spent more than this
/// fraction of the interval unable to read (sources: held by back-pressure).
const BLOCKED: f64 = 0.8;
const HELD: f64 = 0.2;

#[derive(Clone, Debug, Serialize)]
pub struct Point {
    /// Seconds since the run started.
    pub t: f64,
    pub events_per_s: f64,
    pub built_bytes_per_s: f64,
    pub recorded_bytes_per_s: f64,
    pub incomplete_per_s: f64,
    pub rejected_per_s: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct StageView {
    /// `sources`, `readout`, `builders`, `recorder`.
    pub stage: &'static str,
    /// `starved` (nothing to do), `busy` (moving data, not held), `blocked` (held by the next
    /// stage), `idle` (paused).
    pub condition: &'static str,
    /// What the condition is read from, in words.
    pub why: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Rates {
    pub interval_s: f64,
    pub per_source_fragments_per_s: Vec<(u32, f64)>,
    pub per_source_bytes_per_s: Vec<(u32, f64)>,
    /// Fraction of the interval each emulated source was held by back-pressure (dead time).
    pub per_source_dead_fraction: Vec<(u32, f64)>,
    pub per_readout_bytes_per_s: Vec<(u32, f64)>,
    pub per_readout_busy_fraction: Vec<(u32, f64)>,
    pub per_builder_events_per_s: Vec<(u16, f64)>,
    pub per_builder_bytes_per_s: Vec<(u16, f64)>,
    pub per_builder_busy_fraction: Vec<(u16, f64)>,
    pub recorder_busy_fraction: f64,
    pub stages: Vec<StageView>,
    pub bottleneck: String,
}

#[derive(Default)]
pub struct Sampler {
    last: Option<(Instant, Live)>,
    pub history: VecDeque<Point>,
    pub rates: Option<Rates>,
}

fn per_s(a: u64, b: u64, dt: f64) -> f64 {
    a.saturating_sub(b) as f64 / dt
}

fn frac(ns_now: u64, ns_then: u64, dt: f64, n: usize) -> f64 {
    (ns_now.saturating_sub(ns_then) as f64 / 1e9 / dt / n.max(1) as f64).min(1.0)
}

fn occ(used: u64, limit: u64) -> f64 {
    if limit == 0 {
        0.0
    } else {
        used as f64 / limit as f64
    }
}

impl Sampler {
    pub fn reset(&mut self) {
        *self = Sampler::default();
    }

    pub fn push(&mut self, live: &Live) {
        let now = Instant::now();
        let Some((t_then, then)) = self.last.take() else {
            self.last = Some((now, live.clone()));
            return;
        };
        let dt = (now - t_then).as_secs_f64().max(1e-3);
        let sum = |l: &Live, f: fn(&tessera_run::live::LiveBuilder) -> u64| -> u64 {
            l.builders.iter().map(f).sum()
        };
        let events = |l: &Live| sum(l, |b| b.events_complete + b.events_incomplete);
        let rejected = |l: &Live| -> u64 {
            l.sources
                .iter()
                .map(|s| s.rejected.values().sum::<u64>())
                .sum()
        };
        let rec_bytes = |l: &Live| l.recorder.as_ref().map_or(0, |r| r.file_bytes);
        self.history.push_back(Point {
            t: live.elapsed_s,
            events_per_s: per_s(events(live), events(&then), dt),
            built_bytes_per_s: per_s(
                sum(live, |b| b.bytes_built),
                sum(&then, |b| b.bytes_built),
                dt,
            ),
            recorded_bytes_per_s: per_s(rec_bytes(live), rec_bytes(&then), dt),
            incomplete_per_s: per_s(
                sum(live, |b| b.events_incomplete),
                sum(&then, |b| b.events_incomplete),
                dt,
            ),
            rejected_per_s: per_s(rejected(live), rejected(&then), dt),
        });
        while self.history.len() > HISTORY {
            self.history.pop_front();
        }
        self.rates = Some(rates(live, &then, dt));
        self.last = Some((now, live.clone()));
    }
}

fn rates(live: &Live, then: &Live, dt: f64) -> Rates {
    let find_src = |id: u32| then.sources.iter().find(|s| s.id == id);
    let per_source_fragments_per_s = live
        .sources
        .iter()
        .map(|s| {
            (
                s.id,
                per_s(s.received, find_src(s.id).map_or(0, |o| o.received), dt),
            )
        })
        .collect();
    let per_source_bytes_per_s = live
        .sources
        .iter()
        .filter_map(|s| {
            let b = s.bytes_sent?;
            Some((s.id, per_s(b, find_src(s.id)?.bytes_sent?, dt)))
        })
        .collect();
    let per_source_dead_fraction: Vec<(u32, f64)> = live
        .sources
        .iter()
        .filter_map(|s| {
            let h = s.held_ns?;
            Some((s.id, frac(h, find_src(s.id)?.held_ns?, dt, 1)))
        })
        .collect();
    let find_ru = |id: u32| then.readout_units.iter().find(|u| u.id == id);
    let per_readout_bytes_per_s = live
        .readout_units
        .iter()
        .map(|u| {
            (
                u.id,
                per_s(
                    u.bytes_forwarded,
                    find_ru(u.id).map_or(0, |o| o.bytes_forwarded),
                    dt,
                ),
            )
        })
        .collect();
    let per_readout_busy_fraction: Vec<(u32, f64)> = live
        .readout_units
        .iter()
        .map(|u| {
            (
                u.id,
                frac(
                    u.busy_ns,
                    find_ru(u.id).map_or(0, |o| o.busy_ns),
                    dt,
                    u.links,
                ),
            )
        })
        .collect();
    let find_bu = |id: u16| then.builders.iter().find(|b| b.id == id);
    let per_builder_events_per_s = live
        .builders
        .iter()
        .map(|b| {
            let o = find_bu(b.id);
            (
                b.id,
                per_s(
                    b.events_complete + b.events_incomplete,
                    o.map_or(0, |o| o.events_complete + o.events_incomplete),
                    dt,
                ),
            )
        })
        .collect();
    let per_builder_bytes_per_s = live
        .builders
        .iter()
        .map(|b| {
            (
                b.id,
                per_s(
                    b.bytes_built,
                    find_bu(b.id).map_or(0, |o| o.bytes_built),
                    dt,
                ),
            )
        })
        .collect();
    let per_builder_busy_fraction: Vec<(u16, f64)> = live
        .builders
        .iter()
        .map(|b| {
            (
                b.id,
                frac(
                    b.busy_ns,
                    find_bu(b.id).map_or(0, |o| o.busy_ns),
                    dt,
                    b.links,
                ),
            )
        })
        .collect();
    let recorder_busy_fraction = match (&live.recorder, &then.recorder) {
        (Some(a), Some(b)) => frac(a.busy_ns, b.busy_ns, dt, a.links),
        _ => 0.0,
    };

    // Conditions.
    let max = |v: &[f64]| v.iter().cloned().fold(0.0, f64::max);
    let moved_src: f64 = live
        .sources
        .iter()
        .map(|s| per_s(s.received, find_src(s.id).map_or(0, |o| o.received), dt))
        .sum();
    let dead = max(&per_source_dead_fraction
        .iter()
        .map(|x| x.1)
        .collect::<Vec<_>>());
    let mut stages = Vec::new();
    stages.push(if live.paused {
        StageView {
            stage: "sources",
            condition: "idle",
            why: "paused: triggers held".into(),
        }
    } else if dead > HELD {
        StageView {
            stage: "sources",
            condition: "blocked",
            why: format!("held by back-pressure {:.0}% of the time", dead * 100.0),
        }
    } else if moved_src == 0.0 {
        StageView {
            stage: "sources",
            condition: "starved",
            why: "no fragment arrived".into(),
        }
    } else {
        StageView {
            stage: "sources",
            condition: "busy",
            why: format!("{moved_src:.0} fragments/s"),
        }
    });
    let stage = |name: &'static str, occupancy: f64, busy: f64, moved: f64| -> StageView {
        if occupancy > BLOCKED || busy > HELD {
            StageView {
                stage: name,
                condition: "blocked",
                why: format!(
                    "buffers {:.0}% full, unable to read {:.0}% of the time",
                    occupancy * 100.0,
                    busy * 100.0
                ),
            }
        } else if moved == 0.0 {
            StageView {
                stage: name,
                condition: "starved",
                why: format!("nothing moved; buffers {:.0}% full", occupancy * 100.0),
            }
        } else {
            StageView {
                stage: name,
                condition: "busy",
                why: format!("buffers {:.0}% full", occupancy * 100.0),
            }
        }
    };
    let ru_occ = live
        .readout_units
        .iter()
        .map(|u| occ(u.buffer_used, u.buffer_limit))
        .fold(0.0, f64::max);
    let ru_moved: f64 = live
        .readout_units
        .iter()
        .map(|u| {
            per_s(
                u.bytes_forwarded,
                find_ru(u.id).map_or(0, |o| o.bytes_forwarded),
                dt,
            )
        })
        .sum();
    stages.push(stage(
        "readout",
        ru_occ,
        max(&per_readout_busy_fraction
            .iter()
            .map(|x| x.1)
            .collect::<Vec<_>>()),
        ru_moved,
    ));
    let bu_occ = live
        .builders
        .iter()
        .map(|b| occ(b.buffer_used, b.buffer_limit))
        .fold(0.0, f64::max);
    let bu_moved: f64 = live
        .builders
        .iter()
        .map(|b| {
            per_s(
                b.bytes_built,
                find_bu(b.id).map_or(0, |o| o.bytes_built),
                dt,
            )
        })
        .sum();
    stages.push(stage(
        "builders",
        bu_occ,
        max(&per_builder_busy_fraction
            .iter()
            .map(|x| x.1)
            .collect::<Vec<_>>()),
        bu_moved,
    ));
    if let Some(rec) = &live.recorder {
        let moved = per_s(
            rec.record_bytes,
            then.recorder.as_ref().map_or(0, |o| o.record_bytes),
            dt,
        );
        stages.push(stage(
            "recorder",
            occ(rec.buffer_used, rec.buffer_limit),
            recorder_busy_fraction,
            moved,
        ));
    }
    let bottleneck = bottleneck(&stages);
    Rates {
        interval_s: dt,
        per_source_fragments_per_s,
        per_source_bytes_per_s,
        per_source_dead_fraction,
        per_readout_bytes_per_s,
        per_readout_busy_fraction,
        per_builder_events_per_s,
        per_builder_bytes_per_s,
        per_builder_busy_fraction,
        recorder_busy_fraction,
        stages,
        bottleneck,
    }
}

/// The first stage that is not blocked after one that is; the last stage if every stage is
/// blocked (it waits on what is after it: the disk, or a blocking monitor station).
pub fn bottleneck(stages: &[StageView]) -> String {
    let last_blocked = stages.iter().rposition(|s| s.condition == "blocked");
    match last_blocked {
        None => "none: the sources' trigger rate sets the pace".into(),
        Some(i) if i + 1 < stages.len() => stages[i + 1].stage.to_string(),
        Some(i) => format!(
            "{} (held by what comes after it: disk or a blocking monitor station)",
            stages[i].stage
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(stage: &'static str, condition: &'static str) -> StageView {
        StageView {
            stage,
            condition,
            why: String::new(),
        }
    }

    #[test]
    fn the_bottleneck_is_the_stage_after_the_last_blocked_one() {
        let v = [
            s("sources", "blocked"),
            s("readout", "blocked"),
            s("builders", "busy"),
            s("recorder", "starved"),
        ];
        assert_eq!(bottleneck(&v), "builders");
        let v = [
            s("sources", "busy"),
            s("readout", "busy"),
            s("builders", "busy"),
        ];
        assert!(bottleneck(&v).starts_with("none"));
        let v = [s("sources", "blocked"), s("recorder", "blocked")];
        assert!(bottleneck(&v).starts_with("recorder"));
    }
}

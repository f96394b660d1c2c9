//! Rates from successive snapshots, a bounded history of them for the dashboard's plots, and
//! each stage's condition (starved, busy, blocked) with the bottleneck named.
//!
//! The rule for the bottleneck is back-pressure's: a stage that is blocked waits on the stage
//! after it. Walking from the sources towards the recorder, the first stage that is not blocked
//! after one that is, is the one that sets the pace. With no stage blocked the sources' trigger
//! rate sets it.

use serde::Serialize;
use std::collections::{BTreeMap, VecDeque};
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
    /// The host this view is of, in a run spread over hosts (one view per stage and host; the
    /// sources by the host of the readout unit their link ends at).
    pub host: Option<String>,
    /// `starved` (nothing to do), `busy` (moving data, not held), `blocked` (held by the next
    /// stage), `idle` (paused).
    pub condition: &'static str,
    /// What the condition is read from, in words.
    pub why: String,
    /// The larger of the fullest buffer's occupancy and the fraction of the interval unable to
    /// read (0..1).
    pub load: f64,
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

    // Conditions, per stage and, in a run spread over hosts, per host: the bottleneck then
    // names the host as well as the stage.
    let mut stages = Vec::new();
    let ru_host = |id: u32| {
        live.readout_units
            .iter()
            .find(|u| u.id == id)
            .and_then(|u| u.host.clone())
    };
    // Sources are grouped by the host of the readout unit their link ends at.
    let mut src: BTreeMap<Option<String>, Load> = BTreeMap::new();
    for s in &live.sources {
        let l = src.entry(ru_host(s.readout_unit)).or_default();
        l.moved += per_s(s.received, find_src(s.id).map_or(0, |o| o.received), dt);
        if let Some(h) = s.held_ns {
            let f = frac(
                h,
                find_src(s.id).and_then(|o| o.held_ns).unwrap_or(h),
                dt,
                1,
            );
            l.busy = l.busy.max(f);
        }
    }
    for (host, l) in src {
        stages.push(if live.paused {
            StageView::new("sources", host, "idle", "paused: triggers held".into(), 0.0)
        } else if l.busy > HELD {
            StageView::new(
                "sources",
                host,
                "blocked",
                format!("held by back-pressure {:.0}% of the time", l.busy * 100.0),
                l.busy,
            )
        } else if l.moved == 0.0 {
            StageView::new(
                "sources",
                host,
                "starved",
                "no fragment arrived".into(),
                0.0,
            )
        } else {
            StageView::new(
                "sources",
                host,
                "busy",
                format!("{:.0} fragments/s", l.moved),
                l.busy,
            )
        });
    }
    let mut ru: BTreeMap<Option<String>, Load> = BTreeMap::new();
    for u in &live.readout_units {
        let o = find_ru(u.id);
        ru.entry(u.host.clone()).or_default().add(
            occ(u.buffer_used, u.buffer_limit),
            frac(u.busy_ns, o.map_or(0, |o| o.busy_ns), dt, u.links),
            per_s(u.bytes_forwarded, o.map_or(0, |o| o.bytes_forwarded), dt),
        );
    }
    stages.extend(ru.into_iter().map(|(h, l)| l.view("readout", h)));
    let mut bu: BTreeMap<Option<String>, Load> = BTreeMap::new();
    for b in &live.builders {
        let o = find_bu(b.id);
        bu.entry(b.host.clone()).or_default().add(
            occ(b.buffer_used, b.buffer_limit),
            frac(b.busy_ns, o.map_or(0, |o| o.busy_ns), dt, b.links),
            per_s(b.bytes_built, o.map_or(0, |o| o.bytes_built), dt),
        );
    }
    stages.extend(bu.into_iter().map(|(h, l)| l.view("builders", h)));
    if let Some(rec) = &live.recorder {
        let mut l = Load::default();
        l.add(
            occ(rec.buffer_used, rec.buffer_limit),
            recorder_busy_fraction,
            per_s(
                rec.record_bytes,
                then.recorder.as_ref().map_or(0, |o| o.record_bytes),
                dt,
            ),
        );
        stages.push(l.view("recorder", rec.host.clone()));
    }
    let after_last = after_last(live, then, dt);
    let bottleneck = bottleneck_after(&stages, &after_last);
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

/// What holds the last stage when it is blocked itself: nothing after the builders when
/// recording is off (they are CPU-bound), else the disk if the recorder spent most of the
/// interval in write and sync calls (or is below its free-space watermark), else its own CPU or a
/// blocking monitor station.
fn after_last(live: &Live, then: &Live, dt: f64) -> String {
    match &live.recorder {
        None => "CPU-bound: its buffers are full and nothing after it holds it".to_string(),
        Some(rec) if rec.disk_low || rec.disk_full => {
            "held by the disk: below its free-space watermark".to_string()
        }
        Some(rec) => {
            let writing = frac(
                rec.write_ns,
                then.recorder.as_ref().map_or(rec.write_ns, |o| o.write_ns),
                dt,
                1,
            );
            if writing > 0.5 {
                format!(
                    "held by the disk: in write and sync calls {:.0}% of the time",
                    writing * 100.0
                )
            } else {
                format!(
                    "not held by the disk (in write and sync calls {:.0}% of the time): CPU-bound, or a blocking monitor station",
                    writing * 100.0
                )
            }
        }
    }
}

/// What one stage does on one host over the interval.
#[derive(Default)]
struct Load {
    /// Fullest buffer, as a fraction of its limit.
    occupancy: f64,
    /// Largest fraction of the interval a reader could not read (sources: held).
    busy: f64,
    /// Summed rate (bytes or fragments per second).
    moved: f64,
}

impl Load {
    fn add(&mut self, occupancy: f64, busy: f64, moved: f64) {
        self.occupancy = self.occupancy.max(occupancy);
        self.busy = self.busy.max(busy);
        self.moved += moved;
    }

    fn view(&self, stage: &'static str, host: Option<String>) -> StageView {
        let load = self.occupancy.max(self.busy);
        if self.occupancy > BLOCKED || self.busy > HELD {
            StageView::new(
                stage,
                host,
                "blocked",
                format!(
                    "buffers {:.0}% full, unable to read {:.0}% of the time",
                    self.occupancy * 100.0,
                    self.busy * 100.0
                ),
                load,
            )
        } else if self.moved == 0.0 {
            StageView::new(
                stage,
                host,
                "starved",
                format!("nothing moved; buffers {:.0}% full", self.occupancy * 100.0),
                load,
            )
        } else {
            StageView::new(
                stage,
                host,
                "busy",
                format!("buffers {:.0}% full", self.occupancy * 100.0),
                load,
            )
        }
    }
}

impl StageView {
    fn new(
        stage: &'static str,
        host: Option<String>,
        condition: &'static str,
        why: String,
        load: f64,
    ) -> StageView {
        StageView {
            stage,
            host,
            condition,
            why,
            load,
        }
    }
}

/// The first stage that is not blocked after one that is; the last stage if every stage is
/// blocked (it waits on what is after it: the disk, or a blocking monitor station). A stage is
/// blocked when it is on any host; over hosts the bottleneck names the stage's most loaded host
/// (fullest buffers or longest unable to read), or its blocked one.
pub fn bottleneck(stages: &[StageView]) -> String {
    bottleneck_after(
        stages,
        "held by what comes after it: disk or a blocking monitor station",
    )
}

/// [`bottleneck`], with what holds the last stage when it is blocked itself said by the caller,
/// which knows (the recorder's time in write calls, or no recorder at all).
pub fn bottleneck_after(stages: &[StageView], after_last: &str) -> String {
    let mut order: Vec<&'static str> = Vec::new();
    for s in stages {
        if !order.contains(&s.stage) {
            order.push(s.stage);
        }
    }
    let blocked = |name: &str| {
        stages
            .iter()
            .any(|s| s.stage == name && s.condition == "blocked")
    };
    // The host to name within a stage: a blocked one first, then the most loaded.
    let at = |name: &str| -> String {
        let worst = stages.iter().filter(|s| s.stage == name).max_by(|a, b| {
            let key = |s: &StageView| ((s.condition == "blocked") as u8, s.load);
            key(a)
                .partial_cmp(&key(b))
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        match worst.and_then(|s| s.host.as_deref()) {
            Some(h) => format!("{name} on {h}"),
            None => name.to_string(),
        }
    };
    match order.iter().rposition(|s| blocked(s)) {
        None => "none: the sources' trigger rate sets the pace".into(),
        Some(i) if i + 1 < order.len() => at(order[i + 1]),
        Some(i) => format!("{} ({after_last})", at(order[i])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(stage: &'static str, condition: &'static str) -> StageView {
        StageView::new(stage, None, condition, String::new(), 0.0)
    }

    fn on(stage: &'static str, host: &str, condition: &'static str, load: f64) -> StageView {
        StageView::new(stage, Some(host.into()), condition, String::new(), load)
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

    #[test]
    fn over_hosts_a_stage_blocked_on_one_host_is_blocked_and_the_next_names_its_host() {
        let v = [
            on("sources", "fe1", "busy", 0.0),
            on("readout", "fe1", "busy", 0.1),
            on("readout", "fe2", "blocked", 0.95),
            on("builders", "bu1", "busy", 0.3),
            on("builders", "bu2", "busy", 0.7),
            on("recorder", "bu1", "busy", 0.1),
        ];
        assert_eq!(bottleneck(&v), "builders on bu2");
        let v = [
            on("readout", "fe1", "blocked", 0.9),
            on("recorder", "bu1", "blocked", 0.99),
        ];
        assert!(
            bottleneck(&v).starts_with("recorder on bu1 (held"),
            "{}",
            bottleneck(&v)
        );
    }

    /// Issue 14: with recording off the builders are the last stage; full, they are the
    /// bottleneck by their own CPU, not by a disk that is not there.
    #[test]
    fn the_last_stage_blocked_by_nothing_after_it_is_named_cpu_bound() {
        let v = [
            s("sources", "blocked"),
            s("readout", "blocked"),
            s("builders", "blocked"),
        ];
        let live = tessera_run::live::Live::empty(1);
        assert_eq!(
            bottleneck_after(&v, &after_last(&live, &live, 1.0)),
            "builders (CPU-bound: its buffers are full and nothing after it holds it)"
        );
        // A recorder in write calls most of the interval is held by its disk; one that is not
        // is held by something else, and says so.
        let mut then = tessera_run::live::Live::empty(1);
        then.recorder = Some(Default::default());
        let mut now = then.clone();
        now.recorder.as_mut().unwrap().write_ns = 800_000_000;
        assert!(after_last(&now, &then, 1.0).starts_with("held by the disk"));
        now.recorder.as_mut().unwrap().write_ns = 100_000_000;
        assert!(after_last(&now, &then, 1.0).starts_with("not held by the disk"));
    }
}

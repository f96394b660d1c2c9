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
/// A host that used more than this fraction of the cores it may use is CPU-bound: its stages
/// go no faster because they get no more CPU, whatever their buffers say.
const CPU_BOUND: f64 = 0.9;
/// A process whose threads waited for a core more than this fraction of the time they were
/// ready to run is CPU-starved.
const CPU_WAITED: f64 = 0.5;
/// A blocked stage is named itself, CPU-starved, when its process waited for a core this much
/// more of its ready time than the next stage's did.
const STARVED_MORE: f64 = 0.15;
/// A process that used more than this fraction of its allowance is compared with the next
/// stage's by use rather than by waits.
const NEAR_ALLOWANCE: f64 = 0.6;

#[derive(Clone, Debug, Serialize)]
pub struct Point {
    /// Seconds since the run started.
    pub t: f64,
    pub events_per_s: f64,
    pub built_bytes_per_s: f64,
    pub recorded_bytes_per_s: f64,
    pub incomplete_per_s: f64,
    pub rejected_per_s: f64,
    /// Over the interval, by [`tessera_run::live::dead_time_fraction`].
    pub dead_time_fraction: f64,
    /// The fullest buffer's occupancy (readout units, builders, recorder), 0..1.
    pub buffer_fraction: f64,
    /// Each buffer's occupancy, 0..1: `RU 0`, `BU 1`, `recorder` (with ` on HOST` over
    /// hosts). As many as the topology has buffers.
    pub buffers: Vec<(String, f64)>,
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
    /// The CPU of the process this stage runs in (its host's agent, or the whole run) over the
    /// interval, where it was measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu: Option<Cpu>,
    /// Bytes its links to the next stage had written and the network had not yet taken (the
    /// kernel's send queues), as last sampled; where measured (readout units in push mode).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unsent: Option<u64>,
    /// Bytes arrived on its links from the stage before and not yet read (the kernel's
    /// receive queues), as last sampled; where measured (builders in push mode).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unread: Option<u64>,
}

/// CPU a process used over an interval.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Cpu {
    /// Fraction of what it may use (0..1, a little above on rounding).
    pub used: f64,
    /// Cores it may use (its CPUs, or its control group's quota where the process can see it).
    pub allowance: f64,
    /// Of the time its threads were ready to run, the fraction they waited for a core (0..1):
    /// high on a host short of cores, or under a CPU quota the process cannot see.
    pub waited: f64,
}

impl Cpu {
    fn bound(&self) -> bool {
        self.used > CPU_BOUND || self.waited > CPU_WAITED
    }

    fn words(&self) -> String {
        if self.used > CPU_BOUND || self.waited <= CPU_WAITED {
            format!(
                "CPU-bound: its process used {:.0}% of the {} cores it may use",
                self.used * 100.0,
                trim(self.allowance)
            )
        } else {
            format!(
                "CPU-starved: its process's threads waited for a core {:.0}% of the time they were ready to run",
                self.waited * 100.0
            )
        }
    }
}

fn trim(x: f64) -> String {
    let s = format!("{x:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// What holds the last stage when it is blocked itself, in words and as one word for tallies
/// (`disk`, `monitor`, `cpu`, `unknown`).
pub struct Hold {
    pub cause: &'static str,
    pub words: String,
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
    /// Triggers offered and accepted per second, and the fraction of offered ones vetoed
    /// (dead time), over the interval.
    pub trigger_offered_per_s: f64,
    pub trigger_accepted_per_s: f64,
    pub dead_time_fraction: f64,
    pub stages: Vec<StageView>,
    pub bottleneck: String,
    /// The bottleneck in a few fixed words, to count over a run: the stage (and host), and
    /// what holds it when it is the last stage or CPU-bound (`recorder (disk)`, `builders
    /// (cpu)`, `readout on fe1`, `none`).
    pub bottleneck_key: String,
}

#[derive(Default)]
pub struct Sampler {
    last: Option<(Instant, Live)>,
    pub history: VecDeque<Point>,
    pub rates: Option<Rates>,
    /// Seconds each bottleneck was named while the run took data (not paused).
    named: BTreeMap<String, f64>,
    /// Triggers vetoed in intervals where each bottleneck was named.
    vetoed_by: BTreeMap<String, u64>,
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

    /// Takes a snapshot; `taking_data` (running, not paused, no transition under way) counts
    /// the interval towards the run's bottleneck tally.
    pub fn push(&mut self, live: &Live, taking_data: bool) {
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
        let r = rates(live, &then, dt);
        self.history.push_back(Point {
            dead_time_fraction: r.dead_time_fraction,
            buffer_fraction: buffer_fraction(live),
            buffers: buffers(live),
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
        if taking_data && !then.paused {
            *self.named.entry(r.bottleneck_key.clone()).or_default() += dt;
        }
        if let (Some(a), Some(b)) = (&live.trigger, &then.trigger) {
            let vetoed = a.vetoed.saturating_sub(b.vetoed);
            if vetoed > 0 {
                *self.vetoed_by.entry(r.bottleneck_key.clone()).or_default() += vetoed;
            }
        }
        self.rates = Some(r);
        self.last = Some((now, live.clone()));
    }

    /// Vetoed triggers by the bottleneck named when they were vetoed, out of `vetoed` in all:
    /// those after the last sample are `after the last sample`.
    pub fn vetoed_by(&self, vetoed: u64) -> BTreeMap<String, u64> {
        let mut out = self.vetoed_by.clone();
        let seen: u64 = out.values().sum();
        if vetoed > seen {
            out.insert("after the last sample".into(), vetoed - seen);
        }
        out
    }

    /// What was named the bottleneck over the run so far, most named first.
    pub fn bottlenecks(&self) -> Vec<tessera_run::report::BottleneckShare> {
        let total: f64 = self.named.values().sum();
        let mut out: Vec<_> = self
            .named
            .iter()
            .map(|(name, &seconds)| tessera_run::report::BottleneckShare {
                name: name.clone(),
                seconds,
                share: if total > 0.0 { seconds / total } else { 0.0 },
            })
            .collect();
        out.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
        out
    }
}

/// Each buffer's occupancy, 0..1, named as the dashboard names it.
pub fn buffers(live: &Live) -> Vec<(String, f64)> {
    let on = |h: &Option<String>| h.as_ref().map(|h| format!(" on {h}")).unwrap_or_default();
    live.readout_units
        .iter()
        .map(|u| {
            (
                format!("RU {}{}", u.id, on(&u.host)),
                occ(u.buffer_used, u.buffer_limit),
            )
        })
        .chain(live.builders.iter().map(|b| {
            (
                format!("BU {}{}", b.id, on(&b.host)),
                occ(b.buffer_used, b.buffer_limit),
            )
        }))
        .chain(live.recorder.iter().map(|r| {
            (
                format!("recorder{}", on(&r.host)),
                occ(r.buffer_used, r.buffer_limit),
            )
        }))
        .collect()
}

/// The fullest buffer's occupancy, 0..1: readout units, builders and the recorder.
pub fn buffer_fraction(live: &Live) -> f64 {
    live.readout_units
        .iter()
        .map(|u| occ(u.buffer_used, u.buffer_limit))
        .chain(
            live.builders
                .iter()
                .map(|b| occ(b.buffer_used, b.buffer_limit)),
        )
        .chain(
            live.recorder
                .iter()
                .map(|r| occ(r.buffer_used, r.buffer_limit)),
        )
        .fold(0.0, f64::max)
        .min(1.0)
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
    let mut unsent: BTreeMap<Option<String>, u64> = BTreeMap::new();
    for u in &live.readout_units {
        *unsent.entry(u.host.clone()).or_default() += u.send_queued;
    }
    stages.extend(ru.into_iter().map(|(h, l)| {
        let mut v = l.view("readout", h);
        // Request mode answers on links of another kind, not sampled.
        if live.mode != "request" {
            v.unsent = unsent.get(&v.host).copied();
            if let Some(n) = v.unsent.filter(|&n| n >= NETWORK_QUEUED) {
                v.why += &format!("; {} in its send queues", bytes(n));
            }
        }
        v
    }));
    let mut bu: BTreeMap<Option<String>, Load> = BTreeMap::new();
    for b in &live.builders {
        let o = find_bu(b.id);
        bu.entry(b.host.clone()).or_default().add(
            occ(b.buffer_used, b.buffer_limit),
            frac(b.busy_ns, o.map_or(0, |o| o.busy_ns), dt, b.links),
            per_s(b.bytes_built, o.map_or(0, |o| o.bytes_built), dt),
        );
    }
    let mut unread: BTreeMap<Option<String>, u64> = BTreeMap::new();
    for b in &live.builders {
        *unread.entry(b.host.clone()).or_default() += b.receive_queued;
    }
    stages.extend(bu.into_iter().map(|(h, l)| {
        let mut v = l.view("builders", h);
        if live.mode != "request" {
            v.unread = unread.get(&v.host).copied();
            if let Some(n) = v.unread.filter(|&n| n >= NETWORK_QUEUED) {
                v.why += &format!("; {} unread in its receive queues", bytes(n));
            }
        }
        v
    }));
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
    let (trigger_offered_per_s, trigger_accepted_per_s, offered, vetoed) =
        match (&live.trigger, &then.trigger) {
            (Some(a), Some(b)) => {
                let offered = a.offered.saturating_sub(b.offered);
                (
                    offered as f64 / dt,
                    a.accepted.saturating_sub(b.accepted) as f64 / dt,
                    offered,
                    a.vetoed.saturating_sub(b.vetoed),
                )
            }
            _ => (0.0, 0.0, 0, 0),
        };
    let veto = live
        .trigger
        .as_ref()
        .is_some_and(|t| t.policy == "veto")
        .then_some((offered, vetoed));
    let vetoed_fraction = tessera_run::live::dead_time_fraction(veto, []);
    let dead_time_fraction =
        tessera_run::live::dead_time_fraction(veto, per_source_dead_fraction.iter().map(|x| x.1));
    let cpu = cpu_per_host(live, then, dt);
    for s in &mut stages {
        // The sources' view is grouped by the readout unit's host, not by where they run.
        if s.stage != "sources" {
            s.cpu = cpu.get(&s.host).copied();
        }
    }
    let hold = after_last(live, then, dt, &cpu);
    let (bottleneck, bottleneck_key) = vetoed_unblocked(named(&stages, &hold), vetoed_fraction);
    // What the bottleneck was read from, for whoever asks why it was named (TESSERA_LOG=debug).
    tracing::debug!(
        target: "tessera::stages",
        bottleneck = %bottleneck,
        stages = %serde_json::to_string(&stages).unwrap_or_default(),
        "stage conditions"
    );
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
        trigger_offered_per_s,
        trigger_accepted_per_s,
        dead_time_fraction,
        stages,
        bottleneck,
        bottleneck_key,
    }
}

/// Each process's CPU use over the interval, by host (`None`: the run in one process).
fn cpu_per_host(live: &Live, then: &Live, dt: f64) -> BTreeMap<Option<String>, Cpu> {
    live.hosts
        .iter()
        .filter_map(|h| {
            let o = then.hosts.iter().find(|o| o.host == h.host)?;
            let allowance = h.cpu_allowance.max(0.01);
            let ran = h.cpu_ns.saturating_sub(o.cpu_ns) as f64;
            let used = ran / 1e9 / dt / allowance;
            let wait = h.cpu_wait_ns.saturating_sub(o.cpu_wait_ns) as f64;
            let waited = if ran + wait > 0.0 {
                wait / (ran + wait)
            } else {
                0.0
            };
            Some((
                h.host.clone(),
                Cpu {
                    used,
                    allowance,
                    waited,
                },
            ))
        })
        .collect()
}

/// What holds the last stage when it is blocked itself: nothing after the builders when
/// recording is off (they are CPU-bound); else the disk if the recorder spent most of the
/// interval in write and sync calls or held by the disk (throttle, free-space watermark); else
/// a blocking monitor station if it spent most of it offering events to the monitor; else its
/// own CPU when its process used nearly all it may.
fn after_last(live: &Live, then: &Live, dt: f64, cpu: &BTreeMap<Option<String>, Cpu>) -> Hold {
    let hold = |cause, words: String| Hold { cause, words };
    let Some(rec) = &live.recorder else {
        return hold(
            "cpu",
            "CPU-bound: its buffers are full and nothing after it holds it".into(),
        );
    };
    if rec.disk_low || rec.disk_full {
        return hold(
            "disk",
            "held by the disk: below its free-space watermark".into(),
        );
    }
    let old = then.recorder.as_ref();
    let at_disk = frac(
        rec.write_ns + rec.throttled_ns,
        old.map_or(rec.write_ns + rec.throttled_ns, |o| {
            o.write_ns + o.throttled_ns
        }),
        dt,
        1,
    );
    let at_monitor = frac(
        rec.monitor_ns,
        old.map_or(rec.monitor_ns, |o| o.monitor_ns),
        dt,
        1,
    );
    if at_disk > 0.5 {
        hold(
            "disk",
            format!(
                "held by the disk: in write and sync calls or throttled {:.0}% of the time",
                at_disk * 100.0
            ),
        )
    } else if at_monitor > 0.5 {
        hold(
            "monitor",
            format!(
                "held by a blocking monitor station: waiting for its consumers {:.0}% of the time",
                at_monitor * 100.0
            ),
        )
    } else if let Some(c) = cpu.get(&rec.host).filter(|c| c.bound()) {
        hold("cpu", c.words())
    } else {
        hold(
            "unknown",
            format!(
                "not held by the disk ({:.0}% of the time in write calls), the monitor ({:.0}%) or its CPU",
                at_disk * 100.0,
                at_monitor * 100.0
            ),
        )
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
            cpu: None,
            unsent: None,
            unread: None,
        }
    }
}

/// The first stage that is not blocked after one that is; the last stage if every stage is
/// blocked (it waits on what is after it: the disk, or a blocking monitor station). A stage is
/// blocked when it is on any host; over hosts the bottleneck names the stage's most loaded host
/// (fullest buffers or longest unable to read), or its blocked one.
pub fn bottleneck(stages: &[StageView]) -> String {
    named(
        stages,
        &Hold {
            cause: "unknown",
            words: "held by what comes after it: disk or a blocking monitor station".into(),
        },
    )
    .0
}

/// [`bottleneck`] in words and as a key to count, with what holds the last stage when it is
/// blocked itself said by the caller, which knows (the recorder's time in write calls and at
/// the monitor, its CPU, or no recorder at all). A stage named whose process is CPU-bound says
/// so: that is what a profiler would name.
pub fn named(stages: &[StageView], hold: &Hold) -> (String, String) {
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
    let at = |name: &str| -> (String, Option<Cpu>) {
        let worst = stages.iter().filter(|s| s.stage == name).max_by(|a, b| {
            let key = |s: &StageView| ((s.condition == "blocked") as u8, s.load);
            key(a)
                .partial_cmp(&key(b))
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        let cpu = worst.and_then(|s| s.cpu);
        match worst.and_then(|s| s.host.as_deref()) {
            Some(h) => (format!("{name} on {h}"), cpu),
            None => (name.to_string(), cpu),
        }
    };
    // A blocked stage whose own process is starved of CPU, clearly more than the next stage's,
    // is held by its CPU rather than by the next stage: buffers fill where a stage reads faster
    // than its own starved sending side empties them.
    let starved_more = |i: usize| -> bool {
        let (_, a) = at(order[i]);
        let (_, b) = at(order[i + 1]);
        match (a, b) {
            // Either near the end of its own allowance (a quota, or a small host): the one
            // nearer it is the starved one. Measured over a sampling interval, the use of a
            // quota swings with the quota's periods, hence the margin below CPU_BOUND.
            (Some(a), Some(b)) if a.used.max(b.used) > NEAR_ALLOWANCE => {
                a.bound() && a.used > b.used + STARVED_MORE
            }
            // Neither: the one whose threads waited for a core clearly more.
            (Some(a), Some(b)) => a.waited > CPU_WAITED && a.waited > b.waited + STARVED_MORE,
            (Some(a), None) => a.bound(),
            _ => false,
        }
    };
    // Between a blocked stage and the next: bytes the blocked one has written wait in its send
    // queues while the next one's receive queues hold little: neither end is what is slow, the
    // network between them is (a link narrower than both ends' CPUs). Not when either end
    // uses most of its CPU allowance, as a slow link would leave both idle instead: a reader
    // starved by its quota leaves its receive windows small, so little waits unread while the
    // sends pile up (a builder held to a fifth of a core was named "network" in half the
    // samples of its drill); a sender throttled inside a send call holds its socket, so the
    // acknowledgements that would let the kernel send what is queued wait for it.
    let network = |i: usize| -> Option<(u64, u64)> {
        let near = |name: &str| at(name).1.is_some_and(|c| c.used > NEAR_ALLOWANCE);
        if near(order[i]) || near(order[i + 1]) {
            return None;
        }
        let sent: u64 = stages
            .iter()
            .filter(|s| s.stage == order[i] && s.condition == "blocked")
            .filter_map(|s| s.unsent)
            .sum();
        let mut unread = 0u64;
        for s in stages.iter().filter(|s| s.stage == order[i + 1]) {
            unread += s.unread?;
        }
        (sent >= NETWORK_QUEUED && unread.saturating_mul(NETWORK_RATIO) < sent)
            .then_some((sent, unread))
    };
    match order.iter().rposition(|s| blocked(s)) {
        None => (
            "none: the sources' trigger rate sets the pace".into(),
            "none".into(),
        ),
        Some(i) if i + 1 < order.len() && network(i).is_some() => {
            let (sent, unread) = network(i).unwrap_or_default();
            let (from, _) = at(order[i]);
            let key = format!("network from {from} to {}", order[i + 1]);
            (
                format!(
                    "{key} ({} waits in the send queues of the {} blocked, {} in the receive queues of the {}: the link carries less than both ends can move)",
                    bytes(sent),
                    order[i],
                    bytes(unread),
                    order[i + 1]
                ),
                key,
            )
        }
        Some(i) if i + 1 < order.len() && order[i] != "sources" && starved_more(i) => {
            let (name, c) = at(order[i]);
            let words = c.map(|c| c.words()).unwrap_or_default();
            (format!("{name} ({words})"), format!("{name} (cpu)"))
        }
        // The last stage, not blocked by its own buffers' measure, but measured waiting on
        // what comes after it (the disk, a blocking monitor station) most of the interval: that
        // is what holds it, whatever its host's CPU says (a recorder held by a station on a host
        // loaded by others was named "recorder (cpu)").
        Some(i) if i + 2 == order.len() && matches!(hold.cause, "disk" | "monitor") => {
            let (name, _) = at(order[i + 1]);
            (
                format!("{name} ({})", hold.words),
                format!("{name} ({})", hold.cause),
            )
        }
        Some(i) if i + 1 < order.len() => match at(order[i + 1]) {
            (name, Some(c)) if c.bound() => {
                (format!("{name} ({})", c.words()), format!("{name} (cpu)"))
            }
            (name, _) => (name.clone(), name),
        },
        Some(i) => {
            let (name, _) = at(order[i]);
            (
                format!("{name} ({})", hold.words),
                format!("{name} ({})", hold.cause),
            )
        }
    }
}

/// Bytes waiting in a blocked stage's send queues below which no network is blamed (a few TCP
/// windows' worth is normal on any link), and how many times what waits unread on the other
/// side they must be: a slow reader has its receive queues full as well.
const NETWORK_QUEUED: u64 = 256 << 10;
const NETWORK_RATIO: u64 = 4;

fn bytes(n: u64) -> String {
    if n >= 1 << 20 {
        format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64)
    } else {
        format!("{:.0} KiB", n as f64 / 1024.0)
    }
}

/// Dead time above this, in an interval where no stage is blocked, is named on the sources.
const DEAD_UNBLOCKED: f64 = 0.05;

/// Triggers vetoed while no stage is blocked: the front-ends fell behind their triggers with
/// their links taking all they sent, so what they lacked is their own CPU (emulated front-ends
/// share the host's cores with the stages). Saying "none" there would hide the dead time.
fn vetoed_unblocked(named: (String, String), dead_time_fraction: f64) -> (String, String) {
    if named.1 == "none" && dead_time_fraction > DEAD_UNBLOCKED {
        (
            format!(
                "sources: the front-ends fall behind their triggers with no back-pressure ({:.0}% dead time; their CPU)",
                dead_time_fraction * 100.0
            ),
            "sources (cpu)".into(),
        )
    } else {
        named
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_time_with_nothing_blocked_is_named_on_the_sources() {
        let none = || ("none: x".to_string(), "none".to_string());
        assert_eq!(vetoed_unblocked(none(), 0.3).1, "sources (cpu)");
        assert_eq!(vetoed_unblocked(none(), 0.01).1, "none");
        let b = ("builders".to_string(), "builders".to_string());
        assert_eq!(vetoed_unblocked(b.clone(), 0.5), b);
    }

    fn s(stage: &'static str, condition: &'static str) -> StageView {
        StageView::new(stage, None, condition, String::new(), 0.0)
    }

    fn on(stage: &'static str, host: &str, condition: &'static str, load: f64) -> StageView {
        StageView::new(stage, Some(host.into()), condition, String::new(), load)
    }

    /// A recorder measured waiting on a blocking monitor station (or on its disk) most of the
    /// interval is held by that, even when its buffers do not say blocked and its process
    /// waited for a core (a host loaded by others): not "recorder (cpu)".
    #[test]
    fn a_recorder_waiting_on_the_monitor_is_held_by_it_whatever_its_cpu() {
        let starved = Cpu {
            used: 0.3,
            allowance: 2.0,
            waited: 0.8,
        };
        let mut rec = s("recorder", "busy");
        rec.cpu = Some(starved);
        let v = [
            s("sources", "blocked"),
            s("readout", "blocked"),
            s("builders", "blocked"),
            rec,
        ];
        let by = |cause: &'static str| Hold {
            cause,
            words: format!("held by {cause}"),
        };
        assert_eq!(named(&v, &by("monitor")).1, "recorder (monitor)");
        assert_eq!(named(&v, &by("disk")).1, "recorder (disk)");
        // Not measured waiting on either: its CPU, as before.
        assert_eq!(named(&v, &by("unknown")).1, "recorder (cpu)");
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
    fn a_full_send_queue_before_empty_receive_queues_names_the_network() {
        let with = |unsent: u64, unread: u64, cpu_bound: bool| {
            let mut ru = on("readout", "ru1", "blocked", 0.99);
            ru.unsent = Some(unsent);
            let mut bu = on("builders", "bu1", "busy", 0.02);
            bu.unread = Some(unread);
            // Hosts sharing a machine's cores: the builder's threads wait for one.
            bu.cpu = cpu_bound.then_some(Cpu {
                used: 0.05,
                allowance: 2.0,
                waited: 0.8,
            });
            named(
                &[on("sources", "ru1", "blocked", 0.9), ru, bu],
                &Hold {
                    cause: "unknown",
                    words: String::new(),
                },
            )
        };
        // 4 MiB waiting to go out, 40 KiB waiting to be read: the link.
        let (words, key) = with(4 << 20, 40 << 10, true);
        assert_eq!(key, "network from readout on ru1 to builders");
        assert!(words.contains("4.0 MiB"), "{words}");
        // The builder's receive queues as full as the sends: the builder is slow to read.
        assert_eq!(with(4 << 20, 3 << 20, true).1, "builders on bu1 (cpu)");
        assert_eq!(with(4 << 20, 3 << 20, false).1, "builders on bu1");
        // 4 MiB unsent and 40 KiB unread, the unit's and the builder's CPU use of their
        // allowances given.
        let quota = |ru_cpu: Cpu, bu_cpu: Cpu| {
            let mut ru = on("readout", "ru1", "blocked", 0.99);
            ru.unsent = Some(4 << 20);
            ru.cpu = Some(ru_cpu);
            let mut bu = on("builders", "bu1", "busy", 0.02);
            bu.unread = Some(40 << 10);
            bu.cpu = Some(bu_cpu);
            let hold = Hold {
                cause: "unknown",
                words: String::new(),
            };
            named(&[ru, bu], &hold).1
        };
        let (starved, idle) = (
            Cpu {
                used: 0.95,
                allowance: 0.2,
                waited: 0.0,
            },
            Cpu {
                used: 0.1,
                allowance: 2.0,
                waited: 0.0,
            },
        );
        // Little unread because the builder uses all the CPU it may, not because of the link.
        assert_eq!(quota(idle, starved), "builders on bu1 (cpu)");
        // Much unsent because the readout unit uses all the CPU it may: a sender throttled
        // inside a send call holds its socket, so the acknowledgements that would let the
        // kernel send more wait for it (a starved unit was named "network" in two samples of
        // its drill in nine).
        assert_eq!(quota(starved, idle), "readout on ru1 (cpu)");
        // Neither near its allowance: the link.
        assert_eq!(quota(idle, idle), "network from readout on ru1 to builders");
        // A few windows' worth in flight is any link's normal state.
        assert_eq!(with(100 << 10, 0, false).1, "builders on bu1");
        // No receive queues measured (request mode): no judgement of the network.
        let mut ru = on("readout", "ru1", "blocked", 0.99);
        ru.unsent = Some(4 << 20);
        let v = [ru, on("builders", "bu1", "busy", 0.02)];
        assert_eq!(bottleneck(&v), "builders on bu1");
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
        let none = BTreeMap::new();
        let (words, key) = named(&v, &after_last(&live, &live, 1.0, &none));
        assert_eq!(
            words,
            "builders (CPU-bound: its buffers are full and nothing after it holds it)"
        );
        assert_eq!(key, "builders (cpu)");
        // A recorder in write calls (or throttled) most of the interval is held by its disk; one
        // offering events to a blocking monitor station, by the monitor; one doing neither on a
        // process that used all its CPU, by its CPU; else by nothing measured, and it says so.
        let mut then = tessera_run::live::Live::empty(1);
        then.recorder = Some(Default::default());
        let mut now = then.clone();
        let hold = |now: &Live, then: &Live, cpu: &BTreeMap<Option<String>, Cpu>| {
            after_last(now, then, 1.0, cpu)
        };
        now.recorder.as_mut().unwrap().write_ns = 800_000_000;
        assert_eq!(hold(&now, &then, &none).cause, "disk");
        now.recorder.as_mut().unwrap().write_ns = 100_000_000;
        now.recorder.as_mut().unwrap().throttled_ns = 700_000_000;
        assert_eq!(hold(&now, &then, &none).cause, "disk");
        now.recorder.as_mut().unwrap().throttled_ns = 0;
        now.recorder.as_mut().unwrap().monitor_ns = 900_000_000;
        let h = hold(&now, &then, &none);
        assert_eq!(h.cause, "monitor");
        assert!(
            h.words.starts_with("held by a blocking monitor station"),
            "{}",
            h.words
        );
        now.recorder.as_mut().unwrap().monitor_ns = 0;
        let busy = BTreeMap::from([(
            None,
            Cpu {
                used: 0.97,
                allowance: 2.0,
                waited: 0.1,
            },
        )]);
        let h = hold(&now, &then, &busy);
        assert_eq!(h.cause, "cpu");
        assert_eq!(
            h.words,
            "CPU-bound: its process used 97% of the 2 cores it may use"
        );
        let h = hold(&now, &then, &none);
        assert_eq!(h.cause, "unknown");
        assert!(h.words.starts_with("not held by the disk"), "{}", h.words);
    }

    /// A stage named after a blocked one whose process used nearly all its CPU is named
    /// CPU-bound; the same stage on a host with CPU to spare is named alone.
    #[test]
    fn a_named_stage_on_a_saturated_host_is_named_cpu_bound() {
        let mut v = [
            on("sources", "fe1", "blocked", 0.9),
            on("readout", "fe1", "busy", 0.1),
            on("builders", "bu", "busy", 0.2),
        ];
        v[1].cpu = Some(Cpu {
            used: 0.99,
            allowance: 0.2,
            waited: 0.0,
        });
        let (words, key) = named(
            &v,
            &Hold {
                cause: "unknown",
                words: String::new(),
            },
        );
        assert_eq!(
            words,
            "readout on fe1 (CPU-bound: its process used 99% of the 0.2 cores it may use)"
        );
        assert_eq!(key, "readout on fe1 (cpu)");
        v[1].cpu.as_mut().unwrap().used = 0.3;
        let (words, key) = named(
            &v,
            &Hold {
                cause: "unknown",
                words: String::new(),
            },
        );
        assert_eq!(
            (words.as_str(), key.as_str()),
            ("readout on fe1", "readout on fe1")
        );
    }
}

//! What a running session looks like now: raw counters (monotonic, for rates and Prometheus)
//! and gauges (buffers, states) of every component, and the answer to "why is event N
//! incomplete". Read from the components' own atomics: taking one costs no data-path time.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;

use crate::Session;

/// The recorder's histograms, as the live view and the report carry them.
pub use tessera_recorder::histograms::{Histogram, Histograms};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LiveSource {
    pub id: u32,
    /// `emulated` or `external`.
    pub kind: String,
    pub readout_unit: u32,
    /// Fragments and bytes the source put on the wire (emulated sources only: an external one
    /// is seen at its readout link).
    pub fragments_sent: Option<u64>,
    pub bytes_sent: Option<u64>,
    /// Nanoseconds held by back-pressure (dead time; emulated sources only).
    pub held_ns: Option<u64>,
    /// Fragments its readout link read (good or rejected at the wire).
    pub received: u64,
    pub rejected: BTreeMap<String, u64>,
    pub link_state: String,
    /// Event ID of the link's last good fragment (`None`: none yet).
    pub last_event_id: Option<u64>,
    /// Bytes skipped while resynchronising after bad data, and bytes sent after the end of
    /// stream: neither is a fragment.
    pub skipped_bytes: u64,
    pub bytes_after_end: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LiveReadout {
    pub id: u32,
    /// The host it runs on (`[hosts]`; none in a run in one process).
    #[serde(default)]
    pub host: Option<String>,
    pub super_fragments: u64,
    pub fragments_forwarded: u64,
    pub bytes_forwarded: u64,
    pub buffer_used: u64,
    pub buffer_limit: u64,
    /// Nanoseconds links spent unable to read for lack of buffer, summed over links.
    pub busy_ns: u64,
    pub links: usize,
    /// BUSY asserted now (a link out of buffer, or throttled by the event manager).
    pub busy: bool,
    pub pending_events: u64,
    /// Bytes written to builders and not yet taken by the network: the kernel's send queues of
    /// its links, as last sampled (push mode).
    #[serde(default)]
    pub send_queued: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LiveHistogram {
    /// (upper bound in seconds, cumulative count); the last bound is +Inf (serialised as null).
    pub buckets: Vec<(Option<f64>, u64)>,
    pub sum_s: f64,
    pub count: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LiveBuilder {
    pub id: u16,
    #[serde(default)]
    pub host: Option<String>,
    pub events_complete: u64,
    pub events_incomplete: u64,
    pub events_rejected: u64,
    pub bytes_built: u64,
    pub buffer_used: u64,
    pub buffer_limit: u64,
    pub busy_ns: u64,
    pub links: usize,
    pub pending_events: u64,
    /// Fragments of built events not yet handed to the recorder.
    pub queued_fragments: u64,
    /// From an event's first part at the builder to its build.
    pub latency: LiveHistogram,
    /// Bytes arrived from readout units and not yet read: the kernel's receive queues of its
    /// links, as last sampled (push mode).
    #[serde(default)]
    pub receive_queued: u64,
    /// Incomplete events let go to end a stand-still (every link held for memory by events
    /// waiting on each other for a whole event timeout).
    #[serde(default)]
    pub stall_releases: u64,
    /// Request mode: events built without a readout unit that answered later requests of the
    /// same sources but never theirs (request-protocol §4.3, rule 4).
    #[serde(default)]
    pub overdue_requests: u64,
    /// Fragments it dropped, by the accounting's reason (`late_at_builder`,
    /// `duplicate_at_builder`, `malformed_super_fragment`, `recorder_link_lost`): every reason,
    /// at 0 until its first drop.
    #[serde(default)]
    pub dropped: BTreeMap<String, u64>,
    /// Events it built without each source, by source ID (the sources named missing in its
    /// incomplete events): what an operator reads to find the source at fault.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub missing_by_source: BTreeMap<u32, u64>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LiveRecorder {
    #[serde(default)]
    pub host: Option<String>,
    pub events: u64,
    pub incomplete_events: u64,
    pub record_bytes: u64,
    pub file_bytes: u64,
    pub files: u64,
    pub buffer_used: u64,
    pub buffer_limit: u64,
    pub busy_ns: u64,
    pub links: usize,
    pub write_ns: u64,
    /// Nanoseconds the writer was held by the disk beyond its calls: the configured throttle,
    /// or pauses below the free-space watermark.
    #[serde(default)]
    pub throttled_ns: u64,
    /// Nanoseconds spent offering events to the monitor: waits at full blocking stations.
    #[serde(default)]
    pub monitor_ns: u64,
    pub queued_fragments: u64,
    /// Fragments in second copies of events it dropped (request mode, after a failover).
    #[serde(default)]
    pub second_copy_fragments: u64,
    pub error: Option<String>,
    /// Free bytes on the output file system at the recorder's last look.
    pub disk_free: u64,
    /// Below the soft watermark (writes slowed) / below the hard one (the run stops).
    pub disk_low: bool,
    pub disk_full: bool,
    /// The file being written now (`.part`), with the events and bytes of its whole blocks.
    pub current_file: Option<tessera_recorder::CurrentFile>,
    /// The run's histograms so far (`[histograms]`): served at `/api/histograms`, left out of
    /// `/api/live`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub histograms: Option<tessera_recorder::histograms::Histograms>,
}

pub use tessera_shipper::ShipperStatus;

/// A snapshot of every component's counters.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Live {
    pub run_number: u64,
    pub elapsed_s: f64,
    pub mode: String,
    pub paused: bool,
    /// The emulated sources' trigger counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger: Option<LiveTrigger>,
    pub sources: Vec<LiveSource>,
    pub readout_units: Vec<LiveReadout>,
    pub builders: Vec<LiveBuilder>,
    pub recorder: Option<LiveRecorder>,
    pub components: Vec<crate::Component>,
    /// The shipper of the recorder's data directory, where one is configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shipper: Option<tessera_shipper::ShipperStatus>,
    /// Each process's CPU: one entry in a run in one process, one per host over hosts.
    #[serde(default)]
    pub hosts: Vec<LiveHost>,
}

/// The trigger's counters (monotonic).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LiveTrigger {
    pub policy: String,
    pub offered: u64,
    pub accepted: u64,
    pub vetoed: u64,
}

/// The CPU one process of the run (the whole run, or one host's agent) has used and may use.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LiveHost {
    /// `None` in a run in one process.
    pub host: Option<String>,
    /// CPU time of every thread of the process, nanoseconds (monotonic).
    pub cpu_ns: u64,
    /// Time its live threads spent ready to run and waiting for a core, nanoseconds (falls when
    /// a thread that waited ends).
    #[serde(default)]
    pub cpu_wait_ns: u64,
    /// Cores it may use now (CPUs, or its control group's quota).
    pub cpu_allowance: f64,
    /// Resident memory of the process now (`VmRSS`), bytes.
    #[serde(default)]
    pub rss_bytes: u64,
    /// Seconds since the process started (an agent outlives its runs).
    #[serde(default)]
    pub uptime_s: f64,
    /// The process ID, for whoever looks at the host itself.
    #[serde(default)]
    pub pid: u32,
}

impl LiveHost {
    /// This process, now.
    pub fn here(host: Option<String>) -> LiveHost {
        LiveHost {
            host,
            cpu_ns: tessera_net::role::process_cpu_ns(),
            cpu_wait_ns: tessera_net::role::process_cpu_wait_ns(),
            cpu_allowance: tessera_net::role::cpu_allowance(),
            rss_bytes: process_rss_bytes().unwrap_or(0),
            uptime_s: process_uptime_s().unwrap_or(0.0),
            pid: std::process::id(),
        }
    }
}

/// `VmRSS` of this process (Linux `/proc/self/status`).
fn process_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// Seconds since this process started: its start in clock ticks after boot
/// (`/proc/self/stat`, field 22) against the time since boot (`/proc/uptime`).
fn process_uptime_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) may hold spaces: fields are counted after its ')'.
    let after = &stat[stat.rfind(')')? + 1..];
    let start_ticks: f64 = after.split_whitespace().nth(19)?.parse().ok()?;
    // SAFETY: sysconf reads a constant of the system; no memory is passed.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let boot_s: f64 = std::fs::read_to_string("/proc/uptime")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    (hz > 0).then(|| (boot_s - start_ticks / hz as f64).max(0.0))
}

impl Live {
    /// A view with nothing in it yet, for roles to add their entries to.
    pub fn empty(run_number: u64) -> Live {
        Live {
            run_number,
            elapsed_s: 0.0,
            mode: "push".into(),
            paused: false,
            trigger: None,
            sources: Vec::new(),
            readout_units: Vec::new(),
            builders: Vec::new(),
            recorder: None,
            components: Vec::new(),
            shipper: None,
            hosts: Vec::new(),
        }
    }

    /// The view of a run spread over hosts, from every host's own: a source's sending side
    /// from the host that runs it, its link from the host of its readout unit.
    pub fn combine(run_number: u64, elapsed_s: f64, paused: bool, parts: Vec<Live>) -> Live {
        let mut out = Live {
            run_number,
            elapsed_s,
            mode: parts.first().map_or("push".into(), |p| p.mode.clone()),
            paused,
            trigger: None,
            sources: Vec::new(),
            readout_units: Vec::new(),
            builders: Vec::new(),
            recorder: None,
            components: Vec::new(),
            shipper: None,
            hosts: Vec::new(),
        };
        let mut remote: BTreeMap<u32, LiveSource> = BTreeMap::new();
        for p in parts {
            for s in p.sources {
                if s.link_state == crate::report::REMOTE {
                    remote.insert(s.id, s);
                } else {
                    out.sources.push(s);
                }
            }
            out.readout_units.extend(p.readout_units);
            out.builders.extend(p.builders);
            out.recorder = out.recorder.or(p.recorder);
            out.shipper = out.shipper.or(p.shipper);
            out.components.extend(p.components);
            out.hosts.extend(p.hosts);
            out.trigger = match (out.trigger.take(), p.trigger) {
                (Some(a), Some(b)) => Some(LiveTrigger {
                    policy: a.policy,
                    offered: a.offered.max(b.offered),
                    accepted: a.accepted.max(b.accepted),
                    vetoed: a.vetoed + b.vetoed,
                }),
                (a, b) => a.or(b),
            };
        }
        for s in &mut out.sources {
            if let Some(x) = remote.remove(&s.id) {
                s.kind = x.kind;
                s.fragments_sent = x.fragments_sent;
                s.bytes_sent = x.bytes_sent;
                s.held_ns = x.held_ns;
            }
        }
        out.sources.extend(remote.into_values());
        out.sources.sort_by_key(|s| s.id);
        out.readout_units.sort_by_key(|u| u.id);
        out.builders.sort_by_key(|b| b.id);
        out
    }
}

/// The answer to "why is event N incomplete".
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WhyIncomplete {
    pub event_id: u64,
    /// `incomplete` (built without `missing`), `complete` (built with every source, as far as
    /// the builders remember), `pending` (not built yet: `missing` are the sources whose links
    /// have not reached it), `forgotten` (older than what the builders remember).
    pub status: String,
    pub builder: Option<u16>,
    pub missing: Vec<u32>,
    /// Every source's link, the missing ones first.
    pub links: Vec<LinkView>,
    pub explanation: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LinkView {
    pub source: u32,
    pub readout_unit: u32,
    pub missing: bool,
    pub link_state: String,
    pub last_event_id: Option<u64>,
    pub rejected: BTreeMap<String, u64>,
}

pub(crate) fn histogram(h: &tessera_builder::stats::Histogram) -> LiveHistogram {
    let (b, sum_s, count) = h.snapshot();
    LiveHistogram {
        buckets: b
            .into_iter()
            .map(|(le, n)| (le.is_finite().then_some(le), n))
            .collect(),
        sum_s,
        count,
    }
}

impl Session {
    /// Every component's counters now: each role's own entries (a source's link from its
    /// readout unit, its sending side from the sources), joined as a run over hosts joins its
    /// hosts' views.
    pub fn live(&self) -> Live {
        let r = &self.r;
        let mut part = Live::empty(self.run_number);
        for role in self.running.roles() {
            role.live(r, &mut part);
        }
        part.mode = match r.topology.run.mode {
            tessera_config::Mode::Push => "push",
            tessera_config::Mode::Request => "request",
        }
        .into();
        let mut live = Live::combine(
            self.run_number,
            self.t0.elapsed().as_secs_f64(),
            self.paused_at.lock().is_some(),
            vec![part],
        );
        live.components = self.components();
        live.shipper = self.shipper.as_ref().map(|s| s.status());
        live.hosts = vec![LiveHost::here(None)];
        live
    }

    /// Fragments sent by this process's emulated sources and event bytes built by its builders:
    /// what a benchmark watches many times a second, read without building the whole view
    /// (which at 76 roles and 1 920 links is a cost of its own, and asks every link to sample
    /// its kernel queues).
    pub fn sent_and_built(&self) -> (u64, u64) {
        let run = &self.running;
        let sent = run.sources.as_ref().map_or(0, |s| {
            s.stats.iter().map(|e| e.fragments.load(Relaxed)).sum()
        });
        let built = run
            .builders
            .iter()
            .map(|b| b.stats.bytes_built.load(Relaxed))
            .sum();
        (sent, built)
    }

    /// Events the builders have built so far (complete and incomplete), read as cheaply as
    /// [`Self::sent_and_built`]: for a benchmark that measures part of a run by what the DAQ
    /// did, not by what the sources sent (at saturation they can send a whole short run into
    /// the kernel's socket buffers before the readout units have read much of it).
    pub fn events_built(&self) -> u64 {
        self.running
            .builders
            .iter()
            .map(|b| {
                b.stats.events_complete.load(Relaxed) + b.stats.events_incomplete.load(Relaxed)
            })
            .sum()
    }

    /// Which sources are missing for event `event_id`, and the state of their links.
    pub fn why_incomplete(&self, event_id: u64) -> WhyIncomplete {
        let run = &self.running;
        let mut found = None;
        let mut forgotten = false;
        let mut highest_built = None::<u64>;
        for b in &run.builders {
            let built = b.stats.events_complete.load(Relaxed)
                + b.stats.events_incomplete.load(Relaxed)
                + b.stats.events_rejected.load(Relaxed);
            if built > 0 {
                let last = b.stats.last_event.load(Relaxed);
                highest_built = Some(highest_built.map_or(last, |h| h.max(last)));
            }
            let recent = b.stats.recent_incomplete.lock();
            if let Some(m) = recent.get(event_id) {
                found = Some((b.stats.id, m.to_vec()));
                break;
            }
            if recent.forgotten_up_to > 0 && event_id <= recent.forgotten_up_to {
                forgotten = true;
            }
        }
        let all_links = || {
            run.readout_units
                .iter()
                .flat_map(|u| u.stats.links.iter().map(move |l| (u.stats.id, l)))
        };
        let (status, builder, missing, explanation) = match found {
            Some((b, m)) => (
                "incomplete",
                Some(b),
                m.clone(),
                format!(
                    "built by builder {b} without source(s) {}: their fragments had not come when the event timed out, or were rejected",
                    join(&m)
                ),
            ),
            None if highest_built.is_none_or(|h| event_id > h) => {
                let behind: Vec<u32> = all_links()
                    .filter(|(_, l)| {
                        l.fragments.load(Relaxed) == 0 || l.last_event.load(Relaxed) < event_id
                    })
                    .map(|(_, l)| l.source_id)
                    .collect();
                let explanation = if behind.is_empty() {
                    "not built yet; every link has reached it, it is on its way".to_string()
                } else {
                    format!(
                        "not built yet; waiting for source(s) {} whose links have not reached it",
                        join(&behind)
                    )
                };
                ("pending", None, behind, explanation)
            }
            None if forgotten => (
                "forgotten",
                None,
                Vec::new(),
                format!(
                    "older than the {} most recent incomplete events each builder remembers; the recorded file says (tessera dump --from {event_id})",
                    tessera_builder::stats::RecentIncomplete::CAPACITY
                ),
            ),
            None => (
                "complete",
                None,
                Vec::new(),
                "no builder built it incomplete: it is complete (or was rejected by the filter)"
                    .to_string(),
            ),
        };
        let mut links: Vec<LinkView> = all_links()
            .map(|(ru, l)| {
                let rejected = l.rejected_by_reason();
                LinkView {
                    source: l.source_id,
                    readout_unit: ru,
                    missing: missing.contains(&l.source_id),
                    link_state: l.state().label().to_string(),
                    last_event_id: (l.fragments.load(Relaxed) > 0)
                        .then(|| l.last_event.load(Relaxed)),
                    rejected,
                }
            })
            .collect();
        links.sort_by_key(|l| (!l.missing, l.source));
        WhyIncomplete {
            event_id,
            status: status.into(),
            builder,
            missing,
            links,
            explanation,
        }
    }
}

fn join(v: &[u32]) -> String {
    v.iter()
        .map(|s| s.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Dead time as one figure for the whole system. With a veto (`veto` = triggers offered and
/// vetoed), the fraction of triggers lost because a front-end was BUSY: what dead time means
/// for a triggered system (a source held while its derandomizer absorbs the wait loses nothing).
/// Without one (queued or unpaced triggers: none is lost, they are sent late), the fraction of
/// the time the most-held emulated source spent held by back-pressure, unable to send: the
/// front-end that would raise BUSY. The one rule the status line, the dashboard, `/metrics` and
/// the run report use, over an interval or over the run.
pub fn dead_time_fraction(veto: Option<(u64, u64)>, held: impl IntoIterator<Item = f64>) -> f64 {
    match veto {
        Some((offered, vetoed)) if offered > 0 => vetoed.min(offered) as f64 / offered as f64,
        Some(_) => 0.0,
        None => held
            .into_iter()
            .filter(|f| f.is_finite())
            .fold(0.0, f64::max)
            .clamp(0.0, 1.0),
    }
}

impl Live {
    /// The run's dead time so far ([`dead_time_fraction`] over the whole run).
    pub fn dead_time_fraction(&self) -> f64 {
        let secs = self.elapsed_s;
        dead_time_fraction(
            self.trigger
                .as_ref()
                .filter(|t| t.policy == "veto")
                .map(|t| (t.offered, t.vetoed)),
            self.sources.iter().filter_map(|s| {
                let h = s.held_ns? as f64 / 1e9;
                (secs > 0.0).then(|| h / secs)
            }),
        )
    }
}

#[cfg(test)]
mod dead_time_tests {
    use super::dead_time_fraction;

    #[test]
    fn this_process_has_resident_memory_and_an_age() {
        let h = super::LiveHost::here(None);
        assert!(h.rss_bytes > 1 << 20, "{}", h.rss_bytes);
        assert!(super::process_uptime_s().is_some());
        assert!(h.uptime_s < 86_400.0, "{}", h.uptime_s);
        assert_eq!(h.pid, std::process::id());
    }

    #[test]
    fn dead_time_is_the_vetoed_fraction_with_a_veto_else_the_most_held_source() {
        assert_eq!(dead_time_fraction(Some((0, 0)), [0.5]), 0.0);
        assert_eq!(dead_time_fraction(Some((100, 25)), [0.9]), 0.25);
        assert_eq!(dead_time_fraction(Some((10, 20)), []), 1.0);
        // Queued triggers: none lost, the sources held 90% of the time by full buffers.
        assert_eq!(dead_time_fraction(None, [0.3, 0.9, 0.5]), 0.9);
        assert_eq!(dead_time_fraction(None, [f64::NAN, 2.0]), 1.0);
        assert_eq!(dead_time_fraction(None, []), 0.0);
    }
}

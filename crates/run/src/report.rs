//! The run report: what every component counted, and the accounting balance
//! `sent = in complete events + in incomplete events + rejected + still buffered`, each term read
//! from the component that holds it. A non-zero `unaccounted` is a defect to investigate, and is
//! reported as such.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::Ordering;

use tessera_config::Resolved;
use tessera_readout::LinkState;
use tessera_recorder::FileInfo;

use crate::Running;

/// The link state of a source counted by the host that runs it, whose readout unit runs
/// elsewhere (its link's side is in that host's report).
pub const REMOTE: &str = "remote";
const REMOTE_DISCONNECTED: &str = "remote_disconnected";

/// Every component's report, before the totals and the balance are taken.
#[derive(Default)]
pub struct Parts {
    trigger: Option<TriggerReport>,
    sources: Vec<SourceReport>,
    readout_units: Vec<ReadoutReport>,
    builders: Vec<BuilderReport>,
    recorder: Option<RecorderReport>,
    event_manager: Option<ManagerReport>,
    refused_outside_allow: u64,
    /// Request mode over hosts: what the readout units sent builders whose report is lost with
    /// their host, less what of it the recorder took from them (`lost_with_builder_host`).
    lost_with_builders: u64,
    /// Over hosts: what the sources of readout units whose report is lost with their host sent,
    /// less what the builders took from those units as first answers
    /// (`lost_with_readout_unit_host`).
    lost_with_readout_units: u64,
    /// Over hosts, request mode: what the builders took from units lost with their host beyond
    /// what those units' sources sent: answers given again, whose count went with the unit.
    answered_again_by_lost_units: u64,
}

/// Request mode over hosts: fragments the readout units sent to builders that gave no report
/// (lost with their host), less those of them the recorder took from those builders. Such a
/// builder's copies, late fragments and queues went with it; the events were given to others,
/// whose answers then count as given again.
fn lost_with_builders(p: &Parts) -> u64 {
    let mut sent: BTreeMap<u32, u64> = BTreeMap::new();
    for (b, n, reported) in answered_by_builder(p) {
        if !reported {
            *sent.entry(b).or_default() += n;
        }
    }
    let taken = |b: u32| {
        p.recorder.as_ref().map_or(0, |r| {
            u16::try_from(b)
                .ok()
                .and_then(|b| r.fragments_by_builder.get(&b).copied())
                .unwrap_or(0)
        })
    };
    sent.into_iter()
        .map(|(b, n)| n.saturating_sub(taken(b)))
        .sum()
}

/// (builder, fragments a unit sent it, whether that builder reported), per unit and builder:
/// the answers of request mode, the super-fragments of push mode.
fn answered_by_builder(p: &Parts) -> impl Iterator<Item = (u32, u64, bool)> + '_ {
    let reported: std::collections::HashSet<u32> = p.builders.iter().map(|b| b.id as u32).collect();
    p.readout_units
        .iter()
        .flat_map(|u| {
            u.requests
                .as_ref()
                .map_or(&u.fragments_forwarded_by_builder, |q| {
                    &q.fragments_sent_by_builder
                })
        })
        .map(move |(&b, &n)| (b, n, reported.contains(&b)))
}

/// Fragments the builders took from readout units that gave no report (lost with their host).
/// A builder has a link to every unit of the topology, so its counts name every unit.
fn taken_from_lost_units(p: &Parts) -> u64 {
    taken_by_lost_unit(p)
        .values()
        .fold(0, |a, &n| a.saturating_add(n))
}

/// [`taken_from_lost_units`] by unit.
fn taken_by_lost_unit(p: &Parts) -> BTreeMap<u32, u64> {
    let reported: std::collections::HashSet<u32> = p.readout_units.iter().map(|u| u.id).collect();
    let mut taken = BTreeMap::new();
    for (&u, &n) in p.builders.iter().flat_map(|b| &b.fragments_by_readout_unit) {
        if !reported.contains(&u) {
            let t: &mut u64 = taken.entry(u).or_default();
            *t = t.saturating_add(n);
        }
    }
    taken
}

/// Request mode over hosts: the answers a unit lost with its host gave again, as far as they
/// can be known without its report. Each of its sources' fragments reached the builders at
/// most once unless it was answered again, so what the builders took from such a unit beyond
/// what its sources sent was answered again. (Fewer may have been: a copy taken while another
/// fragment of the unit was lost with it is indistinguishable here from a first answer, and
/// then `lost_with_readout_unit_host` is that much smaller; the sum is the same.)
/// `sent_by_lost_unit`: what the sources of each such unit sent, for the units whose every
/// source reported; no other unit's answers are inferred.
fn answered_again_by_lost_units(p: &Parts, sent_by_lost_unit: &BTreeMap<u32, u64>) -> u64 {
    taken_by_lost_unit(p)
        .into_iter()
        .filter_map(|(u, taken)| Some(taken.saturating_sub(*sent_by_lost_unit.get(&u)?)))
        .fold(0, u64::saturating_add)
}

/// What every role's part of the report needs besides its own counters.
pub struct Cx<'a> {
    pub(crate) secs: f64,
    pub(crate) request_mode: bool,
    /// The topology's builder IDs, in its order (a readout unit counts by place).
    pub(crate) builder_ids: Vec<u32>,
    /// The emulated sources of this process, by source ID (their sending side).
    pub(crate) emulated: BTreeMap<u32, &'a tessera_source::SourceStats>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RunInfo {
    pub run_number: u64,
    pub started_unix_ns: u64,
    pub duration_s: f64,
    pub stop_reason: String,
    pub drained: bool,
    pub output: String,
    pub partial: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SourceReport {
    pub id: u32,
    pub kind: String,
    /// Fragments the source sent (external: as declared in its end-of-stream, else as received).
    pub sent: u64,
    pub bytes: u64,
    /// Fraction of the run the source spent held by back-pressure.
    pub held_fraction: f64,
    pub link_state: String,
    pub received: u64,
    pub rejected: BTreeMap<String, u64>,
    /// Bytes skipped while resynchronising after bad data (not fragments: the bad fragment that
    /// started the stretch is counted once under its reason).
    pub skipped_bytes: u64,
    /// Bytes sent after the end of stream (a protocol error; not fragments).
    pub bytes_after_end: u64,
    pub error: Option<String>,
    /// Its readout link has ended (cleanly or not): what it received beyond what was sent is
    /// then final.
    #[serde(default)]
    pub link_ended: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReadoutReport {
    pub id: u32,
    pub super_fragments: u64,
    pub incomplete_super_fragments: u64,
    pub fragments_forwarded: u64,
    pub peak_buffer_fraction: f64,
    /// Mean over links of the fraction of the run each link could not read for lack of memory.
    pub busy_fraction: f64,
    pub refused_connections: u64,
    pub error: Option<String>,
    /// Fragments of super-fragments lost with a builder's connection.
    #[serde(default)]
    pub builder_link_lost: u64,
    /// Fragments it still holds (assembling, queued, or stored awaiting a clear).
    #[serde(default)]
    pub buffered_fragments: u64,
    /// Bytes of its buffer taken and touched before its sources sent (`readout.reserve`).
    #[serde(default)]
    pub reserved_bytes: u64,
    /// Push mode: fragments forwarded to each builder, by builder ID.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub fragments_forwarded_by_builder: BTreeMap<u32, u64>,
    /// Request mode only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requests: Option<ReadoutRequestReport>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReadoutRequestReport {
    pub requests: u64,
    pub answers: u64,
    pub partial_answers: u64,
    pub fragments_sent: u64,
    /// Of those, fragments lent to an answer before: copies (an event asked again after a
    /// failover), added to what the sources sent in the balance.
    #[serde(default)]
    pub fragments_answered_again: u64,
    /// `fragments_sent` by builder ID.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub fragments_sent_by_builder: BTreeMap<u32, u64>,
    pub bytes_sent: u64,
    pub descriptor_waits: u64,
    pub clear_messages: u64,
    pub cleared_events: u64,
    pub clears_unknown: u64,
    pub clears_repeated: u64,
    pub announced: u64,
    pub fragments_still_stored: u64,
    pub free_pages: u64,
    pub total_pages: u64,
    pub throttled_s: f64,
    /// The event manager's connection lost before the end (each one waited for a takeover).
    pub manager_losses: u64,
    /// Events announced again to a manager taking the run over.
    pub reannounced: u64,
    pub manager_error: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ManagerReport {
    pub announced: u64,
    pub assigned: u64,
    pub reassigned: u64,
    pub recorded: u64,
    pub rejected_by_filter: u64,
    pub stale_done: u64,
    pub clear_messages: u64,
    pub cleared_events: u64,
    /// Times a readout unit said its pages were full (request-protocol §3.5); each sent the
    /// clears held at once.
    #[serde(default)]
    pub units_full: u64,
    pub dead_builders: u64,
    pub busy_transitions: u64,
    /// Taking a run over from a lost manager: events left with the builder that held them.
    pub adopted: u64,
    /// Taking a run over: events finished under the lost manager, cleared, not built again.
    pub finished_before: u64,
    /// Connections refused: unknown or duplicate builder or readout unit, bad hello.
    pub refused_connections: u64,
    pub in_flight_at_end: usize,
    pub errors: Vec<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BuilderReport {
    pub id: u16,
    pub events_complete: u64,
    pub events_incomplete: u64,
    pub fragments_in_complete: u64,
    pub fragments_in_incomplete: u64,
    pub bytes_built: u64,
    pub late_fragments: u64,
    pub duplicate_fragments: u64,
    pub malformed_fragments: u64,
    pub busy_fraction: f64,
    pub missing_by_source: BTreeMap<u32, u64>,
    pub errors: Vec<String>,
    /// Request mode: events the filter rejected, and events rebuilt after a failover.
    pub events_rejected: u64,
    pub events_rebuilt: u64,
    /// Request mode: the event manager's connection lost before the end (each time the builder
    /// waited for a takeover).
    pub manager_losses: u64,
    /// Fragments of events lost with the recorder's connection.
    #[serde(default)]
    pub recorder_link_lost: u64,
    /// Request mode: links to the recorder opened again after they broke, and the events sent
    /// again on them for want of an acknowledgement (wire format §2.8).
    #[serde(default)]
    pub recorder_relinks: u64,
    #[serde(default)]
    pub events_resent: u64,
    /// Fragments of events the filter rejected.
    #[serde(default)]
    pub fragments_rejected_by_filter: u64,
    /// Fragments it still holds (assembling, or queued for the recorder).
    #[serde(default)]
    pub buffered_fragments: u64,
    /// Of those, built and queued for the recorder.
    #[serde(default)]
    pub queued_fragments: u64,
    /// Push mode with `rails`: super-fragments received on each rail, from every readout unit.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub super_fragments_by_rail: Vec<u64>,
    /// Fragments taken from each readout unit (in super-fragments or answers, copies
    /// included): set against what the sources of a unit lost with its host sent.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub fragments_by_readout_unit: BTreeMap<u32, u64>,
    /// Bytes of its buffer taken and touched before any readout unit sent (`builder.reserve`).
    #[serde(default)]
    pub reserved_bytes: u64,
    /// Of its incomplete events, those let go to end a stand-still: every link held for memory
    /// by open events waiting on each other for a whole event timeout (wire-format §2.3).
    #[serde(default)]
    pub stall_releases: u64,
    /// Request mode: requests a readout unit left unanswered for a whole builder timeout after
    /// it answered a later request of the same sources (request-protocol §4.3, rule 4), each
    /// event built without that unit's sources.
    #[serde(default)]
    pub overdue_requests: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RecorderReport {
    /// Events the recorder received.
    pub events: u64,
    /// The run's histograms (`[histograms]`), kept with the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub histograms: Option<tessera_recorder::histograms::Histograms>,
    /// Events in files that were finished (trailer, fsync, final name): on disk for good.
    pub events_in_files: u64,
    pub incomplete_events: u64,
    pub fragments: u64,
    pub record_bytes: u64,
    pub file_bytes: u64,
    pub throttled_s: f64,
    pub files: Vec<FileInfo>,
    pub error: Option<String>,
    /// Second copies of events dropped (request mode, after a failover).
    pub duplicate_events: u64,
    /// Fragments in those second copies.
    #[serde(default)]
    pub duplicate_fragments: u64,
    /// Fragments taken from each builder's link, first and second copies.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub fragments_by_builder: BTreeMap<u16, u64>,
    /// Events recorded with the rebuilt flag.
    pub rebuilt_events: u64,
    /// Records counted as written to the file (what the recorder acknowledges to builders that
    /// ask: request mode reports an event done only then). With `recorder.durability = "sync"`,
    /// records synced to the disk.
    pub records_written: u64,
    /// Syncs of data files: group commits (`durability = "sync"`) and finished files.
    pub syncs: u64,
    /// Free bytes on the output file system at the end, and whether the disk alarm (below the
    /// soft watermark) was on then.
    pub disk_free_bytes: u64,
    pub disk_alarm: bool,
    /// Fragments in events recorded complete and incomplete.
    #[serde(default)]
    pub fragments_in_complete: u64,
    #[serde(default)]
    pub fragments_in_incomplete: u64,
    /// Fragments received and not yet written.
    #[serde(default)]
    pub queued_fragments: u64,
    /// Events, and their fragments, that the recorder took but could not write because the
    /// output file system was full (`unrecorded_disk_full` in the balance; not in
    /// `fragments_in_complete` and `fragments_in_incomplete`, which count what it holds).
    #[serde(default)]
    pub unrecorded_events: u64,
    #[serde(default)]
    pub unrecorded_fragments: u64,
    /// Files and events an earlier recorder of this run left, taken over at the start (in
    /// the counts above too).
    #[serde(default)]
    pub adopted_files: u64,
    #[serde(default)]
    pub adopted_events: u64,
    /// Records builders sent again on a new link that the files held already: the same record
    /// twice, dropped; not in the balance (their fragments count once, in the files).
    #[serde(default)]
    pub resent_events: u64,
    #[serde(default)]
    pub resent_fragments: u64,
    /// Builder links opened again after they broke.
    #[serde(default)]
    pub relinks: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Balance {
    pub sent: u64,
    pub in_complete_events: u64,
    pub in_incomplete_events: u64,
    pub rejected: BTreeMap<String, u64>,
    pub rejected_total: u64,
    pub still_buffered: u64,
    /// Rejections a link counted beyond what its source sent (received − sent, per ended link):
    /// bytes that were never a fragment (junk, a second hello) but had to be rejected as one,
    /// since a reader cannot tell them from a fragment whose start was damaged. Named so that
    /// the balance says what they were instead of going negative.
    pub rejected_beyond_sent: u64,
    /// Request mode: fragments the readout units lent to an answer a second time (an event
    /// asked again after its builder was declared dead while it still worked, or asked twice).
    /// Each is a copy that a builder then counts like any fragment (in an event, late, ...); the
    /// recorder keeps one copy of each event and names the other (`second_copy_at_recorder`).
    /// Added to what was sent, so that a copy is neither lost nor counted twice.
    #[serde(default)]
    pub answered_again: u64,
    /// The part of `answered_again` inferred, not counted: for a readout unit lost with its
    /// host (its count went with it) whose sources all reported, what the builders took from
    /// it beyond what its sources sent. Named apart because it is the one term of the balance
    /// taken from the others.
    #[serde(default)]
    pub answered_again_inferred: u64,
    /// sent + rejected beyond sent + answered again − (complete + incomplete + rejected +
    /// buffered). Zero when every fragment is accounted for.
    pub unaccounted: i64,
    pub holds: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    pub run_number: u64,
    pub started_unix_ns: u64,
    pub duration_s: f64,
    pub stop_reason: String,
    pub drained: bool,
    pub output: String,
    /// Only some roles ran in this process (`tessera serve`): the balance needs them all.
    pub partial: bool,
    pub config_origin: String,
    pub config_sha256: String,
    pub events_complete: u64,
    pub events_incomplete: u64,
    pub bytes_built: u64,
    pub events_per_s: f64,
    pub built_bytes_per_s: f64,
    /// The emulated sources' trigger: offered, accepted and vetoed (absent without emulated
    /// sources).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger: Option<TriggerReport>,
    /// The run's dead time: with a veto the triggers vetoed, else the most-held source's time
    /// held by back-pressure ([`crate::live::dead_time_fraction`]).
    #[serde(default)]
    pub dead_time_fraction: f64,
    pub sources: Vec<SourceReport>,
    pub readout_units: Vec<ReadoutReport>,
    pub builders: Vec<BuilderReport>,
    pub recorder: Option<RecorderReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_manager: Option<ManagerReport>,
    pub balance: Balance,
    /// Events the builders built that the recorder did not record (0 when the recorder kept up
    /// and was drained).
    pub recorder_shortfall: i64,
    /// Connections to any port of this process refused because their peer's address is outside
    /// `security.allow` (each also logged with the address).
    pub refused_outside_allow: u64,
    /// The monitor's stations and counters at the end of the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub monitor: Option<tessera_monitor::MonitorStatus>,
    /// A run spread over hosts: hosts whose part of the report is missing (agent lost), and
    /// why. Their sources' counts are then missing from the balance, which says so.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts_missing: Vec<String>,
    /// How the stop went, stage by stage (absent while the run goes on).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop: Option<crate::StopReport>,
    /// What the run control named as the bottleneck while the run took data, each name with
    /// the share of that time it was named, most named first (filled by the run control from
    /// its samples; empty for a run shorter than two samples).
    #[serde(default)]
    pub bottlenecks: Vec<BottleneckShare>,
    /// What could not be kept of the run's end (its manifest, its row in the run database),
    /// and why: the run still closes with its summary, which says so (a full disk).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_kept: Vec<String>,
    /// The memory the configuration lets the roles hold, and what the process held at most.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryReport>,
}

/// The run's memory: its bound, stated, and its peak, measured.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct MemoryReport {
    /// What the configuration lets every role hold at most (buffers, queues, blocks, tables
    /// of open events, memories of event IDs: `tessera check` prints it per unit). Not in it:
    /// the program's code, thread stacks and the allocator's slack, a few tens of MiB.
    pub bound_bytes: u64,
    /// The most resident memory the process held (Linux `VmHWM`); over hosts, the largest of
    /// the hosts' processes. 0 where it cannot be read.
    pub peak_resident_bytes: u64,
    /// Taken over hosts (the largest of their processes), not in one process.
    #[serde(default)]
    pub over_hosts: bool,
}

impl MemoryReport {
    /// The bound of `r`'s roles and this process's peak.
    pub fn now(r: &Resolved) -> MemoryReport {
        MemoryReport {
            bound_bytes: crate::check::memory(r).iter().map(|(_, m)| *m).sum(),
            peak_resident_bytes: peak_resident(),
            over_hosts: false,
        }
    }
}

/// This process's peak resident memory (Linux: `VmHWM` of /proc/self/status), 0 elsewhere.
fn peak_resident() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|t| {
            let line = t.lines().find(|l| l.starts_with("VmHWM:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib * 1024)
        })
        .unwrap_or(0)
}

/// The trigger of the emulated sources: every offered trigger is accepted (an event, sent by
/// every source) or vetoed because the system was BUSY.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct TriggerReport {
    /// `veto` (a trigger while BUSY is not taken) or `queue` (every trigger is taken, late).
    pub policy: String,
    pub offered: u64,
    pub accepted: u64,
    pub vetoed: u64,
    /// Vetoed over offered: the fraction of triggers lost to dead time.
    pub dead_time_fraction: f64,
    /// offered = accepted + vetoed.
    pub holds: bool,
    /// Vetoed triggers by the bottleneck the run control named while they were vetoed (the
    /// stage that held the system BUSY; filled by the run control from its samples).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub vetoed_by: BTreeMap<String, u64>,
    /// With a veto: seconds over which triggers were offered (the trigger time of the last
    /// one), the span that offered and accepted rates are counted over; 0 when not known
    /// (queued triggers: the run's duration is the span).
    #[serde(default)]
    pub offered_s: f64,
}

impl TriggerReport {
    pub fn new(policy: &str, offered: u64, accepted: u64, vetoed: u64) -> TriggerReport {
        TriggerReport {
            policy: policy.into(),
            offered,
            accepted,
            vetoed,
            dead_time_fraction: if offered > 0 {
                vetoed as f64 / offered as f64
            } else {
                0.0
            },
            holds: offered == accepted + vetoed,
            vetoed_by: BTreeMap::new(),
            offered_s: 0.0,
        }
    }

    /// Two processes' triggers (sources queued on several hosts), summed.
    fn and(&self, o: &TriggerReport) -> TriggerReport {
        let mut t = TriggerReport::new(
            &self.policy,
            self.offered.max(o.offered),
            self.accepted.max(o.accepted),
            self.vetoed + o.vetoed,
        );
        t.offered_s = self.offered_s.max(o.offered_s);
        t
    }
}

/// One bottleneck name (`recorder (disk)`, `readout on fe1 (cpu)`, `none`, ...) and how long
/// it was named.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct BottleneckShare {
    pub name: String,
    pub seconds: f64,
    /// Of the time sampled while taking data (0..1).
    pub share: f64,
}

/// The mean fraction of the run each of `n` links spent busy, from their summed busy time: the
/// sum is divided by the links before anything is capped (capping the sum at 1 first made a
/// unit of 21 links busy all run read 1/21).
fn frac_per(ns: u64, secs: f64, n: usize) -> f64 {
    if secs > 0.0 {
        (ns as f64 / 1e9 / secs / n.max(1) as f64).min(1.0)
    } else {
        0.0
    }
}

fn frac(ns: u64, secs: f64) -> f64 {
    frac_per(ns, secs, 1)
}

// Each role's part of the report, called through `RunRole::report`.

/// A readout unit's report, and its links' side of each source's.
pub(crate) fn readout(u: &tessera_readout::ReadoutUnit, cx: &Cx, p: &mut Parts) {
    let st = &u.stats;
    for l in &st.links {
        let received = l.received();
        let (kind, sent, bytes, held, error) = match cx.emulated.get(&l.source_id) {
            Some(s) => (
                "emulated",
                s.fragments.load(Ordering::Relaxed),
                s.bytes.load(Ordering::Relaxed),
                frac(s.held_ns.load(Ordering::Relaxed), cx.secs),
                s.error.lock().clone(),
            ),
            None => {
                let declared = l.eos_fragments.load(Ordering::Relaxed);
                // Said where a reader looks for it, beside the imbalance it makes.
                let short = (declared != u64::MAX && declared > received).then(|| {
                    format!("its end of stream declared {declared} fragments; {received} arrived")
                });
                (
                    "external",
                    if declared == u64::MAX {
                        received
                    } else {
                        declared
                    },
                    0,
                    0.0,
                    short,
                )
            }
        };
        p.sources.push(SourceReport {
            id: l.source_id,
            kind: kind.into(),
            sent,
            bytes,
            held_fraction: held,
            link_state: l.state().label().into(),
            received,
            rejected: l.rejected_by_reason(),
            skipped_bytes: l.skipped_bytes.load(Ordering::Relaxed),
            bytes_after_end: l.bytes_after_end.load(Ordering::Relaxed),
            error,
            link_ended: l.state().ended(),
        });
    }
    let (_, limit) = st.buffer_use();
    let peak: u64 = st
        .links
        .iter()
        .map(|l| l.budget.peak.load(Ordering::Relaxed))
        .sum();
    p.readout_units.push(ReadoutReport {
        id: st.id,
        super_fragments: st.super_fragments.load(Ordering::Relaxed),
        incomplete_super_fragments: st.incomplete_super_fragments.load(Ordering::Relaxed),
        fragments_forwarded: st.fragments_forwarded.load(Ordering::Relaxed),
        peak_buffer_fraction: if limit > 0 {
            peak as f64 / limit as f64
        } else {
            0.0
        },
        busy_fraction: frac_per(st.busy_ns(), cx.secs, st.links.len()),
        refused_connections: st.refused_connections.load(Ordering::Relaxed),
        error: st.builder_error.lock().clone(),
        builder_link_lost: st.builder_lost.load(Ordering::Relaxed),
        fragments_forwarded_by_builder: st
            .fragments_forwarded_by_builder
            .lock()
            .iter()
            .map(|(&i, &n)| (cx.builder_ids.get(i as usize).copied().unwrap_or(i), n))
            .collect(),
        reserved_bytes: st.reserved_bytes.load(Ordering::Relaxed),
        buffered_fragments: st.held_fragments.load(Ordering::Relaxed)
            + st.queued_fragments.load(Ordering::Relaxed)
            + if cx.request_mode {
                // A stored fragment lent to an answer is counted where the answer went.
                let sent = st.requests.stored_sent_fragments.load(Ordering::Relaxed);
                st.requests
                    .stored_fragments
                    .load(Ordering::Relaxed)
                    .saturating_sub(sent)
            } else {
                0
            },
        requests: cx.request_mode.then(|| {
            let q = &st.requests;
            let l = |x: &std::sync::atomic::AtomicU64| x.load(Ordering::Relaxed);
            ReadoutRequestReport {
                requests: l(&q.requests),
                answers: l(&q.answers),
                partial_answers: l(&q.partial_answers),
                fragments_sent: l(&q.fragments_sent),
                fragments_answered_again: l(&q.fragments_answered_again),
                fragments_sent_by_builder: q.fragments_sent_by_builder.lock().clone(),
                bytes_sent: l(&q.bytes_sent),
                descriptor_waits: l(&q.descriptor_waits),
                clear_messages: l(&q.clear_messages),
                cleared_events: l(&q.cleared_events),
                clears_unknown: l(&q.clears_unknown),
                clears_repeated: l(&q.clears_repeated),
                announced: l(&q.announced),
                fragments_still_stored: l(&q.stored_fragments),
                free_pages: l(&q.free_pages),
                total_pages: l(&q.total_pages),
                throttled_s: l(&q.throttled_ns) as f64 / 1e9,
                manager_losses: l(&q.manager_losses),
                reannounced: l(&q.reannounced),
                manager_error: q.manager_error.lock().clone(),
            }
        }),
    });
}

/// Emulated sources, their sending side only (`remote`): where their readout unit runs in
/// this process too, [`Report::collect`] keeps the link's side, which carries the same counts.
pub(crate) fn sources(s: &tessera_source::RunningSources, cx: &Cx, p: &mut Parts) {
    let t = &s.trigger;
    let mut tr = TriggerReport::new(
        t.policy,
        t.offered.load(Ordering::Relaxed),
        t.accepted.load(Ordering::Relaxed),
        t.vetoed.load(Ordering::Relaxed),
    );
    tr.offered_s = t.last_offered_ns.load(Ordering::Relaxed) as f64 / 1e9;
    p.trigger = Some(tr);
    for st in &s.stats {
        let id = st.id;
        p.sources.push(SourceReport {
            id,
            kind: "emulated".into(),
            sent: st.fragments.load(Ordering::Relaxed),
            bytes: st.bytes.load(Ordering::Relaxed),
            held_fraction: frac(st.held_ns.load(Ordering::Relaxed), cx.secs),
            link_state: if st.disconnected.load(Ordering::Relaxed) {
                REMOTE_DISCONNECTED.into()
            } else {
                REMOTE.into()
            },
            received: 0,
            rejected: BTreeMap::new(),
            skipped_bytes: 0,
            bytes_after_end: 0,
            error: st.error.lock().clone(),
            link_ended: false,
        });
    }
}

pub(crate) fn builder(b: &tessera_builder::BuilderUnit, cx: &Cx, p: &mut Parts) {
    let st = &b.stats;
    p.builders.push(BuilderReport {
        id: st.id,
        events_complete: st.events_complete.load(Ordering::Relaxed),
        events_incomplete: st.events_incomplete.load(Ordering::Relaxed),
        fragments_in_complete: st.fragments_in_complete.load(Ordering::Relaxed),
        fragments_in_incomplete: st.fragments_in_incomplete.load(Ordering::Relaxed),
        bytes_built: st.bytes_built.load(Ordering::Relaxed),
        late_fragments: st.late_fragments.load(Ordering::Relaxed),
        stall_releases: st.stall_releases.load(Ordering::Relaxed),
        overdue_requests: st.overdue_requests.load(Ordering::Relaxed),
        duplicate_fragments: st.duplicate_fragments.load(Ordering::Relaxed),
        malformed_fragments: st.malformed_fragments.load(Ordering::Relaxed),
        busy_fraction: frac_per(st.busy_ns(), cx.secs, st.links.len()),
        missing_by_source: st.missing_by_source.lock().clone(),
        errors: std::iter::once(st.recorder_error.lock().clone())
            .chain(st.links.iter().map(|l| {
                l.error
                    .lock()
                    .clone()
                    .map(|e| format!("readout unit {}: {e}", l.readout_unit))
            }))
            .chain(std::iter::once(st.manager_error.lock().clone()))
            .flatten()
            .collect(),
        events_rejected: st.events_rejected.load(Ordering::Relaxed),
        events_rebuilt: st.events_rebuilt.load(Ordering::Relaxed),
        manager_losses: st.manager_losses.load(Ordering::Relaxed),
        recorder_relinks: st.recorder_relinks.load(Ordering::Relaxed),
        events_resent: st.events_resent.load(Ordering::Relaxed),
        recorder_link_lost: st.recorder_lost.load(Ordering::Relaxed),
        fragments_rejected_by_filter: st.fragments_rejected.load(Ordering::Relaxed),
        buffered_fragments: st.held_fragments.load(Ordering::Relaxed)
            + st.queued_fragments.load(Ordering::Relaxed),
        queued_fragments: st.queued_fragments.load(Ordering::Relaxed),
        fragments_by_readout_unit: st
            .links
            .iter()
            .map(|l| (l.readout_unit, l.fragments.load(Ordering::Relaxed)))
            .collect(),
        reserved_bytes: st.reserved_bytes.load(Ordering::Relaxed),
        super_fragments_by_rail: match st.links.first() {
            Some(l) if l.rail_super_fragments.len() > 1 => (0..l.rail_super_fragments.len())
                .map(|r| {
                    st.links
                        .iter()
                        .map(|l| l.rail_super_fragments[r].load(Ordering::Relaxed))
                        .sum()
                })
                .collect(),
            _ => Vec::new(),
        },
    });
}

pub(crate) fn recorder(rec: &tessera_recorder::Recorder, p: &mut Parts) {
    let st = &rec.stats;
    let files = st.files.lock().clone();
    let (uc, ui) = (
        st.unrecorded_fragments_in_complete.load(Ordering::Relaxed),
        st.unrecorded_fragments_in_incomplete
            .load(Ordering::Relaxed),
    );
    let (fc, fi) = (
        st.fragments_in_complete
            .load(Ordering::Relaxed)
            .saturating_sub(uc),
        st.fragments_in_incomplete
            .load(Ordering::Relaxed)
            .saturating_sub(ui),
    );
    p.recorder = Some(RecorderReport {
        histograms: st.histograms.lock().as_ref().map(|f| f.h.clone()),
        events: st.events.load(Ordering::Relaxed),
        incomplete_events: st.incomplete_events.load(Ordering::Relaxed),
        fragments: fc + fi,
        record_bytes: st.record_bytes.load(Ordering::Relaxed),
        file_bytes: st.file_bytes.load(Ordering::Relaxed),
        throttled_s: st.throttled_ns.load(Ordering::Relaxed) as f64 / 1e9,
        events_in_files: files.iter().map(|f| f.events).sum(),
        files,
        error: st.error.lock().clone(),
        duplicate_events: st.duplicate_events.load(Ordering::Relaxed),
        duplicate_fragments: st.duplicate_fragments.load(Ordering::Relaxed),
        fragments_by_builder: st.fragments_by_builder.lock().clone(),
        rebuilt_events: st.rebuilt_events.load(Ordering::Relaxed),
        records_written: st.records_written.load(Ordering::Acquire),
        syncs: st.syncs.load(Ordering::Relaxed),
        disk_free_bytes: st.disk_free.load(Ordering::Relaxed),
        disk_alarm: st.disk_low.load(Ordering::Relaxed) || st.disk_full.load(Ordering::Relaxed),
        fragments_in_complete: fc,
        fragments_in_incomplete: fi,
        queued_fragments: st.queued_fragments.load(Ordering::Relaxed),
        unrecorded_events: st.unrecorded_events.load(Ordering::Relaxed),
        unrecorded_fragments: uc + ui,
        adopted_files: st.adopted_files.load(Ordering::Relaxed),
        adopted_events: st.adopted_events.load(Ordering::Relaxed),
        resent_events: st.resent_events.load(Ordering::Relaxed),
        resent_fragments: st.resent_fragments.load(Ordering::Relaxed),
        relinks: st.relinks.load(Ordering::Relaxed),
    });
}

pub(crate) fn manager(m: &tessera_manager::EventManager, p: &mut Parts) {
    let v = m.view();
    p.event_manager = Some(ManagerReport {
        announced: v.counts.announced,
        assigned: v.counts.assigned,
        reassigned: v.counts.reassigned,
        recorded: v.counts.recorded,
        rejected_by_filter: v.counts.rejected,
        stale_done: v.counts.stale_done,
        clear_messages: v.counts.clears_sent,
        cleared_events: v.counts.cleared_events,
        units_full: v.counts.units_full,
        dead_builders: v.counts.dead_builders,
        busy_transitions: v.counts.busy_transitions,
        adopted: v.counts.adopted,
        finished_before: v.counts.finished_before,
        refused_connections: v.counts.refused_connections,
        in_flight_at_end: v.in_flight,
        errors: v.errors,
    });
}

impl Report {
    pub(crate) fn collect(r: &Resolved, run: &Running, info: RunInfo) -> Report {
        let cx = Cx {
            secs: info.duration_s,
            request_mode: r.topology.run.mode == tessera_config::Mode::Request,
            builder_ids: r.topology.builders.iter().map(|b| b.id).collect(),
            emulated: run
                .sources
                .as_ref()
                .map(|s| s.stats.iter().map(|x| (x.id, x.as_ref())).collect())
                .unwrap_or_default(),
        };
        let mut p = Parts {
            refused_outside_allow: tessera_net::io::REFUSED_BY_NETWORK.load(Ordering::Relaxed),
            ..Parts::default()
        };
        for role in run.roles() {
            role.report(&cx, &mut p);
        }
        // A source read here is reported once, with its link's side.
        let read_here: std::collections::BTreeSet<u32> = p
            .sources
            .iter()
            .filter(|s| !s.link_state.starts_with(REMOTE))
            .map(|s| s.id)
            .collect();
        p.sources
            .retain(|s| !(s.link_state.starts_with(REMOTE) && read_here.contains(&s.id)));
        Report::assemble(r, info, p)
    }

    /// The report of a run spread over hosts, from every host's own report: a source's
    /// counts come from the host that ran it and its link's from the host of its readout
    /// unit; the balance is computed over the whole, as in one process.
    pub fn combine(r: &Resolved, info: RunInfo, parts: Vec<Report>) -> Report {
        let peak = parts
            .iter()
            .filter_map(|p| p.memory.as_ref())
            .map(|m| m.peak_resident_bytes)
            .max()
            .unwrap_or(0);
        let mut all = Parts {
            trigger: None,
            sources: Vec::new(),
            readout_units: Vec::new(),
            builders: Vec::new(),
            recorder: None,
            event_manager: None,
            refused_outside_allow: 0,
            lost_with_builders: 0,
            lost_with_readout_units: 0,
            answered_again_by_lost_units: 0,
        };
        let mut monitor = None;
        let mut remote: BTreeMap<u32, SourceReport> = BTreeMap::new();
        for p in parts {
            for s in p.sources {
                if s.link_state.starts_with(REMOTE) {
                    remote.insert(s.id, s);
                } else {
                    all.sources.push(s);
                }
            }
            all.readout_units.extend(p.readout_units);
            all.builders.extend(p.builders);
            all.recorder = all.recorder.or(p.recorder);
            all.event_manager = all.event_manager.or(p.event_manager);
            all.refused_outside_allow += p.refused_outside_allow;
            monitor = monitor.or(p.monitor);
            all.trigger = match (all.trigger.take(), p.trigger) {
                (Some(a), Some(b)) => Some(a.and(&b)),
                (a, b) => a.or(b),
            };
        }
        for s in &mut all.sources {
            if let Some(x) = remote.remove(&s.id) {
                s.kind = x.kind;
                s.sent = x.sent;
                s.bytes = x.bytes;
                s.held_fraction = x.held_fraction;
                s.error = x.error;
            }
        }
        // Answers given again are inferred only for a unit whose every source reported its
        // side: with a source lost too (a front-end host lost whole) what it sent is unknown,
        // and the builders' takes would be read as copies that balance a loss away.
        let mut sent_by_lost_unit: BTreeMap<u32, u64> = BTreeMap::new();
        if r.topology.run.mode == tessera_config::Mode::Request {
            for (i, ru) in r.topology.readout_units.iter().enumerate() {
                let sources = r.ru_sources.get(i).map_or(&[][..], |v| &v[..]);
                let sent = sources
                    .iter()
                    .try_fold(0u64, |n, id| Some(n.saturating_add(remote.get(id)?.sent)));
                if let (false, Some(sent)) = (sources.is_empty(), sent) {
                    sent_by_lost_unit.insert(ru.id, sent);
                }
            }
        }
        // A source whose readout unit's host gave no report (lost) keeps its own side; what it
        // sent that no builder took went with that unit.
        let orphans: u64 = remote.values().map(|s| s.sent).sum();
        all.sources.extend(remote.into_values());
        all.lost_with_builders = lost_with_builders(&all);
        all.answered_again_by_lost_units = answered_again_by_lost_units(&all, &sent_by_lost_unit);
        all.lost_with_readout_units = orphans
            .saturating_add(all.answered_again_by_lost_units)
            .saturating_sub(taken_from_lost_units(&all));
        let mut report = Report::assemble(r, info, all);
        report.monitor = monitor;
        report.memory = Some(MemoryReport {
            peak_resident_bytes: peak,
            over_hosts: true,
            ..MemoryReport::now(r)
        });
        report
    }

    /// The totals and the balance from the components' reports.
    fn assemble(r: &Resolved, info: RunInfo, mut p: Parts) -> Report {
        let secs = info.duration_s;
        let request_mode = r.topology.run.mode == tessera_config::Mode::Request;
        p.sources.sort_by_key(|s| s.id);
        p.readout_units.sort_by_key(|u| u.id);
        p.builders.sort_by_key(|b| b.id);
        let mut rejected: BTreeMap<String, u64> = BTreeMap::new();
        let mut add = |k: &str, n: u64| {
            if n > 0 {
                *rejected.entry(k.to_string()).or_default() += n;
            }
        };
        let mut buffered = 0u64;
        let mut beyond_sent = 0u64;
        for s in &p.sources {
            for (label, n) in &s.rejected {
                add(label, *n);
            }
            // A link the stop aborted was cut with fragments its source had sent still in the
            // kernel's buffers: they are named, not left unaccounted.
            if s.link_state == LinkState::Aborted.label() {
                add("unread_at_abort", s.sent.saturating_sub(s.received));
            }
            if s.link_ended {
                beyond_sent += s.received.saturating_sub(s.sent);
            }
        }
        add("lost_with_builder_host", p.lost_with_builders);
        add("lost_with_readout_unit_host", p.lost_with_readout_units);
        let mut answered_again = p.answered_again_by_lost_units;
        for u in &p.readout_units {
            add("builder_link_lost", u.builder_link_lost);
            buffered += u.buffered_fragments;
            answered_again += u
                .requests
                .as_ref()
                .map_or(0, |q| q.fragments_answered_again);
        }
        let (mut complete_f, mut incomplete_f, mut ev_c, mut ev_i, mut bytes_built) =
            (0, 0, 0, 0, 0);
        for b in &p.builders {
            add("late_at_builder", b.late_fragments);
            add("duplicate_at_builder", b.duplicate_fragments);
            add("malformed_super_fragment", b.malformed_fragments);
            add("recorder_link_lost", b.recorder_link_lost);
            add("rejected_by_filter", b.fragments_rejected_by_filter);
            buffered += b.buffered_fragments;
            complete_f += b.fragments_in_complete;
            incomplete_f += b.fragments_in_incomplete;
            ev_c += b.events_complete;
            ev_i += b.events_incomplete;
            bytes_built += b.bytes_built;
        }
        // A builder lost with its host gave no count: the events it built are known only as far
        // as the recorder took them from it. Its events are then the recorder's (a run over
        // hosts called 5 008 events built where its files held 9 936).
        let builders_missing = !info.partial && p.builders.len() < r.topology.builders.len();
        if let (true, Some(rc)) = (builders_missing, &p.recorder) {
            ev_c = ev_c.max(rc.events.saturating_sub(rc.incomplete_events));
            ev_i = ev_i.max(rc.incomplete_events);
        }
        // With a recorder the balance runs to it: a built fragment counts once the recorder
        // has it, and until then it is buffered (queued at its builder or at the recorder) or
        // named lost at the recorder link. Counting it when built as well counted it twice
        // while it was on its way (mid-run, or after an aborted stop). In request mode an event
        // may also be built twice (after a failover) but is recorded once: the recorder's
        // counts are the ones that hold. Without a recorder the builders' counts are the end.
        let aborted = !info.drained && info.stop_reason != "running" && !info.partial;
        if let Some(rc) = &p.recorder {
            // What the recorder had taken from its links but not yet written when its stage
            // gave up is dropped with its queue: lost, and named, not "still buffered".
            if aborted {
                add("dropped_at_recorder_abort", rc.queued_fragments);
            } else {
                buffered += rc.queued_fragments;
            }
            complete_f = rc.fragments_in_complete;
            incomplete_f = rc.fragments_in_incomplete;
            // A second copy of an event was built from answers given again (`answered_again`)
            // or from the first answers, the other copy then taking the ones given again: either
            // way its fragments are one copy's worth of what the units put in, named here.
            add("second_copy_at_recorder", rc.duplicate_fragments);
            // Taken from the builders when the output file system had no room left.
            add("unrecorded_disk_full", rc.unrecorded_fragments);
        }
        // Fragments the builders sent on but the recorder has not counted are in flight between
        // them; they are part of what is buffered, not lost, until the recorder link is drained.
        let recorder_shortfall = p.recorder.as_ref().map_or(0, |rc| {
            let copies = if request_mode {
                rc.duplicate_events as i64
            } else {
                0
            };
            (ev_c + ev_i) as i64 - rc.events as i64 - copies
        });
        // A stop that gave up cut the links between the stages with what the senders had
        // written still in the kernel's buffers, unread: per hop, what one side wrote less what
        // the other side took. Named, as `unread_at_abort` is for the sources' links; after a
        // drained stop they are zero and any difference stays unaccounted. While the run goes
        // on the same differences are data on its way, in the kernel's buffers: still
        // buffered, not lost. (What the units sent the builders that reported, copies included,
        // against what those builders took: a builder lost with its host is accounted apart, by
        // what the recorder took from it and `lost_with_builder_host`. Set against the builders
        // that reported, it counted what a lost builder had built and the recorder holds as
        // lost a second time: `IMBALANCE -39424` with one builder host of two killed.)
        let running = info.stop_reason == "running";
        if (running || !info.drained) && !info.partial {
            let (mut in_flight, mut lost) = (0u64, Vec::new());
            let forwarded: u64 = answered_by_builder(&p)
                .filter(|&(_, _, reported)| reported)
                .map(|(_, n, _)| n)
                .sum::<u64>()
                // A push-mode unit that did not count by builder: all of it.
                + p.readout_units
                    .iter()
                    .filter(|u| u.requests.is_none() && u.fragments_forwarded_by_builder.is_empty())
                    .map(|u| u.fragments_forwarded)
                    .sum::<u64>();
            let at_builders: u64 = p
                .builders
                .iter()
                .map(|b| {
                    b.fragments_in_complete
                        + b.fragments_in_incomplete
                        + b.late_fragments
                        + b.duplicate_fragments
                        + b.malformed_fragments
                        + b.fragments_rejected_by_filter
                        + b.buffered_fragments.saturating_sub(b.queued_fragments)
                })
                .sum::<u64>()
                // What came from units lost with their hosts is set against their sources
                // (`lost_with_readout_unit_host`), not against what the reporting units sent.
                .saturating_sub(taken_from_lost_units(&p));
            lost.push((
                "in_flight_to_builders_at_abort",
                forwarded.saturating_sub(at_builders),
            ));
            if let Some(rc) = &p.recorder {
                let written: u64 = p
                    .builders
                    .iter()
                    .map(|b| {
                        (b.fragments_in_complete + b.fragments_in_incomplete)
                            .saturating_sub(b.queued_fragments + b.recorder_link_lost)
                    })
                    .sum();
                // What the recorder took from builders that did not report is theirs, not in
                // flight from the others.
                let reported: std::collections::HashSet<u16> =
                    p.builders.iter().map(|b| b.id).collect();
                let from_unreported: u64 = rc
                    .fragments_by_builder
                    .iter()
                    .filter(|(b, _)| !reported.contains(b))
                    .map(|(_, n)| n)
                    .sum();
                let taken = (rc.fragments_in_complete
                    + rc.fragments_in_incomplete
                    + rc.queued_fragments
                    + rc.duplicate_fragments
                    + rc.unrecorded_fragments)
                    .saturating_sub(from_unreported);
                lost.push((
                    "in_flight_to_recorder_at_abort",
                    written.saturating_sub(taken),
                ));
            }
            for (label, n) in lost {
                if running {
                    in_flight += n;
                } else {
                    add(label, n);
                }
            }
            buffered += in_flight;
        }
        let sent: u64 = p.sources.iter().map(|s| s.sent).sum();
        let rejected_total: u64 = rejected.values().sum();
        let unaccounted = (sent + beyond_sent + answered_again) as i64
            - (complete_f + incomplete_f + rejected_total + buffered) as i64;
        Report {
            run_number: info.run_number,
            started_unix_ns: info.started_unix_ns,
            duration_s: secs,
            stop_reason: info.stop_reason,
            drained: info.drained,
            output: info.output,
            partial: info.partial,
            config_origin: r.origin.clone(),
            config_sha256: hex::encode(r.digest),
            events_complete: ev_c,
            events_incomplete: ev_i,
            bytes_built,
            events_per_s: if secs > 0.0 {
                (ev_c + ev_i) as f64 / secs
            } else {
                0.0
            },
            built_bytes_per_s: if secs > 0.0 {
                bytes_built as f64 / secs
            } else {
                0.0
            },
            dead_time_fraction: crate::live::dead_time_fraction(
                p.trigger
                    .as_ref()
                    .filter(|t| t.policy == "veto")
                    .map(|t| (t.offered, t.vetoed)),
                p.sources.iter().map(|s| s.held_fraction),
            ),
            trigger: p.trigger,
            sources: p.sources,
            readout_units: p.readout_units,
            builders: p.builders,
            recorder: p.recorder,
            event_manager: p.event_manager,
            balance: Balance {
                sent,
                in_complete_events: complete_f,
                in_incomplete_events: incomplete_f,
                rejected,
                rejected_total,
                still_buffered: buffered,
                rejected_beyond_sent: beyond_sent,
                answered_again,
                answered_again_inferred: p.answered_again_by_lost_units,
                unaccounted,
                holds: unaccounted == 0,
            },
            recorder_shortfall,
            refused_outside_allow: p.refused_outside_allow,
            monitor: None,
            hosts_missing: Vec::new(),
            stop: None,
            bottlenecks: Vec::new(),
            not_kept: Vec::new(),
            memory: Some(MemoryReport::now(r)),
        }
    }

    /// Whether the run ended clean: balance holds and the recorder got every built event.
    pub fn ok(&self) -> bool {
        // A role run alone cannot see the whole balance; it answers for its own errors.
        (self.partial || (self.balance.holds && self.recorder_shortfall == 0))
            && self
                .recorder
                .as_ref()
                .is_none_or(|r| r.error.is_none() && r.events_in_files == r.events)
            && self.not_kept.is_empty()
    }

    /// The human summary.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        let b = &self.balance;
        let _ = writeln!(
            s,
            "run {} ended ({}) after {:.1} s{}",
            self.run_number,
            self.stop_reason,
            self.duration_s,
            if self.drained {
                ""
            } else {
                ", NOT fully drained"
            }
        );
        for st in self
            .stop
            .iter()
            .flat_map(|x| &x.stages)
            .filter(|x| !x.finished)
        {
            // A stage can end unfinished before its deadline (a host lost, an abort): said as
            // such, with the time it took, not as a deadline it never reached.
            if st.elapsed_ms >= st.deadline_ms {
                let _ = writeln!(
                    s,
                    "  stop     {} passed its {} ms deadline: {}",
                    st.stage, st.deadline_ms, st.left
                );
            } else {
                let _ = writeln!(
                    s,
                    "  stop     {} ended unfinished after {} ms (deadline {} ms): {}",
                    st.stage, st.elapsed_ms, st.deadline_ms, st.left
                );
            }
        }
        let _ = writeln!(
            s,
            "  built    {} events ({} complete, {} incomplete), {:.0} events/s, {}/s",
            self.events_complete + self.events_incomplete,
            self.events_complete,
            self.events_incomplete,
            self.events_per_s,
            human_bytes(self.built_bytes_per_s)
        );
        if self.trigger.is_some() || self.sources.iter().any(|x| x.held_fraction > 0.0) {
            let _ = writeln!(
                s,
                "  dead time {:.1}%{}",
                100.0 * self.dead_time_fraction,
                match &self.trigger {
                    Some(t) if t.policy == "veto" => {
                        format!(" ({} of {} triggers vetoed)", t.vetoed, t.offered)
                    }
                    _ => " (the most-held source's time held by back-pressure; triggers queued, none lost)".to_string(),
                }
            );
        }
        let missing: BTreeMap<u32, u64> = self
            .builders
            .iter()
            .flat_map(|b| b.missing_by_source.iter().map(|(k, v)| (*k, *v)))
            .fold(BTreeMap::new(), |mut m, (k, v)| {
                *m.entry(k).or_default() += v;
                m
            });
        if !missing.is_empty() {
            let list: Vec<String> = missing
                .iter()
                .take(12)
                .map(|(k, v)| format!("source {k}: {v}"))
                .collect();
            let _ = writeln!(
                s,
                "  incomplete events by missing source: {}{}",
                list.join(", "),
                if missing.len() > 12 { ", ..." } else { "" }
            );
        }
        let released: u64 = self.builders.iter().map(|b| b.stall_releases).sum();
        if released > 0 {
            let _ = writeln!(
                s,
                "  of those, {released} let go by a builder that stood still (every link held for memory by events waiting on each other; a readout unit that promises only in its heartbeat)"
            );
        }
        let overdue: u64 = self.builders.iter().map(|b| b.overdue_requests).sum();
        if overdue > 0 {
            let _ = writeln!(
                s,
                "  overdue requests: {overdue} left unanswered by a readout unit that answered later requests of the same sources (it breaks request-protocol 4.3, rule 4); their events were built without its sources"
            );
        }
        if let Some(r) = &self.recorder {
            let ratio = if r.file_bytes > 0 {
                r.record_bytes as f64 / r.file_bytes as f64
            } else {
                0.0
            };
            let _ = writeln!(
                s,
                "  recorded {} events in {} finished file(s), {} ({} on disk, ratio {:.2}) under {}",
                r.events_in_files,
                r.files.len(),
                human_bytes(r.record_bytes as f64),
                human_bytes(r.file_bytes as f64),
                ratio,
                self.output
            );
            if r.throttled_s > 0.0 {
                let _ = writeln!(s, "  recorder throttled for {:.1} s", r.throttled_s);
            }
            if r.disk_alarm || self.stop_reason == "disk full" {
                let _ = writeln!(
                    s,
                    "  DISK ALARM: {} free on the output file system at the recorder's last look{}",
                    human_bytes(r.disk_free_bytes as f64),
                    if self.stop_reason == "disk full" && r.unrecorded_events > 0 {
                        "; the run was stopped when the disk filled, the next block no longer fitting"
                    } else if self.stop_reason == "disk full" {
                        "; the run was stopped at the hard watermark (recorder.disk_hard_free)"
                    } else {
                        "; below recorder.disk_soft_free, writes were slowed"
                    }
                );
            }
            if let Some(e) = &r.error {
                let _ = writeln!(s, "  RECORDER ERROR: {e}");
            }
            if r.unrecorded_events > 0 {
                let _ = writeln!(s, "  DISK FULL: {} events ({} fragments) could not be written: the output file system filled before the run had drained (another writer, or recorder.disk_hard_free below what was in flight); named unrecorded_disk_full in the balance", r.unrecorded_events, r.unrecorded_fragments);
            }
            let unexplained = r.events.saturating_sub(r.unrecorded_events);
            if r.events_in_files != unexplained {
                let _ = writeln!(s, "  WARNING: the recorder received {} events; {} of them are in no finished file", r.events, unexplained.saturating_sub(r.events_in_files));
            }
        }
        if let Some(m) = &self.event_manager {
            let (req, partial, sent, waits) = self
                .readout_units
                .iter()
                .filter_map(|u| u.requests.as_ref())
                .fold((0, 0, 0, 0), |a, q| {
                    (
                        a.0 + q.answers,
                        a.1 + q.partial_answers,
                        a.2 + q.fragments_sent,
                        a.3 + q.descriptor_waits,
                    )
                });
            let _ = writeln!(
                s,
                "  request mode: {} events assigned, {} recorded, {} rejected by the filter; {req} answers ({partial} partial), {sent} fragments moved; {} clear messages for {} events{}; {} builder(s) declared dead, {} events re-assigned{}",
                m.assigned,
                m.recorded,
                m.rejected_by_filter,
                m.clear_messages,
                m.cleared_events,
                if m.units_full > 0 {
                    format!(" (units full {} times)", m.units_full)
                } else {
                    String::new()
                },
                m.dead_builders,
                m.reassigned,
                if waits > 0 {
                    format!("; requests held for descriptors {waits} times")
                } else {
                    String::new()
                }
            );
            for e in m.errors.iter().take(4) {
                let _ = writeln!(s, "  event manager: {e}");
            }
        }
        if let Some(r) = self
            .recorder
            .as_ref()
            .filter(|r| r.duplicate_events > 0 || r.rebuilt_events > 0)
        {
            let _ = writeln!(
                s,
                "  recorder: {} rebuilt events recorded, {} second copies dropped",
                r.rebuilt_events, r.duplicate_events
            );
        }
        if let Some(r) = self
            .recorder
            .as_ref()
            .filter(|r| r.adopted_files > 0 || r.relinks > 0 || r.resent_events > 0)
        {
            let _ = writeln!(
                s,
                "  recorder: took over {} files ({} events) an earlier recorder of this run left; {} builder links opened again; {} resent events it held already, dropped",
                r.adopted_files, r.adopted_events, r.relinks, r.resent_events
            );
        }
        let held: Vec<String> = self
            .sources
            .iter()
            .filter(|x| x.held_fraction > 0.01)
            .take(8)
            .map(|x| format!("{}: {:.0}%", x.id, 100.0 * x.held_fraction))
            .collect();
        if !held.is_empty() {
            let _ = writeln!(s, "  sources held by back-pressure: {}", held.join(", "));
        }
        let odd: Vec<String> = self
            .sources
            .iter()
            .filter(|x| x.link_state != LinkState::Ended.label())
            .map(|x| format!("{} {}", x.id, x.link_state))
            .collect();
        if !odd.is_empty() {
            let _ = writeln!(s, "  links not ended cleanly: {}", odd.join(", "));
        }
        if let Some(m) = &self.monitor {
            let stations: Vec<String> = m
                .stations
                .iter()
                .map(|st| {
                    let c = &st.counters;
                    format!(
                        "{} ({}) delivered {}, dropped when full {}",
                        st.config.name,
                        match st.config.mode {
                            tessera_config::StationMode::Blocking => "blocking",
                            tessera_config::StationMode::Sampling => "sampling",
                        },
                        c.delivered,
                        c.dropped_full
                    )
                })
                .collect();
            let _ = writeln!(
                s,
                "  monitor: {} events in; {}",
                m.events_in,
                stations.join("; ")
            );
        }
        if self.partial {
            let _ = writeln!(
                s,
                "  (one role of the topology: the accounting balance is computed over a whole run)"
            );
            return s;
        }
        let beyond = if b.rejected_beyond_sent > 0 {
            format!(
                " - rejections beyond what the sources sent (junk) {}",
                b.rejected_beyond_sent
            )
        } else {
            String::new()
        };
        let again = if b.answered_again > 0 {
            let inferred = if b.answered_again_inferred > 0 {
                format!(
                    " (of which {} inferred for readout units lost with their host)",
                    b.answered_again_inferred
                )
            } else {
                String::new()
            };
            format!(
                " - copies answered again after a failover {}{inferred}",
                b.answered_again
            )
        } else {
            String::new()
        };
        let _ = writeln!(s, "  fragments: sent {} = in complete events {} + in incomplete events {} + rejected {} + still buffered {}{beyond}{again}{}", b.sent, b.in_complete_events, b.in_incomplete_events, b.rejected_total, b.still_buffered, if b.holds { "   [balance holds]".to_string() } else if !self.hosts_missing.is_empty() { format!("   [balance open: {} unaccounted until {} host(s) report; the next configure that reaches them gathers what they kept]", b.unaccounted, self.hosts_missing.len()) } else { format!("   [IMBALANCE: {} unaccounted]", b.unaccounted) });
        if !b.rejected.is_empty() {
            let list: Vec<String> = b.rejected.iter().map(|(k, v)| format!("{k} {v}")).collect();
            let _ = writeln!(s, "  rejected by reason: {}", list.join(", "));
        }
        if let Some(m) = &self.memory {
            let _ = writeln!(
                s,
                "  memory: peak resident {} ({}); the configuration bounds what the roles hold at {} (buffers, queues, tables; code and thread stacks aside)",
                human_bytes(m.peak_resident_bytes as f64),
                if m.over_hosts {
                    "the largest of the hosts' processes"
                } else {
                    "this process"
                },
                human_bytes(m.bound_bytes as f64)
            );
        }
        for src in self.sources.iter().filter(|x| x.error.is_some()) {
            let _ = writeln!(
                s,
                "  SOURCE {}: {}",
                src.id,
                src.error.as_deref().unwrap_or_default()
            );
        }
        if self.recorder_shortfall != 0 {
            let _ = writeln!(
                s,
                "  WARNING: builders built {} more events than the recorder recorded",
                self.recorder_shortfall
            );
        }
        for n in &self.not_kept {
            let _ = writeln!(s, "  NOT KEPT: {n}");
        }
        s
    }
}

pub fn human_bytes(b: f64) -> String {
    for (u, m) in [("GB", 1e9), ("MB", 1e6), ("kB", 1e3)] {
        if b >= m {
            return format!("{:.1} {u}", b / m);
        }
    }
    format!("{b:.0} B")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn request_mode() -> tessera_config::Resolved {
        tessera_config::Topology::parse(
            "[run]\nmode = \"request\"\n[sources]\ncount = 4\n\
             [[readout]]\nid = 0\nsources = [0, 1]\n[[readout]]\nid = 1\nsources = [2, 3]\n\
             [[builder]]\nid = 0\n[[builder]]\nid = 1\n",
            "test.toml",
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    fn info() -> RunInfo {
        RunInfo {
            stop_reason: "events".into(),
            drained: true,
            ..Default::default()
        }
    }

    fn source(id: u32) -> SourceReport {
        serde_json::from_value(json!({
            "id": id, "kind": "emulated", "sent": 1, "bytes": 100, "held_fraction": 0.0,
            "link_state": "ended", "received": 1, "rejected": {}, "skipped_bytes": 0,
            "bytes_after_end": 0, "error": null, "link_ended": true,
        }))
        .unwrap()
    }

    /// A request-mode unit that sent each builder `sent` fragments, `again` of them lent before.
    fn unit(id: u32, sent: &[(u32, u64)], again: u64) -> ReadoutReport {
        let by: BTreeMap<u32, u64> = sent.iter().copied().collect();
        serde_json::from_value(json!({
            "id": id, "super_fragments": 0, "incomplete_super_fragments": 0,
            "fragments_forwarded": 0, "peak_buffer_fraction": 0.0, "busy_fraction": 0.0,
            "refused_connections": 0, "error": null,
            "requests": {
                "requests": 0, "answers": 0, "partial_answers": 0,
                "fragments_sent": by.values().sum::<u64>(), "fragments_answered_again": again,
                "fragments_sent_by_builder": by, "bytes_sent": 0, "descriptor_waits": 0,
                "clear_messages": 0, "cleared_events": 0, "clears_unknown": 0,
                "clears_repeated": 0, "announced": 2, "fragments_still_stored": 0,
                "free_pages": 1, "total_pages": 1, "throttled_s": 0.0, "manager_losses": 0,
                "reannounced": 0, "manager_error": null,
            },
        }))
        .unwrap()
    }

    /// A builder that built `copy` fragments into its copy of the event and took `late` late.
    fn builder(id: u16, copy: u64, late: u64, complete: bool) -> BuilderReport {
        let (c, i) = if complete { (copy, 0) } else { (0, copy) };
        serde_json::from_value(json!({
            "id": id, "events_complete": complete as u64, "events_incomplete": !complete as u64,
            "fragments_in_complete": c, "fragments_in_incomplete": i, "bytes_built": 0,
            "late_fragments": late, "duplicate_fragments": 0, "malformed_fragments": 0,
            "busy_fraction": 0.0, "missing_by_source": {}, "errors": [], "events_rejected": 0,
            "events_rebuilt": id as u64, "manager_losses": 0,
        }))
        .unwrap()
    }

    /// A recorder that kept one copy of `kept` fragments and dropped one of `dropped`; `taken`
    /// by builder.
    fn recorder(kept: u64, dropped: u64, taken: &[(u16, u64)]) -> RecorderReport {
        let by: BTreeMap<u16, u64> = taken.iter().copied().collect();
        serde_json::from_value(json!({
            "events": 1, "events_in_files": 1, "incomplete_events": 0, "fragments": kept,
            "record_bytes": 0, "file_bytes": 0, "throttled_s": 0.0, "files": [], "error": null,
            "duplicate_events": (dropped > 0) as u64, "duplicate_fragments": dropped,
            "fragments_by_builder": by, "rebuilt_events": 1, "records_written": 1,
            "syncs": 0, "disk_free_bytes": 0, "disk_alarm": false,
            "fragments_in_complete": kept, "fragments_in_incomplete": 0, "queued_fragments": 0,
        }))
        .unwrap()
    }

    fn parts(
        units: Vec<ReadoutReport>,
        builders: Vec<BuilderReport>,
        rec: RecorderReport,
    ) -> Parts {
        Parts {
            sources: (0..4).map(source).collect(),
            readout_units: units,
            builders,
            recorder: Some(rec),
            ..Default::default()
        }
    }

    /// One event of four sources over two units. Builder 0 was declared dead while it worked:
    /// unit 0's half came in time, unit 1's after builder 0 had built the event without it
    /// (late). Builder 1 was given the event, asked both units again, built it whole and was
    /// recorded first; builder 0's copy was dropped as the second. The late fragments of the
    /// dropped copy were counted twice (the balance off by two) before the units counted the
    /// fragments they gave again and the recorder named its dropped copy.
    #[test]
    fn a_failover_whose_dropped_copy_had_late_fragments_balances() {
        let r = request_mode();
        let p = parts(
            vec![unit(0, &[(0, 2), (1, 2)], 2), unit(1, &[(0, 2), (1, 2)], 2)],
            vec![builder(0, 2, 2, false), builder(1, 4, 0, true)],
            recorder(4, 2, &[(0, 2), (1, 4)]),
        );
        let b = Report::assemble(&r, info(), p).balance;
        assert_eq!(b.sent, 4);
        assert_eq!(b.answered_again, 4);
        assert_eq!(b.rejected["late_at_builder"], 2);
        assert_eq!(b.rejected["second_copy_at_recorder"], 2);
        assert_eq!(b.unaccounted, 0, "{b:?}");
    }

    /// The same event with builder 0 lost with its host, so that its report is missing: what
    /// the units sent it is lost with it, less what of it the recorder took from it.
    #[test]
    fn a_builder_lost_with_its_host_takes_what_it_was_sent_and_no_more() {
        let r = request_mode();
        // Its copy never reached the recorder: builder 1's, built from answers given again, is
        // the one recorded.
        let lost = Report::combine(
            &r,
            info(),
            vec![report_of(parts(
                vec![unit(0, &[(0, 2), (1, 2)], 2), unit(1, &[(0, 2), (1, 2)], 2)],
                vec![builder(1, 4, 0, true)],
                recorder(4, 0, &[(1, 4)]),
            ))],
        );
        let b = &lost.balance;
        assert_eq!(b.rejected["lost_with_builder_host"], 4, "{b:?}");
        assert_eq!(b.unaccounted, 0, "{b:?}");
        // Its copy was recorded before it died: builder 1's is the dropped second copy, and
        // nothing is lost with builder 0.
        let recorded = Report::combine(
            &r,
            info(),
            vec![report_of(parts(
                vec![unit(0, &[(0, 2), (1, 2)], 2), unit(1, &[(0, 2), (1, 2)], 2)],
                vec![builder(1, 4, 0, true)],
                recorder(4, 4, &[(0, 4), (1, 4)]),
            ))],
        );
        let b = &recorded.balance;
        assert!(!b.rejected.contains_key("lost_with_builder_host"), "{b:?}");
        assert_eq!(b.rejected["second_copy_at_recorder"], 4);
        assert_eq!(b.unaccounted, 0, "{b:?}");
    }

    /// Builder 0 built the event whole from both units and was recorded, then was declared
    /// dead; builder 1 was given the event, asked both units again (each answered its two
    /// fragments a second time) and built the copy the recorder dropped. Then unit 1 was lost
    /// with its host: its count of answers given again went with it, and the builders took
    /// from it twice what its sources sent. What they took beyond that can only be answers
    /// given again; counted as such, the balance holds, and nothing is called lost with the
    /// unit that the builders had.
    #[test]
    fn answers_given_again_by_a_unit_lost_with_its_host_are_inferred_from_what_builders_took() {
        let r = request_mode();
        let built = |id: u16| {
            let mut b = builder(id, 4, 0, true);
            b.fragments_by_readout_unit = [(0, 2), (1, 2)].into();
            b
        };
        let remote = |id: u32| SourceReport {
            link_state: REMOTE.into(),
            ..source(id)
        };
        let sources_host = Parts {
            sources: (0..4).map(remote).collect(),
            ..Default::default()
        };
        let unit0_host = Parts {
            sources: (0..2).map(source).collect(),
            readout_units: vec![unit(0, &[(0, 2), (1, 2)], 2)],
            ..Default::default()
        };
        let rest = Parts {
            builders: vec![built(0), built(1)],
            recorder: Some(recorder(4, 4, &[(0, 4), (1, 4)])),
            ..Default::default()
        };
        let whole = Report::combine(
            &r,
            info(),
            vec![
                report_of(sources_host),
                report_of(unit0_host),
                report_of(rest),
            ],
        );
        let b = &whole.balance;
        assert_eq!(b.sent, 4, "{b:?}");
        assert_eq!(
            b.answered_again, 4,
            "unit 0's two, and unit 1's two inferred: {b:?}"
        );
        assert_eq!(b.answered_again_inferred, 2, "{b:?}");
        assert!(
            whole
                .summary()
                .contains("copies answered again after a failover 4 (of which 2 inferred"),
            "{}",
            whole.summary()
        );
        assert_eq!(b.rejected["second_copy_at_recorder"], 4, "{b:?}");
        assert!(
            !b.rejected.contains_key("lost_with_readout_unit_host"),
            "{b:?}"
        );
        assert_eq!(b.unaccounted, 0, "{b:?}");
    }

    /// The same run with unit 1's sources lost as well (a front-end host lost whole): what
    /// they sent is unknown, so nothing the builders took from unit 1 is read as answers given
    /// again, and the balance shows what cannot be proven instead of closing on a guess.
    #[test]
    fn no_answers_are_inferred_for_a_unit_whose_sources_were_lost_with_it() {
        let r = request_mode();
        let mut b = builder(0, 4, 0, true);
        b.fragments_by_readout_unit = [(0, 2), (1, 2)].into();
        let whole = Report::combine(
            &r,
            info(),
            vec![
                report_of(Parts {
                    sources: (0..2).map(source).collect(),
                    readout_units: vec![unit(0, &[(0, 2)], 0)],
                    ..Default::default()
                }),
                report_of(Parts {
                    builders: vec![b],
                    recorder: Some(recorder(4, 0, &[(0, 4)])),
                    ..Default::default()
                }),
            ],
        );
        let b = &whole.balance;
        assert_eq!(b.sent, 2, "{b:?}");
        assert_eq!(
            (b.answered_again, b.answered_again_inferred),
            (0, 0),
            "{b:?}"
        );
        assert_eq!(b.unaccounted, -2, "{b:?}");
    }

    /// A host's part of a report, as its agent sends it.
    fn report_of(p: Parts) -> Report {
        let mut info = info();
        info.partial = true;
        Report::assemble(&request_mode(), info, p)
    }

    /// Overdue requests of every builder, gathered from two hosts' reports, are summed in the
    /// summary, which says what they mean.
    #[test]
    fn overdue_requests_of_every_builder_are_named_in_the_summary() {
        let r = request_mode();
        let overdue = |id: u16, n: u64| {
            let mut b = builder(id, 4, 0, false);
            b.overdue_requests = n;
            Parts {
                builders: vec![b],
                ..Default::default()
            }
        };
        let whole = Report::combine(
            &r,
            info(),
            vec![report_of(overdue(0, 2)), report_of(overdue(1, 1))],
        );
        let text = whole.summary();
        assert!(
            text.contains("overdue requests: 3 left unanswered by a readout unit"),
            "{text}"
        );
        let none = Report::combine(&r, info(), vec![report_of(overdue(0, 0))]);
        assert!(!none.summary().contains("overdue"), "{}", none.summary());
    }

    /// Issue 50, items 1 and 8: a stage that ended unfinished before its deadline (a host lost)
    /// says how long it took, not that it passed its deadline; a recorder that could not write
    /// for a full disk names what it could not write, and the balance holds with it.
    #[test]
    fn a_stop_stage_ended_early_and_unrecorded_events_are_said_as_they_were() {
        let r = request_mode();
        let mut rep = Report::combine(&r, info(), vec![report_of(Parts::default())]);
        let stage = |name: &str, elapsed_ms: u64| crate::StageReport {
            stage: name.into(),
            deadline_ms: 10_000,
            elapsed_ms,
            finished: false,
            left: "a host lost".into(),
        };
        rep.stop = Some(crate::StopReport {
            stages: vec![stage("builders", 26), stage("recorder", 10_003)],
            drained: false,
            all_finished: true,
        });
        let text = rep.summary();
        assert!(
            text.contains("builders ended unfinished after 26 ms (deadline 10000 ms): a host lost"),
            "{text}"
        );
        assert!(
            text.contains("recorder passed its 10000 ms deadline"),
            "{text}"
        );
        assert!(!text.contains("builders passed its"), "{text}");
        let mut rc = recorder(10, 0, &[]);
        rc.unrecorded_events = 2;
        rc.unrecorded_fragments = 6;
        rc.events = 3;
        rc.events_in_files = 1;
        let whole = Report::combine(
            &r,
            info(),
            vec![report_of(Parts {
                recorder: Some(rc),
                ..Default::default()
            })],
        );
        assert_eq!(whole.balance.rejected.get("unrecorded_disk_full"), Some(&6));
        let text = whole.summary();
        assert!(text.contains("DISK FULL: 2 events (6 fragments)"), "{text}");
        assert!(!text.contains("in no finished file"), "{text}");
        assert!(!whole.ok());
        // Stopped for a full disk with events left unwritten: not said to be the watermark's stop.
        let mut rc = whole.recorder.clone().unwrap();
        rc.disk_alarm = true;
        let full = Report::combine(
            &r,
            RunInfo {
                stop_reason: "disk full".into(),
                ..info()
            },
            vec![report_of(Parts {
                recorder: Some(rc),
                ..Default::default()
            })],
        );
        let text = full.summary();
        assert!(text.contains("stopped when the disk filled"), "{text}");
        assert!(!text.contains("at the hard watermark"), "{text}");
    }

    /// Issue 14: 21 links each busy the whole run make a unit busy the whole run, not 1/21.
    #[test]
    fn a_unit_whose_links_were_all_busy_all_run_was_busy_all_run() {
        let secs = 10.0;
        let all = 21 * 10_000_000_000u64;
        assert_eq!(super::frac_per(all, secs, 21), 1.0);
        assert!((super::frac_per(all / 2, secs, 21) - 0.5).abs() < 1e-9);
        assert_eq!(super::frac_per(5, 0.0, 21), 0.0);
        assert_eq!(super::frac_per(all, secs, 0), 1.0);
    }
}

//! One shape for every role: what the code that drives a run (a run in one process, a node
//! agent's share of a run over hosts) needs of a role, whatever the role. `Session` lists its
//! components, watches for failures, measures progress and stops in stages through this alone,
//! so a new role is one implementation here, not edits in each of those places.
//!
//! In the spirit of FairMQ's `Device` and DUNE DAQ's `DAQModule`: a lifecycle (running until it
//! finishes or is aborted), the stage of a stop that ends it, a typed failure, and what it
//! still holds when a stop gives up on it.

use serde::{Deserialize, Serialize};
use std::sync::atomic::Ordering::Relaxed;

use std::collections::BTreeMap;

use tessera_config::Resolved;

use crate::live::{Live, LiveBuilder, LiveReadout, LiveRecorder, LiveSource};
use crate::{report, Running, StopStage};

/// Why a role failed, typed: the run control acts on the kind, the words are for people.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Failure {
    /// The connection to the role it sends to, or is driven by, broke.
    #[error("{peer} link: {detail}")]
    LinkLost {
        /// `builder`, `event manager`, `recorder`.
        peer: String,
        detail: String,
    },
    /// The role's own work failed (the recorder could not write its file, say).
    #[error("{detail}")]
    Role { detail: String },
    /// It ended while what feeds it goes on and no stop was asked for.
    #[error("ended by itself while the run goes on")]
    EndedByItself,
}

/// The first failure of a run, as the run control acts on it: what failed (`recorder`,
/// `host fe1: readout unit 0`, `host fe2 (10.1.0.12:7300)`) and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{subject}: {reason}")]
pub struct Failed {
    pub subject: String,
    pub reason: String,
    /// The component's failure, typed, where a component failed.
    pub failure: Option<Failure>,
}

/// What every role is to the code that drives it.
pub trait RunRole: Send + Sync {
    /// `readout unit 3`, `builder 1`, `recorder`, `event manager`, `sources`.
    fn name(&self) -> String;
    /// `sources`, `readout`, `builder`, `recorder`, `event_manager`.
    fn kind(&self) -> &'static str;
    /// The stage of a stop that waits for it (and, past its deadline, aborts it).
    fn stage(&self) -> StopStage;
    /// Its threads ended.
    fn is_finished(&self) -> bool;
    /// Gives up on what it holds and ends (a stop stage's deadline passed).
    fn abort(&self);
    /// A failure it found itself.
    fn failure(&self) -> Option<Failure>;
    /// Whether what feeds it has ended (so that its own end is no failure), given the others.
    fn upstream_done(&self, run: &Running) -> bool;
    /// Bytes it moved so far: a stop stage ends when nothing has moved for its deadline.
    fn progress(&self) -> u64;
    /// What it still holds, in words, for the report of a stop stage that gave up on it.
    fn left(&self) -> String;
    /// Held by the run's pause (its triggers, for the sources).
    fn paused(&self) -> bool {
        false
    }
    /// Why an end that looks early is none (a builder declared dead and failed over).
    fn note(&self, _run: &Running) -> Option<String> {
        None
    }
    /// Adds its counters and gauges to `live` (the live view, `/metrics`).
    fn live(&self, r: &Resolved, live: &mut Live);
    /// Adds its part to the end-of-run report.
    fn report(&self, cx: &report::Cx, parts: &mut report::Parts);
}

impl Running {
    /// Every role of this process, in the direction of the data.
    pub fn roles(&self) -> impl Iterator<Item = &dyn RunRole> {
        let sources = self.sources.iter().map(|s| s as &dyn RunRole);
        let rus = self.readout_units.iter().map(|u| u as &dyn RunRole);
        let bus = self.builders.iter().map(|b| b as &dyn RunRole);
        let rec = self.recorder.iter().map(|r| r as &dyn RunRole);
        let em = self.manager.iter().map(|m| m as &dyn RunRole);
        sources.chain(rus).chain(bus).chain(rec).chain(em)
    }

    pub fn readout_finished(&self) -> bool {
        self.readout_units.iter().all(|u| u.is_finished())
    }
}

impl RunRole for tessera_source::RunningSources {
    fn name(&self) -> String {
        "sources".into()
    }
    fn kind(&self) -> &'static str {
        "sources"
    }
    fn stage(&self) -> StopStage {
        StopStage::Sources
    }
    fn is_finished(&self) -> bool {
        self.threads_finished()
    }
    fn abort(&self) {
        // Nothing to do here: a source held by back-pressure is cut at its readout link when
        // the readout stage gives up.
    }
    fn failure(&self) -> Option<Failure> {
        None
    }
    fn upstream_done(&self, _: &Running) -> bool {
        true
    }
    fn progress(&self) -> u64 {
        self.stats.iter().map(|x| x.bytes.load(Relaxed)).sum()
    }
    fn left(&self) -> String {
        let held: Vec<String> = self
            .stats
            .iter()
            .filter(|s| !s.finished.load(Relaxed))
            .map(|s| s.id.to_string())
            .collect();
        format!(
            "sources {} still held by back-pressure; their readout links are cut",
            held.join(",")
        )
    }
    fn paused(&self) -> bool {
        tessera_source::RunningSources::paused(self)
    }
    fn report(&self, cx: &report::Cx, parts: &mut report::Parts) {
        report::sources(self, cx, parts);
    }
    fn live(&self, r: &Resolved, live: &mut Live) {
        // The sending side; the link's side comes from the readout unit, here or on another
        // host, and the two are joined by `Live::combine`.
        let t = &self.trigger;
        live.trigger = Some(crate::live::LiveTrigger {
            policy: t.policy.into(),
            offered: t.offered.load(Relaxed),
            accepted: t.accepted.load(Relaxed),
            vetoed: t.vetoed.load(Relaxed),
        });
        for e in &self.stats {
            live.sources.push(LiveSource {
                id: e.id,
                kind: "emulated".into(),
                readout_unit: r
                    .source_ru
                    .get(&e.id)
                    .map_or(0, |&i| r.topology.readout_units[i].id),
                fragments_sent: Some(e.fragments.load(Relaxed)),
                bytes_sent: Some(e.bytes.load(Relaxed)),
                held_ns: Some(e.held_ns.load(Relaxed)),
                received: 0,
                rejected: BTreeMap::new(),
                link_state: crate::report::REMOTE.into(),
                last_event_id: None,
                skipped_bytes: 0,
                bytes_after_end: 0,
            });
        }
    }
}

impl RunRole for tessera_readout::ReadoutUnit {
    fn name(&self) -> String {
        format!("readout unit {}", self.stats.id)
    }
    fn kind(&self) -> &'static str {
        "readout"
    }
    fn stage(&self) -> StopStage {
        StopStage::Readout
    }
    fn is_finished(&self) -> bool {
        tessera_readout::ReadoutUnit::is_finished(self)
    }
    fn abort(&self) {
        tessera_readout::ReadoutUnit::abort(self)
    }
    fn failure(&self) -> Option<Failure> {
        // Request mode: driven by the event manager; push mode: sends to the builders.
        let link = |peer: &str, e: Option<String>| {
            e.map(|detail| Failure::LinkLost {
                peer: peer.into(),
                detail,
            })
        };
        link(
            "event manager",
            self.stats.requests.manager_error.lock().clone(),
        )
        .or_else(|| link("builder", self.stats.builder_error.lock().clone()))
    }
    fn upstream_done(&self, _: &Running) -> bool {
        // A readout unit ends with its own links' streams.
        self.stats.links.iter().all(|l| l.state().ended())
    }
    fn progress(&self) -> u64 {
        self.stats.bytes_forwarded.load(Relaxed)
            + self
                .stats
                .links
                .iter()
                .map(|l| l.fragments.load(Relaxed))
                .sum::<u64>()
    }
    fn left(&self) -> String {
        let s = &self.stats;
        format!(
            "readout unit {} had {} fragments buffered; links aborted",
            s.id,
            s.held_fragments.load(Relaxed)
                + s.queued_fragments.load(Relaxed)
                + s.requests.stored_fragments.load(Relaxed)
        )
    }
    fn report(&self, cx: &report::Cx, parts: &mut report::Parts) {
        report::readout(self, cx, parts);
    }
    fn live(&self, r: &Resolved, live: &mut Live) {
        let s = &self.stats;
        let emulated: std::collections::BTreeSet<u32> = r.emulated_sources().collect();
        for l in &s.links {
            live.sources.push(LiveSource {
                id: l.source_id,
                kind: if emulated.contains(&l.source_id) {
                    "emulated"
                } else {
                    "external"
                }
                .into(),
                readout_unit: s.id,
                fragments_sent: None,
                bytes_sent: None,
                held_ns: None,
                received: l.received(),
                rejected: l.rejected_by_reason(),
                link_state: l.state().label().to_string(),
                last_event_id: (l.fragments.load(Relaxed) > 0).then(|| l.last_event.load(Relaxed)),
                skipped_bytes: l.skipped_bytes.load(Relaxed),
                bytes_after_end: l.bytes_after_end.load(Relaxed),
            });
        }
        let q = &s.requests;
        let total = q.total_pages.load(Relaxed);
        // Request mode: the occupancy that matters is the paged buffers'.
        let (used, limit) = if total > 0 {
            let page = (s.buffer_use().1 / total.max(1)).max(1);
            (
                (total - q.free_pages.load(Relaxed).min(total)) * page,
                total * page,
            )
        } else {
            s.buffer_use()
        };
        live.readout_units.push(LiveReadout {
            id: s.id,
            host: r
                .topology
                .readout_units
                .iter()
                .find(|u| u.id == s.id)
                .and_then(|u| u.host.clone()),
            super_fragments: s.super_fragments.load(Relaxed),
            fragments_forwarded: s.fragments_forwarded.load(Relaxed)
                + q.fragments_sent.load(Relaxed),
            bytes_forwarded: s.bytes_forwarded.load(Relaxed) + q.bytes_sent.load(Relaxed),
            buffer_used: used,
            buffer_limit: limit,
            busy_ns: s.busy_ns() + q.throttled_ns.load(Relaxed),
            links: s.links.len(),
            busy: s.busy(),
            pending_events: s.pending_events.load(Relaxed),
            send_queued: s.send_queues.total(),
        });
    }
}

impl RunRole for tessera_builder::BuilderUnit {
    fn name(&self) -> String {
        format!("builder {}", self.stats.id)
    }
    fn kind(&self) -> &'static str {
        "builder"
    }
    fn stage(&self) -> StopStage {
        StopStage::Builders
    }
    fn is_finished(&self) -> bool {
        tessera_builder::BuilderUnit::is_finished(self)
    }
    fn abort(&self) {
        tessera_builder::BuilderUnit::abort(self)
    }
    fn failure(&self) -> Option<Failure> {
        self.stats
            .recorder_error
            .lock()
            .clone()
            .map(|detail| Failure::LinkLost {
                peer: "recorder".into(),
                detail,
            })
    }
    fn upstream_done(&self, run: &Running) -> bool {
        // Push mode: every unit's link brought its goodbye (the units' own threads may finish
        // a moment after the builder read it, and that is no failure).
        let goodbyes = !run.request_mode
            && self
                .stats
                .links
                .iter()
                .all(|l| l.declared_fragments.load(Relaxed) != u64::MAX);
        goodbyes || self.note(run).is_some() || run.readout_finished()
    }
    fn progress(&self) -> u64 {
        self.stats.bytes_built.load(Relaxed)
    }
    fn left(&self) -> String {
        format!(
            "builder {}: {} events still being assembled and {} fragments not handed to the recorder; aborted",
            self.stats.id,
            self.stats.pending_events.load(Relaxed),
            self.stats.queued_fragments.load(Relaxed)
        )
    }
    fn report(&self, cx: &report::Cx, parts: &mut report::Parts) {
        report::builder(self, cx, parts);
    }
    fn live(&self, r: &Resolved, live: &mut Live) {
        let s = &self.stats;
        let (used, limit) = s.buffer_use();
        live.builders.push(LiveBuilder {
            id: s.id,
            host: r
                .topology
                .builders
                .iter()
                .find(|b| b.id == u32::from(s.id))
                .and_then(|b| b.host.clone()),
            events_complete: s.events_complete.load(Relaxed),
            events_incomplete: s.events_incomplete.load(Relaxed),
            events_rejected: s.events_rejected.load(Relaxed),
            bytes_built: s.bytes_built.load(Relaxed),
            buffer_used: used,
            buffer_limit: limit,
            busy_ns: s.busy_ns(),
            links: s.links.len(),
            pending_events: s.pending_events.load(Relaxed),
            queued_fragments: s.queued_fragments.load(Relaxed),
            latency: crate::live::histogram(&s.latency),
            receive_queued: s.receive_queues.total(),
            stall_releases: s.stall_releases.load(Relaxed),
            overdue_requests: s.overdue_requests.load(Relaxed),
            dropped: [
                ("late_at_builder", &s.late_fragments),
                ("duplicate_at_builder", &s.duplicate_fragments),
                ("malformed_super_fragment", &s.malformed_fragments),
                ("recorder_link_lost", &s.recorder_lost),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.load(Relaxed)))
            .collect(),
            missing_by_source: s.missing_by_source.lock().clone(),
        });
    }
    fn note(&self, run: &Running) -> Option<String> {
        // Request mode: a builder the event manager declared dead (late heartbeats on a loaded
        // machine, say) has had its events given to the others: once it ends, that is the
        // failover doing its work, not a failure of the run.
        let dismissed = self.is_finished()
            && run.manager.as_ref().is_some_and(|m| {
                m.view()
                    .builders
                    .iter()
                    .any(|&(id, alive, _, _)| id == self.stats.id as u32 && !alive)
            });
        dismissed.then(|| {
            "declared dead by the event manager; its events were rebuilt by the others".into()
        })
    }
}

impl RunRole for tessera_recorder::Recorder {
    fn name(&self) -> String {
        "recorder".into()
    }
    fn kind(&self) -> &'static str {
        "recorder"
    }
    fn stage(&self) -> StopStage {
        StopStage::Recorder
    }
    fn is_finished(&self) -> bool {
        tessera_recorder::Recorder::is_finished(self)
    }
    fn abort(&self) {
        tessera_recorder::Recorder::abort(self)
    }
    fn failure(&self) -> Option<Failure> {
        self.stats
            .error
            .lock()
            .clone()
            .map(|detail| Failure::Role { detail })
    }
    fn upstream_done(&self, run: &Running) -> bool {
        run.builders.iter().all(|b| b.is_finished())
            || self
                .stats
                .links_ended_clean
                .load(std::sync::atomic::Ordering::Acquire)
                >= run.builders_in_topology
    }
    fn progress(&self) -> u64 {
        // Taken from the builders, and written by the disk thread, which drains the blocks in
        // the pipeline after the last record was taken.
        self.stats.record_bytes.load(Relaxed) + self.stats.file_bytes.load(Relaxed)
    }
    fn left(&self) -> String {
        format!(
            "{} fragments not written; the open file is left unfinished; recorder aborted",
            self.stats.queued_fragments.load(Relaxed)
        )
    }
    fn report(&self, _cx: &report::Cx, parts: &mut report::Parts) {
        report::recorder(self, parts);
    }
    fn live(&self, r: &Resolved, live: &mut Live) {
        let s = &self.stats;
        let (used, limit) = s.buffer_use();
        live.recorder = Some(LiveRecorder {
            host: r.topology.recorder.host.clone(),
            events: s.events.load(Relaxed),
            incomplete_events: s.incomplete_events.load(Relaxed),
            record_bytes: s.record_bytes.load(Relaxed),
            file_bytes: s.file_bytes.load(Relaxed),
            files: s.files.lock().len() as u64,
            buffer_used: used,
            buffer_limit: limit,
            busy_ns: s.busy_ns(),
            links: s.links.lock().len(),
            write_ns: s.write_ns.load(Relaxed),
            throttled_ns: s.throttled_ns.load(Relaxed),
            monitor_ns: s.monitor.ns(),
            queued_fragments: s.queued_fragments.load(Relaxed),
            second_copy_fragments: s.duplicate_fragments.load(Relaxed),
            error: s.error.lock().clone(),
            current_file: s.current_file.lock().clone(),
            disk_free: s.disk_free.load(Relaxed),
            disk_low: s.disk_low.load(Relaxed),
            disk_full: s.disk_full.load(Relaxed),
            histograms: s.histograms.lock().as_ref().map(|f| f.h.clone()),
        });
    }
}

impl RunRole for tessera_manager::EventManager {
    fn name(&self) -> String {
        "event manager".into()
    }
    fn kind(&self) -> &'static str {
        "event_manager"
    }
    fn stage(&self) -> StopStage {
        // It lives until the builders have finished what it assigned them.
        StopStage::Builders
    }
    fn is_finished(&self) -> bool {
        tessera_manager::EventManager::is_finished(self)
    }
    fn abort(&self) {
        tessera_manager::EventManager::abort(self)
    }
    fn failure(&self) -> Option<Failure> {
        None
    }
    fn upstream_done(&self, run: &Running) -> bool {
        run.readout_finished()
    }
    fn progress(&self) -> u64 {
        0
    }
    fn left(&self) -> String {
        "event manager aborted".into()
    }
    fn report(&self, _cx: &report::Cx, parts: &mut report::Parts) {
        report::manager(self, parts);
    }
    fn live(&self, _: &Resolved, _: &mut Live) {
        // Its counters are in the report (assignments, clears, dead builders), not live.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_keeps_its_kind_through_json_and_says_itself_in_words() {
        let all = [
            Failure::LinkLost {
                peer: "recorder".into(),
                detail: "connection reset".into(),
            },
            Failure::Role {
                detail: "disk full".into(),
            },
            Failure::EndedByItself,
        ];
        for f in all {
            let j = serde_json::to_value(&f).unwrap();
            assert!(j["kind"].is_string(), "{j}");
            assert_eq!(serde_json::from_value::<Failure>(j).unwrap(), f);
        }
        assert_eq!(
            Failure::LinkLost {
                peer: "recorder".into(),
                detail: "connection reset".into()
            }
            .to_string(),
            "recorder link: connection reset"
        );
    }
}

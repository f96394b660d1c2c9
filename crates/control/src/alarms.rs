//! Alarms: conditions an operator must see while a run takes data, raised on the dashboard, in
//! the message log and as metrics, and cleared when the condition goes. Evaluated by the run
//! control at every sample from what the sampler computed (`[alarms]` sets the levels); a lost
//! agent or a failed component is raised as it is found.
//!
//! Time enters as an argument (seconds on a monotonic clock), so the rules are tested without
//! waiting.

use serde::Serialize;
use std::collections::{BTreeMap, VecDeque};

use tessera_config::AlarmsSection;
use tessera_run::live::Live;

use crate::sampler::{Point, Rates};

/// Cleared alarms kept for the dashboard and `/api/alarms`.
pub const RECENT: usize = 200;
/// Alarms active at once: one per stage and host, buffer and lost host is far below this; past
/// it the rest are counted, not kept.
pub const MAX_ACTIVE: usize = 1000;

/// What an alarm is about, in the field's words.
pub mod kind {
    /// A stage held by the stage after it for longer than `alarms.blocked_s`.
    pub const STAGE_BLOCKED: &str = "stage_blocked";
    /// No event built for `alarms.no_events_s` while running.
    pub const NO_EVENTS: &str = "no_events";
    /// Incomplete events above `alarms.incomplete_fraction` of those built.
    pub const INCOMPLETE: &str = "incomplete_fraction";
    /// A buffer fuller than `alarms.buffer_fraction`.
    pub const BUFFER_FULL: &str = "buffer_full";
    /// A host's node agent lost (a run spread over hosts; raised also when its builders were
    /// failed over and the run goes on).
    pub const AGENT_LOST: &str = "agent_lost";
    /// A component failed: the run went to error.
    pub const COMPONENT_FAILED: &str = "component_failed";
    /// Dead time above `alarms.dead_time_fraction` over an interval.
    pub const DEAD_TIME: &str = "dead_time";
    /// One stage sets the pace and holds the others: the blocked stages, full buffers and dead
    /// time it causes, folded into one alarm that names it.
    pub const BOTTLENECK: &str = "bottleneck";
    pub const ALL: [&str; 8] = [
        STAGE_BLOCKED,
        NO_EVENTS,
        INCOMPLETE,
        BUFFER_FULL,
        AGENT_LOST,
        COMPONENT_FAILED,
        DEAD_TIME,
        BOTTLENECK,
    ];
    /// Consequences of a bottleneck: folded into it when one is named.
    pub const CONSEQUENCES: [&str; 3] = [STAGE_BLOCKED, BUFFER_FULL, DEAD_TIME];
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Alarm {
    /// One of [`kind`].
    pub alarm: &'static str,
    /// What it is about: `readout on fe2`, `builder 1`, `host bu2`, `run`.
    pub subject: String,
    /// `warning` or `error`.
    pub level: &'static str,
    pub message: String,
    pub run: Option<u64>,
    pub raised_unix_ns: u64,
    /// Set once the condition went (in the recent list).
    pub cleared_unix_ns: Option<u64>,
    /// A bottleneck alarm: the conditions it causes, folded into it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub folded: Vec<String>,
    /// Who acknowledged it (it stays raised while its condition holds), and when.
    pub acknowledged_by: Option<String>,
    pub acknowledged_unix_ns: Option<u64>,
    /// Who silenced it and until when: shown, not announced.
    pub silenced_by: Option<String>,
    pub silenced_until_unix_ns: Option<u64>,
}

impl Alarm {
    /// Raised, neither acknowledged nor silenced: what the crew must look at.
    pub fn unattended(&self) -> bool {
        self.cleared_unix_ns.is_none()
            && self.acknowledged_by.is_none()
            && self.silenced_by.is_none()
    }
}

/// A condition found true now.
struct Found {
    alarm: &'static str,
    subject: String,
    level: &'static str,
    message: String,
    folded: Vec<String>,
}

impl Found {
    fn new(alarm: &'static str, subject: String, level: &'static str, message: String) -> Found {
        Found {
            alarm,
            subject,
            level,
            message,
            folded: Vec::new(),
        }
    }
}

/// An operator's silence of one alarm (kind and subject), raised or not yet.
#[derive(Clone, Debug)]
struct Silence {
    who: String,
    until_unix_ns: u64,
}

/// What an evaluation looks at.
pub struct Look<'a> {
    /// Seconds on a monotonic clock.
    pub t: f64,
    pub unix_ns: u64,
    /// Running (not paused, not stopping).
    pub taking_data: bool,
    pub run: Option<u64>,
    pub live: Option<&'a Live>,
    pub rates: Option<&'a Rates>,
    pub point: Option<&'a Point>,
    /// Hosts whose agent is lost, with why.
    pub lost_hosts: &'a [(String, String)],
}

#[derive(Default)]
pub struct Alarms {
    active: BTreeMap<(&'static str, String), Alarm>,
    recent: VecDeque<Alarm>,
    raised_total: BTreeMap<&'static str, u64>,
    /// Alarms not kept because [`MAX_ACTIVE`] were active.
    pub not_kept: u64,
    blocked_since: BTreeMap<String, f64>,
    quiet_since: Option<f64>,
    /// Active alarms whose condition went, since when (cleared after `alarms.clear_s`).
    absent_since: BTreeMap<(&'static str, String), f64>,
    silences: BTreeMap<(&'static str, String), Silence>,
    /// The bottleneck last named (key, words), while its alarm is raised: an interval that
    /// names none while the consequences stay still folds them into it.
    last_named: Option<(String, String)>,
}

/// Why an operator's call on an alarm was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum AlarmActionError {
    #[error("no alarm {alarm:?} about {subject:?} is raised")]
    NotRaised { alarm: String, subject: String },
    #[error("no alarm is called {0:?} (known: {known})", known = kind::ALL.join(", "))]
    UnknownKind(String),
    #[error("a silence of {0} s: from 1 s to 7 days")]
    BadSilence(u64),
    /// A silence may name an alarm not raised yet, so their number is bounded.
    #[error("{MAX_SILENCES} silences are in force already: end one first")]
    TooManySilences,
}

/// Silences in force at once.
pub const MAX_SILENCES: usize = 1000;

/// The longest silence, seconds.
pub const MAX_SILENCE_S: u64 = 7 * 86_400;

#[derive(Clone, Debug, Serialize)]
pub struct AlarmsView {
    pub active: Vec<Alarm>,
    /// Cleared, newest first.
    pub recent: Vec<Alarm>,
    pub raised_total: BTreeMap<&'static str, u64>,
}

fn stage_subject(stage: &str, host: Option<&str>) -> String {
    match host {
        Some(h) => format!("{stage} on {h}"),
        None => stage.to_string(),
    }
}

impl Alarms {
    pub fn view(&self) -> AlarmsView {
        AlarmsView {
            active: self.active.values().cloned().collect(),
            recent: self.recent.iter().rev().cloned().collect(),
            raised_total: self.raised_total.clone(),
        }
    }

    pub fn active(&self) -> impl Iterator<Item = &Alarm> {
        self.active.values()
    }

    pub fn raised_total(&self) -> &BTreeMap<&'static str, u64> {
        &self.raised_total
    }

    /// Raises an alarm found outside the periodic look (a component failure); it stays until
    /// [`clear_all`](Self::clear_all).
    pub fn raise(
        &mut self,
        alarm: &'static str,
        subject: &str,
        message: &str,
        run: Option<u64>,
        unix_ns: u64,
    ) {
        self.raise_found(
            Found::new(alarm, subject.to_string(), "error", message.to_string()),
            run,
            unix_ns,
        );
    }

    /// Clears every alarm (a new configure or start: what they were about is gone). Silences
    /// stay until they end: an operator silenced a kind of alarm, not one run's.
    pub fn clear_all(&mut self, unix_ns: u64) {
        let keys: Vec<_> = self.active.keys().cloned().collect();
        for k in keys {
            self.clear(&k, unix_ns);
        }
        self.blocked_since.clear();
        self.quiet_since = None;
        self.absent_since.clear();
    }

    /// An operator acknowledges a raised alarm: it stays raised while its condition holds, no
    /// longer as a call for attention. A raised alarm acknowledged again keeps the first.
    pub fn acknowledge(
        &mut self,
        alarm: &str,
        subject: &str,
        who: &str,
        unix_ns: u64,
    ) -> Result<Alarm, AlarmActionError> {
        let key = known_key(alarm, subject)?;
        let Some(a) = self.active.get_mut(&key) else {
            return Err(AlarmActionError::NotRaised {
                alarm: alarm.into(),
                subject: subject.into(),
            });
        };
        if a.acknowledged_by.is_none() {
            a.acknowledged_by = Some(who.into());
            a.acknowledged_unix_ns = Some(unix_ns);
            tracing::info!(alarm = a.alarm, subject = %a.subject, run = a.run, who, "alarm acknowledged by {who}: {}", a.message);
        }
        Ok(a.clone())
    }

    /// An operator silences an alarm (raised or not yet) for `seconds`: while silenced it is
    /// shown but not announced, and raising it again is logged at INFO. `seconds` 0 ends a
    /// silence.
    pub fn silence(
        &mut self,
        alarm: &str,
        subject: &str,
        who: &str,
        seconds: u64,
        unix_ns: u64,
    ) -> Result<Option<u64>, AlarmActionError> {
        let key = known_key(alarm, subject)?;
        if seconds == 0 {
            self.silences.remove(&key);
            if let Some(a) = self.active.get_mut(&key) {
                a.silenced_by = None;
                a.silenced_until_unix_ns = None;
            }
            tracing::info!(alarm, subject, who, "alarm silence ended by {who}");
            return Ok(None);
        }
        if seconds > MAX_SILENCE_S {
            return Err(AlarmActionError::BadSilence(seconds));
        }
        if !self.silences.contains_key(&key) && self.silences.len() >= MAX_SILENCES {
            return Err(AlarmActionError::TooManySilences);
        }
        let until = unix_ns.saturating_add(seconds * 1_000_000_000);
        if let Some(a) = self.active.get_mut(&key) {
            a.silenced_by = Some(who.into());
            a.silenced_until_unix_ns = Some(until);
        }
        self.silences.insert(
            key,
            Silence {
                who: who.into(),
                until_unix_ns: until,
            },
        );
        tracing::info!(
            alarm,
            subject,
            who,
            seconds,
            "alarm silenced by {who} for {seconds} s"
        );
        Ok(Some(until))
    }

    /// Looks at the run now: raises what has become true, clears what has no longer been for
    /// `alarms.clear_s`.
    pub fn evaluate(&mut self, look: &Look<'_>, cfg: &AlarmsSection) {
        self.end_silences(look.unix_ns);
        let mut found = Vec::new();
        for (host, why) in look.lost_hosts {
            found.push(Found::new(
                kind::AGENT_LOST,
                format!("host {host}"),
                "error",
                format!("the node agent of host {host} is lost: {why}"),
            ));
        }
        if look.taking_data {
            self.data_conditions(look, cfg, &mut found);
            let now = look
                .rates
                .filter(|r| !r.bottleneck_key.is_empty() && !r.bottleneck_key.starts_with("none"))
                .map(|r| (r.bottleneck_key.clone(), r.bottleneck.clone()));
            let raised = self
                .active
                .contains_key(&(kind::BOTTLENECK, BOTTLENECK_SUBJECT.to_string()));
            let named = now.or_else(|| self.last_named.clone().filter(|_| raised));
            fold_into_bottleneck(named.as_ref(), &mut found);
            self.last_named = named;
        } else {
            self.blocked_since.clear();
            self.quiet_since = None;
        }
        // Clear what the look covers and no longer finds (a component failure stays): at once
        // when no run takes data (what it was about is gone), else once gone for `clear_s`, so
        // that a condition on its edge stays one alarm.
        let gone: Vec<_> = self
            .active
            .keys()
            .filter(|(a, s)| {
                *a != kind::COMPONENT_FAILED
                    && !found.iter().any(|f| f.alarm == *a && &f.subject == s)
            })
            .cloned()
            .collect();
        self.absent_since.retain(|k, _| gone.contains(k));
        for k in gone {
            let since = *self.absent_since.entry(k.clone()).or_insert(look.t);
            let data = k.0 != kind::AGENT_LOST;
            if (!look.taking_data && data) || look.t - since >= cfg.clear_s {
                self.absent_since.remove(&k);
                self.clear(&k, look.unix_ns);
            }
        }
        for f in found {
            self.raise_found(f, look.run, look.unix_ns);
        }
    }

    fn end_silences(&mut self, unix_ns: u64) {
        let ended: Vec<_> = self
            .silences
            .iter()
            .filter(|(_, s)| s.until_unix_ns <= unix_ns)
            .map(|(k, _)| k.clone())
            .collect();
        for k in ended {
            self.silences.remove(&k);
            if let Some(a) = self.active.get_mut(&k) {
                a.silenced_by = None;
                a.silenced_until_unix_ns = None;
                tracing::warn!(alarm = a.alarm, subject = %a.subject, run = a.run, "alarm silence ended, still raised: {}", a.message);
            }
        }
    }

    fn data_conditions(&mut self, look: &Look<'_>, cfg: &AlarmsSection, found: &mut Vec<Found>) {
        let t = look.t;
        if let Some(rates) = look.rates {
            let mut still = BTreeMap::new();
            for s in &rates.stages {
                if s.condition != "blocked" {
                    continue;
                }
                let subject = stage_subject(s.stage, s.host.as_deref());
                let since = self.blocked_since.get(&subject).copied().unwrap_or(t);
                still.insert(subject.clone(), since);
                if cfg.blocked_s > 0.0 && t - since >= cfg.blocked_s {
                    found.push(Found::new(
                        kind::STAGE_BLOCKED,
                        subject.clone(),
                        "warning",
                        format!(
                            "{subject} blocked for {:.0} s ({}); bottleneck: {}",
                            t - since,
                            s.why,
                            rates.bottleneck
                        ),
                    ));
                }
            }
            self.blocked_since = still;
        }
        if let Some(p) = look.point {
            if p.events_per_s == 0.0 {
                let since = *self.quiet_since.get_or_insert(t);
                if cfg.no_events_s > 0.0 && t - since >= cfg.no_events_s {
                    found.push(Found::new(
                        kind::NO_EVENTS,
                        "run".into(),
                        "warning",
                        format!("no event built for {:.0} s while running", t - since),
                    ));
                }
            } else {
                self.quiet_since = None;
                let f = p.incomplete_per_s / p.events_per_s;
                if cfg.incomplete_fraction > 0.0 && f > cfg.incomplete_fraction {
                    found.push(Found::new(
                        kind::INCOMPLETE,
                        "builders".into(),
                        "warning",
                        format!(
                            "{:.1}% of the events built over the last interval were incomplete (alarm above {:.1}%){}",
                            f * 100.0,
                            cfg.incomplete_fraction * 100.0,
                            look.live.map(missing_sources).unwrap_or_default()
                        ),
                    ));
                }
            }
            if cfg.dead_time_fraction > 0.0 && p.dead_time_fraction > cfg.dead_time_fraction {
                found.push(Found::new(
                    kind::DEAD_TIME,
                    "trigger".into(),
                    "warning",
                    format!(
                        "dead time {:.1}% over the last interval (alarm above {:.1}%)",
                        p.dead_time_fraction * 100.0,
                        cfg.dead_time_fraction * 100.0
                    ),
                ));
            }
        }
        if let (Some(live), true) = (look.live, cfg.buffer_fraction > 0.0) {
            let active = &self.active;
            let mut buffer = |subject: String, used: u64, limit: u64| {
                // Raised above the level, cleared below nine tenths of it: a buffer that
                // hovers at the level is one alarm.
                let level = if active.contains_key(&(kind::BUFFER_FULL, subject.clone())) {
                    cfg.buffer_fraction * 0.9
                } else {
                    cfg.buffer_fraction
                };
                if limit > 0 && used as f64 > level * limit as f64 {
                    found.push(Found::new(
                        kind::BUFFER_FULL,
                        subject.clone(),
                        "warning",
                        format!(
                            "{subject}'s buffer {:.0}% full ({used} of {limit} bytes; alarm above {:.0}%)",
                            used as f64 * 100.0 / limit as f64,
                            cfg.buffer_fraction * 100.0
                        ),
                    ));
                }
            };
            for u in &live.readout_units {
                buffer(
                    stage_subject(&format!("readout unit {}", u.id), u.host.as_deref()),
                    u.buffer_used,
                    u.buffer_limit,
                );
            }
            for b in &live.builders {
                buffer(
                    stage_subject(&format!("builder {}", b.id), b.host.as_deref()),
                    b.buffer_used,
                    b.buffer_limit,
                );
            }
            if let Some(r) = &live.recorder {
                buffer(
                    stage_subject("recorder", r.host.as_deref()),
                    r.buffer_used,
                    r.buffer_limit,
                );
            }
        }
    }

    fn raise_found(&mut self, f: Found, run: Option<u64>, unix_ns: u64) {
        let key = (f.alarm, f.subject.clone());
        if let Some(a) = self.active.get_mut(&key) {
            // Still true: the message follows the condition (how long, how full).
            a.message = f.message;
            a.folded = f.folded;
            return;
        }
        if self.active.len() >= MAX_ACTIVE {
            self.not_kept += 1;
            return;
        }
        *self.raised_total.entry(f.alarm).or_default() += 1;
        let silence = self.silences.get(&key).cloned();
        if let Some(s) = &silence {
            tracing::info!(alarm = f.alarm, subject = %f.subject, run, "alarm (silenced by {}): {}", s.who, f.message);
        } else if f.level == "error" {
            tracing::error!(alarm = f.alarm, subject = %f.subject, run, "alarm: {}", f.message);
        } else {
            tracing::warn!(alarm = f.alarm, subject = %f.subject, run, "alarm: {}", f.message);
        }
        self.active.insert(
            key,
            Alarm {
                alarm: f.alarm,
                subject: f.subject,
                level: f.level,
                message: f.message,
                run,
                raised_unix_ns: unix_ns,
                cleared_unix_ns: None,
                folded: f.folded,
                acknowledged_by: None,
                acknowledged_unix_ns: None,
                silenced_by: silence.as_ref().map(|s| s.who.clone()),
                silenced_until_unix_ns: silence.map(|s| s.until_unix_ns),
            },
        );
    }

    fn clear(&mut self, key: &(&'static str, String), unix_ns: u64) {
        let Some(mut a) = self.active.remove(key) else {
            return;
        };
        tracing::info!(alarm = a.alarm, subject = %a.subject, run = a.run, "alarm cleared: {}", a.message);
        a.cleared_unix_ns = Some(unix_ns);
        self.recent.push_back(a);
        while self.recent.len() > RECENT {
            self.recent.pop_front();
        }
    }
}

fn known_key(alarm: &str, subject: &str) -> Result<(&'static str, String), AlarmActionError> {
    let k = kind::ALL
        .iter()
        .find(|k| **k == alarm)
        .ok_or_else(|| AlarmActionError::UnknownKind(alarm.into()))?;
    Ok((k, subject.to_string()))
}

/// The subject of the one bottleneck alarm: whatever stage it names, so that the bottleneck
/// moving from one stage to another (or flickering between two) stays one alarm.
pub const BOTTLENECK_SUBJECT: &str = "data path";

/// Where a bottleneck is named, its consequences (blocked stages, full buffers, dead time)
/// become one alarm that names it and lists them, instead of one banner each.
fn fold_into_bottleneck(named: Option<&(String, String)>, found: &mut Vec<Found>) {
    let Some((key, words)) = named else { return };
    let (folded, kept): (Vec<Found>, Vec<Found>) = std::mem::take(found)
        .into_iter()
        .partition(|f| kind::CONSEQUENCES.contains(&f.alarm));
    *found = kept;
    if folded.is_empty() {
        return;
    }
    let level = if folded.iter().any(|f| f.level == "error") {
        "error"
    } else {
        "warning"
    };
    let names: Vec<&str> = folded
        .iter()
        .map(|f| {
            if f.alarm == kind::DEAD_TIME {
                "the trigger (dead time)"
            } else {
                f.subject.as_str()
            }
        })
        .collect();
    found.push(Found {
        alarm: kind::BOTTLENECK,
        subject: BOTTLENECK_SUBJECT.into(),
        level,
        message: format!(
            "bottleneck {key}: {words}; it holds {} ({})",
            names.join(", "),
            folded
                .iter()
                .map(|f| f.alarm)
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect::<Vec<_>>()
                .join(", ")
        ),
        folded: folded.into_iter().map(|f| f.message).collect(),
    });
}

/// The sources most often missing from the run's incomplete events so far, as the end of the
/// incomplete-events alarm: `; missing most: source 5 (1602 events), source 2 (3 events)`.
fn missing_sources(live: &tessera_run::live::Live) -> String {
    let mut by: std::collections::BTreeMap<u32, u64> = Default::default();
    for b in &live.builders {
        for (src, n) in &b.missing_by_source {
            *by.entry(*src).or_default() += n;
        }
    }
    let mut v: Vec<(u32, u64)> = by.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    if v.is_empty() {
        return String::new();
    }
    let named: Vec<String> = v
        .iter()
        .take(5)
        .map(|(s, n)| format!("source {s} ({n} events)"))
        .collect();
    let more = v.len().saturating_sub(5);
    format!(
        "; missing most: {}{}",
        named.join(", "),
        if more > 0 {
            format!(" and {more} more sources")
        } else {
            String::new()
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::StageView;

    fn rates(stages: Vec<StageView>) -> Rates {
        Rates {
            interval_s: 0.5,
            per_source_fragments_per_s: vec![],
            per_source_bytes_per_s: vec![],
            per_source_dead_fraction: vec![],
            per_readout_bytes_per_s: vec![],
            per_readout_busy_fraction: vec![],
            per_builder_events_per_s: vec![],
            per_builder_bytes_per_s: vec![],
            per_builder_busy_fraction: vec![],
            recorder_busy_fraction: 0.0,
            trigger_offered_per_s: 0.0,
            trigger_accepted_per_s: 0.0,
            dead_time_fraction: 0.0,
            bottleneck: crate::sampler::bottleneck(&stages),
            bottleneck_key: String::new(),
            stages,
        }
    }

    fn point(events_per_s: f64, incomplete_per_s: f64) -> Point {
        Point {
            t: 0.0,
            events_per_s,
            built_bytes_per_s: 0.0,
            recorded_bytes_per_s: 0.0,
            incomplete_per_s,
            rejected_per_s: 0.0,
            dead_time_fraction: 0.0,
            buffer_fraction: 0.0,
            buffers: vec![],
        }
    }

    fn stage(stage: &'static str, host: &str, condition: &'static str) -> StageView {
        StageView {
            stage,
            host: Some(host.into()),
            condition,
            why: "buffers 99% full".into(),
            load: 0.99,
            cpu: None,
            unsent: None,
            unread: None,
        }
    }

    fn look<'a>(t: f64, rates: Option<&'a Rates>, point: Option<&'a Point>) -> Look<'a> {
        Look {
            t,
            unix_ns: (t * 1e9) as u64,
            taking_data: true,
            run: Some(7),
            live: None,
            rates,
            point,
            lost_hosts: &[],
        }
    }

    fn active(a: &Alarms) -> Vec<(&'static str, String)> {
        a.active().map(|x| (x.alarm, x.subject.clone())).collect()
    }

    #[test]
    fn a_stage_blocked_longer_than_the_level_raises_one_alarm_naming_its_host_then_clears() {
        let cfg = AlarmsSection {
            blocked_s: 30.0,
            ..Default::default()
        };
        let mut a = Alarms::default();
        let blocked = rates(vec![
            stage("readout", "fe1", "busy"),
            stage("readout", "fe2", "blocked"),
            stage("builders", "bu1", "busy"),
        ]);
        let flowing = point(1000.0, 0.0);
        for t in [0.0, 10.0, 29.5] {
            a.evaluate(&look(t, Some(&blocked), Some(&flowing)), &cfg);
            assert!(active(&a).is_empty(), "raised at {t} s: {:?}", active(&a));
        }
        a.evaluate(&look(30.0, Some(&blocked), Some(&flowing)), &cfg);
        a.evaluate(&look(31.0, Some(&blocked), Some(&flowing)), &cfg);
        assert_eq!(
            active(&a),
            vec![(kind::STAGE_BLOCKED, "readout on fe2".to_string())]
        );
        let msg = &a.view().active[0].message;
        assert!(msg.contains("bottleneck: builders on bu1"), "{msg}");
        assert_eq!(a.raised_total()[kind::STAGE_BLOCKED], 1);
        // Unblocked: cleared once unblocked for `clear_s` (not at the first interval), kept
        // among the recent, and the timer starts again.
        let ok = rates(vec![stage("readout", "fe2", "busy")]);
        a.evaluate(&look(32.0, Some(&ok), Some(&flowing)), &cfg);
        a.evaluate(&look(36.5, Some(&ok), Some(&flowing)), &cfg);
        assert_eq!(active(&a).len(), 1, "cleared before clear_s passed");
        a.evaluate(&look(37.0, Some(&ok), Some(&flowing)), &cfg);
        assert!(active(&a).is_empty());
        let v = a.view();
        assert_eq!(v.recent.len(), 1);
        assert_eq!(v.recent[0].cleared_unix_ns, Some(37_000_000_000));
        a.evaluate(&look(38.0, Some(&blocked), Some(&flowing)), &cfg);
        assert!(active(&a).is_empty());
    }

    #[test]
    fn no_events_while_running_raises_after_its_time_and_not_while_paused() {
        let cfg = AlarmsSection {
            no_events_s: 10.0,
            ..Default::default()
        };
        let mut a = Alarms::default();
        let quiet = point(0.0, 0.0);
        a.evaluate(&look(0.0, None, Some(&quiet)), &cfg);
        a.evaluate(&look(9.0, None, Some(&quiet)), &cfg);
        assert!(active(&a).is_empty());
        a.evaluate(&look(10.0, None, Some(&quiet)), &cfg);
        assert_eq!(active(&a), vec![(kind::NO_EVENTS, "run".to_string())]);
        // Paused: not taking data, so cleared, and the quiet time starts again on resume.
        let mut paused = look(11.0, None, Some(&quiet));
        paused.taking_data = false;
        a.evaluate(&paused, &cfg);
        assert!(active(&a).is_empty());
        a.evaluate(&look(12.0, None, Some(&quiet)), &cfg);
        assert!(active(&a).is_empty());
    }

    #[test]
    fn incomplete_fraction_and_full_buffers_raise_at_their_levels_and_zero_turns_a_check_off() {
        let cfg = AlarmsSection {
            incomplete_fraction: 0.05,
            ..Default::default()
        };
        let mut a = Alarms::default();
        a.evaluate(&look(0.0, None, Some(&point(1000.0, 50.0))), &cfg);
        assert!(active(&a).is_empty(), "5% is the level, not above it");
        // The alarm names the sources missing most (issue 51: "10 % incomplete" never said
        // that source 5 was the one missing).
        let mut live = Live::empty(1);
        for (id, missing) in [(0u16, [(5u32, 1600u64), (2, 3)]), (1, [(5, 2), (7, 1)])] {
            live.builders.push(tessera_run::live::LiveBuilder {
                id,
                missing_by_source: missing.into_iter().collect(),
                ..Default::default()
            });
        }
        let p = point(1000.0, 60.0);
        let mut l = look(1.0, None, Some(&p));
        l.live = Some(&live);
        a.evaluate(&l, &cfg);
        assert_eq!(active(&a), vec![(kind::INCOMPLETE, "builders".to_string())]);
        let msg = &a.view().active[0].message;
        assert!(
            msg.ends_with(
                "; missing most: source 5 (1602 events), source 2 (3 events), source 7 (1 events)"
            ),
            "{msg}"
        );
        let off = AlarmsSection {
            incomplete_fraction: 0.0,
            clear_s: 0.0,
            ..Default::default()
        };
        a.evaluate(&look(2.0, None, Some(&point(1000.0, 1000.0))), &off);
        assert!(active(&a).is_empty());
    }

    #[test]
    fn a_lost_agent_stays_raised_while_lost_and_a_component_failure_until_cleared() {
        let cfg = AlarmsSection {
            clear_s: 0.0,
            ..Default::default()
        };
        let mut a = Alarms::default();
        let lost = [("bu2".to_string(), "no status for 5 s".to_string())];
        let mut l = look(0.0, None, None);
        l.lost_hosts = &lost;
        l.taking_data = false;
        a.evaluate(&l, &cfg);
        a.evaluate(&l, &cfg);
        assert_eq!(active(&a), vec![(kind::AGENT_LOST, "host bu2".to_string())]);
        assert_eq!(
            a.raised_total()[kind::AGENT_LOST],
            1,
            "raised once, not per look"
        );
        a.raise(
            kind::COMPONENT_FAILED,
            "host fe1",
            "host fe1: readout unit 0: link",
            Some(7),
            5,
        );
        a.evaluate(&look(1.0, None, None), &cfg);
        assert_eq!(
            active(&a),
            vec![(kind::COMPONENT_FAILED, "host fe1".to_string())]
        );
        a.clear_all(9);
        assert!(active(&a).is_empty());
        assert_eq!(a.view().recent.len(), 2);
    }

    fn blocked_rates(key: &str) -> Rates {
        let mut r = rates(vec![
            stage("readout", "fe1", "blocked"),
            stage("builders", "bu1", "blocked"),
            stage("recorder", "bu1", "busy"),
        ]);
        r.bottleneck_key = key.into();
        r.bottleneck = format!("{key}: its disk writes 5 MB/s");
        r
    }

    fn full_live() -> Live {
        let mut live = Live::empty(1);
        for id in 0..4 {
            live.readout_units.push(tessera_run::live::LiveReadout {
                id,
                buffer_used: 100,
                buffer_limit: 100,
                ..Default::default()
            });
        }
        live
    }

    #[test]
    fn the_consequences_of_one_bottleneck_are_one_alarm_that_names_it() {
        // Issue 51: one slow disk raised six banners (buffers full four times, stages blocked
        // twice). Now: one, naming the recorder's disk, listing what it holds.
        let cfg = AlarmsSection {
            blocked_s: 1.0,
            ..Default::default()
        };
        let mut a = Alarms::default();
        let live = full_live();
        let r = blocked_rates("recorder (disk)");
        let mut p = point(100.0, 0.0);
        p.dead_time_fraction = 0.4;
        for t in [0.0, 1.0, 2.0] {
            let mut l = look(t, Some(&r), Some(&p));
            l.live = Some(&live);
            a.evaluate(&l, &cfg);
        }
        assert_eq!(
            active(&a),
            vec![(kind::BOTTLENECK, BOTTLENECK_SUBJECT.to_string())]
        );
        let v = a.view();
        let b = &v.active[0];
        assert!(
            b.message.starts_with("bottleneck recorder (disk): recorder (disk): its disk writes 5 MB/s; it holds readout on fe1, builders on bu1, the trigger (dead time), readout unit 0, readout unit 1, readout unit 2, readout unit 3 (buffer_full, dead_time, stage_blocked)"),
            "{}",
            b.message
        );
        assert_eq!(b.folded.len(), 7, "{:?}", b.folded);
        assert_eq!(v.raised_total.len(), 1, "{:?}", v.raised_total);
        // An interval that names no bottleneck while the consequences stay: still one alarm.
        let none = blocked_rates("none");
        let mut l = look(3.0, Some(&none), Some(&p));
        l.live = Some(&live);
        a.evaluate(&l, &cfg);
        assert_eq!(
            active(&a),
            vec![(kind::BOTTLENECK, BOTTLENECK_SUBJECT.to_string())]
        );
        // The bottleneck moves: the same alarm, its message follows.
        let builders = blocked_rates("builders (cpu)");
        let mut l = look(4.0, Some(&builders), Some(&p));
        l.live = Some(&live);
        a.evaluate(&l, &cfg);
        assert_eq!(a.view().active.len(), 1);
        assert!(a.view().active[0]
            .message
            .starts_with("bottleneck builders (cpu)"));
        assert_eq!(a.raised_total()[kind::BOTTLENECK], 1);
    }

    #[test]
    fn a_buffer_on_the_level_raises_once_and_clears_below_nine_tenths_after_clear_s() {
        let cfg = AlarmsSection::default(); // 95%, clear_s 5
        let mut a = Alarms::default();
        let at = |pct: u64| {
            let mut live = Live::empty(1);
            live.readout_units.push(tessera_run::live::LiveReadout {
                id: 0,
                buffer_used: pct,
                buffer_limit: 100,
                ..Default::default()
            });
            live
        };
        let p = point(100.0, 0.0);
        let mut t = 0.0;
        // Hovering around the level: 96, 94, 97, 90, 96 ... one alarm, raised once.
        for pct in [96, 94, 97, 90, 96, 93, 96] {
            let live = at(pct);
            let mut l = look(t, None, Some(&p));
            l.live = Some(&live);
            a.evaluate(&l, &cfg);
            t += 1.0;
        }
        assert_eq!(a.raised_total()[kind::BUFFER_FULL], 1);
        assert_eq!(active(&a).len(), 1);
        // Below 85.5%: cleared once it stayed so for 5 s.
        for pct in [50, 50, 50, 50, 50] {
            let live = at(pct);
            let mut l = look(t, None, Some(&p));
            l.live = Some(&live);
            a.evaluate(&l, &cfg);
            assert_eq!(active(&a).len(), 1, "at {t} s");
            t += 1.0;
        }
        let live = at(50);
        let mut l = look(t, None, Some(&p));
        l.live = Some(&live);
        a.evaluate(&l, &cfg);
        assert!(active(&a).is_empty());
    }

    #[test]
    fn an_operator_acknowledges_and_silences_with_their_name_and_a_silence_ends() {
        let cfg = AlarmsSection {
            no_events_s: 1.0,
            clear_s: 0.0,
            ..Default::default()
        };
        let mut a = Alarms::default();
        let quiet = point(0.0, 0.0);
        a.evaluate(&look(0.0, None, Some(&quiet)), &cfg);
        a.evaluate(&look(1.0, None, Some(&quiet)), &cfg);
        assert!(a.view().active[0].unattended());
        assert_eq!(
            a.acknowledge("no_events", "builders", "ana", 5),
            Err(AlarmActionError::NotRaised {
                alarm: "no_events".into(),
                subject: "builders".into()
            })
        );
        assert!(matches!(
            a.acknowledge("no_such", "run", "ana", 5),
            Err(AlarmActionError::UnknownKind(_))
        ));
        let acked = a
            .acknowledge("no_events", "run", "ana", 1_500_000_000)
            .unwrap();
        assert_eq!(acked.acknowledged_by.as_deref(), Some("ana"));
        assert!(!a.view().active[0].unattended());
        // Cleared, then raised again: a new alarm, not acknowledged.
        a.evaluate(&look(2.0, None, Some(&point(10.0, 0.0))), &cfg);
        assert!(active(&a).is_empty());
        // Silenced before it comes back: raised silenced, until the silence ends.
        assert_eq!(
            a.silence("no_events", "run", "ben", 8 * 86_400, 0),
            Err(AlarmActionError::BadSilence(8 * 86_400))
        );
        let until = a
            .silence("no_events", "run", "ben", 10, 2_000_000_000)
            .unwrap();
        assert_eq!(until, Some(12_000_000_000));
        a.evaluate(&look(3.0, None, Some(&quiet)), &cfg);
        a.evaluate(&look(4.0, None, Some(&quiet)), &cfg);
        let v = a.view();
        assert_eq!(v.active[0].silenced_by.as_deref(), Some("ben"));
        assert!(v.active[0].acknowledged_by.is_none());
        assert!(!v.active[0].unattended());
        a.evaluate(&look(12.0, None, Some(&quiet)), &cfg);
        assert!(a.view().active[0].unattended(), "the silence ended");
        // Silences of subjects never raised are bounded.
        for i in 0..MAX_SILENCES {
            a.silence("buffer_full", &format!("s{i}"), "x", 60, 13_000_000_000)
                .unwrap();
        }
        assert_eq!(
            a.silence("buffer_full", "one more", "x", 60, 13_000_000_000),
            Err(AlarmActionError::TooManySilences)
        );
        assert!(a
            .silence("buffer_full", "s7", "x", 0, 13_000_000_000)
            .is_ok());
    }
}

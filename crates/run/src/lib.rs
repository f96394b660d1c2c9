//! Runs a whole topology in one process. Every role runs as its own threads and the data
//! between roles crosses real loopback TCP, exactly as between hosts.
//!
//! Start order is sink first (recorder, builders, readout units, sources), so that every
//! connection finds its listener. A stop drains in the same direction as the data: the sources
//! end their streams, each readout unit sends what it holds and closes its builder links, each
//! builder finishes and closes its recorder link, the recorder closes its file. Each of these
//! stages has its own deadline (`[stop]`); past it the stage gives up on what it holds and says
//! what that was, so a stop never hangs behind a full queue, and nothing left is hidden.
//!
//! [`Session`] is one run: the run control (`tessera-control`) drives one per run through its
//! states; [`run`] drives one from start to end (`tessera serve`, tests, benchmarks).

pub mod check;
pub mod fault;
pub mod live;
pub mod report;
pub mod role;
pub mod shipping;
mod start;
mod status;

use anyhow::{bail, Context, Result};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tessera_builder::BuilderUnit;
use tessera_config::Resolved;
use tessera_format::wire::{MAX_HEADER_SIZE, TRAILER_SIZE};
use tessera_readout::ReadoutUnit;
use tessera_recorder::Recorder;

pub use report::Report;

/// How the live status is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatusMode {
    /// Rewrite one line on a terminal, print lines otherwise.
    Auto,
    /// A new line each interval.
    Lines,
    Off,
}

/// What the command line adds to the topology.
#[derive(Clone, Debug)]
pub struct Options {
    /// Overrides `run.events`.
    pub events: Option<u64>,
    /// Overrides `run.duration_s`.
    pub duration_s: Option<f64>,
    /// Overrides `run.output`.
    pub output: Option<PathBuf>,
    pub status: StatusMode,
    /// Raised from outside (Ctrl-C) to stop the run.
    pub stop: Arc<AtomicBool>,
    /// Builders count and drop events instead of sending them to the recorder (measurements of
    /// building alone).
    pub sink_at_builders: bool,
    /// Write the run manifest and take a run number from the output directory.
    pub manifest: bool,
    /// Told, once everything listens, where each source must connect (source ID, address).
    pub ready: Option<std::sync::mpsc::SyncSender<Vec<(u32, String)>>>,
    /// Run only this role (a per-role daemon, `tessera serve`); `None`: the whole topology.
    pub only: Option<Role>,
    /// The run number, allocated by the caller (the run database); `None`: `run.number`, else
    /// one more than the output directory's `last_run`.
    pub run_number: Option<u64>,
    /// Run only these roles (a host's share of a run spread over hosts, `tessera node`); the
    /// run control drives the whole. Overrides `only`.
    pub roles: Option<RoleSet>,
    /// Listening sockets bound before the start (by the node agent when it configured, so
    /// that every port, 0 or not, is known to the run control before any role connects),
    /// by [`RoleSet::listener_key`]; a role finds its own here before it binds.
    pub listeners: Listeners,
    /// The emulated sources connect but hold their triggers until [`Session::resume`]: a run
    /// spread over hosts starts its triggers once every host has started.
    pub start_held: bool,
    /// With `roles`: the name of this part (its host), for the files it writes.
    pub part: Option<String>,
    /// The shipper of this process's data directory (it outlives the run): its backlog joins
    /// the live view and the status line, and it is told when a run ends.
    pub shipper: Option<Arc<tessera_shipper::ShipperService>>,
}

/// Listening sockets handed to [`Session::start`], by [`RoleSet::listener_key`].
pub type Listeners = Arc<Mutex<HashMap<String, TcpListener>>>;

/// The roles one process runs: all (`tessera run`), one (`tessera serve`), or a host's share of
/// a run spread over hosts (`tessera node`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoleSet {
    pub recorder: bool,
    pub event_manager: bool,
    pub builders: BTreeSet<u32>,
    pub readout_units: BTreeSet<u32>,
    /// Emulated sources, by source ID.
    pub sources: BTreeSet<u32>,
}

impl RoleSet {
    /// One role, as `tessera serve` runs it.
    pub fn of_role(role: Role, r: &Resolved) -> RoleSet {
        let mut s = RoleSet::default();
        match role {
            Role::Recorder => s.recorder = true,
            Role::EventManager => s.event_manager = true,
            Role::Builder(id) => {
                s.builders.insert(id);
            }
            Role::Readout(id) => {
                s.readout_units.insert(id);
            }
            Role::Sources => s.sources = r.emulated_sources().collect(),
        }
        s
    }

    /// The roles `[hosts]` places on `host` (the monitor goes with the recorder; emulated
    /// sources with their readout unit unless `sources.host` says otherwise).
    pub fn of_host(host: &str, r: &Resolved) -> RoleSet {
        let t = &r.topology;
        let on = |h: &Option<String>| h.as_deref() == Some(host);
        let mut s = RoleSet {
            recorder: t.recorder.enabled && on(&t.recorder.host),
            event_manager: t.run.mode == tessera_config::Mode::Request && on(&t.event_manager.host),
            builders: t
                .builders
                .iter()
                .filter(|b| on(&b.host))
                .map(|b| b.id)
                .collect(),
            readout_units: t
                .readout_units
                .iter()
                .filter(|u| on(&u.host))
                .map(|u| u.id)
                .collect(),
            sources: BTreeSet::new(),
        };
        s.sources = r
            .emulated_sources()
            .filter(|id| {
                r.source_ru
                    .get(id)
                    .is_some_and(|&i| t.source_host(i) == Some(host))
            })
            .collect();
        s
    }

    pub fn is_empty(&self) -> bool {
        *self == RoleSet::default()
    }

    /// The listening sockets these roles need, by key, with the topology's address for each.
    pub fn listens(&self, r: &Resolved) -> Vec<(String, String)> {
        let t = &r.topology;
        let mut v = Vec::new();
        if self.recorder {
            v.push(("recorder".to_string(), t.recorder.listen.clone()));
            if t.monitor.enabled {
                v.push(("monitor".to_string(), t.monitor.listen.clone()));
            }
        }
        if self.event_manager {
            v.push(("event_manager".to_string(), t.event_manager.listen.clone()));
        }
        if t.run.mode == tessera_config::Mode::Push {
            for b in t.builders.iter().filter(|b| self.builders.contains(&b.id)) {
                v.push((format!("builder:{}", b.id), b.listen.clone()));
                for (j, rail) in b.rails.iter().enumerate() {
                    v.push((format!("builder:{}:{}", b.id, j + 1), rail.clone()));
                }
            }
        }
        for u in t
            .readout_units
            .iter()
            .filter(|u| self.readout_units.contains(&u.id))
        {
            v.push((format!("readout:{}", u.id), u.listen.clone()));
        }
        v
    }

    /// The names of its roles, for messages.
    pub fn names(&self) -> Vec<String> {
        let mut v = Vec::new();
        if !self.sources.is_empty() {
            v.push(format!("{} emulated sources", self.sources.len()));
        }
        v.extend(
            self.readout_units
                .iter()
                .map(|i| format!("readout unit {i}")),
        );
        v.extend(self.builders.iter().map(|i| format!("builder {i}")));
        if self.event_manager {
            v.push("event manager".into());
        }
        if self.recorder {
            v.push("recorder".into());
        }
        v
    }
}

/// Sets every listen address of `r` named in `addresses` (keys of [`RoleSet::listens`]) and
/// returns the topology re-resolved: what every host of a run spread over hosts runs, once
/// the run control knows where each role listens.
pub fn with_addresses(
    r: &Resolved,
    addresses: &std::collections::BTreeMap<String, String>,
) -> Result<Resolved> {
    let mut t = r.topology.clone();
    for (key, addr) in addresses {
        match key.split_once(':') {
            None if key == "recorder" => t.recorder.listen = addr.clone(),
            None if key == "monitor" => t.monitor.listen = addr.clone(),
            None if key == "event_manager" => t.event_manager.listen = addr.clone(),
            Some(("builder", id)) => {
                // `builder:ID` is its listen, `builder:ID:N` its rail N (1: the first of `rails`).
                let (id, rail) = match id.split_once(':') {
                    Some((id, n)) => (id, n.parse::<usize>().ok().filter(|&n| n > 0)),
                    None => (id, Some(0)),
                };
                let Some(rail) = rail else {
                    bail!("unknown listening socket {key:?}");
                };
                if let Some(b) = t.builders.iter_mut().find(|b| b.id.to_string() == id) {
                    match rail {
                        0 => b.listen = addr.clone(),
                        n => match b.rails.get_mut(n - 1) {
                            Some(a) => *a = addr.clone(),
                            None => bail!("unknown listening socket {key:?}"),
                        },
                    }
                }
            }
            Some(("readout", id)) => {
                if let Some(u) = t.readout_units.iter_mut().find(|u| u.id.to_string() == id) {
                    u.listen = addr.clone();
                }
            }
            _ => bail!("unknown listening socket {key:?}"),
        }
    }
    // The resolved text is the original (its digest names the configuration the operator
    // wrote); only the addresses change.
    let mut out = r.clone();
    out.topology = t;
    Ok(out)
}

/// One role of a topology, to run as its own process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Recorder,
    Builder(u32),
    Readout(u32),
    /// All the emulated sources.
    Sources,
    /// The event manager (request mode).
    EventManager,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            events: None,
            duration_s: None,
            output: None,
            status: StatusMode::Auto,
            stop: Arc::new(AtomicBool::new(false)),
            sink_at_builders: false,
            manifest: true,
            ready: None,
            only: None,
            run_number: None,
            roles: None,
            listeners: Listeners::default(),
            start_held: false,
            part: None,
            shipper: None,
        }
    }
}

/// Largest fragment on the wire for a payload bound.
pub fn max_fragment_wire(max_payload: usize) -> usize {
    MAX_HEADER_SIZE + max_payload.div_ceil(4) * 4 + TRAILER_SIZE
}

/// The components of a running topology.
pub struct Running {
    pub sources: Option<tessera_source::RunningSources>,
    pub readout_units: Vec<ReadoutUnit>,
    pub builders: Vec<BuilderUnit>,
    pub recorder: Option<Recorder>,
    pub manager: Option<tessera_manager::EventManager>,
    pub request_mode: bool,
    /// Builders of the whole topology (the recorder's upstream, wherever they run).
    pub builders_in_topology: u64,
}

/// A running topology (or the roles of it this process runs): started by [`Session::start`],
/// watched by [`Session::end_reason`] and [`Session::failure`], held by [`Session::pause`],
/// ended by [`Session::stop`] and [`Session::finish`]. The run control drives one per run.
pub struct Session {
    r: Resolved,
    shipper: Option<Arc<tessera_shipper::ShipperService>>,
    events: u64,
    duration: f64,
    only: Option<Role>,
    /// Only some roles run here (`tessera serve`, `tessera node`).
    partial: bool,
    manifest: bool,
    output: PathBuf,
    run_number: u64,
    started_unix_ns: u64,
    t0: Instant,
    pub(crate) running: Running,
    monitor: Option<(
        tessera_monitor::Monitor,
        Mutex<Option<tessera_monitor::Server>>,
    )>,
    status: Mutex<status::Status>,
    stop_flag: Arc<AtomicBool>,
    stop_begun: AtomicBool,
    /// When the whole stop must end, if `[stop] max_ms` is set.
    stop_cap: Mutex<Option<Instant>>,
    paused_at: Mutex<Option<Instant>>,
    paused_total: Mutex<Duration>,
    /// The emulated sources hold their triggers until every external source has said its hello
    /// (or `sources.external_wait_s` passed): a held run is paused by itself, so no event is
    /// triggered that an external source that has not connected yet would miss.
    held_for_external: AtomicBool,
}

/// What a component is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ComponentState {
    Running,
    Paused,
    Stopping,
    Finished,
    Failed,
}

/// One component of the running topology and its state.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Component {
    pub name: String,
    /// The host it runs on, in a run spread over hosts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    pub kind: String,
    pub state: ComponentState,
    /// Why it failed, in words; empty otherwise (or why an early end is none).
    pub detail: String,
    /// Why it failed, typed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<role::Failure>,
}

/// The deadline of each stage of a stop (`[stop]` in the topology).
#[derive(Clone, Debug)]
pub struct StopDeadlines {
    pub sources_ms: u64,
    pub readout_ms: u64,
    pub builders_ms: u64,
    pub recorder_ms: u64,
    /// After a stage's deadline, how long its components get to act on the abort.
    pub abort_grace_ms: u64,
    /// Cap on the whole stop; 0: none.
    pub max_ms: u64,
}

impl From<&tessera_config::StopSection> for StopDeadlines {
    fn from(s: &tessera_config::StopSection) -> Self {
        StopDeadlines {
            sources_ms: s.sources_ms,
            readout_ms: s.readout_ms,
            builders_ms: s.builders_ms,
            recorder_ms: s.recorder_ms,
            abort_grace_ms: s.abort_grace_ms,
            max_ms: s.max_ms,
        }
    }
}

/// The stages of a stop, in the direction of the data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopStage {
    Sources,
    Readout,
    Builders,
    Recorder,
}

impl StopStage {
    pub const ALL: [StopStage; 4] = [
        StopStage::Sources,
        StopStage::Readout,
        StopStage::Builders,
        StopStage::Recorder,
    ];
}

/// How one stage of a stop went.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StageReport {
    pub stage: String,
    pub deadline_ms: u64,
    pub elapsed_ms: u64,
    /// Whether it finished before its deadline.
    pub finished: bool,
    /// What it left when it did not.
    pub left: String,
}

/// How a stop went, stage by stage.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StopReport {
    pub stages: Vec<StageReport>,
    /// Every stage finished in time: nothing was given up.
    pub drained: bool,
    /// Every component's threads ended (false: some ignored even the abort and are left to the
    /// end of the process).
    pub all_finished: bool,
}

impl Session {
    /// Starts every component of the topology (sink first) and returns once all listen and the
    /// sources are connected.
    pub fn start(r: &Resolved, opts: &Options) -> Result<Session> {
        let t = &r.topology;
        let output = opts.output.clone().unwrap_or_else(|| t.run.output.clone());
        std::fs::create_dir_all(&output)
            .with_context(|| format!("creating output directory {}", output.display()))?;
        let sel: Option<RoleSet> = opts
            .roles
            .clone()
            .or_else(|| opts.only.map(|o| RoleSet::of_role(o, r)));
        let run_number = match opts.run_number.or(t.run.number) {
            Some(n) => n,
            None if sel.is_some() => bail!("{}: run.number: a role run as its own process needs the run number (set run.number or pass --run)", r.origin),
            None if opts.manifest => next_run_number(&output)?,
            None => 0,
        };
        if let (Some(role), None) = (opts.only, &opts.roles) {
            check_daemon_addresses(r, role)?;
        }
        // Peers beyond loopback only from the allowed networks (checked when the file loaded).
        tessera_net::io::allow_networks(t.security.networks().unwrap_or_default());
        tessera_net::reactor::set_moderation(Duration::from_micros(t.run.io_moderation_us));
        let duration = opts.duration_s.unwrap_or(t.run.duration_s);
        let started_unix_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let st = start::Starter::new(r, opts, sel.clone(), output.clone(), run_number);
        let events = st.events;
        // Sink first: the recorder (with the monitor), the event manager, the builders, the
        // readout units; then the sources, which connect to them.
        let monitor = st.monitor()?;
        let recorder = st.recorder(monitor.as_ref().map(|(m, _)| m))?;
        let recorder_for_builders = recorder
            .as_ref()
            .map(|(_, a)| a.clone())
            .or_else(|| st.recording().then(|| t.recorder.listen.clone()));
        let (manager, manager_addr) = st.event_manager()?;
        let (mut builders, builder_addrs) = st.push_builders(&recorder_for_builders)?;
        let listening = st.listening_sources()?;
        let (rus, ru_addrs) = st.readout_units(&builder_addrs, &manager_addr, &listening)?;
        builders.extend(st.pull_builders(&ru_addrs, &manager_addr, &recorder_for_builders)?);
        let wait_for_external =
            !t.sources.external.is_empty() && t.sources.external_wait_s > 0.0 && sel.is_none();
        let sources = st.sources(&ru_addrs, listening, wait_for_external || opts.start_held)?;
        let request_mode = st.request_mode();
        let runs_readout = |id: u32| st.runs_readout(id);
        let (recorder, _) = match recorder {
            Some((rec, a)) => (Some(rec), a),
            None => (None, String::new()),
        };
        // Where every role of this process listens, for programs (external sources, consumers,
        // scripts) to read: `addresses.json`, or `addresses.<role>.json` for a role run alone.
        {
            let file = match (opts.only, &opts.roles) {
                (_, Some(_)) => {
                    format!("addresses.{}.json", opts.part.as_deref().unwrap_or("part"))
                }
                (None, None) => "addresses.json".to_string(),
                (Some(Role::Recorder), _) => "addresses.recorder.json".into(),
                (Some(Role::Builder(i)), _) => format!("addresses.builder{i}.json"),
                (Some(Role::Readout(i)), _) => format!("addresses.readout{i}.json"),
                (Some(Role::Sources), _) => "addresses.sources.json".into(),
                (Some(Role::EventManager), _) => "addresses.manager.json".into(),
            };
            let json = serde_json::json!({
                "run": run_number,
                "readout_units": t.readout_units.iter().zip(&ru_addrs)
                    .filter(|(u, _)| runs_readout(u.id))
                    .map(|(u, a)| serde_json::json!({"id": u.id, "listen": a}))
                    .collect::<Vec<_>>(),
                "sources": r.source_ru.iter()
                    .filter(|(_, ru)| runs_readout(t.readout_units[**ru].id))
                    .map(|(s, ru)| serde_json::json!({"id": s, "connect": ru_addrs[*ru]}))
                    .collect::<Vec<_>>(),
                "builders": builders.iter()
                    .map(|b| serde_json::json!({"id": b.stats.id}))
                    .zip(&builder_addrs)
                    .map(|(mut v, a)| {
                        v["listen"] = a[0].clone().into();
                        if a.len() > 1 {
                            v["rails"] = a[1..].to_vec().into();
                        }
                        v
                    })
                    .collect::<Vec<_>>(),
                "recorder": recorder.as_ref().and(recorder_for_builders.clone()),
                "monitor": monitor.as_ref().map(|(_, s)| s.addr.to_string()),
                "event_manager": manager.as_ref().map(|_| manager_addr.clone()),
            });
            let path = output.join(&file);
            tessera_recorder::file_write_atomic(&path, &serde_json::to_vec_pretty(&json)?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        if let Some(tx) = &opts.ready {
            let _ = tx.try_send(
                r.source_ru
                    .iter()
                    .map(|(s, ru)| (*s, ru_addrs[*ru].clone()))
                    .collect(),
            );
        }
        let running = Running {
            sources,
            readout_units: rus,
            builders,
            recorder,
            manager,
            request_mode,
            builders_in_topology: t.builders.len() as u64,
        };
        let mut status =
            status::Status::new(opts.status, Duration::from_millis(t.run.status_interval_ms));
        status.shipper = opts.shipper.clone();
        let external_addrs: Vec<String> = t
            .sources
            .external
            .iter()
            .map(|s| format!("source {s} -> {}", ru_addrs[r.source_ru[s]]))
            .collect();
        if let Some((m, server)) = &monitor {
            let names = m.station_names();
            status.note(&format!(
            "monitor: consumers attach at {} (stations: {}; `tessera monitor stations --addr {}`)",
            server.addr,
            names.join(", "),
            server.addr
        ));
        }
        if !external_addrs.is_empty() {
            status.note(&format!(
                "waiting for external sources: {}",
                external_addrs.join(", ")
            ));
        }
        Ok(Session {
            r: r.clone(),
            shipper: opts.shipper.clone(),
            events,
            duration,
            only: opts.only,
            partial: sel.is_some(),
            manifest: opts.manifest,
            output,
            run_number,
            started_unix_ns,
            t0: Instant::now(),
            stop_begun: AtomicBool::new(false),
            stop_cap: Mutex::new(None),
            running,
            monitor: monitor.map(|(m, s)| (m, Mutex::new(Some(s)))),
            status: Mutex::new(status),
            stop_flag: opts.stop.clone(),
            paused_at: Mutex::new((wait_for_external || opts.start_held).then(Instant::now)),
            paused_total: Mutex::new(Duration::ZERO),
            held_for_external: AtomicBool::new(wait_for_external),
        })
    }

    pub fn run_number(&self) -> u64 {
        self.run_number
    }

    pub fn output(&self) -> &Path {
        &self.output
    }

    pub fn resolved(&self) -> &Resolved {
        &self.r
    }

    /// Time since the start, paused time included.
    pub fn elapsed(&self) -> Duration {
        self.t0.elapsed()
    }

    /// The monitor of this run, if it has one (in the recorder's process).
    pub fn monitor(&self) -> Option<&tessera_monitor::Monitor> {
        self.monitor.as_ref().map(|(m, _)| m)
    }

    /// Redraws the status line if its interval has passed.
    /// Injects an operator's fault into this process's roles (see [`fault`]).
    pub fn fault(&self, f: &fault::Fault) -> std::result::Result<String, String> {
        let checked = f.check()?;
        let d = f.duration();
        match checked {
            fault::Checked::Source(id, sf) => {
                let Some(src) = self.running.sources.as_ref() else {
                    return Err("this run has no emulated sources here".into());
                };
                let Some(st) = src.stats.iter().find(|s| s.id == id) else {
                    return Err(format!(
                        "source {id} is not an emulated source of this run (external sources are the front-ends' own)"
                    ));
                };
                if st.disconnected.load(Ordering::Relaxed) {
                    return Err(format!("source {id} is disconnected already"));
                }
                st.set_fault(sf, d);
                Ok(match sf {
                    tessera_source::SourceFault::Delay(x) => format!(
                        "source {id}: each fragment {} ms late for {} s",
                        x.as_millis(),
                        f.seconds
                    ),
                    tessera_source::SourceFault::Inject(tessera_config::InjectKind::Disconnect) => {
                        format!("source {id}: disconnected at its next trigger (for good)")
                    }
                    tessera_source::SourceFault::Inject(_) => {
                        format!("source {id}: {} on every event for {} s", f.kind, f.seconds)
                    }
                })
            }
            fault::Checked::RecorderThrottle(rate) => {
                let Some(rec) = self.running.recorder.as_ref() else {
                    return Err("this run has no recorder here".into());
                };
                *rec.stats.throttle_fault.lock() = Some((rate, std::time::Instant::now() + d));
                Ok(format!(
                    "recorder: writes held to {} for {} s",
                    report::human_bytes(rate as f64) + "/s",
                    f.seconds
                ))
            }
        }
    }

    pub fn tick_status(&self, phase: &str) {
        self.status
            .lock()
            .tick(&self.running, self.t0.elapsed(), phase);
    }

    pub fn note(&self, msg: &str) {
        self.status.lock().note(msg);
    }

    /// Why the run should end now, if it should: its duration passed, every source ended its
    /// stream, a stop was asked for from outside. `None`: it goes on.
    pub fn end_reason(&self) -> Option<&'static str> {
        self.release_when_external_sources_connected();
        let running = &self.running;
        if self.stop_flag.load(Ordering::Relaxed) {
            return Some("interrupted");
        }
        // The disk fell below its hard watermark: stop now, cleanly, while there is room for
        // what is in flight, the trailers, the manifest and the run database.
        if running
            .recorder
            .as_ref()
            .is_some_and(|r| r.stats.disk_full.load(Ordering::Acquire))
        {
            return Some("disk full");
        }
        let active = self.t0.elapsed().saturating_sub(self.paused_for());
        if self.duration > 0.0 && active.as_secs_f64() >= self.duration {
            return Some("duration");
        }
        // A role run alone (other than the sources) ends when it has finished: its upstream
        // peers ended their streams and it passed everything on.
        if self.only.is_some_and(|role| role != Role::Sources) {
            return all_finished(running).then_some("finished");
        }
        // The run ends by itself once every source has ended its stream: the emulated ones when
        // they reach their event count, external ones when they send their end of stream (or
        // drop their connection). An external source that has not ended keeps the run going
        // until the duration or a stop.
        let emulated_done = running.sources.as_ref().is_none_or(|s| s.all_finished());
        if emulated_done && external_links_done(running, &self.r) {
            return Some(if self.events > 0 && running.sources.is_some() {
                "events"
            } else {
                "sources ended"
            });
        }
        None
    }

    /// The first component found failed, with the reason: the run cannot go on as configured.
    /// A component that ended by itself while the run goes on has failed too.
    /// Asked every 10 ms by the run control: no name or detail is built unless a component
    /// failed (at 76 roles, formatting them all was most of the run control's CPU).
    pub fn failure(&self) -> Option<role::Failed> {
        let stopping = self.stop_begun.load(Ordering::Relaxed);
        self.running.roles().find_map(|role| {
            let (_, failure) = self.role_state(role, stopping);
            failure.map(|f| role::Failed {
                subject: role.name(),
                reason: f.to_string(),
                failure: Some(f),
            })
        })
    }

    /// Whether `role` has finished, and its failure if it failed. A role finishes normally
    /// once what feeds it has or a stop has begun; finishing otherwise is a failure.
    fn role_state(
        &self,
        role: &dyn role::RunRole,
        stopping: bool,
    ) -> (bool, Option<role::Failure>) {
        let finished = role.is_finished();
        let failure = role.failure().or_else(|| {
            (finished && !role.upstream_done(&self.running) && !stopping)
                .then_some(role::Failure::EndedByItself)
        });
        (finished, failure)
    }

    /// Every component and its state.
    pub fn components(&self) -> Vec<Component> {
        let run = &self.running;
        let stopping = self.stop_begun.load(Ordering::Relaxed);
        run.roles()
            .map(|role| {
                let (finished, failure) = self.role_state(role, stopping);
                let state = match &failure {
                    Some(_) => ComponentState::Failed,
                    None if finished => ComponentState::Finished,
                    None if stopping => ComponentState::Stopping,
                    None if role.paused() => ComponentState::Paused,
                    None => ComponentState::Running,
                };
                let detail = match &failure {
                    Some(f) => f.to_string(),
                    None if finished => role.note(run).unwrap_or_default(),
                    None => String::new(),
                };
                Component {
                    name: role.name(),
                    host: None,
                    kind: role.kind().into(),
                    state,
                    detail,
                    failure,
                }
            })
            .collect()
    }

    /// Holds the triggers of the emulated sources (external sources cannot be told: the wire
    /// protocol has no pause). Everything already triggered is still built and recorded.
    pub fn pause(&self) {
        if let Some(s) = &self.running.sources {
            s.pause();
        }
        let mut p = self.paused_at.lock();
        if p.is_none() {
            *p = Some(Instant::now());
        }
    }

    pub fn resume(&self) {
        // Held for external sources: only their hellos (or the wait's end) release the run.
        if self.held_for_external.load(Ordering::Acquire) {
            return;
        }
        if let Some(s) = &self.running.sources {
            s.resume();
        }
        if let Some(t) = self.paused_at.lock().take() {
            *self.paused_total.lock() += t.elapsed();
        }
    }

    /// Holds the triggers (as [`pause`](Self::pause)) and says where this process's sources
    /// end: one past the highest event ID they claimed (0 without emulated sources here).
    pub fn hold_triggers(&self) -> u64 {
        self.pause();
        self.running.sources.as_ref().map_or(0, |s| s.claimed())
    }

    /// Has this process's held sources send up to `end` (exclusive), the highest any host's
    /// sources claimed.
    pub fn align_triggers(&self, end: u64) {
        if let Some(s) = &self.running.sources {
            s.align(end);
        }
    }

    /// Whether every source of this process has ended its stream: its emulated sources reached
    /// their count, and every external source read here sent its end (or dropped its link).
    pub fn sources_ended(&self) -> bool {
        self.running
            .sources
            .as_ref()
            .is_none_or(|s| s.all_finished())
            && external_links_done(&self.running, &self.r)
    }

    /// The recorder here fell below its hard disk watermark.
    pub fn disk_full(&self) -> bool {
        self.running
            .recorder
            .as_ref()
            .is_some_and(|r| r.stats.disk_full.load(Ordering::Acquire))
    }

    /// Whether the run still holds its triggers for external sources that have not connected.
    pub fn waiting_for_external_sources(&self) -> bool {
        self.held_for_external.load(Ordering::Acquire)
    }

    /// Releases the held triggers once every external source has said its hello, or once
    /// `sources.external_wait_s` passed (then naming the ones that did not come: their
    /// fragments are missing from every event).
    fn release_when_external_sources_connected(&self) {
        if !self.held_for_external.load(Ordering::Acquire) {
            return;
        }
        let waiting: std::collections::HashSet<u32> = self
            .running
            .readout_units
            .iter()
            .flat_map(|u| u.stats.links.iter())
            .filter(|l| l.state() == tessera_readout::LinkState::Waiting)
            .map(|l| l.source_id)
            .collect();
        if !external_sources_ready(
            &self.r,
            |id| !waiting.contains(&id),
            self.t0.elapsed().as_secs_f64(),
        ) {
            return;
        }
        if self.held_for_external.swap(false, Ordering::AcqRel) {
            self.resume();
        }
    }

    fn paused_for(&self) -> Duration {
        *self.paused_total.lock()
            + self
                .paused_at
                .lock()
                .map_or(Duration::ZERO, |t| t.elapsed())
    }

    /// Stops in stages, in the direction of the data: sources end their streams, readout units
    /// send what they hold, builders finish, the recorder closes its files. A stage's deadline
    /// runs from the last time data moved anywhere in the system, so a stage that drains (a slow
    /// disk working through a backlog) is never cut short; one that makes no progress for its
    /// deadline gives up on what it still holds, which the stage's report names. So a stop ends
    /// even when every queue is full and nothing moves. `max_ms`, when set, caps the whole stop.
    pub fn stop(&self, deadlines: &StopDeadlines) -> StopReport {
        self.stop_begin(deadlines);
        let stages: Vec<StageReport> = StopStage::ALL
            .iter()
            .map(|&stage| self.stop_stage(stage, deadlines))
            .collect();
        self.stop_report(stages)
    }

    /// The first step of a stop: every component is told at once. Each finishes once its
    /// upstream has ended (a stop is not an abort), so telling all at once loses nothing and
    /// lets the stages overlap. A run spread over hosts does this on every host, then each
    /// [`stop_stage`](Self::stop_stage) on every host before the next.
    pub fn stop_begin(&self, deadlines: &StopDeadlines) {
        self.stop_begun.store(true, Ordering::Relaxed);
        *self.stop_cap.lock() = (deadlines.max_ms > 0)
            .then(|| Instant::now() + Duration::from_millis(deadlines.max_ms));
        let run = &self.running;
        // A blocking station whose consumer holds it (stopped, hung) must not stall the drain
        // until the readout and builder stages give up what they hold: from now on it no
        // longer holds the recorder (what it misses is counted at the station).
        if let Some((m, _)) = &self.monitor {
            m.release_holds();
        }
        // A paused run has its triggers held: let the sources reach their common last trigger.
        // Stopping before resuming: no trigger is claimed in between (a host of a run spread
        // over hosts has had its last trigger aligned with the others').
        if let Some(s) = &run.sources {
            s.stop();
            s.resume();
        }
        for u in &run.readout_units {
            u.stop();
        }
        for b in &run.builders {
            b.stop();
        }
        if let Some(m) = &run.manager {
            m.stop();
        }
        if let Some(rec) = &run.recorder {
            rec.stop();
        }
    }

    /// The stop's report from its stages' reports.
    pub fn stop_report(&self, stages: Vec<StageReport>) -> StopReport {
        let drained = stages.iter().all(|s| s.finished);
        if !drained {
            self.note("stop: a stage passed its deadline; what it left is in the report");
        }
        StopReport {
            stages,
            drained,
            all_finished: all_finished(&self.running),
        }
    }

    /// One stage of a stop (after [`stop_begin`](Self::stop_begin)): waits for this process's
    /// roles of the stage, and past the deadline gives up on what they hold.
    pub fn stop_stage(&self, stage: StopStage, deadlines: &StopDeadlines) -> StageReport {
        let run = &self.running;
        let grace = Duration::from_millis(deadlines.abort_grace_ms);
        let (name, ms, phase) = match stage {
            StopStage::Sources => ("sources", deadlines.sources_ms, "stopping: sources"),
            StopStage::Readout => ("readout", deadlines.readout_ms, "stopping: readout units"),
            StopStage::Builders => ("builders", deadlines.builders_ms, "stopping: builders"),
            StopStage::Recorder => ("recorder", deadlines.recorder_ms, "stopping: recorder"),
        };
        let of_stage = || run.roles().filter(move |r| r.stage() == stage);
        let stage_done = || of_stage().all(|r| r.is_finished());
        let t = Instant::now();
        let done = self.wait_stage(ms, phase, stage_done);
        let mut left = String::new();
        if !done {
            let open: Vec<&dyn role::RunRole> = of_stage().filter(|r| !r.is_finished()).collect();
            left = open.iter().map(|r| r.left()).collect::<Vec<_>>().join("; ");
            match stage {
                // Nothing to abort: the sources held by back-pressure are cut at their
                // readout links in the next stage.
                StopStage::Sources => {}
                StopStage::Recorder => {
                    // A consumer of a blocking station that stopped taking events must not hold
                    // the stop: the monitor is closed first, and the recorder goes on without it.
                    if let Some((m, _)) = &self.monitor {
                        m.close();
                    }
                    if wait_until(grace, stage_done) {
                        left = "the monitor was closed (a blocking station may have held the recorder) and the recorder finished".into();
                    } else {
                        for r in &open {
                            r.abort();
                        }
                        wait_until(grace, stage_done);
                    }
                }
                StopStage::Readout | StopStage::Builders => {
                    for r in &open {
                        r.abort();
                    }
                    // Readout units that give up end their announcements: the event manager,
                    // which waits on them, is told to end too.
                    if stage == StopStage::Readout {
                        if let Some(m) = &run.manager {
                            m.abort();
                        }
                    }
                    wait_until(grace, stage_done);
                }
            }
        }
        StageReport {
            stage: name.into(),
            deadline_ms: ms,
            elapsed_ms: t.elapsed().as_millis() as u64,
            finished: done,
            left,
        }
    }

    /// Waits until `done`, or until nothing moved for `ms` (or the stop's cap passed).
    fn wait_stage(&self, ms: u64, phase: &str, done: impl Fn() -> bool) -> bool {
        // Quiet time is runnable time (`tessera_net::clock`): a stall of the host in the middle
        // of a stop is no stage standing still. The stop's cap is wall time.
        let quiet_for = ms.saturating_mul(1_000_000);
        let cap = *self.stop_cap.lock();
        let clock = tessera_net::clock::Runnable::start();
        let mut moved = self.moved();
        let mut last_move = clock.now_ns();
        loop {
            if done() {
                return true;
            }
            let now = clock.now_ns();
            let m = self.moved();
            if m != moved {
                moved = m;
                last_move = now;
            }
            if now.saturating_sub(last_move) >= quiet_for
                || cap.is_some_and(|c| Instant::now() >= c)
            {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
            self.tick_status(phase);
        }
    }

    /// Bytes moved so far by every role: sent by sources, read and forwarded by readout units,
    /// built, and recorded. Any change means the system still makes progress.
    fn moved(&self) -> u64 {
        self.running.roles().map(|r| r.progress()).sum()
    }

    /// What every component counted so far (live, while the run goes on), as the report.
    pub fn report(&self, stop_reason: &str, drained: bool) -> Report {
        let mut report = report::Report::collect(
            &self.r,
            &self.running,
            report::RunInfo {
                run_number: self.run_number,
                started_unix_ns: self.started_unix_ns,
                duration_s: self.t0.elapsed().as_secs_f64(),
                stop_reason: stop_reason.into(),
                drained,
                output: self.output.display().to_string(),
                partial: self.partial,
            },
        );
        report.monitor = self.monitor.as_ref().map(|(m, _)| m.status());
        report
    }

    /// Ends the session after [`stop`](Self::stop): closes the monitor, joins what finished,
    /// writes the manifest. Components that ignored even the abort are left to the end of the
    /// process rather than joined: a stop must not hang.
    pub fn finish(self, stop_reason: &str, stop: StopReport) -> Result<Report> {
        self.status.lock().finish(&self.running, self.t0.elapsed());
        let mut report = self.report(stop_reason, stop.drained);
        report.stop = Some(stop);
        if let Some((m, server)) = &self.monitor {
            m.close();
            if let Some(mut s) = server.lock().take() {
                s.stop();
            }
        }
        let Session {
            running,
            manifest,
            output,
            run_number,
            shipper,
            ..
        } = self;
        let Running {
            sources,
            readout_units,
            builders,
            recorder,
            manager,
            ..
        } = running;
        if let Some(m) = manager.filter(|m| m.is_finished()) {
            m.join();
        }
        if let Some(s) = sources.filter(|s| s.threads_finished()) {
            s.join();
        }
        for u in readout_units.into_iter().filter(|u| u.is_finished()) {
            u.join();
        }
        for b in builders.into_iter().filter(|b| b.is_finished()) {
            b.join();
        }
        if let Some(rec) = recorder.filter(|r| r.is_finished()) {
            rec.join();
        }
        if manifest {
            // A manifest that cannot be written (a full disk) does not lose the run's summary:
            // the report says what was not kept, and the files finished are on disk.
            let path = output.join(format!("run{run_number:06}.manifest.json"));
            let json = serde_json::to_vec_pretty(&report)?;
            if let Err(e) = tessera_recorder::file_write_atomic(&path, &json) {
                tracing::error!(error = %e, path = %path.display(), "cannot write the run's manifest");
                report.not_kept.push(format!(
                    "the manifest {}: {e} (the report above is all of it)",
                    path.display()
                ));
            }
        }
        // Its last files and its manifest are ready: they ship now, not at the next interval.
        if let Some(s) = shipper {
            s.kick();
        }
        Ok(report)
    }
}

/// A run the run control drives: one in this process ([`Session`]), or one spread over hosts
/// whose parts are sessions in node agents (`tessera-node`). The controller, the HTTP API and
/// the metrics see both through this alone.
pub trait RunSession: Send + Sync {
    fn run_number(&self) -> u64;
    /// The monitor, where it runs in this process.
    fn monitor(&self) -> Option<&tessera_monitor::Monitor>;
    /// Where the monitor listens when it runs in another process (the recorder's host of a run
    /// spread over hosts): consumers attach there over docs/monitor-protocol.md.
    fn monitor_address(&self) -> Option<String> {
        None
    }
    fn tick_status(&self, phase: &str);
    /// Why the run should end now, if it should (see [`Session::end_reason`]).
    fn end_reason(&self) -> Option<String>;
    /// The first component found failed, with the reason (and its host, if elsewhere).
    fn failure(&self) -> Option<role::Failed>;
    fn components(&self) -> Vec<Component>;
    fn pause(&self);
    fn resume(&self);
    /// Stops in stages with their deadlines (see [`Session::stop`]).
    fn stop(&self, deadlines: &StopDeadlines) -> StopReport;
    /// What every component counted so far.
    fn report(&self, stop_reason: &str, drained: bool) -> Report;
    fn live(&self) -> live::Live;
    fn why_incomplete(&self, event_id: u64) -> live::WhyIncomplete;
    /// Ends the run after the stop: its report, the manifest written.
    fn finish(self: Box<Self>, stop_reason: &str, stop: StopReport) -> Result<Report>;
    /// Injects an operator's fault ([`fault::Fault`]), time-boxed; what it did, in words, or
    /// why it was refused.
    fn fault(&self, f: &fault::Fault) -> std::result::Result<String, String>;
}

impl RunSession for Session {
    fn run_number(&self) -> u64 {
        Session::run_number(self)
    }
    fn fault(&self, f: &fault::Fault) -> std::result::Result<String, String> {
        Session::fault(self, f)
    }
    fn monitor(&self) -> Option<&tessera_monitor::Monitor> {
        Session::monitor(self)
    }
    fn tick_status(&self, phase: &str) {
        Session::tick_status(self, phase)
    }
    fn end_reason(&self) -> Option<String> {
        Session::end_reason(self).map(String::from)
    }
    fn failure(&self) -> Option<role::Failed> {
        Session::failure(self)
    }
    fn components(&self) -> Vec<Component> {
        Session::components(self)
    }
    fn pause(&self) {
        Session::pause(self)
    }
    fn resume(&self) {
        Session::resume(self)
    }
    fn stop(&self, deadlines: &StopDeadlines) -> StopReport {
        Session::stop(self, deadlines)
    }
    fn report(&self, stop_reason: &str, drained: bool) -> Report {
        Session::report(self, stop_reason, drained)
    }
    fn live(&self) -> live::Live {
        Session::live(self)
    }
    fn why_incomplete(&self, event_id: u64) -> live::WhyIncomplete {
        Session::why_incomplete(self, event_id)
    }
    fn finish(self: Box<Self>, stop_reason: &str, stop: StopReport) -> Result<Report> {
        Session::finish(*self, stop_reason, stop)
    }
}

/// Runs the topology to its end and returns the report (also written as the run manifest).
pub fn run(r: &Resolved, opts: &Options) -> Result<Report> {
    run_watched(r, opts, |_| {})
}

/// [`run`], showing the running session to `watch` every 5 ms: for a benchmark that measures a
/// steady part of the run rather than the whole, start and end included.
pub fn run_watched(
    r: &Resolved,
    opts: &Options,
    mut watch: impl FnMut(&Session),
) -> Result<Report> {
    let session = Session::start(r, opts)?;
    let stop_reason = loop {
        std::thread::sleep(Duration::from_millis(5));
        session.tick_status("running");
        watch(&session);
        if let Some(reason) = session.end_reason() {
            break reason;
        }
        if let Some(rec) = &session.running.recorder {
            if rec.stats.error.lock().is_some() {
                break "recorder error";
            }
        }
    };
    let stop = session.stop(&StopDeadlines::from(&r.topology.stop));
    session.finish(stop_reason, stop)
}

/// Waits until `done` or `limit`; whether it is done.
fn wait_until(limit: Duration, done: impl Fn() -> bool) -> bool {
    let t = Instant::now();
    while !done() && t.elapsed() < limit {
        std::thread::sleep(Duration::from_millis(5));
    }
    done()
}

/// Whether a run held for its external sources may release its triggers: every external
/// source `connected` (its link has seen the hello), or `sources.external_wait_s` passed
/// (`waited_s`). Says which in the log when it may. Shared by a run in one process and the
/// run control of a run over hosts.
pub fn external_sources_ready(
    r: &Resolved,
    connected: impl Fn(u32) -> bool,
    waited_s: f64,
) -> bool {
    let s = &r.topology.sources;
    let missing: Vec<u32> = s
        .external
        .iter()
        .copied()
        .filter(|&id| !connected(id))
        .collect();
    if missing.is_empty() {
        tracing::info!("every external source connected: the emulated sources start");
        return true;
    }
    if waited_s < s.external_wait_s {
        return false;
    }
    tracing::warn!(
        ?missing,
        waited_s,
        "external sources not connected after sources.external_wait_s: the run starts without them"
    );
    true
}

/// A role run alone reaches its peers at their configured addresses: those need fixed ports.
fn check_daemon_addresses(r: &Resolved, role: Role) -> Result<()> {
    let t = &r.topology;
    let port0 = |a: &str| a.rsplit_once(':').is_some_and(|(_, p)| p == "0");
    let mut peers: Vec<(String, &str)> = Vec::new();
    let request = t.run.mode == tessera_config::Mode::Request;
    if role == Role::EventManager && !request {
        bail!(
            "{}: run.mode: the event manager runs in request mode only",
            r.origin
        );
    }
    match role {
        Role::Sources => peers.extend(
            t.readout_units
                .iter()
                .enumerate()
                .map(|(i, u)| (format!("readout[{i}].listen"), u.listen.as_str())),
        ),
        Role::Readout(_) if request => peers.push((
            "event_manager.listen".into(),
            t.event_manager.listen.as_str(),
        )),
        Role::Readout(_) => {
            for (i, b) in t.builders.iter().enumerate() {
                peers.push((format!("builder[{i}].listen"), b.listen.as_str()));
                peers.extend(
                    b.rails
                        .iter()
                        .enumerate()
                        .map(|(j, a)| (format!("builder[{i}].rails[{j}]"), a.as_str())),
                );
            }
        }
        Role::Builder(id) => {
            if let Some((i, b)) = t.builders.iter().enumerate().find(|(_, b)| b.id == id) {
                // Its further rails are its own ports, fixed as its listen is.
                peers.extend(
                    b.rails
                        .iter()
                        .enumerate()
                        .map(|(j, a)| (format!("builder[{i}].rails[{j}]"), a.as_str())),
                );
            }
            if t.recorder.enabled {
                peers.push(("recorder.listen".into(), t.recorder.listen.as_str()));
            }
            if request {
                peers.push((
                    "event_manager.listen".into(),
                    t.event_manager.listen.as_str(),
                ));
                peers.extend(
                    t.readout_units
                        .iter()
                        .enumerate()
                        .map(|(i, u)| (format!("readout[{i}].listen"), u.listen.as_str())),
                );
            }
        }
        Role::Recorder | Role::EventManager => {}
    }
    let own = match role {
        Role::Recorder => Some(("recorder.listen".to_string(), t.recorder.listen.as_str())),
        Role::Builder(id) => t.builders.iter().position(|b| b.id == id).map(|i| {
            (
                format!("builder[{i}].listen"),
                t.builders[i].listen.as_str(),
            )
        }),
        Role::Readout(id) => t.readout_units.iter().position(|u| u.id == id).map(|i| {
            (
                format!("readout[{i}].listen"),
                t.readout_units[i].listen.as_str(),
            )
        }),
        Role::EventManager => Some((
            "event_manager.listen".to_string(),
            t.event_manager.listen.as_str(),
        )),
        Role::Sources => None,
    };
    // A request-mode builder only connects: it has no address of its own to fix.
    let own = own.filter(|_| !(request && matches!(role, Role::Builder(_))));
    match (role, &own) {
        (Role::Builder(id), _) if !t.builders.iter().any(|b| b.id == id) => {
            bail!("{}: builder: no builder with id {id}", r.origin)
        }
        (Role::Readout(id), None) => bail!("{}: readout: no readout unit with id {id}", r.origin),
        _ => {}
    }
    for (key, addr) in own.into_iter().chain(peers) {
        if port0(addr) {
            bail!("{}: {key}: port 0 (any free port) cannot be found by another process; give a fixed port, e.g. 127.0.0.1:7100", r.origin);
        }
    }
    Ok(())
}

/// Whether every external source's link has ended (cleanly or not).
fn external_links_done(run: &Running, r: &Resolved) -> bool {
    let external: std::collections::HashSet<u32> =
        r.topology.sources.external.iter().copied().collect();
    run.readout_units
        .iter()
        .flat_map(|u| u.stats.links.iter())
        .filter(|l| external.contains(&l.source_id))
        .all(|l| l.state().ended())
}

fn all_finished(r: &Running) -> bool {
    r.roles().all(|x| x.is_finished())
}

/// One more than the highest run number recorded in `dir` (by its `last_run` file).
fn next_run_number(dir: &Path) -> Result<u64> {
    let p = dir.join("last_run");
    let last = match std::fs::read_to_string(&p) {
        Ok(s) => s
            .trim()
            .parse::<u64>()
            .with_context(|| format!("{} does not hold a run number", p.display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
        Err(e) => bail!("reading {}: {e}", p.display()),
    };
    let next = last + 1;
    tessera_recorder::file_write_atomic(&p, format!("{next}\n").as_bytes())
        .with_context(|| format!("writing {}", p.display()))?;
    Ok(next)
}

//! The controller: carries out transitions on the whole system, watches the running session
//! (a run that ends by itself, a component that fails), and records every run and every
//! state-changing action in the run database.
//!
//! One transition at a time: a second request while one is under way is refused (`busy`), not
//! queued, so that an operator never sees a stale click carried out later.

use anyhow::{anyhow, Context, Result};
use parking_lot::{Condvar, Mutex};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tessera_config::Resolved;
use tessera_node::Cluster;
use tessera_run::{Report, RunSession, Session, StopDeadlines, StopReport};

/// The open run, as the API and the watcher share it: in this process or over hosts.
pub type OpenRun = Arc<Box<dyn RunSession>>;
use tessera_rundb::{ActionRow, FileRow, RunDb, RunEnd, RunStart};

use crate::alarms::{Alarms, Look};
use crate::sampler::Sampler;
use crate::state::{State, Transition};

/// Where the controller takes its topology from, and what the command line overrides.
#[derive(Clone, Debug, Default)]
pub struct ControlOptions {
    /// Topology file; `None`: the built-in demo. Read again at every `configure`, so that an
    /// edited file takes effect without restarting.
    pub config: Option<PathBuf>,
    pub events: Option<u64>,
    pub duration_s: Option<f64>,
    pub output: Option<PathBuf>,
    pub status: Option<tessera_run::StatusMode>,
    /// `KEY=VALUE`s set in the topology's text at every configure (`tessera run --set`).
    pub sets: Vec<String>,
}

/// A refused or failed transition.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("cannot {transition} in state {state}; allowed here: {allowed}")]
    Illegal {
        transition: Transition,
        state: State,
        allowed: String,
    },
    #[error("a {0} is under way; try again when it is done")]
    Busy(Transition),
    #[error("{transition} failed: {reason}")]
    Failed {
        transition: Transition,
        reason: String,
    },
    #[error("no run is open")]
    NoRun,
    /// The request itself is refused before anything happens (a comment too long).
    #[error("{0}")]
    BadRequest(String),
    /// A well-formed request this run cannot take (a fault into a run not taking data, or
    /// into a source it does not have).
    #[error("{0}")]
    Conflict(String),
}

/// The state as the API shows it.
#[derive(Clone, Debug, Serialize)]
pub struct StateView {
    pub state: State,
    /// A transition under way (a stop can take up to the sum of its stages' deadlines).
    pub busy: Option<Transition>,
    pub allowed: Vec<Transition>,
    /// The open run, or the last one.
    pub run_number: Option<u64>,
    /// Why the system is in error.
    pub error: Option<String>,
    pub since_unix_ns: u64,
    pub config_origin: Option<String>,
    pub components: Vec<tessera_run::Component>,
    /// How the last stop went, stage by stage.
    pub last_stop: Option<StopReport>,
}

struct Ctl {
    state: State,
    busy: Option<Transition>,
    resolved: Option<Resolved>,
    session: Option<OpenRun>,
    /// With `[hosts]`: every host's node agent, from the configure to the reset.
    cluster: Option<Arc<Cluster>>,
    run_number: Option<u64>,
    error: Option<String>,
    since_unix_ns: u64,
    last_stop: Option<StopReport>,
    last_report: Option<Arc<Report>>,
    db: Option<Arc<RunDb>>,
    /// This process's hold on the output directory (see `recovery::lock_output`).
    output_lock: Option<(std::path::PathBuf, std::fs::File)>,
    /// `[shipper]` of a run in this process: from the configure on, across runs.
    shipper: Option<tessera_run::shipping::HeldShipper>,
}

pub(crate) struct Shared {
    opts: ControlOptions,
    ctl: Mutex<Ctl>,
    changed: Condvar,
    /// Raised by Ctrl-C: the open run stops as if asked.
    pub interrupt: Arc<AtomicBool>,
    pub sampler: Mutex<Sampler>,
    pub alarms: Mutex<Alarms>,
    /// Fault rehearsals under way (until their time is up).
    faults: Mutex<Vec<tessera_rundb::FaultRow>>,
    closing: AtomicBool,
}

/// The run control of one process. Cheap to clone; every clone drives the same system.
#[derive(Clone)]
pub struct Controller {
    pub(crate) shared: Arc<Shared>,
}

/// Fault rehearsals listed as under way at once.
const MAX_ACTIVE_FAULTS: usize = 1000;

pub fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

impl Controller {
    /// A controller in state `initial`, with its watcher thread.
    pub fn new(opts: ControlOptions, interrupt: Arc<AtomicBool>) -> Controller {
        let shared = Arc::new(Shared {
            opts,
            ctl: Mutex::new(Ctl {
                state: State::Initial,
                busy: None,
                resolved: None,
                session: None,
                cluster: None,
                run_number: None,
                error: None,
                since_unix_ns: unix_ns(),
                last_stop: None,
                last_report: None,
                db: None,
                output_lock: None,
                shipper: None,
            }),
            changed: Condvar::new(),
            interrupt,
            sampler: Mutex::new(Sampler::default()),
            alarms: Mutex::new(Alarms::default()),
            faults: Mutex::new(Vec::new()),
            closing: AtomicBool::new(false),
        });
        let c = Controller { shared };
        let w = c.clone();
        std::thread::Builder::new()
            .name("run-control".into())
            .spawn(move || w.watch())
            .expect("spawn the run control's watcher");
        c
    }

    /// Ends the watcher thread and the shipper (the process is about to exit; a copy under
    /// way is made again by the next shipper).
    pub fn close(&self) {
        self.shared.closing.store(true, Ordering::Relaxed);
        let held = self.shared.ctl.lock().shipper.take();
        tessera_run::shipping::stop(&mut { held });
    }

    /// The shipper of this process's data directory, where `[shipper]` names destinations and
    /// the recorder runs here (with `[hosts]`, the recorder's node agent runs it).
    pub fn shipper(&self) -> Option<Arc<tessera_shipper::ShipperService>> {
        self.shared
            .ctl
            .lock()
            .shipper
            .as_ref()
            .map(|h| h.service.clone())
    }

    pub fn state(&self) -> State {
        self.shared.ctl.lock().state
    }

    pub fn view(&self) -> StateView {
        let (mut v, session) = {
            let c = self.shared.ctl.lock();
            (
                StateView {
                    state: c.state,
                    busy: c.busy,
                    allowed: c.state.allowed(),
                    run_number: c.run_number,
                    error: c.error.clone(),
                    since_unix_ns: c.since_unix_ns,
                    config_origin: c.resolved.as_ref().map(|r| r.origin.clone()),
                    components: Vec::new(),
                    last_stop: c.last_stop.clone(),
                },
                c.session.clone(),
            )
        };
        if let Some(s) = session {
            v.components = s.components();
        }
        v
    }

    /// The open session, if a run is open.
    pub fn session(&self) -> Option<OpenRun> {
        self.shared.ctl.lock().session.clone()
    }

    pub fn resolved(&self) -> Option<Resolved> {
        self.shared.ctl.lock().resolved.clone()
    }

    pub fn db(&self) -> Option<Arc<RunDb>> {
        self.shared.ctl.lock().db.clone()
    }

    /// The report of the last run that ended.
    /// The node agents serving `/metrics`, as Prometheus scrape targets (none without
    /// `[hosts]`).
    pub fn prometheus_targets(&self) -> serde_json::Value {
        self.shared
            .ctl
            .lock()
            .cluster
            .as_ref()
            .map_or(serde_json::json!([]), |c| c.prometheus_targets())
    }

    /// Injects an operator's fault into the running run, time-boxed; kept in the run database
    /// and the log with who asked, done or refused. Refused (before anything happens) when no
    /// run takes data, when the fault is malformed, or where the run could not survive it.
    pub fn fault(
        &self,
        who: &str,
        f: &tessera_run::fault::Fault,
    ) -> Result<tessera_rundb::FaultRow, ControlError> {
        let (state, busy, session, db, run) = {
            let c = self.shared.ctl.lock();
            (
                c.state,
                c.busy,
                c.session.clone(),
                c.db.clone(),
                c.run_number,
            )
        };
        let now = unix_ns();
        let result = match (f.check(), state, busy, session) {
            (Err(e), ..) => Err(ControlError::BadRequest(e)),
            (Ok(_), State::Running, None, Some(s)) => s.fault(f).map_err(ControlError::Conflict),
            _ => Err(ControlError::Conflict(format!(
                "a fault is injected into a run taking data; the system is {}",
                state.name()
            ))),
        };
        let row = tessera_rundb::FaultRow {
            run,
            unix_ns: now,
            who: who.into(),
            fault: serde_json::to_string(f).unwrap_or_default(),
            until_unix_ns: now.saturating_add(f.seconds.saturating_mul(1_000_000_000)),
            result: match &result {
                Ok(what) => format!("ok: {what}"),
                Err(e) => e.to_string(),
            },
        };
        match &result {
            Ok(what) => tracing::warn!(who, run, "fault injected by {who}: {what}"),
            Err(e) => tracing::info!(who, run, "fault refused: {e}"),
        }
        if let Some(db) = db {
            if let Err(e) = db.log_fault(&row) {
                tracing::error!(error = %e, "cannot keep a fault in the run database");
            }
        }
        if result.is_ok() {
            let mut active = self.shared.faults.lock();
            active.retain(|x| x.until_unix_ns > now);
            // A source holds one fault at a time (a new one replaces it); the list shown is
            // bounded all the same, the oldest going first.
            if active.len() >= MAX_ACTIVE_FAULTS {
                active.remove(0);
            }
            active.push(row.clone());
        }
        result.map(|_| row)
    }

    /// The faults under way now.
    pub fn faults(&self) -> Vec<tessera_rundb::FaultRow> {
        let now = unix_ns();
        let mut active = self.shared.faults.lock();
        active.retain(|x| x.until_unix_ns > now);
        active.clone()
    }

    /// The alarms raised now and the last cleared.
    pub fn alarms(&self) -> crate::alarms::AlarmsView {
        self.shared.alarms.lock().view()
    }

    pub fn last_report(&self) -> Option<Arc<Report>> {
        self.shared.ctl.lock().last_report.clone()
    }

    /// Waits until the state is one of `states` (or `timeout` passes); the state then.
    pub fn wait_for(&self, states: &[State], timeout: Option<Duration>) -> State {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut c = self.shared.ctl.lock();
        loop {
            if states.contains(&c.state) && c.busy.is_none() {
                return c.state;
            }
            match deadline {
                Some(d) => {
                    if self.shared.changed.wait_until(&mut c, d).timed_out() {
                        return c.state;
                    }
                }
                None => self.shared.changed.wait(&mut c),
            }
        }
    }

    /// Carries out transition `t` for `who` (logged with the result). `comment` is the
    /// operator's comment of the run a `start` opens (or of the run a `stop` closes).
    pub fn request(
        &self,
        t: Transition,
        who: &str,
        comment: Option<&str>,
    ) -> Result<StateView, ControlError> {
        if let Some(c) = comment.filter(|c| c.len() > tessera_rundb::MAX_COMMENT) {
            return Err(ControlError::BadRequest(format!(
                "comment of {} bytes: at most {}",
                c.len(),
                tessera_rundb::MAX_COMMENT
            )));
        }
        let (from, to) = {
            let mut c = self.shared.ctl.lock();
            if let Some(b) = c.busy {
                let e = ControlError::Busy(b);
                drop(c);
                self.log(who, t, "-", "-", &e.to_string(), None);
                return Err(e);
            }
            let from = c.state;
            let Some(to) = from.after(t) else {
                let e = ControlError::Illegal {
                    transition: t,
                    state: from,
                    allowed: names(&from.allowed()),
                };
                let run = c.run_number;
                drop(c);
                self.log(who, t, from.name(), from.name(), &e.to_string(), run);
                return Err(e);
            };
            c.busy = Some(t);
            (from, to)
        };
        tracing::info!(who, transition = %t, from = %from, "transition requested");
        let result = match t {
            Transition::Configure => self.configure(),
            Transition::Start => self.start(comment.unwrap_or(""), who),
            Transition::Pause => self.with_session(|s| s.pause()),
            Transition::Resume => self.with_session(|s| s.resume()),
            Transition::Stop => self
                .stop_run("stopped by operator", comment.map(|c| (c, who)))
                .map(|_| ()),
            Transition::Reset => {
                let cluster = {
                    let mut c = self.shared.ctl.lock();
                    c.resolved = None;
                    c.error = None;
                    c.cluster.take()
                };
                if let Some(cl) = cluster {
                    cl.reset();
                }
                Ok(())
            }
        };
        let run = self.shared.ctl.lock().run_number;
        match result {
            Ok(()) => {
                self.set_state(to, None);
                self.log(who, t, from.name(), to.name(), "ok", run);
                Ok(self.view())
            }
            Err(e) => {
                let reason = format!("{e:#}");
                // A transition that could not be carried out leaves the system in error: what
                // it did half-way is not a state an operator can reason about.
                self.set_state(State::Error, Some(format!("{t} failed: {reason}")));
                self.log(who, t, from.name(), "error", &reason, run);
                Err(ControlError::Failed {
                    transition: t,
                    reason,
                })
            }
        }
    }

    fn set_state(&self, s: State, error: Option<String>) {
        let mut c = self.shared.ctl.lock();
        c.state = s;
        c.busy = None;
        if error.is_some() || s == State::Initial {
            c.error = error;
        }
        c.since_unix_ns = unix_ns();
        drop(c);
        self.shared.changed.notify_all();
    }

    fn log(&self, who: &str, t: Transition, from: &str, to: &str, result: &str, run: Option<u64>) {
        let run_shown = run.map_or_else(|| "-".to_string(), |n| n.to_string());
        if result == "ok" {
            tracing::info!(who, run = %run_shown, transition = %t, from, to, "transition done");
        } else if who == "command line" {
            // The command prints the error itself: a warning too would say it twice.
            tracing::info!(who, run = %run_shown, transition = %t, from, result, "transition refused or failed");
        } else {
            tracing::warn!(who, run = %run_shown, transition = %t, from, result, "transition refused or failed");
        }
        let db = self.shared.ctl.lock().db.clone();
        if let Some(db) = db {
            let row = ActionRow {
                unix_ns: unix_ns(),
                who: who.into(),
                action: t.name().into(),
                from_state: from.into(),
                to_state: to.into(),
                result: result.into(),
                run,
            };
            if let Err(e) = db.log_action(&row) {
                tracing::error!(error = %e, "cannot log an action in the run database");
            }
        }
    }

    fn with_session(&self, f: impl FnOnce(&dyn RunSession)) -> Result<()> {
        let s = self.session().ok_or(ControlError::NoRun)?;
        f(s.as_ref().as_ref());
        Ok(())
    }

    fn configure(&self) -> Result<()> {
        let o = &self.shared.opts;
        let mut r = match &o.config {
            Some(p) => tessera_config::Topology::load_with(p, &o.sets)?,
            None => tessera_config::Topology::demo_with(&o.sets)?,
        };
        if let Some(out) = &o.output {
            r.topology.run.output = out.clone();
        }
        let t = &r.topology;
        std::fs::create_dir_all(&t.run.output)
            .with_context(|| format!("creating output directory {}", t.run.output.display()))?;
        let db_path = t.run.output.join(&t.control.database);
        let db = RunDb::open(&db_path)?;
        // The directory is this process's from here on (kept across configures of the same
        // one); what a crash left in it is closed before anything else is written there.
        let held = self
            .shared
            .ctl
            .lock()
            .output_lock
            .as_ref()
            .is_some_and(|(p, _)| *p == t.run.output);
        if !held {
            let lock = crate::recovery::lock_output(&t.run.output)?;
            // A run over hosts keeps its files on its recording hosts: the runs a crash left
            // open are closed once the hosts are configured and can say what they hold (below),
            // and stay open for the next configure if that fails.
            let over_hosts = !t.hosts.is_empty();
            let closed =
                crate::recovery::close_crashed(&t.run.output, (!over_hosts).then_some(&db))?;
            for r in &closed.recovered_files {
                eprintln!(
                    "recovered: {} ({} events in {} whole blocks{})",
                    r.file,
                    r.events,
                    r.blocks,
                    if r.dropped_bytes > 0 {
                        format!("; {} bytes of a cut block dropped", r.dropped_bytes)
                    } else {
                        String::new()
                    }
                );
            }
            for (run, events) in &closed.crashed_runs {
                eprintln!("run {run} was left running by a crash: closed as crashed ({events} events in its files)");
            }
            self.shared.ctl.lock().output_lock = Some((t.run.output.clone(), lock));
        }
        // A run spread over hosts: every host's agent checks its roles and binds their
        // sockets now, so that what is wrong anywhere is said before a start.
        let old = self.shared.ctl.lock().cluster.take();
        if let Some(old) = old {
            old.reset();
        }
        let cluster = if r.topology.hosts.is_empty() {
            None
        } else {
            let token = r.topology.control.effective_token().ok_or_else(|| {
                anyhow!(
                    "{}: control.token: a run spread over hosts needs the token its node agents hold (set control.token or TESSERA_TOKEN)",
                    r.origin
                )
            })?;
            let cluster = Cluster::configure(&r, &token).context("configuring the hosts")?;
            // A run a crash left open: closed with the files its recording hosts hold.
            for run in db.open_runs()? {
                let (files, recovered) = cluster.run_files(run).with_context(|| {
                    format!("counting the files of run {run}, left running by a crash, on its recording hosts")
                })?;
                let events = crate::recovery::close_crashed_on_hosts(&db, run, &files, &recovered)?;
                let row = db.get(run)?;
                cluster.await_crashed(
                    &r.topology.run.output,
                    run,
                    row.summary.started_unix_ns,
                    &row.summary.config_origin,
                    &row.config,
                )?;
                eprintln!(
                    "run {run} was left running by a crash: closed as crashed ({events} events in {} files on its recording hosts; {} unfinished files finished there)",
                    files.len(),
                    recovered.len()
                );
            }
            // A run that ended with hosts missing: completed with the reports they kept.
            for g in cluster.gather_kept_reports(&r.topology.run.output)? {
                let row = db.get(g.run)?.summary;
                record_end_as(
                    &db,
                    g.run,
                    &g.report,
                    &row.state,
                    row.error.as_deref(),
                    row.stopped_unix_ns.unwrap_or_else(unix_ns),
                )?;
                let b = &g.report.balance;
                eprintln!(
                    "run {}: the counts of {} gathered from the reports they kept; {}",
                    g.run,
                    g.hosts
                        .iter()
                        .map(|h| format!("host {h}"))
                        .collect::<Vec<_>>()
                        .join(", "),
                    if b.holds {
                        "its balance holds".to_string()
                    } else if !g.report.hosts_missing.is_empty() {
                        format!("{} host(s) still to report", g.report.hosts_missing.len())
                    } else {
                        format!("IMBALANCE: {} unaccounted", b.unaccounted)
                    }
                );
            }
            let targets = r
                .topology
                .run
                .output
                .join(&r.topology.control.prometheus_targets);
            let text = serde_json::to_vec_pretty(&cluster.prometheus_targets())?;
            tessera_recorder::file_write_atomic(&targets, &text)
                .with_context(|| format!("writing {}", targets.display()))?;
            Some(cluster)
        };
        self.shared.alarms.lock().clear_all(unix_ns());
        let mut c = self.shared.ctl.lock();
        if cluster.is_none() {
            tessera_run::shipping::ensure(&mut c.shipper, &r.topology, &r.topology.run.output)?;
        } else {
            tessera_run::shipping::stop(&mut c.shipper);
        }
        c.resolved = Some(r);
        c.db = Some(Arc::new(db));
        c.cluster = cluster;
        Ok(())
    }

    fn start(&self, comment: &str, who: &str) -> Result<()> {
        let (r, db) = {
            let c = self.shared.ctl.lock();
            (
                c.resolved
                    .clone()
                    .ok_or_else(|| anyhow!("not configured"))?,
                c.db.clone().ok_or_else(|| anyhow!("no run database"))?,
            )
        };
        let o = &self.shared.opts;
        let t = &r.topology;
        let output = t.run.output.clone();
        // Run numbers keep rising across the database and the `last_run` file that runs
        // without the run control (`tessera serve`, tests) advance.
        let last_file = output.join("last_run");
        let last = std::fs::read_to_string(&last_file)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(0);
        let at_least = t.run.number.unwrap_or(0).max(last + 1);
        let config = toml::to_string(t).context("writing the configuration as TOML")?;
        let started = unix_ns();
        let number = db.begin_run(
            at_least,
            &RunStart {
                config_origin: &r.origin,
                config_sha256: &hex::encode(r.digest),
                config: &config,
                started_unix_ns: started,
                comment,
                who,
            },
        )?;
        tessera_recorder::file_write_atomic(&last_file, format!("{number}\n").as_bytes())
            .with_context(|| format!("writing {}", last_file.display()))?;
        self.shared.interrupt.store(false, Ordering::Relaxed);
        let opts = tessera_run::Options {
            events: o.events,
            duration_s: o.duration_s,
            output: Some(output),
            status: o.status.unwrap_or(tessera_run::StatusMode::Off),
            stop: self.shared.interrupt.clone(),
            run_number: Some(number),
            shipper: self.shipper(),
            ..Default::default()
        };
        let cluster = self.shared.ctl.lock().cluster.clone();
        let started: Result<Box<dyn RunSession>> = match &cluster {
            Some(cl) => cl
                .start(number, &opts)
                .map(|s| Box::new(s) as Box<dyn RunSession>),
            None => Session::start(&r, &opts).map(|s| Box::new(s) as Box<dyn RunSession>),
        };
        let session = match started {
            Ok(s) => s,
            Err(e) => {
                let reason = format!("{e:#}");
                let _ = db.end_run(
                    number,
                    &RunEnd {
                        state: "error",
                        stopped_unix_ns: unix_ns(),
                        stop_reason: "start failed",
                        error: Some(&reason),
                        events: 0,
                        incomplete: 0,
                        bytes: 0,
                        recorded_events: 0,
                        balance_holds: None,
                        rejected: &Default::default(),
                        files: &[],
                        report_json: "null",
                    },
                );
                self.shared.ctl.lock().run_number = Some(number);
                return Err(e);
            }
        };
        self.shared.sampler.lock().reset();
        self.shared.alarms.lock().clear_all(unix_ns());
        let mut c = self.shared.ctl.lock();
        c.session = Some(Arc::new(session));
        c.run_number = Some(number);
        c.last_stop = None;
        Ok(())
    }

    /// Stops the open run in stages and records it. Returns the report.
    /// `comment` is the stop's comment and who gave it, kept among the run's notes.
    fn stop_run(&self, reason: &str, comment: Option<(&str, &str)>) -> Result<Arc<Report>> {
        let (session, db, r) = {
            let c = self.shared.ctl.lock();
            (
                c.session.clone().ok_or(ControlError::NoRun)?,
                c.db.clone(),
                c.resolved.clone(),
            )
        };
        let deadlines = r
            .as_ref()
            .map(|r| StopDeadlines::from(&r.topology.stop))
            .unwrap_or_else(|| StopDeadlines::from(&tessera_config::StopSection::default()));
        let stop = session.stop(&deadlines);
        drop(session);
        // Readers of the session (API calls) hold it only for a moment.
        let session = {
            let s = self
                .shared
                .ctl
                .lock()
                .session
                .take()
                .ok_or(ControlError::NoRun)?;
            let mut s = s;
            let mut tries = 0;
            loop {
                match Arc::try_unwrap(s) {
                    Ok(x) => break x,
                    Err(back) if tries < 5000 => {
                        s = back;
                        tries += 1;
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(_) => return Err(anyhow!("the run's session is still in use")),
                }
            }
        };
        let number = session.run_number();
        let mut report = session.finish(reason, stop.clone())?;
        {
            let sampler = self.shared.sampler.lock();
            report.bottlenecks = sampler.bottlenecks();
            if let Some(t) = report.trigger.as_mut() {
                t.vetoed_by = sampler.vetoed_by(t.vetoed);
            }
        }
        if let Some(db) = &db {
            // A run database that cannot take the run's end (a full disk) does not lose the
            // run's summary: the report says so, and `tessera recover` closes the run's row from
            // its files once there is room.
            let failed = self.shared.ctl.lock().error.clone();
            if let Err(e) = record_end(db, number, &report, failed.as_deref()) {
                tracing::error!(error = %e, "cannot record the run's end in the run database");
                report.not_kept.push(format!(
                    "the run's end: {e} (`tessera recover {}` closes the run from its files once there is room)",
                    db.path().parent().unwrap_or(std::path::Path::new(".")).display()
                ));
            }
        }
        let report = Arc::new(report);
        if let Some(db) = db {
            // The run's message log: every host's lines from its start to now.
            let lines: Vec<tessera_rundb::LogRow> = tessera_node::logbook::LOG
                .between(
                    report.started_unix_ns,
                    unix_ns(),
                    tessera_rundb::MAX_LOG_LINES,
                )
                .into_iter()
                .map(|l| tessera_rundb::LogRow {
                    unix_ns: l.unix_ns,
                    host: if l.host.is_empty() {
                        "run control".into()
                    } else {
                        l.host
                    },
                    role: l.role,
                    level: l.level,
                    message: l.message,
                })
                .collect();
            if let Err(e) = db.add_log(number, &lines) {
                tracing::error!(error = %e, "cannot keep the run's message log");
            }
            if let Some((text, who)) = comment.filter(|c| !c.0.is_empty()) {
                let note = tessera_rundb::NoteRow {
                    unix_ns: unix_ns(),
                    who: who.into(),
                    kind: "stop".into(),
                    text: text.into(),
                };
                if let Err(e) = db.add_note(number, &note) {
                    tracing::error!(error = %e, "cannot keep the stop's comment");
                }
            }
        }
        // Faults end with the run they were injected into.
        self.shared.faults.lock().clear();
        let mut c = self.shared.ctl.lock();
        c.last_stop = Some(stop);
        c.last_report = Some(report.clone());
        Ok(report)
    }

    /// Watches the open run: ends it when it ends by itself, puts the system in error when a
    /// component fails; feeds the sampler.
    fn watch(&self) {
        let t0 = Instant::now();
        let mut last_sample = Instant::now() - Duration::from_secs(60);
        let mut history = crate::history::HistoryWriter::default();
        while !self.shared.closing.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(10));
            let (state, busy, session, cluster, interval, alarms_cfg, run) = {
                let c = self.shared.ctl.lock();
                (
                    c.state,
                    c.busy,
                    c.session.clone(),
                    c.cluster.clone(),
                    c.resolved
                        .as_ref()
                        .map_or(500, |r| r.topology.control.sample_interval_ms),
                    c.resolved
                        .as_ref()
                        .map(|r| r.topology.alarms.clone())
                        .unwrap_or_default(),
                    c.run_number,
                )
            };
            if last_sample.elapsed() >= Duration::from_millis(interval) {
                last_sample = Instant::now();
                let live = session.as_ref().map(|s| s.live());
                let taking_data = state == State::Running
                    && busy.is_none()
                    && live.as_ref().is_some_and(|l| !l.paused);
                let (rates, point) = match &live {
                    Some(l) => {
                        let mut s = self.shared.sampler.lock();
                        s.push(l, taking_data);
                        (s.rates.clone(), s.history.back().cloned())
                    }
                    None => (None, None),
                };
                if let Some(db) = self.db() {
                    if let (true, Some(run), Some(p)) = (taking_data, run, &point) {
                        history.add(run, unix_ns(), p);
                    }
                    history.flush(&db, unix_ns(), !taking_data);
                }
                let lost = cluster.as_ref().map(|c| c.lost_hosts()).unwrap_or_default();
                self.shared.alarms.lock().evaluate(
                    &Look {
                        t: t0.elapsed().as_secs_f64(),
                        unix_ns: unix_ns(),
                        taking_data,
                        run,
                        live: live.as_ref(),
                        rates: rates.as_ref(),
                        point: point.as_ref(),
                        lost_hosts: &lost,
                    },
                    &alarms_cfg,
                );
            }
            let Some(session) = session else { continue };
            if busy.is_some() || !matches!(state, State::Running | State::Paused) {
                continue;
            }
            session.tick_status(if state == State::Paused {
                "paused"
            } else {
                "running"
            });
            if let Some(failed) = session.failure() {
                drop(session);
                self.fail(&failed);
            } else if let Some(reason) = session.end_reason() {
                drop(session);
                self.end_by_itself(&reason);
            }
        }
    }

    /// Claims the controller for an internal transition, unless an operator's is under way.
    fn claim(&self, t: Transition) -> Option<State> {
        let mut c = self.shared.ctl.lock();
        if c.busy.is_some() || !matches!(c.state, State::Running | State::Paused) {
            return None;
        }
        c.busy = Some(t);
        Some(c.state)
    }

    fn end_by_itself(&self, reason: &str) {
        let Some(from) = self.claim(Transition::Stop) else {
            return;
        };
        let who = format!("tessera (run ended: {reason})");
        match self.stop_run(reason, None) {
            Ok(_) => {
                self.set_state(State::Stopped, None);
                self.log(
                    &who,
                    Transition::Stop,
                    from.name(),
                    "stopped",
                    "ok",
                    self.run(),
                );
            }
            Err(e) => {
                let why = format!("stop failed: {e:#}");
                self.set_state(State::Error, Some(why.clone()));
                self.log(
                    &who,
                    Transition::Stop,
                    from.name(),
                    "error",
                    &why,
                    self.run(),
                );
            }
        }
    }

    fn fail(&self, failed: &tessera_run::role::Failed) {
        let Some(from) = self.claim(Transition::Stop) else {
            return;
        };
        let why = &failed.to_string();
        tracing::error!(reason = why, "a component failed: the system goes to error");
        self.shared.alarms.lock().raise(
            crate::alarms::kind::COMPONENT_FAILED,
            &failed.subject,
            why,
            self.run(),
            unix_ns(),
        );
        {
            // In error from the moment a component failed, not once the stop that follows has
            // drained what it can (it can take its stages' deadlines): `/api/state` said
            // `running` all that time. The stop under way shows as the transition in progress.
            let mut c = self.shared.ctl.lock();
            c.error = Some(why.to_string());
            c.state = State::Error;
            c.since_unix_ns = unix_ns();
        }
        self.shared.changed.notify_all();
        let result = self.stop_run(&format!("error: {why}"), None);
        let why = match result {
            Ok(_) => why.to_string(),
            Err(e) => format!("{why}; then the stop failed: {e:#}"),
        };
        self.set_state(State::Error, Some(why.clone()));
        self.log(
            "tessera (component failure)",
            Transition::Stop,
            from.name(),
            "error",
            &why,
            self.run(),
        );
    }

    fn run(&self) -> Option<u64> {
        self.shared.ctl.lock().run_number
    }
}

fn names(t: &[Transition]) -> String {
    if t.is_empty() {
        "nothing".into()
    } else {
        t.iter().map(|t| t.name()).collect::<Vec<_>>().join(", ")
    }
}

/// Writes how a run ended into the database.
fn record_end(db: &RunDb, number: u64, report: &Report, error: Option<&str>) -> Result<()> {
    let state = if error.is_some() { "error" } else { "stopped" };
    record_end_as(db, number, report, state, error, unix_ns())
}

/// Writes a run's end into the database, its state, error and stop time given.
fn record_end_as(
    db: &RunDb,
    number: u64,
    report: &Report,
    state: &str,
    error: Option<&str>,
    stopped_unix_ns: u64,
) -> Result<()> {
    let files: Vec<FileRow> = report
        .recorder
        .iter()
        .flat_map(|r| r.files.iter())
        .map(|f| FileRow {
            name: f.file.clone(),
            size_bytes: f.size_bytes,
            events: f.events,
            crc32c: f.file_crc32c.clone(),
        })
        .collect();
    let json = serde_json::to_string(report)?;
    db.end_run(
        number,
        &RunEnd {
            state,
            stopped_unix_ns,
            stop_reason: &report.stop_reason,
            error,
            events: report.events_complete + report.events_incomplete,
            incomplete: report.events_incomplete,
            bytes: report.bytes_built,
            recorded_events: report.recorder.as_ref().map_or(0, |r| r.events_in_files),
            // Open, not failed, while a host's counts are still to come.
            balance_holds: (report.balance.holds || report.hosts_missing.is_empty())
                .then_some(report.balance.holds),
            rejected: &report.balance.rejected,
            files: &files,
            report_json: &json,
        },
    )?;
    Ok(())
}

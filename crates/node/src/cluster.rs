//! The run control's side of a run spread over hosts: one connection to every host's node
//! agent, and the run itself ([`ClusterRun`]) driven through the same [`RunSession`] as a run
//! in one process. Configure checks every host and binds every socket; start hands every host
//! the addresses of all (sink first), then releases the triggers once all have started; a
//! stop runs each stage on every host before the next; the report and the live view are
//! combined from every host's own, and the balance is taken over the whole.
//!
//! An agent silent for `control.agent_timeout_ms` (agents say `working` every second while a
//! request lasts) is lost: the run goes to error naming its host, and its stop and report go
//! on without it, saying so.

use anyhow::{anyhow, bail, Context, Result};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::{TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tessera_config::Resolved;
use tessera_node_protocol::{self as proto, Reply, Request};
use tessera_run::live::{Live, WhyIncomplete};
use tessera_run::{
    Component, ComponentState, Report, RunSession, StageReport, StopDeadlines, StopReport,
    StopStage,
};

use crate::link::{recv, send};
use crate::tls::Stream;

/// One host's agent, as the run control holds it.
struct AgentLink {
    host: String,
    addr: String,
    conn: Mutex<Option<Stream>>,
    /// Why it was lost, once it was.
    lost: Mutex<Option<String>>,
    /// When the run starts: 0 for hosts with the recorder or event manager, 1 builders, 2
    /// readout units, 3 sources only (sink first).
    rank: u8,
    /// Where the agent serves its host's `/metrics`, as its hello said.
    metrics: Mutex<Option<String>>,
}

impl AgentLink {
    fn name(&self) -> String {
        format!("host {} ({})", self.host, self.addr)
    }

    fn is_lost(&self) -> bool {
        self.lost.lock().is_some()
    }

    /// Sends a request and waits for its answer; a silent agent (no answer and no `working`
    /// within `timeout`) or a broken connection loses it.
    fn call(&self, req: &Request, timeout: Duration) -> Result<Reply> {
        if let Some(why) = self.lost.lock().clone() {
            bail!("{}: lost earlier: {why}", self.name());
        }
        let mut conn = self.conn.lock();
        let s = conn
            .as_mut()
            .ok_or_else(|| anyhow!("{}: not connected", self.name()))?;
        let result = (|| -> std::io::Result<Reply> {
            s.tcp().set_read_timeout(Some(timeout))?;
            send(s, req)?;
            loop {
                match recv::<Reply>(s, proto::MAX_FRAME)? {
                    Reply::Working {} => continue,
                    r => return Ok(r),
                }
            }
        })();
        match result {
            Ok(r) => Ok(r),
            Err(e) => {
                let why = if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) {
                    format!("silent for {} ms", timeout.as_millis())
                } else {
                    e.to_string()
                };
                tracing::error!(host = %self.host, agent = %self.addr, %why, "node agent lost");
                *self.lost.lock() = Some(why.clone());
                *conn = None;
                bail!("{}: node agent lost: {why}", self.name())
            }
        }
    }
}

/// Every host's agent, connected and configured. Lives from a configure to the reset.
pub struct Cluster {
    r: Resolved,
    agents: Vec<AgentLink>,
    timeout: Duration,
    /// The agents hold sockets bound by a configure that no start has used yet.
    fresh: AtomicBool,
    /// Where every listening socket of the run is, from the last configure.
    addresses: Mutex<BTreeMap<String, String>>,
    /// Every host's part as last polled (each agent is asked five times a second, from the
    /// configure on: the live view, and a lost agent seen within the timeout, in a run or not).
    statuses: Mutex<BTreeMap<String, HostStatus>>,
    closing: AtomicBool,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.closing.store(true, Ordering::Relaxed);
    }
}

fn check(reply: Reply, what: &str) -> Result<Reply> {
    match reply {
        Reply::Error { message } => bail!("{what}: {message}"),
        Reply::Refused { reason } => bail!("{what}: refused: {reason}"),
        r => Ok(r),
    }
}

impl Cluster {
    /// Connects to every host of `[hosts]`, checks the protocol revision and the token both
    /// ways, and configures each: every host's problems are gathered and said together.
    pub fn configure(r: &Resolved, token: &str) -> Result<Arc<Cluster>> {
        let t = &r.topology;
        let timeout = Duration::from_millis(t.control.agent_timeout_ms.max(100));
        let rank = |host: &str| -> u8 {
            let roles = tessera_run::RoleSet::of_host(host, r);
            if roles.recorder || roles.event_manager {
                0
            } else if !roles.builders.is_empty() {
                1
            } else if !roles.readout_units.is_empty() {
                2
            } else {
                3
            }
        };
        let mut agents: Vec<AgentLink> = t
            .hosts
            .iter()
            .map(|(host, e)| AgentLink {
                host: host.clone(),
                addr: e.agent().to_string(),
                conn: Mutex::new(None),
                lost: Mutex::new(None),
                rank: rank(host),
                metrics: Mutex::new(None),
            })
            .collect();
        agents.sort_by_key(|a| a.rank);
        let tls = match &t.security.agents_ca {
            Some(ca) => Some(
                crate::tls::client_config(ca)
                    .with_context(|| format!("{}: security.agents_ca", r.origin))?,
            ),
            None => None,
        };
        let tls = tls.as_ref();
        let errors: Vec<String> = std::thread::scope(|scope| {
            let handles: Vec<_> = agents
                .iter()
                .map(|a| scope.spawn(move || connect(a, token, timeout, tls).err()))
                .collect();
            handles
                .into_iter()
                .filter_map(|h| h.join().ok().flatten())
                .map(|e| format!("{e:#}"))
                .collect()
        });
        if !errors.is_empty() {
            bail!("{}", errors.join("\n"));
        }
        let cluster = Cluster {
            r: r.clone(),
            agents,
            timeout,
            fresh: AtomicBool::new(false),
            addresses: Mutex::default(),
            statuses: Mutex::default(),
            closing: AtomicBool::new(false),
        };
        cluster.configure_agents()?;
        let cluster = Arc::new(cluster);
        for i in 0..cluster.agents.len() {
            let weak = Arc::downgrade(&cluster);
            std::thread::Builder::new()
                .name(format!("poll-{}", cluster.agents[i].host))
                .spawn(move || poll(weak, i))?;
        }
        Ok(cluster)
    }

    /// Configures every agent, which binds its sockets; keeps their addresses.
    fn configure_agents(&self) -> Result<()> {
        let replies = self.on_every_agent(|a| {
            a.call(
                &Request::Configure {
                    topology: self.r.text.clone(),
                    origin: self.r.origin.clone(),
                    host: a.host.clone(),
                },
                self.timeout,
            )
        });
        let mut problems = Vec::new();
        let mut addresses = BTreeMap::new();
        for (a, reply) in self.agents.iter().zip(replies) {
            match reply {
                Ok(Reply::Configured {
                    roles,
                    addresses: got,
                }) => {
                    tracing::info!(host = %a.host, ?roles, "host configured");
                    addresses.extend(got);
                }
                Ok(Reply::Problems { problems: p }) => {
                    problems.extend(p.into_iter().map(|p| format!("{}: {p}", a.name())))
                }
                Ok(other) => problems.push(format!("{}: {:?}", a.name(), other)),
                Err(e) => problems.push(format!("{e:#}")),
            }
        }
        if !problems.is_empty() {
            bail!("{}", problems.join("\n"));
        }
        *self.addresses.lock() = addresses;
        self.fresh.store(true, Ordering::Release);
        Ok(())
    }

    /// `f` on every agent not lost, at once; the results in the agents' order.
    fn on_every_agent<T: Send>(
        &self,
        f: impl Fn(&AgentLink) -> Result<T> + Sync,
    ) -> Vec<Result<T>> {
        std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .agents
                .iter()
                .map(|a| {
                    let f = &f;
                    scope.spawn(move || f(a))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow!("request thread panicked")))
                })
                .collect()
        })
    }

    /// The files of run `run` on every host that records (each host finishes the run's `.part`
    /// files first): for a run the run control closes as crashed, whose files are on those
    /// hosts, not in its own directory. With the `.part` files each host finished.
    pub fn run_files(&self, run: u64) -> Result<(Vec<tessera_archive::FileInfo>, Vec<String>)> {
        let (mut files, mut recovered) = (Vec::new(), Vec::new());
        for r in self.on_every_agent(|a| {
            if !tessera_run::RoleSet::of_host(&a.host, &self.r).recorder {
                return Ok(None);
            }
            match check(
                a.call(&Request::RunFiles { run }, self.timeout)?,
                &format!("host {}", a.host),
            )? {
                Reply::RunFiles { files, recovered } => Ok(Some((files, recovered))),
                other => bail!("host {}: answered {other:?} to run_files", a.host),
            }
        }) {
            if let Some((f, rec)) = r? {
                for v in f {
                    files.push(serde_json::from_value(v)?);
                }
                recovered.extend(rec);
            }
        }
        Ok((files, recovered))
    }

    /// Tells every agent to drop its configuration (and any run still open).
    pub fn reset(&self) {
        self.closing.store(true, Ordering::Relaxed);
        for a in self.agents.iter().filter(|a| !a.is_lost()) {
            let _ = a.call(&Request::Reset {}, self.timeout);
        }
    }

    /// The agents that serve `/metrics`, as Prometheus scrape targets in its file-based (and
    /// HTTP) discovery format: one group per host, labelled with the host's `[hosts]` name.
    pub fn prometheus_targets(&self) -> serde_json::Value {
        serde_json::Value::Array(
            self.agents
                .iter()
                .filter_map(|a| {
                    let m = a.metrics.lock().clone()?;
                    Some(serde_json::json!({
                        "targets": [m],
                        "labels": {"host": a.host, "job": "tessera-node"},
                    }))
                })
                .collect(),
        )
    }

    /// The hosts whose agent is lost, with why (failed-over builder hosts among them).
    pub fn lost_hosts(&self) -> Vec<(String, String)> {
        self.agents
            .iter()
            .filter_map(|a| a.lost.lock().clone().map(|w| (a.host.clone(), w)))
            .collect()
    }

    /// Starts run `run_number` on every host (sink first), then releases the triggers.
    pub fn start(
        self: &Arc<Self>,
        run_number: u64,
        opts: &tessera_run::Options,
    ) -> Result<ClusterRun> {
        if let Some(a) = self.agents.iter().find(|a| a.is_lost()) {
            bail!("{} was lost: configure again", a.name());
        }
        // Each start needs sockets bound for it (an earlier run used its own).
        if !self.fresh.load(Ordering::Acquire) {
            self.configure_agents()?;
        }
        self.fresh.store(false, Ordering::Release);
        let addresses = self.addresses.lock().clone();
        let started_unix_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        self.statuses.lock().clear();
        let mut started: Vec<&AgentLink> = Vec::new();
        for a in &self.agents {
            let r = a
                .call(
                    &Request::Start {
                        run_number,
                        addresses: addresses.clone(),
                        events: opts.events,
                    },
                    self.timeout,
                )
                .and_then(|r| check(r, &a.name()));
            if let Err(e) = r {
                for s in started {
                    let _ = s.call(&Request::Reset {}, self.timeout);
                }
                return Err(e).context("starting the run");
            }
            started.push(a);
        }
        // With external sources the triggers stay held until every one has said its hello at
        // its readout unit, wherever that runs (or `sources.external_wait_s` passed), as in one
        // process: no event is triggered that a source not yet connected would miss. The run
        // releases them itself, from the statuses (see `release_when_external_sources_connected`).
        let s = &self.r.topology.sources;
        let hold_for_external = !s.external.is_empty() && s.external_wait_s > 0.0;
        if !hold_for_external {
            for r in self.on_every_agent(|a| a.call(&Request::Release {}, self.timeout)) {
                check(r?, "releasing the triggers")?;
            }
        }
        let t = &self.r.topology;
        let run = ClusterRun {
            cluster: self.clone(),
            run_number,
            started_unix_ns,
            t0: Instant::now(),
            events: opts.events.unwrap_or(t.run.events),
            duration: opts.duration_s.unwrap_or(t.run.duration_s),
            output: opts.output.clone().unwrap_or_else(|| t.run.output.clone()),
            stop_flag: opts.stop.clone(),
            paused_at: Mutex::new(hold_for_external.then(Instant::now)),
            paused_total: Mutex::new(Duration::ZERO),
            held_for_external: AtomicBool::new(hold_for_external),
            status_mode: opts.status,
            last_line: Mutex::new(Instant::now()),
            monitor_address: addresses.get("monitor").cloned(),
        };
        Ok(run)
    }
}

/// How often an agent that refuses connections is tried again during a configure.
const REDIAL: Duration = Duration::from_millis(100);

/// A connection to `addr`. Refused (nothing listens there yet: hosts and their agents started
/// together, by systemd or Kubernetes in any order, or an agent being restarted), it is tried
/// again every [`REDIAL`] until `deadline`, calling `refused` with the count so far; any other
/// failure, or a refusal at the deadline, is the error.
fn dial(
    addr: std::net::SocketAddr,
    timeout: Duration,
    deadline: Instant,
    mut refused: impl FnMut(u32),
) -> std::io::Result<TcpStream> {
    let mut tries = 0;
    loop {
        match TcpStream::connect_timeout(&addr, timeout) {
            Err(e)
                if e.kind() == std::io::ErrorKind::ConnectionRefused
                    && Instant::now() + REDIAL < deadline =>
            {
                tries += 1;
                refused(tries);
                std::thread::sleep(REDIAL);
            }
            r => return r,
        }
    }
}

/// Connects to one agent and exchanges hellos. An agent that refuses the connection is given
/// `control.agent_timeout_ms` to start listening: the time a silent agent is given before it is
/// lost.
fn connect(
    a: &AgentLink,
    token: &str,
    timeout: Duration,
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> Result<()> {
    let addr = a
        .addr
        .to_socket_addrs()
        .with_context(|| format!("{}: not an address", a.name()))?
        .next()
        .ok_or_else(|| anyhow!("{}: no address", a.name()))?;
    let raw = dial(addr, timeout, Instant::now() + timeout, |tries| {
        if tries == 1 {
            tracing::info!(host = %a.host, %addr, "its node agent refuses connections (not listening yet?): trying again");
        }
    })
    .with_context(|| {
        format!(
            "{}: cannot reach its node agent (is `tessera node` running there?)",
            a.name()
        )
    })?;
    raw.set_nodelay(true)?;
    raw.set_read_timeout(Some(timeout))?;
    // The name the agent's certificate must hold: the host part of its `[hosts]` address.
    let name = a
        .addr
        .rsplit_once(':')
        .map_or(a.addr.as_str(), |(h, _)| h)
        .trim_start_matches('[')
        .trim_end_matches(']');
    let mut s = Stream::connect(raw, tls, name).with_context(|| a.name())?;
    let no_hello = || {
        format!(
            "{}: no hello from its node agent{}",
            a.name(),
            if tls.is_some() {
                " (over TLS: does the agent run with --tls-certificate and a certificate for this address, issued by security.agents_ca?)"
            } else {
                ""
            }
        )
    };
    let control_nonce = crate::fresh_nonce();
    send(
        &mut s,
        &Request::Hello {
            protocol: proto::PROTOCOL,
            software: crate::software(),
            nonce: control_nonce.clone(),
        },
    )
    // Under TLS the handshake happens here: an untrusted certificate is said now.
    .with_context(no_hello)?;
    let mut reply: Reply = recv(&mut s, proto::MAX_HELLO).with_context(no_hello)?;
    // An agent of this revision challenges; one of another answers its hello at once.
    let mut agent_nonce = None;
    if let Reply::Challenge { nonce } = &reply {
        send(
            &mut s,
            &Request::Proof {
                proof: proto::proof(token, proto::RUN_CONTROL_PROOF, nonce, &control_nonce),
            },
        )?;
        agent_nonce = Some(nonce.clone());
        reply = recv(&mut s, proto::MAX_HELLO).with_context(no_hello)?;
    }
    match reply {
        Reply::Hello {
            protocol,
            software,
            host,
            metrics,
            proof,
        } => {
            if protocol != proto::PROTOCOL {
                bail!(
                    "{}: the node agent speaks node protocol revision {protocol} ({software}), this run control {} ({})",
                    a.name(),
                    proto::PROTOCOL,
                    crate::software()
                );
            }
            // The agent proves it holds the token too: a stranger at its address cannot play
            // it.
            let holds = agent_nonce.as_deref().is_some_and(|n| {
                proto::proof_holds(token, proto::AGENT_PROOF, &control_nonce, n, &proof)
            });
            if !holds {
                bail!(
                    "{}: its node agent did not prove it holds the token (a wrong token there, or not a node agent)",
                    a.name()
                );
            }
            tracing::info!(host = %a.host, system = %host, %software, metrics = ?metrics, "node agent connected");
            *a.metrics.lock() = metrics;
        }
        Reply::Refused { reason } => bail!("{}: the node agent refused: {reason}", a.name()),
        other => bail!("{}: unexpected answer to the hello: {other:?}", a.name()),
    }
    *a.conn.lock() = Some(s);
    Ok(())
}

/// Asks agent `i` for its status five times a second while the cluster lives: the live view,
/// the end of the sources, and the loss of an agent (in a run or between runs) come from here.
fn poll(cluster: std::sync::Weak<Cluster>, i: usize) {
    let every = Duration::from_millis(200);
    loop {
        let Some(c) = cluster.upgrade() else { return };
        let a = &c.agents[i];
        if c.closing.load(Ordering::Relaxed) || a.is_lost() {
            return;
        }
        let t = Instant::now();
        if let Ok(Reply::Status {
            live,
            sources_ended,
            disk_full,
            logs,
        }) = a.call(&Request::Status {}, c.timeout)
        {
            // Every host's lines go into this process's log, under the host's name.
            for mut l in logs {
                l.host.clone_from(&a.host);
                crate::logbook::LOG.push(l);
            }
            c.statuses.lock().insert(
                a.host.clone(),
                HostStatus {
                    live: serde_json::from_value(live).ok(),
                    sources_ended,
                    disk_full,
                },
            );
        }
        drop(c);
        std::thread::sleep(every.saturating_sub(t.elapsed()));
    }
}

/// One host's part as last polled.
#[derive(Default)]
struct HostStatus {
    live: Option<Live>,
    sources_ended: bool,
    disk_full: bool,
}

/// A run spread over hosts.
pub struct ClusterRun {
    cluster: Arc<Cluster>,
    run_number: u64,
    started_unix_ns: u64,
    t0: Instant,
    events: u64,
    duration: f64,
    output: PathBuf,
    stop_flag: Arc<AtomicBool>,
    paused_at: Mutex<Option<Instant>>,
    paused_total: Mutex<Duration>,
    status_mode: tessera_run::StatusMode,
    last_line: Mutex<Instant>,
    /// Where the recorder's host serves the monitor (the dashboard samples there).
    monitor_address: Option<String>,
    /// The triggers are held until every external source has connected.
    held_for_external: AtomicBool,
}

impl ClusterRun {
    fn paused_for(&self) -> Duration {
        *self.paused_total.lock()
            + self
                .paused_at
                .lock()
                .map_or(Duration::ZERO, |t| t.elapsed())
    }

    fn lost(&self) -> Vec<(String, String)> {
        self.cluster
            .agents
            .iter()
            .filter_map(|a| a.lost.lock().clone().map(|w| (a.name(), w)))
            .collect()
    }

    /// A lost host that ran only request-mode builders, while builders run elsewhere: the
    /// event manager gives its events to the others (failover, as in one process), so its
    /// loss is no failure of the run.
    fn failed_over(&self, a: &AgentLink) -> bool {
        let r = &self.cluster.r;
        if r.topology.run.mode != tessera_config::Mode::Request {
            return false;
        }
        let roles = tessera_run::RoleSet::of_host(&a.host, r);
        let only_builders = !roles.builders.is_empty()
            && roles.readout_units.is_empty()
            && roles.sources.is_empty()
            && !roles.recorder
            && !roles.event_manager;
        let others = self.cluster.agents.iter().any(|b| {
            !b.is_lost()
                && !tessera_run::RoleSet::of_host(&b.host, r)
                    .builders
                    .is_empty()
        });
        only_builders && others
    }

    fn everyone(&self, req: Request) {
        for r in self
            .cluster
            .on_every_agent(|a| a.call(&req, self.cluster.timeout))
        {
            if let Err(e) = r {
                tracing::error!(error = %format!("{e:#}"), "request to a node agent");
            }
        }
    }

    /// Holds the triggers on every host and has every host's sources send up to the highest
    /// trigger any of them claimed: a pause or a stop leaves no event sent by only some
    /// sources, as the one trigger gate of a single process does.
    fn hold_and_align(&self) {
        let replies = self
            .cluster
            .on_every_agent(|a| a.call(&Request::Hold {}, self.cluster.timeout));
        let end = replies
            .into_iter()
            .filter_map(|r| match r {
                Ok(Reply::Held { claimed }) => Some(claimed),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        self.everyone(Request::Align { end });
    }

    fn info(&self, stop_reason: &str, drained: bool) -> tessera_run::report::RunInfo {
        tessera_run::report::RunInfo {
            run_number: self.run_number,
            started_unix_ns: self.started_unix_ns,
            duration_s: self.t0.elapsed().as_secs_f64(),
            stop_reason: stop_reason.into(),
            drained,
            output: self.output.display().to_string(),
            partial: false,
        }
    }

    /// Releases the held triggers once every external source's link, on whatever host, has
    /// seen its hello (from the statuses the agents report five times a second), or once
    /// `sources.external_wait_s` has passed.
    fn release_when_external_sources_connected(&self) {
        if !self.held_for_external.load(Ordering::Acquire) {
            return;
        }
        let connected: std::collections::BTreeSet<u32> = self
            .cluster
            .statuses
            .lock()
            .values()
            .filter_map(|h| h.live.as_ref())
            .flat_map(|l| l.sources.iter())
            .filter(|x| x.kind == "external" && x.link_state != "waiting")
            .map(|x| x.id)
            .collect();
        if !tessera_run::external_sources_ready(
            &self.cluster.r,
            |id| connected.contains(&id),
            self.t0.elapsed().as_secs_f64(),
        ) {
            return;
        }
        if !self.held_for_external.swap(false, Ordering::AcqRel) {
            return;
        }
        self.everyone(Request::Release {});
        if let Some(t) = self.paused_at.lock().take() {
            *self.paused_total.lock() += t.elapsed();
        }
    }

    /// Every host's report; for each host that gave none, its name and why.
    fn reports(&self, req: Request) -> (Vec<Report>, Vec<(String, String)>) {
        let mut parts = Vec::new();
        let mut missing = Vec::new();
        let replies = self
            .cluster
            .on_every_agent(|a| a.call(&req, self.cluster.timeout));
        for (a, r) in self.cluster.agents.iter().zip(replies) {
            match r.and_then(|r| report_of(r, &a.name())) {
                Ok(rep) => parts.push(rep),
                Err(e) => missing.push((a.host.clone(), format!("{e:#}"))),
            }
        }
        (parts, missing)
    }
}

impl RunSession for ClusterRun {
    fn run_number(&self) -> u64 {
        self.run_number
    }

    fn fault(&self, _f: &tessera_run::fault::Fault) -> Result<String, String> {
        Err("fault rehearsal reaches the roles of the run control's own process only; over hosts it is not available yet".into())
    }

    fn monitor(&self) -> Option<&tessera_monitor::Monitor> {
        None
    }

    fn monitor_address(&self) -> Option<String> {
        self.monitor_address.clone()
    }

    fn tick_status(&self, phase: &str) {
        if self.status_mode == tessera_run::StatusMode::Off {
            return;
        }
        let mut last = self.last_line.lock();
        if last.elapsed() < Duration::from_secs(1) {
            return;
        }
        *last = Instant::now();
        let live = self.live();
        let built: u64 = live
            .builders
            .iter()
            .map(|b| b.events_complete + b.events_incomplete)
            .sum();
        let recorded = live.recorder.as_ref().map_or(0, |r| r.events);
        eprintln!(
            "run {} {phase} {:.1} s: {built} events built, {recorded} recorded, {} hosts ({} lost)",
            self.run_number,
            self.t0.elapsed().as_secs_f64(),
            self.cluster.agents.len(),
            self.lost().len()
        );
    }

    fn end_reason(&self) -> Option<String> {
        self.release_when_external_sources_connected();
        if self.stop_flag.load(Ordering::Relaxed) {
            return Some("interrupted".into());
        }
        let st = self.cluster.statuses.lock();
        if st.values().any(|s| s.disk_full) {
            return Some("disk full".into());
        }
        let active = self.t0.elapsed().saturating_sub(self.paused_for());
        if self.duration > 0.0 && active.as_secs_f64() >= self.duration {
            return Some("duration".into());
        }
        // A host lost and failed over has no say (its last status stays as it was).
        let polled: Vec<&HostStatus> = self
            .cluster
            .agents
            .iter()
            .filter(|a| !(a.is_lost() && self.failed_over(a)))
            .filter_map(|a| st.get(&a.host).filter(|s| s.live.is_some()))
            .collect();
        let all_polled = polled.len()
            == self
                .cluster
                .agents
                .iter()
                .filter(|a| !(a.is_lost() && self.failed_over(a)))
                .count();
        if all_polled && polled.iter().all(|s| s.sources_ended) {
            let emulated = self.cluster.r.topology.sources.count > 0;
            return Some(
                if self.events > 0 && emulated {
                    "events"
                } else {
                    "sources ended"
                }
                .into(),
            );
        }
        None
    }

    fn failure(&self) -> Option<tessera_run::role::Failed> {
        if let Some(a) = self
            .cluster
            .agents
            .iter()
            .find(|a| a.is_lost() && !self.failed_over(a))
        {
            let why = a.lost.lock().clone().unwrap_or_default();
            let roles = tessera_run::RoleSet::of_host(&a.host, &self.cluster.r).names();
            return Some(tessera_run::role::Failed {
                subject: a.name(),
                reason: format!(
                    "node agent lost, and with it {}: {why}",
                    if roles.is_empty() {
                        "no role".to_string()
                    } else {
                        roles.join(", ")
                    }
                ),
                failure: Some(tessera_run::role::Failure::LinkLost {
                    peer: "node agent".into(),
                    detail: why,
                }),
            });
        }
        self.components()
            .into_iter()
            .find(|c| c.state == ComponentState::Failed)
            .map(|c| tessera_run::role::Failed {
                subject: format!("host {}: {}", c.host.as_deref().unwrap_or("?"), c.name),
                reason: c.detail,
                failure: c.failure,
            })
    }

    fn components(&self) -> Vec<Component> {
        // A lost host's components are as it last said: it stands for them itself.
        let lost: Vec<String> = self
            .cluster
            .agents
            .iter()
            .filter(|a| a.is_lost())
            .map(|a| a.host.clone())
            .collect();
        let mut v: Vec<Component> = self
            .cluster
            .statuses
            .lock()
            .iter()
            .filter(|(h, _)| !lost.contains(h))
            .filter_map(|(_, s)| s.live.as_ref())
            .flat_map(|l| l.components.clone())
            .collect();
        for a in &self.cluster.agents {
            let lost = a.lost.lock().clone();
            let (state, detail) = match lost {
                None => (ComponentState::Running, String::new()),
                Some(why) if self.failed_over(a) => (
                    ComponentState::Finished,
                    format!("lost ({why}); its builders' events were given to the others"),
                ),
                Some(why) => (ComponentState::Failed, why),
            };
            let failure =
                (state == ComponentState::Failed).then(|| tessera_run::role::Failure::LinkLost {
                    peer: "node agent".into(),
                    detail: detail.clone(),
                });
            v.push(Component {
                name: format!("node agent {}", a.host),
                host: Some(a.host.clone()),
                kind: "node".into(),
                state,
                detail,
                failure,
            });
        }
        v
    }

    fn pause(&self) {
        self.hold_and_align();
        let mut p = self.paused_at.lock();
        if p.is_none() {
            *p = Some(Instant::now());
        }
    }

    fn resume(&self) {
        // Held for external sources: only their hellos (or the wait's end) release the run.
        if self.held_for_external.load(Ordering::Acquire) {
            return;
        }
        self.everyone(Request::Resume {});
        if let Some(t) = self.paused_at.lock().take() {
            *self.paused_total.lock() += t.elapsed();
        }
    }

    fn stop(&self, d: &StopDeadlines) -> StopReport {
        let deadlines = crate::to_wire(d);
        self.hold_and_align();
        self.everyone(Request::StopBegin {
            deadlines: deadlines.clone(),
        });
        let mut stages = Vec::new();
        for stage in StopStage::ALL {
            let name = serde_json::to_value(stage)
                .ok()
                .and_then(|v| v.as_str().map(String::from))
                .unwrap_or_default();
            let t = Instant::now();
            let replies = self.cluster.on_every_agent(|a| {
                a.call(
                    &Request::StopStage {
                        stage: name.clone(),
                        deadlines: deadlines.clone(),
                    },
                    self.cluster.timeout,
                )
            });
            let mut finished = true;
            let mut left = Vec::new();
            for (a, r) in self.cluster.agents.iter().zip(replies) {
                if a.is_lost() && self.failed_over(a) {
                    continue;
                }
                match r.and_then(|r| check(r, &a.name())) {
                    Ok(Reply::Stage { report }) => {
                        match serde_json::from_value::<StageReport>(report) {
                            Ok(s) if !s.finished => {
                                finished = false;
                                left.push(format!("host {}: {}", a.host, s.left));
                            }
                            Ok(_) => {}
                            Err(e) => {
                                finished = false;
                                left.push(format!("host {}: {e}", a.host));
                            }
                        }
                    }
                    Ok(other) => {
                        finished = false;
                        left.push(format!("host {}: {other:?}", a.host));
                    }
                    Err(e) => {
                        finished = false;
                        left.push(format!("{e:#}"));
                    }
                }
            }
            let deadline_ms = match stage {
                StopStage::Sources => d.sources_ms,
                StopStage::Readout => d.readout_ms,
                StopStage::Builders => d.builders_ms,
                StopStage::Recorder => d.recorder_ms,
            };
            stages.push(StageReport {
                stage: name,
                deadline_ms,
                elapsed_ms: t.elapsed().as_millis() as u64,
                finished,
                left: left.join("; "),
            });
        }
        let drained = stages.iter().all(|s| s.finished);
        StopReport {
            stages,
            drained,
            all_finished: self.lost().is_empty(),
        }
    }

    fn report(&self, stop_reason: &str, drained: bool) -> Report {
        let (parts, _) = self.reports(Request::Report {});
        Report::combine(&self.cluster.r, self.info(stop_reason, drained), parts)
    }

    fn live(&self) -> Live {
        let parts: Vec<Live> = self
            .cluster
            .statuses
            .lock()
            .iter()
            .filter_map(|(host, s)| {
                let mut l = s.live.clone()?;
                // An agent measures its own process; the run control knows which host it is.
                for h in &mut l.hosts {
                    h.host.get_or_insert_with(|| host.clone());
                }
                Some(l)
            })
            .collect();
        Live::combine(
            self.run_number,
            self.t0.elapsed().as_secs_f64(),
            self.paused_at.lock().is_some(),
            parts,
        )
    }

    fn why_incomplete(&self, event_id: u64) -> WhyIncomplete {
        let replies = self
            .cluster
            .on_every_agent(|a| a.call(&Request::Why { event_id }, self.cluster.timeout));
        let answers: Vec<(bool, WhyIncomplete)> = self
            .cluster
            .agents
            .iter()
            .zip(replies)
            .filter_map(|(a, r)| match r {
                Ok(Reply::Why { answer }) => {
                    let builds = !tessera_run::RoleSet::of_host(&a.host, &self.cluster.r)
                        .builders
                        .is_empty();
                    serde_json::from_value(answer).ok().map(|w| (builds, w))
                }
                _ => None,
            })
            .collect();
        combine_why(event_id, answers)
    }

    fn finish(self: Box<Self>, stop_reason: &str, stop: StopReport) -> Result<Report> {
        let (parts, missing) = self.reports(Request::Finish {
            stop_reason: stop_reason.into(),
        });
        let r = &self.cluster.r;
        let awaited = Awaited {
            info: self.info(stop_reason, stop.drained),
            stop: Some(stop),
            // A builder host lost in request mode was failed over: its events were built again
            // by the others and recorded once.
            failed_over: self
                .cluster
                .agents
                .iter()
                .filter(|a| a.is_lost() && self.failed_over(a))
                .map(|a| a.host.clone())
                .collect(),
            recorder_host: self
                .cluster
                .agents
                .iter()
                .find(|a| tessera_run::RoleSet::of_host(&a.host, r).recorder)
                .map(|a| a.host.clone()),
            names: self
                .cluster
                .agents
                .iter()
                .map(|a| (a.host.clone(), a.name()))
                .collect(),
            parts,
            missing,
            origin: r.origin.clone(),
            topology: r.text.clone(),
        };
        let report = awaited.report(r);
        let path = self
            .output
            .join(format!("run{:06}.manifest.json", self.run_number));
        std::fs::create_dir_all(&self.output).ok();
        let mut report = report;
        // Hosts that gave no report keep theirs (an agent that lost its run control finishes
        // its part alone and writes it down): the next configure that reaches them gathers it.
        if !awaited.missing.is_empty() {
            let kept = self.output.join(awaited_name(self.run_number));
            if let Err(e) = serde_json::to_vec_pretty(&awaited)
                .map_err(std::io::Error::other)
                .and_then(|j| tessera_archive::file_write_atomic(&kept, &j))
            {
                report.not_kept.push(format!(
                    "what the hosts reported, to be completed later, {}: {e}",
                    kept.display()
                ));
            }
        }
        let json = serde_json::to_vec_pretty(&report)?;
        if let Err(e) = tessera_archive::file_write_atomic(&path, &json) {
            tracing::error!(error = %e, path = %path.display(), "cannot write the run's manifest");
            report
                .not_kept
                .push(format!("the manifest {}: {e}", path.display()));
        }
        Ok(report)
    }
}

/// A run's end over hosts as the run control saw it: what each host reported and which hosts
/// gave nothing. Kept as `run<N>.awaited.json` beside the manifest while a host is missing,
/// so that its report, gathered later, completes the run's report and balance.
#[derive(Serialize, Deserialize)]
struct Awaited {
    info: tessera_run::report::RunInfo,
    /// None for a run whose run control died: each host stopped its part alone.
    stop: Option<StopReport>,
    failed_over: Vec<String>,
    recorder_host: Option<String>,
    /// Each host's name as messages give it (`host fe (10.0.0.1:7300)`).
    names: BTreeMap<String, String>,
    parts: Vec<Report>,
    /// (host, why it gave no report).
    missing: Vec<(String, String)>,
    /// The run's topology, as configured: a later configure may be of another.
    origin: String,
    topology: String,
}

fn awaited_name(run: u64) -> String {
    format!("run{run:06}.awaited.json")
}

impl Awaited {
    /// The run's report over every host that reported.
    fn report(&self, r: &Resolved) -> Report {
        // The files are on the recorder's host, in its output directory.
        let files_at = self
            .parts
            .iter()
            .find(|p| p.recorder.is_some())
            .map(|p| p.output.clone());
        let mut info = self.info.clone();
        if self.stop.is_none() {
            // No run control saw the end: the run lasted as long as its longest part.
            info.duration_s = self.parts.iter().map(|p| p.duration_s).fold(0.0, f64::max);
        }
        let mut report = Report::combine(r, info, self.parts.clone());
        report.stop = self.stop.clone();
        if let (Some(dir), Some(h)) = (files_at, &self.recorder_host) {
            report.output = format!("{dir} on host {h}");
        }
        // A builder host failed over: what it had built is lost with it, so the builders'
        // totals cannot be set against the recorder's.
        if !self.failed_over.is_empty() {
            report.recorder_shortfall = 0;
        }
        report.hosts_missing = self
            .missing
            .iter()
            .map(|(host, m)| {
                if self.failed_over.contains(host) {
                    format!(
                        "{m} (failed over: its builders' events were built again by the others and recorded once; its own counts are lost with it)"
                    )
                } else {
                    m.clone()
                }
            })
            .collect();
        report
    }
}

/// A report from an agent's answer.
fn report_of(reply: Reply, name: &str) -> Result<Report> {
    match check(reply, name)? {
        Reply::Report { report } => serde_json::from_value(report)
            .map_err(|e| anyhow!("{name}: its report does not parse: {e}")),
        other => bail!("{name}: {other:?}"),
    }
}

/// A run whose report, kept while hosts were missing, was completed with theirs.
pub struct Gathered {
    pub run: u64,
    pub report: Report,
    /// The hosts whose reports came now.
    pub hosts: Vec<String>,
}

impl Cluster {
    /// Run `run`, left running by a run control that died, awaits every host's kept report
    /// (each agent stopped its part alone when its run control went silent and wrote it
    /// down): the next [`Cluster::gather_kept_reports`] closes it with the balance over them.
    pub fn await_crashed(
        &self,
        dir: &std::path::Path,
        run: u64,
        started_unix_ns: u64,
        origin: &str,
        topology: &str,
    ) -> Result<()> {
        let path = dir.join(awaited_name(run));
        if path.exists() {
            return Ok(());
        }
        let r = tessera_config::Topology::parse(topology, origin)
            .with_context(|| format!("run {run}: its topology"))?;
        let hosts: Vec<String> = r.topology.hosts.keys().cloned().collect();
        let awaited = Awaited {
            info: tessera_run::report::RunInfo {
                run_number: run,
                started_unix_ns,
                duration_s: 0.0,
                stop_reason: "the run control was lost: each host stopped its part alone".into(),
                drained: false,
                output: dir.display().to_string(),
                partial: false,
            },
            stop: None,
            failed_over: Vec::new(),
            recorder_host: hosts
                .iter()
                .find(|h| tessera_run::RoleSet::of_host(h, &r).recorder)
                .cloned(),
            names: hosts
                .iter()
                .map(|h| (h.clone(), format!("host {h}")))
                .collect(),
            parts: Vec::new(),
            missing: hosts
                .iter()
                .map(|h| (h.clone(), format!("host {h}: its run control died mid-run")))
                .collect(),
            origin: origin.into(),
            topology: topology.into(),
        };
        tessera_archive::file_write_atomic(&path, &serde_json::to_vec_pretty(&awaited)?)
            .with_context(|| format!("writing {}", path.display()))
    }

    /// Completes the runs of `dir` that ended with hosts missing (their `run<N>.awaited.json`)
    /// with the reports those hosts kept, for each host this configure reaches: the report
    /// and balance over every host, the manifest rewritten. A run still missing a host stays
    /// awaited; one complete is no longer.
    pub fn gather_kept_reports(&self, dir: &std::path::Path) -> Result<Vec<Gathered>> {
        let mut done = Vec::new();
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Ok(done);
        };
        let mut runs: Vec<u64> = entries
            .filter_map(|e| {
                let name = e.ok()?.file_name().into_string().ok()?;
                name.strip_prefix("run")?
                    .strip_suffix(".awaited.json")?
                    .parse()
                    .ok()
            })
            .collect();
        runs.sort_unstable();
        for run in runs {
            let path = dir.join(awaited_name(run));
            let mut awaited: Awaited = serde_json::from_slice(
                &std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?,
            )
            .with_context(|| format!("{} does not parse", path.display()))?;
            let mut hosts = Vec::new();
            let missing = std::mem::take(&mut awaited.missing);
            for (host, why) in missing {
                let got = self
                    .agents
                    .iter()
                    .find(|a| a.host == host && !a.is_lost())
                    .map(|a| {
                        a.call(&Request::KeptReport { run }, self.timeout)
                            .and_then(|r| report_of(r, &a.name()))
                    });
                match got {
                    Some(Ok(rep)) => {
                        awaited.parts.push(rep);
                        hosts.push(host);
                    }
                    Some(Err(e)) => {
                        tracing::warn!(run, %host, error = %format!("{e:#}"), "no kept report of the run from its host");
                        awaited.missing.push((host, why));
                    }
                    None => awaited.missing.push((host, why)),
                }
            }
            if hosts.is_empty() {
                continue;
            }
            let r = tessera_config::Topology::parse(&awaited.topology, &awaited.origin)
                .with_context(|| format!("run {run}: its topology"))?;
            let report = awaited.report(&r);
            let manifest = dir.join(format!("run{run:06}.manifest.json"));
            tessera_archive::file_write_atomic(&manifest, &serde_json::to_vec_pretty(&report)?)
                .with_context(|| format!("writing {}", manifest.display()))?;
            if awaited.missing.is_empty() {
                std::fs::remove_file(&path)
                    .with_context(|| format!("removing {}", path.display()))?;
            } else {
                tessera_archive::file_write_atomic(&path, &serde_json::to_vec_pretty(&awaited)?)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            done.push(Gathered { run, report, hosts });
        }
        Ok(done)
    }
}

/// "Why is event N incomplete" over hosts: the builders' hosts say whether it was built and
/// without whom; every host with readout units says where its links are.
fn combine_why(event_id: u64, answers: Vec<(bool, WhyIncomplete)>) -> WhyIncomplete {
    let rank = |s: &str| match s {
        "incomplete" => 0,
        "forgotten" => 1,
        "pending" => 2,
        _ => 3,
    };
    let verdict = answers
        .iter()
        .filter(|(builds, _)| *builds)
        .min_by_key(|(_, w)| rank(&w.status))
        .map(|(_, w)| w.clone());
    let mut links: Vec<_> = answers.iter().flat_map(|(_, w)| w.links.clone()).collect();
    let mut out = match verdict {
        Some(w) => w,
        None => WhyIncomplete {
            event_id,
            status: "pending".into(),
            builder: None,
            missing: Vec::new(),
            links: Vec::new(),
            explanation: "no host with a builder answered".into(),
        },
    };
    if out.status == "pending" {
        // Every host with readout units names the links that have not reached it.
        let mut behind: Vec<u32> = answers
            .iter()
            .filter(|(builds, _)| !*builds)
            .flat_map(|(_, w)| w.missing.clone())
            .chain(out.missing.iter().copied())
            .collect();
        behind.sort_unstable();
        behind.dedup();
        out.missing = behind;
    }
    for l in &mut links {
        l.missing = out.missing.contains(&l.source);
    }
    links.sort_by_key(|l| (!l.missing, l.source));
    links.dedup_by_key(|l| l.source);
    out.links = links;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bound socket that does not listen yet: a connection to it is refused, as to an agent
    /// still starting.
    fn not_listening() -> (socket2::Socket, std::net::SocketAddr) {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        s.bind(&std::net::SocketAddr::from(([127, 0, 0, 1], 0)).into())
            .unwrap();
        let addr = s.local_addr().unwrap().as_socket().unwrap();
        (s, addr)
    }

    #[test]
    fn an_agent_that_starts_listening_after_a_refusal_is_reached() {
        let (s, addr) = not_listening();
        let mut refusals = 0;
        let got = dial(
            addr,
            Duration::from_secs(5),
            Instant::now() + Duration::from_secs(60),
            |n| {
                refusals = n;
                if n == 1 {
                    s.listen(1).unwrap();
                }
            },
        );
        assert!(got.is_ok(), "{got:?}");
        assert_eq!(refusals, 1);
    }

    #[test]
    fn an_agent_that_never_listens_is_an_error_at_the_deadline() {
        let (_s, addr) = not_listening();
        let got = dial(
            addr,
            Duration::from_secs(5),
            Instant::now() + 3 * REDIAL,
            |_| {},
        );
        assert_eq!(
            got.unwrap_err().kind(),
            std::io::ErrorKind::ConnectionRefused
        );
    }
}

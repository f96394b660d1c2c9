//! The node agent: one per host, long-running, driven by one run control at a time. It takes
//! the roles `[hosts]` places on its host, binds their listening sockets when it is configured
//! (so every address is known before any role connects, whatever the ports), runs them through
//! [`Session`] for each run, and answers what they count. It survives runs: a run ends, the
//! agent waits for the next configure.
//!
//! A run control that goes silent (its host or network lost) for `control.agent_timeout_ms`
//! is lost: the agent stops its run in stages, as a stop would, so that what its roles hold is
//! drained and written rather than dropped, and writes the part's report beside its files.

use anyhow::{anyhow, bail, Context, Result};
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tessera_config::{Resolved, Topology};
use tessera_node_protocol::{self as proto, Deadlines, Reply, Request};
use tessera_run::{RoleSet, Session, StageReport, StopDeadlines, StopStage};

use crate::link::{recv, send};
use crate::tls::Stream;

/// Connections served at once (the driving run control's among them).
const MAX_CONNECTIONS: usize = 16;

/// Connections from one address not yet past their hello: beyond this, its oldest is closed.
const PENDING_PER_PEER: usize = 2;

/// Who may connect to the agent: once a configure told it the run's `security.allow`, loopback,
/// those networks and the addresses of run controls that said a good hello; before that, anyone
/// (a fresh agent must be reachable by its run control), each held to [`PENDING_PER_PEER`]
/// connections without a hello.
#[derive(Clone, Debug, Default)]
pub struct Trust(Arc<Mutex<TrustState>>);

#[derive(Debug, Default)]
struct TrustState {
    networks: Option<Vec<ipnet::IpNet>>,
    run_controls: Vec<IpAddr>,
}

impl Trust {
    fn admits(&self, ip: IpAddr) -> bool {
        let t = self.0.lock();
        t.networks
            .as_ref()
            .is_none_or(|n| tessera_net::io::ip_in(ip, n) || t.run_controls.contains(&ip))
    }

    fn run_control(&self, ip: IpAddr) {
        let mut t = self.0.lock();
        if !t.run_controls.contains(&ip) {
            // The last few: a run control moved to another host is let in too.
            if t.run_controls.len() >= 8 {
                t.run_controls.remove(0);
            }
            t.run_controls.push(ip);
        }
    }

    fn networks(&self, n: Vec<ipnet::IpNet>) {
        self.0.lock().networks = Some(n);
    }
}

/// A connection being served.
struct Conn {
    ip: IpAddr,
    /// To close it from the accepting loop (shut down: its thread's read ends).
    stream: TcpStream,
    /// It said its first message: no longer a silent stranger.
    spoke: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

/// How the agent was started.
#[derive(Clone, Debug)]
pub struct AgentOptions {
    /// What the run control must present in its hello.
    pub token: String,
    /// Overrides `run.output` for this host's files.
    pub output: Option<PathBuf>,
    /// How long the run control may be silent before this agent calls it lost (until a
    /// configure gives `control.agent_timeout_ms`).
    pub control_timeout: Duration,
    /// Where this agent serves `/metrics` (`tessera node --metrics`), told to the run control.
    pub metrics: Option<SocketAddr>,
    /// What `/metrics` shows, kept up to date by the driving connection.
    pub published: crate::metrics::Shared,
    /// Who may connect (the last configure's `security.allow`, the run controls seen).
    pub trust: Trust,
    /// TLS (`tessera node --tls-certificate --tls-key`): then only TLS.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

/// Serves run controls on `listener` until `stop` is raised. One drives the agent at a time;
/// another is refused, told which one drives it.
pub fn serve(listener: TcpListener, opts: AgentOptions, stop: Arc<AtomicBool>) -> Result<()> {
    if opts.token.is_empty() {
        bail!("a node agent needs a token (--token or TESSERA_TOKEN): the run control presents the same one");
    }
    listener.set_nonblocking(true)?;
    let driver: Arc<Mutex<Option<SocketAddr>>> = Arc::default();
    let mut conns: Vec<Conn> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((s, peer)) => {
                conns.retain(|c| !c.thread.is_finished());
                let ip = peer.ip();
                if !opts.trust.admits(ip) {
                    tracing::warn!(%peer, "refused a connection from outside security.allow (and not a run control seen before)");
                    drop(s);
                    continue;
                }
                // Silent connections cannot keep the run control out: one address holds at most
                // a few without a hello, and at the limit the oldest silent one makes room (a
                // run control says its hello as soon as it connects).
                let silent = |c: &&Conn| !c.spoke.load(Ordering::Acquire);
                let close_oldest = |conns: &mut Vec<Conn>, of: Option<IpAddr>| -> bool {
                    let Some(i) = conns
                        .iter()
                        .position(|c| silent(&c) && of.is_none_or(|ip| c.ip == ip))
                    else {
                        return false;
                    };
                    let c = conns.remove(i);
                    tracing::warn!(peer = %c.ip, "closed a connection that said nothing, to make room");
                    let _ = c.stream.shutdown(std::net::Shutdown::Both);
                    true
                };
                if conns.iter().filter(|c| c.ip == ip).filter(silent).count() >= PENDING_PER_PEER {
                    close_oldest(&mut conns, Some(ip));
                }
                if conns.len() >= MAX_CONNECTIONS && !close_oldest(&mut conns, None) {
                    tracing::warn!(%peer, "too many connections at once: closed");
                    drop(s);
                    continue;
                }
                s.set_nonblocking(false)?;
                let stream = s.try_clone()?;
                let spoke = Arc::new(AtomicBool::new(false));
                let (opts, driver, stop) = (opts.clone(), driver.clone(), stop.clone());
                let said = spoke.clone();
                let thread = std::thread::spawn(move || {
                    if let Err(e) = connection(s, peer, &opts, &driver, &stop, &said) {
                        tracing::warn!(%peer, error = %format!("{e:#}"), "run control connection ended");
                    }
                });
                conns.push(Conn {
                    ip,
                    stream,
                    spoke,
                    thread,
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e).context("accepting run controls"),
        }
    }
    for c in conns {
        let _ = c.thread.join();
    }
    Ok(())
}

/// Where an agent keeps its part's report of a run whose run control it lost.
fn kept_report_name(run: u64, host: &str) -> String {
    format!("run{run:06}.{host}.report.json")
}

/// This host's system name (`unknown` when it cannot be read).
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// One run control's connection: the hello, then requests answered in order.
fn connection(
    raw: TcpStream,
    peer: SocketAddr,
    opts: &AgentOptions,
    driver: &Mutex<Option<SocketAddr>>,
    stop: &AtomicBool,
    spoke: &AtomicBool,
) -> Result<()> {
    raw.set_nodelay(true)?;
    raw.set_read_timeout(Some(Duration::from_secs(5)))?;
    // A peer speaking the other way (TLS to an agent in clear, or the reverse) is told so,
    // rather than left with a closed connection to puzzle over.
    let Some(opening) = crate::tls::peek_opening(&raw) else {
        tracing::debug!(%peer, "connection closed before its hello");
        return Ok(());
    };
    match (&opts.tls, crate::tls::opens_tls(&opening)) {
        (Some(_), false) => {
            let reason = format!(
                "the agent on {} speaks TLS only: give the run control its certificate authority (security.agents_ca)",
                host_name()
            );
            tracing::warn!(%peer, %reason, "run control refused");
            let mut raw = raw;
            send(
                &mut raw,
                &Reply::Refused {
                    reason: reason.clone(),
                },
            )?;
            bail!("{reason}");
        }
        (None, true) => {
            bail!("a TLS handshake, but this agent has no certificate (tessera node --tls-certificate and --tls-key): closed");
        }
        _ => {}
    }
    let mut s = Stream::accept(raw, opts.tls.as_ref())?;
    // Read as a plain object first: a hello of another revision (its members differ) is still
    // answered with both revisions named.
    let hello: serde_json::Value = match recv(&mut s, proto::MAX_HELLO) {
        Ok(h) => {
            spoke.store(true, Ordering::Release);
            h
        }
        // A connection closed before a word (a port probe, `tessera launch` asking whether
        // the agent answers) is no run control.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            tracing::debug!(%peer, "connection closed before its hello");
            return Ok(());
        }
        Err(e) => return Err(e).context("reading the hello"),
    };
    let me = host_name();
    let refuse = |s: &mut Stream, reason: String| -> Result<()> {
        tracing::warn!(%peer, %reason, "run control refused");
        send(
            s,
            &Reply::Refused {
                reason: reason.clone(),
            },
        )?;
        bail!("{reason}")
    };
    let is_hello = hello.get("type").and_then(|t| t.as_str()) == Some("hello");
    let protocol = hello.get("protocol").and_then(|p| p.as_u64());
    if is_hello && protocol != Some(proto::PROTOCOL as u64) {
        let software = hello
            .get("software")
            .and_then(|p| p.as_str())
            .unwrap_or("?");
        return refuse(
            &mut s,
            format!(
                "node protocol revision {} ({software}) at the run control, {} ({}) at the agent on {me}",
                protocol.map_or("?".to_string(), |p| p.to_string()),
                proto::PROTOCOL,
                crate::software()
            ),
        );
    }
    let Ok(Request::Hello {
        software,
        nonce: control_nonce,
        ..
    }) = serde_json::from_value::<Request>(hello)
    else {
        return refuse(&mut s, "the first message must be a hello".into());
    };
    // The run control proves it holds the token over a nonce of this connection: the token
    // never crosses it, and a captured exchange proves nothing the next time.
    let agent_nonce = crate::fresh_nonce();
    send(
        &mut s,
        &Reply::Challenge {
            nonce: agent_nonce.clone(),
        },
    )?;
    let given = match recv::<Request>(&mut s, proto::MAX_HELLO) {
        Ok(Request::Proof { proof }) => proof,
        Ok(_) => return refuse(&mut s, "a hello must be followed by its proof".into()),
        Err(e) => return Err(e).context("reading the proof"),
    };
    if !proto::proof_holds(
        &opts.token,
        proto::RUN_CONTROL_PROOF,
        &agent_nonce,
        &control_nonce,
        &given,
    ) {
        return refuse(&mut s, format!("wrong token for the agent on {me}"));
    }
    opts.trust.run_control(peer.ip());
    {
        let mut d = driver.lock();
        if let Some(other) = *d {
            drop(d);
            return refuse(
                &mut s,
                format!("the agent on {me} is driven by the run control at {other}"),
            );
        }
        *d = Some(peer);
    }
    tracing::info!(%peer, %software, "run control connected");
    // Bound to every interface: reached where the run control reached this agent.
    let metrics = opts.metrics.map(|m| {
        let ip = match (m.ip().is_unspecified(), s.tcp().local_addr()) {
            (true, Ok(local)) => local.ip(),
            _ => m.ip(),
        };
        SocketAddr::new(ip, m.port()).to_string()
    });
    send(
        &mut s,
        &Reply::Hello {
            protocol: proto::PROTOCOL,
            software: crate::software(),
            host: me,
            metrics,
            proof: proto::proof(
                &opts.token,
                proto::AGENT_PROOF,
                &control_nonce,
                &agent_nonce,
            ),
        },
    )?;
    opts.published.lock().driven = true;
    let mut agent = Agent {
        opts: opts.clone(),
        part: None,
        // What was logged before this run control came is not its business.
        log_seq: crate::logbook::LOG.last_seq(),
    };
    let result = agent.serve(&mut s, stop);
    // Whatever ended the connection, a run still open is stopped in stages and its report
    // kept here: its data is drained and written, not dropped with the run control.
    if let Some(part) = agent.part.as_mut() {
        if let Some(session) = part.session.take() {
            tracing::warn!(
                run = session.run_number(),
                "the run control is gone: stopping this host's part of the run in stages"
            );
            let d = StopDeadlines::from(&part.r.topology.stop);
            let stop = session.stop(&d);
            match session.finish("run control lost", stop) {
                Ok(report) => {
                    let path = part
                        .output
                        .join(kept_report_name(report.run_number, &part.host));
                    let _ = std::fs::write(&path, serde_json::to_vec_pretty(&report)?);
                    tracing::warn!(file = %path.display(), "this host's report of the run written");
                }
                Err(e) => tracing::error!(error = %format!("{e:#}"), "finishing the run"),
            }
        }
    }
    {
        let mut p = opts.published.lock();
        p.driven = false;
        p.live = None;
    }
    *driver.lock() = None;
    result
}

/// This host's share of the configured run.
struct Part {
    host: String,
    r: Resolved,
    roles: RoleSet,
    output: PathBuf,
    /// Bound at configure, taken by the run's start.
    listeners: HashMap<String, TcpListener>,
    session: Option<Session>,
    stages: Vec<StageReport>,
}

struct Agent {
    opts: AgentOptions,
    part: Option<Part>,
    /// The last log line handed to the run control.
    log_seq: u64,
}

impl Agent {
    fn serve(&mut self, s: &mut Stream, stop: &AtomicBool) -> Result<()> {
        loop {
            // Twice the run control's own limit: it asks five times a second, and it should be
            // the one to see a broken link first and name the host.
            let timeout = self.part.as_ref().map_or(self.opts.control_timeout, |p| {
                Duration::from_millis(2 * p.r.topology.control.agent_timeout_ms.max(100))
            });
            s.tcp().set_read_timeout(Some(timeout))?;
            let req: Request = match recv(s, proto::MAX_FRAME) {
                Ok(r) => r,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    bail!(
                        "the run control was silent for {} ms: lost",
                        timeout.as_millis()
                    )
                }
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e).context("reading a request"),
            };
            if stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            // A request that takes long (a stop stage draining) says `working` every second,
            // so the run control can tell a busy agent from a lost one.
            let (tx, rx) = std::sync::mpsc::channel();
            let reply = std::thread::scope(|scope| {
                scope.spawn(|| {
                    let r = self.handle(req);
                    let _ = tx.send(r);
                });
                let w = &mut *s;
                loop {
                    match rx.recv_timeout(Duration::from_secs(1)) {
                        Ok(r) => return Ok::<Reply, anyhow::Error>(r),
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                            send(w, &Reply::Working {})?
                        }
                        Err(_) => return Err(anyhow!("request handler ended without a reply")),
                    }
                }
            })?;
            send(s, &reply)?;
        }
    }

    fn handle(&mut self, req: Request) -> Reply {
        let result = match req {
            Request::Hello { .. } | Request::Proof { .. } => Err(anyhow!("a second hello")),
            Request::Configure {
                topology,
                origin,
                host,
            } => return self.configure(&topology, &origin, &host),
            Request::Start {
                run_number,
                addresses,
                events,
            } => self
                .start(run_number, &addresses, events)
                .map(|_| Reply::Ok {}),
            Request::Release {} | Request::Resume {} => self.with_session(|s| s.resume()),
            Request::Hold {} => self.session().map(|s| Reply::Held {
                claimed: s.hold_triggers(),
            }),
            Request::Align { end } => self.with_session(|s| s.align_triggers(end)),
            Request::Status {} => Ok(self.status()),
            Request::StopBegin { deadlines } => {
                self.with_session(|s| s.stop_begin(&crate::from_wire(&deadlines)))
            }
            Request::StopStage { stage, deadlines } => self.stop_stage(&stage, &deadlines),
            Request::Finish { stop_reason } => self.finish(&stop_reason),
            Request::Report {} => self.report(),
            Request::Why { event_id } => self.why(event_id),
            Request::RunFiles { run } => self.run_files(run),
            Request::KeptReport { run } => self.kept_report(run),
            Request::Reset {} => {
                self.reset();
                Ok(Reply::Ok {})
            }
        };
        result.unwrap_or_else(|e| Reply::Error {
            message: format!("{e:#}"),
        })
    }

    fn session(&self) -> Result<&Session> {
        self.part
            .as_ref()
            .and_then(|p| p.session.as_ref())
            .ok_or_else(|| anyhow!("no run is open on this host"))
    }

    fn with_session(&self, f: impl FnOnce(&Session)) -> Result<Reply> {
        f(self.session()?);
        Ok(Reply::Ok {})
    }

    fn reset(&mut self) {
        if let Some(mut p) = self.part.take() {
            if let Some(s) = p.session.take() {
                let mut d = StopDeadlines::from(&p.r.topology.stop);
                d.max_ms = d.max_ms.max(1);
                let stop = s.stop(&d);
                let _ = s.finish("reset", stop);
            }
        }
    }

    /// Parses the topology, checks this host's roles and binds their sockets: every problem
    /// found is said, not only the first.
    fn configure(&mut self, text: &str, origin: &str, host: &str) -> Reply {
        if self.part.as_ref().is_some_and(|p| p.session.is_some()) {
            return Reply::Error {
                message: "a run is open on this host: stop it before configuring".into(),
            };
        }
        // Sockets of an earlier configure are released before the new ones bind.
        self.part = None;
        let mut r = match Topology::parse(text, origin) {
            Ok(r) => r,
            Err(e) => {
                return Reply::Problems {
                    problems: vec![e.to_string()],
                }
            }
        };
        let Some(entry) = r.topology.hosts.get(host) else {
            return Reply::Problems {
                problems: vec![format!("{origin}: hosts: no host {host:?}")],
            };
        };
        let data_ip: Option<IpAddr> = entry.data_address().parse().ok();
        // The run control holds the same token as this agent: a monitor placed beyond loopback
        // asks consumers for it (the dashboard's sampler among them).
        if r.topology.control.effective_token().is_none() {
            r.topology.control.token = tessera_config::Secret::new(self.opts.token.clone());
        }
        // From now on the agent's own port takes what the run's data ports take (and the run
        // controls it has seen).
        self.opts
            .trust
            .networks(r.topology.security.networks().unwrap_or_default());
        let roles = RoleSet::of_host(host, &r);
        let output = self
            .opts
            .output
            .clone()
            .unwrap_or_else(|| r.topology.run.output.clone());
        let mut problems = Vec::new();
        if !roles.sources.is_empty() {
            problems.extend(outside_the_agents_directory(
                &mut r,
                self.opts.output.as_deref(),
            ));
        }
        if let Err(e) = writable(&output) {
            problems.push(format!("output directory {}: {e:#}", output.display()));
        }
        let need = memory_needed(&r, &roles);
        if let Some(avail) = memory_available() {
            if need > avail {
                problems.push(format!(
                    "its roles' buffers and bookkeeping need {} MB at most, the host has {} MB available",
                    need >> 20,
                    avail >> 20
                ));
            }
        }
        let mut listeners = HashMap::new();
        let mut addresses = BTreeMap::new();
        for (key, listen) in roles.listens(&r) {
            let (bind, advertise_ip) = placed(&listen, data_ip);
            match TcpListener::bind(&bind) {
                Ok(l) => {
                    let got = match l.local_addr() {
                        Ok(a) => a,
                        Err(e) => {
                            problems.push(format!("{key}: {e}"));
                            continue;
                        }
                    };
                    let ip = advertise_ip.unwrap_or(got.ip());
                    addresses.insert(key.clone(), SocketAddr::new(ip, got.port()).to_string());
                    listeners.insert(key, l);
                }
                Err(e) => problems.push(format!("{key}: cannot listen on {bind}: {e}")),
            }
        }
        // `[shipper]` on the recorder's host, held by the agent (not by this run control's
        // connection): files drain between runs and after the run control has gone.
        {
            let held = &mut self.opts.published.lock().shipper;
            if !roles.recorder {
                tessera_run::shipping::stop(held);
            } else if let Err(e) = tessera_run::shipping::ensure(held, &r.topology, &output) {
                problems.push(format!("{e:#}"));
            }
        }
        if !problems.is_empty() {
            return Reply::Problems { problems };
        }
        let names = roles.names();
        tracing::info!(host, roles = ?names, ?addresses, "configured");
        self.opts.published.lock().host = Some(host.to_string());
        self.part = Some(Part {
            host: host.to_string(),
            r,
            roles,
            output,
            listeners,
            session: None,
            stages: Vec::new(),
        });
        Reply::Configured {
            roles: names,
            addresses,
        }
    }

    fn start(
        &mut self,
        run_number: u64,
        addresses: &BTreeMap<String, String>,
        events: Option<u64>,
    ) -> Result<()> {
        let p = self
            .part
            .as_mut()
            .ok_or_else(|| anyhow!("not configured"))?;
        if p.session.is_some() {
            bail!("a run is already open on this host");
        }
        if p.listeners.len() != p.roles.listens(&p.r).len() {
            bail!("this host's sockets were used by an earlier run: configure again");
        }
        let r = tessera_run::with_addresses(&p.r, addresses)?;
        let listeners: tessera_run::Listeners =
            Arc::new(Mutex::new(std::mem::take(&mut p.listeners)));
        let opts = tessera_run::Options {
            events,
            output: Some(p.output.clone()),
            status: tessera_run::StatusMode::Off,
            manifest: false,
            run_number: Some(run_number),
            roles: Some(p.roles.clone()),
            listeners,
            start_held: true,
            part: Some(p.host.clone()),
            shipper: self
                .opts
                .published
                .lock()
                .shipper
                .as_ref()
                .map(|h| h.service.clone()),
            ..Default::default()
        };
        let session = Session::start(&r, &opts)
            .with_context(|| format!("starting {}", p.roles.names().join(", ")))?;
        tracing::info!(run = run_number, host = %p.host, "started");
        p.session = Some(session);
        p.stages.clear();
        Ok(())
    }

    fn status(&mut self) -> Reply {
        let (mut logs, next) = crate::logbook::LOG.since(self.log_seq, 1000);
        self.log_seq = next;
        let host = self
            .part
            .as_ref()
            .map(|p| p.host.clone())
            .unwrap_or_default();
        for l in &mut logs {
            l.host.clone_from(&host);
        }
        match self
            .part
            .as_ref()
            .and_then(|p| Some((p, p.session.as_ref()?)))
        {
            None => {
                self.opts.published.lock().live = None;
                Reply::Status {
                    live: serde_json::Value::Null,
                    sources_ended: false,
                    disk_full: false,
                    logs,
                }
            }
            Some((p, s)) => {
                let mut live = s.live();
                for c in &mut live.components {
                    c.host = Some(p.host.clone());
                }
                // Kept for /metrics only where it is served: no copy of the view otherwise.
                if self.opts.metrics.is_some() {
                    let mut pb = self.opts.published.lock();
                    pb.host = Some(p.host.clone());
                    pb.live = Some(live.clone());
                }
                Reply::Status {
                    live: serde_json::to_value(live).unwrap_or_default(),
                    sources_ended: s.sources_ended(),
                    disk_full: s.disk_full(),
                    logs,
                }
            }
        }
    }

    fn stop_stage(&mut self, stage: &str, d: &Deadlines) -> Result<Reply> {
        let stage: StopStage = serde_json::from_value(serde_json::Value::String(stage.into()))
            .map_err(|_| anyhow!("{stage:?} is not a stage of a stop"))?;
        let rep = self.session()?.stop_stage(stage, &crate::from_wire(d));
        if let Some(p) = self.part.as_mut() {
            p.stages.push(rep.clone());
        }
        Ok(Reply::Stage {
            report: serde_json::to_value(rep)?,
        })
    }

    fn finish(&mut self, reason: &str) -> Result<Reply> {
        let p = self
            .part
            .as_mut()
            .ok_or_else(|| anyhow!("not configured"))?;
        let s = p
            .session
            .take()
            .ok_or_else(|| anyhow!("no run is open on this host"))?;
        let stop = s.stop_report(std::mem::take(&mut p.stages));
        self.opts.published.lock().live = None;
        let report = s.finish(reason, stop)?;
        tracing::info!(run = report.run_number, host = %p.host, "finished");
        Ok(Reply::Report {
            report: serde_json::to_value(report)?,
        })
    }

    fn report(&self) -> Result<Reply> {
        Ok(Reply::Report {
            report: serde_json::to_value(self.session()?.report("running", false))?,
        })
    }

    fn why(&self, event_id: u64) -> Result<Reply> {
        Ok(Reply::Why {
            answer: serde_json::to_value(self.session()?.why_incomplete(event_id))?,
        })
    }

    /// This host's report of a run it finished alone, having lost its run control: the name is
    /// made here from the run number, so a request cannot name another file.
    fn kept_report(&self, run: u64) -> Result<Reply> {
        let part = self
            .part
            .as_ref()
            .ok_or_else(|| anyhow!("this host is not configured"))?;
        if part.session.as_ref().is_some_and(|s| s.run_number() == run) {
            bail!("run {run} is still open on this host");
        }
        let path = part.output.join(kept_report_name(run, &part.host));
        let text = match std::fs::read(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                bail!("no report of run {run} kept on this host")
            }
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        let report: serde_json::Value = serde_json::from_slice(&text)
            .with_context(|| format!("{} does not parse", path.display()))?;
        Ok(Reply::Report { report })
    }

    /// The files of a run the run control closes as crashed, its `.part` files finished first.
    fn run_files(&self, run: u64) -> Result<Reply> {
        let part = self
            .part
            .as_ref()
            .ok_or_else(|| anyhow!("this host is not configured"))?;
        if part.session.is_some() {
            bail!("a run is open on this host: its files are not closed here");
        }
        let (recovered, files) = tessera_verify::recover::close_run(&part.output, run)?;
        for r in &recovered {
            tracing::warn!(
                file = r.file,
                events = r.events,
                "finished a file a crashed run left"
            );
        }
        Ok(Reply::RunFiles {
            files: files
                .iter()
                .map(serde_json::to_value)
                .collect::<Result<_, _>>()?,
            recovered: recovered.into_iter().map(|r| r.file).collect(),
        })
    }
}

/// Where a role's socket binds on this host, and the address it is reached at when that is
/// not the bound one. A loopback address in the topology (the default, `127.0.0.1:0`) means
/// "this host's data address", since a role on another host could not reach it; an
/// unspecified one (`0.0.0.0:7100`) binds every interface and is reached at the data address.
fn placed(listen: &str, data_ip: Option<IpAddr>) -> (String, Option<IpAddr>) {
    let (h, port) = listen.rsplit_once(':').unwrap_or((listen, "0"));
    let h = h.trim_start_matches('[').trim_end_matches(']');
    let ip: Option<IpAddr> = if h == "localhost" {
        Some(IpAddr::from([127, 0, 0, 1]))
    } else {
        h.parse().ok()
    };
    match (ip, data_ip) {
        (Some(ip), Some(d)) if ip.is_loopback() => (
            SocketAddr::new(d, port.parse().unwrap_or(0)).to_string(),
            None,
        ),
        (Some(ip), Some(d)) if ip.is_unspecified() => (listen.to_string(), Some(d)),
        _ => (listen.to_string(), None),
    }
}

fn writable(dir: &std::path::Path) -> Result<()> {
    std::fs::create_dir_all(dir).context("cannot create it")?;
    let probe = dir.join(format!(".tessera-node-probe-{}", std::process::id()));
    std::fs::write(&probe, b"probe").context("cannot write in it")?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// What this host's roles may hold at most, as `tessera check` counts it (all of it resident
/// from the start where they reserve their buffers).
/// The input files this host's sources would read (trigger times, a size histogram, a recording
/// to replay) that lie outside the agent's own directory (`--output`, else the directory it was
/// started in). The run control holds the token, not the host: an agent (often root) reads no
/// file it was not given room for, so a topology cannot make it read, and answer with, any file
/// of its host.
fn outside_the_agents_directory(r: &mut Resolved, own: Option<&Path>) -> Vec<String> {
    let s = &r.topology.sources;
    if s.scenario.is_none() && s.size_histogram.is_none() && s.replay.is_none() {
        return Vec::new();
    }
    let Ok(base) = own
        .map(Path::to_path_buf)
        .map_or_else(std::env::current_dir, Ok)
        .and_then(|d| std::fs::create_dir_all(&d).and_then(|_| d.canonicalize()))
    else {
        return vec![
            "this agent's directory cannot be resolved: its sources read no input file".into(),
        ];
    };
    let s = &mut r.topology.sources;
    let mut problems = Vec::new();
    for (key, p) in [
        ("sources.scenario", &mut s.scenario),
        ("sources.size_histogram", &mut s.size_histogram),
        ("sources.replay", &mut s.replay),
    ] {
        let Some(p) = p.as_mut() else { continue };
        // A relative name is the agent's directory's (the sources read it from there).
        if p.is_relative() {
            *p = base.join(&*p);
        }
        // Resolved as the file system will (links followed), so `..` or a link cannot lead out.
        if !p.canonicalize().is_ok_and(|c| c.starts_with(&base)) {
            problems.push(format!(
                "{key}: {} is not a file under this agent's directory {}: an agent reads its sources' input files only from there (put the file there, or start the agent with --output naming a directory that holds it)",
                p.display(),
                base.display()
            ));
        }
    }
    problems
}

fn memory_needed(r: &Resolved, roles: &RoleSet) -> u64 {
    use tessera_run::check::Unit;
    tessera_run::check::memory(r)
        .into_iter()
        .filter(|(u, _)| match u {
            Unit::Readout(id) => roles.readout_units.contains(id),
            Unit::Builder(id) => roles.builders.contains(id),
            Unit::Recorder => roles.recorder,
            Unit::EventManager => roles.event_manager,
        })
        .map(|(_, m)| m)
        .sum()
}

fn memory_available() -> Option<u64> {
    let m = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = m.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loopback_listen_is_placed_on_the_data_address() {
        let d: IpAddr = "10.77.1.2".parse().unwrap();
        assert_eq!(placed("127.0.0.1:0", Some(d)), ("10.77.1.2:0".into(), None));
        assert_eq!(
            placed("0.0.0.0:7100", Some(d)),
            ("0.0.0.0:7100".into(), Some(d))
        );
        assert_eq!(
            placed("10.9.9.9:7100", Some(d)),
            ("10.9.9.9:7100".into(), None)
        );
        assert_eq!(placed("127.0.0.1:0", None), ("127.0.0.1:0".into(), None));
    }
}

//! Starting each role of a run: one function per role, over what every start needs (the
//! topology, the options, the sizes derived from them, how to get a listening socket).
//! [`Session::start`](crate::Session::start) calls them sink first and wires their addresses.

use anyhow::{anyhow, bail, Context, Result};
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tessera_builder::{BuilderConfig, BuilderUnit};
use tessera_config::Resolved;
use tessera_readout::{ReadoutConfig, ReadoutUnit};
use tessera_recorder::{Recorder, RecorderConfig};
use tessera_source::SourcePlan;

use crate::{max_fragment_wire, Options, RoleSet};

/// The monitor and its TCP service, where the recorder runs.
pub(crate) type MonitorParts = (tessera_monitor::Monitor, tessera_monitor::Server);

/// What starting every role needs to know.
pub(crate) struct Starter<'a> {
    pub r: &'a Resolved,
    pub opts: &'a Options,
    /// The roles this process runs (`None`: all).
    pub sel: Option<RoleSet>,
    pub output: PathBuf,
    pub run_number: u64,
    pub events: u64,
    pub max_payload: usize,
    max_ru_links: usize,
    /// Largest super-fragment and event record on the wire.
    max_sf: usize,
    max_event: usize,
    frag_wire: usize,
}

impl<'a> Starter<'a> {
    pub fn new(
        r: &'a Resolved,
        opts: &'a Options,
        sel: Option<RoleSet>,
        output: PathBuf,
        run_number: u64,
    ) -> Starter<'a> {
        let t = &r.topology;
        let max_payload = t.run.max_fragment_size.0 as usize;
        let frag_wire = max_fragment_wire(max_payload);
        let max_ru_links = r.ru_sources.iter().map(Vec::len).max().unwrap_or(1);
        Starter {
            r,
            opts,
            sel,
            output,
            run_number,
            events: opts.events.unwrap_or(t.run.events),
            max_payload,
            max_ru_links,
            max_sf: 64 + max_ru_links * (4 + frag_wire),
            max_event: 64 + r.source_ru.len() * (4 + frag_wire),
            frag_wire,
        }
    }

    pub fn runs_recorder(&self) -> bool {
        self.sel.as_ref().is_none_or(|s| s.recorder)
    }
    pub fn runs_manager(&self) -> bool {
        self.sel.as_ref().is_none_or(|s| s.event_manager)
    }
    pub fn runs_builder(&self, id: u32) -> bool {
        self.sel.as_ref().is_none_or(|s| s.builders.contains(&id))
    }
    pub fn runs_readout(&self, id: u32) -> bool {
        self.sel
            .as_ref()
            .is_none_or(|s| s.readout_units.contains(&id))
    }
    pub fn runs_source(&self, id: u32) -> bool {
        self.sel.as_ref().is_none_or(|s| s.sources.contains(&id))
    }
    /// Whether this run records (not a bench sinking at the builders, recorder enabled).
    pub fn recording(&self) -> bool {
        !self.opts.sink_at_builders && self.r.topology.recorder.enabled
    }
    pub fn request_mode(&self) -> bool {
        self.r.topology.run.mode == tessera_config::Mode::Request
    }

    /// A socket bound before the start (by a node agent) is taken as it is; a role run alone
    /// may be handed its listening socket (systemd socket activation, or a harness that bound
    /// it): then the configured port must be the one it is bound to.
    pub fn bind(&self, key: &str, addr: &str, what: &str) -> Result<TcpListener> {
        let opts = self.opts;
        if let Some(l) = opts.listeners.lock().remove(key) {
            return Ok(l);
        }
        // `what` is the key that sets the address: the error says which one to change.
        let fresh = || {
            TcpListener::bind(addr).with_context(|| {
                format!("{what}: cannot listen on {addr} (another run on this host? set another address: --set {what}=127.0.0.1:0 takes a free port)")
            })
        };
        // The one inherited socket is a role's main port, never a builder's further rail.
        if opts.only.is_none() || key == "monitor" || key.matches(':').count() > 1 {
            return fresh();
        }
        match tessera_net::io::inherited_listener() {
            None => fresh(),
            Some(Err(e)) => Err(e).with_context(|| format!("{what}: the inherited socket")),
            Some(Ok(l)) => {
                let got = l.local_addr()?;
                let want_port = addr
                    .rsplit_once(':')
                    .and_then(|(_, p)| p.parse::<u16>().ok());
                if want_port.is_some_and(|p| p != 0 && p != got.port()) {
                    bail!(
                        "{what}: the inherited socket is bound to {got}, the topology says {addr}"
                    );
                }
                Ok(l)
            }
        }
    }

    /// The monitor lives with the recorder, which offers it every event it records.
    pub fn monitor(&self) -> Result<Option<MonitorParts>> {
        let (r, t) = (self.r, &self.r.topology);
        if !(self.recording() && self.runs_recorder() && t.monitor.enabled) {
            return Ok(None);
        }
        let m = tessera_monitor::Monitor::new(&t.monitor)
            .map_err(|e| anyhow::anyhow!("{}: monitor: {e}", r.origin))?;
        // Beyond loopback the monitor asks for the run control's token in every command but
        // `status` (an allowed network is not enough to hold the recorder).
        let monitor_token = if tessera_config::is_loopback_listen(&t.monitor.listen) {
            None
        } else {
            let token = t.control.effective_token();
            if token.is_none() {
                bail!(
                    "{}: monitor.listen = {} is not a loopback address: set control.token (or TESSERA_TOKEN); consumers present it in their commands",
                    r.origin,
                    t.monitor.listen
                );
            }
            token
        };
        let l = self.bind("monitor", &t.monitor.listen, "monitor.listen")?;
        let server = tessera_monitor::Server::start(
            l,
            m.clone(),
            tessera_monitor::ServerOptions {
                heartbeat: Duration::from_millis(t.monitor.heartbeat_ms as u64),
                consumer_timeout: Duration::from_millis(t.monitor.consumer_timeout_ms as u64),
                sampling_idle_priority: t.monitor.sampling_idle_priority,
                token: monitor_token,
                hold_token: t.control.effective_token(),
            },
        )
        .context("starting the monitor")?;
        // Consumers of a run with an ephemeral port find it here.
        let addr_file = self.output.join("monitor.addr");
        std::fs::write(&addr_file, format!("{}\n", server.addr))
            .with_context(|| format!("writing {}", addr_file.display()))?;
        Ok(Some((m, server)))
    }

    /// The recorder, if this process runs it, and the address it listens on.
    pub fn recorder(
        &self,
        monitor: Option<&tessera_monitor::Monitor>,
    ) -> Result<Option<(Recorder, String)>> {
        let (r, t) = (self.r, &self.r.topology);
        if !self.recording() || !self.runs_recorder() {
            return Ok(None);
        }
        let l = self.bind("recorder", &t.recorder.listen, "recorder.listen")?;
        let addr = l.local_addr()?.to_string();
        let adopted = self.adopt_run_files()?;
        let rec = Recorder::start(RecorderConfig {
            listener: l,
            builders: t.builders.iter().map(|b| b.id as u16).collect(),
            output: self.output.clone(),
            run_number: self.run_number,
            config_digest: r.digest,
            pattern: r.pattern.name().into(),
            sources: r.all_sources(),
            // Replayed payloads are the recording's, not the pattern's.
            pattern_sources: if t.sources.replay.is_some() {
                Vec::new()
            } else {
                r.emulated_sources().collect()
            },
            settings: t.recorder.clone(),
            max_message: self.max_event,
            monitor: monitor.cloned(),
            takeover: Duration::from_secs(t.recorder.takeover_s),
            adopted,
            histograms: t.histograms.clone(),
        })?;
        Ok(Some((rec, addr)))
    }

    /// A recorder starting where files of its run already lie takes them over: an earlier
    /// recorder of this run died or was restarted (`tessera serve recorder` again, wire format
    /// §2.8). Its `.part` is finished, its events are counted and not written twice, and no file
    /// of the run is ever overwritten. A run whose manifest exists was closed: recording into it
    /// again is refused.
    fn adopt_run_files(&self) -> Result<tessera_recorder::Adopted> {
        let manifest = self
            .output
            .join(format!("run{:06}.manifest.json", self.run_number));
        if manifest.exists() {
            bail!(
                "run {} is closed already ({} exists): give this run another number",
                self.run_number,
                manifest.display()
            );
        }
        let (recovered, adopted) = tessera_verify::recover::adopt_run(
            &self.output,
            self.run_number,
            tessera_recorder::DEDUP_WINDOW,
        )
        .with_context(|| format!("taking over the files of run {}", self.run_number))?;
        for r in &recovered {
            tracing::warn!(
                file = r.file,
                events = r.events,
                dropped_bytes = r.dropped_bytes,
                "finished an unfinished file an earlier recorder of this run left"
            );
        }
        Ok(adopted)
    }

    /// Request mode: the event manager, listening before anyone connects to it; and where it
    /// is reached (here, or as the topology says).
    pub fn event_manager(&self) -> Result<(Option<tessera_manager::EventManager>, String)> {
        let t = &self.r.topology;
        if !(self.request_mode() && self.runs_manager()) {
            return Ok((None, t.event_manager.listen.clone()));
        }
        let l = self.bind(
            "event_manager",
            &t.event_manager.listen,
            "event_manager.listen",
        )?;
        let addr = l.local_addr()?.to_string();
        let m = &t.event_manager;
        let manager = tessera_manager::EventManager::start(tessera_manager::ManagerConfig {
            listener: l,
            readout_units: t.readout_units.iter().map(|u| u.id).collect(),
            builders: t.builders.iter().map(|b| b.id).collect(),
            settings: tessera_manager::Settings {
                clear_group: m.clear_group as usize,
                clear_delay_ns: m.clear_delay_ms * 1_000_000,
                heartbeat_timeout_ns: m.heartbeat_timeout_ms * 1_000_000,
                busy_threshold: m.busy_threshold as usize,
                done_memory: tessera_manager::DONE_MEMORY,
                builder_credits: t.request.credits,
                builder_wait_ns: m.takeover_s.saturating_mul(1_000_000_000),
            },
        })
        .context("starting the event manager")?;
        Ok((Some(manager), addr))
    }

    /// Push mode: the builders, which listen (readout units connect to them); and every
    /// builder's addresses, one per rail (here, or as the topology says).
    pub fn push_builders(
        &self,
        recorder: &Option<String>,
    ) -> Result<(Vec<BuilderUnit>, Vec<Vec<String>>)> {
        let (r, t) = (self.r, &self.r.topology);
        let mut builders = Vec::new();
        let mut addrs = Vec::new();
        for (i, b) in t.builders.iter().enumerate() {
            if self.request_mode() || !self.runs_builder(b.id) {
                addrs.push(
                    std::iter::once(&b.listen)
                        .chain(&b.rails)
                        .cloned()
                        .collect(),
                );
                continue;
            }
            let mut listeners = vec![self.bind(
                &format!("builder:{}", b.id),
                &b.listen,
                &format!("builder[{i}].listen"),
            )?];
            for (j, rail) in b.rails.iter().enumerate() {
                listeners.push(self.bind(
                    &format!("builder:{}:{}", b.id, j + 1),
                    rail,
                    &format!("builder[{i}].rails[{j}]"),
                )?);
            }
            addrs.push(
                listeners
                    .iter()
                    .map(|l| l.local_addr().map(|a| a.to_string()))
                    .collect::<std::io::Result<Vec<_>>>()?,
            );
            builders.push(
                BuilderUnit::start(BuilderConfig {
                    id: b.id as u16,
                    listeners,
                    readout_units: t
                        .readout_units
                        .iter()
                        .zip(&r.ru_sources)
                        .map(|(ru, s)| (ru.id, s.clone()))
                        .collect(),
                    recorder: recorder.clone(),
                    buffer: b.buffer.0,
                    read_chunk: b.read_chunk.0 as usize,
                    reserve: b.reserve,
                    event_timeout: Duration::from_millis(b.event_timeout_ms),
                    max_open_events: b.max_open_events,
                    max_message: self.max_sf,
                })
                .with_context(|| format!("starting builder {}", b.id))?,
            );
        }
        Ok((builders, addrs))
    }

    /// The readout units; and every unit's address (here, or as the topology says).
    pub fn readout_units(
        &self,
        builder_addrs: &[Vec<String>],
        manager_addr: &str,
        listening: &[(u32, Arc<TcpListener>)],
    ) -> Result<(Vec<ReadoutUnit>, Vec<String>)> {
        let (r, t) = (self.r, &self.r.topology);
        let mut rus = Vec::new();
        let mut addrs = Vec::new();
        for (i, ru) in t.readout_units.iter().enumerate() {
            if !self.runs_readout(ru.id) {
                addrs.push(ru.listen.clone());
                continue;
            }
            let l = self.bind(
                &format!("readout:{}", ru.id),
                &ru.listen,
                &format!("readout[{i}].listen"),
            )?;
            addrs.push(l.local_addr()?.to_string());
            let q = &t.request;
            // The sources that listen: those of the topology, and this process's emulated ones.
            let mut dial = ru.dial.clone();
            for (s, sl) in listening {
                if r.source_ru.get(s) == Some(&i) {
                    dial.push(sl.local_addr()?.to_string());
                }
            }
            rus.push(
                ReadoutUnit::start(ReadoutConfig {
                    id: ru.id,
                    listener: l,
                    sources: r.ru_sources[i].clone(),
                    builders: builder_addrs.to_vec(),
                    assignment: t.assignment.clone(),
                    buffer: ru.buffer.0,
                    read_chunk: ru.read_chunk.0 as usize,
                    reserve: ru.reserve,
                    event_timeout: Duration::from_millis(ru.event_timeout_ms),
                    max_open_events: ru.max_open_events,
                    max_payload: self.max_payload,
                    dial,
                    quarantine: ru.quarantine.then(|| {
                        (
                            self.output
                                .join("quarantine")
                                .join(format!("run{:06}_ru{}.dump", self.run_number, ru.id)),
                            ru.quarantine_limit.0,
                        )
                    }),
                    request_mode: self.request_mode().then(|| tessera_readout::RequestMode {
                        generator: None,
                        page_size: q.page_size.0 as usize,
                        descriptors: q.descriptors as usize,
                        timeout: Duration::from_millis(q.timeout_ms),
                        event_manager: manager_addr.to_string(),
                        builders: t.builders.iter().map(|b| b.id).collect(),
                        takeover: Duration::from_secs(t.event_manager.takeover_s),
                    }),
                })
                .with_context(|| format!("starting readout unit {}", ru.id))?,
            );
        }
        Ok((rus, addrs))
    }

    /// Request mode: the builders, which connect to the readout units and the event manager.
    pub fn pull_builders(
        &self,
        ru_addrs: &[String],
        manager_addr: &str,
        recorder: &Option<String>,
    ) -> Result<Vec<BuilderUnit>> {
        let (r, t) = (self.r, &self.r.topology);
        let mut builders = Vec::new();
        if !self.request_mode() {
            return Ok(builders);
        }
        let max_answer = 64 + 4 * self.max_ru_links + self.max_ru_links * (4 + self.frag_wire);
        let filter: Arc<dyn tessera_filter::Filter> =
            Arc::new(tessera_filter::Builtin::new(&t.filter, r.roi.clone()));
        for b in &t.builders {
            if !self.runs_builder(b.id) {
                continue;
            }
            let q = &t.request;
            builders.push(
                BuilderUnit::start_pull(tessera_builder::PullConfig {
                    id: b.id as u16,
                    event_manager: manager_addr.to_string(),
                    readout_units: t
                        .readout_units
                        .iter()
                        .zip(&r.ru_sources)
                        .zip(ru_addrs)
                        .map(|((ru, s), a)| (ru.id, a.clone(), s.clone()))
                        .collect(),
                    recorder: recorder.clone(),
                    credits: q.credits,
                    heartbeat: Duration::from_millis(t.event_manager.heartbeat_ms),
                    event_timeout: Duration::from_millis(q.builder_timeout_ms),
                    filter: filter.clone(),
                    max_message: max_answer,
                    buffer: b.buffer.0,
                    read_chunk: b.read_chunk.0 as usize,
                    takeover: Duration::from_secs(t.event_manager.takeover_s),
                    takeover_memory: t.event_manager.takeover_memory as usize,
                    recorder_takeover: Duration::from_secs(t.recorder.takeover_s),
                })
                .with_context(|| format!("starting builder {}", b.id))?,
            );
        }
        Ok(builders)
    }

    /// With `sources.listen`: a listening socket for each emulated source this process runs,
    /// bound before the readout units start, so that each unit is told where to connect.
    pub fn listening_sources(&self) -> Result<Vec<(u32, Arc<TcpListener>)>> {
        let r = self.r;
        if !r.topology.sources.listen {
            return Ok(Vec::new());
        }
        r.emulated_sources()
            .filter(|&s| self.runs_source(s))
            .map(|s| {
                let l = TcpListener::bind("127.0.0.1:0")
                    .with_context(|| format!("source {s}: binding its listening socket"))?;
                Ok((s, Arc::new(l)))
            })
            .collect()
    }

    /// The emulated sources this process runs, connected to their readout units (or, those
    /// that listen, once their unit connected); held if `held`.
    pub fn sources(
        &self,
        ru_addrs: &[String],
        listening: Vec<(u32, Arc<TcpListener>)>,
        held: bool,
    ) -> Result<Option<tessera_source::RunningSources>> {
        let (r, t) = (self.r, &self.r.topology);
        let emulated: Vec<(u32, String)> = r
            .emulated_sources()
            .filter(|&s| self.runs_source(s) && !t.sources.listen)
            .map(|s| (s, ru_addrs[r.source_ru[&s]].clone()))
            .collect();
        let all: usize = emulated.len() + listening.len();
        if all == 0 {
            return Ok(None);
        }
        // A veto needs one trigger deciding for every source; sources spread over processes
        // each derive their triggers alone, so they can only queue.
        let all_here = all as u64 == u64::from(t.sources.count);
        let veto = match t.sources.busy {
            tessera_config::BusyPolicy::Queue => false,
            // Request mode keeps queued triggers unless a veto is asked for by name: its
            // failover and takeover drills were built on them, and a veto there is untested.
            tessera_config::BusyPolicy::Auto => {
                all_here && t.run.mode == tessera_config::Mode::Push
            }
            tessera_config::BusyPolicy::Veto if all_here => true,
            tessera_config::BusyPolicy::Veto => bail!(
                "sources.busy = \"veto\" needs one trigger for every emulated source, and this process runs {} of {}: set sources.host (one host runs them all), or busy = \"queue\"",
                all,
                t.sources.count
            ),
        };
        let scenario = match (&t.sources.trigger, &t.sources.scenario) {
            (tessera_config::TriggerMode::Scenario, Some(path)) => Some(
                tessera_config::read_scenario(path)
                    .map_err(|e| anyhow!("sources.scenario: {e}"))?
                    .into(),
            ),
            _ => None,
        };
        let mut settings = t.sources.clone();
        let mut events = self.events;
        let (replay, scenario) = match &t.sources.replay {
            None => (None, scenario),
            Some(path) => {
                let rp = tessera_source::Replay::load(path, t.sources.replay_memory.0)
                    .map_err(|e| anyhow!("sources.replay: {e}"))?;
                let recorded = rp.sources();
                let here = emulated
                    .iter()
                    .map(|e| e.0)
                    .chain(listening.iter().map(|l| l.0));
                for s in here {
                    if recorded.binary_search(&s).is_err() {
                        bail!("sources.replay: source {s} is not in the recording (it holds sources {recorded:?}): every event would miss it");
                    }
                }
                if rp.max_payload() > self.max_payload {
                    bail!(
                        "sources.replay: a recorded payload of {} bytes is above run.max_fragment_size ({} bytes)",
                        rp.max_payload(),
                        self.max_payload
                    );
                }
                // The recording's trigger times make the schedule; at speed 0, as fast as
                // allowed. The run ends with the recording.
                let speed = t.sources.replay_speed;
                let times = (speed > 0.0).then(|| rp.times(speed).into());
                settings.trigger = if speed > 0.0 {
                    tessera_config::TriggerMode::Scenario
                } else {
                    tessera_config::TriggerMode::Unlimited
                };
                settings.rate_profile.clear();
                events = match events {
                    0 => rp.events(),
                    n => n.min(rp.events()),
                };
                (Some(Arc::new(rp)), times)
            }
        };
        let size_histogram = match &t.sources.size_histogram {
            Some(path) => Some(
                tessera_config::read_size_histogram(path)
                    .map_err(|e| anyhow!("sources.size_histogram: {e}"))?
                    .into(),
            ),
            None => None,
        };
        Ok(Some(
            tessera_source::start(SourcePlan {
                settings,
                pattern: r.pattern,
                max_payload: self.max_payload,
                sources: emulated,
                injections: t.injections.clone(),
                events,
                start_held: held,
                veto,
                scenario,
                size_histogram,
                listening,
                replay,
                unit_of: r
                    .topology
                    .readout_units
                    .iter()
                    .zip(&r.ru_sources)
                    .flat_map(|(u, s)| s.iter().map(move |&id| (id, u.id)))
                    .collect(),
            })
            .context("connecting the emulated sources")?,
        ))
    }
}

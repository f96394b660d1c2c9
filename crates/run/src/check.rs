//! `tessera check CONFIG`: a dry run. Everything the topology file promises is checked before
//! anything starts: the file itself (keys, IDs, sources, as loading does), the fixed ports (free
//! here, and not given twice), and the buffers against the configured rates and timeouts. It says
//! what it expects of each unit (memory, bytes per second per link) so an operator can compare
//! with the machines.

use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;

use tessera_config::{Mode, Resolved, TriggerMode};

/// One finding, with the key it is about.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Finding {
    pub key: String,
    pub reason: String,
}

/// What a unit is expected to need.
#[derive(Clone, Debug, Serialize)]
pub struct UnitExpectation {
    pub unit: String,
    /// The host it runs on (`[hosts]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    pub links: usize,
    pub bytes_per_s_in: Option<f64>,
    pub bytes_per_s_per_link: Option<f64>,
    /// The most it may hold: its buffers and its bookkeeping together.
    pub memory_bytes: u64,
    /// Of which its bookkeeping (tables of open events, memories of event IDs) at most: held
    /// only as events open and IDs pass, unlike buffers reserved at the start.
    pub bookkeeping_bytes: u64,
    /// How long the unit's buffer holds its input at the expected rate.
    pub buffer_holds_ms: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct CheckReport {
    pub config: String,
    pub mode: String,
    /// Errors: the run would fail or be refused.
    pub problems: Vec<Finding>,
    /// Legal but likely trouble (a buffer that runs full before its timeout ends).
    pub warnings: Vec<Finding>,
    pub events_per_s: Option<f64>,
    pub mean_event_bytes: f64,
    pub units: Vec<UnitExpectation>,
    /// The capacity model's prediction from this host's calibration, where there is one.
    pub capacity: Option<tessera_config::capacity::Prediction>,
    /// Which calibration it used, or why there is none.
    pub calibration: String,
}

impl CheckReport {
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }

    pub fn summary(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "tessera check {}: {} ({} problem(s), {} warning(s))",
            self.config,
            if self.ok() { "OK" } else { "NOT OK" },
            self.problems.len(),
            self.warnings.len()
        );
        let rate = match self.events_per_s {
            Some(r) => format!(
                "{r:.0} events/s of {} ({} built)",
                human(self.mean_event_bytes),
                human_rate(r * self.mean_event_bytes)
            ),
            None => format!(
                "unlimited trigger: as fast as the system goes; events of {} (rate checks need a rate)",
                human(self.mean_event_bytes)
            ),
        };
        let _ = writeln!(s, "  {} mode; {rate}", self.mode);
        for u in &self.units {
            let name = match &u.host {
                Some(h) => format!("{} on {h}", u.unit),
                None => u.unit.clone(),
            };
            let mut line = format!("  {:<18} {:>3} link(s)", name, u.links);
            if let Some(b) = u.bytes_per_s_in {
                let _ = write!(line, ", {} in", human_rate(b));
            }
            if let Some(b) = u.bytes_per_s_per_link {
                let _ = write!(line, " ({} per link)", human_rate(b));
            }
            let _ = write!(
                line,
                ", memory {} (bookkeeping {} of it)",
                human(u.memory_bytes as f64),
                human(u.bookkeeping_bytes as f64)
            );
            if let Some(ms) = u.buffer_holds_ms {
                let _ = write!(line, ", its buffer {ms:.0} ms of its input");
            }
            let _ = writeln!(s, "{line}");
        }
        // Over hosts: what each host's roles may hold, for the machines' memory.
        let mut per_host: BTreeMap<&str, u64> = BTreeMap::new();
        for u in &self.units {
            if let Some(h) = &u.host {
                *per_host.entry(h).or_default() += u.memory_bytes;
            }
        }
        for (h, m) in per_host {
            let _ = writeln!(s, "  host {h}: memory {}", human(m as f64));
        }
        match &self.capacity {
            Some(p) => {
                let _ = writeln!(
                    s,
                    "  capacity ({}): saturates first: {} at {:.0} events/s",
                    self.calibration, p.first, p.max_rate_hz
                );
                if let Some(cpu) = p.cpu_load {
                    let disk = p
                        .disk_load
                        .map(|d| format!(", disk {:.0} %", d * 100.0))
                        .unwrap_or_default();
                    let over = if p.expected_hz < p.offered_hz.unwrap_or(0.0) {
                        "; above capacity: expect dead time (a veto) or a backlog (queued triggers)"
                    } else {
                        ""
                    };
                    let _ = writeln!(
                        s,
                        "  at the configured rate: CPU {:.0} % of the cores{disk}{over}",
                        cpu * 100.0
                    );
                }
            }
            None => {
                let _ = writeln!(s, "  capacity: {}", self.calibration);
            }
        }
        for f in &self.problems {
            let _ = writeln!(s, "  problem: {}: {}", f.key, f.reason);
        }
        for f in &self.warnings {
            let _ = writeln!(s, "  warning: {}: {}", f.key, f.reason);
        }
        s
    }
}

fn human(b: f64) -> String {
    crate::report::human_bytes(b)
}

fn human_rate(b: f64) -> String {
    format!("{}/s", human(b))
}

/// Checks a loaded topology (loading already checked keys, IDs and sources).
/// A unit whose memory [`memory`] counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    Readout(u32),
    Builder(u32),
    /// The recorder with its block being filled and the monitor's station queues.
    Recorder,
    /// Request mode's event manager (its memories of event IDs).
    EventManager,
}

/// The mean size of an emulated fragment on the wire: from the size histogram where one is
/// given, else `fragment_size`.
fn mean_fragment_wire(s: &tessera_config::SourcesSection) -> f64 {
    tessera_format::wire::fragment_wire_size(
        tessera_config::capacity::mean_fragment(s).round() as usize
    ) as f64
}

/// The memory each unit's configuration lets it hold at most: what `tessera check` prints and
/// what a node agent checks against the memory its host has. Its buffers (buffer and read
/// chunks, the recorder's queue and block, the monitor's queues of mean-sized events) plus its
/// [`bookkeeping`].
pub fn memory(r: &Resolved) -> Vec<(Unit, u64)> {
    let t = &r.topology;
    let frag_wire = mean_fragment_wire(&t.sources);
    let mean_event = 48.0 + r.source_ru.len().max(1) as f64 * (4.0 + frag_wire);
    let mut v = Vec::new();
    for (i, u) in t.readout_units.iter().enumerate() {
        let links = r.ru_sources.get(i).map_or(1, |s| s.len().max(1)) as u64;
        v.push((Unit::Readout(u.id), u.buffer.0 + 2 * links * u.read_chunk.0));
    }
    // A builder's budget per readout unit is its share of the buffer, raised to two read chunks
    // per rail (crates/builder).
    let units = t.readout_units.len().max(1) as u64;
    for b in &t.builders {
        let per_unit = (b.buffer.0 / units).max(2 * (1 + b.rails.len() as u64) * b.read_chunk.0);
        v.push((Unit::Builder(b.id), per_unit * units));
    }
    if t.run.mode == Mode::Request {
        v.push((Unit::EventManager, 0));
    }
    if t.recorder.enabled {
        let monitor_bytes: u64 = if t.monitor.enabled {
            t.monitor
                .chain()
                .iter()
                .map(|st| st.queue as u64)
                .sum::<u64>()
                * mean_event as u64
        } else {
            0
        };
        // Compressed blocks are copies: each compressor holds its input and output buffers
        // (three blocks), and up to 2 per compressor wait for the disk, with as many again
        // waiting for their turn (crates/recorder/src/file.rs). Uncompressed blocks are the
        // records themselves, inside the queue.
        let rc = &t.recorder;
        // Each stream, and each series of the main files, has a pipeline and a partial block
        // of its own.
        let streams = rc.writers.max(1) as u64 + rc.streams.len() as u64;
        let pipeline = streams
            * match rc.compression {
                tessera_config::Compression::None => 0,
                _ => 7 * rc.compression_threads as u64 * rc.block_size.0,
            }
            + (streams - 1) * rc.block_size.0;
        v.push((
            Unit::Recorder,
            rc.queue.0 + rc.block_size.0 + pipeline + monitor_bytes,
        ));
    }
    for (unit, m) in &mut v {
        *m = m.saturating_add(bookkeeping(r, *unit));
    }
    v
}

/// The most memory a unit's bookkeeping holds (tables of open events and their part lists,
/// memories of recent event IDs), as each role's crate bounds it: not reserved at the start
/// like buffers, but reached when the tables of open events fill (a link far behind the others)
/// and once as many events have passed as the memories hold.
pub fn bookkeeping(r: &Resolved, unit: Unit) -> u64 {
    let t = &r.topology;
    let request = t.run.mode == Mode::Request;
    match unit {
        Unit::Readout(id) => t
            .readout_units
            .iter()
            .enumerate()
            .find(|(_, u)| u.id == id)
            .map_or(0, |(i, u)| {
                let links = r.ru_sources.get(i).map_or(1, |s| s.len().max(1));
                tessera_readout::bookkeeping_bytes(links, u.max_open_events, request)
            }),
        Unit::Builder(id) if !request => t.builders.iter().find(|b| b.id == id).map_or(0, |b| {
            tessera_builder::bookkeeping_bytes(t.readout_units.len().max(1), b.max_open_events)
        }),
        Unit::Builder(_) => 0,
        Unit::Recorder => tessera_recorder::bookkeeping_bytes(),
        Unit::EventManager => tessera_manager::bookkeeping_bytes(),
    }
}

/// What can still reach the output disk after the run is stopped at its hard watermark: every
/// buffer that drains (readout units, builders, the recorder's queue) and what the kernel holds
/// in the data path's connections (each up to this host's `tcp_rmem` and `tcp_wmem` maxima, as
/// autotuning allows under back-pressure). The room to finish the run (trailers, manifest, run
/// database) is `recorder.disk_reserve`'s, held apart.
pub struct InFlightAtStop {
    pub buffers: u64,
    pub connections: u64,
    pub socket_buffers: u64,
}

impl InFlightAtStop {
    pub fn total(&self) -> u64 {
        self.buffers + self.socket_buffers
    }
}

/// The most a TCP connection's kernel buffers can hold on this host, both ends (the third
/// figure of `tcp_rmem` and of `tcp_wmem`; Linux's defaults, 6 MiB and 4 MiB, where unreadable).
pub fn socket_buffer_max() -> u64 {
    let max_of = |name: &str, default: u64| {
        std::fs::read_to_string(format!("/proc/sys/net/ipv4/{name}"))
            .ok()
            .and_then(|t| t.split_whitespace().nth(2)?.parse().ok())
            .unwrap_or(default)
    };
    max_of("tcp_rmem", 6 << 20) + max_of("tcp_wmem", 4 << 20)
}

pub fn in_flight_at_stop(r: &Resolved) -> InFlightAtStop {
    let t = &r.topology;
    let buffers = t.readout_units.iter().map(|u| u.buffer.0).sum::<u64>()
        + t.builders.iter().map(|b| b.buffer.0).sum::<u64>()
        + t.recorder.queue.0;
    // Every source's link, every readout unit to every builder, every builder to the recorder.
    let connections = r.all_sources().len() as u64
        + (t.readout_units.len() * t.builders.len()) as u64
        + t.builders.len() as u64;
    InFlightAtStop {
        buffers,
        connections,
        socket_buffers: connections * socket_buffer_max(),
    }
}

pub fn check(r: &Resolved) -> CheckReport {
    let t = &r.topology;
    let mut problems = Vec::new();
    let mut warnings = Vec::new();

    // Fixed ports: each given once, and free on this host now. Port 0 takes a free one at start.
    let mut listens: Vec<(String, String)> = Vec::new();
    for (i, u) in t.readout_units.iter().enumerate() {
        listens.push((format!("readout[{i}].listen"), u.listen.clone()));
    }
    for (i, b) in t.builders.iter().enumerate() {
        listens.push((format!("builder[{i}].listen"), b.listen.clone()));
    }
    if t.recorder.enabled {
        listens.push(("recorder.listen".into(), t.recorder.listen.clone()));
        if t.monitor.enabled {
            listens.push(("monitor.listen".into(), t.monitor.listen.clone()));
        }
    }
    if t.run.mode == Mode::Request {
        listens.push((
            "event_manager.listen".into(),
            t.event_manager.listen.clone(),
        ));
    }
    let mut seen: BTreeMap<String, String> = BTreeMap::new();
    for (key, addr) in &listens {
        let fixed = addr.rsplit_once(':').is_some_and(|(_, p)| p != "0");
        if !fixed {
            continue;
        }
        if let Some(first) = seen.insert(addr.clone(), key.clone()) {
            problems.push(Finding {
                key: key.clone(),
                reason: format!("{addr} is also {first}'s address"),
            });
            continue;
        }
        if let Err(e) = std::net::TcpListener::bind(addr.as_str()) {
            problems.push(Finding {
                key: key.clone(),
                reason: format!("cannot listen on {addr} here: {e}"),
            });
        }
    }

    // Rates.
    let s = &t.sources;
    // The highest rate the run will see: the profile's peak where there is one.
    let events_per_s = match s.trigger {
        TriggerMode::Scenario => s
            .scenario
            .as_deref()
            .and_then(|p| tessera_config::read_scenario(p).ok())
            .and_then(|t| {
                let span = (*t.last()? as f64 - *t.first()? as f64) / 1e9;
                (span > 0.0).then(|| t.len() as f64 / span)
            }),
        _ => tessera_config::capacity::offered_rate(s),
    };
    let frag_wire = mean_fragment_wire(s);
    let per_link = events_per_s.map(|r| r * frag_wire);
    let n_sources = r.source_ru.len().max(1);
    let mean_event = 48.0 + n_sources as f64 * (4.0 + frag_wire);
    let mut units = Vec::new();
    let mem = memory(r);
    let memory_of = |unit: Unit| mem.iter().find(|(u, _)| *u == unit).map_or(0, |(_, m)| *m);

    for (i, u) in t.readout_units.iter().enumerate() {
        let links = r.ru_sources[i].len().max(1);
        let bytes_in = per_link.map(|b| b * links as f64);
        let share = u.buffer.0 as f64 / links as f64;
        let holds = per_link.map(|b| share / b * 1e3);
        if let Some(ms) = holds {
            // In push mode a link waits for its slowest peer up to the event timeout; in request
            // mode fragments wait for builders and clears. A share that fills first makes the
            // unit BUSY on a single late link.
            let wait = match t.run.mode {
                Mode::Push => u.event_timeout_ms as f64,
                Mode::Request => t.request.builder_timeout_ms as f64,
            };
            if ms < wait {
                warnings.push(Finding {
                    key: format!("readout[{i}].buffer"),
                    reason: format!(
                        "a link's share ({}) holds {ms:.0} ms of its data at {}, less than the {wait:.0} ms an event may wait: one late link makes the unit BUSY before the timeout; give it at least {}",
                        human(share),
                        human_rate(per_link.unwrap_or(0.0)),
                        human(per_link.unwrap_or(0.0) * wait / 1e3 * links as f64)
                    ),
                });
            }
        }
        units.push(UnitExpectation {
            unit: format!("readout {}", u.id),
            host: u.host.clone(),
            links,
            bytes_per_s_in: bytes_in,
            bytes_per_s_per_link: per_link,
            memory_bytes: memory_of(Unit::Readout(u.id)),
            bookkeeping_bytes: bookkeeping(r, Unit::Readout(u.id)),
            buffer_holds_ms: holds,
        });
    }

    let n_builders = t.builders.len().max(1) as f64;
    for (i, b) in t.builders.iter().enumerate() {
        let links = t.readout_units.len().max(1);
        let bytes_in = events_per_s.map(|r| r * mean_event / n_builders);
        let holds = bytes_in.map(|bps| b.buffer.0 as f64 / bps * 1e3);
        if let Some(ms) = holds {
            let wait = match t.run.mode {
                Mode::Push => b.event_timeout_ms as f64,
                Mode::Request => t.request.builder_timeout_ms as f64,
            };
            if ms < wait {
                warnings.push(Finding {
                    key: format!("builder[{i}].buffer"),
                    reason: format!(
                        "{} holds {ms:.0} ms of its share of events ({}), less than the {wait:.0} ms an event may wait for its last readout unit; give it at least {}",
                        human(b.buffer.0 as f64),
                        human_rate(bytes_in.unwrap_or(0.0)),
                        human(bytes_in.unwrap_or(0.0) * wait / 1e3)
                    ),
                });
            }
        }
        units.push(UnitExpectation {
            unit: format!("builder {}", b.id),
            host: b.host.clone(),
            links,
            bytes_per_s_in: bytes_in,
            bytes_per_s_per_link: bytes_in.map(|x| x / links as f64),
            memory_bytes: memory_of(Unit::Builder(b.id)),
            bookkeeping_bytes: bookkeeping(r, Unit::Builder(b.id)),
            buffer_holds_ms: holds,
        });
    }

    if t.recorder.enabled {
        let bytes_in = events_per_s.map(|r| r * mean_event);
        if let Some(bps) = bytes_in {
            if t.recorder.throttle.0 > 0 && (t.recorder.throttle.0 as f64) < bps {
                warnings.push(Finding {
                    key: "recorder.throttle".into(),
                    reason: format!(
                        "{} is below the expected {}: back-pressure will hold the sources",
                        human_rate(t.recorder.throttle.0 as f64),
                        human_rate(bps)
                    ),
                });
            }
        }
        // The run's expected volume against the free space of its output file system, and the
        // hard watermark against what can be in flight when it is reached.
        let volume = if t.run.events > 0 {
            Some(t.run.events as f64 * mean_event)
        } else if t.run.duration_s > 0.0 {
            bytes_in.map(|b| b * t.run.duration_s)
        } else {
            None
        };
        let dir = if t.run.output.exists() {
            t.run.output.clone()
        } else {
            t.run
                .output
                .ancestors()
                .find(|p| p.exists())
                .map(|p| p.to_path_buf())
                .unwrap_or_else(|| ".".into())
        };
        if let Some(free) = tessera_recorder::free_bytes(&dir) {
            let usable = free.saturating_sub(t.recorder.disk_hard_free.0) as f64;
            if let Some(v) = volume {
                if v > usable {
                    warnings.push(Finding {
                        key: "run.output".into(),
                        reason: format!(
                            "the run is expected to write {} but {} has {} free above recorder.disk_hard_free: it would stop at the watermark",
                            human(v),
                            dir.display(),
                            human(usable)
                        ),
                    });
                }
            }
            if free < t.recorder.disk_soft_free.0 {
                warnings.push(Finding {
                    key: "recorder.disk_soft_free".into(),
                    reason: format!(
                        "{} has only {} free: the disk alarm would be on from the start",
                        dir.display(),
                        human(free as f64)
                    ),
                });
            }
        }
        let f = in_flight_at_stop(r);
        if t.recorder.disk_hard_free.0 < f.total() {
            warnings.push(Finding {
                key: "recorder.disk_hard_free".into(),
                reason: format!(
                    "{} is less than what can still reach the disk after the run stops there ({}: buffers {}, the kernel's buffers of {} connections {} at this host's tcp_rmem/tcp_wmem maxima): the disk could fill during the drain; raise it to {} or more",
                    human(t.recorder.disk_hard_free.0 as f64),
                    human(f.total() as f64),
                    human(f.buffers as f64),
                    f.connections,
                    human(f.socket_buffers as f64),
                    human(f.total() as f64),
                ),
            });
        }
        units.push(UnitExpectation {
            unit: "recorder".into(),
            host: t.recorder.host.clone(),
            links: t.builders.len(),
            bytes_per_s_in: bytes_in,
            bytes_per_s_per_link: bytes_in.map(|x| x / n_builders),
            memory_bytes: memory_of(Unit::Recorder),
            bookkeeping_bytes: bookkeeping(r, Unit::Recorder),
            buffer_holds_ms: bytes_in.map(|bps| t.recorder.queue.0 as f64 / bps * 1e3),
        });
    }

    if t.run.mode == Mode::Request {
        units.push(UnitExpectation {
            unit: "event manager".into(),
            host: t.event_manager.host.clone(),
            links: t.readout_units.len() + t.builders.len(),
            bytes_per_s_in: None,
            bytes_per_s_per_link: None,
            memory_bytes: memory_of(Unit::EventManager),
            bookkeeping_bytes: bookkeeping(r, Unit::EventManager),
            buffer_holds_ms: None,
        });
    }

    let (capacity, calibration) = capacity(r, events_per_s);
    CheckReport {
        capacity,
        calibration,
        config: r.origin.clone(),
        mode: match t.run.mode {
            Mode::Push => "push".into(),
            Mode::Request => "request".into(),
        },
        problems,
        warnings,
        events_per_s,
        mean_event_bytes: mean_event,
        units,
    }
}

/// The capacity model from this host's calibration (`tessera bench calibrate`), where one is.
fn capacity(
    r: &Resolved,
    events_per_s: Option<f64>,
) -> (Option<tessera_config::capacity::Prediction>, String) {
    use tessera_config::capacity;
    let Some(path) = capacity::default_path() else {
        return (
            None,
            "no calibration: no home directory to find it in".into(),
        );
    };
    if !path.exists() {
        return (
            None,
            format!(
                "no calibration of this host at {} (measure one: tessera bench calibrate)",
                path.display()
            ),
        );
    }
    match capacity::load(&path) {
        Ok(c) => {
            let mean = capacity::mean_fragment(&r.topology.sources);
            let p = capacity::predict(r, &c, mean, events_per_s);
            (
                Some(p),
                format!(
                    "calibration of {} with {} cores, {}",
                    c.host,
                    c.cpus,
                    path.display()
                ),
            )
        }
        Err(e) => (None, format!("calibration unreadable: {e}")),
    }
}

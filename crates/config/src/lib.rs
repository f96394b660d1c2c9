//! The topology file: which sources, readout units, builders and recorder a run has, and how each
//! behaves. Every key is declared here once, with its default in the `Default` impl next to it and
//! a doc comment that `docs/configuration.md` repeats. Loading checks the whole topology and names
//! the file, the key and the reason for anything wrong.

pub mod capacity;
pub mod set;
mod size;

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

pub use size::ByteSize;
use tessera_format::pattern::Pattern;

/// A configuration that cannot be used, with where and why.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {key}: {reason}")]
pub struct ConfigError {
    /// The file the configuration came from (`<built-in demo>` for the demo).
    pub file: String,
    /// The key, as a dotted TOML path (`readout[1].sources`), or `-` for the whole file.
    pub key: String,
    pub reason: String,
}

/// The whole topology.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Topology {
    pub run: RunSection,
    pub sources: SourcesSection,
    /// Readout units. Empty: two units share the sources.
    #[serde(rename = "readout")]
    pub readout_units: Vec<ReadoutSection>,
    /// Builder units. Empty: two builders.
    #[serde(rename = "builder")]
    pub builders: Vec<BuilderSection>,
    pub assignment: AssignmentSection,
    pub recorder: RecorderSection,
    /// Request mode: the readout units' request service and the builders' side of it.
    pub request: RequestSection,
    /// Request mode: the event manager.
    pub event_manager: EventManagerSection,
    /// Request mode: the builders' filter.
    pub filter: FilterSection,
    /// Error injection into emulated sources.
    #[serde(rename = "inject")]
    pub injections: Vec<Injection>,
    /// Online event distribution: stations that consumers attach to.
    pub monitor: MonitorSection,
    /// The stages of a stop and their deadlines.
    pub stop: StopSection,
    /// The run control: HTTP API, dashboard, metrics, run database.
    pub control: ControlSection,
    /// `[alarms]`: when the run control raises an alarm while a run takes data.
    pub alarms: AlarmsSection,
    /// `[histograms]`: what the recorder histograms for the dashboard and the run report.
    pub histograms: HistogramsSection,
    /// `[security]`: who may connect to the data and monitor ports.
    pub security: SecuritySection,
    /// `[shipper]`: copies finished files to permanent storage (none without `to`).
    pub shipper: ShipperSection,
    /// `[hosts]`: the machines of a run spread over hosts, each with its node agent (`tessera
    /// node`). Empty: every role runs in one process.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub hosts: BTreeMap<String, HostEntry>,
}

/// One host of `[hosts]`: `fe1 = "10.1.0.2:7300"` (its node agent's address), or a table
/// `fe1 = { agent = "10.1.0.2:7300", data = "10.2.0.2" }` when its data ports are on another
/// network than its agent (a front-end and a back-end network).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum HostEntry {
    Agent(String),
    Full {
        /// Where its node agent listens (`host:port`).
        agent: String,
        /// The address its roles' data ports bind and are reached at (default: the agent's).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data: Option<String>,
        /// Where `tessera launch` reaches it over OpenSSH (`user@host`; default: the agent's
        /// address).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ssh: Option<String>,
    },
}

impl HostEntry {
    /// Where the node agent listens.
    pub fn agent(&self) -> &str {
        match self {
            HostEntry::Agent(a) | HostEntry::Full { agent: a, .. } => a,
        }
    }

    /// The OpenSSH destination of `tessera launch`: `ssh`, else the agent's host part.
    pub fn ssh_destination(&self) -> String {
        match self {
            HostEntry::Full { ssh: Some(s), .. } => s.clone(),
            _ => {
                let a = self.agent();
                a.rsplit_once(':').map_or(a, |(h, _)| h).to_string()
            }
        }
    }

    /// The address (no port) the host's data ports bind: `data`, else the agent's host part.
    pub fn data_address(&self) -> String {
        match self {
            HostEntry::Full { data: Some(d), .. } => d.clone(),
            _ => {
                let a = self.agent();
                a.rsplit_once(':').map_or(a, |(h, _)| h).to_string()
            }
        }
    }
}

/// `[security]`: the data ports (readout units, builders, recorder, event manager) and the
/// monitor port take connections from loopback only, unless their peers' networks are listed
/// here; a listen address other than loopback needs this list (front-end boards cannot hold a
/// token: their network is their credential).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SecuritySection {
    /// Peer networks allowed beyond loopback, e.g. `["10.1.0.0/16", "192.168.5.0/24"]`.
    pub allow: Vec<String>,
    /// With `[hosts]`: the run control speaks TLS to every node agent and trusts the agents'
    /// certificates issued by these certificate authorities (a PEM file), and only those.
    /// Agents then run with `--tls-certificate` and `--tls-key`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agents_ca: Option<PathBuf>,
}

impl SecuritySection {
    /// The allowed networks, parsed.
    pub fn networks(&self) -> Result<Vec<ipnet::IpNet>, (usize, String)> {
        self.allow
            .iter()
            .enumerate()
            .map(|(i, a)| {
                a.parse::<ipnet::IpNet>()
                    .or_else(|_| a.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
                    .map_err(|e| (i, format!("{a:?} is not a network (like 10.1.0.0/16): {e}")))
            })
            .collect()
    }
}

/// Whether `listen` names only this host.
pub fn is_loopback_listen(listen: &str) -> bool {
    let host = listen.rsplit_once(':').map_or(listen, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// `[stop]`: a stop drains in stages, in the direction of the data. Each stage waits at most its
/// deadline, then gives up on what it still holds (reported, never hidden) and the next begins.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StopSection {
    /// Sources send up to their common last trigger and end their streams: how long the stage
    /// may go without any data moving, in milliseconds.
    pub sources_ms: u64,
    /// Readout units send on what they hold and close their builder links: how long the stage
    /// may go without any data moving, in milliseconds.
    pub readout_ms: u64,
    /// Builders finish their events and hand them to the recorder: how long the stage may go
    /// without any data moving, in milliseconds.
    pub builders_ms: u64,
    /// The recorder writes what it has and closes its files: how long the stage may go without
    /// any data moving, in milliseconds.
    pub recorder_ms: u64,
    /// After a stage's deadline, how long its components get to act on the abort, in
    /// milliseconds.
    pub abort_grace_ms: u64,
    /// A hard cap on the whole stop, in milliseconds, for an operator who wants one: past it the
    /// stage under way gives up even while data still moves. 0: none (a stop that drains is
    /// never cut short).
    pub max_ms: u64,
}

impl Default for StopSection {
    fn default() -> Self {
        StopSection {
            sources_ms: 10_000,
            readout_ms: 10_000,
            builders_ms: 10_000,
            recorder_ms: 10_000,
            abort_grace_ms: 3_000,
            max_ms: 0,
        }
    }
}

/// `[histograms]`: the recorder fills, for every event it takes, histograms of event size,
/// fragment size per source, time between consecutive triggers and one payload word per source
/// (a data-quality view), and counts by trigger type. Bounded memory (fixed bins, at most
/// [`MAX_HISTOGRAM_SOURCES`] sources); reset per run, kept in its report.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct HistogramsSection {
    /// Off: nothing is filled (the data path's cost is measured against this).
    pub enabled: bool,
    /// The payload word histogrammed per source: its byte offset in the payload ...
    pub payload_offset: u32,
    /// ... its type: `u8`, `u16`, `u32`, `i16`, `i32` or `f32`, little-endian ...
    pub payload_type: PayloadWord,
    /// ... and the range and number of the histogram's bins (values outside are counted
    /// under and over).
    pub payload_min: f64,
    pub payload_max: f64,
    pub payload_bins: u32,
}

/// Sources histogrammed one by one; past this many, a run's further sources are counted, not
/// kept.
pub const MAX_HISTOGRAM_SOURCES: usize = 4096;

impl Default for HistogramsSection {
    fn default() -> Self {
        HistogramsSection {
            enabled: true,
            payload_offset: 0,
            payload_type: PayloadWord::U16,
            payload_min: 0.0,
            payload_max: 65536.0,
            payload_bins: 64,
        }
    }
}

/// The type of the payload word a data-quality histogram reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PayloadWord {
    U8,
    U16,
    U32,
    I16,
    I32,
    F32,
}

impl PayloadWord {
    pub fn size(self) -> usize {
        match self {
            PayloadWord::U8 => 1,
            PayloadWord::U16 | PayloadWord::I16 => 2,
            PayloadWord::U32 | PayloadWord::I32 | PayloadWord::F32 => 4,
        }
    }

    /// The word at the start of `b` (little-endian), if `b` holds one.
    pub fn read(self, b: &[u8]) -> Option<f64> {
        Some(match self {
            PayloadWord::U8 => f64::from(*b.first()?),
            PayloadWord::U16 => f64::from(u16::from_le_bytes(b.get(..2)?.try_into().ok()?)),
            PayloadWord::I16 => f64::from(i16::from_le_bytes(b.get(..2)?.try_into().ok()?)),
            PayloadWord::U32 => f64::from(u32::from_le_bytes(b.get(..4)?.try_into().ok()?)),
            PayloadWord::I32 => f64::from(i32::from_le_bytes(b.get(..4)?.try_into().ok()?)),
            PayloadWord::F32 => f64::from(f32::from_le_bytes(b.get(..4)?.try_into().ok()?)),
        })
    }
}

/// `[alarms]`: the levels at which the run control raises an alarm (on the dashboard, in the
/// message log, as `tessera_alarm_active` in /metrics). A lost agent or a failed component
/// always raises one. 0 turns a check off.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlarmsSection {
    /// A stage (on any host) blocked by the stage after it for this long, in seconds.
    pub blocked_s: f64,
    /// No event built for this long while running (not paused), in seconds.
    pub no_events_s: f64,
    /// Incomplete events above this fraction of the events built over a sampling interval.
    pub incomplete_fraction: f64,
    /// A readout unit's, builder's or the recorder's buffer fuller than this fraction.
    pub buffer_fraction: f64,
    /// Dead time above this fraction over a sampling interval.
    pub dead_time_fraction: f64,
    /// An alarm clears only once its condition has been gone this long, in seconds, so that a
    /// condition on the edge raises one alarm, not one per interval.
    pub clear_s: f64,
}

impl Default for AlarmsSection {
    fn default() -> Self {
        AlarmsSection {
            blocked_s: 30.0,
            no_events_s: 10.0,
            incomplete_fraction: 0.05,
            buffer_fraction: 0.95,
            dead_time_fraction: 0.05,
            clear_s: 5.0,
        }
    }
}

/// A value read from the configuration that must never leave the process: it serialises and
/// prints as `<redacted>` (or empty when unset), so no topology written to the API, the run
/// database, a manifest or a log can carry it.
#[derive(Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Secret {
        Secret(s.into())
    }

    /// The value itself, for the one place that checks it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn shown(&self) -> &'static str {
        if self.0.is_empty() {
            ""
        } else {
            "<redacted>"
        }
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.shown())
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.shown())
    }
}

/// `[control]`: the run control's HTTP service (API, dashboard, `/metrics`) and run database.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ControlSection {
    /// Address of the HTTP service of `tessera run`; empty: none. Port 0 takes a free port,
    /// written to `control.addr` in the output directory. An address other than loopback needs
    /// `token`.
    pub listen: String,
    /// Bearer token that state-changing calls must present (`Authorization: Bearer ...`);
    /// required when `listen` is not a loopback address. The environment variable
    /// `TESSERA_TOKEN` overrides it, so that it need not be written in the file. Never shown:
    /// the topology as the API, the run database and the manifest give it says `<redacted>`.
    pub token: Secret,
    /// The run database (SQLite), relative to `run.output`.
    pub database: PathBuf,
    /// How often the dashboard's rates are sampled, in milliseconds.
    pub sample_interval_ms: u64,
    /// With `[hosts]`: a node agent (or its run control, seen from the agent) silent for this
    /// long is lost, and the run goes to error naming its host, in milliseconds. Agents answer
    /// within a few ms and say they are still working every second while a request lasts. At a
    /// configure, an agent that refuses connections (not listening yet) is tried again for
    /// this long.
    pub agent_timeout_ms: u64,
    /// With `[hosts]`: the node agents that serve `/metrics` (`tessera node --metrics`), written
    /// at every configure as Prometheus scrape targets in its file-based discovery format
    /// (`file_sd_configs`), relative to `run.output`; the same list is at
    /// `/api/prometheus/targets` for `http_sd_configs`.
    pub prometheus_targets: PathBuf,
    /// Host names the HTTP service answers to besides IP addresses, `localhost` and this host's
    /// own name (a DNS alias of the run control's host, a reverse proxy's name). A request
    /// naming any other host in its `Host` header is refused: a page of another site that has
    /// its name resolve to this address (DNS rebinding) neither reads nor acts. Read when the
    /// service starts.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub host_names: Vec<String>,
    /// The HTTP service's certificate chain (PEM): with `tls_key`, it serves HTTPS only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_certificate: Option<PathBuf>,
    /// The private key (PEM) of `tls_certificate`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
}

impl ControlSection {
    /// The token in force: `TESSERA_TOKEN` if set and not empty, else `token` if not empty.
    pub fn effective_token(&self) -> Option<String> {
        std::env::var("TESSERA_TOKEN")
            .ok()
            .filter(|s| !s.is_empty())
            .or_else(|| Some(self.token.expose().to_string()).filter(|s| !s.is_empty()))
    }
}

impl Default for ControlSection {
    fn default() -> Self {
        ControlSection {
            listen: "127.0.0.1:8080".into(),
            token: Secret::default(),
            database: PathBuf::from("runs.sqlite"),
            sample_interval_ms: 500,
            agent_timeout_ms: 5000,
            prometheus_targets: PathBuf::from("prometheus-targets.json"),
            host_names: Vec::new(),
            tls_certificate: None,
            tls_key: None,
        }
    }
}

/// `[run]`: the run as a whole.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunSection {
    /// Run number. Absent: one more than the highest run found in the output directory.
    pub number: Option<u64>,
    /// Directory for data files, sidecars, quarantine dumps and the run manifest.
    pub output: PathBuf,
    /// Stop after this many triggers (0: no limit).
    pub events: u64,
    /// Stop after this many seconds (0: no limit). With neither limit the run goes until Ctrl-C.
    pub duration_s: f64,
    /// Largest payload a fragment may carry; larger ones are rejected as `oversize`.
    pub max_fragment_size: ByteSize,
    /// How often the live status line is refreshed, in milliseconds.
    pub status_interval_ms: u64,
    /// How events are built: `push` (each readout unit sends every event to the builder the
    /// assignment names) or `request` (readout units hold fragments until builders ask for them;
    /// an event manager hands events to builders with credit and clears what is done).
    pub mode: Mode,
    /// Interrupt moderation of the readout units' links, in microseconds: a link that carries
    /// data is read as soon as 64 KiB are waiting (its receive low-water mark), else at the next
    /// point of a grid of this period shared by every link of the process, so that at low rates
    /// small fragments gather and are read, and acknowledged, once for many, in one round for
    /// all slow links. Costs up to this much latency on links slower than 64 KiB per period;
    /// never holds a link at full rate, nor one whose rate steps up. 0 turns it off.
    pub io_moderation_us: u64,
}

/// `run.mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    Push,
    Request,
}

impl Default for RunSection {
    fn default() -> Self {
        RunSection {
            number: None,
            output: PathBuf::from("./data"),
            events: 0,
            duration_s: 0.0,
            max_fragment_size: ByteSize(1 << 20),
            status_interval_ms: 1000,
            mode: Mode::Push,
            io_moderation_us: 20_000,
        }
    }
}

/// How triggers are spaced in time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TriggerMode {
    /// As fast as back-pressure allows.
    Unlimited,
    /// Every 1/rate seconds.
    Periodic,
    /// Exponential gaps with mean 1/rate, from `seed`: every source sees the same triggers.
    Poisson,
    /// Bursts of `burst_size` triggers spread evenly over `burst_window_us`, the bursts starting
    /// every 1/rate seconds (NectarCAM: 9 events within 180 us).
    Bursts,
    /// Trigger times read from `scenario` (a file of times in seconds from the start of the
    /// run, one per line), replayed once.
    Scenario,
}

/// What the trigger does with a trigger that comes while the system is BUSY.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BusyPolicy {
    /// `veto` in push mode where one process runs every emulated source and triggers are
    /// paced, else `queue`.
    Auto,
    /// As a trigger system does: a trigger while any front-end is BUSY (more than
    /// `derandomizer` accepted events not yet sent) is not taken, and is counted. Accepted
    /// triggers get consecutive event IDs.
    Veto,
    /// Every trigger is taken: a held source falls behind its schedule and sends the backlog
    /// when it can (the behaviour before the trigger model).
    Queue,
}

/// How `rate_profile` joins its points.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProfileShape {
    /// Each rate holds until the next point.
    Steps,
    /// The rate changes linearly between points.
    Linear,
}

/// `[sources]`: the emulated front-ends, and the IDs of external ones.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SourcesSection {
    /// Number of emulated sources.
    pub count: u32,
    /// Source ID of the first emulated source; the others follow consecutively.
    pub first_id: u32,
    /// IDs of external sources: programs that connect to their readout unit and speak the wire
    /// format themselves.
    pub external: Vec<u32>,
    /// With external sources: the emulated ones hold their triggers until every external
    /// source has said its hello, at most this long, in seconds (0: do not wait). After that the
    /// run goes on without the missing ones (their fragments are missing from every event).
    pub external_wait_s: f64,
    /// Mean payload size of a fragment.
    pub fragment_size: ByteSize,
    /// Standard deviation of the payload size (0: every fragment has `fragment_size`); sizes are
    /// drawn from a normal distribution clamped to [0, max_fragment_size].
    pub size_spread: ByteSize,
    pub trigger: TriggerMode,
    /// Trigger rate for `periodic` and `poisson` (bursts per second for `bursts`), in Hz.
    pub rate_hz: f64,
    /// The rate over the run instead of one `rate_hz`: points `[seconds from the start, Hz]`,
    /// the first at 0, joined as `rate_profile_shape` says; the last rate holds after the last
    /// point.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rate_profile: Vec<[f64; 2]>,
    pub rate_profile_shape: ProfileShape,
    /// `bursts`: triggers per burst, and the window they are spread over (microseconds).
    pub burst_size: u32,
    pub burst_window_us: f64,
    /// `scenario`: the file of trigger times (seconds from the start of the run, one per line,
    /// ascending; `#` starts a comment). Relative to the topology file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scenario: Option<std::path::PathBuf>,
    /// Payload sizes drawn from a histogram instead of `fragment_size` and `size_spread`: a
    /// text file of `SIZE WEIGHT` lines (bytes, relative weight; `#` comments). Relative to
    /// the topology file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub size_histogram: Option<std::path::PathBuf>,
    /// How alike one event's sizes are across its sources: 0 independent, 1 the same draw for
    /// every source (an event is big everywhere); the correlation of the normal variates the
    /// sizes come from.
    pub size_correlation: f64,
    /// The emulated sources listen and their readout unit connects to each (server mode, as
    /// SiTCP boards work), instead of connecting to their readout unit.
    pub listen: bool,
    /// A recording (a finished `.tsr` file, or a directory of them) the emulated sources send
    /// again: each its recorded payloads, in event-ID order, at the recorded trigger times
    /// scaled by `replay_speed`. Relative to the topology file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replay: Option<std::path::PathBuf>,
    /// 1: the recorded pace; 2: twice as fast; 0: as fast as allowed.
    pub replay_speed: f64,
    /// Most payload bytes a replay holds in memory.
    pub replay_memory: ByteSize,
    /// What a trigger that comes while the system is BUSY does.
    pub busy: BusyPolicy,
    /// Accepted events the front-ends may hold not yet sent before they raise BUSY (the depth
    /// of their derandomizers), with `busy = "veto"`.
    pub derandomizer: u32,
    /// Seed shared by all sources: trigger times, trigger types and sizes derive from it.
    pub seed: u64,
    /// Payload pattern: `counter` (incompressible) or `adc` (12-bit samples, compressible).
    pub pattern: String,
    /// Number of distinct trigger types (1..=65535), drawn per event from the seed.
    pub trigger_types: u16,
    /// Threads driving the emulated sources (0: one per source up to 4).
    pub threads: u32,
    /// Bytes a source batches into one write when it is behind its trigger schedule.
    pub batch: ByteSize,
    /// With `[hosts]`: the host that runs every emulated source. Absent: each source runs on
    /// the host of its readout unit, as a front-end board sits beside its readout PC.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
}

impl Default for SourcesSection {
    fn default() -> Self {
        SourcesSection {
            count: 8,
            first_id: 0,
            external: Vec::new(),
            external_wait_s: 60.0,
            fragment_size: ByteSize(4096),
            size_spread: ByteSize(0),
            trigger: TriggerMode::Unlimited,
            rate_hz: 1000.0,
            rate_profile: Vec::new(),
            rate_profile_shape: ProfileShape::Steps,
            burst_size: 9,
            burst_window_us: 180.0,
            scenario: None,
            size_histogram: None,
            size_correlation: 0.0,
            listen: false,
            replay: None,
            replay_speed: 1.0,
            replay_memory: ByteSize(1 << 30),
            busy: BusyPolicy::Auto,
            derandomizer: 1024,
            seed: 1,
            pattern: "counter".into(),
            trigger_types: 4,
            threads: 0,
            batch: ByteSize(256 << 10),
            host: None,
        }
    }
}

/// Most triggers a scenario file may hold (8 bytes each in memory).
pub const MAX_SCENARIO_TRIGGERS: usize = 50_000_000;

/// The deepest derandomizer `sources.derandomizer` may ask for, in events.
pub const MAX_DERANDOMIZER: u32 = 1 << 20;

/// Reads a file of trigger times (seconds from the start of the run, one per line, ascending;
/// blank lines and `#` comments skipped) as nanoseconds.
pub fn read_scenario(path: &Path) -> Result<Vec<u64>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    parse_scenario(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// [`read_scenario`] of text. Errors name the line, never its content: a node agent reads the
/// file a run control names, and its error goes back to the run control (a file the agent may
/// read, such as a secret, must not travel back in an error).
pub fn parse_scenario(text: &str) -> Result<Vec<u64>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let t: f64 = line
            .parse()
            .map_err(|_| format!("line {}: not a time in seconds", i + 1))?;
        if !(t.is_finite() && (0.0..=1e9).contains(&t)) {
            return Err(format!(
                "line {}: {t} s is not a time from 0 to 1e9 s",
                i + 1
            ));
        }
        let ns = (t * 1e9).round() as u64;
        if out.last().is_some_and(|&last| ns < last) {
            return Err(format!(
                "line {}: {t} s comes before the time above it",
                i + 1
            ));
        }
        if out.len() == MAX_SCENARIO_TRIGGERS {
            return Err(format!("more than {MAX_SCENARIO_TRIGGERS} triggers"));
        }
        out.push(ns);
    }
    if out.is_empty() {
        return Err("no trigger times in it".into());
    }
    Ok(out)
}

/// Most bins a size histogram may have.
pub const MAX_HISTOGRAM_BINS: usize = 100_000;

/// Payload sizes and their cumulative probabilities, from a histogram file.
#[derive(Clone, Debug, PartialEq)]
pub struct SizeHistogram {
    sizes: Vec<u64>,
    /// Cumulative weight up to and including each size, the last 1.
    cumulative: Vec<f64>,
}

impl SizeHistogram {
    /// The size at cumulative probability `u` (0..1): the first bin whose cumulative weight
    /// reaches it.
    pub fn quantile(&self, u: f64) -> u64 {
        let i = self.cumulative.partition_point(|&c| c < u);
        self.sizes[i.min(self.sizes.len() - 1)]
    }

    pub fn max(&self) -> u64 {
        self.sizes.iter().copied().max().unwrap_or(0)
    }

    pub fn mean(&self) -> f64 {
        let mut prev = 0.0;
        let mut m = 0.0;
        for (s, c) in self.sizes.iter().zip(&self.cumulative) {
            m += *s as f64 * (c - prev);
            prev = *c;
        }
        m
    }
}

/// Reads a size histogram: `SIZE WEIGHT` per line (a size in bytes, its relative weight), blank
/// lines and `#` comments skipped.
pub fn read_size_histogram(path: &Path) -> Result<SizeHistogram, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    parse_size_histogram(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// [`read_size_histogram`] of text. Errors name the line, never its content (as
/// [`parse_scenario`]).
pub fn parse_size_histogram(text: &str) -> Result<SizeHistogram, String> {
    let mut sizes = Vec::new();
    let mut weights = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut f = line.split_whitespace();
        let (Some(size), Some(weight), None) = (f.next(), f.next(), f.next()) else {
            return Err(format!(
                "line {}: not SIZE WEIGHT (bytes and a relative weight)",
                i + 1
            ));
        };
        let size: u64 = size
            .parse()
            .map_err(|_| format!("line {}: the size is not a number of bytes", i + 1))?;
        let weight: f64 = weight
            .parse()
            .ok()
            .filter(|w: &f64| w.is_finite() && *w >= 0.0 && *w <= 1e300)
            .ok_or_else(|| format!("line {}: the weight is not a number of 0 or more", i + 1))?;
        if sizes.len() == MAX_HISTOGRAM_BINS {
            return Err(format!("more than {MAX_HISTOGRAM_BINS} sizes"));
        }
        sizes.push(size);
        weights.push(weight);
    }
    let total: f64 = weights.iter().sum();
    if !(total > 0.0 && total.is_finite()) {
        return Err("no size with a weight above 0 in it".into());
    }
    let mut acc = 0.0;
    let mut cumulative = Vec::with_capacity(weights.len());
    for w in weights {
        acc += w;
        cumulative.push(acc / total);
    }
    if let Some(last) = cumulative.last_mut() {
        *last = 1.0;
    }
    Ok(SizeHistogram { sizes, cumulative })
}

/// Most sources one topology may have (emulated and external together): every table sized by
/// the sources (their IDs, each readout unit's links) is bounded by it before it is built.
/// Thousands are the scale of the largest systems (ATLAS reads ~1 600 links, CMS ~700).
pub const MAX_SOURCES: u32 = 65_536;

/// A list of source IDs: `[0, 1, 2]` or `"0-20,30"`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SourceList {
    #[default]
    Auto,
    Ids(Vec<u32>),
    Ranges(String),
}

impl SourceList {
    pub fn is_auto(&self) -> bool {
        matches!(self, SourceList::Auto)
    }

    fn resolve(&self) -> Result<Option<Vec<u32>>, String> {
        match self {
            SourceList::Auto => Ok(None),
            SourceList::Ids(v) => Ok(Some(v.clone())),
            SourceList::Ranges(s) => {
                let mut v = Vec::new();
                for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                    let parse = |x: &str| {
                        x.trim()
                            .parse::<u32>()
                            .map_err(|_| format!("`{part}` is not an ID or a range like 0-20"))
                    };
                    match part.split_once('-') {
                        Some((a, b)) => {
                            let (a, b) = (parse(a)?, parse(b)?);
                            if a > b {
                                return Err(format!("range `{part}` runs backwards"));
                            }
                            // Counted before it is expanded: a range may not size a table
                            // beyond what a topology can hold.
                            if (b - a) as u64 + 1 + v.len() as u64 > MAX_SOURCES as u64 {
                                return Err(format!(
                                    "`{part}` names more than {MAX_SOURCES} sources"
                                ));
                            }
                            v.extend(a..=b);
                        }
                        None => v.push(parse(part)?),
                    }
                }
                Ok(Some(v))
            }
        }
    }
}

/// `[[readout]]`: one readout unit.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReadoutSection {
    /// Unique readout unit ID.
    pub id: u32,
    /// The host it runs on (a name of `[hosts]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Address its sources connect to (port 0: any free port, for runs in one process).
    pub listen: String,
    /// Sources that listen (SiTCP style): the unit connects to each of these addresses,
    /// retrying until it answers or the run stops; the source's hello then names its link.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub dial: Vec<String>,
    /// Source IDs this unit reads. Absent: the sources are split evenly over the units.
    #[serde(skip_serializing_if = "SourceList::is_auto")]
    pub sources: SourceList,
    /// Memory for buffered fragments, split evenly over its links. A link whose share is full
    /// stops being read (TCP holds its source) and the unit reports BUSY.
    pub buffer: ByteSize,
    /// Size of the blocks a link reads into; raised to hold two maximum-size fragments.
    pub read_chunk: ByteSize,
    /// Take and touch the whole `buffer` when the unit starts, before its sources send, instead
    /// of as data first fills it: the run starts later and the memory is resident from then,
    /// but no read waits for the kernel to find and zero a page.
    pub reserve: bool,
    /// How long an event may wait for a link that could deliver and does not, in ms: a link
    /// that stays silent while it is read, or never connected (one that moved past the event
    /// or closed costs no wait). A link the unit itself stops reading (its buffer full:
    /// back-pressure) never times an event out.
    pub event_timeout_ms: u64,
    /// Most events open (waiting for links) at once. A fragment that would open one more waits,
    /// holding its link (back-pressure); the wait counts as busy time.
    pub max_open_events: usize,
    /// Write rejected fragments to `quarantine/ru<ID>.dump` under the output directory.
    pub quarantine: bool,
    /// Stop dumping (but keep counting) once a dump reaches this size.
    pub quarantine_limit: ByteSize,
}

impl Default for ReadoutSection {
    fn default() -> Self {
        ReadoutSection {
            id: 0,
            host: None,
            listen: "127.0.0.1:0".into(),
            dial: Vec::new(),
            sources: SourceList::Auto,
            buffer: ByteSize(64 << 20),
            read_chunk: ByteSize(256 << 10),
            reserve: false,
            event_timeout_ms: 2000,
            max_open_events: 65536,
            quarantine: true,
            quarantine_limit: ByteSize(16 << 20),
        }
    }
}

/// `[[builder]]`: one builder unit.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BuilderSection {
    /// Unique builder ID (0..65535).
    pub id: u32,
    /// The host it runs on (a name of `[hosts]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Address readout units connect to.
    pub listen: String,
    /// Push mode: further addresses it listens on, one per extra rail (the CMS two-rail layout,
    /// a second network card on another switch). Every readout unit then opens one connection
    /// per address and spreads its super-fragments for this builder over them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rails: Vec<String>,
    /// Memory for super-fragments being assembled, split evenly over its readout-unit links
    /// and each link's share evenly over its rails; every rail needs two read chunks.
    pub buffer: ByteSize,
    /// Size of the blocks a link reads into; raised to hold two maximum-size super-fragments.
    pub read_chunk: ByteSize,
    /// Take and touch the whole `buffer` when the builder starts (see `readout.reserve`).
    pub reserve: bool,
    /// How long an event may wait for a readout unit that has gone silent (no super-fragment
    /// and no progress message, which a live unit sends every 100 ms), in ms. A unit that is
    /// alive but held never times an event out; an event one says it moved past is built
    /// incomplete at once. Must exceed the readout units' own timeout (and so is at least four
    /// times `run.io_moderation_us`, the grid event timeouts are resolved to).
    pub event_timeout_ms: u64,
    /// Most events open (waiting for readout units) at once; a super-fragment that would open
    /// one more waits, holding its link (back-pressure).
    pub max_open_events: usize,
}

impl Default for BuilderSection {
    fn default() -> Self {
        BuilderSection {
            id: 0,
            host: None,
            listen: "127.0.0.1:0".into(),
            rails: Vec::new(),
            buffer: ByteSize(128 << 20),
            read_chunk: ByteSize(1 << 20),
            reserve: false,
            event_timeout_ms: 5000,
            max_open_events: 65536,
        }
    }
}

/// Most addresses one builder listens on (`listen` and its `rails`).
pub const MAX_RAILS: usize = 8;

/// `[assignment]`: which builder gets which event, computed alike by every readout unit.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AssignmentSection {
    /// Blocks of this many consecutive event IDs go round-robin over the builders. Not 1 by
    /// default: a readout unit's sender for one builder then reads each link's fragments in
    /// runs of consecutive events, one after the other in the link's read chunk, where with
    /// single events it read every n-th fragment, and that strided read of memory gone cold
    /// was the costliest copy of the data path (docs/PERFORMANCE.md, session 26).
    pub block: u64,
}

impl Default for AssignmentSection {
    fn default() -> Self {
        AssignmentSection { block: 16 }
    }
}

impl AssignmentSection {
    /// Index (into the builder list) of the builder that builds `event_id`.
    pub fn builder_for(&self, event_id: u64, builders: usize) -> usize {
        ((event_id / self.block.max(1)) % builders as u64) as usize
    }
}

/// `[request]`: request mode, readout unit and builder sides.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RequestSection {
    /// Page size of the readout units' paged buffers; a fragment takes as many pages as it needs
    /// from its link's pool (the link's share of `readout.buffer`).
    pub page_size: ByteSize,
    /// Request descriptors per readout unit, shared evenly by the builders: the bound on requests
    /// in flight. A builder whose share is in use has its next requests left unread.
    pub descriptors: u32,
    /// How long a request waits for fragments that have not arrived before it is answered with
    /// what there is and the list of missing sources, in ms.
    pub timeout_ms: u64,
    /// Events a builder takes at once from the event manager (its credits).
    pub credits: u32,
    /// How long a readout unit may answer a builder nothing while an event of that builder
    /// waits for it, before the event is built incomplete without that unit, in ms; must exceed
    /// `timeout_ms`.
    pub builder_timeout_ms: u64,
}

impl Default for RequestSection {
    fn default() -> Self {
        RequestSection {
            page_size: ByteSize(4096),
            descriptors: 1024,
            timeout_ms: 1000,
            credits: 64,
            builder_timeout_ms: 5000,
        }
    }
}

/// `[event_manager]`: hands events to builders, clears them from the readout units.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EventManagerSection {
    /// The host it runs on (a name of `[hosts]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Address readout units and builders connect to.
    pub listen: String,
    /// Event IDs per clear message sent to the readout units. A group goes before it is full
    /// after `clear_delay_ms`, or at once when no other event is in flight.
    pub clear_group: u32,
    /// Longest a finished event waits for its clear group to fill while other events are in
    /// flight, in ms.
    pub clear_delay_ms: u64,
    /// How often builders send heartbeats, in ms.
    pub heartbeat_ms: u64,
    /// A builder not heard from for this long is declared dead and its unfinished events go to
    /// other builders, in ms.
    pub heartbeat_timeout_ms: u64,
    /// Events known but not given to any builder above which, with no builder holding credit,
    /// the readout units are told BUSY and stop reading their links (the sources are held).
    pub busy_threshold: u32,
    /// How long readout units and builders that lost their event manager wait for it to come
    /// back (restarted at the same address) and take the run over, in seconds; 0: they end at
    /// once, naming the lost manager.
    pub takeover_s: u64,
    /// Events each builder remembers as finished, to tell a manager taking the run over (an
    /// event finished earlier and not yet cleared is built again, and the recorder drops the
    /// second copy, counted).
    pub takeover_memory: u32,
}

impl Default for EventManagerSection {
    fn default() -> Self {
        EventManagerSection {
            host: None,
            listen: "127.0.0.1:0".into(),
            clear_group: 100,
            clear_delay_ms: 50,
            heartbeat_ms: 100,
            heartbeat_timeout_ms: 2000,
            busy_threshold: 4096,
            takeover_s: 30,
            takeover_memory: 65_536,
        }
    }
}

/// `filter.decision`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// Keep every event.
    AcceptAll,
    /// Keep one event in `prescale`.
    Prescale,
    /// Keep a `fraction` of events, chosen by a hash of the event ID and `seed` (the same choice
    /// on every builder, so a rebuilt event is decided alike).
    Random,
    /// Keep events whose payload word `cut_word` (32-bit, little-endian) of source `cut_source`
    /// lies in [`cut_min`, `cut_max`].
    Cut,
}

/// `[filter]`: the builders' decision on each event (request mode).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FilterSection {
    pub decision: Decision,
    pub prescale: u64,
    pub fraction: f64,
    pub seed: u64,
    pub cut_source: u32,
    pub cut_word: u32,
    pub cut_min: u32,
    pub cut_max: u32,
    /// Sources fetched first (the region of interest); the rest only for accepted events.
    /// Absent: the whole event is fetched before the decision.
    #[serde(skip_serializing_if = "SourceList::is_auto")]
    pub roi: SourceList,
}

impl Default for FilterSection {
    fn default() -> Self {
        FilterSection {
            decision: Decision::AcceptAll,
            prescale: 1,
            fraction: 1.0,
            seed: 1,
            cut_source: 0,
            cut_word: 0,
            cut_min: 0,
            cut_max: u32::MAX,
            roi: SourceList::Auto,
        }
    }
}

/// Compression codec names accepted in `[recorder] compression`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Compression {
    None,
    Lz4,
    Zstd,
}

/// `recorder.durability`: when an event counts as safely recorded (acknowledged to its builder,
/// and in request mode then cleared from the readout units).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Durability {
    /// Once its block is written to the file (in the kernel's page cache): survives the
    /// recorder's process dying, not the machine losing power.
    Written,
    /// Once its block is written and synced to the disk (fdatasync), several blocks per sync
    /// (group commit, at most `recorder.sync_interval_ms` apart): survives a power loss.
    Sync,
}

/// `[recorder]`: writes built events to files.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RecorderSection {
    /// The host it runs on (a name of `[hosts]`); the monitor runs with it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Address builders connect to.
    pub listen: String,
    /// Turn recording off: builders count built events and drop them, and no recorder runs (for
    /// measurements of building alone).
    pub enabled: bool,
    /// Start a new file once the current one reaches this size.
    pub max_file_size: ByteSize,
    /// Start a new file once the current one is this old, in seconds, whichever comes first
    /// (0: by size only). A file idle that long is finished too, so a quiet run's data reaches
    /// permanent storage.
    pub max_file_age_s: f64,
    /// Raw bytes of event records per block (the unit of compression).
    pub block_size: ByteSize,
    pub compression: Compression,
    /// zstd level (1..=22).
    pub zstd_level: i32,
    /// Byte-shuffle blocks (2-byte elements) before compressing.
    pub shuffle: bool,
    /// Named streams by trigger type (`calibration = [2, 3]`, as ATLAS and CMS write physics,
    /// calibration and express streams): each has its own files, named
    /// `run000012_calibration_0001.tsr`. Events of other trigger types go to the main files.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub streams: BTreeMap<String, Vec<u16>>,
    /// Threads that checksum, shuffle and compress blocks in parallel (blocks still reach the
    /// file in order; one disk thread only writes).
    pub compression_threads: u32,
    /// File series the main files are written as in parallel, each with a pipeline of its own
    /// (compression threads, disk thread, closer): the events of builder `b` go to series
    /// `b mod writers`, named `run000012_w2_0001.tsr` (series 0 keeps the plain names). For a
    /// disk array faster than one writer.
    pub writers: u32,
    /// Limit the write rate, in bytes per second (0: no limit): rehearses a slow disk.
    pub throttle: ByteSize,
    /// fsync each file before it takes its final name.
    pub fsync: bool,
    /// When an event is acknowledged: written to the file, or written and synced.
    pub durability: Durability,
    /// With `durability = "sync"`: the longest an event waits for its sync, in milliseconds
    /// (the partial block is written then, and everything written is synced at once).
    pub sync_interval_ms: u32,
    /// Bound on event bytes queued between the recorder's links and its writer.
    pub queue: ByteSize,
    /// Free space on the output file system below which the recorder raises the disk alarm and
    /// slows its writes (the run sees it as busy, attributed to the disk), in bytes.
    pub disk_soft_free: ByteSize,
    /// Free space below which the run is stopped cleanly (drained, files finished, manifest and
    /// run database written) while there is still room for that. Must hold what is in flight:
    /// the buffers of every readout unit, builder and the recorder's queue, and the kernel's
    /// socket buffers (several MiB per connection).
    pub disk_hard_free: ByteSize,
    /// Room the recorder allocates on the output file system at the start of a run and gives
    /// back when the disk is exhausted anyway (another writer filled it) and when it ends: what
    /// finishing the run needs on a full disk (the open files' trailers and sidecars, the
    /// manifest, the run database's writes). 0: none.
    pub disk_reserve: ByteSize,
    /// Request mode: how long builders whose recorder link broke keep what the recorder has not
    /// acknowledged and try the recorder's address again (a recorder restarted there adopts the
    /// run's files and takes the resent records), and how long the recorder waits for a builder
    /// whose link broke to come back. 0: they end at once, counting what was unacknowledged.
    pub takeover_s: u64,
}

impl Default for RecorderSection {
    fn default() -> Self {
        RecorderSection {
            host: None,
            listen: "127.0.0.1:0".into(),
            enabled: true,
            max_file_size: ByteSize(1 << 30),
            max_file_age_s: 0.0,
            block_size: ByteSize(1 << 20),
            compression: Compression::None,
            zstd_level: 1,
            shuffle: true,
            compression_threads: 2,
            writers: 1,
            streams: BTreeMap::new(),
            throttle: ByteSize(0),
            fsync: true,
            durability: Durability::Written,
            sync_interval_ms: 100,
            queue: ByteSize(64 << 20),
            disk_soft_free: ByteSize(2 << 30),
            disk_hard_free: ByteSize(1 << 30),
            disk_reserve: ByteSize(16 << 20),
            takeover_s: 30,
        }
    }
}

/// How long a shipped file stays in the data directory by default, in seconds: a day (COMET's
/// buffer of days on the DAQ's disks), the safe side of one default for `[shipper]` and
/// `tessera ship run` alike; the free-space watermark deletes verified files sooner when the
/// disk needs the room.
pub const DEFAULT_KEEP_S: f64 = 86_400.0;

/// `[shipper]`: the second half of role 6. It runs beside the recorder, in the process that
/// holds its data directory (the run control, or the node agent of the recorder's host), from
/// configure until that process ends, so files drain between runs too. docs/shipping.md.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ShipperSection {
    /// Destinations: a directory (a mounted remote file system), `s3://bucket/prefix`
    /// (S3-compatible storage; endpoint and keys from the AWS_* environment variables), or
    /// `ssh://[user@]host[:port]/path` (OpenSSH; `TESSERA_SSH` for its options). Empty: no
    /// shipper.
    pub to: Vec<String>,
    /// Keep a shipped file this many seconds after it was finished (0: delete once every
    /// destination holds a verified copy). Default [`DEFAULT_KEEP_S`], as `tessera ship run`.
    pub keep_s: f64,
    /// Below this much free space on the data directory's file system, verified files are
    /// deleted first, oldest first, whatever `keep_s` says. Default: twice
    /// `recorder.disk_soft_free`, so space comes back before the recorder slows down.
    pub free_watermark: Option<ByteSize>,
    /// Bytes per second all copies may read together (0: no limit), so shipping does not take
    /// the disk from the recorder.
    pub bandwidth: ByteSize,
    /// Seconds between passes (a pass also follows the end of every run).
    pub interval_s: f64,
    /// `tessera run` (one run, then exit) waits this long after its run for the shipper to
    /// drain before it exits; what is left ships at the next start.
    pub drain_at_exit_s: f64,
}

impl Default for ShipperSection {
    fn default() -> Self {
        ShipperSection {
            to: Vec::new(),
            keep_s: DEFAULT_KEEP_S,
            free_watermark: None,
            bandwidth: ByteSize(0),
            interval_s: 5.0,
            drain_at_exit_s: 60.0,
        }
    }
}

impl ShipperSection {
    /// The free-space watermark in bytes, the default resolved.
    pub fn watermark(&self, recorder: &RecorderSection) -> u64 {
        self.free_watermark
            .map_or(recorder.disk_soft_free.0.saturating_mul(2), |b| b.0)
    }
}

/// `[monitor]`: online event distribution (the CODA ET model). Every recorded event enters the
/// monitor's chain of stations; consumers attach to a station locally or over TCP.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MonitorSection {
    /// Run the monitor (in the recorder's process). Off: no station, no port.
    pub enabled: bool,
    /// Address consumers connect to. The default port 0 takes a free one, printed at start and
    /// written to `monitor.addr` in the output directory; the demo uses 127.0.0.1:7711.
    pub listen: String,
    /// How often the monitor beats to a waiting consumer and a consumer to the monitor, in
    /// milliseconds.
    pub heartbeat_ms: u32,
    /// A consumer silent this long (no message, no heartbeat) is declared dead and its events
    /// are handled by its station's `restore` policy, in milliseconds.
    pub consumer_timeout_ms: u32,
    /// Serve consumers of sampling stations from threads at idle scheduling priority (Linux
    /// SCHED_IDLE): they get only CPU time the data path leaves, so watching a run cannot slow
    /// it on a machine short of cores. Blocking stations' consumers are served at normal
    /// priority (they hold the data path by design).
    pub sampling_idle_priority: bool,
    /// Stream tags by trigger type: `physics = [1]`, `calibration = [2, 3]`. A station can
    /// select a stream (the event record has no stream field in format v1, so the tag follows
    /// from the trigger type).
    pub streams: BTreeMap<String, Vec<u16>>,
    /// The chain of stations, in order. Absent: one sampling station `sample` taking every event.
    #[serde(rename = "station")]
    pub stations: Vec<StationSection>,
    /// Most stations at once, configured and created by consumers together: a consumer cannot
    /// make the monitor grow without bound.
    pub max_stations: usize,
}

impl Default for MonitorSection {
    fn default() -> Self {
        MonitorSection {
            enabled: true,
            listen: "127.0.0.1:0".into(),
            heartbeat_ms: 1000,
            consumer_timeout_ms: 5000,
            sampling_idle_priority: true,
            streams: BTreeMap::new(),
            stations: Vec::new(),
            max_stations: 32,
        }
    }
}

impl MonitorSection {
    /// The stations of the chain: those configured, or the default `sample` station.
    pub fn chain(&self) -> Vec<StationSection> {
        if self.stations.is_empty() {
            vec![StationSection {
                name: "sample".into(),
                ..Default::default()
            }]
        } else {
            self.stations.clone()
        }
    }
}

/// `monitor.station[].mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StationMode {
    /// Every selected event must be taken and put back before it moves on; a full queue holds
    /// the data path (as a recorder needs).
    Blocking,
    /// Consumers get a sample: a selected event is copied into the queue if there is room and
    /// goes on at once; a full queue drops it for this station only.
    Sampling,
}

/// `monitor.station[].restore`: what happens to the events a dead consumer held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Restore {
    /// Back into the station's queue for another consumer (to the next station if none is
    /// left). Blocking stations only.
    Station,
    /// On to the next station. Blocking stations only.
    Next,
    /// Released. Sampling stations only (a sampled event is a copy; nothing waits for it).
    Release,
}

/// `monitor.station[].distribution`: how a parallel group shares events.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Distribution {
    /// In turn among the members that select the event.
    RoundRobin,
    /// To the member with the shortest queue.
    EqualQueue,
}

/// `[[monitor.station]]`: one station of the chain.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StationSection {
    /// Unique name consumers attach by.
    pub name: String,
    pub mode: StationMode,
    /// Select only these trigger types (empty: every trigger type).
    pub trigger_types: Vec<u16>,
    /// Select only events of this stream (a name from `monitor.streams`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream: Option<String>,
    /// Select only events whose header satisfies this predicate, e.g. `event_id % 100 == 0`
    /// (language in `docs/monitor-protocol.md`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicate: Option<String>,
    /// Take every Nth selected event (1: every one).
    pub prescale: u64,
    /// Most events the station holds at once (queued and held by consumers).
    pub queue: usize,
    /// Most bytes of events waiting in the station's queue (one event is always taken into an
    /// empty queue, however large): memory bounded in bytes, not only in events.
    pub queue_bytes: ByteSize,
    /// What happens to a dead consumer's events. Absent: `station` for blocking stations,
    /// `release` for sampling ones.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub restore: Option<Restore>,
    /// Stations with the same group name, next to each other in the chain, are parallel: each
    /// event goes to one of them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// How a parallel group shares events (only on grouped stations; default `round_robin`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub distribution: Option<Distribution>,
    /// Blocking stations: the longest the data path waits for room in this station, in ms;
    /// past it the station's consumers are dropped (their events passed on) and the run goes
    /// on, counted (`hold_limit_drops`). 0: no limit (a consumer may hold data taking for good).
    pub hold_limit_ms: u64,
}

impl Default for StationSection {
    fn default() -> Self {
        StationSection {
            name: String::new(),
            mode: StationMode::Sampling,
            trigger_types: Vec::new(),
            stream: None,
            predicate: None,
            prescale: 1,
            queue: 100,
            queue_bytes: ByteSize(64 << 20),
            restore: None,
            group: None,
            distribution: None,
            hold_limit_ms: DEFAULT_HOLD_LIMIT_MS,
        }
    }
}

/// How long a blocking station may hold the data path by default (`hold_limit_ms`): long enough
/// for a consumer that reads every event to catch up, short enough that a hung one costs seconds
/// of data taking, not the run.
pub const DEFAULT_HOLD_LIMIT_MS: u64 = 30_000;

impl StationSection {
    /// The restore policy in force.
    pub fn restore_policy(&self) -> Restore {
        self.restore.unwrap_or(match self.mode {
            StationMode::Blocking => Restore::Station,
            StationMode::Sampling => Restore::Release,
        })
    }

    /// Checks one station on its own; `streams` are the declared stream tags. Returns the key
    /// (relative to the station) and the reason of the first problem.
    pub fn check(
        &self,
        streams: &BTreeMap<String, Vec<u16>>,
    ) -> Result<(), (&'static str, String)> {
        if self.name.is_empty() || self.name.len() > 64 || self.name.chars().any(|c| c.is_control())
        {
            return Err(("name", "give a name of 1 to 64 printable characters".into()));
        }
        if self.prescale == 0 {
            return Err(("prescale", "must be at least 1".into()));
        }
        if self.queue == 0 || self.queue > 1_000_000 {
            return Err(("queue", "must be between 1 and 1000000 events".into()));
        }
        match (self.mode, self.restore) {
            (StationMode::Blocking, Some(Restore::Release)) => {
                return Err((
                    "restore",
                    "a blocking station never loses events: use `station` or `next`".into(),
                ))
            }
            (StationMode::Sampling, Some(r @ (Restore::Station | Restore::Next))) => {
                return Err((
                    "restore",
                    format!(
                        "`{}` cannot apply to a sampling station: its consumers hold copies and the events have already moved on; use `release`",
                        if r == Restore::Station { "station" } else { "next" }
                    ),
                ))
            }
            _ => {}
        }
        if let Some(s) = &self.stream {
            if !streams.contains_key(s) {
                return Err((
                    "stream",
                    format!("stream {s:?} is not declared in [monitor.streams]"),
                ));
            }
        }
        if let Some(p) = &self.predicate {
            tessera_format::select::Predicate::parse(p)
                .map_err(|e| ("predicate", e.to_string()))?;
        }
        if self.distribution.is_some() && self.group.is_none() {
            return Err((
                "distribution",
                "applies only to a parallel group: set `group` too".into(),
            ));
        }
        Ok(())
    }
}

/// Checks a whole chain: each station, unique names, parallel groups adjacent and of one mode.
pub fn check_chain(
    stations: &[StationSection],
    streams: &BTreeMap<String, Vec<u16>>,
) -> Result<(), (String, String)> {
    let mut names = BTreeSet::new();
    for (i, st) in stations.iter().enumerate() {
        st.check(streams)
            .map_err(|(k, why)| (format!("monitor.station[{i}].{k}"), why))?;
        if !names.insert(st.name.as_str()) {
            return Err((
                format!("monitor.station[{i}].name"),
                format!("{:?} is used twice", st.name),
            ));
        }
        if let Some(g) = &st.group {
            let prev = i.checked_sub(1).map(|j| &stations[j]);
            let joins = prev.is_some_and(|p| p.group.as_ref() == Some(g));
            if !joins && stations[..i].iter().any(|p| p.group.as_ref() == Some(g)) {
                return Err((
                    format!("monitor.station[{i}].group"),
                    format!("the stations of group {g:?} must be next to each other"),
                ));
            }
            if let Some(p) = prev.filter(|_| joins) {
                if p.mode != st.mode {
                    return Err((
                        format!("monitor.station[{i}].mode"),
                        format!("the stations of group {g:?} must all have one mode"),
                    ));
                }
                if st.distribution.is_some() && st.distribution != p.distribution {
                    return Err((
                        format!("monitor.station[{i}].distribution"),
                        format!(
                            "the group's distribution is set on its first station ({:?})",
                            p.name
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// An error an emulated source injects on purpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InjectKind {
    /// Flip a payload byte after the CRC was computed.
    BadCrc,
    /// Corrupt the start marker.
    BadMarker,
    /// Send only the first half of the fragment.
    Truncate,
    /// Send the fragment twice.
    Duplicate,
    /// Send nothing for this event.
    Skip,
    /// Send this event after the next one.
    Swap,
    /// Close the connection abruptly before this event.
    Disconnect,
    /// Set the front-end error status flag.
    StatusError,
}

/// `[[inject]]`: one kind of error on one source, at chosen events.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Injection {
    pub source: u32,
    pub kind: InjectKind,
    /// Event IDs at which to inject.
    #[serde(default)]
    pub at: Vec<u64>,
    /// Also inject at every event ID that is a multiple of this (0: off).
    #[serde(default)]
    pub every: u64,
}

impl Injection {
    pub fn applies(&self, event_id: u64) -> bool {
        (self.every > 0 && event_id.is_multiple_of(self.every) && event_id > 0)
            || self.at.contains(&event_id)
    }
}

/// A checked topology with everything derived that the roles need.
#[derive(Clone, Debug)]
pub struct Resolved {
    pub topology: Topology,
    /// Where the configuration came from, for messages.
    pub origin: String,
    /// The configuration as text, as used (the digest is taken over it).
    pub text: String,
    /// SHA-256 of `text`.
    pub digest: [u8; 32],
    pub pattern: Pattern,
    /// Source IDs read by each readout unit, in `topology.readout_units` order.
    pub ru_sources: Vec<Vec<u32>>,
    /// The readout unit index of every source.
    pub source_ru: BTreeMap<u32, usize>,
    /// `filter.roi`, resolved (empty: one-step filter).
    pub roi: Vec<u32>,
}

impl Resolved {
    pub fn emulated_sources(&self) -> impl Iterator<Item = u32> + '_ {
        let s = &self.topology.sources;
        s.first_id..s.first_id + s.count
    }

    pub fn all_sources(&self) -> Vec<u32> {
        self.source_ru.keys().copied().collect()
    }
}

impl Topology {
    /// Reads and checks a topology file.
    pub fn load(path: &Path) -> Result<Resolved, ConfigError> {
        Self::load_with(path, &[])
    }

    /// [`Topology::load`] with each `KEY=VALUE` of `sets` set first (`tessera run --set`).
    pub fn load_with(path: &Path, sets: &[String]) -> Result<Resolved, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: file.clone(),
            key: "-".into(),
            reason: format!("cannot read: {e}"),
        })?;
        let text = set::apply(&text, sets).map_err(|reason| ConfigError {
            file: file.clone(),
            key: "--set".into(),
            reason,
        })?;
        let mut r = Self::parse(&text, &file)?;
        // A scenario file is found beside the topology file that names it, and read now, so
        // that a bad one is refused at configure, with its line.
        if let Some(sc) = r.topology.sources.scenario.as_mut() {
            if sc.is_relative() {
                if let Some(dir) = path.parent() {
                    *sc = dir.join(&*sc);
                }
            }
            if r.topology.sources.trigger == TriggerMode::Scenario {
                read_scenario(sc).map_err(|reason| ConfigError {
                    file: file.clone(),
                    key: "sources.scenario".into(),
                    reason,
                })?;
            }
        }
        // A recording to replay is found beside the topology file too.
        if let Some(rp) = r.topology.sources.replay.as_mut() {
            if rp.is_relative() {
                if let Some(dir) = path.parent() {
                    *rp = dir.join(&*rp);
                }
            }
            if let Err(e) = std::fs::metadata(&*rp) {
                return Err(ConfigError {
                    file: file.clone(),
                    key: "sources.replay".into(),
                    reason: format!("{}: {e}", rp.display()),
                });
            }
        }
        // So is a size histogram, and no size in it may exceed what a fragment may carry.
        let max = r.topology.run.max_fragment_size.0;
        if let Some(h) = r.topology.sources.size_histogram.as_mut() {
            if h.is_relative() {
                if let Some(dir) = path.parent() {
                    *h = dir.join(&*h);
                }
            }
            let err = |reason| ConfigError {
                file: file.clone(),
                key: "sources.size_histogram".into(),
                reason,
            };
            let hist = read_size_histogram(h).map_err(err)?;
            if hist.max() > max {
                return Err(err(format!(
                    "{}: a size of {} bytes is above run.max_fragment_size ({max} bytes)",
                    h.display(),
                    hist.max()
                )));
            }
        }
        Ok(r)
    }

    /// Parses and checks topology text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Resolved, ConfigError> {
        let de = toml::Deserializer::new(text);
        let topo: Topology = serde_path_to_error::deserialize(de).map_err(|e| {
            let key = e.path().to_string();
            let inner = e.into_inner();
            let reason = inner.message().to_string();
            let at = inner
                .span()
                .map(|s| {
                    let line = text[..s.start.min(text.len())].matches('\n').count() + 1;
                    format!(" (line {line})")
                })
                .unwrap_or_default();
            ConfigError {
                file: origin.into(),
                key: if key == "." { "-".into() } else { key },
                reason: format!("{reason}{at}"),
            }
        })?;
        topo.resolve(origin, text.to_string())
    }

    /// The built-in demo with each `KEY=VALUE` of `sets` set.
    pub fn demo_with(sets: &[String]) -> Result<Resolved, ConfigError> {
        let demo = Self::demo();
        if sets.is_empty() {
            return Ok(demo);
        }
        let text = set::apply(&demo.text, sets).map_err(|reason| ConfigError {
            file: demo.origin.clone(),
            key: "--set".into(),
            reason,
        })?;
        Self::parse(&text, &demo.origin)
    }

    /// The built-in demo: 8 sources, 2 readout units, 2 builders, 1 recorder, output under ./data.
    pub fn demo() -> Resolved {
        let mut t = Topology::default();
        t.sources.fragment_size = ByteSize(4096);
        t.sources.size_spread = ByteSize(1024);
        t.sources.trigger = TriggerMode::Periodic;
        t.sources.rate_hz = 5000.0;
        t.run.events = 50_000;
        t.monitor.listen = "127.0.0.1:7711".into();
        let text = toml::to_string(&t).expect("demo serialises");
        t.resolve("<built-in demo>", text)
            .expect("the demo topology is valid")
    }

    /// Checks everything and derives the source placement. Takes defaults for absent sections.
    pub fn resolve(mut self, origin: &str, text: String) -> Result<Resolved, ConfigError> {
        let err = |key: &str, reason: String| ConfigError {
            file: origin.into(),
            key: key.into(),
            reason,
        };
        if self.readout_units.is_empty() {
            self.readout_units = (0..2)
                .map(|id| ReadoutSection {
                    id,
                    ..Default::default()
                })
                .collect();
        }
        if self.builders.is_empty() {
            self.builders = (0..2)
                .map(|id| BuilderSection {
                    id,
                    ..Default::default()
                })
                .collect();
        }
        let s = &self.sources;
        let pattern = Pattern::from_name(&s.pattern).ok_or_else(|| {
            err(
                "sources.pattern",
                format!("`{}` is not a pattern (counter, adc)", s.pattern),
            )
        })?;
        if !(s.external_wait_s >= 0.0 && s.external_wait_s.is_finite()) {
            return Err(err(
                "sources.external_wait_s",
                format!("{} is not a number of seconds >= 0", s.external_wait_s),
            ));
        }
        if s.count == 0 && s.external.is_empty() {
            return Err(err(
                "sources.count",
                "no sources: set count > 0 or list external sources".into(),
            ));
        }
        if s.count as u64 + s.external.len() as u64 > MAX_SOURCES as u64 {
            return Err(err(
                "sources.count",
                format!(
                    "{} emulated and {} external sources: at most {MAX_SOURCES} in all",
                    s.count,
                    s.external.len()
                ),
            ));
        }
        if s.first_id.checked_add(s.count).is_none() {
            return Err(err(
                "sources.first_id",
                "first_id + count overflows a 32-bit source ID".into(),
            ));
        }
        let rated = matches!(
            s.trigger,
            TriggerMode::Periodic | TriggerMode::Poisson | TriggerMode::Bursts
        );
        if !s.rate_profile.is_empty() {
            if !rated {
                return Err(err(
                    "sources.rate_profile",
                    format!(
                        "applies to periodic, poisson and bursts triggers, not {:?}",
                        s.trigger
                    ),
                ));
            }
            if s.rate_profile[0][0] != 0.0 {
                return Err(err(
                    "sources.rate_profile",
                    "the first point must be at 0 s".into(),
                ));
            }
            for (i, [t, hz]) in s.rate_profile.iter().enumerate() {
                if !(t.is_finite() && *t >= 0.0 && hz.is_finite() && *hz >= 0.0) {
                    return Err(err(
                        "sources.rate_profile",
                        format!("point {i} ([{t}, {hz}]) needs a time and a rate, both finite and not negative"),
                    ));
                }
                if i > 0 && *t <= s.rate_profile[i - 1][0] {
                    return Err(err(
                        "sources.rate_profile",
                        format!(
                            "point {i}: times must increase ({t} after {})",
                            s.rate_profile[i - 1][0]
                        ),
                    ));
                }
            }
            if s.rate_profile.iter().all(|p| p[1] == 0.0) {
                return Err(err(
                    "sources.rate_profile",
                    "every rate is 0: no trigger would come".into(),
                ));
            }
        }
        if s.trigger == TriggerMode::Bursts {
            if s.burst_size == 0 || s.burst_size > 1_000_000 {
                return Err(err(
                    "sources.burst_size",
                    format!("must be 1 to 1000000 triggers, got {}", s.burst_size),
                ));
            }
            if !(s.burst_window_us.is_finite() && s.burst_window_us >= 0.0) {
                return Err(err(
                    "sources.burst_window_us",
                    format!("must be a time not below 0, got {}", s.burst_window_us),
                ));
            }
        }
        if s.trigger == TriggerMode::Scenario && s.scenario.is_none() {
            return Err(err(
                "sources.scenario",
                "trigger = \"scenario\" needs the file of trigger times".into(),
            ));
        }
        if !(s.replay_speed.is_finite() && s.replay_speed >= 0.0) {
            return Err(err(
                "sources.replay_speed",
                format!(
                    "must be 0 (as fast as allowed) or a positive factor, got {}",
                    s.replay_speed
                ),
            ));
        }
        if !(s.size_correlation.is_finite() && (0.0..=1.0).contains(&s.size_correlation)) {
            return Err(err(
                "sources.size_correlation",
                format!("must be from 0 to 1, got {}", s.size_correlation),
            ));
        }
        if s.busy == BusyPolicy::Veto && s.derandomizer == 0 {
            return Err(err(
                "sources.derandomizer",
                "must hold at least 1 event with busy = \"veto\"".into(),
            ));
        }
        if s.derandomizer > MAX_DERANDOMIZER {
            // The log of accepted triggers is sized by it: a typo must not size it in gigabytes.
            return Err(err(
                "sources.derandomizer",
                format!(
                    "must be at most {MAX_DERANDOMIZER} events (a front-end's derandomizer holds a few to a few thousand), got {}",
                    s.derandomizer
                ),
            ));
        }
        if rated && s.rate_profile.is_empty() && !(s.rate_hz > 0.0 && s.rate_hz.is_finite()) {
            return Err(err(
                "sources.rate_hz",
                format!(
                    "must be a positive rate for trigger = {:?}, got {}",
                    s.trigger, s.rate_hz
                ),
            ));
        }
        if s.trigger_types == 0 {
            return Err(err("sources.trigger_types", "must be at least 1".into()));
        }
        let max = self.run.max_fragment_size.0;
        if max == 0 || max > (1 << 30) {
            return Err(err(
                "run.max_fragment_size",
                "must be between 1 byte and 1 GiB".into(),
            ));
        }
        if s.fragment_size.0 > max {
            return Err(err(
                "sources.fragment_size",
                format!(
                    "{} exceeds run.max_fragment_size ({})",
                    s.fragment_size, self.run.max_fragment_size
                ),
            ));
        }
        if !(self.run.duration_s >= 0.0 && self.run.duration_s.is_finite()) {
            return Err(err(
                "run.duration_s",
                "must be a non-negative number of seconds".into(),
            ));
        }
        if s.batch.0 == 0 {
            return Err(err("sources.batch", "must be at least 1 byte".into()));
        }
        // Every source belongs to exactly one readout unit.
        let emulated: BTreeSet<u32> = (s.first_id..s.first_id + s.count).collect();
        let mut declared = emulated.clone();
        for (i, x) in s.external.iter().enumerate() {
            if !declared.insert(*x) {
                return Err(err(
                    &format!("sources.external[{i}]"),
                    format!(
                        "source {x} is declared twice (emulated sources are {}..{})",
                        s.first_id,
                        s.first_id + s.count
                    ),
                ));
            }
        }
        let mut ids = BTreeSet::new();
        for (i, ru) in self.readout_units.iter().enumerate() {
            if !ids.insert(ru.id) {
                return Err(err(
                    &format!("readout[{i}].id"),
                    format!("readout unit ID {} is used twice", ru.id),
                ));
            }
        }
        let explicit: Vec<Option<Vec<u32>>> = self
            .readout_units
            .iter()
            .enumerate()
            .map(|(i, ru)| {
                ru.sources
                    .resolve()
                    .map_err(|r| err(&format!("readout[{i}].sources"), r))
            })
            .collect::<Result<_, _>>()?;
        let mut source_ru = BTreeMap::new();
        let mut ru_sources = vec![Vec::new(); self.readout_units.len()];
        for (i, list) in explicit.iter().enumerate() {
            if let Some(list) = list {
                for x in list {
                    if !declared.contains(x) {
                        return Err(err(&format!("readout[{i}].sources"), format!("source {x} is neither emulated ({}..{}) nor listed in sources.external", s.first_id, s.first_id + s.count)));
                    }
                    if let Some(prev) = source_ru.insert(*x, i) {
                        return Err(err(
                            &format!("readout[{i}].sources"),
                            format!("source {x} is already read by readout[{prev}]"),
                        ));
                    }
                    ru_sources[i].push(*x);
                }
            }
        }
        let auto: Vec<usize> = explicit
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_none())
            .map(|(i, _)| i)
            .collect();
        let unplaced: Vec<u32> = declared
            .iter()
            .copied()
            .filter(|x| !source_ru.contains_key(x))
            .collect();
        if !unplaced.is_empty() {
            if auto.is_empty() {
                return Err(err(
                    "readout",
                    format!(
                        "sources {} are read by no readout unit",
                        short_list(&unplaced)
                    ),
                ));
            }
            // Contiguous shares, the first units taking one more when it does not divide evenly.
            let per = unplaced.len() / auto.len();
            let extra = unplaced.len() % auto.len();
            let mut it = unplaced.into_iter();
            for (k, &i) in auto.iter().enumerate() {
                let n = per + usize::from(k < extra);
                for x in it.by_ref().take(n) {
                    source_ru.insert(x, i);
                    ru_sources[i].push(x);
                }
            }
        }
        let chunk_floor = 2 * (tessera_format::wire::MAX_HEADER_SIZE + max as usize + 16);
        for (i, ru) in self.readout_units.iter_mut().enumerate() {
            if ru_sources[i].is_empty() {
                return Err(err(
                    &format!("readout[{i}].sources"),
                    format!("readout unit {} reads no source", ru.id),
                ));
            }
            if ru.dial.len() > ru_sources[i].len() {
                return Err(err(
                    &format!("readout[{i}].dial"),
                    format!(
                        "{} addresses to connect to, and the unit reads {} sources",
                        ru.dial.len(),
                        ru_sources[i].len()
                    ),
                ));
            }
            ru.read_chunk = ByteSize(ru.read_chunk.0.max(chunk_floor as u64));
            let per_link = ru.buffer.0 / ru_sources[i].len() as u64;
            if per_link < 2 * ru.read_chunk.0 {
                return Err(err(
                    &format!("readout[{i}].buffer"),
                    format!(
                        "{} over {} links leaves {} per link; each link needs at least two read chunks ({} each, from read_chunk and run.max_fragment_size): raise buffer to {} or more",
                        ru.buffer, ru_sources[i].len(), ByteSize(per_link), ru.read_chunk, ByteSize((2 * ru.read_chunk.0 * ru_sources[i].len() as u64).div_ceil(1 << 20) << 20)
                    ),
                ));
            }
            if ru.event_timeout_ms == 0 {
                return Err(err(
                    &format!("readout[{i}].event_timeout_ms"),
                    "must be at least 1 ms".into(),
                ));
            }
            if ru.max_open_events == 0 {
                return Err(err(
                    &format!("readout[{i}].max_open_events"),
                    "must be at least 1".into(),
                ));
            }
        }
        let mut bids = BTreeSet::new();
        let max_ru_timeout = self
            .readout_units
            .iter()
            .map(|r| r.event_timeout_ms)
            .max()
            .unwrap_or(0);
        let max_ru_sources = ru_sources.iter().map(Vec::len).max().unwrap_or(0);
        let sf_floor = 2
            * (64
                + 4 * max_ru_sources
                + max_ru_sources * (tessera_format::wire::MAX_HEADER_SIZE + max as usize + 16));
        let n_rus = self.readout_units.len() as u64;
        for (i, bu) in self.builders.iter_mut().enumerate() {
            if bu.id > u16::MAX as u32 {
                return Err(err(
                    &format!("builder[{i}].id"),
                    format!(
                        "{} does not fit the 16-bit builder ID of the event record",
                        bu.id
                    ),
                ));
            }
            if !bids.insert(bu.id) {
                return Err(err(
                    &format!("builder[{i}].id"),
                    format!("builder ID {} is used twice", bu.id),
                ));
            }
            if bu.event_timeout_ms <= max_ru_timeout {
                return Err(err(
                    &format!("builder[{i}].event_timeout_ms"),
                    format!("{} ms must exceed the readout units' event_timeout_ms ({max_ru_timeout} ms), or partial super-fragments arrive after the builder gave up", bu.event_timeout_ms),
                ));
            }
            if bu.max_open_events == 0 {
                return Err(err(
                    &format!("builder[{i}].max_open_events"),
                    "must be at least 1".into(),
                ));
            }
            bu.read_chunk = ByteSize(bu.read_chunk.0.max(sf_floor as u64));
            let per_link = bu.buffer.0 / n_rus;
            // Each rail of a link has its own share (crates/builder, `RuLinkStats::budgets`).
            let rails = 1 + bu.rails.len() as u64;
            if per_link < 2 * rails * bu.read_chunk.0 {
                let each = if rails > 1 {
                    format!(" over {rails} rails; each rail needs")
                } else {
                    "; each needs".into()
                };
                return Err(err(
                    &format!("builder[{i}].buffer"),
                    format!("{} over {} readout-unit links leaves {} per link{each} two read chunks of {}: raise buffer to {} or more", bu.buffer, n_rus, ByteSize(per_link), bu.read_chunk, ByteSize((2 * rails * bu.read_chunk.0 * n_rus).div_ceil(1 << 20) << 20)),
                ));
            }
        }
        if self.assignment.block == 0 {
            return Err(err("assignment.block", "must be at least 1".into()));
        }
        // A link read one moderation late must not make its event late: of two links of one
        // event, one may be read a whole moderation after the other.
        let moderation = self.run.io_moderation_us;
        if moderation > 1_000_000 {
            return Err(err(
                "run.io_moderation_us",
                format!("{moderation} us is more than 1 s of latency on a link"),
            ));
        }
        if let Some(ru) = self
            .readout_units
            .iter()
            .find(|r| r.event_timeout_ms.saturating_mul(1000) < 4 * moderation)
        {
            return Err(err(
                "run.io_moderation_us",
                format!(
                    "{moderation} us must be at most a quarter of every readout unit's event_timeout_ms (readout unit {}: {} ms), or a link read one moderation late makes its event incomplete",
                    ru.id, ru.event_timeout_ms
                ),
            ));
        }
        let q = &self.request;
        if q.page_size.0 < 256 || q.page_size.0 > (16 << 20) {
            return Err(err(
                "request.page_size",
                "must be between 256 bytes and 16 MiB".into(),
            ));
        }
        if (q.descriptors as usize) < self.builders.len() {
            return Err(err(
                "request.descriptors",
                format!(
                    "{} descriptors cannot give each of the {} builders one",
                    q.descriptors,
                    self.builders.len()
                ),
            ));
        }
        if q.timeout_ms == 0 {
            return Err(err("request.timeout_ms", "must be at least 1 ms".into()));
        }
        if q.builder_timeout_ms <= q.timeout_ms {
            return Err(err(
                "request.builder_timeout_ms",
                format!(
                    "{} ms must exceed request.timeout_ms ({} ms), or partial answers arrive after the builder gave up",
                    q.builder_timeout_ms, q.timeout_ms
                ),
            ));
        }
        if q.credits == 0 {
            return Err(err("request.credits", "must be at least 1".into()));
        }
        let m = &self.event_manager;
        if m.clear_group == 0 || m.clear_group as usize > tessera_format::request::MAX_LIST {
            return Err(err(
                "event_manager.clear_group",
                format!(
                    "must be between 1 and {}",
                    tessera_format::request::MAX_LIST
                ),
            ));
        }
        if m.heartbeat_ms == 0 || m.heartbeat_timeout_ms <= m.heartbeat_ms {
            return Err(err(
                "event_manager.heartbeat_timeout_ms",
                format!(
                    "{} ms must exceed heartbeat_ms ({} ms), which must be at least 1",
                    m.heartbeat_timeout_ms, m.heartbeat_ms
                ),
            ));
        }
        if m.takeover_memory as usize > tessera_format::request::MAX_LIST {
            return Err(err(
                "event_manager.takeover_memory",
                format!(
                    "{} events: at most {} (one rejoin message)",
                    m.takeover_memory,
                    tessera_format::request::MAX_LIST
                ),
            ));
        }
        let f = &self.filter;
        if f.prescale == 0 {
            return Err(err("filter.prescale", "must be at least 1".into()));
        }
        if !(0.0..=1.0).contains(&f.fraction) {
            return Err(err(
                "filter.fraction",
                format!("{} is not a fraction in [0, 1]", f.fraction),
            ));
        }
        if f.cut_min > f.cut_max {
            return Err(err(
                "filter.cut_min",
                format!("{} exceeds cut_max ({})", f.cut_min, f.cut_max),
            ));
        }
        if f.decision == Decision::Cut && !source_ru.contains_key(&f.cut_source) {
            return Err(err(
                "filter.cut_source",
                format!("source {} is not in the topology", f.cut_source),
            ));
        }
        let roi = f
            .roi
            .resolve()
            .map_err(|r| err("filter.roi", r))?
            .unwrap_or_default();
        for x in &roi {
            if !source_ru.contains_key(x) {
                return Err(err(
                    "filter.roi",
                    format!("source {x} is not in the topology"),
                ));
            }
        }
        if self.run.mode == Mode::Push && (f.decision != Decision::AcceptAll || !roi.is_empty()) {
            return Err(err(
                "filter.decision",
                "filters run in request mode (run.mode = \"request\"); push mode records every event".into(),
            ));
        }
        let r = &self.recorder;
        if !(1..=22).contains(&r.zstd_level) {
            return Err(err(
                "recorder.zstd_level",
                format!("{} is outside 1..=22", r.zstd_level),
            ));
        }
        if r.durability == Durability::Sync && !(1..=60_000).contains(&r.sync_interval_ms) {
            return Err(err(
                "recorder.sync_interval_ms",
                format!("{} is outside 1..=60000", r.sync_interval_ms),
            ));
        }
        if r.durability == Durability::Sync && !r.fsync {
            return Err(err(
                "recorder.fsync",
                "durability = \"sync\" syncs every block; a finished file cannot skip its sync (set fsync = true)".into(),
            ));
        }
        if r.streams.len() > 16 {
            return Err(err(
                "recorder.streams",
                format!("{} streams: at most 16", r.streams.len()),
            ));
        }
        let mut stream_of: BTreeMap<u16, &str> = BTreeMap::new();
        for (name, types) in &r.streams {
            let key = format!("recorder.streams.{name}");
            if name.is_empty()
                || name.len() > 32
                || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            {
                return Err(err(
                    &key,
                    "a stream name is 1 to 32 letters, digits or '-' (it goes into file names)"
                        .into(),
                ));
            }
            if types.is_empty() {
                return Err(err(&key, "names no trigger type".into()));
            }
            for t in types {
                if let Some(other) = stream_of.insert(*t, name) {
                    return Err(err(
                        &key,
                        format!("trigger type {t} is already in stream {other:?}"),
                    ));
                }
            }
        }
        let sh = &self.shipper;
        for (i, to) in sh.to.iter().enumerate() {
            let key = format!("shipper.to[{i}]");
            if to.trim().is_empty() {
                return Err(err(&key, "is empty".into()));
            }
            if to.contains("://") && !(to.starts_with("s3://") || to.starts_with("ssh://")) {
                return Err(err(
                    &key,
                    format!("{to:?}: a destination is a directory, s3://bucket/prefix or ssh://[user@]host[:port]/path"),
                ));
            }
            if sh.to[..i].contains(to) {
                return Err(err(&key, format!("{to:?} is listed twice")));
            }
        }
        for (key, v, positive) in [
            ("shipper.keep_s", sh.keep_s, false),
            ("shipper.interval_s", sh.interval_s, true),
            ("shipper.drain_at_exit_s", sh.drain_at_exit_s, false),
        ] {
            if !(v.is_finite() && v >= 0.0 && (v > 0.0 || !positive) && v <= 1e9) {
                return Err(err(key, format!("{v} is not a number of seconds")));
            }
        }
        if !(r.max_file_age_s.is_finite() && r.max_file_age_s >= 0.0) {
            return Err(err(
                "recorder.max_file_age_s",
                format!("{} is not a number of seconds (0: off)", r.max_file_age_s),
            ));
        }
        if !(1..=16).contains(&r.writers) {
            return Err(err(
                "recorder.writers",
                format!("{} is outside 1..=16", r.writers),
            ));
        }
        if r.writers > 1 {
            if let Some(name) = r.streams.keys().find(|n| {
                n.strip_prefix('w')
                    .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
            }) {
                return Err(err(
                    &format!("recorder.streams.{name}"),
                    "with recorder.writers > 1, names w1, w2, ... are the main files' series"
                        .into(),
                ));
            }
        }
        if !(1..=64).contains(&r.compression_threads) {
            return Err(err(
                "recorder.compression_threads",
                format!("{} is outside 1..=64", r.compression_threads),
            ));
        }
        if r.block_size.0 < 4096 || r.block_size.0 > (256 << 20) {
            return Err(err(
                "recorder.block_size",
                "must be between 4 KiB and 256 MiB".into(),
            ));
        }
        if r.max_file_size.0 < r.block_size.0 {
            return Err(err(
                "recorder.max_file_size",
                format!(
                    "{} is smaller than one block ({})",
                    r.max_file_size, r.block_size
                ),
            ));
        }
        if r.queue.0 < sf_floor as u64 {
            return Err(err(
                "recorder.queue",
                format!(
                    "{} cannot hold one maximum-size event ({})",
                    r.queue,
                    ByteSize(sf_floor as u64 / 2)
                ),
            ));
        }
        for (i, inj) in self.injections.iter().enumerate() {
            if !emulated.contains(&inj.source) {
                return Err(err(
                    &format!("inject[{i}].source"),
                    format!("{} is not an emulated source", inj.source),
                ));
            }
            if inj.at.is_empty() && inj.every == 0 {
                return Err(err(
                    &format!("inject[{i}]"),
                    "give `at` (event IDs) or `every`".into(),
                ));
            }
            if inj.kind == InjectKind::Disconnect && (inj.every != 0 || inj.at.len() != 1) {
                return Err(err(
                    &format!("inject[{i}].at"),
                    "disconnect takes exactly one event ID in `at` and no `every`".into(),
                ));
            }
        }
        let m = &self.monitor;
        if m.enabled {
            if m.heartbeat_ms == 0 {
                return Err(err("monitor.heartbeat_ms", "must be at least 1".into()));
            }
            if (m.consumer_timeout_ms as u64) < 2 * m.heartbeat_ms as u64 {
                return Err(err(
                    "monitor.consumer_timeout_ms",
                    format!(
                        "{} ms is less than two heartbeats ({} ms): live consumers would be declared dead",
                        m.consumer_timeout_ms,
                        2 * m.heartbeat_ms as u64
                    ),
                ));
            }
            check_chain(&m.chain(), &m.streams).map_err(|(k, why)| err(&k, why))?;
            if m.chain().len() > m.max_stations {
                return Err(err(
                    "monitor.max_stations",
                    format!(
                        "{} stations are configured, more than max_stations = {}",
                        m.chain().len(),
                        m.max_stations
                    ),
                ));
            }
        }
        let h = &self.histograms;
        if !(h.payload_min.is_finite()
            && h.payload_max.is_finite()
            && h.payload_min < h.payload_max)
        {
            return Err(err(
                "histograms.payload_max",
                format!(
                    "the range {} to {} is empty: payload_max must be above payload_min",
                    h.payload_min, h.payload_max
                ),
            ));
        }
        if !(1..=4096).contains(&h.payload_bins) {
            return Err(err(
                "histograms.payload_bins",
                format!("{} bins: from 1 to 4096", h.payload_bins),
            ));
        }
        let a = &self.alarms;
        for (key, v, max) in [
            ("alarms.blocked_s", a.blocked_s, f64::MAX),
            ("alarms.no_events_s", a.no_events_s, f64::MAX),
            ("alarms.incomplete_fraction", a.incomplete_fraction, 1.0),
            ("alarms.buffer_fraction", a.buffer_fraction, 1.0),
            ("alarms.dead_time_fraction", a.dead_time_fraction, 1.0),
            ("alarms.clear_s", a.clear_s, f64::MAX),
        ] {
            if !(v.is_finite() && (0.0..=max).contains(&v)) {
                return Err(err(
                    key,
                    if max == 1.0 {
                        format!("{v} is not a fraction from 0 (off) to 1")
                    } else {
                        format!("{v} is not a number of seconds (0: off)")
                    },
                ));
            }
        }
        self.check_hosts().map_err(|(k, why)| err(&k, why))?;
        for (i, b) in self.builders.iter().enumerate() {
            if b.rails.is_empty() {
                continue;
            }
            if self.run.mode == Mode::Request {
                return Err(err(
                    &format!("builder[{i}].rails"),
                    "rails are for push mode, where readout units connect to the builders; in request mode the builders connect to the readout units".into(),
                ));
            }
            if b.rails.len() > MAX_RAILS - 1 {
                return Err(err(
                    &format!("builder[{i}].rails"),
                    format!(
                        "{} rails: at most {} besides listen",
                        b.rails.len(),
                        MAX_RAILS - 1
                    ),
                ));
            }
            for (j, r) in b.rails.iter().enumerate() {
                if r.rsplit_once(':')
                    .and_then(|(_, p)| p.parse::<u16>().ok())
                    .is_none()
                {
                    return Err(err(
                        &format!("builder[{i}].rails[{j}]"),
                        format!("{r:?} is not an address with a port (\"10.2.0.5:0\")"),
                    ));
                }
            }
        }
        // Ports beyond loopback need the networks allowed to reach them.
        let nets = self
            .security
            .networks()
            .map_err(|(i, why)| err(&format!("security.allow[{i}]"), why))?;
        if nets.is_empty() {
            let mut listens: Vec<(String, &str)> = Vec::new();
            for (i, u) in self.readout_units.iter().enumerate() {
                listens.push((format!("readout[{i}].listen"), &u.listen));
            }
            for (i, b) in self.builders.iter().enumerate() {
                listens.push((format!("builder[{i}].listen"), &b.listen));
                for (j, r) in b.rails.iter().enumerate() {
                    listens.push((format!("builder[{i}].rails[{j}]"), r));
                }
            }
            listens.push(("recorder.listen".into(), &self.recorder.listen));
            listens.push(("event_manager.listen".into(), &self.event_manager.listen));
            if self.monitor.enabled {
                listens.push(("monitor.listen".into(), &self.monitor.listen));
            }
            if let Some((key, l)) = listens.iter().find(|(_, l)| !is_loopback_listen(l)) {
                return Err(err(
                    key,
                    format!("{l} is not a loopback address: list the peer networks allowed to connect in security.allow"),
                ));
            }
        }
        use sha2::Digest;
        let digest: [u8; 32] = sha2::Sha256::digest(text.as_bytes()).into();
        Ok(Resolved {
            topology: self,
            origin: origin.into(),
            text,
            digest,
            pattern,
            ru_sources,
            source_ru,
            roi,
        })
    }
}

impl Topology {
    /// The host of every role is a name of `[hosts]`; with hosts, every role has one.
    fn check_hosts(&self) -> Result<(), (String, String)> {
        let mut roles: Vec<(String, &Option<String>)> = Vec::new();
        for (i, u) in self.readout_units.iter().enumerate() {
            roles.push((format!("readout[{i}].host"), &u.host));
        }
        for (i, b) in self.builders.iter().enumerate() {
            roles.push((format!("builder[{i}].host"), &b.host));
        }
        if self.recorder.enabled {
            roles.push(("recorder.host".into(), &self.recorder.host));
        }
        if self.run.mode == Mode::Request {
            roles.push(("event_manager.host".into(), &self.event_manager.host));
        }
        let sources_host = ("sources.host".to_string(), &self.sources.host);
        if self.hosts.is_empty() {
            if let Some((k, _)) = roles
                .iter()
                .chain(std::iter::once(&sources_host))
                .find(|(_, h)| h.is_some())
            {
                return Err((
                    k.clone(),
                    "names a host, but there is no [hosts] table".into(),
                ));
            }
            return Ok(());
        }
        for (name, h) in &self.hosts {
            // A host's name names files and directories (its report, its agent's logs) and
            // travels in the node protocol: a plain name, never a path.
            let plain = !name.is_empty()
                && name.len() <= 63
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
                && name.starts_with(|c: char| c.is_ascii_alphanumeric());
            if !plain {
                return Err((
                    format!("hosts.{name}"),
                    format!("{name:?} is not a host name: letters, digits, '-', '_' and '.', starting with a letter or a digit, at most 63"),
                ));
            }
            let agent = h.agent();
            if agent.parse::<std::net::SocketAddr>().is_err() && agent.rsplit_once(':').is_none() {
                return Err((
                    format!("hosts.{name}"),
                    format!("{agent:?} is not an agent address like 10.1.0.2:7300"),
                ));
            }
            if let HostEntry::Full { data: Some(d), .. } = h {
                if d.parse::<std::net::IpAddr>().is_err() {
                    return Err((
                        format!("hosts.{name}.data"),
                        format!("{d:?} is not an IP address (the data ports' port is chosen when they bind)"),
                    ));
                }
            }
        }
        for (k, h) in roles.iter().chain(std::iter::once(&sources_host)) {
            match h {
                None if k == "sources.host" => {}
                None => {
                    return Err((
                        k.clone(),
                        "missing: with [hosts], every role names the host it runs on".into(),
                    ))
                }
                Some(h) if !self.hosts.contains_key(h) => {
                    return Err((
                        k.clone(),
                        format!(
                            "{h:?} is not a host of [hosts] ({})",
                            self.hosts.keys().cloned().collect::<Vec<_>>().join(", ")
                        ),
                    ))
                }
                Some(_) => {}
            }
        }
        // A listening source is dialled by its readout unit in the same process: it must run
        // beside it, as a board sits beside its readout PC.
        if self.sources.listen && self.sources.host.is_some() {
            return Err((
                "sources.listen".into(),
                "listening sources run beside their readout unit (each on its unit's host): remove sources.host".into(),
            ));
        }
        // One trigger decides for every emulated source: with a veto they must all run in one
        // process (sources.host, or every readout unit on one host).
        if self.sources.busy == BusyPolicy::Veto && self.sources.count > 0 {
            let hosts: BTreeSet<Option<&str>> = (0..self.readout_units.len())
                .map(|i| self.source_host(i))
                .collect();
            if hosts.len() > 1 {
                return Err((
                    "sources.busy".into(),
                    format!(
                        "\"veto\" needs one trigger for every emulated source, and they would run on {} hosts: set sources.host (the host of the trigger and every emulated source), or busy = \"queue\"",
                        hosts.len()
                    ),
                ));
            }
        }
        let beyond_loopback = self
            .hosts
            .values()
            .any(|h| !is_loopback_listen(&format!("{}:0", h.data_address())));
        if beyond_loopback && self.security.allow.is_empty() {
            return Err((
                "security.allow".into(),
                "the hosts' data ports are beyond loopback: list the networks of the hosts (and of external sources) allowed to connect".into(),
            ));
        }
        Ok(())
    }

    /// The host of each readout unit's sources (`sources.host`, else the unit's own).
    pub fn source_host(&self, ru_index: usize) -> Option<&str> {
        self.sources
            .host
            .as_deref()
            .or(self.readout_units.get(ru_index)?.host.as_deref())
    }
}

fn short_list(v: &[u32]) -> String {
    if v.len() <= 8 {
        format!("{v:?}")
    } else {
        format!("{:?} and {} more", &v[..8], v.len() - 8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scenario_file_reads_as_ascending_nanoseconds_and_names_a_bad_line() {
        assert_eq!(
            parse_scenario("# spill\n0.001\n\n0.5 # late\n0.5\n"),
            Ok(vec![1_000_000, 500_000_000, 500_000_000])
        );
        assert!(parse_scenario("0.2\n0.1\n")
            .unwrap_err()
            .starts_with("line 2"));
        assert!(parse_scenario("x\n").unwrap_err().starts_with("line 1"));
        assert!(parse_scenario("-1\n").is_err());
        assert!(parse_scenario("inf\n").is_err());
        assert!(parse_scenario("# nothing\n").is_err());
    }

    fn parse(s: &str) -> Result<Resolved, ConfigError> {
        Topology::parse(s, "t.toml")
    }

    /// Issue 11, item 11: ports beyond loopback need the networks allowed to reach them.
    #[test]
    fn ports_beyond_loopback_need_an_allow_list() {
        for (text, key) in [
            ("[monitor]\nlisten = \"0.0.0.0:7711\"\n", "monitor.listen"),
            (
                "[[readout]]\nid = 0\nlisten = \"10.1.2.3:0\"\n",
                "readout[0].listen",
            ),
            ("[recorder]\nlisten = \"[::]:9000\"\n", "recorder.listen"),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains("security.allow"), "{e}");
        }
        let ok = parse("[monitor]\nlisten = \"0.0.0.0:7711\"\n[security]\nallow = [\"10.1.0.0/16\", \"192.168.5.7\"]\n")
            .unwrap();
        let nets = ok.topology.security.networks().unwrap();
        assert!(nets[0].contains(&"10.1.200.3".parse::<std::net::IpAddr>().unwrap()));
        assert!(nets[1].contains(&"192.168.5.7".parse::<std::net::IpAddr>().unwrap()));
        let e = parse("[security]\nallow = [\"ten.one\"]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("security.allow[0]"), "{e}");
    }

    /// Issue 11, item 11: the token was returned by the topology API and the run database.
    #[test]
    fn the_token_never_leaves_in_a_serialised_topology() {
        let r = parse("[control]\ntoken = \"hunter2-secret\"\n").unwrap();
        assert_eq!(r.topology.control.token.expose(), "hunter2-secret");
        let toml_text = toml::to_string(&r.topology).unwrap();
        let json_text = serde_json::to_string(&r.topology).unwrap();
        let debug_text = format!("{:?}", r.topology);
        for text in [toml_text.as_str(), json_text.as_str(), debug_text.as_str()] {
            assert!(!text.contains("hunter2"), "{text}");
            assert!(text.contains("<redacted>"), "{text}");
        }
    }

    #[test]
    fn demo_is_valid_and_splits_sources() {
        let d = Topology::demo();
        assert_eq!(d.ru_sources, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
        assert_eq!(d.topology.builders.len(), 2);
    }

    #[test]
    fn ranges_and_external() {
        let r = parse(
            "[sources]\ncount = 4\nexternal = [100]\n[[readout]]\nid = 0\nsources = \"0-3\"\n[[readout]]\nid = 1\nsources = [100]\n",
        )
        .unwrap();
        assert_eq!(r.ru_sources, vec![vec![0, 1, 2, 3], vec![100]]);
    }

    /// A count or a range from the file is checked before it sizes a table (the configuration
    /// fuzz target found `count = 458242264` exhausting memory).
    #[test]
    fn source_counts_are_bounded_before_anything_is_sized() {
        let e = parse("[sources]\ncount = 458242264\n").unwrap_err();
        assert_eq!(e.key, "sources.count", "{e}");
        let e =
            parse("[sources]\ncount = 4\n[[readout]]\nid = 0\nsources = \"0-3,10-4000000000\"\n")
                .unwrap_err();
        assert!(e.reason.contains("more than 65536"), "{e}");
        // At the bound, the count itself is no objection (the default buffers may be).
        let at = parse("[sources]\ncount = 65536\n");
        assert!(
            at.as_ref().err().is_none_or(|e| e.key != "sources.count"),
            "{:?}",
            at.err()
        );
    }

    /// Each rail of a builder's link reads into memory of its own, so the buffer must give
    /// every rail two read chunks: 2 MiB over 2 units is two chunks per link, not per rail.
    /// Issue 50, item 7: a host's name is a plain name, never a path; an input file's error
    /// names its line, never its content.
    #[test]
    fn host_names_are_plain_and_file_errors_never_echo_content() {
        for bad in ["\"../../x\"", "\"a/b\"", "\".hidden\"", "\"\""] {
            let text = format!("[hosts]\n{bad} = \"127.0.0.1:7300\"\n[sources]\nhost = \"fe\"\n");
            let e = parse(&text).unwrap_err();
            assert!(e.reason.contains("is not a host name"), "{bad}: {e}");
        }
        let secret = "root:$6$s3cr3t-hash:19000:0:99999:7:::";
        for e in [
            parse_scenario(secret).unwrap_err(),
            parse_size_histogram(secret).unwrap_err(),
            parse_size_histogram("12 x-s3cr3t-hash").unwrap_err(),
            parse_size_histogram("s3cr3t-hash 1").unwrap_err(),
        ] {
            assert!(!e.contains("s3cr3t"), "{e}");
            assert!(e.starts_with("line 1"), "{e}");
        }
    }

    /// Issue 50, item 8: the size a buffer error asks for is always more than the buffer it
    /// refused (a read chunk a few bytes over a MiB once asked for "32.0 MiB" of a 32 MiB one).
    #[test]
    fn a_buffer_error_asks_for_more_than_it_refused() {
        for text in [
            "[run]\nmax_fragment_size = \"16 MiB\"\n[sources]\ncount = 1\n[[readout]]\nid = 0\nbuffer = \"1 GiB\"\n[[builder]]\nid = 0\nbuffer = \"32 MiB\"\n",
            "[run]\nmax_fragment_size = \"16 MiB\"\n[sources]\ncount = 1\n[[readout]]\nid = 0\nbuffer = \"32 MiB\"\n",
        ] {
            let e = parse(text).unwrap_err();
            let asked = e
                .reason
                .rsplit_once("raise buffer to ")
                .and_then(|(_, r)| r.strip_suffix(" or more"))
                .unwrap_or_else(|| panic!("{e}"));
            let asked: ByteSize = toml::Value::String(asked.into())
                .try_into()
                .unwrap_or_else(|x| panic!("{asked}: {x}"));
            assert!(asked.0 > 32 << 20, "{e}");
            assert!(!e.reason.contains("32.0 MiB or more"), "{e}");
        }
    }

    #[test]
    fn a_builder_buffer_gives_every_rail_two_read_chunks() {
        let two_units =
            "[run]\nmax_fragment_size = \"16 KiB\"\n[sources]\ncount = 8\n[[readout]]\nid = 0\nsources = \"0-3\"\n[[readout]]\nid = 1\nsources = \"4-7\"\n";
        let one_rail = format!(
            "{two_units}[[builder]]\nid = 0\nbuffer = \"1 MiB\"\nread_chunk = \"256 KiB\"\n"
        );
        assert!(parse(&one_rail).is_ok(), "{:?}", parse(&one_rail).err());
        let two_rails = format!("{one_rail}rails = [\"127.0.0.1:0\"]\n");
        let e = parse(&two_rails).unwrap_err();
        assert_eq!(e.key, "builder[0].buffer");
        assert!(e.reason.contains("each rail needs two read chunks"), "{e}");
        assert!(e.reason.contains("raise buffer to 2 MiB"), "{e}");
        let enough = two_rails.replace("\"1 MiB\"", "\"2 MiB\"");
        assert!(parse(&enough).is_ok(), "{:?}", parse(&enough).err());
    }

    #[test]
    fn errors_name_key() {
        let e = parse("[sources]\ncount = \"x\"\n").unwrap_err();
        assert_eq!(e.key, "sources.count");
        let e = parse("[sources]\nbogus = 1\n").unwrap_err();
        assert!(e.reason.contains("bogus"), "{e}");
        let e = parse("[[readout]]\nid = 0\nsources = \"0-3\"\n").unwrap_err();
        assert!(e.reason.contains("read by no readout unit"), "{e}");
        let e = parse("[[readout]]\nid=0\n[[readout]]\nid=0\n").unwrap_err();
        assert_eq!(e.key, "readout[1].id");
        let e = parse("[run]\nmax_fragment_size = \"12 parsecs\"\n").unwrap_err();
        assert_eq!(e.key, "run.max_fragment_size");
        // A moderation longer than a quarter of an event timeout would make events late.
        let e =
            parse("[run]\nio_moderation_us = 60000\n[[readout]]\nid = 0\nevent_timeout_ms = 200\n")
                .unwrap_err();
        assert_eq!(e.key, "run.io_moderation_us");
        assert!(e.reason.contains("readout unit 0: 200 ms"), "{e}");
        parse("[run]\nio_moderation_us = 50000\n[[readout]]\nid = 0\nevent_timeout_ms = 200\n")
            .unwrap();
        let e = parse("[run]\nio_moderation_us = 2000000\n").unwrap_err();
        assert_eq!(e.key, "run.io_moderation_us");
        let e = parse("[[readout]]\nid=0\nbuffer = \"1 MiB\"\n").unwrap_err();
        assert_eq!(e.key, "readout[0].buffer");
        assert!(
            e.to_string().starts_with("t.toml: readout[0].buffer: "),
            "{e}"
        );
    }

    #[test]
    fn builder_for_blocks() {
        let a = AssignmentSection { block: 3 };
        let got: Vec<usize> = (0..9).map(|e| a.builder_for(e, 2)).collect();
        assert_eq!(got, vec![0, 0, 0, 1, 1, 1, 0, 0, 0]);
    }
}

#[cfg(test)]
mod monitor_tests {
    use super::*;

    #[test]
    fn the_documented_monitor_example_parses() {
        let doc = std::fs::read_to_string("../../docs/configuration.md").unwrap();
        let at = doc.find("## `[monitor]`").unwrap();
        let start = at + doc[at..].find("```toml").unwrap() + 7;
        let end = start + doc[start..].find("```").unwrap();
        let r = Topology::parse(&doc[start..end], "doc").unwrap();
        let m = &r.topology.monitor;
        assert_eq!(m.stations.len(), 2);
        assert_eq!(m.stations[1].mode, StationMode::Blocking);
        assert_eq!(m.stations[1].restore_policy(), Restore::Station);
        assert_eq!(m.streams["calibration"], vec![2, 3]);
    }

    #[test]
    fn a_size_histogram_reads_as_cumulative_weights_and_names_a_bad_line() {
        let h = parse_size_histogram("# sizes\n100 1\n200 2 # most\n\n1000 1\n").unwrap();
        assert_eq!(h.quantile(0.0), 100);
        assert_eq!(h.quantile(0.25), 100);
        assert_eq!(h.quantile(0.5), 200);
        assert_eq!(h.quantile(0.76), 1000);
        assert_eq!(h.quantile(1.0), 1000);
        assert_eq!(h.max(), 1000);
        assert!((h.mean() - 375.0).abs() < 1e-9);
        for (bad, why) in [
            ("100\n", "line 1"),
            ("100 1 2\n", "line 1"),
            ("1 1\nx 1\n", "line 2"),
            ("1 -1\n", "weight"),
            ("1 NaN\n", "weight"),
            ("1 0\n", "no size"),
            ("# none\n", "no size"),
        ] {
            let e = parse_size_histogram(bad).unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

    #[test]
    fn bad_trigger_settings_name_their_key() {
        for (text, key, why) in [
            (
                "[sources]\nbusy = \"veto\"\nderandomizer = 0\n",
                "sources.derandomizer",
                "at least 1",
            ),
            (
                "[sources]\nderandomizer = 4294967295\n",
                "sources.derandomizer",
                "at most 1048576",
            ),
            (
                "[sources]\ntrigger = \"bursts\"\nrate_hz = 10\nburst_size = 0\n",
                "sources.burst_size",
                "1 to 1000000",
            ),
            (
                "[sources]\ntrigger = \"scenario\"\n",
                "sources.scenario",
                "file of trigger times",
            ),
            (
                "[sources]\nsize_correlation = 1.5\n",
                "sources.size_correlation",
                "from 0 to 1",
            ),
            (
                "[sources]\ncount = 1\n[[readout]]\nid = 0\ndial = [\"127.0.0.1:1\", \"127.0.0.1:2\"]\n",
                "readout[0].dial",
                "reads 1 sources",
            ),
        ] {
            let e = Topology::parse(text, "t.toml").unwrap_err();
            assert_eq!(e.key, key, "{text}: {e}");
            assert!(e.reason.contains(why), "{text}: {e}");
        }
    }

    #[test]
    fn bad_stations_name_their_key() {
        for (text, key, why) in [
            ("[[monitor.station]]\nname = \"s\"\nrestore = \"next\"\n", "monitor.station[0].restore", "sampling"),
            ("[[monitor.station]]\nname = \"b\"\nmode = \"blocking\"\nrestore = \"release\"\n", "monitor.station[0].restore", "never loses"),
            ("[[monitor.station]]\nname = \"s\"\nstream = \"x\"\n", "monitor.station[0].stream", "not declared"),
            ("[[monitor.station]]\nname = \"s\"\npredicate = \"size >\"\n", "monitor.station[0].predicate", "expected a number"),
            ("[[monitor.station]]\nname = \"a\"\ngroup = \"g\"\n[[monitor.station]]\nname = \"b\"\n[[monitor.station]]\nname = \"c\"\ngroup = \"g\"\n", "monitor.station[2].group", "next to each other"),
            ("[monitor]\nheartbeat_ms = 1000\nconsumer_timeout_ms = 1500\n", "monitor.consumer_timeout_ms", "two heartbeats"),
        ] {
            let e = Topology::parse(text, "t.toml").unwrap_err();
            assert_eq!(e.key, key, "{text}: {e}");
            assert!(e.reason.contains(why), "{text}: {e}");
        }
    }
}

#[cfg(test)]
mod doc_tests {
    /// docs/configuration.md names every key the configuration accepts, under its section.
    #[test]
    fn every_key_is_documented() {
        let doc =
            std::fs::read_to_string("../../docs/configuration.md").expect("docs/configuration.md");
        let mut t = super::Topology::default();
        t.run.number = Some(1);
        t.readout_units.push(super::ReadoutSection {
            sources: super::SourceList::Ids(vec![0]),
            ..Default::default()
        });
        t.builders.push(Default::default());
        t.injections.push(super::Injection {
            source: 0,
            kind: super::InjectKind::Skip,
            at: vec![1],
            every: 0,
        });
        let v: toml::Value = toml::Value::try_from(&t).unwrap();
        let mut missing = Vec::new();
        for (section, body) in v.as_table().unwrap() {
            let tables: Vec<&toml::value::Table> = match body {
                toml::Value::Table(t) => vec![t],
                toml::Value::Array(a) => a.iter().filter_map(|x| x.as_table()).collect(),
                _ => continue,
            };
            for tbl in tables {
                for key in tbl.keys() {
                    let needle = format!("`{section}.{key}`");
                    if !doc.contains(&needle) {
                        missing.push(needle);
                    }
                }
            }
        }
        assert!(
            missing.is_empty(),
            "keys not documented in docs/configuration.md: {missing:?}"
        );
    }
}

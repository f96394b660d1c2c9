//! `tessera bench`: building throughput over fragment sizes and source counts, each point against
//! a raw-TCP baseline measured in the same run on the same topology.
//!
//! The baseline has the same sources (the same generator, writing the same bytes in the same
//! batches), the same hops and the same connections: every stage is a plain relay thread per
//! inbound connection that reads 256 KiB at a time and forwards without parsing, and the last
//! stage only reads. Building and baseline move the same number of events, and both are timed
//! from the moment the sources start until the last byte has arrived at the last stage, so ramp
//! and drain weigh the same on both. The figure that matters is the ratio.

use anyhow::{Context, Result};
use serde::Serialize;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use tessera_config::{ByteSize, Compression, Resolved, Topology, TriggerMode};
use tessera_format::pattern::Pattern;
use tessera_run::{Options, StatusMode};
use tessera_source::SourcePlan;

pub mod calibrate;
pub mod hosts;
pub mod instructions;
pub mod lowrate;
pub mod monitor;
pub mod record;
pub mod request;
pub mod trapezoid;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// `request`: the request-mode readout unit under a request mix (the ATLAS ROSTester), with
    /// the utilisation model fitted. `monitor`: the monitor against the CODA ET figures (TCP
    /// consumer rate, data path with sampling consumers, SIGKILLed blocking consumer). `hosts`:
    /// building over node agents in network namespaces with tc-shaped links against raw TCP on
    /// the same links, and over agents on one host against one process (root). `record`: the
    /// recorder (uncompressed, lz4 and zstd on 1 and 2 threads, files synced, and a point with
    /// frequent rotations) against a plain writer on the same disk. `instructions`: callgrind's
    /// count of instructions per fragment built, the median of `--repeat` pairs of runs (1 KiB
    /// x 8 by default; valgrind needed).
    /// `lowrate`: CPU per fragment of the COMET SUPPRESS setup at 1 kHz against saturation.
    /// `trapezoid`: building per CPU-second as readout units x builders grow (8x2 to 16x60 at
    /// 16 KiB), with the process's peak threads and descriptors. `calibrate`: this host's CPU
    /// per fragment and per byte (DAQ, emulated sources, recorder) and disk rate, stored for
    /// the capacity model of `tessera check` and `tessera scenario`.
    /// Absent: push-mode building against the relay baseline.
    pub what: Option<String>,
    /// A small set of points (building: under a minute; request: under five).
    #[arg(long)]
    pub quick: bool,
    /// request: links into the readout unit.
    #[arg(long, default_value_t = 24)]
    pub links: u32,
    /// request: events per point (default 100 000, 30 000 with --quick).
    #[arg(long)]
    pub events: Option<u64>,
    /// request: measure this one mix (with --sizes, --roi-fraction, --roi-size, --full-fraction)
    /// instead of the plan, and print the prediction of a fit given by --fit.
    #[arg(long)]
    pub roi_fraction: Option<f64>,
    #[arg(long)]
    pub roi_size: Option<u32>,
    #[arg(long)]
    pub full_fraction: Option<f64>,
    /// request: with one mix (--roi-fraction, --full-fraction), feed the unit from its
    /// in-process link generator instead of emulated sources over TCP.
    #[arg(long)]
    pub generator: bool,
    /// One JSON object per point on stdout (one per line).
    #[arg(long)]
    pub json: bool,
    /// Fragment payload sizes in bytes (default: 256 B to 64 KiB).
    #[arg(long, value_delimiter = ',')]
    pub sizes: Option<Vec<u64>>,
    /// Source counts (default: 8 and 32).
    #[arg(long, value_delimiter = ',')]
    pub sources: Option<Vec<u32>>,
    /// Events per builder block (`assignment.block`) for the building points: several values
    /// sweep it, each a point of its own (default: the configuration's default, 16). The
    /// trade: larger blocks let a readout unit's sender read longer runs of each link's
    /// fragments (less CPU), for longer bursts to one builder.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u64).range(1..))]
    pub blocks: Option<Vec<u64>>,
    /// lowrate: the pollers' interrupt moderation (`run.io_moderation_us`) to measure, in
    /// microseconds; several values sweep it, each a pair of points of its own (default: the
    /// configuration's default, 20000). The trade: a longer period reads more fragments per
    /// call on slow links (less CPU at low rates), for more latency per hop on them.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    pub moderation: Option<Vec<u64>>,
    /// Bytes each point moves (default 2 GB, 0.6 GB with --quick): a number (2e9) or a size
    /// with its unit (4GB, 600 MiB).
    #[arg(long, value_parser = parse_bytes)]
    pub bytes: Option<f64>,
    /// Directory for recorded files (default: a temporary directory, deleted after each point).
    #[arg(long)]
    pub output: Option<std::path::PathBuf>,
    /// Measure each point this many times, alternating baseline and building, and report the
    /// medians (default 3, 1 with --quick).
    #[arg(long)]
    pub repeat: Option<usize>,
    /// monitor: run as the consumer process that holds events until it is killed (internal).
    #[arg(long, hide = true)]
    pub hold_child: Option<String>,
    #[arg(long, hide = true)]
    pub hold_station: Option<String>,
}

/// What a point measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Sources → readout units → builders (which count and drop).
    Build,
    /// … → recorder writing uncompressed files.
    Record,
    /// The same with the recorder's histograms (`[histograms]`) off: their cost is the ratio
    /// of the two points of one run.
    RecordNoHistograms,
    /// … → recorder writing lz4 files (byte-shuffled ADC samples).
    RecordLz4,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Build => "build",
            Mode::Record => "build+record",
            Mode::RecordNoHistograms => "build+record-hist",
            Mode::RecordLz4 => "build+record+lz4",
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Point {
    pub mode: Mode,
    pub fragment_size: u64,
    pub sources: u32,
    pub readout_units: usize,
    pub builders: usize,
    /// Consecutive events per builder (`assignment.block`).
    pub block: u64,
    pub events: u64,
    pub events_per_s: f64,
    pub fragments_per_s: f64,
    /// Event bytes built per second (fragments with their headers and trailers, plus record headers).
    pub bytes_per_s: f64,
    /// Bytes per second through the relay chain on the same hops and connections.
    pub baseline_bytes_per_s: f64,
    pub ratio: f64,
    /// Whether every build run ended with the accounting balance holding and nothing incomplete.
    pub clean: bool,
    /// Measurements per point; the rates are medians.
    pub repeat: usize,
    /// Lowest and highest ratio over the repetitions (each building run against the baseline run
    /// just before it), to show how noisy the machine was.
    pub ratio_min: f64,
    pub ratio_max: f64,
    /// CPU seconds of the whole process (every thread, sources included) per GB moved: the
    /// relay's and building's medians. Their ratio says how much of the gap in rate is work
    /// and how much is waiting (a stage idle while another is busy).
    pub baseline_cpu_s_per_gb: f64,
    pub cpu_s_per_gb: f64,
}

fn parse_bytes(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        Ok(_) => Err(format!("`{s}` is not a positive number of bytes")),
        Err(_) => ByteSize::parse(s).and_then(|b| match b.0 {
            0 => Err(format!("`{s}` is not a positive number of bytes")),
            n => Ok(n as f64),
        }),
    }
}

/// CPU seconds (user and system) every thread of this process has used so far.
pub(crate) fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct it is given; RUSAGE_SELF covers every thread.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// What [`run_measured`] saw.
pub(crate) struct Measured {
    pub report: tessera_run::Report,
    /// Over the part measured (the window, or the whole run without one): the process's CPU
    /// seconds (every thread), the emulated sources' driver threads' share, and the wall time.
    pub cpu_s: f64,
    pub sources_cpu_s: f64,
    pub wall_s: f64,
    /// The CPU seconds of the process's shared threads (pollers and sweepers) over that part.
    pub stages: StageCpu,
    /// Events the builders built in that part (complete and incomplete).
    pub events: u64,
    /// The process's CPU seconds over the whole run, start and end included.
    pub whole_cpu_s: f64,
}

/// The steady part of a run to measure: from when the builders have built `from` of the run's
/// `events` to when the sources have sent `to` of its `fragments`. Why not the whole run: its
/// start connects every link and touches buffer pages for the first time, its end drains the
/// buffers with the sources idle, and both are the same CPU whatever the rate, so they pull
/// every per-fragment figure towards each other. Why the start is counted in events built and
/// the end in fragments sent: at an unlimited rate the sources run ahead of the builders by
/// what every buffer on the way holds (the kernel's socket buffers most), so the part between
/// is one where the buffers have filled and the sources still send, held by the DAQ.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Window {
    pub events: u64,
    /// Fragments the sources send in the whole run.
    pub fragments: u64,
    pub from: f64,
    pub to: f64,
}

/// One reading of the clocks a measurement subtracts.
#[derive(Clone, Copy)]
struct Reading {
    cpu: f64,
    sources_ns: u64,
    stages: StageCpu,
    t: std::time::Instant,
    built: u64,
}

impl Reading {
    /// Before or after a run: the sources' threads add their CPU to `DRIVER_CPU_NS` as they end.
    fn outside(built: u64) -> Reading {
        Self::with(
            built,
            tessera_source::DRIVER_CPU_NS.load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// While the sources run: their live threads, by name.
    fn during(built: u64) -> Reading {
        Self::with(
            built,
            tessera_net::role::threads_cpu_ns(|n| n.starts_with("source-drv") || n == "trigger"),
        )
    }

    fn with(built: u64, sources_ns: u64) -> Reading {
        Reading {
            cpu: cpu_seconds(),
            sources_ns,
            stages: StageCpu::now(),
            t: std::time::Instant::now(),
            built,
        }
    }
}

/// CPU seconds of the threads every run of a process shares, by what they do: they live as
/// long as the process, so their CPU over a run is the difference of two readings (the
/// per-run threads, recorder and trigger among them, end with the run and are left to the
/// rest of the DAQ's figure).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct StageCpu {
    /// The readout units' pollers (reading their links).
    pub readout_pollers: f64,
    /// The senders' pollers (readout units writing to builders).
    pub senders: f64,
    /// The builders' pollers (reading their readout units).
    pub builder_pollers: f64,
    /// Every stage's sweeper (event timeouts, every 5 ms or on the moderation grid).
    pub sweepers: f64,
}

impl StageCpu {
    fn now() -> StageCpu {
        let of = |prefix: &'static str| {
            tessera_net::role::threads_cpu_ns(|n| n.starts_with(prefix)) as f64 / 1e9
        };
        StageCpu {
            readout_pollers: of("ru-io"),
            senders: of("send-io"),
            builder_pollers: of("bu-io"),
            sweepers: tessera_net::role::threads_cpu_ns(|n| n.ends_with("-sweep")) as f64 / 1e9,
        }
    }

    fn since(self, before: StageCpu) -> StageCpu {
        StageCpu {
            readout_pollers: self.readout_pollers - before.readout_pollers,
            senders: self.senders - before.senders,
            builder_pollers: self.builder_pollers - before.builder_pollers,
            sweepers: self.sweepers - before.sweepers,
        }
    }

    pub fn total(&self) -> f64 {
        self.readout_pollers + self.senders + self.builder_pollers + self.sweepers
    }
}

/// Runs `r` in this process into `out` (deleted after), with the process's CPU time over the run
/// (or over `window` of it) and the emulated sources' share of it; a run that does not end clean
/// is an error, and so is one that ended before its window closed.
pub(crate) fn run_measured(
    r: &tessera_config::Resolved,
    out: &std::path::Path,
    name: &str,
    window: Option<Window>,
) -> Result<Measured> {
    let opts = tessera_run::Options {
        output: Some(out.to_path_buf()),
        status: tessera_run::StatusMode::Off,
        manifest: false,
        ..Default::default()
    };
    let start = Reading::outside(0);
    let (mut from, mut to) = (None, None);
    let report = tessera_run::run_watched(r, &opts, |session| {
        let Some(w) = window else { return };
        if to.is_some() {
            return;
        }
        let built = session.events_built();
        let ended = session.sent_and_built().0 as f64 >= w.fragments as f64 * w.to;
        if from.is_none() {
            // Not begun once the sources are past its end: no steady part, an error below.
            if built as f64 >= w.events as f64 * w.from && !ended {
                from = Some(Reading::during(built));
            }
        } else if ended {
            to = Some(Reading::during(built));
        }
    })
    .with_context(|| format!("the {name} point"))?;
    let end = Reading::outside(report.events_complete + report.events_incomplete);
    let _ = std::fs::remove_dir_all(out);
    if !report.ok() {
        anyhow::bail!("the {name} point did not run clean:\n{}", report.summary());
    }
    let (a, b) = match (window, from, to) {
        (None, _, _) => (start, end),
        (Some(_), Some(a), Some(b)) if b.built > a.built => (a, b),
        (Some(w), _, _) => anyhow::bail!(
            "the {name} point had no steady part to measure: its sources sent {:.0} % of its {} fragments before its builders had built {:.0} % of its {} events (the buffers on the way held most of the run: give it more events)",
            w.to * 100.0,
            w.fragments,
            w.from * 100.0,
            w.events
        ),
    };
    Ok(Measured {
        report,
        cpu_s: b.cpu - a.cpu,
        sources_cpu_s: b.sources_ns.saturating_sub(a.sources_ns) as f64 / 1e9,
        wall_s: (b.t - a.t).as_secs_f64(),
        stages: b.stages.since(a.stages),
        events: b.built - a.built,
        whole_cpu_s: end.cpu - start.cpu,
    })
}

pub fn run(a: &BenchArgs) -> Result<()> {
    match a.what.as_deref() {
        None => {}
        Some("request") => return run_request(a),
        Some("monitor") => return monitor::run_monitor(a),
        Some("hosts") => return hosts::run_hosts(a),
        Some("record") => return record::run_record(a),
        Some("instructions") => return instructions::run_instructions(a),
        Some("lowrate") => return lowrate::run_lowrate(a),
        Some("trapezoid") => return trapezoid::run_trapezoid(a),
        Some("calibrate") => return calibrate::run_calibrate(a),
        Some(other) => {
            anyhow::bail!(
                "unknown benchmark `{other}`: the choices are `request`, `monitor`, `hosts`, `record`, `instructions`, `lowrate`, `trapezoid`, `calibrate` or none"
            )
        }
    }
    let sizes = a.sizes.clone().unwrap_or_else(|| {
        if a.quick {
            vec![1024, 16384]
        } else {
            vec![256, 1024, 4096, 16384, 65536]
        }
    });
    let sources = a
        .sources
        .clone()
        .unwrap_or_else(|| if a.quick { vec![8] } else { vec![8, 32] });
    let bytes = a.bytes.unwrap_or(if a.quick { 0.6e9 } else { 2e9 });
    let blocks: Vec<Option<u64>> = match &a.blocks {
        Some(b) => b.iter().map(|&b| Some(b)).collect(),
        None => vec![None],
    };
    let mut plan: Vec<(Mode, u64, u32, Option<u64>)> = Vec::new();
    for &n in &sources {
        for &s in &sizes {
            for &b in &blocks {
                plan.push((Mode::Build, s, n, b));
            }
        }
    }
    let rec_size = if sizes.contains(&16384) {
        16384
    } else {
        sizes[sizes.len() / 2]
    };
    plan.push((Mode::Record, rec_size, sources[0], None));
    plan.push((Mode::RecordNoHistograms, rec_size, sources[0], None));
    plan.push((Mode::RecordLz4, rec_size, sources[0], None));
    if !a.json {
        eprintln!(
            "tessera bench: {} points, ~{:.1} GB each (machine: {} cores)",
            plan.len(),
            bytes / 1e9,
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        println!(
            "{:<18} {:>9} {:>7} {:>5} {:>10} {:>12} {:>11} {:>11} {:>7} {:>11} {:>12} {:>5}",
            "mode",
            "fragment",
            "sources",
            "block",
            "events/s",
            "fragments/s",
            "built MB/s",
            "relay MB/s",
            "ratio",
            "min-max",
            "CPU s/GB r:b",
            "clean"
        );
    }
    let repeat = a.repeat.unwrap_or(if a.quick { 1 } else { 3 }).max(1);
    for (mode, size, n, block) in plan {
        let p = point(mode, size, n, bytes, a.output.as_deref(), repeat, block)?;
        if a.json {
            println!("{}", serde_json::to_string(&p)?);
        } else {
            println!(
                "{:<18} {:>9} {:>7} {:>5} {:>10.0} {:>12.0} {:>11.1} {:>11.1} {:>7.2} {:>11} {:>12} {:>5}",
                mode.name(),
                size,
                n,
                p.block,
                p.events_per_s,
                p.fragments_per_s,
                p.bytes_per_s / 1e6,
                p.baseline_bytes_per_s / 1e6,
                p.ratio,
                format!("{:.2}-{:.2}", p.ratio_min, p.ratio_max),
                format!("{:.2}:{:.2}", p.baseline_cpu_s_per_gb, p.cpu_s_per_gb),
                if p.clean { "yes" } else { "NO" }
            );
        }
    }
    Ok(())
}

/// The topology a point runs: `n` sources over two readout units, two builders.
pub fn bench_topology(mode: Mode, size: u64, n: u32, events: u64) -> Result<Resolved> {
    bench_topology_with(mode, size, n, events, None)
}

/// [`bench_topology`] with events dealt to the builders in blocks of `block` (`None`: the
/// configuration's default).
fn bench_topology_with(
    mode: Mode,
    size: u64,
    n: u32,
    events: u64,
    block: Option<u64>,
) -> Result<Resolved> {
    let mut t = Topology::default();
    if let Some(b) = block {
        t.assignment.block = b;
    }
    t.run.events = events;
    t.run.max_fragment_size = ByteSize(size.max(1024));
    t.sources.count = n;
    t.sources.fragment_size = ByteSize(size);
    t.sources.trigger = TriggerMode::Unlimited;
    t.sources.pattern = if mode == Mode::RecordLz4 {
        "adc".into()
    } else {
        "counter".into()
    };
    t.sources.threads = 2;
    t.recorder.fsync = false;
    t.recorder.compression = if mode == Mode::RecordLz4 {
        Compression::Lz4
    } else {
        Compression::None
    };
    t.recorder.max_file_size = ByteSize(4 << 30);
    t.histograms.enabled = mode != Mode::RecordNoHistograms;
    let text = toml_text(&t);
    Ok(t.resolve("<bench>", text)?)
}

fn toml_text(t: &Topology) -> String {
    // The digest in file headers is taken over this text; the bench only needs it to be stable.
    format!("{t:?}")
}

pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn point(
    mode: Mode,
    size: u64,
    n: u32,
    bytes: f64,
    out: Option<&std::path::Path>,
    repeat: usize,
    block: Option<u64>,
) -> Result<Point> {
    let per_event =
        (tessera_format::wire::fragment_wire_size(size as usize) as u64 * n as u64).max(1);
    let events = ((bytes / per_event as f64) as u64).clamp(2000, 5_000_000);
    let r = bench_topology_with(mode, size, n, events, block)?;
    let hops = if mode == Mode::Build { 2 } else { 3 };
    let (mut base, mut built, mut ev_rate, mut fr_rate, mut ratios) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut base_cpu, mut built_cpu) = (Vec::new(), Vec::new());
    let mut clean = true;
    let mut total_events = 0;
    for _ in 0..repeat {
        // Baseline, then building, on the same topology, back to back.
        let c0 = cpu_seconds();
        let (baseline, moved) = relay_chain_measured(&r, hops)?;
        base_cpu.push((cpu_seconds() - c0) / (moved as f64 / 1e9).max(1e-9));
        let tmp = tempfile::tempdir()?;
        let dir = out
            .map(|p| p.to_path_buf())
            .unwrap_or_else(|| tmp.path().to_path_buf());
        let opts = Options {
            output: Some(dir.clone()),
            status: StatusMode::Off,
            sink_at_builders: mode == Mode::Build,
            manifest: false,
            ..Default::default()
        };
        let c0 = cpu_seconds();
        let rep = tessera_run::run(&r, &opts).context("bench run")?;
        built_cpu.push((cpu_seconds() - c0) / (rep.bytes_built as f64 / 1e9).max(1e-9));
        if out.is_some() {
            for f in rep.recorder.iter().flat_map(|r| r.files.iter()) {
                let _ = std::fs::remove_file(dir.join(&f.file));
                let _ = std::fs::remove_file(dir.join(format!("{}.json", f.file)));
            }
        }
        let secs = rep.duration_s.max(1e-9);
        total_events = rep.events_complete + rep.events_incomplete;
        let bps = rep.bytes_built as f64 / secs;
        clean &= rep.ok() && rep.events_incomplete == 0 && total_events == events;
        base.push(baseline);
        built.push(bps);
        ev_rate.push(total_events as f64 / secs);
        fr_rate.push(
            (rep.balance.in_complete_events + rep.balance.in_incomplete_events) as f64 / secs,
        );
        ratios.push(if baseline > 0.0 { bps / baseline } else { 0.0 });
    }
    let baseline = median(&mut base);
    let bytes_per_s = median(&mut built);
    Ok(Point {
        mode,
        fragment_size: size,
        sources: n,
        readout_units: r.topology.readout_units.len(),
        builders: r.topology.builders.len(),
        block: r.topology.assignment.block,
        events: total_events,
        events_per_s: median(&mut ev_rate),
        fragments_per_s: median(&mut fr_rate),
        bytes_per_s,
        baseline_bytes_per_s: baseline,
        ratio: if baseline > 0.0 {
            bytes_per_s / baseline
        } else {
            0.0
        },
        clean,
        repeat,
        ratio_min: ratios.iter().copied().fold(f64::INFINITY, f64::min),
        ratio_max: ratios.iter().copied().fold(0.0, f64::max),
        baseline_cpu_s_per_gb: median(&mut base_cpu),
        cpu_s_per_gb: median(&mut built_cpu),
    })
}

/// A stage of relays: accepts `inbound` connections, one thread each, forwarding every read to
/// one of `outbound` (round-robin per read) or, with none, only counting.
struct Stage {
    addr: String,
    threads: Vec<JoinHandle<()>>,
}

fn start_stage(
    inbound: usize,
    outbound: Vec<String>,
    counter: Arc<AtomicU64>,
    done: Arc<AtomicBool>,
) -> Result<Stage> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?.to_string();
    let mut outs = Vec::new();
    for o in &outbound {
        let s = TcpStream::connect(o)?;
        s.set_nodelay(true)?;
        outs.push(Arc::new(Mutex::new(s)));
    }
    let open = Arc::new(AtomicUsize::new(inbound));
    let accept = std::thread::spawn(move || {
        let mut threads = Vec::new();
        for _ in 0..inbound {
            let Ok((mut s, _)) = l.accept() else { break };
            let outs = outs.clone();
            let counter = counter.clone();
            let open = open.clone();
            let done = done.clone();
            threads.push(std::thread::spawn(move || {
                let mut buf = vec![0u8; 256 << 10];
                let mut k = 0usize;
                loop {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            if outs.is_empty() {
                                counter.fetch_add(n as u64, Ordering::Relaxed);
                            } else {
                                let o = &outs[k % outs.len()];
                                k += 1;
                                if o.lock().expect("relay lock").write_all(&buf[..n]).is_err() {
                                    break;
                                }
                            }
                        }
                    }
                }
                // The last inbound connection to close closes the outbound ones.
                if open.fetch_sub(1, Ordering::AcqRel) == 1 {
                    for o in &outs {
                        let _ = o
                            .lock()
                            .expect("relay lock")
                            .shutdown(std::net::Shutdown::Write);
                    }
                    if outs.is_empty() {
                        done.store(true, Ordering::Release);
                    }
                }
            }));
        }
        for t in threads {
            let _ = t.join();
        }
    });
    Ok(Stage {
        addr,
        threads: vec![accept],
    })
}

/// Runs the relay chain for the topology's sources and events; returns bytes/s at the last stage.
/// `hops`: 2 = sources → readout relays → builder relays (last); 3 adds a recorder relay.
pub fn relay_chain(r: &Resolved, hops: usize) -> Result<f64> {
    Ok(relay_chain_measured(r, hops)?.0)
}

/// [`relay_chain`], with the bytes that reached the last stage.
fn relay_chain_measured(r: &Resolved, hops: usize) -> Result<(f64, u64)> {
    let t = &r.topology;
    let counter = Arc::new(AtomicU64::new(0));
    let n_ru = t.readout_units.len();
    let n_bu = t.builders.len();
    let mut stages = Vec::new();
    // Last stage first, so that every relay finds its downstream listener.
    let last_done: Vec<Arc<AtomicBool>>;
    let bu_addrs: Vec<String>;
    if hops == 3 {
        let done = Arc::new(AtomicBool::new(false));
        let rec = start_stage(n_bu, vec![], counter.clone(), done.clone())?;
        let rec_addr = rec.addr.clone();
        stages.push(rec);
        let mut addrs = Vec::new();
        for _ in 0..n_bu {
            let s = start_stage(
                n_ru,
                vec![rec_addr.clone()],
                counter.clone(),
                Arc::new(AtomicBool::new(false)),
            )?;
            addrs.push(s.addr.clone());
            stages.push(s);
        }
        bu_addrs = addrs;
        last_done = vec![done];
    } else {
        let mut addrs = Vec::new();
        let mut dones = Vec::new();
        for _ in 0..n_bu {
            let d = Arc::new(AtomicBool::new(false));
            let s = start_stage(n_ru, vec![], counter.clone(), d.clone())?;
            addrs.push(s.addr.clone());
            dones.push(d);
            stages.push(s);
        }
        bu_addrs = addrs;
        last_done = dones;
    }
    let mut ru_addrs = Vec::new();
    for (i, _) in t.readout_units.iter().enumerate() {
        let s = start_stage(
            r.ru_sources[i].len(),
            bu_addrs.clone(),
            counter.clone(),
            Arc::new(AtomicBool::new(false)),
        )?;
        ru_addrs.push(s.addr.clone());
        stages.push(s);
    }
    let plan = SourcePlan {
        settings: t.sources.clone(),
        pattern: Pattern::from_name(&t.sources.pattern).unwrap_or_default(),
        max_payload: t.run.max_fragment_size.0 as usize,
        sources: r
            .emulated_sources()
            .map(|s| (s, ru_addrs[r.source_ru[&s]].clone()))
            .collect(),
        injections: Vec::new(),
        events: t.run.events,
        start_held: false,
        veto: false,
        scenario: None,
        size_histogram: None,
        listening: Vec::new(),
        unit_of: Default::default(),
        replay: None,
    };
    let t0 = Instant::now();
    let src = tessera_source::start(plan)?;
    while !last_done.iter().all(|d| d.load(Ordering::Acquire)) {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let secs = t0.elapsed().as_secs_f64();
    src.join();
    for s in stages {
        for th in s.threads {
            let _ = th.join();
        }
    }
    let moved = counter.load(Ordering::Relaxed);
    Ok((moved as f64 / secs, moved))
}

fn run_request(a: &BenchArgs) -> Result<()> {
    use request::{fit, measure, plan, Mix};
    let events = a.events.unwrap_or(if a.quick { 30_000 } else { 100_000 });
    let single = a.roi_fraction.is_some()
        || a.full_fraction.is_some()
        || a.roi_size.is_some()
        || a.generator;
    let mixes: Vec<Mix> = if single {
        a.sizes
            .clone()
            .unwrap_or_else(|| vec![1600])
            .into_iter()
            .map(|s| Mix {
                fragment_size: s,
                links: a.links,
                roi_fraction: a.roi_fraction.unwrap_or(0.0),
                roi_size: a.roi_size.unwrap_or(4),
                full_fraction: a.full_fraction.unwrap_or(1.0),
                generator: a.generator,
            })
            .collect()
    } else {
        plan(a.quick, a.links)
    };
    for m in &mixes {
        if !(0.0..=1.0).contains(&m.roi_fraction) || !(0.0..=1.0).contains(&m.full_fraction) {
            anyhow::bail!("--roi-fraction and --full-fraction are fractions in [0, 1]");
        }
    }
    if !a.json {
        eprintln!(
            "tessera bench request: {} mixes, {events} events each, one readout unit with {} links (machine: {} cores)",
            mixes.len(),
            a.links,
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        println!(
            "{:>6} {:>5} {:>6} {:>4} {:>6} {:>11} {:>11} {:>12} {:>9} {:>5} {:>9}",
            "words",
            "links",
            "RoI",
            "k",
            "full",
            "clears/s",
            "requests/s",
            "transfers/s",
            "MB/s",
            "clean",
            "input"
        );
    }
    let mut points = Vec::new();
    for m in &mixes {
        let p = measure(m, events)?;
        if a.json {
            println!("{}", serde_json::to_string(&p)?);
        } else {
            println!(
                "{:>6} {:>5} {:>6.2} {:>4} {:>6.2} {:>11.0} {:>11.0} {:>12.0} {:>9.1} {:>5} {:>9}",
                p.fragment_words,
                p.links,
                p.roi_fraction,
                p.roi_size,
                p.full_fraction,
                p.clear_rate_hz,
                p.external_requests_per_s,
                p.internal_transfers_per_s,
                p.kb_per_s / 1000.0,
                if p.clean { "yes" } else { "NO" },
                p.input
            );
            if p.input == "generator" {
                println!(
                    "       (generated in the unit: the generator's own thread used {:.2} CPU-s of the point; target at 24 links x 400 words, full build: >= 100 000 clears/s)",
                    p.generator_cpu_s
                );
            }
            if p.unit_cpu_s > 0.0 {
                println!(
                "       (the unit's own threads: {:.2} CPU-s, {:.1} us per clear: {:.0} clears/s per core of its own)",
                p.unit_cpu_s,
                p.unit_cpu_us_per_clear,
                1e6 / p.unit_cpu_us_per_clear.max(1e-9)
            );
            }
        }
        points.push(p);
    }
    if let Some(f) = fit(&points) {
        let design = Mix {
            fragment_size: 1600,
            links: a.links,
            roi_fraction: 0.0,
            roi_size: 4,
            full_fraction: 1.0,
            generator: false,
        };
        if a.json {
            println!(
                "{}",
                serde_json::json!({"fit": f, "predicted_full_build_400_words_hz": f.predict_hz(&design)})
            );
        } else {
            println!(
                "fit of eq. 7.2, costs >= 0 (effective cost, us): per external request {:.3}, per internal transfer {:.3}, per clear {:.3}, per kB {:.3}{}",
                f.t_external_us,
                f.t_internal_us,
                f.t_clear_us,
                f.t_per_kb_us,
                if f.at_zero.is_empty() {
                    String::new()
                } else {
                    format!(" (held at 0 by the constraint: {})", f.at_zero.join(", "))
                }
            );
            let r: Vec<String> = f.residuals.iter().map(|x| format!("{x:+.3}")).collect();
            println!(
                "residuals (1 - fitted utilisation per point): {}",
                r.join(" ")
            );
            println!(
                "predicted maximum clear rate, {} links of 400 words, full build 100 %: {:.0} Hz",
                a.links,
                f.predict_hz(&design)
            );
        }
    } else if !a.json {
        println!("(fewer than 4 points: no fit)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn bytes_are_a_number_or_a_size_with_its_unit() {
        assert_eq!(super::parse_bytes("2e9"), Ok(2e9));
        assert_eq!(super::parse_bytes("4GB"), Ok(4e9));
        assert_eq!(super::parse_bytes("600 MiB"), Ok(600.0 * 1048576.0));
        assert!(super::parse_bytes("0").is_err());
        assert!(super::parse_bytes("-5").is_err());
        assert!(super::parse_bytes("lots").is_err());
    }
}

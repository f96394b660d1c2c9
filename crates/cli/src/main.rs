//! The `tessera` command. Thin on purpose: it parses arguments and calls the crates that do the
//! work (`tessera-run`, `tessera-verify`, `tessera-bench`, `tessera-monitor`).

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

mod control;
mod fault;
mod ship;

#[derive(Parser)]
#[command(
    name = "tessera",
    version,
    about = "Event building over TCP/IP: sources, readout units, builders, recorder"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// Log lines on stderr as text (colours only on a terminal) or as one JSON object per line
    /// (time, level, target, fields: for log shippers). Which lines: TESSERA_LOG (default warn).
    #[arg(
        long,
        global = true,
        value_enum,
        env = "TESSERA_LOG_FORMAT",
        default_value = "text"
    )]
    log_format: LogFormat,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a topology (no CONFIG: the built-in demo: 8 sources, 2 readout units, 2 builders).
    Run(control::RunArgs),
    /// The run database: list runs, show one, set a run's comment.
    Runs {
        #[command(subcommand)]
        cmd: Option<RunsCmd>,
        /// Data directory holding the run database (runs.sqlite).
        #[arg(long, default_value = "data", global = true)]
        data: PathBuf,
        #[arg(long, global = true)]
        json: bool,
    },
    /// Run one role of a topology as its own process: a per-role daemon, for many hosts. Peers
    /// are reached at the `listen` addresses of the topology, which then need fixed ports.
    Serve {
        /// `recorder`, `builder`, `readout`, `sources` (all the emulated sources) or `manager`
        /// (the event manager, request mode).
        role: String,
        /// Topology file (TOML), the same for every process of the run.
        config: PathBuf,
        /// ID of the builder or readout unit to run.
        #[arg(long)]
        id: Option<u32>,
        /// Run number (overrides run.number; every process of a run needs the same one).
        #[arg(long)]
        run: Option<u64>,
        /// Stop after this many triggers (sources; overrides run.events).
        #[arg(long)]
        events: Option<u64>,
        /// Stop after this many seconds (overrides run.duration_s).
        #[arg(long)]
        duration: Option<f64>,
        /// Output directory (overrides run.output).
        #[arg(long)]
        output: Option<PathBuf>,
        /// Print this role's report as JSON on stdout instead of the summary.
        #[arg(long)]
        json: bool,
        /// No live status line.
        #[arg(long)]
        quiet: bool,
    },
    /// The node agent of one host of a run spread over hosts (`[hosts]` in the topology): runs
    /// whatever roles the run control gives this host, run after run. Keep it running with
    /// systemd (deploy/systemd/tessera-node.service), OpenSSH or Kubernetes (deploy/).
    Node {
        /// Address to listen on for the run control (the host's `[hosts]` entry).
        #[arg(long, default_value = "0.0.0.0:7300")]
        listen: String,
        /// The run control's token (better: the environment variable TESSERA_TOKEN).
        #[arg(long, env = "TESSERA_TOKEN", hide_env_values = true)]
        token: String,
        /// Output directory for this host's files (overrides run.output).
        #[arg(long)]
        output: Option<PathBuf>,
        /// Serve this host's `/metrics` here (e.g. `0.0.0.0:9300`); the run control lists it
        /// for Prometheus. Default: not served.
        #[arg(long)]
        metrics: Option<String>,
        /// This agent's certificate chain (PEM): with --tls-key, it speaks TLS only, and the
        /// run control trusts it through `security.agents_ca`. The certificate must hold the
        /// name or address the agent has in `[hosts]`.
        #[arg(long, requires = "tls_key")]
        tls_certificate: Option<PathBuf>,
        /// The private key (PEM) of --tls-certificate.
        #[arg(long, requires = "tls_certificate")]
        tls_key: Option<PathBuf>,
    },
    /// Start the node agent of every host of the topology's `[hosts]` that has none running,
    /// over OpenSSH (the token is handed over on the agent's standard input).
    Launch {
        /// Topology file with `[hosts]`.
        config: PathBuf,
        /// The ssh command and its options.
        #[arg(long, default_value = "ssh -o BatchMode=yes")]
        ssh: String,
        /// The `tessera` binary on the hosts.
        #[arg(long, default_value = "tessera")]
        binary: String,
        /// The agents' output directory (overrides run.output).
        #[arg(long)]
        output: Option<String>,
        /// Each agent's log file on its host.
        #[arg(long, default_value = "/tmp/tessera-node.log")]
        log: String,
        /// The run control's token (better: the environment variable TESSERA_TOKEN).
        #[arg(long, env = "TESSERA_TOKEN", hide_env_values = true)]
        token: String,
        /// Each agent's certificate on its host, for TLS (`{host}`: the host's name in
        /// `[hosts]`, e.g. `/etc/tessera/{host}.pem`); the run control then needs
        /// `security.agents_ca`.
        #[arg(long, requires = "tls_key")]
        tls_certificate: Option<String>,
        /// Each agent's private key on its host (`{host}` as for --tls-certificate).
        #[arg(long, requires = "tls_certificate")]
        tls_key: Option<String>,
    },
    /// Check recorded files: checksums, counts, every fragment present or flagged, payloads.
    /// With --db, check a shipper's destination against the run database: every file the
    /// database lists is read back from the destination and must be the file the recorder
    /// wrote (size, file CRC, intact trailer), or still be waiting in the data directory.
    Verify {
        /// Files or directories (every *.tsr inside); with --db also `s3://bucket/prefix` or
        /// `ssh://[user@]host[:port]/path` (as `tessera ship run --to` takes them).
        #[arg(required = true)]
        paths: Vec<String>,
        /// The run database (`runs.sqlite`, or the data directory that holds it).
        #[arg(long)]
        db: Option<PathBuf>,
        /// Only this run's files (with --db).
        #[arg(long, requires = "db")]
        run: Option<u64>,
        #[arg(long)]
        json: bool,
    },
    /// Close what a crash left open in an output directory: every unfinished file (`.part`) is
    /// rewritten under its final name with the whole blocks it holds (sidecar marked
    /// `recovered`), and runs the run database still calls running are closed as crashed.
    /// `tessera run` does this by itself when it starts on the directory.
    Recover {
        /// The output directory (`run.output`).
        dir: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Show the events of a file.
    Dump {
        file: PathBuf,
        /// Events to show (0: all).
        #[arg(long, default_value_t = 20)]
        events: u64,
        /// Start at this event ID.
        #[arg(long)]
        from: Option<u64>,
        /// Payload bytes to show in hex per fragment.
        #[arg(long, default_value_t = 32)]
        hex: usize,
    },
    /// Measure building throughput against a raw-TCP relay baseline on the same hops.
    Bench(tessera_bench::BenchArgs),
    /// Check a topology before anything starts: the file, free ports, buffers against rates and
    /// timeouts; print what each unit is expected to need. Exit 1 on a problem.
    Check {
        config: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Run a topology over a grid of configuration values and write a report (table, CSV,
    /// JSON, plot as SVG and PNG, HTML page): a design study as one command. Each point is a
    /// full run; its report names the bottleneck.
    Scan {
        config: PathBuf,
        /// KEY=V1,V2,...: a configuration key (dotted, `readout[0].host` for an entry of an
        /// array) and its values; several --vary run every combination, the first on the x
        /// axis, one line per value of the others.
        #[arg(long = "vary", required = true)]
        vary: Vec<tessera_scan::Vary>,
        /// KEY=VALUE set in every point (not a column of the report).
        #[arg(long = "set", value_parser = parse_set)]
        set: Vec<(String, String)>,
        /// Where the report goes.
        #[arg(long, default_value = "scan")]
        output: PathBuf,
        /// Length of each point in seconds (overrides run.duration_s).
        #[arg(long)]
        duration: Option<f64>,
        /// Triggers of each point (overrides run.events).
        #[arg(long)]
        events: Option<u64>,
        /// The plot's y axis: events_per_s, accepted_hz, built_mb_per_s or dead_time.
        #[arg(long, default_value = "events_per_s", value_parser = tessera_scan::report::Metric::parse)]
        y: tessera_scan::report::Metric,
        /// The x axis in decades.
        #[arg(long)]
        log_x: bool,
        /// Keep each point's recorded files under OUTPUT/runs (else only its report is kept).
        #[arg(long)]
        keep_data: bool,
        /// Run every point over emulated hosts (network namespaces made here, root and
        /// iproute2): each readout unit on a host of its own, its sources beside it, sending
        /// at most --front-end-link; each builder on a host of its own receiving at most
        /// --back-end-link; the run control, event manager and recorder on another.
        #[arg(long)]
        network: bool,
        /// With --network: what each readout unit's host sends, in Gb/s.
        #[arg(long, default_value_t = 1.0, requires = "network")]
        front_end_link: f64,
        /// With --network: what each builder's host receives, in Gb/s.
        #[arg(long, default_value_t = 10.0, requires = "network")]
        back_end_link: f64,
    },
    /// A seed's experiment as a sweep on this machine (comet, cms, nectarcam, atlas): the
    /// paper's figure redrawn with our points beside the ones its text publishes, the
    /// bottleneck named at each point, in a report (HTML, SVG, PNG, CSV, JSON).
    Scenario {
        /// comet, cms, nectarcam or atlas.
        #[arg(value_parser = clap::builder::PossibleValuesParser::new(tessera_scan::scenario::NAMES))]
        name: String,
        /// Fewer and shorter points: minutes, not tens of minutes.
        #[arg(long)]
        quick: bool,
        /// Where the report goes (default: scenario-NAME).
        #[arg(long)]
        output: Option<PathBuf>,
        /// Draw the report in OUTPUT again from the points it holds (after a change of the
        /// words or the figure), without running anything.
        #[arg(long)]
        replot: bool,
        /// Run over the paper's network: its hosts as network namespaces made here (root and
        /// iproute2), its links shaped to their rates with tc; the report says which.
        #[arg(long)]
        network: bool,
    },
    /// The live monitor: list stations and consumers, tail events, change stations.
    Monitor(tessera_monitor::console::MonitorArgs),
    /// Ship finished files to permanent storage and verify every copy; or show the backlog.
    #[command(subcommand)]
    Ship(ship::ShipCmd),
    /// Rehearse a fault in a running run (time-boxed, kept with who asked): a source's
    /// corruption, skip, delay or disconnect, a slow recorder disk.
    Fault(fault::FaultArgs),
}

#[derive(Subcommand)]
enum RunsCmd {
    /// The most recent runs (the default).
    List {
        #[arg(long, default_value_t = 20)]
        limit: usize,
    },
    /// Everything about one run: configuration, counts, rejections, files and checksums, actions.
    Show { number: u64 },
    /// Set a run's comment (its title in the run list).
    Comment { number: u64, text: String },
    /// Add a note to a run (kept with the time and who wrote it, beside its start and stop
    /// comments).
    Note {
        number: u64,
        text: String,
        /// Who writes it (default: $USER).
        #[arg(long)]
        operator: Option<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = || {
        tracing_subscriber::EnvFilter::try_from_env("TESSERA_LOG").unwrap_or_else(|_| "warn".into())
    };
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer as _;
    // Two readers of every event: the terminal (TESSERA_LOG, default warn) and the message log
    // (INFO and above: what the run control shows and keeps per run, whatever the terminal).
    let book =
        tessera_node::logbook::Layer.with_filter(tracing_subscriber::filter::LevelFilter::INFO);
    let registry = tracing_subscriber::registry().with(book);
    match cli.log_format {
        LogFormat::Text => {
            use std::io::IsTerminal;
            // Colour codes only where a terminal shows them, never in a pipe or a file.
            registry
                .with(
                    tracing_subscriber::fmt::layer()
                        .with_ansi(std::io::stderr().is_terminal())
                        .with_writer(std::io::stderr)
                        .with_filter(filter()),
                )
                .init()
        }
        LogFormat::Json => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_writer(std::io::stderr)
                    .with_filter(filter()),
            )
            .init(),
    }
    match real_main(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// Ctrl-C ends a scan or scenario after the point that is running, with its report written
/// and its emulated hosts taken down (a second Ctrl-C is the same request).
fn interruptible() {
    let _ = ctrlc::set_handler(|| {
        tessera_scan::INTERRUPTED.store(true, Ordering::Relaxed);
    });
}

/// The last line of a scan or scenario, and its exit code: 1 when a point failed (the report
/// lists it), 130 when it was interrupted.
fn sweep_done(what: &str, points: &[tessera_scan::Point], output: &std::path::Path) -> ExitCode {
    let failed = points.iter().filter(|p| !p.ok).count();
    eprintln!(
        "{what}: {} points, {failed} failed; report in {}",
        points.len(),
        output.join("index.html").display()
    );
    if tessera_scan::INTERRUPTED.load(Ordering::Relaxed) {
        ExitCode::from(130)
    } else if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// This host's calibration for the capacity model, if `tessera bench calibrate` stored one;
/// said on the terminal either way, since the report then has the model's line or not.
fn calibration() -> Option<tessera_config::capacity::Calibration> {
    let path = tessera_config::capacity::default_path()?;
    if !path.exists() {
        eprintln!(
            "no calibration at {}: the report has no capacity model (tessera bench calibrate)",
            path.display()
        );
        return None;
    }
    match tessera_config::capacity::load(&path) {
        Ok(c) => {
            eprintln!("capacity model from the calibration {}", path.display());
            Some(c)
        }
        Err(e) => {
            eprintln!("calibration not used: {e}");
            None
        }
    }
}

fn parse_set(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected KEY=VALUE"))?;
    Ok((k.trim().to_string(), v.trim().to_string()))
}

#[allow(clippy::too_many_arguments)]
fn run_topology(
    resolved: tessera_config::Resolved,
    only: Option<tessera_run::Role>,
    events: Option<u64>,
    duration: Option<f64>,
    output: Option<PathBuf>,
    json: bool,
    quiet: bool,
) -> Result<ExitCode> {
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        // The first Ctrl-C drains; a second one exits at once.
        ctrlc::set_handler(move || {
            if stop.swap(true, Ordering::Relaxed) {
                std::process::exit(130);
            }
            eprintln!("\nstopping: draining what is in flight (Ctrl-C again to abort)");
        })
        .context("installing the Ctrl-C handler")?;
    }
    let opts = tessera_run::Options {
        events,
        duration_s: duration,
        output,
        status: if quiet {
            tessera_run::StatusMode::Off
        } else {
            tessera_run::StatusMode::Auto
        },
        stop,
        only,
        // One process of several writes no manifest: the run's balance needs them all.
        manifest: only.is_none(),
        ..Default::default()
    };
    if !json && !quiet {
        match only {
            None => eprintln!("tessera: running {}", resolved.origin),
            Some(role) => eprintln!("tessera: serving {role:?} of {}", resolved.origin),
        }
    }
    let report = tessera_run::run(&resolved, &opts)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.summary());
    }
    Ok(if report.ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn real_main(cli: Cli) -> Result<ExitCode> {
    if matches!(cli.cmd, Cmd::Runs { .. } | Cmd::Dump { .. }) {
        // Commands that only print end quietly when their reader stops reading (`| head`), as
        // any Unix filter does. Only these: on the data path a peer that closes its socket is
        // an error to count and report, never a signal that kills the process.
        // SAFETY: setting a signal's disposition to its default has no preconditions.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    match cli.cmd {
        Cmd::Run(mut a) => {
            if let Some(m) = a.monitor.take() {
                a.sets.push(format!("monitor.listen={m:?}"));
            }
            control::run(a)
        }
        Cmd::Runs { cmd, data, json } => control::runs(cmd, &data, json),
        Cmd::Serve {
            role,
            config,
            id,
            run,
            events,
            duration,
            output,
            json,
            quiet,
        } => {
            let need_id =
                |what: &str| id.ok_or_else(|| anyhow::anyhow!("serving a {what} needs --id"));
            let role = match role.as_str() {
                "recorder" => tessera_run::Role::Recorder,
                "builder" => tessera_run::Role::Builder(need_id("builder")?),
                "readout" => tessera_run::Role::Readout(need_id("readout unit")?),
                "sources" => tessera_run::Role::Sources,
                "manager" => tessera_run::Role::EventManager,
                other => {
                    anyhow::bail!(
                        "unknown role `{other}`: recorder, builder, readout, sources or manager"
                    )
                }
            };
            let mut resolved = tessera_config::Topology::load(&config)?;
            if run.is_some() {
                resolved.topology.run.number = run;
            }
            run_topology(resolved, Some(role), events, duration, output, json, quiet)
        }
        Cmd::Node {
            listen,
            token,
            output,
            metrics,
            tls_certificate,
            tls_key,
        } => {
            let tls = match (&tls_certificate, &tls_key) {
                (Some(c), Some(k)) => Some(tessera_node::tls::server_config(c, k)?),
                _ => None,
            };
            // The roles' own checks (a monitor beyond loopback needs the token) read it here.
            std::env::set_var("TESSERA_TOKEN", &token);
            let stop = Arc::new(AtomicBool::new(false));
            {
                let stop = stop.clone();
                ctrlc::set_handler(move || stop.store(true, Ordering::Relaxed))
                    .context("installing the signal handler")?;
            }
            // Under systemd the socket may be handed over; else bind the address given.
            let listener = match tessera_net::io::inherited_listener() {
                Some(l) => l.context("the inherited socket")?,
                None => std::net::TcpListener::bind(&listen)
                    .with_context(|| format!("cannot listen on {listen}"))?,
            };
            eprintln!(
                "tessera node: waiting for the run control at {}",
                listener.local_addr()?
            );
            let published = tessera_node::metrics::Shared::default();
            let metrics = match metrics {
                Some(m) => {
                    let l = std::net::TcpListener::bind(&m)
                        .with_context(|| format!("--metrics: cannot listen on {m}"))?;
                    let server = tessera_node::metrics::serve(l, published.clone())?;
                    eprintln!("tessera node: /metrics at http://{}/metrics", server.addr);
                    Some(server)
                }
                None => None,
            };
            tessera_node::serve(
                listener,
                tessera_node::AgentOptions {
                    token,
                    output,
                    control_timeout: std::time::Duration::from_secs(10),
                    metrics: metrics.as_ref().map(|m| m.addr),
                    published,
                    trust: Default::default(),
                    tls,
                },
                stop,
            )?;
            drop(metrics);
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Launch {
            config,
            ssh,
            binary,
            output,
            log,
            token,
            tls_certificate,
            tls_key,
        } => {
            let r = tessera_config::Topology::load(&config)?;
            if r.topology.hosts.is_empty() {
                anyhow::bail!("{}: no [hosts] table: nothing to launch", r.origin);
            }
            let launched = tessera_node::launch::launch(
                &r,
                &tessera_node::launch::LaunchOptions {
                    ssh,
                    binary,
                    output,
                    log,
                    token,
                    patience: std::time::Duration::from_secs(30),
                    tls: tls_certificate.zip(tls_key),
                },
            )?;
            for l in launched {
                match l.pid {
                    Some(pid) => println!("{}: agent started at {} (pid {pid})", l.host, l.agent),
                    None => println!("{}: agent already running at {}", l.host, l.agent),
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Recover { dir, json } => {
            let _lock = tessera_control::recovery::lock_output(&dir)?;
            let db_path = dir.join("runs.sqlite");
            let db = if db_path.exists() {
                Some(tessera_rundb::RunDb::open(&db_path)?)
            } else {
                None
            };
            let closed = tessera_control::recovery::close_crashed(&dir, db.as_ref())?;
            if json {
                println!("{}", serde_json::to_string_pretty(&closed)?);
            } else {
                for r in &closed.recovered_files {
                    println!(
                        "recovered {}: {} events in {} whole blocks, {} bytes of a cut block dropped{}",
                        r.file,
                        r.events,
                        r.blocks,
                        r.dropped_bytes,
                        r.stopped_at
                            .as_ref()
                            .map(|w| format!(" ({w})"))
                            .unwrap_or_default()
                    );
                }
                for (run, events) in &closed.crashed_runs {
                    println!("run {run}: closed as crashed, {events} events in its files");
                }
                if closed.recovered_files.is_empty() && closed.crashed_runs.is_empty() {
                    println!("nothing to recover in {}", dir.display());
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Verify {
            paths,
            db,
            run,
            json,
        } => {
            let remote = |p: &String| p.starts_with("s3://") || p.starts_with("ssh://");
            let mut ok = true;
            let mut out = serde_json::Map::new();
            let local: Vec<PathBuf> = paths
                .iter()
                .filter(|p| !remote(p))
                .map(PathBuf::from)
                .collect();
            if let Some(db) = db {
                let (file, data) = if db.is_dir() {
                    (db.join("runs.sqlite"), db.clone())
                } else {
                    let data = db.parent().map_or(PathBuf::from("."), PathBuf::from);
                    (db.clone(), data)
                };
                if !file.exists() {
                    anyhow::bail!("--db {}: no run database there", file.display());
                }
                let rdb = tessera_rundb::RunDb::open(&file)
                    .with_context(|| format!("--db {}", file.display()))?;
                let mut reps = Vec::new();
                for p in &paths {
                    let d = tessera_shipper::destination(p).with_context(|| p.clone())?;
                    let rep = tessera_shipper::verify_destination(d.as_ref(), &rdb, &data, run)
                        .with_context(|| format!("verifying {p}"))?;
                    ok &= rep.ok();
                    if !json {
                        print!("{}", rep.summary());
                    }
                    reps.push(rep);
                }
                out.insert("destinations".into(), serde_json::to_value(reps)?);
            } else if local.len() < paths.len() {
                anyhow::bail!(
                    "an s3:// or ssh:// destination is checked against the run database: add --db DATA_DIR"
                );
            }
            // A directory (or file) is also read through, event by event.
            if !local.is_empty() {
                let rep = tessera_verify::verify_paths(&local)?;
                ok &= rep.ok();
                if json {
                    out.insert("files".into(), serde_json::to_value(&rep)?);
                } else {
                    print!("{}", rep.summary());
                }
            }
            if json {
                // Without --db, the report as it always was.
                let v = match out.remove("destinations") {
                    None => out.remove("files").unwrap_or_default(),
                    Some(d) => {
                        out.insert("destinations".into(), d);
                        serde_json::Value::Object(out)
                    }
                };
                println!("{}", serde_json::to_string_pretty(&v)?);
            }
            Ok(if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Cmd::Dump {
            file,
            events,
            from,
            hex,
        } => {
            tessera_verify::dump(&file, events, from, hex, &mut std::io::stdout().lock())?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench(args) => {
            tessera_bench::run(&args)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Scenario {
            name,
            quick,
            output,
            replot,
            network,
        } => {
            let sc = tessera_scan::scenario::get(&name, quick)
                .with_context(|| format!("no scenario {name}"))?;
            let output = output.unwrap_or_else(|| {
                PathBuf::from(if network {
                    format!("scenario-{name}-network")
                } else {
                    format!("scenario-{name}")
                })
            });
            let command = std::env::args().collect::<Vec<_>>().join(" ");
            eprintln!("tessera scenario {name}: {}", sc.title);
            let scan = tessera_scan::Scan {
                base: sc.base.into(),
                origin: PathBuf::from(sc.base_name),
                fixed: sc.fixed.clone(),
                varies: sc.varies.clone(),
                output: output.clone(),
                duration_s: Some(sc.duration_s),
                events: None,
                keep_data: false,
                binary: std::env::current_exe().context("finding the tessera binary")?,
                model: calibration().map(|c| (c, sc.metric)),
                network: network.then(|| sc.network.clone()),
            };
            let (points, command) = if replot {
                tessera_scan::read_points(&output)?
            } else {
                interruptible();
                (scan.run()?, command)
            };
            tessera_scan::report::write(&output, &sc.layout(command, &points, network), &points)?;
            eprintln!("{}", sc.found(&points));
            Ok(sweep_done(
                &format!("tessera scenario {name}"),
                &points,
                &output,
            ))
        }
        Cmd::Scan {
            config,
            vary,
            set,
            output,
            duration,
            events,
            y,
            log_x,
            keep_data,
            network,
            front_end_link,
            back_end_link,
        } => {
            let base = std::fs::read_to_string(&config)
                .with_context(|| format!("reading {}", config.display()))?;
            let command = std::env::args().collect::<Vec<_>>().join(" ");
            let scan = tessera_scan::Scan {
                base,
                origin: config.clone(),
                fixed: set,
                varies: vary,
                output: output.clone(),
                duration_s: duration,
                events,
                keep_data,
                binary: std::env::current_exe().context("finding the tessera binary")?,
                model: calibration().map(|c| (c, y)),
                network: network
                    .then(|| {
                        tessera_scan::network::Network::front_and_back(
                            front_end_link,
                            back_end_link,
                        )
                    })
                    .transpose()?,
            };
            interruptible();
            let points = scan.run()?;
            let layout = tessera_scan::report::Layout {
                title: format!(
                    "tessera scan of {}{}",
                    config.display(),
                    if network { ", over emulated hosts" } else { "" }
                ),
                command,
                x_key: None,
                x_label: None,
                x_scale: 1.0,
                metric: y,
                log_x,
                paper: Vec::new(),
                notes: Vec::new(),
                predicted: points.iter().any(|p| p.predicted.is_some()),
            };
            tessera_scan::report::write(&output, &layout, &points)?;
            Ok(sweep_done("tessera scan", &points, &output))
        }
        Cmd::Check { config, json } => {
            let resolved = tessera_config::Topology::load(&config)?;
            let rep = tessera_run::check::check(&resolved);
            if json {
                println!("{}", serde_json::to_string_pretty(&rep)?);
            } else {
                print!("{}", rep.summary());
            }
            Ok(if rep.ok() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Cmd::Monitor(args) => {
            tessera_monitor::console::run(&args)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Fault(a) => fault::run(a).map(|()| ExitCode::SUCCESS),
        Cmd::Ship(cmd) => {
            let stop = Arc::new(AtomicBool::new(false));
            let s = stop.clone();
            ctrlc::set_handler(move || s.store(true, Ordering::Relaxed))
                .context("installing the signal handler")?;
            ship::run(cmd, &stop)
        }
    }
}

//! `tessera run` through the run control, and `tessera runs`.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tessera_control::controller::{ControlOptions, Controller};
use tessera_control::state::{State, Transition};

/// `tessera run`'s arguments.
#[derive(clap::Args)]
pub struct RunArgs {
    /// Topology file (TOML); see docs/configuration.md.
    pub config: Option<PathBuf>,
    /// Stop after this many triggers (overrides run.events).
    #[arg(long)]
    pub events: Option<u64>,
    /// Stop after this many seconds (overrides run.duration_s).
    #[arg(long)]
    pub duration: Option<f64>,
    /// Output directory (overrides run.output).
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Print the run report as JSON on stdout instead of the summary.
    #[arg(long)]
    pub json: bool,
    /// No live status line.
    #[arg(long)]
    pub quiet: bool,
    /// Address of the HTTP service (dashboard, API, /metrics), or `off` (overrides
    /// control.listen; the environment variable TESSERA_HTTP does too).
    #[arg(long)]
    pub http: Option<String>,
    /// Run control mode: configure, then wait for start/pause/resume/stop from the dashboard
    /// or the API; stay up across runs until Ctrl-C.
    #[arg(long)]
    pub control: bool,
    /// The operator's comment for the run, kept in the run database.
    #[arg(long)]
    pub comment: Option<String>,
    /// Where consumers reach the monitor (overrides monitor.listen; `127.0.0.1:0` takes a
    /// free port, written to monitor.addr in the output directory).
    #[arg(long)]
    pub monitor: Option<String>,
    /// Set any key of the topology, as `KEY=VALUE` (`sources.rate_hz=2000`,
    /// `builder[1].event_timeout_ms=8000`); repeatable, applied in order, after the file is
    /// read and before it is checked.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
}

const WHO: &str = "command line";

pub fn run(a: RunArgs) -> Result<ExitCode> {
    let interrupt = Arc::new(AtomicBool::new(false));
    let quit = Arc::new(AtomicBool::new(false));
    {
        let interrupt = interrupt.clone();
        let quit = quit.clone();
        // The first Ctrl-C stops the run (draining in stages); a second one exits at once.
        ctrlc::set_handler(move || {
            if quit.swap(true, Ordering::Relaxed) {
                std::process::exit(130);
            }
            interrupt.store(true, Ordering::Relaxed);
            eprintln!("\nstopping: draining what is in flight (Ctrl-C again to abort)");
        })
        .context("installing the Ctrl-C handler")?;
    }
    let status = if a.quiet || a.json {
        tessera_run::StatusMode::Off
    } else {
        tessera_run::StatusMode::Auto
    };
    let ctl = Controller::new(
        ControlOptions {
            config: a.config.clone(),
            events: a.events,
            duration_s: a.duration,
            output: a.output.clone(),
            status: Some(status),
            sets: a.sets.clone(),
        },
        interrupt.clone(),
    );
    ctl.request(Transition::Configure, WHO, None)?;
    let resolved = ctl.resolved().context("configured")?;
    let t = &resolved.topology;
    let listen = a
        .http
        .clone()
        .or_else(|| std::env::var("TESSERA_HTTP").ok())
        .unwrap_or_else(|| t.control.listen.clone());
    let token = t.control.effective_token();
    let _http = if listen.is_empty() || listen == "off" {
        None
    } else {
        let server = tessera_control::http::serve(ctl.clone(), &listen, token)?;
        // Clients of a run on an ephemeral port find it here.
        let addr_file = t.run.output.join("control.addr");
        std::fs::write(&addr_file, format!("{}\n", server.addr))
            .with_context(|| format!("writing {}", addr_file.display()))?;
        if !a.quiet && !a.json {
            eprintln!(
                "control: dashboard and API at {}://{} (metrics at /metrics)",
                if t.control.tls_certificate.is_some() {
                    "https"
                } else {
                    "http"
                },
                server.addr
            );
        }
        Some(server)
    };
    if a.control {
        // Configured only: the run starts when the operator says so.
        if !a.quiet && !a.json {
            eprintln!("tessera: configured {}", resolved.origin);
            eprintln!("run control mode: start, pause, resume and stop from the dashboard or the API; Ctrl-C to leave");
        }
        // Each run's summary (or report, with --json) as it ends, as a single run prints it.
        let mut said = ctl.last_report();
        let say = |said: &mut Option<Arc<tessera_run::report::Report>>| {
            let now = ctl.last_report();
            if let Some(r) = &now {
                if !said.as_ref().is_some_and(|s| Arc::ptr_eq(s, r)) {
                    if a.json {
                        if let Ok(j) = serde_json::to_string(&**r) {
                            println!("{j}");
                        }
                    } else {
                        print!("{}", r.summary());
                    }
                }
            }
            *said = now;
        };
        while !quit.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(50));
            say(&mut said);
        }
        // A run still open stops by the interrupt; wait for it to finish its stop.
        let end = ctl.wait_for(
            &[
                State::Stopped,
                State::Error,
                State::Configured,
                State::Initial,
            ],
            None,
        );
        say(&mut said);
        ctl.close();
        return Ok(if end == State::Error {
            ExitCode::from(1)
        } else {
            ExitCode::SUCCESS
        });
    }
    ctl.request(Transition::Start, WHO, a.comment.as_deref())?;
    if !a.quiet && !a.json {
        eprintln!("tessera: running {}", resolved.origin);
    }
    let end = ctl.wait_for(&[State::Stopped, State::Error], None);
    let leave = || {
        if let Some(s) = ctl.shipper() {
            drain_at_exit(&s, t.shipper.drain_at_exit_s, &quit, a.quiet || a.json);
        }
        ctl.close();
    };
    let Some(report) = ctl.last_report() else {
        leave();
        bail!(
            "the run ended in error: {}",
            ctl.view().error.unwrap_or_default()
        );
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&*report)?);
    } else {
        print!("{}", report.summary());
    }
    // The run's files ship while its summary is read.
    leave();
    if end == State::Error {
        eprintln!("error: {}", ctl.view().error.unwrap_or_default());
        return Ok(ExitCode::from(1));
    }
    Ok(if report.ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// One run and out: the shipper gets `limit` seconds to ship what the run wrote (Ctrl-C cuts it
/// short); what is left is said, and ships at the next start or with `tessera ship run`.
fn drain_at_exit(s: &tessera_shipper::ShipperService, limit: f64, quit: &AtomicBool, quiet: bool) {
    let mut last = std::time::Instant::now();
    let drained = s.drain(Duration::from_secs_f64(limit), |st| {
        if !quiet && last.elapsed() >= Duration::from_secs(1) {
            eprintln!("shipper: {}", st.line());
            last = std::time::Instant::now();
        }
        !quit.load(Ordering::Relaxed)
    });
    let st = s.status();
    if drained {
        if !quiet {
            eprintln!(
                "shipper: every file verified at {} ({} copies this session{})",
                st.destinations.join(", "),
                st.verified,
                if st.deleted > 0 {
                    format!(", {} local files deleted", st.deleted)
                } else {
                    String::new()
                }
            );
        }
    } else {
        eprintln!(
            "shipper: {} files ({:.1} MB) not yet verified at every destination{}; they ship at the next start, or now with `tessera ship run {} --to …`",
            st.backlog_files,
            st.backlog_bytes as f64 / 1e6,
            st.last_error
                .as_deref()
                .map_or(String::new(), |e| format!(" (last failure: {e})")),
            s.dir().display()
        );
    }
}

pub fn runs(cmd: Option<crate::RunsCmd>, data: &Path, json: bool) -> Result<ExitCode> {
    let path = data.join("runs.sqlite");
    if !path.exists() {
        bail!(
            "no run database at {} (runs started by `tessera run` are kept there; --data DIR names another data directory)",
            path.display()
        );
    }
    let cmd = cmd.unwrap_or(crate::RunsCmd::List { limit: 20 });
    // Reading needs no write: `runs list` and `runs show` answer on a full disk.
    let db = if matches!(
        cmd,
        crate::RunsCmd::Comment { .. } | crate::RunsCmd::Note { .. }
    ) {
        tessera_rundb::RunDb::open(&path)?
    } else {
        tessera_rundb::RunDb::open_read_only(&path)?
    };
    match cmd {
        crate::RunsCmd::List { limit } => {
            let runs = db.list(limit)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&runs)?);
            } else {
                println!(
                    "{:>6}  {:<8} {:<20} {:>9} {:>10} {:>10} {:>10}  {:<8} {:<14} comment",
                    "run",
                    "state",
                    "started (UTC)",
                    "duration",
                    "events",
                    "incomplete",
                    "bytes",
                    "balance",
                    "stop"
                );
                for r in runs {
                    let dur = r
                        .stopped_unix_ns
                        .map(|s| {
                            format!("{:.1}s", (s.saturating_sub(r.started_unix_ns)) as f64 / 1e9)
                        })
                        .unwrap_or_else(|| "-".into());
                    println!(
                        "{:>6}  {:<8} {:<20} {:>9} {:>10} {:>10} {:>10}  {:<8} {:<14} {}",
                        r.number,
                        r.state,
                        utc(r.started_unix_ns),
                        dur,
                        r.events,
                        r.incomplete,
                        tessera_run::report::human_bytes(r.bytes as f64),
                        match r.balance_holds {
                            Some(true) => "holds",
                            Some(false) => "BROKEN",
                            None => "-",
                        },
                        r.stop_reason.unwrap_or_default(),
                        r.comment
                    );
                }
            }
        }
        crate::RunsCmd::Show { number } => {
            let r = db.get(number)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                let s = &r.summary;
                println!("run {}: {}", s.number, s.state);
                println!(
                    "  configuration  {} (sha256 {})",
                    s.config_origin, r.config_sha256
                );
                println!("  started        {}", utc(s.started_unix_ns));
                if let Some(t) = s.stopped_unix_ns {
                    println!(
                        "  stopped        {} ({})",
                        utc(t),
                        s.stop_reason.clone().unwrap_or_default()
                    );
                }
                if let Some(e) = &s.error {
                    println!("  error          {e}");
                }
                println!("  comment        {}", s.comment);
                for n in &r.notes {
                    println!(
                        "  note           {} {} ({}): {}",
                        utc(n.unix_ns),
                        n.who,
                        n.kind,
                        n.text
                    );
                }
                for f in &r.faults {
                    println!(
                        "  fault          {} {} {}: {}",
                        utc(f.unix_ns),
                        f.who,
                        f.fault,
                        f.result
                    );
                }
                for a in &r.alarm_actions {
                    println!(
                        "  alarm action   {} {} {} {} {}{}",
                        utc(a.unix_ns),
                        a.who,
                        a.action,
                        a.alarm,
                        a.subject,
                        a.until_unix_ns
                            .map(|u| format!(" until {}", utc(u)))
                            .unwrap_or_default()
                    );
                }
                println!(
                    "  events         {} ({} incomplete), {} built, {} recorded in files",
                    s.events,
                    s.incomplete,
                    tessera_run::report::human_bytes(s.bytes as f64),
                    s.recorded_events
                );
                // The sources named missing in the incomplete events, from every builder's
                // part of the report: where an operator looks first.
                let mut missing: std::collections::BTreeMap<u64, u64> = Default::default();
                for b in r
                    .report
                    .as_ref()
                    .and_then(|x| x["builders"].as_array())
                    .into_iter()
                    .flatten()
                {
                    for (src, n) in b["missing_by_source"].as_object().into_iter().flatten() {
                        if let (Ok(src), Some(n)) = (src.parse::<u64>(), n.as_u64()) {
                            *missing.entry(src).or_default() += n;
                        }
                    }
                }
                if !missing.is_empty() {
                    let v: Vec<String> = missing
                        .iter()
                        .map(|(src, n)| format!("source {src}: {n}"))
                        .collect();
                    println!(
                        "  missing        {} (incomplete events by missing source)",
                        v.join(", ")
                    );
                }
                if !r.rejected.is_empty() {
                    let v: Vec<String> =
                        r.rejected.iter().map(|(k, n)| format!("{k} {n}")).collect();
                    println!("  rejected       {}", v.join(", "));
                }
                for f in &r.files {
                    println!(
                        "  file           {}  {} events  {}  crc32c {}",
                        f.name,
                        f.events,
                        tessera_run::report::human_bytes(f.size_bytes as f64),
                        f.crc32c
                    );
                }
                for a in &r.actions {
                    println!(
                        "  action         {} {} by {}: {} -> {} ({})",
                        utc(a.unix_ns),
                        a.action,
                        a.who,
                        a.from_state,
                        a.to_state,
                        a.result
                    );
                }
                let said = |lvl: &str| r.log.iter().filter(|l| l.level == lvl).count();
                println!(
                    "  log            {} lines ({} errors, {} warnings); the errors and warnings:",
                    r.log.len(),
                    said("ERROR"),
                    said("WARN")
                );
                for l in r.log.iter().filter(|l| l.level != "INFO") {
                    println!(
                        "    {} {:5} {} {}: {}",
                        utc(l.unix_ns),
                        l.level,
                        l.host,
                        l.role,
                        l.message
                    );
                }
                println!("  (the full configuration and log: tessera runs show {number} --json)");
            }
        }
        crate::RunsCmd::Note {
            number,
            text,
            operator,
        } => {
            let who = operator
                .or_else(|| std::env::var("USER").ok())
                .unwrap_or_else(|| "unknown".into());
            db.add_note(
                number,
                &tessera_rundb::NoteRow {
                    unix_ns: tessera_control::controller::unix_ns(),
                    who: who.clone(),
                    kind: "note".into(),
                    text,
                },
            )?;
            println!("note added to run {number} by {who}");
        }
        crate::RunsCmd::Comment { number, text } => {
            db.set_comment(number, &text)?;
            let user = std::env::var("USER").unwrap_or_else(|_| "unknown".into());
            db.log_action(&tessera_rundb::ActionRow {
                unix_ns: tessera_control::controller::unix_ns(),
                who: format!("{user} (tessera runs comment)"),
                action: "comment".into(),
                from_state: "-".into(),
                to_state: "-".into(),
                result: "ok".into(),
                run: Some(number),
            })?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `YYYY-MM-DD HH:MM:SS` in UTC, from Unix nanoseconds (civil-from-days).
fn utc(ns: u64) -> String {
    let secs = ns / 1_000_000_000;
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + (m <= 2) as i64;
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

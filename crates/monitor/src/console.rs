//! `tessera monitor`: the monitor from a terminal. Lists the stations with their rates, queue
//! depths and consumers; tails sampled events; creates, changes and removes stations.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use tessera_config::StationMode;
use tessera_format::event::EventRecordHeader;
use tessera_format::link::Fragments;
use tessera_format::monitor::Wait;

use crate::client::{command, ClientOptions, Consumer};

#[derive(Args, Debug)]
pub struct MonitorArgs {
    /// Monitor address. Default: the one in ./data/monitor.addr (written by `tessera run`), else
    /// 127.0.0.1:7711 (the demo's).
    #[arg(long, global = true)]
    pub addr: Option<String>,
    #[command(subcommand)]
    pub cmd: MonitorCmd,
}

#[derive(Subcommand, Debug)]
pub enum MonitorCmd {
    /// List the stations: mode, selection, rates, queue depth, consumers.
    Stations {
        /// Seconds between the two readings the rates come from.
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
        /// The raw status as JSON (one reading, no rates).
        #[arg(long)]
        json: bool,
    },
    /// Print events as they arrive at a station (default: `sample`).
    Tail {
        #[arg(long, default_value = "sample")]
        station: String,
        /// Stop after this many events (0: until Ctrl-C).
        #[arg(long, default_value_t = 0)]
        count: u64,
        /// Payload bytes to show in hex per fragment (0: header lines only).
        #[arg(long, default_value_t = 0)]
        hex: usize,
    },
    /// Create a station: `tessera monitor create NAME mode=sampling prescale=10 ...`.
    Create { name: String, settings: Vec<String> },
    /// Change a running station: `tessera monitor set NAME prescale=100 predicate="..."`.
    Set { name: String, settings: Vec<String> },
    /// Remove a station (its consumers are detached, its events passed on).
    Remove { name: String },
}

fn default_addr() -> String {
    std::fs::read_to_string(Path::new("data").join("monitor.addr"))
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "127.0.0.1:7711".into())
}

const TIMEOUT: Duration = Duration::from_secs(5);

fn status(addr: &str) -> Result<MonitorStatusView> {
    let v = command(addr, &serde_json::json!({"op": "status"}), TIMEOUT)?;
    serde_json::from_value(v).context("reading the monitor's status")
}

/// The status as read back from JSON (the server's `MonitorStatus`).
type MonitorStatusView = serde_json::Value;

/// Applies `key=value` settings to a station's JSON settings. Values are parsed as JSON where
/// they parse (numbers, lists), else taken as strings; `trigger_types=1,2` is a list.
fn apply(station: &mut serde_json::Value, settings: &[String]) -> Result<()> {
    for s in settings {
        let Some((k, v)) = s.split_once('=') else {
            bail!("setting {s:?}: write key=value");
        };
        let value = if k == "trigger_types" {
            let list: Result<Vec<u16>, _> = v
                .split(',')
                .filter(|x| !x.is_empty())
                .map(|x| x.trim().parse::<u16>())
                .collect();
            serde_json::json!(list.with_context(|| format!("trigger_types={v}: numbers 0..65535"))?)
        } else if v.is_empty() || v == "none" {
            serde_json::Value::Null
        } else {
            serde_json::from_str(v).unwrap_or_else(|_| serde_json::Value::String(v.into()))
        };
        station[k] = value;
    }
    Ok(())
}

pub fn run(args: &MonitorArgs) -> Result<()> {
    let addr = args.addr.clone().unwrap_or_else(default_addr);
    match &args.cmd {
        MonitorCmd::Stations { interval, json } => {
            let a = status(&addr)?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&a)?);
                return Ok(());
            }
            let t0 = Instant::now();
            std::thread::sleep(Duration::from_secs_f64(interval.max(0.05)));
            let b = status(&addr)?;
            print!("{}", stations_table(&a, &b, t0.elapsed().as_secs_f64()));
            Ok(())
        }
        MonitorCmd::Tail {
            station,
            count,
            hex,
        } => tail(&addr, station, *count, *hex),
        MonitorCmd::Create { name, settings } => {
            let mut st = serde_json::json!({ "name": name });
            apply(&mut st, settings)?;
            command(
                &addr,
                &serde_json::json!({"op": "create", "station": st}),
                TIMEOUT,
            )?;
            println!("station {name} created");
            Ok(())
        }
        MonitorCmd::Set { name, settings } => {
            let s = status(&addr)?;
            let mut st = s["stations"]
                .as_array()
                .and_then(|v| v.iter().find(|x| x["config"]["name"] == *name))
                .map(|x| x["config"].clone())
                .with_context(|| format!("no station {name:?} at {addr}"))?;
            apply(&mut st, settings)?;
            command(
                &addr,
                &serde_json::json!({"op": "set", "station": st}),
                TIMEOUT,
            )?;
            println!("station {name}: {}", serde_json::to_string(&st)?);
            Ok(())
        }
        MonitorCmd::Remove { name } => {
            command(
                &addr,
                &serde_json::json!({"op": "remove", "station": name}),
                TIMEOUT,
            )?;
            println!("station {name} removed");
            Ok(())
        }
    }
}

/// The stations table from two readings `secs` apart.
pub fn stations_table(a: &serde_json::Value, b: &serde_json::Value, secs: f64) -> String {
    let mut s = String::new();
    let n = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
    let _ = writeln!(
        s,
        "monitor instance {:016x}, up {:.0} s: {} events in ({:.0}/s), {} bad records",
        n(&b["instance"]),
        b["uptime_s"].as_f64().unwrap_or(0.0),
        n(&b["events_in"]),
        (n(&b["events_in"]).saturating_sub(n(&a["events_in"]))) as f64 / secs,
        n(&b["bad_records"]),
    );
    let _ = writeln!(
        s,
        "{:>3} {:<16} {:<9} {:<24} {:>8} {:>11} {:>10} {:>10} {:>9}",
        "pos", "station", "mode", "selection", "prescale", "queue", "in/s", "out/s", "drop/s"
    );
    let empty = Vec::new();
    let before = a["stations"].as_array().unwrap_or(&empty);
    for st in b["stations"].as_array().unwrap_or(&empty) {
        let c = &st["config"];
        let name = c["name"].as_str().unwrap_or("?");
        let old = before.iter().find(|x| x["config"]["name"] == c["name"]);
        let rate = |k: &str| {
            let now = n(&st["counters"][k]);
            let was = old.map_or(now, |o| n(&o["counters"][k]));
            now.saturating_sub(was) as f64 / secs
        };
        let mut sel = Vec::new();
        if let Some(t) = c["trigger_types"].as_array().filter(|t| !t.is_empty()) {
            sel.push(format!(
                "trigger {}",
                t.iter()
                    .map(|x| x.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            ));
        }
        if let Some(x) = c["stream"].as_str() {
            sel.push(format!("stream {x}"));
        }
        if let Some(x) = c["predicate"].as_str() {
            sel.push(x.to_string());
        }
        if sel.is_empty() {
            sel.push("all".into());
        }
        let _ = writeln!(
            s,
            "{:>3} {:<16} {:<9} {:<24} {:>8} {:>5}/{:<5} {:>10.0} {:>10.0} {:>9.0}",
            n(&st["position"]),
            name,
            c["mode"].as_str().unwrap_or("?"),
            sel.join(" && "),
            n(&c["prescale"]),
            n(&st["queue_depth"]) + n(&st["held"]),
            n(&c["queue"]),
            rate("queued"),
            rate("delivered"),
            rate("dropped_full"),
        );
        for cons in st["consumers"].as_array().unwrap_or(&empty) {
            let _ = writeln!(
                s,
                "      consumer {} {:<24} got {} put {} holding {}",
                n(&cons["id"]),
                cons["name"].as_str().unwrap_or("?"),
                n(&cons["got"]),
                n(&cons["put"]),
                n(&cons["held"])
            );
        }
    }
    s
}

use std::fmt::Write as _;

fn tail(addr: &str, station: &str, count: u64, hex: usize) -> Result<()> {
    let mut opts = ClientOptions::new(addr, station);
    opts.consumer = format!("tessera monitor tail (pid {})", std::process::id());
    let mut c = Consumer::attach(opts)?;
    let blocking = c
        .station
        .as_ref()
        .is_some_and(|s| s.mode == StationMode::Blocking);
    eprintln!(
        "attached to {station} at {addr} ({}); Ctrl-C to stop",
        if blocking {
            "blocking: events are put back"
        } else {
            "sampling"
        }
    );
    let mut out = std::io::stdout().lock();
    let mut shown = 0u64;
    let mut restarts = c.restarts;
    while count == 0 || shown < count {
        let want = if count == 0 {
            100
        } else {
            (count - shown).min(100) as u32
        };
        let events = c.get(want, Wait::Timed(1000))?;
        if c.restarts != restarts {
            restarts = c.restarts;
            writeln!(
                out,
                "-- the monitor restarted (instance {:016x}); reattached",
                c.instance
            )?;
        }
        for e in &events {
            writeln!(out, "{}", describe(e.seq, &e.record, hex))?;
            shown += 1;
        }
        out.flush()?;
        c.put(&events)?;
    }
    Ok(())
}

/// One line per event (and per fragment with `hex > 0`); never fails on a bad record.
pub fn describe(seq: u64, record: &[u8], hex: usize) -> String {
    let h = match EventRecordHeader::decode_prefix(record, record.len()) {
        Ok(Some((h, _))) => h,
        Ok(None) => return format!("#{seq}: record cut short ({} bytes)", record.len()),
        Err(e) => return format!("#{seq}: not an event record: {e}"),
    };
    let flags = h.flags.names();
    let mut s = format!(
        "#{seq} event {} trigger {} size {} fragments {}{}{}",
        h.event_id,
        h.trigger_type,
        h.record_size,
        h.fragment_count,
        if flags.is_empty() {
            String::new()
        } else {
            format!(" [{}]", flags.join(","))
        },
        if h.missing.is_empty() {
            String::new()
        } else {
            format!(" missing {:?}", h.missing)
        },
    );
    if hex > 0 {
        let body = &record[h.header_size().min(record.len())..];
        for f in Fragments::new(body) {
            match f {
                Ok(f) => {
                    let p = &body[f.payload_range()];
                    let shown: Vec<String> =
                        p.iter().take(hex).map(|b| format!("{b:02x}")).collect();
                    let _ = write!(
                        s,
                        "\n    source {} {} B: {}{}",
                        f.header.source_id,
                        p.len(),
                        shown.join(" "),
                        if p.len() > hex { " ..." } else { "" }
                    );
                }
                Err(e) => {
                    let _ = write!(s, "\n    bad fragment: {e}");
                    break;
                }
            }
        }
    }
    s
}

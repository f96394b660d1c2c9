//! Issue 14, diagnosis: each stage driven into being the bottleneck by a real cause, and the
//! name the run control gives checked in the run report (what it named while the run took data,
//! and for how long). Here the causes in one process: a slow disk (the recorder's throttle) and a
//! blocking monitor consumer that stops taking events. The CPU-starved readout unit and builder
//! are drills over hosts (`cluster.rs`): a CPU quota needs a process of its own.

mod support;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use support::{eventually, http, Proc, LIMIT};

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_tessera")
}

/// Sources as fast as back-pressure lets them, small buffers everywhere so that a slow last
/// stage holds the whole chain within a fraction of a second, samples every 100 ms.
fn topology(out: &Path, extra: &str) -> String {
    format!(
        r#"
[run]
output = "{}"
max_fragment_size = "16 KiB"
[sources]
count = 4
fragment_size = 4096
trigger = "unlimited"
[control]
sample_interval_ms = 100
[[readout]]
id = 0
sources = "0-3"
buffer = "2 MiB"
read_chunk = "128 KiB"
[[builder]]
id = 0
buffer = "4 MiB"
[recorder]
fsync = false
queue = "2 MiB"
block_size = "256 KiB"
{extra}
"#,
        out.display()
    )
}

fn start(dir: &Path, cfg: &str, args: &[&str]) -> Proc {
    let p = dir.join("topology.toml");
    std::fs::write(&p, cfg).unwrap();
    Proc::spawn(
        Command::new(exe())
            .env("TESSERA_HTTP", "127.0.0.1:0")
            .args(["run", p.to_str().unwrap(), "--quiet", "--json"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    )
}

fn finish(run: Proc) -> serde_json::Value {
    let o = run.finish(LIMIT);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// The name given longest while the run took data, and its share of that time.
fn most_named(report: &serde_json::Value) -> (String, f64) {
    let b = &report["bottlenecks"][0];
    (
        b["name"].as_str().unwrap_or_default().to_string(),
        b["share"].as_f64().unwrap_or(0.0),
    )
}

/// A disk slower than the chain before it: every stage's buffers fill back to the sources, and
/// the recorder, blocked itself, is named as held by its disk (it spends its time in write calls
/// and in the throttle that rehearses the slow disk).
#[test]
fn a_slow_disk_is_named_the_bottleneck() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = topology(&dir.path().join("data"), "throttle = \"8 MiB\"\n");
    let report = finish(start(dir.path(), &cfg, &["--duration", "4"]));
    assert_eq!(report["balance"]["holds"], true, "{report}");
    let (name, share) = most_named(&report);
    assert_eq!(name, "recorder (disk)", "{}", report["bottlenecks"]);
    assert!(share > 0.5, "{}", report["bottlenecks"]);
}

/// A consumer of a blocking station that takes its queue's worth and never puts them back: the
/// recorder waits in the monitor for room while every buffer before it fills, and the name says
/// the monitor holds it, not the disk and not its CPU. The wait counts while it lasts: the
/// recorder is inside one call for the whole stall.
#[test]
fn a_blocking_monitor_consumer_is_named_the_bottleneck() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("data");
    let cfg = topology(
        &out,
        "[monitor]\nlisten = \"127.0.0.1:0\"\n\
         [[monitor.station]]\nname = \"blocking\"\nmode = \"blocking\"\nqueue = 20\n",
    );
    let run = start(dir.path(), &cfg, &["--duration", "5"]);
    let addr_file = out.join("monitor.addr");
    assert!(
        eventually(LIMIT, || std::fs::read_to_string(&addr_file)
            .is_ok_and(|a| a.ends_with('\n'))),
        "no monitor.addr"
    );
    let addr = std::fs::read_to_string(&addr_file)
        .unwrap()
        .trim()
        .to_string();
    let mut holder = Proc::spawn(
        Command::new(exe())
            .env("TESSERA_HTTP", "127.0.0.1:0")
            .args(["bench", "monitor", "--hold-child", &addr])
            .args(["--hold-station", "blocking", "--events", "20"])
            .stdout(Stdio::piped()),
    );
    let mut line = String::new();
    BufReader::new(holder.take_stdout().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("held"), "{line:?}");
    // Held until the run stops taking data (its duration is up and the stop begins), then
    // killed, so that the stop can drain: its events go on to the recorder's file.
    let ctl = out.join("control.addr");
    assert!(eventually(LIMIT, || ctl.exists()), "no control.addr");
    let ctl = std::fs::read_to_string(&ctl).unwrap().trim().to_string();
    assert!(
        eventually(LIMIT, || {
            let (code, body) = http(&ctl, "GET", "/api/state");
            let st: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            code == 200 && (st["state"] != "running" || !st["busy"].is_null())
        }),
        "the run never began to stop"
    );
    holder.kill();
    let report = finish(run);
    assert_eq!(report["balance"]["holds"], true, "{report}");
    let (name, share) = most_named(&report);
    assert_eq!(name, "recorder (monitor)", "{}", report["bottlenecks"]);
    assert!(share > 0.5, "{}", report["bottlenecks"]);
}

//! The monitor inside a real run, with consumers as real processes: a consumer of a blocking
//! station killed with SIGKILL while it holds the data path, and sampling consumers that sleep
//! or die, which must not cost the run a single event.

mod support;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::{output, Proc, LIMIT};

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_tessera")
}

fn start_run(dir: &Path, cfg: &str) -> Proc {
    let p = dir.join("topology.toml");
    std::fs::write(&p, cfg).unwrap();
    Proc::spawn(
        Command::new(exe())
            .env("TESSERA_HTTP", "127.0.0.1:0")
            .args(["run", p.to_str().unwrap(), "--quiet", "--json"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    )
}

fn monitor_addr(out: &Path) -> String {
    let t = Instant::now();
    loop {
        if let Ok(a) = std::fs::read_to_string(out.join("monitor.addr")) {
            if a.ends_with('\n') {
                return a.trim().to_string();
            }
        }
        assert!(t.elapsed() < Duration::from_secs(60), "no monitor.addr");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A consumer process that takes `events` events from `station` (0: never asks) and then sleeps
/// until killed. Returns once it says it holds them.
fn consumer(addr: &str, station: &str, events: u32) -> Proc {
    let mut c = Proc::spawn(
        Command::new(exe())
            .env("TESSERA_HTTP", "127.0.0.1:0")
            .args([
                "bench",
                "monitor",
                "--hold-child",
                addr,
                "--hold-station",
                station,
            ])
            .args(["--events", &events.to_string()])
            .stdout(Stdio::piped()),
    );
    let mut line = String::new();
    BufReader::new(c.take_stdout().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("held"), "{line:?}");
    c
}

fn finish(run: Proc) -> serde_json::Value {
    let o = run.finish(LIMIT);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

fn station<'a>(report: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    report["monitor"]["stations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["config"]["name"] == name)
        .unwrap()
}

const BASE: &str = r#"
[run]
events = 20000
output = "OUT"
[sources]
count = 4
fragment_size = 1024
trigger = "periodic"
rate_hz = 2000
[recorder]
fsync = false
[monitor]
listen = "127.0.0.1:0"
"#;

#[test]
fn a_blocking_consumer_killed_while_holding_the_data_path_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("data");
    let cfg = BASE.replace("OUT", out.to_str().unwrap())
        + "[[monitor.station]]\nname = \"blocking\"\nmode = \"blocking\"\nqueue = 50\n";
    let run = start_run(dir.path(), &cfg);
    let addr = monitor_addr(&out);
    // It takes the station's 50 events and keeps them: the station is full, the recorder waits
    // for room, and back-pressure holds the run.
    let mut holder = consumer(&addr, "blocking", 50);
    let stalled_at = loop {
        let s = monitor_status(&addr);
        let st = &s["stations"][0];
        if st["counters"]["waits"].as_u64().unwrap() > 0 {
            break s["events_in"].as_u64().unwrap();
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(stalled_at < 20000);
    holder.kill(); // SIGKILL
    let report = finish(run);
    assert_eq!(report["recorder"]["events"], 20000);
    assert_eq!(report["balance"]["holds"], true);
    let st = station(&report, "blocking");
    // Its events went on (no other consumer to give them to), none lost, no consumer left.
    assert!(st["counters"]["passed_on"].as_u64().unwrap() >= 50, "{st}");
    assert_eq!(st["consumers"].as_array().unwrap().len(), 0);
    assert_eq!(report["monitor"]["events_in"], 20000);
}

#[test]
fn sleeping_and_dead_sampling_consumers_do_not_lower_the_recorded_count() {
    let mut recorded = Vec::new();
    for with_consumers in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("data");
        let mut cfg = BASE.replace("OUT", out.to_str().unwrap());
        for i in 0..3 {
            cfg += &format!("[[monitor.station]]\nname = \"display{i}\"\nqueue = 20\n");
        }
        let run = start_run(dir.path(), &cfg);
        let addr = monitor_addr(&out);
        let mut kids = Vec::new();
        if with_consumers {
            // Two that take a few events and then sleep for ever, one that never asks...
            kids.push(consumer(&addr, "display0", 5));
            kids.push(consumer(&addr, "display1", 5));
            kids.push(consumer(&addr, "display2", 0));
            // ...and one of the sleepers dies mid-run.
            std::thread::sleep(Duration::from_millis(500));
            kids[1].kill();
        }
        let report = finish(run);
        for mut k in kids {
            k.kill();
        }
        assert_eq!(report["balance"]["holds"], true);
        if with_consumers {
            // They really were attached and not reading: their stations filled and dropped.
            let d0 = station(&report, "display0");
            assert!(d0["counters"]["dropped_full"].as_u64().unwrap() > 0, "{d0}");
            assert_eq!(d0["consumers"].as_array().unwrap().len(), 1);
        }
        recorded.push(report["recorder"]["events"].as_u64().unwrap());
    }
    assert_eq!(recorded, vec![20000, 20000]);
}

fn monitor_status(addr: &str) -> serde_json::Value {
    let o = output(
        Command::new(exe())
            .env("TESSERA_HTTP", "127.0.0.1:0")
            .args(["monitor", "--addr", addr, "stations", "--json"]),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn monitor_subcommands_list_change_and_tail() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("data");
    let cfg = BASE.replace("OUT", out.to_str().unwrap());
    let run = start_run(dir.path(), &cfg);
    let addr = monitor_addr(&out);
    let o = output(
        Command::new(exe())
            .env("TESSERA_HTTP", "127.0.0.1:0")
            .args([
                "monitor",
                "--addr",
                &addr,
                "create",
                "calib",
                "trigger_types=2",
                "prescale=2",
            ]),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = output(
        Command::new(exe())
            .env("TESSERA_HTTP", "127.0.0.1:0")
            .args([
                "monitor",
                "--addr",
                &addr,
                "tail",
                "--station",
                "calib",
                "--count",
                "5",
                "--hex",
                "4",
            ]),
    );
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        text.lines().filter(|l| l.contains(" trigger 2 ")).count(),
        5,
        "{text}"
    );
    assert_eq!(
        text.lines().filter(|l| l.contains("    source ")).count(),
        20,
        "{text}"
    );
    let o = output(
        Command::new(exe())
            .env("TESSERA_HTTP", "127.0.0.1:0")
            .args(["monitor", "--addr", &addr, "set", "calib", "restore=next"]),
    );
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("sampling"));
    let o = output(
        Command::new(exe())
            .env("TESSERA_HTTP", "127.0.0.1:0")
            .args(["monitor", "--addr", &addr, "stations", "--interval", "0.2"]),
    );
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("calib") && text.contains("trigger 2") && text.contains("sample"),
        "{text}"
    );
    let _ = finish(run);
}

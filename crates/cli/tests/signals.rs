//! Issue 11, item 4: a run ends cleanly however the operator or the system asks it to stop.
//! SIGTERM (what systemd, Kubernetes and `kill` send) stops like Ctrl-C: drained, summarised,
//! its files finished, the run closed in the run database.

mod support;
use std::process::Command;
use std::time::Duration;
use support::{eventually, has_part, output, Proc, LIMIT};

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_tessera")
}

#[test]
fn sigterm_stops_a_run_like_ctrl_c() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("data");
    let cfg = dir.path().join("t.toml");
    std::fs::write(
        &cfg,
        "[sources]\ncount = 4\nfragment_size = 1024\ntrigger = \"periodic\"\nrate_hz = 2000\n\
         [recorder]\nfsync = false\n",
    )
    .unwrap();
    let run = Proc::spawn_piped(
        Command::new(exe())
            .env("TESSERA_HTTP", "127.0.0.1:0")
            .args([
                "run",
                cfg.to_str().unwrap(),
                "--duration",
                "600",
                "--output",
                out.to_str().unwrap(),
                "--json",
                "--quiet",
            ]),
    );
    assert!(
        eventually(Duration::from_secs(60), || has_part(&out)),
        "no data reached the recorder"
    );
    run.signal("TERM");
    let o = run.finish(LIMIT);
    assert!(
        o.status.success(),
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["balance"]["holds"], true, "{report}");
    assert_eq!(report["drained"], true, "{report}");
    assert!(report["recorder"]["events"].as_u64().unwrap() > 0);
    assert!(out.join("run000001.manifest.json").exists());
    assert!(!has_part(&out), "the open file was finished");
    let db = output(Command::new(exe()).args([
        "runs",
        "show",
        "1",
        "--data",
        out.to_str().unwrap(),
        "--json",
    ]));
    assert!(
        db.status.success(),
        "{}",
        String::from_utf8_lossy(&db.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&db.stdout).unwrap();
    assert_eq!(r["state"], "stopped", "{r}");
    assert_eq!(r["stop_reason"], "interrupted", "{r}");
    let v = output(Command::new(exe()).args(["verify", out.to_str().unwrap()]));
    assert!(v.status.success(), "{}", String::from_utf8_lossy(&v.stdout));
    // A row of the drill table (scripts/drills).
    let sent = report["balance"]["sent"].as_u64().unwrap() / 4;
    let recorded = report["recorder"]["events"].as_u64().unwrap();
    println!(
        "DRILL|SIGTERM during a run|{sent}|{recorded}|{}|0|holds",
        sent.saturating_sub(recorded)
    );
}

fn part_size(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().ends_with(".part"))
                .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
                .sum()
        })
        .unwrap_or(0)
}

/// Issue 11, item 4: SIGKILL leaves a `.part` and a run the database calls running. The next
/// `tessera run` on the directory closes both: the file with every whole block it held, marked
/// recovered and verifiable, the run as crashed; then it runs its own run.
#[test]
fn a_run_killed_with_sigkill_is_closed_at_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("data");
    let cfg = dir.path().join("t.toml");
    std::fs::write(
        &cfg,
        "[sources]\ncount = 4\nfragment_size = 1024\ntrigger = \"periodic\"\nrate_hz = 2000\n\
         [recorder]\nfsync = false\nblock_size = \"64 KiB\"\n",
    )
    .unwrap();
    let args = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = [
            "run",
            cfg.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--quiet",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let mut run = Proc::spawn_piped(
        Command::new(exe())
            .env("TESSERA_HTTP", "127.0.0.1:0")
            .args(args(&["--duration", "600"])),
    );
    // Several whole blocks in the open file.
    assert!(
        eventually(Duration::from_secs(60), || part_size(&out) > 400_000),
        "the recorder wrote no blocks"
    );
    run.kill();
    assert!(part_size(&out) > 0, "the kill left the open file");
    let db = |n: &str| -> serde_json::Value {
        let o = output(Command::new(exe()).args([
            "runs",
            "show",
            n,
            "--data",
            out.to_str().unwrap(),
            "--json",
        ]));
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    assert_eq!(db("1")["state"], "running");
    // The next run closes what the crash left.
    let o = output(
        Command::new(exe())
            .env("TESSERA_HTTP", "127.0.0.1:0")
            .args(args(&["--events", "200"])),
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success(),
        "{}{err}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(err.contains("recovered: "), "{err}");
    assert!(err.contains("run 1 was left running by a crash"), "{err}");
    assert_eq!(part_size(&out), 0);
    let r1 = db("1");
    assert_eq!(r1["state"], "crashed", "{r1}");
    let events = r1["events"].as_u64().unwrap();
    assert!(events > 0, "{r1}");
    assert_eq!(db("2")["state"], "stopped");
    let v = output(Command::new(exe()).args(["verify", out.to_str().unwrap(), "--json"]));
    assert!(v.status.success(), "{}", String::from_utf8_lossy(&v.stdout));
    let vj: serde_json::Value = serde_json::from_slice(&v.stdout).unwrap();
    assert_eq!(vj["events"].as_u64().unwrap(), events + 200, "{vj}");
    let sidecar = std::fs::read_to_string(out.join("run000001_0001.tsr.json")).unwrap();
    assert!(sidecar.contains("\"recovered\": true"), "{sidecar}");
    // A row of the drill table: what sat in the killed process's memory is lost by nature (push
    // mode); the row says what the recovered files hold.
    println!(
        "DRILL|SIGKILL during a run, then the next start|n/a|{events}|n/a|0|run closed as crashed"
    );
}

/// Issue 50, item 5: the whole host stalls (a VM paused, the process starved or stopped; SIGSTOP
/// of the run's one process here, its emulated sources with it) for well past every timeout,
/// three times. Thawed, each readout unit's reads found its links empty (their sources had just
/// woken too) and the clock said seconds had passed: the unit called them silent and the events
/// went incomplete, their fragments late (2 811 incomplete events after a 12 s host stall). The
/// roles count their timeouts in the time the process could run (`tessera_net::clock`): a stall
/// costs time only.
fn a_host_stalled_past_every_timeout(mode: &str) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("data");
    let cfg = dir.path().join("t.toml");
    let events = 12_000u64;
    std::fs::write(
        &cfg,
        format!(
            "[run]\nmode = \"{mode}\"\nevents = {events}\n\
             [sources]\ncount = 8\nfragment_size = 1024\ntrigger = \"periodic\"\nrate_hz = 1000\n\
             [[readout]]\nid = 0\nsources = \"0-3\"\nevent_timeout_ms = 200\n\
             [[readout]]\nid = 1\nsources = \"4-7\"\nevent_timeout_ms = 200\n\
             [[builder]]\nid = 0\nevent_timeout_ms = 400\n[[builder]]\nid = 1\nevent_timeout_ms = 400\n\
             [request]\ntimeout_ms = 200\nbuilder_timeout_ms = 400\n\
             [event_manager]\nheartbeat_timeout_ms = 600\n\
             [recorder]\nfsync = false\n"
        ),
    )
    .unwrap();
    let run = Proc::spawn_piped(
        Command::new(exe())
            .env("TESSERA_HTTP", "127.0.0.1:0")
            .args([
                "run",
                cfg.to_str().unwrap(),
                "--output",
                out.to_str().unwrap(),
                "--json",
                "--quiet",
            ]),
    );
    assert!(
        eventually(Duration::from_secs(60), || has_part(&out)),
        "no data reached the recorder"
    );
    for _ in 0..3 {
        let before = part_size(&out);
        run.signal("STOP");
        // The stall itself: five times the longest timeout.
        std::thread::sleep(Duration::from_secs(2));
        run.signal("CONT");
        // Running again before the next stall.
        assert!(
            eventually(Duration::from_secs(60), || part_size(&out) != before),
            "the run did not go on after the stall"
        );
    }
    let o = run.finish(LIMIT);
    let report: serde_json::Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("no report ({e}): {}", String::from_utf8_lossy(&o.stderr)));
    assert!(o.status.success(), "{report}");
    assert_eq!(report["balance"]["holds"], true, "{report}");
    assert_eq!(report["events_incomplete"], 0, "{report}");
    assert_eq!(report["events_complete"], events, "{report}");
    assert_eq!(report["balance"]["rejected_total"], 0, "{report}");
    let v = output(Command::new(exe()).args(["verify", out.to_str().unwrap()]));
    assert!(v.status.success(), "{}", String::from_utf8_lossy(&v.stdout));
    println!(
        "DRILL|the host stalled 3 x 2 s past every timeout ({mode} mode)|{events}|{}|0|0|holds",
        report["recorder"]["events"]
    );
}

#[test]
fn a_host_stalled_past_every_timeout_costs_time_only_in_push_mode() {
    a_host_stalled_past_every_timeout("push");
}

#[test]
fn a_host_stalled_past_every_timeout_costs_time_only_in_request_mode() {
    a_host_stalled_past_every_timeout("request");
}

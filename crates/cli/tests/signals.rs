//! Issue 11, item 4: a run ends cleanly however the operator or the system asks it to stop.
//! SIGTERM (what systemd, Kubernetes and `kill` send) stops like Ctrl-C: drained, summarised,
//! its files finished, the run closed in the run database.

mod support;
use std::process::Command;
use std::time::Duration;
use support::{eventually, output, Proc, LIMIT};

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_tessera")
}

fn has_part(dir: &std::path::Path) -> bool {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .any(|e| e.file_name().to_string_lossy().ends_with(".part"))
        })
        .unwrap_or(false)
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
}

//! Issue 15, sweeps of your own: `tessera scan CONFIG --vary KEY=V1,V2` runs the topology once
//! per point, as real runs of the binary, and writes the report (table, CSV, JSON, a plot as
//! SVG and PNG, an HTML page) whose points are the runs' own reports.

mod support;

use std::process::{Command, Stdio};

use support::{Proc, LIMIT};

const TOPOLOGY: &str = "[run]\nevents = 600\n\
    [sources]\ncount = 4\nfragment_size = 512\ntrigger = \"periodic\"\nrate_hz = 2000\n\
    [[readout]]\nid = 0\nsources = [0, 1]\n[[readout]]\nid = 1\nsources = [2, 3]\n\
    [[builder]]\nid = 0\n";

/// The same figure, through JSON twice (serde_json parses floats to within an ulp, not exactly).
fn close(got: &serde_json::Value, want: f64) {
    let g = got.as_f64().unwrap();
    assert!(
        (g - want).abs() <= 1e-9 * want.abs().max(1.0),
        "{g} against {want}"
    );
}

fn scan(dir: &std::path::Path, args: &[&str]) -> std::process::Output {
    let cfg = dir.join("topology.toml");
    std::fs::write(&cfg, TOPOLOGY).unwrap();
    Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_tessera"))
            .current_dir(dir)
            .args(["scan", cfg.to_str().unwrap(), "--output", "report"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    )
    .finish(LIMIT)
}

#[test]
fn a_two_value_scan_writes_its_report_from_the_runs_own_reports() {
    let dir = tempfile::tempdir().unwrap();
    let o = scan(
        dir.path(),
        &[
            "--vary",
            "sources.rate_hz=1000,3000",
            "--vary",
            "sources.fragment_size=256,2KiB",
            "--y",
            "built_mb_per_s",
        ],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    // A line per point as it starts and as it ends.
    assert!(
        err.contains("point 4/4: sources.rate_hz=3000, sources.fragment_size=2KiB"),
        "{err}"
    );
    let out = dir.path().join("report");
    let csv = std::fs::read_to_string(out.join("points.csv")).unwrap();
    assert_eq!(csv.lines().count(), 5, "{csv}");
    assert!(csv.starts_with("point,sources.rate_hz,sources.fragment_size,ok,"));
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("points.json")).unwrap()).unwrap();
    let points = json["points"].as_array().unwrap();
    assert_eq!(points.len(), 4);
    for p in points {
        assert_eq!(p["ok"], true, "{p}");
        // The point's figures are its run report's.
        let r: serde_json::Value = serde_json::from_slice(
            &std::fs::read(out.join(p["report"].as_str().unwrap())).unwrap(),
        )
        .unwrap();
        assert_eq!(r["events_complete"], 600, "{r}");
        assert_eq!(p["events_complete"], r["events_complete"]);
        close(&p["events_per_s"], r["events_per_s"].as_f64().unwrap());
        assert_eq!(r["balance"]["holds"], true);
        // The point ran with its values.
        let size = &p["values"][1][1];
        let want = if size == "256" { 256 } else { 2048 };
        // Bytes sent per fragment: the payload and a header of tens of bytes.
        let per = r["sources"][0]["bytes"].as_u64().unwrap() / 600;
        assert!(
            (want..want + 128).contains(&per),
            "{size}: {per} per fragment"
        );
    }
    let png = std::fs::read(out.join("plot.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let svg = std::fs::read_to_string(out.join("plot.svg")).unwrap();
    assert!(svg.starts_with("<svg"), "{svg:.100}");
    // One line per value of the second key.
    assert!(svg.contains("sources.fragment_size=2KiB"), "{svg:.2000}");
    let html = std::fs::read_to_string(out.join("index.html")).unwrap();
    assert!(html.contains("plot.svg") && html.contains("points.csv"));
    // Only the reports are kept, not the recorded data.
    assert!(!out.join("runs").exists());
}

#[test]
fn a_bad_value_is_refused_with_its_point_and_key_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let o = scan(dir.path(), &["--vary", "sources.busy=veto,sometimes"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("sources.busy=sometimes") && err.contains("sources.busy"),
        "{err}"
    );
    assert!(!dir.path().join("report").exists(), "nothing ran");
    let o = scan(dir.path(), &["--vary", "readout[2].host=a,b"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("2 [[readout]] entries"), "{err}");
    let o = scan(dir.path(), &["--vary", "sources.rate_hz"]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("expected KEY=V1,V2"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn a_quick_scenario_writes_the_papers_figure_with_our_points_beside_its_own() {
    let dir = tempfile::tempdir().unwrap();
    // This host calibrated (quick), as a user would once: check and the scenario then predict.
    let cal = dir.path().join("calibration.json");
    let o = Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_tessera"))
            .current_dir(dir.path())
            .env("TESSERA_CALIBRATION", &cal)
            .args(["bench", "calibrate", "--quick", "--json"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    )
    .finish(LIMIT);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let c: serde_json::Value = serde_json::from_slice(&std::fs::read(&cal).unwrap()).unwrap();
    for k in ["daq_ns_per_fragment", "disk_bytes_per_s", "cpus"] {
        assert!(c[k].as_f64().unwrap() > 0.0, "{k}: {c}");
    }
    let o = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .env("TESSERA_CALIBRATION", &cal)
        .args([
            "check",
            concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/comet.toml"),
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("saturates first") && text.contains("at the configured rate: CPU"),
        "{text}"
    );
    let o = Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_tessera"))
            .current_dir(dir.path())
            .env("TESSERA_CALIBRATION", &cal)
            .args(["scenario", "cms", "--quick", "--output", "cms"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    )
    .finish(LIMIT);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let out = dir.path().join("cms");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("points.json")).unwrap()).unwrap();
    let points = json["points"].as_array().unwrap();
    assert_eq!(points.len(), 3, "{json}");
    for p in points {
        assert_eq!(p["ok"], true, "{p}");
        let r: serde_json::Value = serde_json::from_slice(
            &std::fs::read(out.join(p["report"].as_str().unwrap())).unwrap(),
        )
        .unwrap();
        close(
            &p["built_mb_per_s"],
            r["built_bytes_per_s"].as_f64().unwrap() / 1e6,
        );
        assert_eq!(r["readout_units"].as_array().unwrap().len(), 2);
        // Each point names its bottleneck from the run control's samples, and has the capacity
        // model's prediction beside it.
        assert!(p["bottleneck"].is_string(), "{p}");
        assert!(p["predicted"].as_f64().unwrap() > 0.0, "{p}");
    }
    // The paper's points, with the figure they come from.
    assert!(json["paper"][0]["source"]
        .as_str()
        .unwrap()
        .contains("Fig. 4"));
    let notes = json["notes"].as_array().unwrap();
    assert!(notes.iter().any(|n| n
        .as_str()
        .unwrap()
        .starts_with("Where and why ours differs")));
    let png = std::fs::read(out.join("plot.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let svg = std::fs::read_to_string(out.join("plot.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("CMS"), "{svg:.200}");
    let html = std::fs::read_to_string(out.join("index.html")).unwrap();
    assert!(html.contains("Fig. 4") && html.contains("plot.svg"));
    assert!(html.contains("<th>model: ") && svg.contains("capacity model"));
    assert!(notes
        .iter()
        .any(|n| n.as_str().unwrap().contains("measured over predicted")));
    let o = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["scenario", "lhcb"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("comet"));
}

/// Issue 15, the seeds' networks: `--network` runs every point over emulated hosts (network
/// namespaces with `tc`-shaped links), each readout unit on a host of its own. A front-end link
/// of 0.2 Gb/s, far below what this machine's CPU moves, holds each unit to 25 MB/s, and the
/// bottleneck named is that link: the units' send queues full, the builder's receive queues
/// near empty. Without root or `ip netns` the test says SKIPPED and passes; CI runs as root.
#[test]
fn a_scan_over_emulated_hosts_is_held_to_its_links_and_names_the_network() {
    let probe = format!("scanprobe{}", std::process::id());
    if !support::ip(&["netns", "add", &probe]) {
        eprintln!("SKIPPED: cannot make network namespaces (needs root and iproute2)");
        return;
    }
    // And a token bucket in one (the kernel's sch_tbf).
    let shaped = Command::new("ip")
        .args([
            "netns", "exec", &probe, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
        ])
        .args(["rate", "1gbit", "burst", "64kb", "latency", "20ms"])
        .status()
        .is_ok_and(|s| s.success());
    support::ip(&["netns", "del", &probe]);
    if !shaped {
        eprintln!("SKIPPED: tc cannot shape a link here (iproute2's tc, the kernel's sch_tbf)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("topology.toml");
    std::fs::write(
        &cfg,
        "[run]\nevents = 0\nmax_fragment_size = \"32 KiB\"\n\
         [sources]\ncount = 4\nfragment_size = 4096\ntrigger = \"unlimited\"\n\
         [[readout]]\nid = 0\nsources = [0, 1]\n[[readout]]\nid = 1\nsources = [2, 3]\n\
         [[builder]]\nid = 0\n[recorder]\nenabled = false\n",
    )
    .unwrap();
    let o = Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_tessera"))
            .current_dir(dir.path())
            .args(["scan", cfg.to_str().unwrap(), "--output", "report"])
            .args(["--vary", "sources.fragment_size=4096,16384"])
            .args(["--duration", "3", "--y", "built_mb_per_s"])
            .args(["--network", "--front-end-link", "0.2"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    )
    .finish(LIMIT);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("fe1 (sends at most 200 Mb/s)")
            && err.contains("bu1 (receives at most 10 Gb/s)"),
        "{err}"
    );
    let out = dir.path().join("report");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("points.json")).unwrap()).unwrap();
    let points = json["points"].as_array().unwrap();
    assert_eq!(points.len(), 2);
    for p in points {
        assert_eq!(p["ok"], true, "{p}");
        assert_eq!(p["balance_holds"], true, "{p}");
        // Two units, each sending at most 25 MB/s of which the built bytes are a part; the
        // margin is the token buckets' bursts and the run's edges.
        let built = p["built_mb_per_s"].as_f64().unwrap();
        assert!(
            built > 0.0 && built <= 2.0 * 25.0 * 1.2,
            "{built} MB/s: {p}"
        );
        let b = p["bottleneck"].as_str().unwrap_or_default();
        assert!(
            b.starts_with("network from readout on fe") && b.ends_with("to builders"),
            "{b}: {p}"
        );
        // The point ran over the hosts its configuration names.
        let name = p["report"].as_str().unwrap().replace(".json", ".toml");
        let t = std::fs::read_to_string(out.join(name)).unwrap();
        assert!(t.contains("host = \"fe2\"") && t.contains("[hosts]"), "{t}");
    }
    let html = std::fs::read_to_string(out.join("index.html")).unwrap();
    assert!(html.contains("over emulated hosts"), "{html:.500}");
    // The hosts and their agents are gone with the scan.
    assert!(!out.join("hosts").exists());
}

/// Ctrl-C (SIGINT) ends a scan after the point that is running: exit 130, and the report holds
/// the points that ran.
#[test]
fn an_interrupted_scan_writes_the_points_that_ran_and_exits_130() {
    use std::io::{BufRead, Read};
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("topology.toml");
    std::fs::write(&cfg, TOPOLOGY).unwrap();
    let mut scan = Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_tessera"))
            .current_dir(dir.path())
            .args(["scan", cfg.to_str().unwrap(), "--output", "report"])
            .args(["--vary", "sources.rate_hz=1000,1500,2000,2500,3000"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    );
    let mut err = std::io::BufReader::new(scan.take_stderr().unwrap());
    let mut said = String::new();
    // Once the first point has ended, interrupt.
    loop {
        let mut line = String::new();
        assert!(err.read_line(&mut line).unwrap() > 0, "{said}");
        said += &line;
        if line.starts_with("point 1/5:") && !line.trim_end().ends_with("...") {
            break;
        }
    }
    scan.signal("INT");
    err.read_to_string(&mut said).unwrap();
    let status = scan.finish(LIMIT).status;
    assert_eq!(status.code(), Some(130), "{said}");
    assert!(said.contains("interrupted:"), "{said}");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("report/points.json")).unwrap())
            .unwrap();
    let n = json["points"].as_array().unwrap().len();
    assert!((1..5).contains(&n), "{n} points: {said}");
    assert!(dir.path().join("report/index.html").exists());
}

//! `tessera ship` as an operator runs it beside a recorder (issue 13, item 3): the files of a
//! real run go to an archive directory; the shipper is killed (SIGKILL) in the middle of a copy
//! and started again; in the end the archive holds every file exactly once, whole, verified by
//! `tessera verify` where it lies, and the data directory keeps nothing it could not give back.

mod support;
use std::path::Path;
use std::process::Command;
use support::{eventually, Proc, LIMIT};

fn tessera() -> &'static str {
    env!("CARGO_BIN_EXE_tessera")
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|r| {
            r.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn a_shipper_killed_mid_copy_resumes_and_ships_every_file_once() {
    let t = tempfile::tempdir().unwrap();
    let (data, archive) = (t.path().join("data"), t.path().join("archive"));
    let cfg = t.path().join("run.toml");
    std::fs::write(
        &cfg,
        "[run]\nevents = 3000\n[sources]\ncount = 4\nfragment_size = 2048\ntrigger = \"unlimited\"\n\
         [recorder]\nmax_file_size = \"4 MiB\"\n[monitor]\nenabled = false\n",
    )
    .unwrap();
    let o = Command::new(tessera())
        .arg("run")
        .arg(&cfg)
        .arg("--output")
        .arg(&data)
        .args(["--quiet", "--http", "off"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let files: Vec<String> = names(&data)
        .into_iter()
        .filter(|n| n.ends_with(".tsr"))
        .collect();
    assert!(files.len() >= 4, "{files:?}");
    // Slow enough (4 MB/s) that the kill lands inside a copy.
    let mut slow = Proc::spawn(
        Command::new(tessera())
            .args(["ship", "run"])
            .arg(&data)
            .arg("--to")
            .arg(&archive)
            .args(["--bandwidth", "4000000", "--interval", "0.2"]),
    );
    assert!(
        eventually(LIMIT, || names(&archive)
            .iter()
            .any(|n| n.ends_with(".part"))),
        "no copy under way in {}",
        archive.display()
    );
    slow.kill();
    drop(slow);
    assert!(names(&archive).iter().any(|n| n.ends_with(".part")));
    let o = Command::new(tessera())
        .args(["ship", "run"])
        .arg(&data)
        .arg("--to")
        .arg(&archive)
        .arg("--once")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut want: Vec<String> = files
        .iter()
        .flat_map(|f| [f.clone(), format!("{f}.json")])
        .collect();
    want.sort();
    assert_eq!(
        names(&archive),
        want,
        "each file once, whole, with its sidecar"
    );
    // Shipped and verified everywhere: nothing left locally but the run's own records.
    assert!(
        names(&data).iter().all(|n| !n.ends_with(".tsr")),
        "{:?}",
        names(&data)
    );
    let v = Command::new(tessera())
        .args(["verify", "--json"])
        .arg(&archive)
        .output()
        .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&v.stdout).unwrap();
    assert!(v.status.success(), "{report}");
    assert_eq!(report["events"], 3000, "{report}");
    let s = Command::new(tessera())
        .args(["ship", "status", "--json"])
        .arg(&data)
        .output()
        .unwrap();
    let status: serde_json::Value = serde_json::from_slice(&s.stdout).unwrap();
    assert_eq!(status["backlog"]["files"], 0, "{status}");
    let rows = status["shipments"].as_array().unwrap();
    assert_eq!(rows.len(), files.len(), "{status}");
    assert!(rows.iter().all(|r| r["state"] == "verified"), "{status}");
    // The copy the kill cut was made again: one row says so.
    assert!(rows.iter().any(|r| r["attempts"] == 2), "{status}");
    assert_eq!(status["deleted"].as_array().unwrap().len(), files.len());
}

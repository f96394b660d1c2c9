//! Issue 50, item 1: a disk that another writer fills while a run records. A real small file
//! system (tmpfs, mounted by the test: it needs root, as CI has; elsewhere it says so and does
//! nothing), a real `tessera run` process, and a writer that takes every free byte mid-run: the
//! recorder stops writing before the disk is full, finishes its files, names what it could not
//! write in the balance, and the run closes with its summary, its manifest and its row in the
//! run database, which stays readable while the disk is full.

mod support;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use support::{eventually, output, Proc, LIMIT};

/// A tmpfs of `mib` MiB mounted at a new directory, unmounted when dropped.
struct SmallDisk {
    at: PathBuf,
    _dir: tempfile::TempDir,
}

impl SmallDisk {
    fn mount(mib: u64) -> Option<SmallDisk> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let at = dir.path().join("disk");
        std::fs::create_dir(&at).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(&at)
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(SmallDisk { at, _dir: dir })
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.at).status();
    }
}

/// Writes `path` until the file system has no byte left; the bytes written.
fn fill(path: &Path) -> u64 {
    let mut f = std::fs::File::create(path).unwrap();
    let chunk = vec![0x5au8; 64 << 10];
    let mut n = 0u64;
    loop {
        match f.write(&chunk) {
            Ok(0) => break,
            Ok(k) => n += k as u64,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => panic!("filling {}: {e}", path.display()),
        }
    }
    // What a partly written page still takes: to the last byte.
    let _ = f.write(&[0u8; 1]);
    n
}

fn names_in(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

fn tessera(args: &[&str]) -> std::process::Output {
    output(
        Command::new(env!("CARGO_BIN_EXE_tessera"))
            .env("TESSERA_HTTP", "127.0.0.1:0")
            .args(args),
    )
}

/// A run of 8 × 4 KiB at 2 kHz on a 96 MiB disk that another writer fills once the run has
/// finished two files; the run's report (`--json`), whether it exited 0, and its stderr.
fn run_on_a_disk_filled_mid_run(
    disk: &SmallDisk,
    reserve: &str,
) -> (serde_json::Value, bool, String) {
    let work = tempfile::tempdir().unwrap();
    let config = work.path().join("t.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[run]
duration_s = 120
max_fragment_size = "16 KiB"
[sources]
count = 8
fragment_size = 4096
trigger = "periodic"
rate_hz = 2000
[[readout]]
id = 0
sources = "0-3"
buffer = "4 MiB"
[[readout]]
id = 1
sources = "4-7"
buffer = "4 MiB"
[[builder]]
id = 0
buffer = "4 MiB"
[recorder]
fsync = false
block_size = "256 KiB"
queue = "4 MiB"
max_file_size = "4 MiB"
disk_soft_free = "20 MiB"
disk_hard_free = "10 MiB"
disk_reserve = "{reserve}"
"#
        ),
    )
    .unwrap();
    let out = &disk.at;
    let run = Proc::spawn_piped(
        Command::new(env!("CARGO_BIN_EXE_tessera"))
            .env("TESSERA_HTTP", "127.0.0.1:0")
            .args(["run", config.to_str().unwrap(), "--json", "--output"])
            .arg(out)
            .stdin(std::process::Stdio::null()),
    );
    // Another writer takes every free byte once the run has finished a file or two.
    let finished = |d: &Path| names_in(d).iter().filter(|n| n.ends_with(".tsr")).count();
    assert!(
        eventually(LIMIT, || finished(out) >= 2),
        "the run finished no file"
    );
    assert!(fill(&out.join("filler")) > 0);
    let o = run.finish(LIMIT);
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    let report: serde_json::Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("no report ({e}); stderr: {stderr}"));
    (report, o.status.success(), stderr)
}

/// What the report says of the recorder: (events built, in finished files, unrecorded), having
/// checked that the balance holds with what could not be written named.
fn balance_with_unrecorded_named(report: &serde_json::Value, stderr: &str) -> (u64, u64, u64) {
    let summary = || format!("{report:#}\n{stderr}");
    assert_eq!(report["stop_reason"], "disk full", "{}", summary());
    assert_eq!(report["balance"]["holds"], true, "{}", summary());
    let rec = &report["recorder"];
    let unrecorded = rec["unrecorded_events"].as_u64().unwrap();
    assert_eq!(
        report["balance"]["rejected"]["unrecorded_disk_full"]
            .as_u64()
            .unwrap_or(0),
        rec["unrecorded_fragments"].as_u64().unwrap(),
        "{}",
        summary()
    );
    assert_eq!(report["recorder_shortfall"], 0, "{}", summary());
    let built =
        report["events_complete"].as_u64().unwrap() + report["events_incomplete"].as_u64().unwrap();
    (built, rec["events_in_files"].as_u64().unwrap(), unrecorded)
}

fn drill_row(name: &str, report: &serde_json::Value, built: u64, in_files: u64) {
    println!(
        "DRILL|{name}|{built}|{in_files}|{}|0|{}",
        built - in_files,
        if report["balance"]["holds"] == true {
            "holds"
        } else {
            "IMBALANCE"
        }
    );
}

#[test]
fn a_disk_filled_by_another_writer_mid_run_drains_into_the_reserve_and_closes_the_run() {
    let Some(disk) = SmallDisk::mount(96) else {
        eprintln!("SKIPPED: mounting a tmpfs needs root (CI runs this test)");
        return;
    };
    let (report, ok, stderr) = run_on_a_disk_filled_mid_run(&disk, "8 MiB");
    let summary = || format!("{report:#}\n{stderr}");
    let (built, in_files, unrecorded) = balance_with_unrecorded_named(&report, &stderr);
    assert!(
        report["not_kept"].as_array().is_none_or(|a| a.is_empty()),
        "{}",
        summary()
    );
    assert_eq!(
        report["recorder"]["error"],
        serde_json::Value::Null,
        "{}",
        summary()
    );
    // Lost with a reason or not at all: a run that lost events to the disk says so by its exit.
    assert_eq!(ok, unrecorded == 0, "{}", summary());
    assert_eq!(in_files + unrecorded, built, "{}", summary());
    // Every file finished, the room held for that given back, the manifest written.
    let out = &disk.at;
    let names = names_in(out);
    assert!(
        !names
            .iter()
            .any(|n| n.ends_with(".part") || n.ends_with(".reserve") || n.ends_with(".tmp")),
        "{names:?}"
    );
    assert!(
        names.iter().any(|n| n == "run000001.manifest.json"),
        "{names:?}"
    );
    // The disk full again (the freed reserve taken too): the run database still answers.
    fill(&out.join("filler2"));
    let data = out.to_str().unwrap();
    let list = tessera(&["runs", "list", "--data", data, "--json"]);
    assert!(
        list.status.success(),
        "{}",
        String::from_utf8_lossy(&list.stderr)
    );
    let runs: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(
        runs[0]["recorded_events"].as_u64(),
        Some(in_files),
        "{runs:#}"
    );
    let show = tessera(&["runs", "show", "1", "--data", data]);
    assert!(
        show.status.success(),
        "{}",
        String::from_utf8_lossy(&show.stderr)
    );
    // What the files hold is what the report says they hold.
    let v = tessera(&["verify", data, "--json"]);
    let vj: serde_json::Value = serde_json::from_slice(&v.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&v.stderr)));
    assert!(v.status.success(), "{vj:#}");
    assert_eq!(vj["events"].as_u64(), Some(in_files), "{vj:#}");
    drill_row(
        "disk filled by another writer mid-run",
        &report,
        built,
        in_files,
    );
    // Issue 50, item 8: a reader that stops reading (`| head`) ends the printing commands
    // quietly: no panic, no error line.
    let first = names_in(out)
        .into_iter()
        .find(|n| n.ends_with(".tsr"))
        .unwrap();
    let file = out.join(first);
    for args in [
        vec!["runs", "list", "--data", data],
        vec!["runs", "show", "1", "--data", data],
        vec!["dump", file.to_str().unwrap()],
    ] {
        let mut p = Proc::spawn(
            Command::new(env!("CARGO_BIN_EXE_tessera"))
                .args(&args)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped()),
        );
        // The reader is gone before the first line is written.
        drop(p.take_stdout());
        let o = p.finish(LIMIT);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !err.contains("panicked") && !err.contains("Broken pipe"),
            "{args:?}: {err}"
        );
    }
}

/// Without a reserve nothing can be finished on a disk another writer filled to the last byte:
/// the run still ends with its summary and a balance that names what was not written, says what
/// it could not keep, and `tessera recover` closes the rest once space is freed.
#[test]
fn a_disk_filled_to_the_last_byte_without_a_reserve_still_ends_with_a_summary_and_recovers() {
    let Some(disk) = SmallDisk::mount(96) else {
        eprintln!("SKIPPED: mounting a tmpfs needs root (CI runs this test)");
        return;
    };
    let (report, ok, stderr) = run_on_a_disk_filled_mid_run(&disk, "0 B");
    let summary = || format!("{report:#}\n{stderr}");
    let (built, in_files, unrecorded) = balance_with_unrecorded_named(&report, &stderr);
    assert!(!ok, "{}", summary());
    let not_kept = report["not_kept"].as_array().cloned().unwrap_or_default();
    assert!(
        not_kept
            .iter()
            .any(|n| n.as_str().is_some_and(|n| n.contains("manifest"))),
        "{}",
        summary()
    );
    let out = &disk.at;
    let data = out.to_str().unwrap();
    let list = tessera(&["runs", "list", "--data", data, "--json"]);
    assert!(
        list.status.success(),
        "{}",
        String::from_utf8_lossy(&list.stderr)
    );
    // Space freed: recovery finishes what the run could not, from its files.
    std::fs::remove_file(out.join("filler")).unwrap();
    let r = tessera(&["recover", data, "--json"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let v = tessera(&["verify", data, "--json"]);
    let vj: serde_json::Value = serde_json::from_slice(&v.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&v.stderr)));
    assert!(v.status.success(), "{vj:#}");
    let recovered = vj["events"].as_u64().unwrap();
    // Whatever the run could not finish is in the recovered file; nothing is counted twice.
    assert!(recovered >= in_files, "{vj:#}\n{}", summary());
    assert!(recovered + unrecorded <= built, "{vj:#}\n{}", summary());
    let names = names_in(out);
    assert!(!names.iter().any(|n| n.ends_with(".part")), "{names:?}");
    drill_row(
        "disk filled to the last byte, no reserve (then recovered)",
        &report,
        built,
        recovered,
    );
}

/// `tessera check` counts what can still reach the disk after a stop at the hard watermark
/// (the buffers and the kernel's buffers of every connection) and names the key when the
/// watermark is below it.
#[test]
fn check_names_a_hard_watermark_below_what_is_in_flight_at_the_stop() {
    let dir = tempfile::tempdir().unwrap();
    let low = dir.path().join("low.toml");
    std::fs::write(
        &low,
        "[sources]\ncount = 8\n[recorder]\ndisk_soft_free = \"20 MiB\"\ndisk_hard_free = \"10 MiB\"\n",
    )
    .unwrap();
    let o = tessera(&["check", low.to_str().unwrap()]);
    let text =
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{text}");
    let line = text
        .lines()
        .find(|l| l.contains("warning: recorder.disk_hard_free"))
        .unwrap_or_else(|| panic!("{text}"));
    // 8 sources, 2 readout units × 2 builders, 2 builders to the recorder.
    assert!(line.contains("of 14 connections"), "{line}");
    assert!(line.contains("raise it to"), "{line}");
    let high = dir.path().join("high.toml");
    std::fs::write(
        &high,
        "[sources]\ncount = 8\n[recorder]\ndisk_soft_free = \"1 TiB\"\ndisk_hard_free = \"900 GiB\"\n",
    )
    .unwrap();
    let o = tessera(&["check", high.to_str().unwrap()]);
    let text =
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert!(!text.contains("warning: recorder.disk_hard_free"), "{text}");
}

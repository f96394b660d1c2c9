//! Issue 50, item 1: a disk that another writer fills while a run records. A real small file
//! system (tmpfs, mounted by the test: it needs root, as CI has; elsewhere it says so and does
//! nothing), a real `tessera run` process, and a writer that takes every free byte mid-run: the
//! recorder stops writing before the disk is full, finishes its files, names what it could not
//! write in the balance, and the run closes with its summary, its manifest and its row in the
//! run database, which stays readable while the disk is full.

#[path = "../../run/tests/support/small_disk.rs"]
mod small_disk;
mod support;
use small_disk::SmallDisk;
use std::path::Path;
use std::process::Command;
use support::{eventually, output, Proc, LIMIT};

/// Another writer takes all but the last few KiB of the file system (one allocation of what is
/// free, as a large copy landing would): the bytes taken.
fn fill(path: &Path) -> u64 {
    let f = std::fs::File::create(path).unwrap();
    allocate_what_is_free(&f, path)
}

/// [`fill`], then what is left too, to the last byte (with no reserve to give back, nothing
/// races the writer).
fn fill_to_the_last_byte(path: &Path) -> u64 {
    use std::io::Write;
    let mut n = fill(path);
    let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
    loop {
        match f.write(&[0x5au8; 512]) {
            Ok(0) => break,
            Ok(k) => n += k as u64,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => panic!("filling {}: {e}", path.display()),
        }
    }
    n
}

/// Allocates what the file system has free to `f`, or as near to it as it takes.
fn allocate_what_is_free(f: &std::fs::File, path: &Path) -> u64 {
    use std::os::fd::AsRawFd;
    let dir = path.parent().unwrap();
    let free = free_bytes(dir);
    let mut want = free;
    while want > 0 {
        // SAFETY: a valid open descriptor and a non-negative length.
        let rc = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, want as libc::off_t) };
        if rc == 0 {
            return want;
        }
        assert_eq!(rc, libc::ENOSPC, "filling {}", path.display());
        want = want.saturating_sub(64 << 10);
    }
    0
}

/// Free bytes of the file system holding `dir` (statvfs, as the recorder looks).
fn free_bytes(dir: &Path) -> u64 {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).unwrap();
    // SAFETY: an all-zero statvfs is a valid value of this plain C struct.
    let mut v: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated path and `v` a writable statvfs.
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut v) }, 0);
    v.f_bavail as u64 * v.f_frsize as u64
}

fn names_in(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// `tessera runs list --data DIR --json`, which must answer (on a full disk too): what it printed.
fn listed(dir: &str) -> Vec<u8> {
    let list = tessera(&["runs", "list", "--data", dir, "--json"]);
    assert!(
        list.status.success(),
        "{}",
        String::from_utf8_lossy(&list.stderr)
    );
    list.stdout
}

/// `tessera verify DIR --json`, which must pass: its report.
fn verified(dir: &str) -> serde_json::Value {
    let v = tessera(&["verify", dir, "--json"]);
    let vj: serde_json::Value = serde_json::from_slice(&v.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&v.stderr)));
    assert!(v.status.success(), "{vj:#}");
    vj
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
    fill: fn(&Path) -> u64,
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
    let out = disk.path();
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
    // The run is held still (SIGSTOP) while the other writer takes the space, so that it has
    // taken it all before the recorder looks: a writer still taking space after the recorder
    // gave its reserve back would take that too (the case without a reserve).
    run.signal("STOP");
    let taken = fill(&out.join("filler"));
    run.signal("CONT");
    assert!(taken > 0);
    let o = run.finish(LIMIT);
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    let report: serde_json::Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("no report ({e}); stderr: {stderr}"));
    (report, o.status.success(), stderr)
}

/// What the report says of the recorder: (events built, in finished files, unrecorded), having
/// checked that the balance holds with what could not be written named.
/// Without a reserve, the recorder may also fail finishing its file for want of a byte, and the
/// run then ends in error saying so.
fn balance_with_unrecorded_named(
    report: &serde_json::Value,
    stderr: &str,
    reserve: bool,
) -> (u64, u64, u64) {
    let summary = || format!("{report:#}\n{stderr}");
    let why = report["stop_reason"].as_str().unwrap_or("");
    assert!(
        why == "disk full" || (!reserve && why.contains("No space left on device")),
        "{}",
        summary()
    );
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
        return;
    };
    let (report, ok, stderr) = run_on_a_disk_filled_mid_run(&disk, "8 MiB", fill);
    let summary = || format!("{report:#}\n{stderr}");
    let (built, in_files, unrecorded) = balance_with_unrecorded_named(&report, &stderr, true);
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
    let out = disk.path();
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
    let list = listed(data);
    let runs: serde_json::Value = serde_json::from_slice(&list).unwrap();
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
    let vj = verified(data);
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
        return;
    };
    let (report, ok, stderr) = run_on_a_disk_filled_mid_run(&disk, "0 B", fill_to_the_last_byte);
    let summary = || format!("{report:#}\n{stderr}");
    let (built, in_files, unrecorded) = balance_with_unrecorded_named(&report, &stderr, false);
    // With no byte free and none held, what the run can still finish depends on the few pages
    // a write cut back gives back: whatever it could not (its open file, its manifest, its
    // database row) the report names, and the run exits non-zero unless nothing was lost.
    let not_kept = report["not_kept"].as_array().cloned().unwrap_or_default();
    let clean = unrecorded == 0 && report["recorder"]["error"].is_null() && not_kept.is_empty();
    assert_eq!(ok, clean, "{}", summary());
    let manifest_not_kept = not_kept
        .iter()
        .any(|n| n.as_str().is_some_and(|n| n.contains("manifest")));
    assert_eq!(
        manifest_not_kept,
        !disk.path().join("run000001.manifest.json").exists(),
        "{}",
        summary()
    );
    let out = disk.path();
    let data = out.to_str().unwrap();
    // The run database answers while the disk is full.
    listed(data);
    // Space freed: recovery finishes what the run could not, from its files.
    std::fs::remove_file(out.join("filler")).unwrap();
    let r = tessera(&["recover", data, "--json"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let vj = verified(data);
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

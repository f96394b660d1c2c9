//! Issue 15, the trigger model: one trigger for every emulated source, BUSY vetoing triggers as
//! a trigger system does (offered = accepted + vetoed, exactly, and the accepted ones are the
//! events in the files), the old behaviour (queue every trigger) by name, and bursts and
//! scenario files whose trigger times come back in the recorded timestamps.

mod support;

use std::path::Path;
use std::process::{Command, Stdio};

use support::{event_headers, Proc, LIMIT};

fn run(dir: &Path, cfg: &str, args: &[&str]) -> serde_json::Value {
    let p = dir.join("topology.toml");
    std::fs::write(&p, cfg).unwrap();
    let o = Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_tessera"))
            .env("TESSERA_HTTP", "127.0.0.1:0")
            .args(["run", p.to_str().unwrap(), "--quiet", "--json"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    )
    .finish(LIMIT);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// The trigger period of [`slow_disk`]: 8 kHz.
const PERIOD_NS: u64 = 125_000;

/// Four sources at 8 kHz (128 MiB/s) into a recorder whose disk takes 32 MiB/s: the buffers and
/// the kernel's socket buffers (tens of MiB on loopback) fill within a second, and BUSY comes.
fn slow_disk(out: &Path, busy: &str) -> String {
    format!(
        r#"
[run]
output = "{}"
max_fragment_size = "16 KiB"
[sources]
count = 4
fragment_size = 4096
trigger = "periodic"
rate_hz = 8000
busy = "{busy}"
derandomizer = 16
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
throttle = "32 MiB"
"#,
        out.display()
    )
}

#[test]
fn a_busy_system_vetoes_triggers_and_counts_every_one() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("data");
    let report = run(dir.path(), &slow_disk(&out, "veto"), &["--duration", "3"]);
    let t = &report["trigger"];
    assert_eq!(t["policy"], "veto", "{t}");
    let (offered, accepted, vetoed) = (
        t["offered"].as_u64().unwrap(),
        t["accepted"].as_u64().unwrap(),
        t["vetoed"].as_u64().unwrap(),
    );
    assert_eq!(offered, accepted + vetoed, "{t}");
    assert_eq!(t["holds"], true);
    assert!(
        vetoed > 0,
        "a disk a quarter as fast as the sources vetoes: {t}"
    );
    // Every accepted trigger is an event every source sent, and in the files, whole.
    assert_eq!(report["balance"]["holds"], true, "{report}");
    for s in report["sources"].as_array().unwrap() {
        assert_eq!(s["sent"].as_u64().unwrap(), accepted, "{s}");
    }
    let headers = event_headers(&out);
    assert_eq!(headers.len() as u64, accepted, "{report}");
    let mut headers = headers;
    headers.sort_by_key(|h| h.event_id);
    // Accepted triggers have consecutive event IDs and keep their trigger times: multiples of
    // the period, with holes where triggers were vetoed.
    let mut holes = 0;
    for (i, h) in headers.iter().enumerate() {
        assert_eq!(h.event_id, i as u64, "{t}");
        assert_eq!(h.timestamp % PERIOD_NS, 0, "{h:?}");
        if i > 0 {
            let gap = h.timestamp - headers[i - 1].timestamp;
            assert!(gap >= PERIOD_NS, "{h:?}");
            holes += (gap / PERIOD_NS - 1) as usize;
        }
    }
    let last = headers.last().unwrap().timestamp / PERIOD_NS;
    assert_eq!(
        holes as u64,
        last + 1 - accepted,
        "holes in time are vetoed triggers"
    );
    assert!(holes as u64 <= vetoed, "{t}");
    // Each veto is put on the stage that held the system BUSY: here the disk.
    let by = t["vetoed_by"].as_object().unwrap();
    assert_eq!(
        by.values().map(|v| v.as_u64().unwrap()).sum::<u64>(),
        vetoed
    );
    // Which intervals name the disk depends on when the buffers filled (a loaded machine
    // fills them later): the disk is named for some of the vetoes, whatever else is.
    assert!(by.contains_key("recorder (disk)"), "{t}");
}

/// `busy = "queue"`, the behaviour before the trigger model: nothing is vetoed, every trigger
/// is taken, late; the times are the schedule's, without a hole.
#[test]
fn queued_triggers_are_all_taken_late() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("data");
    let report = run(dir.path(), &slow_disk(&out, "queue"), &["--events", "3000"]);
    let t = &report["trigger"];
    assert_eq!(t["policy"], "queue", "{t}");
    assert_eq!(t["vetoed"], 0, "{t}");
    assert_eq!(t["offered"], 3000, "{t}");
    assert_eq!(t["accepted"], 3000, "{t}");
    let mut headers = event_headers(&out);
    headers.sort_by_key(|h| h.event_id);
    assert_eq!(headers.len(), 3000);
    for (i, h) in headers.iter().enumerate() {
        assert_eq!(h.timestamp, i as u64 * PERIOD_NS, "{h:?}");
    }
}

fn paced(out: &Path, trigger: &str) -> String {
    format!(
        r#"
[run]
output = "{}"
[sources]
count = 3
fragment_size = 256
{trigger}
[recorder]
fsync = false
"#,
        out.display()
    )
}

/// NectarCAM's bursts: 9 triggers within 180 us, the bursts at 50 Hz; every trigger time comes
/// back in the recorded timestamps.
#[test]
fn bursts_come_back_in_the_recorded_timestamps() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("data");
    let cfg = paced(
        &out,
        "trigger = \"bursts\"\nrate_hz = 50\nburst_size = 9\nburst_window_us = 180",
    );
    let report = run(dir.path(), &cfg, &["--events", "45"]);
    assert_eq!(report["trigger"]["vetoed"], 0, "{}", report["trigger"]);
    let mut headers = event_headers(&out);
    headers.sort_by_key(|h| h.event_id);
    let want: Vec<u64> = (0..45u64)
        .map(|i| (i / 9) * 20_000_000 + (i % 9) * 20_000)
        .collect();
    let got: Vec<u64> = headers.iter().map(|h| h.timestamp).collect();
    assert_eq!(got, want);
}

/// A scenario file of trigger times (comments, blank lines) replayed once: the run ends by
/// itself after its last trigger, and the timestamps are the file's times. A file out of order
/// is refused at configure, with its line.
#[test]
fn a_scenario_file_is_replayed_and_a_bad_one_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("data");
    std::fs::write(
        dir.path().join("times.txt"),
        "# a spill\n0.001\n0.0015\n\n0.1\n0.1000002  # 200 ns later\n0.5\n",
    )
    .unwrap();
    let cfg = paced(&out, "trigger = \"scenario\"\nscenario = \"times.txt\"");
    let report = run(dir.path(), &cfg, &[]);
    assert_eq!(report["trigger"]["accepted"], 5, "{}", report["trigger"]);
    let mut headers = event_headers(&out);
    headers.sort_by_key(|h| h.event_id);
    let got: Vec<u64> = headers.iter().map(|h| h.timestamp).collect();
    assert_eq!(
        got,
        vec![1_000_000, 1_500_000, 100_000_000, 100_000_200, 500_000_000]
    );
    std::fs::write(dir.path().join("times.txt"), "0.2\n0.1\n").unwrap();
    let text = check_refuses(dir.path());
    assert!(
        text.contains("sources.scenario") && text.contains("line 2"),
        "{text}"
    );
}

/// Sizes from a histogram file, correlated across sources when asked: with a correlation of 1
/// an event is big at every source; the sizes are the file's, in its proportions. A size above
/// what a fragment may carry is refused at configure, naming the key.
#[test]
fn sizes_come_from_a_histogram_and_an_event_is_big_everywhere_when_correlated() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("data");
    std::fs::write(
        dir.path().join("sizes.txt"),
        "# zero-suppressed, with big events\n100 3\n3000 1\n",
    )
    .unwrap();
    let cfg = paced(
        &out,
        "trigger = \"unlimited\"\nsize_histogram = \"sizes.txt\"\nsize_correlation = 1.0",
    );
    run(dir.path(), &cfg, &["--events", "2000"]);
    let mut events = 0;
    let mut big = 0;
    for f in std::fs::read_dir(&out).unwrap().flatten() {
        if !f.file_name().to_string_lossy().ends_with(".tsr") {
            continue;
        }
        let mut rd = tessera_verify::FileReader::open(&f.path()).unwrap();
        while let Some((_, raw)) = rd.next_block().unwrap() {
            for e in tessera_verify::events_in(raw) {
                let sizes: Vec<u32> = e
                    .unwrap()
                    .fragments()
                    .map(|f| f.unwrap().header.payload_size)
                    .collect();
                assert_eq!(sizes.len(), 3);
                assert!(sizes.iter().all(|&s| s == sizes[0]), "{sizes:?}");
                assert!(sizes[0] == 100 || sizes[0] == 3000, "{sizes:?}");
                events += 1;
                big += (sizes[0] == 3000) as u32;
            }
        }
    }
    assert_eq!(events, 2000);
    // A quarter of the weight: 500 expected, binomial spread about 19.
    assert!((400..600).contains(&big), "{big} big events of 2000");
    std::fs::write(dir.path().join("sizes.txt"), "100 1\n2000000 1\n").unwrap();
    let text = check_refuses(dir.path());
    assert!(
        text.contains("sources.size_histogram") && text.contains("run.max_fragment_size"),
        "{text}"
    );
}

/// Every fragment of the finished files of `out`: (event ID, source) -> (timestamp, trigger
/// type, payload).
fn fragments_of(out: &Path) -> std::collections::BTreeMap<(u64, u32), (u64, u16, Vec<u8>)> {
    let mut m = std::collections::BTreeMap::new();
    for f in std::fs::read_dir(out).unwrap().flatten() {
        if !f.file_name().to_string_lossy().ends_with(".tsr") {
            continue;
        }
        let mut rd = tessera_verify::FileReader::open(&f.path()).unwrap();
        while let Some((_, raw)) = rd.next_block().unwrap() {
            for e in tessera_verify::events_in(raw) {
                let e = e.unwrap();
                let body = e.body();
                for fr in e.fragments() {
                    let fr = fr.unwrap();
                    m.insert(
                        (fr.header.event_id, fr.header.source_id),
                        (
                            fr.header.timestamp,
                            fr.header.trigger_type,
                            body[fr.payload_range()].to_vec(),
                        ),
                    );
                }
            }
        }
    }
    m
}

/// Replay: a recorded run sent again by the emulated sources gives files whose payloads and
/// trigger types are the original's, at the recorded trigger times (speed 1) or as fast as
/// allowed (speed 0). A recording without one of the topology's sources is refused by name.
#[test]
fn a_replayed_run_records_the_original_payloads_at_the_recorded_times() {
    let dir = tempfile::tempdir().unwrap();
    let original = dir.path().join("original");
    let cfg = paced(
        &original,
        "trigger = \"poisson\"\nrate_hz = 3000\nsize_spread = 100\ntrigger_types = 4",
    );
    run(dir.path(), &cfg, &["--events", "600"]);
    let want = fragments_of(&original);
    assert_eq!(want.len(), 1800);
    for speed in ["1", "0"] {
        let out = dir.path().join(format!("replay{speed}"));
        let cfg = paced(
            &out,
            &format!("replay = \"original\"\nreplay_speed = {speed}\npattern = \"adc\""),
        );
        let report = run(dir.path(), &cfg, &[]);
        assert_eq!(report["events_complete"], 600, "{report}");
        let got = fragments_of(&out);
        assert_eq!(got.len(), want.len());
        let t0 = want[&(0, 0)].0;
        for (k, (t, ty, p)) in &want {
            let (rt, rty, rp) = &got[k];
            assert_eq!((rty, rp), (ty, p), "event {} source {}", k.0, k.1);
            if speed == "1" {
                // The recorded times, counted from the first event.
                assert_eq!(*rt, t - t0, "event {} source {}", k.0, k.1);
            }
        }
    }
    let cfg =
        paced(&dir.path().join("x"), "replay = \"original\"").replace("count = 3", "count = 4");
    let p = dir.path().join("topology.toml");
    std::fs::write(&p, cfg).unwrap();
    let err = run_refused(&p);
    assert!(err.contains("source 3 is not in the recording"), "{err}");
    // Its memory is bounded: payloads and index alike.
    std::fs::write(
        &p,
        paced(
            &dir.path().join("y"),
            "replay = \"original\"\nreplay_memory = \"16 KiB\"",
        ),
    )
    .unwrap();
    let err = run_refused(&p);
    assert!(err.contains("sources.replay_memory"), "{err}");
}

/// `tessera check` of the topology in `dir`, which must refuse it: what it said.
fn check_refuses(dir: &Path) -> String {
    let p = dir.join("topology.toml");
    let o = Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(["check", p.to_str().unwrap()])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    )
    .finish(LIMIT);
    assert!(!o.status.success());
    String::from_utf8_lossy(&o.stderr).to_string() + &String::from_utf8_lossy(&o.stdout)
}

/// `tessera run` of the topology at `p`, which must refuse it: what it said.
fn run_refused(p: &Path) -> String {
    let o = Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_tessera"))
            .env("TESSERA_HTTP", "127.0.0.1:0")
            .args(["run", p.to_str().unwrap(), "--quiet", "--json"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    )
    .finish(LIMIT);
    assert!(!o.status.success());
    String::from_utf8_lossy(&o.stderr).into_owned()
}

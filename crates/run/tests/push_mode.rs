//! End-to-end runs of push-mode event building: real sockets on loopback, real files, checked
//! by the verifier. No timing is asserted; the assertions are on counts and file contents.

mod support;
use std::path::Path;
use support::drill;
use tessera_config::{Resolved, Topology};
use tessera_run::{Options, Report, StatusMode};

fn topology(text: &str) -> Resolved {
    Topology::parse(text, "test.toml").unwrap_or_else(|e| panic!("{e}"))
}

fn run(r: &Resolved, out: &Path) -> Report {
    let opts = Options {
        output: Some(out.to_path_buf()),
        status: StatusMode::Off,
        ..Default::default()
    };
    tessera_run::run(r, &opts).expect("run starts and ends")
}

fn verify(out: &Path) -> tessera_verify::VerifyReport {
    let v = tessera_verify::verify_paths(&[out.to_path_buf()]).unwrap();
    assert!(v.ok(), "verify found problems:\n{}", v.summary());
    v
}

#[path = "support/external.rs"]
mod external;
use external::run_with_external;

#[test]
fn demo_topology_runs_clean() {
    let dir = tempfile::tempdir().unwrap();
    let mut demo = Topology::demo();
    // The demo's monitor port is fixed (7711); tests run side by side take a free one.
    demo.topology.monitor.listen = "127.0.0.1:0".into();
    demo.topology.run.events = 3000;
    demo.topology.sources.trigger = tessera_config::TriggerMode::Unlimited;
    let rep = run(&demo, dir.path());
    assert!(rep.ok(), "{}", rep.summary());
    assert_eq!(rep.events_complete, 3000);
    assert_eq!(rep.events_incomplete, 0);
    assert_eq!(rep.balance.sent, 3000 * 8);
    assert_eq!(rep.builders.len(), 2);
    // Both builders got work: assignment spreads events.
    assert!(rep.builders.iter().all(|b| b.events_complete > 0));
    let v = verify(dir.path());
    assert_eq!(v.events, 3000);
    assert_eq!(v.fragments, 24_000);
    assert!(dir.path().join("run000001.manifest.json").exists());
    assert!(dir.path().join("run000001_0001.tsr.json").exists());
    // Where everything listened, for programs to read (issue 11, item 18).
    let a: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("addresses.json")).unwrap()).unwrap();
    assert_eq!(a["readout_units"].as_array().unwrap().len(), 2, "{a}");
    assert_eq!(a["sources"].as_array().unwrap().len(), 8, "{a}");
    let connect = a["sources"][0]["connect"].as_str().unwrap();
    assert!(!connect.ends_with(":0"), "{a}");
    assert!(a["monitor"].is_string() && a["recorder"].is_string(), "{a}");
}

#[test]
fn every_injected_error_is_counted_under_its_reason() {
    let dir = tempfile::tempdir().unwrap();
    let t = topology(
        r#"
[run]
events = 3000
[sources]
count = 6
fragment_size = 1024
size_spread = 256
[[readout]]
id = 0
[[readout]]
id = 1
[[builder]]
id = 0
[[inject]]
source = 0
kind = "bad_crc"
every = 500
[[inject]]
source = 1
kind = "bad_marker"
at = [100, 2000]
[[inject]]
source = 2
kind = "truncate"
at = [150, 2500]
[[inject]]
source = 3
kind = "duplicate"
at = [10, 20, 30]
[[inject]]
source = 4
kind = "skip"
at = [40, 41]
[[inject]]
source = 4
kind = "swap"
at = [60]
[[inject]]
source = 5
kind = "status_error"
at = [70]
"#,
    );
    let rep = run(&t, dir.path());
    assert!(rep.ok(), "{}", rep.summary());
    let r = &rep.balance.rejected;
    assert_eq!(r.get("bad_crc"), Some(&5), "{r:?}"); // 500,1000,...,2500
    assert_eq!(r.get("bad_marker"), Some(&2), "{r:?}");
    assert_eq!(r.get("bad_end_marker"), Some(&2), "{r:?}");
    assert_eq!(r.get("duplicate_event_id"), Some(&3), "{r:?}");
    // Event 60 of source 4 came after 61: read as a skip then a late fragment (wire-format
    // 1.6), so event 60 left without it at once.
    assert_eq!(r.get("late"), Some(&1), "{r:?}");
    assert_eq!(rep.balance.rejected_total, 13, "{r:?}");
    // Sent counts the duplicates and not the skipped.
    assert_eq!(rep.balance.sent, 6 * 3000 + 3 - 2);
    // Each rejected or skipped fragment leaves its event incomplete, naming the source.
    let missing: std::collections::BTreeMap<u32, u64> = rep.builders[0].missing_by_source.clone();
    assert_eq!(missing.get(&0), Some(&5));
    assert_eq!(missing.get(&1), Some(&2));
    assert_eq!(missing.get(&2), Some(&2));
    assert_eq!(missing.get(&4), Some(&3));
    assert_eq!(missing.get(&3), None);
    // 500, 1000, 1500, 2000, 2500 (bad CRC; 2000 also a bad marker, 2500 also truncated),
    // 100 (bad marker), 150 (truncated), 40 and 41 (skipped), 60 (swapped): ten events.
    assert_eq!(rep.events_incomplete, 10);
    assert_eq!(rep.events_complete, 3000 - 10);
    let v = verify(dir.path());
    assert_eq!(v.incomplete_events, 10);
    // Quarantine holds the evidence.
    let dump = std::fs::read(dir.path().join("quarantine/run000001_ru0.dump")).unwrap();
    let text = String::from_utf8_lossy(&dump);
    assert!(text.contains("reason=bad_crc"));
    assert!(text.contains("reason=bad_marker"));
}

#[test]
fn slow_recorder_holds_the_sources_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    // About 64 MB of data against 4 MB of buffers and at most ~25 MB of kernel socket buffers
    // (autotuned, several MiB per connection): the throttled recorder must push back through the
    // builders and readout units to every source.
    let t = topology(
        r#"
[run]
events = 8000
max_fragment_size = "16 KiB"
[sources]
count = 4
fragment_size = 2048
batch = "16 KiB"
[[readout]]
id = 0
buffer = "512 KiB"
read_chunk = "64 KiB"
[[builder]]
id = 0
buffer = "1 MiB"
read_chunk = "128 KiB"
[recorder]
throttle = "24 MB"
block_size = "256 KiB"
queue = "3 MiB"
fsync = false
"#,
    );
    let rep = run(&t, dir.path());
    assert!(rep.ok(), "{}", rep.summary());
    assert_eq!(rep.events_complete, 8000);
    assert!(rep.recorder.as_ref().unwrap().throttled_s > 0.0);
    assert!(
        rep.readout_units[0].busy_fraction > 0.0,
        "readout unit never ran out of buffer: {}",
        rep.summary()
    );
    // The back-pressure reached the sources: their writes blocked.
    assert!(
        rep.sources.iter().all(|s| s.held_fraction > 0.0),
        "sources were never held: {}",
        rep.summary()
    );
    assert!(rep.readout_units[0].peak_buffer_fraction <= 1.0);
    verify(dir.path());
}

#[test]
fn early_disconnect_marks_later_events_incomplete() {
    let dir = tempfile::tempdir().unwrap();
    let t = topology(
        r#"
[run]
events = 2000
[sources]
count = 4
fragment_size = 512
[[readout]]
id = 0
[[builder]]
id = 0
[[inject]]
source = 2
kind = "disconnect"
at = [500]
"#,
    );
    let rep = run(&t, dir.path());
    assert!(rep.ok(), "{}", rep.summary());
    assert_eq!(rep.events_complete, 500);
    assert_eq!(rep.events_incomplete, 1500);
    assert_eq!(rep.builders[0].missing_by_source.get(&2), Some(&1500));
    let s2 = rep.sources.iter().find(|s| s.id == 2).unwrap();
    assert_eq!(s2.link_state, "disconnected");
    verify(dir.path());
}

/// Buffers reserved at start (`reserve = true`): every link's share is taken as read chunks
/// before the sources send, reported, and the run builds every event as without it; units
/// that do not ask reserve nothing.
#[test]
fn reserved_buffers_are_taken_before_data_and_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let t = topology(
        r#"
[run]
events = 3000
max_fragment_size = "32 KiB"
[sources]
count = 8
fragment_size = 2048
trigger = "unlimited"
[[readout]]
id = 0
buffer = "4 MiB"
read_chunk = "256 KiB"
reserve = true
[[readout]]
id = 1
buffer = "4 MiB"
[[builder]]
id = 0
buffer = "8 MiB"
read_chunk = "1 MiB"
reserve = true
[[builder]]
id = 1
buffer = "8 MiB"
read_chunk = "1 MiB"
reserve = true
"#,
    );
    let rep = run(&t, dir.path());
    assert!(rep.ok(), "{}", rep.summary());
    assert_eq!(rep.events_complete, 3000);
    assert_eq!(rep.events_incomplete, 0);
    // Four links of 1 MiB each, four read chunks of 256 KiB in each.
    let ru: Vec<u64> = rep.readout_units.iter().map(|u| u.reserved_bytes).collect();
    assert_eq!(ru, vec![4 << 20, 0]);
    // Two readout-unit links of 4 MiB each, four chunks of 1 MiB in each.
    let bu: Vec<u64> = rep.builders.iter().map(|b| b.reserved_bytes).collect();
    assert_eq!(bu, vec![8 << 20, 8 << 20]);
    let v = verify(dir.path());
    assert_eq!(v.events, 3000);
    assert_eq!(v.fragments, 24_000);
}

/// Writes the wire format by hand from docs/wire-format.md, without the project's encoder.
#[path = "support/spec_source.rs"]
mod spec_source;

#[test]
fn external_source_written_from_the_spec() {
    let dir = tempfile::tempdir().unwrap();
    let t = topology(
        r#"
[run]
events = 1000
[sources]
count = 3
external = [77]
fragment_size = 256
trigger_types = 1
[[readout]]
id = 0
sources = "0-2"
[[readout]]
id = 1
sources = [77]
[[builder]]
id = 0
"#,
    );
    let rep = run_with_external(&t, dir.path(), 77, |addr| {
        spec_source::send(&addr, 77, 1000)
    });
    assert!(rep.ok(), "{}", rep.summary());
    assert_eq!(rep.events_complete, 1000, "{}", rep.summary());
    let s77 = rep.sources.iter().find(|s| s.id == 77).unwrap();
    assert_eq!(
        (s77.kind.as_str(), s77.sent, s77.received),
        ("external", 1000, 1000)
    );
    assert_eq!(s77.link_state, "ended");
    let v = verify(dir.path());
    assert_eq!(v.fragments, 4000);
    // The hand-written fragment bytes survive verbatim into the file.
    let mut rd = tessera_verify::FileReader::open(&dir.path().join("run000001_0001.tsr")).unwrap();
    let mut found = false;
    while let Some((_, raw)) = rd.next_block().unwrap() {
        for ev in tessera_verify::events_in(raw) {
            let ev = ev.unwrap();
            if ev.header.event_id == 7 {
                let body = ev.body();
                for f in ev.fragments() {
                    let f = f.unwrap();
                    if f.header.source_id == 77 {
                        assert_eq!(
                            &body[f.start..f.start + f.len],
                            &spec_source::fragment(
                                77,
                                7,
                                1,
                                &(0..107u32).map(|i| (i as u8) ^ 7).collect::<Vec<_>>()
                            )[..]
                        );
                        found = true;
                    }
                }
            }
        }
    }
    assert!(found);
}

/// Server mode, as SiTCP boards work: sources that listen and readout units that connect to
/// them. An external source written from the spec listens on a socket of the test
/// (`readout.dial`), the emulated ones listen on their own (`sources.listen`); in push and in
/// request mode every event is built complete from them.
#[test]
fn sources_that_listen_are_dialled_by_their_readout_units() {
    for mode in ["push", "request"] {
        let dir = tempfile::tempdir().unwrap();
        let board = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = board.local_addr().unwrap();
        let t = topology(&format!(
            r#"
[run]
mode = "{mode}"
events = 1000
[sources]
count = 3
listen = true
external = [77]
fragment_size = 256
trigger_types = 1
[[readout]]
id = 0
sources = "0-2"
[[readout]]
id = 1
sources = [77]
dial = ["{addr}"]
[[builder]]
id = 0
"#
        ));
        let ext = std::thread::spawn(move || spec_source::serve(board, 77, 1000));
        let rep = run(&t, dir.path());
        ext.join().unwrap();
        assert!(rep.ok(), "{mode}: {}", rep.summary());
        assert_eq!(rep.events_complete, 1000, "{mode}: {}", rep.summary());
        for s in &rep.sources {
            assert_eq!(
                (s.received, s.link_state.as_str()),
                (1000, "ended"),
                "{mode}: source {}",
                s.id
            );
        }
        assert_eq!(verify(dir.path()).fragments, 4000);
    }
}

#[test]
fn files_rotate_by_size_and_compress() {
    let dir = tempfile::tempdir().unwrap();
    for (codec, sub) in [("lz4", "lz4"), ("zstd", "zstd")] {
        let out = dir.path().join(sub);
        let t = topology(&format!(
            r#"
[run]
events = 2000
[sources]
count = 4
fragment_size = 4096
pattern = "adc"
[recorder]
compression = "{codec}"
max_file_size = "4 MiB"
block_size = "256 KiB"
fsync = false
"#
        ));
        let rep = run(&t, &out);
        assert!(rep.ok(), "{}", rep.summary());
        let rec = rep.recorder.as_ref().unwrap();
        assert!(
            rec.files.len() >= 3,
            "expected rotation, got {} files",
            rec.files.len()
        );
        assert!(
            rec.file_bytes < rec.record_bytes,
            "adc data should compress"
        );
        let v = verify(&out);
        assert_eq!(v.events, 2000);
        let names: Vec<&str> = rec.files.iter().map(|f| f.file.as_str()).collect();
        assert_eq!(names[0], "run000001_0001.tsr");
        assert_eq!(names[1], "run000001_0002.tsr");
        // No unfinished file is left behind.
        assert!(std::fs::read_dir(&out).unwrap().all(|e| !e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .ends_with(".part")));
    }
}

/// Issue 13, item 1: blocks compressed on several threads at once still reach the files in
/// order, each file finished beside the data path: with one source, one readout unit and one
/// builder the events reach the recorder in event-ID order (with several sources they need not:
/// a unit's link threads finish events concurrently, and nothing promises an order), so every
/// file holds ascending IDs and the files continue each other; each event is read back byte for
/// byte (fragment CRCs, payloads against the pattern).
#[test]
fn blocks_compressed_on_several_threads_reach_the_files_in_order() {
    let dir = tempfile::tempdir().unwrap();
    for (codec, threads) in [("lz4", 3), ("zstd", 4), ("none", 3)] {
        let out = dir.path().join(format!("{codec}{threads}"));
        let t = topology(&format!(
            r#"
[run]
events = 3000
[sources]
count = 1
fragment_size = 8192
pattern = "adc"
trigger = "unlimited"
[[readout]]
id = 0
[[builder]]
id = 0
[recorder]
compression = "{codec}"
compression_threads = {threads}
max_file_size = "1 MiB"
block_size = "16 KiB"
"#
        ));
        let rep = run(&t, &out);
        assert!(rep.ok(), "{}", rep.summary());
        let rec = rep.recorder.as_ref().unwrap();
        assert!(rec.files.len() >= 5, "{codec}: {} files", rec.files.len());
        let v = verify(&out);
        assert_eq!(v.events, 3000);
        let mut last: Option<u64> = None;
        for (i, f) in rec.files.iter().enumerate() {
            assert_eq!(f.sequence as usize, i + 1, "{codec}: {:?}", rec.files);
            let mut r = tessera_archive::FileReader::open(&out.join(&f.file)).unwrap();
            while let Some((_, raw)) = r.next_block().unwrap() {
                for e in tessera_archive::events_in(raw) {
                    let id = e.unwrap().header.event_id;
                    assert!(
                        last.is_none_or(|l| l + 1 == id),
                        "{codec}: event {id} after {last:?} in {}",
                        f.file
                    );
                    last = Some(id);
                }
            }
        }
        assert_eq!(last, Some(2999), "{codec}");
    }
}

/// Issue 13, item 2: files rotate by age too. The trigger holds the run to at least 3 s, so
/// with files at most 0.5 s old there are several, none full, each finished with its sidecar.
#[test]
fn files_rotate_by_age_as_well_as_size() {
    let dir = tempfile::tempdir().unwrap();
    let t = topology(
        r#"
[run]
events = 3000
[sources]
count = 2
fragment_size = 256
trigger = "periodic"
rate_hz = 1000
[recorder]
max_file_age_s = 0.5
"#,
    );
    let rep = run(&t, dir.path());
    assert!(rep.ok(), "{}", rep.summary());
    let rec = rep.recorder.as_ref().unwrap();
    assert!(rec.files.len() >= 2, "{} files", rec.files.len());
    assert!(rec.files.iter().all(|f| f.size_bytes < (1 << 30)));
    assert_eq!(rec.files.iter().map(|f| f.events).sum::<u64>(), 3000);
    for f in &rec.files {
        assert!(dir.path().join(format!("{}.json", f.file)).exists());
    }
    assert_eq!(verify(dir.path()).events, 3000);
}

/// Issue 13, item 2: events go to named streams by trigger type, each stream in files of its
/// own (`run000001_calibration_0001.tsr`), the rest to the main files; nothing is lost or
/// written twice, and in request mode, where builders wait for the recorder's acknowledgements,
/// every event is still acknowledged.
#[test]
fn events_go_to_the_files_of_their_stream() {
    let dir = tempfile::tempdir().unwrap();
    for mode in ["push", "request"] {
        let out = dir.path().join(mode);
        let t = topology(&format!(
            r#"
[run]
mode = "{mode}"
events = 4000
[sources]
count = 4
fragment_size = 512
trigger = "unlimited"
trigger_types = 4
[[readout]]
id = 0
[[builder]]
id = 0
[recorder]
max_file_size = "1 MiB"
block_size = "64 KiB"
streams = {{ calibration = [2], express = [3, 4] }}
"#
        ));
        let rep = run(&t, &out);
        assert!(rep.ok(), "{mode}: {}", rep.summary());
        let rec = rep.recorder.as_ref().unwrap();
        let mut by_stream: std::collections::BTreeMap<Option<String>, u64> = Default::default();
        for f in &rec.files {
            *by_stream.entry(f.stream.clone()).or_default() += f.events;
            let want = match f.stream.as_deref() {
                None => vec![1],
                Some("calibration") => vec![2],
                Some("express") => vec![3, 4],
                Some(other) => panic!("{mode}: stream {other}"),
            };
            if let Some(s) = &f.stream {
                assert!(f.file.contains(&format!("_{s}_")), "{}", f.file);
            }
            let mut r = tessera_archive::FileReader::open(&out.join(&f.file)).unwrap();
            while let Some((_, raw)) = r.next_block().unwrap() {
                for e in tessera_archive::events_in(raw) {
                    let tt = e.unwrap().header.trigger_type;
                    assert!(want.contains(&tt), "{mode}: trigger {tt} in {}", f.file);
                }
            }
        }
        assert_eq!(by_stream.len(), 3, "{mode}: {by_stream:?}");
        assert!(by_stream.values().all(|&n| n > 0), "{mode}: {by_stream:?}");
        assert_eq!(
            by_stream.values().sum::<u64>(),
            4000,
            "{mode}: {by_stream:?}"
        );
        assert_eq!(verify(&out).events, 4000);
    }
}

/// Issue 13, item 1: `recorder.writers = 2` writes the main files as two series in parallel,
/// each with its own pipeline: builder 0's events in the plain files, builder 1's in
/// `run000001_w1_*.tsr`; a named stream still takes its trigger types from both; nothing is lost
/// or written twice, with lz4 on two compression threads per series.
#[test]
fn the_main_files_are_written_as_parallel_series_by_builder() {
    let dir = tempfile::tempdir().unwrap();
    let t = topology(
        r#"
[run]
events = 6000
[sources]
count = 4
fragment_size = 512
trigger = "unlimited"
trigger_types = 2
[[readout]]
id = 0
[[builder]]
id = 0
[[builder]]
id = 1
[recorder]
writers = 2
compression = "lz4"
max_file_size = "1 MiB"
block_size = "64 KiB"
streams = { calibration = [2] }
"#,
    );
    let rep = run(&t, dir.path());
    assert!(rep.ok(), "{}", rep.summary());
    let rec = rep.recorder.as_ref().unwrap();
    let mut events: std::collections::BTreeMap<Option<String>, u64> = Default::default();
    for f in &rec.files {
        *events.entry(f.stream.clone()).or_default() += f.events;
        let mut r = tessera_archive::FileReader::open(&dir.path().join(&f.file)).unwrap();
        while let Some((_, raw)) = r.next_block().unwrap() {
            for e in tessera_archive::events_in(raw) {
                let h = e.unwrap().header;
                match f.stream.as_deref() {
                    None => assert!(h.trigger_type == 1 && h.builder_id == 0, "{}", f.file),
                    Some("w1") => assert!(h.trigger_type == 1 && h.builder_id == 1, "{}", f.file),
                    Some("calibration") => assert_eq!(h.trigger_type, 2, "{}", f.file),
                    Some(other) => panic!("stream {other} in {}", f.file),
                }
            }
        }
    }
    assert_eq!(events.len(), 3, "{events:?}");
    assert!(events.values().all(|&n| n > 0), "{events:?}");
    assert_eq!(events.values().sum::<u64>(), 6000, "{events:?}");
    assert!(rec
        .files
        .iter()
        .any(|f| f.file.starts_with("run000001_w1_")));
    assert_eq!(verify(dir.path()).events, 6000);
}

/// A stop that gives up on every stage (a recorder throttled far below the sources, deadlines
/// of 300 ms) cuts every link with data in it. The balance still holds, every fragment named:
/// unread in the sources' links, in flight to the builders and to the recorder in the kernel's
/// buffers, lost at a link that failed, buffered at the recorder. Counting a built fragment both
/// as built and as queued or lost on its way to the recorder broke it by tens of thousands.
#[test]
fn an_aborted_stop_names_every_fragment_it_cut_off() {
    let dir = tempfile::tempdir().unwrap();
    let t = topology(
        r#"
[run]
duration_s = 2
[sources]
count = 4
fragment_size = 4096
trigger = "unlimited"
[recorder]
throttle = "2 MB"
fsync = false
[stop]
sources_ms = 300
readout_ms = 300
builders_ms = 300
recorder_ms = 300
abort_grace_ms = 500
max_ms = 1000
"#,
    );
    let rep = run(&t, dir.path());
    assert!(!rep.drained, "{}", rep.summary());
    let b = &rep.balance;
    assert!(b.holds, "{}", rep.summary());
    assert_eq!(b.unaccounted, 0, "{}", rep.summary());
    // What the recorder has is what the balance counts as recorded.
    let rec = rep.recorder.as_ref().unwrap();
    assert_eq!(
        b.in_complete_events + b.in_incomplete_events,
        rec.fragments_in_complete + rec.fragments_in_incomplete
    );
    assert!(
        b.rejected.keys().any(|k| k.ends_with("_at_abort")),
        "{:?}",
        b.rejected
    );
    // The recorder's queue went with its abort: named, not called still buffered.
    assert_eq!(
        b.rejected
            .get("dropped_at_recorder_abort")
            .copied()
            .unwrap_or(0),
        rec.queued_fragments,
        "{:?}",
        b.rejected
    );
}

#[test]
fn verify_catches_a_corrupted_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut demo = Topology::demo();
    demo.topology.monitor.listen = "127.0.0.1:0".into();
    demo.topology.run.events = 200;
    run(&demo, dir.path());
    let f = dir.path().join("run000001_0001.tsr");
    let mut bytes = std::fs::read(&f).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&f, &bytes).unwrap();
    let v = tessera_verify::verify_paths(&[dir.path().to_path_buf()]).unwrap();
    assert!(!v.ok());
    assert!(v.problems > 0);
}

#[test]
fn a_source_that_never_ends_cannot_hang_the_stop() {
    let dir = tempfile::tempdir().unwrap();
    let t = topology(
        r#"
[run]
duration_s = 0.5
[stop]
sources_ms = 500
readout_ms = 500
builders_ms = 500
recorder_ms = 500
[sources]
count = 2
external = [9]
fragment_size = 128
trigger = "periodic"
rate_hz = 1000
trigger_types = 1
[[readout]]
id = 0
sources = "0-1"
[[readout]]
id = 1
sources = [9]
[[builder]]
id = 0
"#,
    );
    // An external source that says hello, sends ten fragments and then hangs, holding its
    // connection open and never ending its stream.
    let rep = run_with_external(&t, dir.path(), 9, |addr| {
        use std::io::Write;
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(&spec_source::hello(9)).unwrap();
        for ev in 0..10 {
            s.write_all(&spec_source::fragment(9, ev, 1, &[7; 64]))
                .unwrap();
        }
        std::thread::sleep(std::time::Duration::from_secs(3));
    });
    assert_eq!(rep.stop_reason, "duration");
    assert!(
        !rep.drained,
        "the external link was still open at the deadline"
    );
    let s9 = rep.sources.iter().find(|s| s.id == 9).unwrap();
    assert_eq!(s9.link_state, "aborted");
    assert_eq!(s9.received, 10);
    // What the hanging source sent is still accounted for, and the files are whole.
    assert!(rep.balance.holds, "{}", rep.summary());
    assert_eq!(rep.recorder_shortfall, 0, "{}", rep.summary());
    verify(dir.path());
}

/// Issue 11, item 2: a slow disk at the end of a run. The backlog in the buffers takes the
/// throttled recorder longer than every stage deadline to write, but it keeps moving, so the
/// stop waits for it: every built event is recorded, in finished files.
#[test]
fn a_stop_waits_for_a_slow_disk_that_keeps_draining() {
    let dir = tempfile::tempdir().unwrap();
    let t = topology(
        r#"
[run]
events = 3000
max_fragment_size = "16 KiB"
[sources]
count = 4
fragment_size = 4096
trigger = "unlimited"
[[readout]]
id = 0
buffer = "8 MiB"
[[builder]]
id = 0
buffer = "8 MiB"
[recorder]
throttle = "12 MB"
queue = "8 MiB"
fsync = false
[stop]
sources_ms = 700
readout_ms = 700
builders_ms = 700
recorder_ms = 700
abort_grace_ms = 500
"#,
    );
    let rep = run(&t, dir.path());
    assert!(rep.ok(), "{}", rep.summary());
    let stop = rep.stop.as_ref().unwrap();
    assert!(stop.drained, "{}", rep.summary());
    assert_eq!(rep.events_complete, 3000);
    let rec = rep.recorder.as_ref().unwrap();
    assert_eq!(rec.events, 3000, "{}", rep.summary());
    assert!(rec.throttled_s > 0.0);
    let v = verify(dir.path());
    assert_eq!(v.events, 3000);
    drill(
        "slow disk at the end of a run",
        3000,
        v.events,
        0,
        rep.balance.holds,
    );
    let parts: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "part"))
        .collect();
    assert!(parts.is_empty(), "{parts:?}");
}

/// Issue 11, item 5: a connection that never says hello holds nobody else's hello; a second
/// connection for a connected source, even after every source has connected, is refused,
/// counted and never replaces the first; the honest sources lose nothing.
#[test]
fn silent_and_duplicate_connections_are_refused_without_costing_events() {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let t = topology(
        r#"
[run]
events = 1000
[sources]
count = 0
external = [0, 1]
[[readout]]
id = 0
sources = [0, 1]
[[builder]]
id = 0
"#,
    );
    let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<(u32, String)>>(1);
    let opts = tessera_run::Options {
        output: Some(dir.path().to_path_buf()),
        status: StatusMode::Off,
        ready: Some(tx),
        ..Default::default()
    };
    // What the readout unit has read from source 0, seen from the test's side.
    let received0 = Arc::new(AtomicU64::new(0));
    let seen = received0.clone();
    let clients = std::thread::spawn(move || {
        let addr = rx.recv().unwrap()[0].1.clone();
        // Connected first and silent for the whole run.
        let silent = std::net::TcpStream::connect(&addr).unwrap();
        let other = {
            let addr = addr.clone();
            std::thread::spawn(move || spec_source::send(&addr, 1, 1000))
        };
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.write_all(&spec_source::hello(0)).unwrap();
        for ev in 0..1000u64 {
            s.write_all(&spec_source::fragment(0, ev, 1, &[ev as u8; 64]))
                .unwrap();
            if ev == 500 {
                // Once the unit reads source 0, an impostor for it: refused (closed), whatever
                // it sends.
                while seen.load(Ordering::Relaxed) == 0 {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                let mut dup = std::net::TcpStream::connect(&addr).unwrap();
                let _ = dup.write_all(&spec_source::hello(0));
                let _ = dup.write_all(&spec_source::fragment(0, 501, 1, &[0; 64]));
                dup.set_read_timeout(Some(std::time::Duration::from_secs(60)))
                    .unwrap();
                let n = dup.read(&mut [0u8; 16]).unwrap_or(0);
                assert_eq!(n, 0, "the impostor's connection was closed");
            }
        }
        s.write_all(&spec_source::end(0, 1000)).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let _ = s.read(&mut [0u8; 8]);
        other.join().unwrap();
        drop(silent);
    });
    let session = tessera_run::Session::start(&t, &opts).unwrap();
    let reason = loop {
        let r0 = session
            .live()
            .sources
            .iter()
            .find(|x| x.id == 0)
            .map_or(0, |x| x.received);
        received0.store(r0, Ordering::Relaxed);
        if let Some(r) = session.end_reason() {
            break r;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    clients.join().unwrap();
    let stop = session.stop(&tessera_run::StopDeadlines::from(&t.topology.stop));
    let rep = session.finish(reason, stop).unwrap();
    assert!(rep.ok(), "{}", rep.summary());
    assert_eq!(rep.events_complete, 1000, "{}", rep.summary());
    assert_eq!(rep.events_incomplete, 0);
    assert_eq!(rep.balance.rejected_total, 0, "{}", rep.summary());
    // The impostor, and the silent connection once its hello deadline passed or it closed.
    assert_eq!(
        rep.readout_units[0].refused_connections,
        2,
        "{}",
        rep.summary()
    );
    let s0 = rep.sources.iter().find(|s| s.id == 0).unwrap();
    assert_eq!((s0.sent, s0.received), (1000, 1000));
    let rec = rep.recorder.as_ref().unwrap();
    drill(
        "silent connection and impostor source",
        1000,
        rec.events_in_files,
        0,
        rep.balance.holds,
    );
}

/// Issue 11, item 5: junk and a repeated hello on an honest source's link, and bytes after its
/// end of stream. Every fragment it sent is built; the junk is counted as skipped bytes and its
/// one rejection is named as beyond what the source sent, so the balance holds; the bytes after
/// the end are counted.
/// Issue 50, item 8: an end of stream that declares more fragments than arrived makes an
/// imbalance the balance cannot place; the run says why, by source, instead of "0 errors".
#[test]
fn an_end_of_stream_declaring_more_than_arrived_is_named_by_source() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let t = topology(
        r#"
[run]
events = 100
[sources]
count = 0
external = [5]
[[readout]]
id = 0
sources = [5]
[[builder]]
id = 0
"#,
    );
    let rep = run_with_external(&t, dir.path(), 5, |addr| {
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.write_all(&spec_source::hello(5)).unwrap();
        for ev in 0..100u64 {
            s.write_all(&spec_source::fragment(5, ev, 1, &[ev as u8; 32]))
                .unwrap();
        }
        s.write_all(&spec_source::end(5, 105)).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let _ = s.read(&mut [0u8; 8]);
    });
    assert!(!rep.balance.holds, "{}", rep.summary());
    assert_eq!(rep.balance.unaccounted, 5, "{}", rep.summary());
    let src = &rep.sources[0];
    assert_eq!(
        src.error.as_deref(),
        Some("its end of stream declared 105 fragments; 100 arrived"),
        "{}",
        rep.summary()
    );
    assert!(
        rep.summary()
            .contains("SOURCE 5: its end of stream declared 105 fragments; 100 arrived"),
        "{}",
        rep.summary()
    );
}

#[test]
fn junk_a_second_hello_and_data_after_the_end_keep_the_balance() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let t = topology(
        r#"
[run]
events = 400
[sources]
count = 0
external = [5]
[[readout]]
id = 0
sources = [5]
[[builder]]
id = 0
"#,
    );
    let rep = run_with_external(&t, dir.path(), 5, |addr| {
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.write_all(&spec_source::hello(5)).unwrap();
        for ev in 0..400u64 {
            if ev == 100 {
                // 1 MiB of bytes with no marker in them.
                let junk: Vec<u8> = (0..1u32 << 20).map(|i| (i % 200) as u8 + 1).collect();
                s.write_all(&junk).unwrap();
            }
            if ev == 200 {
                s.write_all(&spec_source::hello(5)).unwrap();
            }
            s.write_all(&spec_source::fragment(5, ev, 1, &[ev as u8; 32]))
                .unwrap();
        }
        s.write_all(&spec_source::end(5, 400)).unwrap();
        s.write_all(b"trailing bytes").unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let _ = s.read(&mut [0u8; 8]);
    });
    assert!(rep.ok(), "{}", rep.summary());
    assert_eq!(rep.events_complete, 400, "{}", rep.summary());
    let src = &rep.sources[0];
    assert_eq!(src.sent, 400);
    assert!(src.skipped_bytes >= 1 << 20, "{}", src.skipped_bytes);
    assert_eq!(src.bytes_after_end, 14);
    assert_eq!(
        rep.balance.rejected_beyond_sent,
        rep.balance.rejected_total,
        "{}",
        rep.summary()
    );
    assert!(rep.balance.rejected_total >= 2, "{}", rep.summary());
    let rec = rep.recorder.as_ref().unwrap();
    drill(
        "1 MiB of junk, a second hello, data after the end",
        400,
        rec.events_in_files,
        0,
        rep.balance.holds,
    );
}

/// Issue 11, item 18: a run mixing emulated and external sources holds the emulated sources'
/// triggers until the external one has said its hello, however late it comes (here a second
/// after the start, five event timeouts): no event is built without it. Before, the emulated
/// sources started at once and every event of that second was built incomplete.
#[test]
fn emulated_sources_wait_for_the_external_ones() {
    let dir = tempfile::tempdir().unwrap();
    let events = 2000u64;
    let t = topology(&format!(
        r#"
[run]
events = {events}
[sources]
count = 3
external = [77]
fragment_size = 256
trigger_types = 1
trigger = "periodic"
rate_hz = 4000
[[readout]]
id = 0
sources = "0-2"
event_timeout_ms = 200
[[readout]]
id = 1
sources = [77]
event_timeout_ms = 200
[[builder]]
id = 0
event_timeout_ms = 1000
"#
    ));
    let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<(u32, String)>>(1);
    let opts = Options {
        output: Some(dir.path().to_path_buf()),
        status: StatusMode::Off,
        ready: Some(tx),
        ..Default::default()
    };
    let s = tessera_run::Session::start(&t, &opts).unwrap();
    let addr = rx
        .recv()
        .unwrap()
        .into_iter()
        .find(|(id, _)| *id == 77)
        .unwrap()
        .1;
    let t0 = std::time::Instant::now();
    while t0.elapsed() < std::time::Duration::from_secs(1) {
        assert_eq!(s.end_reason(), None);
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(s.waiting_for_external_sources());
    let held = s.report("running", false);
    assert!(
        held.sources
            .iter()
            .filter(|x| x.id != 77)
            .all(|x| x.sent == 0),
        "an emulated source sent before the external one connected"
    );
    let ext = std::thread::spawn(move || spec_source::send(&addr, 77, events));
    let reason = loop {
        if let Some(r) = s.end_reason() {
            break r;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    ext.join().unwrap();
    let stop = s.stop(&tessera_run::StopDeadlines::from(&t.topology.stop));
    let rep = s.finish(reason, stop).unwrap();
    assert!(rep.ok(), "{}", rep.summary());
    assert_eq!(rep.events_incomplete, 0, "{}", rep.summary());
    assert_eq!(rep.events_complete, events, "{}", rep.summary());
}

/// Issue 11, item 11: a monitor bound beyond loopback needs the run control's token (its
/// consumers present it); without one the run does not start, and says why.
#[test]
fn a_monitor_beyond_loopback_without_a_token_is_refused() {
    if std::env::var_os("TESSERA_TOKEN").is_some() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let t = topology(
        r#"
[run]
events = 10
[sources]
count = 2
[security]
allow = ["10.0.0.0/8"]
[monitor]
listen = "0.0.0.0:0"
"#,
    );
    let opts = Options {
        output: Some(dir.path().to_path_buf()),
        status: StatusMode::Off,
        ..Default::default()
    };
    let e = match tessera_run::Session::start(&t, &opts) {
        Err(e) => format!("{e:#}"),
        Ok(_) => panic!("a monitor beyond loopback started without a token"),
    };
    assert!(
        e.contains("monitor.listen") && e.contains("control.token"),
        "{e}"
    );
}

/// Issue 12, item 1: a builder reachable over several rails (the CMS two-rail layout). Every
/// readout unit connects to each of the builder's addresses and sends its super-fragments round
/// them; the builder's promises follow the slowest rail, so nothing is built early or lost.
#[test]
fn a_builder_on_three_rails_takes_every_units_super_fragments_over_all_of_them() {
    let dir = tempfile::tempdir().unwrap();
    let t = topology(
        r#"
[run]
events = 3000
[sources]
count = 6
fragment_size = 1024
trigger = "unlimited"
[[readout]]
id = 0
sources = "0-2"
[[readout]]
id = 1
sources = "3-5"
[[builder]]
id = 0
rails = ["127.0.0.1:0", "127.0.0.1:0"]
[[builder]]
id = 1
"#,
    );
    let rep = run(&t, dir.path());
    assert!(rep.ok(), "{}", rep.summary());
    assert_eq!(rep.events_complete, 3000, "{}", rep.summary());
    assert_eq!(rep.events_incomplete, 0);
    let b0 = rep.builders.iter().find(|b| b.id == 0).unwrap();
    let b1 = rep.builders.iter().find(|b| b.id == 1).unwrap();
    // Two readout units, each sending builder 0 one super-fragment per event it gets.
    assert_eq!(b0.super_fragments_by_rail.len(), 3, "{b0:?}");
    assert_eq!(
        b0.super_fragments_by_rail.iter().sum::<u64>(),
        2 * b0.events_complete
    );
    assert!(
        b0.super_fragments_by_rail.iter().all(|&n| n > 0),
        "a rail carried nothing: {:?}",
        b0.super_fragments_by_rail
    );
    assert!(b1.super_fragments_by_rail.is_empty(), "{b1:?}");
    assert_eq!(rep.balance.sent, 3000 * 6);
    let a: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("addresses.json")).unwrap()).unwrap();
    let rails = a["builders"][0]["rails"].as_array().expect("rails listed");
    assert_eq!(rails.len(), 2, "{a}");
    assert!(
        rails.iter().all(|r| !r.as_str().unwrap().ends_with(":0")),
        "{a}"
    );
    let v = verify(dir.path());
    assert_eq!(v.events, 3000);
}

#[test]
fn rails_are_refused_where_they_cannot_work() {
    for (text, key) in [
        (
            "[run]\nmode = \"request\"\n[[readout]]\nid = 0\n[[builder]]\nid = 0\nrails = [\"127.0.0.1:0\"]\n",
            "builder[0].rails",
        ),
        (
            "[[readout]]\nid = 0\n[[builder]]\nid = 0\nrails = [\"nowhere\"]\n",
            "builder[0].rails[0]",
        ),
        (
            "[[readout]]\nid = 0\n[[builder]]\nid = 0\nrails = [\"10.1.0.5:0\"]\n",
            "builder[0].rails[0]",
        ),
    ] {
        let Err(e) = Topology::parse(text, "t.toml") else {
            panic!("accepted: {text}");
        };
        let e = e.to_string();
        assert!(e.contains(key), "{text}: {e}");
    }
}

/// A readout unit's queues to its builders never hold a poller. One poller serves both units;
/// unit 1 reads one external source that stops for 2 s after event 999 (a front end that
/// pauses), while unit 0's sources go on at 5 kHz. Unit 0 runs ahead: its events from 1000 on
/// wait at the builders for unit 1, fill the builders' links and the sockets, and then queue at
/// unit 0, one or two events per read (links read as soon as a fragment comes). While those
/// queues were bounded (256 batches), the poller then waited on unit 0's full queue and never
/// read unit 1 again: its source resumed into a socket nobody read, and the run stood still.
/// It still stood after 280 s, past every event timeout, since a link nobody reads is never
/// proven silent. Unit 0's budget holds what it queues instead; this run takes 4 s.
#[test]
fn a_pausing_source_on_one_unit_does_not_stop_the_poller_that_reads_it() {
    pausing_source_on_one_of_two_units(
        "push",
        r#"
[[readout]]
id = 0
sources = "0-3"
event_timeout_ms = 60000
[[readout]]
id = 1
sources = [77]
event_timeout_ms = 60000
[[builder]]
id = 0
buffer = "512 KiB"
read_chunk = "128 KiB"
event_timeout_ms = 120000
[[builder]]
id = 1
buffer = "512 KiB"
read_chunk = "128 KiB"
event_timeout_ms = 120000
"#,
    );
}

/// The same pause in request mode, with request timeouts longer than the pause: unit 0's answers
/// for the events from 1000 on wait at the builders, its pages fill with events nobody can
/// clear yet, and every request to unit 1 waits in a descriptor; when the source resumes, every
/// event is built complete.
#[test]
fn in_request_mode_a_pausing_source_on_one_unit_holds_the_run_and_loses_nothing() {
    pausing_source_on_one_of_two_units(
        "request",
        r#"
[request]
timeout_ms = 60000
builder_timeout_ms = 120000
[[readout]]
id = 0
sources = "0-3"
buffer = "2 MiB"
[[readout]]
id = 1
sources = [77]
buffer = "2 MiB"
[[builder]]
id = 0
buffer = "512 KiB"
read_chunk = "128 KiB"
[[builder]]
id = 1
buffer = "512 KiB"
read_chunk = "128 KiB"
"#,
    );
}

/// One poller per stage; unit 1 reads one external source (written from the spec) that stops for
/// 2 s after event 999, while unit 0's four sources go on at 5 kHz. Every event must be built
/// complete. `units` gives the units, the builders and anything else the mode needs.
fn pausing_source_on_one_of_two_units(mode: &str, units: &str) {
    // One poller per stage (the reactors are made on first use, in this test's own process).
    std::env::set_var("TESSERA_IO_THREADS", "1");
    const EVENTS: u64 = 20_000;
    let dir = tempfile::tempdir().unwrap();
    let t = topology(&format!(
        r#"
[run]
mode = "{mode}"
events = {EVENTS}
io_moderation_us = 0
max_fragment_size = "1 KiB"
[sources]
count = 4
external = [77]
fragment_size = 256
trigger = "periodic"
rate_hz = 5000
trigger_types = 1
{units}
"#
    ));
    let rep = run_with_external(&t, dir.path(), 77, |addr| {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let mut send = |b: &[u8]| std::io::Write::write_all(&mut s, b).unwrap();
        send(&spec_source::hello(77));
        for ev in 0..EVENTS {
            if ev == 1000 {
                std::thread::sleep(std::time::Duration::from_secs(2));
            }
            send(&spec_source::fragment(77, ev, 1, &[ev as u8; 100]));
        }
        send(&spec_source::end(77, EVENTS));
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let _ = std::io::Read::read(&mut s, &mut [0u8; 8]);
    });
    assert!(rep.ok(), "{}", rep.summary());
    assert_eq!(rep.events_complete, EVENTS, "{}", rep.summary());
    assert_eq!(rep.events_incomplete, 0, "{}", rep.summary());
    assert!(rep.balance.holds, "{}", rep.summary());
}

/// Two readout units of four 16 KiB sources (`[[readout]]` tables by `units`: `sources` and any
/// buffers or caps) and two builders (`builders`: anything beyond their IDs), recorder and monitor
/// off, event timeouts of ten minutes (twenty at the builders), so that an event that waited for
/// one instead of leaving at once would hold the run past the test's time limit rather than
/// pass slowly; `extra`: the faults. Returns the report of `events` events.
fn small_buffer_run(events: u64, units: [&str; 2], builders: &str, extra: &str) -> Report {
    let dir = tempfile::tempdir().unwrap();
    let t = topology(&format!(
        r#"
[run]
events = {events}
max_fragment_size = "16 KiB"
[sources]
count = 8
fragment_size = 16384
threads = 2
[recorder]
enabled = false
[monitor]
enabled = false
[[readout]]
id = 0
event_timeout_ms = 600000
{}
[[readout]]
id = 1
event_timeout_ms = 600000
{}
[[builder]]
id = 0
event_timeout_ms = 1200000
{builders}
[[builder]]
id = 1
event_timeout_ms = 1200000
{builders}
{extra}"#,
        units[0], units[1]
    ));
    run(&t, dir.path())
}

/// `skip` faults on each of `sources`, every `every` events.
fn skips(sources: std::ops::Range<u32>, every: u64) -> String {
    sources
        .map(|s| format!("[[inject]]\nsource = {s}\nkind = \"skip\"\nevery = {every}\n"))
        .collect()
}

/// Events below `events` that are multiples of `every` (event 0 never is skipped).
fn multiples(events: u64, every: u64) -> u64 {
    (1..events).filter(|e| e % every == 0).count() as u64
}

/// How many events the builders built without `source`.
fn missing(rep: &Report, source: u32) -> u64 {
    rep.builders
        .iter()
        .map(|b| b.missing_by_source.get(&source).copied().unwrap_or(0))
        .sum()
}

/// A source that skips events, with buffers of a few read chunks a link: each skipped event
/// leaves at once, missing that source alone. It used to wait out `readout.event_timeout_ms`
/// although its link had moved past it (an item of a later event came), holding a read chunk of
/// each other link meanwhile; with two chunks a link and the emulated sources' drivers shared
/// over links, no link could read and the run stood still for the timeout at every skip
/// (16 KiB x 8, one skip in 200: 21 events/s).
#[test]
fn a_source_skipping_events_costs_units_with_small_buffers_only_those_events() {
    const EVENTS: u64 = 20_000;
    let unit = r#"buffer = "2 MiB""#;
    let builders = "buffer = \"1 MiB\"\nread_chunk = \"256 KiB\"";
    let rep = small_buffer_run(EVENTS, [unit, unit], builders, &skips(2..3, 200));
    assert!(rep.balance.holds, "{}", rep.summary());
    let skipped = multiples(EVENTS, 200);
    assert_eq!(rep.events_incomplete, skipped, "{}", rep.summary());
    assert_eq!(rep.events_complete, EVENTS - skipped, "{}", rep.summary());
    assert_eq!(rep.balance.rejected_total, 0, "{}", rep.summary());
    assert_eq!(missing(&rep, 2), skipped, "{}", rep.summary());
    for b in &rep.builders {
        assert_eq!(b.missing_by_source.len(), 1, "{}", rep.summary());
    }
}

/// Every source of one unit skips the same events, so that unit never has them, with builders
/// of two read chunks a unit: only those events are incomplete, and the run goes on. Each such
/// event's super-fragment from the other unit used to pin one of its link's two chunks at the
/// builder until the unit's promise (its progress floor) said the event would never come; two
/// such events close together pinned both, the builder read nothing more of that link, the
/// other link filled with events waiting for it, and the promise queued behind them: the run
/// stood still for good (event 404 of 20 000), with no timeout able to fire since every link was
/// alive and held.
#[test]
fn a_unit_that_never_had_events_costs_builders_with_small_buffers_only_those_events() {
    const EVENTS: u64 = 20_000;
    let builders = "buffer = \"1 MiB\"\nread_chunk = \"256 KiB\"";
    let rep = small_buffer_run(
        EVENTS,
        [
            "sources = \"0-3\"\nbuffer = \"2 MiB\"",
            "sources = \"4-7\"\nbuffer = \"2 MiB\"",
        ],
        builders,
        &skips(0..4, 200),
    );
    assert!(rep.balance.holds, "{}", rep.summary());
    let skipped = multiples(EVENTS, 200);
    assert_eq!(rep.events_incomplete, skipped, "{}", rep.summary());
    assert_eq!(rep.events_complete, EVENTS - skipped, "{}", rep.summary());
    assert_eq!(rep.balance.rejected_total, 0, "{}", rep.summary());
    for s in 0..4 {
        assert_eq!(missing(&rep, s), skipped, "source {s}: {}", rep.summary());
    }
}

/// Tables of open events of four events, at the readout units and at the builders: the cap
/// costs time, never data. A fragment handed back by a full table used to be read as late when
/// offered again (its link's floor had already moved past it), and a full table whose events
/// all waited for a link whose next fragment would open one more stood the run still: with no
/// skip at all, 64 % of the events in an interval were incomplete and then nothing was built.
/// Here one unit also never has one event in 200 and one source skips one in 300.
#[test]
fn tables_of_open_events_at_their_cap_cost_time_never_data() {
    const EVENTS: u64 = 8_000;
    let rep = small_buffer_run(
        EVENTS,
        [
            "sources = \"0-3\"\nmax_open_events = 4",
            "sources = \"4-7\"\nmax_open_events = 4",
        ],
        "max_open_events = 4",
        &(skips(0..4, 200) + &skips(5..6, 300)),
    );
    assert!(rep.balance.holds, "{}", rep.summary());
    assert_eq!(rep.balance.rejected_total, 0, "{}", rep.summary());
    let incomplete = (1..EVENTS).filter(|e| e % 200 == 0 || e % 300 == 0).count() as u64;
    assert_eq!(rep.events_incomplete, incomplete, "{}", rep.summary());
    assert_eq!(
        rep.events_complete,
        EVENTS - incomplete,
        "{}",
        rep.summary()
    );
    for s in 0..4 {
        assert_eq!(
            missing(&rep, s),
            multiples(EVENTS, 200),
            "source {s}: {}",
            rep.summary()
        );
    }
    assert_eq!(
        missing(&rep, 5),
        multiples(EVENTS, 300),
        "{}",
        rep.summary()
    );
}

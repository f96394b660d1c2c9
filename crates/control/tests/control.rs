//! The run control driving real runs: real sockets on loopback, real files, the real run
//! database. No timing is asserted except that a stop ends within the sum of its deadlines (and
//! their abort graces): that bound is what a stop promises.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_control::controller::{ControlError, ControlOptions, Controller};
use tessera_control::state::{State, Transition};

const WHO: &str = "test";

fn controller(dir: &Path, config: &str) -> Controller {
    let p = dir.join("t.toml");
    std::fs::write(&p, config).unwrap();
    Controller::new(
        ControlOptions {
            config: Some(p),
            output: Some(dir.join("out")),
            ..Default::default()
        },
        Arc::new(AtomicBool::new(false)),
    )
}

fn out(dir: &Path) -> PathBuf {
    dir.join("out")
}

/// Waits (bounded) until `f` holds; false if it never did.
fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f()
}

fn sent(c: &Controller) -> u64 {
    c.session()
        .map(|s| {
            s.live()
                .sources
                .iter()
                .map(|x| x.fragments_sent.unwrap_or(0))
                .sum()
        })
        .unwrap_or(0)
}

const PACED: &str = r#"
[run]
max_fragment_size = "64 KiB"
[sources]
count = 4
fragment_size = 512
trigger = "periodic"
rate_hz = 2000
[stop]
sources_ms = 5000
readout_ms = 5000
builders_ms = 5000
recorder_ms = 5000
abort_grace_ms = 1000
"#;

fn illegal(r: Result<tessera_control::controller::StateView, ControlError>) -> String {
    match r {
        Err(e @ ControlError::Illegal { .. }) => e.to_string(),
        Err(e) => panic!("expected an illegal transition, got {e}"),
        Ok(v) => panic!("expected an illegal transition, got state {}", v.state),
    }
}

#[test]
fn transitions_legal_and_illegal_and_the_run_database_after_several_runs() {
    let dir = tempfile::tempdir().unwrap();
    let c = controller(dir.path(), PACED);
    assert_eq!(c.state(), State::Initial);
    let e = illegal(c.request(Transition::Start, WHO, None));
    assert_eq!(e, "cannot start in state initial; allowed here: configure");
    c.request(Transition::Configure, WHO, None).unwrap();
    assert_eq!(c.state(), State::Configured);
    illegal(c.request(Transition::Pause, WHO, None));
    illegal(c.request(Transition::Stop, WHO, None));

    let mut reports = Vec::new();
    for (i, comment) in ["first", "second", "third"].iter().enumerate() {
        let v = c.request(Transition::Start, WHO, Some(comment)).unwrap();
        assert_eq!(v.state, State::Running);
        assert_eq!(v.run_number, Some(i as u64 + 1));
        assert!(illegal(c.request(Transition::Configure, WHO, None))
            .contains("allowed here: pause, stop"));
        illegal(c.request(Transition::Reset, WHO, None));
        illegal(c.request(Transition::Resume, WHO, None));
        assert!(eventually(Duration::from_secs(20), || sent(&c) > 0));
        if i == 1 {
            // Pause holds the triggers: the sources settle at a common last trigger and stay.
            c.request(Transition::Pause, WHO, None).unwrap();
            assert_eq!(c.state(), State::Paused);
            illegal(c.request(Transition::Pause, WHO, None));
            let mut last = sent(&c);
            assert!(eventually(Duration::from_secs(10), || {
                std::thread::sleep(Duration::from_millis(200));
                let now = sent(&c);
                let settled = now == last;
                last = now;
                settled
            }));
            let held = sent(&c);
            std::thread::sleep(Duration::from_millis(300));
            assert_eq!(sent(&c), held, "a paused run sent fragments");
            let s = c.session().unwrap();
            let live = s.live();
            assert!(live.paused);
            assert!(live
                .components
                .iter()
                .any(|x| x.kind == "sources" && x.state == tessera_run::ComponentState::Paused));
            drop(s);
            c.request(Transition::Resume, WHO, None).unwrap();
            assert_eq!(c.state(), State::Running);
            assert!(eventually(Duration::from_secs(20), || sent(&c) > held));
        }
        let v = c.request(Transition::Stop, WHO, None).unwrap();
        assert_eq!(v.state, State::Stopped);
        let stop = v.last_stop.expect("the stop's report");
        assert_eq!(
            stop.stages
                .iter()
                .map(|s| s.stage.as_str())
                .collect::<Vec<_>>(),
            ["sources", "readout", "builders", "recorder"]
        );
        assert!(stop.drained, "{stop:?}");
        let rep = c.last_report().unwrap();
        assert!(rep.ok(), "{}", rep.summary());
        assert!(rep.balance.holds);
        reports.push(rep);
        illegal(c.request(Transition::Stop, WHO, None));
    }

    // The database holds the three runs with what their reports say.
    let db = c.db().unwrap();
    let runs = db.list(10).unwrap();
    assert_eq!(runs.iter().map(|r| r.number).collect::<Vec<_>>(), [3, 2, 1]);
    for (r, rep) in runs.iter().rev().zip(&reports) {
        assert_eq!(r.state, "stopped");
        assert_eq!(r.events, rep.events_complete + rep.events_incomplete);
        assert_eq!(r.bytes, rep.bytes_built);
        assert_eq!(r.balance_holds, Some(true));
        assert_eq!(r.stop_reason.as_deref(), Some("stopped by operator"));
        let full = db.get(r.number).unwrap();
        // The full configuration, loadable again.
        tessera_config::Topology::parse(&full.config, "db").unwrap();
        let files = &rep.recorder.as_ref().unwrap().files;
        assert!(!files.is_empty());
        assert_eq!(full.files.len(), files.len());
        for (row, f) in full.files.iter().zip(files) {
            assert_eq!(row.name, f.file);
            assert_eq!(row.crc32c, f.file_crc32c);
            assert!(out(dir.path()).join(&row.name).exists());
        }
        // Start and stop by WHO, with the illegal attempts logged too.
        assert!(full
            .actions
            .iter()
            .any(|a| a.action == "start" && a.who == WHO && a.result == "ok"));
        assert!(full
            .actions
            .iter()
            .any(|a| a.action == "reset" && a.result.starts_with("cannot reset")));
    }
    assert_eq!(db.get(1).unwrap().summary.comment, "first");
    assert_eq!(db.get(3).unwrap().summary.comment, "third");
    // Files on disk check out.
    let v = tessera_verify::verify_paths(&[out(dir.path())]).unwrap();
    assert!(v.ok(), "{}", v.summary());

    c.request(Transition::Reset, WHO, None).unwrap();
    assert_eq!(c.state(), State::Initial);
    c.close();
}

#[test]
/// Issue 50, item 4: a blocking station whose consumer never reads holds every queue full; the
/// stop releases the hold (its consumer misses what is left, counted at the station) and drains
/// everything in flight into the files, within its deadlines. It used to wait behind the hold
/// until the stages passed their deadlines and gave up what they held.
fn a_stop_while_a_held_station_fills_every_queue_releases_it_and_drains_within_its_deadlines() {
    let dir = tempfile::tempdir().unwrap();
    // A blocking station whose consumer never reads holds the recorder; the builders, readout
    // units and sources then fill up behind it.
    let c = controller(
        dir.path(),
        r#"
[run]
max_fragment_size = "64 KiB"
[sources]
count = 4
fragment_size = 4096
trigger = "unlimited"
[[readout]]
id = 0
sources = "0-1"
buffer = "4 MiB"
[[readout]]
id = 1
sources = "2-3"
buffer = "4 MiB"
[[builder]]
id = 0
buffer = "4 MiB"
[monitor]
[[monitor.station]]
name = "hold"
mode = "blocking"
queue = 4
[stop]
sources_ms = 1000
readout_ms = 1000
builders_ms = 1000
recorder_ms = 1000
abort_grace_ms = 1000
"#,
    );
    c.request(Transition::Configure, WHO, None).unwrap();
    c.request(Transition::Start, WHO, None).unwrap();
    let s = c.session().unwrap();
    let stuck = s.monitor().unwrap().attach("hold", "stuck").unwrap();
    // Full: every emulated source held, the readout buffers occupied.
    assert!(eventually(Duration::from_secs(30), || {
        let l = s.live();
        let a = sent(&c);
        std::thread::sleep(Duration::from_millis(300));
        let l2 = s.live();
        let still = sent(&c) == a;
        still
            && l2.readout_units.iter().all(|u| u.buffer_used > 0)
            && l.recorder.as_ref().is_some_and(|r| r.events > 0)
    }));
    drop(s);
    let t = Instant::now();
    let v = c.request(Transition::Stop, WHO, None).unwrap();
    let took = t.elapsed();
    assert_eq!(v.state, State::Stopped);
    let stop = v.last_stop.unwrap();
    assert!(stop.drained, "{stop:?}");
    assert!(
        took < Duration::from_secs(4 + 5 + 10),
        "the stop took {took:?}: {stop:?}"
    );
    let rep = c.last_report().unwrap();
    assert!(rep.balance.holds, "{}", rep.summary());
    assert_eq!(rep.events_incomplete, 0, "{}", rep.summary());
    assert_eq!(rep.balance.rejected_total, 0, "{}", rep.summary());
    let held = rep
        .monitor
        .as_ref()
        .and_then(|m| m.stations.iter().find(|x| x.config.name == "hold"))
        .unwrap();
    assert!(held.counters.skipped_at_stop > 0, "{:?}", held.counters);
    drop(stuck);
    // The run was recorded with everything accounted for.
    let r = c.db().unwrap().get(1).unwrap();
    assert_eq!(r.summary.state, "stopped");
    assert_eq!(
        r.summary.events,
        rep.events_complete + rep.events_incomplete
    );
    // And the next run starts and ends clean.
    c.request(Transition::Start, WHO, None).unwrap();
    assert!(eventually(Duration::from_secs(20), || sent(&c) > 0));
    c.close();
}

#[test]
fn alarms_rise_while_back_pressure_holds_the_data_path_and_clear_when_it_moves() {
    let dir = tempfile::tempdir().unwrap();
    // A blocking station whose consumer does not read holds the recorder, and everything
    // behind it: no event is built, and the stages stay blocked.
    let c = controller(
        dir.path(),
        r#"
[run]
max_fragment_size = "64 KiB"
[sources]
count = 2
fragment_size = 4096
trigger = "unlimited"
[[readout]]
id = 0
sources = "0-1"
buffer = "4 MiB"
[[builder]]
id = 0
buffer = "4 MiB"
[monitor]
[[monitor.station]]
name = "hold"
mode = "blocking"
queue = 4
[control]
sample_interval_ms = 100
[alarms]
blocked_s = 1
no_events_s = 1
[stop]
sources_ms = 1000
readout_ms = 1000
builders_ms = 1000
recorder_ms = 1000
abort_grace_ms = 1000
"#,
    );
    c.request(Transition::Configure, WHO, None).unwrap();
    c.request(Transition::Start, WHO, None).unwrap();
    let s = c.session().unwrap();
    let stuck = s.monitor().unwrap().attach("hold", "stuck").unwrap();
    let raised = |kind: &str| c.alarms().active.iter().any(|a| a.alarm == kind);
    // The blocked stages are the bottleneck's consequences: folded into its one alarm, which
    // names what holds them (the recorder, waiting on the monitor's blocking station).
    assert!(
        eventually(Duration::from_secs(60), || raised("no_events")
            && raised("bottleneck")),
        "{:?}",
        c.alarms()
    );
    let v = c.alarms();
    let b = v.active.iter().find(|a| a.alarm == "bottleneck").unwrap();
    assert!(b.message.starts_with("bottleneck recorder"), "{b:?}");
    assert!(b.folded.iter().any(|f| f.contains("blocked for")), "{b:?}");
    assert!(!raised("stage_blocked"), "{v:?}");
    let m = tessera_control::metrics::render(&c);
    assert!(
        m.contains(r#"tessera_alarm_active{alarm="no_events",subject="run""#),
        "{m}"
    );
    assert!(
        m.contains(r#"tessera_alarms_raised_total{alarm="bottleneck""#),
        "{m}"
    );
    // What waits in the kernel's queues between the readout unit and the builder.
    assert!(
        m.contains("tessera_readout_send_queued_bytes{")
            && m.contains("tessera_builder_receive_queued_bytes{"),
        "{m}"
    );
    // Every reason a fragment can be dropped or rejected for is a series from the start, at 0
    // until its first count, so that `increase()` sees the first one.
    for series in [
        r#"tessera_builder_dropped_fragments_total{builder="0",reason="late_at_builder""#,
        r#"tessera_builder_dropped_fragments_total{builder="0",reason="recorder_link_lost""#,
        r#"tessera_rejected_fragments_total{reason="late""#,
        r#"tessera_rejected_fragments_total{reason="bad_crc""#,
    ] {
        assert!(m.contains(series), "{series} not in:\n{m}");
    }
    // The consumer reads: events move again and the alarms clear.
    let ev = stuck.get(64, tessera_monitor::Wait::Poll).unwrap();
    stuck.put(ev).unwrap();
    drop(stuck);
    assert!(
        eventually(Duration::from_secs(60), || !raised("no_events")),
        "{:?}",
        c.alarms()
    );
    assert!(c
        .alarms()
        .recent
        .iter()
        .any(|a| a.alarm == "no_events" && a.cleared_unix_ns.is_some()));
    drop(s);
    c.request(Transition::Stop, WHO, None).unwrap();
    // Nothing taking data: no data-path alarm stays raised.
    assert!(
        eventually(Duration::from_secs(10), || c.alarms().active.is_empty()),
        "{:?}",
        c.alarms()
    );
    c.close();
}

#[test]
fn a_component_that_fails_puts_the_system_in_error_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let c = controller(dir.path(), PACED);
    c.request(Transition::Configure, WHO, None).unwrap();
    // The recorder's first file of run 1 cannot be created: a directory is in its way.
    std::fs::create_dir_all(out(dir.path()).join("run000001_0001.tsr.part")).unwrap();
    c.request(Transition::Start, WHO, None).unwrap();
    let end = c.wait_for(
        &[State::Error, State::Stopped],
        Some(Duration::from_secs(60)),
    );
    assert_eq!(end, State::Error);
    let v = c.view();
    let why = v.error.unwrap();
    assert!(why.starts_with("recorder:"), "{why}");
    // An alarm names it, on the API and in /metrics, until the next configure.
    let a = c.alarms();
    assert!(
        a.active.iter().any(|x| x.alarm == "component_failed"
            && x.subject == "recorder"
            && x.level == "error"),
        "{a:?}"
    );
    let m = tessera_control::metrics::render(&c);
    assert!(
        m.contains(r#"tessera_alarm_active{alarm="component_failed",subject="recorder""#),
        "{m}"
    );
    // The run was stopped and recorded as failed, with the reason.
    let db = c.db().unwrap();
    let r = db.get(1).unwrap();
    assert_eq!(r.summary.state, "error");
    assert!(r.summary.error.unwrap().starts_with("recorder:"));
    // Only reset leaves error.
    for t in [
        Transition::Start,
        Transition::Configure,
        Transition::Stop,
        Transition::Pause,
        Transition::Resume,
    ] {
        assert!(illegal(c.request(t, WHO, None)).contains("allowed here: reset"));
    }
    c.request(Transition::Reset, WHO, None).unwrap();
    assert_eq!(c.view().error, None);
    c.request(Transition::Configure, WHO, None).unwrap();
    assert!(c.alarms().active.is_empty(), "{:?}", c.alarms());
    assert_eq!(c.alarms().recent[0].alarm, "component_failed");
    std::fs::remove_dir(out(dir.path()).join("run000001_0001.tsr.part")).unwrap();
    let v = c.request(Transition::Start, WHO, None).unwrap();
    assert_eq!(v.run_number, Some(2));
    c.request(Transition::Stop, WHO, None).unwrap();
    assert!(c.last_report().unwrap().ok());
    c.close();
}

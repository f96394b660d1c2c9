//! Back-pressure costs time, never data (issue 11, item 1): a run held for many times its
//! timeouts by a blocking monitor station builds every event complete, rejects nothing as late,
//! and shows the hold as the sources' dead time. The hold is the stimulus; what is asserted is
//! counts and file contents, never timing.

mod support;
use std::time::{Duration, Instant};
use support::drill;
use tessera_config::Topology;
use tessera_monitor::Wait;
use tessera_run::{Options, Session, StatusMode, StopDeadlines};

fn sent(s: &Session) -> u64 {
    s.live()
        .sources
        .iter()
        .filter_map(|x| x.fragments_sent)
        .sum()
}

/// Whether nothing was sent for the whole `window`.
fn stalled_for(s: &Session, window: Duration) -> bool {
    let a = sent(s);
    let t = Instant::now();
    while t.elapsed() < window {
        std::thread::sleep(Duration::from_millis(50));
        if sent(s) != a {
            return false;
        }
    }
    true
}

/// Four sources of 2 KiB over two readout units and two builders, with event timeouts of 200 ms
/// at the units and 400 ms at the builders. `trigger`: the trigger's lines; `unit` and
/// `builder`: each unit's and each builder's further lines; `rest`: further tables.
fn two_units_two_builders(
    mode: &str,
    events: u64,
    trigger: &str,
    unit: &str,
    builder: &str,
    rest: &str,
) -> tessera_config::Resolved {
    Topology::parse(
        &format!(
            r#"
[run]
mode = "{mode}"
events = {events}
max_fragment_size = "16 KiB"
[sources]
count = 4
fragment_size = 2048
{trigger}
[[readout]]
id = 0
sources = "0-1"
event_timeout_ms = 200
{unit}
[[readout]]
id = 1
sources = "2-3"
event_timeout_ms = 200
{unit}
[[builder]]
id = 0
event_timeout_ms = 400
{builder}
[[builder]]
id = 1
event_timeout_ms = 400
{builder}
{rest}"#
        ),
        "test.toml",
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

fn start(t: &tessera_config::Resolved, out: &std::path::Path) -> Session {
    let opts = Options {
        output: Some(out.to_path_buf()),
        status: StatusMode::Off,
        ..Default::default()
    };
    Session::start(t, &opts).unwrap()
}

/// Waits for the run's own end (its events sent), stops it in stages and finishes it.
fn to_its_end(s: Session, t: &tessera_config::Resolved) -> tessera_run::report::Report {
    let stop_reason = loop {
        if let Some(r) = s.end_reason() {
            break r;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stop = s.stop(&StopDeadlines::from(&t.topology.stop));
    s.finish(stop_reason, stop).unwrap()
}

#[test]
fn a_run_held_far_past_its_timeouts_loses_nothing() {
    held_far_past_the_timeouts("push", Depth::Shallow);
}

/// The same hold in request mode, where builders ask for each event and time out an event by its
/// age: a builder whose memory is held by built events waiting for the recorder must not count
/// the hold against the events whose answers it cannot read.
#[test]
fn a_request_mode_run_held_far_past_its_timeouts_loses_nothing() {
    held_far_past_the_timeouts("request", Depth::Shallow);
}

/// The same with readout units deep enough to hold thousands of events and builders given the
/// credit to ask for them all: the hold then fills every queue between the roles (requests the
/// units cannot serve yet, answers the builders cannot read), and must still cost time only.
#[test]
fn a_request_mode_run_with_deep_buffers_held_far_past_its_timeouts_loses_nothing() {
    held_far_past_the_timeouts("request", Depth::Deep);
}

/// How much the roles of a held run can hold.
#[derive(Clone, Copy, PartialEq)]
enum Depth {
    /// Units of 1 MiB, builders of 2 MiB, the default credit.
    Shallow,
    /// Units of 32 MiB and a credit of 4 096 events per builder.
    Deep,
}

fn held_far_past_the_timeouts(mode: &str, depth: Depth) {
    let dir = tempfile::tempdir().unwrap();
    let events = 20_000u64;
    let (unit, credits) = match depth {
        Depth::Shallow => ("1 MiB", 64),
        Depth::Deep => ("32 MiB", 4096),
    };
    // Timeouts of 200 and 400 ms against a hold of several seconds; two builders, so that a
    // readout unit held by one builder is still heard by the other.
    let t = two_units_two_builders(
        mode,
        events,
        r#"trigger = "unlimited""#,
        &format!("buffer = \"{unit}\"\nread_chunk = \"64 KiB\""),
        "buffer = \"2 MiB\"\nread_chunk = \"128 KiB\"",
        &format!(
            r#"
[request]
timeout_ms = 200
builder_timeout_ms = 400
credits = {credits}
[recorder]
queue = "2 MiB"
fsync = false
[monitor]
[[monitor.station]]
name = "hold"
mode = "blocking"
queue = 4
"#
        ),
    );
    let s = start(&t, dir.path());
    let consumer = s.monitor().unwrap().attach("hold", "held").unwrap();
    // Hold until the whole system has stood still for well over every timeout, twice over.
    let t0 = Instant::now();
    let mut stalls = 0;
    while stalls < 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the run never stalled behind the held station"
        );
        if stalled_for(&s, Duration::from_millis(1500)) {
            stalls += 1;
        } else {
            stalls = 0;
        }
    }
    assert!(
        sent(&s) < 4 * events,
        "the hold must stall the run before its end"
    );
    // Release: take and put back everything, until the run is over.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let done = done.clone();
        std::thread::spawn(move || {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let got = consumer.get(256, Wait::Timed(50)).unwrap_or_default();
                if !got.is_empty() {
                    consumer.put(got).unwrap();
                }
            }
        })
    };
    let stop_reason = loop {
        if let Some(r) = s.end_reason() {
            break r;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stop = s.stop(&StopDeadlines::from(&t.topology.stop));
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    reader.join().unwrap();
    let rep = s.finish(stop_reason, stop).unwrap();
    assert!(rep.ok(), "{}", rep.summary());
    assert_eq!(rep.events_complete, events, "{}", rep.summary());
    assert_eq!(rep.events_incomplete, 0, "{}", rep.summary());
    assert_eq!(rep.balance.rejected_total, 0, "{}", rep.summary());
    // The hold was paid in dead time at the sources.
    assert!(rep.sources.iter().all(|x| x.held_fraction > 0.0));
    let v = tessera_verify::verify_paths(&[dir.path().to_path_buf()]).unwrap();
    assert!(v.ok(), "{}", v.summary());
    assert_eq!(v.events, events);
    assert_eq!(v.incomplete_events, 0);
    drill(
        &format!(
            "hold the data path past every timeout ({mode} mode{})",
            if depth == Depth::Deep {
                ", deep buffers"
            } else {
                ""
            }
        ),
        events,
        v.events,
        0,
        rep.balance.holds,
    );
}

/// Issue 50, item 4: a stop while a blocking station's consumer holds the run. The stop used to
/// wait behind the held station until the readout and builder stages passed their deadlines and
/// gave up what they held (13 399 events incomplete in one run). The stop releases the hold
/// instead: everything in flight drains into the files, the station counts the events its
/// consumer missed, and nothing is incomplete or rejected.
#[test]
fn a_stop_while_a_blocking_station_is_held_drains_everything() {
    let dir = tempfile::tempdir().unwrap();
    let t = two_units_two_builders(
        "push",
        10_000_000,
        r#"trigger = "unlimited""#,
        "buffer = \"4 MiB\"\nread_chunk = \"64 KiB\"",
        "buffer = \"4 MiB\"\nread_chunk = \"128 KiB\"",
        r#"
[recorder]
queue = "2 MiB"
fsync = false
[monitor]
[[monitor.station]]
name = "hold"
mode = "blocking"
queue = 4
"#,
    );
    let s = start(&t, dir.path());
    let consumer = s.monitor().unwrap().attach("hold", "held").unwrap();
    let t0 = Instant::now();
    while !stalled_for(&s, Duration::from_millis(1500)) {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the run never stalled behind the held station"
        );
    }
    // Stopped with the consumer still holding (it never reads again).
    let stop = s.stop(&StopDeadlines::from(&t.topology.stop));
    let rep = s.finish("interrupted", stop).unwrap();
    assert!(rep.drained, "{}", rep.summary());
    assert!(rep.balance.holds, "{}", rep.summary());
    assert_eq!(rep.events_incomplete, 0, "{}", rep.summary());
    assert_eq!(rep.balance.rejected_total, 0, "{}", rep.summary());
    let built = rep.events_complete;
    assert!(built > 0);
    let station = rep
        .monitor
        .as_ref()
        .and_then(|m| m.stations.iter().find(|x| x.config.name == "hold"))
        .expect("the held station in the report");
    assert!(
        station.counters.skipped_at_stop > 0,
        "{:?}",
        station.counters
    );
    let v = tessera_verify::verify_paths(&[dir.path().to_path_buf()]).unwrap();
    assert!(v.ok(), "{}", v.summary());
    assert_eq!(v.events, built, "{}", rep.summary());
    drop(consumer);
    drill(
        "stop while a blocking station is held",
        built,
        v.events,
        0,
        rep.balance.holds,
    );
}

/// A run paused for longer than every event timeout builds every event complete once it
/// resumes. While paused, every source of a readout unit is silent past its timeout, so the
/// unit's floor leaves them all out: it used to promise its builders `u64::MAX`, and a builder
/// that trusts a promise at once would then send on incomplete every event whose other unit's
/// part came first after the resume. The floor stays at what the sources reached.
#[test]
fn a_run_paused_past_its_timeouts_builds_every_event_complete() {
    let dir = tempfile::tempdir().unwrap();
    let events = 20_000u64;
    let t = two_units_two_builders(
        "push",
        events,
        "trigger = \"periodic\"\nrate_hz = 5000",
        "",
        "",
        "[recorder]\nenabled = false\n[monitor]\nenabled = false\n",
    );
    let s = start(&t, dir.path());
    let t0 = Instant::now();
    while sent(&s) < 4 * 2_000 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the run never began"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    s.pause();
    // Paused until nothing has been sent for well past both timeouts.
    while !stalled_for(&s, Duration::from_millis(1500)) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the pause never held"
        );
    }
    s.resume();
    let rep = to_its_end(s, &t);
    assert!(rep.ok(), "{}", rep.summary());
    assert!(rep.balance.holds, "{}", rep.summary());
    assert_eq!(rep.events_complete, events, "{}", rep.summary());
    assert_eq!(rep.events_incomplete, 0, "{}", rep.summary());
}

/// Busy loops at normal priority, two per core, in their own processes, for as long as this
/// lives: a host whose cores are all taken.
struct BusyHost(Vec<std::process::Child>);

impl BusyHost {
    fn load() -> BusyHost {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        BusyHost(
            (0..2 * cores)
                .map(|_| {
                    std::process::Command::new("sh")
                        .args(["-c", "while :; do :; done"])
                        .spawn()
                        .expect("a busy loop")
                })
                .collect(),
        )
    }
}

impl Drop for BusyHost {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Issue 50, item 3: a blocking monitor station held mid-run on a host whose every core is busy.
/// Eight sources of two readout units on the default four driver threads: each thread used to
/// drive sources of both units, so the back-pressure that held a thread on one unit stopped
/// its source of the other unit while that unit's other sources went on; after its timeout the
/// unit built its events without them (1 022 incomplete events, 2 587 fragments late). Each
/// thread now drives one unit's sources: the hold costs dead time only, on a busy host as on a
/// quiet one.
#[test]
fn a_station_held_mid_run_on_a_busy_host_costs_dead_time_only() {
    let dir = tempfile::tempdir().unwrap();
    let events = 30_000u64;
    let t = Topology::parse(
        &format!(
            r#"
[run]
mode = "push"
events = {events}
max_fragment_size = "16 KiB"
[sources]
count = 8
fragment_size = 2048
trigger = "periodic"
rate_hz = 5000
[[readout]]
id = 0
sources = "0-3"
event_timeout_ms = 200
buffer = "2 MiB"
[[readout]]
id = 1
sources = "4-7"
event_timeout_ms = 200
buffer = "2 MiB"
[[builder]]
id = 0
event_timeout_ms = 400
[[builder]]
id = 1
event_timeout_ms = 400
[recorder]
queue = "4 MiB"
fsync = false
[monitor]
[[monitor.station]]
name = "hold"
mode = "blocking"
queue = 4
"#
        ),
        "busy.toml",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let busy = BusyHost::load();
    let s = start(&t, dir.path());
    let consumer = s.monitor().unwrap().attach("hold", "held").unwrap();
    let t0 = Instant::now();
    while !stalled_for(&s, Duration::from_millis(1500)) {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the run never stalled behind the held station"
        );
    }
    assert!(
        sent(&s) < 8 * events,
        "the hold must stall the run before its end"
    );
    // Released: the consumer goes, and the station lets events pass again.
    drop(consumer);
    let rep = to_its_end(s, &t);
    drop(busy);
    assert!(rep.ok(), "{}", rep.summary());
    assert_eq!(rep.events_complete, events, "{}", rep.summary());
    assert_eq!(rep.events_incomplete, 0, "{}", rep.summary());
    assert_eq!(rep.balance.rejected_total, 0, "{}", rep.summary());
    let v = tessera_verify::verify_paths(&[dir.path().to_path_buf()]).unwrap();
    assert!(v.ok(), "{}", v.summary());
    assert_eq!(v.events, events);
    assert_eq!(v.incomplete_events, 0);
    drill(
        "a blocking station held mid-run on a busy host",
        events,
        v.events,
        0,
        rep.balance.holds,
    );
}

/// Issue 50, item 5: 16 readout units × 60 builders at 16 KiB, every default, in one process
/// beside two busy loops per core. The pollers that carry the units' super-fragments and
/// heartbeats waited for a core for seconds while the process as a whole ran: builders called
/// units silent and built 2 214 to 4 832 events incomplete in each of four 10 s runs (their
/// parts rejected late afterwards). Their waits for a core now count as time the process did
/// not run (`tessera_net::clock`): 0 incomplete in two runs. Manual (`scripts/busy-host`): it
/// takes about 7 GB and a minute of a loaded host, too much beside the rest of CI, and its
/// outcome without the fix depends on how the host is loaded.
#[test]
#[ignore = "manual: scripts/busy-host"]
fn sixteen_units_and_sixty_builders_on_a_busy_host_build_every_event_complete() {
    let dir = tempfile::tempdir().unwrap();
    let events = 10_000u64;
    let mut text = format!(
        "[run]\nevents = {events}\n[sources]\ncount = 16\nfragment_size = 16384\n[recorder]\nfsync = false\n"
    );
    for i in 0..16 {
        text += &format!("[[readout]]\nid = {i}\n");
    }
    for i in 0..60 {
        text += &format!("[[builder]]\nid = {i}\n");
    }
    let t = Topology::parse(&text, "busy-16x60.toml").unwrap_or_else(|e| panic!("{e}"));
    let busy = BusyHost::load();
    let s = start(&t, dir.path());
    let rep = to_its_end(s, &t);
    drop(busy);
    assert!(rep.ok(), "{}", rep.summary());
    assert_eq!(rep.events_incomplete, 0, "{}", rep.summary());
    assert_eq!(rep.events_complete, events, "{}", rep.summary());
    assert_eq!(rep.balance.rejected_total, 0, "{}", rep.summary());
    drill(
        "16 readout units x 60 builders on a busy host",
        events,
        rep.events_complete,
        0,
        rep.balance.holds,
    );
}

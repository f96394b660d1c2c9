//! `tessera bench monitor`: the monitor against the CODA ET figures (issue 4).
//!
//! 1. Events of 5 KiB to one TCP consumer that reads every byte, at 100 and at 1 per call,
//!    against raw TCP moving the same bytes between the same two threads in the same run.
//! 2. The data path's recorded rate with three sampling consumers attached against none, runs
//!    alternated in the same invocation, in push mode and in request mode.
//! 3. A consumer process killed with SIGKILL while it holds a blocking station's events: how long
//!    the producer stays blocked.

use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::io::{BufRead, BufReader, IoSlice, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_config::{Mode as RunMode, MonitorSection, StationMode, StationSection};
use tessera_format::event::{EventFlags, EventRecordHeader};
use tessera_monitor::{ClientOptions, Consumer, Monitor, Server, ServerOptions, Wait};
use tessera_run::{Options, StatusMode};

use crate::{bench_topology, median, BenchArgs, Mode};

const EVENT_SIZE: usize = 5 * 1024;

fn record(event_id: u64, size: usize) -> Vec<u8> {
    let h = EventRecordHeader {
        flags: EventFlags(0),
        event_id,
        timestamp: 0,
        trigger_type: 1,
        builder_id: 0,
        fragment_count: 0,
        record_size: size as u32,
        missing: vec![],
        checksum: 0,
    };
    let mut v = Vec::with_capacity(size);
    h.encode_into(&mut v);
    v.extend((v.len()..size).map(|i| i as u8));
    v
}

/// Reads every byte the way an analysis would: a sum over 8-byte words (kept, so the compiler
/// cannot drop it).
fn touch(b: &[u8]) -> u64 {
    let mut s = 0u64;
    let mut it = b.chunks_exact(8);
    for w in &mut it {
        s = s.wrapping_add(u64::from_le_bytes(w.try_into().expect("8 bytes")));
    }
    for &x in it.remainder() {
        s = s.wrapping_add(x as u64);
    }
    s
}

fn blocking_station(name: &str, queue: usize) -> StationSection {
    StationSection {
        name: name.into(),
        mode: StationMode::Blocking,
        queue,
        ..Default::default()
    }
}

fn start_monitor(stations: Vec<StationSection>) -> Result<(Monitor, Server)> {
    let m = Monitor::new(&MonitorSection {
        stations,
        ..Default::default()
    })?;
    let s = Server::start(
        TcpListener::bind("127.0.0.1:0")?,
        m.clone(),
        ServerOptions {
            heartbeat: Duration::from_millis(1000),
            consumer_timeout: Duration::from_millis(5000),
            sampling_idle_priority: true,
            token: None,
            hold_token: None,
        },
    )?;
    Ok((m, s))
}

#[derive(Serialize)]
struct TcpPoint {
    test: &'static str,
    event_bytes: usize,
    per_call: u32,
    events_per_s: f64,
    bytes_per_s: f64,
    baseline_events_per_s: f64,
    ratio: f64,
    /// At one event per call, each call is a round trip: raw TCP's own request-and-answer rate
    /// between two threads (a 48-byte request, the record as the answer), and the ratio to it.
    #[serde(skip_serializing_if = "Option::is_none")]
    round_trips_per_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    round_trip_ratio: Option<f64>,
    checksum: u64,
}

/// Events/s from the monitor's blocking station to one TCP consumer that reads every byte and
/// puts each batch back.
fn monitor_to_tcp(per_call: u32, secs: f64) -> Result<(f64, u64)> {
    let (m, server) = start_monitor(vec![blocking_station("bench", 2000)])?;
    let addr = server.addr.to_string();
    let mut c = Consumer::attach(ClientOptions::new(&addr, "bench"))?;
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let (m, stop) = (m.clone(), stop.clone());
        std::thread::spawn(move || {
            let rec = record(1, EVENT_SIZE);
            while !stop.load(Ordering::Relaxed) {
                m.insert(&rec);
            }
        })
    };
    let mut sum = 0u64;
    let warm = Instant::now() + Duration::from_millis(300);
    while Instant::now() < warm {
        let ev = c.get(per_call, Wait::Sleep)?;
        c.put(&ev)?;
    }
    let t0 = Instant::now();
    let mut n = 0u64;
    while t0.elapsed().as_secs_f64() < secs {
        let ev = c.get(per_call, Wait::Sleep)?;
        for e in &ev {
            sum = sum.wrapping_add(touch(&e.record));
        }
        n += ev.len() as u64;
        c.put(&ev)?;
    }
    let rate = n as f64 / t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    m.close();
    let _ = producer.join();
    c.close();
    Ok((rate, sum))
}

/// The same bytes over raw TCP between two threads: batches of `per_call` records written with
/// one vectored write, read and summed on the other side.
fn raw_tcp(per_call: u32, secs: f64) -> Result<(f64, u64)> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        std::thread::spawn(move || -> std::io::Result<()> {
            let mut s = TcpStream::connect(addr)?;
            s.set_nodelay(true)?;
            let rec = record(1, EVENT_SIZE);
            while !stop.load(Ordering::Relaxed) {
                let mut slices: Vec<IoSlice<'_>> =
                    (0..per_call).map(|_| IoSlice::new(&rec)).collect();
                if tessera_net::io::write_all_vectored(&mut s, &mut slices).is_err() {
                    break;
                }
            }
            Ok(())
        })
    };
    let (mut s, _) = l.accept()?;
    let mut buf = vec![0u8; EVENT_SIZE * per_call as usize];
    let mut sum = 0u64;
    let t0 = Instant::now();
    let mut bytes = 0u64;
    while t0.elapsed().as_secs_f64() < secs {
        s.read_exact(&mut buf)?;
        sum = sum.wrapping_add(touch(&buf));
        bytes += buf.len() as u64;
    }
    let rate = bytes as f64 / EVENT_SIZE as f64 / t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    drop(s);
    let _ = writer.join();
    Ok((rate, sum))
}

/// Request-and-answer round trips per second over raw TCP between two threads: a 48-byte
/// request (a consumer's put and get together), the 5 KiB record as the answer, read and
/// summed. What one event per call can reach at most, whatever the monitor does.
fn raw_round_trips(secs: f64) -> Result<(f64, u64)> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let answerer = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = l.accept()?;
        s.set_nodelay(true)?;
        let rec = record(1, EVENT_SIZE);
        let mut request = [0u8; 48];
        while s.read_exact(&mut request).is_ok() {
            s.write_all(&rec)?;
        }
        Ok(())
    });
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let request = [1u8; 48];
    let mut buf = vec![0u8; EVENT_SIZE];
    let mut sum = 0u64;
    let mut n = 0u64;
    let t0 = Instant::now();
    while t0.elapsed().as_secs_f64() < secs {
        s.write_all(&request)?;
        s.read_exact(&mut buf)?;
        sum = sum.wrapping_add(touch(&buf));
        n += 1;
    }
    let rate = n as f64 / t0.elapsed().as_secs_f64();
    drop(s);
    let _ = answerer.join();
    Ok((rate, sum))
}

#[derive(Serialize)]
struct DataPathPoint {
    test: &'static str,
    /// "push" or "request".
    run_mode: &'static str,
    consumers: usize,
    events: u64,
    events_per_s_without: f64,
    events_per_s_with: f64,
    ratio: f64,
    sampled_per_consumer: Vec<u64>,
    repeats: usize,
}

/// How the data path point's consumers behave once attached.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Consumers {
    /// They read every byte of all they can get, at normal priority: the greedy case.
    Greedy,
    /// The same, at idle priority (Linux SCHED_IDLE), as a display started with `chrt --idle 0`
    /// on a host of the DAQ: it takes only CPU time the data path leaves.
    GreedyIdle,
    /// Attached and never asking: each station fills once and drops from then on.
    Asleep,
}

/// Runs the bench topology once, with `consumers` sampling consumers attached over TCP (each on
/// its own sampling station), in push or request mode. Returns recorded events/s and what each
/// consumer got.
fn data_path_run(
    run_mode: RunMode,
    events: u64,
    consumers: usize,
    how: Consumers,
) -> Result<(f64, Vec<u64>)> {
    let mut t = bench_topology(Mode::Record, 640, 8, events)?.topology;
    t.run.mode = run_mode;
    t.monitor.listen = "127.0.0.1:0".into();
    t.monitor.stations = (0..3)
        .map(|i| StationSection {
            name: format!("display{i}"),
            ..Default::default()
        })
        .collect();
    let text = format!("{t:?}");
    let r = t.resolve("<bench>", text)?;
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().to_path_buf();
    let addr_file = dir.join("monitor.addr");
    let stop = Arc::new(AtomicBool::new(false));
    let got: Arc<Vec<AtomicU64>> = Arc::new((0..consumers).map(|_| AtomicU64::new(0)).collect());
    let mut threads = Vec::new();
    for i in 0..consumers {
        let (stop, got, addr_file) = (stop.clone(), got.clone(), addr_file.clone());
        threads.push(std::thread::spawn(move || {
            let addr = loop {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                match std::fs::read_to_string(&addr_file) {
                    Ok(a) if a.ends_with('\n') => break a.trim().to_string(),
                    _ => std::thread::sleep(Duration::from_millis(1)),
                }
            };
            let mut o = ClientOptions::new(&addr, &format!("display{i}"));
            o.reattach = false;
            let Ok(mut c) = Consumer::attach(o) else {
                return;
            };
            match how {
                Consumers::Asleep => {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    return;
                }
                Consumers::GreedyIdle => {
                    if !tessera_monitor::server::idle_priority() {
                        eprintln!("bench monitor: SCHED_IDLE refused; the idle-priority consumers run at normal priority");
                    }
                }
                Consumers::Greedy => {}
            }
            let mut sum = 0u64;
            while !stop.load(Ordering::Relaxed) {
                match c.get(100, Wait::Timed(50)) {
                    Ok(ev) => {
                        for e in &ev {
                            sum = sum.wrapping_add(touch(&e.record));
                        }
                        got[i].fetch_add(ev.len() as u64, Ordering::Relaxed);
                    }
                    Err(_) => break,
                }
            }
            std::hint::black_box(sum);
        }));
    }
    let opts = Options {
        output: Some(dir.clone()),
        status: StatusMode::Off,
        manifest: false,
        ..Default::default()
    };
    let rep = tessera_run::run(&r, &opts).context("bench run")?;
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    let recorded = rep.recorder.as_ref().map_or(0, |x| x.events);
    if !rep.ok() || recorded != events {
        bail!("the bench run did not record every event ({recorded} of {events})");
    }
    Ok((
        recorded as f64 / rep.duration_s.max(1e-9),
        got.iter().map(|g| g.load(Ordering::Relaxed)).collect(),
    ))
}

#[derive(Serialize)]
struct KillPoint {
    test: &'static str,
    held_events: usize,
    blocked_ms: Vec<f64>,
    max_blocked_ms: f64,
}

/// A consumer in its own process: attaches to `station`, takes `n` events (none: it never asks),
/// says so, and sleeps until it is killed (`tessera bench monitor --hold-child ADDR
/// [--hold-station NAME] [--events N]`). The tests use it as a stuck or dying consumer.
pub fn hold_child(addr: &str, station: &str, n: u32) -> Result<()> {
    let mut o = ClientOptions::new(addr, station);
    o.reattach = false;
    let mut c = Consumer::attach(o)?;
    let mut held = 0usize;
    let mut keep = Vec::new();
    while held < n as usize {
        let ev = c.get(n - held as u32, Wait::Sleep)?;
        held += ev.len();
        keep.extend(ev);
    }
    println!("held {held}");
    std::io::stdout().flush()?;
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// Blocking station of `queue` events with one consumer process that takes them all and is then
/// killed: the time from the SIGKILL until the producer inserts again.
fn kill_once(queue: usize) -> Result<f64> {
    let (m, server) = start_monitor(vec![blocking_station("blocking", queue)])?;
    let exe = std::env::current_exe()?;
    let mut child = std::process::Command::new(exe)
        .args(["bench", "monitor", "--hold-child", &server.addr.to_string()])
        .arg("--events")
        .arg(queue.to_string())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting the consumer process")?;
    // Wait until it is attached: events pass a station without consumers.
    let t = Instant::now();
    while m.status().stations[0].consumers.is_empty() {
        if t.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            bail!("the consumer process never attached");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let inserted = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let (m, inserted, stop) = (m.clone(), inserted.clone(), stop.clone());
        std::thread::spawn(move || {
            let rec = record(1, EVENT_SIZE);
            while !stop.load(Ordering::Relaxed) {
                m.insert(&rec);
                inserted.fetch_add(1, Ordering::Release);
            }
        })
    };
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
    if !line.starts_with("held") {
        bail!("the consumer process said {line:?}");
    }
    // The station is full: the consumer holds `queue` events, the producer waits for room.
    while m.status().stations[0].counters.waits == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(100));
    let before = inserted.load(Ordering::Acquire);
    let t0 = Instant::now();
    child.kill()?; // SIGKILL on Unix

    while inserted.load(Ordering::Acquire) == before {
        if t0.elapsed() > Duration::from_secs(120) {
            break;
        }
        std::hint::spin_loop();
    }
    let blocked = t0.elapsed().as_secs_f64() * 1e3;
    let _ = child.wait();
    stop.store(true, Ordering::Relaxed);
    m.close();
    let _ = producer.join();
    Ok(blocked)
}

pub fn run_monitor(a: &BenchArgs) -> Result<()> {
    if let Some(addr) = &a.hold_child {
        let station = a.hold_station.as_deref().unwrap_or("blocking");
        return hold_child(addr, station, a.events.unwrap_or(100) as u32);
    }
    let secs = if a.quick { 1.0 } else { 3.0 };
    let repeat = a.repeat.unwrap_or(if a.quick { 1 } else { 3 });
    let emit = |v: &dyn erased::Json, text: String| {
        if a.json {
            println!("{}", v.json());
        } else {
            println!("{text}");
        }
    };
    if !a.json {
        println!(
            "monitor: {} KiB events; every rate is a median of {repeat} run(s), baselines taken in the same run",
            EVENT_SIZE / 1024
        );
    }
    for per_call in [100u32, 1] {
        let (mut mon, mut raw, mut trips) = (Vec::new(), Vec::new(), Vec::new());
        let mut checksum = 0u64;
        for _ in 0..repeat {
            let (b, s1) = raw_tcp(per_call, secs)?;
            let (r, s2) = monitor_to_tcp(per_call, secs)?;
            raw.push(b);
            mon.push(r);
            checksum = checksum.wrapping_add(s1).wrapping_add(s2);
            if per_call == 1 {
                let (t, s3) = raw_round_trips(secs)?;
                trips.push(t);
                checksum = checksum.wrapping_add(s3);
            }
        }
        let (r, b) = (median(&mut mon), median(&mut raw));
        let round_trips = (!trips.is_empty()).then(|| median(&mut trips));
        let p = TcpPoint {
            test: "tcp_consumer",
            event_bytes: EVENT_SIZE,
            per_call,
            events_per_s: r,
            bytes_per_s: r * EVENT_SIZE as f64,
            baseline_events_per_s: b,
            ratio: r / b,
            round_trips_per_s: round_trips,
            round_trip_ratio: round_trips.map(|t| r / t),
            checksum,
        };
        let mut text = format!(
            "  one TCP consumer reading every byte, {per_call:>3} per call: {:>9.0} events/s ({:.2} GB/s); raw TCP {:>9.0} events/s; ratio {:.2}",
            p.events_per_s,
            p.bytes_per_s / 1e9,
            p.baseline_events_per_s,
            p.ratio
        );
        if let Some(t) = round_trips {
            text += &format!(
                "; raw TCP request and answer {t:>7.0}/s, ratio {:.2}",
                r / t
            );
        }
        emit(&p, text);
    }

    let events = a.events.unwrap_or(if a.quick { 100_000 } else { 300_000 });
    // Request mode too: there a builder holds its credit until the recorder says the event is
    // in its file, so anything that delays that word (it once waited for the recorder's read
    // timeout whenever a consumer slowed the writer) shows here and not in push mode.
    for (run_mode, mode_name) in [(RunMode::Push, "push"), (RunMode::Request, "request")] {
        let (mut without, mut with, mut idle, mut asleep) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut sampled, mut sampled_idle) = (Vec::new(), Vec::new());
        for _ in 0..repeat {
            without.push(data_path_run(run_mode, events, 0, Consumers::Asleep)?.0);
            let (r, got) = data_path_run(run_mode, events, 3, Consumers::Greedy)?;
            with.push(r);
            sampled = got;
            let (r, got) = data_path_run(run_mode, events, 3, Consumers::GreedyIdle)?;
            idle.push(r);
            sampled_idle = got;
            asleep.push(data_path_run(run_mode, events, 3, Consumers::Asleep)?.0);
        }
        let (w0, w3, wi, ws) = (
            median(&mut without),
            median(&mut with),
            median(&mut idle),
            median(&mut asleep),
        );
        for (test, rate, got, what) in [
            (
                "data_path_with_sampling_consumers",
                w3,
                sampled.clone(),
                "3 sampling consumers reading all they can",
            ),
            (
                "data_path_with_idle_priority_consumers",
                wi,
                sampled_idle.clone(),
                "the same 3 at idle priority (chrt --idle 0)",
            ),
            (
                "data_path_with_sleeping_consumers",
                ws,
                vec![0, 0, 0],
                "3 sampling consumers attached and asleep",
            ),
        ] {
            let p = DataPathPoint {
                test,
                run_mode: mode_name,
                consumers: 3,
                events,
                events_per_s_without: w0,
                events_per_s_with: rate,
                ratio: rate / w0,
                sampled_per_consumer: got,
                repeats: repeat,
            };
            let text = format!(
                "  data path, {mode_name} mode (8 sources x 640 B, recorded): {:>7.0} events/s with no consumer, {:>7.0} with {what} (ratio {:.3}); sampled {:?}",
                p.events_per_s_without, p.events_per_s_with, p.ratio, p.sampled_per_consumer
            );
            emit(&p, text);
        }
    }

    let mut blocked = Vec::new();
    for _ in 0..repeat.max(3) {
        blocked.push(kill_once(100)?);
    }
    let p = KillPoint {
        test: "sigkill_blocking_consumer",
        held_events: 100,
        max_blocked_ms: blocked.iter().cloned().fold(0.0, f64::max),
        blocked_ms: blocked,
    };
    let text = format!(
        "  consumer holding a full blocking station killed with SIGKILL: producer blocked {:.1} ms at most ({:?} ms)",
        p.max_blocked_ms,
        p.blocked_ms.iter().map(|x| (x * 10.0).round() / 10.0).collect::<Vec<_>>()
    );
    emit(&p, text);
    Ok(())
}

mod erased {
    pub trait Json {
        fn json(&self) -> String;
    }
    impl<T: serde::Serialize> Json for T {
        fn json(&self) -> String {
            serde_json::to_string(self).expect("bench points serialise")
        }
    }
}

//! The monitor over real TCP on loopback: the protocol, consumer deaths seen by the server,
//! heartbeats, reattachment after a restart, commands, and a peer that sends garbage.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use tessera_config::{MonitorSection, Restore, StationMode, StationSection};
use tessera_format::event::{EventFlags, EventRecordHeader};
use tessera_format::monitor::{ErrorCode, Message, Wait};
use tessera_monitor::wire::{read_message, split_records, write_message};
use tessera_monitor::{
    client, ClientError, ClientOptions, Consumer, Monitor, Server, ServerOptions,
};

fn record(event_id: u64, payload: usize) -> Vec<u8> {
    let h = EventRecordHeader {
        flags: EventFlags(0),
        event_id,
        timestamp: 0,
        trigger_type: 1,
        builder_id: 0,
        fragment_count: 0,
        record_size: (48 + payload) as u32,
        missing: vec![],
        checksum: 0,
    };
    let mut v = Vec::new();
    h.encode_into(&mut v);
    v.extend((0..payload).map(|i| (event_id as u8) ^ (i as u8)));
    v
}

fn event_id(r: &[u8]) -> u64 {
    EventRecordHeader::decode_prefix(r, r.len())
        .unwrap()
        .unwrap()
        .0
        .event_id
}

fn start(stations: Vec<StationSection>, timeout_ms: u64) -> (Monitor, Server) {
    start_on("127.0.0.1:0", stations, timeout_ms)
}

fn start_on(addr: &str, stations: Vec<StationSection>, timeout_ms: u64) -> (Monitor, Server) {
    let m = Monitor::new(&MonitorSection {
        stations,
        ..Default::default()
    })
    .unwrap();
    let s = Server::start(
        TcpListener::bind(addr).unwrap(),
        m.clone(),
        ServerOptions {
            heartbeat: Duration::from_millis(50),
            consumer_timeout: Duration::from_millis(timeout_ms),
            // At idle priority a sampling consumer gets no CPU at all on a fully loaded
            // machine (by design: it must never slow the run); these tests assert what it gets,
            // so they serve it at normal priority.
            sampling_idle_priority: false,
            token: None,
            hold_token: None,
        },
    )
    .unwrap();
    (m, s)
}

fn blocking(name: &str) -> StationSection {
    StationSection {
        name: name.into(),
        mode: StationMode::Blocking,
        queue: 64,
        restore: Some(Restore::Station),
        ..Default::default()
    }
}

/// A consumer written from the protocol document alone, with no client library: attaches and
/// returns the open socket.
fn raw_attach(addr: &str, station: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    match read_message(&mut s, 1 << 20).unwrap().message {
        Message::Welcome { instance, .. } => assert_ne!(instance, 0),
        other => panic!("{other:?}"),
    }
    let attach = format!(r#"{{"op":"attach","station":"{station}","consumer":"raw"}}"#);
    write_message(
        &mut s,
        &Message::Command {
            json: attach.into_bytes(),
        },
    )
    .unwrap();
    assert!(matches!(
        read_message(&mut s, 1 << 20).unwrap().message,
        Message::Reply { .. }
    ));
    s
}

/// Gets `n` events on a raw connection.
fn raw_get(s: &mut TcpStream, n: u32) -> Vec<u64> {
    write_message(
        s,
        &Message::Get {
            max: n,
            wait: Wait::Sleep,
        },
    )
    .unwrap();
    loop {
        let r = read_message(s, 1 << 26).unwrap();
        match r.message {
            Message::Events { entries } => {
                let ids = split_records(&entries, &r.data)
                    .iter()
                    .map(|b| event_id(b))
                    .collect();
                return ids;
            }
            Message::Heartbeat { .. } => continue,
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_tcp_consumer_gets_every_event_of_a_blocking_station_in_order() {
    let (m, server) = start(vec![blocking("all")], 5000);
    let addr = server.addr.to_string();
    let mut c = Consumer::attach(ClientOptions::new(&addr, "all")).unwrap();
    let producer = {
        let m = m.clone();
        std::thread::spawn(move || {
            for id in 1..=3000u64 {
                m.insert(&record(id, 5120));
            }
        })
    };
    let mut next = 1u64;
    while next <= 3000 {
        let got = c.get(100, Wait::Sleep).unwrap();
        for e in &got {
            assert_eq!(&e.record[..], &record(next, 5120)[..]);
            next += 1;
        }
        c.put(&got).unwrap();
    }
    producer.join().unwrap();
    c.close();
    // Once the consumer put the last batch, every event left the chain.
    while m.status().events_out < 3000 {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(c.refused_puts, 0);
}

#[test]
fn a_consumer_whose_connection_drops_gives_its_events_back() {
    let (m, server) = start(vec![blocking("b")], 60_000);
    let addr = server.addr.to_string();
    // Events pass a station nobody is attached to: attach first.
    let mut other = Consumer::attach(ClientOptions::new(&addr, "b")).unwrap();
    let mut dying = raw_attach(&addr, "b");
    for id in 1..=10u64 {
        m.insert(&record(id, 100));
    }
    let held = raw_get(&mut dying, 4);
    assert_eq!(held, vec![1, 2, 3, 4]);
    let rest = other.get(100, Wait::Sleep).unwrap();
    assert_eq!(rest.len(), 6);
    drop(dying); // the socket closes as a killed process's would
    let back = other.get(100, Wait::Timed(10_000)).unwrap();
    let ids: Vec<u64> = back.iter().map(|e| event_id(&e.record)).collect();
    assert_eq!(ids, vec![1, 2, 3, 4]);
    other.put(&rest).unwrap();
    other.put(&back).unwrap();
    assert_eq!(m.status().stations[0].counters.restored, 4);
}

/// Asks for events on an empty station and returns once the monitor beats to it: its
/// connection is then waiting inside the `Get`.
fn raw_wait_in_get(s: &mut TcpStream) {
    write_message(
        s,
        &Message::Get {
            max: 1,
            wait: Wait::Sleep,
        },
    )
    .unwrap();
    match read_message(s, 1 << 20).unwrap().message {
        Message::Heartbeat { .. } => {}
        other => panic!("{other:?}"),
    }
}

/// A consumer that dies while its `Get` waits (the service answers a request on the thread
/// that read it, and looks at the socket while it waits) gives its events back all the same.
#[test]
fn a_consumer_that_dies_while_waiting_for_events_gives_its_events_back() {
    let (m, server) = start(vec![blocking("b")], 60_000);
    let addr = server.addr.to_string();
    let mut other = Consumer::attach(ClientOptions::new(&addr, "b")).unwrap();
    let mut dying = raw_attach(&addr, "b");
    for id in 1..=4u64 {
        m.insert(&record(id, 100));
    }
    assert_eq!(raw_get(&mut dying, 4), vec![1, 2, 3, 4]);
    raw_wait_in_get(&mut dying);
    drop(dying);
    let back = other.get(100, Wait::Timed(10_000)).unwrap();
    let ids: Vec<u64> = back.iter().map(|e| event_id(&e.record)).collect();
    assert_eq!(ids, vec![1, 2, 3, 4]);
    other.put(&back).unwrap();
    assert_eq!(m.status().stations[0].counters.restored, 4);
}

/// The same for a consumer that falls silent (no heartbeats) while its `Get` waits: declared
/// dead after the consumer timeout, its events come back.
#[test]
fn a_consumer_silent_while_waiting_for_events_is_declared_dead() {
    let (m, server) = start(vec![blocking("b")], 300);
    let addr = server.addr.to_string();
    let mut silent = raw_attach(&addr, "b");
    for id in 1..=2u64 {
        m.insert(&record(id, 10));
    }
    assert_eq!(raw_get(&mut silent, 2), vec![1, 2]);
    raw_wait_in_get(&mut silent);
    let mut heir = Consumer::attach(ClientOptions::new(&addr, "b")).unwrap();
    let mut ids = Vec::new();
    while ids.len() < 2 {
        let got = heir.get(10, Wait::Sleep).unwrap();
        ids.extend(got.iter().map(|e| event_id(&e.record)));
        heir.put(&got).unwrap();
    }
    assert_eq!(ids, vec![1, 2]);
    assert_eq!(m.status().stations[0].counters.restored, 2);
    drop(silent);
}

#[test]
fn a_silent_consumer_is_declared_dead_after_the_timeout() {
    // No heartbeat from the raw consumer: after 300 ms of silence its events come back.
    let (m, server) = start(vec![blocking("b")], 300);
    let addr = server.addr.to_string();
    let mut silent = raw_attach(&addr, "b");
    for id in 1..=3u64 {
        m.insert(&record(id, 10));
    }
    let held = raw_get(&mut silent, 3);
    assert_eq!(held, vec![1, 2, 3]);
    let mut heir = Consumer::attach(ClientOptions::new(&addr, "b")).unwrap();
    let mut ids = Vec::new();
    while ids.len() < 3 {
        let got = heir.get(10, Wait::Sleep).unwrap();
        ids.extend(got.iter().map(|e| event_id(&e.record)));
        heir.put(&got).unwrap();
    }
    assert_eq!(ids, vec![1, 2, 3]);
    // The heir itself, waiting longer than the timeout, is kept alive by its heartbeats.
    assert!(heir.get(10, Wait::Timed(1000)).unwrap().is_empty());
    assert_eq!(m.status().stations[0].consumers.len(), 1);
}

#[test]
fn a_consumer_reattaches_by_itself_after_the_monitor_restarts() {
    let (m1, s1) = start(vec![blocking("b")], 5000);
    let addr = s1.addr.to_string();
    let mut c = Consumer::attach(ClientOptions::new(&addr, "b")).unwrap();
    m1.insert(&record(1, 10));
    let first = c.get(10, Wait::Sleep).unwrap();
    assert_eq!(event_id(&first[0].record), 1);
    let old_instance = c.instance;
    m1.close();
    drop(s1);
    // A new system on the same address, with events of its own.
    let (m2, _s2) = start_on(&addr, vec![blocking("b")], 5000);
    assert_ne!(m2.instance(), old_instance);
    // Events pass a station with nobody attached, so the new system keeps producing until the
    // consumer is back.
    let mut got = Vec::new();
    let mut id = 100;
    while got.is_empty() {
        m2.insert(&record(id, 10));
        id += 1;
        got = c.get(10, Wait::Timed(100)).unwrap();
    }
    assert!(event_id(&got[0].record) >= 100);
    assert_eq!(c.instance, m2.instance());
    assert_eq!(c.restarts, 1);
    // The event from the old system cannot go into the new one: dropped, counted.
    c.put(&first).unwrap();
    assert_eq!(c.stale_puts, 1);
    c.put(&got).unwrap();
}

#[test]
fn commands_create_change_list_and_remove_stations() {
    let (m, server) = start(vec![], 5000);
    let addr = server.addr.to_string();
    let t = Duration::from_secs(5);
    let s = client::command(&addr, &serde_json::json!({"op": "status"}), t).unwrap();
    assert_eq!(s["stations"][0]["config"]["name"], "sample");
    client::command(
        &addr,
        &serde_json::json!({"op": "create", "station": {"name": "tenth", "predicate": "event_id % 10 == 0"}}),
        t,
    )
    .unwrap();
    let mut c = Consumer::attach(ClientOptions::new(&addr, "tenth")).unwrap();
    for id in 1..=30u64 {
        m.insert(&record(id, 0));
    }
    let ids: Vec<u64> = c
        .get(100, Wait::Sleep)
        .unwrap()
        .iter()
        .map(|e| event_id(&e.record))
        .collect();
    assert_eq!(ids, vec![10, 20, 30]);
    client::command(
        &addr,
        &serde_json::json!({"op": "set", "station": {"name": "tenth", "predicate": "event_id % 10 == 0", "prescale": 2}}),
        t,
    )
    .unwrap();
    for id in 31..=70u64 {
        m.insert(&record(id, 0));
    }
    let ids: Vec<u64> = c
        .get(100, Wait::Sleep)
        .unwrap()
        .iter()
        .map(|e| event_id(&e.record))
        .collect();
    assert_eq!(ids, vec![40, 60]);
    let s = client::command(&addr, &serde_json::json!({"op": "status"}), t).unwrap();
    assert_eq!(s["stations"][1]["consumers"].as_array().unwrap().len(), 1);
    assert_eq!(s["stations"][1]["config"]["prescale"], 2);
    // Refused: a sampling station cannot restore to the next station.
    match client::command(
        &addr,
        &serde_json::json!({"op": "set", "station": {"name": "tenth", "restore": "next"}}),
        t,
    ) {
        Err(ClientError::Refused {
            code: ErrorCode::Refused,
            message,
        }) => {
            assert!(message.contains("sampling"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    match client::command(&addr, &serde_json::json!({"op": "dance"}), t) {
        Err(ClientError::Refused {
            code: ErrorCode::BadRequest,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    client::command(
        &addr,
        &serde_json::json!({"op": "remove", "station": "tenth"}),
        t,
    )
    .unwrap();
    assert_eq!(m.status().stations.len(), 1);
}

#[test]
fn garbage_from_a_peer_closes_only_that_connection() {
    let (m, server) = start(vec![], 5000);
    let addr = server.addr.to_string();
    for junk in [
        vec![0u8; 64],
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        (0..=255u8).cycle().take(5000).collect(),
    ] {
        let mut s = TcpStream::connect(&addr).unwrap();
        let _ = s.write_all(&junk);
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        // Welcome, then the server closes on the bad message.
        let mut n = 0;
        while read_message(&mut s, 1 << 20).is_ok() {
            n += 1;
            assert!(n < 100);
        }
    }
    let mut c = Consumer::attach(ClientOptions::new(&addr, "sample")).unwrap();
    m.insert(&record(1, 0));
    assert_eq!(c.get(1, Wait::Sleep).unwrap().len(), 1);
}

/// Issue 11, item 18 (found by a consumer written from docs/ alone): a command with a field the
/// protocol does not know is refused, `status` included; a `get` with an undefined wait mode is
/// answered with an error (bad request) before the connection closes; a sampling station counts
/// no `put` where none was sent.
#[test]
fn unknown_fields_bad_waits_and_sampling_puts_are_what_the_spec_says() {
    let (m, server) = start(vec![], 5000);
    let addr = server.addr.to_string();
    let mut s = raw_attach(&addr, "sample");
    for id in 0..3 {
        m.insert(&record(id, 8));
    }
    assert_eq!(raw_get(&mut s, 3), vec![0, 1, 2]);
    let command = |s: &mut TcpStream, json: &str| -> Message {
        write_message(
            s,
            &Message::Command {
                json: json.as_bytes().to_vec(),
            },
        )
        .unwrap();
        loop {
            match read_message(s, 1 << 20).unwrap().message {
                Message::Heartbeat { .. } => continue,
                other => return other,
            }
        }
    };
    match command(&mut s, r#"{"op":"status","verbose":true}"#) {
        Message::Error { code, message } => {
            assert_eq!(code, ErrorCode::BadRequest, "{message}");
            assert!(message.contains("verbose"), "{message}");
        }
        other => panic!("status with an unknown field was taken: {other:?}"),
    }
    let status = match command(&mut s, r#"{"op":"status"}"#) {
        Message::Reply { json } => serde_json::from_slice::<serde_json::Value>(&json).unwrap(),
        other => panic!("{other:?}"),
    };
    let c = &status["stations"][0]["counters"];
    assert_eq!(c["delivered"], 3, "{status}");
    assert_eq!(c["put"], 0, "no put was sent: {status}");
    // A get whose wait mode is 7 (0, 1 and 2 are defined), with its CRC right.
    let mut get = Message::Get {
        max: 1,
        wait: Wait::Poll,
    }
    .encode();
    get[20..24].copy_from_slice(&7u32.to_le_bytes());
    let crc =
        tessera_format::crc::crc32c_append(tessera_format::crc::crc32c(&get[..12]), &get[16..32]);
    get[12..16].copy_from_slice(&crc.to_le_bytes());
    s.write_all(&get).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut told = None;
    while let Ok(r) = read_message(&mut s, 1 << 20) {
        if let Message::Error { code, message } = r.message {
            told = Some((code, message));
        }
    }
    let (code, message) = told.expect("the connection closed without saying why");
    assert_eq!(code, ErrorCode::BadRequest);
    assert!(message.contains("wait"), "{message}");
}

/// Issue 11, item 11: a monitor bound beyond loopback (here: told to ask for the token, as it
/// then is) refuses every command but `status` without the run control's token, so that a host
/// on an allowed network cannot attach a blocking consumer and hold the recorder; the reference
/// client presents the token it is given.
#[test]
fn beyond_loopback_commands_need_the_token() {
    let m = Monitor::new(&MonitorSection::default()).unwrap();
    let server = Server::start(
        TcpListener::bind("127.0.0.1:0").unwrap(),
        m.clone(),
        ServerOptions {
            heartbeat: Duration::from_millis(50),
            consumer_timeout: Duration::from_millis(5000),
            sampling_idle_priority: false,
            token: Some("s3cret".into()),
            hold_token: None,
        },
    )
    .unwrap();
    let addr = server.addr.to_string();
    let mut create = blocking("intruder");
    create.queue = 4;
    for token in [None, Some("wrong")] {
        let mut o = ClientOptions::new(&addr, "intruder");
        o.create = Some(create.clone());
        o.reattach = false;
        o.token = token.map(str::to_owned);
        match Consumer::attach(o) {
            Err(tessera_monitor::client::ClientError::Refused { code, message }) => {
                assert_eq!(code, ErrorCode::Refused, "{message}");
                assert!(message.contains("token"), "{message}");
            }
            Err(e) => panic!("refused for another reason: {e}"),
            Ok(_) => panic!("attached with token {token:?}"),
        }
    }
    assert_eq!(
        m.station_names(),
        vec!["sample".to_string()],
        "a station was created"
    );
    // Status reads only: no token needed.
    let mut s = TcpStream::connect(&addr).unwrap();
    let _welcome = read_message(&mut s, 1 << 20).unwrap();
    write_message(
        &mut s,
        &Message::Command {
            json: br#"{"op":"status"}"#.to_vec(),
        },
    )
    .unwrap();
    assert!(matches!(
        read_message(&mut s, 1 << 20).unwrap().message,
        Message::Reply { .. }
    ));
    let mut o = ClientOptions::new(&addr, "sample");
    o.token = Some("s3cret".into());
    let mut c = Consumer::attach(o).unwrap();
    m.insert(&record(1, 0));
    assert_eq!(c.get(1, Wait::Sleep).unwrap().len(), 1);
}

/// Issue 50, item 7: on loopback, where a token is set, a blocking station (which can hold the
/// run) is neither created nor joined without it; sampling stays open to any local display.
#[test]
fn on_loopback_a_blocking_station_needs_the_token_where_one_is_set() {
    let section = MonitorSection {
        stations: vec![
            StationSection {
                name: "sample".into(),
                ..Default::default()
            },
            blocking("recorder2"),
        ],
        ..Default::default()
    };
    let m = Monitor::new(&section).unwrap();
    let server = Server::start(
        TcpListener::bind("127.0.0.1:0").unwrap(),
        m.clone(),
        ServerOptions {
            heartbeat: Duration::from_millis(50),
            consumer_timeout: Duration::from_millis(5000),
            sampling_idle_priority: false,
            token: None,
            hold_token: Some("s3cret".into()),
        },
    )
    .unwrap();
    let addr = server.addr.to_string();
    let mut holder = blocking("holder");
    holder.queue = 2;
    let attach = |station: &str, create: Option<StationSection>, token: Option<&str>| {
        let mut o = ClientOptions::new(&addr, station);
        o.create = create;
        o.reattach = false;
        o.token = token.map(str::to_owned);
        Consumer::attach(o)
    };
    for (station, create) in [("holder", Some(holder.clone())), ("recorder2", None)] {
        for token in [None, Some("wrong")] {
            match attach(station, create.clone(), token) {
                Err(tessera_monitor::client::ClientError::Refused { code, message }) => {
                    assert_eq!(code, ErrorCode::Refused, "{message}");
                    assert!(
                        message.contains("blocking") && message.contains("token"),
                        "{message}"
                    );
                }
                Err(e) => panic!("{station}: refused for another reason: {e}"),
                Ok(_) => panic!("{station}: attached with token {token:?}"),
            }
        }
    }
    assert!(!m.station_names().contains(&"holder".to_string()));
    // A sampling station needs no token on loopback.
    let mut c = attach("sample", None, None).unwrap();
    m.insert(&record(1, 0));
    assert_eq!(c.get(1, Wait::Sleep).unwrap().len(), 1);
    // The token lets a blocking consumer in.
    assert!(attach("recorder2", None, Some("s3cret")).is_ok());
}

/// A processing consumer over TCP replaces records as it puts them back: small replacements
/// wait for its next request (one write), large ones (beyond the client's 64 KiB of waiting
/// puts) go out at once from its own buffers. Either way the next station gets exactly the
/// new records, in order, and the put leaves nothing held.
#[test]
fn records_replaced_over_tcp_reach_the_next_station_small_or_large() {
    let (m, server) = start(vec![blocking("process"), blocking("after")], 5000);
    let after = m.attach("after", "downstream").unwrap();
    let mut c = Consumer::attach(ClientOptions::new(&server.addr.to_string(), "process")).unwrap();
    // (event, size of its replacement): small ones that wait, and one past 64 KiB.
    let plan = [(1u64, 100usize), (2, 3000), (3, 200_000), (4, 10)];
    for (id, _) in plan {
        m.insert(&record(id, 64));
    }
    let mut got = Vec::new();
    while got.len() < plan.len() {
        got.extend(c.get(10, Wait::Sleep).unwrap());
    }
    let replacements: Vec<Vec<u8>> = plan.iter().map(|&(id, n)| record(id + 100, n)).collect();
    for (e, r) in got.iter().zip(&replacements) {
        c.put_with([(e, Some(&r[..]))]).unwrap();
    }
    c.close();
    let mut seen = Vec::new();
    while seen.len() < plan.len() {
        let ev = after.get(10, Wait::Timed(5000)).unwrap();
        assert!(
            !ev.is_empty(),
            "the replaced records never arrived: {seen:?}"
        );
        seen.extend(ev.iter().map(|e| e.bytes.to_vec()));
        after.put(ev).unwrap();
    }
    assert_eq!(seen, replacements);
    assert_eq!(c.refused_puts, 0);
    let st = &m.status().stations[0];
    assert_eq!((st.counters.put, st.counters.restored), (4, 0), "{st:?}");
}

/// Issue 50, item 7: the token never crosses the monitor port. A command that carries it is
/// refused; a proof taken over one connection's challenge opens that connection only, and the
/// same proof replayed on another connection (captured, say) is refused.
#[test]
fn a_proof_of_the_token_opens_its_connection_only_and_the_token_itself_is_refused() {
    let m = Monitor::new(&MonitorSection::default()).unwrap();
    let server = Server::start(
        TcpListener::bind("127.0.0.1:0").unwrap(),
        m.clone(),
        ServerOptions {
            heartbeat: Duration::from_millis(50),
            consumer_timeout: Duration::from_millis(5000),
            sampling_idle_priority: false,
            token: Some("s3cret".into()),
            hold_token: None,
        },
    )
    .unwrap();
    let addr = server.addr.to_string();
    let ask = |s: &mut TcpStream, json: serde_json::Value| -> Message {
        write_message(
            s,
            &Message::Command {
                json: serde_json::to_vec(&json).unwrap(),
            },
        )
        .unwrap();
        loop {
            let m = read_message(s, 1 << 20).unwrap().message;
            if !matches!(m, Message::Heartbeat { .. }) {
                return m;
            }
        }
    };
    let open = || {
        let mut s = TcpStream::connect(&addr).unwrap();
        let _welcome = read_message(&mut s, 1 << 20).unwrap();
        s
    };
    let refused = |m: Message| {
        matches!(
            m,
            Message::Error {
                code: ErrorCode::Refused,
                ..
            }
        )
    };
    // The token itself: refused, whatever it is.
    let mut s = open();
    let m = ask(
        &mut s,
        serde_json::json!({"op": "attach", "station": "sample", "token": "s3cret"}),
    );
    assert!(refused(m));
    // A proof over this connection's challenge.
    let mut s = open();
    let Message::Reply { json } = ask(&mut s, serde_json::json!({"op": "challenge"})) else {
        panic!("no challenge");
    };
    let nonce = serde_json::from_slice::<serde_json::Value>(&json).unwrap()["nonce"]
        .as_str()
        .unwrap()
        .to_owned();
    let proof =
        tessera_format::auth::proof("s3cret", tessera_monitor::server::MONITOR_PROOF, &nonce, "");
    let attach = serde_json::json!({"op": "attach", "station": "sample", "proof": proof});
    assert!(matches!(ask(&mut s, attach.clone()), Message::Reply { .. }));
    // Replayed on another connection, with or without a challenge of its own: refused.
    let mut t = open();
    assert!(refused(ask(&mut t, attach.clone())));
    let mut t = open();
    let _ = ask(&mut t, serde_json::json!({"op": "challenge"}));
    assert!(refused(ask(&mut t, attach)));
}

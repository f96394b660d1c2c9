//! A request-mode builder driven over real sockets by an event manager, two readout units and a
//! recorder written here from docs/request-protocol.md: held by its recorder while one unit is
//! silent, it cuts that unit's events as their timeout says, and beats to the event manager all
//! the while (a builder held by its recorder is alive).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_builder::{BuilderUnit, PullConfig};
use tessera_filter::{Filter, FragmentRef};
use tessera_format::request::{decode, AnswerHeader, Channel, Decoded, Message, Role};
use tessera_format::wire::{encode_fragment, FragmentHeader};

struct AcceptAll;

impl Filter for AcceptAll {
    fn roi(&self) -> &[u32] {
        &[]
    }
    fn accept(&self, _: u64, _: &[FragmentRef<'_>]) -> bool {
        true
    }
}

/// Reads request-protocol messages from one connection.
struct Peer {
    s: TcpStream,
    buf: Vec<u8>,
}

impl Peer {
    fn accept(l: &TcpListener) -> Peer {
        let (s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        Peer { s, buf: Vec::new() }
    }

    fn next(&mut self) -> Message {
        self.next_or_closed().expect("closed")
    }

    /// The next message, or `None` once the peer closed the connection.
    fn next_or_closed(&mut self) -> Option<Message> {
        loop {
            if let Ok(Decoded::Message(m, n)) = decode(&self.buf, 1 << 20) {
                self.buf.drain(..n);
                return Some(m);
            }
            let mut b = [0u8; 65536];
            match self.s.read(&mut b) {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.buf.extend_from_slice(&b[..n]),
            }
        }
    }
}

/// Readout unit `ru` (whose one source is `ru` too): its answers to `events`, each one
/// fragment of `size` bytes, with the tag the builder asked with.
fn answers(ru: u32, tag: u64, events: impl IntoIterator<Item = u64>, size: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for ev in events {
        let mut body = Vec::new();
        let h = FragmentHeader {
            status: 0,
            source_id: ru,
            trigger_type: 1,
            event_id: ev,
            timestamp: ev,
            payload_size: 0,
        };
        encode_fragment(&mut body, &h, &vec![0xCD; size]);
        AnswerHeader {
            tag,
            event_id: ev,
            readout_unit: ru,
            fragment_count: 1,
            total_size: 0,
            missing: Vec::new(),
        }
        .encode_into(&mut out, body.len());
        out.extend_from_slice(&body);
    }
    out
}

/// Waits (bounded) for `cond`.
fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < Duration::from_secs(60), "never: {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Readout units 0 and 1 listening on `units`, each with one source, its own ID.
fn two_units(units: &[TcpListener; 2]) -> Vec<(u32, String, Vec<u32>)> {
    (0..2u32)
        .map(|u| {
            (
                u,
                units[u as usize].local_addr().unwrap().to_string(),
                vec![u],
            )
        })
        .collect()
}

/// Takes the builder's connections: the event manager's (its hello read), then each unit's
/// control connection (requests) and data connection (answers), in the units' order.
fn take_connections(em: &TcpListener, units: &[TcpListener; 2]) -> (Peer, Vec<Peer>, Vec<Peer>) {
    let mut manager = Peer::accept(em);
    assert!(matches!(manager.next(), Message::Hello { .. }));
    let mut control = Vec::new();
    let mut data = Vec::new();
    for l in units {
        for _ in 0..2 {
            let mut p = Peer::accept(l);
            match p.next() {
                Message::Hello {
                    role: Role::BuilderUnit,
                    channel: Channel::Control,
                    ..
                } => control.push(p),
                Message::Hello {
                    role: Role::BuilderUnit,
                    channel: Channel::Data,
                    ..
                } => data.push(p),
                other => panic!("{other:?}"),
            }
        }
    }
    (manager, control, data)
}

/// Unit 1 answers events 0-399 and then nothing more; unit 0 answers all 512 after it. Unit 0's
/// answers complete events 0-399, whose records fill the link to a recorder that reads nothing
/// and the builder's queue to it, so unit 0's reader waits there. Unit 1's reader is free, and
/// proves unit 1 silent: events 400-511 are cut, by the sweep, which then waits for the
/// recorder's queue too. Heartbeats sent from the sweep stopped there, and the event manager
/// would have declared the builder dead; they must go on.
#[test]
fn a_builder_held_by_its_recorder_beats_on_while_it_cuts_late_events() {
    const EVENTS: u64 = 512;
    const ANSWERED_BY_UNIT_1: u64 = 400;
    const SIZE: usize = 32 * 1024;
    let em = TcpListener::bind("127.0.0.1:0").unwrap();
    let units = [
        TcpListener::bind("127.0.0.1:0").unwrap(),
        TcpListener::bind("127.0.0.1:0").unwrap(),
    ];
    let rec = TcpListener::bind("127.0.0.1:0").unwrap();
    let b = BuilderUnit::start_pull(PullConfig {
        id: 0,
        event_manager: em.local_addr().unwrap().to_string(),
        readout_units: two_units(&units),
        recorder: Some(rec.local_addr().unwrap().to_string()),
        credits: EVENTS as u32,
        heartbeat: Duration::from_millis(20),
        // Long enough for unit 0's answers to fill the recorder's queue first.
        event_timeout: Duration::from_millis(2000),
        filter: Arc::new(AcceptAll),
        max_message: 1 << 20,
        // Room for every answer: the readers never wait for memory.
        buffer: 128 << 20,
        read_chunk: 1 << 20,
        takeover: Duration::ZERO,
        takeover_memory: 1024,
        recorder_takeover: std::time::Duration::ZERO,
    })
    .unwrap();
    let stats = b.stats.clone();
    // The recorder: takes the connection and reads nothing.
    let _recorder = rec.accept().unwrap();
    let (mut manager, mut control, mut data) = take_connections(&em, &units);
    // The event manager's reader: notes the latest heartbeat as it comes.
    let last_beat = Arc::new(AtomicU64::new(0));
    let mut to_builder = manager.s.try_clone().unwrap();
    let reader = {
        let last_beat = last_beat.clone();
        std::thread::spawn(move || {
            while let Some(m) = manager.next_or_closed() {
                match m {
                    Message::Heartbeat { sequence } => last_beat.store(sequence, Ordering::Relaxed),
                    Message::Credit { .. } | Message::Done { .. } | Message::End { .. } => {}
                    other => panic!("{other:?}"),
                }
            }
        })
    };
    to_builder
        .write_all(
            &Message::Assign {
                events: (0..EVENTS).map(|e| (e, 0)).collect(),
            }
            .encode(),
        )
        .unwrap();
    let mut tag = 0;
    for c in &mut control {
        for _ in 0..EVENTS {
            match c.next() {
                Message::Request { tag: t, .. } => tag = t,
                other => panic!("{other:?}"),
            }
        }
    }
    // Unit 1 first, read whole before unit 0 says anything: unit 0's answers complete events.
    data[1]
        .s
        .write_all(&answers(1, tag, 0..ANSWERED_BY_UNIT_1, SIZE))
        .unwrap();
    until("unit 1's answers read", || {
        stats.links[1].fragments.load(Ordering::Relaxed) == ANSWERED_BY_UNIT_1
    });
    let unit0 = {
        let mut s = data[0].s.try_clone().unwrap();
        std::thread::spawn(move || {
            // Blocks once the builder stops reading; ends when the builder closes the link.
            let _ = s.write_all(&answers(0, tag, 0..EVENTS, SIZE));
        })
    };
    // Unit 0's answers fill the builder's queue to the recorder (256 events of two fragments;
    // its reader then waits there), well within unit 1's timeout.
    until("the recorder's queue full", || {
        stats.queued_fragments.load(Ordering::Relaxed) >= 2 * 256
    });
    // The sweep cuts the events unit 1 never answered, and then waits for the recorder.
    until("an event cut for unit 1's silence", || {
        stats.events_incomplete.load(Ordering::Relaxed) > 0
    });
    // Heartbeats go on: many beats' worth of them after the cut.
    let cut_at = last_beat.load(Ordering::Relaxed);
    until("heartbeats after the cut", || {
        last_beat.load(Ordering::Relaxed) >= cut_at + 20
    });
    assert!(
        stats.queued_fragments.load(Ordering::Relaxed) > 0,
        "the recorder held the builder all along"
    );
    b.abort();
    drop(_recorder);
    drop(data);
    b.join();
    let _ = unit0.join();
    drop(to_builder);
    reader.join().unwrap();
}

/// Accepts every event, after an RoI step over `0` when it is not empty.
struct Roi(Vec<u32>);

impl Filter for Roi {
    fn roi(&self) -> &[u32] {
        &self.0
    }
    fn accept(&self, _: u64, _: &[FragmentRef<'_>]) -> bool {
        true
    }
}

/// Unit 1 answers every event but 3, and goes on answering while event 3 waits: it is never
/// silent, so the silence rule never cuts event 3. Its answers to later requests of the same
/// sources, sent after event 3's on the same connection, prove that it took event 3's request
/// and that the sources of that request had delivered past event 3 (request-protocol §4.3,
/// rule 4): a builder timeout after the first of them, proven by a read that left its socket
/// empty, event 3 stops waiting for unit 1 and is built without its source, counted as an
/// overdue request. The answer that comes at last is counted late.
#[test]
fn a_unit_that_answers_later_requests_but_never_one_has_that_event_cut() {
    never_answers_one(Roi(Vec::new()));
}

/// The same when unit 1 is asked only for the rest of accepted events, those requests sent by
/// whichever answer reader completed the RoI step (in the line of RoI steps).
#[test]
fn a_unit_that_never_answers_the_rest_of_one_event_has_that_event_cut() {
    never_answers_one(Roi(vec![0]));
}

/// The same when unit 1 is in the RoI: the RoI step stops waiting for it, the filter decides
/// on what came, and the event, with nothing left to ask, is built.
#[test]
fn a_unit_that_never_answers_one_roi_request_has_that_event_cut() {
    never_answers_one(Roi(vec![0, 1]));
}

/// Units 0 and 1 (one source each, the unit's ID) answer every request as it comes, one event
/// at a time, except unit 1 event 3's, until event 3 is reported done.
fn never_answers_one(filter: Roi) {
    const SKIPPED: u64 = 3;
    let em = TcpListener::bind("127.0.0.1:0").unwrap();
    let units = [
        TcpListener::bind("127.0.0.1:0").unwrap(),
        TcpListener::bind("127.0.0.1:0").unwrap(),
    ];
    let b = BuilderUnit::start_pull(PullConfig {
        id: 0,
        event_manager: em.local_addr().unwrap().to_string(),
        readout_units: two_units(&units),
        recorder: None,
        credits: 16,
        heartbeat: Duration::from_millis(100),
        // Both rules wait this long: the silence rule would fire first only if this thread
        // stopped answering for as long, so it is well above any stall of a loaded machine.
        event_timeout: Duration::from_millis(3000),
        filter: Arc::new(filter),
        max_message: 1 << 20,
        buffer: 64 << 20,
        read_chunk: 1 << 20,
        takeover: Duration::ZERO,
        takeover_memory: 1024,
        recorder_takeover: std::time::Duration::ZERO,
    })
    .unwrap();
    let stats = b.stats.clone();
    let (mut manager, mut control, mut data) = take_connections(&em, &units);
    // The event manager's reader: notes when event 3 is reported done.
    let skipped_done = Arc::new(AtomicBool::new(false));
    let mut to_builder = manager.s.try_clone().unwrap();
    let reader = {
        let skipped_done = skipped_done.clone();
        std::thread::spawn(move || {
            while let Some(m) = manager.next_or_closed() {
                if let Message::Done { events } = m {
                    if events.iter().any(|e| e.0 == SKIPPED) {
                        skipped_done.store(true, Ordering::Release);
                    }
                }
            }
        })
    };
    // One event at a time, each answered by both units except event 3 by unit 1, until event 3
    // is done: unit 1 answers the whole while. Each unit is asked once an event: for all of the
    // event (no RoI, or an RoI of both units), or unit 0 for the RoI and, once it answered, unit 1
    // for the rest.
    let t = Instant::now();
    let mut next = 0u64;
    let mut skipped_tag = 0;
    while !skipped_done.load(Ordering::Acquire) {
        assert!(t.elapsed() < Duration::from_secs(60), "event 3 never cut");
        to_builder
            .write_all(
                &Message::Assign {
                    events: vec![(next, 0)],
                }
                .encode(),
            )
            .unwrap();
        for (u, c) in control.iter_mut().enumerate() {
            let tag = match c.next() {
                Message::Request { tag, event_id, .. } if event_id == next => tag,
                other => panic!("{other:?}"),
            };
            if u == 1 && next == SKIPPED {
                skipped_tag = tag;
            } else {
                data[u]
                    .s
                    .write_all(&answers(u as u32, tag, [next], 64))
                    .unwrap();
            }
        }
        next += 1;
    }
    assert!(next > SKIPPED + 1, "later events answered first");
    assert_eq!(stats.overdue_requests.load(Ordering::Relaxed), 1);
    assert_eq!(stats.events_incomplete.load(Ordering::Relaxed), 1);
    assert_eq!(
        *stats.missing_by_source.lock(),
        [(1u32, 1u64)].into_iter().collect()
    );
    // Unit 1's answer at last: late, counted.
    data[1]
        .s
        .write_all(&answers(1, skipped_tag, [SKIPPED], 64))
        .unwrap();
    until("the late answer counted", || {
        stats.late_fragments.load(Ordering::Relaxed) == 1
    });
    b.abort();
    drop(data);
    drop(control);
    b.join();
    drop(to_builder);
    reader.join().unwrap();
}

//! Issue 11, item 9 at the event manager: one connection per declared identity. An unknown
//! builder or readout unit, or a second connection for one that is connected, is refused
//! (closed, counted, logged) and never takes the first one's place.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use tessera_format::request::{decode, Channel, Decoded, Message, Role};
use tessera_manager::{EventManager, ManagerConfig, Settings};

fn manager() -> (EventManager, String) {
    manager_of(&[0, 1], 64)
}

/// A manager of readout unit 0 and `builders`, each giving `builder_credits`, with heartbeat
/// timeouts far beyond any test.
fn manager_of(builders: &[u32], builder_credits: u32) -> (EventManager, String) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let m = EventManager::start(ManagerConfig {
        listener: l,
        readout_units: vec![0],
        builders: builders.to_vec(),
        settings: Settings {
            clear_group: 1,
            clear_delay_ns: 1_000_000,
            heartbeat_timeout_ns: 600_000_000_000,
            busy_threshold: 1 << 20,
            done_memory: 1 << 10,
            builder_credits,
            builder_wait_ns: u64::MAX,
        },
    })
    .unwrap();
    (m, addr)
}

fn connect(addr: &str, role: Role, id: u32) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(
        &Message::Hello {
            role,
            channel: Channel::Control,
            id,
        }
        .encode(),
    )
    .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s
}

/// Waits (bounded) for `cond`.
fn until(mut cond: impl FnMut() -> bool) {
    let t = std::time::Instant::now();
    while !cond() {
        assert!(t.elapsed() < Duration::from_secs(60), "never happened");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The peer closed the connection (end of stream, or a reset).
fn closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 64];
    matches!(s.read(&mut b), Ok(0))
        || matches!(s.read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset)
}

/// Reads one message.
fn next(s: &mut TcpStream, buf: &mut Vec<u8>) -> Message {
    loop {
        if let Ok(Decoded::Message(m, n)) = decode(buf, 1 << 20) {
            buf.drain(..n);
            return m;
        }
        let mut b = [0u8; 4096];
        let n = s.read(&mut b).unwrap();
        assert!(n > 0, "closed");
        buf.extend_from_slice(&b[..n]);
    }
}

#[test]
fn unknown_and_second_connections_are_refused_and_the_first_keeps_its_place() {
    let (m, addr) = manager();
    let mut b0 = connect(&addr, Role::BuilderUnit, 0);
    // Hellos are read concurrently: the second must come after the first was admitted.
    until(|| m.view().builders.iter().any(|b| b.0 == 0 && b.1));
    let mut unknown = connect(&addr, Role::BuilderUnit, 77);
    assert!(closed(&mut unknown), "builder 77 is not in the topology");
    let mut again = connect(&addr, Role::BuilderUnit, 0);
    assert!(closed(&mut again), "builder 0 is connected already");
    let mut ru = connect(&addr, Role::ReadoutUnit, 0);
    until(|| m.view().readout_units_connected == 1);
    let mut ru_again = connect(&addr, Role::ReadoutUnit, 0);
    assert!(closed(&mut ru_again), "readout unit 0 is connected already");
    let mut ru_unknown = connect(&addr, Role::ReadoutUnit, 5);
    assert!(closed(&mut ru_unknown));
    let v = m.view();
    assert_eq!(v.counts.refused_connections, 4, "{:?}", v.errors);
    assert!(
        v.errors.iter().any(|e| e.contains("builder 77")),
        "{:?}",
        v.errors
    );
    // The first builder 0 still gets the work: builder 1 and the unit speak, gathering ends.
    let b1 = connect(&addr, Role::BuilderUnit, 1);
    let mut b1w = b1.try_clone().unwrap();
    b1w.write_all(&Message::Credit { credits: 0 }.encode())
        .unwrap();
    b0.write_all(&Message::Credit { credits: 2 }.encode())
        .unwrap();
    ru.write_all(
        &Message::Announce {
            event_ids: vec![7, 8],
        }
        .encode(),
    )
    .unwrap();
    let mut buf = Vec::new();
    let mut got = Vec::new();
    while got.len() < 2 {
        match next(&mut b0, &mut buf) {
            Message::Assign { events } => got.extend(events.iter().map(|e| e.0)),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(got, vec![7, 8]);
    m.abort();
    m.join();
}

/// A builder may read no assignment for a long while (its reader waits for readout units that
/// take no more requests): the assignments wait for it, as many as its credit allows, and it is
/// not taken for dead. With a queue of 1 024 messages behind the socket's buffers, a builder of
/// large credit whose units held its requests was declared dead while it beat on. A builder that
/// gives more credit than `request.credits` and reads nothing is declared dead once more than
/// that waits for it, rather than queued for without bound.
#[test]
fn a_builder_that_reads_no_assignment_within_its_credit_is_not_declared_dead() {
    const CREDIT: u32 = 200_000;
    for (configured, alive) in [(CREDIT, true), (64, false)] {
        let (m, addr) = manager_of(&[0], configured);
        let b0 = connect(&addr, Role::BuilderUnit, 0);
        let mut w = b0.try_clone().unwrap();
        w.write_all(&Message::Credit { credits: CREDIT }.encode())
            .unwrap();
        let mut ru = connect(&addr, Role::ReadoutUnit, 0);
        // One announcement per event: one assignment message per event, none read (200 000 of
        // them are more than the sockets' buffers hold).
        let mut out = Vec::new();
        for e in 0..CREDIT as u64 {
            out.extend_from_slice(&Message::Announce { event_ids: vec![e] }.encode());
        }
        ru.write_all(&out).unwrap();
        until(|| m.view().counts.assigned == CREDIT as u64 || !m.view().errors.is_empty());
        let v = m.view();
        if alive {
            assert!(v.errors.is_empty(), "{:?}", v.errors);
            assert_eq!(v.counts.assigned, CREDIT as u64);
            assert!(v.builders[0].1, "builder 0 is alive");
        } else {
            assert!(
                v.errors
                    .iter()
                    .any(|e| e.contains("builder 0 declared dead")),
                "{:?}",
                v.errors
            );
            assert!(!v.builders[0].1);
        }
        drop(b0);
        m.abort();
        m.join();
    }
}

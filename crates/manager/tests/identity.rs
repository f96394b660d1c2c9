//! Issue 11, item 9 at the event manager: one connection per declared identity. An unknown
//! builder or readout unit, or a second connection for one that is connected, is refused
//! (closed, counted, logged) and never takes the first one's place.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use tessera_format::request::{decode, Channel, Decoded, Message, Role};
use tessera_manager::{EventManager, ManagerConfig, Settings};

fn manager() -> (EventManager, String) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let m = EventManager::start(ManagerConfig {
        listener: l,
        readout_units: vec![0],
        builders: vec![0, 1],
        settings: Settings {
            clear_group: 1,
            clear_delay_ns: 1_000_000,
            heartbeat_timeout_ns: 600_000_000_000,
            busy_threshold: 1 << 20,
            done_memory: 1 << 10,
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

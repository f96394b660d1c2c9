//! A builder fed by readout units written here from docs/wire-format.md's link messages over
//! real sockets. On two rails: its promises follow the slowest open rail, and a rail that breaks
//! loses only what was sent its way. With small buffers: a unit that promises only in its
//! periodic heartbeat (the spec's "should" not followed) costs time, never a stand-still.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tessera_builder::{BuilderConfig, BuilderStats, BuilderUnit};
use tessera_format::link::{PeerEnd, PeerHello, PeerRole, Progress, SuperFragmentHeader};
use tessera_format::wire::{encode_fragment, FragmentHeader};

/// Readout unit `ru` (whose one source is `ru` too) on one rail.
struct Rail {
    ru: u32,
    s: TcpStream,
    sent: u64,
}

impl Rail {
    fn open(ru: u32, addr: std::net::SocketAddr) -> Rail {
        let mut s = TcpStream::connect(addr).unwrap();
        let hello = PeerHello {
            role: PeerRole::ReadoutUnit,
            id: ru,
            flags: 0,
        };
        s.write_all(&hello.encode()).unwrap();
        Rail { ru, s, sent: 0 }
    }

    fn events(&mut self, ids: impl IntoIterator<Item = u64>) {
        let mut out = Vec::new();
        for ev in ids {
            let mut body = Vec::new();
            let h = FragmentHeader {
                status: 0,
                source_id: self.ru,
                trigger_type: 1,
                event_id: ev,
                timestamp: ev,
                payload_size: 0,
            };
            encode_fragment(&mut body, &h, &[0xAB; 64]);
            let mut sf = SuperFragmentHeader {
                readout_unit: self.ru,
                event_id: ev,
                fragment_count: 1,
                total_size: 0,
                missing: Vec::new(),
            };
            sf.total_size = (sf.header_size() + body.len()) as u32;
            sf.encode_into(&mut out);
            out.extend_from_slice(&body);
            self.sent += 1;
        }
        self.s.write_all(&out).unwrap();
    }

    fn floor(&mut self, floor: u64) {
        let p = Progress {
            readout_unit: self.ru,
            floor,
        };
        self.s.write_all(&p.encode()).unwrap();
    }

    fn end(mut self) {
        let e = PeerEnd {
            role: PeerRole::ReadoutUnit,
            id: self.ru,
            units: self.sent,
            fragments: self.sent,
        };
        self.s.write_all(&e.encode()).unwrap();
    }
}

fn builder(event_timeout: Duration) -> (BuilderUnit, Vec<std::net::SocketAddr>) {
    builder_with(2, 16 << 20, 1 << 16, event_timeout)
}

/// A builder of units 0 and 1 on `rails` rails, `buffer` bytes shared by its links (each rail
/// at least two read chunks of `read_chunk`).
fn builder_with(
    rails: usize,
    buffer: u64,
    read_chunk: usize,
    event_timeout: Duration,
) -> (BuilderUnit, Vec<std::net::SocketAddr>) {
    let listeners: Vec<TcpListener> = (0..rails)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let b = BuilderUnit::start(BuilderConfig {
        id: 0,
        listeners,
        readout_units: vec![(0, vec![0]), (1, vec![1])],
        recorder: None,
        buffer,
        read_chunk,
        reserve: true,
        event_timeout,
        max_open_events: 1024,
        max_message: 1 << 12,
    })
    .unwrap();
    (b, addrs)
}

/// Waits until `what` holds of the builder's counters (bounded: a hang fails, never passes).
fn until(st: &BuilderStats, what: &str, f: impl Fn(&BuilderStats) -> bool) {
    let t = Instant::now();
    while !f(st) {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "never: {what} (built {} complete, {} incomplete, {} open; links' memory {:?})",
            count(&st.events_complete),
            count(&st.events_incomplete),
            count(&st.pending_events),
            st.links
                .iter()
                .map(|l| (l.used(), l.limit()))
                .collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn count(a: &std::sync::atomic::AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

#[test]
fn a_floor_on_one_rail_does_not_excuse_events_still_on_the_other() {
    let (b, addrs) = builder(Duration::from_secs(2));
    let (mut u1a, mut u1b) = (Rail::open(1, addrs[0]), Rail::open(1, addrs[1]));
    u1a.events((0..12).filter(|e| e % 2 == 0));
    u1b.events((0..12).filter(|e| e % 2 == 1));
    let (mut u0a, mut u0b) = (Rail::open(0, addrs[0]), Rail::open(0, addrs[1]));
    // Unit 0's even events on rail 0, which then says it sent everything below 10 it will send
    // there; its odd events are still to come on rail 1.
    u0a.events([0, 2, 4, 6, 8, 10]);
    // Event 12 only from unit 0: unit 1 moved past it (floor 13), so it leaves incomplete once
    // it waited the timeout; it is younger than the odd events, so by then the builder has
    // weighed each of them too.
    u0a.events([12]);
    // Every rail speaks every 50 ms, as a live unit does: no silence excuses anything.
    let t = Instant::now();
    while count(&b.stats.events_incomplete) == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "never: event 12 given up"
        );
        u0a.floor(10);
        u0b.floor(0);
        u1a.floor(13);
        u1b.floor(13);
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        count(&b.stats.events_incomplete),
        1,
        "rail 0's floor made events still on rail 1 incomplete"
    );
    assert_eq!(count(&b.stats.events_complete), 6);
    assert_eq!(count(&b.stats.pending_events), 6, "events 1..11 still wait");
    u0b.events([1, 3, 5, 7, 9, 11]);
    for r in [u0a, u0b, u1a, u1b] {
        r.end();
    }
    until(&b.stats, "the builder finished", |s| {
        s.links.iter().all(|l| l.closed.load(Ordering::Acquire))
    });
    let st = b.stats.clone();
    b.join();
    assert_eq!(count(&st.events_complete), 12);
    assert_eq!(count(&st.events_incomplete), 1);
    assert_eq!(st.missing_by_source.lock().get(&1), Some(&1));
    assert_eq!(count(&st.links[0].declared_fragments), 7 + 6);
    assert_eq!(count(&st.links[0].rail_super_fragments[1]), 6);
}

#[test]
fn a_rail_that_breaks_loses_only_what_went_its_way() {
    // An event a unit moved past leaves once it waited this long.
    let (b, addrs) = builder(Duration::from_millis(300));
    let (mut u1a, mut u1b) = (Rail::open(1, addrs[0]), Rail::open(1, addrs[1]));
    u1a.events((0..12).filter(|e| e % 2 == 0));
    u1b.events((0..12).filter(|e| e % 2 == 1));
    let (mut u0a, mut u0b) = (Rail::open(0, addrs[0]), Rail::open(0, addrs[1]));
    u0b.events([1, 3]);
    u0a.events([0, 2, 4, 6, 8, 10]);
    until(&b.stats, "events 0-4 and the even ones built", |s| {
        count(&s.events_complete) == 8
    });
    // Rail 1 breaks: no end message. Events 5, 7, 9 and 11 went its way and are gone.
    u0b.s.shutdown(std::net::Shutdown::Both).unwrap();
    drop(u0b);
    // Rail 0 says it is past 12: what rail 1 carried below that will never come. (Read before
    // or after the break, the promise counts once rail 1 is closed.)
    // Said every 50 ms, as a live unit does, so rail 0 is never silent: only the floor can
    // excuse unit 0.
    let t = Instant::now();
    while count(&b.stats.events_incomplete) < 4 {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "never: events 5-11 given up"
        );
        u0a.floor(12);
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(count(&b.stats.events_incomplete), 4);
    assert_eq!(count(&b.stats.events_complete), 8);
    assert_eq!(
        b.stats.missing_by_source.lock().get(&0),
        Some(&4),
        "the missing source is unit 0's"
    );
    u0a.end();
    u1a.end();
    u1b.end();
    until(&b.stats, "the builder finished", |s| {
        s.links.iter().all(|l| l.closed.load(Ordering::Acquire))
    });
    b.join();
}

/// A unit that never had two events and says so only in its heartbeat, which it sends between
/// batches (wire-format §2.3: the promise right behind the batch is a "should"). Each of the
/// other unit's super-fragments of those events held one of its link's two read chunks, so the
/// builder read nothing more from that link; the first unit's link then filled both its chunks
/// with events waiting for what the other link had not been read for, and its heartbeat lay
/// behind them. Nothing could ever be read again: the builder stood still for good, every unit
/// alive and held, no event timed out (a unit the builder is not reading is never silent). Now
/// a builder whose every open link is held for memory by events that wait on each other lets
/// the oldest of them go once they have waited out its event timeout: here exactly the two
/// events the unit never had are incomplete, as the promise would have made them.
#[test]
fn a_unit_that_promises_only_in_its_heartbeat_costs_time_never_a_stand_still() {
    const EVENTS: u64 = 3000;
    const NEVER: [u64; 2] = [5, 700];
    // Two read chunks of 64 KiB a link: about 500 super-fragments of 132 bytes each.
    let (b, addrs) = builder_with(1, 256 << 10, 1 << 16, Duration::from_millis(300));
    let other = std::thread::spawn({
        let addr = addrs[0];
        move || {
            let mut u1 = Rail::open(1, addr);
            for start in (0..EVENTS).step_by(1000) {
                u1.events(start..start + 1000);
                u1.floor(start + 1000);
            }
            u1.end();
        }
    });
    let never_had = std::thread::spawn({
        let addr = addrs[0];
        move || {
            let mut u0 = Rail::open(0, addr);
            for start in (0..EVENTS).step_by(1500) {
                u0.events((start..start + 1500).filter(|e| !NEVER.contains(e)));
                u0.floor(start + 1500);
            }
            u0.end();
        }
    });
    until(&b.stats, "the builder finished", |s| {
        s.links.iter().all(|l| l.closed.load(Ordering::Acquire))
    });
    other.join().unwrap();
    never_had.join().unwrap();
    let st = b.stats.clone();
    b.join();
    assert_eq!(count(&st.events_incomplete), NEVER.len() as u64);
    assert_eq!(count(&st.events_complete), EVENTS - NEVER.len() as u64);
    assert_eq!(st.missing_by_source.lock().get(&0), Some(&2));
    assert_eq!(count(&st.late_fragments), 0);
    // Event 5 let go; event 700 may have gone by the heartbeat or a second release.
    assert!(
        (1..=2).contains(&count(&st.stall_releases)),
        "{}",
        count(&st.stall_releases)
    );
}

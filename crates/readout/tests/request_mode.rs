//! A request-mode readout unit over real loopback sockets, with hand-driven peers: sources that
//! write the wire format, builders that speak the request protocol, an event manager that
//! collects announcements and sends clears.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_config::AssignmentSection;
use tessera_format::request::{self, AnswerHeader, Channel, Decoded, Message, Role};
use tessera_format::wire::{encode_fragment, FragmentHeader, Hello, StreamEnd};
use tessera_readout::{ReadoutConfig, ReadoutUnit, RequestMode};

struct Em {
    stream: TcpStream,
    announced: Arc<Mutex<Vec<u64>>>,
}

impl Em {
    fn send(&mut self, m: Message) {
        self.stream.write_all(&m.encode()).unwrap();
    }
}

/// Binds a fake event manager; the returned closure accepts the unit's connection.
fn fake_em() -> (String, impl FnOnce() -> Em) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    (addr, move || {
        let (mut s, _) = l.accept().unwrap();
        let mut hello = [0u8; 24];
        s.read_exact(&mut hello).unwrap();
        let announced = Arc::new(Mutex::new(Vec::new()));
        let (mut r, a) = (s.try_clone().unwrap(), announced.clone());
        std::thread::spawn(move || {
            let mut rd = Reader::default();
            while let Some((m, _)) = rd.next(&mut r) {
                if let Message::Announce { event_ids } = m {
                    a.lock().unwrap().extend(event_ids);
                }
            }
        });
        Em {
            stream: s,
            announced,
        }
    })
}

fn start_ru(
    em: &str,
    sources: &[u32],
    descriptors: usize,
    timeout_ms: u64,
    page_size: usize,
    buffer: u64,
) -> (ReadoutUnit, String) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let ru = ReadoutUnit::start(ReadoutConfig {
        id: 7,
        listener: l,
        sources: sources.to_vec(),
        builders: Vec::new(),
        assignment: AssignmentSection::default(),
        buffer,
        read_chunk: 256 << 10,
        reserve: false,
        event_timeout: Duration::from_secs(1),
        max_open_events: 1 << 16,
        max_payload: 1 << 20,
        dial: Vec::new(),
        quarantine: None,
        request_mode: Some(RequestMode {
            generator: None,
            page_size,
            descriptors,
            timeout: Duration::from_millis(timeout_ms),
            event_manager: em.into(),
            builders: vec![1, 2],
            takeover: Duration::ZERO,
        }),
    })
    .unwrap();
    (ru, addr)
}

/// A source that sends these events, each with a payload of `len` bytes of its ID.
fn source(addr: &str, id: u32, events: &[u64], len: usize) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    let mut out = Hello::new(id).encode().to_vec();
    for &e in events {
        let h = FragmentHeader {
            status: 0,
            source_id: id,
            trigger_type: 1,
            event_id: e,
            timestamp: 0,
            payload_size: len as u32,
        };
        encode_fragment(&mut out, &h, &vec![id as u8; len]);
    }
    s.write_all(&out).unwrap();
    s
}

fn end_source(mut s: TcpStream, id: u32, n: u64) {
    s.write_all(
        &StreamEnd {
            source_id: id,
            fragments_sent: n,
        }
        .encode(),
    )
    .unwrap();
}

#[derive(Default)]
struct Reader {
    buf: Vec<u8>,
}

impl Reader {
    /// The next message and, for an answer, its fragment bytes; None at the end.
    fn next(&mut self, s: &mut TcpStream) -> Option<(Message, Vec<u8>)> {
        loop {
            match request::decode(&self.buf, 1 << 26).unwrap() {
                Decoded::Message(m, n) => {
                    let body = match &m {
                        Message::Answer(h) => self.buf[h.header_size()..n].to_vec(),
                        _ => Vec::new(),
                    };
                    self.buf.drain(..n);
                    return Some((m, body));
                }
                Decoded::NeedMore(_) => {
                    let mut b = [0u8; 65536];
                    match s.read(&mut b) {
                        Ok(0) | Err(_) => return None,
                        Ok(n) => self.buf.extend_from_slice(&b[..n]),
                    }
                }
            }
        }
    }
}

struct Bu {
    control: TcpStream,
    data: TcpStream,
    rd: Reader,
}

impl Bu {
    fn connect(addr: &str, id: u32) -> Bu {
        let open = |c| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(
                &Message::Hello {
                    role: Role::BuilderUnit,
                    channel: c,
                    id,
                }
                .encode(),
            )
            .unwrap();
            s
        };
        Bu {
            control: open(Channel::Control),
            data: open(Channel::Data),
            rd: Reader::default(),
        }
    }

    fn request(&mut self, tag: u64, event_id: u64, sources: &[u32]) {
        let m = Message::Request {
            tag,
            event_id,
            sources: sources.to_vec(),
        };
        self.control.write_all(&m.encode()).unwrap();
    }

    fn answer(&mut self) -> (AnswerHeader, Vec<u8>) {
        match self.rd.next(&mut self.data) {
            Some((Message::Answer(h), body)) => (h, body),
            other => panic!("expected an answer, got {other:?}"),
        }
    }
}

fn sources_in(body: &[u8]) -> Vec<u32> {
    tessera_format::link::Fragments::new(body)
        .map(|f| f.unwrap().header.source_id)
        .collect()
}

#[test]
fn answers_name_exactly_the_missing_links_and_move_only_what_was_asked() {
    let (em_addr, em) = fake_em();
    let (ru, addr) = start_ru(&em_addr, &[10, 11, 12], 16, 200, 4096, 4 << 20);
    let mut em = em();
    // Source 11 skips event 5.
    let s10 = source(&addr, 10, &[4, 5, 6], 100);
    let s11 = source(&addr, 11, &[4, 6], 100);
    let s12 = source(&addr, 12, &[4, 5, 6], 100);
    // A builder the unit does not expect gets no port and no descriptors.
    let _stranger = Bu::connect(&addr, 9);
    let mut b = Bu::connect(&addr, 1);
    // All links of event 5: answered after the timeout, naming source 11 alone.
    b.request(1, 5, &[]);
    let (h, body) = b.answer();
    assert_eq!((h.tag, h.event_id, h.readout_unit), (1, 5, 7));
    assert_eq!(h.missing, vec![11]);
    assert_eq!(sources_in(&body), vec![10, 12]);
    // An RoI request moves only its links.
    b.request(2, 6, &[12]);
    let (h, body) = b.answer();
    assert!(h.missing.is_empty());
    assert_eq!(sources_in(&body), vec![12]);
    b.request(3, 6, &[10, 11]);
    let (h, body) = b.answer();
    assert!(h.missing.is_empty());
    assert_eq!(sources_in(&body), vec![10, 11]);
    let q = &ru.stats.requests;
    assert_eq!(q.fragments_sent.load(Ordering::Relaxed), 5);
    assert_eq!(q.partial_answers.load(Ordering::Relaxed), 1);
    // The stranger's two connections are refused on the unit's acceptor thread once it has read
    // their hellos, which nothing above waits for: waited for here (a loaded host once counted
    // one of the two at this point).
    let t0 = std::time::Instant::now();
    while ru.stats.refused_connections.load(Ordering::Relaxed) < 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the stranger's connections were not refused"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(ru.stats.refused_connections.load(Ordering::Relaxed), 2);
    // Clears free every page; the unsent fragments of event 4 are counted, as are odd clears.
    em.send(Message::Clear {
        event_ids: vec![4, 5, 6, 99],
    });
    em.send(Message::Clear { event_ids: vec![6] });
    let t0 = std::time::Instant::now();
    // The page gauge is published after the counts move (by the clear, and by the sweep every
    // 2 ms): it is waited for with them, not read the moment they are right.
    while q.stored_fragments.load(Ordering::Relaxed) != 0
        || q.clears_repeated.load(Ordering::Relaxed) != 1
        || q.free_pages.load(Ordering::Relaxed) != q.total_pages.load(Ordering::Relaxed)
    {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "clears not applied: {} stored, {} of {} pages free",
            q.stored_fragments.load(Ordering::Relaxed),
            q.free_pages.load(Ordering::Relaxed),
            q.total_pages.load(Ordering::Relaxed)
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(q.clears_unknown.load(Ordering::Relaxed), 1);
    let unsent: u64 = ru
        .stats
        .links
        .iter()
        .map(|l| {
            l.rejected[tessera_readout::Rejection::ClearedUnsent.index()].load(Ordering::Relaxed)
        })
        .sum();
    assert_eq!(unsent, 3, "event 4 was never requested");
    // Announcements reach the fake manager on its own reading thread: waited for as well.
    let t0 = std::time::Instant::now();
    while em.announced.lock().unwrap().len() < 3 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "announced only {:?}",
            em.announced.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut announced = em.announced.lock().unwrap().clone();
    announced.sort_unstable();
    assert_eq!(announced, vec![4, 5, 6]);
    end_source(s10, 10, 3);
    end_source(s11, 11, 2);
    end_source(s12, 12, 3);
    em.send(Message::End { units: 0, items: 0 });
    drop(b);
    ru.stop();
    let t0 = std::time::Instant::now();
    while !ru.is_finished() {
        assert!(t0.elapsed() < Duration::from_secs(20), "unit did not end");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// An event asked again (by the builder it was given to after its first was declared dead, or
/// by the same one) is answered again, and each fragment lent a second time is counted as a
/// copy (`fragments_answered_again`), by builder as well: the balance adds the copies to what
/// the sources sent, which the builders' counts then match.
#[test]
fn fragments_answered_again_are_counted_as_copies() {
    let (em_addr, em) = fake_em();
    let (ru, addr) = start_ru(&em_addr, &[10, 11], 16, 200, 4096, 4 << 20);
    let mut em = em();
    let s10 = source(&addr, 10, &[4], 100);
    let s11 = source(&addr, 11, &[4], 100);
    let mut first = Bu::connect(&addr, 1);
    let mut second = Bu::connect(&addr, 2);
    first.request(1, 4, &[]);
    let (h, body) = first.answer();
    assert_eq!(sources_in(&body), vec![10, 11], "{h:?}");
    let q = &ru.stats.requests;
    assert_eq!(q.fragments_answered_again.load(Ordering::Relaxed), 0);
    second.request(1, 4, &[]);
    let (h, body) = second.answer();
    assert_eq!(sources_in(&body), vec![10, 11], "{h:?}");
    assert_eq!(q.fragments_answered_again.load(Ordering::Relaxed), 2);
    first.request(2, 4, &[10]);
    let (_, body) = first.answer();
    assert_eq!(sources_in(&body), vec![10]);
    assert_eq!(q.fragments_sent.load(Ordering::Relaxed), 5);
    assert_eq!(q.fragments_answered_again.load(Ordering::Relaxed), 3);
    assert_eq!(
        *q.fragments_sent_by_builder.lock(),
        [(1, 3), (2, 2)].into_iter().collect()
    );
    end_source(s10, 10, 1);
    end_source(s11, 11, 1);
    em.send(Message::End { units: 0, items: 0 });
    drop((first, second));
    ru.stop();
    let t0 = std::time::Instant::now();
    while !ru.is_finished() {
        assert!(t0.elapsed() < Duration::from_secs(20), "unit did not end");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn descriptor_exhaustion_holds_requests_without_losing_any() {
    let (em_addr, em) = fake_em();
    // Two descriptors over two builders: one each.
    let (ru, addr) = start_ru(&em_addr, &[1], 2, 60_000, 4096, 4 << 20);
    let _em = em();
    let mut b = Bu::connect(&addr, 1);
    let events: Vec<u64> = (100..120).collect();
    for &e in &events {
        b.request(e, e, &[]);
    }
    // Nothing has arrived: one request waits in the builder's descriptor, the rest are left
    // unread on its connection.
    let q = &ru.stats.requests;
    let t0 = std::time::Instant::now();
    while q.descriptor_waits.load(Ordering::Relaxed) == 0 {
        assert!(t0.elapsed() < Duration::from_secs(20));
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(q.descriptors_in_use.load(Ordering::Relaxed), 1);
    let _s = source(&addr, 1, &events, 64);
    let mut got: Vec<u64> = (0..events.len()).map(|_| b.answer().0.event_id).collect();
    got.sort_unstable();
    assert_eq!(got, events, "every held request was answered, none lost");
    assert_eq!(q.partial_answers.load(Ordering::Relaxed), 0);
    ru.abort();
}

#[test]
fn a_builder_that_stops_reading_does_not_stall_the_others() {
    let (em_addr, em) = fake_em();
    let (ru, addr) = start_ru(&em_addr, &[1, 2], 64, 60_000, 4096, 64 << 20);
    let _em = em();
    let events: Vec<u64> = (0..200).collect();
    let _s1 = source(&addr, 1, &events, 60_000);
    let _s2 = source(&addr, 2, &events, 60_000);
    // Builder 1 asks for everything, twice over, and never reads its data connection: its
    // answers (24 MB) fill the socket buffers and its share of descriptors.
    let mut stuck = Bu::connect(&addr, 1);
    for _ in 0..2 {
        for &e in &events {
            stuck.request(e, e, &[]);
        }
    }
    let mut good = Bu::connect(&addr, 2);
    for &e in &events {
        good.request(e, e, &[]);
        let (h, body) = good.answer();
        assert_eq!(h.event_id, e);
        assert_eq!(sources_in(&body), vec![1, 2]);
    }
    assert!(
        ru.stats.requests.descriptor_waits.load(Ordering::Relaxed) > 0,
        "the stuck builder was held"
    );
    drop(stuck);
    ru.abort();
}

#[test]
fn event_ids_that_wrap_around_are_served() {
    let (em_addr, em) = fake_em();
    // Small pages and index: many IDs share a bucket.
    let (ru, addr) = start_ru(&em_addr, &[3], 8, 60_000, 256, 1 << 20);
    let _em = em();
    let events = [u64::MAX - 2, u64::MAX - 1, u64::MAX, 0, 1, 2];
    let _s = source(&addr, 3, &events, 1000);
    let mut b = Bu::connect(&addr, 1);
    for &e in &events {
        b.request(e, e, &[]);
        let (h, body) = b.answer();
        assert_eq!((h.event_id, h.tag), (e, e));
        assert!(h.missing.is_empty());
        assert_eq!(sources_in(&body), vec![3]);
    }
    ru.abort();
}

/// The in-process link generator (the ROBIN's generator of the ATLAS lab): every link gets every
/// event, whole, held back by the pages until clears free them (pages for far fewer events than
/// the run), then every link ends, and nothing is left in the pages.
#[test]
fn the_link_generator_fills_every_link_with_every_event_under_back_pressure() {
    let (em_addr, em) = fake_em();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    const EVENTS: u64 = 2000;
    let sources = [3u32, 4, 5];
    let ru = ReadoutUnit::start(ReadoutConfig {
        id: 7,
        listener: l,
        sources: sources.to_vec(),
        builders: Vec::new(),
        assignment: AssignmentSection::default(),
        // 64 KiB of pages per link: room for about a hundred of the 2000 events.
        buffer: 3 * (64 << 10),
        read_chunk: 16 << 10,
        reserve: false,
        event_timeout: Duration::from_secs(1),
        max_open_events: 1 << 16,
        max_payload: 1 << 20,
        dial: Vec::new(),
        quarantine: None,
        request_mode: Some(RequestMode {
            generator: Some(tessera_readout::LinkGenerator {
                payload_size: 400,
                events: EVENTS,
            }),
            page_size: 1024,
            descriptors: 16,
            timeout: Duration::from_secs(10),
            event_manager: em_addr,
            builders: vec![1],
            takeover: Duration::ZERO,
        }),
    })
    .unwrap();
    let mut em = em();
    let mut cleared = 0usize;
    let t0 = std::time::Instant::now();
    while cleared < EVENTS as usize {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "only {cleared} events announced"
        );
        let ids: Vec<u64> = em.announced.lock().unwrap()[cleared..].to_vec();
        if ids.is_empty() {
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        cleared += ids.len();
        em.send(Message::Clear { event_ids: ids });
    }
    let mut all = em.announced.lock().unwrap().clone();
    all.sort_unstable();
    assert_eq!(
        all,
        (0..EVENTS).collect::<Vec<_>>(),
        "each event announced once"
    );
    let q = &ru.stats.requests;
    while q.stored_fragments.load(Ordering::Relaxed) > 0
        || !ru.stats.links.iter().all(|l| l.state().ended())
    {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "pages or links not done"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    for l in &ru.stats.links {
        assert_eq!(l.fragments.load(Ordering::Relaxed), EVENTS);
        assert_eq!(l.eos_fragments.load(Ordering::Relaxed), EVENTS);
    }
    // 64 pages of 1 KiB per link hold 64 of the 2000 events: the rest waited for clears.
    assert!(
        ru.stats.busy_ns() > 0,
        "the pages never held the generator back"
    );
    ru.abort();
}

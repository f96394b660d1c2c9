//! Request mode of the readout unit (the ATLAS ROS, seeds/004 §5.3, §6.2): fragments wait in
//! paged buffers until a builder asks for them, and leave on the event manager's clears.
//!
//! Threads, and why:
//! - an accept thread takes sources (wire-format hello) and builders (request-protocol hello,
//!   one control and one data connection each) on the same port;
//! - one reader thread per link, as in push mode, copying each good fragment into the link's
//!   pages; a link whose pages are all used waits for a clear (TCP then holds its source);
//! - per builder a control reader that takes its requests (at most its share of the
//!   descriptors at a time: past that it stops reading, which holds only that builder) and an
//!   answer sender that writes the fragments on the data connection straight from the pages
//!   (held against clears until written). A stuck builder fills only its own share: the
//!   others' answers keep flowing;
//! - an event-manager link: announcements of new events out, clears and BUSY in. Lost before
//!   the end of the run, it is opened again for up to `takeover` (a manager restarted at the
//!   same address takes the run over), every event held is announced again, and the unit's end
//!   said again if its links had ended; meanwhile the links are read until the pages are full;
//! - a sweeper that answers timed-out requests with the list of missing sources, publishes the
//!   gauges and ends the unit.

use crossbeam_channel::{bounded, Receiver, Sender};
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::io::IoSlice;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_format::request::{self, AnswerHeader, Channel, Message, Role, REQUEST_MAGIC};
use tessera_format::wire::HELLO_SIZE;
use tessera_net::control::{MessageReader, ReadEnd};
use tessera_net::role::{spawn, RoleThreads};
use tessera_net::ChunkSlice;

use crate::paged::{Hold, Lent, PagedBuffer, StoreError};
use crate::requests::{Answer, Request, RequestTable, Silent, Submit};
use crate::{LinkCtx, LinkSink, LinkState, Rejection};
use tessera_assembly::RecentSet;

/// Request-mode settings of a readout unit.
#[derive(Clone, Debug)]
pub struct RequestMode {
    pub page_size: usize,
    /// Descriptors in all, split evenly over `builders`.
    pub descriptors: usize,
    pub timeout: Duration,
    pub event_manager: String,
    /// IDs of the builders that will connect.
    pub builders: Vec<u32>,
    /// How long to wait for a lost event manager to come back; zero: end at once.
    pub takeover: Duration,
    /// Fragments made inside the unit instead of read from sources (for measurements).
    pub generator: Option<LinkGenerator>,
}

/// Makes every link's fragments inside the unit, as the ATLAS lab measured its ROS with input
/// from the ROBIN's on-board generator (seeds/004 §7.1), to separate the unit's own cost from
/// its input's: no sources, no TCP in. Each fragment is a whole, valid wire fragment (its CRCs
/// computed here, on this thread), stored in the pages exactly as one read from a link.
#[derive(Clone, Copy, Debug)]
pub struct LinkGenerator {
    pub payload_size: usize,
    /// Events 0 to `events` - 1 on every link, then every link ends.
    pub events: u64,
}

/// The unit's side of its event-manager connection, which may be replaced (takeover).
struct ManagerLink {
    /// The queue of the connection open now; none while the manager is lost.
    tx: Option<Sender<Message>>,
    /// Every link has ended and the unit said its end (said again on a new connection).
    links_ended: bool,
}

/// One builder's side of the unit.
struct Port {
    answers_tx: Sender<Answer>,
    answers_rx: Receiver<Answer>,
    /// Requests taken and not yet answered on the wire.
    in_flight: Mutex<usize>,
    freed: Condvar,
    /// The builder's control connection ended: no more requests.
    closed: AtomicBool,
}

struct Unit {
    ctx: LinkCtx,
    links: Vec<Mutex<PagedBuffer>>,
    /// Signalled when a clear frees pages.
    space: Condvar,
    space_lock: Mutex<()>,
    /// The unit said it is full and no clear has come since: the manager holds that word until
    /// it sends a clear, so saying it again before then would only repeat it (every waiting
    /// link said it at every wake: 100 000 empty announcements in a run of 17 000 clears).
    /// Lowered under `space_lock` by a clear and by a new manager connection.
    full_said: AtomicBool,
    /// Held while the page gauge is summed and stored: without it the sweep's sum, taken
    /// before a clear freed pages, could be stored after the clear's and leave the gauge
    /// stale until the next sweep.
    publish_lock: Mutex<()>,
    requests: Mutex<RequestTable>,
    ports: Mutex<HashMap<u32, Arc<Port>>>,
    share: usize,
    /// The builders expected: only they get a port (and a share of the descriptors).
    builders: Vec<u32>,
    announced: Mutex<RecentSet>,
    cleared: Mutex<RecentSet>,
    manager: Mutex<ManagerLink>,
    manager_ended: AtomicBool,
    /// Link readers still running.
    open_links: AtomicUsize,
    /// Per link, what its reads have proven silent (`None` while it delivers, is held, or has
    /// not been read since data came): a request stops waiting for a link only once this spans
    /// a whole timeout. Written by the link's reader only on the edges of a silence and on its
    /// empty reads, so the lock is seldom taken.
    silence: Vec<Mutex<Option<Silent>>>,
    /// The builder connections open now, by (builder, channel): one each. A second hello for
    /// one is refused, never allowed to take the first one's place.
    claimed: Mutex<std::collections::HashSet<(u32, u8)>>,
}

impl std::ops::Deref for Unit {
    type Target = LinkCtx;
    fn deref(&self) -> &LinkCtx {
        &self.ctx
    }
}

/// Most recent event IDs remembered as announced or cleared.
pub(crate) const MEMORY: usize = 1 << 20;

pub(crate) fn start(
    ctx: LinkCtx,
    listener: TcpListener,
    dial: Vec<String>,
    mode: RequestMode,
    per_link: u64,
    role: &mut RoleThreads,
) -> std::io::Result<()> {
    let n = ctx.sources.len();
    let pages = (per_link as usize / mode.page_size).max(1);
    let links: Vec<Mutex<PagedBuffer>> = (0..n)
        .map(|_| Mutex::new(PagedBuffer::new(mode.page_size, pages, index_bits(pages))))
        .collect();
    let rs = &ctx.stats.requests;
    rs.total_pages.store((pages * n) as u64, Ordering::Relaxed);
    rs.free_pages.store((pages * n) as u64, Ordering::Relaxed);
    let em = tessera_net::control::open(
        &mode.event_manager,
        Role::ReadoutUnit,
        Channel::Control,
        ctx.id,
        Duration::from_secs(10),
    )?;
    let unit = Arc::new(Unit {
        links,
        space: Condvar::new(),
        space_lock: Mutex::new(()),
        full_said: AtomicBool::new(false),
        publish_lock: Mutex::new(()),
        requests: Mutex::new(RequestTable::new(
            mode.descriptors,
            mode.timeout.as_nanos() as u64,
        )),
        ports: Mutex::new(HashMap::new()),
        share: (mode.descriptors / mode.builders.len().max(1)).max(1),
        builders: mode.builders.clone(),
        announced: Mutex::new(RecentSet::new(MEMORY)),
        cleared: Mutex::new(RecentSet::new(MEMORY)),
        manager: Mutex::new(ManagerLink {
            tx: None,
            links_ended: false,
        }),
        manager_ended: AtomicBool::new(false),
        open_links: AtomicUsize::new(n),
        silence: (0..n).map(|_| Mutex::new(None)).collect(),
        claimed: Mutex::new(std::collections::HashSet::new()),
        ctx,
    });
    {
        let u = unit.clone();
        let (writer, tx) = tessera_net::control::spawn_writer(format!("ru{}-to-em", u.id), &em)?;
        u.manager.lock().tx = Some(tx);
        let (addr, takeover) = (mode.event_manager.clone(), mode.takeover);
        role.spawn(format!("ru{}-from-em", u.id), move || {
            manager_link(&u, em, writer, &addr, takeover)
        });
    }
    {
        let u = unit.clone();
        role.spawn(format!("ru{}-sweep", u.id), move || sweep(&u));
    }
    if let Some(g) = mode.generator {
        let u = unit.clone();
        role.spawn(format!("ru{}-generator", u.id), move || generate(&u, g));
    }
    {
        let u = unit;
        role.spawn(format!("ru{}-accept", u.id), move || {
            accept(&u, listener, dial)
        });
    }
    Ok(())
}

/// Index buckets for a link of `pages` pages: one per page (at most one fragment each), so a
/// chain is about one entry long, and the index no bigger than that: a clear finds each
/// fragment in it cold (65 536 buckets a link, 256 KiB, was 5 % of a generator-fed point's CPU
/// in `remove`).
fn index_bits(pages: usize) -> u32 {
    pages.next_power_of_two().trailing_zeros().clamp(4, 24)
}

/// Fills every link with generated fragments in batches, waiting for page space as a link
/// reader does (back-pressure), then ends every link.
fn generate(u: &Unit, g: LinkGenerator) {
    use tessera_format::wire::{encode_fragment, FragmentHeader};
    const BATCH: u64 = 32;
    let n = u.sources.len();
    for l in &u.stats.links {
        l.claim();
    }
    let payload: Vec<u8> = (0..g.payload_size).map(|i| i as u8).collect();
    let mut ev = 0u64;
    let mut good: Vec<(u64, ChunkSlice)> = Vec::with_capacity(BATCH as usize);
    let mut at: Vec<(u64, usize, usize)> = Vec::with_capacity(BATCH as usize);
    while ev < g.events && !u.abort.load(Ordering::Relaxed) {
        let end = (ev + BATCH).min(g.events);
        for slot in 0..n {
            // Sized once: grown from nothing, the vector copied the batch about once more
            // on its way (the generator's `memmove` was 12.7 % of a generator-fed point).
            let mut buf = Vec::with_capacity(
                (end - ev) as usize * tessera_format::wire::fragment_wire_size(g.payload_size),
            );
            at.clear();
            for e in ev..end {
                let start = buf.len();
                let h = FragmentHeader {
                    status: 0,
                    source_id: u.sources[slot],
                    trigger_type: 0,
                    event_id: e,
                    timestamp: e,
                    payload_size: g.payload_size as u32,
                };
                encode_fragment(&mut buf, &h, &payload);
                at.push((e, start, buf.len() - start));
            }
            let whole = ChunkSlice::from_vec(buf);
            good.extend(at.iter().map(|&(e, s, l)| (e, whole.slice(s, l))));
            u.stats.links[slot]
                .last_event
                .store(end - 1, Ordering::Relaxed);
            LinkSink::offer(u, slot, &mut good);
            good.clear();
        }
        ev = end;
    }
    u.stats
        .requests
        .generator_cpu_ns
        .store(tessera_net::role::thread_cpu_ns(), Ordering::Relaxed);
    for slot in 0..n {
        let l = &u.stats.links[slot];
        l.eos_fragments.store(ev, Ordering::Relaxed);
        l.set_state(if ev == g.events {
            LinkState::Ended
        } else {
            LinkState::Aborted
        });
        u.close_link(slot);
    }
}

impl LinkSink for Unit {
    fn ctx(&self) -> &LinkCtx {
        &self.ctx
    }

    fn quiet(&self, slot: usize, since_ns: u64, until_ns: u64) {
        // The first empty read of a silence says since when; the later ones extend it.
        let mut s = self.silence[slot].lock();
        let q = s.get_or_insert(Silent { since_ns, until_ns });
        q.until_ns = q.until_ns.max(until_ns);
    }

    fn heard(&self, slot: usize) {
        *self.silence[slot].lock() = None;
    }

    fn offer(&self, slot: usize, good: &mut Vec<(u64, ChunkSlice)>) {
        let link = &self.stats.links[slot];
        let rs = &self.stats.requests;
        link.fragments
            .fetch_add(good.len() as u64, Ordering::Relaxed);
        let mut stored: Vec<u64> = Vec::with_capacity(good.len());
        for (ev, frag) in good.drain(..) {
            let why = loop {
                // The cleared set is read under the link's lock, and a clear records its IDs
                // there before it takes the link locks: a fragment is either refused as late or
                // stored where the clear will find it, never stored behind a clear's back.
                let r = {
                    let mut b = self.links[slot].lock();
                    if self.cleared.lock().contains(ev) {
                        break Some(Rejection::Late);
                    }
                    b.store(ev, &frag)
                };
                match r {
                    Ok(()) => break None,
                    Err(StoreError::Duplicate) => break Some(Rejection::Duplicate),
                    Err(StoreError::TooLarge { .. }) => break Some(Rejection::NoSpace),
                    Err(StoreError::Full { .. }) => {
                        // Wait for a clear: the link is not read meanwhile (back-pressure).
                        if self.abort.load(Ordering::Relaxed) {
                            break Some(Rejection::NoSpace);
                        }
                        // What this batch stored so far is announced (and answers the requests
                        // waiting for it) before the wait: a read can hold more fragments than
                        // the link has pages, and pages full of events nobody has been told of
                        // would never be cleared.
                        self.publish(slot, &mut stored);
                        // And it says it is full (an announcement of no event): events in
                        // flight may wait for what this link cannot read, and the event
                        // manager would otherwise hold finished events' clears for a group or
                        // its delay (request-protocol §3.5). Once until the next clear.
                        if !self.full_said.swap(true, Ordering::AcqRel) {
                            self.to_manager(Message::Announce {
                                event_ids: Vec::new(),
                            });
                        }
                        let t = Instant::now();
                        rs.links_waiting.fetch_add(1, Ordering::Relaxed);
                        let mut g = self.space_lock.lock();
                        // A clear since the word was said lowered it: the link tries again
                        // (and says it again if still full) rather than wait for the next.
                        if !self.links[slot].lock().fits(frag.len())
                            && self.full_said.load(Ordering::Acquire)
                        {
                            self.space.wait_for(&mut g, Duration::from_millis(20));
                        }
                        drop(g);
                        rs.links_waiting.fetch_sub(1, Ordering::Relaxed);
                        link.budget
                            .busy_ns
                            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    }
                }
            };
            match why {
                None => {
                    rs.stored_fragments.fetch_add(1, Ordering::Relaxed);
                    stored.push(ev);
                }
                Some(why) => {
                    if let Some(q) = &self.quarantine {
                        q.dump(self.sources[slot], why.label(), &frag);
                    }
                    link.reject(why);
                }
            }
        }
        self.publish(slot, &mut stored);
    }

    fn close_link(&self, slot: usize) {
        // Everything the link stored is reported already (each read is published before the
        // next); what its requests still wait for will never come.
        {
            let mut t = self.requests.lock();
            let answers = t.link_closed(slot);
            self.route(answers);
        }
        self.open_links.fetch_sub(1, Ordering::AcqRel);
    }

    fn before_read(&self, slot: usize) {
        let rs = &self.stats.requests;
        // A link that requests wait for is read through BUSY: what it brings can only finish
        // events in flight, which is what gives the builders credit back. Held with the rest,
        // the events every credit waited for were built without it once the builders gave up
        // on the unit (a source running behind: 2 432 of 4 000 events in the test).
        let held = || {
            rs.throttled.load(Ordering::Relaxed)
                && !self.abort.load(Ordering::Relaxed)
                && !self.requests.lock().waits_for(slot)
        };
        if !held() {
            return;
        }
        let t = Instant::now();
        while held() {
            std::thread::sleep(Duration::from_millis(1));
        }
        rs.throttled_ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

impl Unit {
    /// What link `slot`'s reads have proven silent: a source that never connected is silent
    /// from the start to the accepting's last look that found nobody on the way in; a connected
    /// one from its first empty read to the start of its
    /// latest, until it delivers again.
    fn silence(&self, slot: usize) -> Option<Silent> {
        if self.stats.links[slot].state() == LinkState::Waiting {
            return Some(Silent {
                since_ns: 0,
                until_ns: self.never_connected_until_ns(),
            });
        }
        *self.silence[slot].lock()
    }

    /// Queues a message for the event manager; dropped while it is lost (what is held is
    /// announced again to the one that takes over).
    fn to_manager(&self, m: Message) {
        let tx = self.manager.lock().tx.clone();
        if let Some(tx) = tx {
            let _ = tx.send(m);
        }
    }

    fn port(&self, builder: u32) -> Arc<Port> {
        self.ports
            .lock()
            .entry(builder)
            .or_insert_with(|| {
                // Room for every request the builder may have in flight: routing an answer
                // never blocks.
                let (tx, rx) = bounded(self.share + 1);
                Arc::new(Port {
                    answers_tx: tx,
                    answers_rx: rx,
                    in_flight: Mutex::new(0),
                    freed: Condvar::new(),
                    closed: AtomicBool::new(false),
                })
            })
            .clone()
    }

    /// Hands answers to their builders' senders.
    fn route(&self, answers: Vec<Answer>) {
        for a in answers {
            let p = self.port(a.request.builder);
            if p.answers_tx.try_send(a).is_err() {
                // Cannot happen while in_flight bounds the queue; counted rather than trusted.
                tracing::error!(readout_unit = self.id, "answer queue overflow");
            }
        }
    }

    /// Announces the events of `stored` this unit sees first (the event manager keeps the first
    /// sighting) and answers the requests that waited for them on link `slot`; empties it.
    fn publish(&self, slot: usize, stored: &mut Vec<u64>) {
        if stored.is_empty() {
            return;
        }
        let rs = &self.stats.requests;
        {
            // Queued under the lock that picks them: two links' threads announcing at once
            // could otherwise queue a later event before an earlier one, and the event manager
            // assigns in the order announced (request-protocol §4.3).
            let mut a = self.announced.lock();
            let fresh: Vec<u64> = stored.iter().copied().filter(|&e| a.insert(e)).collect();
            if !fresh.is_empty() {
                rs.announced
                    .fetch_add(fresh.len() as u64, Ordering::Relaxed);
                self.to_manager(Message::Announce { event_ids: fresh });
            }
        }
        {
            // Routed under the table's lock, for the same reason: the table completes requests
            // in the order the links delivered, and that order must reach the wire.
            let mut t = self.requests.lock();
            let answers: Vec<Answer> = stored.iter().flat_map(|&e| t.arrived(e, slot)).collect();
            self.route(answers);
        }
        stored.clear();
    }

    fn publish_pages(&self) {
        let _g = self.publish_lock.lock();
        let free: usize = self.links.iter().map(|l| l.lock().free_pages()).sum();
        self.stats
            .requests
            .free_pages
            .store(free as u64, Ordering::Relaxed);
    }

    /// Frees the events on every link, counting fragments never sent and odd clears.
    fn clear(&self, ids: &[u64]) {
        let rs = &self.stats.requests;
        rs.clear_messages.fetch_add(1, Ordering::Relaxed);
        let new: Vec<bool> = {
            let mut c = self.cleared.lock();
            ids.iter().map(|&e| c.insert(e)).collect()
        };
        let mut found = vec![false; ids.len()];
        let mut freed = 0u64;
        let mut sent_freed = 0u64;
        for (slot, l) in self.links.iter().enumerate() {
            let mut unsent = 0u64;
            {
                let mut b = l.lock();
                for (i, &e) in ids.iter().enumerate() {
                    if let Some(sent) = b.remove(e) {
                        found[i] = true;
                        freed += 1;
                        if sent {
                            sent_freed += 1;
                        } else {
                            unsent += 1;
                        }
                    }
                }
            }
            if unsent > 0 {
                self.stats.links[slot].rejected[Rejection::ClearedUnsent.index()]
                    .fetch_add(unsent, Ordering::Relaxed);
            }
        }
        rs.stored_fragments.fetch_sub(freed, Ordering::Relaxed);
        rs.stored_sent_fragments
            .fetch_sub(sent_freed, Ordering::Relaxed);
        for i in 0..ids.len() {
            if !found[i] {
                if new[i] {
                    rs.clears_unknown.fetch_add(1, Ordering::Relaxed);
                } else {
                    rs.clears_repeated.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        rs.cleared_events
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        self.publish_pages();
        let _g = self.space_lock.lock();
        self.full_said.store(false, Ordering::Release);
        self.space.notify_all();
    }

    /// Whether link `slot` holds `event_id`.
    fn has(&self, slot: usize, event_id: u64) -> bool {
        self.links[slot].lock().contains(event_id)
    }
}

/// Sources come until all are connected; builders may connect any time until the end. Each
/// connection's hello is read on its own thread with its own deadline (a silent connection holds
/// nobody else's hello); the thread then serves the connection.
fn accept(u: &Arc<Unit>, listener: TcpListener, dial: Vec<String>) {
    let threads = Mutex::new(Vec::new());
    let hellos = tessera_net::io::Hellos::default();
    // Sources that listen are dialled beside the accepting, under the same hellos.
    let dialer = (!dial.is_empty()).then(|| {
        let (u, hellos) = (u.clone(), hellos.clone());
        spawn(format!("ru{}-dial", u.id), move || {
            let mut conns = Vec::new();
            tessera_net::io::dial_until(&dial, &u.stop, &hellos, |stream, peer, hello| {
                let u = u.clone();
                conns.push(spawn(format!("ru{}-conn", u.id), move || {
                    serve_connection(&u, stream, peer, hello)
                }));
            });
            for t in conns {
                let _ = t.join();
            }
        })
    });
    let end = tessera_net::io::accept_until_looking(
        &listener,
        &u.stop,
        || !u.manager_ended.load(Ordering::Relaxed),
        |stream, peer| {
            let hello = match hellos.begin() {
                Ok(h) => h,
                Err(why) => return crate::refused(u, peer, why),
            };
            let u2 = u.clone();
            let mut v = threads.lock();
            tessera_net::role::reap(&mut v);
            v.push(spawn(format!("ru{}-conn", u.id), move || {
                serve_connection(&u2, stream, peer, hello)
            }));
        },
        // Nobody on the way in, dialled or accepted: the links still waiting are silent so far.
        |at| {
            if hellos.idle() {
                u.none_waiting.saw(at);
            }
        },
    );
    if end == tessera_net::io::AcceptEnd::Stopped {
        // Connections taken before the stop are still saying hello (each within its deadline):
        // they may be sources, which must not be taken for never connected.
        hellos.wait_done();
        crate::close_never_connected(&**u);
    }
    for t in threads.into_inner() {
        let _ = t.join();
    }
    if let Some(d) = dialer {
        let _ = d.join();
    }
}

/// Reads one connection's hello (under way until then) and serves it: a source's
/// link, or a builder's control or data channel.
fn serve_connection(
    u: &Arc<Unit>,
    mut stream: TcpStream,
    peer: std::net::SocketAddr,
    hello_under_way: tessera_net::io::HelloUnderWay,
) {
    let _ = tessera_net::io::tune(&stream, Some(Duration::from_millis(100)));
    let mut h = [0u8; HELLO_SIZE];
    let hello = tessera_net::io::read_exact_patient(&mut stream, &mut h, Duration::from_secs(5));
    let is_builder = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) == REQUEST_MAGIC;
    let builder = match hello {
        Err(e) => Err(e.to_string()),
        Ok(()) if is_builder => builder_hello(&mut stream, &h).map(Some),
        Ok(()) => Ok(None),
    };
    // A source's link is claimed before its hello stops counting as under way, so that the
    // accepting never finds nobody on the way in while the link still waits.
    let source = matches!(builder, Ok(None)).then(|| crate::source_slot(u, &h));
    drop(hello_under_way);
    match builder {
        Err(why) => crate::refused(u, peer, why),
        Ok(Some((_, id))) if !u.builders.contains(&id) => crate::refused(
            u,
            peer,
            format!("builder {id} is not in this topology {:?}", u.builders),
        ),
        Ok(Some((channel, id))) => {
            let key = (id, channel as u8);
            if !u.claimed.lock().insert(key) {
                crate::refused(
                    u,
                    peer,
                    format!("builder {id} already has its {channel:?} connection open"),
                );
                return;
            }
            match channel {
                Channel::Control => take_requests(u, id, stream),
                Channel::Data => {
                    let _ = stream.set_nodelay(false);
                    send_answers(u, id, stream)
                }
            }
            u.claimed.lock().remove(&key);
        }
        Ok(None) => match source.unwrap_or_else(|| Err("no hello".into())) {
            Ok(slot) => crate::read_link(&**u, slot, stream),
            Err(why) => crate::refused(u, peer, why),
        },
    }
}

fn builder_hello(
    stream: &mut TcpStream,
    first: &[u8; HELLO_SIZE],
) -> Result<(Channel, u32), String> {
    let mut b = [0u8; 24];
    b[..HELLO_SIZE].copy_from_slice(first);
    tessera_net::io::read_exact_patient(stream, &mut b[HELLO_SIZE..], Duration::from_secs(5))
        .map_err(|e| e.to_string())?;
    match request::decode(&b, 64) {
        Ok(request::Decoded::Message(
            Message::Hello {
                role: Role::BuilderUnit,
                channel,
                id,
            },
            _,
        )) => Ok((channel, id)),
        Ok(other) => Err(format!("expected a builder's hello, got {other:?}")),
        Err(e) => Err(e.to_string()),
    }
}

/// A builder's control connection: its requests.
fn take_requests(u: &Arc<Unit>, builder: u32, mut stream: TcpStream) {
    let port = u.port(builder);
    let rs = &u.stats.requests;
    let mut r = MessageReader::new(1 << 20);
    loop {
        let (tag, event_id, sources) = match r.next(&mut stream, &u.abort) {
            Ok(Message::Request {
                tag,
                event_id,
                sources,
            }) => (tag, event_id, sources),
            Ok(Message::End { .. }) | Err(ReadEnd::Closed) | Err(ReadEnd::Stopped) => break,
            Ok(other) => {
                tracing::warn!(
                    readout_unit = u.id,
                    builder,
                    "unexpected {other:?} on a request connection"
                );
                break;
            }
            Err(ReadEnd::Failed(e)) => {
                tracing::warn!(readout_unit = u.id, builder, error = %e, "request connection failed");
                break;
            }
        };
        rs.requests.fetch_add(1, Ordering::Relaxed);
        let links: Vec<usize> = if sources.is_empty() {
            (0..u.sources.len()).collect()
        } else {
            let mut v: Vec<usize> = sources
                .iter()
                .filter_map(|s| {
                    let p = u.sources.iter().position(|x| x == s);
                    if p.is_none() {
                        rs.foreign_sources.fetch_add(1, Ordering::Relaxed);
                    }
                    p
                })
                .collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        // Take a descriptor from this builder's share; with none free, stop reading its
        // requests (TCP holds the builder) until answers go out.
        {
            let mut n = port.in_flight.lock();
            if *n >= u.share {
                rs.descriptor_waits.fetch_add(1, Ordering::Relaxed);
            }
            while *n >= u.share {
                if u.abort.load(Ordering::Relaxed) {
                    return;
                }
                port.freed.wait_for(&mut n, Duration::from_millis(50));
            }
            *n += 1;
        }
        rs.descriptors_in_use.fetch_add(1, Ordering::Relaxed);
        let req = Request {
            tag,
            builder,
            event_id,
            links,
        };
        let mut req = Some(req);
        while let Some(q) = req.take() {
            let mut t = u.requests.lock();
            match t.submit(q, u.now_ns(), |l| u.has(l, event_id)) {
                // Routed under the lock, so answers reach the queue in the table's order.
                Submit::Ready(a) => u.route(vec![a]),
                Submit::Pending => {}
                // The shares add up to the pool, so this waits only in a race with answers
                // being freed.
                Submit::NoDescriptor(q) => {
                    drop(t);
                    std::thread::sleep(Duration::from_millis(1));
                    req = Some(q);
                }
            }
        }
    }
    port.closed.store(true, Ordering::Relaxed);
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

/// A builder's data connection: answers written straight from the pages (one vectored write
/// per batch, the answer headers between the fragments' pages), which are held against clears
/// until the write returns. Before, every fragment was copied out of its pages into the answer
/// first: the model's "internal transfer", which the ROS leaves to the RobinNP's DMA.
fn send_answers(u: &Arc<Unit>, builder: u32, mut stream: TcpStream) {
    let port = u.port(builder);
    let rs = &u.stats.requests;
    let mut ok = true;
    let mut headers: Vec<u8> = Vec::new();
    // Per answer: its header's span, then its pieces' span in `lent`.
    let mut spans: Vec<(usize, usize, usize, usize)> = Vec::new();
    let mut lent: Vec<Lent> = Vec::new();
    let mut holds: Vec<(usize, Hold)> = Vec::new();
    let (mut units, mut items) = (0u64, 0u64);
    loop {
        let first = match port.answers_rx.recv_timeout(Duration::from_millis(20)) {
            Ok(a) => a,
            Err(_) => {
                let idle = *port.in_flight.lock() == 0;
                if u.abort.load(Ordering::Relaxed) || (port.closed.load(Ordering::Relaxed) && idle)
                {
                    break;
                }
                continue;
            }
        };
        let mut batch = vec![first];
        while batch.len() < 64 {
            match port.answers_rx.try_recv() {
                Ok(a) => batch.push(a),
                Err(_) => break,
            }
        }
        headers.clear();
        spans.clear();
        lent.clear();
        let sent_before = items;
        for a in &batch {
            if !ok {
                // Drained unwritten (below): nothing is lent, so nothing counts as sent. A
                // fragment stays unsent until an answer that is written lends it (the event
                // given to another builder), or its clear counts it `cleared_unsent`.
                continue;
            }
            let (hs, ls) = (headers.len(), lent.len());
            let ev = a.request.event_id;
            let mut missing = Vec::new();
            let (mut count, mut again) = (0u32, 0u64);
            for &l in &a.request.links {
                match u.links[l].lock().hold(ev, &mut lent) {
                    Some(h) => {
                        again += h.again() as u64;
                        holds.push((l, h));
                        count += 1;
                    }
                    None => missing.push(u.sources[l]),
                }
            }
            // Once per answer, not per fragment under each link's lock: a clear may count one
            // of these out first, which a report taken at that instant sees as a moment's skew
            // (the counter wraps and is read saturating), never as a lasting error.
            rs.stored_sent_fragments
                .fetch_add(count as u64 - again, Ordering::Relaxed);
            missing.sort_unstable();
            let mut h = AnswerHeader {
                tag: a.request.tag,
                event_id: ev,
                readout_unit: u.id,
                fragment_count: count,
                total_size: 0,
                missing,
            };
            let dlen: usize = lent[ls..].iter().map(|p| p.len).sum();
            h.total_size = (h.header_size() + dlen) as u32;
            if !h.missing.is_empty() {
                rs.partial_answers.fetch_add(1, Ordering::Relaxed);
            }
            rs.fragments_sent.fetch_add(count as u64, Ordering::Relaxed);
            if again > 0 {
                rs.fragments_answered_again
                    .fetch_add(again, Ordering::Relaxed);
            }
            rs.bytes_sent.fetch_add(dlen as u64, Ordering::Relaxed);
            items += count as u64;
            h.encode_into(&mut headers, dlen);
            spans.push((hs, headers.len(), ls, lent.len()));
        }
        if items > sent_before {
            *rs.fragments_sent_by_builder
                .lock()
                .entry(builder)
                .or_default() += items - sent_before;
        }
        if ok {
            let mut io: Vec<IoSlice> = Vec::with_capacity(spans.len() + lent.len());
            for &(hs, he, ls, le) in &spans {
                io.push(IoSlice::new(&headers[hs..he]));
                for p in &lent[ls..le] {
                    // SAFETY: held above and released only after `io` is gone (below).
                    io.push(IoSlice::new(unsafe {
                        std::slice::from_raw_parts(p.ptr, p.len)
                    }));
                }
            }
            if let Err(e) = tessera_net::io::write_all_vectored(&mut stream, &mut io) {
                // The builder is gone: its remaining answers are drained without writing, so
                // its descriptors come back; the event manager gives its events to others.
                tracing::warn!(readout_unit = u.id, builder, error = %e, "builder data connection failed");
                ok = false;
            }
        }
        lent.clear();
        // Each link's holds given back under one lock.
        holds.sort_unstable_by_key(|&(l, _)| l);
        let mut rest = holds.drain(..).peekable();
        let mut freed = false;
        while let Some((l, h)) = rest.next() {
            let mut b = u.links[l].lock();
            freed |= b.release(h);
            while let Some((_, h)) = rest.next_if(|&(m, _)| m == l) {
                freed |= b.release(h);
            }
        }
        if freed {
            // Fragments cleared while this write held them: their pages are free only now.
            u.publish_pages();
            let _g = u.space_lock.lock();
            u.space.notify_all();
        }
        units += batch.len() as u64;
        rs.answers.fetch_add(batch.len() as u64, Ordering::Relaxed);
        rs.descriptors_in_use
            .fetch_sub(batch.len() as u64, Ordering::Relaxed);
        let mut n = port.in_flight.lock();
        *n -= batch.len();
        port.freed.notify_all();
    }
    if ok {
        let mut end = Vec::new();
        Message::End { units, items }.encode_into(&mut end);
        let _ = std::io::Write::write_all(&mut stream, &end);
    }
    let _ = stream.shutdown(std::net::Shutdown::Write);
}

fn sweep(u: &Arc<Unit>) {
    let mut end_sent = false;
    loop {
        std::thread::sleep(Duration::from_millis(2));
        {
            let mut t = u.requests.lock();
            let answers = t.expire(u.now_ns(), |l| u.silence(l));
            u.route(answers);
        }
        // The page gauge is refreshed here and on clears, not on every read: it takes every
        // link's lock.
        u.publish_pages();
        if !end_sent && u.open_links.load(Ordering::Acquire) == 0 {
            // Every link has closed and announced all it stored.
            let mut m = u.manager.lock();
            m.links_ended = true;
            if let Some(tx) = &m.tx {
                let _ = tx.send(Message::End {
                    units: u.stats.requests.announced.load(Ordering::Relaxed),
                    items: 0,
                });
            }
            end_sent = true;
        }
        if u.manager_ended.load(Ordering::Relaxed) || u.abort.load(Ordering::Relaxed) {
            break;
        }
    }
    // The event manager has ended the run (or is gone): no clear will come. Pending requests
    // are answered now with what there is, so no builder waits for them.
    {
        let mut t = u.requests.lock();
        let rest = t.expire_all();
        u.route(rest);
    }
    for l in &u.stats.links {
        if l.state() == LinkState::Waiting {
            l.set_state(LinkState::NeverConnected);
        }
    }
}

/// Reads the event manager's clears and BUSY; when its connection is lost before the end of
/// the run, waits up to `takeover` for it to come back (request-protocol §4.2), then ends the
/// unit naming it.
fn manager_link(
    u: &Arc<Unit>,
    mut em: TcpStream,
    mut writer: std::thread::JoinHandle<()>,
    addr: &str,
    takeover: Duration,
) {
    let rs = &u.stats.requests;
    let mut wait = tessera_net::control::TakeoverWait::new(takeover);
    loop {
        let opened = Instant::now();
        let mut heard = false;
        let mut r = MessageReader::new(1 << 24);
        let lost = loop {
            match r.next(&mut em, &u.abort) {
                Ok(Message::Clear { event_ids }) => {
                    heard = true;
                    u.clear(&event_ids)
                }
                Ok(Message::Throttle { busy }) => {
                    heard = true;
                    rs.throttled.store(busy, Ordering::Relaxed)
                }
                Ok(Message::End { .. }) if !u.manager.lock().links_ended => {
                    // The manager ended the run before this unit's sources did (every builder
                    // lost, none back): nothing it holds can be built any more.
                    *rs.manager_error.lock() = Some(
                        "the event manager ended the run before this unit's sources ended (see its report)".into(),
                    );
                    break None;
                }
                Ok(Message::End { .. }) | Err(ReadEnd::Stopped) => break None,
                Ok(other) => break Some(format!("event manager sent {other:?}")),
                Err(ReadEnd::Closed) => {
                    break Some("event manager connection lost before the end of the run".into())
                }
                Err(ReadEnd::Failed(e)) => break Some(format!("event manager link: {e}")),
            }
        };
        // This connection is over: its writer ends with its queue.
        u.manager.lock().tx = None;
        let _ = em.shutdown(std::net::Shutdown::Both);
        let _ = writer.join();
        let Some(why) = lost else { break };
        // BUSY came from the manager that is gone; the pages bound what the links may take.
        rs.throttled.store(false, Ordering::Relaxed);
        rs.manager_losses.fetch_add(1, Ordering::Relaxed);
        let deadline = match wait.lost(opened, heard) {
            Some(d) if !u.abort.load(Ordering::Relaxed) => d,
            _ => {
                *rs.manager_error.lock() = Some(why);
                break;
            }
        };
        tracing::warn!(
            readout_unit = u.id,
            reason = %why,
            "lost the event manager; waiting up to {} s for it to take the run over",
            wait.seconds()
        );
        let back = tessera_net::control::reopen(addr, Role::ReadoutUnit, u.id, deadline, &u.abort)
            .and_then(|s| {
                let w = tessera_net::control::spawn_writer(format!("ru{}-to-em", u.id), &s)?;
                Ok((w, s))
            });
        match back {
            Ok(((w, tx), s)) => {
                em = s;
                writer = w;
                let n = reannounce(u, tx);
                tracing::info!(
                    readout_unit = u.id,
                    events = n,
                    "event manager back: every event held announced again"
                );
            }
            Err(e) => {
                *rs.manager_error.lock() =
                    Some(format!("{why}; not back within {} s ({e})", wait.seconds()));
                break;
            }
        }
    }
    // Without its event manager no fragment of this unit can be built or cleared: the unit
    // ends now, with the reason, rather than reading its sources for ever. What it holds is
    // reported as still buffered.
    if rs.manager_error.lock().is_some() {
        tracing::error!(readout_unit = u.id, "lost the event manager; the unit ends");
        u.abort.store(true, Ordering::Release);
    }
    rs.throttled.store(false, Ordering::Relaxed);
    u.manager_ended.store(true, Ordering::Relaxed);
    u.space.notify_all();
}

/// On a new event-manager connection: announces every event held, then the unit's end if its
/// links have ended, and only then makes the connection the unit's (under the manager lock): an
/// event stored meanwhile is in this list or announced after it on the same connection (twice
/// is harmless: the first counts), and the end never comes before an announcement.
fn reannounce(u: &Unit, tx: Sender<Message>) -> u64 {
    let mut m = u.manager.lock();
    let mut ids: Vec<u64> = u.links.iter().flat_map(|l| l.lock().event_ids()).collect();
    ids.sort_unstable();
    ids.dedup();
    for chunk in ids.chunks(request::MAX_LIST) {
        let _ = tx.send(Message::Announce {
            event_ids: chunk.to_vec(),
        });
    }
    if m.links_ended {
        let _ = tx.send(Message::End {
            units: u.stats.requests.announced.load(Ordering::Relaxed),
            items: 0,
        });
    }
    m.tx = Some(tx);
    drop(m);
    // A new manager has heard nothing: a link still full says so again.
    let _g = u.space_lock.lock();
    u.full_said.store(false, Ordering::Release);
    u.space.notify_all();
    drop(_g);
    let n = ids.len() as u64;
    u.stats.requests.reannounced.fetch_add(n, Ordering::Relaxed);
    n
}

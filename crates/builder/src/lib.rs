//! The builder unit (CMS BU, CODA EB, ATLAS DCM).
//!
//! Each readout unit's link (each rail) is served by the process's I/O pollers
//! ([`tessera_net::reactor`]), which take super-fragments (zero-copy slices of its read chunks)
//! into the shared [`Assembler`]; a sweeper times events out; the link to the recorder, served
//! by the sending stage's pollers, writes finished event records, fragments straight from the
//! read chunks. Each event is checked:
//! every expected source present (else flagged incomplete, naming the missing sources), one event
//! ID in every fragment, fragment counts and sizes as the super-fragments declare, trigger types
//! that agree.

pub mod pull;
mod record;
pub mod stats;

use crossbeam_channel::Receiver;
use parking_lot::Mutex;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_assembly::{Assembled, Assembler, Offer};
use tessera_format::link::{
    decode_link, LinkItem, PeerHello, PeerRole, SuperFragmentHeader, PEER_HELLO_SIZE,
};
use tessera_net::reactor::{HELD_RETRY, MEMORY_RECHECK, READS_PER_TURN, SILENCE_PROOF};
use tessera_net::reader::Fill;
use tessera_net::role::{spawn, RoleThreads};
use tessera_net::{ChunkReader, ChunkSlice};

pub use pull::PullConfig;
pub use stats::{BuilderStats, RuLinkStats};

pub struct BuilderConfig {
    pub id: u16,
    /// Where readout units connect: one listener per rail (the first is `listen`, the others
    /// `rails`); every readout unit connects to each.
    pub listeners: Vec<TcpListener>,
    /// Readout unit IDs it expects, and the sources each reads (to name missing sources).
    pub readout_units: Vec<(u32, Vec<u32>)>,
    /// Where to send event records; `None`: count them and drop them (building measurements).
    pub recorder: Option<String>,
    pub buffer: u64,
    pub read_chunk: usize,
    /// Fill every link's budget with touched read chunks before any readout unit sends.
    pub reserve: bool,
    pub event_timeout: Duration,
    /// Cap on the events open at once.
    pub max_open_events: usize,
    /// Largest super-fragment accepted.
    pub max_message: usize,
}

/// A super-fragment as the assembler holds it: its header, its bytes, and what its fragments
/// said when it was read.
struct Part {
    h: SuperFragmentHeader,
    sf: ChunkSlice,
    check: record::PartCheck,
}

/// A built event on its way to the recorder.
struct Built {
    header: record::HeaderBytes,
    /// Its fragments, one slice each or a part's packed in one.
    fragments: record::Pieces,
    fragment_count: u32,
    event_id: u64,
    /// Declared after the fragments, so dropped after them: see [`Queued`].
    _queued: Option<Queued>,
}

/// A built event's fragments, counted in `queued_fragments` from when it is built until its
/// memory is back in the links' budgets. Counted down when its write was done instead, the
/// count fell to zero a moment before the memory came back, and a builder that looked in that
/// moment took itself for standing still and let an event go incomplete (seen in CI, a run held
/// by its recorder: [`stood_still`]).
struct Queued {
    stats: Arc<BuilderStats>,
    fragments: u64,
}

impl Queued {
    fn new(stats: &Arc<BuilderStats>, fragments: u64) -> Queued {
        stats
            .queued_fragments
            .fetch_add(fragments, Ordering::Relaxed);
        Queued {
            stats: stats.clone(),
            fragments,
        }
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        // Release: whoever reads the count down sees the budgets this event's memory went to.
        self.stats
            .queued_fragments
            .fetch_sub(self.fragments, Ordering::Release);
    }
}

impl tessera_net::sender::Outgoing for Built {
    fn encode_header(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.header);
    }

    fn fragments(&self) -> &[ChunkSlice] {
        &self.fragments
    }

    fn fragment_count(&self) -> u64 {
        self.fragment_count as u64
    }
}

/// Departed events a push-mode builder's assembler remembers, to tell a late super-fragment
/// from a duplicate.
const DEPARTED_MEMORY: usize = 1 << 16;

/// The most heap memory a push-mode builder of `readout_units` units holds for its bookkeeping
/// beside its budget: its assembler's, capped at `max_open` open events
/// ([`Assembler::bytes_at_most`]). What `tessera check` and a node agent count for it. (A
/// request-mode builder's events and notes are bounded by its credits.)
pub fn bookkeeping_bytes(readout_units: usize, max_open: usize) -> u64 {
    Assembler::<Part>::bytes_at_most(readout_units, max_open, DEPARTED_MEMORY)
}

/// One connection of a readout unit (a unit has one per rail).
#[derive(Clone, Copy, Debug, Default)]
struct Rail {
    connected: bool,
    closed: bool,
    /// Its last progress floor: everything below it that went this way was sent.
    floor: Option<u64>,
    /// Fragments its end message declared.
    ended: Option<u64>,
    /// Silent from .0, still silent at .1 (ns since the start).
    silent: Option<(u64, u64)>,
    /// Its reader has found no memory since then (ns since the start), without a read between.
    starved_since: Option<u64>,
}

struct Shared {
    id: u16,
    rus: Vec<(u32, Vec<u32>)>,
    /// Per readout unit, its rails.
    rails: Vec<Mutex<Vec<Rail>>>,
    /// Per rail, its accepting's latest proof that no unit was on its way in: a rail that never
    /// connected is silent up to it, not up to the sweep's clock.
    none_waiting: Vec<tessera_net::io::NoneWaiting>,
    assembler: Mutex<Assembler<Part>>,
    to_recorder: Option<tessera_net::sender::Queue<Built>>,
    stats: Arc<BuilderStats>,
    /// Runnable time since the builder started (`tessera_net::clock`): what timeouts count.
    clock: tessera_net::clock::Runnable,
    stop: Arc<AtomicBool>,
    abort: Arc<AtomicBool>,
    max_message: usize,
    read_chunk: usize,
    event_timeout_ns: u64,
}

pub struct BuilderUnit {
    pub stats: Arc<BuilderStats>,
    role: RoleThreads,
}

impl BuilderUnit {
    pub fn start(cfg: BuilderConfig) -> std::io::Result<BuilderUnit> {
        let n = cfg.readout_units.len();
        let rails = cfg.listeners.len().max(1);
        // Every rail has a budget of its own, of at least two read chunks (the configuration
        // refuses less).
        let per_link = (cfg.buffer / n.max(1) as u64).max(2 * rails as u64 * cfg.read_chunk as u64);
        let stats = Arc::new(BuilderStats::new(
            cfg.id,
            cfg.readout_units.iter().map(|r| r.0),
            per_link,
            rails,
        ));
        if cfg.reserve {
            stats.reserve(cfg.read_chunk);
        }
        let mut role = RoleThreads::default();
        let stop = role.stop.clone();
        let abort = role.abort.clone();
        let to_recorder = match &cfg.recorder {
            Some(addr) => {
                let s = tessera_net::io::connect_retry(addr, Duration::from_secs(10))?;
                tessera_net::io::tune(&s, Some(Duration::from_secs(1)))?;
                let (tx, rx, bell) = tessera_net::sender::queue::<Built>(256);
                let live = Arc::new(tessera_net::reactor::Tally::default());
                let conn = sender_to_recorder(cfg.id, s, rx, bell, stats.clone(), &live)?;
                tessera_net::reactor::Reactor::stage(tessera_net::reactor::Stage::Send)
                    .register(Box::new(conn));
                role.polled.push(live);
                Some(tx)
            }
            None => None,
        };
        let shared = Arc::new(Shared {
            id: cfg.id,
            rails: (0..n)
                .map(|_| Mutex::new(vec![Rail::default(); rails]))
                .collect(),
            none_waiting: vec![Default::default(); rails],
            rus: cfg.readout_units,
            // Readout units send events in the order they finish them, not by event ID: where
            // they are comes from their progress messages instead.
            assembler: Mutex::new(
                Assembler::new(n, cfg.event_timeout.as_nanos() as u64, DEPARTED_MEMORY)
                    .with_max_open(cfg.max_open_events),
            ),
            to_recorder,
            stats: stats.clone(),
            clock: tessera_net::clock::Runnable::start(),
            stop: stop.clone(),
            abort: abort.clone(),
            max_message: cfg.max_message,
            read_chunk: cfg.read_chunk,
            event_timeout_ns: cfg.event_timeout.as_nanos() as u64,
        });
        {
            let sh = shared.clone();
            tessera_net::sweeper::Sweeper::stage(tessera_net::reactor::Stage::Builder).add_to(
                &mut role,
                format!("bu{}", cfg.id),
                move || sweep(&sh),
            );
        }
        for (rail, l) in cfg.listeners.into_iter().enumerate() {
            accept(&shared, rail, l, &mut role);
        }
        Ok(BuilderUnit { stats, role })
    }

    pub fn stop(&self) {
        self.role.stop();
    }

    pub fn abort(&self) {
        self.role.abort();
    }

    pub fn is_finished(&self) -> bool {
        self.role.is_finished()
    }

    pub fn join(self) {
        self.role.join();
    }
}

impl Shared {
    fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }

    fn publish_held(&self, a: &Assembler<Part>) {
        self.stats
            .pending_events
            .store(a.pending_events() as u64, Ordering::Relaxed);
    }

    /// Rail `rail` of readout unit `slot` delivers nothing more; the unit is closed with its
    /// last rail. A rail that ended early leaves the others' promises: events sent its way and
    /// lost with it are excused by the others' floors (everything below them was sent).
    fn close_rail(&self, slot: usize, rail: usize) {
        let last = {
            let mut rs = self.rails[slot].lock();
            rs[rail].closed = true;
            rs[rail].connected = true;
            if let Some(sum) = rs.iter().map(|r| r.ended).sum::<Option<u64>>() {
                self.stats.links[slot]
                    .declared_fragments
                    .store(sum, Ordering::Relaxed);
            }
            rs.iter().all(|r| r.closed)
        };
        if last {
            self.close_link(slot);
        } else {
            self.rails_changed(slot);
        }
    }

    /// Tells the assembler what the rails of `slot` say together: the lowest floor of the
    /// open rails (none while one has said nothing), and a silence while any open rail is
    /// silent (the earliest silence: its events cannot arrive).
    fn rails_changed(&self, slot: usize) {
        let now = self.now_ns();
        let (floor, silent) = {
            let rs = self.rails[slot].lock();
            let open = rs.iter().filter(|r| !r.closed);
            let floor = open.clone().map(|r| r.floor).min().flatten();
            let silent = open
                .filter_map(|r| {
                    if r.connected {
                        r.silent
                    } else {
                        Some((0, now))
                    }
                })
                .min_by_key(|s| s.0);
            (floor, silent)
        };
        let ready = {
            let mut a = self.assembler.lock();
            a.heard(slot);
            if let Some((since, until)) = silent {
                a.quiet(slot, since, until);
            }
            let r = match floor {
                Some(f) => {
                    // Events that lacked only units promised past them leave now: waiting out
                    // the timeout held the other units' parts in their read chunks, and with
                    // two chunks a link two such events stood the builder still for good
                    // (wire-format §2.3).
                    a.promise_floor(slot, f);
                    let mut r: Vec<_> = a.take_passed().collect();
                    r.extend(a.expire(now));
                    r
                }
                None => Vec::new(),
            };
            self.publish_held(&a);
            r
        };
        self.finish(ready);
    }

    /// A rail's reader found it silent from `since` to `until` (`Some`), or heard it (`None`).
    fn rail_silent(&self, slot: usize, rail: usize, s: Option<(u64, u64)>) {
        {
            let mut rs = self.rails[slot].lock();
            rs[rail].silent =
                s.map(|(since, until)| (rs[rail].silent.map_or(since, |(first, _)| first), until));
        }
        self.rails_changed(slot);
    }

    fn close_link(&self, slot: usize) {
        self.stats.links[slot].closed.store(true, Ordering::Release);
        let ready = {
            let mut a = self.assembler.lock();
            let r = a.close(slot);
            self.publish_held(&a);
            r
        };
        self.finish(ready);
    }

    /// Checks and encodes departed events, and passes them on.
    fn finish(&self, ready: Vec<Assembled<Part>>) {
        self.finish_keeping(ready, 0);
    }

    /// [`Self::finish`], returning up to `keep` of the events' emptied part lists, for the
    /// assembler to reuse ([`Assembler::recycle`]).
    fn finish_keeping(&self, ready: Vec<Assembled<Part>>, keep: usize) -> Vec<Vec<Option<Part>>> {
        if ready.is_empty() {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(ready.len());
        let mut lists = Vec::with_capacity(keep.min(ready.len()));
        // One clock read for the batch: its events are built within microseconds of each other.
        let now_ns = self.now_ns();
        for ev in ready {
            let (built, parts) = self.build(ev, now_ns);
            out.push(built);
            if lists.len() < keep {
                lists.push(parts);
            }
        }
        if let Some(tx) = &self.to_recorder {
            let _ = tx.send(out);
        }
        lists
    }

    /// Builds an event's record (its latency taken at `now_ns`); returns it and the event's
    /// part list, emptied.
    fn build(&self, ev: Assembled<Part>, now_ns: u64) -> (Built, Vec<Option<Part>>) {
        let st = &self.stats;
        st.latency
            .observe_ns(now_ns.saturating_sub(ev.first_seen_ns));
        let mut rec = record::Record::of_parts(ev.parts.len());
        let mut missing: Vec<u32> = Vec::new();
        let mut parts = ev.parts;
        for (slot, part) in parts.drain(..).enumerate() {
            let Some(Part { h, sf, check }) = part else {
                missing.extend_from_slice(&self.rus[slot].1);
                continue;
            };
            st.held_fragments
                .fetch_sub(h.fragment_count as u64, Ordering::Relaxed);
            missing.extend_from_slice(&h.missing);
            let body = sf.slice(h.header_size(), sf.len() - h.header_size());
            if !rec.add_checked(body, &check, h.fragment_count, st) {
                missing.extend_from_slice(&self.rus[slot].1);
            }
        }
        let (header, fragments, fragment_count) = rec.finish(ev.event_id, self.id, missing, st);
        let built = Built {
            header,
            fragments,
            fragment_count,
            event_id: ev.event_id,
            _queued: self
                .to_recorder
                .is_some()
                .then(|| Queued::new(&self.stats, fragment_count as u64)),
        };
        (built, parts)
    }
}

/// Accepts readout units on rail `rail` until every link has ended (or the stop), on the
/// builder stage's acceptor (one thread for every builder and rail of the process), which also
/// reads each connection's hello without blocking, within its own deadline: a silent connection
/// holds nobody else's, and no thread is started per connection. A second connection for a unit
/// already connected on this rail, an unknown unit, or a bad hello is refused, counted and
/// logged with its address, also after every unit has connected. The role has finished once the
/// accepting, its hellos and every rail handed to the pollers have.
fn accept(sh: &Arc<Shared>, rail: usize, listener: TcpListener, role: &mut RoleThreads) {
    use tessera_net::acceptor::Greeted;
    use tessera_net::reactor::Tally;
    // Every rail handed to the pollers, until it has closed.
    let live = Arc::new(Tally::default());
    role.polled.push(live.clone());
    let accepting = Arc::new(Tally::default());
    role.polled.push(accepting.clone());
    let on_hello = {
        let sh = sh.clone();
        move |g: Greeted| {
            let (stream, peer, hello) = match g {
                Greeted::Said {
                    stream,
                    peer,
                    hello,
                } => (stream, peer, hello),
                Greeted::Refused { peer, why } => return refused(&sh, peer, &why),
            };
            let slot = match handshake(&sh, rail, &stream, &hello) {
                Ok(slot) => slot,
                Err(why) => return refused(&sh, peer, &why),
            };
            let reader = ChunkReader::new(
                sh.stats.links[slot].budgets[rail].clone(),
                sh.read_chunk.max(2 * sh.max_message),
            );
            let conn = PolledRail {
                sh: sh.clone(),
                slot,
                rail,
                stream,
                reader,
                want: 0,
                got: Vec::new(),
                progress: Vec::new(),
                done: false,
                eof: false,
                silence: Default::default(),
                held: Default::default(),
                unread: sh
                    .stats
                    .receive_queues
                    .gauge(tessera_net::queued::Side::Unread),
                bell: tessera_net::reactor::Doorbell::default(),
                starved: false,
                _live: live.enter(),
            };
            tessera_net::reactor::Reactor::stage(tessera_net::reactor::Stage::Builder)
                .register(Box::new(conn));
        }
    };
    let missing = {
        let sh = sh.clone();
        move || {
            sh.stats
                .links
                .iter()
                .any(|l| !l.closed.load(Ordering::Acquire))
        }
    };
    let on_end = {
        let (sh, accepting2) = (sh.clone(), accepting.clone());
        move |end: tessera_net::io::AcceptEnd| {
            if end != tessera_net::io::AcceptEnd::Stopped {
                return;
            }
            // Every hello of a unit that connected before the stop has been read: the rails
            // still unconnected will not be. Closing them may wait for the assembler: not on
            // the acceptor's thread.
            let guard = accepting2.enter();
            spawn(format!("bu{}-accept-end", sh.id), move || {
                for slot in 0..sh.rus.len() {
                    let never = {
                        let mut rs = sh.rails[slot].lock();
                        !std::mem::replace(&mut rs[rail].connected, true)
                    };
                    if never {
                        sh.close_rail(slot, rail);
                    }
                }
                drop(guard);
            });
        }
    };
    tessera_net::acceptor::Acceptor::stage(tessera_net::reactor::Stage::Builder).add(
        tessera_net::acceptor::Accepting {
            name: format!("bu{}", sh.id),
            listener,
            stop: sh.stop.clone(),
            missing: Box::new(missing),
            hello_len: PEER_HELLO_SIZE,
            hello_patience: tessera_net::acceptor::HELLO_PATIENCE,
            on_hello: Box::new(on_hello),
            on_end: Box::new(on_end),
            dialled: None,
            none_waiting: Some(sh.none_waiting[rail].clone()),
            dial_hellos: None,
        },
        &accepting,
    );
}

fn refused(sh: &Shared, peer: std::net::SocketAddr, why: &str) {
    tracing::warn!(builder = sh.id, %peer, %why, "refused a readout unit connection");
    sh.stats.refused_connections.fetch_add(1, Ordering::Relaxed);
}

fn handshake(sh: &Shared, rail: usize, stream: &TcpStream, hello: &[u8]) -> Result<usize, String> {
    tessera_net::io::tune(stream, None).map_err(|e| e.to_string())?;
    let hello = tessera_net::peer::check_hello(hello, PeerRole::ReadoutUnit)?;
    let slot = sh
        .rus
        .iter()
        .position(|r| r.0 == hello.id)
        .ok_or_else(|| format!("readout unit {} is not in this topology", hello.id))?;
    let mut rs = sh.rails[slot].lock();
    if std::mem::replace(&mut rs[rail].connected, true) {
        return Err(if rs.len() > 1 {
            format!(
                "readout unit {} is already connected on rail {rail}",
                hello.id
            )
        } else {
            format!("readout unit {} is already connected", hello.id)
        });
    }
    // Silent until it says something (an unconnected rail is silent from the start).
    rs[rail].silent = None;
    sh.stats.links[slot]
        .connected
        .store(true, Ordering::Release);
    Ok(slot)
}

/// A readout unit's rail, served by the process's I/O pollers ([`tessera_net::reactor`]): reads
/// what the socket has without blocking, offers super-fragments to the assembler in one lock per
/// read, and never waits (a link that has no memory or whose events the table cannot take yet
/// is looked at again a millisecond later and not read meanwhile: TCP holds the unit).
struct PolledRail {
    sh: Arc<Shared>,
    slot: usize,
    rail: usize,
    stream: TcpStream,
    reader: ChunkReader,
    want: usize,
    got: Vec<(u64, Part)>,
    progress: Vec<u64>,
    /// The end came, or the link broke the protocol: finish once what came before is taken.
    done: bool,
    eof: bool,
    silence: tessera_net::reactor::Silence,
    held: tessera_net::reactor::Held,
    unread: tessera_net::queued::QueueGauge,
    /// Rung by the link's budget when memory comes back after a read found none.
    bell: tessera_net::reactor::Doorbell,
    /// The last read found no memory (mirrored in the rail's `starved_since` for the sweeper).
    starved: bool,
    _live: tessera_net::reactor::TallyGuard,
}

impl PolledRail {
    fn fail(&self, e: String) {
        let link = &self.sh.stats.links[self.slot];
        *link.error.lock() = Some(if link.rail_super_fragments.len() > 1 {
            format!("rail {}: {e}", self.rail)
        } else {
            e
        });
    }

    /// Decodes every whole message in the window.
    fn parse(&mut self) {
        let sh = &*self.sh;
        let (slot, rail) = (self.slot, self.rail);
        let link = &sh.stats.links[slot];
        loop {
            match decode_link(self.reader.window(), sh.max_message) {
                Ok((LinkItem::SuperFragment(h), n)) => {
                    let sf = self.reader.take(n);
                    link.super_fragments.fetch_add(1, Ordering::Relaxed);
                    link.rail_super_fragments[rail].fetch_add(1, Ordering::Relaxed);
                    link.fragments
                        .fetch_add(h.fragment_count as u64, Ordering::Relaxed);
                    // The part is walked now, while the kernel's copy has left it in cache.
                    let body = &sf[h.header_size().min(sf.len())..];
                    let check = record::PartCheck::of(h.event_id, body, h.fragment_count);
                    self.got.push((h.event_id, Part { h, sf, check }));
                }
                Ok((LinkItem::Progress(p), n)) => {
                    self.reader.skip(n);
                    self.progress.push(p.floor);
                }
                Ok((LinkItem::End(end), n)) => {
                    self.reader.skip(n);
                    sh.rails[slot].lock()[rail].ended = Some(end.fragments);
                    self.done = true;
                    return;
                }
                Ok((LinkItem::NeedMore(n), _)) => {
                    self.want = n;
                    return;
                }
                Ok((LinkItem::Idle, _)) => {
                    self.want = 0;
                    return;
                }
                Ok((other, _)) => {
                    self.fail(format!("unexpected message {other:?}"));
                    self.done = true;
                    return;
                }
                Err(e) => {
                    tracing::error!(builder = sh.id, readout_unit = sh.rus[slot].0, error = %e, "readout unit link broke the protocol; closing it");
                    self.fail(e.to_string());
                    self.done = true;
                    return;
                }
            }
        }
    }

    /// Notes for the sweeper that this rail's reader found no memory (kept from the first time
    /// until it reads again, or until the sweeper lets an event go and wants a new proof).
    fn starve(&mut self) {
        self.starved = true;
        let now = self.sh.now_ns();
        self.sh.rails[self.slot].lock()[self.rail]
            .starved_since
            .get_or_insert(now);
    }

    /// The rail read again: one lock when it leaves a starved spell, none otherwise.
    fn fed(&mut self) {
        if std::mem::take(&mut self.starved) {
            self.sh.rails[self.slot].lock()[self.rail].starved_since = None;
        }
    }

    fn count_held(&mut self, now: Instant, still: bool) {
        let busy = &self.sh.stats.links[self.slot].budgets[self.rail].busy_ns;
        self.held.count(busy, now, still);
    }

    /// Offers what came, then applies the floors said after it; false while the table of
    /// open events cannot take it all (back-pressure).
    fn offer(&mut self, now: Instant) -> bool {
        if !self.got.is_empty() {
            offer(&self.sh, self.slot, &mut self.got);
            if !self.got.is_empty() {
                self.count_held(now, true);
                // The table of open events is full. A floor read behind the super-fragments it
                // handed back still holds as far as the lowest of them (everything below that
                // was offered): applied so, it lets go the events the unit never had, which may
                // be what the table waits on. Kept for its whole value once they are in.
                if !self.progress.is_empty() {
                    let lowest = self.got.iter().map(|(ev, _)| *ev).min();
                    self.apply_floor(lowest);
                }
                return false;
            }
        }
        self.count_held(now, false);
        // A floor applies after the super-fragments that came before it.
        self.apply_floor(None);
        self.progress.clear();
        true
    }

    /// Raises this rail's floor to the highest read, at most `cap`.
    fn apply_floor(&self, cap: Option<u64>) {
        let Some(&floor) = self.progress.iter().max() else {
            return;
        };
        let floor = cap.map_or(floor, |c| floor.min(c));
        {
            let mut rs = self.sh.rails[self.slot].lock();
            let r = &mut rs[self.rail];
            if r.floor.is_some_and(|f| f >= floor) {
                return;
            }
            r.floor = Some(floor);
        }
        self.sh.rails_changed(self.slot);
    }

    fn finish(&mut self) -> tessera_net::reactor::Next {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        self.sh.close_rail(self.slot, self.rail);
        tessera_net::reactor::Next::Done
    }
}

impl tessera_net::reactor::Conn for PolledRail {
    fn fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.stream)
    }

    fn doorbell(&self) -> Option<&tessera_net::reactor::Doorbell> {
        Some(&self.bell)
    }

    fn turn(&mut self) -> tessera_net::reactor::Next {
        use tessera_net::reactor::Next;
        self.bell.answer();
        if self.sh.abort.load(Ordering::Relaxed) {
            self.count_held(Instant::now(), false);
            return self.finish();
        }
        self.unread
            .sample(std::os::fd::AsRawFd::as_raw_fd(&self.stream));
        let mut reads = 0;
        let mut drained = false;
        loop {
            if !self.done {
                self.parse();
            }
            let now = Instant::now();
            if !self.offer(now) {
                return Next::At(now + HELD_RETRY);
            }
            if self.done {
                return self.finish();
            }
            if self.eof {
                if !self.reader.window().is_empty() {
                    self.fail("link closed inside a super-fragment".into());
                }
                return self.finish();
            }
            if drained {
                // No low-water mark on a rail (see `Silence::next_look`): its bytes come in the
                // batches of its readout unit's rounds, already moderated, and a mark would hold
                // the slow rails of a fast builder (each a sixtieth of 16 x 60) until the next
                // look, and their events with them: 8 % less built per CPU-second there, and no
                // gain at 1 kHz (docs/PERFORMANCE.md).
                return Next::Readable(now + SILENCE_PROOF);
            }
            if reads == READS_PER_TURN {
                return Next::Again;
            }
            reads += 1;
            match self
                .reader
                .try_fill(&mut self.stream, self.want, &self.bell)
            {
                Ok(Fill::Data(0)) => {
                    self.fed();
                    // Nothing, not even a progress message, since `since`: silence.
                    let now = Instant::now();
                    if let Some(since) = self.silence.empty_read(self.reader.read_started, now) {
                        let s = self.sh.clock.ns_at(since);
                        // Silent up to the read (which did not wait), not up to whenever this
                        // thread got here: a stall in between proves nothing of the unit.
                        let read = self.reader.read_started.unwrap_or(now);
                        let until = self.sh.clock.ns_at(read);
                        self.sh.rail_silent(self.slot, self.rail, Some((s, until)));
                    }
                    return Next::Readable(now + SILENCE_PROOF);
                }
                Ok(Fill::Data(_)) => {
                    self.fed();
                    drained = self.reader.drained();
                    if self.silence.data(drained) {
                        self.sh.rail_silent(self.slot, self.rail, None);
                    }
                }
                Ok(Fill::Eof) => {
                    self.fed();
                    self.eof = true;
                }
                Ok(Fill::NoMemory) => {
                    self.starve();
                    self.silence.not_read();
                    let now = Instant::now();
                    self.count_held(now, true);
                    return Next::At(now + MEMORY_RECHECK);
                }
                Ok(Fill::Stopped) => unreachable!("try_fill never waits"),
                Err(e) => {
                    self.fail(e.to_string());
                    return self.finish();
                }
            }
        }
    }
}

fn offer(sh: &Shared, slot: usize, got: &mut Vec<(u64, Part)>) {
    let now = sh.now_ns();
    let mut ready = Vec::new();
    let most = got.len();
    let st = &sh.stats;
    let mut left = Vec::new();
    // How many emptied part lists the assembler takes back after the events are built.
    let room;
    {
        let mut a = sh.assembler.lock();
        let mut items = got.drain(..);
        for (ev, part) in items.by_ref() {
            let nf = part.h.fragment_count as u64;
            st.held_fragments.fetch_add(nf, Ordering::Relaxed);
            match a.offer(slot, ev, part, now) {
                Offer::Full(part) => {
                    st.held_fragments.fetch_sub(nf, Ordering::Relaxed);
                    left.push((ev, part));
                    break;
                }
                Offer::Held => {}
                Offer::Ready(e) => {
                    // At most one event leaves per part offered: sized once, not grown by
                    // doubling.
                    if ready.capacity() == 0 {
                        ready.reserve(most);
                    }
                    ready.push(e)
                }
                Offer::Duplicate(_) => {
                    st.held_fragments.fetch_sub(nf, Ordering::Relaxed);
                    st.duplicate_fragments.fetch_add(nf, Ordering::Relaxed);
                }
                Offer::Late(_) | Offer::Closed(_) => {
                    st.held_fragments.fetch_sub(nf, Ordering::Relaxed);
                    st.late_fragments.fetch_add(nf, Ordering::Relaxed);
                }
            }
        }
        left.extend(items);
        sh.publish_held(&a);
        room = a.spare_room();
    }
    // Kept in `got` itself, its capacity kept for the rail's next read (see the readout
    // unit's `offer`).
    got.append(&mut left);
    let lists = sh.finish_keeping(ready, room);
    if !lists.is_empty() {
        let mut a = sh.assembler.lock();
        for parts in lists {
            a.recycle(parts);
        }
    }
}

/// One sweep of the builder's open events, run by the builder stage's sweeper; false once every
/// readout unit's link has closed.
fn sweep(sh: &Shared) -> bool {
    let (ready, all_closed) = {
        let mut a = sh.assembler.lock();
        let now = sh.now_ns();
        // A rail that has not connected is listened for and says nothing: silence, up to its
        // accepting's last look that found nobody on the way in.
        for (slot, rails) in sh.rails.iter().enumerate() {
            let until = rails
                .lock()
                .iter()
                .zip(&sh.none_waiting)
                .filter(|(r, _)| !r.connected)
                .map(|(_, w)| w.until_ns(&sh.clock).unwrap_or(0))
                .min();
            if let Some(until) = until {
                a.quiet(slot, 0, until);
            }
        }
        let (mut ready, all_closed) = a.sweep(now);
        if ready.is_empty() && stood_still(sh, &a, now) {
            if let Some(ev) = a.let_go_oldest() {
                let_go(sh, &ev);
                ready.push(ev);
            }
        }
        sh.publish_held(&a);
        (ready, all_closed)
    };
    sh.finish(ready);
    !all_closed
}

/// Whether the builder stands still for good: every open rail of every open unit has found no
/// memory for a whole event timeout, its latest look was refused with no memory given back
/// since, and nothing built still holds memory on its way to the recorder. Its memory is then
/// held by open events alone, each waiting for a part that lies unread behind a rail that has no
/// memory to read it into, which only those events can give back: a unit that promises only in
/// its periodic heartbeat (wire-format §2.3) brings that about with two events it never had and
/// two read chunks a link. Nothing that could still arrive is refused by this test: with one
/// rail readable, memory back that its rail has not looked for yet, or a built event not yet
/// written and dropped, it is false, so back-pressure costs dead time, never an event. (A run
/// held by its recorder once lost an event here: the rails had starved for seconds, the last
/// built events' memory had just come back, and the sweep ran before the rails read again.)
fn stood_still(sh: &Shared, a: &Assembler<Part>, now: u64) -> bool {
    // Acquire: pairs with `Queued`'s release, so the budgets are seen with that memory back.
    if a.pending_events() == 0 || sh.stats.queued_fragments.load(Ordering::Acquire) > 0 {
        return false;
    }
    let mut any = false;
    for (slot, rails) in sh.rails.iter().enumerate() {
        if a.is_closed(slot) {
            continue;
        }
        let budgets = &sh.stats.links[slot].budgets;
        for (r, budget) in rails.lock().iter().zip(budgets).filter(|(r, _)| !r.closed) {
            // Held for a whole timeout, as the rail's own looks prove: starved since then, and
            // its latest look refused with no memory given back since.
            let starved = r
                .starved_since
                .is_some_and(|t| now.saturating_sub(t) >= sh.event_timeout_ns);
            if !starved || !budget.refused_since_given() {
                return false;
            }
            any = true;
        }
    }
    any
}

/// Counts and logs an event let go to end a stand-still, and asks for a new proof before the
/// next: every rail must find no memory again for a whole timeout, so an event is let go only
/// while the builder still stands still after the last one left (its memory may have freed the
/// rails, whose next reads then complete the events behind it).
fn let_go(sh: &Shared, ev: &Assembled<Part>) {
    sh.stats.stall_releases.fetch_add(1, Ordering::Relaxed);
    let lacking: Vec<u32> = ev.missing.iter().map(|&slot| sh.rus[slot].0).collect();
    tracing::warn!(
        builder = sh.id,
        event_id = ev.event_id,
        readout_units = ?lacking,
        "every readout-unit link held for memory by events waiting on each other for a whole event timeout: the oldest leaves incomplete (a unit that promises only in its heartbeat, wire-format 2.3)"
    );
    for rails in &sh.rails {
        for r in rails.lock().iter_mut() {
            r.starved_since = None;
        }
    }
}

/// The link to the recorder, served by the pollers of the sending stage.
fn sender_to_recorder(
    id: u16,
    stream: TcpStream,
    rx: Receiver<Vec<Built>>,
    bell: tessera_net::reactor::Doorbell,
    st: Arc<BuilderStats>,
    live: &Arc<tessera_net::reactor::Tally>,
) -> std::io::Result<impl tessera_net::reactor::Conn> {
    let hello = PeerHello {
        role: PeerRole::BuilderUnit,
        id: id as u32,
        flags: 0,
    };
    let st2 = st.clone();
    // Queued fragments are counted down by the events themselves, once their memory is back.
    let on_batch = move |o: tessera_net::sender::BatchOutcome, _: &[Built]| {
        if !o.written {
            st2.recorder_lost.fetch_add(o.fragments, Ordering::Relaxed);
        }
    };
    let on_error = move |e: &std::io::Error| {
        tracing::error!(builder = id, error = %e, "recorder link failed; events are dropped and counted");
        *st.recorder_error.lock() = Some(e.to_string());
    };
    tessera_net::sender::PolledSender::new(
        stream, rx, bell, hello, on_batch, on_error, None, true, live,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_net::reader::ChunkReader;

    /// A built event counts as queued for the recorder until its memory is back in its link's
    /// budget, never the other way round: the stand-still test reads "nothing queued" as "no
    /// memory still on its way back", and an event let go on that word is lost to the run.
    #[test]
    fn a_built_event_is_queued_until_its_memory_is_back() {
        let stats = Arc::new(BuilderStats::new(0, [0u32].into_iter(), 1 << 16, 1));
        let budget = stats.links[0].budgets[0].clone();
        let mut reader = ChunkReader::new(budget.clone(), 4096);
        let stop = AtomicBool::new(false);
        let mut bytes: &[u8] = &[7u8; 100];
        assert!(matches!(
            reader.fill(&mut bytes, 100, &stop).unwrap(),
            Fill::Data(100)
        ));
        let fragment = reader.take(100);
        drop(reader);
        let built = Built {
            header: Default::default(),
            fragments: [fragment].into_iter().collect(),
            fragment_count: 1,
            event_id: 1,
            _queued: Some(Queued::new(&stats, 1)),
        };
        assert_eq!(stats.queued_fragments.load(Ordering::Relaxed), 1);
        assert!(budget.used() > 0, "the event holds its read chunk");
        // What `stood_still` relies on: once the count reads zero, the memory is back.
        let watcher = {
            let (stats, budget) = (stats.clone(), budget.clone());
            std::thread::spawn(move || {
                while stats.queued_fragments.load(Ordering::Acquire) > 0 {
                    std::hint::spin_loop();
                }
                budget.used()
            })
        };
        drop(built);
        assert_eq!(
            watcher.join().unwrap(),
            0,
            "counted down before its memory was back"
        );
    }
}

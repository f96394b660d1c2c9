//! The readout unit (CMS RU, ATLAS ROS, COMET front-end PC).
//!
//! Threads, and why:
//! - an accept thread takes its sources' connections and checks each hello;
//! - push mode: every link is served by the process's I/O pollers (one `epoll` thread per core,
//!   [`tessera_net::reactor`], `polled.rs`), not a thread of its own: CODA's lesson was that one
//!   `select()` thread serialising 20 links collapsed while a thread per link scaled with the
//!   processors; a poller per processor keeps that parallelism without a wake-up per link and
//!   fragment. Each link reads large chunks from its own memory budget, validates every
//!   fragment, and offers the good ones to the shared [`Assembler`] in one lock per read;
//!   request mode still reads each link on a blocking thread (its paged buffers wait on a
//!   condition variable for clears);
//! - a sweeper that sends events out as incomplete once they waited past the timeout;
//! - one link per builder (and rail), served by the sending stage's pollers, writing each
//!   event's super-fragment with vectored writes straight from the read chunks (no copy of
//!   fragment data inside the unit).
//!
//! A link whose budget is full stops reading, so TCP holds its source: the unit is BUSY, never
//! growing. Every fragment read is accounted: accepted (then forwarded), or rejected by reason.

pub mod paged;
mod polled;
mod quarantine;
pub mod requests;
mod serve;
mod stats;

use crossbeam_channel::Receiver;
use parking_lot::Mutex;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_assembly::{Assembled, Assembler, Offer};
use tessera_config::AssignmentSection;
use tessera_format::link::{
    encode_super_fragment_header, super_fragment_header_size, PeerHello, PeerRole,
};
use tessera_format::wire::{Hello, HELLO_SIZE};
use tessera_format::{Decoded, StreamDecoder};
use tessera_net::line::Line;
use tessera_net::reader::Fill;
use tessera_net::role::{spawn, RoleThreads};
use tessera_net::{ChunkReader, ChunkSlice};

pub use serve::{LinkGenerator, RequestMode};
pub use stats::{LinkState, LinkStats, ReadoutStats, Rejection, RequestStats};

/// Everything a readout unit needs to start.
pub struct ReadoutConfig {
    pub id: u32,
    /// Bound by the caller, so its address is known before anything connects.
    pub listener: TcpListener,
    /// The source IDs it reads, one link each.
    pub sources: Vec<u32>,
    /// Builder addresses, in builder order (the assignment indexes this list): each builder's
    /// rails, one connection each; a builder's super-fragments go round its rails.
    pub builders: Vec<Vec<String>>,
    pub assignment: AssignmentSection,
    /// Total buffer memory, split evenly over the links.
    pub buffer: u64,
    pub read_chunk: usize,
    /// Fill every link's budget with touched read chunks before the sources connect.
    pub reserve: bool,
    pub event_timeout: Duration,
    /// Cap on the events open at once in push mode.
    pub max_open_events: usize,
    pub max_payload: usize,
    /// Dump file for rejected fragments and its size limit.
    pub quarantine: Option<(PathBuf, u64)>,
    /// Request mode (`builders` and `assignment` are then unused); `None`: push mode.
    pub request_mode: Option<RequestMode>,
    /// Addresses of sources that listen (SiTCP style): the unit connects to each.
    pub dial: Vec<String>,
}

/// One event's fragments from this unit on its way to its builder, or a promise (`promise`).
struct SuperFragment {
    event_id: u64,
    fragments: Vec<ChunkSlice>,
    /// Bytes in `fragments`, summed where the list was just made: the sending thread, on the
    /// other core as often as not, would otherwise read the whole list (gone cold) for the
    /// header's size before writing it (84 % of `encode_header` at 1 KiB x 8, `perf annotate`).
    body: usize,
    missing: Vec<u32>,
    readout_unit: u32,
    /// Not a super-fragment: a progress message whose floor is `event_id`, sent in order with
    /// the super-fragments (a flag rather than an enum: every access of the sender's write loop
    /// would match on it).
    promise: bool,
}

impl tessera_net::sender::Outgoing for SuperFragment {
    fn encode_header(&self, out: &mut Vec<u8>) {
        if self.promise {
            let p = tessera_format::link::Progress {
                readout_unit: self.readout_unit,
                floor: self.event_id,
            };
            out.extend_from_slice(&p.encode());
        } else {
            self.encode_super_fragment_header(out);
        }
    }

    fn fragments(&self) -> &[ChunkSlice] {
        &self.fragments
    }

    fn prefetch(&self) {
        tessera_assembly::hint::prefetch_all(&self.fragments);
    }

    fn is_unit(&self) -> bool {
        !self.promise
    }
}

impl SuperFragment {
    /// A progress message with floor `floor`, to travel in the queue with the super-fragments
    /// (see [`Shared::promise_after`]).
    fn promise(readout_unit: u32, floor: u64) -> SuperFragment {
        SuperFragment {
            event_id: floor,
            fragments: Vec::new(),
            body: 0,
            missing: Vec::new(),
            readout_unit,
            promise: true,
        }
    }

    fn encode_super_fragment_header(&self, out: &mut Vec<u8>) {
        let header_size = super_fragment_header_size(self.missing.len());
        encode_super_fragment_header(
            out,
            self.readout_unit,
            self.event_id,
            self.fragments.len() as u32,
            (header_size + self.body) as u32,
            &self.missing,
        );
    }
}

/// What reading a link needs, in either mode.
pub(crate) struct LinkCtx {
    pub id: u32,
    pub sources: Vec<u32>,
    pub stats: Arc<ReadoutStats>,
    /// Runnable time since the unit started (`tessera_net::clock`): what every timeout counts.
    pub clock: tessera_net::clock::Runnable,
    /// Raised when the run stops: no new connections; links that never connected are closed.
    pub stop: Arc<AtomicBool>,
    /// Raised when the drain deadline passed: readers give up on their links.
    pub abort: Arc<AtomicBool>,
    pub quarantine: Option<quarantine::Quarantine>,
    pub max_payload: usize,
    pub read_chunk: usize,
    /// The accepting's latest proof that no source was on its way in: links that never
    /// connected are silent up to it, not up to the sweep's clock.
    pub none_waiting: tessera_net::io::NoneWaiting,
}

impl LinkCtx {
    pub fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }

    /// Until when a link that never connected is proven silent (from the start): the last look
    /// of the accepting that found nobody on the way in; 0 before the first.
    pub fn never_connected_until_ns(&self) -> u64 {
        self.none_waiting.until_ns(&self.clock).unwrap_or(0)
    }
}

/// Where a link reader puts the fragments it read: the push-mode assembler, or the request-mode
/// paged buffers.
pub(crate) trait LinkSink: Send + Sync + 'static {
    fn ctx(&self) -> &LinkCtx;
    /// Takes a read's worth of good fragments. What it cannot take yet (the table of open
    /// events is full) stays in the vector, to be offered again.
    fn offer(&self, slot: usize, good: &mut Vec<(u64, ChunkSlice)>);
    /// The link was read and found silent from `since_ns` to `until_ns`.
    fn quiet(&self, _slot: usize, _since_ns: u64, _until_ns: u64) {}
    /// The link delivered bytes after a silence.
    fn heard(&self, _slot: usize) {}
    /// The link will deliver nothing more.
    fn close_link(&self, slot: usize);
    /// Called before each read of link `slot`: returns once it may be read (request mode waits
    /// while the event manager throttles, unless a request waits for the link).
    fn before_read(&self, _slot: usize) {}
}

struct Shared {
    ctx: LinkCtx,
    assembler: Mutex<Assembler<ChunkSlice>>,
    /// Per builder, one queue per rail.
    to_builders: Vec<Vec<tessera_net::sender::Queue<SuperFragment>>>,
    /// Per builder, super-fragments dispatched so far: the next one's rail.
    next_rail: Vec<AtomicUsize>,
    assignment: AssignmentSection,
    /// Batches of departed events on their way into the builder queues. Raised under the
    /// assembler lock, so a progress message computed under that lock while this is zero
    /// cannot overtake an event that already left the assembler.
    in_dispatch: AtomicUsize,
    /// Batches' places in line, handed out under the assembler lock.
    leaving: Line,
    /// One more than the highest event ID that left the assembler (0: none yet). Written under
    /// the assembler lock.
    departed_top: AtomicU64,
    /// One more than the highest event ID this unit moved past without ever having it (none of
    /// its sources sent it) and has not yet promised its builders it will not send (0: none).
    /// Written under the assembler lock.
    unpromised: AtomicU64,
    /// The highest floor computed for a promise, in the queue or by a heartbeat (written under
    /// the assembler lock). Every later promise says at least this: it stays true (everything
    /// below it has left the assembler), and the unit's own floor can fall (a source back from
    /// a silence counts again), while floors must never decrease on a link (wire-format §2.3).
    floor_said: AtomicU64,
    /// Super-fragment lists on their way back from the builder links.
    emptied: Arc<Emptied>,
}

/// A batch's place in the order batches left the assembler: it enters the builder queues in
/// that order (see [`Shared::dispatch`]). Dropped, it lets the next batch go (also when its own
/// never went) and counts the batch out of `in_dispatch`.
#[must_use]
struct Ticket<'a> {
    place: Option<tessera_net::line::Ticket<'a>>,
    sh: &'a Shared,
    /// A floor to promise every builder link right after the batch.
    promise: Option<u64>,
}

impl Ticket<'_> {
    fn wait_turn(&self) {
        if let Some(p) = &self.place {
            p.wait_turn();
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        drop(self.place.take());
        self.sh.in_dispatch.fetch_sub(1, Ordering::AcqRel);
    }
}

impl std::ops::Deref for Shared {
    type Target = LinkCtx;
    fn deref(&self) -> &LinkCtx {
        &self.ctx
    }
}

impl LinkSink for Shared {
    fn ctx(&self) -> &LinkCtx {
        &self.ctx
    }
    fn offer(&self, slot: usize, good: &mut Vec<(u64, ChunkSlice)>) {
        offer(self, slot, good)
    }
    fn close_link(&self, slot: usize) {
        Shared::close_link(self, slot)
    }
    fn quiet(&self, slot: usize, since_ns: u64, until_ns: u64) {
        self.assembler.lock().quiet(slot, since_ns, until_ns);
    }
    fn heard(&self, slot: usize) {
        self.assembler.lock().heard(slot);
    }
}

impl Shared {
    /// Sends departed events to their builders. Called without the assembler lock held; it
    /// never waits on a builder queue (they are bounded by the unit's budgets), only for the
    /// batch before its own.
    ///
    /// Batches enter the queues in the order they left the assembler, which is event-ID order
    /// for every event complete when it left: each builder then receives a unit's
    /// super-fragments in the order every other unit sends them (docs/wire-format.md, 2.2).
    /// Two pollers offering the same unit's links used to race here, and a later batch
    /// overtook an earlier one. A builder whose link buffer holds only a few super-fragments
    /// then filled one link with events the other units had not sent yet while their links
    /// held the ones it lacked: no link could read, no event timed out (every unit alive and
    /// held), and the run stood still.
    fn dispatch(&self, ready: Vec<Assembled<ChunkSlice>>, ticket: Option<Ticket<'_>>) {
        let Some(ticket) = ticket else {
            return;
        };
        ticket.wait_turn();
        self.dispatch_batch(ready, ticket.promise);
        // The ticket's drop lets the next batch go.
        drop(ticket);
    }

    /// Marks, under the assembler lock (`a`), that `ready` is on its way to [`Self::dispatch`],
    /// and gives it its place in line.
    fn leaving(
        &self,
        a: &Assembler<ChunkSlice>,
        ready: &[Assembled<ChunkSlice>],
    ) -> Option<Ticket<'_>> {
        if ready.is_empty() {
            return None;
        }
        let promise = self.promise_after(a, ready);
        self.in_dispatch.fetch_add(1, Ordering::AcqRel);
        Some(Ticket {
            place: Some(self.leaving.ticket()),
            sh: self,
            promise,
        })
    }

    /// The floor a promise says now (under the assembler lock `a`), never below one said
    /// before: the assembler's floor, or the last said if that is higher.
    fn floor_to_say(&self, a: &Assembler<ChunkSlice>) -> Option<u64> {
        let said = self.floor_said.load(Ordering::Relaxed);
        let f = match a.floor() {
            Some(f) => f.max(said),
            None if said > 0 => said,
            None => return None,
        };
        self.floor_said.store(f, Ordering::Relaxed);
        Some(f)
    }

    /// The floor to promise every builder right after `ready` (under the assembler lock `a`),
    /// when the unit moved past an event it never had and has not promised so yet.
    ///
    /// Another unit's super-fragment of such an event waits at its builder until this unit's
    /// promise says it will never come (wire-format §2.3), and meanwhile holds the read chunk
    /// it lies in. The heartbeat's promise, every 100 ms and only when nothing is queued for
    /// the link, came too late: with two read chunks a link at the builder, two such events
    /// pinned both, the builder read nothing more from the other unit, this unit's link filled
    /// with events waiting for it, and the promise queued behind them. The run stood still for
    /// good. Sent in the queue, the promise reaches the builder right after the super-fragment
    /// that came next: true, since every event below the floor has left the assembler, in this
    /// batch or one queued before it. A unit whose sources number events densely sends one per
    /// event it never had; one whose IDs step by more sends one per batch.
    fn promise_after(
        &self,
        a: &Assembler<ChunkSlice>,
        ready: &[Assembled<ChunkSlice>],
    ) -> Option<u64> {
        let mut top = self.departed_top.load(Ordering::Relaxed);
        let mut gap = self.unpromised.load(Ordering::Relaxed);
        for ev in ready {
            if ev.event_id > top {
                // IDs `top..event_id` never left this unit.
                gap = ev.event_id;
            }
            top = top.max(ev.event_id.saturating_add(1));
        }
        self.departed_top.store(top, Ordering::Relaxed);
        if gap == 0 {
            return None;
        }
        // `gap` is one more than the highest such ID: a floor of `gap` covers it.
        match self.floor_to_say(a) {
            Some(f) if f >= gap => {
                self.unpromised.store(0, Ordering::Relaxed);
                Some(f)
            }
            // An event below it is still open (it left by the timeout, out of order): the next
            // batch tries again.
            _ => {
                self.unpromised.store(gap, Ordering::Relaxed);
                None
            }
        }
    }

    fn dispatch_batch(&self, ready: Vec<Assembled<ChunkSlice>>, promise: Option<u64>) {
        let n = self.to_builders.len();
        let count = ready.len();
        let mut per_rail: Vec<Vec<Vec<SuperFragment>>> = self
            .to_builders
            .iter()
            .map(|r| r.iter().map(|_| Vec::new()).collect())
            .collect();
        for ev in ready {
            let missing: Vec<u32> = ev.missing.iter().map(|&i| self.sources[i]).collect();
            if !missing.is_empty() {
                self.stats
                    .incomplete_super_fragments
                    .fetch_add(1, Ordering::Relaxed);
            }
            // In place: the super-fragment's list is the assembler's part list, reused.
            let fragments = fragments_of(ev.parts);
            self.stats
                .queued_fragments
                .fetch_add(fragments.len() as u64, Ordering::Relaxed);
            let b = self.assignment.builder_for(ev.event_id, n);
            let rails = &mut per_rail[b];
            let rail = if rails.len() > 1 {
                self.next_rail[b].fetch_add(1, Ordering::Relaxed) % rails.len()
            } else {
                0
            };
            if rails[rail].capacity() == 0 {
                // Events are spread evenly over builders and rails, in blocks: about this many
                // each, and at most a block more (short of that, the vectors grew by copying
                // in a batch of a few blocks: 6 instructions a fragment at 1 KiB x 8).
                let block = usize::try_from(self.assignment.block).unwrap_or(usize::MAX);
                let each = count.div_ceil(n * rails.len()).saturating_add(block);
                rails[rail].reserve(each.min(count));
            }
            let body = fragments.iter().map(|f| f.len()).sum();
            rails[rail].push(SuperFragment {
                event_id: ev.event_id,
                fragments,
                body,
                missing,
                readout_unit: self.id,
                promise: false,
            });
        }
        if let Some(floor) = promise {
            for batch in per_rail.iter_mut().flatten() {
                batch.push(SuperFragment::promise(self.id, floor));
            }
        }
        for (b, rails) in per_rail.into_iter().enumerate() {
            for (rail, batch) in rails.into_iter().enumerate() {
                if !batch.is_empty() {
                    // The receiver only goes away after every sender is dropped, so this cannot
                    // fail while `self` holds a sender.
                    let _ = self.to_builders[b][rail].send(batch);
                }
            }
        }
    }

    fn publish_held(&self, a: &Assembler<ChunkSlice>) {
        self.stats
            .held_fragments
            .store(a.held_items() as u64, Ordering::Relaxed);
        self.stats
            .pending_events
            .store(a.pending_events() as u64, Ordering::Relaxed);
    }

    fn close_link(&self, slot: usize) {
        let ready = {
            let mut a = self.assembler.lock();
            let r = a.close(slot);
            self.publish_held(&a);
            let ticket = self.leaving(&a, &r);
            (r, ticket)
        };
        let (ready, ticket) = ready;
        self.dispatch(ready, ticket);
    }
}

/// A running readout unit.
pub struct ReadoutUnit {
    pub stats: Arc<ReadoutStats>,
    role: RoleThreads,
}

impl ReadoutUnit {
    /// Starts the unit: connects to every builder, then accepts its sources.
    pub fn start(cfg: ReadoutConfig) -> std::io::Result<ReadoutUnit> {
        let links = cfg.sources.len();
        let per_link = (cfg.buffer / links.max(1) as u64).max(2 * cfg.read_chunk as u64);
        let stats = Arc::new(ReadoutStats::new(cfg.id, &cfg.sources, per_link));
        let mut role = RoleThreads::default();
        let stop = role.stop.clone();
        let abort = role.abort.clone();
        let quarantine = cfg
            .quarantine
            .as_ref()
            .map(|(p, limit)| quarantine::Quarantine::new(p.clone(), *limit));
        if let Some(mode) = cfg.request_mode {
            // The link budgets hold only the read chunks; fragments live in the pages (taken
            // and touched at configure whatever `reserve` says).
            let stats = Arc::new(ReadoutStats::new(
                cfg.id,
                &cfg.sources,
                4 * cfg.read_chunk as u64,
            ));
            if cfg.reserve {
                stats.reserve(cfg.read_chunk);
            }
            let ctx = LinkCtx {
                id: cfg.id,
                sources: cfg.sources.clone(),
                stats: stats.clone(),
                clock: tessera_net::clock::Runnable::start(),
                stop,
                abort,
                quarantine,
                max_payload: cfg.max_payload,
                read_chunk: cfg.read_chunk,
                none_waiting: Default::default(),
            };
            serve::start(ctx, cfg.listener, cfg.dial, mode, per_link, &mut role)?;
            return Ok(ReadoutUnit { stats, role });
        }
        if cfg.reserve {
            stats.reserve(cfg.read_chunk);
        }
        let mut to_builders = Vec::new();
        // (builder, rail, connection, queue)
        let mut builder_links = Vec::new();
        for (b, rails) in cfg.builders.iter().enumerate() {
            let mut txs = Vec::new();
            for (rail, addr) in rails.iter().enumerate() {
                let s = tessera_net::io::connect_retry(addr, Duration::from_secs(10))?;
                tessera_net::io::tune(&s, Some(Duration::from_secs(1)))?;
                // Bounded by the link budgets (every super-fragment is slices of their chunks),
                // not in batches: a poller that waited on a full queue here would stop the other
                // units' links it serves, which the builder may need before it reads this one.
                let (tx, rx, bell) = tessera_net::sender::queue_unbounded::<SuperFragment>();
                txs.push(tx);
                builder_links.push((b, rail, rails.len(), s, rx, bell));
            }
            to_builders.push(txs);
        }
        let assembler = Assembler::new(links, cfg.event_timeout.as_nanos() as u64, DEPARTED_MEMORY)
            .ordered(true)
            .with_max_open(cfg.max_open_events);
        let emptied = Arc::new(Emptied::new(assembler.spare_room(), builder_links.len()));
        let shared = Arc::new(Shared {
            ctx: LinkCtx {
                id: cfg.id,
                sources: cfg.sources.clone(),
                stats: stats.clone(),
                clock: tessera_net::clock::Runnable::start(),
                stop: stop.clone(),
                abort: abort.clone(),
                quarantine,
                max_payload: cfg.max_payload,
                read_chunk: cfg.read_chunk,
                none_waiting: Default::default(),
            },
            // Sources send their fragments in event-ID order, so a link's fragment for a
            // later event means it will not send the earlier ones.
            assembler: Mutex::new(assembler),
            next_rail: to_builders.iter().map(|_| AtomicUsize::new(0)).collect(),
            to_builders,
            assignment: cfg.assignment.clone(),
            in_dispatch: AtomicUsize::new(0),
            leaving: Line::default(),
            departed_top: AtomicU64::new(0),
            unpromised: AtomicU64::new(0),
            floor_said: AtomicU64::new(0),
            emptied: emptied.clone(),
        });
        let senders = Arc::new(tessera_net::reactor::Tally::default());
        for (b, rail, rails, stream, rx, bell) in builder_links {
            let link = if rails > 1 {
                format!("builder {b} rail {rail}")
            } else {
                format!("builder {b}")
            };
            // Weak: the senders end when the last reader and the sweeper let go of the unit.
            let conn = sender_to_builder(
                cfg.id,
                b as u32,
                link,
                stream,
                rx,
                bell,
                stats.clone(),
                Arc::downgrade(&shared),
                emptied.clone(),
                &senders,
            )?;
            tessera_net::reactor::Reactor::stage(tessera_net::reactor::Stage::Send)
                .register(Box::new(conn));
        }
        // The unit has finished once its links to the builders have (their ends written and
        // the builders' closes seen).
        role.polled.push(senders);
        {
            let sh = shared.clone();
            tessera_net::sweeper::Sweeper::stage(tessera_net::reactor::Stage::Readout).add_to(
                &mut role,
                format!("ru{}", cfg.id),
                move || sweep(&sh),
            );
        }
        accept(&shared, cfg.listener, cfg.dial, &mut role);
        Ok(ReadoutUnit { stats, role })
    }

    /// No more connections; links that never connected count as closed. Connected links drain.
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

/// Accepts sources until every link has ended (or the stop), on the readout stage's acceptor
/// (one thread for every unit of the process), which also reads each connection's hello without
/// blocking, within its own deadline: a silent or slow connection holds nobody else's hello, and
/// no thread is started per connection. A connection for a source that is connected or has
/// finished, or that never says a valid hello, is refused, counted and logged with its address,
/// also after every source has connected. The role has finished once the accepting, its hellos
/// and every link handed to the pollers have.
fn accept<S: LinkSink>(
    sh: &Arc<S>,
    listener: TcpListener,
    dial: Vec<String>,
    role: &mut RoleThreads,
) {
    use tessera_net::acceptor::Greeted;
    use tessera_net::reactor::Tally;
    let c = sh.ctx();
    let id = c.id;
    // Every link handed to the pollers, until it has closed and been accounted.
    let live = Arc::new(Tally::default());
    role.polled.push(live.clone());
    // The accepting, then what its end waits for.
    let accepting = Arc::new(Tally::default());
    role.polled.push(accepting.clone());
    // Sources that listen are dialled beside the accepting (at most `Hellos::MAX` saying hello
    // at once, the dialler waiting beyond); their hellos are read by the acceptor like the
    // accepted ones', and the accepting does not end before the dialler has.
    let dial_hellos = tessera_net::io::Hellos::default();
    let dialled = (!dial.is_empty()).then(|| {
        let (tx, rx) = crossbeam_channel::unbounded::<tessera_net::acceptor::Dialled>();
        let stop = c.stop.clone();
        let hellos = dial_hellos.clone();
        spawn(format!("ru{id}-dial"), move || {
            let acceptor =
                tessera_net::acceptor::Acceptor::stage(tessera_net::reactor::Stage::Readout);
            tessera_net::io::dial_until(&dial, &stop, &hellos, |stream, peer, hello| {
                let _ = tx.send((stream, peer, hello));
                acceptor.wake();
            });
        });
        rx
    });
    let on_hello = {
        let (sh, live) = (sh.clone(), live);
        move |g: Greeted| match g {
            Greeted::Said {
                stream,
                peer,
                hello,
            } => {
                let r = greeted(sh.ctx(), stream, &hello);
                take_source(&sh, peer, r, &live)
            }
            Greeted::Refused { peer, why } => refused(sh.ctx(), peer, why),
        }
    };
    let missing = {
        let sh = sh.clone();
        move || sh.ctx().stats.links.iter().any(|l| !l.state().ended())
    };
    let on_end = {
        let (sh, accepting2) = (sh.clone(), accepting.clone());
        move |end: tessera_net::io::AcceptEnd| {
            if end != tessera_net::io::AcceptEnd::Stopped {
                return;
            }
            // Every hello of a source that connected (or was dialled) before the stop has been
            // read: the links still waiting will not connect. Closing them may wait for room
            // downstream: not on the acceptor's thread.
            let guard = accepting2.enter();
            spawn(format!("ru{id}-accept-end"), move || {
                close_never_connected(&*sh);
                drop(guard);
            });
        }
    };
    tessera_net::acceptor::Acceptor::stage(tessera_net::reactor::Stage::Readout).add(
        tessera_net::acceptor::Accepting {
            name: format!("ru{id}"),
            listener,
            stop: c.stop.clone(),
            missing: Box::new(missing),
            hello_len: HELLO_SIZE,
            hello_patience: tessera_net::acceptor::HELLO_PATIENCE,
            on_hello: Box::new(on_hello),
            on_end: Box::new(on_end),
            dialled,
            none_waiting: Some(c.none_waiting.clone()),
            dial_hellos: Some(dial_hellos),
        },
        &accepting,
    );
}

/// A source's connection (accepted, or dialled to a source that listens) once its hello is
/// checked: the link handed to the pollers, or the connection refused.
fn take_source<S: LinkSink>(
    sh: &Arc<S>,
    peer: std::net::SocketAddr,
    said: Result<(usize, TcpStream), String>,
    live: &Arc<tessera_net::reactor::Tally>,
) {
    let c = sh.ctx();
    match said {
        Ok((slot, stream)) => match polled::PolledLink::new(sh.clone(), slot, stream, live) {
            Ok(conn) => tessera_net::reactor::Reactor::stage(tessera_net::reactor::Stage::Readout)
                .register(Box::new(conn)),
            Err(e) => {
                tracing::warn!(readout_unit = c.id, source = c.sources[slot], error = %e, "link could not be served");
                c.stats.links[slot].set_state(LinkState::Disconnected);
                // Closing may wait for room downstream: not on the acceptor's thread, and
                // counted among the links until done.
                let (sh, guard) = (sh.clone(), live.enter());
                spawn(format!("ru{}-close", c.id), move || {
                    sh.close_link(slot);
                    drop(guard);
                });
            }
        },
        Err(why) => refused(c, peer, why),
    }
}

pub(crate) fn refused(c: &LinkCtx, peer: std::net::SocketAddr, why: String) {
    tracing::warn!(readout_unit = c.id, %peer, %why, "refused a connection");
    c.stats.refused_connections.fetch_add(1, Ordering::Relaxed);
    *c.stats.last_refusal.lock() = Some(format!("{peer}: {why}"));
}

/// Sources still missing after the stop (and an empty backlog) will not come.
pub(crate) fn close_never_connected(sh: &impl LinkSink) {
    for (slot, l) in sh.ctx().stats.links.iter().enumerate() {
        if l.state() == LinkState::Waiting {
            l.set_state(LinkState::NeverConnected);
            sh.close_link(slot);
        }
    }
}

/// Checks the hello the acceptor read (of an accepted or a dialled source); returns the link slot
/// for the source.
fn greeted(sh: &LinkCtx, stream: TcpStream, hello: &[u8]) -> Result<(usize, TcpStream), String> {
    let h: &[u8; HELLO_SIZE] = hello
        .try_into()
        .map_err(|_| format!("a hello of {} bytes, not {HELLO_SIZE}", hello.len()))?;
    tessera_net::io::tune(&stream, None).map_err(|e| e.to_string())?;
    source_slot(sh, h).map(|slot| (slot, stream))
}

/// The link slot of the source whose hello this is, claimed.
pub(crate) fn source_slot(sh: &LinkCtx, h: &[u8; HELLO_SIZE]) -> Result<usize, String> {
    let hello = Hello::decode(h).map_err(|e| e.to_string())?;
    let slot = sh
        .sources
        .iter()
        .position(|&s| s == hello.source_id)
        .ok_or_else(|| {
            format!(
                "source {} is not one of this unit's sources {:?}",
                hello.source_id, sh.sources
            )
        })?;
    let link = &sh.stats.links[slot];
    if !link.claim() {
        return Err(format!(
            "source {} is already connected or finished",
            hello.source_id
        ));
    }
    Ok(slot)
}

/// What [`parse`] found at the end of the window.
struct Parsed {
    /// Bytes the window must hold for the message under way (0: between messages).
    want: usize,
    /// The source's end-of-stream came.
    ended: bool,
}

/// Decodes every whole message the window holds: good fragments into `good` (as slices of the
/// read chunk), rejections counted (and dumped) by reason, the end of stream noted.
fn parse(
    sh: &LinkCtx,
    slot: usize,
    dec: &mut StreamDecoder,
    reader: &mut ChunkReader,
    good: &mut Vec<(u64, ChunkSlice)>,
) -> Parsed {
    let link = &sh.stats.links[slot];
    let source = sh.sources[slot];
    loop {
        let w = reader.window();
        let step = dec.next(w);
        match step.item {
            Decoded::Fragment(h) => {
                link.last_event.store(h.event_id, Ordering::Relaxed);
                good.push((h.event_id, reader.take(step.consumed)));
            }
            Decoded::Rejected { reason, evidence } => {
                let ev = &w[..evidence.min(w.len())];
                if let Some(q) = &sh.quarantine {
                    q.dump(source, reason.label(), ev);
                }
                link.reject(Rejection::Wire(reason));
                reader.skip(step.consumed);
            }
            Decoded::Skipped => {
                link.skipped_bytes
                    .fetch_add(step.consumed as u64, Ordering::Relaxed);
                reader.skip(step.consumed);
            }
            Decoded::End(end) => {
                link.eos_fragments
                    .store(end.fragments_sent, Ordering::Relaxed);
                // Everything before the end of stream has been read: what arrived is counted,
                // or waits in `good` to be. More declared than arrived is fragments lost before
                // this unit, which the balance cannot place (fewer is junk, counted as rejected
                // beyond what was sent).
                let arrived = link.received() + good.len() as u64;
                if end.fragments_sent > arrived {
                    tracing::error!(
                        readout_unit = sh.id,
                        source,
                        declared = end.fragments_sent,
                        arrived,
                        "the source's end of stream declares more fragments than arrived: the balance cannot hold"
                    );
                }
                reader.skip(step.consumed);
                return Parsed {
                    want: 0,
                    ended: true,
                };
            }
            Decoded::NeedMore(n) => {
                return Parsed {
                    want: n,
                    ended: false,
                }
            }
            Decoded::Idle => {
                return Parsed {
                    want: 0,
                    ended: false,
                }
            }
            Decoded::Hello(_) | Decoded::BadHello(_) => {
                unreachable!("hello was read by the handshake")
            }
        }
    }
}

/// Bytes after the end of stream are a protocol error: those already read with it and what
/// arrives in a short look after are counted (as bytes: they may be anything, so they are no
/// fragment of the balance) and logged, rather than silently dropped.
fn count_after_end(sh: &LinkCtx, slot: usize, after: u64) {
    if after > 0 {
        sh.stats.links[slot]
            .bytes_after_end
            .fetch_add(after, Ordering::Relaxed);
        tracing::warn!(
            readout_unit = sh.id,
            source = sh.sources[slot],
            bytes = after,
            "data after the end of stream"
        );
    }
}

/// How long after its end of stream a link is still read, to count bytes that should not come.
const LOOK_AFTER_END: Duration = Duration::from_millis(200);

/// Reads one link on its own thread, blocking (request mode).
pub(crate) fn read_link<S: LinkSink>(sink: &S, slot: usize, mut stream: TcpStream) {
    let sh = sink.ctx();
    let link = &sh.stats.links[slot];
    let source = sh.sources[slot];
    let mut dec = StreamDecoder::after_hello(sh.max_payload, source);
    let chunk = sh.read_chunk.max(dec.max_message() * 2);
    let mut reader = ChunkReader::new(link.budget.clone(), chunk);
    let mut want;
    let mut good: Vec<(u64, ChunkSlice)> = Vec::new();
    let mut ended;
    let mut eof = false;
    let mut silent = false;
    // An empty read proves the link silent from its start for as long as it waited, never up
    // to whenever this thread next ran: a thread stalled after the read proves nothing more.
    let waits = stream
        .read_timeout()
        .ok()
        .flatten()
        .map_or(0, |t| t.as_nanos() as u64);
    loop {
        Parsed { want, ended } = parse(sh, slot, &mut dec, &mut reader, &mut good);
        if !good.is_empty() {
            offer_until_taken(sink, slot, &mut good, &link.budget);
        }
        if ended || eof {
            break;
        }
        sink.before_read(slot);
        if sh.abort.load(Ordering::Relaxed) {
            link.set_state(LinkState::Aborted);
            break;
        }
        match reader.fill(&mut stream, want, &sh.abort) {
            Ok(Fill::Data(0)) => {
                // The kernel's word that nothing came since the read began: silence. A wait
                // for memory before the read is not silence, so it is not counted.
                if let Some(t) = reader.read_started {
                    let since = sh.clock.ns_at(t);
                    sink.quiet(slot, since, sh.now_ns().min(since.saturating_add(waits)));
                    silent = true;
                }
            }
            Ok(Fill::Data(_)) => {
                if silent {
                    sink.heard(slot);
                    silent = false;
                }
            }
            Ok(Fill::Eof) => {
                dec.finish();
                eof = true;
            }
            Ok(Fill::Stopped | Fill::NoMemory) => {
                link.set_state(LinkState::Aborted);
                break;
            }
            Err(e) => {
                tracing::warn!(readout_unit = sh.id, source, error = %e, "link read failed");
                dec.finish();
                eof = true;
            }
        }
    }
    if ended {
        link.set_state(LinkState::Ended);
        let mut after = reader.window().len() as u64;
        let _ = stream.set_read_timeout(Some(LOOK_AFTER_END));
        let mut tail = [0u8; 4096];
        while let Ok(n) = std::io::Read::read(&mut stream, &mut tail) {
            if n == 0 || after > 1 << 20 {
                break;
            }
            after += n as u64;
        }
        count_after_end(sh, slot, after);
    } else if link.state() != LinkState::Aborted {
        link.set_state(LinkState::Disconnected);
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
    sink.close_link(slot);
}

/// Offers until the sink has taken everything: when the table of open events is full the link
/// waits (back-pressure, counted as busy time like a wait for memory) until events leave.
pub(crate) fn offer_until_taken<S: LinkSink>(
    sink: &S,
    slot: usize,
    good: &mut Vec<(u64, ChunkSlice)>,
    budget: &tessera_net::Budget,
) {
    sink.offer(slot, good);
    if good.is_empty() {
        return;
    }
    let t = Instant::now();
    while !good.is_empty() && !sink.ctx().abort.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(1));
        sink.offer(slot, good);
    }
    budget
        .busy_ns
        .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
}

/// Offers a read's worth of good fragments under one lock, then dispatches what became ready.
/// Fragments that would open an event past the cap stay in `good`, in order.
fn offer(sh: &Shared, slot: usize, good: &mut Vec<(u64, ChunkSlice)>) {
    let link = &sh.stats.links[slot];
    let now = sh.now_ns();
    let mut ready = Vec::new();
    let mut rejected = Vec::new();
    let mut n = 0u64;
    let mut left = Vec::new();
    let ticket;
    // At most one event leaves per fragment offered: sized once, not grown by doubling.
    let most = good.len();
    {
        let mut a = sh.assembler.lock();
        sh.emptied.take(&mut a, most);
        let mut items = good.drain(..);
        for (ev, frag) in items.by_ref() {
            n += 1;
            let o = a.offer(slot, ev, frag, now);
            // Events this link moved past (it skipped them) leave at once, before the offer's
            // own, whose ID is higher: waiting out the event timeout for them held their other
            // fragments' read chunks, and with two chunks a link the unit stood still for each
            // skip (16 KiB x 8, 2 MiB units: 2 s without an event built at every skipped one).
            if a.has_passed() {
                ready.extend(a.take_passed());
            }
            match o {
                Offer::Held => {}
                Offer::Ready(e) => {
                    if ready.capacity() == 0 {
                        ready.reserve_exact(most);
                    }
                    ready.push(e)
                }
                Offer::Duplicate(f) => rejected.push((Rejection::Duplicate, f)),
                Offer::Late(f) => rejected.push((Rejection::Late, f)),
                // A link offers only until it closes itself, so this cannot happen; counted
                // rather than trusted.
                Offer::Closed(f) => rejected.push((Rejection::Late, f)),
                Offer::Full(f) => {
                    n -= 1;
                    left.push((ev, f));
                    break;
                }
            }
        }
        left.extend(items);
        sh.publish_held(&a);
        ticket = sh.leaving(&a, &ready);
    }
    // Kept in `good` itself (drained, so empty, its capacity kept for the link's next read:
    // replacing it would make every read grow a new vector from nothing).
    good.append(&mut left);
    link.fragments.fetch_add(n, Ordering::Relaxed);
    for (why, f) in rejected {
        if let Some(q) = &sh.quarantine {
            q.dump(sh.sources[slot], why.label(), &f);
        }
        link.reject(why);
    }
    sh.dispatch(ready, ticket);
}

/// Super-fragment lists the builder links wrote and emptied, on their way back to the
/// assembler to be the part lists of events opened later. Without them each event's list was
/// allocated by a reading poller and freed by a sending one: a malloc and a free from another
/// thread per event and unit, most of the allocator's instructions at 1 KiB x 8 (callgrind).
/// They come and go in handfuls under one lock (a queue with an atomic operation per list cost
/// a third of what the allocator did). Bounded as the assembler's own spare lists are; lists
/// beyond are freed.
struct Emptied {
    lists: Mutex<Vec<Vec<ChunkSlice>>>,
    most: usize,
    /// Lists each builder link gathers before it hands them back together: all the links'
    /// handfuls together hold no more than `most` either.
    handful: usize,
}

/// The most emptied lists a builder link gathers before it hands them back together.
const EMPTIED_HANDFUL: usize = 32;

impl Emptied {
    fn new(most: usize, builder_links: usize) -> Emptied {
        Emptied {
            lists: Mutex::new(Vec::new()),
            most,
            handful: (most / builder_links.max(1)).clamp(1, EMPTIED_HANDFUL),
        }
    }

    /// Takes the lists of `handful` (each empty), as many as there is room for.
    fn give(&self, handful: &mut Vec<Vec<ChunkSlice>>) {
        let mut lists = self.lists.lock();
        let room = self.most.saturating_sub(lists.len());
        lists.extend(handful.drain(..).take(room));
    }

    /// Hands the assembler `a` (locked) emptied lists for up to `opening` events about to open.
    fn take(&self, a: &mut Assembler<ChunkSlice>, opening: usize) {
        let want = a.spare_room().min(opening);
        if want == 0 {
            return;
        }
        let mut lists = self.lists.lock();
        let from = lists.len().saturating_sub(want);
        for list in lists.drain(from..) {
            a.recycle(part_list(list));
        }
    }
}

// A part list and a super-fragment list are one allocation passed between the assembler and a
// builder link: `Option<ChunkSlice>` is a `ChunkSlice` in size and alignment (the `Arc` in it is
// never null), so `capacity` items of either are one layout. Checked when compiling.
const _: () = assert!(
    std::mem::size_of::<Option<ChunkSlice>>() == std::mem::size_of::<ChunkSlice>()
        && std::mem::align_of::<Option<ChunkSlice>>() == std::mem::align_of::<ChunkSlice>()
);

/// An event's part list as its super-fragment's list, the parts that never came left out, in
/// the same allocation and order. `std`'s in-place collect of a `filter_map` did the same for
/// about a hundred instructions a list (callgrind); this is a loop over the parts.
fn fragments_of(parts: Vec<Option<ChunkSlice>>) -> Vec<ChunkSlice> {
    let mut parts = std::mem::ManuallyDrop::new(parts);
    let (base, len, capacity) = (parts.as_mut_ptr(), parts.len(), parts.capacity());
    let out = base.cast::<ChunkSlice>();
    let mut n = 0;
    for i in 0..len {
        // SAFETY: slot `i < len` holds an item, moved out here and never read again. The write
        // goes to slot `n <= i`, whose item has been moved out already (or is this one, just
        // read), and a `ChunkSlice` fits an `Option<ChunkSlice>` slot (the layout check above).
        // Nothing in the loop can unwind half-way.
        if let Some(f) = unsafe { base.add(i).read() } {
            unsafe { out.add(n).write(f) };
            n += 1;
        }
    }
    // SAFETY: the first `n` slots hold `ChunkSlice`s; the allocation is the part list's, made
    // for `capacity` items of the same layout; the part list itself is never dropped
    // (`ManuallyDrop`), so the allocation has one owner.
    unsafe { Vec::from_raw_parts(out, n, capacity) }
}

/// An emptied super-fragment list as an assembler's part list, in the same allocation.
fn part_list(mut list: Vec<ChunkSlice>) -> Vec<Option<ChunkSlice>> {
    list.clear();
    let mut list = std::mem::ManuallyDrop::new(list);
    // SAFETY: the allocation was made for `capacity` items of `ChunkSlice`, whose size and
    // alignment `Option<ChunkSlice>` shares (the layout check above), so it is the same layout
    // for as many of those; the vector is empty, so no item is read as the other type; and the
    // original vector is not dropped (`ManuallyDrop`), so the allocation has one owner.
    unsafe {
        Vec::from_raw_parts(
            list.as_mut_ptr().cast::<Option<ChunkSlice>>(),
            0,
            list.capacity(),
        )
    }
}

/// One sweep of the unit's open events (timeouts, silence of links that never connected), run
/// by the readout stage's sweeper; false once every link has closed. The sweeper then drops its
/// `Arc<Shared>`, which with the last readers drops the builder senders: the sending links then
/// finish their queues and close.
fn sweep(sh: &Shared) -> bool {
    let (ready, all_closed, ticket) = {
        let mut a = sh.assembler.lock();
        let now = sh.now_ns();
        // A source that has not connected is listened for and says nothing: silence.
        for (slot, l) in sh.stats.links.iter().enumerate() {
            if l.state() == LinkState::Waiting {
                a.quiet(slot, 0, sh.never_connected_until_ns());
            }
        }
        let r = a.sweep(now);
        sh.publish_held(&a);
        let ticket = sh.leaving(&a, &r.0);
        (r.0, r.1, ticket)
    };
    sh.dispatch(ready, ticket);
    !all_closed
}

/// How often a readout unit tells each builder where it is (docs/wire-format.md, 2.3).
pub const PROGRESS_INTERVAL: Duration = Duration::from_millis(100);

/// Departed events a push-mode unit's assembler remembers, to tell a late fragment from a
/// duplicate.
const DEPARTED_MEMORY: usize = 1 << 16;

/// The most heap memory a readout unit of `links` links holds for its bookkeeping beside its
/// buffer and read chunks: in push mode its assembler's, capped at `max_open` open events
/// ([`Assembler::bytes_at_most`]); in request mode its memories of the event IDs it announced
/// and cleared. What `tessera check` and a node agent count for it.
pub fn bookkeeping_bytes(links: usize, max_open: usize, request_mode: bool) -> u64 {
    if request_mode {
        2 * tessera_assembly::RecentSet::bytes(serve::MEMORY)
    } else {
        Assembler::<ChunkSlice>::bytes_at_most(links, max_open, DEPARTED_MEMORY)
    }
}

/// The link to one builder (one rail), served by the pollers of the sending stage.
#[allow(clippy::too_many_arguments)]
fn sender_to_builder(
    id: u32,
    builder: u32,
    b: String,
    stream: TcpStream,
    rx: Receiver<Vec<SuperFragment>>,
    bell: tessera_net::reactor::Doorbell,
    st: Arc<ReadoutStats>,
    unit: std::sync::Weak<Shared>,
    emptied: Arc<Emptied>,
    live: &Arc<tessera_net::reactor::Tally>,
) -> std::io::Result<impl tessera_net::reactor::Conn> {
    let hello = PeerHello {
        role: PeerRole::ReadoutUnit,
        id,
        flags: 0,
    };
    let st2 = st.clone();
    let st3 = st.clone();
    // The highest floor promised in the queue and written: the heartbeat never says less, so
    // floors never decrease on the link (wire-format §2.3).
    let promised = Arc::new(AtomicU64::new(0));
    let promised2 = promised.clone();
    let on_batch = move |o: tessera_net::sender::BatchOutcome, units: &[SuperFragment]| {
        let st = &st2;
        if o.written && o.units < units.len() as u64 {
            for u in units {
                if u.promise {
                    promised2.fetch_max(u.event_id, Ordering::Relaxed);
                }
            }
        }
        if o.written {
            st.super_fragments.fetch_add(o.units, Ordering::Relaxed);
            st.fragments_forwarded
                .fetch_add(o.fragments, Ordering::Relaxed);
            if o.fragments > 0 {
                *st.fragments_forwarded_by_builder
                    .lock()
                    .entry(builder)
                    .or_default() += o.fragments;
            }
            st.bytes_forwarded.fetch_add(o.bytes, Ordering::Relaxed);
        } else {
            st.builder_lost.fetch_add(o.fragments, Ordering::Relaxed);
        }
        st.queued_fragments
            .fetch_sub(o.fragments, Ordering::Relaxed);
    };
    let on_error = move |e: &std::io::Error| {
        tracing::error!(readout_unit = id, link = b, error = %e, "builder link failed; its events are dropped and counted");
        *st.builder_error.lock() = Some(format!("{b}: {e}"));
    };
    // The progress message is also the unit's heartbeat, so it goes out every interval even
    // when a new floor cannot be computed (an event between the assembler and a queue, or
    // events still queued for this builder): then the last floor is said again, which stays
    // true (everything below it had been sent when it was first said).
    let mut last_floor = 0u64;
    let progress = move |rx: &Receiver<Vec<SuperFragment>>| {
        let sh = unit.upgrade()?;
        let floor = {
            let a = sh.assembler.lock();
            (sh.in_dispatch.load(Ordering::Acquire) == 0).then(|| sh.floor_to_say(&a))
        };
        if let Some(f) = floor {
            if rx.is_empty() {
                last_floor = last_floor.max(f.unwrap_or(0));
            }
        }
        last_floor = last_floor.max(promised.load(Ordering::Relaxed));
        let p = tessera_format::link::Progress {
            readout_unit: id,
            floor: last_floor,
        };
        Some(p.encode().to_vec())
    };
    let gauges = st3.clone();
    tessera_net::sender::PolledSender::new(
        stream,
        rx,
        bell,
        hello,
        on_batch,
        on_error,
        Some(tessera_net::sender::OwnedBeat {
            every: PROGRESS_INTERVAL,
            message: Box::new(progress),
        }),
        true,
        live,
    )
    .map(|s| {
        s.with_queue_gauge(&gauges.send_queues).with_retire({
            let mut handful = Vec::with_capacity(emptied.handful);
            move |u: SuperFragment| {
                let mut list = u.fragments;
                if list.capacity() > 0 {
                    // Its slices let go of their chunks here, as the unit's drop did.
                    list.clear();
                    handful.push(list);
                    if handful.len() >= emptied.handful {
                        emptied.give(&mut handful);
                    }
                }
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn emptied_list(links: usize) -> Vec<ChunkSlice> {
        let mut v: Vec<ChunkSlice> = (0..links).map(|_| ChunkSlice::copy_from(b"x")).collect();
        v.clear();
        v
    }

    /// A part list becomes its super-fragment's list in its own allocation: the parts that
    /// came, in order, each once (every chunk's last slice gone with the lists).
    #[test]
    fn a_super_fragment_list_is_the_parts_that_came_in_order() {
        for pattern in [
            vec![true, true, true, true],
            vec![false, true, false, true],
            vec![true, false, false, false],
            vec![false, false, false],
            vec![],
        ] {
            let chunks: Vec<ChunkSlice> = (0..pattern.len())
                .map(|i| ChunkSlice::copy_from(&[i as u8; 3]))
                .collect();
            let mut parts: Vec<Option<ChunkSlice>> = Vec::with_capacity(pattern.len() + 2);
            for (c, &came) in chunks.iter().zip(&pattern) {
                parts.push(came.then(|| c.clone()));
            }
            let (ptr, cap) = (parts.as_ptr() as usize, parts.capacity());
            let list = fragments_of(parts);
            assert_eq!(list.capacity(), cap);
            assert_eq!(list.as_ptr() as usize, ptr);
            let got: Vec<u8> = list.iter().map(|f| f[0]).collect();
            let want: Vec<u8> = (0..pattern.len() as u8)
                .filter(|&i| pattern[i as usize])
                .collect();
            assert_eq!(got, want, "{pattern:?}");
            // Each slice moved, not copied or lost: the list and `chunks` hold one each.
            for (i, c) in chunks.iter().enumerate() {
                assert_eq!(c.holders(), if pattern[i] { 2 } else { 1 }, "{pattern:?}");
            }
            drop(list);
            assert!(chunks.iter().all(|c| c.holders() == 1));
        }
    }

    /// An emptied super-fragment list becomes a part list in its own allocation, empty.
    #[test]
    fn a_part_list_keeps_the_super_fragment_list_allocation() {
        let list = emptied_list(8);
        let (ptr, cap) = (list.as_ptr() as usize, list.capacity());
        let parts = part_list(list);
        assert!(parts.is_empty());
        assert_eq!(parts.capacity(), cap);
        assert_eq!(parts.as_ptr() as usize, ptr);
    }

    /// Lists come back to the assembler for the events about to open, no more than it keeps,
    /// and the lists waiting between the links and the assembler are bounded: those beyond
    /// are freed.
    #[test]
    fn emptied_lists_are_bounded_and_go_back_to_the_assembler() {
        let links = 4;
        let mut a: Assembler<ChunkSlice> = Assembler::new(links, 1_000_000, 1 << 16);
        let room = a.spare_room();
        assert!(room > 0);
        let e = Emptied::new(room, 2);
        assert_eq!(e.handful, (room / 2).min(EMPTIED_HANDFUL));
        // However many builder links there are, their handfuls hold no more than the bound.
        for links in [1, 3, 64, 10_000] {
            let h = Emptied::new(room, links).handful;
            assert!((1..=EMPTIED_HANDFUL).contains(&h), "{links}");
            assert!(h * links <= room.max(links), "{links}");
        }
        let mut handful: Vec<_> = (0..room + 5).map(|_| emptied_list(links)).collect();
        e.give(&mut handful);
        assert!(handful.is_empty());
        assert_eq!(
            e.lists.lock().len(),
            room,
            "beyond the bound, lists are freed"
        );
        // Three events about to open take three lists.
        e.take(&mut a, 3);
        assert_eq!(a.spare_room(), room - 3);
        assert_eq!(e.lists.lock().len(), room - 3);
        // Never more than the assembler keeps.
        e.take(&mut a, usize::MAX);
        assert_eq!(a.spare_room(), 0);
        assert!(e.lists.lock().is_empty());
        // A full assembler takes none.
        let mut more = vec![emptied_list(links)];
        e.give(&mut more);
        e.take(&mut a, 10);
        assert_eq!(e.lists.lock().len(), 1);
    }
}

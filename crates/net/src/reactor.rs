//! The event-driven I/O core: a few threads (one per core by default) each own many inbound data
//! connections through `epoll` (via `mio`), instead of a thread per connection.
//!
//! Why: with a thread per link, a trigger at 1 kHz over 105 links woke 105 threads per event
//! (a context switch and a scheduler pass each); the kernel's wake-ups were the largest cost of a
//! DAQ idling at a low rate, and 16 readout units x 60 builders ran two thousand threads that
//! waited seconds for a core. One poller wakes once for all the links that became readable and
//! reads them in turn, and the thread count follows the cores, not the connections.
//!
//! A connection is a [`Conn`]: a state machine that reads what it can without blocking and says
//! what it waits for next ([`Next`]). It must never block: a link that has no memory left, or
//! whose fragments the assembler cannot take yet, asks to be called again a little later
//! ([`Next::At`]) and reads nothing meanwhile, so TCP holds its sender (back-pressure), exactly
//! as a blocked reader thread did, without holding the poller's other links.

use crossbeam_channel::{unbounded, Receiver, Sender};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// What a connection waits for after a turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// The socket was read dry: call again when it is readable, or at this time anyway (to see
    /// silence, a stop or an abort).
    Readable(Instant),
    /// More may be waiting: call again once the poller's other ready links had their turn.
    Again,
    /// Blocked (no memory, or a full table of open events): call again at this time, whether or
    /// not the socket became readable.
    At(Instant),
    /// The socket is full (a sender's peer is behind): call again when it has room, or at this
    /// time anyway. Like [`Next::At`], the round is held back by the next stage, not idle, so the
    /// poller does not moderate it.
    Writable(Instant),
    /// Finished: the poller deregisters and drops the connection.
    Done,
}

/// One connection served by the poller.
pub trait Conn: Send + 'static {
    /// The socket's descriptor (non-blocking; it lives as long as the connection).
    fn fd(&self) -> RawFd;
    /// Reads and handles what it can without blocking.
    fn turn(&mut self) -> Next;
    /// Bytes read or written so far (tells the poller whether its rounds are light: see
    /// [`MODERATION_US`]). A sender counts what it writes: a poller of senders at full rate reads
    /// nothing, and must not be moderated as if it were idle.
    fn bytes_moved(&self) -> u64;
    /// What readiness calls it (a sender also waits for room to write).
    fn interest(&self) -> Interest {
        Interest::READABLE
    }
    /// A doorbell other threads ring when they have given it work (a sender's queue).
    fn doorbell(&self) -> Option<&Doorbell> {
        None
    }
}

/// Rung by the threads that give a connection work: the connection gets a turn soon after,
/// even if its socket says nothing. Ringing a bell already rung costs one atomic operation (no
/// system call): a busy connection is woken at most once per turn.
#[derive(Clone, Debug, Default)]
pub struct Doorbell(Arc<Bell>);

#[derive(Debug, Default)]
struct Bell {
    rung: std::sync::atomic::AtomicBool,
    /// Where it rings: the poller's waker and queue, and the connection's slot there.
    at: OnceLock<(Arc<Waker>, Rung, usize)>,
}

impl Doorbell {
    /// Work was given: the connection gets a turn.
    pub fn ring(&self) {
        if !self.0.rung.swap(true, Ordering::SeqCst) {
            if let Some((waker, rung, slot)) = self.0.at.get() {
                rung.lock().push(*slot);
                let _ = waker.wake();
            }
        }
    }

    /// Whether both are the one bell of one connection.
    pub fn same(&self, other: &Doorbell) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Called by the connection at the start of its turn, before it looks for work: a ring
    /// after this gives it another turn.
    pub fn answer(&self) {
        self.0.rung.store(false, Ordering::SeqCst);
    }
}

/// Counts the connections a role handed to the pollers, so the role can wait for the last one
/// to finish (its links closed and accounted) as it would join reader threads.
#[derive(Debug, Default)]
pub struct Tally {
    live: parking_lot::Mutex<usize>,
    zero: parking_lot::Condvar,
}

/// Held by a connection while it lives.
#[derive(Debug)]
pub struct TallyGuard(Arc<Tally>);

impl Tally {
    pub fn enter(self: &Arc<Self>) -> TallyGuard {
        *self.live.lock() += 1;
        TallyGuard(self.clone())
    }

    pub fn is_zero(&self) -> bool {
        *self.live.lock() == 0
    }

    /// Returns once every connection entered so far has been dropped.
    pub fn wait_zero(&self) {
        let mut n = self.live.lock();
        while *n > 0 {
            self.zero.wait(&mut n);
        }
    }
}

impl Drop for TallyGuard {
    fn drop(&mut self) {
        let mut n = self.0.live.lock();
        *n -= 1;
        if *n == 0 {
            self.0.zero.notify_all();
        }
    }
}

/// The time a polled link spends held (no memory, or fragments the next stage cannot take yet),
/// counted into a busy-time counter as it passes: a long hold shows while it lasts (status
/// line, dashboard, /metrics), not only when it ends, as a blocked reader thread's wait did.
#[derive(Debug, Default)]
pub struct Held(Option<Instant>);

impl Held {
    /// Counts the time since the last call into `busy`; `still`: the link is held from `now`.
    pub fn count(&mut self, busy: &std::sync::atomic::AtomicU64, now: Instant, still: bool) {
        if let Some(t) = self.0 {
            busy.fetch_add(
                now.saturating_duration_since(t).as_nanos() as u64,
                Ordering::Relaxed,
            );
        }
        self.0 = still.then_some(now);
    }
}

/// How long a polled link must be found empty to be proven silent (as the blocking readers'
/// socket timeout did).
pub const SILENCE_PROOF: Duration = Duration::from_millis(100);

/// Reads a polled link makes per turn before the poller's other ready links get theirs.
pub const READS_PER_TURN: usize = 8;

/// How soon a link held by a full table of open events looks again.
pub const HELD_RETRY: Duration = Duration::from_millis(1);

/// How soon a link held for memory looks again if its bell has not rung (it rings as soon as
/// memory is given back): the time to notice an abort, not a poll for memory.
pub const MEMORY_RECHECK: Duration = Duration::from_millis(20);

/// What a polled link's reads prove about its peer's silence. Only reads prove it: a link not
/// read (held for memory) proves nothing.
#[derive(Debug, Default)]
pub struct Silence {
    /// Since when the socket has been found empty with nothing read after.
    dry_since: Option<Instant>,
    silent: bool,
}

impl Silence {
    /// A read found nothing (it began at `read_started`). `Some(since)` when the link is now
    /// proven silent from `since`: the caller reports it (again, extended, on later calls).
    pub fn empty_read(&mut self, read_started: Option<Instant>, now: Instant) -> Option<Instant> {
        let since = *self.dry_since.get_or_insert(read_started.unwrap_or(now));
        (now.saturating_duration_since(since) >= SILENCE_PROOF).then(|| {
            self.silent = true;
            since
        })
    }

    /// A read brought bytes (`drained`: and left the socket empty). True when the link had
    /// been reported silent: the caller reports it heard.
    pub fn data(&mut self, drained: bool) -> bool {
        self.dry_since = drained.then(Instant::now);
        std::mem::take(&mut self.silent)
    }

    /// The link was not read: what was proven so far proves nothing from here.
    pub fn not_read(&mut self) {
        self.dry_since = None;
    }
}

const WAKE: Token = Token(usize::MAX);

struct Entry {
    conn: Box<dyn Conn>,
    /// When the connection must be called even if nothing happens.
    deadline: Option<Instant>,
    /// Whether the time heap holds an entry for this slot that has not passed yet (at most
    /// one is kept per connection, so the heap stays as small as the set of connections).
    queued: Option<Instant>,
    /// Waiting for `deadline` only (blocked): readiness events are left for then.
    blocked: bool,
    in_again: bool,
}

struct Worker {
    tx: Sender<Box<dyn Conn>>,
    waker: Arc<Waker>,
    load: Arc<AtomicUsize>,
}

/// Slots whose doorbell rang since the poller last looked.
type Rung = Arc<parking_lot::Mutex<Vec<usize>>>;

/// The stages of the data path that have pollers, upstream first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Readout units reading their sources.
    Readout = 0,
    /// Builders reading their readout units.
    Builder = 1,
    /// Senders of every stage (readout unit to builder): they never block, so one set serves
    /// all stages' links downstream.
    Send = 2,
}

impl Stage {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Stage::Readout => "ru",
            Stage::Builder => "bu",
            Stage::Send => "send",
        }
    }
}

/// A fixed set of poller threads that inbound connections are spread over.
pub struct Reactor {
    workers: Vec<Worker>,
}

impl Reactor {
    /// Starts `threads` pollers (at least one). They live as long as the process: a node agent
    /// runs run after run on the same pollers.
    pub fn new(threads: usize, name: &str) -> std::io::Result<Reactor> {
        let mut workers = Vec::new();
        for i in 0..threads.max(1) {
            let poll = Poll::new()?;
            let waker = Arc::new(Waker::new(poll.registry(), WAKE)?);
            let (tx, rx) = unbounded::<Box<dyn Conn>>();
            let load = Arc::new(AtomicUsize::new(0));
            let l = load.clone();
            let w = waker.clone();
            std::thread::Builder::new()
                .name(format!("{name}-io{i}"))
                .spawn(move || run(poll, rx, l, w))?;
            workers.push(Worker { tx, waker, load });
        }
        Ok(Reactor { workers })
    }

    /// The process's pollers for one stage of the data path: `TESSERA_IO_THREADS` each, or one
    /// per core.
    ///
    /// One set per stage, because a stage may block its poller on the next stage (a readout
    /// unit's full queue to a builder, a builder's full queue to the recorder): that wait must
    /// never be on a poller the next stage needs, or a readout unit waiting for its builder
    /// queue would hold the very poller that reads the builder's link. Waits only ever point
    /// downstream, so pollers per stage cannot wait on themselves.
    pub fn stage(stage: Stage) -> &'static Reactor {
        static R: [OnceLock<Reactor>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
        R[stage as usize].get_or_init(|| {
            let n = std::env::var("TESSERA_IO_THREADS")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .filter(|&n| n > 0)
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
            Reactor::new(n, stage.name()).expect("start the I/O pollers")
        })
    }

    pub fn threads(&self) -> usize {
        self.workers.len()
    }

    /// Hands a connection to the least loaded poller; it is called at once.
    pub fn register(&self, conn: Box<dyn Conn>) {
        let w = self
            .workers
            .iter()
            .min_by_key(|w| w.load.load(Ordering::Relaxed))
            .expect("at least one poller");
        w.load.fetch_add(1, Ordering::Relaxed);
        // The poller outlives every sender (it never ends), so the send cannot fail.
        let _ = w.tx.send(conn);
        let _ = w.waker.wake();
    }
}

/// The shortest time between the starts of two rounds that handle readiness after a light
/// round (little moved a turn, nothing held back): like a network card's interrupt moderation,
/// at low rates a poller lets several messages gather on each link and reads them in one call
/// (one read and one ACK for many small fragments instead of one each: at 1 kHz over 105 links
/// 2 ms halved the readers' CPU, 5 ms took the DAQ's CPU per fragment a further fifth down,
/// and 20 and 50 ms took it 29 % and 45 % below 5 ms: docs/PERFORMANCE.md), while a poller whose
/// turns move data at full rate, or are held back by the next stage, never waits. Costs at most
/// this much latency per hop, at low rates only. `run.io_moderation_us` (set by each run for
/// the whole process, since the pollers serve every run of a node agent); zero turns it off.
static MODERATION_US: AtomicU64 = AtomicU64::new(DEFAULT_MODERATION_US);

/// The default of `run.io_moderation_us`.
pub const DEFAULT_MODERATION_US: u64 = 5000;

/// Sets the pollers' moderation (see [`MODERATION_US`]); every poller of the process follows
/// from its next round.
pub fn set_moderation(d: Duration) {
    MODERATION_US.store(d.as_micros() as u64, Ordering::Relaxed);
}

fn moderation() -> Duration {
    Duration::from_micros(MODERATION_US.load(Ordering::Relaxed))
}

/// A round whose turns moved less than this on average (and were not held back) is light.
const LIGHT_TURN_BYTES: u64 = 16 << 10;

/// What the turns since the last round began read.
#[derive(Default)]
struct Round {
    turns: u64,
    bytes: u64,
    /// A turn ended blocked by the stage downstream ([`Next::At`], [`Next::Writable`]).
    held: bool,
}

impl Round {
    /// Light: little moved per turn, and nothing held back. A turn that was blocked (no memory,
    /// a full socket) moved little because the next stage is behind, not because little came:
    /// waiting after it would only add dead time once the stage downstream lets go.
    fn light(&self) -> bool {
        self.turns > 0 && !self.held && self.bytes < LIGHT_TURN_BYTES * self.turns
    }
}

/// One poller thread's state.
struct Poller {
    poll: Poll,
    slots: Vec<Option<Entry>>,
    free: Vec<usize>,
    /// When connections must be called even if nothing happens (at most one pending per slot).
    times: BinaryHeap<Reverse<(Instant, usize)>>,
    /// Connections with more to read, called once the others had their turn.
    again: VecDeque<usize>,
    load: Arc<AtomicUsize>,
    round: Round,
    waker: Arc<Waker>,
    rung: Rung,
}

fn run(poll: Poll, rx: Receiver<Box<dyn Conn>>, load: Arc<AtomicUsize>, waker: Arc<Waker>) {
    let mut last_round: Option<Instant> = None;
    let mut events = Events::with_capacity(1024);
    let mut p = Poller::new(poll, load, waker);
    loop {
        let now = Instant::now();
        let timeout = if !p.again.is_empty() {
            Some(Duration::ZERO)
        } else {
            p.times
                .peek()
                .map(|Reverse((t, _))| t.saturating_duration_since(now))
        };
        if let Err(e) = p.poll.poll(&mut events, timeout) {
            if e.kind() != std::io::ErrorKind::Interrupted {
                tracing::error!(error = %e, "I/O poller failed");
                std::thread::sleep(Duration::from_millis(10));
            }
            continue;
        }
        let coalesce = moderation();
        if !events.is_empty() && !coalesce.is_zero() {
            // Too soon after a light round: let more gather, but never past a deadline.
            let now = Instant::now();
            if let Some(t) = last_round.filter(|_| p.round.light()) {
                let mut until = t + coalesce;
                if let Some(Reverse((d, _))) = p.times.peek() {
                    until = until.min(*d);
                }
                if until > now {
                    std::thread::sleep(until - now);
                }
            }
            last_round = Some(Instant::now());
            p.round = Round::default();
        }
        // Each with whether its bell rang. A bell is rung when what a connection waits for has
        // come (work queued, memory given back), so it is answered even by a connection that
        // said it is blocked: that is how a held link reads again at once rather than at its
        // next timed look.
        let mut ready: Vec<(usize, bool)> = Vec::with_capacity(events.iter().count());
        for ev in events.iter() {
            if ev.token() == WAKE {
                for conn in rx.try_iter() {
                    ready.push((p.add(conn), false));
                }
                // A bell of a connection that has ended may name a slot taken since by
                // another: that one gets a turn it did not need, which is harmless.
                ready.extend(p.rung.lock().drain(..).map(|i| (i, true)));
            } else {
                ready.push((ev.token().0, false));
            }
        }
        for (i, rung) in ready {
            if p.slots
                .get(i)
                .and_then(|s| s.as_ref())
                .is_some_and(|e| !e.in_again && (rung || !e.blocked))
            {
                p.turn(i);
            }
        }
        // Links that had more to read, once each, after everyone else's turn.
        for _ in 0..p.again.len() {
            let Some(i) = p.again.pop_front() else { break };
            if let Some(e) = p.slots[i].as_mut() {
                e.in_again = false;
                p.turn(i);
            }
        }
        let now = Instant::now();
        while let Some(&Reverse((t, i))) = p.times.peek() {
            if t > now {
                break;
            }
            p.times.pop();
            let Some(e) = p.slots[i].as_mut() else {
                continue;
            };
            e.queued = None;
            match e.deadline {
                Some(d) if d <= now && !e.in_again => p.turn(i),
                Some(d) if d > now => {
                    e.queued = Some(d);
                    p.times.push(Reverse((d, i)));
                }
                _ => {}
            }
        }
    }
}

impl Poller {
    fn new(poll: Poll, load: Arc<AtomicUsize>, waker: Arc<Waker>) -> Poller {
        Poller {
            poll,
            slots: Vec::new(),
            free: Vec::new(),
            times: BinaryHeap::new(),
            again: VecDeque::new(),
            load,
            round: Round::default(),
            waker,
            rung: Rung::default(),
        }
    }

    fn add(&mut self, conn: Box<dyn Conn>) -> usize {
        let fd = conn.fd();
        let i = self.free.pop().unwrap_or_else(|| {
            self.slots.push(None);
            self.slots.len() - 1
        });
        if let Some(bell) = conn.doorbell() {
            let _ = bell.0.at.set((self.waker.clone(), self.rung.clone(), i));
        }
        if let Err(e) = self
            .poll
            .registry()
            .register(&mut SourceFd(&fd), Token(i), conn.interest())
        {
            // Called anyway: its read fails or sees the state that broke it.
            tracing::warn!(error = %e, "could not poll a connection");
        }
        self.slots[i] = Some(Entry {
            conn,
            deadline: None,
            queued: None,
            blocked: false,
            in_again: false,
        });
        i
    }

    fn turn(&mut self, i: usize) {
        let Some(e) = self.slots[i].as_mut() else {
            return;
        };
        let before = e.conn.bytes_moved();
        let next = e.conn.turn();
        self.round.turns += 1;
        self.round.bytes += e.conn.bytes_moved() - before;
        let times = &mut self.times;
        let mut at = |e: &mut Entry, t: Instant| {
            // Never in the past: a connection that keeps asking for a time already gone is
            // called once per round, not in a loop that starves the poll.
            let t = t.max(Instant::now());
            e.deadline = Some(t);
            if e.queued.is_none_or(|q| q > t) {
                e.queued = Some(t);
                times.push(Reverse((t, i)));
            }
        };
        match next {
            Next::Readable(t) => {
                e.blocked = false;
                at(e, t);
            }
            Next::At(t) => {
                e.blocked = true;
                self.round.held = true;
                at(e, t);
            }
            Next::Writable(t) => {
                e.blocked = false;
                self.round.held = true;
                at(e, t);
            }
            Next::Again => {
                e.blocked = false;
                e.in_again = true;
                self.again.push_back(i);
            }
            Next::Done => {
                let fd = e.conn.fd();
                let _ = self.poll.registry().deregister(&mut SourceFd(&fd));
                // Dropping the connection closes its socket, after the deregistration.
                self.slots[i] = None;
                self.free.push(i);
                self.load.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;
    use std::sync::mpsc;

    /// Reads to the end and reports every byte, with a turn limit so `Again` is exercised, and
    /// blocks itself for a while at the first bytes so `At` is exercised.
    struct Counter {
        s: TcpStream,
        got: Vec<u8>,
        blocked_once: bool,
        done: mpsc::Sender<Vec<u8>>,
    }

    impl Conn for Counter {
        fn fd(&self) -> RawFd {
            self.s.as_raw_fd()
        }
        fn bytes_moved(&self) -> u64 {
            self.got.len() as u64
        }
        fn turn(&mut self) -> Next {
            if !self.got.is_empty() && !self.blocked_once {
                self.blocked_once = true;
                return Next::At(Instant::now() + Duration::from_millis(20));
            }
            let mut buf = [0u8; 7];
            for _ in 0..3 {
                match self.s.read(&mut buf) {
                    Ok(0) => {
                        let _ = self.done.send(std::mem::take(&mut self.got));
                        return Next::Done;
                    }
                    Ok(n) => self.got.extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        return Next::Readable(Instant::now() + Duration::from_secs(1))
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            Next::Again
        }
    }

    /// A connection that says what its turn moved and how it ended, over a socket of its own.
    struct Scripted {
        s: TcpStream,
        moved: u64,
        per_turn: u64,
        next: Next,
    }

    impl Conn for Scripted {
        fn fd(&self) -> RawFd {
            self.s.as_raw_fd()
        }
        fn bytes_moved(&self) -> u64 {
            self.moved
        }
        fn turn(&mut self) -> Next {
            self.moved += self.per_turn;
            self.next
        }
    }

    /// Whether a poller's round of one turn of a connection that moves `per_turn` bytes and
    /// then says `next` counts as light (to be moderated).
    fn light_after(per_turn: u64, next: Next) -> bool {
        let poll = Poll::new().unwrap();
        let waker = Arc::new(Waker::new(poll.registry(), WAKE).unwrap());
        let mut p = Poller::new(poll, Arc::new(AtomicUsize::new(0)), waker);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let _peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        let i = p.add(Box::new(Scripted {
            s,
            moved: 0,
            per_turn,
            next,
        }));
        p.round = Round::default();
        p.turn(i);
        p.round.light()
    }

    /// Moderation waits only after rounds that moved little because little came: not after one
    /// that moved data at full rate, nor after one held back by the next stage (no memory, a
    /// full socket), where waiting would only add dead time.
    #[test]
    fn a_round_is_light_only_when_little_came() {
        let later = Instant::now() + Duration::from_secs(1);
        assert!(light_after(100, Next::Readable(later)));
        assert!(!light_after(LIGHT_TURN_BYTES, Next::Readable(later)));
        assert!(!light_after(0, Next::At(later)));
        assert!(!light_after(0, Next::Writable(later)));
    }

    #[test]
    fn many_connections_on_few_threads_each_read_to_the_end() {
        let r = Reactor::new(2, "test").unwrap();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let (tx, rx) = mpsc::channel();
        let mut writers = Vec::new();
        for k in 0..20u8 {
            let mut w = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            let (s, _) = l.accept().unwrap();
            s.set_nonblocking(true).unwrap();
            r.register(Box::new(Counter {
                s,
                got: Vec::new(),
                blocked_once: false,
                done: tx.clone(),
            }));
            writers.push(std::thread::spawn(move || {
                for i in 0..200u32 {
                    w.write_all(&[k; 50]).unwrap();
                    if i % 50 == 0 {
                        std::thread::yield_now();
                    }
                }
            }));
        }
        for w in writers {
            w.join().unwrap();
        }
        let mut seen = Vec::new();
        for _ in 0..20 {
            let got = rx.recv_timeout(Duration::from_secs(20)).unwrap();
            assert_eq!(got.len(), 200 * 50);
            assert!(got.iter().all(|&b| b == got[0]));
            seen.push(got[0]);
        }
        seen.sort();
        assert_eq!(seen, (0..20).collect::<Vec<u8>>());
    }
}

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
    /// time anyway.
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

/// The receive low-water mark (`SO_RCVLOWAT`) of a link that carries data: epoll reports the
/// link only once this much is waiting (or its peer closed, or the kernel's buffer is under
/// pressure), so a busy link is read at once in large reads, and a slow one at its timed look
/// on the moderation grid ([`Silence::next_look`]), several messages a read, in one round with
/// every other slow link of its poller: a network card that interrupts after so many frames or
/// so much time, whichever comes first. A non-blocking read returns what is waiting, below the
/// mark or not.
pub const LOW_WATER: usize = 64 << 10;

/// The start of the moderation grid: every poller of the process looks at its slow links at the
/// same multiples of the moderation after it.
fn grid_epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// The first point of the moderation grid (period `t`) after `now`.
pub(crate) fn grid_after(now: Instant, t: Duration) -> Instant {
    let e = grid_epoch();
    if now < e {
        // `now` was read before the grid began: its first point.
        return e.min(now + t);
    }
    let t_ns = t.as_nanos().max(1);
    let k = now.saturating_duration_since(e).as_nanos() / t_ns + 1;
    e + Duration::from_nanos(u64::try_from(k * t_ns).unwrap_or(u64::MAX))
}

fn set_low_water(fd: RawFd, bytes: usize) -> std::io::Result<()> {
    let v = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    // SAFETY: a plain integer option on a descriptor the caller owns; the kernel copies `v`.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// What a polled link's reads prove about its peer's silence, and so when it must be looked at
/// next. Only reads prove silence: a link not read (held for memory) proves nothing.
#[derive(Debug, Default)]
pub struct Silence {
    /// Since when the socket has been found empty with nothing read after.
    dry_since: Option<Instant>,
    silent: bool,
    /// The socket's low-water mark is [`LOW_WATER`] (else 1, the kernel's default).
    marked: bool,
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

    /// When a link whose socket was just read dry (`fd`) must be looked at even if epoll says
    /// nothing, with the low-water mark that goes with it. A link that carries data has the
    /// mark [`LOW_WATER`] and a look at the next point of the moderation grid, so bytes below
    /// the mark wait at most one moderation. A link proven silent has the mark back at one
    /// byte, so its first byte wakes the poller at once, and a look after [`SILENCE_PROOF`]
    /// that extends the proof: idle links cost no timed looks. Without moderation, no mark and
    /// the silence look only.
    pub fn next_look(&mut self, fd: RawFd, now: Instant) -> Instant {
        self.look_after(fd, moderation(), now)
    }

    /// [`Self::next_look`] with the moderation `t`.
    fn look_after(&mut self, fd: RawFd, t: Duration, now: Instant) -> Instant {
        let mark = !t.is_zero() && !self.silent;
        if mark != self.marked {
            // Lowering the mark with bytes already waiting raises an event at once (the kernel
            // checks on every change), so no byte is stranded below a mark that no longer
            // applies. A failure leaves the mark where it was: both states are safe.
            match set_low_water(fd, if mark { LOW_WATER } else { 1 }) {
                Ok(()) => self.marked = mark,
                Err(e) => tracing::debug!(error = %e, "could not set a link's low-water mark"),
            }
        }
        if self.marked {
            grid_after(now, t).min(now + SILENCE_PROOF)
        } else {
            now + SILENCE_PROOF
        }
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
    /// One set per stage, because a stage may block its poller on the next stage (a builder's
    /// full queue to the recorder): that wait must never be on a poller the next stage needs,
    /// or a builder waiting for its recorder queue would hold the very poller that reads the
    /// recorder's link. Waits only ever point downstream, so pollers per stage cannot wait on
    /// themselves. A readout unit's queues to its builders never make a poller wait (bounded by
    /// its budgets, [`crate::sender::queue_unbounded`]): a builder needs every unit, and a
    /// poller held by one unit's full queue would stop the others' links it serves.
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

/// Interrupt moderation of the readout units' links: the period of the grid on which a link
/// that carries data is looked at when less than [`LOW_WATER`] is waiting
/// ([`Silence::next_look`]). At low rates several messages gather on each link and are read,
/// and acknowledged, once for many, in one round for all the slow links of a poller; at full
/// rate the mark is reached first and the link is read at once, so a step from a low rate to a
/// high one is never held. Costs at most this much latency, on links slower than the mark per
/// period. At 1 kHz over 105 links of 380 B the DAQ's CPU per fragment at 20 ms was 1.28-1.46
/// times its figure at saturation (2.7 at 5 ms; docs/PERFORMANCE.md). Senders, and the
/// builders' links they write to, are not moderated: their work comes in the batches the
/// readers' rounds make. `run.io_moderation_us` (set by each run for the whole process, since
/// the pollers serve every run of a node agent); zero turns it off.
static MODERATION_US: AtomicU64 = AtomicU64::new(DEFAULT_MODERATION_US);

/// The default of `run.io_moderation_us`.
pub const DEFAULT_MODERATION_US: u64 = 20_000;

/// Sets the pollers' moderation (see [`MODERATION_US`]); every link follows from its next look.
pub fn set_moderation(d: Duration) {
    MODERATION_US.store(d.as_micros() as u64, Ordering::Relaxed);
}

pub(crate) fn moderation() -> Duration {
    Duration::from_micros(MODERATION_US.load(Ordering::Relaxed))
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
    waker: Arc<Waker>,
    rung: Rung,
}

fn run(poll: Poll, rx: Receiver<Box<dyn Conn>>, load: Arc<AtomicUsize>, waker: Arc<Waker>) {
    // A poller that waits for a core delays its links' data and heartbeats: that is not the
    // peers' silence (crate::clock).
    let _watched = crate::clock::watch_this_thread();
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
        let next = e.conn.turn();
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
                at(e, t);
            }
            Next::Writable(t) => {
                e.blocked = false;
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

    fn low_water(s: &TcpStream) -> libc::c_int {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: reads an integer option into a local of the size given.
        let r = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVLOWAT,
                (&mut v as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
        v
    }

    #[test]
    fn timed_looks_fall_on_the_grid_within_one_moderation() {
        let t = Duration::from_millis(20);
        let e = grid_epoch();
        for k in [0u64, 1, 7, 19_999, 20_000_000, 123_456_789] {
            let now = e + Duration::from_nanos(k);
            let g = grid_after(now, t);
            assert!(g > now && g <= now + t, "{k}: {g:?} after {now:?}");
            assert_eq!((g - e).as_nanos() % t.as_nanos(), 0, "{k}: on the grid");
        }
    }

    /// A link that carries data has the low-water mark, and is looked at on the grid; proven
    /// silent, it has the kernel's one byte again (its first byte wakes the poller at once) and
    /// a look per silence proof; without moderation it is never marked.
    #[test]
    fn a_link_is_marked_while_it_carries_data_and_not_once_silent() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let _peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        let fd = s.as_raw_fd();
        let t = Duration::from_millis(20);
        let mut q = Silence::default();
        assert!(!q.data(true), "never reported silent");
        let now = Instant::now();
        let look = q.look_after(fd, t, now);
        assert_eq!(low_water(&s), LOW_WATER as libc::c_int);
        assert!(look > now && look <= now + Duration::from_millis(20));
        // Found empty, not yet for a whole proof: still marked, still on the grid.
        let soon = now + Duration::from_millis(1);
        assert!(q.empty_read(None, soon).is_none());
        assert!(q.look_after(fd, t, soon) <= soon + Duration::from_millis(20));
        assert_eq!(low_water(&s), LOW_WATER as libc::c_int);
        // Found empty for a whole proof (the clock is moved, not slept): silent, unmarked.
        let later = now + SILENCE_PROOF + Duration::from_millis(1);
        assert!(q.empty_read(None, later).is_some());
        assert_eq!(q.look_after(fd, t, later), later + SILENCE_PROOF);
        assert_eq!(low_water(&s), 1);
        // Heard again: marked again.
        assert!(q.data(true), "heard after a silence");
        q.look_after(fd, t, later);
        assert_eq!(low_water(&s), LOW_WATER as libc::c_int);
        // No moderation: no mark, the silence look only.
        assert_eq!(
            q.look_after(fd, Duration::ZERO, later),
            later + SILENCE_PROOF
        );
        assert_eq!(low_water(&s), 1);
    }

    /// Reads like a polled link that is never proven silent (so it stays marked), and hands on
    /// each read with the mark its socket had when it was read.
    struct Marked {
        s: TcpStream,
        silence: Silence,
        got: mpsc::Sender<Option<(libc::c_int, Vec<u8>)>>,
        /// Told once the first look has set the mark.
        looked: Option<mpsc::Sender<()>>,
    }

    impl Conn for Marked {
        fn fd(&self) -> RawFd {
            self.s.as_raw_fd()
        }
        fn turn(&mut self) -> Next {
            let t = Duration::from_millis(20);
            let mark = low_water(&self.s);
            let mut buf = [0u8; 4096];
            match self.s.read(&mut buf) {
                Ok(0) => {
                    let _ = self.got.send(None);
                    Next::Done
                }
                Ok(n) => {
                    let _ = self.got.send(Some((mark, buf[..n].to_vec())));
                    self.silence.data(n < buf.len());
                    Next::Readable(
                        self.silence
                            .look_after(self.s.as_raw_fd(), t, Instant::now()),
                    )
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let look = self
                        .silence
                        .look_after(self.s.as_raw_fd(), t, Instant::now());
                    if let Some(l) = self.looked.take() {
                        let _ = l.send(());
                    }
                    Next::Readable(look)
                }
                Err(e) => panic!("{e}"),
            }
        }
    }

    /// Bytes far below the mark, with nothing after them to raise an event, are still read
    /// (at the link's timed look), message after message, and the peer's close ends the link
    /// whatever the mark.
    #[test]
    fn bytes_below_the_mark_are_read_without_more_traffic() {
        let r = Reactor::new(1, "test").unwrap();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut w = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        s.set_nonblocking(true).unwrap();
        let (tx, rx) = mpsc::channel();
        let (looked, first_look) = mpsc::channel();
        r.register(Box::new(Marked {
            s,
            silence: Silence::default(),
            got: tx,
            looked: Some(looked),
        }));
        first_look.recv_timeout(Duration::from_secs(20)).unwrap();
        for i in 0..5u8 {
            w.write_all(&[i; 10]).unwrap();
            // Each message is answered before the next is written: nothing else comes to
            // raise an event for it.
            let got = rx.recv_timeout(Duration::from_secs(20)).unwrap();
            assert_eq!(
                got,
                Some((LOW_WATER as libc::c_int, vec![i; 10])),
                "read while marked"
            );
        }
        drop(w);
        assert_eq!(rx.recv_timeout(Duration::from_secs(20)).unwrap(), None);
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

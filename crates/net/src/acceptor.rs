//! One thread per stage that accepts connections on every role's listening socket, instead of an
//! accept thread per role (or per rail).
//!
//! Why: a role listens for the whole run (a connection that comes late, or for a link already
//! taken, is refused and counted), so a 16 x 60 trapezoid in one process kept 76 accept threads
//! waking to look at their stop flags, 2.5 % of all CPU samples of the run after they waited in
//! `poll` instead of sleeping (docs/PERFORMANCE.md), and the thread count grew with the roles.
//! One thread per stage waits on every listener at once and takes each connection as it comes.
//!
//! Each registration keeps the rules of [`crate::io::accept_until`]: it ends when `missing()`
//! says nobody else is expected, or when its stop is raised and the backlog holds nobody else (a
//! peer that connected before the stop is still taken).
//!
//! The acceptor also reads each connection's hello (a fixed number of bytes) without blocking,
//! each within its own deadline, before handing the connection over: a silent or slow
//! connection holds nobody else's hello, and a 16 x 60 trapezoid no longer starts a thread per
//! connection to say hello (960 at its start, most of the process's peak of threads). At most
//! [`MAX_HELLOS`] hellos of a role are under way at once; beyond, a connection is refused. A
//! registration ends only once its accepting has ended and none of its hellos is under way, so
//! a stop that takes the peers still missing for never connected has seen every hello of a peer
//! that connected before it. Its `on_end` runs on the acceptor's thread and must not block.

use crate::io::{accept_backlog, AcceptEnd, Backlog, ACCEPT_RECHECK};
use crate::reactor::{Stage, Tally, TallyGuard};
use crossbeam_channel::{unbounded, Receiver, Sender};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Most hellos of one role under way at once: a flood of silent connections costs descriptors
/// until their deadlines, not the role.
pub const MAX_HELLOS: usize = 64;

/// How long a connection may take to say its hello.
pub const HELLO_PATIENCE: Duration = Duration::from_secs(5);

/// What came of a connection's hello.
pub enum Greeted {
    /// The hello's bytes came whole; the connection is non-blocking and holds what the peer sent
    /// after its hello, unread.
    Said {
        stream: TcpStream,
        peer: SocketAddr,
        hello: Vec<u8>,
    },
    /// Refused before a hello: the connection is closed; `why` is for the count and the log.
    Refused { peer: SocketAddr, why: String },
}

/// One role's listening socket and what to do with its connections.
pub struct Accepting {
    pub name: String,
    pub listener: TcpListener,
    pub stop: Arc<AtomicBool>,
    /// Whether a peer is still expected.
    pub missing: Box<dyn FnMut() -> bool + Send>,
    /// Bytes of the hello every connection sends first (0: hand each connection over at once).
    pub hello_len: usize,
    /// How long each connection has to say its hello ([`HELLO_PATIENCE`] for the data path).
    pub hello_patience: Duration,
    /// A connection from an allowed peer once it has said its hello, or refused. Must not block.
    pub on_hello: Box<dyn FnMut(Greeted) + Send>,
    /// Called once when accepting has ended and no hello is under way. Must not block.
    pub on_end: Box<dyn FnOnce(AcceptEnd) + Send>,
    /// Connections the role opened itself to peers that listen (sources dialled SiTCP style),
    /// each with its place among the dialler's hellos under way: their hellos are read here
    /// like the accepted ones'. The registration does not end before this channel is closed
    /// (the dialler has ended). Wake the acceptor ([`Acceptor::wake`]) after each.
    pub dialled: Option<Receiver<Dialled>>,
    /// Told of every look that found no connection waiting and no hello under way (of the
    /// accepted ones, and of `dial_hellos`, the dialler's, which it holds from its connect
    /// until the hello is read here).
    pub none_waiting: Option<crate::io::NoneWaiting>,
    pub dial_hellos: Option<crate::io::Hellos>,
}

/// A connection the role opened to a peer that listens, with its hello under way.
pub type Dialled = (TcpStream, SocketAddr, crate::io::HelloUnderWay);

struct Registration {
    a: Accepting,
    /// Set once the backlog has ended: no more connections are taken.
    ended: Option<AcceptEnd>,
    /// Hellos under way.
    greeting: usize,
    /// The listener may hold connections: it is new, was reported readable, or its last accept
    /// failed. Otherwise a recheck only looks at the stop and at `missing()`: an `accept` on
    /// an empty backlog still makes and frees a socket file in the kernel, and the builders of a
    /// 16 x 60 trapezoid accept for the whole run (a unit may come back), 60 listeners every
    /// 50 ms.
    pending: bool,
    /// The listener is in the poll set (else every recheck accepts, as readiness never comes).
    watched: bool,
    _live: TallyGuard,
}

/// A connection saying its hello.
struct Greeting {
    reg: usize,
    stream: TcpStream,
    peer: SocketAddr,
    hello: Vec<u8>,
    got: usize,
    deadline: Instant,
    /// A dialled connection's place among its dialler's hellos, given back when settled.
    _under_way: Option<crate::io::HelloUnderWay>,
}

/// The accepting thread of one stage.
pub struct Acceptor {
    tx: Sender<Registration>,
    waker: Arc<Waker>,
}

const WAKE: Token = Token(usize::MAX);
/// Tokens of connections saying hello start here; below are the listeners'.
const GREETING: usize = 1 << 31;

impl Acceptor {
    /// The process's acceptor for `stage`, started on first use; it lives as long as the process.
    pub fn stage(stage: Stage) -> &'static Acceptor {
        static A: [OnceLock<Acceptor>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
        A[stage as usize].get_or_init(|| {
            let poll = Poll::new().expect("an epoll instance for the acceptor");
            let waker = Arc::new(Waker::new(poll.registry(), WAKE).expect("the acceptor's waker"));
            let (tx, rx) = unbounded();
            std::thread::Builder::new()
                .name(format!("{}-accept", stage.name()))
                .spawn(move || Thread::new(poll).run(rx))
                .expect("start an acceptor");
            Acceptor { tx, waker }
        })
    }

    /// Looks at every registration now (a dialled connection is waiting).
    pub fn wake(&self) {
        let _ = self.waker.wake();
    }

    /// Accepts on `a.listener` from now until its end; the role counts it in `live` until then.
    pub fn add(&self, a: Accepting, live: &Arc<Tally>) {
        let _ = a.listener.set_nonblocking(true);
        let r = Registration {
            a,
            ended: None,
            greeting: 0,
            pending: true,
            watched: true,
            _live: live.enter(),
        };
        // The acceptor's thread never ends, so its receiver never goes away.
        let _ = self.tx.send(r);
        let _ = self.waker.wake();
    }
}

struct Thread {
    poll: Poll,
    regs: Vec<Option<Registration>>,
    greetings: Vec<Option<Greeting>>,
    /// When the last wait for readiness began: a listener it did not report had nobody come
    /// from then (edge-triggered, and each turn drains the backlog).
    polled_at: Option<Instant>,
}

/// A callback of a role panicked: the role ends as if stopped, alone, and the other roles of the
/// stage keep their acceptor.
struct Panicked;

impl Thread {
    fn new(poll: Poll) -> Self {
        Thread {
            poll,
            regs: Vec::new(),
            greetings: Vec::new(),
            polled_at: None,
        }
    }

    fn run(mut self, rx: Receiver<Registration>) {
        let mut events = Events::with_capacity(256);
        loop {
            while let Ok(r) = rx.try_recv() {
                self.register(r);
            }
            for ev in events.iter() {
                let t = ev.token();
                if t != WAKE && t.0 >= GREETING {
                    self.listen_to(t.0 - GREETING);
                } else if let Some(r) = self.regs.get_mut(t.0).and_then(Option::as_mut) {
                    r.pending = true;
                }
            }
            self.expire(Instant::now());
            // Every registration each round, ready or not: its stop and `missing()` are looked at
            // at least every recheck, and edge-triggered readiness needs the backlog drained.
            for slot in 0..self.regs.len() {
                self.turn(slot);
            }
            self.polled_at = Some(Instant::now());
            let _ = self.poll.poll(&mut events, Some(ACCEPT_RECHECK));
        }
    }

    fn register(&mut self, mut r: Registration) {
        let slot = free_slot(&mut self.regs);
        let fd = r.a.listener.as_raw_fd();
        if let Err(e) =
            self.poll
                .registry()
                .register(&mut SourceFd(&fd), Token(slot), Interest::READABLE)
        {
            // Still served, at every recheck instead of at once.
            tracing::warn!(role = %r.a.name, error = %e, "cannot watch a listener");
            r.watched = false;
        }
        self.regs[slot] = Some(r);
    }

    /// Takes the registration's backlog, if it still accepts, and ends it once nothing of it is
    /// under way.
    fn turn(&mut self, slot: usize) {
        let Some(r) = self.regs[slot].as_mut() else {
            return;
        };
        // Since when this turn knows the backlog empty, if it drains it or nobody came.
        let mut looked = None;
        if r.ended.is_none() {
            let mut taken = Vec::new();
            let pending = r.pending || !r.watched;
            looked = if pending {
                Some(Instant::now())
            } else {
                self.polled_at
            };
            let a = &mut r.a;
            let (end, pending) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // Nothing came since the backlog was drained: only the stop and the peers
                // still expected can have changed (a stop takes the accepting way, which ends
                // on it).
                if !pending && !a.stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let end = (!(a.missing)()).then_some(AcceptEnd::AllConnected);
                    return (end, false);
                }
                match accept_backlog(&a.listener, &a.stop, &mut a.missing, &mut |s, p| {
                    taken.push((s, p))
                }) {
                    Backlog::Ended(end) => (Some(end), false),
                    // A drained listener is looked at again after its next readiness; a
                    // failing one at the next recheck too (edge-triggered: a listener that
                    // stays readable after a failure wakes nobody early).
                    Backlog::Drained => (None, false),
                    Backlog::Failed => {
                        looked = None;
                        (None, true)
                    }
                }
            }))
            .unwrap_or_else(|_| {
                tracing::error!(role = %a.name, "accepting panicked; it takes no more connections");
                (Some(AcceptEnd::Stopped), false)
            });
            r.pending = pending;
            for (stream, peer) in taken {
                if self.greet(slot, stream, peer, None).is_err() {
                    self.fail(slot);
                    break;
                }
            }
            if let Some(end) = end {
                self.end_accepting(slot, end);
            }
        }
        self.take_dialled(slot);
        let Some(r) = self.regs[slot].as_ref() else {
            return;
        };
        if let (Some(at), Some(w)) = (looked, &r.a.none_waiting) {
            let dialling = r.a.dial_hellos.as_ref().is_some_and(|h| !h.idle());
            if r.ended.is_none() && r.greeting == 0 && !dialling {
                w.saw(at);
            }
        }
        if r.ended.is_some() && r.greeting == 0 && r.a.dialled.is_none() {
            let Some(Registration {
                a, ended, _live, ..
            }) = self.regs[slot].take()
            else {
                return;
            };
            let name = a.name;
            let end = ended.unwrap_or(AcceptEnd::Stopped);
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (a.on_end)(end))).is_err() {
                tracing::error!(role = %name, "the end of an accept loop panicked");
            }
            // `_live` dropped here: the role no longer waits for this registration.
        }
    }

    /// Greets the connections the role's dialler opened; forgets the dialler once it has ended.
    fn take_dialled(&mut self, slot: usize) {
        loop {
            let Some(rx) = self.regs[slot].as_ref().and_then(|r| r.a.dialled.as_ref()) else {
                return;
            };
            match rx.try_recv() {
                Ok((stream, peer, under_way)) => {
                    if self.greet(slot, stream, peer, Some(under_way)).is_err() {
                        self.fail(slot);
                    }
                }
                Err(crossbeam_channel::TryRecvError::Empty) => return,
                Err(crossbeam_channel::TryRecvError::Disconnected) => {
                    if let Some(r) = self.regs[slot].as_mut() {
                        r.a.dialled = None;
                    }
                    return;
                }
            }
        }
    }

    /// No more connections for this registration.
    fn end_accepting(&mut self, slot: usize, end: AcceptEnd) {
        let Some(r) = self.regs[slot].as_mut() else {
            return;
        };
        if r.ended.is_none() {
            let fd = r.a.listener.as_raw_fd();
            let _ = self.poll.registry().deregister(&mut SourceFd(&fd));
            r.ended = Some(end);
        }
    }

    /// A callback of the registration panicked: it takes no more connections, and its hellos
    /// under way are dropped (closed) without being handed to it again.
    fn fail(&mut self, slot: usize) {
        if let Some(r) = self.regs[slot].as_ref() {
            tracing::error!(role = %r.a.name, "handing over a connection panicked; the role takes no more connections");
        }
        self.end_accepting(slot, AcceptEnd::Stopped);
        if let Some(r) = self.regs[slot].as_mut() {
            // Its dialler's connections are refused from now on (closed as its sends fail).
            r.a.dialled = None;
        }
        for i in 0..self.greetings.len() {
            if self.greetings[i].as_ref().is_some_and(|g| g.reg == slot) {
                self.take_greeting(i);
            }
        }
    }

    /// A new connection: its hello read at once if it is there, else watched until it comes.
    fn greet(
        &mut self,
        slot: usize,
        stream: TcpStream,
        peer: SocketAddr,
        under_way: Option<crate::io::HelloUnderWay>,
    ) -> Result<(), Panicked> {
        let Some(r) = self.regs[slot].as_mut() else {
            return Ok(());
        };
        // Dialled connections are bounded by their dialler, which waits rather than refuses.
        if under_way.is_none() && r.greeting >= MAX_HELLOS {
            let why = format!("{MAX_HELLOS} connections are already waiting to say hello");
            return hand_over(r, Greeted::Refused { peer, why });
        }
        if let Err(e) = stream.set_nonblocking(true) {
            let why = format!("cannot read a hello: {e}");
            return hand_over(r, Greeted::Refused { peer, why });
        }
        r.greeting += 1;
        let g = Greeting {
            reg: slot,
            stream,
            peer,
            hello: vec![0; r.a.hello_len],
            got: 0,
            deadline: Instant::now() + r.a.hello_patience,
            _under_way: under_way,
        };
        let i = free_slot(&mut self.greetings);
        self.greetings[i] = Some(g);
        if let Some(g) = self.greetings[i].as_ref() {
            let fd = g.stream.as_raw_fd();
            // Edge-triggered, added before the first read: bytes that come between the read
            // and a later registration would raise no edge.
            if let Err(e) = self.poll.registry().register(
                &mut SourceFd(&fd),
                Token(GREETING + i),
                Interest::READABLE,
            ) {
                let why = format!("cannot watch for a hello: {e}");
                return self.settle(i, Err(why));
            }
        }
        self.listen_to(i);
        Ok(())
    }

    /// Reads what the connection has of its hello; settles it once whole, closed or broken.
    fn listen_to(&mut self, i: usize) {
        let Some(g) = self.greetings.get_mut(i).and_then(Option::as_mut) else {
            return;
        };
        let outcome = loop {
            if g.got == g.hello.len() {
                break Some(Ok(()));
            }
            match g.stream.read(&mut g.hello[g.got..]) {
                Ok(0) => break Some(Err("peer closed during handshake".to_string())),
                Ok(n) => g.got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break None,
                Err(e) => break Some(Err(e.to_string())),
            }
        };
        if let Some(outcome) = outcome {
            let slot = g.reg;
            if self.settle(i, outcome).is_err() {
                self.fail(slot);
            }
        }
    }

    /// Hellos past their deadline are refused.
    fn expire(&mut self, now: Instant) {
        for i in 0..self.greetings.len() {
            if let Some(g) = self.greetings[i].as_ref() {
                if now >= g.deadline {
                    let slot = g.reg;
                    let why = "peer sent no handshake in time".to_string();
                    if self.settle(i, Err(why)).is_err() {
                        self.fail(slot);
                    }
                }
            }
        }
    }

    /// Greeting `i` out of the poll and its role's count of hellos under way.
    fn take_greeting(&mut self, i: usize) -> Option<Greeting> {
        let g = self.greetings[i].take()?;
        let _ = self
            .poll
            .registry()
            .deregister(&mut SourceFd(&g.stream.as_raw_fd()));
        if let Some(r) = self.regs[g.reg].as_mut() {
            r.greeting -= 1;
        }
        Some(g)
    }

    /// The hello of greeting `i` is over: hands the connection (or its refusal) to its role.
    fn settle(&mut self, i: usize, outcome: Result<(), String>) -> Result<(), Panicked> {
        let Some(g) = self.take_greeting(i) else {
            return Ok(());
        };
        let Some(r) = self.regs[g.reg].as_mut() else {
            return Ok(());
        };
        let Greeting {
            stream,
            peer,
            hello,
            ..
        } = g;
        let greeted = match outcome {
            Ok(()) => Greeted::Said {
                stream,
                peer,
                hello,
            },
            Err(why) => Greeted::Refused { peer, why },
        };
        hand_over(r, greeted)
    }
}

fn hand_over(r: &mut Registration, g: Greeted) -> Result<(), Panicked> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (r.a.on_hello)(g)))
        .map_err(|_| Panicked)
}

fn free_slot<T>(v: &mut Vec<Option<T>>) -> usize {
    v.iter().position(Option::is_none).unwrap_or_else(|| {
        v.push(None);
        v.len() - 1
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// Two roles on one acceptor: each gets its own connections, one ends when nobody else is
    /// expected, the other when stopped, and a peer that connected before the stop is taken.
    #[test]
    fn roles_share_an_acceptor_and_keep_their_ends() {
        let acc = Acceptor::stage(Stage::Send);
        let mk = |expect: usize| {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            let got = Arc::new(AtomicUsize::new(0));
            let stop = Arc::new(AtomicBool::new(false));
            let (tx, rx) = std::sync::mpsc::channel();
            let live = Arc::new(Tally::default());
            let g = got.clone();
            let g2 = got.clone();
            acc.add(
                Accepting {
                    name: "test".into(),
                    listener: l,
                    stop: stop.clone(),
                    missing: Box::new(move || g.load(Ordering::SeqCst) < expect),
                    hello_len: 0,
                    hello_patience: HELLO_PATIENCE,
                    on_hello: Box::new(move |_| {
                        g2.fetch_add(1, Ordering::SeqCst);
                    }),
                    on_end: Box::new(move |end| {
                        let _ = tx.send(end);
                    }),
                    dialled: None,
                    none_waiting: None,
                    dial_hellos: None,
                },
                &live,
            );
            (addr, got, stop, rx, live)
        };
        let (a1, got1, _stop1, end1, live1) = mk(2);
        let (a2, got2, stop2, end2, live2) = mk(usize::MAX);
        let _c1 = TcpStream::connect(a1).unwrap();
        let _c2 = TcpStream::connect(a1).unwrap();
        let wait = Duration::from_secs(60);
        assert_eq!(end1.recv_timeout(wait).unwrap(), AcceptEnd::AllConnected);
        live1.wait_zero();
        assert_eq!(got1.load(Ordering::SeqCst), 2);
        // Connected (in the backlog, or taken already) before the stop: taken.
        let _c3 = TcpStream::connect(a2).unwrap();
        stop2.store(true, Ordering::SeqCst);
        assert_eq!(end2.recv_timeout(wait).unwrap(), AcceptEnd::Stopped);
        live2.wait_zero();
        assert_eq!(got2.load(Ordering::SeqCst), 1);
    }

    /// A role whose connection handling panics ends alone, as stopped; a role registered after
    /// it on the same acceptor still gets its connections.
    #[test]
    fn a_panicking_role_ends_alone() {
        let acc = Acceptor::stage(Stage::Send);
        let reg = |on_hello: Box<dyn FnMut(Greeted) + Send>| {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            let live = Arc::new(Tally::default());
            acc.add(
                Accepting {
                    name: "test".into(),
                    listener: l,
                    stop: Arc::new(AtomicBool::new(false)),
                    missing: Box::new(|| true),
                    hello_len: 0,
                    hello_patience: HELLO_PATIENCE,
                    on_hello,
                    on_end: Box::new(move |end| {
                        let _ = tx.send(end);
                    }),
                    dialled: None,
                    none_waiting: None,
                    dial_hellos: None,
                },
                &live,
            );
            (addr, rx, live)
        };
        let (bad, bad_end, bad_live) = reg(Box::new(|_| panic!("cannot take a connection")));
        let (tx, taken) = std::sync::mpsc::channel();
        let (good, good_end, _good_live) = reg(Box::new(move |g| {
            if let Greeted::Said { peer, .. } = g {
                let _ = tx.send(peer);
            }
        }));
        let _c = TcpStream::connect(bad).unwrap();
        let wait = Duration::from_secs(60);
        assert_eq!(bad_end.recv_timeout(wait).unwrap(), AcceptEnd::Stopped);
        bad_live.wait_zero();
        let c = TcpStream::connect(good).unwrap();
        assert_eq!(taken.recv_timeout(wait).unwrap(), c.local_addr().unwrap());
        assert!(good_end.try_recv().is_err(), "the other role still accepts");
    }

    enum Seen {
        Said(SocketAddr, Vec<u8>, TcpStream),
        Refused(SocketAddr, String),
        End(AcceptEnd),
    }

    /// A registration whose hellos are `len` bytes; everything it sees goes to one channel, in
    /// the order the acceptor did it.
    fn greeter(
        stage: Stage,
        len: usize,
        stop: Arc<AtomicBool>,
    ) -> (SocketAddr, std::sync::mpsc::Receiver<Seen>, Arc<Tally>) {
        greeter_dialling(stage, len, stop, None)
    }

    fn greeter_dialling(
        stage: Stage,
        len: usize,
        stop: Arc<AtomicBool>,
        dialled: Option<Receiver<Dialled>>,
    ) -> (SocketAddr, std::sync::mpsc::Receiver<Seen>, Arc<Tally>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let tx2 = tx.clone();
        let live = Arc::new(Tally::default());
        Acceptor::stage(stage).add(
            Accepting {
                name: "test".into(),
                listener: l,
                stop,
                missing: Box::new(|| true),
                hello_len: len,
                // Longer than any test waits: no hello here ends by its deadline.
                hello_patience: Duration::from_secs(600),
                on_hello: Box::new(move |g| {
                    let _ = tx.send(match g {
                        Greeted::Said {
                            stream,
                            peer,
                            hello,
                        } => Seen::Said(peer, hello, stream),
                        Greeted::Refused { peer, why } => Seen::Refused(peer, why),
                    });
                }),
                on_end: Box::new(move |end| {
                    let _ = tx2.send(Seen::End(end));
                }),
                dialled,
                none_waiting: None,
                dial_hellos: None,
            },
            &live,
        );
        (addr, rx, live)
    }

    /// Waits until the acceptor of `stage` has finished a whole round begun after now: a
    /// registration added now ends in the round that takes it; one added after that, in a later
    /// round, once every registration has been turned in the first.
    fn full_round(stage: Stage) {
        for _ in 0..2 {
            let (_, rx, _) = greeter(stage, 0, Arc::new(AtomicBool::new(true)));
            loop {
                if let Seen::End(_) = rx.recv_timeout(Duration::from_secs(60)).unwrap() {
                    break;
                }
            }
        }
    }

    /// A listener whose backlog was drained is not accepted on at every recheck, only when it
    /// says a peer came: a peer that comes rounds later is still taken, and a stop still ends
    /// the registration.
    #[test]
    fn a_drained_listener_takes_a_late_peer_and_its_stop() {
        let stage = Stage::Readout;
        let stop = Arc::new(AtomicBool::new(false));
        let (addr, rx, live) = greeter(stage, 0, stop.clone());
        // Two whole rounds after the one that drained the empty backlog.
        full_round(stage);
        full_round(stage);
        let late = TcpStream::connect(addr).unwrap();
        let wait = Duration::from_secs(60);
        match rx.recv_timeout(wait).unwrap() {
            Seen::Said(peer, _, _) => assert_eq!(peer, late.local_addr().unwrap()),
            _ => panic!("the late peer was not taken"),
        }
        stop.store(true, Ordering::SeqCst);
        Acceptor::stage(stage).wake();
        match rx.recv_timeout(wait).unwrap() {
            Seen::End(end) => assert_eq!(end, AcceptEnd::Stopped),
            _ => panic!("expected the end"),
        }
        live.wait_zero();
    }

    /// Hellos are read on the acceptor's thread without blocking it: a silent connection holds
    /// nobody else's hello, a hello that comes in pieces is put together, the bytes after a
    /// hello stay in the connection, a peer that closes early is refused; a stop does not end
    /// the registration while a hello is under way, and the connection that says it after the
    /// stop is still handed over, before the end.
    #[test]
    fn hellos_are_read_without_a_thread_and_a_stop_waits_for_them() {
        use std::io::Write;
        let stage = Stage::Builder;
        let stop = Arc::new(AtomicBool::new(false));
        let (addr, rx, live) = greeter(stage, 8, stop.clone());
        let wait = Duration::from_secs(60);
        let mut silent = TcpStream::connect(addr).unwrap();
        let mut whole = TcpStream::connect(addr).unwrap();
        whole.write_all(b"HELLO-01tail").unwrap();
        match rx.recv_timeout(wait).unwrap() {
            Seen::Said(peer, hello, s) => {
                assert_eq!(peer, whole.local_addr().unwrap());
                assert_eq!(hello, b"HELLO-01");
                s.set_nonblocking(false).unwrap();
                let mut rest = [0u8; 4];
                (&s).read_exact(&mut rest).unwrap();
                assert_eq!(&rest, b"tail");
            }
            _ => panic!("the whole hello first"),
        }
        let mut pieces = TcpStream::connect(addr).unwrap();
        pieces.write_all(b"HEL").unwrap();
        full_round(stage);
        pieces.write_all(b"LO-02").unwrap();
        match rx.recv_timeout(wait).unwrap() {
            Seen::Said(peer, hello, _) => {
                assert_eq!(peer, pieces.local_addr().unwrap());
                assert_eq!(hello, b"HELLO-02");
            }
            _ => panic!("the hello in pieces next"),
        }
        let early = TcpStream::connect(addr).unwrap();
        let early_addr = early.local_addr().unwrap();
        drop(early);
        match rx.recv_timeout(wait).unwrap() {
            Seen::Refused(peer, why) => {
                assert_eq!(peer, early_addr);
                assert!(why.contains("closed"), "{why}");
            }
            _ => panic!("the early close refused"),
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        full_round(stage);
        assert!(
            rx.try_recv().is_err(),
            "nothing ends while the silent connection's hello is under way"
        );
        assert!(!live.is_zero());
        silent.write_all(b"HELLO-03").unwrap();
        match rx.recv_timeout(wait).unwrap() {
            Seen::Said(peer, hello, _) => {
                assert_eq!(peer, silent.local_addr().unwrap());
                assert_eq!(hello, b"HELLO-03");
            }
            _ => panic!("the late hello is handed over before the end"),
        }
        assert!(matches!(
            rx.recv_timeout(wait).unwrap(),
            Seen::End(AcceptEnd::Stopped)
        ));
        live.wait_zero();
    }

    /// At most MAX_HELLOS hellos of a role are under way: the next connection is refused with
    /// the reason, and the ones under way still say theirs.
    #[test]
    fn hellos_under_way_are_bounded() {
        use std::io::Write;
        let stage = Stage::Readout;
        let (addr, rx, _live) = greeter(stage, 4, Arc::new(AtomicBool::new(false)));
        let mut silent: Vec<TcpStream> = (0..MAX_HELLOS)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        full_round(stage);
        let extra = TcpStream::connect(addr).unwrap();
        match rx.recv_timeout(Duration::from_secs(60)).unwrap() {
            Seen::Refused(peer, why) => {
                assert_eq!(peer, extra.local_addr().unwrap());
                assert!(why.contains("already waiting to say hello"), "{why}");
            }
            _ => panic!("the connection beyond the bound is refused"),
        }
        silent[0].write_all(b"HIYA").unwrap();
        match rx.recv_timeout(Duration::from_secs(60)).unwrap() {
            Seen::Said(peer, hello, _) => {
                assert_eq!(peer, silent[0].local_addr().unwrap());
                assert_eq!(hello, b"HIYA");
            }
            _ => panic!("a hello under way still comes through"),
        }
        silent.clear();
    }

    /// A connection the role dialled has its hello read like an accepted one's, and the
    /// registration does not end, even stopped, until its dialler has.
    #[test]
    fn dialled_connections_say_hello_and_hold_the_end_until_the_dialler_ends() {
        use std::io::Write;
        let stage = Stage::Send;
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, dialled) = unbounded::<Dialled>();
        let (_, rx, live) = greeter_dialling(stage, 4, stop.clone(), Some(dialled));
        // A peer that listens, as a SiTCP board does, and the role's connection to it.
        let board = TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = TcpStream::connect(board.local_addr().unwrap()).unwrap();
        let (mut theirs, _) = board.accept().unwrap();
        let hellos = crate::io::Hellos::default();
        tx.send((ours, board.local_addr().unwrap(), hellos.begin().unwrap()))
            .unwrap();
        Acceptor::stage(stage).wake();
        theirs.write_all(b"SITC").unwrap();
        match rx.recv_timeout(Duration::from_secs(60)).unwrap() {
            Seen::Said(peer, hello, _) => {
                assert_eq!(peer, board.local_addr().unwrap());
                assert_eq!(hello, b"SITC");
            }
            _ => panic!("the dialled connection's hello"),
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        full_round(stage);
        assert!(rx.try_recv().is_err(), "the dialler has not ended yet");
        hellos.wait_done();
        drop(tx);
        Acceptor::stage(stage).wake();
        assert!(matches!(
            rx.recv_timeout(Duration::from_secs(60)).unwrap(),
            Seen::End(AcceptEnd::Stopped)
        ));
        live.wait_zero();
    }
}

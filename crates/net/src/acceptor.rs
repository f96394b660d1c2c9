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
//! peer that connected before the stop is still taken). Its `on_end` runs on the acceptor's
//! thread and must not block: waits it needs (hellos under way) go on a thread of its own.

use crate::io::{accept_backlog, AcceptEnd, Backlog, ACCEPT_RECHECK};
use crate::reactor::{Stage, Tally, TallyGuard};
use crossbeam_channel::{unbounded, Receiver, Sender};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};

/// One role's listening socket and what to do with its connections.
pub struct Accepting {
    pub name: String,
    pub listener: TcpListener,
    pub stop: Arc<AtomicBool>,
    /// Whether a peer is still expected.
    pub missing: Box<dyn FnMut() -> bool + Send>,
    /// A connection from an allowed peer, in blocking mode. Must not block (read a hello on a
    /// thread of its own).
    pub on_connection: Box<dyn FnMut(TcpStream, SocketAddr) + Send>,
    /// Called once when accepting has ended. Must not block.
    pub on_end: Box<dyn FnOnce(AcceptEnd) + Send>,
}

struct Registration {
    a: Accepting,
    _live: TallyGuard,
}

/// The accepting thread of one stage.
pub struct Acceptor {
    tx: Sender<Registration>,
    waker: Arc<Waker>,
}

const WAKE: Token = Token(usize::MAX);

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
                .spawn(move || run(poll, rx))
                .expect("start an acceptor");
            Acceptor { tx, waker }
        })
    }

    /// Accepts on `a.listener` from now until its end; the role counts it in `live` until then.
    pub fn add(&self, a: Accepting, live: &Arc<Tally>) {
        let _ = a.listener.set_nonblocking(true);
        let r = Registration {
            a,
            _live: live.enter(),
        };
        // The acceptor's thread never ends, so its receiver never goes away.
        let _ = self.tx.send(r);
        let _ = self.waker.wake();
    }
}

fn run(mut poll: Poll, rx: Receiver<Registration>) {
    let mut regs: Vec<Option<Registration>> = Vec::new();
    let mut events = Events::with_capacity(256);
    loop {
        while let Ok(r) = rx.try_recv() {
            let slot = regs.iter().position(Option::is_none).unwrap_or_else(|| {
                regs.push(None);
                regs.len() - 1
            });
            let fd = r.a.listener.as_raw_fd();
            if let Err(e) =
                poll.registry()
                    .register(&mut SourceFd(&fd), Token(slot), Interest::READABLE)
            {
                // Still served, at every recheck instead of at once.
                tracing::warn!(role = %r.a.name, error = %e, "cannot watch a listener");
            }
            regs[slot] = Some(r);
        }
        // Every registration each round, ready or not: its stop and `missing()` are looked at
        // at least every recheck, and edge-triggered readiness needs the backlog drained.
        for entry in regs.iter_mut() {
            let Some(r) = entry else { continue };
            // A role whose accepting panics (a hello thread that cannot be started) ends as if
            // stopped, alone: the other roles of the stage keep their acceptor.
            let end = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| turn(&mut r.a)))
                .unwrap_or_else(|_| {
                    tracing::error!(role = %r.a.name, "accepting panicked; it takes no more connections");
                    Some(AcceptEnd::Stopped)
                });
            if let Some(end) = end {
                let fd = r.a.listener.as_raw_fd();
                let _ = poll.registry().deregister(&mut SourceFd(&fd));
                let Some(done) = entry.take() else { continue };
                let Registration { a, _live } = done;
                let name = a.name;
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (a.on_end)(end)))
                    .is_err()
                {
                    tracing::error!(role = %name, "the end of an accept loop panicked");
                }
                // `_live` dropped here: the role no longer waits for this registration.
            }
        }
        let _ = poll.poll(&mut events, Some(ACCEPT_RECHECK));
    }
}

/// Accepts what the backlog holds; `Some` when the registration has ended. A drained or failing
/// listener is looked at again after the next readiness or recheck, whichever comes first
/// (edge-triggered: a listener that stays readable after a failure wakes nobody early).
fn turn(a: &mut Accepting) -> Option<AcceptEnd> {
    match accept_backlog(&a.listener, &a.stop, &mut a.missing, &mut a.on_connection) {
        Backlog::Ended(end) => Some(end),
        Backlog::Drained | Backlog::Failed => None,
    }
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
                    on_connection: Box::new(move |_s, _p| {
                        g2.fetch_add(1, Ordering::SeqCst);
                    }),
                    on_end: Box::new(move |end| {
                        let _ = tx.send(end);
                    }),
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
        let reg = |on_connection: Box<dyn FnMut(TcpStream, SocketAddr) + Send>| {
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
                    on_connection,
                    on_end: Box::new(move |end| {
                        let _ = tx.send(end);
                    }),
                },
                &live,
            );
            (addr, rx, live)
        };
        let (bad, bad_end, bad_live) = reg(Box::new(|_, _| panic!("cannot start a hello")));
        let (tx, taken) = std::sync::mpsc::channel();
        let (good, good_end, _good_live) = reg(Box::new(move |_, p| {
            let _ = tx.send(p);
        }));
        let _c = TcpStream::connect(bad).unwrap();
        let wait = Duration::from_secs(60);
        assert_eq!(bad_end.recv_timeout(wait).unwrap(), AcceptEnd::Stopped);
        bad_live.wait_zero();
        let c = TcpStream::connect(good).unwrap();
        assert_eq!(taken.recv_timeout(wait).unwrap(), c.local_addr().unwrap());
        assert!(good_end.try_recv().is_err(), "the other role still accepts");
    }
}

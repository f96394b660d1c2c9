//! Socket helpers shared by every role.

use std::io::{self, IoSlice, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Writes every byte of `bufs`, retrying short writes (std's `write_all_vectored` is unstable).
pub fn write_all_vectored(w: &mut impl Write, bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    write_all_vectored_counted(w, bufs).1
}

/// [`write_all_vectored`], also saying how many bytes went out before an error: a sender whose
/// link fails in the middle of a batch knows which of its units the peer may have whole.
pub fn write_all_vectored_counted(
    w: &mut impl Write,
    mut bufs: &mut [IoSlice<'_>],
) -> (usize, io::Result<()>) {
    IoSlice::advance_slices(&mut bufs, 0);
    let mut done = 0usize;
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => {
                return (
                    done,
                    Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "peer stopped accepting data",
                    )),
                )
            }
            Ok(n) => {
                done += n;
                IoSlice::advance_slices(&mut bufs, n)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return (done, Err(e)),
        }
    }
    (done, Ok(()))
}

/// Writes what `stream` takes of `buf` now, without waiting, even on a blocking socket: 0 when
/// its send buffer is full. For a thread that must never wait on a peer (a recorder's writer
/// telling builders what is in its file) on a socket another thread reads and writes blocking.
pub fn send_now(stream: &TcpStream, buf: &[u8]) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    loop {
        // SAFETY: `buf` is valid for `buf.len()` bytes for the call; the descriptor is open for
        // as long as `stream` is borrowed.
        let n = unsafe {
            libc::send(
                stream.as_raw_fd(),
                buf.as_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => {}
            io::ErrorKind::WouldBlock => return Ok(0),
            _ => return Err(e),
        }
    }
}

/// Sets up a data-path socket. Nagle is off: every role coalesces its own writes (whole batches
/// of fragments per write), so the kernel's coalescing would only add delay to the last segment.
/// A read timeout lets blocked readers notice a stop and check their timers.
pub fn tune(stream: &TcpStream, read_timeout: Option<Duration>) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(read_timeout)?;
    Ok(())
}

/// Connects to `addr`, trying again every 50 ms after any failure until `patience` runs out: the
/// peer role may still be starting (refused, on another host, or a restarted daemon), or its
/// host's network coming up (unreachable). (The run control's `dial` to node agents retries
/// refusals only and reports any other failure at once.)
pub fn connect_retry(addr: &str, patience: Duration) -> io::Result<TcpStream> {
    let t0 = Instant::now();
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs()?.collect();
    loop {
        let mut last = None;
        for a in &addrs {
            match TcpStream::connect_timeout(a, Duration::from_secs(2)) {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        let e = last.unwrap_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("{addr} resolves to nothing"),
            )
        });
        if t0.elapsed() >= patience {
            return Err(io::Error::new(
                e.kind(),
                format!("connecting to {addr}: {e}"),
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Connects to each of `addrs` (sources that listen, SiTCP style), retrying those that do not
/// answer every 50 ms until `stop` is raised, and hands each connection, in blocking mode, to
/// `take` with a hello under way of `hellos` (begun before the attempt, so that a stop waiting
/// for the hellos under way also waits for an attempt that may connect). Returns once every
/// address is connected, or at the stop.
pub fn dial_until(
    addrs: &[String],
    stop: &std::sync::atomic::AtomicBool,
    hellos: &Hellos,
    mut take: impl FnMut(TcpStream, SocketAddr, HelloUnderWay),
) {
    let mut pending: Vec<&String> = addrs.iter().collect();
    while !pending.is_empty() && !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let mut left = Vec::new();
        for addr in pending {
            let Ok(under_way) = hellos.begin() else {
                left.push(addr);
                continue;
            };
            let target = match addr.to_socket_addrs().map(|mut a| a.next()) {
                Ok(Some(a)) => a,
                _ => {
                    // Resolved later, perhaps: a host name that is not up yet.
                    left.push(addr);
                    continue;
                }
            };
            match TcpStream::connect_timeout(&target, Duration::from_millis(200)) {
                Ok(s) => {
                    let _ = s.set_nonblocking(false);
                    take(s, target, under_way);
                }
                Err(_) => left.push(addr),
            }
        }
        pending = left;
        if !pending.is_empty() {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Accepts one connection on `listener` (a source that listens, waiting for its readout unit),
/// from an allowed network, within `patience`.
pub fn accept_one(listener: &std::net::TcpListener, patience: Duration) -> io::Result<TcpStream> {
    listener.set_nonblocking(true)?;
    let t0 = Instant::now();
    loop {
        match listener.accept() {
            Ok((s, peer)) if peer_allowed(&peer) => {
                s.set_nonblocking(false)?;
                return Ok(s);
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if t0.elapsed() >= patience {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!(
                            "no readout unit connected to {} within {} s",
                            listener
                                .local_addr()
                                .map_or_else(|_| "?".into(), |a| a.to_string()),
                            patience.as_secs()
                        ),
                    ));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Reads exactly `buf.len()` bytes, riding over read timeouts (for handshakes).
pub fn read_exact_patient(r: &mut TcpStream, buf: &mut [u8], patience: Duration) -> io::Result<()> {
    use std::io::Read;
    let t0 = Instant::now();
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "peer closed during handshake",
                ))
            }
            Ok(n) => got += n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                if t0.elapsed() > patience {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "peer sent no handshake in time",
                    ));
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// How an [`accept_until`] loop ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcceptEnd {
    /// `missing()` said nobody else is expected.
    AllConnected,
    /// A stop was raised and the backlog held nobody else.
    Stopped,
}

/// What one look at a listener's backlog found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backlog {
    /// The loop has ended.
    Ended(AcceptEnd),
    /// Empty: wait for the next connection (or the next look at the stop).
    Drained,
    /// `accept` failed otherwise (out of descriptors, say): wait before trying again, since the
    /// listener may stay readable meanwhile.
    Failed,
}

/// Takes every connection `listener`'s backlog holds (non-blocking), handing each from an
/// allowed peer to `on_connection` in blocking mode, until `missing()` says no peer is expected
/// any more, or `stop` is raised and the backlog is empty. The stop is read before each accept,
/// so a peer that connected before the stop (and sits in the kernel's backlog) is still taken:
/// only then does accepting give up on the peers still missing. The one rule of every accept
/// loop: [`accept_until`]'s and the stages' acceptors ([`crate::acceptor`]).
pub fn accept_backlog(
    listener: &std::net::TcpListener,
    stop: &std::sync::atomic::AtomicBool,
    missing: &mut dyn FnMut() -> bool,
    on_connection: &mut dyn FnMut(TcpStream, SocketAddr),
) -> Backlog {
    loop {
        if !missing() {
            return Backlog::Ended(AcceptEnd::AllConnected);
        }
        let stopping = stop.load(std::sync::atomic::Ordering::Relaxed);
        match listener.accept() {
            Ok((stream, peer)) => {
                if !peer_allowed(&peer) {
                    continue;
                }
                let _ = stream.set_nonblocking(false);
                on_connection(stream, peer);
            }
            Err(_) if stopping => return Backlog::Ended(AcceptEnd::Stopped),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Backlog::Drained,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                return Backlog::Failed;
            }
        }
    }
}

/// Accepts connections on `listener` and hands each to `on_connection` (in blocking mode), until
/// `missing()` says no peer is expected any more, or `stop` is raised (see [`accept_backlog`]),
/// on the calling thread: for the roles a process runs one of.
pub fn accept_until(
    listener: &std::net::TcpListener,
    stop: &std::sync::atomic::AtomicBool,
    missing: impl FnMut() -> bool,
    on_connection: impl FnMut(TcpStream, SocketAddr),
) -> AcceptEnd {
    accept_until_looking(listener, stop, missing, on_connection, |_| {})
}

/// [`accept_until`], telling `empty` when each look that found no connection waiting began
/// (the accept that drained the backlog, or a wait that saw nobody come): for [`NoneWaiting`].
pub fn accept_until_looking(
    listener: &std::net::TcpListener,
    stop: &std::sync::atomic::AtomicBool,
    mut missing: impl FnMut() -> bool,
    mut on_connection: impl FnMut(TcpStream, SocketAddr),
    mut empty: impl FnMut(std::time::Instant),
) -> AcceptEnd {
    let _ = listener.set_nonblocking(true);
    loop {
        let drained_from = std::time::Instant::now();
        match accept_backlog(listener, stop, &mut missing, &mut on_connection) {
            Backlog::Ended(end) => return end,
            // A recheck with no peer come looks at the stop and at `missing()` only: an
            // `accept` on an empty backlog still makes and frees a socket file in the kernel.
            Backlog::Drained => {
                empty(drained_from);
                loop {
                    let waited_from = std::time::Instant::now();
                    if wait_for_peer(listener) || stop.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                    empty(waited_from);
                    if !missing() {
                        return AcceptEnd::AllConnected;
                    }
                }
            }
            Backlog::Failed => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// How long an accept loop waits for a connection before it looks at its stop flag again: the
/// most a stop waits for it. A connection is taken as soon as it comes.
pub const ACCEPT_RECHECK: Duration = Duration::from_millis(50);

/// Waits until `listener` has a connection to accept, or [`ACCEPT_RECHECK`] has passed; says
/// whether one may have come (readable, or the wait failed). Where a loop slept 20 ms between
/// tries instead, the 76 accept threads of a 16 x 60 trapezoid woke 3 800 times a second for the
/// whole run.
fn wait_for_peer(listener: &std::net::TcpListener) -> bool {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the listener's open descriptor; poll only writes `revents`.
    let rc = unsafe { libc::poll(&mut p, 1, ACCEPT_RECHECK.as_millis() as libc::c_int) };
    if rc < 0 {
        if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            std::thread::sleep(ACCEPT_RECHECK);
        }
        return true;
    }
    rc > 0
}

/// The listening socket handed to this process by its starter (systemd socket activation, or
/// a test harness that bound the port itself so that no other process can take it between a
/// guess and a bind): `LISTEN_FDS` ≥ 1 and, if set, `LISTEN_PID` naming this process; the socket
/// is descriptor 3 (`SD_LISTEN_FDS_START`). Taken at most once per process; `None` when nothing
/// was handed over.
pub fn inherited_listener() -> Option<io::Result<std::net::TcpListener>> {
    use std::sync::atomic::{AtomicBool, Ordering};
    static TAKEN: AtomicBool = AtomicBool::new(false);
    let n: u32 = std::env::var("LISTEN_FDS").ok()?.trim().parse().ok()?;
    if n == 0 {
        return None;
    }
    if let Ok(pid) = std::env::var("LISTEN_PID") {
        if pid.trim().parse::<u32>().ok() != Some(std::process::id()) {
            return None;
        }
    }
    if TAKEN.swap(true, Ordering::AcqRel) {
        return None;
    }
    const FIRST: i32 = 3;
    // Check that descriptor 3 is a listening TCP socket before taking ownership of it.
    let mut accepting: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `accepting`; a bad descriptor only
    // makes it fail.
    let rc = unsafe {
        libc::getsockopt(
            FIRST,
            libc::SOL_SOCKET,
            libc::SO_ACCEPTCONN,
            (&mut accepting as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if rc != 0 || accepting == 0 {
        return Some(Err(io::Error::other(
            "LISTEN_FDS is set but descriptor 3 is not a listening socket",
        )));
    }
    // SAFETY: by the socket-activation protocol descriptor 3 is this process's, open and
    // listening (checked above); it is taken once (TAKEN), so no other owner exists.
    let l = unsafe { <std::net::TcpListener as std::os::fd::FromRawFd>::from_raw_fd(FIRST) };
    Some(Ok(l))
}

/// Which peers may connect to this process's data and monitor ports: loopback always, others
/// only from the networks of `security.allow` (front-end boards cannot hold a token, so their
/// network is their credential). Set at each run's start (a node agent serves one topology after
/// another, each with its own list); unset, only loopback peers are taken.
static ALLOWED: std::sync::RwLock<Vec<ipnet::IpNet>> = std::sync::RwLock::new(Vec::new());

/// Peers refused by [`peer_allowed`] so far.
pub static REFUSED_BY_NETWORK: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Sets the networks allowed beyond loopback, in place of the ones set before.
pub fn allow_networks(nets: Vec<ipnet::IpNet>) {
    *ALLOWED.write().unwrap_or_else(|p| p.into_inner()) = nets;
}

/// Whether `ip` is loopback or in one of `nets` (an IPv4 address mapped into IPv6 as itself).
pub fn ip_in(ip: std::net::IpAddr, nets: &[ipnet::IpNet]) -> bool {
    let ip = match ip {
        std::net::IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map_or(std::net::IpAddr::V6(v6), std::net::IpAddr::V4),
        v4 => v4,
    };
    ip.is_loopback() || nets.iter().any(|n| n.contains(&ip))
}

/// Whether `peer` may connect; a refused peer is counted and logged.
pub fn peer_allowed(peer: &SocketAddr) -> bool {
    if ip_in(
        peer.ip(),
        &ALLOWED.read().unwrap_or_else(|p| p.into_inner()),
    ) {
        return true;
    }
    REFUSED_BY_NETWORK.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    tracing::warn!(%peer, "refused a connection from outside security.allow");
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;

    /// Rechecks with no peer come look only at `missing()` (and the stop): a peer that comes
    /// after several is taken, and the loop ends when no peer is expected any more.
    #[test]
    fn accept_until_takes_a_late_peer_and_ends_when_none_is_missing() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let expect_more = Arc::new(AtomicBool::new(true));
        let looked = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = std::sync::mpsc::channel();
        let (e2, l2) = (expect_more.clone(), looked.clone());
        let t = std::thread::spawn(move || {
            let stop = AtomicBool::new(false);
            accept_until(
                &l,
                &stop,
                move || {
                    l2.fetch_add(1, Ordering::SeqCst);
                    e2.load(Ordering::SeqCst)
                },
                move |s, _| {
                    let _ = tx.send(s);
                },
            )
        });
        let t0 = Instant::now();
        while looked.load(Ordering::SeqCst) < 4 {
            assert!(t0.elapsed() < Duration::from_secs(60), "no recheck");
            std::thread::yield_now();
        }
        let late = TcpStream::connect(addr).unwrap();
        let got = rx.recv_timeout(Duration::from_secs(60)).unwrap();
        assert_eq!(got.peer_addr().unwrap(), late.local_addr().unwrap());
        expect_more.store(false, Ordering::SeqCst);
        assert_eq!(t.join().unwrap(), AcceptEnd::AllConnected);
    }

    #[test]
    fn loopback_always_others_only_from_allowed_networks() {
        let p = |s: &str| s.parse::<SocketAddr>().unwrap();
        allow_networks(vec!["10.1.0.0/16".parse().unwrap()]);
        assert!(peer_allowed(&p("127.0.0.1:5000")));
        assert!(peer_allowed(&p("[::1]:5000")));
        assert!(peer_allowed(&p("10.1.7.9:5000")));
        assert!(peer_allowed(&p("[::ffff:10.1.7.9]:5000")));
        let before = REFUSED_BY_NETWORK.load(std::sync::atomic::Ordering::Relaxed);
        assert!(!peer_allowed(&p("10.2.0.1:5000")));
        assert!(!peer_allowed(&p("[2001:db8::1]:5000")));
        assert_eq!(
            REFUSED_BY_NETWORK.load(std::sync::atomic::Ordering::Relaxed),
            before + 2
        );
        // Issue 54: a node agent serves one topology after another; the second's list holds,
        // not the first's.
        allow_networks(vec!["10.2.0.0/16".parse().unwrap()]);
        assert!(peer_allowed(&p("10.2.0.1:5000")));
        assert!(!peer_allowed(&p("10.1.7.9:5000")));
        assert!(peer_allowed(&p("127.0.0.1:5000")));
    }
}

/// When a role's accepting last proved that no peer of it was on its way in: its listener found
/// with no connection waiting while none of its hellos was under way. A peer that has not
/// connected by then had sent nothing by then (its bytes would sit in an accepted socket or in
/// the backlog), so a link that never connected is silent up to that moment and no further:
/// time in which the role did not look (stalled, starved of a core) proves nothing.
#[derive(Clone, Default)]
pub struct NoneWaiting(std::sync::Arc<parking_lot::Mutex<Option<std::time::Instant>>>);

impl NoneWaiting {
    /// A look that began at `at` found no connection waiting and no hello under way.
    pub fn saw(&self, at: std::time::Instant) {
        let mut g = self.0.lock();
        *g = Some(g.map_or(at, |t| t.max(at)));
    }

    /// The latest such look, in runnable ns of `clock`; `None` before the first.
    pub fn until_ns(&self, clock: &crate::clock::Runnable) -> Option<u64> {
        let t = *self.0.lock();
        t.map(|t| clock.ns_at(t))
    }
}

/// Connections that have been accepted and not yet said their hello, each read on its own thread
/// with its own deadline. Bounded, so a flood of silent connections costs descriptors, not the
/// unit; and a stop can wait for the hellos under way before it takes the peers still missing
/// for never connected.
#[derive(Clone, Default)]
pub struct Hellos(std::sync::Arc<std::sync::atomic::AtomicUsize>);

/// One hello under way; dropping it (once the hello is read, or failed) ends it.
pub struct HelloUnderWay(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl Drop for HelloUnderWay {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

impl Hellos {
    /// Most hellos under way at once.
    pub const MAX: usize = 64;

    /// A new hello, or `Err` with the refusal's reason when too many are under way.
    pub fn begin(&self) -> Result<HelloUnderWay, String> {
        use std::sync::atomic::Ordering;
        if self.0.load(Ordering::Acquire) >= Self::MAX {
            return Err(format!(
                "{} connections are already waiting to say hello",
                Self::MAX
            ));
        }
        self.0.fetch_add(1, Ordering::AcqRel);
        Ok(HelloUnderWay(self.0.clone()))
    }

    /// Whether no hello is under way now.
    pub fn idle(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Acquire) == 0
    }

    /// Waits until no hello is under way (each has its own deadline, so this is bounded).
    pub fn wait_done(&self) {
        while self.0.load(std::sync::atomic::Ordering::Acquire) > 0 {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

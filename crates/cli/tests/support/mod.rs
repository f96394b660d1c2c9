//! Child processes with deadlines: a test never waits on a child without a limit, and a child
//! is killed when its test ends, passes or fails (a hung child must fail its test, not hang the
//! suite).

#![allow(dead_code)]

use std::io::Read;
use std::process::{Child, ChildStdout, Command, ExitStatus, Output, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long any child may take: far beyond what a healthy one needs on a loaded machine.
pub const LIMIT: Duration = Duration::from_secs(240);

/// A child process killed (SIGKILL) when dropped, unless it was waited for.
pub struct Proc {
    child: Option<Child>,
    what: String,
}

impl Proc {
    pub fn spawn(cmd: &mut Command) -> Proc {
        let what = format!("{cmd:?}");
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
        Proc {
            child: Some(child),
            what,
        }
    }

    /// A command whose stdout and stderr are captured.
    pub fn spawn_piped(cmd: &mut Command) -> Proc {
        Proc::spawn(cmd.stdout(Stdio::piped()).stderr(Stdio::piped()))
    }

    pub fn id(&self) -> u32 {
        self.child.as_ref().map_or(0, |c| c.id())
    }

    pub fn take_stdout(&mut self) -> Option<ChildStdout> {
        self.child.as_mut().and_then(|c| c.stdout.take())
    }

    pub fn take_stderr(&mut self) -> Option<std::process::ChildStderr> {
        self.child.as_mut().and_then(|c| c.stderr.take())
    }

    /// Sends `signal` (a name `kill` understands: TERM, STOP, ...).
    pub fn signal(&self, signal: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{signal}"), &self.id().to_string()])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "kill -{signal} {} failed", self.id());
    }

    /// Its exit status, if it has exited (reaped then; still killed at drop otherwise).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// SIGKILL, and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits at most `limit` for the exit; a child still running then is killed and the test
    /// fails, naming it and showing what it printed.
    pub fn finish(mut self, limit: Duration) -> Output {
        let mut child = self.child.take().expect("not yet waited for");
        let out = child.stdout.take().map(drain);
        let err = child.stderr.take().map(drain);
        let status = wait_within(&mut child, limit);
        let stdout = out
            .map(|h| h.join().unwrap_or_default())
            .unwrap_or_default();
        let stderr = err
            .map(|h| h.join().unwrap_or_default())
            .unwrap_or_default();
        let status = match status {
            Ok(s) => s,
            Err(stacks) => panic!(
                "{} did not exit within {limit:?}\nstdout: {}\nstderr: {}\nits threads then:\n{stacks}",
                self.what,
                String::from_utf8_lossy(&stdout),
                String::from_utf8_lossy(&stderr)
            ),
        };
        Output {
            status,
            stdout,
            stderr,
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

fn drain<R: Read + Send + 'static>(mut r: R) -> JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = r.read_to_end(&mut v);
        v
    })
}

/// The exit status; or, for a child that outlived `limit`, what its threads were doing (so
/// that a hang names where it waits), after which it is killed.
fn wait_within(child: &mut Child, limit: Duration) -> Result<ExitStatus, String> {
    let t = Instant::now();
    loop {
        if let Ok(Some(s)) = child.try_wait() {
            return Ok(s);
        }
        if t.elapsed() >= limit {
            let stacks = thread_stacks(child.id());
            let _ = child.kill();
            let _ = child.wait();
            return Err(stacks);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Every thread's name and backtrace (gdb, where installed), else each thread's name and the
/// kernel function it sleeps in.
fn thread_stacks(pid: u32) -> String {
    let gdb = Command::new("timeout")
        .args(["60", "gdb", "-p", &pid.to_string(), "-batch", "-nx"])
        .args(["-ex", "set pagination off", "-ex", "thread apply all bt 25"])
        .stdin(Stdio::null())
        .output();
    if let Ok(o) = gdb {
        let text = String::from_utf8_lossy(&o.stdout);
        if text.contains("Thread ") {
            return text
                .lines()
                .filter(|l| l.starts_with("Thread ") || l.starts_with('#'))
                .collect::<Vec<_>>()
                .join("\n");
        }
    }
    let mut out = String::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            let read = |f: &str| std::fs::read_to_string(t.path().join(f)).unwrap_or_default();
            out += &format!("{} in {}\n", read("comm").trim(), read("wchan").trim());
        }
    }
    out
}

/// Runs `cmd` to its end (at most [`LIMIT`]) and returns what it printed.
pub fn output(cmd: &mut Command) -> Output {
    Proc::spawn_piped(cmd.stdin(Stdio::null())).finish(LIMIT)
}

/// Polls `cond` until it holds or `limit` passes; whether it holds.
pub fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while !cond() {
        if t.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

/// Listening sockets bound by the test and handed to the children that serve them (the
/// socket-activation protocol: descriptor 3 and `LISTEN_FDS`), so that no port is guessed, freed
/// and bound again, where a test running beside this one could take it in between. The test's
/// own copy is closed once a child holds the socket ([`Ports::release`]): a copy kept open
/// would hold connections made after the child died in its backlog for ever, where the peer
/// must see them refused.
pub struct Ports {
    listeners: Vec<std::cell::RefCell<Option<std::net::TcpListener>>>,
    ports: Vec<u16>,
}

impl Ports {
    pub fn bind(n: usize) -> Ports {
        let listeners: Vec<_> = (0..n)
            .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        Ports {
            ports: listeners
                .iter()
                .map(|l| l.local_addr().unwrap().port())
                .collect(),
            listeners: listeners
                .into_iter()
                .map(|l| std::cell::RefCell::new(Some(l)))
                .collect(),
        }
    }

    pub fn port(&self, i: usize) -> u16 {
        self.ports[i]
    }

    /// Makes `cmd` start with listener `i` as its descriptor 3.
    pub fn hand_over(&self, i: usize, cmd: &mut Command) {
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        let fd = self.listeners[i]
            .borrow()
            .as_ref()
            .expect("listener already handed over and released")
            .as_raw_fd();
        cmd.env("LISTEN_FDS", "1").env_remove("LISTEN_PID");
        // SAFETY: between fork and exec only async-signal-safe calls (dup2, fcntl) are made, on
        // descriptors the parent owns.
        unsafe {
            cmd.pre_exec(move || {
                if fd == 3 {
                    // dup2 onto itself keeps close-on-exec: clear it instead.
                    if libc::fcntl(3, libc::F_SETFD, 0) == -1 {
                        return Err(std::io::Error::last_os_error());
                    }
                } else if libc::dup2(fd, 3) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }

    /// Closes the test's copy of listener `i` (after its child was started with it).
    pub fn release(&self, i: usize) {
        self.listeners[i].borrow_mut().take();
    }
}

/// A loopback port held bound but not listening, for a server that must be down at a known
/// address and then come up there (one that cannot be handed a socket, as moto cannot): until
/// [`HeldPort::release`] a connection to it is refused, as to a server that is down, and no
/// other socket can bind it (no `SO_REUSEADDR`). It is below the kernel's ephemeral range, so
/// no `bind(0)` or outgoing connection of a test beside this one lands on it between the
/// release and the server's bind.
pub struct HeldPort {
    socket: Option<socket2::Socket>,
    pub port: u16,
}

impl HeldPort {
    pub fn new() -> HeldPort {
        let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
            .unwrap_or(32768);
        const LOW: u32 = 10_000;
        assert!(ephemeral > LOW + 1000, "ephemeral ports from {ephemeral}");
        let span = ephemeral - LOW;
        let seed = std::process::id().wrapping_mul(7919)
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos();
        for k in 0..span {
            let port = (LOW + (seed.wrapping_add(k)) % span) as u16;
            // socket2 sets no SO_REUSEADDR of its own, which is what keeps the port ours.
            let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
                .expect("a TCP socket");
            let addr = std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, port));
            if socket.bind(&addr.into()).is_ok() {
                return HeldPort {
                    socket: Some(socket),
                    port,
                };
            }
        }
        panic!("no free loopback port below {ephemeral}");
    }

    /// Lets the server bind it.
    pub fn release(&mut self) {
        self.socket.take();
    }
}

/// Runs `ip ARGS` (iproute2); whether it succeeded. For tests that make their hosts as network
/// namespaces.
pub fn ip(args: &[&str]) -> bool {
    std::process::Command::new("ip")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Runs `f` on a thread that lives in network namespace `ns`: the sockets it opens are that
/// host's.
pub fn on_host<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/var/run/netns/{ns}");
    std::thread::spawn(move || {
        let fd = std::fs::File::open(&path).unwrap();
        use std::os::fd::AsRawFd;
        // SAFETY: setns on this thread only, with a namespace file descriptor held open.
        let r = unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(r, 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .unwrap()
}

/// Whether a recorder is writing a file in `dir` (a `.part` exists): data reached the disk.
pub fn has_part(dir: &std::path::Path) -> bool {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .any(|e| e.file_name().to_string_lossy().ends_with(".part"))
        })
        .unwrap_or(false)
}

/// One plain HTTP/1.1 request to `addr`: status and (de-chunked) body.
pub fn http(addr: &str, method: &str, path: &str) -> (u16, Vec<u8>) {
    let (status, _, body) = http_with_head(addr, method, path);
    (status, body)
}

/// [`http`], with the answer's head (status line and headers) as well.
pub fn http_with_head(addr: &str, method: &str, path: &str) -> (u16, String, Vec<u8>) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut r = Vec::new();
    s.read_to_end(&mut r).unwrap();
    let end = r.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&r[..end]).to_string();
    let status = head[9..12].parse().unwrap();
    let mut body = r[end + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        // De-chunk: size line, data, CRLF, until the 0 chunk.
        let (mut out, mut rest) = (Vec::new(), &body[..]);
        loop {
            let eol = rest.windows(2).position(|w| w == b"\r\n").unwrap();
            let n = usize::from_str_radix(std::str::from_utf8(&rest[..eol]).unwrap().trim(), 16)
                .unwrap();
            if n == 0 {
                break;
            }
            out.extend_from_slice(&rest[eol + 2..eol + 2 + n]);
            rest = &rest[eol + 4 + n..];
        }
        body = out;
    }
    (status, head, body)
}

/// The header of every event in the finished files of `out`.
pub fn event_headers(out: &std::path::Path) -> Vec<tessera_format::event::EventRecordHeader> {
    let mut v = Vec::new();
    for f in std::fs::read_dir(out).unwrap().flatten() {
        if !f.file_name().to_string_lossy().ends_with(".tsr") {
            continue;
        }
        let mut rd = tessera_verify::FileReader::open(&f.path()).unwrap();
        while let Some((_, raw)) = rd.next_block().unwrap() {
            v.extend(tessera_verify::events_in(raw).map(|e| e.unwrap().header));
        }
    }
    v
}

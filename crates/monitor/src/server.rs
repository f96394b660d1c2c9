//! The monitor's TCP service (`docs/monitor-protocol.md`): one connection per consumer (or per
//! control client), one thread per connection.
//!
//! The thread reads a request and answers it itself: one wake-up per request. Between requests
//! it waits in its read, where a consumer's death shows at once (a killed process's socket
//! closes) or after `consumer_timeout_ms` of silence; while a `Get` waits for events, it looks
//! at the socket every 50 ms for the same. Either way the consumer is detached and its events
//! restored.

use parking_lot::Mutex;
use serde::Deserialize;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tessera_config::StationSection;
use tessera_format::monitor::{ErrorCode, Message, Wait};

use crate::chain::{Monitor, MonitorError};
use crate::wire::{read_message, split_records, write_events, write_message};

/// Largest message a consumer may send (commands and put-back records).
pub const MAX_CLIENT_MESSAGE: usize = 256 << 20;
/// Most connections at once; more are refused (each costs a thread).
pub const MAX_CONNECTIONS: usize = 256;
/// Most events one `Get` returns, whatever the consumer asks.
pub const MAX_GET: usize = 10_000;

/// Timing of the service.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    pub heartbeat: Duration,
    pub consumer_timeout: Duration,
    /// Serve sampling stations' consumers at idle scheduling priority.
    pub sampling_idle_priority: bool,
    /// The token every command but `status` must carry (`"token": "..."`): set when the
    /// monitor listens beyond loopback, where anyone on an allowed network could otherwise
    /// attach a blocking consumer and hold the recorder.
    pub token: Option<String>,
    /// The token that creating or attaching to a blocking station needs even on loopback, where
    /// one is set: a blocking station can stop data taking, so no local process without the
    /// run control's credential may hold the run with one.
    pub hold_token: Option<String>,
}

/// Moves the calling thread to idle scheduling priority (Linux SCHED_IDLE, what `chrt --idle 0`
/// sets for a process): it runs only when a core has nothing else to do. Best effort: false
/// elsewhere, or if refused, and nothing changes.
pub fn idle_priority() -> bool {
    #[cfg(target_os = "linux")]
    {
        let p = libc::sched_param { sched_priority: 0 };
        // SAFETY: plain syscall on the calling thread (pid 0) with a valid parameter struct.
        let r = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &p) };
        if r != 0 {
            tracing::debug!("monitor: SCHED_IDLE refused; serving at normal priority");
        }
        r == 0
    }
    #[cfg(not(target_os = "linux"))]
    false
}

/// A running service. Dropping it does not stop it; call [`Server::stop`].
pub struct Server {
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    pub fn start(
        listener: TcpListener,
        monitor: Monitor,
        opts: ServerOptions,
    ) -> std::io::Result<Server> {
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("monitor-accept".into())
            .spawn(move || accept(listener, monitor, opts, &s))?;
        Ok(Server {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// Stops accepting and ends every connection (after [`Monitor::close`], their waits end).
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Conn {
    stream: TcpStream,
    woken: Arc<AtomicBool>,
}

fn accept(listener: TcpListener, monitor: Monitor, opts: ServerOptions, stop: &AtomicBool) {
    let live = Arc::new(AtomicUsize::new(0));
    let mut conns: Vec<(Conn, JoinHandle<()>)> = Vec::new();
    while !stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((s, peer)) => {
                if !tessera_net::io::peer_allowed(&peer) {
                    continue;
                }
                let _ = s.set_nonblocking(false);
                let _ = s.set_nodelay(true);
                if live.load(Ordering::Acquire) >= MAX_CONNECTIONS {
                    tracing::warn!(%peer, "monitor: too many connections, refused");
                    let mut s = s;
                    let _ = write_message(
                        &mut s,
                        &Message::Error {
                            code: ErrorCode::BadRequest,
                            message: format!("more than {MAX_CONNECTIONS} connections"),
                        },
                    );
                    continue;
                }
                let Ok(keep) = s.try_clone() else { continue };
                let woken = Arc::new(AtomicBool::new(false));
                let (m, w, l, o) = (monitor.clone(), woken.clone(), live.clone(), opts.clone());
                l.fetch_add(1, Ordering::AcqRel);
                let h = std::thread::Builder::new()
                    .name(format!("monitor-{peer}"))
                    .spawn(move || {
                        serve(s, peer, m, o, w);
                        l.fetch_sub(1, Ordering::AcqRel);
                    });
                match h {
                    Ok(h) => conns.push((
                        Conn {
                            stream: keep,
                            woken,
                        },
                        h,
                    )),
                    Err(_) => {
                        live.fetch_sub(1, Ordering::AcqRel);
                    }
                }
                conns.retain(|(_, h)| !h.is_finished());
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
                conns.retain(|(_, h)| !h.is_finished());
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    for (c, _) in &conns {
        c.woken.store(true, Ordering::Release);
        let _ = c.stream.shutdown(std::net::Shutdown::Both);
    }
    for (_, h) in conns {
        let _ = h.join();
    }
}

/// A JSON command of the protocol.
#[derive(Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
enum Command {
    Attach {
        station: String,
        #[serde(default)]
        consumer: String,
        /// Create the station first if it does not exist.
        #[serde(default)]
        create: Option<StationSection>,
    },
    // A struct variant: `deny_unknown_fields` refuses `{"op": "status", "x": 1}` as it does
    // for every other command (a unit variant would ignore the extra field).
    Status {},
    /// A fresh nonce for this connection, over which the commands after it prove the token.
    Challenge {},
    Create {
        station: StationSection,
    },
    Set {
        station: StationSection,
    },
    Remove {
        station: String,
    },
}

/// What a consumer's proof of the token is taken over, before the connection's nonce
/// (`tessera_format::auth::proof`; the second nonce is empty).
pub const MONITOR_PROOF: &str = "tessera monitor protocol 1: consumer";

/// The tokens a command is checked against: every command but `status` (a monitor beyond
/// loopback), and those that can hold the run (a blocking station, wherever a token is set).
struct Tokens<'a> {
    all: Option<&'a str>,
    hold: Option<&'a str>,
}

/// Whether a command makes or joins a blocking station: one whose consumer can hold the run.
fn holds_the_run(cmd: &Command, monitor: &Monitor) -> bool {
    let blocking = |s: &StationSection| s.mode == tessera_config::StationMode::Blocking;
    match cmd {
        Command::Attach {
            station, create, ..
        } => monitor
            .status()
            .stations
            .iter()
            .find(|s| &s.config.name == station)
            .map(|s| blocking(&s.config))
            .or_else(|| create.as_ref().map(blocking))
            .unwrap_or(false),
        Command::Create { station } | Command::Set { station } => blocking(station),
        Command::Status {} | Command::Challenge {} | Command::Remove { .. } => false,
    }
}

fn serve(
    mut stream: TcpStream,
    peer: SocketAddr,
    monitor: Monitor,
    opts: ServerOptions,
    woken: Arc<AtomicBool>,
) {
    let _ = stream.set_read_timeout(Some(opts.consumer_timeout));
    if write_message(
        &mut stream,
        &Message::Welcome {
            instance: monitor.instance(),
            heartbeat_ms: opts.heartbeat.as_millis().min(u32::MAX as u128) as u32,
        },
    )
    .is_err()
    {
        return;
    }
    let consumer: Mutex<Option<u64>> = Mutex::new(None);
    let why = work(&stream, peer, &monitor, &opts, &consumer, &woken);
    woken.store(true, Ordering::Release);
    let _ = stream.shutdown(std::net::Shutdown::Both);
    let attached = consumer.lock().take();
    if let Some(id) = attached {
        monitor.detach(id);
        if let Some(why) = why {
            tracing::info!(%peer, %why, "monitor consumer gone");
        }
    }
}

/// Why a connection ended, from what reading it said: closed, broke the protocol (then `true`:
/// it is told why) or fell silent.
fn gone(e: &std::io::Error) -> (String, bool) {
    let broke_protocol = e.kind() == std::io::ErrorKind::InvalidData;
    let why = match e.kind() {
        std::io::ErrorKind::UnexpectedEof => "closed".to_string(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            "silent for longer than the consumer timeout".to_string()
        }
        _ => e.to_string(),
    };
    (why, broke_protocol)
}

fn error_message(e: &MonitorError) -> Message {
    Message::Error {
        code: e.code(),
        message: e.to_string(),
    }
}

/// Reads and answers the connection's messages in turn, on the connection's one thread: a
/// request is answered by the thread that read it (one wake-up per request, not a hand-off
/// between a reader and a worker). Returns why the peer went, when it did.
fn work(
    out: &TcpStream,
    peer: SocketAddr,
    monitor: &Monitor,
    opts: &ServerOptions,
    consumer: &Mutex<Option<u64>>,
    woken: &AtomicBool,
) -> Option<String> {
    let mut name = String::new();
    // The nonce of this connection's last challenge: what the token's proofs are taken over.
    let mut nonce: Option<String> = None;
    // Buffered: a consumer's put and its next get usually arrive together and are taken in
    // one read, and a small message is not two reads (header, then the rest).
    let mut reader = std::io::BufReader::with_capacity(READ_BUFFER, out);
    let mut out = out;
    loop {
        let (message, data) = match read_message(&mut reader, MAX_CLIENT_MESSAGE) {
            Ok(r) => (r.message, r.data),
            Err(e) => {
                let (why, broke_protocol) = gone(&e);
                // A consumer that broke the protocol (a bad value, a size that disagrees) hears
                // why before the connection closes: an error, code 1 (bad request).
                if broke_protocol {
                    let _ = write_message(
                        &mut out,
                        &Message::Error {
                            code: ErrorCode::BadRequest,
                            message: format!("protocol error, closing: {why}"),
                        },
                    );
                }
                return (!name.is_empty()).then_some(why);
            }
        };
        if woken.load(Ordering::Acquire) {
            return None;
        }
        let reply = match message {
            Message::Command { json } => {
                let reply = command(
                    monitor,
                    consumer,
                    &json,
                    peer,
                    &mut name,
                    Tokens {
                        all: opts.token.as_deref(),
                        hold: opts.hold_token.as_deref(),
                    },
                    &mut nonce,
                );
                let attached = consumer.lock().and_then(|id| monitor.station_of(id));
                if opts.sampling_idle_priority
                    && attached.is_some_and(|s| s.mode == tessera_config::StationMode::Sampling)
                {
                    idle_priority();
                }
                reply
            }
            Message::Get { max, wait } => {
                let Some(id) = *consumer.lock() else {
                    if write_message(&mut out, &not_attached()).is_err() {
                        return None;
                    }
                    continue;
                };
                match get(out, monitor, id, max as usize, wait, opts, woken) {
                    Ok(()) => continue,
                    Err(Gone::Refused(e)) => error_message(&e),
                    Err(Gone::Peer(why)) => return (!name.is_empty()).then_some(why),
                    Err(Gone::Woken) => return None,
                }
            }
            Message::Put { entries } => {
                let Some(id) = *consumer.lock() else {
                    if write_message(&mut out, &not_attached()).is_err() {
                        return None;
                    }
                    continue;
                };
                let records = split_records(&entries, &data);
                let events = entries
                    .iter()
                    .zip(records)
                    .map(|(e, r)| (e.seq, (e.len > 0).then_some(r)))
                    .collect();
                // A put has no answer unless it is refused: the refusal comes before the answer
                // to the consumer's next request.
                match monitor.put(id, events) {
                    Ok(()) => continue,
                    Err(e) => error_message(&e),
                }
            }
            Message::Heartbeat { .. } => continue,
            Message::Bye => {
                if let Some(id) = consumer.lock().take() {
                    monitor.detach(id);
                }
                return None;
            }
            other => Message::Error {
                code: ErrorCode::BadRequest,
                message: format!("a consumer does not send {}", kind_name(&other)),
            },
        };
        if write_message(&mut out, &reply).is_err() {
            return None;
        }
    }
}

fn not_attached() -> Message {
    Message::Error {
        code: ErrorCode::NotAttached,
        message: "attach to a station first".into(),
    }
}

fn kind_name(m: &Message) -> &'static str {
    match m {
        Message::Welcome { .. } => "welcome",
        Message::Command { .. } => "command",
        Message::Reply { .. } => "reply",
        Message::Error { .. } => "error",
        Message::Get { .. } => "get",
        Message::Events { .. } => "events",
        Message::Put { .. } => "put",
        Message::Heartbeat { .. } => "heartbeat",
        Message::Bye => "bye",
    }
}

/// How a `Get` ended other than with its answer written.
enum Gone {
    /// The monitor refused it: the consumer is told.
    Refused(MonitorError),
    /// The consumer went while it waited (closed, or silent past the timeout).
    Peer(String),
    /// The service is stopping, or the connection could not be written.
    Woken,
}

/// Read buffer per connection: requests are small; a put of replaced records larger than this
/// is read past the buffer, straight into its message.
const READ_BUFFER: usize = 64 << 10;

/// While a `Get` waits, how often its thread looks at the consumer's socket: a consumer that
/// dies while it waits has its events restored this soon, not at the end of the wait.
const PEER_CHECK: Duration = Duration::from_millis(50);

/// Answers a `Get`. While it waits for events it beats to the consumer every heartbeat, so a
/// consumer waiting for rare events can tell a quiet monitor from a dead one, and it looks at
/// the consumer's socket every [`PEER_CHECK`]: closed is gone; nothing arriving (not even the
/// consumer's heartbeats) for the consumer timeout is silent. What arrives meanwhile is left
/// in the socket, read after the answer.
fn get(
    mut out: &TcpStream,
    monitor: &Monitor,
    id: u64,
    max: usize,
    wait: Wait,
    opts: &ServerOptions,
    woken: &AtomicBool,
) -> Result<(), Gone> {
    let max = max.clamp(1, MAX_GET);
    let beat = opts.heartbeat.max(Duration::from_millis(1));
    let deadline = match wait {
        Wait::Timed(ms) => Some(Instant::now() + Duration::from_millis(ms as u64)),
        _ => None,
    };
    let mut last_beat = Instant::now();
    let mut heard = (Instant::now(), 0u64);
    loop {
        let slice = match (wait, deadline) {
            (Wait::Poll, _) => Wait::Poll,
            (_, Some(d)) => {
                let left = d.saturating_duration_since(Instant::now());
                Wait::Timed(left.min(PEER_CHECK).as_millis() as u32)
            }
            _ => Wait::Timed(PEER_CHECK.as_millis() as u32),
        };
        let events = match monitor.get(id, max, slice, woken) {
            Ok(ev) => ev,
            Err(MonitorError::Woken) => return Err(Gone::Woken),
            Err(e) => return Err(Gone::Refused(e)),
        };
        let finished = !events.is_empty()
            || wait == Wait::Poll
            || deadline.is_some_and(|d| Instant::now() >= d);
        if finished {
            return write_events(&mut out, &events).map_err(|_| Gone::Woken);
        }
        if let Some(why) = peer_gone(out, &mut heard, opts.consumer_timeout) {
            return Err(Gone::Peer(why));
        }
        if last_beat.elapsed() >= beat {
            last_beat = Instant::now();
            write_message(
                &mut out,
                &Message::Heartbeat {
                    instance: monitor.instance(),
                },
            )
            .map_err(|_| Gone::Woken)?;
        }
    }
}

/// Whether the consumer at the other end of `s` is gone: its socket closed, or nothing new
/// arrived from it (`heard`: when the bytes waiting unread last changed, and how many) for
/// `timeout`.
fn peer_gone(s: &TcpStream, heard: &mut (Instant, u64), timeout: Duration) -> Option<String> {
    use tessera_net::queued::{queued, Side};
    let _ = s.set_nonblocking(true);
    let mut b = [0u8; 1];
    let peeked = s.peek(&mut b);
    let _ = s.set_nonblocking(false);
    match peeked {
        Ok(0) => return Some("closed".into()),
        Err(e) if e.kind() != std::io::ErrorKind::WouldBlock => return Some(e.to_string()),
        _ => {}
    }
    let unread = queued(std::os::fd::AsRawFd::as_raw_fd(s), Side::Unread).unwrap_or(0);
    if unread != heard.1 {
        *heard = (Instant::now(), unread);
    } else if heard.0.elapsed() >= timeout {
        return Some("silent for longer than the consumer timeout".into());
    }
    None
}

fn command(
    monitor: &Monitor,
    consumer: &Mutex<Option<u64>>,
    json: &[u8],
    peer: SocketAddr,
    name: &mut String,
    tokens: Tokens<'_>,
    nonce: &mut Option<String>,
) -> Message {
    let token = tokens.all;
    let mut value: serde_json::Value = match serde_json::from_slice(json) {
        Ok(v) => v,
        Err(e) => {
            return Message::Error {
                code: ErrorCode::BadRequest,
                message: format!("command: {e}"),
            }
        }
    };
    // The token never crosses the connection: a command proves it over this connection's
    // nonce (`challenge`), so a captured command proves nothing on another connection.
    if value.get("token").is_some() {
        tracing::warn!(%peer, "monitor refused a command carrying the token itself");
        return Message::Error {
            code: ErrorCode::Refused,
            message: "the token is never sent: ask for a challenge and send its proof (docs/monitor-protocol.md §5)".into(),
        };
    }
    let given = value
        .as_object_mut()
        .and_then(|o| o.remove("proof"))
        .and_then(|t| t.as_str().map(str::to_owned));
    let proven = |want: &str| -> bool {
        match (nonce.as_deref(), given.as_deref()) {
            (Some(n), Some(p)) => tessera_format::auth::proof_holds(want, MONITOR_PROOF, n, "", p),
            _ => false,
        }
    };
    if let Some(want) = token {
        let op = value.get("op").and_then(|o| o.as_str());
        let reads_only = matches!(op, Some("status") | Some("challenge"));
        if !reads_only && !proven(want) {
            tracing::warn!(%peer, op = ?value.get("op"), "monitor refused a command: no proof of the token, or a wrong one");
            return Message::Error {
                code: ErrorCode::Refused,
                message: "this monitor listens beyond loopback: commands other than status and challenge need a proof of the run control's token (\"proof\", docs/monitor-protocol.md §5)".into(),
            };
        }
    }
    let cmd: Command = match serde_json::from_value(value) {
        Ok(c) => c,
        Err(e) => {
            return Message::Error {
                code: ErrorCode::BadRequest,
                message: format!("command: {e}"),
            }
        }
    };
    if let Some(want) = tokens.hold {
        if holds_the_run(&cmd, monitor) && !proven(want) {
            tracing::warn!(%peer, "monitor refused a blocking station: no proof of the token, or a wrong one");
            return Message::Error {
                code: ErrorCode::Refused,
                message: "a blocking station can hold the run: creating or attaching to one needs a proof of the run control's token (\"proof\", docs/monitor-protocol.md §5)".into(),
            };
        }
    }
    let ok = |v: serde_json::Value| Message::Reply {
        json: serde_json::to_vec(&v).expect("JSON values serialise"),
    };
    let result = match cmd {
        Command::Attach {
            station,
            consumer: cname,
            create,
        } => {
            if consumer.lock().is_some() {
                return Message::Error {
                    code: ErrorCode::BadRequest,
                    message: "already attached: one station per connection".into(),
                };
            }
            if let Some(c) = create {
                if c.name != station {
                    return Message::Error {
                        code: ErrorCode::BadRequest,
                        message: format!("create names {:?}, attach names {station:?}", c.name),
                    };
                }
                let exists = monitor
                    .status()
                    .stations
                    .iter()
                    .any(|s| s.config.name == station);
                if !exists {
                    if let Err(e) = monitor.create_station(c) {
                        return error_message(&e);
                    }
                }
            }
            let cname = if cname.is_empty() {
                peer.to_string()
            } else {
                cname
            };
            monitor.attach_id(&station, &cname).map(|id| {
                *consumer.lock() = Some(id);
                *name = cname;
                tracing::info!(%peer, consumer = %name, %station, "monitor consumer attached");
                let cfg = monitor.station_of(id);
                serde_json::json!({ "consumer_id": id, "station": cfg })
            })
        }
        Command::Status {} => {
            Ok(serde_json::to_value(monitor.status()).expect("status serialises"))
        }
        Command::Challenge {} => {
            let b: [u8; 16] = rand::random();
            let n: String = b.iter().map(|x| format!("{x:02x}")).collect();
            *nonce = Some(n.clone());
            Ok(serde_json::json!({ "nonce": n }))
        }
        Command::Create { station } => {
            tracing::info!(%peer, station = %station.name, "monitor station created");
            monitor
                .create_station(station)
                .map(|()| serde_json::json!({ "ok": true }))
        }
        Command::Set { station } => {
            tracing::info!(%peer, station = %station.name, "monitor station changed");
            monitor
                .set_station(station)
                .map(|()| serde_json::json!({ "ok": true }))
        }
        Command::Remove { station } => {
            tracing::info!(%peer, %station, "monitor station removed");
            monitor
                .remove_station(&station)
                .map(|()| serde_json::json!({ "ok": true }))
        }
    };
    match result {
        Ok(v) => ok(v),
        Err(e) => error_message(&e),
    }
}

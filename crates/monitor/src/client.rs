//! The consumer side of the monitor protocol, for Rust programs, `tessera monitor` and the
//! Python package.
//!
//! A [`Consumer`] beats to the monitor from a thread of its own (so a consumer busy with an event
//! is not taken for dead), notices a monitor that went away (closed connection, or no heartbeat
//! while it waits) and, with `reattach`, connects and attaches again by itself: an event display
//! can be left running across restarts of the system. Events received from an earlier connection
//! cannot be put back into the new one; such puts are dropped (the old system's events are gone).

use bytes::Bytes;
use parking_lot::Mutex;
use std::io::BufReader;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tessera_config::{StationMode, StationSection};
use tessera_format::monitor::{encode_put_header, Entry, ErrorCode, Message, Wait};

use crate::wire::{read_message, split_records, write_message};

/// Largest message a consumer accepts (a batch of events).
pub const MAX_EVENTS_MESSAGE: usize = 1 << 30;

/// Why a consumer call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach the monitor at {addr}: {source}")]
    Unreachable {
        addr: String,
        source: std::io::Error,
    },
    #[error("connection to the monitor: {0}")]
    Io(#[from] std::io::Error),
    #[error("monitor protocol: {0}")]
    Protocol(String),
    #[error("the monitor refused ({code:?}): {message}")]
    Refused { code: ErrorCode, message: String },
}

/// How to attach.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// `host:port` of the monitor.
    pub addr: String,
    pub station: String,
    /// Shown in the monitor's status.
    pub consumer: String,
    /// Create the station with these settings if it does not exist.
    pub create: Option<StationSection>,
    /// Connect and attach again after the connection breaks (a restarted system).
    pub reattach: bool,
    /// How long one connection attempt may take.
    pub connect_timeout: Duration,
    /// The run control's token, which a monitor bound beyond loopback asks for in every
    /// command but `status`. Default: the environment variable `TESSERA_TOKEN`.
    pub token: Option<String>,
}

/// The token from `TESSERA_TOKEN`, if set and not empty.
fn env_token() -> Option<String> {
    std::env::var("TESSERA_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
}

impl ClientOptions {
    pub fn new(addr: &str, station: &str) -> ClientOptions {
        ClientOptions {
            addr: addr.into(),
            station: station.into(),
            consumer: format!("pid{}", std::process::id()),
            create: None,
            reattach: true,
            connect_timeout: Duration::from_secs(2),
            token: env_token(),
        }
    }
}

/// An event received from the monitor.
#[derive(Clone, Debug)]
pub struct ReceivedEvent {
    pub seq: u64,
    /// The whole event record: a slice of the message it came in (no copy per event).
    pub record: Bytes,
    /// Which connection it came on (puts of events from an earlier one are dropped).
    pub connection: u64,
}

/// The consumer's side of the socket for writing, with the puts not sent yet.
struct Outgoing {
    stream: TcpStream,
    /// Puts wait here for the consumer's next request and go in the same write, so the monitor
    /// reads both at once and wakes once (one event per call is a round trip, not two
    /// messages chasing each other). The heartbeat thread sends what waits longer than
    /// [`PUT_DELAY`].
    puts: Vec<u8>,
}

/// Longest a put waits for the consumer's next request before it is sent alone.
pub const PUT_DELAY: Duration = Duration::from_millis(20);

/// Puts that would wait with more than this many bytes (replaced records) are sent at once.
const PUTS_HELD: usize = 64 << 10;

impl Outgoing {
    /// Sends the waiting puts followed by `then` (encoded), in one write.
    fn send(&mut self, then: &[u8]) -> std::io::Result<()> {
        use std::io::Write;
        if self.puts.is_empty() {
            return self.stream.write_all(then);
        }
        self.puts.extend_from_slice(then);
        let r = self.stream.write_all(&self.puts);
        self.puts.clear();
        r
    }
}

struct Conn {
    /// Buffered: an answer's header and a small batch come in one read, not two.
    reader: BufReader<TcpStream>,
    writer: Arc<Mutex<Outgoing>>,
    beat_stop: Arc<AtomicBool>,
    beat: Option<JoinHandle<()>>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.beat_stop.store(true, Ordering::Release);
        let _ = self.reader.get_ref().shutdown(std::net::Shutdown::Both);
        if let Some(b) = self.beat.take() {
            let _ = b.join();
        }
    }
}

/// A consumer attached to a station over TCP.
pub struct Consumer {
    opts: ClientOptions,
    conn: Option<Conn>,
    connection: u64,
    /// The monitor's instance on the current (or last) connection.
    pub instance: u64,
    /// Times this consumer attached again after a break; `restarts` of those found a new
    /// instance of the monitor.
    pub reattaches: u64,
    pub restarts: u64,
    /// The monitor's heartbeat period.
    pub heartbeat: Duration,
    /// The attached station's settings, as the monitor reported them.
    pub station: Option<StationSection>,
    /// Puts the monitor refused (the last reason in `last_put_error`).
    pub refused_puts: u64,
    pub last_put_error: Option<String>,
    /// Puts of events from an earlier connection, dropped.
    pub stale_puts: u64,
}

fn connect(addr: &str, timeout: Duration) -> Result<(TcpStream, u64, Duration), ClientError> {
    use std::net::ToSocketAddrs;
    let unreachable = |source| ClientError::Unreachable {
        addr: addr.into(),
        source,
    };
    let addrs: Vec<_> = addr.to_socket_addrs().map_err(unreachable)?.collect();
    let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
    for a in addrs {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(mut s) => {
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(timeout))?;
                return match read_message(&mut s, 1 << 16)?.message {
                    Message::Welcome {
                        instance,
                        heartbeat_ms,
                    } => Ok((
                        s,
                        instance,
                        Duration::from_millis(heartbeat_ms.max(1) as u64),
                    )),
                    Message::Error { code, message } => Err(ClientError::Refused { code, message }),
                    other => Err(ClientError::Protocol(format!(
                        "expected a welcome, got {other:?}"
                    ))),
                };
            }
            Err(e) => last = e,
        }
    }
    Err(unreachable(last))
}

/// Reads the answer to a request, skipping heartbeats.
fn answer(s: &mut impl std::io::Read) -> Result<(Message, Bytes), ClientError> {
    loop {
        let r = read_message(s, MAX_EVENTS_MESSAGE)?;
        if !matches!(r.message, Message::Heartbeat { .. }) {
            return Ok((r.message, r.data));
        }
    }
}

/// The proof of `token` for this connection: asks the monitor for a challenge and proves the
/// token over its nonce (docs/monitor-protocol.md §5); the token itself never crosses.
fn prove(s: &mut TcpStream, token: &str) -> Result<String, ClientError> {
    write_message(
        s,
        &Message::Command {
            json: br#"{"op":"challenge"}"#.to_vec(),
        },
    )?;
    match answer(s)?.0 {
        Message::Reply { json } => {
            let v: serde_json::Value =
                serde_json::from_slice(&json).map_err(|e| ClientError::Protocol(e.to_string()))?;
            let nonce = v["nonce"].as_str().ok_or_else(|| {
                ClientError::Protocol(format!("a challenge without a nonce: {v}"))
            })?;
            Ok(tessera_format::auth::proof(
                token,
                crate::server::MONITOR_PROOF,
                nonce,
                "",
            ))
        }
        Message::Error { code, message } => Err(ClientError::Refused { code, message }),
        other => Err(ClientError::Protocol(format!("unexpected {other:?}"))),
    }
}

/// Sends one JSON command on a fresh connection and returns the monitor's JSON answer
/// (`status`, `create`, `set`, `remove`; see `docs/monitor-protocol.md`).
pub fn command(
    addr: &str,
    cmd: &serde_json::Value,
    timeout: Duration,
) -> Result<serde_json::Value, ClientError> {
    let (mut s, _, _) = connect(addr, timeout)?;
    let mut cmd = cmd.clone();
    if let Some(t) = env_token() {
        let proof = prove(&mut s, &t)?;
        if let Some(o) = cmd.as_object_mut() {
            o.entry("proof").or_insert(proof.into());
        }
    }
    write_message(
        &mut s,
        &Message::Command {
            json: serde_json::to_vec(&cmd).expect("JSON values serialise"),
        },
    )?;
    let r = answer(&mut s)?;
    let _ = write_message(&mut s, &Message::Bye);
    match r.0 {
        Message::Reply { json } => {
            serde_json::from_slice(&json).map_err(|e| ClientError::Protocol(e.to_string()))
        }
        Message::Error { code, message } => Err(ClientError::Refused { code, message }),
        other => Err(ClientError::Protocol(format!("unexpected {other:?}"))),
    }
}

impl Consumer {
    /// Connects and attaches; fails if the monitor cannot be reached now (reattaching applies to
    /// breaks after that).
    pub fn attach(opts: ClientOptions) -> Result<Consumer, ClientError> {
        let mut c = Consumer {
            opts,
            conn: None,
            connection: 0,
            instance: 0,
            reattaches: 0,
            restarts: 0,
            heartbeat: Duration::from_secs(1),
            station: None,
            refused_puts: 0,
            last_put_error: None,
            stale_puts: 0,
        };
        c.open()?;
        Ok(c)
    }

    /// Whether the consumer is connected now.
    pub fn connected(&self) -> bool {
        self.conn.is_some()
    }

    fn open(&mut self) -> Result<(), ClientError> {
        let (mut s, instance, heartbeat) = connect(&self.opts.addr, self.opts.connect_timeout)?;
        let mut cmd = serde_json::json!({
            "op": "attach",
            "station": self.opts.station,
            "consumer": self.opts.consumer,
            "create": self.opts.create,
        });
        if let Some(t) = &self.opts.token {
            cmd["proof"] = prove(&mut s, t)?.into();
        }
        write_message(
            &mut s,
            &Message::Command {
                json: serde_json::to_vec(&cmd).expect("JSON values serialise"),
            },
        )?;
        match answer(&mut s)?.0 {
            Message::Reply { json } => {
                let v: serde_json::Value = serde_json::from_slice(&json)
                    .map_err(|e| ClientError::Protocol(e.to_string()))?;
                self.station = serde_json::from_value(v["station"].clone()).ok();
            }
            Message::Error { code, message } => return Err(ClientError::Refused { code, message }),
            other => return Err(ClientError::Protocol(format!("unexpected {other:?}"))),
        }
        // Silence for three beats while we wait for an answer means the monitor is gone.
        s.set_read_timeout(Some(heartbeat * 3))?;
        let writer = Arc::new(Mutex::new(Outgoing {
            stream: s.try_clone()?,
            puts: Vec::new(),
        }));
        let beat_stop = Arc::new(AtomicBool::new(false));
        let beat = {
            let (w, stop) = (writer.clone(), beat_stop.clone());
            std::thread::Builder::new()
                .name("monitor-heartbeat".into())
                .spawn(move || {
                    let msg = Message::Heartbeat { instance: 0 }.encode();
                    let step = PUT_DELAY.min(heartbeat);
                    let mut last = Instant::now();
                    while !stop.load(Ordering::Acquire) {
                        std::thread::sleep(step);
                        if last.elapsed() >= heartbeat {
                            last = Instant::now();
                            if w.lock().send(&msg).is_err() {
                                return;
                            }
                        } else {
                            let mut w = w.lock();
                            if !w.puts.is_empty() && w.send(&[]).is_err() {
                                return;
                            }
                        }
                    }
                })?
        };
        if self.instance != 0 {
            self.reattaches += 1;
            if self.instance != instance {
                self.restarts += 1;
            }
        }
        self.instance = instance;
        self.heartbeat = heartbeat;
        self.connection += 1;
        self.conn = Some(Conn {
            // Nothing can be waiting unread: every message so far was read to its end.
            reader: BufReader::with_capacity(64 << 10, s),
            writer,
            beat_stop,
            beat: Some(beat),
        });
        Ok(())
    }

    /// Reconnects after a break, until `deadline` (none: forever).
    fn reopen(&mut self, deadline: Option<Instant>) -> Result<bool, ClientError> {
        loop {
            match self.open() {
                Ok(()) => return Ok(true),
                Err(e) => {
                    if !self.opts.reattach {
                        return Err(e);
                    }
                    if let ClientError::Refused { code, .. } = &e {
                        if *code != ErrorCode::Closed && *code != ErrorCode::UnknownStation {
                            return Err(e);
                        }
                    }
                }
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Up to `max` events, waiting as `wait` says. An empty answer: the wait ended without
    /// events (or, reattaching, the monitor was not back in time).
    pub fn get(&mut self, max: u32, wait: Wait) -> Result<Vec<ReceivedEvent>, ClientError> {
        let deadline = match wait {
            Wait::Sleep => None,
            Wait::Poll => Some(Instant::now()),
            Wait::Timed(ms) => Some(Instant::now() + Duration::from_millis(ms as u64)),
        };
        loop {
            if self.conn.is_none() && !self.reopen(deadline)? {
                return Ok(Vec::new());
            }
            match self.get_once(max, wait, deadline) {
                Ok(v) => return Ok(v),
                Err(e) => {
                    self.conn = None;
                    let gone = matches!(e, ClientError::Io(_))
                        || matches!(&e, ClientError::Refused { code, .. }
                            if matches!(code, ErrorCode::Closed | ErrorCode::NotAttached));
                    if !(self.opts.reattach && gone) {
                        return Err(e);
                    }
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Ok(Vec::new());
                    }
                }
            }
        }
    }

    fn get_once(
        &mut self,
        max: u32,
        wait: Wait,
        deadline: Option<Instant>,
    ) -> Result<Vec<ReceivedEvent>, ClientError> {
        let wait = match (wait, deadline) {
            (Wait::Timed(_), Some(d)) => {
                Wait::Timed(d.saturating_duration_since(Instant::now()).as_millis() as u32)
            }
            (w, _) => w,
        };
        let connection = self.connection;
        let conn = self.conn.as_mut().expect("connected");
        conn.writer
            .lock()
            .send(&Message::Get { max, wait }.encode())?;
        loop {
            let (m, data) = answer(&mut conn.reader)?;
            match m {
                Message::Events { entries } => {
                    let records = split_records(&entries, &data);
                    return Ok(entries
                        .iter()
                        .zip(records)
                        .map(|(e, record)| ReceivedEvent {
                            seq: e.seq,
                            record,
                            connection,
                        })
                        .collect());
                }
                Message::Error {
                    code: ErrorCode::NotHeld | ErrorCode::BadRequest,
                    message,
                } => {
                    // The refusal of an earlier put (puts have no answer otherwise).
                    self.refused_puts += 1;
                    self.last_put_error = Some(message);
                }
                Message::Error { code, message } => {
                    return Err(ClientError::Refused { code, message })
                }
                other => return Err(ClientError::Protocol(format!("unexpected {other:?}"))),
            }
        }
    }

    /// Puts events back (needed at a blocking station, where an event moves on only once put;
    /// at a sampling station there is nothing to put and this sends nothing). The put travels
    /// with the consumer's next request (get or close), or alone [`PUT_DELAY`] later at most.
    pub fn put(&mut self, events: &[ReceivedEvent]) -> Result<(), ClientError> {
        self.put_with(events.iter().map(|e| (e, None)))
    }

    /// Puts events back, some with a new record (a processing station's output).
    pub fn put_with<'a>(
        &mut self,
        events: impl IntoIterator<Item = (&'a ReceivedEvent, Option<&'a [u8]>)>,
    ) -> Result<(), ClientError> {
        if self
            .station
            .as_ref()
            .is_some_and(|s| s.mode == StationMode::Sampling)
        {
            return Ok(());
        }
        let mut entries = Vec::new();
        let mut data: Vec<&[u8]> = Vec::new();
        for (e, rep) in events {
            if e.connection != self.connection {
                self.stale_puts += 1;
                continue;
            }
            entries.push(Entry {
                seq: e.seq,
                len: rep.map_or(0, |r| r.len() as u32),
            });
            if let Some(r) = rep {
                data.push(r);
            }
        }
        if entries.is_empty() {
            return Ok(());
        }
        let Some(conn) = self.conn.as_mut() else {
            self.stale_puts += entries.len() as u64;
            return Ok(());
        };
        let mut w = conn.writer.lock();
        encode_put_header(&mut w.puts, &entries);
        let replaced: usize = data.iter().map(|d| d.len()).sum();
        let r = if w.puts.len() + replaced <= PUTS_HELD {
            for d in data {
                w.puts.extend_from_slice(d);
            }
            Ok(())
        } else {
            // Large replaced records go out now from the caller's buffers, not copied into
            // the waiting puts first.
            let Outgoing { stream, puts } = &mut *w;
            let mut slices: Vec<std::io::IoSlice<'_>> = vec![std::io::IoSlice::new(puts)];
            slices.extend(data.iter().map(|d| std::io::IoSlice::new(d)));
            let r = tessera_net::io::write_all_vectored(stream, &mut slices);
            puts.clear();
            r
        };
        drop(w);
        if let Err(e) = r {
            self.conn = None;
            if !self.opts.reattach {
                return Err(e.into());
            }
        }
        Ok(())
    }

    /// Detaches cleanly.
    pub fn close(&mut self) {
        if let Some(c) = self.conn.take() {
            let _ = c.writer.lock().send(&Message::Bye.encode());
        }
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        self.close();
    }
}

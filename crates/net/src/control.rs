//! Connections of the request protocol (`docs/request-protocol.md`): a reader that decodes
//! messages from a socket, and a writer thread that drains a bounded queue of messages,
//! coalescing whatever is queued into one write.

use crossbeam_channel::Receiver;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tessera_format::request::{decode, Channel, Decoded, Message, Role};

/// Reads request-protocol messages from one connection (control messages: small ones; answers
/// are read with a [`crate::ChunkReader`] for zero-copy slices).
pub struct MessageReader {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    max_message: usize,
}

/// Why [`MessageReader::next`] returned no message.
#[derive(Debug)]
pub enum ReadEnd {
    /// The peer closed the connection at a message boundary.
    Closed,
    /// The stop flag was raised while waiting.
    Stopped,
    /// A protocol error, a read error, or a close inside a message.
    Failed(String),
}

impl MessageReader {
    pub fn new(max_message: usize) -> MessageReader {
        MessageReader {
            buf: vec![0; 64 << 10],
            start: 0,
            end: 0,
            max_message,
        }
    }

    /// The next message. Read timeouts on the socket are ridden over, checking `stop` each time.
    pub fn next(&mut self, stream: &mut TcpStream, stop: &AtomicBool) -> Result<Message, ReadEnd> {
        self.next_noting(stream, stop, |_| {})
    }

    /// [`Self::next`], telling `empty` when each read that timed out with nothing began: what
    /// proves the peer silent, where the clock alone would count time this thread did not run.
    pub fn next_noting(
        &mut self,
        stream: &mut TcpStream,
        stop: &AtomicBool,
        mut empty: impl FnMut(std::time::Instant),
    ) -> Result<Message, ReadEnd> {
        loop {
            let want = match decode(&self.buf[self.start..self.end], self.max_message) {
                Ok(Decoded::Message(m, n)) => {
                    self.start += n;
                    return Ok(m);
                }
                Ok(Decoded::NeedMore(n)) => n,
                Err(e) => return Err(ReadEnd::Failed(e.to_string())),
            };
            if self.start > 0 && self.start + want > self.buf.len() {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            if want > self.buf.len() {
                self.buf.resize(want, 0);
            }
            let began = std::time::Instant::now();
            match stream.read(&mut self.buf[self.end..]) {
                Ok(0) if self.start == self.end => return Err(ReadEnd::Closed),
                Ok(0) => return Err(ReadEnd::Failed("connection closed inside a message".into())),
                Ok(n) => self.end += n,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::TimedOut
                            | io::ErrorKind::Interrupted
                    ) =>
                {
                    if e.kind() != io::ErrorKind::Interrupted {
                        empty(began);
                    }
                    if stop.load(Ordering::Relaxed) {
                        return Err(ReadEnd::Stopped);
                    }
                }
                Err(e) => return Err(ReadEnd::Failed(e.to_string())),
            }
        }
    }
}

/// Sends messages from `rx`, coalescing what is queued, until it has sent an `End` (the last
/// message of any connection) or `rx` closes; then shuts the sending side down. Returns the first
/// write error.
pub fn write_loop(stream: &mut TcpStream, rx: &Receiver<Message>) -> io::Result<()> {
    let mut out = Vec::with_capacity(64 << 10);
    while let Ok(m) = rx.recv() {
        out.clear();
        let mut ended = matches!(m, Message::End { .. });
        m.encode_into(&mut out);
        while out.len() < (256 << 10) && !ended {
            match rx.try_recv() {
                Ok(m) => {
                    ended = matches!(m, Message::End { .. });
                    m.encode_into(&mut out)
                }
                Err(_) => break,
            }
        }
        stream.write_all(&out)?;
        if ended {
            break;
        }
    }
    let _ = stream.shutdown(std::net::Shutdown::Write);
    Ok(())
}

/// Opens a request-protocol connection: connects (retrying while the peer starts), sets Nagle
/// as the channel wants, and sends the hello.
pub fn open(
    addr: &str,
    role: Role,
    channel: Channel,
    id: u32,
    patience: Duration,
) -> io::Result<TcpStream> {
    let mut s = crate::io::connect_retry(addr, patience)?;
    // Control messages are latency-bound; answers are bulk (the CMS lesson).
    s.set_nodelay(channel == Channel::Control)?;
    s.set_read_timeout(Some(Duration::from_millis(100)))?;
    s.write_all(&Message::Hello { role, channel, id }.encode())?;
    Ok(s)
}

/// Opens a control connection again after its peer was lost (an event manager restarted at the
/// same address, say): tries until `deadline`, or until `stop` is raised.
pub fn reopen(
    addr: &str,
    role: Role,
    id: u32,
    deadline: std::time::Instant,
    stop: &AtomicBool,
) -> io::Result<TcpStream> {
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if stop.load(Ordering::Relaxed) {
            return Err(io::Error::new(io::ErrorKind::Interrupted, "stopped"));
        }
        match open(addr, role, Channel::Control, id, Duration::ZERO) {
            Ok(s) => return Ok(s),
            Err(e) if left.is_zero() => return Err(e),
            Err(_) => std::thread::sleep(left.min(Duration::from_millis(100))),
        }
    }
}

/// The writer of one control connection: its thread and its queue. A failed write shuts the
/// connection down, so that its reader sees the loss (and may open it again).
pub fn spawn_writer(
    name: String,
    stream: &TcpStream,
) -> io::Result<(
    std::thread::JoinHandle<()>,
    crossbeam_channel::Sender<Message>,
)> {
    let mut w = stream.try_clone()?;
    let (tx, rx) = crossbeam_channel::bounded::<Message>(4096);
    let t = crate::role::spawn(name.clone(), move || {
        if let Err(e) = write_loop(&mut w, &rx) {
            tracing::warn!(connection = %name, error = %e, "write failed");
            let _ = w.shutdown(std::net::Shutdown::Both);
        }
    });
    Ok((t, tx))
}

/// How long a role that lost its event manager still waits for one to take the run over
/// (request-protocol §4.2): `takeover` from the loss. A connection that closes at once, unheard
/// (a manager still holding the old one refuses the new), is not a return: the wait goes on
/// from the first loss.
pub struct TakeoverWait {
    takeover: Duration,
    lost_since: Option<std::time::Instant>,
}

impl TakeoverWait {
    pub fn new(takeover: Duration) -> TakeoverWait {
        TakeoverWait {
            takeover,
            lost_since: None,
        }
    }

    /// The connection opened at `opened` was lost; `heard`: it carried a message. Returns the
    /// deadline for a new one, or `None` when no takeover is waited for.
    pub fn lost(&mut self, opened: std::time::Instant, heard: bool) -> Option<std::time::Instant> {
        if self.takeover.is_zero() {
            return None;
        }
        let now = std::time::Instant::now();
        if self.lost_since.is_none() || heard || opened.elapsed() > Duration::from_secs(1) {
            self.lost_since = Some(now);
        }
        Some(self.lost_since.unwrap_or(now) + self.takeover)
    }

    pub fn seconds(&self) -> f64 {
        self.takeover.as_secs_f64()
    }
}

/// Reads the hello of an accepted request-protocol connection.
pub fn read_hello(stream: &mut TcpStream) -> Result<(Role, Channel, u32), String> {
    stream
        .set_read_timeout(Some(Duration::from_millis(100)))
        .map_err(|e| e.to_string())?;
    let mut b = [0u8; 24];
    crate::io::read_exact_patient(stream, &mut b, Duration::from_secs(5))
        .map_err(|e| e.to_string())?;
    match decode(&b, 64) {
        Ok(Decoded::Message(Message::Hello { role, channel, id }, _)) => {
            let _ = stream.set_nodelay(channel == Channel::Control);
            Ok((role, channel, id))
        }
        Ok(_) => Err("first message is not a hello".into()),
        Err(e) => Err(e.to_string()),
    }
}

//! The monitor protocol, v1 (the CODA ET model): consumers attach to a station of the monitor over
//! TCP, get events in batches, put them back, and exchange heartbeats with the monitor. Specified
//! byte by byte in `docs/monitor-protocol.md`, with the test vectors of [`crate::vectors`].
//!
//! Every message has the same 16-byte header as the request protocol (magic, version, kind, total
//! size, CRC32C of the header and the message's own fields), with its own magic. Event records in
//! an `Events` or `Put` message are not under that CRC: each carries its own checksum.
//! Commands and replies (attach, status, station settings) are JSON bodies, so that adding a
//! station option does not change the framing.
//!
//! Nothing here trusts the peer: sizes are checked against the input and a configured maximum,
//! and a malformed message is an error, never a panic.

use crate::bytes::{put_u32, put_u64, u32_at, u64_at};
use crate::frame;

pub const MONITOR_MAGIC: u32 = 0xEE4D_4EEE;
pub const MONITOR_VERSION: u16 = 1;
pub use crate::frame::HEADER_SIZE;
/// Most events one `Events` or `Put` message may carry.
pub const MAX_BATCH: usize = 65_536;
/// Size of one entry of an `Events` or `Put` table.
pub const ENTRY_SIZE: usize = 16;

/// How long a `Get` may wait for events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// Until at least one event is there (or the consumer is woken: the system stops).
    Sleep,
    /// Not at all: whatever is queued now, possibly nothing.
    Poll,
    /// Up to this many milliseconds.
    Timed(u32),
}

/// Error codes of an `Error` message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum ErrorCode {
    /// The message or command is malformed or not allowed now.
    BadRequest = 1,
    /// No station of that name.
    UnknownStation = 2,
    /// A station option that cannot apply (for example `restore = "next"` on a sampling station).
    Refused = 3,
    /// `Get` or `Put` before `attach`.
    NotAttached = 4,
    /// `Put` of an event this consumer does not hold.
    NotHeld = 5,
    /// The monitor is shutting down.
    Closed = 6,
}

impl ErrorCode {
    pub fn from_u32(v: u32) -> Option<ErrorCode> {
        use ErrorCode::*;
        Some(match v {
            1 => BadRequest,
            2 => UnknownStation,
            3 => Refused,
            4 => NotAttached,
            5 => NotHeld,
            6 => Closed,
            _ => return None,
        })
    }
}

/// One entry of an `Events` or `Put` table: which event, how many record bytes follow for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The monitor's sequence number of the event (its order of arrival in the monitor).
    pub seq: u64,
    /// Record bytes of this entry in the data part (in `Put`: 0 = unchanged).
    pub len: u32,
}

/// One monitor-protocol message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Monitor → consumer, first on every connection: which incarnation of the monitor this is
    /// and how often it beats.
    Welcome { instance: u64, heartbeat_ms: u32 },
    /// Consumer → monitor: a JSON command (attach, status, create, set, remove).
    Command { json: Vec<u8> },
    /// Monitor → consumer: the JSON answer to a command.
    Reply { json: Vec<u8> },
    /// Monitor → consumer: a command or message was refused.
    Error { code: ErrorCode, message: String },
    /// Consumer → monitor: up to `max` events, waiting as `wait` says.
    Get { max: u32, wait: Wait },
    /// Monitor → consumer: a table of events; their records follow the table in order. The
    /// decoder returns the table and where the records start; see [`Decoded::Message`].
    Events { entries: Vec<Entry> },
    /// Consumer → monitor: these events are done at this station. An entry with `len > 0`
    /// replaces the event's record with the bytes that follow the table.
    Put { entries: Vec<Entry> },
    /// Either way: I am alive (monitor → consumer carries the monitor's instance).
    Heartbeat { instance: u64 },
    /// Consumer → monitor: detach; events held are handled as after a death.
    Bye,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
enum Kind {
    Welcome = 1,
    Command = 2,
    Reply = 3,
    Error = 4,
    Get = 5,
    Events = 6,
    Put = 7,
    Heartbeat = 8,
    Bye = 9,
}

impl Kind {
    fn from_u16(v: u16) -> Option<Kind> {
        use Kind::*;
        Some(match v {
            1 => Welcome,
            2 => Command,
            3 => Reply,
            4 => Error,
            5 => Get,
            6 => Events,
            7 => Put,
            8 => Heartbeat,
            9 => Bye,
            _ => return None,
        })
    }
}

/// A message that breaks the protocol; the connection cannot continue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    #[error("unsupported monitor protocol version {0}")]
    BadVersion(u16),
    #[error("unknown message kind {0}")]
    BadKind(u16),
    #[error("bad size in {0}")]
    BadSize(&'static str),
    #[error("bad value in {0}")]
    BadValue(&'static str),
    #[error("header CRC mismatch")]
    BadCrc,
}

fn seal(b: &mut [u8], kind: Kind, total: usize, covered: usize) {
    frame::seal(
        b,
        MONITOR_MAGIC,
        MONITOR_VERSION,
        kind as u16,
        total,
        covered,
    )
}

/// Appends the header and table of an `Events` or `Put` message whose records (`entries[i].len`
/// bytes each, in order) the caller sends right after, so records go out without being copied
/// into the message.
fn encode_table(out: &mut Vec<u8>, kind: Kind, entries: &[Entry]) {
    let start = out.len();
    let covered = HEADER_SIZE + 8 + ENTRY_SIZE * entries.len();
    let data: usize = entries.iter().map(|e| e.len as usize).sum();
    out.resize(start + covered, 0);
    let b = &mut out[start..];
    put_u32(b, 16, entries.len() as u32);
    for (i, e) in entries.iter().enumerate() {
        let o = HEADER_SIZE + 8 + ENTRY_SIZE * i;
        put_u64(b, o, e.seq);
        put_u32(b, o + 8, e.len);
    }
    seal(b, kind, covered + data, covered);
}

/// Header and table of an `Events` message; the records follow.
pub fn encode_events_header(out: &mut Vec<u8>, entries: &[Entry]) {
    encode_table(out, Kind::Events, entries)
}

/// Header and table of a `Put` message; the replacement records (entries with `len > 0`) follow.
pub fn encode_put_header(out: &mut Vec<u8>, entries: &[Entry]) {
    encode_table(out, Kind::Put, entries)
}

impl Message {
    /// Appends the message's bytes. For `Events` and `Put`, only header and table: the caller
    /// appends the records the table declares.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let start = out.len();
        let fixed = |out: &mut Vec<u8>, n: usize| {
            out.resize(start + HEADER_SIZE + n, 0);
            HEADER_SIZE + n
        };
        let (kind, total) = match self {
            Message::Welcome {
                instance,
                heartbeat_ms,
            } => {
                let t = fixed(out, 16);
                put_u64(&mut out[start..], 16, *instance);
                put_u32(&mut out[start..], 24, *heartbeat_ms);
                (Kind::Welcome, t)
            }
            Message::Command { json } | Message::Reply { json } => {
                out.extend_from_slice(&[0u8; HEADER_SIZE]);
                out.extend_from_slice(json);
                let k = if matches!(self, Message::Command { .. }) {
                    Kind::Command
                } else {
                    Kind::Reply
                };
                (k, HEADER_SIZE + json.len())
            }
            Message::Error { code, message } => {
                let t = fixed(out, 8);
                put_u32(&mut out[start..], 16, *code as u32);
                out.extend_from_slice(message.as_bytes());
                (Kind::Error, t + message.len())
            }
            Message::Get { max, wait } => {
                let t = fixed(out, 16);
                let (w, ms) = match wait {
                    Wait::Sleep => (0, 0),
                    Wait::Poll => (1, 0),
                    Wait::Timed(ms) => (2, *ms),
                };
                put_u32(&mut out[start..], 16, *max);
                put_u32(&mut out[start..], 20, w);
                put_u32(&mut out[start..], 24, ms);
                (Kind::Get, t)
            }
            Message::Events { entries } => return encode_table(out, Kind::Events, entries),
            Message::Put { entries } => return encode_table(out, Kind::Put, entries),
            Message::Heartbeat { instance } => {
                let t = fixed(out, 8);
                put_u64(&mut out[start..], 16, *instance);
                (Kind::Heartbeat, t)
            }
            Message::Bye => (Kind::Bye, fixed(out, 0)),
        };
        seal(&mut out[start..], kind, total, total);
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::new();
        self.encode_into(&mut v);
        v
    }
}

/// What the decoder found at the start of its input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decoded {
    /// A message of `consumed` bytes in all. For `Events` and `Put`, the records are the bytes
    /// `data_start..consumed`, in table order.
    Message {
        message: Message,
        data_start: usize,
        consumed: usize,
    },
    /// At least this many bytes are needed in all.
    NeedMore(usize),
}

/// Decodes one message. `max_message` bounds any message's total size (`Events` are the large
/// ones).
pub fn decode(b: &[u8], max_message: usize) -> Result<Decoded, ProtocolError> {
    if b.len() < HEADER_SIZE {
        return Ok(Decoded::NeedMore(HEADER_SIZE));
    }
    let (kind, total) = frame::head(b, MONITOR_MAGIC, MONITOR_VERSION).map_err(|f| match f {
        frame::HeadFault::Magic(m) => ProtocolError::BadMagic(m),
        frame::HeadFault::Version(v) => ProtocolError::BadVersion(v),
    })?;
    let kind = Kind::from_u16(kind).ok_or(ProtocolError::BadKind(kind))?;
    if !frame::total_ok(total, max_message) {
        return Err(ProtocolError::BadSize("message"));
    }
    let fixed = |n: usize, what: &'static str| {
        if total != HEADER_SIZE + n {
            Err(ProtocolError::BadSize(what))
        } else {
            Ok(())
        }
    };
    match kind {
        Kind::Welcome | Kind::Get => fixed(16, "fixed message")?,
        Kind::Heartbeat => fixed(8, "heartbeat")?,
        Kind::Bye => fixed(0, "bye")?,
        Kind::Error if total < HEADER_SIZE + 8 => return Err(ProtocolError::BadSize("error")),
        _ => {}
    }
    let covered = match kind {
        Kind::Events | Kind::Put => {
            if total < HEADER_SIZE + 8 {
                return Err(ProtocolError::BadSize("event table"));
            }
            if b.len() < HEADER_SIZE + 8 {
                return Ok(Decoded::NeedMore(HEADER_SIZE + 8));
            }
            let n = u32_at(b, 16) as usize;
            let covered = HEADER_SIZE + 8 + ENTRY_SIZE * n;
            if n > MAX_BATCH || covered > total {
                return Err(ProtocolError::BadSize("event table"));
            }
            covered
        }
        _ => total,
    };
    if b.len() < covered {
        return Ok(Decoded::NeedMore(covered));
    }
    if !frame::crc_ok(b, covered) {
        return Err(ProtocolError::BadCrc);
    }
    let message = match kind {
        Kind::Welcome => Message::Welcome {
            instance: u64_at(b, 16),
            heartbeat_ms: u32_at(b, 24),
        },
        Kind::Command => Message::Command {
            json: b[HEADER_SIZE..total].to_vec(),
        },
        Kind::Reply => Message::Reply {
            json: b[HEADER_SIZE..total].to_vec(),
        },
        Kind::Error => Message::Error {
            code: ErrorCode::from_u32(u32_at(b, 16))
                .ok_or(ProtocolError::BadValue("error code"))?,
            message: String::from_utf8_lossy(&b[HEADER_SIZE + 8..total]).into_owned(),
        },
        Kind::Get => Message::Get {
            max: u32_at(b, 16),
            wait: match u32_at(b, 20) {
                0 => Wait::Sleep,
                1 => Wait::Poll,
                2 => Wait::Timed(u32_at(b, 24)),
                _ => return Err(ProtocolError::BadValue("get wait")),
            },
        },
        Kind::Events | Kind::Put => {
            let n = u32_at(b, 16) as usize;
            let mut entries = Vec::with_capacity(n);
            let mut data = 0usize;
            for i in 0..n {
                let o = HEADER_SIZE + 8 + ENTRY_SIZE * i;
                let e = Entry {
                    seq: u64_at(b, o),
                    len: u32_at(b, o + 8),
                };
                data += e.len as usize;
                entries.push(e);
            }
            if covered + data != total {
                return Err(ProtocolError::BadSize("event table"));
            }
            if b.len() < total {
                return Ok(Decoded::NeedMore(total));
            }
            if kind == Kind::Events {
                Message::Events { entries }
            } else {
                Message::Put { entries }
            }
        }
        Kind::Heartbeat => Message::Heartbeat {
            instance: u64_at(b, 16),
        },
        Kind::Bye => Message::Bye,
    };
    Ok(Decoded::Message {
        message,
        data_start: covered,
        consumed: total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn message() -> impl Strategy<Value = Message> {
        let entries = proptest::collection::vec((any::<u64>(), 0u32..64), 0..20).prop_map(|v| {
            v.into_iter()
                .map(|(seq, len)| Entry { seq, len })
                .collect::<Vec<_>>()
        });
        prop_oneof![
            (any::<u64>(), any::<u32>()).prop_map(|(instance, heartbeat_ms)| Message::Welcome {
                instance,
                heartbeat_ms
            }),
            proptest::collection::vec(any::<u8>(), 0..100)
                .prop_map(|json| Message::Command { json }),
            proptest::collection::vec(any::<u8>(), 0..100).prop_map(|json| Message::Reply { json }),
            (1u32..7, "[a-z ]{0,40}").prop_map(|(c, message)| Message::Error {
                code: ErrorCode::from_u32(c).unwrap(),
                message
            }),
            (any::<u32>(), 0u32..3, any::<u32>()).prop_map(|(max, w, ms)| Message::Get {
                max,
                wait: match w {
                    0 => Wait::Sleep,
                    1 => Wait::Poll,
                    _ => Wait::Timed(ms),
                }
            }),
            entries
                .clone()
                .prop_map(|entries| Message::Events { entries }),
            entries.prop_map(|entries| Message::Put { entries }),
            any::<u64>().prop_map(|instance| Message::Heartbeat { instance }),
            Just(Message::Bye),
        ]
    }

    /// Encodes with the records the table declares (byte `i` of each record is `seq + i`).
    fn wire(m: &Message) -> Vec<u8> {
        let mut v = m.encode();
        if let Message::Events { entries } | Message::Put { entries } = m {
            for e in entries {
                v.extend((0..e.len).map(|i| (e.seq as u8).wrapping_add(i as u8)));
            }
        }
        v
    }

    proptest! {
        #[test]
        fn round_trip(m in message()) {
            let b = wire(&m);
            match decode(&b, 1 << 20).unwrap() {
                Decoded::Message { message, data_start, consumed } => {
                    prop_assert_eq!(&message, &m);
                    prop_assert_eq!(consumed, b.len());
                    if let Message::Events { entries } | Message::Put { entries } = &m {
                        let mut at = data_start;
                        for e in entries {
                            for i in 0..e.len as usize {
                                prop_assert_eq!(b[at + i], (e.seq as u8).wrapping_add(i as u8));
                            }
                            at += e.len as usize;
                        }
                        prop_assert_eq!(at, consumed);
                    }
                }
                other => prop_assert!(false, "{other:?}"),
            }
            // Every strict prefix asks for more; none is an error.
            for cut in 0..b.len() {
                match decode(&b[..cut], 1 << 20) {
                    Ok(Decoded::NeedMore(n)) => prop_assert!(n > cut),
                    other => prop_assert!(false, "prefix {cut}: {other:?}"),
                }
            }
        }

        #[test]
        fn any_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode(&b, 1 << 16);
        }

        #[test]
        fn a_flipped_header_or_table_bit_is_caught(m in message(), bit in any::<prop::sample::Index>()) {
            let mut b = m.encode();
            let covered = match decode(&b, 1 << 20) {
                Ok(Decoded::Message { data_start, .. }) => data_start,
                _ => b.len(),
            };
            let i = bit.index(covered * 8);
            b[i / 8] ^= 1 << (i % 8);
            match decode(&b, 1 << 20) {
                Ok(Decoded::Message { message, .. }) => prop_assert!(false, "accepted {message:?}"),
                Ok(Decoded::NeedMore(_)) | Err(_) => {}
            }
        }
    }

    #[test]
    fn oversized_messages_are_refused_before_their_bytes_arrive() {
        let mut b = Message::Command {
            json: vec![b'x'; 100],
        }
        .encode();
        b.truncate(HEADER_SIZE);
        assert_eq!(decode(&b, 64), Err(ProtocolError::BadSize("message")));
    }
}

//! The request protocol of request mode, v1 (the ATLAS ROS and CMS EVM model): builders ask
//! readout units for the fragments of the events an event manager gave them, and the event
//! manager clears them from the readout units once they are recorded or rejected. Specified byte
//! by byte in `docs/request-protocol.md`, with the test vectors of [`crate::vectors`].
//!
//! Every message has the same 16-byte header, so one decoder serves every connection:
//! magic, version, kind, total size and a CRC32C of the header and the message's own fields. An
//! answer's fragments are not under that CRC: each carries its own CRC from its source.
//!
//! Nothing here trusts the peer: sizes are checked against the input and a configured maximum,
//! and a malformed message is an error, never a panic.

use crate::bytes::{put_u16, put_u32, put_u64, u16_at, u32_at, u64_at};
use crate::frame;

pub const REQUEST_MAGIC: u32 = 0xEE52_51EE;
pub const REQUEST_VERSION: u16 = 1;
pub use crate::frame::HEADER_SIZE;
/// Fixed part of an answer, header included; missing source IDs and fragments follow.
pub const ANSWER_FIXED_SIZE: usize = HEADER_SIZE + 32;
/// Most event IDs or source IDs one message may list.
pub const MAX_LIST: usize = 65_536;

/// Which role speaks on a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Role {
    ReadoutUnit = 1,
    BuilderUnit = 2,
    EventManager = 3,
}

/// What a connection carries: control messages (small, latency-bound: Nagle off) or answers
/// (bulk data: Nagle on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Channel {
    Control = 1,
    Data = 2,
}

/// Flags of an assignment.
pub const ASSIGN_REBUILD: u32 = 1;

/// What a builder did with an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Outcome {
    /// Built and handed to the recorder.
    Recorded = 0,
    /// Rejected by the filter: cleared without being recorded.
    Rejected = 1,
}

/// One message of the request protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// First message on every connection.
    Hello {
        role: Role,
        channel: Channel,
        id: u32,
    },
    /// Builder → readout unit (control): send me these links' fragments of an event; an empty
    /// list means every link of the unit.
    Request {
        tag: u64,
        event_id: u64,
        sources: Vec<u32>,
    },
    /// Readout unit → builder (data). The fragments follow the header (see [`AnswerHeader`]).
    Answer(AnswerHeader),
    /// Event manager → readout unit: free these events.
    Clear { event_ids: Vec<u64> },
    /// Readout unit → event manager: these events arrived here first.
    Announce { event_ids: Vec<u64> },
    /// Builder → event manager: I can take this many more events.
    Credit { credits: u32 },
    /// Event manager → builder: build these events.
    Assign { events: Vec<(u64, u32)> },
    /// Builder → event manager: these events are finished.
    Done { events: Vec<(u64, Outcome)> },
    /// Builder → event manager: I am alive.
    Heartbeat { sequence: u64 },
    /// Event manager → readout unit: no builder has credit (`busy`), or they have again.
    Throttle { busy: bool },
    /// Last message of a connection closed cleanly, with the count of messages of its main kind
    /// sent on it (announcements, answers, clears or done events).
    End { units: u64, items: u64 },
    /// Builder → event manager, first after the hello when the builder connects again (its
    /// manager was lost or restarted): the events it holds (assigned, not finished) and the
    /// events it finished most recently, so that a manager taking the run over neither gives a
    /// held event to another builder nor builds a finished one again.
    Rejoin {
        held: Vec<u64>,
        done: Vec<(u64, Outcome)>,
    },
}

/// An answer's fixed fields and the list of requested sources that had no fragment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AnswerHeader {
    pub tag: u64,
    pub event_id: u64,
    pub readout_unit: u32,
    pub fragment_count: u32,
    /// Header, missing list and fragments, in bytes.
    pub total_size: u32,
    pub missing: Vec<u32>,
}

impl AnswerHeader {
    /// Where the fragments start.
    pub fn header_size(&self) -> usize {
        ANSWER_FIXED_SIZE + 4 * self.missing.len()
    }

    /// Encodes the header for `fragments_len` bytes of fragments that follow it.
    pub fn encode_into(&self, out: &mut Vec<u8>, fragments_len: usize) {
        let start = out.len();
        let hs = self.header_size();
        out.resize(start + hs, 0);
        let b = &mut out[start..];
        put_u64(b, 16, self.tag);
        put_u64(b, 24, self.event_id);
        put_u32(b, 32, self.readout_unit);
        put_u32(b, 36, self.fragment_count);
        put_u32(b, 40, self.missing.len() as u32);
        for (i, m) in self.missing.iter().enumerate() {
            put_u32(b, ANSWER_FIXED_SIZE + 4 * i, *m);
        }
        seal(b, Kind::Answer, hs + fragments_len, hs);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
enum Kind {
    Hello = 1,
    Request = 2,
    Answer = 3,
    Clear = 4,
    Announce = 5,
    Credit = 6,
    Assign = 7,
    Done = 8,
    Heartbeat = 9,
    Throttle = 10,
    End = 11,
    Rejoin = 12,
}

impl Kind {
    fn from_u16(v: u16) -> Option<Kind> {
        use Kind::*;
        Some(match v {
            1 => Hello,
            2 => Request,
            3 => Answer,
            4 => Clear,
            5 => Announce,
            6 => Credit,
            7 => Assign,
            8 => Done,
            9 => Heartbeat,
            10 => Throttle,
            11 => End,
            12 => Rejoin,
            _ => return None,
        })
    }
}

/// A message that breaks the protocol; the connection cannot continue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    #[error("unsupported request protocol version {0}")]
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
        REQUEST_MAGIC,
        REQUEST_VERSION,
        kind as u16,
        total,
        covered,
    )
}

fn list_message(out: &mut Vec<u8>, count: usize, item: usize) -> usize {
    let start = out.len();
    let total = HEADER_SIZE + 8 + count * item;
    out.resize(start + total, 0);
    put_u32(&mut out[start..], 16, count as u32);
    start
}

impl Message {
    /// Appends the message's bytes. For an answer, only its header: the caller appends
    /// fragments of the size it declared.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let start = out.len();
        let (kind, total) = match self {
            Message::Hello { role, channel, id } => {
                out.resize(start + HEADER_SIZE + 8, 0);
                let b = &mut out[start..];
                put_u16(b, 16, *role as u16);
                put_u16(b, 18, *channel as u16);
                put_u32(b, 20, *id);
                (Kind::Hello, HEADER_SIZE + 8)
            }
            Message::Request {
                tag,
                event_id,
                sources,
            } => {
                let total = HEADER_SIZE + 24 + 4 * sources.len();
                out.resize(start + total, 0);
                let b = &mut out[start..];
                put_u64(b, 16, *tag);
                put_u64(b, 24, *event_id);
                put_u32(b, 32, sources.len() as u32);
                for (i, s) in sources.iter().enumerate() {
                    put_u32(b, 40 + 4 * i, *s);
                }
                (Kind::Request, total)
            }
            Message::Answer(h) => {
                let fragments = (h.total_size as usize).saturating_sub(h.header_size());
                h.encode_into(out, fragments);
                return;
            }
            Message::Clear { event_ids } | Message::Announce { event_ids } => {
                let kind = if matches!(self, Message::Clear { .. }) {
                    Kind::Clear
                } else {
                    Kind::Announce
                };
                let s = list_message(out, event_ids.len(), 8);
                let b = &mut out[s..];
                for (i, e) in event_ids.iter().enumerate() {
                    put_u64(b, 24 + 8 * i, *e);
                }
                (kind, b.len())
            }
            Message::Credit { credits } => {
                out.resize(start + HEADER_SIZE + 8, 0);
                put_u32(&mut out[start..], 16, *credits);
                (Kind::Credit, HEADER_SIZE + 8)
            }
            Message::Assign { events } => {
                let s = list_message(out, events.len(), 16);
                let b = &mut out[s..];
                for (i, (e, f)) in events.iter().enumerate() {
                    put_u64(b, 24 + 16 * i, *e);
                    put_u32(b, 32 + 16 * i, *f);
                }
                (Kind::Assign, b.len())
            }
            Message::Done { events } => {
                let s = list_message(out, events.len(), 16);
                let b = &mut out[s..];
                for (i, (e, o)) in events.iter().enumerate() {
                    put_u64(b, 24 + 16 * i, *e);
                    put_u32(b, 32 + 16 * i, *o as u32);
                }
                (Kind::Done, b.len())
            }
            Message::Heartbeat { sequence } => {
                out.resize(start + HEADER_SIZE + 8, 0);
                put_u64(&mut out[start..], 16, *sequence);
                (Kind::Heartbeat, HEADER_SIZE + 8)
            }
            Message::Throttle { busy } => {
                out.resize(start + HEADER_SIZE + 8, 0);
                put_u32(&mut out[start..], 16, *busy as u32);
                (Kind::Throttle, HEADER_SIZE + 8)
            }
            Message::End { units, items } => {
                out.resize(start + HEADER_SIZE + 16, 0);
                put_u64(&mut out[start..], 16, *units);
                put_u64(&mut out[start..], 24, *items);
                (Kind::End, HEADER_SIZE + 16)
            }
            Message::Rejoin { held, done } => {
                let total = HEADER_SIZE + 8 + 8 * held.len() + 16 * done.len();
                out.resize(start + total, 0);
                let b = &mut out[start..];
                put_u32(b, 16, held.len() as u32);
                put_u32(b, 20, done.len() as u32);
                for (i, e) in held.iter().enumerate() {
                    put_u64(b, 24 + 8 * i, *e);
                }
                let d = 24 + 8 * held.len();
                for (i, (e, o)) in done.iter().enumerate() {
                    put_u64(b, d + 16 * i, *e);
                    put_u32(b, d + 16 * i + 8, *o as u32);
                }
                (Kind::Rejoin, total)
            }
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
    /// A message of `consumed` bytes (for an answer: header, missing list and fragments).
    Message(Message, usize),
    /// At least this many bytes are needed in all.
    NeedMore(usize),
}

fn outcome(v: u32) -> Result<Outcome, ProtocolError> {
    match v {
        0 => Ok(Outcome::Recorded),
        1 => Ok(Outcome::Rejected),
        _ => Err(ProtocolError::BadValue("done outcome")),
    }
}

/// Decodes one message. `max_message` bounds any message's total size (answers are the large
/// ones: the largest event's fragments from one unit).
pub fn decode(b: &[u8], max_message: usize) -> Result<Decoded, ProtocolError> {
    if b.len() < HEADER_SIZE {
        return Ok(Decoded::NeedMore(HEADER_SIZE));
    }
    let (kind, total) = frame::head(b, REQUEST_MAGIC, REQUEST_VERSION).map_err(|f| match f {
        frame::HeadFault::Magic(m) => ProtocolError::BadMagic(m),
        frame::HeadFault::Version(v) => ProtocolError::BadVersion(v),
    })?;
    let kind = Kind::from_u16(kind).ok_or(ProtocolError::BadKind(kind))?;
    if !frame::total_ok(total, max_message) {
        return Err(ProtocolError::BadSize("message"));
    }
    // Fixed-size messages are checked before waiting for their bytes, so that a bad size is an
    // error at once rather than a wait for data that never comes.
    let fixed = |n: usize, what: &'static str| {
        if total != HEADER_SIZE + n {
            Err(ProtocolError::BadSize(what))
        } else {
            Ok(())
        }
    };
    match kind {
        Kind::Hello | Kind::Credit | Kind::Heartbeat | Kind::Throttle => fixed(8, "fixed message")?,
        Kind::End => fixed(16, "end")?,
        _ => {}
    }
    // The CRC covers the message's own fields: all of it except an answer's fragments.
    let covered = if kind == Kind::Answer {
        if total < ANSWER_FIXED_SIZE {
            return Err(ProtocolError::BadSize("answer"));
        }
        if b.len() < ANSWER_FIXED_SIZE {
            return Ok(Decoded::NeedMore(ANSWER_FIXED_SIZE));
        }
        let n = u32_at(b, 40) as usize;
        if n > MAX_LIST || ANSWER_FIXED_SIZE + 4 * n > total {
            return Err(ProtocolError::BadSize("answer missing list"));
        }
        let count = u32_at(b, 36) as usize;
        if count > (total - ANSWER_FIXED_SIZE - 4 * n) / crate::wire::FRAGMENT_OVERHEAD {
            return Err(ProtocolError::BadSize("answer fragment count"));
        }
        ANSWER_FIXED_SIZE + 4 * n
    } else {
        total
    };
    if b.len() < covered {
        return Ok(Decoded::NeedMore(covered));
    }
    if !frame::crc_ok(b, covered) {
        return Err(ProtocolError::BadCrc);
    }
    let list = |item: usize, what: &'static str| -> Result<usize, ProtocolError> {
        if total < HEADER_SIZE + 8 {
            return Err(ProtocolError::BadSize(what));
        }
        let n = u32_at(b, 16) as usize;
        if n > MAX_LIST || total != HEADER_SIZE + 8 + n * item {
            return Err(ProtocolError::BadSize(what));
        }
        Ok(n)
    };
    let msg = match kind {
        Kind::Hello => {
            let role = match u16_at(b, 16) {
                1 => Role::ReadoutUnit,
                2 => Role::BuilderUnit,
                3 => Role::EventManager,
                _ => return Err(ProtocolError::BadValue("hello role")),
            };
            let channel = match u16_at(b, 18) {
                1 => Channel::Control,
                2 => Channel::Data,
                _ => return Err(ProtocolError::BadValue("hello channel")),
            };
            Message::Hello {
                role,
                channel,
                id: u32_at(b, 20),
            }
        }
        Kind::Request => {
            if total < HEADER_SIZE + 24 {
                return Err(ProtocolError::BadSize("request"));
            }
            let n = u32_at(b, 32) as usize;
            if n > MAX_LIST || total != HEADER_SIZE + 24 + 4 * n {
                return Err(ProtocolError::BadSize("request"));
            }
            Message::Request {
                tag: u64_at(b, 16),
                event_id: u64_at(b, 24),
                sources: (0..n).map(|i| u32_at(b, 40 + 4 * i)).collect(),
            }
        }
        Kind::Answer => {
            if b.len() < total {
                return Ok(Decoded::NeedMore(total));
            }
            let n = u32_at(b, 40) as usize;
            Message::Answer(AnswerHeader {
                tag: u64_at(b, 16),
                event_id: u64_at(b, 24),
                readout_unit: u32_at(b, 32),
                fragment_count: u32_at(b, 36),
                total_size: total as u32,
                missing: (0..n)
                    .map(|i| u32_at(b, ANSWER_FIXED_SIZE + 4 * i))
                    .collect(),
            })
        }
        Kind::Clear | Kind::Announce => {
            let n = list(8, "event ID list")?;
            let event_ids = (0..n).map(|i| u64_at(b, 24 + 8 * i)).collect();
            if kind == Kind::Clear {
                Message::Clear { event_ids }
            } else {
                Message::Announce { event_ids }
            }
        }
        Kind::Credit => Message::Credit {
            credits: u32_at(b, 16),
        },
        Kind::Assign => {
            let n = list(16, "assignment list")?;
            Message::Assign {
                events: (0..n)
                    .map(|i| (u64_at(b, 24 + 16 * i), u32_at(b, 32 + 16 * i)))
                    .collect(),
            }
        }
        Kind::Done => {
            let n = list(16, "done list")?;
            let mut events = Vec::with_capacity(n);
            for i in 0..n {
                events.push((u64_at(b, 24 + 16 * i), outcome(u32_at(b, 32 + 16 * i))?));
            }
            Message::Done { events }
        }
        Kind::Rejoin => {
            if total < HEADER_SIZE + 8 {
                return Err(ProtocolError::BadSize("rejoin"));
            }
            let (h, d) = (u32_at(b, 16) as usize, u32_at(b, 20) as usize);
            if h > MAX_LIST || d > MAX_LIST || total != HEADER_SIZE + 8 + 8 * h + 16 * d {
                return Err(ProtocolError::BadSize("rejoin"));
            }
            let at = 24 + 8 * h;
            let mut done = Vec::with_capacity(d);
            for i in 0..d {
                done.push((u64_at(b, at + 16 * i), outcome(u32_at(b, at + 16 * i + 8))?));
            }
            Message::Rejoin {
                held: (0..h).map(|i| u64_at(b, 24 + 8 * i)).collect(),
                done,
            }
        }
        Kind::Heartbeat => Message::Heartbeat {
            sequence: u64_at(b, 16),
        },
        Kind::Throttle => Message::Throttle {
            busy: match u32_at(b, 16) {
                0 => false,
                1 => true,
                _ => return Err(ProtocolError::BadValue("throttle")),
            },
        },
        Kind::End => Message::End {
            units: u64_at(b, 16),
            items: u64_at(b, 24),
        },
    };
    Ok(Decoded::Message(msg, total))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn message() -> impl Strategy<Value = Message> {
        let ids = proptest::collection::vec(any::<u64>(), 0..40);
        prop_oneof![
            (1u16..4, 1u16..3, any::<u32>()).prop_map(|(r, c, id)| Message::Hello {
                role: [Role::ReadoutUnit, Role::BuilderUnit, Role::EventManager][r as usize - 1],
                channel: if c == 1 {
                    Channel::Control
                } else {
                    Channel::Data
                },
                id
            }),
            (
                any::<u64>(),
                any::<u64>(),
                proptest::collection::vec(any::<u32>(), 0..30)
            )
                .prop_map(|(tag, event_id, sources)| Message::Request {
                    tag,
                    event_id,
                    sources
                }),
            ids.clone()
                .prop_map(|event_ids| Message::Clear { event_ids }),
            ids.prop_map(|event_ids| Message::Announce { event_ids }),
            any::<u32>().prop_map(|credits| Message::Credit { credits }),
            proptest::collection::vec((any::<u64>(), any::<u32>()), 0..20)
                .prop_map(|events| Message::Assign { events }),
            proptest::collection::vec((any::<u64>(), any::<bool>()), 0..20).prop_map(|v| {
                Message::Done {
                    events: v
                        .into_iter()
                        .map(|(e, r)| {
                            (
                                e,
                                if r {
                                    Outcome::Rejected
                                } else {
                                    Outcome::Recorded
                                },
                            )
                        })
                        .collect(),
                }
            }),
            any::<u64>().prop_map(|sequence| Message::Heartbeat { sequence }),
            any::<bool>().prop_map(|busy| Message::Throttle { busy }),
            (any::<u64>(), any::<u64>()).prop_map(|(units, items)| Message::End { units, items }),
            (
                proptest::collection::vec(any::<u64>(), 0..20),
                proptest::collection::vec((any::<u64>(), any::<bool>()), 0..20)
            )
                .prop_map(|(held, d)| Message::Rejoin {
                    held,
                    done: d
                        .into_iter()
                        .map(|(e, r)| (
                            e,
                            if r {
                                Outcome::Rejected
                            } else {
                                Outcome::Recorded
                            }
                        ))
                        .collect(),
                }),
        ]
    }

    proptest! {
        #[test]
        fn every_message_round_trips(m in message()) {
            let b = m.encode();
            prop_assert_eq!(decode(&b, 1 << 20), Ok(Decoded::Message(m.clone(), b.len())));
            // Any strict prefix asks for more, never decodes and never errs.
            for cut in 0..b.len() {
                match decode(&b[..cut], 1 << 20) {
                    Ok(Decoded::NeedMore(n)) => prop_assert!(n > cut),
                    other => prop_assert!(false, "prefix {} gave {:?}", cut, other),
                }
            }
        }

        #[test]
        fn a_flipped_bit_is_an_error_or_a_wait_never_a_different_message(
            m in message(), at in any::<prop::sample::Index>(), bit in 0u8..8
        ) {
            let mut b = m.encode();
            let i = at.index(b.len());
            b[i] ^= 1 << bit;
            match decode(&b, 1 << 20) {
                Ok(Decoded::Message(got, _)) => prop_assert!(false, "decoded {:?}", got),
                Ok(Decoded::NeedMore(_)) | Err(_) => {}
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode(&b, 1 << 16);
        }

        #[test]
        fn answers_round_trip(
            tag in any::<u64>(), ev in any::<u64>(), ru in any::<u32>(),
            missing in proptest::collection::vec(any::<u32>(), 0..8),
            body in proptest::collection::vec(any::<u8>(), 0..200)
        ) {
            // The most fragments such a body can hold: a count beyond is refused (see below).
            let count = (body.len() / crate::wire::FRAGMENT_OVERHEAD) as u32;
            let mut h = AnswerHeader { tag, event_id: ev, readout_unit: ru, fragment_count: count,
                total_size: 0, missing };
            h.total_size = (h.header_size() + body.len()) as u32;
            let mut b = Vec::new();
            h.encode_into(&mut b, body.len());
            b.extend_from_slice(&body);
            prop_assert_eq!(decode(&b, 1 << 20), Ok(Decoded::Message(Message::Answer(h), b.len())));
        }
    }

    #[test]
    fn a_fragment_count_the_answer_cannot_hold_is_refused() {
        let mut h = AnswerHeader {
            tag: 1,
            event_id: 2,
            readout_unit: 3,
            fragment_count: u32::MAX,
            total_size: 0,
            missing: vec![],
        };
        h.total_size = (h.header_size() + 48) as u32;
        let mut b = Vec::new();
        h.encode_into(&mut b, 48);
        b.extend_from_slice(&[0u8; 48]);
        assert_eq!(
            decode(&b, 1 << 20),
            Err(ProtocolError::BadSize("answer fragment count"))
        );
    }

    #[test]
    fn oversized_messages_are_refused_before_their_bytes_arrive() {
        let mut b = Message::Clear {
            event_ids: vec![1; 100],
        }
        .encode();
        b.truncate(HEADER_SIZE);
        assert_eq!(decode(&b, 256), Err(ProtocolError::BadSize("message")));
    }
}

//! The links between Tessera's own roles, v1: readout unit → builder unit carries super-fragments;
//! builder unit → recorder carries event records (`crate::event`). Both links open with a
//! [`PeerHello`] and close cleanly with a [`PeerEnd`] that carries counts for the accounting
//! balance. Specified in `docs/wire-format.md`, section "Builder links".
//!
//! The peer is another Tessera role, yet nothing here trusts it: every size is checked against the
//! input and the configured maximum, and a malformed message is an error, never a panic.

use crate::bytes::{pad4, put_u16, put_u32, put_u64, u16_at, u32_at, u64_at};
use crate::event::{EventRecordHeader, EVENT_MARKER};
use crate::wire::{
    FragmentHeader, FRAGMENT_HEADER_SIZE, MAX_HEADER_SIZE, START_MARKER, TRAILER_SIZE,
};

/// Version 2 added the progress message (readout unit → builder unit); version 3 the resend
/// message (builder unit → recorder).
pub const LINK_VERSION: u16 = 3;
pub const PEER_HELLO_MAGIC: u32 = 0xEE22_BBEE;
pub const SUPER_FRAGMENT_MARKER: u32 = 0xEE53_46EE;
pub const PEER_END_MARKER: u32 = 0xEE0E_0EEE;
pub const PROGRESS_MARKER: u32 = 0xEE50_57EE;
pub const PROGRESS_SIZE: usize = 24;
pub const ACK_MARKER: u32 = 0xEE41_4BEE;
pub const ACK_SIZE: usize = 24;
pub const RESEND_MARKER: u32 = 0xEE52_53EE;
pub const RESEND_SIZE: usize = 24;
pub const PEER_HELLO_SIZE: usize = 16;
pub const PEER_END_SIZE: usize = 32;
pub const SUPER_FRAGMENT_HEADER_SIZE: usize = 32;

/// A super-fragment header's size with `missing` missing-source IDs after its fixed part.
pub const fn super_fragment_header_size(missing: usize) -> usize {
    SUPER_FRAGMENT_HEADER_SIZE + 4 * missing
}

/// Which role opened a link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum PeerRole {
    ReadoutUnit = 1,
    BuilderUnit = 2,
}

impl PeerRole {
    fn from_u16(v: u16) -> Option<PeerRole> {
        match v {
            1 => Some(PeerRole::ReadoutUnit),
            2 => Some(PeerRole::BuilderUnit),
            _ => None,
        }
    }
}

/// First message on a link between roles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerHello {
    pub role: PeerRole,
    pub id: u32,
    /// [`PeerHello::WANTS_ACKS`], or 0.
    pub flags: u16,
}

impl PeerHello {
    /// The opener asks to be told, with [`Ack`] messages, which of its units are written
    /// (a request-mode builder, which reports an event done only once it is on disk).
    pub const WANTS_ACKS: u16 = 1;

    pub fn encode(&self) -> [u8; PEER_HELLO_SIZE] {
        let mut b = [0u8; PEER_HELLO_SIZE];
        put_u32(&mut b, 0, PEER_HELLO_MAGIC);
        put_u16(&mut b, 4, LINK_VERSION);
        put_u16(&mut b, 6, PEER_HELLO_SIZE as u16);
        put_u16(&mut b, 8, self.role as u16);
        put_u16(&mut b, 10, self.flags);
        put_u32(&mut b, 12, self.id);
        b
    }
}

/// Last message on a link closed cleanly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerEnd {
    pub role: PeerRole,
    pub id: u32,
    /// Super-fragments (readout unit) or event records (builder unit) sent on this link.
    pub units: u64,
    /// Fragments inside them.
    pub fragments: u64,
}

impl PeerEnd {
    pub fn encode(&self) -> [u8; PEER_END_SIZE] {
        let mut b = [0u8; PEER_END_SIZE];
        put_u32(&mut b, 0, PEER_END_MARKER);
        put_u16(&mut b, 4, LINK_VERSION);
        put_u16(&mut b, 6, PEER_END_SIZE as u16);
        put_u16(&mut b, 8, self.role as u16);
        put_u32(&mut b, 12, self.id);
        put_u64(&mut b, 16, self.units);
        put_u64(&mut b, 24, self.fragments);
        b
    }
}

/// A readout unit's word to a builder, sent at least every progress interval whether or not
/// super-fragments flow: it is alive (so the builder can tell a held unit from a dead one), and
/// every super-fragment with an event ID below `floor` that it will ever send on this link has
/// been sent before this message (so the builder need not wait for events the unit never had).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    pub readout_unit: u32,
    /// 0: no promise yet (some link has not said where it is).
    pub floor: u64,
}

impl Progress {
    pub fn encode(&self) -> [u8; PROGRESS_SIZE] {
        let mut b = [0u8; PROGRESS_SIZE];
        put_u32(&mut b, 0, PROGRESS_MARKER);
        put_u16(&mut b, 4, LINK_VERSION);
        put_u16(&mut b, 6, PROGRESS_SIZE as u16);
        put_u32(&mut b, 8, self.readout_unit);
        put_u64(&mut b, 16, self.floor);
        b
    }
}

/// The recorder's word to a builder that asked for it ([`PeerHello::WANTS_ACKS`]), sent back on
/// the builder's own link: the first `records` event records the builder sent on this link are
/// in the recorder's file (written, and synced when the recorder syncs). Counts only grow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ack {
    pub records: u64,
}

impl Ack {
    pub fn encode(&self) -> [u8; ACK_SIZE] {
        let mut b = [0u8; ACK_SIZE];
        put_u32(&mut b, 0, ACK_MARKER);
        put_u16(&mut b, 4, LINK_VERSION);
        put_u16(&mut b, 6, ACK_SIZE as u16);
        put_u64(&mut b, 16, self.records);
        b
    }
}

/// A builder's word to the recorder, on a link that replaces one that broke: the next `records`
/// event records are sent again, having gone out on the broken link without an [`Ack`]. The
/// recorder may hold some of them already (written before the break, or by a recorder that
/// died and whose files it adopted): those are dropped and counted as resent, not as second
/// copies of an event built twice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resend {
    pub records: u64,
}

impl Resend {
    pub fn encode(&self) -> [u8; RESEND_SIZE] {
        let mut b = [0u8; RESEND_SIZE];
        put_u32(&mut b, 0, RESEND_MARKER);
        put_u16(&mut b, 4, LINK_VERSION);
        put_u16(&mut b, 6, RESEND_SIZE as u16);
        put_u64(&mut b, 16, self.records);
        b
    }
}

/// Header of the super-fragment a readout unit sends for one event: its links' fragments for
/// that event, verbatim, and the list of its sources that did not deliver one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SuperFragmentHeader {
    pub readout_unit: u32,
    pub event_id: u64,
    pub fragment_count: u32,
    /// Header plus fragments, in bytes.
    pub total_size: u32,
    pub missing: Vec<u32>,
}

impl SuperFragmentHeader {
    pub fn header_size(&self) -> usize {
        super_fragment_header_size(self.missing.len())
    }

    pub fn encode_into(&self, out: &mut Vec<u8>) {
        encode_super_fragment_header(
            out,
            self.readout_unit,
            self.event_id,
            self.fragment_count,
            self.total_size,
            &self.missing,
        );
    }
}

/// Appends a super-fragment header of these fields to `out`, as
/// [`SuperFragmentHeader::encode_into`] does, for a sender that holds the fields rather than a
/// header (a readout unit writes one per event and unit, and building the header first cost a
/// copy of its list of missing sources).
pub fn encode_super_fragment_header(
    out: &mut Vec<u8>,
    readout_unit: u32,
    event_id: u64,
    fragment_count: u32,
    total_size: u32,
    missing: &[u32],
) {
    // The fixed part built on the stack and appended whole: one header per super-fragment,
    // and zero-filling then writing through bounds checks cost ~90 instructions a header.
    let header_size = super_fragment_header_size(missing.len());
    let mut b = [0u8; SUPER_FRAGMENT_HEADER_SIZE];
    put_u32(&mut b, 0, SUPER_FRAGMENT_MARKER);
    put_u16(&mut b, 4, LINK_VERSION);
    put_u16(&mut b, 6, header_size as u16);
    put_u32(&mut b, 8, readout_unit);
    put_u32(&mut b, 12, fragment_count);
    put_u64(&mut b, 16, event_id);
    put_u32(&mut b, 24, total_size);
    put_u32(&mut b, 28, missing.len() as u32);
    out.reserve(header_size);
    out.extend_from_slice(&b);
    for m in missing {
        out.extend_from_slice(&m.to_le_bytes());
    }
}

/// What a link decoder found at the start of its input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkItem {
    Hello(PeerHello),
    /// A super-fragment of `consumed` bytes; its fragments start at its header size.
    SuperFragment(SuperFragmentHeader),
    /// An event record of `consumed` bytes.
    Event(EventRecordHeader),
    End(PeerEnd),
    Progress(Progress),
    Ack(Ack),
    Resend(Resend),
    NeedMore(usize),
    Idle,
}

/// A link message that breaks the protocol; the connection cannot continue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    /// A message starts with an unknown marker.
    #[error("unknown message marker {0:#010x}")]
    BadMarker(u32),
    /// Unsupported link protocol version.
    #[error("unsupported link version {0}")]
    BadVersion(u16),
    /// A size field contradicts the message or exceeds the configured maximum.
    #[error("bad size in {0}")]
    BadSize(&'static str),
    /// The hello names an unknown role.
    #[error("unknown peer role {0}")]
    BadRole(u16),
    /// The stream ended inside a message.
    #[error("link closed inside a message")]
    Truncated,
    /// An event record failed its own checks.
    #[error("bad event record: {0}")]
    Event(#[from] crate::event::EventError),
}

/// Decodes messages on a role-to-role link. `max_message` bounds a super-fragment or event record.
pub fn decode_link(b: &[u8], max_message: usize) -> Result<(LinkItem, usize), LinkError> {
    if b.is_empty() {
        return Ok((LinkItem::Idle, 0));
    }
    if b.len() < 8 {
        return Ok((LinkItem::NeedMore(8), 0));
    }
    let marker = u32_at(b, 0);
    let version = u16_at(b, 4);
    // An event record carries its own record version (checked by its decoder); every other
    // message carries the link version.
    if marker != EVENT_MARKER && version != LINK_VERSION {
        return Err(LinkError::BadVersion(version));
    }
    let size = u16_at(b, 6) as usize;
    match marker {
        PEER_HELLO_MAGIC => {
            if size != PEER_HELLO_SIZE {
                return Err(LinkError::BadSize("peer hello"));
            }
            if b.len() < size {
                return Ok((LinkItem::NeedMore(size), 0));
            }
            let role = PeerRole::from_u16(u16_at(b, 8)).ok_or(LinkError::BadRole(u16_at(b, 8)))?;
            Ok((
                LinkItem::Hello(PeerHello {
                    role,
                    id: u32_at(b, 12),
                    flags: u16_at(b, 10),
                }),
                size,
            ))
        }
        PEER_END_MARKER => {
            if size != PEER_END_SIZE {
                return Err(LinkError::BadSize("peer end"));
            }
            if b.len() < size {
                return Ok((LinkItem::NeedMore(size), 0));
            }
            let role = PeerRole::from_u16(u16_at(b, 8)).ok_or(LinkError::BadRole(u16_at(b, 8)))?;
            let end = PeerEnd {
                role,
                id: u32_at(b, 12),
                units: u64_at(b, 16),
                fragments: u64_at(b, 24),
            };
            Ok((LinkItem::End(end), size))
        }
        ACK_MARKER => {
            if size != ACK_SIZE {
                return Err(LinkError::BadSize("ack"));
            }
            if b.len() < size {
                return Ok((LinkItem::NeedMore(size), 0));
            }
            Ok((
                LinkItem::Ack(Ack {
                    records: u64_at(b, 16),
                }),
                size,
            ))
        }
        RESEND_MARKER => {
            if size != RESEND_SIZE {
                return Err(LinkError::BadSize("resend"));
            }
            if b.len() < size {
                return Ok((LinkItem::NeedMore(size), 0));
            }
            Ok((
                LinkItem::Resend(Resend {
                    records: u64_at(b, 16),
                }),
                size,
            ))
        }
        PROGRESS_MARKER => {
            if size != PROGRESS_SIZE {
                return Err(LinkError::BadSize("progress"));
            }
            if b.len() < size {
                return Ok((LinkItem::NeedMore(size), 0));
            }
            Ok((
                LinkItem::Progress(Progress {
                    readout_unit: u32_at(b, 8),
                    floor: u64_at(b, 16),
                }),
                size,
            ))
        }
        SUPER_FRAGMENT_MARKER => {
            if b.len() < SUPER_FRAGMENT_HEADER_SIZE {
                return Ok((LinkItem::NeedMore(SUPER_FRAGMENT_HEADER_SIZE), 0));
            }
            let missing_n = u32_at(b, 28) as usize;
            let total = u32_at(b, 24) as usize;
            if missing_n > (u16::MAX as usize) || size != super_fragment_header_size(missing_n) {
                return Err(LinkError::BadSize("super-fragment header"));
            }
            if total < size || total > max_message {
                return Err(LinkError::BadSize("super-fragment"));
            }
            // A count is checked against the bytes that must hold it before anyone sizes
            // anything by it: every fragment takes at least its header and trailer.
            let count = u32_at(b, 12) as usize;
            if count > (total - size) / crate::wire::FRAGMENT_OVERHEAD {
                return Err(LinkError::BadSize("super-fragment fragment count"));
            }
            if b.len() < total {
                return Ok((LinkItem::NeedMore(total), 0));
            }
            let missing = (0..missing_n).map(|i| u32_at(b, 32 + 4 * i)).collect();
            let h = SuperFragmentHeader {
                readout_unit: u32_at(b, 8),
                fragment_count: u32_at(b, 12),
                event_id: u64_at(b, 16),
                total_size: total as u32,
                missing,
            };
            Ok((LinkItem::SuperFragment(h), total))
        }
        EVENT_MARKER => {
            let (h, total) = match EventRecordHeader::decode_prefix(b, max_message)? {
                Some(x) => x,
                None => return Ok((LinkItem::NeedMore(needed_event(b)), 0)),
            };
            if b.len() < total {
                return Ok((LinkItem::NeedMore(total), 0));
            }
            Ok((LinkItem::Event(h), total))
        }
        m => Err(LinkError::BadMarker(m)),
    }
}

fn needed_event(b: &[u8]) -> usize {
    if b.len() >= 8 {
        (u16_at(b, 6) as usize).max(crate::event::EVENT_HEADER_SIZE)
    } else {
        crate::event::EVENT_HEADER_SIZE
    }
}

/// Walks the fragments packed back to back in a super-fragment or event record body, checking
/// only framing (markers and sizes); CRCs were checked where the fragments entered the system.
pub struct Fragments<'a> {
    body: &'a [u8],
    pos: usize,
}

impl<'a> Fragments<'a> {
    pub fn new(body: &'a [u8]) -> Self {
        Fragments { body, pos: 0 }
    }
}

/// A fragment inside a body: its header and byte range relative to the body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedFragment {
    pub header: FragmentHeader,
    pub start: usize,
    pub len: usize,
    pub header_size: usize,
}

impl PackedFragment {
    /// The payload's byte range relative to the body.
    pub fn payload_range(&self) -> std::ops::Range<usize> {
        let s = self.start + self.header_size;
        s..s + self.header.payload_size as usize
    }
}

impl<'a> Iterator for Fragments<'a> {
    type Item = Result<PackedFragment, LinkError>;

    fn next(&mut self) -> Option<Self::Item> {
        let b = &self.body[self.pos..];
        if b.is_empty() {
            return None;
        }
        let r = (|| {
            if b.len() < FRAGMENT_HEADER_SIZE || u32_at(b, 0) != START_MARKER {
                return Err(LinkError::BadSize("packed fragment header"));
            }
            let hs = b[5] as usize;
            if !(FRAGMENT_HEADER_SIZE..=MAX_HEADER_SIZE).contains(&hs) {
                return Err(LinkError::BadSize("packed fragment header size"));
            }
            let h = FragmentHeader::read(b);
            let len = hs
                .checked_add(pad4(h.payload_size as usize))
                .and_then(|x| x.checked_add(TRAILER_SIZE))
                .ok_or(LinkError::BadSize("packed fragment"))?;
            if len > b.len() {
                return Err(LinkError::BadSize("packed fragment"));
            }
            Ok(PackedFragment {
                header: h,
                start: self.pos,
                len,
                header_size: hs,
            })
        })();
        match &r {
            Ok(f) => self.pos += f.len,
            Err(_) => self.pos = self.body.len(),
        }
        Some(r)
    }
}

//! Fragment wire format v1: what a source sends to a readout unit over one TCP connection.
//!
//! A connection carries a hello, then fragments, then (on a clean stop) an end-of-stream message.
//! `docs/wire-format.md` is the normative description; this module is its reference
//! implementation. The decoder is a pure state machine over byte slices: the caller owns the
//! buffer and the socket, feeds whatever bytes it has, and gets back one item at a time with the
//! number of bytes it used. After a corrupt fragment the decoder resynchronises on the next start
//! marker and reports how many bytes it skipped, counting the corrupt stretch as exactly one
//! rejection.

use crate::bytes::{pad4, put_u16, put_u32, put_u64, u16_at, u32_at, u64_at};

/// Wire protocol version spoken in the hello and carried by every fragment.
pub const WIRE_VERSION: u16 = 1;
/// Hello magic, first four bytes on every source connection.
pub const HELLO_MAGIC: u32 = 0xEE11_AAEE;
/// Start marker of every fragment.
pub const START_MARKER: u32 = 0xEE12_34EE;
/// End marker closing every fragment trailer. Its last byte (0xDD) differs from the first byte of
/// every other marker (0xEE), so a fragment cut short by a few bytes can never borrow the next
/// fragment's start marker to complete its own end marker.
pub const END_MARKER: u32 = 0xDD56_78EE;
/// Marker of the end-of-stream message a source sends before closing cleanly.
pub const EOS_MARKER: u32 = 0xEE0E_05EE;

pub const HELLO_SIZE: usize = 16;
pub const FRAGMENT_HEADER_SIZE: usize = 40;
pub const TRAILER_SIZE: usize = 8;
pub const EOS_SIZE: usize = 24;
/// Largest header a v1 decoder accepts; room for later minor additions it will skip over.
pub const MAX_HEADER_SIZE: usize = 252;
/// Bytes a fragment adds around its payload (header, padding excluded, trailer).
pub const FRAGMENT_OVERHEAD: usize = FRAGMENT_HEADER_SIZE + TRAILER_SIZE;

/// Status flags a front-end sets in a fragment header (informational; the event record ORs them).
pub mod status {
    /// The front-end saw an error of its own while producing this fragment.
    pub const FRONT_END_ERROR: u16 = 1 << 0;
    /// The front-end cut the payload short (its own buffer overflowed).
    pub const FRONT_END_TRUNCATED: u16 = 1 << 1;
    /// The front-end was busy and this trigger's data are partial.
    pub const FRONT_END_BUSY: u16 = 1 << 2;
}

/// The first message on a source connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub version: u16,
    pub source_id: u32,
    pub flags: u32,
}

impl Hello {
    pub fn new(source_id: u32) -> Self {
        Hello {
            version: WIRE_VERSION,
            source_id,
            flags: 0,
        }
    }

    pub fn encode(&self) -> [u8; HELLO_SIZE] {
        let mut b = [0u8; HELLO_SIZE];
        put_u32(&mut b, 0, HELLO_MAGIC);
        put_u16(&mut b, 4, self.version);
        put_u16(&mut b, 6, HELLO_SIZE as u16);
        put_u32(&mut b, 8, self.source_id);
        put_u32(&mut b, 12, self.flags);
        b
    }

    /// Parses a hello; `Err` names what is wrong. A bad hello is fatal for the connection.
    pub fn decode(b: &[u8]) -> Result<Hello, HelloError> {
        if b.len() < HELLO_SIZE {
            return Err(HelloError::Short);
        }
        if u32_at(b, 0) != HELLO_MAGIC {
            return Err(HelloError::BadMagic(u32_at(b, 0)));
        }
        let version = u16_at(b, 4);
        if version != WIRE_VERSION {
            return Err(HelloError::UnsupportedVersion(version));
        }
        if u16_at(b, 6) as usize != HELLO_SIZE {
            return Err(HelloError::BadSize(u16_at(b, 6)));
        }
        Ok(Hello {
            version,
            source_id: u32_at(b, 8),
            flags: u32_at(b, 12),
        })
    }
}

/// Why a hello was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HelloError {
    /// Fewer than 16 bytes arrived before the connection closed.
    #[error("connection closed before a complete hello")]
    Short,
    /// The first four bytes are not the hello magic: not a Tessera source.
    #[error("bad hello magic {0:#010x}")]
    BadMagic(u32),
    /// The source speaks a protocol version this readout unit does not.
    #[error("unsupported wire protocol version {0}")]
    UnsupportedVersion(u16),
    /// The hello's size field is not 16.
    #[error("bad hello size {0}")]
    BadSize(u16),
}

/// The fields of a fragment header.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FragmentHeader {
    pub status: u16,
    pub source_id: u32,
    pub trigger_type: u16,
    pub event_id: u64,
    pub timestamp: u64,
    pub payload_size: u32,
}

impl FragmentHeader {
    /// Total bytes on the wire for this header's fragment.
    pub fn wire_size(&self) -> usize {
        fragment_wire_size(self.payload_size as usize)
    }

    /// Reads the header fields of a fragment already validated by the decoder (or produced by
    /// `encode_fragment`). Callers that hold an unvalidated slice use [`FragmentView::parse`].
    pub fn read(b: &[u8]) -> FragmentHeader {
        // One bound for the six fields, so that each read needs no check of its own.
        let b = &b[..36];
        FragmentHeader {
            status: u16_at(b, 6),
            source_id: u32_at(b, 8),
            trigger_type: u16_at(b, 12),
            event_id: u64_at(b, 16),
            timestamp: u64_at(b, 24),
            payload_size: u32_at(b, 32),
        }
    }

    /// The source ID of a fragment already validated (see [`FragmentHeader::read`]).
    pub fn source_id(b: &[u8]) -> u32 {
        u32_at(b, 8)
    }
}

/// Bytes a fragment with `payload` bytes occupies on the wire (v1, 40-byte header).
pub const fn fragment_wire_size(payload: usize) -> usize {
    FRAGMENT_HEADER_SIZE + pad4(payload) + TRAILER_SIZE
}

/// Appends one fragment to `out`, letting `fill` write the payload in place (no staging copy).
pub fn encode_fragment_with(out: &mut Vec<u8>, h: &FragmentHeader, fill: impl FnOnce(&mut [u8])) {
    encode_fragment_at(out, out.len(), h, fill);
}

/// Writes one fragment into `out` from offset `at` (`at` ≤ `out.len()`), over whatever bytes
/// are there, growing `out` only where it is too short; returns the offset after the fragment.
/// A sender that keeps its buffer's length between batches writes fragments without zeroing
/// their bytes first. Every byte of the fragment is written (`fill` must write all of the
/// payload it is given; the padding is zeroed here).
pub fn encode_fragment_at(
    out: &mut Vec<u8>,
    at: usize,
    h: &FragmentHeader,
    fill: impl FnOnce(&mut [u8]),
) -> usize {
    let start = at;
    let psize = h.payload_size as usize;
    let total = fragment_wire_size(psize);
    if out.len() < start + total {
        out.resize(start + total, 0);
    }
    let f = &mut out[start..start + total];
    put_u32(f, 0, START_MARKER);
    f[4] = WIRE_VERSION as u8;
    f[5] = FRAGMENT_HEADER_SIZE as u8;
    put_u16(f, 6, h.status);
    put_u32(f, 8, h.source_id);
    put_u16(f, 12, h.trigger_type);
    put_u16(f, 14, 0);
    put_u64(f, 16, h.event_id);
    put_u64(f, 24, h.timestamp);
    put_u32(f, 32, h.payload_size);
    // `f` was sized above to hold the whole fragment.
    let hcrc = crate::crc::crc32c_array(f.first_chunk::<36>().expect("a whole fragment"));
    put_u32(f, 36, hcrc);
    fill(&mut f[FRAGMENT_HEADER_SIZE..FRAGMENT_HEADER_SIZE + psize]);
    let body = FRAGMENT_HEADER_SIZE + pad4(psize);
    // Only a payload that is not whole words has padding: a call for none cost 15 instructions.
    if body > FRAGMENT_HEADER_SIZE + psize {
        f[FRAGMENT_HEADER_SIZE + psize..body].fill(0);
    }
    // The fragment's CRC covers the header again: it continues from the header's.
    let crc = crate::crc::crc32c_append(hcrc, &f[36..body]);
    put_u32(f, body, crc);
    put_u32(f, body + 4, END_MARKER);
    start + total
}

/// Appends one fragment with the given payload.
pub fn encode_fragment(out: &mut Vec<u8>, h: &FragmentHeader, payload: &[u8]) {
    let mut h = *h;
    h.payload_size = payload.len() as u32;
    encode_fragment_with(out, &h, |p| p.copy_from_slice(payload));
}

/// A validated fragment inside a byte slice: header fields plus where its payload lies.
#[derive(Clone, Copy, Debug)]
pub struct FragmentView<'a> {
    pub header: FragmentHeader,
    pub bytes: &'a [u8],
    header_size: usize,
}

impl<'a> FragmentView<'a> {
    /// Validates a complete fragment at the start of `b` (markers, sizes, both CRCs) with no
    /// limit on its source. Returns the view and the fragment's length.
    pub fn parse(
        b: &'a [u8],
        max_payload: usize,
    ) -> Result<(FragmentView<'a>, usize), RejectReason> {
        let (hs, hcrc) = check_header(b, max_payload, None)?;
        let h = FragmentHeader::read(b);
        let total = hs + pad4(h.payload_size as usize) + TRAILER_SIZE;
        if b.len() < total {
            return Err(RejectReason::Truncated);
        }
        check_body(&b[..total], hcrc)?;
        Ok((
            FragmentView {
                header: h,
                bytes: &b[..total],
                header_size: hs,
            },
            total,
        ))
    }

    pub fn payload(&self) -> &'a [u8] {
        &self.bytes[self.header_size..self.header_size + self.header.payload_size as usize]
    }

    /// The CRC32C stored in the trailer.
    pub fn crc(&self) -> u32 {
        u32_at(self.bytes, self.bytes.len() - TRAILER_SIZE)
    }
}

/// The message a source sends before closing a connection cleanly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamEnd {
    pub source_id: u32,
    /// Fragments the source put on this connection, for the accounting balance.
    pub fragments_sent: u64,
}

impl StreamEnd {
    pub fn encode(&self) -> [u8; EOS_SIZE] {
        let mut b = [0u8; EOS_SIZE];
        put_u32(&mut b, 0, EOS_MARKER);
        put_u16(&mut b, 4, WIRE_VERSION);
        put_u16(&mut b, 6, EOS_SIZE as u16);
        put_u32(&mut b, 8, self.source_id);
        put_u32(&mut b, 12, 0);
        put_u64(&mut b, 16, self.fragments_sent);
        b
    }
}

/// Why a fragment (or a stretch of bytes where one should have been) was rejected. Each rejected
/// stretch is counted once under one of these.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, thiserror::Error)]
pub enum RejectReason {
    /// Bytes where a fragment should start do not begin with the start marker.
    #[error("bad start marker")]
    BadMarker,
    /// The fragment's format version is not one this decoder reads.
    #[error("unsupported fragment version")]
    BadVersion,
    /// The header-size field is below 40, above 252 or not a multiple of 4.
    #[error("bad header size")]
    BadHeaderSize,
    /// The header checksum does not match: the header fields cannot be trusted.
    #[error("bad header checksum")]
    BadHeaderCrc,
    /// The fragment names a source other than the one that said hello on this connection.
    #[error("wrong source ID")]
    WrongSource,
    /// The payload size exceeds the configured maximum fragment size.
    #[error("fragment larger than the configured maximum")]
    Oversize,
    /// The end marker is not where the header's payload size puts it: the fragment was cut short
    /// or its size field is wrong.
    #[error("bad end marker (truncated or mis-sized fragment)")]
    BadEndMarker,
    /// The trailer CRC32C does not match header and payload.
    #[error("bad CRC")]
    BadCrc,
    /// The connection ended in the middle of a fragment.
    #[error("connection ended inside a fragment")]
    Truncated,
    /// A malformed end-of-stream message.
    #[error("bad end-of-stream message")]
    BadEndOfStream,
    /// Bytes after the end-of-stream message.
    #[error("data after end of stream")]
    DataAfterEnd,
}

impl RejectReason {
    pub const ALL: [RejectReason; 11] = [
        RejectReason::BadMarker,
        RejectReason::BadVersion,
        RejectReason::BadHeaderSize,
        RejectReason::BadHeaderCrc,
        RejectReason::WrongSource,
        RejectReason::Oversize,
        RejectReason::BadEndMarker,
        RejectReason::BadCrc,
        RejectReason::Truncated,
        RejectReason::BadEndOfStream,
        RejectReason::DataAfterEnd,
    ];

    /// Stable snake_case label used in summaries, JSON and metrics.
    pub fn label(self) -> &'static str {
        match self {
            RejectReason::BadMarker => "bad_marker",
            RejectReason::BadVersion => "bad_version",
            RejectReason::BadHeaderSize => "bad_header_size",
            RejectReason::BadHeaderCrc => "bad_header_crc",
            RejectReason::WrongSource => "wrong_source",
            RejectReason::Oversize => "oversize",
            RejectReason::BadEndMarker => "bad_end_marker",
            RejectReason::BadCrc => "bad_crc",
            RejectReason::Truncated => "truncated",
            RejectReason::BadEndOfStream => "bad_end_of_stream",
            RejectReason::DataAfterEnd => "data_after_end",
        }
    }
}

/// Checks a fragment header at the start of `b` (needs 40 bytes). Returns its header size.
/// Checks a fragment header; returns its size and the CRC of its first 36 bytes (checked against
/// the header CRC, and where the fragment's CRC continues from).
fn check_header(
    b: &[u8],
    max_payload: usize,
    source: Option<u32>,
) -> Result<(usize, u32), RejectReason> {
    if b.len() < FRAGMENT_HEADER_SIZE {
        return Err(RejectReason::Truncated);
    }
    if u32_at(b, 0) != START_MARKER {
        return Err(RejectReason::BadMarker);
    }
    if b[4] as u16 != WIRE_VERSION {
        return Err(RejectReason::BadVersion);
    }
    let hs = b[5] as usize;
    if !(FRAGMENT_HEADER_SIZE..=MAX_HEADER_SIZE).contains(&hs) || !hs.is_multiple_of(4) {
        return Err(RejectReason::BadHeaderSize);
    }
    let Some(head) = b.first_chunk::<36>() else {
        return Err(RejectReason::Truncated);
    };
    let hcrc = crate::crc::crc32c_array(head);
    if hcrc != u32_at(b, 36) {
        return Err(RejectReason::BadHeaderCrc);
    }
    if let Some(s) = source {
        if u32_at(b, 8) != s {
            return Err(RejectReason::WrongSource);
        }
    }
    if u32_at(b, 32) as usize > max_payload {
        return Err(RejectReason::Oversize);
    }
    Ok((hs, hcrc))
}

/// Checks trailer marker and CRC of a complete fragment `f` whose header was checked and whose
/// first 36 bytes have the CRC `head_crc`.
fn check_body(f: &[u8], head_crc: u32) -> Result<(), RejectReason> {
    let n = f.len();
    if u32_at(f, n - 4) != END_MARKER {
        return Err(RejectReason::BadEndMarker);
    }
    if crate::crc::crc32c_append(head_crc, &f[36..n - TRAILER_SIZE]) != u32_at(f, n - TRAILER_SIZE)
    {
        return Err(RejectReason::BadCrc);
    }
    Ok(())
}

/// One step of the stream decoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decoded {
    /// The connection's hello.
    Hello(Hello),
    /// The hello was refused: the caller closes the connection.
    BadHello(HelloError),
    /// A valid fragment occupies the first `Step::consumed` bytes.
    Fragment(FragmentHeader),
    /// A rejected fragment (or stretch of bytes). `evidence` bytes from the start of the input
    /// show it, for the quarantine dump; `consumed` may be smaller when the decoder resynchronises
    /// inside the stretch.
    Rejected {
        reason: RejectReason,
        evidence: usize,
    },
    /// Bytes skipped while searching for the next start marker after a rejection; already
    /// counted by that rejection.
    Skipped,
    /// The source ended the stream cleanly.
    End(StreamEnd),
    /// Nothing can be decoded until the input holds at least this many bytes from its start.
    NeedMore(usize),
    /// The input is empty (or, after `finish`, fully accounted for).
    Idle,
}

/// A decoded item and the number of input bytes it used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    pub item: Decoded,
    pub consumed: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    AwaitHello,
    Fragments,
    Ended,
    Failed,
}

/// Totals a decoder keeps over its whole stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecoderStats {
    pub fragments: u64,
    pub rejected: u64,
    pub skipped_bytes: u64,
}

/// Incremental decoder for one source connection.
#[derive(Clone, Debug)]
pub struct StreamDecoder {
    max_payload: usize,
    expected_source: Option<u32>,
    state: State,
    resyncing: bool,
    eof: bool,
    source: Option<u32>,
    pub stats: DecoderStats,
}

impl StreamDecoder {
    /// `max_payload` bounds the payload size of a fragment; `expected_source`, if given, is the
    /// only source ID the hello may carry.
    pub fn new(max_payload: usize, expected_source: Option<u32>) -> Self {
        StreamDecoder {
            max_payload,
            expected_source,
            state: State::AwaitHello,
            resyncing: false,
            eof: false,
            source: None,
            stats: DecoderStats::default(),
        }
    }

    /// A decoder for a stream whose hello was read elsewhere.
    pub fn after_hello(max_payload: usize, source_id: u32) -> Self {
        let mut d = Self::new(max_payload, Some(source_id));
        d.state = State::Fragments;
        d.source = Some(source_id);
        d
    }

    /// Largest number of bytes `NeedMore` can ask for: the caller's buffer must hold this.
    pub fn max_message(&self) -> usize {
        MAX_HEADER_SIZE + pad4(self.max_payload) + TRAILER_SIZE
    }

    /// Source ID from the hello, once seen.
    pub fn source_id(&self) -> Option<u32> {
        self.source
    }

    pub fn ended(&self) -> bool {
        self.state == State::Ended
    }

    /// Declares that no more bytes will come: pending partial data is then rejected as truncated
    /// instead of waited for.
    pub fn finish(&mut self) {
        self.eof = true;
    }

    /// Decodes the next item at the start of `b`.
    pub fn next(&mut self, b: &[u8]) -> Step {
        let s = self.step(b);
        match s.item {
            Decoded::Fragment(_) => self.stats.fragments += 1,
            Decoded::Rejected { .. } => self.stats.rejected += 1,
            Decoded::Skipped => self.stats.skipped_bytes += s.consumed as u64,
            _ => {}
        }
        s
    }

    fn step(&mut self, b: &[u8]) -> Step {
        if b.is_empty() {
            return Step {
                item: Decoded::Idle,
                consumed: 0,
            };
        }
        match self.state {
            State::Failed => Step {
                item: Decoded::Idle,
                consumed: b.len(),
            },
            State::Ended => Step {
                item: Decoded::Rejected {
                    reason: RejectReason::DataAfterEnd,
                    evidence: b.len(),
                },
                consumed: b.len(),
            },
            State::AwaitHello => {
                if b.len() < HELLO_SIZE && !self.eof {
                    return need(HELLO_SIZE);
                }
                match Hello::decode(b) {
                    Ok(h) => {
                        if let Some(e) = self.expected_source {
                            if e != h.source_id {
                                self.state = State::Failed;
                                return Step {
                                    item: Decoded::BadHello(HelloError::BadMagic(h.source_id)),
                                    consumed: 0,
                                };
                            }
                        }
                        self.state = State::Fragments;
                        self.source = Some(h.source_id);
                        Step {
                            item: Decoded::Hello(h),
                            consumed: HELLO_SIZE,
                        }
                    }
                    Err(e) => {
                        self.state = State::Failed;
                        Step {
                            item: Decoded::BadHello(e),
                            consumed: 0,
                        }
                    }
                }
            }
            State::Fragments => self.fragment_step(b),
        }
    }

    fn fragment_step(&mut self, b: &[u8]) -> Step {
        if b.len() < 4 {
            if !self.eof {
                return need(4);
            }
            return self.reject_or_skip(RejectReason::Truncated, b.len(), b.len());
        }
        let marker = u32_at(b, 0);
        if marker == START_MARKER {
            if b.len() < FRAGMENT_HEADER_SIZE && !self.eof {
                return need(FRAGMENT_HEADER_SIZE);
            }
            // Marker, version, header size and header CRC decide whether this is a real fragment
            // boundary; until they check, the bytes are garbage and the sizes cannot be used.
            let (hs, hcrc) = match check_header(b, usize::MAX, None) {
                Ok(h) => h,
                Err(reason) => {
                    return self.reject_or_skip(reason, 1, b.len().min(FRAGMENT_HEADER_SIZE))
                }
            };
            // A trusted header ends any resynchronisation: what follows is counted afresh.
            self.resyncing = false;
            let h = FragmentHeader::read(b);
            if h.payload_size as usize > self.max_payload {
                return self.reject_or_skip(RejectReason::Oversize, 1, FRAGMENT_HEADER_SIZE);
            }
            let total = hs + pad4(h.payload_size as usize) + TRAILER_SIZE;
            if b.len() < total {
                if !self.eof {
                    return need(total);
                }
                return self.reject_or_skip(RejectReason::Truncated, 1, b.len());
            }
            match check_body(&b[..total], hcrc) {
                Ok(()) if Some(h.source_id) != self.source => Step {
                    item: Decoded::Rejected {
                        reason: RejectReason::WrongSource,
                        evidence: total,
                    },
                    consumed: total,
                },
                Ok(()) => Step {
                    item: Decoded::Fragment(h),
                    consumed: total,
                },
                // The framing held (both markers where the header says), so only this fragment
                // is lost and the next one starts right after it.
                Err(RejectReason::BadCrc) => Step {
                    item: Decoded::Rejected {
                        reason: RejectReason::BadCrc,
                        evidence: total,
                    },
                    consumed: total,
                },
                Err(reason) => self.reject_or_skip(reason, 1, total),
            }
        } else if marker == EOS_MARKER {
            if b.len() < EOS_SIZE && !self.eof {
                return need(EOS_SIZE);
            }
            if b.len() >= EOS_SIZE
                && u16_at(b, 4) == WIRE_VERSION
                && u16_at(b, 6) as usize == EOS_SIZE
                && Some(u32_at(b, 8)) == self.source
            {
                self.state = State::Ended;
                self.resyncing = false;
                let end = StreamEnd {
                    source_id: u32_at(b, 8),
                    fragments_sent: u64_at(b, 16),
                };
                return Step {
                    item: Decoded::End(end),
                    consumed: EOS_SIZE,
                };
            }
            self.reject_or_skip(RejectReason::BadEndOfStream, 1, b.len().min(EOS_SIZE))
        } else if self.resyncing {
            self.scan(b)
        } else {
            self.resyncing = true;
            let evidence = find_marker(&b[1..]).map_or(b.len(), |k| k + 1);
            Step {
                item: Decoded::Rejected {
                    reason: RejectReason::BadMarker,
                    evidence,
                },
                consumed: 1,
            }
        }
    }

    /// A structural error at the start of `b`: the first one since the last good fragment is a
    /// rejection, later ones (false markers met while resynchronising) are skipped bytes.
    fn reject_or_skip(&mut self, reason: RejectReason, consumed: usize, evidence: usize) -> Step {
        if self.resyncing {
            return Step {
                item: Decoded::Skipped,
                consumed,
            };
        }
        self.resyncing = true;
        Step {
            item: Decoded::Rejected { reason, evidence },
            consumed,
        }
    }

    fn scan(&mut self, b: &[u8]) -> Step {
        match find_marker(b) {
            Some(0) => Step {
                item: Decoded::Skipped,
                consumed: 1,
            },
            Some(k) => Step {
                item: Decoded::Skipped,
                consumed: k,
            },
            None if self.eof => Step {
                item: Decoded::Skipped,
                consumed: b.len(),
            },
            // Keep three bytes: a marker may straddle the end of the input.
            None if b.len() > 3 => Step {
                item: Decoded::Skipped,
                consumed: b.len() - 3,
            },
            None => need(4),
        }
    }
}

fn need(n: usize) -> Step {
    Step {
        item: Decoded::NeedMore(n),
        consumed: 0,
    }
}

/// Position of the first fragment start or end-of-stream marker in `b`.
fn find_marker(b: &[u8]) -> Option<usize> {
    let start = START_MARKER.to_le_bytes();
    let eos = EOS_MARKER.to_le_bytes();
    // Both markers begin and end with 0xEE; search for that byte and confirm.
    let mut i = 0;
    while i + 4 <= b.len() {
        match b[i..b.len() - 3].iter().position(|&x| x == 0xEE) {
            None => return None,
            Some(k) => {
                let p = i + k;
                let w = &b[p..p + 4];
                if w == start || w == eos {
                    return Some(p);
                }
                i = p + 1;
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frag(source: u32, event: u64, payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        let h = FragmentHeader {
            source_id: source,
            event_id: event,
            trigger_type: 1,
            ..Default::default()
        };
        encode_fragment(&mut v, &h, payload);
        v
    }

    fn drain(d: &mut StreamDecoder, mut b: &[u8]) -> Vec<Step> {
        let mut out = Vec::new();
        loop {
            let s = d.next(b);
            match s.item {
                Decoded::Idle | Decoded::NeedMore(_) => break,
                _ => {}
            }
            out.push(s);
            b = &b[s.consumed..];
        }
        out
    }

    /// Encoding over old bytes (a sender's kept buffer) gives the same fragment as encoding into
    /// fresh memory, for every padding length, and the fragment checks.
    #[test]
    fn encoding_over_old_bytes_writes_every_byte() {
        for n in 0..12 {
            let payload: Vec<u8> = (0..n as u8).collect();
            let fresh = frag(3, 9, &payload);
            let mut dirty = vec![0xA5u8; 7 + fresh.len() + 5];
            let h = FragmentHeader {
                source_id: 3,
                event_id: 9,
                trigger_type: 1,
                payload_size: n as u32,
                ..Default::default()
            };
            let end = encode_fragment_at(&mut dirty, 7, &h, |p| p.copy_from_slice(&payload));
            assert_eq!(end, 7 + fresh.len());
            assert_eq!(&dirty[7..end], &fresh[..], "payload of {n} bytes");
            assert!(FragmentView::parse(&dirty[7..end], 64).is_ok());
            // Past the end of the vector: it grows.
            let mut short = vec![0xA5u8; 3];
            assert_eq!(
                encode_fragment_at(&mut short, 3, &h, |p| p.copy_from_slice(&payload)),
                3 + fresh.len()
            );
            assert_eq!(&short[3..], &fresh[..]);
        }
    }

    #[test]
    fn hello_then_fragments_then_end() {
        let mut s = Hello::new(7).encode().to_vec();
        s.extend(frag(7, 1, b"abcde"));
        s.extend(frag(7, 2, b""));
        s.extend(
            StreamEnd {
                source_id: 7,
                fragments_sent: 2,
            }
            .encode(),
        );
        let mut d = StreamDecoder::new(1 << 20, None);
        let steps = drain(&mut d, &s);
        let items: Vec<_> = steps.iter().map(|s| s.item).collect();
        assert!(matches!(
            items[0],
            Decoded::Hello(Hello { source_id: 7, .. })
        ));
        assert!(matches!(
            items[1],
            Decoded::Fragment(FragmentHeader {
                event_id: 1,
                payload_size: 5,
                ..
            })
        ));
        assert!(matches!(
            items[2],
            Decoded::Fragment(FragmentHeader { event_id: 2, .. })
        ));
        assert_eq!(
            items[3],
            Decoded::End(StreamEnd {
                source_id: 7,
                fragments_sent: 2
            })
        );
        assert!(d.ended());
    }

    #[test]
    fn bad_crc_skips_exactly_one_fragment() {
        let mut s = Hello::new(1).encode().to_vec();
        let mut bad = frag(1, 1, &[9; 100]);
        bad[60] ^= 0xFF;
        s.extend(&bad);
        s.extend(frag(1, 2, &[3; 10]));
        let mut d = StreamDecoder::new(1 << 20, None);
        let steps = drain(&mut d, &s);
        assert_eq!(
            steps[1].item,
            Decoded::Rejected {
                reason: RejectReason::BadCrc,
                evidence: bad.len()
            }
        );
        assert!(matches!(
            steps[2].item,
            Decoded::Fragment(FragmentHeader { event_id: 2, .. })
        ));
        assert_eq!(d.stats.skipped_bytes, 0);
    }

    #[test]
    fn truncated_fragment_is_one_rejection_and_resyncs() {
        let mut s = Hello::new(1).encode().to_vec();
        let whole = frag(1, 1, &[5; 200]);
        s.extend(&whole[..120]);
        s.extend(frag(1, 2, &[6; 200]));
        s.extend(frag(1, 3, &[7; 200]));
        let mut d = StreamDecoder::new(1 << 20, None);
        let steps = drain(&mut d, &s);
        let rejected: Vec<_> = steps
            .iter()
            .filter(|s| matches!(s.item, Decoded::Rejected { .. }))
            .collect();
        assert_eq!(rejected.len(), 1);
        let ids: Vec<u64> = steps
            .iter()
            .filter_map(|s| match s.item {
                Decoded::Fragment(h) => Some(h.event_id),
                _ => None,
            })
            .collect();
        assert_eq!(ids, vec![2, 3]);
        assert_eq!(d.stats.skipped_bytes, 119);
    }

    #[test]
    fn eof_inside_fragment_is_truncated_and_still_finds_end() {
        let mut s = Hello::new(1).encode().to_vec();
        let whole = frag(1, 1, &[5; 200]);
        s.extend(&whole[..100]);
        s.extend(
            StreamEnd {
                source_id: 1,
                fragments_sent: 1,
            }
            .encode(),
        );
        let mut d = StreamDecoder::new(1 << 20, None);
        let _ = drain(&mut d, &s[..HELLO_SIZE]);
        let mut rest = &s[HELLO_SIZE..];
        assert!(matches!(d.next(rest).item, Decoded::NeedMore(_)));
        d.finish();
        let mut seen = Vec::new();
        loop {
            let st = d.next(rest);
            if st.item == Decoded::Idle {
                break;
            }
            seen.push(st.item);
            rest = &rest[st.consumed..];
        }
        assert!(matches!(
            seen[0],
            Decoded::Rejected {
                reason: RejectReason::Truncated,
                ..
            }
        ));
        assert!(seen.contains(&Decoded::End(StreamEnd {
            source_id: 1,
            fragments_sent: 1
        })));
    }

    #[test]
    fn garbage_between_fragments_is_one_bad_marker() {
        let mut s = Hello::new(1).encode().to_vec();
        s.extend(frag(1, 1, &[1; 8]));
        s.extend([0u8; 37]);
        s.extend(frag(1, 2, &[1; 8]));
        let mut d = StreamDecoder::new(1 << 20, None);
        let steps = drain(&mut d, &s);
        let rej: Vec<_> = steps
            .iter()
            .filter(|s| matches!(s.item, Decoded::Rejected { .. }))
            .collect();
        assert_eq!(rej.len(), 1);
        assert_eq!(
            rej[0].item,
            Decoded::Rejected {
                reason: RejectReason::BadMarker,
                evidence: 37
            }
        );
        assert_eq!(d.stats.fragments, 2);
        assert_eq!(d.stats.skipped_bytes, 36);
    }

    #[test]
    fn wrong_source_and_oversize_rejected() {
        let mut s = Hello::new(1).encode().to_vec();
        s.extend(frag(2, 1, &[1; 8]));
        s.extend(frag(1, 2, &[1; 64]));
        s.extend(frag(1, 3, &[1; 8]));
        let mut d = StreamDecoder::new(32, None);
        let steps = drain(&mut d, &s);
        let reasons: Vec<_> = steps
            .iter()
            .filter_map(|s| match s.item {
                Decoded::Rejected { reason, .. } => Some(reason),
                _ => None,
            })
            .collect();
        assert_eq!(
            reasons,
            vec![RejectReason::WrongSource, RejectReason::Oversize]
        );
        assert_eq!(d.stats.fragments, 1);
    }

    #[test]
    fn bad_hello_fails_connection() {
        let mut d = StreamDecoder::new(32, None);
        let st = d.next(&[0u8; 16]);
        assert_eq!(st.item, Decoded::BadHello(HelloError::BadMagic(0)));
        let mut d = StreamDecoder::new(32, None);
        let mut h = Hello::new(3).encode();
        h[4] = 9;
        assert_eq!(
            d.next(&h).item,
            Decoded::BadHello(HelloError::UnsupportedVersion(9))
        );
    }
}

//! The event record, v1: one built event as a builder emits it and as files store it. The
//! fragments follow the record header verbatim as they arrived from the sources (their own
//! headers, payloads and CRC trailers included), so a file can be checked down to each byte that
//! entered the system. Specified in `docs/file-format.md`, section "Event record".

use crate::bytes::{put_u16, put_u32, put_u64, u16_at, u32_at, u64_at};
use crate::wire::TRAILER_SIZE;

pub const EVENT_MARKER: u32 = 0xEE45_56EE;
pub const EVENT_VERSION: u16 = 1;
pub const EVENT_HEADER_SIZE: usize = 48;

/// Event record flags.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventFlags(pub u32);

impl EventFlags {
    /// At least one expected source is missing; the missing list names them.
    pub const INCOMPLETE: u32 = 1 << 0;
    /// The fragments disagree on the trigger type.
    pub const TRIGGER_MISMATCH: u32 = 1 << 1;
    /// Some fragment carries non-zero front-end status flags.
    pub const FRONT_END_STATUS: u32 = 1 << 2;
    /// Built again after the builder that first had it failed (request mode).
    pub const REBUILT: u32 = 1 << 3;

    pub fn has(self, f: u32) -> bool {
        self.0 & f != 0
    }

    /// Names of the set flags, for humans and JSON.
    pub fn names(self) -> Vec<&'static str> {
        let mut v = Vec::new();
        for (bit, name) in [
            (Self::INCOMPLETE, "incomplete"),
            (Self::TRIGGER_MISMATCH, "trigger_mismatch"),
            (Self::FRONT_END_STATUS, "front_end_status"),
            (Self::REBUILT, "rebuilt"),
        ] {
            if self.0 & bit != 0 {
                v.push(name);
            }
        }
        v
    }
}

/// The header of an event record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EventRecordHeader {
    pub flags: EventFlags,
    pub event_id: u64,
    pub timestamp: u64,
    pub trigger_type: u16,
    pub builder_id: u16,
    pub fragment_count: u32,
    /// Header plus fragments, in bytes.
    pub record_size: u32,
    /// Source IDs expected but absent, ascending.
    pub missing: Vec<u32>,
    /// See [`EventRecordHeader::checksum_over`].
    pub checksum: u32,
}

/// The second half of an event checksum, gathered apart from the header: the CRC register
/// (from zero, no inversions) over fragments' trailer CRCs, and how many. Pieces gathered apart
/// are joined in order ([`Self::then`]), so a builder gathers each part's while it reads the part
/// (its bytes hot in cache) and never walks the fragments again when the event is sealed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrailerCrcs {
    reg: u32,
    /// Trailer CRCs covered.
    pub count: u64,
}

/// Gathers trailer CRCs 16 at a time, one CRC call for each 64 bytes: a call per 4-byte CRC
/// cost more than the CRC itself (`tessera bench instructions`).
#[derive(Clone, Copy, Debug)]
pub struct TrailerGather {
    sum: TrailerCrcs,
    words: [u8; 64],
    used: usize,
}

impl TrailerGather {
    /// Adds a fragment's trailer CRC (`f` is the whole fragment; one too short to have a
    /// trailer adds nothing).
    #[inline]
    pub fn add_fragment(&mut self, f: &[u8]) {
        // The trailer is the fragment's CRC then its end marker: the CRC's four bytes.
        if let Some([a, b, c, d, ..]) = f.len().checked_sub(TRAILER_SIZE).map(|at| &f[at..]) {
            self.add([*a, *b, *c, *d]);
        }
    }

    /// Adds one trailer CRC, as its 4 bytes on the wire.
    #[inline]
    pub fn add(&mut self, crc: [u8; 4]) {
        self.words[self.used..self.used + 4].copy_from_slice(&crc);
        self.used += 4;
        self.sum.count += 1;
        if self.used == self.words.len() {
            self.sum.reg = crate::crc::register_after(self.sum.reg, &self.words);
            self.used = 0;
        }
    }

    pub fn finish(mut self) -> TrailerCrcs {
        self.sum.reg = crate::crc::register_after(self.sum.reg, &self.words[..self.used]);
        self.sum
    }
}

impl TrailerCrcs {
    pub fn gather() -> TrailerGather {
        TrailerGather {
            sum: TrailerCrcs::default(),
            words: [0; 64],
            used: 0,
        }
    }

    /// These trailer CRCs followed by `next`'s.
    #[inline]
    pub fn then(self, next: TrailerCrcs) -> TrailerCrcs {
        TrailerCrcs {
            reg: crate::crc::shift_register(self.reg, 4 * next.count) ^ next.reg,
            count: self.count + next.count,
        }
    }

    /// The event checksum of a record with this header (its checksum field is taken as zero)
    /// and these trailer CRCs: see [`EventRecordHeader::checksum_over`].
    pub fn checksum(self, header: &[u8]) -> u32 {
        let mut h = [0u8; EVENT_HEADER_SIZE];
        let n = header.len().min(EVENT_HEADER_SIZE);
        h[..n].copy_from_slice(&header[..n]);
        h[44..48].fill(0);
        let crc = crate::crc::crc32c_append(crate::crc::crc32c(&h[..n]), &header[n..]);
        !(crate::crc::shift_register(!crc, 4 * self.count) ^ self.reg)
    }
}

/// An event record that fails its own checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    #[error("bad event marker")]
    BadMarker,
    #[error("unsupported event record version {0}")]
    BadVersion(u16),
    #[error("header size does not match the missing-source count")]
    BadHeaderSize,
    #[error("record size smaller than its header or larger than the maximum")]
    BadRecordSize,
    #[error("event checksum mismatch")]
    BadChecksum,
    /// More fragments declared than the record's size can hold (each takes at least its header
    /// and trailer).
    #[error("fragment count larger than the record can hold")]
    BadFragmentCount,
}

impl EventRecordHeader {
    pub fn header_size(&self) -> usize {
        EVENT_HEADER_SIZE + 4 * self.missing.len()
    }

    /// Writes the header with a zero checksum field; see [`Self::seal`].
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.resize(start + self.header_size(), 0);
        self.encode_to(&mut out[start..]);
    }

    /// [`Self::encode_into`] over `b`, which must be [`Self::header_size`] bytes long (a
    /// caller that keeps headers inline, without an allocation per event).
    ///
    /// # Panics
    /// When `b` is not `header_size()` bytes: a caller's sizing error, not input from a peer.
    pub fn encode_to(&self, b: &mut [u8]) {
        assert_eq!(b.len(), self.header_size(), "event header buffer size");
        put_u32(b, 0, EVENT_MARKER);
        put_u16(b, 4, EVENT_VERSION);
        put_u16(b, 6, self.header_size() as u16);
        put_u32(b, 8, self.record_size);
        put_u32(b, 12, self.flags.0);
        put_u64(b, 16, self.event_id);
        put_u64(b, 24, self.timestamp);
        put_u16(b, 32, self.trigger_type);
        put_u16(b, 34, self.builder_id);
        put_u32(b, 36, self.fragment_count);
        put_u32(b, 40, self.missing.len() as u32);
        put_u32(b, 44, 0);
        for (i, m) in self.missing.iter().enumerate() {
            put_u32(b, EVENT_HEADER_SIZE + 4 * i, *m);
        }
    }

    /// The event checksum: CRC32C over the header bytes (checksum field zero) followed by the
    /// 4-byte trailer CRC of every fragment in order. Each fragment's own CRC covers its bytes,
    /// so this covers the whole record without reading the payloads a second time.
    pub fn checksum_over<'a>(header: &[u8], fragments: impl IntoIterator<Item = &'a [u8]>) -> u32 {
        let mut t = TrailerCrcs::gather();
        for f in fragments {
            t.add_fragment(f);
        }
        t.finish().checksum(header)
    }

    /// Stores `checksum` into an encoded header.
    pub fn seal(header: &mut [u8], checksum: u32) {
        put_u32(header, 44, checksum);
    }

    /// Parses the header at the start of `b` if it is all there (`Ok(None)`: need more bytes).
    /// Returns the header and the record size.
    pub fn decode_prefix(
        b: &[u8],
        max_record: usize,
    ) -> Result<Option<(EventRecordHeader, usize)>, EventError> {
        if b.len() < EVENT_HEADER_SIZE {
            if b.len() >= 4 && u32_at(b, 0) != EVENT_MARKER {
                return Err(EventError::BadMarker);
            }
            return Ok(None);
        }
        if u32_at(b, 0) != EVENT_MARKER {
            return Err(EventError::BadMarker);
        }
        let v = u16_at(b, 4);
        if v != EVENT_VERSION {
            return Err(EventError::BadVersion(v));
        }
        let hs = u16_at(b, 6) as usize;
        let missing_n = u32_at(b, 40) as usize;
        if missing_n > 16_000 || hs != EVENT_HEADER_SIZE + 4 * missing_n {
            return Err(EventError::BadHeaderSize);
        }
        let rs = u32_at(b, 8) as usize;
        if rs < hs || rs > max_record {
            return Err(EventError::BadRecordSize);
        }
        if u32_at(b, 36) as usize > (rs - hs) / crate::wire::FRAGMENT_OVERHEAD {
            return Err(EventError::BadFragmentCount);
        }
        if b.len() < hs {
            return Ok(None);
        }
        let h = EventRecordHeader {
            record_size: rs as u32,
            flags: EventFlags(u32_at(b, 12)),
            event_id: u64_at(b, 16),
            timestamp: u64_at(b, 24),
            trigger_type: u16_at(b, 32),
            builder_id: u16_at(b, 34),
            fragment_count: u32_at(b, 36),
            missing: (0..missing_n)
                .map(|i| u32_at(b, EVENT_HEADER_SIZE + 4 * i))
                .collect(),
            checksum: u32_at(b, 44),
        };
        Ok(Some((h, rs)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The event checksum is its definition, the CRC-32C of the header (checksum field zero)
    /// and then every fragment's 4-byte trailer CRC, for any number of fragments: around the
    /// Trailer CRCs gathered part by part and joined give the checksum of the whole, for any
    /// cut into parts (empty parts included).
    #[test]
    fn trailer_crcs_gathered_apart_join_to_the_checksum() {
        let header: Vec<u8> = (0..EVENT_HEADER_SIZE as u32 + 8)
            .map(|i| (i * 5) as u8)
            .collect();
        let frags: Vec<Vec<u8>> = (0..90u32)
            .map(|i| {
                (0..TRAILER_SIZE + i as usize % 9)
                    .map(|j| (i as usize * 17 + j) as u8)
                    .collect()
            })
            .collect();
        let whole = EventRecordHeader::checksum_over(&header, frags.iter().map(|f| &f[..]));
        for cuts in [
            vec![],
            vec![0],
            vec![1, 1, 2],
            vec![16, 17, 33, 64, 90],
            vec![45],
            vec![89],
        ] {
            let mut joined = TrailerCrcs::default();
            let mut from = 0;
            for &c in cuts.iter().chain([&90]) {
                let mut g = TrailerCrcs::gather();
                for f in &frags[from..c] {
                    g.add_fragment(f);
                }
                joined = joined.then(g.finish());
                from = c;
            }
            assert_eq!(joined.count, 90);
            assert_eq!(joined.checksum(&header), whole, "cuts {cuts:?}");
        }
    }

    /// 16 CRCs the checksum gathers per call, and with a fragment too short to have a trailer.
    #[test]
    fn the_checksum_is_its_definition_for_any_number_of_fragments() {
        let h = EventRecordHeader {
            flags: EventFlags(0),
            event_id: 42,
            timestamp: 7,
            trigger_type: 3,
            builder_id: 1,
            fragment_count: 0,
            record_size: 0,
            missing: vec![5, 9],
            checksum: 0xDEAD_BEEF,
        };
        let mut header = Vec::new();
        h.encode_into(&mut header);
        let frags: Vec<Vec<u8>> = (0..200u32)
            .map(|i| {
                let len = if i == 70 {
                    3
                } else {
                    TRAILER_SIZE + (i as usize * 13) % 50
                };
                (0..len).map(|j| (i as usize * 31 + j * 7) as u8).collect()
            })
            .collect();
        for n in [0, 1, 15, 16, 17, 63, 64, 65, 71, 129, 200] {
            let mut def = header.clone();
            def[44..48].fill(0);
            for f in frags[..n].iter().filter(|f| f.len() >= TRAILER_SIZE) {
                def.extend_from_slice(&f[f.len() - TRAILER_SIZE..f.len() - 4]);
            }
            let got = EventRecordHeader::checksum_over(&header, frags[..n].iter().map(|f| &f[..]));
            assert_eq!(got, crc32c::crc32c(&def), "{n} fragments");
        }
    }
}

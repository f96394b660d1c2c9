//! The 16-byte message header that the request protocol and the monitor protocol share: magic,
//! version, kind, total size, and a CRC32C of the header's first 12 bytes followed by the
//! message's own fields (bytes 16..covered). Each protocol has its own magic, kinds and bodies.

use crate::bytes::{put_u16, put_u32, u16_at, u32_at};
use crate::crc::{crc32c, crc32c_append};

pub const HEADER_SIZE: usize = 16;

/// Writes the header of a message of `total` bytes whose bytes 16..`covered` are under the CRC.
pub(crate) fn seal(
    b: &mut [u8],
    magic: u32,
    version: u16,
    kind: u16,
    total: usize,
    covered: usize,
) {
    put_u32(b, 0, magic);
    put_u16(b, 4, version);
    put_u16(b, 6, kind);
    put_u32(b, 8, total as u32);
    let crc = header_crc(b, covered);
    put_u32(b, 12, crc);
}

/// CRC32C of the header's first 12 bytes followed by bytes 16..`covered`.
pub(crate) fn header_crc(b: &[u8], covered: usize) -> u32 {
    crc32c_append(crc32c(&b[..12]), &b[HEADER_SIZE..covered])
}

/// Whether the header's CRC matches bytes 16..`covered` (all present in `b`).
pub(crate) fn crc_ok(b: &[u8], covered: usize) -> bool {
    header_crc(b, covered) == u32_at(b, 12)
}

/// What is wrong with a header, before its protocol looks at the kind.
pub(crate) enum HeadFault {
    Magic(u32),
    Version(u16),
}

/// Magic and version of a header (at least `HEADER_SIZE` bytes); returns the raw kind and the
/// declared total size.
pub(crate) fn head(b: &[u8], magic: u32, version: u16) -> Result<(u16, usize), HeadFault> {
    let m = u32_at(b, 0);
    if m != magic {
        return Err(HeadFault::Magic(m));
    }
    let v = u16_at(b, 4);
    if v != version {
        return Err(HeadFault::Version(v));
    }
    Ok((u16_at(b, 6), u32_at(b, 8) as usize))
}

/// Whether a declared total size is possible: at least a header, at most the receiver's bound
/// (never below a header and 64 bytes, so small fixed messages always pass).
pub(crate) fn total_ok(total: usize, max_message: usize) -> bool {
    (HEADER_SIZE..=max_message.max(HEADER_SIZE + 64)).contains(&total)
}

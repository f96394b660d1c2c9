//! CRC-32C (Castagnoli), the checksum of every Tessera format. One place, so the implementation
//! is chosen by measurement, per size:
//!
//! - Blocks and files (64 KiB and up) go through `crc-fast` (carry-less multiply): 59 GB/s on
//!   16 KiB on a machine of this kind with AVX-512, where the `crc32c` crate ran at 13 GB/s; on
//!   one without (AVX2, VPCLMULQDQ) it ran at 18.7 GB/s against the `crc32c` crate's 24.
//! - Fragments (256 B to 64 KiB) go through the `crc32c` crate (the SSE 4.2 `crc32`
//!   instruction): `crc-fast` spends ~550 instructions per call computing a shift constant
//!   (`xnmodp_iscsi_sse`), which at 1 KiB was 10 % of every instruction of a build (callgrind,
//!   1 KiB x 8 sources) and made it 106 ns a call against 66 ns.
//! - Below 256 B without SSE 4.2, `crc-fast`'s own short path (7 ns against 10 at 64 B).
//! - Below 256 B, where the SSE 4.2 `crc32` instruction is there (every x86-64 of the last
//!   fifteen years), a loop of it written here: each fragment has three such CRCs (its header's
//!   at the source and at the readout unit, and the 4 bytes of its CRC that the event checksum
//!   appends at the builder), and both crates spend more on the call than on the bytes there.
//!   Measured per call on this machine (best of 5 x 20 M): 4 B 3.1 ns against 8.6 (`crc-fast`)
//!   and 9.6 (`crc32c`), 36 B 4.4 against 11.7 and 12.7, 200 B 13.2 against 19.1 and 25.5;
//!   under callgrind the build's instructions per fragment fell by ~220 (docs/PERFORMANCE.md).
//!
//! Appending continues from the previous CRC; no CRC is ever combined from two: a combine cost
//! 8-100 us here (both crates), more than computing a whole 1 MiB block (19 us).

use crc_fast::{CrcAlgorithm::Crc32Iscsi, Digest};

const SHORT: usize = 256;
const LONG: usize = 64 << 10;

#[cfg(target_arch = "x86_64")]
mod short {
    use std::arch::x86_64::{_mm_crc32_u32, _mm_crc32_u64, _mm_crc32_u8};

    /// The CRC register after `data`, from `reg` (no inversions: the caller's). Eight bytes a
    /// step, then four, then one at a time for the last three at most.
    #[target_feature(enable = "sse4.2")]
    fn update(reg: u32, data: &[u8]) -> u32 {
        let (words, rest) = data.as_chunks::<8>();
        let mut r = reg as u64;
        for w in words {
            r = _mm_crc32_u64(r, u64::from_le_bytes(*w));
        }
        let mut r = r as u32;
        let (quad, rest) = rest.as_chunks::<4>();
        if let Some(q) = quad.first() {
            r = _mm_crc32_u32(r, u32::from_le_bytes(*q));
        }
        for &b in rest {
            r = _mm_crc32_u8(r, b);
        }
        r
    }

    /// The CRC-32C continuing `crc` over `data`, if this processor has the instruction.
    #[inline]
    pub fn append(crc: u32, data: &[u8]) -> Option<u32> {
        if std::arch::is_x86_feature_detected!("sse4.2") {
            // SAFETY: `update` needs SSE 4.2 only, and the processor was just asked for it.
            Some(!unsafe { update(!crc, data) })
        } else {
            None
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod short {
    #[inline]
    pub fn append(_crc: u32, _data: &[u8]) -> Option<u32> {
        None
    }
}

/// CRC-32C of `data`.
#[inline]
pub fn crc32c(data: &[u8]) -> u32 {
    if data.len() < SHORT {
        if let Some(c) = short::append(0, data) {
            return c;
        }
    }
    if data.len() <= SHORT || data.len() >= LONG {
        crc_fast::checksum(Crc32Iscsi, data) as u32
    } else {
        crc32c::crc32c(data)
    }
}

/// The CRC-32C of the concatenation of the bytes that gave `crc` and `data`.
#[inline]
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    if data.len() < SHORT {
        if let Some(c) = short::append(crc, data) {
            return c;
        }
    }
    if data.len() < LONG {
        return crc32c::crc32c_append(crc, data);
    }
    // The digest's state is the CRC before its final inversion.
    let mut d = Digest::new_with_init_state(Crc32Iscsi, (crc ^ 0xffff_ffff) as u64);
    d.update(data);
    d.finalize() as u32
}

#[cfg(test)]
mod tests {
    #[test]
    fn agrees_with_the_reference() {
        assert_eq!(super::crc32c(b"123456789"), 0xE306_9283);
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 253) as u8).collect();
        assert_eq!(super::crc32c(&data), crc32c::crc32c(&data));
        let big: Vec<u8> = (0..200_000u32).map(|i| (i * 13 % 251) as u8).collect();
        for n in [0, 1, 255, 256, 257, 4096, 65_535, 65_536, 65_537, 200_000] {
            assert_eq!(super::crc32c(&big[..n]), crc32c::crc32c(&big[..n]), "{n}");
        }
        for cut in [0, 1, 100, 511, 512, 4000, 9999, 10_000] {
            let a = super::crc32c(&data[..cut]);
            assert_eq!(
                super::crc32c_append(a, &data[cut..]),
                crc32c::crc32c(&data),
                "cut {cut}"
            );
        }
        // Every short length, from every starting CRC kind: fresh, and continued.
        for n in 0..300 {
            let d = &big[1000..1000 + n];
            assert_eq!(super::crc32c(d), crc32c::crc32c(d), "short {n}");
            let a = super::crc32c(&big[..77]);
            assert_eq!(
                super::crc32c_append(a, d),
                crc32c::crc32c_append(a, d),
                "append {n}"
            );
        }
        for cut in [0, 1, 1000, 65_536, 100_000, 134_464, 199_999] {
            let a = super::crc32c(&big[..cut]);
            assert_eq!(
                super::crc32c_append(a, &big[cut..]),
                crc32c::crc32c(&big),
                "cut {cut}"
            );
        }
    }
}

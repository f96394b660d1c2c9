//! CRC-32C (Castagnoli), the checksum of every Tessera format. One place, so the implementation
//! is chosen by measurement, per size:
//!
//! - Blocks and files (64 KiB and up) go through `crc-fast` (carry-less multiply): 59 GB/s on
//!   16 KiB on a machine of this kind with AVX-512, where the `crc32c` crate ran at 13 GB/s; on
//!   one without (AVX2, VPCLMULQDQ) it ran at 18.7 GB/s against the `crc32c` crate's 24.
//! - Fragments (256 B to 64 KiB), where the SSE 4.2 `crc32` instruction and `pclmulqdq` are
//!   there, go through three interleaved streams of `crc32` written here (module `medium`):
//!   measured per call on this machine against the `crc32c` crate, 1 064 B 70 ns against 101,
//!   16 KiB 761 against 1 119, 300 B 34 against 51; callgrind, 375 instructions a 1 064 B call
//!   against 590 (the crate checks bounds on every word of its three streams and joins them
//!   through tables every 768 bytes, leaving up to 760 bytes to one stream). Elsewhere the
//!   `crc32c` crate (hardware CRC on aarch64 too); not `crc-fast`, which spends ~550
//!   instructions per call computing a shift constant (`xnmodp_iscsi_sse`): at 1 KiB 10 % of
//!   every instruction of a build, 106 ns a call against the crate's 66.
//! - Below 256 B without SSE 4.2, `crc-fast`'s own short path (7 ns against 10 at 64 B).
//! - Below 256 B, where the SSE 4.2 `crc32` instruction is there (every x86-64 of the last
//!   fifteen years), a loop of it written here: each fragment has three such CRCs (its header's
//!   at the source and at the readout unit, and the 4 bytes of its CRC that the event checksum
//!   appends at the builder), and both crates spend more on the call than on the bytes there.
//!   Measured per call on this machine (best of 5 x 20 M): 4 B 3.1 ns against 8.6 (`crc-fast`)
//!   and 9.6 (`crc32c`), 36 B 4.4 against 11.7 and 12.7, 200 B 13.2 against 19.1 and 25.5;
//!   under callgrind the build's instructions per fragment fell by ~220 (docs/PERFORMANCE.md).
//!
//! - From 2 KiB, where the processor has AVX-512 and VPCLMULQDQ, `crc-fast` again: its folding
//!   over 512-bit registers outruns three `crc32` streams once its per-call constant is paid.
//!   Measured per call on this machine (AMD EPYC, AVX-512; best of 5, `--example crc_rate`):
//!   2 KiB 46-64 ns against 90-113 (`medium`), 4 KiB 92-109 against 157-191, 16 KiB 347 against
//!   630, 32 KiB 573-638 against 1 132-1 264. Below 2 KiB the streams stay: at 1 KiB the
//!   crate's 39-60 ns against 51-67 is about 25 ns a fragment (its source's CRC and its readout
//!   unit's), and valgrind's processor has no AVX-512, so there the instructions counted per
//!   1 KiB fragment would no longer be those of the path that runs. Without AVX-512 nothing
//!   changes.
//!
//! Appending continues from the previous CRC; no two CRCs computed apart are combined: the
//! crates' combine cost 8-100 us here, more than computing a whole 1 MiB block (19 us). (The
//! three streams of `medium` are joined with a constant per length taken from a table.)

use crc_fast::{CrcAlgorithm::Crc32Iscsi, Digest};

const SHORT: usize = 256;
const LONG: usize = 64 << 10;
/// From here, `crc-fast` where [`wide_folding`] says it folds 512 bits a step.
const WIDE: usize = 2 << 10;

/// Whether `crc-fast` runs its AVX-512 VPCLMULQDQ path here (std caches the answers).
#[inline]
fn wide_folding() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("vpclmulqdq")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod short {
    use std::arch::x86_64::{_mm_crc32_u32, _mm_crc32_u64, _mm_crc32_u8};

    /// The CRC register after `data`, from `reg` (no inversions: the caller's). Eight bytes a
    /// step, then four, then one at a time for the last three at most.
    #[target_feature(enable = "sse4.2")]
    pub(super) fn update(reg: u32, data: &[u8]) -> u32 {
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

    /// `reg` after `bytes` zero bytes, without reading memory.
    #[target_feature(enable = "sse4.2")]
    fn over_zeros(reg: u32, bytes: usize) -> u32 {
        let mut r = reg as u64;
        for _ in 0..bytes / 8 {
            r = _mm_crc32_u64(r, 0);
        }
        let mut r = r as u32;
        if bytes & 4 != 0 {
            r = _mm_crc32_u32(r, 0);
        }
        for _ in 0..bytes & 3 {
            r = _mm_crc32_u8(r, 0);
        }
        r
    }

    /// [`over_zeros`], if this processor has the instruction.
    #[inline]
    pub fn shift(reg: u32, bytes: usize) -> Option<u32> {
        if std::arch::is_x86_feature_detected!("sse4.2") {
            // SAFETY: `over_zeros` needs SSE 4.2 only, and the processor was just asked.
            Some(unsafe { over_zeros(reg, bytes) })
        } else {
            None
        }
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

    /// [`update`] over a length known when compiling: no loop is left, only the `crc32`
    /// instructions.
    #[target_feature(enable = "sse4.2")]
    fn update_fixed<const N: usize>(reg: u32, data: &[u8; N]) -> u32 {
        update(reg, data)
    }

    /// The CRC-32C of `data`, whose length is known when compiling, if this processor has the
    /// instruction.
    #[inline]
    pub fn of_array<const N: usize>(data: &[u8; N]) -> Option<u32> {
        if std::arch::is_x86_feature_detected!("sse4.2") {
            // SAFETY: `update_fixed` needs SSE 4.2 only, and the processor was just asked.
            Some(!unsafe { update_fixed(!0, data) })
        } else {
            None
        }
    }
}

/// Fragments (256 B to 64 KiB): the `crc32` instruction over three streams at once, because
/// it takes three cycles and can start one a cycle. The data is cut into three equal runs of
/// whole words and a tail; the registers of the runs are joined by shifting one over the
/// length of the next with a carry-less multiply (one `pclmulqdq` and one `crc32` a join,
/// with the constant for that length from a table made once), so no length needs a table
/// of its own and the tail is under 24 bytes.
#[cfg(target_arch = "x86_64")]
mod medium {
    use std::arch::x86_64::_mm_crc32_u64;
    use std::arch::x86_64::{_mm_clmulepi64_si128, _mm_cvtsi128_si64, _mm_cvtsi64_si128};
    use std::sync::OnceLock;

    /// Longest run handled: a third of the largest medium length, in words.
    const MAX_WORDS: usize = (super::LONG / 24) + 1;
    /// The reflected polynomial of CRC-32C.
    const POLY: u32 = 0x82F6_3B78;

    /// x^n mod P as a reflected register (bit 31 is x^0), from x^m's register.
    fn times_x(mut r: u32, n: usize) -> u32 {
        for _ in 0..n {
            r = (r >> 1) ^ if r & 1 != 0 { POLY } else { 0 };
        }
        r
    }

    /// `K[k]` = x^(64k - 33) mod P: shifting a register over `k` words is
    /// `crc32(0, clmul(reg, K[k]))`, since the product of two reflected 32-bit values
    /// carries one more x and `crc32` of a word multiplies by x^32.
    fn constants() -> &'static [u32] {
        static K: OnceLock<Box<[u32]>> = OnceLock::new();
        K.get_or_init(|| {
            let mut k = vec![0u32; MAX_WORDS + 1];
            // x^31: bit 0.
            let mut r = 1u32;
            for slot in k.iter_mut().skip(1) {
                *slot = r;
                r = times_x(r, 64);
            }
            k.into_boxed_slice()
        })
    }

    #[inline]
    #[target_feature(enable = "sse4.2,pclmulqdq")]
    fn shift(reg: u32, k: u32) -> u32 {
        let p = _mm_clmulepi64_si128(
            _mm_cvtsi64_si128(reg as i64),
            _mm_cvtsi64_si128(k as i64),
            0,
        );
        _mm_crc32_u64(0, _mm_cvtsi128_si64(p) as u64) as u32
    }

    #[target_feature(enable = "sse4.2,pclmulqdq")]
    fn update(reg: u32, data: &[u8]) -> u32 {
        let (words, _) = data.as_chunks::<8>();
        let k = words.len() / 3;
        if k == 0 || k > MAX_WORDS {
            return super::short::update(reg, data);
        }
        let (a, rest) = words.split_at(k);
        let (b, rest) = rest.split_at(k);
        let c = &rest[..k];
        let (mut ra, mut rb, mut rc) = (reg as u64, 0u64, 0u64);
        // Eight words of each run a step: the loop's own counting and branching was a third of
        // the instructions at two words a step, a tenth at four.
        let (a4, a1) = a.as_chunks::<8>();
        let (b4, b1) = b.as_chunks::<8>();
        let (c4, c1) = c.as_chunks::<8>();
        for ((x, y), z) in a4.iter().zip(b4).zip(c4) {
            for i in 0..8 {
                ra = _mm_crc32_u64(ra, u64::from_le_bytes(x[i]));
                rb = _mm_crc32_u64(rb, u64::from_le_bytes(y[i]));
                rc = _mm_crc32_u64(rc, u64::from_le_bytes(z[i]));
            }
        }
        for ((x, y), z) in a1.iter().zip(b1).zip(c1) {
            ra = _mm_crc32_u64(ra, u64::from_le_bytes(*x));
            rb = _mm_crc32_u64(rb, u64::from_le_bytes(*y));
            rc = _mm_crc32_u64(rc, u64::from_le_bytes(*z));
        }
        let kk = constants()[k];
        let r = shift(ra as u32, kk) ^ rb as u32;
        let r = shift(r, kk) ^ rc as u32;
        super::short::update(r, &data[24 * k..])
    }

    /// The CRC-32C continuing `crc` over `data`, if this processor has the instructions.
    #[inline]
    pub fn append(crc: u32, data: &[u8]) -> Option<u32> {
        if std::arch::is_x86_feature_detected!("sse4.2")
            && std::arch::is_x86_feature_detected!("pclmulqdq")
        {
            // SAFETY: `update` needs SSE 4.2 and PCLMULQDQ, and the processor was just asked.
            Some(!unsafe { update(!crc, data) })
        } else {
            None
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod medium {
    #[inline]
    pub fn append(_crc: u32, _data: &[u8]) -> Option<u32> {
        None
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod short {
    #[inline]
    pub fn append(_crc: u32, _data: &[u8]) -> Option<u32> {
        None
    }

    #[inline]
    pub fn shift(_reg: u32, _bytes: usize) -> Option<u32> {
        None
    }

    #[inline]
    pub fn of_array<const N: usize>(_data: &[u8; N]) -> Option<u32> {
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
    let wide = data.len() >= WIDE && wide_folding();
    if data.len() < LONG && !wide {
        if let Some(c) = medium::append(0, data) {
            return c;
        }
    }
    if data.len() <= SHORT || data.len() >= LONG || wide {
        crc_fast::checksum(Crc32Iscsi, data) as u32
    } else {
        crc32c::crc32c(data)
    }
}

/// CRC-32C of `data`, of a length known when compiling (a fragment header's 36 bytes): the
/// same value as [`crc32c`], without the loop and the choice by size. Each fragment's header CRC
/// is computed at its source and checked at its readout unit, and the general call spent 62
/// instructions on 36 bytes (callgrind).
#[inline]
pub fn crc32c_array<const N: usize>(data: &[u8; N]) -> u32 {
    if N < SHORT {
        if let Some(c) = short::of_array(data) {
            return c;
        }
    }
    crc32c(data)
}

/// The CRC-32C of the concatenation of the bytes that gave `crc` and `data`.
#[inline]
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    if data.len() < SHORT {
        if let Some(c) = short::append(crc, data) {
            return c;
        }
    }
    if data.len() < LONG && (data.len() < WIDE || !wide_folding()) {
        if let Some(c) = medium::append(crc, data) {
            return c;
        }
        return crc32c::crc32c_append(crc, data);
    }
    // The digest's state is the CRC before its final inversion.
    let mut d = Digest::new_with_init_state(Crc32Iscsi, (crc ^ 0xffff_ffff) as u64);
    d.update(data);
    d.finalize() as u32
}

/// The reflected polynomial of CRC-32C.
const POLY: u32 = 0x82F6_3B78;

/// `a` times `b` modulo the polynomial, both reflected registers (bit 31 is x^0).
const fn mul_mod(a: u32, mut b: u32) -> u32 {
    let mut p = 0u32;
    let mut m = 1u32 << 31;
    while m != 0 {
        if a & m != 0 {
            p ^= b;
        }
        b = (b >> 1) ^ if b & 1 != 0 { POLY } else { 0 };
        m >>= 1;
    }
    p
}

/// `X2N[k]` = x^(2^k) mod P.
const X2N: [u32; 67] = {
    let mut t = [0u32; 67];
    t[0] = 1 << 30;
    let mut k = 1;
    while k < t.len() {
        t[k] = mul_mod(t[k - 1], t[k - 1]);
        k += 1;
    }
    t
};

/// A CRC register (no inversions) moved over `bytes` zero bytes: what lets registers of
/// consecutive pieces, each computed from zero where its bytes were at hand, be joined in order
/// later without reading the bytes again (`reg(a ++ b) = shift(reg(a), len(b)) ^ reg_from_zero(b)`).
/// Up to 4 KiB, the `crc32` instruction over zeros, one a word: for a part of n fragments
/// (4n bytes of trailer CRCs) n/2 instructions, what gathering them cost. Beyond, or without
/// the instruction, a multiply per set bit of `bytes`, each 32 steps: still not the 8-100 us
/// of the crates' general combine.
pub fn shift_register(reg: u32, bytes: u64) -> u32 {
    if bytes <= 4096 {
        if let Some(r) = short::shift(reg, bytes as usize) {
            return r;
        }
    }
    shift_by_multiplying(reg, bytes)
}

fn shift_by_multiplying(reg: u32, bytes: u64) -> u32 {
    let mut x = 1u32 << 31;
    let mut n = bytes;
    // x^8 is X2N[3]: bit k of `bytes` multiplies by x^(8 * 2^k).
    let mut k = 3;
    while n != 0 {
        if n & 1 != 0 {
            x = mul_mod(X2N[k], x);
        }
        n >>= 1;
        k += 1;
    }
    mul_mod(x, reg)
}

/// The CRC register (no inversions) after `data`, from `reg`.
#[inline]
pub fn register_after(reg: u32, data: &[u8]) -> u32 {
    !crc32c_append(!reg, data)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_fixed_length_agrees_with_the_general_call() {
        let data: Vec<u8> = (0..300u32).map(|i| (i * 11 % 251) as u8).collect();
        fn check<const N: usize>(d: &[u8]) {
            let a: &[u8; N] = d[..N].try_into().unwrap();
            assert_eq!(super::crc32c_array(a), crc32c::crc32c(a), "{N}");
        }
        check::<0>(&data);
        check::<1>(&data);
        check::<4>(&data);
        check::<7>(&data);
        check::<36>(&data);
        check::<37>(&data);
        check::<255>(&data);
        check::<256>(&data);
        check::<300>(&data);
    }

    /// The three streams stay the path of every length to 64 KiB on a processor without
    /// AVX-512, so they are checked at every length here whichever path this one takes.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_three_streams_agree_with_the_reference_where_wide_folding_takes_over() {
        let data: Vec<u8> = (0..70_000u32).map(|i| (i * 37 % 253) as u8).collect();
        for len in (super::WIDE - 30..super::WIDE + 30).chain([
            4_095,
            4_096,
            16_384,
            16_420,
            40_000,
            super::LONG - 1,
        ]) {
            let Some(c) = super::medium::append(0x0BAD_CAFE, &data[..len]) else {
                return;
            };
            assert_eq!(c, crc32c::crc32c_append(0x0BAD_CAFE, &data[..len]), "{len}");
        }
    }

    #[test]
    fn registers_computed_apart_join_to_the_whole() {
        let data: Vec<u8> = (0..5_000u32).map(|i| (i * 29 % 251) as u8).collect();
        for (cut, end) in [
            (0, 0),
            (0, 4),
            (4, 4),
            (7, 100),
            (100, 4_096),
            (1_000, 5_000),
        ] {
            let (a, b) = (&data[..cut], &data[cut..end]);
            let joined = super::shift_register(super::register_after(!0, a), b.len() as u64)
                ^ super::register_after(0, b);
            assert_eq!(!joined, crc32c::crc32c(&data[..end]), "cut {cut} end {end}");
        }
        assert_eq!(super::shift_register(0x1234_5678, 0), 0x1234_5678);
        // Both ways of shifting (the instruction over zeros, the multiplies) agree.
        for bytes in [1u64, 3, 4, 5, 8, 100, 4_095, 4_096] {
            let zeros = vec![0u8; bytes as usize];
            let by_multiply = super::shift_by_multiplying(0xCAFE_F00D, bytes);
            assert_eq!(
                super::register_after(0xCAFE_F00D, &zeros),
                by_multiply,
                "{bytes}"
            );
            assert_eq!(
                super::shift_register(0xCAFE_F00D, bytes),
                by_multiply,
                "{bytes}"
            );
        }
        let long = vec![0u8; 10_000];
        assert_eq!(
            super::shift_register(7, 10_000),
            super::register_after(7, &long)
        );
    }

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

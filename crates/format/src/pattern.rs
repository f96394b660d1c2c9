//! Verifiable payload patterns. A payload is a pure function of (pattern, source ID, event ID,
//! length), so `tessera verify` can regenerate it and compare byte for byte: a payload moved to the
//! wrong event, the wrong source or the wrong offset fails.

/// A payload pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Pattern {
    /// 64-bit words `seed + i * φ` (wrapping): cheap to make and check, incompressible.
    #[default]
    Counter,
    /// 16-bit samples of a 12-bit ADC: a pedestal, a few counts of noise and one pulse per
    /// fragment; compresses like real digitiser data.
    Adc,
}

impl Pattern {
    /// The pattern is named in the run configuration and the file sidecar, never on the wire.
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Counter => "counter",
            Pattern::Adc => "adc",
        }
    }

    pub fn from_name(s: &str) -> Option<Pattern> {
        match s {
            "counter" => Some(Pattern::Counter),
            "adc" => Some(Pattern::Adc),
            _ => None,
        }
    }

    /// Writes the payload of (source, event) into `out`.
    pub fn fill(self, source: u32, event: u64, out: &mut [u8]) {
        match self {
            Pattern::Counter => fill_counter(seed(source, event), out),
            Pattern::Adc => fill_adc(seed(source, event), source, out),
        }
    }

    /// Offset of the first byte that differs from the expected payload, if any.
    pub fn check(self, source: u32, event: u64, payload: &[u8]) -> Option<usize> {
        let mut buf = [0u8; 4096];
        let mut off = 0;
        // Regenerate in pieces so checking needs no allocation; both patterns are defined per
        // 8-byte word / 2-byte sample, so a piece can start at any multiple of 8.
        while off < payload.len() {
            let n = (payload.len() - off).min(buf.len());
            self.fill_at(source, event, off, &mut buf[..n]);
            if buf[..n] != payload[off..off + n] {
                let k = buf[..n]
                    .iter()
                    .zip(&payload[off..off + n])
                    .position(|(a, b)| a != b)
                    .unwrap_or(0);
                return Some(off + k);
            }
            off += n;
        }
        None
    }

    fn fill_at(self, source: u32, event: u64, offset: usize, out: &mut [u8]) {
        let s = seed(source, event);
        match self {
            Pattern::Counter => fill_counter_from(s, offset / 8, out),
            Pattern::Adc => fill_adc_from(s, source, offset / 2, out),
        }
    }
}

const PHI: u64 = 0x9E37_79B9_7F4A_7C15;

fn seed(source: u32, event: u64) -> u64 {
    let mut z = event ^ ((source as u64) << 40) ^ 0x5EED_0000_0000_0001;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn fill_counter(s: u64, out: &mut [u8]) {
    fill_counter_from(s, 0, out)
}

fn fill_counter_from(s: u64, first_word: usize, out: &mut [u8]) {
    let w = s.wrapping_add((first_word as u64).wrapping_mul(PHI));
    let (words, tail) = out.as_chunks_mut::<8>();
    let w = fill_words(w, words);
    let n = tail.len();
    if n > 0 {
        tail.copy_from_slice(&w.to_le_bytes()[..n]);
    }
}

/// Writes counter words `w, w + φ, ...` into `words`; returns the next word.
fn fill_words(w: u64, words: &mut [[u8; 8]]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    let w = if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected on this processor just above.
        unsafe { fill_words_avx2(w, words) }
    } else {
        // SAFETY: SSE2 is part of every x86-64 processor, so there is nothing to detect.
        unsafe { fill_words_sse2(w, words) }
    };
    #[cfg(not(target_arch = "x86_64"))]
    let w = fill_words_scalar(w, words);
    w
}

fn fill_words_scalar(mut w: u64, words: &mut [[u8; 8]]) -> u64 {
    for c in words {
        *c = w.to_le_bytes();
        w = w.wrapping_add(PHI);
    }
    w
}

/// Eight words a step as four pairs, each pair one add and one store: the source's payload
/// fill was a tenth of a 1 KiB build's instructions at one add and one store a word.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse2")]
fn fill_words_sse2(w: u64, words: &mut [[u8; 8]]) -> u64 {
    use std::arch::x86_64::{
        __m128i, _mm_add_epi64, _mm_set1_epi64x, _mm_set_epi64x, _mm_storeu_si128,
    };
    let (octs, rest) = words.as_chunks_mut::<8>();
    let pair = |k: u64| {
        let a = w.wrapping_add(PHI.wrapping_mul(2 * k));
        _mm_set_epi64x(a.wrapping_add(PHI) as i64, a as i64)
    };
    let mut v = [pair(0), pair(1), pair(2), pair(3)];
    let step = _mm_set1_epi64x(PHI.wrapping_mul(8) as i64);
    for o in octs.iter_mut() {
        let p = o.as_mut_ptr() as *mut __m128i;
        for (i, x) in v.iter_mut().enumerate() {
            // SAFETY: `o` is 64 writable bytes, so `p.add(i)` for i < 4 is 16 of them; the
            // store has no alignment requirement.
            unsafe { _mm_storeu_si128(p.add(i), *x) };
            *x = _mm_add_epi64(*x, step);
        }
    }
    let w = w.wrapping_add(PHI.wrapping_mul(8 * octs.len() as u64));
    fill_words_scalar(w, rest)
}

/// Sixteen words a step as four quadruples, each one add and one store: half the steps of
/// [`fill_words_sse2`] (callgrind, `tessera bench instructions`: see docs/PERFORMANCE.md).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn fill_words_avx2(w: u64, words: &mut [[u8; 8]]) -> u64 {
    use std::arch::x86_64::{
        __m256i, _mm256_add_epi64, _mm256_set1_epi64x, _mm256_set_epi64x, _mm256_storeu_si256,
    };
    let (steps, rest) = words.as_chunks_mut::<16>();
    let quad = |k: u64| {
        let a = w.wrapping_add(PHI.wrapping_mul(4 * k));
        _mm256_set_epi64x(
            a.wrapping_add(PHI.wrapping_mul(3)) as i64,
            a.wrapping_add(PHI.wrapping_mul(2)) as i64,
            a.wrapping_add(PHI) as i64,
            a as i64,
        )
    };
    let mut v = [quad(0), quad(1), quad(2), quad(3)];
    let step = _mm256_set1_epi64x(PHI.wrapping_mul(16) as i64);
    for o in steps.iter_mut() {
        let p = o.as_mut_ptr() as *mut __m256i;
        for (i, x) in v.iter_mut().enumerate() {
            // SAFETY: `o` is 128 writable bytes, so `p.add(i)` for i < 4 is 32 of them; the
            // store has no alignment requirement.
            unsafe { _mm256_storeu_si256(p.add(i), *x) };
            *x = _mm256_add_epi64(*x, step);
        }
    }
    let w = w.wrapping_add(PHI.wrapping_mul(16 * steps.len() as u64));
    // AVX2 implies SSE2: a safe call from here.
    fill_words_sse2(w, rest)
}

fn fill_adc(s: u64, source: u32, out: &mut [u8]) {
    fill_adc_from(s, source, 0, out)
}

/// Sample i = pedestal + noise(i) + pulse(i), clamped to 12 bits.
fn fill_adc_from(s: u64, source: u32, first_sample: usize, out: &mut [u8]) {
    let pedestal = 200 + (source % 64) as i32 * 4;
    let pulse_at = (s % 997) as i64;
    let amplitude = 300 + ((s >> 20) % 3000) as i32;
    let mut chunks = out.chunks_exact_mut(2);
    for (i, c) in (first_sample as u64..).zip(&mut chunks) {
        let mut x = s ^ i.wrapping_mul(PHI);
        x ^= x >> 29;
        x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let noise = ((x >> 59) as i32) - 16; // -16..15
        let dt = i as i64 - pulse_at;
        let pulse = if (0..64).contains(&dt) {
            amplitude >> (dt / 8)
        } else {
            0
        };
        let v = (pedestal + noise + pulse).clamp(0, 4095) as u16;
        c.copy_from_slice(&v.to_le_bytes());
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        tail[0] = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_accepts_own_fill_and_finds_flips() {
        for p in [Pattern::Counter, Pattern::Adc] {
            for len in [0usize, 1, 7, 8, 9, 4095, 4096, 4097, 10_000] {
                let mut v = vec![0u8; len];
                p.fill(3, 77, &mut v);
                assert_eq!(p.check(3, 77, &v), None, "{p:?} {len}");
                if len > 0 {
                    assert!(p.check(4, 77, &v).is_some() || len < 2);
                    let k = len / 2;
                    v[k] ^= 1;
                    assert_eq!(p.check(3, 77, &v), Some(k));
                }
            }
        }
    }

    /// The counter's vector fill writes exactly the words of its definition, word `i` =
    /// `seed + i * φ`, for every length around its 64- and 128-byte steps, and a payload that is
    /// regenerated in pieces from any word offset (`check`) agrees with it.
    #[test]
    fn counter_is_its_definition() {
        let s = seed(9, 12_345);
        for len in 0..300 {
            let mut v = vec![0u8; len];
            Pattern::Counter.fill(9, 12_345, &mut v);
            let want: Vec<u8> = (0..len.div_ceil(8) as u64)
                .flat_map(|i| s.wrapping_add(i.wrapping_mul(PHI)).to_le_bytes())
                .take(len)
                .collect();
            assert_eq!(v, want, "{len}");
            for first in [1usize, 3, 8] {
                let mut piece = vec![0u8; len];
                fill_counter_from(s, first, &mut piece);
                assert_eq!(
                    piece[..len.saturating_sub(8 * first)],
                    want[(8 * first).min(len)..]
                );
            }
        }
    }

    /// Each vector fill, not only the one this processor dispatches to, writes the words the
    /// scalar definition writes and returns the same next word.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_vector_fill_agrees_with_the_scalar_one() {
        let w = seed(3, 77);
        for n in 0..70 {
            let mut want = vec![[0u8; 8]; n];
            let next = fill_words_scalar(w, &mut want);
            let mut sse2 = vec![[0u8; 8]; n];
            // SAFETY: SSE2 is part of every x86-64 processor.
            assert_eq!(unsafe { fill_words_sse2(w, &mut sse2) }, next, "{n}");
            assert_eq!(sse2, want, "{n}");
            if std::arch::is_x86_feature_detected!("avx2") {
                let mut avx2 = vec![[0u8; 8]; n];
                // SAFETY: AVX2 was detected just above.
                assert_eq!(unsafe { fill_words_avx2(w, &mut avx2) }, next, "{n}");
                assert_eq!(avx2, want, "{n}");
            }
        }
    }

    #[test]
    fn adc_is_twelve_bit() {
        let mut v = vec![0u8; 2048];
        Pattern::Adc.fill(1, 2, &mut v);
        assert!(v
            .chunks_exact(2)
            .all(|c| u16::from_le_bytes([c[0], c[1]]) < 4096));
    }
}

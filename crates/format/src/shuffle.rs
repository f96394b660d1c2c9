//! Byte-shuffle filter (as Blosc and HDF5 use it): groups the k-th byte of every `elem`-byte
//! element together, so the slowly varying high bytes of ADC samples sit side by side and
//! compress far better and faster. Bytes past the last whole element are copied unchanged.

/// Shuffles `src` into `dst` (same length).
pub fn shuffle(elem: usize, src: &[u8], dst: &mut [u8]) {
    assert_eq!(src.len(), dst.len());
    let n = src.len() / elem;
    if elem == 2 {
        let (lo, hi) = dst[..2 * n].split_at_mut(n);
        let done = simd::split2(&src[..2 * n], lo, hi);
        for i in done..n {
            lo[i] = src[2 * i];
            hi[i] = src[2 * i + 1];
        }
    } else {
        for i in 0..n {
            for k in 0..elem {
                dst[k * n + i] = src[i * elem + k];
            }
        }
    }
    dst[n * elem..].copy_from_slice(&src[n * elem..]);
}

/// Inverse of [`shuffle`].
pub fn unshuffle(elem: usize, src: &[u8], dst: &mut [u8]) {
    assert_eq!(src.len(), dst.len());
    let n = src.len() / elem;
    if elem == 2 {
        let (lo, hi) = src[..2 * n].split_at(n);
        let done = simd::join2(lo, hi, &mut dst[..2 * n]);
        for i in done..n {
            dst[2 * i] = lo[i];
            dst[2 * i + 1] = hi[i];
        }
    } else {
        for i in 0..n {
            for k in 0..elem {
                dst[i * elem + k] = src[k * n + i];
            }
        }
    }
    dst[n * elem..].copy_from_slice(&src[n * elem..]);
}

/// The 2-byte case, 16 elements at a time with SSE2 (part of every x86_64): the compiler does
/// not vectorise the stride-2 loop by itself, and the scalar loop ran at 1.4 GB/s, a fifth of the
/// recorder's CPU with lz4 (perf, 16 KiB adc events); this runs at 17 GB/s on the same machine.
/// Elsewhere nothing is done here and the scalar loop does it all.
mod simd {
    /// Splits pairs of `src` into `lo` and `hi` for as many whole groups of 16 as fit; how many
    /// elements it did.
    #[cfg(target_arch = "x86_64")]
    pub fn split2(src: &[u8], lo: &mut [u8], hi: &mut [u8]) -> usize {
        use std::arch::x86_64::*;
        let whole = lo.len().min(hi.len()).min(src.len() / 2) / 16 * 16;
        for ((s, l), h) in src[..2 * whole]
            .chunks_exact(32)
            .zip(lo[..whole].chunks_exact_mut(16))
            .zip(hi[..whole].chunks_exact_mut(16))
        {
            // SAFETY: SSE2 is baseline on x86_64; every load and store is an unaligned one
            // inside the 32- or 16-byte chunk just taken.
            unsafe {
                let a = _mm_loadu_si128(s.as_ptr() as *const __m128i);
                let b = _mm_loadu_si128(s.as_ptr().add(16) as *const __m128i);
                let m = _mm_set1_epi16(0x00FF);
                let even = _mm_packus_epi16(_mm_and_si128(a, m), _mm_and_si128(b, m));
                let odd = _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8));
                _mm_storeu_si128(l.as_mut_ptr() as *mut __m128i, even);
                _mm_storeu_si128(h.as_mut_ptr() as *mut __m128i, odd);
            }
        }
        whole
    }

    /// Interleaves `lo` and `hi` into pairs of `dst`, as [`split2`] in reverse.
    #[cfg(target_arch = "x86_64")]
    pub fn join2(lo: &[u8], hi: &[u8], dst: &mut [u8]) -> usize {
        use std::arch::x86_64::*;
        let whole = lo.len().min(hi.len()).min(dst.len() / 2) / 16 * 16;
        for ((l, h), d) in lo[..whole]
            .chunks_exact(16)
            .zip(hi[..whole].chunks_exact(16))
            .zip(dst[..2 * whole].chunks_exact_mut(32))
        {
            // SAFETY: as in `split2`.
            unsafe {
                let a = _mm_loadu_si128(l.as_ptr() as *const __m128i);
                let b = _mm_loadu_si128(h.as_ptr() as *const __m128i);
                _mm_storeu_si128(d.as_mut_ptr() as *mut __m128i, _mm_unpacklo_epi8(a, b));
                _mm_storeu_si128(
                    d.as_mut_ptr().add(16) as *mut __m128i,
                    _mm_unpackhi_epi8(a, b),
                );
            }
        }
        whole
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub fn split2(_: &[u8], _: &mut [u8], _: &mut [u8]) -> usize {
        0
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub fn join2(_: &[u8], _: &[u8], _: &mut [u8]) -> usize {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_odd_lengths() {
        for elem in [2usize, 4] {
            for len in [0usize, 1, 2, 3, 7, 64, 1001] {
                let src: Vec<u8> = (0..len).map(|i| (i * 37 % 251) as u8).collect();
                let mut mid = vec![0; len];
                let mut back = vec![0; len];
                shuffle(elem, &src, &mut mid);
                unshuffle(elem, &mid, &mut back);
                assert_eq!(src, back);
            }
        }
    }

    /// The vector path against the definition, over lengths around its 32-byte groups.
    #[test]
    fn the_vector_path_matches_the_definition() {
        for len in (0usize..200).chain([4095, 4096, 4097, 65537]) {
            let src: Vec<u8> = (0..len).map(|i| (i * 131 % 253) as u8).collect();
            let n = len / 2;
            let mut want = src.clone();
            for i in 0..n {
                want[i] = src[2 * i];
                want[n + i] = src[2 * i + 1];
            }
            let mut got = vec![0; len];
            shuffle(2, &src, &mut got);
            assert_eq!(got, want, "len {len}");
            let mut back = vec![0; len];
            unshuffle(2, &got, &mut back);
            assert_eq!(back, src, "len {len}");
        }
    }

    #[test]
    fn groups_bytes() {
        let mut d = [0u8; 4];
        shuffle(2, &[1, 2, 3, 4], &mut d);
        assert_eq!(d, [1, 3, 2, 4]);
    }
}

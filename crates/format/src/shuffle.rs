//! Byte-shuffle filter (as Blosc and HDF5 use it): groups the k-th byte of every `elem`-byte
//! element together, so the slowly varying high bytes of ADC samples sit side by side and
//! compress far better and faster. Bytes past the last whole element are copied unchanged.

/// Shuffles `src` into `dst` (same length).
pub fn shuffle(elem: usize, src: &[u8], dst: &mut [u8]) {
    assert_eq!(src.len(), dst.len());
    let n = src.len() / elem;
    if elem == 2 {
        let (lo, hi) = dst[..2 * n].split_at_mut(n);
        for (i, pair) in src[..2 * n].chunks_exact(2).enumerate() {
            lo[i] = pair[0];
            hi[i] = pair[1];
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
        for (i, pair) in dst[..2 * n].chunks_exact_mut(2).enumerate() {
            pair[0] = lo[i];
            pair[1] = hi[i];
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

    #[test]
    fn groups_bytes() {
        let mut d = [0u8; 4];
        shuffle(2, &[1, 2, 3, 4], &mut d);
        assert_eq!(d, [1, 3, 2, 4]);
    }
}

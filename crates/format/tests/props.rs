//! Property tests: round trips, resynchronisation, and no panic on any input.

use proptest::prelude::*;
use tessera_format::file::{
    decode_block, BlockEncoder, BlockHeader, Codec, FileHeader, FileTrailer, Filter,
};
use tessera_format::link::{decode_link, Fragments};
use tessera_format::wire::{encode_fragment, FragmentHeader, Hello, StreamEnd};
use tessera_format::{Decoded, StreamDecoder};

fn header() -> impl Strategy<Value = FragmentHeader> {
    (any::<u16>(), any::<u16>(), any::<u64>(), any::<u64>()).prop_map(|(status, tt, ev, ts)| {
        FragmentHeader {
            status,
            source_id: 5,
            trigger_type: tt,
            event_id: ev,
            timestamp: ts,
            payload_size: 0,
        }
    })
}

/// Feeds `stream` to a decoder in pieces of the given sizes, as a socket would, and collects items.
fn decode_in_pieces(stream: &[u8], cuts: &[usize], max: usize) -> Vec<(Decoded, Vec<u8>)> {
    let mut d = StreamDecoder::new(max, None);
    let mut out = Vec::new();
    let mut avail = 0usize;
    let mut pos = 0usize;
    let mut cut_iter = cuts.iter().cycle();
    loop {
        let eof = avail == stream.len();
        if eof {
            d.finish();
        }
        let s = d.next(&stream[pos..avail]);
        match s.item {
            Decoded::Idle | Decoded::NeedMore(_) => {
                if eof {
                    break;
                }
                avail = (avail + cut_iter.next().copied().unwrap_or(1).max(1)).min(stream.len());
                continue;
            }
            item => {
                assert!(
                    s.consumed > 0 || matches!(item, Decoded::BadHello(_)),
                    "no progress on {item:?}"
                );
                out.push((item, stream[pos..pos + s.consumed].to_vec()));
                pos += s.consumed;
                if matches!(item, Decoded::BadHello(_)) {
                    break;
                }
            }
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Every format's CRC-32C, whichever implementation a size goes to (the short loop below
    /// 256 B, the three streams to 64 KiB or to 2 KiB, `crc-fast` above), equals the reference crate's,
    /// fresh and appended.
    #[test]
    fn crc32c_agrees_with_the_reference_at_every_size(
        data in proptest::collection::vec(any::<u8>(), 0..1200),
        cut in 0usize..1200,
        start in any::<u32>(),
    ) {
        let cut = cut.min(data.len());
        prop_assert_eq!(tessera_format::crc::crc32c(&data), crc32c::crc32c(&data));
        prop_assert_eq!(
            tessera_format::crc::crc32c_append(start, &data[cut..]),
            crc32c::crc32c_append(start, &data[cut..])
        );
        let head = tessera_format::crc::crc32c(&data[..cut]);
        prop_assert_eq!(
            tessera_format::crc::crc32c_append(head, &data[cut..]),
            crc32c::crc32c(&data)
        );
    }

    /// The same across every path's edges up to 70 000 bytes: each length of the three streams
    /// has its own joining constant, 64 KiB is where they stop, and 2 KiB where `crc-fast`
    /// takes over on a processor with AVX-512.
    #[test]
    fn crc32c_agrees_with_the_reference_up_to_blocks(
        len in prop_oneof![0usize..70_000, 65_400usize..65_600, 240usize..300, 2_000usize..2_100],
        seed in any::<u8>(),
        start in any::<u32>(),
    ) {
        let data: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect();
        prop_assert_eq!(tessera_format::crc::crc32c(&data), crc32c::crc32c(&data));
        prop_assert_eq!(
            tessera_format::crc::crc32c_append(start, &data),
            crc32c::crc32c_append(start, &data)
        );
    }

    /// An event checksum gathered part by part (trailer CRCs joined by shifting, as a builder
    /// does while it reads each part) equals the checksum over the whole, for any cut into
    /// parts, and a register shifted over zeros equals the CRC of the zeros appended.
    #[test]
    fn trailer_crcs_gathered_apart_join_to_the_checksum(
        header in proptest::collection::vec(any::<u8>(), 48..120),
        fragments in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 12..40), 0..300),
        cuts in proptest::collection::vec(0usize..300, 0..6),
        reg in any::<u32>(),
        zeros in 0usize..9000,
    ) {
        use tessera_format::event::{EventRecordHeader, TrailerCrcs};
        let whole = EventRecordHeader::checksum_over(&header, fragments.iter().map(|f| &f[..]));
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(fragments.len())).collect();
        cuts.push(fragments.len());
        cuts.sort_unstable();
        let (mut joined, mut from) = (TrailerCrcs::default(), 0);
        for c in cuts {
            let mut g = TrailerCrcs::gather();
            for f in &fragments[from..c] {
                g.add_fragment(f);
            }
            joined = joined.then(g.finish());
            from = c;
        }
        prop_assert_eq!(joined.checksum(&header), whole);
        prop_assert_eq!(
            tessera_format::crc::shift_register(reg, zeros as u64),
            tessera_format::crc::register_after(reg, &vec![0u8; zeros])
        );
    }

    #[test]
    fn fragments_round_trip(hs in proptest::collection::vec((header(), proptest::collection::vec(any::<u8>(), 0..300)), 1..8),
                            cuts in proptest::collection::vec(1usize..97, 1..5)) {
        let mut s = Hello::new(5).encode().to_vec();
        for (h, p) in &hs {
            encode_fragment(&mut s, h, p);
        }
        s.extend(StreamEnd { source_id: 5, fragments_sent: hs.len() as u64 }.encode());
        let items = decode_in_pieces(&s, &cuts, 1 << 16);
        prop_assert_eq!(items.len(), hs.len() + 2);
        for ((item, bytes), (h, p)) in items[1..].iter().zip(&hs) {
            match item {
                Decoded::Fragment(got) => {
                    prop_assert_eq!(got.event_id, h.event_id);
                    prop_assert_eq!(got.trigger_type, h.trigger_type);
                    prop_assert_eq!(got.timestamp, h.timestamp);
                    prop_assert_eq!(got.status, h.status);
                    let (view, _) = tessera_format::FragmentView::parse(bytes, 1 << 16).unwrap();
                    prop_assert_eq!(view.payload(), &p[..]);
                }
                other => prop_assert!(false, "expected fragment, got {:?}", other),
            }
        }
        let is_end = matches!(items.last().unwrap().0, Decoded::End(_));
        prop_assert!(is_end);
    }

    #[test]
    fn decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..2000), cuts in proptest::collection::vec(1usize..300, 1..4)) {
        let mut s = Hello::new(5).encode().to_vec();
        s.extend(bytes);
        let items = decode_in_pieces(&s, &cuts, 512);
        let consumed: usize = items.iter().map(|(_, b)| b.len()).sum();
        prop_assert!(consumed <= s.len());
    }

    /// Damage one fragment among many: exactly that fragment is lost and counted once, the rest
    /// come through.
    #[test]
    fn one_damaged_fragment_costs_one(n in 3usize..10, victim_sel in any::<usize>(), kind in 0u8..4, pos_sel in any::<usize>()) {
        let victim = victim_sel % n;
        let mut s = Hello::new(5).encode().to_vec();
        for ev in 0..n as u64 {
            let mut f = Vec::new();
            let payload: Vec<u8> = (0..(64 + ev as usize * 8)).map(|i| (i as u8).wrapping_mul(7)).collect();
            encode_fragment(&mut f, &FragmentHeader { source_id: 5, event_id: ev, ..Default::default() }, &payload);
            if ev as usize == victim {
                match kind {
                    0 => { let k = 40 + pos_sel % (f.len() - 48); f[k] ^= 0x5A; }      // payload bit flip: bad CRC
                    1 => { f[pos_sel % 4] ^= 0x11; }                                    // start marker
                    2 => { let k = 40 + pos_sel % (f.len() - 40); f.truncate(k); }      // truncation
                    _ => { let k = pos_sel % 36; f[k] ^= 0x01; }                        // header field
                }
            }
            s.extend(f);
        }
        let items = decode_in_pieces(&s, &[1000], 1 << 16);
        let good: Vec<u64> = items.iter().filter_map(|(i, _)| match i { Decoded::Fragment(h) => Some(h.event_id), _ => None }).collect();
        let rejected = items.iter().filter(|(i, _)| matches!(i, Decoded::Rejected { .. })).count();
        let expected: Vec<u64> = (0..n as u64).filter(|&e| e as usize != victim).collect();
        prop_assert_eq!(good, expected);
        prop_assert_eq!(rejected, 1);
    }

    #[test]
    fn link_decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        let mut b = &bytes[..];
        while let Ok((item, n)) = decode_link(b, 4096) {
            if n == 0 { break; }
            if let tessera_format::link::LinkItem::SuperFragment(h) = &item {
                for f in Fragments::new(&b[h.header_size()..n]) { let _ = f; }
            }
            b = &b[n..];
            let _ = item;
        }
        let _ = FileHeader::decode(&bytes);
        let _ = FileTrailer::decode(&bytes);
        if let Ok(h) = BlockHeader::decode(&bytes, 0) {
            let (mut s, mut o) = (Vec::new(), Vec::new());
            if (h.raw_size as usize) < (1 << 20) {
                let _ = decode_block(&h, &bytes[32.min(bytes.len())..], &mut s, &mut o);
            }
        }
    }

    #[test]
    fn blocks_round_trip(raw in proptest::collection::vec(any::<u8>(), 0..5000), codec in 0u8..3, shuffle in any::<bool>()) {
        let codec = Codec::from_u8(codec).unwrap();
        let filter = if shuffle { Filter::Shuffle2 } else { Filter::None };
        let mut enc = BlockEncoder::default();
        let (h, stored) = enc.encode(&raw, codec, filter, 1, 3, 42);
        let stored = stored.to_vec();
        let h2 = BlockHeader::decode(&h.encode(), 0).unwrap();
        prop_assert_eq!(h, h2);
        let (mut s, mut out) = (Vec::new(), Vec::new());
        decode_block(&h2, &stored, &mut s, &mut out).unwrap();
        prop_assert_eq!(out, raw);
    }
}

//! Damaged files: `verify` never panics, and any single flipped byte is reported.

use proptest::prelude::*;
use std::collections::HashSet;
use tessera_format::event::{EventFlags, EventRecordHeader};
use tessera_format::file::{BlockEncoder, Codec, FileHeader, FileTrailer, Filter};
use tessera_format::pattern::Pattern;
use tessera_format::wire::{encode_fragment_with, FragmentHeader};

/// A small valid file: `events` events of two sources with counter payloads.
fn valid_file(codec: Codec, events: u64) -> Vec<u8> {
    file_with(codec, events, None)
}

/// A file whose event `drop` lacks source 1 without being flagged incomplete.
fn file_with(codec: Codec, events: u64, drop: Option<u64>) -> Vec<u8> {
    let mut raw = Vec::new();
    let mut frags_total = 0;
    for ev in 0..events {
        let mut frags = Vec::new();
        let mut spans = Vec::new();
        for src in 0..2u32 {
            if drop == Some(ev) && src == 1 {
                continue;
            }
            let start = frags.len();
            let h = FragmentHeader {
                source_id: src,
                event_id: ev,
                trigger_type: 1,
                payload_size: 40 + 8 * ev as u32,
                ..Default::default()
            };
            encode_fragment_with(&mut frags, &h, |p| Pattern::Counter.fill(src, ev, p));
            spans.push(start..frags.len());
        }
        let mut h = EventRecordHeader {
            event_id: ev,
            trigger_type: 1,
            fragment_count: spans.len() as u32,
            flags: EventFlags(0),
            ..Default::default()
        };
        h.record_size = (h.header_size() + frags.len()) as u32;
        let mut rec = Vec::new();
        h.encode_into(&mut rec);
        let crc = EventRecordHeader::checksum_over(&rec, spans.iter().map(|r| &frags[r.clone()]));
        EventRecordHeader::seal(&mut rec, crc);
        rec.extend_from_slice(&frags);
        raw.extend_from_slice(&rec);
        frags_total += spans.len() as u64;
    }
    let mut file = FileHeader {
        run_number: 1,
        file_sequence: 1,
        codec,
        filter: Filter::None,
        start_time_ns: 0,
        config_digest: [0; 32],
    }
    .encode()
    .to_vec();
    let mut enc = BlockEncoder::default();
    let (bh, stored) = enc.encode(&raw, codec, Filter::None, 1, events as u32, 0);
    file.extend_from_slice(&bh.encode());
    file.extend_from_slice(stored);
    let t = FileTrailer {
        events,
        incomplete_events: 0,
        fragments: frags_total,
        record_bytes: raw.len() as u64,
        blocks: 1,
        file_crc: tessera_format::crc::crc32c(&file),
    };
    file.extend_from_slice(&t.encode());
    file
}

fn verify_bytes(bytes: &[u8]) -> tessera_verify::FileReport {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("run000001_0001.tsr");
    std::fs::write(&p, bytes).unwrap();
    let mut seen = HashSet::new();
    let mut dups = 0;
    tessera_verify::verify_file(&p, &mut seen, &mut dups)
}

#[test]
fn the_valid_file_verifies() {
    for codec in [Codec::None, Codec::Lz4, Codec::Zstd] {
        let r = verify_bytes(&valid_file(codec, 5));
        assert!(r.ok, "{codec:?}: {:?}", r.problems);
        assert_eq!(r.events, 5);
    }
}

#[test]
fn an_unflagged_missing_source_is_found_without_a_sidecar() {
    let r = verify_bytes(&file_with(Codec::None, 5, Some(3)));
    assert!(!r.ok);
    assert!(
        r.problems
            .iter()
            .any(|p| p == "event 3: sources [1] neither present nor flagged missing"),
        "{:?}",
        r.problems
    );
    assert_eq!(r.problems.len(), 1, "{:?}", r.problems);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn any_flipped_byte_is_reported(codec in 0u8..3, pos in any::<prop::sample::Index>(), bit in 0u8..8) {
        let mut f = valid_file(Codec::from_u8(codec).unwrap(), 4);
        let i = pos.index(f.len());
        f[i] ^= 1 << bit;
        let r = verify_bytes(&f);
        prop_assert!(!r.ok, "flipping bit {} of byte {} went unnoticed", bit, i);
    }

    #[test]
    fn truncated_or_random_files_never_panic(cut in any::<prop::sample::Index>(), junk in proptest::collection::vec(any::<u8>(), 0..200)) {
        let f = valid_file(Codec::None, 3);
        let n = cut.index(f.len());
        let r = verify_bytes(&f[..n]);
        prop_assert!(!r.ok);
        let mut g = f[..n].to_vec();
        g.extend_from_slice(&junk);
        let _ = verify_bytes(&g);
        let _ = verify_bytes(&junk);
    }
}

/// Issue 11, probe 15: a block header claiming a gigabyte in a cut file is a truncated file,
/// read only as far as the file goes.
#[test]
fn a_block_size_past_the_end_of_the_file_is_truncation() {
    use tessera_format::file::{BlockHeader, MAX_BLOCK_SIZE};
    let mut bytes = valid_file(Codec::None, 3);
    let at = tessera_format::file::FILE_HEADER_SIZE;
    let mut h = [0u8; 32];
    h.copy_from_slice(&bytes[at..at + 32]);
    let mut bh = BlockHeader::decode(&h, at as u64).unwrap();
    bh.stored_size = MAX_BLOCK_SIZE as u32;
    bh.raw_size = MAX_BLOCK_SIZE as u32;
    bytes[at..at + 32].copy_from_slice(&bh.encode());
    let mut r = tessera_verify::FileReader::new(std::io::Cursor::new(bytes)).unwrap();
    match r.next_block() {
        Err(tessera_verify::ReadError::Format(tessera_format::file::FileError::Truncated)) => {}
        Err(e) => panic!("expected truncation, got {e}"),
        Ok(_) => panic!("a cut block was read"),
    }
}

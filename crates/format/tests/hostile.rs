//! Probes from issue 11 that crashed or would have crashed a component, kept as regression
//! tests: a count or size from a peer or a file is checked against what contains it before it
//! sizes anything.

use tessera_format::event::{EventError, EventRecordHeader, EVENT_HEADER_SIZE, EVENT_MARKER};
use tessera_format::link::{decode_link, LinkError, SuperFragmentHeader};

/// Probe 12: one super-fragment with an absurd fragment count aborted the builder's process
/// (`Vec::with_capacity` of the count).
#[test]
fn a_super_fragment_whose_count_its_bytes_cannot_hold_is_refused() {
    let mut b = Vec::new();
    SuperFragmentHeader {
        readout_unit: 0,
        event_id: 1,
        fragment_count: u32::MAX,
        total_size: 32 + 48,
        missing: vec![],
    }
    .encode_into(&mut b);
    b.extend_from_slice(&[0u8; 48]);
    assert_eq!(
        decode_link(&b, 1 << 20),
        Err(LinkError::BadSize("super-fragment fragment count"))
    );
    // One fragment fits in 48 bytes: that count is fine (framing is checked later).
    b[12..16].copy_from_slice(&1u32.to_le_bytes());
    assert!(decode_link(&b, 1 << 20).is_ok());
}

/// Probe 12, Python side: a 48-byte record claiming 2^32-1 fragments aborted the interpreter.
#[test]
fn an_event_record_whose_count_its_bytes_cannot_hold_is_refused() {
    let h = EventRecordHeader {
        event_id: 1,
        fragment_count: u32::MAX,
        record_size: EVENT_HEADER_SIZE as u32,
        ..Default::default()
    };
    let mut b = Vec::new();
    h.encode_into(&mut b);
    assert_eq!(
        u32::from_le_bytes(b[0..4].try_into().unwrap()),
        EVENT_MARKER
    );
    assert_eq!(
        EventRecordHeader::decode_prefix(&b, 1 << 20),
        Err(EventError::BadFragmentCount)
    );
}

/// Probe 15: a corrupt block header made a reader allocate ~3 GiB before looking at the file.
#[test]
fn a_block_claiming_more_raw_bytes_than_its_stored_bytes_can_hold_is_refused() {
    use tessera_format::file::{decode_block, BlockHeader, Codec, Filter};
    let stored = lz4_flex::block::compress(&[7u8; 1000]);
    for (codec, stored) in [
        (Codec::Lz4, stored.clone()),
        (Codec::Zstd, zstd::bulk::compress(&[7u8; 1000], 3).unwrap()),
    ] {
        let h = BlockHeader {
            codec,
            filter: Filter::None,
            stored_size: stored.len() as u32,
            raw_size: 1 << 30,
            event_count: 1,
            raw_crc: 0,
            first_event_id: 0,
        };
        let (mut scratch, mut out) = (Vec::new(), Vec::new());
        assert!(decode_block(&h, &stored, &mut scratch, &mut out).is_err());
        assert!(out.capacity() < 1 << 20, "{codec:?}: sized by the header");
    }
}

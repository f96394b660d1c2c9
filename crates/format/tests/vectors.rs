//! Test vectors: the exact bytes `docs/wire-format.md` and `docs/file-format.md` show. Another
//! implementation can check itself against the same hex.

use tessera_format::event::{EventFlags, EventRecordHeader};
use tessera_format::file::{BlockHeader, Codec, FileHeader, FileTrailer, Filter};
use tessera_format::link::{PeerEnd, PeerHello, PeerRole, SuperFragmentHeader};
use tessera_format::wire::{encode_fragment, FragmentHeader, Hello, StreamEnd};

fn h(s: &str) -> Vec<u8> {
    hex::decode(s.split_whitespace().collect::<String>()).unwrap()
}

pub const HELLO_SOURCE_7: &str = "eeaa11ee 0100 1000 07000000 00000000";

pub const FRAGMENT_SOURCE_7_EVENT_42: &str = "
    ee3412ee 01 28 0000 07000000 0200 0000 2a00000000000000 e803000000000000 05000000 ec93099f
    0102030405 000000
    cb7fc4c0 ee7856dd";

pub const EOS_SOURCE_7: &str = "ee050eee 0100 1800 07000000 00000000 0300000000000000";

#[test]
fn hello_vector() {
    assert_eq!(Hello::new(7).encode().to_vec(), h(HELLO_SOURCE_7));
}

#[test]
fn fragment_vector() {
    let mut v = Vec::new();
    let hd = FragmentHeader {
        status: 0,
        source_id: 7,
        trigger_type: 2,
        event_id: 42,
        timestamp: 1000,
        payload_size: 5,
    };
    encode_fragment(&mut v, &hd, &[1, 2, 3, 4, 5]);
    assert_eq!(hex::encode(&v), hex::encode(h(FRAGMENT_SOURCE_7_EVENT_42)));
}

#[test]
fn eos_vector() {
    assert_eq!(
        StreamEnd {
            source_id: 7,
            fragments_sent: 3
        }
        .encode()
        .to_vec(),
        h(EOS_SOURCE_7)
    );
}

#[test]
fn link_vectors() {
    let hello = PeerHello {
        role: PeerRole::ReadoutUnit,
        id: 1,
        flags: 0,
    }
    .encode();
    assert_eq!(
        hex::encode(hello),
        "eebb22ee0300100001000000".to_string() + "01000000"
    );
    let end = PeerEnd {
        role: PeerRole::BuilderUnit,
        id: 0,
        units: 2,
        fragments: 16,
    }
    .encode();
    assert_eq!(
        hex::encode(end),
        "ee0e0eee030020000200000000000000".to_string() + "02000000000000001000000000000000"
    );
    let mut sf = Vec::new();
    SuperFragmentHeader {
        readout_unit: 1,
        event_id: 42,
        fragment_count: 1,
        total_size: 36 + 64,
        missing: vec![9],
    }
    .encode_into(&mut sf);
    assert_eq!(
        hex::encode(sf),
        "ee4653ee0300240001000000010000002a00000000000000640000000100000009000000"
    );
}

#[test]
fn event_and_file_vectors() {
    let hd = EventRecordHeader {
        flags: EventFlags(EventFlags::INCOMPLETE),
        event_id: 42,
        timestamp: 1000,
        trigger_type: 2,
        builder_id: 1,
        fragment_count: 1,
        record_size: 52 + 64,
        missing: vec![9],
        checksum: 0,
    };
    let mut b = Vec::new();
    hd.encode_into(&mut b);
    assert_eq!(
        hex::encode(&b),
        "ee5645ee0100340074000000010000002a00000000000000e8030000000000000200010001000000010000000000000009000000"
    );
    let fh = FileHeader {
        run_number: 12,
        file_sequence: 3,
        codec: Codec::Lz4,
        filter: Filter::Shuffle2,
        start_time_ns: 5,
        config_digest: [0xAB; 32],
    };
    let enc = fh.encode();
    assert_eq!(&enc[..8], b"\x89TSR\r\n\x1a\n");
    assert_eq!(FileHeader::decode(&enc).unwrap(), fh);
    let bh = BlockHeader {
        codec: Codec::Lz4,
        filter: Filter::Shuffle2,
        stored_size: 10,
        raw_size: 20,
        event_count: 2,
        raw_crc: 0xdeadbeef,
        first_event_id: 7,
    };
    assert_eq!(
        hex::encode(bh.encode()),
        "ee4c42ee010100000a0000001400000002000000efbeadde0700000000000000"
    );
    let t = FileTrailer {
        events: 1,
        incomplete_events: 1,
        fragments: 1,
        record_bytes: 116,
        blocks: 1,
        file_crc: 0x01020304,
    };
    assert_eq!(FileTrailer::decode(&t.encode()).unwrap(), t);
}

/// Every vector in the documents matches the implementation, byte for byte.
#[test]
fn documents_match_implementation() {
    let docs: String = [
        "../../docs/wire-format.md",
        "../../docs/file-format.md",
        "../../docs/request-protocol.md",
        "../../docs/monitor-protocol.md",
    ]
    .iter()
    .map(|p| std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{p}: {e}")))
    .collect();
    for (name, bytes) in tessera_format::vectors::all() {
        let marker = format!("Vector: {name} (");
        let at = docs
            .find(&marker)
            .unwrap_or_else(|| panic!("vector `{name}` is not in the docs"));
        let rest = &docs[at..];
        let start = rest.find("```hex").expect("hex block") + 6;
        let end = start + rest[start..].find("```").expect("end of hex block");
        let doc_hex: String = rest[start..end].split_whitespace().collect();
        assert_eq!(
            doc_hex,
            hex::encode(&bytes),
            "vector `{name}` in the docs differs from the implementation"
        );
    }
}

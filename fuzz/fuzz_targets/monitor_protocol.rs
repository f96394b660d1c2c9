//! The monitor protocol (docs/monitor-protocol.md): every message decoded, the event records
//! of `events` and `put` messages walked.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tessera_format::event::EventRecordHeader;
use tessera_format::monitor::{decode, Decoded};

fuzz_target!(|data: &[u8]| {
    let max = 1 << 16;
    let mut b = data;
    loop {
        match decode(b, max) {
            Ok(Decoded::Message {
                data_start,
                consumed,
                ..
            }) => {
                assert!(consumed > 0 && consumed <= b.len());
                assert!(data_start <= consumed);
                let mut records = &b[data_start..consumed];
                while let Ok(Some((_, n))) =
                    EventRecordHeader::decode_prefix(records, records.len())
                {
                    assert!(n > 0 && n <= records.len());
                    records = &records[n..];
                }
                b = &b[consumed..];
            }
            Ok(Decoded::NeedMore(n)) => {
                assert!(n > b.len(), "asked for bytes it has");
                return;
            }
            Err(_) => return,
        }
    }
});

//! Selection predicates (monitor stations): any text parsed, and what parses evaluated on an
//! event header made from the rest of the input.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tessera_format::event::{EventFlags, EventRecordHeader};
use tessera_format::select::Predicate;

fuzz_target!(|data: &[u8]| {
    let Some((head, text)) = data.split_first_chunk::<24>() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(text) else {
        return;
    };
    let Ok(p) = Predicate::parse(text) else {
        return;
    };
    let u = |i: usize| u64::from_le_bytes(head[i..i + 8].try_into().unwrap());
    let h = EventRecordHeader {
        flags: EventFlags(u(0) as u32),
        event_id: u(8),
        timestamp: u(16),
        trigger_type: (u(0) >> 32) as u16,
        builder_id: (u(0) >> 48) as u16,
        fragment_count: u(16) as u32,
        record_size: (u(8) >> 32) as u32,
        missing: vec![head[0] as u32; (head[1] % 4) as usize],
        checksum: 0,
    };
    let _ = p.eval(&h);
});

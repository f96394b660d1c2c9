//! A recorded file (docs/file-format.md): header, blocks (decompressed), the event records in
//! them and their fragments, the trailer; and a selection predicate evaluated on every event.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tessera_format::event::EventRecordHeader;
use tessera_format::file::{
    decode_block, next_is_trailer, BlockHeader, FileHeader, FileTrailer, BLOCK_HEADER_SIZE,
    FILE_HEADER_SIZE,
};
use tessera_format::link::Fragments;
use tessera_format::select::Predicate;

fuzz_target!(|data: &[u8]| {
    if FileHeader::decode(data).is_err() {
        return;
    }
    let selection = Predicate::parse("flags & 1 != 0 || event_id % 3 == 1").unwrap();
    let (mut scratch, mut raw) = (Vec::new(), Vec::new());
    let mut pos = FILE_HEADER_SIZE;
    while pos + 4 <= data.len() {
        let rest = &data[pos..];
        if next_is_trailer(rest) {
            let _ = FileTrailer::decode(rest);
            return;
        }
        let Ok(bh) = BlockHeader::decode(rest, pos as u64) else {
            return;
        };
        let Some(stored) = rest
            .get(BLOCK_HEADER_SIZE..)
            .and_then(|s| s.get(..bh.stored_size as usize))
        else {
            return;
        };
        if decode_block(&bh, stored, &mut scratch, &mut raw).is_err() {
            return;
        }
        let mut r = &raw[..];
        while let Ok(Some((h, n))) = EventRecordHeader::decode_prefix(r, r.len()) {
            assert!(n >= h.header_size() && n <= r.len());
            let _ = selection.eval(&h);
            for f in Fragments::new(&r[h.header_size()..n]) {
                if f.is_err() {
                    break;
                }
            }
            r = &r[n..];
        }
        pos += BLOCK_HEADER_SIZE + stored.len();
    }
});

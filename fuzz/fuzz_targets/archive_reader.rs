//! A recorded file read as `tessera verify`, the shipper and Python read it: through the archive
//! library's `FileReader`, block by block, each block's events and their fragments, to the
//! trailer and past it.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tessera_archive::{events_in, FileReader};

fuzz_target!(|data: &[u8]| {
    let Ok(mut r) = FileReader::new(data) else {
        return;
    };
    while let Ok(Some((_, raw))) = r.next_block() {
        for e in events_in(raw) {
            let Ok(e) = e else { break };
            for f in e.fragments() {
                if f.is_err() {
                    break;
                }
            }
        }
    }
    let _ = r.bytes_after_trailer();
});

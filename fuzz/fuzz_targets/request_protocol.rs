//! The request protocol (docs/request-protocol.md): every message of a connection decoded.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tessera_format::request::{decode, Decoded};

fuzz_target!(|data: &[u8]| {
    let max = 1 << 16;
    let mut b = data;
    loop {
        match decode(b, max) {
            Ok(Decoded::Message(_, n)) => {
                assert!(n > 0 && n <= b.len(), "consumed {n} of {}", b.len());
                b = &b[n..];
            }
            Ok(Decoded::NeedMore(n)) => {
                assert!(n > b.len(), "asked for bytes it has");
                return;
            }
            Err(_) => return,
        }
    }
});

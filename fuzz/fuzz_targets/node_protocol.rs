//! The node protocol (docs/node-protocol.md): every frame of a connection decoded, both ways.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tessera_node_protocol::{decode_frame, Reply, Request, MAX_HELLO};

fuzz_target!(|data: &[u8]| {
    let mut b = data;
    while let Ok(Some((_, n))) = decode_frame::<Request>(b, MAX_HELLO) {
        assert!(n >= 4 && n <= b.len(), "consumed {n} of {}", b.len());
        b = &b[n..];
    }
    let _ = decode_frame::<Reply>(data, MAX_HELLO);
});

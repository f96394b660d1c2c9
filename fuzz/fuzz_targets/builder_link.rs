//! A builder link (readout unit → builder, builder → recorder; docs/wire-format.md §2): every
//! message decoded, the fragments of every super-fragment and event record walked.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tessera_format::link::{decode_link, Fragments, LinkItem};

fuzz_target!(|data: &[u8]| {
    let max = 1 << 16;
    let mut b = data;
    loop {
        let (item, n) = match decode_link(b, max) {
            Ok(x) => x,
            Err(_) => return,
        };
        let body_from = match &item {
            LinkItem::NeedMore(want) => {
                assert!(*want > b.len(), "asked for bytes it has");
                return;
            }
            LinkItem::Idle => return,
            LinkItem::SuperFragment(h) => Some(h.header_size()),
            LinkItem::Event(h) => Some(h.header_size()),
            _ => None,
        };
        assert!(n > 0 && n <= b.len(), "consumed {n} of {}", b.len());
        assert!(n <= max, "a message beyond the maximum was taken");
        if let Some(from) = body_from {
            assert!(from <= n);
            for f in Fragments::new(&b[from..n]) {
                match f {
                    Ok(f) => assert!(f.payload_range().end <= n - from),
                    Err(_) => break,
                }
            }
        }
        b = &b[n..];
    }
});

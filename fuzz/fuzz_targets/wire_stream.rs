//! A source connection's byte stream (wire format, docs/wire-format.md §1), cut into reads at
//! the places the input chooses, through the readout unit's incremental decoder.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tessera_format::wire::{Decoded, StreamDecoder};

fuzz_target!(|data: &[u8]| {
    let Some((&[cut, mode], stream)) = data.split_first_chunk::<2>() else {
        return;
    };
    let cut = cut as usize % 61 + 1;
    let expected = (mode & 1 == 1).then_some(7);
    let mut d = StreamDecoder::new(4096, expected);
    let mut buf: Vec<u8> = Vec::new();
    let mut fed = 0;
    let mut finished = false;
    loop {
        let mut idle_steps = 0;
        loop {
            let s = d.next(&buf);
            assert!(s.consumed <= buf.len(), "consumed past the input");
            match s.item {
                Decoded::NeedMore(n) => {
                    assert!(n > buf.len(), "asked for bytes it has");
                    assert!(n <= d.max_message(), "asked for more than its bound");
                    assert!(!finished, "waits for bytes after the end of input");
                    break;
                }
                Decoded::Idle => {
                    buf.drain(..s.consumed);
                    break;
                }
                // The connection is closed on a refused hello.
                Decoded::BadHello(_) => return,
                _ => {}
            }
            buf.drain(..s.consumed);
            idle_steps = if s.consumed == 0 { idle_steps + 1 } else { 0 };
            assert!(idle_steps < 3, "no progress: {:?}", s.item);
        }
        if finished {
            assert!(
                buf.is_empty(),
                "bytes left unaccounted after the end of input"
            );
            break;
        }
        if fed == stream.len() {
            d.finish();
            finished = true;
            continue;
        }
        let n = cut.min(stream.len() - fed);
        buf.extend_from_slice(&stream[fed..fed + n]);
        fed += n;
    }
});

//! Tessera's formats, byte by byte, with no I/O: the fragment wire format that sources speak
//! (`wire`), the readout-unit-to-builder link (`link`), the request and monitor protocols
//! (`request`, `monitor`), predicates on event headers (`select`), the event record that builders emit and
//! files store (`event`), the file container (`file`), and the verifiable payload patterns
//! (`pattern`). Everything here works on byte slices, so it can be fuzzed, shared with Python and
//! used by any transport. The normative description is `docs/wire-format.md` and
//! `docs/file-format.md`; the test vectors in `tests/vectors.rs` pin both.

pub mod auth;
pub mod bytes;
pub mod crc;
pub mod event;
pub mod file;
mod frame;
pub mod link;
pub mod monitor;
pub mod pattern;
pub mod request;
pub mod select;
pub mod shuffle;
pub mod vectors;
pub mod wire;

pub use event::{EventFlags, EventRecordHeader};
pub use wire::{
    Decoded, FragmentHeader, FragmentView, Hello, RejectReason, StreamDecoder, StreamEnd,
};

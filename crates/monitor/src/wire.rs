//! Reading and writing monitor-protocol messages on a socket, shared by server and client.
//!
//! A message is read whole into its own buffer, so the records of an `Events` or `Put` message
//! are slices of it (no copy per event); records are written from the events' own buffers with
//! one vectored write per batch.

use bytes::Bytes;
use std::io::{self, IoSlice, Read, Write};

use tessera_format::monitor::{decode, encode_events_header, Decoded, Entry, Message, HEADER_SIZE};

use crate::chain::Event;

/// A message and the record bytes that followed its table (empty for other kinds).
pub struct Received {
    pub message: Message,
    pub data: Bytes,
}

fn invalid(e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}

/// Reads one whole message. A protocol error is `InvalidData`; a closed peer `UnexpectedEof`.
pub fn read_message(r: &mut impl Read, max_message: usize) -> io::Result<Received> {
    let mut head = [0u8; HEADER_SIZE];
    r.read_exact(&mut head)?;
    // The decoder checks magic, version, kind and the size bound before we allocate for it.
    let need = match decode(&head, max_message).map_err(invalid)? {
        Decoded::NeedMore(n) => n,
        Decoded::Message { .. } => HEADER_SIZE,
    };
    let total = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes")) as usize;
    let want = total.max(need);
    let mut buf = Vec::with_capacity(want);
    buf.extend_from_slice(&head);
    // read_to_end fills the spare capacity without zeroing it first: a batch of events is
    // written to memory once, by the kernel.
    r.by_ref()
        .take((want - HEADER_SIZE) as u64)
        .read_to_end(&mut buf)?;
    if buf.len() != want {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed inside a message",
        ));
    }
    match decode(&buf, max_message).map_err(invalid)? {
        Decoded::Message {
            message,
            data_start,
            consumed,
        } => {
            if consumed != buf.len() {
                return Err(invalid("message size disagrees with its table"));
            }
            let data = Bytes::from(buf).slice(data_start..consumed);
            Ok(Received { message, data })
        }
        Decoded::NeedMore(_) => Err(invalid("message size disagrees with its table")),
    }
}

pub fn write_message(w: &mut impl Write, m: &Message) -> io::Result<()> {
    w.write_all(&m.encode())
}

/// Writes an `Events` message from the events' own buffers.
pub fn write_events(w: &mut impl Write, events: &[Event]) -> io::Result<()> {
    let entries: Vec<Entry> = events
        .iter()
        .map(|e| Entry {
            seq: e.seq,
            len: e.bytes.len() as u32,
        })
        .collect();
    let mut head = Vec::with_capacity(HEADER_SIZE + 8 + 16 * entries.len());
    encode_events_header(&mut head, &entries);
    let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(1 + events.len());
    slices.push(IoSlice::new(&head));
    slices.extend(events.iter().map(|e| IoSlice::new(&e.bytes)));
    // The kernel takes at most IOV_MAX (1024) slices per call.
    for chunk in slices.chunks_mut(1024) {
        tessera_net::io::write_all_vectored(w, chunk)?;
    }
    Ok(())
}

/// Splits the records of an `Events` or `Put` message by its table (entries with `len == 0` get
/// an empty slice).
pub fn split_records(entries: &[Entry], data: &Bytes) -> Vec<Bytes> {
    let mut at = 0usize;
    entries
        .iter()
        .map(|e| {
            let b = data.slice(at..at + e.len as usize);
            at += e.len as usize;
            b
        })
        .collect()
}

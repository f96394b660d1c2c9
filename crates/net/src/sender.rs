//! The sending side of a link between Tessera's roles (readout unit → builder, builder →
//! recorder): one thread per link takes batches from a bounded queue, coalesces what is queued,
//! and writes every unit's header and fragments with vectored writes straight from the read
//! chunks. It opens the link with a peer hello and, once the queue is closed, ends it with a
//! peer end carrying the counts, then waits for the peer to close (it has then read everything).

use crossbeam_channel::Receiver;
use std::io::{self, IoSlice};
use std::net::TcpStream;
use std::time::Duration;

use tessera_format::link::{PeerEnd, PeerHello};

use crate::ChunkSlice;

/// Most units gathered into one vectored write when the queue holds several batches.
const COALESCE: usize = 512;

/// A unit sent on a link: a super-fragment or an event record.
pub trait Outgoing: Send {
    /// Appends this unit's header to `out`.
    fn encode_header(&self, out: &mut Vec<u8>);
    /// The fragments that follow the header, verbatim.
    fn fragments(&self) -> &[ChunkSlice];
}

/// What happened to one batch, for the sender's counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchOutcome {
    pub units: u64,
    pub fragments: u64,
    /// Bytes of the batch on the wire (headers and fragments).
    pub bytes: u64,
    /// False once the link has failed: the batch was dropped (and must be counted as lost).
    pub written: bool,
}

/// Runs the link until `rx` closes. `on_batch` is told the fate of every batch (after its write);
/// `on_error` once, when the link fails.
pub fn send_loop<T: Outgoing>(
    mut stream: TcpStream,
    rx: Receiver<Vec<T>>,
    hello: PeerHello,
    mut on_batch: impl FnMut(BatchOutcome, &[T]),
    mut on_error: impl FnMut(&io::Error),
) {
    let mut ok =
        match crate::io::write_all_vectored(&mut stream, &mut [IoSlice::new(&hello.encode())]) {
            Ok(()) => true,
            Err(e) => {
                on_error(&e);
                false
            }
        };
    let mut headers: Vec<u8> = Vec::new();
    let mut offsets: Vec<(usize, usize)> = Vec::new();
    let (mut units, mut fragments) = (0u64, 0u64);
    while let Ok(mut batch) = rx.recv() {
        // Several batches per write when they are queued: fewer system calls under load.
        while batch.len() < COALESCE {
            match rx.try_recv() {
                Ok(more) => batch.extend(more),
                Err(_) => break,
            }
        }
        let nfrag: u64 = batch.iter().map(|u| u.fragments().len() as u64).sum();
        let mut nbytes: u64 = batch
            .iter()
            .flat_map(|u| u.fragments())
            .map(|f| f.len() as u64)
            .sum();
        if ok {
            headers.clear();
            offsets.clear();
            for u in &batch {
                let start = headers.len();
                u.encode_header(&mut headers);
                offsets.push((start, headers.len()));
            }
            nbytes += headers.len() as u64;
            let mut io: Vec<IoSlice> = Vec::with_capacity(batch.len() * 9);
            for (u, &(s, e)) in batch.iter().zip(&offsets) {
                io.push(IoSlice::new(&headers[s..e]));
                io.extend(u.fragments().iter().map(|f| IoSlice::new(f)));
            }
            if let Err(e) = crate::io::write_all_vectored(&mut stream, &mut io) {
                on_error(&e);
                ok = false;
            }
        }
        if ok {
            units += batch.len() as u64;
            fragments += nfrag;
        }
        on_batch(
            BatchOutcome {
                units: batch.len() as u64,
                fragments: nfrag,
                bytes: nbytes,
                written: ok,
            },
            &batch,
        );
    }
    if ok {
        let end = PeerEnd {
            role: hello.role,
            id: hello.id,
            units,
            fragments,
        }
        .encode();
        let _ = crate::io::write_all_vectored(&mut stream, &mut [IoSlice::new(&end)]);
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let _ = stream.set_read_timeout(Some(Duration::from_secs(60)));
        let _ = std::io::Read::read(&mut stream, &mut [0u8; 64]);
    }
}

//! The sending side of a link between Tessera's roles (readout unit → builder, builder →
//! recorder): one thread per link takes batches from a bounded queue, coalesces what is queued,
//! and writes every unit's header and fragments with vectored writes straight from the read
//! chunks. It opens the link with a peer hello and, once the queue is closed, ends it with a
//! peer end carrying the counts, then waits for the peer to close (it has then read everything).

use crossbeam_channel::{Receiver, RecvTimeoutError};
use std::io::{self, IoSlice};
use std::net::TcpStream;
use std::time::{Duration, Instant};

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

/// A message the sender writes between batches at least every `every`, whether or not batches
/// flow (a readout unit's progress message). `message` sees the queue, so that it can decline
/// (return `None`) while units it must not overtake are still queued; it is asked again after
/// the next batch or the next interval.
pub struct Beat<'a, T> {
    pub every: Duration,
    #[allow(clippy::type_complexity)]
    pub message: &'a mut dyn FnMut(&Receiver<Vec<T>>) -> Option<Vec<u8>>,
}

/// Runs the link until `rx` closes. `on_batch` is told the fate of every batch (after its write);
/// `on_error` once, when the link fails.
pub fn send_loop<T: Outgoing>(
    stream: TcpStream,
    rx: Receiver<Vec<T>>,
    hello: PeerHello,
    on_batch: impl FnMut(BatchOutcome, &[T]),
    on_error: impl FnMut(&io::Error),
) {
    send_loop_beating(stream, rx, hello, on_batch, on_error, None, true)
}

/// [`send_loop`] with a [`Beat`]. `wait_close`: after the peer end, wait here for the peer to
/// close the link (false when another thread reads the link, as a builder's acknowledgement
/// reader does, and waits for the close itself).
pub fn send_loop_beating<T: Outgoing>(
    mut stream: TcpStream,
    rx: Receiver<Vec<T>>,
    hello: PeerHello,
    mut on_batch: impl FnMut(BatchOutcome, &[T]),
    mut on_error: impl FnMut(&io::Error),
    mut beat: Option<Beat<'_, T>>,
    wait_close: bool,
) {
    let ok = match crate::io::write_all_vectored(&mut stream, &mut [IoSlice::new(&hello.encode())])
    {
        Ok(()) => true,
        Err(e) => {
            on_error(&e);
            false
        }
    };
    let mut st = LinkState {
        ok,
        units: 0,
        fragments: 0,
        headers: Vec::new(),
        offsets: Vec::new(),
    };
    let mut last_beat = Instant::now();
    loop {
        let got = match &beat {
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(b) => rx.recv_timeout(b.every.saturating_sub(last_beat.elapsed())),
        };
        let mut batch = match got {
            Ok(batch) => batch,
            Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) => Vec::new(),
        };
        // Several batches per write when they are queued: fewer system calls under load.
        while batch.len() < COALESCE {
            match rx.try_recv() {
                Ok(more) => batch.extend(more),
                Err(_) => break,
            }
        }
        if !batch.is_empty() {
            send_batch(&mut stream, batch, &mut st, &mut on_batch, &mut on_error);
        }
        // After the batch: a beat must never overtake a unit taken from the queue.
        if let Some(b) = &mut beat {
            if st.ok && last_beat.elapsed() >= b.every {
                if let Some(m) = (b.message)(&rx) {
                    if let Err(e) =
                        crate::io::write_all_vectored(&mut stream, &mut [IoSlice::new(&m)])
                    {
                        on_error(&e);
                        st.ok = false;
                    }
                    last_beat = Instant::now();
                }
            }
        }
    }
    finish_link(&mut stream, hello, &st, wait_close);
}

/// Counters and scratch of one link's sending side.
struct LinkState {
    ok: bool,
    units: u64,
    fragments: u64,
    headers: Vec<u8>,
    offsets: Vec<(usize, usize)>,
}

fn send_batch<T: Outgoing>(
    stream: &mut TcpStream,
    batch: Vec<T>,
    st: &mut LinkState,
    on_batch: &mut impl FnMut(BatchOutcome, &[T]),
    on_error: &mut impl FnMut(&io::Error),
) {
    // Units the link took whole: all of them, none (a link already failed), or those before
    // the byte where it failed. A unit cut in the middle is not whole at the peer (it drops a
    // partial record), so it is counted lost with the rest; one written whole may still be read.
    let mut whole = 0usize;
    // Headers were encoded for this batch (its offsets in `st.headers` are this batch's).
    let encoded = st.ok;
    if st.ok {
        st.headers.clear();
        st.offsets.clear();
        for u in &batch {
            let start = st.headers.len();
            u.encode_header(&mut st.headers);
            st.offsets.push((start, st.headers.len()));
        }
        let mut io: Vec<IoSlice> = Vec::with_capacity(batch.len() * 9);
        for (u, &(s, e)) in batch.iter().zip(&st.offsets) {
            io.push(IoSlice::new(&st.headers[s..e]));
            io.extend(u.fragments().iter().map(|f| IoSlice::new(f)));
        }
        let (written, r) = crate::io::write_all_vectored_counted(stream, &mut io);
        match r {
            Ok(()) => whole = batch.len(),
            Err(e) => {
                on_error(&e);
                st.ok = false;
                let mut left = written as u64;
                for (u, &(s, e)) in batch.iter().zip(&st.offsets) {
                    let size =
                        (e - s) as u64 + u.fragments().iter().map(|f| f.len() as u64).sum::<u64>();
                    if size > left {
                        break;
                    }
                    left -= size;
                    whole += 1;
                }
            }
        }
    }
    // Units `range` of the batch, as counted for `on_batch`.
    let outcome = |range: std::ops::Range<usize>, written: bool| {
        let units = &batch[range.clone()];
        let headers = match (encoded, range.is_empty()) {
            (true, false) => (st.offsets[range.end - 1].1 - st.offsets[range.start].0) as u64,
            _ => 0,
        };
        BatchOutcome {
            units: units.len() as u64,
            fragments: units.iter().map(|u| u.fragments().len() as u64).sum(),
            bytes: headers
                + units
                    .iter()
                    .flat_map(|u| u.fragments())
                    .map(|f| f.len() as u64)
                    .sum::<u64>(),
            written,
        }
    };
    if whole > 0 {
        let o = outcome(0..whole, true);
        st.units += o.units;
        st.fragments += o.fragments;
        on_batch(o, &batch[..whole]);
    }
    if whole < batch.len() {
        let o = outcome(whole..batch.len(), false);
        on_batch(o, &batch[whole..]);
    }
}

/// Ends a link that did not fail with a peer end carrying the counts, then waits for the peer to
/// close (it has then read everything).
fn finish_link(stream: &mut TcpStream, hello: PeerHello, st: &LinkState, wait_close: bool) {
    if st.ok {
        let end = PeerEnd {
            role: hello.role,
            id: hello.id,
            units: st.units,
            fragments: st.fragments,
        }
        .encode();
        let _ = crate::io::write_all_vectored(stream, &mut [IoSlice::new(&end)]);
        let _ = stream.shutdown(std::net::Shutdown::Write);
        if wait_close {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(60)));
            let _ = std::io::Read::read(stream, &mut [0u8; 64]);
        }
    }
}

//! The sending side of a link between Tessera's roles (readout unit → builder, builder →
//! recorder, and a request-mode builder's links): it takes batches from a bounded queue,
//! coalesces what is queued, and writes every unit's header and fragments with vectored writes
//! straight from the read chunks. It opens the link with a peer hello and, once the queue is
//! closed, ends it with a peer end carrying the counts, then waits for the peer to close (it has
//! then read everything). Two forms, one protocol and one accounting: [`send_loop`] on a thread
//! of its own, blocking (request mode), and [`PolledSender`], a connection of the I/O pollers
//! (push mode: one poller serves any number of links).

use crossbeam_channel::{Receiver, RecvTimeoutError};
use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use tessera_format::link::{PeerEnd, PeerHello};

use crate::reactor::{Conn, Doorbell, Next};
use crate::ChunkSlice;

/// Most units gathered into one vectored write when the queue holds several batches.
const COALESCE: usize = 512;

/// A unit sent on a link: a super-fragment or an event record.
pub trait Outgoing: Send {
    /// Appends this unit's header to `out`.
    fn encode_header(&self, out: &mut Vec<u8>);
    /// The bytes that follow the header, verbatim: its fragments, one slice each or several
    /// packed in one slice.
    fn fragments(&self) -> &[ChunkSlice];
    /// Starts loading what [`Self::fragments`] will read, a few units before the write's walk
    /// reaches this one. Nothing by default.
    fn prefetch(&self) {}
    /// Fragments in [`Self::fragments`], for the link's counts.
    fn fragment_count(&self) -> u64 {
        self.fragments().len() as u64
    }
    /// Whether it counts as one of the link's units (super-fragments, event records: the
    /// peer end's count); false for a message that only travels in order with them.
    fn is_unit(&self) -> bool {
        true
    }
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
    stream: TcpStream,
    rx: Receiver<Vec<T>>,
    hello: PeerHello,
    mut on_batch: impl FnMut(BatchOutcome, &[T]),
    mut on_error: impl FnMut(&io::Error),
    mut beat: Option<Beat<'_, T>>,
    wait_close: bool,
) {
    let mut link = LinkWriter::open(stream, hello, &mut on_error);
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
            link.send(batch, &mut on_batch, &mut on_error);
        }
        // After the batch: a beat must never overtake a unit taken from the queue.
        if let Some(b) = &mut beat {
            if link.is_ok() && last_beat.elapsed() >= b.every {
                if let Some(m) = (b.message)(&rx) {
                    link.write_message(&m, &mut on_error);
                    last_beat = Instant::now();
                }
            }
        }
    }
    link.finish(wait_close);
}

/// The sending side of one link, driven by its caller: the hello, batches, messages between
/// them, and the peer end with the link's counts. [`send_loop`] drives one from a queue; a
/// request-mode builder drives its recorder link itself, since it keeps every record until the
/// recorder acknowledges it and sends the rest again on a new link when one breaks.
pub struct LinkWriter {
    stream: TcpStream,
    hello: PeerHello,
    st: LinkState,
}

impl LinkWriter {
    /// Opens the link with `hello` (a failure goes to `on_error`, and the link is failed).
    pub fn open(
        mut stream: TcpStream,
        hello: PeerHello,
        on_error: &mut impl FnMut(&io::Error),
    ) -> LinkWriter {
        let ok = match crate::io::write_all_vectored(
            &mut stream,
            &mut [IoSlice::new(&hello.encode())],
        ) {
            Ok(()) => true,
            Err(e) => {
                on_error(&e);
                false
            }
        };
        LinkWriter {
            stream,
            hello,
            st: LinkState {
                ok,
                units: 0,
                fragments: 0,
                headers: Vec::new(),
                offsets: VecDeque::new(),
            },
        }
    }

    /// False once a write failed: what is sent from then on is reported not written.
    pub fn is_ok(&self) -> bool {
        self.st.ok
    }

    /// Writes `batch`; `on_batch` is told the fate of its units (those written whole, and those
    /// not), `on_error` of a failure.
    pub fn send<T: Outgoing>(
        &mut self,
        batch: Vec<T>,
        on_batch: &mut impl FnMut(BatchOutcome, &[T]),
        on_error: &mut impl FnMut(&io::Error),
    ) {
        send_batch(&mut self.stream, batch, &mut self.st, on_batch, on_error);
    }

    /// Writes a message that travels between units (not counted as one).
    pub fn write_message(&mut self, m: &[u8], on_error: &mut impl FnMut(&io::Error)) {
        if !self.st.ok {
            return;
        }
        if let Err(e) = crate::io::write_all_vectored(&mut self.stream, &mut [IoSlice::new(m)]) {
            on_error(&e);
            self.st.ok = false;
        }
    }

    /// Ends a link that did not fail with the peer end; `wait_close`: then waits for the peer
    /// to close it.
    pub fn finish(mut self, wait_close: bool) {
        finish_link(&mut self.stream, self.hello, &self.st, wait_close);
    }

    /// Gives the link up without its peer end (the peer sees it break).
    pub fn abandon(self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// Counters and scratch of one link's sending side.
struct LinkState {
    ok: bool,
    units: u64,
    fragments: u64,
    headers: Vec<u8>,
    /// Per unit of the batch, where its header lies in `headers`. Queues, as the batch is: the
    /// units written leave from the front while the rest stay where they are (a vector's
    /// drain moved the rest down at every write, 26 instructions a fragment at 1 KiB x 8).
    offsets: VecDeque<(usize, usize)>,
}

fn send_batch<T: Outgoing>(
    stream: &mut TcpStream,
    batch: Vec<T>,
    st: &mut LinkState,
    on_batch: &mut impl FnMut(BatchOutcome, &[T]),
    on_error: &mut impl FnMut(&io::Error),
) {
    if !st.ok {
        report(&batch, st, 0, false, on_batch);
        return;
    }
    encode_headers(&batch, st);
    let mut batch = VecDeque::from(batch);
    // In writes of at most `MAX_SLICES` slices and about `WRITE_BYTES`, each unit counted and dropped once its write is
    // out: its memory goes back then, not when the whole coalesced batch has (512 request-mode
    // events of 24 x 1.6 KB would hold 20 MB of a builder's buffer until the last was written).
    while !batch.is_empty() {
        let mut io: Vec<IoSlice> = Vec::with_capacity(MAX_SLICES);
        let mut units = 0;
        let mut bytes = 0;
        for (u, &(s, e)) in batch.iter().zip(&st.offsets) {
            if units > 0
                && (io.len() + 1 + u.fragments().len() > MAX_SLICES || bytes >= WRITE_BYTES)
            {
                break;
            }
            io.push(IoSlice::new(&st.headers[s..e]));
            io.extend(u.fragments().iter().map(|f| IoSlice::new(f)));
            bytes += wire_size(u, (s, e));
            units += 1;
        }
        let (written, r) = crate::io::write_all_vectored_counted(stream, &mut io);
        match r {
            Ok(()) => release(&mut batch, st, units, on_batch, &mut None),
            Err(e) => {
                on_error(&e);
                st.ok = false;
                // Units that lie whole within what went out may still be read by the peer; a
                // unit cut in the middle is not whole there (it drops a partial record), so it
                // is counted lost with the rest.
                let batch = batch.make_contiguous();
                let (whole, _) = whole_units(batch, st, written);
                report(batch, st, whole, true, on_batch);
                return;
            }
        }
    }
}

/// Tells `on_batch` the fate of a batch of which the first `whole` units reached the link whole
/// (`encoded`: `st`'s headers were encoded for this batch), and counts them.
fn report<T: Outgoing>(
    batch: &[T],
    st: &mut LinkState,
    whole: usize,
    encoded: bool,
    on_batch: &mut impl FnMut(BatchOutcome, &[T]),
) {
    // Units `range` of the batch, as counted for `on_batch`.
    let outcome = |range: std::ops::Range<usize>, written: bool| {
        let units = &batch[range.clone()];
        let headers = match (encoded, range.is_empty()) {
            (true, false) => (st.offsets[range.end - 1].1 - st.offsets[range.start].0) as u64,
            _ => 0,
        };
        BatchOutcome {
            units: units.iter().filter(|u| u.is_unit()).count() as u64,
            fragments: units.iter().map(|u| u.fragment_count()).sum(),
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

/// How many units of `batch` lie whole within its first `written` bytes on the wire, and their
/// bytes.
fn whole_units<T: Outgoing>(batch: &[T], st: &LinkState, written: usize) -> (usize, usize) {
    let mut bytes = 0;
    let mut whole = 0;
    for (u, &offsets) in batch.iter().zip(&st.offsets) {
        let size = wire_size(u, offsets);
        if bytes + size > written {
            break;
        }
        bytes += size;
        whole += 1;
    }
    (whole, bytes)
}

/// A unit's bytes on the wire: its encoded header (at `offsets` in the link's headers) and its
/// fragments.
fn wire_size<T: Outgoing>(u: &T, (s, e): (usize, usize)) -> usize {
    (e - s) + u.fragments().iter().map(|f| f.len()).sum::<usize>()
}

/// What a link does with each unit it wrote whole, where its stage asked for more than the
/// unit's drop ([`PolledSender::with_retire`]).
pub type Retire<T> = Box<dyn FnMut(T) + Send>;

/// Counts the first `whole` units of `batch` as written and drops them (and their headers'
/// offsets), or hands them to `retire`: their chunks go back to their budgets now.
fn release<T: Outgoing>(
    batch: &mut VecDeque<T>,
    st: &mut LinkState,
    whole: usize,
    on_batch: &mut impl FnMut(BatchOutcome, &[T]),
    retire: &mut Option<Retire<T>>,
) {
    if whole == 0 {
        return;
    }
    // Contiguous already: a batch only loses units at its front.
    report(&batch.make_contiguous()[..whole], st, whole, true, on_batch);
    match retire {
        Some(r) => batch.drain(..whole).for_each(&mut **r),
        None => drop(batch.drain(..whole)),
    }
    st.offsets.drain(..whole);
}

/// Encodes the headers of `batch` into `st` (their offsets index `st.headers`).
fn encode_headers<T: Outgoing>(batch: &[T], st: &mut LinkState) {
    st.headers.clear();
    st.offsets.clear();
    for u in batch {
        let start = st.headers.len();
        u.encode_header(&mut st.headers);
        st.offsets.push_back((start, st.headers.len()));
    }
}

/// How many units ahead a write prefetches a unit's list of slices.
const PREFETCH_AHEAD: usize = 4;

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

/// The queue into a polled sender: a bounded channel whose every send rings the sender's bell.
pub struct Queue<T> {
    /// `None` only while dropping.
    tx: Option<crossbeam_channel::Sender<Vec<T>>>,
    bell: Doorbell,
}

impl<T> Clone for Queue<T> {
    fn clone(&self) -> Self {
        Queue {
            tx: self.tx.clone(),
            bell: self.bell.clone(),
        }
    }
}

impl<T> Queue<T> {
    /// Queues a batch (waiting while the queue is full: back-pressure on the caller) and wakes
    /// the sender.
    pub fn send(&self, batch: Vec<T>) -> Result<(), crossbeam_channel::SendError<Vec<T>>> {
        let r = match &self.tx {
            Some(tx) => tx.send(batch),
            None => Err(crossbeam_channel::SendError(batch)),
        };
        self.bell.ring();
        r
    }
}

impl<T> Drop for Queue<T> {
    fn drop(&mut self) {
        // The last queue gone means the end of the link: the sender must see it, so the
        // channel's end goes first and the bell after.
        self.tx = None;
        self.bell.ring();
    }
}

/// A queue of `cap` batches and its receiving end with the bell it rings.
pub fn queue<T>(cap: usize) -> (Queue<T>, Receiver<Vec<T>>, Doorbell) {
    with_bell(crossbeam_channel::bounded(cap))
}

/// A queue with no bound of its own, for batches that are slices of budgeted read chunks (a
/// readout unit's super-fragments): the producer's budgets bound what it holds, so the
/// producer is held by its budget (its links stop reading) and never waits on the queue. A
/// poller that waited here would stop every other link it serves, among them links of other
/// units whose data the consumer's peer needs before it can drain this queue: a cycle.
pub fn queue_unbounded<T>() -> (Queue<T>, Receiver<Vec<T>>, Doorbell) {
    with_bell(crossbeam_channel::unbounded())
}

fn with_bell<T>(
    (tx, rx): (crossbeam_channel::Sender<Vec<T>>, Receiver<Vec<T>>),
) -> (Queue<T>, Receiver<Vec<T>>, Doorbell) {
    let bell = Doorbell::default();
    (
        Queue {
            tx: Some(tx),
            bell: bell.clone(),
        },
        rx,
        bell,
    )
}

/// A [`Beat`] a polled sender owns.
pub struct OwnedBeat<T> {
    pub every: Duration,
    #[allow(clippy::type_complexity)]
    pub message: Box<dyn FnMut(&Receiver<Vec<T>>) -> Option<Vec<u8>> + Send>,
}

/// [`send_loop_beating`] as a connection of the I/O pollers ([`crate::reactor`]): the same link
/// protocol (hello, batches coalesced from the queue and written with vectored writes straight
/// from the read chunks, beats between batches, the peer end, the wait for the peer's close) and
/// the same accounting, written without blocking, so one poller serves the links to every
/// builder instead of a thread each. A link that cannot take more waits for the socket to say
/// it can (its queue fills: back-pressure), without holding anyone else's link.
pub struct PolledSender<T, B, E> {
    stream: TcpStream,
    rx: Receiver<Vec<T>>,
    bell: Doorbell,
    hello: PeerHello,
    /// Small messages to write before anything else (hello, beat, end), and how far.
    out: Vec<u8>,
    out_at: usize,
    /// The batch being written, and how many of its bytes are out.
    batch: VecDeque<T>,
    at: usize,
    st: LinkState,
    on_batch: B,
    on_error: E,
    beat: Option<OwnedBeat<T>>,
    last_beat: Instant,
    wait_close: bool,
    closing: Closing,
    /// Samples the socket's send queue, where the stage asked (`with_queue_gauge`).
    unsent: Option<crate::queued::QueueGauge>,
    /// Takes each unit written whole, where the stage asked (`with_retire`).
    retire: Option<Retire<T>>,
    _live: crate::reactor::TallyGuard,
}

/// Pieces of a polled sender's write (headers, fragments, the rest of one cut by the last
/// write) shorter than this are copied into one buffer, in order with the others, and written
/// as one slice of it. Measured with `tessera run` (150 000 events of 256 B x 32, recorder
/// off, four alternations): 2.49-2.60 CPU-s against 2.68-2.83 writing every fragment as a
/// slice of its own, the run 6 % shorter. The units' send copy was four times the sources'
/// for the same bytes; gathered, the kernel's copy costs what the sources' does and the read
/// of the fragments moves to the gathering (docs/PERFORMANCE.md). At 1 KiB, gathering every
/// fragment made no difference (2.34-2.68 CPU-s either way): larger pieces stay slices.
const GATHER_BELOW: usize = 512;
/// Most bytes gathered for one write: what a write to a full socket leaves out is gathered
/// again at the next, so no more than a write is likely to take.
const GATHER_BYTES: usize = 256 << 10;

thread_local! {
    /// The gathering buffer of the poller thread turning a link: one per thread, not per link,
    /// so that a thousand links cost no more than the pollers do.
    static GATHER: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A piece of a write: a slice of a unit's own bytes, or a range of the gathering buffer.
#[derive(Clone, Copy)]
enum Piece<'a> {
    Slice(&'a [u8]),
    Gathered(usize, usize),
}

/// How long a finished link waits for its peer to close it.
const CLOSE_WAIT: Duration = Duration::from_secs(60);
/// Slices per vectored write (Linux's IOV_MAX).
const MAX_SLICES: usize = 1024;
/// About the most bytes per write of a blocking sender: what is written is given back then, and
/// a write of this size costs one system call per megabyte.
const WRITE_BYTES: usize = 1 << 20;

impl<T, B, E> PolledSender<T, B, E>
where
    T: Outgoing + 'static,
    B: FnMut(BatchOutcome, &[T]) + Send + 'static,
    E: FnMut(&io::Error) + Send + 'static,
{
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        stream: TcpStream,
        rx: Receiver<Vec<T>>,
        bell: Doorbell,
        hello: PeerHello,
        on_batch: B,
        on_error: E,
        beat: Option<OwnedBeat<T>>,
        wait_close: bool,
        live: &std::sync::Arc<crate::reactor::Tally>,
    ) -> io::Result<Self> {
        stream.set_nonblocking(true)?;
        Ok(PolledSender {
            stream,
            rx,
            bell,
            hello,
            out: hello.encode().to_vec(),
            out_at: 0,
            batch: VecDeque::new(),
            at: 0,
            st: LinkState {
                ok: true,
                units: 0,
                fragments: 0,
                headers: Vec::new(),
                offsets: VecDeque::new(),
            },
            on_batch,
            on_error,
            beat,
            last_beat: Instant::now(),
            wait_close,
            closing: Closing::Open,
            unsent: None,
            retire: None,
            _live: live.enter(),
        })
    }

    /// Keeps `gauges` told what waits in this link's send queue (a slow network against a slow
    /// peer: see [`crate::queued`]).
    pub fn with_queue_gauge(mut self, gauges: &crate::queued::QueueGauges) -> Self {
        self.unsent = Some(gauges.gauge(crate::queued::Side::Unsent));
        self
    }

    /// Hands each unit written whole to `retire` instead of dropping it here: a stage that
    /// reuses what a unit owns (its list of slices) gets it back from the link's thread.
    /// Units of a failed link are dropped as before.
    pub fn with_retire(mut self, retire: impl FnMut(T) + Send + 'static) -> Self {
        self.retire = Some(Box::new(retire));
        self
    }

    fn fail(&mut self, e: &io::Error) {
        (self.on_error)(e);
        self.st.ok = false;
        self.out.clear();
        self.out_at = 0;
        let mut batch = std::mem::take(&mut self.batch);
        if !batch.is_empty() {
            let batch = batch.make_contiguous();
            let (whole, _) = whole_units(batch, &self.st, self.at);
            report(batch, &mut self.st, whole, true, &mut self.on_batch);
        }
        self.at = 0;
    }

    /// Writes what it can of the current batch: `Ok(true)` when it is all out.
    fn write_batch(&mut self) -> io::Result<bool> {
        loop {
            let mut skip = self.at;
            // Contiguous already (units leave only from the front): slices walk faster than
            // the queues' own iterators.
            let batch: &[T] = self.batch.make_contiguous();
            let offsets: &[(usize, usize)] = self.st.offsets.make_contiguous();
            let headers = &self.st.headers;
            let stream = &mut self.stream;
            let wrote = GATHER.with_borrow_mut(|gather| {
                gather.clear();
                gather.reserve(GATHER_BYTES);
                let mut pieces: Vec<Piece> = Vec::with_capacity(MAX_SLICES.min(batch.len() * 9));
                'fill: for (k, (u, &(s, e))) in batch.iter().zip(offsets).enumerate() {
                    // A unit's list of slices was written by the thread that finished it, on
                    // the other core as often as not, and has left the cache since (each write
                    // copies hundreds of KiB through it): the load of its first slice was half
                    // of this turn's time at 256 B x 32 (`perf annotate`). Asked for a few
                    // units ahead, every line of it is there when the walk reaches it.
                    if let Some(ahead) = batch.get(k + PREFETCH_AHEAD) {
                        ahead.prefetch();
                    }
                    for piece in
                        std::iter::once(&headers[s..e]).chain(u.fragments().iter().map(|f| &f[..]))
                    {
                        if skip >= piece.len() {
                            skip -= piece.len();
                            continue;
                        }
                        let rest = &piece[skip..];
                        skip = 0;
                        // Small pieces in a row become one slice of the buffer, the first
                        // copied there when the second comes; one alone between large ones (a
                        // header between 1 KiB fragments) stays a slice of its own, not copied
                        // for nothing. `run`: where the run starts, and what of it is still a
                        // slice.
                        let run = match pieces.last() {
                            _ if rest.len() >= GATHER_BELOW => None,
                            Some(&Piece::Gathered(at, _)) => Some((at, &[][..])),
                            Some(&Piece::Slice(prev)) if prev.len() < GATHER_BELOW => {
                                Some((gather.len(), prev))
                            }
                            _ => None,
                        };
                        let Some((at, prev)) = run else {
                            pieces.push(Piece::Slice(rest));
                            if pieces.len() == MAX_SLICES {
                                break 'fill;
                            }
                            continue;
                        };
                        if gather.len() + prev.len() + rest.len() > GATHER_BYTES {
                            break 'fill;
                        }
                        gather.extend_from_slice(prev);
                        gather.extend_from_slice(rest);
                        if let Some(last) = pieces.last_mut() {
                            *last = Piece::Gathered(at, gather.len());
                        }
                    }
                }
                if pieces.is_empty() {
                    return None;
                }
                let io: Vec<IoSlice> = pieces
                    .iter()
                    .map(|p| match *p {
                        Piece::Slice(b) => IoSlice::new(b),
                        Piece::Gathered(a, z) => IoSlice::new(&gather[a..z]),
                    })
                    .collect();
                Some(std::io::Write::write_vectored(stream, &io))
            });
            let Some(wrote) = wrote else {
                return Ok(true);
            };
            match wrote {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "peer stopped accepting data",
                    ))
                }
                Ok(n) => {
                    self.at += n;
                    self.release_written();
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e),
            }
        }
    }

    /// Counts and drops the units at the front of the batch that are out whole. Dropping them
    /// gives their chunks back to the links' budgets now, not when the whole batch is out (a
    /// coalesced batch can hold half a unit's buffer at 16 KiB fragments): the links read again
    /// sooner, into chunks the kernel's copy has just left warm in cache.
    fn release_written(&mut self) {
        let (whole, bytes) = whole_units(self.batch.make_contiguous(), &self.st, self.at);
        release(
            &mut self.batch,
            &mut self.st,
            whole,
            &mut self.on_batch,
            &mut self.retire,
        );
        self.at -= bytes;
    }

    /// Writes what it can of the small messages: `Ok(true)` when they are all out.
    fn write_out(&mut self) -> io::Result<bool> {
        while self.out_at < self.out.len() {
            match std::io::Write::write(&mut self.stream, &self.out[self.out_at..]) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "peer stopped accepting data",
                    ))
                }
                Ok(n) => {
                    self.out_at += n;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        self.out.clear();
        self.out_at = 0;
        Ok(true)
    }

    /// When an idle link looks again: when a beat is next due (or a distant check when there
    /// is none), never in the past (a beat that declined is asked again a little later).
    fn next_check(&self) -> Instant {
        let now = Instant::now();
        match &self.beat {
            Some(b) => (self.last_beat + b.every).max(now + Duration::from_millis(1)),
            None => now + Duration::from_secs(1),
        }
    }

    /// When a link whose socket is full looks again if no room is announced: its beat waits
    /// for the units before it anyway.
    fn blocked_check() -> Instant {
        Instant::now() + Duration::from_secs(1)
    }

    /// Queues a beat if one is due and the beat has something to say.
    fn beat_if_due(&mut self) {
        if !self.st.ok || !self.out.is_empty() {
            return;
        }
        if let Some(b) = &mut self.beat {
            if self.last_beat.elapsed() >= b.every {
                if let Some(m) = (b.message)(&self.rx) {
                    self.out = m;
                    self.out_at = 0;
                    self.last_beat = Instant::now();
                }
            }
        }
    }

    /// After the peer end: waits for the peer to close (it has then read everything).
    fn await_close(&mut self, until: Instant) -> Next {
        let mut buf = [0u8; 64];
        loop {
            match std::io::Read::read(&mut self.stream, &mut buf) {
                Ok(0) => return Next::Done,
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return if Instant::now() >= until {
                        Next::Done
                    } else {
                        Next::Readable(until)
                    };
                }
                Err(_) => return Next::Done,
            }
        }
    }
}

impl<T, B, E> Conn for PolledSender<T, B, E>
where
    T: Outgoing + 'static,
    B: FnMut(BatchOutcome, &[T]) + Send + 'static,
    E: FnMut(&io::Error) + Send + 'static,
{
    fn fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.stream)
    }

    fn interest(&self) -> mio::Interest {
        mio::Interest::READABLE | mio::Interest::WRITABLE
    }

    fn doorbell(&self) -> Option<&Doorbell> {
        Some(&self.bell)
    }

    fn turn(&mut self) -> Next {
        self.bell.answer();
        if let Some(g) = &mut self.unsent {
            g.sample(std::os::fd::AsRawFd::as_raw_fd(&self.stream));
        }
        if let Closing::Waiting(until) = self.closing {
            return self.await_close(until);
        }
        loop {
            if self.st.ok && !self.out.is_empty() {
                match self.write_out() {
                    Ok(true) => {}
                    Ok(false) => return Next::Writable(Self::blocked_check()),
                    Err(e) => {
                        self.fail(&e);
                        continue;
                    }
                }
            }
            if let Closing::Ending(until) = self.closing {
                // The peer end is out (or the link failed, and then ends without it).
                if !self.st.ok {
                    return Next::Done;
                }
                let _ = self.stream.shutdown(std::net::Shutdown::Write);
                if !self.wait_close {
                    return Next::Done;
                }
                self.closing = Closing::Waiting(until);
                return self.await_close(until);
            }
            if !self.batch.is_empty() {
                match self.write_batch() {
                    Ok(true) => {
                        // Every unit was counted and dropped as it went out.
                        debug_assert!(self.batch.is_empty() && self.at == 0);
                        // After the batch: a beat never overtakes a unit taken from the queue.
                        self.beat_if_due();
                        continue;
                    }
                    Ok(false) => return Next::Writable(Self::blocked_check()),
                    Err(e) => {
                        self.fail(&e);
                        continue;
                    }
                }
            }
            match self.rx.try_recv() {
                Ok(mut batch) => {
                    // Several batches per write when they are queued: fewer system calls.
                    while batch.len() < COALESCE {
                        match self.rx.try_recv() {
                            Ok(more) => batch.extend(more),
                            Err(_) => break,
                        }
                    }
                    if self.st.ok {
                        encode_headers(&batch, &mut self.st);
                        self.batch = VecDeque::from(batch);
                        self.at = 0;
                    } else {
                        report(&batch, &mut self.st, 0, false, &mut self.on_batch);
                    }
                }
                Err(crossbeam_channel::TryRecvError::Empty) => {
                    self.beat_if_due();
                    if self.st.ok && !self.out.is_empty() {
                        continue;
                    }
                    return Next::Readable(self.next_check());
                }
                Err(crossbeam_channel::TryRecvError::Disconnected) => {
                    self.closing = Closing::Ending(Instant::now() + CLOSE_WAIT);
                    if self.st.ok {
                        let end = PeerEnd {
                            role: self.hello.role,
                            id: self.hello.id,
                            units: self.st.units,
                            fragments: self.st.fragments,
                        };
                        self.out = end.encode().to_vec();
                        self.out_at = 0;
                    }
                }
            }
        }
    }
}

/// Where a polled sender is in ending its link.
#[derive(Clone, Copy)]
enum Closing {
    Open,
    /// The queue closed: the peer end is being written; then the write side is shut.
    Ending(Instant),
    /// Waiting (until then) for the peer to close the link.
    Waiting(Instant),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reactor::{Reactor, Tally};
    use std::net::TcpListener;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use tessera_format::link::{PeerRole, PEER_END_SIZE, PEER_HELLO_SIZE};

    /// A unit of an 8-byte header (its number) and two fragments of its own bytes.
    struct Unit(u64, Vec<ChunkSlice>);

    impl Outgoing for Unit {
        fn encode_header(&self, out: &mut Vec<u8>) {
            out.extend_from_slice(&self.0.to_le_bytes());
        }
        fn fragments(&self) -> &[ChunkSlice] {
            &self.1
        }
    }

    fn unit(i: u64) -> Unit {
        let f = |k: u64| ChunkSlice::copy_from(&vec![(i * 7 + k) as u8; 3000 + (i % 5) as usize]);
        Unit(i, vec![f(1), f(2)])
    }

    fn expected(units: u64) -> Vec<u8> {
        expected_of(units, unit)
    }

    /// A unit of twenty small fragments (1 to 600 bytes: most gathered into the write's buffer,
    /// some written as slices) and, every tenth unit, one of 5 000 bytes.
    fn small_unit(i: u64) -> Unit {
        let mut v: Vec<ChunkSlice> = (0..20u64)
            .map(|k| {
                let len = 1 + ((i * 131 + k * 17) % 600) as usize;
                ChunkSlice::copy_from(&vec![(i * 31 + k) as u8; len])
            })
            .collect();
        if i.is_multiple_of(10) {
            v.push(ChunkSlice::copy_from(&vec![i as u8; 5000]));
        }
        Unit(i, v)
    }

    fn expected_of(units: u64, make: fn(u64) -> Unit) -> Vec<u8> {
        let mut v = Vec::new();
        for i in 0..units {
            let u = make(i);
            u.encode_header(&mut v);
            for f in u.fragments() {
                v.extend_from_slice(f);
            }
        }
        v
    }

    /// A sender's batch report for a link that must never fail: adds the units written to
    /// `sent`.
    fn count_units(sent: &Arc<AtomicU64>) -> impl FnMut(BatchOutcome, &[Unit]) + Send + 'static {
        let sent = sent.clone();
        move |o: BatchOutcome, _: &[Unit]| {
            assert!(o.written);
            sent.fetch_add(o.units, Ordering::SeqCst);
        }
    }

    /// A polled sender on a new link, serving a reactor of its own, that must never fail:
    /// returns the reactor (keep it), the peer's end, the queue, the units counted out and the
    /// tally to wait on.
    fn counting_sender(
        hello: PeerHello,
    ) -> (Reactor, TcpStream, Queue<Unit>, Arc<AtomicU64>, Arc<Tally>) {
        let r = Reactor::new(1, "test").unwrap();
        let (conn, peer, q, sent, live) = counting_link(hello, None);
        r.register(Box::new(conn));
        (r, peer, q, sent, live)
    }

    /// [`counting_sender`]'s link and sender, served by nobody yet (the caller turns it), and
    /// handing each unit written to `retire` where given.
    fn counting_link(
        hello: PeerHello,
        retire: Option<Retire<Unit>>,
    ) -> (
        impl Conn,
        TcpStream,
        Queue<Unit>,
        Arc<AtomicU64>,
        Arc<Tally>,
    ) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (peer, _) = l.accept().unwrap();
        let (q, rx, bell) = queue::<Unit>(4);
        let sent = Arc::new(AtomicU64::new(0));
        let live = Arc::new(Tally::default());
        let conn = PolledSender::new(
            s,
            rx,
            bell,
            hello,
            count_units(&sent),
            |e: &io::Error| panic!("{e}"),
            None,
            true,
            &live,
        )
        .unwrap();
        let conn = match retire {
            Some(r) => conn.with_retire(r),
            None => conn,
        };
        (conn, peer, q, sent, live)
    }

    /// The first `want` bytes of the link, read a thousand at a time: megabytes in such reads
    /// fill the sender's socket, so its writes are cut and resumed.
    fn read_slowly(peer: &mut TcpStream, want: usize) -> Vec<u8> {
        let mut got = Vec::with_capacity(want);
        let mut buf = vec![0u8; 1000];
        while got.len() < want {
            let n = std::io::Read::read(peer, &mut buf).unwrap();
            assert!(n > 0, "closed early at {} of {want} bytes", got.len());
            got.extend_from_slice(&buf[..n]);
        }
        got
    }

    /// Every unit reaches a slow peer whole and in order (writes are cut by a full socket and
    /// resumed on the next turn), then the peer end with the counts; the link waits for the
    /// peer's close before it is done.
    #[test]
    fn a_polled_sender_delivers_every_unit_in_order_then_the_end() {
        let hello = PeerHello {
            role: PeerRole::ReadoutUnit,
            id: 7,
            flags: 0,
        };
        let (_r, mut peer, q, sent, live) = counting_sender(hello);
        const N: u64 = 2000;
        let producer = std::thread::spawn(move || {
            for i in 0..N {
                q.send(vec![unit(i)]).unwrap();
            }
        });
        let want = PEER_HELLO_SIZE + expected(N).len() + PEER_END_SIZE;
        let got = read_slowly(&mut peer, want);
        producer.join().unwrap();
        assert_eq!(&got[..PEER_HELLO_SIZE], &hello.encode());
        let body = &got[PEER_HELLO_SIZE..want - PEER_END_SIZE];
        assert!(body == expected(N).as_slice(), "units out of order or cut");
        let end = PeerEnd {
            role: PeerRole::ReadoutUnit,
            id: 7,
            units: N,
            fragments: 2 * N,
        };
        assert_eq!(&got[want - PEER_END_SIZE..], &end.encode());
        assert_eq!(sent.load(Ordering::Relaxed), N);
        // The sender shut its side and waits for ours.
        assert_eq!(std::io::Read::read(&mut peer, &mut [0u8; 16]).unwrap(), 0);
        drop(peer);
        live.wait_zero();
    }

    /// Small pieces are copied into one buffer per write and written as one slice of it: the
    /// peer reads the same bytes in the same order as if each were a slice of its own, through
    /// writes cut by a slow peer (the rest gathered again at the next) and runs of small
    /// pieces longer than the buffer.
    #[test]
    fn a_polled_sender_gathers_small_pieces_into_the_same_bytes() {
        let hello = PeerHello {
            role: PeerRole::ReadoutUnit,
            id: 5,
            flags: 0,
        };
        let (_r, mut peer, q, sent, live) = counting_sender(hello);
        const N: u64 = 3000;
        let producer = std::thread::spawn(move || {
            for first in (0..N).step_by(50) {
                q.send((first..first + 50).map(small_unit).collect())
                    .unwrap();
            }
        });
        let body = expected_of(N, small_unit);
        let small_bytes: usize = (0..N)
            .flat_map(|i| small_unit(i).1)
            .filter(|f| f.len() < GATHER_BELOW)
            .map(|f| f.len())
            .sum();
        assert!(
            small_bytes > 8 * GATHER_BYTES,
            "most of the stream is small pieces, more than a gathering buffer holds"
        );
        let want = PEER_HELLO_SIZE + body.len() + PEER_END_SIZE;
        let got = read_slowly(&mut peer, want);
        producer.join().unwrap();
        assert!(
            got[PEER_HELLO_SIZE..want - PEER_END_SIZE] == body[..],
            "bytes out of order, cut or changed"
        );
        let fragments: u64 = (0..N).map(|i| small_unit(i).1.len() as u64).sum();
        let end = PeerEnd {
            role: PeerRole::ReadoutUnit,
            id: 5,
            units: N,
            fragments,
        };
        assert_eq!(&got[want - PEER_END_SIZE..], &end.encode());
        assert_eq!(sent.load(Ordering::SeqCst), N);
        drop(peer);
        live.wait_zero();
    }

    /// A stage that asked for the units written gets each one once, in order, after its
    /// bytes are out whole (writes cut by a slow peer included), and no more than were
    /// counted written.
    #[test]
    fn a_polled_sender_retires_each_unit_written_whole_once_in_order() {
        let hello = PeerHello {
            role: PeerRole::ReadoutUnit,
            id: 9,
            flags: 0,
        };
        let retired = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let written = Arc::new(std::sync::OnceLock::<Arc<AtomicU64>>::new());
        let (retired2, written2) = (retired.clone(), written.clone());
        let (conn, mut peer, q, sent, live) = counting_link(
            hello,
            Some(Box::new(move |u: Unit| {
                let mut r = retired2.lock();
                r.push(u.0);
                // Never ahead of what was counted written.
                let sent = written2
                    .get()
                    .expect("the count is set before the link runs");
                assert!(r.len() as u64 <= sent.load(Ordering::SeqCst));
            })),
        );
        written.set(sent.clone()).unwrap();
        let r = Reactor::new(1, "test").unwrap();
        r.register(Box::new(conn));
        const N: u64 = 3000;
        // One batch, larger than the sockets hold: its writes are cut and resumed.
        q.send((0..N).map(unit).collect()).unwrap();
        drop(q);
        let want = PEER_HELLO_SIZE + expected(N).len() + PEER_END_SIZE;
        let mut got = 0;
        let mut buf = vec![0u8; 4096];
        while got < want {
            let n = std::io::Read::read(&mut peer, &mut buf).unwrap();
            assert!(n > 0, "closed early at {got} of {want} bytes");
            got += n;
        }
        drop(peer);
        live.wait_zero();
        drop(r);
        assert_eq!(sent.load(Ordering::SeqCst), N);
        assert_eq!(*retired.lock(), (0..N).collect::<Vec<_>>());
    }

    /// Units are counted and their chunks given back to their budget as each goes out whole,
    /// not when the whole batch has: with a peer that reads nothing, the part of one large batch
    /// the sockets could take is already reported and its memory free for the links. Both
    /// forms of the sender.
    #[test]
    fn a_polled_sender_gives_back_each_unit_as_it_goes_out() {
        gives_back_each_unit_as_it_goes_out(true);
    }

    #[test]
    fn a_blocking_sender_gives_back_each_unit_as_it_goes_out() {
        gives_back_each_unit_as_it_goes_out(false);
    }

    fn gives_back_each_unit_as_it_goes_out(polled: bool) {
        use crate::budget::Budget;
        use crate::chunk::Chunk;
        const N: u64 = 2048;
        const SIZE: usize = 16 << 10;
        let budget = Arc::new(Budget::new(N * SIZE as u64));
        let stop = std::sync::atomic::AtomicBool::new(false);
        let batch: Vec<Unit> = (0..N)
            .map(|i| {
                let buf = budget.take_buffer(SIZE, SIZE, &stop).unwrap();
                // SAFETY: the whole chunk, which nothing writes after this.
                let f = unsafe { ChunkSlice::new(Chunk::new(buf, budget.clone()), 0, SIZE) };
                Unit(i, vec![f])
            })
            .collect();
        assert_eq!(budget.used(), N * SIZE as u64);
        let hello = PeerHello {
            role: PeerRole::ReadoutUnit,
            id: 3,
            flags: 0,
        };
        // The link, its sender polled or on a thread of its own (`send_loop`).
        enum Sender {
            Polled(Reactor, Queue<Unit>, Arc<Tally>),
            Blocking(
                crossbeam_channel::Sender<Vec<Unit>>,
                std::thread::JoinHandle<()>,
            ),
        }
        let (mut peer, sent, sender) = if polled {
            let (r, peer, q, sent, live) = counting_sender(hello);
            q.send(batch).unwrap();
            (peer, sent, Sender::Polled(r, q, live))
        } else {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            // Room for a whole write of `WRITE_BYTES` without a reader, whatever the
            // kernel's autotuning: the blocking sender's first write must complete.
            socket2::SockRef::from(&s)
                .set_send_buffer_size(4 * WRITE_BYTES)
                .unwrap();
            let peer = l.accept().unwrap().0;
            let (tx, rx) = crossbeam_channel::bounded::<Vec<Unit>>(4);
            let sent = Arc::new(AtomicU64::new(0));
            let count = count_units(&sent);
            let t = std::thread::spawn(move || {
                send_loop(s, rx, hello, count, |e: &io::Error| panic!("{e}"))
            });
            tx.send(batch).unwrap();
            (peer, sent, Sender::Blocking(tx, t))
        };
        // The peer reads nothing yet: the sockets take what they can (far less than 32 MiB).
        let t = Instant::now();
        // Each unit's memory goes back right after it is counted (the same turn): it is seen
        // here while the batch is still far from out.
        loop {
            let reported = sent.load(Ordering::SeqCst);
            assert!(reported < N, "the whole batch cannot be in the sockets");
            if budget.used() <= (N - reported) * SIZE as u64 && reported > 0 {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "{reported} units reported but {} bytes still charged",
                budget.used()
            );
            std::thread::yield_now();
        }
        // The queue closes: the sender ends the link once the rest is out.
        let finished: Box<dyn FnOnce()> = match sender {
            Sender::Polled(r, q, live) => {
                drop(q);
                Box::new(move || {
                    live.wait_zero();
                    drop(r);
                })
            }
            Sender::Blocking(tx, t) => {
                drop(tx);
                Box::new(move || t.join().unwrap())
            }
        };
        let mut got = 0usize;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = std::io::Read::read(&mut peer, &mut buf).unwrap();
            if n == 0 {
                break;
            }
            got += n;
        }
        assert_eq!(
            got,
            PEER_HELLO_SIZE + N as usize * (8 + SIZE) + PEER_END_SIZE
        );
        assert_eq!(sent.load(Ordering::SeqCst), N);
        drop(peer);
        finished();
        assert_eq!(budget.used(), 0);
    }

    /// A peer that goes away: the units it cannot have had are reported as not written (to be
    /// counted as lost), the error once, and the queue still drains to the end.
    #[test]
    fn a_polled_sender_whose_peer_dies_accounts_every_unit() {
        let r = Reactor::new(1, "test").unwrap();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (peer, _) = l.accept().unwrap();
        let (q, rx, bell) = queue::<Unit>(4);
        let (written, lost, errors) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
        );
        let live = Arc::new(Tally::default());
        let (w2, l2, e2) = (written.clone(), lost.clone(), errors.clone());
        let conn = PolledSender::new(
            s,
            rx,
            bell,
            PeerHello {
                role: PeerRole::ReadoutUnit,
                id: 1,
                flags: 0,
            },
            move |o: BatchOutcome, _: &[Unit]| {
                if o.written { &w2 } else { &l2 }.fetch_add(o.units, Ordering::Relaxed);
            },
            move |_: &io::Error| {
                e2.fetch_add(1, Ordering::Relaxed);
            },
            None,
            true,
            &live,
        )
        .unwrap();
        r.register(Box::new(conn));
        drop(peer);
        const N: u64 = 3000;
        for i in 0..N {
            q.send(vec![unit(i)]).unwrap();
        }
        drop(q);
        live.wait_zero();
        assert_eq!(errors.load(Ordering::Relaxed), 1);
        assert_eq!(
            written.load(Ordering::Relaxed) + lost.load(Ordering::Relaxed),
            N
        );
        assert!(lost.load(Ordering::Relaxed) > 0);
    }
}

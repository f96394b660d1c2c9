//! Reads a socket into budgeted chunks and hands out whole messages as zero-copy slices.
//!
//! Large reads, many messages parsed out of each (a 256 KiB read holds 256 fragments of 1 KiB):
//! on this kind of machine that is 3-4x faster than one read per message. A message cut by the
//! end of a chunk is copied once into the next chunk; nothing else is copied.

use crate::budget::Budget;
use crate::chunk::{Chunk, ChunkSlice};
use std::io::{self, Read};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

/// The smallest read chunk. Chunks start this small and double while the link fills them
/// within [`GROW_WITHIN`], up to the configured read chunk. Why: a builder of 60 reading 16
/// readout units has 960 links that each carry little; with every link reading into chunks of
/// the full 1 MiB, nearly every byte landed in memory fresh from the system, and zeroing those
/// pages (`clear_page`, page faults) took a third of all CPU at 16 x 60. A link's own freed
/// chunks are kept for it (see [`Budget`]), so a slow link cycles through a few small warm ones.
pub const MIN_CHUNK: usize = 128 << 10;
const GROW_WITHIN: std::time::Duration = std::time::Duration::from_millis(10);
const SHRINK_AFTER: std::time::Duration = std::time::Duration::from_millis(500);

/// What a [`ChunkReader::fill`] call produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fill {
    /// This many new bytes (0 when the socket's read timeout passed: check timers and stop).
    Data(usize),
    /// The peer closed the connection.
    Eof,
    /// `stop` was raised while waiting for memory.
    Stopped,
    /// [`ChunkReader::try_fill`]: the link's budget is exhausted; nothing was read.
    NoMemory,
}

pub struct ChunkReader {
    budget: Arc<Budget>,
    /// The largest chunk (the configured read chunk).
    chunk_size: usize,
    /// The size of the next chunk: it follows the link's rate (see [`MIN_CHUNK`]).
    cur: usize,
    /// When the current chunk was started.
    started: Option<Instant>,
    chunk: Option<Arc<Chunk>>,
    pos: usize,
    filled: usize,
    /// When the last read system call began (after any wait for memory): a read that came back
    /// empty proves the peer silent from then on, a wait for memory proves nothing.
    pub read_started: Option<Instant>,
    drained: bool,
}

impl ChunkReader {
    pub fn new(budget: Arc<Budget>, chunk_size: usize) -> ChunkReader {
        ChunkReader {
            budget,
            chunk_size,
            cur: MIN_CHUNK.min(chunk_size),
            started: None,
            chunk: None,
            pos: 0,
            filled: 0,
            read_started: None,
            drained: false,
        }
    }

    pub fn budget(&self) -> &Arc<Budget> {
        &self.budget
    }

    /// The bytes read and not yet taken or skipped.
    pub fn window(&self) -> &[u8] {
        match &self.chunk {
            // SAFETY: [pos, filled) is filled and is never written again.
            Some(c) => unsafe { c.bytes(self.pos, self.filled - self.pos) },
            None => &[],
        }
    }

    /// Hands out the next `n` bytes of the window as a shared slice.
    pub fn take(&mut self, n: usize) -> ChunkSlice {
        assert!(n <= self.filled - self.pos, "take past the window");
        let c = self.chunk.clone().expect("a window implies a chunk");
        // SAFETY: [pos, pos+n) is inside the filled region, which the reader never writes again.
        let s = unsafe { ChunkSlice::new(c, self.pos, n) };
        self.pos += n;
        s
    }

    /// Drops the next `n` bytes of the window.
    pub fn skip(&mut self, n: usize) {
        assert!(n <= self.filled - self.pos, "skip past the window");
        self.pos += n;
    }

    /// Reads more bytes from `r`. `want` is how many bytes the window must be able to hold from
    /// its start (the size of the message being assembled); a new chunk is started when the
    /// current one cannot hold that, taking memory from the budget and waiting for it if needed.
    pub fn fill(&mut self, r: &mut impl Read, want: usize, stop: &AtomicBool) -> io::Result<Fill> {
        self.fill_marking_waits(r, want, stop, None)
    }

    /// [`Self::fill`] that raises `waiting` for as long as it waits for memory, so that other
    /// threads can tell a reader held by its own budget from one that has not run.
    pub fn fill_marking_waits(
        &mut self,
        r: &mut impl Read,
        want: usize,
        stop: &AtomicBool,
        waiting: Option<&AtomicBool>,
    ) -> io::Result<Fill> {
        let budget = self.budget.clone();
        let take = |min, n| {
            let mark = |on| {
                if let Some(w) = waiting {
                    w.store(on, std::sync::atomic::Ordering::Release);
                }
            };
            mark(true);
            let got = budget.take_buffer(min, n, stop);
            mark(false);
            got
        };
        if !self.ensure_room(want, take) {
            return Ok(Fill::Stopped);
        }
        self.read_into(r)
    }

    /// [`Self::fill`] for a non-blocking socket served by a poller: never waits. `NoMemory` when
    /// the budget has no chunk to give (nothing was read: the peer is held by TCP; `bell` rings
    /// as soon as memory is given back, so the link reads again then, not at a guess),
    /// `Data(0)` when the socket had nothing. [`Self::drained`] says whether the socket was
    /// read dry.
    pub fn try_fill(
        &mut self,
        r: &mut impl Read,
        want: usize,
        bell: &crate::reactor::Doorbell,
    ) -> io::Result<Fill> {
        let budget = self.budget.clone();
        if !self.ensure_room(want, |min, n| budget.try_take_buffer(min, n, bell)) {
            return Ok(Fill::NoMemory);
        }
        self.read_into(r)
    }

    /// Whether the last read left the socket empty (it returned less than it could take, or
    /// nothing): with edge-triggered polling, new bytes will raise a new event.
    pub fn drained(&self) -> bool {
        self.drained
    }

    fn ensure_room(
        &mut self,
        want: usize,
        take: impl FnOnce(usize, usize) -> Option<Box<[u8]>>,
    ) -> bool {
        let cap = self.chunk.as_ref().map_or(0, |c| c.capacity());
        let have = self.filled - self.pos;
        // A fresh chunk when this one cannot take the whole message, or is nearly used up.
        let room = cap - self.filled;
        if self.chunk.is_none()
            || cap - self.pos < want
            || room < (self.cur / 16).max(1).min(want.max(1))
            || room == 0
        {
            // A chunk used up fast means a busy link: the next is twice as big (fewer reads,
            // fewer messages cut at a chunk's end); a slow one, half.
            if let Some(t) = self.started {
                let took = t.elapsed();
                if took < GROW_WITHIN {
                    self.cur = (self.cur * 2).min(self.chunk_size);
                } else if took > SHRINK_AFTER {
                    self.cur = (self.cur / 2).max(MIN_CHUNK.min(self.chunk_size));
                }
            }
            // And at least eight of the link's messages: a message cut by a chunk's end is
            // copied into the next, half a message per chunk on average, so this keeps the
            // copy under a sixteenth of the bytes. Without it a slow link of 32 KiB
            // super-fragments (16 x 60) kept 128 KiB chunks and copied an eighth.
            self.cur = self.cur.max(want.saturating_mul(8).min(self.chunk_size));
            let size = self.cur.max(want);
            let need = want.max(have).max(1);
            // The usual case, memory at hand: the part of a message cut by the chunk's end goes
            // straight into the new chunk, one copy (through a vector it was two copies and an
            // allocation, 2-3 % of all CPU at 16 x 60 where 128 KiB chunks carry half a 32 KiB
            // super-fragment each).
            if let Some(buf) = self.budget.take_now(need, size) {
                let fresh = Chunk::new(buf, self.budget.clone());
                if have > 0 {
                    // SAFETY: `fresh` is ours alone; nothing has been handed out of it.
                    unsafe { fresh.tail_mut(0)[..have].copy_from_slice(self.window()) };
                }
                self.chunk = Some(fresh);
                self.pos = 0;
                self.filled = have;
                self.started = Some(Instant::now());
                return true;
            }
            // Let go of the current chunk before waiting for memory: if nothing downstream still
            // holds a slice of it, that frees it, and a budget of two chunks can never deadlock
            // on the reader's own leftovers. The partial message carried over is at most one
            // message long.
            let carry = self.window().to_vec();
            self.chunk = None;
            // The new chunk must hold the message under way (and what was carried of it).
            let Some(buf) = take(need, size) else {
                self.chunk = Some(Chunk::from_vec(carry));
                self.pos = 0;
                self.filled = have;
                return false;
            };
            let fresh = Chunk::new(buf, self.budget.clone());
            if have > 0 {
                // SAFETY: `fresh` is ours alone; nothing has been handed out of it.
                unsafe { fresh.tail_mut(0)[..have].copy_from_slice(&carry) };
            }
            self.chunk = Some(fresh);
            self.pos = 0;
            self.filled = have;
            self.started = Some(Instant::now());
        }
        true
    }

    fn read_into(&mut self, r: &mut impl Read) -> io::Result<Fill> {
        let c = self.chunk.as_ref().expect("chunk present");
        // SAFETY: every slice handed out lies before `filled`; this is the only writer.
        let tail = unsafe { c.tail_mut(self.filled) };
        let asked = tail.len();
        self.read_started = Some(Instant::now());
        loop {
            match r.read(tail) {
                Ok(0) => return Ok(Fill::Eof),
                Ok(n) => {
                    self.filled += n;
                    self.drained = n < asked;
                    return Ok(Fill::Data(n));
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    self.drained = true;
                    return Ok(Fill::Data(0));
                }
                Err(e) => return Err(e),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader that returns its data in small pieces.
    struct Trickle<'a>(&'a [u8], usize);
    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = self.0.len().min(buf.len()).min(self.1);
            buf[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }

    #[test]
    fn messages_across_chunks_and_budget_returns() {
        let budget = Arc::new(Budget::new(1 << 20));
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let stop = AtomicBool::new(false);
        let mut slices = Vec::new();
        {
            let mut r = ChunkReader::new(budget.clone(), 1000);
            let mut src = Trickle(&data, 333);
            loop {
                // Messages of 300 bytes.
                while r.window().len() >= 300 {
                    slices.push(r.take(300));
                }
                if let Fill::Eof = r.fill(&mut src, 300, &stop).unwrap() {
                    break;
                }
            }
            let rest = r.window().len();
            r.skip(rest);
        }
        let joined: Vec<u8> = slices.iter().flat_map(|s| s.iter().copied()).collect();
        assert_eq!(&joined[..], &data[..joined.len()]);
        assert_eq!(joined.len(), 9900);
        assert!(budget.used() > 0);
        drop(slices);
        assert_eq!(budget.used(), 0);
    }

    /// A budget of exactly one chunk: the new chunk can only be the old one, given back once
    /// the reader lets go of it, so the part of a message cut at the chunk's end must be carried
    /// aside first. The stop flag is raised from the start, so a read that would wait for
    /// memory says `Stopped` instead of hanging the test.
    #[test]
    fn a_budget_of_one_chunk_carries_cut_messages_through_its_own_chunk() {
        let budget = Arc::new(Budget::new(1000));
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let stop = AtomicBool::new(true);
        let mut joined = Vec::new();
        let mut r = ChunkReader::new(budget.clone(), 1000);
        let mut src = Trickle(&data, 333);
        loop {
            while r.window().len() >= 300 {
                // Slices let go at once, as a consumer that keeps up would.
                joined.extend_from_slice(&r.take(300));
            }
            match r.fill(&mut src, 300, &stop).unwrap() {
                Fill::Eof => break,
                Fill::Data(_) => {}
                other => panic!("the one chunk was not reused: {other:?}"),
            }
        }
        assert_eq!(joined.len(), 9900);
        assert_eq!(&joined[..], &data[..9900]);
        assert!(budget.used() <= 1000);
    }

    /// A link of large messages reads into chunks that hold at least eight of them, whatever
    /// its rate: the first chunk, before any rate is known, already does.
    #[test]
    fn a_chunk_holds_at_least_eight_of_the_link_s_messages() {
        let budget = Arc::new(Budget::new(8 << 20));
        let mut r = ChunkReader::new(budget, 1 << 20);
        let data = vec![5u8; 64 << 10];
        let stop = AtomicBool::new(false);
        let got = r
            .fill(&mut Trickle(&data, 64 << 10), 32 << 10, &stop)
            .unwrap();
        assert_eq!(got, Fill::Data(64 << 10));
        assert_eq!(r.chunk.as_ref().unwrap().capacity(), 256 << 10);
        // Messages of a few bytes keep the smallest chunk.
        let mut small = ChunkReader::new(Arc::new(Budget::new(8 << 20)), 1 << 20);
        small.fill(&mut Trickle(&data, 100), 100, &stop).unwrap();
        assert_eq!(small.chunk.as_ref().unwrap().capacity(), MIN_CHUNK);
    }
}

//! A push-mode link served by the process's I/O pollers ([`tessera_net::reactor`]) instead of a
//! thread of its own: the same decoding, offering, silence and end-of-stream rules as the
//! blocking reader, as a state machine that never waits.

use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tessera_format::StreamDecoder;
use tessera_net::reactor::{
    Conn, Doorbell, Held, Next, Silence, Tally, TallyGuard, HELD_RETRY, MEMORY_RECHECK,
    READS_PER_TURN,
};
use tessera_net::reader::Fill;
use tessera_net::{ChunkReader, ChunkSlice};

use crate::{count_after_end, parse, LinkSink, LinkState, Parsed, LOOK_AFTER_END};

enum Phase {
    Reading,
    /// After the end of stream: counting bytes that should not come, until this time.
    AfterEnd {
        until: Instant,
        bytes: u64,
    },
}

pub(crate) struct PolledLink<S: LinkSink> {
    sink: Arc<S>,
    slot: usize,
    stream: TcpStream,
    dec: StreamDecoder,
    reader: ChunkReader,
    want: usize,
    /// Good fragments the sink could not take yet (the table of open events is full).
    good: Vec<(u64, ChunkSlice)>,
    silence: Silence,
    held: Held,
    eof: bool,
    /// The end of stream was parsed (acted on once every fragment before it was taken).
    ended: bool,
    phase: Phase,
    /// Rung by the link's budget when memory comes back after a read found none.
    bell: Doorbell,
    _live: TallyGuard,
}

impl<S: LinkSink> PolledLink<S> {
    pub(crate) fn new(
        sink: Arc<S>,
        slot: usize,
        stream: TcpStream,
        live: &Arc<Tally>,
    ) -> std::io::Result<Self> {
        stream.set_nonblocking(true)?;
        let sh = sink.ctx();
        let dec = StreamDecoder::after_hello(sh.max_payload, sh.sources[slot]);
        let chunk = sh.read_chunk.max(dec.max_message() * 2);
        let reader = ChunkReader::new(sh.stats.links[slot].budget.clone(), chunk);
        Ok(PolledLink {
            sink,
            slot,
            stream,
            dec,
            reader,
            want: 0,
            good: Vec::new(),
            silence: Silence::default(),
            held: Held::default(),
            eof: false,
            ended: false,
            phase: Phase::Reading,
            bell: Doorbell::default(),
            _live: live.enter(),
        })
    }

    fn count_held(&mut self, now: Instant, still: bool) {
        let busy = &self.sink.ctx().stats.links[self.slot].budget.busy_ns;
        self.held.count(busy, now, still);
    }

    /// Offers what is waiting; false while the sink cannot take it all.
    fn offer(&mut self, now: Instant) -> bool {
        if self.good.is_empty() {
            // Ends a wait for memory, if there was one.
            self.count_held(now, false);
            return true;
        }
        self.sink.offer(self.slot, &mut self.good);
        let taken = self.good.is_empty();
        self.count_held(now, !taken);
        taken
    }

    fn finish(&mut self) -> Next {
        let sh = self.sink.ctx();
        let link = &sh.stats.links[self.slot];
        if link.state() != LinkState::Aborted && link.state() != LinkState::Ended {
            link.set_state(LinkState::Disconnected);
        }
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        self.sink.close_link(self.slot);
        Next::Done
    }

    fn after_end(&mut self, now: Instant) -> Next {
        let Phase::AfterEnd { until, bytes } = &mut self.phase else {
            unreachable!("called after the end only")
        };
        let mut tail = [0u8; 4096];
        let mut over = now >= *until;
        loop {
            match std::io::Read::read(&mut self.stream, &mut tail) {
                Ok(0) => over = true,
                Ok(n) => {
                    *bytes += n as u64;
                    if *bytes <= 1 << 20 {
                        continue;
                    }
                    over = true;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => over = true,
            }
            break;
        }
        if !over {
            return Next::Readable(*until);
        }
        let bytes = *bytes;
        count_after_end(self.sink.ctx(), self.slot, bytes);
        self.finish()
    }
}

impl<S: LinkSink> Conn for PolledLink<S> {
    fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    fn doorbell(&self) -> Option<&Doorbell> {
        Some(&self.bell)
    }

    fn turn(&mut self) -> Next {
        self.bell.answer();
        let now = Instant::now();
        if let Phase::AfterEnd { .. } = self.phase {
            return self.after_end(now);
        }
        let sink = self.sink.clone();
        let sh = sink.ctx();
        let link = &sh.stats.links[self.slot];
        if sh.abort.load(Ordering::Relaxed) {
            self.count_held(now, false);
            link.set_state(LinkState::Aborted);
            return self.finish();
        }
        let mut reads = 0;
        let mut drained = false;
        loop {
            if !self.ended {
                let p: Parsed = parse(
                    sh,
                    self.slot,
                    &mut self.dec,
                    &mut self.reader,
                    &mut self.good,
                );
                self.want = p.want;
                self.ended = p.ended;
            }
            let now = Instant::now();
            // Whatever follows waits with held fragments: a link's fragments stay in order,
            // and its end is acted on only once all before it were taken.
            if !self.offer(now) {
                return Next::At(now + HELD_RETRY);
            }
            if self.ended {
                link.set_state(LinkState::Ended);
                self.phase = Phase::AfterEnd {
                    until: now + LOOK_AFTER_END,
                    bytes: self.reader.window().len() as u64,
                };
                return self.after_end(now);
            }
            if self.eof {
                return self.finish();
            }
            if drained {
                // The socket was empty as of the last read: wait for the next edge rather
                // than make a read that would only say "nothing".
                return Next::Readable(self.silence.next_look(self.stream.as_raw_fd(), now));
            }
            if reads == READS_PER_TURN {
                return Next::Again;
            }
            sink.before_read(self.slot);
            reads += 1;
            match self
                .reader
                .try_fill(&mut self.stream, self.want, &self.bell)
            {
                Ok(Fill::Data(0)) => {
                    let now = Instant::now();
                    if let Some(since) = self.silence.empty_read(self.reader.read_started, now) {
                        let s = sh.clock.ns_at(since);
                        // Silent up to the read, which did not wait: not up to whenever this
                        // thread got to here.
                        let read = self.reader.read_started.unwrap_or(now);
                        let until = sh.clock.ns_at(read);
                        sink.quiet(self.slot, s, until);
                    }
                    return Next::Readable(self.silence.next_look(self.stream.as_raw_fd(), now));
                }
                Ok(Fill::Data(_)) => {
                    drained = self.reader.drained();
                    if self.silence.data(drained) {
                        sink.heard(self.slot);
                    }
                }
                Ok(Fill::Eof) => {
                    self.dec.finish();
                    self.eof = true;
                }
                Ok(Fill::NoMemory) => {
                    // Not read: TCP holds the source. Not silence either.
                    self.silence.not_read();
                    let now = Instant::now();
                    self.count_held(now, true);
                    return Next::At(now + MEMORY_RECHECK);
                }
                Ok(Fill::Stopped) => unreachable!("try_fill never waits, so is never stopped"),
                Err(e) => {
                    tracing::warn!(readout_unit = sh.id, source = sh.sources[self.slot], error = %e, "link read failed");
                    self.dec.finish();
                    self.eof = true;
                }
            }
        }
    }
}

//! Writes the files as a pipeline, so that the disk stays busy and no file's close pauses the
//! flow of events:
//!
//! - the recorder's writer thread fills blocks with records and seals them ([`FileWriter`]);
//! - `recorder.compression_threads` threads encode sealed blocks (checksum, byte shuffle,
//!   compression), several at once, in any order;
//! - one disk thread writes the encoded blocks in their order and only writes: it rotates files
//!   by size (the next file is opened at once) and syncs when asked (group commit);
//! - one closer thread finishes each full file (trailer, sync, rename, sidecar, directory sync)
//!   while the next one is already being written.
//!
//! Records count as written once the disk thread wrote their block, and as synced once the file
//! holding them and every file before it are synced, so an acknowledgement never runs ahead of
//! the disk. Every stage hands on through a bounded channel: a slow disk holds the compressors,
//! which hold the writer, which holds the builder links (back-pressure, never a growing queue).

use crossbeam_channel::{bounded, Receiver, Sender};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, IoSlice, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tessera_config::{Compression, Durability, RecorderSection};
use tessera_format::file::{
    BlockEncoder, BlockHeader, Codec, FileHeader, FileTrailer, Filter, FILE_HEADER_SIZE,
};
use tessera_net::role::spawn;
use tessera_net::ChunkSlice;

use crate::{FileInfo, RecorderStats};

#[derive(Clone)]
pub struct FileSettings {
    pub dir: PathBuf,
    pub run_number: u64,
    pub config_digest: [u8; 32],
    pub pattern: String,
    pub sources: Vec<u32>,
    pub pattern_sources: Vec<u32>,
    pub section: RecorderSection,
    /// The stream its files belong to (`recorder.streams`); none: the main files.
    pub stream: Option<String>,
}

impl FileSettings {
    fn codec(&self) -> Codec {
        match self.section.compression {
            Compression::None => Codec::None,
            Compression::Lz4 => Codec::Lz4,
            Compression::Zstd => Codec::Zstd,
        }
    }

    fn filter(&self) -> Filter {
        if self.section.shuffle && self.codec() != Codec::None {
            Filter::Shuffle2
        } else {
            Filter::None
        }
    }

    /// A finished file is synced when the files are, or when events are acknowledged only once
    /// synced (then skipping it would acknowledge what is not on the disk).
    fn sync_files(&self) -> bool {
        self.section.fsync || self.section.durability == Durability::Sync
    }
}

/// The file being written.
struct Open {
    opened: Instant,
    file: File,
    part: PathBuf,
    name: String,
    sequence: u32,
    crc: u32,
    size: u64,
    trailer: FileTrailer,
    first: Option<u64>,
    last: Option<u64>,
    start_ns: u64,
}

/// The block being filled.
#[derive(Default)]
struct Block {
    records: Vec<ChunkSlice>,
    raw: usize,
    events: u32,
    fragments: u64,
    incomplete: u64,
    /// Fragments of the incomplete events.
    incomplete_fragments: u64,
    first: Option<u64>,
}

/// What a block holds, for the file's trailer and sidecar.
#[derive(Clone, Copy, Default)]
struct Counts {
    raw: usize,
    events: u32,
    fragments: u64,
    incomplete: u64,
    incomplete_fragments: u64,
    first: u64,
    last: Option<u64>,
}

/// Work for the compressors, numbered in the order the disk thread must take it.
enum Work {
    Block(u64, Block),
    /// Sync what is written so far (and raise the synced count when done).
    Sync(u64),
}

/// Work the disk thread takes in order.
enum Ready {
    Block {
        header: [u8; tessera_format::file::BLOCK_HEADER_SIZE],
        stored: Stored,
        counts: Counts,
    },
    Sync,
}

/// A block's bytes on the disk: the records themselves (uncompressed, written with one
/// vectored call from the links' chunks) or the encoded bytes.
enum Stored {
    Records(Vec<ChunkSlice>),
    Bytes(Vec<u8>),
}

/// A full file on its way to the closer, with the records written before its end.
struct ToClose {
    open: Open,
    records_end: u64,
}

/// How far the records got, counted in the order the writer sealed them.
#[derive(Default)]
struct Progress {
    /// Records in blocks the disk thread wrote.
    written: AtomicU64,
    /// Records on the disk: in files synced (the closer) or synced in the open file, with every
    /// file before synced too.
    synced: AtomicU64,
    sync: Mutex<SyncState>,
    /// The first error of the disk or the closer: the writer stops storing and says why.
    error: Mutex<Option<String>>,
    failed: AtomicBool,
    /// Raised by the writer's abandon: drop everything, finish nothing more.
    abandon: AtomicBool,
}

#[derive(Default)]
struct SyncState {
    /// Records before the end of the last file handed to the closer.
    handed: u64,
    /// Records before the end of the last file the closer finished.
    closed: u64,
    /// Records synced in the open file (counted from the run's start).
    open_synced: u64,
}

impl Progress {
    fn fail(&self, what: &str, e: io::Error) {
        let mut err = self.error.lock();
        if err.is_none() {
            tracing::error!(error = %e, "{what} failed");
            *err = Some(format!("{what}: {e}"));
        }
        self.failed.store(true, Ordering::Release);
    }

    /// Raises the synced count as far as every earlier file allows.
    fn update_synced(&self, f: impl FnOnce(&mut SyncState)) {
        let mut s = self.sync.lock();
        f(&mut s);
        let synced = if s.closed >= s.handed {
            s.closed.max(s.open_synced)
        } else {
            s.closed
        };
        self.synced.fetch_max(synced, Ordering::AcqRel);
    }
}

/// The writer's end of the pipeline. Records appended are sealed into blocks and handed on;
/// [`FileWriter::unwritten`] and [`FileWriter::unsynced`] say how many have not reached the file
/// or the disk yet.
pub struct FileWriter {
    block_size: usize,
    block: Block,
    next_seq: u64,
    /// Records appended since the start.
    appended: u64,
    to_compress: Option<Sender<Work>>,
    progress: Arc<Progress>,
    threads: Vec<JoinHandle<()>>,
    st: Arc<RecorderStats>,
}

fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

impl FileWriter {
    /// `news` is told after each write or sync (several writers may share it).
    pub fn new(s: FileSettings, st: Arc<RecorderStats>, news: Sender<()>) -> FileWriter {
        let s = Arc::new(s);
        let threads_n = s.section.compression_threads.max(1) as usize;
        // Two blocks per compressor in each hand-over: enough to keep every stage busy, and the
        // records they pin are bounded by the links' budgets.
        let (work_tx, work_rx) = bounded::<Work>(2 * threads_n);
        let (ready_tx, ready_rx) = bounded::<(u64, Ready)>(2 * threads_n);
        let (close_tx, close_rx) = bounded::<ToClose>(4);
        let news_tx = news;
        let progress = Arc::new(Progress::default());
        let mut threads = Vec::new();
        for i in 0..threads_n {
            let (rx, tx, s) = (work_rx.clone(), ready_tx.clone(), s.clone());
            let (progress, st) = (progress.clone(), st.clone());
            threads.push(spawn(format!("recorder-compress{i}"), move || {
                compress_loop(&s, rx, tx, &progress, &st)
            }));
        }
        drop(ready_tx);
        {
            let (s, st, progress) = (s.clone(), st.clone(), progress.clone());
            let news = news_tx.clone();
            threads.push(spawn("recorder-disk".into(), move || {
                let mut d = Disk::new(s, st, progress, close_tx, news);
                d.run(ready_rx);
            }));
        }
        {
            let (s, progress, st) = (s.clone(), progress.clone(), st.clone());
            threads.push(spawn("recorder-closer".into(), move || {
                for c in close_rx {
                    close_file(&s, &st, &progress, c, &news_tx);
                }
            }));
        }
        FileWriter {
            block_size: s.section.block_size.0 as usize,
            block: Block::default(),
            next_seq: 0,
            appended: 0,
            to_compress: Some(work_tx),
            progress,
            threads,
            st,
        }
    }

    fn failed(&self) -> io::Result<()> {
        if self.progress.failed.load(Ordering::Acquire) {
            let e = self.progress.error.lock().clone().unwrap_or_default();
            return Err(io::Error::other(e));
        }
        Ok(())
    }

    /// Adds one event record.
    pub fn append(&mut self, rec: ChunkSlice, fragments: u32, incomplete: bool) -> io::Result<()> {
        self.failed()?;
        let id = tessera_format::bytes::u64_at(&rec, 16);
        if self.block.raw > 0 && self.block.raw + rec.len() > self.block_size {
            self.seal()?;
        }
        let b = &mut self.block;
        b.first.get_or_insert(id);
        b.raw += rec.len();
        b.events += 1;
        b.fragments += fragments as u64;
        b.incomplete += incomplete as u64;
        if incomplete {
            b.incomplete_fragments += fragments as u64;
        }
        b.records.push(rec);
        self.appended += 1;
        if self.block.raw >= self.block_size {
            self.seal()?;
        }
        Ok(())
    }

    fn send(&mut self, w: impl FnOnce(u64) -> Work) -> io::Result<()> {
        let seq = self.next_seq;
        self.next_seq += 1;
        let tx = self
            .to_compress
            .as_ref()
            .ok_or_else(|| io::Error::other("closed"))?;
        tx.send(w(seq))
            .map_err(|_| io::Error::other("the recorder's disk pipeline ended"))?;
        self.failed()
    }

    /// Hands the partial block on.
    fn seal(&mut self) -> io::Result<()> {
        if self.block.events == 0 {
            return Ok(());
        }
        let block = std::mem::take(&mut self.block);
        self.send(|seq| Work::Block(seq, block))
    }

    /// After a failed write: drops the records still held (their memory goes back to the
    /// links, so the recorder keeps draining its builders) and the unfinished file, which stays
    /// on disk as `.part` for inspection and is never given its final name.
    pub fn abandon(&mut self) {
        let b = std::mem::take(&mut self.block);
        if self.st.disk_exhausted.load(Ordering::Acquire) {
            // Not written for want of space: named as such, not left out of every count.
            self.st
                .unrecorded(b.events as u64, b.fragments, b.incomplete_fragments);
        }
        self.progress.abandon.store(true, Ordering::Release);
        self.to_compress = None;
    }

    /// Records appended and not yet written to the file.
    pub fn unwritten(&self) -> usize {
        (self.appended
            - self
                .progress
                .written
                .load(Ordering::Acquire)
                .min(self.appended)) as usize
    }

    /// Records appended and not yet on the disk.
    pub fn unsynced(&self) -> usize {
        (self.appended
            - self
                .progress
                .synced
                .load(Ordering::Acquire)
                .min(self.appended)) as usize
    }

    /// Writes the partial block and syncs everything written (group commit): once done,
    /// [`Self::unsynced`] drops (the disk thread and the closer report it).
    pub fn sync(&mut self) -> io::Result<()> {
        if self.unsynced() == 0 {
            return Ok(());
        }
        self.seal()?;
        self.send(Work::Sync)
    }

    /// Writes the partial block, if any (the file stays open).
    pub fn flush(&mut self) -> io::Result<()> {
        self.seal()
    }

    /// Writes the last block, closes the file, and waits for every stage to finish.
    pub fn close(&mut self) -> io::Result<()> {
        let sealed = self.seal();
        self.to_compress = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        sealed?;
        self.failed()
    }
}

impl Drop for FileWriter {
    fn drop(&mut self) {
        self.to_compress = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// One compressor: checksums, shuffles and compresses blocks as they come.
fn compress_loop(
    s: &FileSettings,
    rx: Receiver<Work>,
    tx: Sender<(u64, Ready)>,
    progress: &Progress,
    st: &RecorderStats,
) {
    let (codec, filter, level) = (s.codec(), s.filter(), s.section.zstd_level);
    let mut enc = BlockEncoder::default();
    let mut raw = Vec::new();
    for w in rx {
        let (seq, ready) = match w {
            Work::Sync(seq) => (seq, Ready::Sync),
            Work::Block(seq, block) => {
                if progress.abandon.load(Ordering::Acquire) {
                    if st.disk_exhausted.load(Ordering::Acquire) {
                        st.unrecorded(
                            block.events as u64,
                            block.fragments,
                            block.incomplete_fragments,
                        );
                    }
                    continue;
                }
                let counts = Counts {
                    raw: block.raw,
                    events: block.events,
                    fragments: block.fragments,
                    incomplete: block.incomplete,
                    incomplete_fragments: block.incomplete_fragments,
                    first: block.first.unwrap_or(0),
                    last: block
                        .records
                        .last()
                        .map(|r| tessera_format::bytes::u64_at(r, 16)),
                };
                if codec == Codec::None {
                    let mut raw_crc = 0u32;
                    for r in &block.records {
                        raw_crc = tessera_format::crc::crc32c_append(raw_crc, r);
                    }
                    let h = BlockHeader {
                        codec,
                        filter: Filter::None,
                        stored_size: block.raw as u32,
                        raw_size: block.raw as u32,
                        event_count: block.events,
                        raw_crc,
                        first_event_id: counts.first,
                    };
                    let ready = Ready::Block {
                        header: h.encode(),
                        stored: Stored::Records(block.records),
                        counts,
                    };
                    (seq, ready)
                } else {
                    // Compressed blocks need the records contiguous; their chunks go back to
                    // the links as soon as they are copied.
                    raw.clear();
                    for r in &block.records {
                        raw.extend_from_slice(r);
                    }
                    drop(block.records);
                    let (h, stored) =
                        enc.encode(&raw, codec, filter, level, counts.events, counts.first);
                    let ready = Ready::Block {
                        header: h.encode(),
                        stored: Stored::Bytes(stored.to_vec()),
                        counts,
                    };
                    (seq, ready)
                }
            }
        };
        if tx.send((seq, ready)).is_err() {
            return;
        }
    }
}

/// Free space a block must leave on the output file system, beyond itself, to be written: room
/// for finishing the run once nothing more fits (the open files' trailers and sidecars, the
/// manifest, the run database's end of the run with its report and message log).
const CLOSE_MARGIN: u64 = 4 << 20;

/// The disk thread: writes in order, rotates, syncs.
struct Disk {
    s: Arc<FileSettings>,
    st: Arc<RecorderStats>,
    progress: Arc<Progress>,
    to_closer: Option<Sender<ToClose>>,
    news: Sender<()>,
    open: Option<Open>,
    next_sequence: u32,
    /// Records written since the start.
    written: u64,
    throttle_t0: Option<Instant>,
    throttle_bytes: u64,
    throttle_rate: u64,
}

impl Disk {
    fn new(
        s: Arc<FileSettings>,
        st: Arc<RecorderStats>,
        progress: Arc<Progress>,
        to_closer: Sender<ToClose>,
        news: Sender<()>,
    ) -> Disk {
        Disk {
            s,
            st,
            progress,
            to_closer: Some(to_closer),
            news,
            open: None,
            next_sequence: 1,
            written: 0,
            throttle_t0: None,
            throttle_bytes: 0,
            throttle_rate: 0,
        }
    }

    fn run(&mut self, rx: Receiver<(u64, Ready)>) {
        // Compressors finish out of order; blocks wait here for their turn (at most the ones in
        // flight: the channels are bounded).
        let mut waiting: BTreeMap<u64, Ready> = BTreeMap::new();
        let mut next = 0u64;
        let max_age = (self.s.section.max_file_age_s > 0.0)
            .then(|| Duration::from_secs_f64(self.s.section.max_file_age_s));
        loop {
            // Woken at least every 100 ms to finish a file past its age, data or not.
            let got = match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(x) => Some(x),
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => None,
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
            };
            if let Some(age) = max_age {
                if self
                    .open
                    .as_ref()
                    .is_some_and(|o| o.opened.elapsed() >= age)
                    && !self.progress.failed.load(Ordering::Acquire)
                    && !self.progress.abandon.load(Ordering::Acquire)
                {
                    self.hand_to_closer();
                    let _ = self.news.try_send(());
                }
            }
            let Some((seq, ready)) = got else {
                continue;
            };
            waiting.insert(seq, ready);
            while let Some(r) = waiting.remove(&next) {
                next += 1;
                if self.progress.abandon.load(Ordering::Acquire)
                    || self.progress.failed.load(Ordering::Acquire)
                {
                    if let Ready::Block { counts: c, .. } = &r {
                        if self.st.disk_exhausted.load(Ordering::Acquire) {
                            // Dropped behind a failure that the full disk caused: named.
                            self.st.unrecorded(
                                c.events as u64,
                                c.fragments,
                                c.incomplete_fragments,
                            );
                        }
                    }
                    continue;
                }
                let r = match r {
                    Ready::Block {
                        header,
                        stored,
                        counts,
                    } => self.write_or_count(&header, stored, counts),
                    Ready::Sync => self.sync(),
                };
                if let Err(e) = r {
                    self.progress.fail("writing", e);
                }
                let _ = self.news.try_send(());
            }
        }
        // The writer closed its end: the open file is finished too (never after an abandon or
        // a failure: it stays `.part`).
        if !self.progress.abandon.load(Ordering::Acquire)
            && !self.progress.failed.load(Ordering::Acquire)
        {
            self.hand_to_closer();
        }
        self.to_closer = None;
    }

    fn open_file(&mut self) -> io::Result<&mut Open> {
        if self.open.is_none() {
            let s = &self.s;
            std::fs::create_dir_all(&s.dir)?;
            // A file of this run already there (an earlier recorder of the run wrote it, and
            // this one took it over) keeps its name: the sequence goes on after it.
            let (seq, name, part) = loop {
                let seq = self.next_sequence;
                self.next_sequence += 1;
                let name =
                    tessera_archive::stream_file_name(s.run_number, s.stream.as_deref(), seq);
                let part = s.dir.join(format!("{name}.part"));
                // (Anything else in the way, a directory say, is not skipped: creating the
                // file then fails, and says so.)
                if !s.dir.join(&name).is_file() && !part.is_file() {
                    break (seq, name, part);
                }
            };
            let mut file = File::options().write(true).create_new(true).open(&part)?;
            let start_ns = unix_ns();
            let hb = FileHeader {
                run_number: s.run_number,
                file_sequence: seq,
                codec: s.codec(),
                filter: s.filter(),
                start_time_ns: start_ns,
                config_digest: s.config_digest,
            }
            .encode();
            if let Err(e) = file.write_all(&hb) {
                // A file without its whole header holds nothing: none is left behind.
                drop(file);
                let _ = std::fs::remove_file(&part);
                self.next_sequence -= 1;
                return Err(e);
            }
            self.open = Some(Open {
                opened: Instant::now(),
                file,
                part,
                name,
                sequence: seq,
                crc: tessera_format::crc::crc32c(&hb),
                size: FILE_HEADER_SIZE as u64,
                trailer: FileTrailer::default(),
                first: None,
                last: None,
                start_ns,
            });
        }
        Ok(self.open.as_mut().expect("opened above"))
    }

    /// Writes a block if the disk has room for it; once it has not, finishes the open file and
    /// counts this block and every later one as unrecorded (the run is stopping: the disk is
    /// full). Room means the block and [`CLOSE_MARGIN`] for finishing the run. The room held in
    /// reserve (`recorder.disk_reserve`) is given back the first time a block does not fit, and
    /// the drain goes on into it. A write that fails for want of space anyway (another writer
    /// took it meanwhile) is cut back to the file's last whole block and tried once more with
    /// the reserve given back.
    fn write_or_count(&mut self, header: &[u8], stored: Stored, c: Counts) -> io::Result<()> {
        if !self.st.disk_exhausted.load(Ordering::Acquire) {
            let len = header.len() as u64
                + match &stored {
                    Stored::Records(_) => c.raw as u64,
                    Stored::Bytes(b) => b.len() as u64,
                };
            let fits = |dir: &std::path::Path| {
                free_bytes(dir).is_none_or(|free| free >= len + CLOSE_MARGIN)
            };
            let mut stored = Some(stored);
            for _ in 0..2 {
                // One look at the free space per block while it fits.
                if !fits(&self.s.dir) {
                    if !self.give_back_reserve() {
                        break;
                    }
                    if !fits(&self.s.dir) {
                        continue;
                    }
                }
                match self.write_block(header, &mut stored, c) {
                    Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                        self.cut_back()?;
                        if !self.give_back_reserve() {
                            break;
                        }
                    }
                    r => return r,
                }
            }
            self.exhausted();
        }
        if self.open.is_some() {
            // Another series exhausted the disk: this one finishes its file too.
            self.hand_to_closer();
        }
        self.st
            .unrecorded(c.events as u64, c.fragments, c.incomplete_fragments);
        // Counted as passed on, so that acknowledgements go on and no builder waits for what
        // will never be written.
        self.written += c.events as u64;
        self.progress.written.store(self.written, Ordering::Release);
        if self.open.is_none() {
            let w = self.written;
            self.progress.update_synced(|s| s.open_synced = w);
        }
        Ok(())
    }

    /// Gives the reserve back for the drain; whether there was one.
    fn give_back_reserve(&self) -> bool {
        let free = free_bytes(&self.s.dir).unwrap_or(0);
        let given = self.st.release_reserve();
        if given {
            tracing::warn!(dir = %self.s.dir.display(), free,
                "output file system nearly full: the room held in reserve (recorder.disk_reserve) goes to the drain");
        }
        given
    }

    /// The disk has no room for data: the run stops and the open file is finished with the
    /// blocks it holds.
    fn exhausted(&mut self) {
        let st = &self.st;
        if !st.disk_exhausted.swap(true, Ordering::AcqRel) {
            tracing::error!(
                dir = %self.s.dir.display(),
                free = free_bytes(&self.s.dir).unwrap_or(0),
                "output file system full: the recorder finishes its files and writes nothing more; what it cannot write is counted unrecorded_disk_full"
            );
        }
        st.disk_full.store(true, Ordering::Release);
        st.release_reserve();
        self.hand_to_closer();
    }

    /// After a write that ran out of space: the open file is cut back to its last whole block
    /// (what the failed write left of its block is not part of the file).
    fn cut_back(&mut self) -> io::Result<()> {
        use std::io::{Seek, SeekFrom};
        if let Some(o) = self.open.as_mut() {
            o.file.set_len(o.size)?;
            o.file.seek(SeekFrom::Start(o.size))?;
        }
        Ok(())
    }

    /// Writes the block in `stored`, taking it once written; left there when the write fails.
    fn write_block(
        &mut self,
        header: &[u8],
        stored: &mut Option<Stored>,
        c: Counts,
    ) -> io::Result<()> {
        let t = Instant::now();
        let max_file = self.s.section.max_file_size.0;
        let st = self.st.clone();
        let o = self.open_file()?;
        let Some(block) = stored.as_ref() else {
            return Ok(());
        };
        let written = match block {
            Stored::Records(records) => {
                let mut io: Vec<IoSlice> = Vec::with_capacity(records.len() + 1);
                io.push(IoSlice::new(header));
                io.extend(records.iter().map(|r| IoSlice::new(r)));
                tessera_net::io::write_all_vectored(&mut o.file, &mut io)?;
                // The file CRC goes on over the header and the same records (a second pass at
                // ~59 GB/s is cheaper than combining the raw CRC into it).
                o.crc = tessera_format::crc::crc32c_append(o.crc, header);
                for r in records {
                    o.crc = tessera_format::crc::crc32c_append(o.crc, r);
                }
                header.len() + c.raw
            }
            Stored::Bytes(b) => {
                o.file.write_all(header)?;
                o.file.write_all(b)?;
                o.crc = tessera_format::crc::crc32c_append(
                    tessera_format::crc::crc32c_append(o.crc, header),
                    b,
                );
                header.len() + b.len()
            }
        };
        drop(stored.take());
        o.size += written as u64;
        o.trailer.events += c.events as u64;
        o.trailer.incomplete_events += c.incomplete;
        o.trailer.fragments += c.fragments;
        o.trailer.record_bytes += c.raw as u64;
        o.trailer.blocks += 1;
        o.first.get_or_insert(c.first);
        o.last = c.last;
        *st.current_file.lock() = Some(crate::CurrentFile {
            file: format!("{}.part", o.name),
            events: o.trailer.events,
            size_bytes: o.size,
        });
        let full = o.size >= max_file;
        self.written += c.events as u64;
        self.progress.written.store(self.written, Ordering::Release);
        self.st
            .write_ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.st
            .file_bytes
            .fetch_add(written as u64, Ordering::Relaxed);
        self.throttle(written as u64);
        if full {
            // The next block opens the next file; this one is finished beside the data path.
            self.hand_to_closer();
        }
        Ok(())
    }

    fn hand_to_closer(&mut self) {
        let Some(open) = self.open.take() else {
            return;
        };
        self.st.current_file.lock().take();
        let records_end = self.written;
        self.progress.update_synced(|s| s.handed = records_end);
        if let Some(tx) = &self.to_closer {
            let _ = tx.send(ToClose { open, records_end });
        }
    }

    /// Syncs the data written to the open file (fdatasync): every record written so far is on
    /// the disk once the files before it are too. One call covers every block written since the
    /// last (group commit).
    fn sync(&mut self) -> io::Result<()> {
        if let Some(o) = &self.open {
            let t = Instant::now();
            o.file.sync_data()?;
            self.st
                .write_ns
                .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            self.st.syncs.fetch_add(1, Ordering::Relaxed);
        }
        let w = self.written;
        self.progress.update_synced(|s| s.open_synced = w);
        Ok(())
    }

    /// Looks at the free space of the output file system after each block: below the soft
    /// watermark the disk alarm goes on and each block is followed by a pause (the run feels it
    /// as back-pressure from the disk); below the hard one the run is asked to stop while there
    /// is room left for its drain, trailers, manifest and database.
    fn watch_disk(&mut self) {
        let st = &self.st;
        let Some(free) = free_bytes(&self.s.dir) else {
            return;
        };
        st.disk_free.store(free, Ordering::Relaxed);
        let soft = self.s.section.disk_soft_free.0;
        let hard = self.s.section.disk_hard_free.0;
        if free < hard && !st.disk_full.swap(true, Ordering::AcqRel) {
            tracing::error!(free, hard, dir = %self.s.dir.display(), "disk below its hard watermark: the run stops");
        }
        let low = free < soft;
        if low != st.disk_low.swap(low, Ordering::AcqRel) {
            if low {
                tracing::warn!(free, soft, dir = %self.s.dir.display(), "disk alarm: below the soft watermark, writes slowed");
            } else {
                tracing::info!(free, soft, "disk alarm off");
            }
        }
        if low {
            let pause = Duration::from_millis(20);
            std::thread::sleep(pause);
            st.throttled_ns
                .fetch_add(pause.as_nanos() as u64, Ordering::Relaxed);
        }
    }

    /// Sleeps as needed so that the average write rate stays under the throttle.
    fn throttle(&mut self, n: u64) {
        self.watch_disk();
        let rate = {
            let mut f = self.st.throttle_fault.lock();
            match *f {
                Some((rate, until)) if Instant::now() < until => rate,
                Some(_) => {
                    *f = None;
                    self.s.section.throttle.0
                }
                None => self.s.section.throttle.0,
            }
        };
        if rate != self.throttle_rate {
            // The average is kept from when this rate began.
            self.throttle_rate = rate;
            self.throttle_t0 = None;
            self.throttle_bytes = 0;
        }
        if rate == 0 {
            return;
        }
        let t0 = *self.throttle_t0.get_or_insert_with(Instant::now);
        self.throttle_bytes += n;
        let due = Duration::from_secs_f64(self.throttle_bytes as f64 / rate as f64);
        let el = t0.elapsed();
        if due > el {
            std::thread::sleep(due - el);
            self.st
                .throttled_ns
                .fetch_add((due - el).as_nanos() as u64, Ordering::Relaxed);
        }
    }
}

/// The closer: trailer, sync, rename, sidecar, directory sync; then the file's records count as
/// synced (with every file before it, which this thread finished first).
fn close_file(
    s: &FileSettings,
    st: &RecorderStats,
    progress: &Progress,
    c: ToClose,
    news: &Sender<()>,
) {
    let ToClose {
        open: mut o,
        records_end,
    } = c;
    if progress.failed.load(Ordering::Acquire) {
        return;
    }
    let t = Instant::now();
    let r = (|| -> io::Result<FileInfo> {
        o.trailer.file_crc = o.crc;
        let tb = o.trailer.encode();
        o.file.write_all(&tb)?;
        o.size += tb.len() as u64;
        st.file_bytes.fetch_add(tb.len() as u64, Ordering::Relaxed);
        if s.sync_files() {
            o.file.sync_all()?;
            st.syncs.fetch_add(1, Ordering::Relaxed);
        }
        let final_path = s.dir.join(&o.name);
        std::fs::rename(&o.part, &final_path)?;
        let codec = s.codec();
        let info = FileInfo {
            file: o.name.clone(),
            format_version: tessera_format::file::FILE_VERSION,
            run_number: s.run_number,
            sequence: o.sequence,
            size_bytes: o.size,
            events: o.trailer.events,
            incomplete_events: o.trailer.incomplete_events,
            fragments: o.trailer.fragments,
            record_bytes: o.trailer.record_bytes,
            blocks: o.trailer.blocks,
            compression: codec.name().into(),
            filter: s.filter().name().into(),
            file_crc32c: format!("{:08x}", o.crc),
            first_event_id: o.first,
            last_event_id: o.last,
            start_time_unix_ns: o.start_ns,
            end_time_unix_ns: unix_ns(),
            config_sha256: hex::encode(s.config_digest),
            pattern: s.pattern.clone(),
            sources: s.sources.clone(),
            pattern_sources: s.pattern_sources.clone(),
            recovered: false,
            stream: s.stream.clone(),
        };
        let json = serde_json::to_vec_pretty(&info).map_err(io::Error::other)?;
        write_atomic(
            &s.dir.join(format!("{}.json", o.name)),
            &json,
            s.section.fsync,
        )?;
        if s.sync_files() {
            File::open(&s.dir)?.sync_all()?;
        }
        Ok(info)
    })();
    st.write_ns
        .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    match r {
        Ok(info) => {
            st.files.lock().push(info);
            progress.update_synced(|s| s.closed = records_end);
        }
        Err(e) => progress.fail("closing a file", e),
    }
    let _ = news.try_send(());
}

/// The recorder's files by stream (`recorder.streams`): the main files first (as
/// `recorder.writers` series, each with a pipeline of its own), then each named stream with a
/// pipeline of its own; an event goes to the stream of its trigger type, else to the main
/// series of its builder link.
pub struct Streams {
    writers: Vec<FileWriter>,
    /// Trigger type to stream index; absent: the main files.
    route: std::collections::HashMap<u16, usize>,
    /// Series of the main files: indices `0..main`.
    main: usize,
}

impl Streams {
    pub fn new(s: FileSettings, st: Arc<RecorderStats>, news: Sender<()>) -> Streams {
        let names: Vec<(String, Vec<u16>)> = s
            .section
            .streams
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let main = s.section.writers.max(1) as usize;
        let mut route = std::collections::HashMap::new();
        let mut writers = Vec::with_capacity(names.len() + main);
        writers.push(FileWriter::new(s.clone(), st.clone(), news.clone()));
        for k in 1..main {
            let one = FileSettings {
                stream: Some(format!("w{k}")),
                ..s.clone()
            };
            writers.push(FileWriter::new(one, st.clone(), news.clone()));
        }
        for (i, (name, types)) in names.into_iter().enumerate() {
            for t in types {
                route.insert(t, main + i);
            }
            let one = FileSettings {
                stream: Some(name),
                ..s.clone()
            };
            writers.push(FileWriter::new(one, st.clone(), news.clone()));
        }
        Streams {
            writers,
            route,
            main,
        }
    }

    pub fn len(&self) -> usize {
        self.writers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.writers.is_empty()
    }

    /// Adds one event record, from builder link `link`, to its stream's files; the stream's
    /// index.
    pub fn append(
        &mut self,
        link: usize,
        rec: ChunkSlice,
        fragments: u32,
        incomplete: bool,
    ) -> io::Result<usize> {
        let main = link % self.main;
        let i = if self.route.is_empty() || rec.len() < 34 {
            main
        } else {
            let trigger = tessera_format::bytes::u16_at(&rec, 32);
            self.route.get(&trigger).copied().unwrap_or(main)
        };
        self.writers[i].append(rec, fragments, incomplete)?;
        Ok(i)
    }

    pub fn unwritten_of(&self, i: usize) -> usize {
        self.writers[i].unwritten()
    }

    pub fn unsynced_of(&self, i: usize) -> usize {
        self.writers[i].unsynced()
    }

    pub fn unwritten(&self) -> usize {
        self.writers.iter().map(|w| w.unwritten()).sum()
    }

    pub fn unsynced(&self) -> usize {
        self.writers.iter().map(|w| w.unsynced()).sum()
    }

    pub fn flush(&mut self) -> io::Result<()> {
        self.writers.iter_mut().try_for_each(|w| w.flush())
    }

    pub fn sync(&mut self) -> io::Result<()> {
        self.writers.iter_mut().try_for_each(|w| w.sync())
    }

    pub fn abandon(&mut self) {
        self.writers.iter_mut().for_each(|w| w.abandon());
    }

    /// Closes every stream's files (each finishes even when another fails); the first error.
    pub fn close(&mut self) -> io::Result<()> {
        let mut first = Ok(());
        for w in &mut self.writers {
            let r = w.close();
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

pub use tessera_archive::{free_bytes, write_atomic};

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: u64) -> ChunkSlice {
        let mut r = vec![0u8; 64];
        r[16..24].copy_from_slice(&id.to_le_bytes());
        ChunkSlice::copy_from(&r)
    }

    /// Waits (bounded) until `f` holds of the writer: the disk thread works on its own.
    fn until(w: &FileWriter, news: &Receiver<()>, what: &str, f: impl Fn(&FileWriter) -> bool) {
        let t = std::time::Instant::now();
        while !f(w) {
            assert!(t.elapsed() < Duration::from_secs(60), "never: {what}");
            let _ = news.recv_timeout(Duration::from_millis(10));
        }
    }

    /// An acknowledgement waits for `unsynced()` to cover a record: it counts the partial block
    /// and every block written since the last sync, and only a sync (or a finished, synced file)
    /// brings it down.
    #[test]
    fn unsynced_counts_written_records_until_a_sync() {
        let dir = tempfile::tempdir().unwrap();
        let mut section = RecorderSection {
            block_size: tessera_config::ByteSize(4096),
            ..Default::default()
        };
        section.disk_hard_free = tessera_config::ByteSize(0);
        section.disk_soft_free = tessera_config::ByteSize(0);
        let st = Arc::new(RecorderStats::default());
        let (news_tx, news) = bounded(1);
        let mut w = FileWriter::new(
            FileSettings {
                dir: dir.path().to_path_buf(),
                run_number: 1,
                config_digest: [0; 32],
                pattern: String::new(),
                sources: vec![],
                pattern_sources: vec![],
                section,
                stream: None,
            },
            st.clone(),
            news_tx,
        );
        for id in 0..3 {
            w.append(record(id), 0, false).unwrap();
        }
        assert_eq!((w.unwritten(), w.unsynced()), (3, 3));
        w.flush().unwrap();
        until(&w, &news, "the block written", |w| w.unwritten() == 0);
        assert_eq!(w.unsynced(), 3, "written is not synced");
        w.append(record(3), 0, false).unwrap();
        assert_eq!(w.unsynced(), 4);
        w.sync().unwrap();
        until(&w, &news, "the sync", |w| w.unsynced() == 0);
        assert_eq!(w.unwritten(), 0, "a sync writes the partial block first");
        assert_eq!(st.syncs.load(Ordering::Relaxed), 1);
        w.append(record(4), 0, false).unwrap();
        w.close().unwrap();
        assert_eq!(w.unsynced(), 0, "a finished file is synced whole");
        assert_eq!(st.syncs.load(Ordering::Relaxed), 2);
        assert_eq!(st.files.lock().len(), 1);
        assert_eq!(st.files.lock()[0].events, 5);
    }
}

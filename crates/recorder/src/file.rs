//! Writes the files: blocks, rotation, trailer, durable close, sidecar.

use std::fs::File;
use std::io::{self, IoSlice, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tessera_config::{Compression, RecorderSection};
use tessera_format::file::{
    BlockEncoder, BlockHeader, Codec, FileHeader, FileTrailer, Filter, FILE_HEADER_SIZE,
};
use tessera_net::ChunkSlice;

use crate::{FileInfo, RecorderStats};

pub struct FileSettings {
    pub dir: PathBuf,
    pub run_number: u64,
    pub config_digest: [u8; 32],
    pub pattern: String,
    pub sources: Vec<u32>,
    pub pattern_sources: Vec<u32>,
    pub section: RecorderSection,
}

struct Open {
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
    first: Option<u64>,
}

pub struct FileWriter {
    s: FileSettings,
    codec: Codec,
    filter: Filter,
    open: Option<Open>,
    block: Block,
    next_sequence: u32,
    enc: BlockEncoder,
    raw_buf: Vec<u8>,
    throttle_t0: Option<Instant>,
    throttle_bytes: u64,
    /// Records written to the file since its last sync (a finished file is synced whole).
    unsynced: usize,
}

fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

impl FileWriter {
    pub fn new(s: FileSettings) -> FileWriter {
        let codec = match s.section.compression {
            Compression::None => Codec::None,
            Compression::Lz4 => Codec::Lz4,
            Compression::Zstd => Codec::Zstd,
        };
        let filter = if s.section.shuffle && codec != Codec::None {
            Filter::Shuffle2
        } else {
            Filter::None
        };
        FileWriter {
            s,
            codec,
            filter,
            open: None,
            block: Block::default(),
            next_sequence: 1,
            enc: BlockEncoder::default(),
            raw_buf: Vec::new(),
            throttle_t0: None,
            throttle_bytes: 0,
            unsynced: 0,
        }
    }

    /// Adds one event record.
    pub fn append(
        &mut self,
        rec: ChunkSlice,
        fragments: u32,
        incomplete: bool,
        st: &RecorderStats,
    ) -> io::Result<()> {
        let id = tessera_format::bytes::u64_at(&rec, 16);
        if self.block.raw > 0 && self.block.raw + rec.len() > self.s.section.block_size.0 as usize {
            self.flush_block(st)?;
        }
        let b = &mut self.block;
        b.first.get_or_insert(id);
        b.raw += rec.len();
        b.events += 1;
        b.fragments += fragments as u64;
        b.incomplete += incomplete as u64;
        b.records.push(rec);
        if self.block.raw >= self.s.section.block_size.0 as usize {
            self.flush_block(st)?;
        }
        Ok(())
    }

    fn flush_block(&mut self, st: &RecorderStats) -> io::Result<()> {
        if self.block.events == 0 {
            return Ok(());
        }
        let block = std::mem::take(&mut self.block);
        let first = block.first.unwrap_or(0);
        let last = block
            .records
            .last()
            .map(|r| tessera_format::bytes::u64_at(r, 16));
        let t = Instant::now();
        let codec = self.codec;
        let filter = self.filter;
        let level = self.s.section.zstd_level;
        let written;
        {
            // Compressed blocks need the records contiguous; uncompressed ones go out as they are.
            let raw_buf = &mut self.raw_buf;
            let enc = &mut self.enc;
            if self.open.is_none() {
                Self::open_now(
                    &mut self.open,
                    &self.s,
                    codec,
                    filter,
                    &mut self.next_sequence,
                )?;
            }
            let o = self.open.as_mut().expect("opened above");
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
                    first_event_id: first,
                };
                let hb = h.encode();
                let mut io: Vec<IoSlice> = Vec::with_capacity(block.records.len() + 1);
                io.push(IoSlice::new(&hb));
                io.extend(block.records.iter().map(|r| IoSlice::new(r)));
                tessera_net::io::write_all_vectored(&mut o.file, &mut io)?;
                // The file CRC goes on over the header and the same records (a second pass at
                // ~59 GB/s is cheaper than combining raw_crc into it, which cost ~100 us a block).
                o.crc = tessera_format::crc::crc32c_append(o.crc, &hb);
                for r in &block.records {
                    o.crc = tessera_format::crc::crc32c_append(o.crc, r);
                }
                written = hb.len() + block.raw;
            } else {
                raw_buf.clear();
                for r in &block.records {
                    raw_buf.extend_from_slice(r);
                }
                let (h, stored) = enc.encode(raw_buf, codec, filter, level, block.events, first);
                let hb = h.encode();
                o.file.write_all(&hb)?;
                o.file.write_all(stored)?;
                o.crc = tessera_format::crc::crc32c_append(
                    tessera_format::crc::crc32c_append(o.crc, &hb),
                    stored,
                );
                written = hb.len() + stored.len();
            }
            o.size += written as u64;
            self.unsynced += block.events as usize;
            o.trailer.events += block.events as u64;
            o.trailer.incomplete_events += block.incomplete;
            o.trailer.fragments += block.fragments;
            o.trailer.record_bytes += block.raw as u64;
            o.trailer.blocks += 1;
            o.first.get_or_insert(first);
            o.last = last;
            *st.current_file.lock() = Some(crate::CurrentFile {
                file: format!("{}.part", o.name),
                events: o.trailer.events,
                size_bytes: o.size,
            });
        }
        st.write_ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        st.file_bytes.fetch_add(written as u64, Ordering::Relaxed);
        drop(block.records);
        self.throttle(written as u64, st);
        if self
            .open
            .as_ref()
            .is_some_and(|o| o.size >= self.s.section.max_file_size.0)
        {
            self.finish_file(st)?;
        }
        Ok(())
    }

    fn open_now<'a>(
        slot: &'a mut Option<Open>,
        s: &FileSettings,
        codec: Codec,
        filter: Filter,
        next: &mut u32,
    ) -> io::Result<&'a mut Open> {
        std::fs::create_dir_all(&s.dir)?;
        let seq = *next;
        *next += 1;
        let name = file_name(s.run_number, seq);
        let part = s.dir.join(format!("{name}.part"));
        let mut file = File::create(&part)?;
        let start_ns = unix_ns();
        let hb = FileHeader {
            run_number: s.run_number,
            file_sequence: seq,
            codec,
            filter,
            start_time_ns: start_ns,
            config_digest: s.config_digest,
        }
        .encode();
        file.write_all(&hb)?;
        *slot = Some(Open {
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
        Ok(slot.as_mut().expect("just set"))
    }

    /// Sleeps as needed so that the average write rate stays under the throttle.
    /// Looks at the free space of the output file system after each block: below the soft
    /// watermark the disk alarm goes on and each block is followed by a pause (the run feels it
    /// as back-pressure from the disk); below the hard one the run is asked to stop while there
    /// is room left for its drain, trailers, manifest and database.
    fn watch_disk(&mut self, st: &RecorderStats) {
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

    fn throttle(&mut self, n: u64, st: &RecorderStats) {
        self.watch_disk(st);
        let rate = self.s.section.throttle.0;
        if rate == 0 {
            return;
        }
        let t0 = *self.throttle_t0.get_or_insert_with(Instant::now);
        self.throttle_bytes += n;
        let due = Duration::from_secs_f64(self.throttle_bytes as f64 / rate as f64);
        let el = t0.elapsed();
        if due > el {
            std::thread::sleep(due - el);
            st.throttled_ns
                .fetch_add((due - el).as_nanos() as u64, Ordering::Relaxed);
        }
    }

    /// Trailer, fsync, rename, sidecar.
    fn finish_file(&mut self, st: &RecorderStats) -> io::Result<()> {
        let Some(mut o) = self.open.take() else {
            return Ok(());
        };
        st.current_file.lock().take();
        let t = Instant::now();
        o.trailer.file_crc = o.crc;
        let tb = o.trailer.encode();
        o.file.write_all(&tb)?;
        o.size += tb.len() as u64;
        if self.s.section.fsync {
            o.file.sync_all()?;
            self.unsynced = 0;
            st.syncs.fetch_add(1, Ordering::Relaxed);
        }
        drop(o.file);
        let final_path = self.s.dir.join(&o.name);
        std::fs::rename(&o.part, &final_path)?;
        let info = FileInfo {
            file: o.name.clone(),
            format_version: tessera_format::file::FILE_VERSION,
            run_number: self.s.run_number,
            sequence: o.sequence,
            size_bytes: o.size,
            events: o.trailer.events,
            incomplete_events: o.trailer.incomplete_events,
            fragments: o.trailer.fragments,
            record_bytes: o.trailer.record_bytes,
            blocks: o.trailer.blocks,
            compression: self.codec.name().into(),
            filter: self.filter.name().into(),
            file_crc32c: format!("{:08x}", o.crc),
            first_event_id: o.first,
            last_event_id: o.last,
            start_time_unix_ns: o.start_ns,
            end_time_unix_ns: unix_ns(),
            config_sha256: hex::encode(self.s.config_digest),
            pattern: self.s.pattern.clone(),
            sources: self.s.sources.clone(),
            pattern_sources: self.s.pattern_sources.clone(),
            recovered: false,
        };
        let json = serde_json::to_vec_pretty(&info).map_err(io::Error::other)?;
        write_atomic(
            &self.s.dir.join(format!("{}.json", o.name)),
            &json,
            self.s.section.fsync,
        )?;
        if self.s.section.fsync {
            File::open(&self.s.dir)?.sync_all()?;
        }
        st.write_ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        st.file_bytes.fetch_add(tb.len() as u64, Ordering::Relaxed);
        st.files.lock().push(info);
        Ok(())
    }

    /// After a failed write: drops the records still held (their memory goes back to the
    /// links, so the recorder keeps draining its builders) and the unfinished file, which stays
    /// on disk as `.part` for inspection and is never given its final name.
    pub fn abandon(&mut self) {
        self.block = Block::default();
        self.open = None;
    }

    /// Records appended and not yet written to the file (in the partial block).
    pub fn unwritten(&self) -> usize {
        self.block.events as usize
    }

    /// Records appended and not yet on the disk: in the partial block, or written and not yet
    /// synced.
    pub fn unsynced(&self) -> usize {
        self.unwritten() + self.unsynced
    }

    /// Syncs the data written to the open file (fdatasync): every record written so far is then
    /// on the disk. One call covers every block written since the last (group commit).
    pub fn sync(&mut self, st: &RecorderStats) -> io::Result<()> {
        if self.unsynced == 0 {
            return Ok(());
        }
        if let Some(o) = &self.open {
            let t = Instant::now();
            o.file.sync_data()?;
            st.write_ns
                .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            st.syncs.fetch_add(1, Ordering::Relaxed);
        }
        self.unsynced = 0;
        Ok(())
    }

    /// Writes the partial block, if any (the file stays open).
    pub fn flush(&mut self, st: &RecorderStats) -> io::Result<()> {
        self.flush_block(st)
    }

    /// Writes the last block and closes the file.
    pub fn close(&mut self, st: &RecorderStats) -> io::Result<()> {
        self.flush_block(st)?;
        self.finish_file(st)
    }
}

/// Free bytes for an unprivileged writer on the file system holding `dir`.
pub fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut v: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated path and `v` a writable statvfs.
    if unsafe { libc::statvfs(c.as_ptr(), &mut v) } != 0 {
        return None;
    }
    Some((v.f_bavail as u64).saturating_mul(v.f_frsize as u64))
}

pub use tessera_archive::{file_name, write_atomic};

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: u64) -> ChunkSlice {
        let mut r = vec![0u8; 64];
        r[16..24].copy_from_slice(&id.to_le_bytes());
        ChunkSlice::copy_from(&r)
    }

    /// In sync mode an acknowledgement waits for `unsynced()` to cover a record: it counts the
    /// partial block and every block written since the last sync, and only a sync (or a
    /// finished, synced file) brings it down.
    #[test]
    fn unsynced_counts_written_records_until_a_sync() {
        let dir = tempfile::tempdir().unwrap();
        let mut section = RecorderSection {
            block_size: tessera_config::ByteSize(4096),
            ..Default::default()
        };
        section.disk_hard_free = tessera_config::ByteSize(0);
        section.disk_soft_free = tessera_config::ByteSize(0);
        let mut w = FileWriter::new(FileSettings {
            dir: dir.path().to_path_buf(),
            run_number: 1,
            config_digest: [0; 32],
            pattern: String::new(),
            sources: vec![],
            pattern_sources: vec![],
            section,
        });
        let st = RecorderStats::default();
        for id in 0..3 {
            w.append(record(id), 0, false, &st).unwrap();
        }
        assert_eq!((w.unwritten(), w.unsynced()), (3, 3));
        w.flush(&st).unwrap();
        assert_eq!(
            (w.unwritten(), w.unsynced()),
            (0, 3),
            "written is not synced"
        );
        w.append(record(3), 0, false, &st).unwrap();
        assert_eq!(w.unsynced(), 4);
        w.sync(&st).unwrap();
        assert_eq!(
            (w.unwritten(), w.unsynced()),
            (1, 1),
            "the partial block is not synced"
        );
        assert_eq!(st.syncs.load(Ordering::Relaxed), 1);
        w.close(&st).unwrap();
        assert_eq!(w.unsynced(), 0, "a finished file is synced whole");
        assert_eq!(st.syncs.load(Ordering::Relaxed), 2);
    }
}

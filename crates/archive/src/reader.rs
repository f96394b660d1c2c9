//! Reading a recorded file block by block ([`FileReader`]), and a block's raw bytes event by event
//! ([`events_in`]). Every size is checked against what holds it (docs/file-format.md); a damaged
//! file gives an error, never a panic.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use tessera_format::event::EventRecordHeader;
use tessera_format::file::{
    decode_block, next_is_trailer, BlockHeader, FileError, FileHeader, FileTrailer,
    BLOCK_HEADER_SIZE, FILE_HEADER_SIZE, FILE_TRAILER_SIZE,
};
use tessera_format::link::Fragments;

/// An event read from a file.
pub struct Event<'a> {
    pub header: EventRecordHeader,
    /// The whole record (header and fragments).
    pub bytes: &'a [u8],
}

impl<'a> Event<'a> {
    pub fn body(&self) -> &'a [u8] {
        &self.bytes[self.header.header_size()..]
    }

    pub fn fragments(&self) -> Fragments<'a> {
        Fragments::new(self.body())
    }
}

/// Why a file cannot be read further.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("{0}")]
    Format(#[from] FileError),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("event record at block offset {0}: {1}")]
    Event(usize, String),
}

/// Sequential reader of one file.
pub struct FileReader<R: Read> {
    r: R,
    pub header: FileHeader,
    crc: u32,
    offset: u64,
    stored: Vec<u8>,
    scratch: Vec<u8>,
    raw: Vec<u8>,
    pub trailer: Option<FileTrailer>,
    /// The file CRC computed over the bytes before the trailer, once the trailer is read.
    pub computed_crc: Option<u32>,
}

impl FileReader<BufReader<File>> {
    pub fn open(path: &Path) -> Result<Self, ReadError> {
        Self::new(BufReader::with_capacity(1 << 20, File::open(path)?))
    }
}

impl<R: Read> FileReader<R> {
    pub fn new(mut r: R) -> Result<Self, ReadError> {
        let mut h = [0u8; FILE_HEADER_SIZE];
        r.read_exact(&mut h).map_err(|_| FileError::Truncated)?;
        let header = FileHeader::decode(&h)?;
        Ok(FileReader {
            r,
            header,
            crc: tessera_format::crc::crc32c(&h),
            offset: FILE_HEADER_SIZE as u64,
            stored: Vec::new(),
            scratch: Vec::new(),
            raw: Vec::new(),
            trailer: None,
            computed_crc: None,
        })
    }

    /// Reads the next block into the internal buffer; `Ok(None)` after the trailer.
    pub fn next_block(&mut self) -> Result<Option<(BlockHeader, &[u8])>, ReadError> {
        if self.trailer.is_some() {
            return Ok(None);
        }
        let mut m = [0u8; 4];
        self.r
            .read_exact(&mut m)
            .map_err(|_| FileError::Truncated)?;
        if next_is_trailer(&m) {
            let mut t = [0u8; FILE_TRAILER_SIZE];
            t[..4].copy_from_slice(&m);
            self.r
                .read_exact(&mut t[4..])
                .map_err(|_| FileError::Truncated)?;
            self.trailer = Some(FileTrailer::decode(&t)?);
            self.computed_crc = Some(self.crc);
            return Ok(None);
        }
        let mut hb = [0u8; BLOCK_HEADER_SIZE];
        hb[..4].copy_from_slice(&m);
        self.r
            .read_exact(&mut hb[4..])
            .map_err(|_| FileError::Truncated)?;
        let bh = BlockHeader::decode(&hb, self.offset)?;
        // Read as far as the file goes rather than sized from the header: a corrupt size in a
        // cut file then costs what the file holds, not what the header claims.
        self.stored.clear();
        let want = bh.stored_size as u64;
        let got = (&mut self.r)
            .take(want)
            .read_to_end(&mut self.stored)
            .map_err(|_| FileError::Truncated)?;
        if got as u64 != want {
            return Err(FileError::Truncated.into());
        }
        self.crc = tessera_format::crc::crc32c_append(
            tessera_format::crc::crc32c_append(self.crc, &hb),
            &self.stored,
        );
        self.offset += (BLOCK_HEADER_SIZE + self.stored.len()) as u64;
        decode_block(&bh, &self.stored, &mut self.scratch, &mut self.raw)?;
        Ok(Some((bh, &self.raw)))
    }

    /// Whether anything follows the trailer (a file must end with it). Reads at most one byte.
    pub fn bytes_after_trailer(&mut self) -> bool {
        let mut extra = [0u8; 1];
        self.trailer.is_some() && self.r.read(&mut extra).is_ok_and(|n| n > 0)
    }

    /// The stored (on-disk) bytes of the block [`Self::next_block`] last returned.
    pub fn stored(&self) -> &[u8] {
        &self.stored
    }
}

/// Splits a block's raw bytes into event records.
pub fn events_in(raw: &[u8]) -> impl Iterator<Item = Result<Event<'_>, ReadError>> {
    let mut pos = 0usize;
    std::iter::from_fn(move || {
        if pos >= raw.len() {
            return None;
        }
        let at = pos;
        let r = match EventRecordHeader::decode_prefix(&raw[pos..], raw.len() - pos) {
            Ok(Some((h, n))) => {
                pos += n;
                Ok(Event {
                    header: h,
                    bytes: &raw[at..at + n],
                })
            }
            Ok(None) => Err(ReadError::Event(
                at,
                "record cut by the end of its block".into(),
            )),
            Err(e) => Err(ReadError::Event(at, e.to_string())),
        };
        if r.is_err() {
            pos = raw.len();
        }
        Some(r)
    })
}

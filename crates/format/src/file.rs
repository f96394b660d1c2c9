//! File format v1: a file header, blocks of event records (each block optionally shuffled and
//! compressed), and a trailer with counts and a checksum over everything before it. Specified in
//! `docs/file-format.md`. Pure functions over byte slices; the recorder and the verifier do the I/O.

use crate::bytes::{put_u16, put_u32, put_u64, u16_at, u32_at, u64_at};
use crate::shuffle;

pub const FILE_MAGIC: [u8; 8] = *b"\x89TSR\r\n\x1a\n";
pub const FILE_VERSION: u16 = 1;
pub const FILE_HEADER_SIZE: usize = 80;
pub const BLOCK_MARKER: u32 = 0xEE42_4CEE;
pub const BLOCK_HEADER_SIZE: usize = 32;
pub const TRAILER_MARKER: u32 = 0xEE45_4EEE;
pub const FILE_TRAILER_SIZE: usize = 56;
/// Largest raw block a reader accepts; writers stay far below (the default target is 1 MiB).
pub const MAX_BLOCK_SIZE: usize = 1 << 30;

/// Block compression codec.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Codec {
    #[default]
    None = 0,
    Lz4 = 1,
    Zstd = 2,
}

impl Codec {
    pub fn from_u8(v: u8) -> Option<Codec> {
        match v {
            0 => Some(Codec::None),
            1 => Some(Codec::Lz4),
            2 => Some(Codec::Zstd),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Codec::None => "none",
            Codec::Lz4 => "lz4",
            Codec::Zstd => "zstd",
        }
    }
}

/// Filter applied to a block's raw bytes before compression.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Filter {
    #[default]
    None = 0,
    /// Byte shuffle with 2-byte elements (16-bit ADC samples).
    Shuffle2 = 1,
}

impl Filter {
    pub fn from_u8(v: u8) -> Option<Filter> {
        match v {
            0 => Some(Filter::None),
            1 => Some(Filter::Shuffle2),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Filter::None => "none",
            Filter::Shuffle2 => "shuffle2",
        }
    }
}

/// What a file or block fails.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FileError {
    #[error("not a Tessera file (bad magic)")]
    BadMagic,
    #[error("unsupported file format version {0}")]
    BadVersion(u16),
    #[error("file header checksum mismatch")]
    BadHeaderCrc,
    #[error("bad block header at offset {0}")]
    BadBlock(u64),
    #[error("unknown codec {0} or filter {1}")]
    UnknownCodec(u8, u8),
    #[error("block does not decompress: {0}")]
    Decompress(String),
    #[error("block checksum mismatch")]
    BadBlockCrc,
    #[error("bad trailer")]
    BadTrailer,
    #[error("file shorter than its header says")]
    Truncated,
}

/// The file header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileHeader {
    pub run_number: u64,
    pub file_sequence: u32,
    pub codec: Codec,
    pub filter: Filter,
    /// Nanoseconds since the Unix epoch when the file was opened.
    pub start_time_ns: u64,
    /// SHA-256 of the run's configuration text.
    pub config_digest: [u8; 32],
}

impl FileHeader {
    pub fn encode(&self) -> [u8; FILE_HEADER_SIZE] {
        let mut b = [0u8; FILE_HEADER_SIZE];
        b[..8].copy_from_slice(&FILE_MAGIC);
        put_u16(&mut b, 8, FILE_VERSION);
        put_u16(&mut b, 10, FILE_HEADER_SIZE as u16);
        put_u32(&mut b, 12, 0);
        put_u64(&mut b, 16, self.run_number);
        put_u32(&mut b, 24, self.file_sequence);
        b[28] = self.codec as u8;
        b[29] = self.filter as u8;
        put_u64(&mut b, 32, self.start_time_ns);
        b[40..72].copy_from_slice(&self.config_digest);
        let crc = crate::crc::crc32c(&b[..76]);
        put_u32(&mut b, 76, crc);
        b
    }

    pub fn decode(b: &[u8]) -> Result<FileHeader, FileError> {
        if b.len() < FILE_HEADER_SIZE {
            return Err(FileError::Truncated);
        }
        if b[..8] != FILE_MAGIC {
            return Err(FileError::BadMagic);
        }
        let v = u16_at(b, 8);
        if v != FILE_VERSION {
            return Err(FileError::BadVersion(v));
        }
        if u16_at(b, 10) as usize != FILE_HEADER_SIZE
            || crate::crc::crc32c(&b[..76]) != u32_at(b, 76)
        {
            return Err(FileError::BadHeaderCrc);
        }
        Ok(FileHeader {
            run_number: u64_at(b, 16),
            file_sequence: u32_at(b, 24),
            codec: Codec::from_u8(b[28]).ok_or(FileError::UnknownCodec(b[28], b[29]))?,
            filter: Filter::from_u8(b[29]).ok_or(FileError::UnknownCodec(b[28], b[29]))?,
            start_time_ns: u64_at(b, 32),
            config_digest: b[40..72].try_into().expect("32 bytes"),
        })
    }
}

/// A block header: the block's stored (compressed) bytes follow it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockHeader {
    pub codec: Codec,
    pub filter: Filter,
    pub stored_size: u32,
    pub raw_size: u32,
    pub event_count: u32,
    /// CRC32C of the raw (decompressed, unshuffled) bytes.
    pub raw_crc: u32,
    pub first_event_id: u64,
}

impl BlockHeader {
    pub fn encode(&self) -> [u8; BLOCK_HEADER_SIZE] {
        let mut b = [0u8; BLOCK_HEADER_SIZE];
        put_u32(&mut b, 0, BLOCK_MARKER);
        b[4] = self.codec as u8;
        b[5] = self.filter as u8;
        put_u32(&mut b, 8, self.stored_size);
        put_u32(&mut b, 12, self.raw_size);
        put_u32(&mut b, 16, self.event_count);
        put_u32(&mut b, 20, self.raw_crc);
        put_u64(&mut b, 24, self.first_event_id);
        b
    }

    /// `offset` is only used to name the place in errors.
    pub fn decode(b: &[u8], offset: u64) -> Result<BlockHeader, FileError> {
        if b.len() < BLOCK_HEADER_SIZE || u32_at(b, 0) != BLOCK_MARKER {
            return Err(FileError::BadBlock(offset));
        }
        let h = BlockHeader {
            codec: Codec::from_u8(b[4]).ok_or(FileError::UnknownCodec(b[4], b[5]))?,
            filter: Filter::from_u8(b[5]).ok_or(FileError::UnknownCodec(b[4], b[5]))?,
            stored_size: u32_at(b, 8),
            raw_size: u32_at(b, 12),
            event_count: u32_at(b, 16),
            raw_crc: u32_at(b, 20),
            first_event_id: u64_at(b, 24),
        };
        if h.raw_size as usize > MAX_BLOCK_SIZE || h.stored_size as usize > MAX_BLOCK_SIZE {
            return Err(FileError::BadBlock(offset));
        }
        if h.codec == Codec::None && h.stored_size != h.raw_size {
            return Err(FileError::BadBlock(offset));
        }
        Ok(h)
    }
}

/// Reusable buffers for encoding blocks, so a recorder allocates once.
#[derive(Default)]
pub struct BlockEncoder {
    scratch: Vec<u8>,
    out: Vec<u8>,
    zstd: Option<zstd::bulk::Compressor<'static>>,
}

impl BlockEncoder {
    /// Encodes `raw` (whole event records) as one block; returns header and stored bytes.
    pub fn encode<'a>(
        &'a mut self,
        raw: &'a [u8],
        codec: Codec,
        filter: Filter,
        zstd_level: i32,
        event_count: u32,
        first_event_id: u64,
    ) -> (BlockHeader, &'a [u8]) {
        let raw_crc = crate::crc::crc32c(raw);
        let input: &[u8] = if codec != Codec::None && filter == Filter::Shuffle2 {
            self.scratch.resize(raw.len(), 0);
            shuffle::shuffle(2, raw, &mut self.scratch);
            &self.scratch
        } else {
            raw
        };
        // Shuffle without compression gains nothing, so uncompressed blocks are never shuffled.
        let filter = if codec == Codec::None {
            Filter::None
        } else {
            filter
        };
        let stored: &[u8] = match codec {
            Codec::None => raw,
            Codec::Lz4 => {
                self.out
                    .resize(lz4_flex::block::get_maximum_output_size(input.len()), 0);
                let n = lz4_flex::block::compress_into(input, &mut self.out)
                    .expect("sized by get_maximum_output_size");
                &self.out[..n]
            }
            Codec::Zstd => {
                let c = self.zstd.get_or_insert_with(|| {
                    zstd::bulk::Compressor::new(zstd_level).expect("zstd compressor")
                });
                let _ = c.set_compression_level(zstd_level);
                self.out
                    .resize(zstd::zstd_safe::compress_bound(input.len()), 0);
                let n = c
                    .compress_to_buffer(input, &mut self.out)
                    .expect("sized by compress_bound");
                &self.out[..n]
            }
        };
        let h = BlockHeader {
            codec,
            filter,
            stored_size: stored.len() as u32,
            raw_size: raw.len() as u32,
            event_count,
            raw_crc,
            first_event_id,
        };
        (h, stored)
    }
}

/// Decodes a block's stored bytes into `out` (cleared first) and checks the raw CRC.
pub fn decode_block(
    h: &BlockHeader,
    stored: &[u8],
    scratch: &mut Vec<u8>,
    out: &mut Vec<u8>,
) -> Result<(), FileError> {
    out.clear();
    let raw = h.raw_size as usize;
    // The raw size is checked against what the stored bytes can expand to before it sizes a
    // buffer: a corrupt header must not make a reader allocate a gigabyte.
    let possible = match h.codec {
        Codec::None => stored.len(),
        // An lz4 block expands at most ~255 times (a match length grows by 255 per byte).
        Codec::Lz4 => stored.len().saturating_mul(255).saturating_add(64),
        // A zstd frame states its content size; the frames written here always do.
        Codec::Zstd => match zstd::zstd_safe::get_frame_content_size(stored) {
            Ok(Some(n)) => usize::try_from(n).unwrap_or(usize::MAX),
            _ => {
                return Err(FileError::Decompress(
                    "zstd frame without a content size".into(),
                ))
            }
        },
    };
    if raw > possible {
        return Err(FileError::Decompress(format!(
            "block claims {raw} raw bytes, its {} stored bytes cannot hold them",
            stored.len()
        )));
    }
    let target: &mut Vec<u8> = if h.filter == Filter::Shuffle2 {
        scratch
    } else {
        &mut *out
    };
    target.clear();
    target.resize(raw, 0);
    match h.codec {
        Codec::None => {
            if stored.len() != raw {
                return Err(FileError::Truncated);
            }
            target.copy_from_slice(stored);
        }
        Codec::Lz4 => {
            let n = lz4_flex::block::decompress_into(stored, target)
                .map_err(|e| FileError::Decompress(e.to_string()))?;
            if n != raw {
                return Err(FileError::Decompress(format!(
                    "{n} bytes, header says {raw}"
                )));
            }
        }
        Codec::Zstd => {
            let n = zstd::bulk::decompress_to_buffer(stored, target)
                .map_err(|e| FileError::Decompress(e.to_string()))?;
            if n != raw {
                return Err(FileError::Decompress(format!(
                    "{n} bytes, header says {raw}"
                )));
            }
        }
    }
    if h.filter == Filter::Shuffle2 {
        out.resize(raw, 0);
        shuffle::unshuffle(2, scratch, out);
    }
    if crate::crc::crc32c(out) != h.raw_crc {
        return Err(FileError::BadBlockCrc);
    }
    Ok(())
}

/// The file trailer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FileTrailer {
    pub events: u64,
    pub incomplete_events: u64,
    pub fragments: u64,
    /// Sum of event record sizes (uncompressed).
    pub record_bytes: u64,
    pub blocks: u32,
    /// CRC32C of every byte of the file before the trailer.
    pub file_crc: u32,
}

impl FileTrailer {
    pub fn encode(&self) -> [u8; FILE_TRAILER_SIZE] {
        let mut b = [0u8; FILE_TRAILER_SIZE];
        put_u32(&mut b, 0, TRAILER_MARKER);
        put_u16(&mut b, 4, FILE_VERSION);
        put_u16(&mut b, 6, FILE_TRAILER_SIZE as u16);
        put_u64(&mut b, 8, self.events);
        put_u64(&mut b, 16, self.incomplete_events);
        put_u64(&mut b, 24, self.fragments);
        put_u64(&mut b, 32, self.record_bytes);
        put_u32(&mut b, 40, self.blocks);
        put_u32(&mut b, 44, self.file_crc);
        put_u32(&mut b, 48, 0);
        // The trailer CRC comes last and covers every byte before it, reserved ones included.
        let crc = crate::crc::crc32c(&b[..52]);
        put_u32(&mut b, 52, crc);
        b
    }

    pub fn decode(b: &[u8]) -> Result<FileTrailer, FileError> {
        if b.len() < FILE_TRAILER_SIZE
            || u32_at(b, 0) != TRAILER_MARKER
            || u16_at(b, 4) != FILE_VERSION
            || u16_at(b, 6) as usize != FILE_TRAILER_SIZE
            || crate::crc::crc32c(&b[..52]) != u32_at(b, 52)
        {
            return Err(FileError::BadTrailer);
        }
        Ok(FileTrailer {
            events: u64_at(b, 8),
            incomplete_events: u64_at(b, 16),
            fragments: u64_at(b, 24),
            record_bytes: u64_at(b, 32),
            blocks: u32_at(b, 40),
            file_crc: u32_at(b, 44),
        })
    }
}

/// Whether the four bytes at `b` start a block or the trailer.
pub fn next_is_trailer(b: &[u8]) -> bool {
    b.len() >= 4 && u32_at(b, 0) == TRAILER_MARKER
}

//! Tessera's recorded files as a library of their own: reading them ([`FileReader`],
//! [`events_in`]), the sidecar that describes each finished one ([`FileInfo`]), their names, and
//! the durable write of small files beside them. Shared by the recorder, `tessera verify`, the
//! shipper and the Python package, with nothing of the data path in it (as CBM flesnet's archive
//! library stands apart from its DAQ).

mod reader;
mod sidecar;

pub use reader::{events_in, Event, FileReader, ReadError};
pub use sidecar::{file_name, stream_file_name, stream_of_name, FileInfo};

use std::fs::File;
use std::io::{self, Write};
use std::path::Path;

/// Writes a small file durably under its final name (temporary name, fsync, rename).
pub fn file_write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_atomic(path, bytes, true)
}

/// Writes `bytes` to `path` through a temporary name, so readers never see a partial file.
/// A write that fails (a full disk) leaves no temporary file behind.
pub fn write_atomic(path: &Path, bytes: &[u8], sync: bool) -> io::Result<()> {
    let tmp = path.with_extension("tmp");
    let r = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        if sync {
            f.sync_all()?;
        }
        std::fs::rename(&tmp, path)
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

/// Room held on the output file system for finishing a run: a file of allocated blocks that
/// the recorder gives back when the disk is exhausted (another writer filled it, or the hard
/// watermark was below what was in flight) and when it ends, so that the trailers, sidecars,
/// manifest and run database can still be written on a full disk. Removed when dropped.
#[derive(Debug)]
pub struct DiskReserve {
    path: std::path::PathBuf,
}

/// The reserve's name for a run: hidden, so no listing of data files takes it for one.
pub fn reserve_file_name(run_number: u64) -> String {
    format!(".run{run_number:06}.reserve")
}

/// Whether `name` is a reserve that a run left behind (a crash): `tessera recover` removes it.
pub fn is_reserve_file_name(name: &str) -> bool {
    name.starts_with(".run") && name.ends_with(".reserve")
}

impl DiskReserve {
    /// Allocates `bytes` in `dir` (real blocks: `posix_fallocate`, not a sparse file).
    pub fn take(dir: &Path, run_number: u64, bytes: u64) -> io::Result<DiskReserve> {
        use std::os::fd::AsRawFd;
        let path = dir.join(reserve_file_name(run_number));
        let f = File::create(&path)?;
        let len = libc::off_t::try_from(bytes).map_err(io::Error::other)?;
        // SAFETY: a valid open descriptor and a non-negative length.
        let rc = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, len) };
        if rc != 0 {
            drop(f);
            let _ = std::fs::remove_file(&path);
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(DiskReserve { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for DiskReserve {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Free bytes for an unprivileged writer on the file system holding `dir`.
pub fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: an all-zero statvfs is a valid value of this plain C struct.
    let mut v: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated path and `v` a writable statvfs.
    if unsafe { libc::statvfs(c.as_ptr(), &mut v) } != 0 {
        return None;
    }
    Some((v.f_bavail as u64).saturating_mul(v.f_frsize as u64))
}

/// What an earlier recorder of a run left in its output directory, for a recorder of the same
/// run that starts there (it died, or was restarted) and takes it over: its files, the newest
/// event IDs they hold (oldest first), and their counts.
#[derive(Clone, Debug, Default)]
pub struct AdoptedRun {
    pub files: Vec<FileInfo>,
    pub event_ids: Vec<u64>,
    pub events: u64,
    pub incomplete_events: u64,
    pub fragments_in_complete: u64,
    pub fragments_in_incomplete: u64,
    pub record_bytes: u64,
    pub file_bytes: u64,
}

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
pub fn write_atomic(path: &Path, bytes: &[u8], sync: bool) -> io::Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        if sync {
            f.sync_all()?;
        }
    }
    std::fs::rename(tmp, path)
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

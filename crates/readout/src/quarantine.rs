//! The quarantine dump: every rejected fragment's bytes, for debugging a front-end. Each entry is
//! a text line naming source, reason and length, then the raw bytes, then a newline, so the file
//! reads with `less` and splits with a few lines of script. Writing stops at the size limit;
//! counting never does.

use parking_lot::Mutex;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;

/// Largest number of bytes kept per rejected stretch.
const MAX_EVIDENCE: usize = 64 << 10;

pub struct Quarantine {
    path: PathBuf,
    limit: u64,
    inner: Mutex<Option<(BufWriter<File>, u64)>>,
    failed: std::sync::atomic::AtomicBool,
}

impl Quarantine {
    pub fn new(path: PathBuf, limit: u64) -> Quarantine {
        Quarantine {
            path,
            limit,
            inner: Mutex::new(None),
            failed: Default::default(),
        }
    }

    pub fn dump(&self, source: u32, reason: &str, bytes: &[u8]) {
        use std::sync::atomic::Ordering;
        if self.failed.load(Ordering::Relaxed) {
            return;
        }
        let mut g = self.inner.lock();
        if g.is_none() {
            let opened = self
                .path
                .parent()
                .map_or(Ok(()), std::fs::create_dir_all)
                .and_then(|_| File::create(&self.path));
            match opened {
                Ok(f) => *g = Some((BufWriter::new(f), 0)),
                Err(e) => {
                    tracing::warn!(path = %self.path.display(), error = %e, "cannot open quarantine dump; rejections are still counted");
                    self.failed.store(true, Ordering::Relaxed);
                    return;
                }
            }
        }
        let (w, written) = g.as_mut().expect("opened above");
        let n = bytes.len().min(MAX_EVIDENCE);
        let line = format!(
            "# source={source} reason={reason} bytes={} kept={n}\n",
            bytes.len()
        );
        if *written + (line.len() + n + 1) as u64 > self.limit {
            return;
        }
        let r = w
            .write_all(line.as_bytes())
            .and_then(|_| w.write_all(&bytes[..n]))
            .and_then(|_| w.write_all(b"\n"))
            .and_then(|_| w.flush());
        if r.is_err() {
            self.failed.store(true, Ordering::Relaxed);
        }
        *written += (line.len() + n + 1) as u64;
    }
}

//! The shipper as a service of a long-running process (the run control, or the node agent of the
//! recorder's host): passes on a thread of its own, from configure until the process ends, so
//! that files drain between runs as well as during them. Its [`ShipperStatus`] is what the
//! status line, the dashboard and `/metrics` show.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::{Backlog, Destination, Policy, ShipError, Shipper};

/// The shipper as the run control shows it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ShipperStatus {
    pub destinations: Vec<String>,
    /// Files not yet verified at every destination.
    pub backlog_files: u64,
    pub backlog_bytes: u64,
    /// Age of the oldest of them, in seconds since it was finished.
    pub oldest_s: f64,
    /// Bytes per second verified in the last pass that copied anything.
    pub rate_bytes_per_s: f64,
    /// Time to drain the backlog at that rate, in seconds.
    pub drain_s: Option<f64>,
    /// Since the service started.
    pub copied: u64,
    pub verified: u64,
    pub failed: u64,
    pub deleted: u64,
    pub passes: u64,
    /// The last pass's failure to run at all (the data directory or run database unreadable),
    /// or the last copy that failed, with its reason.
    pub last_error: Option<String>,
}

impl ShipperStatus {
    fn set_backlog(&mut self, b: &Backlog) {
        self.backlog_files = b.files;
        self.backlog_bytes = b.bytes;
        self.oldest_s = b.oldest_s;
        self.rate_bytes_per_s = b.rate_bytes_per_s;
        self.drain_s = b.drain_s;
    }

    /// For the status line: `ship 3 files 1.2 GB (oldest 40 s, ~25 s to drain)`.
    pub fn line(&self) -> String {
        let mut s = format!(
            "ship {} files {:.1} MB",
            self.backlog_files,
            self.backlog_bytes as f64 / 1e6
        );
        if self.backlog_files > 0 {
            s += &format!(" (oldest {:.0} s", self.oldest_s);
            if let Some(d) = self.drain_s {
                s += &format!(", ~{d:.0} s to drain");
            }
            s.push(')');
        }
        if self.failed > 0 {
            s += &format!(" {} failed copies", self.failed);
        }
        s
    }
}

struct Inner {
    status: Mutex<ShipperStatus>,
    stop: AtomicBool,
    /// Raised to make the next pass now (a file was finished, or the process leaves).
    kick: Mutex<bool>,
    woken: Condvar,
}

/// A running shipper. Dropping it stops its thread (a copy under way is made again by the next
/// shipper, from the run database).
pub struct ShipperService {
    dir: PathBuf,
    inner: Arc<Inner>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl ShipperService {
    /// Starts shipping the finished files of `dir` to `destinations`, a pass every `interval`,
    /// its state in the run database `db`.
    pub fn start(
        dir: &Path,
        db: &Path,
        destinations: Vec<Box<dyn Destination>>,
        policy: Policy,
        interval: Duration,
    ) -> Result<ShipperService, ShipError> {
        let names: Vec<String> = destinations.iter().map(|d| d.name()).collect();
        let mut shipper = Shipper::with_db(dir, db, destinations, policy)?;
        let inner = Arc::new(Inner {
            status: Mutex::new(ShipperStatus {
                destinations: names,
                ..ShipperStatus::default()
            }),
            stop: AtomicBool::new(false),
            kick: Mutex::new(true),
            woken: Condvar::new(),
        });
        let i = inner.clone();
        let thread = std::thread::Builder::new()
            .name("shipper".into())
            .spawn(move || {
                while !i.stop.load(Ordering::Relaxed) {
                    {
                        let mut k = i.kick.lock().unwrap_or_else(|e| e.into_inner());
                        let t = Instant::now();
                        while !*k && !i.stop.load(Ordering::Relaxed) && t.elapsed() < interval {
                            k = i
                                .woken
                                .wait_timeout(k, interval.saturating_sub(t.elapsed()))
                                .unwrap_or_else(|e| e.into_inner())
                                .0;
                        }
                        *k = false;
                    }
                    if i.stop.load(Ordering::Relaxed) {
                        break;
                    }
                    // The backlog as the pass begins: a pass against a slow or unreachable
                    // destination may take a while, and the files waiting are news now.
                    if let Ok(b) = shipper.backlog() {
                        i.status
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .set_backlog(&b);
                    }
                    let r = shipper.pass();
                    let mut st = i.status.lock().unwrap_or_else(|e| e.into_inner());
                    st.passes += 1;
                    match r {
                        Ok(p) => {
                            st.copied += p.copied;
                            st.verified += p.verified;
                            st.failed += p.failed;
                            st.deleted += p.deleted;
                            st.set_backlog(&p.backlog);
                            if p.failed > 0 {
                                st.last_error = shipper
                                    .shipments()
                                    .ok()
                                    .and_then(|rows| {
                                        rows.into_iter()
                                            .filter(|r| r.state == "failed")
                                            .max_by_key(|r| r.updated_unix_ns)
                                    })
                                    .map(|r| {
                                        format!(
                                            "{} to {}: {}",
                                            r.file,
                                            r.destination,
                                            r.error.unwrap_or_default()
                                        )
                                    });
                            }
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "shipper pass failed");
                            st.last_error = Some(e.to_string());
                        }
                    }
                }
            })
            .map_err(|e| ShipError::Dir(dir.to_path_buf(), e))?;
        Ok(ShipperService {
            dir: dir.to_path_buf(),
            inner,
            thread: Mutex::new(Some(thread)),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn status(&self) -> ShipperStatus {
        self.inner
            .status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// A pass now rather than at the next interval.
    pub fn kick(&self) {
        *self.inner.kick.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.inner.woken.notify_all();
    }

    /// Waits until the backlog is empty (after a pass that started after this call), `limit`
    /// passes, or `progress` (shown each status in between) says to give up; whether it
    /// drained.
    pub fn drain(&self, limit: Duration, mut progress: impl FnMut(&ShipperStatus) -> bool) -> bool {
        let t = Instant::now();
        let start = self.status().passes;
        self.kick();
        loop {
            let st = self.status();
            // A pass that was under way at the call may have listed the directory before the
            // last file was finished: only one begun after it counts.
            if st.passes >= start + 2 && st.backlog_files == 0 {
                return true;
            }
            if t.elapsed() >= limit || !progress(&st) {
                return false;
            }
            // Between passes the backlog cannot change: a short wait for the next one.
            std::thread::sleep(Duration::from_millis(100));
            if self.status().passes == st.passes {
                continue;
            }
            self.kick();
        }
    }

    /// Stops the thread after the pass under way.
    pub fn stop(&self) {
        self.inner.stop.store(true, Ordering::Relaxed);
        self.inner.woken.notify_all();
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for ShipperService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShipperService")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl Drop for ShipperService {
    fn drop(&mut self) {
        self.stop();
    }
}

//! The shipper, the second half of role 6 (the COMET "bucket brigade", ATLAS's SFO transfer,
//! MIDAS's lazylogger): it picks up every finished file in the data directory (one with its
//! sidecar, never a `.part`), copies it to each destination, verifies each copy by reading it
//! back (size and CRC-32C of every byte), retries with backoff, and deletes the local file only
//! once every destination holds a verified copy and the retention policy allows: the file is
//! older than `keep`, or the disk is short of space (then verified files go first, oldest first,
//! and an unverified one never).
//!
//! What was copied, verified and deleted lives in the run database (`shipments`,
//! `deleted_files`), so a shipper that is killed picks up where it stopped: a copy that was
//! under way is made again, from the start, under a temporary name, and a destination holds each
//! file exactly once, under its final name only when whole.

mod dir;
mod s3;
mod service;
mod ssh;
mod verify;

pub use dir::DirDestination;
pub use s3::{S3Destination, S3Target};
pub use service::{ShipperService, ShipperStatus};
pub use ssh::{SshDestination, SshTarget};
pub use verify::{verify_destination, CopyCheck, DestinationReport};

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tessera_rundb::{RunDb, ShipmentRow};

#[derive(Debug, thiserror::Error)]
pub enum ShipError {
    #[error(transparent)]
    Db(#[from] tessera_rundb::DbError),
    #[error("data directory {0}: {1}")]
    Dir(PathBuf, io::Error),
}

/// Where copies go. A copy is written under a temporary name and takes its final name only
/// when whole; [`Destination::check`] reads back what the destination holds under the final
/// name.
pub trait Destination: Send + Sync {
    /// As configured and as recorded in the run database (`/mnt/archive`, `s3://bucket/prefix`).
    fn name(&self) -> String;
    /// Copies `size` bytes, read through `read` (which paces and checksums them), to the
    /// destination under `file`.
    fn put(&self, file: &str, size: u64, read: &mut dyn Read) -> io::Result<()>;
    /// Reads back every byte the destination holds under `file`: its [`Digest`]; `None` if
    /// nothing.
    fn check(&self, file: &str) -> io::Result<Option<Digest>>;
}

/// What the shipper may do with local files.
#[derive(Clone, Debug)]
pub struct Policy {
    /// Keep a shipped file at least this long after it was finished (0: delete once shipped).
    pub keep: Duration,
    /// Below this many free bytes on the data directory's file system, verified files are
    /// deleted, oldest first, whatever `keep` says, until the space is back.
    pub free_watermark: u64,
    /// Bytes per second all copies together may read (0: no limit), so that shipping does not
    /// starve the recorder of the disk.
    pub bandwidth: u64,
    /// First retry after a failed copy; doubled per attempt up to `retry_max`.
    pub retry_min: Duration,
    pub retry_max: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            keep: Duration::ZERO,
            free_watermark: 0,
            bandwidth: 0,
            retry_min: Duration::from_secs(1),
            retry_max: Duration::from_secs(300),
        }
    }
}

/// Files not yet safe at every destination, as the status line, the dashboard and /metrics
/// show them.
#[derive(Clone, Debug, Default, serde::Serialize, PartialEq)]
pub struct Backlog {
    pub files: u64,
    pub bytes: u64,
    /// Age of the oldest file still to ship, in seconds (since it was finished).
    pub oldest_s: f64,
    /// Bytes per second verified in the last pass that copied anything.
    pub rate_bytes_per_s: f64,
    /// `bytes / rate`, if there is a rate.
    pub drain_s: Option<f64>,
}

/// What one pass did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Pass {
    pub copied: u64,
    pub verified: u64,
    pub failed: u64,
    pub deleted: u64,
    pub backlog: Backlog,
}

/// One pass at a time over a data directory; [`ShipperService`] runs passes on a thread.
pub struct Shipper {
    dir: PathBuf,
    destinations: Vec<Box<dyn Destination>>,
    policy: Policy,
    db: RunDb,
    last_rate: f64,
}

/// A finished file in the data directory.
struct Local {
    name: String,
    size: u64,
    /// When its sidecar was written: the file was finished then.
    finished: SystemTime,
}

fn unix_ns(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

impl Shipper {
    /// A shipper for the finished files of `dir`, keeping its state in `dir/runs.sqlite`.
    pub fn new(
        dir: &Path,
        destinations: Vec<Box<dyn Destination>>,
        policy: Policy,
    ) -> Result<Shipper, ShipError> {
        Self::with_db(dir, &dir.join("runs.sqlite"), destinations, policy)
    }

    /// The same, keeping its state in the run database at `db` (`control.database`).
    pub fn with_db(
        dir: &Path,
        db: &Path,
        destinations: Vec<Box<dyn Destination>>,
        policy: Policy,
    ) -> Result<Shipper, ShipError> {
        let db = RunDb::open(db)?;
        Ok(Shipper {
            dir: dir.to_path_buf(),
            destinations,
            policy,
            db,
            last_rate: 0.0,
        })
    }

    /// One pass: copies and verifies what is due, then deletes what the policy allows.
    pub fn pass(&mut self) -> Result<Pass, ShipError> {
        let now = SystemTime::now();
        let mut pass = Pass::default();
        let rows: BTreeMap<(String, String), ShipmentRow> = self
            .db
            .shipments()?
            .into_iter()
            .map(|r| ((r.file.clone(), r.destination.clone()), r))
            .collect();
        let files = finished(&self.dir)?;
        let (mut moved, t0) = (0u64, Instant::now());
        // A destination that failed a copy in this pass is not tried again until the next: a
        // store that is down would otherwise cost a timeout per file.
        let mut down: Vec<String> = Vec::new();
        for f in &files {
            for d in &self.destinations {
                let key = (f.name.clone(), d.name());
                if down.contains(&key.1) {
                    continue;
                }
                let row = rows.get(&key);
                if row.is_some_and(|r| r.state == "verified")
                    || row.is_some_and(|r| r.next_try_unix_ns > unix_ns(now))
                {
                    continue;
                }
                let attempts = row.map_or(0, |r| r.attempts) + 1;
                let mut r = ShipmentRow {
                    file: f.name.clone(),
                    destination: d.name(),
                    size_bytes: f.size,
                    crc32c: String::new(),
                    state: "copying".into(),
                    attempts,
                    error: None,
                    next_try_unix_ns: 0,
                    updated_unix_ns: unix_ns(SystemTime::now()),
                };
                // Recorded before the copy: a shipper killed during it finds the copy due again.
                self.db.set_shipment(&r)?;
                match self.copy(d.as_ref(), f) {
                    Ok(crc) => {
                        pass.copied += 1;
                        r.crc32c = format!("{crc:08x}");
                        match d.check(&f.name) {
                            Ok(Some(got)) if got.size == f.size && got.crc32c == crc => {
                                // The sidecar goes with it, so the copy can be verified where
                                // it lies (`tessera verify`).
                                let side = self.dir.join(format!("{}.json", f.name));
                                match std::fs::File::open(&side).and_then(|mut s| {
                                    let len = s.metadata()?.len();
                                    d.put(&format!("{}.json", f.name), len, &mut s)
                                }) {
                                    Ok(()) => {
                                        r.state = "verified".into();
                                        pass.verified += 1;
                                        moved += f.size;
                                    }
                                    Err(e) => {
                                        r.state = "failed".into();
                                        r.error = Some(format!("copying the sidecar: {e}"));
                                    }
                                }
                            }
                            Ok(other) => {
                                r.state = "failed".into();
                                r.error = Some(match other {
                                    None => "the copy is not at the destination".into(),
                                    Some(got) => format!(
                                        "the copy reads back as {} bytes, CRC-32C {:08x}; the file is {} bytes, {crc:08x}",
                                        got.size, got.crc32c, f.size
                                    ),
                                });
                            }
                            Err(e) => {
                                r.state = "failed".into();
                                r.error = Some(format!("reading the copy back: {e}"));
                            }
                        }
                    }
                    Err(e) => {
                        if e.kind() != io::ErrorKind::InvalidData {
                            down.push(d.name());
                        }
                        r.state = "failed".into();
                        r.error = Some(e.to_string());
                    }
                }
                if r.state == "failed" {
                    pass.failed += 1;
                    let backoff = self
                        .policy
                        .retry_min
                        .saturating_mul(1 << (attempts - 1).min(20))
                        .min(self.policy.retry_max);
                    r.next_try_unix_ns = unix_ns(SystemTime::now() + backoff);
                    tracing::warn!(file = %f.name, destination = %d.name(), attempts, error = r.error.as_deref().unwrap_or(""), "shipping failed; retrying later");
                } else {
                    tracing::info!(file = %f.name, destination = %d.name(), "shipped and verified");
                }
                r.updated_unix_ns = unix_ns(SystemTime::now());
                self.db.set_shipment(&r)?;
            }
        }
        self.sync_manifests()?;
        if moved > 0 {
            self.last_rate = moved as f64 / t0.elapsed().as_secs_f64().max(1e-9);
        } else if pass.failed > 0 {
            // Every copy of this pass failed: an earlier pass's rate says nothing of when the
            // backlog drains (the status line said "drains in ~1 s" while nothing moved).
            self.last_rate = 0.0;
        }
        pass.deleted = self.retire(&files)?;
        pass.backlog = self.backlog()?;
        Ok(pass)
    }

    /// Copies `f` to `d` at the allowed bandwidth; the CRC-32C of every byte read. The bytes
    /// read must be the file the recorder closed (its size and the file CRC its sidecar
    /// records): a file damaged on the local disk is refused, never spread to the archive
    /// and never deleted.
    fn copy(&self, d: &dyn Destination, f: &Local) -> io::Result<u32> {
        let file = std::fs::File::open(self.dir.join(&f.name))?;
        let mut r = Paced {
            inner: file,
            digest: Digester::default(),
            bytes: 0,
            rate: self.policy.bandwidth,
            t0: Instant::now(),
        };
        d.put(&f.name, f.size, &mut r)?;
        if r.bytes != f.size {
            return Err(io::Error::other(format!(
                "read {} bytes of a {}-byte file",
                r.bytes, f.size
            )));
        }
        let got = r.digest.finish();
        if let Some(info) = sidecar(&self.dir, &f.name) {
            got.matches_recorded(info.size_bytes, &info.file_crc32c)
                .map_err(|e| {
                    io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("the local file is not what was recorded ({e}); not verified"),
                    )
                })?;
        }
        Ok(got.crc32c)
    }

    /// Brings each run's manifest (`runNNNNNN.manifest.json` beside the files) up to date with
    /// the run database: every file's entry lists the destinations that hold a verified copy.
    /// Once every file of a run is verified at a destination, the manifest goes there too (and
    /// is recorded as shipped, like a file), so the archive describes itself. A run still going
    /// has no manifest yet; it is brought up to date when it has one.
    fn sync_manifests(&self) -> Result<(), ShipError> {
        let rows = self.db.shipments()?;
        let verified = |file: &str, dn: &str| {
            rows.iter()
                .find(|r| r.file == file && r.destination == dn && r.state == "verified")
        };
        let err = |e| ShipError::Dir(self.dir.to_path_buf(), e);
        let mut names: Vec<String> = std::fs::read_dir(&self.dir)
            .map_err(err)?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("run") && n.ends_with(".manifest.json"))
            .collect();
        names.sort();
        for name in names {
            let dests: Vec<&dyn Destination> = self
                .destinations
                .iter()
                .map(|d| d.as_ref())
                .filter(|d| verified(&name, &d.name()).is_none())
                .collect();
            if dests.is_empty() {
                continue;
            }
            let path = self.dir.join(&name);
            let Ok(bytes) = std::fs::read(&path) else {
                continue;
            };
            let Ok(mut m) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
                tracing::warn!(manifest = %name, "not JSON; left alone");
                continue;
            };
            let Some(files) = m
                .pointer_mut("/recorder/files")
                .and_then(|v| v.as_array_mut())
            else {
                continue;
            };
            let mut complete: Vec<bool> = vec![true; dests.len()];
            for e in files.iter_mut() {
                let Some(file) = e["file"].as_str().map(String::from) else {
                    continue;
                };
                let list: Vec<serde_json::Value> = self
                    .destinations
                    .iter()
                    .filter_map(|d| {
                        let dn = d.name();
                        verified(&file, &dn).map(|r| {
                            serde_json::json!({
                                "destination": dn,
                                "crc32c": r.crc32c,
                                "verified_unix_ns": r.updated_unix_ns,
                            })
                        })
                    })
                    .collect();
                for (i, d) in dests.iter().enumerate() {
                    complete[i] &= verified(&file, &d.name()).is_some();
                }
                if let Some(o) = e.as_object_mut() {
                    o.insert("destinations".into(), list.into());
                }
            }
            let out = serde_json::to_vec_pretty(&m).map_err(|e| err(io::Error::other(e)))?;
            if out != bytes {
                tessera_archive::file_write_atomic(&path, &out).map_err(err)?;
            }
            for (d, whole) in dests.iter().zip(complete) {
                if !whole {
                    continue;
                }
                let (size, crc) = (out.len() as u64, tessera_format::crc::crc32c(&out));
                let mut r = ShipmentRow {
                    file: name.clone(),
                    destination: d.name(),
                    size_bytes: size,
                    crc32c: format!("{crc:08x}"),
                    state: "verified".into(),
                    attempts: 1,
                    error: None,
                    next_try_unix_ns: 0,
                    updated_unix_ns: unix_ns(SystemTime::now()),
                };
                match d
                    .put(&name, size, &mut out.as_slice())
                    .and_then(|()| d.check(&name))
                {
                    Ok(Some(got)) if got.size == size && got.crc32c == crc => {}
                    Ok(_) => continue,
                    Err(e) => {
                        tracing::warn!(manifest = %name, destination = %d.name(), error = %e, "manifest not shipped; next pass");
                        r.state = "failed".into();
                        r.error = Some(e.to_string());
                    }
                }
                self.db.set_shipment(&r)?;
            }
        }
        Ok(())
    }

    /// Deletes verified files the policy lets go: past `keep`, or (oldest first) while the
    /// disk is below its watermark. Never a file some destination has not verified.
    fn retire(&self, files: &[Local]) -> Result<u64, ShipError> {
        let rows = self.db.shipments()?;
        let safe = |name: &str| {
            !self.destinations.is_empty()
                && self.destinations.iter().all(|d| {
                    let dn = d.name();
                    rows.iter()
                        .any(|r| r.file == name && r.destination == dn && r.state == "verified")
                })
        };
        let now = SystemTime::now();
        let mut deleted = 0;
        for f in files {
            if !safe(&f.name) {
                continue;
            }
            let old = now
                .duration_since(f.finished)
                .is_ok_and(|age| age >= self.policy.keep);
            let short = self.policy.free_watermark > 0
                && free_bytes(&self.dir).is_some_and(|free| free < self.policy.free_watermark);
            if !(old || short) {
                continue;
            }
            let reason = if old { "retention" } else { "free space" };
            let path = self.dir.join(&f.name);
            std::fs::remove_file(&path).map_err(|e| ShipError::Dir(path.clone(), e))?;
            let _ = std::fs::remove_file(self.dir.join(format!("{}.json", f.name)));
            self.db.mark_deleted(&f.name, unix_ns(now), reason)?;
            tracing::info!(file = %f.name, reason, "local copy deleted: every destination holds a verified copy");
            deleted += 1;
        }
        Ok(deleted)
    }

    /// Files in the data directory not yet verified at every destination.
    pub fn backlog(&self) -> Result<Backlog, ShipError> {
        let names: Vec<String> = self.destinations.iter().map(|d| d.name()).collect();
        let mut b = backlog(&self.dir, &self.db, &names)?;
        b.rate_bytes_per_s = self.last_rate;
        b.drain_s = (b.rate_bytes_per_s > 0.0).then(|| b.bytes as f64 / b.rate_bytes_per_s);
        Ok(b)
    }

    /// The run database's rows, for `tessera ship status`.
    pub fn shipments(&self) -> Result<Vec<ShipmentRow>, ShipError> {
        Ok(self.db.shipments()?)
    }
}

/// The files of `dir` not yet verified at every one of `destinations`, from the run database
/// there (no rate: that is the running shipper's).
pub fn backlog(dir: &Path, db: &RunDb, destinations: &[String]) -> Result<Backlog, ShipError> {
    let rows = db.shipments()?;
    let now = SystemTime::now();
    let mut b = Backlog::default();
    for f in finished(dir)? {
        let done = !destinations.is_empty()
            && destinations.iter().all(|dn| {
                rows.iter()
                    .any(|r| r.file == f.name && &r.destination == dn && r.state == "verified")
            });
        if done {
            continue;
        }
        b.files += 1;
        b.bytes += f.size;
        let age = now
            .duration_since(f.finished)
            .map_or(0.0, |d| d.as_secs_f64());
        b.oldest_s = b.oldest_s.max(age);
    }
    Ok(b)
}

/// The sidecar of `file`, if it is a recorder's (a file put there by hand may have none).
fn sidecar(dir: &Path, file: &str) -> Option<tessera_archive::FileInfo> {
    let b = std::fs::read(dir.join(format!("{file}.json"))).ok()?;
    serde_json::from_slice(&b).ok()
}

/// Finished files of `dir` (a `.tsr` with its sidecar), oldest first. A `.part` is never taken.
fn finished(dir: &Path) -> Result<Vec<Local>, ShipError> {
    let err = |e| ShipError::Dir(dir.to_path_buf(), e);
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).map_err(err)? {
        let e = e.map_err(err)?;
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.ends_with(".tsr") {
            continue;
        }
        let Ok(side) = std::fs::metadata(dir.join(format!("{name}.json"))) else {
            continue;
        };
        let size = e.metadata().map_err(err)?.len();
        out.push(Local {
            name,
            size,
            finished: side.modified().unwrap_or(UNIX_EPOCH),
        });
    }
    out.sort_by(|a, b| (a.finished, &a.name).cmp(&(b.finished, &b.name)));
    Ok(out)
}

/// Reads a local file for a copy: paced to the bandwidth limit, checksummed as it goes.
struct Paced {
    inner: std::fs::File,
    digest: Digester,
    bytes: u64,
    rate: u64,
    t0: Instant,
}

impl Read for Paced {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.rate > 0 {
            let due = Duration::from_secs_f64(self.bytes as f64 / self.rate as f64);
            if let Some(wait) = due.checked_sub(self.t0.elapsed()) {
                std::thread::sleep(wait);
            }
        }
        let n = self.inner.read(buf)?;
        self.digest.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}

pub use tessera_archive::free_bytes;

/// A destination from its address: `s3://bucket/prefix` (endpoint and keys from the usual AWS
/// environment variables), `ssh://[user@]host[:port]/path` (OpenSSH; `TESSERA_SSH` for its
/// options), or a directory.
pub fn destination(to: &str) -> io::Result<Box<dyn Destination>> {
    if to.starts_with("ssh://") {
        let t = SshTarget::from_url_and_env(to).map_err(io::Error::other)?;
        Ok(Box::new(SshDestination::new(t)))
    } else if to.starts_with("s3://") {
        let t = S3Target::from_url_and_env(to).map_err(io::Error::other)?;
        Ok(Box::new(S3Destination::new(t)?))
    } else {
        Ok(Box::new(DirDestination::new(to)))
    }
}

/// What a copy (or a local file) holds, from one read of every byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Digest {
    pub size: u64,
    /// CRC-32C of every byte.
    pub crc32c: u32,
    /// CRC-32C of every byte before the last [`FILE_TRAILER_SIZE`]: for a Tessera file, what its
    /// trailer's file CRC (and the run database's `crc32c`) covers.
    pub body_crc32c: u32,
    /// The last [`FILE_TRAILER_SIZE`] bytes (fewer in a shorter file): a Tessera file's trailer.
    pub tail: [u8; FILE_TRAILER_SIZE],
    pub tail_len: usize,
}

use tessera_format::file::FILE_TRAILER_SIZE;

impl Digest {
    /// Whether this is the whole Tessera file the recorder closed: `size` bytes whose body has
    /// the recorded file CRC and whose trailer is intact and says so. An error says what
    /// differs.
    pub fn matches_recorded(&self, size: u64, file_crc32c: &str) -> Result<(), String> {
        let want = u32::from_str_radix(file_crc32c, 16)
            .map_err(|_| format!("the recorded file CRC {file_crc32c:?} is not 8 hex digits"))?;
        if self.size != size {
            return Err(format!("{} bytes where {size} were recorded", self.size));
        }
        if self.body_crc32c != want {
            return Err(format!(
                "file CRC-32C {:08x} where {want:08x} was recorded",
                self.body_crc32c
            ));
        }
        match tessera_format::file::FileTrailer::decode(&self.tail[..self.tail_len]) {
            Ok(t) if t.file_crc == want => Ok(()),
            Ok(t) => Err(format!(
                "the trailer says file CRC {:08x}, the run database {want:08x}",
                t.file_crc
            )),
            Err(e) => Err(format!("the trailer is damaged: {e}")),
        }
    }
}

/// Builds a [`Digest`] from chunks: the last trailer-size bytes are held back until more come,
/// so the body CRC is known without knowing the size first.
#[derive(Default)]
pub struct Digester {
    size: u64,
    body: u32,
    held: Vec<u8>,
}

impl Digester {
    pub fn update(&mut self, chunk: &[u8]) {
        self.size += chunk.len() as u64;
        if chunk.len() >= FILE_TRAILER_SIZE {
            // Everything held and all but the chunk's tail go into the body at once: the bytes
            // are checksummed where they lie, not copied first.
            let (body, tail) = chunk.split_at(chunk.len() - FILE_TRAILER_SIZE);
            self.body = tessera_format::crc::crc32c_append(self.body, &self.held);
            self.body = tessera_format::crc::crc32c_append(self.body, body);
            self.held.clear();
            self.held.extend_from_slice(tail);
            return;
        }
        self.held.extend_from_slice(chunk);
        if self.held.len() > FILE_TRAILER_SIZE {
            let out = self.held.len() - FILE_TRAILER_SIZE;
            self.body = tessera_format::crc::crc32c_append(self.body, &self.held[..out]);
            self.held.drain(..out);
        }
    }

    pub fn finish(self) -> Digest {
        let mut tail = [0u8; FILE_TRAILER_SIZE];
        tail[..self.held.len()].copy_from_slice(&self.held);
        Digest {
            size: self.size,
            crc32c: tessera_format::crc::crc32c_append(self.body, &self.held),
            body_crc32c: self.body,
            tail,
            tail_len: self.held.len(),
        }
    }
}

/// The [`Digest`] of everything `r` gives.
pub fn digest_of(mut r: impl Read) -> io::Result<Digest> {
    let mut buf = vec![0u8; 1 << 20];
    let mut d = Digester::default();
    loop {
        let k = r.read(&mut buf)?;
        if k == 0 {
            return Ok(d.finish());
        }
        d.update(&buf[..k]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// However the bytes arrive, the digest is the same: the body CRC over all but the last
    /// trailer-size bytes, the tail those bytes, the whole CRC over everything.
    #[test]
    fn a_digest_does_not_depend_on_how_the_bytes_are_cut() {
        let data: Vec<u8> = (0..5000u32).map(|i| (i * 29 % 251) as u8).collect();
        for n in [0usize, 10, 56, 57, 1000, 5000] {
            let d = &data[..n];
            let keep = n.min(FILE_TRAILER_SIZE);
            for step in [1usize, 7, 55, 56, 57, 300, 5000] {
                let mut g = Digester::default();
                for c in d.chunks(step) {
                    g.update(c);
                }
                let got = g.finish();
                assert_eq!(got.size, n as u64);
                assert_eq!(got.crc32c, tessera_format::crc::crc32c(d), "{n} by {step}");
                assert_eq!(
                    got.body_crc32c,
                    tessera_format::crc::crc32c(&d[..n - keep]),
                    "{n} by {step}"
                );
                assert_eq!(&got.tail[..got.tail_len], &d[n - keep..], "{n} by {step}");
            }
        }
    }
}

//! The run database: one SQLite file in the data directory that keeps, for every run, its number
//! (allocated here at start, so that two runs never share one), the full configuration, start
//! and stop times, what it counted, the files it wrote with their checksums, the operator's
//! comment, and every state-changing action with who asked for it.
//!
//! SQLite because a run database is small, written a few times per run and read by people and
//! scripts: one file, no server, readable with `sqlite3` when Tessera is not at hand. The schema
//! is versioned by `PRAGMA user_version`.

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

/// The schema this code writes and reads.
pub const SCHEMA_VERSION: i64 = 4;

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("run database {path}: {source}")]
    Sqlite {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error(
        "run database {path}: schema version {found}, this tessera reads version {SCHEMA_VERSION}"
    )]
    Schema { path: PathBuf, found: i64 },
    #[error("run database: no run {0}")]
    NoRun(u64),
    /// A comment longer than [`MAX_COMMENT`].
    #[error("comment of {0} bytes: at most {MAX_COMMENT}")]
    CommentTooLong(usize),
    #[error("run {0} has {MAX_NOTES} notes already: no more are kept")]
    TooManyNotes(u64),
}

/// Longest comment kept on a run, in bytes: comments go into the database and into one log line.
pub const MAX_COMMENT: usize = 4096;

fn check_comment(c: &str) -> Result<(), DbError> {
    if c.len() > MAX_COMMENT {
        Err(DbError::CommentTooLong(c.len()))
    } else {
        Ok(())
    }
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS runs (
    number          INTEGER PRIMARY KEY,
    state           TEXT NOT NULL,          -- running, stopped, error
    config_origin   TEXT NOT NULL,
    config_sha256   TEXT NOT NULL,
    config          TEXT NOT NULL,          -- the full topology, TOML
    started_unix_ns INTEGER NOT NULL,
    stopped_unix_ns INTEGER,
    stop_reason     TEXT,
    error           TEXT,
    comment         TEXT NOT NULL DEFAULT '',
    events          INTEGER NOT NULL DEFAULT 0,
    incomplete      INTEGER NOT NULL DEFAULT 0,
    bytes           INTEGER NOT NULL DEFAULT 0,
    recorded_events INTEGER NOT NULL DEFAULT 0,
    balance_holds   INTEGER,
    report          TEXT                    -- the run report, JSON, as the manifest
);
CREATE TABLE IF NOT EXISTS rejected (
    run     INTEGER NOT NULL REFERENCES runs(number),
    reason  TEXT NOT NULL,
    count   INTEGER NOT NULL,
    PRIMARY KEY (run, reason)
);
CREATE TABLE IF NOT EXISTS files (
    run         INTEGER NOT NULL REFERENCES runs(number),
    name        TEXT NOT NULL,
    size_bytes  INTEGER NOT NULL,
    events      INTEGER NOT NULL,
    crc32c      TEXT NOT NULL,
    PRIMARY KEY (run, name)
);
CREATE TABLE IF NOT EXISTS actions (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    unix_ns     INTEGER NOT NULL,
    who         TEXT NOT NULL,
    action      TEXT NOT NULL,
    from_state  TEXT NOT NULL,
    to_state    TEXT NOT NULL,
    result      TEXT NOT NULL,          -- ok, or why it was refused
    run         INTEGER
);
CREATE TABLE IF NOT EXISTS log (
    run         INTEGER NOT NULL REFERENCES runs(number),
    unix_ns     INTEGER NOT NULL,
    host        TEXT NOT NULL,
    role        TEXT NOT NULL,
    level       TEXT NOT NULL,          -- ERROR, WARN, INFO
    message     TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS log_by_run ON log (run);
-- Schema 3: the shipper's word on every finished file and destination.
CREATE TABLE IF NOT EXISTS shipments (
    file            TEXT NOT NULL,          -- name in the data directory
    destination     TEXT NOT NULL,          -- as configured: a directory, s3://..., ssh://...
    size_bytes      INTEGER NOT NULL,
    crc32c          TEXT NOT NULL,          -- of the whole file, 8 hex digits
    state           TEXT NOT NULL,          -- copying, verified, failed
    attempts        INTEGER NOT NULL,
    error           TEXT,
    next_try_unix_ns INTEGER NOT NULL,
    updated_unix_ns INTEGER NOT NULL,
    PRIMARY KEY (file, destination)
);
CREATE TABLE IF NOT EXISTS deleted_files (
    file            TEXT PRIMARY KEY,
    unix_ns         INTEGER NOT NULL,
    reason          TEXT NOT NULL           -- retention, or free space
);
-- Schema 4: the run's notes (an Elog in small), what operators did to alarms, and the headline
-- series of every run at a bounded resolution.
CREATE TABLE IF NOT EXISTS notes (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    run         INTEGER NOT NULL REFERENCES runs(number),
    unix_ns     INTEGER NOT NULL,
    who         TEXT NOT NULL,
    kind        TEXT NOT NULL,          -- start, stop, note
    text        TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS notes_by_run ON notes (run);
CREATE TABLE IF NOT EXISTS alarm_actions (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    unix_ns         INTEGER NOT NULL,
    who             TEXT NOT NULL,
    action          TEXT NOT NULL,      -- acknowledge, silence, unsilence
    alarm           TEXT NOT NULL,
    subject         TEXT NOT NULL,
    until_unix_ns   INTEGER,            -- silence: until when
    run             INTEGER
);
CREATE TABLE IF NOT EXISTS faults (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    run             INTEGER,
    unix_ns         INTEGER NOT NULL,
    who             TEXT NOT NULL,
    fault           TEXT NOT NULL,      -- what was asked, JSON
    until_unix_ns   INTEGER NOT NULL,
    result          TEXT NOT NULL       -- what it did, or why it was refused
);
CREATE TABLE IF NOT EXISTS history (
    run                 INTEGER NOT NULL,
    unix_ns             INTEGER NOT NULL,   -- start of the span the point stands for
    span_s              REAL NOT NULL,      -- 1, then coarser as points age
    events_per_s        REAL NOT NULL,
    built_bytes_per_s   REAL NOT NULL,
    recorded_bytes_per_s REAL NOT NULL,
    incomplete_per_s    REAL NOT NULL,
    rejected_per_s      REAL NOT NULL,
    dead_time_fraction  REAL NOT NULL,
    buffer_fraction     REAL NOT NULL,      -- the fullest buffer's occupancy
    PRIMARY KEY (run, unix_ns)
);
";

/// The shipper's state of one file at one destination.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct ShipmentRow {
    pub file: String,
    pub destination: String,
    pub size_bytes: u64,
    pub crc32c: String,
    /// `copying`, `verified` or `failed`.
    pub state: String,
    pub attempts: u32,
    pub error: Option<String>,
    pub next_try_unix_ns: u64,
    pub updated_unix_ns: u64,
}

/// Lines of a run's message log kept in the database (at most this many per run).
pub const MAX_LOG_LINES: usize = 10_000;

/// One line of a run's message log.
#[derive(Clone, Debug, Serialize)]
pub struct LogRow {
    pub unix_ns: u64,
    pub host: String,
    pub role: String,
    pub level: String,
    pub message: String,
}

/// One entry of a run's notes: the comment it was started or stopped with, or a note an
/// operator added while or after it ran.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct NoteRow {
    pub unix_ns: u64,
    pub who: String,
    /// `start`, `stop` or `note`.
    pub kind: String,
    pub text: String,
}

/// What an operator did to an alarm.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct AlarmActionRow {
    pub unix_ns: u64,
    pub who: String,
    /// `acknowledge`, `silence` or `unsilence`.
    pub action: String,
    pub alarm: String,
    pub subject: String,
    /// A silence: until when.
    pub until_unix_ns: Option<u64>,
    pub run: Option<u64>,
}

/// An operator's fault rehearsal, done or refused.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct FaultRow {
    pub run: Option<u64>,
    pub unix_ns: u64,
    pub who: String,
    /// What was asked (JSON of `tessera_run::fault::Fault`).
    pub fault: String,
    pub until_unix_ns: u64,
    /// `ok: ...` with what it did, or why it was refused.
    pub result: String,
}

/// One point of a run's headline series, standing for `span_s` seconds from `unix_ns`.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct HistoryPoint {
    pub run: u64,
    pub unix_ns: u64,
    pub span_s: f64,
    pub events_per_s: f64,
    pub built_bytes_per_s: f64,
    pub recorded_bytes_per_s: f64,
    pub incomplete_per_s: f64,
    pub rejected_per_s: f64,
    pub dead_time_fraction: f64,
    /// The fullest buffer's occupancy (the largest over the span).
    pub buffer_fraction: f64,
}

/// How the history is kept: points younger than the first age at their own resolution (1 s),
/// then averaged into buckets of the given width as they age; older than
/// [`HISTORY_KEPT_DAYS`] they are deleted. A year of running is about 60 000 rows.
pub const HISTORY_TIERS: [(u64, u64); 2] = [(3_600, 60), (86_400, 600)];
/// Days of history kept.
pub const HISTORY_KEPT_DAYS: u64 = 400;
/// Notes kept per run.
pub const MAX_NOTES: usize = 1000;

/// The run database, shared by the threads of one process.
pub struct RunDb {
    path: PathBuf,
    conn: Mutex<Connection>,
}

/// One row of the run list.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RunSummary {
    pub number: u64,
    pub state: String,
    pub started_unix_ns: u64,
    pub stopped_unix_ns: Option<u64>,
    pub stop_reason: Option<String>,
    pub error: Option<String>,
    pub comment: String,
    pub events: u64,
    pub incomplete: u64,
    pub bytes: u64,
    pub recorded_events: u64,
    pub balance_holds: Option<bool>,
    pub config_origin: String,
}

/// A file a run wrote.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct FileRow {
    pub name: String,
    pub size_bytes: u64,
    pub events: u64,
    pub crc32c: String,
}

/// A state-changing action.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct ActionRow {
    pub unix_ns: u64,
    pub who: String,
    pub action: String,
    pub from_state: String,
    pub to_state: String,
    pub result: String,
    pub run: Option<u64>,
}

/// Everything about one run.
#[derive(Clone, Debug, Serialize)]
pub struct RunRecord {
    #[serde(flatten)]
    pub summary: RunSummary,
    pub config_sha256: String,
    /// The full topology, TOML.
    pub config: String,
    pub rejected: BTreeMap<String, u64>,
    pub files: Vec<FileRow>,
    pub actions: Vec<ActionRow>,
    /// The run report (JSON), once the run stopped.
    pub report: Option<serde_json::Value>,
    /// What every role and host said during the run (INFO and above), oldest first.
    pub log: Vec<LogRow>,
    /// The run's notes, oldest first: its start and stop comments among them.
    pub notes: Vec<NoteRow>,
    /// What operators did to the run's alarms, oldest first.
    pub alarm_actions: Vec<AlarmActionRow>,
    /// The fault rehearsals asked for during the run, done or refused, oldest first.
    pub faults: Vec<FaultRow>,
}

/// What a run is started with.
pub struct RunStart<'a> {
    pub config_origin: &'a str,
    pub config_sha256: &'a str,
    pub config: &'a str,
    pub started_unix_ns: u64,
    /// Kept as the run's title and as its first note.
    pub comment: &'a str,
    /// Who started it.
    pub who: &'a str,
}

/// What a run ended with.
pub struct RunEnd<'a> {
    pub state: &'a str,
    pub stopped_unix_ns: u64,
    pub stop_reason: &'a str,
    pub error: Option<&'a str>,
    pub events: u64,
    pub incomplete: u64,
    pub bytes: u64,
    pub recorded_events: u64,
    pub balance_holds: Option<bool>,
    pub rejected: &'a BTreeMap<String, u64>,
    pub files: &'a [FileRow],
    pub report_json: &'a str,
}

impl RunDb {
    /// Opens (creating if absent) the database at `path`.
    pub fn open(path: &Path) -> Result<RunDb, DbError> {
        let err = |source| DbError::Sqlite {
            path: path.to_path_buf(),
            source,
        };
        let conn = Connection::open(path).map_err(err)?;
        // Several processes (a run, `tessera runs`) may open it at once.
        conn.busy_timeout(Duration::from_secs(10)).map_err(err)?;
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(err)?;
        if version > SCHEMA_VERSION {
            return Err(DbError::Schema {
                path: path.to_path_buf(),
                found: version,
            });
        }
        conn.execute_batch(SCHEMA).map_err(err)?;
        conn.execute_batch(&format!("PRAGMA user_version = {SCHEMA_VERSION}"))
            .map_err(err)?;
        Ok(RunDb {
            path: path.to_path_buf(),
            conn: Mutex::new(conn),
        })
    }

    /// Opens the database at `path` for reading only: nothing is created, migrated or written,
    /// so it answers on a full disk and beside a run that holds it. A database of an older
    /// schema is brought up to date first (a write), as [`RunDb::open`] does.
    /// A database that a process left mid-write (a hot journal, which only a writer may roll
    /// back) is opened for writing instead, as [`RunDb::open`] does.
    pub fn open_read_only(path: &Path) -> Result<RunDb, DbError> {
        let err = |source| DbError::Sqlite {
            path: path.to_path_buf(),
            source,
        };
        let read = || -> rusqlite::Result<(Connection, i64)> {
            let conn = Connection::open_with_flags(
                path,
                rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY
                    | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
            )?;
            conn.busy_timeout(Duration::from_secs(10))?;
            let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
            // The first read of a table is where a hot journal is found.
            conn.query_row("SELECT COUNT(*) FROM sqlite_master", [], |r| {
                r.get::<_, i64>(0)
            })?;
            Ok((conn, version))
        };
        let (conn, version) = match read() {
            Ok(x) => x,
            Err(rusqlite::Error::SqliteFailure(e, _))
                if e.code == rusqlite::ErrorCode::ReadOnly =>
            {
                return RunDb::open(path);
            }
            Err(e) => return Err(err(e)),
        };
        if version > SCHEMA_VERSION {
            return Err(DbError::Schema {
                path: path.to_path_buf(),
                found: version,
            });
        }
        if version < SCHEMA_VERSION {
            drop(conn);
            return RunDb::open(path);
        }
        Ok(RunDb {
            path: path.to_path_buf(),
            conn: Mutex::new(conn),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn err(&self, source: rusqlite::Error) -> DbError {
        DbError::Sqlite {
            path: self.path.clone(),
            source,
        }
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        // A panic while holding the lock leaves the connection usable: SQLite rolled back.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Allocates the next run number (above every run here and above `at_least - 1`) and
    /// records the run as running, in one transaction: two processes cannot take one number.
    pub fn begin_run(&self, at_least: u64, s: &RunStart) -> Result<u64, DbError> {
        check_comment(s.comment)?;
        let mut c = self.conn();
        let tx = c
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .map_err(|e| self.err(e))?;
        let max: Option<i64> = tx
            .query_row("SELECT MAX(number) FROM runs", [], |r| r.get(0))
            .map_err(|e| self.err(e))?;
        let number = (max.unwrap_or(0) as u64 + 1).max(at_least);
        tx.execute(
            "INSERT INTO runs (number, state, config_origin, config_sha256, config, started_unix_ns, comment)
             VALUES (?1, 'running', ?2, ?3, ?4, ?5, ?6)",
            params![
                number as i64,
                s.config_origin,
                s.config_sha256,
                s.config,
                s.started_unix_ns as i64,
                s.comment
            ],
        )
        .map_err(|e| self.err(e))?;
        if !s.comment.is_empty() {
            tx.execute(
                "INSERT INTO notes (run, unix_ns, who, kind, text) VALUES (?1, ?2, ?3, 'start', ?4)",
                params![number as i64, s.started_unix_ns as i64, s.who, s.comment],
            )
            .map_err(|e| self.err(e))?;
        }
        tx.commit().map_err(|e| self.err(e))?;
        Ok(number)
    }

    /// Records how a run ended: state, times, counts, rejections by reason, files.
    pub fn end_run(&self, number: u64, e: &RunEnd) -> Result<(), DbError> {
        let mut c = self.conn();
        let tx = c.transaction().map_err(|x| self.err(x))?;
        let n = tx
            .execute(
                "UPDATE runs SET state = ?2, stopped_unix_ns = ?3, stop_reason = ?4, error = ?5,
                 events = ?6, incomplete = ?7, bytes = ?8, recorded_events = ?9, balance_holds = ?10,
                 report = ?11 WHERE number = ?1",
                params![
                    number as i64,
                    e.state,
                    e.stopped_unix_ns as i64,
                    e.stop_reason,
                    e.error,
                    e.events as i64,
                    e.incomplete as i64,
                    e.bytes as i64,
                    e.recorded_events as i64,
                    e.balance_holds,
                    e.report_json
                ],
            )
            .map_err(|x| self.err(x))?;
        if n == 0 {
            return Err(DbError::NoRun(number));
        }
        for (reason, count) in e.rejected {
            tx.execute(
                "INSERT OR REPLACE INTO rejected (run, reason, count) VALUES (?1, ?2, ?3)",
                params![number as i64, reason, *count as i64],
            )
            .map_err(|x| self.err(x))?;
        }
        for f in e.files {
            tx.execute(
                "INSERT OR REPLACE INTO files (run, name, size_bytes, events, crc32c) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![number as i64, f.name, f.size_bytes as i64, f.events as i64, f.crc32c],
            )
            .map_err(|x| self.err(x))?;
        }
        tx.commit().map_err(|x| self.err(x))
    }

    /// Records the shipper's state of a file at a destination (one row per pair).
    pub fn set_shipment(&self, r: &ShipmentRow) -> Result<(), DbError> {
        self.conn()
            .execute(
                "INSERT OR REPLACE INTO shipments (file, destination, size_bytes, crc32c, state,
                 attempts, error, next_try_unix_ns, updated_unix_ns)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
                params![
                    r.file,
                    r.destination,
                    r.size_bytes as i64,
                    r.crc32c,
                    r.state,
                    r.attempts as i64,
                    r.error,
                    r.next_try_unix_ns as i64,
                    r.updated_unix_ns as i64
                ],
            )
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Every shipment row, by file and destination.
    pub fn shipments(&self) -> Result<Vec<ShipmentRow>, DbError> {
        let c = self.conn();
        let mut st = c
            .prepare(
                "SELECT file, destination, size_bytes, crc32c, state, attempts, error,
                 next_try_unix_ns, updated_unix_ns FROM shipments ORDER BY file, destination",
            )
            .map_err(|e| self.err(e))?;
        let rows = st
            .query_map([], |r| {
                Ok(ShipmentRow {
                    file: r.get(0)?,
                    destination: r.get(1)?,
                    size_bytes: r.get::<_, i64>(2)? as u64,
                    crc32c: r.get(3)?,
                    state: r.get(4)?,
                    attempts: r.get::<_, i64>(5)? as u32,
                    error: r.get(6)?,
                    next_try_unix_ns: r.get::<_, i64>(7)? as u64,
                    updated_unix_ns: r.get::<_, i64>(8)? as u64,
                })
            })
            .map_err(|e| self.err(e))?;
        rows.collect::<Result<_, _>>().map_err(|e| self.err(e))
    }

    /// Records that the local copy of `file` was deleted, and why.
    pub fn mark_deleted(&self, file: &str, unix_ns: u64, reason: &str) -> Result<(), DbError> {
        self.conn()
            .execute(
                "INSERT OR REPLACE INTO deleted_files (file, unix_ns, reason) VALUES (?1, ?2, ?3)",
                params![file, unix_ns as i64, reason],
            )
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Files whose local copy the shipper deleted.
    pub fn deleted_files(&self) -> Result<Vec<(String, u64, String)>, DbError> {
        let c = self.conn();
        let mut st = c
            .prepare("SELECT file, unix_ns, reason FROM deleted_files ORDER BY file")
            .map_err(|e| self.err(e))?;
        let rows = st
            .query_map([], |r| {
                Ok((r.get(0)?, r.get::<_, i64>(1)? as u64, r.get(2)?))
            })
            .map_err(|e| self.err(e))?;
        rows.collect::<Result<_, _>>().map_err(|e| self.err(e))
    }

    /// Runs whose state is still `running`: left so by a process that ended without stopping
    /// them (a crash, a SIGKILL, a power cut), once no process runs them any more.
    pub fn open_runs(&self) -> Result<Vec<u64>, DbError> {
        let c = self.conn();
        let mut st = c
            .prepare("SELECT number FROM runs WHERE state = 'running' ORDER BY number")
            .map_err(|x| self.err(x))?;
        let rows = st
            .query_map([], |r| r.get::<_, i64>(0))
            .map_err(|x| self.err(x))?;
        rows.map(|r| r.map(|n| n as u64).map_err(|x| self.err(x)))
            .collect()
    }

    /// Sets the operator's comment of a run.
    pub fn set_comment(&self, number: u64, comment: &str) -> Result<(), DbError> {
        check_comment(comment)?;
        let n = self
            .conn()
            .execute(
                "UPDATE runs SET comment = ?2 WHERE number = ?1",
                params![number as i64, comment],
            )
            .map_err(|e| self.err(e))?;
        if n == 0 {
            return Err(DbError::NoRun(number));
        }
        Ok(())
    }

    /// Keeps a run's message log (the first [`MAX_LOG_LINES`] lines).
    pub fn add_log(&self, run: u64, lines: &[LogRow]) -> Result<(), DbError> {
        let mut c = self.conn();
        let tx = c.transaction().map_err(|e| self.err(e))?;
        {
            let mut st = tx
                .prepare(
                    "INSERT INTO log (run, unix_ns, host, role, level, message)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                )
                .map_err(|e| self.err(e))?;
            for l in lines.iter().take(MAX_LOG_LINES) {
                st.execute(params![
                    run as i64,
                    l.unix_ns as i64,
                    l.host,
                    l.role,
                    l.level,
                    l.message
                ])
                .map_err(|e| self.err(e))?;
            }
        }
        tx.commit().map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Logs a state-changing action (accepted or refused).
    pub fn log_action(&self, a: &ActionRow) -> Result<(), DbError> {
        self.conn()
            .execute(
                "INSERT INTO actions (unix_ns, who, action, from_state, to_state, result, run)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                params![
                    a.unix_ns as i64,
                    a.who,
                    a.action,
                    a.from_state,
                    a.to_state,
                    a.result,
                    a.run.map(|r| r as i64)
                ],
            )
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// The most recent runs, newest first.
    pub fn list(&self, limit: usize) -> Result<Vec<RunSummary>, DbError> {
        let c = self.conn();
        let mut st = c
            .prepare(&format!(
                "SELECT {SUMMARY_COLUMNS} FROM runs ORDER BY number DESC LIMIT ?1"
            ))
            .map_err(|e| self.err(e))?;
        let rows = st
            .query_map([limit as i64], summary_row)
            .map_err(|e| self.err(e))?;
        rows.collect::<Result<Vec<_>, _>>().map_err(|e| self.err(e))
    }

    /// Everything about run `number`.
    pub fn get(&self, number: u64) -> Result<RunRecord, DbError> {
        let c = self.conn();
        let row = c
            .query_row(
                &format!(
                    "SELECT {SUMMARY_COLUMNS}, config_sha256, config, report FROM runs WHERE number = ?1"
                ),
                [number as i64],
                |r| {
                    Ok((
                        summary_row(r)?,
                        r.get::<_, String>(13)?,
                        r.get::<_, String>(14)?,
                        r.get::<_, Option<String>>(15)?,
                    ))
                },
            )
            .optional()
            .map_err(|e| self.err(e))?;
        let Some((summary, config_sha256, config, report)) = row else {
            return Err(DbError::NoRun(number));
        };
        let mut rejected = BTreeMap::new();
        let mut st = c
            .prepare("SELECT reason, count FROM rejected WHERE run = ?1 ORDER BY reason")
            .map_err(|e| self.err(e))?;
        for r in st
            .query_map([number as i64], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?))
            })
            .map_err(|e| self.err(e))?
        {
            let (k, v) = r.map_err(|e| self.err(e))?;
            rejected.insert(k, v as u64);
        }
        let mut st = c
            .prepare(
                "SELECT name, size_bytes, events, crc32c FROM files WHERE run = ?1 ORDER BY name",
            )
            .map_err(|e| self.err(e))?;
        let files = st
            .query_map([number as i64], |r| {
                Ok(FileRow {
                    name: r.get(0)?,
                    size_bytes: r.get::<_, i64>(1)? as u64,
                    events: r.get::<_, i64>(2)? as u64,
                    crc32c: r.get(3)?,
                })
            })
            .map_err(|e| self.err(e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.err(e))?;
        let mut st = c
            .prepare(
                "SELECT unix_ns, who, action, from_state, to_state, result, run FROM actions
                 WHERE run = ?1 ORDER BY id",
            )
            .map_err(|e| self.err(e))?;
        let actions = st
            .query_map([number as i64], action_row)
            .map_err(|e| self.err(e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.err(e))?;
        let mut st = c
            .prepare(
                "SELECT unix_ns, host, role, level, message FROM log WHERE run = ?1 ORDER BY rowid",
            )
            .map_err(|e| self.err(e))?;
        let log = st
            .query_map([number as i64], |r| {
                Ok(LogRow {
                    unix_ns: r.get::<_, i64>(0)? as u64,
                    host: r.get(1)?,
                    role: r.get(2)?,
                    level: r.get(3)?,
                    message: r.get(4)?,
                })
            })
            .map_err(|e| self.err(e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.err(e))?;
        let mut st = c
            .prepare("SELECT unix_ns, who, kind, text FROM notes WHERE run = ?1 ORDER BY id")
            .map_err(|e| self.err(e))?;
        let notes = st
            .query_map([number as i64], |r| {
                Ok(NoteRow {
                    unix_ns: r.get::<_, i64>(0)? as u64,
                    who: r.get(1)?,
                    kind: r.get(2)?,
                    text: r.get(3)?,
                })
            })
            .map_err(|e| self.err(e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.err(e))?;
        let mut st = c
            .prepare(
                "SELECT unix_ns, who, action, alarm, subject, until_unix_ns, run FROM alarm_actions
                 WHERE run = ?1 ORDER BY id",
            )
            .map_err(|e| self.err(e))?;
        let alarm_actions = st
            .query_map([number as i64], alarm_action_row)
            .map_err(|e| self.err(e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.err(e))?;
        let mut st = c
            .prepare(
                "SELECT run, unix_ns, who, fault, until_unix_ns, result FROM faults
                 WHERE run = ?1 ORDER BY id",
            )
            .map_err(|e| self.err(e))?;
        let faults = st
            .query_map([number as i64], |r| {
                Ok(FaultRow {
                    run: r.get::<_, Option<i64>>(0)?.map(|v| v as u64),
                    unix_ns: r.get::<_, i64>(1)? as u64,
                    who: r.get(2)?,
                    fault: r.get(3)?,
                    until_unix_ns: r.get::<_, i64>(4)? as u64,
                    result: r.get(5)?,
                })
            })
            .map_err(|e| self.err(e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.err(e))?;
        Ok(RunRecord {
            faults,
            notes,
            alarm_actions,
            log,
            summary,
            config_sha256,
            config,
            rejected,
            files,
            actions,
            // The report was written by this code as JSON; one that does not parse is shown as
            // absent rather than failing the whole record.
            report: report.and_then(|s| serde_json::from_str(&s).ok()),
        })
    }

    /// Adds an entry to a run's notes (at most [`MAX_NOTES`] per run). A stop's comment also
    /// becomes the run's title when it was started without one.
    pub fn add_note(&self, run: u64, n: &NoteRow) -> Result<(), DbError> {
        check_comment(&n.text)?;
        let mut c = self.conn();
        let tx = c.transaction().map_err(|e| self.err(e))?;
        let exists: Option<i64> = tx
            .query_row(
                "SELECT number FROM runs WHERE number = ?1",
                [run as i64],
                |r| r.get(0),
            )
            .optional()
            .map_err(|e| self.err(e))?;
        if exists.is_none() {
            return Err(DbError::NoRun(run));
        }
        let count: i64 = tx
            .query_row(
                "SELECT COUNT(*) FROM notes WHERE run = ?1",
                [run as i64],
                |r| r.get(0),
            )
            .map_err(|e| self.err(e))?;
        if count as usize >= MAX_NOTES {
            return Err(DbError::TooManyNotes(run));
        }
        tx.execute(
            "INSERT INTO notes (run, unix_ns, who, kind, text) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![run as i64, n.unix_ns as i64, n.who, n.kind, n.text],
        )
        .map_err(|e| self.err(e))?;
        if n.kind == "stop" {
            // A run started without a comment is listed by its stop's.
            tx.execute(
                "UPDATE runs SET comment = ?2 WHERE number = ?1 AND comment = ''",
                params![run as i64, n.text],
            )
            .map_err(|e| self.err(e))?;
        }
        tx.commit().map_err(|e| self.err(e))
    }

    /// Keeps what an operator did to an alarm.
    pub fn log_alarm_action(&self, a: &AlarmActionRow) -> Result<(), DbError> {
        self.conn()
            .execute(
                "INSERT INTO alarm_actions (unix_ns, who, action, alarm, subject, until_unix_ns, run)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                params![
                    a.unix_ns as i64,
                    a.who,
                    a.action,
                    a.alarm,
                    a.subject,
                    a.until_unix_ns.map(|v| v as i64),
                    a.run.map(|v| v as i64)
                ],
            )
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Keeps a fault rehearsal (done or refused).
    pub fn log_fault(&self, f: &FaultRow) -> Result<(), DbError> {
        self.conn()
            .execute(
                "INSERT INTO faults (run, unix_ns, who, fault, until_unix_ns, result)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                params![
                    f.run.map(|v| v as i64),
                    f.unix_ns as i64,
                    f.who,
                    f.fault,
                    f.until_unix_ns as i64,
                    f.result
                ],
            )
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// The most recent alarm actions, newest first.
    pub fn alarm_actions(&self, limit: usize) -> Result<Vec<AlarmActionRow>, DbError> {
        let c = self.conn();
        let mut st = c
            .prepare(
                "SELECT unix_ns, who, action, alarm, subject, until_unix_ns, run FROM alarm_actions
                 ORDER BY id DESC LIMIT ?1",
            )
            .map_err(|e| self.err(e))?;
        let rows = st
            .query_map([limit as i64], alarm_action_row)
            .map_err(|e| self.err(e))?;
        rows.collect::<Result<Vec<_>, _>>().map_err(|e| self.err(e))
    }

    /// Adds points to the history, then averages what has aged into coarser buckets
    /// ([`HISTORY_TIERS`]) and deletes what is older than [`HISTORY_KEPT_DAYS`], `now_unix_ns`
    /// being the present.
    pub fn add_history(&self, points: &[HistoryPoint], now_unix_ns: u64) -> Result<(), DbError> {
        let mut c = self.conn();
        let tx = c.transaction().map_err(|e| self.err(e))?;
        insert_history(&tx, points).map_err(|e| self.err(e))?;
        for (age_s, width_s) in HISTORY_TIERS {
            let width = width_s * 1_000_000_000;
            // Whole buckets only, so that a bucket is averaged once.
            let cut = now_unix_ns.saturating_sub(age_s * 1_000_000_000) / width * width;
            let merged: Vec<HistoryPoint> = {
                let mut st = tx
                    .prepare(
                        "SELECT run, (unix_ns / ?2) * ?2, SUM(span_s),
                         SUM(events_per_s * span_s), SUM(built_bytes_per_s * span_s),
                         SUM(recorded_bytes_per_s * span_s), SUM(incomplete_per_s * span_s),
                         SUM(rejected_per_s * span_s), SUM(dead_time_fraction * span_s),
                         MAX(buffer_fraction)
                         FROM history WHERE unix_ns < ?1 AND span_s < ?3
                         GROUP BY run, unix_ns / ?2",
                    )
                    .map_err(|e| self.err(e))?;
                let rows = st
                    .query_map(params![cut as i64, width as i64, width_s as f64], |r| {
                        let w: f64 = r.get(2)?;
                        let avg = |i: usize| -> rusqlite::Result<f64> {
                            Ok(if w > 0.0 {
                                r.get::<_, f64>(i)? / w
                            } else {
                                0.0
                            })
                        };
                        Ok(HistoryPoint {
                            run: r.get::<_, i64>(0)? as u64,
                            unix_ns: r.get::<_, i64>(1)? as u64,
                            span_s: width_s as f64,
                            events_per_s: avg(3)?,
                            built_bytes_per_s: avg(4)?,
                            recorded_bytes_per_s: avg(5)?,
                            incomplete_per_s: avg(6)?,
                            rejected_per_s: avg(7)?,
                            dead_time_fraction: avg(8)?,
                            buffer_fraction: r.get(9)?,
                        })
                    })
                    .map_err(|e| self.err(e))?;
                rows.collect::<Result<_, _>>().map_err(|e| self.err(e))?
            };
            if merged.is_empty() {
                continue;
            }
            tx.execute(
                "DELETE FROM history WHERE unix_ns < ?1 AND span_s < ?2",
                params![cut as i64, width_s as f64],
            )
            .map_err(|e| self.err(e))?;
            insert_history(&tx, &merged).map_err(|e| self.err(e))?;
        }
        tx.execute(
            "DELETE FROM history WHERE unix_ns < ?1",
            [now_unix_ns.saturating_sub(HISTORY_KEPT_DAYS * 86_400 * 1_000_000_000) as i64],
        )
        .map_err(|e| self.err(e))?;
        tx.commit().map_err(|e| self.err(e))
    }

    /// The history of runs `first..=last` (every run when `None`) between two times, oldest
    /// first, at most `limit` points (the newest of them).
    pub fn history(
        &self,
        runs: Option<(u64, u64)>,
        since_unix_ns: u64,
        until_unix_ns: u64,
        limit: usize,
    ) -> Result<Vec<HistoryPoint>, DbError> {
        let (first, last) = runs.unwrap_or((0, i64::MAX as u64));
        let c = self.conn();
        let mut st = c
            .prepare(
                "SELECT run, unix_ns, span_s, events_per_s, built_bytes_per_s,
                 recorded_bytes_per_s, incomplete_per_s, rejected_per_s, dead_time_fraction,
                 buffer_fraction FROM (
                   SELECT * FROM history WHERE run BETWEEN ?1 AND ?2 AND unix_ns BETWEEN ?3 AND ?4
                   ORDER BY unix_ns DESC LIMIT ?5
                 ) ORDER BY unix_ns",
            )
            .map_err(|e| self.err(e))?;
        let rows = st
            .query_map(
                params![
                    first as i64,
                    last.min(i64::MAX as u64) as i64,
                    since_unix_ns.min(i64::MAX as u64) as i64,
                    until_unix_ns.min(i64::MAX as u64) as i64,
                    limit as i64
                ],
                |r| {
                    Ok(HistoryPoint {
                        run: r.get::<_, i64>(0)? as u64,
                        unix_ns: r.get::<_, i64>(1)? as u64,
                        span_s: r.get(2)?,
                        events_per_s: r.get(3)?,
                        built_bytes_per_s: r.get(4)?,
                        recorded_bytes_per_s: r.get(5)?,
                        incomplete_per_s: r.get(6)?,
                        rejected_per_s: r.get(7)?,
                        dead_time_fraction: r.get(8)?,
                        buffer_fraction: r.get(9)?,
                    })
                },
            )
            .map_err(|e| self.err(e))?;
        rows.collect::<Result<Vec<_>, _>>().map_err(|e| self.err(e))
    }

    /// The most recent actions, newest first (all runs, and those outside any run).
    pub fn actions(&self, limit: usize) -> Result<Vec<ActionRow>, DbError> {
        let c = self.conn();
        let mut st = c
            .prepare(
                "SELECT unix_ns, who, action, from_state, to_state, result, run FROM actions
                 ORDER BY id DESC LIMIT ?1",
            )
            .map_err(|e| self.err(e))?;
        let rows = st
            .query_map([limit as i64], action_row)
            .map_err(|e| self.err(e))?;
        rows.collect::<Result<Vec<_>, _>>().map_err(|e| self.err(e))
    }
}

const SUMMARY_COLUMNS: &str = "number, state, started_unix_ns, stopped_unix_ns, stop_reason, error, comment, events, incomplete, bytes, recorded_events, balance_holds, config_origin";

fn summary_row(r: &rusqlite::Row) -> rusqlite::Result<RunSummary> {
    Ok(RunSummary {
        number: r.get::<_, i64>(0)? as u64,
        state: r.get(1)?,
        started_unix_ns: r.get::<_, i64>(2)? as u64,
        stopped_unix_ns: r.get::<_, Option<i64>>(3)?.map(|v| v as u64),
        stop_reason: r.get(4)?,
        error: r.get(5)?,
        comment: r.get(6)?,
        events: r.get::<_, i64>(7)? as u64,
        incomplete: r.get::<_, i64>(8)? as u64,
        bytes: r.get::<_, i64>(9)? as u64,
        recorded_events: r.get::<_, i64>(10)? as u64,
        balance_holds: r.get(11)?,
        config_origin: r.get(12)?,
    })
}

fn insert_history(tx: &rusqlite::Transaction, points: &[HistoryPoint]) -> rusqlite::Result<()> {
    let mut st = tx.prepare(
        "INSERT OR REPLACE INTO history (run, unix_ns, span_s, events_per_s,
         built_bytes_per_s, recorded_bytes_per_s, incomplete_per_s, rejected_per_s,
         dead_time_fraction, buffer_fraction)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
    )?;
    for p in points {
        st.execute(params![
            p.run as i64,
            p.unix_ns as i64,
            p.span_s,
            p.events_per_s,
            p.built_bytes_per_s,
            p.recorded_bytes_per_s,
            p.incomplete_per_s,
            p.rejected_per_s,
            p.dead_time_fraction,
            p.buffer_fraction
        ])?;
    }
    Ok(())
}

fn alarm_action_row(r: &rusqlite::Row) -> rusqlite::Result<AlarmActionRow> {
    Ok(AlarmActionRow {
        unix_ns: r.get::<_, i64>(0)? as u64,
        who: r.get(1)?,
        action: r.get(2)?,
        alarm: r.get(3)?,
        subject: r.get(4)?,
        until_unix_ns: r.get::<_, Option<i64>>(5)?.map(|v| v as u64),
        run: r.get::<_, Option<i64>>(6)?.map(|v| v as u64),
    })
}

fn action_row(r: &rusqlite::Row) -> rusqlite::Result<ActionRow> {
    Ok(ActionRow {
        unix_ns: r.get::<_, i64>(0)? as u64,
        who: r.get(1)?,
        action: r.get(2)?,
        from_state: r.get(3)?,
        to_state: r.get(4)?,
        result: r.get(5)?,
        run: r.get::<_, Option<i64>>(6)?.map(|v| v as u64),
    })
}

//! Every run is closed (issue 11, item 4): what a crash left open is closed at the next start of
//! the run control on the same output directory, and by `tessera recover DIR`. Unfinished files
//! (`.part`) are recovered with every whole block they hold; runs the database still calls
//! `running` are closed as `crashed`, with the counts of the files they left.

use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;
use tessera_rundb::{FileRow, RunDb, RunEnd};
use tessera_verify::recover::{recover_dir, Recovered};

/// What [`close_crashed`] did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Closed {
    pub recovered_files: Vec<Recovered>,
    /// (run, events in its files) for each run closed as `crashed`.
    pub crashed_runs: Vec<(u64, u64)>,
}

/// Recovers `dir`'s unfinished files, then closes the runs of `db` left `running`. Call it only
/// when no process is recording into `dir`.
pub fn close_crashed(dir: &Path, db: Option<&RunDb>) -> Result<Closed> {
    let mut closed = Closed {
        recovered_files: recover_dir(dir)?,
        ..Default::default()
    };
    for r in &closed.recovered_files {
        tracing::warn!(
            file = r.file,
            events = r.events,
            dropped_bytes = r.dropped_bytes,
            "recovered an unfinished file"
        );
    }
    let Some(db) = db else {
        return Ok(closed);
    };
    for run in db.open_runs()? {
        let (files, events, incomplete, bytes) = files_of(dir, run)?;
        let recovered: Vec<&Recovered> = closed
            .recovered_files
            .iter()
            .filter(|r| r.run_number == run)
            .collect();
        let report = serde_json::json!({
            "crashed": true,
            "files": files,
            "recovered_files": recovered,
        });
        end_crashed(
            db,
            run,
            (&files, events, incomplete, bytes),
            "the process ended without stopping the run; its files were closed by recovery",
            report,
        )?;
        tracing::warn!(run, events, "closed a run left running by a crash");
        closed.crashed_runs.push((run, events));
    }
    Ok(closed)
}

/// Closes run `run`, crashed, again with the files the recording hosts hold (`files`, their
/// `.part` files `recovered` there first): a run spread over hosts keeps its files on those
/// hosts, not in the run control's directory, which [`close_crashed`] read.
pub fn close_crashed_on_hosts(
    db: &RunDb,
    run: u64,
    files: &[tessera_recorder::FileInfo],
    recovered: &[String],
) -> Result<u64> {
    let rows: Vec<FileRow> = files.iter().map(row).collect();
    let events: u64 = files.iter().map(|f| f.events).sum();
    let incomplete: u64 = files.iter().map(|f| f.incomplete_events).sum();
    let bytes: u64 = files.iter().map(|f| f.record_bytes).sum();
    let report = serde_json::json!({
        "crashed": true,
        "files": rows,
        "recovered_files_on_hosts": recovered,
    });
    end_crashed(
        db,
        run,
        (&rows, events, incomplete, bytes),
        "the run control ended without stopping the run; the recording hosts closed its files",
        report,
    )?;
    tracing::warn!(
        run,
        events,
        "closed a run left running by a crash, with the files its recording hosts hold"
    );
    Ok(events)
}

/// Records run `run` as crashed with what its files hold: (rows, events, incomplete, bytes).
fn end_crashed(
    db: &RunDb,
    run: u64,
    (files, events, incomplete, bytes): (&[FileRow], u64, u64, u64),
    error: &str,
    report: serde_json::Value,
) -> Result<()> {
    db.end_run(
        run,
        &RunEnd {
            state: "crashed",
            stopped_unix_ns: crate::controller::unix_ns(),
            stop_reason: "crashed: closed at the next start",
            error: Some(error),
            events,
            incomplete,
            bytes,
            recorded_events: events,
            balance_holds: None,
            rejected: &Default::default(),
            files,
            report_json: &report.to_string(),
        },
    )?;
    Ok(())
}

/// A file's row in the run database, from its sidecar.
fn row(info: &tessera_recorder::FileInfo) -> FileRow {
    FileRow {
        name: info.file.clone(),
        size_bytes: info.size_bytes,
        events: info.events,
        crc32c: info.file_crc32c.clone(),
    }
}

/// The finished files of `run` in `dir`, from their sidecars: rows, events, incomplete, bytes.
fn files_of(dir: &Path, run: u64) -> Result<(Vec<FileRow>, u64, u64, u64)> {
    let prefix = format!("run{run:06}_");
    let mut rows = Vec::new();
    let (mut events, mut incomplete, mut bytes) = (0, 0, 0);
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&prefix) && n.ends_with(".tsr.json"))
        .collect();
    names.sort();
    for n in names {
        let text = std::fs::read(dir.join(&n))?;
        let Ok(info) = serde_json::from_slice::<tessera_recorder::FileInfo>(&text) else {
            continue;
        };
        events += info.events;
        incomplete += info.incomplete_events;
        bytes += info.record_bytes;
        rows.push(row(&info));
    }
    Ok((rows, events, incomplete, bytes))
}

/// Takes the output directory for this process (an advisory lock on `DIR/.tessera.lock`, held
/// while the returned file is open): recovery must never touch the open file of a run another
/// process is recording, and two processes must not record into one directory.
pub fn lock_output(dir: &Path) -> Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let path = dir.join(".tessera.lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: flock on a descriptor this function owns; no memory is involved.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        anyhow::bail!(
            "output directory {} is in use by another tessera process (it holds {})",
            dir.display(),
            path.display()
        );
    }
    Ok(f)
}

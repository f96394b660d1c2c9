//! `tessera verify DESTINATION --db …`: every copy a destination holds, read back and checked
//! against what the run database says the recorder wrote (size, the file CRC, an intact
//! trailer), and every file the database knows accounted for: at the destination, or still
//! waiting in the data directory, never neither.

use std::path::Path;

use serde::Serialize;
use tessera_rundb::RunDb;

use crate::{Destination, ShipError};

/// One file the run database lists, as the destination holds it.
#[derive(Clone, Debug, Serialize)]
pub struct CopyCheck {
    pub run: u64,
    pub file: String,
    /// `ok`, `waiting` (not shipped there yet; the local file is still in the data directory),
    /// `damaged`, `missing` (the database says it was verified there), `lost` (neither there
    /// nor in the data directory), `unreadable`.
    pub state: &'static str,
    pub detail: Option<String>,
    /// A damaged or missing copy whose local file is still there: the shipper was told to
    /// send it again.
    pub sent_again: bool,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct DestinationReport {
    pub destination: String,
    pub files: Vec<CopyCheck>,
    pub ok: u64,
    pub waiting: u64,
    pub problems: u64,
}

impl DestinationReport {
    pub fn ok(&self) -> bool {
        self.problems == 0 && !self.files.is_empty()
    }

    pub fn summary(&self) -> String {
        let mut s = String::new();
        for f in &self.files {
            s += &format!(
                "{} run {} {}{}{}\n",
                match f.state {
                    "ok" => "ok  ",
                    "waiting" => "wait",
                    _ => "FAIL",
                },
                f.run,
                f.file,
                match (&f.detail, f.state) {
                    (Some(d), _) => format!(": {} ({d})", f.state),
                    (None, "ok") => String::new(),
                    (None, st) => format!(": {st}"),
                },
                match (f.sent_again, f.state) {
                    (true, _) => "; the shipper will send it again",
                    (false, "damaged" | "missing") => {
                        "; no local copy is left: restore it from another destination"
                    }
                    _ => "",
                }
            );
        }
        s += &format!(
            "{}: {} file(s) in the run database; {} verified here, {} still waiting to be shipped; {} problem(s)\n",
            self.destination,
            self.files.len(),
            self.ok,
            self.waiting,
            self.problems
        );
        s
    }
}

/// Checks `d` against the run database `db` (of the data directory `data`), for run `run` or
/// every run.
pub fn verify_destination(
    d: &dyn Destination,
    db: &RunDb,
    data: &Path,
    run: Option<u64>,
) -> Result<DestinationReport, ShipError> {
    let dn = d.name();
    let shipped = db.shipments()?;
    let runs: Vec<u64> = match run {
        Some(n) => vec![n],
        None => {
            let mut v: Vec<u64> = db.list(usize::MAX >> 1)?.iter().map(|r| r.number).collect();
            v.sort();
            v
        }
    };
    let mut rep = DestinationReport {
        destination: dn.clone(),
        ..DestinationReport::default()
    };
    for n in runs {
        for f in db.get(n)?.files {
            let verified_here = shipped
                .iter()
                .any(|r| r.file == f.name && r.destination == dn && r.state == "verified");
            let (state, detail) = match d.check(&f.name) {
                Ok(Some(got)) => match got.matches_recorded(f.size_bytes, &f.crc32c) {
                    Ok(()) => ("ok", None),
                    Err(e) => ("damaged", Some(e)),
                },
                Ok(None) if verified_here => (
                    "missing",
                    Some("the shipper verified a copy here, which is gone".into()),
                ),
                Ok(None) if data.join(&f.name).exists() => ("waiting", None),
                Ok(None) => (
                    "lost",
                    Some("neither at the destination nor in the data directory".into()),
                ),
                Err(e) => ("unreadable", Some(e.to_string())),
            };
            match state {
                "ok" => rep.ok += 1,
                "waiting" => rep.waiting += 1,
                _ => rep.problems += 1,
            }
            // What the shipper believes verified but is not: it must send it again, which it
            // can while the local file is there (the retention keeps it for that).
            let mut sent_again = false;
            if matches!(state, "damaged" | "missing") && verified_here {
                if let Some(mut r) = shipped
                    .iter()
                    .find(|r| r.file == f.name && r.destination == dn)
                    .cloned()
                {
                    r.state = "failed".into();
                    r.error = Some(format!(
                        "tessera verify found the copy {state}: {}",
                        detail.as_deref().unwrap_or("")
                    ));
                    r.next_try_unix_ns = 0;
                    r.updated_unix_ns = crate::unix_ns(std::time::SystemTime::now());
                    db.set_shipment(&r)?;
                    sent_again = data.join(&f.name).exists();
                }
            }
            rep.files.push(CopyCheck {
                run: n,
                file: f.name,
                state,
                detail,
                sent_again,
            });
        }
    }
    Ok(rep)
}

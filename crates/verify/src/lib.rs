//! Reading recorded files: [`FileReader`] walks a file's blocks and events; [`verify_paths`]
//! checks everything a file promises; [`dump`] prints events for people.
//!
//! What `verify` checks, per file: the header; every block's decompression and raw CRC; the file
//! CRC in the trailer over every byte before it; the trailer's counts against what was read; the
//! sidecar's counts and CRC against the trailer. Per event: its checksum; every fragment's markers
//! and CRC; one event ID in every fragment; no source twice; every expected source present or
//! named missing under the incomplete flag; payloads against the pattern of the emulated sources.
//! Across files: no event ID recorded twice in one run. An incomplete event is reported, not a problem; a
//! missing fragment that is not flagged is.

use anyhow::{Context, Result};
use serde::Serialize;
use std::collections::{BTreeSet, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use tessera_archive::FileInfo;
use tessera_format::event::{EventFlags, EventRecordHeader};
use tessera_format::link::PackedFragment;
use tessera_format::pattern::Pattern;
use tessera_format::wire::FragmentView;

pub use tessera_archive::{events_in, Event, FileReader, ReadError};

pub mod recover;

#[derive(Clone, Debug, Default, Serialize)]
pub struct FileReport {
    pub path: String,
    pub ok: bool,
    pub run_number: Option<u64>,
    pub sequence: Option<u32>,
    pub compression: Option<String>,
    pub events: u64,
    pub incomplete_events: u64,
    pub fragments: u64,
    pub payload_bytes: u64,
    pub record_bytes: u64,
    pub file_bytes: u64,
    pub payloads_checked: u64,
    pub sidecar: bool,
    pub problems: Vec<String>,
    /// Problems beyond the first 50 are counted here, not listed.
    pub more_problems: u64,
}

impl FileReport {
    fn problem(&mut self, p: String) {
        if self.problems.len() < 50 {
            self.problems.push(p);
        } else {
            self.more_problems += 1;
        }
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct VerifyReport {
    pub files: Vec<FileReport>,
    pub events: u64,
    pub incomplete_events: u64,
    pub fragments: u64,
    pub payload_bytes: u64,
    pub duplicate_event_ids: u64,
    pub problems: u64,
}

impl VerifyReport {
    pub fn ok(&self) -> bool {
        self.problems == 0 && !self.files.is_empty()
    }

    pub fn summary(&self) -> String {
        let mut s = String::new();
        for f in &self.files {
            let _ = writeln!(
                s,
                "{} {}: {} events ({} incomplete), {} fragments, {} payload bytes, {} payloads checked{}",
                if f.ok { "ok  " } else { "FAIL" },
                f.path,
                f.events,
                f.incomplete_events,
                f.fragments,
                f.payload_bytes,
                f.payloads_checked,
                if f.sidecar { "" } else { " (no sidecar: expected sources inferred)" }
            );
            for p in &f.problems {
                let _ = writeln!(s, "       {p}");
            }
            if f.more_problems > 0 {
                let _ = writeln!(s, "       ... and {} more problems", f.more_problems);
            }
        }
        let _ = writeln!(
            s,
            "{} file(s): {} events ({} incomplete), {} fragments, {} payload bytes; {} problem(s){}",
            self.files.len(),
            self.events,
            self.incomplete_events,
            self.fragments,
            self.payload_bytes,
            self.problems,
            if self.duplicate_event_ids > 0 { format!(", {} event IDs recorded twice", self.duplicate_event_ids) } else { String::new() }
        );
        if self.files.is_empty() {
            let _ = writeln!(s, "no files found");
        }
        s
    }
}

/// Expands directories into their `.tsr` files (sorted), and flags unfinished `.part` files.
fn expand(paths: &[PathBuf]) -> Result<(Vec<PathBuf>, Vec<PathBuf>)> {
    let mut files = Vec::new();
    let mut partial = Vec::new();
    for p in paths {
        if p.is_dir() {
            let mut v: Vec<PathBuf> = std::fs::read_dir(p)
                .with_context(|| format!("reading directory {}", p.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .collect();
            v.sort();
            for f in v {
                let name = f.file_name().and_then(|n| n.to_str()).unwrap_or("");
                if name.ends_with(".tsr") {
                    files.push(f);
                } else if name.ends_with(".tsr.part") {
                    partial.push(f);
                }
            }
        } else if p.exists() {
            files.push(p.clone());
        } else {
            anyhow::bail!("{} does not exist", p.display());
        }
    }
    Ok((files, partial))
}

/// Verifies files and directories of files.
pub fn verify_paths(paths: &[PathBuf]) -> Result<VerifyReport> {
    let (files, partial) = expand(paths)?;
    let mut rep = VerifyReport::default();
    let mut seen: HashSet<(u64, u64)> = HashSet::new();
    for f in files {
        let fr = verify_file(&f, &mut seen, &mut rep.duplicate_event_ids);
        rep.events += fr.events;
        rep.incomplete_events += fr.incomplete_events;
        rep.fragments += fr.fragments;
        rep.payload_bytes += fr.payload_bytes;
        rep.problems += fr.problems.len() as u64 + fr.more_problems;
        rep.files.push(fr);
    }
    for p in partial {
        rep.problems += 1;
        rep.files.push(FileReport {
            path: p.display().to_string(),
            problems: vec!["unfinished file (.part): its run did not close it".into()],
            ..Default::default()
        });
    }
    Ok(rep)
}

fn sidecar_of(path: &Path) -> Option<Result<FileInfo, String>> {
    let mut p = path.as_os_str().to_owned();
    p.push(".json");
    let p = PathBuf::from(p);
    if !p.exists() {
        return None;
    }
    Some(
        std::fs::read(&p)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice(&b).map_err(|e| format!("{}: {e}", p.display()))),
    )
}

/// Verifies one file; (run, event ID) pairs are checked against `seen` across files.
pub fn verify_file(
    path: &Path,
    seen: &mut HashSet<(u64, u64)>,
    duplicates: &mut u64,
) -> FileReport {
    let mut fr = FileReport {
        path: path.display().to_string(),
        ..Default::default()
    };
    fr.file_bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    let side = match sidecar_of(path) {
        Some(Ok(s)) => Some(s),
        Some(Err(e)) => {
            fr.problem(format!("sidecar unreadable: {e}"));
            None
        }
        None => None,
    };
    fr.sidecar = side.is_some();
    let expected: Option<BTreeSet<u32>> = side
        .as_ref()
        .filter(|s| !s.sources.is_empty())
        .map(|s| s.sources.iter().copied().collect());
    let pattern = side.as_ref().and_then(|s| Pattern::from_name(&s.pattern));
    let pattern_sources: HashSet<u32> = side
        .as_ref()
        .map(|s| s.pattern_sources.iter().copied().collect())
        .unwrap_or_default();
    let mut rd = match FileReader::open(path) {
        Ok(r) => r,
        Err(e) => {
            fr.problem(format!("cannot read: {e}"));
            return fr;
        }
    };
    let run_number = rd.header.run_number;
    fr.run_number = Some(run_number);
    fr.sequence = Some(rd.header.file_sequence);
    fr.compression = Some(rd.header.codec.name().into());
    let mut blocks = 0u32;
    // Without a sidecar, the expected sources are what the file itself shows.
    let mut inferred: BTreeSet<u32> = BTreeSet::new();
    // Without a sidecar the expected set is known only at the end; events are kept by the set of
    // sources they cover (few distinct sets in practice), with at most 50 event IDs each, so
    // memory does not grow with the file.
    let mut patterns: std::collections::HashMap<BTreeSet<u32>, (u64, Vec<u64>)> =
        std::collections::HashMap::new();
    loop {
        let (bh, raw) = match rd.next_block() {
            Ok(Some(b)) => b,
            Ok(None) => break,
            Err(e) => {
                fr.problem(format!("block {blocks}: {e}"));
                break;
            }
        };
        blocks += 1;
        let mut in_block = 0u32;
        for ev in events_in(raw) {
            let ev = match ev {
                Ok(e) => e,
                Err(e) => {
                    fr.problem(format!("block {blocks}: {e}"));
                    break;
                }
            };
            in_block += 1;
            let h = &ev.header;
            fr.events += 1;
            fr.record_bytes += ev.bytes.len() as u64;
            let incomplete = h.flags.has(EventFlags::INCOMPLETE);
            fr.incomplete_events += incomplete as u64;
            if !seen.insert((run_number, h.event_id)) {
                *duplicates += 1;
                fr.problem(format!("event {}: recorded more than once", h.event_id));
            }
            let mut frags: Vec<PackedFragment> = Vec::new();
            for f in ev.fragments() {
                match f {
                    Ok(f) => frags.push(f),
                    Err(e) => {
                        fr.problem(format!("event {}: {e}", h.event_id));
                        break;
                    }
                }
            }
            if frags.len() != h.fragment_count as usize {
                fr.problem(format!(
                    "event {}: header says {} fragments, record holds {}",
                    h.event_id,
                    h.fragment_count,
                    frags.len()
                ));
            }
            let body = ev.body();
            let sum = EventRecordHeader::checksum_over(
                &ev.bytes[..h.header_size()],
                frags.iter().map(|f| &body[f.start..f.start + f.len]),
            );
            if sum != h.checksum {
                fr.problem(format!("event {}: event checksum mismatch", h.event_id));
            }
            let mut sources = BTreeSet::new();
            for f in &frags {
                fr.fragments += 1;
                let bytes = &body[f.start..f.start + f.len];
                let view = match FragmentView::parse(bytes, u32::MAX as usize) {
                    Ok((v, _)) => v,
                    Err(e) => {
                        fr.problem(format!(
                            "event {} source {}: fragment fails its check: {e}",
                            h.event_id, f.header.source_id
                        ));
                        continue;
                    }
                };
                fr.payload_bytes += view.header.payload_size as u64;
                if view.header.event_id != h.event_id {
                    fr.problem(format!(
                        "event {}: holds a fragment of event {} (source {})",
                        h.event_id, view.header.event_id, view.header.source_id
                    ));
                }
                if !sources.insert(view.header.source_id) {
                    fr.problem(format!(
                        "event {}: source {} appears twice",
                        h.event_id, view.header.source_id
                    ));
                }
                if let Some(p) = pattern {
                    if pattern_sources.contains(&view.header.source_id) {
                        fr.payloads_checked += 1;
                        if let Some(off) =
                            p.check(view.header.source_id, h.event_id, view.payload())
                        {
                            fr.problem(format!("event {} source {}: payload differs from the {} pattern at byte {off}", h.event_id, view.header.source_id, p.name()));
                        }
                    }
                }
            }
            for m in &h.missing {
                if sources.contains(m) {
                    fr.problem(format!(
                        "event {}: source {m} is listed missing but present",
                        h.event_id
                    ));
                }
            }
            if incomplete == h.missing.is_empty() {
                fr.problem(format!(
                    "event {}: incomplete flag and missing list disagree",
                    h.event_id
                ));
            }
            inferred.extend(sources.iter().copied());
            inferred.extend(h.missing.iter().copied());
            let mut covered = sources;
            covered.extend(h.missing.iter().copied());
            match &expected {
                Some(exp) => check_coverage(&mut fr, h.event_id, &covered, exp),
                None => {
                    let e = patterns.entry(covered).or_default();
                    e.0 += 1;
                    if e.1.len() < 50 {
                        e.1.push(h.event_id);
                    }
                }
            }
        }
        if in_block != bh.event_count {
            fr.problem(format!(
                "block {blocks}: header says {} events, holds {in_block}",
                bh.event_count
            ));
        }
    }
    if expected.is_none() {
        for (covered, (count, ids)) in &patterns {
            if covered != &inferred {
                for ev in ids {
                    check_coverage(&mut fr, *ev, covered, &inferred);
                }
                fr.more_problems += count - ids.len() as u64;
            }
        }
    }
    match (&rd.trailer, rd.computed_crc) {
        (Some(t), Some(crc)) => {
            if t.file_crc != crc {
                fr.problem(format!(
                    "file CRC mismatch: trailer {:08x}, computed {crc:08x}",
                    t.file_crc
                ));
            }
            let counts = [
                ("events", t.events, fr.events),
                (
                    "incomplete events",
                    t.incomplete_events,
                    fr.incomplete_events,
                ),
                ("fragments", t.fragments, fr.fragments),
                ("record bytes", t.record_bytes, fr.record_bytes),
                ("blocks", t.blocks as u64, blocks as u64),
            ];
            for (what, said, found) in counts {
                if said != found {
                    fr.problem(format!("trailer says {said} {what}, file holds {found}"));
                }
            }
            if let Some(s) = &side {
                if s.events != t.events
                    || s.fragments != t.fragments
                    || s.file_crc32c != format!("{:08x}", t.file_crc)
                    || s.size_bytes != fr.file_bytes
                {
                    fr.problem("sidecar disagrees with the file (counts, CRC or size)".into());
                }
            }
            // Anything after the trailer?
            if rd.bytes_after_trailer() {
                fr.problem("bytes after the trailer".into());
            }
        }
        _ => {
            if fr.problems.is_empty() {
                fr.problem("no trailer: the file was not closed".into());
            }
        }
    }
    fr.ok = fr.problems.is_empty();
    fr
}

/// Every expected source of an event is present or named missing, and no other source appears.
fn check_coverage(fr: &mut FileReport, ev: u64, covered: &BTreeSet<u32>, expected: &BTreeSet<u32>) {
    if covered == expected {
        return;
    }
    let absent: Vec<u32> = expected.difference(covered).copied().collect();
    let extra: Vec<u32> = covered.difference(expected).copied().collect();
    if !absent.is_empty() {
        fr.problem(format!(
            "event {ev}: sources {absent:?} neither present nor flagged missing"
        ));
    }
    if !extra.is_empty() {
        fr.problem(format!("event {ev}: unexpected sources {extra:?}"));
    }
}

/// Prints events of a file for people.
pub fn dump(
    path: &Path,
    max_events: u64,
    from: Option<u64>,
    hex_bytes: usize,
    out: &mut impl std::io::Write,
) -> Result<()> {
    let mut rd = FileReader::open(path).with_context(|| format!("opening {}", path.display()))?;
    let h = rd.header.clone();
    writeln!(
        out,
        "file {}: format v{}, run {}, sequence {}, {} / {}, config sha256 {}",
        path.display(),
        tessera_format::file::FILE_VERSION,
        h.run_number,
        h.file_sequence,
        h.codec.name(),
        h.filter.name(),
        hex_short(&h.config_digest)
    )?;
    let mut shown = 0u64;
    'blocks: while let Some((_, raw)) = rd
        .next_block()
        .with_context(|| format!("reading {}", path.display()))?
    {
        for ev in events_in(raw) {
            let ev = ev?;
            let h = &ev.header;
            if from.is_some_and(|f| h.event_id < f) {
                continue;
            }
            if max_events > 0 && shown >= max_events {
                break 'blocks;
            }
            shown += 1;
            let flags = h.flags.names();
            writeln!(
                out,
                "event {:>10}  trigger {:>3}  builder {}  {} fragments  {} bytes  ts {}{}{}",
                h.event_id,
                h.trigger_type,
                h.builder_id,
                h.fragment_count,
                h.record_size,
                h.timestamp,
                if flags.is_empty() {
                    String::new()
                } else {
                    format!("  [{}]", flags.join(","))
                },
                if h.missing.is_empty() {
                    String::new()
                } else {
                    format!("  missing {:?}", h.missing)
                }
            )?;
            let body = ev.body();
            for f in ev.fragments() {
                let f = f?;
                let p = &body[f.payload_range()];
                let n = p.len().min(hex_bytes);
                let hex: String = p[..n]
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<Vec<_>>()
                    .join(" ");
                writeln!(
                    out,
                    "    source {:>5}  {:>7} B  status {:#06x}  {hex}{}",
                    f.header.source_id,
                    f.header.payload_size,
                    f.header.status,
                    if p.len() > n { " ..." } else { "" }
                )?;
            }
        }
    }
    if let Some(t) = &rd.trailer {
        writeln!(
            out,
            "trailer: {} events ({} incomplete), {} fragments, {} blocks, file crc32c {:08x}",
            t.events, t.incomplete_events, t.fragments, t.blocks, t.file_crc
        )?;
    }
    Ok(())
}

fn hex_short(d: &[u8]) -> String {
    d[..8].iter().map(|b| format!("{b:02x}")).collect()
}

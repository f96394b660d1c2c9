//! Closing what a crash left open (`tessera recover DIR`, and every run's start): a recorder
//! killed at any moment leaves its open file as `.part`. Every whole block it holds whose
//! checksum holds is kept: the file is rewritten under its final name with a trailer counting
//! exactly those blocks, its sidecar says `"recovered": true`, and the `.part` goes. Blocks are
//! copied as they are stored (no recompression); a torn last block is dropped and reported.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Serialize;
use tessera_archive::FileInfo;
use tessera_format::event::EventFlags;
use tessera_format::file::{FileTrailer, FILE_HEADER_SIZE, FILE_VERSION};

use crate::{events_in, FileReader};

/// What recovery made of one `.part`.
#[derive(Clone, Debug, Serialize)]
pub struct Recovered {
    pub part: String,
    /// The finished file written in its place.
    pub file: String,
    pub run_number: u64,
    pub events: u64,
    pub blocks: u32,
    /// Bytes after the last whole block (a block the crash cut), dropped.
    pub dropped_bytes: u64,
    /// Why reading stopped before the end of the `.part`, if it did.
    pub stopped_at: Option<String>,
    pub info: FileInfo,
}

/// Recovers every `*.tsr.part` in `dir`.
/// First gives back the room a crashed run held for finishing itself (`recorder.disk_reserve`):
/// rewriting its `.part` files needs it.
pub fn recover_dir(dir: &Path) -> Result<Vec<Recovered>> {
    for e in std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .flatten()
    {
        if e.file_name()
            .to_str()
            .is_some_and(tessera_archive::is_reserve_file_name)
        {
            let _ = std::fs::remove_file(e.path());
        }
    }
    let mut parts: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.to_string_lossy().ends_with(".tsr.part"))
        .collect();
    parts.sort();
    parts.iter().map(|p| recover_part(p)).collect()
}

/// Recovers one `.part` into its final name.
pub fn recover_part(part: &Path) -> Result<Recovered> {
    let name = part
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_suffix(".part"))
        .with_context(|| format!("{} is not a .part file", part.display()))?
        .to_string();
    let dir = part.parent().unwrap_or(Path::new("."));
    let final_path = dir.join(&name);
    if final_path.exists() {
        anyhow::bail!(
            "{}: {} exists already; not overwritten",
            part.display(),
            final_path.display()
        );
    }
    let total = std::fs::metadata(part)?.len();
    let mut r = FileReader::open(part)
        .map_err(|e| anyhow::anyhow!("{}: no readable file header: {e}", part.display()))?;
    let header = r.header.clone();
    let tmp = dir.join(format!("{name}.recovering"));
    let mut out = std::io::BufWriter::new(
        File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?,
    );
    let hb = header.encode();
    out.write_all(&hb)?;
    let mut crc = tessera_format::crc::crc32c(&hb);
    let mut t = FileTrailer {
        events: 0,
        incomplete_events: 0,
        fragments: 0,
        record_bytes: 0,
        blocks: 0,
        file_crc: 0,
    };
    let (mut first, mut last) = (None, None);
    let mut sources = std::collections::BTreeSet::new();
    let mut kept = FILE_HEADER_SIZE as u64;
    let stopped_at = loop {
        let (bh, raw) = match r.next_block() {
            Ok(Some(b)) => b,
            Ok(None) => break None,
            Err(e) => break Some(e.to_string()),
        };
        // A block whose events do not all parse is not kept either.
        let mut ok = true;
        let (mut ev, mut inc, mut fr) = (0u64, 0u64, 0u64);
        let (mut f0, mut f1) = (None, None);
        for e in events_in(raw) {
            match e {
                Ok(e) => {
                    ev += 1;
                    inc += e.header.flags.has(EventFlags::INCOMPLETE) as u64;
                    fr += e.header.fragment_count as u64;
                    f0.get_or_insert(e.header.event_id);
                    f1 = Some(e.header.event_id);
                    for f in e.fragments().flatten() {
                        sources.insert(f.header.source_id);
                    }
                }
                Err(_) => ok = false,
            }
        }
        if !ok || ev != bh.event_count as u64 {
            break Some(format!("block {} does not hold whole events", t.blocks));
        }
        let bhb = bh.encode();
        let raw_len = raw.len() as u64;
        out.write_all(&bhb)?;
        out.write_all(r.stored())?;
        crc = tessera_format::crc::crc32c_append(
            tessera_format::crc::crc32c_append(crc, &bhb),
            r.stored(),
        );
        kept += (bhb.len() + r.stored().len()) as u64;
        t.events += ev;
        t.incomplete_events += inc;
        t.fragments += fr;
        t.record_bytes += raw_len;
        t.blocks += 1;
        if first.is_none() {
            first = f0;
        }
        last = f1.or(last);
    };
    t.file_crc = crc;
    let tb = t.encode();
    out.write_all(&tb)?;
    let size = kept + tb.len() as u64;
    let file = out.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&tmp, &final_path)?;
    let info = FileInfo {
        file: name.clone(),
        format_version: FILE_VERSION,
        run_number: header.run_number,
        sequence: header.file_sequence,
        size_bytes: size,
        events: t.events,
        incomplete_events: t.incomplete_events,
        fragments: t.fragments,
        record_bytes: t.record_bytes,
        blocks: t.blocks,
        compression: header.codec.name().into(),
        filter: header.filter.name().into(),
        file_crc32c: format!("{:08x}", t.file_crc),
        first_event_id: first,
        last_event_id: last,
        start_time_unix_ns: header.start_time_ns,
        end_time_unix_ns: 0,
        config_sha256: hex::encode(header.config_digest),
        // The emulated sources' pattern is not known here: payloads are not checked.
        pattern: String::new(),
        sources: sources.into_iter().collect(),
        pattern_sources: Vec::new(),
        recovered: true,
        stream: tessera_archive::stream_of_name(&name),
    };
    let json = serde_json::to_vec_pretty(&info)?;
    tessera_archive::file_write_atomic(&dir.join(format!("{name}.json")), &json)?;
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    std::fs::remove_file(part)?;
    Ok(Recovered {
        part: part.display().to_string(),
        file: final_path.display().to_string(),
        run_number: header.run_number,
        events: t.events,
        blocks: t.blocks,
        dropped_bytes: total.saturating_sub(kept),
        stopped_at,
        info,
    })
}

/// Takes over what an earlier recorder of `run` left in `dir`: finishes its `.part` files
/// (every whole block kept, as `tessera recover` does) and reads every file of the run for its
/// counts and its event IDs (the newest `keep_ids` of them). A file it cannot read is an error:
/// a recorder must not start next to files it cannot account for.
pub fn adopt_run(
    dir: &Path,
    run: u64,
    keep_ids: usize,
) -> Result<(Vec<Recovered>, tessera_archive::AdoptedRun)> {
    let mut out = tessera_archive::AdoptedRun::default();
    if !dir.is_dir() {
        return Ok((Vec::new(), out));
    }
    // Its `.part` files finished, and every finished file's sidecar, by file name.
    let (recovered, sidecars) = close_run(dir, run)?;
    let sidecars: std::collections::HashMap<String, FileInfo> =
        sidecars.into_iter().map(|i| (i.file.clone(), i)).collect();
    // In name order: a series' files in their order, so the IDs kept are the newest.
    let files = run_paths(dir, run, ".tsr")?;
    let mut ids = std::collections::VecDeque::new();
    let mut infos = Vec::new();
    for f in &files {
        let mut r = FileReader::open(f)
            .map_err(|e| anyhow::anyhow!("{}: cannot read it to take it over: {e}", f.display()))?;
        let start = r.header.start_time_ns;
        while let Some((_, raw)) = r
            .next_block()
            .map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?
        {
            out.record_bytes += raw.len() as u64;
            for e in events_in(raw) {
                let e = e.map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?;
                let n = e.header.fragment_count as u64;
                out.events += 1;
                if e.header.flags.has(EventFlags::INCOMPLETE) {
                    out.incomplete_events += 1;
                    out.fragments_in_incomplete += n;
                } else {
                    out.fragments_in_complete += n;
                }
                if keep_ids > 0 {
                    if ids.len() == keep_ids {
                        ids.pop_front();
                    }
                    ids.push_back(e.header.event_id);
                }
            }
        }
        out.file_bytes += std::fs::metadata(f).map(|m| m.len()).unwrap_or(0);
        let name = f.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        match sidecars.get(name) {
            Some(info) => infos.push((start, info.clone())),
            None => anyhow::bail!(
                "{}: its sidecar {name}.json is missing or unreadable; run `tessera verify` on it",
                f.display()
            ),
        }
    }
    infos.sort_by(|a, b| (a.0, &a.1.file).cmp(&(b.0, &b.1.file)));
    out.files = infos.into_iter().map(|(_, i)| i).collect();
    out.event_ids = ids.into();
    Ok((recovered, out))
}

/// Closes what a crash left of run `run` in `dir`: finishes its `.part` files (every whole block
/// kept) and returns them and every finished file of the run, from their sidecars, in name order.
pub fn close_run(dir: &Path, run: u64) -> Result<(Vec<Recovered>, Vec<FileInfo>)> {
    let mut recovered = Vec::new();
    for p in run_paths(dir, run, ".tsr.part")? {
        recovered.push(recover_part(&p)?);
    }
    let mut files = Vec::new();
    for p in run_paths(dir, run, ".tsr.json")? {
        let text = std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?;
        files.push(
            serde_json::from_slice::<FileInfo>(&text)
                .with_context(|| format!("{}: not a file's sidecar", p.display()))?,
        );
    }
    Ok((recovered, files))
}

/// The regular files of run `run` in `dir` whose names end in `suffix`, in name order.
fn run_paths(dir: &Path, run: u64, suffix: &str) -> Result<Vec<PathBuf>> {
    let prefix = format!("run{run:06}_");
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.is_file()
                && p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(suffix))
        })
        .collect();
    v.sort();
    Ok(v)
}

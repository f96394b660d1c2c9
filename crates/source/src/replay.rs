//! Recorded files as the emulated sources' input (`sources.replay`): a run taken today becomes
//! tomorrow's stimulus. Each emulated source sends, for each recorded event in event-ID order,
//! the payload its ID had in that event, at the recorded trigger times (scaled) or as fast as
//! allowed. A source with no fragment in a recorded event sends none for it, so the event is
//! built without it, as it was recorded.
//!
//! The payloads are held in memory, bounded by `sources.replay_memory`: replay drives a run from
//! memory, as a stimulator does, and does not compete with the recorder for the disk.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Bytes of index a recorded fragment or event takes (counted against `replay_memory`).
const INDEX_BYTES: u64 = 24;

/// A recording, read for replay.
#[derive(Debug, Default)]
pub struct Replay {
    /// Trigger times in ns from the first event, in event order, never decreasing.
    times: Vec<u64>,
    /// Each event's trigger type, as its first fragment said.
    types: Vec<u16>,
    /// The largest payload.
    max_payload: usize,
    /// Per source ID, per event (in order): its payload's range in `data`.
    payloads: HashMap<u32, Vec<Option<(usize, usize)>>>,
    data: Vec<u8>,
}

impl Replay {
    /// Reads `path` (a recorded file, or a directory: every finished `.tsr` in it), holding at
    /// most `limit` bytes of payload.
    pub fn load(path: &Path, limit: u64) -> Result<Replay, String> {
        let files = recorded_files(path)?;
        // (event ID, timestamp, trigger type, [(source, payload range)])
        type Recorded = (u64, u64, u16, Vec<(u32, (usize, usize))>);
        let mut events: Vec<Recorded> = Vec::new();
        let mut data = Vec::new();
        let mut index_bytes = 0u64;
        for f in &files {
            let mut rd = tessera_archive::FileReader::open(f)
                .map_err(|e| format!("{}: {e}", f.display()))?;
            while let Some((_, raw)) = rd
                .next_block()
                .map_err(|e| format!("{}: {e}", f.display()))?
            {
                for ev in tessera_archive::events_in(raw) {
                    let ev = ev.map_err(|e| format!("{}: {e}", f.display()))?;
                    let body = ev.body();
                    let mut frags = Vec::new();
                    let mut trigger_type = 0;
                    for fr in ev.fragments() {
                        let fr = fr.map_err(|e| {
                            format!("{}: event {}: {e}", f.display(), ev.header.event_id)
                        })?;
                        let p = &body[fr.payload_range()];
                        // Payloads and the index of them share the bound: a recording of
                        // many empty fragments must not size the index past it either.
                        index_bytes += INDEX_BYTES;
                        if (data.len() + p.len()) as u64 + index_bytes > limit {
                            return Err(format!(
                                "the recording holds more than sources.replay_memory ({limit} bytes) of payload: raise it, or replay fewer files"
                            ));
                        }
                        if frags.is_empty() {
                            trigger_type = fr.header.trigger_type;
                        }
                        let start = data.len();
                        data.extend_from_slice(p);
                        frags.push((fr.header.source_id, (start, p.len())));
                    }
                    index_bytes += INDEX_BYTES;
                    events.push((ev.header.event_id, ev.header.timestamp, trigger_type, frags));
                }
            }
        }
        if events.is_empty() {
            return Err(format!("{}: no recorded event in it", path.display()));
        }
        // Several builders write in the order they finish: replay goes by event ID, each once.
        events.sort_by_key(|e| e.0);
        events.dedup_by_key(|e| e.0);
        let first = events[0].1;
        let mut times = Vec::with_capacity(events.len());
        let mut types = Vec::with_capacity(events.len());
        let mut max_payload = 0;
        let mut payloads: HashMap<u32, Vec<Option<(usize, usize)>>> = HashMap::new();
        let n = events.len();
        // The index holds a slot per (source, event): bounded with the payloads.
        let sources: std::collections::HashSet<u32> = events
            .iter()
            .flat_map(|e| e.3.iter().map(|f| f.0))
            .collect();
        let slots = (sources.len() as u64).saturating_mul(n as u64);
        if data.len() as u64 + slots.saturating_mul(INDEX_BYTES) > limit {
            return Err(format!(
                "{} sources x {n} events of index with the payloads exceed sources.replay_memory ({limit} bytes): raise it, or replay fewer files",
                sources.len()
            ));
        }
        for (i, (_, t, ty, frags)) in events.into_iter().enumerate() {
            let t = t
                .saturating_sub(first)
                .max(times.last().copied().unwrap_or(0));
            times.push(t);
            types.push(ty);
            for (s, r) in frags {
                max_payload = max_payload.max(r.1);
                payloads.entry(s).or_insert_with(|| vec![None; n])[i] = Some(r);
            }
        }
        Ok(Replay {
            times,
            types,
            max_payload,
            payloads,
            data,
        })
    }

    /// Recorded events, each a trigger.
    pub fn events(&self) -> u64 {
        self.times.len() as u64
    }

    /// The trigger times, in ns from the first, at `speed` times the recorded pace.
    pub fn times(&self, speed: f64) -> Vec<u64> {
        self.times
            .iter()
            .map(|&t| (t as f64 / speed).round() as u64)
            .collect()
    }

    /// The trigger type of the `i`-th recorded event.
    pub fn trigger_type(&self, i: u64) -> u16 {
        self.types.get(i as usize).copied().unwrap_or(1)
    }

    /// The largest recorded payload, in bytes.
    pub fn max_payload(&self) -> usize {
        self.max_payload
    }

    /// The recorded source IDs.
    pub fn sources(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.payloads.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// Source `source`'s payload in the `i`-th recorded event; `None` where it sent none.
    pub fn payload(&self, source: u32, i: u64) -> Option<&[u8]> {
        let (start, len) = (*self.payloads.get(&source)?.get(i as usize)?)?;
        Some(&self.data[start..start + len])
    }
}

/// The finished files at `path`: the file itself, or every `.tsr` of a directory, by name.
fn recorded_files(path: &Path) -> Result<Vec<PathBuf>, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if !meta.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut v: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "tsr"))
        .collect();
    v.sort();
    if v.is_empty() {
        return Err(format!("{}: no finished .tsr file in it", path.display()));
    }
    Ok(v)
}

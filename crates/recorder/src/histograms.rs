//! The histograms a shift crew looks at, filled by the recorder from every event it takes:
//! event size, fragment size per source, time between consecutive triggers, one payload word
//! per source (a data-quality view: an ADC sample, say) and events by trigger type. The
//! recorder reads each record's header and fragment headers while they are in its cache
//! anyway; the bins are fixed, so the memory is bounded whatever the run's length.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use tessera_config::{HistogramsSection, PayloadWord, MAX_HISTOGRAM_SOURCES};
use tessera_format::event::EventRecordHeader;

/// Bins of a size histogram: bin `i` holds values in `[2^(i-1), 2^i)`, bin 0 the value 0.
pub const LOG2_BINS: usize = 41;
/// Event IDs whose trigger times are remembered to pair an event with the one before or after
/// it: events arrive out of order (several builders), within this many of each other.
const TRIGGER_WINDOW: usize = 4096;
/// Trigger types counted one by one; the rest are counted together.
pub const MAX_TRIGGER_TYPES: usize = 256;

/// A histogram of fixed bins.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Histogram {
    /// `log2` (bin `i` holds `[2^(i-1), 2^i)` in `unit`, bin 0 the value 0) or `linear`
    /// (`bins.len()` equal bins from `lo` to `hi`).
    pub scale: String,
    /// What a value is in: `bytes`, `ns`, or the payload word's type.
    pub unit: String,
    pub lo: f64,
    pub hi: f64,
    pub bins: Vec<u64>,
    /// Values below `lo`, and at or above `hi` (linear only).
    pub under: u64,
    pub over: u64,
    pub count: u64,
    pub sum: f64,
}

impl Histogram {
    pub fn log2(unit: &str) -> Histogram {
        Histogram {
            scale: "log2".into(),
            unit: unit.into(),
            lo: 0.0,
            hi: 2f64.powi(LOG2_BINS as i32 - 1),
            bins: vec![0; LOG2_BINS],
            ..Default::default()
        }
    }

    pub fn linear(unit: &str, lo: f64, hi: f64, bins: usize) -> Histogram {
        Histogram {
            scale: "linear".into(),
            unit: unit.into(),
            lo,
            hi,
            bins: vec![0; bins.max(1)],
            ..Default::default()
        }
    }

    /// The bin a log2 histogram puts `v` in.
    pub fn log2_bin(v: u64) -> usize {
        ((64 - v.leading_zeros()) as usize).min(LOG2_BINS - 1)
    }

    pub fn add_u64(&mut self, v: u64) {
        self.count += 1;
        self.sum += v as f64;
        let i = Histogram::log2_bin(v);
        if let Some(b) = self.bins.get_mut(i) {
            *b += 1;
        }
    }

    pub fn add_f64(&mut self, v: f64) {
        if !v.is_finite() {
            self.over += 1;
            return;
        }
        self.count += 1;
        self.sum += v;
        if v < self.lo {
            self.under += 1;
        } else if v >= self.hi {
            self.over += 1;
        } else {
            let n = self.bins.len();
            let i = (((v - self.lo) / (self.hi - self.lo)) * n as f64) as usize;
            self.bins[i.min(n - 1)] += 1;
        }
    }

    pub fn mean(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum / self.count as f64)
    }

    /// Upper bound of bin `i` (log2: `2^i`), for Prometheus's `le`.
    pub fn upper(&self, i: usize) -> f64 {
        if self.scale == "log2" {
            2f64.powi(i as i32)
        } else {
            self.lo + (self.hi - self.lo) * (i + 1) as f64 / self.bins.len() as f64
        }
    }
}

/// Every histogram of one run's recorder.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Histograms {
    /// Record bytes of each event (header and fragments).
    pub event_size: Histogram,
    /// Payload bytes of each fragment, by source.
    pub fragment_size: BTreeMap<u32, Histogram>,
    /// Nanoseconds between the triggers of consecutive event IDs (their timestamps), each pair
    /// counted once when both were taken within 4096 events of each other.
    pub time_between_triggers: Histogram,
    /// The configured payload word of each fragment, by source.
    pub payload_word: BTreeMap<u32, Histogram>,
    /// Events by trigger type (the first 256 types; the rest under `other_trigger_types`).
    pub trigger_types: BTreeMap<u16, u64>,
    pub other_trigger_types: u64,
    /// Events by the stream they are written to (`recorder.streams`, by trigger type; `main`
    /// for the rest).
    #[serde(default)]
    pub streams: BTreeMap<String, u64>,
    /// Fragments of sources beyond the first 4096, counted here and not histogrammed.
    pub sources_not_kept: u64,
    /// Fragments too short for the payload word.
    pub payload_too_short: u64,
}

/// What fills [`Histograms`]: the recorder's, one per run.
#[derive(Debug)]
pub struct Filler {
    pub cfg: HistogramsSection,
    pub h: Histograms,
    /// The stream of each trigger type named in `recorder.streams`.
    stream_of: BTreeMap<u16, String>,
    /// (event ID, trigger timestamp) by event ID modulo the window.
    triggers: Vec<(u64, u64)>,
}

impl Filler {
    /// `streams`: `recorder.streams` (stream name by trigger types).
    pub fn new(cfg: &HistogramsSection, streams: &BTreeMap<String, Vec<u16>>) -> Filler {
        Filler {
            stream_of: streams
                .iter()
                .flat_map(|(name, types)| types.iter().map(move |t| (*t, name.clone())))
                .collect(),
            cfg: cfg.clone(),
            h: Histograms {
                event_size: Histogram::log2("bytes"),
                time_between_triggers: Histogram::log2("ns"),
                ..Default::default()
            },
            triggers: vec![(u64::MAX, 0); TRIGGER_WINDOW],
        }
    }

    /// Takes one event record. Never panics on its bytes: a record that does not parse is
    /// skipped (the recorder wrote it as it came; `tessera verify` judges it).
    pub fn add(&mut self, rec: &[u8]) {
        let Ok(Some((h, size))) = EventRecordHeader::decode_prefix(rec, rec.len()) else {
            return;
        };
        let hs = h.header_size();
        let Some(body) = rec.get(hs..size) else {
            return;
        };
        self.h.event_size.add_u64(size as u64);
        let types = &mut self.h.trigger_types;
        if types.len() < MAX_TRIGGER_TYPES || types.contains_key(&h.trigger_type) {
            *types.entry(h.trigger_type).or_default() += 1;
        } else {
            self.h.other_trigger_types += 1;
        }
        let stream = self
            .stream_of
            .get(&h.trigger_type)
            .map_or("main", |s| s.as_str());
        match self.h.streams.get_mut(stream) {
            Some(n) => *n += 1,
            None => {
                self.h.streams.insert(stream.to_string(), 1);
            }
        }
        self.pair_triggers(h.event_id, h.timestamp);
        let word = self.cfg.payload_type;
        let at = self.cfg.payload_offset as usize;
        for f in tessera_format::link::Fragments::new(body) {
            // Framing only (the CRCs were checked where the fragments came in); a record whose
            // framing is bad ends here.
            let Ok(f) = f else { break };
            let Some(payload) = body.get(f.payload_range()) else {
                break;
            };
            let src = f.header.source_id;
            if !self.h.fragment_size.contains_key(&src)
                && self.h.fragment_size.len() >= MAX_HISTOGRAM_SOURCES
            {
                self.h.sources_not_kept += 1;
                continue;
            }
            self.h
                .fragment_size
                .entry(src)
                .or_insert_with(|| Histogram::log2("bytes"))
                .add_u64(payload.len() as u64);
            match payload.get(at..).and_then(|p| word.read(p)) {
                Some(v) => self
                    .h
                    .payload_word
                    .entry(src)
                    .or_insert_with(|| {
                        Histogram::linear(
                            word_name(word),
                            self.cfg.payload_min,
                            self.cfg.payload_max,
                            self.cfg.payload_bins as usize,
                        )
                    })
                    .add_f64(v),
                None => self.h.payload_too_short += 1,
            }
        }
    }

    /// Counts the time to the trigger before and after `id`, if either was taken recently.
    fn pair_triggers(&mut self, id: u64, t: u64) {
        let n = TRIGGER_WINDOW as u64;
        let slot = |i: u64| (i % n) as usize;
        if let Some(prev) = id.checked_sub(1) {
            let (pid, pt) = self.triggers[slot(prev)];
            if pid == prev {
                self.h.time_between_triggers.add_u64(t.saturating_sub(pt));
            }
        }
        if let Some(next) = id.checked_add(1) {
            let (nid, nt) = self.triggers[slot(next)];
            if nid == next {
                self.h.time_between_triggers.add_u64(nt.saturating_sub(t));
            }
        }
        self.triggers[slot(id)] = (id, t);
    }
}

fn word_name(w: PayloadWord) -> &'static str {
    match w {
        PayloadWord::U8 => "u8",
        PayloadWord::U16 => "u16",
        PayloadWord::U32 => "u32",
        PayloadWord::I16 => "i16",
        PayloadWord::I32 => "i32",
        PayloadWord::F32 => "f32",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_format::event::{EventFlags, EventRecordHeader};
    use tessera_format::wire::{encode_fragment, FragmentHeader};

    fn record(id: u64, t: u64, trigger: u16, payloads: &[(u32, Vec<u8>)]) -> Vec<u8> {
        let mut body = Vec::new();
        for (src, p) in payloads {
            let h = FragmentHeader {
                status: 0,
                source_id: *src,
                trigger_type: trigger,
                event_id: id,
                timestamp: t,
                payload_size: 0,
            };
            encode_fragment(&mut body, &h, p);
        }
        let mut h = EventRecordHeader {
            flags: EventFlags(0),
            event_id: id,
            timestamp: t,
            trigger_type: trigger,
            builder_id: 0,
            fragment_count: payloads.len() as u32,
            record_size: 0,
            missing: vec![],
            checksum: 0,
        };
        h.record_size = (h.header_size() + body.len()) as u32;
        let mut rec = Vec::new();
        h.encode_into(&mut rec);
        rec.extend_from_slice(&body);
        rec
    }

    #[test]
    fn sizes_words_triggers_and_pairs_out_of_order_are_counted_once() {
        let mut f = Filler::new(
            &HistogramsSection {
                payload_offset: 2,
                payload_bins: 4,
                payload_min: 0.0,
                payload_max: 400.0,
                ..Default::default()
            },
            &BTreeMap::from([("calibration".to_string(), vec![2])]),
        );
        // Events 2, 0, 1 (two builders interleave), 1 000 ns apart, then event 9 alone.
        let word = |v: u16| {
            let mut p = vec![0xAA, 0xBB];
            p.extend_from_slice(&v.to_le_bytes());
            p.extend_from_slice(&[0; 4]);
            p
        };
        for (id, t, trig) in [(2u64, 2000u64, 1u16), (0, 0, 1), (1, 1000, 2), (9, 9500, 1)] {
            f.add(&record(
                id,
                t,
                trig,
                &[(4, word(50 * id as u16)), (7, vec![1])],
            ));
        }
        let h = &f.h;
        assert_eq!(h.event_size.count, 4);
        assert_eq!(h.trigger_types, BTreeMap::from([(1, 3), (2, 1)]));
        assert_eq!(
            h.streams,
            BTreeMap::from([("calibration".to_string(), 1), ("main".to_string(), 3)])
        );
        assert_eq!(h.time_between_triggers.count, 2, "0-1 and 1-2, once each");
        assert_eq!(h.time_between_triggers.sum, 2000.0);
        assert_eq!(h.time_between_triggers.bins[Histogram::log2_bin(1000)], 2);
        assert_eq!(h.fragment_size[&4].bins[Histogram::log2_bin(8)], 4);
        assert_eq!(h.fragment_size[&7].bins[1], 4, "1 byte: [1, 2)");
        // Source 4's word at offset 2: 0, 50, 100, 450 in bins of 100 up to 400.
        let w = &h.payload_word[&4];
        assert_eq!(w.bins, vec![2, 1, 0, 0]);
        assert_eq!(w.over, 1);
        assert_eq!(w.mean(), Some(150.0));
        assert_eq!(
            h.payload_too_short, 4,
            "source 7's one byte has no word at 2"
        );
    }

    #[test]
    fn a_record_that_does_not_parse_is_skipped_not_trusted() {
        let mut f = Filler::new(&HistogramsSection::default(), &BTreeMap::new());
        let mut rec = record(1, 0, 0, &[(0, vec![1, 2, 3, 4])]);
        f.add(&rec[..10]);
        // A fragment claiming more payload than the record holds ends the walk.
        let hs = EventRecordHeader::decode_prefix(&rec, rec.len())
            .unwrap()
            .unwrap()
            .0
            .header_size();
        rec[hs + 32..hs + 36].copy_from_slice(&u32::MAX.to_le_bytes());
        f.add(&rec);
        assert_eq!(f.h.event_size.count, 1);
        assert!(f.h.fragment_size.is_empty());
        let mut g = Histogram::linear("u16", 0.0, 10.0, 5);
        g.add_f64(f64::NAN);
        g.add_f64(-1.0);
        g.add_f64(9.99);
        assert_eq!((g.over, g.under, g.bins[4]), (1, 1, 1));
    }
}

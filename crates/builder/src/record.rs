//! Building one event record from the parts a builder received (super-fragments in push mode,
//! answers in request mode): the checks every part gets, and the sealed record header with its
//! counters. Shared by both modes, so that an event is checked and flagged alike however it came.

use std::sync::atomic::Ordering;

use tessera_format::event::{EventFlags, EventRecordHeader};
use tessera_format::link::Fragments;
use tessera_net::ChunkSlice;

use crate::BuilderStats;

/// An event record being put together.
#[derive(Default)]
pub(crate) struct Record {
    pub flags: u32,
    trigger: Option<u16>,
    timestamp: u64,
    /// Validated fragments, in the order the parts were added (their source IDs are in their
    /// headers: `FragmentHeader::source_id`). Moved out as the record's fragment list as is,
    /// so sealing a record allocates only its header.
    pub fragments: Vec<ChunkSlice>,
}

impl Record {
    /// Adds the `count` fragments packed in `body`. A part that contradicts itself (bad framing,
    /// another event's fragment, a count that differs) is not trusted at all: its fragments are
    /// counted as malformed and `false` is returned, so the caller names its sources missing.
    pub fn add_part(
        &mut self,
        event_id: u64,
        body: &ChunkSlice,
        count: u32,
        st: &BuilderStats,
    ) -> bool {
        // The decoders bound `count` by the part's size; the reservation is bounded again here
        // so that no count from a peer ever sizes an allocation on its own. The fragments go
        // straight into the record and are taken back out if the part fails a check (one
        // allocation per event, not one per part).
        let most = body.len() / tessera_format::wire::FRAGMENT_OVERHEAD;
        let start = self.fragments.len();
        self.fragments.reserve((count as usize).min(most));
        let mut first: Option<(u16, u64)> = None;
        let (mut mismatch, mut status) = (false, false);
        for f in Fragments::new(body) {
            match f {
                Ok(f) if f.header.event_id == event_id => {
                    match first {
                        None => first = Some((f.header.trigger_type, f.header.timestamp)),
                        Some((t, _)) if t != f.header.trigger_type => mismatch = true,
                        _ => {}
                    }
                    status |= f.header.status != 0;
                    self.fragments.push(body.slice(f.start, f.len));
                }
                _ => {
                    self.fragments.truncate(start);
                    st.malformed_fragments
                        .fetch_add(count as u64, Ordering::Relaxed);
                    return false;
                }
            }
        }
        if self.fragments.len() - start != count as usize {
            self.fragments.truncate(start);
            st.malformed_fragments
                .fetch_add(count as u64, Ordering::Relaxed);
            return false;
        }
        if let Some((t, ts)) = first {
            match self.trigger {
                None => {
                    self.trigger = Some(t);
                    self.timestamp = ts;
                }
                Some(mine) if mine != t => mismatch = true,
                _ => {}
            }
        }
        if mismatch {
            self.flags |= EventFlags::TRIGGER_MISMATCH;
        }
        if status {
            self.flags |= EventFlags::FRONT_END_STATUS;
        }
        true
    }

    /// A record with room for `fragments` fragments (the sources an event is expected to hold).
    pub fn with_capacity(fragments: usize) -> Record {
        Record {
            fragments: Vec::with_capacity(fragments),
            ..Record::default()
        }
    }

    /// Seals the record: flags it incomplete if sources are missing (sorted and deduplicated
    /// here), encodes and checksums the header, and counts the event. Returns the header bytes
    /// and the fragments that follow it.
    pub fn finish(
        self,
        event_id: u64,
        builder_id: u16,
        mut missing: Vec<u32>,
        st: &BuilderStats,
    ) -> (Vec<u8>, Vec<ChunkSlice>) {
        let mut flags = self.flags;
        missing.sort_unstable();
        missing.dedup();
        if !missing.is_empty() {
            flags |= EventFlags::INCOMPLETE;
            let mut m = st.missing_by_source.lock();
            for s in &missing {
                *m.entry(*s).or_default() += 1;
            }
            drop(m);
            st.recent_incomplete.lock().push(event_id, &missing);
        }
        let fragments = self.fragments;
        let body: usize = fragments.iter().map(|f| f.len()).sum();
        let mut h = EventRecordHeader {
            flags: EventFlags(flags),
            event_id,
            timestamp: self.timestamp,
            trigger_type: self.trigger.unwrap_or(0),
            builder_id,
            fragment_count: fragments.len() as u32,
            record_size: 0,
            missing,
            checksum: 0,
        };
        h.record_size = (h.header_size() + body) as u32;
        let mut header = Vec::with_capacity(h.header_size());
        h.encode_into(&mut header);
        let crc = EventRecordHeader::checksum_over(&header, fragments.iter().map(|f| &f[..]));
        EventRecordHeader::seal(&mut header, crc);
        let nf = fragments.len() as u64;
        if flags & EventFlags::INCOMPLETE != 0 {
            st.events_incomplete.fetch_add(1, Ordering::Relaxed);
            st.fragments_in_incomplete.fetch_add(nf, Ordering::Relaxed);
        } else {
            st.events_complete.fetch_add(1, Ordering::Relaxed);
            st.fragments_in_complete.fetch_add(nf, Ordering::Relaxed);
        }
        st.bytes_built
            .fetch_add(h.record_size as u64, Ordering::Relaxed);
        st.last_event.store(event_id, Ordering::Relaxed);
        (header, fragments)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_format::event::EventFlags;
    use tessera_format::wire::{encode_fragment, FragmentHeader};

    /// Packed fragments of `event` from `sources`, each with `trigger`; one fragment of
    /// `stray_event` in place `stray` if given.
    fn part(event: u64, sources: &[u32], trigger: u16, stray: Option<(usize, u64)>) -> ChunkSlice {
        let mut body = Vec::new();
        for (i, &s) in sources.iter().enumerate() {
            let ev = match stray {
                Some((at, other)) if at == i => other,
                _ => event,
            };
            let h = FragmentHeader {
                status: 0,
                source_id: s,
                trigger_type: trigger,
                event_id: ev,
                timestamp: 7,
                payload_size: 0,
            };
            encode_fragment(&mut body, &h, &[s as u8; 40]);
        }
        ChunkSlice::copy_from(&body)
    }

    fn stats() -> BuilderStats {
        BuilderStats::new(0, [0u32, 1].into_iter(), 1 << 20, 1)
    }

    /// A part that contradicts itself half-way leaves nothing of itself in the record (its
    /// good fragments before the bad one included) and is counted whole as malformed; the parts
    /// before it stay.
    #[test]
    fn a_part_that_fails_half_way_leaves_nothing_behind() {
        let st = stats();
        let mut r = Record::with_capacity(6);
        assert!(r.add_part(5, &part(5, &[0, 1, 2], 1, None), 3, &st));
        assert!(!r.add_part(5, &part(5, &[3, 4, 5], 2, Some((2, 6))), 3, &st));
        assert_eq!(
            r.fragments
                .iter()
                .map(|f| FragmentHeader::source_id(f))
                .collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        assert_eq!(st.malformed_fragments.load(Ordering::Relaxed), 3);
        // Its trigger type, seen before the bad fragment, flags nothing.
        assert_eq!(r.flags & EventFlags::TRIGGER_MISMATCH, 0);
        // A count that differs from what the part holds: the same.
        assert!(!r.add_part(5, &part(5, &[3, 4], 1, None), 3, &st));
        assert_eq!(r.fragments.len(), 3);
        assert_eq!(st.malformed_fragments.load(Ordering::Relaxed), 6);
        // A good part with another trigger type flags the mismatch.
        assert!(r.add_part(5, &part(5, &[3, 4], 2, None), 2, &st));
        assert_eq!(r.fragments.len(), 5);
        assert_ne!(r.flags & EventFlags::TRIGGER_MISMATCH, 0);
    }

    /// A mismatch inside one part is flagged as well as one across parts.
    #[test]
    fn a_trigger_mismatch_inside_one_part_is_flagged() {
        let st = stats();
        let mut body = Vec::new();
        for (s, t) in [(0u32, 1u16), (1, 3)] {
            let h = FragmentHeader {
                status: 0,
                source_id: s,
                trigger_type: t,
                event_id: 9,
                timestamp: 1,
                payload_size: 0,
            };
            encode_fragment(&mut body, &h, &[0; 8]);
        }
        let mut r = Record::default();
        assert!(r.add_part(9, &ChunkSlice::copy_from(&body), 2, &st));
        assert_ne!(r.flags & EventFlags::TRIGGER_MISMATCH, 0);
        assert_eq!(r.trigger, Some(1));
    }
}

//! Building one event record from the parts a builder received (super-fragments in push mode,
//! answers in request mode): the checks every part gets, and the sealed record header with its
//! counters. Shared by both modes, so that an event is checked and flagged alike however it came.

use std::sync::atomic::Ordering;

use tessera_format::event::{EventFlags, EventRecordHeader, TrailerCrcs};
use tessera_format::link::Fragments;
use tessera_net::ChunkSlice;

use crate::BuilderStats;

/// An event record's header, inline up to 64 bytes (every complete event's 48, and an
/// incomplete one missing up to four sources): one allocation and one cross-thread free less
/// per event than a vector (`bench instructions`, docs/PERFORMANCE.md).
pub(crate) type HeaderBytes = smallvec::SmallVec<[u8; 64]>;

/// What follows a record's header: inline up to four pieces (a push-mode record of up to four
/// readout units needs no allocation of its own; larger ones, and request-mode records of a
/// piece per fragment, spill to the heap as a vector would).
pub(crate) type Pieces = smallvec::SmallVec<[ChunkSlice; 4]>;

/// An event record being put together.
#[derive(Default)]
pub(crate) struct Record {
    pub flags: u32,
    trigger: Option<u16>,
    timestamp: u64,
    /// What follows the header, in order: validated fragments (their source IDs are in their
    /// headers: `FragmentHeader::source_id`), or, for a record of checked parts
    /// ([`Self::of_parts`]), each part's packed fragments as one piece (the same bytes). Moved
    /// out as the record's list as is: sealing a record allocates nothing more (inline up to
    /// four pieces, see [`Pieces`]).
    pub fragments: Pieces,
    /// Fragments in `fragments`.
    count: u32,
    /// For a record of checked parts: their trailer CRCs, gathered as each part was read.
    trailers: Option<TrailerCrcs>,
}

/// What a part's fragments say, found by one walk while the part is read (its bytes just copied
/// in by the kernel, hot in cache), so that sealing its event, which can come much later when
/// the event's last part arrives, reads no fragment byte: each read there was a cache miss
/// (`link::Fragments::next` was 3.6 % of a 1 KiB x 8 build, docs/PERFORMANCE.md, session 23).
#[derive(Clone, Copy, Debug)]
pub(crate) struct PartCheck {
    /// The part is whole and its own: every fragment framed, of its event, as many as it says.
    ok: bool,
    /// The first fragment's trigger type and timestamp.
    first: Option<(u16, u64)>,
    /// Its fragments disagree on the trigger type.
    mismatch: bool,
    /// A fragment's front end reported a non-zero status.
    status: bool,
    trailers: TrailerCrcs,
}

impl PartCheck {
    /// Walks the `count` fragments packed in `body`, a part of event `event_id`.
    pub fn of(event_id: u64, body: &[u8], count: u32) -> PartCheck {
        let mut c = PartCheck {
            ok: false,
            first: None,
            mismatch: false,
            status: false,
            trailers: TrailerCrcs::default(),
        };
        let mut gather = TrailerCrcs::gather();
        for f in Fragments::new(body) {
            match f {
                Ok(f) if f.header.event_id == event_id => {
                    match c.first {
                        None => c.first = Some((f.header.trigger_type, f.header.timestamp)),
                        Some((t, _)) if t != f.header.trigger_type => c.mismatch = true,
                        _ => {}
                    }
                    c.status |= f.header.status != 0;
                    gather.add_fragment(&body[f.start..f.start + f.len]);
                }
                _ => return c,
            }
        }
        c.trailers = gather.finish();
        c.ok = c.trailers.count == count as u64;
        c
    }
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
        self.count += count;
        self.agree(first, mismatch, status);
        true
    }

    /// Adds a part of `count` fragments whose walk, `check`, was made when it was read (see
    /// [`PartCheck`]): its packed fragments go into the record as one piece. A part that
    /// contradicts itself is not trusted at all, as in [`Self::add_part`].
    pub fn add_checked(
        &mut self,
        body: ChunkSlice,
        check: &PartCheck,
        count: u32,
        st: &BuilderStats,
    ) -> bool {
        debug_assert!(self.trailers.is_some(), "a record of checked parts");
        if !check.ok {
            st.malformed_fragments
                .fetch_add(count as u64, Ordering::Relaxed);
            return false;
        }
        if count > 0 {
            self.fragments.push(body);
        }
        self.count += count;
        self.trailers = self.trailers.map(|t| t.then(check.trailers));
        self.agree(check.first, check.mismatch, check.status);
        true
    }

    /// Takes in a part's trigger type and flags.
    fn agree(&mut self, first: Option<(u16, u64)>, mut mismatch: bool, status: bool) {
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
    }

    /// A record of checked parts ([`Self::add_checked`]), with room for `parts` of them.
    pub fn of_parts(parts: usize) -> Record {
        Record {
            fragments: Pieces::with_capacity(parts),
            trailers: Some(TrailerCrcs::default()),
            ..Record::default()
        }
    }

    /// Seals the record: flags it incomplete if sources are missing (sorted and deduplicated
    /// here), encodes and checksums the header, and counts the event. Returns the header bytes
    /// and the pieces that follow it (see [`Self::fragments`]) with their fragment count.
    pub fn finish(
        self,
        event_id: u64,
        builder_id: u16,
        mut missing: Vec<u32>,
        st: &BuilderStats,
    ) -> (HeaderBytes, Pieces, u32) {
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
        let count = self.count;
        let body: usize = fragments.iter().map(|f| f.len()).sum();
        let mut h = EventRecordHeader {
            flags: EventFlags(flags),
            event_id,
            timestamp: self.timestamp,
            trigger_type: self.trigger.unwrap_or(0),
            builder_id,
            fragment_count: count,
            record_size: 0,
            missing,
            checksum: 0,
        };
        h.record_size = (h.header_size() + body) as u32;
        let mut header = HeaderBytes::from_elem(0, h.header_size());
        h.encode_to(&mut header);
        let crc = match self.trailers {
            Some(t) => t.checksum(&header),
            None => EventRecordHeader::checksum_over(&header, fragments.iter().map(|f| &f[..])),
        };
        EventRecordHeader::seal(&mut header, crc);
        let nf = count as u64;
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
        (header, fragments, count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_format::event::{EventFlags, EVENT_HEADER_SIZE};
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

    /// A record of fragments (request mode) or of checked parts (push mode).
    #[derive(Clone, Copy, Debug)]
    enum Kind {
        Fragments,
        Parts,
    }

    impl Kind {
        fn record(self) -> Record {
            match self {
                Kind::Fragments => Record::default(),
                Kind::Parts => Record::of_parts(4),
            }
        }

        fn add(
            self,
            r: &mut Record,
            event: u64,
            body: ChunkSlice,
            count: u32,
            st: &BuilderStats,
        ) -> bool {
            match self {
                Kind::Fragments => r.add_part(event, &body, count, st),
                Kind::Parts => {
                    let check = PartCheck::of(event, &body, count);
                    r.add_checked(body, &check, count, st)
                }
            }
        }
    }

    /// Source IDs of the fragments in a record's pieces.
    fn sources(r: &Record) -> Vec<u32> {
        r.fragments
            .iter()
            .flat_map(|p| {
                Fragments::new(p).map(|f| FragmentHeader::source_id(&p[f.unwrap().start..]))
            })
            .collect()
    }

    /// A part that contradicts itself half-way leaves nothing of itself in the record (its
    /// good fragments before the bad one included) and is counted whole as malformed; the parts
    /// before it stay. Alike whether the part was walked when added or when read.
    #[test]
    fn a_part_that_fails_half_way_leaves_nothing_behind() {
        for kind in [Kind::Fragments, Kind::Parts] {
            let st = stats();
            let mut r = kind.record();
            assert!(kind.add(&mut r, 5, part(5, &[0, 1, 2], 1, None), 3, &st));
            assert!(!kind.add(&mut r, 5, part(5, &[3, 4, 5], 2, Some((2, 6))), 3, &st));
            assert_eq!(sources(&r), vec![0, 1, 2], "{kind:?}");
            assert_eq!(r.count, 3);
            assert_eq!(st.malformed_fragments.load(Ordering::Relaxed), 3);
            // Its trigger type, seen before the bad fragment, flags nothing.
            assert_eq!(r.flags & EventFlags::TRIGGER_MISMATCH, 0);
            // A count that differs from what the part holds: the same.
            assert!(!kind.add(&mut r, 5, part(5, &[3, 4], 1, None), 3, &st));
            assert_eq!(r.count, 3);
            assert_eq!(st.malformed_fragments.load(Ordering::Relaxed), 6);
            // A good part with another trigger type flags the mismatch.
            assert!(kind.add(&mut r, 5, part(5, &[3, 4], 2, None), 2, &st));
            assert_eq!(sources(&r), vec![0, 1, 2, 3, 4], "{kind:?}");
            assert_eq!(r.count, 5);
            assert_ne!(r.flags & EventFlags::TRIGGER_MISMATCH, 0);
        }
    }

    /// A mismatch inside one part is flagged as well as one across parts.
    #[test]
    fn a_trigger_mismatch_inside_one_part_is_flagged() {
        for kind in [Kind::Fragments, Kind::Parts] {
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
            let mut r = kind.record();
            assert!(kind.add(&mut r, 9, ChunkSlice::copy_from(&body), 2, &st));
            assert_ne!(r.flags & EventFlags::TRIGGER_MISMATCH, 0, "{kind:?}");
            assert_eq!(r.trigger, Some(1));
        }
    }

    /// A record of parts checked when they were read seals to the same bytes as the record of
    /// their fragments walked when sealing: header, checksum and body, with a part refused and
    /// one empty between.
    #[test]
    fn checked_parts_seal_to_the_same_record_as_walked_fragments() {
        let parts = [
            (part(8, &[0, 1, 2], 4, None), 3),
            (part(8, &[3], 4, Some((0, 9))), 1),
            (part(8, &[], 4, None), 0),
            (part(8, &(4..40).collect::<Vec<_>>(), 4, None), 36),
        ];
        let sealed: Vec<(Vec<u8>, Vec<u8>, u32)> = [Kind::Fragments, Kind::Parts]
            .into_iter()
            .map(|kind| {
                let st = stats();
                let mut r = kind.record();
                for (body, count) in &parts {
                    kind.add(&mut r, 8, body.clone(), *count, &st);
                }
                let (header, pieces, count) = r.finish(8, 1, vec![3], &st);
                (
                    header.to_vec(),
                    pieces.iter().flat_map(|p| p.to_vec()).collect(),
                    count,
                )
            })
            .collect();
        assert_eq!(sealed[0], sealed[1]);
        assert_eq!(sealed[0].2, 39);
        // And that record is right by the format's own definition.
        let (header, body, _) = &sealed[1];
        let mut record = header.clone();
        record.extend_from_slice(body);
        let (h, size) = EventRecordHeader::decode_prefix(&record, usize::MAX)
            .unwrap()
            .unwrap();
        assert_eq!(
            (size, h.fragment_count, h.missing),
            (record.len(), 39, vec![3])
        );
        let fragments = Fragments::new(body).map(|f| {
            let f = f.unwrap();
            &body[f.start..f.start + f.len]
        });
        assert_eq!(
            h.checksum,
            EventRecordHeader::checksum_over(header, fragments)
        );
    }

    #[test]
    fn headers_of_any_length_seal_whole_inline_or_not() {
        // 0 and 4 missing sources fit the inline 64 bytes; 5 and 300 do not.
        for n in [0u32, 4, 5, 300] {
            let st = stats();
            let missing: Vec<u32> = (0..n).map(|i| i * 7).collect();
            let (header, pieces, count) = Record::default().finish(11, 2, missing.clone(), &st);
            assert!(pieces.is_empty() && count == 0);
            assert_eq!(header.len(), EVENT_HEADER_SIZE + 4 * n as usize);
            let (h, size) = EventRecordHeader::decode_prefix(&header, usize::MAX)
                .unwrap()
                .unwrap();
            assert_eq!((size, h.event_id, h.missing), (header.len(), 11, missing));
            assert_eq!(
                h.checksum,
                EventRecordHeader::checksum_over(&header, std::iter::empty())
            );
        }
    }
}

//! Pending data requests of request mode (issue 3; ATLAS ROS, seeds/004 §5.3 and §6.2): a builder
//! asks a readout unit for one event's fragments from all links or a listed subset (RoI). The
//! unit answers at once when it has them; otherwise the request waits in one of a fixed number of
//! descriptors until the missing fragments arrive, or until every link it still waits for has
//! been silent for its timeout, and is then answered with what there is plus the list of links
//! still missing. A link that keeps delivering, however far behind, is waited for: dead time,
//! never a fragment lost. With every descriptor in use, new requests
//! are not taken (the caller stops reading requests: back-pressure), never queued without bound.
//!
//! A link that reports a later event than one a request waits for has skipped it (its source
//! sends in ascending order, wire-format §1.6): the request stops waiting for that link, which is
//! answered missing at once instead of at the timeout; so is a link whose connection ended.
//!
//! A link counts as holding an event only once its arrival was reported ([`RequestTable::arrived`]),
//! never from the pages alone: a link's reader stores a batch before it reports it, and a request
//! found ready in the pages while a lower one still waited for that batch's report was answered
//! first. Since each link reports its events in ascending order and a builder asks in ascending
//! order, each builder's answers then leave in ascending event-ID order (request-protocol §4.3). A builder that reads only a few
//! answers ahead per unit relies on that order: answered as they became ready, two units sent
//! their common events in different orders, and the builder's links filled with halves of
//! different events.
//!
//! Pure state machine: the caller says which links hold the event (`have`), when fragments arrive
//! and what time it is; no I/O, no clock. Request mode (`serve.rs`) keeps one per unit.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// A builder's request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Identifies the request to its builder (echoed in the answer).
    pub tag: u64,
    pub builder: u32,
    pub event_id: u64,
    /// Link indices asked for, ascending and distinct.
    pub links: Vec<usize>,
}

/// What to send back for a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    pub request: Request,
    /// Requested links that have no fragment for the event: skipped, or still absent at the
    /// timeout. Ascending.
    pub missing: Vec<usize>,
}

/// What became of a new request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Submit {
    /// Every requested link holds the event: answer now.
    Ready(Answer),
    /// Waiting in a descriptor.
    Pending,
    /// Every descriptor is in use: the request is handed back, to be submitted again after
    /// answers free descriptors.
    NoDescriptor(Request),
}

/// What a link's reads have proven about its source: every read from `since_ns` to `until_ns`
/// found nothing (`until_ns`: when the latest of them began). A link proven silent for a
/// request's timeout is answered missing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Silent {
    pub since_ns: u64,
    pub until_ns: u64,
}

/// How soon a request is looked at again once its links' silence has lasted the timeout by the
/// clock but the read that proves it has not come yet: reads of a silent link come back empty
/// every 100 ms at most (their timeout).
const PROOF_LOOK_NS: u64 = 10_000_000;

struct Pending {
    request: Request,
    /// Requested links still without a fragment.
    waiting: Vec<usize>,
    /// Requested links that skipped the event.
    skipped: Vec<usize>,
    deadline_ns: u64,
}

/// The table of pending requests.
pub struct RequestTable {
    capacity: usize,
    timeout_ns: u64,
    next_slot: u64,
    pending: HashMap<u64, Pending>,
    /// Deadlines in order: (deadline, slot).
    deadlines: BTreeMap<(u64, u64), ()>,
    /// Per link, the highest event ID whose arrival was reported (none yet: absent). One entry
    /// per link index the caller reports, so bounded by the unit's links.
    reported: HashMap<usize, u64>,
    /// Per link, the (event ID, slot) of the pending requests waiting for it, so that a report
    /// of a later event finds the requests it skipped. Bounded by the descriptors.
    waits: HashMap<usize, BTreeSet<(u64, u64)>>,
    /// Links whose connection ended: they deliver nothing more.
    closed: BTreeSet<usize>,
}

impl RequestTable {
    /// `capacity` descriptors; requests wait at most `timeout_ns`.
    pub fn new(capacity: usize, timeout_ns: u64) -> RequestTable {
        RequestTable {
            capacity: capacity.max(1),
            timeout_ns,
            next_slot: 0,
            pending: HashMap::new(),
            deadlines: BTreeMap::new(),
            reported: HashMap::new(),
            waits: HashMap::new(),
            closed: BTreeSet::new(),
        }
    }

    pub fn in_use(&self) -> usize {
        self.pending.len()
    }

    pub fn is_full(&self) -> bool {
        self.pending.len() >= self.capacity
    }

    /// Submits a request at `now_ns`; `have(link)` says whether the link holds the event now.
    /// A link that holds it but has not yet reported it ([`RequestTable::arrived`]) is waited
    /// for, so that the answer keeps the order of the reports.
    pub fn submit(
        &mut self,
        request: Request,
        now_ns: u64,
        have: impl Fn(usize) -> bool,
    ) -> Submit {
        let e = request.event_id;
        let (mut waiting, mut skipped) = (Vec::new(), Vec::new());
        for &l in &request.links {
            let closed = self.closed.contains(&l);
            match (self.reported(l, e) || closed, have(l)) {
                (true, true) => {}
                // Reported this event or a later one, and does not hold it: skipped.
                (true, false) => skipped.push(l),
                (false, _) => waiting.push(l),
            }
        }
        if waiting.is_empty() {
            return Submit::Ready(Answer {
                request,
                missing: skipped,
            });
        }
        if self.is_full() {
            return Submit::NoDescriptor(request);
        }
        let slot = self.next_slot;
        self.next_slot += 1;
        let deadline_ns = now_ns.saturating_add(self.timeout_ns);
        self.deadlines.insert((deadline_ns, slot), ());
        for &l in &waiting {
            self.waits.entry(l).or_default().insert((e, slot));
        }
        self.pending.insert(
            slot,
            Pending {
                request,
                waiting,
                skipped,
                deadline_ns,
            },
        );
        Submit::Pending
    }

    /// Whether `link` has reported `event_id` or a later event (serial order over the 64-bit
    /// ring, so that IDs wrapping round stay in order).
    fn reported(&self, link: usize, event_id: u64) -> bool {
        self.reported
            .get(&link)
            .is_some_and(|&r| r.wrapping_sub(event_id) < 1 << 63)
    }

    /// A fragment of `event_id` arrived on `link` (each link's reports in the order it
    /// delivered): returns the requests now complete.
    pub fn arrived(&mut self, event_id: u64, link: usize) -> Vec<Answer> {
        if !self.reported(link, event_id) {
            self.reported.insert(link, event_id);
        }
        let mut done = Vec::new();
        if let Some(waits) = self.waits.get_mut(&link) {
            // The requests for this event, and those for every event the link skipped: those
            // serially below it, at most half the ring back.
            let e = event_id;
            let mut hit: Vec<(u64, u64)> = if e >= 1 << 63 {
                waits
                    .range((e - (1 << 63), 0)..=(e, u64::MAX))
                    .copied()
                    .collect()
            } else {
                waits
                    .range(..=(e, u64::MAX))
                    .chain(waits.range((e + (1 << 63), 0)..))
                    .copied()
                    .collect()
            };
            // In the order of their event IDs, so that answers keep it.
            hit.sort_unstable_by_key(|&(x, slot)| (x.wrapping_sub(e) as i64, slot));
            for (x, slot) in hit {
                waits.remove(&(x, slot));
                let p = self
                    .pending
                    .get_mut(&slot)
                    .expect("a waiting slot is pending");
                p.waiting.retain(|&l| l != link);
                if x != e {
                    p.skipped.push(link);
                }
                if p.waiting.is_empty() {
                    done.push(slot);
                }
            }
        }
        done.into_iter().map(|slot| self.finish(slot)).collect()
    }

    /// Requests whose deadline passed by `now_ns` and whose every awaited link has been proven
    /// silent for the timeout, answered with their missing links. `silent(link)`: what the
    /// link's reads have proven ([`Silent`]); `None` while it delivers, or is held by the unit
    /// (pages full, throttled), which proves nothing. A request waiting for a link that is not
    /// proven silent waits on and is looked at again later: a source that runs behind the others
    /// but keeps delivering costs time, never its fragments (it used to be answered missing at
    /// the timeout, and its fragments came late to be rejected). The proof is the reads' and
    /// never the clock's: time in which the unit did not read the link (the unit stalled, its
    /// reader starved of a core) proves nothing about the source.
    pub fn expire(&mut self, now_ns: u64, silent: impl Fn(usize) -> Option<Silent>) -> Vec<Answer> {
        let due: Vec<u64> = self
            .deadlines
            .range(..(now_ns.saturating_add(1), 0))
            .map(|(&(_, slot), _)| slot)
            .collect();
        let t = self.timeout_ns;
        let mut answers = Vec::new();
        for slot in due {
            let Some(p) = self.pending.get_mut(&slot) else {
                continue;
            };
            // When the last awaited link not yet proven silent for the timeout is next worth
            // a look: a timeout from now while it delivers; a timeout after its silence began,
            // or soon when that has passed and only the read that proves it is still to come.
            let again = p
                .waiting
                .iter()
                .filter_map(|&l| match silent(l) {
                    Some(q) if q.until_ns.saturating_sub(q.since_ns) >= t => None,
                    Some(q) => Some(match q.since_ns.saturating_add(t) {
                        at if at > now_ns => at,
                        _ => now_ns.saturating_add(t.min(PROOF_LOOK_NS)),
                    }),
                    None => Some(now_ns.saturating_add(t)),
                })
                .max();
            match again {
                None => answers.push(self.finish(slot)),
                Some(d) => {
                    self.deadlines.remove(&(p.deadline_ns, slot));
                    p.deadline_ns = d;
                    self.deadlines.insert((d, slot), ());
                }
            }
        }
        answers
    }

    /// Answers every pending request with what there is, silent or not: the run is over.
    pub fn expire_all(&mut self) -> Vec<Answer> {
        let all: Vec<u64> = self.deadlines.keys().map(|&(_, slot)| slot).collect();
        all.into_iter().map(|slot| self.finish(slot)).collect()
    }

    /// Link `link`'s connection ended, everything it delivered reported: the requests waiting for
    /// it are answered naming it missing (those waiting for nothing else: returned), and so are
    /// later ones. Without this every event after a source died waited for the request timeout,
    /// and a run went at one round of credits per timeout (25 events/s).
    pub fn link_closed(&mut self, link: usize) -> Vec<Answer> {
        self.closed.insert(link);
        let mut done = Vec::new();
        let waits = self.waits.remove(&link).unwrap_or_default();
        for (_, slot) in waits {
            let p = self
                .pending
                .get_mut(&slot)
                .expect("a waiting slot is pending");
            p.waiting.retain(|&l| l != link);
            p.skipped.push(link);
            if p.waiting.is_empty() {
                done.push(slot);
            }
        }
        done.into_iter().map(|slot| self.finish(slot)).collect()
    }

    /// Whether some pending request waits for `link`.
    pub fn waits_for(&self, link: usize) -> bool {
        self.waits.get(&link).is_some_and(|w| !w.is_empty())
    }

    /// When the next request times out, if any.
    pub fn next_deadline(&self) -> Option<u64> {
        self.deadlines.keys().next().map(|&(d, _)| d)
    }

    fn finish(&mut self, slot: u64) -> Answer {
        let p = self
            .pending
            .remove(&slot)
            .expect("finishing a pending slot");
        self.deadlines.remove(&(p.deadline_ns, slot));
        let e = p.request.event_id;
        for l in &p.waiting {
            if let Some(w) = self.waits.get_mut(l) {
                w.remove(&(e, slot));
            }
        }
        let mut missing = p.waiting;
        missing.extend(p.skipped);
        missing.sort_unstable();
        Answer {
            request: p.request,
            missing,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    fn req(tag: u64, event_id: u64, links: &[usize]) -> Request {
        Request {
            tag,
            builder: 0,
            event_id,
            links: links.to_vec(),
        }
    }

    #[test]
    fn answers_at_once_when_data_is_there() {
        let mut t = RequestTable::new(4, 1000);
        t.arrived(5, 0);
        t.arrived(5, 2);
        assert_eq!(
            t.submit(req(1, 5, &[0, 2]), 0, |_| true),
            Submit::Ready(Answer {
                request: req(1, 5, &[0, 2]),
                missing: vec![]
            })
        );
        assert_eq!(t.in_use(), 0);
    }

    #[test]
    fn pending_until_the_data_arrives() {
        let mut t = RequestTable::new(4, 1000);
        t.arrived(5, 1);
        assert_eq!(
            t.submit(req(1, 5, &[0, 1, 2]), 0, |l| l == 1),
            Submit::Pending
        );
        assert!(t.arrived(5, 0).is_empty());
        assert!(
            t.arrived(4, 2).is_empty(),
            "another event's fragment completes nothing"
        );
        let done = t.arrived(5, 2);
        assert_eq!(
            done,
            vec![Answer {
                request: req(1, 5, &[0, 1, 2]),
                missing: vec![]
            }]
        );
        assert_eq!(t.in_use(), 0);
        assert!(t.expire(10_000, |_| quiet(0, 10_000)).is_empty());
    }

    #[test]
    fn timeout_answers_with_exactly_the_missing_links() {
        let mut t = RequestTable::new(4, 1000);
        t.arrived(5, 0);
        t.submit(req(1, 5, &[0, 1, 2, 3]), 100, |l| l == 0);
        t.arrived(5, 2);
        assert!(t.expire(1099, |_| quiet(0, 1099)).is_empty());
        assert_eq!(t.next_deadline(), Some(1100));
        assert_eq!(
            t.expire(1100, |_| quiet(0, 1100)),
            vec![Answer {
                request: req(1, 5, &[0, 1, 2, 3]),
                missing: vec![1, 3]
            }]
        );
    }

    #[test]
    fn a_link_that_keeps_delivering_is_waited_for_past_the_timeout() {
        let mut t = RequestTable::new(4, 1000);
        t.submit(req(1, 5, &[0, 1]), 0, |_| false);
        t.arrived(5, 0);
        // Link 1 delivers (earlier events) or is held by the unit: no silence, no answer.
        assert!(t.expire(1000, |_| None).is_empty());
        assert_eq!(
            t.next_deadline(),
            Some(2000),
            "looked at again a timeout later"
        );
        assert!(t.expire(5000, |_| None).is_empty());
        assert_eq!(t.in_use(), 1);
        // Then it goes silent at 5 500: given up a whole timeout after that, not before.
        let silent = |now: u64| move |l: usize| if l == 1 { quiet(5500, now) } else { None };
        assert!(t.expire(6000, silent(6000)).is_empty());
        assert_eq!(t.next_deadline(), Some(6500));
        assert!(t.expire(6499, silent(6499)).is_empty());
        assert_eq!(
            t.expire(6500, silent(6500)),
            vec![Answer {
                request: req(1, 5, &[0, 1]),
                missing: vec![1]
            }]
        );
        assert_eq!(t.in_use(), 0);
    }

    /// A silence proven by reads from `since` to `until`.
    fn quiet(since: u64, until: u64) -> Option<Silent> {
        Some(Silent {
            since_ns: since,
            until_ns: until,
        })
    }

    /// The unit stalled (SIGSTOP, a starved process) with the link last read empty 300 ns into
    /// a silence: by the clock the silence has lasted past the timeout, but nothing read proves
    /// it, and the source may well have sent during the stall. Only a read that finds the link
    /// still empty a timeout after the silence began proves it.
    #[test]
    fn a_stall_of_the_unit_proves_no_silence_of_its_links() {
        let mut t = RequestTable::new(4, 1000);
        t.submit(req(1, 5, &[0, 1]), 0, |_| false);
        t.arrived(5, 0);
        let before_the_stall = |l: usize| if l == 1 { quiet(0, 300) } else { None };
        assert!(t.expire(5000, before_the_stall).is_empty());
        assert_eq!(t.in_use(), 1);
        assert!(
            t.next_deadline().is_some_and(|d| d > 5000),
            "looked at again once a read may have proven it"
        );
        // The link's first read after the stall brings the fragment: answered whole.
        assert_eq!(
            t.arrived(5, 1),
            vec![Answer {
                request: req(1, 5, &[0, 1]),
                missing: vec![]
            }]
        );
        // Had that read found the link still empty, the silence is proven: answered missing.
        t.submit(req(2, 6, &[0, 1]), 5000, |_| false);
        t.arrived(6, 0);
        assert!(t
            .expire(6000, |l| if l == 1 { quiet(0, 300) } else { None })
            .is_empty());
        assert_eq!(
            t.expire(7000, |l| if l == 1 { quiet(0, 6005) } else { None }),
            vec![Answer {
                request: req(2, 6, &[0, 1]),
                missing: vec![1]
            }]
        );
    }

    #[test]
    fn a_late_fragment_of_a_link_waited_for_completes_the_request() {
        let mut t = RequestTable::new(4, 1000);
        t.submit(req(1, 5, &[0]), 0, |_| false);
        assert!(t.expire(3000, |_| None).is_empty());
        assert_eq!(
            t.arrived(5, 0),
            vec![Answer {
                request: req(1, 5, &[0]),
                missing: vec![]
            }]
        );
        assert_eq!(t.next_deadline(), None);
        assert!(t.expire_all().is_empty());
    }

    #[test]
    fn descriptor_exhaustion_hands_requests_back() {
        let mut t = RequestTable::new(2, 1000);
        assert_eq!(t.submit(req(1, 1, &[0]), 0, |_| false), Submit::Pending);
        assert_eq!(t.submit(req(2, 2, &[0]), 0, |_| false), Submit::Pending);
        assert_eq!(
            t.submit(req(3, 3, &[0]), 0, |_| false),
            Submit::NoDescriptor(req(3, 3, &[0]))
        );
        // Answers that need no descriptor still go through.
        t.arrived(4, 1);
        assert!(matches!(
            t.submit(req(4, 4, &[1]), 0, |_| true),
            Submit::Ready(_)
        ));
        t.arrived(1, 0);
        assert_eq!(t.submit(req(3, 3, &[0]), 0, |_| false), Submit::Pending);
    }

    #[test]
    fn a_link_that_delivers_a_later_event_is_answered_missing_at_once() {
        let mut t = RequestTable::new(4, 1000);
        t.arrived(4, 0);
        t.arrived(4, 1);
        assert_eq!(t.submit(req(1, 5, &[0, 1]), 0, |_| false), Submit::Pending);
        assert_eq!(t.submit(req(2, 6, &[0, 1]), 0, |_| false), Submit::Pending);
        t.arrived(5, 0);
        // Link 1 skips 5: request 1 is answered naming it, without waiting for the timeout.
        let out = t.arrived(6, 1);
        assert_eq!(
            out,
            vec![Answer {
                request: req(1, 5, &[0, 1]),
                missing: vec![1]
            }]
        );
        assert_eq!(t.arrived(6, 0).len(), 1);
        assert_eq!(t.in_use(), 0);
        // Asked after the link moved past it: missing at once.
        assert_eq!(
            t.submit(req(3, 5, &[0, 1]), 0, |l| l == 0),
            Submit::Ready(Answer {
                request: req(3, 5, &[0, 1]),
                missing: vec![1]
            })
        );
    }

    #[test]
    fn a_closed_link_is_answered_missing_at_once() {
        let mut t = RequestTable::new(4, 1000);
        t.arrived(4, 0);
        assert_eq!(t.submit(req(1, 5, &[0, 1]), 0, |_| false), Submit::Pending);
        assert_eq!(t.submit(req(2, 4, &[0, 1]), 0, |l| l == 0), Submit::Pending);
        t.arrived(5, 0);
        let out = t.link_closed(1);
        assert_eq!(out.len(), 2);
        assert!(out.iter().all(|a| a.missing == [1]), "{out:?}");
        assert_eq!(t.in_use(), 0);
        assert_eq!(
            t.submit(req(3, 6, &[0, 1]), 0, |_| false),
            Submit::Pending,
            "link 0 may still deliver 6"
        );
        let out = t.arrived(6, 0);
        assert_eq!(out[0].missing, [1]);
    }

    /// The race the reports close: link 1 stored events 5 and 6 together but has not reported
    /// them yet when the requests come. Found ready in the pages, 6 was answered at once while 5
    /// waited for link 1's report, and the builder got 6 before 5 from this unit only.
    #[test]
    fn a_request_waits_for_the_report_of_what_the_pages_already_hold() {
        let mut t = RequestTable::new(4, 1000);
        for e in [5, 6] {
            t.arrived(e, 0);
        }
        // Link 1 holds 5 and 6 (stored), reported nothing yet.
        assert_eq!(t.submit(req(1, 5, &[0, 1]), 0, |_| true), Submit::Pending);
        assert_eq!(t.submit(req(2, 6, &[0, 1]), 0, |_| true), Submit::Pending);
        let tags: Vec<u64> = [5, 6]
            .into_iter()
            .flat_map(|e| t.arrived(e, 1))
            .map(|a| a.request.tag)
            .collect();
        assert_eq!(tags, [1, 2]);
        // A link that reported a later event has reported this one too (or skipped it).
        assert!(matches!(
            t.submit(req(3, 4, &[0, 1]), 0, |_| true),
            Submit::Ready(_)
        ));
        // Event IDs wrapping round stay in order.
        t.arrived(u64::MAX, 2);
        assert_eq!(t.submit(req(4, 0, &[2]), 0, |_| true), Submit::Pending);
        t.arrived(0, 2);
        assert!(matches!(
            t.submit(req(5, u64::MAX - 1, &[2]), 0, |_| true),
            Submit::Ready(_)
        ));
    }

    proptest! {
        /// Links store events in ascending order and report what they stored later, in the same
        /// order; two builders ask for ascending events. Each builder's answers leave in
        /// ascending event-ID order, however stores, reports and requests interleave.
        #[test]
        fn each_builders_answers_leave_in_event_id_order(ops in proptest::collection::vec(0u8..7, 0..200)) {
            const LINKS: usize = 3;
            const EVENTS: u64 = 12;
            let mut t = RequestTable::new(64, u64::MAX / 2);
            let mut stored = [0u64; LINKS];
            let mut reported = [0u64; LINKS];
            let mut asked = [0u64; 2];
            let mut last: [Option<u64>; 2] = [None; 2];
            let mut tag = 0u64;
            let check = |out: Vec<Answer>, last: &mut [Option<u64>; 2]| -> Result<(), TestCaseError> {
                for a in out {
                    let b = a.request.builder as usize;
                    prop_assert!(last[b].is_none_or(|l| l < a.request.event_id), "builder {} got {} after {:?}", b, a.request.event_id, last[b]);
                    last[b] = Some(a.request.event_id);
                }
                Ok(())
            };
            for op in ops {
                match op {
                    // A link stores its next event (not reported yet).
                    0..=2 => {
                        let l = op as usize;
                        stored[l] = (stored[l] + 1).min(EVENTS);
                    }
                    // A link reports everything it stored.
                    3..=4 => {
                        let l = (op - 3) as usize * 2;
                        for e in reported[l]..stored[l] {
                            check(t.arrived(e, l), &mut last)?;
                        }
                        reported[l] = stored[l];
                    }
                    // A builder asks for its next event (builder 0 the even, 1 the odd ones).
                    _ => {
                        let b = (op - 5) as usize;
                        let e = asked[b] * 2 + b as u64;
                        if e >= EVENTS { continue; }
                        asked[b] += 1;
                        tag += 1;
                        let r = Request { tag, builder: b as u32, event_id: e, links: (0..LINKS).collect() };
                        let s = t.submit(r, 0, |l| e < stored[l]);
                        if let Submit::Ready(a) = s { check(vec![a], &mut last)?; }
                    }
                }
                // Link 1 reports as it stores (its own reader, never behind).
                for e in reported[1]..stored[1] {
                    check(t.arrived(e, 1), &mut last)?;
                }
                reported[1] = stored[1];
            }
        }

        /// Links deliver in ascending order, skipping some events. Every accepted request is
        /// answered exactly once, and an answer names as missing exactly the requested links
        /// whose fragment had not arrived (never one that came after: a link that skipped an
        /// event does not deliver it later).
        #[test]
        fn every_request_answered_once(ops in proptest::collection::vec(prop_oneof![
            2 => (0u64..10, proptest::collection::btree_set(0usize..4, 1..4)).prop_map(|(e, l)| (0u8, e, l.into_iter().collect::<Vec<_>>())),
            // A link delivers its next event, having skipped 0 to 2 before it.
            3 => (0u64..3, 0usize..4).prop_map(|(skip, l)| (1u8, skip, vec![l])),
            1 => (0u64..6).prop_map(|d| (2u8, d, vec![])),
        ], 0..150)) {
            let mut t = RequestTable::new(5, 50);
            let mut now = 0u64;
            let mut present: HashSet<(u64, usize)> = HashSet::new();
            let mut accepted: HashSet<u64> = HashSet::new();
            let mut answered: HashSet<u64> = HashSet::new();
            let mut tag = 0u64;
            let mut next = [0u64; 4];
            let mut check = |a: &Answer, present: &HashSet<(u64, usize)>| -> Result<(), TestCaseError> {
                prop_assert!(answered.insert(a.request.tag), "answered twice");
                let expect: Vec<usize> = a.request.links.iter().copied().filter(|l| !present.contains(&(a.request.event_id, *l))).collect();
                prop_assert_eq!(&a.missing, &expect);
                Ok(())
            };
            for (kind, x, links) in ops {
                match kind {
                    0 => {
                        tag += 1;
                        match t.submit(Request { tag, builder: 0, event_id: x, links }, now, |l| present.contains(&(x, l))) {
                            Submit::Ready(a) => { accepted.insert(tag); check(&a, &present)?; }
                            Submit::Pending => { accepted.insert(tag); }
                            Submit::NoDescriptor(_) => prop_assert!(t.is_full()),
                        }
                    }
                    1 => {
                        let l = links[0];
                        let e = next[l] + x;
                        next[l] = e + 1;
                        present.insert((e, l));
                        for a in t.arrived(e, l) { check(&a, &present)?; }
                    }
                    _ => {
                        now += x * 10;
                        // Every link silent from the start: the plain timeout.
                        for a in t.expire(now, |_| quiet(0, now)) { check(&a, &present)?; }
                    }
                }
            }
            for a in t.expire_all() { check(&a, &present)?; }
            prop_assert_eq!(accepted, answered);
            prop_assert_eq!(t.in_use(), 0);
        }
    }
}

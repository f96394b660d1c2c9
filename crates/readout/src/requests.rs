//! Pending data requests of request mode (issue 3; ATLAS ROS, seeds/004 §5.3 and §6.2): a builder
//! asks a readout unit for one event's fragments from all links or a listed subset (RoI). The
//! unit answers at once when it has them; otherwise the request waits in one of a fixed number of
//! descriptors until the missing fragments arrive or its timeout passes, and is then answered with
//! what there is plus the list of links still missing. With every descriptor in use, new requests
//! are not taken (the caller stops reading requests: back-pressure), never queued without bound.
//!
//! Each builder's answers leave in ascending event-ID order (request-protocol §4.3): an answer
//! ready while the same builder still waits for a lower event ID is held, in its descriptor, until
//! that one is answered. A builder that reads only a few answers ahead per unit relies on every
//! unit sending their common events in one order; answered as they became ready, two units sent
//! them in different orders and the builder's links filled with halves of different events.
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
    /// Requested links that have no fragment for the event (timed-out requests only).
    pub missing: Vec<usize>,
}

/// What became of a new request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Submit {
    /// Taken: these answers (the request's own if it was ready and nothing lower of its builder
    /// waits, possibly none) are to be sent now, in this order.
    Taken(Vec<Answer>),
    /// Every descriptor is in use: the request is handed back, to be submitted again after
    /// answers free descriptors.
    NoDescriptor(Request),
}

struct Pending {
    request: Request,
    /// Requested links still without a fragment.
    waiting: Vec<usize>,
    deadline_ns: u64,
}

/// One builder's requests in the table, keyed by (event ID, slot): the slot (submission order)
/// orders two requests for one event (the RoI step before the rest).
#[derive(Default)]
struct Queue {
    waiting: BTreeSet<(u64, u64)>,
    /// Answered, held behind a lower event ID still waiting.
    held: BTreeMap<(u64, u64), Answer>,
}

impl Queue {
    /// The held answers no waiting request precedes, in order.
    fn release(&mut self, out: &mut Vec<Answer>) {
        let first = self.waiting.first().copied();
        while let Some(entry) = self.held.first_entry() {
            if first.is_some_and(|w| w < *entry.key()) {
                break;
            }
            out.push(entry.remove());
        }
    }

    fn is_empty(&self) -> bool {
        self.waiting.is_empty() && self.held.is_empty()
    }
}

impl Submit {
    /// The answers to send now (none if the request was handed back).
    pub fn answers(self) -> Vec<Answer> {
        match self {
            Submit::Taken(v) => v,
            Submit::NoDescriptor(_) => Vec::new(),
        }
    }
}

/// The table of pending requests.
pub struct RequestTable {
    capacity: usize,
    timeout_ns: u64,
    next_slot: u64,
    pending: HashMap<u64, Pending>,
    /// Pending slots per event ID, so an arriving fragment finds its requests at once.
    by_event: HashMap<u64, Vec<u64>>,
    /// Deadlines in order: (deadline, slot).
    deadlines: BTreeMap<(u64, u64), ()>,
    queues: HashMap<u32, Queue>,
    /// Answers held in `queues`: each keeps its descriptor.
    held: usize,
}

impl RequestTable {
    /// `capacity` descriptors; requests wait at most `timeout_ns`.
    pub fn new(capacity: usize, timeout_ns: u64) -> RequestTable {
        RequestTable {
            capacity: capacity.max(1),
            timeout_ns,
            next_slot: 0,
            pending: HashMap::new(),
            by_event: HashMap::new(),
            deadlines: BTreeMap::new(),
            queues: HashMap::new(),
            held: 0,
        }
    }

    /// Descriptors in use: requests waiting for fragments and answers held for order.
    pub fn in_use(&self) -> usize {
        self.pending.len() + self.held
    }

    pub fn is_full(&self) -> bool {
        self.in_use() >= self.capacity
    }

    /// Submits a request at `now_ns`; `have(link)` says whether the link holds the event now.
    pub fn submit(
        &mut self,
        request: Request,
        now_ns: u64,
        have: impl Fn(usize) -> bool,
    ) -> Submit {
        let waiting: Vec<usize> = request
            .links
            .iter()
            .copied()
            .filter(|&l| !have(l))
            .collect();
        let key = (request.event_id, self.next_slot);
        let behind = self
            .queues
            .get(&request.builder)
            .and_then(|q| q.waiting.first())
            .is_some_and(|&w| w < key);
        if waiting.is_empty() && !behind {
            // Ready, and nothing of its builder waits before it: no descriptor needed.
            return Submit::Taken(vec![Answer {
                request,
                missing: Vec::new(),
            }]);
        }
        if self.is_full() {
            return Submit::NoDescriptor(request);
        }
        let slot = self.next_slot;
        self.next_slot += 1;
        let queue = self.queues.entry(request.builder).or_default();
        if waiting.is_empty() {
            queue.held.insert(
                key,
                Answer {
                    request,
                    missing: Vec::new(),
                },
            );
            self.held += 1;
            return Submit::Taken(Vec::new());
        }
        queue.waiting.insert(key);
        let deadline_ns = now_ns.saturating_add(self.timeout_ns);
        self.by_event
            .entry(request.event_id)
            .or_default()
            .push(slot);
        self.deadlines.insert((deadline_ns, slot), ());
        self.pending.insert(
            slot,
            Pending {
                request,
                waiting,
                deadline_ns,
            },
        );
        Submit::Taken(Vec::new())
    }

    /// A fragment of `event_id` arrived on `link`: returns the answers now to be sent, each
    /// builder's in order.
    pub fn arrived(&mut self, event_id: u64, link: usize) -> Vec<Answer> {
        let Some(slots) = self.by_event.get(&event_id) else {
            return Vec::new();
        };
        let mut done = Vec::new();
        for &slot in slots {
            let p = self
                .pending
                .get_mut(&slot)
                .expect("indexed slot is pending");
            p.waiting.retain(|&l| l != link);
            if p.waiting.is_empty() {
                done.push(slot);
            }
        }
        self.finish(done)
    }

    /// Requests whose deadline passed by `now_ns` are answered with their missing links: returns
    /// the answers now to be sent, each builder's in order.
    pub fn expire(&mut self, now_ns: u64) -> Vec<Answer> {
        let due: Vec<u64> = self
            .deadlines
            .range(..(now_ns.saturating_add(1), 0))
            .map(|(&(_, slot), _)| slot)
            .collect();
        self.finish(due)
    }

    /// When the next request times out, if any.
    pub fn next_deadline(&self) -> Option<u64> {
        self.deadlines.keys().next().map(|&(d, _)| d)
    }

    /// Answers the pending `slots` (into their builders' queues), then releases what no longer
    /// waits behind a lower event ID.
    fn finish(&mut self, slots: Vec<u64>) -> Vec<Answer> {
        let mut builders = Vec::new();
        for slot in slots {
            let p = self
                .pending
                .remove(&slot)
                .expect("finishing a pending slot");
            self.deadlines.remove(&(p.deadline_ns, slot));
            let e = p.request.event_id;
            if let Some(v) = self.by_event.get_mut(&e) {
                v.retain(|&s| s != slot);
                if v.is_empty() {
                    self.by_event.remove(&e);
                }
            }
            let b = p.request.builder;
            let q = self.queues.entry(b).or_default();
            q.waiting.remove(&(e, slot));
            q.held.insert(
                (e, slot),
                Answer {
                    request: p.request,
                    missing: p.waiting,
                },
            );
            self.held += 1;
            if !builders.contains(&b) {
                builders.push(b);
            }
        }
        let mut out = Vec::new();
        for b in builders {
            let q = self.queues.get_mut(&b).expect("queued above");
            let before = out.len();
            q.release(&mut out);
            self.held -= out.len() - before;
            if q.is_empty() {
                self.queues.remove(&b);
            }
        }
        out
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
        assert_eq!(
            t.submit(req(1, 5, &[0, 2]), 0, |_| true),
            Submit::Taken(vec![Answer {
                request: req(1, 5, &[0, 2]),
                missing: vec![]
            }])
        );
        assert_eq!(t.in_use(), 0);
    }

    #[test]
    fn pending_until_the_data_arrives() {
        let mut t = RequestTable::new(4, 1000);
        assert_eq!(
            t.submit(req(1, 5, &[0, 1, 2]), 0, |l| l == 1),
            Submit::Taken(vec![])
        );
        assert!(t.arrived(5, 0).is_empty());
        assert!(
            t.arrived(6, 2).is_empty(),
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
        assert!(t.expire(10_000).is_empty());
    }

    #[test]
    fn timeout_answers_with_exactly_the_missing_links() {
        let mut t = RequestTable::new(4, 1000);
        t.submit(req(1, 5, &[0, 1, 2, 3]), 100, |l| l == 0);
        t.arrived(5, 2);
        assert!(t.expire(1099).is_empty());
        assert_eq!(t.next_deadline(), Some(1100));
        assert_eq!(
            t.expire(1100),
            vec![Answer {
                request: req(1, 5, &[0, 1, 2, 3]),
                missing: vec![1, 3]
            }]
        );
    }

    #[test]
    fn descriptor_exhaustion_hands_requests_back() {
        let mut t = RequestTable::new(2, 1000);
        assert_eq!(
            t.submit(req(1, 1, &[0]), 0, |_| false),
            Submit::Taken(vec![])
        );
        let other = Request {
            builder: 1,
            ..req(2, 2, &[0])
        };
        assert_eq!(t.submit(other, 0, |_| false), Submit::Taken(vec![]));
        assert_eq!(
            t.submit(req(3, 3, &[0]), 0, |_| false),
            Submit::NoDescriptor(req(3, 3, &[0]))
        );
        // A ready answer that waits behind nothing needs no descriptor and still goes through;
        // one that must be held behind a lower event ID needs one.
        let ready_first = Request {
            builder: 1,
            ..req(4, 1, &[0])
        };
        assert_eq!(t.submit(ready_first, 0, |_| true).answers().len(), 1);
        assert_eq!(
            t.submit(req(5, 4, &[0]), 0, |_| true),
            Submit::NoDescriptor(req(5, 4, &[0]))
        );
        assert_eq!(t.arrived(1, 0).len(), 1);
        assert_eq!(
            t.submit(req(3, 3, &[0]), 0, |_| false),
            Submit::Taken(vec![])
        );
    }

    #[test]
    fn a_builders_answers_leave_in_event_id_order_whatever_order_they_became_ready_in() {
        let mut t = RequestTable::new(8, 1000);
        let b1 = |tag, e| Request {
            builder: 1,
            ..req(tag, e, &[0, 1])
        };
        // Builder 0 asks for 5, 6 and 7; 6 and 7 are ready first, 5 arrives last.
        assert_eq!(
            t.submit(req(1, 5, &[0, 1]), 0, |l| l == 0),
            Submit::Taken(vec![])
        );
        assert_eq!(
            t.submit(req(2, 6, &[0, 1]), 0, |_| true),
            Submit::Taken(vec![])
        );
        assert_eq!(
            t.submit(req(3, 7, &[0, 1]), 0, |l| l == 0),
            Submit::Taken(vec![])
        );
        // Another builder's answers wait for nothing of builder 0's.
        assert_eq!(t.submit(b1(9, 8), 0, |_| true).answers().len(), 1);
        assert!(t.arrived(7, 1).is_empty(), "7 is held behind 5");
        assert_eq!(t.in_use(), 3, "held answers keep their descriptors");
        let tags: Vec<u64> = t.arrived(5, 1).iter().map(|a| a.request.tag).collect();
        assert_eq!(tags, [1, 2, 3]);
        assert_eq!(t.in_use(), 0);
        // A held answer also goes when the request before it times out.
        t.submit(req(4, 10, &[0, 1]), 100, |l| l == 0);
        t.submit(req(5, 11, &[0, 1]), 200, |_| true);
        assert!(t.expire(1099).is_empty());
        let out = t.expire(1100);
        assert_eq!(out.len(), 2);
        assert_eq!((out[0].request.tag, &out[0].missing), (4, &vec![1]));
        assert_eq!((out[1].request.tag, &out[1].missing), (5, &vec![]));
    }

    proptest! {
        /// Every accepted request is answered exactly once; an answer names as missing at least
        /// the requested links whose fragment had not arrived when it goes (a fragment may arrive
        /// while a timed-out answer is held for order), and only requested links; and no answer
        /// goes while a request of its builder with a lower event ID (or the same, asked
        /// earlier) still waits.
        #[test]
        fn every_request_answered_once_and_in_order(ops in proptest::collection::vec(prop_oneof![
            2 => (0u64..6, proptest::collection::btree_set(0usize..4, 1..4), 0u32..2).prop_map(|(e, l, b)| (0u8, e, l.into_iter().collect::<Vec<_>>(), b)),
            3 => (0u64..6, 0usize..4).prop_map(|(e, l)| (1u8, e, vec![l], 0)),
            1 => (0u64..6).prop_map(|d| (2u8, d, vec![], 0)),
        ], 0..150)) {
            let mut t = RequestTable::new(5, 50);
            let mut now = 0u64;
            let mut present: HashSet<(u64, usize)> = HashSet::new();
            let mut accepted: HashSet<u64> = HashSet::new();
            let mut answered: HashSet<u64> = HashSet::new();
            // Per builder: (event ID, tag) of requests taken and not yet answered.
            let mut open: [std::collections::BTreeSet<(u64, u64)>; 2] = Default::default();
            let mut tag = 0u64;
            let mut check = |a: &Answer, present: &HashSet<(u64, usize)>, open: &mut [std::collections::BTreeSet<(u64, u64)>; 2]| -> Result<(), TestCaseError> {
                let r = &a.request;
                prop_assert!(answered.insert(r.tag), "answered twice");
                let q = &mut open[r.builder as usize];
                prop_assert_eq!(q.first().copied(), Some((r.event_id, r.tag)), "a lower request of its builder still waits");
                q.remove(&(r.event_id, r.tag));
                for l in r.links.iter().filter(|l| !present.contains(&(r.event_id, **l))) {
                    prop_assert!(a.missing.contains(l));
                }
                prop_assert!(a.missing.iter().all(|l| r.links.contains(l)));
                Ok(())
            };
            for (kind, x, links, builder) in ops {
                match kind {
                    0 => {
                        tag += 1;
                        let r = Request { tag, builder, event_id: x, links };
                        match t.submit(r, now, |l| present.contains(&(x, l))) {
                            Submit::Taken(out) => {
                                accepted.insert(tag);
                                open[builder as usize].insert((x, tag));
                                for a in out { check(&a, &present, &mut open)?; }
                            }
                            Submit::NoDescriptor(_) => prop_assert!(t.is_full()),
                        }
                    }
                    1 => {
                        if present.insert((x, links[0])) {
                            for a in t.arrived(x, links[0]) { check(&a, &present, &mut open)?; }
                        }
                    }
                    _ => {
                        now += x * 10;
                        for a in t.expire(now) { check(&a, &present, &mut open)?; }
                    }
                }
            }
            for a in t.expire(u64::MAX) { check(&a, &present, &mut open)?; }
            prop_assert_eq!(accepted, answered);
            prop_assert_eq!(t.in_use(), 0);
        }
    }
}

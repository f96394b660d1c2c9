//! Pending data requests of request mode (issue 3; ATLAS ROS, seeds/004 §5.3 and §6.2): a builder
//! asks a readout unit for one event's fragments from all links or a listed subset (RoI). The
//! unit answers at once when it has them; otherwise the request waits in one of a fixed number of
//! descriptors until the missing fragments arrive or its timeout passes, and is then answered with
//! what there is plus the list of links still missing. With every descriptor in use, new requests
//! are not taken (the caller stops reading requests: back-pressure), never queued without bound.
//!
//! Pure state machine: the caller says which links hold the event (`have`), when fragments arrive
//! and what time it is; no I/O, no clock. Request mode (`serve.rs`) keeps one per unit.

use std::collections::{BTreeMap, HashMap};

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
    /// Every requested link holds the event: answer now.
    Ready(Answer),
    /// Waiting in a descriptor.
    Pending,
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
        }
    }

    pub fn in_use(&self) -> usize {
        self.pending.len()
    }

    pub fn is_full(&self) -> bool {
        self.pending.len() >= self.capacity
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
        if waiting.is_empty() {
            return Submit::Ready(Answer {
                request,
                missing: Vec::new(),
            });
        }
        if self.is_full() {
            return Submit::NoDescriptor(request);
        }
        let slot = self.next_slot;
        self.next_slot += 1;
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
        Submit::Pending
    }

    /// A fragment of `event_id` arrived on `link`: returns the requests now complete.
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
        done.into_iter().map(|slot| self.finish(slot)).collect()
    }

    /// Requests whose deadline passed by `now_ns`, answered with their missing links.
    pub fn expire(&mut self, now_ns: u64) -> Vec<Answer> {
        let due: Vec<u64> = self
            .deadlines
            .range(..(now_ns.saturating_add(1), 0))
            .map(|(&(_, slot), _)| slot)
            .collect();
        due.into_iter().map(|slot| self.finish(slot)).collect()
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
        if let Some(v) = self.by_event.get_mut(&p.request.event_id) {
            v.retain(|&s| s != slot);
            if v.is_empty() {
                self.by_event.remove(&p.request.event_id);
            }
        }
        Answer {
            request: p.request,
            missing: p.waiting,
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
        assert_eq!(
            t.submit(req(1, 5, &[0, 1, 2]), 0, |l| l == 1),
            Submit::Pending
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
        assert_eq!(t.submit(req(1, 1, &[0]), 0, |_| false), Submit::Pending);
        assert_eq!(t.submit(req(2, 2, &[0]), 0, |_| false), Submit::Pending);
        assert_eq!(
            t.submit(req(3, 3, &[0]), 0, |_| false),
            Submit::NoDescriptor(req(3, 3, &[0]))
        );
        // Answers that need no descriptor still go through.
        assert!(matches!(
            t.submit(req(4, 4, &[0]), 0, |_| true),
            Submit::Ready(_)
        ));
        t.arrived(1, 0);
        assert_eq!(t.submit(req(3, 3, &[0]), 0, |_| false), Submit::Pending);
    }

    proptest! {
        /// Every accepted request is answered exactly once, and an answer names as missing
        /// exactly the requested links whose fragment had not arrived.
        #[test]
        fn every_request_answered_once(ops in proptest::collection::vec(prop_oneof![
            2 => (0u64..6, proptest::collection::btree_set(0usize..4, 1..4)).prop_map(|(e, l)| (0u8, e, l.into_iter().collect::<Vec<_>>())),
            3 => (0u64..6, 0usize..4).prop_map(|(e, l)| (1u8, e, vec![l])),
            1 => (0u64..6).prop_map(|d| (2u8, d, vec![])),
        ], 0..150)) {
            let mut t = RequestTable::new(5, 50);
            let mut now = 0u64;
            let mut present: HashSet<(u64, usize)> = HashSet::new();
            let mut accepted: HashSet<u64> = HashSet::new();
            let mut answered: HashSet<u64> = HashSet::new();
            let mut tag = 0u64;
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
                        if present.insert((x, links[0])) {
                            for a in t.arrived(x, links[0]) { check(&a, &present)?; }
                        }
                    }
                    _ => {
                        now += x * 10;
                        for a in t.expire(now) { check(&a, &present)?; }
                    }
                }
            }
            for a in t.expire(u64::MAX) { check(&a, &present)?; }
            prop_assert_eq!(accepted, answered);
            prop_assert_eq!(t.in_use(), 0);
        }
    }
}

//! Event assembly, with no I/O and no clock of its own (time is passed in, in nanoseconds).
//!
//! An [`Assembler`] has a fixed set of contributors (a readout unit's links, or a builder's
//! readout units). Items arrive tagged with (contributor, event ID). An event is *ready* when every
//! contributor has delivered its item or is closed (will never deliver again); it is *timed out*
//! when it has waited longer than the timeout since its first item. Ready events come out
//! complete or incomplete with the list of contributors that are missing.
//!
//! After an event leaves, the assembler remembers which contributors delivered it for a bounded
//! number of events, so a late item (after the timeout) or a repeated one (a duplicated event ID)
//! is reported as such instead of opening a new event that could only time out.

mod recent;
pub use recent::RecentSet;

use std::collections::{HashMap, VecDeque};

/// An event that left the assembler.
#[derive(Debug)]
pub struct Assembled<T> {
    pub event_id: u64,
    /// One entry per contributor, in contributor order.
    pub parts: Vec<Option<T>>,
    /// Contributors with no item, ascending. Empty for a complete event.
    pub missing: Vec<usize>,
    /// Whether the event left by timeout rather than by being ready.
    pub timed_out: bool,
    /// When its first item arrived.
    pub first_seen_ns: u64,
}

impl<T> Assembled<T> {
    pub fn is_complete(&self) -> bool {
        self.missing.is_empty()
    }
}

/// What became of an offered item.
#[derive(Debug)]
pub enum Offer<T> {
    /// Held; the event still waits for other contributors.
    Held,
    /// The item completed its event (or the event is ready because the rest are closed).
    Ready(Assembled<T>),
    /// The contributor already delivered this event ID (still pending, or recently sent).
    Duplicate(T),
    /// The event already left (timed out, or ready without this contributor); the item is late.
    Late(T),
    /// The contributor is closed; nothing more is taken from it.
    Closed(T),
}

struct Pending<T> {
    parts: Vec<Option<T>>,
    have: usize,
    first_seen_ns: u64,
}

/// Bitset of contributors.
#[derive(Clone, Debug)]
struct Bits(Vec<u64>);

impl Bits {
    fn new(n: usize) -> Bits {
        Bits(vec![0; n.div_ceil(64).max(1)])
    }
    fn set(&mut self, i: usize) {
        self.0[i / 64] |= 1 << (i % 64);
    }
    fn get(&self, i: usize) -> bool {
        self.0[i / 64] & (1 << (i % 64)) != 0
    }
}

/// Counts kept over the assembler's life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AssemblyStats {
    pub complete: u64,
    pub incomplete: u64,
    pub timed_out: u64,
    pub duplicates: u64,
    pub late: u64,
}

pub struct Assembler<T> {
    contributors: usize,
    timeout_ns: u64,
    pending: HashMap<u64, Pending<T>>,
    /// (event ID, first seen) in arrival order; entries for events that left are skipped lazily.
    order: VecDeque<(u64, u64)>,
    closed: Vec<bool>,
    open: usize,
    /// Events that left, with who delivered them; bounded by `memory`.
    done: HashMap<u64, Bits>,
    done_order: VecDeque<u64>,
    memory: usize,
    held_items: usize,
    pub stats: AssemblyStats,
}

impl<T> Assembler<T> {
    /// `memory`: how many departed events to remember for late/duplicate detection.
    pub fn new(contributors: usize, timeout_ns: u64, memory: usize) -> Self {
        Assembler {
            contributors,
            timeout_ns,
            pending: HashMap::new(),
            order: VecDeque::new(),
            closed: vec![false; contributors],
            open: contributors,
            done: HashMap::new(),
            done_order: VecDeque::new(),
            memory: memory.max(1),
            held_items: 0,
            stats: AssemblyStats::default(),
        }
    }

    pub fn contributors(&self) -> usize {
        self.contributors
    }

    /// Items held in pending events.
    pub fn held_items(&self) -> usize {
        self.held_items
    }

    pub fn pending_events(&self) -> usize {
        self.pending.len()
    }

    /// Whether every contributor is closed.
    pub fn all_closed(&self) -> bool {
        self.open == 0
    }

    pub fn is_closed(&self, c: usize) -> bool {
        self.closed[c]
    }

    /// Offers contributor `c`'s item for `event_id`, at time `now_ns`.
    pub fn offer(&mut self, c: usize, event_id: u64, item: T, now_ns: u64) -> Offer<T> {
        if self.closed[c] {
            return Offer::Closed(item);
        }
        if let Some(bits) = self.done.get(&event_id) {
            return if bits.get(c) {
                self.stats.duplicates += 1;
                Offer::Duplicate(item)
            } else {
                self.stats.late += 1;
                Offer::Late(item)
            };
        }
        let n = self.contributors;
        let p = self.pending.entry(event_id).or_insert_with(|| {
            self.order.push_back((event_id, now_ns));
            Pending {
                parts: (0..n).map(|_| None).collect(),
                have: 0,
                first_seen_ns: now_ns,
            }
        });
        if p.parts[c].is_some() {
            self.stats.duplicates += 1;
            return Offer::Duplicate(item);
        }
        p.parts[c] = Some(item);
        p.have += 1;
        self.held_items += 1;
        if self.ready(event_id) {
            Offer::Ready(self.depart(event_id, false))
        } else {
            Offer::Held
        }
    }

    fn ready(&self, event_id: u64) -> bool {
        let p = &self.pending[&event_id];
        p.have == self.contributors
            || p.parts
                .iter()
                .zip(&self.closed)
                .all(|(x, &closed)| x.is_some() || closed)
    }

    fn depart(&mut self, event_id: u64, timed_out: bool) -> Assembled<T> {
        let p = self
            .pending
            .remove(&event_id)
            .expect("departing event is pending");
        self.held_items -= p.have;
        let mut bits = Bits::new(self.contributors);
        let mut missing = Vec::new();
        for (i, x) in p.parts.iter().enumerate() {
            if x.is_some() {
                bits.set(i);
            } else {
                missing.push(i);
            }
        }
        if missing.is_empty() {
            self.stats.complete += 1;
        } else {
            self.stats.incomplete += 1;
        }
        if timed_out {
            self.stats.timed_out += 1;
        }
        self.done.insert(event_id, bits);
        self.done_order.push_back(event_id);
        while self.done_order.len() > self.memory {
            if let Some(old) = self.done_order.pop_front() {
                self.done.remove(&old);
            }
        }
        Assembled {
            event_id,
            parts: p.parts,
            missing,
            timed_out,
            first_seen_ns: p.first_seen_ns,
        }
    }

    /// Events whose first item is older than the timeout, oldest first.
    pub fn expire(&mut self, now_ns: u64) -> Vec<Assembled<T>> {
        let mut out = Vec::new();
        while let Some(&(ev, t)) = self.order.front() {
            let live = self.pending.get(&ev).is_some_and(|p| p.first_seen_ns == t);
            if !live {
                self.order.pop_front();
                continue;
            }
            if now_ns.saturating_sub(t) < self.timeout_ns {
                break;
            }
            self.order.pop_front();
            out.push(self.depart(ev, true));
        }
        out
    }

    /// The periodic step of a sweeper: events past their timeout leave; once every contributor is
    /// closed, everything still pending leaves too. Returns the departed events and whether the
    /// assembler is done (all contributors closed, nothing pending).
    pub fn sweep(&mut self, now_ns: u64) -> (Vec<Assembled<T>>, bool) {
        let mut out = self.expire(now_ns);
        let done = self.all_closed();
        if done {
            out.extend(self.flush());
        }
        (out, done)
    }

    /// When the oldest pending event will time out, if any.
    pub fn next_deadline(&self) -> Option<u64> {
        self.order
            .iter()
            .find(|(ev, t)| self.pending.get(ev).is_some_and(|p| p.first_seen_ns == *t))
            .map(|(_, t)| t + self.timeout_ns)
    }

    /// Contributor `c` will deliver nothing more: events that waited only for it are ready now.
    pub fn close(&mut self, c: usize) -> Vec<Assembled<T>> {
        if self.closed[c] {
            return Vec::new();
        }
        self.closed[c] = true;
        self.open -= 1;
        let mut ids: Vec<u64> = self
            .pending
            .keys()
            .copied()
            .filter(|ev| self.ready(*ev))
            .collect();
        ids.sort_unstable();
        ids.into_iter().map(|ev| self.depart(ev, false)).collect()
    }

    /// Sends every pending event out as it is (at the end of a run, or an abort).
    pub fn flush(&mut self) -> Vec<Assembled<T>> {
        let mut ids: Vec<u64> = self.pending.keys().copied().collect();
        ids.sort_unstable();
        ids.into_iter().map(|ev| self.depart(ev, false)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn complete_when_all_arrive() {
        let mut a = Assembler::new(3, 1000, 100);
        assert!(matches!(a.offer(0, 5, 'a', 0), Offer::Held));
        assert!(matches!(a.offer(2, 5, 'c', 1), Offer::Held));
        match a.offer(1, 5, 'b', 2) {
            Offer::Ready(e) => {
                assert!(e.is_complete());
                assert_eq!(e.parts, vec![Some('a'), Some('b'), Some('c')]);
            }
            o => panic!("{o:?}"),
        }
        assert!(matches!(a.offer(1, 5, 'x', 3), Offer::Duplicate('x')));
        assert_eq!(a.held_items(), 0);
    }

    #[test]
    fn timeout_names_missing_and_late_is_reported() {
        let mut a = Assembler::new(3, 1000, 100);
        a.offer(0, 1, 0u8, 0);
        a.offer(1, 1, 0u8, 10);
        assert!(a.expire(999).is_empty());
        let out = a.expire(1000);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].missing, vec![2]);
        assert!(out[0].timed_out);
        assert!(matches!(a.offer(2, 1, 9u8, 2000), Offer::Late(9)));
        assert_eq!(a.stats.late, 1);
    }

    #[test]
    fn closed_contributor_releases_waiting_and_future_events() {
        let mut a = Assembler::new(2, u64::MAX, 100);
        a.offer(0, 1, (), 0);
        a.offer(0, 2, (), 0);
        let out = a.close(1);
        assert_eq!(
            out.iter().map(|e| e.event_id).collect::<Vec<_>>(),
            vec![1, 2]
        );
        assert!(out.iter().all(|e| e.missing == vec![1]));
        match a.offer(0, 3, (), 0) {
            Offer::Ready(e) => assert_eq!(e.missing, vec![1]),
            o => panic!("{o:?}"),
        }
        assert!(matches!(a.offer(1, 4, (), 0), Offer::Closed(())));
    }

    #[test]
    fn sweep_flushes_only_when_all_closed() {
        let mut a = Assembler::new(2, 100, 10);
        a.offer(0, 1, (), 0);
        let (out, done) = a.sweep(50);
        assert!(out.is_empty() && !done);
        a.offer(0, 2, (), 60);
        let (out, done) = a.sweep(100);
        assert_eq!(out.iter().map(|e| e.event_id).collect::<Vec<_>>(), vec![1]);
        assert!(!done);
        a.close(1);
        a.close(0);
        let (out, done) = a.sweep(101);
        assert!(out.is_empty() && done, "closing released event 2 already");
    }

    #[test]
    fn many_contributors_bitset() {
        let mut a = Assembler::new(130, 10, 4);
        for c in 0..129 {
            a.offer(c, 7, c, 0);
        }
        let out = a.expire(10);
        assert_eq!(out[0].missing, vec![129]);
        assert!(matches!(a.offer(128, 7, 0, 11), Offer::Duplicate(_)));
        assert!(matches!(a.offer(129, 7, 0, 11), Offer::Late(_)));
    }
}

//! A bounded memory of recently seen event IDs (first in, first forgotten): which events a
//! readout unit announced or cleared, which the event manager finished, which the recorder
//! wrote. Bounded so that a long run cannot grow it; an ID forgotten and seen again is new.
//!
//! Its memory is fixed by its capacity ([`RecentSet::bytes`]): a ring of the remembered IDs in
//! the order they came, and an index over them with twice as many slots (open addressing,
//! linear probing, deletion by shifting the cluster back, so no tombstones: the index never
//! grows or rehashes). Pages are touched as IDs arrive. It replaced a std `HashSet` with a
//! `VecDeque`, which for 2^20 IDs reached 54.7 MB resident: the deque doubled past the
//! capacity, and deletions' tombstones made the set resize to four slots per ID.

use std::hash::BuildHasher;

/// An index slot that holds no ID. The ID 0 itself is remembered by `has_zero`.
const EMPTY: u64 = 0;

pub struct RecentSet {
    /// The index: an ID, or `EMPTY`. A power of two, at least twice the capacity, so it is
    /// never more than half full and every probe ends at an empty slot.
    slots: Vec<u64>,
    mask: usize,
    has_zero: bool,
    /// The remembered IDs in the order they came; once full, `oldest` is the next forgotten.
    ring: Vec<u64>,
    oldest: usize,
    capacity: usize,
    /// Seeded per set, so that no sequence of IDs a peer chooses can pile them into one cluster.
    hasher: crate::EventIdHasher,
}

impl RecentSet {
    /// At most [`RecentSet::MAX_CAPACITY`] IDs: a larger capacity is taken as that.
    pub fn new(capacity: usize) -> RecentSet {
        let capacity = capacity.clamp(1, Self::MAX_CAPACITY);
        let slots = Self::slots_for(capacity);
        RecentSet {
            // Zeroed pages from the allocator: resident only once an ID lands in them.
            slots: vec![EMPTY; slots],
            mask: slots - 1,
            has_zero: false,
            ring: Vec::with_capacity(capacity),
            oldest: 0,
            capacity,
            hasher: crate::EventIdHasher::default(),
        }
    }

    /// 2^40 IDs (24 TiB): far beyond any memory, and its index's size still a power of two.
    pub const MAX_CAPACITY: usize = 1 << 40;

    fn slots_for(capacity: usize) -> usize {
        capacity.saturating_mul(2).next_power_of_two()
    }

    /// The most memory a set of this capacity holds, in bytes, once it has remembered that
    /// many IDs (what `tessera check` counts for it).
    pub fn bytes(capacity: usize) -> u64 {
        let capacity = capacity.clamp(1, Self::MAX_CAPACITY) as u64;
        8 * capacity + 8 * Self::slots_for(capacity as usize) as u64
    }

    pub fn contains(&self, id: u64) -> bool {
        if id == EMPTY {
            return self.has_zero;
        }
        self.find(id).is_some()
    }

    /// Remembers `id`; false if it was already remembered.
    pub fn insert(&mut self, id: u64) -> bool {
        let home = self.home(id);
        if id == EMPTY {
            if self.has_zero {
                return false;
            }
        } else if self
            .probe_from(home, |s| s == EMPTY || s == id)
            .is_some_and(|i| self.slots[i] == id)
        {
            return false;
        }
        if self.ring.len() < self.capacity {
            self.ring.push(id);
        } else {
            let old = std::mem::replace(&mut self.ring[self.oldest], id);
            self.oldest += 1;
            if self.oldest == self.capacity {
                self.oldest = 0;
            }
            self.forget(old);
        }
        if id == EMPTY {
            self.has_zero = true;
        } else if let Some(i) = self.probe_from(home, |s| s == EMPTY) {
            // From its home again: forgetting may have emptied a slot on its way.
            self.slots[i] = id;
        }
        true
    }

    /// The first slot from `id`'s home that `stop` accepts. The index is never more than half
    /// full, so an empty slot ends every probe; the bound turns a broken invariant into a
    /// forgotten ID instead of a hang.
    fn probe(&self, id: u64, stop: impl Fn(u64) -> bool) -> Option<usize> {
        self.probe_from(self.home(id), stop)
    }

    fn probe_from(&self, home: usize, stop: impl Fn(u64) -> bool) -> Option<usize> {
        let mut i = home;
        for _ in 0..self.slots.len() {
            if stop(self.slots[i]) {
                return Some(i);
            }
            i = (i + 1) & self.mask;
        }
        None
    }

    /// Where `id`'s probe starts. IDs come nearly in order, so each run of eight (`id >> 3`)
    /// goes to a place of its own, eight consecutive slots (one cache line), chosen by the seeded
    /// hash: eight insertions and the eight forgettings that follow them touch one line each,
    /// where a hash of each ID touched a line apiece (two misses an insertion, three quarters of
    /// its time under `perf annotate`). A peer can fill one run's line, no more.
    fn home(&self, id: u64) -> usize {
        ((self.hasher.hash_one(id >> 3) << 3) | (id & 7)) as usize & self.mask
    }

    fn find(&self, id: u64) -> Option<usize> {
        self.probe(id, |s| s == EMPTY || s == id)
            .filter(|&i| self.slots[i] == id)
    }

    /// Takes `id` out of the index, moving back the IDs after it in its cluster that could
    /// not otherwise be found once its slot is empty.
    fn forget(&mut self, id: u64) {
        if id == EMPTY {
            self.has_zero = false;
            return;
        }
        let Some(mut hole) = self.find(id) else {
            return;
        };
        let mut j = hole;
        for _ in 0..self.slots.len() {
            j = (j + 1) & self.mask;
            let s = self.slots[j];
            if s == EMPTY {
                break;
            }
            let home = self.home(s);
            // `s` is found from its home by probing up to `j`: it may stay unless the hole
            // lies on that path (cyclically in [home, j)).
            let on_path = if home <= j {
                home <= hole && hole < j
            } else {
                home <= hole || hole < j
            };
            if on_path {
                self.slots[hole] = s;
                hole = j;
            }
        }
        self.slots[hole] = EMPTY;
    }
}

#[cfg(test)]
mod tests {
    use super::RecentSet;
    use proptest::prelude::*;
    use std::collections::{HashSet, VecDeque};

    #[test]
    fn forgets_the_oldest_beyond_its_capacity() {
        let mut r = RecentSet::new(3);
        assert!(r.insert(1) && r.insert(2) && r.insert(3));
        assert!(!r.insert(2));
        assert!(r.insert(4));
        assert!(!r.contains(1) && r.contains(2) && r.contains(4));
    }

    #[test]
    fn zero_and_the_largest_id_are_ids_like_any_other() {
        let mut r = RecentSet::new(2);
        assert!(!r.contains(0) && !r.contains(u64::MAX));
        assert!(r.insert(0) && r.insert(u64::MAX));
        assert!(!r.insert(0) && r.contains(0) && r.contains(u64::MAX));
        assert!(r.insert(7));
        assert!(!r.contains(0) && r.contains(u64::MAX) && r.contains(7));
    }

    #[test]
    fn its_memory_is_fixed_by_its_capacity() {
        // 2^20 IDs: a ring of 8 MiB and an index of 2^21 slots.
        assert_eq!(RecentSet::bytes(1 << 20), 24 << 20);
        let r = RecentSet::new(1000);
        assert_eq!(r.slots.len(), 2048);
        assert_eq!(r.ring.capacity(), 1000);
    }

    /// The set against the plain model it replaced: a hash set of the IDs in a queue of their
    /// order. IDs from a small range (0 and the largest among them) so that they repeat, collide
    /// and wrap the index; capacities from 1.
    fn same_as_the_model(capacity: usize, ops: Vec<(bool, u64)>) -> Result<(), TestCaseError> {
        let mut r = RecentSet::new(capacity);
        let (mut set, mut order) = (HashSet::new(), VecDeque::new());
        for (insert, id) in ops {
            if insert {
                let new = set.insert(id);
                if new {
                    order.push_back(id);
                    if order.len() > capacity {
                        let old = order.pop_front().unwrap();
                        set.remove(&old);
                    }
                }
                prop_assert_eq!(r.insert(id), new, "insert {}", id);
            } else {
                prop_assert_eq!(r.contains(id), set.contains(&id), "contains {}", id);
            }
        }
        for id in 0..64u64 {
            prop_assert_eq!(r.contains(id), set.contains(&id), "at the end, {}", id);
        }
        prop_assert_eq!(r.contains(u64::MAX), set.contains(&u64::MAX));
        Ok(())
    }

    fn id() -> impl Strategy<Value = u64> {
        prop_oneof![8 => 0u64..64, 1 => Just(u64::MAX), 1 => any::<u64>()]
    }

    proptest! {
        #[test]
        fn remembers_exactly_the_latest_ids_as_the_model_does(
            capacity in 1usize..40,
            ops in proptest::collection::vec((proptest::bool::weighted(0.6), id()), 0..400),
        ) {
            same_as_the_model(capacity, ops)?;
        }
    }
}

//! A bounded memory of recently seen event IDs (first in, first forgotten): which events a
//! readout unit announced or cleared, which the event manager finished, which the recorder
//! wrote. Bounded so that a long run cannot grow it; an ID forgotten and seen again is new.

use std::collections::{HashSet, VecDeque};

pub struct RecentSet {
    set: HashSet<u64, crate::EventIdHasher>,
    order: VecDeque<u64>,
    capacity: usize,
}

impl RecentSet {
    pub fn new(capacity: usize) -> RecentSet {
        RecentSet {
            set: HashSet::with_capacity_and_hasher(
                capacity.min(1 << 16),
                crate::EventIdHasher::default(),
            ),
            order: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }

    pub fn contains(&self, id: u64) -> bool {
        self.set.contains(&id)
    }

    /// Remembers `id`; false if it was already remembered.
    pub fn insert(&mut self, id: u64) -> bool {
        if !self.set.insert(id) {
            return false;
        }
        self.order.push_back(id);
        if self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn forgets_the_oldest_beyond_its_capacity() {
        let mut r = super::RecentSet::new(3);
        assert!(r.insert(1) && r.insert(2) && r.insert(3));
        assert!(!r.insert(2));
        assert!(r.insert(4));
        assert!(!r.contains(1) && r.contains(2) && r.contains(4));
    }
}

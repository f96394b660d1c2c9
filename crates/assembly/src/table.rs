//! The table of open events: a ring of slots indexed by event ID, and a map for the events whose
//! slot is taken by another open event.
//!
//! Event IDs are dense and rising, so the open events of a unit are mostly a run of consecutive
//! IDs, which a ring holds in consecutive slots: the lookup at every fragment touches memory the
//! previous fragments touched. A hash map spreads consecutive IDs over all its buckets, and it
//! is as large as the most events ever open at once (hundreds: a source writes hundreds of
//! events per write), so at 1 KiB x 8 the lookup of the open event was the largest single stall
//! of the assembler under `perf annotate`. IDs further apart than the ring (an event held back
//! while the others run ahead) still work, through the map.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use crate::EventIdHasher;

/// Slots of the ring: events spread over more IDs than this share slots and go to the map.
pub const RING_SLOTS: usize = 4096;

pub(crate) struct Table<V> {
    ring: Vec<Option<(u64, V)>>,
    mask: u64,
    /// Open events whose slot was taken when they opened.
    overflow: HashMap<u64, V, EventIdHasher>,
    len: usize,
}

impl<V> Table<V> {
    pub fn new(slots: usize) -> Table<V> {
        let slots = slots.max(2).next_power_of_two();
        Table {
            ring: (0..slots).map(|_| None).collect(),
            mask: slots as u64 - 1,
            overflow: HashMap::default(),
            len: 0,
        }
    }

    fn slot(&self, id: u64) -> usize {
        (id & self.mask) as usize
    }

    fn in_ring(&self, id: u64) -> bool {
        matches!(&self.ring[self.slot(id)], Some((k, _)) if *k == id)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn contains_key(&self, id: u64) -> bool {
        self.get(id).is_some()
    }

    pub fn get(&self, id: u64) -> Option<&V> {
        match &self.ring[self.slot(id)] {
            Some((k, v)) if *k == id => Some(v),
            _ if self.overflow.is_empty() => None,
            _ => self.overflow.get(&id),
        }
    }

    /// The event `id`, opened with `open` if it is not open.
    pub fn get_or_insert_with(&mut self, id: u64, open: impl FnOnce() -> V) -> &mut V {
        let s = self.slot(id);
        if !self.in_ring(id) {
            if self.ring[s].is_some()
                || (!self.overflow.is_empty() && self.overflow.contains_key(&id))
            {
                // The slot holds another event, or it was taken when `id` opened.
                let e = self.overflow.entry(id);
                if matches!(e, Entry::Vacant(_)) {
                    self.len += 1;
                }
                return e.or_insert_with(open);
            }
            self.len += 1;
        }
        &mut self.ring[s].get_or_insert_with(|| (id, open())).1
    }

    pub fn remove(&mut self, id: u64) -> Option<V> {
        let v = if self.in_ring(id) {
            let s = self.slot(id);
            self.ring[s].take().map(|(_, v)| v)
        } else {
            self.overflow.remove(&id)
        };
        if v.is_some() {
            self.len -= 1;
        }
        v
    }

    /// Every open event's ID, in no order. Walks the whole ring: for the rare paths (a link
    /// closed, the end of a run, a rebuild of the floor's heap).
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.ring
            .iter()
            .filter_map(|s| s.as_ref().map(|(k, _)| *k))
            .chain(self.overflow.keys().copied())
    }
}

#[cfg(test)]
mod tests {
    use super::Table;
    use std::collections::BTreeMap;

    #[test]
    fn behaves_as_a_map_whether_ids_share_slots_or_not() {
        // A ring of 8 slots against a reference map, with IDs that collide in every way: the
        // same slot taken, freed and taken again while an event of that slot waits in the map.
        let mut t: Table<u64> = Table::new(8);
        let mut r: BTreeMap<u64, u64> = BTreeMap::new();
        let mut x = 12345u64;
        for step in 0..20_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let id = x % 40;
            match x % 3 {
                0 => {
                    let v = *t.get_or_insert_with(id, || step);
                    assert_eq!(v, *r.entry(id).or_insert(step), "open {id}");
                }
                1 => assert_eq!(t.remove(id), r.remove(&id), "remove {id}"),
                _ => assert_eq!(t.get(id), r.get(&id), "get {id}"),
            }
            assert_eq!(t.len(), r.len());
        }
        let mut keys: Vec<u64> = t.keys().collect();
        keys.sort_unstable();
        assert_eq!(keys, r.keys().copied().collect::<Vec<_>>());
        assert!(!t.contains_key(u64::MAX));
        *t.get_or_insert_with(u64::MAX, || 1) += 1;
        assert_eq!(t.get(u64::MAX), Some(&2));
    }
}

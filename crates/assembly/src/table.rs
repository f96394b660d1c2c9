//! The table of open events: a ring of slots indexed by event ID, and a map for the events whose
//! slot is taken by another open event.
//!
//! Event IDs are dense and rising, so the open events of a unit are mostly a run of consecutive
//! IDs, which a ring holds in consecutive slots: the lookup at every fragment touches memory the
//! previous fragments touched. A hash map spreads consecutive IDs over all its buckets, and it
//! is as large as the most events ever open at once (hundreds: a source writes hundreds of
//! events per write), so at 1 KiB x 8 the lookup of the open event was the largest single stall
//! of the assembler under `perf annotate`. The ring grows while open IDs spread further than
//! it (a unit's links run apart within its buffer); IDs further apart than its bound (an event
//! held back while the others run ahead) still work, through the map.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use crate::EventIdHasher;

/// Slots of the ring at first: events spread over more IDs than this share slots.
pub const RING_SLOTS: usize = 4096;
/// Most slots the ring grows to (3 MiB of slots at 48 bytes each); past it, IDs that share a slot
/// go to the map.
pub const MAX_RING_SLOTS: usize = 1 << 16;

pub(crate) struct Table<V> {
    ring: Vec<Option<(u64, V)>>,
    mask: u64,
    /// The ring doubles, up to this, when two open events need one slot: at 1 KiB x 8 the open
    /// events of a unit spread over 12 000-15 000 IDs (its links run that far apart within
    /// its buffer), so a ring of 4 096 sent most of them to the map.
    max_slots: usize,
    /// Open events whose slot was taken when they opened.
    overflow: HashMap<u64, V, EventIdHasher>,
    len: usize,
}

impl<V> Table<V> {
    /// The most heap memory a table whose ring may grow to `max_slots` (as [`Table::grow_up_to`]
    /// sets it) holds with at most `entries` open events at once: the ring, and while it
    /// doubles the old one beside it; the map, which std's table may have resized to four
    /// buckets per entry to clear its deleted marks, and while it resizes the old buckets beside
    /// the new.
    pub fn bytes_at_most(max_slots: usize, entries: usize) -> u128 {
        let slots = max_slots
            .checked_next_power_of_two()
            .unwrap_or(MAX_RING_SLOTS)
            .clamp(RING_SLOTS, MAX_RING_SLOTS) as u128;
        let ring = slots * std::mem::size_of::<Option<(u64, V)>>() as u128 * 3 / 2;
        let buckets = 6 * (entries as u128 + 1).next_power_of_two();
        let map = buckets * (std::mem::size_of::<(u64, V)>() as u128 + 1) + 64;
        ring + map
    }

    pub fn new(slots: usize) -> Table<V> {
        let slots = slots.max(2).next_power_of_two();
        Table {
            ring: (0..slots).map(|_| None).collect(),
            mask: slots as u64 - 1,
            max_slots: slots,
            overflow: HashMap::default(),
            len: 0,
        }
    }

    /// Lets the ring grow up to `max` slots (rounded to a power of two, never below its size
    /// now nor above [`MAX_RING_SLOTS`]).
    pub fn grow_up_to(&mut self, max: usize) {
        self.max_slots = max
            .checked_next_power_of_two()
            .unwrap_or(MAX_RING_SLOTS)
            .clamp(self.ring.len(), MAX_RING_SLOTS.max(self.ring.len()));
    }

    /// Doubles the ring and places every open event again: in its slot if free, else the map.
    fn grow(&mut self) {
        let slots = self.ring.len() * 2;
        let old = std::mem::replace(&mut self.ring, (0..slots).map(|_| None).collect());
        self.mask = slots as u64 - 1;
        let mut overflow = std::mem::take(&mut self.overflow);
        for (id, v) in old.into_iter().flatten().chain(overflow.drain()) {
            let s = self.slot(id);
            if self.ring[s].is_none() {
                self.ring[s] = Some((id, v));
            } else {
                self.overflow.insert(id, v);
            }
        }
    }

    fn slot(&self, id: u64) -> usize {
        (id & self.mask) as usize
    }

    fn in_ring(&self, id: u64) -> bool {
        matches!(&self.ring[self.slot(id)], Some((k, _)) if *k == id)
    }

    /// The event `id` if it sits in its ring slot; `None` if it is not open or is in the
    /// overflow map. For hints (prefetching), where the map's lookup would cost more than the
    /// hint saves.
    pub fn get_in_ring(&self, id: u64) -> Option<&V> {
        match &self.ring[self.slot(id)] {
            Some((k, v)) if *k == id => Some(v),
            _ => None,
        }
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

    pub fn get_mut(&mut self, id: u64) -> Option<&mut V> {
        let s = self.slot(id);
        match &self.ring[s] {
            Some((k, _)) if *k == id => self.ring[s].as_mut().map(|(_, v)| v),
            _ if self.overflow.is_empty() => None,
            _ => self.overflow.get_mut(&id),
        }
    }

    /// The event `id`, opened with `open` if it is not open.
    pub fn get_or_insert_with(&mut self, id: u64, open: impl FnOnce() -> V) -> &mut V {
        // An event already in its slot (every fragment of an event but its first) skips the
        // growing and the map.
        if !self.in_ring(id) {
            while self.ring.len() < self.max_slots
                && matches!(&self.ring[self.slot(id)], Some((k, _)) if *k != id)
                && (self.overflow.is_empty() || !self.overflow.contains_key(&id))
            {
                self.grow();
            }
            let s = self.slot(id);
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
        let s = self.slot(id);
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
        behaves_as_a_map(Table::new(8), 40);
        // The same while the ring grows (to 16, then 32) under the open events.
        let mut t = Table::new(8);
        t.grow_up_to(32);
        behaves_as_a_map(t, 100);
    }

    /// The ring doubles, up to its bound, rather than send events to the map; past the bound,
    /// IDs that share a slot still work, through the map.
    #[test]
    fn the_ring_grows_to_hold_the_spread_of_open_events() {
        let mut t: Table<u64> = Table::new(8);
        t.grow_up_to(100);
        for id in 1000..1100 {
            *t.get_or_insert_with(id, || id) += 1;
        }
        assert_eq!(t.ring.len(), 128, "rounded up to a power of two");
        assert!(t.overflow.is_empty(), "100 consecutive IDs fit 128 slots");
        *t.get_or_insert_with(1000 + 128, || 7) += 1;
        assert_eq!(t.ring.len(), 128, "never past its bound");
        assert_eq!(t.overflow.len(), 1);
        for id in 1000..1100 {
            assert_eq!(t.get(id), Some(&(id + 1)));
        }
        assert_eq!(t.remove(1000 + 128), Some(8));
        assert_eq!(t.len(), 100);
        let mut small: Table<u64> = Table::new(8);
        small.grow_up_to(3);
        assert_eq!(small.max_slots, 8, "never below its size");
    }

    fn behaves_as_a_map(mut t: Table<u64>, ids: u64) {
        let mut r: BTreeMap<u64, u64> = BTreeMap::new();
        let mut x = 12345u64;
        for step in 0..20_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let id = x % ids;
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

//! The paged readout buffer of request mode (issue 3; the ATLAS ROS design, seeds/004 §5.3):
//! one link's memory split into pages of a fixed size, allocated once; a fragment takes as many
//! pages as it needs from the link's free-page pool; an index by event ID finds a fragment in
//! constant time; a clear gives its pages back. When the pool cannot hold the next fragment the
//! link must stop reading (back-pressure) — the buffer never grows.
//!
//! Pure data structure, no I/O and no clock. The index hashes the low bits of the event ID into
//! buckets (ATLAS uses the low 20 bits of the L1ID) and compares full 64-bit IDs along the bucket's
//! chain, so IDs that wrap around (a 32-bit front-end counter restarting, or u64::MAX → 0) never
//! alias. Request mode (`serve.rs`) keeps one per link.

/// Why a fragment was not stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// Not enough free pages now: stop reading the link until clears free some.
    #[error("no free pages for {needed} (free: {free})")]
    Full { needed: usize, free: usize },
    /// The fragment needs more pages than the whole buffer has.
    #[error("fragment needs {needed} pages, the buffer has {total}")]
    TooLarge { needed: usize, total: usize },
    /// The event ID is already stored.
    #[error("event ID already buffered")]
    Duplicate,
}

use tessera_net::HugeBuffer;

const NONE: u32 = u32::MAX;

/// A fragment lent by [`PagedBuffer::hold`], to give back with [`PagedBuffer::release`].
#[derive(Debug)]
#[must_use = "a hold keeps the fragment's pages until it is released"]
pub struct Hold {
    entry: u32,
    again: bool,
}

impl Hold {
    /// Whether the fragment had been lent to an answer before this one: a second answer of the
    /// same fragment (request mode, an event asked again after a failover) puts a copy of it into
    /// the system, which the accounting counts as such.
    pub fn again(&self) -> bool {
        self.again
    }
}

/// One page's part of a lent fragment: valid, and unchanged, until its hold is released.
#[derive(Clone, Copy, Debug)]
pub struct Lent {
    pub ptr: *const u8,
    pub len: usize,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    event_id: u64,
    first_page: u32,
    len: u32,
    /// Next entry in the same bucket.
    next: u32,
    /// Lent to an answer at least once (a clear of a fragment never sent is counted).
    sent: bool,
    /// Answers being written straight from this fragment's pages ([`PagedBuffer::hold`]).
    holds: u32,
    /// Cleared while held: out of the index, its pages freed by the last release.
    cleared: bool,
}

/// One link's paged buffer.
pub struct PagedBuffer {
    page_size: usize,
    /// On huge pages: a fragment is read for an answer long after it was stored, in no order
    /// the cache or a 4 KiB TLB can follow.
    memory: HugeBuffer,
    /// Free pages, used as a stack (most recently freed first: warm in cache).
    free_pages: Vec<u32>,
    /// Per page: the next page of the same fragment, or NONE.
    page_next: Box<[u32]>,
    buckets: Box<[u32]>,
    bucket_mask: u64,
    entries: Vec<Entry>,
    free_entries: Vec<u32>,
    stored: usize,
}

impl PagedBuffer {
    /// A buffer of `pages` pages of `page_size` bytes, with `2^index_bits` index buckets.
    pub fn new(page_size: usize, pages: usize, index_bits: u32) -> PagedBuffer {
        assert!(
            page_size > 0 && pages > 0 && pages < NONE as usize,
            "page size and count must be positive"
        );
        let buckets = 1usize << index_bits.min(24);
        PagedBuffer {
            page_size,
            memory: HugeBuffer::zeroed(page_size * pages),
            free_pages: (0..pages as u32).rev().collect(),
            page_next: vec![NONE; pages].into_boxed_slice(),
            buckets: vec![NONE; buckets].into_boxed_slice(),
            bucket_mask: buckets as u64 - 1,
            entries: Vec::new(),
            free_entries: Vec::new(),
            stored: 0,
        }
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn total_pages(&self) -> usize {
        self.page_next.len()
    }

    pub fn free_pages(&self) -> usize {
        self.free_pages.len()
    }

    /// Fragments stored.
    pub fn len(&self) -> usize {
        self.stored
    }

    pub fn is_empty(&self) -> bool {
        self.stored == 0
    }

    /// Pages a fragment of `len` bytes takes (at least one, so that empty fragments are indexed).
    pub fn pages_for(&self, len: usize) -> usize {
        len.div_ceil(self.page_size).max(1)
    }

    /// Whether a fragment of `len` bytes would fit now.
    pub fn fits(&self, len: usize) -> bool {
        self.pages_for(len) <= self.free_pages.len()
    }

    fn bucket(&self, event_id: u64) -> usize {
        (event_id & self.bucket_mask) as usize
    }

    fn find(&self, event_id: u64) -> Option<u32> {
        let mut e = self.buckets[self.bucket(event_id)];
        while e != NONE {
            let entry = &self.entries[e as usize];
            if entry.event_id == event_id {
                return Some(e);
            }
            e = entry.next;
        }
        None
    }

    /// The event IDs stored, in no particular order.
    pub fn event_ids(&self) -> Vec<u64> {
        let mut v = Vec::with_capacity(self.stored);
        for &head in self.buckets.iter() {
            let mut e = head;
            while e != NONE {
                let entry = &self.entries[e as usize];
                v.push(entry.event_id);
                e = entry.next;
            }
        }
        v
    }

    pub fn contains(&self, event_id: u64) -> bool {
        self.find(event_id).is_some()
    }

    /// Copies a fragment into pages and indexes it.
    pub fn store(&mut self, event_id: u64, bytes: &[u8]) -> Result<(), StoreError> {
        let needed = self.pages_for(bytes.len());
        if needed > self.total_pages() {
            return Err(StoreError::TooLarge {
                needed,
                total: self.total_pages(),
            });
        }
        if needed > self.free_pages.len() {
            return Err(StoreError::Full {
                needed,
                free: self.free_pages.len(),
            });
        }
        if self.contains(event_id) {
            return Err(StoreError::Duplicate);
        }
        let mut first = NONE;
        let mut prev = NONE;
        for chunk_index in 0..needed {
            let p = self.free_pages.pop().expect("counted above");
            let start = chunk_index * self.page_size;
            let piece = &bytes[start.min(bytes.len())..(start + self.page_size).min(bytes.len())];
            // SAFETY: page `p` was free, so no answer holds it, and it lies inside `memory`.
            unsafe { self.write_page(p, piece) };
            self.page_next[p as usize] = NONE;
            if prev == NONE {
                first = p;
            } else {
                self.page_next[prev as usize] = p;
            }
            prev = p;
        }
        let b = self.bucket(event_id);
        let entry = Entry {
            event_id,
            first_page: first,
            len: bytes.len() as u32,
            next: self.buckets[b],
            sent: false,
            holds: 0,
            cleared: false,
        };
        let slot = match self.free_entries.pop() {
            Some(i) => {
                self.entries[i as usize] = entry;
                i
            }
            None => {
                self.entries.push(entry);
                (self.entries.len() - 1) as u32
            }
        };
        self.buckets[b] = slot;
        self.stored += 1;
        Ok(())
    }

    /// The fragment's bytes, page by page, in order (no copy).
    pub fn pieces(&self, event_id: u64) -> Option<impl Iterator<Item = &[u8]> + '_> {
        let e = self.entries[self.find(event_id)? as usize];
        let mut page = e.first_page;
        let mut left = e.len as usize;
        let mut first = true;
        Some(std::iter::from_fn(move || {
            if page == NONE || (left == 0 && !first) {
                return None;
            }
            first = false;
            let n = left.min(self.page_size);
            let piece = self.page(page, n);
            left -= n;
            page = self.page_next[page as usize];
            Some(piece)
        }))
    }

    /// Stored length of a fragment.
    pub fn fragment_len(&self, event_id: u64) -> Option<usize> {
        self.find(event_id)
            .map(|e| self.entries[e as usize].len as usize)
    }

    /// Lends a fragment's pages to an answer written straight from them: appends where each
    /// piece is to `out`, marks the fragment sent, and keeps its pages from reuse (a clear
    /// meanwhile takes it out of the index; the pages come free at [`Self::release`]). `None`
    /// if it is not stored.
    pub fn hold(&mut self, event_id: u64, out: &mut Vec<Lent>) -> Option<Hold> {
        let e = self.find(event_id)?;
        let entry = &mut self.entries[e as usize];
        let again = entry.sent;
        entry.sent = true;
        entry.holds += 1;
        let entry = *entry;
        let mut page = entry.first_page;
        let mut left = entry.len as usize;
        while left > 0 && page != NONE {
            let n = left.min(self.page_size);
            out.push(Lent {
                ptr: self.page(page, n).as_ptr(),
                len: n,
            });
            left -= n;
            page = self.page_next[page as usize];
        }
        Some(Hold { entry: e, again })
    }

    /// Gives back what [`Self::hold`] lent: every [`Lent`] piece of it must be out of use.
    /// True when that freed pages (the fragment was cleared while held).
    pub fn release(&mut self, hold: Hold) -> bool {
        let entry = &mut self.entries[hold.entry as usize];
        debug_assert!(entry.holds > 0, "release without a hold");
        entry.holds = entry.holds.saturating_sub(1);
        if entry.holds == 0 && entry.cleared {
            let first = entry.first_page;
            self.free_fragment(hold.entry, first);
            return true;
        }
        false
    }

    /// Bytes `[0, n)` of page `p`.
    fn page(&self, p: u32, n: usize) -> &[u8] {
        let off = p as usize * self.page_size;
        assert!(n <= self.page_size && off + n <= self.memory.len());
        // SAFETY: inside `memory` (checked); only free pages are ever written, and the page of
        // a stored fragment is not free.
        unsafe { std::slice::from_raw_parts(self.memory.base().add(off), n) }
    }

    /// # Safety
    /// Page `p` must be free (not part of a stored or held fragment).
    unsafe fn write_page(&mut self, p: u32, piece: &[u8]) {
        let off = p as usize * self.page_size;
        assert!(piece.len() <= self.page_size && off + piece.len() <= self.memory.len());
        std::ptr::copy_nonoverlapping(piece.as_ptr(), self.memory.base().add(off), piece.len());
    }

    /// Returns a fragment's pages, last first (so its first page is reused first), and its
    /// entry.
    fn free_fragment(&mut self, e: u32, first_page: u32) {
        let mut n = 0;
        let mut p = first_page;
        while p != NONE {
            n += 1;
            p = self.page_next[p as usize];
        }
        let mut at = self.free_pages.len() + n;
        self.free_pages.resize(at, NONE);
        let mut p = first_page;
        while p != NONE {
            at -= 1;
            self.free_pages[at] = p;
            p = self.page_next[p as usize];
        }
        self.free_entries.push(e);
    }

    /// Frees a fragment's pages (a clear). Returns false if the event ID is not stored.
    pub fn clear(&mut self, event_id: u64) -> bool {
        self.remove(event_id).is_some()
    }

    /// Frees a fragment's pages (or, while an answer holds them, at its release); `Some(sent)`
    /// says whether it was ever lent to an answer, `None` that the event ID is not stored.
    pub fn remove(&mut self, event_id: u64) -> Option<bool> {
        let b = self.bucket(event_id);
        let mut prev = NONE;
        let mut e = self.buckets[b];
        while e != NONE {
            let entry = self.entries[e as usize];
            if entry.event_id == event_id {
                if prev == NONE {
                    self.buckets[b] = entry.next;
                } else {
                    self.entries[prev as usize].next = entry.next;
                }
                if entry.holds > 0 {
                    self.entries[e as usize].cleared = true;
                } else {
                    self.free_fragment(e, entry.first_page);
                }
                self.stored -= 1;
                return Some(entry.sent);
            }
            prev = e;
            e = entry.next;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn read(b: &PagedBuffer, ev: u64) -> Option<Vec<u8>> {
        b.pieces(ev)
            .map(|it| it.flat_map(|p| p.iter().copied()).collect())
    }

    #[test]
    fn spans_pages_and_frees_them() {
        let mut b = PagedBuffer::new(4096, 8, 4);
        let data: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        b.store(7, &data).unwrap();
        assert_eq!(b.free_pages(), 5);
        assert_eq!(read(&b, 7).unwrap(), data);
        assert_eq!(b.store(7, &[1]), Err(StoreError::Duplicate));
        b.store(8, &data).unwrap();
        assert_eq!(b.free_pages(), 2);
        assert_eq!(
            b.store(9, &data),
            Err(StoreError::Full { needed: 3, free: 2 })
        );
        assert!(b.clear(7));
        assert_eq!(b.free_pages(), 5);
        b.store(9, &data).unwrap();
        assert_eq!(read(&b, 9).unwrap(), data);
        assert_eq!(read(&b, 8).unwrap(), data);
        assert!(b.clear(8) && b.clear(9));
        assert!(!b.clear(7));
        assert_eq!(
            b.store(1, &vec![0; 9 * 4096]),
            Err(StoreError::TooLarge {
                needed: 9,
                total: 8
            })
        );
    }

    #[test]
    fn a_cleared_fragments_first_page_is_the_next_one_used() {
        let mut b = PagedBuffer::new(64, 8, 4);
        b.store(1, &[5; 64 * 3]).unwrap();
        let first = b.pieces(1).unwrap().next().unwrap().as_ptr();
        let rest: Vec<*const u8> = b.pieces(1).unwrap().skip(1).map(|p| p.as_ptr()).collect();
        assert!(b.clear(1));
        for (ev, want) in [(2, first), (3, rest[0]), (4, rest[1])] {
            b.store(ev, &[6; 10]).unwrap();
            assert_eq!(b.pieces(ev).unwrap().next().unwrap().as_ptr(), want);
        }
    }

    #[test]
    fn a_fragment_cleared_while_lent_keeps_its_pages_until_given_back() {
        let mut b = PagedBuffer::new(64, 4, 2);
        let data: Vec<u8> = (0..100u8).collect();
        b.store(1, &data).unwrap();
        let mut lent = Vec::new();
        let hold = b.hold(1, &mut lent).unwrap();
        assert_eq!(lent.len(), 2);
        assert!(b.clear(1));
        assert!(!b.contains(1) && b.is_empty());
        // Its two pages are not free: the other two are all a store may take.
        assert_eq!(b.free_pages(), 2);
        assert_eq!(
            b.store(2, &[9; 65 * 2]),
            Err(StoreError::Full { needed: 3, free: 2 })
        );
        b.store(2, &[9; 128]).unwrap();
        assert_eq!(lent_bytes(&lent), data);
        assert!(b.release(hold));
        assert_eq!(b.free_pages(), 2);
        // A hold given back before any clear frees nothing; the clear then frees at once.
        let hold = b.hold(2, &mut Vec::new()).unwrap();
        assert!(!hold.again());
        assert!(!b.release(hold));
        // Lent a second time (asked again after a failover): a copy, said so.
        let hold = b.hold(2, &mut Vec::new()).unwrap();
        assert!(hold.again());
        assert!(!b.release(hold));
        assert!(b.clear(2));
        assert_eq!(b.free_pages(), 4);
    }

    #[test]
    fn full_pool_refuses_until_a_clear() {
        let mut b = PagedBuffer::new(100, 4, 2);
        for ev in 0..4 {
            b.store(ev, &[ev as u8; 100]).unwrap();
        }
        assert_eq!(
            b.store(4, &[0; 1]),
            Err(StoreError::Full { needed: 1, free: 0 })
        );
        assert!(b.clear(2));
        b.store(4, &[9; 50]).unwrap();
        assert_eq!(read(&b, 4).unwrap(), vec![9; 50]);
        assert_eq!(read(&b, 3).unwrap(), vec![3; 100]);
    }

    #[test]
    fn wrapped_event_ids_share_buckets_without_aliasing() {
        // With 2^4 buckets, these IDs all land in bucket 0xF or 0x0 and wrap past the 32-bit
        // and 64-bit boundaries.
        let mut b = PagedBuffer::new(64, 64, 4);
        let ids = [
            u32::MAX as u64,
            u32::MAX as u64 + 1,
            u64::MAX,
            0,
            15,
            31,
            (1 << 20) + 15,
        ];
        for (k, id) in ids.iter().enumerate() {
            b.store(*id, &[k as u8; 10]).unwrap();
        }
        for (k, id) in ids.iter().enumerate() {
            assert_eq!(read(&b, *id).unwrap(), vec![k as u8; 10], "id {id}");
        }
        assert!(b.clear(u64::MAX));
        assert!(read(&b, u64::MAX).is_none());
        assert_eq!(read(&b, 15).unwrap(), vec![4; 10]);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Store(u64, usize),
        Clear(u64),
        /// Lend a stored fragment to an answer.
        Hold(u64),
        /// Give back the oldest lent fragment.
        Release,
    }

    /// A fragment lent by `hold`, with the bytes it must still read.
    struct Held {
        ev: u64,
        /// Which store of `ev` was lent: a fragment lent twice holds its pages once, and an
        /// empty fragment lends no piece to tell it by.
        stored: u64,
        /// Cleared since it was lent.
        cleared: bool,
        hold: Hold,
        pieces: Vec<Lent>,
        bytes: Vec<u8>,
    }

    fn lent_bytes(pieces: &[Lent]) -> Vec<u8> {
        pieces
            .iter()
            // SAFETY: the tests read pieces only while their hold lasts.
            .flat_map(|p| {
                unsafe { std::slice::from_raw_parts(p.ptr, p.len) }
                    .iter()
                    .copied()
            })
            .collect()
    }

    proptest! {
        /// The buffer behaves like a map from event ID to bytes with a page budget: every stored
        /// fragment reads back intact, a store fails exactly when the model says it must, and
        /// clears return every page. A fragment lent to an answer reads back intact until it is
        /// given back, whatever is cleared and stored meanwhile, and its pages stay used until
        /// then even if it was cleared.
        #[test]
        fn matches_a_map_model(ops in proptest::collection::vec(prop_oneof![
            3 => (0u64..40, 0usize..700).prop_map(|(e, n)| Op::Store(e.wrapping_sub(20), n)),
            2 => (0u64..40).prop_map(|e| Op::Clear(e.wrapping_sub(20))),
            1 => (0u64..40).prop_map(|e| Op::Hold(e.wrapping_sub(20))),
            1 => Just(Op::Release),
        ], 0..300)) {
            let (page, pages) = (128usize, 24usize);
            let mut b = PagedBuffer::new(page, pages, 3);
            let mut model: HashMap<u64, Vec<u8>> = HashMap::new();
            // The store that put each fragment in: numbers every successful store.
            let mut stored: HashMap<u64, u64> = HashMap::new();
            let mut stores = 0u64;
            let mut held: std::collections::VecDeque<Held> = Default::default();
            let pages_of = |v: &Vec<u8>| v.len().div_ceil(page).max(1);
            // Pages in use: every stored fragment's, and those of cleared fragments still lent
            // (one lent twice counted once).
            let used = |m: &HashMap<u64, Vec<u8>>, h: &std::collections::VecDeque<Held>| {
                let mut cleared: Vec<(u64, usize)> = h
                    .iter()
                    .filter(|x| x.cleared)
                    .map(|x| (x.stored, pages_of(&x.bytes)))
                    .collect();
                cleared.sort();
                cleared.dedup();
                m.values().map(pages_of).sum::<usize>()
                    + cleared.iter().map(|&(_, n)| n).sum::<usize>()
            };
            for op in ops {
                match op {
                    Op::Store(ev, n) => {
                        let data: Vec<u8> = (0..n).map(|i| (i as u64 ^ ev) as u8).collect();
                        let need = n.div_ceil(page).max(1);
                        let free = pages - used(&model, &held);
                        let expect = if need > pages {
                            Err(StoreError::TooLarge { needed: need, total: pages })
                        } else if need > free {
                            Err(StoreError::Full { needed: need, free })
                        } else if model.contains_key(&ev) {
                            Err(StoreError::Duplicate)
                        } else {
                            Ok(())
                        };
                        prop_assert_eq!(b.store(ev, &data), expect);
                        if expect.is_ok() {
                            model.insert(ev, data);
                            stores += 1;
                            stored.insert(ev, stores);
                        }
                    }
                    Op::Clear(ev) => {
                        prop_assert_eq!(b.clear(ev), model.remove(&ev).is_some());
                        for x in held.iter_mut().filter(|x| x.ev == ev) {
                            x.cleared = true;
                        }
                    }
                    Op::Hold(ev) => {
                        let mut pieces = Vec::new();
                        let h = b.hold(ev, &mut pieces);
                        prop_assert_eq!(h.is_some(), model.contains_key(&ev));
                        if let Some(hold) = h {
                            let bytes = model[&ev].clone();
                            prop_assert_eq!(&lent_bytes(&pieces), &bytes);
                            held.push_back(Held { ev, stored: stored[&ev], cleared: false, hold, pieces, bytes });
                        }
                    }
                    Op::Release => {
                        if let Some(x) = held.pop_front() {
                            prop_assert_eq!(&lent_bytes(&x.pieces), &x.bytes);
                            b.release(x.hold);
                        }
                    }
                }
                for x in &held {
                    prop_assert_eq!(&lent_bytes(&x.pieces), &x.bytes);
                }
                prop_assert_eq!(b.free_pages(), pages - used(&model, &held));
                prop_assert_eq!(b.len(), model.len());
            }
            for (ev, data) in &model {
                prop_assert_eq!(&read(&b, *ev).unwrap(), data);
            }
            for x in held.drain(..) {
                b.release(x.hold);
            }
            let ids: Vec<u64> = model.keys().copied().collect();
            for ev in ids {
                prop_assert!(b.clear(ev));
            }
            prop_assert_eq!(b.free_pages(), pages);
        }
    }
}

//! Event assembly, with no I/O and no clock of its own (time is passed in, in nanoseconds).
//!
//! An [`Assembler`] has a fixed set of contributors (a readout unit's links, or a builder's
//! readout units). Items arrive tagged with (contributor, event ID). An event is *ready* when every
//! contributor has delivered its item or is closed (will never deliver again). Ready events come
//! out complete or incomplete with the list of contributors that are missing.
//!
//! An event leaves incomplete only when every contributor it lacks *could have delivered and did
//! not*: at once when each of them is closed, or has moved past the event (in an ordered
//! assembler an item of a later event came from it: its stream is in ascending order, so it
//! skipped this one, and its item for it could only ever be late; in any assembler its peer
//! promised a floor above the event, after everything below it); after the timeout when one of
//! them was read and stayed silent for a whole timeout while the event waited. A contributor
//! that Tessera itself
//! stopped reading (its buffer full because downstream holds the data, or its reader starved of
//! CPU) is none of these, so back-pressure turns into dead time, never into incomplete events.
//! Silence is reported by the reader ([`Assembler::quiet`]) from reads that came back empty, so
//! only the kernel's word that nothing arrived counts as silence.
//!
//! After an event leaves, the assembler remembers which contributors delivered it while its ID
//! is among the last `memory` (a bounded ring indexed by event ID), so a late item or a
//! repeated one (a duplicated event ID) is reported as such instead of opening a new event
//! that could only time out. The table of open events is
//! capped ([`Assembler::with_max_open`]): an item that would open one more is handed back
//! ([`Offer::Full`]) and its contributor waits, which holds its link (back-pressure), unless its
//! event would leave at once (every other contributor closed or past it), which needs no room.

pub mod hint;
mod recent;
mod table;
pub use recent::RecentSet;
pub use table::{MAX_RING_SLOTS, RING_SLOTS};

use std::collections::VecDeque;

/// The hasher of tables keyed by event ID. Std's SipHash was 9 % of the instructions per
/// fragment built (callgrind, 1 KiB x 8); foldhash is a few multiplies, seeded at random per
/// process, and every such table is bounded by configuration, so a peer that picks colliding
/// event IDs can slow a bounded table, never grow one.
pub type EventIdHasher = foldhash::fast::RandomState;

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
    /// The item would open an event past the cap on open events, and the event would not leave
    /// at once: nothing was taken. Offer it again once events have left (the contributor waits
    /// meanwhile: back-pressure).
    Full(T),
}

struct Pending<T> {
    parts: Vec<Option<T>>,
    have: usize,
    /// Contributors that moved past this event without delivering it (each counted once, when
    /// its floor passed the event or when the event opened above it).
    passed: usize,
    first_seen_ns: u64,
}

impl<T> Pending<T> {
    /// Every contributor delivered, or moved past the event, or those that did neither are
    /// closed. `any_closed`: whether any contributor is; while none is (every run until its
    /// end), the counts decide alone. The walk over the parts it saves ran at every item:
    /// O(contributors) per item, and at 256 B x 32 (16 links a unit) 23 % of the readout
    /// unit's `offer` (`perf annotate`).
    fn ready(&self, closed: &[bool], any_closed: bool, past: impl Fn(usize) -> bool) -> bool {
        self.have + self.passed == self.parts.len()
            || (any_closed
                && self
                    .parts
                    .iter()
                    .zip(closed)
                    .enumerate()
                    .all(|(i, (x, &closed))| x.is_some() || closed || past(i)))
    }
}

/// Who delivered each departed event, in a ring indexed by event ID: event `e` lives in slot
/// `e mod capacity` (a power of two) until a later event with the same slot departs, so the
/// memory holds the departed events of the last `capacity` IDs. Event IDs are dense and
/// rising, so consecutive events use consecutive slots and the lookup at every item and the
/// store at every departure touch memory that is already in the cache. (The hash map and
/// queue of departures it replaced kept 65 536 events in scattered buckets: at 1 KiB x 8
/// under `perf`, `depart` fell from 6.1 % to 4.1 % of all samples with the ring, and CPU per
/// GB built by 6-9 %.)
struct Departed {
    /// The event ID in each slot plus one; 0 in a slot never used, so the ring starts as
    /// zeroed pages the system hands out untouched (a builder of a 60-builder system would
    /// otherwise write 512 KiB at start). Event ID u64::MAX, which would be 0, is never
    /// remembered: an item for it after it left opens it again and it times out, counted.
    ids: Vec<u64>,
    /// `words` words of contributor bits per slot.
    bits: Vec<u64>,
    words: usize,
    /// Slots - 1: a power of two, so the slot is a mask, not a division.
    mask: u64,
    /// Where the bits of an event that is not remembered (u64::MAX) are set and forgotten.
    scratch: Vec<u64>,
}

impl Departed {
    fn new(capacity: usize, contributors: usize) -> Departed {
        let capacity = capacity.max(2).next_power_of_two();
        let words = contributors.div_ceil(64).max(1);
        Departed {
            ids: vec![0; capacity],
            bits: vec![0; capacity * words],
            words,
            mask: capacity as u64 - 1,
            scratch: vec![0; words],
        }
    }

    fn slot(&self, event_id: u64) -> usize {
        (event_id & self.mask) as usize
    }

    /// Who delivered `event_id`, if it departed and is still remembered.
    fn get(&self, event_id: u64) -> Option<&[u64]> {
        let s = self.slot(event_id);
        (event_id != u64::MAX && self.ids[s] == event_id + 1)
            .then(|| &self.bits[s * self.words..(s + 1) * self.words])
    }

    /// Remembers that `event_id` departed, with nobody delivered yet: set them with the
    /// returned words.
    fn insert(&mut self, event_id: u64) -> &mut [u64] {
        if event_id == u64::MAX {
            return &mut self.scratch;
        }
        let s = self.slot(event_id);
        self.ids[s] = event_id + 1;
        let w = &mut self.bits[s * self.words..(s + 1) * self.words];
        // Up to 64 contributors the record is one word: a store, not a call to `memset`.
        match w {
            [one] => *one = 0,
            _ => w.fill(0),
        }
        w
    }
}

fn has(bits: &[u64], i: usize) -> bool {
    bits.get(i / 64).is_some_and(|w| w & (1 << (i % 64)) != 0)
}

/// What the assembler knows of one contributor's progress, for the timeout rule.
#[derive(Clone, Copy, Debug, Default)]
struct Progress {
    /// The lowest event ID it may still deliver: from its items when its stream is ordered, or
    /// promised by the peer.
    floor: Option<u64>,
    /// Start of its current silence (reads that came back empty), if it is silent.
    quiet_since: Option<u64>,
    /// When its reader last found it silent.
    quiet_until: u64,
}

/// Counts kept over the assembler's life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AssemblyStats {
    pub complete: u64,
    pub incomplete: u64,
    pub timed_out: u64,
    pub duplicates: u64,
    pub late: u64,
    /// Items handed back because the table of open events was full.
    pub full: u64,
}

/// Puts `id` into `q`, kept in ascending order: on the back when it is the highest (the common
/// case), else where a binary search places it.
fn ascending_insert(q: &mut VecDeque<u64>, id: u64) {
    match q.back() {
        Some(&last) if last > id => {
            let at = q.partition_point(|&x| x < id);
            q.insert(at, id);
        }
        _ => q.push_back(id),
    }
}

pub struct Assembler<T> {
    contributors: usize,
    timeout_ns: u64,
    pending: table::Table<Pending<T>>,
    /// (event ID, first seen) in arrival order; entries for events that left are skipped lazily.
    order: VecDeque<(u64, u64)>,
    /// The open events' IDs in ascending order, lowest first, for the floor (asked at every
    /// progress message): entries of events that left are dropped when they reach the front,
    /// and the queue is rebuilt when they outnumber the open events, so it stays proportional
    /// to them. Events open in rising order nearly always, so an ID goes on the back and leaves
    /// from the front, a few instructions each, where a binary heap's pop cost a hundred
    /// (`bench instructions`); an ID that opens out of order is put in its place by a binary
    /// search, its cost bounded by the table of open events.
    lowest: VecDeque<u64>,
    closed: Vec<bool>,
    open: usize,
    /// Events that left, with who delivered them: the last `memory` event IDs.
    done: Departed,
    held_items: usize,
    progress: Vec<Progress>,
    /// Items of an ordered contributor raise its floor (source links, read in order).
    ordered: bool,
    max_open: usize,
    /// The highest floor of any contributor: an event that opens at or above it has nobody
    /// past it, which spares the look at every contributor when it opens.
    top_floor: u64,
    /// Events that left because a contributor moved past them (an ordered one's later item, or
    /// a promise), ascending, for the caller to take ([`Assembler::take_passed`]).
    passed: Vec<Assembled<T>>,
    /// The contributor that kept the last aged event waiting: checked first by the next sweep,
    /// so a long backlog behind one lagging link costs one look per event.
    last_blocker: usize,
    /// Emptied part lists handed back by the consumer ([`Assembler::recycle`]), reused by the
    /// next events opened instead of allocating: at most [`Assembler::spare_room`] of them.
    spare: Vec<Vec<Option<T>>>,
    pub stats: AssemblyStats,
}

/// How many event IDs ahead of an item [`Assembler::offer`] prefetches the same contributor's
/// part: enough for the load to arrive while this item and the next are handled.
const PREFETCH_AHEAD: u64 = 12;

/// Part lists kept for reuse, at least this many: enough for a batch of departed events.
pub const SPARE_LISTS: usize = 64;

/// ... and as many more as fit in this many bytes. A builder's offer hands over hundreds of
/// parts at once, and the events that one batch completes are followed by as many opened by the
/// next: with 64 kept lists, 33 000 of 40 000 events allocated a fresh one (callgrind, 1 KiB x 8,
/// two readout units).
pub const SPARE_BYTES: usize = 256 << 10;

impl<T> Assembler<T> {
    /// `memory`: how many event IDs back departed events are remembered for late and duplicate
    /// detection (rounded up to a power of two).
    pub fn new(contributors: usize, timeout_ns: u64, memory: usize) -> Self {
        let mut pending = table::Table::new(RING_SLOTS);
        pending.grow_up_to(MAX_RING_SLOTS);
        Assembler {
            contributors,
            timeout_ns,
            pending,
            lowest: Default::default(),
            order: VecDeque::new(),
            closed: vec![false; contributors],
            open: contributors,
            done: Departed::new(memory, contributors),
            held_items: 0,
            progress: vec![Progress::default(); contributors],
            ordered: false,
            max_open: usize::MAX,
            top_floor: 0,
            passed: Vec::new(),
            last_blocker: 0,
            spare: Vec::new(),
            stats: AssemblyStats::default(),
        }
    }

    /// The most heap memory the bookkeeping of an assembler of `contributors` holds, capped at
    /// `max_open` open events ([`Assembler::with_max_open`]; with no cap the figure saturates:
    /// nothing bounds it) and remembering `memory` departed events: its table of open events, their part
    /// lists (`Option<T>` for each contributor, an allocator's 16 bytes apiece), the queues of
    /// their IDs, the events passed and not yet taken (taken after every offer and promise, as
    /// [`Assembler::take_passed`] asks), the lists kept for reuse, and the ring of departed
    /// events. Not the bytes an item points to (the caller's budget), nor the part lists of
    /// events handed to the caller until it gives them back. What `tessera check` counts for a
    /// readout unit or a builder; `tests/memory.rs` holds an assembler to it.
    pub fn bytes_at_most(contributors: usize, max_open: usize, memory: usize) -> u64 {
        // In 128 bits: a cap of open events near 2^64 saturates the figure, not the sum.
        let n = contributors.max(1) as u128;
        // An event older than every open one is taken past the cap, one per contributor.
        let open = max_open.max(1) as u128 + n;
        let part = std::mem::size_of::<Option<T>>() as u128;
        let list = n * part + 16;
        let table = table::Table::<Pending<T>>::bytes_at_most(
            max_open.max(1),
            usize::try_from(open).unwrap_or(usize::MAX),
        );
        let spare = {
            let lists = (SPARE_BYTES as u128 / (n * part.max(1))).max(SPARE_LISTS as u128);
            lists * (list + 16)
        };
        // Events that left by a promise wait in `passed` for the caller, who takes them after
        // every offer and promise ([`Assembler::take_passed`]): at most the events that were
        // open, whose part lists moved there (counted as open above), each with the list of
        // its missing contributors.
        let passed = open * (n * 8 + 16) + 2 * open * std::mem::size_of::<Assembled<T>>() as u128;
        // The ID queues drop the entries of departed events once they outnumber twice the open
        // events and 1 024 (the order queue at every offer, the ascending one at every
        // departure, and opens between two departures are open events). A queue's buffer may
        // be twice its longest length.
        let queued = 3 * open + 1025;
        let queues = 2 * queued * (16 + 8);
        let departed = {
            let slots = (memory.max(2) as u128).next_power_of_two();
            let words = n.div_ceil(64);
            slots * 8 * (1 + words) + 8 * words
        };
        let per_contributor = n * (std::mem::size_of::<Progress>() as u128 + 1);
        let total = table + open * list + spare + passed + queues + departed + per_contributor;
        u64::try_from(total).unwrap_or(u64::MAX)
    }

    /// Caps the table of open (pending) events.
    pub fn with_max_open(mut self, max_open: usize) -> Self {
        self.max_open = max_open.max(1);
        // No more slots than events that may be open (the ring still starts small).
        self.pending.grow_up_to(self.max_open);
        self
    }

    /// Contributors deliver event IDs in ascending order (a front-end's stream), so an item
    /// raises its contributor's floor: it has moved past every lower event it did not deliver.
    pub fn ordered(mut self, ordered: bool) -> Self {
        self.ordered = ordered;
        self
    }

    /// The reader of contributor `c` found nothing to read from `since_ns` to `until_ns` (a read
    /// that waited and came back empty). Consecutive reports extend one silence.
    pub fn quiet(&mut self, c: usize, since_ns: u64, until_ns: u64) {
        let p = &mut self.progress[c];
        if p.quiet_since.is_none() {
            p.quiet_since = Some(since_ns);
        }
        p.quiet_until = p.quiet_until.max(until_ns);
    }

    /// Contributor `c` delivered bytes again: its silence is over.
    pub fn heard(&mut self, c: usize) {
        self.progress[c].quiet_since = None;
    }

    /// Contributor `c` promises it will deliver no event below `floor` (a readout unit's
    /// progress message, read after everything the unit sent before it). Promises only ever
    /// raise the floor. Open events that lack only contributors past them leave, incomplete,
    /// through [`Assembler::take_passed`]: the promise says their items will never come, and
    /// waiting out the timeout held the other contributors' items (their read chunks) for
    /// nothing.
    pub fn promise_floor(&mut self, c: usize, floor: u64) {
        let before = self.progress[c].floor;
        if before.is_some_and(|f| f >= floor) {
            return;
        }
        self.progress[c].floor = Some(floor);
        self.top_floor = self.top_floor.max(floor);
        if !self.lowest.is_empty() {
            self.pass(c, before.unwrap_or(0), floor);
        }
    }

    /// Whether contributor `c` has moved past event `ev`: an ordered one delivered a later
    /// event, or the peer promised a floor above it.
    fn past(&self, c: usize, ev: u64) -> bool {
        self.progress[c].floor.is_some_and(|f| f > ev)
    }

    /// Events that left because a contributor moved past them (an ordered one's later item, or
    /// a promised floor), since the last call, in ascending event-ID order: take them after
    /// every [`Assembler::offer`] and [`Assembler::promise_floor`], and send them before the
    /// offer's own ready event, whose ID is higher.
    pub fn take_passed(&mut self) -> impl Iterator<Item = Assembled<T>> + '_ {
        self.passed.drain(..)
    }

    /// Whether [`Assembler::take_passed`] has anything: one load, for the caller's every offer.
    #[inline]
    pub fn has_passed(&self) -> bool {
        !self.passed.is_empty()
    }

    /// Contributor `c`, whose floor was `from`, is now past every event below `to` (an ordered
    /// one delivered `to`, or a promise): it skipped every event in between. Those open ones
    /// count it as past, and leave if nothing else lacks.
    fn pass(&mut self, c: usize, from: u64, to: u64) {
        let start = self.lowest.partition_point(|&x| x < from);
        let mut ids: Vec<u64> = self
            .lowest
            .range(start..)
            .take_while(|&&x| x < to)
            .copied()
            .collect();
        // An event that left and opened again (its ID forgotten by the bounded memory of
        // departed events) may still have its first entry here: it is counted past once.
        ids.dedup();
        for ev in ids {
            let Some(p) = self.pending.get_mut(ev) else {
                continue;
            };
            if p.parts[c].is_some() {
                continue;
            }
            p.passed += 1;
            if self.ready(ev) {
                let e = self.depart(ev, false);
                self.passed.push(e);
            }
        }
    }

    /// Whether `c` has been silent for at least a timeout (then it could have delivered).
    fn long_silent(&self, c: usize) -> bool {
        let p = &self.progress[c];
        p.quiet_since
            .is_some_and(|s| p.quiet_until.saturating_sub(s) >= self.timeout_ns)
    }

    /// Whether `c` not delivering event `ev` (first seen at `first_seen`) makes the event
    /// incomplete: `c` could have delivered and did not.
    fn excused(&self, c: usize, ev: u64, first_seen: u64) -> bool {
        if self.closed[c] {
            return true;
        }
        let p = &self.progress[c];
        if p.floor.is_some_and(|f| f > ev) {
            return true;
        }
        p.quiet_since
            .is_some_and(|s| p.quiet_until >= s.max(first_seen).saturating_add(self.timeout_ns))
    }

    /// The lowest event ID this assembler may still let out: the lowest open event, and the floor
    /// of every contributor that is open and not long silent. `None` while such a contributor
    /// has not said where it is (it has delivered nothing yet). What a readout unit promises its
    /// builders in its progress messages.
    ///
    /// A contributor left out for its silence caps the floor at the highest any contributor
    /// reached: the assembler promises nothing about events nobody has reached. Without the
    /// cap, a unit whose sources had not connected for a timeout promised `u64::MAX`, and a
    /// builder that trusts promises at once sent the events of sources that connected late on
    /// without them.
    pub fn floor(&self) -> Option<u64> {
        let mut f = u64::MAX;
        let mut left_out = false;
        for (c, p) in self.progress.iter().enumerate() {
            if self.closed[c] {
                continue;
            }
            if self.long_silent(c) {
                left_out = true;
                continue;
            }
            f = f.min(p.floor?);
        }
        if left_out {
            f = f.min(self.top_floor);
        }
        if let Some(m) = self.lowest_open() {
            f = f.min(m);
        }
        Some(f)
    }

    /// The lowest event ID still open (held, waiting for parts).
    pub fn lowest_open(&self) -> Option<u64> {
        self.lowest.front().copied()
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

    /// Whether some contributor is closed: only then can an event be ready short of every part.
    fn any_closed(&self) -> bool {
        self.open < self.contributors
    }

    /// Takes back a departed event's part list once the consumer has emptied it, to hold the
    /// parts of an event opened later: a consumer on the assembler's thread spares an
    /// allocation and a free per event. Lists beyond [`SPARE_LISTS`] are dropped.
    pub fn recycle(&mut self, mut parts: Vec<Option<T>>) {
        if self.spare.len() < self.spare_lists() && parts.capacity() >= self.contributors {
            parts.clear();
            self.spare.push(parts);
        }
    }

    /// How many emptied part lists [`Assembler::recycle`] would keep now.
    pub fn spare_room(&self) -> usize {
        self.spare_lists() - self.spare.len()
    }

    fn spare_lists(&self) -> usize {
        let list = self.contributors.max(1) * std::mem::size_of::<Option<T>>().max(1);
        (SPARE_BYTES / list).max(SPARE_LISTS)
    }

    /// Offers contributor `c`'s item for `event_id`, at time `now_ns`.
    pub fn offer(&mut self, c: usize, event_id: u64, item: T, now_ns: u64) -> Offer<T> {
        if self.closed[c] {
            return Offer::Closed(item);
        }
        // Only an offer opens an event, so checked here the order queue is bounded whether or
        // not sweeps come.
        self.compact_order();
        let before = self.progress[c].floor;
        let below = before.is_some_and(|f| event_id < f);
        // Others may be past this event already, if it opens now: looked for only when some
        // contributor's floor is above it.
        let skipped = self.top_floor > event_id;
        if self.ordered && !below {
            let next = event_id.saturating_add(1);
            self.progress[c].floor = Some(next);
            self.top_floor = self.top_floor.max(next);
            let from = before.unwrap_or(0);
            if event_id > from && !self.lowest.is_empty() {
                self.pass(c, from, event_id);
            }
        }
        self.progress[c].quiet_since = None;
        if let Some(bits) = self.done.get(event_id) {
            return if has(bits, c) {
                self.stats.duplicates += 1;
                Offer::Duplicate(item)
            } else {
                self.stats.late += 1;
                Offer::Late(item)
            };
        }
        if below && self.ordered {
            // Below what it already delivered: the same item again, or one that comes after
            // its successor, read as late (wire-format §1.6): the event went on without it, or
            // will, since this contributor counts as past it.
            return if self
                .pending
                .get(event_id)
                .is_some_and(|p| p.parts[c].is_some())
            {
                self.stats.duplicates += 1;
                Offer::Duplicate(item)
            } else {
                self.stats.late += 1;
                Offer::Late(item)
            };
        }
        // Whether an item below its promise finds its event open (counting it as past).
        let below_open = below && self.pending.contains_key(event_id);
        let n = self.contributors;
        let any_closed = self.any_closed();
        if self.pending.len() >= self.max_open
            && !self.pending.contains_key(event_id)
            && !self.leaves_at_once(c, event_id)
            && !self.oldest_needed(event_id)
        {
            if self.ordered && !below {
                // Past every lower event (its passing stands: those left, or wait for others),
                // but not past this one, which it offers again: with its floor above it, the
                // retry read as late, and back-pressure lost the fragment.
                self.progress[c].floor = Some(event_id);
            }
            self.stats.full += 1;
            return Offer::Full(item);
        }
        // Only where a contributor's items are consecutive events (a source link carries
        // every event): a builder's link carries every n-th, and there the hint would load a
        // ring slot for nothing at every item.
        if self.ordered {
            self.prefetch_part(event_id.wrapping_add(PREFETCH_AHEAD), c);
        }
        let progress = &self.progress;
        let past = |d: usize| progress[d].floor.is_some_and(|f| f > event_id);
        let p = self.pending.get_or_insert_with(event_id, || {
            self.order.push_back((event_id, now_ns));
            ascending_insert(&mut self.lowest, event_id);
            let parts = match self.spare.pop() {
                Some(mut v) => {
                    v.resize_with(n, || None);
                    v
                }
                None => (0..n).map(|_| None).collect(),
            };
            // Nobody delivered this event before (it was not open), so every other
            // contributor whose floor is above it skipped it.
            let passed = if skipped {
                (0..n).filter(|&d| d != c && past(d)).count()
            } else {
                0
            };
            Pending {
                parts,
                have: 0,
                passed,
                first_seen_ns: now_ns,
            }
        });
        if p.parts[c].is_some() {
            self.stats.duplicates += 1;
            return Offer::Duplicate(item);
        }
        if below_open {
            // Below what its peer promised (wire-format §2.3: a source of that unit came back
            // from a silence): the event counted it as past, and now it delivered. A promise
            // is only the word of a peer, so the item still joins an event that has not left.
            p.passed -= 1;
        }
        p.parts[c] = Some(item);
        p.have += 1;
        self.held_items += 1;
        if p.ready(&self.closed, any_closed, past) {
            Offer::Ready(self.depart(event_id, false))
        } else {
            Offer::Held
        }
    }

    /// Starts loading the part `c` of event `event_id` into the cache, if that event is open
    /// and in its ring slot. A link's items come in event order, so its next items will touch
    /// the parts of the next events. Those part lists were written when the first link's item
    /// opened each event, hundreds of events earlier (a read of 256 KiB holds 900 fragments of
    /// 256 B), and by the time the other links' items come they have left the core's cache:
    /// the load of the part was most of `offer`'s time (`perf annotate`).
    /// When that item will complete the event, every line of its parts is asked for: the
    /// consumer of the ready event walks them all next (the walk was half of the readout
    /// unit's `dispatch` at 1 KiB x 8).
    #[inline]
    fn prefetch_part(&self, event_id: u64, c: usize) {
        let Some(p) = self.pending.get_in_ring(event_id) else {
            return;
        };
        if p.have + 1 == p.parts.len() {
            hint::prefetch_all(&p.parts);
        } else if let Some(x) = p.parts.get(c) {
            hint::prefetch(x);
        }
    }

    /// Whether an item of `c` that opens event `event_id` completes it at once: every other
    /// contributor is closed or past it. Such an item needs no room in a full table; refusing
    /// it would hold `c`, and the events in the table may be waiting for `c`'s later items.
    fn leaves_at_once(&self, c: usize, event_id: u64) -> bool {
        (0..self.contributors).all(|d| d == c || self.closed[d] || self.past(d, event_id))
    }

    /// Whether an item that would open event `event_id` in a full table must be taken for the
    /// assembler to go on: its event is older than every open one. The open events then all
    /// wait for later items of their contributors (an open event older than it, lacking a
    /// contributor whose next item is this, would count it as past), so refusing it could hold
    /// every link for good: two links lagging at an event the others skipped, the table full
    /// of later events. Bounded: such events take at most one slot per contributor beyond the
    /// cap (each contributor's items rise, and these only fall below the lowest open event).
    fn oldest_needed(&self, event_id: u64) -> bool {
        self.pending.len() < self.max_open.saturating_add(self.contributors)
            && self.lowest_open().is_none_or(|l| event_id < l)
    }

    fn ready(&self, event_id: u64) -> bool {
        self.pending
            .get(event_id)
            .is_some_and(|p| p.ready(&self.closed, self.any_closed(), |i| self.past(i, event_id)))
    }

    fn depart(&mut self, event_id: u64, timed_out: bool) -> Assembled<T> {
        let p = self
            .pending
            .remove(event_id)
            .expect("departing event is pending");
        self.held_items -= p.have;
        while let Some(&first) = self.lowest.front() {
            if self.pending.contains_key(first) {
                break;
            }
            self.lowest.pop_front();
        }
        if self.lowest.len() > 2 * self.pending.len() + 1024 {
            let mut open: Vec<u64> = self.pending.keys().collect();
            open.sort_unstable();
            self.lowest = open.into();
        }
        let bits = self.done.insert(event_id);
        let mut missing = Vec::new();
        let n = p.parts.len();
        if p.have == n {
            // Every contributor delivered: their bits are the first `n`, and the parts (whose
            // lines, but the last item's, have left the cache since they were filled) need
            // no walk. That walk was 60 % of `depart` at 1 KiB x 8 (`perf annotate`).
            for (w, word) in bits.iter_mut().enumerate() {
                let k = n.saturating_sub(w * 64).min(64);
                *word |= if k == 64 { !0 } else { (1u64 << k) - 1 };
            }
        } else {
            for (i, x) in p.parts.iter().enumerate() {
                if x.is_some() {
                    bits[i / 64] |= 1 << (i % 64);
                } else {
                    missing.push(i);
                }
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
        Assembled {
            event_id,
            parts: p.parts,
            missing,
            timed_out,
            first_seen_ns: p.first_seen_ns,
        }
    }

    /// Events that waited past the timeout and whose missing contributors could all have
    /// delivered (see the crate documentation), oldest first. Events still waiting for a
    /// contributor that Tessera is not reading stay.
    pub fn expire(&mut self, now_ns: u64) -> Vec<Assembled<T>> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.order.len() {
            let (ev, t) = self.order[i];
            let live = self.pending.get(ev).is_some_and(|p| p.first_seen_ns == t);
            if !live {
                if i == 0 {
                    self.order.pop_front();
                } else {
                    i += 1;
                }
                continue;
            }
            if now_ns.saturating_sub(t) < self.timeout_ns {
                break;
            }
            if self.may_leave(ev, t) {
                if i == 0 {
                    self.order.pop_front();
                } else {
                    i += 1;
                }
                out.push(self.depart(ev, true));
            } else {
                i += 1;
            }
        }
        self.compact_order();
        out
    }

    /// Drops the entries of events that left from behind a waiting one, once they make the
    /// order queue more than twice the open events and 1 024: so it stays proportional to the
    /// open events whether or not a sweep comes (checked at every offer and every expiry).
    fn compact_order(&mut self) {
        if self.order.len() > 2 * self.pending.len() + 1024 {
            let pending = &self.pending;
            self.order
                .retain(|(ev, t)| pending.get(*ev).is_some_and(|p| p.first_seen_ns == *t));
        }
    }

    /// Whether every contributor that event `ev` lacks is excused.
    fn may_leave(&mut self, ev: u64, first_seen: u64) -> bool {
        let Some(p) = self.pending.get(ev) else {
            return false;
        };
        let hint = self.last_blocker;
        if hint < self.contributors
            && p.parts[hint].is_none()
            && !self.excused(hint, ev, first_seen)
        {
            return false;
        }
        let blocker = p
            .parts
            .iter()
            .enumerate()
            .find(|(c, x)| x.is_none() && !self.excused(*c, ev, first_seen))
            .map(|(c, _)| c);
        match blocker {
            Some(c) => {
                self.last_blocker = c;
                false
            }
            None => true,
        }
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

    /// Contributor `c` will deliver nothing more: events that waited only for it are ready now.
    pub fn close(&mut self, c: usize) -> Vec<Assembled<T>> {
        if self.closed[c] {
            return Vec::new();
        }
        self.closed[c] = true;
        self.open -= 1;
        let mut ids: Vec<u64> = self.pending.keys().filter(|ev| self.ready(*ev)).collect();
        ids.sort_unstable();
        ids.into_iter().map(|ev| self.depart(ev, false)).collect()
    }

    /// Lets the lowest open event go as it is, incomplete and counted as timed out. For a
    /// consumer that found its open events waiting on each other's items that it cannot read
    /// (every contributor held for memory that those same events hold): nothing else can end
    /// that, and the oldest event is the one every later one waits behind.
    pub fn let_go_oldest(&mut self) -> Option<Assembled<T>> {
        let ev = self.lowest_open()?;
        Some(self.depart(ev, true))
    }

    /// Sends every pending event out as it is (at the end of a run, or an abort).
    pub fn flush(&mut self) -> Vec<Assembled<T>> {
        let mut ids: Vec<u64> = self.pending.keys().collect();
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

    /// A part list handed back holds the next event's parts from empty (nothing of the old
    /// event's left in it), and no more than `SPARE_LISTS` lists are kept.
    #[test]
    fn recycled_part_lists_start_empty_and_are_bounded() {
        let mut a = Assembler::new(3, 1000, 100);
        a.offer(0, 1, 10, 0);
        a.offer(1, 1, 11, 0);
        let Offer::Ready(e) = a.offer(2, 1, 12, 0) else {
            panic!("event 1 complete")
        };
        let ptr = e.parts.as_ptr();
        // Handed back as it came (full): the list is emptied here.
        a.recycle(e.parts);
        a.offer(1, 2, 21, 0);
        a.offer(2, 2, 22, 0);
        // Contributor 0 closes: event 2, waiting only for it, leaves.
        let mut out = a.close(0);
        assert_eq!(out.len(), 1);
        let e = out.remove(0);
        assert_eq!(e.event_id, 2);
        assert_eq!(e.parts, vec![None, Some(21), Some(22)]);
        assert_eq!(e.parts.as_ptr(), ptr, "the handed-back list was reused");
        let most = (SPARE_BYTES / (3 * std::mem::size_of::<Option<i32>>())).max(SPARE_LISTS);
        assert_eq!(a.spare_room(), most);
        for _ in 0..most + 10 {
            a.recycle(Vec::with_capacity(3));
        }
        assert_eq!(a.spare.len(), most);
        assert_eq!(a.spare_room(), 0);
        // Too short for this assembler's contributors: not kept.
        let mut b = Assembler::<u8>::new(3, 1000, 100);
        b.recycle(Vec::with_capacity(2));
        assert!(b.spare.is_empty());
    }

    #[test]
    fn timeout_names_missing_and_late_is_reported() {
        let mut a = Assembler::new(3, 1000, 100);
        a.offer(0, 1, 0u8, 0);
        a.offer(1, 1, 0u8, 10);
        a.quiet(2, 0, 999);
        assert!(a.expire(999).is_empty());
        a.quiet(2, 999, 1000);
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
    fn with_a_contributor_closed_an_event_still_waits_for_the_open_ones() {
        let mut a = Assembler::new(3, u64::MAX, 100);
        assert!(a.close(2).is_empty());
        assert!(matches!(a.offer(0, 1, (), 0), Offer::Held));
        match a.offer(1, 1, (), 0) {
            Offer::Ready(e) => assert_eq!(e.missing, vec![2]),
            o => panic!("{o:?}"),
        }
    }

    #[test]
    fn every_contributor_of_a_complete_event_is_remembered_at_any_count() {
        for n in [1, 2, 63, 64, 65, 128, 130] {
            let mut a = Assembler::new(n, u64::MAX, 16);
            for c in 0..n - 1 {
                assert!(matches!(a.offer(c, 5, (), 0), Offer::Held));
            }
            assert!(matches!(a.offer(n - 1, 5, (), 0), Offer::Ready(e) if e.is_complete()));
            for c in 0..n {
                assert!(
                    matches!(a.offer(c, 5, (), 1), Offer::Duplicate(())),
                    "n {n} c {c}"
                );
            }
        }
    }

    #[test]
    fn sweep_flushes_only_when_all_closed() {
        let mut a = Assembler::new(2, 100, 10);
        a.offer(0, 1, (), 0);
        let (out, done) = a.sweep(50);
        assert!(out.is_empty() && !done);
        a.offer(0, 2, (), 60);
        a.quiet(1, 0, 100);
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
        a.quiet(129, 0, 10);
        let out = a.expire(10);
        assert_eq!(out[0].missing, vec![129]);
        assert!(matches!(a.offer(128, 7, 0, 11), Offer::Duplicate(_)));
        assert!(matches!(a.offer(129, 7, 0, 11), Offer::Late(_)));
    }

    #[test]
    fn departed_events_are_remembered_for_the_last_memory_ids_then_forgotten() {
        // memory 8: event 3 is remembered until event 11 (same slot) departs.
        let mut a = Assembler::new(2, 1000, 8);
        for ev in 0..11u64 {
            a.offer(0, ev, (), 0);
            assert!(matches!(a.offer(1, ev, (), 0), Offer::Ready(_)));
        }
        assert!(matches!(a.offer(1, 3, (), 1), Offer::Duplicate(_)));
        assert!(matches!(a.offer(0, 10, (), 1), Offer::Duplicate(_)));
        a.offer(0, 11, (), 1);
        assert!(matches!(a.offer(1, 11, (), 1), Offer::Ready(_)));
        // Event 3 is forgotten: an item for it opens it anew, counted by nobody as late.
        assert!(matches!(a.offer(1, 3, (), 2), Offer::Held));
        assert_eq!(a.pending_events(), 1);
        // An event ID whose slot was never used is not remembered.
        let mut b = Assembler::new(2, 1000, 8);
        assert!(matches!(b.offer(0, 5, (), 0), Offer::Held));
        assert!(matches!(b.offer(0, 6, (), 0), Offer::Held));
        assert_eq!(b.pending_events(), 2);
        // u64::MAX is never remembered, and takes no other event's place.
        let mut c = Assembler::new(2, 1000, 8);
        c.offer(0, 7, (), 0);
        assert!(matches!(c.offer(1, 7, (), 0), Offer::Ready(_)));
        c.offer(0, u64::MAX, (), 0);
        assert!(matches!(c.offer(1, u64::MAX, (), 0), Offer::Ready(_)));
        assert!(matches!(c.offer(1, u64::MAX, (), 0), Offer::Held));
        assert!(matches!(c.offer(1, 7, (), 0), Offer::Duplicate(_)));
    }

    #[test]
    fn a_link_that_is_not_being_read_never_times_an_event_out() {
        // Contributor 1 is held (its buffer full, or its reader without CPU): no quiet reports,
        // no items. However long the event waits, it stays.
        let mut a = Assembler::new(2, 1000, 100);
        a.offer(0, 1, (), 0);
        assert!(a.expire(1_000_000_000).is_empty());
        assert_eq!(a.pending_events(), 1);
        match a.offer(1, 1, (), 1_000_000_001) {
            Offer::Ready(e) => assert!(e.is_complete()),
            o => panic!("{o:?}"),
        }
        assert_eq!(a.stats.late, 0);
    }

    #[test]
    fn silence_counts_only_while_the_event_waits_and_only_unbroken() {
        let mut a = Assembler::new(2, 1000, 100);
        a.quiet(1, 0, 500);
        a.offer(0, 1, (), 400);
        a.heard(1);
        // A new silence from 900: it must last a whole timeout from there.
        a.quiet(1, 900, 1400);
        assert!(a.expire(1400).is_empty());
        a.quiet(1, 1400, 1899);
        assert!(a.expire(1899).is_empty());
        a.quiet(1, 1899, 1900);
        let out = a.expire(1900);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].missing, vec![1]);
    }

    #[test]
    fn silence_before_the_event_counts_when_it_goes_on() {
        let mut a = Assembler::new(2, 1000, 100);
        a.quiet(1, 0, 500);
        a.offer(0, 1, (), 400);
        a.quiet(1, 500, 1399);
        assert!(
            a.expire(1399).is_empty(),
            "a timeout has not passed since the event came"
        );
        a.quiet(1, 1399, 1400);
        assert_eq!(a.expire(1400).len(), 1);
    }

    #[test]
    fn letting_the_oldest_go_takes_the_lowest_open_event_only() {
        let mut a = Assembler::new(2, 1000, 100);
        assert!(a.let_go_oldest().is_none());
        for ev in [7, 3, 9] {
            assert!(matches!(a.offer(0, ev, ev, 0), Offer::Held));
        }
        let e = a.let_go_oldest().unwrap();
        assert_eq!(
            (e.event_id, e.missing.as_slice(), e.timed_out),
            (3, &[1][..], true)
        );
        assert_eq!(a.pending_events(), 2);
        assert_eq!(a.lowest_open(), Some(7));
        // Its other part comes too late, and the rest still completes.
        assert!(matches!(a.offer(1, 3, 3, 1), Offer::Late(_)));
        assert!(matches!(a.offer(1, 7, 7, 1), Offer::Ready(_)));
    }

    #[test]
    fn an_ordered_link_past_the_event_makes_it_incomplete_at_once() {
        let mut a = Assembler::new(3, 1000, 100).ordered(true);
        assert!(matches!(a.offer(0, 3, 'a', 0), Offer::Held));
        assert!(matches!(a.offer(1, 4, 'b', 10), Offer::Held)); // link 1 skipped event 3
        assert_eq!(a.take_passed().count(), 0, "event 3 still waits for link 2");
        assert!(matches!(a.offer(2, 3, 'c', 20), Offer::Ready(e) if e.missing == vec![1]));
        assert_eq!(a.stats.timed_out, 0);
        // Link 2 skips 4 and 5: event 4 lacked only it, so it leaves with the offer of 6,
        // before it (its ID is lower).
        assert!(matches!(a.offer(0, 4, 'd', 30), Offer::Held));
        assert!(matches!(a.offer(2, 6, 'e', 40), Offer::Held));
        let out: Vec<_> = a.take_passed().collect();
        assert_eq!(out.iter().map(|e| e.event_id).collect::<Vec<_>>(), vec![4]);
        assert_eq!(out[0].missing, vec![2]);
        // Event 5 opens above link 2's floor: link 2 counts as past it from the start.
        assert!(matches!(a.offer(0, 5, 'f', 50), Offer::Held));
        assert!(matches!(a.offer(1, 5, 'g', 50), Offer::Ready(e) if e.missing == vec![2]));
        // Event 6 waits for links 0 and 1, which have not moved past it.
        assert!(a.expire(1_000_000).is_empty());
        assert_eq!(a.pending_events(), 1);
        // An item below its link's floor is late (wire-format 1.6), the same one again a
        // duplicate; neither opens or joins an event.
        assert!(matches!(a.offer(1, 3, 'h', 60), Offer::Late('h')));
        assert!(matches!(a.offer(2, 6, 'i', 60), Offer::Duplicate('i')));
        assert!(matches!(a.offer(2, 5, 'j', 60), Offer::Late('j')));
        assert_eq!((a.stats.late, a.stats.duplicates), (2, 1));
    }

    #[test]
    fn a_promised_floor_releases_at_once_events_the_peer_will_never_send() {
        let mut a = Assembler::new(3, 1000, 100);
        a.offer(0, 10, (), 0);
        a.offer(0, 20, (), 0);
        a.offer(2, 10, (), 0);
        a.offer(0, 30, (), 0);
        a.promise_floor(1, 25);
        assert!(a.has_passed());
        // Event 10 lacked only contributor 1; 20 still lacks 2, which promised nothing.
        let out: Vec<u64> = a.take_passed().map(|e| e.event_id).collect();
        assert_eq!(out, vec![10]);
        a.promise_floor(1, 12); // promises never go back
        assert!(!a.has_passed());
        assert!(a.expire(1000).is_empty(), "2 is not silent: event 20 waits");
        // Event 20 leaves once 2 delivers, without 1: no timeout.
        match a.offer(2, 20, (), 5) {
            Offer::Ready(e) => assert_eq!(e.missing, vec![1]),
            o => panic!("{o:?}"),
        }
        // An event that opens below a promise leaves as soon as the rest delivered.
        a.offer(0, 22, (), 6);
        match a.offer(2, 22, (), 6) {
            Offer::Ready(e) => assert_eq!(e.missing, vec![1]),
            o => panic!("{o:?}"),
        }
        // An item below its promise broke it: late if its event left, else it joins it.
        assert!(matches!(a.offer(1, 20, (), 7), Offer::Late(())));
        assert!(matches!(a.offer(0, 24, (), 7), Offer::Held));
        assert!(matches!(a.offer(1, 24, (), 7), Offer::Held));
        match a.offer(2, 24, (), 7) {
            Offer::Ready(e) => assert!(e.is_complete()),
            o => panic!("{o:?}"),
        }
        assert_eq!(a.pending_events(), 1, "event 30 waits for 1 and 2");
        // Event 30 lacks 1 (promised to 25 only) and 2: it waits, without a timeout's help.
        assert!(a.expire(1000).is_empty());
    }

    #[test]
    fn a_waiting_event_does_not_hold_back_one_that_may_leave() {
        let mut a = Assembler::new(3, 1000, 100);
        a.offer(0, 1, (), 0);
        a.offer(1, 1, (), 0); // event 1 waits for 2, which is held
        a.offer(0, 2, (), 10);
        a.offer(2, 2, (), 10); // event 2 waits for 1, which is silent
        a.quiet(1, 0, 2000);
        let out = a.expire(2000);
        assert_eq!(out.iter().map(|e| e.event_id).collect::<Vec<_>>(), vec![2]);
        assert_eq!(a.pending_events(), 1);
    }

    /// With the table full, an item whose event every other contributor has moved past (or
    /// promised past) still goes in: it leaves at once, needing no room. Refused, it held its
    /// contributor, whose later items the full table's events wait for: every link alive and
    /// held, nothing could time out, and the unit stood still for good.
    #[test]
    fn a_full_table_takes_an_item_that_leaves_at_once() {
        let mut a = Assembler::new(2, 1000, 100).ordered(true).with_max_open(2);
        // Link 1 skipped event 1 and is ahead: events 2 and 3 wait for link 0.
        assert!(matches!(a.offer(1, 2, 'b', 0), Offer::Held));
        assert!(matches!(a.offer(1, 3, 'c', 0), Offer::Held));
        match a.offer(0, 1, 'a', 0) {
            Offer::Ready(e) => assert_eq!((e.event_id, e.missing), (1, vec![1])),
            o => panic!("{o:?}"),
        }
        assert!(matches!(a.offer(0, 2, 'x', 0), Offer::Ready(_)));
        // The same for a promise (a builder's readout units).
        let mut b = Assembler::new(2, 1000, 100).with_max_open(1);
        assert!(matches!(b.offer(1, 5, 'b', 0), Offer::Held));
        b.promise_floor(1, 4);
        match b.offer(0, 3, 'a', 0) {
            Offer::Ready(e) => assert_eq!((e.event_id, e.missing), (3, vec![1])),
            o => panic!("{o:?}"),
        }
        assert!(matches!(b.offer(0, 6, 'c', 0), Offer::Full('c')));
        assert_eq!(b.stats.full, 1);
    }

    /// An item handed back by a full table, offered again once there is room, goes in: it is
    /// not read as below its contributor's floor (late), which lost it.
    #[test]
    fn an_item_handed_back_by_a_full_table_goes_in_when_offered_again() {
        let mut a = Assembler::new(2, 1000, 100).ordered(true).with_max_open(1);
        assert!(matches!(a.offer(0, 1, 'a', 0), Offer::Held));
        assert!(matches!(a.offer(0, 2, 'b', 0), Offer::Full('b')));
        assert!(matches!(a.offer(1, 1, 'c', 0), Offer::Ready(_)));
        assert!(matches!(a.offer(0, 2, 'b', 0), Offer::Held));
        match a.offer(1, 2, 'd', 0) {
            Offer::Ready(e) => assert!(e.is_complete()),
            o => panic!("{o:?}"),
        }
        assert_eq!(a.stats.late, 0);
    }

    #[test]
    fn the_open_event_table_is_capped_and_hands_items_back() {
        let mut a = Assembler::new(2, 1000, 100).with_max_open(2);
        assert!(matches!(a.offer(0, 1, 'a', 0), Offer::Held));
        assert!(matches!(a.offer(0, 2, 'b', 0), Offer::Held));
        assert!(matches!(a.offer(0, 3, 'c', 0), Offer::Full('c')));
        // Items of open events still go in, and free room.
        assert!(matches!(a.offer(1, 1, 'x', 0), Offer::Ready(_)));
        assert!(matches!(a.offer(0, 3, 'c', 0), Offer::Held));
        assert_eq!(a.stats.full, 1);
    }

    #[test]
    fn the_lowest_open_event_holds_through_disorder_and_rebuilds() {
        // Thousands of events opened out of order and finished in another order, enough that
        // the entries of departed events outnumber the open ones and the queue is rebuilt.
        let mut a = Assembler::new(2, u64::MAX / 4, 100_000).with_max_open(100_000);
        let mut open = std::collections::BTreeSet::new();
        let mut x = 12345u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut opened = Vec::new();
        for round in 0..6u64 {
            for _ in 0..3000 {
                let ev = round * 2000 + next() % 4000;
                if open.contains(&ev) || opened.contains(&ev) {
                    continue;
                }
                assert!(matches!(a.offer(0, ev, (), 0), Offer::Held));
                open.insert(ev);
                opened.push(ev);
                assert_eq!(a.lowest_open(), open.first().copied());
            }
            let mut still: Vec<u64> = open.iter().copied().collect();
            for i in (1..still.len()).rev() {
                still.swap(i, (next() % (i as u64 + 1)) as usize);
            }
            for ev in still.into_iter().take(open.len() * 9 / 10) {
                assert!(matches!(a.offer(1, ev, (), 0), Offer::Ready(_)));
                open.remove(&ev);
                assert_eq!(a.lowest_open(), open.first().copied());
            }
        }
        assert!(a.lowest.len() <= 2 * a.pending_events() + 1024);
    }

    #[test]
    fn floor_is_the_lowest_event_still_to_leave() {
        let mut a = Assembler::new(2, 1000, 100).ordered(true);
        assert_eq!(a.floor(), None, "nobody has said where it is");
        a.offer(0, 5, (), 0);
        a.offer(0, 6, (), 0);
        assert_eq!(a.floor(), None);
        a.offer(1, 5, (), 0);
        assert_eq!(a.floor(), Some(6), "event 6 is still open");
        a.offer(1, 7, (), 0);
        let passed: Vec<u64> = a.take_passed().map(|e| e.event_id).collect();
        assert_eq!(passed, vec![6], "link 1 skipped event 6");
        assert_eq!(a.floor(), Some(7), "link 0 may still send 7");
        a.quiet(0, 0, 1000);
        assert_eq!(a.floor(), Some(7), "a long-silent link makes no claim");
        a.close(1);
        assert_eq!(a.floor(), Some(7), "event 7 waits for link 0");
    }

    /// Links that never connected (silent from the start) promise nothing about events no
    /// link has reached: a unit whose sources connect late sent `u64::MAX`.
    #[test]
    fn silent_links_leave_the_floor_at_what_was_reached() {
        let mut a = Assembler::<()>::new(2, 1000, 100).ordered(true);
        a.quiet(0, 0, 2000);
        a.quiet(1, 0, 2000);
        assert_eq!(a.floor(), Some(0));
        a.offer(1, 3, (), 2000);
        a.quiet(0, 0, 4000);
        a.quiet(1, 2000, 4000);
        assert_eq!(a.floor(), Some(3), "event 3 is open");
        assert_eq!(a.expire(4000).len(), 1);
        assert_eq!(a.floor(), Some(4), "nobody reached 4");
    }
}

//! The event manager's decisions, as a pure state machine (no I/O, no clock: the caller passes
//! the time), so that they can be tested against a model: which builder gets which event, when a
//! builder is dead, what is cleared, when the readout units are told BUSY.
//!
//! It starts by gathering: nothing is assigned or cleared until every builder of the topology
//! has spoken (its credit, or its rejoin when this manager takes a run over from a lost one) and
//! every readout unit has connected, or `heartbeat_timeout` has passed. Otherwise a manager
//! taking a run over could give an event to one builder before hearing that another holds it.

use std::collections::{BTreeSet, HashMap, HashSet};

use tessera_assembly::RecentSet;

use tessera_format::request::{Outcome, ASSIGN_REBUILD};

/// What the manager wants sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Out {
    /// To the builder in this slot.
    Assign(usize, Vec<(u64, u32)>),
    /// To every readout unit.
    Clear(Vec<u64>),
    /// To every readout unit.
    Throttle(bool),
    /// To the builder in this slot: it is declared dead; close its connection.
    Drop(usize),
}

#[derive(Clone, Copy, Debug)]
pub struct Settings {
    pub clear_group: usize,
    pub clear_delay_ns: u64,
    pub heartbeat_timeout_ns: u64,
    pub busy_threshold: usize,
    /// Finished event IDs remembered, so that a late announcement of one is ignored.
    pub done_memory: usize,
    /// The credit a builder gives (`request.credits`): at most this many assignments wait for
    /// a builder that does not read them, each using one.
    pub builder_credits: u32,
    /// How long the run goes on with every builder lost, waiting for one to come back
    /// (`event_manager.takeover_s`): past that nothing could ever be built, and the manager
    /// ends the run.
    pub builder_wait_ns: u64,
}

/// Who the manager waits for before it assigns anything.
struct Gathering {
    until_ns: u64,
    builders: HashSet<u32>,
    readout_units: HashSet<u32>,
}

struct Builder {
    id: u32,
    alive: bool,
    credits: u64,
    last_heard_ns: u64,
    /// When the latest read of its connection that found nothing began: a builder is silent
    /// for the heartbeat timeout only once a read proves it. Time in which the manager did not
    /// read (stalled, starved of a core) says nothing of the builder, whose heartbeats may be
    /// waiting in the socket.
    looked_ns: u64,
    /// Events given to it and not finished.
    holding: HashSet<u64>,
    /// It has sent its credit or its rejoin.
    spoke: bool,
}

struct InFlight {
    builder: Option<usize>,
    since_ns: u64,
    rebuild: bool,
}

/// Counters the manager keeps (all monotonic but `in_flight`, `unassigned`, `busy`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub announced: u64,
    pub assigned: u64,
    pub reassigned: u64,
    pub recorded: u64,
    pub rejected: u64,
    /// Done reports for events not in flight (finished already, e.g. by a builder declared dead
    /// that was only slow).
    pub stale_done: u64,
    pub clears_sent: u64,
    pub cleared_events: u64,
    pub dead_builders: u64,
    pub busy_transitions: u64,
    /// Taking a run over: events a builder said it held, left with it.
    pub adopted: u64,
    /// Taking a run over: events a builder said it had finished, cleared when a readout unit
    /// announced them (not built again).
    pub finished_before: u64,
    /// Connections refused (unknown or duplicate identity, bad hello).
    pub refused_connections: u64,
    /// Announcements with no event: a readout unit's pages are full and it waits for clears
    /// (request-protocol §3.5), so the next clear goes at once.
    pub units_full: u64,
}

pub struct Core {
    s: Settings,
    builders: Vec<Builder>,
    next_builder: usize,
    events: HashMap<u64, InFlight>,
    /// Announced and not yet given to a builder, assigned lowest event ID first: each builder
    /// then asks for its events in ascending order, which the readout units' answer order and
    /// the builders' small read buffers rely on (request-protocol §4.3). Announcements come in
    /// that order from each unit already; a rebuild (older) goes before them.
    unassigned: BTreeSet<u64>,
    done: RecentSet,
    clears: Vec<u64>,
    oldest_clear_ns: u64,
    busy: bool,
    /// A readout unit said it is full since the last clear went: the next finished event's
    /// clear goes at once.
    unit_full: bool,
    gathering: Option<Gathering>,
    /// Finished according to a rejoining builder (the last `done_memory` of them): cleared when
    /// a readout unit announces one, since it still holds it.
    finished_elsewhere: RecentSet,
    /// Of those, the ones a readout unit announced (and were cleared): one clear is enough.
    cleared_elsewhere: RecentSet,
    /// Since when no builder has been alive (after the gathering): see [`Self::builderless_ns`].
    builderless_since: Option<u64>,
    pub counts: Counts,
}

impl Core {
    /// A manager for these builders and readout units, gathering them from `now_ns` on.
    pub fn new(s: Settings, builders: &[u32], readout_units: &[u32], now_ns: u64) -> Core {
        let everyone = builders.len() + readout_units.len();
        Core {
            gathering: (everyone > 0).then(|| Gathering {
                until_ns: now_ns.saturating_add(s.heartbeat_timeout_ns),
                builders: builders.iter().copied().collect(),
                readout_units: readout_units.iter().copied().collect(),
            }),
            finished_elsewhere: RecentSet::new(s.done_memory),
            cleared_elsewhere: RecentSet::new(s.done_memory),
            s,
            builders: Vec::new(),
            next_builder: 0,
            events: HashMap::new(),
            unassigned: BTreeSet::new(),
            done: RecentSet::new(s.done_memory),
            clears: Vec::new(),
            oldest_clear_ns: 0,
            busy: false,
            unit_full: false,
            builderless_since: None,
            counts: Counts::default(),
        }
    }

    /// How long no builder has been alive, as of the last tick (zero while one is, or while
    /// gathering): every builder lost and none back, nothing can be built.
    pub fn builderless_ns(&self, now_ns: u64) -> u64 {
        self.builderless_since
            .map_or(0, |t| now_ns.saturating_sub(t))
    }

    /// A builder connected; returns its slot.
    pub fn builder_joined(&mut self, id: u32, now_ns: u64) -> usize {
        self.builders.push(Builder {
            id,
            alive: true,
            credits: 0,
            last_heard_ns: now_ns,
            looked_ns: now_ns,
            holding: HashSet::new(),
            spoke: false,
        });
        self.builders.len() - 1
    }

    /// Whether a builder with this ID is alive (its connection open): a second one is refused.
    pub fn builder_alive(&self, id: u32) -> bool {
        self.builders.iter().any(|b| b.alive && b.id == id)
    }

    /// A readout unit connected (again).
    pub fn readout_unit_joined(&mut self, id: u32, now_ns: u64, out: &mut Vec<Out>) {
        if let Some(g) = &mut self.gathering {
            g.readout_units.remove(&id);
        }
        self.end_gathering(now_ns, out);
    }

    /// Still waiting for the builders and readout units to gather.
    pub fn gathering(&self) -> bool {
        self.gathering.is_some()
    }

    fn spoke(&mut self, slot: usize, now_ns: u64, out: &mut Vec<Out>) {
        let b = &mut self.builders[slot];
        b.last_heard_ns = now_ns;
        if !b.spoke {
            b.spoke = true;
            let id = b.id;
            if let Some(g) = &mut self.gathering {
                g.builders.remove(&id);
            }
            self.end_gathering(now_ns, out);
        }
    }

    fn end_gathering(&mut self, now_ns: u64, out: &mut Vec<Out>) {
        let over = match &self.gathering {
            None => return,
            Some(g) => {
                (g.builders.is_empty() && g.readout_units.is_empty()) || now_ns >= g.until_ns
            }
        };
        if over {
            self.gathering = None;
            if self.clears.len() >= self.s.clear_group {
                self.flush_clears(out);
            }
            self.assign(out);
        }
    }

    /// A builder connected again (this manager takes the run over from a lost one, or had
    /// wrongly declared it dead): `held` are the events it is building, `done` those it
    /// finished most recently. A held event stays with it unless another builder has it now
    /// (then both build it: the first done counts, the recorder drops the second copy); a
    /// finished one is never assigned again, and is cleared where a readout unit still holds it.
    pub fn rejoin(
        &mut self,
        slot: usize,
        held: &[u64],
        done: &[(u64, Outcome)],
        now_ns: u64,
        out: &mut Vec<Out>,
    ) {
        if !self.builders[slot].alive {
            return;
        }
        let mut unqueued = HashSet::new();
        for &(e, _) in done {
            if let Some(f) = self.events.remove(&e) {
                match f.builder {
                    Some(b) => {
                        self.builders[b].holding.remove(&e);
                    }
                    None => {
                        unqueued.insert(e);
                    }
                }
                self.counts.finished_before += 1;
                self.finish(e, now_ns, out);
            } else if !self.done.contains(e) {
                self.done.insert(e);
                self.finished_elsewhere.insert(e);
            }
        }
        for &e in held {
            match self.events.get_mut(&e) {
                Some(f) if f.builder.is_none() => {
                    f.builder = Some(slot);
                    unqueued.insert(e);
                    self.builders[slot].holding.insert(e);
                    self.counts.adopted += 1;
                }
                Some(_) => {}
                None if self.done.contains(e) => {}
                None => {
                    self.events.insert(
                        e,
                        InFlight {
                            builder: Some(slot),
                            since_ns: now_ns,
                            rebuild: false,
                        },
                    );
                    self.builders[slot].holding.insert(e);
                    self.counts.adopted += 1;
                }
            }
        }
        if !unqueued.is_empty() {
            self.unassigned.retain(|e| !unqueued.contains(e));
        }
        self.spoke(slot, now_ns, out);
        self.assign(out);
    }

    /// Queues a finished event's clear. The group goes when it is full, or at once when no
    /// other event is in flight: then no more finished events will join it soon, and the
    /// readout units may be waiting for exactly these clears to read the next events (pages
    /// that hold fewer events than a group). Waiting out the delay there made every group wait
    /// `clear_delay_ms`: 448 events/s instead of 10 774 with pages of about 32 events per link
    /// (16 KiB x 8, `readout.buffer` 2 MiB), the units BUSY meanwhile.
    fn finish(&mut self, e: u64, now_ns: u64, out: &mut Vec<Out>) {
        self.done.insert(e);
        if self.clears.is_empty() {
            self.oldest_clear_ns = now_ns;
        }
        self.clears.push(e);
        if self.clears.len() >= self.s.clear_group || self.events.is_empty() || self.unit_full {
            self.flush_clears(out);
        }
    }

    pub fn builder_id(&self, slot: usize) -> u32 {
        self.builders[slot].id
    }

    pub fn alive_builders(&self) -> usize {
        self.builders.iter().filter(|b| b.alive).count()
    }

    pub fn in_flight(&self) -> usize {
        self.events.len()
    }

    pub fn unassigned(&self) -> usize {
        self.unassigned.len()
    }

    pub fn busy(&self) -> bool {
        self.busy
    }

    /// Age of the oldest event in flight.
    pub fn oldest_age_ns(&self, now_ns: u64) -> u64 {
        self.events
            .values()
            .map(|e| now_ns.saturating_sub(e.since_ns))
            .max()
            .unwrap_or(0)
    }

    /// Events given to each alive builder: (builder ID, events held, credits).
    pub fn builder_view(&self) -> Vec<(u32, bool, usize, u64)> {
        self.builders
            .iter()
            .map(|b| (b.id, b.alive, b.holding.len(), b.credits))
            .collect()
    }

    /// Readout units saw these events (the first sighting of each counts). None: the unit's
    /// pages are full and it reads nothing until clears free some, while events in flight may
    /// be waiting for exactly what it cannot read: the clears held go now, and the next one at
    /// once. Waiting for a full group or `clear_delay_ms` there made every cycle of the unit's
    /// pages wait the delay (1 340 events/s instead of 4 800 at a 5 kHz trigger, one fragment
    /// per page, a recorder acknowledging).
    pub fn announce(&mut self, ids: &[u64], now_ns: u64, out: &mut Vec<Out>) {
        if ids.is_empty() {
            self.counts.units_full += 1;
            self.unit_full = true;
            self.flush_clears(out);
        }
        for &e in ids {
            if self.finished_elsewhere.contains(e) && self.cleared_elsewhere.insert(e) {
                // Finished under the manager this one took over from; this unit still holds it.
                self.counts.finished_before += 1;
                self.finish(e, now_ns, out);
                continue;
            }
            if self.events.contains_key(&e) || self.done.contains(e) {
                continue;
            }
            self.counts.announced += 1;
            self.events.insert(
                e,
                InFlight {
                    builder: None,
                    since_ns: now_ns,
                    rebuild: false,
                },
            );
            self.unassigned.insert(e);
        }
        self.assign(out);
    }

    pub fn credit(&mut self, slot: usize, n: u32, now_ns: u64, out: &mut Vec<Out>) {
        let b = &mut self.builders[slot];
        if !b.alive {
            return;
        }
        b.credits += n as u64;
        self.spoke(slot, now_ns, out);
        self.assign(out);
    }

    pub fn heartbeat(&mut self, slot: usize, now_ns: u64) {
        self.builders[slot].last_heard_ns = now_ns;
    }

    /// A read of the builder's connection that began at `at_ns` found nothing.
    pub fn looked(&mut self, slot: usize, at_ns: u64) {
        let b = &mut self.builders[slot];
        b.looked_ns = b.looked_ns.max(at_ns);
    }

    pub fn done(
        &mut self,
        slot: usize,
        events: &[(u64, Outcome)],
        now_ns: u64,
        out: &mut Vec<Out>,
    ) {
        self.builders[slot].last_heard_ns = now_ns;
        for &(e, outcome) in events {
            let Some(f) = self.events.remove(&e) else {
                self.counts.stale_done += 1;
                continue;
            };
            if let Some(b) = f.builder {
                self.builders[b].holding.remove(&e);
            } else {
                // Finished by a builder declared dead while it was queued for another: drop it
                // from the queue.
                self.unassigned.remove(&e);
            }
            match outcome {
                Outcome::Recorded => self.counts.recorded += 1,
                Outcome::Rejected => self.counts.rejected += 1,
            }
            self.finish(e, now_ns, out);
        }
        self.assign(out);
    }

    /// The builder's connection is gone (or it missed its heartbeats): its unfinished events go
    /// back to the queue, flagged for rebuilding (older than what waits there, they go first).
    pub fn builder_lost(&mut self, slot: usize, out: &mut Vec<Out>) {
        let b = &mut self.builders[slot];
        if !b.alive {
            return;
        }
        b.alive = false;
        b.credits = 0;
        self.counts.dead_builders += 1;
        let held: Vec<u64> = b.holding.drain().collect();
        for e in held {
            if let Some(f) = self.events.get_mut(&e) {
                f.builder = None;
                f.rebuild = true;
                self.unassigned.insert(e);
                self.counts.reassigned += 1;
            }
        }
        out.push(Out::Drop(slot));
        self.assign(out);
    }

    /// Periodic work: heartbeat timeouts (proven by reads, [`Self::looked`]), clear groups that
    /// waited long enough, BUSY.
    pub fn tick(&mut self, now_ns: u64, out: &mut Vec<Out>) {
        let dead: Vec<usize> = (0..self.builders.len())
            .filter(|&i| {
                let b = &self.builders[i];
                b.alive && b.looked_ns.saturating_sub(b.last_heard_ns) > self.s.heartbeat_timeout_ns
            })
            .collect();
        for slot in dead {
            self.builder_lost(slot, out);
        }
        self.end_gathering(now_ns, out);
        let alive = self.builders.iter().any(|b| b.alive);
        self.builderless_since = if alive || self.gathering.is_some() {
            None
        } else {
            Some(self.builderless_since.unwrap_or(now_ns))
        };
        if !self.clears.is_empty()
            && now_ns.saturating_sub(self.oldest_clear_ns) >= self.s.clear_delay_ns
        {
            self.flush_clears(out);
        }
        self.update_busy(out);
    }

    /// Sends what clears are pending (at the end of a run).
    pub fn flush_clears(&mut self, out: &mut Vec<Out>) {
        // While gathering, a readout unit not yet back would miss the clear.
        if self.clears.is_empty() || self.gathering.is_some() {
            return;
        }
        let ids = std::mem::take(&mut self.clears);
        self.unit_full = false;
        self.counts.clears_sent += 1;
        self.counts.cleared_events += ids.len() as u64;
        out.push(Out::Clear(ids));
    }

    /// Nothing in flight, nothing waiting.
    pub fn idle(&self) -> bool {
        self.events.is_empty() && self.clears.is_empty()
    }

    fn assign(&mut self, out: &mut Vec<Out>) {
        if self.gathering.is_some() {
            self.update_busy(out);
            return;
        }
        let n = self.builders.len();
        let mut batches: HashMap<usize, Vec<(u64, u32)>> = HashMap::new();
        while !self.unassigned.is_empty() {
            // Round-robin over builders with credit.
            let Some(slot) = (0..n)
                .map(|k| (self.next_builder + k) % n)
                .find(|&i| self.builders[i].alive && self.builders[i].credits > 0)
            else {
                break;
            };
            self.next_builder = (slot + 1) % n;
            let e = self.unassigned.pop_first().expect("not empty");
            let f = self
                .events
                .get_mut(&e)
                .expect("queued events are in flight");
            f.builder = Some(slot);
            let b = &mut self.builders[slot];
            b.credits -= 1;
            b.holding.insert(e);
            self.counts.assigned += 1;
            batches
                .entry(slot)
                .or_default()
                .push((e, if f.rebuild { ASSIGN_REBUILD } else { 0 }));
        }
        let mut slots: Vec<usize> = batches.keys().copied().collect();
        slots.sort_unstable();
        for s in slots {
            out.push(Out::Assign(s, batches.remove(&s).expect("listed")));
        }
        self.update_busy(out);
    }

    fn update_busy(&mut self, out: &mut Vec<Out>) {
        let credit =
            self.gathering.is_none() && self.builders.iter().any(|b| b.alive && b.credits > 0);
        let busy = if self.busy {
            !(credit || self.unassigned.len() < self.s.busy_threshold / 2)
        } else {
            !credit && self.unassigned.len() >= self.s.busy_threshold
        };
        if busy != self.busy {
            self.busy = busy;
            self.counts.busy_transitions += 1;
            out.push(Out::Throttle(busy));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn settings() -> Settings {
        Settings {
            clear_group: 3,
            clear_delay_ns: 1000,
            heartbeat_timeout_ns: 10_000,
            busy_threshold: 4,
            done_memory: 1 << 16,
            builder_credits: 64,
            builder_wait_ns: u64::MAX,
        }
    }

    fn assigns(out: &[Out]) -> Vec<(usize, u64, u32)> {
        out.iter()
            .flat_map(|o| match o {
                Out::Assign(s, v) => v.iter().map(|&(e, f)| (*s, e, f)).collect(),
                _ => Vec::new(),
            })
            .collect()
    }

    #[test]
    fn events_go_to_builders_with_credit_only() {
        let mut c = Core::new(settings(), &[], &[], 0);
        let mut out = Vec::new();
        let a = c.builder_joined(10, 0);
        let b = c.builder_joined(11, 0);
        c.announce(&[1, 2, 3], 0, &mut out);
        assert!(assigns(&out).is_empty());
        c.credit(a, 2, 0, &mut out);
        assert_eq!(assigns(&out), vec![(a, 1, 0), (a, 2, 0)]);
        out.clear();
        c.credit(b, 5, 0, &mut out);
        assert_eq!(assigns(&out), vec![(b, 3, 0)]);
        // A second sighting of an event is not a new event.
        out.clear();
        c.announce(&[3, 4], 0, &mut out);
        assert_eq!(assigns(&out), vec![(b, 4, 0)]);
        assert_eq!(c.counts.announced, 4);
    }

    /// A group waits to fill while other events are in flight, and goes as soon as none is.
    /// Builders ask for their events in the order given, and readout units answer each builder
    /// in ascending order (request-protocol §4.3): the lowest event waiting goes first, whatever
    /// order the announcements came in, and a dead builder's events (older) before the rest.
    #[test]
    fn the_lowest_event_waiting_is_assigned_first() {
        let mut c = Core::new(settings(), &[], &[], 0);
        let mut out = Vec::new();
        let a = c.builder_joined(10, 0);
        let b = c.builder_joined(11, 0);
        c.announce(&[7, 8], 0, &mut out);
        c.announce(&[5, 6], 0, &mut out);
        c.credit(a, 3, 0, &mut out);
        assert_eq!(assigns(&out), vec![(a, 5, 0), (a, 6, 0), (a, 7, 0)]);
        out.clear();
        c.builder_lost(a, &mut out);
        c.credit(b, 4, 0, &mut out);
        let r = ASSIGN_REBUILD;
        assert_eq!(
            assigns(&out),
            vec![(b, 5, r), (b, 6, r), (b, 7, r), (b, 8, 0)]
        );
    }

    #[test]
    fn a_clear_group_goes_when_full_or_when_nothing_else_is_in_flight() {
        let mut c = Core::new(settings(), &[], &[], 0);
        let mut out = Vec::new();
        let a = c.builder_joined(0, 0);
        c.credit(a, 10, 0, &mut out);
        c.announce(&[1, 2, 3, 4, 5], 0, &mut out);
        out.clear();
        c.done(
            a,
            &[(1, Outcome::Recorded), (2, Outcome::Recorded)],
            10,
            &mut out,
        );
        assert!(out.is_empty(), "3, 4 and 5 are in flight: the group waits");
        c.done(a, &[(3, Outcome::Recorded)], 20, &mut out);
        assert_eq!(out, vec![Out::Clear(vec![1, 2, 3])], "a full group goes");
        out.clear();
        c.done(a, &[(4, Outcome::Rejected)], 30, &mut out);
        assert!(out.is_empty(), "5 is in flight");
        c.done(a, &[(5, Outcome::Recorded)], 40, &mut out);
        assert_eq!(out, vec![Out::Clear(vec![4, 5])], "nothing in flight");
        assert!(c.idle());
    }

    #[test]
    fn a_full_unit_gets_the_clears_held_at_once_and_the_next_one_without_waiting() {
        let mut c = Core::new(settings(), &[], &[], 0);
        let mut out = Vec::new();
        let a = c.builder_joined(0, 0);
        c.credit(a, 10, 0, &mut out);
        c.announce(&[1, 2, 3, 4, 5, 6, 7], 0, &mut out);
        out.clear();
        c.done(a, &[(1, Outcome::Recorded)], 10, &mut out);
        assert!(out.is_empty(), "the group waits");
        c.announce(&[], 11, &mut out);
        assert_eq!(clears(&out), [1], "a full unit gets what is held");
        out.clear();
        c.announce(&[], 12, &mut out);
        assert!(out.is_empty(), "nothing held: nothing sent");
        c.done(a, &[(2, Outcome::Recorded)], 13, &mut out);
        assert_eq!(clears(&out), [2], "the next clear goes at once");
        out.clear();
        c.done(a, &[(3, Outcome::Recorded)], 14, &mut out);
        assert!(out.is_empty(), "then groups fill again");
        assert_eq!(c.counts.units_full, 2);
        assert_eq!(
            c.counts.announced, 7,
            "an empty announcement announces nothing"
        );
    }

    #[test]
    fn a_dead_builders_events_are_rebuilt_elsewhere_and_cleared_once() {
        let mut c = Core::new(settings(), &[], &[], 0);
        let mut out = Vec::new();
        let a = c.builder_joined(0, 0);
        let b = c.builder_joined(1, 0);
        c.credit(a, 10, 0, &mut out);
        c.announce(&[5, 6, 7], 0, &mut out);
        out.clear();
        c.done(a, &[(5, Outcome::Recorded)], 100, &mut out);
        // b never heard from: it has no credit, so it got nothing; a misses its heartbeats.
        c.credit(b, 10, 200, &mut out);
        out.clear();
        c.looked(a, 20_000);
        c.looked(b, 20_000);
        c.tick(20_000, &mut out);
        // Both went silent by then: a and b are dead. Nothing is lost; a third builder takes
        // the rest as rebuilds.
        assert!(out.contains(&Out::Drop(a)));
        // The clear of 5 waited past the clear delay: sent alone.
        assert!(out.contains(&Out::Clear(vec![5])));
        let d = c.builder_joined(2, 20_000);
        out.clear();
        c.credit(d, 10, 20_000, &mut out);
        let got = assigns(&out);
        assert_eq!(got, vec![(d, 6, ASSIGN_REBUILD), (d, 7, ASSIGN_REBUILD)]);
        out.clear();
        c.done(
            d,
            &[(6, Outcome::Recorded), (7, Outcome::Rejected)],
            20_001,
            &mut out,
        );
        // Nothing else in flight: the group of 2 goes at once, not after a third or the delay.
        assert_eq!(out, vec![Out::Clear(vec![6, 7])]);
        // The late done of the builder declared dead is stale, not a second clear.
        out.clear();
        c.done(a, &[(6, Outcome::Recorded)], 20_002, &mut out);
        assert_eq!(c.counts.stale_done, 1);
        assert!(out.is_empty());
        // A late announcement of a finished event does not resurrect it.
        c.announce(&[6], 20_003, &mut out);
        assert!(c.idle());
    }

    #[test]
    fn busy_when_no_builder_has_credit_and_the_queue_is_long() {
        let mut c = Core::new(settings(), &[], &[], 0);
        let mut out = Vec::new();
        let a = c.builder_joined(0, 0);
        c.announce(&[1, 2, 3], 0, &mut out);
        assert!(!c.busy());
        c.announce(&[4], 0, &mut out);
        assert!(c.busy());
        assert_eq!(out, vec![Out::Throttle(true)]);
        out.clear();
        // One credit takes one event: the queue is still long, so still busy.
        c.credit(a, 1, 0, &mut out);
        assert!(c.busy());
        c.credit(a, 2, 0, &mut out);
        assert!(!c.busy());
        assert!(out.contains(&Out::Throttle(false)));
    }

    fn clears(out: &[Out]) -> Vec<u64> {
        out.iter()
            .flat_map(|o| match o {
                Out::Clear(v) => v.clone(),
                _ => Vec::new(),
            })
            .collect()
    }

    #[test]
    fn nothing_is_assigned_until_every_builder_spoke_and_every_unit_connected() {
        let mut c = Core::new(settings(), &[10, 11], &[0], 0);
        let mut out = Vec::new();
        let a = c.builder_joined(10, 0);
        let b = c.builder_joined(11, 0);
        c.credit(a, 4, 0, &mut out);
        c.announce(&[1, 2], 0, &mut out);
        c.credit(b, 4, 0, &mut out);
        assert!(
            assigns(&out).is_empty() && c.gathering(),
            "unit 0 not yet there"
        );
        c.readout_unit_joined(0, 0, &mut out);
        assert!(!c.gathering());
        assert_eq!(assigns(&out), vec![(a, 1, 0), (b, 2, 0)]);
        // Someone who never comes holds nobody up for longer than the heartbeat timeout.
        let mut c = Core::new(settings(), &[10, 11], &[0], 0);
        let a = c.builder_joined(10, 0);
        c.readout_unit_joined(0, 0, &mut out);
        c.credit(a, 4, 0, &mut out);
        c.announce(&[1], 0, &mut out);
        out.clear();
        c.tick(5_000, &mut out);
        assert!(assigns(&out).is_empty());
        c.tick(10_000, &mut out);
        assert_eq!(assigns(&out), vec![(a, 1, 0)]);
    }

    #[test]
    fn a_manager_taking_over_leaves_held_events_and_clears_finished_ones() {
        let mut c = Core::new(settings(), &[10, 11], &[0, 1], 0);
        let mut out = Vec::new();
        let a = c.builder_joined(10, 0);
        let b = c.builder_joined(11, 0);
        // Unit 0 comes back first and announces all it holds, before the builders rejoin.
        c.readout_unit_joined(0, 0, &mut out);
        c.announce(&[3, 5, 6, 7], 0, &mut out);
        // Builder 10 holds 5 and 9 (9 not announced yet), finished 3 and 4 (4 cleared already
        // by the lost manager: no unit holds it).
        c.rejoin(
            a,
            &[5, 9],
            &[(3, Outcome::Recorded), (4, Outcome::Rejected)],
            0,
            &mut out,
        );
        c.credit(a, 1, 0, &mut out);
        c.credit(b, 8, 0, &mut out);
        // Still gathering: nothing given, nothing cleared (four events waiting make it BUSY).
        assert_eq!(out, vec![Out::Throttle(true)]);
        c.readout_unit_joined(1, 0, &mut out);
        c.announce(&[4, 5, 6, 7, 9, 10], 0, &mut out);
        let given: Vec<u64> = assigns(&out).iter().map(|x| x.1).collect();
        let mut given_sorted = given.clone();
        given_sorted.sort_unstable();
        assert_eq!(
            given_sorted,
            vec![6, 7, 10],
            "held and finished events are not given"
        );
        assert_eq!((c.counts.adopted, c.counts.finished_before), (2, 2));
        out.clear();
        c.tick(2_000, &mut out);
        // 3 (announced, then finished before) is cleared; 4, announced after the rejoin by a
        // unit that still held it, too.
        let mut cl = clears(&out);
        cl.sort_unstable();
        assert_eq!(cl, vec![3, 4]);
        // The held events finish with their builder as usual.
        out.clear();
        c.done(
            a,
            &[(5, Outcome::Recorded), (9, Outcome::Recorded)],
            3_000,
            &mut out,
        );
        assert_eq!(c.counts.stale_done, 0);
    }

    /// The manager stalled (SIGSTOP, a starved process) past the heartbeat timeout: by the
    /// clock every builder went silent, but no read proves it; their heartbeats wait in the
    /// sockets. Only a read that finds a connection empty a timeout after its last message
    /// declares a builder dead.
    #[test]
    fn a_stall_of_the_manager_declares_no_builder_dead() {
        let mut c = Core::new(settings(), &[], &[], 0);
        let mut out = Vec::new();
        let a = c.builder_joined(10, 0);
        c.credit(a, 3, 0, &mut out);
        c.looked(a, 500);
        out.clear();
        c.tick(50_000, &mut out);
        assert!(!out.contains(&Out::Drop(a)), "{out:?}");
        // The first read after the stall brings its heartbeat: alive.
        c.heartbeat(a, 50_001);
        c.looked(a, 50_100);
        c.tick(50_200, &mut out);
        assert!(c.builder_alive(10));
        // Reads that keep finding nothing for the timeout: dead.
        c.looked(a, 60_002);
        c.tick(60_003, &mut out);
        assert!(out.contains(&Out::Drop(a)), "{out:?}");
    }

    #[test]
    fn a_builder_wrongly_declared_dead_rejoins_without_an_event_built_twice_in_its_queue() {
        let mut c = Core::new(settings(), &[], &[], 0);
        let mut out = Vec::new();
        let a = c.builder_joined(10, 0);
        let b = c.builder_joined(11, 0);
        c.credit(a, 3, 0, &mut out);
        c.announce(&[1, 2, 3], 0, &mut out);
        c.heartbeat(b, 15_000);
        out.clear();
        // Builder 10 was only slow: declared dead, its events queued for rebuilding; builder
        // 11 has no credit, so they wait.
        c.looked(a, 15_000);
        c.tick(15_000, &mut out);
        assert!(out.contains(&Out::Drop(a)));
        assert!(!c.builder_alive(10));
        // It connects again, having finished 1 meanwhile and still holding 2 and 3.
        let a2 = c.builder_joined(10, 15_001);
        out.clear();
        c.rejoin(a2, &[2, 3], &[(1, Outcome::Recorded)], 15_001, &mut out);
        c.credit(b, 5, 15_002, &mut out);
        assert!(assigns(&out).is_empty(), "nothing left to give: {out:?}");
        c.done(
            a2,
            &[(2, Outcome::Recorded), (3, Outcome::Recorded)],
            15_003,
            &mut out,
        );
        c.flush_clears(&mut out);
        let mut cl = clears(&out);
        cl.sort_unstable();
        assert_eq!(cl, vec![1, 2, 3]);
        assert!(c.idle());
    }

    #[derive(Clone, Debug)]
    enum Op {
        Announce(u64),
        Credit(usize, u32),
        Finish(usize),
        Kill(usize),
        Join,
        Tick,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..40).prop_map(Op::Announce),
            (0usize..4, 1u32..4).prop_map(|(b, n)| Op::Credit(b, n)),
            (0usize..4).prop_map(Op::Finish),
            (0usize..4).prop_map(Op::Kill),
            Just(Op::Join),
            Just(Op::Tick),
        ]
    }

    proptest! {
        /// Whatever builders join, take credit, finish or die: every announced event is finished
        /// exactly once (its clear is sent once) when some builder survives to take it, and no
        /// builder is ever given more events than its credit.
        #[test]
        fn every_event_is_cleared_exactly_once(ops in proptest::collection::vec(op(), 1..120)) {
            let mut c = Core::new(Settings { heartbeat_timeout_ns: u64::MAX, ..settings() }, &[], &[], 0);
            let mut out = Vec::new();
            let mut holding: Vec<Vec<u64>> = Vec::new();
            let mut granted: Vec<u64> = Vec::new();
            let mut taken: Vec<u64> = Vec::new();
            let mut announced = HashSet::new();
            let mut cleared: Vec<u64> = Vec::new();
            holding.push(Vec::new());
            granted.push(0);
            taken.push(0);
            c.builder_joined(0, 0);
            let mut alive = vec![true];
            let apply = |out: &mut Vec<Out>, holding: &mut Vec<Vec<u64>>, taken: &mut Vec<u64>,
                         cleared: &mut Vec<u64>, alive: &[bool]| {
                for o in out.drain(..) {
                    match o {
                        Out::Assign(s, v) => {
                            assert!(alive[s], "assigned to a dead builder");
                            taken[s] += v.len() as u64;
                            holding[s].extend(v.iter().map(|x| x.0));
                        }
                        Out::Clear(v) => cleared.extend(v),
                        Out::Drop(_) | Out::Throttle(_) => {}
                    }
                }
            };
            for o in ops {
                match o {
                    Op::Announce(e) => { announced.insert(e); c.announce(&[e], 0, &mut out) }
                    Op::Credit(b, n) if b < alive.len() && alive[b] => {
                        granted[b] += n as u64;
                        c.credit(b, n, 0, &mut out)
                    }
                    Op::Finish(b) if b < alive.len() => {
                        let v: Vec<(u64, Outcome)> =
                            holding[b].drain(..).map(|e| (e, Outcome::Recorded)).collect();
                        c.done(b, &v, 0, &mut out)
                    }
                    Op::Kill(b) if b < alive.len() && alive[b] => {
                        alive[b] = false;
                        holding[b].clear();
                        c.builder_lost(b, &mut out)
                    }
                    Op::Join => {
                        c.builder_joined(alive.len() as u32, 0);
                        alive.push(true);
                        holding.push(Vec::new());
                        granted.push(0);
                        taken.push(0);
                    }
                    Op::Tick => c.tick(0, &mut out),
                    _ => {}
                }
                apply(&mut out, &mut holding, &mut taken, &mut cleared, &alive);
                for b in 0..alive.len() {
                    prop_assert!(taken[b] <= granted[b], "builder {} took more than its credit", b);
                }
            }
            // Drain: one fresh builder with plenty of credit finishes everything.
            let b = c.builder_joined(99, 0);
            alive.push(true);
            holding.push(Vec::new());
            taken.push(0);
            c.credit(b, 1000, 0, &mut out);
            apply(&mut out, &mut holding, &mut taken, &mut cleared, &alive);
            for s in 0..alive.len() {
                if alive[s] {
                    let v: Vec<(u64, Outcome)> =
                        holding[s].drain(..).map(|e| (e, Outcome::Recorded)).collect();
                    c.done(s, &v, 0, &mut out);
                }
            }
            c.flush_clears(&mut out);
            apply(&mut out, &mut holding, &mut taken, &mut cleared, &alive);
            let mut sorted = cleared.clone();
            sorted.sort_unstable();
            let before = sorted.len();
            sorted.dedup();
            prop_assert_eq!(before, sorted.len(), "an event was cleared twice");
            prop_assert_eq!(sorted.into_iter().collect::<HashSet<_>>(), announced);
            prop_assert!(c.idle());
        }
    }
}

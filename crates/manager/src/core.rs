//! The event manager's decisions, as a pure state machine (no I/O, no clock: the caller passes
//! the time), so that they can be tested against a model: which builder gets which event, when a
//! builder is dead, what is cleared, when the readout units are told BUSY.

use std::collections::{HashMap, HashSet, VecDeque};

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
}

struct Builder {
    id: u32,
    alive: bool,
    credits: u64,
    last_heard_ns: u64,
    /// Events given to it and not finished.
    holding: HashSet<u64>,
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
}

pub struct Core {
    s: Settings,
    builders: Vec<Builder>,
    next_builder: usize,
    events: HashMap<u64, InFlight>,
    unassigned: VecDeque<u64>,
    done: RecentSet,
    clears: Vec<u64>,
    oldest_clear_ns: u64,
    busy: bool,
    pub counts: Counts,
}

impl Core {
    pub fn new(s: Settings) -> Core {
        Core {
            s,
            builders: Vec::new(),
            next_builder: 0,
            events: HashMap::new(),
            unassigned: VecDeque::new(),
            done: RecentSet::new(s.done_memory),
            clears: Vec::new(),
            oldest_clear_ns: 0,
            busy: false,
            counts: Counts::default(),
        }
    }

    /// A builder connected; returns its slot.
    pub fn builder_joined(&mut self, id: u32, now_ns: u64) -> usize {
        self.builders.push(Builder {
            id,
            alive: true,
            credits: 0,
            last_heard_ns: now_ns,
            holding: HashSet::new(),
        });
        self.builders.len() - 1
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

    /// Readout units saw these events (the first sighting of each counts).
    pub fn announce(&mut self, ids: &[u64], now_ns: u64, out: &mut Vec<Out>) {
        for &e in ids {
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
            self.unassigned.push_back(e);
        }
        self.assign(out);
    }

    pub fn credit(&mut self, slot: usize, n: u32, now_ns: u64, out: &mut Vec<Out>) {
        let b = &mut self.builders[slot];
        if !b.alive {
            return;
        }
        b.credits += n as u64;
        b.last_heard_ns = now_ns;
        self.assign(out);
    }

    pub fn heartbeat(&mut self, slot: usize, now_ns: u64) {
        self.builders[slot].last_heard_ns = now_ns;
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
                self.unassigned.retain(|&x| x != e);
            }
            match outcome {
                Outcome::Recorded => self.counts.recorded += 1,
                Outcome::Rejected => self.counts.rejected += 1,
            }
            self.done.insert(e);
            if self.clears.is_empty() {
                self.oldest_clear_ns = now_ns;
            }
            self.clears.push(e);
            if self.clears.len() >= self.s.clear_group {
                self.flush_clears(out);
            }
        }
        self.assign(out);
    }

    /// The builder's connection is gone (or it missed its heartbeats): its unfinished events go
    /// back to the front of the queue, flagged for rebuilding.
    pub fn builder_lost(&mut self, slot: usize, out: &mut Vec<Out>) {
        let b = &mut self.builders[slot];
        if !b.alive {
            return;
        }
        b.alive = false;
        b.credits = 0;
        self.counts.dead_builders += 1;
        let mut held: Vec<u64> = b.holding.drain().collect();
        held.sort_unstable();
        for e in held.into_iter().rev() {
            if let Some(f) = self.events.get_mut(&e) {
                f.builder = None;
                f.rebuild = true;
                self.unassigned.push_front(e);
                self.counts.reassigned += 1;
            }
        }
        out.push(Out::Drop(slot));
        self.assign(out);
    }

    /// Periodic work: heartbeat timeouts, clear groups that waited long enough, BUSY.
    pub fn tick(&mut self, now_ns: u64, out: &mut Vec<Out>) {
        let dead: Vec<usize> = (0..self.builders.len())
            .filter(|&i| {
                let b = &self.builders[i];
                b.alive && now_ns.saturating_sub(b.last_heard_ns) > self.s.heartbeat_timeout_ns
            })
            .collect();
        for slot in dead {
            self.builder_lost(slot, out);
        }
        if !self.clears.is_empty()
            && now_ns.saturating_sub(self.oldest_clear_ns) >= self.s.clear_delay_ns
        {
            self.flush_clears(out);
        }
        self.update_busy(out);
    }

    /// Sends what clears are pending (at the end of a run).
    pub fn flush_clears(&mut self, out: &mut Vec<Out>) {
        if self.clears.is_empty() {
            return;
        }
        let ids = std::mem::take(&mut self.clears);
        self.counts.clears_sent += 1;
        self.counts.cleared_events += ids.len() as u64;
        out.push(Out::Clear(ids));
    }

    /// Nothing in flight, nothing waiting.
    pub fn idle(&self) -> bool {
        self.events.is_empty() && self.clears.is_empty()
    }

    fn assign(&mut self, out: &mut Vec<Out>) {
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
            let e = self.unassigned.pop_front().expect("not empty");
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
        let credit = self.builders.iter().any(|b| b.alive && b.credits > 0);
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
        let mut c = Core::new(settings());
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

    #[test]
    fn a_dead_builders_events_are_rebuilt_elsewhere_and_cleared_once() {
        let mut c = Core::new(settings());
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
        assert!(
            out.is_empty(),
            "a group of 2 waits for a third or the delay"
        );
        c.tick(21_001, &mut out);
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
        let mut c = Core::new(settings());
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
            let mut c = Core::new(Settings { heartbeat_timeout_ns: u64::MAX, ..settings() });
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

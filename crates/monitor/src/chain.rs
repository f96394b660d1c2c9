//! The chain of stations: where events wait, who holds them, where they go next.
//!
//! One lock guards the whole chain (stations, queues, consumers), as in ET's single event-flow
//! process: an event's move from one station to the next is one critical section, so no event
//! can be seen at two places or at none. Consumers wait on their station's condition variable,
//! producers (and consumers putting into a full blocking station) on `space`.
//!
//! The monitor owns copies of the events it holds, in memory bounded by the stations' queues: it
//! never pins the recorder's read buffers, so a stuck consumer cannot take the data path's memory.

use bytes::Bytes;
use parking_lot::{Condvar, Mutex, MutexGuard};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_config::{
    check_chain, Distribution, MonitorSection, Restore, StationMode, StationSection,
};
use tessera_format::event::EventRecordHeader;
use tessera_format::monitor::{ErrorCode, Wait};
use tessera_format::select::Predicate;

/// Why a monitor call was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MonitorError {
    /// No station of that name.
    #[error("no station {0:?}")]
    UnknownStation(String),
    /// A station option that cannot apply, or a chain that would not hold together.
    #[error("{key}: {reason}")]
    Refused { key: String, reason: String },
    /// A put of an event this consumer does not hold.
    #[error("event {0} is not held by this consumer")]
    NotHeld(u64),
    /// A put that names the same event twice.
    #[error("event {0} is named twice in one put")]
    Repeated(u64),
    /// A replacement record that is not one whole event record.
    #[error("replacement for event {0} is not an event record: {1}")]
    BadRecord(u64, String),
    /// The consumer was detached (declared dead, or its station removed).
    #[error("consumer detached")]
    Detached,
    /// The consumer was woken from a wait (its connection closed).
    #[error("woken")]
    Woken,
    /// The monitor is shutting down.
    #[error("the monitor is closed")]
    Closed,
}

impl MonitorError {
    pub fn code(&self) -> ErrorCode {
        match self {
            MonitorError::UnknownStation(_) => ErrorCode::UnknownStation,
            MonitorError::Refused { .. } => ErrorCode::Refused,
            MonitorError::NotHeld(_) => ErrorCode::NotHeld,
            MonitorError::BadRecord(..) | MonitorError::Repeated(_) => ErrorCode::BadRequest,
            MonitorError::Detached | MonitorError::Woken => ErrorCode::NotAttached,
            MonitorError::Closed => ErrorCode::Closed,
        }
    }
}

/// An event as a consumer receives it.
#[derive(Clone, Debug)]
pub struct Event {
    /// Order of arrival in the monitor (1, 2, ...); what `put` names.
    pub seq: u64,
    pub header: Arc<EventRecordHeader>,
    /// The whole event record.
    pub bytes: Bytes,
}

/// Counters of one station, since it was created.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct StationCounters {
    /// Events that matched the selection while the station had consumers.
    pub selected: u64,
    /// Selected events skipped by the prescale.
    pub prescaled_out: u64,
    /// Events that entered the queue.
    pub queued: u64,
    /// Sampling: selected events dropped because the queue was full.
    pub dropped_full: u64,
    /// Events handed to consumers.
    pub delivered: u64,
    /// Events put back by consumers (blocking stations; a sampling station's events are the
    /// consumer's copies once delivered, and nothing is put back).
    pub put: u64,
    /// Blocking: events of dead consumers given back to the station's queue.
    pub restored: u64,
    /// Blocking: events passed on to the next station by a dead consumer's restore or by the
    /// last consumer leaving.
    pub passed_on: u64,
    /// Sampling: queued events released when the last consumer left.
    pub released: u64,
    /// Times the data path (or an upstream consumer's put) waited for room in this station.
    pub waits: u64,
    /// Blocking: events not queued because the station was full once the run was stopping (a
    /// stop releases the holds, so that a held consumer cannot turn the drain into loss upstream:
    /// the recorder writes them; this station's consumers miss them).
    #[serde(default)]
    pub skipped_at_stop: u64,
    /// Blocking: times the data path waited `hold_limit_ms` for room and the station's
    /// consumers were dropped for it (the event that waited went on without this station).
    #[serde(default)]
    pub hold_limit_drops: u64,
}

/// One consumer as the status shows it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ConsumerStatus {
    pub id: u64,
    pub name: String,
    pub held: usize,
    pub got: u64,
    pub put: u64,
}

/// One station as the status shows it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StationStatus {
    pub position: usize,
    pub config: StationSection,
    pub queue_depth: usize,
    pub held: usize,
    pub counters: StationCounters,
    pub consumers: Vec<ConsumerStatus>,
}

/// The whole monitor as the status shows it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MonitorStatus {
    /// Random per start of the monitor: a consumer that sees it change knows the system restarted.
    pub instance: u64,
    pub uptime_s: f64,
    /// Events that entered the chain.
    pub events_in: u64,
    /// Records offered that were not one whole event record (counted, not passed on).
    pub bad_records: u64,
    /// Events that went through the whole chain.
    pub events_out: u64,
    pub stations: Vec<StationStatus>,
}

struct Selection {
    triggers: Vec<u16>,
    stream: Option<Vec<u16>>,
    predicate: Option<Predicate>,
}

impl Selection {
    fn new(c: &StationSection, streams: &BTreeMap<String, Vec<u16>>) -> Selection {
        Selection {
            triggers: c.trigger_types.clone(),
            stream: c
                .stream
                .as_ref()
                .map(|s| streams.get(s).cloned().unwrap_or_default()),
            predicate: c.predicate.as_ref().and_then(|p| Predicate::parse(p).ok()),
        }
    }

    fn selects(&self, h: &EventRecordHeader) -> bool {
        (self.triggers.is_empty() || self.triggers.contains(&h.trigger_type))
            && self
                .stream
                .as_ref()
                .is_none_or(|t| t.contains(&h.trigger_type))
            && self.predicate.as_ref().is_none_or(|p| p.eval(h))
    }
}

struct Station {
    id: u64,
    config: StationSection,
    selection: Selection,
    queue: VecDeque<Event>,
    /// Bytes of the records in `queue`, kept as they come and go: `full` is asked at every
    /// insert, under the monitor's lock, and must not walk a queue of thousands.
    queued_bytes: usize,
    held: usize,
    consumers: Vec<u64>,
    counters: StationCounters,
    /// Round-robin turn of a parallel group (kept on its first member).
    turn: usize,
    data: Arc<Condvar>,
}

impl Station {
    fn occupancy(&self) -> usize {
        self.queue.len() + self.held
    }

    /// Whether the station can take no event of `next` bytes now: its count of events, or the
    /// bytes waiting in its queue (an empty queue always takes one, however large).
    fn full(&self, next: usize) -> bool {
        if self.occupancy() >= self.config.queue {
            return true;
        }
        !self.queue.is_empty() && self.queued_bytes + next > self.config.queue_bytes.0 as usize
    }

    /// Whether a producer waiting for room here is worth waking: a quarter of the station's
    /// queue is free, in events and in bytes. Once the producer waits, nothing comes in, so
    /// the puts that follow always reach this. Waking it at every put back would cost a wake-up
    /// and a lock round per event when a consumer takes one event per call; in a batch it
    /// costs one.
    fn room_for_a_batch(&self) -> bool {
        let slack = (self.config.queue / 4).max(1);
        self.occupancy() + slack <= self.config.queue
            && (self.queue.is_empty()
                || self.queued_bytes <= self.config.queue_bytes.0 as usize / 4 * 3)
    }

    fn blocking(&self) -> bool {
        self.config.mode == StationMode::Blocking
    }

    /// Queues the event (copying the record if nobody has yet) and wakes a consumer.
    fn enqueue(&mut self, seq: u64, header: &Arc<EventRecordHeader>, pending: &mut Pending<'_>) {
        let bytes = pending.materialize();
        self.queued_bytes += bytes.len();
        self.queue.push_back(Event {
            seq,
            header: header.clone(),
            bytes,
        });
        self.counters.queued += 1;
        self.data.notify_one();
    }
}

struct Consumer {
    name: String,
    station: u64,
    /// Events taken from a blocking station and not yet put back.
    held: BTreeMap<u64, Event>,
    got: u64,
    put: u64,
}

struct State {
    stations: Vec<Station>,
    /// Indices into `stations` per position of the chain (more than one: a parallel group).
    positions: Vec<Vec<usize>>,
    /// Bumped whenever stations are added or removed, so a waiter knows its indices went stale.
    generation: u64,
    consumers: HashMap<u64, Consumer>,
    next_consumer: u64,
    next_station: u64,
    seq: u64,
    events_in: u64,
    bad_records: u64,
    events_out: u64,
    /// Consumers of stations that held the data path past their hold limit, to be detached
    /// once the event that waited has gone on.
    expel: Vec<(u64, String)>,
}

pub(crate) struct Inner {
    state: Mutex<State>,
    space: Condvar,
    closed: AtomicBool,
    /// The run is stopping: blocking stations no longer hold the producer.
    releasing: AtomicBool,
    pub(crate) instance: u64,
    started: Instant,
    streams: BTreeMap<String, Vec<u16>>,
    max_stations: usize,
}

/// The monitor: a chain of stations that every recorded event passes through. Cheap to clone.
#[derive(Clone)]
pub struct Monitor {
    pub(crate) inner: Arc<Inner>,
}

/// Where an event is routed from, for `route`.
enum Start {
    Position(usize),
}

fn positions_of(stations: &[Station]) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    for (i, s) in stations.iter().enumerate() {
        let joins =
            i > 0 && s.config.group.is_some() && stations[i - 1].config.group == s.config.group;
        if joins {
            out.last_mut().expect("a previous position").push(i);
        } else {
            out.push(vec![i]);
        }
    }
    out
}

impl State {
    fn index_of(&self, id: u64) -> Option<usize> {
        self.stations.iter().position(|s| s.id == id)
    }

    fn position_of(&self, index: usize) -> usize {
        self.positions
            .iter()
            .position(|p| p.contains(&index))
            .expect("every station has a position")
    }

    fn rebuild(&mut self) {
        self.positions = positions_of(&self.stations);
        self.generation += 1;
    }
}

impl Monitor {
    /// A monitor with the chain `section` describes (checked again here, since a monitor can also
    /// be built without a topology file).
    pub fn new(section: &MonitorSection) -> Result<Monitor, MonitorError> {
        let chain = section.chain();
        check_chain(&chain, &section.streams)
            .map_err(|(key, reason)| MonitorError::Refused { key, reason })?;
        let mut state = State {
            stations: Vec::new(),
            positions: Vec::new(),
            generation: 0,
            consumers: HashMap::new(),
            next_consumer: 1,
            next_station: 1,
            seq: 0,
            events_in: 0,
            bad_records: 0,
            events_out: 0,
            expel: Vec::new(),
        };
        for c in chain {
            let id = state.next_station;
            state.next_station += 1;
            state.stations.push(Station {
                id,
                selection: Selection::new(&c, &section.streams),
                config: c,
                queue: VecDeque::new(),
                queued_bytes: 0,
                held: 0,
                consumers: Vec::new(),
                counters: StationCounters::default(),
                turn: 0,
                data: Arc::new(Condvar::new()),
            });
        }
        state.rebuild();
        let instance = {
            use rand::Rng;
            rand::thread_rng().gen::<u64>() | 1
        };
        Ok(Monitor {
            inner: Arc::new(Inner {
                state: Mutex::new(state),
                space: Condvar::new(),
                closed: AtomicBool::new(false),
                releasing: AtomicBool::new(false),
                instance,
                started: Instant::now(),
                streams: section.streams.clone(),
                max_stations: section.max_stations.max(section.chain().len()),
            }),
        })
    }

    /// This incarnation's random instance number.
    pub fn instance(&self) -> u64 {
        self.inner.instance
    }

    /// Offers one event record to the chain (the recorder calls this for every event it
    /// records). Returns at once unless a blocking station with consumers is full: then it waits
    /// for room, which is the back-pressure a blocking station exists for. A record that is not
    /// one whole event record is counted and dropped.
    pub fn insert(&self, record: &[u8]) {
        let header = match EventRecordHeader::decode_prefix(record, record.len()) {
            Ok(Some((h, n))) if n == record.len() => h,
            _ => {
                self.inner.state.lock().bad_records += 1;
                return;
            }
        };
        let mut g = self.inner.state.lock();
        g.seq += 1;
        g.events_in += 1;
        if g.consumers.is_empty() {
            // Nobody attached anywhere: the common case of an unwatched run costs one lock.
            g.events_out += 1;
            return;
        }
        let seq = g.seq;
        let header = Arc::new(header);
        let mut pending = Pending::Borrowed(record);
        self.route(&mut g, seq, &header, &mut pending, Start::Position(0));
        let expel = std::mem::take(&mut g.expel);
        drop(g);
        for (consumer, station) in expel {
            tracing::warn!(consumer, station, "a blocking station held the data path past its hold_limit_ms: its consumer is dropped and the run goes on");
            self.detach(consumer);
        }
    }

    /// Moves an event along the chain from `start` until a blocking station keeps it or it
    /// leaves the chain. The record is copied at the first station that takes it.
    fn route(
        &self,
        g: &mut MutexGuard<'_, State>,
        seq: u64,
        header: &Arc<EventRecordHeader>,
        pending: &mut Pending<'_>,
        start: Start,
    ) {
        let Start::Position(mut p) = start;
        'positions: while p < g.positions.len() {
            let Some(index) = self.choose(g, p, header) else {
                p += 1;
                continue;
            };
            {
                let st = &mut g.stations[index];
                st.counters.selected += 1;
                if !st.counters.selected.is_multiple_of(st.config.prescale) {
                    st.counters.prescaled_out += 1;
                    p += 1;
                    continue;
                }
            }
            if g.stations[index].blocking() {
                let id = g.stations[index].id;
                let mut index = index;
                let mut waited = false;
                let limit = g.stations[index].config.hold_limit_ms;
                // In runnable time: a stalled host is no consumer holding the run.
                let clock = tessera_net::clock::Runnable::start();
                let mut held_too_long = false;
                while g.stations[index].full(pending.len())
                    && !self.inner.closed.load(Ordering::Acquire)
                    && !self.inner.releasing.load(Ordering::Acquire)
                {
                    if !waited {
                        g.stations[index].counters.waits += 1;
                        waited = true;
                    }
                    let left_ms = limit.saturating_sub(clock.now_ns() / 1_000_000);
                    if limit > 0 && left_ms == 0 {
                        held_too_long = true;
                        break;
                    }
                    let generation = g.generation;
                    if limit > 0 {
                        self.inner
                            .space
                            .wait_for(g, std::time::Duration::from_millis(left_ms.min(100)));
                    } else {
                        self.inner.space.wait(g);
                    }
                    if g.generation != generation {
                        match g.index_of(id) {
                            Some(i) => index = i,
                            None => continue 'positions, // removed: route on from here
                        }
                    }
                    if g.stations[index].consumers.is_empty() {
                        // Its last consumer left while we waited: the station is passed by now.
                        p = g.position_of(index) + 1;
                        continue 'positions;
                    }
                }
                if self.inner.closed.load(Ordering::Acquire) {
                    break;
                }
                if held_too_long {
                    // Its consumers go once this event has gone on (`insert`); the event goes
                    // on without this station now.
                    let st = &mut g.stations[index];
                    st.counters.hold_limit_drops += 1;
                    let name = st.config.name.clone();
                    let consumers = st.consumers.clone();
                    g.expel
                        .extend(consumers.into_iter().map(|c| (c, name.clone())));
                    p = g.position_of(index) + 1;
                    continue 'positions;
                }
                if g.stations[index].full(pending.len()) {
                    // Released by the stop: this station's consumers miss the event, counted;
                    // the stations after it still see it.
                    g.stations[index].counters.skipped_at_stop += 1;
                    p = g.position_of(index) + 1;
                    continue 'positions;
                }
                g.stations[index].enqueue(seq, header, pending);
                return;
            }
            let st = &mut g.stations[index];
            if st.full(pending.len()) {
                st.counters.dropped_full += 1;
            } else {
                st.enqueue(seq, header, pending);
            }
            p += 1;
        }
        g.events_out += 1;
    }

    /// The station of position `p` that takes this event, if any: a station with consumers whose
    /// selection matches (in a parallel group, one of them by the group's distribution).
    fn choose(&self, g: &mut State, p: usize, h: &EventRecordHeader) -> Option<usize> {
        let members = &g.positions[p];
        if members.len() == 1 {
            let s = &g.stations[members[0]];
            return (!s.consumers.is_empty() && s.selection.selects(h)).then_some(members[0]);
        }
        let candidates: Vec<usize> = members
            .iter()
            .copied()
            .filter(|&i| !g.stations[i].consumers.is_empty() && g.stations[i].selection.selects(h))
            .collect();
        if candidates.is_empty() {
            return None;
        }
        let first = members[0];
        match g.stations[first]
            .config
            .distribution
            .unwrap_or(Distribution::RoundRobin)
        {
            Distribution::RoundRobin => {
                let t = g.stations[first].turn;
                g.stations[first].turn = t.wrapping_add(1);
                Some(candidates[t % candidates.len()])
            }
            Distribution::EqualQueue => candidates
                .into_iter()
                .min_by_key(|&i| g.stations[i].occupancy()),
        }
    }

    /// Attaches a consumer to a station.
    pub fn attach(&self, station: &str, name: &str) -> Result<LocalConsumer, MonitorError> {
        let id = self.attach_id(station, name)?;
        Ok(LocalConsumer {
            monitor: self.clone(),
            id,
            woken: Arc::new(AtomicBool::new(false)),
        })
    }

    pub(crate) fn attach_id(&self, station: &str, name: &str) -> Result<u64, MonitorError> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(MonitorError::Closed);
        }
        let mut g = self.inner.state.lock();
        let index = g
            .stations
            .iter()
            .position(|s| s.config.name == station)
            .ok_or_else(|| MonitorError::UnknownStation(station.into()))?;
        let id = g.next_consumer;
        g.next_consumer += 1;
        let sid = g.stations[index].id;
        g.stations[index].consumers.push(id);
        g.consumers.insert(
            id,
            Consumer {
                name: name.into(),
                station: sid,
                held: BTreeMap::new(),
                got: 0,
                put: 0,
            },
        );
        Ok(id)
    }

    /// The configuration of the station a consumer is attached to.
    pub fn station_of(&self, consumer: u64) -> Option<StationSection> {
        let g = self.inner.state.lock();
        let c = g.consumers.get(&consumer)?;
        let i = g.index_of(c.station)?;
        Some(g.stations[i].config.clone())
    }

    /// Up to `max` events for a consumer. `woken` ends a wait early (the consumer's connection
    /// closed); see [`Monitor::wake`].
    pub(crate) fn get(
        &self,
        consumer: u64,
        max: usize,
        wait: Wait,
        woken: &AtomicBool,
    ) -> Result<Vec<Event>, MonitorError> {
        let deadline = match wait {
            Wait::Timed(ms) => Some(Instant::now() + Duration::from_millis(ms as u64)),
            _ => None,
        };
        let mut g = self.inner.state.lock();
        loop {
            if woken.load(Ordering::Acquire) {
                return Err(MonitorError::Woken);
            }
            let Some(c) = g.consumers.get(&consumer) else {
                return Err(MonitorError::Detached);
            };
            let sid = c.station;
            let Some(index) = g.index_of(sid) else {
                return Err(MonitorError::Detached);
            };
            let st = &mut g.stations[index];
            if !st.queue.is_empty() && max > 0 {
                let n = max.min(st.queue.len());
                let events: Vec<Event> = st.queue.drain(..n).collect();
                st.queued_bytes -= events.iter().map(|e| e.bytes.len()).sum::<usize>();
                st.counters.delivered += n as u64;
                let blocking = st.blocking();
                // A sampled event is the consumer's copy from now on: its room is free, and
                // nothing is put back (`put` counts puts only; docs/monitor-protocol.md §4).
                if blocking {
                    st.held += n;
                }
                if let Some(c) = g.consumers.get_mut(&consumer) {
                    c.got += n as u64;
                    if blocking {
                        for e in &events {
                            c.held.insert(e.seq, e.clone());
                        }
                    }
                }
                return Ok(events);
            }
            if self.inner.closed.load(Ordering::Acquire) {
                return Err(MonitorError::Closed);
            }
            let data = st.data.clone();
            match (wait, deadline) {
                (Wait::Poll, _) => return Ok(Vec::new()),
                (_, Some(d)) => {
                    if data.wait_until(&mut g, d).timed_out() {
                        // One last look before giving up: an event may have come with the timeout.
                        let c = g.consumers.get(&consumer).ok_or(MonitorError::Detached)?;
                        let i = g.index_of(c.station).ok_or(MonitorError::Detached)?;
                        if g.stations[i].queue.is_empty() {
                            return Ok(Vec::new());
                        }
                    }
                }
                _ => data.wait(&mut g),
            }
        }
    }

    /// Puts events back: at a blocking station each moves on to the next position (with a new
    /// record if `replacement` is given); at a sampling station a put only says the consumer is
    /// done with its copy. Every entry is checked before any moves.
    pub(crate) fn put(
        &self,
        consumer: u64,
        events: Vec<(u64, Option<Bytes>)>,
    ) -> Result<(), MonitorError> {
        let mut g = self.inner.state.lock();
        let c = g.consumers.get(&consumer).ok_or(MonitorError::Detached)?;
        let index = g.index_of(c.station).ok_or(MonitorError::Detached)?;
        if !g.stations[index].blocking() {
            return Ok(());
        }
        let mut headers = Vec::with_capacity(events.len());
        let mut named = std::collections::HashSet::with_capacity(events.len());
        for (seq, rep) in &events {
            if !c.held.contains_key(seq) {
                return Err(MonitorError::NotHeld(*seq));
            }
            // Checked before anything moves: a put is taken whole or not at all.
            if !named.insert(*seq) {
                return Err(MonitorError::Repeated(*seq));
            }
            headers.push(match rep {
                Some(b) => match EventRecordHeader::decode_prefix(b, b.len()) {
                    Ok(Some((h, n))) if n == b.len() => Some(Arc::new(h)),
                    Ok(_) => {
                        return Err(MonitorError::BadRecord(*seq, "not one whole record".into()))
                    }
                    Err(e) => return Err(MonitorError::BadRecord(*seq, e.to_string())),
                },
                None => None,
            });
        }
        let mut moving = Vec::with_capacity(events.len());
        {
            let c = g
                .consumers
                .get_mut(&consumer)
                .ok_or(MonitorError::Detached)?;
            for ((seq, rep), h) in events.into_iter().zip(headers) {
                // Every seq was found held and named once, under this same lock.
                let Some(mut e) = c.held.remove(&seq) else {
                    continue;
                };
                if let (Some(b), Some(h)) = (rep, h) {
                    e.bytes = b;
                    e.header = h;
                }
                moving.push(e);
            }
            c.put += moving.len() as u64;
        }
        let st = &mut g.stations[index];
        st.held -= moving.len();
        st.counters.put += moving.len() as u64;
        if st.room_for_a_batch() {
            self.inner.space.notify_all();
        }
        let next = g.position_of(index) + 1;
        for e in moving {
            let mut pending = Pending::Owned(e.bytes);
            self.route(
                &mut g,
                e.seq,
                &e.header,
                &mut pending,
                Start::Position(next),
            );
        }
        Ok(())
    }

    /// Detaches a consumer (it left, or it was declared dead): its events go where the station's
    /// `restore` says, and a station left without consumers passes its queue on.
    pub fn detach(&self, consumer: u64) {
        let mut g = self.inner.state.lock();
        let Some(c) = g.consumers.remove(&consumer) else {
            return;
        };
        let Some(index) = g.index_of(c.station) else {
            return;
        };
        let st = &mut g.stations[index];
        st.consumers.retain(|&x| x != consumer);
        st.held -= c.held.len();
        let alone = st.consumers.is_empty();
        let held: Vec<Event> = c.held.into_values().collect();
        let next = g.position_of(index) + 1;
        let mut onward = Vec::new();
        let st = &mut g.stations[index];
        if st.blocking() {
            if st.config.restore_policy() == Restore::Station && !alone {
                st.counters.restored += held.len() as u64;
                for e in held.into_iter().rev() {
                    st.queued_bytes += e.bytes.len();
                    st.queue.push_front(e);
                }
                st.data.notify_all();
            } else {
                onward.extend(held);
            }
            if alone {
                onward.extend(st.queue.drain(..));
                st.queued_bytes = 0;
            }
            st.counters.passed_on += onward.len() as u64;
        } else if alone {
            st.counters.released += st.queue.len() as u64;
            st.queue.clear();
            st.queued_bytes = 0;
        }
        self.inner.space.notify_all();
        onward.sort_by_key(|e| e.seq);
        for e in onward {
            let mut pending = Pending::Owned(e.bytes);
            self.route(
                &mut g,
                e.seq,
                &e.header,
                &mut pending,
                Start::Position(next),
            );
        }
    }

    /// Adds a station at the end of the chain (or into the parallel group it names, if that group
    /// is last).
    pub fn create_station(&self, config: StationSection) -> Result<(), MonitorError> {
        let mut g = self.inner.state.lock();
        if g.stations.len() >= self.inner.max_stations {
            return Err(MonitorError::Refused {
                key: "monitor.max_stations".into(),
                reason: format!(
                    "the monitor has {} stations already, its most",
                    g.stations.len()
                ),
            });
        }
        let mut chain: Vec<StationSection> = g.stations.iter().map(|s| s.config.clone()).collect();
        chain.push(config.clone());
        check_chain(&chain, &self.inner.streams).map_err(|(key, reason)| {
            MonitorError::Refused {
                key: key.replace(&format!("monitor.station[{}]", chain.len() - 1), "station"),
                reason,
            }
        })?;
        let id = g.next_station;
        g.next_station += 1;
        g.stations.push(Station {
            id,
            selection: Selection::new(&config, &self.inner.streams),
            config,
            queue: VecDeque::new(),
            queued_bytes: 0,
            held: 0,
            consumers: Vec::new(),
            counters: StationCounters::default(),
            turn: 0,
            data: Arc::new(Condvar::new()),
        });
        g.rebuild();
        Ok(())
    }

    /// Changes a station while it runs. Selection, prescale, queue size, restore policy and the
    /// group's distribution can change; mode and group cannot (remove and create the station).
    pub fn set_station(&self, config: StationSection) -> Result<(), MonitorError> {
        let mut g = self.inner.state.lock();
        let index = g
            .stations
            .iter()
            .position(|s| s.config.name == config.name)
            .ok_or_else(|| MonitorError::UnknownStation(config.name.clone()))?;
        let old = &g.stations[index].config;
        let refused = |key: &str, reason: &str| MonitorError::Refused {
            key: format!("station.{key}"),
            reason: reason.into(),
        };
        if old.mode != config.mode {
            return Err(refused(
                "mode",
                "cannot change while the station exists: remove it and create it anew",
            ));
        }
        if old.group != config.group {
            return Err(refused(
                "group",
                "cannot change while the station exists: remove it and create it anew",
            ));
        }
        let mut chain: Vec<StationSection> = g.stations.iter().map(|s| s.config.clone()).collect();
        chain[index] = config.clone();
        check_chain(&chain, &self.inner.streams).map_err(|(key, reason)| {
            MonitorError::Refused {
                key: key.replace(&format!("monitor.station[{index}]"), "station"),
                reason,
            }
        })?;
        let st = &mut g.stations[index];
        st.selection = Selection::new(&config, &self.inner.streams);
        st.config = config;
        // A larger queue may let a waiting producer in.
        self.inner.space.notify_all();
        Ok(())
    }

    /// Removes a station; its consumers are detached first (their events restored as after a
    /// death), then its queue passes on (blocking) or is released (sampling).
    pub fn remove_station(&self, name: &str) -> Result<(), MonitorError> {
        loop {
            let consumers: Vec<u64> = {
                let mut g = self.inner.state.lock();
                let index = g
                    .stations
                    .iter()
                    .position(|s| s.config.name == name)
                    .ok_or_else(|| MonitorError::UnknownStation(name.into()))?;
                if g.stations[index].consumers.is_empty() {
                    // Without consumers a blocking station's queue has already passed on.
                    let st = g.stations.remove(index);
                    st.data.notify_all();
                    g.rebuild();
                    self.inner.space.notify_all();
                    return Ok(());
                }
                g.stations[index].consumers.clone()
            };
            for c in consumers {
                self.detach(c);
            }
        }
    }

    /// The names of the stations, in chain order.
    pub fn station_names(&self) -> Vec<String> {
        self.status()
            .stations
            .iter()
            .map(|s| s.config.name.clone())
            .collect()
    }

    /// Everything about the chain now.
    pub fn status(&self) -> MonitorStatus {
        let g = self.inner.state.lock();
        let stations = g
            .stations
            .iter()
            .enumerate()
            .map(|(i, s)| StationStatus {
                position: g.position_of(i),
                config: s.config.clone(),
                queue_depth: s.queue.len(),
                held: s.held,
                counters: s.counters.clone(),
                consumers: s
                    .consumers
                    .iter()
                    .filter_map(|id| {
                        g.consumers.get(id).map(|c| ConsumerStatus {
                            id: *id,
                            name: c.name.clone(),
                            held: c.held.len(),
                            got: c.got,
                            put: c.put,
                        })
                    })
                    .collect(),
            })
            .collect();
        MonitorStatus {
            instance: self.inner.instance,
            uptime_s: self.inner.started.elapsed().as_secs_f64(),
            events_in: g.events_in,
            bad_records: g.bad_records,
            events_out: g.events_out,
            stations,
        }
    }

    /// The run is stopping: a blocking station that is full no longer holds the producer (the
    /// event goes on without it, counted `skipped_at_stop`), so that a consumer that holds its
    /// events (stopped, hung) cannot stall the drain until the upstream stages give up and cut
    /// what they hold. Consumers still get what their queues hold.
    pub fn release_holds(&self) {
        self.inner.releasing.store(true, Ordering::Release);
        let _g = self.inner.state.lock();
        self.inner.space.notify_all();
    }

    /// Stops the monitor: waits end, a producer waiting for room goes on without the monitor.
    pub fn close(&self) {
        self.inner.closed.store(true, Ordering::Release);
        let g = self.inner.state.lock();
        for s in &g.stations {
            s.data.notify_all();
        }
        self.inner.space.notify_all();
    }

    pub fn is_closed(&self) -> bool {
        self.inner.closed.load(Ordering::Acquire)
    }
}

/// A record on its way: borrowed from the caller until a station keeps it.
enum Pending<'a> {
    Borrowed(&'a [u8]),
    Owned(Bytes),
}

impl Pending<'_> {
    fn len(&self) -> usize {
        match self {
            Pending::Owned(b) => b.len(),
            Pending::Borrowed(s) => s.len(),
        }
    }

    fn materialize(&mut self) -> Bytes {
        match self {
            Pending::Owned(b) => b.clone(),
            Pending::Borrowed(s) => {
                let b = Bytes::copy_from_slice(s);
                *self = Pending::Owned(b.clone());
                b
            }
        }
    }
}

/// A consumer in the same process. Dropping it detaches it (its events restored per station
/// policy).
pub struct LocalConsumer {
    monitor: Monitor,
    id: u64,
    woken: Arc<AtomicBool>,
}

impl LocalConsumer {
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Up to `max` events: waiting until there is one (`Wait::Sleep`), not at all (`Wait::Poll`)
    /// or up to a time (`Wait::Timed`). An empty answer means the wait ended without events.
    pub fn get(&self, max: usize, wait: Wait) -> Result<Vec<Event>, MonitorError> {
        self.monitor.get(self.id, max, wait, &self.woken)
    }

    /// Puts events back (see [`Monitor`]'s put semantics per mode).
    pub fn put(&self, events: Vec<Event>) -> Result<(), MonitorError> {
        self.monitor
            .put(self.id, events.into_iter().map(|e| (e.seq, None)).collect())
    }

    /// Puts one event back with a new record (a processing station's output).
    pub fn put_replaced(&self, seq: u64, record: Bytes) -> Result<(), MonitorError> {
        self.monitor.put(self.id, vec![(seq, Some(record))])
    }
}

impl Drop for LocalConsumer {
    fn drop(&mut self) {
        self.monitor.detach(self.id);
    }
}

//! Request mode of the builder unit (CMS BU with its EVM, ATLAS DCM): it takes events from the
//! event manager as far as its credit goes, requests their fragments from the readout units
//! (the RoI first when the filter has one, the rest only if the filter accepts), builds each
//! event, hands it to the recorder, and only once the recorder link has taken it reports it done,
//! so that a builder dying at any moment leaves every unfinished event to be rebuilt elsewhere.
//!
//! Its event manager lost before the end of the run, it keeps building what it holds and opens
//! the connection again for up to `takeover` (a manager restarted at the same address takes the
//! run over, request-protocol §4.2): it rejoins with the events it holds and those it finished
//! most recently, then its free credit.
//!
//! Threads: an event-manager reader (assignments) and writer (credit, done, heartbeats); per
//! readout unit a request writer (control connection, Nagle off) and an answer reader (data
//! connection, Nagle on: the CMS lesson); a sweeper for heartbeats and the event timeout; the
//! recorder sender.

use crossbeam_channel::{bounded, Sender};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet, VecDeque};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_filter::{Filter, FragmentRef};
use tessera_format::event::EventFlags;
use tessera_format::link::{decode_link, Fragments, LinkItem, PeerHello, PeerRole};
use tessera_format::request::{
    self, AnswerHeader, Channel, Message, Outcome, Role, ASSIGN_REBUILD,
};
use tessera_format::wire::FragmentHeader;
use tessera_net::control::{open, write_loop, MessageReader, ReadEnd};
use tessera_net::line::{Line, Ticket};
use tessera_net::reader::Fill;
use tessera_net::role::RoleThreads;
use tessera_net::{ChunkReader, ChunkSlice};

use crate::{BuilderStats, BuilderUnit, Built, Queued};

/// Everything a request-mode builder needs to start.
pub struct PullConfig {
    pub id: u16,
    pub event_manager: String,
    /// (readout unit ID, address, its sources).
    pub readout_units: Vec<(u32, String, Vec<u32>)>,
    pub recorder: Option<String>,
    pub credits: u32,
    pub heartbeat: Duration,
    /// How long an event may wait for its answers before it is built incomplete.
    pub event_timeout: Duration,
    pub filter: Arc<dyn Filter>,
    /// Largest answer accepted.
    pub max_message: usize,
    pub buffer: u64,
    pub read_chunk: usize,
    /// How long to wait for a lost event manager to come back; zero: end at once.
    pub takeover: Duration,
    /// Finished events remembered for a rejoin.
    pub takeover_memory: usize,
    /// How long to keep what the recorder has not acknowledged and try its address again after
    /// the link broke (wire format §2.8); zero: count it lost at once.
    pub recorder_takeover: Duration,
}

/// The builder's side of its event-manager connection, which may be replaced (takeover).
struct ManagerLink {
    /// The queue of the connection open now; none while the manager is lost.
    tx: Option<Sender<Message>>,
    /// Events assigned and not finished.
    held: HashSet<u64>,
    /// The most recently finished events, at most `memory`.
    recent: VecDeque<(u64, Outcome)>,
    memory: usize,
}

/// Request steps, sent as the request tag and echoed in the answers.
const STEP_ROI: u64 = 1;
const STEP_FULL: u64 = 2;

struct Building {
    rebuild: bool,
    since_ns: u64,
    step: u64,
    /// The readout units (slots) whose answers this step still expects.
    pending: Vec<usize>,
    parts: Vec<(AnswerHeader, ChunkSlice)>,
}

impl Building {
    /// Fragments in the answers taken so far (each answer's count, as `held_fragments` took it).
    fn fragments(&self) -> u64 {
        self.parts.iter().map(|p| p.0.fragment_count as u64).sum()
    }
}

/// One readout unit's requests of one step (one list of sources), in the order they went on its
/// control connection, until answered. A unit reads requests in that order, and a unit that
/// follows rule 4 (request-protocol §4.3) answers a request once its sources delivered the event:
/// so its answer to a later event asked after an earlier request of the same sources proves the
/// earlier one taken and answerable. The time this builder first saw such an answer is kept
/// with the request; a request still unanswered a whole builder timeout after it, as proven by a
/// read that began then and left the unit's socket empty (`Pull::drained_ns`), is overdue. A unit
/// that answers others while it never answers one request would otherwise hold that event, and
/// its credit, until the run's stop deadlines.
#[derive(Default)]
struct Asked {
    /// (event ID, when an answer to a later event asked after it was first seen).
    sent: VecDeque<(u64, Option<u64>)>,
    /// Entries of `sent` overtaken: none, the usual case, and the sweep looks no further.
    overtaken: usize,
}

impl Asked {
    /// A request for `event` goes on the connection now, after every one noted before.
    fn sent(&mut self, event: u64) {
        self.sent.push_back((event, None));
    }

    /// The answer to `event` came at `now()`: its request is no longer waited for, and every
    /// request for an earlier event asked before it is overtaken, if it was not already.
    fn answered(&mut self, event: u64, now: impl FnOnce() -> u64) {
        let Some(i) = self.sent.iter().position(|&(e, _)| e == event) else {
            return; // answered again, or its request was given up (its event cut or rebuilt)
        };
        if i > 0 {
            let t = now();
            for (e, overtaken) in self.sent.iter_mut().take(i) {
                if *e < event && overtaken.is_none() {
                    *overtaken = Some(t);
                    self.overtaken += 1;
                }
            }
        }
        if let Some((_, Some(_))) = self.sent.remove(i) {
            self.overtaken -= 1;
        }
    }

    /// Takes the requests overtaken more than `timeout` before a read that began at `drained`
    /// and left the socket empty, and returns those whose events still wait for them (`waits`).
    fn take_overdue(
        &mut self,
        drained: u64,
        timeout: u64,
        waits: impl Fn(u64) -> bool,
    ) -> Vec<u64> {
        let mut overdue = Vec::new();
        if self.overtaken == 0 {
            return overdue;
        }
        let mut taken = 0;
        self.sent.retain(|&(e, overtaken)| {
            let due = overtaken.is_some_and(|t| gave_nothing_for(t, drained, timeout));
            if due {
                taken += 1;
                if waits(e) {
                    overdue.push(e);
                }
            }
            !due
        });
        self.overtaken -= taken;
        overdue
    }

    /// Forgets the requests whose events no longer wait for them (cut by the silence rule,
    /// say), once there are more than `most` (the events that can be in flight): kept, they
    /// are only ever dropped when a later answer overtakes them.
    fn bound(&mut self, most: usize, waits: impl Fn(u64) -> bool) {
        if self.sent.len() > most {
            self.sent.retain(|&(e, _)| waits(e));
            self.overtaken = self.sent.iter().filter(|x| x.1.is_some()).count();
        }
    }
}

/// The requests' steps, in the order of `Pull::asked`.
const STEPS: [u64; 2] = [STEP_ROI, STEP_FULL];

/// Where a step's requests are noted in `Pull::asked`; none for a tag this builder never sends.
fn step_index(tag: u64) -> Option<usize> {
    STEPS.iter().position(|&t| t == tag)
}

struct Pull {
    id: u16,
    rus: Vec<(u32, Vec<u32>)>,
    expected: Vec<u32>,
    stats: Arc<BuilderStats>,
    filter: Arc<dyn Filter>,
    events: Mutex<HashMap<u64, Building>>,
    to_rus: Vec<Sender<Message>>,
    manager: Mutex<ManagerLink>,
    credits: u32,
    to_recorder: Mutex<Option<Sender<Vec<Kept>>>>,
    /// A recorder is configured: an event built after its link closed (the run was cut short,
    /// by the manager's death, say) is lost at the link, never reported recorded.
    recording: bool,
    /// Runnable time since the builder started (`tessera_net::clock`): what timeouts count.
    clock: tessera_net::clock::Runnable,
    timeout_ns: u64,
    /// Per readout unit, when a read last brought bytes of its answers (runnable ns from the start). An event
    /// gives up on a unit only once the unit has answered nothing for a whole timeout while the
    /// event waited: a unit waiting for a source that runs behind but keeps delivering answers
    /// each event as that source delivers it, and must not have its events cut by their age.
    last_answer_ns: Vec<AtomicU64>,
    /// Per readout unit, when the latest read of its answers that found nothing began (ns
    /// from the start, runnable): a unit has answered nothing for a timeout only once a read proves it, never
    /// by the clock alone. Time in which this builder did not read (stalled, starved of a
    /// core) says nothing of the unit, whose answers may be waiting in the socket.
    looked_ns: Vec<AtomicU64>,
    /// Per readout unit, when the latest read of its answers that left its socket empty began
    /// (runnable ns from the start): every answer the unit wrote before then has been read. An overdue
    /// request (`Asked`) is proven by it: a unit that answers all the while is never silent,
    /// so `looked_ns` would not move.
    drained_ns: Vec<AtomicU64>,
    /// Per readout unit: its answer reader is waiting for memory, held by this builder's own
    /// budget. The unit's answers cannot be read; cutting the events that wait for it is what
    /// gives memory back (the old rule, by the clock).
    held: Vec<AtomicBool>,
    abort: Arc<AtomicBool>,
    /// The event manager ended the run.
    ended: AtomicBool,
    /// Per readout unit: its connection was lost before the end of the run. Nothing more is
    /// asked of it and no event waits for it: its sources are named missing at once. Changed
    /// and read under the `events` lock, so that no event is left waiting on a lost unit.
    lost: Vec<AtomicBool>,
    /// Places in line of the events whose RoI step completed, taken under `events`: the rest of
    /// accepted events is requested in that order (request-protocol §4.3), whichever answer
    /// reader completed them.
    roi_done: Line,
    /// Per readout unit, per step (RoI, full): its requests not yet answered, in the order sent.
    asked: Vec<[Mutex<Asked>; 2]>,
    /// Per readout unit: an overdue request was logged (once per unit: a unit that breaks the
    /// order may do it for every event).
    overdue_logged: Vec<AtomicBool>,
}

impl BuilderUnit {
    /// Starts a request-mode builder: connects to the event manager, every readout unit and the
    /// recorder, then asks for events.
    pub fn start_pull(cfg: PullConfig) -> std::io::Result<BuilderUnit> {
        let n = cfg.readout_units.len();
        let per_link = (cfg.buffer / n.max(1) as u64).max(2 * cfg.read_chunk as u64);
        let stats = Arc::new(BuilderStats::new(
            cfg.id,
            cfg.readout_units.iter().map(|r| r.0),
            per_link,
            1,
        ));
        let mut role = RoleThreads::default();
        let patience = Duration::from_secs(10);
        let id = cfg.id as u32;
        let em = open(
            &cfg.event_manager,
            Role::BuilderUnit,
            Channel::Control,
            id,
            patience,
        )?;
        let mut controls = Vec::new();
        let mut datas = Vec::new();
        for (_, addr, _) in &cfg.readout_units {
            controls.push(open(
                addr,
                Role::BuilderUnit,
                Channel::Control,
                id,
                patience,
            )?);
            datas.push(open(addr, Role::BuilderUnit, Channel::Data, id, patience)?);
        }
        for l in &stats.links {
            l.connected.store(true, Ordering::Relaxed);
        }
        let to_recorder = match &cfg.recorder {
            Some(addr) => {
                let s = tessera_net::io::connect_retry(addr, patience)?;
                tessera_net::io::tune(&s, Some(Duration::from_secs(1)))?;
                Some(s)
            }
            None => None,
        };
        let mut to_rus = Vec::new();
        let mut request_queues = Vec::new();
        for s in controls {
            let (tx, rx) = bounded::<Message>(4096);
            to_rus.push(tx);
            request_queues.push((s, rx));
        }
        let mut expected: Vec<u32> = cfg
            .readout_units
            .iter()
            .flat_map(|r| r.2.iter().copied())
            .collect();
        expected.sort_unstable();
        let pull = Arc::new(Pull {
            id: cfg.id,
            rus: cfg
                .readout_units
                .iter()
                .map(|(r, _, s)| (*r, s.clone()))
                .collect(),
            expected,
            stats: stats.clone(),
            filter: cfg.filter,
            events: Mutex::new(HashMap::new()),
            to_rus,
            manager: Mutex::new(ManagerLink {
                tx: None,
                held: HashSet::new(),
                recent: VecDeque::new(),
                memory: cfg.takeover_memory,
            }),
            credits: cfg.credits,
            to_recorder: Mutex::new(None),
            recording: to_recorder.is_some(),
            clock: tessera_net::clock::Runnable::start(),
            timeout_ns: cfg.event_timeout.as_nanos() as u64,
            last_answer_ns: (0..n).map(|_| AtomicU64::new(0)).collect(),
            looked_ns: (0..n).map(|_| AtomicU64::new(0)).collect(),
            drained_ns: (0..n).map(|_| AtomicU64::new(0)).collect(),
            held: (0..n).map(|_| AtomicBool::new(false)).collect(),
            abort: role.abort.clone(),
            ended: AtomicBool::new(false),
            lost: (0..n).map(|_| AtomicBool::new(false)).collect(),
            roi_done: Line::default(),
            asked: (0..n).map(|_| Default::default()).collect(),
            overdue_logged: (0..n).map(|_| AtomicBool::new(false)).collect(),
        });
        for (i, (mut s, rx)) in request_queues.into_iter().enumerate() {
            let p = pull.clone();
            role.spawn(
                format!("bu{id}-req-ru{}", cfg.readout_units[i].0),
                move || {
                    if let Err(e) = write_loop(&mut s, &rx) {
                        p.ru_lost(i, format!("request connection: {e}"));
                    }
                },
            );
        }
        if let Some(s) = to_recorder {
            let (tx, rx) = bounded::<Vec<Kept>>(256);
            *pull.to_recorder.lock() = Some(tx);
            let unacked = Arc::new(Mutex::new(Unacknowledged::default()));
            // Each link the sender opens goes to the acknowledgement reader, which says when it
            // ended.
            let (links_tx, links_rx) = crossbeam_channel::unbounded::<(u64, TcpStream)>();
            let (ended_tx, ended_rx) = crossbeam_channel::unbounded::<u64>();
            let link = RecorderLink {
                addr: cfg.recorder.clone().unwrap_or_default(),
                takeover: cfg.recorder_takeover,
                unacked: unacked.clone(),
                links: links_tx,
                ended: ended_rx,
            };
            let p = pull.clone();
            role.spawn(format!("bu{id}-to-rec"), move || {
                send_to_recorder(&p, s, rx, link)
            });
            let p = pull.clone();
            role.spawn(format!("bu{id}-rec-acks"), move || {
                read_acks(&p, links_rx, ended_tx, &unacked)
            });
        }
        let (writer, tx) = tessera_net::control::spawn_writer(format!("bu{id}-to-em"), &em)?;
        let _ = tx.send(Message::Credit {
            credits: cfg.credits,
        });
        pull.manager.lock().tx = Some(tx);
        for (i, s) in datas.into_iter().enumerate() {
            let p = pull.clone();
            let chunk = cfg.read_chunk.max(2 * cfg.max_message);
            let max = cfg.max_message;
            role.spawn(
                format!("bu{id}-ans-ru{}", cfg.readout_units[i].0),
                move || read_answers(&p, i, s, chunk, max),
            );
        }
        {
            let p = pull.clone();
            role.spawn(format!("bu{id}-sweep"), move || sweep(&p));
        }
        {
            let p = pull.clone();
            let hb = cfg.heartbeat;
            role.spawn(format!("bu{id}-beat"), move || beat(&p, hb));
        }
        {
            let p = pull;
            let (addr, takeover) = (cfg.event_manager.clone(), cfg.takeover);
            role.spawn(format!("bu{id}-from-em"), move || {
                manager_link(&p, em, writer, &addr, takeover);
                p.ended.store(true, Ordering::Relaxed);
                p.finish();
            });
        }
        Ok(BuilderUnit { stats, role })
    }
}

impl Pull {
    fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }

    /// The run is over (or the event manager is gone): end every connection.
    fn finish(&self) {
        let end = Message::End { units: 0, items: 0 };
        for tx in &self.to_rus {
            let _ = tx.send(end.clone());
        }
        if let Some(tx) = self.manager.lock().tx.take() {
            let _ = tx.send(end);
        }
        // Dropping the queue ends the recorder link once it has written what is queued.
        self.to_recorder.lock().take();
    }

    fn assigned(&self, events: &[(u64, u32)]) {
        let now = self.now_ns();
        let roi = self.filter.roi();
        let mut sends: Vec<(usize, Message)> = Vec::new();
        let mut unasked = Vec::new();
        self.manager
            .lock()
            .held
            .extend(events.iter().map(|&(e, _)| e));
        {
            let mut map = self.events.lock();
            for &(e, flags) in events {
                let rebuild = flags & ASSIGN_REBUILD != 0;
                let (step, asks) = if roi.is_empty() {
                    (STEP_FULL, self.ask(|_| true))
                } else {
                    (STEP_ROI, self.ask(|s| roi.contains(&s)))
                };
                self.stats.events_in_flight.fetch_add(1, Ordering::Relaxed);
                if rebuild {
                    self.stats.events_rebuilt.fetch_add(1, Ordering::Relaxed);
                }
                let b = Building {
                    rebuild,
                    since_ns: now,
                    step,
                    pending: asks.iter().map(|a| a.0).collect(),
                    parts: Vec::new(),
                };
                if asks.is_empty() {
                    // Every unit it needs is lost: nothing to wait for.
                    unasked.push((e, b));
                } else {
                    map.insert(e, b);
                }
                for (ru, sources) in asks {
                    sends.push((
                        ru,
                        Message::Request {
                            tag: step,
                            event_id: e,
                            sources,
                        },
                    ));
                }
            }
        }
        self.send_requests(sends);
        for (e, b) in unasked {
            self.step_done(e, b, None);
        }
    }

    /// Readout unit `slot`'s connection is lost before the end of the run (its process died,
    /// or the link failed): events stop waiting for it, now and from now on, and are built
    /// with its sources named missing. Without this every event would wait out the timeout,
    /// holding the builder's credit, and the run would crawl at one credit-full per timeout.
    fn ru_lost(&self, slot: usize, why: String) {
        self.stats.links[slot].error.lock().get_or_insert(why);
        if self.ended.load(Ordering::Relaxed) || self.abort.load(Ordering::Relaxed) {
            return;
        }
        let ready: Vec<(u64, Building, Option<Ticket>)> = {
            let mut map = self.events.lock();
            if self.lost[slot].swap(true, Ordering::AcqRel) {
                return;
            }
            for a in &self.asked[slot] {
                *a.lock() = Asked::default();
            }
            tracing::error!(
                builder = self.id,
                readout_unit = self.rus[slot].0,
                "readout unit lost: its sources are missing from every event from now on"
            );
            let mut ids: Vec<u64> = map
                .iter_mut()
                .filter_map(|(e, b)| {
                    b.pending.retain(|&s| s != slot);
                    b.pending.is_empty().then_some(*e)
                })
                .collect();
            ids.sort_unstable();
            ids.into_iter()
                .filter_map(|e| map.remove(&e).map(|b| (e, b)))
                .map(|(e, b)| {
                    let place = (b.step == STEP_ROI).then(|| self.roi_done.ticket());
                    (e, b, place)
                })
                .collect()
        };
        for (e, b, place) in ready {
            self.step_done(e, b, place);
        }
    }

    /// Which readout units to ask for the sources `want` selects, and with what list (empty:
    /// all of the unit's sources).
    fn ask(&self, want: impl Fn(u32) -> bool) -> Vec<(usize, Vec<u32>)> {
        let mut v = Vec::new();
        for (i, (_, sources)) in self.rus.iter().enumerate() {
            if self.lost[i].load(Ordering::Acquire) {
                continue;
            }
            let pick: Vec<u32> = sources.iter().copied().filter(|&s| want(s)).collect();
            if pick.is_empty() {
                continue;
            }
            v.push((
                i,
                if pick.len() == sources.len() {
                    Vec::new()
                } else {
                    pick
                },
            ));
        }
        v
    }

    fn send_requests(&self, sends: Vec<(usize, Message)>) {
        self.stats
            .requests
            .fetch_add(sends.len() as u64, Ordering::Relaxed);
        for (ru, m) in sends {
            if let Message::Request { tag, event_id, .. } = &m {
                // Noted just before it is queued: the requests of one step are queued by one
                // thread at a time (the manager's reader; the rest of accepted events in the
                // RoI steps' line), so this is the order they go on the connection.
                if let Some(a) = step_index(*tag).and_then(|i| self.asked[ru].get(i)) {
                    a.lock().sent(*event_id);
                }
            }
            // Blocking: a readout unit that stops reading requests (its descriptors for this
            // builder are in use) holds this builder, which is the back-pressure wanted.
            let _ = self.to_rus[ru].send(m);
        }
    }

    fn answered(&self, slot: usize, h: AnswerHeader, body: ChunkSlice) {
        let e = h.event_id;
        if let Some(a) = step_index(h.tag).and_then(|i| self.asked[slot].get(i)) {
            a.lock().answered(e, || self.now_ns());
        }
        // An RoI answer is copied out of the link's read chunk: kept there until the rest of
        // its event arrived, it would hold the chunk while later events' RoI answers fill the
        // link ahead of that rest, and a link of a few chunks could then never read it. The
        // copies are bounded by the credits times the RoI's size.
        let body = if h.tag == STEP_ROI {
            ChunkSlice::copy_from(&body)
        } else {
            body
        };
        let step_done = {
            let mut map = self.events.lock();
            match map.get_mut(&e) {
                Some(b) if b.step == h.tag && b.pending.contains(&slot) => {
                    b.pending.retain(|&s| s != slot);
                    self.stats
                        .held_fragments
                        .fetch_add(h.fragment_count as u64, Ordering::Relaxed);
                    b.parts.push((h, body));
                    if b.pending.is_empty() {
                        map.remove(&e).map(|b| {
                            let place = (b.step == STEP_ROI).then(|| self.roi_done.ticket());
                            (b, place)
                        })
                    } else {
                        None
                    }
                }
                _ => {
                    // For an event built already (timed out) or not ours.
                    self.stats
                        .late_fragments
                        .fetch_add(h.fragment_count as u64, Ordering::Relaxed);
                    None
                }
            }
        };
        if let Some((b, place)) = step_done {
            self.step_done(e, b, place);
        }
    }

    /// A step of event `e` has all its answers. `place`: its place among RoI steps completed,
    /// in which order the rest of accepted events is requested.
    fn step_done(&self, e: u64, mut b: Building, place: Option<Ticket>) {
        let roi = self.filter.roi();
        // The filter decides after the RoI step, or after the only step when there is no RoI.
        let deciding = b.step == STEP_ROI || roi.is_empty();
        if deciding && !self.accepts(e, &b.parts) {
            drop(place);
            let n = b.fragments();
            self.stats.events_rejected.fetch_add(1, Ordering::Relaxed);
            self.stats
                .fragments_rejected
                .fetch_add(n, Ordering::Relaxed);
            self.stats.held_fragments.fetch_sub(n, Ordering::Relaxed);
            self.done(&[(e, Outcome::Rejected)]);
            return;
        }
        if b.step == STEP_ROI {
            // Asked under the lock that `ru_lost` takes: no event waits on a unit lost meanwhile.
            let mut map = self.events.lock();
            let asks = self.ask(|s| !roi.contains(&s));
            if !asks.is_empty() {
                b.step = STEP_FULL;
                b.pending = asks.iter().map(|a| a.0).collect();
                let sends = asks
                    .into_iter()
                    .map(|(ru, sources)| {
                        (
                            ru,
                            Message::Request {
                                tag: STEP_FULL,
                                event_id: e,
                                sources,
                            },
                        )
                    })
                    .collect();
                map.insert(e, b);
                drop(map);
                if let Some(p) = &place {
                    p.wait_turn();
                }
                self.send_requests(sends);
                return;
            }
        }
        drop(place);
        self.build(e, b);
    }

    fn accepts(&self, e: u64, parts: &[(AnswerHeader, ChunkSlice)]) -> bool {
        let frags = fragment_views(e, parts);
        let refs: Vec<FragmentRef> = frags
            .iter()
            .map(|(s, p)| FragmentRef {
                source_id: *s,
                payload: p,
            })
            .collect();
        self.filter.accept(e, &refs)
    }

    /// Reports events finished and gives their credit back.
    fn done(&self, events: &[(u64, Outcome)]) {
        if events.is_empty() {
            return;
        }
        self.stats
            .events_in_flight
            .fetch_sub(events.len() as u64, Ordering::Relaxed);
        let mut m = self.manager.lock();
        for &(e, o) in events {
            m.held.remove(&e);
            if m.memory > 0 {
                if m.recent.len() >= m.memory {
                    m.recent.pop_front();
                }
                m.recent.push_back((e, o));
            }
        }
        // While the manager is lost the report waits in `recent` for the one that takes over.
        if let Some(tx) = &m.tx {
            let _ = tx.send(Message::Done {
                events: events.to_vec(),
            });
            let _ = tx.send(Message::Credit {
                credits: events.len() as u32,
            });
        }
    }

    /// Events that will never be done (lost at the recorder link): not claimed in a rejoin, so
    /// that a manager taking over has them built again elsewhere.
    fn forget(&self, events: impl IntoIterator<Item = u64>) {
        let mut m = self.manager.lock();
        for e in events {
            m.held.remove(&e);
        }
    }

    fn build(&self, e: u64, b: Building) {
        let st = &self.stats;
        st.latency
            .observe_ns(self.now_ns().saturating_sub(b.since_ns));
        let mut rec = crate::record::Record::default();
        if b.rebuild {
            rec.flags |= EventFlags::REBUILT;
        }
        for (h, body) in &b.parts {
            // A malformed answer's sources show up below as missing.
            rec.add_part(e, body, h.fragment_count, st);
        }
        // Parts come from several requests in any order: fragments go in source order.
        let source = |f: &ChunkSlice| FragmentHeader::source_id(f);
        rec.fragments.sort_by_key(source);
        let missing: Vec<u32> = self
            .expected
            .iter()
            .copied()
            .filter(|s| rec.fragments.binary_search_by_key(s, source).is_err())
            .collect();
        let (header, fragments, fragment_count) = rec.finish(e, self.id, missing, st);
        // Counted in the event (or malformed) now: no longer held.
        st.held_fragments
            .fetch_sub(b.fragments(), Ordering::Relaxed);
        let nf = fragment_count as u64;
        let tx = self.to_recorder.lock().clone();
        match tx {
            Some(tx) => {
                let built = Built {
                    header,
                    fragments,
                    fragment_count,
                    event_id: e,
                    _queued: Some(Queued::new(&self.stats, nf)),
                };
                if tx.send(vec![Kept(Arc::new(built))]).is_err() {
                    st.recorder_lost.fetch_add(nf, Ordering::Relaxed);
                    self.forget([e]);
                }
            }
            None if self.recording => {
                st.recorder_lost.fetch_add(nf, Ordering::Relaxed);
                self.forget([e]);
            }
            // Building measured alone: done at once.
            None => self.done(&[(e, Outcome::Recorded)]),
        }
    }
}

/// (source ID, payload) of every fragment in the answers, for the filter.
fn fragment_views(e: u64, parts: &[(AnswerHeader, ChunkSlice)]) -> Vec<(u32, &[u8])> {
    let mut v = Vec::new();
    for (_, body) in parts {
        for f in Fragments::new(body).flatten() {
            if f.header.event_id == e {
                v.push((f.header.source_id, &body[f.payload_range()]));
            }
        }
    }
    v
}

fn read_answers(p: &Pull, slot: usize, mut stream: TcpStream, chunk: usize, max: usize) {
    let link = &p.stats.links[slot];
    let mut reader = ChunkReader::new(link.budgets[0].clone(), chunk);
    let mut want = 0usize;
    let mut lost: Option<String> = None;
    let mut drained_at: Option<u64> = None;
    loop {
        let mut done = false;
        loop {
            match request::decode(reader.window(), max) {
                Ok(request::Decoded::Message(Message::Answer(h), n)) => {
                    let all = reader.take(n);
                    let hs = h.header_size();
                    let body = all.slice(hs, n - hs);
                    link.super_fragments.fetch_add(1, Ordering::Relaxed);
                    link.fragments
                        .fetch_add(h.fragment_count as u64, Ordering::Relaxed);
                    p.answered(slot, h, body);
                }
                Ok(request::Decoded::Message(Message::End { items, .. }, n)) => {
                    reader.skip(n);
                    link.declared_fragments.store(items, Ordering::Relaxed);
                    done = true;
                    break;
                }
                Ok(request::Decoded::Message(other, _)) => {
                    lost = Some(format!("unexpected {other:?} on a data connection"));
                    done = true;
                    break;
                }
                Ok(request::Decoded::NeedMore(n)) => {
                    want = if reader.window().is_empty() { 0 } else { n };
                    break;
                }
                Err(e) => {
                    lost = Some(e.to_string());
                    done = true;
                    break;
                }
            }
        }
        if done {
            break;
        }
        if let Some(at) = drained_at.take() {
            if reader.window().is_empty() {
                p.drained_ns[slot].fetch_max(at, Ordering::AcqRel);
            }
        }
        match reader.fill_marking_waits(&mut stream, want, &p.abort, Some(&p.held[slot])) {
            Ok(Fill::Data(n)) => {
                let started = reader.read_started.map(|t| p.clock.ns_at(t));
                if n == 0 {
                    if let Some(at) = started {
                        p.looked_ns[slot].fetch_max(at, Ordering::AcqRel);
                    }
                } else {
                    // Stored once per read, not per answer: the answers parsed from it are
                    // timed by it, and part of an answer is an answer under way (the unit is
                    // not silent).
                    p.last_answer_ns[slot].store(p.now_ns(), Ordering::Release);
                }
                // Stored once the answers this read brought are noted (`answered`), and only if
                // it ended on an answer's end: a request answered in it is not then taken for
                // overdue, nor one whose answer it brought in part.
                drained_at = started.filter(|_| reader.drained());
            }
            Ok(Fill::Eof) => {
                if !reader.window().is_empty() {
                    lost = Some("connection closed inside an answer".into());
                } else if !p.ended.load(Ordering::Relaxed) {
                    lost = Some("readout unit closed the data connection".into());
                }
                break;
            }
            Ok(Fill::Stopped | Fill::NoMemory) => break,
            Err(e) => {
                lost = Some(e.to_string());
                break;
            }
        }
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
    if let Some(why) = lost {
        p.ru_lost(slot, why);
    }
}

/// Beats to the event manager every `every` until the run ends, on a thread that does nothing
/// else: every other thread of the builder may wait for the recorder's queue (the sweep builds
/// late events), and a builder held by its recorder is alive. Beating from the sweep, builders
/// of a run held by its recorder for a few seconds were declared dead and their events built
/// again.
fn beat(p: &Pull, every: Duration) {
    let mut last = Instant::now();
    let mut seq = 0u64;
    loop {
        std::thread::sleep(Duration::from_millis(5).min(every));
        if p.ended.load(Ordering::Relaxed) || p.abort.load(Ordering::Relaxed) {
            break;
        }
        if last.elapsed() >= every {
            seq += 1;
            if let Some(tx) = &p.manager.lock().tx {
                let _ = tx.try_send(Message::Heartbeat { sequence: seq });
            }
            last = Instant::now();
        }
    }
}

fn sweep(p: &Pull) {
    loop {
        std::thread::sleep(Duration::from_millis(5));
        if p.ended.load(Ordering::Relaxed) || p.abort.load(Ordering::Relaxed) {
            break;
        }
        let now = p.now_ns();
        // Per unit, the latest look that found nothing; or now, by the clock, while this
        // builder's own memory keeps the unit's answers unread and only the events waiting can
        // give it back: the reader's wait was refused with no memory given back since, and no
        // built event holds any on its way to the recorder. Memory held by built events is the
        // recorder's back-pressure and costs time only; by the clock, a run held by its
        // recorder for seconds built a thousand events incomplete. Loaded before the answer
        // times below: an empty read that began after bytes came is then seen with those
        // bytes' time (the reader stores that before it reads on).
        // Acquire: pairs with `Queued`'s release, so the budgets are seen with that memory back.
        let nothing_queued = p.stats.queued_fragments.load(Ordering::Acquire) == 0;
        let held: Vec<bool> = (0..p.rus.len())
            .map(|r| {
                p.held[r].load(Ordering::Acquire)
                    && nothing_queued
                    && p.stats.links[r].budgets[0].refused_since_given()
            })
            .collect();
        let by_look = |r: usize, t: &[AtomicU64]| {
            if held[r] {
                now
            } else {
                t[r].load(Ordering::Acquire)
            }
        };
        let looked: Vec<u64> = (0..p.rus.len()).map(|r| by_look(r, &p.looked_ns)).collect();
        // Per unit, the latest read that left its socket empty, for overdue requests.
        let drained: Vec<u64> = (0..p.rus.len())
            .map(|r| by_look(r, &p.drained_ns))
            .collect();
        let (late, ready) = {
            let mut map = p.events.lock();
            // Late: some unit it waits for has answered nothing since the event asked, or
            // since its last answer, for a whole timeout (a unit that stopped answering), as
            // proven by a look (above).
            let ids: Vec<u64> = map
                .iter()
                .filter(|(_, b)| {
                    b.pending.iter().any(|&r| {
                        let heard = p.last_answer_ns[r].load(Ordering::Acquire);
                        gave_nothing_for(b.since_ns.max(heard), looked[r], p.timeout_ns)
                    })
                })
                .map(|(e, _)| *e)
                .collect();
            let late: Vec<(u64, Building)> = ids
                .into_iter()
                .filter_map(|e| map.remove(&e).map(|b| (e, b)))
                .collect();
            // Overdue: a unit answered a later request of the same sources a whole timeout ago
            // and never this one (`Asked`). The event stops waiting for that unit alone, as
            // for a lost unit: its sources are named missing.
            let mut overdue = Vec::new();
            for (r, steps) in p.asked.iter().enumerate() {
                for (step, asked) in STEPS.iter().zip(steps) {
                    let waits = |e: u64| {
                        map.get(&e)
                            .is_some_and(|b| b.step == *step && b.pending.contains(&r))
                    };
                    let mut a = asked.lock();
                    a.bound(p.credits as usize, waits);
                    overdue.extend(
                        a.take_overdue(drained[r], p.timeout_ns, waits)
                            .into_iter()
                            .map(|e| (e, r)),
                    );
                }
            }
            overdue.sort_unstable();
            let mut ready = Vec::new();
            for (e, r) in overdue {
                let Some(b) = map.get_mut(&e) else { continue };
                b.pending.retain(|&s| s != r);
                p.stats.overdue_requests.fetch_add(1, Ordering::Relaxed);
                if !p.overdue_logged[r].swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        builder = p.id,
                        readout_unit = p.rus[r].0,
                        event_id = e,
                        "readout unit left a request unanswered while it answered later ones of \
                         the same sources (request-protocol 4.3, rule 4): the event is built \
                         without its sources (logged once; counted as overdue requests)"
                    );
                }
                if b.pending.is_empty() {
                    if let Some(b) = map.remove(&e) {
                        let place = (b.step == STEP_ROI).then(|| p.roi_done.ticket());
                        ready.push((e, b, place));
                    }
                }
            }
            (late, ready)
        };
        for (e, b) in late {
            // Answers missing past the timeout: built with what came, the rest named missing.
            p.build(e, b);
        }
        for (e, b, place) in ready {
            p.step_done(e, b, place);
        }
        p.stats
            .pending_events
            .store(p.events.lock().len() as u64, Ordering::Relaxed);
    }
}

/// Whether a unit that last answered (or was last asked) at `from` has answered nothing for
/// more than `timeout`, as seen by a look at `looked` that found nothing new.
fn gave_nothing_for(from: u64, looked: u64, timeout: u64) -> bool {
    looked.saturating_sub(from) > timeout
}

/// A built event kept until the recorder acknowledges it: the link writes it from one handle
/// while [`Unacknowledged`] holds another, to send it again on a new link if this one breaks.
/// Its memory (and its `queued_fragments`) goes back with the last handle, at the ack.
#[derive(Clone)]
struct Kept(Arc<Built>);

impl tessera_net::sender::Outgoing for Kept {
    fn encode_header(&self, out: &mut Vec<u8>) {
        self.0.encode_header(out)
    }
    fn fragments(&self) -> &[ChunkSlice] {
        self.0.fragments()
    }
    fn fragment_count(&self) -> u64 {
        self.0.fragment_count()
    }
}

/// Events sent to the recorder and not yet acknowledged, in the order of the link they are on
/// (wire format §2.6, §2.8). The sending thread notes each batch before it writes it, so an
/// acknowledgement never runs ahead of what is noted. A new link (`relink`) sends all of them
/// again, first; acknowledgements of an older link are then stale and ignored.
#[derive(Default)]
struct Unacknowledged {
    records: VecDeque<Kept>,
    /// The link the records are on now.
    link: u64,
    /// Records of this link acknowledged and reported done.
    settled: u64,
}

impl Unacknowledged {
    /// These go on the link now, after every one noted before.
    fn sending(&mut self, batch: &[Kept]) {
        self.records.extend(batch.iter().cloned());
    }

    /// The recorder holds the first `records` records of `link`: those are done.
    fn acknowledged(&mut self, link: u64, records: u64) -> Vec<(u64, Outcome)> {
        let mut done = Vec::new();
        if link != self.link {
            return done;
        }
        while self.settled < records {
            let Some(k) = self.records.pop_front() else {
                break;
            };
            done.push((k.0.event_id, Outcome::Recorded));
            self.settled += 1;
        }
        done
    }

    /// A new link opens: its number, and every record to send on it again, in order.
    fn relink(&mut self) -> (u64, Vec<Kept>) {
        self.link += 1;
        self.settled = 0;
        (self.link, self.records.iter().cloned().collect())
    }

    /// Whether the recorder has acknowledged anything on the current link, or there was
    /// nothing to acknowledge: a link opened again is taken once it has.
    fn link_proven(&self) -> bool {
        self.settled > 0 || self.records.is_empty()
    }

    /// No link will take them: every record left, and no acknowledgement counts any more.
    fn give_up(&mut self) -> Vec<Kept> {
        self.link += 1;
        self.records.drain(..).collect()
    }
}

/// What the recorder sender needs beside its queue.
struct RecorderLink {
    addr: String,
    takeover: Duration,
    unacked: Arc<Mutex<Unacknowledged>>,
    /// Each link opened, with its number, to the acknowledgement reader.
    links: Sender<(u64, TcpStream)>,
    /// The number of each link whose reader saw it end (the recorder closed it, or it failed).
    ended: crossbeam_channel::Receiver<u64>,
}

/// How a link to the recorder ended, for the sender.
enum LinkEnd {
    /// Every record sent and acknowledged after the builder's peer end.
    Done,
    /// It broke with records unacknowledged, or the recorder closed it early.
    Broken,
    /// The run was aborted while the builder's last records waited for their acknowledgement.
    Aborted,
}

/// Sends built events to the recorder, each kept until acknowledged. A link that breaks is
/// opened again at the same address for up to `takeover` and every unacknowledged event sent
/// again on it (a recorder restarted there adopts the run's files and drops what they hold);
/// past that they are counted lost at the recorder link and forgotten (so that a manager taking
/// the run over has them built again elsewhere). Meanwhile the queue fills and the builder
/// stops building: back-pressure, not loss.
fn send_to_recorder(
    p: &Pull,
    first: TcpStream,
    rx: crossbeam_channel::Receiver<Vec<Kept>>,
    link: RecorderLink,
) {
    let st = &p.stats;
    let hello = PeerHello {
        role: PeerRole::BuilderUnit,
        id: p.id as u32,
        flags: PeerHello::WANTS_ACKS,
    };
    let mut stream = first;
    let mut why = String::new();
    // Since the link first broke, until a new one was acknowledged: when the wait ends. A
    // connection alone proves nothing (a listening socket held open with no recorder behind
    // it, as under socket activation, takes it into its backlog): the recorder must
    // acknowledge within the same wait.
    let mut recovering: Option<Instant> = None;
    loop {
        let (number, resend) = link.unacked.lock().relink();
        let end = match stream.try_clone() {
            Ok(acks) => match link.links.send((number, acks)) {
                Ok(()) => one_link(
                    p,
                    stream,
                    (hello, number, resend),
                    &rx,
                    &link,
                    &mut recovering,
                    &mut why,
                ),
                Err(_) => LinkEnd::Aborted,
            },
            Err(e) => {
                why = e.to_string();
                LinkEnd::Broken
            }
        };
        match end {
            LinkEnd::Done | LinkEnd::Aborted => return,
            LinkEnd::Broken => {}
        }
        let held = link.unacked.lock().records.len();
        let first_break = recovering.is_none();
        let deadline = *recovering.get_or_insert_with(|| Instant::now() + link.takeover);
        if first_break && !link.takeover.is_zero() && !p.abort.load(Ordering::Relaxed) {
            tracing::warn!(
                builder = p.id,
                reason = %why,
                held,
                "recorder link broke; keeping the events it has not acknowledged and connecting again for up to {} s",
                link.takeover.as_secs()
            );
        }
        let again = if Instant::now() >= deadline && !first_break {
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no recorder acknowledged anything at the address",
            ))
        } else {
            reconnect(&link.addr, deadline, &p.abort)
        };
        match again {
            Ok(s) => {
                st.recorder_relinks.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    builder = p.id,
                    held,
                    "recorder link open again: sending again what was not acknowledged"
                );
                stream = s;
            }
            Err(e) => {
                // Nothing will take them: counted, by name, and left to a manager that takes
                // the run over (not claimed in a rejoin).
                let mut kept = link.unacked.lock().give_up();
                // And what waits in the queue: an event built from now on finds no queue and is
                // counted lost where it is built; one on its way into the queue ends here (the
                // queue ends once no sender is left).
                p.to_recorder.lock().take();
                kept.extend(rx.iter().flatten());
                let events: Vec<u64> = kept.iter().map(|k| k.0.event_id).collect();
                let fragments: u64 = kept.iter().map(|k| k.0.fragment_count as u64).sum();
                st.recorder_lost.fetch_add(fragments, Ordering::Relaxed);
                p.forget(events.iter().copied());
                let msg = format!(
                    "recorder link: {why}; not back within {} s ({e}): {} events ({fragments} fragments) it held unacknowledged are counted lost at the recorder link (those the recorder wrote before it was lost are in its last file too)",
                    link.takeover.as_secs(),
                    events.len()
                );
                tracing::error!(builder = p.id, "{msg}");
                *st.recorder_error.lock() = Some(msg);
                // Nothing this builder builds can be recorded: it ends, and the event manager
                // gives what it holds to the others (or, with none left, ends the run).
                p.abort.store(true, Ordering::Release);
                return;
            }
        }
    }
}

/// Drives one link to the recorder: the hello, what an earlier link left unacknowledged (after
/// a resend message), then the queue until it closes, then the peer end and the wait for the
/// last acknowledgement.
/// While `recovering` (a link that broke, until when a new one may take to be acknowledged), a
/// link that acknowledges nothing by then is broken too; its first acknowledgement ends the
/// recovery.
fn one_link(
    p: &Pull,
    stream: TcpStream,
    (hello, number, resend): (PeerHello, u64, Vec<Kept>),
    rx: &crossbeam_channel::Receiver<Vec<Kept>>,
    link: &RecorderLink,
    recovering: &mut Option<Instant>,
    why: &mut String,
) -> LinkEnd {
    // Whether a recovering link has gone its wait without an acknowledgement.
    let unproven = |recovering: &mut Option<Instant>| -> bool {
        let Some(until) = *recovering else {
            return false;
        };
        if link.unacked.lock().link_proven() {
            *recovering = None;
            return false;
        }
        Instant::now() >= until
    };
    let mut failed: Option<String> = None;
    let mut on_error = |e: &std::io::Error| {
        failed.get_or_insert_with(|| e.to_string());
    };
    // Sent batches are noted before their write; the acknowledgements settle them.
    let mut on_batch = |_: tessera_net::sender::BatchOutcome, _: &[Kept]| {};
    let mut w = tessera_net::sender::LinkWriter::open(stream, hello, &mut on_error);
    if !resend.is_empty() {
        p.stats
            .events_resent
            .fetch_add(resend.len() as u64, Ordering::Relaxed);
        let m = tessera_format::link::Resend {
            records: resend.len() as u64,
        };
        w.write_message(&m.encode(), &mut on_error);
        w.send(resend, &mut on_batch, &mut on_error);
    }
    let tick = Duration::from_millis(100);
    let mut closed = false;
    while w.is_ok() && !closed {
        crossbeam_channel::select! {
            recv(rx) -> got => match got {
                Ok(mut batch) => {
                    // Several batches per write when they are queued: fewer system calls.
                    while batch.len() < 512 {
                        match rx.try_recv() {
                            Ok(more) => batch.extend(more),
                            Err(_) => break,
                        }
                    }
                    link.unacked.lock().sending(&batch);
                    w.send(batch, &mut on_batch, &mut on_error);
                }
                Err(_) => closed = true,
            },
            recv(link.ended) -> n => {
                if n.map_or(true, |n| n == number) {
                    failed.get_or_insert_with(|| "the recorder closed the link".into());
                    break;
                }
            },
            default(tick) => {}
        }
        if unproven(recovering) {
            failed.get_or_insert_with(|| "nothing acknowledged on the link opened again".into());
            break;
        }
    }
    if !(closed && w.is_ok()) {
        w.abandon();
        *why = failed.unwrap_or_else(|| "broken".into());
        return LinkEnd::Broken;
    }
    w.finish(false);
    // The recorder closes the link once it has acknowledged everything; a close with records
    // left unacknowledged is a recorder that died after the builder's end.
    loop {
        match link.ended.recv_timeout(tick) {
            Ok(n) if n == number => break,
            Ok(_) => {}
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                if p.abort.load(Ordering::Relaxed) {
                    return LinkEnd::Aborted;
                }
                if unproven(recovering) {
                    *why = "nothing acknowledged on the link opened again".into();
                    return LinkEnd::Broken;
                }
            }
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
        }
    }
    if link.unacked.lock().records.is_empty() {
        LinkEnd::Done
    } else {
        *why = "the recorder closed the link before acknowledging every event".into();
        LinkEnd::Broken
    }
}

/// Connects to the recorder again, until `deadline` or the abort.
fn reconnect(addr: &str, deadline: Instant, abort: &AtomicBool) -> std::io::Result<TcpStream> {
    loop {
        if abort.load(Ordering::Relaxed) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Interrupted,
                "the run was aborted",
            ));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match tessera_net::io::connect_retry(addr, Duration::ZERO) {
            Ok(s) => {
                tessera_net::io::tune(&s, Some(Duration::from_secs(1)))?;
                return Ok(s);
            }
            Err(e) if left.is_zero() => return Err(e),
            Err(_) => std::thread::sleep(left.min(Duration::from_millis(100))),
        }
    }
}

/// Reads the recorder's acknowledgements on each link the sender opens and reports the events
/// they cover done, in the order they were sent; tells the sender when a link ended (the
/// recorder closed it after its last acknowledgement, or it broke).
fn read_acks(
    p: &Pull,
    links: crossbeam_channel::Receiver<(u64, TcpStream)>,
    ended: Sender<u64>,
    unacked: &Mutex<Unacknowledged>,
) {
    for (number, mut stream) in links {
        read_link_acks(p, number, &mut stream, unacked);
        let _ = ended.send(number);
    }
}

fn read_link_acks(p: &Pull, number: u64, stream: &mut TcpStream, unacked: &Mutex<Unacknowledged>) {
    let mut buf: Vec<u8> = Vec::with_capacity(4096);
    let mut tmp = [0u8; 4096];
    loop {
        loop {
            match decode_link(&buf, 0) {
                Ok((LinkItem::Ack(a), n)) => {
                    buf.drain(..n);
                    let done = unacked.lock().acknowledged(number, a.records);
                    p.done(&done);
                }
                Ok((LinkItem::NeedMore(_), _)) | Ok((LinkItem::Idle, _)) => break,
                Ok((other, _)) => {
                    tracing::error!(
                        builder = p.id,
                        "recorder sent {other:?} on the link; it is given up"
                    );
                    let _ = stream.shutdown(std::net::Shutdown::Both);
                    return;
                }
                Err(e) => {
                    tracing::error!(builder = p.id, error = %e, "recorder link: bad acknowledgement; it is given up");
                    let _ = stream.shutdown(std::net::Shutdown::Both);
                    return;
                }
            }
        }
        match std::io::Read::read(stream, &mut tmp) {
            Ok(0) => return,
            Ok(n) => buf.extend_from_slice(&tmp[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) =>
            {
                if p.abort.load(Ordering::Relaxed) {
                    return;
                }
            }
            Err(_) => return,
        }
    }
}

/// Reads the event manager's assignments until its end. Lost before that (it died, or it
/// declared this builder dead), the connection is opened again for up to `takeover`, and the
/// builder rejoins (request-protocol §4.2); past that the error names the manager.
fn manager_link(
    p: &Pull,
    mut em: TcpStream,
    mut writer: std::thread::JoinHandle<()>,
    addr: &str,
    takeover: Duration,
) {
    let id = p.id as u32;
    let mut wait = tessera_net::control::TakeoverWait::new(takeover);
    loop {
        let opened = Instant::now();
        let mut heard = false;
        let mut r = MessageReader::new(1 << 24);
        let lost = loop {
            match r.next(&mut em, &p.abort) {
                Ok(Message::Assign { events }) => {
                    heard = true;
                    p.assigned(&events)
                }
                Ok(Message::End { .. }) | Err(ReadEnd::Stopped) => break None,
                Ok(other) => break Some(format!("event manager sent {other:?}")),
                // Closed without the end: the manager died, or dropped this builder as dead
                // (then the others rebuild its events).
                Err(ReadEnd::Closed) => break Some(
                    "the event manager closed the connection before the end of the run (it died, or declared this builder dead)".into(),
                ),
                // The manager's process died with bytes unread: the kernel resets the
                // connection, and the raw error would not say whose it was.
                Err(ReadEnd::Failed(e)) => break Some(format!("event manager link: {e}")),
            }
        };
        if lost.is_some() {
            // This connection is over: its writer ends with its queue.
            p.manager.lock().tx = None;
        }
        let Some(why) = lost else {
            // The run is over: this connection's last message is the builder's end.
            let tx = p.manager.lock().tx.take();
            if let Some(tx) = tx {
                let _ = tx.send(Message::End { units: 0, items: 0 });
            }
            let _ = writer.join();
            return;
        };
        let _ = em.shutdown(std::net::Shutdown::Both);
        let _ = writer.join();
        p.stats.manager_losses.fetch_add(1, Ordering::Relaxed);
        let deadline = match wait.lost(opened, heard) {
            Some(d) if !p.abort.load(Ordering::Relaxed) => d,
            _ => {
                p.stats.manager_error.lock().get_or_insert(why);
                return;
            }
        };
        tracing::warn!(
            builder = id,
            reason = %why,
            "lost the event manager; building what it holds and waiting up to {} s for it to take the run over",
            wait.seconds()
        );
        let back = tessera_net::control::reopen(addr, Role::BuilderUnit, id, deadline, &p.abort)
            .and_then(|s| {
                let w = tessera_net::control::spawn_writer(format!("bu{id}-to-em"), &s)?;
                Ok((w, s))
            });
        match back {
            Ok(((w, tx), s)) => {
                em = s;
                writer = w;
                let (held, done) = rejoin(p, tx);
                tracing::info!(
                    builder = id,
                    held,
                    done,
                    "event manager back: rejoined with the events held and finished"
                );
            }
            Err(e) => {
                p.stats.manager_error.lock().get_or_insert_with(|| {
                    format!("{why}; not back within {} s ({e})", wait.seconds())
                });
                return;
            }
        }
    }
}

/// On a new event-manager connection: the rejoin (events held, events finished most recently),
/// then the free credit; only then is the connection the builder's (under the manager lock), so
/// that no done report comes before the rejoin and none is missing from both.
fn rejoin(p: &Pull, tx: Sender<Message>) -> (usize, usize) {
    let mut m = p.manager.lock();
    let mut held: Vec<u64> = m.held.iter().copied().collect();
    held.sort_unstable();
    let done: Vec<(u64, Outcome)> = m.recent.iter().copied().collect();
    let max = request::MAX_LIST;
    let messages = held
        .len()
        .div_ceil(max)
        .max(done.len().div_ceil(max))
        .max(1);
    for i in 0..messages {
        let part = |n: usize| (i * max).min(n)..((i + 1) * max).min(n);
        let _ = tx.send(Message::Rejoin {
            held: held[part(held.len())].to_vec(),
            done: done[part(done.len())].to_vec(),
        });
    }
    let free = (p.credits as usize).saturating_sub(held.len());
    if free > 0 {
        let _ = tx.send(Message::Credit {
            credits: free as u32,
        });
    }
    m.tx = Some(tx);
    (held.len(), done.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Requests are overtaken only by the answer to a later event asked after them; overdue
    /// only a whole timeout after that, as a drain proves; and given up once taken.
    #[test]
    fn a_request_is_overdue_only_once_a_later_one_asked_after_it_was_answered() {
        let mut a = Asked::default();
        for e in [10, 11, 12] {
            a.sent(e);
        }
        // An older event given again (a dead builder's), asked after the others.
        a.sent(5);
        let waits = |_| true;
        // In order: nothing overtaken.
        a.answered(10, || panic!("no clock needed"));
        // The older event answered before 11 and 12: it overtakes neither.
        a.answered(5, || 100);
        assert!(a.take_overdue(u64::MAX, 0, waits).is_empty());
        // 12 before 11: 11 overtaken at 1 000.
        a.answered(12, || 1_000);
        a.sent(13);
        // Not before a whole timeout after it, by a drain.
        assert!(a.take_overdue(1_000 + 500, 500, waits).is_empty());
        assert_eq!(a.take_overdue(1_000 + 501, 500, waits), vec![11]);
        // Taken: not overdue twice; 13 was asked after 12's answer and is not overtaken.
        assert!(a.take_overdue(u64::MAX, 500, waits).is_empty());
        assert_eq!(a.sent.len(), 1);
        // Overtaken but no longer waited for (its event cut meanwhile): dropped, not returned.
        a.sent(14);
        a.answered(14, || 2_000);
        assert!(a.take_overdue(u64::MAX, 0, |_| false).is_empty());
        assert!(a.sent.is_empty());
        assert_eq!(a.overtaken, 0);
        // Requests whose events no longer wait go once there are more than the bound.
        for e in 20..30 {
            a.sent(e);
        }
        a.bound(10, |e| e >= 25);
        assert_eq!(a.sent.len(), 10, "at the bound: kept");
        a.sent(30);
        a.bound(10, |e| e >= 25);
        assert_eq!(
            a.sent.iter().map(|x| x.0).collect::<Vec<_>>(),
            vec![25, 26, 27, 28, 29, 30]
        );
    }

    fn ids(v: &[(u64, Outcome)]) -> Vec<u64> {
        v.iter().map(|d| d.0).collect()
    }

    fn kept(id: u64) -> Kept {
        Kept(Arc::new(Built {
            header: Default::default(),
            fragments: Default::default(),
            fragment_count: 1,
            event_id: id,
            _queued: None,
        }))
    }

    #[test]
    fn acknowledgements_settle_in_order_and_a_new_link_sends_the_rest_again() {
        let mut u = Unacknowledged::default();
        let (first, again) = u.relink();
        assert!(again.is_empty());
        u.sending(&[kept(7), kept(8), kept(9)]);
        assert_eq!(ids(&u.acknowledged(first, 1)), vec![7]);
        // Acknowledgements are cumulative: an old count settles nothing twice.
        assert_eq!(ids(&u.acknowledged(first, 1)), Vec::<u64>::new());
        // The link breaks: what it did not acknowledge goes again, in order, on the next.
        let (second, again) = u.relink();
        assert_eq!(
            again.iter().map(|k| k.0.event_id).collect::<Vec<_>>(),
            vec![8, 9]
        );
        u.sending(&[kept(10)]);
        // A late acknowledgement of the broken link counts for nothing: it numbered its own
        // records.
        assert_eq!(ids(&u.acknowledged(first, 3)), Vec::<u64>::new());
        // The new link counts from its hello, the records sent again first.
        assert_eq!(ids(&u.acknowledged(second, 2)), vec![8, 9]);
        assert_eq!(ids(&u.acknowledged(second, 3)), vec![10]);
        u.sending(&[kept(11)]);
        let left = u.give_up();
        assert_eq!(left.len(), 1);
        assert_eq!(ids(&u.acknowledged(second, 4)), Vec::<u64>::new());
    }
}

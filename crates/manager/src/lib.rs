//! The event manager of request mode (CMS EVM, ATLAS HLT supervisor, CODA trigger supervisor).
//!
//! It learns the event stream from the readout units (each announces the events it sees first;
//! the first announcement of an event counts), hands events to builders that have credit, tracks
//! every event in flight until its builder reports it done, then clears it from every readout
//! unit in groups. A builder whose connection drops or whose heartbeats stop is declared dead and
//! its unfinished events go, flagged for rebuilding, to the others. With no builder holding
//! credit and a long queue it tells the readout units BUSY, and they stop reading their links.
//!
//! One connection per identity: a hello naming a builder or readout unit outside the topology,
//! or one whose connection is open, is refused, counted and logged with the peer. A unit or
//! builder whose connection closed may connect again: that is how a manager restarted at the
//! same address takes a run over (request-protocol §4.2): the units announce again every event
//! they hold, the builders rejoin with what they hold and what they finished.
//!
//! Threads: an accept thread; per connection a reader and a writer (a queue bounded by the peer's
//! credit or by a fixed size); a ticker
//! for heartbeat timeouts, clear groups and the end of the run. The decisions live in
//! [`core::Core`], a pure state machine under one lock. Assignments are queued before the lock
//! is released (never blocking: credit bounds them), so each builder gets its events in the
//! order the core gave them; clears and BUSY go out after, so a slow readout unit holds only the
//! thread that writes to it.

pub mod core;

use crossbeam_channel::{bounded, unbounded, Sender};
use parking_lot::Mutex;
use std::collections::HashSet;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tessera_format::request::{Channel, Message, Role};
use tessera_net::control::{read_hello, write_loop, MessageReader, ReadEnd};
use tessera_net::role::{spawn, RoleThreads};

pub use crate::core::{Counts, Out, Settings};

/// Event IDs the event manager remembers as done, finished and cleared elsewhere (each).
pub const DONE_MEMORY: usize = 1 << 20;

/// The most heap memory the event manager holds in its memories of event IDs (done, finished
/// and cleared elsewhere, [`DONE_MEMORY`] each): what `tessera check` and a node agent count
/// for it. Its other tables are bounded by the builders' credits and the units' buffers.
pub fn bookkeeping_bytes() -> u64 {
    3 * tessera_assembly::RecentSet::bytes(DONE_MEMORY)
}

pub struct ManagerConfig {
    pub listener: TcpListener,
    /// IDs of the readout units; the run is over when all of them ended and nothing is in flight.
    pub readout_units: Vec<u32>,
    /// IDs of the builders: no other is accepted.
    pub builders: Vec<u32>,
    pub settings: Settings,
}

/// A snapshot for status lines and reports.
#[derive(Clone, Debug, Default)]
pub struct ManagerView {
    pub counts: Counts,
    pub in_flight: usize,
    pub unassigned: usize,
    pub oldest_age_s: f64,
    pub busy: bool,
    /// (builder ID, alive, events held, credits).
    pub builders: Vec<(u32, bool, usize, u64)>,
    pub readout_units_ended: usize,
    /// Still waiting for every builder and readout unit before assigning anything.
    pub gathering: bool,
    /// Readout units whose connection is open.
    pub readout_units_connected: usize,
    pub errors: Vec<String>,
}

struct BuilderConn {
    tx: Option<Sender<Message>>,
    /// Raised when the manager drops the builder, so its reader lets go.
    dropped: Arc<AtomicBool>,
}

struct Shared {
    core: Mutex<core::Core>,
    /// Runnable time since the manager started (`tessera_net::clock`): what timeouts count.
    clock: tessera_net::clock::Runnable,
    readout_units: Vec<u32>,
    builder_ids: Vec<u32>,
    ru_tx: Mutex<Vec<(u32, Sender<Message>)>>,
    /// Readout units whose connection is open now.
    ru_open: Mutex<HashSet<u32>>,
    ended: Mutex<HashSet<u32>>,
    builders: Mutex<Vec<BuilderConn>>,
    /// Assignment messages that may wait for one builder: its credit, and its end.
    assignments_queued_max: usize,
    /// `Settings::builder_wait_ns`.
    builder_wait_ns: u64,
    abort: Arc<AtomicBool>,
    finished: AtomicBool,
    errors: Mutex<Vec<String>>,
}

pub struct EventManager {
    shared: Arc<Shared>,
    role: RoleThreads,
}

impl EventManager {
    pub fn start(cfg: ManagerConfig) -> std::io::Result<EventManager> {
        let role = RoleThreads::default();
        let assignments_queued_max = cfg.settings.builder_credits as usize + 1;
        let builder_wait_ns = cfg.settings.builder_wait_ns;
        let shared = Arc::new(Shared {
            core: Mutex::new(core::Core::new(
                cfg.settings,
                &cfg.builders,
                &cfg.readout_units,
                0,
            )),
            clock: tessera_net::clock::Runnable::start(),
            readout_units: cfg.readout_units,
            builder_ids: cfg.builders,
            ru_tx: Mutex::new(Vec::new()),
            ru_open: Mutex::new(HashSet::new()),
            ended: Mutex::new(HashSet::new()),
            builders: Mutex::new(Vec::new()),
            assignments_queued_max,
            builder_wait_ns,
            abort: role.abort.clone(),
            finished: AtomicBool::new(false),
            errors: Mutex::new(Vec::new()),
        });
        let mut role = role;
        {
            let sh = shared.clone();
            let l = cfg.listener;
            role.spawn("em-accept".into(), move || accept(&sh, l));
        }
        {
            let sh = shared.clone();
            role.spawn("em-tick".into(), move || tick(&sh));
        }
        Ok(EventManager { shared, role })
    }

    pub fn view(&self) -> ManagerView {
        let sh = &self.shared;
        let now = sh.now_ns();
        let c = sh.core.lock();
        ManagerView {
            counts: c.counts.clone(),
            in_flight: c.in_flight(),
            unassigned: c.unassigned(),
            oldest_age_s: c.oldest_age_ns(now) as f64 / 1e9,
            busy: c.busy(),
            builders: c.builder_view(),
            readout_units_ended: sh.ended.lock().len(),
            gathering: c.gathering(),
            readout_units_connected: sh.ru_open.lock().len(),
            errors: sh.errors.lock().clone(),
        }
    }

    /// The run is stopping: nothing changes for the manager, which ends once the readout units
    /// ended and every event is done. Kept for symmetry with the other roles.
    pub fn stop(&self) {
        self.role.stop();
    }

    pub fn abort(&self) {
        self.role.abort();
    }

    pub fn is_finished(&self) -> bool {
        self.role.is_finished()
    }

    pub fn join(self) {
        self.role.join();
    }
}

impl Shared {
    fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }

    fn refuse(&self, peer: std::net::SocketAddr, why: String) {
        self.core.lock().counts.refused_connections += 1;
        self.error(format!("{peer}: refused: {why}"));
    }

    fn error(&self, e: String) {
        tracing::warn!(error = %e, "event manager");
        let mut v = self.errors.lock();
        if v.len() < 32 {
            v.push(e);
        }
    }

    /// Runs `decide` on the core, queues its assignments before the core is unlocked, then
    /// sends the rest. Queued after the unlock, as they once were, two threads' assignments
    /// reached a builder in either order, and builders must ask for their events in ascending
    /// order (request-protocol §4.3): with small read buffers, a builder stood still until its
    /// event timeout and built the events incomplete.
    fn decide<T>(&self, decide: impl FnOnce(&mut core::Core, &mut Vec<Out>) -> T) -> T {
        let mut outs = Vec::new();
        let (r, rest) = {
            let mut c = self.core.lock();
            let r = decide(&mut c, &mut outs);
            (r, self.queue_assignments(&mut c, outs))
        };
        self.dispatch(rest);
        r
    }

    /// Queues the assignments among `outs` (never blocking: they are bounded by the builders'
    /// credit, each message using at least one) and returns the other outputs.
    fn queue_assignments(&self, c: &mut core::Core, mut outs: Vec<Out>) -> Vec<Out> {
        let mut rest = Vec::new();
        while !outs.is_empty() {
            let mut more = Vec::new();
            for o in outs {
                let Out::Assign(slot, events) = o else {
                    rest.push(o);
                    continue;
                };
                let tx = self.builders.lock()[slot].tx.clone();
                let sent = match tx {
                    // More unread than a builder's credit allows: it gave more credit than
                    // `request.credits` (a peer breaking the protocol), and is declared dead
                    // rather than queued for without bound. A builder that reads nothing for a
                    // while within its credit (held by readout units that take no more
                    // requests) is alive: a fixed queue of 1 024 had it declared dead.
                    Some(tx) if tx.len() < self.assignments_queued_max => {
                        tx.send(Message::Assign { events }).is_ok()
                    }
                    _ => false,
                };
                if !sent {
                    c.builder_lost(slot, &mut more);
                }
            }
            outs = more;
        }
        rest
    }

    /// Sends what the core decided, its assignments already queued ([`Shared::decide`]). Never
    /// called with the core locked.
    fn dispatch(&self, outs: Vec<Out>) {
        let mut outs = std::collections::VecDeque::from(outs);
        while let Some(o) = outs.pop_front() {
            match o {
                // Not made by `decide`'s callers; queued here all the same rather than lost.
                Out::Assign(..) => {
                    let rest = self.queue_assignments(&mut self.core.lock(), vec![o]);
                    outs.extend(rest);
                }
                Out::Clear(ids) => {
                    let txs: Vec<Sender<Message>> =
                        self.ru_tx.lock().iter().map(|t| t.1.clone()).collect();
                    for tx in txs {
                        // Blocking: a readout unit slow to take clears holds the builder
                        // reports behind it, so credit stops and the manager throttles.
                        let _ = tx.send(Message::Clear {
                            event_ids: ids.clone(),
                        });
                    }
                }
                Out::Throttle(busy) => {
                    let txs: Vec<Sender<Message>> =
                        self.ru_tx.lock().iter().map(|t| t.1.clone()).collect();
                    for tx in txs {
                        let _ = tx.send(Message::Throttle { busy });
                    }
                }
                Out::Drop(slot) => {
                    let id = self.core.lock().builder_id(slot);
                    let mut b = self.builders.lock();
                    b[slot].tx = None;
                    b[slot].dropped.store(true, Ordering::Relaxed);
                    drop(b);
                    self.error(format!(
                        "builder {id} declared dead; its unfinished events go to the others"
                    ));
                }
            }
        }
    }
}

/// Takes connections until the run is over. Each hello is read on its own thread with its own
/// deadline, so a silent connection holds nobody else's hello.
fn accept(sh: &Arc<Shared>, listener: TcpListener) {
    let threads = Arc::new(Mutex::new(Vec::new()));
    let hellos = tessera_net::io::Hellos::default();
    let _ = tessera_net::io::accept_until(
        &listener,
        &sh.abort,
        || !sh.finished.load(Ordering::Relaxed),
        |mut stream, peer| {
            let under_way = match hellos.begin() {
                Ok(h) => h,
                Err(why) => return sh.refuse(peer, why),
            };
            let (sh2, t2) = (sh.clone(), threads.clone());
            let t = spawn("em-hello".into(), move || {
                let hello = read_hello(&mut stream);
                drop(under_way);
                let started = admit(&sh2, stream, peer, hello);
                t2.lock().extend(started);
            });
            let mut v = threads.lock();
            tessera_net::role::reap(&mut v);
            v.push(t);
        },
    );
    // A hello thread adds its connection's threads before it ends: joining it first makes
    // them visible here.
    loop {
        let next = threads.lock().pop();
        match next {
            Some(t) => {
                let _ = t.join();
            }
            None => break,
        }
    }
}

/// One connection per declared identity: the unknown and the second are refused.
fn admit(
    sh: &Arc<Shared>,
    stream: TcpStream,
    peer: std::net::SocketAddr,
    hello: Result<(Role, Channel, u32), String>,
) -> Vec<std::thread::JoinHandle<()>> {
    match hello {
        Ok((Role::ReadoutUnit, Channel::Control, id)) => {
            if !sh.readout_units.contains(&id) {
                sh.refuse(peer, format!("readout unit {id} is not in the topology"));
            } else if !sh.ru_open.lock().insert(id) {
                sh.refuse(peer, format!("readout unit {id} is connected already"));
            } else {
                return readout_unit(sh, stream, id);
            }
        }
        Ok((Role::BuilderUnit, Channel::Control, id)) => {
            if !sh.builder_ids.contains(&id) {
                sh.refuse(peer, format!("builder {id} is not in the topology"));
            } else {
                match builder(sh, stream, id) {
                    Some(t) => return t,
                    None => sh.refuse(peer, format!("builder {id} is connected already")),
                }
            }
        }
        Ok(other) => sh.refuse(peer, format!("unexpected hello {other:?}")),
        Err(e) => sh.refuse(peer, format!("hello: {e}")),
    }
    Vec::new()
}

fn readout_unit(sh: &Arc<Shared>, stream: TcpStream, id: u32) -> Vec<std::thread::JoinHandle<()>> {
    let (tx, rx) = bounded::<Message>(4096);
    let mut w = match stream.try_clone() {
        Ok(w) => w,
        Err(e) => {
            sh.error(format!("readout unit {id}: {e}"));
            sh.ru_open.lock().remove(&id);
            return Vec::new();
        }
    };
    {
        // A unit connecting again (it lost this manager's connection, or this manager takes
        // the run over) replaces its old queue, announces again what it holds, and says its
        // end again if its links had ended.
        sh.decide(|c, outs| {
            let mut t = sh.ru_tx.lock();
            t.retain(|x| x.0 != id);
            if c.busy() {
                let _ = tx.try_send(Message::Throttle { busy: true });
            }
            t.push((id, tx));
            sh.ended.lock().remove(&id);
            c.readout_unit_joined(id, sh.now_ns(), outs);
        });
    }
    let sh2 = sh.clone();
    let writer = spawn(format!("em-to-ru{id}"), move || {
        if let Err(e) = write_loop(&mut w, &rx) {
            sh2.error(format!("readout unit {id}: {e}"));
        }
    });
    let sh3 = sh.clone();
    let reader = spawn(format!("em-from-ru{id}"), move || {
        let mut stream = stream;
        let mut r = MessageReader::new(1 << 24);
        let mut said_end = false;
        loop {
            match r.next(&mut stream, &sh3.abort) {
                Ok(Message::Announce { event_ids }) => {
                    sh3.decide(|c, outs| c.announce(&event_ids, sh3.now_ns(), outs))
                }
                Ok(Message::End { .. }) => {
                    said_end = true;
                    sh3.ended.lock().insert(id);
                }
                Ok(other) => {
                    sh3.error(format!("readout unit {id} sent {other:?}; closing"));
                    break;
                }
                Err(ReadEnd::Closed) => {
                    if !said_end {
                        sh3.error(format!(
                            "readout unit {id} lost before its end (connection closed): the run goes on without its sources"
                        ));
                    }
                    break;
                }
                Err(ReadEnd::Stopped) => break,
                Err(ReadEnd::Failed(e)) => {
                    sh3.error(format!("readout unit {id}: {e}"));
                    break;
                }
            }
        }
        // A unit gone without its end announces nothing more: the run must not wait for it.
        sh3.ended.lock().insert(id);
        sh3.ru_open.lock().remove(&id);
    });
    vec![writer, reader]
}

/// Serves a builder's connection; `None` if a builder with its ID is connected already (checked
/// and joined under one lock: two hellos at once cannot both pass).
fn builder(
    sh: &Arc<Shared>,
    stream: TcpStream,
    id: u32,
) -> Option<Vec<std::thread::JoinHandle<()>>> {
    // Bounded by the builder's credit (`Shared::queue_assignments`), not by its capacity.
    let (tx, rx) = unbounded::<Message>();
    let dropped = Arc::new(AtomicBool::new(false));
    let slot = {
        let mut c = sh.core.lock();
        let mut b = sh.builders.lock();
        if c.builder_alive(id) {
            return None;
        }
        let slot = c.builder_joined(id, sh.now_ns());
        drop(c);
        debug_assert_eq!(slot, b.len());
        b.push(BuilderConn {
            tx: Some(tx),
            dropped: dropped.clone(),
        });
        slot
    };
    let mut w = match stream.try_clone() {
        Ok(w) => w,
        Err(e) => {
            sh.error(format!("builder {id}: {e}"));
            return Some(Vec::new());
        }
    };
    let writer = spawn(format!("em-to-bu{id}"), move || {
        // A failed write shows as the reader's failure too; the reader declares the loss.
        let _ = write_loop(&mut w, &rx);
    });
    let sh2 = sh.clone();
    let reader = spawn(format!("em-from-bu{id}"), move || {
        let mut stream = stream;
        let mut r = MessageReader::new(1 << 24);
        let mut clean = false;
        loop {
            if dropped.load(Ordering::Relaxed) {
                break;
            }
            let looked = |t: std::time::Instant| {
                let at = sh2.clock.ns_at(t);
                sh2.core.lock().looked(slot, at);
            };
            match r.next_noting(&mut stream, &dropped, looked) {
                Ok(Message::Credit { credits }) => {
                    sh2.decide(|c, outs| c.credit(slot, credits, sh2.now_ns(), outs))
                }
                Ok(Message::Done { events }) => {
                    sh2.decide(|c, outs| c.done(slot, &events, sh2.now_ns(), outs))
                }
                Ok(Message::Rejoin { held, done }) => {
                    sh2.decide(|c, outs| c.rejoin(slot, &held, &done, sh2.now_ns(), outs))
                }
                Ok(Message::Heartbeat { .. }) => sh2.core.lock().heartbeat(slot, sh2.now_ns()),
                Ok(Message::End { .. }) => {
                    clean = true;
                    break;
                }
                Ok(other) => {
                    sh2.error(format!("builder {id} sent {other:?}; dropping it"));
                    break;
                }
                Err(ReadEnd::Closed) | Err(ReadEnd::Stopped) => break,
                Err(ReadEnd::Failed(e)) => {
                    sh2.error(format!("builder {id}: {e}"));
                    break;
                }
            }
        }
        if !clean || !sh2.finished.load(Ordering::Relaxed) {
            sh2.decide(|c, outs| c.builder_lost(slot, outs));
        }
        let _ = stream.shutdown(std::net::Shutdown::Both);
    });
    Some(vec![writer, reader])
}

fn tick(sh: &Arc<Shared>) {
    loop {
        std::thread::sleep(Duration::from_millis(5));
        let now = sh.now_ns();
        let mut orphaned = None;
        let done = sh.decide(|c, outs| {
            c.tick(now, outs);
            let all_ended = sh.ended.lock().len() >= sh.readout_units.len();
            if all_ended && c.in_flight() == 0 && !c.gathering() {
                c.flush_clears(outs);
                true
            } else if c.builderless_ns(now) > sh.builder_wait_ns {
                orphaned = Some(c.in_flight());
                c.flush_clears(outs);
                true
            } else {
                false
            }
        });
        if let Some(n) = orphaned {
            // The readout units end at the manager's end before their sources did, and report
            // what they hold.
            sh.error(format!(
                "every builder lost and none back within {} s: the run ends with {n} events never built (their fragments are still stored at the readout units, counted there)",
                sh.builder_wait_ns / 1_000_000_000
            ));
        }
        if done || sh.abort.load(Ordering::Relaxed) {
            break;
        }
    }
    // The end: every readout unit and builder is told, then their queues close.
    sh.finished.store(true, Ordering::Relaxed);
    let end = Message::End { units: 0, items: 0 };
    for (_, tx) in sh.ru_tx.lock().drain(..) {
        let _ = tx.send(end.clone());
    }
    let aborted = sh.abort.load(Ordering::Relaxed);
    for b in sh.builders.lock().iter_mut() {
        if let Some(tx) = b.tx.take() {
            let _ = tx.send(end.clone());
        }
        // Aborted: nobody waits for a builder to close its side.
        if aborted {
            b.dropped.store(true, Ordering::Relaxed);
        }
    }
}

//! Emulated front-end sources. Each source opens one TCP connection to its readout unit, says
//! hello, and sends one fragment per trigger. All sources derive the same triggers (event IDs,
//! times, trigger types) from the shared seed, like boards fed by one trigger system.
//!
//! Sources are driven by a few threads, each serving several sources in lock step (a front-end
//! crate): per batch of due triggers, every source's fragments are encoded straight into that
//! source's send buffer and written with one call. A write that blocks is TCP back-pressure from
//! the readout unit; the time blocked is the source's held (dead) time.

pub mod schedule;

use parking_lot::Mutex;
use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tessera_config::{InjectKind, Injection, SourcesSection};
use tessera_format::pattern::Pattern;
use tessera_format::wire::{self, encode_fragment_at, FragmentHeader, Hello, StreamEnd};

pub mod replay;
pub use replay::Replay;
pub use schedule::{payload_size, trigger_type, Sizes, TriggerSchedule};

/// Live counters of one source.
#[derive(Debug, Default)]
pub struct SourceStats {
    pub id: u32,
    /// Fragments put on the wire, bad ones included.
    pub fragments: AtomicU64,
    pub bytes: AtomicU64,
    /// Nanoseconds spent blocked in writes (back-pressure from the readout unit).
    pub held_ns: AtomicU64,
    /// Highest event ID sent so far + 1.
    pub next_event: AtomicU64,
    pub finished: AtomicBool,
    /// Set when the connection closed early (injected, or the peer went away).
    pub disconnected: AtomicBool,
    pub error: Mutex<Option<String>>,
    /// An operator's fault rehearsal on this source, until its time is up (`fault_on` says
    /// whether to look, so that a source without one pays one relaxed load per trigger).
    fault: Mutex<Option<(SourceFault, Instant)>>,
    fault_on: AtomicBool,
}

/// A fault an operator injects into an emulated source while the run goes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceFault {
    /// One of `[[inject]]`'s kinds on every event while it lasts (`disconnect`: once; the
    /// source stays disconnected).
    Inject(tessera_config::InjectKind),
    /// Each trigger's fragment sent this much later: the driver thread waits (and with it the
    /// other sources it drives, `sources.threads`).
    Delay(Duration),
}

impl SourceStats {
    /// Injects `f` for `duration` from now (replacing any under way).
    pub fn set_fault(&self, f: SourceFault, duration: Duration) {
        *self.fault.lock() = Some((f, Instant::now() + duration));
        self.fault_on.store(true, Ordering::Release);
    }

    /// The fault under way, if any (one whose time is up is forgotten here).
    pub fn fault(&self) -> Option<SourceFault> {
        if !self.fault_on.load(Ordering::Acquire) {
            return None;
        }
        let mut g = self.fault.lock();
        match *g {
            Some((f, until)) if Instant::now() < until => Some(f),
            _ => {
                *g = None;
                self.fault_on.store(false, Ordering::Release);
                None
            }
        }
    }
}

/// What a group of emulated sources needs to run.
#[derive(Clone, Debug)]
pub struct SourcePlan {
    pub settings: SourcesSection,
    pub pattern: Pattern,
    pub max_payload: usize,
    /// (source ID, readout unit address).
    pub sources: Vec<(u32, String)>,
    pub injections: Vec<Injection>,
    /// Stop after this many triggers (0: no limit).
    pub events: u64,
    /// Start with the triggers held (as paused, the schedule's clock standing still) until
    /// [`RunningSources::resume`]: the run waits for external sources before its first event.
    pub start_held: bool,
    /// Veto triggers that come while the front-ends are BUSY (the caller has checked that
    /// these are every emulated source of the run: one trigger decides for all), or queue them.
    pub veto: bool,
    /// The times of `sources.scenario`, read (for `trigger = "scenario"`).
    pub scenario: Option<Arc<[u64]>>,
    /// `sources.size_histogram`, read.
    pub size_histogram: Option<Arc<tessera_config::SizeHistogram>>,
    /// Sources that listen (server mode): each waits for its readout unit to connect.
    pub listening: Vec<(u32, Arc<std::net::TcpListener>)>,
    /// Each source's readout unit, where known (else its address tells): a driver thread
    /// serves the sources of one unit, or whole units (see [`driver_groups`]).
    pub unit_of: std::collections::HashMap<u32, u32>,
    /// Payloads and trigger types from a recording (`sources.replay`), instead of emulated ones;
    /// the caller sets the schedule from its times.
    pub replay: Option<Arc<Replay>>,
}

/// The trigger's counts: every offered trigger is accepted or vetoed.
#[derive(Debug, Default)]
pub struct TriggerStats {
    /// `veto` or `queue`.
    pub policy: &'static str,
    pub offered: AtomicU64,
    pub accepted: AtomicU64,
    /// Offered while BUSY, not taken.
    pub vetoed: AtomicU64,
    /// With a veto: the trigger time (since the start, pauses left out) of the last trigger
    /// offered, so that rates are counted over the time triggers came, not over a run whose
    /// start and drain take longer.
    pub last_offered_ns: AtomicU64,
}

/// CPU time used by every source driver thread that has finished in this process: the emulated
/// front-ends' share, which a measurement of the DAQ's own cost takes out (real front-ends are
/// other hardware).
pub static DRIVER_CPU_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Handles to running source threads and their counters.
pub struct RunningSources {
    pub stats: Vec<Arc<SourceStats>>,
    pub trigger: Arc<TriggerStats>,
    threads: Vec<JoinHandle<()>>,
    control: Arc<Control>,
}

/// The trigger gate, shared by all driver threads. A driver claims each batch of triggers before
/// sending it; claiming and seeing a stop or a pause are one step under the lock, so once either
/// is set the highest claimed trigger is final and every source sends exactly up to it: a pause
/// or a stop never leaves an event sent by only some sources.
#[derive(Default)]
struct Control {
    gate: Mutex<Gate>,
    /// With a veto: the accepted triggers the drivers have not all sent yet.
    log: Mutex<Log>,
    /// Rung when triggers are accepted or the log ends.
    more: parking_lot::Condvar,
    trigger: Arc<TriggerStats>,
}

/// Accepted triggers on their way to every source (veto mode): the front-ends' derandomizers,
/// seen together. The trigger is BUSY while the driver furthest behind has `depth` accepted
/// events not yet sent.
#[derive(Default)]
struct Log {
    /// Trigger times of events `base..next`.
    times: std::collections::VecDeque<u64>,
    base: u64,
    /// One past the last accepted event ID.
    next: u64,
    /// Per driver: the next event ID it sends.
    sent: Vec<u64>,
    /// No trigger will be accepted any more (stopped, scenario over, `events` reached).
    ended: bool,
}

impl Log {
    fn slowest(&self) -> u64 {
        self.sent.iter().copied().min().unwrap_or(self.next)
    }

    /// Forgets the times every driver has sent.
    fn trim(&mut self) {
        let done = self.slowest();
        while self.base < done && !self.times.is_empty() {
            self.times.pop_front();
            self.base += 1;
        }
    }
}

#[derive(Clone, Copy, Default)]
struct Gate {
    stopping: bool,
    /// One past the highest claimed event ID.
    claimed: u64,
    paused_since: Option<Instant>,
    /// Time spent paused before `paused_since`: the trigger schedule's clock stands still while
    /// paused, so a resume does not fire the missed triggers in one burst.
    paused_total: Duration,
}

impl Control {
    /// Claims triggers up to `end` (exclusive); returns how far this driver may send.
    fn claim(&self, end: u64) -> u64 {
        let mut g = self.gate.lock();
        if g.stopping || g.paused_since.is_some() {
            g.claimed
        } else {
            // Queued triggers are all taken: offered and accepted move together.
            let more = end.saturating_sub(g.claimed);
            self.trigger.offered.fetch_add(more, Ordering::Relaxed);
            self.trigger.accepted.fetch_add(more, Ordering::Relaxed);
            g.claimed = g.claimed.max(end);
            end
        }
    }

    fn state(&self) -> Gate {
        *self.gate.lock()
    }
}

impl RunningSources {
    /// Stops the triggers as a trigger system does: every source sends up to the same last
    /// event ID (the highest any source has claimed), ends its stream and closes, so a stop
    /// leaves no event built from only some sources.
    pub fn stop(&self) {
        self.control.gate.lock().stopping = true;
        self.control.more.notify_all();
    }

    /// Holds the triggers (a run pause): every source sends up to the highest trigger already
    /// claimed, then waits with its connection open.
    pub fn pause(&self) {
        let mut g = self.control.gate.lock();
        if g.paused_since.is_none() {
            g.paused_since = Some(Instant::now());
        }
    }

    /// Releases the triggers held by [`pause`](Self::pause); the schedule goes on from where it
    /// stood.
    pub fn resume(&self) {
        let mut g = self.control.gate.lock();
        if let Some(t) = g.paused_since.take() {
            g.paused_total += t.elapsed();
        }
    }

    /// One past the highest event ID any source here has claimed: after a pause or a stop,
    /// where these sources end.
    pub fn claimed(&self) -> u64 {
        self.control.gate.lock().claimed
    }

    /// Raises the last event of a pause or a stop to `end` (one past it): sources on several
    /// hosts each claim their own triggers, so the run control takes the highest of all and
    /// has every host send up to it, and no event is left sent by only some sources.
    pub fn align(&self, end: u64) {
        let mut g = self.control.gate.lock();
        g.claimed = g.claimed.max(end);
    }

    pub fn paused(&self) -> bool {
        self.control.gate.lock().paused_since.is_some()
    }

    pub fn join(self) {
        for t in self.threads {
            let _ = t.join();
        }
    }

    /// Whether every driver thread has returned (after `stop`, or a failed connection).
    pub fn threads_finished(&self) -> bool {
        self.threads.iter().all(|t| t.is_finished())
    }

    pub fn all_finished(&self) -> bool {
        self.stats
            .iter()
            .all(|s| s.finished.load(Ordering::Relaxed))
    }
}

struct Link {
    stats: Arc<SourceStats>,
    stream: Option<TcpStream>,
    /// Bytes to write, `buf[..used]`. The vector is not shortened after a write: the next
    /// batch's fragments are encoded over the old bytes, which spares zeroing every fragment's
    /// bytes before writing them (2-3 % of a 1 KiB build's instructions, sources included).
    buf: Vec<u8>,
    used: usize,
    injections: Vec<Injection>,
    /// An event held back by a `swap` injection, sent after the next one.
    swapped: Option<u64>,
}

/// Connects every source and starts the driver threads. [`RunningSources::stop`] ends them.
pub fn start(mut plan: SourcePlan) -> std::io::Result<RunningSources> {
    let paced = plan.settings.trigger != tessera_config::TriggerMode::Unlimited;
    let veto = plan.veto && paced;
    let control = Arc::new(Control {
        trigger: Arc::new(TriggerStats {
            policy: if veto { "veto" } else { "queue" },
            ..Default::default()
        }),
        ..Default::default()
    });
    if plan.start_held {
        control.gate.lock().paused_since = Some(Instant::now());
    }
    let mut links = Vec::new();
    // The unit each source feeds, for the drivers' grouping: its ID where known, else its
    // address (a listening source of unknown unit stands alone).
    let mut units: Vec<String> = Vec::new();
    let unit_key = |id: u32, addr: Option<&String>| match (plan.unit_of.get(&id), addr) {
        (Some(u), _) => format!("unit {u}"),
        (None, Some(a)) => format!("address {a}"),
        (None, None) => format!("source {id}"),
    };
    for (id, addr) in &plan.sources {
        units.push(unit_key(*id, Some(addr)));
    }
    for (id, _) in &plan.listening {
        units.push(unit_key(*id, None));
    }
    // A listening source's readout unit dials it as soon as the unit starts (before this).
    let listening = std::mem::take(&mut plan.listening);
    let connected = plan
        .sources
        .iter()
        .map(|(id, addr)| -> std::io::Result<(u32, TcpStream)> {
            Ok((
                *id,
                tessera_net::io::connect_retry(addr, Duration::from_secs(10))?,
            ))
        })
        .chain(
            listening
                .iter()
                .map(|(id, l)| -> std::io::Result<(u32, TcpStream)> {
                    Ok((
                        *id,
                        tessera_net::io::accept_one(l, Duration::from_secs(10))?,
                    ))
                }),
        );
    for c in connected {
        let (id, stream): (u32, TcpStream) = c?;
        let id = &id;
        stream.set_nodelay(true)?;
        let mut s = stream;
        s.write_all(&Hello::new(*id).encode())?;
        // Non-blocking from here, so that a write that has to wait is told apart from one that
        // does not (see `write_counting_held`).
        s.set_nonblocking(true)?;
        let stats = Arc::new(SourceStats {
            id: *id,
            ..Default::default()
        });
        let injections = plan
            .injections
            .iter()
            .filter(|i| i.source == *id)
            .cloned()
            .collect();
        links.push(Link {
            stats,
            stream: Some(s),
            buf: Vec::new(),
            used: 0,
            injections,
            swapped: None,
        });
    }
    let stats = links.iter().map(|l| l.stats.clone()).collect();
    let threads_wanted = match plan.settings.threads {
        0 => links.len().clamp(1, 4),
        n => (n as usize).min(links.len()).max(1),
    };
    let mut groups: Vec<Vec<Link>> = (0..threads_wanted).map(|_| Vec::new()).collect();
    for (l, g) in links.into_iter().zip(driver_groups(&units, threads_wanted)) {
        groups[g].push(l);
    }
    control.log.lock().sent = vec![0; groups.len()];
    let plan = Arc::new(plan);
    let t0 = Instant::now();
    let mut threads: Vec<JoinHandle<()>> = groups
        .into_iter()
        .enumerate()
        .map(|(k, group)| {
            let plan = plan.clone();
            let control = control.clone();
            std::thread::Builder::new()
                .name(format!("source-drv-{k}"))
                .spawn(move || {
                    // Emulated sources starved of a core are late, not silent (the readout
                    // unit beside them in this process counts its timeouts in runnable time).
                    let _watched = tessera_net::clock::watch_this_thread();
                    if veto {
                        drive_accepted(&plan, group, &control, k);
                    } else {
                        drive(&plan, group, &control, t0);
                    }
                    DRIVER_CPU_NS.fetch_add(
                        tessera_net::role::thread_cpu_ns(),
                        std::sync::atomic::Ordering::Relaxed,
                    );
                })
                .expect("spawn source thread")
        })
        .collect();
    if veto {
        let plan = plan.clone();
        let control = control.clone();
        threads.push(
            std::thread::Builder::new()
                .name("trigger".into())
                .spawn(move || {
                    trigger_unit(&plan, &control, t0);
                    DRIVER_CPU_NS.fetch_add(
                        tessera_net::role::thread_cpu_ns(),
                        std::sync::atomic::Ordering::Relaxed,
                    );
                })
                .expect("spawn trigger thread"),
        );
    }
    Ok(RunningSources {
        stats,
        trigger: control.trigger.clone(),
        threads,
        control,
    })
}

/// The driver thread of each source, given the unit each feeds (in source order) and the
/// number of threads: a thread serves the sources of one readout unit (a unit with several
/// threads splits its sources among them), or, with fewer threads than units, whole units. A
/// thread writes its sources in lock step and a write that blocks holds all of them: had it
/// served a source of a unit that is held by back-pressure and one of another unit that is not,
/// the second unit would see that source stop while its others went on, and after its timeout
/// build its events without it (1 022 events incomplete, one blocking monitor station held 20 s
/// on a busy host). Whole units stop together, at one trigger batch: nothing is incomplete.
pub fn driver_groups(units: &[String], threads: usize) -> Vec<usize> {
    let threads = threads.max(1);
    let mut distinct: Vec<&String> = Vec::new();
    for u in units {
        if !distinct.contains(&u) {
            distinct.push(u);
        }
    }
    let n = distinct.len().max(1);
    // Threads per unit (units beyond the threads share them, whole), and the first of each.
    let per: Vec<usize> = (0..n)
        .map(|j| {
            if n >= threads {
                1
            } else {
                threads / n + usize::from(j < threads % n)
            }
        })
        .collect();
    let first: Vec<usize> = (0..n)
        .map(|j| {
            if n >= threads {
                j % threads
            } else {
                per[..j].iter().sum()
            }
        })
        .collect();
    let mut seen = vec![0usize; n];
    units
        .iter()
        .map(|u| {
            let j = distinct.iter().position(|d| *d == u).unwrap_or(0);
            let g = first[j] + seen[j] % per[j];
            seen[j] += 1;
            g
        })
        .collect()
}

/// The shortest the trigger sleeps between looks at the clock: triggers due within it are
/// decided together, on the BUSY state of that moment.
const TRIGGER_TICK: Duration = Duration::from_micros(200);

/// The trigger of a run with a veto: offers the schedule's triggers at their times and takes
/// each one only when no front-end is BUSY, giving the taken ones consecutive event IDs; the
/// others are vetoed and counted. Holds while paused (its clock stands still), ends on a stop,
/// when the scenario runs out or `events` triggers are taken.
fn trigger_unit(plan: &SourcePlan, control: &Control, t0: Instant) {
    let s = &plan.settings;
    let mut sched = TriggerSchedule::from_settings(s, plan.scenario.clone());
    let depth = u64::from(s.derandomizer.max(1));
    let hard_end = if plan.events > 0 {
        plan.events
    } else {
        u64::MAX
    };
    let st = &control.trigger;
    let mut pending = sched.next_trigger();
    loop {
        let g = control.state();
        if g.stopping || pending.is_none() {
            break;
        }
        if g.paused_since.is_some() {
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        let now = t0.elapsed().saturating_sub(g.paused_total).as_nanos() as u64;
        let mut accepted_any = false;
        {
            let mut log = control.log.lock();
            // Triggers are taken under the gate's lock: once a pause or a stop has set the
            // gate, nothing more is taken, and `claimed` is where every source ends.
            let mut g = control.gate.lock();
            if g.stopping || g.paused_since.is_some() {
                continue;
            }
            while let Some((_, t)) = pending.filter(|&(_, t)| t <= now) {
                if log.next >= hard_end {
                    pending = None;
                    break;
                }
                st.offered.fetch_add(1, Ordering::Relaxed);
                st.last_offered_ns.store(t, Ordering::Relaxed);
                if log.next.saturating_sub(log.slowest()) >= depth {
                    st.vetoed.fetch_add(1, Ordering::Relaxed);
                } else {
                    log.times.push_back(t);
                    log.next += 1;
                    st.accepted.fetch_add(1, Ordering::Relaxed);
                    accepted_any = true;
                }
                pending = sched.next_trigger();
            }
            if log.next >= hard_end {
                pending = None;
            }
            g.claimed = g.claimed.max(log.next);
        }
        if accepted_any {
            control.more.notify_all();
        }
        if let Some((_, t)) = pending {
            let wait = Duration::from_nanos(t.saturating_sub(now));
            std::thread::sleep(wait.clamp(TRIGGER_TICK, Duration::from_millis(5)));
        }
    }
    control.log.lock().ended = true;
    control.more.notify_all();
}

/// A driver of a run with a veto: sends the accepted triggers, in order, as the trigger takes
/// them.
fn drive_accepted(plan: &SourcePlan, mut links: Vec<Link>, control: &Control, k: usize) {
    let s = &plan.settings;
    let mean_wire = wire::fragment_wire_size(s.fragment_size.0 as usize);
    let batch_events = ((s.batch.0 as usize) / mean_wire.max(1)).clamp(1, 4096) as u64;
    let mut due: Vec<(u64, u64)> = Vec::with_capacity(batch_events as usize);
    loop {
        if links.iter().all(|l| l.stream.is_none()) {
            break;
        }
        due.clear();
        {
            let mut log = control.log.lock();
            let from = log.sent[k];
            if from >= log.next {
                // Stopped with everything sent: the log is final once the trigger ended, or
                // once a stop is seen (the trigger takes nothing after it).
                if log.ended {
                    break;
                }
                control.more.wait_for(&mut log, Duration::from_millis(20));
                continue;
            }
            let to = log.next.min(from + batch_events);
            for ev in from..to {
                due.push((ev, log.times[(ev - log.base) as usize]));
            }
        }
        let next_event = due.last().map_or(0, |d| d.0 + 1);
        send_due(plan, &mut links, &due, next_event);
        let mut log = control.log.lock();
        log.sent[k] = next_event;
        log.trim();
    }
    // A driver whose links all failed sends nothing more: it must not hold the others BUSY.
    {
        let mut log = control.log.lock();
        log.sent[k] = u64::MAX;
        log.trim();
    }
    finish_links(plan, &mut links);
}

fn drive(plan: &SourcePlan, mut links: Vec<Link>, control: &Control, t0: Instant) {
    let s = &plan.settings;
    let mut sched = TriggerSchedule::from_settings(s, plan.scenario.clone());
    let mean_wire = wire::fragment_wire_size(s.fragment_size.0 as usize);
    // Unlimited: batch as many triggers as fill `batch` bytes. Paced: whatever is due, capped.
    let batch_events = ((s.batch.0 as usize) / mean_wire.max(1)).clamp(1, 4096) as u64;
    let paced = sched.paced();
    let mut hard_end = if plan.events > 0 {
        plan.events
    } else {
        u64::MAX
    };
    let mut next_event = 0u64;
    let mut pending: Option<(u64, u64)> = None; // (event, time) peeked from the schedule
    loop {
        let g = control.state();
        let stopping = g.stopping;
        let end = if stopping {
            g.claimed.min(hard_end)
        } else if g.paused_since.is_some() {
            // Paused: catch up to what other drivers claimed, then wait.
            g.claimed.min(hard_end)
        } else {
            hard_end
        };
        if links.iter().all(|l| l.stream.is_none()) || (stopping && next_event >= end) {
            break;
        }
        if next_event >= end {
            if next_event >= hard_end {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        let mut due: Vec<(u64, u64)> = Vec::with_capacity(batch_events as usize);
        let now = t0.elapsed().saturating_sub(g.paused_total).as_nanos() as u64;
        while (due.len() as u64) < batch_events && next_event < end {
            let Some((ev, t)) = pending.take().or_else(|| sched.next_trigger()) else {
                // The schedule has run out (a scenario's last trigger): that is the end.
                hard_end = hard_end.min(next_event);
                break;
            };
            // After a stop, triggers other sources already sent are due at once.
            if paced && !stopping && t > now {
                pending = Some((ev, t));
                break;
            }
            due.push((ev, t));
            next_event = ev + 1;
        }
        if due.is_empty() {
            if next_event >= hard_end {
                // Every source stops at the same trigger: the schedule is the same for all.
                control.claim(next_event);
                break;
            }
            if let Some((_, t)) = pending {
                std::thread::sleep(
                    Duration::from_nanos(t.saturating_sub(now)).min(Duration::from_millis(20)),
                );
            }
            continue;
        }
        let allowed = control.claim(next_event);
        if allowed < next_event {
            due.retain(|&(ev, _)| ev < allowed);
            next_event = allowed;
        }
        send_due(plan, &mut links, &due, next_event);
    }
    finish_links(plan, &mut links);
}

/// Sends the triggers `due` on every live link, one write per link.
fn send_due(plan: &SourcePlan, links: &mut [Link], due: &[(u64, u64)], next_event: u64) {
    for link in links.iter_mut() {
        if link.stream.is_none() {
            continue;
        }
        for &(ev, t) in due {
            emit(plan, link, ev, t);
            if link.stream.is_none() {
                break;
            }
        }
        flush(link);
        link.stats.next_event.store(next_event, Ordering::Relaxed);
    }
}

/// Ends every link: a held-back event, the end of stream, and a wait for the readout unit's
/// close.
fn finish_links(plan: &SourcePlan, links: &mut [Link]) {
    for link in links.iter_mut() {
        if let Some(ev) = link.swapped.take() {
            encode(plan, link, ev, 0, 0, None);
        }
        if link.stream.is_some() {
            let n = link.stats.fragments.load(Ordering::Relaxed);
            link.buf.truncate(link.used);
            link.buf.extend_from_slice(
                &StreamEnd {
                    source_id: link.stats.id,
                    fragments_sent: n,
                }
                .encode(),
            );
            link.used = link.buf.len();
            flush(link);
            if let Some(st) = link.stream.take() {
                let _ = st.shutdown(std::net::Shutdown::Write);
                // Wait for the readout unit to close its side, so that the end-of-stream is read
                // before the connection can be reset.
                let _ = st.set_nonblocking(false);
                let _ = st.set_read_timeout(Some(Duration::from_secs(10)));
                let _ = std::io::Read::read(&mut &st, &mut [0u8; 16]);
            }
        }
        link.stats.finished.store(true, Ordering::Relaxed);
    }
}

/// Appends the fragment(s) of one trigger to the link's buffer, applying its injections.
fn emit(plan: &SourcePlan, link: &mut Link, ev: u64, t: u64) {
    let kind = match link.stats.fault() {
        Some(SourceFault::Inject(k)) => Some(k),
        Some(SourceFault::Delay(d)) => {
            // What is encoded goes out first; this trigger's fragment waits.
            flush(link);
            std::thread::sleep(d);
            None
        }
        None => None,
    };
    let kind = kind.or_else(|| {
        link.injections
            .iter()
            .find(|i| i.applies(ev))
            .map(|i| i.kind)
    });
    match kind {
        Some(InjectKind::Disconnect) => {
            // Whatever was encoded before this trigger still goes out, then the link drops
            // without an end-of-stream: the readout unit sees an early disconnect.
            flush(link);
            if let Some(st) = link.stream.take() {
                let _ = st.shutdown(std::net::Shutdown::Both);
            }
            link.stats.disconnected.store(true, Ordering::Relaxed);
            return;
        }
        Some(InjectKind::Skip) => return,
        Some(InjectKind::Swap) if link.swapped.is_none() => {
            link.swapped = Some(ev);
            return;
        }
        _ => {}
    }
    encode(plan, link, ev, t, 0, kind);
    if kind == Some(InjectKind::Duplicate) {
        encode(plan, link, ev, t, 0, None);
    }
    if let Some(held) = link.swapped.take() {
        if held != ev {
            encode(plan, link, held, t, 0, None);
        } else {
            link.swapped = Some(held);
        }
    }
}

fn encode(
    plan: &SourcePlan,
    link: &mut Link,
    ev: u64,
    t: u64,
    status: u16,
    inject: Option<InjectKind>,
) {
    let s = &plan.settings;
    let id = link.stats.id;
    let replayed = match &plan.replay {
        // A source with no fragment in the recorded event sends none for it.
        Some(r) => match r.payload(id, ev) {
            Some(p) => Some((p, r.trigger_type(ev))),
            None => return,
        },
        None => None,
    };
    let size = replayed.map_or_else(
        || {
            Sizes {
                seed: s.seed,
                mean: s.fragment_size.0,
                spread: s.size_spread.0,
                max: plan.max_payload as u64,
                correlation: s.size_correlation,
                histogram: plan.size_histogram.as_deref(),
            }
            .of(id, ev)
        },
        |(p, _)| p.len() as u64,
    );
    let status = if inject == Some(InjectKind::StatusError) {
        status | wire::status::FRONT_END_ERROR
    } else {
        status
    };
    let h = FragmentHeader {
        status,
        source_id: id,
        trigger_type: replayed.map_or_else(|| trigger_type(s.seed, ev, s.trigger_types), |r| r.1),
        event_id: ev,
        timestamp: t,
        payload_size: size as u32,
    };
    let start = link.used;
    let pattern = plan.pattern;
    let end = encode_fragment_at(&mut link.buf, start, &h, |p| match replayed {
        Some((r, _)) => p.copy_from_slice(r),
        None => pattern.fill(id, ev, p),
    });
    link.used = end;
    match inject {
        Some(InjectKind::BadCrc) => link.buf[end - 8] ^= 0xFF,
        Some(InjectKind::BadMarker) => link.buf[start] = 0x00,
        Some(InjectKind::Truncate) => link.used = start + (end - start) / 2,
        _ => {}
    }
    link.stats.fragments.fetch_add(1, Ordering::Relaxed);
}

/// Writes all of `buf`, adding to `held_ns` only the time spent blocked because the readout unit
/// is not taking data (back-pressure), not the time of an ordinary write. The socket is
/// non-blocking; when the kernel's buffer is full it is switched to blocking for the rest.
fn write_counting_held(st: &mut TcpStream, buf: &[u8], held_ns: &AtomicU64) -> std::io::Result<()> {
    let mut off = 0;
    while off < buf.len() {
        match st.write(&buf[off..]) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::WriteZero,
                    "readout unit closed the connection",
                ))
            }
            Ok(n) => off += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let t = Instant::now();
                st.set_nonblocking(false)?;
                let r = st.write_all(&buf[off..]);
                held_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                st.set_nonblocking(true)?;
                return r;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn flush(link: &mut Link) {
    if link.used == 0 {
        return;
    }
    if let Some(st) = link.stream.as_mut() {
        let r = write_counting_held(st, &link.buf[..link.used], &link.stats.held_ns);
        match r {
            Ok(()) => {
                link.stats
                    .bytes
                    .fetch_add(link.used as u64, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::warn!(source = link.stats.id, error = %e, "source connection failed");
                *link.stats.error.lock() = Some(e.to_string());
                link.stats.disconnected.store(true, Ordering::Relaxed);
                link.stream = None;
            }
        }
    }
    link.used = 0;
}

#[cfg(test)]
mod tests {
    use super::driver_groups;

    fn units(v: &[u32]) -> Vec<String> {
        v.iter().map(|u| format!("unit {u}")).collect()
    }

    #[test]
    fn a_driver_thread_serves_one_unit_or_whole_units() {
        // 8 sources of two units, 4 threads: two threads per unit, never one across both.
        let u = units(&[0, 0, 0, 0, 1, 1, 1, 1]);
        assert_eq!(driver_groups(&u, 4), vec![0, 1, 0, 1, 2, 3, 2, 3]);
        // Fewer threads than units: whole units share a thread.
        let u = units(&[0, 0, 1, 1, 2, 2]);
        assert_eq!(driver_groups(&u, 2), vec![0, 0, 1, 1, 0, 0]);
        // Three threads over two units: the first unit takes the spare.
        let u = units(&[0, 0, 0, 1, 1, 1]);
        assert_eq!(driver_groups(&u, 3), vec![0, 1, 0, 2, 2, 2]);
        // Sources listed in any order keep to their unit's threads.
        let u = units(&[1, 0, 1, 0]);
        assert_eq!(driver_groups(&u, 2), vec![0, 1, 0, 1]);
        assert_eq!(driver_groups(&u, 1), vec![0, 0, 0, 0]);
    }
}

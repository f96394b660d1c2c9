//! The recorder (CODA ER, ATLAS SFO): receives event records from every builder and writes them
//! to files in the format of `docs/file-format.md`.
//!
//! One reader thread per builder link (zero-copy slices of its budgeted read chunks) feeds one
//! writer thread through a bounded queue. The writer packs records into blocks; uncompressed
//! blocks go out with one vectored write straight from the read chunks, compressed ones through
//! the block encoder (optionally byte-shuffled first). A file is written as `NAME.part`, gets its
//! trailer, is fsynced, and only then takes its final name; its JSON sidecar follows the same way.
//! So a file under its final name is always complete.

mod file;
pub mod histograms;

use crossbeam_channel::{bounded, Receiver, Sender};
use parking_lot::Mutex;

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_config::{Durability, RecorderSection};
use tessera_format::event::EventFlags;
use tessera_format::link::{decode_link, Ack, LinkItem, PeerHello, PeerRole};
use tessera_net::reader::Fill;
use tessera_net::role::{spawn, RoleThreads};
use tessera_net::{Budget, ChunkReader, ChunkSlice};

pub use file::{free_bytes, FileSettings, FileWriter, Streams};

pub use tessera_archive::{file_name, file_write_atomic, FileInfo};

pub struct RecorderConfig {
    pub listener: TcpListener,
    /// Builder IDs expected to connect.
    pub builders: Vec<u16>,
    pub output: PathBuf,
    pub run_number: u64,
    pub config_digest: [u8; 32],
    /// Pattern name recorded in sidecars, so `verify` knows what to check payloads against.
    pub pattern: String,
    /// Every source of the topology, and those that follow `pattern`, for the sidecars.
    pub sources: Vec<u32>,
    pub pattern_sources: Vec<u32>,
    pub settings: RecorderSection,
    pub max_message: usize,
    /// The monitor every recorded event is offered to (after it is written).
    pub monitor: Option<tessera_monitor::Monitor>,
    /// How long a builder whose link broke may take to open it again (`recorder.takeover_s`).
    pub takeover: Duration,
    /// What an earlier recorder of this run left in the output directory, taken over.
    pub adopted: Adopted,
    /// What to histogram of every event taken (`[histograms]`).
    pub histograms: tessera_config::HistogramsSection,
}

/// The files an earlier recorder of the same run left, taken over by this one at its start:
/// their counts are this recorder's from the start, their event IDs seed its deduplication (a
/// builder sends again what that recorder never acknowledged), and its own files continue
/// their sequence.
pub use tessera_archive::AdoptedRun as Adopted;

/// The file being written: its name, what its whole blocks hold so far.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct CurrentFile {
    pub file: String,
    pub events: u64,
    pub size_bytes: u64,
}

#[derive(Debug, Default)]
pub struct RecorderStats {
    pub events: AtomicU64,
    pub incomplete_events: AtomicU64,
    pub fragments_in_complete: AtomicU64,
    pub fragments_in_incomplete: AtomicU64,
    pub record_bytes: AtomicU64,
    /// Bytes written to files (after compression).
    pub file_bytes: AtomicU64,
    /// Fragments received and not yet written.
    pub queued_fragments: AtomicU64,
    /// Nanoseconds the writer slept to honour the throttle.
    pub throttled_ns: AtomicU64,
    /// An operator's rehearsal of a slow disk: the write rate (bytes/s) and until when, in
    /// place of `recorder.throttle` while it lasts.
    pub throttle_fault: Mutex<Option<(u64, Instant)>>,
    /// Nanoseconds the writer spent in write and fsync calls.
    pub write_ns: AtomicU64,
    /// Time spent offering events to the monitor (waits at full blocking stations), a wait
    /// under way included.
    pub monitor: tessera_net::role::Stopwatch,
    /// fsync/fdatasync calls on data files (group commits and finished files).
    pub syncs: AtomicU64,
    pub files: Mutex<Vec<FileInfo>>,
    /// The file being written now (`.part`), if any.
    pub current_file: Mutex<Option<CurrentFile>>,
    pub error: Mutex<Option<String>>,
    pub links: Mutex<Vec<(u16, Arc<Budget>)>>,
    /// Builder links that ended with their peer end: their builders finished normally (read
    /// by the run control, which must not take a recorder that finished after every builder
    /// said goodbye for one that failed).
    pub links_ended_clean: AtomicU64,
    /// Records (first or second copies) counted as written in the file, the sum of what the
    /// builders' acknowledgements say.
    pub records_written: AtomicU64,
    /// Free bytes on the output file system at the last look (u64::MAX: not looked at yet).
    pub disk_free: AtomicU64,
    /// Below `recorder.disk_soft_free`: the disk alarm is on and writes are slowed.
    pub disk_low: AtomicBool,
    /// Below `recorder.disk_hard_free`: the run must stop (the run control does so cleanly).
    pub disk_full: AtomicBool,
    /// The output file system had no room for the next block (a write failed with ENOSPC, or
    /// it would have left less than a block free): the recorder finished its open files and
    /// writes nothing more this run; what it takes from then on is counted unrecorded.
    pub disk_exhausted: AtomicBool,
    /// Events, and their fragments in complete and in incomplete events, that the recorder took
    /// from its builders but could not write because the disk was exhausted: the balance names
    /// them `unrecorded_disk_full`.
    pub unrecorded_events: AtomicU64,
    pub unrecorded_fragments_in_complete: AtomicU64,
    pub unrecorded_fragments_in_incomplete: AtomicU64,
    /// The room held for finishing the run (`recorder.disk_reserve`), until given back.
    pub reserve: Mutex<Option<tessera_archive::DiskReserve>>,
    /// Events and files an earlier recorder of this run wrote, adopted at the start (counted in
    /// `events` and the fragment counts too).
    pub adopted_events: AtomicU64,
    pub adopted_files: AtomicU64,
    /// Records a builder sent again on a new link (wire format §2.8) that the files held
    /// already: the same record twice, dropped, and not a second copy of an event.
    pub resent_events: AtomicU64,
    pub resent_fragments: AtomicU64,
    /// Builder links opened again after they broke.
    pub relinks: AtomicU64,
    /// Second copies of events, dropped (request mode, after a builder failover).
    pub duplicate_events: AtomicU64,
    pub duplicate_fragments: AtomicU64,
    /// Events recorded with the rebuilt flag.
    pub rebuilt_events: AtomicU64,
    /// Fragments taken from each builder's link (first and second copies): set against what
    /// the readout units sent a builder lost with its host (the report of a run over hosts).
    pub fragments_by_builder: Mutex<std::collections::BTreeMap<u16, u64>>,
    /// The run's histograms (`[histograms]`; `None` when turned off), filled from every event
    /// taken, before it is written.
    pub histograms: Mutex<Option<histograms::Filler>>,
}

impl RecorderStats {
    /// Gives the room held for finishing the run back to the file system.
    /// Whether it was still held.
    pub fn release_reserve(&self) -> bool {
        let Some(r) = self.reserve.lock().take() else {
            return false;
        };
        tracing::info!(path = %r.path().display(), "disk reserve given back");
        true
    }

    /// Counts records the recorder took and could not write (the disk was exhausted): `events`
    /// holding `fragments`, of which `fragments_in_incomplete` in incomplete events.
    pub(crate) fn unrecorded(&self, events: u64, fragments: u64, fragments_in_incomplete: u64) {
        self.unrecorded_events.fetch_add(events, Ordering::Relaxed);
        self.unrecorded_fragments_in_complete
            .fetch_add(fragments - fragments_in_incomplete, Ordering::Relaxed);
        self.unrecorded_fragments_in_incomplete
            .fetch_add(fragments_in_incomplete, Ordering::Relaxed);
    }

    pub fn buffer_use(&self) -> (u64, u64) {
        self.links
            .lock()
            .iter()
            .fold((0, 0), |(u, l), (_, b)| (u + b.used(), l + b.limit()))
    }
    pub fn busy_ns(&self) -> u64 {
        self.links
            .lock()
            .iter()
            .map(|(_, b)| b.busy_ns.load(Ordering::Relaxed))
            .sum()
    }
}

/// Size of the chunks the recorder reads builder links into.
pub const RECORDER_CHUNK: usize = 1 << 20;

/// Event records from one builder link, and the link (for its acknowledgements).
struct Batch {
    slot: usize,
    /// The slot's link the records came on (see [`Written::per_link`]).
    link: u64,
    records: Vec<Record>,
}

/// One event record on its way to the writer.
struct Record {
    rec: ChunkSlice,
    fragments: u32,
    incomplete: bool,
    event_id: u64,
    rebuilt: bool,
    /// Sent again after a broken link (wire format §2.8).
    resent: bool,
}

/// Bits of [`Written::per_link`] that count records; the rest number the slot's link.
const COUNT_BITS: u32 = 40;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;

/// Per builder slot: how many of the records it sent are written (in the file), for the acks.
#[derive(Default)]
struct Written {
    /// Per slot: the number of its current link (high bits) and how many records of that link
    /// are written (low [`COUNT_BITS`]), in one word so that a record of a link that broke is
    /// never counted for the link that replaced it (each link counts from its own hello).
    per_link: Vec<AtomicU64>,
    /// Per builder slot that asked for acknowledgements: its link's sending side. The writer
    /// tells a builder as soon as its records are in the file; left to the link's reader, an
    /// acknowledgement waited for the builder's next write or the reader's read timeout (100 ms),
    /// and a request-mode builder holds its credit until then (measured: 1 400 events/s instead
    /// of 16 000 once a monitor consumer made the writer lose the race with the reader).
    ack_links: Vec<Mutex<Option<AckSender>>>,
    /// Per slot: the writer found the link's sender in use by its reader, which must then look
    /// again once it lets go, or a count that came in between would wait for its next wake.
    ack_again: Vec<AtomicBool>,
    /// A link waits for its last acknowledgement: write the partial block now.
    flush_wanted: AtomicBool,
    /// Some builder asked for acknowledgements (request mode).
    acks_wanted: AtomicBool,
}

/// The sending side of a builder link that wants acknowledgements. The acknowledgement is a
/// running count, so only the newest matters; an encoded one is finished before a newer starts.
struct AckSender {
    stream: TcpStream,
    /// The count last encoded.
    acked: u64,
    /// What is left to send of the last encoded acknowledgement.
    unsent: Vec<u8>,
}

impl AckSender {
    /// Sends the acknowledgement of `now` records if it is news. `wait`: the link's reader, which
    /// may block on the peer; the writer never does (what the socket does not take now is left
    /// for the next call of either). False when the link failed.
    fn send(&mut self, now: u64, wait: bool) -> bool {
        loop {
            if self.unsent.is_empty() {
                if now <= self.acked {
                    return true;
                }
                self.acked = now;
                self.unsent = Ack { records: now }.encode().to_vec();
            }
            if wait {
                if std::io::Write::write_all(&mut self.stream, &self.unsent).is_err() {
                    return false;
                }
                self.unsent.clear();
                continue;
            }
            match tessera_net::io::send_now(&self.stream, &self.unsent) {
                Ok(0) => return true,
                Ok(n) => {
                    self.unsent.drain(..n);
                }
                Err(_) => return false,
            }
        }
    }
}

impl Written {
    /// Records of the slot's current link written.
    fn written_of(&self, slot: usize) -> u64 {
        self.per_link[slot].load(Ordering::Acquire) & COUNT_MASK
    }

    /// A new link for `slot`: its number; its count starts at zero.
    fn new_link(&self, slot: usize) -> u64 {
        let v = self.per_link[slot].load(Ordering::Acquire);
        let link = (v >> COUNT_BITS) + 1;
        self.per_link[slot].store(link << COUNT_BITS, Ordering::Release);
        link
    }

    /// One record of `link` of `slot` is written; nothing if that link was replaced since.
    fn count_written(&self, slot: usize, link: u64) {
        let _ = self.per_link[slot].fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
            (v >> COUNT_BITS == link).then_some(v + 1)
        });
    }

    /// Tells every builder that wants acknowledgements what is in the file now, without waiting
    /// for any of them: a link whose reader is using it, or whose socket is full, gets it from
    /// its reader instead.
    fn tell_builders(&self) {
        for (slot, link) in self.ack_links.iter().enumerate() {
            // Raised before the lock is tried, and looked at by the reader after it lets go
            // (fences on both sides): either the writer gets the lock or the reader sees this.
            self.ack_again[slot].store(true, Ordering::SeqCst);
            std::sync::atomic::fence(Ordering::SeqCst);
            if let Some(mut g) = link.try_lock() {
                if let Some(a) = g.as_mut() {
                    // A failure is the reader's to find and report.
                    a.send(self.written_of(slot), false);
                }
            }
        }
    }

    /// The link reader's turn: sends what is due, waiting on the peer if it must, and again
    /// while the writer found the sender in use meanwhile. False when the link failed.
    fn tell_builder(&self, slot: usize) -> bool {
        loop {
            if let Some(a) = self.ack_links[slot].lock().as_mut() {
                if !a.send(self.written_of(slot), true) {
                    return false;
                }
            }
            std::sync::atomic::fence(Ordering::SeqCst);
            if !self.ack_again[slot].swap(false, Ordering::SeqCst) {
                return true;
            }
        }
    }
}

/// Event IDs remembered for deduplication. A builder that fails after handing an event over gets
/// it rebuilt elsewhere within moments; copies further apart than this are not caught.
pub const DEDUP_WINDOW: usize = 1 << 20;

/// The most heap memory the recorder holds for its bookkeeping beside its queue and blocks: the
/// event IDs it remembers for deduplication. What `tessera check` and a node agent count.
pub fn bookkeeping_bytes() -> u64 {
    tessera_assembly::RecentSet::bytes(DEDUP_WINDOW)
}

pub struct Recorder {
    pub stats: Arc<RecorderStats>,
    role: RoleThreads,
}

impl Recorder {
    pub fn start(cfg: RecorderConfig) -> std::io::Result<Recorder> {
        let stats = Arc::new(RecorderStats::default());
        if cfg.histograms.enabled {
            *stats.histograms.lock() = Some(histograms::Filler::new(
                &cfg.histograms,
                &cfg.settings.streams,
            ));
        }
        let a = &cfg.adopted;
        if !a.files.is_empty() {
            let st = &stats;
            st.adopted_files
                .store(a.files.len() as u64, Ordering::Relaxed);
            st.adopted_events.store(a.events, Ordering::Relaxed);
            st.events.store(a.events, Ordering::Relaxed);
            st.incomplete_events
                .store(a.incomplete_events, Ordering::Relaxed);
            st.fragments_in_complete
                .store(a.fragments_in_complete, Ordering::Relaxed);
            st.fragments_in_incomplete
                .store(a.fragments_in_incomplete, Ordering::Relaxed);
            st.record_bytes.store(a.record_bytes, Ordering::Relaxed);
            st.file_bytes.store(a.file_bytes, Ordering::Relaxed);
            st.files.lock().extend(a.files.iter().cloned());
            tracing::warn!(
                files = a.files.len(),
                events = a.events,
                "took over the files an earlier recorder of this run left; its events are not written twice"
            );
        }
        // A run that starts on a disk already below its watermarks says so at once.
        if let Some(free) = file::free_bytes(&cfg.output) {
            stats.disk_free.store(free, Ordering::Relaxed);
            stats
                .disk_low
                .store(free < cfg.settings.disk_soft_free.0, Ordering::Relaxed);
            if free < cfg.settings.disk_hard_free.0 {
                tracing::error!(free, dir = %cfg.output.display(), "disk below its hard watermark at the start: the run stops");
                stats.disk_full.store(true, Ordering::Relaxed);
            }
        }
        if cfg.settings.enabled && cfg.settings.disk_reserve.0 > 0 {
            let _ = std::fs::create_dir_all(&cfg.output);
            match tessera_archive::DiskReserve::take(
                &cfg.output,
                cfg.run_number,
                cfg.settings.disk_reserve.0,
            ) {
                Ok(r) => *stats.reserve.lock() = Some(r),
                Err(e) => {
                    tracing::warn!(error = %e, dir = %cfg.output.display(), bytes = cfg.settings.disk_reserve.0,
                    "cannot hold the disk reserve (recorder.disk_reserve): a disk filled by another writer may leave this run's last file unfinished")
                }
            }
        }
        let mut role = RoleThreads::default();
        let stop = role.stop.clone();
        let abort = role.abort.clone();
        let (tx, rx) = bounded::<Batch>(256);
        let n = cfg.builders.len().max(1);
        let chunk = RECORDER_CHUNK.max(cfg.max_message);
        // The writer's partial block pins up to a block of records, the reader holds one chunk and
        // asks for the next: below that the link could wait on itself (the config refuses it).
        let per_link =
            (cfg.settings.queue.0 / n as u64).max(cfg.settings.block_size.0 + 2 * chunk as u64);
        let settings = FileSettings {
            dir: cfg.output.clone(),
            run_number: cfg.run_number,
            config_digest: cfg.config_digest,
            pattern: cfg.pattern.clone(),
            sources: cfg.sources.clone(),
            pattern_sources: cfg.pattern_sources.clone(),
            section: cfg.settings.clone(),
            stream: None,
        };
        let written = Arc::new(Written {
            per_link: (0..n).map(|_| AtomicU64::new(0)).collect(),
            ack_links: (0..n).map(|_| Mutex::new(None)).collect(),
            ack_again: (0..n).map(|_| AtomicBool::new(false)).collect(),
            flush_wanted: AtomicBool::new(false),
            acks_wanted: AtomicBool::new(false),
        });
        {
            let st = stats.clone();
            let monitor = cfg.monitor.clone();
            let written = written.clone();
            let adopted = cfg.adopted.event_ids;
            role.threads.push(spawn("recorder-writer".into(), move || {
                write_loop(settings, rx, st, monitor.as_ref(), &written, &adopted)
            }));
        }
        {
            let st = stats.clone();
            let (stop, abort) = (stop.clone(), abort.clone());
            let max = cfg.max_message;
            let builders = cfg.builders.clone();
            let listener = cfg.listener;
            let takeover = cfg.takeover;
            role.threads.push(spawn("recorder-accept".into(), move || {
                let links = Links {
                    per_link,
                    max,
                    tx,
                    written,
                    takeover,
                };
                accept(listener, builders, links, &st, &stop, &abort)
            }));
        }
        Ok(Recorder { stats, role })
    }

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

/// What every builder link's reader shares.
struct Links {
    per_link: u64,
    max: usize,
    tx: Sender<Batch>,
    written: Arc<Written>,
    takeover: Duration,
}

/// Where each builder's link stands, for the accept loop.
#[derive(Clone, Copy, PartialEq)]
enum SlotState {
    Never,
    Open,
    /// Ended with its peer end: the builder is done.
    Ended,
    /// Broke without its peer end at this time; `acks`: its builder keeps what is not
    /// acknowledged and may open it again (request mode).
    Broken {
        at: Instant,
        acks: bool,
    },
}

fn accept(
    listener: TcpListener,
    builders: Vec<u16>,
    links: Links,
    st: &Arc<RecorderStats>,
    stop: &AtomicBool,
    abort: &Arc<AtomicBool>,
) {
    let Links {
        per_link,
        max,
        tx,
        written,
        takeover,
    } = links;
    let slots = Arc::new(Mutex::new(vec![SlotState::Never; builders.len()]));
    let mut readers = Vec::new();
    let warned = std::cell::Cell::new(false);
    // The recorder takes links until the run is over for it: no link open, none broken whose
    // builder may still open it again (`takeover`), and every builder connected or, once one
    // ended cleanly (the run is over), given up. A builder that never connected by then died
    // before it did (its events were rebuilt elsewhere or counted lost upstream): waiting
    // would hang the recorder, and with it the run, for good.
    let missing = || {
        let s = slots.lock();
        let back_soon = |x: &SlotState| matches!(x, SlotState::Broken { at, acks: true } if at.elapsed() < takeover);
        if s.iter().any(|x| *x == SlotState::Open || back_soon(x)) {
            return true;
        }
        let clean = s.contains(&SlotState::Ended);
        let never = s.contains(&SlotState::Never);
        if never && clean && !warned.replace(true) {
            for (b, _) in builders
                .iter()
                .zip(s.iter())
                .filter(|(_, x)| **x == SlotState::Never)
            {
                tracing::warn!(
                    builder = b,
                    "builder never connected; the recorder ends without it"
                );
            }
        }
        never && !clean
    };
    tessera_net::io::accept_until(&listener, stop, missing, |mut s, peer| {
        let slot = tessera_net::peer::read_hello(&mut s, PeerRole::BuilderUnit).and_then(|h| {
            let slot = builders
                .iter()
                .position(|&b| b as u32 == h.id)
                .ok_or_else(|| format!("builder {} is not in this topology", h.id))?;
            let mut all = slots.lock();
            match all[slot] {
                SlotState::Open => return Err(format!("builder {} is already connected", h.id)),
                SlotState::Ended => return Err(format!("builder {} ended its link already", h.id)),
                SlotState::Broken { .. } => {
                    st.relinks.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(builder = h.id, "builder link open again");
                }
                SlotState::Never => {}
            }
            all[slot] = SlotState::Open;
            Ok((slot, h.flags & PeerHello::WANTS_ACKS != 0))
        });
        match slot {
            Ok((slot, acks)) => {
                let budget = Arc::new(Budget::new(per_link));
                let builder = builders[slot];
                {
                    let mut links = st.links.lock();
                    links.retain(|(b, _)| *b != builder);
                    links.push((builder, budget.clone()));
                }
                let (tx, st, abort) = (tx.clone(), st.clone(), abort.clone());
                let written = written.clone();
                let slots = slots.clone();
                if acks {
                    written.acks_wanted.store(true, Ordering::Release);
                }
                let link_no = written.new_link(slot);
                readers.push(spawn(format!("recorder-bu{builder}"), move || {
                    let link = BuilderLink {
                        slot,
                        link: link_no,
                        builder,
                        acks: acks.then_some(written),
                    };
                    let clean = read_builder(s, budget, max, tx, &st, &abort, link);
                    if clean {
                        st.links_ended_clean.fetch_add(1, Ordering::AcqRel);
                    }
                    slots.lock()[slot] = if clean {
                        SlotState::Ended
                    } else {
                        SlotState::Broken {
                            at: Instant::now(),
                            acks,
                        }
                    };
                }));
            }
            Err(why) => tracing::warn!(%peer, %why, "recorder refused a connection"),
        }
    });
    drop(tx);
    for r in readers {
        let _ = r.join();
    }
}

/// Which builder link a reader reads, and whether its builder wants acknowledgements.
struct BuilderLink {
    slot: usize,
    /// Its number among the slot's links ([`Written::per_link`]).
    link: u64,
    builder: u16,
    acks: Option<Arc<Written>>,
}

/// Reads one builder's link to its end; whether it ended cleanly (with a peer end). A builder
/// that asked for them is told as its records reach the file ([`Ack`]); after its peer end it
/// gets the last acknowledgement before the link closes.
fn read_builder(
    mut s: TcpStream,
    budget: Arc<Budget>,
    max: usize,
    tx: Sender<Batch>,
    st: &RecorderStats,
    abort: &AtomicBool,
    link: BuilderLink,
) -> bool {
    let mut clean = false;
    let mut received = 0u64;
    if let Some(w) = &link.acks {
        match s.try_clone() {
            Ok(stream) => {
                *w.ack_links[link.slot].lock() = Some(AckSender {
                    stream,
                    acked: 0,
                    unsent: Vec::new(),
                })
            }
            Err(e) => {
                *st.error.lock() = Some(format!("builder link: {e}"));
                return false;
            }
        }
    }
    // Whatever the writer could not send without waiting.
    let ack = || -> bool { link.acks.as_ref().is_none_or(|w| w.tell_builder(link.slot)) };
    let mut reader = ChunkReader::new(budget, RECORDER_CHUNK.max(max));
    let mut want = 0;
    // Records still to come that the builder sends again (wire format §2.8).
    let mut resending = 0u64;
    loop {
        let mut batch: Vec<Record> = Vec::new();
        let mut done = false;
        loop {
            match decode_link(reader.window(), max) {
                Ok((LinkItem::Event(h), n)) => {
                    let rec = reader.take(n);
                    st.queued_fragments
                        .fetch_add(h.fragment_count as u64, Ordering::Relaxed);
                    let resent = resending > 0;
                    resending = resending.saturating_sub(1);
                    batch.push(Record {
                        rec,
                        fragments: h.fragment_count,
                        incomplete: h.flags.has(EventFlags::INCOMPLETE),
                        event_id: h.event_id,
                        rebuilt: h.flags.has(EventFlags::REBUILT),
                        resent,
                    });
                }
                Ok((LinkItem::Resend(r), n)) => {
                    reader.skip(n);
                    resending = r.records;
                }
                Ok((LinkItem::End(_), _)) => {
                    clean = true;
                    done = true;
                    break;
                }
                Ok((LinkItem::NeedMore(n), _)) => {
                    want = n;
                    break;
                }
                Ok((LinkItem::Idle, _)) => {
                    want = 0;
                    break;
                }
                Ok((other, _)) => {
                    *st.error.lock() =
                        Some(format!("unexpected message from a builder: {other:?}"));
                    done = true;
                    break;
                }
                Err(e) => {
                    *st.error.lock() = Some(format!("builder link: {e}"));
                    done = true;
                    break;
                }
            }
        }
        received += batch.len() as u64;
        if !batch.is_empty() {
            // A record sent again was counted when it first came (to this recorder or to
            // one that died).
            let n: u64 = batch
                .iter()
                .filter(|r| !r.resent)
                .map(|r| r.fragments as u64)
                .sum();
            *st.fragments_by_builder
                .lock()
                .entry(link.builder)
                .or_default() += n;
        }
        if !batch.is_empty()
            && tx
                .send(Batch {
                    slot: link.slot,
                    link: link.link,
                    records: batch,
                })
                .is_err()
        {
            break;
        }
        if done {
            break;
        }
        if !ack() {
            break;
        }
        match reader.fill(&mut s, want, abort) {
            Ok(Fill::Data(_)) => {}
            Ok(Fill::Eof | Fill::Stopped | Fill::NoMemory) | Err(_) => break,
        }
    }
    if clean {
        if let Some(w) = &link.acks {
            // The builder reports its last events done only when they are written: wait for the
            // writer (which is asked to write its partial block now), unless it failed or the
            // run aborts, then say so.
            while w.written_of(link.slot) < received
                && !abort.load(Ordering::Relaxed)
                && st.error.lock().is_none()
            {
                w.flush_wanted.store(true, Ordering::Release);
                std::thread::sleep(Duration::from_millis(2));
            }
            ack();
        }
    }
    if let Some(w) = &link.acks {
        w.ack_links[link.slot].lock().take();
    }
    let _ = s.shutdown(std::net::Shutdown::Both);
    clean
}

/// The link of every record the writer took, in order, until it is in the file. Each stream's
/// records are written in the order they are appended, so all but the newest `pending` of a
/// stream are on disk; a record is acknowledged once it and every record taken before it, in
/// any stream, are (the acknowledgement is a count per link: a prefix). A second copy dropped by
/// deduplication is acknowledged once everything taken before it (its first copy included) is.
#[derive(Default)]
struct InFlight {
    /// (link slot, its link number, the stream it was appended to; none: not appended).
    queue: std::collections::VecDeque<(usize, u64, Option<usize>)>,
    /// Per stream, its records in the queue.
    appended: Vec<usize>,
}

impl InFlight {
    fn take(&mut self, slot: usize, link: u64, stream: Option<usize>) {
        self.queue.push_back((slot, link, stream));
        if let Some(s) = stream {
            if self.appended.len() <= s {
                self.appended.resize(s + 1, 0);
            }
            self.appended[s] += 1;
        }
    }

    /// Counts as written what the files now hold, `pending(s)` being the records of stream `s`
    /// not yet there.
    fn acknowledge(
        &mut self,
        pending: impl Fn(usize) -> usize,
        written: &Written,
        st: &RecorderStats,
    ) {
        let mut news = false;
        while let Some(&(slot, link, stream)) = self.queue.front() {
            if let Some(s) = stream {
                if self.appended[s] <= pending(s) {
                    break;
                }
                self.appended[s] -= 1;
            }
            self.queue.pop_front();
            written.count_written(slot, link);
            st.records_written.fetch_add(1, Ordering::AcqRel);
            news = true;
        }
        if news && written.acks_wanted.load(Ordering::Acquire) {
            written.tell_builders();
        }
    }
}

fn write_loop(
    settings: FileSettings,
    rx: Receiver<Batch>,
    stats: Arc<RecorderStats>,
    monitor: Option<&tessera_monitor::Monitor>,
    written: &Written,
    adopted: &[u64],
) {
    let enabled = settings.section.enabled;
    let sync_mode = enabled && settings.section.durability == Durability::Sync;
    let interval = Duration::from_millis(settings.section.sync_interval_ms.max(1) as u64);
    // A partial block is written out after a quiet spell, so that at low rates events reach
    // the disk (and release their buffer memory) without waiting for a full block; in sync
    // mode no event waits longer than the sync interval.
    let quiet = if sync_mode {
        interval.min(Duration::from_millis(200))
    } else {
        Duration::from_millis(200)
    };
    let mut last_sync = Instant::now();
    let st: &RecorderStats = &stats;
    // Told whenever a disk thread wrote or synced something: acknowledge at once.
    let (news_tx, news) = crossbeam_channel::bounded::<()>(1);
    let mut w = Streams::new(settings, stats.clone(), news_tx);
    let mut failed = false;
    let fail = |w: &mut Streams, failed: &mut bool, what: &str, e: std::io::Error| {
        tracing::error!(error = %e, "recorder cannot write; events are counted but not stored");
        *st.error.lock() = Some(format!("{what}: {e}"));
        *failed = true;
        w.abandon();
    };
    // Group commit: everything written since the last sync is synced at once, at most
    // `interval` after the oldest of it, or at once when a link waits for its last
    // acknowledgement.
    let commit = |w: &mut Streams, force: bool, last_sync: &mut Instant| -> std::io::Result<()> {
        if sync_mode && w.unsynced() > 0 && (force || last_sync.elapsed() >= interval) {
            w.sync()?;
            *last_sync = Instant::now();
        }
        Ok(())
    };
    // What the file holds but the acknowledgements may not cover yet: the partial block, and
    // in sync mode what is written and not yet synced.
    let pending = |w: &Streams, i: usize| match (enabled, sync_mode) {
        (false, _) => 0,
        (true, false) => w.unwritten_of(i),
        (true, true) => w.unsynced_of(i),
    };
    let mut seen = tessera_assembly::RecentSet::new(DEDUP_WINDOW);
    // Events an earlier recorder of this run wrote: a builder sends again those it never
    // acknowledged, and they are not written twice.
    for &id in adopted {
        seen.insert(id);
    }
    // The link of every record taken, in order, until it is in the file: records are written in
    // the order they are taken, so the oldest `taken - unwritten` of them are on disk. A second
    // copy dropped by deduplication queues here too, so it is acknowledged only once everything
    // before it (its first copy included) is written.
    let mut in_flight = InFlight::default();
    loop {
        let got = crossbeam_channel::select! {
            recv(rx) -> b => b.map_err(|_| crossbeam_channel::RecvTimeoutError::Disconnected),
            recv(news) -> _ => {
                if !failed {
                    in_flight.acknowledge(|i| pending(&w, i), written, st);
                }
                continue;
            }
            default(quiet) => Err(crossbeam_channel::RecvTimeoutError::Timeout),
        };
        let batch = match got {
            Ok(b) => b,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                if enabled && !failed {
                    if let Err(e) = w.flush() {
                        fail(&mut w, &mut failed, "writing", e);
                    } else if let Err(e) = commit(&mut w, false, &mut last_sync) {
                        fail(&mut w, &mut failed, "syncing", e);
                    }
                }
                if !failed {
                    in_flight.acknowledge(|i| pending(&w, i), written, st);
                }
                continue;
            }
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
        };
        let Batch {
            slot,
            link,
            records,
        } = batch;
        for r in records {
            let Record {
                rec,
                fragments: nf,
                incomplete,
                event_id,
                rebuilt,
                resent,
            } = r;
            let len = rec.len() as u64;
            let first_copy = seen.insert(event_id);
            if !first_copy {
                in_flight.take(slot, link, None);
                if resent {
                    // The same record again: its first sending is in the files already.
                    st.resent_events.fetch_add(1, Ordering::Relaxed);
                    st.resent_fragments.fetch_add(nf as u64, Ordering::Relaxed);
                } else {
                    // A second copy of an event (rebuilt after its first builder was declared
                    // dead, though that one had delivered it): each event is written once.
                    st.duplicate_events.fetch_add(1, Ordering::Relaxed);
                    st.duplicate_fragments
                        .fetch_add(nf as u64, Ordering::Relaxed);
                }
                st.queued_fragments.fetch_sub(nf as u64, Ordering::Relaxed);
                continue;
            }
            if rebuilt {
                st.rebuilt_events.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(f) = st.histograms.lock().as_mut() {
                f.add(&rec);
            }
            if let Some(m) = monitor {
                // Returns at once unless a blocking station is full: then the recorder waits, as
                // a blocking station asks (the monitor copies what it keeps; `rec` stays ours).
                st.monitor.time(|| m.insert(&rec));
            }
            let exhausted = st.disk_exhausted.load(Ordering::Acquire);
            if exhausted && enabled {
                // Nothing more fits: counted, by name, and acknowledged in its turn (the
                // builders must not wait for what will never be written).
                st.unrecorded(1, nf as u64, if incomplete { nf as u64 } else { 0 });
            }
            let stream = if enabled && !failed && !exhausted {
                match w.append(slot, rec, nf, incomplete) {
                    Ok(i) => Some(i),
                    Err(e) => {
                        fail(&mut w, &mut failed, "writing", e);
                        None
                    }
                }
            } else {
                None
            };
            in_flight.take(slot, link, stream);
            st.events.fetch_add(1, Ordering::Relaxed);
            st.record_bytes.fetch_add(len, Ordering::Relaxed);
            if incomplete {
                st.incomplete_events.fetch_add(1, Ordering::Relaxed);
                st.fragments_in_incomplete
                    .fetch_add(nf as u64, Ordering::Relaxed);
            } else {
                st.fragments_in_complete
                    .fetch_add(nf as u64, Ordering::Relaxed);
            }
            st.queued_fragments.fetch_sub(nf as u64, Ordering::Relaxed);
        }
        let wanted = written.flush_wanted.swap(false, Ordering::AcqRel);
        // Builders that wait for acknowledgements (request mode) hold their credit until their
        // events are in the file: when nothing more is queued, the partial block is written now,
        // not after a quiet spell, or a run would go at one credit's worth of events per quiet
        // spell (measured: ~160 events/s with 32 pages per link). Busy, blocks still fill.
        let idle = written.acks_wanted.load(Ordering::Acquire) && rx.is_empty();
        // A rare stream's partial block holds few records from many read chunks, and pins every
        // one of them: when the links' memory runs low, every partial block goes out, or the
        // links would wait for the next quiet spell.
        let pinned = w.len() > 1 && {
            let (used, limit) = st.buffer_use();
            limit > 0 && used * 10 >= limit * 9
        };
        if (wanted || idle || pinned) && enabled && !failed && w.unwritten() > 0 {
            if let Err(e) = w.flush() {
                fail(&mut w, &mut failed, "writing", e);
            }
        }
        if enabled && !failed {
            if let Err(e) = commit(&mut w, wanted, &mut last_sync) {
                fail(&mut w, &mut failed, "syncing", e);
            }
        }
        if !failed {
            in_flight.acknowledge(|i| pending(&w, i), written, st);
        }
    }
    if enabled && !failed {
        if let Err(e) = w.close() {
            *st.error.lock() = Some(format!("closing file: {e}"));
        }
    }
    // The files are finished: the room held for that goes to the manifest and the database.
    drop(w);
    st.release_reserve();
}

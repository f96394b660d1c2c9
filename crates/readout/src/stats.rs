//! The readout unit's live counters: what the status line, the run summary and the accounting
//! balance read.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use tessera_format::RejectReason;
use tessera_net::Budget;

/// Why the readout unit refused a fragment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rejection {
    /// It failed a wire-format check.
    Wire(RejectReason),
    /// Its source already delivered this event ID.
    Duplicate,
    /// Its event had already been sent on (timed out without it), or cleared (request mode).
    Late,
    /// Request mode: cleared without ever being requested (the rest of an event a filter
    /// rejected on its RoI, or a fragment that arrived after its event was built without it).
    ClearedUnsent,
    /// Request mode: no room in the paged buffer when the run was aborted, or larger than the
    /// whole buffer of its link.
    NoSpace,
}

impl Rejection {
    pub const COUNT: usize = RejectReason::ALL.len() + 4;

    pub fn index(self) -> usize {
        match self {
            Rejection::Wire(r) => RejectReason::ALL
                .iter()
                .position(|x| *x == r)
                .expect("listed"),
            Rejection::Duplicate => RejectReason::ALL.len(),
            Rejection::Late => RejectReason::ALL.len() + 1,
            Rejection::ClearedUnsent => RejectReason::ALL.len() + 2,
            Rejection::NoSpace => RejectReason::ALL.len() + 3,
        }
    }

    /// Every reason's label, in index order: the label set a counter by reason exposes, each at
    /// 0 until its first rejection (so that a rate over it sees the first one).
    pub fn labels() -> impl Iterator<Item = &'static str> {
        (0..Self::COUNT).map(|i| Self::from_index(i).label())
    }

    pub fn from_index(i: usize) -> Rejection {
        match i {
            i if i < RejectReason::ALL.len() => Rejection::Wire(RejectReason::ALL[i]),
            i if i == RejectReason::ALL.len() => Rejection::Duplicate,
            i if i == RejectReason::ALL.len() + 1 => Rejection::Late,
            i if i == RejectReason::ALL.len() + 2 => Rejection::ClearedUnsent,
            _ => Rejection::NoSpace,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Rejection::Wire(r) => r.label(),
            Rejection::Duplicate => "duplicate_event_id",
            Rejection::Late => "late",
            Rejection::ClearedUnsent => "cleared_unsent",
            Rejection::NoSpace => "no_buffer_space",
        }
    }
}

/// Where a link is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkState {
    Waiting = 0,
    Connected = 1,
    /// Closed after an end-of-stream message.
    Ended = 2,
    /// Closed without one.
    Disconnected = 3,
    /// Still open when the drain deadline passed.
    Aborted = 4,
    /// The run stopped before the source connected.
    NeverConnected = 5,
}

impl LinkState {
    fn from_u8(v: u8) -> LinkState {
        match v {
            0 => LinkState::Waiting,
            1 => LinkState::Connected,
            2 => LinkState::Ended,
            3 => LinkState::Disconnected,
            4 => LinkState::Aborted,
            _ => LinkState::NeverConnected,
        }
    }

    /// Whether the link is done for this run, cleanly or not.
    pub fn ended(self) -> bool {
        matches!(
            self,
            LinkState::Ended
                | LinkState::Disconnected
                | LinkState::Aborted
                | LinkState::NeverConnected
        )
    }

    pub fn label(self) -> &'static str {
        match self {
            LinkState::Waiting => "waiting",
            LinkState::Connected => "connected",
            LinkState::Ended => "ended",
            LinkState::Disconnected => "disconnected",
            LinkState::Aborted => "aborted",
            LinkState::NeverConnected => "never_connected",
        }
    }
}

/// One link (one source).
#[derive(Debug)]
pub struct LinkStats {
    pub source_id: u32,
    state: AtomicU8,
    /// Fragments that passed the wire checks (some may then be refused as duplicate or late).
    pub fragments: AtomicU64,
    pub rejected: [AtomicU64; Rejection::COUNT],
    /// Bytes skipped while resynchronising after a rejection.
    pub skipped_bytes: AtomicU64,
    /// Bytes the source sent after its end of stream (a protocol error): counted as bytes, not
    /// as fragments, since they may be anything.
    pub bytes_after_end: AtomicU64,
    /// The count the source declared in its end-of-stream message (u64::MAX: none yet).
    pub eos_fragments: AtomicU64,
    /// Event ID of the last good fragment, for the alignment view.
    pub last_event: AtomicU64,
    /// This link's share of the buffer; its `busy_ns` is the time the link stopped reading.
    pub budget: Arc<Budget>,
}

impl LinkStats {
    pub fn state(&self) -> LinkState {
        LinkState::from_u8(self.state.load(Ordering::Relaxed))
    }

    pub fn set_state(&self, s: LinkState) {
        self.state.store(s as u8, Ordering::Relaxed);
    }

    /// Marks a waiting link connected; false if it was not waiting.
    pub fn claim(&self) -> bool {
        self.state
            .compare_exchange(
                LinkState::Waiting as u8,
                LinkState::Connected as u8,
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_ok()
    }

    pub fn reject(&self, why: Rejection) {
        self.rejected[why.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Fragments rejected so far, by reason label; reasons with none left out.
    pub fn rejected_by_reason(&self) -> std::collections::BTreeMap<String, u64> {
        self.rejected
            .iter()
            .enumerate()
            .map(|(i, c)| (i, c.load(Ordering::Relaxed)))
            .filter(|(_, n)| *n > 0)
            .map(|(i, n)| (Rejection::from_index(i).label().to_string(), n))
            .collect()
    }

    pub fn rejected_total(&self) -> u64 {
        self.rejected
            .iter()
            .map(|x| x.load(Ordering::Relaxed))
            .sum()
    }

    /// Fragments read from this link in all: good or rejected at the wire.
    pub fn received(&self) -> u64 {
        let wire: u64 = RejectReason::ALL
            .iter()
            .map(|r| self.rejected[Rejection::Wire(*r).index()].load(Ordering::Relaxed))
            .sum();
        self.fragments.load(Ordering::Relaxed) + wire
    }
}

/// The whole unit.
#[derive(Debug)]
pub struct ReadoutStats {
    pub id: u32,
    pub links: Vec<LinkStats>,
    pub super_fragments: AtomicU64,
    pub incomplete_super_fragments: AtomicU64,
    pub fragments_forwarded: AtomicU64,
    /// Bytes sent to builders (push mode; request mode: `requests.bytes_sent`).
    pub bytes_forwarded: AtomicU64,
    /// Fragments in events the assembler still holds.
    pub held_fragments: AtomicU64,
    /// Bytes of its buffer taken and touched before data taking (`reserve`).
    pub reserved_bytes: AtomicU64,
    pub pending_events: AtomicU64,
    /// Fragments of departed events not yet written to their builder.
    pub queued_fragments: AtomicU64,
    /// Fragments dropped because their builder's link failed.
    pub builder_lost: AtomicU64,
    /// Push mode: fragments forwarded to each builder, by its place in the topology's builder
    /// list: set against what the recorder took from a builder lost with its host.
    pub fragments_forwarded_by_builder: Mutex<std::collections::BTreeMap<u32, u64>>,
    pub builder_error: Mutex<Option<String>>,
    pub refused_connections: AtomicU64,
    pub last_refusal: Mutex<Option<String>>,
    /// Request mode only (zero in push mode).
    pub requests: RequestStats,
    /// What waits in the kernel's send queues of its links to builders (push mode).
    pub send_queues: tessera_net::queued::QueueGauges,
}

/// A request-mode readout unit's counters.
#[derive(Debug, Default)]
pub struct RequestStats {
    /// Fragments in the paged buffers now.
    pub stored_fragments: AtomicU64,
    /// Of those, fragments lent to an answer already: from then on a builder counts them (or
    /// they are on their way to one), so the unit counts as buffered only the others.
    pub stored_sent_fragments: AtomicU64,
    /// CPU time of the in-process link generator's thread, once it has finished (0 without).
    pub generator_cpu_ns: AtomicU64,
    pub total_pages: AtomicU64,
    pub free_pages: AtomicU64,
    pub requests: AtomicU64,
    pub answers: AtomicU64,
    /// Answers sent after the timeout, with missing sources.
    pub partial_answers: AtomicU64,
    /// Fragments sent from the paged buffers in answers (internal transfers).
    pub fragments_sent: AtomicU64,
    /// Of those, fragments lent to an answer before (an event asked again after its builder was
    /// declared dead, or asked twice): each such answer puts a copy into the system, which the
    /// builder that takes it counts like any other (built, late, ...), so the accounting adds
    /// these to what the sources sent (`answered_again`).
    pub fragments_answered_again: AtomicU64,
    /// `fragments_sent` by builder: what a builder lost with its host took with it is what it
    /// was sent less what of it the recorder took (the report of a run over hosts).
    pub fragments_sent_by_builder: Mutex<std::collections::BTreeMap<u32, u64>>,
    pub bytes_sent: AtomicU64,
    pub descriptors_in_use: AtomicU64,
    /// Requests left unread because their builder's share of descriptors was in use.
    pub descriptor_waits: AtomicU64,
    /// Requests naming a source this unit does not read.
    pub foreign_sources: AtomicU64,
    pub clear_messages: AtomicU64,
    pub cleared_events: AtomicU64,
    /// Clears of events this unit never held.
    pub clears_unknown: AtomicU64,
    /// Clears of events already cleared.
    pub clears_repeated: AtomicU64,
    pub announced: AtomicU64,
    /// Links waiting for free pages right now.
    pub links_waiting: AtomicU64,
    /// The event manager says no builder has credit: links are not read.
    pub throttled: std::sync::atomic::AtomicBool,
    pub throttled_ns: AtomicU64,
    /// Times the event manager's connection was lost before the end of the run.
    pub manager_losses: AtomicU64,
    /// Events announced again to an event manager taking the run over.
    pub reannounced: AtomicU64,
    pub manager_error: Mutex<Option<String>>,
}

impl ReadoutStats {
    /// Fills every link's budget with touched read chunks of `chunk` bytes (`readout.reserve`);
    /// returns the bytes reserved.
    pub fn reserve(&self, chunk: usize) -> u64 {
        let links = self.links.iter().map(|l| &*l.budget);
        let bytes = tessera_net::budget::reserve_all(&format!("ru{}", self.id), links, chunk);
        self.reserved_bytes.fetch_add(bytes, Ordering::Relaxed);
        bytes
    }

    pub fn new(id: u32, sources: &[u32], per_link_budget: u64) -> ReadoutStats {
        ReadoutStats {
            id,
            links: sources
                .iter()
                .map(|&s| LinkStats {
                    source_id: s,
                    state: AtomicU8::new(LinkState::Waiting as u8),
                    fragments: AtomicU64::new(0),
                    rejected: Default::default(),
                    skipped_bytes: AtomicU64::new(0),
                    bytes_after_end: AtomicU64::new(0),
                    eos_fragments: AtomicU64::new(u64::MAX),
                    last_event: AtomicU64::new(0),
                    budget: Arc::new(Budget::new(per_link_budget)),
                })
                .collect(),
            super_fragments: AtomicU64::new(0),
            incomplete_super_fragments: AtomicU64::new(0),
            fragments_forwarded: AtomicU64::new(0),
            bytes_forwarded: AtomicU64::new(0),
            held_fragments: AtomicU64::new(0),
            reserved_bytes: AtomicU64::new(0),
            pending_events: AtomicU64::new(0),
            queued_fragments: AtomicU64::new(0),
            builder_lost: AtomicU64::new(0),
            fragments_forwarded_by_builder: Mutex::new(Default::default()),
            builder_error: Mutex::new(None),
            refused_connections: AtomicU64::new(0),
            last_refusal: Mutex::new(None),
            requests: RequestStats::default(),
            send_queues: Default::default(),
        }
    }

    /// Buffer bytes in use over all links, and the total bound.
    pub fn buffer_use(&self) -> (u64, u64) {
        self.links.iter().fold((0, 0), |(u, l), x| {
            (u + x.budget.used(), l + x.budget.limit())
        })
    }

    /// Nanoseconds links spent unable to read for lack of memory, summed over links.
    pub fn busy_ns(&self) -> u64 {
        self.links
            .iter()
            .map(|l| l.budget.busy_ns.load(Ordering::Relaxed))
            .sum()
    }

    /// Whether any link is out of memory right now, or the event manager throttles (the unit
    /// is BUSY).
    pub fn busy(&self) -> bool {
        self.links.iter().any(|l| l.budget.would_block(1))
            || self.requests.throttled.load(Ordering::Relaxed)
            || self.requests.links_waiting.load(Ordering::Relaxed) > 0
    }
}

//! The builder unit's live counters.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use tessera_net::Budget;

#[derive(Debug)]
pub struct RuLinkStats {
    pub readout_unit: u32,
    pub connected: AtomicBool,
    /// The link will deliver nothing more (ended, broke, or never connected before the stop).
    pub closed: AtomicBool,
    pub super_fragments: AtomicU64,
    /// Super-fragments by rail (one entry per address the builder listens on).
    pub rail_super_fragments: Vec<AtomicU64>,
    pub fragments: AtomicU64,
    /// Fragments the readout unit declared in its end message (u64::MAX: none yet).
    pub declared_fragments: AtomicU64,
    /// The link's memory, one budget per rail, each an equal share: a rail's reads can never
    /// take the memory its sibling needs. With one shared budget, one rail filled it with
    /// events the other readout units had not sent yet while the sibling rail, holding the
    /// events they had, could not read: every unit alive and held, nothing timed out, and
    /// the run stood still. Each rail's super-fragments come in event-ID order, so with
    /// memory of its own a rail always holds the next event the others wait for.
    pub budgets: Vec<Arc<Budget>>,
    pub error: Mutex<Option<String>>,
}

impl RuLinkStats {
    pub fn used(&self) -> u64 {
        self.budgets.iter().map(|b| b.used()).sum()
    }

    pub fn limit(&self) -> u64 {
        self.budgets.iter().map(|b| b.limit()).sum()
    }

    /// Time the link's rails were held (no memory, or the table of open events full), as the
    /// mean over its rails: a link whose every rail is held all the time is busy all the time.
    pub fn busy_ns(&self) -> u64 {
        let sum: u64 = self
            .budgets
            .iter()
            .map(|b| b.busy_ns.load(std::sync::atomic::Ordering::Relaxed))
            .sum();
        sum / self.budgets.len().max(1) as u64
    }
}

#[derive(Debug)]
pub struct BuilderStats {
    pub id: u16,
    pub links: Vec<RuLinkStats>,
    pub events_complete: AtomicU64,
    pub events_incomplete: AtomicU64,
    pub fragments_in_complete: AtomicU64,
    pub fragments_in_incomplete: AtomicU64,
    pub bytes_built: AtomicU64,
    /// Fragments in super-fragments that arrived after their event was built.
    pub late_fragments: AtomicU64,
    /// Events let go incomplete because every link was held for memory by open events waiting
    /// on each other for a whole event timeout (a stand-still nothing else could end).
    pub stall_releases: AtomicU64,
    pub duplicate_fragments: AtomicU64,
    /// Fragments in super-fragments that contradicted themselves.
    pub malformed_fragments: AtomicU64,
    /// Fragments held in events being assembled (request mode: in answers taken for events
    /// not yet built or rejected).
    pub held_fragments: AtomicU64,
    /// Bytes of its buffer taken and touched before data taking (`reserve`).
    pub reserved_bytes: AtomicU64,
    pub pending_events: AtomicU64,
    /// Fragments of built events not yet written to the recorder.
    pub queued_fragments: AtomicU64,
    pub recorder_lost: AtomicU64,
    pub recorder_error: Mutex<Option<String>>,
    /// Request mode: links to the recorder that broke and were opened again (the recorder
    /// restarted at its address, or the connection failed), and the events sent again on them
    /// for want of an acknowledgement (wire format §2.8).
    pub recorder_relinks: AtomicU64,
    pub events_resent: AtomicU64,
    pub refused_connections: AtomicU64,
    pub last_event: AtomicU64,
    /// For incomplete events: how often each source was the one missing.
    pub missing_by_source: Mutex<std::collections::BTreeMap<u32, u64>>,
    /// Request mode: events the filter rejected, and the fragments fetched for them.
    pub events_rejected: AtomicU64,
    pub fragments_rejected: AtomicU64,
    /// Request mode: events built again after their first builder failed.
    pub events_rebuilt: AtomicU64,
    pub requests: AtomicU64,
    /// Request mode: requests a readout unit left unanswered for a whole builder timeout after
    /// answering a later request of the same sources (request-protocol §4.3, rule 4), their
    /// events built without its sources.
    pub overdue_requests: AtomicU64,
    /// Request mode: events assigned and not yet done.
    pub events_in_flight: AtomicU64,
    pub manager_error: Mutex<Option<String>>,
    /// Request mode: times the event manager's connection was lost before the end of the run.
    pub manager_losses: AtomicU64,
    /// Time from an event's first part at this builder to its build (waiting for the slowest
    /// readout unit or answer included).
    pub latency: Histogram,
    /// The most recent incomplete events and their missing sources, for "why is event N
    /// incomplete"; bounded.
    pub recent_incomplete: Mutex<RecentIncomplete>,
    /// What waits unread in the kernel's receive queues of its readout-unit links (push mode).
    pub receive_queues: tessera_net::queued::QueueGauges,
}

/// Incomplete events remembered, oldest first, at most [`RecentIncomplete::CAPACITY`].
#[derive(Debug, Default)]
pub struct RecentIncomplete {
    pub events: std::collections::VecDeque<(u64, Vec<u32>)>,
    /// The highest event ID forgotten to make room (0: none yet): an event at or below it that
    /// is not remembered may have been incomplete.
    pub forgotten_up_to: u64,
}

impl RecentIncomplete {
    pub const CAPACITY: usize = 4096;

    pub fn push(&mut self, event_id: u64, missing: &[u32]) {
        if self.events.len() == Self::CAPACITY {
            if let Some((old, _)) = self.events.pop_front() {
                self.forgotten_up_to = self.forgotten_up_to.max(old);
            }
        }
        self.events.push_back((event_id, missing.to_vec()));
    }

    pub fn get(&self, event_id: u64) -> Option<&[u32]> {
        self.events
            .iter()
            .rev()
            .find(|(e, _)| *e == event_id)
            .map(|(_, m)| m.as_slice())
    }
}

/// A latency histogram with power-of-two bucket bounds from 1 us to 64 s, lock-free to fill.
#[derive(Debug)]
pub struct Histogram {
    buckets: [AtomicU64; Histogram::BUCKETS],
    sum_ns: AtomicU64,
    count: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    /// Bucket `i` counts values up to 2^i microseconds; the last is unbounded.
    pub const BUCKETS: usize = 28;

    pub fn observe_ns(&self, ns: u64) {
        let us = ns / 1000;
        let i = if us <= 1 {
            0
        } else {
            (64 - (us - 1).leading_zeros()) as usize
        };
        self.buckets[i.min(Self::BUCKETS - 1)].fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(ns, Relaxed);
        self.count.fetch_add(1, Relaxed);
    }

    /// (upper bound in seconds, cumulative count) per bucket, the last bound infinite; the sum
    /// in seconds; the count.
    pub fn snapshot(&self) -> (Vec<(f64, u64)>, f64, u64) {
        let mut acc = 0;
        let b = (0..Self::BUCKETS)
            .map(|i| {
                acc += self.buckets[i].load(Relaxed);
                let bound = if i + 1 == Self::BUCKETS {
                    f64::INFINITY
                } else {
                    (1u64 << i) as f64 * 1e-6
                };
                (bound, acc)
            })
            .collect();
        (
            b,
            self.sum_ns.load(Relaxed) as f64 * 1e-9,
            self.count.load(Relaxed),
        )
    }
}

impl BuilderStats {
    /// Fills every readout-unit link's budget with touched read chunks of `chunk` bytes
    /// (`builder.reserve`); returns the bytes reserved.
    pub fn reserve(&self, chunk: usize) -> u64 {
        let links = self
            .links
            .iter()
            .flat_map(|l| l.budgets.iter().map(|b| &**b));
        let bytes = tessera_net::budget::reserve_all(&format!("bu{}", self.id), links, chunk);
        self.reserved_bytes
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        bytes
    }

    pub fn new(
        id: u16,
        rus: impl Iterator<Item = u32>,
        per_link: u64,
        rails: usize,
    ) -> BuilderStats {
        BuilderStats {
            id,
            links: rus
                .map(|r| RuLinkStats {
                    readout_unit: r,
                    connected: AtomicBool::new(false),
                    closed: AtomicBool::new(false),
                    super_fragments: AtomicU64::new(0),
                    rail_super_fragments: (0..rails.max(1)).map(|_| AtomicU64::new(0)).collect(),
                    fragments: AtomicU64::new(0),
                    declared_fragments: AtomicU64::new(u64::MAX),
                    budgets: (0..rails.max(1))
                        .map(|_| Arc::new(Budget::new(per_link / rails.max(1) as u64)))
                        .collect(),
                    error: Mutex::new(None),
                })
                .collect(),
            events_complete: AtomicU64::new(0),
            events_incomplete: AtomicU64::new(0),
            fragments_in_complete: AtomicU64::new(0),
            fragments_in_incomplete: AtomicU64::new(0),
            bytes_built: AtomicU64::new(0),
            late_fragments: AtomicU64::new(0),
            stall_releases: AtomicU64::new(0),
            duplicate_fragments: AtomicU64::new(0),
            malformed_fragments: AtomicU64::new(0),
            held_fragments: AtomicU64::new(0),
            reserved_bytes: AtomicU64::new(0),
            pending_events: AtomicU64::new(0),
            queued_fragments: AtomicU64::new(0),
            recorder_lost: AtomicU64::new(0),
            recorder_error: Mutex::new(None),
            recorder_relinks: AtomicU64::new(0),
            events_resent: AtomicU64::new(0),
            refused_connections: AtomicU64::new(0),
            last_event: AtomicU64::new(0),
            missing_by_source: Mutex::new(Default::default()),
            events_rejected: AtomicU64::new(0),
            fragments_rejected: AtomicU64::new(0),
            events_rebuilt: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            overdue_requests: AtomicU64::new(0),
            events_in_flight: AtomicU64::new(0),
            manager_error: Mutex::new(None),
            manager_losses: AtomicU64::new(0),
            latency: Histogram::default(),
            receive_queues: Default::default(),
            recent_incomplete: Mutex::new(RecentIncomplete::default()),
        }
    }

    pub fn buffer_use(&self) -> (u64, u64) {
        self.links
            .iter()
            .fold((0, 0), |(u, l), x| (u + x.used(), l + x.limit()))
    }

    pub fn busy_ns(&self) -> u64 {
        self.links.iter().map(|l| l.busy_ns()).sum()
    }
}

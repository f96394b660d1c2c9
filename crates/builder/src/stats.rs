//! The builder unit's live counters.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use tessera_net::Budget;

#[derive(Debug)]
pub struct RuLinkStats {
    pub readout_unit: u32,
    pub connected: AtomicBool,
    pub super_fragments: AtomicU64,
    pub fragments: AtomicU64,
    /// Fragments the readout unit declared in its end message (u64::MAX: none yet).
    pub declared_fragments: AtomicU64,
    pub budget: Arc<Budget>,
    pub error: Mutex<Option<String>>,
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
    pub duplicate_fragments: AtomicU64,
    /// Fragments in super-fragments that contradicted themselves.
    pub malformed_fragments: AtomicU64,
    /// Fragments held in events being assembled.
    pub held_fragments: AtomicU64,
    pub pending_events: AtomicU64,
    /// Fragments of built events not yet written to the recorder.
    pub queued_fragments: AtomicU64,
    pub recorder_lost: AtomicU64,
    pub recorder_error: Mutex<Option<String>>,
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
    /// Request mode: events assigned and not yet done.
    pub events_in_flight: AtomicU64,
    pub manager_error: Mutex<Option<String>>,
}

impl BuilderStats {
    pub fn new(id: u16, rus: impl Iterator<Item = u32>, per_link: u64) -> BuilderStats {
        BuilderStats {
            id,
            links: rus
                .map(|r| RuLinkStats {
                    readout_unit: r,
                    connected: AtomicBool::new(false),
                    super_fragments: AtomicU64::new(0),
                    fragments: AtomicU64::new(0),
                    declared_fragments: AtomicU64::new(u64::MAX),
                    budget: Arc::new(Budget::new(per_link)),
                    error: Mutex::new(None),
                })
                .collect(),
            events_complete: AtomicU64::new(0),
            events_incomplete: AtomicU64::new(0),
            fragments_in_complete: AtomicU64::new(0),
            fragments_in_incomplete: AtomicU64::new(0),
            bytes_built: AtomicU64::new(0),
            late_fragments: AtomicU64::new(0),
            duplicate_fragments: AtomicU64::new(0),
            malformed_fragments: AtomicU64::new(0),
            held_fragments: AtomicU64::new(0),
            pending_events: AtomicU64::new(0),
            queued_fragments: AtomicU64::new(0),
            recorder_lost: AtomicU64::new(0),
            recorder_error: Mutex::new(None),
            refused_connections: AtomicU64::new(0),
            last_event: AtomicU64::new(0),
            missing_by_source: Mutex::new(Default::default()),
            events_rejected: AtomicU64::new(0),
            fragments_rejected: AtomicU64::new(0),
            events_rebuilt: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            events_in_flight: AtomicU64::new(0),
            manager_error: Mutex::new(None),
        }
    }

    pub fn buffer_use(&self) -> (u64, u64) {
        self.links.iter().fold((0, 0), |(u, l), x| {
            (u + x.budget.used(), l + x.budget.limit())
        })
    }

    pub fn busy_ns(&self) -> u64 {
        self.links
            .iter()
            .map(|l| l.budget.busy_ns.load(std::sync::atomic::Ordering::Relaxed))
            .sum()
    }
}

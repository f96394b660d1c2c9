//! The live status line: events/s, built MB/s, busy and buffer occupancy per stage.

use std::io::{IsTerminal, Write};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::report::human_bytes;
use crate::{Running, StatusMode};

pub struct Status {
    mode: StatusMode,
    tty: bool,
    every: Duration,
    last: Option<Instant>,
    last_events: u64,
    last_bytes: u64,
    last_busy: u64,
    last_offered: u64,
    last_vetoed: u64,
    /// Each emulated source's time held by back-pressure at the last line, nanoseconds.
    last_held: Vec<u64>,
    dirty: bool,
    /// The shipper's backlog goes on the line.
    pub shipper: Option<std::sync::Arc<tessera_shipper::ShipperService>>,
}

impl Status {
    pub fn new(mode: StatusMode, every: Duration) -> Status {
        Status {
            mode,
            tty: std::io::stderr().is_terminal(),
            every,
            last: None,
            last_events: 0,
            last_bytes: 0,
            last_busy: 0,
            last_offered: 0,
            last_vetoed: 0,
            last_held: Vec::new(),
            dirty: false,
            shipper: None,
        }
    }

    pub fn note(&mut self, msg: &str) {
        if self.mode == StatusMode::Off {
            return;
        }
        self.clear();
        eprintln!("{msg}");
    }

    fn clear(&mut self) {
        if self.dirty && self.tty && self.mode == StatusMode::Auto {
            eprint!("\r\x1b[2K");
            self.dirty = false;
        }
    }

    pub fn tick(&mut self, r: &Running, elapsed: Duration, phase: &str) {
        if self.mode == StatusMode::Off {
            return;
        }
        let now = Instant::now();
        let dt = match self.last {
            Some(t) if now - t < self.every => return,
            Some(t) => (now - t).as_secs_f64(),
            None => {
                self.last = Some(now);
                return;
            }
        };
        self.last = Some(now);
        let events: u64 = r
            .builders
            .iter()
            .map(|b| {
                b.stats.events_complete.load(Ordering::Relaxed)
                    + b.stats.events_incomplete.load(Ordering::Relaxed)
            })
            .sum();
        let incomplete: u64 = r
            .builders
            .iter()
            .map(|b| b.stats.events_incomplete.load(Ordering::Relaxed))
            .sum();
        let bytes: u64 = r
            .builders
            .iter()
            .map(|b| b.stats.bytes_built.load(Ordering::Relaxed))
            .sum();
        let links: usize = r.readout_units.iter().map(|u| u.stats.links.len()).sum();
        let busy: u64 = r.readout_units.iter().map(|u| u.stats.busy_ns()).sum();
        // Fragments cleared unsent (the rest of events a filter rejected) are decisions, not
        // errors: shown apart.
        let unsent = tessera_readout::Rejection::ClearedUnsent.index();
        let (rejected, cleared_unsent): (u64, u64) = r
            .readout_units
            .iter()
            .flat_map(|u| u.stats.links.iter())
            .map(|l| {
                let u = l.rejected[unsent].load(Ordering::Relaxed);
                (l.rejected_total() - u, u)
            })
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        let filtered: u64 = r
            .builders
            .iter()
            .map(|b| b.stats.events_rejected.load(Ordering::Relaxed))
            .sum();
        // Request mode: the occupancy that matters is the paged buffers', not the read chunks'.
        let (ru_used, ru_lim) = r
            .readout_units
            .iter()
            .map(|u| {
                let q = &u.stats.requests;
                let total = q.total_pages.load(Ordering::Relaxed);
                if total > 0 {
                    (
                        total - q.free_pages.load(Ordering::Relaxed).min(total),
                        total,
                    )
                } else {
                    u.stats.buffer_use()
                }
            })
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        let (bu_used, bu_lim) = r
            .builders
            .iter()
            .map(|b| b.stats.buffer_use())
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        let busy_pct =
            100.0 * (busy - self.last_busy.min(busy)) as f64 / 1e9 / dt / links.max(1) as f64;
        let line = format!(
            "[{:>6.1}s] {phase:<8} events {events} ({:.0}/s)  built {}/s  RU busy {:.0}%  buffers RU {:.0}% BU {:.0}%  incomplete {incomplete}  rejected {rejected}",
            elapsed.as_secs_f64(),
            (events - self.last_events.min(events)) as f64 / dt,
            human_bytes((bytes - self.last_bytes.min(bytes)) as f64 / dt),
            busy_pct.min(100.0),
            pct(ru_used, ru_lim),
            pct(bu_used, bu_lim),
        );
        // Dead time over the interval and the run, by the rule the dashboard, `/metrics` and
        // the report use: the larger of the triggers vetoed and the most-held source's time.
        let line = match &r.sources {
            Some(src) => {
                let t = &src.trigger;
                let offered = t.offered.load(Ordering::Relaxed);
                let vetoed = t.vetoed.load(Ordering::Relaxed);
                let held: Vec<u64> = src
                    .stats
                    .iter()
                    .map(|x| x.held_ns.load(Ordering::Relaxed))
                    .collect();
                let secs = elapsed.as_secs_f64();
                let veto = t.policy == "veto";
                let interval = crate::live::dead_time_fraction(
                    veto.then(|| {
                        (
                            offered - self.last_offered.min(offered),
                            vetoed - self.last_vetoed.min(vetoed),
                        )
                    }),
                    held.iter().enumerate().map(|(i, h)| {
                        let then = self.last_held.get(i).copied().unwrap_or(0);
                        h.saturating_sub(then) as f64 / 1e9 / dt
                    }),
                );
                let run = crate::live::dead_time_fraction(
                    veto.then_some((offered, vetoed)),
                    held.iter()
                        .filter(|_| secs > 0.0)
                        .map(|h| *h as f64 / 1e9 / secs),
                );
                let o = offered - self.last_offered.min(offered);
                self.last_offered = offered;
                self.last_vetoed = vetoed;
                self.last_held = held;
                if veto {
                    format!(
                        "{line}  trigger {:.0}/s offered, dead {:.0}% (run {:.1}%, vetoed {vetoed})",
                        o as f64 / dt,
                        100.0 * interval,
                        100.0 * run,
                    )
                } else {
                    format!(
                        "{line}  dead {:.0}% (run {:.1}%)",
                        100.0 * interval,
                        100.0 * run
                    )
                }
            }
            _ => line,
        };
        let line = match &r.manager {
            Some(m) => {
                let v = m.view();
                format!(
                    "{line}  filtered out {filtered} events ({cleared_unsent} fragments never moved)  in flight {} (oldest {:.1}s){}",
                    v.in_flight,
                    v.oldest_age_s,
                    if v.busy { "  EM BUSY: no builder credit" } else { "" }
                )
            }
            None => line,
        };
        let busy_now: Vec<String> = r
            .readout_units
            .iter()
            .filter(|u| u.stats.busy())
            .map(|u| u.stats.id.to_string())
            .collect();
        let line = if busy_now.is_empty() {
            line
        } else {
            format!("{line}  BUSY: RU {}", busy_now.join(","))
        };
        // The disk alarm: below the soft watermark writes pause, below the hard one the run stops.
        let line = match &r.recorder {
            Some(rec) if rec.stats.disk_full.load(Ordering::Relaxed) => format!(
                "{line}  DISK FULL ({} free): stopping",
                human_bytes(rec.stats.disk_free.load(Ordering::Relaxed) as f64)
            ),
            Some(rec) if rec.stats.disk_low.load(Ordering::Relaxed) => format!(
                "{line}  DISK LOW ({} free)",
                human_bytes(rec.stats.disk_free.load(Ordering::Relaxed) as f64)
            ),
            _ => line,
        };
        let line = match &self.shipper {
            Some(s) => format!("{line}  {}", s.status().line()),
            None => line,
        };
        self.last_events = events;
        self.last_bytes = bytes;
        self.last_busy = busy;
        if self.tty && self.mode == StatusMode::Auto {
            eprint!("\r\x1b[2K{line}");
            let _ = std::io::stderr().flush();
            self.dirty = true;
        } else {
            eprintln!("{line}");
        }
    }

    pub fn finish(&mut self, _r: &Running, _elapsed: Duration) {
        self.clear();
    }
}

fn pct(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        100.0 * a as f64 / b as f64
    }
}

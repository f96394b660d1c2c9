//! Runnable time: the time this process could run, for every timeout that judges a peer.
//!
//! A peer is silent, dead or late only for time in which this process was there to hear it.
//! When the process itself does not run (the host stalled, the VM was paused, the process was
//! stopped, or it waited for a core on a busy host), a read after it finds the socket empty and
//! the clock says seconds have passed: a unit on the same host that stalled with it, or one
//! whose bytes are still on their way, would be called silent for time nobody ran (2 811 events
//! built incomplete after a 12 s host stall). So the roles measure their timeouts in runnable
//! time: wall time less every stall this process saw.
//!
//! A stall is seen by a watcher thread that wakes every [`TICK`]: a wake later than [`TICK`] +
//! [`SLACK`] after the previous one means the process did not run (or its watcher waited for a
//! core) for the difference, and that much is left out from then on. Any reading of the clock
//! looks for such a gap too, so that a thread that wakes from a stall before the watcher does
//! already reads the clock without it. Left out wrongly (the watcher alone waited), a stall only
//! makes timeouts later in wall time: dead time, never loss.

use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How often the watcher wakes.
pub const TICK: Duration = Duration::from_millis(5);
/// How much later than its tick the watcher may wake before the gap counts as a stall.
pub const SLACK: Duration = Duration::from_millis(20);
/// Stalls remembered one by one, for instants of the past (older ones are summed).
const REMEMBERED: usize = 1024;

struct Clock {
    epoch: Instant,
    /// The watcher's last wake, or the last reading that looked (ns from `epoch`).
    last: AtomicU64,
    /// Every stall so far, in ns: runnable time now is wall time less this.
    stalled: AtomicU64,
    stalls: Mutex<Stalls>,
}

#[derive(Default)]
struct Stalls {
    /// (start, end) of recent stalls, in wall ns from the epoch, oldest first.
    recent: VecDeque<(u64, u64)>,
    /// Stall time of those forgotten.
    forgotten_ns: u64,
}

fn clock() -> &'static Clock {
    static CLOCK: OnceLock<&'static Clock> = OnceLock::new();
    CLOCK.get_or_init(|| {
        let c: &'static Clock = Box::leak(Box::new(Clock {
            epoch: Instant::now(),
            last: AtomicU64::new(0),
            stalled: AtomicU64::new(0),
            stalls: Mutex::new(Stalls::default()),
        }));
        let _ = std::thread::Builder::new()
            .name("stall-watch".into())
            .spawn(move || loop {
                std::thread::sleep(TICK);
                c.look(c.wall_ns(Instant::now()));
            });
        c
    })
}

impl Clock {
    fn wall_ns(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.epoch).as_nanos() as u64
    }

    /// Notes `now` (wall ns) as a moment the process ran; a gap since the last one longer than
    /// a tick and its slack is a stall.
    fn look(&self, now: u64) {
        let last = self.last.load(Ordering::Acquire);
        if now <= last {
            return;
        }
        let tick = TICK.as_nanos() as u64;
        if now - last <= tick + SLACK.as_nanos() as u64 {
            self.last.fetch_max(now, Ordering::AcqRel);
            return;
        }
        let mut s = self.stalls.lock();
        // Another reader may have taken this gap meanwhile.
        let last = self.last.load(Ordering::Acquire);
        if now <= last || now - last <= tick + SLACK.as_nanos() as u64 {
            self.last.fetch_max(now, Ordering::AcqRel);
            return;
        }
        let start = last + tick;
        if s.recent.len() == REMEMBERED {
            if let Some((a, b)) = s.recent.pop_front() {
                s.forgotten_ns += b - a;
            }
        }
        s.recent.push_back((start, now));
        self.stalled.fetch_add(now - start, Ordering::AcqRel);
        self.last.store(now, Ordering::Release);
    }

    /// Runnable ns at wall ns `t` (stalls up to then left out; inside one, its start).
    fn runnable_at(&self, t: u64) -> u64 {
        let s = self.stalls.lock();
        let mut left_out = s.forgotten_ns;
        for &(a, b) in &s.recent {
            if a >= t {
                break;
            }
            left_out += b.min(t) - a;
        }
        t.saturating_sub(left_out)
    }
}

/// Runnable time as one role counts it: from its start, in ns.
#[derive(Clone, Copy, Debug)]
pub struct Runnable {
    t0: Instant,
    /// Runnable ns (from the process's epoch) at `t0`.
    t0_ns: u64,
}

impl Default for Runnable {
    fn default() -> Self {
        Runnable::start()
    }
}

impl Runnable {
    /// A clock starting now (the watcher starts with the first).
    pub fn start() -> Runnable {
        let t0 = Instant::now();
        let c = clock();
        c.look(c.wall_ns(t0));
        Runnable {
            t0,
            t0_ns: c.runnable_at(c.wall_ns(t0)),
        }
    }

    /// The wall-clock instant it started.
    pub fn started(&self) -> Instant {
        self.t0
    }

    /// Runnable ns since the start.
    pub fn now_ns(&self) -> u64 {
        let c = clock();
        let now = c.wall_ns(Instant::now());
        c.look(now);
        now.saturating_sub(c.stalled.load(Ordering::Acquire))
            .saturating_sub(self.t0_ns)
    }

    /// Runnable ns from the start to `t`, an instant taken earlier (a read's start, say).
    pub fn ns_at(&self, t: Instant) -> u64 {
        let c = clock();
        c.look(c.wall_ns(Instant::now()));
        c.runnable_at(c.wall_ns(t)).saturating_sub(self.t0_ns)
    }
}

/// Stall time this process has seen, in ns (for reports and tests).
pub fn stalled_ns() -> u64 {
    clock().stalled.load(Ordering::Acquire)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gap_is_left_out_of_every_later_reading_and_of_instants_after_it() {
        let c = Clock {
            epoch: Instant::now(),
            last: AtomicU64::new(0),
            stalled: AtomicU64::new(0),
            stalls: Mutex::new(Stalls::default()),
        };
        let ms = 1_000_000u64;
        c.look(4 * ms);
        c.look(9 * ms);
        assert_eq!(c.stalled.load(Ordering::Relaxed), 0);
        // Nobody ran from 9 ms to 3 s: all but one tick of it is a stall.
        c.look(3_000 * ms);
        assert_eq!(c.stalled.load(Ordering::Relaxed), 3_000 * ms - 14 * ms);
        assert_eq!(c.runnable_at(5 * ms), 5 * ms);
        // Inside the stall: its start.
        assert_eq!(c.runnable_at(1_000 * ms), 14 * ms);
        assert_eq!(c.runnable_at(3_010 * ms), 24 * ms);
        // The same gap seen twice is counted once.
        c.look(3_000 * ms);
        assert_eq!(c.stalled.load(Ordering::Relaxed), 3_000 * ms - 14 * ms);
    }
}
